"""Train a diffusion LM: one loop for every objective (mdm | block | idlm), on accelerate.

  dlm train --config idlm_b2_cpu --data chat.jsonl --max-minutes 10
  dlm train --model smollm2-135m --objective idlm --block-size 2 --data chat.jsonl --output-dir runs/b2
  dlm train --config diffullama_cpu --packed-data-dir data/packed --train.keep_last 2
  accelerate launch --config_file configs/accelerate/ddp_cpu.yaml -m dlm train --config ...

Configuration: dataclass defaults < the YAML file (--config) < flags. Every field is a flag --section.key
(e.g. --optim.warmup_ratio 0.03); the original trainers' flags (--batch-size, --learning-rate, ...) also work.
Outputs in --output-dir: the final model + tokenizer, checkpoints/step_XXXXXXXX/ (every --save-every steps),
eval_history.jsonl (every --eval-every steps), train_log.jsonl, run_config.yaml. --resume auto continues the
latest checkpoint exactly (model, optimizer, scheduler, RNG, data position).
"""

from __future__ import annotations

import argparse

# the common flags (ALIASES in dlm.config: the original trainers' names and dlm's shortcuts) -> how each parses;
# their help is the field's own
FLAGS = {
    "model": "value",
    "objective": "value",
    "block-size": "value",
    "packed-data-dir": "value",
    "packed-prefixes": "list",
    "packed-weights": "list",
    "data": "value",
    "eval-data": "value",
    "seq-length": "value",
    "batch-size": "value",
    "gradient-accumulate-every": "value",
    "max-train-steps": "value",
    "max-minutes": "value",
    "learning-rate": "value",
    "output-dir": "value",
    "checkpoint-dir": "value",
    "save-every": "value",
    "keep-last": "value",
    "eval-every": "value",
    "eval-tasks": "list",
    "eval-history-path": "value",
    "eval-data-dir": "value",
    "attn-impl": "value",
    "mixed-precision": "value",
    "seed": "value",
    "lora-r": "value",
    "lora-alpha": "value",
    "gated-lora": "flag",
    "gradient-checkpointing": "flag",
    "resume": "optional",
    "overwrite": "flag",
    "wandb-project": "value",
    "wandb-entity": "value",
    "wandb-run-name": "value",
    "wandb-dir": "value",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlm.config import ALIASES, field_help, is_list_field, presets, section_keys

    parser.usage = "dlm train [--config YAML] [--flag VALUE ...] [--section.key VALUE ...]"
    parser.add_argument(
        "--config",
        metavar="YAML|PRESET",
        help=f"a YAML file, or a preset shipped with dlm by name (dlm/configs/): {', '.join(presets())}",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    g = parser.add_argument_group("common flags (the original trainers' names and dlm's shortcuts)")
    for flag, kind in FLAGS.items():
        key = flag.replace("-", "_")
        dotted, origin = ALIASES[key]
        help_text = f"{field_help(dotted)}; = --{dotted} ({origin})"
        dest = f"flat__{key}"
        if kind == "flag":
            g.add_argument(
                f"--{flag}", dest=dest, action="store_const", const=True, default=argparse.SUPPRESS, help=help_text
            )
        elif kind == "optional":
            g.add_argument(
                f"--{flag}",
                dest=dest,
                nargs="?",
                const="auto",
                default=argparse.SUPPRESS,
                metavar="auto|PATH",
                help=help_text,
            )
        elif kind == "list":
            g.add_argument(f"--{flag}", dest=dest, nargs="+", default=argparse.SUPPRESS, metavar="V", help=help_text)
        else:
            g.add_argument(f"--{flag}", dest=dest, default=argparse.SUPPRESS, metavar="V", help=help_text)
    s = parser.add_argument_group("every configuration field (--section.key VALUE)")
    for dotted in section_keys():
        s.add_argument(
            f"--{dotted}",
            dest=f"cfg__{dotted}",
            default=argparse.SUPPRESS,
            metavar="V",
            nargs="+" if is_list_field(dotted) else None,
            help=field_help(dotted),
        )
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
            flat[dest[len("flat__") :]] = value
        elif dest.startswith("cfg__"):
            dotted[dest[len("cfg__") :]] = value
    return {**flat, **dotted}


def build_config(args: argparse.Namespace):
    from dlm.config import TrainingConfig, apply_mapping, load_yaml
    from dlm.model.families import folder_objective

    cfg = TrainingConfig()
    mapping = load_yaml(args.config) if args.config else {}
    if args.config:
        apply_mapping(cfg, mapping, where=f" in '{args.config}'", in_file=True)
    given = overrides_from_args(args)
    apply_mapping(cfg, given, where=" on the command line")
    if not (_names_objective(mapping) or _names_objective(given)):  # a DLM trains on with its own objective
        own = folder_objective(cfg.model.name)
        if own is not None:
            cfg.model.objective = own
    return cfg.validate()


def _names_objective(mapping: dict) -> bool:
    """Whether a config mapping (YAML or flags; flat aliases, section.key or nested sections) sets the objective."""
    from dlm.config import ALIASES

    for key, value in mapping.items():
        key = str(key).replace("-", "_")
        if key == "model.objective" or ALIASES.get(key, ("",))[0] == "model.objective":
            return True
        if key == "model" and isinstance(value, dict) and "objective" in value:
            return True
    return False


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
        print(
            f"dlm train: {result.step} steps ({result.stopped}), last loss {last:.4f}, {result.tokens} tokens in "
            f"{result.seconds:.0f}s; model in {result.output_dir}"
        )
    return 0
