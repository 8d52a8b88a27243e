"""Our causal PIQA score vs lm-evaluation-harness's own ``hf`` model on the same items and prompts.

Writes (to a temporary folder, never into the repo) the PIQA items with their labels as JSONL and a harness task
YAML with exactly our prompt, runs ``lm_eval``'s ``hf`` model on it and ``dlm``'s :func:`run_eval`-path scoring
on the same items, and prints acc / acc_norm of both, the largest per-choice log-likelihood difference and how
many predictions differ. Two prompts: ``spec`` (DiffuLLaMA, docs/algorithms.md#evaluation: "Question: {goal}\\nAnswer: " then
" " + sol) and ``harness`` (lm-eval's piqa task: "Question: {goal}\\nAnswer:" then " " + sol).

``--served ar,isd`` adds lm-eval's ``local-completions`` model against ``dlm serve`` (started in this process on a
loopback port, decoding with each listed decoder): the harness's log-likelihood requests (token ids, ``echo``,
``logprobs``) answered by the server, compared with the ``hf`` model item by item.

    python bench/eval_harness_parity.py                      # smollm2-135m, the 200 PIQA items in shared data
    python bench/eval_harness_parity.py --limit 50 --prompts spec
    python bench/eval_harness_parity.py --prompts harness --served ar,isd
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from dlm.decode.options import EngineOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")

PROMPTS = {  # name -> (harness doc_to_text, target_delimiter, choice prefix); ours = context + choice
    "spec": ("Question: {{goal}}\\nAnswer: ", "", " "),
    "harness": ("Question: {{goal}}\\nAnswer:", " ", ""),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default=os.path.join(SHARED, "piqa"))
    ap.add_argument("--limit", type=int)
    ap.add_argument("--prompts", default="spec,harness")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--served", default="", help="decoders of dlm serve to score through (e.g. ar,isd)")
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    import lm_eval
    from lm_eval.tasks import TaskManager

    from dlm.eval.multiple_choice import evaluate_multiple_choice
    from dlm.eval.scoring import as_eval_model
    from dlm.eval.tasks import load_task
    from dlm.eval.tasks.base import MCExample
    from dlm.model.hub import load_model, load_tokenizer, resolve_model_path

    folder = resolve_model_path(args.model)
    items = load_task("piqa", paths={"piqa": args.data})
    if args.limit:
        items = items[: args.limit]
    goals = [ex.context[len("Question: ") : -len("\nAnswer: ")] for ex in items]
    sols = [[c[1:] for c in ex.choices] for ex in items]
    tmp = tempfile.mkdtemp(prefix="dlm_parity_")
    data = os.path.join(tmp, "piqa_items.jsonl")
    with open(data, "w") as fh:
        for g, (s1, s2), ex in zip(goals, sols, items):
            fh.write(json.dumps({"goal": g, "sol1": s1, "sol2": s2, "label": ex.label}) + "\n")

    model = load_model(folder)
    em = as_eval_model(model, load_tokenizer(folder))
    rows = []
    served_rows = []
    for name in args.prompts.split(","):
        text, delim, prefix = PROMPTS[name]
        with open(os.path.join(tmp, f"parity_{name}.yaml"), "w") as fh:
            fh.write(
                f"task: dlm_parity_piqa_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
                f'doc_to_text: "{text}"\ntarget_delimiter: "{delim}"\n'
                f"doc_to_choice: \"{{{{['{prefix}' + sol1, '{prefix}' + sol2]}}}}\"\ndoc_to_target: label\n"
                f"metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
            )
        ctx_text = text.replace("{{goal}}", "{}").replace("\\n", "\n")
        examples = [
            MCExample(ctx_text.format(g) + delim, [prefix + s for s in ss], ex.label)
            for g, ss, ex in zip(goals, sols, items)
        ]
        t0 = time.perf_counter()
        ours = evaluate_multiple_choice(em, examples, "piqa", keep_predictions=True)
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={folder},dtype=float32",
            tasks=[f"dlm_parity_piqa_{name}"],
            batch_size=args.batch_size,
            task_manager=TaskManager(include_path=tmp, include_defaults=False),
            log_samples=True,
            device="cpu",
        )
        t_hf = time.perf_counter() - t0
        task = f"dlm_parity_piqa_{name}"
        res = out["results"][task]
        samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
        max_diff, differ = 0.0, 0
        for s, p in zip(samples, ours["predictions"]):
            hf_ll = [float(r[0]) for r in s["filtered_resps"]]
            max_diff = max(max_diff, max(abs(a - b) for a, b in zip(hf_ll, p["scores"])))
            differ += int(max(range(2), key=lambda i: hf_ll[i]) != p["pred"])
        rows.append(
            (name, ours["acc"], res["acc,none"], ours["acc_norm"], res["acc_norm,none"], max_diff, differ, t_ours, t_hf)
        )
        for decode in [d for d in args.served.split(",") if d]:
            served_rows.append((name, decode, *served(folder, decode, task, tmp, samples, args.batch_size)))
    print(f"\nPIQA, {len(items)} items from {args.data}, model {args.model} (causal, fp32, CPU)")
    print(
        f"{'prompt':<8} {'dlm acc':>8} {'hf acc':>8} {'dlm norm':>9} {'hf norm':>8} {'max|dLL|':>9} "
        f"{'preds differ':>12} {'dlm s':>7} {'hf s':>7}"
    )
    for r in rows:
        print(
            f"{r[0]:<8} {r[1]:>8.4f} {r[2]:>8.4f} {r[3]:>9.4f} {r[4]:>8.4f} {r[5]:>9.2e} {r[6]:>12d} "
            f"{r[7]:>7.1f} {r[8]:>7.1f}"
        )
    if served_rows:
        print("\nlm-eval local-completions against dlm serve vs lm-eval hf, per item")
        print(f"{'prompt':<8} {'decode':<6} {'acc':>7} {'norm':>7} {'max|dLL|':>9} {'preds differ':>12} {'s':>7}")
        for r in served_rows:
            print(f"{r[0]:<8} {r[1]:<6} {r[2]:>7.4f} {r[3]:>7.4f} {r[4]:>9.2e} {r[5]:>12d} {r[6]:>7.1f}")


def served(folder, decode: str, task: str, include: str, hf_samples: list, batch_size: int) -> tuple:
    """lm-eval's ``local-completions`` model on ``task`` against ``dlm serve --decode decode`` (in this process):
    (acc, acc_norm, largest per-choice log-likelihood difference to the hf samples, predictions that differ,
    seconds)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from dlm.serve.app import ServerThread, ServeSettings, create_app, load_engine
    from dlm.serve.scheduler import Scheduler

    engine = load_engine(str(folder), decode=decode, options=EngineOptions(max_batch_size=16))
    app = create_app(Scheduler(engine), ServeSettings(model_name="dlm", max_tokens_limit=16))
    with ServerThread(app) as srv:
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=dlm,base_url={srv.url}/v1/completions,tokenizer={folder},num_concurrent=1",
            tasks=[task],
            batch_size=batch_size,
            task_manager=TaskManager(include_path=include, include_defaults=False),
            log_samples=True,
        )
        seconds = time.perf_counter() - t0
    res = out["results"][task]
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    max_diff, differ = 0.0, 0
    for s, h in zip(samples, hf_samples):
        a = [float(r[0]) for r in s["filtered_resps"]]
        b = [float(r[0]) for r in h["filtered_resps"]]
        max_diff = max(max_diff, max(abs(x - y) for x, y in zip(a, b)))
        differ += int(max(range(len(a)), key=lambda i: a[i]) != max(range(len(b)), key=lambda i: b[i]))
    return res["acc,none"], res["acc_norm,none"], max_diff, differ, seconds


if __name__ == "__main__":
    main()
