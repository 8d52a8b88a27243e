"""LLaDA2.0 / 2.1 (mini and flash): block diffusion on a Bailing-style mixture of experts, loaded as transformers'
GLM-4-MoE (the same computation: QK-norm before a partial rotary embedding, sigmoid routing with a selection-only
expert bias, group-limited top-k, renormalised and scaled weights, shared experts, dense first layers) under
other names: the fused ``query_key_value`` is split, the experts stacked, and ``dlm export --format llada2``
writes them back. No shift, block-causal, block 32 unless config.json gives ``block_size``, mask id 156895;
``--decode block`` runs LLaDA2's threshold sampler (0.95), 2.1's editing with ``--editing-threshold``."""

from __future__ import annotations

from pathlib import Path

import torch

from dlm.errors import DLMError
from dlm.model.families.base import LAYER_RE, Family, moe_sizes, names_of, need, with_stacked_experts

LLADA2_BLOCK = 32  # the block length LLaDA2.0 / 2.1 are trained and sampled with (their config.json has none)
LLADA2_NAMES = ("llada2_moe", "llada21_moe", "LLaDA2MoeModelLM")  # 2.0 and 2.1 share the first (llada21: dllm's)


def llada2_config(fields: dict, path: Path):
    """LLaDA2's Bailing-style MoE as transformers' GLM-4-MoE: the same computation (QK-norm before a partial rotary
    embedding, sigmoid routing with a selection-only expert bias, group-limited top-k, renormalised and scaled
    weights, shared experts, dense first layers) under other names (see :func:`_llada2_state`)."""
    from transformers import Glm4MoeConfig

    hidden, layers, heads, vocab, experts, top_k, moe_ffn = moe_sizes(fields, path, "moe_intermediate_size")
    kv = fields.get("num_key_value_heads") or heads  # 0 means as many as the attention heads (LLaDA2's class)
    head_dim = fields.get("head_dim") or hidden // heads
    dense = int(fields.get("first_k_dense_replace") or 0)
    ffn = need(fields, "intermediate_size", path, "the dense layers' width") if dense else moe_ffn
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


# -- weights: LLaDA2's names <-> GLM-4-MoE's ---------------------------------------------------------------
_LLADA2_PART = {
    "attention.query_layernorm.weight": "self_attn.q_norm.weight",
    "attention.key_layernorm.weight": "self_attn.k_norm.weight",
    "attention.dense.weight": "self_attn.o_proj.weight",
    "mlp.gate.expert_bias": "mlp.gate.e_score_correction_bias",
}

_LLADA2_PART_INVERSE = {v: k for k, v in _LLADA2_PART.items()}


def glm4_moe_to_llada2(name: str) -> str | None:
    """LLaDA2's name of a GLM-4-MoE weight that :func:`_llada2_state` renames (the inverse of ``_LLADA2_PART``),
    None for the others (q/k/v, fused; experts, stacked; the rest, named alike)."""
    m = LAYER_RE.match(name)
    if m is None or m.group(2) not in _LLADA2_PART_INVERSE:
        return None
    return f"model.layers.{m.group(1)}.{_LLADA2_PART_INVERSE[m.group(2)]}"


def rename(state: dict[str, torch.Tensor], folder: Path, config) -> dict[str, torch.Tensor]:
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
        m = LAYER_RE.match(name)
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
    out = with_stacked_experts(out, n, folder)
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


FAMILY = Family(
    name="llada2",
    title="LLaDA2",
    objective="block",
    shift=False,
    attention="block",
    recognise=lambda fields: any(n in LLADA2_NAMES for n in names_of(fields)),
    mask_id=156895,
    config=llada2_config,
    rename=rename,
    block_keys=("block_size",),
    default_block=LLADA2_BLOCK,
    # LLaDA2MoeModelLM.generate's threshold, its rule (SDAR's dynamic remasking; the quotas split the block's length,
    # a pass commits at most the masks left) and its cap of a block's passes at the answer's length
    samplers={
        "block": {
            "threshold": 0.95,
            "remasking": "low_confidence_dynamic",
            "quota_overflow": "clip",
            "steps_cap": "new_tokens",
        }
    },
    export=("llada2", "dlm.model.export:to_llada2"),
)
