"""Fast-dLLM v2: block diffusion on a Qwen2 body with the logit shift, block-causal attention; its block size is
config.json's ``bd_size`` (mask id 151665). Decoded with ``--decode block`` (threshold commits)."""

from __future__ import annotations

from dlm.model.families.base import Family, names_of
from dlm.model.families.dream import dream_config

FAMILY = Family(
    name="fast_dllm_v2",
    title="Fast-dLLM v2",
    objective="block",
    shift=True,
    attention="block",
    recognise=lambda fields: (
        fields.get("model_type") == "Fast_dLLM_Qwen" or "Fast_dLLM_QwenForCausalLM" in names_of(fields)
    ),
    mask_id=151665,
    config=dream_config,  # Qwen2's computation, as Dream's
    block_keys=("bd_size", "block_size"),
)
