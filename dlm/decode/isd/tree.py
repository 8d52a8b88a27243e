"""The shapes of ISD's tree chunks (docs/algorithms.md#isd): the position offsets and attention of a verify chunk
that carries the masks of several outcomes (fallback drafts, :func:`branch_layout`) or several draft candidates
(:func:`candidate_layout`), and where in such a chunk an outcome's masks sit. Pure: ints in, layouts out."""

from __future__ import annotations

import torch

Layout = tuple[list[int], torch.Tensor]  # (position offset of each chunk token from row.pos, [n, n] attention)


def verify_len(n: int, fallback: str, candidates: int) -> int:
    """Tokens a row feeds in a verify step at stride ``n``: 2N-1 (c, N-1 drafts, one branch of N-1 masks),
    N + N x (N-1) with every branch (``fallback='all'``); with K draft candidates 2K+1, plus the rejection branch's
    mask unless fallback is off."""
    if candidates > 1:
        return 1 + 2 * candidates + (fallback != "off")
    return n + (n - 1) * (n if fallback == "all" else 1)


def branch_layout(n: int, branches: tuple[int, ...]) -> Layout:
    """Offsets and attention of a verify chunk at stride ``n`` that carries the masks of ``branches``:
    ``[c, d_1..d_{N-1}]`` (offsets 0..N-1, causal), then N-1 masks per branch. Branch 0 (every draft accepted)
    sits at offsets N..2N-2 and sees the whole chunk before it: the plain verify chunk. Branch i (first rejection
    at d_i) sits at offsets i..i+N-2 and sees c, d_1..d_{i-1} and its own earlier masks: what a cold start from
    the correction at offset i would feed, minus the correction itself. N = 2, branches (0, 1)::

        token  off  sees      c d1 M  F
        c       0             x .  .  .
        d1      1             x x  .  .
        M       2             x x  x  .
        F       1   (d1 rej.) x .  .  x
    """
    total = n + (n - 1) * len(branches)
    offsets = list(range(n))
    attn = torch.zeros(total, total, dtype=torch.bool)
    attn[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril_()
    own = torch.ones(n - 1, n - 1, dtype=torch.bool).tril_()
    for k, b in enumerate(branches):
        lo = n + k * (n - 1)
        start = b if b else n
        offsets += list(range(start, start + n - 1))
        attn[lo : lo + n - 1, : (b if b else n)] = True  # c, d_1 .. d_{b-1} (all of them for branch 0)
        attn[lo : lo + n - 1, lo : lo + n - 1] = own
    return offsets, attn


def branch_masks(n: int, branches: tuple[int, ...], outcome: int) -> tuple[int, int] | None:
    """Where outcome ``outcome``'s N-1 masks sit in a verify chunk carrying ``branches`` (:func:`branch_layout`):
    (chunk index of the first, position offset from row.pos at which the next d_1 will sit); None if the chunk
    does not carry them."""
    if outcome not in branches:
        return None
    return n + branches.index(outcome) * (n - 1), (outcome + 1 if outcome else n + 1)


def candidate_layout(k: int, fallback: bool) -> Layout:
    """Offsets and attention of a candidate verify chunk ``[c, d^1..d^k, M^1..M^k (, F)]``: c at offset 0; each
    candidate at offset 1 sees c; M^j at offset 2 sees c and d^j; F (the rejection branch) at offset 1 sees c. Every
    token sees itself. k = 2 with F::

        token  off  sees  c d1 d2 M1 M2 F
        c       0         x
        d1      1         x x
        d2      1         x .  x
        M1      2         x x  .  x
        M2      2         x .  x  .  x
        F       1         x .  .  .  .  x
    """
    total = 1 + 2 * k + bool(fallback)
    offsets = [0] + [1] * k + [2] * k + [1] * bool(fallback)
    attn = torch.eye(total, dtype=torch.bool)
    attn[:, 0] = True
    for j in range(k):
        attn[1 + k + j, 1 + j] = True
    return offsets, attn


class LayoutCache:
    """Tree layouts by shape, built once each (a decoder sees a handful of shapes). Keys: ``(n, branches)`` for
    fallback branches, ``(n, ("cands", k, with_f))`` for candidates."""

    def __init__(self) -> None:
        self.layouts: dict[tuple[int, tuple[object, ...]], Layout] = {}

    def branches(self, n: int, branches: tuple[int, ...]) -> Layout:
        key = (n, branches)
        if key not in self.layouts:
            self.layouts[key] = branch_layout(n, branches)
        return self.layouts[key]

    def candidates(self, n: int, k: int, fallback: bool) -> Layout:
        key: tuple[int, tuple[object, ...]] = (n, ("cands", k, fallback))
        if key not in self.layouts:
            self.layouts[key] = candidate_layout(k, fallback)
        return self.layouts[key]
