import json

import pytest
import torch

from dlm.errors import DLMError
from dlm.model import masks
from dlm.model.convert import DEFAULT_MASK_TOKEN, AutoDLMForCausalLM, convert_ar_to_dlm
from dlm.testing import ARCHITECTURES, make_tokenizer


def _ids(V=300, B=2, L=10, seed=0):
    return torch.randint(5, V, (B, L), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_parity_mask_token_and_round_trip(arch, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(arch)
    orig = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    V = orig.config.vocab_size
    dlm = convert_ar_to_dlm(folder, "idlm", block_size=2)
    # no mask token in the tiny tokenizer: a new special token, embedding resized by one row (mean init)
    assert dlm.mask_token_id == V and dlm.tokenizer.mask_token == DEFAULT_MASK_TOKEN
    emb = dlm.model.get_input_embeddings().weight
    assert emb.shape[0] == V + 1
    torch.testing.assert_close(emb[V], orig.get_input_embeddings().weight.mean(0))
    x = _ids()
    L = x.shape[1]
    causal = masks.dense(masks.causal(), 2, L)
    with torch.no_grad():
        ref = orig(input_ids=x).logits
        got = dlm(input_ids=x, attention_mask=causal).logits
        torch.testing.assert_close(got[..., :V], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dlm(input_ids=x).logits[..., :V], ref, atol=1e-5, rtol=1e-5)
    dlm.save_pretrained(tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg["dlm_objective"], cfg["block_size"], cfg["mask_token_id"], cfg["shift"]) == ("idlm", 2, V, True)
    loaded = AutoDLMForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.spec == dlm.spec and loaded.tokenizer.mask_token_id == V
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, dlm(input_ids=x).logits)
        torch.testing.assert_close(plain(input_ids=x).logits[..., :V], ref, atol=1e-5, rtol=1e-5)


def test_own_and_existing_special_mask_token(tiny_model_dir):
    from transformers import AutoTokenizer

    folder = tiny_model_dir("llama")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"mask_token": "<|mask|>"})
    tok.save_pretrained(folder)  # the tokenizer now has its own mask token (id 320, beyond the embedding)
    dlm = convert_ar_to_dlm(folder, "mdm")
    assert dlm.mask_token_id == 320 and dlm.tokenizer.mask_token == "<|mask|>"
    assert dlm.model.get_input_embeddings().weight.shape[0] == 321
    # an existing special token may be named explicitly; its id is kept
    dlm2 = convert_ar_to_dlm(folder, "mdm", mask_token="<|im_end|>")
    assert dlm2.mask_token_id == AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|im_end|>")


def test_ordinary_token_refused(tiny_model_dir):
    folder = tiny_model_dir("llama")
    tok = make_tokenizer()
    ordinary = next(t for t in tok.get_vocab() if t.isalpha() and len(t) > 2)
    with pytest.raises(DLMError, match="ordinary token"):
        convert_ar_to_dlm(folder, "mdm", mask_token=ordinary)


def test_conversion_fields_and_errors(tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    assert convert_ar_to_dlm(folder, "block").spec.shift is False
    assert convert_ar_to_dlm(folder, "block").block_size == 4
    assert convert_ar_to_dlm(folder, "mdm").spec.block_size is None
    with pytest.raises(DLMError, match="valid objectives are mdm, block, idlm"):
        convert_ar_to_dlm(folder, "bd3")
    with pytest.raises(DLMError, match="no block size"):
        convert_ar_to_dlm(folder, "mdm", block_size=4)
    with pytest.raises(DLMError, match="positive integer"):
        convert_ar_to_dlm(folder, "idlm", block_size=0)


def test_attention_that_cannot_take_a_mask_is_refused(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), attn_implementation="sdpa")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(DLMError, match="'flash_attention_2'.*cannot take"):
        convert_ar_to_dlm(model, "idlm", tokenizer=make_tokenizer())


@pytest.mark.slow
def test_smollm2_parity_and_round_trip(smollm2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    orig = AutoModelForCausalLM.from_pretrained(smollm2_path, attn_implementation="sdpa", dtype=torch.float32)
    V = orig.config.vocab_size
    dlm = convert_ar_to_dlm(smollm2_path, "idlm", block_size=2)
    assert dlm.mask_token_id == V  # SmolLM2 has no mask token: a new one is added
    x = _ids(V=V, B=1, L=24)
    with torch.no_grad():
        ref = orig(input_ids=x).logits
        got = dlm(input_ids=x, attention_mask=masks.dense(masks.causal(), 1, 24)).logits
        torch.testing.assert_close(got[..., :V], ref, atol=1e-4, rtol=1e-4)
        x_t = x.clone()
        x_t[:, 12:] = dlm.mask_token_id
        two = dlm(
            input_ids=torch.cat([x_t, x], 1),
            attention_mask=masks.dense(masks.introspective(24, 2), 1, 48),
            position_ids=torch.arange(24).repeat(2)[None],
        ).logits
        torch.testing.assert_close(two[:, 24:, :V], ref, atol=1e-4, rtol=1e-4)
    dlm.save_pretrained(tmp_path / "s")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "s")
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=x).logits[..., :V], ref, atol=1e-4, rtol=1e-4)


def test_cli_convert(tiny_model_dir, tmp_path, capsys):
    from dlm.cli import main

    folder = tiny_model_dir("qwen3")
    out = tmp_path / "conv"
    assert (
        main(
            [
                "convert",
                "--model",
                str(folder),
                "--objective",
                "block",
                "--block-size",
                "2",
                "--shift",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    assert "objective=block block_size=2 shift=True" in capsys.readouterr().out
    dlm = AutoDLMForCausalLM.from_pretrained(out)
    assert (dlm.objective, dlm.block_size, dlm.shift) == ("block", 2, True)
    # gated LoRA conversion: adapters beside the base weights
    gout = tmp_path / "gated"
    assert (
        main(
            [
                "convert",
                "--model",
                str(folder),
                "--objective",
                "idlm",
                "--gated-lora",
                "--lora-r",
                "4",
                "--lora-targets",
                "q_proj,v_proj",
                "--output",
                str(gout),
            ]
        )
        == 0
    )
    g = AutoDLMForCausalLM.from_pretrained(gout)
    assert len(g.gated_lora.adapters) == 4 and g.gated_lora.settings.r == 4
    # errors: one line, exit 2
    assert main(["convert", "--model", str(folder), "--objective", "mdlm", "--output", str(tmp_path / "x")]) == 2
    assert "valid objectives are mdm, block, idlm" in capsys.readouterr().err
    assert main(["convert", "--model", str(folder), "--objective", "mdm", "--output", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (
        main(
            ["convert", "--model", str(folder), "--objective", "mdm", "--lora-r", "4", "--output", str(tmp_path / "y")]
        )
        == 2
    )
    assert "--gated-lora" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
