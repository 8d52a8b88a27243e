"""``confidence`` (low-confidence remasking): each of ``steps`` passes predicts every masked position and commits
the most confident so that ``floor(n0 * (T - s) / T)`` stay masked after pass s (none after the last)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dlm.decode.engine import Engine, Row
from dlm.decode.mdm.base import Sampler, no_positions, propose


@dataclass
class ConfidenceState:
    steps: int
    s: int = 0  # passes planned so far
    masked: torch.Tensor = field(default_factory=no_positions)
    n_commit: int = 0


class ConfidenceSampler(Sampler):
    name = "confidence"

    def start(self, engine: Engine, row: Row, steps: int) -> ConfidenceState:
        return ConfidenceState(steps)

    def plan(self, engine: Engine, row: Row) -> None:
        st: ConfidenceState = row.state["sampler"]
        st.masked = masked = self.masked(engine, row)
        n_gen = row.params.max_new_tokens
        while True:
            st.s += 1
            remain = math.floor(n_gen * (st.steps - st.s) / st.steps)
            if masked.numel() - remain > 0:
                st.n_commit = masked.numel() - remain
                return

    def commit(self, engine: Engine, row: Row, logits: torch.Tensor) -> None:
        st: ConfidenceState = row.state["sampler"]
        x, masked = row.state["x"], st.masked
        scores = self.decoder._scores(row, logits, masked)
        tokens, conf = propose(scores, row.params, engine.mask_token_id, row.generator)
        top = conf.topk(st.n_commit).indices
        x[masked[top]] = tokens[top]
