"""Plain autoregressive decoding on the engine: feed the pending token, sample the next one, keep its KV.

Greedy output equals ``transformers`` ``generate(do_sample=False)`` token for token (tested).

Under a structured output the grammar often forces the next tokens (a JSON schema's keys and punctuation). They are
fed with the pending token in one chunk and verified as speculative drafts proposed with certainty (q one-hot):
each is kept with the probability the constrained model gives it - greedy: if it is the argmax - and the first
one refused is replaced by a draw from the rest of the distribution, so the output is exactly the one-token-a-step
output while a forward commits up to ``dlm.decode.structured.MAX_AHEAD`` + 1 tokens (jump-forward decoding, without appending anything
unverified).
"""

from __future__ import annotations

import torch

from dlm.decode.engine import Decoder, Engine, Row
from dlm.decode.isd.accept import verify_forced
from dlm.decode.sampling import next_token, suppress


class ARDecoder(Decoder):
    name = "ar"

    # row.state (the decoder's own): {"ahead": the forced tokens the row's next chunk verifies}

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        return [row.last, *row.state.get("ahead", ())]

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        ahead = self.forced_first(row)  # verified in the prefill's forward (consume)
        if ahead:
            row.state["ahead"] = ahead
        return ahead

    def forced(self, engine: Engine, row: Row, tokens: list[int]) -> None:
        row.state["ahead"] = tokens

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        ahead = row.state.pop("ahead", [])
        if not ahead or logits.shape[0] <= len(ahead):  # a plain step (or a prefill: one logit)
            token = int(next_token(logits[0], row.params, engine.mask_token_id, row.generator))
            row.last = token
            return [token], 1
        committed, keep = verify_forced(logits, ahead, row.params, engine.mask_token_id, row.generator)
        row.last = committed[-1]
        return committed, keep

    def consume_batch(self, engine: Engine, rows: list[Row], logits: torch.Tensor, lengths: list[int]):
        """The greedy rows' next tokens in one argmax over their logits and one host read (each row's argmax is
        its own: the same tokens as row by row); sampled rows, and rows verifying forced tokens, one by one."""
        greedy = [i for i, row in enumerate(rows) if row.params.greedy and lengths[i] == 1]
        if len(greedy) < 2:
            return super().consume_batch(engine, rows, logits, lengths)
        idx = torch.tensor(greedy, device=logits.device) if len(greedy) < len(rows) else None
        last = logits[:, 0] if idx is None else logits[idx, 0]
        tokens = dict(zip(greedy, suppress(last, engine.mask_token_id).argmax(-1).tolist()))
        out = []
        for i, row in enumerate(rows):
            if i in tokens:
                row.last = tokens[i]
                out.append(([tokens[i]], 1))
            else:
                out.append(self.consume(engine, row, logits[i, : lengths[i]]))
        return out
