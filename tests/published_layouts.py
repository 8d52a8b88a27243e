"""Tiny random checkpoints in the published layouts of LLaDA, Dream, SDAR, I-DLM, Fast-dLLM v2, LLaDA2 and LLaDA-MoE (config.json
fields and weight names as the released folders have them), written in code for the tests; and a reference
forward of each family written from its definition on those weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from dlm.testing import make_tokenizer

VOCAB = 336  # embedding rows; the tokenizer has 320 tokens + the mask token (id 320)
MASK = 320
HIDDEN, LAYERS, HEADS, HEAD_DIM, FFN, POSITIONS = 32, 2, 4, 8, 64, 256
EOS = 0


def _tokenizer(path: Path, mask: str):
    tok = make_tokenizer()
    tok.add_special_tokens({"mask_token": mask})
    assert tok.mask_token_id == MASK
    tok.save_pretrained(path)
    return tok


def _rand(g, *shape, scale=0.15):
    return torch.randn(*shape, generator=g) * scale


def _norm(g, n):
    return 1.0 + _rand(g, n, scale=0.1)


def _save(path: Path, config: dict, state: dict, shards: int = 1) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in state.items()}
    if shards == 1:
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(state)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def write_llada(path, seed: int = 0, tie: bool = False, shards: int = 1, **override) -> Path:
    """GSAI-ML/LLaDA-8B-* layout (OLMo-style names under model.transformer, block_type 'llama')."""
    path = Path(path)
    g = torch.Generator().manual_seed(seed)
    config = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": HIDDEN,
        "embedding_dropout": 0.0,
        "embedding_size": VOCAB,
        "eos_token_id": EOS,
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": MASK,
        "max_sequence_length": POSITIONS,
        "mlp_hidden_size": FFN,
        "mlp_ratio": 4,
        "model_type_": None,
        "multi_query_attention": None,
        "n_heads": HEADS,
        "n_kv_heads": HEADS,
        "n_layers": LAYERS,
        "pad_token_id": 3,
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "transformers_version": "4.46.3",
        "use_cache": False,
        "vocab_size": VOCAB,
        "weight_tying": tie,
    }
    del config["model_type_"]
    config.update(override)
    d, kv = HIDDEN, config["n_kv_heads"] or HEADS
    t = "model.transformer"
    state = {f"{t}.wte.weight": _rand(g, VOCAB, d), f"{t}.ln_f.weight": _norm(g, d)}
    if not tie:
        state[f"{t}.ff_out.weight"] = _rand(g, VOCAB, d)
    for i in range(LAYERS):
        b = f"{t}.blocks.{i}"
        state.update(
            {
                f"{b}.attn_norm.weight": _norm(g, d),
                f"{b}.q_proj.weight": _rand(g, HEADS * HEAD_DIM, d),
                f"{b}.k_proj.weight": _rand(g, kv * HEAD_DIM, d),
                f"{b}.v_proj.weight": _rand(g, kv * HEAD_DIM, d),
                f"{b}.attn_out.weight": _rand(g, d, HEADS * HEAD_DIM),
                f"{b}.ff_norm.weight": _norm(g, d),
                f"{b}.ff_proj.weight": _rand(g, FFN, d),
                f"{b}.up_proj.weight": _rand(g, FFN, d),
                f"{b}.ff_out.weight": _rand(g, d, FFN),
            }
        )
    _save(path, config, state, shards)
    _tokenizer(path, "<|mdm_mask|>")
    return path


def _qwen_state(g, qkv_bias: bool, qk_norm: bool, kv: int = 2) -> dict:
    d = HIDDEN
    state = {
        "model.embed_tokens.weight": _rand(g, VOCAB, d),
        "model.norm.weight": _norm(g, d),
        "lm_head.weight": _rand(g, VOCAB, d),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        state.update(
            {
                f"{p}.input_layernorm.weight": _norm(g, d),
                f"{p}.post_attention_layernorm.weight": _norm(g, d),
                f"{p}.self_attn.q_proj.weight": _rand(g, HEADS * HEAD_DIM, d),
                f"{p}.self_attn.k_proj.weight": _rand(g, kv * HEAD_DIM, d),
                f"{p}.self_attn.v_proj.weight": _rand(g, kv * HEAD_DIM, d),
                f"{p}.self_attn.o_proj.weight": _rand(g, d, HEADS * HEAD_DIM),
                f"{p}.mlp.gate_proj.weight": _rand(g, FFN, d),
                f"{p}.mlp.up_proj.weight": _rand(g, FFN, d),
                f"{p}.mlp.down_proj.weight": _rand(g, d, FFN),
            }
        )
        if qkv_bias:
            for n, rows in (("q", HEADS), ("k", kv), ("v", kv)):
                state[f"{p}.self_attn.{n}_proj.bias"] = _rand(g, rows * HEAD_DIM)
        if qk_norm:
            state[f"{p}.self_attn.q_norm.weight"] = _norm(g, HEAD_DIM)
            state[f"{p}.self_attn.k_norm.weight"] = _norm(g, HEAD_DIM)
    return state


def _qwen_config(**kw) -> dict:
    config = {
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "max_position_embeddings": POSITIONS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_cache": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "bos_token_id": EOS,
        "eos_token_id": EOS,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
    }
    config.update(kw)
    return config


def write_dream(path, seed: int = 0, **override) -> Path:
    """Dream-org/Dream-v0-* layout (Qwen2 names with q/k/v biases; a generation_config.json)."""
    path = Path(path)
    g = torch.Generator().manual_seed(seed)
    config = _qwen_config(
        architectures=["DreamModel"],
        model_type="Dream",
        auto_map={"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        mask_token_id=MASK,
        pad_token_id=3,
        max_window_layers=28,
    )
    config.update(override)
    _save(path, config, _qwen_state(g, qkv_bias=True, qk_norm=False))
    (path / "generation_config.json").write_text(
        json.dumps(
            {
                "alg": "origin",
                "alg_temp": None,
                "bos_token_id": EOS,
                "eos_token_id": EOS,
                "eps": 0.001,
                "mask_token_id": None,
                "pad_token_id": EOS,
                "steps": 512,
                "temperature": 0.0,
                "top_k": None,
                "top_p": None,
            }
        )
    )
    _tokenizer(path, "<|mask|>")
    return path


def write_sdar(path, seed: int = 0, block_size: int | None = 4, idlm: bool = False, **override) -> Path:
    """JetLM/SDAR-*-Chat layout (Qwen3 names with q/k norms), with block_size and mask_token_id as the training
    copies carry them (``block_size=None``: the hub file, without both); ``idlm``: the I-DLM release's variant
    (same layout, causal, block 1/2/3, longer context, eos <|im_end|>)."""
    path = Path(path)
    g = torch.Generator().manual_seed(seed)
    config = _qwen_config(
        architectures=["SDARForCausalLM"],
        model_type="sdar",
        head_dim=HEAD_DIM,
        auto_map={
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        attention_bias=False,
        attn_implementation="flex_attention",
        fuse_cross_entropy=True,
        debug=False,
        ep_size=1,
        micro_forward=False,
        skip_checkpoint=False,
        use_deepep=False,
    )
    if block_size is not None:
        config.update(block_size=block_size, mask_token_id=MASK)
    if idlm:
        config.update(max_position_embeddings=POSITIONS + 64, eos_token_id=2)
    config.update(override)
    _save(path, config, _qwen_state(g, qkv_bias=False, qk_norm=True))
    _tokenizer(path, "<|MASK|>")
    return path


def write_idlm(path, seed: int = 0, block_size: int = 1, **override) -> Path:
    return write_sdar(path, seed, block_size=block_size, idlm=True, **override)


def write_fast_dllm_v2(path, seed: int = 0, bd_size: int = 4, **override) -> Path:
    """Efficient-Large-Model/Fast_dLLM_v2_7B layout (Qwen2 names with q/k/v biases, bd_size)."""
    path = Path(path)
    g = torch.Generator().manual_seed(seed)
    config = _qwen_config(
        architectures=["Fast_dLLM_QwenForCausalLM"],
        model_type="Fast_dLLM_Qwen",
        auto_map={
            "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
            "AutoModel": "modeling.Fast_dLLM_QwenModel",
            "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
        },
        bd_size=bd_size,
        conplemenrary_mask=True,
        mask_token_id=MASK,
        layer_types=["full_attention"] * LAYERS,
        max_window_layers=LAYERS,
    )
    config.update(override)
    _save(path, config, _qwen_state(g, qkv_bias=True, qk_norm=False))
    _tokenizer(path, "|<MASK>|")
    return path


def _top(g, embedding: str) -> dict:
    """The weights outside the layers: the embedding (under its family's name), the final norm, the output head."""
    return {
        embedding: _rand(g, VOCAB, HIDDEN, scale=1.0),
        "model.norm.weight": _norm(g, HIDDEN),
        "lm_head.weight": _rand(g, VOCAB, HIDDEN),
    }


def _mlp(g, prefix: str, width: int) -> dict:
    """A SiLU-gated MLP's weights under ``prefix`` (``gate_proj``, ``up_proj``, ``down_proj``)."""
    shapes = (("gate", (width, HIDDEN)), ("up", (width, HIDDEN)), ("down", (HIDDEN, width)))
    return {f"{prefix}.{n}_proj.weight": _rand(g, *shape) for n, shape in shapes}


def _experts(g, prefix: str, n: int, width: int) -> dict:
    """``n`` routed experts under ``prefix``.experts.E, one tensor per expert as checkpoints hold them."""
    out: dict = {}
    for e in range(n):
        out.update(_mlp(g, f"{prefix}.experts.{e}", width))
    return out


def write_llada2(path, seed: int = 0, shared: int = 1, kv_heads: int = 2, **override) -> Path:
    """inclusionAI/LLaDA2.0-mini / LLaDA2.1-mini layout (Bailing-style MoE: ``word_embeddings``, fused
    ``query_key_value``, ``query_layernorm`` / ``key_layernorm``, ``dense``; the first layer dense, the others with
    routed experts ``experts.E.*``, a router ``gate.weight`` with its ``gate.expert_bias``, and shared experts)."""
    path = Path(path)
    g = torch.Generator().manual_seed(seed)
    layers, experts, moe_ffn, kv = 3, 8, 16, kv_heads
    config = {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "auto_map": {
            "AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
            "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
            "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM",
        },
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": kv,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "use_qkv_bias": False,
        "use_bias": False,
        "use_qk_norm": True,
        "rms_norm_eps": 1e-6,
        "norm_head": False,
        "tie_word_embeddings": False,
        "embedding_dropout": 0.0,
        "attention_dropout": 0.0,
        "output_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": POSITIONS,
        "rope_theta": 600000,
        "rope_scaling": None,
        "partial_rotary_factor": 0.5,
        "rotary_dim": HEAD_DIM // 2,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "num_experts": experts,
        "num_shared_experts": shared,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "moe_intermediate_size": moe_ffn,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "norm_topk_prob": True,
        "router_dtype": "fp32",
        "output_router_logits": False,
        "pad_token_id": 3,
        "eos_token_id": EOS,
        "mask_token_id": MASK,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.52.3",
    }
    config.update(override)
    d = HIDDEN
    state = _top(g, "model.word_embeddings.weight")
    for i in range(layers):
        p = f"model.layers.{i}"
        state.update(
            {
                f"{p}.input_layernorm.weight": _norm(g, d),
                f"{p}.post_attention_layernorm.weight": _norm(g, d),
                f"{p}.attention.query_key_value.weight": _rand(g, (HEADS + 2 * kv) * HEAD_DIM, d),
                f"{p}.attention.query_layernorm.weight": _norm(g, HEAD_DIM),
                f"{p}.attention.key_layernorm.weight": _norm(g, HEAD_DIM),
                f"{p}.attention.dense.weight": _rand(g, d, HEADS * HEAD_DIM),
            }
        )
        if i < config["first_k_dense_replace"]:
            state.update(_mlp(g, f"{p}.mlp", FFN))
            continue
        state[f"{p}.mlp.gate.weight"] = _rand(g, experts, d, scale=0.5)
        state[f"{p}.mlp.gate.expert_bias"] = _rand(g, experts, scale=0.2).float()
        state.update(_experts(g, f"{p}.mlp", experts, moe_ffn))
        if shared:
            state.update(_mlp(g, f"{p}.mlp.shared_experts", moe_ffn * shared))
    _save(path, config, state)
    _tokenizer(path, "<|mask|>")
    return path


def write_llada_moe(path, seed: int = 0, **override) -> Path:
    """inclusionAI/LLaDA-MoE-7B-A1B layout (OLMoE-like: model_type "llada" with the LLaDAMoEModelLM architecture,
    Qwen3-MoE's names, per-head q/k norms, a softmax router over experts ``mlp.experts.E.*``; no mask id in
    config.json). The second layer is dense (``moe_layer_freq``)."""
    path = Path(path)
    g = torch.Generator().manual_seed(seed)
    layers, experts, expert_ffn = 3, 8, 16
    config = {
        "architectures": ["LLaDAMoEModelLM"],
        "model_type": "llada",
        "auto_map": {
            "AutoConfig": "configuration_lladamoe.LLaDAMoEConfig",
            "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
            "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM",
        },
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "hidden_act": "silu",
        "max_position_embeddings": POSITIONS,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "use_cache": False,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "attention_bias": False,
        "clip_qkv": None,
        "dense_intermediate_size": FFN,
        "expert_intermediate_size": expert_ffn,
        "num_experts": experts,
        "num_experts_per_tok": 3,
        "shared_expert_intermediate_size": None,
        "moe_layer_freq": [1, 0, 1],
        "qk_layernorm": True,
        "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.01,
        "routed_scaling_factor": 1,
        "norm_topk_prob": None,
        "rope_theta": 50000.0,
        "rope_scaling": None,
        "partial_rotary_factor": 1.0,
        "eos_token_id": EOS,
        "pad_token_id": 3,
        "mask_token_id": MASK,  # (the published file has none: dlm's default is LLaDA-MoE's 156895)
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.3",
    }
    config.update(override)
    d = HIDDEN
    state = _top(g, "model.embed_tokens.weight")
    for i in range(layers):
        p = f"model.layers.{i}"
        state.update(
            {
                f"{p}.input_layernorm.weight": _norm(g, d),
                f"{p}.post_attention_layernorm.weight": _norm(g, d),
                f"{p}.self_attn.q_proj.weight": _rand(g, d, d),
                f"{p}.self_attn.k_proj.weight": _rand(g, d, d),
                f"{p}.self_attn.v_proj.weight": _rand(g, d, d),
                f"{p}.self_attn.o_proj.weight": _rand(g, d, d),
                f"{p}.self_attn.q_norm.weight": _norm(g, HEAD_DIM),
                f"{p}.self_attn.k_norm.weight": _norm(g, HEAD_DIM),
            }
        )
        if config["moe_layer_freq"][i] == 0:
            state.update(_mlp(g, f"{p}.mlp", FFN))
            continue
        state[f"{p}.mlp.gate.weight"] = _rand(g, experts, d, scale=0.5)
        state.update(_experts(g, f"{p}.mlp", experts, expert_ffn))
    _save(path, config, state)
    _tokenizer(path, "<|mask|>")
    return path


def write_sdar_moe(path, seed: int = 0, block_size: int | None = 4, **override) -> Path:
    """JetLM/SDAR-30B-A3B-* layout as its base Qwen3-30B-A3B names it (SDARMoeForCausalLM, Qwen3-MoE's
    config fields and weights: per-head q/k norms, a softmax router, ``mlp.experts.E.*``; ``norm_topk_prob``)."""
    path = Path(path)
    g = torch.Generator().manual_seed(seed)
    layers, experts, moe_ffn = 3, 8, 16
    config = _qwen_config(
        architectures=["SDARMoeForCausalLM"],
        model_type="sdar_moe",
        head_dim=HEAD_DIM,
        num_hidden_layers=layers,
        auto_map={
            "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
            "AutoModel": "modeling_sdar_moe.SDARMoeModel",
            "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
        },
        attention_bias=False,
        num_experts=experts,
        num_experts_per_tok=3,
        moe_intermediate_size=moe_ffn,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    )
    if block_size is not None:
        config.update(block_size=block_size, mask_token_id=MASK)
    config.update(override)
    d, kv = HIDDEN, config["num_key_value_heads"]
    state = _top(g, "model.embed_tokens.weight")
    for i in range(layers):
        p = f"model.layers.{i}"
        state.update(
            {
                f"{p}.input_layernorm.weight": _norm(g, d),
                f"{p}.post_attention_layernorm.weight": _norm(g, d),
                f"{p}.self_attn.q_proj.weight": _rand(g, HEADS * HEAD_DIM, d),
                f"{p}.self_attn.k_proj.weight": _rand(g, kv * HEAD_DIM, d),
                f"{p}.self_attn.v_proj.weight": _rand(g, kv * HEAD_DIM, d),
                f"{p}.self_attn.o_proj.weight": _rand(g, d, HEADS * HEAD_DIM),
                f"{p}.self_attn.q_norm.weight": _norm(g, HEAD_DIM),
                f"{p}.self_attn.k_norm.weight": _norm(g, HEAD_DIM),
            }
        )
        if i in config["mlp_only_layers"]:
            state.update(_mlp(g, f"{p}.mlp", FFN))
            continue
        state[f"{p}.mlp.gate.weight"] = _rand(g, experts, d, scale=0.5)
        state.update(_experts(g, f"{p}.mlp", experts, moe_ffn))
    _save(path, config, state)
    _tokenizer(path, "<|MASK|>")
    return path


WRITERS = {
    "llada": write_llada,
    "dream": write_dream,
    "sdar": write_sdar,
    "idlm": write_idlm,
    "fast_dllm_v2": write_fast_dllm_v2,
    "llada2": write_llada2,
    "llada_moe": write_llada_moe,
}


# -- reference forwards ---------------------------------------------------------------------------------------
def _rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None]  # [L, d/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def _swiglu(W: dict, h: torch.Tensor, prefix: str) -> torch.Tensor:
    """The SiLU-gated MLP under ``prefix`` of the weights ``W``."""
    gate, up = h @ W[f"{prefix}.gate_proj.weight"].T, h @ W[f"{prefix}.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ W[f"{prefix}.down_proj.weight"].T


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax attention of queries [H, L, d] over keys / values [KV, L, d] (grouped: each shared by H / KV heads)
    under ``allowed`` [L, L]; [L, H * d]."""
    heads, L, hd = q.shape
    k, v = k.repeat_interleave(heads // k.shape[0], 0), v.repeat_interleave(heads // v.shape[0], 0)
    scores = ((q @ k.transpose(-1, -2)) / math.sqrt(hd)).masked_fill(~allowed[None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(L, heads * hd)


def _llada2_logits(cfg: dict, W: dict, ids: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """LLaDA2's forward from its definition (Bailing-style MoE) on its own weight names."""
    heads, hd, eps = cfg["num_attention_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    kv = cfg["num_key_value_heads"] or heads  # 0: as many as the heads
    rd = int(hd * cfg["partial_rotary_factor"])
    L = len(ids)
    pos = torch.arange(L)

    def mlp(h, p):
        return _swiglu(W, h, p)

    x = W["model.word_embeddings.weight"][torch.tensor(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = _rms(x, W[f"{p}.input_layernorm.weight"], eps)
        qkv = h @ W[f"{p}.attention.query_key_value.weight"].T
        if f"{p}.attention.query_key_value.bias" in W:  # use_qkv_bias
            qkv = qkv + W[f"{p}.attention.query_key_value.bias"]
        qkv = qkv.view(L, heads + 2 * kv, hd)
        q, k, v = (t.transpose(0, 1) for t in qkv.split([heads, kv, kv], dim=1))
        q = _rms(q, W[f"{p}.attention.query_layernorm.weight"], eps)
        k = _rms(k, W[f"{p}.attention.key_layernorm.weight"], eps)
        theta = cfg["rope_theta"]
        q = torch.cat([_rope(q[..., :rd], pos, theta), q[..., rd:]], -1)  # only the first rd dims rotate
        k = torch.cat([_rope(k[..., :rd], pos, theta), k[..., rd:]], -1)
        x = x + _attend(q, k, v, allowed) @ W[f"{p}.attention.dense.weight"].T
        if f"{p}.attention.dense.bias" in W:  # use_bias
            x = x + W[f"{p}.attention.dense.bias"]
        h = _rms(x, W[f"{p}.post_attention_layernorm.weight"], eps)
        if i < cfg["first_k_dense_replace"]:
            x = x + mlp(h, f"{p}.mlp")
            continue
        n, top, groups = cfg["num_experts"], cfg["num_experts_per_tok"], cfg["n_group"]
        probs = torch.sigmoid(h.float() @ W[f"{p}.mlp.gate.weight"].float().T)  # [L, E]
        y = torch.zeros_like(x)
        for t in range(L):  # one token at a time, as the definition reads
            bias = W.get(f"{p}.mlp.gate.expert_bias", torch.zeros(n))  # picks experts, does not weight them
            choice = probs[t] + bias
            group_best = choice.view(groups, n // groups).topk(2).values.sum(-1)
            keep = torch.zeros(groups, dtype=torch.bool)
            keep[group_best.topk(cfg["topk_group"]).indices] = True
            chosen = choice.masked_fill(~keep.repeat_interleave(n // groups), float("-inf")).topk(top).indices
            w = probs[t, chosen]
            w = w / (w.sum() + 1e-20) * cfg["routed_scaling_factor"]
            for e, we in zip(chosen.tolist(), w):
                y[t] += we * mlp(h[t], f"{p}.mlp.experts.{e}")
        if cfg.get("num_shared_experts"):
            y = y + mlp(h, f"{p}.mlp.shared_experts")
        x = x + y
    return _rms(x, W["model.norm.weight"], eps) @ W["lm_head.weight"].T


def _softmax_moe_logits(cfg: dict, W: dict, ids: list[int], allowed: torch.Tensor, dense, renorm) -> torch.Tensor:
    """The forward of LLaDA-MoE (OLMoE-like) and of SDAR-MoE (Qwen3-MoE) from their definitions, on their own
    weight names: per-head q/k norms, a softmax router whose top-k probabilities weight the experts (``renorm``:
    divided by their sum first, Qwen3-MoE's ``norm_topk_prob``), the ``dense`` layers a plain MLP."""
    heads, eps, theta = cfg["num_attention_heads"], cfg["rms_norm_eps"], cfg["rope_theta"]
    kv, hd = cfg["num_key_value_heads"], cfg.get("head_dim") or cfg["hidden_size"] // heads
    L = len(ids)
    pos = torch.arange(L)

    def mlp(h, p):
        return _swiglu(W, h, p)

    x = W["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = _rms(x, W[f"{p}.input_layernorm.weight"], eps)
        q = _rms((h @ W[f"{p}.self_attn.q_proj.weight"].T).view(L, heads, hd), W[f"{p}.self_attn.q_norm.weight"], eps)
        k = _rms((h @ W[f"{p}.self_attn.k_proj.weight"].T).view(L, kv, hd), W[f"{p}.self_attn.k_norm.weight"], eps)
        v = (h @ W[f"{p}.self_attn.v_proj.weight"].T).view(L, kv, hd)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        x = x + _attend(q, k, v, allowed) @ W[f"{p}.self_attn.o_proj.weight"].T
        h = _rms(x, W[f"{p}.post_attention_layernorm.weight"], eps)
        if i in dense:
            x = x + mlp(h, f"{p}.mlp")
            continue
        probs = (h @ W[f"{p}.mlp.gate.weight"].T).softmax(-1)  # [L, E]
        y = torch.zeros_like(x)
        for t in range(L):
            w, chosen = probs[t].topk(cfg["num_experts_per_tok"])
            w = w / w.sum() if renorm else w  # LLaDA-MoE: the probabilities themselves
            for e, we in zip(chosen.tolist(), w):
                y[t] += we * mlp(h[t], f"{p}.mlp.experts.{e}")
        x = x + y
    return _rms(x, W["model.norm.weight"], eps) @ W["lm_head.weight"].T


def reference_logits(folder, ids: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """The family's forward written from its definition on the folder's own weight names: [L, V] logits of one
    sequence under ``allowed`` [L, L] (True = query may attend key), positions 0..L-1."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    index = folder / "model.safetensors.index.json"
    W = {}
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    for f in files:
        W.update(load_file(str(folder / f)))
    if cfg["model_type"] == "llada2_moe":
        return _llada2_logits(cfg, W, ids, allowed)
    if "LLaDAMoEModelLM" in cfg.get("architectures", []):
        dense = [i for i, f in enumerate(cfg["moe_layer_freq"]) if f == 0]
        return _softmax_moe_logits(cfg, W, ids, allowed, dense, renorm=False)
    if "SDARMoeForCausalLM" in cfg.get("architectures", []):
        return _softmax_moe_logits(cfg, W, ids, allowed, cfg["mlp_only_layers"], renorm=cfg["norm_topk_prob"])
    llada = cfg["model_type"] == "llada"
    if llada:
        t = "model.transformer"
        names = dict(
            emb=f"{t}.wte.weight",
            norm=f"{t}.ln_f.weight",
            head=f"{t}.wte.weight" if cfg["weight_tying"] else f"{t}.ff_out.weight",
        )
        blk = lambda i, n: f"{t}.blocks.{i}.{n}"  # noqa: E731
        part = dict(
            ln1="attn_norm",
            q="q_proj",
            k="k_proj",
            v="v_proj",
            o="attn_out",
            ln2="ff_norm",
            gate="ff_proj",
            up="up_proj",
            down="ff_out",
        )
        eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        heads, kv, layers = cfg["n_heads"], cfg["n_kv_heads"], cfg["n_layers"]
    else:
        names = dict(emb="model.embed_tokens.weight", norm="model.norm.weight", head="lm_head.weight")
        blk = lambda i, n: f"model.layers.{i}.{n}"  # noqa: E731
        part = dict(
            ln1="input_layernorm",
            q="self_attn.q_proj",
            k="self_attn.k_proj",
            v="self_attn.v_proj",
            o="self_attn.o_proj",
            ln2="post_attention_layernorm",
            gate="mlp.gate_proj",
            up="mlp.up_proj",
            down="mlp.down_proj",
        )
        eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        heads, kv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    hd = HEAD_DIM
    L = len(ids)
    pos = torch.arange(L)
    x = W[names["emb"]][torch.tensor(ids)]
    for i in range(layers):
        w = lambda n: W[blk(i, part[n] + ".weight")]  # noqa: E731
        bias = lambda n: W.get(blk(i, part[n] + ".bias"))  # noqa: E731

        def lin(h, n):
            out = h @ w(n).T
            return out + bias(n) if bias(n) is not None else out

        h = _rms(x, w("ln1"), eps)
        q = lin(h, "q").view(L, heads, hd).transpose(0, 1)
        k = lin(h, "k").view(L, kv, hd).transpose(0, 1)
        v = lin(h, "v").view(L, kv, hd).transpose(0, 1)
        qn = blk(i, "self_attn.q_norm.weight")
        if qn in W:  # Qwen3 / SDAR: RMSNorm of each head before the rotation
            q, k = _rms(q, W[qn], eps), _rms(k, W[blk(i, "self_attn.k_norm.weight")], eps)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        a = (scores.softmax(-1) @ v).transpose(0, 1).reshape(L, heads * hd)
        x = x + a @ w("o").T
        h = _rms(x, w("ln2"), eps)
        x = x + (torch.nn.functional.silu(h @ w("gate").T) * (h @ w("up").T)) @ w("down").T
    return _rms(x, W[names["norm"]], eps) @ W[names["head"]].T


def family_attention(family: str, L: int, block: int | None = None) -> torch.Tensor:
    """[L, L] attention of a family at inference, positions 0..L-1."""
    i = torch.arange(L)
    if family in ("llada", "dream", "llada_moe"):
        return torch.ones(L, L, dtype=torch.bool)
    if family == "idlm":
        return i[None, :] <= i[:, None]
    return (i[None, :] // block) <= (i[:, None] // block)
