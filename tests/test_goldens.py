"""dlm against the published families' own code: tiny checkpoints built and saved by each family's own classes,
with the logits and sampler outputs its own code produced on them (tests/goldens/, README.md there says how).
A family's reference call maps to dlm's settings here; where a call sets nothing, dlm sets nothing either, so the
family defaults dlm applies are what is checked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from published_layouts import _tokenizer
from safetensors.torch import load_file

import dlm
from dlm.decode.engine import Engine
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams

GOLDENS = Path(__file__).parent / "goldens"
MASK_NAMES = {"llada": "<|mdm_mask|>", "llada_moe": "<|mask|>", "dream": "<|mask|>", "sdar": "<|MASK|>"}
MASK_NAMES["llada2"] = "<|mask|>"
FAMILIES = sorted(MASK_NAMES)

pytestmark = pytest.mark.usefixtures("one_thread")


def runs(family: str) -> list[dict]:
    return json.loads((GOLDENS / family / "runs.json").read_text())["runs"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("goldens")
    loaded = {}
    for family in FAMILIES:
        folder = root / family
        shutil.copytree(GOLDENS / family, folder, ignore=shutil.ignore_patterns("runs.json", "forward.safetensors"))
        _tokenizer(folder, MASK_NAMES[family])  # (the goldens carry no tokenizer: the calls are token ids)
        loaded[family] = dlm.load_model(folder)
    return loaded


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_equals_the_familys_own(models, family):
    f = load_file(str(GOLDENS / family / "forward.safetensors"))
    ids = f["input_ids"]
    n = ids.numel()
    allowed = f.get("attention", torch.ones(n, n, dtype=torch.bool))
    with torch.inference_mode():
        logits = models[family](input_ids=ids[None], attention_mask=allowed[None, None]).logits[0].float()
    assert (logits - f["logits"]).abs().max() < 5e-5  # float32, other summation orders (LLaDA and Dream: 0)


def engine_call(family: str, call: dict) -> tuple[str, dict, SamplingParams]:
    """The reference call as dlm settings: the decoder, its options (only those the call gives) and the request."""
    c = dict(call)
    if family in ("llada", "llada_moe"):  # LLaDA's generate.py generate(); temperature 0, low_confidence
        kw = dict(steps=c["steps"], semi_ar_block=c["block_length"])
        if c.get("cfg_scale"):
            kw["cfg_scale"] = c["cfg_scale"]
        return "mdm", kw, SamplingParams(max_new_tokens=c["gen_length"], temperature=0.0, ignore_eos=True)
    if family == "dream":  # diffusion_generate(); temperature 0
        kw = dict(steps=c["steps"], alg=c["alg"])
        if "top_k" in c and c["top_k"] is None:
            kw["dream_top_k"] = 0  # the caller turned Dream's hidden top-k off
        top_p = c.get("top_p")
        return "mdm", kw, SamplingParams(max_new_tokens=c["max_new_tokens"], temperature=0.0, top_p=top_p or 1.0)
    if family == "sdar":  # block_diffusion_generate(); its draw replaced by the argmax, i.e. greedy decoding
        kw = dict(steps=c["denoising_steps"])
        if "remasking_strategy" in c:
            kw["remasking"] = c["remasking_strategy"]
        if "confidence_threshold" in c:
            kw["threshold"] = c["confidence_threshold"]
        return "block", kw, SamplingParams(max_new_tokens=c["gen_length"], temperature=0.0, ignore_eos=True)
    assert family == "llada2"  # LLaDA2MoeModelLM.generate(); its defaults (greedy; its end token is none here)
    kw = {k: c[k] for k in ("steps", "threshold") if k in c}
    return "block", kw, SamplingParams(max_new_tokens=c["gen_length"], temperature=0.0, ignore_eos=True)


# SDAR's own rule that dlm does not follow: in the block holding the prompt's tail, a pass whose quota exceeds the
# masks left takes the top-k of the block with every non-mask at -inf, and writes its proposal at each chosen
# position - the prompt's included; dlm writes the masks and decoded positions it chooses, never the prompt's
SDAR_PROMPT_TAIL = "prompt tail, SDAR overwrites the prompt"


CASES = [(family, r["name"]) for family in FAMILIES for r in runs(family) if r["name"] != SDAR_PROMPT_TAIL]


@pytest.mark.parametrize("family,name", CASES)
def test_sampler_equals_the_familys_own(models, family, name):
    run = next(r for r in runs(family) if r["name"] == name)
    decode, kw, params = engine_call(family, run["call"])
    out = Engine(models[family], decoder=decode, **kw).generate([run["prompt"]], params)[0].token_ids
    assert out == run["output"], (name, run["call"])


def test_batched_requests_equal_the_familys_own_one_by_one(models):
    """The goldens are one request at a time; dlm's engine batches them - the same tokens."""
    for family in ("llada", "dream", "sdar", "llada2"):
        by_call: dict[str, list[dict]] = {}
        for r in runs(family):
            if r["name"] != SDAR_PROMPT_TAIL:
                decode, kw, params = engine_call(family, r["call"])
                by_call.setdefault(json.dumps([decode, kw], sort_keys=True), []).append((r, params))
        for key, group in by_call.items():
            decode, kw = json.loads(key)
            prompts = [r["prompt"] for r, _ in group] * 2
            params = [p for _, p in group] * 2
            results = Engine(models[family], decoder=decode, options=EngineOptions(max_batch_size=3), **kw).generate(
                prompts, params
            )
            assert [res.token_ids for res in results] == [r["output"] for r, _ in group] * 2, (family, key)


def test_sdar_prompt_tail_divergence(models):
    """Where SDAR's own code overwrites a prompt token (docs/models.md), dlm keeps the prompt: the pass that does
    it commits the same token at the mask, and what follows differs, SDAR's later blocks seeing another prompt."""
    run = next(r for r in runs("sdar") if r["name"] == SDAR_PROMPT_TAIL)
    decode, kw, params = engine_call("sdar", run["call"])
    ours = Engine(models["sdar"], decoder=decode, **kw).generate([run["prompt"]], params)[0].token_ids
    p = len(run["prompt"])
    theirs = run["sequence"]
    assert theirs[:p] != run["prompt"]  # SDAR rewrote the prompt
    assert ours[: 4 - p] == run["output"][: 4 - p]  # the block holding the prompt's tail (block 4)
    assert ours != run["output"]
