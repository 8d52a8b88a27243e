"""CUDA checks (marked ``gpu``; skipped without CUDA; run with ``pytest -m gpu``).

What a GPU user relies on and CPU CI cannot show: flex-attention training equals SDPA training (loss and
gradients), ISD greedy == AR greedy on CUDA kernels, and a bf16 training run on CUDA with flex attention,
gated LoRA, a checkpoint and an exact resume.
"""

import json

import pytest
import torch

from dlm.decode.options import EngineOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_objectives_under_flex_equal_sdpa_with_gradients():
    from test_flex import objective_parity

    for name, ls, lf, diff, scale in objective_parity("cuda", grads=True):
        assert lf == pytest.approx(ls, abs=2e-4, rel=1e-4), name
        assert scale > 0 and diff <= 1e-3 * scale + 1e-6, (name, diff, scale)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_isd_greedy_equals_ar_greedy_on_cuda(arch):
    from dlm import convert_ar_to_dlm
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.testing import make_model, make_tokenizer

    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]
    dlm = convert_ar_to_dlm(make_model(arch, seed=1), "idlm", block_size=3, tokenizer=make_tokenizer()).to("cuda")
    params = SamplingParams(max_new_tokens=14, ignore_eos=True)
    ar = [
        r.token_ids
        for r in Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=4)).generate(prompts, params)
    ]
    for stride in (2, 3, 4):
        batch = Engine(dlm, decoder="isd", stride=stride, options=EngineOptions(max_batch_size=3)).generate(
            prompts, params
        )
        assert [r.token_ids for r in batch] == ar, (arch, stride)


def test_gqa_decode_attention_equals_sdpa_on_cuda():
    """dlm_sdpa's packed-query form (the one CUDA takes) gives transformers' sdpa logits."""
    from test_decode_engine import gqa_parity

    ref, got = gqa_parity("cuda")
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _chat(path, n=48):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "response": f"The answer is {2 * i}."}) + "\n")
    return path


def test_bf16_flex_gated_lora_run_on_cuda_resumes_exactly(tmp_path, monkeypatch):
    """bf16 autocast + flex attention + gated LoRA on CUDA: the run trains (finite, falling loss), the base weights
    come back unchanged, and a run stopped at step 3 and resumed reaches step 6 with the same losses as the
    uninterrupted run."""
    from safetensors.torch import load_file

    from dlm.config import load_config
    from dlm.testing import save_tiny
    from dlm.train.loop import train

    monkeypatch.setenv("DLM_DEVICE", "cuda")
    model = save_tiny(tmp_path / "tiny")
    data = _chat(tmp_path / "chat.jsonl")

    def cfg(out, **over):
        base = {
            "model": str(model),
            "data": str(data),
            "output_dir": str(out),
            "objective": "idlm",
            "block_size": 2,
            "seq_length": 64,
            "batch_size": 4,
            "max_train_steps": 6,
            "learning_rate": 1e-3,
            "lora_r": 4,
            "gated_lora": True,
            "mixed_precision": "bf16",
            "attn_impl": "flex_attention",
            "save_every": 3,
            "train.progress": False,
        }
        base.update(over)
        return load_config(None, base)

    full = train(cfg(tmp_path / "full"))
    assert full.step == 6 and all(torch.isfinite(torch.tensor(full.losses)))
    log = [json.loads(x) for x in (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()]
    assert any(r.get("device", "").startswith("cuda") for r in log)
    base = load_file(model / "model.safetensors")
    saved = load_file(tmp_path / "full" / "model.safetensors")
    same = [k for k in base if k in saved and base[k].shape == saved[k].shape]
    assert same and all(torch.equal(base[k], saved[k]) for k in same)

    from dlm.errors import DLMError
    from dlm.objectives import get_objective

    real = get_objective("idlm", block_size=2)

    def interrupted(m, batch, step, generator=None):  # the run dies in its 4th step, after the step-3 checkpoint
        out = real(m, batch, step, generator)
        if step == 3:
            out.loss = out.loss * float("nan")
        return out

    part = tmp_path / "part"
    with pytest.raises(DLMError, match="non-finite"):
        train(cfg(part), objective=interrupted)
    resumed = train(cfg(part, resume="auto"))
    assert resumed.step == 6
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses[3:]), rtol=2e-3, atol=2e-3)
