import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dlm.errors import DLMError
from dlm.model import masks
from dlm.model.convert import convert_ar_to_dlm
from dlm.model.lora import prepare_model_for_lora
from dlm.objectives import OBJECTIVE_NAMES, get_objective, schedules
from dlm.objectives.block import block_run_ids
from dlm.testing import make_model, make_tokenizer

V, M = 50, 49


class FakeDLM(torch.nn.Module):
    """A stand-in DLM whose logits we control; records what the objective fed it."""

    def __init__(self, objective="mdm", shift=True, block_size=None, logits_fn=None, max_pos=64, attn="sdpa"):
        super().__init__()
        self.objective, self.shift, self.block_size, self.mask_token_id = objective, shift, block_size, M
        self.hf_config = SimpleNamespace(_attn_implementation=attn)
        self.max_positions = max_pos
        self.base_model_hf = self
        self.bias = torch.nn.Parameter(torch.zeros(V))
        g = torch.Generator().manual_seed(123)
        self.table = torch.randn(2 * max_pos, V, generator=g)
        self.logits_fn = logits_fn
        self.calls = []

    @property
    def device(self):
        return torch.device("cpu")

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kw):  # noqa: ARG002
        self.calls.append(dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids))
        B, T = input_ids.shape
        base = self.logits_fn(input_ids) if self.logits_fn else self.table[:T].expand(B, T, V)
        return SimpleNamespace(logits=base + self.bias)


def one_hot_logits(targets_fn):
    """Logits = 30 * one_hot(targets_fn(input_ids)): CE ~ 0 at the right target, ~30 at any other."""

    def fn(input_ids):
        return 30.0 * F.one_hot(targets_fn(input_ids), V).float()

    return fn


def test_registry_and_config_errors():
    assert OBJECTIVE_NAMES == ("mdm", "block", "idlm", "renoise")
    with pytest.raises(DLMError, match="valid objectives are mdm, block, idlm, renoise"):
        get_objective("mdlm")
    with pytest.raises(DLMError, match="unknown setting.*'alpha'.*ce_alpha"):
        get_objective("idlm", alpha=0.3)
    with pytest.raises(DLMError, match="idlm_loss_type"):
        get_objective("idlm", idlm_loss_type="kl")
    with pytest.raises(DLMError, match="normalize"):
        get_objective("mdm", normalize="tokens")


def test_schedules():
    g = torch.Generator().manual_seed(0)
    t = schedules.sample_t(10000, eps=1e-3, generator=g)
    assert t.min() >= 1e-3 and t.max() <= 1.0
    # mean of U(eps, 1) = (1 + eps) / 2; sd of the mean = 0.289 / sqrt(1e4) = 0.0029; 5 sd = 0.015
    assert abs(t.mean().item() - 0.5005) < 0.015
    ta = schedules.sample_t(8, eps=0.0, antithetic=True, generator=g)
    strata = (ta * 8).floor().long().sort().values
    assert strata.tolist() == list(range(8))  # one draw per 1/8 stratum
    assert schedules.anneal_p(0, 10) == 0.1 and schedules.anneal_p(9, 10) == 1.0
    assert schedules.anneal_p(50, 10) == 1.0 and schedules.anneal_p(0, 0) == 1.0
    ids = torch.zeros(100, 100, dtype=torch.long)
    maskable = torch.ones_like(ids, dtype=torch.bool)
    maskable[:, :10] = False
    x_t, masked = schedules.mask_tokens(ids, maskable, torch.tensor(0.3), M, g)
    assert not masked[:, :10].any() and torch.equal(x_t == M, masked)
    # 9000 Bernoulli(0.3): sd of the rate = sqrt(.21 / 9000) = 0.0048; 5 sd = 0.024
    assert abs(masked[:, 10:].float().mean().item() - 0.3) < 0.024


@pytest.mark.parametrize("shift", [True, False])
def test_mdm_alignment_oracle(shift):
    """An oracle that outputs the right token under the right alignment gets ~0 loss; off by one it would not."""
    x0 = torch.randint(0, 40, (3, 12), generator=torch.Generator().manual_seed(1))
    if shift:
        target = lambda ids: torch.cat([x0[:, 1:], x0[:, :1]], 1)  # noqa: E731  logits at i -> token i+1
    else:
        target = lambda ids: x0  # noqa: E731
    model = FakeDLM("mdm", shift=shift, logits_fn=one_hot_logits(target))
    out = get_objective("mdm", attention="full")(
        model, {"input_ids": x0, "labels": x0}, generator=torch.Generator().manual_seed(0)
    )
    assert out.num_tokens > 0 and out.loss.item() < 1e-6
    wrong = FakeDLM(
        "mdm", shift=shift, logits_fn=one_hot_logits(lambda ids: x0 if shift else torch.cat([x0[:, 1:], x0[:, :1]], 1))
    )
    bad = get_objective("mdm", attention="full")(
        wrong, {"input_ids": x0, "labels": x0}, generator=torch.Generator().manual_seed(0)
    )
    assert bad.loss.item() > 1.0


@pytest.mark.parametrize("normalize", ["masked", "all"])
def test_mdm_weighting_and_normalisation_by_hand(normalize):
    B, L, eps = 4, 10, 1e-3
    x0 = torch.randint(0, 40, (B, L), generator=torch.Generator().manual_seed(2))
    labels = x0.clone()
    labels[:, :3] = -100  # a prompt
    model = FakeDLM("mdm", shift=True)
    out = get_objective("mdm", attention="full", normalize=normalize)(
        model, {"input_ids": x0, "labels": labels}, generator=torch.Generator().manual_seed(5)
    )
    t = schedules.sample_t(B, eps, False, torch.Generator().manual_seed(5))  # the objective's first draw
    x_t = model.calls[0]["input_ids"]
    masked = x_t == M
    assert not masked[:, :3].any()
    logits = model.table[:L]
    total, n = 0.0, 0
    for b in range(B):
        for j in range(1, L):
            if masked[b, j]:
                total += F.cross_entropy(logits[j - 1], x0[b, j]).item() / t[b].item()  # 1/t, not t
                n += 1
    denom = n if normalize == "masked" else B * (L - 3)
    assert out.num_tokens == n
    assert math.isclose(out.loss.item(), total / denom, rel_tol=1e-5)


def test_mdm_annealed_attention_schedule():
    x0 = torch.randint(0, 40, (2, 16))
    model = FakeDLM("mdm")
    obj = get_objective("mdm", attention="annealed", anneal_steps=4)
    out = obj(model, {"input_ids": x0, "labels": x0}, step=0, generator=torch.Generator().manual_seed(0))
    assert out.parts["p_anneal"] == 0.25
    am = model.calls[-1]["attention_mask"]
    tril = torch.ones(16, 16, dtype=torch.bool).tril()
    assert am[:, 0][:, tril].all() and not am[0, 0].all()  # causal kept, some of the future blocked
    assert torch.equal(am[0], am[1])  # one draw shared by the batch
    obj(model, {"input_ids": x0, "labels": x0}, step=3)
    assert model.calls[-1]["attention_mask"].all()


def test_block_objective_by_hand_t_per_block():
    B, L, bs = 2, 8, 4
    x0 = torch.randint(0, 40, (B, L), generator=torch.Generator().manual_seed(3))
    model = FakeDLM("block", shift=False, block_size=bs)
    out = get_objective("block", t_per="block")(
        model, {"input_ids": x0, "labels": x0}, generator=torch.Generator().manual_seed(7)
    )
    call = model.calls[0]
    assert call["input_ids"].shape == (B, 2 * L) and torch.equal(call["input_ids"][:, L:], x0)
    assert torch.equal(call["position_ids"][0], torch.arange(L).repeat(2))
    assert torch.equal(call["attention_mask"][0, 0], masks.dense(masks.block_diffusion(L, bs), 1, 2 * L)[0, 0])
    t_blocks = schedules.sample_t((B, L), 1e-3, False, torch.Generator().manual_seed(7))
    t_tok = t_blocks.gather(1, block_run_ids(torch.arange(L).expand(B, L), bs))
    masked = call["input_ids"][:, :L] == M
    logits = model.table[:L]
    total = sum(
        F.cross_entropy(logits[j], x0[b, j]).item() / t_tok[b, j].item()
        for b in range(B)
        for j in range(L)
        if masked[b, j]
    )
    assert out.num_tokens == int(masked.sum())
    assert math.isclose(out.loss.item(), total / int(masked.sum()), rel_tol=1e-5)
    # per-block t: tokens of one block share t, blocks differ
    assert t_tok[0, 0] == t_tok[0, 3] and t_tok[0, 0] != t_tok[0, 4]


def test_idlm_alignment_hand_checked():
    """Prompt of 3, response of 4, one pad: masks at 2..5 (the last prompt position predicts the first response
    token), none at the last response token or the pad; an oracle aligned as docs/algorithms.md#idlm gets zero loss. (On the 2L
    reference layout, which a fake model can show; the split path is checked equal to it on real models.)"""
    x0 = torch.tensor([[10, 11, 12, 20, 21, 22, 23, 0]])
    labels = torch.tensor([[-100, -100, -100, 20, 21, 22, 23, -100]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    L = 8
    nxt = torch.cat([x0[:, 1:], x0[:, :1]], 1)  # token i+1 at i
    model = FakeDLM(
        "idlm", shift=True, block_size=1, logits_fn=one_hot_logits(lambda ids: nxt.repeat(1, ids.shape[1] // L))
    )
    out = get_objective("idlm", fast_path=False)(model, {"input_ids": x0, "labels": labels, "attention_mask": attn})
    x_t = model.calls[0]["input_ids"][:, :L]
    assert x_t.tolist() == [[10, 11, M, M, M, M, 23, 0]]
    assert out.num_tokens == 4  # = number of response tokens; the first one (20) is scored by the mask at 2
    assert out.parts["ce_noisy"] < 1e-6 and out.parts["ce_clean"] < 1e-6
    # the same oracle shifted by one more position fails badly
    off = FakeDLM(
        "idlm", shift=True, block_size=1, logits_fn=one_hot_logits(lambda ids: x0.repeat(1, ids.shape[1] // L))
    )
    assert (
        get_objective("idlm", fast_path=False)(off, {"input_ids": x0, "labels": labels, "attention_mask": attn}).loss
        > 5
    )
    # the mask the model saw: the introspective mask, padded key 7 blocked for real queries
    am = model.calls[0]["attention_mask"][0, 0]
    assert not am[:7, 7].any() and not am[8:15, 15].any()


def test_idlm_loss_combination_and_auto_balance():
    x0 = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(4))
    model = FakeDLM("idlm", block_size=2)
    out = get_objective("idlm", fast_path=False, ce_alpha=0.5)(model, {"input_ids": x0, "labels": x0})
    p = out.parts
    assert math.isclose(out.loss.item(), p["ce_noisy"] + 0.5 * p["ce_clean"], rel_tol=1e-6)
    out = get_objective("idlm", fast_path=False, loss_auto_balance=True)(model, {"input_ids": x0, "labels": x0})
    p = out.parts
    assert math.isclose(p["scale"], p["ce_noisy"] / p["ce_clean"], rel_tol=1e-5)
    assert math.isclose(out.loss.item(), 2 * p["ce_noisy"], rel_tol=1e-5)


def test_idlm_distill_targets_clean_distribution():
    x0 = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(4))
    # both halves give the same logits per position -> masks already match the clean distribution: KL = 0
    model = FakeDLM(
        "idlm", block_size=1, logits_fn=lambda ids: model.table[:10].repeat(ids.shape[1] // 10, 1).expand(2, -1, -1)
    )
    out = get_objective("idlm", fast_path=False, idlm_loss_type="distill")(model, {"input_ids": x0, "labels": x0})
    assert abs(out.parts["kl_noisy"]) < 1e-5
    assert out.parts["mask_greedy_agree"] == 1.0
    # the gradient of the distill loss w.r.t. the mask logits is q - p (zero here up to the clean CE term)
    ar = get_objective("idlm", fast_path=False, idlm_loss_type="ar")(model, {"input_ids": x0, "labels": x0})
    assert ar.parts["ce_noisy"] == pytest.approx(ar.parts["ce_clean"], rel=1e-6)


# -- real tiny models ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_idlm_clean_half_is_ar_logits(arch, tok):
    dlm = convert_ar_to_dlm(make_model(arch), "idlm", tokenizer=tok, block_size=2)
    x0 = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    x_t = x0.clone()
    x_t[:, 4:] = dlm.mask_token_id
    am = masks.dense(masks.introspective(12, 2), 2, 24)
    with torch.no_grad():
        two = dlm(
            input_ids=torch.cat([x_t, x0], 1),
            attention_mask=am,
            position_ids=torch.arange(12).repeat(2)[None].expand(2, -1),
        ).logits
        ar = dlm(input_ids=x0).logits
    torch.testing.assert_close(two[:, 12:], ar, atol=1e-5, rtol=1e-5)


def _row_losses(dlm, obj, rows):
    """ce_noisy sum and token count of each (input_ids, labels) row on its own."""
    sums, ns = [], []
    for ids, lab in rows:
        out = obj(dlm, {"input_ids": torch.tensor([ids]), "labels": torch.tensor([lab])})
        sums.append(out.parts["ce_noisy"] * out.num_tokens)
        ns.append(out.num_tokens)
    return sum(sums) / sum(ns), sum(ns)


def test_idlm_padded_and_packed_batches_equal_single_rows(tok):
    dlm = convert_ar_to_dlm(make_model("llama"), "idlm", tokenizer=tok, block_size=2)
    obj = get_objective("idlm")
    a = ([5, 6, 7, 8, 9, 10, 11], [-100, -100, -100, 8, 9, 10, 11])
    b = ([20, 21, 22, 23, 24], [-100, -100, 22, 23, 24])
    ref, n = _row_losses(dlm, obj, [a, b])
    with torch.no_grad():
        # right-padded batch of 2
        pad = 3
        ids = torch.tensor([a[0], b[0] + [pad, pad]])
        lab = torch.tensor([a[1], b[1] + [-100, -100]])
        am = torch.tensor([[1] * 7, [1] * 5 + [0, 0]])
        out = obj(dlm, {"input_ids": ids, "labels": lab, "attention_mask": am})
        assert out.num_tokens == n
        assert out.parts["ce_noisy"] == pytest.approx(ref, abs=1e-5)
        # padding that *had* labels is still never trained
        lab_bad = torch.tensor([a[1], b[1] + [pad, pad]])
        out2 = obj(dlm, {"input_ids": ids, "labels": lab_bad, "attention_mask": am})
        assert out2.num_tokens == n and out2.parts["ce_noisy"] == pytest.approx(ref, abs=1e-5)
        # packed: both documents in one row
        packed = {
            "input_ids": torch.tensor([a[0] + b[0]]),
            "labels": torch.tensor([a[1] + b[1]]),
            "doc_ids": torch.tensor([[0] * 7 + [1] * 5]),
        }
        out3 = obj(dlm, packed)
        assert out3.num_tokens == n and out3.parts["ce_noisy"] == pytest.approx(ref, abs=1e-5)


def test_mdm_and_block_packed_rows_equal_single_rows(tok):
    """Same noise on a packed row and on separate rows (all tokens masked: t forced to 1 by eps = 1 - tiny)."""
    for objective, kw in [("mdm", {"attention": "full"}), ("block", {})]:
        dlm = convert_ar_to_dlm(make_model("llama"), objective, tokenizer=tok)
        obj = get_objective(objective, eps=0.999999, **kw)
        a, b = [5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23]
        with torch.no_grad():
            single = [obj(dlm, {"input_ids": torch.tensor([r]), "labels": torch.tensor([r])}) for r in (a, b)]
            packed = obj(
                dlm,
                {
                    "input_ids": torch.tensor([a + b]),
                    "labels": torch.tensor([a + b]),
                    "doc_ids": torch.tensor([[0] * 8 + [1] * 4]),
                },
            )
        ce_sum = sum(o.parts["ce"] * o.num_tokens for o in single)
        assert packed.num_tokens == sum(o.num_tokens for o in single)
        assert packed.parts["ce"] == pytest.approx(ce_sum / packed.num_tokens, abs=1e-5)


def test_gated_fast_path_equals_full_forward(tok):
    # float64: the two paths are the same maths (fp32 differs by ~1e-4 relative in a few gradient entries from
    # summation order over 2L vs L + L keys; in float64 they agree to ~1e-17)
    dlm = convert_ar_to_dlm(make_model("llama").double(), "idlm", tokenizer=tok, block_size=2)
    prepare_model_for_lora(dlm, {"r": 4, "gated": True})
    with torch.no_grad():
        for a in dlm.gated_lora.adapters.values():
            a.B.normal_(0, 0.3)
    ids = torch.randint(5, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    lab = ids.clone()
    lab[0, :4] = -100  # prompts: the fast path starts its noisy pass at the first block holding a mask
    lab[1, :3] = -100
    am = torch.ones_like(ids)
    am[1, 9:] = 0
    batch = {"input_ids": ids, "labels": lab, "attention_mask": am}
    grads = []
    outs = []
    for fast in (True, False):
        for p in dlm.parameters():
            p.grad = None
        out = get_objective("idlm", fast_path=fast, idlm_loss_type="distill")(dlm, batch)
        out.loss.backward()
        outs.append(out)
        grads.append(torch.cat([p.grad.flatten() for p in dlm.parameters() if p.requires_grad]))
    assert outs[0].parts["ce_noisy"] == pytest.approx(outs[1].parts["ce_noisy"], abs=1e-10)
    assert outs[0].loss.item() == pytest.approx(outs[1].loss.item(), abs=1e-10)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("packed", [False, True])
def test_split_path_equals_full_forward_without_lora(tok, packed):
    """Without gated LoRA the split path keeps the clean pass's graph: same loss (CE_noisy + alpha * CE_clean) and
    the same gradients on every weight as the single 2L forward, for plain and for packed/padded rows."""
    dlm = convert_ar_to_dlm(make_model("llama").double(), "idlm", tokenizer=tok, block_size=2)
    ids = torch.randint(5, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    lab = ids.clone()
    lab[0, :3] = -100
    batch = {"input_ids": ids, "labels": lab}
    if packed:
        batch["doc_ids"] = torch.tensor([[0] * 6 + [1] * 5, [0] * 11])
        am = torch.ones_like(ids)
        am[1, 8:] = 0
        batch["attention_mask"] = am
    outs, grads = [], []
    for fast in (True, False):
        dlm.zero_grad(set_to_none=True)
        out = get_objective("idlm", fast_path=fast, ce_alpha=0.5)(dlm, batch)
        out.loss.backward()
        outs.append(out)
        grads.append(torch.cat([p.grad.flatten() for p in dlm.parameters() if p.grad is not None]))
    assert outs[0].loss.item() == pytest.approx(outs[1].loss.item(), abs=1e-10)
    assert outs[0].parts["ce_clean"] == pytest.approx(outs[1].parts["ce_clean"], abs=1e-10)
    assert grads[0].numel() == grads[1].numel() and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], atol=1e-10, rtol=1e-8)


def test_objective_errors(tok):
    x0 = torch.randint(0, 40, (1, 8))
    with pytest.raises(DLMError, match="block_size 3 does not match the checkpoint's block_size 2"):
        get_objective("idlm", block_size=3)(FakeDLM("idlm", block_size=2), {"input_ids": x0, "labels": x0})
    with pytest.raises(DLMError, match="block_size 8 does not match"):
        get_objective("block", block_size=8)(
            FakeDLM("block", shift=False, block_size=4), {"input_ids": x0, "labels": x0}
        )
    with pytest.raises(DLMError, match="sequence length 8 is longer than the model's 6 positions"):
        get_objective("mdm")(FakeDLM("mdm", max_pos=6), {"input_ids": x0, "labels": x0})
    with pytest.raises(DLMError, match="'flash_attention_2'.*cannot take"):
        get_objective("mdm")(FakeDLM("mdm", attn="flash_attention_2"), {"input_ids": x0, "labels": x0})
    with pytest.raises(DLMError, match="converted for objective 'mdm'"):
        get_objective("idlm")(FakeDLM("mdm"), {"input_ids": x0, "labels": x0})
    with pytest.raises(DLMError, match="no 'labels'"):
        get_objective("mdm")(FakeDLM("mdm"), {"input_ids": x0})


def test_mdm_full_attention_without_a_mask_kernel(tok):
    """flash_attention_2 cannot take a mask: mdm 'full' runs through is_causal=False; checked here on sdpa,
    where is_causal=False must equal the dense full mask."""
    dlm = convert_ar_to_dlm(make_model("llama"), "mdm", tokenizer=tok)
    x = torch.randint(5, 300, (2, 9))
    with torch.no_grad():
        a = dlm(input_ids=x, is_causal=False).logits
        b = dlm(input_ids=x, attention_mask=masks.dense(masks.full(), 2, 9)).logits
        c = dlm(input_ids=x).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (a - c).abs().max() > 1e-3
    fake = FakeDLM("mdm", attn="flash_attention_2")
    x = x % 40
    out = get_objective("mdm", attention="full")(fake, {"input_ids": x, "labels": x})
    assert fake.calls[0]["attention_mask"] is None and out.num_tokens > 0
    with pytest.raises(DLMError, match="packed rows"):
        get_objective("mdm", attention="full")(fake, {"input_ids": x, "labels": x, "doc_ids": torch.zeros_like(x)})
