"""What dlm hands vLLM, checked without vLLM: the folder a gated-LoRA I-DLM is served from (its base model, no
adapter file), drafters exported for vLLM's parallel drafting (gated adapters merged exactly at mask positions,
the mask moved into the target's vocabulary, K = block size + 1), small drafters cut from a target, and the
`dlm serve --engine vllm` / `dlm export --drafter` command lines and errors."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest
import torch

from dlm.cli import main
from dlm.errors import DLMError


def _target_with_spare_token(tiny_model_dir, tmp_path):
    """A tiny target whose tokenizer has a special token chat never uses (as SmolLM2's <empty_output>)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model_dir("llama", tie=True)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_special_tokens({"additional_special_tokens": ["<empty_output>"]})
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    out = tmp_path / "target"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, len(tok), tok.convert_tokens_to_ids("<empty_output>")


def _gated_idlm(target, out, block_size=2, seed=0):
    """A gated-LoRA I-DLM of ``target`` (mask token added past its vocabulary) whose adapters are not zero."""
    from dlm.model.convert import convert_ar_to_dlm
    from dlm.model.lora import LoraSettings

    dlm = convert_ar_to_dlm(
        target, "idlm", block_size=block_size, lora=LoraSettings(r=4, alpha=8, gated=True, target_modules="all-linear")
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a in dlm.gated_lora.adapters.values():
            a.B.copy_(torch.randn(a.B.shape, generator=g) * 0.05)
        dlm.gated_lora.mask_embedding.copy_(torch.randn(dlm.gated_lora.mask_embedding.shape, generator=g))
    dlm.save_pretrained(out)
    return dlm


def test_gated_folder_for_vllm_is_the_base_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from dlm.model.convert import AutoDLMForCausalLM
    from dlm.model.lora import ADAPTER_FILE, CONFIG_KEY
    from dlm.serve.vllm import vllm_model_folder

    target, _, _ = _target_with_spare_token(tiny_model_dir, tmp_path)
    assert vllm_model_folder(target) == target.resolve()  # an AR folder goes as it is
    _gated_idlm(target, tmp_path / "gated")
    served = vllm_model_folder(tmp_path / "gated", cache_root=tmp_path / "cache")
    assert not (served / ADAPTER_FILE).exists()  # vLLM would try to load it as weights
    assert (tmp_path / "gated" / ADAPTER_FILE).is_file()  # the checkpoint itself is untouched
    assert CONFIG_KEY not in json.loads((served / "config.json").read_text())
    assert vllm_model_folder(tmp_path / "gated", cache_root=tmp_path / "cache") == served  # reused
    # a trained folder's checksum list is not carried over: config.json was rewritten, so it would not match
    from dlm.fsutil import CHECKSUMS, write_checksums

    write_checksums(tmp_path / "gated")
    served2 = vllm_model_folder(tmp_path / "gated", cache_root=tmp_path / "cache2")
    assert not (served2 / CHECKSUMS).exists()
    AutoDLMForCausalLM.from_pretrained(served2)  # loads through dlm too, no stale checksum
    # what vLLM reads as plain weights is dlm's clean path exactly
    ids = torch.tensor([[1, 5, 9, 33, 2, 7]])
    clean = AutoDLMForCausalLM.from_pretrained(tmp_path / "gated")
    plain = AutoModelForCausalLM.from_pretrained(served)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, clean(input_ids=ids).logits)
    # `dlm export --format vllm`: a standalone copy of it
    assert (
        main(["export", "--model", str(tmp_path / "gated"), "--format", "vllm", "--output", str(tmp_path / "v")]) == 0
    )
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == sorted(p.name for p in served.iterdir())
    assert not any(p.is_symlink() for p in (tmp_path / "v").iterdir())


def test_exported_drafter_is_the_gated_masks_in_the_targets_vocabulary(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from dlm.model.convert import AutoDLMForCausalLM

    target, vocab, spare = _target_with_spare_token(tiny_model_dir, tmp_path)
    _gated_idlm(target, tmp_path / "gated", block_size=3)
    assert (
        main(
            [
                "export",
                "--model",
                str(tmp_path / "gated"),
                "--drafter",
                "--target",
                str(target),
                "--output",
                str(tmp_path / "drafter"),
            ]
        )
        == 0
    )
    assert "num_speculative_tokens=4" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert cfg["vocab_size"] == vocab and cfg["mask_token_id"] == spare  # vLLM reads mask_token_id
    assert cfg["dlm_drafter"]["num_speculative_tokens"] == 4 and "dlm_gated_lora" not in cfg
    assert not (tmp_path / "drafter" / "dlm_adapter.safetensors").exists()
    drafter = AutoModelForCausalLM.from_pretrained(tmp_path / "drafter")
    assert drafter.get_input_embeddings().weight.shape[0] == vocab
    gated = AutoDLMForCausalLM.from_pretrained(tmp_path / "gated")
    # where every position is a mask, the gated model runs its adapters everywhere: the merged drafter must give
    # the same logits (its mask now carried by the spare token id), over the target's vocabulary
    n = 5
    with torch.no_grad():
        want = gated(input_ids=torch.full((1, n), gated.mask_token_id)).logits[..., :vocab]
        got = drafter(input_ids=torch.full((1, n), spare)).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # without --target: the I-DLM's own vocabulary (its mask row kept where it is)
    assert main(["export", "--model", str(tmp_path / "gated"), "--drafter", "--output", str(tmp_path / "d2")]) == 0
    cfg2 = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert cfg2["vocab_size"] == vocab + 1 and cfg2["mask_token_id"] == vocab


def test_drafter_export_errors_leave_no_output(tiny_model_dir, tmp_path, capsys):
    target, _, _ = _target_with_spare_token(tiny_model_dir, tmp_path)
    # a plain AR folder is no drafter
    assert main(["export", "--model", str(target), "--drafter", "--output", str(tmp_path / "a")]) == 2
    assert "plain causal LM" in capsys.readouterr().err
    # a bidirectional mdm model cannot draft causally
    assert main(["convert", "--model", str(target), "--objective", "mdm", "--output", str(tmp_path / "mdm")]) == 0
    capsys.readouterr()
    assert main(["export", "--model", str(tmp_path / "mdm"), "--drafter", "--output", str(tmp_path / "b")]) == 2
    assert "causal I-DLM" in capsys.readouterr().err
    # a drafter whose vocabulary is not the target's
    _gated_idlm(target, tmp_path / "gated")
    other = tiny_model_dir("qwen2", vocab_size=200)
    assert (
        main(
            [
                "export",
                "--model",
                str(tmp_path / "gated"),
                "--drafter",
                "--target",
                str(other),
                "--output",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    assert "share the tokenizer" in capsys.readouterr().err
    assert (
        main(
            [
                "export",
                "--model",
                str(tmp_path / "gated"),
                "--drafter",
                "--format",
                "sdar",
                "--output",
                str(tmp_path / "d"),
            ]
        )
        == 2
    )
    assert "drop --format" in capsys.readouterr().err
    assert main(["export", "--model", str(tmp_path / "gated"), "--output", str(tmp_path / "e")]) == 2
    assert "--drafter" in capsys.readouterr().err
    for name in "abcde":
        assert not (tmp_path / name).exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind


def test_truncated_drafter_is_the_targets_first_layers(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from dlm.model.drafter import truncated_drafter

    folder = tiny_model_dir("qwen2", layers=4, tie=True)
    full = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(DLMError, match="--layers must be in 1..4"):
        truncated_drafter(folder, 5)
    small2 = truncated_drafter(folder, 2, block_size=2, mask_token="<pad>")
    ids = torch.tensor([[1, 5, 9, 33, 2, 7]])
    with torch.no_grad():
        h = full(input_ids=ids, output_hidden_states=True).hidden_states[2]  # after the first 2 layers
        want = full.lm_head(full.model.norm(h))
        got = small2(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    small2.save_pretrained(tmp_path / "small2")  # the saved drafter holds 2 layers' weights, not the target's 4
    from safetensors import safe_open

    with safe_open(str(tmp_path / "small2" / "model.safetensors"), "pt") as fh:
        layers = {k.split(".")[2] for k in fh.keys() if k.startswith("model.layers.")}
    assert layers == {"0", "1"}
    target, vocab, spare = _target_with_spare_token(tiny_model_dir, tmp_path)
    small = truncated_drafter(target, 1, block_size=2)
    assert small.mask_token_id == spare and small.hf_config.num_hidden_layers == 1  # in the target's vocabulary
    assert small.base_model_hf.get_input_embeddings().weight.shape[0] == vocab


def _fake_vllm_python(tmp_path):
    """A Python that imports a stand-in `vllm` package (for the command line only; nothing is served)."""
    pkg = tmp_path / "fakevllm" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.0-fake'\n")
    script = tmp_path / "python-with-vllm"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={pkg.parent} exec {sys.executable} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_serve_engine_vllm_command_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    target, _, _ = _target_with_spare_token(tiny_model_dir, tmp_path)
    _gated_idlm(target, tmp_path / "gated", block_size=2)
    monkeypatch.setenv("DLM_HOME", str(tmp_path / "home"))
    py = _fake_vllm_python(tmp_path)
    assert (
        main(
            [
                "serve",
                "--engine",
                "vllm",
                "--vllm-python",
                py,
                "--model",
                str(tmp_path / "gated"),
                "--drafter",
                str(tmp_path / "gated"),
                "--host",
                "127.0.0.2",
                "--port",
                "8123",
                "--api-key",
                "s3cret",
                "--served-model-name",
                "smol",
                "--print-command",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "s3cret" not in out  # the key is never printed
    serve_line = next(line for line in out.splitlines() if "same as  vllm serve " in line)
    args = serve_line.split("same as  vllm serve ", 1)[1].split()
    served = args[0]
    assert served.startswith(str(tmp_path / "home")) and not os.path.exists(
        os.path.join(served, "dlm_adapter.safetensors")
    )
    assert args[args.index("--host") + 1] == "127.0.0.2" and args[args.index("--port") + 1] == "8123"
    assert args[args.index("--served-model-name") + 1] == "smol" and "--api-key" in args
    spec = json.loads(args[args.index("--speculative-config") + 1].strip("'"))
    assert spec["method"] == "draft_model" and spec["parallel_drafting"] is True
    assert spec["num_speculative_tokens"] == 3  # block size 2 + 1
    assert json.loads(open(os.path.join(spec["model"], "config.json")).read())["dlm_drafter"]
    runs = next(line for line in out.splitlines() if "runs  " in line)
    assert "-m vllm.entrypoints.openai.api_server --model " + served in runs and "--enforce-eager" in runs
    assert "--no-enable-prefix-caching" not in runs  # vLLM's own prefix cache, on as dlm's is
    assert "--enable-auto-tool-choice" not in runs  # this chat template shows no tool-call format
    # K given by hand
    assert (
        main(
            [
                "serve",
                "--engine",
                "vllm",
                "--vllm-python",
                py,
                "--model",
                str(target),
                "--drafter",
                str(tmp_path / "gated"),
                "--num-speculative-tokens",
                "2",
                "--prefix-cache-tokens",
                "0",
                "--tool-call-parser",
                "hermes",
                "--print-command",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert '"num_speculative_tokens":2' in out and "--no-enable-prefix-caching" in out  # --prefix-cache-tokens 0
    assert "--enable-auto-tool-choice --tool-call-parser hermes" in out  # tool_choice "auto" read by vLLM's parser
    # prompt lookup: vLLM's n-gram speculation with the same settings
    assert (
        main(
            ["serve", "--engine", "vllm", "--vllm-python", py, "--model", str(target), "--prompt-lookup", "3"]
            + ["--prompt-lookup-min", "1", "--print-command"]
        )
        == 0
    )
    out = capsys.readouterr().out
    spec = json.loads(next(a for a in out.split("same as  vllm serve ", 1)[1].split() if a.startswith("'{")).strip("'"))
    assert spec == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    assert "with prompt lookup (K=3)" in out
    both = ["--prompt-lookup", "3", "--drafter", str(tmp_path / "gated"), "--print-command"]
    assert main(["serve", "--engine", "vllm", "--vllm-python", py, "--model", str(target), *both]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_serve_engine_vllm_errors(tiny_model_dir, tmp_path, capsys, monkeypatch):
    target, _, _ = _target_with_spare_token(tiny_model_dir, tmp_path)
    monkeypatch.setenv("DLM_HOME", str(tmp_path / "home"))
    # this test's Python has no vLLM (the dev environment never gets it): the message says what to run
    monkeypatch.setenv("DLM_VLLM_PYTHON", sys.executable)
    if os.system(f"{sys.executable} -c 'import vllm' 2>/dev/null") == 0:
        pytest.skip("this Python has vLLM")
    assert main(["serve", "--engine", "vllm", "--model", str(target), "--print-command"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (progress bars of the folder written before it)
    assert err.startswith("dlm serve: error: vLLM does not import") and "scripts/install_vllm.sh" in err
    monkeypatch.setenv("DLM_VLLM_PYTHON", str(tmp_path / "nope" / "python"))
    assert main(["serve", "--engine", "vllm", "--model", str(target)]) == 2
    assert "DLM_VLLM_PYTHON" in capsys.readouterr().err
    # flags of the other engine
    py = _fake_vllm_python(tmp_path)
    assert main(["serve", "--engine", "vllm", "--vllm-python", py, "--model", str(target), "--decode", "isd"]) == 2
    assert "--decode isd runs on dlm's engine only" in capsys.readouterr().err
    assert main(["serve", "--engine", "vllm", "--vllm-python", py, "--model", str(target), "--stride", "3"]) == 2
    assert "--stride" in capsys.readouterr().err
    vllm_flags = ["serve", "--engine", "vllm", "--vllm-python", py, "--model", str(target)]
    assert main([*vllm_flags, "--reasoning-parser", "think"]) == 2
    assert "--vllm-arg=--reasoning-parser=qwen3" in capsys.readouterr().err
    assert main([*vllm_flags, "--max-queue", "8"]) == 2
    assert "--max-queue is dlm's engine's" in capsys.readouterr().err
    assert main(["serve", "--model", str(target), "--drafter", str(target)]) == 2
    assert "--drafter goes with --engine vllm" in capsys.readouterr().err
    assert (
        main(
            [
                "serve",
                "--engine",
                "vllm",
                "--vllm-python",
                py,
                "--model",
                str(target),
                "--drafter",
                str(target),
                "--print-command",
            ]
        )
        == 2
    )
    assert "plain causal LM" in capsys.readouterr().err


def test_cli_convert_layers_cuts_a_drafter(tiny_model_dir, tmp_path, capsys):
    target, vocab, spare = _target_with_spare_token(tiny_model_dir, tmp_path)
    assert (
        main(
            [
                "convert",
                "--model",
                str(target),
                "--objective",
                "idlm",
                "--block-size",
                "2",
                "--layers",
                "1",
                "--output",
                str(tmp_path / "cut"),
            ]
        )
        == 0
    )
    assert f"mask_token_id={spare}" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "cut" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == vocab and cfg["block_size"] == 2
    assert (
        main(
            [
                "convert",
                "--model",
                str(target),
                "--objective",
                "mdm",
                "--layers",
                "1",
                "--output",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )
    assert "--layers cuts a drafter" in capsys.readouterr().err and not (tmp_path / "bad").exists()
