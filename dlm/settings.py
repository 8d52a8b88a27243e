"""dlm's environment variables: every ``DLM_*`` variable is named and documented here and read through :func:`env`
(at the moment it is needed, so a variable set before a call counts); docs/DEVELOPING.md's table is this one (a test
keeps them equal). One root holds dlm's own files: :func:`home`.

Variables of other tools that dlm reads for their own meaning (``HF_*`` through huggingface_hub, ``RANK`` /
``WORLD_SIZE`` and ``ACCELERATE_*`` from a distributed launcher, ``XDG_CACHE_HOME``) are not dlm's and are not
listed.
"""

from __future__ import annotations

import os
from pathlib import Path

from dlm import deprecations

VARIABLES: dict[str, str] = {
    "DLM_HOME": "the root of dlm's own files: the embedded model's folder (`models/`), the CPU kernels' and "
    "precision's measured choices, converted folders for vLLM (`vllm/`), hub benchmark data (`data/`), vLLM's "
    "virtual environment (`venv-vllm/`); default `$XDG_CACHE_HOME/dlm`, else `~/.cache/dlm`",
    "DLM_CACHE_DIR": "the old name of `DLM_HOME` (still read, with a DeprecationWarning; removed in the next release)",
    "DLM_DEVICE": "the default device (`cpu`, `cuda`, `cuda:1`, `mps`) where a command has no `--device`",
    "DLM_API_KEY": "`dlm serve`'s API key where `--api-key` is not given",
    "DLM_VLLM_VENV": "where `scripts/install_vllm.sh` puts vLLM's environment (default `$DLM_HOME/venv-vllm`)",
    "DLM_VLLM_PYTHON": "the Python that runs vLLM for `dlm serve --engine vllm` (default: the venv above's)",
    "DLM_CPU_KERNEL": "the CPU decode kernels: `auto` (where measured faster, default), `1` / `on`, `0` / `off`",
    "DLM_CPU_ISA": "the kernels' instruction set: `auto` (the best the CPU has), `avx512vnni`, `avx512`, `avx2`, `generic`",
    "DLM_CPU_QUANT": "`0` keeps GGUF-quantized layers out of the kernels' packed form (default `1`)",
    "DLM_CPU_ADAPTERS": "the kernels' form for gated adapters: `q8_0` (8-bit blocks, default) or `f32`",
    "DLM_CPU_ACTIVATIONS": "how GGUF Q4_1 / Q8_0 layers take their inputs in the kernels: `f32` (exact, default) or `int8` "
    "(integer dot products as llama.cpp's: faster, ~1e-2 relative error)",
    "DLM_CPU_BF16": "training's bf16 autocast on a CPU: unset (where measured faster), `1` / `on`, `0` / `off`",
    "DLM_PREPARE_TEST_DELAY_S": "tests only: seconds `dlm prepare` sleeps after each source file (to stop it midway)",
}


def env(name: str, default: str | None = None) -> str | None:
    """The value of dlm's variable ``name`` (one of :data:`VARIABLES`), or ``default`` where it is unset."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not one of dlm's environment variables (dlm.settings.VARIABLES)")
    return os.environ.get(name, default)


def home() -> Path:
    """The root of dlm's own files: ``$DLM_HOME``, else the old ``$DLM_CACHE_DIR`` (deprecated), else
    ``$XDG_CACHE_HOME/dlm``, else ``~/.cache/dlm``."""
    root = env("DLM_HOME")
    if not root and env("DLM_CACHE_DIR"):
        deprecations.warn("DLM_CACHE_DIR")
        root = env("DLM_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dlm"


def table() -> str:
    """The variables as a markdown table (docs/DEVELOPING.md holds this)."""
    rows = ["| variable | meaning |", "|---|---|"] + [f"| `{k}` | {v} |" for k, v in VARIABLES.items()]
    return "\n".join(rows) + "\n"
