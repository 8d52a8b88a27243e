"""Write a dlm model in a published family's layout (``dlm export --format sdar|llada|dream|llada2|diffusion_gemma``).

The inverse of :mod:`dlm.model.families`: the same weights under the family's names and a config.json with the
family's fields, so that the engines that read that family serve it (docs/models.md says which reads which).

- ``sdar``: Qwen3 (or Qwen3-MoE: SDAR-MoE) models; a block-diffusion model without shift (SDAR) or an I-DLM (the
  I-DLM release's SDAR format: ``use_regular_causal`` true, shift). Weights keep Qwen3's names (one per expert);
  ``block_size`` and ``mask_token_id`` go into config.json.
- ``llada``: Llama models without biases, masked diffusion without shift; weights renamed to LLaDA's
  ``model.transformer.*`` names.
- ``dream``: Qwen2 models (or Llama ones, whose attention is Qwen2's with zero q/k/v biases), masked diffusion
  with shift; a generation_config.json with Dream's sampler defaults.
- ``llada2``: GLM-4-MoE block-diffusion models without shift (a loaded LLaDA2, fine-tuned or not); q/k/v fused
  into ``query_key_value``, the stacked experts written one by one, LLaDA2's names and config fields.
- ``diffusion_gemma``: a DiffusionGemma model (loaded from such a folder, fine-tuned or not), written by
  transformers' own ``save_pretrained`` (LoRA merged): the folder transformers, vLLM and SGLang load.

No remote code is written: consumers that run the families' own modeling files need them from the family's
release. The folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from dlm.errors import DLMError, closest
from dlm.fsutil import atomic_folder
from dlm.model.families import REGISTRY
from dlm.model.families.base import STACKED_EXPERTS, unstacked_experts
from dlm.model.families.llada import llama_to_llada
from dlm.model.families.llada2 import glm4_moe_to_llada2


def _state(dlm) -> dict[str, torch.Tensor]:
    hf = dlm.base_model_hf
    state = {k: v.detach().cpu().contiguous() for k, v in hf.state_dict().items()}
    if getattr(hf.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def _kind(dlm) -> str:
    return getattr(dlm.hf_config, "model_type", None) or type(dlm.base_model_hf).__name__


def _refuse_adapters(dlm, fmt: str) -> None:
    if getattr(dlm, "gated_lora", None) is not None:
        raise DLMError(
            f"this model has gated-LoRA adapters (dlm_adapter.safetensors), which the {fmt} layout has "
            f"no place for; export the base model, or serve the dlm folder itself"
        )


def _common(config, fields: dict) -> dict:
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key, None)
        if value is not None:
            fields[key] = value
    return fields


def _hf_fields(config) -> dict:
    """The transformers config fields (without dlm's and the class's own names)."""
    fields = config.to_dict()
    for key in (
        "architectures",
        "model_type",
        "dlm_objective",
        "shift",
        "block_size",
        "mask_token_id",
        "dlm_family",
        "dlm_attention",
        "dlm_gated_lora",
        "_name_or_path",
        "transformers_version",
        "auto_map",
        "dtype",
        "torch_dtype",
    ):
        fields.pop(key, None)
    rope = fields.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        # the older field names too: the families' own code (pinned to earlier transformers) reads these
        fields["rope_theta"] = rope["rope_theta"]
        extra = {k: v for k, v in rope.items() if k != "rope_theta"}
        fields["rope_scaling"] = None if extra.get("rope_type", "default") == "default" else extra
    return fields


def to_sdar(dlm) -> tuple[dict, dict[str, torch.Tensor], dict | None]:
    spec = dlm.spec
    moe = _kind(dlm) == "qwen3_moe"  # SDAR-MoE
    if _kind(dlm) != "qwen3" and not moe:
        raise DLMError(
            f"--format sdar needs a Qwen3 (or Qwen3-MoE) model (SDAR's weights are Qwen3's, with per-head q/k "
            f"norms); this is '{_kind(dlm)}': use --format llada (Llama) or dream (Qwen2)"
        )
    if spec.objective == "block" and spec.shift:
        raise DLMError(
            "--format sdar: SDAR block diffusion has no logit shift and this block model has "
            "shift=True; convert with --no-shift, or export an I-DLM (objective idlm)"
        )
    if spec.objective not in ("block", "idlm"):
        raise DLMError(
            f"--format sdar holds block-diffusion (objective block) and I-DLM (objective idlm) models; "
            f"this is '{spec.objective}': use --format llada or dream"
        )
    if spec.objective == "idlm" and not spec.shift:
        raise DLMError("--format sdar: an I-DLM in the SDAR format has the logit shift; this one has shift=False")
    fields = _hf_fields(dlm.hf_config)
    fields.update(
        architectures=["SDARMoeForCausalLM" if moe else "SDARForCausalLM"],
        model_type="sdar_moe" if moe else "sdar",
        block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        use_regular_causal=spec.objective == "idlm",
    )
    if moe and "num_local_experts" in fields:  # transformers' own name; Qwen3-MoE's config.json says num_experts
        fields["num_experts"] = fields.pop("num_local_experts")

    state: dict[str, torch.Tensor] = {}
    for name, t in _state(dlm).items():
        state.update(unstacked_experts(name, t) if name.endswith(STACKED_EXPERTS) else {name: t})
    return fields, state, None


def to_llada(dlm) -> tuple[dict, dict[str, torch.Tensor], dict | None]:
    spec, c = dlm.spec, dlm.hf_config
    if _kind(dlm) != "llama" or getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        raise DLMError(
            f"--format llada needs a Llama model without biases (LLaDA's blocks are Llama's); this is "
            f"'{_kind(dlm)}': use --format dream (Qwen2) or sdar (Qwen3)"
        )
    if spec.objective != "mdm" or spec.shift:
        raise DLMError(
            f"--format llada holds masked-diffusion models without logit shift (objective mdm, "
            f"--no-shift); this is objective '{spec.objective}' with shift={spec.shift}: convert with "
            f"dlm convert --objective mdm --no-shift, or use --format dream (mdm with shift)"
        )
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise DLMError(
            f"--format llada: LLaDA's head size is d_model / n_heads; this model's head_dim {head_dim} "
            f"x {c.num_attention_heads} heads != hidden size {c.hidden_size}"
        )
    rope = getattr(c, "rope_parameters", None) or {}
    if (rope.get("rope_type") or "default") != "default":
        raise DLMError(
            f"--format llada: LLaDA's rotary embedding is the plain one; this model uses "
            f"'{rope.get('rope_type')}' scaling"
        )
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    if getattr(c, "hidden_act", "silu") != "silu":
        raise DLMError(f"--format llada: LLaDA's MLP is SiLU-gated; this model's activation is {c.hidden_act}")
    fields = _common(
        c,
        {
            "architectures": ["LLaDAModelLM"],
            "model_type": "llada",
            "activation_type": "silu",
            "alibi": False,
            "attention_dropout": 0.0,
            "attention_layer_norm": False,
            "bias_for_layer_norm": False,
            "block_group_size": 1,
            "block_type": "llama",
            "d_model": c.hidden_size,
            "embedding_dropout": 0.0,
            "embedding_size": c.vocab_size,
            "flash_attention": False,
            "include_bias": False,
            "include_qkv_bias": False,
            "input_emb_norm": False,
            "layer_norm_type": "rms",
            "layer_norm_with_affine": True,
            "mask_token_id": spec.mask_token_id,
            "max_sequence_length": c.max_position_embeddings,
            "mlp_hidden_size": c.intermediate_size,
            "multi_query_attention": None,
            "n_heads": c.num_attention_heads,
            "n_kv_heads": c.num_key_value_heads,
            "n_layers": c.num_hidden_layers,
            "residual_dropout": 0.0,
            "rms_norm_eps": c.rms_norm_eps,
            "rope": True,
            "rope_full_precision": True,
            "rope_theta": float(theta),
            "scale_logits": False,
            "use_cache": False,
            "vocab_size": c.vocab_size,
            "weight_tying": bool(getattr(c, "tie_word_embeddings", False)),
        },
    )
    state = {llama_to_llada(k): v for k, v in _state(dlm).items()}
    return fields, state, None


def to_dream(dlm) -> tuple[dict, dict[str, torch.Tensor], dict | None]:
    spec, c = dlm.spec, dlm.hf_config
    kind = _kind(dlm)
    if kind not in ("qwen2", "llama"):
        raise DLMError(
            f"--format dream needs a Qwen2 (or bias-free Llama) model, Dream's layout; this is "
            f"'{kind}': use --format sdar (Qwen3)"
        )
    if spec.objective != "mdm" or not spec.shift:
        raise DLMError(
            f"--format dream holds masked-diffusion models with the logit shift (objective mdm, "
            f"shift); this is objective '{spec.objective}' with shift={spec.shift}: use --format "
            f"llada for mdm without shift, sdar for block/idlm"
        )
    state = _state(dlm)
    fields = _hf_fields(c)
    if kind == "llama":
        if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
            raise DLMError(
                "--format dream: this Llama model has attention/MLP biases, which Dream's layout "
                "(q/k/v biases only) cannot hold"
            )
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        if head_dim * c.num_attention_heads != c.hidden_size:
            raise DLMError(
                f"--format dream: Dream's head size is hidden_size / heads; this model's head_dim "
                f"{head_dim} does not fit"
            )
        # Qwen2 attention = Llama's with q/k/v biases: zero biases keep the computation
        for key in [
            k
            for k in state
            if k.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"))
        ]:
            state[key[: -len("weight")] + "bias"] = torch.zeros(state[key].shape[0], dtype=state[key].dtype)
        for key in ("attention_bias", "mlp_bias", "pretraining_tp", "head_dim"):
            fields.pop(key, None)
    fields.update(architectures=["DreamModel"], model_type="Dream", mask_token_id=spec.mask_token_id)
    generation = _common(
        c,
        {
            "alg": "origin",
            "alg_temp": None,
            "eps": 0.001,
            "mask_token_id": spec.mask_token_id,
            "steps": 512,
            "temperature": 0.0,
            "top_k": None,
            "top_p": None,
        },
    )
    return fields, state, generation


def to_llada2(dlm) -> tuple[dict, dict[str, torch.Tensor], dict | None]:
    """A GLM-4-MoE block-diffusion model (a loaded LLaDA2, fine-tuned or not) in LLaDA2's Bailing-style layout:
    the inverse of :func:`dlm.model.families.llada2.rename`."""
    spec, c = dlm.spec, dlm.hf_config
    if _kind(dlm) != "glm4_moe":
        raise DLMError(
            f"--format llada2 needs a GLM-4-MoE model (a loaded LLaDA2 checkpoint: LLaDA2's computation); this "
            f"is '{_kind(dlm)}': use --format sdar (Qwen3), llada (Llama) or dream (Qwen2)"
        )
    if spec.objective != "block" or spec.shift:
        raise DLMError(
            f"--format llada2 holds block-diffusion models without logit shift (LLaDA2's); this is objective "
            f"'{spec.objective}' with shift={spec.shift}"
        )
    top_k = c.num_experts_per_tok
    if bool(c.norm_topk_prob) != (top_k > 1):
        raise DLMError(
            f"--format llada2: LLaDA2 renormalises the chosen experts' weights exactly when more than one is "
            f"chosen; this model has norm_topk_prob={c.norm_topk_prob} with {top_k} per token"
        )
    rope = getattr(c, "rope_parameters", None) or {}
    if (rope.get("rope_type") or "default") != "default":
        raise DLMError(f"--format llada2: LLaDA2's rotary embedding is the plain one, not '{rope.get('rope_type')}'")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    partial = float(rope.get("partial_rotary_factor", 1.0))
    fields = _common(
        c,
        {
            "architectures": ["LLaDA2MoeModelLM"],
            "model_type": "llada2_moe",
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": head_dim,
            "hidden_act": c.hidden_act,
            "use_qkv_bias": bool(c.attention_bias),
            "use_bias": False,
            "use_qk_norm": bool(c.use_qk_norm),
            "rms_norm_eps": c.rms_norm_eps,
            "norm_head": False,
            "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
            "embedding_dropout": 0.0,
            "attention_dropout": 0.0,
            "output_dropout": 0.0,
            "initializer_range": getattr(c, "initializer_range", 0.02),
            "max_position_embeddings": c.max_position_embeddings,
            "rope_theta": float(rope.get("rope_theta", 10000.0)),
            "rope_scaling": None,
            "partial_rotary_factor": partial,
            "rotary_dim": int(head_dim * partial),
            "use_sliding_window": False,
            "num_experts": c.n_routed_experts,
            "num_shared_experts": c.n_shared_experts or None,
            "num_experts_per_tok": top_k,
            "n_group": c.n_group,
            "topk_group": c.topk_group,
            "moe_intermediate_size": c.moe_intermediate_size,
            "first_k_dense_replace": c.first_k_dense_replace,
            "routed_scaling_factor": c.routed_scaling_factor,
            "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "norm_topk_prob": True,
            "router_dtype": "fp32",
            "output_router_logits": False,
            "use_cache": True,
            "block_size": spec.block_size,
            "mask_token_id": spec.mask_token_id,
        },
    )

    weights = _state(dlm)
    state: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        qkv = _QKV.match(name)
        renamed = glm4_moe_to_llada2(name)
        if name == "model.embed_tokens.weight":
            state["model.word_embeddings.weight"] = t
        elif qkv is not None:
            layer, part, kind = qkv.groups()
            if part == "q":  # q, k and v as one matrix, rows in that order
                parts = [weights[f"{layer}.self_attn.{n}_proj.{kind}"] for n in "qkv"]
                state[f"{layer}.attention.query_key_value.{kind}"] = torch.cat(parts, 0)
        elif renamed is not None:
            state[renamed] = t.float() if renamed.endswith("expert_bias") else t
        elif name.endswith(STACKED_EXPERTS):
            state.update(unstacked_experts(name, t))
        elif ".mlp.shared_experts." not in name or c.n_shared_experts:  # (none: LLaDA2 has no module for them)
            state[name] = t
    return fields, {k: v.contiguous() for k, v in state.items()}, None


_QKV = re.compile(r"^(model\.layers\.\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")


def to_diffusion_gemma(dlm):
    """A DiffusionGemma model (loaded from such a folder, fine-tuned or not) is written by transformers' own
    ``save_pretrained`` (LoRA merged, dlm's fields left out): no renaming, the weights tied as transformers ties
    them. Returns the function that writes the folder."""
    if getattr(dlm.hf_config, "dlm_family", None) != "diffusion_gemma" or dlm.renoise is None:
        raise DLMError(
            f"--format diffusion_gemma writes a DiffusionGemma model (one loaded from a DiffusionGemma folder); "
            f"this is a '{dlm.objective}' model of {_kind(dlm)}, whose layers DiffusionGemma's do not match - "
            f"serve or save its dlm folder instead"
        )
    return dlm.renoise.save_pretrained


def formats() -> dict[str, Callable]:
    """``dlm export --format`` name -> its writer, from the registered families' ``export`` entries: a writer
    takes the model and returns ``(config.json fields, state dict, generation_config.json fields or None)``, or a
    function that writes the folder itself."""
    import importlib

    out: dict[str, Callable] = {}
    for family in REGISTRY:
        if family.export is None or family.export[0] in out:
            continue
        name, writer = family.export
        if isinstance(writer, str):
            module, attr = writer.split(":")
            writer = getattr(importlib.import_module(module), attr)
        out[name] = writer
    return out


def export_model(dlm, output: str | Path, fmt: str) -> Path:
    """Write ``dlm`` (a :class:`~dlm.model.convert.DiffusionLM`) to ``output`` in layout ``fmt`` (atomically)."""
    from safetensors.torch import save_file

    writers = formats()
    if fmt not in writers:
        raise DLMError(
            f"unknown export format '{fmt}' (--format): use one of {', '.join(writers)} (did you mean "
            f"{closest(fmt, writers)}?)"
        )
    _refuse_adapters(dlm, fmt)
    out = Path(output)
    written = writers[fmt](dlm)
    if callable(written):  # the writer writes the folder itself (transformers' own save_pretrained)
        with atomic_folder(out) as tmp:
            written(tmp)
            if dlm.tokenizer is not None:
                dlm.tokenizer.save_pretrained(tmp)
        return out
    fields, state, generation = written
    with atomic_folder(out) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
        if generation is not None:
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if dlm.tokenizer is not None:
            dlm.tokenizer.save_pretrained(tmp)
    return out
