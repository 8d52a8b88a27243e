"""The engines users outgrow one machine with, run for real on CPU processes (gloo): FSDP2 full sharding against
DDP with the same launch, an FSDP checkpoint resumed after SIGKILL, and a two-node launch (two torchrun
processes, node ranks 0 and 1, rendezvous on 127.0.0.1). DeepSpeed is not here: accelerate takes a DeepSpeed
launch only on accelerator devices (and DeepSpeed's CPU backend needs oneCCL) - docs/training.md says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_distributed import free_port

pytestmark = pytest.mark.integration
ACCELERATE = Path(__file__).resolve().parents[1] / "dlm" / "configs" / "accelerate"
LR, STEPS = 1e-3, 4


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from dlm.testing import save_tiny

    root = tmp_path_factory.mktemp("engines")
    model = save_tiny(root / "tiny")
    data = root / "chat.jsonl"
    with open(data, "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"Say {i}.", "response": f"{i} {i + 1} {i + 2}"}) + "\n")
    return model, data


def train_args(model, data, out, objective, *extra) -> list[str]:
    block = ["--block-size", "2"] if objective in ("idlm", "block") else []
    return [
        "-m", "dlm", "train", "--model", str(model), "--data", str(data), "--objective", objective, *block,
        "--seq-length", "48", "--batch-size", "2", "--max-train-steps", str(STEPS), "--learning-rate", str(LR),
        "--save-every", "2", "--output-dir", str(out), "--train.progress", "false", "--train.mixed_precision", "no",
        *extra,
    ]  # fmt: skip


def accelerate(config: str, args: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE / config),
        "--main_process_port", str(free_port()), *args,
    ]  # fmt: skip


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def run(cmd) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, dict]:
    recs = records(out)
    start = max((i for i, r in enumerate(recs) if r.get("event") in ("start", "resume")), default=len(recs))
    return {r["step"]: r for r in recs[start:] if "loss" in r}


@pytest.mark.parametrize("objective", ["idlm", "mdm", "block"])
def test_fsdp_trains_as_ddp_does(inputs, tmp_path, objective):
    """FSDP2 full sharding over two CPU processes: the same losses as DDP with the same launch (not bit-exact:
    the sharded gradients are reduce-scattered, DDP's all-reduced - another summation order - so AdamW's
    normalised update of a gradient that is rounding noise may differ in sign: the weights agree within
    2 * lr * steps), a sharded checkpoint, and a final folder that loads in plain transformers and in dlm."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, data = inputs
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    run(accelerate("ddp_cpu.yaml", train_args(model, data, ddp, objective)))
    run(accelerate("fsdp_cpu.yaml", train_args(model, data, fsdp, objective)))
    assert records(ddp)[0]["distributed_type"] == "MULTI_CPU"
    assert records(fsdp)[0]["distributed_type"] == "FSDP" and records(fsdp)[0]["world_size"] == 2
    a, b = losses(ddp), losses(fsdp)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for s in a:
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-5, abs=1e-6), s
        assert a[s]["data_fingerprint"] == b[s]["data_fingerprint"]  # the same batches on the same ranks
    state = fsdp / "checkpoints" / "step_00000004" / "training_state"
    assert (state / "pytorch_model_fsdp_0").is_dir() and (state / "optimizer_0").is_dir()  # sharded, not gathered
    wa, wb = load_file(ddp / "model.safetensors"), load_file(fsdp / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 2 * LR * STEPS
    assert json.loads((ddp / "config.json").read_text()) == json.loads((fsdp / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(fsdp)  # no remote code, no dlm
    assert torch.isfinite(plain(torch.tensor([[1, 2, 3]])).logits).all()


def test_fsdp_greedy_isd_equals_greedy_ar_on_the_trained_folder(inputs, tmp_path):
    import dlm
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams

    model, data = inputs
    out = tmp_path / "fsdp"
    run(accelerate("fsdp_cpu.yaml", train_args(model, data, out, "idlm")))
    trained = dlm.load_model(out)
    prompts = [[1, 5, 9, 13], [2, 4, 6]]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    ar = Engine(trained, decoder="ar").generate(prompts, params)
    isd = Engine(trained, decoder="isd").generate(prompts, params)
    assert [r.token_ids for r in isd] == [r.token_ids for r in ar]


def test_fsdp_checkpoint_resumes_after_sigkill_to_the_uninterrupted_losses(inputs, tmp_path):
    model, data = inputs
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    extra = ("--max-train-steps", "10", "--save-every", "3")
    run(accelerate("fsdp_cpu.yaml", train_args(model, data, ref, "idlm", *extra)))
    proc = subprocess.Popen(
        accelerate("fsdp_cpu.yaml", train_args(model, data, cut, "idlm", *extra)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=ENV,
        start_new_session=True,  # the launcher and both ranks in one process group
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline:  # kill every process once a checkpoint exists and training moved past it
            if (cut / "train_log.jsonl").exists() and max(losses(cut), default=0) >= 5:
                break
            if proc.poll() is not None:
                pytest.fail("the run ended before it could be killed")
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not any(r.get("event") == "end" for r in records(cut)), "the run finished before the kill"
    run(accelerate("fsdp_cpu.yaml", train_args(model, data, cut, "idlm", *extra, "--resume", "auto")))
    resumed, full = losses(cut), losses(ref)
    start = next(r for r in reversed(records(cut)) if r.get("event") == "resume")
    assert start["step"] % 3 == 0 and start["step"] < 10 and start["distributed_type"] == "FSDP"
    assert sorted(resumed) == list(range(start["step"] + 1, 11))
    for s, rec in resumed.items():  # the sharded weights, optimizer, schedule, RNG and data position restored
        assert (rec["loss"], rec["grad_norm"], rec["lr"]) == (full[s]["loss"], full[s]["grad_norm"], full[s]["lr"]), s


def test_two_nodes_train_checkpoint_and_resume(inputs, tmp_path):
    """Two torchrun processes as two nodes of one process each (node ranks 0 and 1, rendezvous on 127.0.0.1), the
    data and the output folder shared (as on a shared file system): they train, checkpoint, and resume."""
    model, data = inputs
    out = tmp_path / "nodes"

    def launch_nodes(*extra):
        port = str(free_port())
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--node_rank",
                    str(rank),
                    "--nproc_per_node",
                    "1",
                    "--master_addr",
                    "127.0.0.1",
                    "--master_port",
                    port,
                    *train_args(model, data, out, "idlm", *extra),
                ],  # fmt: skip
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=ENV,
            )
            for rank in (0, 1)
        ]
        for p in procs:
            _, err = p.communicate(timeout=600)
            assert p.returncode == 0, err[-4000:]

    launch_nodes("--max-train-steps", "2")
    first = records(out)[0]
    assert first["world_size"] == 2 and first["distributed_type"] == "MULTI_CPU"
    assert (out / "checkpoints" / "step_00000002" / "training_state" / "dlm_rank1.pt").is_file()
    launch_nodes("--resume", "auto")
    start = next(r for r in reversed(records(out)) if r.get("event") == "resume")
    assert start["step"] == 2 and sorted(losses(out)) == [3, 4]


def test_lora_under_fsdp_is_refused_before_anything_is_written(inputs, tmp_path):
    model, data = inputs
    out = tmp_path / "lora"
    r = subprocess.run(
        accelerate("fsdp_cpu.yaml", train_args(model, data, out, "idlm", "--lora-r", "4")),
        capture_output=True,
        text=True,
        timeout=600,
        env=ENV,
    )
    assert r.returncode != 0
    assert "--lora-r with FSDP" in r.stderr and "ddp_cpu.yaml" in r.stderr
    assert not out.exists()


GPU_PRESETS = [
    "idlm_b1_qwen3_8b_gpu", "idlm_b2_qwen3_8b_gpu", "idlm_b3_qwen3_8b_gpu", "sdar_qwen3_8b_gpu",
    "diffullama_llama2_7b_gpu",
]  # fmt: skip


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_the_published_recipes_launch_with_their_settings(inputs, tmp_path, preset):
    """Each GPU recipe launched as its first lines say, on two CPU processes with DDP (its own engine where that
    is DDP; DeepSpeed ZeRO-2 does not run on CPU processes), a tiny model and a short length instead of the
    published ones: its optimisation, batch and objective settings reach the run unchanged."""
    import yaml

    from dlm.config import load_config, preset_path

    model, data = inputs
    head = preset_path(preset).read_text().splitlines()[:2]
    assert head[0].startswith("# accelerate launch --config_file configs/accelerate/") and f"--config {preset}" in (
        " ".join(head)
    )
    out = tmp_path / "run"
    packed = []
    if preset.startswith("diffullama"):  # packed shards, as the recipe trains on
        import numpy as np

        from dlm.data.shards import write_shard

        shards = tmp_path / "packed"
        shards.mkdir()
        for i in range(4):
            write_shard(
                shards / f"train_parquet_{i:010d}.bin",
                np.random.default_rng(i).integers(4, 300, 4096).astype(np.uint16),
            )
        packed = ["--packed-data-dir", str(shards)]
    args = [
        "-m", "dlm", "train", "--config", preset, "--model", str(model), *(packed or ["--data", str(data)]),
        "--seq-length", "48", "--max-train-steps", "2", "--save-every", "0", "--output-dir", str(out),
        "--train.progress", "false",
    ]  # fmt: skip
    run(accelerate("ddp_cpu.yaml", args))
    recs = records(out)
    assert recs[0]["world_size"] == 2 and sorted(losses(out)) == [1, 2]
    ran = yaml.safe_load((out / "run_config.yaml").read_text())
    want = load_config(preset_path(preset), validate=False).to_dict()
    objective = want["model"]["objective"]
    for section in ("optim", objective):
        assert ran[section] == want[section], section
    for key in ("batch_size", "gradient_accumulate_every"):
        assert ran["train"][key] == want["train"][key], key
    assert ran["model"]["gradient_checkpointing"] == want["model"]["gradient_checkpointing"]
