"""Device and dtype choice in one place. Nothing else in dlm says "cuda".

``DLM_DEVICE`` (e.g. ``cpu``, ``cuda:1``, ``mps``) overrides the automatic choice; tests set it to ``cpu``.
"""

from __future__ import annotations

import os

import torch


def get_device(requested: str | None = None) -> torch.device:
    """The device to run on: the explicit request, else $DLM_DEVICE, else cuda > mps > cpu."""
    name = requested or os.environ.get("DLM_DEVICE")
    if name and name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def supports_bf16(device: torch.device) -> bool:
    """Whether bf16 autocast is worth using on this device (fast bf16 matmuls)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return False


def get_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """Parse a dtype name (auto|float32|fp32|bfloat16|bf16|float16|fp16) for weights on ``device``."""
    if name in (None, "auto"):
        return torch.bfloat16 if supports_bf16(device) else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        from dlm.errors import DLMError

        raise DLMError(f"unknown dtype '{name}': use one of auto, {', '.join(table)}")
    return table[name]


def default_num_threads() -> int:
    return torch.get_num_threads()
