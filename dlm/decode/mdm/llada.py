"""``llada`` (LLaDA's sampler): semi-autoregressive blocks of ``semi_ar_block``, ``steps`` passes split evenly over
the blocks and each block's masks split evenly over its passes (the remainder to the first ones); each pass commits
the block's masks with the highest probability of their proposed token (``remasking='low_confidence'``, at
temperature 1) or random scores (``'random'``). ``cfg_scale > 0``: classifier-free guidance, the logits
``u + (cfg_scale + 1) (c - u)`` of the conditional sequence c and the one with the prompt masked u, both in one
forward (two copies in the row's chunk, each attending to itself only, both at positions 0..)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dlm.decode.engine import Engine, Row
from dlm.decode.mdm.base import Sampler, even_split, no_positions
from dlm.decode.sampling import next_token, suppress
from dlm.errors import DLMError


def llada_quotas(gen_length: int, block_length: int, steps: int) -> list[list[int]]:
    """Per semi-autoregressive block, the masks each of its passes commits (LLaDA's schedule: ``steps`` split
    evenly over the blocks, each block's masks evenly over its passes; the last block may be shorter)."""
    blocks = math.ceil(gen_length / block_length)
    if steps < blocks:
        raise DLMError(
            f"--steps {steps} is fewer than the {blocks} blocks of --semi-ar-block {block_length} in "
            f"{gen_length} tokens; give at least one pass per block"
        )
    sizes = [min(block_length, gen_length - b * block_length) for b in range(blocks)]
    return [even_split(size, s) for size, s in zip(sizes, even_split(steps, blocks))]


@dataclass
class LLaDAState:
    quotas: list[list[int]]  # per block, the masks each of its passes commits
    block: int = 0
    pass_: int = 0  # the block's next pass
    masked: torch.Tensor = field(default_factory=no_positions)  # the planned pass's block's masks
    n_commit: int = 0


class LLaDASampler(Sampler):
    name = "llada"

    @property
    def guided(self) -> bool:
        """Classifier-free guidance: the chunk holds the conditional and the unconditional sequence."""
        return self.config.cfg_scale > 0

    def check_request(self, engine: Engine, row: Row) -> None:
        steps = self.config.steps or row.params.max_new_tokens
        llada_quotas(row.params.max_new_tokens, self.config.semi_ar_block, steps)  # fewer steps than blocks: refused

    def start(self, engine: Engine, row: Row, steps: int) -> LLaDAState:
        return LLaDAState(llada_quotas(row.params.max_new_tokens, self.config.semi_ar_block, steps))

    def plan(self, engine: Engine, row: Row) -> None:
        st: LLaDAState = row.state["sampler"]
        masked = self.masked(engine, row)
        x = row.state["x"]
        while True:  # the next pass with a quota (a block with fewer masks than passes has empty ones)
            b, j = st.block, st.pass_
            if j >= len(st.quotas[b]):
                st.block, st.pass_ = b + 1, 0
                continue
            st.pass_ += 1
            if st.quotas[b][j] > 0:
                lo = row.state["p"] + b * self.config.semi_ar_block
                hi = min(lo + self.config.semi_ar_block, x.numel())
                st.n_commit = st.quotas[b][j]
                st.masked = masked[(masked >= lo) & (masked < hi)]
                return

    def _uncond(self, engine: Engine, row: Row) -> torch.Tensor:
        """The sequence with its prompt masked (classifier-free guidance's unconditional input)."""
        u = row.state["x"].clone()
        u[: row.state["p"]] = engine.mask_token_id
        u[row.state.get("end", u.numel()) :] = engine.mask_token_id  # a suffix conditions too
        return u

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        rest = super().prefill_suffix(engine, row)
        return rest + self._uncond(engine, row).tolist() if self.guided else rest

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        x = row.state["x"]
        return x.tolist() + self._uncond(engine, row).tolist() if self.guided else x.tolist()

    def chunk_attention(self, engine: Engine, row: Row, positions: torch.Tensor) -> torch.Tensor:
        if not self.guided:
            return super().chunk_attention(engine, row, positions)
        # [conditional | unconditional], each the whole sequence from position 0 (nothing is cached): each copy
        # sees itself only
        n, a = positions.numel(), row.state["x"].numel()
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[:a, :a] = True
        mask[a:, a:] = True
        return mask

    def chunk_positions(self, engine: Engine, row: Row, n: int) -> list[int] | None:
        return list(range(row.state["x"].numel())) * 2 if self.guided else None

    def commit(self, engine: Engine, row: Row, logits: torch.Tensor) -> None:
        st: LLaDAState = row.state["sampler"]
        p, mask_id, g = row.params, engine.mask_token_id, row.generator
        x, masked = row.state["x"], st.masked
        if self.guided:
            n = x.numel() - row.pos
            cond, uncond = logits[:n], logits[n : 2 * n]
            logits = uncond + (self.config.cfg_scale + 1.0) * (cond - uncond)
        scores = self.decoder._scores(row, logits, masked)
        tokens = next_token(scores, p, mask_id, g)
        if (self.config.remasking or "low_confidence") == "low_confidence":
            conf = suppress(scores, mask_id).softmax(-1).gather(-1, tokens[:, None]).squeeze(-1).cpu()
        else:
            conf = torch.rand(tokens.numel(), generator=g)
        top = conf.topk(st.n_commit).indices
        x[masked[top]] = tokens.cpu()[top]
