"""Small filesystem helpers shared by every writer of model folders."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


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
