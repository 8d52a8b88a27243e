"""Serving benchmark: throughput and latency of `dlm serve` at several concurrency levels, ISD against AR, in one
run, through the same server code (FastAPI + the engine thread) and the official `openai` client.

    python bench/serve.py                                   # smollm2-135m, ar vs isd, concurrency 1, 8, 32
    python bench/serve.py --model runs/idlm/final --stride 3 --max-tokens 32 --output bench_serve.json
    python bench/serve.py --decodes ar,isd,isd:6     # also isd that drafts only while rows x (2N-1) <= 6
    python bench/serve.py --decodes ar,isd,isd:auto  # also isd that measures whether drafting pays
    python bench/serve.py --decodes ar,isd:c3,isd:auto:c3   # isd with 3 draft candidates (--isd-candidates 3)
    python bench/serve.py --decodes ar,ar:pl4,ar:pl4:always  # ar with prompt lookup (--prompt-lookup 4)

Each level sends max(concurrency, --min-requests) streaming chat requests from `concurrency` concurrent clients
(greedy; a request ends at end-of-sequence or --max-tokens, as a real server's do; with --ignore-eos every request
produces exactly --max-tokens tokens, most of them past the answer's end for short answers, text no decoder is
trained for). Greedy ISD output equals AR output, so every decoder serves the same tokens; the bench checks this
request by request and says so in the table's last column. Reported per decoder and level:
output tokens/s over the level's wall time, its ratio to concurrency 1, time to first token (p50/mean), time
per output token after the first (mean over requests), CPU seconds of this process per output token (fairer than
wall time on a shared machine), tokens per forward / draft acceptance (from /metrics) and the load average. All
decoders are served at once by their own server (same model object); levels are interleaved across decoders so
that load drift on a shared machine hits them alike.
The last table gives isd / ar throughput at each level. A plain AR model is converted on the fly for isd: its
drafts are untrained, so acceptance is ~0 and isd pays for its longer chunks; pass a trained I-DLM with --model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time

from dlm.decode.options import SERVER, EngineOptions

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused.",
    "Explain photosynthesis simply.",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "What is 17 times 23?",
    "Name five fruits.",
    "Why is the sky blue?",
    "Summarize the plot of Cinderella.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
    "List three uses of a paperclip.",
    "What is a prime number?",
    "Describe a cat to someone who has never seen one.",
    "How many days are in a leap year?",
    "What is machine learning?",
    "Give a synonym for happy.",
    "Why do we sleep?",
    "What is gravity?",
    "Suggest a name for a pet goldfish.",
    "How do airplanes fly?",
    "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
    "Write one sentence about autumn.",
    "How do vaccines work?",
    "What is an API?",
    "Why is exercise healthy?",
    "What is the largest planet?",
    "How do I make a cup of tea?",
    "What is a noun?",
    "Explain recursion briefly.",
]


def _metric_values(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def _one(client, model, prompt, max_tokens, ignore_eos):
    t0 = time.perf_counter()
    first = None
    tokens = 0
    text = []
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": ignore_eos},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = first or end
    return {
        "ttft": first - t0,
        "tpot": (end - first) / (tokens - 1) if tokens > 1 else 0.0,
        "tokens": tokens,
        "text": "".join(text),
    }


async def _level(url, model, concurrency, n_requests, max_tokens, ignore_eos=False):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600)
    work = list(range(n_requests))
    results = []

    async def worker():
        while work:
            i = work.pop(0)
            r = await _one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens, ignore_eos)
            results.append(dict(r, request=i))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await client.close()
    return results, wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="alias, AR folder or DLM folder (default smollm2-135m)")
    ap.add_argument(
        "--decodes",
        default="ar,isd",
        help="comma-separated decoders (default ar,isd); 'isd:B' = isd "
        "with --isd-draft-budget B (an integer or auto); 'isd:cK' (or 'isd:B:cK') = with "
        "--isd-candidates K; 'isd:nN' = with --stride N; 'ar:plK' = ar with --prompt-lookup K (budget auto, as dlm serve; 'ar:plK:always')",
    )
    ap.add_argument("--stride", type=int, help="ISD stride (default: the model's block size + 1)")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated levels (default 1,8,32)")
    ap.add_argument("--min-requests", type=int, default=4, help="requests per level at least (default 4)")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate exactly --max-tokens per request, past the end of the answer (default: stop at end-of-sequence)",
    )
    ap.add_argument("--max-batch-size", type=int, help="engine batch (default: the largest concurrency)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=SERVER.prefix_cache,
        help=f"the engines' prefix cache (default {SERVER.prefix_cache}, as dlm serve; 0 = off)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every level this many times, interleaved, and report the sums (default 1)",
    )
    ap.add_argument("--output", help="write the results as JSON here")
    args = ap.parse_args(argv)

    import httpx
    import torch

    from dlm.decode.engine import Engine
    from dlm.device import get_device, get_dtype
    from dlm.model.convert import load_any
    from dlm.serve.app import ServerThread, ServeSettings, create_app
    from dlm.serve.scheduler import Scheduler

    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.concurrency.split(",")]
    decodes = [d.strip() for d in args.decodes.split(",") if d.strip()]
    batch = args.max_batch_size or max(levels)
    dev = get_device(None)
    t = time.perf_counter()
    dlm = load_any(args.model, dtype=get_dtype("auto", dev), device=dev)
    print(
        f"model {args.model} ({dlm.objective}, block {dlm.block_size}) loaded in {time.perf_counter() - t:.1f}s; "
        f"torch threads {torch.get_num_threads()}; batch {batch}; "
        f"{'exactly ' if args.ignore_eos else 'up to '}{args.max_tokens} tokens/request",
        flush=True,
    )

    # every decoder gets its own server (same model object, same server code); the levels are interleaved
    # (ar c=1, isd c=1, ..., ar c=8, ...) so that load drift on a shared machine hits all decoders alike
    servers = {}
    with contextlib.ExitStack() as stack:
        for decode in decodes:
            # "isd:6" / "isd:auto" = --isd-draft-budget 6 / auto; "isd:c3" = --isd-candidates 3
            name, *opts = decode.split(":")
            kw = {"stride": args.stride} if name == "isd" and args.stride else {}
            for opt in opts:
                if opt.startswith("c") and opt[1:].isdigit():
                    kw["candidates"] = int(opt[1:])
                elif opt.startswith("n") and opt[1:].isdigit():  # isd:n3 = --stride 3
                    kw["stride"] = int(opt[1:])
                elif opt.startswith("pl") and opt[2:].isdigit():  # ar:pl4 = --prompt-lookup 4
                    kw["prompt_lookup"] = int(opt[2:])
                elif name == "ar":
                    kw["lookup_budget"] = opt
                else:
                    kw["draft_budget"] = opt
            if name == "ar" and "prompt_lookup" in kw:
                kw.setdefault("lookup_budget", "auto")  # dlm serve's default
            engine = Engine(
                dlm,
                dlm.tokenizer,
                decoder=name,
                options=EngineOptions(
                    max_batch_size=batch, threads=args.threads, prefix_cache=args.prefix_cache_tokens
                ),
                **kw,
            )
            app = create_app(
                Scheduler(engine),
                ServeSettings(model_name="bench", max_tokens_limit=args.max_tokens),
            )
            srv = stack.enter_context(ServerThread(app))
            asyncio.run(_level(srv.url, "bench", 1, 1, 4))  # warm-up
            servers[decode] = (srv, engine)
        raw = {}  # (decode, c) -> summed measurements over the rounds
        for rnd in range(args.rounds):
            for c in levels:
                for decode in decodes:
                    srv = servers[decode][0]
                    before = _metric_values(httpx.get(srv.url + "/metrics").text)
                    n = max(c, args.min_requests)
                    cpu0 = time.process_time()
                    res, wall = asyncio.run(_level(srv.url, "bench", c, n, args.max_tokens, args.ignore_eos))
                    cpu = time.process_time() - cpu0
                    after = _metric_values(httpx.get(srv.url + "/metrics").text)
                    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                    acc = raw.setdefault((decode, c), {"res": [], "wall": 0.0, "cpu": 0.0, "n": 0, "d": {}, "load": []})
                    acc["res"] += [dict(r, round=rnd) for r in res]
                    acc["wall"] += wall
                    acc["cpu"] += cpu
                    acc["n"] += n
                    acc["load"].append(os.getloadavg()[0])
                    for k, v in d.items():
                        acc["d"][k] = acc["d"].get(k, 0) + v
                    toks = sum(r["tokens"] for r in res)
                    print(
                        f"  round {rnd + 1} {decode:>11} c={c:<3} {toks / wall:7.1f} tok/s  "
                        f"tpf {d['dlm_generation_tokens_total'] / max(d['dlm_forwards_total'], 1):.2f}  "
                        f"load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
        rows = []
        for c in levels:
            for decode in decodes:
                acc = raw[(decode, c)]
                res, d, wall = acc["res"], acc["d"], acc["wall"]
                toks = sum(r["tokens"] for r in res)
                ttfts = [r["ttft"] for r in res]
                row = {
                    "decode": decode,
                    "stride": getattr(servers[decode][1].decoder, "stride", None),
                    "concurrency": c,
                    "requests": acc["n"],
                    "output_tokens": toks,
                    "wall_s": wall,
                    "tokens_per_s": toks / wall,
                    "cpu_s_per_token": acc["cpu"] / max(toks, 1),
                    "load_average": statistics.fmean(acc["load"]),
                    "ttft_p50_s": statistics.median(ttfts),
                    "ttft_mean_s": statistics.fmean(ttfts),
                    "tpot_mean_s": statistics.fmean(r["tpot"] for r in res),
                    "tpf": d["dlm_generation_tokens_total"] / max(d["dlm_forwards_total"], 1),
                    "acceptance": (
                        d["dlm_draft_accepted_total"] / d["dlm_draft_proposed_total"]
                        if d.get("dlm_draft_proposed_total")
                        else None
                    ),
                    "engine_steps": d["dlm_engine_steps_total"],
                    # ISD decode steps by what the policy chose: "ar" or the stride drafted at (from /metrics)
                    "isd_steps": {
                        **(
                            {"ar": d['dlm_isd_steps_total{mode="ar"}']} if 'dlm_isd_steps_total{mode="ar"}' in d else {}
                        ),
                        **{
                            k.split('"')[1]: v for k, v in d.items() if k.startswith("dlm_isd_draft_steps_total{") and v
                        },
                    },
                }
                # greedy: every decoder must serve the same text for the same request as the first decoder
                ref = {(r["round"], r["request"]): r["text"] for r in raw[(decodes[0], c)]["res"]}
                row["same_output_as"] = decodes[0]
                row["same_output"] = sum(ref.get((r["round"], r["request"])) == r["text"] for r in res) / len(res)
                rows.append(row)

    base = {(r["decode"]): r["tokens_per_s"] for r in rows if r["concurrency"] == levels[0]}
    print()
    w = max(8, *(len(d) for d in decodes))
    hdr = (
        f"{'decode':<{w}} {'conc':>4} {'reqs':>4} {'tok/s':>8} {'x c=' + str(levels[0]):>7} {'TTFT p50 ms':>11} "
        f"{'TTFT mean ms':>12} {'TPOT ms':>8} {'CPU ms/tok':>10} {'TPF':>5} {'accept':>6} {'load':>5} "
        f"{'== ' + decodes[0]:>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(
            f"{r['decode']:<{w}} {r['concurrency']:>4} {r['requests']:>4} {r['tokens_per_s']:>8.1f} "
            f"{r['tokens_per_s'] / base[r['decode']]:>7.2f} {r['ttft_p50_s'] * 1e3:>11.0f} "
            f"{r['ttft_mean_s'] * 1e3:>12.0f} {r['tpot_mean_s'] * 1e3:>8.1f} {r['cpu_s_per_token'] * 1e3:>10.1f} "
            f"{r['tpf']:>5.2f} {acc:>6} {r['load_average']:>5.1f} {r['same_output']:>8.0%}"
        )
    others = [d for d in decodes if d != "ar"]
    if "ar" in decodes and others:
        print()
        print(f"{'conc':>4} " + " ".join(f"{d + '/ar tok/s':>18}" for d in others))
        for c in levels:
            a = next(r for r in rows if r["decode"] == "ar" and r["concurrency"] == c)
            ratios = [
                next(r for r in rows if r["decode"] == d and r["concurrency"] == c)["tokens_per_s"] / a["tokens_per_s"]
                for d in others
            ]
            print(f"{c:>4} " + " ".join(f"{x:>18.2f}" for x in ratios))
    policy = [r for r in rows if r["isd_steps"]]
    if policy:
        print()
        print("ISD engine steps by the policy's choice (ar, or the stride drafted at):")
        for r in policy:
            steps = ", ".join(f"{k}: {v:.0f}" for k, v in sorted(r["isd_steps"].items()))
            print(f"  {r['decode']} c={r['concurrency']}: {steps}")
    if args.output:
        tmp = args.output + ".tmp"
        with open(tmp, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "max_tokens": args.max_tokens,
                    "ignore_eos": args.ignore_eos,
                    "batch": batch,
                    "rows": rows,
                },
                f,
                indent=1,
            )
        os.replace(tmp, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
