"""User-facing errors.

Anything a user can cause (a bad path, a malformed file, a mismatched block size, a missing extra) raises
:class:`DLMError` with one message that names the file/field/flag and the fix. The CLI prints it without a
traceback and exits with status 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class DLMError(Exception):
    """An error the user can fix; the message says what and how."""


def closest(name: str, valid: Iterable[str], n: int = 3) -> str:
    """A ', '-joined list of the closest valid names, for 'did you mean' messages."""
    valid = list(valid)
    matches = difflib.get_close_matches(name, valid, n=n, cutoff=0.4)
    return ", ".join(matches) if matches else ", ".join(sorted(valid)[:10])


def require(module: str, extra: str):
    """Import an optional dependency or raise a DLMError naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DLMError(
            f"this feature needs the optional package '{module}' ({e}); install it with: pip install 'dlm[{extra}]'"
        ) from e
