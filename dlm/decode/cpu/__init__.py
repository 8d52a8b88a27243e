"""The decoding engine's CPU kernels: few-row linears over packed (and GGUF-form compressed) weights, fused norms,
rotary, gated MLPs, decode attention and whole Llama-form decoder layers.

Why: at batch 1 a decode forward of a small model on a CPU is bound by streaming the weights from memory (a step
reads every weight once for 2 FLOPs each) and by ~1300 small torch ops of Python overhead; a chunk of M tokens
reads the same weights. torch's BLAS path costs 2-3x the 1-row time for 3-8 rows on these shapes, and streams fp32
even where the model's weights are 4.5-bit GGUF values. The kernels here

- stream each weight once per call from a pre-packed copy (32 output columns x K inputs per block), 4 rows (AVX2)
  or 8 rows (AVX-512) of accumulators in registers per pass, prefetching ahead of the arithmetic;
- stream weights that are exactly GGUF Q4_1 / Q8_0 values in that form (5.3x / 3.6x fewer bytes) and rebuild each
  weight in registers, bit for bit the fp32 value (:mod:`dlm.decode.cpu.packing`); with more rows than one pass
  (a batch of 16), each 32-input block is rebuilt once into an fp32 buffer and applied to every pass;
- run RMSNorm, the rotary embedding, silu(gate) * up and the attention of decode chunks as one call each, a
  whole Llama / Qwen2 / Mistral decoder layer as one Python function, and a base model whose layers are all fused
  as one loop over their bodies (:mod:`~dlm.decode.cpu.modules`, :mod:`~dlm.decode.cpu.layer`,
  :mod:`~dlm.decode.cpu.stack`), each checked against the model's own code before
  it is used.

Exactness: every linear output is one multiply-add chain over the inputs in order, and every attention query is
computed over the keys in order, whatever the other rows are: a row's result is bit for bit the same alone or in
any chunk or batch, so greedy ISD (verify rows sharing a forward with drafts and masks) equals greedy AR exactly.
Against torch's BLAS the results differ by float rounding (~1e-5 relative).

Where: only inside :func:`active` (the engine wraps its forwards in it), without gradients, for fp32 CPU inputs of
at most :data:`MAX_ROWS` rows; everything else (training, the base model's own ``generate``, GPUs) runs the stock
layers. The instruction set is picked at run time (:mod:`dlm.decode.cpu.build`: AVX-512, AVX2 + FMA, generic), and
with ``DLM_CPU_KERNEL=auto`` (the default) the kernels are used only where a micro-benchmark at attach, cached per
machine and model shape, finds them at or under the stock layers' time (:mod:`dlm.decode.cpu.choice`).
``DLM_CPU_KERNEL=1`` uses them without measuring, ``=0`` never; ``DLM_CPU_ISA`` forces an instruction set;
``DLM_CPU_QUANT=0`` keeps every weight fp32-packed; ``DLM_CPU_ADAPTERS=f32`` keeps the gated adapters exact (by
default 8-bit blocks: they only propose drafts); ``DLM_CPU_ACTIVATIONS=int8`` has GGUF Q4_1 / Q8_0 layers take int8
activations (integer dot products, as llama.cpp computes them: faster, not the fp32 result). These are read into
one :class:`KernelOptions` at attach, unless the caller passes one (``attach(model, options)``,
``EngineOptions(kernels=...)``).

Use: ``handle = attach(model)`` packs and patches (truthy where the kernels are in use; ``handle.choice`` says
why); ``handle.detach()`` gives every patched module its own forward back and frees the packed copies (the last
handle of a model does; :func:`detach` does at once).
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from dlm.decode.cpu import choice as _choice
from dlm.decode.cpu import layer as _layer
from dlm.decode.cpu import modules as _modules
from dlm.decode.cpu import packing, runtime
from dlm.decode.cpu import stack as _stack
from dlm.decode.cpu.adapters import AdapterDelta
from dlm.decode.cpu.build import ENV, ISA_ENV, extension, isa, mode, set_isa
from dlm.decode.cpu.modules import attend
from dlm.decode.cpu.packing import QUANT_ENV
from dlm.decode.cpu.runtime import ATTEND_MAX_QUERIES, MAX_ROWS, KernelOptions, active
from dlm.device import cpu_name
from dlm.errors import DLMError
from dlm.model.lora import _linear_shape

__all__ = [
    "ATTEND_MAX_QUERIES",
    "ENV",
    "ISA_ENV",
    "MAX_ROWS",
    "QUANT_ENV",
    "Attached",
    "KernelOptions",
    "active",
    "attach",
    "attend",
    "cpu_name",
    "detach",
    "extension",
    "isa",
    "mode",
    "set_isa",
]

RAM_SHARE = 0.25  # pack only when the packed copy takes at most this share of physical memory
SLOW = 3.0  # 1-row forwards this many times the linears' measured time: the cached choice is measured again
WATCH = 64  # 1-row forwards per look at their median time

log = logging.getLogger(__name__)


@dataclass
class _ModelKernels:
    """An attached model's record: its open handles, the decision and the cached decision's key."""

    refs: int
    choice: _choice.Choice | None
    key: str | None
    options: KernelOptions


# the models attached now (weakly: a model dropped without detach takes its record with it)
_ATTACHED: weakref.WeakKeyDictionary[nn.Module, _ModelKernels] = weakref.WeakKeyDictionary()


class Attached:
    """What :func:`attach` did to a model: truthy where its layers run through the kernels inside
    :func:`active`; :meth:`detach` undoes it (once the model's last handle is detached)."""

    def __init__(
        self,
        model: nn.Module,
        used: bool,
        choice: _choice.Choice | None = None,
        why: str = "",
        key: str | None = None,
        options: KernelOptions | None = None,
    ):
        self.model, self.used, self.choice, self.why = model, used, choice, why
        self.options = options  # what the model's kernel forwards read (shared by its handles); None where unused
        self._open = used
        self._key = key  # the cached decision's key (None: forced, not measured)
        self._seen: list[float] = []

    def observe(self, seconds: float) -> None:
        """A 1-row forward's wall time, from the engine: where the median of :data:`WATCH` of them is over
        :data:`SLOW` times the linears' measured time, the cached decision is dropped (measured again at the next
        start) - the measurement may have been taken at a moment unlike this machine's usual one."""
        if self._key is None or self.choice is None:
            return
        self._seen.append(seconds)
        if len(self._seen) < WATCH:
            return
        med, self._seen = sorted(self._seen)[WATCH // 2] * 1e3, []
        predicted = self.choice.predicted_ms(1)
        if predicted > 0 and med > SLOW * predicted:
            _choice.forget(
                self._key,
                f"1-row forwards took {med:.1f} ms (median of {WATCH}), {med / predicted:.1f}x the {predicted:.1f} ms "
                f"its linear layers were measured at",
            )
            self._key = None

    def __bool__(self) -> bool:
        return self.used

    def __repr__(self) -> str:
        return f"Attached({self.choice.summary() if self.choice is not None else self.why or 'off'})"

    def describe(self) -> str:
        """The decision and the path of each layer kind (or why the kernels are off)."""
        if self.choice is None:
            return f"off ({self.why or 'not attached'})"
        paths = self.choice.paths()
        return self.choice.summary() + (f"; {paths}" if paths else "")

    def detach(self) -> None:
        if not self._open:
            return
        self._open = False
        state = _ATTACHED.get(self.model)
        if state is not None and state.refs > 1:
            state.refs -= 1
        else:
            detach(self.model)


def _linear_layers(model: nn.Module):
    return [m for m in model.modules() if _linear_shape(m) is not None]


def _plain_fp32_cpu(w) -> bool:
    """A whole fp32 CPU weight (not a DTensor / FSDP shard / DeepSpeed ZeRO-3 placeholder)."""
    return (
        isinstance(w, torch.Tensor)
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.dim() == 2
        and w.numel() > 0
        and type(w) in (nn.Parameter, torch.Tensor)
        and not hasattr(w, "ds_id")
    )


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def attach(model: nn.Module, options: KernelOptions | None = None) -> Attached:
    """:func:`_attach`, and what it did logged (``dlm generate -v`` shows it). Out of inference mode whatever the
    caller's (an engine built inside ``torch.inference_mode()``): the fused forwards' checks copy layers and read
    weight versions, which inference tensors do not have, so each check failed there and the failure, cached per
    class, kept every model of the process on the per-op path (about twice the decode time of SmolLM2-135M)."""
    with torch.inference_mode(False):
        handle = _attach(model, options)
    log.info("CPU kernels: %s", handle.describe())
    return handle


def _attach(model: nn.Module, options: KernelOptions | None) -> Attached:
    """Pack the fp32 CPU linear layers of ``model`` for the kernels and route their forwards (and the norms,
    MLPs and decoder layers that match) through them inside :func:`active` - where they are faster here (see the
    module doc), with ``options`` (None: :meth:`KernelOptions.from_env`). Idempotent: a model already attached
    gets another handle on the same packing and options."""
    state = _ATTACHED.get(model)
    if state is not None:
        if options is not None and options != state.options:
            raise DLMError(
                f"this model's CPU kernels are attached with {state.options}; another engine or attach on it asks "
                f"for {options}: detach the other handles first, or pass the same KernelOptions"
            )
        state.refs += 1
        return Attached(model, True, state.choice, key=state.key, options=state.options)
    options = options if options is not None else KernelOptions.from_env()
    layers = [m for m in _linear_layers(model) if _plain_fp32_cpu(m.weight)]
    if not layers or options.mode == "off":
        return Attached(model, False, why="off" if layers else "no fp32 CPU linear layers")
    extra = sum(m.weight.numel() for m in layers) * 4
    mem = _physical_memory()
    if options.mode == "auto" and mem and extra > RAM_SHARE * mem:
        return Attached(model, False, why="the packed copy would not fit comfortably in memory")
    ops = extension()
    if ops is None:
        return Attached(model, False, why="the kernels could not be built")
    runtime.STATE.ops = ops
    name_of = {id(m): n for n, m in model.named_modules()}  # (the walk _linear_layers made, with names)
    names = [name_of[id(m)] for m in layers]
    key = None
    if options.mode == "on":
        ch = _choice.Choice(use=True, quant=options.quant, isa=ops.isa(), forced=f"{ENV}=1")
    else:
        key = _choice.cache_key(layers, ops.isa(), options.activations)
        ch = _choice.cached(key)
        if ch is not None and not ch.use and ch.confirmed < _choice.CONFIRM:
            ch = None  # a decision for the stock layers is measured again until a second measurement confirms it
        if ch is not None and not ch.use:
            return Attached(model, False, ch)
    quant = options.quant and (ch.quant if ch is not None else True)
    packs = [(m, packing.pack(m, ops, quant, options.activations)) for m in layers]
    if ch is None:
        ch = _choice.choose(packs, ops, key, names)
        if not ch.use:
            return Attached(model, False, ch)
    if ch.fp32_kinds:
        keep_fp32 = set(ch.fp32_kinds)
        for (m, p), label in zip(packs, _choice.labels(packs, names)):
            if label in keep_fp32 and p.packed.dtype != torch.float32:
                p.quant = False
                p.pack(m, ops)
    for m, p in packs:
        if not runtime.patched(m):
            runtime.patch(m, _modules.LinearForward(m, m.forward, p))
    gated = getattr(model, "gated_lora", None)
    if gated is not None and hasattr(gated, "fast_delta"):
        gated.fast_delta = AdapterDelta(options)  # the mask rows' low-rank deltas through the kernels too
    _modules.attach_norms(model, ops)
    _modules.attach_mlps(model, ops)
    _layer.attach_layers(model, options)
    _stack.attach_stacks(model, options)
    _ATTACHED[model] = _ModelKernels(1, ch, key, options)
    return Attached(model, True, ch, key=key, options=options)


def detach(model: nn.Module) -> None:
    """Undo :func:`attach` now, whatever handles are open: every patched module gets its own forward back, the
    packed copies (held by the kernels' forwards) are freed."""
    for m in model.modules():
        runtime.unpatch(m)
    gated = getattr(model, "gated_lora", None)
    if gated is not None and isinstance(getattr(gated, "fast_delta", None), AdapterDelta):
        gated.fast_delta = None
        for adapter in gated.adapters.values():
            adapter.__dict__.pop("_dlm_packed", None)
    _ATTACHED.pop(model, None)
