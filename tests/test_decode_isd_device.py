"""ISD's batched verify-and-accept (dlm.decode.isd.batch, ISDDecoder.consume_batch) equals the per-row path
(ISDDecoder.consume, the reference the exactness tests in tests/test_decode_isd.py were written for) token for
token: the same outputs, statistics, routing counts and, for sampled requests, the same generator states at the end
(every random draw taken in the same order); and a step moves one small tensor to the host."""

import pytest
import torch

from dlm import convert_ar_to_dlm
from dlm.decode.configs import ISDConfig
from dlm.decode.engine import Engine
from dlm.decode.isd import ISDDecoder, batch
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams
from dlm.model.convert import DiffusionLM, DLMSpec
from dlm.testing import HostReads, make_model, make_tokenizer, oracle_isd

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22], [23, 24, 25]]


def idlm(seed=1, block_size=3):
    return convert_ar_to_dlm(make_model("llama", seed=seed), "idlm", block_size=block_size, tokenizer=make_tokenizer())


def tiny_idlm(vocab=5, scale=6.0):
    """Vocabulary 0..vocab-2 plus the mask: sampled drafts are accepted and rejected often."""
    model = make_model("llama", seed=0, vocab_size=vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return DiffusionLM(model, None, DLMSpec("idlm", vocab - 1, True, 3))


def OracleDrafts(truth, corrupt=0.3, seed=0, **kw):
    """Drafts = the true greedy continuation, corrupted at random (through the ``_drafted`` hook both paths call):
    full acceptance, partial acceptance and a rejection at every draft position."""
    return oracle_isd(truth, 1.0 - corrupt, seed, **kw)


class Calls:
    """Counts batch.accept_rows calls (the batched path ran) while installed."""

    def __init__(self, monkeypatch):
        self.n = 0
        orig = batch.accept_rows

        def counted(*a, **kw):
            self.n += 1
            return orig(*a, **kw)

        monkeypatch.setattr(batch, "accept_rows", counted)


def run(dlm, dec, prompts, params, batch_size):
    eng = Engine(dlm, decoder=dec, options=EngineOptions(max_batch_size=batch_size))
    ids = [eng.add(p, sp, request_id=i) for i, (p, sp) in enumerate(zip(prompts, params))]
    gens = {}
    while eng.has_unfinished():
        for r in eng.rows:
            gens[r.request_id] = r.generator
        eng.step()
    res = [eng.pop_result(i) for i in ids]
    return res, gens


def both(dlm, make, prompts, params, batch_size, monkeypatch):
    """The same requests through the batched path and the per-row path; everything observable must agree."""
    calls = Calls(monkeypatch)
    fused = make()
    fused.batch_verify = True  # (the default takes it off the CPU only)
    got, g_fused = run(dlm, fused, prompts, params, batch_size)
    assert calls.n > 0, "the batched path did not run"
    ref = make()
    ref.batch_verify = False
    before = calls.n
    want, g_ref = run(dlm, ref, prompts, params, batch_size)
    assert calls.n == before, "the reference ran the batched path"
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert (a.stats.forwards, a.stats.proposed, a.stats.accepted) == (
            b.stats.forwards,
            b.stats.proposed,
            b.stats.accepted,
        )
    assert fused.counts.branch_steps == ref.counts.branch_steps and fused.counts.mode_steps == ref.counts.mode_steps
    assert fused._calib.counts == ref._calib.counts
    for rid, g in g_fused.items():
        if params[rid].seed is not None:  # the same draws, in the same order
            assert g.get_state().equal(g_ref[rid].get_state()), rid
    return got


@pytest.mark.parametrize("stride", [2, 3, 4])
def test_batched_greedy_equals_per_row_with_oracle_drafts(stride, monkeypatch):
    dlm = idlm()
    params = [SamplingParams(max_new_tokens=k, ignore_eos=True) for k in (17, 9, 21, 13, 15)]
    ar = Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=5)).generate(PROMPTS, params)
    truth = {i: p + r.token_ids for i, (p, r) in enumerate(zip(PROMPTS, ar))}
    for fallback in ("predict", "all", "off"):
        got = both(dlm, lambda: OracleDrafts(truth, stride=stride, fallback=fallback), PROMPTS, params, 3, monkeypatch)
        assert [r.token_ids for r in got] == [r.token_ids for r in ar], fallback
        acc = [a for r in got for a in r.stats.acceptance]
        assert max(acc) > 0.5 and min(acc) < 1.0, (fallback, acc)  # accepted and rejected drafts


@pytest.mark.parametrize("stride", [2, 3])
def test_batched_sampling_equals_per_row_generator_for_generator(stride, monkeypatch):
    """Sampled rows (mixed settings in one batch: greedy, plain, top-k, top-p, argmax drafts) through every
    fallback mode: the batched draws are the per-row draws (acceptance tests, corrections, free tokens, drafts;
    the drafts' noise of a row whose outcome drafts nothing put back)."""
    dlm = tiny_idlm()
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.0),
        dict(temperature=0.7, top_k=3),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0),
    ]
    prompts = [[1, 2, 3, 0], [2, 1], [3, 3, 1], [0, 1, 2], [1, 1]]
    params = [SamplingParams(max_new_tokens=14 + 3 * i, seed=i, ignore_eos=True, **s) for i, s in enumerate(settings)]
    for fallback in ("predict", "all", "off"):
        for draft in ("sample", "argmax"):
            got = both(
                dlm,
                lambda: ISDDecoder(ISDConfig(stride=stride, fallback=fallback, draft=draft, draft_budget="always")),
                prompts,
                params,
                4,
                monkeypatch,
            )
            acc = [a for r in got for a in r.stats.acceptance]
            assert max(acc) > 0.3 and min(acc) < 0.95, (fallback, draft, acc)


def test_batched_path_with_ar_steps_and_a_single_row(monkeypatch):
    """A drafting budget that turns steps into plain AR steps as the batch grows (rows in AR, cold and verify steps
    in one batch), and one row alone."""
    dlm = tiny_idlm()
    params = [SamplingParams(max_new_tokens=12 + 2 * i, temperature=1.0, seed=7 + i, ignore_eos=True) for i in range(4)]
    prompts = [[1, 2, 3], [2, 1], [3, 0, 1], [1]]
    dec = lambda: ISDDecoder(ISDConfig(stride=3, draft_budget=10))  # noqa: E731 - two rows of 5 draft, more run AR
    both(dlm, dec, prompts, params, 3, monkeypatch)
    both(dlm, lambda: ISDDecoder(ISDConfig(stride=3)), prompts[:1], params[:1], 1, monkeypatch)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_batched_step_moves_one_small_tensor_to_the_host(temperature, monkeypatch):
    """consume_batch of a 4-row step converts exactly one tensor, [rows, 2 + 2 (N-1)], whatever the step's
    outcomes (the per-row path converts several per row: the counter sees them)."""
    dlm = tiny_idlm() if temperature else idlm()
    prompts = [[1, 2, 3, 0], [2, 1], [3, 3, 1], [0, 1, 2]] if temperature else PROMPTS[:4]
    n = 3
    seen = {}

    def wrap(dec):
        orig = dec.consume_batch

        def watched(engine, rows, logits, lengths):
            with HostReads() as mode:
                out = orig(engine, rows, logits, lengths)
            seen.setdefault(dec.batch_verify, []).append((len(rows), mode.seen))
            return out

        dec.consume_batch = watched
        return dec

    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=0, ignore_eos=True)
    for fused in (True, False):
        dec = ISDDecoder(ISDConfig(stride=n))
        dec.batch_verify = fused
        Engine(dlm, decoder=wrap(dec), options=EngineOptions(max_batch_size=4)).generate(prompts, params)
    for rows, conversions in seen[True]:
        assert conversions == [("tolist", (rows, 2 + 2 * (n - 1)))], conversions
    assert sum(len(c) for _, c in seen[False]) > 2 * len(seen[False])


def test_accept_rows_greedy_and_sampled_against_the_per_row_rules():
    """The batched rule on its own against accept.verify_greedy / verify_sampled and propose, on random logits:
    every outcome (0..N-1 drafts accepted) and its free token or correction."""
    from dlm.decode.isd import propose, verify_greedy, verify_sampled
    from dlm.decode.sampling import probs_from_logits, sample

    torch.manual_seed(0)
    n, v, g, m = 3, 7, 64, 6
    logits = torch.randn(g, 2 * n - 1, v) * 2
    greedy = SamplingParams()
    target = logits[:, :n].clone()
    target[..., m] = float("-inf")
    best = target.argmax(-1)
    # drafts right up to a random point, then wrong: every accepted count occurs
    cut = torch.randint(0, n, (g,))
    drafts = torch.where(torch.arange(n - 1)[None] < cut[:, None], best[:, : n - 1], (best[:, : n - 1] + 1) % m)
    nd = torch.full((g,), n - 1)
    windows = torch.tensor([[-1] * (n - 1) + [n]] * g)  # only the all-accepted outcome's masks (fallback 'off')
    out, _ = batch.accept_rows(logits, greedy, m, batch.VerifyGroup(n, nd, drafts, windows), conf=True)
    for j in range(g):
        a, c = verify_greedy(drafts[j].tolist(), best[j].tolist())
        assert out[j, 0] == a and out[j, 1] == (c if c is not None else best[j, n - 1])
        if a == n - 1:
            prop = propose(logits[j, n:], greedy, m, None, conf=True)
            assert out[j, 2 : n + 1].tolist() == prop.drafts and out[j, n + 1 :].tolist() == prop.conf
    assert set(out[:, 0].tolist()) == set(range(n))

    params = SamplingParams(temperature=1.0)
    q = probs_from_logits(torch.randn(g, n - 1, v), params, m)
    gens = [torch.Generator().manual_seed(s) for s in range(g)]
    ref_gens = [torch.Generator().manual_seed(s) for s in range(g)]
    drafts = torch.stack([sample(q[j], torch.Generator().manual_seed(100 + j)) for j in range(g)])
    rand, _ = batch.draws(gens, [True] * g, [False] * g, [False] * g, n, v, sample_drafts=True)
    out, _ = batch.accept_rows(logits, params, m, batch.VerifyGroup(n, nd, drafts, None, q, torch.arange(g), rand))
    p = probs_from_logits(logits[:, :n], params, m)
    outcomes = set()
    for j in range(g):
        a, c = verify_sampled(p[j], q[j], drafts[j].tolist(), ref_gens[j])
        tok = c if c is not None else int(sample(p[j, n - 1], ref_gens[j]))
        assert (out[j, 0], out[j, 1]) == (a, tok), j
        assert gens[j].get_state().equal(ref_gens[j].get_state())
        outcomes.add(a)
    assert outcomes == set(range(n)), outcomes
