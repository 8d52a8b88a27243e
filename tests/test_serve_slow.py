"""`dlm serve` with the real default model (smollm2-135m converted on the fly to an I-DLM): chat through the
official client, greedy ISD output equal to the plain AR model's greedy generate, streamed and not."""

import asyncio

import pytest

from dlm.decode.options import EngineOptions

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

pytestmark = pytest.mark.slow


def test_smollm2_chat_greedy_equals_ar_generate(smollm2_path):
    import torch

    from dlm.model.hub import load_model
    from dlm.serve.app import ServerThread, ServeSettings, create_app, load_engine
    from dlm.serve.scheduler import Scheduler

    engine = load_engine("smollm2-135m", "isd", options=EngineOptions(max_batch_size=4))
    tok = engine.tokenizer
    questions = ["What is the capital of France?", "Name three colours."]
    refs = []
    ar = load_model("smollm2-135m")  # the untouched AR model
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.inference_mode():
            out = ar.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        refs.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))

    app = create_app(Scheduler(engine), ServeSettings(model_name="smollm2-135m", max_tokens_limit=64))
    with ServerThread(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600)
        r = client.chat.completions.create(
            model="smollm2-135m", max_tokens=16, temperature=0, messages=[{"role": "user", "content": questions[0]}]
        )
        assert r.choices[0].message.content == refs[0]

        async def both():
            aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=600)

            async def one(q):
                stream = await aclient.chat.completions.create(
                    model="smollm2-135m",
                    max_tokens=16,
                    temperature=0,
                    stream=True,
                    messages=[{"role": "user", "content": q}],
                )
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            try:
                return await asyncio.gather(*(one(q) for q in questions))
            finally:
                await aclient.close()

        assert asyncio.run(both()) == refs
