"""In-process training runs on a tiny random Llama (fp32, CPU)."""

import json
import math
from pathlib import Path

import pytest
import torch

from dlm.config import load_config
from dlm.errors import DLMError


def write_chat(path, n=40):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "response": f"The answer is {2 * i}."}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dlm.testing import save_tiny

    root = tmp_path_factory.mktemp("train")
    return {"model": save_tiny(root / "tiny"), "data": write_chat(root / "chat.jsonl"), "root": root}


def make_cfg(tiny, out, **over):
    base = {
        "model": str(tiny["model"]),
        "data": str(tiny["data"]),
        "output_dir": str(out),
        "objective": "idlm",
        "block_size": 2,
        "seq_length": 64,
        "batch_size": 4,
        "max_train_steps": 4,
        "learning_rate": 1e-3,
        "train.progress": False,
    }
    base.update(over)
    return load_config(None, base)


def log_lines(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tiny):
    from dlm.train.loop import train

    out = tiny["root"] / "run"
    result = train(make_cfg(tiny, out, save_every=2, keep_last=1, eval_every=2, gradient_accumulate_every=2))
    return out, result


def test_outputs_of_a_run(run):
    from safetensors.torch import load_file

    from dlm.model.convert import AutoDLMForCausalLM

    out, result = run
    assert result.step == 4 and result.stopped == "max_train_steps" and len(result.losses) == 4
    dlm = AutoDLMForCausalLM.from_pretrained(out)
    assert dlm.objective == "idlm" and dlm.block_size == 2 and dlm.tokenizer is not None
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_00000004"]  # keep_last=1 pruned step 2
    ck = out / "checkpoints" / "step_00000004"
    assert (ck / "trainer_state.json").is_file() and (ck / "training_state").is_dir()
    a, b = load_file(ck / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [r for r in log_lines(out) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and "ce_noisy" in r["parts"] for r in steps)
    assert [r["loss"] for r in steps] == result.losses
    hist = [json.loads(line) for line in (out / "eval_history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in hist] == [2, 4] and hist[1]["checkpoint"] == "step_00000004"
    assert all(h["metrics"]["heldout_loss"] > 0 for h in hist)
    assert (out / "run_config.yaml").is_file()


def test_existing_run_is_not_overwritten(run, tiny):
    from dlm.train.loop import train

    out, _ = run
    before = (out / "train_log.jsonl").read_text()
    with pytest.raises(DLMError, match="--resume auto.*--overwrite"):
        train(make_cfg(tiny, out))
    assert (out / "train_log.jsonl").read_text() == before


def test_resume_from_a_finished_run_is_a_no_op_continuation(run, tiny):
    """--resume auto with max_train_steps reached trains nothing and keeps the step count."""
    from dlm.train.loop import train

    out, _ = run
    result = train(make_cfg(tiny, out, resume="auto", save_every=2, keep_last=1))
    assert result.step == 4 and result.losses == []


def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_checkpoint(tiny, tmp_path):
    from dlm.objectives import get_objective
    from dlm.train.loop import train

    real = get_objective("idlm", block_size=2)

    def poisoned(model, batch, step, generator=None):
        out = real(model, batch, step, generator)
        if step == 2:  # the third optimizer step
            out.loss = out.loss * float("nan")
        return out

    out = tmp_path / "nan"
    with pytest.raises(DLMError, match=r"non-finite loss at step 3.*step_00000002"):
        train(make_cfg(tiny, out, save_every=2), objective=poisoned)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]
    last = log_lines(out)[-1]
    assert last["event"] == "error" and "step 3" in last["message"]


@pytest.mark.parametrize(
    "over, msg",
    [
        ({"seq_length": 600}, "exceeds the model's context of 512"),
        ({"data.idlm_block_size": 3}, r"idlm_block_size \(block_length\) = 3 does not match"),
        ({"attn_impl": "flex_attention"}, "cannot train on CPU"),
    ],
)
def test_mismatched_data_is_refused_before_training(tiny, tmp_path, over, msg):
    from dlm.train.loop import train

    out = tmp_path / "bad"
    with pytest.raises(DLMError, match=msg):
        train(make_cfg(tiny, out, **over))
    assert not any("loss" in r for r in log_lines(out)) if (out / "train_log.jsonl").exists() else True


def test_lr_1e5_bf16_autocast_step_changes_fp32_master_weights(tiny, tmp_path):
    """bf16 autocast with fp32 master weights: a 1e-5 AdamW step changes (nearly) every trained weight, while the
    same update applied to bf16-stored weights (8 mantissa bits: steps of ~0.4% of |w|) is rounded away for most
    of them (all but the ~25% smallest weights of this N(0, 0.02) init)."""
    from dlm.model.convert import load_any
    from dlm.train.loop import train

    dlm = load_any(tiny["model"], objective="idlm", block_size=2)
    before = {n: p.detach().clone() for n, p in dlm.named_parameters()}
    result = train(
        make_cfg(
            tiny,
            tmp_path / "bf16",
            mixed_precision="bf16",
            learning_rate=1e-5,
            max_train_steps=1,
            **{"optim.max_grad_norm": 0},
        ),
        dlm=dlm,
    )
    assert result.step == 1
    changed, survives_bf16 = [], []
    for n, p in dlm.named_parameters():
        assert p.dtype == torch.float32
        if p.ndim == 2 and "embed" not in n:
            w0 = before[n]
            changed.append((p.detach() != w0).float().mean().item())
            survives_bf16.append((p.detach().bfloat16() != w0.bfloat16()).float().mean().item())
    assert min(changed) > 0.9, changed
    assert max(survives_bf16) < 0.5, survives_bf16


def test_max_minutes_stops_cleanly_and_saves(tiny, tmp_path):
    from dlm.train.loop import train

    out = tmp_path / "budget"
    result = train(make_cfg(tiny, out, max_train_steps=1000, max_minutes=1e-9, gradient_checkpointing=True))
    assert result.stopped == "max_minutes" and result.step == 1
    assert (out / "checkpoints" / "step_00000001" / "trainer_state.json").is_file()
    assert (out / "model.safetensors").is_file()
    assert log_lines(out)[-1]["event"] == "end"


def test_gated_lora_keeps_base_weights_and_trains_adapters(tiny, tmp_path):
    from safetensors.torch import load_file

    from dlm.train.loop import train

    out = tmp_path / "gated"
    train(make_cfg(tiny, out, lora_r=4, gated_lora=True, max_train_steps=2))
    base = load_file(tiny["model"] / "model.safetensors")
    saved = load_file(out / "model.safetensors")
    same = [k for k in base if k in saved and base[k].shape == saved[k].shape]
    assert same and all(torch.equal(base[k], saved[k]) for k in same)
    adapters = load_file(out / "dlm_adapter.safetensors")
    assert any(v.abs().sum() > 0 for k, v in adapters.items() if k.endswith(".B"))


def test_plain_lora_is_merged_into_the_saved_weights(tiny, tmp_path):
    from safetensors.torch import load_file

    from dlm.train.loop import train

    out = tmp_path / "lora"
    train(make_cfg(tiny, out, lora_r=4, max_train_steps=2))
    base = load_file(tiny["model"] / "model.safetensors")
    saved = load_file(out / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert saved[q].shape == base[q].shape and not torch.equal(saved[q], base[q])
    assert not any("lora" in k for k in saved)


def test_lr_schedule():
    from dlm.train.loop import lr_factor

    assert [lr_factor(s, 10, 2, "cosine", 0.0) for s in (0, 1)] == [0.5, 1.0]
    assert lr_factor(2, 10, 2, "cosine", 0.0) == 1.0
    assert lr_factor(10, 10, 2, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(6, 10, 2, "cosine", 0.0) == pytest.approx(0.5)
    assert lr_factor(7, 10, 0, "constant", 0.0) == 1.0
    # wsd: constant, then linear to the floor over the last decay_ratio of the run
    assert [lr_factor(s, 10, 0, "wsd", 0.0, decay_ratio=0.2) for s in (0, 8, 9, 10)] == [
        1.0,
        1.0,
        pytest.approx(0.5),
        pytest.approx(0.0, abs=1e-12),
    ]
    assert lr_factor(10, 10, 0, "wsd", 0.1, decay_ratio=0.2) == pytest.approx(0.1)
    # a time budget drives the progress when it is ahead of the steps (a huge step limit under --max-minutes)
    assert lr_factor(5, 10**6, 2, "cosine", 0.0, time_fraction=0.5) == pytest.approx(0.5)
    assert lr_factor(5, 10**6, 2, "wsd", 0.0, time_fraction=0.9, decay_ratio=0.2) == pytest.approx(0.5)
    assert lr_factor(5, 10**6, 2, "wsd", 0.0, time_fraction=1.7, decay_ratio=0.2) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(9, 10, 0, "cosine", 0.0, time_fraction=0.0) == lr_factor(9, 10, 0, "cosine", 0.0)
    assert lr_factor(1, 10, 2, "wsd", 0.0, time_fraction=0.99) == 1.0  # warm-up first


def test_time_bounded_run_decays_to_the_floor_when_its_minutes_run_out(tiny, tmp_path, monkeypatch):
    """--max-minutes with a step limit never reached: wsd holds the peak, then decays over the budget's last half
    and ends near 0; a checkpoint records the seconds trained (a resumed run continues the schedule from them)."""
    import dlm.train.loop as loop

    class Clock:  # each time.time() call advances 1 s: a deterministic 60 s budget
        now = 1_000_000.0

        @classmethod
        def time(cls):
            cls.now += 1.0
            return cls.now

        perf_counter = staticmethod(__import__("time").perf_counter)

    monkeypatch.setattr(loop, "time", Clock)
    out = tmp_path / "wsd"
    result = loop.train(
        make_cfg(
            tiny,
            out,
            max_train_steps=10**6,
            max_minutes=1.0,
            **{"optim.warmup_steps": 2, "optim.schedule": "wsd", "optim.decay_ratio": 0.5},
        )
    )
    assert result.stopped == "max_minutes" and result.step > 8
    lrs = [r["lr"] for r in log_lines(out) if "loss" in r]
    peak = 1e-3
    assert lrs[:2] == [pytest.approx(peak / 2), pytest.approx(peak)]
    assert lrs[len(lrs) // 3] == pytest.approx(peak)  # still stable a third of the way in
    tail = lrs[2:]
    assert all(b <= a + 1e-15 for a, b in zip(tail, tail[1:]))  # never rises again
    assert lrs[-1] < 0.25 * peak  # decayed by the end of the budget
    state = json.loads(next((out / "checkpoints").iterdir()).joinpath("trainer_state.json").read_text())
    assert state["train_seconds"] > 60


def test_bad_decay_ratio_is_refused(tiny, tmp_path):
    with pytest.raises(DLMError, match="optim.decay_ratio"):
        make_cfg(tiny, tmp_path / "x", **{"optim.schedule": "wsd", "optim.decay_ratio": 0.0}).validate()


def write_shards(folder, prefix, vocab, n_files=2, chunk=256, seed=0):
    import numpy as np

    from dlm.data.shards import write_shard

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(n_files):
        write_shard(folder / f"{prefix}_{i:010d}.bin", rng.integers(4, vocab, chunk).astype(np.uint16))
    return folder


def test_packed_shards_mdm_run_with_heldout_prefix(tiny, tmp_path):
    from dlm.train.loop import train

    data = write_shards(tmp_path / "packed", "train", 320)
    write_shards(data, "val", 320, n_files=1, seed=1)
    out = tmp_path / "mdm"
    result = train(
        make_cfg(
            tiny,
            out,
            data=None,
            packed_data_dir=str(data),
            objective="mdm",
            block_size=None,
            max_train_steps=2,
            eval_every=2,
            **{"data.eval_packed_prefixes": "val", "seq_length": 32},
        )
    )
    assert result.step == 2 and all(math.isfinite(x) for x in result.losses)
    hist = json.loads((out / "eval_history.jsonl").read_text().splitlines()[-1])
    assert hist["metrics"]["heldout_loss"] > 0
    steps = [r for r in log_lines(out) if "loss" in r]
    assert steps[0]["parts"]["p_anneal"] < 1  # annealed attention during training


def test_packed_shards_from_another_tokenizer_are_refused(tiny, tmp_path):
    from dlm.train.loop import train

    data = write_shards(tmp_path / "big", "train", 60000)
    with pytest.raises(DLMError, match="another tokenizer"):
        train(make_cfg(tiny, tmp_path / "x", data=None, packed_data_dir=str(data), seq_length=32))


def test_wandb_without_the_package_names_the_extra(tiny, tmp_path):
    import importlib.util

    from dlm.train.loop import train

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(DLMError, match=r"dlm\[wandb\]"):
        train(make_cfg(tiny, tmp_path / "w", wandb_project="p"))


def test_scheduled_task_evaluation_goes_to_eval_history(tiny, tmp_path, task_data):
    from dlm.train.loop import train

    out = tmp_path / "ev"
    train(
        make_cfg(
            tiny,
            out,
            max_train_steps=1,
            eval_every=1,
            eval_tasks="piqa",
            eval_data_dir=task_data,
            **{"eval.eval_limit": 4},
        )
    )
    rec = json.loads((out / "eval_history.jsonl").read_text().splitlines()[0])
    assert rec["step"] == 1 and rec["checkpoint"] == "step_00000001"
    assert 0 <= rec["metrics"]["piqa/acc"] <= 1 and rec["metrics"]["heldout_loss"] > 0


def test_scheduled_isd_acceptance_needs_no_data(tiny, tmp_path):
    """An I-DLM run can log its drafts' acceptance as it trains (built-in held-out prompts, the model's stride)."""
    from dlm.train.loop import train

    out = tmp_path / "isd"
    train(make_cfg(tiny, out, max_train_steps=2, eval_every=2, eval_tasks="isd_acceptance", **{"eval.eval_limit": 2}))
    m = json.loads((out / "eval_history.jsonl").read_text().splitlines()[0])["metrics"]
    assert m["isd_acceptance/stride"] == 3 and m["isd_acceptance/identical"] == 1.0
    assert 0 <= m["isd_acceptance/acc"] <= 1 and 0 <= m["isd_acceptance/acc_pos2"] <= 1
    assert 1 <= m["isd_acceptance/tpf"] <= 3


def test_only_complete_checkpoints_count(tmp_path):
    from dlm.train.checkpoint import STATE_FILE, latest_checkpoint, list_checkpoints, resolve_resume

    root = tmp_path / "checkpoints"
    for name, complete in (
        ("step_00000002", True),
        ("step_00000004", True),
        (".step_00000006.tmp", True),
        ("step_00000008", False),
    ):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / STATE_FILE).write_text("{}")
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002", "step_00000004"]
    assert latest_checkpoint(root).name == "step_00000004"
    assert resolve_resume("auto", tmp_path / "none") is None
    with pytest.raises(DLMError, match="not a complete dlm checkpoint"):
        resolve_resume(str(root / "step_00000008"), root)


def test_callbacks_join_the_scheduled_evaluation_and_the_trainer_needs_no_eval_package(tiny, tmp_path):
    """Evaluation during training goes through callbacks: a custom one's metrics land in eval_history.jsonl next to
    the held-out loss at each scheduled step; the trainer module imports neither dlm.eval nor accelerate's private
    state (a second run in one process with another precision works, as the bf16 test shows)."""
    import subprocess
    import sys

    from dlm.train.loop import Callback, train

    class Count(Callback):
        def __init__(self):
            self.set_up, self.steps = False, []

        def setup(self, trainer):
            self.set_up = trainer.cfg.eval.eval_every == 2  # before any model or data is loaded

        def on_evaluate(self, trainer, step):
            self.steps.append(step)
            return {"custom/step_seen": float(trainer.step)}

    cb = Count()
    out = tmp_path / "cb"
    train(make_cfg(tiny, out, max_train_steps=4, eval_every=2), callbacks=[cb])
    hist = [json.loads(line) for line in (out / "eval_history.jsonl").read_text().splitlines()]
    assert cb.set_up and cb.steps == [2, 4]
    assert [h["metrics"]["custom/step_seen"] for h in hist] == [2.0, 4.0]
    assert all(h["metrics"]["heldout_loss"] > 0 for h in hist)
    code = "import sys, dlm.train.loop; print(sorted(m for m in sys.modules if m.startswith('dlm.eval')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"
    assert "_reset_state" not in (Path(__file__).parents[1] / "dlm" / "train" / "loop.py").read_text()
