"""ISD's proposer: drafts (and their distributions q) from the logits of the masks, one draft per mask or K draft
candidates for the first. Pure: logits and sampling settings in, a :class:`Proposal` out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlm.decode.isd.accept import draws_without_replacement
from dlm.decode.isd.policy import candidate_count
from dlm.decode.sampling import (
    SamplingParams,
    argmax_no_mask,
    greedy_with_prob,
    probs_from_logits,
    sample,
    suppress,
)


@dataclass
class Proposal:
    drafts: list[int]  # one per mask
    q: torch.Tensor | None  # [masks, V]: their distributions (None when greedy)
    cands: list[int] | None  # the candidates for the first mask's position (None: one draft, candidates == 1)
    conf: list[float] | None  # each draft's probability under its own distribution (None: not asked for)


def propose(
    mask_logits: torch.Tensor,
    params: SamplingParams,
    mask_token_id: int | None,
    generator: torch.Generator,
    *,
    draft: str = "sample",
    candidates: int = 1,
    min_prob: float = 0.0,
    conf: bool = False,
) -> Proposal:
    """Drafts from ``mask_logits`` [masks, V]. Greedy: the argmax (never the mask token); sampling: draws from q
    (``draft='argmax'``: its argmax, biased). ``candidates`` K > 1: up to K candidates for the first position, as
    many as :func:`candidate_count` gives from the mask's distribution (greedy: its top ones; sampling: the first
    draw, then draws without replacement; argmax: the top ones). ``conf``: also each draft's own probability, where
    one draft per position is verified."""
    k = candidates
    cands = None
    own = None
    if params.greedy:
        q = None
        if k > 1:  # (never the suppressed mask token, even when K reaches the vocabulary's size)
            logits = suppress(mask_logits, mask_token_id)
            top = logits[0].topk(min(k, logits.shape[-1] - 1))
            k = candidate_count((top.values.float() - logits[0].float().logsumexp(-1)).exp(), min_prob)
            cands = top.indices[:k].tolist()
        if conf and k == 1:
            d, probs = greedy_with_prob(mask_logits, mask_token_id)
            own = probs.tolist()
        else:
            d = argmax_no_mask(mask_logits, mask_token_id)
    else:
        q = probs_from_logits(mask_logits, params, mask_token_id)
        d = q.argmax(-1) if draft == "argmax" else sample(q, generator)
        if k > 1:  # draws without replacement (recursive_rejection verifies them exactly); argmax: top k
            # how many: from q alone, before any draw (a count that depended on the draws would bias them)
            top = q[0].topk(min(k, q.shape[-1]))
            k = candidate_count(top.values, min_prob)
            cands = (
                top.indices[:k].tolist()
                if draft == "argmax"
                else draws_without_replacement(q[0], int(d[0]), k, generator)
            )
        if conf and k == 1:
            own = q.gather(-1, d[:, None])[:, 0].tolist()
    return Proposal(d.tolist(), q, cands, own)
