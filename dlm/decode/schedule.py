"""When ISD's drafts pay: per-step draft policies (plain AR steps otherwise; the output stays exact either way).

Speculation costs compute. An ISD row feeds up to 2N-1 tokens per step for at most N committed ones. While the
device is latency-bound (one request; a GPU at small batch) the extra tokens are nearly free and drafting wins;
once the batch makes it compute-bound (this CPU at 8 requests: a verify step costs 1.4x an AR step) they are
not, and a low acceptance never pays. A policy says, before each decode step, whether the step drafts (ISD
chunks) or runs plain AR steps (``[pending token]`` chunks: the model's own next-token distribution, exactly what
ISD preserves; pending drafts are dropped and rows cold-start when drafting resumes).

- :class:`AlwaysDraft`: ISD at every step (the default; ``dlm serve`` takes ``auto``);
- :class:`TokenBudget`: draft while ``running rows x (2N-1) <= budget`` tokens per step (a fixed rule);
- :class:`MeasuredDraft` (``auto``): measures, per batch-size bucket, committed tokens per second of decode
  step with and without drafting, and runs the faster (goodput-based speculation control, as in SmartSpec,
  Liu et al. 2024). Both modes are tried when a bucket is first seen; the losing one is re-tried in short bursts,
  less and less often while it keeps losing (exponential back-off), so the choice follows acceptance and load
  drift. Greedy output is the same token for token whatever it picks; with sampling the output keeps the model's
  distribution but a seed no longer fixes the draws (AR and ISD steps use the generator differently and the
  choice depends on measured time).

What :class:`MeasuredDraft` learns per bucket (its choice and how far its exploration backed off) is kept for the
next process on the same model folder, machine and decoder setting (:class:`PolicyMemory`, ``isd_policy.json``
under dlm's home; ISD only): a one-shot ``dlm generate`` then starts in the mode that won before and explores the
other at the backed-off period, instead of paying a first drafting burst at every start (a loss of 3-5% of a
64-token batch where drafting runs at half AR's speed). The exploration still runs, so a stale record is
corrected as any drift is; deleting the file forgets every record.
"""

from __future__ import annotations

import collections
import math
import time

from dlm.errors import DLMError
from dlm.fsutil import read_records, write_record


class AlwaysDraft:
    name = "always"

    def drafting(self, rows: int) -> bool:
        return True

    def peek(self, rows: int) -> bool:
        return True

    def observe(self, rows: int, drafted: bool, seconds: float, tokens: int) -> None:
        pass


class TokenBudget(AlwaysDraft):
    name = "budget"

    def __init__(self, budget: int, stride: int, per_row: int | None = None, flag: str = "--isd-draft-budget"):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise DLMError(f"{flag} must be a positive integer, 'auto' or 'always', got {budget!r}")
        self.budget, self.stride = budget, stride
        self.per_row = per_row or 2 * stride - 1  # tokens a row feeds in a verify step

    def drafting(self, rows: int) -> bool:
        return rows * self.per_row <= self.budget

    peek = drafting


class _Window:
    """One mode's most recent decode steps, covering at least ``size`` row-steps, with running totals."""

    __slots__ = ("steps", "seconds", "tokens", "rows")

    def __init__(self):
        self.steps = collections.deque()  # (seconds, tokens, rows)
        self.seconds, self.tokens, self.rows = 0.0, 0, 0

    def add(self, seconds: float, tokens: int, rows: int, size: int) -> None:
        self.steps.append((seconds, tokens, rows))
        self.seconds, self.tokens, self.rows = self.seconds + seconds, self.tokens + tokens, self.rows + rows
        while self.rows - self.steps[0][2] >= size:
            s, t, r = self.steps.popleft()
            self.seconds, self.tokens, self.rows = self.seconds - s, self.tokens - t, self.rows - r

    def rate(self) -> float | None:
        """Committed tokens per second (None before any step)."""
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None

    def step_seconds(self) -> float:
        """Mean seconds of a step (over a window with steps)."""
        return self.seconds / len(self.steps)


class _Bucket:
    __slots__ = ("window", "burst_mode", "burst_left", "since", "period", "choice_before", "prior", "kept")

    def __init__(self, period: int):
        self.window = {True: _Window(), False: _Window()}
        self.burst_mode: bool | None = None
        self.burst_left = 0
        self.since = 0
        self.period = period
        self.choice_before: bool | None = None
        self.prior: bool | None = None  # an earlier process's choice (PolicyMemory), until this one measured both
        self.kept: tuple | None = None  # what PolicyMemory holds for this bucket


class PolicyMemory:
    """:class:`MeasuredDraft`'s choice per batch bucket, carried from one process to the next under ``key`` (the
    model folder, the machine and the decoder's setting: :func:`dlm.decode.isd.policy.memory_key`) in
    ``isd_policy.json`` under dlm's home. A record is ``{"t": time written, "buckets": {bucket: {"draft": bool,
    "period": int, "tok_s": [drafting, ar]}}}``; written when a bucket's choice or period changes (a few writes a
    run), never half-written; the ``KEEP`` most recently written records stay (a folder retrained in place gets a
    new key each time); a read-only home is not an error (nothing is carried)."""

    FILE = "isd_policy.json"
    KEEP = 64

    def __init__(self, key: str):
        self.key = key
        rec = read_records(self.FILE).get(key)
        buckets = rec.get("buckets") if isinstance(rec, dict) else None
        self.buckets: dict[str, dict] = buckets if isinstance(buckets, dict) else {}

    def get(self, bucket: int) -> dict | None:
        r = self.buckets.get(str(bucket))
        ok = isinstance(r, dict) and isinstance(r.get("draft"), bool) and isinstance(r.get("period"), int)
        return r if ok else None

    def put(self, bucket: int, record: dict) -> None:
        self.buckets[str(bucket)] = record
        write_record(self.FILE, self.key, {"t": round(time.time(), 3), "buckets": self.buckets}, keep=self.KEEP)


class MeasuredDraft(AlwaysDraft):
    """Goodput-based drafting: per batch-size bucket (1, 2, 3-4, 5-8, ...), the committed tokens per second of
    each mode's most recent decode steps covering ``window`` row-steps (96 steps alone, 12 at batch 8: a row's
    tokens per step vary, 1 or up to N, so the estimate needs rows x steps samples, not steps); the faster mode
    runs.

    - A new bucket starts in the mode a measured neighbour implies (AR chosen at a smaller batch -> AR; drafting
      chosen at a larger batch -> drafting; :meth:`_guess`) and tries the other at its first period; with no
      such neighbour it runs a drafting burst, then an AR burst, then picks. A burst is ``draft_burst``
      (``ar_burst``) row-steps long, at least 3 (2) steps. The first drafting step after AR steps is not counted:
      every row cold-starts there (one token, masks fed), a switching cost paid once per switch, not the steady
      state that the choice is about.
    - The losing mode is re-run for one burst after ``period`` steps of the winner. Each burst that confirms the
      choice (and the first choice) sets the period to the larger of its double (up to ``max_period``) and the
      period at which one burst costs at most ``explore_cost`` of the time between bursts (:meth:`_affordable`);
      a burst that flips the choice sets it back to ``period``. So a far slower loser is re-tried rarely from the
      first choice on, not after a run of doublings: drafting at 0.7x AR (the default 30-minute quickstart
      checkpoint on a 2-core AVX2 CPU) cost a first process 6-7% of its tokens/s over 16 prompts x 64 tokens when
      the period doubled from 24 (0.93x AR measured, 0.95x in the simulation of tests/test_decode_schedule.py) and
      ~1-2% now (0.98-0.99x simulated).
    - ``margin``: drafting must beat AR by this fraction (drafting changes the sampling draws and costs memory;
      at parity AR is the safer pick; and a window of drafting steps is a noisy estimate - a row's tokens per step
      vary 1..N with the text - so a small lead is often noise: with 0.02 the policy ran 0.96-0.97x AR at batch 1
      on a checkpoint whose drafting ran 0.94x, with 0.04 and ``explore_cost`` 0.015 1.00x, same run).
    - ``memory`` (:class:`PolicyMemory`): a bucket that an earlier process decided starts in that mode with that
      period (no first bursts); once both modes are measured here, this process's own rates decide, and each
      choice or period it settles is written back.
    """

    name = "auto"

    def __init__(
        self,
        window: int = 96,
        draft_burst: int = 16,
        ar_burst: int = 4,
        period: int = 24,
        max_period: int = 96,
        margin: float = 0.04,
        explore_cost: float = 0.01,
        memory: PolicyMemory | None = None,
    ):
        if draft_burst < 1 or ar_burst < 1 or window < 1 or not explore_cost > 0:
            raise DLMError("MeasuredDraft: need draft_burst, ar_burst and window >= 1 and explore_cost > 0")
        self.window, self.draft_burst, self.ar_burst = window, draft_burst, ar_burst
        self.base_period, self.max_period, self.margin = period, max_period, margin
        self.explore_cost = explore_cost
        self.memory = memory
        self.buckets: dict[int, _Bucket] = {}
        self._prev = True  # the previous step's mode (whatever its bucket): rows carry their ISD state across
        self._switched = False

    @staticmethod
    def bucket_of(rows: int) -> int:
        return max(rows - 1, 0).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def _bucket(self, k: int) -> _Bucket:
        if k not in self.buckets:
            b = _Bucket(self.base_period)
            # a neighbour whose choice implies this bucket's (_guess) passes on how far its exploration backed off:
            # a batch of 32 joining after 8 had learnt that drafting loses does not re-learn it from period 24
            inherited = [
                o.period
                for j, o in self.buckets.items()
                if (j < k and self._decided(j) is False) or (j > k and self._decided(j) is True)
            ]
            b.period = max([self.base_period, *inherited])
            rec = self.memory.get(k) if self.memory is not None else None
            if rec is not None:
                b.prior, b.period = rec["draft"], max(b.period, rec["period"])
                b.kept = (rec["draft"], rec["period"])
            self.buckets[k] = b
        return self.buckets[k]

    def _decided(self, k: int) -> bool | None:
        b = self.buckets.get(k)
        if b is None:
            return None
        d, a = b.window[True].rate(), b.window[False].rate()
        if d is None or a is None:
            return None
        return d > a * (1 + self.margin)

    def _verdict(self, k: int) -> bool | None:
        """The bucket's choice: measured here, else an earlier process's (``memory``), else None."""
        best = self._decided(k)
        return best if best is not None or k not in self.buckets else self.buckets[k].prior

    def _guess(self, k: int) -> bool | None:
        """A bucket's mode before it measured both: an earlier process's choice for it (``memory``); else the
        neighbours': the extra tokens of a drafting step cost more, relative to an AR step, the larger the batch,
        while acceptance does not depend on it. So AR chosen at a smaller batch means AR here, and drafting chosen
        at a larger batch means drafting here (no costly first burst)."""
        b = self.buckets.get(k)
        if b is not None and b.prior is not None:
            return b.prior
        if b is None and self.memory is not None and (rec := self.memory.get(k)) is not None:  # (peek, before use)
            return rec["draft"]
        if any(self._verdict(j) is False for j in self.buckets if j < k):
            return False
        if any(self._verdict(j) is True for j in self.buckets if j > k):
            return True
        return None

    def peek(self, rows: int) -> bool:
        """The mode the next step at this batch size would most likely run (no side effects): for the prefill of a
        joining request, which decides whether it appends its first masks."""
        k = self.bucket_of(rows)
        b = self.buckets.get(k)
        if b is not None and b.burst_left > 0:
            return bool(b.burst_mode)
        best = self._decided(k)
        if best is None:
            best = self._guess(k)
        return True if best is None else best

    def drafting(self, rows: int) -> bool:
        mode = self._choose(rows)
        self._switched = mode and not self._prev
        self._prev = mode
        return mode

    def _choose(self, rows: int) -> bool:
        k = self.bucket_of(rows)
        b = self._bucket(k)
        if b.burst_left > 0:
            b.burst_left -= 1
            return bool(b.burst_mode)
        best = self._decided(k)
        if b.burst_mode is not None and best is not None:
            # a burst just ended: back off while it confirms the choice (at once as far as the loser's cost asks),
            # start over when it flips it
            if b.choice_before is None or best == b.choice_before:
                doubled = b.period if b.choice_before is None else min(2 * b.period, self.max_period)
                b.period = max(doubled, self._affordable(b, best, rows))
            else:
                b.period = self.base_period
            b.choice_before = None
        if best is not None and self.memory is not None and b.kept != (best, b.period):
            b.kept = (best, b.period)
            rates = [b.window[True].rate(), b.window[False].rate()]
            self.memory.put(k, {"draft": best, "period": b.period, "tok_s": [round(r or 0.0, 2) for r in rates]})
        b.burst_mode = None
        if best is None:
            best = self._guess(k)
            if best is None:
                for mode in (True, False):  # nothing to go by: measure both modes first
                    if not b.window[mode].steps:
                        return self._start_burst(b, mode, rows)
                best = True  # (not reached: with steps in both windows both rates are known, so _decided chose)
        b.since += 1
        if b.since >= b.period:
            b.since = 0
            b.choice_before = best
            return self._start_burst(b, not best, rows)
        return best

    def _burst_steps(self, mode: bool, rows: int) -> int:
        return max(3, -(-self.draft_burst // rows)) if mode else max(2, -(-self.ar_burst // rows))

    def _affordable(self, b: _Bucket, best: bool, rows: int) -> int:
        """The fewest steps between bursts of the losing mode at which one burst (and a drafting burst's cold start)
        costs at most ``explore_cost`` of the time: a burst's time x its loss of rate (1 - lose / win) over the
        winner's step time x ``explore_cost``. 0 where the loser is not measured slower."""
        win, lose = b.window[best], b.window[not best]
        rw, rl = win.rate(), lose.rate()
        if rw is None or not rl or rl >= rw:
            return 0
        burst = (self._burst_steps(not best, rows) + (not best)) * lose.step_seconds()
        return math.ceil(burst * (1 - rl / rw) / (self.explore_cost * win.step_seconds()))

    def _start_burst(self, b: _Bucket, mode: bool, rows: int) -> bool:
        b.burst_mode = mode
        b.burst_left = self._burst_steps(mode, rows) - 1 + (mode and not self._prev)  # plus the uncounted cold start
        return mode

    def describe(self, rows: int = 1) -> dict:
        """What the policy measured at this batch size: each mode's committed tokens/s over its recent steps
        (None where not measured) and its choice (``draft``, ``ar``, or None while undecided)."""
        b = self.buckets.get(self.bucket_of(rows))
        d = b.window[True].rate() if b else None
        a = b.window[False].rate() if b else None
        best = self._decided(self.bucket_of(rows))
        prior = b.prior if b else None
        name = lambda x: None if x is None else ("draft" if x else "ar")  # noqa: E731
        return {"drafting_tok_s": d, "ar_tok_s": a, "choice": name(best), "carried": name(prior)}

    def observe(self, rows: int, drafted: bool, seconds: float, tokens: int) -> None:
        if drafted and self._switched:
            return
        if seconds > 0 and math.isfinite(seconds) and rows > 0:
            self._bucket(self.bucket_of(rows)).window[drafted].add(seconds, tokens, rows, self.window)


def make_policy(token_budget, stride: int, per_row: int | None = None, flag: str = "--isd-draft-budget"):
    """``None`` or ``'always'`` -> always draft; an int -> :class:`TokenBudget`; ``'auto'`` ->
    :class:`MeasuredDraft`; an object with ``drafting``/``peek``/``observe`` (a policy of your own) is used as
    is. ``flag``: the setting's flag, for the error of a bad value (ISD's, or prompt lookup's)."""
    if token_budget is None or (isinstance(token_budget, str) and token_budget.strip().lower() == "always"):
        return AlwaysDraft()
    if all(hasattr(token_budget, a) for a in ("drafting", "peek", "observe")):
        return token_budget
    if isinstance(token_budget, str):
        if token_budget.strip().lower() == "auto":
            return MeasuredDraft()
        try:
            token_budget = int(token_budget)
        except ValueError:
            raise DLMError(f"{flag} must be a positive integer, 'auto' or 'always', got {token_budget!r}") from None
    return TokenBudget(token_budget, stride, per_row, flag)
