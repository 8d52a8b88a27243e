"""Plain autoregressive decoding on the engine: feed the pending token, sample the next one, keep its KV.

Greedy output equals ``transformers`` ``generate(do_sample=False)`` token for token (tested).

Under a structured output the grammar often forces the next tokens (a JSON schema's keys and punctuation). They are
fed with the pending token in one chunk and verified as speculative drafts proposed with certainty (q one-hot):
each is kept with the probability the constrained model gives it - greedy: if it is the argmax - and the first
one refused is replaced by a draw from the rest of the distribution, so the output is exactly the one-token-a-step
output while a forward commits up to ``dlm.decode.structured.MAX_AHEAD`` + 1 tokens (jump-forward decoding, without appending anything
unverified).

Prompt lookup (``prompt_lookup=K``, vLLM's ``ngram`` speculation): where no forced tokens are due, the longest of the
output's last n-grams (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) that occurred earlier in the
prompt or output proposes the up to K tokens that followed its latest occurrence; they are verified the same way
(a proposal made with certainty), so the output is exactly AR's - greedy token for token, sampled in distribution -
and a forward commits several tokens where the answer copies. The n-grams are indexed per request as tokens come,
so a lookup costs a few dictionary reads, not a scan of the context. A request proposes fewer drafts after its
drafts are refused (one more than it kept) and twice as many again after all are kept: where its n-grams keep
misleading it, it pays for one draft a step instead of K. ``lookup_budget`` says when a step drafts at all, as ISD's
``draft_budget`` does (``'auto'``: whichever of drafting and plain steps commits more tokens per second at this
batch size).
"""

from __future__ import annotations

import torch

from dlm.decode.configs import ARConfig, decoder_config
from dlm.decode.engine import Decoder, Engine, Row
from dlm.decode.isd.accept import verify_forced
from dlm.decode.sampling import argmax_no_mask, next_token
from dlm.decode.schedule import make_policy


class ARDecoder(Decoder):
    name = "ar"

    # row.state (the decoder's own): {"ahead": the forced tokens or prompt-lookup drafts the row's next chunk
    # verifies, "drafted": whether they are drafts, "lookup": the row's n-gram index (NgramIndex), "k": how many
    # drafts it proposes next}

    def __init__(self, config: ARConfig | None = None):
        self.config = config = decoder_config(ARConfig, config)
        prompt_lookup, lookup_budget = config.prompt_lookup, config.lookup_budget
        self.prompt_lookup, self.lookup_min, self.lookup_max = (
            prompt_lookup,
            config.prompt_lookup_min,
            config.prompt_lookup_max,
        )
        # when a step drafts (dlm.decode.schedule, as ISD's --isd-draft-budget): a row feeds K + 1 tokens
        self.policy = (
            make_policy(lookup_budget, 2, prompt_lookup + 1, "--prompt-lookup-budget") if prompt_lookup else None
        )
        self._drafting = True

    def plan_step(self, engine: Engine, rows: list[Row]) -> None:
        if self.policy is not None:
            self._drafting = self.policy.drafting(len(rows))

    def step_done(self, engine: Engine, rows: list[Row], seconds: float, tokens: int) -> None:
        if self.policy is not None:
            self.policy.observe(len(rows), self._drafting, seconds, tokens)

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        if self.prompt_lookup and self._drafting and "ahead" not in row.state:
            # the chunk's positions must fit the context, and its commits (accepted + 1) the length limit
            room = min(
                row.state.get("k", self.prompt_lookup),
                engine.max_positions - row.pos - 1,
                row.params.max_new_tokens - len(row.out) - 1,
            )
            if room > 0:
                index = row.state.get("lookup")
                if index is None:
                    index = row.state["lookup"] = NgramIndex(self.lookup_min, self.lookup_max)
                drafts = index.propose(row.prompt_ids, row.out, room)
                if drafts:
                    row.state["ahead"], row.state["drafted"] = drafts, True
                    if not row.stats.proposed:  # one count for all of a request's drafts
                        row.stats.proposed, row.stats.accepted = [0], [0]
                    row.stats.proposed[0] += len(drafts)
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
        drafted = row.state.pop("drafted", False)
        if not ahead or logits.shape[0] <= len(ahead):  # a plain step (or a prefill: one logit)
            token = int(next_token(logits[0], row.params, engine.mask_token_id, row.generator))
            row.last = token
            return [token], 1
        committed, keep = verify_forced(logits, ahead, row.params, engine.mask_token_id, row.generator)
        row.last = committed[-1]
        if drafted:  # prompt-lookup drafts
            row.stats.accepted[0] += keep - 1
            # how many to propose next: all kept -> twice as many (up to K); else one more than were kept, so a
            # request whose copies keep failing pays for one draft a step, not K
            k = len(ahead)
            row.state["k"] = min(self.prompt_lookup, 2 * k) if keep - 1 == k else keep
        return committed, keep

    def consume_batch(self, engine: Engine, rows: list[Row], logits: torch.Tensor, lengths: list[int]):
        """The greedy rows' next tokens in one argmax over their logits and one host read (each row's argmax is
        its own: the same tokens as row by row); sampled rows, and rows verifying forced tokens, one by one."""
        greedy = [i for i, row in enumerate(rows) if row.params.greedy and lengths[i] == 1]
        if len(greedy) < 2:
            return super().consume_batch(engine, rows, logits, lengths)
        idx = torch.tensor(greedy, device=logits.device) if len(greedy) < len(rows) else None
        last = logits[:, 0] if idx is None else logits[idx, 0]
        tokens = dict(zip(greedy, argmax_no_mask(last, engine.mask_token_id).tolist()))
        out = []
        for i, row in enumerate(rows):
            if i in tokens:
                row.last = tokens[i]
                out.append(([tokens[i]], 1))
            else:
                out.append(self.consume(engine, row, logits[i, : lengths[i]]))
        return out


class NgramIndex:
    """A request's n-grams (``lo`` to ``hi`` tokens) by where they occurred last, for prompt lookup. ``propose``
    indexes the tokens that came since its last call (every n-gram that ends before the last token, so the
    output's own last n-gram is found only where it occurred before) and answers the tokens that followed the
    latest earlier occurrence of the longest last n-gram that has one."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> the position right after its latest occurrence
        self.done = 0  # n-grams ending before this position are indexed

    def propose(self, prompt: list[int], out: list[int], k: int) -> list[int]:
        seq = prompt + out if out else prompt
        end = len(seq) - 1  # the last token's position: its n-grams are the query, indexed next time
        for e in range(self.done, end):
            for n in range(self.lo, min(self.hi, e + 1) + 1):
                self.last[tuple(seq[e - n + 1 : e + 1])] = e + 1
        self.done = max(self.done, end)
        for n in range(min(self.hi, len(seq)), self.lo - 1, -1):
            at = self.last.get(tuple(seq[len(seq) - n :]))
            if at is not None:
                return seq[at : at + k]
        return []
