"""Block diffusion (BD3-LM / SDAR), docs/algorithms.md#block-diffusion.

Input ``[x_t | x0]`` (2L tokens, both halves with the same position ids) under the block-diffusion mask:
noisy tokens see their own noisy block (bidirectionally) and the clean blocks before it; clean tokens are
block-causal. Only the noisy half is scored: masked tokens, 1/t weighted, normalised like ``mdm``. ``t`` per
sample (SDAR) or per block (BD3-LM). ``block_size`` must be the checkpoint's. SDAR uses no shift; with a shifted
checkpoint logits at i score token i+1.
"""

from __future__ import annotations

import time

import torch

from dlm.model import masks
from dlm.objectives import schedules
from dlm.objectives.base import IGNORE, Objective, ObjectiveOutput, token_ce, zero_loss
from dlm.objectives.configs import BlockConfig
from dlm.objectives.mdm import score_positions, weighted_loss


def block_run_ids(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, L] index of the (document, block) run each token belongs to, counted from 0 in every row."""
    start = positions % block_size == 0
    start[:, 0] = True
    return start.long().cumsum(1) - 1


class BlockObjective(Objective):
    name = "block"
    Config = BlockConfig

    def __call__(self, model, batch, step: int = 0, generator=None) -> ObjectiveOutput:
        c = self.config
        b, t_build, _ = self.start(model, batch)
        B, L = b.shape
        bs = self.resolve_block_size(model, c.block_size)
        shift = self.resolve_shift(model, c.shift)
        trainable = b.labels != IGNORE
        next_ok = b.same_doc_next()
        if shift:
            prev_ok = torch.zeros_like(trainable)
            prev_ok[:, 1:] = next_ok[:, :-1]
            trainable = trainable & prev_ok
        if c.t_per == "sample":
            t_tok = schedules.sample_t(B, c.eps, c.antithetic, generator, model.device)[:, None].expand(B, L)
        else:
            t_blocks = schedules.sample_t((B, L), c.eps, c.antithetic, generator, model.device)
            t_tok = t_blocks.gather(1, block_run_ids(b.positions, bs))
        x_t, masked = schedules.mask_tokens(b.input_ids, trainable, t_tok, model.mask_token_id, generator)
        attn = self.attn_mask(
            model, masks.block_diffusion(L, bs, b.doc_ids, b.key_valid, device=model.device), B, 2 * L
        )
        where, targets = score_positions(masked, b.labels, shift, next_ok)
        if shift:  # the weight of a scored pair is the t of the masked token it predicts
            w_tok = torch.ones_like(t_tok)
            w_tok[:, :-1] = t_tok[:, 1:]
        else:
            w_tok = t_tok
        build_s = time.perf_counter() - t_build

        logits = model(
            input_ids=torch.cat([x_t, b.input_ids], 1), attention_mask=attn, position_ids=b.positions.repeat(1, 2)
        ).logits
        noisy = logits[:, :L]
        ce = token_ce(noisy, targets, where)
        n_masked, n_all = int(where.sum()), int(trainable.sum())
        loss = weighted_loss(ce, 1.0 / w_tok[where], n_masked, n_all, c.normalize) if n_masked else zero_loss(logits)
        parts = {
            "ce": float(ce.detach().mean()) if n_masked else 0.0,
            "t_mean": float(t_tok[trainable].mean()) if n_all else 0.0,
            "mask_frac": n_masked / max(n_all, 1),
            "build_s": build_s,
        }
        return ObjectiveOutput(loss=loss, parts=parts, num_tokens=n_masked)
