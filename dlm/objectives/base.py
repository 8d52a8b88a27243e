"""The objective interface shared by every training objective, and the batch plumbing they have in common.

Contract (used by the trainer)::

    objective = get_objective("idlm", block_size=2, ce_alpha=0.2)
    out = objective(model, batch, step=step, generator=gen)   # -> ObjectiveOutput
    out.loss.backward()

``batch``: ``input_ids`` LongTensor [B, L]; ``labels`` LongTensor [B, L] aligned with input_ids (not shifted;
-100 = not trained); optional ``doc_ids`` LongTensor [B, L] (document index per token of packed rows; attention
never crosses documents and positions restart at 0 in every document); optional ``attention_mask`` [B, L]
(1 real, 0 padding; padding is never trained and never attended). Objectives do any shifting themselves.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dlm.errors import DLMError
from dlm.model import masks
from dlm.model.convert import MASKABLE_ATTN

IGNORE = -100


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # scalar, to backward
    parts: dict[str, float] = field(default_factory=dict)  # named parts for logging
    num_tokens: int = 0  # tokens that carried loss


@dataclass
class Batch:
    """A validated batch on the model's device."""

    input_ids: torch.Tensor  # [B, L]
    labels: torch.Tensor  # [B, L], -100 where not trained (padding forced to -100)
    doc_ids: torch.Tensor | None  # [B, L]
    key_valid: torch.Tensor | None  # [B, L] bool
    positions: torch.Tensor  # [B, L] position ids (restart per document; skip left padding)

    @property
    def shape(self):
        return self.input_ids.shape

    def same_doc_next(self) -> torch.Tensor:
        """[B, L] bool: position i has a next token i+1 in the same document (and i+1 is not padding)."""
        B, L = self.shape
        ok = torch.zeros(B, L, dtype=torch.bool, device=self.input_ids.device)
        if L > 1:
            nxt = torch.ones(B, L - 1, dtype=torch.bool, device=ok.device)
            if self.doc_ids is not None:
                nxt &= self.doc_ids[:, 1:] == self.doc_ids[:, :-1]
            if self.key_valid is not None:
                nxt &= self.key_valid[:, 1:] & self.key_valid[:, :-1]
            ok[:, :-1] = nxt
        return ok

    def shifted_targets(self) -> torch.Tensor:
        """[B, L]: the target of position i is label i+1 (same document only); -100 elsewhere and at the end."""
        tgt = torch.full_like(self.labels, IGNORE)
        tgt[:, :-1] = self.labels[:, 1:]
        return torch.where(self.same_doc_next(), tgt, torch.full_like(tgt, IGNORE))


class Objective:
    """Base class: ``name``, a ``Config`` dataclass, and ``__call__(model, batch, step, generator)``."""

    name: str = ""
    Config: type = object

    def __init__(self, **config):
        fields = {f.name for f in dataclasses.fields(self.Config)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise DLMError(f"unknown setting(s) {unknown} for objective '{self.name}': valid ones are {sorted(fields)}")
        self.config = self.Config(**config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    def __call__(
        self, model, batch: dict, step: int = 0, generator: torch.Generator | None = None
    ) -> ObjectiveOutput:  # pragma: no cover
        raise NotImplementedError

    # -- checks shared by the objectives ----------------------------------------------------------------------
    def start(self, model, batch: dict, unmasked_ok: bool = False):
        """Every objective's first lines: ``(batch on the model's device, its build start time, whether the model
        takes custom masks)``, after :meth:`check_model`."""
        t_build = time.perf_counter()
        b = prepare_batch(batch, model.device)
        maskable = self.check_model(model, b.shape[1], unmasked_ok=unmasked_ok)
        return b, t_build, maskable

    def check_model(self, model, L: int, unmasked_ok: bool = False) -> bool:
        """Validate model vs objective; returns whether the model takes custom masks (``unmasked_ok``: the
        caller can run without one, i.e. full attention through ``is_causal=False``)."""
        objective = model.objective
        if objective != self.name:
            raise DLMError(
                f"the model was converted for objective '{objective}' but training uses "
                f"'{self.name}'; convert it with `dlm convert --objective {self.name}` or train with "
                f"objective: {objective}"
            )
        attn = getattr(model.hf_config, "_attn_implementation", None)
        maskable = attn in masks_ok()
        if not maskable and not unmasked_ok:
            raise DLMError(
                f"attention implementation '{attn}' of {type(model.base_model_hf).__name__} cannot take "
                f"the custom attention masks objective '{self.name}' needs; load the model with "
                f"attn_implementation='sdpa' (or 'eager' / 'flex_attention')"
            )
        limit = model.max_positions
        if limit is not None and L > limit:
            raise DLMError(
                f"sequence length {L} is longer than the model's {limit} positions "
                f"(max_position_embeddings); use a block/sequence length of at most {limit}"
            )
        return maskable

    @staticmethod
    def attn_mask(model, mask_mod, B: int, Q: int, K: int | None = None):
        """``mask_mod`` in the form the model's attention implementation takes (dense for SDPA/eager, a
        ``BlockMask`` for flex attention)."""
        return masks.build(
            mask_mod, B, Q, K, device=model.device, attn_impl=getattr(model.hf_config, "_attn_implementation", None)
        )

    def resolve_block_size(self, model, block_size: int | None) -> int:
        ckpt = model.block_size
        if block_size is None:
            if ckpt is None:
                raise DLMError(
                    f"objective '{self.name}' needs block_size and the checkpoint has none; "
                    f"convert with `dlm convert --objective {self.name} --block-size B`"
                )
            return int(ckpt)
        if not isinstance(block_size, int) or block_size < 1:
            raise DLMError(f"block_size must be a positive integer, got {block_size!r}")
        if ckpt is not None and int(ckpt) != block_size:
            raise DLMError(
                f"block_size {block_size} does not match the checkpoint's block_size {ckpt} "
                f"(config.json); set block_size: {ckpt} or re-convert with --block-size {block_size}"
            )
        return block_size

    @staticmethod
    def resolve_shift(model, shift: bool | None) -> bool:
        if shift is not None and bool(shift) != model.shift:
            raise DLMError(
                f"shift={shift} does not match the checkpoint's shift={model.shift} (config.json); "
                f"drop the setting or re-convert with --{'no-' if not shift else ''}shift"
            )
        return model.shift


def masks_ok():
    return MASKABLE_ATTN


def prepare_batch(batch: dict, device) -> Batch:
    """Validate a batch dict and move it to ``device``; padding positions never carry labels."""
    for key in ("input_ids", "labels"):
        if key not in batch:
            raise DLMError(f"the training batch has no '{key}' (got keys {sorted(batch)})")
    input_ids = batch["input_ids"].to(device)
    labels = batch["labels"].to(device)
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise DLMError(
            f"batch input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both be "
            f"[B, L] (labels aligned with input_ids, not shifted)"
        )
    doc_ids = batch.get("doc_ids")
    doc_ids = doc_ids.to(device).long() if doc_ids is not None else None
    key_valid = batch.get("attention_mask")
    if key_valid is not None:
        key_valid = key_valid.to(device).bool()
        if key_valid.all():
            key_valid = None
        else:
            labels = torch.where(key_valid, labels, torch.full_like(labels, IGNORE))
    if doc_ids is not None:
        positions = masks.doc_positions(doc_ids)
    elif key_valid is not None:
        positions = (key_valid.long().cumsum(1) - 1).clamp(min=0)  # left padding: real tokens start at 0
    else:
        positions = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
    return Batch(input_ids, labels, doc_ids, key_valid, positions)


def token_ce(logits: torch.Tensor, targets: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """CE (fp32) of ``logits[where]`` against ``targets[where]``: a 1D tensor, one value per selected token."""
    sel = upcast(logits[where])
    return F.cross_entropy(sel, targets[where], reduction="none") if sel.numel() else sel.sum(-1)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """fp32 for the softmax/CE of half-precision logits; float64 stays float64."""
    return x if x.dtype == torch.float64 else x.float()


def zero_loss(logits: torch.Tensor) -> torch.Tensor:
    """A zero that keeps the graph (no token carried loss in this batch)."""
    return logits.sum() * 0.0
