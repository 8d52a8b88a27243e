"""Evaluate a model on benchmarks, or print/plot the evaluation history of training runs.

Benchmarks (multiple choice: hellaswag, winogrande, piqa, siqa; generation: lambada, poem_reverse):

    dlm eval --model smollm2-135m --eval-tasks piqa,siqa --data-dir benchmarks/ --limit 100 --output r.json

An I-DLM's drafting quality (greedy ISD: acceptance per draft position, TPF, output == greedy AR), on dlm's
built-in held-out instructions unless --isd-acceptance-path gives prompts (chat JSONL, {"prompt"} JSONL or text):

    dlm eval --model runs/quickstart/train_b2 --eval-tasks isd_acceptance --limit 48 --stride 2 --dtype float32

Diffusion LMs (objective mdm/block) are scored by the denoising loss (--diffusion-steps T masks per choice,
deterministic for a --seed); AR models and I-DLMs by the exact log-likelihood. A plain AR folder/alias is scored as
the AR model unless --objective converts it on the fly.

History (what training appends to eval_history.jsonl):

    dlm eval --history-paths run1/eval_history.jsonl run2/eval_history.jsonl --plot curves.png
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and tasks")
    g.add_argument("--model", help="DLM or AR model: hub id (org/name), local folder or alias (e.g. smollm2-135m)")
    g.add_argument(
        "--objective",
        choices=("mdm", "block", "idlm"),
        help="convert a plain AR model on the fly to this DLM kind before evaluating",
    )
    g.add_argument(
        "--eval-tasks",
        default="hellaswag,winogrande,piqa,siqa",
        help="comma-separated: hellaswag,winogrande,piqa,siqa,lambada,poem_reverse,isd_acceptance",
    )
    g.add_argument("--data-dir", help="folder holding one sub-folder per task (piqa/, siqa/, ...)")
    for task in ("hellaswag", "winogrande", "piqa", "siqa", "lambada", "poem"):
        g.add_argument(f"--{task}-path", help=f"{task} data file or folder (overrides --data-dir)")
    g.add_argument(
        "--isd-acceptance-path",
        help="isd_acceptance prompts: chat JSONL, JSONL with 'prompt', or one "
        "prompt per line (default: the built-in held-out instructions)",
    )
    g.add_argument("--limit", type=int, help="evaluate only the first N examples of each task")
    g.add_argument("--output", help="write the results as JSON to this file")
    g.add_argument("--predictions", action="store_true", help="include per-example predictions in --output")
    s = p.add_argument_group("scoring and decoding")
    s.add_argument(
        "--scoring",
        default="auto",
        choices=("auto", "causal", "diffusion"),
        help="auto: by the model's kind (causal for AR/I-DLM, denoising score for mdm/block)",
    )
    s.add_argument("--diffusion-steps", type=int, default=32, help="T for the denoising-loss score (default 32)")
    s.add_argument("--seed", type=int, default=0, help="seed of the denoising masks and of sampling")
    s.add_argument(
        "--quiet", action="store_true", help="no progress bars (they are shown only when stderr is a terminal)"
    )
    s.add_argument(
        "--poem-direction",
        default="ftb",
        choices=("ftb", "btf"),
        help="poem_reverse: ftb = give the first line, ask the next; btf = the reverse",
    )
    s.add_argument("--gen-length", type=int, default=28, help="poem_reverse: tokens to generate (default 28)")
    s.add_argument("--batch-size", type=int, default=8, help="generation batch size")
    s.add_argument(
        "--score-batch-tokens",
        type=int,
        default=8192,
        help="scoring batch size in tokens (rows x padded length per forward; default 8192)",
    )
    from dlm.decode.configs import add_decoder_arguments, deprecated_flag

    deprecated_flag(s, "--token-budget", "--score-batch-tokens", dest="score_batch_tokens", type=int)
    add_decoder_arguments(
        p,
        default="auto",
        extra_names=("auto",),
        implied="auto: the model's own (ar, isd for an I-DLM, mdm, block)",
        old_flags={"steps": "--gen-steps"},
        group_title="decoding of the generation tasks and isd_acceptance (docs/decoding.md#settings)",
    )
    s.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: $DLM_DEVICE or the best available)")
    s.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    h = p.add_argument_group("history")
    h.add_argument(
        "--history-paths",
        nargs="+",
        metavar="JSONL",
        help="print the checkpoint-by-metric table of these eval_history.jsonl files",
    )
    h.add_argument("--plot", metavar="PNG", help="with --history-paths: draw the metric curves to this file")


def _print_results(results: dict) -> None:
    header = f"{'task':<14} {'metric':<9} {'accuracy':>9} {'stderr':>8} {'examples':>9} {'seconds':>9}"
    print(header)
    print("-" * len(header))
    for task, r in results.items():
        metrics = ["acc"] + (["acc_norm"] if "acc_norm" in r else [])
        for m in metrics:
            print(f"{task:<14} {m:<9} {r[m]:>9.4f} {r[m + '_stderr']:>8.4f} {r['n']:>9d} {r['seconds']:>9.1f}")
        # isd_acceptance: the later draft positions, TPF and the exactness check (no standard error)
        for m in sorted(k for k in r if k.startswith("acc_pos")) + [k for k in ("tpf", "identical") if k in r]:
            print(f"{task:<14} {m:<9} {r[m]:>9.4f} {'-':>8} {r['n']:>9d} {r['seconds']:>9.1f}")


def _write_json(path: str, payload: dict) -> None:
    import json
    import os
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, out)


def run(args) -> int:
    from dlm.errors import DLMError

    if args.history_paths:
        from dlm.eval.history import format_history_table, plot_history, read_history

        records = read_history(args.history_paths)
        print(format_history_table(records))
        if args.plot:
            print(f"plot: {plot_history(records, args.plot)}")
        return 0
    if args.plot:
        raise DLMError("--plot draws the history: give --history-paths too")
    if not args.model:
        raise DLMError("give --model PATH_OR_ALIAS to evaluate (or --history-paths to print a history)")

    import dataclasses
    import json

    from dlm.device import get_device, get_dtype
    from dlm.eval.runner import EvalSettings, run_eval
    from dlm.eval.tasks import load_task, parse_task_list
    from dlm.model.convert import load_any
    from dlm.model.hub import load_model, load_tokenizer, resolve_model_path
    from dlm.progress import wanted

    paths = {t: getattr(args, f"{t}_path") for t in ("hellaswag", "winogrande", "piqa", "siqa", "lambada")}
    paths["poem_reverse"] = args.poem_path
    paths["isd_acceptance"] = args.isd_acceptance_path
    from dlm.decode.configs import config_from_args, given_settings, owning_decoders

    if args.decode != "auto":
        decoder = config_from_args(args)  # bad values fail before the model loads
    else:
        owning_decoders(given_settings(args))  # settings of no one decoder fail before the model loads
    settings = EvalSettings(  # bad values fail before the model loads
        data_dir=args.data_dir,
        paths=paths,
        limit=args.limit,
        scoring=args.scoring,
        diffusion_steps=args.diffusion_steps,
        score_batch_tokens=args.score_batch_tokens,
        seed=args.seed,
        batch_size=args.batch_size,
        poem_direction=args.poem_direction,
        poem_gen_length=args.gen_length,
        keep_predictions=args.predictions,
    )
    for name in parse_task_list(args.eval_tasks):  # fail on bad data before loading the model
        options = {"direction": args.poem_direction} if name == "poem_reverse" else {}
        load_task(name, args.data_dir, paths, **options)
    device = get_device(args.device)
    dtype = get_dtype(args.dtype, device)
    folder = resolve_model_path(args.model)
    fields = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if "dlm_objective" in fields or args.objective:
        model = load_any(folder, objective=args.objective, dtype=dtype, device=device)
        tokenizer = None
    else:
        model = load_model(folder, dtype=dtype, device=device)
        tokenizer = load_tokenizer(folder)
    if args.decode == "auto":  # the model's own decoder, with the settings given
        from dlm.decode.configs import own_decoder

        decoder = config_from_args(args, own_decoder(getattr(model, "objective", None)))
    settings = dataclasses.replace(settings, decoder=decoder)
    results = run_eval(
        model,
        args.eval_tasks,
        settings,
        tokenizer=tokenizer,
        log=lambda s: print(s, flush=True),
        progress=wanted(args.quiet),
    )
    print()
    _print_results(results)
    if args.output:
        _write_json(
            args.output,
            {
                "model": str(args.model),
                "settings": {
                    "scoring": args.scoring,
                    "diffusion_steps": args.diffusion_steps,
                    "seed": args.seed,
                    "decode": decoder.name,
                    "decoder": decoder.changed(),
                    "limit": args.limit,
                },
                "results": results,
            },
        )
        print(f"wrote {args.output}")
    return 0
