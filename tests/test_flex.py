"""Training under ``--attn-impl flex_attention``: every objective hands flex a ``BlockMask`` built from the same
index functions, and gets the loss (and on CUDA, where flex has a backward, the gradients) that SDPA with the
dense mask gives. Before this path existed the objectives passed flex a dense boolean mask, which transformers
adds to the scores as 0/1: no masking at all on CUDA, a crash on CPU."""

import pytest
import torch

from dlm.model.convert import convert_ar_to_dlm, dense_mask_attention
from dlm.objectives import get_objective
from dlm.testing import make_model, make_tokenizer


def _flex_ok() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        return True
    except Exception:  # pragma: no cover
        return False


CASES = [  # (objective, objective kwargs, convert kwargs)
    ("idlm", {"ce_alpha": 0.5}, {"block_size": 2}),
    ("idlm", {"ce_alpha": 0.5, "fast_path": False}, {"block_size": 2}),
    ("mdm", {"attention": "full"}, {}),
    ("mdm", {"attention": "annealed", "anneal_steps": 10}, {}),
    ("block", {}, {"block_size": 3}),
]
# torch 2.13's CPU inductor emits C++ that does not compile for the annealed (random-draw) mask; CUDA runs it
CPU_CASES = [c for c in CASES if c[1].get("attention") != "annealed"]


def _batch(device):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 300, (2, 23), generator=g)
    lab = ids.clone()
    lab[0, :5] = -100  # a prompt
    am = torch.ones_like(ids)
    am[1, 19:] = 0  # padding
    doc = torch.tensor([[0] * 14 + [1] * 9, [0] * 23])  # a packed row
    return {k: v.to(device) for k, v in {"input_ids": ids, "labels": lab, "attention_mask": am, "doc_ids": doc}.items()}


def objective_parity(device: str, grads: bool, cases=CASES):
    """For each case: (name, loss sdpa, loss flex, max |grad sdpa - grad flex|, max |grad sdpa|)."""
    tok = make_tokenizer()
    rows = []
    for objective, kw, conv in cases:
        dlm = convert_ar_to_dlm(make_model("llama"), objective, tokenizer=tok, **conv).to(device)
        batch = _batch(device)
        obj = get_objective(objective, **kw)
        res = {}
        for impl in ("sdpa", "flex_attention"):
            dlm.base_model_hf.set_attn_implementation(impl)
            dlm.zero_grad(set_to_none=True)
            gen = torch.Generator(device=device).manual_seed(0)
            with torch.enable_grad() if grads else torch.no_grad():
                out = obj(dlm, batch, step=4, generator=gen)
                if grads:
                    out.loss.backward()
            g = torch.cat([p.grad.flatten() for p in dlm.parameters() if p.grad is not None]) if grads else None
            res[impl] = (out.loss.item(), g)
        (ls, gs), (lf, gf) = res["sdpa"], res["flex_attention"]
        name = (
            objective
            + ("" if kw.get("fast_path", True) else "-2L")
            + (f"-{kw['attention']}" if "attention" in kw else "")
        )
        diff = float((gs - gf).abs().max()) if grads else 0.0
        scale = float(gs.abs().max()) if grads else 0.0
        rows.append((name, ls, lf, diff, scale))
    return rows


@pytest.mark.slow  # torch.compile of flex attention on CPU: about a minute the first time
@pytest.mark.skipif(not _flex_ok(), reason="flex attention not available in this torch")
def test_objectives_under_flex_equal_sdpa_cpu():
    for name, ls, lf, _, _ in objective_parity("cpu", grads=False, cases=CPU_CASES):
        assert lf == pytest.approx(ls, abs=1e-5), name


def test_dense_mask_attention_switches_and_restores():
    tok = make_tokenizer()
    dlm = convert_ar_to_dlm(make_model("llama"), "idlm", tokenizer=tok)
    hf = dlm.base_model_hf
    hf.set_attn_implementation("flex_attention")
    with dense_mask_attention(dlm):
        assert hf.config._attn_implementation == "sdpa"
    assert hf.config._attn_implementation == "flex_attention"
    with pytest.raises(Exception, match="flex_attention"):
        from dlm.decode.engine import Engine

        Engine(dlm)
