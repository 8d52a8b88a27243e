"""LoRA through peft, and gated (mask-only) LoRA.

This module also owns how a DiffusionLM's weights are written (``save_model_folder``) and how adapters are
restored on load (``load_adapters_if_any``), because adapters decide what goes where.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dlm.errors import DLMError


@dataclass
class LoraSettings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | str = field(default_factory=lambda: "all-linear")
    gated: bool = False  # adapters act only at mask positions (I-DLM "lossless" mode)


def _settings(config) -> LoraSettings:
    if isinstance(config, LoraSettings):
        return config
    if isinstance(config, dict):
        return LoraSettings(**config)
    raise DLMError(f"LoRA settings must be a LoraSettings or dict, got {type(config).__name__}")


def prepare_model_for_lora(dlm, config):
    """Apply (plain) LoRA with peft to ``dlm.model``; returns the same DiffusionLM."""
    from peft import LoraConfig, get_peft_model

    s = _settings(config)
    if s.gated:
        raise DLMError("gated LoRA is not available yet")
    peft_config = LoraConfig(r=s.r, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=s.target_modules,
                             task_type="CAUSAL_LM")
    dlm.model = get_peft_model(dlm.model, peft_config)
    return dlm


def save_model_folder(dlm, path: Path, merge_lora: bool = True) -> None:
    model = dlm.model
    if hasattr(model, "merge_and_unload"):
        if not merge_lora:
            raise DLMError("saving unmerged peft adapters is not supported; use merge_lora=True")
        import copy

        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(path)


def load_adapters_if_any(dlm, folder: Path) -> None:
    if (Path(folder) / "dlm_adapter.safetensors").is_file():
        raise DLMError(f"'{folder}' holds gated-LoRA adapters, which this version cannot load yet")
