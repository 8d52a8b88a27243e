"""LLaDA-MoE 7B-A1B: masked diffusion on an OLMoE-like mixture of experts, loaded as transformers' Qwen3-MoE
(per-head QK-norm before a full rotary embedding, a softmax router whose top-k probabilities weight the experts as
they are, dense layers where ``moe_layer_freq`` says 0); its experts are stacked on load. Its config.json says
``model_type`` ``llada`` like the dense LLaDA's: the architecture ``LLaDAMoEModelLM`` tells it apart. No shift,
bidirectional, mask id 156895 (its model card's; config.json has none); LLaDA's sampler."""

from __future__ import annotations

from pathlib import Path

import torch

from dlm.errors import DLMError
from dlm.model.families.base import Family, moe_sizes, names_of, need, with_stacked_experts

LLADA_MOE_NAMES = ("LLaDAMoEModelLM", "LLaDAMoEModel", "lladamoe", "llada_moe")


def is_llada_moe(fields: dict) -> bool:
    """LLaDA-MoE says model_type "llada" like the dense LLaDA: its architecture tells them apart."""
    return any(n in LLADA_MOE_NAMES for n in names_of(fields))


def llada_moe_config(fields: dict, path: Path):
    """LLaDA-MoE (an OLMoE-like layout) as transformers' Qwen3-MoE: per-head QK-norm before a full rotary
    embedding, a softmax router whose top-k probabilities weight the experts as they are (not renormalised), dense
    layers where ``moe_layer_freq`` says 0."""
    from transformers import Qwen3MoeConfig

    hidden, layers, heads, vocab, experts, top_k, expert_ffn = moe_sizes(fields, path, "expert_intermediate_size")
    freq = fields.get("moe_layer_freq") or [1] * layers
    if not isinstance(freq, list) or len(freq) != layers:
        raise DLMError(f"'{path}': 'moe_layer_freq' must list one 0/1 per layer ({layers}), got {freq!r}")
    dense = [i for i, f in enumerate(freq) if f == 0]
    ffn = need(fields, "dense_intermediate_size", path, "the dense layers' width") if dense else expert_ffn
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


def rename(state: dict[str, torch.Tensor], folder: Path, config) -> dict[str, torch.Tensor]:
    return with_stacked_experts(state, config.num_experts, folder)


FAMILY = Family(
    name="llada_moe",
    title="LLaDA-MoE",
    objective="mdm",
    shift=False,
    attention="bidirectional",
    recognise=is_llada_moe,
    mask_id=156895,
    config=llada_moe_config,
    rename=rename,
    samplers={"mdm": {"sampler": "llada"}},  # LLaDA's sampler, as its model card samples
)
