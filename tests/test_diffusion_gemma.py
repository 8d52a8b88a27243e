"""DiffusionGemma (uniform-noise block diffusion) against transformers' own code, on tiny random checkpoints built
here: the forward (encoder scores of the context and decoder scores of a canvas), the sampler (its ``generate``,
token for token with the same seed), batching, loading a folder, and the refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from dlm.decode.engine import Engine
from dlm.decode.sampling import SamplingParams
from dlm.errors import DLMError
from dlm.model.convert import convert_ar_to_dlm
from dlm.model.families.diffusion_gemma import wrap
from dlm.testing import make_diffusion_gemma, make_model, make_tokenizer, save_tiny_diffusion_gemma

pytest.importorskip("transformers.models.diffusion_gemma")
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig  # noqa: E402

from dlm.decode.options import EngineOptions

EOS, PAD = 0, 3
CONFIGS = {
    # a window shorter than the prompts (the sliding layers' cut), 2 of 4 experts per token
    "window": dict(window=6, canvas=4),
    # another layer pattern (full attention first), one expert per token, a longer canvas
    "full-first": dict(
        window=5, canvas=6, layer_types=("full_attention", "sliding_attention", "full_attention"), experts=3, top_k=1
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = make_diffusion_gemma(seed=1, **CONFIGS[request.param])
    return hf, wrap(hf)


def _reference(hf, prompt: list[int], seed: int, n: int, **settings) -> list[int]:
    torch.manual_seed(seed)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=EOS, pad_token_id=PAD, **settings)
    return out.sequences[0, len(prompt) :].tolist()


def _until_stop(tokens: list[int], n: int) -> list[int]:
    out = tokens[:n]
    return out[: out.index(EOS) + 1] if EOS in out else out


def test_logits_equal_transformers_forward_on_context_and_canvas(pair):
    hf, dlm = pair
    lm = dlm.renoise
    c = hf.config.canvas_length
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 300, (2, 9), generator=gen)
    canvas = torch.randint(4, 300, (2, c), generator=gen)
    previous = torch.randn(2, c, hf.config.text_config.vocab_size, generator=gen)
    with torch.no_grad():
        want = hf(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=previous).logits
        enc = hf.model.encoder(input_ids=prompt).last_hidden_state
        cap = hf.config.text_config.final_logit_softcapping
        want_ctx = torch.tanh(hf.lm_head(enc).float() / cap) * cap
        ids = torch.cat([prompt, canvas], dim=1)
        soft = torch.zeros(2, ids.shape[1], hf.config.text_config.hidden_size)
        soft[:, 9:] = lm.soft_embeddings(previous)
        got = lm(ids, canvas_from=torch.tensor([9, 9]), soft=soft).logits
        plain = lm(ids, canvas_from=torch.tensor([9, 9])).logits  # no self-conditioning: a first step
        want_plain = hf(input_ids=prompt, decoder_input_ids=canvas).logits
    torch.testing.assert_close(got[:, 9:], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[:, :9], want_ctx, rtol=0, atol=1e-5)
    torch.testing.assert_close(plain[:, 9:], want_plain, rtol=0, atol=1e-5)


SETTINGS = [
    ({"max_denoising_steps": 5}, {"steps": 5}),
    (
        {"max_denoising_steps": 4, "t_min": 0.2, "t_max": 1.3, "sampler_config": EntropyBoundSamplerConfig(1.5)},
        {"steps": 4, "t_min": 0.2, "t_max": 1.3, "entropy_bound": 1.5},
    ),
    # cold, every position accepted, confident at once (above the uniform entropy): the canvas stops as soon as
    # its argmax repeats
    (
        {
            "max_denoising_steps": 12,
            "t_min": 0.01,
            "t_max": 0.02,
            "sampler_config": EntropyBoundSamplerConfig(100.0),
            "stability_threshold": 1,
            "confidence_threshold": 6.0,
        },
        {
            "steps": 12,
            "t_min": 0.01,
            "t_max": 0.02,
            "entropy_bound": 100.0,
            "stability_threshold": 1,
            "confidence_threshold": 6.0,
        },
    ),
]


@pytest.mark.parametrize("setting", range(len(SETTINGS)), ids=["default", "schedule+bound", "early-stop"])
def test_generate_equals_transformers_token_for_token(pair, setting):
    hf, dlm = pair
    theirs, ours = SETTINGS[setting]
    engine = Engine(dlm, None, decoder="renoise", **ours)
    early = 0
    for length, seed, n in itertools.product((3, 11), (0, 7), (3, 17)):
        prompt = [4 + (7 * i) % 290 for i in range(length)]
        result = engine.generate([prompt], SamplingParams(max_new_tokens=n, seed=seed))[0]
        assert result.token_ids == _until_stop(_reference(hf, prompt, seed, n, **theirs), n), (length, seed, n)
        steps = result.stats.canvas_steps
        assert steps and all(1 <= s <= ours["steps"] for s in steps)
        early += sum(s < ours["steps"] for s in steps)
    if setting == 2:
        assert early > 0  # the stopping rule was exercised


def test_batched_rows_equal_one_request_at_a_time(pair):
    _, dlm = pair
    engine = Engine(dlm, None, decoder="renoise", steps=4, options=EngineOptions(max_batch_size=3))
    prompts = [[5, 6, 7], list(range(10, 23)), [40, 41, 42, 43, 44, 45]]
    params = SamplingParams(max_new_tokens=13, seed=11)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    assert [r.token_ids for r in engine.generate(prompts, params)] == alone
    # joining a running batch (continuous batching) changes nothing either
    rid = engine.add(prompts[0], params)
    engine.step()
    later = [engine.add(p, params) for p in prompts[1:]]
    while engine.has_unfinished():
        engine.step()
    assert [engine.pop_result(r).token_ids for r in [rid, *later]] == alone


def test_tokens_stream_a_committed_canvas_at_a_time(pair):
    hf, dlm = pair
    c = hf.config.canvas_length
    engine = Engine(dlm, None, decoder="renoise", steps=3)
    rid = engine.add([5, 6, 7], SamplingParams(max_new_tokens=2 * c + 1, seed=0, ignore_eos=True))
    pieces = []
    while engine.has_unfinished():
        pieces += [len(e.new_token_ids) for e in engine.step() if e.request_id == rid and e.new_token_ids]
    assert pieces == [c, c, 1]


def test_folder_loads_as_the_family_with_its_generation_settings(tmp_path):
    from dlm.decode import generate
    from dlm.model.convert import load_any

    folder = save_tiny_diffusion_gemma(
        tmp_path / "dg",
        seed=2,
        generation={
            "max_denoising_steps": 3,
            "sampler_config": {"entropy_bound": 0.7, "_cls_name": "EntropyBoundSamplerConfig"},
        },
    )
    dlm = load_any(folder)
    assert dlm.objective == "renoise" and dlm.block_size == 4 and dlm.hf_config.dlm_family == "diffusion_gemma"
    hf = make_diffusion_gemma(seed=2)
    prompt = dlm.tokenizer("The quick brown fox")["input_ids"]
    out = generate(dlm, [prompt], "renoise", SamplingParams(max_new_tokens=9, seed=4))[0]
    theirs = _reference(hf, prompt, 4, 9, max_denoising_steps=3, sampler_config=EntropyBoundSamplerConfig(0.7))
    assert out.token_ids == _until_stop(theirs, 9)
    assert all(s <= 3 for s in out.stats.canvas_steps)


def test_refusals_name_the_setting(pair):
    _, dlm = pair
    engine = Engine(dlm, None, decoder="renoise")
    with pytest.raises(
        DLMError, match=r"logprobs: not with --decode \w+, which commits tokens out of order.*a left-to-right decoder"
    ):
        engine.add([5, 6], SamplingParams(max_new_tokens=4, logprobs=1))
    with pytest.raises(DLMError, match="logit_bias"):
        engine.add([5, 6], SamplingParams(max_new_tokens=4, logit_bias={5: 1.0}))
    with pytest.raises(DLMError, match="static"):
        Engine(dlm, None, decoder="renoise", options=EngineOptions(static_cache=True))
    with pytest.raises(DLMError, match="--t-max"):
        Engine(dlm, None, decoder="renoise", t_min=0.9, t_max=0.5)
    with pytest.raises(DLMError, match="renois"):
        Engine(convert_ar_to_dlm(make_model(), "mdm", tokenizer=make_tokenizer()), None, decoder="renoise")


def test_multiple_choice_scores_with_the_encoder_s_next_token_likelihood(pair):
    from dlm.eval.scoring import as_eval_model, loglikelihoods

    hf, dlm = pair
    em = as_eval_model(dlm, tokenizer=make_tokenizer())
    assert em.kind == "causal"
    ctx, cont = [5, 9, 14, 20, 30, 31, 40, 41], [50, 60, 70]  # longer than the sliding window
    (got, _), (short, _) = loglikelihoods(em, [(ctx, cont), (ctx[:3], cont)])
    with torch.no_grad():
        ids = torch.tensor([ctx + cont[:-1]])
        h = hf.model.encoder(input_ids=ids).last_hidden_state
        cap = hf.config.text_config.final_logit_softcapping
        logp = (torch.tanh(hf.lm_head(h).float() / cap) * cap).log_softmax(-1)[0]
    want = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    assert got == pytest.approx(want, abs=1e-4) and got != pytest.approx(short, abs=1e-3)


@pytest.mark.integration
def test_served_chat_and_completions_stream_by_committed_canvas(tmp_path):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dlm.serve.app import ServerThread, ServeSettings, create_app
    from dlm.serve.loader import load_engine
    from dlm.serve.scheduler import Scheduler

    folder = save_tiny_diffusion_gemma(tmp_path / "dg", seed=3)
    engine = load_engine(str(folder), "renoise", options=EngineOptions(threads=1, max_batch_size=4))
    tok = engine.tokenizer
    prompt = "Once upon a time"
    params = SamplingParams(max_new_tokens=10, seed=5, ignore_eos=True)
    ref = Engine(engine.model, tok, decoder="renoise").generate([tok(prompt)["input_ids"]], params)[0]
    app = create_app(Scheduler(engine), ServeSettings(model_name="dg", max_tokens_limit=64))
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model="dg", prompt=prompt, max_tokens=10, seed=5, extra_body={"ignore_eos": True})
        assert r.choices[0].text == ref.text and r.usage.completion_tokens == 10
        chunks = list(
            client.completions.create(
                model="dg", prompt=prompt, max_tokens=10, seed=5, stream=True, extra_body={"ignore_eos": True}
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == ref.text
        assert len([c for c in chunks if c.choices[0].text]) > 1  # streamed as canvases commit, not at the end
        chat = client.chat.completions.create(
            model="dg", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, seed=1
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 8
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        with pytest.raises(openai.BadRequestError, match="image_url"):  # a request with an image: refused by name
            client.chat.completions.create(model="dg", messages=[{"role": "user", "content": [image]}], max_tokens=4)
