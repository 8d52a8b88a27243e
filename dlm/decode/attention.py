"""Decode attention for grouped-query models: SDPA without copying the KV cache.

transformers' ``sdpa`` attention repeats every key/value head ``num_key_value_groups`` times (``repeat_kv``)
whenever an attention mask is passed, i.e. for every decode chunk of more than one token and for every step of a
batch with holes in its cache. That copy of the whole cache, per layer and per forward, grows with the context and
is a large share of a small chunk's cost on CPU (SmolLM2-135M, 9 query / 3 KV heads: 100-300 us of a layer's
attention at 128-512 cached tokens, against 40-90 us without it). For masked chunks of at most
:data:`MAX_CHUNK` queries this implementation attends to the unrepeated cache instead:

- on CPU, ``scaled_dot_product_attention(..., enable_gqa=True)``;
- elsewhere (CUDA: masked GQA there falls back to the math kernel), the queries of a KV head's group are packed
  into one longer query block (``[B, H, T, D] -> [B, H_kv, n_rep * T, D]``, the mask tiled to match), which is
  exactly the same attention.

Everything else (training, prefill, unmasked steps) goes through transformers' own SDPA function unchanged.
:func:`use_for_decoding` switches a model from ``sdpa`` to this implementation (same maths; name
:data:`NAME`); the decoding engine does so for the models it runs.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

from dlm.decode import cpu as cpu_kernels
from dlm.model.convert import _hf

NAME = "dlm_sdpa"
MAX_CHUNK = 16  # queries; decode chunks are 1 .. 2N-1 tokens
CPU_ENABLE_GQA = True  # False: the packed-query form on CPU too (tests exercise both forms here)

_registered = False


def gqa_sdpa_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (
        dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and getattr(module, "sinks", None) is None
    ):
        out = cpu_kernels.attend(query, key, value, attention_mask, scaling)  # CPU fp32 decode chunks
        if out is not None:
            return out, None
    n_rep = getattr(module, "num_key_value_groups", 1)
    B, H, T, D = query.shape
    if (
        n_rep > 1
        and T <= MAX_CHUNK
        and dropout == 0.0
        and attention_mask is not None
        and attention_mask.dtype == torch.bool
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and key.shape[-1] == value.shape[-1]
        and not torch.compiler.is_compiling()
    ):
        if query.device.type == "cpu" and CPU_ENABLE_GQA:
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
            )
        else:
            q = query.reshape(B, H // n_rep, n_rep * T, D)
            mask = attention_mask.repeat(1, 1, n_rep, 1) if T > 1 else attention_mask
            out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
            out = out.reshape(B, H, T, value.shape[-1])
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def register() -> str:
    """Register :data:`NAME` with transformers (attention function and its mask builder: SDPA's)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, gqa_sdpa_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return NAME


class Switched:
    """A model switched to :data:`NAME` by :func:`use_for_decoding`; :meth:`restore` switches it back to ``sdpa``
    when the last user of the switch restores."""

    def __init__(self, hf):
        self.hf, self._open = hf, True
        _SWITCHED[hf] = _SWITCHED.get(hf, 0) + 1

    def restore(self) -> None:
        if not self._open:
            return
        self._open = False
        refs = _SWITCHED.pop(self.hf, 1) - 1
        if refs > 0:
            _SWITCHED[self.hf] = refs
        elif getattr(self.hf.config, "_attn_implementation", None) == NAME:
            self.hf.set_attn_implementation("sdpa")


# the models switched now and how many handles hold each switch (weakly: a model dropped takes its count along)
_SWITCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def use_for_decoding(model) -> Switched | None:
    """Switch ``model`` (a DiffusionLM or HF causal LM) from ``sdpa`` to :data:`NAME` when it has grouped-query
    attention; returns a handle whose ``restore()`` switches it back, or None where nothing was switched. Models on
    other implementations (eager, flash, flex) are left alone."""

    hf: Any = _hf(model)  # a transformers model (nn.Module's attributes type as Tensor | Module)
    config = getattr(hf, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == NAME and _SWITCHED.get(hf, 0) > 0:
        return Switched(hf)  # already switched by another engine on the same model
    if impl != "sdpa":
        return None
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    if not heads or not kv or kv == heads:
        return None
    register()
    hf.set_attn_implementation(NAME)
    return Switched(hf)
