import copy

import pytest
import torch

from dlm.errors import DLMError
from dlm.model import masks
from dlm.model.convert import AutoDLMForCausalLM, convert_ar_to_dlm
from dlm.model.lora import ADAPTER_FILE, LoraSettings, prepare_model_for_lora, trainable_parameters
from dlm.testing import make_model, make_tokenizer


def _dlm(arch="llama", objective="idlm", **kw):
    tok = make_tokenizer()
    return convert_ar_to_dlm(make_model(arch), objective, tokenizer=tok, **kw)


def _batch(dlm, L=12, B=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(5, 300, (B, L), generator=g)
    xt = x0.clone()
    xt[:, L // 2 :] = dlm.mask_token_id
    return x0, xt


def _two_half(model, xt, x0, b=1):
    B, L = x0.shape
    am = masks.dense(masks.introspective(L, b), B, 2 * L)
    pos = torch.arange(L).repeat(2)[None].expand(B, -1)
    return model(input_ids=torch.cat([xt, x0], 1), attention_mask=am, position_ids=pos).logits


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gated_lora_clean_path_stays_base_after_training(arch):
    dlm = _dlm(arch)
    base = copy.deepcopy(dlm.model)
    prepare_model_for_lora(dlm, {"r": 4, "alpha": 8, "gated": True})
    params = trainable_parameters(dlm)
    n_adapters = len(dlm.gated_lora.adapters)
    assert len(params) == 2 * n_adapters + 1  # A, B per layer + the mask embedding vector
    assert all(not p.requires_grad for p in dlm.model.parameters())
    emb_before = dlm.model.get_input_embeddings().weight.detach().clone()

    x0, xt = _batch(dlm)
    # B = 0 at start: identical to the base model everywhere except the mask embedding (same init row)
    with torch.no_grad():
        torch.testing.assert_close(_two_half(dlm, xt, x0), _two_half(base, xt, x0), rtol=0, atol=1e-6)

    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    dlm.train()
    for _ in range(4):
        logits = _two_half(dlm, xt, x0)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :12].reshape(-1, logits.shape[-1]), x0.roll(-1, 1).reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    dlm.eval()
    with torch.no_grad():
        got, ref = _two_half(dlm, xt, x0), _two_half(base, xt, x0)
        # clean half (and unmasked noisy positions): exactly the frozen base model
        assert torch.equal(got[:, 12:], ref[:, 12:])
        assert torch.equal(got[:, :6], ref[:, :6])
        # the masks did learn something
        assert (got[:, 6:12] - ref[:, 6:12]).abs().max() > 1e-3
        # a plain causal forward is exactly the base model
        assert torch.equal(dlm(input_ids=x0).logits, base(input_ids=x0).logits)
    # weight decay could not touch the embedding table (the mask vector is a separate parameter)
    assert torch.equal(dlm.model.get_input_embeddings().weight, emb_before)
    assert not torch.equal(dlm.gated_lora.mask_embedding, emb_before[dlm.mask_token_id])


def test_gated_lora_gate_per_call_with_kv_cache():
    from transformers import DynamicCache

    from dlm.model.convert import cache_kw

    dlm = _dlm()
    prepare_model_for_lora(dlm, {"r": 4, "gated": True})
    with torch.no_grad():
        for a in dlm.gated_lora.adapters.values():
            a.B.normal_(0, 0.5)
    x0, _ = _batch(dlm, L=8, B=1)
    M = dlm.mask_token_id
    ext = torch.tensor([[7, M, M]])
    full_ids = torch.cat([x0, ext], 1)
    with torch.no_grad():
        full = dlm(input_ids=full_ids).logits
        kv = {cache_kw(dlm): DynamicCache()}
        pre = dlm(input_ids=x0, use_cache=True, **kv)
        step = dlm(input_ids=ext, position_ids=torch.arange(8, 11)[None], **kv).logits
    torch.testing.assert_close(step, full[:, 8:], atol=1e-5, rtol=1e-5)
    # the prefill (no masks) is the base path: equal to the full forward's first 8 positions
    torch.testing.assert_close(pre.logits, full[:, :8], atol=1e-5, rtol=1e-5)


def test_gated_lora_save_load_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    dlm = _dlm()
    base = copy.deepcopy(dlm.model)
    prepare_model_for_lora(dlm, LoraSettings(r=4, target_modules=["q_proj", "v_proj"], gated=True))
    with torch.no_grad():
        for a in dlm.gated_lora.adapters.values():
            a.B.normal_(0, 0.5)
        dlm.gated_lora.mask_embedding.add_(1.0)
    x0, xt = _batch(dlm)
    with torch.no_grad():
        before = _two_half(dlm, xt, x0)
    dlm.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / ADAPTER_FILE).is_file()
    loaded = AutoDLMForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert len(loaded.gated_lora.adapters) == 4  # q_proj, v_proj x 2 layers
    with torch.no_grad():
        assert torch.equal(_two_half(loaded, xt, x0), before)
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
        assert torch.equal(plain(input_ids=x0).logits, base(input_ids=x0).logits)
        assert torch.equal(plain(input_ids=xt).logits, base(input_ids=xt).logits)
    # saving again from the loaded model works (config entry restored on save only)
    loaded.save_pretrained(tmp_path / "again")
    again = AutoDLMForCausalLM.from_pretrained(tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(_two_half(again, xt, x0), before)


def test_gated_lora_missing_adapter_file(tmp_path):
    dlm = _dlm()
    prepare_model_for_lora(dlm, {"r": 2, "gated": True})
    dlm.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / ADAPTER_FILE).unlink()
    with pytest.raises(DLMError, match=ADAPTER_FILE):
        AutoDLMForCausalLM.from_pretrained(tmp_path / "ckpt")


def test_plain_lora_merges_on_save(tmp_path):
    dlm = _dlm(objective="mdm")
    prepare_model_for_lora(dlm, {"r": 4, "alpha": 8})
    with torch.no_grad():
        for n, p in dlm.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    x0, _ = _batch(dlm)
    with torch.no_grad():
        before = dlm(input_ids=x0).logits
    dlm.save_pretrained(tmp_path / "m")
    loaded = AutoDLMForCausalLM.from_pretrained(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x0).logits, before, atol=1e-5, rtol=1e-5)


def test_lora_settings_errors():
    dlm = _dlm()
    with pytest.raises(DLMError, match="unknown LoRA setting"):
        prepare_model_for_lora(dlm, {"rank": 4})
    with pytest.raises(DLMError, match="matched no linear layer"):
        prepare_model_for_lora(dlm, {"target_modules": ["nope"], "gated": True})
    with pytest.raises(DLMError, match="positive integer"):
        LoraSettings(r=0)


def test_gated_dense_row_and_span_paths_agree():
    """The three ways a gated delta is applied give the same logits, and non-gated rows stay the base's exactly:
    dense (training, many masks), gathered rows (scattered masks) and one contiguous span (decoding)."""
    dlm = _dlm()
    prepare_model_for_lora(dlm, {"r": 4, "gated": True})
    with torch.no_grad():
        for a in dlm.gated_lora.adapters.values():
            a.B.normal_(0, 0.5)
    x0, _ = _batch(dlm, L=12, B=2)
    cases = {"scattered": [(0, 9), (1, 3)], "span": [(0, 10), (0, 11)]}
    for name, where in cases.items():
        g = dlm.gated_lora
        x = x0.clone()
        for r, c in where:
            x[r, c] = dlm.mask_token_id
        gated_rows = x == dlm.mask_token_id
        with torch.enable_grad():
            g.dense_fraction = 0.0
            dense = dlm(input_ids=x).logits.detach()
            assert g._dense
        g.dense_fraction = 0.25
        with torch.no_grad():
            rows = dlm(input_ids=x).logits
            assert not g._dense and (g._span is not None) == (name == "span")
            g.remove()
            base = dlm(input_ids=x).logits  # the frozen base model, no adapters at all
        _attach_again(dlm, g)
        torch.testing.assert_close(dense, rows, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(rows[gated_rows], base[gated_rows], atol=1e-3)  # the adapters act on masks
        for r in range(x.shape[0]):  # every row before the first mask of its sequence is the base model's exactly
            c = int(gated_rows[r].float().argmax()) if gated_rows[r].any() else x.shape[1]
            assert torch.equal(rows[r, :c], base[r, :c]) and torch.equal(dense[r, :c], base[r, :c])


def _attach_again(dlm, g):
    from dlm.model.lora import GatedLoRA

    fresh = GatedLoRA(dlm.base_model_hf, dlm.mask_token_id, g.settings, g.module_names)
    fresh.load_state_dict(g.state_dict())
    dlm.gated_lora = fresh


def test_target_modules_comma_string():
    """The command-line form ``q_proj,v_proj`` (dlm convert / quickstart --lora-targets) names the modules."""
    assert LoraSettings(target_modules="q_proj, v_proj").target_modules == ["q_proj", "v_proj"]
    assert LoraSettings(target_modules="all-linear").target_modules == "all-linear"
    dlm = _dlm()
    prepare_model_for_lora(dlm, {"r": 4, "gated": True, "target_modules": "q_proj,v_proj"})
    names = dlm.gated_lora.module_names
    assert names and all(n.endswith(("q_proj", "v_proj")) for n in names)
