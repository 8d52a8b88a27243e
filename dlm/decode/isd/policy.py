"""ISD's drafting policy: the stride, when a step drafts (:mod:`dlm.decode.schedule`'s policies, chosen by
``draft_budget``), how many draft candidates a step verifies, and the calibration that ``fallback='predict'``
routes on (:class:`AcceptCalibration`)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from dlm.decode.configs import CANDIDATE_MIN_PROB, DRAFT_MODES
from dlm.decode.cpu.choice import machine_key
from dlm.decode.schedule import AlwaysDraft, MeasuredDraft, PolicyMemory, TokenBudget, make_policy

__all__ = [
    "CANDIDATE_MIN_PROB",
    "DRAFT_MODES",
    "AcceptCalibration",
    "AlwaysDraft",
    "DraftPolicy",
    "MeasuredDraft",
    "PolicyMemory",
    "TokenBudget",
    "candidate_count",
    "default_stride",
    "make_policy",
    "memory_key",
    "supported_strides",
]

# CANDIDATE_MIN_PROB (ISDConfig.candidate_min_prob's default, dlm.decode.configs): draft candidates beyond the first
# are verified only where the mask gives them at least this probability: each
# costs two chunk tokens, and a 2% candidate is rarely the one. Measured on the gated 30-minute quickstart
# checkpoint (609 verify steps of 16 held-out prompts, greedy, batch 1; per-forward costs of 4/6/8-token chunks
# 1.22x/1.28x/1.38x an AR step on a 2-core CPU): speed vs AR 1.14x for K=3 always (TPF 1.58), 1.16x / 1.18x / 1.16x
# with a 0.05 / 0.1 / 0.2 threshold (TPF 1.55 / 1.48 / 1.41). 0.05 keeps most of the TPF, which is what a device
# with cheaper chunk tokens (a GPU) turns into speed; 0 verifies all K every step.


@runtime_checkable
class DraftPolicy(Protocol):
    """When a decode step drafts (:mod:`dlm.decode.schedule`): asked before each step, told its cost after. An
    answer is a bool (draft at the decoder's stride, or not) or a stride (2 .. the decoder's; 0: a plain AR
    step)."""

    def drafting(self, rows: int) -> bool | int: ...

    def peek(self, rows: int) -> bool | int: ...

    def observe(self, rows: int, drafted: bool | int, seconds: float, tokens: int) -> None: ...


def supported_strides(block_size: int | None) -> list[int]:
    """Strides an I-DLM trained with ``block_size`` masks per block was trained for: 2..block_size+1 (a shorter
    run of masks is a prefix of a trained block)."""
    return list(range(2, (block_size or 1) + 2))


def default_stride(block_size: int | None, candidates: int = 1) -> int:
    """The stride ISD runs at when none is given: the model's trained ``block_size + 1``, or 2 with draft
    candidates (they run at stride 2 only)."""
    return 2 if candidates > 1 else (block_size or 1) + 1


def candidate_count(top_probs: torch.Tensor, min_prob: float) -> int:
    """How many candidates a step verifies: 1 + those of the 2nd..K-th likeliest drafts (``top_probs``,
    descending) with probability >= ``min_prob``. Taken from q alone, before any draw (a count that depended on
    the draws would bias them)."""
    return 1 + int((top_probs[1:] >= min_prob).sum())


class AcceptCalibration:
    """How often a draft at position i with probability c under its own distribution is accepted, learned from the
    verify steps so far: per position and tenth of c, hits and trials (halved past ``cap`` trials, so it follows
    drift), with c itself as a prior worth ``prior`` trials. A model's drafts need not be calibrated (a masked
    position trained on hard labels may be right at c = 0.2 every time); the counts correct that within a few
    steps."""

    def __init__(self, bins: int = 10, prior: float = 2.0, cap: int = 256):
        self.bins, self.prior, self.cap = bins, prior, cap
        self.counts: dict[tuple[int, int], list[float]] = {}

    def _bin(self, c: float) -> int:
        return min(max(int(c * self.bins), 0), self.bins - 1)

    def p_accept(self, i: int, c: float) -> float:
        hits, n = self.counts.get((i, self._bin(c)), (0.0, 0.0))
        return (hits + self.prior * c) / (n + self.prior)

    def observe(self, i: int, c: float, accepted: bool) -> None:
        cell = self.counts.setdefault((i, self._bin(c)), [0.0, 0.0])
        cell[0] += accepted
        cell[1] += 1
        if cell[1] > self.cap:
            cell[0] /= 2
            cell[1] /= 2

    def observe_verify(self, conf: list[float], proposed: int, accepted: int) -> None:
        """A verify step checked the first ``proposed`` drafts (own probabilities ``conf``) and accepted the first
        ``accepted``."""
        for i in range(proposed):
            self.observe(i, conf[i], i < accepted)


def memory_key(engine, setting: str) -> str | None:
    """Where :class:`PolicyMemory` keeps what the measured policy learnt: the model folder (its path, and the size
    and modification time of its config and weight files: a retrained folder is a new model), the machine (on a
    CPU: its model, the kernels' ISA (and their activations where not fp32) or 'stock', torch and its threads -
    :func:`dlm.decode.cpu.choice.machine_key`; else the device's name) and ``setting`` (the decoder's stride, fallback, candidates). None for a model that
    was not loaded from a folder (nothing to recognise it by next time)."""
    name = getattr(engine.config, "_name_or_path", "") or ""
    folder = Path(name)
    if not name or not folder.is_dir():
        return None
    stamps = []
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")) + [folder / "config.json"]:
        try:
            st = f.stat()
        except OSError:
            continue
        stamps.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    model = hashlib.sha1("|".join([str(folder.resolve()), *stamps]).encode()).hexdigest()[:16]
    if engine.device.type == "cpu":
        kernels = engine.kernels
        isa = kernels.choice.isa if kernels and kernels.choice is not None else "stock"
        acts = getattr(getattr(kernels, "options", None), "activations", "f32") if kernels else "f32"
        machine = machine_key(isa if acts == "f32" else f"{isa}+{acts}")  # int8 activations: other step costs
    else:
        machine = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else engine.device.type
    return "|".join([model, machine, setting])
