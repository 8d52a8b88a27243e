"""``random``: at step k = T-1 .. 0 every still-masked position is committed with probability 1/(k+1) (so all are
resolved at k = 0); tokens by temperature/top-p sampling. A step that would commit nothing skips its forward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dlm.decode.engine import Engine, Row
from dlm.decode.mdm.base import Sampler, no_positions, propose


@dataclass
class RandomState:
    k: int  # passes left after the next one
    masked: torch.Tensor = field(default_factory=no_positions)
    commit: torch.Tensor = field(default_factory=no_positions)  # [masked] bool: which masks the next pass commits


class RandomSampler(Sampler):
    name = "random"

    def start(self, engine: Engine, row: Row, steps: int) -> RandomState:
        return RandomState(steps - 1)

    def plan(self, engine: Engine, row: Row) -> None:
        st: RandomState = row.state["sampler"]
        st.masked = masked = self.masked(engine, row)
        while True:
            k = st.k
            st.k -= 1
            commit = torch.rand(masked.numel(), generator=row.generator) < 1.0 / (k + 1)
            if bool(commit.any()):
                st.commit = commit
                return

    def commit(self, engine: Engine, row: Row, logits: torch.Tensor) -> None:
        st: RandomState = row.state["sampler"]
        x, masked = row.state["x"], st.masked
        tokens, _ = propose(self.decoder._scores(row, logits, masked), row.params, engine.mask_token_id, row.generator)
        x[masked[st.commit]] = tokens[st.commit]
