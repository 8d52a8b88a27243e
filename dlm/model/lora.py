"""LoRA through peft, and gated (mask-only) LoRA.

This module also owns how a DiffusionLM's weights are written (``save_model_folder``) and how adapters are
restored on load (``load_adapters_if_any``), because adapters decide what goes where.

Gated LoRA (I-DLM "lossless" mode, docs/algorithms.md#idlm): low-rank adapters that act **only at mask positions**
(``input_ids == mask_token_id``). The Hugging Face model keeps its modules and weights; the targeted linears (and the
input embedding) get a same-named subclass whose ``forward`` is the base one plus the gated part - no hook per
module:

- one pre-hook on the HF model computes the gate ``[B, T]`` from the ``input_ids`` of *that* call (so it works in
  one forward and in KV-cache extends) and, once, what every adapter needs (how many masks, their rows);
- the adapted linears that read one input (q/k/v; gate/up) form a group: the first to run gathers that input's
  mask rows once and multiplies them by the group's stacked A ``[G * r, in]`` in one matmul, and each adds
  ``scale * u_i @ B_i.T`` to its own output's mask rows only (``addmm_`` on those rows in place when decoding,
  ``index_add`` / ``torch.where`` with gradients; every other row is bit-for-bit the base layer's output);
- the input embedding replaces the embedding of mask positions with a separate trainable vector
  (``GatedLoRA.mask_embedding``), so AdamW (weight decay included) can never touch another embedding row.

The adapters live in ``dlm.gated_lora`` (outside the HF model), so ``dlm.model.state_dict()`` is exactly the
frozen base model: ``save_pretrained`` writes it unchanged (plain transformers opens it as the AR model) and
puts the adapters + mask embedding in ``dlm_adapter.safetensors`` and their settings in ``config.json``
(``dlm_gated_lora``).
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from dlm.errors import DLMError

ADAPTER_FILE = "dlm_adapter.safetensors"
CONFIG_KEY = "dlm_gated_lora"


@dataclass
class LoraSettings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: "all-linear")  # or "q_proj,v_proj" / a list
    gated: bool = False  # adapters act only at mask positions (I-DLM "lossless" mode)

    def __post_init__(self):
        if not isinstance(self.r, int) or self.r < 1:
            raise DLMError(f"LoRA r must be a positive integer, got {self.r!r} (--lora-r / lora.r)")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise DLMError(f"LoRA dropout must be in [0, 1), got {self.dropout!r} (lora.dropout)")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            # the command-line form: comma-separated module names
            self.target_modules = [t.strip() for t in self.target_modules.split(",") if t.strip()]


def _settings(config) -> LoraSettings:
    if isinstance(config, LoraSettings):
        return config
    if isinstance(config, dict):
        valid = set(LoraSettings.__dataclass_fields__)
        unknown = set(config) - valid
        if unknown:
            raise DLMError(f"unknown LoRA setting(s) {sorted(unknown)}: valid ones are {sorted(valid)}")
        return LoraSettings(**config)
    raise DLMError(f"LoRA settings must be a LoraSettings or dict, got {type(config).__name__}")


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of an nn.Linear or a GPT-2 style Conv1D, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        w = module.weight  # [in, out]
        return w.shape[0], w.shape[1]
    return None


def _target_names(model: nn.Module, target_modules) -> list[str]:
    out_emb = model.get_output_embeddings()
    names = []
    for name, module in model.named_modules():
        if _linear_shape(module) is None or module is out_emb:
            continue
        if target_modules == "all-linear":
            names.append(name)
        elif isinstance(target_modules, str):
            if name == target_modules or name.endswith("." + target_modules):
                names.append(name)
        elif any(name == t or name.endswith("." + t) for t in target_modules):
            names.append(name)
    if not names:
        raise DLMError(
            f"LoRA target_modules {target_modules!r} matched no linear layer of "
            f"{type(model).__name__}; use 'all-linear' or names such as q_proj, v_proj"
        )
    return names


class _Adapter(nn.Module):
    def __init__(self, in_f: int, out_f: int, r: int, device, dtype):
        super().__init__()
        self.A = nn.Parameter(torch.empty(r, in_f, device=device, dtype=dtype))
        self.B = nn.Parameter(torch.zeros(out_f, r, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # as peft: A random, B zero -> starts as the base


# Adapted linears of one module that read the same input: the attention's q/k/v read the post-norm hidden state, a
# gated MLP's gate/up theirs. Their adapters share one gather of the mask rows and one matmul by their stacked A.
_SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))

_GATED_CLASSES: dict[tuple[type, bool], type] = {}

# Where a gated module keeps its part (the one place that names them; the CPU kernels read them through these):
# an adapted linear ``module.__dict__[SLOT] = (group, index)``, the input embedding ``[EMB_SLOT] = (lora,)``. They
# sit in the module's own ``__dict__``, as the class swap does, so that a deep copy or a pickle of the model keeps
# its adapters with it (a side table keyed by module would not follow a copy).
SLOT, EMB_SLOT = "_dlm_gated", "_dlm_gated_emb"


def _gated_class(cls: type, embedding: bool = False) -> type:
    """``cls`` (nn.Linear, Conv1D; or the input embedding's class) with the gated delta (the mask vector) added in
    its own ``forward``: a subclass of the same name, so the module's parameters, state-dict keys and type checks
    stay the base's."""
    sub = _GATED_CLASSES.get((cls, embedding))
    if sub is not None:
        return sub
    base_forward = cls.forward
    if embedding:

        def forward(self, *args, **kwargs):
            return self.__dict__[EMB_SLOT][0]._embed(base_forward(self, *args, **kwargs))

    else:

        def forward(self, input):
            group, i = self.__dict__[SLOT]
            return group.add(i, input, base_forward(self, input))

    qualname = f"_Gated{cls.__name__}_{len(_GATED_CLASSES)}"
    sub = type(cls.__name__, (cls,), {"forward": forward, "_dlm_gated_base": cls, "__module__": __name__})
    sub.__qualname__ = qualname
    globals()[qualname] = sub  # so that pickle finds it
    _GATED_CLASSES[cls, embedding] = sub
    return sub


# Bumped whenever gated adapters are attached to modules or taken off them (their classes and slots change).
_EPOCH = [0]


def structure_version() -> int:
    """A number that changes whenever gated adapters are attached to any module or taken off one: what a cache of a
    model's structure compares (dlm.decode.cpu's decode-step plans) instead of walking the modules."""
    return _EPOCH[0]


def slot(module: nn.Module):
    """A gated-LoRA linear's ``(group, index)`` (its delta on the mask rows is ``group.add(index, x, out)``), or
    None."""
    return module.__dict__.get(SLOT)


def _ungate(module: nn.Module) -> None:
    _EPOCH[0] += 1
    base = type(module).__dict__.get("_dlm_gated_base")
    if base is not None:
        module.__class__ = base
    module.__dict__.pop(SLOT, None)
    module.__dict__.pop(EMB_SLOT, None)


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


class _Group:
    """The gated adapters of the linears that read one input (:data:`_SHARED_INPUT`; any other adapter is a group
    of one). The first of them to run in a forward gathers the mask rows of that input once and multiplies them by
    the adapters' stacked A matrices ``[G * r, in]`` in one matmul; each linear then adds ``scale * u_i @ B_i.T``
    (its own columns ``u_i`` of that product) to its output's mask rows - an ``addmm_`` into the rows in place
    when decoding, ``index_add`` / ``torch.where`` with gradients. Every other row of every output is left as the
    base layer computed it."""

    def __init__(self, lora: GatedLoRA, keys: list[str]):
        self.lora = lora
        self.adapters = [lora.adapters[k] for k in keys]
        self.x: torch.Tensor | None = None  # the input whose product u is held
        self.u: torch.Tensor | None = None
        self.left = 0  # adapters of the group still to take their columns of u
        self.tick = -1
        self.stacked: tuple | None = None  # (key, [G * r, in]) for forwards without gradients

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.lora
        x2 = x.reshape(-1, x.shape[-1])
        if lora._dense:
            return x2
        if lora._span is not None:
            lo, hi = lora._span
            return x2[lo:hi]
        return x2.index_select(0, lora._idx)

    def _stacked_a(self) -> torch.Tensor:
        if torch.is_grad_enabled():
            return torch.cat([a.A for a in self.adapters])
        key = tuple((a.A.data_ptr(), _version(a.A), a.A.dtype) for a in self.adapters)
        if self.stacked is None or self.stacked[0] != key:
            with torch.no_grad():
                self.stacked = (key, torch.cat([a.A.detach() for a in self.adapters]))
        return self.stacked[1]

    def _u(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """``rows @ A_i.T`` for adapter ``i``: ``[rows, r]`` over the rows this forward's deltas are computed on."""
        lora = self.lora
        dropout = lora.training and lora.settings.dropout > 0
        if len(self.adapters) == 1 or dropout:  # (dropout: a mask of its own per adapter, as peft)
            a = self.adapters[i]
            rows = self._rows(x)
            if dropout:
                rows = lora.dropout(rows)
            if rows.dtype != a.A.dtype:
                rows = rows.to(a.A.dtype)
            return rows @ a.A.t()
        if self.x is not x or self.tick != lora._tick:
            a = self._stacked_a()
            rows = self._rows(x)
            if rows.dtype != a.dtype:
                rows = rows.to(a.dtype)
            self.u, self.x, self.tick, self.left = rows @ a.t(), x, lora._tick, len(self.adapters)
            lora._pending.append(self)
        u = self.u
        self.left -= 1
        if self.left == 0:  # every adapter of the group has its columns: let go of the input and the product
            self.x = self.u = None
        r = lora.settings.r
        return u[:, i * r : (i + 1) * r]

    def add(self, i: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the base output of the group's linear ``i`` on ``x``) with the adapter's delta on the mask rows
        of this forward; ``x`` and ``out`` may be ``[B, T, .]`` or flattened ``[B * T, .]``."""
        lora = self.lora
        if lora._n_gated == 0:
            return out
        n_out = out.shape[-1]
        gate = lora._gate
        if gate.numel() * n_out != out.numel():
            raise DLMError(
                f"gated LoRA: gate shape {tuple(gate.shape)} does not match activations "
                f"{tuple(out.shape[:-1])}; call the model with input_ids"
            )
        a = self.adapters[i]
        span = lora._span
        if span is not None and out.is_contiguous() and x.dtype == out.dtype == a.A.dtype:
            # decoding, the masks one run of rows: one addmm_ in place on a view of those rows
            lo, hi = span
            target = out.view(-1, n_out)[lo:hi]
            fast = lora.fast_delta
            if fast is None or not fast(a, x.reshape(-1, x.shape[-1])[lo:hi], target, lora.scale):
                target.addmm_(self._u(i, x), a.B.t(), alpha=lora.scale)
            return out
        u = self._u(i, x)
        if lora._dense:
            # Many masks (training): the delta on every row, kept only where gated; torch.where leaves the other
            # rows bit for bit (and is far cheaper than index_add / scatter on CPU).
            d = (u @ a.B.t()) * lora.scale
            if d.dtype != out.dtype:
                d = d.to(out.dtype)
            return torch.where(gate.view(out.shape[:-1])[..., None], out + d.view(out.shape), out)
        d = u @ a.B.t()
        if d.dtype != out.dtype:
            d = d.to(out.dtype)
        flat = out.reshape(-1, n_out)
        if torch.is_grad_enabled():
            flat = flat.index_add(0, lora._idx, d, alpha=lora.scale)
        else:  # decoding: in place, no copy of the layer output
            flat.index_add_(0, lora._idx, d, alpha=lora.scale)
        return flat.view_as(out)


def _groups(module_names: list[str]) -> list[list[str]]:
    """The targeted module names grouped by shared input (siblings of one parent in one :data:`_SHARED_INPUT`
    set), in the order of ``module_names``."""
    out, seen = [], {}
    for name in module_names:
        parent, _, leaf = name.rpartition(".")
        shared = next((s for s in _SHARED_INPUT if leaf in s), None)
        key = (parent, shared) if shared is not None else name
        if key in seen:
            out[seen[key]].append(name)
        else:
            seen[key] = len(out)
            out.append([name])
    return out


class GatedLoRA(nn.Module):
    """Adapters + mask embedding of a gated-LoRA DiffusionLM; attach with :func:`prepare_model_for_lora`."""

    def __init__(
        self, hf_model: nn.Module, mask_token_id: int, settings: LoraSettings, module_names: list[str] | None = None
    ):
        super().__init__()
        self.settings = settings
        self.mask_token_id = int(mask_token_id)
        self.scale = settings.alpha / settings.r
        self.module_names = module_names or _target_names(hf_model, settings.target_modules)
        modules = dict(hf_model.named_modules())
        self.adapters = nn.ModuleDict()
        emb = hf_model.get_input_embeddings()
        for name in self.module_names:
            if name not in modules:
                raise DLMError(f"gated LoRA adapter for '{name}' does not match a module of {type(hf_model).__name__}")
            shape = _linear_shape(modules[name])
            if shape is None:
                raise DLMError(f"gated LoRA adapter for '{name}': not a linear layer ({type(modules[name]).__name__})")
            if SLOT in modules[name].__dict__:
                raise DLMError(f"'{name}' has gated-LoRA adapters already")
            in_f, out_f = shape
            w = modules[name].weight
            self.adapters[name.replace(".", "__")] = _Adapter(in_f, out_f, settings.r, w.device, w.dtype)
        self.mask_embedding = nn.Parameter(emb.weight[self.mask_token_id].detach().clone())
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self._gate: torch.Tensor | None = None  # [B, T] bool, set per HF forward
        self._n_gated, self._dense, self._idx, self._span, self._tick = 0, False, None, None, 0
        self._pending: list[_Group] = []  # groups holding a product of this forward
        # gated share of rows above which the delta is computed densely (cheaper than row gathers on CPU)
        self.dense_fraction = 0.25
        # decoding may install a faster few-row path here: fast_delta(adapter, rows, out_rows, scale) adds
        # scale * B(A(rows)) to out_rows in place and returns True, or returns False (dlm.decode.cpu on CPU)
        self.fast_delta = None
        # sync_free: the gate and every delta without reading anything on the host (no mask count, no row index):
        # each adapter's delta on every row, kept at the masks by torch.where. What a CUDA graph capture needs
        # (the graph replays kernels, not this hook's Python); clean rows stay bit for bit the base's. See sync_free().
        self.sync_free = False
        self._hf = weakref.ref(hf_model)
        # The per-forward gate: one pre-hook on the whole model. The adapters themselves run inside the targeted
        # modules' own forward (their class swapped for a same-named subclass): no hook per module.
        self._handles = [hf_model.register_forward_pre_hook(self._set_gate, with_kwargs=True)]
        emb.__class__ = _gated_class(type(emb), embedding=True)
        emb.__dict__[EMB_SLOT] = (self,)
        for names in _groups(self.module_names):
            group = _Group(self, [n.replace(".", "__") for n in names])
            for i, name in enumerate(names):
                m = modules[name]
                m.__class__ = _gated_class(type(m))
                m.__dict__[SLOT] = (group, i)
        _EPOCH[0] += 1

    def _set_gate(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids")
        if input_ids is None and args:
            input_ids = args[0]
        if input_ids is None:
            raise DLMError(
                "a gated-LoRA model needs input_ids in every forward (the gate is input_ids == "
                "mask_token_id); inputs_embeds cannot be gated"
            )
        gate = input_ids == self.mask_token_id
        self._gate = gate
        self._tick += 1
        for group in self._pending:  # products a forward left behind (an adapter of a group that did not run)
            group.x = group.u = None
        self._pending.clear()
        if self.sync_free:  # not counted (-1): every adapter and the embedding take their dense torch.where path
            self._n_gated, self._dense, self._idx, self._span = -1, True, None, None
            return
        # Per-forward facts every adapted linear needs, computed once here instead of in each of them
        # (at batch 1 the adapters' own overhead is what decides whether ISD's extra tokens are "free").
        idx = gate.reshape(-1).nonzero().squeeze(1)
        n = idx.numel()
        self._n_gated = n
        # Dense (delta on every row, torch.where) pays when training with many masks; without gradients (decoding)
        # the row gather + in-place index_add is ~4x cheaper per layer whatever the share of masks.
        grad = torch.is_grad_enabled()
        self._dense = grad and n >= self.dense_fraction * gate.numel()
        self._idx = idx if 0 < n and not self._dense else None
        # Decoding puts the masks in one contiguous run of the flattened [B*T] rows (always at batch 1: the
        # masks close the forward). Then each adapter is one addmm_ on a view of those rows (after the group's one
        # mm) instead of gather / 2 mm / index_add.
        self._span = None
        if self._idx is not None and not grad and not (self.training and self.settings.dropout > 0):
            lo, hi = idx[[0, -1]].tolist()
            if hi + 1 - lo == n:
                self._span = (lo, hi + 1)

    def _embed(self, out: torch.Tensor) -> torch.Tensor:
        """The input embedding's output with the mask rows replaced by the trainable mask vector."""
        if self._n_gated == 0:
            return out
        gate = self._gate
        if gate.shape != out.shape[:2]:
            raise DLMError(
                f"gated LoRA: gate shape {tuple(gate.shape)} does not match activations "
                f"{tuple(out.shape[:2])}; call the model with input_ids"
            )
        return torch.where(gate[..., None], self.mask_embedding.to(out.dtype), out)

    def remove(self):
        """Detach: the model's modules get their own classes back, the gate's pre-hook goes."""
        for h in self._handles:
            h.remove()
        self._handles = []
        hf = self._hf() if self._hf is not None else None
        if hf is not None:
            for m in hf.modules():
                gated, emb = m.__dict__.get(SLOT), m.__dict__.get(EMB_SLOT)
                if (gated is not None and gated[0].lora is self) or (emb is not None and emb[0] is self):
                    _ungate(m)
        self._pending.clear()

    # -- io ----------------------------------------------------------------------------------------------------
    def config_entry(self) -> dict:
        d = asdict(self.settings)
        d["target_modules"] = list(self.module_names)
        return d

    def adapter_state(self) -> dict[str, torch.Tensor]:
        state = {"mask_embedding": self.mask_embedding.detach().contiguous()}
        for key, adapter in self.adapters.items():
            state[f"{key}.A"] = adapter.A.detach().contiguous()
            state[f"{key}.B"] = adapter.B.detach().contiguous()
        return state


def get_gated(dlm) -> GatedLoRA | None:
    return getattr(dlm, "gated_lora", None)


def attached(model: nn.Module) -> list[GatedLoRA]:
    """The gated-LoRA adapters attached to ``model`` (a DiffusionLM or its Hugging Face model), if any."""
    out: list[GatedLoRA] = []
    for m in model.modules():
        emb = m.__dict__.get(EMB_SLOT)
        if emb is not None and emb[0] not in out:
            out.append(emb[0])
    return out


@contextlib.contextmanager
def sync_free(model: nn.Module):
    """Forwards of ``model`` inside this block read nothing on the host for its gated adapters (see
    :attr:`GatedLoRA.sync_free`): capturable as a CUDA graph. Each adapter's setting is put back on exit."""
    loras = attached(model)
    before = [g.sync_free for g in loras]
    for g in loras:
        g.sync_free = True
    try:
        yield loras
    finally:
        for g, b in zip(loras, before):
            g.sync_free = b


def prepare_model_for_lora(dlm, config):
    """Apply LoRA to a DiffusionLM and return it.

    - plain (``gated=False``): peft LoRA on ``dlm.model`` (merged into the weights on save);
    - gated (``gated=True``): adapters that act only at mask positions (see module docstring). The base weights
      are frozen; the trainable parameters are the adapters and the mask token's embedding vector only.
    """
    s = _settings(config)
    if (
        get_gated(dlm) is not None
        or hasattr(dlm.model, "get_base_model")
        or hasattr(getattr(dlm.model, "hf", None), "get_base_model")
    ):
        raise DLMError("this model already has LoRA adapters")
    if s.gated and dlm.mask_token_id is None:
        raise DLMError(
            f"gated LoRA acts at mask positions, and a '{dlm.objective}' model has no mask token: use plain LoRA "
            f"(lora.gated: false)"
        )
    if not s.gated:
        from peft import LoraConfig, get_peft_model

        peft_config = LoraConfig(
            r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=s.target_modules, task_type="CAUSAL_LM"
        )
        with warnings.catch_warnings():  # noise of the libraries' own making, nothing the user can act on:
            # transformers' deprecation of the name peft reads, and peft's stacked-expert patterns that "all-linear"
            # does not use (the routed experts of a MoE are 3-D parameters, not linear layers: they stay frozen)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            warnings.filterwarnings("ignore", message=".*_pattern keys did not match.*", category=RuntimeWarning)
            if hasattr(dlm.model, "add_lora"):  # a wrapper of the transformers model (dlm.model.renoise)
                dlm.model.add_lora(peft_config)
            else:
                dlm.model = get_peft_model(dlm.model, peft_config)
        return dlm
    return _attach_gated(dlm, s)


def _attach_gated(dlm, s: LoraSettings, module_names=None):
    hf = dlm.base_model_hf
    for p in hf.parameters():
        p.requires_grad_(False)
    dlm.gated_lora = GatedLoRA(hf, dlm.mask_token_id, s, module_names)
    return dlm


def trainable_parameters(dlm) -> list[nn.Parameter]:
    return [p for p in dlm.parameters() if p.requires_grad]


def save_model_folder(dlm, path: Path, merge_lora: bool = True) -> None:
    path = Path(path)
    model = dlm.model
    if hasattr(model, "save_folder"):  # a renoising model writes its own folder (dlm.model.renoise)
        model.save_pretrained(path, merge_lora=merge_lora)
        return
    if hasattr(model, "merge_and_unload"):
        if not merge_lora:
            raise DLMError("saving unmerged peft adapters is not supported; use merge_lora=True")
        import copy

        model = copy.deepcopy(model).merge_and_unload()
    gated = get_gated(dlm)
    if gated is not None:
        from safetensors.torch import save_file

        setattr(model.config, CONFIG_KEY, gated.config_entry())
        try:
            model.save_pretrained(path)
        finally:
            if hasattr(model.config, CONFIG_KEY):
                delattr(model.config, CONFIG_KEY)
        save_file(
            {k: v.cpu() for k, v in gated.adapter_state().items()},
            str(path / ADAPTER_FILE),
            metadata={"format": "dlm-gated-lora"},
        )
    else:
        model.save_pretrained(path)


def load_adapters_if_any(dlm, folder: Path) -> None:
    folder = Path(folder)
    file = folder / ADAPTER_FILE
    entry = getattr(dlm.hf_config, CONFIG_KEY, None)
    if not file.is_file():
        if entry is not None:
            raise DLMError(
                f"'{folder}/config.json' declares gated-LoRA adapters ({CONFIG_KEY}) but "
                f"{ADAPTER_FILE} is missing; copy the whole checkpoint folder"
            )
        return
    if entry is None:
        raise DLMError(f"'{file}' exists but config.json has no '{CONFIG_KEY}' entry; the folder is incomplete")
    from safetensors.torch import load_file

    entry = dict(entry)
    names = entry.pop("target_modules")
    settings = LoraSettings(**{k: v for k, v in entry.items() if k in LoraSettings.__dataclass_fields__})
    settings.target_modules = names
    delattr(dlm.hf_config, CONFIG_KEY)  # kept on the GatedLoRA object; re-added on save
    _attach_gated(dlm, settings, names)
    state = load_file(str(file))
    gated = dlm.gated_lora
    expected = set(gated.adapter_state())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise DLMError(f"'{file}' does not match its config: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        gated.mask_embedding.copy_(state["mask_embedding"])
        for key, adapter in gated.adapters.items():
            adapter.A.copy_(state[f"{key}.A"])
            adapter.B.copy_(state[f"{key}.B"])
