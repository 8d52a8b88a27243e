"""The fused forwards through which an attached model's layers run inside :func:`active` (see the package doc).

Each forward falls back to the module's own (``stock``) wherever its conditions do not hold: outside
:func:`active`, with gradients, other dtypes or devices, more than :data:`MAX_ROWS` rows, hooks it cannot honour.
"""

from __future__ import annotations

import contextlib
import operator

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from dlm.decode.cpu import packing
from dlm.model import lora as _lora

# rows (tokens x batch) per call up to which the kernels are used; above, BLAS's compute-bound GEMM is faster
# (bench/gemm_rows.py: at or under BLAS up to 96 rows on both AVX2 and AVX-512). 96 = 32 requests x an N=2 verify
# chunk of 3 tokens, so a served batch of 32 stays on one kernel.
MAX_ROWS = 96
ATTEND_MAX_QUERIES = 16  # decode chunks (1 .. 2N-1 tokens, candidate trees up to ~12); prefill stays with SDPA

_OPS = [None]  # torch.ops.dlm_cpu once attached
_active = [0]
_MISSING = object()


@contextlib.contextmanager
def active(on: bool = True):
    """Route attached layers through the kernels for the forwards inside this block."""
    if not on:
        yield
        return
    _active[0] += 1
    try:
        yield
    finally:
        _active[0] -= 1


def fresh(module: nn.Module) -> None:
    packing.fresh(module, _OPS[0])


def _patch(module: nn.Module, forward) -> None:
    """Route ``module``'s calls through ``forward`` (marked, with what it replaces, for :func:`unpatch`)."""
    forward._dlm = True
    forward._dlm_prev = module.__dict__.get("forward", _MISSING)
    module.forward = forward


def patched(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "_dlm", False)


def unpatch(module: nn.Module) -> None:
    """Give ``module`` back the forward it had before :func:`_patch`."""
    fn = module.__dict__.get("forward")
    if getattr(fn, "_dlm", False):
        prev = fn._dlm_prev
        del module.forward
        if prev is not _MISSING:
            module.forward = prev


def _attach_mlps(model: nn.Module, mod) -> None:
    """Gated SiLU MLPs (Llama, Qwen, Mistral): gate and up projections in one kernel pass with the SiLU product."""
    for m in model.modules():
        gate, up = getattr(m, "gate_proj", None), getattr(m, "up_proj", None)
        if (
            not type(m).__name__.endswith("MLP")
            or not isinstance(gate, nn.Linear)
            or not isinstance(up, nn.Linear)
            or not isinstance(getattr(m, "down_proj", None), nn.Module)
            or type(getattr(m, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation")
            or gate.bias is not None
            or up.bias is not None
            or gate.weight.shape != up.weight.shape
            or getattr(gate, "_dlm_packed", None) is None
            or getattr(up, "_dlm_packed", None) is None
            or patched(m)
        ):
            continue
        _patch(m, _make_mlp_forward(m, m.forward))


def _make_mlp_forward(module: nn.Module, stock):
    gate, up, down = module.gate_proj, module.up_proj, module.down_proj

    def forward(x):
        if (
            not _active[0]
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or torch.is_grad_enabled()
            or gate._forward_hooks
            or up._forward_hooks
            or gate._forward_pre_hooks
            or up._forward_pre_hooks
            or _gated(gate) is not None
            or _gated(up) is not None
        ):
            return stock(x)
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not 0 < rows <= MAX_ROWS:
            return stock(x)
        fresh(gate), fresh(up)
        if gate._dlm_tail is not None or up._dlm_tail is not None:
            return stock(x)
        h = _OPS[0].gate_up(x.reshape(rows, k).contiguous(), gate._dlm_packed, up._dlm_packed, gate._dlm_out)
        return down(h.view(*x.shape[:-1], gate._dlm_out))

    forward._dlm = True
    return forward


# -- the elementwise ops around the matmuls ------------------------------------------------------------------
# At batch 1 a decode forward is ~1300 small torch ops besides the matmuls, the same for 1 token as for 8. RMSNorm
# (7 ops: pow, mean = sum + div, add, rsqrt, 2 mul) and the rotary embedding (7 per tensor) are most of them; inside
# active() they run as one call each. The norm is checked against the model's own on random input before it is
# used (Gemma's (1 + w) norm keeps its own); the rotary embedding runs only inside a fused decoder layer, which is
# checked as a whole (no modeling module's function is rebound).

_checked: dict = {}  # class -> whether the fused RMSNorm / decoder layer matches its own forward


def _norm_eps(m: nn.Module):
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return eps if isinstance(eps, float) else None


def _attach_norms(model: nn.Module, mod) -> None:
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (
            not type(m).__name__.endswith("RMSNorm")
            or _norm_eps(m) is None
            or not isinstance(w, torch.Tensor)
            or w.dim() != 1
            or w.dtype != torch.float32
            or w.device.type != "cpu"
            or patched(m)
        ):
            continue
        if type(m) not in _checked:
            x = torch.randn(3, w.numel(), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                try:
                    ok = torch.allclose(m(x), mod.rms_norm(x, w.contiguous(), _norm_eps(m)), rtol=1e-5, atol=1e-5)
                except Exception:  # noqa: BLE001 - a norm of another shape or signature: keep its own forward
                    ok = False
            _checked[type(m)] = ok
        if _checked[type(m)]:
            _patch(m, _make_norm_forward(m, m.forward))


def _make_norm_forward(module: nn.Module, stock):
    eps = _norm_eps(module)

    def forward(x):
        w = module.weight
        if (
            not _active[0]
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or torch.is_grad_enabled()
            or w.dtype != torch.float32
            or x.shape[-1] != w.numel()
        ):
            return stock(x)
        return _OPS[0].rms_norm(x.contiguous(), w, eps)

    forward._dlm = True
    return forward


def attend(query, key, value, mask, scale):
    """Attention of a decode chunk through the kernel: ``query [B, H, T, D]``, ``key``/``value [B, Hk, S, D]``,
    ``mask`` a bool ``[B, 1, T, S]`` or None (every key; only for T = 1), ``scale`` (None: 1/sqrt(D)); returns
    ``[B, T, H, D]`` or None where it does not apply (outside :func:`active`, gradients, other dtypes or shapes)."""
    if not _active[0] or _OPS[0] is None or torch.is_grad_enabled():
        return None
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    b, h, t, d = query.shape
    if (
        not 0 < t <= ATTEND_MAX_QUERIES
        or d % 16
        or value.shape[-1] != d
        or h % key.shape[1]
        or key.shape[0] != b
        or any(x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1 for x in (query, key, value))
    ):
        return None
    if mask is None:
        if t != 1:
            return None
    elif (
        mask.dtype != torch.bool
        or mask.dim() != 4
        or mask.shape[1] != 1
        or mask.shape[2] != t
        or mask.shape[3] != key.shape[2]
        or mask.shape[0] not in (1, b)
    ):
        return None
    elif mask.shape[0] != b:
        mask = mask.expand(b, 1, t, key.shape[2])
    return _OPS[0].attend(query, key, value, mask, float(scale if scale is not None else d**-0.5))


# -- whole decoder layers ---------------------------------------------------------------------------------------
# With every op of a Llama-form layer in the extension, what is left of a decode forward's cost besides the
# arithmetic is Python: each layer is ~12 nn.Module calls (hooks checks, kwargs, transformers' decorators) around
# ~10 kernel calls. Inside active() a layer whose pieces are all attached runs as one Python function that calls
# the kernels directly (a linear with a hook on it is still called as a module, so its hook runs; a gated-LoRA
# linear's delta on the mask rows is added after its kernel, see _gated). Checked once per layer class against the layer's own forward (on a deep copy without hooks) before
# it is used; a layer of another form (Qwen3's per-head q/k norms, Gemma's sandwich norms, ...) keeps its own.

_NO_BIAS = torch.empty(0)
_NO_ADAPTERS = (_NO_BIAS,) * 6  # decode_stack: a layer's packed A and B of q, k, v where no adapter acts
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


def _attach_layers(model: nn.Module, mod) -> None:
    for m in model.modules():
        if not type(m).__name__.endswith("DecoderLayer") or patched(m):
            continue
        parts = _layer_parts(m)
        if parts is None:
            continue
        if type(m) not in _checked:
            _checked[type(m)] = _check_layer(m, parts)
        if _checked[type(m)]:
            _patch(m, _make_layer_forward(m, m.forward, parts))


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
            _ungate(sub)
        for sub, orig in zip(twin.modules(), layer.modules()):  # forwards attach() bound to the original modules
            if patched(sub):
                del sub.forward
            if getattr(orig, "_dlm_packed", None) is not None:
                sub._dlm_packed, sub._dlm_tail, sub._dlm_out = orig._dlm_packed, orig._dlm_tail, orig._dlm_out
                sub._dlm_ptr, sub._dlm_version = sub.weight.data_ptr(), sub.weight._version
                sub._dlm_quant = orig._dlm_quant
        _attach_norms(twin, _OPS[0])
        for sub in twin.modules():
            if getattr(sub, "_dlm_packed", None) is not None:
                _patch(sub, _make_forward(sub, sub.forward))
        _attach_mlps(twin, _OPS[0])
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


def _gated(module: nn.Module):
    """A gated-LoRA linear's ``(group, index)`` (dlm.model.lora: its delta on the mask rows is
    ``group.add(index, x, out)``), or None."""
    return module.__dict__.get("_dlm_gated")


def _gates(module: nn.Module) -> bool:
    """Whether a gated-LoRA linear adds a delta in this forward: it has an adapter and the forward has mask rows
    (the count its model's gate took; -1 in sync-free mode, where every row's delta is computed). Without mask
    rows its output is the base layer's, so a layer with adapters on q/k/v (or o_proj / down_proj) takes the two
    kernel calls in an AR step of a gated model: bit for bit the per-op path it takes with mask rows."""
    g = _gated(module)
    return g is not None and g[0].lora._n_gated != 0


def _ungate(module: nn.Module) -> None:
    _lora._ungate(module)


def _global_hooks() -> bool:
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks)


def _layer_mask(mask, b: int, t: int, keys: int):
    if mask is not None and mask.shape[0] != b:
        mask = mask.expand(b, 1, t, mask.shape[-1])
    if mask is not None and (mask.shape[2] != t or mask.shape[3] != keys):
        raise RuntimeError(f"attention mask {tuple(mask.shape)} does not match {t} queries x {keys} keys")
    return mask


def _make_layer_forward(layer: nn.Module, stock, parts):
    attn, mlp, n1, n2, (qp, kp, vp, op) = parts
    hd, layer_idx, scaling = attn.head_dim, attn.layer_idx, attn.scaling
    eps1, eps2 = _norm_eps(n1), _norm_eps(n2)
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    mods = (qp, kp, vp, op, gate, up, down)

    def bare(ms) -> bool:  # no hooks, gated adapters with mask rows in this forward or fp32 tails on these
        return not any(m._forward_hooks or m._forward_pre_hooks or m._dlm_tail is not None or _gates(m) for m in ms)

    def fused_mlp() -> bool:
        # adapters on gate/up (idle or not) keep the MLP's own activation product, as with mask rows, so that a
        # gated model's rows round alike with and without masks in the forward (greedy ISD == its AR)
        return "_dlm_gated" not in gate.__dict__ and "_dlm_gated" not in up.__dict__

    def plain() -> bool:  # the projections bare, no biases on o_proj / down_proj
        return not (_global_hooks() or op.bias is not None or down.bias is not None) and bare(mods) and fused_mlp()

    def plain_out() -> bool:  # gated adapters on q/k/v only (no hooks): the layer's second half in one call
        return (
            not (_global_hooks() or op.bias is not None or down.bias is not None)
            and not any(m._forward_hooks or m._forward_pre_hooks for m in mods[:3])
            and bare(mods[3:])
            and fused_mlp()
        )

    def lin(module, h, shape):  # h: [rows, in] contiguous
        if module._forward_pre_hooks or module._forward_hooks_with_kwargs or _global_hooks():
            return module(h.view(*shape, h.shape[-1])).reshape(h.shape[0], -1)
        fresh(module)
        out = _OPS[0].linear(h, module._dlm_packed, module._dlm_out, module.bias, module._dlm_tail)
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
            or _global_hooks()
            or qp._forward_hooks_with_kwargs
            or kp._forward_hooks_with_kwargs
            or vp._forward_hooks_with_kwargs
            or qp._dlm_tail is not None
            or kp._dlm_tail is not None
            or vp._dlm_tail is not None
        ):
            return [lin(m, h, shape) for m in (qp, kp, vp)]
        outs = _OPS[0].linears(
            h,
            [qp._dlm_packed, kp._dlm_packed, vp._dlm_packed],
            [qp._dlm_out, kp._dlm_out, vp._dlm_out],
            [m.bias if m.bias is not None else _NO_BIAS for m in (qp, kp, vp)],
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
            not _active[0]
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
        if pe is None or not (_chunk_ok(b, t, mask) and _rotary_ok(b, t, hd, pe[0], pe[1])):
            return stock(*args, **kwargs)
        return body(x, pe[0], pe[1], mask, kwargs.get("cache", kwargs.get("past_key_values")))

    def plan(rows: int):
        """Whether this forward's ``rows`` take the layer's two kernel calls (``layer_in`` / ``layer_in_gated``, then
        ``layer_out``): None (the per-op steps), else ``(deltas,)`` - ``_qkv_deltas``' arguments of
        ``layer_in_gated``, or None where no adapter acts in this layer."""
        for m in mods:
            fresh(m)
        if plain():
            return (None,)
        if not plain_out() or any(m._dlm_tail is not None for m in mods[:3]):
            return None
        deltas = _qkv_deltas(mods[:3], rows)  # gated adapters on q/k/v with mask rows: inside the first call
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
            *(m.bias if m.bias is not None else _NO_BIAS for m in (qp, kp, vp)),
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
        ext = _OPS[0]
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
                [m.bias if m.bias is not None else _NO_BIAS for m in (qp, kp, vp)],
                cos,
                sin,
                b,
                hd,
            )
            q, k, v = ext.layer_in(*args) if deltas is None else ext.layer_in_gated(*args, *deltas)
            if cache is not None:
                k, v = cache.update(k, v, layer_idx)
            mask = _layer_mask(mask, b, t, k.shape[2])
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
        mask = _layer_mask(mask, b, t, k.shape[2])
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
                h, [gate._dlm_packed, up._dlm_packed], [gate._dlm_out, up._dlm_out], [_NO_BIAS] * 2
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


def _chunk_ok(b: int, t: int, mask) -> bool:
    """A decode chunk the fused layer takes: at most MAX_ROWS rows and ATTEND_MAX_QUERIES tokens a row, a bool
    [B | 1, 1, T, S] mask (or none, for one token)."""
    if mask is None:
        ok_mask = t == 1
    else:
        ok_mask = isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4
    return 0 < b * t <= MAX_ROWS and t <= ATTEND_MAX_QUERIES and ok_mask


def _rotary_ok(b: int, t: int, hd: int, cos, sin) -> bool:
    """fp32 rotary tables [B, T, head_dim], the last stride 1."""
    return (
        cos.dim() == 3
        and tuple(cos.shape) == (b, t, hd)
        and cos.dtype == torch.float32
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
    )


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
    if not all(getattr(f, "_dlm_body", None) is not None for f in fwds):
        return None
    if len({f._dlm_hd for f in fwds}) != 1:
        return None
    return emb, layers, norm, rot, fwds


def _attach_stacks(model: nn.Module, mod) -> None:
    for m in list(model.modules()):
        parts = _stack_parts(m)
        if parts is None:
            continue
        forward = _make_stack_forward(m, m.forward, parts)
        key = (type(m), "stack")
        if key not in _checked:
            if not forward._dlm_ready():  # hooks on it now: the check would not see the stack path run
                continue
            _checked[key] = _check_stack(m, forward)
        if _checked[key]:
            _patch(m, forward)


def _output_type():
    from transformers.modeling_outputs import BaseModelOutputWithPast

    fields = getattr(BaseModelOutputWithPast, "__dataclass_fields__", {})
    return BaseModelOutputWithPast, "cache" if "cache" in fields else "past_key_values"


def _make_stack_forward(model: nn.Module, stock, parts):
    emb, layers, norm, rot, fwds = parts
    hd = fwds[0]._dlm_hd
    steps = [(layer, f._dlm_ready, f._dlm_body) for layer, f in zip(layers, fwds)]
    out_type, cache_field = _output_type()
    memo: dict = {}  # _one_call's plans of this stack

    def ready() -> bool:
        if (
            model.training
            or emb._forward_hooks
            or emb._forward_pre_hooks
            or rot._forward_hooks
            or rot._forward_pre_hooks
            or _global_hooks()
            or emb.weight.dtype != torch.float32
            or emb.weight.device.type != "cpu"
        ):
            return False
        for layer, layer_ready, _ in steps:
            if layer._forward_hooks or layer._forward_pre_hooks or not layer_ready():
                return False
        return all(layer.__dict__.get("forward") is f for (layer, _, _), f in zip(steps, fwds))

    def forward(*args, **kwargs):
        if args or not _active[0] or torch.is_grad_enabled() or not _STACK_KWARGS.issuperset(kwargs.keys()):
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
            or not _chunk_ok(ids.shape[0], ids.shape[1], mask)
            or not ready()
        ):
            return stock(*args, **kwargs)
        b, t = ids.shape
        h = emb(ids)
        cos, sin = rot(h, pos)  # (no hooks on either: going back to the stock forward repeats nothing visible)
        if not _rotary_ok(b, t, hd, cos, sin):
            return stock(*args, **kwargs)
        one = _one_call(fwds, h, cos, sin, mask, cache, memo) if ONE_CALL[0] else None
        if one is not None:
            h = one
        else:
            for _, _, body in steps:
                h = body(h, cos, sin, mask, cache)
        _stack_runs[0] += 1
        return out_type(last_hidden_state=norm(h), **{cache_field: cache})

    forward._dlm = True
    forward._dlm_ready = ready
    return forward


# With the engine's growing KV cache, a stack whose every layer takes its two kernel calls runs the whole chunk in
# one call (decode_stack: the layers' calls and cache writes in C++, in the loop's order on its data, so bit for bit
# the loop). The loop's Python between the layers - the checks, the cache update, the kernels' arguments - cost
# 50-75 us a layer in a decode forward (the weights streaming through the caches evict the interpreter's data):
# 1.6 ms of a 10 ms AR step of SmolLM2-135M on 2 cores. ONE_CALL[0] = False keeps the loop (tests compare the two).
ONE_CALL = [True]
_NO_ROWS = torch.empty(0, dtype=torch.long)


def _one_call(fwds, h, cos, sin, mask, cache, memo: dict | None = None):
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
    plan = _StackPlan.get(memo, fwds, rows)
    if plan is None:
        return None
    lora = plan.lora if plan.gated else None
    if lora is not None and not _rows_indexed(lora, rows):
        return None  # (what _qkv_deltas answers: the per-op path)
    ts, slots = plan.ts, plan.kv_slots
    rooms = []
    n0 = None
    for f, hk in zip(fwds, plan.kv_heads):
        layer = layers[f._dlm_layer_idx]
        keys, values = layer.keys, layer.values
        if keys.shape[0] != b or keys.shape[1] != hk or values.dim() != 4:
            return None
        kb, vb, n = layer.room(b, hk, t, keys.shape[-1], values.shape[-1], keys, values)
        if n0 is None:
            n0 = n
        elif n != n0:
            return None
        rooms.append((layer, kb, vb))
    mask = _layer_mask(mask, b, t, n0 + t)
    idx, r, scale = (_NO_ROWS, 1, 1.0) if lora is None else (lora._idx, lora.settings.r, float(lora.scale))
    x2 = h.reshape(rows, d).contiguous()
    try:
        for j, (_, kb, vb) in zip(slots, rooms):
            ts[j], ts[j + 1] = kb, vb
        y = _OPS[0].decode_stack(x2, cos, sin, mask, b, fwds[0]._dlm_hd, n0, ts, plan.fs, plan.ints, idx, r, scale)
    finally:
        for j in slots:  # the plan does not keep the KV buffers alive
            ts[j] = ts[j + 1] = _NO_BIAS
    for layer, kb, vb in rooms:
        layer.extended(kb, vb, n0 + t)
    return y.view(b, t, d)


_next_hook = getattr(getattr(torch.utils, "hooks", None), "RemovableHandle", None)
KEEP_PLANS = [True]  # False: decode_stack's arguments built at every forward (bench/decode.py --rebuilt-plans)


class _StackPlan:
    """``decode_stack``'s arguments for a stack's decode forwards, with (or without) gated adapters acting: built
    by the layers' own checks (:func:`_make_layer_forward`'s ``plan`` and ``stack_args``) and kept while nothing
    those checks read has changed. Each forward compares, in a few C-level passes over flat lists: the hook count
    (``torch.utils.hooks.RemovableHandle.next_id``: every hook registration, on any module or global, takes a new
    id), the gated adapters' attach count (``dlm.model.lora.EPOCH``) and packed form (:data:`ADAPTER_FORM`), and
    each packed weight, norm weight, bias and adapter matrix - the same object in its module (not replaced), its
    in-place version and its data (what :func:`packing.fresh` checks). A hook removed needs nothing (a plan is never
    built while one is there). Not seen: a hook put into a module's hook dict without a handle, a module's class
    changed other than by dlm's gated LoRA; neither dlm nor transformers does that."""

    __slots__ = (
        "gated",
        "lora",
        "hooks",
        "slots",
        "objs",
        "tensors",
        "versions",
        "ptrs",
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
            for m in f._dlm_mods:
                g = m.__dict__.get("_dlm_gated")
                if g is not None:
                    if found is not None and g[0].lora is not found:
                        return False
                    found = g[0].lora
        return found

    @classmethod
    def get(cls, memo, fwds, rows: int):
        """The plan for this forward: the kept one where nothing it depends on changed, else a new one."""
        if memo is None or _next_hook is None or not KEEP_PLANS[0]:
            return cls.build(fwds, rows)
        epoch = (_lora.EPOCH[0], ADAPTER_FORM[0])
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
            and list(map(_version_of, self.tensors)) == self.versions
            and list(map(_ptr_of, self.tensors)) == self.ptrs
        )

    @classmethod
    def build(cls, fwds, rows: int):
        """The plan the layers' checks give now (they repack weights changed since), or None (the per-op path)."""
        hooks = _next_hook.next_id if _next_hook is not None else None
        plans = []
        for f in fwds:
            pl = f._dlm_plan(rows)
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
            tensors_, adapters, floats, widths = f._dlm_stack_args(dl)
            kv_heads.append(widths[1] // f._dlm_hd)
            ts += tensors_
            kv_slots.append(len(ts))
            ts += (_NO_BIAS, _NO_BIAS, *adapters)
            fs += floats
            ints += widths
            for n in f._dlm_norms:
                watch(n, "weight", False)
            for m in f._dlm_mods:
                watch(m, "weight", True)
                watch(m, "bias", False)
                g = m.__dict__.get("_dlm_gated") if dl is not None else None
                if g is not None:
                    adapter = g[0].adapters[g[1]]
                    watch(adapter, "A", True)
                    watch(adapter, "B", True)
        self.ts, self.fs, self.ints, self.kv_slots, self.kv_heads = ts, fs, ints, kv_slots, kv_heads
        self.slots, self.objs, self.tensors = (dicts, names), objs, tensors
        try:
            self.versions = list(map(_version_of, tensors))
        except RuntimeError:  # inference tensors keep no version: nothing to compare, so no plan kept
            self.hooks = None
            self.versions = []
        self.ptrs = list(map(_ptr_of, tensors))
        return self


_is = operator.is_
_getitem = dict.get
_version_of = operator.attrgetter("_version")
_ptr_of = operator.methodcaller("data_ptr")


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


def adapter_delta(adapter: nn.Module, rows: torch.Tensor, out_rows: torch.Tensor, scale: float) -> bool:
    """``out_rows += scale * B(A(rows))`` for a gated-LoRA adapter through the kernel, in one call; False (nothing
    done) outside :func:`active` or for inputs it does not take. At batch 1 these are two tiny matmuls per adapted
    layer, and BLAS spends more on starting its threads than on the arithmetic."""
    if (
        not _active[0]
        or rows.dtype != torch.float32
        or rows.device.type != "cpu"
        or torch.is_grad_enabled()
        or _OPS[0] is None
        or not 0 < rows.shape[0] <= MAX_ROWS
        or out_rows.stride(-1) != 1
    ):
        return False
    packed = _adapter_packed(adapter)
    if packed is None:
        return False
    pa, pb = packed
    _OPS[0].lora_add(out_rows, rows.contiguous(), pa, adapter.A.shape[0], pb, float(scale))
    return True


# How the kernels hold the gated adapters' matrices: "q8_0" (default; DLM_CPU_ADAPTERS, read at attach) rounds each
# to 8-bit blocks where its inputs are a multiple of 32 and it has 4,096 weights or more (packing.q8_rounded), "f32"
# keeps them exact. The adapters act on the mask rows only: their logits propose drafts that the clean rows - the
# base model's, untouched - verify, so the output is the same either way and sampled ISD keeps the model's
# distribution (the drafts' q is what these adapters give). At r = 64 on q and v of SmolLM2 their fp32 bytes cost
# 3-5% of an ISD verify forward (docs/benchmarks.md#adapters-8-bit).
ADAPTER_ENV = "DLM_CPU_ADAPTERS"
ADAPTER_FORMS = ("q8_0", "f32")
ADAPTER_FORM = ["q8_0"]


def _adapter_packed(adapter: nn.Module):
    """A gated-LoRA adapter's A and B packed for the kernels (repacked when either changes or the form does), or
    None where they are not fp32 (the kernels' adapters are)."""
    a, b = adapter._parameters["A"], adapter._parameters["B"]  # (nn.Module.__getattr__ costs more than the rest)
    form = ADAPTER_FORM[0]
    key = (a.data_ptr(), a._version, b.data_ptr(), b._version, form)
    packed = adapter.__dict__.get("_dlm_packed")
    if packed is None or packed[0] != key:
        if a.dtype != torch.float32 or b.dtype != torch.float32:  # (a new dtype is a new tensor: a new key)
            packed = (key, None)
        else:
            with torch.no_grad():
                packed = (key, (_adapter_matrix(a.detach(), form), _adapter_matrix(b.detach(), form)))
        adapter.__dict__["_dlm_packed"] = packed
    return packed[1]


def _adapter_matrix(w: torch.Tensor, form: str) -> torch.Tensor:
    rounded = packing.q8_rounded(w) if form == "q8_0" else None
    return rounded[0] if rounded is not None else _OPS[0].pack(w, False)


def _rows_indexed(lora, rows: int) -> bool:
    """Whether this forward's gate hands the kernels its mask rows as an index over ``rows`` rows: not without mask
    rows, in sync-free mode or for dense deltas (with gradients), with dropout in training mode, or for a gate of
    another shape (the per-op path raises that error)."""
    return not (lora._idx is None or (lora.training and lora.settings.dropout > 0) or lora._gate.numel() != rows)


def _qkv_deltas(projs, rows: int):
    """What ``layer_in_gated`` needs to add the gated adapters' deltas of q / k / v inside the layer's first call:
    ``(mask rows, [A_q, A_k, A_v], [B_q, B_k, B_v], r, scale)`` (an empty tensor where a projection has no
    adapter), or None where the per-op path is the one to take: no adapter with mask rows in this forward,
    sync-free mode (every row's delta, kept by torch.where), dropout in training mode, a gate of another shape
    (the per-op path raises the error), adapters of another dtype or of two GatedLoRA modules."""
    gs = [m.__dict__.get("_dlm_gated") for m in projs]  # (_gated, inlined: once a layer per forward)
    g0 = gs[0] or gs[1] or gs[2]
    lora = g0[0].lora if g0 is not None else None
    if lora is None or not _rows_indexed(lora, rows):
        return None
    a, b = [], []
    for g in gs:
        if g is None:
            a.append(_NO_BIAS), b.append(_NO_BIAS)
            continue
        packed = _adapter_packed(g[0].adapters[g[1]]) if g[0].lora is lora else None
        if packed is None:
            return None
        a.append(packed[0]), b.append(packed[1])
    return lora._idx, a, b, lora.settings.r, float(lora.scale)


def _make_forward(module: nn.Module, stock):
    if getattr(stock, "__self__", None) is module and "forward" not in module.__dict__:
        stock = None  # the class's own forward, looked up at each call (it may gain gated adapters later)

    def forward(x):
        if not _active[0] or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return stock(x) if stock is not None else type(module).forward(module, x)
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not 0 < rows <= MAX_ROWS:
            return stock(x) if stock is not None else type(module).forward(module, x)
        fresh(module)
        x2 = x.reshape(rows, k).contiguous()
        out = _OPS[0].linear(x2, module._dlm_packed, module._dlm_out, module.bias, module._dlm_tail)
        g = module.__dict__.get("_dlm_gated")
        if g is not None:  # a gated-LoRA linear: its delta on the mask rows (what its class's forward adds)
            out = g[0].add(g[1], x2, out)
        return out.view(*x.shape[:-1], module._dlm_out)

    forward._dlm = True
    return forward
