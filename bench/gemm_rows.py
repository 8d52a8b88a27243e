"""What one more row costs in each matmul of a decode forward: where an ISD chunk's extra tokens go on a CPU.

    python bench/gemm_rows.py                       # SmolLM2-135M's shapes (30 layers), fp32, rows 1,2,3,5
    python bench/gemm_rows.py --hidden 896 --intermediate 4864 --kv 128 --vocab 151936 --layers 24   # Qwen2-0.5B

Each projection is timed the way a forward meets it: one weight matrix per layer (``--layers`` distinct copies,
cycled, so the weights stream from memory as they do in a real forward, not from cache), ``x [M, in] @ W.T``
through ``F.linear`` for M rows (M = 1: an AR step at batch 1; M = 3: an ISD N=2 verify chunk). The table gives
microseconds per call and the per-forward total (calls x layers), and the ratio of each M to M = 1. At batch 1 an
AR step is memory-bound: the extra rows cost only as much as the BLAS kernel for a few rows streams the weights
less efficiently than the one-row kernel does.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def per_call_us(weights: list[torch.Tensor], x: torch.Tensor, repeats: int) -> float:
    with torch.inference_mode():
        for w in weights:  # warm-up
            F.linear(x, w)
        t0 = time.perf_counter()
        for _ in range(repeats):
            for w in weights:
                F.linear(x, w)
    return (time.perf_counter() - t0) / repeats / len(weights) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--kv", type=int, default=192, help="k/v projection width (kv heads x head dim)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", default="1,2,3,5", help="comma-separated M (the first is the reference)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    h, i, kv = args.hidden, args.intermediate, args.kv
    # (name, out, in, calls per layer); lm_head once per forward
    shapes = [("q_proj + o_proj", h, h, 2), ("k_proj + v_proj", kv, h, 2), ("gate_proj + up_proj", i, h, 2),
              ("down_proj", h, i, 1)]
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, fp32, {args.layers} layers, weights cycled (cold in cache)")
    head = f"{'matmul':<20} {'calls':>5} " + " ".join(f"{'M=' + str(m) + ' us':>9}" for m in rows)
    print(head + "   per forward (ms) by M")
    totals = {m: 0.0 for m in rows}
    for name, out_f, in_f, calls in shapes:
        ws = [torch.randn(out_f, in_f) for _ in range(args.layers * calls)]
        us = {m: per_call_us(ws, torch.randn(m, in_f), args.repeats) for m in rows}
        for m in rows:
            totals[m] += us[m] * args.layers * calls / 1000
        print(f"{name:<20} {args.layers * calls:>5} " + " ".join(f"{us[m]:>9.0f}" for m in rows) + "   " +
              " ".join(f"{us[m] * args.layers * calls / 1000:.1f}" for m in rows))
        del ws
    w = torch.randn(args.vocab, h)
    us = {m: per_call_us([w], torch.randn(m, h), args.repeats) for m in rows}
    for m in rows:
        totals[m] += us[m] / 1000
    print(f"{'lm_head':<20} {1:>5} " + " ".join(f"{us[m]:>9.0f}" for m in rows) + "   " +
          " ".join(f"{us[m] / 1000:.1f}" for m in rows))
    ref = totals[rows[0]]
    print("all matmuls (ms):   " + ", ".join(f"M={m} {totals[m]:.1f} ({totals[m] / ref:.2f}x)" for m in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
