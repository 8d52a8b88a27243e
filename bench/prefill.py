"""Prefill of prompts that share tokens, in the same run against prompts that do not.

``--mode choices`` (default): ``n`` choices of one prompt (computed once and copied) against ``n`` distinct prompts
of the same length (what the same requests cost without the sharing). Each measurement adds the n requests to a
fresh engine and times its first ``step()`` (the prefill forward and the first token of every request).

``--mode prefix``: one request after another whose prompts start with the same ``--prompt-tokens`` tokens (a system
prompt, a document, a conversation so far) followed by ``--new-tokens`` of their own, on an engine with the prefix
cache (``prefix_cache``, warmed by one such request) against one without; the first step of each request is timed.

    python bench/prefill.py                                  # smollm2-135m, 512-token prompts, n = 1, 4, 8
    python bench/prefill.py --prompt-tokens 128,1024 --n 8 --decode isd
``--mode chat``: ``--conversations`` chats taken in turn, ``--turns`` each, on one engine (batch 1): a turn's
prompt is the chat so far (a shared ``--prompt-tokens`` system prompt, then each earlier turn's user tokens and
answer) and ``--new-tokens`` user tokens; the answer is ``--answer-tokens`` long. Run with the prefix cache at
``--cache-tokens`` (the radix tree), with a flat cache of the same budget that keeps a copy of each stored prompt
(dlm's cache before the tree: a conversation's turns each stored whole) and without a cache: the prompt tokens the
prefills computed, the share the cache saved, the tokens kept at the end and the time of the whole run.

    python bench/prefill.py --mode prefix --prompt-tokens 256,1024 --new-tokens 16,64
    python bench/prefill.py --mode chat --conversations 8 --turns 6 --cache-tokens 4096

The kinds alternate per repeat; the median is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from dlm.decode.options import EngineOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", default="512")
    ap.add_argument("--n", default="1,4,8")
    ap.add_argument("--mode", choices=("choices", "prefix", "chat"), default="choices")
    ap.add_argument("--conversations", type=int, default=8, help="--mode chat: chats taken in turn")
    ap.add_argument("--turns", type=int, default=6, help="--mode chat: turns of each chat")
    ap.add_argument("--answer-tokens", type=int, default=32, help="--mode chat: each answer's length")
    ap.add_argument("--cache-tokens", type=int, default=4096, help="--mode chat: the prefix cache's budget")
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
        eng = eng or Engine(model, decoder=args.decode, options=EngineOptions(max_batch_size=len(prompts)))
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
    if args.mode == "chat":
        chat(args, model, rand)
        return
    if args.mode == "prefix":
        print(f"{'shared':>7} {'new':>4} {'no cache ms':>12} {'cache ms':>9} {'speed-up':>9}")
        for length in [int(x) for x in args.prompt_tokens.split(",")]:
            for new in [int(x) for x in args.new_tokens.split(",")]:
                shared = rand(length)
                off = Engine(model, decoder=args.decode, options=EngineOptions(max_batch_size=1))
                on = Engine(
                    model, decoder=args.decode, options=EngineOptions(max_batch_size=1, prefix_cache=4 * (length + new))
                )
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


class FlatPrefixCache:
    """The baseline: a copy of each stored prompt's KV, found by comparing the new prompt with every stored one
    (least recently used prompts evicted beyond the budget) - how dlm kept prompts before the radix tree."""

    def __init__(self, max_tokens: int, min_tokens: int = 16):
        from collections import OrderedDict

        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self.entries: OrderedDict = OrderedDict()
        self.stored_tokens = self.hits = self.reused_tokens = 0

    def lookup(self, prompt):
        limit, best, key = len(prompt) - 1, 0, None
        for k in self.entries:
            c = 0
            while c < min(limit, len(k)) and k[c] == prompt[c]:
                c += 1
            if c > best:
                best, key = c, k
        if key is None or best < self.min_tokens:
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        self.reused_tokens += best
        return best, self.entries[key]

    def store(self, prompt, layers):
        key = tuple(prompt[:-1])
        n = len(key)
        if n < self.min_tokens or n > self.max_tokens or key in self.entries:
            return
        self.entries[key] = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in layers]
        self.stored_tokens += n
        while self.stored_tokens > self.max_tokens:
            old, _ = self.entries.popitem(last=False)
            self.stored_tokens -= len(old)


def chat(args, model, rand) -> None:
    """--mode chat (see the module docstring)."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams

    system = rand(int(args.prompt_tokens.split(",")[0]))
    new = int(args.new_tokens.split(",")[0])
    params = SamplingParams(max_new_tokens=args.answer_tokens, ignore_eos=True)
    users = [[rand(new) for _ in range(args.turns)] for _ in range(args.conversations)]

    def run(kind: str) -> tuple[float, int, int, int, list]:
        eng = Engine(
            model,
            decoder=args.decode,
            options=EngineOptions(max_batch_size=1, prefix_cache=args.cache_tokens if kind else 0),
        )
        if kind == "flat":
            eng.prefix = FlatPrefixCache(args.cache_tokens)
        chats = [list(system) for _ in range(args.conversations)]
        prompt_tokens = 0
        t0 = time.perf_counter()
        for turn in range(args.turns):
            for c in range(args.conversations):
                chats[c] += users[c][turn]
                prompt_tokens += len(chats[c])
                chats[c] += eng.generate([chats[c]], params)[0].token_ids
        dt = time.perf_counter() - t0
        reused = eng.prefix.reused_tokens if eng.prefix is not None else 0
        kept = eng.prefix.stored_tokens if eng.prefix is not None else 0
        eng.close()
        return dt, prompt_tokens, reused, kept, chats

    names = {"radix": "radix tree", "flat": "flat copies", "": "no cache"}
    times: dict[str, list[float]] = {k: [] for k in names}
    counts = {}
    outputs = {}
    for _ in range(args.repeats):
        for kind in names:
            dt, prompt_tokens, reused, kept, outputs[kind] = run(kind)
            times[kind].append(dt)
            counts[kind] = (prompt_tokens, reused, kept)
    differ = [names[k] for k in names if outputs[k] != outputs[""]]
    if differ:
        raise SystemExit(f"the chats with {', '.join(differ)} differ from those without a cache")
    print(
        f"{args.conversations} chats x {args.turns} turns, system {len(system)}, user {new}, answer "
        f"{args.answer_tokens} tokens, cache budget {args.cache_tokens}"
    )
    print(f"{'cache':>12} {'prompt tok':>11} {'computed':>9} {'saved':>6} {'kept':>6} {'run s':>7} {'speed-up':>9}")
    base = statistics.median(times[""])
    for kind, name in names.items():
        prompt_tokens, reused, kept = counts[kind]
        t = statistics.median(times[kind])
        print(
            f"{name:>12} {prompt_tokens:>11} {prompt_tokens - reused:>9} {reused / prompt_tokens:>6.0%} {kept:>6} "
            f"{t:>7.1f} {base / t:>8.2f}x"
        )
    print("every chat the same with and without a cache (greedy)")


if __name__ == "__main__":
    main()
