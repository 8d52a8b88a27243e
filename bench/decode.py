"""Decoding speed: transformers ``generate`` (KV cache) vs dlm ``ar`` vs ``isd`` N=2,3,4, greedy, in one run.

    python bench/decode.py                                  # smollm2-135m, LAMBADA prompts, batch 1 and 8
    python bench/decode.py --model runs/idlm-b3 --strides 2,3,4 --max-new-tokens 64

A plain AR model is converted on the fly for ISD (untrained masks: TPF near 1, so this measures the overhead of
the verify chunk); an I-DLM checkpoint shows the real speed-up. Prompts are the first lines of a real text file,
cut to ``--prompt-tokens`` tokens. EOS is ignored so every method generates exactly ``--max-new-tokens`` tokens
per prompt. Prints one table: tokens/s, forwards, TPF, ratio to transformers, and whether the tokens equal the
``ar`` tokens (greedy ISD must).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--strides", default="2,3,4")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import load_any

    dlm = load_any(args.model, "idlm")
    tok = dlm.tokenizer
    hf = dlm.model
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    strides = [int(s) for s in args.strides.split(",") if s]
    texts = read_prompts(Path(args.data), max(batch_sizes))
    prompts = [tok(t, add_special_tokens=False)["input_ids"][-args.prompt_tokens:] for t in texts]
    k = args.max_new_tokens
    params = SamplingParams(max_new_tokens=k, ignore_eos=True)

    rows = []
    for b in batch_sizes:
        batch = prompts[:b]
        # transformers generate with left padding (its batched KV-cache path)
        width = max(map(len, batch))
        pad = hf.generation_config.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            hf.generate(ids[:, :8], attention_mask=att[:, :8], do_sample=False, max_new_tokens=2)  # warm-up
            t = time.perf_counter()
            out = hf.generate(ids, attention_mask=att, do_sample=False, max_new_tokens=k, min_new_tokens=k)
            hf_s = time.perf_counter() - t
        hf_tokens = [out[i, width:].tolist() for i in range(b)]
        base = {"batch": b, "method": "transformers", "tokens": b * k, "seconds": hf_s, "tok_s": b * k / hf_s,
                "forwards": k, "tpf": 1.0, "match_ar": None}
        rows.append(base)
        ar_tokens = None
        for name, kw in [("ar", {})] + [(f"isd N={n}", {"stride": n}) for n in strides]:
            dec = "ar" if name == "ar" else "isd"
            engine = Engine(dlm, tok, decoder=dec, max_batch_size=b, **kw)
            engine.generate([batch[0][:8]], SamplingParams(max_new_tokens=2, ignore_eos=True))  # warm-up
            engine.total_forwards = 0
            t = time.perf_counter()
            res = engine.generate(batch, params)
            s = time.perf_counter() - t
            toks = [r.token_ids for r in res]
            if name == "ar":
                ar_tokens = toks
            n_tok = sum(len(x) for x in toks)
            acc = res[0].stats.acceptance
            rows.append({"batch": b, "method": name, "tokens": n_tok, "seconds": s, "tok_s": n_tok / s,
                         "forwards": engine.total_forwards,
                         "tpf": sum(r.stats.new_tokens for r in res) / sum(r.stats.forwards for r in res),
                         "acceptance": acc, "match_ar": toks == ar_tokens,
                         "match_hf": toks == hf_tokens})

    hdr = f"{'batch':>5} {'method':<13} {'tokens':>6} {'tok/s':>8} {'x hf':>6} {'x ar':>6} {'forwards':>8} " \
          f"{'TPF':>5} {'= ar':>5} {'= hf':>5}"
    print(f"model={args.model} prompts={Path(args.data).name} prompt_tokens<={args.prompt_tokens} "
          f"new_tokens={k} threads={torch.get_num_threads()}")
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
        print(f"{r['batch']:>5} {r['method']:<13} {r['tokens']:>6} {r['tok_s']:>8.1f} "
              f"{r['tok_s'] / ref[r['batch']]:>6.2f} {x_ar:>6.2f} {r['forwards']:>8} {r['tpf']:>5.2f} "
              f"{str(r.get('match_ar', '')):>5} {str(r.get('match_hf', '')):>5}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
