"""LoRA through peft, and gated (mask-only) LoRA.

This module also owns how a DiffusionLM's weights are written (``save_model_folder``) and how adapters are
restored on load (``load_adapters_if_any``), because adapters decide what goes where.

Gated LoRA (I-DLM "lossless" mode, docs/algorithms.md#idlm): low-rank adapters that act **only at mask positions**
(``input_ids == mask_token_id``). It is implemented with forward hooks on the untouched Hugging Face modules:

- a pre-hook on the HF model computes the gate ``[B, T]`` from the ``input_ids`` of *that* call (so it works in
  one forward and in KV-cache extends);
- a hook on each targeted linear layer adds ``scale * B(A(x))`` to the output rows of gated positions only
  (``torch.where`` / ``index_add`` on those rows; every other row is bit-for-bit the base layer's output);
- a hook on the input embedding replaces the embedding of mask positions with a separate trainable vector
  (``GatedLoRA.mask_embedding``), so AdamW (weight decay included) can never touch another embedding row.

The adapters live in ``dlm.gated_lora`` (outside the HF model), so ``dlm.model.state_dict()`` is exactly the
frozen base model: ``save_pretrained`` writes it unchanged (plain transformers opens it as the AR model) and
puts the adapters + mask embedding in ``dlm_adapter.safetensors`` and their settings in ``config.json``
(``dlm_gated_lora``).
"""

from __future__ import annotations

import math
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
            in_f, out_f = _linear_shape(modules[name])
            w = modules[name].weight
            self.adapters[name.replace(".", "__")] = _Adapter(in_f, out_f, settings.r, w.device, w.dtype)
        self.mask_embedding = nn.Parameter(emb.weight[self.mask_token_id].detach().clone())
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self._gate: torch.Tensor | None = None  # [B, T] bool, set per HF forward
        self._n_gated, self._dense, self._idx, self._span = 0, False, None, None
        # gated share of rows above which the delta is computed densely (cheaper than row gathers on CPU)
        self.dense_fraction = 0.25
        # decoding may install a faster few-row path here: fast_delta(adapter, rows, out_rows, scale) adds
        # scale * B(A(rows)) to out_rows in place and returns True, or returns False (dlm.decode.cpu on CPU)
        self.fast_delta = None
        self._handles = []
        self._handles.append(hf_model.register_forward_pre_hook(self._set_gate, with_kwargs=True))
        self._handles.append(emb.register_forward_hook(self._embed_hook))
        for name in self.module_names:
            adapter = self.adapters[name.replace(".", "__")]
            self._handles.append(modules[name].register_forward_hook(self._make_linear_hook(adapter)))

    # -- hooks -----------------------------------------------------------------------------------------------
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
        # Per-forward facts every linear hook needs, computed once here instead of in each of the ~200 hooks
        # (at batch 1 the hooks' own overhead is what decides whether ISD's extra tokens are "free").
        n = int(gate.sum())
        self._n_gated = n
        # Dense (delta on every row, torch.where) pays when training with many masks; without gradients (decoding)
        # the row gather + in-place index_add is ~4x cheaper per layer whatever the share of masks.
        self._dense = torch.is_grad_enabled() and n >= self.dense_fraction * gate.numel()
        self._idx = gate.reshape(-1).nonzero().squeeze(1) if 0 < n and not self._dense else None
        # Decoding puts the masks in one contiguous run of the flattened [B*T] rows (always at batch 1: the
        # masks close the forward). Then each hook is one mm + one in-place addmm on a view of those rows
        # instead of gather / 2 mm / index_add: at batch 1 the per-hook op count is the cost (~200 hooks).
        self._span = None
        if self._idx is not None and not torch.is_grad_enabled() and not (self.training and self.settings.dropout > 0):
            lo, hi = int(self._idx[0]), int(self._idx[-1]) + 1
            if hi - lo == n:
                self._span = (lo, hi)

    def _gate_for(self, x: torch.Tensor) -> torch.Tensor | None:
        gate = self._gate
        if gate is None:
            return None
        if gate.shape != x.shape[:2]:
            raise DLMError(
                f"gated LoRA: gate shape {tuple(gate.shape)} does not match activations "
                f"{tuple(x.shape[:2])}; call the model with input_ids"
            )
        return gate

    def _embed_hook(self, module, args, out):
        gate = self._gate_for(out)
        if gate is None or not bool(gate.any()):
            return out
        return torch.where(gate[..., None], self.mask_embedding.to(out.dtype), out)

    def _make_linear_hook(self, adapter: _Adapter):
        def hook(module, args, out):
            gate = self._gate_for(out)
            if gate is None or self._n_gated == 0:
                return out
            x = args[0]
            if self._dense:
                # Many masks (training): low-rank delta on every row, kept only where gated. torch.where keeps the
                # other rows bit-for-bit (and is far cheaper than index_add/scatter on CPU).
                delta = (self.dropout(x).to(adapter.A.dtype) @ adapter.A.t()) @ adapter.B.t() * self.scale
                return torch.where(gate[..., None], out + delta.to(out.dtype), out)
            if out.is_contiguous() and self.span_delta(
                adapter, x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
            ):
                return out
            # Few masks (decoding): compute the delta on the gated rows only.
            idx = self._idx
            rows = x.reshape(-1, x.shape[-1]).index_select(0, idx)  # [N, in]
            if self.training and self.settings.dropout > 0:
                rows = self.dropout(rows)
            if rows.dtype != adapter.A.dtype:
                rows = rows.to(adapter.A.dtype)
            delta = (rows @ adapter.A.t()) @ adapter.B.t()
            if delta.dtype != out.dtype:
                delta = delta.to(out.dtype)
            flat = out.reshape(-1, out.shape[-1])
            if torch.is_grad_enabled():
                flat = flat.index_add(0, idx, delta, alpha=self.scale)
            else:  # decoding: in place, no copy of the layer output
                flat.index_add_(0, idx, delta, alpha=self.scale)
            return flat.view_as(out)

        hook._dlm_gated = (self, adapter)  # lets a fused decode path apply the same delta without the hook call
        return hook

    def span_delta(self, adapter: _Adapter, x: torch.Tensor, out: torch.Tensor) -> bool:
        """Decoding's delta when this forward's masks are one run of rows (``_span``): ``out[lo:hi] += scale *
        B(A(x[lo:hi]))`` in place on the layer's flattened input ``x [rows, in]`` and output ``out [rows, out]``
        (through ``fast_delta`` where one is installed); False, nothing done, where that does not apply."""
        span = self._span
        if span is None or self._dense or not x.dtype == adapter.A.dtype == out.dtype:
            return False
        lo, hi = span
        rows, target = x[lo:hi], out[lo:hi]
        fast = self.fast_delta
        if fast is None or not fast(adapter, rows, target, self.scale):
            target.addmm_(rows @ adapter.A.t(), adapter.B.t(), alpha=self.scale)
        return True

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []

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


def prepare_model_for_lora(dlm, config):
    """Apply LoRA to a DiffusionLM and return it.

    - plain (``gated=False``): peft LoRA on ``dlm.model`` (merged into the weights on save);
    - gated (``gated=True``): adapters that act only at mask positions (see module docstring). The base weights
      are frozen; the trainable parameters are the adapters and the mask token's embedding vector only.
    """
    s = _settings(config)
    if get_gated(dlm) is not None or hasattr(dlm.model, "get_base_model"):
        raise DLMError("this model already has LoRA adapters")
    if not s.gated:
        from peft import LoraConfig, get_peft_model

        peft_config = LoraConfig(
            r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=s.target_modules, task_type="CAUSAL_LM"
        )
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
