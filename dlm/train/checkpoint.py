"""Atomic checkpoints and exact resume.

A checkpoint ``<checkpoint_dir>/step_00000500/`` is a self-describing Hugging Face folder (the DiffusionLM written
by :meth:`DiffusionLM.save_pretrained`: config with the DLM fields, safetensors, tokenizer) plus, beside it:

- ``training_state/``: ``accelerator.save_state`` output - model, optimizer and scheduler state and the RNG states
  of every process (python, numpy, torch, cuda) - which accelerate writes correctly for DDP, FSDP and DeepSpeed;
- ``training_state/dlm_rank{r}.pt``: each rank's data position and objective generator state;
- ``trainer_state.json``: step, tokens seen, world size, the resolved configuration. It is written last, and the
  folder is built under ``.step_00000500.tmp`` and renamed when complete, so a crash never leaves a folder that
  looks like a checkpoint. :func:`latest_checkpoint` only considers folders with ``trainer_state.json``.
- ``checksums.sha256``: the sha256 of every file (``sha256sum -c`` format), checked on resume, so a file damaged
  on disk is an error naming it. A save that fails (a full disk: a one-line error naming the path and the free
  space) removes its temporary folder and leaves the earlier checkpoints as they were.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from dlm.errors import DLMError
from dlm.fsutil import atomic_folder, disk_full_as_error, verify_checksums, write_checksums
from dlm.model.lora import get_gated

STATE_FILE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def read_state(path: str | os.PathLike) -> dict:
    path = Path(path)
    f = path / STATE_FILE
    if not f.is_file():
        raise DLMError(
            f"'{path}' is not a complete dlm checkpoint (no {STATE_FILE}); pass a folder like "
            f"<output_dir>/checkpoints/step_00000500 or --resume auto"
        )
    try:
        state = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise DLMError(
            f"'{f}' is damaged ({e}); resume from an earlier checkpoint with --resume PATH or restore the folder"
        ) from e
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise DLMError(f"'{f}' is damaged (no integer 'step'); resume from an earlier checkpoint with --resume PATH")
    return state


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def resolve_resume(resume: str | None, checkpoint_dir: Path) -> Path | None:
    """The checkpoint to resume from: None (fresh), ``auto`` (latest, or None when there is none) or a path."""
    if resume in (None, "", "none", "no"):
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoint_dir)
    path = Path(resume)
    read_state(path)
    return path


def save_checkpoint(
    accelerator,
    dlm,
    wrapped,
    root: Path,
    step: int,
    state: dict[str, Any],
    rank_state: dict[str, Any],
    keep_last: int = 0,
) -> Path:
    """Write checkpoint ``root/step_XXXXXXXX`` atomically; every process must call this."""
    import torch

    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / f".{checkpoint_name(step)}.tmp"
    fix = (
        "the checkpoints before it are intact: free some space (or pass another --output-dir / "
        "--checkpoint-dir) and rerun the same command with --resume auto"
    )
    try:
        with disk_full_as_error(tmp, fix):
            if accelerator.is_main_process:
                root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
            accelerator.wait_for_everyone()
            export_model(accelerator, dlm, wrapped, tmp)  # creates tmp (main process)
            accelerator.wait_for_everyone()
            accelerator.save_state(str(tmp / "training_state"), safe_serialization=False)
            torch.save(rank_state, tmp / "training_state" / f"dlm_rank{accelerator.process_index}.pt")
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                _write_synced(tmp / STATE_FILE, json.dumps(state, indent=1, default=str))
                write_checksums(tmp)  # every file, so a resume notices one damaged on disk
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # never a half-written folder beside the complete ones
        raise
    if accelerator.is_main_process and keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> tuple[dict, dict]:
    """Restore model/optimizer/scheduler/RNG through accelerate; returns (trainer state, this rank's state)."""
    import torch

    state = read_state(path)
    verify_checksums(path, what="checkpoint")  # a damaged file is an error naming it, never a garbled resume
    world = accelerator.num_processes
    if state.get("world_size", world) != world:
        raise DLMError(
            f"checkpoint '{path}' was written by {state.get('world_size')} processes but this run has "
            f"{world}; resume with the same number of processes (the data position is per process)"
        )
    try:
        accelerator.load_state(str(Path(path) / "training_state"))
    except Exception as e:  # noqa: BLE001 - torch/pickle raise many types for a damaged file; name the folder
        raise DLMError(
            f"cannot load the training state of checkpoint '{path}' ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); resume from an earlier checkpoint with "
            f"--resume PATH"
        ) from e
    rank_file = Path(path) / "training_state" / f"dlm_rank{accelerator.process_index}.pt"
    if not rank_file.is_file():
        raise DLMError(f"checkpoint '{path}' has no state for process {accelerator.process_index} ({rank_file.name})")
    try:
        rank_state = torch.load(rank_file, weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise DLMError(
            f"'{rank_file}' is damaged ({type(e).__name__}); resume from an earlier checkpoint with --resume PATH"
        ) from e
    return state, rank_state


def export_model(accelerator, dlm, wrapped, path: Path) -> None:
    """Write the model + tokenizer as a DLM Hugging Face folder at ``path`` (atomic; all processes call this).

    Single process, DDP and DeepSpeed ZeRO-1/2 hold full weights on every rank: the main process writes them.
    FSDP / ZeRO-3 shard the weights: the full state dict is gathered first.
    """
    from accelerate.utils import DistributedType

    with disk_full_as_error(
        path,
        "free some space and rerun the same command with --resume auto (the checkpoints written so far are intact)",
    ):
        _export(accelerator, dlm, wrapped, path, DistributedType)


def sharded_weights(accelerator) -> bool:
    """Whether the run's weights are sharded over its processes (FSDP, DeepSpeed ZeRO-3): no rank holds them whole."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP or (
        accelerator.distributed_type == DistributedType.DEEPSPEED
        and getattr(getattr(accelerator.state, "deepspeed_plugin", None), "zero_stage", 0) == 3
    )


def _export(accelerator, dlm, wrapped, path: Path, DistributedType) -> None:
    if sharded_weights(accelerator) and _has_adapters(dlm):
        # LoRA merges (and gated LoRA writes its adapters beside the base) through the model's own writer, which
        # needs whole tensors: every weight is gathered in place for the write (one rank's full copy, as DDP holds)
        with _whole_parameters(accelerator, wrapped):
            if accelerator.is_main_process:
                dlm.save_pretrained(path)
        return
    if sharded_weights(accelerator):
        full = accelerator.get_state_dict(wrapped)  # collective; full weights on the main process
        if accelerator.is_main_process:
            _save_from_state_dict(dlm, full, path)
        return
    if accelerator.is_main_process:
        dlm.save_pretrained(path)


def _has_adapters(dlm) -> bool:
    """Plain (peft) or gated LoRA: the model's own writer merges or writes them."""

    return get_gated(dlm) is not None or any(hasattr(m, "merge_and_unload") for m in (dlm.model, *dlm.model.children()))


@contextlib.contextmanager
def _whole_parameters(accelerator, wrapped):
    """The sharded model's parameters whole inside the block (on the main process at least), sharded again after
    it. DeepSpeed ZeRO-3: ``GatheredParameters`` on every rank. FSDP2: its full state dict gathered to the main
    process, whose modules hold those tensors in place of their sharded parameters for the block (the same
    parameter objects are put back after it; nothing runs the model in between)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(wrapped.parameters()), modifier_rank=None):
            yield
        return
    import torch

    full = accelerator.get_state_dict(wrapped)  # collective; the whole tensors on the main process
    kept: list[tuple[dict, str, torch.nn.Parameter]] = []
    if accelerator.is_main_process:
        for prefix, module in wrapped.named_modules():
            for name, param in list(module._parameters.items()):
                key = f"{prefix}.{name}" if prefix else name
                if param is not None and key in full:
                    kept.append((module._parameters, name, param))
                    module._parameters[name] = torch.nn.Parameter(full[key], requires_grad=param.requires_grad)
    try:
        yield
    finally:
        for params, name, param in kept:
            params[name] = param


def _save_from_state_dict(dlm, full: dict, path: Path) -> None:
    inner = {k[len("model.") :]: v for k, v in full.items() if k.startswith("model.")} or full

    with atomic_folder(path) as tmp:
        dlm.model.save_pretrained(tmp, state_dict=inner)
        if dlm.tokenizer is not None:
            dlm.tokenizer.save_pretrained(tmp)


def publish_final(src: Path, output_dir: Path) -> None:
    """Move the files of the exported model folder ``src`` into ``output_dir`` (which also holds the run's logs
    and checkpoints, so it is not replaced as a whole); ``config.json`` moves last, so the folder only looks like
    a model once the weights are in place."""
    output_dir.mkdir(parents=True, exist_ok=True)
    write_checksums(src)  # loading the model checks them: a file damaged later is an error naming it
    names = sorted(p.name for p in src.iterdir())
    for name in [n for n in names if n != "config.json"] + (["config.json"] if "config.json" in names else []):
        target = output_dir / name
        if target.is_dir() and not (src / name).is_dir():
            shutil.rmtree(target)
        os.replace(src / name, target)
    shutil.rmtree(src, ignore_errors=True)
