"""The static decode step: the engine's decode forward with fixed shapes per (batch bucket, chunk bucket, key span),
so that on CUDA it is captured once per shape as a CUDA graph and replayed (one launch instead of ~1,000 kernel
launches and the Python around them).

Layout (:class:`StaticKV`): per layer one preallocated key and one value buffer ``[rows, H, capacity, D]``; row
``b`` writes its chunk at its own slots ``lens[b] .. lens[b] + Q - 1`` (a ``scatter_`` at a device index, so the
slots are data, not shapes) and attends to ``valid[b]`` (True = a live token of that row; always False at
``lens[b]`` and beyond). A rejected ISD draft is not a hole here: the row's write pointer simply does not move past
it and the next chunk overwrites it. Tree chunks that keep a non-prefix leave holes (``valid`` False), gathered
out only when a row runs out of room (:meth:`StaticKV.compact`); only then, or when the rows outgrow the buffers
(which then double), does the layout change. Room for a request's prompt + new tokens is made when it is added
(:meth:`StaticKV.plan`), and with graphs the buffers hold the engine's whole batch from the start. Rows join from
the engine's ordinary prefill (a :class:`~dlm.decode.engine.KVBatch`, copied into free rows) and leave by moving
the rows behind them forward.

The forward (:meth:`StaticDecode.forward`): the batch is padded to a bucket (1, 2, 4, 8, 16, 32, then multiples of
32) with pad rows that see only their own chunk, each chunk to a bucket (1..8, then powers of two) with pad tokens
that no real token sees, and the keys to a span (CPU: the live length rounded up to 64 slots; CUDA: a power of two
>= 256, up to the capacity). The mask ``[B, 1, Q, span]`` is built inside the forward from ``valid``, ``lens`` and
the chunk's own pattern ``[B, Q, Q]``, so everything that varies from step to step is the content of fixed tensors.

On CUDA, :class:`GraphRunner` captures that forward with ``torch.cuda.graphs`` per shape (see docs/decoding.md
for why not ``torch.compile``). A gated-LoRA model's gate hook runs sync-free there (``dlm.model.lora.sync_free``:
no mask count or row index on the host; the deltas on every row, kept at the masks); models with other Python
forward hooks run the same static forward uncaptured.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from dlm.model.lora import GatedLoRA, sync_free

SPAN_GRANULE = 64  # CPU: key span rounded up to this many slots
GRAPH_MIN_SPAN = 256  # CUDA: key spans are powers of two from this
INITIAL_CAPACITY = 256  # slots per row before the first growth


def static_default(device) -> bool:
    """Whether an engine on ``device`` runs the static decode step where its caller does not say: on CUDA, where it is
    captured as graphs and gives a 1B-class body's AR 4.0x the growing cache's tokens/s at batch 1 and 1.7-2.4x at
    8-32 on an H200 (docs/benchmarks.md#static-step-gpu); not on a CPU, where it gives the same tokens 1.05-1.2x
    slower."""
    return torch.device(device).type == "cuda"


def batch_bucket(b: int) -> int:
    """1, 2, 4, 8, 16, 32, then multiples of 32."""
    if b <= 32:
        return 1 << max(b - 1, 0).bit_length()
    return -(-b // 32) * 32


def chunk_bucket(q: int) -> int:
    """1..8 as they are (AR and ISD chunks: 1 .. 2N-1), then powers of two."""
    return q if q <= 8 else 1 << (q - 1).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


_slot_layer: list[type] = []


def _slot_layer_class():
    if _slot_layer:
        return _slot_layer[0]
    from transformers.cache_utils import DynamicLayer

    class SlotLayer(DynamicLayer):
        """One layer of a :class:`StaticKV`: writes the chunk's keys/values at the owner's write slots and returns
        the first ``span`` slots of the rows in the forward."""

        def __init__(self, owner: StaticKV, keys: torch.Tensor, values: torch.Tensor):
            super().__init__()
            self.owner, self.kbuf, self.vbuf = owner, keys, values
            self.device = keys.device
            self.keys, self.values = keys, values
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:  # buffers are made by the owner
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            o = self.owner
            b, h, q, d = key_states.shape
            idx = o.write_index
            kb, vb = self.kbuf[:b], self.vbuf[:b]
            kb.scatter_(2, idx.expand(b, h, q, d), key_states.to(kb.dtype))
            vb.scatter_(2, idx.expand(b, h, q, value_states.shape[-1]), value_states.to(vb.dtype))
            return kb[:, :, : o.span], vb[:, :, : o.span]

        def get_seq_length(self) -> int:
            return self.owner.span

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.owner.span, 0

        def get_max_length(self) -> int:
            return self.owner.capacity

    _slot_layer.append(SlotLayer)
    return SlotLayer


class StaticKV:
    """Preallocated KV buffers with a write pointer (``lens``) and live slots (``valid``) per row; the engine's
    cache interface (``merge``, ``select``, ``after_extend``, ``compact``, ``live``, ``seq_len``) over them."""

    def __init__(self, device, capacity: int | None = None, graphs: bool = False, rows: int = 0):
        from transformers.cache_utils import Cache

        self.device = torch.device(device)
        self.capacity = max(int(capacity or INITIAL_CAPACITY), SPAN_GRANULE)
        self.graphs = graphs
        self.min_rows = rows  # buffer rows of the first allocation (graphs: the engine's whole batch, see plan)
        self.rows = 0  # live rows: buffer rows 0 .. rows-1
        self.row_capacity = 0
        self.lens: list[int] = []  # write pointer of each live row (host copy; the device gets it per step)
        self.valid = torch.zeros(0, self.capacity, dtype=torch.bool, device=self.device)
        self.bufs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cache = Cache(layers=[])
        self.generation = 0  # bumped whenever the buffers are reallocated (captured graphs hold their addresses)
        # per forward: the write slots [B, 1, Q, 1] and the key span
        self.write_index = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=self.device)
        self.span = 0

    # -- the engine's cache interface ---------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.rows

    @property
    def seq_len(self) -> int:
        return max(self.lens, default=0)

    def live(self) -> torch.Tensor:
        if not self.rows:
            raise RuntimeError("StaticKV: no rows in the cache")
        return self.valid[: self.rows, : self.seq_len]

    def hole_fraction(self) -> float:
        return 0.0  # holes are gathered out only when a row runs out of room (ensure_room)

    def _alloc(self, row_capacity: int, capacity: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """(Re)allocate the buffers, keeping the live rows' slots."""
        keep = self.seq_len
        bufs = []
        for k, v in like:
            kb = k.new_zeros(row_capacity, k.shape[1], capacity, k.shape[3])
            vb = v.new_zeros(row_capacity, v.shape[1], capacity, v.shape[3])
            bufs.append((kb, vb))
        valid = torch.zeros(row_capacity, capacity, dtype=torch.bool, device=self.device)
        if self.bufs and self.rows:
            for (kb, vb), (ko, vo) in zip(bufs, self.bufs):
                kb[: self.rows, :, :keep].copy_(ko[: self.rows, :, :keep])
                vb[: self.rows, :, :keep].copy_(vo[: self.rows, :, :keep])
            valid[: self.rows, :keep] = self.valid[: self.rows, :keep]
        self.bufs, self.valid = bufs, valid
        self.row_capacity, self.capacity = row_capacity, capacity
        layer_cls = _slot_layer_class()
        self.cache.layers = [layer_cls(self, kb, vb) for kb, vb in bufs]
        self.generation += 1

    def plan(self, slots: int) -> None:
        """A request of up to ``slots`` tokens (prompt + new tokens) is coming: room for it in every row now, in one
        allocation, rather than by doublings while it decodes (each of which drops the captured graphs)."""
        if not self.bufs:
            self.capacity = max(self.capacity, _round_up(slots, SPAN_GRANULE))
        elif slots > self.capacity:
            self.reserve(self.row_capacity, slots)

    def reserve(self, rows: int, slots: int) -> None:
        """Room for ``rows`` buffer rows of ``slots`` slots (grows by doubling)."""
        if not self.bufs:
            return
        r, c = self.row_capacity, self.capacity
        if rows > r:
            r = max(batch_bucket(rows), 2 * r)
        if slots > c:
            c = _round_up(max(slots, 2 * c), SPAN_GRANULE)
        if (r, c) != (self.row_capacity, self.capacity):
            self._alloc(r, c, self.bufs)

    def merge(self, other) -> None:
        """Copy the rows of ``other`` (a KVBatch: a prefill's cache) into the rows after the live ones."""
        if other.valid is None:
            return
        k, s = other.valid.shape
        layers = other._layers()
        if not self.bufs:
            shapes = [(la.keys, la.values) for la in layers]
            self._alloc(batch_bucket(max(k, self.min_rows)), _round_up(max(self.capacity, 2 * s), SPAN_GRANULE), shapes)
        if len(layers) != len(self.bufs):
            raise RuntimeError("cannot merge KV caches with different numbers of layers")
        self.reserve(self.rows + k, s + 1)
        r0 = self.rows
        for (kb, vb), la in zip(self.bufs, layers):
            kb[r0 : r0 + k, :, :s].copy_(la.keys)
            vb[r0 : r0 + k, :, :s].copy_(la.values)
        ov = other.valid.to(self.device)
        self.valid[r0 : r0 + k] = False
        self.valid[r0 : r0 + k, :s] = ov
        self.lens += _extent(ov.cpu()).tolist()
        self.rows += k

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these live rows (ascending), moved to the front of the buffers."""
        order = [int(i) for i in rows.tolist()]
        n = self.seq_len
        for dst, src in enumerate(order):
            if dst != src:
                for kb, vb in self.bufs:
                    kb[dst, :, :n].copy_(kb[src, :, :n])
                    vb[dst, :, :n].copy_(vb[src, :, :n])
                self.valid[dst].copy_(self.valid[src])
        self.valid[len(order) : self.rows] = False
        self.lens = [self.lens[i] for i in order]
        self.rows = len(order)

    def drop(self, i: int) -> None:
        """Forget row ``i``'s cached KV (a row that re-feeds from an earlier position)."""
        self.valid[i] = False
        self.lens[i] = 0

    def after_extend(self, keep: torch.Tensor) -> None:
        """Mark the kept tokens of the chunk just written (``keep [B, Q]``) live and move each write pointer past
        the last one kept."""
        keep = keep.to(self.device)
        b, q = keep.shape
        start = torch.tensor(self.lens, dtype=torch.long, device=self.device)
        slots = start[:, None] + torch.arange(q, device=self.device)[None]
        self.valid[:b].scatter_(1, slots, keep)
        self.lens = (start.cpu() + _extent(keep.cpu())).tolist()

    def compact(self) -> None:
        """Gather each row's live slots to its front (order kept): removes the holes in one copy."""
        if not self.rows:
            return
        b, n = self.rows, self.seq_len
        valid = self.valid[:b, :n]
        counts = valid.sum(1)
        m = int(counts.max())
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :m]  # live slots first
        for kb, vb in self.bufs:
            for buf in (kb, vb):
                idx = order[:, None, :, None].expand(b, buf.shape[1], m, buf.shape[3])
                buf[:b, :, :m] = buf[:b, :, :n].gather(2, idx)
        self.valid[:b] = torch.arange(self.capacity, device=self.device)[None] < counts[:, None]
        self.lens = counts.cpu().tolist()

    def holes(self) -> bool:
        return bool(self.rows) and int(self.valid[: self.rows].sum()) < sum(self.lens)

    def ensure_room(self, rows: int, q: int) -> None:
        """Buffer rows for a forward of ``rows`` (padded) rows and room for a ``q``-token chunk in every row."""
        if self.seq_len + q > self.capacity and self.holes():
            self.compact()
        self.reserve(rows, self.seq_len + q)

    def span_for(self, need: int) -> int:
        if self.graphs:
            return min(self.capacity, max(GRAPH_MIN_SPAN, 1 << (need - 1).bit_length()))
        return min(self.capacity, _round_up(need, SPAN_GRANULE))


def _extent(keep: torch.Tensor) -> torch.Tensor:
    """Per row, 1 + the index of its last True (0 where none): how far the write pointer moves."""
    q = keep.shape[1]
    return (keep.to(torch.long) * torch.arange(1, q + 1)).amax(1) if q else torch.zeros(keep.shape[0], dtype=torch.long)


def static_mask(valid: torch.Tensor, lens: torch.Tensor, pattern: torch.Tensor, span: int) -> torch.Tensor:
    """``[B, 1, Q, span]`` bool (True = may attend): query j of row b sees the row's live slots before
    ``lens[b]`` and, at slots ``lens[b] + k``, chunk token k where ``pattern[b, j, k]``. Fixed shapes only."""
    b, q, _ = pattern.shape
    rel = torch.arange(span, device=valid.device)[None] - lens[:, None]  # [B, span]: slot - write pointer
    past = valid[:b, :span] & (rel < 0)
    inside = (rel >= 0) & (rel < q)
    chunk = pattern.gather(2, rel.clamp(0, q - 1)[:, None, :].expand(b, q, span)) & inside[:, None, :]
    return (past[:, None, :] | chunk)[:, None]


class GraphRunner:
    """CUDA graphs of the static forward, one per (batch bucket, chunk bucket, key span) and buffer layout."""

    def __init__(self, fn):
        self.fn = fn
        self.graphs: dict[tuple, tuple[Any, dict[str, torch.Tensor], torch.Tensor]] = {}
        self.generation = -1
        self.pool = None
        self.failed: str | None = None
        self.captures = 0
        self.replays = 0

    def __call__(self, key: tuple, generation: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if generation != self.generation:  # the buffers moved: every graph points at the old ones
            self.graphs.clear()
            self.generation = generation
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(inputs)
            if entry is None:
                return self.fn(**inputs)
            self.graphs[key] = entry
        graph, static, out = entry
        for name, t in inputs.items():
            static[name].copy_(t, non_blocking=True)
        graph.replay()
        self.replays += 1
        return out.clone()  # the graphs share one memory pool: the next replay may reuse this output's memory

    def _capture(self, inputs: dict[str, torch.Tensor]):
        if self.failed is not None:
            return None
        static = {name: t.clone() for name, t in inputs.items()}
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the capture (lazy inits, autotuning)
                for _ in range(2):
                    self.fn(**static)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.fn(**static)
        except Exception as e:  # noqa: BLE001 - anything the capture cannot take: run uncaptured from now on
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"CUDA graph capture failed, the static decode step runs uncaptured: {self.failed}", stacklevel=2
            )
            return None
        self.captures += 1
        return graph, static, out


def graphs_unsupported(model) -> str | None:
    """Why ``model``'s forward cannot be captured (None: it can): Python hooks that may read tensors on the host.
    A gated-LoRA gate is not one: the captured forward runs it sync-free (:func:`dlm.model.lora.sync_free`)."""
    for name, m in model.named_modules():
        for hook in (*m._forward_pre_hooks.values(), *m._forward_hooks.values()):
            if not isinstance(getattr(hook, "__self__", None), GatedLoRA):
                return f"module '{name or type(m).__name__}' has forward hooks ({_hook_name(hook)})"
    return None


def _hook_name(hook) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__


class StaticDecode:
    """The engine's decode forward over a :class:`StaticKV` (which becomes ``engine.kv``)."""

    def __init__(self, engine, graphs: bool | None = None, capacity: int | None = None):
        self.engine = engine
        cuda = engine.device.type == "cuda" and torch.cuda.is_available()
        why = graphs_unsupported(engine.model) if cuda else "not a CUDA device"
        if graphs is None:
            graphs = why is None
        elif graphs and why is not None:
            warnings.warn(
                f"CUDA graphs are off for this engine: {why}; the static decode step runs uncaptured", stacklevel=2
            )
            graphs = False
        self.graphs = bool(graphs)
        self.why_not_graphs = None if self.graphs else why
        # with graphs, buffer rows for the engine's whole batch from the start: a growth moves the buffers, and every
        # graph captured over the old ones is dropped (no such cost without graphs: rows grow as they join)
        rows = engine.max_batch_size if self.graphs else 0
        self.kv = StaticKV(engine.device, capacity, graphs=self.graphs, rows=rows)
        self.runner = GraphRunner(self._run) if self.graphs else None

    def _run(self, ids, pos, lens, pattern, slots):
        kv = self.kv
        kv.write_index = slots[:, None, :, None]
        mask = static_mask(kv.valid, lens, pattern, kv.span)
        # captured: the gated adapters' gate reads nothing on the host
        with sync_free(self.engine.model) if self.graphs else contextlib.nullcontext():
            return self.engine._forward(ids, pos, mask, kv.cache)

    def forward(self, rows, chunks: list[list[int]], ids: torch.Tensor, pos: torch.Tensor, trees: dict):
        """Logits ``[B, Q, V]`` of the step whose chunks are ``ids``/``pos`` ``[B, Q]`` (host tensors)."""
        engine, kv = self.engine, self.kv
        b, q = ids.shape
        for i, r in enumerate(rows):
            if r.fresh:  # this row re-feeds from an earlier position: its cached KV goes
                kv.drop(i)
                r.fresh = False
        bb, qb = batch_bucket(b), chunk_bucket(q)
        kv.ensure_room(bb, qb)
        kv.span = span = kv.span_for(kv.seq_len + qb)
        ids_p = torch.full((bb, qb), engine.pad_id, dtype=torch.long)
        ids_p[:b, :q] = ids
        pos_p = torch.zeros(bb, qb, dtype=torch.long)
        pos_p[:b, :q] = pos
        if qb > q:  # pad tokens: positions after the chunk's last, nobody attends to them
            pos_p[:b, q:] = pos[:, q - 1 : q] + torch.arange(1, qb - q + 1)[None]
            pos_p.clamp_(max=engine.max_positions - 1)
        lens = torch.zeros(bb, dtype=torch.long)
        lens[:b] = torch.tensor(kv.lens, dtype=torch.long)
        pattern = torch.ones(qb, qb, dtype=torch.bool).tril_().expand(bb, qb, qb).clone()
        if engine.decoder.causal:
            for i, (_, attn) in trees.items():
                n = len(chunks[i])
                pattern[i, :n, :n] = attn
        else:
            pattern[:b] = torch.eye(qb, dtype=torch.bool)  # pads see themselves only, no real token sees them
            for i, (r, c) in enumerate(zip(rows, chunks)):
                n = len(c)
                pattern[i, :n, :n] = engine.decoder.chunk_attention(engine, r, pos[i, :n])
        slots = lens[:, None] + torch.arange(qb)[None]
        dev = engine.device
        inputs = {
            "ids": ids_p.to(dev),
            "pos": pos_p.to(dev),
            "lens": lens.to(dev),
            "pattern": pattern.to(dev),
            "slots": slots.to(dev),
        }
        forwards = engine.total_forwards
        if self.runner is not None:
            logits = self.runner((bb, qb, span), kv.generation, inputs)
        else:
            logits = self._run(**inputs)
        engine.total_forwards = forwards + 1  # one step, however many warm-up and capture runs it took
        return logits[:b, :q]
