"""Multiple-choice scoring speed of a diffusion model: our batched denoising score vs the reference protocol.

Both score the same PIQA items with the same T masks per choice (same seeds -> same masks):

- baseline (what the DiffuLLaMA evaluator does): one forward per mask draw, batch 1, full-vocabulary logits at
  every position, CE over the masked tokens;
- dlm: all T masked copies of every (context, choice) in a few padded batches under a full attention mask, only
  the masked positions projected to the vocabulary (:func:`dlm.eval.scoring.denoising_scores`).

Prints examples/s of each, the speed ratio, the largest score difference and whether the predictions agree.

    python bench/eval.py                       # smollm2-135m converted to mdm (untrained: speed only), T=32
    python bench/eval.py --model tiny --limit 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dlm.eval.scoring import as_eval_model, denoising_scores, draw_masks, encode_pair  # noqa: E402
from dlm.eval.tasks import load_task  # noqa: E402
from dlm.model.convert import convert_ar_to_dlm  # noqa: E402

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def baseline_scores(dlm, pairs, keys, steps, seed):
    """The reference protocol: for each pair, for k = T..1, one forward of one masked copy."""
    M = dlm.mask_token_id
    out = []
    with torch.inference_mode():
        for (ctx, cont), key in zip(pairs, keys):
            full = ctx + cont
            masks = draw_masks(len(cont), steps, seed, key)
            losses = []
            for k in reversed(range(steps)):
                where = [len(ctx) + j for j in range(len(cont)) if masks[k, j]]
                if not where:
                    continue
                x = torch.tensor([full])
                x[0, where] = M
                attn = torch.ones(1, 1, len(full), len(full), dtype=torch.bool)
                logits = dlm(input_ids=x, attention_mask=attn).logits[0].float()  # [L, V]: every position
                logits[:, M] = float("-inf")
                rows = [p - 1 for p in where] if dlm.shift else where
                losses.append(float(F.cross_entropy(logits[rows], torch.tensor([full[p] for p in where]))))
            out.append(sum(losses) / len(losses))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="AR alias/folder to convert to mdm, or 'tiny'")
    ap.add_argument("--data", default=os.path.join(SHARED, "piqa"))
    ap.add_argument("--limit", type=int, default=6, help="PIQA items (2 choices each)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-budget", type=int, default=8192)
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.model == "tiny":
        from dlm.testing import make_model, make_tokenizer

        dlm = convert_ar_to_dlm(make_model("llama", hidden=256, layers=4), "mdm", tokenizer=make_tokenizer())
    else:
        dlm = convert_ar_to_dlm(args.model, "mdm")
    em = as_eval_model(dlm)
    examples = load_task("piqa", paths={"piqa": args.data})[: args.limit]
    pairs, keys = [], []
    for i, ex in enumerate(examples):
        for c in ex.choices:
            pairs.append(encode_pair(em, ex.context, c))
            keys.append(f"piqa:{i}")
    n_tok = sum(len(a) + len(b) for a, b in pairs) / len(pairs)
    print(
        f"model {args.model} (mdm, shift={dlm.shift}), {len(examples)} PIQA items, {len(pairs)} pairs of "
        f"~{n_tok:.0f} tokens, T={args.steps}, threads={torch.get_num_threads()}",
        flush=True,
    )

    denoising_scores(em, pairs[:2], keys[:2], steps=2, seed=args.seed)  # warm-up
    t0 = time.perf_counter()
    ours = denoising_scores(em, pairs, keys, steps=args.steps, seed=args.seed, batch_tokens=args.token_budget)
    t_ours = time.perf_counter() - t0
    print(f"dlm batched: {t_ours:.1f} s", flush=True)
    t0 = time.perf_counter()
    ref = baseline_scores(dlm, pairs, keys, args.steps, args.seed)
    t_ref = time.perf_counter() - t0

    def preds(scores):
        return [min(range(len(ex.choices)), key=lambda c: scores[2 * i + c]) for i, ex in enumerate(examples)]

    diff = max(abs(a - b) for a, b in zip(ours, ref))
    n = len(examples)
    print()
    print(f"{'method':<34} {'seconds':>8} {'examples/s':>11} {'ratio':>7}")
    print(f"{'baseline: 1 forward per mask draw':<34} {t_ref:>8.1f} {n / t_ref:>11.3f} {1.0:>7.2f}")
    print(f"{'dlm: batched T masks':<34} {t_ours:>8.1f} {n / t_ours:>11.3f} {t_ref / t_ours:>7.2f}")
    print()
    print(f"max |score difference| = {diff:.2e}; predictions agree: {preds(ours) == preds(ref)}")


if __name__ == "__main__":
    main()
