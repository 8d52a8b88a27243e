"""LLaDA (LLaDA 8B, LLaDA 1.5, d3LLM-LLaDA): masked diffusion on a Llama body under LLaDA's own names.

config.json speaks OLMo's language (``d_model``, ``n_layers``, ...); the weights live under
``model.transformer.*`` and are renamed to Llama's on load (and back by ``dlm export --format llada``). Attention is
bidirectional, no logit shift, mask id 126336. Its sampler is ``--decode mdm --sampler llada`` (the default here).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dlm.errors import DLMError
from dlm.model.families.base import Family, names_of, need
from dlm.model.families.llada_moe import is_llada_moe


def _expect(fields: dict, key: str, want, path: Path, default=None) -> None:
    value = fields.get(key, default)
    if value != want:
        raise DLMError(
            f"'{path}': '{key}' is {value!r}; dlm loads the LLaDA layout with {key}={want!r} only "
            f"(the published checkpoints' value); set it or convert the checkpoint"
        )


def llada_config(fields: dict, path: Path):
    from transformers import LlamaConfig

    d = need(fields, "d_model", path, "the hidden size")
    layers = need(fields, "n_layers", path, "the number of blocks")
    heads = need(fields, "n_heads", path, "the number of attention heads")
    for key, want, default in (
        ("block_type", "llama", None),
        ("rope", True, None),
        ("alibi", False, False),
        ("layer_norm_type", "rms", None),
        ("activation_type", "silu", None),
        ("include_bias", False, None),
        ("include_qkv_bias", False, False),
        ("block_group_size", 1, 1),
        ("scale_logits", False, False),
        ("attention_layer_norm", False, False),
        ("input_emb_norm", False, False),
    ):
        _expect(fields, key, want, path, default)
    if fields.get("bias_for_layer_norm"):
        raise DLMError(f"'{path}': 'bias_for_layer_norm' is true; dlm loads the LLaDA layout without norm biases")
    if d % heads:
        raise DLMError(f"'{path}': 'd_model' {d} is not a multiple of 'n_heads' {heads}")
    kv = fields.get("n_kv_heads") or (1 if fields.get("multi_query_attention") else heads)
    mlp = fields.get("mlp_hidden_size") or int(fields.get("mlp_ratio", 4)) * d
    vocab = fields.get("embedding_size") or need(fields, "vocab_size", path, "the vocabulary size")
    return LlamaConfig(
        hidden_size=d,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=d // heads,
        vocab_size=vocab,
        hidden_act="silu",
        rms_norm_eps=float(fields.get("rms_norm_eps", 1e-5)),
        rope_theta=float(fields.get("rope_theta", 10000.0)),
        max_position_embeddings=int(fields.get("max_sequence_length") or 4096),
        tie_word_embeddings=bool(fields.get("weight_tying", False)),
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=fields.get("bos_token_id"),
        eos_token_id=fields.get("eos_token_id"),
        pad_token_id=fields.get("pad_token_id"),
    )


# -- weights: LLaDA's names <-> Llama's ---------------------------------------------------------------------
_LLADA_BLOCK = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}

_LLADA_TOP = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}

_LLADA_RE = re.compile(r"^model\.transformer\.blocks\.(\d+)\.(\w+)\.weight$")


def llada_to_llama(name: str) -> str | None:
    """The Llama name of a LLaDA weight (None: not a LLaDA weight name)."""
    if name in _LLADA_TOP:
        return _LLADA_TOP[name]
    m = _LLADA_RE.match(name)
    if m and m.group(2) in _LLADA_BLOCK:
        return f"model.layers.{m.group(1)}.{_LLADA_BLOCK[m.group(2)]}.weight"
    return None


def llama_to_llada(name: str) -> str:
    """The LLaDA name of a Llama weight (the inverse of :func:`llada_to_llama`)."""
    inverse_top = {v: k for k, v in _LLADA_TOP.items()}
    if name in inverse_top:
        return inverse_top[name]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.weight$", name)
    inverse = {v: k for k, v in _LLADA_BLOCK.items()}
    if m and m.group(2) in inverse:
        return f"model.transformer.blocks.{m.group(1)}.{inverse[m.group(2)]}.weight"
    raise DLMError(
        f"weight '{name}' has no place in the LLaDA layout (biases and extra modules are not part of "
        f"it); export to another --format"
    )


def rename(state: dict[str, torch.Tensor], folder: Path, config=None) -> dict[str, torch.Tensor]:
    """LLaDA's weights under Llama's names (a weight outside the layout is named in the error)."""
    out = {}
    for name, t in state.items():
        new = llada_to_llama(name)
        if new is None:
            raise DLMError(
                f"'{folder}': weight '{name}' is not part of the LLaDA layout dlm loads (block_type "
                f"'llama': model.transformer.{{wte, blocks.N.{{attn_norm, q_proj, k_proj, v_proj, "
                f"attn_out, ff_norm, ff_proj, up_proj, ff_out}}, ln_f, ff_out}})"
            )
        out[new] = t
    return out


FAMILY = Family(
    name="llada",
    title="LLaDA",
    objective="mdm",
    shift=False,
    attention="bidirectional",
    recognise=lambda fields: (
        (fields.get("model_type") == "llada" or "LLaDAModelLM" in names_of(fields)) and not is_llada_moe(fields)
    ),
    mask_id=126336,
    config=llada_config,
    rename=rename,
    samplers={"mdm": {"sampler": "llada"}},
    export=("llada", "dlm.model.export:to_llada"),
)
