"""Sampling parameters and the one place where logits become a distribution or a token.

Every distribution the decoders sample from or compare (AR p, ISD drafts q, diffusion proposals) goes through
:func:`probs_from_logits`, so temperature, top-k and top-p are applied exactly once and identically to p and q
(the I-DLM reference applies temperature twice to q and leaves p/q untruncated while the free token is truncated;
with one transform for everything ISD's output is exactly the transformed AR distribution). The mask token's
logit is -inf everywhere, so it is never emitted.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from dlm.decode.cpu import runtime as _cpu_runtime
from dlm.decode.structured import Constraint, StructuredOutput
from dlm.errors import DLMError

MAX_LOGPROBS = 20  # most likely alternatives reported per token (OpenAI's chat limit; vLLM's default cap)
LOGPROB_ROWS = 512  # positions scored at once by token_logprobs (a vocabulary of 150k: 300 MB of fp32 per slice)


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    ``temperature == 0`` means greedy. ``seed`` seeds the request's own ``torch.Generator`` so its output does not
    depend on its batch neighbours (``None``: a random seed). ``stop_token_ids`` defaults to the tokenizer's EOS
    (unless ``ignore_eos``); the stop token is kept in ``token_ids`` (as ``transformers.generate`` does) and dropped
    from the text. ``stop_strings`` cut the text at the first occurrence.

    ``logprobs`` k (None: off): each new token's log-probability under the model and the k most likely tokens at
    its position (:class:`TokenLogprob`); ``prompt_logprobs`` k the same for the prompt's tokens after the first
    (the prefill then computes the logits of every prompt position). Both need a left-to-right decoder (``ar``,
    ``isd``).

    Logit adjustments, applied where a token's distribution is formed, in vLLM's order, before temperature /
    top-k / top-p (so ISD's output is exactly the adjusted AR distribution): ``logit_bias`` ((token id, bias)
    pairs) added; ``repetition_penalty`` r divides a positive logit by r and multiplies a negative one by r for
    every token of the prompt or the output so far; ``frequency_penalty`` subtracts f x the token's count in the
    output so far and ``presence_penalty`` p once if it occurs there (OpenAI's); ``min_tokens`` n: the stop tokens
    cannot be drawn before the n-th new token (vLLM's). ``structured`` (:class:`StructuredOutput`): the output
    must match a JSON schema, a regular expression, one of several strings or a grammar; the tokens it does not
    allow get no probability at each position. ``ar`` and ``isd`` only.

    ``suffix_ids``: tokens that follow the answer (fill-in-the-middle, OpenAI's ``suffix``): the answer's
    ``max_new_tokens`` masks sit between the prompt and them, and a bidirectional model sees both sides while it
    fills them. ``mdm`` only.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    suffix_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise DLMError(f"--max-new-tokens must be a positive integer, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise DLMError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise DLMError(f"--top-k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise DLMError(f"--top-p must be in (0, 1], got {self.top_p}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise DLMError(f"{name} must be an integer in 0..{MAX_LOGPROBS} (or None: off), got {k!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise DLMError(
                f"--min-tokens must be an integer from 0 to --max-new-tokens ({self.max_new_tokens}), "
                f"got {self.min_tokens}"
            )
        if self.seed is not None:
            if (
                isinstance(self.seed, bool)
                or not isinstance(self.seed, numbers.Integral)
                or not -(2**63) <= int(self.seed) < 2**64
            ):
                raise DLMError(f"--seed must be an integer that fits in 64 bits, got {self.seed!r}")
            self.seed = int(self.seed)
        if not self.repetition_penalty > 0:
            raise DLMError(f"--repetition-penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise DLMError(f"--{name.replace('_', '-')} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        bias = dict(self.logit_bias) if isinstance(self.logit_bias, dict) else dict(tuple(b) for b in self.logit_bias)
        if any(not -100.0 <= float(v) <= 100.0 for v in bias.values()):
            raise DLMError("logit_bias values must be in [-100, 100]")
        self.logit_bias = tuple(sorted((int(k), float(v)) for k, v in bias.items()))
        self.stop_strings = tuple(self.stop_strings or ())
        if self.stop_token_ids is not None:
            self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.suffix_ids = tuple(int(t) for t in self.suffix_ids or ())
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise DLMError(f"structured must be a dlm.decode.structured.StructuredOutput, got {self.structured!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts(self) -> bool:
        """Whether a logit bias, a penalty or a structured output changes the model's logits (see the class
        docstring)."""
        return bool(
            self.structured is not None
            or self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.min_tokens
        )

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(int(self.seed))
        return g


class LogitAdjust:
    """A request's logit bias, penalties, minimum length and structured output over its history (see
    :class:`SamplingParams`): the prompt's tokens, the output's counts (updated as tokens are committed), a dense
    bias vector, the stop tokens held back until ``min_tokens``, the grammar's state (a
    :class:`~dlm.decode.structured.Constraint`)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab: int,
        stop_ids: Iterable[int] = (),
        constraint: Constraint | None = None,
    ):
        self.params, self.vocab = params, vocab
        self.constraint = constraint
        self.produced = 0  # output tokens committed
        self.stops = torch.tensor(sorted(t for t in stop_ids if 0 <= t < vocab), dtype=torch.long)
        ids = torch.tensor([t for t in prompt_ids if 0 <= t < vocab], dtype=torch.long)
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool)
        self.in_prompt[ids] = True
        self.counts = torch.zeros(vocab, dtype=torch.float32)
        self.bias = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab, dtype=torch.float32)
            for t, b in params.logit_bias:
                if 0 <= t < vocab:
                    self.bias[t] = b

    def add(self, tokens: Sequence[int]) -> None:
        """Committed output tokens."""
        for t in tokens:
            self.produced += 1
            if 0 <= t < self.vocab:
                self.counts[t] += 1
        if self.constraint is not None:
            self.constraint.add(tokens)

    @property
    def done(self) -> bool:
        """The structured output is complete (the request ends)."""
        return self.constraint is not None and self.constraint.done

    def apply(self, logits: torch.Tensor, extra: Sequence[Sequence[int]], drafting: Sequence[int] = ()) -> torch.Tensor:
        """``logits [n, V]`` adjusted, row j as if ``extra[j]`` (tokens of the chunk before row j's position, e.g.
        ISD's drafts) were already in the output; float32, out of place. The rows in ``drafting`` (a mask's: they
        propose drafts for a position after tokens not chosen yet) get no grammar mask - any proposal is verified
        against the grammar - and would get one under a history they do not have."""
        p, n = self.params, logits.shape[0]
        dev = logits.device
        out = logits.float()  # every step below is out of place
        if out.shape[-1] != self.vocab:
            raise ValueError(f"logits of {out.shape[-1]} tokens for a vocabulary of {self.vocab}")
        changed = False  # whether a bias or penalty may have pushed a logit out of float32's range
        if self.bias is not None:
            out, changed = out + self.bias.to(dev)[None], True
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            changed = True
            counts = self.counts.to(dev)[None].expand(n, -1).clone()
            pairs = [(j, t) for j, ts in enumerate(extra) for t in ts if 0 <= t < self.vocab]
            if pairs:
                rows = torch.tensor([j for j, _ in pairs], device=dev)
                cols = torch.tensor([t for _, t in pairs], device=dev)
                counts.index_put_((rows, cols), torch.ones(len(pairs), device=dev), accumulate=True)
            if p.repetition_penalty != 1.0:
                seen = self.in_prompt.to(dev)[None] | (counts > 0)
                r = p.repetition_penalty
                out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
            if p.frequency_penalty:
                out = out - p.frequency_penalty * counts
            if p.presence_penalty:
                out = out - p.presence_penalty * (counts > 0).float()
        allowed = self.constraint.allowed(extra, drafting) if self.constraint is not None else None
        if p.min_tokens and self.stops.numel():  # row j's token is new token number produced + len(extra[j]) + 1
            early = [j for j, ts in enumerate(extra) if self.produced + len(ts) < p.min_tokens]
            if allowed is not None:  # where the grammar allows only stop tokens, the grammar wins
                others = allowed.clone()
                others[:, self.stops] = False
                early = [j for j in early if bool(others[j].any())]
            if early:
                out, changed = out.clone(), True
                out[torch.tensor(early, device=dev)[:, None], self.stops.to(dev)[None]] = float("-inf")
        # an extreme repetition penalty (5e-324 divides a logit into +inf) must not turn the softmax into NaN
        if changed and not bool(out.isfinite().all()):
            big = torch.finfo(torch.float32).max
            out = out.nan_to_num(nan=-big, posinf=big, neginf=-big)
        if allowed is not None:  # after the clamp: a refused token has no probability, however large its logit
            out = out.masked_fill(~allowed.to(dev), float("-inf"))
        return out


def suppress(logits: torch.Tensor, mask_token_id: int | None) -> torch.Tensor:
    """Logits (float32) with the mask token at -inf (and any padded vocabulary rows left as they are)."""
    logits = logits.float()
    if mask_token_id is not None and 0 <= mask_token_id < logits.shape[-1]:
        # out of place: the caller's logits (often the model's output buffer) stay untouched
        logits = logits.index_fill(-1, torch.tensor([mask_token_id], device=logits.device), float("-inf"))
    return logits


def _scan_ops(logits: torch.Tensor, mask_token_id: int | None):
    """``(ops, skip)``: the CPU kernels' operators where they are loaded and can scan these logits (float32 rows on
    the CPU) and the column their scans leave out (-1: none), else None."""
    ops = _cpu_runtime.STATE.ops
    if (
        ops is None
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() == 0
        or logits.shape[-1] == 0
        or logits.stride(-1) != 1
        or logits.requires_grad
    ):
        return None
    m = mask_token_id
    return ops, m if m is not None and 0 <= m < logits.shape[-1] else -1


def greedy_with_prob(logits: torch.Tensor, mask_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`argmax_no_mask`'s tokens and each one's probability under ``suppress(logits, m).softmax(-1)``
    (float32): what a greedy draft records of its own confidence. The CPU kernels compute both in two passes over
    each row instead of a masked copy and a vocabulary-wide softmax (the probability may differ in the last bits)."""
    scan = _scan_ops(logits, mask_token_id)
    if scan is not None:
        ops, skip = scan
        return ops.argmax_skip_prob(logits, skip)
    d = argmax_no_mask(logits, mask_token_id)
    return d, suppress(logits, mask_token_id).softmax(-1).gather(-1, d[..., None])[..., 0]


def argmax_no_mask(logits: torch.Tensor, mask_token_id: int | None) -> torch.Tensor:
    """``suppress(logits, m).argmax(-1)`` - the greedy token - without copying the logits (a 49,152-float row per
    position): the first maximal index outside the mask token's column (the larger of the two sides' maxima; the
    left side wins a tie, as argmax's first index does), a NaN ranking above every number (the first NaN wins);
    where every other column is -inf, the first column that is not the mask's. No host read, so it also runs inside
    a CUDA graph. Float32 CPU logits take the CPU kernels' one-pass scan where they are loaded (the same index)."""
    scan = _scan_ops(logits, mask_token_id)
    if scan is not None:  # the CPU kernels' one-pass scan: the same index (torch's argmax reads ~1 float a ns)
        ops, skip = scan
        return ops.argmax_skip(logits, skip)
    v = logits.shape[-1]
    m = mask_token_id
    if m is None or not 0 <= m < v:
        return logits.argmax(-1)
    if m == 0:
        return logits[..., 1:].argmax(-1) + 1
    if m == v - 1:
        return logits[..., :m].argmax(-1)
    left, right = logits[..., :m].max(-1), logits[..., m + 1 :].max(-1)
    first = (left.values >= right.values) | left.values.isnan()  # (a NaN ranks above every number, as in argmax)
    return torch.where(first, left.indices, right.indices + (m + 1))


def probs_from_logits(
    logits: torch.Tensor, params: SamplingParams, mask_token_id: int | None, top_p_first: bool = False
) -> torch.Tensor:
    """[..., V] logits -> [..., V] probabilities after mask suppression, temperature, top-k and top-p (top-p then
    top-k with ``top_p_first``, the order of Dream's sampler).

    For greedy params this returns the one-hot distribution of the argmax (so acceptance tests and the
    residual ``max(0, p - q)`` reduce to the greedy rules).
    """
    logits = suppress(logits, mask_token_id)
    if params.greedy:
        out = torch.zeros_like(logits)
        out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return out
    # shifted by the max first (the same distribution, no inf - inf) and a temperature of at least float32's
    # smallest normal number (5e-324 would be 0 in float32: 0 / 0)
    temperature = max(params.temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if not top_p_first:
        logits = _top_k(logits, params.top_k)
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False  # a top_p below float32's smallest number (5e-324) would drop every token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if top_p_first:
        logits = _top_k(logits, params.top_k)
    return logits.softmax(-1)


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k and k < logits.shape[-1]:
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of [..., V] probabilities (or weights) -> [...] token ids (long).

    torch.multinomial draws one sample as argmax(probs / E), E ~ Exp(1) over probs' shape; a generator on another
    device than the probabilities (a request's CPU generator, CUDA logits) draws that noise on its own device, so
    the same seed gives the same draws wherever the logits are."""
    flat = probs.reshape(-1, probs.shape[-1])
    if generator.device != flat.device:
        noise = torch.empty(flat.shape, device=generator.device).exponential_(generator=generator)
        ids = (flat.float() / noise.to(flat.device)).argmax(-1)
    else:
        ids = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return ids.reshape(probs.shape[:-1])


def next_token(
    logits: torch.Tensor, params: SamplingParams, mask_token_id: int | None, generator: torch.Generator
) -> torch.Tensor:
    """[..., V] logits -> [...] tokens: argmax when greedy, else a draw from :func:`probs_from_logits`."""
    if params.greedy:
        return argmax_no_mask(logits, mask_token_id)
    return sample(probs_from_logits(logits, params, mask_token_id), generator)


@dataclass
class TokenLogprob:
    """A token's log-probability under the model at its position - the log-softmax of the logits there, the mask
    token excluded, before temperature, top-k and top-p (the distribution the model gives, whichever way the token
    was chosen) - and the ``top`` most likely tokens there as (id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], k: int, mask_token_id: int | None
) -> list[TokenLogprob]:
    """``logits [T, V]``, row t the model's output where ``tokens[t]`` was chosen -> each token's
    :class:`TokenLogprob` with its ``k`` most likely alternatives: one log-softmax, one gather, one top-k and one
    transfer to the host. The token's log-probability and its alternatives' come from the same tensor, so a token
    that is the most likely one has exactly the first alternative's value."""
    if logits.shape[0] != len(tokens):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(tokens)} tokens")
    if not len(tokens):
        return []
    if len(tokens) > LOGPROB_ROWS:  # a long prompt: its temporaries (float copy, log-softmax) a slice at a time
        return [
            t
            for at in range(0, len(tokens), LOGPROB_ROWS)
            for t in token_logprobs(logits[at : at + LOGPROB_ROWS], tokens[at : at + LOGPROB_ROWS], k, mask_token_id)
        ]
    lp = suppress(logits, mask_token_id).log_softmax(-1)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)
    chosen = lp.gather(-1, ids[:, None]).squeeze(-1)
    if k > 0:
        top = lp.topk(min(k, lp.shape[-1]), dim=-1)
        vals, idx = top.values.tolist(), top.indices.tolist()
    else:
        vals = idx = [[] for _ in tokens]
    return [TokenLogprob(int(t), float(c), list(zip(i, v))) for t, c, i, v in zip(tokens, chosen.tolist(), idx, vals)]


@dataclass
class RequestStats:
    """Per-request counters. ``forwards`` counts model forward passes that advanced this request (prefill included);
    ``proposed[i]`` / ``accepted[i]`` count ISD drafts at draft position i+1."""

    forwards: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    canvas_steps: list[int] = field(default_factory=list)  # denoising steps of each canvas (renoise)
    start_time: float = 0.0
    first_token_time: float = 0.0
    end_time: float = 0.0

    @property
    def tpf(self) -> float:
        """Tokens per forward."""
        return self.new_tokens / self.forwards if self.forwards else 0.0

    @property
    def acceptance(self) -> list[float]:
        """Acceptance rate per draft position (ISD); empty for other decoders."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def elapsed(self) -> float:
        return max(self.end_time - self.start_time, 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed if self.elapsed > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "forwards": self.forwards,
            "new_tokens": self.new_tokens,
            "tpf": round(self.tpf, 4),
            "acceptance": [round(a, 4) for a in self.acceptance],
            "tokens_per_s": round(self.tokens_per_s, 2),
            "elapsed_s": round(self.elapsed, 4),
            "prompt_tokens": self.prompt_tokens,
            **({"steps_per_canvas": list(self.canvas_steps)} if self.canvas_steps else {}),
        }


def draft_totals(stats) -> tuple[list[int], list[int]]:
    """ISD drafts proposed and accepted per draft position, summed over requests' :class:`RequestStats` (requests
    may have drafted at different numbers of positions; ``None`` entries and non-ISD requests add nothing)."""
    proposed: list[int] = []
    accepted: list[int] = []
    for st in stats:
        if st is None:
            continue
        for i, (p, a) in enumerate(zip(st.proposed or [], st.accepted or [])):
            if i == len(proposed):
                proposed.append(0)
                accepted.append(0)
            proposed[i] += p
            accepted[i] += a
    return proposed, accepted


def check_fits_context(prompt_len: int, max_new: int, limit: int) -> None:
    """The whole-sequence samplers (mdm, block) lay out prompt + max_new positions at once: refuse what cannot fit."""
    if prompt_len + max_new > limit:
        raise DLMError(
            f"prompt ({prompt_len} tokens) + --max-new-tokens {max_new} exceed the model's context "
            f"of {limit} positions; shorten the prompt or generate fewer tokens"
        )
