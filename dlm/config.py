"""Typed configuration of ``dlm train``: dataclasses, YAML presets and command-line overrides.

A configuration is a :class:`TrainingConfig` made of sections (``model``, ``data``, ``mdm``, ``block``, ``idlm``,
``renoise``,
``optim``, ``train``, ``eval``, ``lora``, ``wandb``). It is built in three layers, each overriding the previous:

1. the dataclass defaults below;
2. a YAML file (``--config FILE``) or a preset shipped in the wheel by name (``--config idlm_b2_cpu``, the files of
   ``dlm/configs/``), either with sections (``train: {batch_size: 4}``) or with the
   flat keys of the original projects (``learning_rate``, ``per_device_train_batch_size``, ``cutoff_len``,
   ``block_length``, ``ce_alpha``, ``loss_auto_balance``, ...; see :data:`FLAT_KEYS`);
3. command-line flags: ``--section.key value`` for any field, and the original flags (``--batch-size``,
   ``--learning-rate``, ...), which are the flat keys with dashes.

An unknown key at any layer is a :class:`~dlm.errors.DLMError` naming the key and the closest valid ones.
No ``eval``/``exec``: values are YAML scalars/lists coerced to the field's declared type.

Each field is declared once with its help text and choices (:func:`dlm.fields.opt`): ``dlm train --help`` and the
checks read them; the ``mdm`` / ``block`` / ``idlm`` / ``renoise`` sections are the objectives' own configs
(:mod:`dlm.objectives.configs`). The loader is plain dataclasses plus the short coercion below rather than a
config library (simple_parsing, jsonargparse): those bring their own flag syntax and nested-key rules, while dlm
must accept the original trainers' flags and YAML keys (:data:`ALIASES`) and name the closest valid key on a typo;
the coercion is strict (``"3.5"`` is no int, ``"yes"`` no float) and needs no dependency beyond PyYAML.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlm.errors import DLMError, closest
from dlm.fields import check_choices, describe, opt
from dlm.objectives.configs import BlockConfig, IDLMConfig, MDMConfig, RenoiseConfig

OBJECTIVES = ("mdm", "block", "idlm", "renoise")
ATTN_IMPLS = ("sdpa", "eager", "flash_attention_2", "flex_attention")


@dataclass
class ModelConfig:
    """The model to train."""

    name: str = opt(
        "smollm2-135m",
        "alias, hub id (org/name[@revision]), AR folder (converted on load) or DLM folder (trained further)",
    )
    objective: str = opt(
        "idlm", "training objective (dlm train on a DLM folder: its own unless given)", choices=OBJECTIVES
    )
    block_size: int | None = opt(
        None, "masks per block (block / idlm); None: the model's, else the objective's default (block 4, idlm 1)"
    )
    attn_impl: str = opt(
        "sdpa", "attention kernel (flash_attention_2: mdm only, full attention from step 0)", choices=ATTN_IMPLS
    )
    mask_token: str | None = opt(
        None, "mask token text to add when converting an AR model (default: the tokenizer's own, else <|mdm_mask|>)"
    )
    gradient_checkpointing: bool = opt(False, "recompute activations in the backward pass (less memory)")


@dataclass
class DataConfig:
    """Training data: packed LITPKDS shards or chat/instruction JSONL."""

    packed_data_dir: str | None = opt(None, "folder of packed LITPKDS shards (dlm prepare)")
    packed_prefixes: list[str] = opt(["train"], "shard file prefixes to train on")
    packed_weights: list[float] | None = opt(None, "mixing weight per prefix (default: equal)")
    eval_packed_prefixes: list[str] | None = opt(None, "held-out shard prefixes for the scheduled held-out loss")
    data: str | None = opt(None, "chat/instruction JSONL (messages | conversations | prompt/response records)")
    eval_data: str | None = opt(None, "held-out chat JSONL; default: a seeded eval_fraction of data")
    eval_fraction: float = opt(
        0.05, "share of data held out when eval_data is not given (always, so resumes see the same split)"
    )
    seq_length: int = opt(256, "tokens per training row (chat data: the cut-off length)", unit="tokens")
    idlm_block_size: int | None = opt(
        None,
        "I-DLM data block size (I-DLM's block_length; was data.block_length); must equal the model's block size "
        "when given",
    )
    seed: int = opt(42, "seed of the data order and the held-out split")


@dataclass
class OptimConfig:
    """AdamW with a warm-up then a cosine, constant or warm-up-stable-decay (wsd) schedule.

    The decaying schedules follow the run's progress: the larger of the optimizer steps done over
    ``train.max_train_steps`` and, when ``train.max_minutes`` is set, the time spent over that budget, so a run
    bounded by time (a huge step limit) still decays and ends at the floor when its minutes run out."""

    learning_rate: float = opt(1e-4, "peak learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    schedule: str = opt(
        "cosine",
        "learning-rate schedule after the warm-up (wsd: constant, then linear to the floor over decay_ratio)",
        choices=("cosine", "constant", "wsd"),
    )
    warmup_ratio: float = opt(0.0, "warm-up as a share of max_train_steps")
    warmup_steps: int | None = opt(None, "warm-up steps (overrides warmup_ratio)", unit="optimizer steps")
    min_lr_ratio: float = opt(0.0, "cosine / wsd floor, as a share of learning_rate")
    decay_ratio: float = opt(0.2, "wsd: the last share of the run that decays to the floor")
    max_grad_norm: float = opt(1.0, "gradient clipping norm (0: no clipping)")
    fused: str = opt(
        "auto", "fused AdamW kernel (auto: where torch has one for the device)", choices=("auto", "true", "false")
    )


@dataclass
class TrainConfig:
    """The run: batch, steps, precision, outputs, checkpoints, resume."""

    batch_size: int = opt(4, "rows per device per micro-batch")
    gradient_accumulate_every: int = opt(1, "micro-batches per optimizer step")
    max_train_steps: int = opt(100, "optimizer steps to train", unit="optimizer steps")
    max_minutes: float | None = opt(None, "wall-clock budget: stop cleanly and save when spent", unit="minutes")
    mixed_precision: str = opt(
        "auto",
        "autocast precision (auto: bf16 on GPUs with it and on CPUs where measured faster); weights stay fp32",
        choices=("auto", "no", "bf16", "fp16"),
    )
    seed: int = opt(42, "seed of initialisation, masking and dropout")
    output_dir: str = opt("runs/dlm", "run folder: final model, checkpoints, logs")
    checkpoint_dir: str | None = opt(None, "checkpoint folder (default output_dir/checkpoints)")
    save_every: int = opt(0, "checkpoint every N optimizer steps (0: only the final model)", unit="optimizer steps")
    keep_last: int = opt(0, "keep the N newest checkpoints (0: all)")
    resume: str | None = opt(None, "auto (the latest complete checkpoint) or the PATH of a checkpoint")
    overwrite: bool = opt(False, "start over in an output_dir that holds a run")
    log_every: int = opt(1, "JSONL log line every N optimizer steps", unit="optimizer steps")
    log_path: str | None = opt(None, "JSONL training log (default output_dir/train_log.jsonl)")
    progress: bool = opt(True, "progress bar on stderr")
    accelerate_config: str | None = opt(
        None, "the accelerate launcher file the preset is meant for (accelerate launch --config_file)"
    )


@dataclass
class EvalConfig:
    """Scheduled evaluation during training."""

    eval_every: int = opt(
        0, "held-out loss (and eval_tasks) every N optimizer steps (0: never)", unit="optimizer steps"
    )
    eval_tasks: list[str] = opt(
        [], "task evaluations (dlm eval's tasks, e.g. hellaswag,piqa) besides the held-out loss"
    )
    eval_history_path: str | None = opt(None, "eval history JSONL (default output_dir/eval_history.jsonl)")
    eval_batches: int = opt(4, "held-out batches of the held-out loss")
    eval_limit: int = opt(50, "examples per task evaluation")
    eval_batch_size: int = opt(8, "generation batch of the task evaluations (lambada, poem_reverse, isd_acceptance)")
    eval_data_dir: str | None = opt(None, "folder with <task>/ files for the task evaluations")


@dataclass
class LoraConfig:
    """LoRA adapters (peft); r = 0 trains all weights."""

    r: int = opt(0, "LoRA rank (0: full fine-tuning)")
    alpha: int = opt(32, "LoRA alpha")
    dropout: float = opt(0.0, "LoRA dropout")
    target_modules: list[str] | None = opt(None, "adapted modules (default all-linear)")
    gated: bool = opt(
        False, "adapters act only at mask positions (I-DLM lossless mode: the clean path stays the base model)"
    )


@dataclass
class WandbConfig:
    """Weights & Biases logging, only when project is given (needs dlm[wandb])."""

    project: str | None = opt(None, "W&B project: logging is on when given")
    entity: str | None = opt(None, "W&B team or user")
    run_name: str | None = opt(None, "W&B run name")
    dir: str | None = opt(None, "W&B local folder")


@dataclass
class TrainingConfig:
    """Everything ``dlm train`` needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mdm: MDMConfig = field(default_factory=MDMConfig)
    block: BlockConfig = field(default_factory=BlockConfig)
    idlm: IDLMConfig = field(default_factory=IDLMConfig)
    renoise: RenoiseConfig = field(default_factory=RenoiseConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    # -- derived -------------------------------------------------------------------------------------------
    @property
    def output_dir(self) -> Path:
        return Path(self.train.output_dir)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.train.checkpoint_dir) if self.train.checkpoint_dir else self.output_dir / "checkpoints"

    @property
    def eval_history_path(self) -> Path:
        p = self.eval.eval_history_path
        return Path(p) if p else self.output_dir / "eval_history.jsonl"

    @property
    def log_path(self) -> Path:
        return Path(self.train.log_path) if self.train.log_path else self.output_dir / "train_log.jsonl"

    def objective_kwargs(self, block_size: int | None) -> dict[str, Any]:
        """Keyword arguments of ``dlm.objectives.get_objective`` for the chosen objective."""
        name = self.model.objective
        kw = dataclasses.asdict(getattr(self, name))
        if name in ("block", "idlm", "renoise"):
            kw["block_size"] = block_size
        if name == "mdm" and self.model.attn_impl == "flash_attention_2":
            kw["attention"] = (
                "full"  # flash kernels cannot take the annealed mask (docs/algorithms.md#annealed-attention)
            )
        return kw

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> TrainingConfig:
        """Check values a user can get wrong; raise DLMError naming the key and the fix."""
        m, d, o, t, e = self.model, self.data, self.optim, self.train, self.eval
        o.fused = str(o.fused).lower()
        for section in SECTIONS:  # the choices each field declares; the objectives' own checks
            obj = getattr(self, section)
            check_choices(obj, section)
            if hasattr(obj, "__post_init__"):
                obj.__post_init__()
        if m.attn_impl == "flash_attention_2" and m.objective != "mdm":
            raise DLMError(
                f"model.attn_impl=flash_attention_2 cannot take the attention masks of objective "
                f"'{m.objective}'; use --attn-impl sdpa"
            )
        if m.objective == "mdm" and m.block_size is not None:
            raise DLMError(
                "model.block_size (--block-size) is meaningless for objective 'mdm'; drop it or use "
                "--objective block/idlm"
            )
        if not 0 < o.decay_ratio <= 1:
            raise DLMError(
                f"optim.decay_ratio must be in (0, 1], got {o.decay_ratio} (the share of the run over "
                f"which --optim.schedule wsd decays)"
            )
        for key, value in (
            ("train.batch_size", t.batch_size),
            ("train.gradient_accumulate_every", t.gradient_accumulate_every),
            ("train.max_train_steps", t.max_train_steps),
            ("data.seq_length", d.seq_length),
            ("train.log_every", t.log_every),
            ("eval.eval_batch_size", e.eval_batch_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise DLMError(f"{key} must be a positive integer, got {value!r}")
        for key, value in (
            ("train.save_every", t.save_every),
            ("eval.eval_every", e.eval_every),
            ("train.keep_last", t.keep_last),
            ("lora.r", self.lora.r),
        ):
            if value < 0:
                raise DLMError(f"{key} must be >= 0, got {value}")
        if not o.learning_rate > 0:
            raise DLMError(f"optim.learning_rate (--learning-rate) must be > 0, got {o.learning_rate}")
        if not 0 <= o.warmup_ratio < 1:
            raise DLMError(f"optim.warmup_ratio must be in [0, 1), got {o.warmup_ratio}")
        if t.max_minutes is not None and not t.max_minutes > 0:
            raise DLMError(f"train.max_minutes (--max-minutes) must be > 0, got {t.max_minutes}")
        if (d.packed_data_dir is None) == (d.data is None):
            raise DLMError(
                "give exactly one data source: --packed-data-dir DIR (packed shards) or --data FILE.jsonl "
                "(chat/instruction records)"
            )
        if d.packed_weights is not None and len(d.packed_weights) != len(d.packed_prefixes):
            raise DLMError(
                f"--packed-weights has {len(d.packed_weights)} values but --packed-prefixes has "
                f"{len(d.packed_prefixes)}; give one weight per prefix"
            )
        if not 0 <= d.eval_fraction < 1:
            raise DLMError(f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
        if self.lora.gated and self.lora.r == 0:
            raise DLMError("--gated-lora needs adapters: give --lora-r R (e.g. 16)")
        return self


SECTIONS: dict[str, type] = {f.name: f.default_factory().__class__ for f in dataclasses.fields(TrainingConfig)}

# The one spelling of a field is ``section.key`` (a YAML section, or ``--section.key`` on the command line). Besides
# it, only these aliases, each mapped here once: the original trainers' names, so their configs and command lines
# keep working (miniDiffuLLaMA's train.py flags with '_' for '-'; the I-DLM recipe's LLaMA-Factory YAML keys), and
# a few command-line shortcuts of dlm's own for the commonest fields (flags and Python overrides only: a YAML file
# uses sections or the original names).
MINIDIFFULLAMA, IDLM_YAML, SHORTCUT = "miniDiffuLLaMA flag", "I-DLM / LLaMA-Factory YAML key", "dlm shortcut"
ALIASES: dict[str, tuple[str, str]] = {
    "model": ("model.name", MINIDIFFULLAMA),
    "packed_data_dir": ("data.packed_data_dir", MINIDIFFULLAMA),
    "packed_prefixes": ("data.packed_prefixes", MINIDIFFULLAMA),
    "packed_weights": ("data.packed_weights", MINIDIFFULLAMA),
    "seq_length": ("data.seq_length", MINIDIFFULLAMA),
    "batch_size": ("train.batch_size", MINIDIFFULLAMA),
    "gradient_accumulate_every": ("train.gradient_accumulate_every", MINIDIFFULLAMA),
    "max_train_steps": ("train.max_train_steps", MINIDIFFULLAMA),
    "learning_rate": ("optim.learning_rate", MINIDIFFULLAMA),
    "output_dir": ("train.output_dir", MINIDIFFULLAMA),
    "checkpoint_dir": ("train.checkpoint_dir", MINIDIFFULLAMA),
    "save_every": ("train.save_every", MINIDIFFULLAMA),
    "eval_every": ("eval.eval_every", MINIDIFFULLAMA),
    "eval_tasks": ("eval.eval_tasks", MINIDIFFULLAMA),
    "eval_history_path": ("eval.eval_history_path", MINIDIFFULLAMA),
    "attn_impl": ("model.attn_impl", MINIDIFFULLAMA),
    "wandb_project": ("wandb.project", MINIDIFFULLAMA),
    "wandb_entity": ("wandb.entity", MINIDIFFULLAMA),
    "wandb_run_name": ("wandb.run_name", MINIDIFFULLAMA),
    "wandb_dir": ("wandb.dir", MINIDIFFULLAMA),
    "model_name_or_path": ("model.name", IDLM_YAML),
    "block_size": ("model.block_size", IDLM_YAML),
    "block_length": ("data.idlm_block_size", IDLM_YAML),
    "ce_alpha": ("idlm.ce_alpha", IDLM_YAML),
    "idlm_loss_type": ("idlm.idlm_loss_type", IDLM_YAML),
    "loss_auto_balance": ("idlm.loss_auto_balance", IDLM_YAML),
    "cutoff_len": ("data.seq_length", IDLM_YAML),
    "per_device_train_batch_size": ("train.batch_size", IDLM_YAML),
    "gradient_accumulation_steps": ("train.gradient_accumulate_every", IDLM_YAML),
    "lr_scheduler_type": ("optim.schedule", IDLM_YAML),
    "warmup_ratio": ("optim.warmup_ratio", IDLM_YAML),
    "max_steps": ("train.max_train_steps", IDLM_YAML),
    "max_grad_norm": ("optim.max_grad_norm", IDLM_YAML),
    "weight_decay": ("optim.weight_decay", IDLM_YAML),
    "bf16": ("train.mixed_precision", IDLM_YAML),  # true -> bf16, false -> no
    "gradient_checkpointing": ("model.gradient_checkpointing", IDLM_YAML),
    "seed": ("train.seed", IDLM_YAML),
    "objective": ("model.objective", SHORTCUT),
    "data": ("data.data", SHORTCUT),
    "eval_data": ("data.eval_data", SHORTCUT),
    "eval_data_dir": ("eval.eval_data_dir", SHORTCUT),
    "lora_r": ("lora.r", SHORTCUT),
    "lora_alpha": ("lora.alpha", SHORTCUT),
    "gated_lora": ("lora.gated", SHORTCUT),
    "max_minutes": ("train.max_minutes", SHORTCUT),
    "resume": ("train.resume", SHORTCUT),
    "overwrite": ("train.overwrite", SHORTCUT),
    "keep_last": ("train.keep_last", SHORTCUT),
    "mixed_precision": ("train.mixed_precision", SHORTCUT),
}
FLAT_KEYS: dict[str, str] = {alias: dotted for alias, (dotted, _) in ALIASES.items()}
# Fields set from another one (the objectives' block size is the model's): not keys of their own.
DERIVED = {
    "block.block_size": "model.block_size",
    "idlm.block_size": "model.block_size",
    "renoise.block_size": "model.block_size",
}
# renamed keys: old section.key -> new (accepted with a warning naming the new key, for one release)
RENAMED = {"data.block_length": "data.idlm_block_size"}


def section_keys() -> list[str]:
    """Every ``section.key`` of the configuration (the one spelling of each field)."""
    return [
        k for k in (f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)) if k not in DERIVED
    ]


def field_help(dotted: str) -> str:
    """The ``--help`` text of a field: what it means, its choices or unit, its type and default."""
    section, key = dotted.split(".", 1)
    cls = SECTIONS[section]
    f = {f.name: f for f in dataclasses.fields(cls)}[key]
    return f"{describe(f)} [{_type_name(typing.get_type_hints(cls)[key])}]".replace("%", "%%")


def is_list_field(dotted: str) -> bool:
    section, key = dotted.split(".", 1)
    tp = typing.get_type_hints(SECTIONS[section])[key]
    return typing.get_origin(tp) is list or any(typing.get_origin(a) is list for a in typing.get_args(tp))


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(dotted: str, value, tp):
    """Coerce a YAML/CLI value to the declared field type (no eval); DLMError naming the key otherwise."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(dotted, value, inner[0])
    if origin is list:
        (item,) = args
        if isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(dotted, v, item) for v in value]
    if isinstance(value, str) and tp is not str:
        import yaml

        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            pass
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
                return value.lower() in ("true", "yes", "1", "on")
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            raise ValueError
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            if isinstance(value, bool):  # fused: true in YAML -> "true"
                return str(value).lower()
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        raise DLMError(f"{dotted}: unsupported type {tp}")  # pragma: no cover - a bug in this file
    raise DLMError(f"{dotted} = {value!r} is not a valid {_type_name(tp)}")


def resolve_key(key: str, where: str = "", in_file: bool = False) -> str:
    """The ``section.key`` for a dotted key or an alias (:data:`ALIASES`; in a file, ``in_file``, not the
    command-line shortcuts); DLMError naming the closest valid keys otherwise."""
    k = key.replace("-", "_") if "." not in key else key
    if "." in k:
        section, name = k.split(".", 1)
        name = name.replace("-", "_")
        if f"{section}.{name}" in RENAMED:
            new = RENAMED[f"{section}.{name}"]
            warnings.warn(
                f"'{section}.{name}'{where} is renamed '{new}' (the old key will be removed in the next release)",
                FutureWarning,
                stacklevel=3,
            )
            section, name = new.split(".", 1)
        if section not in SECTIONS:
            raise DLMError(
                f"unknown configuration section '{section}'{where}; did you mean: {closest(section, SECTIONS)}"
            )
        names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        if name not in names:
            near = ", ".join(f"{section}.{n}" for n in closest(name, names).split(", "))
            raise DLMError(f"unknown key '{section}.{name}'{where}; did you mean: {near}")
        if f"{section}.{name}" in DERIVED:
            raise DLMError(f"'{section}.{name}'{where} is set from {DERIVED[f'{section}.{name}']}; set that instead")
        return f"{section}.{name}"
    if k in ALIASES:
        dotted, origin = ALIASES[k]
        if in_file and origin == SHORTCUT:
            section, name = dotted.split(".", 1)
            raise DLMError(
                f"'{k}'{where} is a command-line shortcut; in a file write it as {dotted} "
                f"(a '{section}:' section with '{name}:')"
            )
        return dotted
    raise DLMError(f"unknown key '{key}'{where}; did you mean: {closest(k, list(FLAT_KEYS) + section_keys())}")


def set_value(cfg: TrainingConfig, key: str, value, where: str = "", in_file: bool = False) -> None:
    """Set one (dotted or aliased) key, coercing the value to the field's type."""
    dotted = resolve_key(key, where, in_file)
    section, name = dotted.split(".", 1)
    obj = getattr(cfg, section)
    if key in ("bf16",):  # LLaMA-Factory's boolean precision switch
        value = "bf16" if _coerce(key, value, bool) else "no"
    tp = typing.get_type_hints(type(obj))[name]
    setattr(obj, name, _coerce(dotted, value, tp))


def apply_mapping(cfg: TrainingConfig, mapping: dict, where: str = "", in_file: bool = False) -> TrainingConfig:
    """Apply a YAML-style mapping: sections (``train: {...}``) and/or aliases (a file's, ``in_file``: the original
    trainers' names only)."""
    for key, value in mapping.items():
        key = str(key)
        if key in SECTIONS and isinstance(value, dict):
            for sub, v in value.items():
                set_value(cfg, f"{key}.{sub}", v, where, in_file)
        elif key in SECTIONS and key not in FLAT_KEYS:
            raise DLMError(f"section '{key}'{where} must be a mapping of keys, got {value!r}")
        else:
            set_value(cfg, key, value, where, in_file)
    return cfg


PRESET_DIR = Path(__file__).parent / "configs"  # shipped in the wheel


def presets() -> list[str]:
    """The names of the training presets shipped with dlm (``dlm train --config NAME``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """The file of a shipped preset by name (``idlm_b2_cpu``, or ``accelerate/ddp_cpu`` for accelerate's configs);
    DLMError naming the closest presets otherwise."""
    stem = name[:-5] if name.endswith(".yaml") else name
    path = PRESET_DIR / f"{stem}.yaml"
    if not path.is_file():
        names = presets() + sorted(f"accelerate/{p.stem}" for p in (PRESET_DIR / "accelerate").glob("*.yaml"))
        raise DLMError(
            f"--config '{name}' is neither a file nor a preset: did you mean {closest(stem, names)}? "
            f"(presets: {', '.join(presets())})"
        )
    return path


def resolve_config_path(path: str | Path) -> Path:
    """``--config``: a YAML file's path, else the name of a shipped preset (``idlm_b2_cpu``; a clone's
    ``configs/idlm_b2_cpu.yaml`` resolves to the same file from any directory)."""
    p = Path(path)
    if p.is_file():
        return p
    parts = p.parts[1:] if p.parts[:1] == ("configs",) else p.parts
    if len(parts) == 1 or (len(parts) == 2 and parts[0] == "accelerate"):
        return preset_path("/".join(parts))
    raise DLMError(f"config file '{path}' does not exist; give a YAML file or a preset name ({', '.join(presets())})")


def load_yaml(path: str | Path) -> dict:
    import yaml

    path = resolve_config_path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise DLMError(f"config file '{path}' is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise DLMError(f"config file '{path}' must hold a mapping of keys, got {type(data).__name__}")
    return data


def load_config(
    path: str | Path | None = None, overrides: dict | list[str] | None = None, validate: bool = True
) -> TrainingConfig:
    """Defaults, then the YAML file at ``path``, then ``overrides`` (a mapping or ``["section.key=value"]``)."""
    cfg = TrainingConfig()
    if path is not None:
        apply_mapping(cfg, load_yaml(path), where=f" in '{path}'", in_file=True)
    if overrides:
        if isinstance(overrides, dict):
            apply_mapping(cfg, overrides, where=" on the command line")
        else:
            for item in overrides:
                if "=" not in item:
                    raise DLMError(f"override '{item}' must look like section.key=value")
                k, v = item.split("=", 1)
                set_value(cfg, k.lstrip("-"), v, " on the command line")
    return cfg.validate() if validate else cfg


def save_yaml(cfg: TrainingConfig, path: str | Path) -> None:
    import yaml

    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def alias_table() -> str:
    """The Markdown table of :data:`ALIASES` that docs/training.md holds (kept in sync by a test)."""
    rows = {}
    for alias, (dotted, origin) in ALIASES.items():
        rows.setdefault(origin, []).append(f"`{alias}` = `{dotted}`")
    lines = ["| origin | aliases (flag: `--` and `-` for `_`) |", "|---|---|"]
    for origin in (MINIDIFFULLAMA, IDLM_YAML, SHORTCUT):
        items = rows[origin]
        for i in range(0, len(items), 4):
            lines.append(f"| {origin if i == 0 else ''} | {', '.join(items[i : i + 4])} |")
    return "\n".join(lines)
