"""Published DLM checkpoints (LLaDA, Dream, SDAR and SDAR-MoE, I-DLM, Fast-dLLM v2, LLaDA2, LLaDA-MoE) in their
exact folder layouts: loaded
without remote code they give the family's own forward (written in published_layouts.py from its definition),
save and reload unchanged, refuse broken folders with one line naming the field; dlm export writes them back."""

import json

import pytest
import torch
from published_layouts import (
    HEADS,
    MASK,
    WRITERS,
    family_attention,
    reference_logits,
    write_dream,
    write_fast_dllm_v2,
    write_idlm,
    write_llada,
    write_llada2,
    write_llada_moe,
    write_sdar,
    write_sdar_moe,
)

import dlm
from dlm.cli import main
from dlm.errors import DLMError

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]

EXPECTED = {  # family -> (objective, shift, block size, attention, transformers class)
    "llada": ("mdm", False, None, "bidirectional", "LlamaForCausalLM"),
    "dream": ("mdm", True, None, "bidirectional", "Qwen2ForCausalLM"),
    "sdar": ("block", False, 4, "block", "Qwen3ForCausalLM"),
    "idlm": ("idlm", True, 1, "causal", "Qwen3ForCausalLM"),
    "fast_dllm_v2": ("block", True, 4, "block", "Qwen2ForCausalLM"),
    "llada2": ("block", False, 32, "block", "Glm4MoeForCausalLM"),
    "llada_moe": ("mdm", False, None, "bidirectional", "Qwen3MoeForCausalLM"),
}


def logits_of(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_load_gives_the_family_forward_and_fields(tmp_path, family):
    folder = WRITERS[family](tmp_path / family)
    model = dlm.load_model(folder)
    objective, shift, block, attention, cls = EXPECTED[family]
    assert isinstance(model, dlm.DiffusionLM) and type(model.base_model_hf).__name__ == cls
    assert (model.objective, model.shift, model.block_size, model.mask_token_id) == (objective, shift, block, MASK)
    assert model.hf_config.dlm_family == family and model.hf_config.dlm_attention == attention
    want = reference_logits(folder, IDS, family_attention(family, len(IDS), block))
    torch.testing.assert_close(logits_of(model), want, atol=2e-5, rtol=1e-5)
    # the same through the command-line loader the other commands use
    from dlm.model.convert import load_any

    again = load_any(folder)
    assert torch.equal(logits_of(again), logits_of(model))


def test_llada_moe_placeholders_its_code_never_reads_do_not_block_loading(tmp_path):
    """LLaDA-MoE's configuration class writes router_num_group / router_topk_group = -2, which none of its modeling
    code reads: the folder loads, with the logits of the folder without them."""
    plain = dlm.load_model(write_llada_moe(tmp_path / "plain"))
    placeholders = dlm.load_model(write_llada_moe(tmp_path / "p", router_num_group=-2, router_topk_group=-2))
    assert json.loads((tmp_path / "p" / "config.json").read_text())["router_num_group"] == -2
    assert torch.equal(logits_of(placeholders), logits_of(plain))


def test_llada2_across_blocks_and_its_variants(tmp_path):
    """LLaDA2's block-causal attention over several blocks (its own block length 32 and a smaller one given in
    config.json), and the layouts' options: biased projections, no shared experts, a router without its bias,
    num_key_value_heads 0 (as many as the heads)."""
    ids = [(7 * i + 3) % 300 for i in range(70)]
    for name, kw in (
        ("plain", {}),
        ("block8", {"block_size": 8}),
        ("unshared", {"shared": 0}),
        ("mha", {"kv_heads": HEADS, "num_key_value_heads": 0}),
    ):
        folder = write_llada2(tmp_path / name, **kw)
        model = dlm.load_model(folder)
        block = kw.get("block_size", 32)
        assert model.block_size == block
        want = reference_logits(folder, ids, family_attention("llada2", len(ids), block))
        torch.testing.assert_close(logits_of(model, ids), want, atol=3e-5, rtol=1e-5)


def test_llada2_qkv_biases_and_a_router_without_its_bias(tmp_path):
    """use_qkv_bias and a router without expert_bias load (and save, and load again, the same); a bias on the
    output projection (use_bias, absent from the published checkpoints) is refused naming the weight."""
    from safetensors.torch import load_file, save_file

    folder = write_llada2(tmp_path / "biased", use_qkv_bias=True, moe_router_enable_expert_bias=False)
    state = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for i in range(3):
        p = f"model.layers.{i}.attention"
        state[f"{p}.query_key_value.bias"] = torch.randn(state[f"{p}.query_key_value.weight"].shape[0], generator=g)
        state.pop(f"model.layers.{i}.mlp.gate.expert_bias", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = dlm.load_model(folder)
    ids = list(range(5, 45))
    want = reference_logits(folder, ids, family_attention("llada2", len(ids), 32))
    torch.testing.assert_close(logits_of(model, ids), want, atol=3e-5, rtol=1e-5)
    model.save_pretrained(tmp_path / "saved")
    assert torch.equal(logits_of(dlm.load_model(tmp_path / "saved"), ids), logits_of(model, ids))

    state["model.layers.1.attention.dense.bias"] = torch.zeros(state["model.layers.1.attention.dense.weight"].shape[0])
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DLMError, match=r"attention\.dense\.bias.*use_bias false"):
        dlm.load_model(folder)


def test_sdar_moe_is_sdar_on_qwen3_moe(tmp_path):
    """SDAR-MoE (SDARMoeForCausalLM, Qwen3-30B-A3B's weights and fields) loads as Qwen3-MoE with SDAR's block
    attention (and as an I-DLM where config.json says causal), saves and loads again the same."""
    folder = write_sdar_moe(tmp_path / "sdar_moe", block_size=4)
    model = dlm.load_model(folder)
    assert type(model.base_model_hf).__name__ == "Qwen3MoeForCausalLM"
    assert (model.objective, model.shift, model.block_size, model.hf_config.dlm_family) == ("block", False, 4, "sdar")
    ids = list(range(5, 40))
    want = reference_logits(folder, ids, family_attention("sdar", len(ids), 4))
    torch.testing.assert_close(logits_of(model, ids), want, atol=3e-5, rtol=1e-5)
    model.save_pretrained(tmp_path / "saved")
    assert torch.equal(logits_of(dlm.load_model(tmp_path / "saved"), ids), logits_of(model, ids))
    idlm = dlm.load_model(write_sdar_moe(tmp_path / "idlm_moe", block_size=2))
    assert (idlm.objective, idlm.shift, idlm.hf_config.dlm_family) == ("idlm", True, "idlm")


def test_llada_variants_tied_and_sharded(tmp_path):
    for kw in (dict(tie=True), dict(shards=3)):
        folder = write_llada(tmp_path / str(sorted(kw)), **kw)
        model = dlm.load_model(folder)
        want = reference_logits(folder, IDS, family_attention("llada", len(IDS)))
        torch.testing.assert_close(logits_of(model), want, atol=2e-5, rtol=1e-5)


def test_padding_mask_keeps_the_bidirectional_attention_on_real_tokens(tmp_path):
    model = dlm.load_model(write_llada(tmp_path / "llada"))
    padded = torch.tensor([IDS + [3, 3]])
    mask = torch.tensor([[1] * len(IDS) + [0, 0]])
    with torch.no_grad():
        got = model(input_ids=padded, attention_mask=mask).logits[0, : len(IDS)]
    torch.testing.assert_close(got, logits_of(model), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_save_and_reload_round_trip(tmp_path, family):
    model = dlm.load_model(WRITERS[family](tmp_path / family))
    model.save_pretrained(tmp_path / "saved")
    fields = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert fields["dlm_family"] == family and fields["dlm_objective"] == EXPECTED[family][0]
    assert fields["model_type"] in ("llama", "qwen2", "qwen3", "glm4_moe", "qwen3_moe")
    back = dlm.load_model(tmp_path / "saved")
    assert back.spec == model.spec and back.hf_config.dlm_attention == model.hf_config.dlm_attention
    assert torch.equal(logits_of(back), logits_of(model))


def test_sdar_and_idlm_told_apart(tmp_path):
    def family(**kw):
        return dlm.load_model(write_sdar(tmp_path / "x", **kw)).hf_config.dlm_family

    assert family(block_size=4) == "sdar"
    assert family(block_size=2) == "idlm"  # the I-DLM release: no use_regular_causal, block 1/2/3
    assert family(block_size=2, use_regular_causal=False) == "sdar"
    assert family(block_size=8, use_regular_causal=True) == "idlm"
    m = dlm.load_model(write_idlm(tmp_path / "b3", block_size=3))
    assert (m.objective, m.block_size, m.shift) == ("idlm", 3, True)


def _broken(tmp_path, writer, drop=(), **set_):
    folder = writer(tmp_path / "broken")
    path = folder / "config.json"
    fields = json.loads(path.read_text())
    for k in drop:
        fields.pop(k)
    fields.update(set_)
    path.write_text(json.dumps(fields))
    return folder


@pytest.mark.parametrize(
    "writer,drop,set_,words",
    [
        (write_llada, ("d_model",), {}, ["'d_model'", "config.json"]),
        (write_llada, (), {"block_type": "sequential"}, ["'block_type'", "llama"]),
        (write_llada, (), {"rope": False}, ["'rope'"]),
        (write_llada, ("mask_token_id",), {}, ["mask_token_id", "126336"]),
        (write_dream, (), {"mask_token_id": 10_000}, ["'mask_token_id' 10000", "config.json"]),
        (write_sdar, ("block_size",), {}, ["'block_size'", "--block-size", "dlm convert"]),
        (write_fast_dllm_v2, ("bd_size",), {}, ["'block_size'"]),
        (write_sdar, ("num_hidden_layers",), {}, ["'num_hidden_layers'"]),
        (write_sdar, (), {"model_type": "sdar_moe", "architectures": ["SDARMoeForCausalLM"]}, ["'num_experts'"]),
        (write_llada_moe, (), {"shared_expert_intermediate_size": 32}, ["'shared_expert_intermediate_size'"]),
        (write_llada_moe, (), {"moe_layer_freq": [1, 1]}, ["'moe_layer_freq'"]),
        (write_llada_moe, (), {"moe_router_score_function": "sigmoid"}, ["softmax"]),
        (write_llada_moe, (), {"num_experts": 4}, ["has more experts", "num_experts 4"]),
        (write_llada2, ("num_experts",), {}, ["'num_experts'", "config.json"]),
        (write_llada2, (), {"norm_head": True}, ["'norm_head'"]),
        (write_llada2, (), {"score_function": "softmax"}, ["'score_function'", "sigmoid"]),
        (write_llada2, ("partial_rotary_factor", "rotary_dim"), {}, ["'partial_rotary_factor'"]),
        (write_llada2, (), {"n_group": 3}, ["'n_group'"]),
        (write_llada2, (), {"num_experts": 16, "n_group": 8}, ["lacks", "experts.8.gate_proj"]),
        (write_llada2, (), {"num_key_value_heads": 4}, ["query_key_value", "rows"]),
        (write_llada, (), {"n_layers": 3}, ["lacks", "model.layers.2"]),
        (write_dream, (), {"intermediate_size": 48}, ["shape", "mlp"]),
    ],
)
def test_broken_folders_fail_with_one_line_naming_the_field(tmp_path, writer, drop, set_, words):
    folder = _broken(tmp_path, writer, drop, **set_)
    with pytest.raises(DLMError) as e:
        dlm.load_model(folder)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_missing_block_size_through_the_commands(tmp_path, capsys):
    folder = write_sdar(tmp_path / "hub", block_size=None)  # the hub config: no block_size, no mask_token_id
    rc = main(["generate", "--model", str(folder), "--prompt", "The cat", "--decode", "block", "--max-new-tokens", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "'block_size'" in err[0], err
    # the fix the message names: write a dlm folder with the block size (the default mask id is not in this tiny
    # vocabulary, so give it too)
    fields = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(fields, mask_token_id=MASK)))
    out = tmp_path / "sdar-b4"
    assert (
        main(["convert", "--model", str(folder), "--objective", "block", "--block-size", "4", "--output", str(out)])
        == 0
    )
    m = dlm.load_model(out)
    assert (m.objective, m.block_size, m.hf_config.dlm_family) == ("block", 4, "sdar")
    assert main(["convert", "--model", str(folder), "--objective", "mdm", "--output", str(tmp_path / "x")]) == 2


def test_block_size_given_by_a_flag_fills_in_only(tmp_path):
    from dlm.model.convert import load_any

    hub = write_sdar(tmp_path / "hub", block_size=None, mask_token_id=MASK)
    assert load_any(hub, objective="block", block_size=8).block_size == 8  # e.g. dlm train --block-size 8
    with pytest.raises(DLMError, match="'block_size' 4, but block size 8"):
        load_any(write_sdar(tmp_path / "b4"), block_size=8)


# -- export ---------------------------------------------------------------------------------------------------
def _own(arch, objective, shift, block_size=None):
    from dlm.testing import make_model, make_tokenizer

    return dlm.convert_ar_to_dlm(
        make_model(arch, seed=1), objective, block_size=block_size, shift=shift, tokenizer=make_tokenizer()
    )


@pytest.mark.parametrize(
    "arch,objective,shift,block,fmt,family",
    [
        ("llama", "mdm", False, None, "llada", "llada"),
        ("llama", "mdm", True, None, "dream", "dream"),
        ("qwen2", "mdm", True, None, "dream", "dream"),
        ("qwen3", "block", False, 4, "sdar", "sdar"),
        ("qwen3", "idlm", True, 2, "sdar", "idlm"),
    ],
)
def test_export_then_load_gives_identical_logits(tmp_path, arch, objective, shift, block, fmt, family):
    model = _own(arch, objective, shift, block)
    out = tmp_path / "out"
    model.save_pretrained(tmp_path / "dlm")
    assert main(["export", "--model", str(tmp_path / "dlm"), "--format", fmt, "--output", str(out)]) == 0
    back = dlm.load_model(out)
    assert back.hf_config.dlm_family == family and back.spec == model.spec
    allowed = family_attention(family, len(IDS), block)[None, None]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([IDS]), attention_mask=allowed).logits[0]
    assert torch.equal(logits_of(back), want)


def test_a_published_folder_exports_back_to_its_own_files(tmp_path):
    from safetensors.torch import load_file

    for family, writer, fmt in (
        ("llada", write_llada, "llada"),
        ("sdar", write_sdar, "sdar"),
        ("llada2", write_llada2, "llada2"),
        ("sdar_moe", write_sdar_moe, "sdar"),
    ):
        src = writer(tmp_path / family)
        assert main(["export", "--model", str(src), "--format", fmt, "--output", str(tmp_path / f"{family}-out")]) == 0
        a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / f"{family}-out/model.safetensors"))
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
        fa = json.loads((src / "config.json").read_text())
        fb = json.loads((tmp_path / f"{family}-out/config.json").read_text())
        for key in ("model_type", "architectures", "mask_token_id", "vocab_size", "rope_theta", "block_size"):
            assert fa.get(key, fb.get(key)) == fb.get(key), key  # (LLaDA2's own files have no block_size)
        assert torch.equal(logits_of(dlm.load_model(src)), logits_of(dlm.load_model(tmp_path / f"{family}-out")))


def test_export_refusals_leave_no_folder(tmp_path, capsys):
    cases = [
        (_own("qwen2", "mdm", True), "sdar", "Qwen3"),
        (_own("llama", "mdm", True), "llada", "shift"),
        (_own("qwen3", "block", False, 4), "dream", "qwen3"),
        (_own("llama", "idlm", True, 1), "llada", "idlm"),
        (_own("qwen3", "block", False, 4), "llada2", "GLM-4-MoE"),
    ]
    for i, (model, fmt, word) in enumerate(cases):
        model.save_pretrained(tmp_path / f"m{i}")
        capsys.readouterr()
        out = tmp_path / f"out{i}"
        assert main(["export", "--model", str(tmp_path / f"m{i}"), "--format", fmt, "--output", str(out)]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dlm ")]  # no progress bars
        assert len(err) == 1 and "--format" in err[0] and word in err[0], err
        assert not out.exists() and not list(tmp_path.glob(f".out{i}*"))
    (tmp_path / "taken").mkdir()
    assert (
        main(["export", "--model", str(tmp_path / "m0"), "--format", "dream", "--output", str(tmp_path / "taken")]) == 2
    )
    assert "--force" in capsys.readouterr().err


# -- the I-DLM release's LoRA adapter (a PEFT LoRA folder), attached as gated LoRA ------------------------------
def _peft_adapter(model, folder, **extra):
    """A PEFT LoRA adapter for ``model``'s base weights, written by peft itself (random A and B)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(model.hf_config)
    base.load_state_dict(model.base_model_hf.state_dict())
    torch.manual_seed(0)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False, **extra
    )
    peft_model = get_peft_model(base, cfg)
    peft_model.save_pretrained(folder)
    return peft_model.eval()


def test_gated_lora_adapter_acts_on_masks_only(tmp_path):
    from dlm.decode import generate
    from dlm.decode.sampling import SamplingParams
    from dlm.model.families import attach_gated_adapter

    model = dlm.load_model(write_idlm(tmp_path / "idlm", block_size=2))
    peft_model = _peft_adapter(model, tmp_path / "adapter")
    clean = logits_of(model)
    attach_gated_adapter(model, tmp_path / "adapter")
    assert torch.equal(logits_of(model), clean)  # no mask: exactly the base model
    masks = [MASK] * 6
    with torch.no_grad():
        want = peft_model(input_ids=torch.tensor([masks])).logits[0]
    torch.testing.assert_close(logits_of(model, masks), want, atol=2e-5, rtol=1e-5)  # all masks: the adapter's
    assert not torch.allclose(logits_of(model, masks), logits_of(dlm.load_model(tmp_path / "idlm"), masks))
    p = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert [r.token_ids for r in generate(model, [IDS], "isd", p)] == [
        r.token_ids for r in generate(model, [IDS], "ar", p)
    ]
    model.save_pretrained(tmp_path / "saved")  # a dlm folder with dlm_adapter.safetensors
    back = dlm.load_model(tmp_path / "saved")
    assert torch.equal(logits_of(back, masks), logits_of(model, masks))


def test_adapter_folders_that_cannot_be_attached(tmp_path, capsys):
    from dlm.model.families import attach_gated_adapter

    model = dlm.load_model(write_idlm(tmp_path / "idlm"))
    _peft_adapter(model, tmp_path / "dora", use_dora=True)
    with pytest.raises(DLMError, match="'use_dora'"):
        attach_gated_adapter(model, tmp_path / "dora")
    with pytest.raises(DLMError, match="'mdm' model"):
        attach_gated_adapter(dlm.load_model(write_llada(tmp_path / "llada")), tmp_path / "dora")
    assert main(["generate", "--model", str(tmp_path / "dora"), "--prompt", "x", "--decode", "isd"]) == 2
    err = capsys.readouterr().err
    assert "adapter_config.json" in err and "attach_gated_adapter" in err


def test_published_folders_load_without_the_remote_code_question(tmp_path, monkeypatch):
    """config.json's auto_map names remote code: every loader says no to it up front, so transformers never stops
    to ask on the terminal (dlm eval / serve / generate read the tokenizer through load_tokenizer)."""
    from dlm.model.hub import load_tokenizer

    questions = []
    monkeypatch.setattr("builtins.input", lambda *a: questions.append(a) or "n")  # (transformers hides errors)
    for writer in (write_llada, write_llada2):
        folder = writer(tmp_path / writer.__name__)
        assert load_tokenizer(folder).mask_token_id == MASK
        assert load_tokenizer(folder).mask_token_id == dlm.load_model(folder).mask_token_id
    assert questions == []
