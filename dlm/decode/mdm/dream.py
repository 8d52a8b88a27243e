"""``dream`` (Dream's ``diffusion_generate``): ``t = linspace(1, eps, steps + 1)``; at pass i every mask is revealed
with probability ``1 - t[i+1]/t[i]`` (``alg='origin'``), or the ``int(n_masked (1 - t[i+1]/t[i]))`` masks of
highest confidence are (``maskgit_plus``: the token's probability, ``topk_margin``: top-1 minus top-2, ``entropy``:
the negative entropy; drawn from ``softmax(confidence / alg_temp)`` when ``alg_temp > 0``), all of them at the last
pass. The count is per row (the reference averages it over the batch), in float32 as Dream's; the masks are chosen
over the whole sequence (non-masks at -inf), so ties break at Dream's positions. Tokens: temperature, then top-p,
then top-k, as Dream's ``sample_tokens`` (its hidden top-k 50 where the request sets none, on Dream checkpoints:
``dream_top_k``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from dlm.decode.engine import Engine, Row
from dlm.decode.mdm.base import Sampler, no_positions
from dlm.decode.sampling import next_token, probs_from_logits, sample

EPS = 1e-3  # Dream's diffusion_generate default: the last noise level of its schedule


def dream_ratio(t: torch.Tensor, i: int, steps: int) -> torch.Tensor:
    """The share of the masks Dream reveals at pass ``i`` of ``steps`` (``t``: its float32 ``linspace(1, eps,
    steps + 1)``): ``1 - t[i+1] / t[i]`` in float32 as its code computes it, 1 at the last pass."""
    return torch.ones(()) if i >= steps - 1 else 1 - t[i + 1] / t[i]


def dream_reveal_count(n_masked: int, t: torch.Tensor, i: int, steps: int) -> int:
    """How many masks Dream's confidence algorithms reveal at pass ``i`` of ``steps``: ``int(n *``
    :func:`dream_ratio` ``)`` in float32 as its code computes it (the count a float32 tensor), every mask at the last
    pass. In float64 some (length, steps, pass) give one fewer."""
    if i >= steps - 1:
        return n_masked
    return int(torch.tensor(n_masked, dtype=torch.float32) * dream_ratio(t, i, steps))


@dataclass
class DreamState:
    steps: int
    t: torch.Tensor  # float32 linspace(1, eps, steps + 1)
    i: int = 0  # the next pass
    masked: torch.Tensor = field(default_factory=no_positions)
    commit: torch.Tensor = field(
        default_factory=no_positions
    )  # origin: [masked] bool, which masks the next pass reveals
    n_commit: int = 0  # the confidence algorithms: how many


class DreamSampler(Sampler):
    name = "dream"

    @property
    def alg(self) -> str:
        return self.config.alg or "origin"

    def start(self, engine: Engine, row: Row, steps: int) -> DreamState:
        return DreamState(steps, torch.linspace(1, EPS, steps + 1))

    def plan(self, engine: Engine, row: Row) -> None:
        st: DreamState = row.state["sampler"]
        st.masked = masked = self.masked(engine, row)
        while True:
            i = st.i
            st.i += 1
            if self.alg == "origin":
                # drawn at the last pass too (ratio 1: every mask), as the reference does
                commit = torch.rand(masked.numel(), generator=row.generator) < dream_ratio(st.t, i, st.steps)
                if bool(commit.any()):
                    st.commit = commit
                    return
            else:
                n = dream_reveal_count(masked.numel(), st.t, i, st.steps)
                if n > 0:
                    st.n_commit = n
                    return

    def commit(self, engine: Engine, row: Row, logits: torch.Tensor) -> None:
        st: DreamState = row.state["sampler"]
        p, mask_id, g = row.params, engine.mask_token_id, row.generator
        x, masked = row.state["x"], st.masked
        scores = self.decoder._scores(row, logits, masked)
        top_k = p.top_k or int(self.config.dream_top_k or 0)
        if self.alg == "origin":
            sub = scores[st.commit.to(scores.device)]
            if p.greedy:
                tokens = next_token(sub, p, mask_id, g)  # the argmax survives any filter
            else:
                tokens = sample(probs_from_logits(sub, replace(p, top_k=top_k), mask_id, top_p_first=True), g)
            x[masked[st.commit]] = tokens.cpu()
            return
        # the confidence algorithms: the distribution after the filters (at temperature 1 when greedy), its argmax
        # or a draw, and a confidence per mask
        params = replace(p, temperature=1.0, top_k=top_k) if p.greedy else replace(p, top_k=top_k)
        probs = probs_from_logits(scores, params, mask_id, top_p_first=True)
        tokens = probs.argmax(-1) if p.greedy else sample(probs, g)
        if self.alg == "maskgit_plus":
            conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
        elif self.alg == "topk_margin":
            top2 = probs.topk(2, dim=-1).values
            conf = top2[:, 0] - top2[:, 1]
        else:  # entropy: sum p log p (higher = more certain)
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)
        # Dream selects over the whole sequence with the non-masks at -inf, not over the masks alone: among equal
        # confidences (many are exactly 1 under top-p) torch.topk returns other positions on the longer row
        # (on the logits' device, as Dream runs it there; the request's generator draws on the CPU)
        full = torch.full((x.numel(),), float("-inf"), dtype=conf.dtype, device=conf.device)
        full[masked.to(conf.device)] = conf
        proposed = x.clone()  # the proposals at the masks (only masks can be chosen: the rest are at -inf)
        proposed[masked] = tokens.cpu()
        k = st.n_commit
        if self.config.alg_temp:
            chosen = torch.multinomial((full / self.config.alg_temp).softmax(-1).cpu(), k, generator=g)
        else:
            chosen = full.topk(k).indices.cpu()
        x[chosen] = proposed[chosen]
