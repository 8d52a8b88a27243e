"""Packing a linear layer's weight for the CPU decode kernels (the layouts: ``dlm/csrc/cpu/layout.h``).

fp32 weights are packed 32 output columns at a time, K contiguous. A model loaded from a GGUF file (the embedded
SmolLM2: Q4_1 projections, a Q8_0 embedding / lm_head) holds fp32 weights that are, block by block, ``d * q + m``
(Q4_1) or ``d * q`` (Q8_0) with fp16 scales. At batch 1 a decode step streams every weight once, so such a layer is
packed in that form (4.5 or 9 bits per weight plus fp32 scales instead of 32) and the kernel rebuilds each weight
in registers: exactly the fp32 value the model holds (every block is checked before it is packed this way), so the
outputs are bit for bit those of the fp32 packing. ``DLM_CPU_QUANT=0`` turns this off (``attach`` reads it).
"""

from __future__ import annotations

import torch
from torch import nn

QUANT_ENV = "DLM_CPU_QUANT"
_Q_MIN_WEIGHTS = 4096  # smaller matrices stay fp32 (nothing to gain, and the check would cost more than it saves)


def _fit_blocks(b: torch.Tensor, levels: int):
    """Blocks ``b [..., 32]`` as ``d * q + m`` (``levels`` 16: q in 0..15, Q4_1) or ``d * q`` (256: q int8, Q8_0)
    with d an fp16 value, each product and sum rounded in fp32 (what GGUF's dequantization computes). Returns d, q,
    m (None for Q8_0) and which blocks they reproduce bit for bit (``[...]`` bool)."""
    shape = b.shape
    flat = b.reshape(-1, 32)
    if levels == 16:
        m = flat.amin(-1, keepdim=True)
        est = (flat.amax(-1, keepdim=True) - m) / 15
    else:
        m = None
        est = flat.abs().amax(-1, keepdim=True) / 127
    bits = est.to(torch.float16).view(torch.int16)
    d, q = torch.zeros_like(est), torch.zeros_like(flat)
    done = torch.zeros(flat.shape[0], dtype=torch.bool)
    todo = None  # every block; then the indices of those not fitted yet
    for delta in (0, -1, 1, -2, 2):  # the fp16 scale nearest the estimate, or one or two steps off it
        x = flat if todo is None else flat[todo]
        cand = ((bits if todo is None else bits[todo]) + delta).view(torch.float16).float()
        cand = torch.where(torch.isfinite(cand) & (cand > 0), cand, torch.zeros_like(cand))
        safe = torch.where(cand > 0, cand, torch.ones_like(cand))
        if levels == 16:
            mm = m if todo is None else m[todo]
            qv = torch.round((x - mm) / safe).clamp_(0, 15)
            rec = cand * qv + mm  # two rounded ops, as the dequantization's (d * q) + m
        else:
            qv = torch.round(x / safe).clamp_(-128, 127)
            rec = cand * qv
        ok = (rec == x).all(-1)
        if todo is None:
            d, q, done = torch.where(ok[:, None], cand, d), torch.where(ok[:, None], qv, q), ok
        else:
            hit = todo[ok]
            d[hit], q[hit], done[hit] = cand[ok], qv[ok], True
        todo = (~done).nonzero().squeeze(1)
        if todo.numel() == 0:
            break
    return (d.view(*shape[:-1], 1), q.view(shape), None if m is None else m.view(*shape[:-1], 1), done.view(shape[:-1]))


def probe_form(w: torch.Tensor) -> str:
    """``"q4_1"``, ``"q8_0"`` or ``"f32"``: the form of ``w [N, K]``'s first 64 rows (quant_pack checks them all)."""
    n, k = w.shape
    if k % 32 or n * k < _Q_MIN_WEIGHTS:
        return "f32"
    for levels, name in ((16, "q4_1"), (256, "q8_0")):
        if bool(_fit_blocks(w[:64].reshape(-1, k // 32, 32), levels)[3].all()):
            return name
    return "f32"


def quant_pack(w: torch.Tensor, ops, activations: str = "f32"):
    """``w [N, K]`` packed in the Q4_1 (uint8) or Q8_0 (int8) layout where its blocks fit, as (packed, tail): tail
    the fp32 packing of the last rows when only they do not fit (tokens added to a GGUF model's vocabulary, e.g. the
    mask token), else None; or None where the weight is in neither form. ``activations="int8"``: Q4_1 weights
    whose scales and minima are fp16 values (as GGUF stores them) and Q8_0 weights without a -128 take the
    int8-activation layouts (layout.h, kinds Q4_1_I8 and Q8_0_I8: integer dot products, not the fp32 result)."""
    n, k = w.shape
    if k % 32 or n * k < _Q_MIN_WEIGHTS:
        return None
    w = w.contiguous()
    for levels in (16, 256):
        if not bool(_fit_blocks(w[:64].reshape(-1, k // 32, 32), levels)[3].all()):  # a few rows first
            continue
        d, q, m, done = _fit_blocks(w.reshape(n, k // 32, 32), levels)
        bad = (~done.all(-1)).nonzero()
        n_fit = n if bad.numel() == 0 else int(bad[0]) // 32 * 32  # rows before the first misfit's block
        if n_fit < n / 2:
            continue
        tail = ops.pack(w[n_fit:], False) if n_fit < n else None
        d, q, m = d[:n_fit], q[:n_fit], (m[:n_fit] if m is not None else None)
        if levels == 16 and activations == "int8" and _halves(d) and _halves(m):
            return _q4_i8_layout(d, q, m), tail
        if levels == 16:
            dd = _columns(d)[..., 0].contiguous().view(torch.uint8)  # [nb, kb, 128]: 32 fp32 scales
            mm = _columns(m)[..., 0].contiguous().view(torch.uint8)
            qq = _columns(q).to(torch.uint8).transpose(2, 3)  # [nb, kb, 32 inputs, 32 columns]
            nib = (qq[..., :16] | (qq[..., 16:] << 4)).reshape(*qq.shape[:2], 512)
            return torch.cat([dd, mm, nib], dim=-1).contiguous(), tail
        if activations == "int8" and bool((q > -128).all()):
            return _q8_i8_layout(d, q), tail
        return _q8_layout(d, q), tail
    return None


def _columns(t: torch.Tensor) -> torch.Tensor:
    """``[n, kb, c]`` -> ``[nb, kb, 32 columns, c]``: the outputs in blocks of 32, zero padded (a padded column's
    weights rebuild to 0)."""
    n, kb, c = t.shape
    if n % 32:
        t = torch.cat([t, t.new_zeros(-n % 32, kb, c)])
    return t.reshape(-1, 32, kb, c).permute(0, 2, 1, 3)


def form_name(packed: torch.Tensor) -> str:
    """How a packed weight is held, as reports name it: ``fp32``, ``Q4_1``, ``Q8_0``, or ``Q4_1 int8`` / ``Q8_0
    int8`` (the int8-activation layouts, told apart by their block size)."""
    if packed.dtype == torch.float32:
        return "fp32"
    if packed.dtype == torch.int8:
        return "Q8_0"
    return {640: "Q4_1 int8", 1152: "Q8_0 int8"}.get(packed.shape[-1], "Q4_1")


def _halves(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is an fp16 value (stored as one without loss)."""
    return bool((t.half().float() == t).all())


def _q4_i8_layout(d: torch.Tensor, q: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The int8-activation Q4_1 layout (uint8 [NB, K / 32, 640], layout.h kind Q4_1_I8) of ``d``, ``m`` [n, K / 32,
    1] (fp16 values) and ``q`` [n, K / 32, 32] (0..15): per block 32 fp16 scales, 32 fp16 minima, then per group of 4
    inputs byte 4 * c + i = column c's input (low nibble) and column c + 16's (high nibble)."""
    dd = _columns(d)[..., 0].half().contiguous().view(torch.uint8)  # [nb, kb, 64]
    mm = _columns(m)[..., 0].half().contiguous().view(torch.uint8)
    qq = _columns(q).to(torch.uint8)  # [nb, kb, 32 columns, 32 inputs]
    nib = qq[:, :, :16] | (qq[:, :, 16:] << 4)  # [nb, kb, 16, 32]
    return torch.cat([dd, mm, _by_4_inputs(nib)], dim=-1).contiguous()


def _q8_i8_layout(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The int8-activation Q8_0 layout (uint8 [NB, K / 32, 1152], layout.h kind Q8_0_I8) of ``d`` [n, K / 32, 1]
    and ``q`` [n, K / 32, 32] (-127..127): per block 32 fp32 scales, then per group of 4 inputs byte 4 * c + i =
    column c's input."""
    dd = _columns(d)[..., 0].contiguous().view(torch.uint8)  # [nb, kb, 128]
    qq = _columns(q).to(torch.int8).view(torch.uint8)  # [nb, kb, 32 columns, 32 inputs]
    return torch.cat([dd, _by_4_inputs(qq)], dim=-1).contiguous()


def _by_4_inputs(t: torch.Tensor) -> torch.Tensor:
    """``[nb, kb, c columns, 32 inputs]`` bytes -> ``[nb, kb, 8 * c * 4]``: per group of 4 inputs, byte 4 * j + i =
    column j's input 4 * g + i (a 32-bit lane per column, as an integer dot product of 4 bytes takes them)."""
    nb, kb, c = t.shape[:3]
    return t.reshape(nb, kb, c, 8, 4).permute(0, 1, 3, 2, 4).reshape(nb, kb, 32 * c)


def _q8_layout(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The Q8_0 layout (int8 [NB, K / 32, Q8B]) of scales ``d [n, K / 32, 1]`` and values ``q [n, K / 32, 32]``."""
    dd = _columns(d)[..., 0].contiguous().view(torch.int8)  # [nb, kb, 128]: 32 fp32 scales
    qq = _columns(q).to(torch.int8).transpose(2, 3)  # [nb, kb, 32 inputs, 32 columns]
    return torch.cat([dd, qq.reshape(*qq.shape[:2], 1024)], dim=-1).contiguous()


def q8_rounded(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``w [N, K]`` rounded to Q8_0 blocks - per 32 consecutive inputs of an output, ``d * q`` with d the fp16 value
    nearest max|w| / 127 and q = round(w / d) in -127..127, as GGUF's quantizer - as (its packing, the fp32 weights
    it stands for: what the kernels compute with, bit for bit); None where K is not a multiple of 32 or ``w`` has
    under 4,096 weights (fp32 there: nothing to gain). For the gated adapters (dlm.decode.cpu.adapters): lossy, so only
    where a small error is harmless - the adapters act on the mask rows alone, whose logits propose drafts that the
    clean rows verify exactly."""
    n, k = w.shape
    if k % 32 or n * k < _Q_MIN_WEIGHTS:
        return None
    b = w.detach().float().reshape(n, k // 32, 32)
    d = (b.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    q = torch.round(b / torch.where(d > 0, d, torch.ones_like(d))).clamp_(-127, 127)
    return _q8_layout(d, q), (d * q).reshape(n, k)


class Packed:
    """A linear layer's weight as the kernels read it, held by the layer's kernel forward (nothing is stored on
    the module): ``packed`` (and ``tail``: the fp32 packing of last rows a quantized form does not fit, else
    None), ``out`` its output width, ``quant`` whether a quantized form may be used, ``activations`` how a Q4_1
    form takes its inputs (:func:`quant_pack`), and what the copy was made from (``ptr``: the weight's storage,
    ``version``: its in-place version) so that a replaced or modified weight is packed again (:meth:`fresh`)."""

    __slots__ = ("packed", "tail", "out", "ptr", "version", "quant", "activations")

    def __init__(self, module: nn.Module, ops, quant: bool = True, activations: str = "f32"):
        self.quant, self.activations = quant, activations
        self.pack(module, ops)

    def pack(self, module: nn.Module, ops) -> None:
        """Pack ``module``'s weight (an ``nn.Linear`` or GPT-2's ``Conv1D``): the quantized form where
        :attr:`quant` and its blocks fit, else fp32."""
        w = module.weight
        transposed = not isinstance(module, nn.Linear)
        with torch.no_grad():
            wt = w.detach().t() if transposed else w.detach()
            packed = quant_pack(wt, ops, self.activations) if self.quant else None
            self.packed, self.tail = packed if packed is not None else (ops.pack(w.detach(), transposed), None)
        self.ptr, self.version = w.data_ptr(), w._version
        self.out = w.shape[1] if transposed else w.shape[0]

    @property
    def int8_inputs(self) -> bool:
        """Whether the packed form multiplies int8-quantized input rows (``Q4_1 int8`` / ``Q8_0 int8``)."""
        return form_name(self.packed).endswith(" int8")

    def fresh(self, module: nn.Module, ops) -> None:
        """Pack ``module`` again if its weight changed in place (training) or was replaced since it was packed."""
        w = module._parameters.get("weight")  # (nn.Module.__getattr__ costs more than the check, 7 times a layer)
        if w is None:
            w = module.weight
        if w._version != self.version or w.data_ptr() != self.ptr:
            self.pack(module, ops)

    def for_copy(self, module: nn.Module) -> Packed:
        """This packing for ``module``, a copy of the packed module (same weights, other storage): the packed
        tensors shared, the origin that of the copy's weight."""
        twin = object.__new__(Packed)
        twin.packed, twin.tail, twin.out, twin.quant = self.packed, self.tail, self.out, self.quant
        twin.activations = self.activations
        twin.ptr, twin.version = module.weight.data_ptr(), module.weight._version
        return twin


def pack(module: nn.Module, ops, quant: bool = True, activations: str = "f32") -> Packed:
    """``module``'s weight packed for the kernels (:class:`Packed`)."""
    return Packed(module, ops, quant, activations)
