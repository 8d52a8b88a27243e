"""bench/gpu_checks.sh is the one script a GPU session runs, with minutes to spend: its rehearsal on the CPU runs every
step with the same scripts and flags on a tiny model, so that a flag or script that no longer fits fails here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dlm.testing import save_tiny

ROOT = Path(__file__).resolve().parents[1]
STEPS = [
    "objectives sdpa",
    "static step / CUDA graphs, gated adapters",
    "static step / CUDA graphs",
    "forced acceptance",
]


def _bench(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT ARGS`` on one thread; asserted to exit 0 (its output shown where it does not)."""
    run = subprocess.run(
        ["python", f"bench/{script}", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def _rehearse(model: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECKS_REHEARSAL": "1", "OUT": str(out), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        ["bash", "bench/gpu_checks.sh", model], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.integration
def test_gpu_checks_rehearsal_runs_every_step_on_the_cpu(tmp_path):
    model = save_tiny(tmp_path / "tiny")
    run = _rehearse(str(model), tmp_path / "out")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    for name in STEPS:
        assert f"{name}: " in run.stdout and f"{name}: " in run.stdout.split("every step ran")[0]
        assert [line for line in run.stdout.splitlines() if line.startswith(f"{name}: ")][0].endswith("exit 0")
    assert "every step ran" in run.stdout and "failed:" not in run.stdout
    objectives = json.loads((tmp_path / "out" / "objectives_sdpa.json").read_text())
    assert {r["objective"] for r in objectives} >= {"ar", "idlm", "idlm-gated"}
    for name, decoders in [("static_step_adapters", {"ar", "isd3"}), ("static_step", {"ar", "isd3"})]:
        rows = json.loads((tmp_path / "out" / f"{name}.json").read_text())
        assert {r["decoder"] for r in rows} == decoders
        # the static step gives the growing cache's tokens: the figures are of the same decoding
        assert all(r["same_tokens"] for r in rows), rows
    # forced acceptance: ISD's output is AR's at every forced rate, growing cache and static step alike
    table = [line for line in run.stdout.splitlines() if line.startswith("| ") and "isd N=3" in line]
    assert len(table) == 8 and all(line.rstrip(" |").endswith(("1/1", "2/2")) for line in table), table


@pytest.mark.integration
def test_gpu_checks_names_each_failed_step_and_exits_non_zero(tmp_path):
    run = _rehearse(str(tmp_path / "no-such-model"), tmp_path / "out")
    assert run.returncode == 1
    failed = [line for line in run.stdout.splitlines() if line.startswith("failed: ")]
    assert [line.split("failed: ")[1].rsplit(" (", 1)[0] for line in failed] == STEPS, run.stdout[-3000:]
    assert "every step ran" not in run.stdout


@pytest.mark.integration
def test_structured_bench_runs_and_checks_equality(tmp_path):
    """bench/structured.py on a tiny model: its table, with every constrained decoder's output equal to
    constrained AR's (the script's own check)."""
    pytest.importorskip("llguidance")
    model = save_tiny(tmp_path / "tiny")
    run = _bench(
        "structured.py",
        *("--model", str(model), "--prompts", "2", "--max-new-tokens", "12", "--strides", "2", "--threads", "1"),
        "--compact",
    )
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ISD") or line.startswith("| AR + schema")]
    assert len(rows) == 4 and all(line.rstrip().endswith("| 2/2 |") for line in rows), run.stdout


@pytest.mark.integration
def test_prefill_chat_bench_runs_and_checks_equality(tmp_path):
    """bench/prefill.py --mode chat on a tiny model: every chat the same with either cache as without (the script's
    own check), and the radix tree, which keeps a conversation's turns once, computes no more prompt tokens than
    flat copies of the same budget."""
    model = save_tiny(tmp_path / "tiny")
    run = _bench(
        "prefill.py",
        *("--mode", "chat", "--model", str(model), "--conversations", "3", "--turns", "3", "--prompt-tokens", "40"),
        *("--new-tokens", "8", "--answer-tokens", "8", "--cache-tokens", "300", "--repeats", "1", "--threads", "1"),
    )
    assert "every chat the same with and without a cache" in run.stdout
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines() if line.strip().endswith("x")}
    computed = {k: int(v[-5]) for k, v in rows.items()}
    assert computed["radix"] <= computed["flat"] < computed["no"], run.stdout
    assert all(int(v[-3]) <= 300 for v in rows.values()), run.stdout  # kept within the budget


@pytest.mark.integration
def test_prompt_lookup_bench_runs_and_checks_equality(tmp_path):
    """bench/prompt_lookup.py on a tiny model: its table, every output equal to plain AR's (the script's check)."""
    model = save_tiny(tmp_path / "tiny")
    run = _bench("prompt_lookup.py", "--model", str(model), "--k", "3", "--max-new-tokens", "16", "--rounds", "1")
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "| 3 |" in line]
    assert len(rows) == 4 and all(line.rstrip().endswith("| yes |") for line in rows), run.stdout


@pytest.mark.integration
def test_decode_bench_runs_every_variant_with_ar_tokens(tmp_path):
    """bench/decode.py on a tiny model with the kernels' per-layer loop and decode_stack's arguments rebuilt at every
    forward as extra rows, and the measured policy with and without what earlier processes learnt: every engine row,
    each variant included, decodes the ar row's tokens (greedy)."""
    model = save_tiny(tmp_path / "tiny")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox jumps over\nhello world this is a test\nanother line of text\none more\n")
    run = _bench(
        "decode.py",
        *("--model", str(model), "--data", str(prompts), "--batch-sizes", "1,2", "--strides", "2"),
        *("--max-new-tokens", "8", "--groups", "2", "--threads", "1", "--layer-loop", "--rebuilt-plans"),
        *("--draft-budgets", "auto,fresh"),
    )
    table = [line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    rows = [r for r in table if r[1] != "transformers"]  # the engine's rows: batch, method ..., = ar, = hf
    names = [" ".join(r[1:-10]) for r in rows]
    assert {"ar (loop)", "ar (rebuilt)", "isd N=2 (rebuilt)", "isd N=2 auto", "isd N=2 fresh"} <= set(names), run.stdout
    assert len(rows) == 24 and all(r[-2] == "True" for r in rows), run.stdout


@pytest.mark.integration
def test_renoise_bench_runs_and_matches_transformers_on_a_small_vocabulary():
    """bench/renoise.py on a tiny DiffusionGemma-shaped model: its table, every engine row's tokens equal to
    transformers' generate (a small vocabulary: the forwards' rounding never flips a draw there)."""
    run = _bench(
        "renoise.py",
        *("--hidden", "64", "--layers", "2", "--vocab", "512", "--experts", "4", "--canvas", "8"),
        *("--steps", "3", "--prompts", "2", "--max-new-tokens", "12", "--batch-size", "2"),
    )
    rows = [line for line in run.stdout.splitlines() if line.startswith("| dlm renoise")]
    assert len(rows) == 2 and all(line.rstrip().endswith("| 100% |") for line in rows), run.stdout
