"""One training loop for every objective, on accelerate (single process, DDP, FSDP, DeepSpeed).

``train(cfg)`` = ``Trainer(cfg).fit()``. Setup, in order (``Trainer.__init__``):

1. the accelerator; refuse to overwrite an existing run (unless ``train.resume`` / ``train.overwrite``);
2. the model (a DLM folder, or an AR model converted on the fly) in fp32 - the master weights and the AdamW state
   stay fp32 while bf16 autocast runs the matmuls, so a learning-rate-1e-5 update is not rounded away as with
   bf16 weights; LoRA / gated LoRA and gradient checkpointing;
3. the data (packed shards or chat JSONL), checked against the model (block size, context, vocabulary) before any
   step;
4. AdamW (fused where available) with warm-up then cosine/constant/wsd decay, gradient accumulation and clipping;
   the state of a checkpoint to resume.

:meth:`Trainer.fit` runs the optimizer steps (:meth:`Trainer.train_step`): a JSONL log line (loss, parts, lr, grad
norm, tokens/s) every ``log_every`` steps, the progress bar and W&B; an atomic checkpoint every ``save_every``
steps (:meth:`Trainer.save`, :mod:`dlm.train.checkpoint`); every ``eval_every`` steps :meth:`Trainer.validate`:
the held-out loss plus the callbacks' metrics (task evaluation is a callback of :mod:`dlm.eval`) appended to
``eval_history.jsonl``; it stops at ``max_train_steps`` or when the ``max_minutes`` budget is spent (a non-finite
loss stops before the weights are touched) and writes the final model + tokenizer into ``output_dir``.

Each rank reads its own data in-process (see :mod:`dlm.train.data`); the model is the only thing handed to
``accelerator.prepare`` besides the optimizer. The scheduler steps once per optimizer step whatever the number of
processes (accelerate's prepared scheduler would step ``num_processes`` times).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlm.config import TrainingConfig, save_yaml
from dlm.data.loader import build_packed_dataset
from dlm.data.sft import SFTCollator, load_sft_examples, pad_token_id, read_jsonl
from dlm.device import get_device, memory_mib, peak_memory_mib, training_precision
from dlm.errors import DLMError, require
from dlm.model.convert import DiffusionLM, load_any
from dlm.model.lora import LoraSettings, prepare_model_for_lora
from dlm.objectives import get_objective
from dlm.train import checkpoint as ckpt_mod
from dlm.train.data import PackedBatches, SFTBatches, heldout_batches, split_heldout

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


class RoutedDLM:
    """What the objectives are handed: the real model's attributes, its forward through the distributed wrapper
    (DDP/FSDP/DeepSpeed need their own forward for gradient synchronisation). A plain composition: no second
    DiffusionLM, no module of its own."""

    def __init__(self, dlm: DiffusionLM, wrapped: nn.Module):
        self.__dict__.update(_dlm=dlm, _wrapped=wrapped, training=True)

    def __getattr__(self, name):
        return getattr(self.__dict__["_dlm"], name)

    def __call__(self, *args, **kwargs):
        return self.__dict__["_wrapped"](*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True):
        self.__dict__["_wrapped"].train(mode)
        self.__dict__["training"] = mode
        return self

    def eval(self):
        return self.train(False)


# ----------------------------------------------------------------------------------------------- pieces
def lr_factor(
    step: int,
    max_steps: int,
    warmup: int,
    schedule: str,
    min_ratio: float,
    time_fraction: float | None = None,
    decay_ratio: float = 0.2,
) -> float:
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
    use_fused = fused == "true" or (
        fused == "auto"
        and device.type in ("cuda", "cpu")
        and all(p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params)
    )
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
    holds_run = (
        any((out / f).exists() for f in RUN_FILES)
        or bool(ckpt_mod.list_checkpoints(cfg.checkpoint_dir))
        or (out / "config.json").exists()
    )
    if not holds_run and not any(out.iterdir()):
        return
    if resuming:
        return
    if not cfg.train.overwrite:
        what = "a training run" if holds_run else "files"
        raise DLMError(
            f"output_dir '{out}' already holds {what}; pass --resume auto to continue it, --overwrite "
            f"to start over there, or choose another --output-dir"
        )


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

    m = cfg.model
    convert_kw: dict[str, Any] = {}
    if m.block_size is not None:
        convert_kw["block_size"] = m.block_size
    if m.mask_token is not None:
        convert_kw["mask_token"] = m.mask_token
    dlm = load_any(m.name, objective=m.objective, dtype=torch.float32, **convert_kw)
    if m.block_size is not None and dlm.block_size != m.block_size:
        raise DLMError(
            f"model '{m.name}' is an {dlm.objective} DLM with block size {dlm.block_size}, but "
            f"--block-size {m.block_size} was asked; drop --block-size or start from the AR model"
        )
    if m.attn_impl == "flex_attention":
        if get_device().type == "cpu":
            raise DLMError(
                "--attn-impl flex_attention cannot train on CPU (torch's flex attention has no CPU "
                "backward); use --attn-impl sdpa here, flex_attention on CUDA"
            )
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
        raise DLMError(
            f"data.seq_length (--seq-length / cutoff_len) = {d.seq_length} exceeds the model's context "
            f"of {ctx} positions; use --seq-length {ctx} or less"
        )
    if d.idlm_block_size is not None:
        if dlm.block_size is None:
            raise DLMError(
                f"data.idlm_block_size (block_length) = {d.idlm_block_size} is set but objective "
                f"'{dlm.objective}' has no blocks; drop it"
            )
        if d.idlm_block_size != dlm.block_size:
            raise DLMError(
                f"data.idlm_block_size (block_length) = {d.idlm_block_size} does not match the model's block size "
                f"{dlm.block_size} (config.json block_size); set it to {dlm.block_size} or train "
                f"a model converted with --block-size {d.idlm_block_size}"
            )
    if dlm.objective == "block" and d.packed_data_dir and d.seq_length % dlm.block_size:
        raise DLMError(
            f"--seq-length {d.seq_length} is not a multiple of the block size {dlm.block_size}; block "
            f"diffusion needs whole blocks"
        )


def check_token_ids(batch: dict, dlm: DiffusionLM, source: str) -> None:
    emb = dlm.base_model_hf.get_input_embeddings()  # num_embeddings: ZeRO-3 leaves each rank a 0-size weight
    vocab = getattr(emb, "num_embeddings", None) or emb.weight.shape[0]
    top = int(batch["input_ids"].max())
    if top >= vocab:
        raise DLMError(
            f"{source} holds token id {top} but the model's vocabulary has {vocab} entries: the data was "
            f"tokenized with another tokenizer; re-run dlm prepare with --tokenizer {cfg_name(dlm)}"
        )


def cfg_name(dlm) -> str:
    return getattr(dlm.hf_config, "name_or_path", "") or "<the model>"


def build_data(cfg: TrainingConfig, dlm: DiffusionLM, rank: int, world: int):
    """(train batches, held-out batches of this rank)."""

    d, t = cfg.data, cfg.train
    eval_on = cfg.eval.eval_every > 0
    if d.packed_data_dir:
        ds = build_packed_dataset(
            d.packed_data_dir,
            d.packed_prefixes,
            d.packed_weights,
            block_size=d.seq_length,
            seed=d.seed,
            rank=rank,
            world_size=world,
        )
        train = PackedBatches(ds, t.batch_size)
        held: list[dict] = []
        if eval_on and d.eval_packed_prefixes:
            eds = build_packed_dataset(
                d.packed_data_dir,
                d.eval_packed_prefixes,
                None,
                block_size=d.seq_length,
                seed=d.seed,
                rank=rank,
                world_size=world,
                shuffle=False,
            )
            it = PackedBatches(eds, t.batch_size)
            held = [next(it) for _ in range(cfg.eval.eval_batches)]
        return train, held

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
            wandb = require("wandb", "wandb")
            wandb.init(
                project=cfg.wandb.project,
                entity=cfg.wandb.entity,
                name=cfg.wandb.run_name,
                dir=cfg.wandb.dir,
                config=cfg.to_dict(),
                resume="allow",
            )
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
            self.wandb.log(
                {
                    "train/loss": record["loss"],
                    "train/lr": record["lr"],
                    "train/grad_norm": record["grad_norm"],
                    "train/tokens_per_s": record["tokens_per_s"],
                    **{f"train/{k}": v for k, v in record.get("parts", {}).items()},
                },
                step=record["step"],
            )

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
    from dlm.eval.history import append_history  # the trainer needs the eval package only when evaluation runs

    append_history(path, step, ckpt_mod.checkpoint_name(step), metrics)


class Callback:
    """A hook of the trainer: ``setup(trainer)`` once before the first step (fail early there), and
    ``on_evaluate(trainer, step) -> dict`` at every scheduled evaluation on the main process, whose metrics join the
    held-out loss in ``eval_history.jsonl``."""

    def setup(self, trainer: Trainer) -> None:
        pass

    def on_evaluate(self, trainer: Trainer, step: int) -> dict:
        return {}


# The task evaluation of eval.eval_tasks is a plug-in of the evaluation package (the trainer does not import it):
TASK_EVALUATION = "dlm.eval.callback:TaskEvaluation"


def default_callbacks(cfg: TrainingConfig) -> list[Callback]:
    """The callbacks a configuration asks for: the task evaluation when ``eval.eval_tasks`` is set."""
    if not cfg.eval.eval_tasks:
        return []
    import importlib

    module, name = TASK_EVALUATION.split(":")
    try:
        return [getattr(importlib.import_module(module), name)()]
    except ImportError as e:
        raise DLMError(
            f"--eval-tasks needs the task evaluation of dlm.eval, which is not available here ({e}); "
            f"drop --eval-tasks to log the held-out loss only"
        ) from e


# ----------------------------------------------------------------------------------------------- the loop
def train(
    cfg: TrainingConfig, objective=None, dlm: DiffusionLM | None = None, callbacks: list[Callback] | None = None
) -> TrainResult:
    """Run training as configured; see the module docstring. ``objective`` / ``dlm`` may be given directly
    (library use, tests); otherwise they come from ``cfg``. ``callbacks``: default :func:`default_callbacks`."""
    trainer = Trainer(cfg, objective=objective, dlm=dlm, callbacks=callbacks)
    return trainer.fit()


def _launched_with(engine: str) -> bool:
    """Whether accelerate's launcher started this process for ``engine`` (``DEEPSPEED`` or ``FSDP``)."""
    import os

    return os.environ.get(f"ACCELERATE_USE_{engine}", "").lower() in ("1", "true")


def _device_args(device) -> dict:
    """Accelerator's device arguments. A DeepSpeed launch on CPU processes: accelerate takes DeepSpeed only when it
    is not told ``cpu=True``, and then needs the process group's backend named; DeepSpeed's CPU accelerator runs
    its collectives over gloo (oneCCL where installed)."""
    import os

    if device.type != "cpu" or not _launched_with("DEEPSPEED"):
        return {"cpu": device.type == "cpu"}
    if torch.cuda.is_available():
        raise DLMError(
            "DLM_DEVICE=cpu with a DeepSpeed launch on a machine with a GPU: DeepSpeed would take the GPU; unset "
            "DLM_DEVICE, or shard on the CPU with dlm/configs/accelerate/fsdp_cpu.yaml"
        )
    from accelerate.utils import InitProcessGroupKwargs

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return {"cpu": False, "kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}


@contextlib.contextmanager
def _whole_weights(accelerator):
    """Load the model whole on every rank under DeepSpeed ZeRO-3 too. accelerate registers its DeepSpeed config
    with transformers whatever the launch's ``zero3_init_flag`` says, and transformers then loads a ZeRO-3 model
    already partitioned (each rank a 0-size tensor per weight); dlm's set-up reads and edits whole weights (the
    mask token's embedding row, the gated adapters' mask embedding, LoRA's initialisation), so the model is loaded
    whole and ``accelerate.prepare`` partitions it."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or plugin.zero_stage != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        plugin.set_deepspeed_weakref()


class Trainer:
    """``Trainer(cfg)`` sets up (accelerator, run folder, model, data, optimizer, resume); :meth:`fit` runs the
    optimizer steps, with :meth:`save` and :meth:`validate` on their schedules, and writes the final model."""

    def __init__(
        self,
        cfg: TrainingConfig,
        objective=None,
        dlm: DiffusionLM | None = None,
        callbacks: list[Callback] | None = None,
    ):
        cfg.validate()
        self.cfg, self.t0 = cfg, time.time()
        self.callbacks = default_callbacks(cfg) if callbacks is None else list(callbacks)
        self.checked_ids = False  # the first batch's token ids are checked against the vocabulary
        self._setup_accelerator()
        self._setup_run_folder()
        self._setup_model(dlm, objective)
        self.data, self.held = build_data(cfg, self.dlm, self.rank, self.world)
        self._setup_optimizer()
        self._resume()
        self.log = _Log(cfg, self.main, self.step)
        if cfg.eval.eval_every and not self.held and not self.callbacks and self.main:
            note = (
                "--eval-every is set but there is nothing to evaluate: give held-out data (--eval-data for chat "
                "data, --data.eval_packed_prefixes for shards) or --eval-tasks"
            )
            print(f"dlm train: warning: {note}")
            self.log.write({"event": "warning", "message": note})
        # what each replica's forward runs at: the trainer's own autocast, else accelerate's (they must agree)
        precision_by_rank = ["bf16" if self.autocast_dtype is not None else str(self.accelerator.mixed_precision)]
        if self.world > 1:
            from accelerate.utils import gather_object

            precision_by_rank = gather_object(precision_by_rank)
        if self.main and cfg.train.progress and cfg.train.mixed_precision == "auto":
            print(f"dlm train: precision {self.precision_note}", file=sys.stderr)
        self.log.write(
            {
                "event": "resume" if self.resume_from else "start",
                "step": self.step,
                "time": time.time(),
                "checkpoint": str(self.resume_from) if self.resume_from else None,
                "world_size": self.world,
                "distributed_type": str(self.accelerator.distributed_type.value),
                "mixed_precision": self.mixed_precision,
                "mixed_precision_why": self.precision_note,
                "mixed_precision_by_rank": precision_by_rank,
                "device": str(self.accelerator.device),
            }
        )

    # -- setup ---------------------------------------------------------------------------------------------
    def _engine_on_cpu(self) -> None:
        """accelerate turns an FSDP launch into plain DDP when the processes run on the CPU (its branches for it
        only cover accelerator devices). torch's FSDP2 shards over gloo, so the launch's FSDP settings are put back
        and a CPU run trains the way the same launch trains on GPUs. (DeepSpeed is kept by ``_setup_accelerator``.)"""

        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        acc = self.accelerator
        if acc.distributed_type != DistributedType.MULTI_CPU:
            return
        if _launched_with("FSDP"):
            acc.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # the launcher's fsdp_config, from the env
            acc.state.distributed_type = DistributedType.FSDP
            # (every later AcceleratorState() copies the process state's type over its own)
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    def _setup_accelerator(self) -> None:
        """bf16 autocast is the trainer's own (``torch.autocast`` around the forward, fp32 weights), so one process
        may train several runs with different precisions; fp16 (which needs loss scaling), DeepSpeed and FSDP keep
        it in accelerate, which fixes it per process (a launcher starts fresh ones)."""

        from accelerate import Accelerator

        cfg = self.cfg
        device = get_device()
        mp = cfg.train.mixed_precision
        self.precision_note = f"{mp}: set by train.mixed_precision"
        launcher_managed = _launched_with("DEEPSPEED") or _launched_with("FSDP")
        if mp == "auto" and launcher_managed and device.type == "cpu":
            # the launcher fixes the precision before the processes could agree on a measured one
            mp, self.precision_note = "no", "fp32: auto under DeepSpeed / FSDP on a CPU"
        elif mp == "auto":
            mp, self.precision_note = training_precision(device, tokens=cfg.train.batch_size * cfg.data.seq_length)
        in_accelerate = mp == "fp16" or launcher_managed
        try:
            self.accelerator = Accelerator(
                gradient_accumulation_steps=cfg.train.gradient_accumulate_every,
                mixed_precision=mp if in_accelerate else "no",
                **_device_args(device),
            )
        except ValueError as e:  # accelerate's precision is fixed per process once set
            raise DLMError(f"train.mixed_precision={mp}: {e}; run this training in a new process") from e
        self._engine_on_cpu()
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.main = self.accelerator.is_main_process
        if cfg.train.mixed_precision == "auto" and self.world > 1 and not in_accelerate:
            # each process measured on its own (and may have read a different cache): all take the main one's verdict
            from accelerate.utils import broadcast_object_list

            mp, self.precision_note = broadcast_object_list([(mp, self.precision_note)], from_process=0)[0]
        self.mixed_precision = mp
        self.autocast_dtype = torch.bfloat16 if mp == "bf16" and not in_accelerate else None

    def _setup_run_folder(self) -> None:
        cfg, acc = self.cfg, self.accelerator
        self.resume_from = ckpt_mod.resolve_resume(cfg.train.resume, cfg.checkpoint_dir)
        check_output_dir(cfg, resuming=cfg.train.resume is not None)
        if cfg.wandb.project and self.main:
            require("wandb", "wandb")  # fail before loading anything
        for cb in self.callbacks:
            cb.setup(self)
        acc.wait_for_everyone()
        if self.main:
            if cfg.train.overwrite and cfg.train.resume is None:
                clear_run(cfg)
            cfg.output_dir.mkdir(parents=True, exist_ok=True)
            for stale in cfg.checkpoint_dir.glob(".step_*.tmp") if cfg.checkpoint_dir.is_dir() else []:
                shutil.rmtree(stale, ignore_errors=True)  # a crash mid-save left it; it never looked complete

            save_yaml(cfg, cfg.output_dir / "run_config.yaml")
        acc.wait_for_everyone()

    def _setup_model(self, dlm: DiffusionLM | None, objective) -> None:
        from accelerate.utils import set_seed

        cfg = self.cfg
        set_seed(cfg.train.seed)  # identical LoRA init on every rank
        if dlm is None:
            with _whole_weights(self.accelerator):
                dlm = load_training_model(cfg)
        check_data_against_model(cfg, dlm)
        if cfg.lora.r > 0:
            lo = cfg.lora
            dlm = prepare_model_for_lora(
                dlm,
                LoraSettings(
                    r=lo.r,
                    alpha=lo.alpha,
                    dropout=lo.dropout,
                    target_modules=lo.target_modules or "all-linear",
                    gated=lo.gated,
                ),
            )
        if cfg.model.gradient_checkpointing:
            hf = dlm.base_model_hf
            hf.config.use_cache = False
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.dlm = dlm
        self.objective = objective if objective is not None else get_objective_for(cfg, dlm)

    def _setup_optimizer(self) -> None:
        cfg, acc, dlm = self.cfg, self.accelerator, self.dlm
        params = [p for p in dlm.parameters() if p.requires_grad]
        if not params:
            raise DLMError("the model has no trainable parameters")
        dlm.train()
        optimizer = build_optimizer(params, cfg, acc.device)
        warm = warmup_steps(cfg)
        # Share of a max_minutes budget spent (the main process's clock, summed across processes with the step's
        # stats so every replica gets the same learning rate); None without a budget.
        self.clock: dict[str, float | None] = {"fraction": 0.0 if cfg.train.max_minutes else None}
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_factor(
                s,
                cfg.train.max_train_steps,
                warm,
                cfg.optim.schedule,
                cfg.optim.min_lr_ratio,
                self.clock["fraction"],
                cfg.optim.decay_ratio,
            ),
        )
        ds_plugin = getattr(acc.state, "deepspeed_plugin", None)
        if ds_plugin is not None:  # no prepared DataLoader, so accelerate cannot infer DeepSpeed's "auto" fields
            ds_conf = ds_plugin.deepspeed_config
            if ds_conf.get("train_micro_batch_size_per_gpu", "auto") == "auto":
                ds_conf["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
            if ds_conf.get("train_batch_size", "auto") == "auto":
                ds_conf["train_batch_size"] = cfg.train.batch_size * cfg.train.gradient_accumulate_every * self.world
            if ds_conf.get("gradient_clipping", "auto") == "auto":
                ds_conf["gradient_clipping"] = cfg.optim.max_grad_norm
        self.wrapped, self.optimizer = acc.prepare(dlm, optimizer)
        acc.register_for_checkpointing(self.scheduler)
        self.proxy = RoutedDLM(dlm, self.wrapped)
        self.proxy.train(True)
        self.gen = torch.Generator(device=acc.device)
        self.gen.manual_seed(cfg.train.seed * 1_000_003 + self.rank)

    def _resume(self) -> None:
        cfg = self.cfg
        self.step, self.tokens_total = 0, 0
        self.prior_s = 0.0  # training seconds of the interrupted runs this one resumes (time-bounded schedules)
        self.last_ckpt: Path | None = None
        if self.resume_from is not None:
            state, rank_state = ckpt_mod.load_checkpoint(self.accelerator, self.resume_from)
            saved = state.get("config", {}).get("model", {})
            for key in ("objective", "block_size"):
                if key in saved and saved[key] is not None and saved[key] != getattr(cfg.model, key):
                    raise DLMError(
                        f"cannot resume '{self.resume_from}': it was trained with model.{key} = "
                        f"{saved[key]!r}, this run asks for {getattr(cfg.model, key)!r}"
                    )
            self.step, self.tokens_total = int(state["step"]), int(state["tokens"])
            self.prior_s = float(state.get("train_seconds", 0.0))
            self.data.load_state_dict(rank_state["data"])
            self.gen.set_state(rank_state["generator"])
            self.last_ckpt = self.resume_from
        elif cfg.train.resume == "auto" and self.main:
            print(f"dlm train: no checkpoint in {cfg.checkpoint_dir}; starting from step 0")

    # -- the step loop -----------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        """Optimizer steps until ``max_train_steps`` or the ``max_minutes`` budget; checkpoints, evaluation and
        log lines on their schedules; then the final model. Each step makes one host read, of its reduced stats
        (loss sum, tokens, non-finite loss or gradient, budget spent, grad norm): every process must agree on them
        before the weights move. The loss parts stay on the device until the log interval."""
        cfg, acc = self.cfg, self.accelerator
        budget_s = cfg.train.max_minutes * 60 if cfg.train.max_minutes else None
        pending: list[tuple] = []  # (step, lr, stats as read, parts on the device, seconds, fingerprint)
        losses: list[float] = []
        stopped = "max_train_steps"
        run_tokens, run_t0 = 0, time.perf_counter()
        try:
            while self.step < cfg.train.max_train_steps:
                t_step = time.perf_counter()
                stats, parts, fp = self.train_step(budget_s)
                stats = stats.tolist()  # the one host read per step
                _, _, bad_loss, over, frac, _, bad_norm = stats
                if bad_loss > 0:
                    raise DLMError(
                        f"non-finite loss at step {self.step + 1} (the weights were not updated); last "
                        f"good checkpoint: {self.last_ckpt or 'none'}. Resume from it with a lower "
                        f"--learning-rate (or check the data)"
                    )
                if bad_norm > 0:
                    raise DLMError(
                        f"non-finite gradient norm at step {self.step + 1} (the weights were not "
                        f"updated); last good checkpoint: {self.last_ckpt or 'none'}"
                    )
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                lr = self.scheduler.get_last_lr()[0]
                if self.clock["fraction"] is not None:
                    self.clock["fraction"] = frac
                self.scheduler.step()
                self.step += 1
                pending.append((self.step, lr, stats, parts, time.perf_counter() - t_step, fp))
                stop = over > 0
                is_last = self.step == cfg.train.max_train_steps or stop
                # the budget ran out: a resumable checkpoint even without save_every
                saving = bool(cfg.train.save_every and self.step % cfg.train.save_every == 0) or stop
                evaluating = bool(cfg.eval.eval_every and self.step % cfg.eval.eval_every == 0)
                if self.step % cfg.train.log_every == 0 or is_last or saving or evaluating:
                    run_tokens = self._flush(pending, losses, run_tokens, run_t0)  # the token count saves need
                if saving:
                    self.last_ckpt = self.save(self.step)
                if evaluating:
                    self.validate(self.step)
                if stop:
                    stopped = "max_minutes"
                    break
            self._flush(pending, losses, run_tokens, run_t0)
            self._write_final(stopped)
        except BaseException as e:
            if isinstance(e, DLMError):
                self.log.write({"event": "error", "step": self.step, "message": str(e), "time": time.time()})
            raise
        finally:
            self.log.close()
        acc.wait_for_everyone()
        acc.end_training()
        return TrainResult(
            output_dir=cfg.output_dir,
            step=self.step,
            stopped=stopped,
            losses=losses,
            tokens=self.tokens_total,
            seconds=time.time() - self.t0,
            last_checkpoint=self.last_ckpt,
        )

    def train_step(self, budget_s: float | None):
        """The micro-batches of one optimizer step (forward, backward; clipping at the last). Returns the step's
        stats as one device tensor, ``[loss sum, tokens, nonfinite loss, over budget, time share]`` summed over
        the processes then ``[grad norm, nonfinite grad norm]``, the loss parts (device tensors) and the batch
        fingerprint (several processes)."""
        cfg, acc = self.cfg, self.accelerator
        accum, max_norm, dev = cfg.train.gradient_accumulate_every, cfg.optim.max_grad_norm, acc.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        ntok = torch.zeros((), dtype=torch.float64, device=dev)
        parts: dict[str, torch.Tensor] = {}
        fp = None
        for _ in range(accum):
            batch = next(self.data)
            if not self.checked_ids:
                check_token_ids(batch, self.dlm, cfg.data.packed_data_dir or cfg.data.data or "the data")
                self.checked_ids = True
            batch = _to_device(batch, dev)
            if fp is None and self.world > 1:
                fp = _fingerprint(batch["input_ids"])
            with acc.accumulate(self.wrapped):
                with self.autocast():
                    out = self.objective(self.proxy, batch, self.step, self.gen)
                acc.backward(out.loss)
                loss_sum += out.loss.detach().to(torch.float64)
                ntok += torch.as_tensor(out.num_tokens, dtype=torch.float64).to(dev)
                for k, v in (out.parts or {}).items():
                    v = torch.as_tensor(v).detach().to(dev, torch.float64) / accum
                    parts[k] = parts[k] + v if k in parts else v
        # the last micro-batch synchronised the gradients
        norm = acc.clip_grad_norm_(self.wrapped.parameters(), max_norm if max_norm > 0 else float("inf"))
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        norm_t = zero + float("nan") if norm is None else torch.as_tensor(norm).detach().to(dev, torch.float64)
        bad_norm = zero if norm is None else (~torch.isfinite(norm_t)).to(torch.float64)
        over = budget_s is not None and self.main and time.time() - self.t0 > budget_s
        # A resumed run gets a fresh budget on top of the seconds already trained.
        frac = (self.prior_s + time.time() - self.t0) / (self.prior_s + budget_s) if budget_s and self.main else 0.0
        finite = torch.isfinite(loss_sum)
        stats = torch.stack(
            [
                torch.where(finite, loss_sum, zero),
                ntok,
                (~finite).to(torch.float64),
                zero + (1.0 if over else 0.0),
                zero + frac,
            ]
        )
        stats = acc.reduce(stats, "sum")
        return torch.cat([stats, norm_t.view(1), bad_norm.view(1)]), parts, fp

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.accelerator.device.type, dtype=self.autocast_dtype)

    def _flush(self, pending: list, losses: list[float], run_tokens: int, run_t0: float) -> int:
        """The pending steps into the loss list, the token count and the log lines (their loss parts read from the
        device here); returns the run's token count."""
        cfg = self.cfg
        accum = cfg.train.gradient_accumulate_every
        for step, lr, stats, parts, seconds, fp in pending:
            loss_sum, ntok, _, _, _, norm, _ = stats
            loss = loss_sum / (accum * self.world)
            step_tokens = int(ntok)
            self.tokens_total += step_tokens
            run_tokens += step_tokens
            losses.append(loss)
            if step % cfg.train.log_every == 0 or step == cfg.train.max_train_steps:
                record = {
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": norm,
                    "tokens": self.tokens_total,
                    "tokens_per_s": step_tokens / max(seconds, 1e-9),
                    "avg_tokens_per_s": run_tokens / max(time.perf_counter() - run_t0, 1e-9),
                    "elapsed_s": time.time() - self.t0,
                    "parts": {k: float(v) for k, v in parts.items()},
                }
                if self.world > 1:
                    record["data_fingerprint"] = self.accelerator.gather(
                        torch.tensor([fp], device=self.accelerator.device)
                    ).tolist()
                self.log.step(record)
        pending.clear()
        return run_tokens

    # -- checkpoints, evaluation, the final model ----------------------------------------------------------------
    def save(self, at_step: int) -> Path:
        """An atomic, resumable checkpoint (:mod:`dlm.train.checkpoint`)."""
        state = {
            "step": at_step,
            "tokens": self.tokens_total,
            "world_size": self.world,
            "time": time.time(),
            "train_seconds": self.prior_s + time.time() - self.t0,
            "config": self.cfg.to_dict(),
        }
        rank_state = {"data": self.data.state_dict(), "generator": self.gen.get_state()}
        return ckpt_mod.save_checkpoint(
            self.accelerator,
            self.dlm,
            self.wrapped,
            self.cfg.checkpoint_dir,
            at_step,
            state,
            rank_state,
            keep_last=self.cfg.train.keep_last,
        )

    def validate(self, step: int) -> dict:
        """The held-out loss (every process), then the callbacks' metrics (main process), into
        ``eval_history.jsonl``, the log and W&B."""
        cfg = self.cfg
        metrics = (
            heldout_loss(self.accelerator, self.proxy, self.objective, self.held, step, cfg.data.seed + 7919)
            if self.held
            else {}
        )
        if self.main:
            for cb in self.callbacks:
                metrics.update(cb.on_evaluate(self, step))
            if metrics:
                append_eval_history(cfg.eval_history_path, step, metrics)
                self.log.write({"event": "eval", "step": step, "metrics": metrics})
                self.log.eval(step, metrics)
        self.accelerator.wait_for_everyone()
        return metrics

    def _write_final(self, stopped: str) -> None:
        cfg, acc = self.cfg, self.accelerator
        trained = torch.tensor([memory_mib(acc.device)], dtype=torch.float64, device=acc.device)  # before the export
        staging = cfg.output_dir / ".final_model.tmp"
        ckpt_mod.export_model(acc, self.dlm, self.wrapped, staging)
        acc.wait_for_everyone()
        if self.main:
            ckpt_mod.publish_final(staging, cfg.output_dir)
        checksum = torch.tensor(
            [sum(float(p.detach().double().sum()) for p in self.dlm.parameters())],
            dtype=torch.float64,
            device=acc.device,
        )
        checksums = acc.gather(checksum).tolist() if self.world > 1 else [float(checksum)]
        peak = torch.tensor([peak_memory_mib(acc.device)], dtype=torch.float64, device=acc.device)
        peaks = acc.gather(peak).tolist() if self.world > 1 else [float(peak)]
        resident = acc.gather(trained).tolist() if self.world > 1 else [float(trained)]
        self.log.write(
            {
                "event": "end",
                "step": self.step,
                "stopped": stopped,
                "time": time.time(),
                "tokens": self.tokens_total,
                "param_checksum": checksums,
                # per rank: RSS on a CPU, the CUDA allocator's on a GPU - the peak, and what training left held
                "peak_memory_mib": [round(p, 1) for p in peaks],
                "trained_memory_mib": [round(m, 1) for m in resident],
            }
        )
