"""The fused forward of a whole Llama-form decoder layer (see the comment below)."""

from __future__ import annotations

import torch
from torch import nn

from dlm.decode.cpu.adapters import qkv_deltas
from dlm.decode.cpu.modules import LinearForward, attach_mlps, attach_norms, norm_eps, packed_of
from dlm.decode.cpu.runtime import (
    ATTEND_MAX_QUERIES,
    CHECKED,
    MAX_ROWS,
    NO_BIAS,
    STATE,
    KernelForward,
    KernelOptions,
    active,
    forward_of,
    gates,
    global_hooks,
    patch,
    patched,
    ungate,
)
from dlm.model.lora import SLOT

# -- whole decoder layers ---------------------------------------------------------------------------------------
# With every op of a Llama-form layer in the extension, what is left of a decode forward's cost besides the
# arithmetic is Python: each layer is ~12 nn.Module calls (hooks checks, kwargs, transformers' decorators) around
# ~10 kernel calls. Inside active() a layer whose pieces are all attached runs as one Python function that calls
# the kernels directly (a linear with a hook on it is still called as a module, so its hook runs; a gated-LoRA
# linear's delta on the mask rows is added after its kernel, see runtime.gated). Checked once per layer class
# against the layer's own forward (on a deep copy without hooks) before it is used; a layer of another form (Qwen3's per-head q/k norms, Gemma's sandwich norms, ...) keeps its own.

_NO_ADAPTERS = (NO_BIAS,) * 6  # decode_stack: a layer's packed A and B of q, k, v where no adapter acts
_LAYER_KWARGS = frozenset(
    ("attention_mask", "position_ids", "cache", "past_key_values", "use_cache", "position_embeddings", "cache_position")
)


def _layer_parts(layer: nn.Module):
    """The modules a Llama-form decoder layer is made of, or None where it is not one the fast path takes."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    n1, n2 = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
    if (
        attn is None
        or mlp is None
        or n1 is None
        or n2 is None
        or any(hasattr(layer, a) for a in ("pre_feedforward_layernorm", "post_feedforward_layernorm"))
        or any(hasattr(attn, a) for a in ("q_norm", "k_norm", "sinks"))
    ):
        return None
    projs = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(isinstance(m, nn.Linear) and packed_of(m) is not None for m in projs):
        return None
    if not all(patched(m) for m in (n1, n2, mlp)):
        return None  # norms and MLP must be the fused ones (checked against their own code when attached)
    head_dim, groups, layer_idx = (getattr(attn, a, None) for a in ("head_dim", "num_key_value_groups", "layer_idx"))
    if (
        not isinstance(head_dim, int)
        or not isinstance(groups, int)
        or not isinstance(layer_idx, int)
        or head_dim % 16
        or not isinstance(getattr(attn, "scaling", None), float)
    ):
        return None
    impl = getattr(getattr(attn, "config", None), "_attn_implementation", None)
    if impl not in ("sdpa", "dlm_sdpa"):
        return None
    return attn, mlp, n1, n2, projs


def attach_layers(model: nn.Module, options: KernelOptions) -> None:
    for m in model.modules():
        if not type(m).__name__.endswith("DecoderLayer") or patched(m):
            continue
        parts = _layer_parts(m)
        if parts is None:
            continue
        if type(m) not in CHECKED:
            CHECKED[type(m)] = _check_layer(m, parts, options)
        if CHECKED[type(m)]:
            patch(m, LayerForward(m, m.forward, parts, options))


def _check_layer(layer: nn.Module, parts, options: KernelOptions) -> bool:
    """The fast path against the layer's own forward (with the kernels' norms/linears, inside active()) on random
    input: 3 tokens, causal mask, no cache; on a copy without hooks, so that adapters' gates do not interfere."""
    import copy

    attn = parts[0]
    try:
        # a copy without the kernels' forwards (theirs are rebuilt on the copy, the packed weights shared)
        memo = {id(f): None for f in map(forward_of, layer.modules()) if f is not None}
        twin = copy.deepcopy(layer, memo)
        for sub, orig in zip(twin.modules(), layer.modules()):
            if sub.__dict__.get("forward", sub) is None:
                del sub.__dict__["forward"]
            sub._forward_hooks.clear()
            sub._forward_pre_hooks.clear()
            ungate(sub)
            p = packed_of(orig)
            if p is not None:
                patch(sub, LinearForward(sub, sub.forward, p.for_copy(sub)))
        attach_norms(twin, STATE.ops)
        attach_mlps(twin, STATE.ops)
        parts_t = _layer_parts(twin)
        if parts_t is None:
            return False
        d = attn.q_proj.in_features
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 3, d, generator=g)
        hd = attn.head_dim
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.arange(3, dtype=torch.float32)[:, None] * inv[None]
        emb = torch.cat([ang, ang], -1)[None]
        pe = (emb.cos(), emb.sin())
        mask = torch.ones(3, 3, dtype=torch.bool).tril_()[None, None]
        with torch.no_grad(), active(True):
            ref = twin.forward(x, attention_mask=mask, position_embeddings=pe, position_ids=torch.arange(3)[None])
            if not isinstance(ref, torch.Tensor):  # an older layer returning a tuple: keep its own
                return False
            got = LayerForward(twin, None, parts_t, options)(
                x, attention_mask=mask, position_embeddings=pe, position_ids=torch.arange(3)[None]
            )
        if options.activations == "int8":
            # a last-bit difference before a projection (SDPA's attention against the kernels') can move one input
            # by a quantization step: held to the output's scale, where a wrong layer form misses by far more
            return bool(torch.allclose(ref, got, rtol=1e-3, atol=1e-4 * float(ref.abs().max())))
        return bool(torch.allclose(ref, got, rtol=1e-4, atol=1e-5))
    except Exception:  # noqa: BLE001 - another layer form or signature: keep its own forward
        return False


def layer_mask(mask, b: int, t: int, keys: int):
    if mask is not None and mask.shape[0] != b:
        mask = mask.expand(b, 1, t, mask.shape[-1])
    if mask is not None and (mask.shape[2] != t or mask.shape[3] != keys):
        raise RuntimeError(f"attention mask {tuple(mask.shape)} does not match {t} queries x {keys} keys")
    return mask


class LayerForward(KernelForward):
    """A Llama-form decoder layer's forward through the kernels (see the comment above): :meth:`body` runs the
    layer on a decode chunk once :meth:`__call__`'s checks (or the stack's) hold; :meth:`plan` and
    :meth:`stack_args` give the stack's ``decode_stack`` call this layer's part. Holds the modules it calls and
    their packed weights (``packs``, in the order of ``mods``: q, k, v, o, gate, up, down)."""

    __slots__ = (
        "layer", "stock", "options", "attn", "mlp", "n1", "n2", "mods", "packs", "hd", "layer_idx", "scaling", "eps1",
        "eps2",
    )  # fmt: skip

    def __init__(self, layer: nn.Module, stock, parts, options: KernelOptions):
        attn, mlp, n1, n2, (qp, kp, vp, op) = parts
        self.options = options
        self.layer, self.stock, self.attn, self.mlp, self.n1, self.n2 = layer, stock, attn, mlp, n1, n2
        self.hd, self.layer_idx, self.scaling = attn.head_dim, attn.layer_idx, attn.scaling
        self.eps1, self.eps2 = norm_eps(n1), norm_eps(n2)
        self.mods = (qp, kp, vp, op, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        self.packs = tuple(packed_of(m) for m in self.mods)

    # -- the checks, at each call ----------------------------------------------------------------------------

    def fresh(self) -> None:
        ops = STATE.ops
        for m, p in zip(self.mods, self.packs):
            p.fresh(m, ops)

    def bare(self, i: int, j: int) -> bool:
        """No hooks, gated adapters with mask rows in this forward or fp32 tails on ``mods[i:j]``."""
        return not any(
            m._forward_hooks or m._forward_pre_hooks or p.tail is not None or gates(m)
            for m, p in zip(self.mods[i:j], self.packs[i:j])
        )

    def fused_mlp(self) -> bool:
        # adapters on gate/up (idle or not) keep the MLP's own activation product, as with mask rows, so that a
        # gated model's rows round alike with and without masks in the forward (greedy ISD == its AR)
        return SLOT not in self.mods[4].__dict__ and SLOT not in self.mods[5].__dict__

    def plain_out(self) -> bool:
        """Hooks and gated adapters (if any) on q/k/v only: the layer's second half in one call."""
        op, down = self.mods[3], self.mods[6]
        return (
            not (global_hooks() or op.bias is not None or down.bias is not None)
            and not any(m._forward_hooks or m._forward_pre_hooks for m in self.mods[:3])
            and self.bare(3, 7)
            and self.fused_mlp()
        )

    def plain(self) -> bool:
        """The projections bare, no biases on o_proj / down_proj: the whole layer in two calls."""
        return self.bare(0, 3) and self.plain_out()

    def ready(self) -> bool:
        """No hook on the modules the layer would call as modules (checked at each call)."""
        attn, mlp, n1, n2, gate, up = self.attn, self.mlp, self.n1, self.n2, self.mods[4], self.mods[5]
        return not (
            self.layer.training
            or attn._forward_hooks
            or attn._forward_pre_hooks
            or mlp._forward_hooks
            or mlp._forward_pre_hooks
            or n1._forward_hooks
            or n2._forward_hooks
            or n1._forward_pre_hooks
            or n2._forward_pre_hooks
            or gate._forward_hooks
            or up._forward_hooks
            or gate._forward_pre_hooks
            or up._forward_pre_hooks
        )

    def __call__(self, *args, **kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if (
            not STATE.depth
            or len(args) > 1
            or not isinstance(x, torch.Tensor)
            or x.dim() != 3
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or torch.is_grad_enabled()
            or not self.ready()
            or not _LAYER_KWARGS.issuperset(kwargs.keys() - {"hidden_states"})
        ):
            return self.stock(*args, **kwargs)
        b, t, _ = x.shape
        pe, mask = kwargs.get("position_embeddings"), kwargs.get("attention_mask")
        if pe is None or not (chunk_ok(b, t, mask) and rotary_ok(b, t, self.hd, pe[0], pe[1])):
            return self.stock(*args, **kwargs)
        return self.body(x, pe[0], pe[1], mask, kwargs.get("cache", kwargs.get("past_key_values")))

    # -- the stack's part ------------------------------------------------------------------------------------

    def plan(self, rows: int):
        """Whether this forward's ``rows`` take the layer's two kernel calls (``layer_in`` / ``layer_in_gated``, then
        ``layer_out``): None (the per-op steps), else ``(deltas,)`` - ``qkv_deltas``' arguments of
        ``layer_in_gated``, or None where no adapter acts in this layer."""
        self.fresh()
        if self.plain():
            return (None,)
        if not self.plain_out() or any(p.tail is not None for p in self.packs[:3]):
            return None
        # gated adapters on q/k/v with mask rows: inside the first call
        deltas = qkv_deltas(self.mods[:3], rows, self.options.adapter_form)
        return None if deltas is None else (deltas,)

    def stack_args(self, deltas):
        """The layer's arguments of ``decode_stack`` (after :meth:`plan`): its tensors but the KV buffers (the
        adapters' packed A and B where ``deltas``), its floats and its ints."""
        adapters = _NO_ADAPTERS if deltas is None else (*deltas[1], *deltas[2])
        pq, pk, pv, po, pg, pu, pd = self.packs
        tensors = (
            self.n1.weight,
            pq.packed,
            pk.packed,
            pv.packed,
            *(m.bias if m.bias is not None else NO_BIAS for m in self.mods[:3]),
            po.packed,
            self.n2.weight,
            pg.packed,
            pu.packed,
            pd.packed,
        )
        return tensors, adapters, (self.eps1, self.eps2, self.scaling), (pq.out, pk.out, pv.out, pg.out)

    # -- the layer on a chunk --------------------------------------------------------------------------------

    def body(self, x, cos, sin, mask, cache):
        """The layer on ``x [b, t, d]`` once :meth:`__call__`'s (or the stack's) checks hold: two kernel calls
        around the cache update where :meth:`plan` allows, else the per-op steps (bit for bit the same)."""
        b, t, d = x.shape
        rows = b * t
        x2 = x.reshape(rows, d).contiguous()
        two = self.plan(rows)
        if two is None:
            return self.steps(x2, cos, sin, mask, cache, (b, t))
        deltas = two[0]
        pq, pk, pv = self.packs[:3]
        args = (
            x2,
            self.n1.weight,
            self.eps1,
            pq.packed,
            pk.packed,
            pv.packed,
            [pq.out, pk.out, pv.out],
            [m.bias if m.bias is not None else NO_BIAS for m in self.mods[:3]],
            cos,
            sin,
            b,
            self.hd,
        )
        ext = STATE.ops
        q, k, v = ext.layer_in(*args) if deltas is None else ext.layer_in_gated(*args, *deltas)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        return self.layer_out(x2, q, k, v, layer_mask(mask, b, t, k.shape[2]), (b, t))

    def layer_out(self, x2, q, k, v, mask, shape):
        """Attention, o_proj, norm and MLP in one kernel call."""
        po, pg, pu, pd = self.packs[3:]
        y = STATE.ops.layer_out(
            x2, q, k, v, mask, self.scaling, po.packed, self.n2.weight, self.eps2, pg.packed, pu.packed, pg.out,
            pd.packed,
        )  # fmt: skip
        return y.view(*shape, x2.shape[1])

    def steps(self, x2, cos, sin, mask, cache, shape):
        """The layer op by op: the projections' hooks and gated adapters run as the modules' own forwards would."""
        ext, hd = STATE.ops, self.hd
        (b, t), rows = shape, x2.shape[0]
        second = self.plain_out()  # adapters on q/k/v only, but not the two calls (fp32 tails): layer_out still
        h = ext.rms_norm(x2, self.n1.weight, self.eps1)
        q, k, v = self.qkv(h, shape)
        q = q.view(b, t, -1, hd).transpose(1, 2)
        k = k.view(b, t, -1, hd).transpose(1, 2)
        v = v.view(b, t, -1, hd).transpose(1, 2)
        q, k = ext.rope(q, cos, sin), ext.rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        mask = layer_mask(mask, b, t, k.shape[2])
        if second:  # adapters on q/k/v only: the rest of the layer in one call (bit for bit the steps below)
            return self.layer_out(x2, q, k, v, mask, shape)
        o = ext.attend(q, k, v, mask, self.scaling).view(rows, -1)
        x2 = x2 + self.lin(3, o, shape)
        h = ext.rms_norm(x2, self.n2.weight, self.eps2)
        return self.mlp_steps(x2, h, shape)

    def mlp_steps(self, x2, h, shape):
        """The MLP and its residual on the normed ``h`` (``x2`` the residual stream, this forward's own tensor)."""
        ext = STATE.ops
        (b, t), rows, d = shape, x2.shape[0], x2.shape[1]
        gate, up, down = self.mods[4:]
        pg, pu, pd = self.packs[4:]
        self.fresh()
        if pg.tail is not None or pu.tail is not None:
            return (x2 + self.mlp(h.view(b, t, d)).reshape(rows, d)).view(b, t, d)
        if not self.fused_mlp():
            # adapters on gate/up: both projections in one kernel pass, their deltas on the mask rows, then the
            # MLP's own activation product (the fused gate_up kernel has no place for the deltas)
            g_out, u_out = ext.linears(h, [pg.packed, pu.packed], [pg.out, pu.out], [NO_BIAS] * 2)
            h = self.mlp.act_fn(self.after(gate, h, g_out, shape)) * self.after(up, h, u_out, shape)
        else:
            h = ext.gate_up(h, pg.packed, pu.packed, pg.out)
        if not self.bare(6, 7) or down.bias is not None:
            x2 = x2 + self.lin(6, h, shape)
        else:  # x2 is this forward's own tensor: the residual added in place by the kernel
            ext.linear_add_(x2, h, pd.packed)
        return x2.view(b, t, d)

    def lin(self, i: int, h, shape):
        """``mods[i]`` on ``h [rows, in]`` (contiguous): as a module call where pre-hooks ask for one."""
        module, p = self.mods[i], self.packs[i]
        if module._forward_pre_hooks or module._forward_hooks_with_kwargs or global_hooks():
            return module(h.view(*shape, h.shape[-1])).reshape(h.shape[0], -1)
        p.fresh(module, STATE.ops)
        out = STATE.ops.linear(h, p.packed, p.out, module.bias, p.tail)
        return self.after(module, h, out, shape)

    @staticmethod
    def after(module, h, out, shape):
        """What ``module``'s forward adds to its base output (a gated adapter's delta on the mask rows, in place
        when decoding), then its forward hooks, as a module call runs them."""
        g = module.__dict__.get(SLOT)
        if g is not None:
            out = g[0].add(g[1], h, out)
        if not module._forward_hooks:
            return out
        x3, out3 = h.view(*shape, h.shape[-1]), out.view(*shape, out.shape[-1])
        for hook in tuple(module._forward_hooks.values()):
            res = hook(module, (x3,), out3)
            if res is not None:
                out3 = res
        return out3.reshape(h.shape[0], -1)

    def qkv(self, h, shape):
        """The three projections in one kernel pass, then any adapter hooks on them."""
        qkv_mods, packs = self.mods[:3], self.packs[:3]
        for m, p in zip(qkv_mods, packs):
            p.fresh(m, STATE.ops)
        if global_hooks() or any(
            m._forward_pre_hooks or m._forward_hooks_with_kwargs or p.tail is not None for m, p in zip(qkv_mods, packs)
        ):
            return [self.lin(i, h, shape) for i in range(3)]
        outs = STATE.ops.linears(
            h,
            [p.packed for p in packs],
            [p.out for p in packs],
            [m.bias if m.bias is not None else NO_BIAS for m in qkv_mods],
        )
        return [self.after(m, h, o, shape) for m, o in zip(qkv_mods, outs)]


def chunk_ok(b: int, t: int, mask) -> bool:
    """A decode chunk the fused layer takes: at most MAX_ROWS rows and ATTEND_MAX_QUERIES tokens a row, a bool
    [B | 1, 1, T, S] mask (or none, for one token)."""
    if mask is None:
        ok_mask = t == 1
    else:
        ok_mask = isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
    return 0 < b * t <= MAX_ROWS and t <= ATTEND_MAX_QUERIES and ok_mask


def rotary_ok(b: int, t: int, hd: int, cos, sin) -> bool:
    """fp32 rotary tables [B, T, head_dim], the last stride 1."""
    return (
        cos.dim() == 3
        and tuple(cos.shape) == (b, t, hd)
        and cos.dtype == torch.float32
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
    )
