"""The engines users outgrow one machine with, run for real on CPU processes (gloo): FSDP2 full sharding and
DeepSpeed ZeRO-2 / ZeRO-3 (DeepSpeed's CPU accelerator) against DDP with the same launch, each engine's checkpoint
resumed after SIGKILL, and a two-node launch (two torchrun processes, node ranks 0 and 1, rendezvous on
127.0.0.1). The DeepSpeed cases skip, with the reason, where DeepSpeed is not installed."""

from __future__ import annotations

import json
import os
import re
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


def failure_report(cmd, returncode: int, stdout: str, stderr: str) -> str:
    """What a failed launch printed, cause first. A rank that dies in C++ (an abort in gloo prints no Python
    exception) is reported by torchrun's summary at the end of stderr; its own cause is earlier, between the other
    rank's logs (and, as dlm enables faulthandler, the Python stack of each of its threads): keep the lines that
    name one."""
    cause = [
        line
        for line in stderr.splitlines()
        if re.search(
            r"Traceback|Error|error|terminate called|what\(\)|Abort|SIG[A-Z]+|exitcode|File \"|Current thread|"
            r"^Thread 0x|no Python frame",
            line,
        )
    ]
    first = stderr.find("Traceback")
    return (
        f"{' '.join(map(str, cmd))}: exit {returncode}\n-- stdout (tail):\n{stdout[-2000:]}"
        f"\n-- stderr lines naming a cause:\n"
        + "\n".join(cause[:80])
        + (f"\n-- first traceback:\n{stderr[first : first + 4000]}" if first >= 0 else "")
        + f"\n-- stderr (tail):\n{stderr[-3000:]}"
    )


def run(cmd) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    if r.returncode != 0:
        raise AssertionError(failure_report(cmd, r.returncode, r.stdout, r.stderr))


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def losses(out: Path) -> dict[int, dict]:
    recs = records(out)
    start = max((i for i, r in enumerate(recs) if r.get("event") in ("start", "resume")), default=len(recs))
    return {r["step"]: r for r in recs[start:] if "loss" in r}


# engine -> (accelerate config, the run's distributed type, the files a checkpoint's sharded state holds)
SHARDED = {
    "fsdp": ("fsdp_cpu.yaml", "FSDP", ["pytorch_model_fsdp_0", "optimizer_0"]),
    "zero2": (
        "deepspeed_zero2_cpu.yaml",
        "DEEPSPEED",
        ["pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt", "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt"],
    ),
    "zero3": (
        "deepspeed_zero3_cpu.yaml",
        "DEEPSPEED",
        ["pytorch_model/zero_pp_rank_0_mp_rank_00_model_states.pt", "pytorch_model/zero_pp_rank_1_mp_rank_00_model_states.pt"],
    ),
}  # fmt: skip


def config_of(engine: str) -> str:
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'dlm[deepspeed]')")
    return SHARDED[engine][0]


@pytest.fixture(scope="module")
def ddp_runs(inputs, tmp_path_factory):
    """The DDP run of each objective and extra flags (LoRA's), made once and shared by the engines compared
    with it."""
    done: dict[tuple, Path] = {}

    def get(objective: str, *extra: str) -> Path:
        key = (objective, *extra)
        if key not in done:
            out = tmp_path_factory.mktemp(f"ddp_{objective}")
            run(accelerate("ddp_cpu.yaml", train_args(*inputs, out, objective, *extra)))
            assert records(out)[0]["distributed_type"] == "MULTI_CPU"
            done[key] = out
        return done[key]

    return get


def assert_same_losses(ddp: Path, other: Path) -> None:
    """Every step's loss of ``other`` equals DDP's within 1e-5 relative (another summation order of the
    gradients), on the same batches."""
    a, b = losses(ddp), losses(other)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for s in a:
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-5, abs=1e-6), s
        assert a[s]["data_fingerprint"] == b[s]["data_fingerprint"]  # the same batches on the same ranks


def assert_greedy_isd_equals_ar(folder: Path) -> None:
    import dlm
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams

    trained = dlm.load_model(folder)
    prompts = [[1, 5, 9, 13], [2, 4, 6]]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    ar = Engine(trained, decoder="ar").generate(prompts, params)
    isd = Engine(trained, decoder="isd").generate(prompts, params)
    assert [r.token_ids for r in isd] == [r.token_ids for r in ar]


@pytest.mark.parametrize("engine", list(SHARDED))
@pytest.mark.parametrize("objective", ["idlm", "mdm", "block"])
def test_sharded_engines_train_as_ddp_does(inputs, ddp_runs, tmp_path, engine, objective):
    """FSDP2 full sharding, ZeRO-2 and ZeRO-3 over two CPU processes: the same losses as DDP with the same launch
    (not bit-exact: the sharded gradients are reduce-scattered, or reduced in DeepSpeed's buckets, where DDP
    all-reduces them - another summation order - so AdamW's normalised update of a gradient that is rounding noise
    may differ in sign: the weights agree within 2 * lr * steps), a sharded checkpoint, and a final folder that
    loads in plain transformers and in dlm."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, data = inputs
    config, kind, sharded_files = SHARDED[engine]
    ddp, other = ddp_runs(objective), tmp_path / engine
    run(accelerate(config_of(engine), train_args(model, data, other, objective)))
    assert records(other)[0]["distributed_type"] == kind and records(other)[0]["world_size"] == 2
    assert_same_losses(ddp, other)
    state = other / "checkpoints" / "step_00000004" / "training_state"
    for name in sharded_files:  # each rank's share, not one gathered copy
        assert (state / name).exists(), name
    wa, wb = load_file(ddp / "model.safetensors"), load_file(other / "model.safetensors")
    assert sorted(wa) == sorted(wb) and all(wa[k].shape == wb[k].shape for k in wa)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 2 * LR * STEPS
    assert json.loads((ddp / "config.json").read_text()) == json.loads((other / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(other)  # no remote code, no dlm
    assert torch.isfinite(plain(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("engine", ["fsdp", "zero3"])
def test_greedy_isd_equals_greedy_ar_on_a_sharded_run_s_folder(inputs, tmp_path, engine):
    model, data = inputs
    out = tmp_path / engine
    run(accelerate(config_of(engine), train_args(model, data, out, "idlm")))
    assert_greedy_isd_equals_ar(out)


@pytest.mark.parametrize("engine", list(SHARDED))
def test_sharded_checkpoint_resumes_after_sigkill_to_the_uninterrupted_losses(inputs, tmp_path, engine):
    model, data = inputs
    config = config_of(engine)
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    extra = ("--max-train-steps", "10", "--save-every", "3")
    run(accelerate(config, train_args(model, data, ref, "idlm", *extra)))
    proc = subprocess.Popen(
        accelerate(config, train_args(model, data, cut, "idlm", *extra)),
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
    run(accelerate(config, train_args(model, data, cut, "idlm", *extra, "--resume", "auto")))
    resumed, full = losses(cut), losses(ref)
    start = next(r for r in reversed(records(cut)) if r.get("event") == "resume")
    assert start["step"] % 3 == 0 and start["step"] < 10 and start["distributed_type"] == SHARDED[engine][1]
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
        outs = [p.communicate(timeout=600) for p in procs]
        failed = [
            f"node {rank}: " + failure_report(p.args, p.returncode, *outs[rank])
            for rank, p in enumerate(procs)
            if p.returncode != 0
        ]
        if failed:  # every node's report, and whether the run had finished (an abort after the end record is exit's)
            log = out / "train_log.jsonl"
            ended = log.is_file() and any('"event": "end"' in line for line in log.read_text().splitlines())
            raise AssertionError("\n\n".join(failed) + f"\n-- the run wrote its end record: {ended}")

    launch_nodes("--max-train-steps", "2")
    first = records(out)[0]
    assert first["world_size"] == 2 and first["distributed_type"] == "MULTI_CPU"
    assert (out / "checkpoints" / "step_00000002" / "training_state" / "dlm_rank1.pt").is_file()
    launch_nodes("--resume", "auto")
    start = next(r for r in reversed(records(out)) if r.get("event") == "resume")
    assert start["step"] == 2 and sorted(losses(out)) == [3, 4]


LORA = {"plain": ("--lora-r", "4"), "gated": ("--lora-r", "4", "--gated-lora")}


@pytest.mark.parametrize("form", list(LORA))
@pytest.mark.parametrize("engine", ["zero2", "zero3", "fsdp"])
def test_lora_under_each_engine_trains_and_exports_as_ddp_does(inputs, ddp_runs, tmp_path, engine, form):
    """I-DLM with LoRA merged into the weights (plain) or with gated LoRA (adapters at mask positions only, written
    beside the untouched base) under ZeRO-2, which keeps whole weights on every rank, and under ZeRO-3 and FSDP2,
    whose sharded weights are gathered for the export: the same losses, weights and adapters as DDP; on the gated
    folder, greedy ISD (drafting through the adapters) equals greedy AR."""
    from safetensors.torch import load_file

    model, data = inputs
    ddp, other = ddp_runs("idlm", *LORA[form]), tmp_path / engine
    run(accelerate(config_of(engine), train_args(model, data, other, "idlm", *LORA[form])))
    assert records(other)[0]["distributed_type"] == SHARDED[engine][1]
    assert_same_losses(ddp, other)
    wa, wb = load_file(ddp / "model.safetensors"), load_file(other / "model.safetensors")
    assert sorted(wa) == sorted(wb) and max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 2 * LR * STEPS
    if form == "plain":  # merged: no adapter file, and the weights moved
        assert not (other / "dlm_adapter.safetensors").exists()
        base = load_file(Path(model) / "model.safetensors")
        assert any(not bool((base[k] == wb[k][: base[k].shape[0]]).all()) for k in base)
        return
    ad, ab = load_file(ddp / "dlm_adapter.safetensors"), load_file(other / "dlm_adapter.safetensors")
    assert sorted(ad) == sorted(ab) and max(float((ad[k] - ab[k]).abs().max()) for k in ad) <= 2 * LR * STEPS
    assert max(float(ab[k].abs().max()) for k in ab if k.endswith(".B")) > 0  # the adapters trained
    base = load_file(Path(model) / "model.safetensors")
    assert sorted(base) == sorted(wb)  # the clean path is the base: its weights untouched (plus the mask row)
    assert all(bool((base[k] == wb[k][: base[k].shape[0]]).all()) for k in base)
    assert_greedy_isd_equals_ar(other)


GPU_PRESETS = [
    "idlm_b1_qwen3_8b_gpu", "idlm_b2_qwen3_8b_gpu", "idlm_b3_qwen3_8b_gpu", "sdar_qwen3_8b_gpu",
    "diffullama_llama2_7b_gpu",
]  # fmt: skip


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_the_published_recipes_launch_with_their_settings(inputs, tmp_path, preset):
    """Each GPU recipe launched as its first lines say - its own accelerate config (DeepSpeed ZeRO-2 for the I-DLM
    and SDAR recipes, DDP for DiffuLLaMA's) - on two CPU processes, a tiny model and a short length instead of
    the published ones: the engine and its precision run, and the optimisation, batch and objective settings
    reach the run unchanged."""
    import re

    import yaml

    from dlm.config import load_config, preset_path

    model, data = inputs
    head = preset_path(preset).read_text().splitlines()[:2]
    assert head[0].startswith("# accelerate launch --config_file configs/accelerate/") and f"--config {preset}" in (
        " ".join(head)
    )
    launch_config = re.search(r"configs/accelerate/(\S+\.yaml)", head[0]).group(1)
    engine = yaml.safe_load((ACCELERATE / launch_config).read_text())["distributed_type"]
    if engine == "DEEPSPEED":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install 'dlm[deepspeed]')")
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
    run(accelerate(launch_config, ["--num_processes", "2", *args]))
    recs = records(out)
    assert recs[0]["world_size"] == 2 and sorted(losses(out)) == [1, 2]
    assert recs[0]["distributed_type"] == ("DEEPSPEED" if engine == "DEEPSPEED" else "MULTI_CPU")
    assert recs[0]["mixed_precision"] == load_config(preset_path(preset), validate=False).train.mixed_precision
    ran = yaml.safe_load((out / "run_config.yaml").read_text())
    want = load_config(preset_path(preset), validate=False).to_dict()
    objective = want["model"]["objective"]
    for section in ("optim", objective):
        assert ran[section] == want[section], section
    for key in ("batch_size", "gradient_accumulate_every"):
        assert ran["train"][key] == want["train"][key], key
    assert ran["model"]["gradient_checkpointing"] == want["model"]["gradient_checkpointing"]
