"""The fused forward of a base decoder model whose layers are all fused: one loop over the layers' bodies, or one
``decode_stack`` call for the whole chunk (see the comments below)."""

from __future__ import annotations

import operator

import torch
from torch import nn

from dlm.decode.cpu.adapters import rows_indexed
from dlm.decode.cpu.layer import LayerForward, chunk_ok, layer_mask, rotary_ok
from dlm.decode.cpu.runtime import (
    ATTEND_MAX_QUERIES,
    CHECKED,
    MAX_ROWS,
    NO_BIAS,
    STATE,
    KernelForward,
    KernelOptions,
    active,
    global_hooks,
    patch,
    patched,
)
from dlm.model import lora as _lora
from dlm.model.lora import SLOT

# -- the decoder stack ------------------------------------------------------------------------------------------
# With every layer fused, what is left of a decode step's Python is the glue around the layers: the base model's
# forward (its decorators, the causal-mask builder, 30 module calls with 6 keyword arguments each) and every
# layer's own checks of its inputs - a quarter of a 1-row step of a 135M model on a fast CPU. Inside active() a
# base model (LlamaModel, Qwen2Model, ...) whose layers are all fused runs its decode chunks as one loop over the
# layers' bodies: the checks once per forward, the embedding, rotary embedding and final norm called as modules,
# the cache updated through its own API. Checked once per class against its own forward on the model itself
# (hidden states and cache bit for bit) before it is used; anything else (inputs_embeds, a 2-D padding mask,
# output_hidden_states, a hook on a layer, sliding windows) takes the model's own forward.

_stack_runs = [0]  # forwards the stack path took (for its check)
_STACK_KWARGS = frozenset(
    ("input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "inputs_embeds", "use_cache")
)


def _stack_parts(model: nn.Module):
    """(embedding, layers, final norm, rotary embedding, the layers' fused forwards) of a base decoder model the
    stack path takes, or None."""
    emb, layers, norm, rot = (getattr(model, a, None) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
    cfg = getattr(model, "config", None)
    if (
        not type(model).__name__.endswith("Model")
        or not isinstance(emb, nn.Embedding)
        or not isinstance(layers, nn.ModuleList)
        or not len(layers)
        or not isinstance(norm, nn.Module)
        or not patched(norm)
        or not isinstance(rot, nn.Module)
        or getattr(cfg, "num_hidden_layers", None) != len(layers)
        or patched(model)
    ):
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        if any(t != "full_attention" for t in types):
            return None
    elif getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return None
    fwds = [layer.__dict__.get("forward") for layer in layers]
    if not all(isinstance(f, LayerForward) for f in fwds):
        return None
    if len({f.hd for f in fwds}) != 1:
        return None
    return emb, layers, norm, rot, fwds


def attach_stacks(model: nn.Module, options: KernelOptions) -> None:
    for m in list(model.modules()):
        parts = _stack_parts(m)
        if parts is None:
            continue
        forward = StackForward(m, m.forward, parts, options)
        key = (type(m), "stack")
        if key not in CHECKED:
            if not forward.ready():  # hooks on it now: the check would not see the stack path run
                continue
            CHECKED[key] = _check_stack(m, forward)
        if CHECKED[key]:
            patch(m, forward)


def _output_type():
    from transformers.modeling_outputs import BaseModelOutputWithPast

    fields = getattr(BaseModelOutputWithPast, "__dataclass_fields__", {})
    return BaseModelOutputWithPast, "cache" if "cache" in fields else "past_key_values"


class StackForward(KernelForward):
    """A base decoder model's forward on decode chunks through its fused layers (see the comment above): one
    ``decode_stack`` call (:func:`_one_call`, its arguments kept in ``memo``) or the loop over the layers' bodies."""

    __slots__ = (
        "model", "stock", "options", "emb", "layers", "norm", "rot", "fwds", "hd", "out_type", "cache_field", "memo",
    )  # fmt: skip

    def __init__(self, model: nn.Module, stock, parts, options: KernelOptions):
        self.model, self.stock, self.options = model, stock, options
        self.emb, self.layers, self.norm, self.rot, self.fwds = parts
        self.hd = self.fwds[0].hd
        self.out_type, self.cache_field = _output_type()
        self.memo: dict = {}  # _one_call's plans of this stack

    def ready(self) -> bool:
        emb, rot = self.emb, self.rot
        if (
            self.model.training
            or emb._forward_hooks
            or emb._forward_pre_hooks
            or rot._forward_hooks
            or rot._forward_pre_hooks
            or global_hooks()
            or emb.weight.dtype != torch.float32
            or emb.weight.device.type != "cpu"
        ):
            return False
        for layer, f in zip(self.layers, self.fwds):
            if (
                layer._forward_hooks
                or layer._forward_pre_hooks
                or not f.ready()
                or layer.__dict__.get("forward") is not f
            ):
                return False
        return True

    def __call__(self, *args, **kwargs):
        stock = self.stock
        if args or not STATE.depth or torch.is_grad_enabled() or not _STACK_KWARGS.issuperset(kwargs.keys()):
            return stock(*args, **kwargs)
        ids, pos, mask = kwargs.get("input_ids"), kwargs.get("position_ids"), kwargs.get("attention_mask")
        cache = kwargs.get("cache")
        if cache is None:
            cache = kwargs.get("past_key_values")
        if (
            mask is None
            and cache is not None
            and isinstance(ids, torch.Tensor)
            and ids.dim() == 2
            and 1 < ids.shape[1] <= ATTEND_MAX_QUERIES
            and ids.numel() <= MAX_ROWS
        ):
            # a chunk without a mask: causal over the cache and itself, the mask the model's own forward builds (its
            # positions follow the cache's length, not position_ids); checked against it at attach
            t, past = ids.shape[1], cache.get_seq_length()
            mask = torch.ones(t, past + t, dtype=torch.bool).tril_(past)[None, None]
        if (
            not isinstance(ids, torch.Tensor)
            or kwargs.get("inputs_embeds") is not None
            or cache is None
            or ids.dim() != 2
            or not isinstance(pos, torch.Tensor)
            or pos.shape != ids.shape
            or not chunk_ok(ids.shape[0], ids.shape[1], mask)
            or not self.ready()
        ):
            return stock(*args, **kwargs)
        b, t = ids.shape
        h = self.emb(ids)
        cos, sin = self.rot(h, pos)  # (no hooks on either: going back to the stock forward repeats nothing visible)
        if not rotary_ok(b, t, self.hd, cos, sin):
            return stock(*args, **kwargs)
        options = self.options
        one = _one_call(self.fwds, h, cos, sin, mask, cache, self.memo, options) if options.one_call else None
        if one is not None:
            h = one
        else:
            for f in self.fwds:
                h = f.body(h, cos, sin, mask, cache)
        _stack_runs[0] += 1
        return self.out_type(last_hidden_state=self.norm(h), **{self.cache_field: cache})


# With the engine's growing KV cache, a stack whose every layer takes its two kernel calls runs the whole chunk in
# one call (decode_stack: the layers' calls and cache writes in C++, in the loop's order on its data, so bit for bit
# the loop). The loop's Python between the layers - the checks, the cache update, the kernels' arguments - cost
# 50-75 us a layer in a decode forward (the weights streaming through the caches evict the interpreter's data):
# 1.6 ms of a 10 ms AR step of SmolLM2-135M on 2 cores. KernelOptions.one_call = False keeps the loop (tests compare the two).
_NO_ROWS = torch.empty(0, dtype=torch.long)


def _one_call(fwds, h, cos, sin, mask, cache, memo: dict | None, options: KernelOptions):
    """The decoder layers on ``h [b, t, d]`` through one ``decode_stack`` call, or None (nothing done) where a
    layer takes the per-op steps, the cache is not the engine's growing one or its layers differ in length.

    ``memo`` keeps the call's arguments between forwards (:class:`_StackPlan`): building them - each layer's checks
    of hooks, packed weights and adapters, and its list of tensors - is Python that cost a 1-row step of a 30-layer
    model about as much as a tenth of its kernel time."""
    layers = getattr(cache, "layers", None)
    b, t, d = h.shape
    rows = b * t
    if layers is None or len(layers) != len(fwds) or getattr(cache, "offloading", False):
        return None
    for layer in layers:  # the engine's growing layers, each holding this batch's keys (a prefill's: not yet)
        keys = getattr(layer, "keys", None)
        if not hasattr(layer, "room") or not getattr(layer, "is_initialized", False) or keys is None or keys.dim() != 4:
            return None
    plan = _StackPlan.get(memo, fwds, rows, options)
    if plan is None:
        return None
    lora = plan.lora if plan.gated else None
    if lora is not None and not rows_indexed(lora, rows):
        return None  # (what qkv_deltas answers: the per-op path)
    ts, slots = plan.ts, plan.kv_slots
    rooms = []
    n0 = None
    for f, hk in zip(fwds, plan.kv_heads):
        layer = layers[f.layer_idx]
        keys, values = layer.keys, layer.values
        if keys.shape[0] != b or keys.shape[1] != hk or values.dim() != 4:
            return None
        kb, vb, n = layer.room(b, hk, t, keys.shape[-1], values.shape[-1], keys, values)
        if n0 is None:
            n0 = n
        elif n != n0:
            return None
        rooms.append((layer, kb, vb))
    mask = layer_mask(mask, b, t, n0 + t)
    idx, r, scale = (_NO_ROWS, 1, 1.0) if lora is None else (lora._idx, lora.settings.r, float(lora.scale))
    x2 = h.reshape(rows, d).contiguous()
    try:
        for j, (_, kb, vb) in zip(slots, rooms):
            ts[j], ts[j + 1] = kb, vb
        y = STATE.ops.decode_stack(x2, cos, sin, mask, b, fwds[0].hd, n0, ts, plan.fs, plan.ints, idx, r, scale)
    finally:
        for j in slots:  # the plan does not keep the KV buffers alive
            ts[j] = ts[j + 1] = NO_BIAS
    for layer, kb, vb in rooms:
        layer.extended(kb, vb, n0 + t)
    return y.view(b, t, d)


_next_hook = getattr(getattr(torch.utils, "hooks", None), "RemovableHandle", None)


class _StackPlan:
    """``decode_stack``'s arguments for a stack's decode forwards, with (or without) gated adapters acting: built
    by the layers' own checks (:class:`~dlm.decode.cpu.layer.LayerForward`'s ``plan`` and ``stack_args``) and kept while nothing
    those checks read has changed. Each forward compares, in a few C-level passes over flat lists: the hook count
    (``torch.utils.hooks.RemovableHandle.next_id``: every hook registration, on any module or global, takes a new
    id), the gated adapters' attach count (``dlm.model.lora.structure_version()``) and packed form (``KernelOptions.adapter_form``), and
    each packed weight, norm weight, bias and adapter matrix - the same object in its module (not replaced), its
    in-place version and its data address (what :meth:`packing.Packed.fresh` checks; versions and addresses in one
    kernel call, ``stamps_equal``: read from Python they cost ~0.4 ms a forward of a 30-layer model). A hook removed needs nothing (a plan is never
    built while one is there). Not seen: a hook put into a module's hook dict without a handle, a module's class
    changed other than by dlm's gated LoRA; neither dlm nor transformers does that."""

    __slots__ = (
        "gated",
        "lora",
        "hooks",
        "slots",
        "objs",
        "tensors",
        "stamps",
        "ts",
        "fs",
        "ints",
        "kv_slots",
        "kv_heads",
    )

    @staticmethod
    def _lora_of(fwds):
        """The stack's gated-LoRA module (one or none), False where layers hold adapters of two."""
        found = None
        for f in fwds:
            for m in f.mods:
                g = m.__dict__.get(SLOT)
                if g is not None:
                    if found is not None and g[0].lora is not found:
                        return False
                    found = g[0].lora
        return found

    @classmethod
    def get(cls, memo, fwds, rows: int, options: KernelOptions):
        """The plan for this forward: the kept one where nothing it depends on changed, else a new one."""
        if memo is None or _next_hook is None or not options.keep_plans:
            return cls.build(fwds, rows)
        epoch = (_lora.structure_version(), options.adapter_form)
        if memo.get("epoch") != epoch:  # adapters attached or taken off (or packed otherwise) since: all again
            memo.clear()
            memo["epoch"], memo["lora"] = epoch, cls._lora_of(fwds)
        lora = memo["lora"]
        if lora is False:
            return None
        gated = lora is not None and lora._n_gated != 0  # (a forward with mask rows or without: a plan each)
        plan = memo.get(gated)
        if plan is None or not plan.valid():
            if plan is not None:  # the other plan is likely stale too: not kept holding weights packed before
                memo.pop(not gated, None)
            plan = memo[gated] = cls.build(fwds, rows)
        return plan

    def valid(self) -> bool:
        """Nothing the plan was built from has changed (see the class; the attach count is the memo's)."""
        return (
            self.hooks == _next_hook.next_id
            and all(map(_is, map(_getitem, self.slots[0], self.slots[1]), self.objs))
            and STATE.ops.stamps_equal(self.tensors, self.stamps)
        )

    @classmethod
    def build(cls, fwds, rows: int):
        """The plan the layers' checks give now (they repack weights changed since), or None (the per-op path)."""
        hooks = _next_hook.next_id if _next_hook is not None else None
        plans = []
        for f in fwds:
            pl = f.plan(rows)
            if pl is None:
                return None
            plans.append(pl[0])
        gate = next((dl for dl in plans if dl is not None), None)  # (mask rows, A, B, r, scale): one gate a forward
        if gate is not None and any(dl is not None and (dl[0] is not gate[0] or dl[3:] != gate[3:]) for dl in plans):
            return None
        lora = cls._lora_of(fwds) if gate is not None else None
        if lora is False:  # adapters of two gated-LoRA modules in the stack: the per-op path
            return None
        self = cls()
        self.gated, self.hooks, self.lora = gate is not None, hooks, lora
        ts, fs, ints, kv_slots, kv_heads = [], [], [], [], []
        dicts, names, objs, tensors = [], [], [], []

        def watch(owner: nn.Module, name: str, tracked: bool) -> None:  # (a parameter, or None where it has none)
            d = owner._parameters if name in owner._parameters else owner.__dict__
            obj = d.get(name)
            dicts.append(d), names.append(name), objs.append(obj)
            if tracked and obj is not None:
                tensors.append(obj)

        for f, dl in zip(fwds, plans):
            tensors_, adapters, floats, widths = f.stack_args(dl)
            kv_heads.append(widths[1] // f.hd)
            ts += tensors_
            kv_slots.append(len(ts))
            ts += (NO_BIAS, NO_BIAS, *adapters)
            fs += floats
            ints += widths
            for n in (f.n1, f.n2):
                watch(n, "weight", False)
            for m in f.mods:
                watch(m, "weight", True)
                watch(m, "bias", False)
                g = m.__dict__.get(SLOT) if dl is not None else None
                if g is not None:
                    adapter = g[0].adapters[g[1]]
                    watch(adapter, "A", True)
                    watch(adapter, "B", True)
        self.ts, self.fs, self.ints, self.kv_slots, self.kv_heads = ts, fs, ints, kv_slots, kv_heads
        self.slots, self.objs, self.tensors = (dicts, names), objs, tensors
        try:
            self.stamps = STATE.ops.stamps(tensors)  # each one's (in-place version, data address)
        except RuntimeError:  # inference tensors keep no version: nothing to compare, so no plan kept
            self.hooks = None
            self.stamps = None
        return self


_is = operator.is_
_getitem = dict.get


def _check_stack(model: nn.Module, forward) -> bool:
    """The stack path against the model's own forward (its layers fused) inside active(), on the model itself: a
    3-token prompt, a 2-token chunk with a 4-D mask holding a hole, a 1-token step without a mask, one with a mask
    holding a hole and a 2-token chunk without a mask; hidden states and cache bit for bit, and the stack path ran
    each time. Gated adapters are held off (no mask rows) while it runs."""
    from transformers import DynamicCache

    loras = _lora.attached(model)
    saved = [lora._n_gated for lora in loras]
    try:
        for lora in loras:
            lora._n_gated = 0
        vocab = model.embed_tokens.num_embeddings
        ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(2, 1, 2, 5, dtype=torch.bool)
        mask[0, ..., 1] = False
        mask[..., 4] = torch.tensor([False, True])
        hole = torch.ones(2, 1, 1, 7, dtype=torch.bool)
        hole[1, ..., 2] = False
        results = []
        runs = _stack_runs[0]
        cache_arg = _output_type()[1]  # the forward's cache argument is named as its output's field
        with torch.no_grad(), active(True):
            for fn in (model.forward, forward):
                cache = DynamicCache()
                kw = {cache_arg: cache}
                model.forward(input_ids=ids[:, :3], position_ids=torch.arange(3)[None].expand(2, 3), **kw)
                a = fn(
                    input_ids=ids[:, 3:5],
                    position_ids=torch.arange(3, 5)[None].expand(2, 2),
                    attention_mask=mask,
                    use_cache=True,
                    **kw,
                )
                c = fn(input_ids=ids[:, 5:6], position_ids=torch.full((2, 1), 5), use_cache=True, **kw)
                e = fn(input_ids=ids[:, 6:7], position_ids=torch.full((2, 1), 6), attention_mask=hole, **kw)
                f = fn(input_ids=ids[:, 7:], position_ids=torch.arange(7, 9)[None].expand(2, 2), use_cache=True, **kw)
                results.append(
                    (a.last_hidden_state, c.last_hidden_state, e.last_hidden_state, f.last_hidden_state, cache)
                )
        *h0, k0 = results[0]
        *h1, k1 = results[1]
        same_cache = all(
            torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values) for x, y in zip(k0.layers, k1.layers)
        )
        return _stack_runs[0] - runs == 4 and same_cache and all(torch.equal(x, y) for x, y in zip(h0, h1))
    except Exception:  # noqa: BLE001 - another forward signature or output: keep the model's own forward
        return False
    finally:
        for lora, n in zip(loras, saved):
            lora._n_gated = n
