"""Masked diffusion (MDLM / LLaDA / DiffuLLaMA), docs/algorithms.md#masked-diffusion.

Per sequence ``t ~ U(eps, 1)``; each trainable token is replaced by the mask id with probability t; the loss is
the CE of the masked tokens weighted by ``1 / t`` (not t: DiffuLLaMA's 7B script had that bug), divided by the
number of masked tokens (``normalize='masked'``, DiffuLLaMA) or of trainable tokens (``'all'``, MDLM).

With ``shift`` (DiffuLLaMA) logits at i score token i+1 where i+1 was masked; the first token of each document
is then never masked (nothing could predict it). Without shift (LLaDA) logits at i score token i.
Attention: ``annealed`` (causal -> full over ``anneal_steps`` optimizer steps, one Bernoulli draw per forward)
or ``full`` from step 0. With an attention kernel that cannot take a mask (flash_attention_2), only ``full`` on
unpacked, unpadded rows works: it is passed as ``is_causal=False``.
"""

from __future__ import annotations

import time

import torch

from dlm.errors import DLMError
from dlm.model import masks
from dlm.objectives import schedules
from dlm.objectives.base import IGNORE, Objective, ObjectiveOutput, token_ce, zero_loss
from dlm.objectives.configs import MDMConfig


def weighted_loss(ce: torch.Tensor, weight: torch.Tensor, n_masked: int, n_all: int, normalize: str):
    """``sum(ce / t) / denominator``: the masked-token count or the trainable-token count."""
    denom = n_masked if normalize == "masked" else n_all
    return (ce * weight).sum() / max(denom, 1)


def score_positions(masked: torch.Tensor, labels: torch.Tensor, shift: bool, next_ok: torch.Tensor):
    """Where the logits are scored and against what: ``(where [B, L] bool, targets [B, L])``."""
    if not shift:
        return masked, labels
    where = torch.zeros_like(masked)
    where[:, :-1] = masked[:, 1:] & next_ok[:, :-1]
    targets = torch.full_like(labels, IGNORE)
    targets[:, :-1] = labels[:, 1:]
    return where, targets


class MDMObjective(Objective):
    name = "mdm"
    Config = MDMConfig

    def __call__(self, model, batch, step: int = 0, generator=None) -> ObjectiveOutput:
        c = self.config
        b, t_build, maskable = self.start(model, batch, unmasked_ok=c.attention == "full")
        B, L = b.shape
        if not maskable and (b.doc_ids is not None or b.key_valid is not None):
            attn_impl = getattr(model.hf_config, "_attn_implementation", None)
            raise DLMError(
                f"attention implementation '{attn_impl}' cannot take a custom mask, so packed rows "
                f"(doc_ids) and padding cannot be kept apart; use attn_implementation='sdpa' or "
                f"unpadded, unpacked rows"
            )
        shift = self.resolve_shift(model, c.shift)
        trainable = b.labels != IGNORE
        next_ok = b.same_doc_next()
        if shift:  # a token is maskable only if a same-document predecessor can predict it
            prev_ok = torch.zeros_like(trainable)
            prev_ok[:, 1:] = next_ok[:, :-1]
            trainable = trainable & prev_ok
        t = schedules.sample_t(B, c.eps, c.antithetic, generator, model.device)  # [B]
        x_t, masked = schedules.mask_tokens(b.input_ids, trainable, t[:, None], model.mask_token_id, generator)
        p = schedules.anneal_p(step, c.anneal_steps) if c.attention == "annealed" else 1.0
        attn_kw = {}
        if not maskable:  # flash kernels: full attention through is_causal=False (docs/algorithms.md#annealed-attention, DiffuLLaMA-7B)
            attn_kw["is_causal"] = False
        elif p >= 1.0:
            attn_kw["attention_mask"] = self.attn_mask(model, masks.full(b.doc_ids, b.key_valid), B, L)
        else:
            mod = masks.annealed(L, p, generator, b.doc_ids, b.key_valid, device=model.device)
            attn_kw["attention_mask"] = self.attn_mask(model, mod, B, L)
        where, targets = score_positions(masked, b.labels, shift, next_ok)
        build_s = time.perf_counter() - t_build

        logits = model(input_ids=x_t, position_ids=b.positions, **attn_kw).logits
        ce = token_ce(logits, targets, where)
        weight = (1.0 / t)[:, None].expand(B, L)[where]
        n_masked, n_all = int(where.sum()), int(trainable.sum())
        loss = weighted_loss(ce, weight, n_masked, n_all, c.normalize) if n_masked else zero_loss(logits)
        parts = {
            "ce": float(ce.detach().mean()) if n_masked else 0.0,
            "t_mean": float(t.mean()),
            "mask_frac": n_masked / max(n_all, 1),
            "p_anneal": p,
            "build_s": build_s,
        }
        return ObjectiveOutput(loss=loss, parts=parts, num_tokens=n_masked)
