"""Plain autoregressive decoding on the engine: feed the pending token, sample the next one, keep its KV.

Greedy output equals ``transformers`` ``generate(do_sample=False)`` token for token (tested).
"""

from __future__ import annotations

import torch

from dlm.decode.engine import Decoder, Engine, Row
from dlm.decode.sampling import next_token, suppress


class ARDecoder(Decoder):
    name = "ar"

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        return [row.last]

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        token = int(next_token(logits[0], row.params, engine.mask_token_id, row.generator))
        row.last = token
        return [token], 1

    def consume_batch(self, engine: Engine, rows: list[Row], logits: torch.Tensor, lengths: list[int]):
        """The greedy rows' next tokens in one argmax over their logits and one host read (each row's argmax is
        its own: the same tokens as row by row); sampled rows draw from their own generators as before."""
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) < 2:
            return super().consume_batch(engine, rows, logits, lengths)
        idx = torch.tensor(greedy, device=logits.device) if len(greedy) < len(rows) else None
        last = logits[:, 0] if idx is None else logits[idx, 0]
        tokens = dict(zip(greedy, suppress(last, engine.mask_token_id).argmax(-1).tolist()))
        out = []
        for i, row in enumerate(rows):
            token = (
                tokens[i]
                if i in tokens
                else int(next_token(logits[i, 0], row.params, engine.mask_token_id, row.generator))
            )
            row.last = token
            out.append(([token], 1))
        return out
