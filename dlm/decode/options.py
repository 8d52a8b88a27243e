"""The engine's own settings - how many rows it batches, the CPU threads, the static step, the prefix cache - as one
:class:`EngineOptions` with one default each. :class:`~dlm.decode.engine.Engine`, :func:`dlm.decode.generate`,
:func:`dlm.serve.loader.load_engine`, the scheduler and the commands all take it; a decoder's settings are not here
(they are its config, :mod:`dlm.decode.configs`).

The library's defaults leave the caller's process as it is (torch's thread count, no memory kept for earlier
prompts). The commands own their process: :data:`COMMANDS` picks the idle cores and keeps a prefix cache, and
:data:`SERVER` also batches more requests. Those departures are written here and nowhere else; the commands' flags
(:func:`add_flags`) take their defaults and help from this module. No torch import: the CLI parses with it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from dlm.errors import DLMError

if TYPE_CHECKING:
    from dlm.decode.cpu.runtime import KernelOptions

THREADS_HELP = (
    "CPU threads while decoding: auto (the cores other processes leave idle, looked at again every few seconds; on "
    "a busy 2-core machine 1 thread is ~3x faster than 2), a number, or torch (torch's own setting)"
)
STATIC_CACHE_HELP = (
    "decode steps with fixed shapes over a preallocated KV cache (dlm.decode.static), captured as CUDA graphs on "
    "CUDA where the model has no forward hooks; default: on on CUDA, off on a CPU (same tokens, slower there); "
    "--no-static-cache turns it off"
)


def parse_threads(value) -> int | str | None:
    """``threads`` / ``--threads``: ``auto``, a positive integer, or None / ``torch`` (leave torch's setting)."""
    if value is None or value == "torch":
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if isinstance(value, bool) or n < 1 or (isinstance(value, float) and value != n):
        raise DLMError(f"--threads takes 'auto', 'torch' or a positive integer, got {value!r}")
    return n


def check_prefix_tokens(n) -> int:
    """``n`` as a prefix-cache budget (``prefix_cache`` / ``--prefix-cache-tokens``), or a DLMError naming the flag."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise DLMError(f"--prefix-cache-tokens must be an integer >= 0 (0 = off), got {n}")
    return n


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs, whatever it decodes. Fields are checked (and ``threads`` normalised) when built, so a bad
    value fails before a model loads."""

    max_batch_size: int = 8
    """Requests decoded together (continuous batching: a finished row's slot goes to the next waiting request)."""
    threads: int | str | None = None
    """CPU threads while decoding: None leaves torch's setting, an int sets it, ``'auto'`` follows the cores other
    processes leave idle (:mod:`dlm.decode.threads`); set in the thread that steps and put back on close."""
    static_cache: bool | None = None
    """The static decode step (fixed shapes over preallocated KV, :mod:`dlm.decode.static`); None: the device's
    default (on CUDA where the decoder allows it, off on a CPU)."""
    cuda_graphs: bool | None = None
    """Capture the static step as CUDA graphs: None wherever the model allows, False never."""
    prefix_cache: int = 0
    """Tokens of recent prompts' KV kept for prompts that start the same way (0: off; causal decoders only,
    :mod:`dlm.decode.prefix`)."""
    compact_threshold: float = 0.5
    """Compact the dynamic KV cache once more than this share of its positions are holes (finished rows' room)."""
    kernels: KernelOptions | None = None
    """How the CPU kernels run on the model (:class:`dlm.decode.cpu.KernelOptions`); None: from the environment
    (``DLM_CPU_KERNEL``, ``DLM_CPU_QUANT``, ``DLM_CPU_ADAPTERS``, ``DLM_CPU_ACTIVATIONS``) when the engine attaches
    them."""

    def __post_init__(self):
        b = self.max_batch_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise DLMError(f"--batch-size / --max-batch-size (max_batch_size) must be a positive integer, got {b!r}")
        object.__setattr__(self, "threads", parse_threads(self.threads))
        check_prefix_tokens(self.prefix_cache)
        for name in ("static_cache", "cuda_graphs"):
            if getattr(self, name) not in (None, True, False):
                raise DLMError(f"EngineOptions.{name} is None, True or False, got {getattr(self, name)!r}")
        k = self.kernels
        if k is not None and type(k).__name__ != "KernelOptions":  # (no torch import here: the class by name)
            raise DLMError(f"EngineOptions.kernels is a dlm.decode.cpu.KernelOptions or None, got {k!r}")
        c = self.compact_threshold
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0.0 <= c <= 1.0:
            raise DLMError(f"EngineOptions.compact_threshold is a share in [0, 1], got {c!r}")


NAMES = frozenset(f.name for f in fields(EngineOptions))

COMMANDS = EngineOptions(threads="auto", prefix_cache=4096)
"""``dlm generate``: the idle cores, and a prefix cache (SmolLM2-135M's KV in fp32 is 45 KB a token: 4096 tokens are
180 MB) for prompts under one chat template or few-shot preamble (evaluation's generation tasks keep the same)."""
SERVER = replace(COMMANDS, max_batch_size=16)
"""``dlm serve``: as the commands, with more requests in the running batch (concurrent clients)."""


def misplaced(keywords, where: str) -> None:
    """Refuse engine settings given as loose keywords (the spelling before :class:`EngineOptions`), naming the fix."""
    loose = sorted(set(keywords) & (NAMES | {"batch_size"}))
    if loose:
        given = ", ".join(f"{k}=" for k in loose)
        fix = ", ".join(f"{'max_batch_size' if k == 'batch_size' else k}=..." for k in loose)
        raise DLMError(f"{where} takes the engine's settings as options=EngineOptions({fix}), not {given}")


def add_flags(p: argparse.ArgumentParser, defaults: EngineOptions, batch_flag: str, batch_help: str) -> None:
    """The engine's flags of a command, with ``defaults`` (:data:`COMMANDS` or :data:`SERVER`)."""
    p.add_argument(
        batch_flag,
        dest="max_batch_size",
        type=int,
        default=defaults.max_batch_size,
        help=f"{batch_help} (default {defaults.max_batch_size})",
    )
    p.add_argument(
        "--threads", default=defaults.threads or "torch", help=f"{THREADS_HELP} (default {defaults.threads})"
    )
    p.add_argument("--static-cache", action=argparse.BooleanOptionalAction, default=None, help=STATIC_CACHE_HELP)
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=defaults.prefix_cache,
        help="keep the KV of recent prompts, up to this many tokens, for prompts that start the same way (a chat's "
        "next turn, a shared system prompt or chat template, a document); 0 = off "
        f"(default {defaults.prefix_cache}; ar and isd)",
    )


def from_args(args) -> EngineOptions:
    """The :class:`EngineOptions` of a command's parsed flags (:func:`add_flags`); a bad value is a DLMError naming
    its flag, before any model loads."""
    return EngineOptions(
        max_batch_size=args.max_batch_size,
        threads=args.threads,
        static_cache=args.static_cache,
        prefix_cache=args.prefix_cache_tokens,
    )
