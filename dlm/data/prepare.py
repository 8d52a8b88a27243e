"""``dlm prepare``: text (parquet / JSONL[.gz|.zst] / plain .txt) -> TinyLlama-compatible packed token shards.

How the work is laid out, and why the output does not depend on timing:

- The source files are sorted and assigned to ``num_processes`` workers up front (greedy by file size, ties by
  name). Worker ``p`` packs its files in order with its own :class:`~dlm.data.shards.ShardWriter`, into files
  named ``{prefix}_{p}_{counter:010d}.bin`` (TinyLlama's naming; with one process simply
  ``{prefix}_{counter:010d}.bin``). The bytes each worker writes are therefore a function of the inputs only.
  Each worker drops (or, with ``--write-remainder``, writes) its own partial last buffer.
- Tokenization is batched: the texts of many rows go through the fast tokenizer's ``encode_batch_fast`` at once
  (same ids as ``tokenizer(text)["input_ids"]``, i.e. with the tokenizer's own special tokens such as BOS),
  followed by the EOS id unless ``--no-eos``.
- Crash safety: shards are written to ``.<name>.tmp`` and renamed when complete; after every source file a
  worker atomically writes a checkpoint (files done, shard counter, the pending partial buffer, per-file stats)
  under ``<destination>/.dlm-prepare-<prefix>/``. A rerun with the same arguments (even after SIGKILL) deletes
  any shard written after a worker's last checkpoint, restores the buffer and continues with the next file, so
  it ends with exactly the shards of an uninterrupted run. The manifest is written last; the checkpoint folder is
  then removed.
- A user error (bad path, corrupt file, too little data, ...) raises :class:`~dlm.errors.DLMError` and removes
  what this prefix's run had written, so there is never partial output.

The test hook ``DLM_PREPARE_TEST_DELAY_S`` (seconds slept after each source file) exists only so that the
crash-resume test can kill a run in the middle.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import struct
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dlm.data.shards import (
    MANIFEST_NAME,
    RESUME_FIX,
    ShardWriter,
    atomic_write_text,
    choose_dtype,
    read_manifest,
    update_manifest,
)
from dlm.errors import DLMError
from dlm.fsutil import DiskFullError, disk_full_as_error
from dlm.model.hub import load_tokenizer
from dlm.settings import env

DEFAULT_CHUNK_SIZE = 2049 * 1024
TEXT_COLUMNS = ("text", "content", "body")
KINDS = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".txt": "txt"}
COMPRESSIONS = {".gz": "gz", ".zst": "zst"}
BATCH_CHARS = 4 << 20  # characters of text per tokenizer call
BATCH_ROWS = 4096
TXT_PIECE = 1 << 20


@dataclass
class PrepareConfig:
    """Everything ``dlm prepare`` needs; the fields mirror the CLI flags."""

    source_path: str
    destination_path: str
    tokenizer: str = "smollm2-135m"
    prefix: str = "train"
    pattern: str | None = None
    num_processes: int = 1
    text_column: str = "auto"
    percentage: float = 1.0
    skip_redpajama_github: bool = False
    write_remainder: bool = False
    eos: bool = True
    chunk_size: int = DEFAULT_CHUNK_SIZE
    dtype: str = "auto"
    overwrite: bool = False
    progress: bool = True


@dataclass
class SourceFile:
    path: str  # absolute
    rel: str  # relative to the source path (as recorded in the manifest)
    kind: str  # parquet | jsonl | txt
    compression: str | None
    size: int
    column: str | None = None  # resolved text column (parquet/jsonl)


@dataclass
class FileStats:
    file: str
    process: int
    rows_read: int = 0
    documents_written: int = 0
    tokens: int = 0
    rows_skipped: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------- discovery


def _classify(path: Path) -> tuple[str | None, str | None]:
    suffixes = [s.lower() for s in path.suffixes]
    compression = None
    if suffixes and suffixes[-1] in COMPRESSIONS:
        compression = COMPRESSIONS[suffixes[-1]]
        suffixes = suffixes[:-1]
    kind = KINDS.get(suffixes[-1]) if suffixes else None
    if kind == "parquet" and compression:
        return None, None
    if kind == "txt" and compression:
        return None, None
    return kind, compression


def discover_files(source: str, pattern: str | None, percentage: float) -> list[SourceFile]:
    src = Path(source).expanduser()
    if not src.exists():
        raise DLMError(
            f"--source-path '{source}' does not exist; pass a folder of parquet/jsonl/txt files or one such file"
        )
    if src.is_file():
        candidates, base = [src], src.parent
    else:
        base = src
        globbed = sorted(p for p in src.glob(pattern or "**/*") if p.is_file() and not p.name.startswith("."))
        if pattern is None:
            globbed = [p for p in globbed if _classify(p)[0] is not None]
        if not globbed:
            what = f"--pattern '{pattern}'" if pattern else "the supported types (.parquet, .jsonl[.gz|.zst], .txt)"
            present = sorted(p.name for p in src.iterdir())[:8]
            raise DLMError(
                f"no file in '{src}' matches {what} (the folder holds: {', '.join(present) or 'nothing'});"
                f" fix --pattern or --source-path"
            )
        candidates = globbed
    files = []
    for p in candidates:
        kind, comp = _classify(p)
        if kind is None:
            raise DLMError(
                f"'{p}' is not a supported input (.parquet, .jsonl/.json[.gz|.zst], .txt); narrow "
                f"--pattern to exclude it"
            )
        files.append(SourceFile(str(p.resolve()), str(p.relative_to(base)), kind, comp, p.stat().st_size))
    if not 0.0 < percentage <= 1.0:
        raise DLMError(f"--percentage must be in (0, 1], got {percentage}")
    keep = max(1, int(len(files) * percentage))  # reference: files[:int(len * percentage)], but never zero
    return files[:keep]


def _open_text(sf: SourceFile):
    """A text line iterator over a (possibly compressed) JSONL file; truncation raises DLMError."""
    if sf.compression == "zst":
        return _zst_lines(sf.path)
    if sf.compression == "gz":
        return io.TextIOWrapper(gzip.open(sf.path, "rb"), encoding="utf-8")
    return open(sf.path, encoding="utf-8")


def _zst_lines(path: str):
    import zstandard

    dctx = zstandard.ZstdDecompressor()

    def chunks():
        obj, done = dctx.decompressobj(), True
        with open(path, "rb") as fh:
            for raw in iter(lambda: fh.read(1 << 20), b""):
                while raw:
                    out = obj.decompress(raw)
                    done = obj.eof
                    if out:
                        yield out
                    raw = b""
                    if obj.eof:
                        raw = obj.unused_data
                        obj, done = dctx.decompressobj(), not raw
        if not done:
            raise DLMError(f"'{path}' is truncated (the zstd stream ends inside a frame); re-download or remove it")

    buf = b""
    for c in chunks():
        buf += c
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.decode("utf-8") + "\n"
    if buf:
        yield buf.decode("utf-8")


def _is_string_type(t) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)
    )


def _corrupt(sf: SourceFile, e: Exception) -> DLMError:
    return DLMError(
        f"{sf.kind} file '{sf.path}' is corrupt or truncated ({type(e).__name__}: {e}); "
        f"re-download it or remove it from --source-path"
    )


def _auto_column(strings: list[str]) -> str | None:
    """``--text-column auto``: the first of TEXT_COLUMNS among a file's string columns, else its first string
    column, else None."""
    return next((name for name in (*TEXT_COLUMNS, *strings) if name in strings), None)


def inspect_file(sf: SourceFile, text_column: str) -> None:
    """Check a file opens and resolve its text column (sets ``sf.column``); DLMError naming the file otherwise."""
    if sf.kind == "txt":
        return
    if sf.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            schema = pq.ParquetFile(sf.path).schema_arrow
        except Exception as e:
            raise _corrupt(sf, e) from e
        found = [(f.name, str(f.type)) for f in schema]
        listing = ", ".join(f"{n} ({t})" for n, t in found) or "none"
        if text_column != "auto":
            if text_column not in schema.names:
                raise DLMError(
                    f"--text-column '{text_column}' is not a column of '{sf.path}'; columns found: {listing}"
                )
            if not _is_string_type(schema.field(text_column).type):
                raise DLMError(
                    f"--text-column '{text_column}' of '{sf.path}' holds {schema.field(text_column).type},"
                    f" not text; columns found: {listing}"
                )
            sf.column = text_column
            return
        sf.column = _auto_column([f.name for f in schema if _is_string_type(f.type)])
        if sf.column is not None:
            return
        raise DLMError(
            f"no usable text column in '{sf.path}': columns found: {listing}; pass --text-column NAME "
            f"of a string column"
        )
    # jsonl: the first non-blank line decides
    try:
        with contextlib.closing(_open_text(sf)) as lines:
            first = None
            for lineno, line in enumerate(lines, 1):  # noqa: B007 - lineno is read after the loop
                if line.strip():
                    first = line
                    break
    except DLMError:
        raise
    except Exception as e:
        raise _corrupt(sf, e) from e
    if first is None:
        raise DLMError(f"JSONL file '{sf.path}' is empty; remove it or narrow --pattern")
    try:
        obj = json.loads(first)
    except ValueError as e:
        raise DLMError(f"JSONL file '{sf.path}' line {lineno} is not valid JSON ({e}); fix or remove the file") from e
    if not isinstance(obj, dict):
        raise DLMError(
            f"JSONL file '{sf.path}' line {lineno} is a {type(obj).__name__}, not an object with a text field"
        )
    listing = ", ".join(f"{k} ({type(v).__name__})" for k, v in obj.items()) or "none"
    if text_column != "auto":
        if text_column not in obj:
            raise DLMError(
                f"--text-column '{text_column}' is not a field of '{sf.path}' (first record); fields found: {listing}"
            )
        sf.column = text_column
        return
    sf.column = _auto_column([k for k, v in obj.items() if isinstance(v, str)])
    if sf.column is not None:
        return
    raise DLMError(
        f"no usable text column in '{sf.path}': fields found in the first record: {listing}; pass --text-column NAME"
    )


# --------------------------------------------------------------------------------------------- reading


def _skip_reason(value) -> str | None:
    if value is None:
        return "missing"
    if not isinstance(value, str):
        return "non_string"
    if not value.strip():
        return "empty"
    return None


def _iter_rows(sf: SourceFile, skip_rp: bool):
    """Yield batches ``(texts, rows_read, skipped Counter)`` of one parquet/jsonl file, streamed."""
    if sf.kind == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(sf.path)
            cols = [sf.column]
            has_meta = skip_rp and "meta" in pf.schema_arrow.names
            if has_meta:
                cols.append("meta")
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=cols):
                values = batch.column(0).to_pylist()
                sets = _redpajama_sets(batch.column(1)) if has_meta else None
                texts, skipped = [], Counter()
                for i, v in enumerate(values):
                    if sets is not None and sets[i] == "RedPajamaGithub":
                        skipped["redpajama_github"] += 1
                        continue
                    reason = _skip_reason(v)
                    if reason:
                        skipped[reason] += 1
                    else:
                        texts.append(v)
                yield texts, len(values), skipped
        except DLMError:
            raise
        except Exception as e:
            raise _corrupt(sf, e) from e
        return
    # jsonl
    texts, skipped, rows, chars = [], Counter(), 0, 0
    lineno = 0
    try:
        with contextlib.closing(_open_text(sf)) as lines:
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise DLMError(
                        f"JSONL file '{sf.path}' line {lineno} is not valid JSON ({e}); the file is "
                        f"corrupt or truncated: fix or remove it"
                    ) from e
                rows += 1
                if not isinstance(obj, dict):
                    skipped["not_an_object"] += 1
                    continue
                if skip_rp:
                    meta = obj.get("meta")
                    if isinstance(meta, dict) and meta.get("redpajama_set_name") == "RedPajamaGithub":
                        skipped["redpajama_github"] += 1
                        continue
                v = obj.get(sf.column)
                reason = _skip_reason(v)
                if reason:
                    skipped[reason] += 1
                    continue
                texts.append(v)
                chars += len(v)
                if len(texts) >= BATCH_ROWS or chars >= BATCH_CHARS:
                    yield texts, rows, skipped
                    texts, skipped, rows, chars = [], Counter(), 0, 0
    except DLMError:
        raise
    except Exception as e:
        raise _corrupt(sf, e) from e
    if rows:
        yield texts, rows, skipped


def _redpajama_sets(meta) -> list:
    import pyarrow as pa

    if pa.types.is_struct(meta.type):
        try:
            return meta.field("redpajama_set_name").to_pylist()
        except KeyError:
            return [None] * len(meta)
    out = []
    for v in meta.to_pylist():  # JSON strings in some dumps
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                v = None
        out.append(v.get("redpajama_set_name") if isinstance(v, dict) else None)
    return out


# --------------------------------------------------------------------------------------------- worker


def _shard_prefix(prefix: str, proc: int, num_processes: int) -> str:
    return prefix if num_processes == 1 else f"{prefix}_{proc}"


def shard_name_regex(prefix: str) -> re.Pattern:
    """Shard names ``dlm prepare`` writes for ``prefix`` (with or without a process index)."""
    return re.compile(rf"^{re.escape(prefix)}_(\d+_)?\d{{10}}\.bin$")


def _state_dir(dest: Path, prefix: str) -> Path:
    return dest / f".dlm-prepare-{prefix}"


def _save_state(path: Path, state: dict, pending: np.ndarray) -> None:
    blob = json.dumps(state).encode()
    tmp = path.with_name(path.name + ".tmp")
    try:
        with disk_full_as_error(path, RESUME_FIX):
            with open(tmp, "wb") as fh:
                fh.write(struct.pack("<Q", len(blob)))
                fh.write(blob)
                fh.write(pending.tobytes())
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _load_state(path: Path, dtype) -> tuple[dict, np.ndarray] | None:
    if not path.is_file():
        return None
    raw = path.read_bytes()
    try:
        (n,) = struct.unpack("<Q", raw[:8])
        state = json.loads(raw[8 : 8 + n])
        pending = np.frombuffer(raw[8 + n :], dtype=dtype).copy()
        if not isinstance(state, dict) or not {"files_done", "counter", "shards", "sources"} <= set(state):
            raise ValueError("not a prepare checkpoint")
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise DLMError(
            f"the resume checkpoint '{path}' of an interrupted dlm prepare is damaged ({e}); delete "
            f"the folder '{path.parent}' and its prefix's shards, or rerun with --overwrite"
        ) from e
    return state, pending


@dataclass
class _Job:
    proc: int
    files: list  # SourceFile as dicts (picklable for spawned workers)
    dest: str
    state_dir: str
    shard_prefix: str
    tokenizer_json: str
    eos_id: int | None
    sep_id: int
    dtype: str
    chunk_size: int
    write_remainder: bool
    skip_rp: bool
    config_hash: str
    parent_pid: int | None  # set for spawned workers: they stop when orphaned


def _encode_batch(tok, texts: list[str], eos_id, dtype, add_special_tokens: bool = True) -> np.ndarray:
    """One tokenizer call for many documents -> their ids back to back, each followed by EOS when enabled."""
    encs = tok.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
    ids = [e.ids for e in encs]
    extra = 0 if eos_id is None else 1
    flat = np.empty(sum(map(len, ids)) + extra * len(ids), dtype=dtype)
    pos = 0
    for doc in ids:
        n = len(doc)
        flat[pos : pos + n] = doc
        pos += n
        if extra:
            flat[pos] = eos_id
            pos += 1
    return flat


def _txt_pieces(sf: SourceFile):
    """A plain text file is one document, read in pieces of about 1 MiB cut after a line break."""
    try:
        with open(sf.path, encoding="utf-8") as fh:
            while True:
                piece = fh.read(TXT_PIECE)
                if not piece:
                    return
                if not piece.endswith("\n"):
                    piece += fh.readline()
                yield piece
    except UnicodeDecodeError as e:
        raise DLMError(f"text file '{sf.path}' is not UTF-8 ({e}); convert it or remove it") from e
    except OSError as e:
        raise DLMError(f"cannot read '{sf.path}': {e}") from e


def _pack_file(sf: SourceFile, job: _Job, tok, writer: ShardWriter, dtype, stats: FileStats, report) -> Counter:
    skipped = Counter()
    if sf.kind == "txt":
        stats.rows_read = 1
        first, wrote = True, False
        for piece in _txt_pieces(sf):
            if first and not piece.strip() and len(piece) < TXT_PIECE:
                break
            flat = _encode_batch(tok, [piece], None, dtype, add_special_tokens=first)
            first, wrote = False, True
            writer.add(flat)
            stats.tokens += int(flat.shape[0])
            report("batch", 0, int(flat.shape[0]))
        if not wrote:
            skipped["empty"] += 1
            return skipped
        if job.eos_id is not None:
            writer.add(np.array([job.eos_id], dtype=dtype))
            stats.tokens += 1
        stats.documents_written = 1
        report("batch", 1, 0 if job.eos_id is None else 1)
        return skipped
    for texts, rows, skip in _iter_rows(sf, job.skip_rp):
        stats.rows_read += rows
        skipped.update(skip)
        if texts:
            flat = _encode_batch(tok, texts, job.eos_id, dtype)
            writer.add(flat)
            stats.documents_written += len(texts)
            stats.tokens += int(flat.shape[0])
            report("batch", len(texts), int(flat.shape[0]))
        if (
            job.parent_pid is not None and os.getppid() != job.parent_pid
        ):  # orphaned (the parent was killed): stop; a rerun resumes
            os._exit(1)
    return skipped


def _run_job(job: _Job, report) -> dict:
    """Pack this worker's files in order, resuming from its checkpoint. ``report(kind, *values)`` = progress."""
    from tokenizers import Tokenizer

    dest = Path(job.dest)
    dtype = np.dtype(job.dtype)
    state_path = Path(job.state_dir) / f"p{job.proc}.state"
    loaded = _load_state(state_path, dtype)
    if loaded is not None and loaded[0].get("config_hash") == job.config_hash:
        state, pending = loaded
    else:
        state, pending = (
            {
                "config_hash": job.config_hash,
                "files_done": 0,
                "counter": 0,
                "shards": [],
                "sources": [],
                "done": False,
                "dropped": 0,
            },
            None,
        )
    if state["done"]:
        report("file", len(job.files))
        return state
    # Drop what was written after the last checkpoint (it is rewritten identically below) and any temp file.
    own = re.compile(rf"^(\.?){re.escape(job.shard_prefix)}_(\d{{10}})\.bin(\.tmp)?$")
    for p in dest.iterdir():
        m = own.match(p.name)
        if m and (m.group(1) or m.group(3) or int(m.group(2)) >= state["counter"]):
            p.unlink()
    tok = Tokenizer.from_str(job.tokenizer_json)
    writer = ShardWriter(
        dest, job.shard_prefix, job.chunk_size, job.sep_id, dtype, counter=state["counter"], pending=pending
    )
    writer.shards = list(state["shards"])
    delay = float(env("DLM_PREPARE_TEST_DELAY_S") or 0)
    if state["files_done"]:
        report("file", state["files_done"])
    for k in range(state["files_done"], len(job.files)):
        sf = SourceFile(**job.files[k])
        stats = FileStats(sf.rel, job.proc)
        skipped = _pack_file(sf, job, tok, writer, dtype, stats, report)
        stats.rows_skipped = dict(sorted(skipped.items()))
        state.update(
            files_done=k + 1, counter=writer.counter, shards=writer.shards, sources=state["sources"] + [asdict(stats)]
        )
        _save_state(state_path, state, writer.pending())
        report("file", 1)
        if delay:
            time.sleep(delay)
    state["dropped"] = writer.finish(job.write_remainder)
    state.update(counter=writer.counter, shards=writer.shards, done=True)
    _save_state(state_path, state, writer.pending())
    return state


def _worker_main(job: _Job, queue) -> None:
    """Entry point of a spawned worker: run the job, send progress and the outcome through ``queue``."""
    try:
        _run_job(job, lambda *m: queue.put((job.proc, *m)))
        queue.put((job.proc, "done"))
    except DiskFullError as e:
        queue.put((job.proc, "diskfull", str(e)))
    except DLMError as e:
        queue.put((job.proc, "error", str(e)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        import traceback

        queue.put((job.proc, "crash", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


# --------------------------------------------------------------------------------------------- orchestration


class _Progress:
    def __init__(self, n_files: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=n_files, unit="file", desc="dlm prepare", disable=not enabled, dynamic_ncols=True)
        self.docs = self.tokens = 0
        self.t0 = self._last = time.perf_counter()

    def __call__(self, kind, *values):
        if kind == "file":
            self.bar.update(values[0])
        elif kind == "batch":
            self.docs += values[0]
            self.tokens += values[1]
        now = time.perf_counter()
        if now - self._last > 0.5 or kind == "file":
            self._last = now
            rate = self.tokens / max(now - self.t0, 1e-9)
            self.bar.set_postfix_str(f"docs={self.docs:,} tokens={self.tokens:,} tok/s={rate:,.0f}")

    def close(self):
        self.bar.close()


def assign_files(files: list[SourceFile], num_processes: int) -> list[list[SourceFile]]:
    """Deterministic split by file: largest file first to the least-loaded worker (ties: lowest index)."""
    import heapq

    heap = [(0, p) for p in range(num_processes)]
    owned: list[list[int]] = [[] for _ in range(num_processes)]
    for i in sorted(range(len(files)), key=lambda i: (-files[i].size, i)):
        load, p = heapq.heappop(heap)
        owned[p].append(i)
        heapq.heappush(heap, (load + max(files[i].size, 1), p))
    return [[files[i] for i in sorted(idx)] for idx in owned]


def _load_tokenizer(name: str):
    try:
        tok = load_tokenizer(name)
    except DLMError as e:
        raise DLMError(f"--tokenizer: {e}") from e
    if getattr(tok, "backend_tokenizer", None) is None:
        raise DLMError(
            f"--tokenizer '{name}' has no fast (Rust) tokenizer; save a tokenizer.json with "
            f"PreTrainedTokenizerFast.save_pretrained and pass its folder"
        )
    return tok


def _check_destination(dest: Path) -> bool:
    """Create ``dest`` if needed and check it is writable; returns True when this call created it."""
    if dest.exists() and not dest.is_dir():
        raise DLMError(f"--destination-path '{dest}' exists and is not a folder; pass a folder path")
    created = not dest.exists()
    try:
        dest.mkdir(parents=True, exist_ok=True)
        probe = dest / f".dlm-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise DLMError(
            f"--destination-path '{dest}' is not writable ({e.strerror or e}); pass a folder you can write to"
        ) from e
    return created


def _config_diff(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:6]) or "unknown"


def _purge(dest: Path, prefix: str) -> None:
    rx = shard_name_regex(prefix)
    tmp_rx = re.compile(rf"^\.{re.escape(prefix)}_(\d+_)?\d{{10}}\.bin\.tmp$")
    for p in dest.iterdir():
        if rx.match(p.name) or tmp_rx.match(p.name):
            p.unlink()
    shutil.rmtree(_state_dir(dest, prefix), ignore_errors=True)


@contextlib.contextmanager
def _prefix_lock(dest: Path, prefix: str):
    import fcntl

    path = dest / f".dlm-prepare-{prefix}.lock"
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        fh.close()
        raise DLMError(
            f"another dlm prepare is writing prefix '{prefix}' into '{dest}'; wait for it or choose another --prefix"
        ) from e
    try:
        yield
    finally:
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def prepare(cfg: PrepareConfig) -> dict:
    """Run ``dlm prepare``; returns the summary (files, documents, tokens, shards, ...). Raises DLMError."""
    if cfg.chunk_size <= 0:
        raise DLMError(f"--chunk-size must be a positive number of tokens, got {cfg.chunk_size}")
    if cfg.num_processes < 1:
        raise DLMError(f"--num-processes must be at least 1, got {cfg.num_processes}")
    if not cfg.prefix or "/" in cfg.prefix or cfg.prefix.startswith("."):
        raise DLMError(f"--prefix {cfg.prefix!r} must be a plain file-name prefix (no '/', not starting with '.')")
    t0 = time.perf_counter()
    files = discover_files(cfg.source_path, cfg.pattern, cfg.percentage)
    tok = _load_tokenizer(cfg.tokenizer)
    tokenizer_json = tok.backend_tokenizer.to_str()
    vocab_size = len(tok)
    eos_id = tok.eos_token_id if cfg.eos else None
    if cfg.eos and eos_id is None:
        raise DLMError(
            f"--tokenizer '{cfg.tokenizer}' defines no EOS token; pass --no-eos or use a tokenizer with an eos_token"
        )
    sep_id = next(i for i in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, 0) if i is not None)
    dtype = choose_dtype(vocab_size, cfg.dtype)
    for sf in files:
        inspect_file(sf, cfg.text_column)
    dest = Path(cfg.destination_path).expanduser().resolve()
    created = _check_destination(dest)
    num_processes = min(cfg.num_processes, len(files))
    config = {
        "source_path": str(Path(cfg.source_path).expanduser().resolve()),
        "files": [[sf.rel, sf.size, sf.column] for sf in files],
        "tokenizer": cfg.tokenizer,
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        "vocab_size": vocab_size,
        "dtype": dtype.name,
        "chunk_size": cfg.chunk_size,
        "eos": cfg.eos,
        "eos_token_id": eos_id,
        "sep_token_id": sep_id,
        "prefix": cfg.prefix,
        "num_processes": num_processes,
        "text_column": cfg.text_column,
        "percentage": cfg.percentage,
        "skip_redpajama_github": cfg.skip_redpajama_github,
        "write_remainder": cfg.write_remainder,
    }
    chash = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    sdir = _state_dir(dest, cfg.prefix)
    try:
        with _prefix_lock(dest, cfg.prefix):
            done = _check_existing(dest, cfg, config, chash, sdir)
            if done is not None:
                done["already_complete"] = True
                return done
            try:
                sdir.mkdir(exist_ok=True)
                atomic_write_text(sdir / "config.json", json.dumps({"config": config, "config_hash": chash}))
                states = _run_all(cfg, files, num_processes, dest, sdir, tokenizer_json, eos_id, sep_id, dtype, chash)
                summary = _finish(cfg, dest, config, chash, states, files, time.perf_counter() - t0)
            except DiskFullError:
                raise  # keep the finished shards and the checkpoints: the same command resumes
            except DLMError:
                _purge(dest, cfg.prefix)
                raise
        shutil.rmtree(sdir, ignore_errors=True)
        (dest / f".dlm-prepare-{cfg.prefix}.lock").unlink(missing_ok=True)
        return summary
    except DLMError:
        (dest / f".dlm-prepare-{cfg.prefix}.lock").unlink(missing_ok=True)
        if created and not any(dest.iterdir()):
            dest.rmdir()
        raise


def _check_existing(dest: Path, cfg: PrepareConfig, config: dict, chash: str, sdir: Path) -> dict | None:
    """Decide between a fresh run, a resume, 'already complete' (returns its summary) and a refusal."""
    rx = shard_name_regex(cfg.prefix)
    if cfg.overwrite:
        _purge(dest, cfg.prefix)
        if (dest / MANIFEST_NAME).is_file():
            update_manifest(dest, cfg.prefix, None)
        return None
    existing = sorted(p.name for p in dest.iterdir() if rx.match(p.name))
    entry = read_manifest(dest)["prefixes"].get(cfg.prefix)
    refuse = (
        f"; choose another --destination-path or --prefix, or pass --overwrite to replace prefix '{cfg.prefix}' there"
    )
    if entry is not None:
        if entry.get("config_hash") != chash:
            raise DLMError(
                f"'{dest}' already holds shards of prefix '{cfg.prefix}' written with a different "
                f"configuration ({_config_diff(entry.get('config', {}), config)})" + refuse
            )
        listed = sorted(s["file"] for s in entry["shards"])
        if listed == existing:
            shutil.rmtree(sdir, ignore_errors=True)  # a crash between the manifest write and the clean-up
            return dict(entry["totals"], destination=str(dest))
        raise DLMError(
            f"'{dest}': the shards of prefix '{cfg.prefix}' do not match its manifest.json (missing or "
            f"extra files)" + refuse
        )
    if (sdir / "config.json").is_file():
        try:
            old = json.loads((sdir / "config.json").read_text())
        except ValueError:
            old = {}
        if old.get("config_hash") != chash:
            raise DLMError(
                f"'{dest}' holds an unfinished dlm prepare of prefix '{cfg.prefix}' with a different "
                f"configuration ({_config_diff(old.get('config', {}), config)}); rerun it with its own "
                f"arguments to finish it" + refuse
            )
        return None  # resume
    if existing:
        raise DLMError(
            f"'{dest}' already holds {len(existing)} shard(s) of prefix '{cfg.prefix}' (e.g. "
            f"{existing[0]}) of an unknown configuration (no manifest entry)" + refuse
        )
    return None


def _run_all(cfg, files, num_processes, dest, sdir, tokenizer_json, eos_id, sep_id, dtype, chash) -> list[dict]:
    groups = assign_files(files, num_processes)
    jobs = [
        _Job(
            proc=p,
            files=[asdict(sf) for sf in group],
            dest=str(dest),
            state_dir=str(sdir),
            shard_prefix=_shard_prefix(cfg.prefix, p, num_processes),
            tokenizer_json=tokenizer_json,
            eos_id=eos_id,
            sep_id=sep_id,
            dtype=dtype.name,
            chunk_size=cfg.chunk_size,
            write_remainder=cfg.write_remainder,
            skip_rp=cfg.skip_redpajama_github,
            config_hash=chash,
            parent_pid=os.getpid() if num_processes > 1 else None,
        )
        for p, group in enumerate(groups)
    ]
    progress = _Progress(len(files), cfg.progress)
    try:
        if num_processes == 1:
            return [_run_job(jobs[0], progress)]
        return _run_spawned(jobs, progress)
    finally:
        progress.close()


def _run_spawned(jobs: list[_Job], progress) -> list[dict]:
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")  # no fork: the parent holds a Rust tokenizer with its own thread pool
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(job, q), daemon=True) for job in jobs]
    finished: set[int] = set()
    dead_since: dict[int, float] = {}
    env_before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the workers are the parallelism
    try:
        for p in procs:
            p.start()
    finally:
        if env_before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = env_before
    try:
        while len(finished) < len(procs):
            try:
                proc, kind, *values = q.get(timeout=0.5)
            except queue_mod.Empty:
                now = time.perf_counter()
                for i, p in enumerate(procs):
                    if i not in finished and not p.is_alive():
                        if now - dead_since.setdefault(i, now) > 3.0:
                            raise RuntimeError(
                                f"dlm prepare worker {i} died (exit code {p.exitcode}) without "
                                f"reporting; rerun the same command to resume"
                            ) from None
                continue
            if kind == "done":
                finished.add(proc)
            elif kind == "diskfull":
                raise DiskFullError(values[0])
            elif kind == "error":
                raise DLMError(values[0])
            elif kind == "crash":
                raise RuntimeError(f"dlm prepare worker {proc} crashed: {values[0]}")
            else:
                progress(kind, *values)
    finally:
        for p in procs:
            if p.is_alive() and len(finished) < len(procs):
                p.terminate()
            p.join()
    states = []
    for job in jobs:
        loaded = _load_state(Path(job.state_dir) / f"p{job.proc}.state", np.dtype(job.dtype))
        if loaded is None or not loaded[0]["done"]:
            raise RuntimeError(f"dlm prepare worker {job.proc} finished without a completion record")
        states.append(loaded[0])
    return states


def _finish(cfg: PrepareConfig, dest: Path, config: dict, chash: str, states: list[dict], files, seconds) -> dict:
    sources, shards, dropped = [], [], 0
    for proc, st in enumerate(states):
        sources += st["sources"]
        shards += [dict(s, process=proc) for s in st["shards"]]
        dropped += st["dropped"]
    order = {sf.rel: i for i, sf in enumerate(files)}
    sources.sort(key=lambda s: order[s["file"]])
    docs = sum(s["documents_written"] for s in sources)
    tokens = sum(s["tokens"] for s in sources)
    skipped = Counter()
    for s in sources:
        skipped.update(s["rows_skipped"])
    if docs == 0:
        raise DLMError(
            f"no documents in {len(files)} file(s) under '{cfg.source_path}': every row was skipped "
            f"({dict(skipped) or 'no rows'}); check --text-column and the inputs"
        )
    if not shards:
        raise DLMError(
            f"too little data: {tokens:,} tokens is less than one chunk of --chunk-size "
            f"{cfg.chunk_size:,}, so no shard would be written; pass --write-remainder to write the "
            f"partial chunk (sep-padded) or lower --chunk-size"
        )
    totals = {
        "files": len(files),
        "rows_read": sum(s["rows_read"] for s in sources),
        "documents": docs,
        "tokens": tokens,
        "tokens_in_shards": sum(s["tokens"] for s in shards),
        "tokens_dropped": dropped,
        "rows_skipped": dict(sorted(skipped.items())),
        "shards": len(shards),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
    }
    entry = {
        "format": "LITPKDS",
        "format_version": 1,
        "status": "complete",
        "config_hash": chash,
        "config": config,
        "tokenizer": config["tokenizer"],
        "tokenizer_sha256": config["tokenizer_sha256"],
        "vocab_size": config["vocab_size"],
        "dtype": config["dtype"],
        "chunk_size": cfg.chunk_size,
        "eos": {"append": cfg.eos, "token_id": config["eos_token_id"]},
        "sep_token_id": config["sep_token_id"],
        "write_remainder": cfg.write_remainder,
        "num_processes": config["num_processes"],
        "shards": shards,
        "sources": sources,
        "totals": totals,
    }
    update_manifest(dest, cfg.prefix, entry)
    return dict(totals, destination=str(dest))
