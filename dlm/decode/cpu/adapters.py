"""The gated-LoRA adapters through the kernels: their matrices packed (8-bit blocks by default), a delta in one call,
and the arguments that add q / k / v's deltas inside a fused layer's first call."""

from __future__ import annotations

import torch
from torch import nn

from dlm.decode.cpu import packing
from dlm.decode.cpu.runtime import MAX_ROWS, NO_BIAS, STATE, KernelOptions
from dlm.model.lora import SLOT

# How the kernels hold the gated adapters' matrices (KernelOptions.adapter_form): "q8_0" (default; DLM_CPU_ADAPTERS) rounds each
# to 8-bit blocks where its inputs are a multiple of 32 and it has 4,096 weights or more (packing.q8_rounded), "f32"
# keeps them exact. The adapters act on the mask rows only: their logits propose drafts that the clean rows - the
# base model's, untouched - verify, so the output is the same either way and sampled ISD keeps the model's
# distribution (the drafts' q is what these adapters give). At r = 64 on q and v of SmolLM2 their fp32 bytes cost
# 3-5% of an ISD verify forward (docs/benchmarks.md#adapters-8-bit).


def _adapter_packed(adapter: nn.Module, form: str):
    """A gated-LoRA adapter's A and B packed for the kernels in ``form`` (repacked when either changes or the form
    does), or None where they are not fp32 (the kernels' adapters are). Kept on the adapter, dlm's own module."""
    a, b = adapter._parameters["A"], adapter._parameters["B"]  # (nn.Module.__getattr__ costs more than the rest)
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
    return rounded[0] if rounded is not None else STATE.ops.pack(w, False)


def rows_indexed(lora, rows: int) -> bool:
    """Whether this forward's gate hands the kernels its mask rows as an index over ``rows`` rows: not without mask
    rows, in sync-free mode or for dense deltas (with gradients), with dropout in training mode, or for a gate of
    another shape (the per-op path raises that error)."""
    return not (lora._idx is None or (lora.training and lora.settings.dropout > 0) or lora._gate.numel() != rows)


def qkv_deltas(projs, rows: int, form: str):
    """What ``layer_in_gated`` needs to add the gated adapters' deltas of q / k / v inside the layer's first call:
    ``(mask rows, [A_q, A_k, A_v], [B_q, B_k, B_v], r, scale)`` (an empty tensor where a projection has no
    adapter), or None where the per-op path is the one to take: no adapter with mask rows in this forward,
    sync-free mode (every row's delta, kept by torch.where), dropout in training mode, a gate of another shape
    (the per-op path raises the error), adapters of another dtype or of two GatedLoRA modules."""
    gs = [m.__dict__.get(SLOT) for m in projs]  # (gated, inlined: once a layer per forward)
    g0 = gs[0] or gs[1] or gs[2]
    lora = g0[0].lora if g0 is not None else None
    if lora is None or not rows_indexed(lora, rows):
        return None
    a, b = [], []
    for g in gs:
        if g is None:
            a.append(NO_BIAS), b.append(NO_BIAS)
            continue
        packed = _adapter_packed(g[0].adapters[g[1]], form) if g[0].lora is lora else None
        if packed is None:
            return None
        a.append(packed[0]), b.append(packed[1])
    return lora._idx, a, b, lora.settings.r, float(lora.scale)


class AdapterDelta:
    """A gated-LoRA module's ``fast_delta`` while the kernels are attached (with the attach's options):
    ``out_rows += scale * B(A(rows))`` for an adapter through the kernel, in one call; False (nothing done) outside
    :func:`active` or for inputs it does not take. At batch 1 these are two tiny matmuls per adapted layer, and BLAS
    spends more on starting its threads than on the arithmetic."""

    __slots__ = ("options",)

    def __init__(self, options: KernelOptions):
        self.options = options

    def __call__(self, adapter: nn.Module, rows: torch.Tensor, out_rows: torch.Tensor, scale: float) -> bool:
        return adapter_delta(adapter, rows, out_rows, scale, self.options.adapter_form)


def adapter_delta(adapter: nn.Module, rows: torch.Tensor, out_rows: torch.Tensor, scale: float, form: str) -> bool:
    """:class:`AdapterDelta`'s work, the adapter's matrices in ``form``."""
    if (
        not STATE.depth
        or rows.dtype != torch.float32
        or rows.device.type != "cpu"
        or torch.is_grad_enabled()
        or STATE.ops is None
        or not 0 < rows.shape[0] <= MAX_ROWS
        or out_rows.stride(-1) != 1
    ):
        return False
    packed = _adapter_packed(adapter, form)
    if packed is None:
        return False
    pa, pb = packed
    STATE.ops.lora_add(out_rows, rows.contiguous(), pa, adapter.A.shape[0], pb, float(scale))
    return True
