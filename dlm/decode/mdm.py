"""Masked-diffusion samplers for bidirectional ``mdm`` DLMs (SPEC section 2.2).

All start with every generated position = M and run forward passes with full (bidirectional) attention. With the
model's ``shift`` (DiffuLLaMA/Dream), the logit at i-1 scores position i; without it (LLaDA), the logit at i.

- ``confidence`` (low-confidence remasking): each of ``steps`` passes predicts every masked position and commits
  the most confident so that ``floor(n0 * (T - s) / T)`` stay masked after pass s (none after the last).
- ``random``: at step k = T-1 .. 0 every still-masked position is committed with probability 1/(k+1) (so all are
  resolved at k = 0); tokens by temperature/top-p sampling.
- ``threshold`` (Fast-dLLM): semi-autoregressive blocks of ``block_length``; within a block each pass commits every
  masked token whose probability exceeds ``threshold`` (at least the most confident one). The KV of the finished
  prefix is cached: refreshed by one full forward at the start of each block, reused by the block's later passes
  (approximate for a bidirectional model, as in Fast-dLLM).

Rows are decoded one at a time (the sequences are short and the passes full-length); every function returns one
:class:`~dlm.decode.engine.GenerationResult` per prompt with ``forwards`` counted.
"""

from __future__ import annotations

import math
import time

import torch

from dlm.decode.engine import GenerationResult
from dlm.decode.sampling import RequestStats, SamplingParams, check_fits_context, probs_from_logits, sample, suppress
from dlm.errors import DLMError
from dlm.model.convert import cache_kw

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


def _full_mask(n: int, device) -> torch.Tensor:
    return torch.ones(1, 1, n, n, dtype=torch.bool, device=device)


def _scored(logits_rows: torch.Tensor, positions: torch.Tensor, shift: bool, offset: int = 0) -> torch.Tensor:
    """Logits that score ``positions`` (absolute), given logits for absolute positions offset.."""
    return logits_rows[positions - offset - (1 if shift else 0)]


def finish(result_ids: list[int], stop_ids, max_new: int) -> tuple[list[int], str]:
    for i, t in enumerate(result_ids[:max_new]):
        if t in stop_ids:
            return result_ids[: i + 1], "stop"
    return result_ids[:max_new], "length"


@torch.inference_mode()
def mdm_generate(dlm, prompts: list[list[int]], params: SamplingParams, method: str = "confidence",
                 steps: int | None = None, threshold: float = 0.9, block_length: int = 32,
                 stop_ids=frozenset()) -> list[GenerationResult]:
    """Sample ``params.max_new_tokens`` tokens after each prompt with a masked-diffusion sampler."""
    if method not in METHODS:
        raise DLMError(f"unknown mdm sampler '{method}': use one of {', '.join(METHODS)}")
    spec = getattr(dlm, "spec", None)
    if spec is None:
        raise DLMError("--decode mdm needs a DLM with a mask token; convert the model first (dlm convert)")
    mask_id, shift, device = spec.mask_token_id, spec.shift, dlm.device
    max_new = params.max_new_tokens
    steps = steps or max_new
    if steps < 1:
        raise DLMError(f"--steps must be >= 1, got {steps}")
    from dlm.model.convert import max_positions

    limit = max_positions(dlm.hf_config) or 1 << 30
    results = []
    for rid, prompt in enumerate(prompts):
        check_fits_context(len(prompt), max_new, limit)
        g = params.make_generator()
        stats = RequestStats(prompt_tokens=len(prompt), start_time=time.perf_counter())
        p_len = len(prompt)
        x = torch.tensor(prompt + [mask_id] * max_new, device=device)
        n = x.numel()

        def forward_full():
            stats.forwards += 1
            return dlm(input_ids=x[None], attention_mask=_full_mask(n, device)).logits[0]

        if method == "confidence":
            for s in range(1, steps + 1):
                masked = (x == mask_id).nonzero().squeeze(-1)
                if masked.numel() == 0:
                    break
                remain = math.floor(max_new * (steps - s) / steps)
                n_commit = masked.numel() - remain
                if n_commit <= 0:
                    continue
                tokens, conf = propose(_scored(forward_full(), masked, shift), params, mask_id, g)
                top = conf.topk(n_commit).indices
                x[masked[top]] = tokens[top]
        elif method == "random":
            for k in range(steps - 1, -1, -1):
                masked = (x == mask_id).nonzero().squeeze(-1)
                if masked.numel() == 0:
                    break
                commit = torch.rand(masked.numel(), generator=g) < 1.0 / (k + 1)
                if not bool(commit.any()):
                    continue  # nothing would change: skip the forward
                tokens, _ = propose(_scored(forward_full(), masked, shift), params, mask_id, g)
                x[masked[commit]] = tokens[commit]
        else:
            _threshold_blocks(dlm, x, p_len, params, g, stats, threshold, block_length, mask_id, shift)
        ids, reason = finish(x[p_len:].tolist(), stop_ids, max_new)
        stats.new_tokens = len(ids)
        stats.end_time = time.perf_counter()
        results.append(GenerationResult(rid, list(prompt), ids, None, reason, stats))
    return results


def _threshold_blocks(dlm, x, p_len, params, g, stats, threshold, block_length, mask_id, shift) -> None:
    """Fast-dLLM: semi-AR blocks, confidence-threshold commits, prefix KV cache refreshed once per block."""
    from transformers import DynamicCache

    n = x.numel()
    device = x.device
    kv_kw = cache_kw(dlm)
    for start in range(p_len, n, block_length):
        end = min(start + block_length, n)
        # the cached prefix stops one early with the shift: the logit scoring `start` comes from start-1
        c = start - 1 if shift else start
        first = True
        while bool((x[start:end] == mask_id).any()):
            if first:
                # refresh: one full forward; its prefix KV is kept for the block's later passes
                cache = DynamicCache()
                stats.forwards += 1
                logits = dlm(input_ids=x[None], attention_mask=_full_mask(n, device), **{kv_kw: cache},
                             use_cache=True).logits[0]
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[:, :, :c], layer.values[:, :, :c]
                offset, first = 0, False
            else:
                q = n - c
                stats.forwards += 1
                mask = torch.ones(1, 1, q, c + q, dtype=torch.bool, device=device)
                logits = dlm(input_ids=x[None, c:], position_ids=torch.arange(c, n, device=device)[None],
                             attention_mask=mask, **{kv_kw: cache}, use_cache=True).logits[0]
                for layer in cache.layers:  # drop this pass's KV again: the prefix cache stays as refreshed
                    layer.keys, layer.values = layer.keys[:, :, :c], layer.values[:, :, :c]
                offset = c
            masked = (x[start:end] == mask_id).nonzero().squeeze(-1) + start
            tokens, conf = propose(_scored(logits, masked, shift, offset), params, mask_id, g)
            commit = conf > threshold
            commit[conf.argmax()] = True
            x[masked[commit]] = tokens[commit]
