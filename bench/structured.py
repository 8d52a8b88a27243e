"""Structured outputs: what a JSON schema costs and what ISD makes of it, in the same run.

Chat prompts asking for a JSON record, decoded greedily at batch 1: free-text AR (the baseline), AR constrained by
the schema one token a step (the grammar's cost per token; ``forced`` turned off) and with the grammar's forced
tokens verified in the same forward (the default: jump-forward), ISD constrained by the schema with the forced
tokens as drafts (the default) and without them (the drafts are the masks' own). Every constrained decoder
must give constrained AR's tokens (checked); the table gives tokens per forward (TPF), tokens/s of the decode phase
(after each request's first step: free text runs to the limit while a record ends sooner, so whole-request rates
would weigh the prefill differently) with the ratio to free AR, whole-request tokens/s with the ratio to constrained
AR a token a step (the same tokens: a ratio of times, the prefill's forced start included), and the share of the
outputs that parse and match the schema.

    python bench/structured.py                                   # smollm2-135m as an untrained I-DLM, N = 2, 3
    python bench/structured.py --model runs/quickstart/train_b2 --strides 2 --prompts 16

With untrained masks (a plain AR model converted on the fly) ISD's own drafts are rarely right: what it gains is
the schema's forced text (keys, quotes, braces), verified in the same forward as AR verifies it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from shapes import machine  # noqa: E402

from dlm.decode.options import EngineOptions

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "is_student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "occupation", "languages", "is_student"],
    "additionalProperties": False,
}
SUBJECTS = [
    "a baker in Lyon",
    "a retired sailor",
    "a student of physics in Kyoto",
    "a nurse from Lagos",
    "a software engineer in Berlin",
    "a farmer in Iowa",
    "a violinist from Vienna",
    "a young chess champion",
    "a librarian in Toronto",
    "a marine biologist",
    "a taxi driver in Mumbai",
    "a painter in Mexico City",
    "a firefighter in Sydney",
    "a chef from Naples",
    "a history teacher in Cairo",
    "an astronaut in training",
]


def valid(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(v, dict)
        and set(v) == set(SCHEMA["required"])
        and isinstance(v["age"], int)
        and isinstance(v["is_student"], bool)
        and isinstance(v["languages"], list)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--strides", default="2,3")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", default="auto")
    ap.add_argument("--compact", action="store_true", help="the schema without free whitespace")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the decoders this many times (median)")
    args = ap.parse_args()

    from dlm.decode import ARConfig, ISDConfig, generate
    from dlm.decode.options import parse_threads
    from dlm.decode.sampling import SamplingParams
    from dlm.decode.structured import Constraint, StructuredOutput
    from dlm.model.convert import load_any
    from dlm.model.hub import resolve_model_path

    strides = [int(s) for s in args.strides.split(",")]
    model = load_any(resolve_model_path(args.model), convert_to="idlm", block_size=max(strides) - 1)
    tok = model.tokenizer
    prompts = []
    for subject in SUBJECTS[: args.prompts]:
        msg = f"Describe {subject} as a JSON object with name, age, city, occupation, languages and is_student."
        text = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    spec = StructuredOutput(json=SCHEMA, disable_any_whitespace=args.compact)
    free = SamplingParams(args.max_new_tokens)
    shaped = SamplingParams(args.max_new_tokens, structured=spec)
    threads = parse_threads(args.threads)
    own_forced = Constraint.forced  # the one source of forced tokens, for the prefill and every step

    def run(config, params, forced=True):
        Constraint.forced = own_forced if forced else (lambda self, limit=0: [])
        try:
            generate(
                model, prompts[:1], config, params, options=EngineOptions(max_batch_size=1, threads=threads)
            )  # warm-up
            t0 = time.perf_counter()
            res = generate(model, prompts, config, params, options=EngineOptions(max_batch_size=1, threads=threads))
            return res, time.perf_counter() - t0
        finally:
            Constraint.forced = own_forced

    load = os.getloadavg()[0]
    print(
        f"{machine()}; {args.model}; greedy, batch 1, {len(prompts)} prompts x <= {args.max_new_tokens} tokens, "
        f"median of {args.rounds} alternated rounds"
    )
    print(f"schema: {len(SCHEMA['properties'])} required keys{', compact' if args.compact else ''}; load {load:.1f}")
    rows = [
        ("AR, free text", ARConfig(), free, True),
        ("AR + schema, a token a step", ARConfig(), shaped, False),
        ("AR + schema, forced tokens verified", ARConfig(), shaped, True),
    ]
    for n in strides:
        rows.append((f"ISD N={n} + schema, forced drafts", ISDConfig(stride=n), shaped, True))
        rows.append((f"ISD N={n} + schema, own drafts", ISDConfig(stride=n), shaped, False))
    rates: list[list[tuple[float, float]]] = [[] for _ in rows]
    outputs: list = [None] * len(rows)
    for _ in range(args.rounds):  # the decoders alternate, so drift in the machine's speed hits each alike
        for i, (_name, config, params, forced) in enumerate(rows):
            res, seconds = run(config, params, forced)
            # the decode phase: after each request's first token (the prefill), so that outputs of other lengths
            # (free text runs to the limit, a record ends sooner) weigh their prefill alike
            decode_s = sum(r.stats.end_time - r.stats.first_token_time for r in res)
            tokens = sum(len(r.token_ids) for r in res)
            rates[i].append((tokens / seconds, sum(len(r.token_ids) - 1 for r in res) / decode_s))
            outputs[i] = res
    measured = []
    for (name, *_), res, rs in zip(rows, outputs, rates):
        tpf = sum(len(r.token_ids) for r in res) / max(sum(r.stats.forwards for r in res), 1)
        rate, steady = statistics.median(r for r, _ in rs), statistics.median(d for _, d in rs)
        measured.append((name, res, rate, steady, tpf))
    free_rate, ref = measured[0][3], measured[1]
    print(
        "\n| decoder | TPF | decode tokens/s | vs free AR | request tokens/s | vs AR + schema | valid JSON | == AR + schema |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, res, rate, steady, tpf in measured:
        same = (
            "-"
            if res is measured[0][1]
            else f"{sum(a.token_ids == b.token_ids for a, b in zip(res, ref[1]))}/{len(res)}"
        )
        ok = sum(valid(r.text) for r in res)
        print(
            f"| {name} | {tpf:.2f} | {steady:.1f} | {steady / free_rate:.2f}x | {rate:.1f} | {rate / ref[2]:.2f}x | "
            f"{ok}/{len(res)} | {same} |"
        )
    lengths = [sum(len(r.token_ids) for r in m[1]) / len(m[1]) for m in measured[:2]]
    print(f"\nmean output tokens: free text {lengths[0]:.0f}, with the schema {lengths[1]:.0f}")
    print("(decode tokens/s of the rows with forced tokens count the forced start, committed in the prefill)")
    print(f"\nload after: {os.getloadavg()[0]:.1f}")
    print(f"example: {ref[1][0].text!r}")


if __name__ == "__main__":
    main()
