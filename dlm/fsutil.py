"""Small filesystem helpers shared by every writer of model folders, checkpoints and shards: atomic folders,
sha256 lists (``checksums.sha256``, ``sha256sum -c`` format), disk-full errors that name the path, and the cache
of per-machine measured verdicts (``$DLM_CACHE_DIR``, default ``~/.cache/dlm``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from dlm.errors import DLMError
from dlm.settings import home


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike):
    """Yield a temporary folder beside ``path``; on success it replaces ``path`` in one rename.

    A crash (or any exception) removes the temporary folder, so a folder at ``path`` is always complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp.", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


CHECKSUMS = "checksums.sha256"


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_checksums(folder: str | os.PathLike, skip: tuple[str, ...] = ()) -> Path:
    """Write ``folder/checksums.sha256`` (``sha256sum`` format: ``<hex>  <relative path>``) over every file below
    ``folder`` except ``skip`` (names relative to ``folder``), fsynced; ``sha256sum -c`` checks it by hand."""
    folder = Path(folder)
    lines = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel != CHECKSUMS and rel not in skip:
            lines.append(f"{sha256_file(p)}  {rel}\n")
    out = folder / CHECKSUMS
    with open(out, "w") as fh:
        fh.writelines(lines)
        fh.flush()
        os.fsync(fh.fileno())
    return out


def verify_checksums(folder: str | os.PathLike, what: str = "folder") -> bool:
    """Check every file listed in ``folder/checksums.sha256``; False when the folder has no such list. A missing,
    truncated or changed file raises a DLMError naming it (``what`` says what the folder is, for the message)."""
    folder = Path(folder)
    listing = folder / CHECKSUMS
    if not listing.is_file():
        return False
    try:
        entries = [line.rstrip("\n").split("  ", 1) for line in listing.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise DLMError(f"cannot read '{listing}' ({e}); the {what} is damaged: restore it from a copy") from e
    for entry in entries:
        if len(entry) != 2 or len(entry[0]) != 64:
            raise DLMError(
                f"'{listing}' is damaged (line {entry!r}); the {what} cannot be verified: restore it from a copy"
            )
        digest, rel = entry
        f = folder / rel
        if not f.is_file():
            raise DLMError(
                f"'{f}' is missing from the {what} '{folder}' (listed in {CHECKSUMS}); restore the whole "
                f"folder from a copy"
            )
        if sha256_file(f) != digest:
            raise DLMError(
                f"'{f}' is corrupt: its sha256 differs from the one recorded in {CHECKSUMS} when the "
                f"{what} was written (truncated or changed on disk); restore it from a copy or use an "
                f"earlier one"
            )
    return True


# -- disk full ----------------------------------------------------------------------------------------------------
LOW_SPACE = 16 << 20  # a write that fails with less than this free is taken for a full disk


def _is_disk_full(exc: BaseException, path) -> bool:
    import errno

    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        if e is not None and ("No space left on device" in str(e) or "Disk quota exceeded" in str(e)):
            return True
    # torch.save (a C++ stream) reports a full disk as "unexpected pos ..." / "iostream error" without an errno
    if isinstance(exc, (OSError, RuntimeError)):
        return _free_bytes(path) < LOW_SPACE
    return False


def _free_bytes(path) -> int:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:  # pragma: no cover
        return 1 << 62


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def free_space(path: str | os.PathLike) -> str:
    """'12.0 MiB free of 1.0 GiB' for the filesystem holding ``path`` (or its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        u = shutil.disk_usage(p)
    except OSError:  # pragma: no cover
        return "free space unknown"
    return f"{_human(u.free)} free of {_human(u.total)}"


@contextlib.contextmanager
def disk_full_as_error(path: str | os.PathLike, fix: str):
    """Turn 'no space left on device' (an OSError, or the RuntimeError torch.save and safetensors raise for it)
    inside the block into a one-line :class:`DiskFullError` naming ``path``, the free space and ``fix``."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:  # noqa: BLE001 - only disk-full errors are translated; the rest propagate as they are
        if not _is_disk_full(e, path):
            raise
        raise DiskFullError(f"no space left on the device while writing '{path}' ({free_space(path)}); {fix}") from e


class DiskFullError(DLMError):
    """The disk filled up: what was complete before is kept, so the same command resumes once space is freed."""


# -- model folders ------------------------------------------------------------------------------------------------
def read_json_file(path: str | os.PathLike, what: str = "file") -> dict:
    """A JSON object from ``path``; a truncated or garbled file is a DLMError naming it."""
    import json

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DLMError(f"'{path}' is damaged or not JSON ({e}); restore the {what} from a copy") from e
    if not isinstance(data, dict):
        raise DLMError(f"'{path}' is not a JSON object; restore the {what} from a copy")
    return data


def check_model_folder(folder: str | os.PathLike) -> None:
    """Before a model folder loads: its ``checksums.sha256`` (when it has one) and the framing of every
    ``*.safetensors`` file (header length, JSON header, data size), so a truncated or damaged file is an error
    naming it rather than a library traceback."""
    import json
    import struct

    folder = Path(folder)
    verify_checksums(folder, what="model folder")
    for f in sorted(folder.glob("*.safetensors")):
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > size - 8:
                    raise ValueError(f"header of {n} bytes in a {size}-byte file")
                header = json.loads(fh.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
            if 8 + n + max(ends, default=0) != size:
                raise ValueError(f"{size} bytes, the header describes {8 + n + max(ends, default=0)}")
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error, UnicodeDecodeError) as e:
            raise DLMError(
                f"'{f}' is truncated or damaged ({type(e).__name__}: {e}); restore the model folder from a copy"
            ) from e


@contextlib.contextmanager
def file_lock(path: str | os.PathLike):
    """An exclusive advisory lock (``flock``) held on ``path`` (created, with its folder) for the ``with`` block:
    processes sharing a cache or a manifest take turns."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_records(file: str) -> dict:
    """The measured verdicts cached in ``file`` under :func:`dlm.settings.home` ({} if none or unreadable)."""
    try:
        data = json.loads((home() / file).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_record(file: str, key: str, record: dict, keep: int | None = None) -> None:
    """Add ``record`` under ``key`` to ``file`` (written to a temporary file, then renamed: never a half-written
    cache); a read-only home is not an error: the verdict is measured again next time. ``keep``: at most this many
    records stay, the ones with the oldest ``"t"`` (a time stamp the caller puts in its records) dropped first, so a
    file keyed by something that keeps changing (a retrained folder's modification time) does not grow forever."""
    try:
        d = home()
        d.mkdir(parents=True, exist_ok=True)
        data = read_records(file)
        data[key] = record
        if keep is not None and len(data) > keep:

            def stamp(k: str) -> float:
                t = data[k].get("t") if isinstance(data[k], dict) else None
                return float(t) if isinstance(t, (int, float)) else 0.0

            for k in sorted(data, key=stamp)[: len(data) - keep]:
                del data[k]
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".choice-")
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, d / file)
    except OSError:
        pass
