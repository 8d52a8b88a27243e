"""ISD's acceptance rules as pure functions: tensors and token ids in, the verdict out (docs/algorithms.md#isd).

- :func:`verify_greedy` / :func:`verify_sampled`: a run of single drafts d_1..d_{N-1}, checked left to right
  (greedy: accepted iff d_i is the argmax of p_i; sampling: :func:`accept_or_correct`, speculative sampling);
- :func:`greedy_candidate` / :func:`recursive_rejection`: K draft candidates for one position (greedy: the one
  equal to the AR token; sampling: recursive rejection over draws without replacement,
  :func:`draws_without_replacement`);
- :func:`fallback_branches`: the fallback choice, which outcomes of a verify step get masks for the next drafts;
- :func:`verify_forced`: tokens a structured output forces, fed after the pending token and verified as drafts
  proposed with certainty (``ar`` and ``isd``).

Each sampled rule emits a token with exactly the target distribution p, whatever q was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dlm.decode.sampling import SamplingParams, argmax_no_mask, probs_from_logits, sample


def accept_or_correct(p: torch.Tensor, q: torch.Tensor, d: int, u: float, generator: torch.Generator) -> int | None:
    """The single-draft rule (speculative sampling): draft ``d`` drawn from ``q`` [V] is accepted with probability
    min(1, p(d)/q(d)) for the uniform draw ``u`` (None: accepted); on a rejection the correction is drawn from
    normalize(max(0, p - q)) (:func:`~dlm.decode.isd.batch.accept_rows` is the same rule for a batch of rows). The token emitted (d or the correction) has distribution exactly ``p``."""
    if u * float(q[d]) < float(p[d]):  # q(d) > 0 because d was drawn from q
        return None
    residual = (p - q).clamp_(min=0.0)
    # drawn from the unnormalised residual (a draw is argmax(weights / Exp(1) noise): the scale does not matter,
    # and no sum whose rounding depends on the reduction's split); no mass left only if p == q, where rejection
    # has probability 0: guard against rounding anyway
    dist = residual if float(residual.max()) > 0 else p
    return int(sample(dist, generator))


def verify_greedy(drafts: Sequence[int], target: Sequence[int]) -> tuple[int, int | None]:
    """Greedy verification of drafts d_1..d_{N-1} against ``target`` (the argmax of p_1..p_N): (how many lead
    drafts equal their target, the correction ``target[accepted]`` at the first mismatch or None if all match)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return accepted, (target[accepted] if accepted < len(drafts) else None)


def verify_sampled(
    probs: torch.Tensor, q: torch.Tensor, drafts: Sequence[int], generator: torch.Generator
) -> tuple[int, int | None]:
    """Sampled verification of drafts d_1..d_{N-1} drawn from ``q`` [N-1, V] against the target ``probs``
    [>= N-1, V] (row i is p_{i+1}): :func:`accept_or_correct` left to right, one uniform draw per draft taken up
    front. Returns (drafts accepted, the correction drawn at the first rejection or None if all are accepted)."""
    u = torch.rand(len(drafts), generator=generator)
    for i, d in enumerate(drafts):
        correction = accept_or_correct(probs[i], q[i], d, float(u[i]), generator)
        if correction is not None:
            return i, correction
    return len(drafts), None


def draws_without_replacement(q: torch.Tensor, first: int, k: int, generator: torch.Generator) -> list[int]:
    """``first`` (already drawn from q), then up to k-1 more from q without replacement (fewer if q has fewer
    tokens with mass, e.g. after top-k/top-p)."""
    rest = q.clone()
    out = [first]
    for _ in range(k - 1):
        rest[out[-1]] = 0.0
        total = float(rest.sum())
        if total <= 0:
            break
        out.append(int(sample(rest / total, generator)))
    return out


def greedy_candidate(cands: Sequence[int], target: int) -> int | None:
    """Greedy candidate verification: the index of the candidate equal to the AR token ``target`` (None: none)."""
    return cands.index(target) if target in cands else None


def recursive_rejection(
    p: torch.Tensor, q: torch.Tensor, cands: Sequence[int], generator: torch.Generator
) -> tuple[int | None, int]:
    """One token with distribution exactly ``p`` [V] from candidates drawn from ``q`` [V] without replacement
    (``cands[j]`` from q_j: q with the earlier candidates removed and renormalised): recursive rejection sampling
    (Jeon et al. 2024, the without-replacement form of SpecInfer's multi-draft sampling). Candidate j is accepted
    with probability min(1, r_j(d^j) / q_j(d^j)), where r_1 = p and a rejection leaves r_{j+1} =
    normalize(max(0, r_j - q_j)); if every candidate is rejected the token is drawn from the last residual. Each
    step is the single-draft rule with target r_j and proposal q_j, whatever the earlier draws were, so the token
    has distribution p. Returns (index of the accepted candidate or None, token)."""
    rest = q.clone()  # q without the candidates before j (unnormalised)
    r = p
    u = torch.rand(len(cands), generator=generator)
    for j, d in enumerate(cands):
        qj = rest / rest.sum()
        if float(u[j]) * float(qj[d]) < float(r[d]):
            return j, d
        r = (r - qj).clamp_(min=0.0)
        total = float(r.sum())
        # total == 0 only if r == q_j, where rejection has probability 0; guard against rounding anyway
        r = r / total if total > 0 else p
        rest[d] = 0.0
    return None, int(sample(r, generator))


def fallback_branches(fallback: str, n: int, p_accept: Sequence[float]) -> tuple[int, ...]:
    """Which outcomes of a verify step at stride ``n`` get their N-1 masks (0: every draft accepted; i: first
    rejection at d_i). ``'off'``: (0,); ``'all'``: every outcome; ``'predict'``: the likeliest by the drafts'
    acceptance probabilities ``p_accept`` (a_1..a_{N-1}): P(0) = prod a_i, P(i) = a_1 .. a_{i-1} (1 - a_i);
    all-accepted wins a tie."""
    if fallback == "off":
        return (0,)
    if fallback == "all":
        return tuple(range(n))
    best, p_best, run = 0, 0.0, 1.0
    for i, a in enumerate(p_accept, start=1):
        if run * (1.0 - a) > p_best:
            best, p_best = i, run * (1.0 - a)
        run *= a
    return (0,) if run >= p_best else (best,)


def verify_forced(
    logits: torch.Tensor,
    ahead: list[int],
    params: SamplingParams,
    mask_token_id: int | None,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """A chunk ``[c, f_1..f_k]`` of forced tokens after the pending token c: ``logits[j]`` is p at f_{j+1}'s position
    (``logits[k]`` after f_k). The forced tokens are drafts proposed with certainty (q one-hot): greedy keeps the
    leading ones that are the argmax, sampling accepts each with probability p(f), and the first refused is
    replaced by a draw from p without it (the free token after all k). Returns (the committed tokens, how many
    chunk tokens keep their KV)."""
    k = len(ahead)
    if params.greedy:
        target = argmax_no_mask(logits[: k + 1], mask_token_id).tolist()
        accepted, correction = verify_greedy(ahead, target)
        last = correction if correction is not None else target[k]
    else:
        probs = probs_from_logits(logits[: k + 1], params, mask_token_id)
        q = torch.zeros(k, probs.shape[-1], device=probs.device)
        q[torch.arange(k, device=probs.device), torch.tensor(ahead, device=probs.device)] = 1.0
        accepted, correction = verify_sampled(probs, q, ahead, generator)
        last = correction if correction is not None else int(sample(probs[k], generator))
    return ahead[:accepted] + [last], accepted + 1
