"""Random-weight models for benchmarks: a model's own config, or a named larger shape on top of it (the tokenizer
and vocabulary stay the model's), so that a GPU machine that holds only the embedded model's config and tokenizer
can time 0.5B- and 1B-class models; random gated adapters for them; and the machine line every figure carries.

    from shapes import SHAPES, shaped_config
    config = shaped_config(folder, "1b")   # SmolLM2's tokenizer and vocabulary, a Llama-3.2-1B-like body

The shapes follow published models' bodies (hidden size, depth, heads, MLP width); the vocabulary is the base
model's (49,152 for SmolLM2), so the head is smaller than those models' and the figures are of the body.
"""

from __future__ import annotations

import contextlib
import copy
import os
import platform
import re

SHAPES: dict[str, dict[str, int | bool]] = {
    "base": {},  # the model's own config
    # Qwen2.5-0.5B's body: 24 layers, hidden 896, 14 query / 2 KV heads, MLP 4864
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        head_dim=64,
    ),
    # Llama-3.2-1B's body: 16 layers, hidden 2048, 32 query / 8 KV heads, MLP 8192
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        head_dim=64,
    ),
}


def shaped_config(folder, shape: str = "base"):
    """The config of ``folder`` with the body of ``shape`` (see :data:`SHAPES`)."""
    from transformers import AutoConfig

    if shape not in SHAPES:
        raise SystemExit(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    config = copy.deepcopy(AutoConfig.from_pretrained(folder))
    for key, value in SHAPES[shape].items():
        setattr(config, key, value)
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    return config


def parameter_count(config) -> int:
    """Parameters of a causal LM built from ``config`` (without building it)."""
    h, n, f = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    emb = config.vocab_size * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return n * (attn + 3 * h * f + 2 * h) + emb + h


def random_idlm(folder, shape: str = "base", seed: int = 0, **convert_kw):
    """``folder``'s model (or the body of ``shape``) with random weights, converted to an I-DLM (fp32, sdpa)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dlm.model.convert import convert_ar_to_dlm

    torch.manual_seed(seed)
    ar = AutoModelForCausalLM.from_config(shaped_config(folder, shape), attn_implementation="sdpa", dtype=torch.float32)
    return convert_ar_to_dlm(ar, "idlm", tokenizer=AutoTokenizer.from_pretrained(folder), **convert_kw)


def random_gated_adapters(dlm, r: int = 16, targets: str = "q_proj,v_proj") -> None:
    """Gated-LoRA adapters on ``targets`` with a random, non-zero B: they do their full work on the masks (their cost
    does not depend on their values)."""
    import torch

    from dlm.model.lora import LoraSettings, prepare_model_for_lora

    prepare_model_for_lora(dlm, LoraSettings(r=r, alpha=r, gated=True, target_modules=targets))
    with torch.no_grad():
        for a in dlm.gated_lora.adapters.values():
            a.B.normal_(0, 1e-3)


def machine() -> str:
    """CPU model, its widest vector ISA and core count, from /proc/cpuinfo (as `lscpu` shows them)."""
    model, flags = platform.processor() or "unknown CPU", ""
    with contextlib.suppress(OSError):
        info = open("/proc/cpuinfo").read()
        m = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        model = m.group(1).strip() if m else model
        m = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
        flags = f" {m.group(1)} " if m else ""
    isa = "AVX-512" if " avx512f " in flags else "AVX2" if " avx2 " in flags else "no AVX2"
    return f"{model}, {isa}, {os.cpu_count()} cores"
