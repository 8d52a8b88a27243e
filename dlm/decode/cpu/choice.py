"""Whether the CPU kernels beat torch's own layers on this machine, for this model: a measurement at attach.

What is timed is what a decode step does: a pass over the model's linear layers in the order the forward runs
them, each on its own weights, at 1 row (an AR step) and 4 rows (an ISD verify chunk). A pass streams far more
weight bytes than any last-level cache holds (every layer, or an evenly spread sample of at most
:data:`WORKING_SET` bytes of fp32 weights for large models), so the timings measure memory traffic as decoding
pays it - timing one layer repeatedly would keep its weights in cache and favour the packing with more bytes.
Three variants are timed, interleaved and in rotating order within each round: torch's ``F.linear``, the kernels
on the chosen packing (GGUF-form Q4_1 / Q8_0 where a weight is exactly such values, else fp32), and the kernels
on fp32 packing of the layers that have a quantized one.

Decision, from the median of the rounds for each layer kind (same shape and packing): a kind keeps its quantized
packing only where it is at or under its fp32 packing; the kernels are used only if the total is at or under the
stock time at both row counts. Rounds are added (up to :data:`MAX_ROUNDS`) while a deciding ratio lies within
:data:`MARGIN` of 1. So one slow moment (a compile, another job) moves one round, not the median.

The decision is cached per CPU model, instruction set, torch version, thread count and model shape
(``$DLM_HOME``, default ``~/.cache/dlm``, file ``cpu_kernel_choice.json``). A measurement that contradicts the
same machine's decisions for its other model shapes is taken again before it is cached; a cached decision for
the stock layers is measured again until a second independent measurement confirms it; and the engine drops a
cached decision (:func:`forget`) when it observes its 1-row steps much slower than the decision predicted, so
the next start measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dlm.decode.cpu.packing import Packed, form_name, probe_form
from dlm.device import cpu_name
from dlm.fsutil import read_records, write_record

log = logging.getLogger(__name__)

ROWS = (1, 4)
ROUNDS = 5  # at least this many interleaved rounds
MAX_ROUNDS = 15  # at most, while a deciding ratio stays within MARGIN of 1
MARGIN = 0.05
WORKING_SET = 512 << 20  # fp32 weight bytes a pass streams at most (all layers below it): far beyond any LLC
SHARE = 0.1  # a layer kind whose time is under this share of the pass does not hold the rounds open
CONFIRM = 2  # independent measurements that agree before a decision for the stock layers stays cached
VERSION = "2"  # of the measurement: records of another version are measured again
CACHE_FILE = "cpu_kernel_choice.json"


@dataclass
class Choice:
    use: bool  # the kernels at all
    quant: bool  # a quantized packing kept for at least one layer kind
    stock_ms: dict = field(default_factory=dict)  # rows -> ms of the model's linears through F.linear
    kernel_ms: dict = field(default_factory=dict)  # rows -> ms through the kernels (the chosen packing per kind)
    fp32_ms: dict = field(default_factory=dict)  # rows -> ms through the kernels with every weight fp32-packed
    kinds: dict = field(default_factory=dict)  # layer kind -> {"path", "count", "vs_stock", "vs_fp32"} (1 row)
    fp32_kinds: list = field(default_factory=list)  # kinds kept fp32-packed although a quantized form fits
    rounds: int = 0
    confirmed: int = 1  # independent measurements that reached this decision
    isa: str = ""
    cached: bool = False
    forced: str = ""  # "": measured; else why it was not (DLM_CPU_KERNEL=1)
    note: str = ""  # e.g. "taken again: contradicted this machine's other shapes"

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
            f"{'quantized packing' if self.quant else 'fp32 packing'}; median of {self.rounds} rounds"
            f"{'; cached' if self.cached else ''}{'; ' + self.note if self.note else ''})"
        )

    def paths(self) -> str:
        """Which path each layer kind takes and why (for ``dlm generate -v`` and the server's start-up log)."""
        out = []
        for kind, k in self.kinds.items():
            path = k["path"] if self.use else "torch stock"
            why = f"{k['vs_stock']:.2f}x stock"
            if k.get("vs_fp32") is not None:
                why += f", {k['vs_fp32']:.2f}x its fp32 packing"
            out.append(f"{kind} x{k['count']}: {path} ({why} at 1 row)")
        return "; ".join(out)

    def predicted_ms(self, rows: int = 1) -> float:
        """The linears' time of one forward of ``rows`` rows on the chosen path, as measured (0: unknown)."""
        d = self.kernel_ms if self.use else self.stock_ms
        return float(d.get(str(rows), 0.0))


def signature(layers: list[nn.Module]) -> list[tuple]:
    """(out, in, bias, weight form, count) of each distinct layer shape; the form ("q4_1", "q8_0", "f32") from the
    first rows of the group's first weight (a cheap probe: the packing checks every block)."""

    seen: dict = {}
    for m in layers:
        out, inp = m.weight.shape if isinstance(m, nn.Linear) else m.weight.shape[::-1]
        key = (int(out), int(inp), m.bias is not None)
        if key not in seen:
            seen[key] = [probe_form(m.weight.detach() if isinstance(m, nn.Linear) else m.weight.detach().t()), 0]
        seen[key][1] += 1
    return [(*k, *v) for k, v in sorted(seen.items())]


def machine_key(isa: str) -> str:
    return "|".join([cpu_name(), isa, torch.__version__, str(torch.get_num_threads()), "v" + VERSION])


def cache_key(layers: list[nn.Module], isa: str, activations: str = "f32") -> str:
    """The choice cache's key: this machine and ISA, the layers' shapes and forms, and (where not the default
    fp32) how the Q4_1 forms take their activations - a different kernel, measured on its own."""
    sig = json.dumps(signature(layers))
    key = machine_key(isa) + "|" + hashlib.sha1(sig.encode()).hexdigest()[:12]
    return key if activations == "f32" else key + "|" + activations


_STORED = ("cached", "forced")


def _write_cache(key: str, choice: Choice) -> None:
    write_record(CACHE_FILE, key, {k: v for k, v in asdict(choice).items() if k not in _STORED})


def cached(key: str) -> Choice | None:
    rec = read_records(CACHE_FILE).get(key)
    if not isinstance(rec, dict):
        return None
    try:
        return Choice(**rec, cached=True)
    except TypeError:
        return None


def forget(key: str, why: str) -> None:
    """Drop the cached decision under ``key`` (the next attach measures again)."""
    records = read_records(CACHE_FILE)
    if key in records:
        write_record(CACHE_FILE, key, {"forgotten": why})
        log.warning("the CPU kernel choice will be measured again at the next start: %s", why)


def _others(key: str) -> list[dict]:
    """This machine's cached decisions for other model shapes."""
    prefix = key.rsplit("|", 1)[0] + "|"
    return [
        r
        for k, r in read_records(CACHE_FILE).items()
        if k.startswith(prefix) and k != key and isinstance(r, dict) and "use" in r
    ]


def _timed(variant: str, fn, x: torch.Tensor) -> float:
    """Seconds of one call (a seam for the tests, which plant slow moments here)."""
    t0 = time.perf_counter()
    fn(x)
    return time.perf_counter() - t0


Packs = list[tuple[nn.Module, Packed]]  # the linear layers and their packed weights, in forward order


def _kind_of(layer: tuple[nn.Module, Packed]) -> tuple:
    m, p = layer
    return (
        p.out,
        m.weight.numel() // p.out,
        str(p.packed.dtype),
        p.tail is not None,
        m.bias is not None,
        isinstance(m, nn.Linear),
    )


def _working_set(layers: Packs, kinds: list[tuple]) -> list[int]:
    """Indices of the layers a pass runs: all, or every s-th one (and one of each kind) below WORKING_SET bytes."""
    total = sum(m.weight.numel() * 4 for m, _ in layers)
    if total <= WORKING_SET:
        return list(range(len(layers)))
    step = math.ceil(total / WORKING_SET)
    chosen = list(range(0, len(layers), step))
    have = {kinds[i] for i in chosen}
    for i, k in enumerate(kinds):
        if k not in have:
            chosen.append(i)
            have.add(k)
    return sorted(chosen)


def labels(layers: Packs, names: list[str]) -> list[str]:
    """Each packed layer's kind as the report names it: its attribute names and shape, e.g. ``q_proj/o_proj
    576x576 Q4_1``: the weights' form where they fit one, else fp32; layers of one shape and form are one kind)."""
    kinds = [_kind_of(m) for m in layers]
    members: dict = {}
    for n, k in zip(names, kinds):
        members.setdefault(k, []).append(n.rsplit(".", 1)[-1])
    out = []
    for (m, p), k in zip(layers, kinds):
        short = "/".join(dict.fromkeys(x for x in members[k] if x)) or type(m).__name__
        form = form_name(p.packed)
        out.append(f"{short} {p.out}x{m.weight.numel() // p.out} {form}")
    return out


@torch.no_grad()
def measure(layers: Packs, ops, names: list[str] | None = None) -> Choice:
    """Time passes over the model's linear layers through ``F.linear`` and the kernels (see the module doc).
    ``layers`` in the order the forward runs them, with their :class:`~dlm.decode.cpu.packing.Packed`; ``names`` their
    qualified names (for the per-kind report)."""
    kinds = [_kind_of(m) for m in layers]
    label = dict(zip(kinds, labels(layers, names or [""] * len(layers))))
    count: dict = {}
    for k in kinds:
        count[k] = count.get(k, 0) + 1
    chosen = _working_set(layers, kinds)
    timed_count: dict = {}
    for i in chosen:
        timed_count[kinds[i]] = timed_count.get(kinds[i], 0) + 1
    scale = {k: count[k] / timed_count[k] for k in count}  # a sampled pass stands for the whole model
    g = torch.Generator().manual_seed(0)
    xs = {r: {} for r in ROWS}
    plan = []  # (kind, {variant: fn}) per timed layer, in forward order
    for i in chosen:
        (m, p), k = layers[i], kinds[i]
        n, kin = p.out, m.weight.numel() // p.out
        w = m.weight.detach() if isinstance(m, nn.Linear) else m.weight.detach().t()
        b = m.bias.detach() if m.bias is not None else None
        fns = {
            "stock": lambda x, w=w, b=b: F.linear(x, w, b),
            "kernel": lambda x, p=p, n=n, b=b: ops.linear(x, p.packed, n, b, p.tail),
        }
        if p.packed.dtype != torch.float32:
            p32 = ops.pack(w.contiguous(), False)
            fns["f32"] = lambda x, p32=p32, n=n, b=b: ops.linear(x, p32, n, b, None)
        for r in ROWS:
            if kin not in xs[r]:
                xs[r][kin] = torch.randn(r, kin, generator=g)
        plan.append((k, kin, fns))
    variants = ["stock", "kernel", "f32"]
    samples: dict = {(v, r, k): [] for v in variants for r in ROWS for k in count}

    def one_round(rotation: int) -> None:
        for r in ROWS:
            for v in variants[rotation % 3 :] + variants[: rotation % 3]:
                acc: dict = {}
                for k, kin, fns in plan:
                    fn = fns.get(v)
                    if fn is not None:
                        acc[k] = acc.get(k, 0.0) + _timed(v, fn, xs[r][kin])
                for k, t in acc.items():
                    samples[(v, r, k)].append(t * scale[k] * 1e3)

    for _, kin, fns in plan:  # warm: code, threads, page faults of the packed copies
        for fn in fns.values():
            fn(xs[1][kin])
    rounds = 0
    while True:
        one_round(rounds)
        rounds += 1
        if rounds < ROUNDS:
            continue
        choice, close = _decide(samples, count, label, layers, kinds)
        if not close or rounds >= MAX_ROUNDS:
            break
    choice.rounds, choice.isa = rounds, ops.isa()
    return choice


def _decide(samples: dict, count: dict, label: dict, layers: list, kinds: list) -> tuple[Choice, bool]:
    """The decision from the rounds' medians, and whether a deciding ratio is within MARGIN of 1."""
    med = {key: statistics.median(v) for key, v in samples.items() if v}
    stock = {r: sum(med[("stock", r, k)] for k in count) for r in ROWS}
    f32 = {r: sum(med.get(("f32", r, k), med[("kernel", r, k)]) for k in count) for r in ROWS}
    total1 = stock[1] or 1.0
    first = {k: layers[kinds.index(k)] for k in count}
    best = {r: 0.0 for r in ROWS}
    report: dict = {}
    fp32_kinds, quant_any, close = [], False, False
    for k in count:
        q = ("f32", 1, k) in med  # a quantized packing, timed against its fp32 one
        kern = sum(med[("kernel", r, k)] for r in ROWS)
        fp32 = sum(med[("f32", r, k)] for r in ROWS) if q else kern
        keep = q and kern <= fp32
        if q and abs(kern / max(fp32, 1e-12) - 1) < MARGIN and med[("stock", 1, k)] >= SHARE * total1:
            close = True
        if q and not keep:
            fp32_kinds.append(label[k])
        quant_any |= keep
        run = "f32" if q and not keep else "kernel"  # the variant this kind runs
        for r in ROWS:
            best[r] += med[(run, r, k)]
        p = first[k][1]
        form = form_name(p.packed) if keep else "fp32"
        path = f"kernels, {form}" + (" + fp32 tail" if keep and p.tail is not None else "")
        report[label[k]] = {
            "path": path,
            "count": count[k],
            "vs_stock": round(med[(run, 1, k)] / max(med[("stock", 1, k)], 1e-12), 3),
            "vs_fp32": round(med[("kernel", 1, k)] / max(med[("f32", 1, k)], 1e-12), 3) if q else None,
        }
    rnd = lambda d: {str(r): round(v, 4) for r, v in d.items()}  # noqa: E731
    # decided on the figures the record keeps, so a cached choice always reads as consistent with its own numbers
    # (a tie at that precision keeps the kernels: the difference is below what the record can show)
    stock_kept, best_kept = rnd(stock), rnd(best)
    use = all(best_kept[r] <= stock_kept[r] for r in stock_kept)
    if any(abs(best[r] / max(stock[r], 1e-12) - 1) < MARGIN for r in ROWS):
        close = True
    choice = Choice(
        use=use,
        quant=quant_any,
        stock_ms=stock_kept,
        kernel_ms=best_kept,
        fp32_ms=rnd(f32),
        kinds=report,
        fp32_kinds=fp32_kinds,
    )
    return choice, close


def choose(layers: Packs, ops, key: str, names: list[str] | None = None) -> Choice:
    """Measure (layers packed), checked against this machine's other decisions and the previous one for ``key``,
    and cache what is settled (see the module doc)."""
    previous = cached(key)
    ch = measure(layers, ops, names)
    others = _others(key)
    against = None
    if previous is not None and previous.use != ch.use:
        against = "its previous measurement"
    elif others:
        using = sum(r["use"] for r in others) * 2  # twice the records that use the kernels, against all of them
        if using != len(others) and (using > len(others)) != ch.use:
            against = "this machine's other model shapes"
    if against is not None:  # taken again: of the three verdicts (that one, the first, the second) the majority
        again = measure(layers, ops, names)
        again.confirmed = 2 if again.use == ch.use else 1
        again.note = f"taken again: the first measurement contradicted {against}" + (
            ", the second confirmed it" if again.use == ch.use else ""
        )
        log.info("CPU kernel choice %s", again.note)
        ch = again
    elif previous is not None and previous.use == ch.use:
        ch.confirmed = previous.confirmed + 1
    _write_cache(key, ch)
    return ch
