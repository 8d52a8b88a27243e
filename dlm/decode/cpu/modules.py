"""The fused forwards of single modules: linear layers, gated SiLU MLPs, RMSNorm and decode attention."""

from __future__ import annotations

import torch
from torch import nn

from dlm.decode.cpu.packing import Packed
from dlm.decode.cpu.runtime import (
    ATTEND_MAX_QUERIES,
    CHECKED,
    MAX_ROWS,
    STATE,
    KernelForward,
    forward_of,
    gated,
    patch,
    patched,
)
from dlm.model.lora import SLOT


def kernel_rows(x: torch.Tensor, packs) -> int:
    """How many input rows a linear call of ``x [..., K]`` hands the kernels over ``packs`` (its packed weights), or 0
    where the module's own forward (BLAS) takes it: up to MAX_ROWS rows - decode chunks - and, for weights that take
    int8 input rows, any batch of sequences up to MAX_ROWS tokens each. Those kernels' numbers are not BLAS's (the
    inputs' rounding, ~1e-2 relative), so a prompt prefilled beside others must take them as it would alone: which
    arithmetic a sequence gets then depends on its own length only, not on what shares its batch."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if 0 < rows <= MAX_ROWS:
        return rows
    if rows and x.dim() >= 3 and 0 < x.shape[-2] <= MAX_ROWS and all(p.int8_inputs for p in packs):
        return rows
    return 0


class LinearForward(KernelForward):
    """A linear layer's forward through the kernels over its packed weight (:class:`packing.Packed`, held here),
    with a gated-LoRA linear's delta on the mask rows added after the kernel."""

    __slots__ = ("module", "stock", "packed")

    def __init__(self, module: nn.Module, stock, packed: Packed):
        if getattr(stock, "__self__", None) is module and "forward" not in module.__dict__:
            stock = None  # the class's own forward, looked up at each call (it may gain gated adapters later)
        self.module, self.stock, self.packed = module, stock, packed

    def own(self, x):
        return self.stock(x) if self.stock is not None else type(self.module).forward(self.module, x)

    def __call__(self, x):
        if not STATE.depth or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return self.own(x)
        module, p = self.module, self.packed
        rows = kernel_rows(x, (p,))
        if not rows:
            return self.own(x)
        k = x.shape[-1]
        p.fresh(module, STATE.ops)
        x2 = x.reshape(rows, k).contiguous()
        out = STATE.ops.linear(x2, p.packed, p.out, module.bias, p.tail)
        g = module.__dict__.get(SLOT)
        if g is not None:  # a gated-LoRA linear: its delta on the mask rows (what its class's forward adds)
            out = g[0].add(g[1], x2, out)
        return out.view(*x.shape[:-1], p.out)


def packed_of(module: nn.Module) -> Packed | None:
    """The packed weight of a linear layer the kernels run (None where they do not)."""
    fn = forward_of(module)
    return fn.packed if isinstance(fn, LinearForward) else None


def attach_mlps(model: nn.Module, mod) -> None:
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
            or packed_of(gate) is None
            or packed_of(up) is None
            or patched(m)
        ):
            continue
        patch(m, MlpForward(m, m.forward))


class MlpForward(KernelForward):
    """A gated SiLU MLP's forward: gate and up projections and their SiLU product in one kernel call."""

    __slots__ = ("stock", "gate", "up", "down", "packs")

    def __init__(self, module: nn.Module, stock):
        self.stock, self.gate, self.up, self.down = stock, module.gate_proj, module.up_proj, module.down_proj
        self.packs = (packed_of(self.gate), packed_of(self.up))

    def __call__(self, x):
        gate, up, stock = self.gate, self.up, self.stock
        if (
            not STATE.depth
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or torch.is_grad_enabled()
            or gate._forward_hooks
            or up._forward_hooks
            or gate._forward_pre_hooks
            or up._forward_pre_hooks
            or gated(gate) is not None
            or gated(up) is not None
        ):
            return stock(x)
        pg, pu = self.packs
        rows = kernel_rows(x, self.packs)
        if not rows:
            return stock(x)
        k = x.shape[-1]
        pg.fresh(gate, STATE.ops), pu.fresh(up, STATE.ops)
        if pg.tail is not None or pu.tail is not None:
            return stock(x)
        h = STATE.ops.gate_up(x.reshape(rows, k).contiguous(), pg.packed, pu.packed, pg.out)
        return self.down(h.view(*x.shape[:-1], pg.out))


# -- the elementwise ops around the matmuls ------------------------------------------------------------------
# At batch 1 a decode forward is ~1300 small torch ops besides the matmuls, the same for 1 token as for 8. RMSNorm
# (7 ops: pow, mean = sum + div, add, rsqrt, 2 mul) and the rotary embedding (7 per tensor) are most of them; inside
# active() they run as one call each. The norm is checked against the model's own on random input before it is
# used (Gemma's (1 + w) norm keeps its own); the rotary embedding runs only inside a fused decoder layer, which is
# checked as a whole (no modeling module's function is rebound).


def norm_eps(m: nn.Module):
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return eps if isinstance(eps, float) else None


def attach_norms(model: nn.Module, mod) -> None:
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (
            not type(m).__name__.endswith("RMSNorm")
            or norm_eps(m) is None
            or not isinstance(w, torch.Tensor)
            or w.dim() != 1
            or w.dtype != torch.float32
            or w.device.type != "cpu"
            or patched(m)
        ):
            continue
        if type(m) not in CHECKED:
            x = torch.randn(3, w.numel(), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                try:
                    ok = torch.allclose(m(x), mod.rms_norm(x, w.contiguous(), norm_eps(m)), rtol=1e-5, atol=1e-5)
                except Exception:  # noqa: BLE001 - a norm of another shape or signature: keep its own forward
                    ok = False
            CHECKED[type(m)] = ok
        if CHECKED[type(m)]:
            patch(m, NormForward(m, m.forward))


class NormForward(KernelForward):
    """An RMSNorm's forward in one kernel call (checked against the norm's own at attach)."""

    __slots__ = ("module", "stock", "eps")

    def __init__(self, module: nn.Module, stock):
        self.module, self.stock, self.eps = module, stock, norm_eps(module)

    def __call__(self, x):
        w = self.module.weight
        if (
            not STATE.depth
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or torch.is_grad_enabled()
            or w.dtype != torch.float32
            or x.shape[-1] != w.numel()
        ):
            return self.stock(x)
        return STATE.ops.rms_norm(x.contiguous(), w, self.eps)


def attend(query, key, value, mask, scale):
    """Attention of a decode chunk through the kernel: ``query [B, H, T, D]``, ``key``/``value [B, Hk, S, D]``,
    ``mask`` a bool ``[B, 1, T, S]`` or None (every key; only for T = 1), ``scale`` (None: 1/sqrt(D)); returns
    ``[B, T, H, D]`` or None where it does not apply (outside :func:`active`, gradients, other dtypes or shapes)."""
    if not STATE.depth or STATE.ops is None or torch.is_grad_enabled():
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
    return STATE.ops.attend(query, key, value, mask, float(scale if scale is not None else d**-0.5))
