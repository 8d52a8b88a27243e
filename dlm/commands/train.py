"""Train a diffusion LM: one loop for every objective (mdm | block | idlm), on accelerate.

  dlm train --config idlm_b2_cpu --data chat.jsonl --max-minutes 10
  dlm train --model smollm2-135m --objective idlm --block-size 2 --data chat.jsonl --output-dir runs/b2
  dlm train --config diffullama_cpu --packed-data-dir data/packed --train.keep_last 2
  accelerate launch --config_file configs/accelerate/ddp.yaml -m dlm train --config ...

Configuration: dataclass defaults < the YAML file (--config) < flags. Every field is a flag --section.key
(e.g. --optim.warmup_ratio 0.03); the original trainers' flags (--batch-size, --learning-rate, ...) also work.
Outputs in --output-dir: the final model + tokenizer, checkpoints/step_XXXXXXXX/ (every --save-every steps),
eval_history.jsonl (every --eval-every steps), train_log.jsonl, run_config.yaml. --resume auto continues the
latest checkpoint exactly (model, optimizer, scheduler, RNG, data position).
"""

from __future__ import annotations

import argparse

# flat flag -> (help, kind); kind: "value" | "list" | "flag" | "optional"
FLAGS = {
    "model": ("model alias or folder (AR: converted on load; DLM: trained further)", "value"),
    "objective": ("mdm | block | idlm", "value"),
    "block-size": ("masks per block (block / idlm)", "value"),
    "packed-data-dir": ("folder of packed LITPKDS shards (dlm prepare)", "value"),
    "packed-prefixes": ("shard prefixes (comma-separated or several values)", "list"),
    "packed-weights": ("mixing weight per prefix", "list"),
    "data": ("chat/instruction JSONL (messages | conversations | prompt/response)", "value"),
    "eval-data": ("held-out chat JSONL (default: a seeded slice of --data)", "value"),
    "seq-length": ("tokens per training row (cutoff_len)", "value"),
    "batch-size": ("rows per device per micro-batch", "value"),
    "gradient-accumulate-every": ("micro-batches per optimizer step", "value"),
    "max-train-steps": ("optimizer steps", "value"),
    "max-minutes": ("wall-clock budget: stop cleanly and save when spent", "value"),
    "learning-rate": ("peak learning rate", "value"),
    "output-dir": ("run folder: final model, checkpoints, logs", "value"),
    "checkpoint-dir": ("checkpoints (default OUTPUT_DIR/checkpoints)", "value"),
    "save-every": ("checkpoint every N steps (0: only the final model)", "value"),
    "keep-last": ("keep the N newest checkpoints (0: all)", "value"),
    "eval-every": ("held-out loss (+ --eval-tasks) every N steps (0: never)", "value"),
    "eval-tasks": ("task evaluations, e.g. hellaswag,piqa", "list"),
    "eval-history-path": ("eval history JSONL (default OUTPUT_DIR/eval_history.jsonl)", "value"),
    "eval-data-dir": ("folder holding the evaluation tasks' files", "value"),
    "attn-impl": ("sdpa | flash_attention_2 (flash: mdm only, full attention)", "value"),
    "mixed-precision": ("auto | no | bf16 | fp16 (weights stay fp32)", "value"),
    "seed": ("random seed", "value"),
    "lora-r": ("LoRA rank (0: full fine-tuning)", "value"),
    "lora-alpha": ("LoRA alpha", "value"),
    "gated-lora": ("LoRA adapters only at mask positions (I-DLM lossless)", "flag"),
    "gradient-checkpointing": ("recompute activations in backward (less memory)", "flag"),
    "resume": ("auto (latest checkpoint) or PATH of a checkpoint", "optional"),
    "overwrite": ("start over in an output dir that holds a run", "flag"),
    "wandb-project": ("log to Weights & Biases (needs dlm[wandb])", "value"),
    "wandb-entity": ("W&B entity", "value"),
    "wandb-run-name": ("W&B run name", "value"),
    "wandb-dir": ("W&B local folder", "value"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlm.config import FLAT_KEYS, field_help, is_list_field, presets, section_keys

    parser.usage = "dlm train [--config YAML] [--flag VALUE ...] [--section.key VALUE ...]"
    parser.add_argument("--config", metavar="YAML|PRESET", help="a YAML file, or a preset shipped with dlm by "
                        f"name (dlm/configs/): {', '.join(presets())}")
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    g = parser.add_argument_group("common flags (the original trainers' names)")
    for flag, (help_text, kind) in FLAGS.items():
        key = flag.replace("-", "_")
        assert key in FLAT_KEYS, key
        dest = f"flat__{key}"
        if kind == "flag":
            g.add_argument(f"--{flag}", dest=dest, action="store_const", const=True, default=argparse.SUPPRESS,
                           help=help_text)
        elif kind == "optional":
            g.add_argument(f"--{flag}", dest=dest, nargs="?", const="auto", default=argparse.SUPPRESS,
                           metavar="auto|PATH", help=help_text)
        elif kind == "list":
            g.add_argument(f"--{flag}", dest=dest, nargs="+", default=argparse.SUPPRESS, metavar="V",
                           help=help_text)
        else:
            g.add_argument(f"--{flag}", dest=dest, default=argparse.SUPPRESS, metavar="V", help=help_text)
    s = parser.add_argument_group("every configuration field (--section.key VALUE)")
    for dotted in section_keys():
        s.add_argument(f"--{dotted}", dest=f"cfg__{dotted}", default=argparse.SUPPRESS, metavar="V",
                       nargs="+" if is_list_field(dotted) else None, help=field_help(dotted))
    _suggest_on_unknown(parser)


def _suggest_on_unknown(parser: argparse.ArgumentParser) -> None:
    """Unknown --options become an error naming the closest valid ones (argparse alone just lists them)."""
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extras = original(args, namespace)
        unknown = [a for a in extras if a.startswith("--")]
        if unknown:
            from dlm.config import section_keys
            from dlm.errors import closest

            valid = ["--" + k for k in FLAGS] + ["--" + k for k in section_keys()] + ["--config"]
            name = unknown[0].split("=", 1)[0]
            hint = closest(name, valid)
            parser.error(f"unknown option {name}; did you mean: {hint}")
        return ns, extras

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def overrides_from_args(args: argparse.Namespace) -> dict:
    """Flags given on the command line as a mapping of flat keys and section.key entries (flags win)."""
    flat, dotted = {}, {}
    for dest, value in vars(args).items():
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        if dest.startswith("flat__"):
            flat[dest[len("flat__"):]] = value
        elif dest.startswith("cfg__"):
            dotted[dest[len("cfg__"):]] = value
    return {**flat, **dotted}


def build_config(args: argparse.Namespace):
    from dlm.config import apply_mapping, load_yaml, TrainingConfig

    cfg = TrainingConfig()
    if args.config:
        apply_mapping(cfg, load_yaml(args.config), where=f" in '{args.config}'")
    apply_mapping(cfg, overrides_from_args(args), where=" on the command line")
    return cfg.validate()


def run(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    from dlm.train.loop import train

    result = train(cfg)
    from accelerate import PartialState

    if PartialState().is_main_process:
        last = result.losses[-1] if result.losses else float("nan")
        print(f"dlm train: {result.step} steps ({result.stopped}), last loss {last:.4f}, {result.tokens} tokens in "
              f"{result.seconds:.0f}s; model in {result.output_dir}")
    return 0
