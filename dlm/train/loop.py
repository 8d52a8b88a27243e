"""One training loop for every objective, on accelerate (single process, DDP, FSDP, DeepSpeed).

``train(cfg)`` does, in order:

1. refuse to overwrite an existing run (unless ``train.resume`` / ``train.overwrite``);
2. load the model (a DLM folder, or an AR model converted on the fly) in fp32 - the master weights and the AdamW
   state stay fp32 while bf16 autocast runs the matmuls, so a learning-rate-1e-5 update is not rounded away as
   with bf16 weights; apply LoRA / gated LoRA and gradient checkpointing;
3. build the data (packed shards or chat JSONL), check it against the model (block size, context, vocabulary)
   before any step;
4. AdamW (fused where available) with warm-up then cosine/constant decay, gradient accumulation and clipping;
5. every step: log a JSONL line (loss, parts, lr, grad norm, tokens/s), update the progress bar and W&B;
   every ``save_every`` steps an atomic checkpoint, every ``eval_every`` steps the held-out loss (+ task
   evaluations) appended to ``eval_history.jsonl``; stop cleanly at ``max_train_steps`` or when the
   ``max_minutes`` budget is spent; a non-finite loss stops before the weights are touched;
6. write the final model + tokenizer into ``output_dir``.

Each rank reads its own data in-process (see :mod:`dlm.train.data`); the model is the only thing handed to
``accelerator.prepare`` besides the optimizer. The scheduler steps once per optimizer step whatever the number of
processes (accelerate's prepared scheduler would step ``num_processes`` times).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlm.config import TrainingConfig
from dlm.errors import DLMError
from dlm.model.convert import DiffusionLM
from dlm.train import checkpoint as ckpt_mod

RUN_FILES = ("run_config.yaml", "train_log.jsonl")
EVAL_STEP = 2**31 - 1


@dataclass
class TrainResult:
    output_dir: Path
    step: int
    stopped: str  # "max_train_steps" | "max_minutes"
    losses: list[float] = field(default_factory=list)  # per optimizer step of this process's run (mean over ranks)
    tokens: int = 0
    seconds: float = 0.0
    last_checkpoint: Path | None = None


class RoutedDLM(DiffusionLM):
    """The DiffusionLM handed to objectives: attributes of the real model, forward through the distributed
    wrapper (DDP/FSDP/DeepSpeed need their own forward for gradient synchronisation and autocast)."""

    def __init__(self, dlm: DiffusionLM, wrapped: nn.Module):
        nn.Module.__init__(self)
        self.__dict__["_dlm"] = dlm
        self.__dict__["_wrapped"] = wrapped

    def __getattr__(self, name):
        return getattr(self.__dict__["_dlm"], name)

    def forward(self, *args, **kwargs):
        return self.__dict__["_wrapped"](*args, **kwargs)

    def train(self, mode: bool = True):
        self.__dict__["_wrapped"].train(mode)
        self.training = mode
        return self

    def parameters(self, recurse: bool = True):
        return self.__dict__["_dlm"].parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.__dict__["_dlm"].named_parameters(*args, **kwargs)

    @property
    def device(self):
        return self.__dict__["_dlm"].device

    @property
    def dtype(self):
        return self.__dict__["_dlm"].dtype


# ----------------------------------------------------------------------------------------------- pieces
def lr_factor(step: int, max_steps: int, warmup: int, schedule: str, min_ratio: float,
              time_fraction: float | None = None, decay_ratio: float = 0.2) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based): linear warm-up over ``warmup``
    steps, then constant, cosine down to ``min_ratio``, or ``wsd``: constant, then linear down to ``min_ratio`` over
    the last ``decay_ratio`` of the run. The run's progress is the larger of the steps after warm-up over
    ``max_steps - warmup`` and ``time_fraction`` (time spent over a ``max_minutes`` budget, when there is one)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, max_steps - warmup)
    progress = (step - warmup) / span
    if time_fraction is not None:
        progress = max(progress, time_fraction)
    progress = min(1.0, progress)
    if schedule == "wsd":
        start = 1.0 - decay_ratio
        if progress <= start:
            return 1.0
        return min_ratio + (1 - min_ratio) * (1.0 - (progress - start) / decay_ratio)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_steps(cfg: TrainingConfig) -> int:
    o = cfg.optim
    if o.warmup_steps is not None:
        return int(o.warmup_steps)
    return int(math.ceil(o.warmup_ratio * cfg.train.max_train_steps))


def build_optimizer(params: list[nn.Parameter], cfg: TrainingConfig, device: torch.device):
    """AdamW; weight decay on matrices only; fused kernels where this torch has them for the device."""
    o = cfg.optim
    decay = [p for p in params if p.ndim >= 2]
    other = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": other, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    fused = str(o.fused).lower()
    use_fused = fused == "true" or (fused == "auto" and device.type in ("cuda", "cpu")
                                    and all(p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                                            for p in params))
    kw = dict(lr=o.learning_rate, betas=(o.beta1, o.beta2), eps=o.adam_eps)
    if use_fused:
        try:
            return torch.optim.AdamW(groups, fused=True, **kw)
        except (RuntimeError, TypeError) as e:
            if fused == "true":
                raise DLMError(f"optim.fused=true but fused AdamW is not available here ({e}); use auto") from e
    return torch.optim.AdamW(groups, **kw)


def check_output_dir(cfg: TrainingConfig, resuming: bool) -> None:
    """Never overwrite a run without --resume or --overwrite."""
    out = cfg.output_dir
    if not out.exists():
        return
    if not out.is_dir():
        raise DLMError(f"output_dir '{out}' exists and is not a folder; choose another --output-dir")
    holds_run = any((out / f).exists() for f in RUN_FILES) or bool(ckpt_mod.list_checkpoints(cfg.checkpoint_dir)) \
        or (out / "config.json").exists()
    if not holds_run and not any(out.iterdir()):
        return
    if resuming:
        return
    if not cfg.train.overwrite:
        what = "a training run" if holds_run else "files"
        raise DLMError(f"output_dir '{out}' already holds {what}; pass --resume auto to continue it, --overwrite "
                       f"to start over there, or choose another --output-dir")


def clear_run(cfg: TrainingConfig) -> None:
    """--overwrite: remove what a previous run wrote (checkpoints, logs); the final model files get replaced."""
    out = cfg.output_dir
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    cfg.eval_history_path.unlink(missing_ok=True)
    if cfg.checkpoint_dir.is_dir():
        shutil.rmtree(cfg.checkpoint_dir)


def load_training_model(cfg: TrainingConfig) -> DiffusionLM:
    """The DiffusionLM to train, fp32, with the requested objective/block size (checked against a DLM folder)."""
    from dlm.model.convert import load_any

    m = cfg.model
    convert_kw: dict[str, Any] = {}
    if m.block_size is not None:
        convert_kw["block_size"] = m.block_size
    if m.mask_token is not None:
        convert_kw["mask_token"] = m.mask_token
    dlm = load_any(m.name, objective=m.objective, dtype=torch.float32, **convert_kw)
    if m.block_size is not None and dlm.block_size != m.block_size:
        raise DLMError(f"model '{m.name}' is an {dlm.objective} DLM with block size {dlm.block_size}, but "
                       f"--block-size {m.block_size} was asked; drop --block-size or start from the AR model")
    if m.attn_impl == "flex_attention":
        from dlm.device import get_device

        if get_device().type == "cpu":
            raise DLMError("--attn-impl flex_attention cannot train on CPU (torch's flex attention has no CPU "
                           "backward); use --attn-impl sdpa here, flex_attention on CUDA")
    if m.attn_impl != "sdpa":
        try:
            dlm.base_model_hf.set_attn_implementation(m.attn_impl)
        except Exception as e:  # transformers raises ImportError/ValueError depending on the kernel
            raise DLMError(f"--attn-impl {m.attn_impl} is not usable here ({e}); use --attn-impl sdpa") from e
    return dlm


def check_data_against_model(cfg: TrainingConfig, dlm: DiffusionLM) -> None:
    """Refuse, before training starts, data whose block size or length does not fit the model."""
    d = cfg.data
    ctx = dlm.max_positions
    if ctx is not None and d.seq_length > ctx:
        raise DLMError(f"data.seq_length (--seq-length / cutoff_len) = {d.seq_length} exceeds the model's context "
                       f"of {ctx} positions; use --seq-length {ctx} or less")
    if d.block_length is not None:
        if dlm.block_size is None:
            raise DLMError(f"block_length = {d.block_length} is set but objective '{dlm.objective}' has no blocks; "
                           f"drop block_length")
        if d.block_length != dlm.block_size:
            raise DLMError(f"data block_length = {d.block_length} does not match the model's block size "
                           f"{dlm.block_size} (config.json block_size); set block_length: {dlm.block_size} or train "
                           f"a model converted with --block-size {d.block_length}")
    if dlm.objective == "block" and d.packed_data_dir and d.seq_length % dlm.block_size:
        raise DLMError(f"--seq-length {d.seq_length} is not a multiple of the block size {dlm.block_size}; block "
                       f"diffusion needs whole blocks")


def check_token_ids(batch: dict, dlm: DiffusionLM, source: str) -> None:
    vocab = dlm.base_model_hf.get_input_embeddings().weight.shape[0]
    top = int(batch["input_ids"].max())
    if top >= vocab:
        raise DLMError(f"{source} holds token id {top} but the model's vocabulary has {vocab} entries: the data was "
                       f"tokenized with another tokenizer; re-run dlm prepare with --tokenizer {cfg_name(dlm)}")


def cfg_name(dlm) -> str:
    return getattr(dlm.hf_config, "name_or_path", "") or "<the model>"


def build_data(cfg: TrainingConfig, dlm: DiffusionLM, rank: int, world: int):
    """(train batches, held-out batches of this rank)."""
    from dlm.train.data import PackedBatches, SFTBatches, heldout_batches, split_heldout

    d, t = cfg.data, cfg.train
    eval_on = cfg.eval.eval_every > 0
    if d.packed_data_dir:
        from dlm.data.loader import build_packed_dataset

        ds = build_packed_dataset(d.packed_data_dir, d.packed_prefixes, d.packed_weights, block_size=d.seq_length,
                                  seed=d.seed, rank=rank, world_size=world)
        train = PackedBatches(ds, t.batch_size)
        held: list[dict] = []
        if eval_on and d.eval_packed_prefixes:
            eds = build_packed_dataset(d.packed_data_dir, d.eval_packed_prefixes, None, block_size=d.seq_length,
                                       seed=d.seed, rank=rank, world_size=world, shuffle=False)
            it = PackedBatches(eds, t.batch_size)
            held = [next(it) for _ in range(cfg.eval.eval_batches)]
        return train, held
    from dlm.data.sft import SFTCollator, load_sft_examples, pad_token_id, read_jsonl

    records = read_jsonl(d.data)
    held_records: list = []
    if d.eval_data:
        held_records = read_jsonl(d.eval_data)
    else:  # held out whether or not this run evaluates, so that runs/resumes with other eval settings agree
        records, held_records = split_heldout(records, d.eval_fraction, d.seed)
    tok = dlm.tokenizer
    examples = load_sft_examples(d.data, tok, d.seq_length, records=records)
    multiple = dlm.block_size if dlm.objective in ("block", "idlm") else None
    collator = SFTCollator(pad_token_id(tok), pad_to_multiple_of=multiple, max_length=None)
    train = SFTBatches(examples, t.batch_size, collator, rank=rank, world_size=world, seed=d.seed)
    held = []
    if held_records and eval_on:
        held_ex = load_sft_examples(d.eval_data or d.data, tok, d.seq_length, records=held_records)
        held = heldout_batches(held_ex, t.batch_size, collator, cfg.eval.eval_batches, rank, world)
    return train, held


def get_objective_for(cfg: TrainingConfig, dlm: DiffusionLM):
    try:
        from dlm.objectives import get_objective
    except ImportError as e:  # pragma: no cover - the objectives package is part of dlm
        raise DLMError(f"the objectives package is not available ({e})") from e
    return get_objective(cfg.model.objective, **cfg.objective_kwargs(dlm.block_size))


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "index"}


def _fingerprint(ids: torch.Tensor) -> int:
    """A cheap hash of a batch (to show in the log that ranks read different data)."""
    w = torch.arange(1, ids.numel() + 1, device=ids.device, dtype=torch.int64).view_as(ids)
    return int(((ids.to(torch.int64) * w).sum() % 2_147_483_647).item())


class _Log:
    """JSONL training log (main process), progress bar and W&B."""

    def __init__(self, cfg: TrainingConfig, main: bool, start_step: int):
        self.main = main
        self.fh = None
        self.bar = None
        self.deadline = None
        self.wandb = None
        if not main:
            return
        cfg.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(cfg.log_path, "a", buffering=1)
        if cfg.train.progress:
            from tqdm.auto import tqdm

            # With a wall-clock budget the step total is only an upper bound: show the minutes left instead of
            # a step-based ETA that would be meaningless (the quickstart runs "until the budget is spent").
            self.deadline = time.time() + cfg.train.max_minutes * 60 if cfg.train.max_minutes else None
            total = None if self.deadline and cfg.train.max_train_steps >= 100_000 else cfg.train.max_train_steps
            self.bar = tqdm(total=total, initial=start_step, desc="dlm train", unit="step", dynamic_ncols=True)
        if cfg.wandb.project:
            from dlm.errors import require

            wandb = require("wandb", "wandb")
            wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.run_name,
                       dir=cfg.wandb.dir, config=cfg.to_dict(), resume="allow")
            self.wandb = wandb

    def write(self, record: dict) -> None:
        if self.fh is not None:
            self.fh.write(json.dumps(record) + "\n")

    def step(self, record: dict) -> None:
        if not self.main:
            return
        self.write(record)
        if self.bar is not None:
            self.bar.update(record["step"] - self.bar.n)
            extra = {}
            if self.deadline:
                extra["left"] = f"{max(0.0, self.deadline - time.time()) / 60:.1f}min"
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", **extra)
        if self.wandb is not None:
            self.wandb.log({"train/loss": record["loss"], "train/lr": record["lr"],
                            "train/grad_norm": record["grad_norm"], "train/tokens_per_s": record["tokens_per_s"],
                            **{f"train/{k}": v for k, v in record.get("parts", {}).items()}}, step=record["step"])

    def eval(self, step: int, metrics: dict) -> None:
        if self.main and self.wandb is not None:
            self.wandb.log({f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.fh is not None:
            self.fh.close()
        if self.wandb is not None:
            self.wandb.finish()


def heldout_loss(accelerator, proxy, objective, batches: list[dict], step: int, seed: int) -> dict[str, float]:
    """Token-weighted mean objective loss over the fixed held-out batches, with a fixed generator (the same
    noise at every evaluation, so the curve shows the model changing, not the noise)."""
    gen = torch.Generator(device=accelerator.device)
    gen.manual_seed(seed)
    was_training = proxy.training
    proxy.train(False)
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    with torch.no_grad():
        for b in batches:
            # EVAL_STEP: objectives that anneal with the step (mdm) evaluate at the end of the anneal (p = 1,
            # full attention, as at sampling time - docs/algorithms.md#annealed-attention).
            out = objective(proxy, _to_device(b, accelerator.device), EVAL_STEP, gen)
            n = max(1, int(out.num_tokens))
            total += torch.tensor([float(out.loss) * n, n], dtype=torch.float64, device=accelerator.device)
    proxy.train(was_training)
    total = accelerator.reduce(total, "sum")
    if total[1] == 0:
        return {}
    loss = float(total[0] / total[1])
    return {"heldout_loss": loss, "heldout_tokens": int(total[1].item())}


def append_eval_history(path: Path, step: int, metrics: dict) -> None:
    """One eval_history.jsonl line; ``checkpoint`` is the step's checkpoint name (its folder when saved)."""
    from dlm.eval.history import append_history

    append_history(path, step, ckpt_mod.checkpoint_name(step), metrics)


def task_metrics(cfg: TrainingConfig, dlm: DiffusionLM, step: int) -> dict:
    """Scheduled task evaluation through dlm.eval.run_eval (main process, unwrapped model)."""
    if not cfg.eval.eval_tasks:
        return {}
    from dlm.eval import run_eval  # checked available before training starts

    was = dlm.training
    dlm.eval()
    try:
        with torch.no_grad():
            result = run_eval(dlm, tasks=list(cfg.eval.eval_tasks), data_dir=cfg.eval.eval_data_dir,
                              limit=cfg.eval.eval_limit, batch_size=cfg.eval.eval_batch_size)
    finally:
        dlm.train(was)
    return dict(result) if isinstance(result, dict) else {"tasks": result}


# ----------------------------------------------------------------------------------------------- the loop
def train(cfg: TrainingConfig, objective=None, dlm: DiffusionLM | None = None) -> TrainResult:
    """Run training as configured; see the module docstring. ``objective`` / ``dlm`` may be given directly
    (library use, tests); otherwise they come from ``cfg``."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from dlm.device import get_device, supports_bf16

    cfg.validate()
    t0 = time.time()
    device = get_device()
    mp = cfg.train.mixed_precision
    if mp == "auto":
        mp = "bf16" if supports_bf16(device) else "no"
    from accelerate.state import AcceleratorState, GradientState

    # a previous train() in this process (library use, tests) leaves accelerate's singletons set up with its
    # precision and accumulation; the process group (PartialState) is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=cfg.train.gradient_accumulate_every, mixed_precision=mp,
                              cpu=device.type == "cpu")
    rank, world = accelerator.process_index, accelerator.num_processes
    main = accelerator.is_main_process

    # -- the run folder ------------------------------------------------------------------------------------
    resume_from = ckpt_mod.resolve_resume(cfg.train.resume, cfg.checkpoint_dir)
    check_output_dir(cfg, resuming=cfg.train.resume is not None)
    if cfg.wandb.project and main:
        from dlm.errors import require

        require("wandb", "wandb")  # fail before loading anything
    if cfg.eval.eval_tasks:
        try:
            from dlm.eval import run_eval  # noqa: F401
        except ImportError as e:
            raise DLMError(f"--eval-tasks needs the task evaluation of dlm.eval, which is not available here ({e}); "
                           f"drop --eval-tasks to log the held-out loss only") from e
    accelerator.wait_for_everyone()
    if main:
        if cfg.train.overwrite and cfg.train.resume is None:
            clear_run(cfg)
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        for stale in cfg.checkpoint_dir.glob(".step_*.tmp") if cfg.checkpoint_dir.is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)  # a crash mid-save left it; it never looked complete
        from dlm.config import save_yaml

        save_yaml(cfg, cfg.output_dir / "run_config.yaml")
    accelerator.wait_for_everyone()

    # -- model -------------------------------------------------------------------------------------------
    set_seed(cfg.train.seed)  # identical LoRA init on every rank
    if dlm is None:
        dlm = load_training_model(cfg)
    check_data_against_model(cfg, dlm)
    if cfg.lora.r > 0:
        from dlm.model.lora import LoraSettings, prepare_model_for_lora

        lo = cfg.lora
        dlm = prepare_model_for_lora(dlm, LoraSettings(r=lo.r, alpha=lo.alpha, dropout=lo.dropout,
                                                       target_modules=lo.target_modules or "all-linear",
                                                       gated=lo.gated))
    if cfg.model.gradient_checkpointing:
        hf = dlm.base_model_hf
        hf.config.use_cache = False
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if objective is None:
        objective = get_objective_for(cfg, dlm)

    # -- data --------------------------------------------------------------------------------------------
    data, held = build_data(cfg, dlm, rank, world)

    # -- optimizer, schedule -------------------------------------------------------------------------------
    params = [p for p in dlm.parameters() if p.requires_grad]
    if not params:
        raise DLMError("the model has no trainable parameters")
    dlm.train()
    optimizer = build_optimizer(params, cfg, accelerator.device)
    warm = warmup_steps(cfg)
    # Share of a max_minutes budget spent (the main process's clock, summed across processes with the step's
    # stats so every replica gets the same learning rate); None without a budget.
    clock: dict[str, float | None] = {"fraction": 0.0 if cfg.train.max_minutes else None}
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.train.max_train_steps, warm, cfg.optim.schedule, cfg.optim.min_lr_ratio,
                                       clock["fraction"], cfg.optim.decay_ratio))
    ds_plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if ds_plugin is not None:  # no prepared DataLoader, so accelerate cannot infer DeepSpeed's "auto" batch fields
        ds_conf = ds_plugin.deepspeed_config
        if ds_conf.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            ds_conf["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
        if ds_conf.get("train_batch_size", "auto") == "auto":
            ds_conf["train_batch_size"] = cfg.train.batch_size * cfg.train.gradient_accumulate_every * world
        if ds_conf.get("gradient_clipping", "auto") == "auto":
            ds_conf["gradient_clipping"] = cfg.optim.max_grad_norm
    wrapped, optimizer = accelerator.prepare(dlm, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    proxy = RoutedDLM(dlm, wrapped)
    proxy.train(True)
    gen = torch.Generator(device=accelerator.device)
    gen.manual_seed(cfg.train.seed * 1_000_003 + rank)

    step, tokens_total = 0, 0
    prior_s = 0.0  # training seconds of the interrupted runs this one resumes (for a time-bounded schedule)
    last_ckpt: Path | None = None
    if resume_from is not None:
        state, rank_state = ckpt_mod.load_checkpoint(accelerator, resume_from)
        saved = state.get("config", {}).get("model", {})
        for key in ("objective", "block_size"):
            if key in saved and saved[key] is not None and saved[key] != getattr(cfg.model, key):
                raise DLMError(f"cannot resume '{resume_from}': it was trained with model.{key} = {saved[key]!r}, "
                               f"this run asks for {getattr(cfg.model, key)!r}")
        step, tokens_total = int(state["step"]), int(state["tokens"])
        prior_s = float(state.get("train_seconds", 0.0))
        data.load_state_dict(rank_state["data"])
        gen.set_state(rank_state["generator"])
        last_ckpt = resume_from
    elif cfg.train.resume == "auto" and main:
        print(f"dlm train: no checkpoint in {cfg.checkpoint_dir}; starting from step 0")

    log = _Log(cfg, main, step)
    if cfg.eval.eval_every and not held and not cfg.eval.eval_tasks and main:
        note = ("--eval-every is set but there is nothing to evaluate: give held-out data (--eval-data for chat "
                "data, --data.eval_packed_prefixes for shards) or --eval-tasks")
        print(f"dlm train: warning: {note}")
        log.write({"event": "warning", "message": note})
    log.write({"event": "resume" if resume_from else "start", "step": step, "time": time.time(),
               "checkpoint": str(resume_from) if resume_from else None, "world_size": world,
               "mixed_precision": mp, "device": str(accelerator.device)})

    def save(at_step: int) -> Path:
        state = {"step": at_step, "tokens": tokens_total, "world_size": world, "time": time.time(),
                 "train_seconds": prior_s + time.time() - t0, "config": cfg.to_dict()}
        rank_state = {"data": data.state_dict(), "generator": gen.get_state()}
        return ckpt_mod.save_checkpoint(accelerator, dlm, wrapped, cfg.checkpoint_dir, at_step, state, rank_state,
                                        keep_last=cfg.train.keep_last)

    budget_s = cfg.train.max_minutes * 60 if cfg.train.max_minutes else None
    accum = cfg.train.gradient_accumulate_every
    max_norm = cfg.optim.max_grad_norm
    losses: list[float] = []
    stopped = "max_train_steps"
    first_batch = True
    run_tokens, run_t0 = 0, time.perf_counter()
    try:
        while step < cfg.train.max_train_steps:
            t_step = time.perf_counter()
            loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
            ntok = 0
            parts: dict[str, float] = {}
            fp = None
            grad_norm = float("nan")
            for micro in range(accum):
                batch = next(data)
                if first_batch:
                    check_token_ids(batch, dlm, cfg.data.packed_data_dir or cfg.data.data or "the data")
                    first_batch = False
                batch = _to_device(batch, accelerator.device)
                if fp is None and world > 1:
                    fp = _fingerprint(batch["input_ids"])
                with accelerator.accumulate(wrapped):
                    out = objective(proxy, batch, step, gen)
                    accelerator.backward(out.loss)
                    loss_sum += out.loss.detach().to(torch.float64)
                    ntok += int(out.num_tokens)
                    for k, v in (out.parts or {}).items():
                        parts[k] = parts.get(k, 0.0) + float(v) / accum
                    if accelerator.sync_gradients:
                        over = budget_s is not None and main and time.time() - t0 > budget_s
                        # A resumed run gets a fresh budget on top of the seconds already trained.
                        frac = (prior_s + time.time() - t0) / (prior_s + budget_s) if budget_s and main else 0.0
                        finite = bool(torch.isfinite(loss_sum))
                        stats = torch.tensor([float(loss_sum) if finite else 0.0, ntok, 0 if finite else 1,
                                              1 if over else 0, frac], dtype=torch.float64,
                                             device=accelerator.device)
                        stats = accelerator.reduce(stats, "sum")
                        if stats[2] > 0:
                            raise DLMError(
                                f"non-finite loss at step {step + 1} (the weights were not updated); last good "
                                f"checkpoint: {last_ckpt or 'none'}. Resume from it with a lower --learning-rate "
                                f"(or check the data)")
                        norm = accelerator.clip_grad_norm_(wrapped.parameters(), max_norm if max_norm > 0
                                                           else float("inf"))
                        if norm is not None:
                            grad_norm = float(norm)
                            if not math.isfinite(grad_norm):
                                raise DLMError(f"non-finite gradient norm at step {step + 1} (the weights were "
                                               f"not updated); last good checkpoint: {last_ckpt or 'none'}")
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            if clock["fraction"] is not None:
                clock["fraction"] = float(stats[4])
            scheduler.step()
            step += 1
            loss = float(stats[0]) / (accum * world)
            step_tokens = int(stats[1])
            tokens_total += step_tokens
            run_tokens += step_tokens
            losses.append(loss)
            if step % cfg.train.log_every == 0 or step == cfg.train.max_train_steps:
                dt = time.perf_counter() - t_step
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens_total,
                          "tokens_per_s": step_tokens / max(dt, 1e-9),
                          "avg_tokens_per_s": run_tokens / max(time.perf_counter() - run_t0, 1e-9),
                          "elapsed_s": time.time() - t0, "parts": parts}
                if world > 1:
                    record["data_fingerprint"] = accelerator.gather(
                        torch.tensor([fp], device=accelerator.device)).tolist()
                log.step(record)
            stop = stats[3] > 0
            is_last = step == cfg.train.max_train_steps or stop
            if cfg.train.save_every and (step % cfg.train.save_every == 0 or (is_last and stop)):
                last_ckpt = save(step)
            elif stop:  # the budget ran out: keep a resumable checkpoint even without --save-every
                last_ckpt = save(step)
            if cfg.eval.eval_every and step % cfg.eval.eval_every == 0:
                metrics = heldout_loss(accelerator, proxy, objective, held, step, cfg.data.seed + 7919) if held \
                    else {}
                if main:
                    metrics.update(task_metrics(cfg, dlm, step))
                    if metrics:
                        append_eval_history(cfg.eval_history_path, step, metrics)
                        log.write({"event": "eval", "step": step, "metrics": metrics})
                        log.eval(step, metrics)
                accelerator.wait_for_everyone()
            if stop:
                stopped = "max_minutes"
                break

        # -- final model ---------------------------------------------------------------------------------
        staging = cfg.output_dir / ".final_model.tmp"
        ckpt_mod.export_model(accelerator, dlm, wrapped, staging)
        accelerator.wait_for_everyone()
        if main:
            ckpt_mod.publish_final(staging, cfg.output_dir)
        checksum = torch.tensor([sum(float(p.detach().double().sum()) for p in dlm.parameters())],
                                dtype=torch.float64, device=accelerator.device)
        checksums = accelerator.gather(checksum).tolist() if world > 1 else [float(checksum)]
        log.write({"event": "end", "step": step, "stopped": stopped, "time": time.time(), "tokens": tokens_total,
                   "param_checksum": checksums})
    except BaseException as e:
        if isinstance(e, DLMError):
            log.write({"event": "error", "step": step, "message": str(e), "time": time.time()})
        raise
    finally:
        log.close()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return TrainResult(output_dir=cfg.output_dir, step=step, stopped=stopped, losses=losses, tokens=tokens_total,
                       seconds=time.time() - t0, last_checkpoint=last_ckpt)
