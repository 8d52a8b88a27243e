"""DiffusionGemma's sampler (uniform-noise block diffusion): transformers' own ``generate`` vs dlm's engine
(``--decode renoise``) on the same random DiffusionGemma-shaped model, in the same run.

    python bench/renoise.py                                   # a SmolLM2-sized model (hidden 576, 8 layers)
    python bench/renoise.py --hidden 64 --layers 2 --vocab 512 --max-new-tokens 16    # a quick look

The model is random (nothing to download): its text is noise, but a step costs what a trained model's would. Both
run the same number of denoising steps per canvas (``--steps``; the stop rule is off: a random model's entropy
never falls below the confidence bound), one request at a time with the same seed, and then dlm's engine with
``--batch-size`` requests at once. Prints one table (tokens/s, the ratio to transformers, forwards, TPF, the share
of tokens equal to transformers') with the CPU and its load average, and the largest difference between the two
forwards' canvas logits. The draws are aligned (same seed, same order), so the tokens are equal while the logits
are bit for bit; one pass over [prompt | canvas] rounds differently from transformers' encoder-then-decoder (about
1e-5), and over a large vocabulary a multinomial draw flips on such a difference now and then, after which the
canvases part (the tests check token equality on small vocabularies, and the forwards to 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shapes import machine  # noqa: E402  (bench/shapes.py)

from dlm.decode.options import EngineOptions  # noqa: E402


def build(args):
    """The random model: :func:`dlm.testing.make_diffusion_gemma` at the benchmark's shape (Gemma's 5:1 sliding to
    full layers, a window longer than the prompts)."""
    from dlm.testing import make_diffusion_gemma

    h = args.hidden
    heads = max(h // 64, 2)
    layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(args.layers)]
    layer_types[-1] = "full_attention"
    return make_diffusion_gemma(
        vocab_size=args.vocab,
        canvas=args.canvas,
        window=512,
        layer_types=tuple(layer_types),
        experts=args.experts,
        top_k=2,
        hidden=h,
        intermediate_size=int(h * 8 / 3),
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 3, 1),
        head_dim=h // heads,
        global_head_dim=2 * (h // heads),
        max_position_embeddings=4096,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--canvas", type=int, default=32, help="canvas length (tokens)")
    ap.add_argument("--steps", type=int, default=8, help="denoising steps per canvas (both sides)")
    ap.add_argument("--prompts", type=int, default=4, help="requests (prompt lengths 24, 40, 56, ...)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--json", help="write the rows here as JSON")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.families.diffusion_gemma import wrap

    hf = build(args)
    dlm = wrap(hf)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, args.vocab, (24 + 16 * i,), generator=gen).tolist() for i in range(args.prompts)]
    n = args.max_new_tokens
    settings = dict(max_denoising_steps=args.steps, stability_threshold=1, confidence_threshold=1e-9)
    params = SamplingParams(max_new_tokens=n, seed=7, ignore_eos=True)

    # transformers' generate, one request at a time (it runs whole canvases: only the first n tokens count)
    theirs, t0 = [], time.perf_counter()
    for p in prompts:
        torch.manual_seed(7)
        out = hf.generate(torch.tensor([p]), max_new_tokens=n, eos_token_id=-1, **settings)
        theirs.append(out.sequences[0, len(p) : len(p) + n].tolist())
    t_hf = time.perf_counter() - t0

    engine = Engine(
        dlm,
        None,
        decoder="renoise",
        steps=args.steps,
        confidence_threshold=1e-9,
        options=EngineOptions(max_batch_size=1),
    )
    engine.generate([prompts[0]], params)  # warm-up (the CPU kernels' measured choice, allocations)
    t0 = time.perf_counter()
    ours = [engine.generate([p], params)[0] for p in prompts]
    t_one = time.perf_counter() - t0
    batched = Engine(
        dlm,
        None,
        decoder="renoise",
        steps=args.steps,
        confidence_threshold=1e-9,
        options=EngineOptions(max_batch_size=args.batch_size),
    )
    batched.generate(prompts[:1], params)
    t0 = time.perf_counter()
    many = batched.generate(prompts, params)
    t_many = time.perf_counter() - t0

    with torch.no_grad():  # one forward of both on the same prompt and canvas
        p0, c0 = torch.tensor([prompts[0]]), torch.randint(2, args.vocab, (1, args.canvas), generator=gen)
        want = hf(input_ids=p0, decoder_input_ids=c0).logits
        got = dlm.renoise(torch.cat([p0, c0], 1), canvas_from=torch.tensor([p0.shape[1]])).logits[:, p0.shape[1] :]
        logit_diff = float((got - want).abs().max())

    def agree(results) -> float:
        return sum(sum(a == b for a, b in zip(r.token_ids, t)) for r, t in zip(results, theirs)) / (n * len(prompts))

    total = n * len(prompts)
    rows = [
        {"engine": "transformers generate", "batch": 1, "tokens_per_s": total / t_hf, "forwards": None, "same": 1.0},
        {
            "engine": "dlm renoise",
            "batch": 1,
            "tokens_per_s": total / t_one,
            "forwards": sum(r.stats.forwards for r in ours),
            "same": agree(ours),
        },
        {
            "engine": "dlm renoise",
            "batch": args.batch_size,
            "tokens_per_s": total / t_many,
            "forwards": sum(r.stats.forwards for r in many),
            "same": agree(many),
        },
    ]
    params_m = sum(p.numel() for p in hf.model.encoder.language_model.parameters()) / 1e6
    print(
        f"DiffusionGemma-shaped random model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
        f"{args.experts} experts (top 2), {params_m:.1f}M text parameters; canvas {args.canvas}, {args.steps} steps, "
        f"{len(prompts)} prompts x {n} new tokens, fp32"
    )
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"CPU: {machine()}, {torch.get_num_threads()} torch threads, load average {load}")
    print(f"canvas logits, dlm's one pass vs transformers' forward: max |difference| {logit_diff:.1e}")
    print("| engine | batch | tokens/s | vs transformers | forwards | TPF | tokens equal to transformers' |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        r["ratio"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        tpf = f"{total / r['forwards']:.2f}" if r["forwards"] else "-"
        fw = r["forwards"] if r["forwards"] else "-"
        print(
            f"| {r['engine']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['ratio']:.2f}x | {fw} | {tpf} | "
            f"{r['same']:.0%} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
