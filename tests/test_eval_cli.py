"""`dlm eval` end to end on a tiny model, generation tasks with a controlled generator, and the history."""

import json

import pytest

from dlm.cli import main
from dlm.eval import append_history, read_history, run_eval
from dlm.eval.history import format_history_table
from dlm.eval.scoring import encode_pair
from dlm.testing import make_model, make_tokenizer


def test_dlm_eval_writes_table_and_json(tiny_model_dir, shared_data, tmp_path, capsys):
    model = tiny_model_dir("llama")
    out = tmp_path / "r.json"
    rc = main(["eval", "--model", str(model), "--eval-tasks", "piqa,winogrande", "--data-dir", shared_data,
               "--limit", "4", "--output", str(out)])
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


def test_generation_tasks_with_controlled_generator(shared_data):
    """LAMBADA counts each exact hit once; poem reversal is a substring match."""
    tok = make_tokenizer()
    model = make_model("llama")

    def oracle(em, prompts, lengths, **kw):  # returns the target tokens for even items, garbage for odd ones
        outs = []
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            outs.append(targets[i] if i % 2 == 0 else tok("zz", add_special_tokens=False)["input_ids"][:1] * n)
        return outs

    from dlm.eval.scoring import as_eval_model
    from dlm.eval.tasks import load_task

    em = as_eval_model(model, tok)
    ex = load_task("lambada", shared_data)[:6]
    targets = [encode_pair(em, e.prompt, " " + e.target)[1] for e in ex]
    r = run_eval(model, "lambada", tokenizer=tok, data_dir=shared_data, limit=6, generate_fn=oracle)
    assert r["lambada"]["acc"] == 0.5
    poems = load_task("poem_reverse", shared_data)[:4]
    targets = [tok("前言 " + e.target + " 后记", add_special_tokens=False)["input_ids"] for e in poems]
    r = run_eval(model, "poem_reverse", tokenizer=tok, data_dir=shared_data, limit=4, generate_fn=oracle)
    assert r["poem_reverse"]["acc"] == 0.5


def test_diffusion_model_generation_runs(shared_data):
    from dlm.model.convert import convert_ar_to_dlm

    for objective, decoder in (("mdm", "mdm"), ("block", "block"), ("idlm", "isd")):
        dlm = convert_ar_to_dlm(make_model("llama"), objective, tokenizer=make_tokenizer())
        r = run_eval(dlm, "lambada", data_dir=shared_data, limit=2, keep_predictions=True)
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
