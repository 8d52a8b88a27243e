"""Server metrics in the Prometheus text exposition format (no client library needed).

Written by the engine thread and the HTTP handlers, read by ``GET /metrics``; one lock guards everything (the
updates are a handful of additions per request).

Exposed (all prefixed ``dlm_``):

- ``requests_total{finish_reason}``, ``request_errors_total{status}``: finished engine requests / HTTP errors;
- ``prompt_tokens_total``, ``generation_tokens_total``, ``forwards_total`` (request-forwards, prefill included),
  ``prompt_tokens_cached_total`` (prompt tokens whose KV came from the prefix cache),
  ``engine_steps_total``, ``tokens_per_forward`` (generation tokens / request-forwards since start);
- ``draft_proposed_total``, ``draft_accepted_total``, ``draft_acceptance`` (ISD acceptance, all draft positions);
- ``isd_steps_total{mode}``: ISD decode steps that drafted / ran plain AR steps (``--isd-draft-budget``);
- ``isd_draft_steps_total{stride}``: ISD drafting steps by the stride they drafted at;
- ``isd_verify_rows_total{next}``: ISD verify row-steps whose outcome had its masks in the chunk (``verify``: the
  next step verifies again) or not (``cold``: a cold start follows), see ``--isd-fallback``;
- ``queue_length`` (requests waiting for a batch slot), ``running_requests`` (in the running batch);
- histograms ``time_to_first_token_seconds``, ``time_per_output_token_seconds``, ``request_latency_seconds``.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dlm.decode.isd.stats import StepCounts

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """A cumulative Prometheus histogram (``le`` buckets, ``_sum``, ``_count``)."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for le, c in zip(self.buckets + (float("inf"),), self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{"+Inf" if le == float("inf") else repr(float(le))}"}} {acc}')
        out.append(f"{name}_sum {self.sum!r}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = defaultdict(int)  # finish_reason -> count
        self.errors = defaultdict(int)  # http status -> count
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.forwards = 0
        self.steps = 0
        self.proposed = 0
        self.accepted = 0
        self.isd_steps: dict = {}
        self.isd_strides: dict = {}
        self.isd_branches: dict = {}
        self.queue_length = 0
        self.running = 0
        self.prefix_tokens: int | None = None  # tokens whose KV the prefix cache keeps (None: no cache)
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(TOKEN_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)

    # -- updates --------------------------------------------------------------------------------------------
    def on_step(
        self,
        queue_length: int,
        running: int,
        isd: StepCounts | None = None,
        prefix_tokens: int | None = None,
    ) -> None:
        """One engine step ran; ``isd``: the ISD decoder's step counters (None for other decoders)."""
        with self.lock:
            self.steps += 1
            self.queue_length, self.running = queue_length, running
            self.prefix_tokens = prefix_tokens
            if isd is not None:
                self.isd_steps = dict(isd.mode_steps)
                self.isd_strides = dict(isd.stride_steps)
                self.isd_branches = dict(isd.branch_steps)

    def set_load(self, queue_length: int, running: int) -> None:
        with self.lock:
            self.queue_length, self.running = queue_length, running

    def on_finished(self, finish_reason: str, stats, ttft: float | None, latency: float) -> None:
        """One engine request finished (``stats``: its :class:`dlm.decode.sampling.RequestStats`)."""
        with self.lock:
            self.requests[finish_reason] += 1
            self.prompt_tokens += stats.prompt_tokens
            self.cached_prompt_tokens += getattr(stats, "cached_tokens", 0)
            self.generation_tokens += stats.new_tokens
            self.forwards += stats.forwards
            self.proposed += sum(stats.proposed)
            self.accepted += sum(stats.accepted)
            if ttft is not None:
                self.ttft.observe(ttft)
                if stats.new_tokens > 1:
                    self.tpot.observe(max(latency - ttft, 0.0) / (stats.new_tokens - 1))
            self.latency.observe(latency)

    def on_error(self, status: int) -> None:
        with self.lock:
            self.errors[status] += 1

    # -- exposition ---------------------------------------------------------------------------------------
    def render(self) -> str:
        with self.lock:
            lines: list[str] = []

            def metric(name, kind, help_text, samples):
                lines.append(f"# HELP dlm_{name} {help_text}")
                lines.append(f"# TYPE dlm_{name} {kind}")
                for labels, value in samples:
                    lines.append(f"dlm_{name}{labels} {value}")

            reqs = sorted(self.requests.items()) or [("stop", 0)]
            metric(
                "requests_total",
                "counter",
                "Finished generation requests (one per choice).",
                [(f'{{finish_reason="{k}"}}', v) for k, v in reqs],
            )
            errs = sorted(self.errors.items())
            metric(
                "request_errors_total",
                "counter",
                "HTTP requests answered with an error status.",
                [(f'{{status="{k}"}}', v) for k, v in errs] or [("", 0)],
            )
            metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", self.prompt_tokens)])
            metric(
                "prompt_tokens_cached_total",
                "counter",
                "Prompt tokens whose KV came from the prefix cache (--prefix-cache-tokens) instead of a forward.",
                [("", self.cached_prompt_tokens)],
            )
            if self.prefix_tokens is not None:
                metric(
                    "prefix_cache_tokens",
                    "gauge",
                    "Tokens whose KV the prefix cache keeps now (each once; at most --prefix-cache-tokens).",
                    [("", self.prefix_tokens)],
                )
            metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generation_tokens)])
            metric(
                "forwards_total",
                "counter",
                "Model forwards that advanced a request (per request).",
                [("", self.forwards)],
            )
            metric("engine_steps_total", "counter", "Engine steps (one batched forward each).", [("", self.steps)])
            tpf = self.generation_tokens / self.forwards if self.forwards else 0.0
            metric(
                "tokens_per_forward",
                "gauge",
                "Generated tokens per request-forward since start (TPF).",
                [("", round(tpf, 6))],
            )
            metric("draft_proposed_total", "counter", "ISD drafts proposed.", [("", self.proposed)])
            metric("draft_accepted_total", "counter", "ISD drafts accepted.", [("", self.accepted)])
            acc = self.accepted / self.proposed if self.proposed else 0.0
            metric("draft_acceptance", "gauge", "ISD draft acceptance rate since start.", [("", round(acc, 6))])
            if self.isd_steps:
                metric(
                    "isd_steps_total",
                    "counter",
                    "ISD decode steps by mode: draft (ISD chunks) or ar (plain AR steps chosen by --isd-draft-budget).",
                    [(f'{{mode="{k}"}}', v) for k, v in sorted(self.isd_steps.items())],
                )
            if self.isd_strides:
                metric(
                    "isd_draft_steps_total",
                    "counter",
                    "ISD drafting steps by the stride they drafted at (the measured policy chooses it where no "
                    "--stride is given).",
                    [(f'{{stride="{k}"}}', v) for k, v in sorted(self.isd_strides.items())],
                )
            if self.isd_branches:
                hit = self.isd_branches.get("predicted", 0)
                metric(
                    "isd_verify_rows_total",
                    "counter",
                    "ISD verify row-steps by what follows: verify (the "
                    "outcome's masks were in the chunk, --isd-fallback) or cold (a cold-start step).",
                    [('{next="verify"}', hit), ('{next="cold"}', self.isd_branches.get("verify", 0) - hit)],
                )
            metric(
                "queue_length", "gauge", "Requests waiting for a slot in the running batch.", [("", self.queue_length)]
            )
            metric("running_requests", "gauge", "Requests in the running batch.", [("", self.running)])
            for name, hist, help_text in (
                ("time_to_first_token_seconds", self.ttft, "Time from arrival to the first generated token."),
                ("time_per_output_token_seconds", self.tpot, "Mean time per generated token after the first."),
                ("request_latency_seconds", self.latency, "Time from arrival to the last token."),
            ):
                lines.append(f"# HELP dlm_{name} {help_text}")
                lines.append(f"# TYPE dlm_{name} histogram")
                lines.extend(hist.lines(f"dlm_{name}"))
            return "\n".join(lines) + "\n"
