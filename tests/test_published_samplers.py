"""The published families' samplers as decoders of the one engine (LLaDA's low-confidence remasking with
semi-autoregressive blocks and classifier-free guidance; Dream's alg choices; SDAR's block strategies; LLaDA2's
threshold sampler): each equals a plain one-request reference written here from the family's sampler, token for
token greedy and draw for draw with a seed, batched with prompts of different lengths, and stops at a stop token."""

import json
import math
from dataclasses import replace

import pytest
import torch
from published_layouts import (
    MASK,
    write_dream,
    write_fast_dllm_v2,
    write_llada,
    write_llada2,
    write_llada_moe,
    write_sdar,
    write_sdar_moe,
)

import dlm
from dlm.cli import main
from dlm.decode import generate
from dlm.decode.configs import BlockConfig, MDMConfig
from dlm.decode.engine import Engine
from dlm.decode.mdm import MDMDecoder, propose
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams, next_token, probs_from_logits, sample, suppress
from dlm.errors import DLMError

pytestmark = pytest.mark.usefixtures("one_thread")

MIXED = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [30], [40, 41, 42, 43, 44, 45]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("published")
    return {
        "llada": dlm.load_model(write_llada(d / "llada", seed=4)),
        "dream": dlm.load_model(write_dream(d / "dream", seed=5)),
        "sdar": dlm.load_model(write_sdar(d / "sdar", seed=6, block_size=4)),
        "fast_dllm_v2": dlm.load_model(write_fast_dllm_v2(d / "fast", seed=7, bd_size=4)),
        "llada2": dlm.load_model(write_llada2(d / "llada2", seed=8, block_size=4)),
        "llada2_32": dlm.load_model(write_llada2(d / "llada2_32", seed=9)),
        "llada_moe": dlm.load_model(write_llada_moe(d / "llada_moe", seed=10)),
        "sdar_moe": dlm.load_model(write_sdar_moe(d / "sdar_moe", seed=11, block_size=4)),
    }


def split(n, parts):
    base, rest = divmod(n, parts)
    return [base + (i < rest) for i in range(parts)]


def full_logits(model, x, allowed=None):
    n = x.numel()
    allowed = torch.ones(n, n, dtype=torch.bool) if allowed is None else allowed
    with torch.inference_mode():
        return model(input_ids=x[None], attention_mask=allowed[None, None]).logits[0]


def until_stop(ids, params, gen):
    out = []
    for t in ids[:gen]:
        out.append(t)
        if params.stop_token_ids and t in params.stop_token_ids:
            break
    return out


# -- LLaDA: ML-GSAI/LLaDA generate.py, one request ---------------------------------------------------------------
def reference_llada(
    model, prompt, params, steps=None, block_length=32, cfg_scale=0.0, remasking="low_confidence", suffix=()
):
    """LLaDA's generate(): the canvas prompt + gen masks, blocks of block_length left to right, steps split
    evenly over the blocks and each block's masks over its steps (remainder first); at each step predict every
    position (with guidance: u + (cfg+1)(c - u), u the canvas with the prompt masked), score the candidates of the
    block's masks by their softmax probability (or uniformly), commit the step's quota of the highest. Candidates
    are drawn only where they can be committed (the block's masks). The mask token is never proposed. A
    ``suffix`` follows the masks on the canvas (masked too in u)."""
    gen, g, p = params.max_new_tokens, params.make_generator(), len(prompt)
    steps = steps or gen
    shift = 1 if model.shift else 0
    x = torch.tensor(list(prompt) + [MASK] * gen + list(suffix))
    blocks = math.ceil(gen / block_length)
    for b, block_steps in enumerate(split(steps, blocks)):
        lo = p + b * block_length
        hi = min(lo + block_length, p + gen)
        for k in split(hi - lo, block_steps):
            if k == 0:
                continue
            logits = full_logits(model, x)
            if cfg_scale > 0:
                u = x.clone()
                u[:p] = MASK
                u[p + gen :] = MASK
                un = full_logits(model, u)
                logits = un + (cfg_scale + 1) * (logits - un)
            where = (x[lo:hi] == MASK).nonzero().squeeze(-1) + lo
            scores = logits[where - shift]
            x0 = next_token(scores, params, MASK, g)
            if remasking == "low_confidence":
                conf = suppress(scores, MASK).softmax(-1).gather(-1, x0[:, None]).squeeze(-1)
            else:
                conf = torch.rand(x0.numel(), generator=g)
            top = conf.topk(k).indices
            x[where[top]] = x0[top]
    return until_stop(x[p : p + gen].tolist(), params, gen)


# -- Dream: diffusion_generate, one request -----------------------------------------------------------------------
def reference_dream(model, prompt, params, steps=None, alg="origin", alg_temp=None, eps=1e-3, suffix=(), top_k=50):
    """Dream's diffusion_generate: t = linspace(1, eps, steps+1); logits shifted right by one; 'origin' reveals
    each mask with probability 1 - s/t (all at the last step) with a token drawn from its distribution, the others
    reveal the int(n_mask (1 - s/t)) masks of highest confidence (or drawn from softmax(conf/alg_temp)). A step
    that reveals nothing is not run (its candidate draws are not made)."""
    gen, g, p = params.max_new_tokens, params.make_generator(), len(prompt)
    # sample_tokens filters top-p, then top-k - 50 when its caller gives none (the generation config it builds
    # from the model config carries transformers' global top_k)
    dream = replace(params, top_k=params.top_k or top_k)
    steps = steps or gen
    x = torch.tensor(list(prompt) + [MASK] * gen + list(suffix))
    t = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        masked = (x == MASK).nonzero().squeeze(-1)
        if masked.numel() == 0:
            break
        s, tt = t[i + 1], t[i]
        if alg == "origin":
            p_transfer = 1 - s / tt if i < steps - 1 else 1
            transfer = torch.rand(masked.numel(), generator=g) < p_transfer
            if not bool(transfer.any()):
                continue
            logits = full_logits(model, x)
            logits = torch.cat([logits[:1], logits[:-1]])  # Dream's right shift
            sub = logits[masked[transfer]]
            x[masked[transfer]] = (
                next_token(sub, params, MASK, g)
                if params.greedy
                else sample(probs_from_logits(sub, dream, MASK, top_p_first=True), g)
            )
            continue
        num_mask_token = (x == MASK).sum() / 1  # Dream: mask_index.sum() / batch, a float32 tensor
        k = int(num_mask_token * (1 - s / tt)) if i < steps - 1 else int(num_mask_token)
        if k == 0:
            continue
        logits = full_logits(model, x)
        logits = torch.cat([logits[:1], logits[:-1]])
        # sample_tokens: temperature (none when greedy), top-k / top-p, softmax; a draw, or the argmax when greedy
        probs = probs_from_logits(
            logits[masked],
            dream if not params.greedy else SamplingParams(temperature=1.0, top_k=dream.top_k, top_p=params.top_p),
            MASK,
            top_p_first=True,
        )
        x0 = sample(probs, g) if not params.greedy else probs.argmax(-1)
        if alg == "maskgit_plus":
            conf = probs.gather(-1, x0[:, None]).squeeze(-1)
        elif alg == "topk_margin":
            srt = probs.sort(-1, descending=True).values
            conf = srt[:, 0] - srt[:, 1]
        else:
            conf = (probs * torch.log(probs + 1e-10)).sum(-1)
        full_confidence = torch.full((x.numel(),), -torch.inf, dtype=conf.dtype)  # over the whole sequence
        full_confidence[masked] = conf
        if alg_temp:
            idx = torch.multinomial(torch.softmax(full_confidence / alg_temp, -1), k, generator=g)
        else:
            idx = torch.topk(full_confidence, k).indices
        x_ = torch.full_like(x, MASK)
        x_[masked] = x0
        x[idx] = x_[idx]
    return until_stop(x[p:].tolist(), params, gen)


# -- SDAR: JetAstra/SDAR generate.py block_diffusion_generate, one request ----------------------------------------
def reference_sdar(model, prompt, params, steps=None, remasking="low_confidence_dynamic", threshold=0.9, rewrite=True):
    """SDAR's block_diffusion_generate: the canvas rounded up to whole blocks, block-causal attention, per block
    at most `steps` passes over the block; a pass samples every position and commits its quota (the block's length
    split evenly over the steps, remainder first) by strategy: the masks above the threshold if they fill the quota
    (dynamic), else the top quota of the block's confidences with the non-masks at -inf - so where the quota
    exceeds the masks left, decoded positions too, set to the pass's sample there (``rewrite``); stop after a block
    holding a stop token. Greedy takes the argmax (SDAR has no greedy branch; it divides by the temperature). dlm's
    one departure: a prompt position the top-k chooses is not written (SDAR overwrites it). Without ``rewrite``
    (dlm's 'masks' rule) the quotas split the masks of the block and only masks are written."""
    gen, g, p = params.max_new_tokens, params.make_generator(), len(prompt)
    b = model.block_size
    steps = steps or b
    shift = 1 if model.shift else 0
    total = -(-(p + gen) // b) * b
    x = torch.tensor(list(prompt) + [MASK] * (total - p))
    i = torch.arange(total)
    allowed = (i[None, :] // b) <= (i[:, None] // b)
    for blk in range(p // b, total // b):
        lo, hi = blk * b, (blk + 1) * b
        quotas = split(hi - lo if rewrite else int((x[lo:hi] == MASK).sum()), steps)
        for step in range(steps + 1):
            where = (x[lo:hi] == MASK).nonzero().squeeze(-1) + lo
            if where.numel() == 0:
                break
            logits = full_logits(model, x[:hi], allowed[:hi, :hi])
            x0, x0_p = propose(logits[where - shift], params, MASK, g)
            k = min(quotas[step], where.numel())
            transfer = torch.zeros(where.numel(), dtype=torch.bool)
            dynamic_fills = remasking == "low_confidence_dynamic" and int((x0_p > threshold).sum()) >= quotas[step]
            if rewrite and remasking != "sequential" and quotas[step] > where.numel() and not dynamic_fills:
                confidence = torch.full((hi - lo,), -torch.inf)
                confidence[where - lo] = x0_p
                idx = torch.topk(confidence, quotas[step]).indices + lo
                x[where] = x0
                decoded = idx[~torch.isin(idx, where) & (idx >= p)]
                if decoded.numel():
                    x[decoded] = propose(logits[decoded - shift], params, MASK, g)[0]
                continue
            if remasking == "sequential":
                transfer[:k] = True
            elif remasking == "low_confidence_dynamic" and int((x0_p > threshold).sum()) >= k:
                transfer = x0_p > threshold
            else:
                transfer[x0_p.topk(k).indices] = True
            x[where[transfer]] = x0[transfer]
        if params.stop_token_ids and any(t in params.stop_token_ids for t in x[p:hi].tolist()):
            break
    return until_stop(x[p:].tolist(), params, gen)


# -- LLaDA2: LLaDA2MoeModelLM.generate, one request ---------------------------------------------------------------
def reference_llada2(model, prompt, params, steps=None, threshold=0.95):
    """LLaDA2's generate(): the canvas rounded up to whole blocks, block-causal attention, from the block holding
    the prompt's end; per block at most `steps` passes, each scoring the block's masks and committing every one
    above `threshold` if there are at least the pass's quota of them (the *block length* split over the steps -
    at most max_new_tokens of them - remainder first), else the quota's most confident (at most the masks left);
    stop after a block holding a stop token."""
    gen, g, p = params.max_new_tokens, params.make_generator(), len(prompt)
    b = model.block_size
    steps = min(steps or b, gen)  # generate(): steps = min(steps, gen_length // minimal_topk), minimal_topk 1
    total = -(-(p + gen) // b) * b
    x = torch.tensor(list(prompt) + [MASK] * (total - p))
    i = torch.arange(total)
    allowed = (i[None, :] // b) <= (i[:, None] // b)
    schedule = split(b, steps)
    for blk in range(p // b, total // b):
        lo, hi = blk * b, (blk + 1) * b
        for step in range(steps):
            where = (x[lo:hi] == MASK).nonzero().squeeze(-1) + lo
            if where.numel() == 0:
                break
            logits = full_logits(model, x[:hi], allowed[:hi, :hi])
            x0, x0_p = propose(logits[where], params, MASK, g)
            high = x0_p > threshold
            if int(high.sum()) >= schedule[step]:
                transfer = high
            else:
                transfer = torch.zeros(where.numel(), dtype=torch.bool)
                transfer[x0_p.topk(min(schedule[step], where.numel())).indices] = True
            x[where[transfer]] = x0[transfer]
        if params.stop_token_ids and any(t in params.stop_token_ids for t in x[p:hi].tolist()):
            break
    return until_stop(x[p:].tolist(), params, gen)


# -- LLaDA2.1: its generate with token editing (as dllm's LLaDA21Sampler mirrors it), one request ----------------
def reference_llada21(model, prompt, params, threshold=0.95, editing_threshold=0.9, max_post_steps=16):
    """LLaDA2.1's generate(): as LLaDA2.0's, but a pass commits every mask above `threshold` or else the most
    confident one (no step schedule), and also replaces each generated token of the block (not the prompt's)
    whose new prediction differs with probability above `editing_threshold`; once the block has no mask, passes
    go on until one edits nothing, at most `max_post_steps` of them."""
    gen, g, p = params.max_new_tokens, params.make_generator(), len(prompt)
    b = model.block_size
    total = -(-(p + gen) // b) * b
    x = torch.tensor(list(prompt) + [MASK] * (total - p))
    i = torch.arange(total)
    allowed = (i[None, :] // b) <= (i[:, None] // b)
    for blk in range(p // b, total // b):
        lo, hi = max(blk * b, p), (blk + 1) * b
        post = 0
        while True:
            old = x[lo:hi].clone()
            active = old == MASK
            if not active.any():
                post += 1
            if post > max_post_steps:
                break
            logits = full_logits(model, x[:hi], allowed[:hi, :hi])
            tokens, probs = propose(logits[lo:hi], params, MASK, g)
            transfer = torch.zeros(hi - lo, dtype=torch.bool)
            if active.any():
                conf = torch.where(active, probs, torch.tensor(-math.inf))
                high = (conf > threshold) & active
                if int(high.sum()) >= 1:
                    transfer = high
                else:
                    transfer[conf.topk(1).indices] = True
            edit = ~active & (probs > editing_threshold) & (tokens != old)
            x[lo:hi][transfer | edit] = tokens[transfer | edit]
            if not active.any() and not edit.any():
                break
        if params.stop_token_ids and any(t in params.stop_token_ids for t in x[p:hi].tolist()):
            break
    return until_stop(x[p:].tolist(), params, gen)


CASES = [
    ("llada", "mdm", dict(sampler="llada", steps=None, semi_ar_block=4), reference_llada, dict(block_length=4)),
    ("llada", "mdm", dict(sampler="llada", steps=6, semi_ar_block=3), reference_llada, dict(steps=6, block_length=3)),
    (
        "llada",
        "mdm",
        dict(sampler="llada", steps=4, semi_ar_block=8, cfg_scale=1.5),
        reference_llada,
        dict(steps=4, block_length=8, cfg_scale=1.5),
    ),
    (
        "llada",
        "mdm",
        dict(sampler="llada", steps=5, semi_ar_block=4, remasking="random"),
        reference_llada,
        dict(steps=5, block_length=4, remasking="random"),
    ),
    ("dream", "mdm", dict(sampler="dream", steps=5), reference_dream, dict(steps=5)),
    (
        "dream",
        "mdm",
        dict(sampler="dream", steps=4, alg="maskgit_plus"),
        reference_dream,
        dict(steps=4, alg="maskgit_plus"),
    ),
    (
        "dream",
        "mdm",
        dict(sampler="dream", steps=6, alg="topk_margin"),
        reference_dream,
        dict(steps=6, alg="topk_margin"),
    ),
    (
        "dream",
        "mdm",
        dict(sampler="dream", steps=5, alg="entropy", alg_temp=0.5),
        reference_dream,
        dict(steps=5, alg="entropy", alg_temp=0.5),
    ),
    ("dream", "mdm", dict(sampler="dream", steps=3, alg="entropy"), reference_dream, dict(steps=3, alg="entropy")),
    (
        "sdar",
        "block",
        dict(steps=3, remasking="low_confidence_dynamic", threshold=0.03),
        reference_sdar,
        dict(steps=3, threshold=0.03),
    ),
    (
        "sdar",
        "block",
        dict(steps=2, remasking="low_confidence_dynamic", threshold=0.06),
        reference_sdar,
        dict(steps=2, threshold=0.06),
    ),
    (
        "sdar",
        "block",
        dict(steps=2, remasking="low_confidence_static"),
        reference_sdar,
        dict(steps=2, remasking="low_confidence_static"),
    ),
    ("sdar", "block", dict(steps=4, remasking="sequential"), reference_sdar, dict(steps=4, remasking="sequential")),
    (
        "fast_dllm_v2",
        "block",
        dict(steps=2, remasking="low_confidence_dynamic", threshold=0.04),
        reference_sdar,
        dict(rewrite=False, steps=2, threshold=0.04),
    ),
    ("llada2", "block", dict(steps=2, threshold=0.05), reference_llada2, dict(steps=2, threshold=0.05)),
    ("llada2", "block", dict(steps=3, threshold=0.02), reference_llada2, dict(steps=3, threshold=0.02)),
    ("llada2_32", "block", dict(steps=8, threshold=0.03), reference_llada2, dict(steps=8, threshold=0.03)),
    (
        "llada2",
        "block",
        dict(threshold=0.03, editing_threshold=0.02),
        reference_llada21,
        dict(threshold=0.03, editing_threshold=0.02),
    ),
    (
        "llada2",
        "block",
        dict(threshold=0.05, editing_threshold=0.015, max_post_steps=2),
        reference_llada21,
        dict(threshold=0.05, editing_threshold=0.015, max_post_steps=2),
    ),
    (
        "llada2_32",
        "block",
        dict(threshold=0.02, editing_threshold=0.02, max_post_steps=0),
        reference_llada21,
        dict(threshold=0.02, editing_threshold=0.02, max_post_steps=0),
    ),
    (
        "llada_moe",
        "mdm",
        dict(sampler="llada", steps=4, semi_ar_block=4),
        reference_llada,
        dict(steps=4, block_length=4),
    ),
    (
        "sdar_moe",
        "block",
        dict(steps=2, remasking="low_confidence_dynamic", threshold=0.04),
        reference_sdar,
        dict(steps=2, threshold=0.04),
    ),
]


def params_for(i, temperature, **kw):
    return SamplingParams(max_new_tokens=5 + i, temperature=temperature, seed=100 + i, ignore_eos=True, **kw)


@pytest.mark.parametrize("family,decode,kw,ref,ref_kw", CASES)
def test_batched_engine_equals_the_one_request_reference(models, family, decode, kw, ref, ref_kw):
    model = models[family]
    for temperature, filt in ((0.0, {}), (1.0, {"top_k": 20}), (0.8, {"top_p": 0.9})):
        params = [params_for(i, temperature, **filt) for i in range(len(MIXED))]
        results = Engine(model, decoder=decode, options=EngineOptions(max_batch_size=3), **kw).generate(MIXED, params)
        for prompt, p, r in zip(MIXED, params, results):
            assert r.token_ids == ref(model, prompt, p, **ref_kw), (prompt, temperature)
            assert len(r.token_ids) == p.max_new_tokens and MASK not in r.token_ids


@pytest.mark.parametrize(
    "family,decode,kw,ref,ref_kw", [CASES[0], CASES[4], CASES[6], CASES[9], CASES[13], CASES[14], CASES[17]]
)
def test_a_stop_token_ends_the_request_where_the_reference_does(models, family, decode, kw, ref, ref_kw):
    model = models[family]
    free = SamplingParams(max_new_tokens=10, seed=1, ignore_eos=True)
    ids = Engine(model, decoder=decode, **kw).generate([MIXED[0]], free)[0].token_ids
    stop = ids[4]
    params = SamplingParams(max_new_tokens=10, seed=1, stop_token_ids=(stop,))
    r = Engine(model, decoder=decode, **kw).generate([MIXED[0]], params)[0]
    assert r.token_ids == ref(model, MIXED[0], params, **ref_kw) == ids[: ids.index(stop) + 1]
    assert r.finish_reason == "stop"


def test_a_suffix_is_filled_up_to(models):
    """A suffix (OpenAI's ``suffix``: fill-in-the-middle) follows the answer's masks: the batched engine equals the
    one-request reference over the canvas prompt + masks + suffix (LLaDA's sampler with and without guidance,
    Dream's with its shift; greedy and sampled), only the answer comes back, the suffix changes it, and a
    left-to-right decoder refuses it naming the fix."""
    suffix = (40, 41, 42, 43, 44)
    cases = [
        ("llada", dict(sampler="llada", semi_ar_block=4), reference_llada, dict(block_length=4)),
        (
            "llada",
            dict(sampler="llada", steps=4, semi_ar_block=8, cfg_scale=1.5),
            reference_llada,
            dict(steps=4, block_length=8, cfg_scale=1.5),
        ),
        ("dream", dict(sampler="dream", steps=5, alg="entropy"), reference_dream, dict(steps=5, alg="entropy")),
    ]
    for family, kw, ref, ref_kw in cases:
        model = models[family]
        for temperature in (0.0, 1.0):
            params = [params_for(i, temperature, suffix_ids=suffix) for i in range(len(MIXED))]
            results = Engine(model, decoder="mdm", options=EngineOptions(max_batch_size=3), **kw).generate(
                MIXED, params
            )
            for prompt, p, r in zip(MIXED, params, results):
                assert r.token_ids == ref(model, prompt, p, suffix=suffix, **ref_kw), (family, temperature)
                assert len(r.token_ids) == p.max_new_tokens
    greedy = [params_for(i, 0.0) for i in range(len(MIXED))]
    plain = Engine(models["llada"], decoder="mdm", sampler="llada", semi_ar_block=4).generate(MIXED, greedy)
    filled = Engine(models["llada"], decoder="mdm", sampler="llada", semi_ar_block=4).generate(
        MIXED, [params_for(i, 0.0, suffix_ids=suffix) for i in range(len(MIXED))]
    )
    assert [r.token_ids for r in plain] != [r.token_ids for r in filled]
    for family, decode in (("sdar", "block"), ("llada", "ar")):
        engine = Engine(models[family], decoder=decode)
        with pytest.raises(DLMError, match="suffix.*--decode mdm"):
            engine.add([5, 6, 7], SamplingParams(max_new_tokens=4, suffix_ids=(8, 9)))
        assert not engine.has_unfinished()


def test_token_editing_edits_and_costs_passes(models):
    """With --editing-threshold the block's placed tokens are revised (the output differs from the same sampler
    without editing) and a block takes passes after its masks are filled; --max-post-steps 0 takes none."""
    p = [params_for(i, 0.0) for i in range(len(MIXED))]
    runs = {}
    for name, kw in (
        ("plain", dict(threshold=0.03)),
        ("edit", dict(threshold=0.03, editing_threshold=0.02)),
        ("edit0", dict(threshold=0.03, editing_threshold=0.02, max_post_steps=0)),
    ):
        results = Engine(models["llada2"], decoder="block", options=EngineOptions(max_batch_size=3), **kw).generate(
            MIXED, p
        )
        runs[name] = ([r.token_ids for r in results], sum(r.stats.forwards for r in results))
    assert runs["edit"][0] != runs["plain"][0]
    assert runs["edit"][1] > runs["edit0"][1]


def test_the_family_sampler_is_the_default(models):
    """Without --sampler a LLaDA checkpoint decodes with LLaDA's sampler, Dream with Dream's (alg origin), SDAR
    with SDAR's dynamic low-confidence strategy at its threshold 0.85, LLaDA2 with its own (that strategy with the
    block length's quotas, threshold 0.95); dlm's own mdm models keep the confidence sampler. One rule for the
    family's settings, whatever built the config: every setting its caller did not choose is the family's."""
    p = SamplingParams(max_new_tokens=6, seed=3, ignore_eos=True)
    cases = [
        ("llada", "mdm", reference_llada, dict(block_length=32)),
        ("dream", "mdm", reference_dream, {}),
        ("sdar", "block", reference_sdar, dict(threshold=0.85)),  # SDAR's generate.py default
        ("llada2", "block", reference_llada2, {}),  # LLaDA2's rule and its threshold 0.95
        ("llada_moe", "mdm", reference_llada, dict(block_length=32)),  # LLaDA-MoE samples as LLaDA does
    ]
    for family, decode, ref, ref_kw in cases:
        got = generate(models[family], [MIXED[0]], decode, p)[0].token_ids
        assert got == ref(models[family], MIXED[0], p, **ref_kw), family
    assert Engine(models["llada"], decoder="mdm").decoder.sampler.name == "llada"
    from dlm.decode.configs import make_config

    assert Engine(models["llada2"], decoder="block").decoder.threshold == 0.95  # LLaDA2's
    assert Engine(models["llada2"], decoder=make_config("block", steps=4)).decoder.threshold == 0.95  # (the CLI's)
    assert Engine(models["llada2"], decoder="block", threshold=0.5).decoder.threshold == 0.5  # given: kept
    assert Engine(models["llada2"], decoder=BlockConfig()).decoder.threshold == 0.95  # the Python API: the same
    assert Engine(models["llada2"], decoder=BlockConfig(steps=4)).decoder.threshold == 0.95
    assert Engine(models["llada2"], decoder=BlockConfig(threshold=0.9)).decoder.threshold == 0.9  # chosen: kept
    chosen = BlockConfig()
    chosen.threshold = 0.7  # assigned after construction: chosen too
    assert Engine(models["llada2"], decoder=chosen).decoder.threshold == 0.7
    assert Engine(models["sdar"], decoder="block").decoder.threshold == 0.85  # SDAR's
    assert Engine(models["sdar"], decoder=BlockConfig()).decoder.threshold == 0.85
    assert Engine(models["fast_dllm_v2"], decoder="block").decoder.threshold == 0.9  # dlm's, for the others
    from dlm.cli import build_parser
    from dlm.decode.configs import config_from_args

    def cli(*flags):  # the commands' path: flags -> config -> engine
        args = build_parser().parse_args(["generate", "--prompt", "x", "--decode", "block", *flags])
        return Engine(models["llada2"], decoder=config_from_args(args)).decoder.threshold

    assert cli() == 0.95 and cli("--threshold", "0.6") == 0.6


def test_family_block_rules_are_settings_of_its_record(models):
    """SDAR's and LLaDA2's block-sampler rules are their records' sampler settings (remasking, how the quotas split,
    LLaDA2.0's cap of a block's passes), not branches on the family's name: the engine's decoder shows them, and a
    top-k run (--threshold 0) of SDAR's dynamic remasking is its static one, as before."""

    def rules(family):
        dec = Engine(models[family], decoder="block").decoder
        return dec.remasking, dec.quota_overflow, dec.length_quotas, dec.steps_at_most_new_tokens

    assert rules("llada2") == ("low_confidence_dynamic", "clip", True, True)
    assert rules("sdar") == ("low_confidence_dynamic", "rewrite", True, False)
    assert rules("fast_dllm_v2")[:3] == (None, "masks", False)  # dlm's own rule
    p = SamplingParams(max_new_tokens=6, seed=3, ignore_eos=True)
    got = generate(models["sdar"], [MIXED[0]], BlockConfig(steps=2, threshold=0.0), p)[0].token_ids
    assert got == reference_sdar(models["sdar"], MIXED[0], p, steps=2, remasking="low_confidence_static")


def test_sampler_option_errors():
    from dlm.decode.configs import MDMConfig

    for kw, words in (
        (dict(sampler="dream", cfg_scale=1.0), "--cfg-scale"),
        (dict(sampler="llada", alg="entropy"), "--alg"),
        (dict(alg="nope"), "--alg"),
        (dict(sampler="llada", remasking="x"), "--remasking"),
        (dict(cfg_scale=-1.0), "--cfg-scale"),
        (dict(sampler="dream", alg_temp=-1.0), "--alg-temp"),
    ):
        with pytest.raises(DLMError, match=words):
            MDMDecoder(MDMConfig(**kw))
    with pytest.raises(DLMError, match="--remasking"):
        BlockConfig(remasking="low_confidence")
    from dlm.decode.mdm import llada_quotas

    with pytest.raises(DLMError, match="--steps 2"):
        llada_quotas(12, 4, 2)


def test_too_few_steps_refused_when_the_request_is_added(models):
    engine = Engine(models["llada"], decoder="mdm", sampler="llada", steps=2, semi_ar_block=4)
    with pytest.raises(DLMError, match="--steps 2 is fewer than the 3 blocks"):
        engine.add([5, 6, 7], SamplingParams(max_new_tokens=12))
    assert not engine.has_unfinished()


def test_generate_command_on_published_folders(tmp_path, capsys):
    folder = write_llada(tmp_path / "llada")
    argv = [
        "generate",
        "--model",
        str(folder),
        "--prompt",
        "The cat",
        "--decode",
        "mdm",
        "--max-new-tokens",
        "6",
        "--block-length",
        "3",
        "--json",
        "--threads",
        "1",
    ]
    assert main(argv + ["--cfg-scale", "1.0"]) == 0
    assert main(argv + ["--sampler", "dream", "--alg", "entropy"]) == 0
    capsys.readouterr()
    assert main(argv + ["--suffix", " on the mat."]) == 0  # fill-in-the-middle: what generate() fills
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    model = dlm.load_model(folder)
    tok = model.tokenizer
    fill = SamplingParams(6, seed=0, suffix_ids=tuple(tok(" on the mat.", add_special_tokens=False)["input_ids"]))
    assert got == generate(model, [tok("The cat")["input_ids"]], MDMConfig(semi_ar_block=3), fill)[0].token_ids
    assert main([*argv[:6], "ar", "--suffix", "x"]) == 2
    assert "--suffix" in capsys.readouterr().err
    assert (
        main(
            [
                "generate",
                "--model",
                str(write_sdar(tmp_path / "sdar")),
                "--prompt",
                "The cat",
                "--decode",
                "block",
                "--max-new-tokens",
                "6",
                "--remasking",
                "sequential",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(argv + ["--sampler", "dream", "--cfg-scale", "1.0"]) == 2
    assert "--cfg-scale" in capsys.readouterr().err


def test_dream_breaks_ties_as_its_own_code_does(models):
    """Under top-p at temperature 0 every mask's confidence is exactly 1 (one token left): Dream takes torch.topk
    over the whole sequence with the non-masks at -inf, and among tied values that returns other positions than a
    top-k over the masks alone - the order in which the answer is revealed, and so its tokens, follow Dream's."""
    model = models["dream"]
    for alg in ("maskgit_plus", "entropy"):
        params = [
            SamplingParams(max_new_tokens=9 + 3 * i, temperature=0.0, top_p=1e-3, ignore_eos=True)
            for i in range(len(MIXED))
        ]
        results = Engine(
            model, decoder="mdm", options=EngineOptions(max_batch_size=3), sampler="dream", steps=3, alg=alg
        ).generate(MIXED, params)
        for prompt, p, r in zip(MIXED, params, results):
            assert r.token_ids == reference_dream(model, prompt, p, steps=3, alg=alg), (alg, prompt)


def test_dream_counts_the_masks_to_reveal_in_float32():
    """Dream's count ``int(num_mask_token * (1 - s / t))`` with float32 tensors (its timesteps, and the mask count
    divided by the batch size), every mask at the last pass: dream_reveal_count gives it along whole schedules, and
    on these the same formula in float64 would reveal a different number at some passes."""
    from dlm.decode.mdm import dream_reveal_count

    def dream(n, t, i, steps):  # the expression of Dream's _sample, for one row
        num_mask_token = torch.tensor([n]).sum() / 1
        return int(num_mask_token * (1 - t[i + 1] / t[i])) if i < steps - 1 else int(num_mask_token)

    differ = 0
    for length, steps in [(794, 493), (1000, 333), (517, 512), (64, 64), (1024, 100)]:
        t = torch.linspace(1, 1e-3, steps + 1)
        n = length
        for i in range(steps):
            k = dream(n, t, i, steps)
            assert dream_reveal_count(n, t, i, steps) == k, (length, steps, i)
            differ += i < steps - 1 and k != int(n * (1.0 - float(t[i + 1] / t[i])))
            n -= k
        assert n == 0
    assert differ > 0


def test_sdar_rewrites_decoded_positions_when_a_quota_exceeds_the_masks_left(models):
    """SDAR's generate.py: a threshold pass may commit more than its quota, so a later pass's quota exceeds the
    masks left, and its top-k over the block (non-masks at -inf) picks decoded positions too and rewrites them.
    On SDAR checkpoints that is the default (quota_overflow='rewrite'); 'masks' commits only masks. Both equal
    the reference run the same way, and on these prompts they differ (the rewrite does happen)."""
    model = models["sdar"]
    params = [
        SamplingParams(max_new_tokens=8 + i, temperature=t, seed=7 + i, ignore_eos=True)
        for i, t in enumerate((0.0, 1.0, 0.0, 1.0))
    ][: len(MIXED)]
    runs = {}
    for overflow in ("rewrite", "masks"):
        kw = dict(steps=2, remasking="low_confidence_dynamic", threshold=0.02, quota_overflow=overflow)
        results = Engine(model, decoder="block", options=EngineOptions(max_batch_size=3), **kw).generate(
            MIXED[: len(params)], params
        )
        runs[overflow] = [r.token_ids for r in results]
        for prompt, p, r in zip(MIXED, params, results):
            want = reference_sdar(model, prompt, p, steps=2, threshold=0.02, rewrite=overflow == "rewrite")
            assert r.token_ids == want, (overflow, prompt)
    assert runs["rewrite"] != runs["masks"]
    assert Engine(model, decoder="block").decoder.quota_overflow == "rewrite"  # SDAR's, by default
    assert Engine(models["fast_dllm_v2"], decoder="block").decoder.quota_overflow == "masks"
