"""Diffusion decoding on the batching engine: mdm samplers and block decoding, one request at a time (the plain
per-request loop dlm ran before, kept in tests/diffusion_reference.py) vs the engine at batch 1 and at batch B.

    python bench/diffusion.py                                 # smollm2-135m converted on the fly, LAMBADA prompts
    python bench/diffusion.py --mdm runs/mdm --block runs/block --max-new-tokens 64

A plain AR model is converted to an untrained mdm (shift) and block (block size 4) DLM: the text is noise, but the
passes cost what a trained model's would (the threshold samplers commit about one token per pass when untrained).
EOS is ignored so every request decodes exactly ``--max-new-tokens`` positions. Greedy. Prints one table:
tokens/s, the ratio to the per-request loop, forwards per request (summed) and TPF, the number of model calls (a
batched call advances many requests) and whether the tokens equal the loop's.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from decode import DEFAULT_DATA, read_prompts  # noqa: E402  (bench/decode.py)

from dlm.decode.options import EngineOptions  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="smollm2-135m", help="AR model converted on the fly when --mdm/--block are not given"
    )
    ap.add_argument("--mdm", help="an mdm DLM folder (default: --model converted)")
    ap.add_argument("--block", help="a block DLM folder (default: --model converted with --block-size)")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument(
        "--configs",
        default="mdm-confidence,mdm-threshold,block",
        help="comma list of mdm-confidence, mdm-random, mdm-threshold, block",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    from diffusion_reference import reference_block, reference_mdm

    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import load_any

    k = args.max_new_tokens
    configs = {
        "mdm-confidence": ("mdm", {"method": "confidence", "steps": max(k // 2, 1)}),
        "mdm-random": ("mdm", {"method": "random", "steps": max(k // 2, 1)}),
        "mdm-threshold": ("mdm", {"method": "threshold", "block_length": 8, "threshold": 0.9}),
        "block": ("block", {"steps": args.block_size, "threshold": 0.9}),
    }
    wanted = [c for c in args.configs.split(",") if c]
    for c in wanted:
        if c not in configs:
            ap.error(f"--configs: unknown '{c}' (use {', '.join(configs)})")
    models = {}
    for objective in sorted({configs[c][0] for c in wanted}):
        path = getattr(args, objective) or args.model
        kw = {"block_size": args.block_size} if objective == "block" and not getattr(args, objective) else {}
        models[objective] = load_any(path, objective, **kw)
    tok = next(iter(models.values())).tokenizer
    texts = read_prompts(Path(args.data), args.batch_size)
    prompts = [tok(t, add_special_tokens=False)["input_ids"][-args.prompt_tokens :] for t in texts]
    params = SamplingParams(max_new_tokens=k, ignore_eos=True)

    print(
        f"model={args.model} prompts={len(prompts)} x <= {args.prompt_tokens} tokens, new_tokens={k}, "
        f"threads={torch.get_num_threads()}"
    )
    hdr = (
        f"{'decoder':<16} {'run':<14} {'tok/s':>7} {'x loop':>7} {'forwards':>8} {'TPF':>5} {'model calls':>11} "
        f"{'= loop':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name in wanted:
        objective, kw = configs[name]
        dlm = models[objective]
        ref_fn = reference_mdm if objective == "mdm" else reference_block
        ref_fn(dlm, prompts[0][:8], SamplingParams(max_new_tokens=2, ignore_eos=True), **kw)  # warm-up
        t = time.perf_counter()
        ref = [ref_fn(dlm, p, params, **kw) for p in prompts]
        loop_s = time.perf_counter() - t
        n_tok = sum(len(ids) for ids, _ in ref)
        loop_tps = n_tok / loop_s
        fw = sum(f for _, f in ref)
        print(
            f"{name:<16} {'per-request':<14} {loop_tps:>7.1f} {1.0:>7.2f} {fw:>8} {n_tok / fw:>5.2f} {fw:>11} {'':>6}",
            flush=True,
        )
        for b in sorted({1, args.batch_size}):
            engine = Engine(dlm, tok, decoder=objective, options=EngineOptions(max_batch_size=b), **kw)
            t = time.perf_counter()
            res = engine.generate(prompts, params)
            s = time.perf_counter() - t
            got = sum(len(r.token_ids) for r in res)
            same = all(r.token_ids == ids for r, (ids, _) in zip(res, ref))
            fw = sum(r.stats.forwards for r in res)  # per request, as for the loop; model calls: batched
            print(
                f"{name:<16} {f'engine b{b}':<14} {got / s:>7.1f} {got / s / loop_tps:>7.2f} {fw:>8} "
                f"{got / fw:>5.2f} {engine.total_forwards:>11} {str(same):>6}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
