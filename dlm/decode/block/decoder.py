"""The ``block`` decoder: the engine's view of block diffusion. It lays out each row's canvas, runs its blocks
(block-causal attention, the finished blocks' KV written once), proposes tokens for a block's masks (and, with
``editing_threshold``, for its decoded positions), streams each finished block, and asks its commit rule
(:data:`RULES`: dlm's threshold / top-k rule or SDAR's remasking strategies) which masks a pass commits."""

from __future__ import annotations

import math

import torch

from dlm.decode.block.base import BlockRule, BlockState, block_mask
from dlm.decode.block.sdar import SDARRemasking
from dlm.decode.block.threshold import ThresholdRule
from dlm.decode.configs import BlockConfig, decoder_config
from dlm.decode.engine import Engine, Row
from dlm.decode.mdm import DiffusionDecoder, even_split, propose
from dlm.errors import DLMError

# the commit rules by name: SDAR's where BlockConfig.remasking names one of its strategies, else dlm's own
RULES: dict[str, type[BlockRule]] = {r.name: r for r in (ThresholdRule, SDARRemasking)}


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
        self.rule: BlockRule = RULES["threshold" if self.remasking is None else "sdar"](self)

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
        if not self.rule.extends_canvas():
            return x
        end = min(-(-x.numel() // self.block_size) * self.block_size, engine.max_positions)
        x = torch.cat([x, x.new_full((end - x.numel(),), engine.mask_id)])
        row.state["x"] = x
        return x

    def chunk_attention(self, engine: Engine, row: Row, positions: torch.Tensor) -> torch.Tensor:
        return block_mask(positions, positions, self.block_size)[0, 0]

    def _start_block(self, engine: Engine, row: Row, bs: int) -> None:
        x = row.state["x"]
        be = min(bs + self.block_size, x.numel())
        lo = max(bs, row.state["p"])
        n0 = int((x[lo:be] == engine.mask_token_id).sum())
        steps = self.steps or self.block_size
        if self.steps_at_most_new_tokens:
            steps = min(steps, row.params.max_new_tokens)
        quotas = even_split(be - bs if self.length_quotas else n0, steps)
        row.state["block"] = BlockState(bs, be, lo, steps, math.ceil(n0 / steps), quotas)

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        x = self._layout(engine, row)
        p = len(row.prompt_ids)
        self._start_block(engine, row, (p // self.block_size) * self.block_size)
        return x[p : row.state["block"].be].tolist()

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        return row.state["x"][row.pos : row.state["block"].be].tolist()

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        st: BlockState = row.state["block"]
        x, bs, be, lo = row.state["x"], st.bs, st.be, st.lo
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
        st.passes += 1
        if masked.numel() == 0:  # a pass over a filled block (editing): no mask to commit
            commit = torch.zeros(0, dtype=torch.bool)
        else:
            commit, masked, tokens = self.rule.commit(engine, row, logits, masked, tokens, conf)
        x[masked[commit]] = tokens[commit]
        if editing:
            x[lo:be][edit] = every[edit]
        if bool((x[lo:be] == engine.mask_token_id).any()):
            return [], keep
        if editing:  # LLaDA2.1: after the pass that fills the block, passes that edit go on (a bounded number)
            if masked.numel() == 0:
                st.post += 1
                if bool(edit.any()) and st.post < self.max_post_steps:
                    return [], keep
            elif self.max_post_steps > 0:
                return [], keep
        out = self._emit(engine, row)  # the finished block, in order
        if be < x.numel():
            self._start_block(engine, row, bs + self.block_size)
        return out, keep
