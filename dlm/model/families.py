"""Published diffusion LMs (LLaDA, Dream, SDAR, I-DLM, Fast-dLLM v2, LLaDA2, LLaDA-MoE) loaded without remote code.

Each family's folder is recognised by its ``config.json`` (``model_type`` / ``architectures``), rebuilt as the
transformers class with the same computation (Llama, Qwen2, Qwen3, GLM-4-MoE, Qwen3-MoE) with the weights renamed
on load, and returned as a :class:`~dlm.model.convert.DiffusionLM` whose config carries the dlm fields the rest of
dlm reads (SDAR-MoE is ``sdar`` on Qwen3-MoE):

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
==============  =============  =========  =======  ==========================  =================  ===========

(``mask_token_id`` from config.json wins over the default.) Two fields more are recorded: ``dlm_family`` (which
layout it came from: the default of ``dlm export``) and ``dlm_attention`` (``bidirectional`` / ``block`` /
``causal``): a :class:`DiffusionLM` called without a 4-D mask applies that attention itself, so
``model(input_ids).logits`` are the family's logits. Saved with ``save_pretrained`` the model is a dlm folder
(transformers layout plus these fields) that loads the same way. See docs/models.md.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from dlm.errors import DLMError
from dlm.model.diffusion_gemma import is_diffusion_gemma

FAMILIES = ("llada", "dream", "sdar", "idlm", "fast_dllm_v2", "llada2", "llada_moe", "diffusion_gemma")
MASK_IDS = {
    "llada": 126336,
    "dream": 151666,
    "sdar": 151669,
    "idlm": 151669,
    "fast_dllm_v2": 151665,
    "llada2": 156895,
    "llada_moe": 156895,  # LLaDA-MoE's model card samples with this id; its config.json has none
}
OBJECTIVE = {
    "llada": "mdm",
    "dream": "mdm",
    "sdar": "block",
    "idlm": "idlm",
    "fast_dllm_v2": "block",
    "llada2": "block",
    "llada_moe": "mdm",
    "diffusion_gemma": "renoise",
}
SHIFT = {
    "llada": False,
    "dream": True,
    "sdar": False,
    "idlm": True,
    "fast_dllm_v2": True,
    "llada2": False,
    "llada_moe": False,
    "diffusion_gemma": False,
}
ATTENTION = {
    "llada": "bidirectional",
    "dream": "bidirectional",
    "sdar": "block",
    "idlm": "causal",
    "fast_dllm_v2": "block",
    "llada2": "block",
    "llada_moe": "bidirectional",
    "diffusion_gemma": "renoise",  # causal context, bidirectional canvas (dlm.model.diffusion_gemma)
}
TITLE = {
    "llada": "LLaDA",
    "dream": "Dream",
    "sdar": "SDAR",
    "idlm": "I-DLM (SDAR format)",
    "fast_dllm_v2": "Fast-dLLM v2",
    "llada2": "LLaDA2",
    "llada_moe": "LLaDA-MoE",
    "diffusion_gemma": "DiffusionGemma",
}
IDLM_BLOCK_SIZES = (1, 2, 3)  # the I-DLM release's training block sizes (stride N = b + 1)
LLADA2_BLOCK = 32  # the block length LLaDA2.0 / 2.1 are trained and sampled with (their config.json has none)
LLADA2_NAMES = ("llada2_moe", "llada21_moe", "LLaDA2MoeModelLM")  # 2.0 and 2.1 share the first (llada21: dllm's)
# LLaDA-MoE's config.json says model_type "llada" like the dense LLaDA: its architecture tells them apart
LLADA_MOE_NAMES = ("LLaDAMoEModelLM", "LLaDAMoEModel", "lladamoe", "llada_moe")
SDAR_MOE_NAMES = ("SDARMoeForCausalLM", "sdar_moe")  # SDAR-30B-A3B: Qwen3-30B-A3B's mixture of experts

# decoder settings of a family's own sampler where dlm's defaults differ (what the caller gives wins): LLaDA2's
# LLaDA2MoeModelLM.generate threshold; SDAR's generate.py threshold (its function's default and its CLI's)
# Dream's diffusion_generate filters to the top 50 tokens unless its caller passes top_k=None (transformers' global
# default, taken from the model config rather than the folder's generation_config.json)
SAMPLER_DEFAULTS = {
    "llada2": {"block": {"threshold": 0.95}},
    "sdar": {"block": {"threshold": 0.85, "quota_overflow": "rewrite"}},
    "dream": {"mdm": {"dream_top_k": 50}},
}


def sampler_defaults(config, decoder: str) -> dict[str, Any]:
    """The settings :data:`SAMPLER_DEFAULTS` gives ``decoder`` on a model of this config's family ({} for others),
    and those the checkpoint sets itself (``dlm_sampler``: DiffusionGemma's generation_config.json)."""
    out = dict(SAMPLER_DEFAULTS.get(getattr(config, "dlm_family", None) or "", {}).get(decoder, {}))
    own = getattr(config, "dlm_sampler", None)
    if isinstance(own, dict):
        out.update(own.get(decoder, {}))
    return out


# config.json keys of the published files that are remote-code settings with no meaning here
_DROP = {
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


def family_of(fields: dict) -> str | None:
    """The family of a folder's config.json fields, None for anything else (plain models, dlm folders)."""
    if not isinstance(fields, dict) or "dlm_objective" in fields:
        return None
    mtype = fields.get("model_type")
    archs = fields.get("architectures") or []
    if not isinstance(archs, list):
        archs = [archs]
    names = [n for n in [mtype, *archs] if isinstance(n, str)]
    if is_diffusion_gemma(fields):
        return "diffusion_gemma"
    if any(n in LLADA_MOE_NAMES for n in names):
        return "llada_moe"
    if mtype == "llada" or "LLaDAModelLM" in archs:
        return "llada"
    if any(n in LLADA2_NAMES for n in names):
        return "llada2"
    if mtype == "Dream" or "DreamModel" in archs:
        return "dream"
    if mtype == "Fast_dLLM_Qwen" or "Fast_dLLM_QwenForCausalLM" in archs:
        return "fast_dllm_v2"
    if mtype == "sdar" or "SDARForCausalLM" in archs or any(n in SDAR_MOE_NAMES for n in names):
        causal = fields.get("use_regular_causal")
        if causal is None:  # absent in the I-DLM release's files: its block sizes tell it from SDAR (4 and up)
            return "idlm" if fields.get("block_size") in IDLM_BLOCK_SIZES else "sdar"
        return "idlm" if causal else "sdar"
    return None


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


def refuse_remote_code(folder: str | Path, fields: dict) -> None:
    """A folder whose model only its own Python code defines (config.json's ``auto_map`` for a ``model_type``
    transformers does not know), and which is not a family dlm maps itself, is refused by name: dlm runs no remote
    code. (A stale ``auto_map`` beside a type transformers defines is harmless and passes.)"""
    auto_map = fields.get("auto_map")
    if not auto_map or family_of(fields) is not None or fields.get("dlm_family") in FAMILIES:
        return
    from transformers import CONFIG_MAPPING

    mtype = fields.get("model_type")
    if isinstance(mtype, str) and mtype in CONFIG_MAPPING:
        return
    families = ", ".join(TITLE[f] for f in FAMILIES)
    raise DLMError(
        f"'{folder}' needs its own Python code (config.json auto_map, model_type {mtype!r}, which transformers does "
        f"not define); dlm runs no remote code. It maps these families itself: {families} - this model is not "
        f"one of them"
    )


def folder_objective(folder: str | Path) -> str | None:
    """The objective of a DLM folder (a dlm folder's ``dlm_objective``, a published family's), None for anything
    else (an AR model, an alias, a path that is not there: the loader names those)."""
    fields = read_fields(folder)  # {} where there is no config.json; a damaged one is named, as loading names it
    family = family_of(fields)
    own = fields.get("dlm_objective") or (OBJECTIVE[family] if family is not None else None)
    return own if isinstance(own, str) else None


def default_decoder(model: str, default: str) -> str:
    """A command's decoder where its caller gave no ``--decode``: ``default``, unless the model is one that only its
    own decoder runs (a renoising model: ``renoise``). ``model``: a folder (or a name that is not one: ``default``)."""
    return "renoise" if folder_objective(model) == "renoise" else default


def is_published(folder: str | Path) -> bool:
    """Whether ``folder`` holds a checkpoint of one of FAMILIES (raises for an unsupported known one)."""
    return family_of(read_fields(folder)) is not None


# -- config.json -> transformers config ----------------------------------------------------------------------
def _need(fields: dict, key: str, path: Path, what: str, kind=int):
    value = fields.get(key)
    if value is None:
        raise DLMError(f"'{path}' has no '{key}' ({what}); add it as in the published config.json")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise DLMError(f"'{path}': '{key}' must be a positive integer, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise DLMError(f"'{path}': '{key}' must be a number, got {value!r}")
    return value


def _expect(fields: dict, key: str, want, path: Path, default=None) -> None:
    value = fields.get(key, default)
    if value != want:
        raise DLMError(
            f"'{path}': '{key}' is {value!r}; dlm loads the LLaDA layout with {key}={want!r} only "
            f"(the published checkpoints' value); set it or convert the checkpoint"
        )


def _llada_config(fields: dict, path: Path):
    from transformers import LlamaConfig

    d = _need(fields, "d_model", path, "the hidden size")
    layers = _need(fields, "n_layers", path, "the number of blocks")
    heads = _need(fields, "n_heads", path, "the number of attention heads")
    for key, want, default in (
        ("block_type", "llama", None),
        ("rope", True, None),
        ("alibi", False, False),
        ("layer_norm_type", "rms", None),
        ("activation_type", "silu", None),
        ("include_bias", False, None),
        ("include_qkv_bias", False, False),
        ("block_group_size", 1, 1),
        ("scale_logits", False, False),
        ("attention_layer_norm", False, False),
        ("input_emb_norm", False, False),
    ):
        _expect(fields, key, want, path, default)
    if fields.get("bias_for_layer_norm"):
        raise DLMError(f"'{path}': 'bias_for_layer_norm' is true; dlm loads the LLaDA layout without norm biases")
    if d % heads:
        raise DLMError(f"'{path}': 'd_model' {d} is not a multiple of 'n_heads' {heads}")
    kv = fields.get("n_kv_heads") or (1 if fields.get("multi_query_attention") else heads)
    mlp = fields.get("mlp_hidden_size") or int(fields.get("mlp_ratio", 4)) * d
    vocab = fields.get("embedding_size") or _need(fields, "vocab_size", path, "the vocabulary size")
    return LlamaConfig(
        hidden_size=d,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=d // heads,
        vocab_size=vocab,
        hidden_act="silu",
        rms_norm_eps=float(fields.get("rms_norm_eps", 1e-5)),
        rope_theta=float(fields.get("rope_theta", 10000.0)),
        max_position_embeddings=int(fields.get("max_sequence_length") or 4096),
        tie_word_embeddings=bool(fields.get("weight_tying", False)),
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=fields.get("bos_token_id"),
        eos_token_id=fields.get("eos_token_id"),
        pad_token_id=fields.get("pad_token_id"),
    )


def _moe_sizes(fields: dict, path: Path, expert_width: str) -> tuple[int, ...]:
    """A mixture of experts' sizes from config.json (each named in the error where it is missing): hidden size,
    layers, attention heads, vocabulary, experts, experts per token, and an expert's width (key ``expert_width``)."""
    return tuple(
        _need(fields, key, path, what)
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


def _llada2_config(fields: dict, path: Path):
    """LLaDA2's Bailing-style MoE as transformers' GLM-4-MoE: the same computation (QK-norm before a partial rotary
    embedding, sigmoid routing with a selection-only expert bias, group-limited top-k, renormalised and scaled
    weights, shared experts, dense first layers) under other names (see :func:`_llada2_state`)."""
    from transformers import Glm4MoeConfig

    hidden, layers, heads, vocab, experts, top_k, moe_ffn = _moe_sizes(fields, path, "moe_intermediate_size")
    kv = fields.get("num_key_value_heads") or heads  # 0 means as many as the attention heads (LLaDA2's class)
    head_dim = fields.get("head_dim") or hidden // heads
    dense = int(fields.get("first_k_dense_replace") or 0)
    ffn = _need(fields, "intermediate_size", path, "the dense layers' width") if dense else moe_ffn
    for key, what in (
        ("use_sliding_window", "sliding-window attention"),
        ("use_linear_attention", "linear attention"),
        ("norm_head", "a normalised output head"),
    ):
        if fields.get(key):
            raise DLMError(f"'{path}': '{key}' is true; dlm loads the LLaDA2 layout without {what} (set it false)")
    if fields.get("score_function", "sigmoid") != "sigmoid":
        raise DLMError(
            f"'{path}': 'score_function' is {fields['score_function']!r}; dlm loads LLaDA2's sigmoid routing"
        )
    scaling = fields.get("rope_scaling")
    if scaling and (not isinstance(scaling, dict) or (scaling.get("rope_type") or scaling.get("type")) != "default"):
        raise DLMError(f"'{path}': 'rope_scaling' {scaling!r} is not loaded by dlm for LLaDA2 (use null)")
    partial = fields.get("partial_rotary_factor")
    if partial is None and fields.get("rotary_dim"):
        partial = fields["rotary_dim"] / head_dim
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise DLMError(
            f"'{path}': 'partial_rotary_factor' is {partial!r}; give the share of each head that is rotated "
            f"(0.5 in the published config.json)"
        )
    groups, top_groups = int(fields.get("n_group") or 1), int(fields.get("topk_group") or 1)
    if experts % groups or not 1 <= top_groups <= groups:
        raise DLMError(
            f"'{path}': 'num_experts' {experts} in 'n_group' {groups} groups, 'topk_group' {top_groups}: the "
            f"experts must split evenly and 1 <= topk_group <= n_group"
        )
    return Glm4MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_act=fields.get("hidden_act", "silu"),
        max_position_embeddings=int(fields.get("max_position_embeddings") or 32768),
        rms_norm_eps=float(fields.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(fields.get("rope_theta", 10000.0)),
            "partial_rotary_factor": float(partial),
        },
        attention_bias=bool(fields.get("use_qkv_bias", False)),
        use_qk_norm=bool(fields.get("use_qk_norm", True)),
        moe_intermediate_size=moe_ffn,
        num_experts_per_tok=top_k,
        n_shared_experts=int(fields.get("num_shared_experts") or 0),
        n_routed_experts=experts,
        routed_scaling_factor=float(fields.get("routed_scaling_factor", 1.0)),
        n_group=groups,
        topk_group=top_groups,
        first_k_dense_replace=dense,
        norm_topk_prob=top_k > 1,  # LLaDA2 renormalises the chosen weights whenever there is more than one
        num_mtp_layers=0,
        bos_token_id=fields.get("bos_token_id"),
        eos_token_id=fields.get("eos_token_id"),
        pad_token_id=fields.get("pad_token_id"),
    )


def _llada_moe_config(fields: dict, path: Path):
    """LLaDA-MoE (an OLMoE-like layout) as transformers' Qwen3-MoE: per-head QK-norm before a full rotary
    embedding, a softmax router whose top-k probabilities weight the experts as they are (not renormalised), dense
    layers where ``moe_layer_freq`` says 0."""
    from transformers import Qwen3MoeConfig

    hidden, layers, heads, vocab, experts, top_k, expert_ffn = _moe_sizes(fields, path, "expert_intermediate_size")
    freq = fields.get("moe_layer_freq") or [1] * layers
    if not isinstance(freq, list) or len(freq) != layers:
        raise DLMError(f"'{path}': 'moe_layer_freq' must list one 0/1 per layer ({layers}), got {freq!r}")
    dense = [i for i, f in enumerate(freq) if f == 0]
    ffn = _need(fields, "dense_intermediate_size", path, "the dense layers' width") if dense else expert_ffn
    for key, what in (
        ("shared_expert_intermediate_size", "shared experts"),
        ("moe_router_enable_expert_bias", "a router expert bias"),
        ("clip_qkv", "clipped q/k/v"),
    ):  # (router_num_group / router_topk_group: its configuration class writes -2, none of its code reads them)
        if fields.get(key):  # null, 0 or false: not used
            raise DLMError(f"'{path}': '{key}' is {fields[key]!r}; dlm loads the LLaDA-MoE layout without {what}")
    if fields.get("moe_router_score_function", "softmax") != "softmax":
        raise DLMError(f"'{path}': 'moe_router_score_function' must be softmax (LLaDA-MoE's router)")
    if not fields.get("qk_layernorm", True):
        raise DLMError(f"'{path}': 'qk_layernorm' is false; dlm loads the LLaDA-MoE layout with its q/k norms")
    if float(fields.get("partial_rotary_factor", 1.0)) != 1.0 or fields.get("rope_scaling"):
        raise DLMError(
            f"'{path}': dlm loads LLaDA-MoE with a full, unscaled rotary embedding (partial_rotary_factor 1)"
        )
    if float(fields.get("routed_scaling_factor", 1) or 1) != 1.0:
        raise DLMError(
            f"'{path}': 'routed_scaling_factor' must be 1 (LLaDA-MoE's router weights are its probabilities)"
        )
    return Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=fields.get("num_key_value_heads") or heads,
        head_dim=hidden // heads,
        hidden_act=fields.get("hidden_act", "silu"),
        max_position_embeddings=int(fields.get("max_position_embeddings") or 8192),
        rms_norm_eps=float(fields.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
        rope_parameters={"rope_type": "default", "rope_theta": float(fields.get("rope_theta", 50000.0))},
        attention_bias=bool(fields.get("attention_bias", False)),
        moe_intermediate_size=expert_ffn,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=False,  # LLaDA-MoE weights the chosen experts by their softmax probabilities as they are
        decoder_sparse_step=1,
        mlp_only_layers=dense,
        use_sliding_window=False,
        bos_token_id=fields.get("bos_token_id"),
        eos_token_id=fields.get("eos_token_id"),
        pad_token_id=fields.get("pad_token_id"),
    )


def _qwen_config(fields: dict, path: Path, cls):
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        _need(fields, key, path, "a size of the model")
    kw = {k: v for k, v in fields.items() if k not in _DROP}
    try:
        return cls(**kw)
    except Exception as e:  # noqa: BLE001 - the config class names the bad field
        raise DLMError(f"'{path}' does not make a {cls.__name__}: {e}") from e


def _hf_config(family: str, fields: dict, path: Path):
    from transformers import Qwen2Config, Qwen3Config

    if family == "llada":
        return _llada_config(fields, path)
    if family == "llada2":
        return _llada2_config(fields, path)
    if family == "llada_moe":
        return _llada_moe_config(fields, path)
    if family in ("dream", "fast_dllm_v2"):
        return _qwen_config(fields, path, Qwen2Config)
    if "head_dim" not in fields and "hidden_size" in fields and fields.get("num_attention_heads"):
        fields = dict(fields, head_dim=fields["hidden_size"] // fields["num_attention_heads"])
    names = [fields.get("model_type"), *(fields.get("architectures") or [])]
    if any(n in SDAR_MOE_NAMES for n in names):  # SDAR-MoE: Qwen3-MoE's computation and weight names
        from transformers import Qwen3MoeConfig

        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if key != "num_experts" or "num_local_experts" not in fields:  # (transformers' name for it)
                _need(fields, key, path, "a size of the mixture of experts")

        return _qwen_config(fields, path, Qwen3MoeConfig)
    return _qwen_config(fields, path, Qwen3Config)


def _block_size(family: str, fields: dict, path: Path, block_size: int | None) -> int | None:
    if family in ("llada", "dream", "llada_moe"):
        return None
    key = "bd_size" if family == "fast_dllm_v2" and "bd_size" in fields else "block_size"
    if block_size is not None and fields.get(key) is not None and block_size != fields[key]:
        raise DLMError(
            f"'{path}' says '{key}' {fields[key]}, but block size {block_size} was asked (--block-size); "
            f"drop --block-size (a published model decodes with the block size it was trained with)"
        )
    value = block_size if block_size is not None else fields.get(key)
    if value is None and family == "llada2":
        value = LLADA2_BLOCK
    if value is None:
        raise DLMError(
            f"'{path}' has no 'block_size' (the published {TITLE[family]} config.json lacks it): add "
            f'"block_size": 4 (the model\'s block length) to it, or '
            f"write a dlm folder with: dlm convert --model {path.parent} --objective "
            f"{OBJECTIVE[family]} --block-size 4 --output DIR"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DLMError(f"'{path}': '{key}' must be a positive integer, got {value!r}")
    return value


def _mask_id(family: str, fields: dict, path: Path, vocab: int) -> int:
    value = fields.get("mask_token_id")
    if value is None:
        value = MASK_IDS[family]
        where = f"the {TITLE[family]} default mask id {value}"
    else:
        where = f"'mask_token_id' {value}"
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise DLMError(
            f"'{path}': {where} is not a row of the {vocab}-token embedding; set \"mask_token_id\" in "
            f"config.json to the id of the tokenizer's mask token"
        )
    return value


# -- weights -------------------------------------------------------------------------------------------------
_LLADA_BLOCK = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_LLADA_TOP = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}
_LLADA_RE = re.compile(r"^model\.transformer\.blocks\.(\d+)\.(\w+)\.weight$")


def llada_to_llama(name: str) -> str | None:
    """The Llama name of a LLaDA weight (None: not a LLaDA weight name)."""
    if name in _LLADA_TOP:
        return _LLADA_TOP[name]
    m = _LLADA_RE.match(name)
    if m and m.group(2) in _LLADA_BLOCK:
        return f"model.layers.{m.group(1)}.{_LLADA_BLOCK[m.group(2)]}.weight"
    return None


def llama_to_llada(name: str) -> str:
    """The LLaDA name of a Llama weight (the inverse of :func:`llada_to_llama`)."""
    inverse_top = {v: k for k, v in _LLADA_TOP.items()}
    if name in inverse_top:
        return inverse_top[name]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.weight$", name)
    inverse = {v: k for k, v in _LLADA_BLOCK.items()}
    if m and m.group(2) in inverse:
        return f"model.transformer.blocks.{m.group(1)}.{inverse[m.group(2)]}.weight"
    raise DLMError(
        f"weight '{name}' has no place in the LLaDA layout (biases and extra modules are not part of "
        f"it); export to another --format"
    )


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


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LLADA2_PART = {
    "attention.query_layernorm.weight": "self_attn.q_norm.weight",
    "attention.key_layernorm.weight": "self_attn.k_norm.weight",
    "attention.dense.weight": "self_attn.o_proj.weight",
    "mlp.gate.expert_bias": "mlp.gate.e_score_correction_bias",
}
_LLADA2_PART_INVERSE = {v: k for k, v in _LLADA2_PART.items()}
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def _stacked_experts(parts: dict[tuple[int, str], torch.Tensor], n: int, prefix: str, folder: Path) -> dict:
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
    """The inverse of :func:`_stacked_experts` for one of a layer's :data:`STACKED_EXPERTS` tensors: the one tensor
    per expert checkpoints hold (``mlp.experts.E.{gate,up,down}_proj.weight``; for ``dlm export``)."""
    base = name.rsplit(".", 1)[0] + "."
    if name.endswith("gate_up_proj"):
        out = {}
        for e, (gate, up) in enumerate(x.chunk(2, dim=0) for x in t):
            out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
        return out
    return {f"{base}{e}.down_proj.weight": down for e, down in enumerate(t)}


def glm4_moe_to_llada2(name: str) -> str | None:
    """LLaDA2's name of a GLM-4-MoE weight that :func:`_llada2_state` renames (the inverse of ``_LLADA2_PART``),
    None for the others (q/k/v, fused; experts, stacked; the rest, named alike)."""
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) not in _LLADA2_PART_INVERSE:
        return None
    return f"model.layers.{m.group(1)}.{_LLADA2_PART_INVERSE[m.group(2)]}"


def _with_stacked_experts(state: dict[str, torch.Tensor], n: int, folder: Path) -> dict[str, torch.Tensor]:
    """``state`` with every layer's ``mlp.experts.E.*_proj.weight`` (one tensor per expert, as checkpoints hold
    them: LLaDA-MoE, SDAR-MoE, LLaDA2) stacked by :func:`_stacked_experts`."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in state.items():
        m = _LAYER_RE.match(name)
        e = _EXPERT_RE.match(m.group(2)) if m is not None else None
        if e is None:
            out[name] = t
        else:
            experts.setdefault(int(m.group(1)), {})[(int(e.group(1)), e.group(2))] = t
    for i, parts in sorted(experts.items()):
        out.update(_stacked_experts(parts, n, f"model.layers.{i}.mlp.", folder))
    return out


def _llada2_state(state: dict[str, torch.Tensor], config, folder: Path) -> dict[str, torch.Tensor]:
    """LLaDA2's weights under GLM-4-MoE's names: the fused ``query_key_value`` split into q, k, v (rows in that
    order), ``dense`` as ``o_proj``, the router's ``expert_bias`` as ``e_score_correction_bias`` (zeros where the
    router has none) and each layer's experts stacked into the ``[E, 2F, H]`` gate-and-up and ``[E, H, F]`` down
    tensors transformers keeps them in."""
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name == "model.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t
            continue
        m = _LAYER_RE.match(name)
        if m is None:
            out[name] = t  # model.norm, lm_head; anything else is named by the layout check
            continue
        p, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if rest in ("attention.query_key_value.weight", "attention.query_key_value.bias"):
            kind = rest.rsplit(".", 1)[1]
            if t.shape[0] != (heads + 2 * kv) * hd:
                raise DLMError(
                    f"'{folder}': weight '{name}' has {t.shape[0]} rows, config.json says (num_attention_heads "
                    f"{heads} + 2 x num_key_value_heads {kv}) x head_dim {hd}; fix the sizes in config.json"
                )
            q, k, v = t.split([heads * hd, kv * hd, kv * hd], dim=0)
            out.update({f"{p}self_attn.{n}_proj.{kind}": x for n, x in zip("qkv", (q, k, v))})
        elif rest == "attention.dense.bias":
            raise DLMError(
                f"'{folder}': weight '{name}': dlm loads the LLaDA2 layout without a bias on the attention's output "
                f"projection (use_bias false, as in the published checkpoints)"
            )
        elif rest in _LLADA2_PART:
            out[p + _LLADA2_PART[rest]] = t
        else:
            out[name] = t
    n = config.n_routed_experts
    out = _with_stacked_experts(out, n, folder)
    for p in [k.removesuffix("experts.down_proj") for k in out if k.endswith("mlp.experts.down_proj")]:
        if p + "gate.e_score_correction_bias" not in out:  # moe_router_enable_expert_bias false: no bias
            out[p + "gate.e_score_correction_bias"] = torch.zeros(n)
        if not config.n_shared_experts:  # no shared experts: GLM-4-MoE's shared MLP of width 0 adds nothing
            h = config.hidden_size
            out.update(
                {
                    p + "shared_experts.gate_proj.weight": torch.zeros(0, h),
                    p + "shared_experts.up_proj.weight": torch.zeros(0, h),
                    p + "shared_experts.down_proj.weight": torch.zeros(h, 0),
                }
            )
    return out


def _rename(family: str, state: dict[str, torch.Tensor], folder: Path, config=None) -> dict[str, torch.Tensor]:
    if family == "llada2":
        return _llada2_state(state, config, folder)
    if getattr(config, "model_type", None) == "qwen3_moe":  # LLaDA-MoE, SDAR-MoE
        return _with_stacked_experts(state, config.num_experts, folder)
    if family != "llada":
        return state
    out = {}
    for name, t in state.items():
        new = llada_to_llama(name)
        if new is None:
            raise DLMError(
                f"'{folder}': weight '{name}' is not part of the LLaDA layout dlm loads (block_type "
                f"'llama': model.transformer.{{wte, blocks.N.{{attn_norm, q_proj, k_proj, v_proj, "
                f"attn_out, ff_norm, ff_proj, up_proj, ff_out}}, ln_f, ff_out}})"
            )
        out[new] = t
    return out


def _build(config, state: dict[str, torch.Tensor], dtype, folder: Path, family: str):
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
            else f"has {len(unexpected)} weight(s) the {TITLE[family]} layout does not, e.g. '{unexpected[0]}'"
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


def _tokenizer(folder: Path):
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


def load_published(folder: str | Path, dtype=None, device=None, block_size: int | None = None):
    """A :class:`DiffusionLM` from a published checkpoint folder (see the module docstring)."""
    from dlm.model.convert import DiffusionLM, DLMSpec

    folder = Path(folder)
    path = folder / "config.json"
    fields = read_fields(folder)
    family = family_of(fields)
    if family == "diffusion_gemma":  # transformers' own class, loaded as it is
        from dlm.model import diffusion_gemma

        return diffusion_gemma.load(folder, dtype=dtype, device=device)
    if family is None:
        raise DLMError(
            f"'{path}' is not a checkpoint of {', '.join(TITLE.values())} (model_type {fields.get('model_type')!r})"
        )
    dtype = dtype or torch.float32
    config = _hf_config(family, fields, path)
    b = _block_size(family, fields, path, block_size)
    mask_id = _mask_id(family, fields, path, config.vocab_size)
    model = _build(config, _rename(family, read_weights(folder), folder, config), dtype, folder, family)
    tokenizer = _tokenizer(folder)
    config.dlm_family = family
    config.dlm_attention = ATTENTION[family]
    spec = DLMSpec(objective=OBJECTIVE[family], mask_token_id=mask_id, shift=SHIFT[family], block_size=b)
    dlm = DiffusionLM(model, tokenizer, spec)
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


# -- the I-DLM release's LoRA adapter: a PEFT LoRA folder, applied at mask positions only ----------------------
ADAPTER_CONFIG = "adapter_config.json"
# adapter_config.json settings that change what a LoRA computes; dlm's gated adapters are plain LoRA (B A x,
# scaled by alpha / r), so any of these set to something else is refused by name
_PLAIN_LORA = {
    "use_rslora": False,
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "target_parameters": None,
    "alpha_pattern": {},
    "rank_pattern": {},
    "use_qalora": False,
    "alora_invocation_tokens": None,
}


def adapter_folder_error(folder: Path) -> DLMError:
    base = None
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, AttributeError, OSError):
        pass
    return DLMError(
        f"'{folder}' is a LoRA adapter ({ADAPTER_CONFIG}), not a model (its base: {base or 'not named'}); "
        f"attach it to the I-DLM it was trained on with dlm.model.families.attach_gated_adapter("
        f"dlm.load_model(BASE), '{folder}') and save_pretrained() the result: a dlm folder every "
        f"command loads"
    )


def attach_gated_adapter(dlm, folder: str | Path):
    """Attach a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, as the I-DLM
    release's gated LoRA is published to be served: active at MASK positions only) to an I-DLM as dlm's gated
    LoRA: the adapters act only at mask positions, so the clean path (and greedy ISD) stays the base model's.
    Returns ``dlm``. The mask token's input embedding is the base model's row (the adapter carries none)."""
    from safetensors.torch import load_file

    from dlm.model.lora import LoraSettings, _attach_gated, get_gated

    folder = Path(folder)
    cfg_path = folder / ADAPTER_CONFIG
    if not cfg_path.is_file():
        raise DLMError(f"'{folder}' has no {ADAPTER_CONFIG}; give the folder of a PEFT LoRA adapter")
    if dlm.objective != "idlm":
        raise DLMError(
            f"gated LoRA adapters act at mask positions of an I-DLM; this is a '{dlm.objective}' model: "
            f"load the I-DLM base"
        )
    if get_gated(dlm) is not None:
        raise DLMError("this model has gated-LoRA adapters already")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise DLMError(f"'{cfg_path}' is not valid JSON ({e})") from e
    if cfg.get("peft_type") != "LORA":
        raise DLMError(f"'{cfg_path}': 'peft_type' is {cfg.get('peft_type')!r}; only LORA adapters are known")
    for key, plain in _PLAIN_LORA.items():
        value = cfg.get(key)
        if value not in (None, False, {}, [], "none") and value != plain:
            raise DLMError(
                f"'{cfg_path}': '{key}' is {value!r}; dlm attaches plain LoRA adapters only ({key}={plain!r})"
            )
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise DLMError(f"'{cfg_path}' needs an integer 'r' and a number 'lora_alpha' (got {r!r}, {alpha!r})")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise DLMError(f"'{weights}' is missing (dlm reads safetensors adapters only)")
    state = load_file(str(weights))
    hf = dlm.base_model_hf
    modules = dict(hf.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        m = re.match(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.default)?\.weight$", key)
        if m is None:
            raise DLMError(
                f"'{weights}': tensor '{key}' is not a LoRA A/B weight (embeddings, biases or other "
                f"trained modules are not part of a plain LoRA adapter)"
            )
        name = m.group(1)
        if name not in modules or not isinstance(modules[name], torch.nn.Linear):
            raise DLMError(
                f"'{weights}': '{name}' is not a linear layer of {type(hf).__name__}; the adapter is for "
                f"another base model"
            )
        pairs.setdefault(name, {})[m.group(2)] = t
    names = sorted(pairs)
    for name in names:
        if set(pairs[name]) != {"A", "B"}:
            raise DLMError(f"'{weights}': '{name}' lacks lora_{'B' if 'A' in pairs[name] else 'A'}")
        lin = modules[name]
        a, b = pairs[name]["A"], pairs[name]["B"]
        if tuple(a.shape) != (r, lin.in_features) or tuple(b.shape) != (lin.out_features, r):
            raise DLMError(
                f"'{weights}': '{name}' has LoRA shapes {tuple(a.shape)}, {tuple(b.shape)}; the base "
                f"layer needs ({r}, {lin.in_features}) and ({lin.out_features}, {r})"
            )
    settings = LoraSettings(r=r, alpha=alpha, dropout=0.0, target_modules=names, gated=True)
    _attach_gated(dlm, settings, names)
    with torch.no_grad():
        for name in names:
            adapter = dlm.gated_lora.adapters[name.replace(".", "__")]
            adapter.A.copy_(pairs[name]["A"])
            adapter.B.copy_(pairs[name]["B"])
    return dlm
