"""The fused forward of a whole Llama-form decoder layer (see the comment below)."""

from __future__ import annotations

import torch
from torch import nn

from dlm.decode.cpu.adapters import qkv_deltas
from dlm.decode.cpu.modules import attach_mlps, attach_norms, make_linear_forward, norm_eps
from dlm.decode.cpu.runtime import (
    ATTEND_MAX_QUERIES,
    CHECKED,
    MAX_ROWS,
    NO_BIAS,
    STATE,
    active,
    fresh,
    gates,
    global_hooks,
    patch,
    patched,
    ungate,
)

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
    if not all(isinstance(m, nn.Linear) and getattr(m, "_dlm_packed", None) is not None for m in projs):
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


def attach_layers(model: nn.Module, mod) -> None:
    for m in model.modules():
        if not type(m).__name__.endswith("DecoderLayer") or patched(m):
            continue
        parts = _layer_parts(m)
        if parts is None:
            continue
        if type(m) not in CHECKED:
            CHECKED[type(m)] = _check_layer(m, parts)
        if CHECKED[type(m)]:
            patch(m, _make_layer_forward(m, m.forward, parts))


def _check_layer(layer: nn.Module, parts) -> bool:
    """The fast path against the layer's own forward (with the kernels' norms/linears, inside active()) on random
    input: 3 tokens, causal mask, no cache; on a copy without hooks, so that adapters' gates do not interfere."""
    import copy

    attn = parts[0]
    try:
        twin = copy.deepcopy(layer)
        for sub in twin.modules():
            sub._forward_hooks.clear()
            sub._forward_pre_hooks.clear()
            ungate(sub)
        for sub, orig in zip(twin.modules(), layer.modules()):  # forwards attach() bound to the original modules
            if patched(sub):
                del sub.forward
            if getattr(orig, "_dlm_packed", None) is not None:
                sub._dlm_packed, sub._dlm_tail, sub._dlm_out = orig._dlm_packed, orig._dlm_tail, orig._dlm_out
                sub._dlm_ptr, sub._dlm_version = sub.weight.data_ptr(), sub.weight._version
                sub._dlm_quant = orig._dlm_quant
        attach_norms(twin, STATE.ops)
        for sub in twin.modules():
            if getattr(sub, "_dlm_packed", None) is not None:
                patch(sub, make_linear_forward(sub, sub.forward))
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
            got = _make_layer_forward(twin, None, parts_t)(
                x, attention_mask=mask, position_embeddings=pe, position_ids=torch.arange(3)[None]
            )
        return bool(torch.allclose(ref, got, rtol=1e-4, atol=1e-5))
    except Exception:  # noqa: BLE001 - another layer form or signature: keep its own forward
        return False


def layer_mask(mask, b: int, t: int, keys: int):
    if mask is not None and mask.shape[0] != b:
        mask = mask.expand(b, 1, t, mask.shape[-1])
    if mask is not None and (mask.shape[2] != t or mask.shape[3] != keys):
        raise RuntimeError(f"attention mask {tuple(mask.shape)} does not match {t} queries x {keys} keys")
    return mask


def _make_layer_forward(layer: nn.Module, stock, parts):
    attn, mlp, n1, n2, (qp, kp, vp, op) = parts
    hd, layer_idx, scaling = attn.head_dim, attn.layer_idx, attn.scaling
    eps1, eps2 = norm_eps(n1), norm_eps(n2)
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    mods = (qp, kp, vp, op, gate, up, down)

    def bare(ms) -> bool:  # no hooks, gated adapters with mask rows in this forward or fp32 tails on these
        return not any(m._forward_hooks or m._forward_pre_hooks or m._dlm_tail is not None or gates(m) for m in ms)

    def fused_mlp() -> bool:
        # adapters on gate/up (idle or not) keep the MLP's own activation product, as with mask rows, so that a
        # gated model's rows round alike with and without masks in the forward (greedy ISD == its AR)
        return "_dlm_gated" not in gate.__dict__ and "_dlm_gated" not in up.__dict__

    def plain() -> bool:  # the projections bare, no biases on o_proj / down_proj
        return not (global_hooks() or op.bias is not None or down.bias is not None) and bare(mods) and fused_mlp()

    def plain_out() -> bool:  # gated adapters on q/k/v only (no hooks): the layer's second half in one call
        return (
            not (global_hooks() or op.bias is not None or down.bias is not None)
            and not any(m._forward_hooks or m._forward_pre_hooks for m in mods[:3])
            and bare(mods[3:])
            and fused_mlp()
        )

    def lin(module, h, shape):  # h: [rows, in] contiguous
        if module._forward_pre_hooks or module._forward_hooks_with_kwargs or global_hooks():
            return module(h.view(*shape, h.shape[-1])).reshape(h.shape[0], -1)
        fresh(module)
        out = STATE.ops.linear(h, module._dlm_packed, module._dlm_out, module.bias, module._dlm_tail)
        return after(module, h, out, shape)

    def after(module, h, out, shape):  # what the module's forward adds to its base output, then its hooks
        g = module.__dict__.get("_dlm_gated")
        if g is not None:
            out = g[0].add(g[1], h, out)  # the gated adapter's delta on the mask rows (in place when decoding)
        return hooked(module, h, out, shape) if module._forward_hooks else out

    def hooked(module, h, out, shape):  # the module's forward hooks on its output, as a module call runs them
        hooks = tuple(module._forward_hooks.values())
        x3, out3 = h.view(*shape, h.shape[-1]), out.view(*shape, out.shape[-1])
        for hook in hooks:
            res = hook(module, (x3,), out3)
            if res is not None:
                out3 = res
        return out3.reshape(h.shape[0], -1)

    def qkv(h, shape):  # the three projections in one kernel pass, then any adapter hooks on them
        for m in (qp, kp, vp):
            fresh(m)
        if (
            qp._forward_pre_hooks
            or kp._forward_pre_hooks
            or vp._forward_pre_hooks
            or global_hooks()
            or qp._forward_hooks_with_kwargs
            or kp._forward_hooks_with_kwargs
            or vp._forward_hooks_with_kwargs
            or qp._dlm_tail is not None
            or kp._dlm_tail is not None
            or vp._dlm_tail is not None
        ):
            return [lin(m, h, shape) for m in (qp, kp, vp)]
        outs = STATE.ops.linears(
            h,
            [qp._dlm_packed, kp._dlm_packed, vp._dlm_packed],
            [qp._dlm_out, kp._dlm_out, vp._dlm_out],
            [m.bias if m.bias is not None else NO_BIAS for m in (qp, kp, vp)],
        )
        return [after(m, h, o, shape) for m, o in zip((qp, kp, vp), outs)]

    def ready() -> bool:  # no hook on the modules the layer would call as modules (checked at each call)
        return not (
            layer.training
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

    def forward(*args, **kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if (
            not STATE.depth
            or len(args) > 1
            or not isinstance(x, torch.Tensor)
            or x.dim() != 3
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or torch.is_grad_enabled()
            or not ready()
            or not _LAYER_KWARGS.issuperset(kwargs.keys() - {"hidden_states"})
        ):
            return stock(*args, **kwargs)
        b, t, _ = x.shape
        pe, mask = kwargs.get("position_embeddings"), kwargs.get("attention_mask")
        if pe is None or not (chunk_ok(b, t, mask) and rotary_ok(b, t, hd, pe[0], pe[1])):
            return stock(*args, **kwargs)
        return body(x, pe[0], pe[1], mask, kwargs.get("cache", kwargs.get("past_key_values")))

    def plan(rows: int):
        """Whether this forward's ``rows`` take the layer's two kernel calls (``layer_in`` / ``layer_in_gated``, then
        ``layer_out``): None (the per-op steps), else ``(deltas,)`` - ``qkv_deltas``' arguments of
        ``layer_in_gated``, or None where no adapter acts in this layer."""
        for m in mods:
            fresh(m)
        if plain():
            return (None,)
        if not plain_out() or any(m._dlm_tail is not None for m in mods[:3]):
            return None
        deltas = qkv_deltas(mods[:3], rows)  # gated adapters on q/k/v with mask rows: inside the first call
        return None if deltas is None else (deltas,)

    def stack_args(deltas):
        """The layer's arguments of ``decode_stack`` (after :func:`plan`): its tensors but the KV buffers (the
        adapters' packed A and B where ``deltas``), its floats and its ints."""
        adapters = _NO_ADAPTERS if deltas is None else (*deltas[1], *deltas[2])
        tensors = (
            n1.weight,
            qp._dlm_packed,
            kp._dlm_packed,
            vp._dlm_packed,
            *(m.bias if m.bias is not None else NO_BIAS for m in (qp, kp, vp)),
            op._dlm_packed,
            n2.weight,
            gate._dlm_packed,
            up._dlm_packed,
            down._dlm_packed,
        )
        return tensors, adapters, (eps1, eps2, scaling), (qp._dlm_out, kp._dlm_out, vp._dlm_out, gate._dlm_out)

    def body(x, cos, sin, mask, cache):  # the layer on x [b, t, d] once forward's (or the stack's) checks hold
        b, t, d = x.shape
        rows = b * t
        ext = STATE.ops
        shape = (b, t)
        x2 = x.reshape(rows, d).contiguous()

        def layer_out(q, k, v, mask):  # attention, o_proj, norm and MLP in one kernel call
            y = ext.layer_out(
                x2,
                q,
                k,
                v,
                mask,
                scaling,
                op._dlm_packed,
                n2.weight,
                eps2,
                gate._dlm_packed,
                up._dlm_packed,
                gate._dlm_out,
                down._dlm_packed,
            )
            return y.view(b, t, d)

        two = plan(rows)
        if two is not None:
            # the whole layer in two kernel calls around the cache update (bit for bit the steps below)
            deltas = two[0]
            args = (
                x2,
                n1.weight,
                eps1,
                qp._dlm_packed,
                kp._dlm_packed,
                vp._dlm_packed,
                [qp._dlm_out, kp._dlm_out, vp._dlm_out],
                [m.bias if m.bias is not None else NO_BIAS for m in (qp, kp, vp)],
                cos,
                sin,
                b,
                hd,
            )
            q, k, v = ext.layer_in(*args) if deltas is None else ext.layer_in_gated(*args, *deltas)
            if cache is not None:
                k, v = cache.update(k, v, layer_idx)
            mask = layer_mask(mask, b, t, k.shape[2])
            return layer_out(q, k, v, mask)
        second = plain_out()  # adapters on q/k/v only, but not the two calls (fp32 tails): layer_out still
        h = ext.rms_norm(x2, n1.weight, eps1)
        q, k, v = qkv(h, shape)
        q = q.view(b, t, -1, hd).transpose(1, 2)
        k = k.view(b, t, -1, hd).transpose(1, 2)
        v = v.view(b, t, -1, hd).transpose(1, 2)
        q, k = ext.rope(q, cos, sin), ext.rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        mask = layer_mask(mask, b, t, k.shape[2])
        if second:  # adapters on q/k/v only: the rest of the layer in one call (bit for bit the steps below)
            return layer_out(q, k, v, mask)
        o = ext.attend(q, k, v, mask, scaling).view(rows, -1)
        x2 = x2 + lin(op, o, shape)
        h = ext.rms_norm(x2, n2.weight, eps2)
        fresh(gate), fresh(up), fresh(down)
        if gate._dlm_tail is not None or up._dlm_tail is not None:
            return (x2 + mlp(h.view(b, t, d)).reshape(rows, d)).view(b, t, d)
        if "_dlm_gated" in gate.__dict__ or "_dlm_gated" in up.__dict__:
            # adapters on gate/up: both projections in one kernel pass, their deltas on the mask rows, then the
            # MLP's own activation product (the fused gate_up kernel has no place for the deltas)
            g_out, u_out = ext.linears(
                h, [gate._dlm_packed, up._dlm_packed], [gate._dlm_out, up._dlm_out], [NO_BIAS] * 2
            )
            h = mlp.act_fn(after(gate, h, g_out, shape)) * after(up, h, u_out, shape)
        else:
            h = ext.gate_up(h, gate._dlm_packed, up._dlm_packed, gate._dlm_out)
        if not bare((down,)) or down.bias is not None:
            x2 = x2 + lin(down, h, shape)
        else:  # x2 is this function's own tensor: the residual added in place by the kernel
            ext.linear_add_(x2, h, down._dlm_packed)
        return x2.view(b, t, d)

    forward._dlm = True
    forward._dlm_ready, forward._dlm_body, forward._dlm_hd = ready, body, hd
    forward._dlm_plan, forward._dlm_stack_args, forward._dlm_layer_idx = plan, stack_args, layer_idx
    forward._dlm_norms, forward._dlm_mods = (n1, n2), mods
    return forward


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
