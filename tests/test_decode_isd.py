"""Introspective Strided Decoding: greedy == AR greedy for any model, the sampled output distribution equals the
AR distribution (and argmax drafts are biased), and the model checks."""

import itertools
import math

import pytest
import torch

from dlm import convert_ar_to_dlm
from dlm.decode.engine import Engine
from dlm.decode.isd import ISDDecoder
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
    ar = [r.token_ids for r in Engine(dlm, decoder="ar", max_batch_size=4).generate(PROMPTS, params)]
    for stride in (2, 3, 4):
        one = Engine(dlm, decoder="isd", stride=stride).generate([PROMPTS[2]], params)[0]
        assert one.token_ids == ar[2], (arch, stride)
        batch = Engine(dlm, decoder="isd", stride=stride, max_batch_size=3).generate(PROMPTS, params)
        assert [r.token_ids for r in batch] == ar, (arch, stride)
        assert all(1.0 <= r.stats.tpf <= stride for r in batch)


class OracleDrafts(ISDDecoder):
    """Drafts = the true greedy continuation, corrupted at random: exercises full acceptance (free token + next
    drafts from a verify step), partial acceptance and rejection at every draft position."""

    def __init__(self, truth, prompt_len, corrupt, seed=0, **kw):
        super().__init__(**kw)
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
        row.state["drafts"] = drafts


@pytest.mark.parametrize("stride", [2, 3, 4])
def test_isd_verify_paths_with_oracle_drafts(stride):
    dlm = idlm("qwen2")
    k = 1 + 5 * stride  # cold start, then five verify steps
    truth = Engine(dlm, decoder="ar").generate([PROMPTS[0]], SamplingParams(k + 2 * stride, ignore_eos=True))[0]
    truth = truth.token_ids
    perfect = Engine(dlm, decoder=OracleDrafts(truth, 5, 0.0, stride=stride)).generate(
        [PROMPTS[0]], SamplingParams(k, ignore_eos=True))[0]
    assert perfect.token_ids == truth[:k]
    assert perfect.stats.forwards == 6 and perfect.stats.acceptance == [1.0] * (stride - 1)  # TPF = k/6
    noisy = Engine(dlm, decoder=OracleDrafts(truth, 5, 0.3, stride=stride)).generate(
        [PROMPTS[0]], SamplingParams(k, ignore_eos=True))[0]
    assert noisy.token_ids == truth[:k]
    assert 1.0 < noisy.stats.tpf < perfect.stats.tpf


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


def empirical(dlm, prompt, k, n, **engine_kw):
    m = dlm.mask_token_id
    params = [SamplingParams(max_new_tokens=k, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    res = Engine(dlm, max_batch_size=n, **engine_kw).generate([prompt] * n, params)
    counts = torch.zeros(m ** k)
    for r in res:
        counts[sum(t * m ** (k - 1 - j) for j, t in enumerate(r.token_ids))] += 1
    acc = [sum(r.stats.accepted[i] for r in res) / max(1, sum(r.stats.proposed[i] for r in res))
           for i in range(len(res[0].stats.proposed))]
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
    for name, kw in [("ar", dict(decoder="ar")), ("isd2", dict(decoder="isd", stride=2)),
                     ("isd3", dict(decoder="isd", stride=3)),
                     ("isd2-argmax", dict(decoder="isd", stride=2, draft="argmax"))]:
        dist, acc = empirical(dlm, prompt, k, n, **kw)
        tv[name] = 0.5 * float((dist - exact).abs().sum())
        if name.startswith("isd"):
            assert 0.05 < acc[0] < 0.999, (name, acc)  # both accept and reject paths were exercised
    assert tv["ar"] < eps and tv["isd2"] < eps and tv["isd3"] < eps, (tv, eps)
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
    prompts = [tok(t)["input_ids"] for t in ["The capital of France is", "Once upon a time, in a small village",
                                             "def fibonacci(n):"]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = [r.token_ids for r in Engine(dlm, decoder="ar", max_batch_size=3).generate(prompts, params)]
    for stride in (2, 3, 4):
        assert Engine(dlm, decoder="isd", stride=stride).generate([prompts[0]], params)[0].token_ids == ar[0]
        batch = Engine(dlm, decoder="isd", stride=stride, max_batch_size=3).generate(prompts, params)
        assert [r.token_ids for r in batch] == ar
