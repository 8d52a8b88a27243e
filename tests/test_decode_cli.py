"""`dlm generate` end to end on a tiny model folder."""

import json

import pytest

from dlm.cli import main


@pytest.fixture
def tiny_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def run_json(capsys, *argv):
    assert main(["generate", *argv, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_generate_json_ar_and_isd_on_the_fly(tiny_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "The quick brown fox"}\n{"prompt": "To be, or not"}\n')
    common = ["--model", str(tiny_dir), "--prompts-file", str(prompts), "--max-new-tokens", "9"]
    ar = run_json(capsys, *common, "--decode", "ar")
    isd = run_json(capsys, *common, "--decode", "isd", "--stride", "3", "--batch-size", "2")
    assert len(ar) == 2 and all({"text", "token_ids", "forwards", "tpf", "acceptance"} <= set(r) for r in ar)
    assert [r["token_ids"] for r in isd] == [r["token_ids"] for r in ar]  # untrained I-DLM, greedy: still exact
    assert all(len(r["acceptance"]) == 2 and r["forwards"] >= 1 for r in isd)
    for mode in ("all", "off"):
        other = run_json(capsys, *common, "--decode", "isd", "--stride", "3", "--isd-fallback", mode)
        assert [r["token_ids"] for r in other] == [r["token_ids"] for r in ar], mode
    assert main(["generate", *common, "--decode", "ar", "--isd-fallback", "all"]) == 2
    assert "--isd-fallback is an ISD setting" in capsys.readouterr().err
    cands = run_json(capsys, *common, "--decode", "isd", "--isd-candidates", "3")
    assert [r["token_ids"] for r in cands] == [r["token_ids"] for r in ar]
    assert main(["generate", *common, "--decode", "ar", "--isd-candidates", "2"]) == 2
    assert "--isd-candidates is an ISD setting" in capsys.readouterr().err
    assert main(["generate", *common, "--decode", "isd", "--stride", "3", "--isd-candidates", "2"]) == 2
    assert "runs at --stride 2 only" in capsys.readouterr().err
    assert main(["generate", *common, "--decode", "isd", "--isd-candidates", "0"]) == 2
    assert "--isd-candidates must be an integer from 1 to 8" in capsys.readouterr().err
    mdm = run_json(
        capsys,
        "--model",
        str(tiny_dir),
        "--prompt",
        "The cat",
        "--decode",
        "mdm",
        "--max-new-tokens",
        "5",
        "--steps",
        "3",
        "--temperature",
        "1",
        "--seed",
        "1",
    )
    assert len(mdm) == 1 and mdm[0]["forwards"] == 3


def test_generate_logprobs(tiny_dir, capsys):
    common = ["--model", str(tiny_dir), "--prompt", "The quick brown fox", "--max-new-tokens", "7", "--logprobs", "2"]
    ar = run_json(capsys, *common, "--decode", "ar")[0]
    isd = run_json(capsys, *common, "--decode", "isd", "--stride", "3")[0]
    assert [t["token_id"] for t in ar["logprobs"]] == ar["token_ids"] == isd["token_ids"]
    for a, b in zip(ar["logprobs"], isd["logprobs"]):  # ISD's tokens carry the AR model's probabilities
        assert abs(a["logprob"] - b["logprob"]) < 1e-4 and len(a["top"]) == 2 and a["top"][0][0] == a["token_id"]
        assert isinstance(a["token"], str)
    assert main(["generate", *common]) == 0
    assert "log-probability -" in capsys.readouterr().out
    assert main(["generate", *common, "--decode", "mdm"]) == 2
    assert "--logprobs: not with --decode mdm" in capsys.readouterr().err
    longer = [*common[:-4], "--max-new-tokens", "24"]
    plain = run_json(capsys, *longer, "--decode", "isd")[0]["token_ids"]
    rp = ["--repetition-penalty", "3", "--frequency-penalty", "2", "--presence-penalty", "2"]
    pen = run_json(capsys, *longer, "--decode", "isd", *rp)[0]["token_ids"]
    assert pen == run_json(capsys, *longer, "--decode", "ar", *rp)[0]["token_ids"] and pen != plain
    assert main(["generate", *longer, "--decode", "mdm", *rp]) == 2
    assert "the penalties: not with --decode mdm" in capsys.readouterr().err
    assert main(["generate", *longer, "--presence-penalty", "3"]) == 2
    assert "--presence-penalty must be in [-2, 2]" in capsys.readouterr().err
    cached = run_json(capsys, *longer, "--decode", "isd", "--prefix-cache-tokens", "0")[0]["token_ids"]
    assert cached == plain  # the prefix cache (on by default) changes nothing in the output
    assert main(["generate", *longer, "--prefix-cache-tokens", "-1"]) == 2
    assert "--prefix-cache-tokens must be an integer >= 0" in capsys.readouterr().err
    assert main(["generate", *common[:-1], "21"]) == 2
    assert "logprobs must be an integer in 0..20" in capsys.readouterr().err


def test_generate_text_output_and_errors(tiny_dir, tmp_path, capsys):
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "The cat", "--max-new-tokens", "4", "--chat"]) == 0
    out = capsys.readouterr().out
    assert "forwards" in out and "TPF" in out and "tokens/s" in out
    assert main(["generate", "--model", str(tiny_dir), "--prompts-file", str(tmp_path / "none.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "x " * 600]) == 2
    assert "context" in capsys.readouterr().err


def test_generate_structured_outputs(tiny_dir, tmp_path, capsys):
    pytest.importorskip("llguidance")
    common = ["--model", str(tiny_dir), "--prompt", "The cat", "--max-new-tokens", "40"]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    ar = run_json(capsys, *common, "--json-schema", str(tmp_path / "s.json"), "--compact-json")[0]
    isd = run_json(capsys, *common, "--json-schema", json.dumps(schema), "--compact-json", "--decode", "isd")[0]
    assert ar["token_ids"] == isd["token_ids"] and ar["finish_reason"] == "stop"
    assert isinstance(json.loads(ar["text"])["n"], int)
    for flags, ok in [
        (["--regex", "[0-9]{3}"], lambda t: t.isdigit() and len(t) == 3),
        (["--choice", "yes", "--choice", "no"], lambda t: t in ("yes", "no")),
        (["--json-object"], lambda t: t.startswith("{")),  # a random model's object may not close in 40 tokens
        (["--grammar", 'start: "a" "b"+'], lambda t: t[0] == "a" and set(t[1:]) == {"b"}),
    ]:
        out = run_json(capsys, *common, "--decode", "isd", "--temperature", "1", *flags)[0]
        assert ok(out["text"]), (flags, out["text"])
    for flags, message in [
        (["--regex", "("], "--regex: the regex of the structured output is invalid"),
        (["--json-schema", "missing.json"], "--json-schema 'missing.json' is no file"),
        (["--json-schema", "{nope"], "--json-schema: the JSON schema is not valid JSON"),
        (["--compact-json"], "--compact-json needs --json-schema or --json-object"),
        (["--choice", "a", "--decode", "mdm"], "a structured output: not with --decode mdm"),
    ]:
        assert main(["generate", *common, *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags


@pytest.mark.integration
def test_generate_in_a_pipe_prints_no_loading_bars(tiny_dir):
    """Run as a command whose stderr is a pipe (a log, CI), `dlm generate` prints its answer and no progress bar -
    transformers' "Loading weights" bars included."""
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "dlm.cli", "generate", "--model", str(tiny_dir), "--prompt", "The cat"],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tokens/s" in run.stdout
    assert "Loading weights" not in run.stderr and "%|" not in run.stderr, run.stderr[-2000:]


def test_generate_verbose_says_which_path_each_layer_kind_takes(tiny_dir, capsys, monkeypatch, tmp_path):
    from dlm.decode import cpu

    if cpu.extension() is None:
        pytest.skip("the CPU kernels could not be built here")
    monkeypatch.setenv(cpu.ENV, "auto")
    monkeypatch.setenv("DLM_HOME", str(tmp_path))
    argv = ["generate", "--model", str(tiny_dir), "--prompt", "Hi", "--max-new-tokens", "2", "--decode", "ar"]
    assert main([*argv, "-v"]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("dlm generate: CPU kernels: "))
    assert "median of" in line and "q_proj" in line and "lm_head" in line and "at 1 row" in line
    assert main(argv) == 0
    assert "CPU kernels" not in capsys.readouterr().err
