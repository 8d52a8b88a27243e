"""Log-probabilities from the engine (``SamplingParams.logprobs`` / ``prompt_logprobs``): for every left-to-right
decoder they are the model's own next-token distribution at each returned token's position - what one teacher-forced
forward over the prompt and the output gives - whichever step, chunk row or candidate the token came from."""

import pytest
import torch

from dlm import convert_ar_to_dlm
from dlm.decode.engine import Engine
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams, token_logprobs
from dlm.errors import DLMError
from dlm.testing import make_model, make_tokenizer, oracle_candidates, oracle_isd

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]
TOL = 1e-4  # the engine's CPU kernels vs the plain forward of the reference: float32 rounding only

pytestmark = pytest.mark.usefixtures("one_thread")


def idlm(arch="llama", seed=1, block_size=3):
    return convert_ar_to_dlm(make_model(arch, seed=seed), "idlm", block_size=block_size, tokenizer=make_tokenizer())


def reference(model, prompt, out, k):
    """Teacher forcing: one plain forward over prompt + output, the output tokens' log-probabilities."""
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return token_logprobs(logits[len(prompt) - 1 : len(prompt) + len(out) - 1], out, k, model.mask_token_id)


def assert_same(got, want):
    assert [t.token_id for t in got] == [t.token_id for t in want]
    for g, w in zip(got, want):
        assert abs(g.logprob - w.logprob) < TOL, (g, w)
        assert [i for i, _ in g.top] == [i for i, _ in w.top], (g, w)
        assert all(abs(a - b) < TOL for (_, a), (_, b) in zip(g.top, w.top)), (g, w)


def decoders(model, params):
    """name -> a decoder (or name) and its settings; the oracles draft the AR output at a set acceptance."""
    truth = {}
    eng = Engine(model, decoder="ar", options=EngineOptions(max_batch_size=4))
    ids = [eng.add(p, SamplingParams(max_new_tokens=params.max_new_tokens + 4, ignore_eos=True)) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    for rid, p in zip(ids, PROMPTS):
        truth[rid] = p + eng.pop_result(rid).token_ids
    batched = oracle_isd(truth, 0.7, stride=3)
    batched.batch_verify = True  # the batched verify-and-accept (an accelerator's default) on the CPU
    return {
        "ar": ("ar", {}),
        "ar-static": ("ar", {"static_cache": True}),
        "isd-n3": (oracle_isd(truth, 0.7, stride=3), {}),
        "isd-n3-batched": (batched, {}),
        "isd-n3-static": (oracle_isd(truth, 0.7, stride=3), {"static_cache": True}),
        "isd-n2-predict": (oracle_isd(truth, 0.6, stride=2, fallback="predict"), {}),
        "isd-candidates": (oracle_candidates(truth, 0.3, candidates=2), {}),
    }


@pytest.mark.parametrize(
    "name", ["ar", "ar-static", "isd-n3", "isd-n3-batched", "isd-n3-static", "isd-n2-predict", "isd-candidates"]
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_models_distribution_at_each_returned_token(name, temperature):
    model = idlm()
    ks = [3, 0, None, 5]  # per request: 3 alternatives, the token's own only, none, 5
    base = SamplingParams(max_new_tokens=13, ignore_eos=True, temperature=temperature)
    dec, kw = decoders(model, base)[name]
    eng = Engine(
        model, decoder=dec, options=EngineOptions(max_batch_size=3, **kw)
    )  # 4 requests, 3 rows: one joins a running batch
    streamed: dict = {}
    ids = []
    for p, k in zip(PROMPTS, ks):
        params = SamplingParams(max_new_tokens=13, ignore_eos=True, temperature=temperature, seed=7, logprobs=k)
        ids.append(eng.add(p, params, request_id=len(ids)))  # the oracles' truth is keyed by these ids
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.logprobs is not None:
                streamed.setdefault(ev.request_id, []).extend(ev.logprobs)
            assert ev.logprobs is None or len(ev.logprobs) == len(ev.new_token_ids)
    multi = 0
    for rid, p, k in zip(ids, PROMPTS, ks):
        r = eng.pop_result(rid)
        if k is None:
            assert r.logprobs is None and rid not in streamed
            continue
        assert len(r.token_ids) == 13 and len(r.logprobs) == 13  # ISD's overshoot past max_new_tokens dropped
        assert_same(r.logprobs, reference(model, p, r.token_ids, k))
        assert all(len(t.top) == k for t in r.logprobs)
        assert streamed[rid] == r.logprobs
        multi += r.stats.tpf > 1.0
    if name.startswith("isd"):
        assert multi, "no request committed several tokens per forward: the test would not see a wrong row"


def test_greedy_top1_is_the_token_itself():
    """Greedy: every token is its position's most likely one, with exactly the first alternative's log-probability
    (what an evaluation harness compares to call a continuation greedy)."""
    model = idlm()
    r = Engine(model, decoder="isd", stride=3).generate([PROMPTS[2]], SamplingParams(12, ignore_eos=True, logprobs=2))
    for t in r[0].logprobs:
        assert t.top[0] == (t.token_id, t.logprob) and t.top[1][1] <= t.logprob


@pytest.mark.parametrize("decoder", ["ar", "isd"])
def test_prompt_logprobs_are_teacher_forcing_over_the_prompt(decoder):
    model = idlm()
    prompts = [PROMPTS[0], [30, 31, 32, 33, 34], [40]]  # two of one length share a prefill forward
    ks = [2, None, 0]
    eng = Engine(model, decoder=decoder, options=EngineOptions(max_batch_size=4))
    ids = [eng.add(p, SamplingParams(6, ignore_eos=True, prompt_logprobs=k, logprobs=1)) for p, k in zip(prompts, ks)]
    while eng.has_unfinished():
        eng.step()
    for rid, p, k in zip(ids, prompts, ks):
        r = eng.pop_result(rid)
        assert_same(r.logprobs, reference(model, p, r.token_ids, 1))  # the prefill's own token still right
        if k is None:
            assert r.prompt_logprobs is None
            continue
        assert len(r.prompt_logprobs) == len(p) and r.prompt_logprobs[0] is None
        assert_same(r.prompt_logprobs[1:], reference(model, p[:1], p[1:], k))


def test_logprobs_stop_with_the_output_and_are_in_the_result_dict():
    model = idlm()
    ar = Engine(model).generate([PROMPTS[0]], SamplingParams(10, ignore_eos=True))[0].token_ids
    stop = ar[4]
    r = Engine(model, decoder="isd", stride=3).generate(
        [PROMPTS[0]], SamplingParams(10, stop_token_ids=(stop,), logprobs=1)
    )[0]
    assert r.token_ids == ar[: ar.index(stop) + 1] and r.finish_reason == "stop"
    assert [t.token_id for t in r.logprobs] == r.token_ids
    d = r.to_dict()
    assert [t["token_id"] for t in d["logprobs"]] == r.token_ids and "prompt_logprobs" not in d


def test_logprobs_are_refused_for_the_diffusion_decoders():
    model = convert_ar_to_dlm(make_model("llama"), "mdm", tokenizer=make_tokenizer())
    eng = Engine(model, decoder="mdm", steps=4)
    with pytest.raises(
        DLMError, match=r"logprobs: not with --decode \w+, which commits tokens out of order.*a left-to-right decoder"
    ):
        eng.add(PROMPTS[0], SamplingParams(8, logprobs=1))
    with pytest.raises(DLMError, match="logprobs must be an integer in 0..20"):
        SamplingParams(8, logprobs=21)


def test_token_logprobs_of_a_long_prompt_go_a_slice_at_a_time(monkeypatch):
    """Slicing the positions (a long prompt's temporaries) changes nothing: each row's numbers are its own."""
    from dlm.decode import sampling

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1300, 50, generator=g)
    tokens = torch.randint(0, 50, (1300,), generator=g).tolist()
    sliced = token_logprobs(logits, tokens, 3, 7)
    monkeypatch.setattr(sampling, "LOGPROB_ROWS", 1 << 20)
    assert token_logprobs(logits, tokens, 3, 7) == sliced and len(sliced) == 1300
    assert not any(i == 7 for t in sliced for i, _ in t.top)  # the mask token is never an alternative
