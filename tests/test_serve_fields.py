"""The OpenAI fields beyond plain sampling through ``dlm serve`` (ISD, stride 3, on a tiny random I-DLM):
completions' ``logprobs`` (with ``echo`` the prompt's too - what lm-evaluation-harness's ``local-completions``
model asks for), chat's ``logprobs`` / ``top_logprobs``, streamed and not - the numbers the model's (teacher
forcing), the token texts adding up to the answer's text; the penalties and ``logit_bias``; vLLM's tokenizer
routes; structured outputs (``response_format``, vLLM's ``structured_outputs``)."""

import json
import re

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dlm.decode.configs import ISDConfig, MDMConfig  # noqa: E402
from dlm.decode.options import EngineOptions  # noqa: E402
from dlm.decode.sampling import token_logprobs  # noqa: E402
from dlm.serve.app import ServerThread, ServeSettings, create_app, load_engine  # noqa: E402
from dlm.serve.scheduler import Scheduler  # noqa: E402

MODEL = "tiny"
TOL = 1e-4

pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:--stride 3:UserWarning"),
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from dlm.testing import save_tiny

    folder = save_tiny(tmp_path_factory.mktemp("serve-lp") / "tiny-llama", "llama")
    return load_engine(str(folder), ISDConfig(stride=3), options=EngineOptions(threads=1, max_batch_size=8))


@pytest.fixture(scope="module")
def server(engine):
    settings = ServeSettings(
        model_name=MODEL, max_tokens_limit=160, tool_call_parser="hermes", reasoning_parser="think"
    )
    app = create_app(Scheduler(engine), settings)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def teacher(engine, prompt, out):
    """The model's log-probabilities of ``out`` after ``prompt`` from one plain forward (and the argmax there)."""
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt + out])).logits[0]
    return token_logprobs(logits[len(prompt) - 1 : len(prompt) + len(out) - 1], out, 1, engine.mask_token_id)


def assert_spans(text, tokens, offsets):
    """Each token's text starts at its offset, and the spans between offsets make up the text (a token that adds
    no text - a special token, part of a character - spans nothing)."""
    spans = [text[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])]
    assert "".join(spans) == text and offsets == sorted(offsets)
    assert all(sp in (t, "") for sp, t in zip(spans, tokens)), list(zip(spans, tokens))


def encode(engine, text):
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_completion_logprobs_are_the_models_and_add_up_to_the_text(client, engine):
    prompt = "The cat sat on the"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, logprobs=2, temperature=0, extra_body={"ignore_eos": True}
    )
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == 12
    assert_spans(c.text, lp.tokens, lp.text_offset)
    ids = encode(engine, prompt)
    out = engine.tokenizer(c.text, add_special_tokens=False)["input_ids"]
    want = teacher(engine, ids, out) if len(out) == 12 else None
    for i, (tok, val, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        assert 2 <= len(top) <= 3 and top[tok] == val  # the 2 most likely and the chosen one
        assert val == max(top.values())  # greedy: the chosen token is the most likely, to the last bit
        if want is not None:
            assert abs(val - want[i].logprob) < TOL


def test_chat_logprobs_streamed_equal_collected(client, engine):
    msgs = [{"role": "user", "content": "Tell me about the dog"}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=16, logprobs=True, top_logprobs=3, temperature=0)
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    special = set(engine.tokenizer.all_special_tokens)
    text = bytes(b for t in content if t.token not in special for b in t.bytes).decode(errors="replace")
    assert text == whole.choices[0].message.content  # the tokens' own bytes make up the text
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob == t.logprob and t.top_logprobs[0].token == t.token  # greedy
    streamed = []
    text = ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        ch = chunk.choices[0]
        text += ch.delta.content or ""
        if ch.logprobs is not None:
            streamed += ch.logprobs.content
    assert text == whole.choices[0].message.content
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    assert plain.choices[0].logprobs is None


def streamed_tokens(client, **kw):
    got = []
    for chunk in client.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            got += chunk.choices[0].logprobs.tokens
    return got


def test_logprobs_with_stop_strings(client):
    """A stop string: every generated token keeps its entry (the stop string's too), streamed or not; text held
    back in a stream (a possible start of a stop string) carries its tokens' log-probabilities when it is sent."""
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, logprobs=0)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    toks, offs, text = free.logprobs.tokens, free.logprobs.text_offset, free.text
    assert len(toks) == 20
    # a stop string that is exactly token j's text, first found where token j starts
    j = next(
        j
        for j in range(2, 20)
        if toks[j].strip() and text[offs[j] :].startswith(toks[j]) and text.find(toks[j]) == offs[j]
    )
    resp = client.completions.create(**kw, stop=[toks[j]], extra_body={"ignore_eos": True})
    r, m = resp.choices[0], resp.usage.completion_tokens
    assert r.finish_reason == "stop" and r.text == text[: offs[j]]
    # one entry per generated token, the stop string's included (a step may commit a few past it)
    assert j < m and r.logprobs.tokens == toks[:m] and r.logprobs.text_offset == offs[:m]
    assert streamed_tokens(client, **kw, stop=[toks[j]], extra_body={"ignore_eos": True}) == toks[:m]
    # a stop string that never completes, starting with the text's last character: the stream holds that back
    # until the end, then sends it with its tokens' log-probabilities
    never = [text[-1] + "\u2603\u2603"]
    whole = client.completions.create(**kw, stop=never, extra_body={"ignore_eos": True}).choices[0]
    assert whole.finish_reason == "length" and whole.logprobs.tokens == toks
    assert streamed_tokens(client, **kw, stop=never, extra_body={"ignore_eos": True}) == toks


def test_echo_scores_the_prompt_as_lm_eval_reads_it(server, engine):
    """lm-evaluation-harness's ``local-completions`` loglikelihood request (token ids, echo, logprobs 1, max_tokens
    1) and its own parser: the continuation's log-likelihood is the model's, greedy when every continuation token is
    the argmax; ``max_tokens`` 0 answers the prompt alone."""
    ctx = encode(engine, "The cat sat on")
    cont = encode(engine, " the mat")
    body = {"model": MODEL, "prompt": [ctx + cont], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    lp = resp["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(ctx) + len(cont) + 1
    want = teacher(engine, ctx[:1], ctx[1:] + cont)
    for got, w in zip(lp["token_logprobs"][1:], want):
        assert abs(got - w.logprob) < TOL
    assert resp["choices"][0]["text"].startswith(engine.tokenizer.decode(ctx + cont))
    lm_eval_api = pytest.importorskip("lm_eval.models.openai_completions")
    ((ll, greedy),) = lm_eval_api.LocalCompletionsAPI.parse_logprobs(resp, ctxlens=[len(ctx)])
    tail = want[len(ctx) - 1 :]
    assert abs(ll - sum(t.logprob for t in tail)) < TOL * len(tail)
    assert greedy == all(t.top[0][0] == t.token_id for t in tail)
    # the one generated token a stop (here a stop string; end-of-text alike): still its entry, the same scores
    for cont in [encode(engine, c) for c in (" the mat", " the dog", " a log", " the", " 1 2 3")]:
        q = dict(body, prompt=[ctx + cont])
        first = httpx.post(server.url + "/v1/completions", json=q, timeout=60).json()
        gen = first["choices"][0]["logprobs"]["tokens"][-1]
        if gen.strip() and first["choices"][0]["text"].endswith(gen):  # a token with text of its own
            break
    else:
        raise AssertionError("no continuation whose next token has text of its own")
    stopped = httpx.post(server.url + "/v1/completions", json=dict(q, stop=[gen]), timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["logprobs"]["token_logprobs"] == first["choices"][0]["logprobs"]["token_logprobs"]
    parse = lm_eval_api.LocalCompletionsAPI.parse_logprobs
    assert parse(stopped, ctxlens=[len(ctx)]) == parse(first, ctxlens=[len(ctx)])
    with torch.no_grad():
        nxt = int(engine.model(input_ids=torch.tensor([ctx])).logits[0, -1].argmax())
    body["prompt"] = [ctx + [nxt]]
    again = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert lm_eval_api.LocalCompletionsAPI.parse_logprobs(again, ctxlens=[len(ctx)])[0][1] is True
    only = httpx.post(server.url + "/v1/completions", json=dict(body, max_tokens=0), timeout=60).json()
    c = only["choices"][0]
    assert c["text"] == engine.tokenizer.decode(ctx + [nxt]) and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == len(ctx) + 1 and only["usage"]["completion_tokens"] == 0
    echo_only = httpx.post(
        server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi there", "echo": True, "max_tokens": 3}
    ).json()["choices"][0]
    assert echo_only["text"].startswith("Hi there") and echo_only["logprobs"] is None


def test_echo_streamed_equals_collected(server, engine):
    """``echo`` with ``stream``: each choice's first chunk is its prompt (as the collected answer shows it, special
    tokens included), then the answer's deltas; ``max_tokens`` 0 streams the prompt alone with finish ``length`` and
    no completion tokens in the usage. Several prompts and ``n`` > 1 keep each choice's own prompt."""
    prompts = ["Hi there", "The cat sat"]
    for max_tokens in (4, 0):
        body = {"model": MODEL, "prompt": prompts, "echo": True, "max_tokens": max_tokens, "n": 2, "temperature": 0}
        collected = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        events = []
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            json=dict(body, stream=True, stream_options={"include_usage": True}),
            timeout=60,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
        texts, finish = {}, {}
        for e in events:
            for c in e["choices"]:
                if not texts.get(c["index"]):  # the first text of a choice: its prompt
                    assert c["text"] == prompts[c["index"] // 2]
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
        want = {c["index"]: c["text"] for c in collected["choices"]}
        assert texts == want and len(want) == 4
        assert finish == {c["index"]: c["finish_reason"] for c in collected["choices"]}
        assert events[-1]["usage"] == collected["usage"]
        if max_tokens == 0:
            assert set(want.values()) == set(prompts) and collected["usage"]["completion_tokens"] == 0


def test_refused_with_a_diffusion_decoder(tmp_path):
    from dlm.testing import save_tiny

    folder = save_tiny(tmp_path / "tiny", "llama")
    eng = load_engine(str(folder), MDMConfig(steps=4), options=EngineOptions(threads=1, max_batch_size=2))
    app = create_app(Scheduler(eng), ServeSettings(model_name=MODEL, max_tokens_limit=8))
    with ServerThread(app) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 1}, timeout=60)
        assert r.status_code == 400 and json.loads(r.text)["error"]["param"] == "logprobs"
        assert "--decode ar or isd" in r.json()["error"]["message"]
        body = {"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_tokenizer_endpoints_are_the_served_tokenizer(server, engine):
    """``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (vLLM's) give the engine's tokenizer to a client without
    a copy of it: lm-evaluation-harness's remote tokenizer encodes, decodes and templates exactly as it does."""
    tok = engine.tokenizer
    text = "The cat sat on the mat. Numbers: 1 2 3"
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=60)  # noqa: E731
    r = post("/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == engine.max_positions
    assert r["token_strs"] == tok.convert_ids_to_tokens(ids)
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = post("/tokenize", {"messages": msgs, "model": MODEL}).json()["tokens"]
    templated = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat == tok(templated, add_special_tokens=False)["input_ids"]  # as /v1/chat/completions tokenizes
    assert post("/detokenize", {"tokens": ids}).json() == {"prompt": tok.decode(ids)}
    info = httpx.get(server.url + "/tokenizer_info", timeout=60).json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    for path, body, status, param in [
        ("/tokenize", {"prompt": "x", "messages": msgs}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ]:
        bad = post(path, body)
        assert bad.status_code == status and bad.json()["error"]["param"] == param, (path, body, bad.text)
    lm_eval_utils = pytest.importorskip("lm_eval.utils")
    url = server.url + "/v1/completions"
    assert lm_eval_utils.check_remote_tokenizer_support(url)
    remote = lm_eval_utils.RemoteTokenizer(url)
    assert remote.encode(text) == ids and remote.decode(ids) == tok.decode(ids)
    assert remote.eos_token_id == tok.eos_token_id
    assert remote.apply_chat_template(msgs) == templated


def test_penalties_and_logit_bias_reach_the_engine(client, engine):
    """The served text with penalties and a logit bias is the engine's for the same settings, and differs from the
    plain one; a bias of -100 on a token keeps it out."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams

    prompt = "The cat sat on the"
    ids = encode(engine, prompt)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    first = engine.tokenizer(plain, add_special_tokens=False)["input_ids"][0]
    extra = {"ignore_eos": True, "repetition_penalty": 1.5}
    adjusted = client.completions.create(
        **kw, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={str(first): -100}, extra_body=extra
    ).choices[0]
    params = SamplingParams(
        16,
        ignore_eos=True,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.5,
        logit_bias={first: -100.0},
    )
    alone = Engine(engine.model, engine.tokenizer, decoder="isd", stride=3).generate([ids], params)[0]
    assert adjusted.text == alone.text != plain
    assert alone.token_ids[0] != first


def test_stop_token_ids_and_min_tokens(client, engine):
    """vLLM's ``stop_token_ids`` (besides end-of-sequence) and ``min_tokens`` (no stop token before that many)."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams

    prompt = "Once upon a time"
    free = Engine(engine.model, engine.tokenizer, decoder="isd", stride=3).generate(
        [encode(engine, prompt)], SamplingParams(12, ignore_eos=True)
    )[0]
    stop = free.token_ids[1]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [stop]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 2
    held = client.completions.create(**kw, extra_body={"stop_token_ids": [stop], "min_tokens": 5})
    assert held.usage.completion_tokens >= 5
    bad = httpx.post(
        str(client.base_url).rstrip("/") + "/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 3, "min_tokens": 4},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"


def test_prefix_cache_serves_a_conversations_next_turn(tmp_path):
    """With ``--prefix-cache-tokens``, a chat's next turn reuses the KV of the conversation so far (counted in
    /metrics) and answers what the server without the cache answers."""
    from dlm.testing import save_tiny

    folder = save_tiny(tmp_path / "tiny", "llama")
    turn1 = [{"role": "system", "content": "You are a careful assistant. " * 4}, {"role": "user", "content": "Hi"}]
    answers = {}
    for tokens in (0, 2048):
        eng = load_engine(str(folder), "isd", options=EngineOptions(threads=1, max_batch_size=4, prefix_cache=tokens))
        app = create_app(Scheduler(eng), ServeSettings(model_name=MODEL, max_tokens_limit=16))
        with ServerThread(app) as srv:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
            first = c.chat.completions.create(model=MODEL, messages=turn1, max_tokens=8, temperature=0)
            turn2 = turn1 + [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And then?"},
            ]
            second = c.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8, temperature=0)
            metrics = httpx.get(srv.url + "/metrics", timeout=30).text
        cached = [line for line in metrics.splitlines() if line.startswith("dlm_prompt_tokens_cached_total")]
        answers[tokens] = (first.choices[0].message.content, second.choices[0].message.content)
        assert (float(cached[0].split()[-1]) > 20) == (tokens > 0), cached  # the system prompt and the first turn
        kept = [line for line in metrics.splitlines() if line.startswith("dlm_prefix_cache_tokens")]
        assert (20 < float(kept[0].split()[-1]) <= tokens) if tokens else not kept, kept  # the turns, kept once
    assert answers[0] == answers[2048]
    with pytest.raises(Exception, match="prefix-cache-tokens must be an integer"):
        load_engine(str(folder), "isd", options=EngineOptions(prefix_cache=-1))


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_outputs_answer_what_the_engine_gives(client, engine):
    """``response_format`` (json_schema, json_object) on chat and completions and vLLM's ``structured_outputs``
    (regex, choice, grammar, json) answer the engine's own constrained output, which matches the grammar; streamed
    the same; a bad schema, regex or grammar is a 400 naming the field."""
    pytest.importorskip("llguidance")
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.decode.structured import StructuredOutput

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Who?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0, response_format=fmt
    )
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    alone = Engine(engine.model, engine.tokenizer, decoder="isd", stride=3).generate(
        [encode(engine, text)], SamplingParams(40, structured=StructuredOutput(json=SCHEMA))
    )[0]
    assert chat.choices[0].message.content == alone.text and alone.text.startswith("{")
    if alone.finish_reason == "stop":
        value = json.loads(alone.text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    kw = dict(model=MODEL, prompt="The cat sat on the", max_tokens=24, temperature=0)
    for extra, ok in [
        (
            {"structured_outputs": {"regex": "[0-9]{2} (cats|dogs)"}},
            lambda t: t[:2].isdigit() and t[3:] in ("cats", "dogs"),
        ),
        ({"structured_outputs": {"choice": ["mat", "log", "hat"]}}, lambda t: t in ("mat", "log", "hat")),
        ({"structured_outputs": {"grammar": 'start: "(" /[a-c]/ ")"'}}, lambda t: len(t) == 3 and t[0] == "("),
        ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}}, lambda t: t[:2] == '{"'),
        ({"response_format": {"type": "json_object"}}, lambda t: t[:1] == "{"),
    ]:
        got = client.completions.create(**kw, extra_body=extra).choices[0]
        assert ok(got.text), (extra, got.text)
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(**kw, extra_body=extra, stream=True) if c.choices
        )
        assert streamed == got.text, extra
    url = str(client.base_url).rstrip("/")
    for extra, param, message in [
        ({"structured_outputs": {"regex": "("}}, "structured_outputs", "regex of the structured output is invalid"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs", "grammar"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
    ]:
        r = httpx.post(url + "/completions", json={"model": MODEL, "prompt": "x", **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        assert message in r.json()["error"]["message"], (extra, r.text)
    plain = client.completions.create(**kw, extra_body={"response_format": {"type": "text"}}).choices[0].text
    assert plain == client.completions.create(**kw).choices[0].text


def collect_stream(client, thoughts=None, **kw):
    """A streamed chat answer put together as a client does: (content or None, [(name, arguments)], finish,
    log-probabilities' tokens); each call's first delta carries its id, type and name, later ones only arguments.
    ``thoughts``: a list the reasoning deltas are appended to."""
    thoughts = [] if thoughts is None else thoughts
    content, calls, finish, lps = None, [], None, []
    for chunk in client.chat.completions.create(**kw, stream=True):
        (ch,) = chunk.choices
        if ch.delta.content:
            content = (content or "") + ch.delta.content
        if getattr(ch.delta, "reasoning_content", None):
            thoughts.append(ch.delta.reasoning_content)
        for d in ch.delta.tool_calls or []:
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function" and d.id.startswith("call_")
                calls.append([d.function.name, d.function.arguments or ""])
            else:
                assert d.index == len(calls) - 1 and d.function.name is None
                calls[-1][1] += d.function.arguments
        if ch.logprobs is not None:
            lps += [t.token for t in ch.logprobs.content]
        finish = ch.finish_reason or finish
    return content, [tuple(c) for c in calls], finish, lps


def answered(choice):
    m = choice.message
    return m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []], choice.finish_reason


def test_tool_calls_are_the_constrained_arguments(client, engine):
    """A named ``tool_choice`` answers one call whose arguments are the engine's output under the function's
    parameter schema (cut by ``max_tokens``: the arguments so far, ``finish_reason: length``, as OpenAI answers);
    ``"required"`` answers calls of the listed functions (``finish_reason: tool_calls``); streamed answers carry
    the same calls; a conversation that carries earlier calls and tool answers is accepted."""
    pytest.importorskip("llguidance")
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.decode.structured import StructuredOutput

    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 3},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    tools = [
        {"type": "function", "function": {"name": "forecast", "parameters": params}},
        {
            "type": "function",
            "function": {"name": "now", "parameters": {"type": "object", "additionalProperties": False}},
        },
    ]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    named = {"type": "function", "function": {"name": "forecast"}}
    kw = dict(model=MODEL, messages=messages, max_tokens=40, temperature=0, tools=tools)
    r = client.chat.completions.create(**kw, tool_choice=named).choices[0]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    alone = Engine(engine.model, engine.tokenizer, decoder="isd", stride=3).generate(
        [encode(engine, text)],
        SamplingParams(40, structured=StructuredOutput(json=params, disable_any_whitespace=True)),
    )[0]
    assert alone.finish_reason == "stop"  # the arguments closed within max_tokens (greedy: always the same)
    assert r.finish_reason == "stop" and r.message.content is None
    (call,) = r.message.tool_calls
    assert call.type == "function" and call.function.name == "forecast" and call.id.startswith("call_")
    assert call.function.arguments == alone.text and set(json.loads(alone.text)) == {"city", "days"}
    assert collect_stream(client, **kw, tool_choice=named)[:3] == (None, [("forecast", alone.text)], "stop")
    cut = client.chat.completions.create(**{**kw, "max_tokens": 3}, tool_choice=named).choices[0]
    content, ((name, args),), finish = answered(cut)
    assert (content, name, finish) == (None, "forecast", "length") and alone.text.startswith(args) and args
    assert collect_stream(client, **{**kw, "max_tokens": 3}, tool_choice=named)[:3] == answered(cut)
    # one short call (this tokenizer spells JSON a character a token)
    req = client.chat.completions.create(**{**kw, "max_tokens": 48, "tools": tools[1:]}, tool_choice="required")
    assert answered(req.choices[0]) == (None, [("now", "{}")], "tool_calls")
    from dlm.serve.schemas import ChatCompletion  # the answer /openapi.json documents

    url = str(client.base_url).rstrip("/")
    body = dict(kw, max_tokens=48, tools=tools[1:], tool_choice="required")
    raw = httpx.post(url + "/chat/completions", json=body, timeout=60).json()
    documented = ChatCompletion.model_validate(raw).choices[0]  # every field of the answer is in the document
    assert documented.message.model_dump(exclude_unset=True) == raw["choices"][0]["message"]
    assert documented.finish_reason == raw["choices"][0]["finish_reason"] == "tool_calls"
    again = collect_stream(client, **{**kw, "max_tokens": 48, "tools": tools[1:]}, tool_choice="required")
    assert again[:3] == (None, [("now", "{}")], "tool_calls")
    history = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
    ]
    ok = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, tools=tools, tool_choice="none")
    assert ok.choices[0].message.content is not None


def test_tool_choice_auto_reads_the_models_own_calls(client, engine):
    """``tool_choice: "auto"`` (the default with tools) reads the answer in the model's format (``hermes`` here):
    the text outside ``<tool_call>`` blocks is the content, each block a call (``finish_reason: tool_calls``), a
    block naming a function that is not among the tools stays text; streamed (with log-probabilities) it carries
    the same message and every token's log-probability. The random model is made to write a call by a regex."""
    pytest.importorskip("llguidance")
    tools = [
        {"type": "function", "function": {"name": "forecast", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
    ]
    call = '<tool_call>\n{"name": "forecast", "arguments": {"city": "Oslo"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    kw = dict(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], max_tokens=48, temperature=0, tools=tools
    )

    def forced(text):
        return {"structured_outputs": {"regex": re.escape(text)}}

    for text, want in [
        ("Let me look.\n" + call, ("Let me look.", [("forecast", '{"city": "Oslo"}')], "tool_calls")),
        (call + "\nDone", ("\nDone", [("forecast", '{"city": "Oslo"}')], "tool_calls")),
        ("No " + other, ("No " + other, [], "stop")),  # not one of the tools: text
        ("Sunny.", ("Sunny.", [], "stop")),
    ]:
        body = dict(kw, max_tokens=len(encode(engine, text)) + 2, extra_body=forced(text))
        r = client.chat.completions.create(**body)
        assert answered(r.choices[0]) == (want[0] or None, want[1], want[2]), text
        ids = [r.choices[0].message.tool_calls[0].id] if want[1] else []
        assert all(i.startswith("call_") for i in ids)
        content, calls, finish, tokens = collect_stream(client, **body, logprobs=True)
        assert (content, calls, finish) == (want[0] or None, want[1], want[2]), text
        assert "".join(tokens) == text  # every token's log-probability, once, in order
    inside = len(encode(engine, "Let me look.\n" + call[:24]))  # cut inside the block
    cut = dict(kw, max_tokens=inside, extra_body=forced("Let me look.\n" + call))
    r = client.chat.completions.create(**cut).choices[0]
    assert r.finish_reason == "length" and not r.message.tool_calls and "<tool_call>" in r.message.content
    assert collect_stream(client, **cut)[:3] == answered(r)
    whole = len(encode(engine, call)) + 2
    plain = client.chat.completions.create(**dict(kw, max_tokens=whole, tool_choice="none", extra_body=forced(call)))
    assert answered(plain.choices[0]) == (call, [], "stop")  # no tools offered: the text as it is


def test_reasoning_is_sent_apart(client, engine):
    """A ``<think>`` block at the start of the answer is ``reasoning_content`` (vLLM's field), the rest - without
    the whitespace after the tag - the content, collected and streamed alike; a tool call written inside the block
    is not a call. The random model is made to think by a regex."""
    pytest.importorskip("llguidance")
    call = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    for text, want, extra in [
        ("<think>plan it</think>\n\nIt is 12.", ("It is 12.", [], "stop", "plan it"), {}),
        (
            f"<think>maybe {call}</think>\n{call}",
            (None, [("now", "{}")], "tool_calls", f"maybe {call}"),
            {"tools": tools},
        ),
        ("No <think>x</think>", ("No <think>x</think>", [], "stop", None), {}),
    ]:
        body = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "Time?"}],
            temperature=0,
            max_tokens=len(encode(engine, text)) + 2,
            extra_body={"structured_outputs": {"regex": re.escape(text)}},
            **extra,
        )
        r = client.chat.completions.create(**body).choices[0]
        assert (*answered(r), getattr(r.message, "reasoning_content", None)) == want, text
        thoughts: list[str] = []
        streamed = collect_stream(client, thoughts, **body, logprobs=True)
        assert (*streamed[:3], "".join(thoughts) or None) == want, text
        assert "".join(streamed[3]) == text  # every token's log-probability, reasoning tokens included
        from dlm.serve.schemas import ChatCompletion  # every field of the answer is in /openapi.json's document

        raw = {k: v for k, v in body.items() if k != "extra_body"} | body["extra_body"]
        answer = httpx.post(str(client.base_url).rstrip("/") + "/chat/completions", json=raw, timeout=60).json()
        message = ChatCompletion.model_validate(answer).choices[0].message
        assert message.model_dump(exclude_unset=True) == answer["choices"][0]["message"]
