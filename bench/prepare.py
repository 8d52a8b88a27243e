"""Benchmark `dlm prepare` against the reference data-prep approach, in the same run.

Corpus: tinyshakespeare cut into ~2,000-character documents, repeated into several parquet files (>= 5M tokens
with the smollm2-135m tokenizer, vocab 49152 -> uint16 shards).

- baseline: what the reference scripts do - one process, record batches from each parquet file, one tokenizer call
  per document (``tokenizer(text)["input_ids"]`` + EOS), packed by the lit-gpt builder (docs/algorithms.md#shards) (``add_array``).
- dlm prepare: ``prepare(PrepareConfig(..., num_processes=N))`` - the whole command, timed end to end including
  tokenizer loading and worker start-up (the baseline's timing excludes its tokenizer loading).

Both must produce the same number of tokens. Usage:
    python bench/prepare.py [--copies 16] [--files 8] [--num-processes 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent.parent / "shared" / "data" / "corpus" / "tinyshakespeare.txt"


def make_corpus(folder: Path, copies: int, files: int, doc_chars: int = 2000) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = CORPUS.read_text()
    docs, cur = [], ""
    for para in text.split("\n\n"):
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= doc_chars:
            docs.append(cur)
            cur = ""
    if cur:
        docs.append(cur)
    per_file = copies // files
    for i in range(files):
        rows = docs * per_file
        pq.write_table(
            pa.table({"id": list(range(len(rows))), "text": rows}),
            folder / f"part-{i:03d}.parquet",
            row_group_size=1024,
        )
    return len(docs) * per_file * files


class ReferenceBuilder:
    """lit-gpt's PackedDatasetBuilder (docs/algorithms.md#shards), as the reference scripts use it."""

    def __init__(self, outdir, prefix, chunk_size, sep_token, dtype):
        self._outdir, self._prefix, self._chunk_size = outdir, prefix, chunk_size
        self._dtype = dtype
        self._arr = np.full(chunk_size, sep_token, dtype=dtype)
        self._sep, self._idx, self._counter = sep_token, 0, 0

    def _write_chunk(self):
        name = os.path.join(self._outdir, f"{self._prefix}_{self._counter:010d}.bin")
        with open(name, "wb") as f:
            f.write(b"LITPKDS" + (1).to_bytes(8, "little") + bytes([8]) + self._chunk_size.to_bytes(8, "little"))
            f.write(self._arr.tobytes(order="C"))
        self._counter += 1
        self._arr.fill(self._sep)
        self._idx = 0

    def add_array(self, arr):
        while self._idx + arr.shape[0] > self._chunk_size:
            part_len = self._chunk_size - self._idx
            self._arr[self._idx : self._idx + part_len] = arr[:part_len]
            self._write_chunk()
            arr = arr[part_len:]
        self._arr[self._idx : self._idx + arr.shape[0]] = arr
        self._idx += arr.shape[0]


def baseline(src: Path, dest: Path, tokenizer, chunk_size: int) -> tuple[int, float]:
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    eos = tokenizer.eos_token_id
    builder = ReferenceBuilder(str(dest), "train", chunk_size, eos, np.uint16)
    tokens = 0
    for path in sorted(src.glob("*.parquet")):
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["text"]):
            for text in batch.column(0).to_pylist():
                ids = tokenizer(text)["input_ids"] + [eos]
                arr = np.array(ids, dtype=np.uint16)
                builder.add_array(arr)
                tokens += len(ids)
    return tokens, time.perf_counter() - t0


def cpu_seconds() -> float:
    """User + system CPU of this process and its finished children (the spawned prepare workers)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=16, help="copies of tinyshakespeare (~341k tokens each)")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--chunk-size", type=int, default=2049 * 1024)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core for the one-process rows
    from dlm.data.prepare import PrepareConfig, prepare
    from dlm.model.hub import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dlm-bench-prepare-") as tmp:
        tmp = Path(tmp)
        (tmp / "src").mkdir()
        n_docs = make_corpus(tmp / "src", args.copies, args.files)
        (tmp / "base").mkdir()
        load = os.getloadavg()[0]
        c0 = cpu_seconds()
        base_tokens, base_s = baseline(tmp / "src", tmp / "base", tokenizer, args.chunk_size)
        rows.append(("baseline: per-doc tokenizer call, 1 process", base_tokens, base_s, cpu_seconds() - c0))
        for procs in sorted({1, args.num_processes}):
            c0 = cpu_seconds()
            s = prepare(
                PrepareConfig(
                    str(tmp / "src"),
                    str(tmp / f"dlm{procs}"),
                    tokenizer="smollm2-135m",
                    num_processes=procs,
                    chunk_size=args.chunk_size,
                    progress=False,
                )
            )
            if s["tokens"] != base_tokens:
                print(f"MISMATCH: dlm prepare produced {s['tokens']} tokens, baseline {base_tokens}", file=sys.stderr)
                return 1
            rows.append((f"dlm prepare --num-processes {procs}", s["tokens"], s["seconds"], cpu_seconds() - c0))
    print(
        f"corpus: {n_docs:,} documents in {args.files} parquet files, {base_tokens:,} tokens "
        f"(smollm2-135m tokenizer, chunk size {args.chunk_size:,}); {os.cpu_count()} CPU cores, "
        f"load average {load:.1f} at start (the machine is shared: wall-clock rates depend on it)"
    )
    print(
        f"| {'run':<45} | {'tokens':>10} | {'wall s':>7} | {'tokens/s':>10} | {'vs base':>7} | {'CPU s':>6} | "
        f"{'tok/CPU-s':>10} | {'vs base':>7} |"
    )
    print(f"|{'-' * 47}|{'-' * 11}:|{'-' * 8}:|{'-' * 11}:|{'-' * 8}:|{'-' * 7}:|{'-' * 11}:|{'-' * 8}:|")
    base_rate, base_cpu_rate = base_tokens / base_s, base_tokens / rows[0][3]
    results = []
    for name, tokens, secs, cpu in rows:
        rate, cpu_rate = tokens / secs, tokens / cpu
        results.append(
            {
                "run": name,
                "tokens": tokens,
                "seconds": secs,
                "tokens_per_s": rate,
                "ratio": rate / base_rate,
                "cpu_seconds": cpu,
                "tokens_per_cpu_s": cpu_rate,
                "cpu_ratio": cpu_rate / base_cpu_rate,
                "load_average": load,
            }
        )
        print(
            f"| {name:<45} | {tokens:>10,} | {secs:>7.2f} | {rate:>10,.0f} | {rate / base_rate:>6.2f}x | "
            f"{cpu:>6.2f} | {cpu_rate:>10,.0f} | {cpu_rate / base_cpu_rate:>6.2f}x |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
