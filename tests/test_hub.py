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
    if case != "remote code":  # a hub id is spelled like a relative path: the message says neither exists
        assert "(and there is no local folder" in str(e.value)
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
def test_the_cli_downloads_converts_generates_and_evaluates_from_hub_ids(hub, task_data, tmp_path):
    """`dlm convert`, `dlm generate` and `dlm eval` (its data from a dataset repository) in fresh processes
    (HF_ENDPOINT, HF_HOME as a user sets them), then `dlm generate` again with HF_HUB_OFFLINE=1 from the cache."""
    from dlm.eval.tasks import TASKS

    repo, config, split = TASKS["piqa"].HUB
    rows = _hub_records(task_data)["piqa"]
    hub.add(repo, _parquet_repo(tmp_path / "piqa_repo", rows, config, split), "datasets", "refs/convert/parquet")
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
    out_json = tmp_path / "r.json"
    rc, out = dlm(
        "eval",
        "--model",
        "org/tiny",
        "--eval-tasks",
        "piqa",
        "--limit",
        "3",
        "--output",
        str(out_json),
        DLM_HOME=str(tmp_path / "dlm_home"),
    )
    assert rc == 0 and json.loads(out_json.read_text())["results"]["piqa"]["n"] == 3, out
    rc, err = dlm("generate", "--model", "org/nope", "--prompt", "ab")
    assert rc == 2 and "no model repository 'org/nope'" in err and "Traceback" not in err


def _parquet_repo(root: Path, records: list[dict], config: str, split: str) -> Path:
    """A dataset repository's parquet export: ``<config>/<split>/0000.parquet`` (and a second file, as large
    splits have)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = root / config / split
    d.mkdir(parents=True)
    half = max(1, len(records) // 2)
    pq.write_table(pa.Table.from_pylist(records[:half]), d / "0000.parquet")
    if records[half:]:
        pq.write_table(pa.Table.from_pylist(records[half:]), d / "0001.parquet")
    return root


def _hub_records(task_data: str) -> dict[str, list[dict]]:
    """The made-up local records of tests/task_data.py in each hub repository's own fields."""
    from dlm.eval.tasks.base import read_records

    def lines(path):
        return [x.strip() for x in open(path) if x.strip()]

    piqa = read_records(Path(task_data, "piqa", "valid.jsonl"))
    siqa = read_records(Path(task_data, "siqa", "dev.jsonl"))
    wino = read_records(Path(task_data, "winogrande", "winogrande.jsonl"))
    openai = read_records(Path(task_data, "lambada", "lambada_openai.jsonl"))
    return {
        "piqa": [{**r, "label": int(y)} for r, y in zip(piqa, lines(f"{task_data}/piqa/valid-labels.lst"))],
        "siqa": [{**r, "label": y} for r, y in zip(siqa, lines(f"{task_data}/siqa/dev-labels.lst"))],
        "winogrande": [  # the original layout: a blank where the two options go
            {
                "sentence": r["context_options"][0].rsplit(" ", 1)[0] + " _ " + r["continuation"],
                "option1": r["context_options"][0].rsplit(" ", 1)[1],
                "option2": r["context_options"][1].rsplit(" ", 1)[1],
                "answer": str(r["gold"] + 1),
            }
            for r in wino
        ],
        "hellaswag": [
            {
                "ind": 4,
                "activity_label": "Baking bread",
                "ctx_a": "A woman kneads dough on a floured table.",
                "ctx_b": "she",
                "ctx": "A woman kneads dough on a floured table. she",
                "endings": ["paints the table.", "throws the dough.", "shapes the dough into a loaf.", "reads."],
                "source_id": "x",
                "split": "val",
                "split_type": "indomain",
                "label": "2",
            }
        ],
        "lambada": [{"text": r["context"] + r["continuation"]} for r in openai],
    }


def test_eval_data_comes_from_the_hubs_dataset_repositories_when_no_path_is_given(
    hub, task_data, tmp_path, monkeypatch
):
    """Each task's hub source (its parquet export) gives the examples its local files give; written once under
    $DLM_HOME/data, then read from the cache alone offline."""
    from huggingface_hub import constants

    from dlm.eval.tasks import TASKS, lambada, load_task

    monkeypatch.setenv("DLM_HOME", str(tmp_path / "dlm_home"))
    records = _hub_records(task_data)
    for name, rows in records.items():
        repo, config, split = TASKS[name].HUB
        hub.add(repo, _parquet_repo(tmp_path / name, rows, config, split), "datasets", "refs/convert/parquet")
    for name in ("piqa", "siqa", "winogrande"):
        assert load_task(name, None) == load_task(name, task_data), name
    assert load_task("lambada", None) == lambada.load(f"{task_data}/lambada/lambada_openai.jsonl")
    h = load_task("hellaswag", None)[0]
    assert h.context == "Baking bread: A woman kneads dough on a floured table. She" and h.label == 2
    assert h.choices[2] == " shapes the dough into a loaf."
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    before = sum(hub.requests.values())
    assert load_task("piqa", None) == load_task("piqa", task_data) and sum(hub.requests.values()) == before
    # poem reversal has no hub source: the message says which flag to pass
    with pytest.raises(DLMError, match="no data for task 'poem_reverse': .* or --poem-path"):
        load_task("poem_reverse", None)
    # a dataset repository that is not there: one line naming it
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(TASKS["piqa"], "HUB", ("org/no-piqa", "default", "validation"))
    with pytest.raises(DLMError, match="no dataset repository 'org/no-piqa'"):
        load_task("piqa", None)
