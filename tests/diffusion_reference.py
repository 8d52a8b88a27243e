"""Straight, one-request-at-a-time reference implementations of the mdm samplers and block decoding (the code
dlm ran before these decoders moved onto the batching engine). The engine must reproduce them token for token
(greedy) and draw for draw (seeded sampling); they are deliberately plain: no batching, no streaming, no early
stop. Returns (generated ids, forwards) per prompt; every position is decoded (callers use ignore_eos)."""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from dlm.decode.block import block_mask
from dlm.decode.mdm import propose
from dlm.model.convert import cache_kw

# the references take their samplers' own names (LLaDA's block_length, the old method=); the decoders' configs
# name them sampler= and semi_ar_block=
CONFIG_NAMES = {"method": "sampler", "block_length": "semi_ar_block"}


def decoder_config(decoder: str, kw: dict):
    """The decoder config of ``decoder`` for the settings ``kw`` spelled as the references spell them."""
    from dlm.decode.configs import make_config

    return make_config(decoder, **{CONFIG_NAMES.get(k, k): v for k, v in kw.items()})


def _full(n):
    return torch.ones(1, 1, n, n, dtype=torch.bool)


def _crop(cache, n):
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]


@torch.inference_mode()
def reference_mdm(dlm, prompt, params, method="confidence", steps=None, threshold=0.9, block_length=32):
    mask_id, shift = dlm.spec.mask_token_id, 1 if dlm.spec.shift else 0
    max_new = params.max_new_tokens
    steps = steps or max_new
    g = params.make_generator()
    p = len(prompt)
    x = torch.tensor(list(prompt) + [mask_id] * max_new)
    n = x.numel()
    forwards = 0

    def full(**kw):
        nonlocal forwards
        forwards += 1
        return dlm(input_ids=x[None], attention_mask=_full(n), **kw).logits[0]

    if method == "confidence":
        for s in range(1, steps + 1):
            masked = (x == mask_id).nonzero().squeeze(-1)
            if masked.numel() == 0:
                break
            n_commit = masked.numel() - math.floor(max_new * (steps - s) / steps)
            if n_commit <= 0:
                continue
            tokens, conf = propose(full()[masked - shift], params, mask_id, g)
            top = conf.topk(n_commit).indices
            x[masked[top]] = tokens[top]
    elif method == "random":
        for k in range(steps - 1, -1, -1):
            masked = (x == mask_id).nonzero().squeeze(-1)
            if masked.numel() == 0:
                break
            commit = torch.rand(masked.numel(), generator=g) < 1.0 / (k + 1)
            if not bool(commit.any()):
                continue
            tokens, _ = propose(full()[masked - shift], params, mask_id, g)
            x[masked[commit]] = tokens[commit]
    else:
        kw = cache_kw(dlm)
        for start in range(p, n, block_length):
            end = min(start + block_length, n)
            c = start - shift
            first, cache = True, DynamicCache()
            while bool((x[start:end] == mask_id).any()):
                if first:
                    logits, offset, first = full(**{kw: cache}, use_cache=True), 0, False
                else:
                    forwards += 1
                    q = n - c
                    logits = dlm(
                        input_ids=x[None, c:],
                        position_ids=torch.arange(c, n)[None],
                        attention_mask=torch.ones(1, 1, q, c + q, dtype=torch.bool),
                        **{kw: cache},
                        use_cache=True,
                    ).logits[0]
                    offset = c
                _crop(cache, c)
                masked = (x[start:end] == mask_id).nonzero().squeeze(-1) + start
                tokens, conf = propose(logits[masked - offset - shift], params, mask_id, g)
                commit = conf > threshold
                commit[conf.argmax()] = True
                x[masked[commit]] = tokens[commit]
    return x[p:].tolist(), forwards


@torch.inference_mode()
def reference_block(dlm, prompt, params, steps=None, threshold=0.9):
    b, mask_id, off = dlm.spec.block_size, dlm.spec.mask_token_id, 1 if dlm.spec.shift else 0
    steps = steps or b
    kw = cache_kw(dlm)
    g = params.make_generator()
    p = len(prompt)
    end = p + params.max_new_tokens
    x = torch.tensor(list(prompt) + [mask_id] * params.max_new_tokens)
    first_block = (p // b) * b
    c = max(first_block - off, 0)
    cache = DynamicCache()
    forwards = 0
    if c > 0:
        # the complete blocks before the first one to decode, then cropped to c: with the shift, the last of them is
        # fed again with the block, but the blocks' KV must see it (block-causal attention is bidirectional within
        # a block). dlm's pre-engine code fed only x[:c] here, so that block's KV missed its own last token.
        pos = torch.arange(first_block)
        forwards += 1
        dlm(
            input_ids=x[None, :first_block],
            position_ids=pos[None],
            attention_mask=block_mask(pos, pos, b),
            **{kw: cache},
            use_cache=True,
        )
        _crop(cache, c)
    for bs in range(first_block, end, b):
        be = min(bs + b, end)
        lo = max(bs, p)
        per_step = math.ceil(int((x[lo:be] == mask_id).sum()) / steps)
        for step in range(steps):
            masked = (x[lo:be] == mask_id).nonzero().squeeze(-1) + lo
            if masked.numel() == 0:
                break
            q_pos, k_pos = torch.arange(c, be), torch.arange(0, be)
            forwards += 1
            logits = dlm(
                input_ids=x[None, c:be],
                position_ids=q_pos[None],
                attention_mask=block_mask(q_pos, k_pos, b),
                **{kw: cache},
                use_cache=True,
            ).logits[0]
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
    return x[p:].tolist(), forwards
