"""Device and dtype choice in one place. Nothing else in dlm says "cuda".

``DLM_DEVICE`` (e.g. ``cpu``, ``cuda:1``, ``mps``) overrides the automatic choice; tests set it to ``cpu``.

Training precision (``train.mixed_precision: auto``, :func:`training_precision`): bf16 autocast where it makes
training faster, fp32 elsewhere; the weights stay fp32 either way. On CUDA, bf16 wherever the GPU has it. On a CPU it
depends on the chip: with AMX tiles (Intel Xeon since Sapphire Rapids) or AVX512-BF16 (AMD Zen 4 and later) oneDNN
multiplies bf16 natively; without them bf16 is converted around fp32 arithmetic and many times slower. So on a CPU
with bf16 instructions a micro-benchmark decides: a decoder MLP block (two linears of a small model's shape, forward
and backward, at the run's tokens per micro-batch) timed in fp32 and under bf16 autocast, interleaved, the best of a
few repeats; bf16 is used where it takes at most :data:`BF16_MARGIN` of the fp32 time (a whole step also has fp32
parts: norms, softmax, the optimizer). A CPU without bf16 instructions is not measured. The verdict is cached per CPU
model, bf16 instruction sets, torch version, thread count and token count (``cpu_bf16_choice.json`` in
:func:`dlm.fsutil.cache_dir`); ``DLM_CPU_BF16=1`` / ``=0`` forces it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from dlm.errors import DLMError
from dlm.fsutil import read_records, write_record
from dlm.settings import env


def get_device(requested: str | None = None) -> torch.device:
    """The device to run on: the explicit request, else $DLM_DEVICE, else cuda > mps > cpu."""
    name = requested or env("DLM_DEVICE")
    if name and name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def supports_bf16(device: torch.device) -> bool:
    """Whether bf16 autocast is worth using on this device (fast bf16 matmuls)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return False


def get_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """Parse a dtype name (auto|float32|fp32|bfloat16|bf16|float16|fp16) for weights on ``device``."""
    if name in (None, "auto"):
        return torch.bfloat16 if supports_bf16(device) else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise DLMError(f"unknown dtype '{name}': use one of auto, {', '.join(table)}")
    return table[name]


def default_num_threads() -> int:
    return torch.get_num_threads()


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


BF16_ENV = "DLM_CPU_BF16"
BF16_CACHE_FILE = "cpu_bf16_choice.json"
BF16_MARGIN = 0.85  # bf16 is used where the probe takes at most this share of the fp32 time
_PROBE_SHAPE = (576, 1536)  # SmolLM2-135M's MLP (hidden, intermediate): the small end of what a CPU trains
_PROBE_REPEATS = 5


@dataclass
class Bf16Choice:
    use: bool
    why: str  # one line for the log and the console
    fp32_ms: float | None = None
    bf16_ms: float | None = None
    cached: bool = False


def cpu_bf16_isa() -> list[str]:
    """The CPU's native bf16 instruction sets that oneDNN uses, as torch sees them."""
    found = []
    for name, fn in (("amx", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported")):
        probe = getattr(torch.cpu, fn, None)
        with contextlib.suppress(Exception):
            if probe is not None and probe():
                found.append(name)
    return found


def _bf16_probe_ms(tokens: int, repeats: int = _PROBE_REPEATS) -> tuple[float, float]:
    """Best-of-``repeats`` milliseconds of an MLP block's forward + backward in fp32 and under bf16 autocast."""
    import torch.nn.functional as F

    hidden, inner = _PROBE_SHAPE
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(inner, hidden, generator=g).mul_(hidden**-0.5).requires_grad_()
    w2 = torch.randn(hidden, inner, generator=g).mul_(inner**-0.5).requires_grad_()
    x = torch.randn(tokens, hidden, generator=g).requires_grad_()

    def step(bf16: bool) -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            y = F.linear(F.silu(F.linear(x, w1)), w2)
        y.float().square().mean().backward()
        return time.perf_counter() - t0

    best = {False: float("inf"), True: float("inf")}
    for mode in (False, True):
        step(mode)  # warm: oneDNN's kernels, the threads
    for i in range(repeats):  # interleaved, alternating which goes first, so a drift of the machine hits both
        for mode in (False, True) if i % 2 == 0 else (True, False):
            best[mode] = min(best[mode], step(mode))
    return best[False] * 1e3, best[True] * 1e3


def cpu_bf16_choice(tokens: int = 512) -> Bf16Choice:
    """Whether bf16 autocast speeds up training on this CPU (see the module doc); cached once measured."""

    forced = (env(BF16_ENV) or "").strip().lower()
    if forced in ("1", "true", "on", "yes"):
        return Bf16Choice(True, f"bf16: forced by {BF16_ENV}={forced}")
    if forced in ("0", "false", "off", "no"):
        return Bf16Choice(False, f"fp32: forced by {BF16_ENV}={forced}")
    isa = cpu_bf16_isa()
    if not isa:
        return Bf16Choice(False, "fp32: this CPU has no bf16 instructions (no AMX, no AVX512-BF16)")
    tokens = max(64, min(int(tokens), 2048))
    key = "|".join([cpu_name(), "+".join(isa), torch.__version__, str(torch.get_num_threads()), str(tokens)])
    rec = read_records(BF16_CACHE_FILE).get(key)
    if isinstance(rec, dict) and isinstance(rec.get("fp32_ms"), float) and isinstance(rec.get("bf16_ms"), float):
        fp32_ms, bf16_ms, hit = rec["fp32_ms"], rec["bf16_ms"], True
    else:
        fp32_ms, bf16_ms = _bf16_probe_ms(tokens)
        write_record(BF16_CACHE_FILE, key, {"fp32_ms": round(fp32_ms, 4), "bf16_ms": round(bf16_ms, 4)})
        hit = False
    use = bf16_ms <= BF16_MARGIN * fp32_ms
    why = (
        f"{'bf16' if use else 'fp32'}: an MLP block's training step under bf16 autocast took "
        f"{bf16_ms / fp32_ms:.2f}x the fp32 time on this CPU ({', '.join(isa)}; {'cached' if hit else 'measured'})"
    )
    return Bf16Choice(use, why, fp32_ms, bf16_ms, hit)


def training_precision(device: torch.device, tokens: int = 512) -> tuple[str, str]:
    """``train.mixed_precision: auto`` resolved for ``device``: ("bf16" or "no", why); ``tokens`` per micro-batch."""
    if device.type == "cuda":
        return ("bf16", "bf16: this GPU has bf16") if supports_bf16(device) else ("no", "fp32: this GPU has no bf16")
    if device.type == "cpu":
        choice = cpu_bf16_choice(tokens)
        return ("bf16" if choice.use else "no"), choice.why
    return "no", f"fp32: bf16 autocast is not chosen automatically on {device.type}"


def peak_memory_mib(device: torch.device) -> float:
    """This process's peak memory so far: the CUDA allocator's peak on a GPU, else the peak resident set (RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_mib(device: torch.device) -> float:
    """This process's memory now: the CUDA allocator's on a GPU, else the resident set (RSS; 0 where /proc is not)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0
