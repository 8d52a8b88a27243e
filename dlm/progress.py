"""The progress bar of long-running commands (eval per task, generate over a prompts file, convert, the
quickstart's stages): on stderr, with a rate and an ETA, cleared when done. Commands show it only when stderr is
a terminal and ``--quiet`` is not given (:func:`wanted`)."""

from __future__ import annotations

import sys


def wanted(quiet: bool = False) -> bool:
    """Whether a command shows progress bars: not under ``--quiet``, and only on a terminal's stderr."""
    return not quiet and sys.stderr.isatty()


def bar(total: int | None, desc: str, unit: str, initial: int = 0):
    """A tqdm bar on stderr over ``total`` ``unit``s (``None``: a counter with a rate, no ETA)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, leave=False, file=sys.stderr)
