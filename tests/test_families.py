"""The families registry: every published layout is recognised by exactly one family, the commands' export formats
are the registry's, and adding a family is one module plus one registry line - shown by a toy family defined and
registered in this test alone, loaded, decoded and exported back."""

from __future__ import annotations

import json

import pytest
import torch
from published_layouts import WRITERS, write_sdar_moe

from dlm.model import families
from dlm.model.families.base import Family, names_of
from dlm.testing import save_tiny, save_tiny_diffusion_gemma


def test_each_published_layout_is_recognised_by_exactly_one_family(tmp_path):
    folders = {name: write(tmp_path / name) for name, write in WRITERS.items()}
    folders["sdar"] = write_sdar_moe(tmp_path / "sdar_moe")  # SDAR-MoE is read as the sdar family
    folders["diffusion_gemma"] = save_tiny_diffusion_gemma(tmp_path / "dg")
    for name, folder in folders.items():
        fields = families.read_fields(folder)
        accepting = [f.name for f in families.REGISTRY if f.recognise(fields)]
        assert accepting == [name], (name, accepting)
        info = families.inspect_folder(folder)
        assert info.family is families.get(name) and info.objective == info.family.objective
    plain = families.inspect_folder(save_tiny(tmp_path / "ar"))
    assert plain.family is None and plain.objective is None and not plain.is_dlm


def test_the_export_command_offers_the_registry_s_formats():
    from dlm.commands.export import FORMATS
    from dlm.model.export import formats

    assert set(FORMATS) == set(formats()) | {"vllm"}


# -- a toy family, defined here only ------------------------------------------------------------------------
TOY = "toy_mdm"


def _toy_to_llama(name: str) -> str:
    return name.replace("toy.", "model.", 1) if name.startswith("toy.") else name


def _toy_config(fields: dict, path):
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in fields["body"].items()})


def _toy_writer(dlm):
    """The toy layout back: Llama's weights under ``toy.``, the Llama config under ``body``."""
    state = {k.replace("model.", "toy.", 1): v.detach().contiguous() for k, v in dlm.base_model_hf.state_dict().items()}
    body = {k: v for k, v in dlm.hf_config.to_dict().items() if not k.startswith("dlm_") and k not in TOY_DROP}
    fields = {"model_type": TOY, "body": body, "mask_token_id": dlm.mask_token_id}
    return fields, state, None


TOY_DROP = {"architectures", "model_type", "mask_token_id", "shift", "block_size", "transformers_version", "dtype"}


def _write_toy(tmp_path) -> tuple:
    from transformers import AutoModelForCausalLM

    src = save_tiny(tmp_path / "src", "llama", vocab_size=320)
    model = AutoModelForCausalLM.from_pretrained(src)
    folder = tmp_path / "toy"
    folder.mkdir()
    from safetensors.torch import save_file

    save_file(
        {k.replace("model.", "toy.", 1): v.contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
    )
    body = {k: v for k, v in model.config.to_dict().items() if k not in TOY_DROP}
    (folder / "config.json").write_text(json.dumps({"model_type": TOY, "body": body}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((src / name).read_bytes())
    return folder, model


@pytest.fixture
def toy_family():
    family = Family(
        name=TOY,
        title="Toy",
        objective="mdm",
        shift=True,
        attention="bidirectional",
        recognise=lambda fields: TOY in names_of(fields),
        mask_id=7,
        config=_toy_config,
        rename=lambda state, folder, config: {_toy_to_llama(k): v for k, v in state.items()},
        export=("toy", _toy_writer),
    )
    saved = list(families.REGISTRY)
    families.register(family)
    yield family
    families.REGISTRY[:] = saved


def test_a_new_family_is_one_record_loads_decodes_and_exports(toy_family, tmp_path):
    from dlm.decode import generate
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import load_any
    from dlm.model.export import export_model

    folder, llama = _write_toy(tmp_path)
    dlm = load_any(folder)
    assert dlm.hf_config.dlm_family == TOY and dlm.objective == "mdm" and dlm.mask_token_id == 7 and dlm.shift
    ids = torch.tensor([[5, 6, 9, 11]])
    with torch.no_grad():  # the family's attention (bidirectional) applied when no mask is given
        full = torch.ones(1, 1, 4, 4, dtype=torch.bool)
        torch.testing.assert_close(dlm(input_ids=ids).logits, llama(input_ids=ids, attention_mask=full).logits)
    out = generate(dlm, [[5, 6, 9]], "mdm", SamplingParams(max_new_tokens=4, seed=0))[0]
    assert len(out.token_ids) == 4
    export_model(dlm, tmp_path / "back", "toy")
    again = load_any(tmp_path / "back")
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, dlm(input_ids=ids).logits, rtol=0, atol=0)
    again_out = generate(again, [[5, 6, 9]], "mdm", SamplingParams(max_new_tokens=4, seed=0))[0]
    assert again_out.token_ids == out.token_ids


def test_unregistered_the_toy_folder_is_not_a_dlm(tmp_path):
    folder, _ = _write_toy(tmp_path)
    assert families.inspect_folder(folder).family is None
