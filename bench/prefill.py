"""Prefill of prompts that share tokens, in the same run against prompts that do not.

``--mode choices`` (default): ``n`` choices of one prompt (computed once and copied) against ``n`` distinct prompts
of the same length (what the same requests cost without the sharing). Each measurement adds the n requests to a
fresh engine and times its first ``step()`` (the prefill forward and the first token of every request).

``--mode prefix``: one request after another whose prompts start with the same ``--prompt-tokens`` tokens (a system
prompt, a document, a conversation so far) followed by ``--new-tokens`` of their own, on an engine with the prefix
cache (``prefix_cache``, warmed by one such request) against one without; the first step of each request is timed.

    python bench/prefill.py                                  # smollm2-135m, 512-token prompts, n = 1, 4, 8
    python bench/prefill.py --prompt-tokens 128,1024 --n 8 --decode isd
    python bench/prefill.py --mode prefix --prompt-tokens 256,1024 --new-tokens 16,64

The two kinds alternate per repeat; the median is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", default="512")
    ap.add_argument("--n", default="1,4,8")
    ap.add_argument("--mode", choices=("choices", "prefix"), default="choices")
    ap.add_argument(
        "--new-tokens", default="16,64", help="--mode prefix: each prompt's own tokens after the shared ones"
    )
    ap.add_argument("--decode", default="ar")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    import torch

    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import load_any
    from dlm.model.hub import resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model)
    model = load_any(folder, convert_to="idlm" if args.decode == "isd" else None)
    vocab = int(model.config.vocab_size if hasattr(model, "config") else model.hf_config.vocab_size)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def first_step(prompts, eng=None) -> float:
        own = eng is None
        eng = eng or Engine(model, decoder=args.decode, max_batch_size=len(prompts))
        for p in prompts:
            eng.add(p, params)
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        while eng.has_unfinished():
            eng.step()
        eng.results.clear()
        if own:
            eng.close()
        return dt

    load = os.getloadavg()[0]
    print(f"{args.model}, --decode {args.decode}, torch threads {torch.get_num_threads()}, load {load:.1f}")
    rand = lambda k: torch.randint(100, vocab - 100, (k,), generator=g).tolist()  # noqa: E731
    if args.mode == "prefix":
        print(f"{'shared':>7} {'new':>4} {'no cache ms':>12} {'cache ms':>9} {'speed-up':>9}")
        for length in [int(x) for x in args.prompt_tokens.split(",")]:
            for new in [int(x) for x in args.new_tokens.split(",")]:
                shared = rand(length)
                off = Engine(model, decoder=args.decode, max_batch_size=1)
                on = Engine(model, decoder=args.decode, max_batch_size=1, prefix_cache=4 * (length + new))
                first_step([shared + rand(new)], on)  # warm-up; the cache now holds the shared tokens
                first_step([shared + rand(new)], off)
                t_off, t_on = [], []
                for _ in range(args.repeats):
                    t_off.append(first_step([shared + rand(new)], off))
                    t_on.append(first_step([shared + rand(new)], on))
                a, b = statistics.median(t_off) * 1e3, statistics.median(t_on) * 1e3
                print(f"{length:>7} {new:>4} {a:>12.1f} {b:>9.1f} {a / b:>8.2f}x")
                off.close()
                on.close()
        return
    print(f"{'prompt':>7} {'n':>3} {'distinct ms':>12} {'same ms':>9} {'speed-up':>9}")
    for length in [int(x) for x in args.prompt_tokens.split(",")]:
        for n in [int(x) for x in args.n.split(",")]:
            same = [rand(length)] * n
            distinct = [rand(length) for _ in range(n)]
            first_step(same[:1])  # warm-up
            t_same, t_distinct = [], []
            for _ in range(args.repeats):
                t_distinct.append(first_step(distinct))
                t_same.append(first_step(same))
            a, b = statistics.median(t_distinct) * 1e3, statistics.median(t_same) * 1e3
            print(f"{length:>7} {n:>3} {a:>12.1f} {b:>9.1f} {a / b:>8.2f}x")


if __name__ == "__main__":
    main()
