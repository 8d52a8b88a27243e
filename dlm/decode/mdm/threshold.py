"""``threshold`` (Fast-dLLM): semi-autoregressive blocks of ``semi_ar_block``; within a block each pass commits every
masked token whose probability exceeds ``threshold`` (at least the most confident one). The KV of the finished
prefix is cached: refreshed by one full forward at the start of each block, reused by the block's later passes
(approximate for a bidirectional model, as in Fast-dLLM)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlm.decode.engine import Engine, Row
from dlm.decode.mdm.base import Sampler, propose


@dataclass
class ThresholdState:
    start: int  # the current block's first position
    c: int  # the cached prefix ends here (one short of the block with the model's shift)
    refresh: bool = False  # the next pass re-feeds the whole sequence (a new block's first pass)


class ThresholdSampler(Sampler):
    name = "threshold"

    def start(self, engine: Engine, row: Row, steps: int) -> ThresholdState:
        p = row.state["p"]
        return ThresholdState(start=p, c=p - (1 if self.shift else 0))

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        st: ThresholdState = row.state["sampler"]
        x = row.state["x"]
        if st.refresh:
            st.refresh = False
            row.fresh = True  # a full forward at the start of a block: recompute the prefix KV
            row.pos = 0
            return x.tolist()
        return x[row.pos :].tolist()

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        st: ThresholdState = row.state["sampler"]
        x = row.state["x"]
        limit = row.state.get("end", x.numel())
        block = self.config.semi_ar_block
        end = min(st.start + block, limit)
        keep = st.c - row.pos  # a refresh (or the prefill) keeps the prefix before the block; later passes nothing
        masked = (x[st.start : end] == engine.mask_token_id).nonzero().squeeze(-1) + st.start
        scores = self.decoder._scores(row, logits, masked)
        tokens, conf = propose(scores, row.params, engine.mask_token_id, row.generator)
        commit = conf > self.decoder.threshold
        commit[conf.argmax()] = True
        x[masked[commit]] = tokens[commit]
        if not bool((x[st.start : end] == engine.mask_token_id).any()) and end < limit:
            st.start = end  # next block: its first pass refreshes the prefix cache
            st.c, st.refresh = end - (1 if self.shift else 0), True
        return self.decoder._emit(engine, row), keep
