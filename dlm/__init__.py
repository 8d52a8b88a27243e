"""dlm: turn pretrained autoregressive language models into diffusion language models and run them.

The public API is imported lazily so that ``import dlm`` (and ``dlm --help``) stays fast:

- :func:`dlm.convert_ar_to_dlm` - any Hugging Face causal LM -> a DLM (mdm, block or idlm objective)
- :class:`dlm.AutoDLMForCausalLM` - load a saved DLM folder
- :func:`dlm.prepare_model_for_lora` - LoRA / gated LoRA through peft
- :func:`dlm.load_model` / :func:`dlm.load_tokenizer` - resolve aliases (``smollm2-135m``) or local folders
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "convert_ar_to_dlm": "dlm.model.convert",
    "AutoDLMForCausalLM": "dlm.model.convert",
    "DiffusionLM": "dlm.model.convert",
    "prepare_model_for_lora": "dlm.model.lora",
    "LoraSettings": "dlm.model.lora",
    "load_model": "dlm.model.hub",
    "load_tokenizer": "dlm.model.hub",
    "resolve_model_path": "dlm.model.hub",
    "DLMError": "dlm.errors",
    "get_objective": "dlm.objectives",
    "Engine": "dlm.decode.engine",
    "SamplingParams": "dlm.decode.sampling",
    "run_eval": "dlm.eval",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return getattr(module, name)
    raise AttributeError(f"module 'dlm' has no attribute {name!r}")
