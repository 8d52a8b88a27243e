"""`dlm serve --engine vllm` with the real SmolLM2-135M on loopback, through the official `openai` client: greedy
chat equal token for token to `dlm generate --decode ar` for an AR model, a merged I-DLM and a gated-LoRA I-DLM
(served as its base model), with and without a dlm drafter; vLLM's speculative-decoding counters show drafts
proposed and accepted; bad requests get vLLM's 4xx.

Needs vLLM beside dlm (`bash scripts/install_vllm.sh`; found as `dlm serve --engine vllm` finds it) and minutes
of CPU per server start (`--enforce-eager`: about 45 s for this model): skipped, with the reason, without vLLM.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dlm.decode.options import EngineOptions

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Give me three tips for learning to cook.",
]
MAX_TOKENS = 40
KEY = "test-key"


@pytest.fixture(scope="module")
def vllm_ready():
    from dlm.errors import DLMError
    from dlm.serve.vllm import check_vllm, vllm_python

    try:
        python = vllm_python()
        return check_vllm(python)
    except DLMError as e:
        pytest.skip(f"vLLM is not installed beside dlm ({e})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model, *extra, timeout=600):
    """`dlm serve --engine vllm` as a user runs it; yields (base_url, log path)."""
    port = _free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"dlm-vllm-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "dlm.cli",
        "serve",
        "--engine",
        "vllm",
        "--model",
        str(model),
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--served-model-name",
        "smol",
        "--max-model-len",
        "1024",
        "--max-batch-size",
        "8",
        *map(str, extra),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"dlm serve --engine vllm exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > timeout:
                raise AssertionError(f"vLLM did not come up in {timeout} s:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield url, log
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def dlm_ar_reference(model) -> list[list[int]]:
    """What `dlm generate --decode ar --chat --temperature 0` produces for QUESTIONS (token ids)."""
    import json

    import torch

    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import load_any
    from dlm.model.hub import load_model, load_tokenizer, resolve_model_path

    folder = resolve_model_path(model)
    if "dlm_objective" in json.loads((folder / "config.json").read_text()):
        m = load_any(folder)
        tok = m.tokenizer
    else:
        m, tok = load_model(folder), load_tokenizer(folder)
    engine = Engine(m, tok, decoder="ar", options=EngineOptions(max_batch_size=1))
    try:
        out = []
        for q in QUESTIONS:
            text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            ids = tok(text, add_special_tokens=False).input_ids
            with torch.inference_mode():
                r = engine.generate([ids], SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0))[0]
            out.append(list(r.token_ids))
        return out
    finally:
        engine.close()


def chat_all(url) -> list[tuple[str, int]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    out = []
    for q in QUESTIONS:
        r = client.chat.completions.create(
            model="smol", max_tokens=MAX_TOKENS, temperature=0, messages=[{"role": "user", "content": q}]
        )
        out.append((r.choices[0].message.content, r.usage.completion_tokens))
    return out


def assert_same_as_reference(got, ref, tok):
    for (text, n), ids in zip(got, ref):
        eos = tok.eos_token_id
        body = ids[:-1] if ids and ids[-1] == eos else ids  # vLLM counts the eos it stopped on too
        assert text == tok.decode(body, skip_special_tokens=True)
        assert n == len(ids)


def spec_counters(url) -> dict[str, float]:
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for name in (
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
    ):
        vals = re.findall(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
        out[name.split(":")[1]] = sum(map(float, vals))
    return out


@pytest.fixture(scope="module")
def smol(smollm2_path):
    from dlm.model.hub import load_tokenizer

    return smollm2_path, load_tokenizer(smollm2_path)


def test_prompt_lookup_on_vllm_equals_dlm_ar(vllm_ready, smol):
    """``--prompt-lookup K`` becomes vLLM's n-gram speculation: the answers stay AR's, and drafts were proposed."""
    path, tok = smol
    ref = dlm_ar_reference(path)
    with vllm_server("smollm2-135m", "--prompt-lookup", "4", "--prompt-lookup-min", "1") as (url, _log):
        assert_same_as_reference(chat_all(url), ref, tok)
        assert spec_counters(url)["spec_decode_num_draft_tokens"] > 0


def test_ar_model_on_vllm_equals_dlm_ar_and_rejects_bad_requests(vllm_ready, smol):
    path, tok = smol
    ref = dlm_ar_reference(path)
    with vllm_server("smollm2-135m") as (url, _log):
        assert_same_as_reference(chat_all(url), ref, tok)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError):  # vLLM's 400
            client.chat.completions.create(model="smol", max_tokens=-3, messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.NotFoundError):  # an unknown model name: 404
            client.chat.completions.create(
                model="not-served", max_tokens=4, messages=[{"role": "user", "content": "x"}]
            )
        bad_key = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=120)
        with pytest.raises(openai.AuthenticationError):  # --api-key reached vLLM: 401
            bad_key.models.list()
        assert spec_counters(url)["spec_decode_num_drafts"] == 0  # no drafter: no speculation


def test_gated_idlm_serves_its_base_model_with_itself_as_drafter(vllm_ready, smol, tmp_path):
    """A gated-LoRA I-DLM whose adapters are not zero: vLLM must serve the base model (not load the adapter file),
    and the same folder as drafter must propose K = block size + 1 tokens whose first ones get accepted."""
    import torch

    from dlm.model.convert import convert_ar_to_dlm
    from dlm.model.lora import LoraSettings

    path, tok = smol
    gated = convert_ar_to_dlm(
        path, "idlm", block_size=2, lora=LoraSettings(r=4, alpha=4, gated=True, target_modules="q_proj,v_proj")
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for a in gated.gated_lora.adapters.values():
            a.B.copy_(torch.randn(a.B.shape, generator=g) * 1e-3)
    gated.save_pretrained(tmp_path / "gated")
    ref = dlm_ar_reference(path)  # the base model's greedy output
    assert dlm_ar_reference(tmp_path / "gated") == ref  # dlm's own clean path is the base model
    with vllm_server(tmp_path / "gated", "--drafter", tmp_path / "gated") as (url, log):
        assert "(K=3)" in log.read_text()
        assert_same_as_reference(chat_all(url), ref, tok)
        c = spec_counters(url)
    assert c["spec_decode_num_drafts"] > 0 and c["spec_decode_num_draft_tokens"] == 3 * c["spec_decode_num_drafts"]
    assert c["spec_decode_num_accepted_tokens"] > 0


def test_merged_idlm_with_small_drafter_equals_dlm_ar(vllm_ready, smol, tmp_path):
    """A merged (plain) I-DLM folder, vocabulary 49153 with its mask row, served by vLLM with a 2-layer drafter cut
    from the base model and exported by `dlm export --drafter` for it: the output stays dlm's AR output."""
    from dlm.cli import main
    from dlm.model.drafter import truncated_drafter

    path, tok = smol
    assert main(["convert", "--model", str(path), "--objective", "idlm", "--output", str(tmp_path / "idlm")]) == 0
    truncated_drafter(path, 2, block_size=3).save_pretrained(tmp_path / "small")
    assert (
        main(
            [
                "export",
                "--model",
                str(tmp_path / "small"),
                "--drafter",
                "--target",
                str(tmp_path / "idlm"),
                "--output",
                str(tmp_path / "small-drafter"),
            ]
        )
        == 0
    )
    ref = dlm_ar_reference(tmp_path / "idlm")
    with vllm_server(tmp_path / "idlm", "--drafter", tmp_path / "small-drafter") as (url, log):
        assert "(K=4)" in log.read_text()
        assert_same_as_reference(chat_all(url), ref, tok)
        c = spec_counters(url)
    assert c["spec_decode_num_drafts"] > 0
