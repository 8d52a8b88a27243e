"""CPU decoding at batch 1, greedy: dlm's engine (AR, an ISD N=2 verify chunk) vs transformers' ``generate`` vs
llama.cpp on the same GGUF file, at 1 and 2 threads and 128 / 512 cached tokens; and the engine's batch-16 rate.

    pip install llama-cpp-python          # bench-only (builds llama.cpp from source: ~15-40 min on 2 cores)
    python bench/cpu_vs_llamacpp.py                          # the embedded SmolLM2-135M-Instruct (Q4_1 GGUF)
    python bench/cpu_vs_llamacpp.py --threads 2 --contexts 128 --tokens 32

Every figure is decode time only: each method first takes the prompt (prefill, not timed), then ``--tokens``
greedy steps are timed; the methods run interleaved, ``--repeats`` times, best run kept (a shared machine's noise
makes runs slower, never faster). Rows: ms per step and tokens/s, and ratios to transformers and llama.cpp. The ISD
row is the cost of one verify forward (2N-1 = 3 tokens at N=2) relative to the engine's AR step (its speed-up over
AR is TPF / that ratio; the tokens are not counted since an untrained mask row drafts nothing useful). The header
prints the CPU model, the instruction set the kernels run, the kernel choice made at attach and the load average.
Without llama-cpp-python its rows are left out.

With ``--checkpoint`` (an I-DLM made from the same model, e.g. ``dlm quickstart``'s ``train_b2``), the same
methods also decode the checkpoint's own held-out chat prompts end to end (context ``chat``: ``--chat-prompts``
prompts, ``--tokens`` new tokens each, tokens/s over the decode time) beside ISD on the checkpoint: its default
(the measured policy, which chose what it learnt in the warm-up) and drafting at N=2 on every step. The base
model's AR and llama.cpp decode the same prompt ids; greedy ISD's tokens equal the engine's AR (checked).

    python bench/cpu_vs_llamacpp.py --threads 2 --contexts 128 --checkpoint runs/quickstart/train_b2
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

from dlm.decode.options import EngineOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "lambada" / "lambada_openai.head300.jsonl"


def prompt_ids(tok, n: int, data: Path) -> list[int]:
    """``n`` tokens of real text (LAMBADA passages joined)."""
    ids: list[int] = []
    if data.is_file():
        for line in open(data):
            ids += tok(json.loads(line).get("text", ""), add_special_tokens=False)["input_ids"]
            if len(ids) >= n:
                break
    while len(ids) < n:  # no data file: a repeated sentence
        ids += tok("The quick brown fox jumps over the lazy dog. ", add_special_tokens=False)["input_ids"]
    return ids[:n]


def engine_ms(engine, prompts: list[list[int]], steps: int) -> float:
    """ms per decode step of ``engine`` for these prompts (one batch; prefill not timed)."""
    from dlm.decode.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True, temperature=0.0)
    ids = [engine.add(p, params) for p in prompts]
    engine.step()  # prefill (+ the first token)
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    dt = time.perf_counter() - t
    while engine.has_unfinished():
        engine.step()
    for i in ids:
        engine.pop_result(i)
    return dt / steps * 1e3


def engine_tokens_ms(engine, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """ms per generated token of ``engine`` decoding each prompt alone (batch 1) for ``tokens`` new tokens after
    the first (prefill and the first token not timed), and the tokens."""
    from dlm.decode.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=tokens + 1, ignore_eos=True, temperature=0.0)
    dt, made, out = 0.0, 0, []
    for prompt in prompts:
        rid = engine.add(prompt, params)
        engine.step()  # prefill (+ the first token)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        dt += time.perf_counter() - t
        res = engine.pop_result(rid)
        made += len(res.token_ids) - 1
        out.append(res.token_ids)
    return dt / made * 1e3, out


def llama_tokens_ms(llm, prompts: list[list[int]], tokens: int) -> float:
    return sum(llama_ms(llm, p, tokens) for p in prompts) / len(prompts)


def best_of(fns: dict, repeats: int) -> dict:
    """Each method's best ms over ``repeats`` interleaved runs, after one warm-up run of each."""
    for fn in fns.values():
        fn()
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            best[k] = min(best[k], fn())
    return best


def hf_ms(hf, prompt: list[int], steps: int) -> float:
    ids = torch.tensor([prompt])
    kw = {"do_sample": False, "pad_token_id": 0}
    t = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    hf.generate(ids, max_new_tokens=1 + steps, min_new_tokens=1 + steps, **kw)
    return max(time.perf_counter() - t - t1, 1e-9) / steps * 1e3


def llama_ms(llm, prompt: list[int], steps: int) -> float:
    llm.reset()
    llm.eval(prompt)
    t = time.perf_counter()
    for _ in range(steps):
        tok = llm.sample(top_k=1, temp=0.0)
        llm.eval([tok])
    return (time.perf_counter() - t) / steps * 1e3


def llama_model(llama_cpp, gguf, n_ctx: int, threads: int, extra_bufts: bool):
    """llama.cpp on ``gguf``; ``extra_bufts=False`` keeps the weights in plain CPU buffers (no AMX or repacked
    buffer: the AMX buffer's matmul segfaults on some AMX machines, llama.cpp issue 20824)."""
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def params():
        p = default()
        if not extra_bufts and hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params
    try:
        return llama_cpp.Llama(str(gguf), n_ctx=n_ctx, n_threads=threads, n_batch=512, verbose=False)
    finally:
        low.llama_model_default_params = default


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a dlm model alias (its GGUF file goes to llama.cpp)")
    ap.add_argument("--threads", default="2,1", help="comma-separated thread counts")
    ap.add_argument("--contexts", default="128,512", help="comma-separated cached-token counts")
    ap.add_argument("--tokens", type=int, default=32, help="timed decode steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per method (best kept)")
    ap.add_argument("--batch", type=int, default=16, help="rows for the engine's batched AR row (0: skip)")
    ap.add_argument(
        "--llamacpp-extra-bufts",
        default="auto",
        choices=["auto", "on", "off"],
        help="llama.cpp's extra weight buffers (AMX, repacked); auto: off on a CPU with AMX, where its AMX matmul "
        "can segfault",
    )
    ap.add_argument(
        "--checkpoint",
        help="an I-DLM checkpoint of the same model (e.g. dlm quickstart's train_b2): adds ISD on it, end to end, "
        "on its held-out chat prompts",
    )
    ap.add_argument("--chat-prompts", type=int, default=4, help="held-out chat prompts for --checkpoint's rows")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")

    from dlm.decode import cpu
    from dlm.decode.engine import Engine
    from dlm.model.convert import load_any
    from dlm.model.hub import ALIASES, gguf_location

    dlm = load_any(args.model, "idlm")
    tok, hf = dlm.tokenizer, dlm.model
    gguf = None
    if args.model in ALIASES:
        folder, name = gguf_location(args.model)
        gguf = folder / name
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    from dlm.device import cpu_bf16_isa

    amx = "amx" in cpu_bf16_isa()
    extra_bufts = args.llamacpp_extra_bufts == "on" or (args.llamacpp_extra_bufts == "auto" and not amx)
    ckpt = chat = None
    if args.checkpoint:
        from dlm.data.distill import builtin_instructions, chat_prompt_ids
        from dlm.decode.configs import ISDConfig

        ckpt = load_any(args.checkpoint, "idlm")
        chat = [chat_prompt_ids(tok, x) for x in builtin_instructions("heldout", n=args.chat_prompts)]
    threads = [int(t) for t in args.threads.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for th in threads:
        torch.set_num_threads(th)
        # the verify row drafts at every step (the default policy would step AR on this model's untrained masks)
        ar = Engine(dlm, tok, decoder="ar")
        isd = Engine(dlm, tok, decoder="isd", stride=2, draft_budget="always")
        llm = None
        if llama_cpp is not None and gguf is not None:
            llm = llama_model(llama_cpp, gguf, max(contexts) + args.tokens + 8, th, extra_bufts)
        for ctx in contexts:
            prompt = prompt_ids(tok, ctx, DEFAULT_DATA)
            fns = {
                "transformers generate": lambda: hf_ms(hf, prompt, args.tokens),
                "dlm engine ar": lambda: engine_ms(ar, [prompt], args.tokens),
                "dlm isd N=2 verify forward": lambda: engine_ms(isd, [prompt], args.tokens),
            }
            if llm is not None:
                fns["llama.cpp"] = lambda: llama_ms(llm, prompt, args.tokens)
            for k, ms in best_of(fns, args.repeats).items():
                rows.append({"threads": th, "context": ctx, "method": k, "batch": 1, "ms": ms, "tok_s": 1e3 / ms})
        if ckpt is not None:
            isd_default = Engine(ckpt, ckpt.tokenizer, decoder=ISDConfig())
            isd_n2 = Engine(ckpt, ckpt.tokenizer, decoder=ISDConfig(stride=2, draft_budget="always"))
            made = {}

            def timed(name, engine):
                def fn():
                    ms, made[name] = engine_tokens_ms(engine, chat, args.tokens)
                    return ms

                return fn

            fns = {
                "dlm engine ar": timed("ar", ar),
                "dlm isd default (ckpt)": timed("default", isd_default),
                "dlm isd N=2 always (ckpt)": timed("n2", isd_n2),
            }
            if llm is not None:
                fns["llama.cpp"] = lambda: llama_tokens_ms(llm, chat, args.tokens)
            best = best_of(fns, args.repeats)  # (the default policy learns in the warm-up what pays)
            if not made["default"] == made["n2"] == made["ar"]:
                raise SystemExit("ISD on the checkpoint made other tokens than the base model's AR")
            policy = isd_default.decoder.policy.describe(1)  # what the default chose, and the rates it measured
            for k, ms in best.items():
                row = {"threads": th, "context": "chat", "method": k, "batch": 1, "ms": ms, "tok_s": 1e3 / ms}
                rows.append(dict(row, policy=policy) if k.startswith("dlm isd default") else row)
            isd_default.close()
            isd_n2.close()
        if args.batch > 1:
            ctx = contexts[0]
            prompts = [prompt_ids(tok, ctx + i, DEFAULT_DATA)[i:] for i in range(args.batch)]
            eng = Engine(dlm, tok, decoder="ar", options=EngineOptions(max_batch_size=args.batch))
            engine_ms(eng, prompts[:1], 4)
            ms = min(engine_ms(eng, prompts, args.tokens) for _ in range(args.repeats))
            rows.append(
                {
                    "threads": th,
                    "context": ctx,
                    "method": f"dlm engine ar, {args.batch} rows",
                    "batch": args.batch,
                    "ms": ms,
                    "tok_s": args.batch * 1e3 / ms,
                }
            )
            eng.close()
        handle = ar._cpu
        ar.close()
        isd.close()

    print(f"cpu={cpu.cpu_name()} isa={cpu.isa()} kernels: {handle!r}")
    print(
        f"model={args.model} gguf={gguf.name if gguf else '-'} tokens={args.tokens} repeats={args.repeats} "
        f"load average={' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        f"{'' if llama_cpp else ' (llama-cpp-python not installed: no llama.cpp rows)'}"
        f"{'' if extra_bufts or not llama_cpp else ' llama.cpp: extra buffers (AMX, repack) off'}"
    )
    hdr = f"{'threads':>7} {'ctx':>5} {'method':<28} {'ms/step':>8} {'tok/s':>8} {'x hf':>6} {'x llama.cpp':>11}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ref = {x["method"]: x for x in rows if x["threads"] == r["threads"] and x["context"] == r["context"]}
        hf_r, ll = ref.get("transformers generate"), ref.get("llama.cpp")
        x_hf = r["tok_s"] / hf_r["tok_s"] if hf_r else float("nan")
        x_ll = r["tok_s"] / ll["tok_s"] if ll else float("nan")
        note = ""
        if r["method"].startswith("dlm isd") and r["method"].endswith("(ckpt)"):
            note = f"  ({ref['dlm engine ar']['ms'] / r['ms']:.2f}x the base model's AR)"
            x_hf = float("nan")
        elif r["method"].startswith("dlm isd") and "dlm engine ar" in ref:
            note = f"  ({r['ms'] / ref['dlm engine ar']['ms']:.2f}x the AR step)"
            x_hf = x_ll = float("nan")
        print(
            f"{r['threads']:>7} {r['context']:>5} {r['method']:<28} {r['ms']:>8.1f} {r['tok_s']:>8.1f} "
            f"{x_hf:>6.2f} {x_ll:>11.2f}{note}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
