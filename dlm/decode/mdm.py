"""Masked-diffusion samplers for bidirectional ``mdm`` DLMs (docs/algorithms.md#mdm-sampling), as a decoder of the batching engine.

Every generated position starts as M and the passes run with full (bidirectional) attention. With the model's
``shift`` (DiffuLLaMA/Dream), the logit at i-1 scores position i; without it (LLaDA), the logit at i.

- ``confidence`` (low-confidence remasking): each of ``steps`` passes predicts every masked position and commits
  the most confident so that ``floor(n0 * (T - s) / T)`` stay masked after pass s (none after the last).
- ``random``: at step k = T-1 .. 0 every still-masked position is committed with probability 1/(k+1) (so all are
  resolved at k = 0); tokens by temperature/top-p sampling. A step that would commit nothing skips its forward.
- ``threshold`` (Fast-dLLM): semi-autoregressive blocks of ``block_length``; within a block each pass commits every
  masked token whose probability exceeds ``threshold`` (at least the most confident one). The KV of the finished
  prefix is cached: refreshed by one full forward at the start of each block, reused by the block's later passes
  (approximate for a bidirectional model, as in Fast-dLLM).

On the engine (:class:`dlm.decode.engine.Engine`) a batch of requests with different prompt lengths, lengths and
schedules runs together: each step is one forward of every running row's sequence (``confidence``/``random``: the
whole sequence, nothing cached; ``threshold``: the part after the cached prefix). Committed tokens are final, so a
row streams the resolved prefix of its answer as it grows, and stops as soon as that prefix holds a stop token
(the passes the reference would still spend on positions after the stop are saved; the tokens are the same).
The first pass is the request's prefill forward.
"""

from __future__ import annotations

import math

import torch

from dlm.decode.engine import Decoder, Engine, Row
from dlm.decode.sampling import SamplingParams, check_fits_context, probs_from_logits, sample, suppress
from dlm.errors import DLMError

METHODS = ("confidence", "random", "threshold")


def propose(logits: torch.Tensor, params: SamplingParams, mask_id: int, generator: torch.Generator):
    """[n, V] logits -> (tokens [n], confidence [n]): argmax or a draw, and its probability (at temperature 1 for
    greedy, so confidences stay comparable)."""
    if params.greedy:
        probs = suppress(logits, mask_id).softmax(-1)
        tokens = probs.argmax(-1)
    else:
        probs = probs_from_logits(logits, params, mask_id)
        tokens = sample(probs, generator)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1)


def check_steps(steps: int | None) -> None:
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise DLMError(f"--steps must be a positive integer, got {steps}")


class DiffusionDecoder(Decoder):
    """What the whole-sequence decoders (mdm, block) share: the row's sequence ``x`` (prompt + masks) laid out at
    once, emission of the resolved prefix in order, and the context check."""

    causal = False

    def check_request(self, engine: Engine, row: Row) -> None:
        check_fits_context(len(row.prompt_ids), row.params.max_new_tokens, engine.max_positions)

    def _layout(self, engine: Engine, row: Row) -> torch.Tensor:
        p = len(row.prompt_ids)
        x = torch.tensor(row.prompt_ids + [engine.mask_token_id] * row.params.max_new_tokens)
        row.state.update(x=x, p=p, emitted=p)
        return x

    def _scores(self, row: Row, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits scoring absolute ``positions``; ``logits[j]`` is the output at position ``row.pos + j``."""
        return logits[positions - row.pos - (1 if self.shift else 0)]

    def _emit(self, engine: Engine, row: Row) -> list[int]:
        """The newly resolved prefix of the answer (tokens are final once committed)."""
        x, start = row.state["x"], row.state["emitted"]
        masked = (x[start:] == engine.mask_token_id).nonzero()
        stop = start + int(masked[0]) if masked.numel() else x.numel()
        row.state["emitted"] = stop
        return x[start:stop].tolist()


class MDMDecoder(DiffusionDecoder):
    name = "mdm"

    def __init__(self, method: str = "confidence", steps: int | None = None, threshold: float | None = 0.9,
                 block_length: int = 32):
        if method not in METHODS:
            raise DLMError(f"unknown mdm sampler '{method}' (--sampler): use one of {', '.join(METHODS)}")
        check_steps(steps)
        threshold = 0.9 if threshold is None else float(threshold)
        if method == "threshold" and not 0.0 <= threshold < 1.0:
            raise DLMError(f"--threshold must be in [0, 1) for the threshold sampler, got {threshold}")
        if not isinstance(block_length, int) or block_length < 1:
            raise DLMError(f"--block-length must be a positive integer, got {block_length}")
        self.method, self.steps, self.threshold, self.block_length = method, steps, threshold, block_length
        self.shift = True

    def check_model(self, engine: Engine) -> None:
        spec = engine.spec
        if spec is None or engine.mask_token_id is None:
            raise DLMError("--decode mdm needs a DLM with a mask token; convert the model first "
                           "(dlm convert --objective mdm)")
        if spec.objective != "mdm":
            raise DLMError(f"--decode mdm needs a bidirectional masked-diffusion model (objective 'mdm'); this is "
                           f"a '{spec.objective}' model: use --decode {'isd' if spec.objective == 'idlm' else 'block'}")
        self.shift = bool(spec.shift)

    def chunk_attention(self, engine: Engine, row: Row, positions: torch.Tensor) -> torch.Tensor:
        n = positions.numel()
        return torch.ones(n, n, dtype=torch.bool)

    # -- planning: decide what the next pass commits (before its forward, so a pass that commits nothing is
    # never run), in the order the reference sampler draws its random numbers
    def _plan(self, engine: Engine, row: Row) -> None:
        st = row.state
        x = st["x"]
        masked = (x == engine.mask_token_id).nonzero().squeeze(-1)
        st["masked"] = masked
        if self.method == "confidence":
            total, n_gen = st["steps"], row.params.max_new_tokens
            while True:
                st["s"] += 1
                remain = math.floor(n_gen * (total - st["s"]) / total)
                if masked.numel() - remain > 0:
                    st["n_commit"] = masked.numel() - remain
                    return
        elif self.method == "random":
            while True:
                k = st["k"]
                st["k"] -= 1
                commit = torch.rand(masked.numel(), generator=row.generator) < 1.0 / (k + 1)
                if bool(commit.any()):
                    st["commit"] = commit
                    return

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        self._layout(engine, row)
        p, shift = len(row.prompt_ids), 1 if self.shift else 0
        row.state.update(steps=self.steps or row.params.max_new_tokens, s=0)
        row.state["k"] = row.state["steps"] - 1
        if self.method == "threshold":
            row.state.update(start=p, c=p - shift, refresh=False)
        self._plan(engine, row)
        return [engine.mask_token_id] * row.params.max_new_tokens

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        x = row.state["x"]
        if self.method != "threshold":
            return x.tolist()  # the whole sequence, at positions 0.. (row.pos stays 0: nothing is cached)
        if row.state.pop("refresh", False):
            row.state["fresh"] = True  # a full forward at the start of a block: recompute the prefix KV
            row.pos = 0
            return x.tolist()
        return x[row.pos:].tolist()

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        st, p = row.state, row.params
        x = st["x"]
        if self.method == "threshold":
            return self._consume_threshold(engine, row, logits)
        masked = st["masked"]
        tokens, conf = propose(self._scores(row, logits, masked), p, engine.mask_token_id, row.generator)
        if self.method == "confidence":
            top = conf.topk(st["n_commit"]).indices
            x[masked[top]] = tokens[top]
        else:
            commit = st["commit"]
            x[masked[commit]] = tokens[commit]
        out = self._emit(engine, row)
        if bool((x == engine.mask_token_id).any()):
            self._plan(engine, row)
        return out, -row.pos  # nothing is cached: the next pass feeds the whole sequence again

    def _consume_threshold(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        st = row.state
        x, start, c = st["x"], st["start"], st["c"]
        end = min(start + self.block_length, x.numel())
        keep = c - row.pos  # a refresh (or the prefill) keeps the prefix before the block; later passes nothing
        masked = (x[start:end] == engine.mask_token_id).nonzero().squeeze(-1) + start
        tokens, conf = propose(self._scores(row, logits, masked), row.params, engine.mask_token_id, row.generator)
        commit = conf > self.threshold
        commit[conf.argmax()] = True
        x[masked[commit]] = tokens[commit]
        if not bool((x[start:end] == engine.mask_token_id).any()) and end < x.numel():
            start = end  # next block: its first pass refreshes the prefix cache
            st.update(start=start, c=start - (1 if self.shift else 0), refresh=True)
        return self._emit(engine, row), keep
