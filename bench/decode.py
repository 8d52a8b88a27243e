"""Decoding speed: transformers ``generate`` (KV cache) vs dlm ``ar`` vs ``isd`` N=2,3,4, greedy, in one run.

    python bench/decode.py                                  # smollm2-135m, LAMBADA prompts, batch 1 and 8
    python bench/decode.py --model runs/idlm-b3 --strides 2,3,4 --max-new-tokens 64

A plain AR model is converted on the fly for ISD (untrained masks: TPF near 1, so this measures the overhead of the
verify chunk); an I-DLM checkpoint shows the real speed-up. ``--temperature T`` samples instead of greedy (ISD's
drafts are then sampled from q, so the output keeps the model's distribution; tokens are not compared). Prompts are
the first lines of a real text file, cut to ``--prompt-tokens`` tokens, or (``--data heldout``) dlm's built-in
held-out chat instructions, the distribution the quickstart's checkpoints are trained for. EOS is ignored so every
method generates exactly ``--max-new-tokens`` tokens per prompt. Each batch size runs ``--groups`` batches of
distinct prompts; every method decodes every batch, the methods interleaved (batch g starts with the g-th method),
so that a shared machine's speed drifts hit all alike. Prints one table: tokens/s, forwards, TPF, first-position
acceptance, ratio to transformers and to ``ar``, "hit" (ISD: the share of verify steps whose outcome had its masks
in the chunk, so the next step verified again instead of cold-starting; ``--fallbacks`` compares the modes) and
whether the tokens equal the ``ar`` / transformers tokens (greedy ISD must equal ``ar``). ``--candidates 2,3`` adds
ISD at stride 2 with K draft candidates per position (``--isd-candidates``; rows 'isd N=2 K=k', default fallback
mode). ``--layer-loop`` adds each engine row again with the CPU kernels' per-layer loop instead of their one
``decode_stack`` call for all layers (rows '... (loop)', interleaved with the others; tokens equal);
``--rebuilt-plans`` with that call's arguments built at every forward instead of kept between forwards (rows
'... (rebuilt)'); ``--f32-adapters`` each ISD row with the gated adapters exact in the kernels instead of in 8-bit
blocks (rows '... (f32 adapters)': the same tokens, drafts that may differ).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from dlm.decode.options import EngineOptions
from dlm.decode.schedule import MeasuredDraft

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "lambada" / "lambada_openai.head300.jsonl"


def read_prompts(path: Path, n: int) -> list[str]:
    texts = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            if path.suffix == ".jsonl":
                rec = json.loads(line)
                line = rec.get("context") or rec.get("prompt") or rec.get("text") or ""
            texts.append(line)
            if len(texts) >= n:
                break
    return texts


def next_verify(engine) -> float | None:
    """Share of an ISD engine's verify steps whose outcome had its masks in the chunk, so that the next step
    verified again instead of cold-starting (``--isd-fallback``; 'off' gives the acceptance of all drafts)."""
    counts = getattr(getattr(engine, "decoder", None), "counts", None)
    b = counts.branch_steps if counts is not None else None
    return b["predicted"] / b["verify"] if b and b["verify"] else None


# rows run again with one of the CPU kernels' settings (dlm.decode.cpu.runtime.KernelOptions) changed: row suffix ->
# (setting, value)
VARIANTS = {
    " (loop)": ("one_call", False),
    " (rebuilt)": ("keep_plans", False),
    " (f32 adapters)": ("adapter_form", "f32"),
}


def policy_steps(engine) -> dict | None:
    """A measured policy's decode steps by mode: plain AR and drafting at each stride (None for other rows)."""
    dec = getattr(engine, "decoder", None)
    if not isinstance(getattr(dec, "policy", None), MeasuredDraft):
        return None
    return {"ar": dec.counts.mode_steps["ar"], **{f"N={n}": k for n, k in sorted(dec.counts.stride_steps.items())}}


def fresh_policy(engine):
    """The measured policy starting from nothing, as ``'auto'`` builds it for this engine's decoder: choosing the
    stride from 2 up to the model's where none was given."""
    return MeasuredDraft(strides=engine.decoder.policy_strides)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--data",
        default=str(DEFAULT_DATA),
        help="text / JSONL file whose first lines are the prompts (default: LAMBADA), or 'heldout': "
        "dlm's built-in held-out chat instructions (chat template applied)",
    )
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--strides", default="2,3,4")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument(
        "--groups",
        type=int,
        default=4,
        help="batches per batch size (distinct prompts; every method runs each, interleaved; default 4)",
    )
    ap.add_argument(
        "--fallbacks",
        default="predict",
        help="comma-separated ISD fallback modes to run (default predict; 'isd N=n' is the first, the "
        "others are named 'isd N=n MODE'): predict, all, off (plain ISD (docs/algorithms.md#isd): a cold-start step "
        "after every rejection)",
    )
    ap.add_argument(
        "--draft-budgets",
        default="",
        help="comma-separated ISD drafting policies to add beside the always-drafting rows (e.g. 'auto', the "
        "default measured policy, which starts from what an earlier process on this folder learnt "
        "(isd_policy.json under DLM_HOME); 'fresh': the same policy starting from nothing, as a first run does; "
        "rows 'isd N=n auto' / 'isd N=n fresh'), at each --strides stride ('model' in --strides: the model's "
        "own stride given as none, so that 'auto' chooses each step's stride from 2 up to it: rows 'isd N=model ...')",
    )
    ap.add_argument(
        "--candidates",
        default="",
        help="comma-separated K > 1: also run ISD at stride 2 with K draft candidates per position "
        "(rows 'isd N=2 K=k')",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy, outputs compared token for token; > 0: sampled (seed 0 per "
        "request; the outputs then differ between methods by construction and are not compared)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument(
        "--layer-loop",
        action="store_true",
        help="also run ar and each isd row through the CPU kernels' per-layer loop (rows '... (loop)') instead of "
        "one decode_stack call for all layers: what the one call saves",
    )
    ap.add_argument(
        "--rebuilt-plans",
        action="store_true",
        help="also run ar and each isd row with decode_stack's arguments built at every forward (rows "
        "'... (rebuilt)') instead of kept between forwards: what keeping them saves",
    )
    ap.add_argument(
        "--f32-adapters",
        action="store_true",
        help="also run each isd row with the gated adapters exact in the CPU kernels (rows '... (f32 adapters)') "
        "instead of in 8-bit blocks (DLM_CPU_ADAPTERS)",
    )
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    if args.groups < 1:
        ap.error("--groups must be >= 1")
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    from dlm.decode.configs import ISDConfig
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams, draft_totals
    from dlm.model.convert import load_any

    dlm = load_any(args.model, "idlm")
    tok = dlm.tokenizer
    hf = dlm.model
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    # 'model': no stride given (the model's block_size + 1; the measured policy then chooses the stride)
    strides = [None if s.strip() == "model" else int(s) for s in args.strides.split(",") if s.strip()]
    label = {n: "model" if n is None else str(n) for n in strides}
    if args.data == "heldout":  # the chat distribution the quickstart's checkpoints are trained for
        from dlm.data.distill import builtin_instructions, chat_prompt_ids

        prompts = [
            chat_prompt_ids(tok, x)[-args.prompt_tokens :]
            for x in builtin_instructions("heldout", n=max(batch_sizes) * args.groups)
        ]
    else:
        texts = read_prompts(Path(args.data), max(batch_sizes) * args.groups)
        prompts = [tok(t, add_special_tokens=False)["input_ids"][-args.prompt_tokens :] for t in texts]
    k = args.max_new_tokens
    if args.temperature < 0:
        ap.error("--temperature must be >= 0")
    params = SamplingParams(max_new_tokens=k, ignore_eos=True, temperature=args.temperature, seed=0)
    sampled = args.temperature > 0

    fallbacks = [f.strip() for f in args.fallbacks.split(",") if f.strip()]
    names = {f: "" if i == 0 else f" {f}" for i, f in enumerate(fallbacks)}
    cands = [int(c) for c in args.candidates.split(",") if c.strip()]
    if any(c < 2 for c in cands):
        ap.error("--candidates takes K >= 2 (K = 1 is plain ISD: --strides 2)")
    budgets = [x.strip() for x in args.draft_budgets.split(",") if x.strip()]
    methods = (
        ["transformers", "ar"]
        + [f"isd N={label[n]}{names[f]}" for f in fallbacks for n in strides]
        + [f"isd N={label[n]} {x}" for x in budgets for n in strides]
        + [f"isd N=2 K={c}" for c in cands]
    )
    engine_rows = methods[1:]
    if args.layer_loop:  # the same engines with the CPU kernels' per-layer loop instead of one decode_stack call
        methods += [f"{m} (loop)" for m in engine_rows]
    if args.rebuilt_plans:  # ... with decode_stack's arguments built at every forward
        methods += [f"{m} (rebuilt)" for m in engine_rows]
    if args.f32_adapters:  # ... with the gated adapters exact (ISD only: AR steps have no mask rows)
        methods += [f"{m} (f32 adapters)" for m in engine_rows if m.startswith("isd")]
    engines = {}
    for b in batch_sizes:
        engines[b] = {"ar": Engine(dlm, tok, decoder="ar", options=EngineOptions(max_batch_size=b))}
        for n in strides:
            for f in fallbacks:
                engines[b][f"isd N={label[n]}{names[f]}"] = Engine(
                    dlm,
                    tok,
                    decoder="isd",
                    options=EngineOptions(max_batch_size=b),
                    stride=n,
                    fallback=f,
                    draft_budget="always",  # the rows that draft at every step; --draft-budgets adds the policies
                )
        for x in budgets:  # one engine per batch size: the policy learns over every group, as a server's would
            for n in strides:
                engines[b][f"isd N={label[n]} {x}"] = eng = Engine(
                    dlm,
                    tok,
                    # a policy object is used as given: 'fresh' carries nothing from earlier processes
                    decoder=ISDConfig(
                        stride=n, fallback=fallbacks[0], draft_budget=MeasuredDraft() if x == "fresh" else x
                    ),
                    options=EngineOptions(max_batch_size=b),
                )
                if x == "fresh":
                    eng.decoder.policy = fresh_policy(eng)
        for c in cands:
            engines[b][f"isd N=2 K={c}"] = Engine(
                dlm,
                tok,
                decoder="isd",
                options=EngineOptions(max_batch_size=b),
                stride=2,
                candidates=c,
                fallback=fallbacks[0],
                draft_budget="always",
            )
    pad = hf.generation_config.pad_token_id

    def run(b, method, batch):
        if method == "transformers":  # left padding: transformers' batched KV-cache path
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            t = time.perf_counter()
            extra = (
                {"do_sample": True, "temperature": args.temperature, "top_k": 0} if sampled else {"do_sample": False}
            )
            out = hf.generate(ids, attention_mask=att, max_new_tokens=k, min_new_tokens=k, **extra)
            s = time.perf_counter() - t
            return [out[i, width:].tolist() for i in range(len(batch))], s, k, [k] * len(batch), []
        suffix = next((x for x in VARIANTS if method.endswith(x)), "")
        engine = engines[b][method.removesuffix(suffix) if suffix else method]
        engine.total_forwards = 0
        options = engine.kernels.options if engine.kernels else None  # (what the model's kernel forwards read)
        setting = VARIANTS[suffix][0] if suffix and options is not None else None
        before = getattr(options, setting) if setting else None
        if setting:
            setattr(options, setting, VARIANTS[suffix][1])
        try:
            t = time.perf_counter()
            res = engine.generate(batch, params)
            s = time.perf_counter() - t
        finally:
            if setting:
                setattr(options, setting, before)
        return (
            [r.token_ids for r in res],
            s,
            engine.total_forwards,
            [r.stats.forwards for r in res],
            [r.stats for r in res],
        )

    rows = []
    with torch.inference_mode():
        for b in batch_sizes:
            groups = [prompts[g * b : (g + 1) * b] for g in range(args.groups)]
            for m in methods:  # warm-up: first calls pay one-off costs, not timed
                run(b, m, [groups[0][0][:8]])
            for m in methods:  # ... but a fresh policy's first exploration is a first run's cost: it starts timed
                if m.endswith(" fresh"):
                    engines[b][m].decoder.policy = fresh_policy(engines[b][m])
            agg = {m: {"tokens": [], "seconds": 0.0, "forwards": 0, "row_forwards": 0, "stats": []} for m in methods}
            for g, batch in enumerate(groups):  # methods interleaved, rotating, so machine drift hits all alike
                for j in range(len(methods)):
                    m = methods[(g + j) % len(methods)]
                    toks, sec, fw, row_fw, stats = run(b, m, batch)
                    a = agg[m]
                    a["tokens"] += toks
                    a["seconds"] += sec
                    a["forwards"] += fw
                    a["row_forwards"] += sum(row_fw)
                    a["stats"] += stats
            hf_tokens, ar_tokens = agg["transformers"]["tokens"], agg["ar"]["tokens"]
            for m in methods:
                a = agg[m]
                n_tok = sum(map(len, a["tokens"]))
                prop, accd = draft_totals(a["stats"])
                rows.append(
                    {
                        "batch": b,
                        "method": m,
                        "tokens": n_tok,
                        "seconds": a["seconds"],
                        "tok_s": n_tok / a["seconds"],
                        "forwards": a["forwards"],
                        "tpf": n_tok / max(a["row_forwards"], 1),
                        "acceptance": [round(x / y, 3) for x, y in zip(accd, prop) if y],
                        "match_ar": None if m == "transformers" or sampled else a["tokens"] == ar_tokens,
                        "match_hf": None if m == "transformers" or sampled else a["tokens"] == hf_tokens,
                        "next_verify": next_verify(engines[b].get(m)),
                        "steps": policy_steps(engines[b].get(m)),
                    }
                )

    hdr = (
        f"{'batch':>5} {'method':<17} {'tokens':>6} {'tok/s':>8} {'x hf':>6} {'x ar':>6} {'forwards':>8} "
        f"{'TPF':>5} {'acc':>5} {'hit':>5} {'= ar':>5} {'= hf':>5}"
    )
    source = "heldout chat" if args.data == "heldout" else Path(args.data).name
    print(
        f"model={args.model} prompts={source} prompt_tokens<={args.prompt_tokens} new_tokens={k} "
        f"{f'temperature={args.temperature:g} ' if sampled else 'greedy '}"
        f"threads={torch.get_num_threads()} groups={args.groups} (methods interleaved per group)"
    )
    print(hdr)
    print("-" * len(hdr))
    ref = {}
    ar_ref = {}
    for r in rows:
        if r["method"] == "transformers":
            ref[r["batch"]] = r["tok_s"]
        if r["method"] == "ar":
            ar_ref[r["batch"]] = r["tok_s"]
        x_ar = r["tok_s"] / ar_ref[r["batch"]] if r["batch"] in ar_ref else float("nan")
        print(
            f"{r['batch']:>5} {r['method']:<17} {r['tokens']:>6} {r['tok_s']:>8.1f} "
            f"{r['tok_s'] / ref[r['batch']]:>6.2f} {x_ar:>6.2f} {r['forwards']:>8} {r['tpf']:>5.2f} "
            f"{(f'{acc[0]:.2f}' if (acc := r.get('acceptance')) else '-'):>5} "
            f"{(f'{h:.2f}' if (h := r.get('next_verify')) is not None else '-'):>5} "
            f"{str(r.get('match_ar', '')):>5} {str(r.get('match_hf', '')):>5}"
        )
    for r in rows:  # what each measured policy ran (its warm-up included)
        if r.get("steps"):
            ran = ", ".join(f"{k} {v}" for k, v in r["steps"].items())
            print(f"policy at batch {r['batch']}, {r['method']}: decode steps {ran}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
