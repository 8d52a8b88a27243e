"""Plain autoregressive decoding on the engine: feed the pending token, sample the next one, keep its KV.

Greedy output equals ``transformers`` ``generate(do_sample=False)`` token for token (tested).
"""

from __future__ import annotations

import torch

from dlm.decode.engine import Decoder, Engine, Row
from dlm.decode.sampling import next_token


class ARDecoder(Decoder):
    name = "ar"

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        return [row.last]

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        token = int(next_token(logits[0], row.params, engine.mask_token_id, row.generator))
        row.last = token
        return [token], 1
