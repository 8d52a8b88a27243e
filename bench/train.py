"""Training-step cost: `dlm train` (dlm.train.loop.train) vs a plain ~30-line PyTorch loop, same objective, same
run; or (``--vs precision``) the trainer in fp32 vs under bf16 autocast, which ``train.mixed_precision: auto``
picks where it is faster (dlm.device.training_precision).

Both train smollm2-135m with the I-DLM b2 objective on the same packed blocks (random token ids written as LITPKDS
shards; the content does not change the cost), same AdamW (fused where available), clipping and schedule, at the
precision ``auto`` resolves to on this machine (``--fp32``: fp32). Each mode runs in its own subprocess (so peak
memory is its own), alternating ``--repeats`` times; the first ``--warmup`` steps of every run are not timed.
``--adapters gated`` trains the quickstart's gated q/v LoRA (rank 64, distillation loss) instead of every weight
(trainer modes only).

    python bench/train.py                       # seq 256, batch 1, 6 timed steps per run
    python bench/train.py --seq-length 256 --batch-size 2 --steps 8 --repeats 2
    python bench/train.py --vs precision --batch-size 4 --repeats 2                 # fp32 vs bf16 autocast
    python bench/train.py --vs precision --adapters gated --seq-length 192 --batch-size 2

Prints a table: median seconds per optimizer step, tokens/s (input tokens; the I-DLM forward runs 2L), peak RSS
(CPU) or peak CUDA memory, the mean loss of the timed steps, and the ratio of the second mode to the first. Goal of
the default comparison: trainer / plain <= 1.10.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def make_shards(folder: Path, vocab: int, tokens: int) -> Path:
    import numpy as np

    from dlm.data.shards import write_shard

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    chunk = 8192
    for i in range(max(1, tokens // chunk + 1)):
        write_shard(folder / f"train_{i:010d}.bin", rng.integers(0, vocab, chunk).astype(np.uint16))
    return folder


def peak_memory_mb() -> float:
    import resource

    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_plain(a) -> dict:
    """The baseline: what a careful user would write by hand."""
    import torch

    from dlm.data.loader import build_packed_dataset
    from dlm.device import get_device, training_precision
    from dlm.model.convert import load_any
    from dlm.objectives import get_objective

    device = get_device()
    precision = "no" if a.fp32 else training_precision(device, a.batch_size * a.seq_length)[0]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    torch.manual_seed(0)
    dlm = load_any(a.model, objective="idlm", block_size=2, dtype=torch.float32).to(device).train()
    objective = get_objective("idlm", block_size=2)
    params = [p for p in dlm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    blocks = iter(build_packed_dataset(a.data, "train", block_size=a.seq_length, seed=a.seed, rank=0, world_size=1))
    gen = torch.Generator(device=device).manual_seed(0)
    times, losses = [], []
    for step in range(a.warmup + a.steps):
        t = time.perf_counter()
        for _ in range(a.accum):
            ids = torch.stack([next(blocks) for _ in range(a.batch_size)]).to(device)
            with autocast:
                out = objective(dlm, {"input_ids": ids, "labels": ids.clone()}, step, gen)
            (out.loss / a.accum).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss))  # the loss a user prints
        times.append(time.perf_counter() - t)
    return {
        "step_s": times[a.warmup :],
        "peak_mb": peak_memory_mb(),
        "loss": losses[a.warmup :],
        "precision": precision,
    }


def run_trainer(a, precision: str) -> dict:
    from dlm.config import load_config
    from dlm.train.loop import train

    out = Path(tempfile.mkdtemp(prefix="dlm-bench-train-"))
    adapters = (
        {"lora_r": 64, "lora_alpha": 64, "gated_lora": True, "lora.target_modules": ["q_proj", "v_proj"]}
        | {"idlm.idlm_loss_type": "distill", "idlm.ce_alpha": 0.0, "idlm.loss_auto_balance": False}
        if a.adapters == "gated"
        else {}
    )
    cfg = load_config(
        None,
        {
            **adapters,
            "model": a.model,
            "objective": "idlm",
            "block_size": 2,
            "packed_data_dir": a.data,
            "packed_prefixes": "train",
            "seq_length": a.seq_length,
            "batch_size": a.batch_size,
            "gradient_accumulate_every": a.accum,
            "max_train_steps": a.warmup + a.steps,
            "learning_rate": 1e-5,
            "optim.schedule": "constant",
            "optim.max_grad_norm": 1.0,
            "output_dir": str(out),
            "train.progress": False,
            "data.seed": a.seed,
            "train.mixed_precision": precision,
        },
    )
    train(cfg)
    recs = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    start = [r for r in recs if r.get("event") == "start"][0]
    # per-step wall time: differences of the log's elapsed clock (includes logging, reductions, the JSON line)
    el = [r["elapsed_s"] for r in steps]
    times = [b - a_ for a_, b in zip(el, el[1:])]
    shutil.rmtree(out, ignore_errors=True)
    return {
        "step_s": times[a.warmup - 1 :],
        "peak_mb": peak_memory_mb(),
        "loss": [r["loss"] for r in steps[a.warmup :]],
        "precision": start["mixed_precision"],
    }


# the modes a subprocess runs: name -> runner
MODES = {
    "plain": run_plain,
    "trainer": lambda a: run_trainer(a, "no" if a.fp32 else "auto"),
    "trainer-fp32": lambda a: run_trainer(a, "no"),
    "trainer-bf16": lambda a: run_trainer(a, "bf16"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp32", action="store_true", help="fp32 instead of what train.mixed_precision: auto picks")
    p.add_argument("--vs", choices=["plain", "precision"], default="plain", help="what to compare (see above)")
    p.add_argument("--adapters", choices=["none", "gated"], default="none", help="gated: the quickstart's adapters")
    p.add_argument("--mode", choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.mode:
        print("RESULT " + json.dumps(MODES[a.mode](a)))
        return
    modes = ("trainer-fp32", "trainer-bf16") if a.vs == "precision" else ("plain", "trainer")
    if a.vs == "plain" and a.adapters != "none":
        p.error("--adapters needs --vs precision (the plain loop trains every weight)")

    from dlm.model.hub import resolve_model_path

    resolve_model_path(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(resolve_model_path(a.model)).vocab_size
        need = (a.warmup + a.steps) * a.accum * a.batch_size * a.seq_length * 2
        data = make_shards(Path(tmp) / "packed", min(vocab, 65000), need)
        results: dict[str, list] = {m: [] for m in modes}
        losses: dict[str, list] = {m: [] for m in modes}
        precision: dict[str, str] = {}
        mem: dict[str, float] = {}
        for i in range(a.repeats):
            for mode in modes if i % 2 == 0 else modes[::-1]:
                args = (
                    [sys.executable, __file__, "--mode", mode, "--data", str(data)]
                    + [
                        f"--{k.replace('_', '-')}={v}"
                        for k, v in vars(a).items()
                        if k not in ("mode", "data", "fp32", "repeats", "vs") and v is not None
                    ]
                    + (["--fp32"] if a.fp32 else [])
                )
                r = subprocess.run(args, capture_output=True, text=True)
                line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
                if r.returncode != 0 or not line:
                    sys.exit(f"{mode} run failed:\n{r.stderr[-3000:]}")
                res = json.loads(line[-1][7:])
                results[mode] += res["step_s"]
                losses[mode] += res["loss"]
                precision[mode] = res["precision"]
                mem[mode] = max(mem.get(mode, 0.0), res["peak_mb"])
    tokens = a.batch_size * a.accum * a.seq_length
    med = {m: statistics.median(v) for m, v in results.items()}
    import torch

    from dlm.device import cpu_bf16_isa, cpu_name

    mem_kind = "peak CUDA MiB" if torch.cuda.is_available() else "peak RSS MiB"
    where = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"{cpu_name()} (bf16 instructions: {', '.join(cpu_bf16_isa()) or 'none'}), load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"\nbench/train.py: {a.model}, I-DLM b2, {'gated q/v LoRA r=64' if a.adapters == 'gated' else 'all weights'}, "
        f"seq {a.seq_length}, batch {a.batch_size} x accum {a.accum}, {a.steps} timed steps x {a.repeats} run(s) per "
        f"mode, torch threads {torch.get_num_threads()}, {where}"
    )
    print(f"| loop | precision | s/step (median) | tokens/s | {mem_kind} | mean loss | n |")
    print("|---|---|---|---|---|---|---|")
    for m in modes:
        print(
            f"| {m} | {precision[m]} | {med[m]:.3f} | {tokens / med[m]:.1f} | {mem[m]:.0f} | "
            f"{statistics.fmean(losses[m]):.4f} | {len(results[m])} |"
        )
    first, second = modes
    ratio = med[second] / med[first]
    goal = f" (goal <= 1.10: {'met' if ratio <= 1.10 else 'NOT met'})" if a.vs == "plain" else ""
    print(f"\n{second} / {first} time per step: {ratio:.3f}{goal}; memory ratio {mem[second] / mem[first]:.3f}")


if __name__ == "__main__":
    main()
