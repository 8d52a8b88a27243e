"""Block diffusion decoding for ``block`` DLMs (SDAR / BD3-LM, SPEC section 3).

Blocks of ``block_size`` are aligned to absolute positions (block(i) = i // b, as in training). Attention is
block-causal: a query sees every key of its own block and of earlier blocks. Per block, up to ``steps`` denoising
passes feed the current block (prompt tail tokens fixed, masks to fill) against the KV cache of the earlier
blocks and commit either every masked token above ``threshold`` (at least the most confident one) or the
``ceil(n_masked / steps)`` most confident (top-k mode, ``threshold=None``); the last allowed pass commits all.

KV of a finished block is written once: the first pass of the next block feeds ``[finished block | new block]``
(the finished tokens cannot see the new block under block-causal attention, so their KV is exact) and keeps the
finished block's KV; later passes reuse it. With ``shift`` (logit i-1 scores token i) the cache stops one token
short so that the token before the block is fed with it.
"""

from __future__ import annotations

import math
import time

import torch

from dlm.decode.engine import GenerationResult
from dlm.decode.mdm import finish, propose
from dlm.decode.sampling import RequestStats, SamplingParams, check_fits_context
from dlm.errors import DLMError
from dlm.model.convert import cache_kw


def block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, b: int) -> torch.Tensor:
    """[1, 1, Q, K] boolean block-causal mask over absolute positions: block(k) <= block(q)."""
    return ((k_pos[None, :] // b) <= (q_pos[:, None] // b))[None, None]


def _crop(cache, n: int) -> None:
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]


@torch.inference_mode()
def block_generate(dlm, prompts: list[list[int]], params: SamplingParams, steps: int | None = None,
                   threshold: float | None = 0.9, stop_ids=frozenset()) -> list[GenerationResult]:
    """Generate ``params.max_new_tokens`` tokens per prompt with per-block denoising."""
    from transformers import DynamicCache

    from dlm.model.convert import max_positions

    spec = getattr(dlm, "spec", None)
    if spec is None or spec.objective != "block" or not spec.block_size:
        what = "a plain causal LM" if spec is None else f"a '{spec.objective}' model"
        raise DLMError(f"--decode block needs a block-diffusion DLM (objective 'block' with a block_size); this is "
                       f"{what}: use --decode {'ar' if spec is None else ('isd' if spec.objective == 'idlm' else 'mdm')}")
    b, mask_id, shift, device = spec.block_size, spec.mask_token_id, spec.shift, dlm.device
    steps = steps or b
    if steps < 1:
        raise DLMError(f"--steps must be >= 1, got {steps}")
    off = 1 if shift else 0
    limit = max_positions(dlm.hf_config) or 1 << 30
    max_new = params.max_new_tokens
    kv_kw = cache_kw(dlm)
    results = []
    for rid, prompt in enumerate(prompts):
        check_fits_context(len(prompt), max_new, limit)
        g = params.make_generator()
        stats = RequestStats(prompt_tokens=len(prompt), start_time=time.perf_counter())
        p_len = len(prompt)
        end = p_len + max_new
        x = torch.tensor(prompt + [mask_id] * max_new, device=device)
        first_block = (p_len // b) * b
        c = max(first_block - off, 0)  # cache holds positions [0, c)
        cache = DynamicCache()
        if c > 0:
            pos = torch.arange(c, device=device)
            stats.forwards += 1
            dlm(input_ids=x[None, :c], position_ids=pos[None], attention_mask=block_mask(pos, pos, b),
                **{kv_kw: cache}, use_cache=True)
        stopped = False
        for bs in range(first_block, end, b):
            be = min(bs + b, end)
            lo = max(bs, p_len)
            n0 = int((x[lo:be] == mask_id).sum())
            per_step = math.ceil(n0 / steps)
            for step in range(steps):
                masked = (x[lo:be] == mask_id).nonzero().squeeze(-1) + lo
                if masked.numel() == 0:
                    break
                q_pos = torch.arange(c, be, device=device)
                k_pos = torch.arange(0, be, device=device)
                stats.forwards += 1
                logits = dlm(input_ids=x[None, c:be], position_ids=q_pos[None],
                             attention_mask=block_mask(q_pos, k_pos, b), **{kv_kw: cache},
                             use_cache=True).logits[0]
                # keep the KV of everything before this block (finished blocks: written once), drop the rest
                new_c = max(bs - off, c)
                _crop(cache, new_c)
                rows = masked - c - off
                c = new_c
                tokens, conf = propose(logits[rows], params, mask_id, g)
                if step == steps - 1:
                    commit = torch.ones_like(conf, dtype=torch.bool)
                elif threshold is not None:
                    commit = conf > threshold
                    commit[conf.argmax()] = True
                else:
                    commit = torch.zeros_like(conf, dtype=torch.bool)
                    commit[conf.topk(min(per_step, conf.numel())).indices] = True
                x[masked[commit]] = tokens[commit]
            if any(int(t) in stop_ids for t in x[lo:be].tolist()):
                stopped = True
                break
        gen = x[p_len:].tolist()
        if stopped:  # positions after the stop were never decoded
            gen = [t for t in gen if t != mask_id]
        ids, reason = finish(gen, stop_ids, max_new)
        stats.new_tokens = len(ids)
        stats.end_time = time.perf_counter()
        results.append(GenerationResult(rid, list(prompt), ids, None, reason, stats))
    return results
