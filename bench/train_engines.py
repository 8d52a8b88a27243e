"""Memory of the training engines, per process: DDP against FSDP2 full sharding and DeepSpeed ZeRO-2 / ZeRO-3
(with and without gradient checkpointing) in two CPU processes, and dlm's objectives against a plain AR fine-tune of the same model in one
process - a random Llama (about 230M parameters by default), AdamW, a few steps each, in the same run.

Every run is its own process tree; `dlm train` records per rank, in the end record of train_log.jsonl, the peak
resident set (RSS) and the RSS after the last step (before the final model is gathered and written). The plain AR fine-tune is the ~20-line loop a user writes (the causal LM
loss of the transformers model, the same AdamW). Timings are not the point (two processes share two cores here).

    python bench/train_engines.py                         # hidden 1024, 16 layers, vocab 32000 (234M), seq 256
    python bench/train_engines.py --hidden 512 --layers 8 # a quick look

Prints a table: run, processes, peak RSS and RSS after the last step, MiB per rank (max over ranks), each with its
ratio to DDP (engines) or to the plain AR loop (objectives), and the last loss.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = ROOT / "dlm" / "configs" / "accelerate"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain_ar(a) -> dict:
    """The baseline: a plain causal-LM fine-tune of the same model on the same blocks."""
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    from dlm.data.loader import build_packed_dataset

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    blocks = iter(build_packed_dataset(a.data, "train", block_size=a.seq_length, seed=0, rank=0, world_size=1))
    loss = None
    for _ in range(a.steps):
        ids = torch.stack([next(blocks) for _ in range(a.batch_size)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    from dlm.device import memory_mib

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak": [peak], "held": [memory_mib(torch.device("cpu"))], "loss": float(loss)}


def dlm_run(a, out: Path, objective: str, launcher: str | None, *extra: str) -> dict:
    args = [
        "-m", "dlm", "train", "--model", a.model_dir, "--objective", objective, "--packed-data-dir", a.data,
        "--packed-prefixes", "train", "--seq-length", str(a.seq_length), "--batch-size", str(a.batch_size),
        "--max-train-steps", str(a.steps), "--learning-rate", "1e-5", "--output-dir", str(out),
        "--train.progress", "false", "--train.mixed_precision", "no", "--save-every", "0", *extra,
    ]  # fmt: skip
    if objective in ("idlm", "block"):
        args += ["--block-size", "2"]
    if launcher is None:
        cmd = [sys.executable, *args]
    else:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE / launcher),
            "--main_process_port", str(free_port()), *args,
        ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        sys.exit(f"{objective} {launcher} failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    end = next(x for x in recs if x.get("event") == "end")
    engine = next(x for x in recs if x.get("event") == "start")["distributed_type"]
    return {
        "peak": end["peak_memory_mib"],
        "held": end["trained_memory_mib"],
        "loss": [x for x in recs if "loss" in x][-1]["loss"],
        "engine": engine,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.mode == "plain":
        print("RESULT " + json.dumps(plain_ar(a)))
        return

    from shapes import machine
    from train import make_shards

    from dlm.testing import save_tiny

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        a.model_dir = str(
            save_tiny(
                tmp / "model",
                hidden=a.hidden,
                layers=a.layers,
                heads=a.hidden // 64,
                kv_heads=a.hidden // 64,
                vocab_size=a.vocab,
                max_positions=max(512, a.seq_length),
            )
        )
        need = (a.steps + 2) * a.batch_size * a.seq_length * 4
        a.data = str(make_shards(tmp / "packed", 300, max(need, 4 * 8192)))  # a shard file per rank at least
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(a.model_dir)
        n_params = 2 * cfg.vocab_size * cfg.hidden_size + cfg.num_hidden_layers * (
            4 * cfg.hidden_size**2 + 3 * cfg.hidden_size * cfg.intermediate_size
        )
        rows = []
        r = subprocess.run(
            [sys.executable, __file__, "--mode", "plain", "--model-dir", a.model_dir, "--data", a.data]
            + [f"--seq-length={a.seq_length}", f"--batch-size={a.batch_size}", f"--steps={a.steps}"],
            capture_output=True,
            text=True,
        )
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            sys.exit(f"plain AR loop failed:\n{r.stderr[-3000:]}")
        plain = json.loads(line[-1][7:])
        rows.append(("plain AR fine-tune (transformers loop)", 1, plain, "objectives"))
        for obj in ("idlm", "mdm"):
            rows.append((f"dlm train --objective {obj}", 1, dlm_run(a, tmp / f"one_{obj}", obj, None), "objectives"))
        runs = [
            ("DDP, idlm", "ddp_cpu.yaml", ()),
            ("FSDP2 full sharding, idlm", "fsdp_cpu.yaml", ()),
            ("FSDP2 + gradient checkpointing, idlm", "fsdp_cpu.yaml", ("--gradient-checkpointing",)),
            ("DDP + gradient checkpointing, idlm", "ddp_cpu.yaml", ("--gradient-checkpointing",)),
        ]
        import importlib.util

        if importlib.util.find_spec("deepspeed") is not None:
            runs += [
                ("DeepSpeed ZeRO-2, idlm", "deepspeed_zero2_cpu.yaml", ()),
                ("DeepSpeed ZeRO-3, idlm", "deepspeed_zero3_cpu.yaml", ()),
                (
                    "DeepSpeed ZeRO-3 + gradient checkpointing, idlm",
                    "deepspeed_zero3_cpu.yaml",
                    ("--gradient-checkpointing",),
                ),
            ]
        else:
            print("DeepSpeed is not installed: no ZeRO rows (pip install 'dlm[deepspeed]')", file=sys.stderr)
        for i, (name, launcher, extra) in enumerate(runs):
            rows.append((name, 2, dlm_run(a, tmp / f"eng{i}", "idlm", launcher, *extra), "engines"))

    print(
        f"\nbench/train_engines.py: random Llama, {n_params / 1e6:.0f}M parameters (hidden {a.hidden}, {a.layers} "
        f"layers, vocab {a.vocab}), fp32, AdamW, seq {a.seq_length} x batch {a.batch_size}, {a.steps} steps; "
        f"{machine()}, load {os.getloadavg()[0]:.1f}"
    )
    print(
        "| run | processes | peak RSS MiB per rank (max) | ratio | RSS after the last step (max) | ratio | last loss |"
    )
    print("|---|---|---|---|---|---|---|")
    base = {"objectives": rows[0][2], "engines": rows[3][2]}
    for name, procs, res, group in rows:
        peak, held = max(res["peak"]), max(res["held"])
        ref = "plain AR" if group == "objectives" else "DDP"
        b = base[group]
        print(
            f"| {name} | {procs} | {peak:.0f} | {peak / max(b['peak']):.2f}x {ref} | {held:.0f} | "
            f"{held / max(b['held']):.2f}x | {res['loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
