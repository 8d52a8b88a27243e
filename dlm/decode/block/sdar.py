"""SDAR's remasking strategies for block decoding (``--remasking``; SDAR's and LLaDA2's checkpoints default to
``low_confidence_dynamic``, LLaDA2's own sampler being this one).

The canvas runs to the end of the last block (as SDAR lays it out; tokens past ``max_new_tokens`` are never
returned); each block's commits are split evenly over its passes (the remainder to the first ones) and a pass
commits its quota: the leftmost masks (``sequential``), the most confident (``low_confidence_static``), or every
mask above ``threshold`` when there are at least the quota of them, else the most confident
(``low_confidence_dynamic``). With ``quota_overflow='rewrite'`` (SDAR) the quotas split the block's length and a
pass whose quota exceeds the masks left takes SDAR's top-k over the whole block, rewriting decoded positions
(never a prompt position); with ``'clip'`` (LLaDA2) they split the length and commit at most the masks left; with
``'masks'`` they split the block's masks."""

from __future__ import annotations

import torch

from dlm.decode.block.base import BlockRule
from dlm.decode.engine import Engine, Row
from dlm.decode.mdm import propose

STRATEGIES = ("sequential", "low_confidence_static", "low_confidence_dynamic")


class SDARRemasking(BlockRule):
    name = "sdar"

    def extends_canvas(self) -> bool:
        return True

    def commit(self, engine: Engine, row: Row, logits, masked, tokens, conf):
        st = row.state["block"]
        quota = st.quotas[st.passes - 1] if st.passes <= len(st.quotas) else conf.numel()
        if self._rewrites(conf, quota):
            self._rewrite_pass(engine, row, logits, masked, tokens, conf, quota)
            # done: every mask and the rewritten positions (nothing left for the decoder to write)
            return torch.zeros(0, dtype=torch.bool), masked[:0], tokens[:0]
        return self._quota_commit(conf, quota), masked, tokens

    def _rewrites(self, conf: torch.Tensor, quota: int) -> bool:
        """Whether this pass takes SDAR's top-k over the whole block (``quota_overflow='rewrite'``): its quota
        exceeds the masks left and the strategy would take a top-k (not 'sequential', not a dynamic pass whose
        masks above the threshold fill the quota - they cannot, here)."""
        return (
            self.decoder.quota_overflow == "rewrite"
            and quota > conf.numel()
            and self.decoder.remasking in ("low_confidence_static", "low_confidence_dynamic")
        )

    def _rewrite_pass(self, engine: Engine, row: Row, logits, masked, tokens, conf, quota: int) -> None:
        """SDAR's pass when its quota exceeds the masks left: the top ``quota`` of the block's confidences with
        every other position at -inf (so every mask, and then other positions in torch.topk's order among equal
        values), each chosen position set to the pass's proposal there (a decoded one is proposed anew) - except
        the prompt's: SDAR's code writes there too, in the block holding the prompt's tail; dlm never does."""
        st = row.state["block"]
        x, p = row.state["x"], row.state["p"]
        bs, be = st.bs, st.be
        full = torch.full((be - bs,), float("-inf"), dtype=conf.dtype)
        full[masked - bs] = conf
        chosen = full.topk(min(quota, be - bs)).indices + bs
        decoded = chosen[(x[chosen] != engine.mask_token_id) & (chosen >= p)]
        x[masked] = tokens
        if decoded.numel():
            scores = self.decoder._scores(row, logits, decoded)
            again, _ = propose(scores, row.params, engine.mask_token_id, row.generator)
            x[decoded] = again

    def _quota_commit(self, conf: torch.Tensor, quota: int) -> torch.Tensor:
        """Which of the block's masks (in position order, with confidences ``conf``) this pass commits."""
        k = min(quota, conf.numel())
        commit = torch.zeros_like(conf, dtype=torch.bool)
        threshold, strategy = self.decoder.threshold, self.decoder.remasking
        if strategy == "sequential":
            commit[:k] = True
        elif (
            strategy == "low_confidence_dynamic"
            and threshold is not None  # (check_model: dynamic remasking has a threshold)
            and int((conf > threshold).sum()) >= k
        ):
            commit = conf > threshold
        else:
            commit[conf.topk(k).indices] = True
        return commit
