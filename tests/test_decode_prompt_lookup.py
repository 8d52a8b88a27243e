"""Prompt lookup decoding (``ar`` with ``prompt_lookup=K``): drafts copied from earlier in the prompt or output,
verified in the same forward - greedy output token for token AR's (with the static cache, the prefix cache, stop
strings, log-probabilities, a structured output), sampled output in AR's exact distribution; more than one token
per forward where the answer repeats."""

import math

import pytest
import torch
from test_decode_penalties import STRONG, exact_distribution, tiny_idlm

from dlm.decode.ar import NgramIndex
from dlm.decode.configs import make_config
from dlm.decode.engine import Engine
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams
from dlm.errors import DLMError
from dlm.testing import make_model, make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = make_tokenizer()
TEXTS = (
    "The cat sat on the mat and the dog sat on the log. The cat sat on",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 1 2 3",
    "Once upon",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to be, or not to",
)


def prompts():
    return [TOK(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def test_the_index_proposes_what_followed_the_latest_earlier_occurrence():
    idx = NgramIndex(2, 3)
    #        0  1  2  3  4  5  6  7  8
    seq = [5, 6, 7, 8, 5, 6, 9, 5, 6]
    assert idx.propose(seq, [], 3) == [9, 5, 6]  # "5 6" last occurred at 4..5, followed by 9 (not at 0..1)
    assert idx.propose(seq, [9], 2) == [5, 6]  # "5 6 9" (3-gram) at 4..6 -> what followed it
    assert idx.propose(seq, [9, 1], 3) == []  # "9 1" never occurred before
    assert NgramIndex(2, 3).propose([1, 2, 3], [], 4) == []  # the last n-gram itself is not an earlier occurrence
    three = NgramIndex(1, 3)
    assert three.propose([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], [], 2) == [9, 2]  # "1 2 3" at 0..2 beats "2 3" at 4..5
    with pytest.raises(DLMError, match="--prompt-lookup-max"):
        make_config("ar", prompt_lookup=4, prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(DLMError, match="--prompt-lookup must be an integer from 0"):
        make_config("ar", prompt_lookup=-1)


@pytest.mark.parametrize("static", [False, True])
def test_greedy_output_is_ar_token_for_token(static):
    model = make_model("llama", seed=0)
    ps = prompts()
    params = [
        SamplingParams(40, ignore_eos=True),
        SamplingParams(40, ignore_eos=True, logprobs=2),
        SamplingParams(40, ignore_eos=True, stop_strings=(" sat on the log",)),
        SamplingParams(7, ignore_eos=True),  # the length limit inside a chunk's drafts
    ]
    want = Engine(model, TOK, decoder="ar").generate(ps, params)
    eng = Engine(
        model, TOK, decoder="ar", prompt_lookup=5, options=EngineOptions(max_batch_size=3, static_cache=static)
    )
    got = eng.generate(ps, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason and g.text == w.text
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(got[1].logprobs, want[1].logprobs))
    assert [len(r.token_ids) for r in got][3] == 7
    # the answers repeat (a small random model loops): several tokens per forward, drafts mostly kept
    assert sum(r.stats.new_tokens for r in got) > 1.2 * sum(r.stats.forwards for r in got)
    assert sum(r.stats.accepted[0] for r in got if r.stats.accepted) > 0
    # the prefix cache: a prompt that starts like a stored one, with the lookup over the whole prompt
    cached = Engine(model, TOK, decoder="ar", prompt_lookup=5, options=EngineOptions(prefix_cache=4096))
    cached.generate(ps[:1], params[0])
    again = cached.generate([ps[0] + ps[1]], params[0])[0]
    assert again.token_ids == Engine(model, TOK, decoder="ar").generate([ps[0] + ps[1]], params[0])[0].token_ids
    assert again.stats.cached_tokens > 0


def test_the_drafting_policy_decides_when_a_step_drafts():
    """``lookup_budget``: a token budget no step fits drafts never (one token a forward), 'auto' measures both
    kinds of step; the output is AR's either way. A bad budget names its flag."""
    model = make_model("llama", seed=0)
    ps = prompts()
    params = SamplingParams(40, ignore_eos=True)
    want = [r.token_ids for r in Engine(model, TOK, decoder="ar").generate(ps, params)]
    never = Engine(
        model, TOK, decoder="ar", prompt_lookup=4, lookup_budget=1, options=EngineOptions(max_batch_size=4)
    ).generate(ps, params)
    assert [r.token_ids for r in never] == want and all(r.stats.tpf <= 1.0 for r in never)
    eng = Engine(
        model, TOK, decoder="ar", prompt_lookup=4, lookup_budget="auto", options=EngineOptions(max_batch_size=4)
    )
    assert [r.token_ids for r in eng.generate(ps, params)] == want
    assert any(b.window[True].steps and b.window[False].steps for b in eng.decoder.policy.buckets.values())
    with pytest.raises(DLMError, match="--prompt-lookup-budget must be"):
        make_config("ar", prompt_lookup=4, lookup_budget="sometimes")


def test_a_structured_output_with_prompt_lookup():
    pytest.importorskip("llguidance")
    from dlm.decode.structured import StructuredOutput

    model = make_model("llama", seed=0)
    spec = StructuredOutput(regex=r"(the (cat|dog) sat on the (mat|log)\. ){1,4}")
    params = SamplingParams(60, structured=spec)
    ps = prompts()
    want = Engine(model, TOK, decoder="ar").generate(ps, params)
    got = Engine(model, TOK, decoder="ar", prompt_lookup=4, options=EngineOptions(max_batch_size=2)).generate(
        ps, params
    )
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_sampled_output_has_the_ar_distribution():
    """A 4-token vocabulary and n-grams from 1 token on, so that drafts are proposed at almost every step and both
    kept and refused: the empirical distribution of 3-token continuations within the Bretagnolle-Huber-Carol bound
    of the exact one, plain and with penalties (drafts verified under the adjusted distribution)."""
    dlm = tiny_idlm()
    prompt, k, n = [1, 2, 3, 1, 2, 0, 1], 3, 2000
    m = dlm.mask_token_id
    eps = math.sqrt((m**k * math.log(2) + math.log(1e4)) / (2 * n))  # delta 1e-4
    for extra in ({}, dict(logit_bias=((2, 1.5),), **STRONG)):
        exact = exact_distribution(dlm, prompt, k, SamplingParams(k, temperature=1.0, **extra))
        eng = Engine(dlm, decoder="ar", prompt_lookup=3, prompt_lookup_min=1, options=EngineOptions(max_batch_size=n))
        res = eng.generate(
            [prompt] * n, [SamplingParams(k, temperature=1.0, seed=s, ignore_eos=True, **extra) for s in range(n)]
        )
        counts = torch.zeros(m**k)
        for r in res:
            assert len(r.token_ids) == k
            counts[sum(t * m ** (k - 1 - j) for j, t in enumerate(r.token_ids))] += 1
        tv = 0.5 * float((counts / n - exact).abs().sum())
        assert tv < eps, (extra, tv, eps)
        proposed = sum(r.stats.proposed[0] for r in res if r.stats.proposed)
        accepted = sum(r.stats.accepted[0] for r in res if r.stats.accepted)
        assert proposed >= n and 0.05 < accepted / proposed < 0.95, (proposed, accepted)  # both kept and refused
