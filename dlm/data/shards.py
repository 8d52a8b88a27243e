"""LITPKDS packed token shards (TinyLlama / lit-gpt format, docs/algorithms.md#shards) and their sidecar manifest.

Byte layout of one ``.bin`` shard, all integers little-endian::

    offset  bytes  content
    0       7      b"LITPKDS"
    7       8      version, uint64 = 1
    15      1      dtype code, uint8 (1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f32, 7 f64, 8 u16)
    16      8      chunk_size = number of tokens in the payload, uint64
    24      ...    chunk_size tokens, C order

Nothing else goes into a ``.bin`` (so TinyLlama/DiffuLLaMA readers load our shards and we load theirs); real-token
counts, hashes and per-source statistics live in the sidecar ``manifest.json`` (:func:`update_manifest`).

:class:`ShardWriter` is the builder: documents are concatenated back to back into a buffer of ``chunk_size``
tokens pre-filled with a sep token; each full buffer becomes the next file ``{prefix}_{counter:010d}.bin``
(written to a temporary name, then renamed). One deliberate difference from lit-gpt's ``PackedDatasetBuilder``:
a buffer is written as soon as it is full. The reference only writes when the *next* token arrives, so when the
data ends exactly on a chunk boundary it silently drops that last full chunk (or, with the remainder requested,
writes it late); and it writes an all-sep file when the remainder is requested with nothing pending. Neither
happens here. For any stream that does not end exactly on a boundary the files are byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dlm.errors import DLMError
from dlm.fsutil import disk_full_as_error, file_lock, sha256_file  # noqa: F401 - sha256_file: part of this module's API

RESUME_FIX = "free some space (or use another --destination-path) and rerun the same command: finished shards are kept and it resumes after them"

HDR_MAGIC = b"LITPKDS"
HDR_VERSION = 1
HDR_SIZE = 24  # 7 magic + 8 version + 1 dtype code + 8 chunk size
MANIFEST_NAME = "manifest.json"

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float32,
    7: np.float64,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
TOKEN_DTYPES = {"uint16": np.uint16, "int32": np.int32}


def choose_dtype(vocab_size: int, dtype: str = "auto") -> np.dtype:
    """The shard dtype: ``auto`` = uint16 when the vocabulary is below 65500, else int32 (docs/algorithms.md#shards)."""
    if dtype == "auto":
        return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)
    if dtype not in TOKEN_DTYPES:
        raise DLMError(f"--dtype {dtype!r} is not supported; use auto, uint16 or int32")
    dt = np.dtype(TOKEN_DTYPES[dtype])
    if dt == np.uint16 and vocab_size > 65536:
        raise DLMError(f"--dtype uint16 cannot hold a vocabulary of {vocab_size} ids; use --dtype int32 or auto")
    return dt


def encode_header(dtype, chunk_size: int) -> bytes:
    code = CODE_OF_DTYPE.get(np.dtype(dtype))
    if code is None:
        raise DLMError(f"dtype {np.dtype(dtype)} has no LITPKDS code; use uint16 or int32")
    return HDR_MAGIC + struct.pack("<Q", HDR_VERSION) + struct.pack("<B", code) + struct.pack("<Q", chunk_size)


@dataclass(frozen=True)
class ShardHeader:
    path: str
    dtype: np.dtype
    chunk_size: int

    @property
    def nbytes(self) -> int:
        return HDR_SIZE + self.chunk_size * self.dtype.itemsize


def read_header(path: str | os.PathLike, check_size: bool = True) -> ShardHeader:
    """Parse and validate one shard's header (magic, version, dtype code, chunk size) and its file size.

    Every failure is a :class:`DLMError` that names the file.
    """
    path = str(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(HDR_SIZE)
        size = os.path.getsize(path)
    except OSError as e:
        raise DLMError(f"cannot read shard '{path}': {e.strerror or e}") from e
    if len(raw) < HDR_SIZE:
        raise DLMError(
            f"shard '{path}' is truncated: {len(raw)} bytes, shorter than the {HDR_SIZE}-byte LITPKDS "
            f"header; delete it and re-run dlm prepare"
        )
    if raw[:7] != HDR_MAGIC:
        raise DLMError(f"'{path}' is not a LITPKDS shard (magic {raw[:7]!r}, expected {HDR_MAGIC!r})")
    (version,) = struct.unpack("<Q", raw[7:15])
    if version != HDR_VERSION:
        raise DLMError(f"shard '{path}' has LITPKDS version {version}; only version {HDR_VERSION} is supported")
    code = raw[15]
    if code not in DTYPE_CODES:
        raise DLMError(f"shard '{path}' has unknown dtype code {code} (valid: {sorted(DTYPE_CODES)})")
    (chunk_size,) = struct.unpack("<Q", raw[16:24])
    header = ShardHeader(path, np.dtype(DTYPE_CODES[code]), int(chunk_size))
    if chunk_size == 0:
        raise DLMError(f"shard '{path}' declares an empty payload (chunk_size 0)")
    if check_size and size != header.nbytes:
        what = "truncated" if size < header.nbytes else "longer than its header says"
        raise DLMError(
            f"shard '{path}' is {what}: {size} bytes, expected {header.nbytes} "
            f"(24-byte header + {chunk_size} x {header.dtype.itemsize}-byte tokens); delete it and "
            f"re-run dlm prepare"
        )
    return header


def read_shard(path: str | os.PathLike, mmap: bool = True) -> np.ndarray:
    """All tokens of a validated shard (a read-only memory map by default)."""
    h = read_header(path)
    if mmap:
        return np.memmap(h.path, dtype=h.dtype, mode="r", offset=HDR_SIZE, shape=(h.chunk_size,))
    return np.fromfile(h.path, dtype=h.dtype, count=h.chunk_size, offset=HDR_SIZE)


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> str:
    """Write one complete shard atomically (temp name, fsync, rename); returns the sha256 of the file bytes."""
    path = Path(path)
    tokens = np.ascontiguousarray(tokens)
    header = encode_header(tokens.dtype, tokens.shape[0])
    payload = tokens.tobytes(order="C")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with disk_full_as_error(path, RESUME_FIX):
            with open(tmp, "wb") as fh:
                fh.write(header)
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave half a shard behind
        raise
    h = hashlib.sha256(header)
    h.update(payload)
    return h.hexdigest()


class ShardWriter:
    """Pack a token stream into LITPKDS shards ``{prefix}_{counter:010d}.bin`` in ``out_dir``.

    ``add(tokens)`` appends tokens (a document's ids, EOS included by the caller); full buffers are written at
    once. ``finish(write_remainder)`` writes the partial last buffer (sep-filled) only when asked. ``shards`` lists
    ``{"file", "tokens" (real tokens), "sha256"}`` of every file written. ``counter``/``pending()`` plus the
    constructor's ``counter``/``pending`` arguments let a caller checkpoint and resume the builder exactly.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        prefix: str,
        chunk_size: int,
        sep_token: int,
        dtype=np.uint16,
        counter: int = 0,
        pending: np.ndarray | None = None,
    ):
        if chunk_size <= 0:
            raise DLMError(f"--chunk-size must be positive, got {chunk_size}")
        self.out_dir = Path(out_dir)
        self.prefix = prefix
        self.chunk_size = int(chunk_size)
        self.dtype = np.dtype(dtype)
        self.sep_token = int(sep_token)
        self.counter = int(counter)
        self.shards: list[dict] = []
        self._buf = np.full(self.chunk_size, self.sep_token, dtype=self.dtype)
        self._idx = 0
        if pending is not None and len(pending):
            self._buf[: len(pending)] = pending
            self._idx = len(pending)

    def filename(self, counter: int) -> str:
        return f"{self.prefix}_{counter:010d}.bin"

    def pending(self) -> np.ndarray:
        """The tokens waiting in the partial buffer (a copy)."""
        return self._buf[: self._idx].copy()

    def add(self, tokens) -> None:
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            arr = arr.astype(self.dtype)
        n, pos = arr.shape[0], 0
        while pos < n:
            take = min(self.chunk_size - self._idx, n - pos)
            self._buf[self._idx : self._idx + take] = arr[pos : pos + take]
            self._idx += take
            pos += take
            if self._idx == self.chunk_size:
                self._flush()

    def _flush(self) -> None:
        name = self.filename(self.counter)
        digest = write_shard(self.out_dir / name, self._buf)
        self.shards.append({"file": name, "tokens": int(self._idx), "sha256": digest})
        self.counter += 1
        self._buf.fill(self.sep_token)
        self._idx = 0

    def finish(self, write_remainder: bool = False) -> int:
        """Write the partial buffer if asked (sep-filled); returns the number of real tokens dropped."""
        dropped = self._idx
        if self._idx and write_remainder:
            self._flush()
            dropped = 0
        else:
            self._buf.fill(self.sep_token)
            self._idx = 0
        return dropped


# ---------------------------------------------------------------------------------------------- manifest


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with disk_full_as_error(path, RESUME_FIX):
            with open(tmp, "w") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(folder: str | os.PathLike) -> dict:
    """The folder's manifest (``{"format", "version", "prefixes": {prefix: entry}}``), or an empty one."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return {"format": "dlm-packed-manifest", "version": 1, "prefixes": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DLMError(f"'{path}' is not a readable dlm manifest ({e}); remove it or use --overwrite") from e
    if not isinstance(data, dict) or not isinstance(data.get("prefixes"), dict):
        raise DLMError(f"'{path}' is not a dlm manifest (no 'prefixes' table); remove it or use --overwrite")
    return data


def update_manifest(folder: str | os.PathLike, prefix: str, entry: dict | None) -> None:
    """Set (or with ``entry=None`` remove) one prefix's entry of ``folder/manifest.json``, under a file lock.

    One folder may hold several prefixes (the loader mixes them), so the manifest is a table keyed by prefix and
    concurrent ``dlm prepare`` runs for different prefixes do not overwrite each other's entries.
    """
    folder = Path(folder)
    with file_lock(folder / f".{MANIFEST_NAME}.lock"):
        data = read_manifest(folder)
        if entry is None:
            data["prefixes"].pop(prefix, None)
        else:
            data["prefixes"][prefix] = entry
        atomic_write_text(folder / MANIFEST_NAME, json.dumps(data, indent=2, sort_keys=False) + "\n")
