"""Prompt lookup decoding (``--decode ar --prompt-lookup K``) against plain AR, in the same run.

Chat requests whose answers copy from the prompt (repeat a passage, correct a few words in it, continue a list)
and one that does not (an open question), greedy, batch 1: per task the tokens per forward, the draft acceptance
and the whole-request time of AR with prompt lookup against plain AR (alternated, median of ``--rounds``). Every
output is checked equal to plain AR's (greedy prompt lookup is AR token for token); the script exits non-zero
where one is not.

    python bench/prompt_lookup.py                       # smollm2-135m, K = 4
    python bench/prompt_lookup.py --k 2,4,8 --max-new-tokens 96 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

PASSAGE = (
    "The quick brown fox jumps over the lazy dog. A diffusion language model denoises masked tokens, while an "
    "autoregressive model predicts the next token from the ones before it. Speculative decoding drafts several "
    "tokens cheaply and verifies them in one forward pass of the large model."
)
TASKS = {
    "repeat": f"Repeat this text exactly, word for word:\n\n{PASSAGE}",
    "correct": "Rewrite this text with its spelling fixed and nothing else changed:\n\n"
    + PASSAGE.replace("quick", "qiuck").replace("tokens", "tokns").replace("verifies", "verfies"),
    "list": "Continue the list in the same format: 1. apples 2. pears 3. plums 4. cherries 5.",
    "open": "Why is the sky blue? Answer in three sentences.",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", default="4", help="drafts per step, comma-separated (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    import torch

    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.hub import load_model, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.model)
    model = load_model(args.model)
    params = SamplingParams(args.max_new_tokens)
    prompts = {
        name: tok(
            tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        for name, text in TASKS.items()
    }
    ks = [int(k) for k in args.k.split(",")]
    engines = {0: Engine(model, tok, decoder="ar")}
    engines.update({k: Engine(model, tok, decoder="ar", prompt_lookup=k) for k in ks})
    load = os.getloadavg()[0]
    print(f"{args.model}, torch threads {torch.get_num_threads()}, load {load:.1f}, greedy, batch 1")
    print("| task | K | new tokens | TPF | acceptance | time vs AR | same as AR |")
    print("|---|---|---|---|---|---|---|")
    bad = 0
    for name, ids in prompts.items():
        times: dict[int, list[float]] = {k: [] for k in engines}
        results = {}
        for _ in range(args.rounds):
            for k, eng in engines.items():
                t0 = time.perf_counter()
                results[k] = eng.generate([ids], params)[0]
                times[k].append(time.perf_counter() - t0)
        base = statistics.median(times[0])
        for k in ks:
            r = results[k]
            same = r.token_ids == results[0].token_ids
            bad += not same
            acc = r.stats.accepted[0] / r.stats.proposed[0] if r.stats.proposed and r.stats.proposed[0] else 0.0
            print(
                f"| {name} | {k} | {len(r.token_ids)} | {r.stats.tpf:.2f} | {acc:.2f} | "
                f"{base / statistics.median(times[k]):.2f}x | {'yes' if same else 'NO'} |"
            )
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    if bad:
        print(f"{bad} outputs differ from plain AR's", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
