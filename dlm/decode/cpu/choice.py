"""Whether the CPU kernels beat torch's own layers on this machine, for this model: a micro-benchmark at attach.

For each distinct linear layer of the model (output and input size, packed kind) the kernel and ``F.linear`` are
timed on the layer's own weights, interleaved, at 1 row (an AR step) and 4 rows (an ISD verify chunk), the best of
a few repeats each; the totals weighted by how many layers have that shape decide: the kernels are used only if
they are at or under the stock time at both row counts, and a quantized packing only where it is at or under the
fp32 packing. The decision is cached per CPU model, instruction set, torch version, thread count and model shape
(``$DLM_CACHE_DIR`` or ``~/.cache/dlm``, file ``cpu_kernel_choice.json``), so it is measured once per machine.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dlm.device import cpu_name
from dlm.fsutil import read_records, write_record

ROWS = (1, 4)
REPEATS = 5
CACHE_FILE = "cpu_kernel_choice.json"


@dataclass
class Choice:
    use: bool  # the kernels at all
    quant: bool  # the quantized packing where a weight has that form
    stock_ms: dict = field(default_factory=dict)  # rows -> ms of the model's linears through F.linear
    kernel_ms: dict = field(default_factory=dict)  # rows -> ms through the kernels (the chosen packing)
    fp32_ms: dict = field(default_factory=dict)  # rows -> ms through the kernels with every weight fp32-packed
    isa: str = ""
    cached: bool = False
    forced: str = ""  # "": measured; else why it was not (DLM_CPU_KERNEL=1)

    def summary(self) -> str:
        if self.forced:
            return f"kernels on ({self.forced}; {self.isa})"
        ratio = ", ".join(
            f"{r} row{'s' if int(r) > 1 else ''} {self.kernel_ms[r] / self.stock_ms[r]:.2f}x"
            for r in self.kernel_ms
            if self.stock_ms.get(r)
        )
        return (
            f"{'kernels' if self.use else 'stock layers'} ({self.isa}; linears' time vs stock: {ratio}; "
            f"{'quantized packing' if self.quant else 'fp32 packing'}{'; cached' if self.cached else ''})"
        )


def signature(layers: list[nn.Module]) -> list[tuple]:
    """(out, in, bias, weight form, count) of each distinct layer shape; the form ("q4_1", "q8_0", "f32") from the
    first rows of the group's first weight (a cheap probe: the packing checks every block)."""
    from dlm.decode.cpu.packing import probe_form

    seen: dict = {}
    for m in layers:
        out, inp = m.weight.shape if isinstance(m, nn.Linear) else m.weight.shape[::-1]
        key = (int(out), int(inp), m.bias is not None)
        if key not in seen:
            seen[key] = [probe_form(m.weight.detach() if isinstance(m, nn.Linear) else m.weight.detach().t()), 0]
        seen[key][1] += 1
    return [(*k, *v) for k, v in sorted(seen.items())]


def cache_key(layers: list[nn.Module], isa: str) -> str:
    sig = json.dumps(signature(layers))
    return "|".join(
        [cpu_name(), isa, torch.__version__, str(torch.get_num_threads()), hashlib.sha1(sig.encode()).hexdigest()[:12]]
    )


def _write_cache(key: str, choice: Choice) -> None:
    write_record(CACHE_FILE, key, {k: v for k, v in asdict(choice).items() if k not in ("cached", "forced")})


def cached(key: str) -> Choice | None:
    rec = read_records(CACHE_FILE).get(key)
    if not isinstance(rec, dict):
        return None
    try:
        return Choice(**rec, cached=True)
    except TypeError:
        return None


@torch.no_grad()
def measure(layers: list[nn.Module], ops, repeats: int = REPEATS) -> Choice:
    """Time the model's distinct linear layers through ``F.linear`` and the kernels (see the module doc)."""
    groups: dict = {}
    for m in layers:
        key = (
            m._dlm_out,
            m.weight.numel() // m._dlm_out,
            str(m._dlm_packed.dtype),
            m._dlm_tail is not None,
            m.bias is not None,
            isinstance(m, nn.Linear),
        )
        groups.setdefault(key, [m, 0])[1] += 1
    stock, kern, f32 = ({r: 0.0 for r in ROWS} for _ in range(3))
    g = torch.Generator().manual_seed(0)
    for (n, k, dtype, _, _, plain), (m, count) in groups.items():
        w = m.weight.detach() if plain else m.weight.detach().t()
        b = m.bias.detach() if m.bias is not None else None
        p32 = ops.pack(w.contiguous(), False) if dtype != str(torch.float32) else None
        for r in ROWS:
            x = torch.randn(r, k, generator=g)
            fns = {
                "stock": lambda x: F.linear(x, w, b),
                "kernel": lambda x: ops.linear(x, m._dlm_packed, n, b, m._dlm_tail),
            }
            if p32 is not None:
                fns["f32"] = lambda x: ops.linear(x, p32, n, b, None)
            for fn in fns.values():
                fn(x)  # warm: caches, threads
            t = {name: float("inf") for name in fns}
            for _ in range(repeats):  # interleaved, so that a drift of the machine's speed hits all alike
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn(x)
                    t[name] = min(t[name], time.perf_counter() - t0)
            stock[r] += count * t["stock"] * 1e3
            kern[r] += count * t["kernel"] * 1e3
            f32[r] += count * t.get("f32", t["kernel"]) * 1e3
    quant = all(kern[r] <= f32[r] for r in ROWS)
    best = kern if quant else f32
    use = all(best[r] <= stock[r] for r in ROWS)
    rnd = lambda d: {str(r): round(v, 4) for r, v in d.items()}  # noqa: E731
    return Choice(use=use, quant=quant, stock_ms=rnd(stock), kernel_ms=rnd(best), fp32_ms=rnd(f32), isa=ops.isa())


def choose(layers: list[nn.Module], ops) -> Choice:
    """The cached choice for this machine and model shape, else :func:`measure` it and cache it."""
    key = cache_key(layers, ops.isa())
    hit = cached(key)
    if hit is not None:
        return hit
    choice = measure(layers, ops)
    _write_cache(key, choice)
    return choice
