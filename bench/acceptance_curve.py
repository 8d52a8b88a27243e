"""How an I-DLM's held-out draft acceptance grows with training, past what a CPU budget reaches.

Trains the `dlm quickstart` recipe (gated LoRA I-DLM on self-distilled chat answers: the same adapters, loss,
optimizer, batch and sequence length, through `dlm train`) for one block size, and evaluates `isd_acceptance`
(greedy ISD at N = block size + 1 on the built-in held-out instructions, output checked against greedy AR) every
--eval-every optimizer steps, and once before training.

    python bench/acceptance_curve.py --data runs/quickstart/data/self_distill.jsonl --steps 1000 --eval-every 250
    python bench/acceptance_curve.py --data D --minutes 4 --steps 100000 --eval-every 500   # time-bounded (GPU)
    python bench/acceptance_curve.py --data D --lora-targets all-linear --lora-r 32 ...     # another adapter layout
    python bench/acceptance_curve.py --data D --adapters merged ...   # LoRA on every position (ISD == its own AR)

On this 2-core CPU one step takes ~2.3 s (the quickstart's 30 minutes are ~500 steps of b1 and ~250 of b2); on a
GPU the same curve goes many times further in minutes. Prints a table (step, epochs of the data, training seconds,
acceptance per draft position, TPF, share of prompts whose ISD output equals AR); --json writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    from dlm.quickstart import QuickstartConfig

    d = QuickstartConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=d.model)
    p.add_argument("--data", required=True, help="chat JSONL (e.g. a quickstart run's data/self_distill.jsonl)")
    p.add_argument("--output", help="run folder (default: a temporary one, removed afterwards)")
    p.add_argument("--block-size", type=int, default=1, help="masks per block; N = block size + 1 (default 1)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    p.add_argument("--minutes", type=float, help="stop after this many training minutes as well")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-prompts", type=int, default=48, help="held-out instructions per evaluation (<= 320)")
    p.add_argument("--eval-batch-size", type=int, default=16)
    p.add_argument(
        "--adapters",
        default=d.adapters,
        choices=("gated", "merged"),
        help="gated (the quickstart default) or merged: plain LoRA on every position, CE_clean on",
    )
    p.add_argument("--lora-r", type=int, default=None, help="default: the quickstart's for --adapters")
    p.add_argument("--lora-targets", default=None, help="default: the quickstart's for --adapters")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate)
    p.add_argument("--lr-schedule", default=d.lr_schedule, choices=("constant", "wsd", "cosine"))
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-length", type=int, default=d.seq_length)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bf16",
        action="store_true",
        help="train with bf16 autocast on a GPU (default fp32, as on a "
        "CPU; the evaluations then run under the same autocast)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --output up to --steps (its eval "
        "history is kept; the step-0 row comes from --json of the first run, if given and present)",
    )
    p.add_argument("--json", help="write the table's rows here")
    a = p.parse_args()

    from dlm.config import load_config
    from dlm.device import get_device
    from dlm.eval import EvalSettings, run_eval
    from dlm.model.convert import convert_ar_to_dlm
    from dlm.quickstart import lora_settings, stage_overrides
    from dlm.train.loop import train

    if not Path(a.data).is_file():
        sys.exit(f"--data '{a.data}' does not exist")
    if a.resume and not (a.output and (Path(a.output) / "run" / "checkpoints").is_dir()):
        sys.exit("--resume needs the --output folder of an earlier run (with run/checkpoints)")
    cfg = QuickstartConfig(
        model=a.model,
        adapters=a.adapters,
        lora_r=a.lora_r,
        lora_targets=a.lora_targets,
        learning_rate=a.learning_rate,
        lr_schedule=a.lr_schedule,
        batch_size=a.batch_size,
        seq_length=a.seq_length,
        seed=a.seed,
    ).validate()
    a.lora_r, a.lora_targets = cfg.lora_r, cfg.lora_targets
    tmp = None if a.output else tempfile.TemporaryDirectory(prefix="dlm-acc-curve-")
    out = Path(a.output or tmp.name)
    records = sum(1 for line in open(a.data) if line.strip())

    dlm = convert_ar_to_dlm(cfg.model, "idlm", block_size=a.block_size, lora=lora_settings(cfg))
    device = get_device()  # the device train() will use ($DLM_DEVICE, else cuda > mps > cpu)
    dlm.to(device)
    if a.resume:
        prev = json.loads(Path(a.json).read_text())["rows"] if a.json and Path(a.json).is_file() else []
        r0 = next((r for r in prev if r["step"] == 0), None)
    else:
        t = time.perf_counter()
        r0 = run_eval(dlm, ["isd_acceptance"], EvalSettings(limit=a.eval_prompts, batch_size=a.eval_batch_size))[
            "isd_acceptance"
        ]
        print(
            f"step 0: acceptance {r0['acceptance']} TPF {r0['tpf']:.3f} ({time.perf_counter() - t:.1f} s)", flush=True
        )

    over = stage_overrides(
        cfg,
        a.block_size,
        Path(a.data),
        out / "run",
        minutes=a.minutes,
        seed=a.seed,
        resume="auto" if a.resume else None,
        max_train_steps=a.steps,
        save_every=0,
    )
    over["eval"] = {
        "eval_every": a.eval_every,
        "eval_tasks": ["isd_acceptance"],
        "eval_limit": a.eval_prompts,
        "eval_batch_size": a.eval_batch_size,
    }
    over["train"]["progress"] = False
    over["train"]["mixed_precision"] = "auto" if a.bf16 else "no"
    tcfg = load_config(None, over)
    t = time.time()
    train(tcfg, dlm=dlm)
    wall = time.time() - t

    log = [json.loads(x) for x in (out / "run" / "train_log.jsonl").read_text().splitlines()]
    elapsed, offset, last = {}, 0.0, 0.0  # training seconds, summed over a resumed run's pieces
    for r in log:
        if r.get("event") == "resume":
            offset = last
        if "loss" in r and "elapsed_s" in r:
            last = elapsed[r["step"]] = offset + r["elapsed_s"]
    start = next((r for r in log if r.get("event") == "start"), {})
    history = (
        [json.loads(x) for x in (out / "run" / "eval_history.jsonl").read_text().splitlines()]
        if (out / "run" / "eval_history.jsonl").is_file()
        else []
    )
    rows = (
        []
        if r0 is None
        else [
            {
                "step": 0,
                "epochs": 0.0,
                "train_s": 0.0,
                "acceptance": r0["acceptance"],
                "tpf": r0["tpf"],
                "identical": r0["identical"],
            }
        ]
    )
    for h in history:
        m = h["metrics"]
        acc = [m["isd_acceptance/acc"]] + [m[f"isd_acceptance/acc_pos{i}"] for i in range(2, a.block_size + 1)]
        step = h["step"]
        rows.append(
            {
                "step": step,
                "epochs": step * a.batch_size / max(records, 1),
                "train_s": elapsed.get(step, float("nan")),
                "acceptance": acc,
                "tpf": m["isd_acceptance/tpf"],
                "identical": m["isd_acceptance/identical"],
            }
        )
    print(
        f"\nbench/acceptance_curve.py: {a.model}, I-DLM b{a.block_size} (N={a.block_size + 1}), adapters "
        f"{a.adapters} {a.lora_targets} r{a.lora_r}, lr {a.learning_rate} {a.lr_schedule}, "
        f"batch {a.batch_size} x "
        f"{a.seq_length}, {records} chat records ({a.data}); device {start.get('device', device)}, "
        f"precision {start.get('mixed_precision', '?')}; {a.eval_prompts} held-out prompts x 64 tokens, greedy; "
        f"{wall:.0f} s in train()"
    )
    print("| step | epochs | train s | acceptance per draft position | TPF | ISD == AR |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        acc = ", ".join(f"{x:.3f}" for x in r["acceptance"])
        print(
            f"| {r['step']} | {r['epochs']:.1f} | {r['train_s']:.0f} | {acc} | {r['tpf']:.3f} | {r['identical']:.0%} |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
