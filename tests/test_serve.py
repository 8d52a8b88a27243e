"""`dlm serve`: the OpenAI-compatible server, driven by the official `openai` client against a server started
in-process on a loopback port with a tiny random model (converted on the fly to an I-DLM, decoded with ISD)."""

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dlm.decode.configs import ISDConfig, make_config  # noqa: E402
from dlm.decode.engine import Engine  # noqa: E402
from dlm.decode.options import EngineOptions  # noqa: E402
from dlm.decode.sampling import SamplingParams  # noqa: E402
from dlm.errors import DLMError  # noqa: E402
from dlm.serve.app import ServerThread, ServeSettings, TextStream, create_app, load_engine  # noqa: E402
from dlm.serve.scheduler import Scheduler  # noqa: E402

MODEL = "tiny"
LIMIT = 48  # --max-tokens-limit of the test server


# one torch thread for the test thread (conftest); the servers' engine threads get threads=1. Stride 3 on a model
# converted with block size 1: untrained drafts (acceptance ~0), but the output stays exact (its warning ignored).
pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:--stride 3:UserWarning"),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from dlm.testing import save_tiny

    return save_tiny(tmp_path_factory.mktemp("serve") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def engine(tiny_dir):
    # drafting at every step (not the measured default): the tests count drafting steps and draft metrics
    return load_engine(
        str(tiny_dir), ISDConfig(stride=3, draft_budget="always"), options=EngineOptions(threads=1, max_batch_size=16)
    )


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(
        Scheduler(engine), ServeSettings(model_name=MODEL, max_tokens_limit=LIMIT, max_body_bytes=64 * 1024)
    )
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def alone(engine, ids, max_tokens, decoder="isd", stop=(), ignore_eos=False):
    """The same greedy request served alone (batch 1) by a fresh engine on the same model."""
    kw = {"stride": 3} if decoder == "isd" else {}
    eng = Engine(engine.model, engine.tokenizer, decoder=decoder, options=EngineOptions(max_batch_size=1), **kw)
    sp = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, stop_strings=tuple(stop), ignore_eos=ignore_eos)
    return eng.generate([ids], sp)[0]


def encode(engine, text):
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_ids(engine, messages):
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return encode(engine, text)


def assert_error_shape(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# -- correctness against the engine ---------------------------------------------------------------------------
def test_completion_greedy_equals_engine_and_ar(client, engine):
    prompt = "The quick brown fox"
    ids = encode(engine, prompt)
    ref = alone(engine, ids, 20)
    ar = alone(engine, ids, 20, decoder="ar")
    assert ref.token_ids == ar.token_ids  # ISD greedy is exactly AR greedy
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == len(ids) + len(ref.token_ids)

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    # token-id prompts are the same request
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert r2.choices[0].text == ref.text


def test_chat_greedy_equals_engine(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How do you boil an egg?"}]
    ref = alone(engine, chat_ids(engine, messages), 24)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    # content parts (a list of {"type": "text"}) are the same message
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        messages[1],
    ]
    r3 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=24, temperature=0)
    assert r3.choices[0].message.content == ref.text


def test_stop_string_cuts_text_streamed_and_not(client, engine):
    prompt = "Once upon a time"
    ref = alone(engine, encode(engine, prompt), 30, ignore_eos=True)
    text = ref.text
    assert len(text) > 12
    stop = text[8:11]  # a stop string from the middle of the greedy answer
    want = text[: text.find(stop)]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop, "@@@@"], extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=30,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_seed_and_multiple_prompts(client):
    kw = dict(model=MODEL, prompt="The cat sat", max_tokens=12, temperature=1.0, top_p=0.95, n=3, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # choice j uses seed+j: the samples differ
    assert a.usage.completion_tokens > 0
    # a list of prompts: choices are prompt-major, n per prompt
    r = client.completions.create(model=MODEL, prompt=["The cat", "The dog"], max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text


def test_streamed_n_choices(client, engine):
    ref = alone(engine, encode(engine, "A diffusion"), 10)
    chunks = list(
        client.completions.create(model=MODEL, prompt="A diffusion", max_tokens=10, temperature=0, n=2, stream=True)
    )
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert "".join(c.text for c in mine) == ref.text
        assert mine[-1].finish_reason == ref.finish_reason


# -- continuous batching under load ---------------------------------------------------------------------------
def test_64_concurrent_streams_equal_alone(server, engine, client):
    # 32 distinct requests, each sent twice at once (twins in the same batch must agree too)
    distinct = [(f"Question {i}: the cat" if i % 2 else f"{i} little models", 6 + (i % 5)) for i in range(32)]
    alone_refs = {req: alone(engine, encode(engine, req[0]), req[1]) for req in distinct}
    prompts = [p for p, _ in distinct] * 2
    max_tokens = [m for _, m in distinct] * 2  # different lengths: requests leave at different steps
    refs = [alone_refs[(p, m)] for p, m in zip(prompts, max_tokens)]

    async def one(aclient, p, m):
        stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=m, temperature=0, stream=True)
        text, reasons = "", []
        async for c in stream:
            text += c.choices[0].text
            if c.choices[0].finish_reason:
                reasons.append(c.choices[0].finish_reason)
        return text, reasons

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(aclient, p, m) for p, m in zip(prompts, max_tokens)))
        finally:
            await aclient.close()

    t0 = time.perf_counter()
    outs = asyncio.run(main())
    assert time.perf_counter() - t0 < 120
    for (text, reasons), ref in zip(outs, refs):
        assert text == ref.text
        assert reasons == [ref.finish_reason]
    # still serving, nothing left behind
    assert client.completions.create(model=MODEL, prompt="still there?", max_tokens=3, temperature=0).choices
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["running"] == 0 and health["waiting"] == 0


@pytest.mark.parametrize(
    "decode,kw",
    [
        ("mdm", dict(sampler="confidence", steps=6)),
        ("mdm", dict(sampler="threshold", semi_ar_block=4)),
        ("block", dict(steps=2)),
    ],
)
def test_diffusion_decoders_are_served_batched(tiny_dir, decode, kw):
    """mdm and block run on the same continuous-batching engine: 12 concurrent streaming requests of different
    prompt lengths and max_tokens each get what `dlm generate` gives the request alone."""
    from dlm.decode import generate

    config = make_config(decode, **kw)
    eng = load_engine(str(tiny_dir), config, options=EngineOptions(max_batch_size=4))
    requests = [(f"Request {i}: " + "the cat " * (i % 4), 4 + (i % 5)) for i in range(12)]
    refs = [
        generate(
            eng.model, [encode(eng, p)], config, SamplingParams(m), options=EngineOptions(threads=1, max_batch_size=1)
        )[0]
        for p, m in requests
    ]
    app = create_app(Scheduler(eng), ServeSettings(model_name=MODEL, max_tokens_limit=LIMIT))

    async def one(aclient, p, m):
        stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=m, temperature=0, stream=True)
        text, reasons = "", []
        async for c in stream:
            text += c.choices[0].text
            reasons += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
        return text, reasons

    with ServerThread(app) as srv:

        async def main():
            aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            try:
                return await asyncio.gather(*(one(aclient, p, m) for p, m in requests))
            finally:
                await aclient.close()

        outs = asyncio.run(main())
        for (text, reasons), ref in zip(outs, refs):
            assert text == ref.text and reasons == [ref.finish_reason]
        sync = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = sync.completions.create(model=MODEL, prompt=requests[0][0], max_tokens=requests[0][1], temperature=0)
        assert r.choices[0].text == refs[0].text and r.usage.completion_tokens == len(refs[0].token_ids)
        # a request whose prompt + max_tokens cannot fit the context is a 4xx, and the server keeps serving
        long = "word " * 200
        resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": long, "max_tokens": LIMIT})
        assert 400 <= resp.status_code < 500 and "context" in resp.json()["error"]["message"], resp.text
        assert sync.models.list().data


def test_cancelled_stream_does_not_stall_others(server, client, engine, monkeypatch):
    # engine steps of 20 ms: the long request cannot finish its LIMIT tokens before the server sees the client go
    # (on a fast CPU the tiny model wrote them all first, and nothing was left to abort)
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda *a, **k: (time.sleep(0.02), step(*a, **k))[1])
    long = client.completions.create(
        model=MODEL,
        prompt="Numbers: 0 1 2",
        max_tokens=LIMIT,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(long)
    next(it), next(it)
    long.close()  # client disconnects mid-stream
    ref = alone(engine, encode(engine, "To be, or not"), 12)
    r = client.completions.create(model=MODEL, prompt="To be, or not", max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.text
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the aborted request leaves the batch
        m = httpx.get(server.url + "/metrics").text
        health = httpx.get(server.url + "/health").json()
        if 'dlm_requests_total{finish_reason="abort"}' in m and health["running"] == 0:
            break
        time.sleep(0.1)
    assert 'dlm_requests_total{finish_reason="abort"}' in m
    assert health["running"] == 0


def test_engine_failure_is_an_error_not_a_dead_server(server, client, engine):
    sched = server.app.state.scheduler
    real = sched.engine

    calls = {"n": 0}
    original_step = real.step

    def broken_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return original_step()

    real.step = broken_step
    try:
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL, prompt="The dog", max_tokens=10, temperature=0)
    finally:
        real.step = original_step
    # rebuilt from scratch; the requests in flight get their 500 first, so the rebuild may finish just after
    deadline = time.time() + 10
    while sched.engine is real and time.time() < deadline:
        time.sleep(0.01)
    assert sched.engine is not real
    ref = alone(engine, encode(engine, "The dog"), 10)
    assert (
        client.completions.create(model=MODEL, prompt="The dog", max_tokens=10, temperature=0).choices[0].text
        == ref.text
    )


# -- the small endpoints --------------------------------------------------------------------------------------
def test_models_health_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt="The cat", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in (
        "dlm_generation_tokens_total",
        "dlm_prompt_tokens_total",
        "dlm_forwards_total",
        "dlm_tokens_per_forward",
        "dlm_draft_acceptance",
        "dlm_queue_length",
        "dlm_running_requests",
        "dlm_time_to_first_token_seconds_count",
        "dlm_request_latency_seconds_count",
    ):
        assert name in values, name
    assert values["dlm_generation_tokens_total"] >= 4
    assert 1.0 <= values["dlm_tokens_per_forward"] <= 3.0  # stride 3: at most 3 tokens per forward
    assert values["dlm_draft_proposed_total"] > 0
    assert values['dlm_isd_steps_total{mode="draft"}'] > 0 and values['dlm_isd_steps_total{mode="ar"}'] == 0
    # every drafting step at the fixed --stride 3
    assert values['dlm_isd_draft_steps_total{stride="3"}'] == values['dlm_isd_steps_total{mode="draft"}']
    verify_rows = values['dlm_isd_verify_rows_total{next="verify"}'] + values['dlm_isd_verify_rows_total{next="cold"}']
    assert 0 < verify_rows <= values["dlm_forwards_total"]
    assert (
        values['dlm_time_to_first_token_seconds_bucket{le="+Inf"}'] == values["dlm_time_to_first_token_seconds_count"]
    )


def test_metrics_count_isd_steps_by_the_stride_the_policy_chose():
    """A policy that chooses the stride per step: /metrics says how many drafting steps ran at each stride, beside
    the draft / ar split (the counters are the decoder's, copied at each engine step)."""
    from dlm.decode.isd.stats import StepCounts
    from dlm.serve.metrics import Metrics

    counts, metrics = StepCounts(), Metrics()
    for stride in (0, 2, 2, 3, 0, 2, 4):  # 0: a plain AR step
        counts.step(stride > 0, stride)
        metrics.on_step(0, 1, counts)
    text = metrics.render()
    assert 'dlm_isd_steps_total{mode="draft"} 5' in text and 'dlm_isd_steps_total{mode="ar"} 2' in text
    for stride, n in ((2, 3), (3, 1), (4, 1)):
        assert f'dlm_isd_draft_steps_total{{stride="{stride}"}} {n}' in text
    assert 'stride="0"' not in text
    assert "# TYPE dlm_isd_draft_steps_total counter" in text


# -- bad input ------------------------------------------------------------------------------------------------
BAD = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "x",', 400, None),  # malformed JSON
    ("/v1/completions", b"[1, 2, 3]", 400, None),  # not an object
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 1.5}', 400, "n"),
    ("/v1/completions", b'{"model": "tiny", "prompt": 42}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "x"}', 400, "model"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 49}', 400, "max_tokens"),  # > limit
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": -0.5}', 400, "temperature"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": 0}', 400, "top_p"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 0}', 400, "n"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ""}', 400, "prompt"),  # empty prompt
    ("/v1/completions", b'{"model": "tiny", "prompt": [5, 99999]}', 400, "prompt"),  # not in vocab
    ("/v1/completions", b'{"model": "tiny", "prompt": [320]}', 400, "prompt"),  # the mask token
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ""}', 400, "stop"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "echo": true, "stream": true, "logprobs": 1}', 400, "echo"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logprobs": 21}', 400, "logprobs"),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
        400,
        "top_logprobs",
    ),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),  # unknown model
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages"),  # empty messages
    ("/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}',
        400,
        "messages.0.role",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}',
        400,
        "messages.0.content",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000}',
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}',
        400,
        "presence_penalty",
    ),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}', 400, "logit_bias"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logit_bias": {"5": 101}}', 400, "logit_bias"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logit_bias": {"five": 1}}', 400, "logit_bias"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "repetition_penalty": 0}', 400, "repetition_penalty"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "seed": -2407928497069766337363968}', 400, "seed"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "seed": 9223372036854775808}', 400, "seed"),  # 2**63
    ("/v1/nope", b"{}", 404, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_is_a_4xx_openai_error(server, path, body, status, param):
    r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"})
    err = assert_error_shape(r, status)
    assert err["param"] == param


def test_bad_input_leaves_the_server_serving(server, client):
    long_prompt = "x " * 600  # over the tiny model's 512 positions
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 2})
    assert assert_error_shape(r, 400)["code"] == "context_length_exceeded"
    big = json.dumps({"model": MODEL, "prompt": "y" * 70_000}).encode()  # over the 64 KiB body limit
    assert_error_shape(httpx.post(server.url + "/v1/completions", content=big), 413)

    def chunked():  # no Content-Length: the limit counts the bytes as they come
        for _ in range(80):
            yield b" " * 1024

    assert_error_shape(httpx.post(server.url + "/v1/completions", content=chunked()), 413)
    # unknown fields are ignored (clients send newer fields), known ones still checked
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0, "some_new_field": {"a": [1]}},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=LIMIT + 1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'dlm_request_errors_total{status="413"}' in metrics and "500" not in metrics.split("errors_total")[1][:200]


# -- auth -----------------------------------------------------------------------------------------------------
def test_api_key(engine):
    eng = Engine(engine.model, engine.tokenizer, decoder="ar", options=EngineOptions(threads=1, max_batch_size=4))
    app = create_app(Scheduler(eng), ServeSettings(model_name=MODEL, api_key="sekret"))
    with ServerThread(app) as srv:
        body = {"model": MODEL, "prompt": "The cat", "max_tokens": 3, "temperature": 0}
        err = assert_error_shape(httpx.post(srv.url + "/v1/completions", json=body), 401)
        assert err["code"] == "invalid_api_key"
        assert_error_shape(
            httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401
        )
        assert_error_shape(httpx.get(srv.url + "/v1/models"), 401)
        assert_error_shape(httpx.get(srv.url + "/metrics"), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        ref = alone(engine, encode(engine, "The cat"), 3, decoder="ar")
        assert good.completions.create(**body).choices[0].text == ref.text
        assert httpx.get(srv.url + "/health").status_code == 200  # health stays open for probes


def test_max_queue_answers_503_past_capacity(engine):
    """``--max-queue``: a request whose choices would make more than that many engine requests wait for a batch
    slot is a 503 with ``Retry-After`` in the OpenAI shape, at once (n choices count n); the requests let in are
    served as always, and the server serves again once the queue drains."""
    eng = Engine(engine.model, engine.tokenizer, decoder="ar", options=EngineOptions(threads=1, max_batch_size=1))
    app = create_app(Scheduler(eng), ServeSettings(model_name=MODEL, max_queue=2))
    with ServerThread(app) as srv:
        url = srv.url + "/v1/completions"
        body = {"model": MODEL, "prompt": "The cat", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url, json={**body, "n": 3})  # idle: 3 choices > 2
        assert assert_error_shape(r, 503)["code"] == "server_overloaded" and r.headers["retry-after"] == "1"
        assert "--max-queue 2" in r.json()["error"]["message"]
        assert httpx.post(url, json={**body, "n": 2}).status_code == 200

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(c.post(url, json=body) for _ in range(8)))

        got = asyncio.run(
            burst()
        )  # one runs, up to 2 wait (the first may still count as waiting): some are turned away
        codes = sorted(r.status_code for r in got)
        assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
        ref = alone(engine, encode(engine, "The cat"), 48, decoder="ar", ignore_eos=True).text
        assert all(r.json()["choices"][0]["text"] == ref for r in got if r.status_code == 200)
        assert all(r.headers["retry-after"] == "1" for r in got if r.status_code == 503)
        assert httpx.post(url, json=body).status_code == 200  # drained: served again
        assert 'dlm_request_errors_total{status="503"}' in httpx.get(srv.url + "/metrics").text
    with pytest.raises(DLMError, match="--max-queue must be an integer >= 0"):
        ServeSettings(max_queue=-1)


# -- pieces ---------------------------------------------------------------------------------------------------
def test_text_stream_holds_back_possible_stop_prefixes(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok("The cat sat on the mat", add_special_tokens=False)["input_ids"]
    ts = TextStream(tok, ["on the"])
    sent = ""
    for i in ids:
        sent += ts.feed([i])
        full = tok.decode(ts.ids, skip_special_tokens=True)
        assert full.startswith(sent)
        assert "on" not in sent[len("The cat sat ") :]  # anything that may begin the stop string waits
    assert sent == "The cat sat "  # "on the mat" holds at "on the" (the engine would have stopped there)
    assert ts.finish("The cat sat ") == ""
    ts2 = TextStream(tok, [])
    assert "".join(ts2.feed([i]) for i in ids) + ts2.finish("The cat sat on the mat") == "The cat sat on the mat"


@pytest.mark.filterwarnings("ignore::dlm.deprecations.DLMDeprecationWarning")  # the old keyword spellings
def test_settings_and_engine_errors(tiny_dir):
    with pytest.raises(DLMError, match="--max-tokens-limit"):
        ServeSettings(max_tokens_limit=0)
    with pytest.raises(DLMError, match="--api-key"):
        ServeSettings(api_key=" ")
    with pytest.raises(DLMError, match="--stride"):
        load_engine(str(tiny_dir), decode="ar", stride=3)
    with pytest.raises(DLMError, match="--steps: not a setting of --decode ar"):
        load_engine(str(tiny_dir), decode="ar", steps=4)
    with pytest.raises(DLMError, match="--sampler, --semi-ar-block: not a setting of --decode block"):
        load_engine(str(tiny_dir), decode="block", method="random", block_length=4)  # the old spellings
    with pytest.raises(DLMError, match="--isd-draft-budget"):
        load_engine(str(tiny_dir), decode="ar", isd_token_budget=8)


def test_cli_registers_serve():
    from dlm.cli import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "x",
            "--decode",
            "ar",
            "--api-key",
            "k",
            "--served-model-name",
            "m",
            "--max-batch-size",
            "4",
        ]
    )
    assert args.command == "serve" and args.decode == "ar" and args.host == "127.0.0.1" and args.port == 8000
    assert args.max_batch_size == 4 and args.served_model_name == "m"
    from dlm.decode.options import COMMANDS, SERVER, EngineOptions, from_args

    # the commands' defaults are the options module's: the prefix cache on, the idle cores, a larger server batch
    assert args.prefix_cache_tokens == SERVER.prefix_cache == COMMANDS.prefix_cache == 4096
    assert from_args(build_parser().parse_args(["serve"])) == SERVER
    assert from_args(build_parser().parse_args(["generate", "--prompt", "p"])) == COMMANDS
    assert SERVER.max_batch_size == 16 and COMMANDS.max_batch_size == EngineOptions().max_batch_size == 8
    assert EngineOptions().threads is None and EngineOptions().prefix_cache == 0  # the library leaves the process be
    bench = (Path(__file__).resolve().parents[1] / "bench" / "serve.py").read_text()
    assert "default=SERVER.prefix_cache" in bench  # the benchmark serves with the same default
    assert build_parser().parse_args(["serve", "--prefix-cache-tokens", "0"]).prefix_cache_tokens == 0
    for cmd in (["serve"], ["generate", "--prompt", "p"]):  # the static step: the device's default unless a flag says
        assert build_parser().parse_args(cmd).static_cache is None
        assert build_parser().parse_args([*cmd, "--static-cache"]).static_cache is True
        assert build_parser().parse_args([*cmd, "--no-static-cache"]).static_cache is False
    from dlm.commands.serve import SERVE_DEFAULTS
    from dlm.decode.configs import ARConfig, config_from_args

    def config(argv):
        a = build_parser().parse_args(["serve", *argv])
        return config_from_args(a, a.decode or "isd", command_defaults=SERVE_DEFAULTS)

    assert config(["--decode", "ar"]) == ARConfig(lookup_budget="auto")  # ar: measured, if it drafts (--prompt-lookup)
    assert config([]).draft_budget == "auto"  # the server's default for isd
    assert config(["--isd-draft-budget", "always"]).draft_budget == "always"
    assert config(["--isd-token-budget", "always"]).draft_budget == "always"  # the old spelling, deprecated


def test_isd_draft_budget_flag_reaches_the_decoder(tiny_dir):
    """--isd-draft-budget: an int is a fixed budget, 'auto' the measured policy (dlm.decode.schedule, tested in
    tests/test_decode_schedule.py); a bad value is refused before the model loads."""
    from dlm.decode.configs import ARConfig, ISDConfig
    from dlm.decode.schedule import MeasuredDraft, TokenBudget

    eng = load_engine(str(tiny_dir), ISDConfig(draft_budget="auto"))
    assert isinstance(eng.decoder.policy, MeasuredDraft)
    eng = load_engine(str(tiny_dir), ISDConfig(draft_budget="6"))
    assert isinstance(eng.decoder.policy, TokenBudget) and eng.decoder.policy.budget == 6
    with pytest.raises(DLMError, match="--isd-draft-budget"):
        load_engine("/nonexistent", ISDConfig(draft_budget="fast"))
    eng = load_engine(str(tiny_dir), ISDConfig(fallback="all"))
    assert eng.decoder.fallback == "all" and load_engine(str(tiny_dir), "isd").decoder.fallback == "predict"
    with pytest.raises(DLMError, match="--isd-fallback must be one of"):
        load_engine("/nonexistent", ISDConfig(fallback="sometimes"))
    with pytest.raises(DLMError, match="--isd-fallback is an ISD setting"):
        make_config("ar", fallback="all")
    with pytest.raises(DLMError, match="not both"):
        make_config(ARConfig(), fallback="all")
    eng = load_engine(str(tiny_dir), ISDConfig(candidates=3))
    assert eng.decoder.candidates == 3 and eng.decoder.stride == 2
    with pytest.raises(DLMError, match="--isd-candidates is an ISD setting"):
        make_config("ar", candidates=2)
    with pytest.raises(DLMError, match="--isd-candidates must be an integer"):
        load_engine("/nonexistent", ISDConfig(candidates=12))
