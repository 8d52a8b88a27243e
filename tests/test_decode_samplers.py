"""Diffusion samplers (mdm: confidence / random / threshold; block): every mask resolved, max tokens respected,
reproducible for a seed, the right errors."""

import pytest
import torch
from diffusion_reference import decoder_config, reference_block, reference_mdm

from dlm import convert_ar_to_dlm
from dlm.decode import generate
from dlm.decode.block import block_mask
from dlm.decode.configs import BlockConfig
from dlm.decode.engine import Engine
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams
from dlm.errors import DLMError
from dlm.testing import make_model, make_tokenizer

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


pytestmark = pytest.mark.usefixtures("one_thread")


def dlm_of(objective, shift=None, block_size=None, arch="llama"):
    return convert_ar_to_dlm(
        make_model(arch, seed=3), objective, block_size=block_size, shift=shift, tokenizer=make_tokenizer()
    )


CASES = [
    ("mdm", dict(method="confidence", steps=4), dict()),
    ("mdm", dict(method="random", steps=5), dict()),
    ("mdm", dict(method="threshold", block_length=4, threshold=0.9), dict()),
    ("mdm", dict(method="confidence", steps=3), dict(shift=False)),
    ("mdm", dict(method="threshold", block_length=3, threshold=0.5), dict(shift=False)),
    ("block", dict(steps=2, threshold=0.9), dict(block_size=4)),
    ("block", dict(steps=3, threshold=None), dict(block_size=3)),
    ("block", dict(steps=4), dict(block_size=4, shift=True)),
]


@pytest.mark.parametrize("objective,kw,conv", CASES)
def test_diffusion_samplers_resolve_every_mask_and_are_seeded(objective, kw, conv):
    dlm = dlm_of(objective, **conv)
    for k in (1, 7):
        for temperature in (0.0, 1.0):
            p = SamplingParams(max_new_tokens=k, temperature=temperature, top_p=0.9, seed=11, ignore_eos=True)
            res = generate(dlm, PROMPTS, decoder_config(objective, kw), p)
            again = generate(dlm, PROMPTS, decoder_config(objective, kw), p)
            for r, r2 in zip(res, again):
                assert len(r.token_ids) == k and dlm.mask_token_id not in r.token_ids
                assert r.token_ids == r2.token_ids and r.stats.forwards >= 1
                assert isinstance(r.text, str)
    # the confidence sampler uses exactly `steps` passes; block uses at most `steps` per block
    if kw.get("method") == "confidence":
        r = generate(dlm, PROMPTS[:1], decoder_config("mdm", kw), SamplingParams(8, ignore_eos=True))[0]
        assert r.stats.forwards == kw["steps"]


MIXED = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], [30], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


def reference(dlm, objective, prompt, params, kw):
    if objective == "mdm":
        return reference_mdm(dlm, prompt, params, **kw)
    return reference_block(dlm, prompt, params, **kw)


@pytest.mark.parametrize("objective,kw,conv", CASES)
def test_batched_engine_equals_the_one_request_reference(objective, kw, conv):
    """The engine decodes a batch of prompts of different lengths (joining a running batch of 3) exactly as the
    plain per-request sampler does: same tokens greedy, and the same draws when sampling with a seed."""
    dlm = dlm_of(objective, **conv)
    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(max_new_tokens=5 + i, temperature=temperature, top_k=20, seed=100 + i, ignore_eos=True)
            for i in range(len(MIXED))
        ]
        results = Engine(dlm, decoder=decoder_config(objective, kw), options=EngineOptions(max_batch_size=3)).generate(
            MIXED, params
        )
        for prompt, p, r in zip(MIXED, params, results):
            ids, forwards = reference(dlm, objective, prompt, p, kw)
            assert r.token_ids == ids, (prompt, temperature)
            assert r.finish_reason == "length" and dlm.mask_token_id not in r.token_ids
            # block: the engine's prefill caches the prompt within the first pass (the reference spends a forward)
            assert r.stats.forwards == forwards - (objective == "block" and len(prompt) >= conv["block_size"])


@pytest.mark.parametrize("objective,kw,conv", [CASES[0], CASES[2], CASES[5]])
def test_diffusion_decoders_stream_in_order_and_stop_early(objective, kw, conv):
    dlm = dlm_of(objective, **conv)
    full = generate(dlm, MIXED[:2], decoder_config(objective, kw), SamplingParams(12, ignore_eos=True))
    streamed = {}
    got = generate(
        dlm,
        MIXED[:2],
        decoder_config(objective, kw),
        SamplingParams(12, ignore_eos=True),
        on_tokens=lambda rid, new, done: streamed.setdefault(rid, []).append(list(new)),
    )
    for rid, (a, b) in enumerate(zip(full, got)):
        assert a.token_ids == b.token_ids
        assert sum(streamed[rid], []) == b.token_ids
        # the answer arrives over several steps, not in one piece at the end
        assert sum(1 for d in streamed[rid] if d) > 1
    # a stop token: the same tokens up to it, and the passes after it are not spent
    r = full[0]
    stop = r.token_ids[len(r.token_ids) // 2]
    cut = r.token_ids[: r.token_ids.index(stop) + 1]
    s = generate(dlm, MIXED[:1], decoder_config(objective, kw), SamplingParams(12, stop_token_ids=(stop,)))[0]
    assert s.token_ids == cut and s.finish_reason == "stop"
    assert s.stats.forwards <= r.stats.forwards


def test_diffusion_decoders_refuse_what_does_not_fit():
    dlm = dlm_of("mdm")
    limit = dlm.hf_config.max_position_embeddings
    with pytest.raises(DLMError, match="exceed the model's context"):
        generate(dlm, [[5] * (limit - 3)], "mdm", SamplingParams(8))
    with pytest.raises(DLMError, match="--sampler"):
        Engine(dlm, decoder="mdm", sampler="best")
    with pytest.raises(DLMError, match="--steps"):
        Engine(dlm, decoder="mdm", steps=0)
    with pytest.raises(DLMError, match="--threshold"):
        Engine(dlm_of("block", block_size=4), decoder="block", threshold=1.5)


def test_block_mask_is_block_causal():
    pos = torch.arange(6)
    m = block_mask(pos, pos, 2)[0, 0].int().tolist()
    assert m == [
        [1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1],
    ]


def test_block_kv_cache_equals_full_recompute():
    """With a one-step-per-block schedule in top-k mode, decoding with the cached finished blocks gives the same
    tokens as recomputing the whole sequence under the block-causal mask (the cache is exact)."""
    dlm = dlm_of("block", block_size=2)
    p = SamplingParams(max_new_tokens=6, ignore_eos=True)
    got = generate(dlm, [PROMPTS[0]], BlockConfig(steps=1, threshold=None), p)[0].token_ids
    x = list(PROMPTS[0]) + [dlm.mask_token_id] * 6
    b = 2
    with torch.no_grad():
        for bs in range(4, 11, 2):
            be = min(bs + b, len(x))
            pos = torch.arange(be)
            logits = dlm(input_ids=torch.tensor([x[:be]]), attention_mask=block_mask(pos, pos, b)).logits[0]
            logits[:, dlm.mask_token_id] = float("-inf")
            for i in range(max(bs, 5), be):
                x[i] = int(logits[i].argmax())
    assert got == x[5:]


def test_samplers_refuse_the_wrong_model():
    with pytest.raises(DLMError, match="use --decode isd"):
        generate(dlm_of("idlm"), PROMPTS, "mdm", SamplingParams(4))
    with pytest.raises(DLMError, match="use --decode mdm"):
        generate(dlm_of("mdm"), PROMPTS, "block", SamplingParams(4))
    with pytest.raises(DLMError, match="did you mean"):
        generate(dlm_of("mdm"), PROMPTS, "mdn", SamplingParams(4))
