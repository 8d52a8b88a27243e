"""The engine's KV cache: in-place appends into a growing buffer vs transformers' DynamicLayer (a torch.cat of the
whole cache in every layer at every step), A/B in one process.

    python bench/kv_cache.py --model runs/quickstart/train_b2 --context 128,512 --batch-sizes 1,8

For each context length and batch size: ``ar`` and ``isd`` (stride 2) decode ``--new-tokens`` tokens greedily
(EOS ignored) with each cache, the two alternated per repeat; best of ``--repeats`` (the least disturbed run on a
shared machine). Prints tokens/s and the growing/cat ratio, and checks that the tokens are identical.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from dlm.decode.options import EngineOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="an I-DLM checkpoint, or an AR model (converted)")
    ap.add_argument("--context", default="128,512", help="prompt lengths (tokens)")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    from dlm.decode import engine as engine_mod
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import load_any

    dlm = load_any(args.model, "idlm")
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    print(f"model={args.model} new_tokens={args.new_tokens} best of {args.repeats} threads={torch.get_num_threads()}")
    hdr = f"{'context':>7} {'batch':>5} {'decoder':<8} {'cat tok/s':>9} {'growing':>8} {'ratio':>6} {'same':>5}"
    print(hdr)
    print("-" * len(hdr))
    for ctx in [int(c) for c in args.context.split(",")]:
        for b in [int(x) for x in args.batch_sizes.split(",")]:
            # different lengths in a batch: the merges leave holes, as in serving
            prompts = [[1000 + (7 * i + j) % 5000 for j in range(ctx - i)] for i in range(b)]
            for dec, kw in (("ar", {}), ("isd", {"stride": 2})):
                best, tokens = {}, {}
                for _ in range(args.repeats):
                    for growing in (False, True):
                        engine_mod.GROWING_CACHE = growing
                        eng = Engine(dlm, dlm.tokenizer, decoder=dec, options=EngineOptions(max_batch_size=b), **kw)
                        t = time.perf_counter()
                        out = [r.token_ids for r in eng.generate(prompts, params)]
                        s = time.perf_counter() - t
                        best[growing] = min(best.get(growing, s), s)
                        tokens.setdefault(growing, out)
                n = b * args.new_tokens
                print(
                    f"{ctx:>7} {b:>5} {dec:<8} {n / best[False]:>9.1f} {n / best[True]:>8.1f} "
                    f"{best[False] / best[True]:>6.2f} {str(tokens[False] == tokens[True]):>5}",
                    flush=True,
                )
    engine_mod.GROWING_CACHE = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
