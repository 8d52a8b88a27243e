"""Typed configuration of ``dlm train``: dataclasses, YAML presets and command-line overrides.

A configuration is a :class:`TrainingConfig` made of sections (``model``, ``data``, ``mdm``, ``block``, ``idlm``,
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
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlm.errors import DLMError, closest

OBJECTIVES = ("mdm", "block", "idlm")


@dataclass
class ModelConfig:
    """The model to train."""

    name: str = "smollm2-135m"  # alias, AR folder (converted on load) or DLM folder (trained further)
    objective: str = "idlm"  # mdm | block | idlm
    block_size: int | None = None  # masks per block (block/idlm); default from the model or the objective
    attn_impl: str = "sdpa"  # sdpa | eager | flash_attention_2 (flash: mdm only, full attention from step 0)
    mask_token: str | None = None  # name of the mask token to add when converting an AR model
    gradient_checkpointing: bool = False


@dataclass
class DataConfig:
    """Training data: packed LITPKDS shards or chat/instruction JSONL."""

    packed_data_dir: str | None = None
    packed_prefixes: list[str] = field(default_factory=lambda: ["train"])
    packed_weights: list[float] | None = None
    eval_packed_prefixes: list[str] | None = None  # held-out shards for the scheduled held-out loss
    data: str | None = None  # chat/instruction JSONL (messages | conversations | prompt/response)
    eval_data: str | None = None  # held-out JSONL; default: a seeded eval_fraction of `data`
    eval_fraction: float = 0.05  # of `data` held out (always, for consistent resumes) when eval_data is not given
    seq_length: int = 256  # tokens per training row (cutoff_len for chat data)
    block_length: int | None = None  # I-DLM data block length; must equal the model's block size when given
    seed: int = 42


@dataclass
class MDMConfig:
    """Masked diffusion (DiffuLLaMA / MDLM); mirrors dlm.objectives.MDMConfig."""

    eps: float = 1e-3
    antithetic: bool = False  # stratified t across the batch
    normalize: str = "masked"  # masked (DiffuLLaMA: / masked tokens) | all (MDLM: / tokens)
    shift: bool | None = None  # None: the checkpoint's
    attention: str = "annealed"  # annealed | full
    anneal_steps: int = 1000


@dataclass
class BlockConfig:
    """Block diffusion (BD3-LM / SDAR); mirrors dlm.objectives.BlockConfig."""

    t_per: str = "sample"  # sample (SDAR) | block (BD3-LM)
    eps: float = 1e-3
    antithetic: bool = False
    normalize: str = "masked"  # masked | all
    shift: bool | None = None


@dataclass
class IDLMConfig:
    """Introspective diffusion (I-DLM); mirrors dlm.objectives.IDLMConfig."""

    ce_alpha: float = 0.2
    loss_auto_balance: bool = False
    idlm_loss_type: str = "ar"  # ar (hard labels) | distill (the clean pass's soft distribution)
    distill_temperature: float = 1.0
    fast_path: bool | None = None  # None/True: split clean + noisy passes (faster); False: one 2L forward


@dataclass
class OptimConfig:
    """AdamW with a warm-up then a cosine, constant or warm-up-stable-decay (wsd) schedule.

    The decaying schedules follow the run's progress: the larger of the optimizer steps done over
    ``train.max_train_steps`` and, when ``train.max_minutes`` is set, the time spent over that budget, so a run
    bounded by time (a huge step limit) still decays and ends at the floor when its minutes run out."""

    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    schedule: str = "cosine"  # cosine | constant | wsd (constant, then linear to the floor over decay_ratio)
    warmup_ratio: float = 0.0  # fraction of max_train_steps
    warmup_steps: int | None = None  # overrides warmup_ratio
    min_lr_ratio: float = 0.0  # cosine / wsd floor, as a fraction of learning_rate
    decay_ratio: float = 0.2  # wsd: the last fraction of the run that decays to the floor
    max_grad_norm: float = 1.0  # 0 disables clipping
    fused: str = "auto"  # auto | true | false


@dataclass
class TrainConfig:
    """The run: batch, steps, precision, outputs, checkpoints, resume."""

    batch_size: int = 4  # per device
    gradient_accumulate_every: int = 1
    max_train_steps: int = 100  # optimizer steps
    max_minutes: float | None = None  # wall-clock budget: stop cleanly and save when exceeded
    mixed_precision: str = "auto"  # auto (bf16 where fast) | no | bf16 | fp16; weights stay fp32
    seed: int = 42
    output_dir: str = "runs/dlm"
    checkpoint_dir: str | None = None  # default output_dir/checkpoints
    save_every: int = 0  # optimizer steps; 0 = only the final model
    keep_last: int = 0  # keep this many checkpoints (0 = all)
    resume: str | None = None  # auto | PATH of a checkpoint
    overwrite: bool = False
    log_every: int = 1
    log_path: str | None = None  # default output_dir/train_log.jsonl
    progress: bool = True
    accelerate_config: str | None = None  # launcher file the preset is meant for (accelerate launch --config_file)


@dataclass
class EvalConfig:
    """Scheduled evaluation during training."""

    eval_every: int = 0  # optimizer steps; 0 disables
    eval_tasks: list[str] = field(default_factory=list)  # task evaluations (dlm.eval) besides held-out loss
    eval_history_path: str | None = None  # default output_dir/eval_history.jsonl
    eval_batches: int = 4  # held-out batches for the held-out loss
    eval_limit: int = 50  # examples per task evaluation
    eval_batch_size: int = 8  # generation batch of the task evaluations (lambada, poem_reverse, isd_acceptance)
    eval_data_dir: str | None = None  # folder with <task>/ files for the task evaluations


@dataclass
class LoraConfig:
    """LoRA (peft); r = 0 trains all weights."""

    r: int = 0
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] | None = None  # default all-linear
    gated: bool = False  # adapters only at mask positions (I-DLM lossless mode)


@dataclass
class WandbConfig:
    """Weights & Biases logging, only when project is given."""

    project: str | None = None
    entity: str | None = None
    run_name: str | None = None
    dir: str | None = None


@dataclass
class TrainingConfig:
    """Everything ``dlm train`` needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mdm: MDMConfig = field(default_factory=MDMConfig)
    block: BlockConfig = field(default_factory=BlockConfig)
    idlm: IDLMConfig = field(default_factory=IDLMConfig)
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
        if name in ("block", "idlm"):
            kw["block_size"] = block_size
        if name == "mdm" and self.model.attn_impl == "flash_attention_2":
            kw["attention"] = "full"  # flash kernels cannot take the annealed mask (docs/algorithms.md#annealed-attention)
        return kw

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> "TrainingConfig":
        """Check values a user can get wrong; raise DLMError naming the key and the fix."""
        m, d, o, t, e = self.model, self.data, self.optim, self.train, self.eval
        _choice("model.objective", m.objective, OBJECTIVES)
        _choice("model.attn_impl", m.attn_impl, ("sdpa", "eager", "flash_attention_2", "flex_attention"))
        if m.attn_impl == "flash_attention_2" and m.objective != "mdm":
            raise DLMError(f"model.attn_impl=flash_attention_2 cannot take the attention masks of objective "
                           f"'{m.objective}'; use --attn-impl sdpa")
        if m.objective == "mdm" and m.block_size is not None:
            raise DLMError("model.block_size (--block-size) is meaningless for objective 'mdm'; drop it or use "
                           "--objective block/idlm")
        _choice("mdm.normalize", self.mdm.normalize, ("masked", "all"))
        _choice("block.normalize", self.block.normalize, ("masked", "all"))
        _choice("mdm.attention", self.mdm.attention, ("annealed", "full"))
        _choice("block.t_per", self.block.t_per, ("sample", "block"))
        _choice("idlm.idlm_loss_type", self.idlm.idlm_loss_type, ("ar", "distill"))
        _choice("optim.schedule", o.schedule, ("cosine", "constant", "wsd"))
        if not 0 < o.decay_ratio <= 1:
            raise DLMError(f"optim.decay_ratio must be in (0, 1], got {o.decay_ratio} (the share of the run over "
                           f"which --optim.schedule wsd decays)")
        _choice("optim.fused", str(o.fused).lower(), ("auto", "true", "false"))
        _choice("train.mixed_precision", t.mixed_precision, ("auto", "no", "bf16", "fp16"))
        for key, value in (("train.batch_size", t.batch_size), ("train.gradient_accumulate_every",
                           t.gradient_accumulate_every), ("train.max_train_steps", t.max_train_steps),
                           ("data.seq_length", d.seq_length), ("train.log_every", t.log_every),
                           ("eval.eval_batch_size", e.eval_batch_size)):
            if not isinstance(value, int) or value < 1:
                raise DLMError(f"{key} must be a positive integer, got {value!r}")
        for key, value in (("train.save_every", t.save_every), ("eval.eval_every", e.eval_every),
                           ("train.keep_last", t.keep_last), ("lora.r", self.lora.r)):
            if value < 0:
                raise DLMError(f"{key} must be >= 0, got {value}")
        if not o.learning_rate > 0:
            raise DLMError(f"optim.learning_rate (--learning-rate) must be > 0, got {o.learning_rate}")
        if not 0 <= o.warmup_ratio < 1:
            raise DLMError(f"optim.warmup_ratio must be in [0, 1), got {o.warmup_ratio}")
        if t.max_minutes is not None and not t.max_minutes > 0:
            raise DLMError(f"train.max_minutes (--max-minutes) must be > 0, got {t.max_minutes}")
        if (d.packed_data_dir is None) == (d.data is None):
            raise DLMError("give exactly one data source: --packed-data-dir DIR (packed shards) or --data FILE.jsonl "
                           "(chat/instruction records)")
        if d.packed_weights is not None and len(d.packed_weights) != len(d.packed_prefixes):
            raise DLMError(f"--packed-weights has {len(d.packed_weights)} values but --packed-prefixes has "
                           f"{len(d.packed_prefixes)}; give one weight per prefix")
        if not 0 <= d.eval_fraction < 1:
            raise DLMError(f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
        if self.lora.gated and self.lora.r == 0:
            raise DLMError("--gated-lora needs adapters: give --lora-r R (e.g. 16)")
        return self


def _choice(key: str, value, valid) -> None:
    if value not in valid:
        raise DLMError(f"{key} = {value!r} is not valid; use one of: {', '.join(map(str, valid))}")


SECTIONS: dict[str, type] = {f.name: f.default_factory().__class__ for f in dataclasses.fields(TrainingConfig)}

# Flat keys of the original trainers (miniDiffuLLaMA flags with '_' for '-', LLaMA-Factory / I-DLM YAML keys)
# and the section.key each one sets.
FLAT_KEYS: dict[str, str] = {
    # miniDiffuLLaMA train.py flags
    "model": "model.name",
    "packed_data_dir": "data.packed_data_dir",
    "packed_prefixes": "data.packed_prefixes",
    "packed_weights": "data.packed_weights",
    "seq_length": "data.seq_length",
    "batch_size": "train.batch_size",
    "gradient_accumulate_every": "train.gradient_accumulate_every",
    "max_train_steps": "train.max_train_steps",
    "learning_rate": "optim.learning_rate",
    "output_dir": "train.output_dir",
    "checkpoint_dir": "train.checkpoint_dir",
    "save_every": "train.save_every",
    "eval_every": "eval.eval_every",
    "eval_tasks": "eval.eval_tasks",
    "eval_history_path": "eval.eval_history_path",
    "eval_data_dir": "eval.eval_data_dir",
    "attn_impl": "model.attn_impl",
    "wandb_project": "wandb.project",
    "wandb_entity": "wandb.entity",
    "wandb_run_name": "wandb.run_name",
    "wandb_dir": "wandb.dir",
    # dlm additions
    "objective": "model.objective",
    "block_size": "model.block_size",
    "data": "data.data",
    "eval_data": "data.eval_data",
    "lora_r": "lora.r",
    "lora_alpha": "lora.alpha",
    "gated_lora": "lora.gated",
    "max_minutes": "train.max_minutes",
    "resume": "train.resume",
    "overwrite": "train.overwrite",
    "keep_last": "train.keep_last",
    "seed": "train.seed",
    "mixed_precision": "train.mixed_precision",
    "gradient_checkpointing": "model.gradient_checkpointing",
    # LLaMA-Factory / I-DLM YAML keys
    "model_name_or_path": "model.name",
    "block_length": "data.block_length",
    "ce_alpha": "idlm.ce_alpha",
    "idlm_loss_type": "idlm.idlm_loss_type",
    "loss_auto_balance": "idlm.loss_auto_balance",
    "cutoff_len": "data.seq_length",
    "per_device_train_batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulate_every",
    "lr_scheduler_type": "optim.schedule",
    "warmup_ratio": "optim.warmup_ratio",
    "max_steps": "train.max_train_steps",
    "max_grad_norm": "optim.max_grad_norm",
    "weight_decay": "optim.weight_decay",
    "bf16": "train.mixed_precision",  # true -> bf16, false -> no
}


def section_keys() -> list[str]:
    """Every ``section.key`` of the configuration."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def field_help(dotted: str) -> str:
    section, key = dotted.split(".", 1)
    cls = SECTIONS[section]
    f = {f.name: f for f in dataclasses.fields(cls)}[key]
    hints = typing.get_type_hints(cls)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return f"{_type_name(hints[key])}, default {default!r}"


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


def resolve_key(key: str, where: str = "") -> str:
    """The ``section.key`` for a dotted or flat key; DLMError naming the closest valid keys otherwise."""
    k = key.replace("-", "_") if "." not in key else key
    if "." in k:
        section, name = k.split(".", 1)
        name = name.replace("-", "_")
        if section not in SECTIONS:
            raise DLMError(f"unknown configuration section '{section}'{where}; did you mean: "
                           f"{closest(section, SECTIONS)}")
        names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        if name not in names:
            near = ", ".join(f"{section}.{n}" for n in closest(name, names).split(", "))
            raise DLMError(f"unknown key '{section}.{name}'{where}; did you mean: {near}")
        return f"{section}.{name}"
    if k in FLAT_KEYS:
        return FLAT_KEYS[k]
    raise DLMError(f"unknown key '{key}'{where}; did you mean: "
                   f"{closest(k, list(FLAT_KEYS) + section_keys())}")


def set_value(cfg: TrainingConfig, key: str, value, where: str = "") -> None:
    """Set one (dotted or flat) key, coercing the value to the field's type."""
    dotted = resolve_key(key, where)
    section, name = dotted.split(".", 1)
    obj = getattr(cfg, section)
    if key in ("bf16",):  # LLaMA-Factory's boolean precision switch
        value = "bf16" if _coerce(key, value, bool) else "no"
    tp = typing.get_type_hints(type(obj))[name]
    setattr(obj, name, _coerce(dotted, value, tp))


def apply_mapping(cfg: TrainingConfig, mapping: dict, where: str = "") -> TrainingConfig:
    """Apply a YAML-style mapping: sections (``train: {...}``) and/or flat keys."""
    for key, value in mapping.items():
        key = str(key)
        if key in SECTIONS and isinstance(value, dict):
            for sub, v in value.items():
                set_value(cfg, f"{key}.{sub}", v, where)
        elif key in SECTIONS and key not in FLAT_KEYS:
            raise DLMError(f"section '{key}'{where} must be a mapping of keys, got {value!r}")
        else:
            set_value(cfg, key, value, where)
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
        raise DLMError(f"--config '{name}' is neither a file nor a preset: did you mean {closest(stem, names)}? "
                       f"(presets: {', '.join(presets())})")
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
    raise DLMError(f"config file '{path}' does not exist; give a YAML file or a preset name "
                   f"({', '.join(presets())})")


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


def load_config(path: str | Path | None = None, overrides: dict | list[str] | None = None,
                validate: bool = True) -> TrainingConfig:
    """Defaults, then the YAML file at ``path``, then ``overrides`` (a mapping or ``["section.key=value"]``)."""
    cfg = TrainingConfig()
    if path is not None:
        apply_mapping(cfg, load_yaml(path), where=f" in '{path}'")
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
