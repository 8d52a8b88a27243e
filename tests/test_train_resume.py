"""Exact resume: a CPU run killed with SIGKILL mid-way and resumed gives the uninterrupted run's losses."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

STEPS, SAVE = 10, 3


def cli(model, data, out, *extra):
    return [
        sys.executable,
        "-m",
        "dlm",
        "train",
        "--model",
        str(model),
        "--data",
        str(data),
        "--objective",
        "idlm",
        "--block-size",
        "2",
        "--seq-length",
        "48",
        "--batch-size",
        "4",
        "--gradient-accumulate-every",
        "2",
        "--max-train-steps",
        str(STEPS),
        "--learning-rate",
        "1e-3",
        "--save-every",
        str(SAVE),
        "--keep-last",
        "2",
        "--eval-every",
        "5",
        "--output-dir",
        str(out),
        "--train.progress",
        "false",
        "--optim.warmup_steps",
        "3",
        *extra,
    ]


def records(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def steps_after_last_start(out):
    recs = records(out)
    start = max(i for i, r in enumerate(recs) if r.get("event") in ("start", "resume"))
    return recs[start], {r["step"]: r for r in recs[start + 1 :] if "loss" in r}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dlm.testing import save_tiny

    root = tmp_path_factory.mktemp("resume")
    data = root / "chat.jsonl"
    with open(data, "w") as f:
        for i in range(60):
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"Count to {i % 7}."},
                            {"role": "assistant", "content": " ".join(map(str, range(i % 7 + 1)))},
                        ]
                    }
                )
                + "\n"
            )
    return root, save_tiny(root / "tiny"), data


@pytest.mark.integration
def test_sigkill_then_resume_matches_the_uninterrupted_run(setup):
    from safetensors.torch import load_file

    root, model, data = setup
    ref, cut = root / "ref", root / "cut"
    r = subprocess.run(cli(model, data, ref), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]

    proc = subprocess.Popen(cli(model, data, cut), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:  # kill once a checkpoint exists and training has moved past it
            if (cut / "train_log.jsonl").exists():
                done = [x["step"] for x in records(cut) if "loss" in x]
                if done and done[-1] >= SAVE + 2:
                    break
            if proc.poll() is not None:
                pytest.fail(f"run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    killed_at = max(x["step"] for x in records(cut) if "loss" in x)
    assert killed_at < STEPS, "the run finished before the kill"
    assert not any(x.get("event") == "end" for x in records(cut))

    r = subprocess.run(cli(model, data, cut, "--resume", "auto"), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    start, resumed = steps_after_last_start(cut)
    assert start["event"] == "resume" and start["step"] >= SAVE and start["step"] % SAVE == 0
    _, full = steps_after_last_start(ref)
    assert sorted(resumed) == list(range(start["step"] + 1, STEPS + 1))
    for s, rec in resumed.items():  # bit-for-bit: same weights, optimizer, schedule, RNG and data position
        assert (rec["loss"], rec["grad_norm"], rec["lr"], rec["tokens"]) == (
            full[s]["loss"],
            full[s]["grad_norm"],
            full[s]["lr"],
            full[s]["tokens"],
        ), s
    a, b = load_file(ref / "model.safetensors"), load_file(cut / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    hist_ref = (ref / "eval_history.jsonl").read_text().splitlines()
    hist_cut = (cut / "eval_history.jsonl").read_text().splitlines()
    last = lambda lines: json.loads(lines[-1])["metrics"]  # noqa: E731
    assert last(hist_ref) == last(hist_cut)
    ckpts = sorted(p.name for p in (cut / "checkpoints").iterdir())
    last_saved = STEPS // SAVE * SAVE
    assert ckpts == [f"step_{last_saved - SAVE:08d}", f"step_{last_saved:08d}"]  # keep_last=2, no temp folder
