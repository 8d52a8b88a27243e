"""What the CPU kernels' forwards share: the loaded operators, the :func:`active` switch, the patching of a
module's forward (and its undoing), the check results per class and the gated-LoRA hooks' tests."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules import module as _nn_module

from dlm.decode.cpu.build import ENV, mode
from dlm.decode.cpu.packing import QUANT_ENV
from dlm.errors import DLMError
from dlm.model import lora as _lora
from dlm.settings import env

# rows (tokens x batch) per call up to which the kernels are used; above, BLAS's compute-bound GEMM is faster
# (bench/gemm_rows.py: at or under BLAS up to 96 rows on both AVX2 and AVX-512). 96 = 32 requests x an N=2 verify
# chunk of 3 tokens, so a served batch of 32 stays on one kernel.
MAX_ROWS = 96
ATTEND_MAX_QUERIES = 16  # decode chunks (1 .. 2N-1 tokens, candidate trees up to ~12); prefill stays with SDPA

ADAPTER_ENV = "DLM_CPU_ADAPTERS"
ADAPTER_FORMS = ("q8_0", "f32")
ACTIVATION_ENV = "DLM_CPU_ACTIVATIONS"
# how GGUF Q4_1 / Q8_0 weights take their input rows: "f32" (each weight rebuilt in fp32: the model's fp32 result,
# bit for bit the fp32 packing's) or "int8" (the rows quantized per 32 inputs and integer dot products, as llama.cpp
# computes these weights: a step's matmuls 1.7x faster on a 2-core Zen 4 and a few more rows nearly free, relative
# error ~1e-2 on each output; every row still computed alone, so ISD's verify rows equal AR steps bit for bit)
ACTIVATION_FORMS = ("f32", "int8")
MODES = ("auto", "on", "off")


@dataclass
class KernelOptions:
    """How :func:`dlm.decode.cpu.attach` uses the kernels on a model, in one object: built from the environment
    (:meth:`from_env`, at attach) or passed (``attach(model, options)``, ``EngineOptions(kernels=...)``). The
    attached model's forwards read this object, so a test or benchmark that compares two paths sets a field on the
    handle's ``options`` (or attaches with other options) - nothing module-wide."""

    # DLM_CPU_KERNEL: "auto" (used where a measurement at attach finds them at or under the stock layers' time),
    # "on" (without measuring) or "off"
    mode: str = "auto"
    # DLM_CPU_QUANT: weights that are exactly GGUF Q4_1 / Q8_0 values streamed in that form (False: fp32 packing)
    quant: bool = True
    # DLM_CPU_ADAPTERS: how the kernels hold the gated adapters' matrices (dlm.decode.cpu.adapters): "q8_0" or "f32"
    adapter_form: str = ADAPTER_FORMS[0]
    # DLM_CPU_ACTIVATIONS: "f32" or "int8" (ACTIVATION_FORMS)
    activations: str = ACTIVATION_FORMS[0]
    # a decode chunk of a stack whose every layer takes its two kernel calls runs as one decode_stack call (False:
    # the loop over the layers' bodies, bit for bit the same)
    one_call: bool = True
    # decode_stack's arguments kept between forwards while nothing they were built from changed (False: built at
    # every forward)
    keep_plans: bool = True

    def __post_init__(self):
        if self.mode not in MODES:
            raise DLMError(f"KernelOptions.mode ({ENV}) is one of {', '.join(MODES)}, got {self.mode!r}")
        if self.adapter_form not in ADAPTER_FORMS:
            raise DLMError(
                f"KernelOptions.adapter_form ({ADAPTER_ENV}) is one of {', '.join(ADAPTER_FORMS)}, got {self.adapter_form!r}"
            )
        if self.activations not in ACTIVATION_FORMS:
            raise DLMError(
                f"KernelOptions.activations ({ACTIVATION_ENV}) is one of {', '.join(ACTIVATION_FORMS)}, "
                f"got {self.activations!r}"
            )

    @classmethod
    def from_env(cls, **fields) -> KernelOptions:
        """The options the environment gives (``DLM_CPU_KERNEL``, ``DLM_CPU_QUANT``, ``DLM_CPU_ADAPTERS``,
        ``DLM_CPU_ACTIVATIONS``), with ``fields`` set on top (``KernelOptions.from_env(one_call=False)``)."""
        form = (env(ADAPTER_ENV) or ADAPTER_FORMS[0]).strip().lower()
        if form not in ADAPTER_FORMS:
            raise DLMError(f"{ADAPTER_ENV}={form!r}: expected one of {', '.join(ADAPTER_FORMS)}")
        acts = (env(ACTIVATION_ENV) or ACTIVATION_FORMS[0]).strip().lower()
        if acts not in ACTIVATION_FORMS:
            raise DLMError(f"{ACTIVATION_ENV}={acts!r}: expected one of {', '.join(ACTIVATION_FORMS)}")
        given = {
            "mode": mode(),
            "quant": (env(QUANT_ENV) or "1").strip() != "0",
            "adapter_form": form,
            "activations": acts,
        }
        return cls(**{**given, **fields})


class KernelState:
    """What the kernels' forwards read at each call: the loaded operators and how deep inside :func:`active` the
    caller is (the forwards take the kernels only there)."""

    __slots__ = ("ops", "depth")

    def __init__(self):
        self.ops = None  # torch.ops.dlm_cpu once attached
        self.depth = 0


STATE = KernelState()


@contextlib.contextmanager
def active(on: bool = True):
    """Route attached layers through the kernels for the forwards inside this block."""
    if not on:
        yield
        return
    STATE.depth += 1
    try:
        yield
    finally:
        STATE.depth -= 1


class KernelForward:
    """A module's forward while the kernels are attached: an object of dlm's own, set as the module's instance
    ``forward`` by :func:`patch`, that takes the kernels inside :func:`active` and the module's own forward
    elsewhere. It holds everything the kernels keep for that module (its packed weight, the modules a fused layer
    calls, a stack's kept plans), so that the module carries nothing of dlm's but this one attribute - the one
    place torch routes a module's calls through per instance - and :func:`unpatch` gives it back as it was.
    ``prev`` is the instance forward it replaced (absent: :data:`MISSING`). A deep copy of a patched module is
    patched alike, on the copy's own modules and packed weights."""

    __slots__ = ("prev",)


MISSING = object()


def patch(module: nn.Module, forward: KernelForward) -> None:
    """Route ``module``'s calls through ``forward`` (with what it replaces, for :func:`unpatch`)."""
    forward.prev = module.__dict__.get("forward", MISSING)
    module.forward = forward


def forward_of(module: nn.Module) -> KernelForward | None:
    """The kernels' forward of ``module`` (None where it has none)."""
    fn = module.__dict__.get("forward")
    return fn if isinstance(fn, KernelForward) else None


def patched(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), KernelForward)


def unpatch(module: nn.Module) -> None:
    """Give ``module`` back the forward it had before :func:`patch`."""
    fn = module.__dict__.get("forward")
    if isinstance(fn, KernelForward):
        del module.forward
        if fn.prev is not MISSING:
            module.forward = fn.prev


CHECKED: dict = {}  # class -> whether a fused forward (norm, decoder layer, stack) matches its own
NO_BIAS = torch.empty(0)  # an absent tensor argument of the kernels


gated = _lora.slot  # a gated-LoRA linear's (group, index), or None


def gates(module: nn.Module) -> bool:
    """Whether a gated-LoRA linear adds a delta in this forward: it has an adapter and the forward has mask rows
    (the count its model's gate took; -1 in sync-free mode, where every row's delta is computed). Without mask
    rows its output is the base layer's, so a layer with adapters on q/k/v (or o_proj / down_proj) takes the two
    kernel calls in an AR step of a gated model: bit for bit the per-op path it takes with mask rows."""
    g = gated(module)
    return g is not None and g[0].lora._n_gated != 0


def ungate(module: nn.Module) -> None:
    _lora._ungate(module)


def global_hooks() -> bool:
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks)
