"""Published diffusion LMs loaded without remote code: one module per family, each defining one
:class:`~dlm.model.families.base.Family` record, and the registry that asks them in order.

==============  =============  =========  =======  ==========================  =================  ===========
family          class          objective  shift    block size                  attention          mask id
==============  =============  =========  =======  ==========================  =================  ===========
llada           Llama          mdm        no       -                           bidirectional      126336
dream           Qwen2          mdm        yes      -                           bidirectional      151666
sdar            Qwen3          block      no       ``block_size`` (required)   block-causal       151669
idlm            Qwen3          idlm       yes      ``block_size`` (1, 2, 3)    causal             151669
fast_dllm_v2    Qwen2          block      yes      ``bd_size``                 block-causal       151665
llada2          GLM-4-MoE      block      no       ``block_size`` or 32        block-causal       156895
llada_moe       Qwen3-MoE      mdm        no       -                           bidirectional      156895
diffusion_gemma its own        renoise    no       ``canvas_length``           causal + canvas    none
==============  =============  =========  =======  ==========================  =================  ===========

A folder is recognised by its ``config.json`` (``model_type`` / ``architectures``), rebuilt as the transformers class
with the same computation with the weights renamed on load (DiffusionGemma: transformers' own class), and returned as
a :class:`~dlm.model.convert.DiffusionLM` whose config carries ``dlm_family`` (the layout it came from: the default
of ``dlm export``) and ``dlm_attention`` (a :class:`DiffusionLM` called without a 4-D mask applies that attention
itself, so ``model(input_ids).logits`` are the family's). ``mask_token_id`` from config.json wins over the default.

Adding a family: one module defining its ``FAMILY`` (how its folder is recognised, its config and weight mapping,
its objective, shift, attention, mask id, block size, samplers' defaults and export format), and one line in
:data:`REGISTRY` - or :func:`register` at run time. :func:`inspect_folder` reads a folder's config.json once; the
loader and the commands take its answer. See docs/models.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlm.errors import DLMError
from dlm.model.families import diffusion_gemma, dream, fast_dllm_v2, llada, llada2, llada_moe, sdar
from dlm.model.families.adapters import ADAPTER_CONFIG, adapter_folder_error, attach_gated_adapter
from dlm.model.families.base import Family, build, read_weights, tokenizer

# the families' folders are told apart by their recognisers alone (no two accept the same config.json); the
# registry asks them in this order, and lists them so in messages
REGISTRY: list[Family] = [
    llada.FAMILY,
    dream.FAMILY,
    sdar.SDAR,
    sdar.IDLM,
    fast_dllm_v2.FAMILY,
    llada2.FAMILY,
    llada_moe.FAMILY,
    diffusion_gemma.FAMILY,
]


def register(family: Family, first: bool = True) -> Family:
    """Add ``family`` to the registry (asked before the others unless ``first`` is False); returns it. A family of
    the same name is replaced."""
    REGISTRY[:] = [f for f in REGISTRY if f.name != family.name]
    REGISTRY.insert(0 if first else len(REGISTRY), family)
    return family


def names() -> tuple[str, ...]:
    return tuple(f.name for f in REGISTRY)


def get(name: str) -> Family:
    """The registered family ``name``."""
    for f in REGISTRY:
        if f.name == name:
            return f
    raise DLMError(f"unknown model family '{name}': dlm maps {', '.join(names())}")


def family_of(fields: dict) -> Family | None:
    """The family of a folder's config.json fields, None for anything else (plain models, dlm folders)."""
    if not isinstance(fields, dict) or "dlm_objective" in fields:
        return None
    return next((f for f in REGISTRY if f.recognise(fields)), None)


def read_fields(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        return {}
    try:
        fields = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DLMError(f"'{path}' is not valid JSON ({e}); restore the file") from e
    if not isinstance(fields, dict):
        raise DLMError(f"'{path}' must hold a JSON object")
    return fields


@dataclass(frozen=True)
class Folder:
    """What a model folder is, from one read of its config.json: ``fields`` ({} without one), the published
    ``family`` (None: a dlm folder, a plain model, or no folder), and the DLM ``objective`` it has (a dlm folder's
    ``dlm_objective``, a family's; None for a plain causal LM)."""

    path: Path
    fields: dict[str, Any]
    family: Family | None
    objective: str | None

    @property
    def is_dlm(self) -> bool:
        return self.objective is not None


def inspect_folder(path: str | Path, fields: dict | None = None) -> Folder:
    """:class:`Folder` of ``path`` (a path that is not a model folder gives empty fields: the loader names it);
    ``fields``: its config.json, where the caller has read it already."""
    path = Path(path)
    fields = read_fields(path) if fields is None else fields
    family = family_of(fields)
    own = fields.get("dlm_objective") or (family.objective if family is not None else None)
    return Folder(path, fields, family, own if isinstance(own, str) else None)


def refuse_remote_code(folder: str | Path, fields: dict) -> None:
    """A folder whose model only its own Python code defines (config.json's ``auto_map`` for a ``model_type``
    transformers does not know), and which is not a family dlm maps itself, is refused by name: dlm runs no remote
    code. (A stale ``auto_map`` beside a type transformers defines is harmless and passes.)"""
    auto_map = fields.get("auto_map")
    if not auto_map or family_of(fields) is not None or fields.get("dlm_family") in names():
        return
    from transformers import CONFIG_MAPPING

    mtype = fields.get("model_type")
    if isinstance(mtype, str) and mtype in CONFIG_MAPPING:
        return
    families = ", ".join(f.title for f in REGISTRY)
    raise DLMError(
        f"'{folder}' needs its own Python code (config.json auto_map, model_type {mtype!r}, which transformers does "
        f"not define); dlm runs no remote code. It maps these families itself: {families} - this model is not "
        f"one of them"
    )


def folder_objective(folder: str | Path) -> str | None:
    """The objective of a DLM folder (a dlm folder's ``dlm_objective``, a published family's), None for anything
    else (an AR model, an alias, a path that is not there: the loader names those)."""
    return inspect_folder(folder).objective


def default_decoder(model: str, default: str) -> str:
    """A command's decoder where its caller gave no ``--decode``: ``default``, unless the model is one that only its
    own decoder runs (a renoising model: ``renoise``). ``model``: a folder (or a name that is not one: ``default``)."""
    return "renoise" if folder_objective(model) == "renoise" else default


def is_published(folder: str | Path) -> bool:
    """Whether ``folder`` holds a checkpoint of a registered family."""
    return inspect_folder(folder).family is not None


def sampler_defaults(config, decoder: str) -> dict[str, Any]:
    """The settings a family's own sampler gives ``decoder`` on a model of this config's family ({} for others),
    and those the checkpoint sets itself (``dlm_sampler``: DiffusionGemma's generation_config.json)."""
    name = getattr(config, "dlm_family", None)
    family = next((f for f in REGISTRY if f.name == name), None)
    out = dict(family.samplers.get(decoder, {})) if family is not None else {}
    own = getattr(config, "dlm_sampler", None)
    if isinstance(own, dict):
        out.update(own.get(decoder, {}))
    return out


def load_published(folder: str | Path | Folder, dtype=None, device=None, block_size: int | None = None):
    """A :class:`~dlm.model.convert.DiffusionLM` from a published checkpoint folder (see the module docstring)."""
    from dlm.model.convert import DiffusionLM, DLMSpec  # a circle: convert <-> hub, families, renoise

    info = folder if isinstance(folder, Folder) else inspect_folder(folder)
    folder, fields, family = info.path, info.fields, info.family
    path = folder / "config.json"
    if family is None:
        raise DLMError(
            f"'{path}' is not a checkpoint of {', '.join(f.title for f in REGISTRY)} "
            f"(model_type {fields.get('model_type')!r})"
        )
    if family.load is not None:  # a family transformers defines itself: its own loader
        return family.load(folder, dtype=dtype, device=device)
    dtype = dtype or torch.float32
    config = family.config(fields, path)
    b = family.block_size(fields, path, block_size)
    mask_id = family.mask_token(fields, path, config.vocab_size)
    state = read_weights(folder)
    if family.rename is not None:
        state = family.rename(state, folder, config)
    model = build(config, state, dtype, folder, family.title)
    config.dlm_family = family.name
    config.dlm_attention = family.attention
    spec = DLMSpec(objective=family.objective, mask_token_id=mask_id, shift=family.shift, block_size=b)
    dlm = DiffusionLM(model, tokenizer(folder), spec)
    if device is not None:
        dlm.to(device)
    dlm.eval()
    return dlm


# -- the family's attention for a forward without a 4-D mask -----------------------------------------------
def default_attention(config, kwargs: dict[str, Any], input_ids: torch.Tensor | None) -> dict[str, Any]:
    """``kwargs`` of a forward with the family's 4-D attention mask added when the caller gave none (no mask or a
    2-D padding mask, and no cache with content). Positions 0..L-1 (with rotary embeddings only relative positions
    matter, so the offset a padded row's tokens get changes nothing)."""
    kind = getattr(config, "dlm_attention", None)
    mask = kwargs.get("attention_mask")
    if kind not in ("bidirectional", "block") or input_ids is None or (mask is not None and mask.dim() != 2):
        return kwargs
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if cache is not None and getattr(cache, "get_seq_length", lambda: 0)() > 0:
        return kwargs
    b, n = input_ids.shape
    dev = input_ids.device
    valid = torch.ones(b, n, dtype=torch.bool, device=dev) if mask is None else mask.to(dev).bool()
    pos = kwargs.get("position_ids")
    if pos is None:
        pos = torch.arange(n, device=dev)[None].expand(b, n)
    allowed = valid[:, None, None, :].expand(b, 1, n, n)
    if kind == "block":
        blk = pos // int(config.block_size)
        allowed = allowed & (blk[:, None, None, :] <= blk[:, None, :, None])
    allowed = allowed | torch.eye(n, dtype=torch.bool, device=dev)  # a pad query attends to itself (no NaN)
    out = dict(kwargs)
    out["attention_mask"] = allowed
    out["position_ids"] = pos
    return out


__all__ = [
    "ADAPTER_CONFIG",
    "Family",
    "Folder",
    "REGISTRY",
    "adapter_folder_error",
    "attach_gated_adapter",
    "default_attention",
    "default_decoder",
    "family_of",
    "folder_objective",
    "get",
    "inspect_folder",
    "is_published",
    "load_published",
    "names",
    "read_fields",
    "refuse_remote_code",
    "register",
    "sampler_defaults",
]
