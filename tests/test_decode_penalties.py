"""Logit bias and the repetition / presence / frequency penalties (``SamplingParams``): AR decoding equals a plain
teacher-forced loop that applies them; ISD's greedy output equals AR's and its sampled output has exactly the
adjusted AR distribution, on every ISD path (drafts verified at positions whose history includes earlier drafts)."""

import itertools
import math

import pytest
import torch

from dlm import convert_ar_to_dlm
from dlm.decode.engine import Engine
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams, token_logprobs
from dlm.errors import DLMError
from dlm.model.convert import DiffusionLM, DLMSpec
from dlm.testing import every_isd_path, make_model, make_tokenizer, oracle_candidates, oracle_isd

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]
STRONG = dict(repetition_penalty=1.8, presence_penalty=0.8, frequency_penalty=0.6)


def penalized(logits, prompt, out, p):
    """The adjustment written out (vLLM's order: bias, repetition over prompt + output, frequency and presence over
    the output), for one position's logits [V]."""
    x = logits.float().clone()
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    if len(out) < p.min_tokens:
        for t in p.stop_token_ids or ():
            x[t] = float("-inf")
    return x


def reference_greedy(model, prompt, params):
    """Greedy decoding by full forwards, the adjustment applied to each position's logits."""
    out = []
    m = model.mask_token_id
    for _ in range(params.max_new_tokens):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1]
        x = penalized(logits, prompt, out, params)
        if m is not None:
            x[m] = float("-inf")
        out.append(int(x.argmax()))
        if out[-1] in (params.stop_token_ids or ()):
            break
    return out


def idlm(seed=1):
    return convert_ar_to_dlm(make_model("llama", seed=seed), "idlm", block_size=3, tokenizer=make_tokenizer())


def test_ar_and_every_isd_path_equal_the_reference_with_penalties():
    model = idlm()
    params = SamplingParams(14, ignore_eos=True, logit_bias=((40, 3.0), (41, -100.0)), **STRONG)
    plain = SamplingParams(14, ignore_eos=True)
    ref = [reference_greedy(model, p, params) for p in PROMPTS]
    unadjusted = [r.token_ids for r in Engine(model, options=EngineOptions(max_batch_size=4)).generate(PROMPTS, plain)]
    assert ref != unadjusted  # the adjustment changes the output, so a decoder that ignored it would fail
    assert [
        r.token_ids for r in Engine(model, options=EngineOptions(max_batch_size=3)).generate(PROMPTS, params)
    ] == ref
    truth = {i: p + r for i, (p, r) in enumerate(zip(PROMPTS, ref))}
    for name, res in every_isd_path(model, PROMPTS, params, truth):
        assert [r.token_ids for r in res] == ref, name
        if name.startswith("isd-n") or name == "isd-candidates":
            assert any(r.stats.tpf > 1.5 for r in res), name  # drafts accepted: later rows saw earlier drafts


def test_min_tokens_holds_the_stop_tokens_back_on_every_path():
    model = idlm()
    free = Engine(model).generate(PROMPTS, SamplingParams(14, ignore_eos=True))
    stops = tuple({r.token_ids[2] for r in free})  # each request would stop at its 3rd token
    params = SamplingParams(14, stop_token_ids=stops, min_tokens=6)
    ref = [reference_greedy(model, p, params) for p in PROMPTS]
    assert all(len(r) >= 6 for r in ref) and any(len(r) < 14 for r in ref)  # held back, then a stop
    assert [
        r.token_ids for r in Engine(model, options=EngineOptions(max_batch_size=3)).generate(PROMPTS, params)
    ] == ref
    truth = {i: p + r.token_ids for i, (p, r) in enumerate(zip(PROMPTS, free))}
    for name, dec, kw in [
        ("isd-n3", oracle_isd(truth, 0.7, stride=3), {}),
        ("isd-candidates", oracle_candidates(truth, 0.3, candidates=2), {}),
        ("isd-untrained", "isd", {"stride": 4}),
    ]:
        eng = Engine(model, decoder=dec, options=EngineOptions(max_batch_size=3), **kw)
        ids = [eng.add(p, params, request_id=i) for i, p in enumerate(PROMPTS)]
        while eng.has_unfinished():
            eng.step()
        assert [eng.pop_result(i).token_ids for i in ids] == ref, name


def test_logprobs_stay_the_models_own_under_penalties():
    """Log-probabilities are the model's distribution (vLLM's raw ones), not the adjusted one that chose the token."""
    model = idlm()
    params = SamplingParams(8, ignore_eos=True, logprobs=1, **STRONG)
    r = Engine(model, decoder="isd", stride=3).generate([PROMPTS[0]], params)[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPTS[0] + r.token_ids])).logits[0]
    want = token_logprobs(logits[len(PROMPTS[0]) - 1 : -1], r.token_ids, 1, model.mask_token_id)
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(r.logprobs, want))


def tiny_idlm(vocab=5, scale=6.0):
    model = make_model("llama", seed=0, vocab_size=vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return DiffusionLM(model, None, DLMSpec("idlm", vocab - 1, True, 2))


def exact_distribution(dlm, prompt, k, params):
    """The adjusted model's exact distribution over all k-token continuations, by enumeration."""
    m = dlm.mask_token_id
    conts = list(itertools.product(range(m), repeat=k))
    seqs = torch.tensor([prompt + list(c) for c in conts])
    with torch.no_grad():
        logits = dlm(input_ids=seqs).logits.float()
    total = torch.zeros(len(conts))
    for i, c in enumerate(conts):
        for j in range(k):
            x = penalized(logits[i, len(prompt) - 1 + j], prompt, list(c[:j]), params)
            x[m] = float("-inf")
            total[i] += x.log_softmax(-1)[c[j]]
    return total.exp()


def test_sampled_isd_has_the_adjusted_ar_distribution():
    dlm = tiny_idlm()
    prompt, k, n = [1, 2, 3, 0], 3, 2000  # 3 tokens: a verify row whose history holds a draft
    # token 0 stops, but not before the 2nd new token: a 3-token continuation either way
    params = dict(temperature=1.0, stop_token_ids=(0,), min_tokens=2, logit_bias=((2, 1.5),), **STRONG)
    exact = exact_distribution(dlm, prompt, k, SamplingParams(k, **params))
    plain = exact_distribution(dlm, prompt, k, SamplingParams(k, temperature=1.0))
    m = dlm.mask_token_id
    K = m**k
    eps = math.sqrt((K * math.log(2) + math.log(1e4)) / (2 * n))  # Bretagnolle-Huber-Carol, delta 1e-4: 0.116
    assert 0.5 * float((exact - plain).abs().sum()) > 2 * eps  # the adjustment is visible at this sample size
    for name, kw in [
        ("ar", dict(decoder="ar")),
        ("isd2", dict(decoder="isd", stride=2)),
        ("isd3", dict(decoder="isd", stride=3)),
    ]:
        res = Engine(dlm, options=EngineOptions(max_batch_size=n), **kw).generate(
            [prompt] * n, [SamplingParams(k, seed=s, **params) for s in range(n)]
        )
        counts = torch.zeros(K)
        assert all(len(r.token_ids) == k and 0 not in r.token_ids[:2] for r in res), name
        for r in res:
            counts[sum(t * m ** (k - 1 - j) for j, t in enumerate(r.token_ids))] += 1
        tv = 0.5 * float((counts / n - exact).abs().sum())
        assert tv < eps, (name, tv, eps)
        if name != "ar":
            acc = sum(r.stats.accepted[0] for r in res) / max(1, sum(r.stats.proposed[0] for r in res))
            assert 0.05 < acc < 0.999, (name, acc)  # both accept and reject were exercised


def test_refusals():
    with pytest.raises(DLMError, match="repetition-penalty must be > 0"):
        SamplingParams(4, repetition_penalty=0.0)
    with pytest.raises(DLMError, match="presence-penalty must be in"):
        SamplingParams(4, presence_penalty=3.0)
    with pytest.raises(DLMError, match="logit_bias values"):
        SamplingParams(4, logit_bias={5: 200.0})
    for seed in (-(2**63) - 1, 2**64, 1.5):  # a torch generator takes 64 bits
        with pytest.raises(DLMError, match="--seed must be an integer that fits in 64 bits"):
            SamplingParams(4, seed=seed)
    assert SamplingParams(4, seed=2**64 - 1).make_generator() is not None
    assert SamplingParams(4, logit_bias={7: 1.0, 3: -2}).logit_bias == ((3, -2.0), (7, 1.0))
    assert not SamplingParams(4).adjusts and SamplingParams(4, presence_penalty=0.1).adjusts
    assert SamplingParams(4, min_tokens=2).adjusts
    with pytest.raises(DLMError, match="--min-tokens must be an integer from 0 to --max-new-tokens"):
        SamplingParams(4, min_tokens=5)
    model = idlm()
    with pytest.raises(DLMError, match="outside the vocabulary"):
        Engine(model).add(PROMPTS[0], SamplingParams(4, logit_bias={10_000: 1.0}))
    mdm = convert_ar_to_dlm(make_model("llama"), "mdm", tokenizer=make_tokenizer())
    with pytest.raises(DLMError, match=r"penalties: not with --decode \w+.*use a left-to-right decoder"):
        Engine(mdm, decoder="mdm", steps=4).add(PROMPTS[0], SamplingParams(4, repetition_penalty=1.2))


def test_a_chunk_positions_history_is_its_ancestors():
    """What counts as output at each chunk position: the chunk's earlier tokens that position attends to (a tree
    chunk's own attention), less the pending token and the masks."""
    from types import SimpleNamespace

    from dlm.decode.isd import candidate_layout

    eng = Engine(idlm(), decoder="isd", candidates=3)
    m = eng.mask_token_id
    row = SimpleNamespace(adjust=object())
    c, d1, d2, d3 = 50, 51, 52, 53
    assert eng._chunk_history(row, [c, d1, d2, m, m], None) == [[], [d1], [d1, d2], [d1, d2], [d1, d2]]
    tree = candidate_layout(3, True)  # c, d1 d2 d3 (one position), their masks, F (the rejection branch's mask)
    chunk = [c, d1, d2, d3, m, m, m, m]
    assert eng._chunk_history(row, chunk, tree) == [[], [d1], [d2], [d3], [d1], [d2], [d3], []]
    assert eng._chunk_history(SimpleNamespace(adjust=None), chunk, tree) is None


@pytest.mark.parametrize("r", [5e-324, 1e-30, 1e30, 1.7e308])
def test_extreme_repetition_penalties_still_sample(r):
    """A repetition penalty that overflows a logit to infinity still gives a distribution (no NaN), greedy or not."""
    model = idlm()
    for t in (0.0, 1.0):
        res = Engine(model, decoder="isd", stride=3).generate(
            [PROMPTS[0]], SamplingParams(6, ignore_eos=True, temperature=t, seed=0, repetition_penalty=r)
        )[0]
        assert len(res.token_ids) == 6
