"""SDAR (block diffusion on Qwen3, SDAR-MoE on Qwen3-MoE) and the I-DLM release, which ships in SDAR's format.

Both say ``model_type`` ``sdar``: ``use_regular_causal`` tells an I-DLM (causal attention, logit shift, decoded by
ISD with stride block size + 1) from SDAR (block-causal attention, no shift, ``--decode block`` with SDAR's
remasking); where it is absent (the I-DLM release's files), the I-DLM release's block sizes (1, 2, 3) tell them
apart. Weights are Qwen3's as they are (SDAR-MoE's experts, one tensor each, are stacked as transformers keeps
them); ``block_size`` is required, mask id 151669. ``dlm export --format sdar`` writes either back.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dlm.model.families.base import Family, names_of, need, qwen_config, with_stacked_experts

IDLM_BLOCK_SIZES = (1, 2, 3)  # the I-DLM release's training block sizes (stride N = b + 1)
SDAR_MOE_NAMES = ("SDARMoeForCausalLM", "sdar_moe")  # SDAR-30B-A3B: Qwen3-30B-A3B's mixture of experts


def is_sdar(fields: dict) -> bool:
    names = names_of(fields)
    return fields.get("model_type") == "sdar" or "SDARForCausalLM" in names or any(n in SDAR_MOE_NAMES for n in names)


def is_idlm(fields: dict) -> bool:
    causal = fields.get("use_regular_causal")
    if causal is None:  # absent in the I-DLM release's files: its block sizes tell it from SDAR (4 and up)
        return fields.get("block_size") in IDLM_BLOCK_SIZES
    return bool(causal)


def sdar_config(fields: dict, path: Path):
    from transformers import Qwen3Config

    if "head_dim" not in fields and "hidden_size" in fields and fields.get("num_attention_heads"):
        fields = dict(fields, head_dim=fields["hidden_size"] // fields["num_attention_heads"])
    if any(n in SDAR_MOE_NAMES for n in names_of(fields)):  # SDAR-MoE: Qwen3-MoE's computation and weight names
        from transformers import Qwen3MoeConfig

        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if key != "num_experts" or "num_local_experts" not in fields:  # (transformers' name for it)
                need(fields, key, path, "a size of the mixture of experts")
        return qwen_config(fields, path, Qwen3MoeConfig)
    return qwen_config(fields, path, Qwen3Config)


def rename(state: dict[str, torch.Tensor], folder: Path, config=None) -> dict[str, torch.Tensor]:
    """SDAR-MoE's experts stacked; SDAR's and the I-DLM's weights are Qwen3's names already."""
    if getattr(config, "model_type", None) == "qwen3_moe":
        return with_stacked_experts(state, config.num_experts, folder)
    return state


SDAR = Family(
    name="sdar",
    title="SDAR",
    objective="block",
    shift=False,
    attention="block",
    recognise=lambda fields: is_sdar(fields) and not is_idlm(fields),
    mask_id=151669,
    config=sdar_config,
    rename=rename,
    block_keys=("block_size",),
    # SDAR's generate.py: its threshold (its function's default and its CLI's), its remasking, and its top-k over
    # the whole block when a pass's quota exceeds the masks left
    samplers={"block": {"threshold": 0.85, "quota_overflow": "rewrite", "remasking": "low_confidence_dynamic"}},
    export=("sdar", "dlm.model.export:to_sdar"),
)

IDLM = Family(
    name="idlm",
    title="I-DLM (SDAR format)",
    objective="idlm",
    shift=True,
    attention="causal",
    recognise=lambda fields: is_sdar(fields) and is_idlm(fields),
    mask_id=151669,
    config=sdar_config,
    rename=rename,
    block_keys=("block_size",),
    export=("sdar", "dlm.model.export:to_sdar"),
)
