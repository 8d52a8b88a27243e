"""Dream (Dream 7B, d3LLM-Dream): masked diffusion on a Qwen2 body, weights as they are, with the logit shift
(logit i-1 scores position i). Bidirectional attention, mask id 151666; its sampler is ``--decode mdm --sampler
dream`` (the default here), whose hidden top-k of 50 is this family's sampler default."""

from __future__ import annotations

from pathlib import Path

from dlm.model.families.base import Family, names_of, qwen_config


def dream_config(fields: dict, path: Path):
    from transformers import Qwen2Config

    return qwen_config(fields, path, Qwen2Config)


FAMILY = Family(
    name="dream",
    title="Dream",
    objective="mdm",
    shift=True,
    attention="bidirectional",
    recognise=lambda fields: fields.get("model_type") == "Dream" or "DreamModel" in names_of(fields),
    mask_id=151666,
    config=dream_config,
    # Dream's diffusion_generate filters to the top 50 tokens unless its caller passes top_k=None (transformers'
    # global default, taken from the model config rather than the folder's generation_config.json)
    samplers={"mdm": {"sampler": "dream", "dream_top_k": 50}},
    export=("dream", "dlm.model.export:to_dream"),
)
