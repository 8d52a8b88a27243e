"""Building and loading the CPU decode kernels (``dlm/csrc/cpu/*.cpp``) and choosing their instruction set.

The sources are compiled once per source version and torch version with torch's ``cpp_extension`` (about a minute
on 2 cores; needs a C++ compiler and ninja), cached under ``TORCH_EXTENSIONS_DIR``, and loaded as the torch
operators ``torch.ops.dlm_cpu.*``. The build is portable: no ``-march=native``; each instruction set's kernels
(AVX-512, AVX2 + FMA, and a generic baseline) are compiled in their own file with a target pragma, and the one to
use is picked at run time from CPUID - the best the CPU runs, or ``DLM_CPU_ISA=avx512vnni|avx512|avx2|generic``
(avx512vnni: the AVX-512 kernels with VNNI's dot products for the int8-activation layers; the rest the same).

``DLM_CPU_KERNEL``: ``auto`` (default: the kernels are used where a micro-benchmark at attach finds them faster
than torch's own layers on this machine, see :mod:`dlm.decode.cpu.choice`), ``1`` (always, and a failed build is
an error), ``0`` (never).
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from pathlib import Path

import torch

from dlm.errors import DLMError
from dlm.fsutil import file_lock
from dlm.settings import env

ENV = "DLM_CPU_KERNEL"
ISA_ENV = "DLM_CPU_ISA"
SOURCES = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
ISAS = ("avx512vnni", "avx512", "avx2", "generic")
_FLAGS = ["-O3", "-fopenmp"]  # -fopenmp: at::parallel_for is inline; without it, one thread

_built: list = []  # [torch.ops.dlm_cpu or None] once tried


def mode() -> str:
    """``off``, ``on`` or ``auto`` from ``DLM_CPU_KERNEL``."""
    v = (env(ENV) or "auto").strip().lower()
    return {"0": "off", "false": "off", "off": "off", "1": "on", "true": "on", "on": "on"}.get(v, "auto")


def _sources() -> list[Path]:
    return sorted(p for p in SOURCES.iterdir() if p.suffix in (".cpp", ".h", ".inc"))


def _tag() -> str:
    h = hashlib.sha1()
    for p in _sources():
        h.update(p.name.encode() + p.read_bytes())
    h.update((torch.__version__ + " ".join(_FLAGS)).encode())
    return h.hexdigest()[:12]


def _load():
    from torch.utils.cpp_extension import load

    name = f"dlm_cpu_{_tag()}"
    if not hasattr(torch.ops.dlm_cpu, "linear"):  # not loaded in this process yet
        with _build_turn(name):
            load(
                name,
                sources=[str(p) for p in _sources() if p.suffix == ".cpp"],
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(SOURCES)],
                is_python_module=False,
                verbose=False,
            )
    return torch.ops.dlm_cpu


@contextlib.contextmanager
def _build_turn(name: str):
    """One process at a time builds or loads the extension ``name``, under an ``flock`` (which the system releases
    when its holder dies). torch's own guard is a ``lock`` file in the build folder that a killed build (a Ctrl-C
    during the first run's compile) leaves behind, after which every later load waits for it forever; holding the
    flock, no other dlm process is building, so such a file is stale and is removed."""

    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(name, False))
    except (ImportError, OSError):  # another torch: its own guard alone
        yield
        return
    with file_lock(folder.parent / f"{name}.dlm-lock"):
        (folder / "lock").unlink(missing_ok=True)
        yield


def extension():
    """The kernels' operators (``torch.ops.dlm_cpu``; built on first call), or None where they are off or cannot
    be built here."""
    if _built:
        return _built[0]
    ops = None
    if mode() != "off":
        try:
            ops = _load()
        except Exception as e:  # noqa: BLE001 - no compiler / ninja / headers: the stock layers still work
            if mode() == "on":
                last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                raise DLMError(
                    f"{ENV}=1 but the CPU decode kernels could not be built ({type(e).__name__}: "
                    f"{last}); install a C++ compiler and ninja (pip install ninja) or unset {ENV}"
                ) from e
            warnings.warn(
                f"dlm: the CPU decode kernels could not be built ({type(e).__name__}); decoding uses "
                f"torch's own layers. Set {ENV}=0 to skip the attempt.",
                stacklevel=2,
            )
    if ops is not None:
        set_isa(env(ISA_ENV) or "auto", ops)
    _built.append(ops)
    return ops


def set_isa(name: str, ops=None) -> str:
    """Use the kernels of ``name`` (``auto`` or one of :data:`ISAS`); returns the one in use."""

    ops = ops if ops is not None else extension()
    name = (name or "auto").strip().lower()
    if ops is None:
        raise DLMError(f"the CPU decode kernels are not built here; {ISA_ENV}={name} has no effect")
    have = ops.isas().split(",")
    if name != "auto" and name not in have:
        raise DLMError(
            f"{ISA_ENV}={name}: this CPU runs only {', '.join(have)} kernels (choose one of those, or auto)"
            if name in ISAS
            else f"{ISA_ENV}={name}: choose auto, {', '.join(ISAS)}"
        )
    return ops.set_isa(name)


def isa() -> str | None:
    """The instruction set whose kernels are in use, or None where there are none."""
    ops = extension()
    return ops.isa() if ops is not None else None
