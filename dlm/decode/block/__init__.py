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

``remasking`` (SDAR's strategies, :mod:`.sdar`): the canvas runs to the end of the last block and each pass
commits a quota of the block (the leftmost masks, the most confident, or those above ``threshold``); LLaDA2's
checkpoints run the same rule, with at most max_new_tokens passes a block.

One module per commit rule - :mod:`.threshold` (dlm's own, above) and :mod:`.sdar` - each a
:class:`~dlm.decode.block.base.BlockRule` over the row's typed :class:`~dlm.decode.block.base.BlockState`, behind
the thin decoder shell of :mod:`.decoder` that the engine sees. A new rule is one module and its line in
:data:`~dlm.decode.block.decoder.RULES`.

On the engine, rows of a batch sit in different blocks at different passes; the prefill forward is the first
block's first pass (the prompt before that block is cached by it). A finished block is streamed at once, and a
stop token in it ends the request.
"""

from __future__ import annotations

from dlm.decode.block.base import BlockRule, BlockState, block_mask
from dlm.decode.block.decoder import RULES, BlockDecoder

__all__ = ["RULES", "BlockDecoder", "BlockRule", "BlockState", "block_mask"]
