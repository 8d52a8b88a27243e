"""Uniform-noise ("renoising") block diffusion (DiffusionGemma), docs/algorithms.md#uniform-noise-diffusion.

The trained tokens of a row (labels != -100) are cut into canvases of ``block_size`` tokens, counted from the start
of each run of trained tokens (a response), as the decoder writes them after a prompt. Per sequence one noise
level ``t ~ U(noise_min, noise_max)``; each trained token is replaced by a token drawn uniformly from the
vocabulary with probability ``t`` (the noisy copy ``x_t``). One forward over ``[x_t | x0]`` (both halves at the
same positions) runs the two roles of the model's shared layers:

- a noisy token sees the noisy tokens of its own canvas (bidirectionally) and the clean tokens before its canvas's
  first position (the prompt and the earlier canvases, as the decoder sees the encoder's cache); its input
  embedding is mixed with the self-conditioning signal;
- a clean token sees the clean tokens before it (causal, as the encoder).

Loss = canvas loss + ``encoder_weight`` x context loss. The canvas loss is the cross-entropy of each trained
token's noisy-copy prediction against the clean token (every trained token, noised or not: the decoder cannot
tell which were replaced), averaged per sequence, times the sequence's weight (``constant``: 1; ``reweighted``:
``1 / (1 - t)``, the rectified-flow ELBO weight, clipped at ``weight_clip``), averaged over sequences. The
context loss is the clean half's next-token cross-entropy on the trained tokens (the encoder's causal loss).

Self-conditioning: with probability ``self_conditioning`` a sequence first runs a no-grad pass over the same
``[x_t | x0]``; the trained pass then mixes the soft embedding of that pass's canvas logits into its noisy tokens
(other sequences get a zero signal, as a canvas's first denoising step does).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from dlm.objectives import schedules
from dlm.objectives.base import IGNORE, Batch, Objective, ObjectiveOutput, zero_loss
from dlm.objectives.configs import RenoiseConfig


def canvases(b: Batch, trainable: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(canvas id [B, L], canvas start position [B, L])`` of each token: trained tokens are cut into canvases of
    ``size`` from the start of each run of trained tokens within a document (ids count from 1 in each row; 0 and
    the token's own position for the others)."""
    B, L = trainable.shape
    idx = torch.arange(L, device=trainable.device).expand(B, L)
    prev = torch.zeros_like(trainable)
    prev[:, 1:] = trainable[:, :-1]
    if b.doc_ids is not None:
        prev[:, 1:] &= b.doc_ids[:, 1:] == b.doc_ids[:, :-1]
    run_start = trainable & ~prev
    first = torch.where(run_start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    start = trainable & ((idx - first) % size == 0)
    ids = torch.where(trainable, start.long().cumsum(1), torch.zeros_like(idx))
    at = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return ids, torch.where(trainable, b.positions.gather(1, at), b.positions)


def renoise_mask(b: Batch, trainable: torch.Tensor, canvas: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The ``[B, 1, 2L, 2L]`` attention over ``[x_t | x0]`` (module doc); queries that attend nowhere else (an
    untrained noisy slot, padding) see themselves."""
    B, L = trainable.shape
    dev = trainable.device
    idx = torch.arange(L, device=dev)
    same_doc = torch.ones(B, L, L, dtype=torch.bool, device=dev)
    if b.doc_ids is not None:
        same_doc = b.doc_ids[:, :, None] == b.doc_ids[:, None, :]
    real = b.key_valid if b.key_valid is not None else torch.ones(B, L, dtype=torch.bool, device=dev)
    keys = same_doc & real[:, None, :]
    nn_ = trainable[:, :, None] & trainable[:, None, :] & (canvas[:, :, None] == canvas[:, None, :])
    nc = trainable[:, :, None] & keys & (b.positions[:, None, :] < starts[:, :, None])
    cc = keys & (idx[None, None, :] <= idx[None, :, None])
    eye = torch.eye(L, dtype=torch.bool, device=dev)[None]
    top = torch.cat([nn_ | (eye & ~trainable[:, :, None]), nc], dim=2)
    bottom = torch.cat([torch.zeros_like(cc), cc | eye], dim=2)
    return torch.cat([top, bottom], dim=1)[:, None]


class RenoiseObjective(Objective):
    name = "renoise"
    Config = RenoiseConfig

    def draw(self, b: Batch, trainable: torch.Tensor, vocab: int, generator=None):
        """This step's random draws: ``(t [B], x_t [B, L], self-conditioned [B])``."""
        c = self.config
        B, L = b.shape
        dev = b.input_ids.device
        t = c.noise_min + (c.noise_max - c.noise_min) * schedules._rand(B, generator, dev)
        noised = trainable & (schedules._rand((B, L), generator, dev) < t[:, None])
        gen_dev = generator.device if generator is not None else dev
        random_ids = torch.randint(0, vocab, (B, L), generator=generator, device=gen_dev).to(dev)
        x_t = torch.where(noised, random_ids, b.input_ids)
        sc = schedules._rand(B, generator, dev) < c.self_conditioning
        return t, x_t, sc

    def __call__(self, model, batch, step: int = 0, generator=None) -> ObjectiveOutput:
        b, t_build, _ = self.start(model, batch)
        trainable = b.labels != IGNORE
        vocab = int(model.base_model_hf.get_input_embeddings().weight.shape[0])
        t, x_t, sc = self.draw(b, trainable, vocab, generator)
        return self.loss(model, b, t, x_t, sc, build_s=time.perf_counter() - t_build)

    def loss(self, model, b: Batch, t, x_t, sc, build_s: float = 0.0) -> ObjectiveOutput:
        """The loss of batch ``b`` for given draws (noise levels ``t [B]``, noisy copy ``x_t [B, L]``, which
        sequences are self-conditioned ``sc [B]``): deterministic, so a test can check it against a reference."""
        c = self.config
        B, L = b.shape
        size = self.resolve_block_size(model, c.block_size)
        trainable = b.labels != IGNORE
        canvas, starts = canvases(b, trainable, size)
        mask = renoise_mask(b, trainable, canvas, starts)
        noisy = torch.cat([trainable, torch.zeros_like(trainable)], dim=1)
        ref = torch.cat([starts, b.positions], dim=1)
        kw = dict(
            input_ids=torch.cat([x_t, b.input_ids], 1),
            attention_mask=mask,
            position_ids=b.positions.repeat(1, 2),
            noisy=noisy,
            ref=ref,
        )
        lm = model.renoise
        if bool(sc.any()) and bool(trainable.any()):
            with torch.no_grad():
                first = model(**kw).logits[:, :L]
            soft = lm.soft_embeddings(first.detach()) * (sc[:, None, None] & trainable[:, :, None])
            kw["soft"] = torch.cat([soft, torch.zeros_like(soft)], dim=1)
        logits = model(**kw).logits
        n_tok = trainable.sum(1)
        if not bool(n_tok.any()):
            return ObjectiveOutput(loss=zero_loss(logits), parts={"build_s": build_s}, num_tokens=0)
        ce = F.cross_entropy(logits[:, :L].float().transpose(1, 2), b.input_ids, reduction="none")  # [B, L]
        per_seq = (ce * trainable).sum(1) / n_tok.clamp(min=1)
        weight = torch.ones_like(t) if c.weighting == "constant" else 1.0 / (1.0 - t).clamp(min=1e-12)
        if c.weight_clip is not None:
            weight = weight.clamp(max=float(c.weight_clip))
        rows = n_tok > 0
        canvas_loss = (weight * per_seq)[rows].mean()
        targets = b.shifted_targets()
        scored = targets != IGNORE
        loss = canvas_loss
        enc = torch.zeros((), device=logits.device)
        if c.encoder_weight > 0 and bool(scored.any()):
            enc = F.cross_entropy(logits[:, L:][scored].float(), targets[scored])
            loss = loss + c.encoder_weight * enc
        parts = {
            "canvas_ce": float(per_seq[rows].detach().mean()),
            "encoder_ce": float(enc.detach()),
            "t_mean": float(t[rows].mean()),
            "noise_frac": float(((x_t != b.input_ids) & trainable).sum()) / max(int(n_tok.sum()), 1),
            "self_cond_frac": float(sc.float().mean()),
            "build_s": build_s,
        }
        return ObjectiveOutput(loss=loss, parts=parts, num_tokens=int(n_tok.sum()))
