"""What every published family's module uses: the :class:`Family` record, config.json helpers, reading safetensors
weights, stacking and unstacking a mixture of experts, and building the transformers model from a renamed state.
No family's name appears here."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dlm.errors import DLMError


@dataclass(frozen=True)
class Family:
    """One published family: how its folder is recognised, what it maps onto and how it decodes.

    - ``recognise(fields)``: whether config.json's fields are this family's (the registry asks in its order);
    - ``config(fields, path)``: the transformers config with the same computation; ``rename(state, folder,
      config)``: the checkpoint's weights under that class's names (None: as they are);
    - ``objective`` / ``shift`` / ``attention`` (``bidirectional``, ``block``, ``causal``, ``renoise``) /
      ``mask_id`` (where config.json has no ``mask_token_id``; None: no mask token);
    - ``block_keys``: the config.json keys that give its block size, first found wins (empty: no blocks);
      ``default_block``: where none is given;
    - ``samplers``: decoder name -> the settings its own sampler uses where dlm's defaults differ;
    - ``load(folder, dtype, device)``: a family transformers defines itself loads through this instead;
    - ``export``: ``(format name, writer)``, the ``dlm export --format`` that writes its layout back: the writer
      as ``"module:function"`` (imported when used) or the function, see :func:`dlm.model.export.formats`; None:
      no layout of its own.
    """

    name: str
    title: str
    objective: str
    shift: bool
    attention: str
    recognise: Callable[[dict], bool]
    mask_id: int | None = None
    config: Callable[[dict, Path], Any] | None = None
    rename: Callable[[dict, Path, Any], dict] | None = None
    block_keys: tuple[str, ...] = ()
    default_block: int | None = None
    samplers: dict[str, dict[str, Any]] = field(default_factory=dict)
    load: Callable | None = None
    export: tuple[str, str | Callable] | None = None

    def block_size(self, fields: dict, path: Path, asked: int | None) -> int | None:
        """The block size a loaded checkpoint decodes with: config.json's (``asked``, --block-size, must agree),
        else the family's default; a family with blocks and neither is refused with the fix."""
        if not self.block_keys:
            return None
        key = next((k for k in self.block_keys if k in fields), self.block_keys[-1])
        if asked is not None and fields.get(key) is not None and asked != fields[key]:
            raise DLMError(
                f"'{path}' says '{key}' {fields[key]}, but block size {asked} was asked (--block-size); "
                f"drop --block-size (a published model decodes with the block size it was trained with)"
            )
        value = asked if asked is not None else fields.get(key)
        if value is None:
            value = self.default_block
        if value is None:
            raise DLMError(
                f"'{path}' has no 'block_size' (the published {self.title} config.json lacks it): add "
                f'"block_size": 4 (the model\'s block length) to it, or '
                f"write a dlm folder with: dlm convert --model {path.parent} --objective "
                f"{self.objective} --block-size 4 --output DIR"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DLMError(f"'{path}': '{key}' must be a positive integer, got {value!r}")
        return value

    def mask_token(self, fields: dict, path: Path, vocab: int) -> int | None:
        """The mask token's id: config.json's ``mask_token_id``, else the family's default (checked against the
        embedding's rows)."""
        value = fields.get("mask_token_id")
        if value is None:
            value = self.mask_id
            if value is None:
                return None
            where = f"the {self.title} default mask id {value}"
        else:
            where = f"'mask_token_id' {value}"
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
            raise DLMError(
                f"'{path}': {where} is not a row of the {vocab}-token embedding; set \"mask_token_id\" in "
                f"config.json to the id of the tokenizer's mask token"
            )
        return value


def names_of(fields: dict) -> list[str]:
    """config.json's ``model_type`` and ``architectures``: the names a family is recognised by."""
    archs = fields.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    return [n for n in [fields.get("model_type"), *archs] if isinstance(n, str)]


# -- config.json -> transformers config ----------------------------------------------------------------------
def need(fields: dict, key: str, path: Path, what: str, kind=int):
    value = fields.get(key)
    if value is None:
        raise DLMError(f"'{path}' has no '{key}' ({what}); add it as in the published config.json")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise DLMError(f"'{path}': '{key}' must be a positive integer, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise DLMError(f"'{path}': '{key}' must be a number, got {value!r}")
    return value


def moe_sizes(fields: dict, path: Path, expert_width: str) -> tuple[int, ...]:
    """A mixture of experts' sizes from config.json (each named in the error where it is missing): hidden size,
    layers, attention heads, vocabulary, experts, experts per token, and an expert's width (key ``expert_width``)."""
    return tuple(
        need(fields, key, path, what)
        for key, what in (
            ("hidden_size", "the hidden size"),
            ("num_hidden_layers", "the number of layers"),
            ("num_attention_heads", "the number of attention heads"),
            ("vocab_size", "the vocabulary size"),
            ("num_experts", "the number of routed experts"),
            ("num_experts_per_tok", "the experts per token"),
            (expert_width, "the width of an expert"),
        )
    )


# config.json keys of the published files that are remote-code settings with no meaning here
DROP = {
    "architectures",
    "auto_map",
    "model_type",
    "attn_implementation",
    "_attn_implementation",
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "block_size",
    "bd_size",
    "mask_token_id",
    "use_regular_causal",
    "fuse_cross_entropy",
    "debug",
    "ep_size",
    "micro_forward",
    "skip_checkpoint",
    "use_deepep",
    "conplemenrary_mask",
    "complementary_mask",
    "dlm_family",
    "dlm_attention",
}


def qwen_config(fields: dict, path: Path, cls):
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        need(fields, key, path, "a size of the model")
    kw = {k: v for k, v in fields.items() if k not in DROP}
    try:
        return cls(**kw)
    except Exception as e:  # noqa: BLE001 - the config class names the bad field
        raise DLMError(f"'{path}' does not make a {cls.__name__}: {e}") from e


# -- weights -------------------------------------------------------------------------------------------------
def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files (one file, or the shards of model.safetensors.index.json)."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise DLMError(f"'{index}' is not a safetensors index (no 'weight_map'): {e}") from e
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise DLMError(
            f"'{folder}' has no model.safetensors (or model.safetensors.index.json); dlm reads "
            f"safetensors weights only: convert .bin files with safetensors first"
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise DLMError(f"'{folder / name}' (listed in model.safetensors.index.json) is missing")
        state.update(load_file(str(folder / name)))
    return state


LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def stacked_experts(parts: dict[tuple[int, str], torch.Tensor], n: int, prefix: str, folder: Path) -> dict:
    """One layer's experts (``parts[(e, "gate"|"up"|"down")]``, from ``mlp.experts.E.*_proj.weight``) as the
    ``[E, 2F, H]`` gate-and-up and ``[E, H, F]`` down tensors transformers keeps them in, under ``prefix``."""
    missing = [f"{e}.{w}_proj" for e in range(n) for w in ("gate", "up", "down") if (e, w) not in parts]
    if missing or len(parts) != 3 * n:
        what = f"lacks '{prefix}experts.{missing[0]}.weight'" if missing else "has more experts"
        raise DLMError(f"'{folder}' {what} (config.json says num_experts {n}); the weights do not match it")
    return {
        prefix + "experts.gate_up_proj": torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]]) for e in range(n)]
        ),
        prefix + "experts.down_proj": torch.stack([parts[(e, "down")] for e in range(n)]),
    }


STACKED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # transformers' names for them


def unstacked_experts(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of :func:`stacked_experts` for one of a layer's :data:`STACKED_EXPERTS` tensors: the one tensor
    per expert checkpoints hold (``mlp.experts.E.{gate,up,down}_proj.weight``; for ``dlm export``)."""
    base = name.rsplit(".", 1)[0] + "."
    if name.endswith("gate_up_proj"):
        out = {}
        for e, (gate, up) in enumerate(x.chunk(2, dim=0) for x in t):
            out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        return out
    return {f"{base}{e}.down_proj.weight": down for e, down in enumerate(t)}


def with_stacked_experts(state: dict[str, torch.Tensor], n: int, folder: Path) -> dict[str, torch.Tensor]:
    """``state`` with every layer's ``mlp.experts.E.*_proj.weight`` (one tensor per expert, as checkpoints hold
    them: LLaDA-MoE, SDAR-MoE, LLaDA2) stacked by :func:`stacked_experts`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in state.items():
        m = LAYER_RE.match(name)
        e = EXPERT_RE.match(m.group(2)) if m is not None else None
        if e is None:
            out[name] = t
        else:
            experts.setdefault(int(m.group(1)), {})[(int(e.group(1)), e.group(2))] = t
    for i, parts in sorted(experts.items()):
        out.update(stacked_experts(parts, n, f"model.layers.{i}.mlp.", folder))
    return out


# -- the model -----------------------------------------------------------------------------------------------
def build(config, state: dict[str, torch.Tensor], dtype, folder: Path, title: str):
    """The transformers model of ``config`` holding ``state`` (every weight checked against the class's: names and
    shapes), in ``dtype``; ``title``: the family's, for the messages."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "sdpa"
    with torch.device("meta"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")  # a width-0 shared MLP
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    want = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in want if k not in state and not (tied and k == "lm_head.weight")]
    unexpected = [k for k in state if k not in want]
    if missing or unexpected:
        what = (
            f"lacks {len(missing)} weight(s), e.g. '{missing[0]}'"
            if missing
            else f"has {len(unexpected)} weight(s) the {title} layout does not, e.g. '{unexpected[0]}'"
        )
        raise DLMError(
            f"'{folder}' {what}; the weights do not match its config.json (a different layout or a truncated download)"
        )
    for k, t in want.items():
        if k in state and tuple(state[k].shape) != tuple(t.shape):
            raise DLMError(
                f"'{folder}': weight '{k}' has shape {tuple(state[k].shape)}, config.json says "
                f"{tuple(t.shape)}; fix the sizes in config.json"
            )
    fp32 = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())  # e.g. a router's weights and bias
    model.load_state_dict(
        {k: v.to(torch.float32 if any(n in k for n in fp32) else dtype) for k, v in state.items()},
        strict=False,
        assign=True,
    )
    if tied:
        model.tie_weights()
    # non-persistent buffers (rotary frequencies) were made on the meta device: build them again
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, type(module)(config=config))
    return model


def tokenizer(folder: Path):
    """The folder's tokenizer without its remote code (config.json's auto_map names classes dlm never runs)."""
    import warnings

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many types; name the folder
        raise DLMError(
            f"could not load the tokenizer of '{folder}' without remote code: {e}; a tokenizer.json "
            f"(or a tokenizer_class transformers knows in tokenizer_config.json) is needed"
        ) from e
    finally:
        hf_logging.set_verbosity(level)
