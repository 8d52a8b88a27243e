"""dlm's own commit rule for block decoding: every mask above ``threshold`` (at least the most confident one), or
the ``ceil(n_masked / steps)`` most confident (top-k, ``threshold`` None); the block's last allowed pass commits
every mask left. Fast-dLLM v2 checkpoints and dlm's own ``block`` models decode with it."""

from __future__ import annotations

import torch

from dlm.decode.block.base import BlockRule
from dlm.decode.engine import Engine, Row


class ThresholdRule(BlockRule):
    name = "threshold"

    def commit(self, engine: Engine, row: Row, logits, masked, tokens, conf):
        st, threshold = row.state["block"], self.decoder.threshold
        if st.passes >= st.steps:
            commit = torch.ones_like(conf, dtype=torch.bool)
        elif threshold is not None:
            commit = conf > threshold
            commit[conf.argmax()] = True
        else:
            commit = torch.zeros_like(conf, dtype=torch.bool)
            commit[conf.topk(min(st.per_step, conf.numel())).indices] = True
        return commit, masked, tokens
