"""Make the golden references in this folder from the published families' own code.

Not part of the test run: it needs each family's configuration and modeling files and sampler (not shipped with
dlm) importable from ``--refs`` (layout in README.md), in an environment with the transformers version they were
written for. For each family it builds a tiny random checkpoint with the family's own classes, saves it as the
family saves it (``save_pretrained``), and records what the family's own code computes on it: a forward's logits and
its sampler's token ids over a set of calls. tests/test_goldens.py compares dlm against these files.

    python tests/goldens/make_goldens.py --refs REFS --out tests/goldens
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

VOCAB, MASK, EOS, PAD = 336, 320, 0, 3
HIDDEN, LAYERS, HEADS, HEAD_DIM, FFN, POSITIONS = 32, 2, 4, 8, 64, 256
# the matrices that add into the residual stream (their row 0 is zeroed, see suppress_mask)
WRITERS = ("o_proj", "down_proj", "attn_out", "dense", "ff_out")
# queries and keys larger than the rest, so attention (and through it the position) tells the masks apart
QK = ("q_proj", "k_proj", "query_key_value")
QK_NORMS = ("q_norm", "k_norm", "query_layernorm", "key_layernorm")
PROMPTS = {"short": [5, 6, 7, 8, 9], "aligned": [10, 11, 12, 13, 14, 15, 16, 17], "three": [20, 21, 22]}
# on the SDAR checkpoint, a prompt whose greedy output differs between thresholds 0.85 (SDAR's) and 0.9
PROMPTS["threshold"] = [185, 175, 285, 288, 231, 47, 275, 154]


def randomise(model: torch.nn.Module, seed: int, head_scale: float) -> None:
    """Replace the family's initialisation (std 0.02: every prediction nearly uniform) by weights that give the
    samplers' rules something to decide: matrices N(0, 0.15), queries and keys N(0, 0.6) (their norms 3 + N(0, 0.3)),
    embeddings N(0, 1), norms 1 + N(0, 0.1), the output head N(0, head_scale)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.ndim == 1 and any(k in name for k in QK_NORMS):
                p.copy_(3.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                norm = name.endswith("weight")  # (a bias is named bias)
                p.copy_((1.0 if norm else 0.0) + (0.1 if norm else 0.05) * torch.randn(p.shape, generator=g))
            elif any(k in name for k in QK):
                p.copy_(0.6 * torch.randn(p.shape, generator=g))
            elif p.shape[0] == VOCAB and _is_embedding(name):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.shape[0] == VOCAB:
                p.copy_(head_scale * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def _is_embedding(name: str) -> bool:
    return any(k in name for k in ("embed_tokens", "wte", "word_embeddings"))


def suppress_mask(model: torch.nn.Module) -> None:
    """A trained DLM never predicts the mask token; a random one does, and the families' samplers differ from dlm's
    only in whether they may propose it. So the residual stream's dimension 0 is made a constant 5 (the embedding's
    column 0; every matrix that writes into the stream has row 0 zero), the final norm passes it (weight 1), and
    the output head reads it only in the mask's row, at -30: the mask's logit sits at least 30 below the best
    (e^-30: under float32's resolution)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and p.shape[0] == VOCAB and _is_embedding(name):
                p[:, 0] = 5.0
            elif p.ndim == 2 and p.shape[0] == VOCAB:
                p[:, 0] = 0.0
                p[MASK] = 0.0
                p[MASK, 0] = -30.0
            elif p.ndim == 2 and p.shape[0] == HIDDEN and name.rsplit(".", 2)[-2] in WRITERS:
                p[0] = 0.0
            elif p.ndim == 3 and "down" in name:  # stacked experts (E, hidden, width)
                p[:, 0] = 0.0
            elif p.ndim == 1 and p.shape[0] == HIDDEN and name.rsplit(".", 2)[-2] in WRITERS:
                p[0] = 0.0
        final = [p for n, p in model.named_parameters() if n.endswith(("model.norm.weight", "ln_f.weight"))]
        assert len(final) == 1, "no final norm found"
        final[0][0] = 1.0


def check_mask_suppressed(logits: torch.Tensor) -> None:
    others = torch.cat([logits[..., :MASK], logits[..., MASK + 1 :]], -1)
    gap = others.max(-1).values - logits[..., MASK]
    assert float(gap.min()) > 30, f"mask logit only {float(gap.min()):.1f} below the best"


def save(model, out: Path, forward_ids: list[int], logits: torch.Tensor, attention=None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tensors = {"input_ids": torch.tensor(forward_ids), "logits": logits.float().contiguous()}
    if attention is not None:
        tensors["attention"] = attention.contiguous()
    save_file(tensors, str(out / "forward.safetensors"))


def write_runs(out: Path, source: dict, runs: list[dict]) -> None:
    (out / "runs.json").write_text(json.dumps({"source": source, "runs": runs}, indent=1) + "\n")


def block_attention(n: int, block: int) -> torch.Tensor:
    i = torch.arange(n)
    return (i[None, :] // block) <= (i[:, None] // block)


FORWARD_IDS = [5, 6, 7, 8, 9, MASK, MASK, 11, MASK, 12, 13, MASK]


# -- LLaDA (and LLaDA-MoE): LLaDA's generate.py ---------------------------------------------------------------------
def llada_runs(model, generate, mask_id) -> list[dict]:
    calls = [
        ("one block, a token a step", "short", dict(steps=8, gen_length=8, block_length=8)),
        ("semi-autoregressive blocks", "short", dict(steps=4, gen_length=8, block_length=4)),
        ("two tokens a step", "three", dict(steps=6, gen_length=12, block_length=12)),
        ("uneven split 5 over 3", "short", dict(steps=3, gen_length=5, block_length=5)),
        ("guidance", "three", dict(steps=4, gen_length=8, block_length=4, cfg_scale=1.5)),
    ]
    runs = []
    for name, prompt, kw in calls:
        x = torch.tensor([PROMPTS[prompt]])
        full = dict(temperature=0.0, remasking="low_confidence", mask_id=mask_id, **kw)
        # an all-ones attention mask as its main() passes (with guidance and none, generate() fails)
        out = generate(model, x, attention_mask=torch.ones_like(x), **full)[0, x.shape[1] :].tolist()
        runs.append({"name": name, "prompt": PROMPTS[prompt], "call": full, "output": out})
    return runs


def make_llada(refs: Path, out: Path) -> None:
    sys.path.insert(0, str(refs))
    from llada.generate import generate
    from llada.models.configuration_llada import LLaDAConfig
    from llada.models.modeling_llada import LLaDAModel, LLaDAModelLM, create_model_config_from_pretrained_config

    config = LLaDAConfig(
        d_model=HIDDEN, n_heads=HEADS, n_kv_heads=HEADS, n_layers=LAYERS, mlp_hidden_size=FFN, mlp_ratio=4,
        vocab_size=VOCAB, embedding_size=VOCAB, max_sequence_length=POSITIONS, block_type="llama",
        activation_type="silu", layer_norm_type="rms", rms_norm_eps=1e-5, rope=True, rope_theta=500000.0,
        include_bias=False, include_qkv_bias=False, weight_tying=False, alibi=False, flash_attention=False,
        init_device="cpu", mask_token_id=MASK, eos_token_id=EOS, pad_token_id=PAD, input_emb_norm=False,
        scale_logits=False, attention_layer_norm=False, attention_dropout=0.0, residual_dropout=0.0,
        embedding_dropout=0.0,
    )  # fmt: skip
    inner = create_model_config_from_pretrained_config(config)
    inner.init_device = "cpu"  # LLaDAModelLM would build on "cuda"
    model = LLaDAModelLM(config, model=LLaDAModel(inner, init_params=True)).eval()
    randomise(model, seed=1, head_scale=0.6)
    suppress_mask(model)
    with torch.no_grad():
        logits = model(torch.tensor([FORWARD_IDS])).logits[0]
    check_mask_suppressed(logits)
    save(model, out, FORWARD_IDS, logits)
    runs = llada_runs(model, generate, MASK)
    write_runs(out, {"modeling": "modeling_llada.py", "sampler": "generate.py: generate"}, runs)


def make_llada_moe(refs: Path, out: Path) -> None:
    sys.path.insert(0, str(refs))
    from llada.generate import generate
    from llada.models.configuration_lladamoe import LLaDAMoEConfig
    from llada.models.modeling_lladamoe import LLaDAMoEModelLM

    config = LLaDAMoEConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, dense_intermediate_size=FFN, expert_intermediate_size=16,
        shared_expert_intermediate_size=None, num_hidden_layers=3, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, max_position_embeddings=POSITIONS, rms_norm_eps=1e-5, rope_theta=50000.0,
        partial_rotary_factor=1.0, num_experts=8, num_experts_per_tok=3, norm_topk_prob=None, qk_layernorm=True,
        moe_layer_freq=[1, 0, 1], moe_router_enable_expert_bias=False, moe_router_score_function="softmax",
        routed_scaling_factor=1, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
        mask_token_id=MASK,  # (the published file has none: its mask id 156895 is no row of this vocabulary)
    )  # fmt: skip
    model = LLaDAMoEModelLM(config).eval()
    randomise(model, seed=2, head_scale=0.6)
    suppress_mask(model)
    with torch.no_grad():
        logits = model(torch.tensor([FORWARD_IDS])).logits[0]
    check_mask_suppressed(logits)
    save(model, out, FORWARD_IDS, logits)
    # the published LLaDA-MoE config.json names the model type "llada" (dllm's copy of the class renames it)
    cfg = json.loads((out / "config.json").read_text())
    cfg["model_type"] = "llada"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    runs = llada_runs(model, generate, MASK)
    write_runs(out, {"modeling": "modeling_lladamoe.py", "sampler": "generate.py: generate"}, runs)


# -- Dream: DreamModel.diffusion_generate -----------------------------------------------------------------------------
def make_dream(refs: Path, out: Path) -> None:
    sys.path.insert(0, str(refs))
    from dream.models import generation_utils
    from dream.models.configuration_dream import DreamConfig
    from dream.models.modeling_dream import DreamModel

    # the hub's generation_utils.py names this field return_dict_in_generate (dllm's copy renamed it, which breaks
    # DreamGenerationConfig.from_model_config - the path a plain call takes); restored as the hub file has it
    generation_utils.DreamGenerationConfig.return_dict_in_generate = False

    config = DreamConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, mask_token_id=MASK, pad_token_id=PAD, bos_token_id=EOS,
        eos_token_id=EOS,
    )  # fmt: skip
    model = DreamModel(config).eval()
    randomise(model, seed=3, head_scale=0.6)
    suppress_mask(model)
    with torch.no_grad():
        logits = model(torch.tensor([FORWARD_IDS])).logits[0]
    check_mask_suppressed(logits)
    save(model, out, FORWARD_IDS, logits)
    # the published generation_config.json (its values are not what diffusion_generate uses when called plainly)
    (out / "generation_config.json").write_text(
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
            },
            indent=2,
        )  # fmt: skip
        + "\n"
    )
    calls = [
        ("entropy, a token a step", "short", dict(max_new_tokens=8, steps=8, alg="entropy")),
        ("entropy, float32 reveal counts", "three", dict(max_new_tokens=11, steps=4, alg="entropy")),
        ("maskgit_plus", "short", dict(max_new_tokens=10, steps=5, alg="maskgit_plus")),
        ("topk_margin", "three", dict(max_new_tokens=9, steps=4, alg="topk_margin")),
        ("top_p ties at temperature 0", "short", dict(max_new_tokens=10, steps=4, alg="maskgit_plus", top_p=0.05)),
        ("top_p ties, entropy", "three", dict(max_new_tokens=12, steps=3, alg="entropy", top_p=0.05)),
        ("explicit top_k None", "short", dict(max_new_tokens=10, steps=5, alg="maskgit_plus", top_k=None)),
        # 996 masks over 27 steps: at pass 4 the float32 count reveals one more than the float64 one would
        ("float32 count, 996 tokens", "three", dict(max_new_tokens=996, steps=27, alg="maskgit_plus")),
    ]
    runs = []
    for name, prompt, kw in calls:
        x = torch.tensor([PROMPTS[prompt]])
        full = dict(temperature=0.0, **kw)
        effective = model._prepare_generation_config(None, **full)
        result = model.diffusion_generate(x, **full)
        result = getattr(result, "sequences", result)  # a DreamModelOutput where the config says return_dict
        out_ids = result[0, x.shape[1] :].tolist()
        runs.append(
            {
                "name": name,
                "prompt": PROMPTS[prompt],
                "call": full,
                "effective": {"top_k": effective.top_k, "top_p": effective.top_p, "eps": effective.eps},
                "output": out_ids,
            }
        )
    write_runs(out, {"modeling": "modeling_dream.py", "sampler": "generation_utils.py: diffusion_generate"}, runs)


# -- SDAR: generate.py block_diffusion_generate -----------------------------------------------------------------------
def make_sdar(refs: Path, out: Path, shims: Path) -> None:
    sys.path.insert(0, str(shims))
    sys.path.insert(0, str(refs / "sdar"))
    from configuration_sdar import SDARConfig
    from modeling_sdar import SDARForCausalLM

    sys.path.insert(0, str(refs))
    import sdar.generate as sdar_generate

    config = SDARConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=POSITIONS,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
        block_size=4, mask_token_id=MASK, eos_token_id=EOS, bos_token_id=EOS, pad_token_id=PAD,
        attn_implementation="sdpa", fuse_cross_entropy=False, debug=False, ep_size=1, micro_forward=False,
        skip_checkpoint=False, use_deepep=False, sliding_window=None,
    )  # fmt: skip
    model = SDARForCausalLM(config).eval()
    randomise(model, seed=4, head_scale=1.5)  # peaked enough for thresholds near 0.85 to matter
    suppress_mask(model)
    n = len(FORWARD_IDS)
    attention = block_attention(n, 4)
    with torch.no_grad():
        logits = model(torch.tensor([FORWARD_IDS]), attention_mask=attention[None]).logits[0]
    check_mask_suppressed(logits)
    save(model, out, FORWARD_IDS, logits, attention)
    cfg = json.loads((out / "config.json").read_text())
    cfg["attn_implementation"] = "flex_attention"  # as the published folders carry it
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    # SDAR's generate always samples (torch.multinomial); its argmax stands in for the draw here, so the confidences
    # are the temperature-1 probabilities of the argmax - dlm's greedy decoding
    def argmax_draw(probs, num_samples=1, **_):
        return probs.argmax(-1, keepdim=True)

    sdar_generate.torch.multinomial = argmax_draw
    calls = [
        ("the default call", "aligned", dict(gen_length=8, block_length=4, denoising_steps=4)),
        ("the default threshold decides", "threshold", dict(gen_length=16, block_length=4, denoising_steps=4)),
        ("threshold 0.5", "aligned", dict(gen_length=12, block_length=4, denoising_steps=4, confidence_threshold=0.5)),
        ("static", "aligned", dict(gen_length=8, block_length=4, denoising_steps=2,
                                   remasking_strategy="low_confidence_static")),
        ("sequential", "aligned", dict(gen_length=8, block_length=4, denoising_steps=4,
                                       remasking_strategy="sequential")),
        ("quota over the masks left", "aligned", dict(gen_length=12, block_length=4, denoising_steps=2,
                                                       confidence_threshold=0.3)),
        ("prompt tail, quota within the masks", "short", dict(gen_length=7, block_length=4, denoising_steps=4)),
        ("prompt tail, quota over the masks", "short",
         dict(gen_length=7, block_length=4, denoising_steps=2, confidence_threshold=0.99)),
        ("prompt tail, SDAR overwrites the prompt", "three",
         dict(gen_length=9, block_length=4, denoising_steps=2, confidence_threshold=0.99)),
    ]  # fmt: skip
    runs = []
    for name, prompt, kw in calls:
        x = torch.tensor([PROMPTS[prompt]])
        full = dict(mask_id=MASK, temperature=1.0, top_k=0, top_p=1.0, **kw)
        seq = sdar_generate.block_diffusion_generate(model, {"input_ids": x}, **full)[0]
        runs.append(
            {
                "name": name,
                "prompt": PROMPTS[prompt],
                "call": full,
                "output": seq[x.shape[1] : x.shape[1] + kw["gen_length"]].tolist(),
                "sequence": seq.tolist(),
            }
        )
    write_runs(
        out,
        {"modeling": "modeling_sdar.py", "sampler": "generate.py: block_diffusion_generate (argmax for the draw)"},
        runs,
    )


# -- LLaDA2: LLaDA2MoeModelLM.generate --------------------------------------------------------------------------------
def make_llada2(refs: Path, out: Path) -> None:
    sys.path.insert(0, str(refs))
    from llada2.models.configuration_llada2_moe import LLaDA2MoeConfig
    from llada2.models.modeling_llada2_moe import LLaDA2MoeModelLM

    config = LLaDA2MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=3, num_attention_heads=HEADS,
        num_key_value_heads=2, head_dim=HEAD_DIM, use_qkv_bias=False, use_bias=False, use_qk_norm=True,
        rms_norm_eps=1e-6, norm_head=False, tie_word_embeddings=False, max_position_embeddings=POSITIONS,
        rope_theta=600000, partial_rotary_factor=0.5, num_experts=8, num_shared_experts=1, num_experts_per_tok=3,
        n_group=4, topk_group=2, moe_intermediate_size=16, first_k_dense_replace=1, routed_scaling_factor=2.5,
        score_function="sigmoid", moe_router_enable_expert_bias=True, norm_topk_prob=True, router_dtype="fp32",
        pad_token_id=PAD, eos_token_id=EOS, mask_token_id=MASK,
    )  # fmt: skip
    model = LLaDA2MoeModelLM(config).eval()
    randomise(model, seed=5, head_scale=1.5)  # peaked enough for thresholds near 0.95 to matter
    suppress_mask(model)
    n = len(FORWARD_IDS)
    attention = block_attention(n, 4)
    with torch.no_grad():
        bias = torch.zeros(n, n).masked_fill(~attention, float("-inf"))
        logits = model(torch.tensor([FORWARD_IDS]), attention_mask=bias[None, None]).logits[0]
    check_mask_suppressed(logits)
    save(model, out, FORWARD_IDS, logits, attention)
    # its defaults: block_length 32, steps 32 (capped at gen_length), threshold 0.95, eos_id 156892 (no token here)
    calls = [
        ("the default call", "aligned", dict(gen_length=56)),
        ("fewer new tokens than steps", "short", dict(gen_length=27)),
        ("threshold 0.4, 8 steps", "aligned", dict(gen_length=40, steps=8, threshold=0.4)),
        ("three steps, uneven quotas", "three", dict(gen_length=29, steps=3, threshold=0.3)),
    ]
    # generate() builds its block mask (0 / -inf) in bfloat16, which SDPA refuses beside float32 queries (the
    # published weights are bfloat16); the same values in float32 at the call
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa_float_mask(q, k, v, attn_mask=None, **kw):
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(q.dtype)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    torch.nn.functional.scaled_dot_product_attention = sdpa_float_mask
    runs = []
    for name, prompt, kw in calls:
        x = torch.tensor([PROMPTS[prompt]])
        full = dict(mask_id=MASK, **kw)
        out_ids = model.generate(x, **full)[0].tolist()
        runs.append({"name": name, "prompt": PROMPTS[prompt], "call": full, "output": out_ids})
    write_runs(out, {"modeling": "modeling_llada2_moe.py", "sampler": "LLaDA2MoeModelLM.generate"}, runs)


MAKERS = {
    "llada": make_llada,
    "llada_moe": make_llada_moe,
    "dream": make_dream,
    "sdar": make_sdar,
    "llada2": make_llada2,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refs", type=Path, required=True, help="folder holding the families' own files")
    ap.add_argument(
        "--shims", type=Path, default=Path(__file__).parent / "cpu_shims", help="CPU stand-ins for SDAR's CUDA imports"
    )
    ap.add_argument("--out", type=Path, default=Path(__file__).parent)
    ap.add_argument("families", nargs="*", default=list(MAKERS))
    args = ap.parse_args()
    torch.manual_seed(0)
    for family in args.families:
        kwargs = {"shims": args.shims} if family == "sdar" else {}
        MAKERS[family](args.refs, args.out / family, **kwargs)
        print(family, "written")


if __name__ == "__main__":
    main()
