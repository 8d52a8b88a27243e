"""The quickstart pipeline end to end on a tiny model, and its bad-input messages."""

import json

import pytest

from dlm.cli import main


def _args(model, out, *extra):
    return [
        "quickstart",
        "--model",
        str(model),
        "--output",
        str(out),
        "--num-instructions",
        "6",
        "--answer-tokens",
        "8",
        "--eval-prompts",
        "3",
        "--eval-tokens",
        "12",
        "--batch-size",
        "2",
        "--seq-length",
        "64",
        "--lora-r",
        "4",
        *extra,
    ]


@pytest.mark.integration
def test_quickstart_end_to_end_tiny(tiny_model_dir, tmp_path, capsys):
    model = tiny_model_dir("llama")
    out = tmp_path / "qs"
    assert main(_args(model, out, "--minutes", "0.05", "--curriculum", "1,2", "--strides", "2,3")) == 0
    results = json.loads((out / "results.json").read_text())
    rows = {(r["decoder"], r["stride"], r["candidates"]): r for r in results["rows"] if "policy" not in r}
    # gated LoRA keeps the clean path = the base model, so greedy ISD output equals the base model's generate,
    # with draft candidates too (the default K = 3 row at stride 2)
    assert set(rows) == {("ar", None, None), ("isd", 2, 1), ("isd", 3, 1), ("isd", 2, 3)}
    # the drafting policy's row (the server's default, at the model's own stride 3): what it measured and chose
    auto = [r for r in results["rows"] if "policy" in r]
    assert len(auto) == 1 and auto[0]["stride"] == 3 and auto[0]["identical_to_base"] == "3/3"
    assert auto[0]["policy"]["draft"] + auto[0]["policy"]["ar"] > 0
    for key in rows:
        assert rows[key]["identical_to_base"] == "3/3", rows[key]
        assert 1.0 <= rows[key]["tpf"] <= (key[1] or 1)
        assert rows[key]["identical_to_ar"] == "3/3", rows[key]
    report = (out / "report.md").read_text()
    assert "| dlm isd | trained | 3 |" in report and "| dlm isd | trained | 2, K=3 |" in report
    assert "| dlm isd, policy auto | trained | 3 |" in report
    # it leads with ISD against the engine's own AR, and says what the policy chose on which figures
    best = max(
        (r for r in results["rows"] if r["decoder"] == "isd" and "policy" not in r), key=lambda r: r["speedup_vs_ar"]
    )
    first = report.split("| decoder |")[0]
    assert "**ISD against `dlm ar`**" in first and f"**{best['speedup_vs_ar']:.2f}x** `dlm ar`" in first
    assert "The drafting policy (`--isd-draft-budget auto`" in first and "decode steps" in first
    # what each curriculum stage did, read back from its training log (steps depend on the machine)
    stages = results["training"]
    assert [st["block_size"] for st in stages] == [1, 2] and all(st["finished"] for st in stages)
    for st in stages:
        log = (out / f"train_b{st['block_size']}" / "train_log.jsonl").read_text().splitlines()
        last = [json.loads(x) for x in log if '"loss"' in x][-1]
        assert st["steps"] == last["step"] >= 1 and st["tokens"] > 0 and 0.0 <= st["train_agreement_last50"] <= 1.0
        assert f"Training b{st['block_size']}: {st['steps']} optimizer steps" in report
        assert st["precision"] == "fp32" and "s/step, fp32)" in report  # the tests pin fp32 (conftest)
    assert (out / "data" / "self_distill.jsonl").is_file()
    assert (out / "train_b1" / "DONE").is_file() and (out / "train_b2" / "DONE").is_file()
    cfg = json.loads((out / "train_b2" / "config.json").read_text())
    assert cfg["block_size"] == 2 and cfg["dlm_objective"] == "idlm"
    # a rerun reuses the finished stages instead of redoing them
    capsys.readouterr()
    assert main(_args(model, out, "--minutes", "0.05", "--curriculum", "1,2", "--strides", "2")) == 0
    log = capsys.readouterr().out
    assert "reusing" in log and "already done" in log


@pytest.mark.integration
def test_quickstart_merged_adapters_tiny(tiny_model_dir, tmp_path, capsys):
    """--adapters merged: plain LoRA on every position, merged at each stage's end; ISD must equal the trained
    model's own greedy AR output (not the base model's, which it may leave)."""
    model = tiny_model_dir("llama")
    out = tmp_path / "qs"
    assert (
        main(
            _args(
                model,
                out,
                "--adapters",
                "merged",
                "--minutes",
                "0.05",
                "--curriculum",
                "1,2",
                "--strides",
                "2,3",
                "--learning-rate",
                "0.05",
            )
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert results["adapters"] == "merged" and results["config"]["lora_targets"] == "all-linear"
    rows = {
        (r["decoder"], r["stride"], r["model"]): r
        for r in results["rows"]
        if r["candidates"] in (None, 1) and "policy" not in r
    }
    assert set(rows) == {("ar", None, "base"), ("ar", None, "trained"), ("isd", 2, "trained"), ("isd", 3, "trained")}
    assert [r["candidates"] for r in results["rows"]].count(3) == 1  # the default K = 3 row
    assert rows[("ar", None, "base")]["identical_to_base"] == "3/3"
    for n in (2, 3):
        assert rows[("isd", n, "trained")]["identical_to_ar"] == "3/3"
    assert 0.0 <= results["base_agreement"] <= 1.0
    # the merged stages are plain model folders (no gated adapter file), and stage 2 trained its own fresh adapters
    for b in (1, 2):
        folder = out / f"train_b{b}"
        assert (folder / "DONE").is_file() and not (folder / "dlm_adapter.safetensors").exists()
        assert "dlm_gated_lora" not in json.loads((folder / "config.json").read_text())
    log = [json.loads(x) for x in (out / "train_b1" / "train_log.jsonl").read_text().splitlines() if '"loss"' in x]
    assert log and log[-1]["parts"]["ce_clean"] > 0  # CE_clean is trained (ce_alpha 1), not a frozen constant
    report = (out / "report.md").read_text()
    assert "merged LoRA" in report and "greedy AR output on 3/3 prompts" in report
    # rerunning the folder in the other mode would mix two kinds of model: refused, nothing changed
    before = (out / "results.json").read_text()
    capsys.readouterr()
    assert main(_args(model, out, "--minutes", "0.05", "--curriculum", "1,2")) == 2
    assert "--adapters merged" in capsys.readouterr().err
    assert (out / "results.json").read_text() == before


def test_quickstart_bad_adapters_mode(tmp_path, capsys):
    from dlm.errors import DLMError
    from dlm.quickstart import QuickstartConfig

    try:
        QuickstartConfig(output=str(tmp_path / "x"), adapters="fused").validate()
    except DLMError as e:
        assert "--adapters" in str(e)
    else:
        raise AssertionError("an unknown --adapters mode was accepted")
    assert QuickstartConfig().lora_targets == "q_proj,v_proj" and QuickstartConfig().lora_r == 64
    assert QuickstartConfig(adapters="merged").lora_targets == "all-linear"


def test_quickstart_bad_candidates(tmp_path, capsys):
    assert main(["quickstart", "--output", str(tmp_path / "x"), "--candidates", "1"]) == 2
    assert "--candidates takes K from 2 to 8" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_quickstart_zero_minutes_is_an_error(tmp_path, capsys):
    assert main(["quickstart", "--output", str(tmp_path / "x"), "--minutes", "0"]) == 2
    assert "--minutes" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_quickstart_unknown_data_layout(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "reply": "r"}) + "\n")
    assert main(_args(tiny_model_dir("llama"), tmp_path / "o", "--data", str(bad), "--minutes", "1")) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err


def test_quickstart_not_enough_disk(tmp_path, monkeypatch, capsys):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 2**20))
    assert main(["quickstart", "--output", str(tmp_path / "x")]) == 2
    assert "GiB free" in capsys.readouterr().err


def test_curriculum_minutes_split():
    from dlm.quickstart import QuickstartConfig, stage_minutes

    # default: b1 (the N=2 draft on every mask) gets twice each later stage's share
    assert stage_minutes(QuickstartConfig(minutes=30, curriculum=(1, 2))) == [20.0, 10.0]
    assert stage_minutes(QuickstartConfig(minutes=40, curriculum=(1, 2, 3))) == [20.0, 10.0, 10.0]
    assert stage_minutes(QuickstartConfig(minutes=30, curriculum=(1, 2), curriculum_split=(1, 1))) == [15.0, 15.0]
    assert stage_minutes(QuickstartConfig(minutes=10, curriculum=(1,))) == [10.0]


def test_base_agreement_is_one_for_an_unchanged_model_and_drops_when_weights_move(tiny_model_dir):
    """The merged mode's closeness figure: teacher-forced greedy agreement with the base model's own answers."""
    import torch

    from dlm.decode import generate
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import convert_ar_to_dlm
    from dlm.quickstart import base_agreement

    folder = tiny_model_dir("llama")
    dlm = convert_ar_to_dlm(str(folder), "idlm")
    prompts = [[5, 9, 3], [7, 1, 2, 8, 4], [11]]
    answers = [r.token_ids for r in generate(dlm, prompts, "ar", SamplingParams(max_new_tokens=12, temperature=0.0))]
    assert base_agreement(dlm, prompts, answers, torch.device("cpu")) == 1.0
    with torch.no_grad():
        for p in dlm.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert base_agreement(dlm, prompts, answers, torch.device("cpu")) < 1.0
