"""What the block decoder and its commit rules share: the block-causal mask, a row's typed block state and the
:class:`BlockRule` interface each rule module implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from dlm.decode.block.decoder import BlockDecoder
    from dlm.decode.engine import Engine, Row


def block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, b: int) -> torch.Tensor:
    """[1, 1, Q, K] boolean block-causal mask over absolute positions: block(k) <= block(q)."""
    return ((k_pos[None, :] // b) <= (q_pos[:, None] // b))[None, None]


@dataclass
class BlockState:
    """A row's place in its current block (at ``row.state["block"]``, beside the shared layout of
    :class:`~dlm.decode.mdm.base.DiffusionDecoder`: ``x``, ``p``, ``emitted``)."""

    bs: int  # the block's first position
    be: int  # its end (exclusive; the canvas's end for the last block)
    lo: int  # its first generated position (after the prompt's tail in the prompt's block)
    steps: int  # the passes this block is allowed
    per_step: int  # masks a top-k pass commits (dlm's rule)
    quotas: list[int] = field(default_factory=list)  # what each pass commits (SDAR's strategies)
    passes: int = 0  # passes run over this block
    post: int = 0  # editing passes after its masks were filled (LLaDA2.1)


class BlockRule:
    """Which of a block's masks a pass commits, behind :class:`~dlm.decode.block.decoder.BlockDecoder` (the shell
    the engine sees: the canvas, the blocks, the proposals, editing and emission)."""

    name: ClassVar[str]

    def __init__(self, decoder: BlockDecoder):
        self.decoder = decoder

    def extends_canvas(self) -> bool:
        """Whether the row's canvas runs to the end of the last block (SDAR's layout) instead of max_new_tokens."""
        return False

    def commit(
        self, engine: Engine, row: Row, logits: torch.Tensor, masked: torch.Tensor, tokens: torch.Tensor, conf
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This pass's commits among the block's ``masked`` positions (proposals ``tokens``, confidences
        ``conf``): ``(which [n] bool, masked, tokens)`` - a rule that writes ``x`` itself returns empty ones."""
        raise NotImplementedError
