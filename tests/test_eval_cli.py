"""`dlm eval` end to end on a tiny model, generation tasks with a controlled generator, and the history."""

import json

import pytest

from dlm.cli import main
from dlm.decode.configs import ISDConfig
from dlm.decode.options import EngineOptions
from dlm.eval import EvalSettings, append_history, read_history, run_eval
from dlm.eval.history import format_history_table
from dlm.eval.scoring import encode_pair
from dlm.testing import make_model, make_tokenizer


def test_dlm_eval_writes_table_and_json(tiny_model_dir, task_data, tmp_path, capsys):
    model = tiny_model_dir("llama")
    out = tmp_path / "r.json"
    rc = main(
        [
            "eval",
            "--model",
            str(model),
            "--eval-tasks",
            "piqa,winogrande",
            "--data-dir",
            task_data,
            "--limit",
            "4",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "accuracy" in printed and "piqa" in printed and "acc_norm" in printed
    res = json.loads(out.read_text())["results"]
    assert res["piqa"]["n"] == 4 and res["piqa"]["scoring"] == "causal"
    assert res["piqa"]["acc"] in (0, 0.25, 0.5, 0.75, 1.0)
    # bad input: a clear one-line error, exit 2, nothing written
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n')
    assert main(["eval", "--model", str(model), "--eval-tasks", "siqa", "--siqa-path", str(bad)]) == 2
    assert "expected JSONL records with fields context, question" in capsys.readouterr().err


def test_generation_tasks_with_controlled_generator(task_data):
    """LAMBADA counts each exact hit once; poem reversal is a substring match."""
    tok = make_tokenizer()
    model = make_model("llama")

    def oracle(em, prompts, lengths, **kw):  # returns the target tokens for even items, garbage for odd ones
        outs = []
        for i, (_p, n) in enumerate(zip(prompts, lengths)):
            outs.append(targets[i] if i % 2 == 0 else tok("zz", add_special_tokens=False)["input_ids"][:1] * n)
        return outs

    from dlm.eval.scoring import as_eval_model
    from dlm.eval.tasks import load_task

    em = as_eval_model(model, tok)
    ex = load_task("lambada", task_data)[:6]
    targets = [encode_pair(em, e.prompt, " " + e.target)[1] for e in ex]
    r = run_eval(model, "lambada", EvalSettings(data_dir=task_data, limit=6), tokenizer=tok, generate_fn=oracle)
    assert r["lambada"]["acc"] == 0.5
    poems = load_task("poem_reverse", task_data)[:4]
    targets = [tok("前言 " + e.target + " 后记", add_special_tokens=False)["input_ids"] for e in poems]
    r = run_eval(model, "poem_reverse", EvalSettings(data_dir=task_data, limit=4), tokenizer=tok, generate_fn=oracle)
    assert r["poem_reverse"]["acc"] == 0.5


def test_diffusion_model_generation_runs(task_data):
    from dlm.model.convert import convert_ar_to_dlm

    for objective, decoder in (("mdm", "mdm"), ("block", "block"), ("idlm", "isd")):
        dlm = convert_ar_to_dlm(make_model("llama"), objective, tokenizer=make_tokenizer())
        r = run_eval(dlm, "lambada", EvalSettings(data_dir=task_data, limit=2, keep_predictions=True))
        assert r["lambada"]["decode"] == decoder and r["lambada"]["n"] == 2
        assert all(isinstance(p["output"], str) for p in r["lambada"]["predictions"])


def test_history_table_and_plot(tmp_path, capsys):
    h1, h2 = tmp_path / "a" / "eval_history.jsonl", tmp_path / "b" / "eval_history.jsonl"
    append_history(h1, 500, "step_00000500", {"piqa": {"acc": 0.55, "acc_stderr": 0.03, "n": 200}})
    append_history(h1, 1000, "step_00001000", {"piqa/acc": 0.6, "heldout/loss": 2.5})
    append_history(h2, 500, "step_00000500", {"piqa/acc": 0.52})
    rec = read_history([h1])
    assert rec[0]["metrics"] == {"piqa/acc": 0.55, "piqa/acc_stderr": 0.03}
    assert set(rec[0]) >= {"step", "checkpoint", "time", "metrics"}
    table = format_history_table(rec)
    lines = table.splitlines()
    assert "step_00000500" in lines[0] and "step_00001000" in lines[0]
    assert lines[2].split() == ["piqa/acc", "0.5500", "0.6000"]
    assert lines[3].split() == ["heldout/loss", "-", "2.5000"]
    png = tmp_path / "curves.png"
    assert main(["eval", "--history-paths", str(h1), str(h2), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "a:step_00000500" in capsys.readouterr().out
    (tmp_path / "junk.jsonl").write_text("not json\n")
    assert main(["eval", "--history-paths", str(tmp_path / "junk.jsonl")]) == 2


# -- isd_acceptance: an I-DLM's drafting quality -----------------------------------------------------------------
def _idlm(seed=1, block_size=1):
    from dlm.model.convert import convert_ar_to_dlm

    return convert_ar_to_dlm(make_model("llama", seed=seed), "idlm", block_size=block_size, tokenizer=make_tokenizer())


def test_isd_acceptance_matches_the_engine_and_checks_exactness(tmp_path):
    """The task's figures are the ISD engine's own counts on the same prompts, and ISD output == greedy AR."""
    from dlm.decode import generate
    from dlm.decode.sampling import SamplingParams
    from dlm.eval.generation import _prompt_ids
    from dlm.eval.scoring import as_eval_model
    from dlm.eval.tasks import load_task

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"tell me about item {i}"},
                        {"role": "assistant", "content": "ok"},
                    ]
                }
            )
            + "\n"
            for i in range(5)
        )
    )
    dlm = _idlm(block_size=2)
    r = run_eval(
        dlm,
        "isd_acceptance",
        EvalSettings(
            paths={"isd_acceptance": str(prompts)}, decoder=ISDConfig(stride=3), batch_size=3, keep_predictions=True
        ),
    )["isd_acceptance"]
    ex = load_task("isd_acceptance", paths={"isd_acceptance": str(prompts)})
    assert [e.prompt for e in ex] == [f"tell me about item {i}" for i in range(5)]
    em = as_eval_model(dlm)
    direct = generate(
        dlm,
        [_prompt_ids(em, e) for e in ex],
        ISDConfig(stride=3, draft_budget="always"),  # the task drafts at every step, whatever the config's policy
        [SamplingParams(max_new_tokens=64, temperature=0.0)] * 5,
        options=EngineOptions(max_batch_size=3),
    )
    prop = [sum(x.stats.proposed[i] for x in direct) for i in range(2)]
    acc = [sum(x.stats.accepted[i] for x in direct) for i in range(2)]
    assert r["stride"] == 3 and r["n"] == 5 and r["drafts"] == prop
    assert r["acceptance"] == [a / p for a, p in zip(acc, prop)]
    assert r["acc"] == r["acceptance"][0] and r["acc_pos2"] == r["acceptance"][1]
    assert r["tpf"] == sum(len(x.token_ids) for x in direct) / sum(x.stats.forwards for x in direct)
    assert r["identical"] == 1.0 and all(p["identical_to_ar"] for p in r["predictions"])
    # with draft candidates: the engine's counts again, stride 2, output still AR's
    k3 = run_eval(
        dlm,
        "isd_acceptance",
        EvalSettings(paths={"isd_acceptance": str(prompts)}, decoder=ISDConfig(candidates=3), batch_size=3),
    )
    k3 = k3["isd_acceptance"]
    direct = generate(
        dlm,
        [_prompt_ids(em, e) for e in ex],
        ISDConfig(candidates=3, draft_budget="always"),
        [SamplingParams(max_new_tokens=64, temperature=0.0)] * 5,
        options=EngineOptions(max_batch_size=3),
    )
    assert k3["stride"] == 2 and k3["candidates"] == 3 and k3["identical"] == 1.0
    assert k3["drafts"] == [sum(x.stats.proposed[0] for x in direct)]
    assert k3["acc"] == sum(x.stats.accepted[0] for x in direct) / k3["drafts"][0]


def test_isd_acceptance_of_a_perfect_drafter_is_one():
    """A model whose every position (masks included) predicts the same token: each draft is accepted, N=2 commits
    two tokens per verify step."""
    import torch

    dlm = _idlm(block_size=1)
    hf = dlm.base_model_hf
    with torch.no_grad():
        hf.model.norm.weight.zero_()  # hidden states -> 0, so the logits are the hook's bias alone
    bias = torch.zeros(hf.config.vocab_size)
    bias[42] = 5.0
    hf.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    r = run_eval(dlm, "isd_acceptance", EvalSettings(limit=3))["isd_acceptance"]  # the built-in held-out instructions
    assert r["acc"] == 1.0 and r["identical"] == 1.0 and r["stride"] == 2
    # 64 tokens: the prefill commits 1 and drafts, then every forward commits 2 -> 1 + 32 forwards (the last one
    # commits only the 64th token's share) - TPF well above 1.9
    assert 1.9 < r["tpf"] <= 2.0


def test_isd_acceptance_data_and_bad_input(tmp_path, capsys):
    from dlm.data.distill import builtin_instructions
    from dlm.errors import DLMError
    from dlm.eval.tasks import load_task

    builtin = load_task("isd_acceptance")
    assert [e.prompt for e in builtin] == builtin_instructions("heldout") and len(builtin) == 320
    assert all(e.chat and e.max_new_tokens == 64 for e in builtin)
    (tmp_path / "isd_acceptance").mkdir()
    (tmp_path / "isd_acceptance" / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    assert [e.prompt for e in load_task("isd_acceptance", tmp_path)] == ["first prompt", "second prompt"]
    jl = tmp_path / "q.jsonl"
    jl.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [e.prompt for e in load_task("isd_acceptance", paths={"isd_acceptance": str(jl)})] == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt here"}\n')
    with pytest.raises(DLMError, match="known isd_acceptance layout"):
        load_task("isd_acceptance", paths={"isd_acceptance": str(bad)})
    with pytest.raises(DLMError, match="measures the drafts of an I-DLM"):
        run_eval(make_model("llama"), "isd_acceptance", EvalSettings(limit=1), tokenizer=make_tokenizer())
    from dlm.model.convert import convert_ar_to_dlm

    with pytest.raises(DLMError, match="'mdm' model"):
        run_eval(
            convert_ar_to_dlm(make_model("llama"), "mdm", tokenizer=make_tokenizer()),
            "isd_acceptance",
            EvalSettings(limit=1),
        )
    # the CLI: a table with TPF and the exactness row; a bad file is a one-line error, exit 2
    model = tmp_path / "idlm"
    _idlm(block_size=1).save_pretrained(model)
    assert main(["eval", "--model", str(model), "--eval-tasks", "isd_acceptance", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "isd_acceptance acc" in out and "isd_acceptance tpf" in out and "isd_acceptance identical    1.0000" in out
    assert (
        main(["eval", "--model", str(model), "--eval-tasks", "isd_acceptance", "--limit", "1", "--isd-candidates", "2"])
        == 0
    )
    assert "isd_acceptance: N=2 K=2 acceptance" in capsys.readouterr().out
    assert (
        main(
            ["eval", "--model", str(model), "--eval-tasks", "isd_acceptance", "--stride", "3", "--isd-candidates", "2"]
        )
        == 2
    )
    assert "runs at --stride 2 only" in capsys.readouterr().err
    assert (
        main(["eval", "--model", str(model), "--eval-tasks", "isd_acceptance", "--isd-acceptance-path", str(bad)]) == 2
    )
    assert "expected JSONL chat records" in capsys.readouterr().err
