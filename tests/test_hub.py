"""Hub ids (`org/name`, `@revision`, `--revision`) through huggingface_hub, against a hub served on loopback by the
test (tests/loopback_hub.py): download into the standard cache, load through every entry point, the cache alone
under HF_HUB_OFFLINE, and one clear line naming the repository for 401 / 403 / 404 / a bad revision / no network /
offline with nothing cached. No remote code: Python files never come down, and a model only its own code defines
is refused by name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loopback_hub import TOKEN, LoopbackHub

from dlm.errors import DLMError
from dlm.model import hub as hub_mod

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_model_dir):
    """A loopback hub holding org/tiny (a tiny Llama with a stray modeling file), pointed at by this process's
    huggingface_hub, with an empty cache of its own."""
    from huggingface_hub import constants

    folder = tiny_model_dir("llama")
    (folder / "modeling_evil.py").write_text("raise SystemExit('remote code ran')\n")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no_token"))
    with LoopbackHub() as h:
        h.sha = h.add("org/tiny", folder)
        h.folder = folder
        h.patch(monkeypatch)
        yield h


def _logits(model, ids=(1, 5, 9, 3)):
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits


def test_a_hub_id_downloads_once_into_the_cache_and_loads_as_the_folder_does(hub, tmp_path):
    from dlm.model.hub import load_model, load_tokenizer, resolve_model_path

    folder = resolve_model_path("org/tiny")
    assert folder.is_relative_to(tmp_path / "hf_cache") and folder.name == hub.sha
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    assert not (folder / "modeling_evil.py").exists()  # no Python file comes down
    torch.testing.assert_close(_logits(load_model("org/tiny")), _logits(load_model(hub.folder)), rtol=0, atol=0)
    assert load_tokenizer("org/tiny").encode("ab") == load_tokenizer(hub.folder).encode("ab")
    # @revision: the commit and the branch name give the same snapshot; a second resolve downloads nothing
    downloads = sum(n for p, n in hub.requests.items() if "/resolve/" in p)
    assert resolve_model_path(f"org/tiny@{hub.sha}") == folder == resolve_model_path("org/tiny@main")
    assert sum(n for p, n in hub.requests.items() if "/resolve/" in p) == downloads


def test_every_python_entry_point_takes_a_hub_id(hub, tmp_path):
    from dlm import AutoDLMForCausalLM, convert_ar_to_dlm
    from dlm.model.convert import load_any

    dlm = convert_ar_to_dlm("org/tiny", "idlm")
    local = convert_ar_to_dlm(hub.folder, "idlm")
    torch.testing.assert_close(_logits(dlm), _logits(local), rtol=0, atol=0)
    dlm.save_pretrained(tmp_path / "dlm_folder")
    hub.add("org/tiny-dlm", tmp_path / "dlm_folder")
    again = AutoDLMForCausalLM.from_pretrained("org/tiny-dlm")
    torch.testing.assert_close(_logits(again), _logits(dlm), rtol=0, atol=0)
    assert type(load_any("org/tiny", "idlm")).__name__ == "DiffusionLM"


def test_offline_uses_the_cache_and_says_what_is_missing(hub, monkeypatch):
    from huggingface_hub import constants

    from dlm.model.hub import load_model, resolve_model_path

    folder = resolve_model_path("org/tiny")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = sum(hub.requests.values())
    assert resolve_model_path("org/tiny") == folder and load_model("org/tiny") is not None
    assert sum(hub.requests.values()) == before  # not one request
    hub.add("org/other", hub.folder)
    with pytest.raises(DLMError, match=r"'org/other' is not in the Hugging Face cache .* HF_HUB_OFFLINE is set"):
        resolve_model_path("org/other")


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", r"no model repository 'org/nope' on http://127\.0\.0\.1:\d+: check the name"),
        ("private", r"'org/secret' on .* is private or does not exist: log in \(`hf auth login`\) or set HF_TOKEN"),
        ("gated", r"'org/gated' on .* is gated: accept its conditions"),
        ("revision", r"'org/tiny' on .* has no revision 'v9'"),
        ("unreachable", r"could not reach http://127\.0\.0\.1:\d+ to download 'org/tiny'.*check the network"),
        ("remote code", r"'.*' needs its own Python code \(config.json auto_map, model_type 'weird'.*LLaDA, Dream"),
    ],
)
def test_each_failure_is_one_line_naming_the_repository(hub, monkeypatch, tmp_path, case, message):
    from dlm.model.hub import load_model, resolve_model_path

    name = {"missing": "org/nope", "private": "org/secret", "gated": "org/gated", "revision": "org/tiny@v9"}
    name.update({"unreachable": "org/tiny", "remote code": "org/weird"})
    hub.add("org/secret", hub.folder)
    hub.private.add("org/secret")
    hub.add("org/gated", hub.folder)
    hub.gated.add("org/gated")
    weird = tmp_path / "weird"
    weird.mkdir()
    config = json.loads((hub.folder / "config.json").read_text())
    config.update(model_type="weird", auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (weird / "config.json").write_text(json.dumps(config))
    hub.add("org/weird", weird)
    if case == "unreachable":
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        LoopbackHub.patch(type("H", (), {"url": f"http://127.0.0.1:{port}"})(), monkeypatch)
    with pytest.raises(DLMError, match=message) as e:
        load_model(name[case])
    assert "\n" not in str(e.value)
    if case in ("private", "gated"):  # the token opens them
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        assert resolve_model_path(name[case]).is_dir()


def test_revision_flag_pins_the_model_and_is_refused_without_a_hub_id():
    from dlm.cli import build_parser, main

    needs = {
        "generate": ["--prompt", "p"],
        "convert": ["--objective", "idlm", "--output", "o"],
        "export": ["--output", "o"],
    }
    for cmd in ("generate", "serve", "eval", "convert", "export", "quickstart"):
        argv = [cmd, "--model", "org/x", "--revision", "v1", *needs.get(cmd, [])]
        assert build_parser().parse_args(argv).revision == "v1", cmd
    assert hub_mod.with_revision("org/x", "v1") == "org/x@v1" and hub_mod.with_revision("org/x@a", "b") == "org/x@b"
    assert main(["generate", "--model", "smollm2-135m", "--revision", "v1", "--prompt", "p"]) == 2
    with pytest.raises(DLMError, match="--revision v1: 'smollm2-135m' is not a hub id"):
        hub_mod.with_revision("smollm2-135m", "v1")


@pytest.mark.integration
def test_the_cli_downloads_converts_and_generates_from_a_hub_id(hub, tmp_path):
    """`dlm convert` and `dlm generate` in fresh processes (HF_ENDPOINT, HF_HOME as a user sets them), then
    `dlm generate` again with HF_HUB_OFFLINE=1 from the cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf_home"), HF_TOKEN_PATH=str(tmp_path / "no_token"))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")

    def dlm(*argv, **extra):
        r = subprocess.run(
            [sys.executable, "-m", "dlm.cli", *argv], env={**env, **extra}, capture_output=True, text=True, timeout=300
        )
        return r.returncode, r.stdout + r.stderr

    rc, out = dlm(
        "convert",
        "--model",
        "org/tiny",
        "--revision",
        hub.sha,
        "--objective",
        "idlm",
        "--output",
        str(tmp_path / "conv"),
    )
    assert rc == 0 and (tmp_path / "conv" / "config.json").is_file(), out
    gen = ("generate", "--model", "org/tiny", "--prompt", "ab", "--max-new-tokens", "3", "--decode", "ar")
    rc, online = dlm(*gen)
    assert rc == 0, online
    rc, offline = dlm(*gen, HF_HUB_OFFLINE="1")
    text = [ln for ln in online.splitlines() if not ln.startswith("---")]  # the stats line has a speed in it
    assert rc == 0 and [ln for ln in offline.splitlines() if not ln.startswith("---")] == text, (online, offline)
    rc, err = dlm("generate", "--model", "org/nope", "--prompt", "ab")
    assert rc == 2 and "no model repository 'org/nope'" in err and "Traceback" not in err
