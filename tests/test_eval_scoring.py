"""Scoring is exact: the batched causal log-likelihood and the batched denoising score equal a naive
one-sequence-at-a-time computation with the same masks (fp32, CPU; tolerance for summation order only)."""

import math

import pytest
import torch
import torch.nn.functional as F

from dlm.eval.multiple_choice import evaluate_multiple_choice
from dlm.eval.scoring import as_eval_model, denoising_scores, draw_masks, encode_pair, loglikelihoods
from dlm.eval.tasks.base import MCExample
from dlm.model.convert import convert_ar_to_dlm
from dlm.testing import make_model, make_tokenizer

PAIRS = [
    ("Question: How do you boil an egg?\nAnswer: ", " Put it in boiling water."),
    ("Question: How do you boil an egg?\nAnswer: ", " Put it in the fridge for a year."),
    ("The quick brown fox", " jumps over the lazy dog."),
    ("", "Once upon a time"),
    ("To be, or not to be,", " that"),
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _naive_ll(model, ctx, cont):
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    lp = sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
    greedy = all(int(logp[len(ctx) - 1 + j].argmax()) == t for j, t in enumerate(cont))
    return lp, greedy


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_causal_loglikelihood_matches_naive(arch, tok):
    model = make_model(arch)
    em = as_eval_model(model, tok)
    pairs = [encode_pair(em, c, x) for c, x in PAIRS]
    assert pairs[3][0] == [tok.eos_token_id]  # empty context -> the BOS/EOS token
    for budget in (64, 10_000) if arch == "llama" else (10_000,):  # several batches vs one
        got = loglikelihoods(em, pairs, batch_tokens=budget)
        for (ctx, cont), (lp, greedy) in zip(pairs, got):
            want, want_greedy = _naive_ll(model, ctx, cont)
            assert lp == pytest.approx(want, abs=1e-4)
            assert greedy == want_greedy


def test_encode_pair_moves_trailing_space(tok):
    em = as_eval_model(make_model(), tok)
    ctx, cont = encode_pair(em, "Answer: ", "yes")
    assert ctx == tok("Answer:", add_special_tokens=False)["input_ids"]
    assert ctx + cont == tok("Answer: yes", add_special_tokens=False)["input_ids"]


def _naive_denoise(dlm, ctx, cont, steps, seed, key):
    """The reference protocol: one forward per mask draw, full attention, shift honoured."""
    M, full = dlm.mask_token_id, ctx + cont
    masks = draw_masks(len(cont), steps, seed, key)
    per_step = []
    for k in range(steps):
        where = [len(ctx) + j for j in range(len(cont)) if masks[k, j]]
        if not where:
            continue
        x = torch.tensor([full])
        x[0, where] = M
        attn = torch.ones(1, 1, len(full), len(full), dtype=torch.bool)
        with torch.no_grad():
            logits = dlm(input_ids=x, attention_mask=attn).logits[0].double()
        logits[:, M] = float("-inf")  # the mask token is never a prediction
        rows = [p - 1 for p in where] if dlm.shift else where
        per_step.append(float(F.cross_entropy(logits[rows], torch.tensor([full[p] for p in where]))))
    return sum(per_step) / len(per_step)


@pytest.mark.parametrize("objective,shift", [("mdm", True), ("block", False)])
def test_denoising_score_matches_one_forward_per_draw(objective, shift):
    dlm = convert_ar_to_dlm(make_model("llama"), objective, tokenizer=make_tokenizer())
    assert dlm.shift is shift
    em = as_eval_model(dlm)
    assert em.kind == "diffusion"
    pairs = [encode_pair(em, c, x) for c, x in PAIRS[:3]]
    keys = ["t:0", "t:0", "t:1"]
    got = denoising_scores(em, pairs, keys, steps=8, seed=3, batch_tokens=10_000)
    for (ctx, cont), key, g in zip(pairs, keys, got):
        assert g == pytest.approx(_naive_denoise(dlm, ctx, cont, 8, 3, key), abs=1e-4)
    # deterministic per example: independent of batching, reproducible, and the seed matters
    assert denoising_scores(em, pairs, keys, steps=8, seed=3, batch_tokens=40) == pytest.approx(got, abs=1e-5)
    assert denoising_scores(em, pairs, keys, steps=8, seed=3, batch_tokens=10_000) == got
    assert denoising_scores(em, pairs, keys, steps=8, seed=4) != got


def test_draw_masks_schedule_and_common_random_numbers():
    m = draw_masks(5, 32, seed=0, key="x")
    assert m.shape == (32, 5) and m[-1].all()  # step T masks every token
    longer = draw_masks(9, 32, seed=0, key="x")
    assert torch.equal(longer[:, :5], m)  # choices of one example share their leading draws
    # masking rate at step k is k/T: over 4000 tokens the mean at k = T/2 is 0.5 within 4 standard errors
    big = draw_masks(4000, 32, seed=1, key=0)
    rate = big[15].float().mean().item()
    assert abs(rate - 0.5) < 4 * math.sqrt(0.25 / 4000)


def test_model_kinds_and_causal_dlm_equals_ar(tok):
    ar = make_model("llama")
    idlm = convert_ar_to_dlm(make_model("llama"), "idlm", tokenizer=make_tokenizer())
    assert as_eval_model(idlm).kind == "causal" and as_eval_model(ar, tok).kind == "causal"
    examples = [MCExample(c, [x, " something else entirely"], 0) for c, x in PAIRS[:3]]
    r_ar = evaluate_multiple_choice(as_eval_model(ar, tok), examples, keep_predictions=True)
    r_idlm = evaluate_multiple_choice(as_eval_model(idlm), examples, keep_predictions=True)
    for a, b in zip(r_ar["predictions"], r_idlm["predictions"]):
        assert a["scores"] == pytest.approx(b["scores"], abs=1e-4)  # same weights, causal mask, mask suppressed
    assert set(r_ar) >= {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "n", "seconds"}
    assert 0.0 <= r_ar["acc"] <= 1.0 and r_ar["n"] == 3
    # no gradients were kept
    assert all(p.grad is None for p in ar.parameters())


def test_accuracy_from_known_scores(tok, monkeypatch):
    """acc / acc_norm / stderr arithmetic on scores we control."""
    import dlm.eval.multiple_choice as mc

    em = as_eval_model(make_model(), tok)
    examples = [
        MCExample("c", ["a", "bbbbbbbb"], 1),
        MCExample("c", ["a", "b"], 0),
        MCExample("c", ["aaaa", "b"], 0),
        MCExample("c", ["a", "b"], 1),
    ]
    fake = [[-1.0, -2.0], [-1.0, -2.0], [-4.0, -2.0], [-3.0, -1.0]]
    monkeypatch.setattr(mc, "score_examples", lambda *a, **k: fake)
    r = mc.evaluate_multiple_choice(em, examples)
    assert r["acc"] == 0.5  # argmax: 0, 0, 1, 1 vs gold 1, 0, 0, 1
    assert r["acc_norm"] == 1.0  # per char: [-1, -.25] -> 1; [-1, -2] -> 0; [-1, -2] -> 0; [-3, -1] -> 1
    assert r["acc_stderr"] == pytest.approx(math.sqrt(0.25 * 4 / 3 / 4))


def test_run_eval_progress_bar_counts_every_scored_row(tmp_path, monkeypatch):
    """A long multiple-choice task shows a progress bar (rate, ETA) that reaches its total: one row per
    (context, choice) pair for a causal model."""
    import json

    import dlm.eval.runner as runner
    from dlm.testing import make_model, make_tokenizer

    (tmp_path / "piqa").mkdir()
    with open(tmp_path / "piqa" / "valid.jsonl", "w") as fh:
        for i in range(5):
            fh.write(json.dumps({"goal": f"goal {i}", "sol1": "a b", "sol2": "c d e"}) + "\n")
    (tmp_path / "piqa" / "valid-labels.lst").write_text("0\n1\n0\n1\n0\n")
    bars = []
    make = runner._bar
    monkeypatch.setattr(runner, "_bar", lambda *a: bars.append(make(*a)) or bars[-1])
    res = runner.run_eval(
        make_model("llama"), "piqa", runner.EvalSettings(data_dir=tmp_path), tokenizer=make_tokenizer(), progress=True
    )
    assert res["piqa"]["n"] == 5 and len(bars) == 1 and bars[0].n == bars[0].total == 10
    runner.run_eval(make_model("llama"), "piqa", runner.EvalSettings(data_dir=tmp_path), tokenizer=make_tokenizer())
    assert len(bars) == 1  # progress=False (the default, and dlm eval --quiet or a non-terminal stderr): no bar


def test_generation_task_progress_bar_counts_every_prompt(monkeypatch):
    """LAMBADA and poem reversal generate for minutes: a bar over the prompts (rate, ETA) that reaches its total."""
    import dlm.progress
    from dlm.eval.generation import evaluate_generation
    from dlm.eval.scoring import as_eval_model
    from dlm.eval.tasks.base import GenExample
    from dlm.testing import make_model, make_tokenizer

    bars = []
    make = dlm.progress.bar
    monkeypatch.setattr(dlm.progress, "bar", lambda *a, **k: bars.append(make(*a, **k)) or bars[-1])
    em = as_eval_model(make_model("llama"), make_tokenizer())
    examples = [GenExample(id=str(i), prompt=f"the {i} cat", target="sat down") for i in range(3)]
    res = evaluate_generation(em, examples, "lambada", "ar", progress=True)
    assert res["n"] == 3 and len(bars) == 1 and bars[0].n == bars[0].total == 3
    evaluate_generation(em, examples, "lambada", "ar")
    assert len(bars) == 1  # progress=False: no bar
