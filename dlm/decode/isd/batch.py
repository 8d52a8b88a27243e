"""ISD's verify-and-accept for all rows of a decode step at once, on the logits' device (docs/algorithms.md#isd).

The per-row rules (:mod:`~dlm.decode.isd.accept`, :func:`~dlm.decode.isd.draft.propose`) as batched torch ops:
each row's accepted count, the token it emits (the correction at the first rejection, the free token when every
draft is accepted, or the next token of a cold start / AR step) and its next drafts (from the masks of the outcome
that happened, when the chunk carried them) come out of one call as one small tensor, so a step moves a few
numbers per row to the host instead of logits.

Every row is one case of the same computation: ``n_drafts`` drafts to verify (0 for a cold start or an AR step),
the target distributions at chunk positions 0..n_drafts, the token drawn from position ``accepted``, and the next
drafts from the window of masks that ``windows[accepted]`` names (-1: none).

Randomness: the rows' draws come from their own generators, in the order the per-row path takes them (see
:func:`draws`); a draw of torch.multinomial for one token is argmax(p / E) with E ~ Exp(1) drawn over p's shape
(torch's own algorithm), so the noise is drawn per row and the argmax taken here, batched. Bit for bit the
per-row path's tokens (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlm.decode.sampling import SamplingParams, argmax_no_mask, greedy_with_prob, probs_from_logits


@dataclass
class Draws:
    """One group's random draws, per row in the per-row path's order: ``u`` [g, n-1] the uniform draws of the
    verify rows' acceptance tests, ``token`` [g, V] the Exp(1) noise of the emitted token's draw, ``draft``
    [g, n-1, V] that of the next drafts (None: argmax drafts, or no row drafts)."""

    u: torch.Tensor | None
    token: torch.Tensor
    draft: torch.Tensor | None


def draws(
    generators: list[torch.Generator],
    verify: list[bool],
    may_draft: list[bool],
    sure_draft: list[bool],
    n: int,
    vocab: int,
    sample_drafts: bool,
) -> tuple[Draws, list[torch.Tensor | None]]:
    """Each row's draws from its own generator, in the per-row path's order: the acceptance test's uniforms
    (``torch.rand(n-1)``, verify rows only), the emitted token's noise (what ``torch.multinomial`` draws for one
    token over ``vocab``), then the next drafts' noise over ``[n-1, vocab]`` (``sample_drafts`` and
    ``may_draft``). Returns the draws and, per row, the generator's state before the drafts' noise (None where it
    was not drawn, or where the row drafts whatever the outcome, ``sure_draft``): a row whose outcome then has no drafts puts it
    back (:func:`rewind`), so its stream is the per-row path's."""
    g = len(generators)
    dev = generators[0].device if g else torch.device("cpu")
    u = torch.zeros(g, max(n - 1, 1), device=dev) if any(verify) else None
    token = torch.empty(g, vocab, device=dev)
    draft = torch.empty(g, n - 1, vocab, device=dev) if sample_drafts and any(may_draft) else None
    saved: list[torch.Tensor | None] = [None] * g
    for j, gen in enumerate(generators):
        if gen.device != dev:  # a generator elsewhere draws on its own device (as the per-row path would)
            if verify[j] and u is not None:
                u[j, : n - 1].copy_(torch.rand(n - 1, generator=gen, device=gen.device))
            token[j].copy_(torch.empty(vocab, device=gen.device).exponential_(generator=gen))
            if draft is not None and may_draft[j]:
                saved[j] = None if sure_draft[j] else gen.get_state()
                draft[j].copy_(torch.empty(n - 1, vocab, device=gen.device).exponential_(generator=gen))
            continue
        if verify[j] and u is not None:
            u[j, : n - 1].uniform_(generator=gen)  # torch.rand(n - 1) on the same stream
        token[j].exponential_(generator=gen)
        if draft is not None and may_draft[j]:
            saved[j] = None if sure_draft[j] else gen.get_state()
            draft[j].exponential_(generator=gen)
    return Draws(u, token, draft), saved


def rewind(generator: torch.Generator, state: torch.Tensor | None) -> None:
    """Undo a row's drafts' noise (its outcome drafted nothing): the generator as the per-row path leaves it."""
    if state is not None:
        generator.set_state(state)


@dataclass
class VerifyGroup:
    """What one verify-and-accept needs of a group of ``g`` rows besides their logits (see :func:`accept_rows`)."""

    n: int
    """The stride."""
    n_drafts: torch.Tensor
    """[g] long: drafts each row verifies (n-1, or 0 for a cold start / AR step)."""
    drafts: torch.Tensor | None = None
    """[g, n-1] long (None: no row verifies)."""
    windows: torch.Tensor | None = None
    """[g, n] long: for each accepted count a = 0..n-1, the chunk index of the first of the N-1 masks that give the
    row's next drafts, -1 where the chunk did not carry that outcome's masks (None: no row drafts)."""
    q: torch.Tensor | None = None
    """[R, n-1, V]: the verify rows' drafts' distributions (sampling)."""
    q_rows: torch.Tensor | None = None
    """Row j's distributions are ``q[q_rows[j]]``."""
    rand: Draws | None = None
    """The group's :func:`draws` (sampling)."""


def accept_rows(
    logits: torch.Tensor,
    params: SamplingParams,
    mask_token_id: int | None,
    group: VerifyGroup,
    draft: str = "sample",
    conf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One verify-and-accept for a group of ``g`` rows with the same sampling settings ``params``.

    ``logits`` [g, Q, V]: the rows' chunk logits (position 0 at each row's pending token); ``group``: their drafts,
    next-draft windows, drafts' distributions and draws (:class:`VerifyGroup`); ``draft``: 'sample' or 'argmax';
    ``conf``: also each next draft's probability under its own distribution.

    Returns ``out`` [g, 2 + 2 (n-1)] float64: accepted count, emitted token, the next drafts, their
    probabilities (0 where not asked for), and the next drafts' distributions [g, n-1, V] (sampling, else None).
    A greedy row accepts d_i iff it is the argmax of p_i and emits the argmax at position ``accepted``; a sampled
    row accepts d_i iff u_i q_i(d_i) < p_i(d_i) (in float64, as the per-row rule compares Python floats) and
    emits a draw from max(0, p - q) at the first rejection (p if that has no mass), else from p."""
    n, drafts, windows, q, q_rows, rand = group.n, group.drafts, group.windows, group.q, group.q_rows, group.rand
    g, _, v = logits.shape
    dev = logits.device
    nd = group.n_drafts
    verifying = drafts is not None
    npos = n if verifying else 1
    greedy = params.greedy
    lead = torch.arange(max(n - 1, 1), device=dev)[None, : n - 1]  # [1, n-1]
    if greedy:
        target = argmax_no_mask(logits[:, :npos], mask_token_id)  # [g, npos]
        if verifying:
            assert drafts is not None
            hit = (drafts == target[:, : n - 1]) & (lead < nd[:, None])
            accepted = hit.long().cumprod(-1).sum(-1)
        else:
            accepted = torch.zeros(g, dtype=torch.long, device=dev)
        token = target.gather(1, accepted[:, None])[:, 0]
    else:
        assert rand is not None
        p = probs_from_logits(logits[:, :npos], params, mask_token_id)  # [g, npos, V]
        if verifying:
            assert drafts is not None and q is not None and q_rows is not None and rand.u is not None
            qv = q.reshape(-1, v)
            base = (q_rows * (n - 1))[:, None]  # [g, 1]: row j's q_1 in qv
            p_d = p[:, : n - 1].gather(-1, drafts[..., None])[..., 0]
            q_d = qv[base + lead, drafts]  # [g, n-1]
            ok = (rand.u[:, : n - 1].to(dev).double() * q_d.double() < p_d.double()) & (lead < nd[:, None])
            accepted = ok.long().cumprod(-1).sum(-1)
            p_a = p.reshape(-1, v)[torch.arange(g, device=dev) * npos + accepted]  # [g, V]: p at position accepted
            q_a = qv[base[:, 0] + accepted.clamp(max=n - 2)]
            residual = (p_a - q_a).clamp_(min=0.0)
            use = (accepted < nd) & (residual.amax(-1) > 0)
            dist = torch.where(use[:, None], residual, p_a)
        else:
            accepted = torch.zeros(g, dtype=torch.long, device=dev)
            dist = p[:, 0]
        token = (dist / rand.token.to(dev)).argmax(-1)
    cols = [accepted.double()[:, None], token.double()[:, None]]
    q_next = None
    if windows is not None and n > 1:
        first = windows.gather(1, accepted[:, None]).clamp(min=0)  # [g, 1]; -1 (no drafts): any window, unused
        at = (first + lead).clamp(max=logits.shape[1] - 1)  # [g, n-1]
        rows = torch.arange(g, device=dev)[:, None] * logits.shape[1]
        # whole rows of V logits (a copy at memcpy speed; gather along positions reads an index per element)
        w = logits.reshape(-1, v).index_select(0, (rows + at).reshape(-1)).view(g, n - 1, v)
        if greedy:
            d, own = greedy_with_prob(w, mask_token_id) if conf else (argmax_no_mask(w, mask_token_id), None)
        else:
            assert rand is not None
            q_next = probs_from_logits(w, params, mask_token_id)
            if draft == "argmax" or rand.draft is None:
                d = q_next.argmax(-1)
            else:
                d = (q_next / rand.draft.to(dev)).argmax(-1)
            own = q_next.gather(-1, d[..., None])[..., 0] if conf else None
        cols += [
            d.double(),
            own.double() if own is not None else torch.zeros(g, n - 1, dtype=torch.float64, device=dev),
        ]
    else:
        cols.append(torch.zeros(g, 2 * (n - 1), dtype=torch.float64, device=dev))
    return torch.cat(cols, dim=1), q_next
