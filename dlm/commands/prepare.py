"""Text (parquet / JSONL[.gz|.zst] / .txt) -> TinyLlama-compatible packed token shards (LITPKDS) + manifest.json.

Example:
  dlm prepare --source-path data/ --tokenizer smollm2-135m --destination-path packed/ \\
      --prefix train_parquet --pattern '*.parquet' --num-processes 2

Each worker process packs its own files into {prefix}_{proc}_{counter:010d}.bin ({prefix}_{counter:010d}.bin with
one process); the output does not depend on timing. An interrupted run (Ctrl-C, crash, SIGKILL) rerun with the same
arguments resumes and ends with exactly the shards of an uninterrupted run.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source-path", required=True, help="folder of input files, or one file")
    parser.add_argument("--destination-path", required=True, help="folder for the .bin shards and manifest.json")
    parser.add_argument(
        "--tokenizer",
        default="smollm2-135m",
        help="alias (smollm2-135m), hub id (org/name) or a local Hugging Face tokenizer folder (default: %(default)s)",
    )
    parser.add_argument("--prefix", default="train", help="shard file-name prefix (default: %(default)s)")
    parser.add_argument(
        "--pattern",
        default=None,
        help="glob of input files inside --source-path, e.g. '*.parquet' or '**/*.jsonl.zst' "
        "(default: every .parquet, .jsonl/.json[.gz|.zst] and .txt file, recursively)",
    )
    parser.add_argument(
        "--num-processes",
        type=int,
        default=1,
        help="worker processes; the work is split by file (default: %(default)s)",
    )
    parser.add_argument(
        "--text-column",
        default="auto",
        help="column/field holding the text; auto tries text, content, body, then the first "
        "string column (default: %(default)s)",
    )
    parser.add_argument(
        "--percentage",
        type=float,
        default=1.0,
        help="fraction of the (sorted) input files to use, in (0, 1] (default: %(default)s)",
    )
    parser.add_argument(
        "--skip-redpajama-github",
        action="store_true",
        help="drop rows whose meta.redpajama_set_name is RedPajamaGithub",
    )
    parser.add_argument(
        "--write-remainder",
        action="store_true",
        help="also write each worker's last partial chunk (padded with the sep token)",
    )
    parser.add_argument("--no-eos", action="store_true", help="do not append EOS after each document")
    parser.add_argument(
        "--chunk-size", type=int, default=2049 * 1024, help="tokens per shard (default: 2049*1024 = %(default)s)"
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "uint16", "int32"),
        default="auto",
        help="token dtype in the shards; auto = uint16 below 65500 ids, else int32",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace shards of this prefix written with a different configuration"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from dlm.data.prepare import PrepareConfig, prepare

    cfg = PrepareConfig(
        source_path=args.source_path,
        destination_path=args.destination_path,
        tokenizer=args.tokenizer,
        prefix=args.prefix,
        pattern=args.pattern,
        num_processes=args.num_processes,
        text_column=args.text_column,
        percentage=args.percentage,
        skip_redpajama_github=args.skip_redpajama_github,
        write_remainder=args.write_remainder,
        eos=not args.no_eos,
        chunk_size=args.chunk_size,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    s = prepare(cfg)
    if s.get("already_complete"):
        print(f"dlm prepare: prefix '{cfg.prefix}' in {s['destination']} is already complete (same configuration)")
    skipped = ", ".join(f"{k}={v:,}" for k, v in s["rows_skipped"].items()) or "none"
    print(
        f"dlm prepare: {s['files']:,} files, {s['documents']:,} documents, {s['tokens']:,} tokens -> "
        f"{s['shards']:,} shards in {s['destination']} ({s['tokens_in_shards']:,} tokens in shards, "
        f"{s['tokens_dropped']:,} dropped in partial chunks; rows skipped: {skipped}; "
        f"{s['tokens_per_s']:,.0f} tokens/s)"
    )
    return 0
