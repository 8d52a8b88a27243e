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
    """Drafts at every step. A policy answers ``drafting`` / ``peek`` with a bool (draft or not, at the decoder's
    stride) or, where it chooses the stride, the stride (0: a plain AR step); ``observe`` is told that answer back
    with the step's seconds and committed tokens."""

    name = "always"

    def drafting(self, rows: int) -> bool | int:
        return True

    def peek(self, rows: int) -> bool | int:
        return True

    def observe(self, rows: int, drafted: bool | int, seconds: float, tokens: int) -> None:
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

    def spread(self) -> float:
        """The rate's relative standard error from the steps' committed tokens (a ratio estimator's: the tokens a
        row commits per step vary 1..N with the text, the step's time far less); inf with fewer than two steps."""
        n = len(self.steps)
        if n < 2 or not self.tokens:
            return math.inf
        per_row = self.tokens / self.rows
        dev = sum((t - per_row * r) ** 2 for _, t, r in self.steps) * n / (n - 1)
        return math.sqrt(dev) / self.tokens


AR = 0  # MeasuredDraft's mode of a plain AR step (its drafting modes: 1 alone, or the strides it chooses from)


class _Bucket:
    __slots__ = ("window", "burst_mode", "burst_left", "since", "period", "choice_before", "prior", "kept")

    def __init__(self, period: int, modes: list[int]):
        self.window = {m: _Window() for m in modes}
        self.burst_mode: int | None = None
        self.burst_left = 0
        # per mode: steps since its last exploration burst, and how many steps of another choice come between two
        self.since = dict.fromkeys(modes, 0)
        self.period = dict.fromkeys(modes, period)
        self.choice_before: int | None = None
        self.prior: int | None = None  # an earlier process's choice (PolicyMemory), until this one measured
        self.kept: tuple | None = None  # what PolicyMemory holds for this bucket


class PolicyMemory:
    """:class:`MeasuredDraft`'s choice per batch bucket, carried from one process to the next under ``key`` (the
    model folder, the machine and the decoder's setting: :func:`dlm.decode.isd.policy.memory_key`) in
    ``isd_policy.json`` under dlm's home. A record is ``{"t": time written, "buckets": {bucket: {"draft": bool,
    "period": int, "tok_s": [drafting, ar], "stride": int (0: AR) and "periods": {mode: int} (a policy that
    chooses the stride)}}}``; written
    when a bucket's choice or period changes (a few writes a run), never half-written; the ``KEEP`` most recently
    written records stay (a folder retrained in place gets a new key each time); a read-only home is not an error
    (nothing is carried)."""

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
    runs. The modes are a plain AR step and drafting - or, with ``strides`` (ISD's ``auto``: 2 up to the
    decoder's stride), drafting at each of those strides: :meth:`drafting` then answers the stride (0 for AR).

    - A new bucket starts in the mode a measured neighbour implies (AR chosen at a smaller batch -> AR; drafting
      chosen at a larger batch -> drafting; :meth:`_guess`) and tries the others at its first period; with no
      such neighbour it runs a drafting burst (at the smallest stride), then an AR burst, then picks. A burst is
      ``draft_burst`` (``ar_burst``) row-steps long, at least 3 (2) steps. The first step of a drafting mode after
      another mode is not counted: every row cold-starts there (one token, masks fed), a switching cost paid once
      per switch, not the steady state that the choice is about.
    - Strides are climbed as a ladder: stride s+1 is first measured once stride s beats AR and every stride below
      it (a larger stride costs more per step and its extra drafts are accepted only after the earlier ones, so
      where s loses, s+1 loses too - on CPUs, where each chunk token costs, N=2 is the usual winner); where
      drafting loses, only the smallest stride is ever re-tried, so the exploration costs what it costs with one
      stride.
    - The choice's neighbours (AR and the strides next to it; the smallest stride when AR wins) are each re-run
      for one burst after their own ``period`` of steps of the winner. A burst that confirms the choice sets the
      explored neighbour's period to the larger of its double (up to ``max_period``) and the period at which one
      burst of it costs at most its share of ``explore_cost`` (the neighbours share it) of the time between its
      bursts, the loss judged ``confidence`` standard errors smaller (:meth:`_affordable`); the first choice does
      so for every neighbour; a burst that flips the choice sets every period back to ``period``. So a far
      slower loser is re-tried rarely from the first choice on, not after a run of doublings: drafting at 0.7x
      AR (the default 30-minute quickstart checkpoint on a 2-core AVX2 CPU) cost a first process 6-7% of its
      tokens/s over 16 prompts x 64 tokens when the period doubled from 24 (0.93x AR measured, 0.95x in the
      simulation of tests/test_decode_schedule.py) and ~1-2% now (0.98-0.99x simulated).
    - ``margin``: drafting must beat AR (and a larger stride the best smaller one) by this fraction (drafting
      changes the sampling draws and costs memory; at parity AR is the safer pick; and a window of drafting steps
      is a noisy estimate - a row's tokens per step vary 1..N with the text - so a small lead is often noise: with
      0.02 the policy ran 0.96-0.97x AR at batch 1 on a checkpoint whose drafting ran 0.94x, with 0.04 and
      ``explore_cost`` 0.015 1.00x, same run).
    - ``memory`` (:class:`PolicyMemory`): a bucket that an earlier process decided starts in that mode with that
      period (no first bursts); once this process measured the modes it needs, its own rates decide, and each
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
        strides: list[int] | tuple[int, ...] | None = None,
        confidence: float = 1.0,
    ):
        if draft_burst < 1 or ar_burst < 1 or window < 1 or not explore_cost > 0:
            raise DLMError("MeasuredDraft: need draft_burst, ar_burst and window >= 1 and explore_cost > 0")
        if strides is not None and (
            not strides or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 2 for s in strides)
        ):
            raise DLMError(f"MeasuredDraft: strides must be integers >= 2 (N-1 drafts per step), got {strides!r}")
        self.window, self.draft_burst, self.ar_burst = window, draft_burst, ar_burst
        self.base_period, self.max_period, self.margin = period, max_period, margin
        self.explore_cost, self.confidence = explore_cost, confidence
        self.memory = memory
        self.strides = sorted(set(strides)) if strides is not None else None
        self.drafts: list[int] = list(self.strides) if self.strides is not None else [1]  # the drafting modes
        self.modes = [AR, *self.drafts]
        self.buckets: dict[int, _Bucket] = {}
        self._prev: int | None = None  # the previous step's mode (whatever its bucket); None before the first step
        self._switched = False

    @staticmethod
    def bucket_of(rows: int) -> int:
        return max(rows - 1, 0).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def _out(self, mode: int) -> bool | int:
        """What :meth:`drafting` / :meth:`peek` answer: the stride (0: AR) when choosing strides, else a bool."""
        return mode if self.strides is not None else bool(mode)

    def _mode_of(self, rec: dict) -> int:
        """The mode a :class:`PolicyMemory` record chose (a record without a stride drafted at the largest)."""
        stride = rec.get("stride")
        if self.strides is not None and isinstance(stride, int) and stride in self.modes:
            return stride
        return self.drafts[-1] if rec["draft"] else AR

    def _bucket(self, k: int) -> _Bucket:
        if k not in self.buckets:
            b = _Bucket(self.base_period, self.modes)
            # a neighbour whose choice implies this bucket's (_guess) passes on how far its exploration backed off:
            # a batch of 32 joining after 8 had learnt that drafting loses does not re-learn it from period 24
            inherited = [
                max(o.period.values())
                for j, o in self.buckets.items()
                if (j < k and self._decided(j) == AR) or (j > k and self._decided(j) not in (None, AR))
            ]
            b.period = dict.fromkeys(self.modes, max([self.base_period, *inherited]))
            rec = self.memory.get(k) if self.memory is not None else None
            if rec is not None:
                b.prior = self._mode_of(rec)
                periods = rec.get("periods")
                periods = periods if isinstance(periods, dict) else {}
                for m in self.modes:
                    p = periods.get(str(m), rec["period"])
                    b.period[m] = max(b.period[m], p if isinstance(p, int) else rec["period"])
                b.kept = (b.prior, tuple(b.period.values()))
            self.buckets[k] = b
        return self.buckets[k]

    def _decided(self, k: int) -> int | None:
        """The bucket's measured choice: the fastest drafting mode measured (a larger stride only when it beats
        the best smaller one by ``margin``) if it beats AR by ``margin``, else AR; None until AR and the smallest
        drafting mode are both measured."""
        b = self.buckets.get(k)
        if b is None:
            return None
        ar, best_rate = b.window[AR].rate(), b.window[self.drafts[0]].rate()
        if ar is None or best_rate is None:
            return None
        best = self.drafts[0]
        for m in self.drafts[1:]:
            r = b.window[m].rate()
            if r is not None and r > best_rate * (1 + self.margin):
                best, best_rate = m, r
        return best if best_rate > ar * (1 + self.margin) else AR

    def _verdict(self, k: int) -> int | None:
        """The bucket's choice: measured here, else an earlier process's (``memory``), else None."""
        best = self._decided(k)
        return best if best is not None or k not in self.buckets else self.buckets[k].prior

    def _guess(self, k: int) -> int | None:
        """A bucket's mode before it measured both: an earlier process's choice for it (``memory``); else the
        neighbours': the extra tokens of a drafting step cost more, relative to an AR step, the larger the batch,
        while acceptance does not depend on it. So AR chosen at a smaller batch means AR here, and drafting chosen
        at a larger batch means drafting here (at the nearest such batch's stride; no costly first burst)."""
        b = self.buckets.get(k)
        if b is not None and b.prior is not None:
            return b.prior
        if b is None and self.memory is not None and (rec := self.memory.get(k)) is not None:  # (peek, before use)
            return self._mode_of(rec)
        if any(self._verdict(j) == AR for j in self.buckets if j < k):
            return AR
        larger = sorted(j for j in self.buckets if j > k and self._verdict(j) not in (None, AR))
        return self._verdict(larger[0]) if larger else None

    def peek(self, rows: int) -> bool | int:
        """The mode the next step at this batch size would most likely run (no side effects): for the prefill of a
        joining request, which decides whether (and how many) masks it appends."""
        k = self.bucket_of(rows)
        b = self.buckets.get(k)
        if b is not None and b.burst_left > 0 and b.burst_mode is not None:
            return self._out(b.burst_mode)
        best = self._decided(k)
        if best is None:
            best = self._guess(k)
        return self._out(self.drafts[0] if best is None else best)

    def drafting(self, rows: int) -> bool | int:
        mode = self._choose(rows)
        self._switched = self._switch_to(mode)
        self._prev = mode
        return self._out(mode)

    def _switch_to(self, mode: int) -> bool:
        """Whether a step in ``mode`` cold-starts every row (a drafting mode after a different mode)."""
        return mode != AR and self._prev is not None and mode != self._prev

    def _neighbours(self, best: int) -> list[int]:
        """The modes next to ``best`` that exploration re-tries: the smallest stride when AR wins; else AR and the
        strides next to the winning one."""
        if best == AR:
            return [self.drafts[0]]
        i = self.drafts.index(best)
        return [AR, *self.drafts[max(i - 1, 0) : i], *self.drafts[i + 1 : i + 2]]

    def _choose(self, rows: int) -> int:
        k = self.bucket_of(rows)
        b = self._bucket(k)
        if b.burst_left > 0 and b.burst_mode is not None:
            b.burst_left -= 1
            return b.burst_mode
        best = self._decided(k)
        if b.burst_mode is not None and best is not None:
            # a burst just ended: back off the explored mode while it confirms the choice (at once as far as its
            # cost asks), start over when it flips it; the first choice backs off each of its neighbours
            tried = b.burst_mode
            if b.choice_before is None:
                for m in self._neighbours(best):
                    b.period[m] = max(b.period[m], self._affordable(b, best, m, rows))
            elif best == b.choice_before:
                b.period[tried] = max(min(2 * b.period[tried], self.max_period), self._affordable(b, best, tried, rows))
            else:
                b.period = dict.fromkeys(self.modes, self.base_period)
            b.choice_before = None
        if best is not None and self.memory is not None and b.kept != (best, tuple(b.period.values())):
            b.kept = (best, tuple(b.period.values()))
            self.memory.put(k, self._record(b, best))
        b.burst_mode = None
        if best is None:
            best = self._guess(k)
            if best is None:
                for mode in (self.drafts[0], AR):  # nothing to go by: measure both modes first
                    if not b.window[mode].steps:
                        return self._start_burst(b, mode, rows)
                best = self.drafts[0]  # (not reached: with steps in both windows both rates are known)
        elif best != AR and best != self.drafts[-1]:
            above = self.drafts[self.drafts.index(best) + 1]
            if not b.window[above].steps:  # the ladder: the next stride, once this one won
                b.choice_before = best
                return self._start_burst(b, above, rows)
        for m in self._neighbours(best):
            b.since[m] += 1
            if b.since[m] >= b.period[m]:
                b.since[m] = 0
                b.choice_before = best
                return self._start_burst(b, m, rows)
        return best

    def _drafting_rate(self, b: _Bucket) -> float | None:
        """The fastest measured drafting mode's committed tokens/s in this bucket (None before any)."""
        return max((r for m in self.drafts if (r := b.window[m].rate()) is not None), default=None)

    def _record(self, b: _Bucket, best: int) -> dict:
        """What :class:`PolicyMemory` keeps of a bucket: the choice, its neighbours' longest period, the rates."""
        rates = [self._drafting_rate(b) or 0.0, b.window[AR].rate() or 0.0]
        period = max(b.period[m] for m in self._neighbours(best))
        record: dict = {"draft": best != AR, "period": period, "tok_s": [round(r, 2) for r in rates]}
        if self.strides is not None:
            record["stride"] = best
            record["periods"] = {str(m): p for m, p in b.period.items()}
        return record

    def explore_period(self, rows: int) -> int:
        """Steps of the current choice between two exploration bursts of its slowest-explored neighbour, at this
        batch size (the base period before the bucket was seen)."""
        k = self.bucket_of(rows)
        b = self.buckets.get(k)
        if b is None:
            return self.base_period
        best = self._verdict(k)
        return max(b.period[m] for m in self._neighbours(self.drafts[0] if best is None else best))

    def _burst_steps(self, mode: int, rows: int) -> int:
        return max(3, -(-self.draft_burst // rows)) if mode != AR else max(2, -(-self.ar_burst // rows))

    def _affordable(self, b: _Bucket, best: int, loser: int, rows: int) -> int:
        """The fewest steps between bursts of ``loser`` at which one burst (and a drafting burst's cold start) costs
        at most ``explore_cost`` of the time: a burst's time x its loss of rate (1 - lose / win) over the winner's
        step time x ``explore_cost``. 0 where the loser is not measured slower."""
        win, lose = b.window[best], b.window[loser]
        rw, rl = win.rate(), lose.rate()
        if rw is None or not rl:
            return 0
        # the loss it is sure of: each rate moved ``confidence`` standard errors towards the other (a 16-step burst
        # of drafting at stride 4 measures its rate within ~16%: a bad one must not put off the next try for long)
        rw, rl = rw * (1 - self.confidence * win.spread()), rl * (1 + self.confidence * lose.spread())
        if rl >= rw:
            return 0
        burst = (self._burst_steps(loser, rows) + (loser != AR)) * lose.step_seconds()
        share = self.explore_cost / len(self._neighbours(best))  # the neighbours share the exploration's budget
        return math.ceil(burst * (1 - rl / rw) / (share * win.step_seconds()))

    def _start_burst(self, b: _Bucket, mode: int, rows: int) -> int:
        b.burst_mode = mode
        b.burst_left = self._burst_steps(mode, rows) - 1 + self._switch_to(mode)  # plus the uncounted cold start
        return mode

    def describe(self, rows: int = 1) -> dict:
        """What the policy measured at this batch size: the fastest drafting mode's and AR's committed tokens/s over
        their recent steps (None where not measured), the choice (``draft``, ``ar``, or None while undecided) and,
        when it chooses strides, the stride it drafts at."""
        k = self.bucket_of(rows)
        b = self.buckets.get(k)
        d = self._drafting_rate(b) if b else None
        a = b.window[AR].rate() if b else None
        best = self._decided(k)
        prior = b.prior if b else None
        name = lambda x: None if x is None else ("draft" if x != AR else "ar")  # noqa: E731
        out = {"drafting_tok_s": d, "ar_tok_s": a, "choice": name(best), "carried": name(prior)}
        if self.strides is not None:
            out["stride"] = best if best is not None else prior
        return out

    def observe(self, rows: int, drafted: bool | int, seconds: float, tokens: int) -> None:
        mode = int(drafted)
        if mode != AR and self._switched:
            return
        if seconds > 0 and math.isfinite(seconds) and rows > 0:
            window = self._bucket(self.bucket_of(rows)).window.get(mode)
            if window is not None:
                window.add(seconds, tokens, rows, self.window)


def make_policy(token_budget, stride: int, per_row: int | None = None, flag: str = "--isd-draft-budget", strides=None):
    """``None`` or ``'always'`` -> always draft; an int -> :class:`TokenBudget`; ``'auto'`` ->
    :class:`MeasuredDraft` (choosing among ``strides`` when given); an object with ``drafting``/``peek``/``observe``
    (a policy of your own) is used as is. ``flag``: the setting's flag, for the error of a bad value (ISD's, or
    prompt lookup's)."""
    if token_budget is None or (isinstance(token_budget, str) and token_budget.strip().lower() == "always"):
        return AlwaysDraft()
    if all(hasattr(token_budget, a) for a in ("drafting", "peek", "observe")):
        return token_budget
    if isinstance(token_budget, str):
        if token_budget.strip().lower() == "auto":
            return MeasuredDraft(strides=strides)
        try:
            token_budget = int(token_budget)
        except ValueError:
            raise DLMError(f"{flag} must be a positive integer, 'auto' or 'always', got {token_budget!r}") from None
    return TokenBudget(token_budget, stride, per_row, flag)
