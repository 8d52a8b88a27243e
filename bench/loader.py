"""Benchmark PackedDataset read throughput (one process) against a naive per-block file read, in the same run.

Shards: ``--files`` random uint16 shards of 2049*1024 tokens (the default chunk size) in a temp folder; blocks of
2049 tokens (seq_length 2048 + 1), shuffled windows of 8 files, int64 tensors out, as the trainer gets them.
The baseline opens the file and reads each block with ``np.fromfile`` (no memory map, no window).

    python bench/loader.py [--files 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dlm.data.loader import PackedDataset
from dlm.data.shards import HDR_SIZE, write_shard

CHUNK, BLOCK = 2049 * 1024, 2049


def naive(files, block):
    n = 0
    for f in files:
        for b in range(CHUNK // block):
            arr = np.fromfile(f, dtype=np.uint16, count=block, offset=HDR_SIZE + 2 * b * block)
            n += torch.from_numpy(arr.astype(np.int64)).numel()
    return n


def packed(files, block):
    n = 0
    for x in PackedDataset(files, block, n_chunks=8, seed=0, shuffle=True, rank=0, world_size=1):
        n += x.numel()
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the data per reader (best is reported)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="dlm-bench-loader-") as tmp:
        files = []
        for i in range(args.files):
            p = Path(tmp) / f"b_{i:010d}.bin"
            write_shard(p, rng.integers(0, 49152, CHUNK, dtype=np.uint16))
            files.append(str(p))
        rows = []
        for name, fn in (("baseline: np.fromfile per block", naive), ("PackedDataset (memmap, shuffled)", packed)):
            best = None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                n = fn(files, BLOCK)
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            rows.append((name, n, best))
    print(
        f"{args.files} shards x {CHUNK:,} uint16 tokens, block {BLOCK}, one process, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(f"| {'reader':<34} | {'tokens':>11} | {'seconds':>7} | {'tokens/s':>13} | {'vs baseline':>11} |")
    print(f"|{'-' * 36}|{'-' * 12}:|{'-' * 8}:|{'-' * 14}:|{'-' * 12}:|")
    base = rows[0][1] / rows[0][2]
    for name, n, dt in rows:
        print(f"| {name:<34} | {n:>11,} | {dt:>7.3f} | {n / dt:>13,.0f} | {n / dt / base:>10.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
