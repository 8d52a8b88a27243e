"""Introspective Strided Decoding: greedy == AR greedy for any model, the sampled output distribution equals the
AR distribution (and argmax drafts are biased), and the model checks."""

import itertools
import math

import pytest
import torch

from dlm import convert_ar_to_dlm
from dlm.decode.configs import ISDConfig
from dlm.decode.engine import Engine
from dlm.decode.isd import ISDDecoder
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams
from dlm.errors import DLMError
from dlm.model.convert import DiffusionLM, DLMSpec
from dlm.testing import make_model, make_tokenizer

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]


pytestmark = pytest.mark.usefixtures("one_thread")


def idlm(arch, seed=1, block_size=3):
    return convert_ar_to_dlm(make_model(arch, seed=seed), "idlm", block_size=block_size, tokenizer=make_tokenizer())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gpt2"])
def test_isd_greedy_equals_ar_greedy(arch):
    dlm = idlm(arch)
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    ar = [
        r.token_ids
        for r in Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=4)).generate(PROMPTS, params)
    ]
    for stride, fallback in itertools.product((2, 3, 4), ("predict", "all", "off")):
        one = Engine(dlm, decoder="isd", stride=stride, fallback=fallback).generate([PROMPTS[2]], params)[0]
        assert one.token_ids == ar[2], (arch, stride, fallback)
        batch = Engine(
            dlm, decoder="isd", stride=stride, fallback=fallback, options=EngineOptions(max_batch_size=3)
        ).generate(PROMPTS, params)
        assert [r.token_ids for r in batch] == ar, (arch, stride, fallback)
        assert all(1.0 <= r.stats.tpf <= stride for r in batch)


class OracleDrafts(ISDDecoder):
    """Drafts = the true greedy continuation, corrupted at random: exercises full acceptance (free token + next
    drafts from a verify step), partial acceptance and rejection at every draft position."""

    def __init__(self, truth, prompt_len, corrupt, seed=0, **kw):
        super().__init__(ISDConfig(**kw))
        self.truth, self.prompt_len, self.corrupt = truth, prompt_len, corrupt
        self.rng = torch.Generator().manual_seed(seed)

    def _draft(self, engine, row, mask_logits, first_pos):
        super()._draft(engine, row, mask_logits, first_pos)
        drafts = []
        for j in range(self.stride - 1):
            g = first_pos + j - self.prompt_len
            true = self.truth[g] if g < len(self.truth) else 0
            bad = float(torch.rand(1, generator=self.rng)) < self.corrupt
            drafts.append((true + 1) % 300 if bad else true)
        row.state.drafts = drafts


@pytest.mark.parametrize("stride", [2, 3, 4])
def test_isd_verify_paths_with_oracle_drafts(stride):
    dlm = idlm("qwen2")
    k = 1 + 5 * stride  # cold start, then five verify steps
    truth = Engine(dlm, decoder="ar").generate([PROMPTS[0]], SamplingParams(k + 2 * stride, ignore_eos=True))[0]
    truth = truth.token_ids
    # ("predict" would route on the untrained model's own draft probabilities, not on the oracle's)
    perfect = Engine(dlm, decoder=OracleDrafts(truth, 5, 0.0, stride=stride, fallback="off")).generate(
        [PROMPTS[0]], SamplingParams(k, ignore_eos=True)
    )[0]
    assert perfect.token_ids == truth[:k]
    assert perfect.stats.forwards == 6 and perfect.stats.acceptance == [1.0] * (stride - 1)  # TPF = k/6
    for fallback in ("predict", "all", "off"):
        noisy = Engine(dlm, decoder=OracleDrafts(truth, 5, 0.3, stride=stride, fallback=fallback)).generate(
            [PROMPTS[0]], SamplingParams(k, ignore_eos=True)
        )[0]
        assert noisy.token_ids == truth[:k]
        assert 1.0 < noisy.stats.tpf < perfect.stats.tpf


class CountFallbacks(ISDDecoder):
    """Counts verify steps whose rejection was followed by drafts from that branch's masks."""

    def __init__(self, **kw):
        super().__init__(ISDConfig(**kw))
        self.fallbacks = 0

    def _next_drafts(self, engine, row, logits, outcome):
        super()._next_drafts(engine, row, logits, outcome)
        self.fallbacks += outcome > 0 and row.state.mode == "verify"


@pytest.mark.parametrize("stride", [2, 3])
def test_isd_fallback_drafts_skip_the_cold_start(stride):
    """With every branch's masks in the chunk (``all``) the drafts after a rejection are verified at once: every
    forward after the prefill verifies drafts; without them (``off``, plain ISD (docs/algorithms.md#isd)) rejections cost a cold
    start."""
    dlm = idlm("llama")
    k = 24
    truth = Engine(dlm, decoder="ar").generate([PROMPTS[0]], SamplingParams(k + 2 * stride, ignore_eos=True))[0]
    truth = truth.token_ids
    runs = {}
    for fallback in ("all", "off"):
        dec = OracleDrafts(truth, 5, 0.4, seed=3, stride=stride, fallback=fallback)
        r = Engine(dlm, decoder=dec).generate([PROMPTS[0]], SamplingParams(k, ignore_eos=True))[0]
        assert r.token_ids == truth[:k]
        runs[fallback] = r
    on, off = runs["all"].stats, runs["off"].stats
    # with fallback drafts every forward after the prefill verifies drafts (one row of proposals each)
    assert on.forwards == 1 + on.proposed[0]
    assert off.forwards > 1 + off.proposed[0]  # cold starts: forwards without drafts to verify
    assert on.tpf > off.tpf


def test_branch_layout_n3():
    from dlm.decode.isd import branch_layout

    offsets, attn = branch_layout(3, (0, 1, 2))
    #          c  d1 d2 M  M  F1 F1 F2 F2
    assert offsets == [0, 1, 2, 3, 4, 1, 2, 2, 3]
    assert attn[5].tolist() == [1, 0, 0, 0, 0, 1, 0, 0, 0]  # rejection at d1: sees c only
    assert attn[6].tolist() == [1, 0, 0, 0, 0, 1, 1, 0, 0]
    assert attn[7].tolist() == [1, 1, 0, 0, 0, 0, 0, 1, 0]  # rejection at d2: sees c, d1
    assert attn[8].tolist() == [1, 1, 0, 0, 0, 0, 0, 1, 1]
    assert attn[:5, :5].equal(torch.ones(5, 5, dtype=torch.bool).tril())
    assert not attn[:5, 5:].any()  # nothing on the main chunk sees a fallback mask


def tree_logits(dlm, prefix, chunk, offsets, attn):
    """Logits of a tree-shaped chunk after a causal prefix in one plain forward: the chunk's tokens at
    ``len(prefix) + offsets``, seeing the whole prefix and each other as ``attn`` says."""
    L, n = len(prefix), len(chunk)
    ids = torch.tensor([prefix + chunk])
    pos = torch.tensor([list(range(L)) + [L + o for o in offsets]])
    mask = torch.zeros(1, 1, L + n, L + n, dtype=torch.bool)
    mask[0, 0, :, :L] = torch.ones(L + n, L, dtype=torch.bool).tril()[:, :L] | (torch.arange(L + n) >= L)[:, None]
    mask[0, 0, L:, L:] = attn
    with torch.no_grad():
        return dlm(input_ids=ids, position_ids=pos, attention_mask=mask).logits[0, L:]


def test_fallback_drafts_equal_a_cold_start_from_the_correction_minus_its_token():
    """A fallback mask sees what the cold start's masks would see except the correction itself: its logits equal
    those of a mask fed at the same position after [c, d_1..d_{i-1}] in a plain sequence."""
    dlm = idlm("llama", block_size=2)
    from dlm.decode.isd import branch_layout

    n = 3
    m = dlm.mask_token_id
    prefix = PROMPTS[2]
    c, d1, d2 = 40, 41, 42
    chunk = [c, d1, d2, m, m] + [m] * 4
    offsets, attn = branch_layout(n, (0, 1, 2))
    L = len(prefix)
    tree = tree_logits(dlm, prefix, chunk, offsets, attn)
    with torch.no_grad():
        # rejection at d2: the branch at offsets 2, 3 after [c, d1] == plain [prefix, c, d1, M, M]
        plain = dlm(input_ids=torch.tensor([prefix + [c, d1, m, m]])).logits[0, L:]
    torch.testing.assert_close(tree[7:9], plain[2:4])
    with torch.no_grad():
        plain1 = dlm(input_ids=torch.tensor([prefix + [c, m, m]])).logits[0, L:]
    torch.testing.assert_close(tree[5:7], plain1[1:3])
    torch.testing.assert_close(tree[:5], dlm(input_ids=torch.tensor([prefix + chunk[:5]])).logits[0, L:])


def tiny_idlm(vocab=9, scale=6.0):
    """A tiny I-DLM with vocabulary 0..vocab-2 plus the mask (vocab-1), logits scaled up so that the next-token
    distributions are far from uniform and depend on the context."""
    model = make_model("llama", seed=0, vocab_size=vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return DiffusionLM(model, None, DLMSpec("idlm", vocab - 1, True, 2))


def exact_ar_distribution(dlm, prompt, k):
    """The model's exact distribution over all k-token continuations (mask token excluded), by enumeration."""
    m = dlm.mask_token_id
    conts = list(itertools.product(range(m), repeat=k))
    seqs = torch.tensor([prompt + list(c) for c in conts])
    with torch.no_grad():
        logits = dlm(input_ids=seqs).logits.float()
    logits[..., m] = float("-inf")
    logp = logits.log_softmax(-1)
    total = torch.zeros(len(conts))
    for j in range(k):
        total += logp[torch.arange(len(conts)), len(prompt) - 1 + j, seqs[:, len(prompt) + j]]
    return conts, total.exp()


def empirical(dlm, prompt, k, n, batch=None, **engine_kw):
    m = dlm.mask_token_id
    params = [SamplingParams(max_new_tokens=k, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    res = Engine(dlm, options=EngineOptions(max_batch_size=batch or n), **engine_kw).generate([prompt] * n, params)
    counts = torch.zeros(m**k)
    for r in res:
        counts[sum(t * m ** (k - 1 - j) for j, t in enumerate(r.token_ids))] += 1
    positions = max(len(r.stats.proposed) for r in res)
    proposed = [sum(r.stats.proposed[i] for r in res if i < len(r.stats.proposed)) for i in range(positions)]
    accepted = [sum(r.stats.accepted[i] for r in res if i < len(r.stats.accepted)) for i in range(positions)]
    acc = [a / max(1, p) for a, p in zip(accepted, proposed)]
    return counts / n, acc


def test_isd_sampling_has_the_ar_distribution_and_argmax_drafts_are_biased():
    dlm = tiny_idlm()
    prompt, k, n = [1, 2, 3, 4], 2, 2000
    conts, exact = exact_ar_distribution(dlm, prompt, k)
    assert float(exact.max()) < 0.5  # a spread-out target, so bias would show
    # Bretagnolle-Huber-Carol: P(TV(empirical, exact) > eps) <= 2^K exp(-2 n eps^2); K = 64 outcomes, delta 1e-4
    K = len(conts)
    eps = math.sqrt((K * math.log(2) + math.log(1e4)) / (2 * n))  # = 0.116 for n = 2000
    tv = {}
    for name, kw in [
        ("ar", dict(decoder="ar")),
        ("isd2", dict(decoder="isd", stride=2)),
        ("isd3", dict(decoder="isd", stride=3)),
        ("isd2-cold", dict(decoder="isd", stride=2, fallback="off")),
        ("isd2-argmax", dict(decoder="isd", stride=2, draft="argmax")),
    ]:
        dist, acc = empirical(dlm, prompt, k, n, **kw)
        tv[name] = 0.5 * float((dist - exact).abs().sum())
        if name.startswith("isd"):
            assert 0.05 < acc[0] < 0.999, (name, acc)  # both accept and reject paths were exercised
    assert tv["ar"] < eps and tv["isd2"] < eps and tv["isd3"] < eps and tv["isd2-cold"] < eps, (tv, eps)
    assert tv["isd2-argmax"] > 2 * eps, (tv, eps)  # measurably biased towards the argmax draft


def test_isd_refuses_models_it_cannot_run_and_warns_on_untrained_strides():
    tok = make_tokenizer()
    mdm = convert_ar_to_dlm(make_model("llama"), "mdm", tokenizer=tok)
    with pytest.raises(DLMError, match="use --decode mdm"):
        Engine(mdm, decoder="isd")
    with pytest.raises(DLMError, match="needs an I-DLM"):
        Engine(make_model("llama"), make_tokenizer(), decoder="isd")
    with pytest.raises(DLMError, match="stride"):
        Engine(idlm("llama"), decoder="isd", stride=1)
    with pytest.warns(UserWarning, match="strides 2, 3"):
        eng = Engine(idlm("llama", block_size=2), decoder="isd", stride=4)
    assert eng.decoder.stride == 4
    assert Engine(idlm("llama", block_size=2), decoder="isd").decoder.stride == 3  # default block_size + 1


@pytest.mark.slow
def test_isd_greedy_equals_ar_on_smollm2(smollm2_path):
    from dlm.model.convert import load_any

    dlm = load_any(smollm2_path, "idlm", block_size=3)
    tok = dlm.tokenizer
    prompts = [
        tok(t)["input_ids"]
        for t in ["The capital of France is", "Once upon a time, in a small village", "def fibonacci(n):"]
    ]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = [
        r.token_ids
        for r in Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=3)).generate(prompts, params)
    ]
    for stride in (2, 3, 4):
        assert Engine(dlm, decoder="isd", stride=stride).generate([prompts[0]], params)[0].token_ids == ar[0]
        batch = Engine(dlm, decoder="isd", stride=stride, options=EngineOptions(max_batch_size=3)).generate(
            prompts, params
        )
        assert [r.token_ids for r in batch] == ar
    for min_prob in (0.0, 0.05):  # every candidate verified / only those the mask gives >= 5% (the default)
        batch = Engine(
            dlm, decoder="isd", candidates=3, candidate_min_prob=min_prob, options=EngineOptions(max_batch_size=3)
        ).generate(prompts, params)
        assert [r.token_ids for r in batch] == ar
    # with penalties (each verify row's history holds the drafts before it): still AR's output, and a different one
    adjusted = SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5)
    ar_adj = [
        r.token_ids
        for r in Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=3)).generate(prompts, adjusted)
    ]
    assert ar_adj != ar
    for stride in (2, 3):
        batch = Engine(dlm, decoder="isd", stride=stride, options=EngineOptions(max_batch_size=3)).generate(
            prompts, adjusted
        )
        assert [r.token_ids for r in batch] == ar_adj


def test_isd_sampling_through_fallback_drafts_has_the_ar_distribution():
    """Three sampled tokens at stride 2: a rejection in the first verify step is followed by a verify of the
    fallback masks' drafts (sampled from their own q), which must keep the AR distribution too."""
    dlm = tiny_idlm(vocab=5)
    prompt, k, n = [1, 2, 3, 0], 3, 2000
    conts, exact = exact_ar_distribution(dlm, prompt, k)
    assert float(exact.max()) < 0.5
    K = len(conts)  # 64
    eps = math.sqrt((K * math.log(2) + math.log(1e4)) / (2 * n))
    for fallback in ("all", "predict"):
        counter = CountFallbacks(stride=2, fallback=fallback)
        dist, acc = empirical(dlm, prompt, k, n, decoder=counter)
        assert counter.fallbacks > 100 and 0.05 < acc[0] < 0.999, (fallback, counter.fallbacks, acc)
        tv = 0.5 * float((dist - exact).abs().sum())
        assert tv < eps, (fallback, tv, eps)


def test_isd_sampling_with_the_stride_changing_between_steps_has_the_ar_distribution():
    """A policy that chooses the stride step by step (here at random, AR steps included; prefills append masks for
    a stride the next step may not run): drafts made at one stride are dropped at another, and the three sampled
    tokens keep the AR distribution."""
    from test_decode_schedule import RandomStrides

    dlm = tiny_idlm(vocab=5)  # trained for strides 2 and 3
    prompt, k, n = [1, 2, 3, 0], 3, 2000
    conts, exact = exact_ar_distribution(dlm, prompt, k)
    eps = math.sqrt((len(conts) * math.log(2) + math.log(1e4)) / (2 * n))
    policy = RandomStrides([0, 2, 3], seed=1)
    # 16 rows at a time: requests join and leave between steps, so every row meets strides of its own
    dist, acc = empirical(dlm, prompt, k, n, decoder="isd", draft_budget=policy, batch=16)
    assert set(policy.seen) == {0, 2, 3} and 0.05 < acc[0] < 0.999, (set(policy.seen), acc)
    tv = 0.5 * float((dist - exact).abs().sum())
    assert tv < eps, (tv, eps)


def test_predict_picks_the_likeliest_outcome_and_its_chunk_has_the_plain_length():
    """``predict`` carries one branch of masks, the likeliest outcome by the drafts' own probabilities, so a
    verify chunk stays 2N-1 tokens; ``all`` carries every branch; ``off`` only the all-accepted one."""
    from dlm.decode.isd import ISDRowState, branch_layout

    dec = ISDDecoder(ISDConfig(stride=3))
    row = ISDRowState()
    for conf, want in [
        ([0.9, 0.9], (0,)),  # P(0) .81
        ([0.3, 0.9], (1,)),  # P(1) .7
        ([0.9, 0.3], (2,)),  # P(2) .63
        ([0.6, 0.6], (0,)),  # .36 .4 .24: P(1) .4 > P(0) .36 -> 1
    ]:
        row.conf = conf
        got = dec._branches(row)
        if conf == [0.6, 0.6]:
            want = (1,)
        assert got == want, (conf, got)
    assert ISDDecoder(ISDConfig(stride=3, fallback="off"))._branches(row) == (0,)
    assert ISDDecoder(ISDConfig(stride=3, fallback="all"))._branches(row) == (0, 1, 2)
    assert (
        ISDDecoder(ISDConfig(stride=3)).verify_len == 5
        and ISDDecoder(ISDConfig(stride=3, fallback="all")).verify_len == 9
    )
    offsets, attn = branch_layout(2, (1,))
    assert offsets == [0, 1, 1] and attn.tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    with pytest.raises(DLMError, match="--isd-fallback"):
        ISDDecoder(ISDConfig(fallback="sometimes"))


def test_accept_calibration_learns_that_unconfident_drafts_are_right():
    """A draft's own probability need not predict its acceptance; ``predict`` corrects it from the verify steps
    (a drafter right every time at probability 0.2 first looks like a rejection, then like an acceptance)."""
    from dlm.decode.isd import AcceptCalibration, ISDRowState

    cal = AcceptCalibration()
    assert cal.p_accept(0, 0.2) == pytest.approx(0.2)  # the prior: the draft's own probability
    for _ in range(3):
        cal.observe(0, 0.21, True)
    assert cal.p_accept(0, 0.25) == pytest.approx((3 + 2 * 0.25) / 5) and cal.p_accept(0, 0.95) == pytest.approx(
        0.95
    )  # other bins untouched
    for _ in range(1000):
        cal.observe(1, 0.9, False)
    assert cal.p_accept(1, 0.9) < 0.01 and cal.counts[(1, 9)][1] <= cal.cap  # capped: it can turn again

    dec = ISDDecoder(ISDConfig(stride=2))
    row = ISDRowState(conf=[0.2])
    assert dec._branches(row) == (1,)
    dec._calib = cal
    assert dec._branches(row) == (0,)


# -- draft candidates (--isd-candidates) -----------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_isd_candidates_greedy_equals_ar_greedy(arch):
    dlm = idlm(arch)
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    ar = [
        r.token_ids
        for r in Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=4)).generate(PROMPTS, params)
    ]
    # a random tiny model's mask spreads its mass thinly: candidate_min_prob=0 makes every step verify all K
    for k, fallback in itertools.product((2, 3), ("predict", "off")):
        one = Engine(dlm, decoder="isd", candidates=k, fallback=fallback, candidate_min_prob=0.0).generate(
            [PROMPTS[2]], params
        )[0]
        assert one.token_ids == ar[2], (arch, k, fallback)
        batch = Engine(
            dlm,
            decoder="isd",
            candidates=k,
            fallback=fallback,
            candidate_min_prob=0.0,
            options=EngineOptions(max_batch_size=3),
        ).generate(PROMPTS, params)
        assert [r.token_ids for r in batch] == ar, (arch, k, fallback)
        assert all(1.0 <= r.stats.tpf <= 2 for r in batch)


class OracleCandidates(ISDDecoder):
    """Candidates = wrong tokens with the true next-next token at a random slot (or missing, with probability
    ``miss``): every candidate slot gets accepted sometimes, so the kept KV is non-contiguous in the chunk."""

    def __init__(self, truth, prompt_len, miss, seed=0, **kw):
        super().__init__(ISDConfig(**kw))
        self.truth, self.prompt_len, self.miss = truth, prompt_len, miss
        self.rng = torch.Generator().manual_seed(seed)
        self.slots = []

    def _draft(self, engine, row, mask_logits, first_pos):
        super()._draft(engine, row, mask_logits, first_pos)
        g = first_pos - self.prompt_len
        true = self.truth[g] if g < len(self.truth) else 0
        k = self.candidates
        cands = [(true + 1 + j) % 300 for j in range(k)]
        if float(torch.rand(1, generator=self.rng)) >= self.miss:
            slot = int(torch.randint(k, (1,), generator=self.rng))
            cands[slot] = true
            self.slots.append(slot)
        row.state.cands = cands


@pytest.mark.parametrize("k", [2, 3])
def test_isd_candidates_accept_any_slot_and_keep_its_kv(k):
    dlm = idlm("qwen2")
    n = 21
    truth = Engine(dlm, decoder="ar").generate([PROMPTS[0]], SamplingParams(n + 4, ignore_eos=True))[0].token_ids
    dec = OracleCandidates(truth, 5, 0.0, candidates=k)
    perfect = Engine(dlm, decoder=dec).generate([PROMPTS[0]], SamplingParams(n, ignore_eos=True))[0]
    assert perfect.token_ids == truth[:n]
    assert set(dec.slots) == set(range(k))  # every slot was the accepted one at least once
    # prefill (1 token + the first candidates), then 2 tokens per forward
    assert perfect.stats.acceptance == [1.0] and perfect.stats.forwards == 1 + (n - 1) // 2
    for fallback in ("predict", "off"):
        dec = OracleCandidates(truth, 5, 0.4, seed=1, candidates=k, fallback=fallback)
        noisy = Engine(dlm, decoder=dec).generate([PROMPTS[0]], SamplingParams(n, ignore_eos=True))[0]
        assert noisy.token_ids == truth[:n], fallback
        assert 0.3 < noisy.stats.acceptance[0] < 0.9 and 1.0 < noisy.stats.tpf < perfect.stats.tpf


def test_candidate_layout_and_its_logits_equal_plain_forwards():
    """Each candidate sees c only, its mask sees c and that candidate, F sees c: the tree chunk's logits equal
    plain causal forwards of those sequences."""
    from dlm.decode.isd import candidate_layout

    offsets, attn = candidate_layout(2, True)
    #                c  d1 d2 M1 M2 F
    assert offsets == [0, 1, 1, 2, 2, 1]
    assert attn.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 0, 0, 0, 0, 1],
    ]
    assert candidate_layout(3, False)[0] == [0, 1, 1, 1, 2, 2, 2]
    dlm = idlm("llama", block_size=1)
    m = dlm.mask_token_id
    prefix, c, d1, d2 = PROMPTS[2], 40, 41, 42
    chunk = [c, d1, d2, m, m, m]
    L = len(prefix)
    tree = tree_logits(dlm, prefix, chunk, offsets, attn)
    with torch.no_grad():
        one = dlm(input_ids=torch.tensor([prefix + [c, d1, m]])).logits[0, L:]
        two = dlm(input_ids=torch.tensor([prefix + [c, d2, m]])).logits[0, L:]
        cold = dlm(input_ids=torch.tensor([prefix + [c, m]])).logits[0, L:]
    torch.testing.assert_close(tree[[0, 1, 3]], one)
    torch.testing.assert_close(tree[[0, 2, 4]], two)
    torch.testing.assert_close(tree[[0, 5]], cold)


def test_isd_sampling_with_candidates_has_the_ar_distribution():
    """Recursive rejection sampling over K draws without replacement keeps the AR distribution (three tokens: the
    accepted candidate's mask, the rejection mask and the free token all feed later steps) and accepts more
    often than one draft."""
    dlm = tiny_idlm(vocab=5)
    prompt, k, n = [1, 2, 3, 0], 3, 2000
    conts, exact = exact_ar_distribution(dlm, prompt, k)
    assert float(exact.max()) < 0.5
    eps = math.sqrt((len(conts) * math.log(2) + math.log(1e4)) / (2 * n))
    acc = {}
    for cands, fallback in [(1, "predict"), (2, "predict"), (3, "off")]:
        dist, a = empirical(dlm, prompt, k, n, decoder="isd", stride=2, candidates=cands, fallback=fallback)
        tv = 0.5 * float((dist - exact).abs().sum())
        assert tv < eps, (cands, fallback, tv, eps)
        acc[cands] = a[0]
    assert 0.05 < acc[1] < acc[2] - 0.05 and acc[2] < acc[3] < 0.999, acc


def test_isd_candidates_settings_and_errors():
    assert (
        ISDDecoder(ISDConfig(candidates=3)).verify_len == 8
        and ISDDecoder(ISDConfig(candidates=3, fallback="off")).verify_len == 7
    )
    assert Engine(idlm("llama", block_size=3), decoder="isd", candidates=2).decoder.stride == 2  # not block + 1
    for bad in (0, 9, "2", 2.0, True):
        with pytest.raises(DLMError, match="--isd-candidates must be an integer from 1 to 8"):
            ISDDecoder(ISDConfig(candidates=bad))
    with pytest.raises(DLMError, match="--stride 2 only, got --stride 3"):
        ISDDecoder(ISDConfig(stride=3, candidates=2))
    # more candidates than the vocabulary has tokens: every token is a candidate (never the mask), all accepted
    small = tiny_idlm(vocab=5)
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    ar = Engine(small, decoder="ar").generate([[1, 2, 3]], params)[0].token_ids
    for sampled in (False, True):
        p = SamplingParams(max_new_tokens=9, ignore_eos=True, temperature=1.0 if sampled else 0.0, seed=0)
        r = Engine(small, decoder="isd", candidates=8).generate([[1, 2, 3]], p)[0]
        assert r.stats.acceptance == [1.0] and small.mask_token_id not in r.token_ids
        if not sampled:
            assert r.token_ids == ar
    # top-k 2 leaves q two tokens with mass: at most two candidates are drawn, the chunk shrinks to match
    dec = ISDDecoder(ISDConfig(candidates=3))
    r = Engine(idlm("llama"), decoder=dec, options=EngineOptions(max_batch_size=2)).generate(
        [[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=12, temperature=1.0, top_k=2, seed=1, ignore_eos=True)
    )
    assert [len(x.token_ids) for x in r] == [12, 12] and set(dec._trees.layouts) == {(2, ("cands", 2, True))}


def test_recursive_rejection_over_draws_without_replacement_gives_p_exactly():
    """The candidates' sampling rule on its own: 10000 tokens from fixed p, q (candidates drawn from q without
    replacement) have distribution p; verifying the same draws as if they were independent (q not renormalised
    without the earlier candidates: SpecInfer's rule for i.i.d. drafts) is measurably biased, so this test would
    catch that mistake (the model-level test above is too small to)."""
    from dlm.decode.isd import draws_without_replacement, recursive_rejection
    from dlm.decode.sampling import sample

    def iid_rule(p, q, cands, g):
        r, u = p, torch.rand(len(cands), generator=g)
        for j, d in enumerate(cands):
            if float(u[j]) * float(q[d]) < float(r[d]):
                return j, d
            r = (r - q).clamp_(min=0.0)
            r = r / r.sum()
        return None, int(sample(r, g))

    p, q = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 10000
    eps = math.sqrt((4 * math.log(2) + math.log(1e4)) / (2 * n))  # 0.0245: P(TV > eps) <= 1e-4
    g = torch.Generator().manual_seed(0)

    def tv(rule, k):
        counts, hits = torch.zeros(4), 0
        for _ in range(n):
            cands = draws_without_replacement(q, int(sample(q, g)), k, g)
            assert len(set(cands)) == k
            hit, token = rule(p, q, cands, g)
            counts[token] += 1
            hits += hit is not None
        return 0.5 * float((counts / n - p).abs().sum()), hits / n

    (tv2, acc2), (tv3, acc3) = tv(recursive_rejection, 2), tv(recursive_rejection, 3)
    assert tv2 < eps and tv3 < eps, (tv2, tv3, eps)
    assert 0.6 < acc2 < acc3 < 0.9, (acc2, acc3)  # measured: 0.69, 0.78
    assert tv(iid_rule, 3)[0] > 4 * eps


def test_isd_candidates_beyond_the_first_only_where_the_mask_gives_them_mass():
    """--isd-candidates K verifies the 2nd..K-th likeliest drafts only where the mask gives them at least
    candidate_min_prob (default 0.05): a confident mask costs a 4-token chunk, an unsure one the full tree; the
    output stays AR's, greedy and sampled (the count comes from q alone, before any draw)."""
    probs = torch.tensor([0.7, 0.2, 0.03])
    assert ISDDecoder(ISDConfig(candidates=3))._candidate_count(probs) == 2
    assert ISDDecoder(ISDConfig(candidates=3, candidate_min_prob=0.0))._candidate_count(probs) == 3
    assert ISDDecoder(ISDConfig(candidates=3))._candidate_count(torch.tensor([0.97, 0.02, 0.01])) == 1
    for bad in (-0.1, 1.5, "0.1", True):
        with pytest.raises(DLMError, match="--isd-candidate-min-prob must be a probability"):
            ISDDecoder(ISDConfig(candidates=2, candidate_min_prob=bad))
    small = tiny_idlm(vocab=5)  # its mask spreads over 4 tokens: some steps above 0.25 for a 2nd/3rd, some not
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ar = Engine(small, decoder="ar").generate([[1, 2, 3], [3, 1]], params)
    dec = ISDDecoder(ISDConfig(candidates=3, candidate_min_prob=0.25))
    got = Engine(small, decoder=dec, options=EngineOptions(max_batch_size=2)).generate([[1, 2, 3], [3, 1]], params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    assert len({key[1][1] for key in dec._trees.layouts}) >= 2, dec._trees.layouts  # chunks of more than one size ran


@pytest.mark.slow
def test_prefix_cache_changes_no_token_on_smollm2(smollm2_path):
    """Chat prompts under SmolLM2's template (its system prompt shared), a next turn repeating an answer: greedy
    ar and isd with the prefix cache give the tokens of full prefills."""
    from dlm.model.convert import load_any

    dlm = load_any(smollm2_path, "idlm", block_size=2)
    tok = dlm.tokenizer

    def chat(*turns):
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    first = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?"]
    for decoder in ("ar", "isd"):
        eng = Engine(dlm, decoder=decoder, options=EngineOptions(max_batch_size=3, prefix_cache=4096))
        ids = [tok(chat(q), add_special_tokens=False)["input_ids"] for q in first]
        got = eng.generate(ids, params)
        answer = tok.decode(got[0].token_ids, skip_special_tokens=True)
        follow = tok(chat(first[0], answer, "And of Italy?"), add_special_tokens=False)["input_ids"]
        again = eng.generate([follow], params)[0]
        assert eng.prefix.hits >= 3 and again.stats.cached_tokens > len(ids[0])
        plain = Engine(dlm, decoder=decoder, options=EngineOptions(max_batch_size=3))
        assert [r.token_ids for r in got] == [r.token_ids for r in plain.generate(ids, params)]
        assert again.token_ids == plain.generate([follow], params)[0].token_ids
