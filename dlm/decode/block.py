"""Block diffusion decoding for ``block`` DLMs (SDAR / BD3-LM, docs/algorithms.md#block-diffusion), as a decoder of the batching engine.

Blocks of ``block_size`` are aligned to absolute positions (block(i) = i // b, as in training). Attention is
block-causal: a query sees every key of its own block and of earlier blocks. Per block, up to ``steps`` denoising
passes feed the current block (prompt tail tokens fixed, masks to fill) against the KV cache of the earlier
blocks and commit either every masked token above ``threshold`` (at least the most confident one) or the
``ceil(n_masked / steps)`` most confident (top-k mode, ``threshold=None``); the last allowed pass commits all.

KV of a finished block is written once: the first pass of the next block feeds ``[finished block | new block]``
(the finished tokens cannot see the new block under block-causal attention, so their KV is exact) and keeps the
finished block's KV; later passes reuse it. With ``shift`` (logit i-1 scores token i) the cache stops one token
short so that the token before the block is fed with it.

``remasking`` (SDAR's strategies): the canvas runs to the end of the last block (as SDAR lays it out; tokens
past ``max_new_tokens`` are never returned), each block's masks are split evenly over ``steps`` passes (the
remainder to the first ones) and a pass commits its quota: the leftmost masks (``sequential``), the most confident
(``low_confidence_static``), or every mask above ``threshold`` when there are at least the quota of them, else the
most confident (``low_confidence_dynamic``, the default for SDAR and LLaDA2 checkpoints: LLaDA2's own sampler is
this one). The quotas split the block's length, as SDAR's and LLaDA2's samplers do (LLaDA2's commits at most the
masks left and runs at most max_new_tokens passes a block; SDAR's top-k then also reaches decoded positions:
``quota_overflow='rewrite'``, never a prompt position); with ``quota_overflow='masks'`` they split the block's
masks and only masks are written.

On the engine, rows of a batch sit in different blocks at different passes; the prefill forward is the first
block's first pass (the prompt before that block is cached by it). A finished block is streamed at once, and a
stop token in it ends the request.
"""

from __future__ import annotations

import math

import torch

from dlm.decode.configs import BlockConfig, decoder_config
from dlm.decode.engine import Engine, Row
from dlm.decode.mdm import DiffusionDecoder, even_split, propose
from dlm.errors import DLMError


def block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, b: int) -> torch.Tensor:
    """[1, 1, Q, K] boolean block-causal mask over absolute positions: block(k) <= block(q)."""
    return ((k_pos[None, :] // b) <= (q_pos[:, None] // b))[None, None]


class BlockDecoder(DiffusionDecoder):
    name = "block"

    def __init__(self, config: BlockConfig | None = None):
        self.config = config = decoder_config(BlockConfig, config)
        threshold = config.threshold
        self.remasking = config.remasking  # None: dlm's threshold / top-k rule
        self.editing_threshold, self.max_post_steps = config.editing_threshold, config.max_post_steps
        self.quota_overflow = config.quota_overflow or "masks"
        if threshold is not None and float(threshold) <= 0.0:
            threshold = None  # top-k commits
        self.steps, self.threshold = config.steps, threshold
        self.block_size, self.shift = 1, False
        self.length_quotas = self.steps_at_most_new_tokens = False

    def check_model(self, engine: Engine) -> None:
        spec = engine.spec
        if spec is None or spec.objective != "block" or not spec.block_size:
            what = "a plain causal LM" if spec is None else f"a '{spec.objective}' model"
            other = "ar" if spec is None else ("isd" if spec.objective == "idlm" else "mdm")
            raise DLMError(
                f"--decode block needs a block-diffusion DLM (objective 'block' with a block_size); "
                f"this is {what}: use --decode {other}"
            )
        self.block_size, self.shift = spec.block_size, bool(spec.shift)
        # the quotas split the block's length (SDAR's 'rewrite', LLaDA2's 'clip': a published family's sampler
        # settings, dlm.model.families) or its masks (dlm's own rule) - they differ only in a first block that holds
        # the prompt's tail
        self.length_quotas = self.quota_overflow in ("rewrite", "clip")
        # LLaDA2.0's generate() runs at most max_new_tokens passes a block (steps = min(steps, gen_length)); 2.1's
        # editing loop has no step schedule
        self.steps_at_most_new_tokens = self.config.steps_cap == "new_tokens" and self.editing_threshold is None

    def _layout(self, engine: Engine, row: Row) -> torch.Tensor:
        x = super()._layout(engine, row)
        if self.remasking is None:
            return x
        end = min(-(-x.numel() // self.block_size) * self.block_size, engine.max_positions)
        x = torch.cat([x, x.new_full((end - x.numel(),), engine.mask_id)])
        row.state["x"] = x
        return x

    def chunk_attention(self, engine: Engine, row: Row, positions: torch.Tensor) -> torch.Tensor:
        return block_mask(positions, positions, self.block_size)[0, 0]

    def _start_block(self, engine: Engine, row: Row, bs: int) -> None:
        st = row.state
        end = st["x"].numel()
        be = min(bs + self.block_size, end)
        lo = max(bs, st["p"])
        n0 = int((st["x"][lo:be] == engine.mask_token_id).sum())
        steps = self.steps or self.block_size
        if self.steps_at_most_new_tokens:
            steps = min(steps, row.params.max_new_tokens)
        st.update(
            bs=bs,
            be=be,
            lo=lo,
            pass_=0,
            post=0,
            per_step=math.ceil(n0 / steps),
            block_steps=steps,
            quotas=even_split(be - bs if self.length_quotas else n0, steps),
        )

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        x = self._layout(engine, row)
        p = len(row.prompt_ids)
        self._start_block(engine, row, (p // self.block_size) * self.block_size)
        return x[p : row.state["be"]].tolist()

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        return row.state["x"][row.pos : row.state["be"]].tolist()

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        st = row.state
        x, bs, be, lo = st["x"], st["bs"], st["be"], st["lo"]
        # keep the KV of everything before this block (finished blocks: written once), drop the rest
        keep = max(bs - (1 if self.shift else 0), 0) - row.pos
        is_mask = x[lo:be] == engine.mask_token_id
        masked = is_mask.nonzero().squeeze(-1) + lo
        editing = self.editing_threshold is not None
        if editing:  # every generated position of the block is predicted: the masks and the tokens placed so far
            every, every_conf = propose(
                self._scores(row, logits, torch.arange(lo, be)), row.params, engine.mask_token_id, row.generator
            )
            tokens, conf = every[is_mask], every_conf[is_mask]
            edit = ~is_mask & (every_conf > self.editing_threshold) & (every != x[lo:be])
        else:
            tokens, conf = propose(self._scores(row, logits, masked), row.params, engine.mask_token_id, row.generator)
        st["pass_"] += 1
        if masked.numel() == 0:  # a pass over a filled block (editing): no mask to commit
            commit = torch.zeros(0, dtype=torch.bool)
        elif self.remasking is not None:
            quota = st["quotas"][st["pass_"] - 1] if st["pass_"] <= len(st["quotas"]) else conf.numel()
            if self._rewrites(conf, quota):
                self._rewrite_pass(engine, row, logits, masked, tokens, conf, quota)
                # done: every mask and the rewritten positions (nothing left for the commit below)
                commit, masked, tokens = torch.zeros(0, dtype=torch.bool), masked[:0], tokens[:0]
            else:
                commit = self._sdar_commit(conf, quota)
        elif st["pass_"] >= st["block_steps"]:
            commit = torch.ones_like(conf, dtype=torch.bool)
        elif self.threshold is not None:
            commit = conf > self.threshold
            commit[conf.argmax()] = True
        else:
            commit = torch.zeros_like(conf, dtype=torch.bool)
            commit[conf.topk(min(st["per_step"], conf.numel())).indices] = True
        x[masked[commit]] = tokens[commit]
        if editing:
            x[lo:be][edit] = every[edit]
        if bool((x[lo:be] == engine.mask_token_id).any()):
            return [], keep
        if editing:  # LLaDA2.1: after the pass that fills the block, passes that edit go on (a bounded number)
            if masked.numel() == 0:
                st["post"] += 1
                if bool(edit.any()) and st["post"] < self.max_post_steps:
                    return [], keep
            elif self.max_post_steps > 0:
                return [], keep
        out = self._emit(engine, row)  # the finished block, in order
        if be < x.numel():
            self._start_block(engine, row, bs + self.block_size)
        return out, keep

    def _rewrites(self, conf: torch.Tensor, quota: int) -> bool:
        """Whether this pass takes SDAR's top-k over the whole block (``quota_overflow='rewrite'``): its quota
        exceeds the masks left and the strategy would take a top-k (not 'sequential', not a dynamic pass whose
        masks above the threshold fill the quota - they cannot, here)."""
        return (
            self.quota_overflow == "rewrite"
            and quota > conf.numel()
            and self.remasking in ("low_confidence_static", "low_confidence_dynamic")
        )

    def _rewrite_pass(self, engine: Engine, row: Row, logits, masked, tokens, conf, quota: int) -> None:
        """SDAR's pass when its quota exceeds the masks left: the top ``quota`` of the block's confidences with
        every other position at -inf (so every mask, and then other positions in torch.topk's order among equal
        values), each chosen position set to the pass's proposal there (a decoded one is proposed anew) - except
        the prompt's: SDAR's code writes there too, in the block holding the prompt's tail; dlm never does."""
        st = row.state
        x, bs, be, p = st["x"], st["bs"], st["be"], st["p"]
        full = torch.full((be - bs,), float("-inf"), dtype=conf.dtype)
        full[masked - bs] = conf
        chosen = full.topk(min(quota, be - bs)).indices + bs
        decoded = chosen[(x[chosen] != engine.mask_token_id) & (chosen >= p)]
        x[masked] = tokens
        if decoded.numel():
            again, _ = propose(self._scores(row, logits, decoded), row.params, engine.mask_token_id, row.generator)
            x[decoded] = again

    def _sdar_commit(self, conf: torch.Tensor, quota: int) -> torch.Tensor:
        """Which of the block's masks (in position order, with confidences ``conf``) this pass commits."""
        k = min(quota, conf.numel())
        commit = torch.zeros_like(conf, dtype=torch.bool)
        if self.remasking == "sequential":
            commit[:k] = True
        elif (
            self.remasking == "low_confidence_dynamic"
            and self.threshold is not None  # (check_model: dynamic remasking has a threshold)
            and int((conf > self.threshold).sum()) >= k
        ):
            commit = conf > self.threshold
        else:
            commit[conf.topk(k).indices] = True
        return commit
