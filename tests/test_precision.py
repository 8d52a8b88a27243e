"""``train.mixed_precision: auto`` on a CPU: bf16 autocast only where a measurement on this machine says it is faster
(AMX / AVX512-BF16 chips), fp32 without bf16 instructions, the verdict cached, ``DLM_CPU_BF16`` forcing it; and the
trainer running what was chosen."""

from __future__ import annotations

import json

import pytest
import torch

from dlm import device as precision


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """The measurement replaced by set timings (a real one depends on the machine), counted; a fresh cache."""
    monkeypatch.delenv(precision.BF16_ENV, raising=False)
    monkeypatch.setenv("DLM_HOME", str(tmp_path / "cache"))
    calls = []
    timings = {"fp32": 10.0, "bf16": 5.0}

    def fake(tokens, repeats=precision._PROBE_REPEATS):
        calls.append(tokens)
        return timings["fp32"], timings["bf16"]

    monkeypatch.setattr(precision, "_bf16_probe_ms", fake)
    monkeypatch.setattr(precision, "cpu_bf16_isa", lambda: ["amx"])
    return calls, timings, tmp_path / "cache" / precision.BF16_CACHE_FILE


def test_bf16_where_measured_faster_and_the_verdict_is_cached(probe):
    calls, timings, cache = probe
    first = precision.cpu_bf16_choice(tokens=256)
    assert first.use and not first.cached and calls == [256]
    assert "0.50x the fp32 time" in first.why and "amx" in first.why
    again = precision.cpu_bf16_choice(tokens=256)
    assert again.use and again.cached and calls == [256]  # not measured twice
    assert precision.training_precision(torch.device("cpu"), tokens=256) == ("bf16", again.why)
    assert len(json.loads(cache.read_text())) == 1
    # another token count is another key: measured again, and here bf16 is not enough faster to pay
    timings["bf16"] = 9.0
    slow = precision.cpu_bf16_choice(tokens=1024)
    assert not slow.use and calls == [256, 1024] and "0.90x" in slow.why
    assert precision.training_precision(torch.device("cpu"), tokens=1024)[0] == "no"
    assert precision.cpu_bf16_choice(tokens=256).use  # the first verdict kept


def test_the_margin_is_inclusive_and_strict_above(probe):
    calls, timings, _ = probe
    timings["bf16"] = precision.BF16_MARGIN * timings["fp32"]
    assert precision.cpu_bf16_choice(tokens=128).use
    timings["bf16"] = precision.BF16_MARGIN * timings["fp32"] + 0.01
    assert not precision.cpu_bf16_choice(tokens=130).use


def test_a_cpu_without_bf16_instructions_is_fp32_and_not_measured(probe, monkeypatch):
    calls, _, cache = probe
    monkeypatch.setattr(precision, "cpu_bf16_isa", lambda: [])
    choice = precision.cpu_bf16_choice()
    assert not choice.use and "no bf16 instructions" in choice.why
    assert calls == [] and not cache.exists()


@pytest.mark.parametrize("value, use", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_the_environment_forces_the_choice(probe, monkeypatch, value, use):
    calls, _, _ = probe
    monkeypatch.setenv(precision.BF16_ENV, value)
    choice = precision.cpu_bf16_choice()
    assert choice.use is use and precision.BF16_ENV in choice.why and calls == []


def test_a_broken_cache_is_measured_again(probe):
    calls, _, cache = probe
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    assert precision.cpu_bf16_choice(tokens=64).use and calls == [64]
    assert json.loads(cache.read_text())  # rewritten whole


def test_other_devices_are_not_chosen_automatically():
    assert precision.training_precision(torch.device("meta"))[0] == "no"


def test_the_probe_times_both_modes_on_this_cpu():
    fp32_ms, bf16_ms = precision._bf16_probe_ms(64, repeats=1)
    assert 0 < fp32_ms < 60_000 and 0 < bf16_ms < 60_000


@pytest.mark.parametrize("forced, dtype", [("1", torch.bfloat16), ("0", torch.float32)])
def test_the_trainer_runs_what_auto_chose(tmp_path, monkeypatch, forced, dtype):
    """The choice reaches the forward: under ``auto`` the projections' outputs are bf16 where bf16 was chosen, and
    the run's log says what was chosen and why; the weights stay fp32."""
    from dlm.config import load_config
    from dlm.model.convert import load_any
    from dlm.testing import save_tiny
    from dlm.train.loop import train

    monkeypatch.setenv(precision.BF16_ENV, forced)
    model = save_tiny(tmp_path / "tiny")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} plus {i}?", "response": f"{2 * i}."}) + "\n" for i in range(8)))
    dlm = load_any(model, objective="idlm", block_size=2)
    seen = []
    proj = next(m for n, m in dlm.named_modules() if n.endswith("q_proj"))
    proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = tmp_path / "run"
    cfg = {
        "model": str(model),
        "data": str(data),
        "output_dir": str(out),
        "objective": "idlm",
        "block_size": 2,
        "seq_length": 32,
        "batch_size": 2,
        "max_train_steps": 1,
        "train.progress": False,
    }
    train(load_config(None, cfg), dlm=dlm)
    assert seen and set(seen) == {dtype}
    start = json.loads((out / "train_log.jsonl").read_text().splitlines()[0])
    assert start["mixed_precision"] == ("bf16" if forced == "1" else "no")
    assert precision.BF16_ENV in start["mixed_precision_why"]
    assert all(p.dtype == torch.float32 for p in dlm.parameters())
