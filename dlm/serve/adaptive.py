"""ISD that stops drafting while the running batch is large: a serving policy, not a new sampler.

Speculation costs compute: an ISD row feeds 2N-1 tokens per step for at most N committed ones. When the device
is latency-bound (one request, or a GPU at small batch) the extra tokens are almost free; once the batch makes it
compute-bound (a CPU at 8+ requests, a GPU at large batch), they are not. :class:`BudgetedISD` runs ISD while
``running rows x (2N - 1) <= token_budget`` and plain AR steps (``[pending token]`` chunks) above it.

Exactness is unchanged: an AR step draws the next token from the model's own p (greedy: its argmax), exactly the
distribution ISD preserves; pending drafts are simply dropped and the row cold-starts when drafting resumes.

A thin subclass of :class:`dlm.decode.isd.ISDDecoder` kept in ``dlm/serve`` until the engine grows a scheduling
hook of its own; it relies on the decoder's documented behaviour that a one-token chunk is an AR step.
"""

from __future__ import annotations

from dlm.decode.isd import ISDDecoder
from dlm.errors import DLMError


class BudgetedISD(ISDDecoder):
    name = "isd"

    def __init__(self, token_budget: int, stride: int | None = None, draft: str = "sample"):
        super().__init__(stride=stride, draft=draft)
        if not isinstance(token_budget, int) or token_budget < 1:
            raise DLMError(f"--isd-token-budget must be a positive integer, got {token_budget}")
        self.token_budget = token_budget

    def drafting(self, engine, rows: int) -> bool:
        """Whether ISD runs with ``rows`` requests in the batch."""
        return rows * (2 * self.stride - 1) <= self.token_budget

    def prefill_suffix(self, engine, row) -> list[int]:
        suffix = super().prefill_suffix(engine, row)  # also resets the row's ISD state
        # the joining row counts itself: with a full batch its prefill is a plain AR step (no masks)
        return suffix if self.drafting(engine, len(engine.rows) + 1) else []

    def chunk(self, engine, row) -> list[int]:
        if not self.drafting(engine, len(engine.rows)):
            row.state.update(mode="ar", drafts=None, q=None)
            return [row.last]
        return super().chunk(engine, row)
