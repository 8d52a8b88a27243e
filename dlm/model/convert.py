"""AR -> DLM conversion, and the :class:`DiffusionLM` that every other part of dlm runs.

A DLM here is an ordinary Hugging Face causal LM (weights untouched, so a causal mask gives the AR logits
exactly) plus four fields stored in its ``config.json``:

- ``dlm_objective``: ``mdm`` (masked diffusion), ``block`` (BD3-LM/SDAR block diffusion) or ``idlm``
  (introspective diffusion);
- ``block_size``: masks per block (``block``/``idlm``; ``None`` for ``mdm``);
- ``mask_token_id``: the tokenizer's own mask token, or a new special token added by the conversion;
- ``shift``: whether hidden state i predicts token i+1 (the AR head reused as is).

The saved folder (safetensors + tokenizer + config) opens with plain ``transformers.AutoModelForCausalLM`` as
well as with :class:`AutoDLMForCausalLM`. Gated-LoRA adapters (which act only at mask positions and so cannot be
merged into the base weights) are stored beside the weights in ``dlm_adapter.safetensors``; the base weights in
``model.safetensors`` are then exactly the frozen AR model, which is what plain transformers opens.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlm.errors import DLMError
from dlm.fsutil import atomic_folder, check_model_folder, read_json_file
from dlm.model import lora as lora_mod
from dlm.model.lora import prepare_model_for_lora
from dlm.model.renoise import unwrapped

OBJECTIVES = ("mdm", "block", "idlm", "renoise")
DEFAULT_MASK_TOKEN = "<|mdm_mask|>"
# Attention implementations that accept an arbitrary 4D mask (the DLM objectives need one).
MASKABLE_ATTN = ("sdpa", "eager", "flex_attention", "dlm_sdpa")  # dlm_sdpa: dlm.decode.attention


def _hf(model) -> nn.Module:
    """The transformers model inside ``model`` (a DiffusionLM, a renoising wrapper, a peft wrapper, or itself)."""
    m = getattr(model, "base_model_hf", model)
    return unwrapped(getattr(m, "hf", m))  # (hf: a renoising model's wrapper, dlm.model.renoise.RenoiseLM)


_CACHE_KW: dict[type, str] = {}


def cache_kw(model) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``cache`` (newer transformers 5 releases, which
    deprecate the old name) or ``past_key_values`` (earlier ones)."""
    cls = type(_hf(model))
    if cls not in _CACHE_KW:
        import inspect

        params = inspect.signature(cls.forward).parameters
        _CACHE_KW[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KW[cls]


@contextlib.contextmanager
def dense_mask_attention(model):
    """Run ``model`` with SDPA inside the block when it was switched to flex attention (``--attn-impl
    flex_attention`` in training): decoding and scoring build dense boolean masks, which transformers' flex path
    would read as additive scores (masking nothing). The model's own implementation is restored afterwards."""
    hf = _hf(model)
    impl = getattr(getattr(hf, "config", None), "_attn_implementation", None)
    if impl != "flex_attention":
        yield model
        return
    hf.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        hf.set_attn_implementation(impl)


@dataclass
class DLMSpec:
    """The DLM fields of a checkpoint's config."""

    objective: str
    mask_token_id: int | None  # None: a uniform-noise (renoise) model has no mask token
    shift: bool
    block_size: int | None = None

    def to_config(self) -> dict[str, Any]:
        return {
            "dlm_objective": self.objective,
            "mask_token_id": self.mask_token_id,
            "shift": self.shift,
            "block_size": self.block_size,
        }

    @classmethod
    def from_config(cls, config) -> DLMSpec | None:
        objective = getattr(config, "dlm_objective", None)
        if objective is None:
            return None
        return cls(
            objective=objective,
            mask_token_id=None if getattr(config, "mask_token_id", None) is None else int(config.mask_token_id),
            shift=bool(config.shift),
            block_size=getattr(config, "block_size", None),
        )


def default_shift(objective: str) -> bool:
    """DiffuLLaMA (mdm) and I-DLM keep the AR shift; SDAR/BD3 block diffusion does not."""
    return objective in ("mdm", "idlm")


def default_block_size(objective: str) -> int | None:
    return {"mdm": None, "block": 4, "idlm": 1, "renoise": 32}[objective]


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise DLMError(f"unknown objective '{objective}': valid objectives are {', '.join(OBJECTIVES)}")
    return objective


def max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class DiffusionLM(nn.Module):
    """A Hugging Face causal LM with its DLM fields and tokenizer.

    ``forward`` passes everything through to the wrapped model (``self.model``), so 4D boolean attention masks
    ``[B, 1, Q, K]`` (True = may attend), explicit ``position_ids`` and ``past_key_values`` all work as in
    transformers. ``self.base_model_hf`` is always the underlying transformers model (inside any peft wrapper).
    """

    def __init__(self, model: nn.Module, tokenizer=None, spec: DLMSpec | None = None):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        if spec is not None:
            for key, value in spec.to_config().items():
                setattr(self.hf_config, key, value)
        if DLMSpec.from_config(self.hf_config) is None:
            raise DLMError(
                "this model has no DLM fields (dlm_objective, mask_token_id); convert it first with "
                "dlm.convert_ar_to_dlm or `dlm convert`"
            )

    # -- fields -------------------------------------------------------------------------------------------
    @property
    def hf_config(self):
        return self.model.config

    @property
    def spec(self) -> DLMSpec:
        return DLMSpec.from_config(self.hf_config)

    @property
    def objective(self) -> str:
        return self.spec.objective

    @property
    def mask_token_id(self) -> int:
        return self.spec.mask_token_id

    @property
    def block_size(self) -> int | None:
        return self.spec.block_size

    @property
    def shift(self) -> bool:
        return self.spec.shift

    @property
    def is_causal(self) -> bool:
        """Causal DLMs (I-DLM) decode with ISD and score with the exact AR likelihood."""
        return self.objective == "idlm"

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def max_positions(self) -> int | None:
        return max_positions(self.hf_config)

    @property
    def base_model_hf(self) -> nn.Module:
        return _hf(self.model)

    @property
    def renoise(self):
        """The :class:`~dlm.model.renoise.RenoiseLM` a renoising model runs through (None for the others)."""
        return self.model if hasattr(self.model, "soft_embeddings") else None

    def forward(self, *args, **kwargs):
        if getattr(self.hf_config, "dlm_attention", None) in ("bidirectional", "block"):
            # a published family's attention when the caller gives no 4-D mask (dlm.model.families)
            from dlm.model.families import default_attention

            kwargs = default_attention(self.hf_config, kwargs, kwargs.get("input_ids", args[0] if args else None))
        return self.model(*args, **kwargs)

    # -- save / load -------------------------------------------------------------------------------------
    def save_pretrained(self, path: str | os.PathLike, merge_lora: bool = True) -> Path:
        """Write a self-describing HF folder atomically (temp folder, then rename).

        Plain LoRA adapters are merged into the weights (``merge_lora``); gated-LoRA adapters cannot be (they act
        on mask positions only) and go to ``dlm_adapter.safetensors`` beside the untouched base weights.
        """
        path = Path(path)
        with atomic_folder(path) as tmp:
            lora_mod.save_model_folder(self, tmp, merge_lora=merge_lora)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(tmp)
        return path


class AutoDLMForCausalLM:
    """Load a DLM folder written by :meth:`DiffusionLM.save_pretrained` (or `dlm convert` / `dlm train`)."""

    @staticmethod
    def from_pretrained(
        path: str | os.PathLike, dtype: torch.dtype | None = None, device=None, attn_implementation: str = "sdpa"
    ) -> DiffusionLM:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        # a circle inside dlm.model: hub, families and renoise import this module
        from dlm.model.hub import resolve_model_path

        folder = resolve_model_path(path)
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise DLMError(f"'{folder}' has no config.json")
        fields = read_json_file(config_path, "model folder")
        check_model_folder(folder)  # damaged files: an error naming the file, not a traceback or wrong weights
        from dlm.model.families import inspect_folder, load_published  # a circle: convert <-> hub, families, renoise

        info = inspect_folder(folder, fields)
        if info.family is not None:  # a published folder (LLaDA, Dream, SDAR, DiffusionGemma, ...)
            return load_published(info, dtype=dtype, device=device)
        if "dlm_objective" not in fields:
            raise DLMError(
                f"'{folder}' is a plain causal LM, not a DLM (no 'dlm_objective' in config.json); "
                f"convert it with: dlm convert --model {path} --objective idlm --output DIR"
            )
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype or torch.float32, attn_implementation=attn_implementation, trust_remote_code=False
        )
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - transformers raises many types for a damaged tokenizer file
            raise DLMError(
                f"could not load the tokenizer of '{folder}' ({type(e).__name__}: {e}); its "
                f"tokenizer.json / tokenizer_config.json is damaged: restore the folder"
            ) from e
        if fields.get("dlm_objective") == "renoise":  # a converted renoising model: its self-conditioning block
            from dlm.model.renoise import ConvertedRenoiseLM  # a circle: convert <-> hub, families, renoise

            wrapped = ConvertedRenoiseLM(model)
            wrapped.load_extra(folder)
            model = wrapped
        dlm = DiffusionLM(model, tokenizer)
        lora_mod.load_adapters_if_any(dlm, folder)
        if device is not None:
            dlm.to(device)
        dlm.eval()
        return dlm


def load_any(
    name_or_path: str | os.PathLike,
    objective: str | None = None,
    dtype=None,
    device=None,
    convert_to: str | None = None,
    **convert_kw,
) -> DiffusionLM:
    """A DiffusionLM from a DLM folder, or converted on the fly from an AR folder/alias. ``objective``: the
    objective a DLM folder must have and the one an AR model is converted to; ``convert_to``: only the latter (a
    DLM folder loads whatever its objective). Conversion defaults to idlm."""
    from dlm.model.families import inspect_folder, load_published  # a circle: convert <-> hub, families, renoise
    from dlm.model.hub import resolve_model_path  # a circle: convert <-> hub, families, renoise

    info = inspect_folder(resolve_model_path(name_or_path))
    folder = info.path
    if info.is_dlm:
        if info.family is not None:  # a published folder: a block_size where its config lacks one
            dlm = load_published(info, dtype=dtype, device=device, block_size=convert_kw.get("block_size"))
        else:
            dlm = AutoDLMForCausalLM.from_pretrained(folder, dtype=dtype, device=device)
        if objective is not None and objective != dlm.objective:
            raise DLMError(
                f"'{name_or_path}' is a '{dlm.objective}' DLM, not '{objective}' (--objective): a DLM keeps the "
                f"objective it was trained with; give --objective {dlm.objective}"
            )
        return dlm
    dlm = convert_ar_to_dlm(folder, objective or convert_to or "idlm", **convert_kw)
    if dtype is not None:
        dlm.to(dtype)
    if device is not None:
        dlm.to(device)
    return dlm


def _add_mask_token(model: nn.Module, tokenizer, mask_token: str | None) -> int:
    """Return the mask id: the tokenizer's own mask token, else a new special token with a resized embedding."""
    if mask_token is None and getattr(tokenizer, "mask_token", None) is not None:
        token_id = int(tokenizer.mask_token_id)
    else:
        name = mask_token or DEFAULT_MASK_TOKEN
        vocab = tokenizer.get_vocab()
        if name in vocab:
            token_id = vocab[name]
            special_ids = set(getattr(tokenizer, "all_special_ids", []))
            added = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
            if token_id not in special_ids and name not in added:
                raise DLMError(
                    f"mask token '{name}' is an ordinary token of this tokenizer (id {token_id}); "
                    f"reusing it would also score it wherever it occurs naturally. Pass a new name "
                    f"(e.g. --mask-token '{DEFAULT_MASK_TOKEN}') or an existing *special* token"
                )
            tokenizer.mask_token = name
            token_id = int(token_id)
        else:
            tokenizer.add_special_tokens({"mask_token": name})
            token_id = int(tokenizer.convert_tokens_to_ids(name))
    _cover_token(model, token_id, len(tokenizer))
    return token_id


def _cover_token(model: nn.Module, token_id: int, tokenizer_len: int) -> None:
    """Resize the embedding (and an untied head) so that ``token_id`` has a row; new rows get the mean row."""
    old_in = model.get_input_embeddings().weight.shape[0]
    if token_id < old_in:
        return
    new_size = max(tokenizer_len, token_id + 1, old_in)
    with torch.no_grad():
        # Sensible init: the mean input embedding (and mean head row when untied), as in HF mean resizing.
        in_mean = model.get_input_embeddings().weight.mean(0).clone()
        out = model.get_output_embeddings()
        out_mean = out.weight.mean(0).clone() if out is not None else None
        model.resize_token_embeddings(new_size, mean_resizing=False)
        emb = model.get_input_embeddings().weight
        emb[old_in:] = in_mean
        out = model.get_output_embeddings()
        if out is not None and out.weight.data_ptr() != emb.data_ptr():
            out.weight[old_in:] = out_mean
            if getattr(out, "bias", None) is not None:
                out.bias[old_in:] = out.bias[:old_in].mean()


def convert_ar_to_dlm(
    model_or_path,
    objective: str = "idlm",
    block_size: int | None = None,
    shift: bool | None = None,
    mask_token: str | None = None,
    lora=None,
    tokenizer=None,
    dtype: torch.dtype | None = None,
) -> DiffusionLM:
    """Turn a Hugging Face causal LM (object, local folder or alias) into a :class:`DiffusionLM`.

    - ``objective``: ``mdm`` | ``block`` | ``idlm``; ``block_size`` defaults to 4 for block and 1 for idlm.
    - ``shift`` defaults to True for mdm/idlm (DiffuLLaMA / I-DLM) and False for block (SDAR).
    - ``mask_token``: use the tokenizer's own mask token if it has one, else add this new special token
      (default ``<|mdm_mask|>``) and resize the embedding; an ordinary existing token is refused.
    - ``lora``: a :class:`dlm.model.lora.LoraSettings` (or dict) applied through
      :func:`dlm.prepare_model_for_lora`; ``gated=True`` makes the adapters act on mask positions only.
    The weights are untouched: under a causal mask the result returns the original model's logits exactly.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dlm.model.hub import resolve_model_path  # a circle: convert <-> hub, families, renoise

    check_objective(objective)
    if isinstance(model_or_path, (str, os.PathLike)):
        folder = resolve_model_path(model_or_path)
        # a circle: convert <-> hub, families, renoise
        from dlm.model.families import inspect_folder, load_published, refuse_remote_code

        info = inspect_folder(folder)
        refuse_remote_code(folder, info.fields)
        family = info.family
        if family is not None:  # a published DLM: loaded as it is (block_size where its config lacks one)
            if objective != family.objective:
                raise DLMError(
                    f"'{model_or_path}' is a published '{family.name}' checkpoint, a "
                    f"'{family.objective}' DLM already: use --objective {family.objective}"
                )
            dlm = load_published(info, dtype=dtype, block_size=block_size)
            if shift is not None and bool(shift) != dlm.shift:
                raise DLMError(
                    f"'{model_or_path}' ({family.name}) has shift={dlm.shift} by construction; drop --shift/--no-shift"
                )
            return dlm
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
            except Exception as e:
                raise DLMError(f"could not load the tokenizer of '{folder}': {e}") from e
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype or torch.float32, attn_implementation="sdpa", trust_remote_code=False
            )
        except Exception as e:
            raise DLMError(f"could not load a causal LM from '{folder}': {e}") from e
    else:
        model = model_or_path
        if tokenizer is None:
            raise DLMError("convert_ar_to_dlm(model_object, ...) needs tokenizer=... to add the mask token")
    if isinstance(model, DiffusionLM):
        raise DLMError("this model is already a DLM")
    if DLMSpec.from_config(model.config) is not None:
        raise DLMError("this model is already a DLM (its config has dlm_objective)")

    attn = getattr(model.config, "_attn_implementation", None)
    if attn not in MASKABLE_ATTN:
        raise DLMError(
            f"attention implementation '{attn}' of {type(model).__name__} cannot take the custom "
            f"attention masks DLM objectives need; load the model with attn_implementation='sdpa'"
        )

    if block_size is None:
        block_size = default_block_size(objective)
    if objective in ("block", "idlm", "renoise") and (not isinstance(block_size, int) or block_size < 1):
        raise DLMError(f"--block-size must be a positive integer for objective '{objective}', got {block_size}")
    if objective == "mdm" and block_size is not None:
        raise DLMError("objective 'mdm' has no block size; drop --block-size or use --objective block")
    if shift is None:
        shift = default_shift(objective)

    if objective == "renoise":  # uniform noise: no mask token; a self-conditioning block beside the AR model
        from dlm.model.renoise import ConvertedRenoiseLM  # a circle: convert <-> hub, families, renoise

        if shift:
            raise DLMError("objective 'renoise' scores each canvas token at its own position: drop --shift")
        spec = DLMSpec(objective=objective, mask_token_id=None, shift=False, block_size=block_size)
        dlm = DiffusionLM(ConvertedRenoiseLM(model), tokenizer, spec)
    else:
        mask_id = _add_mask_token(model, tokenizer, mask_token)
        spec = DLMSpec(objective=objective, mask_token_id=mask_id, shift=bool(shift), block_size=block_size)
        dlm = DiffusionLM(model, tokenizer, spec)
    if lora is not None:
        dlm = prepare_model_for_lora(dlm, lora)
    dlm.eval()
    return dlm


def spec_dict(dlm: DiffusionLM) -> dict[str, Any]:
    return asdict(dlm.spec)
