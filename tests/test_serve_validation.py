"""Request parsing and validation of ``dlm serve`` without HTTP: a body to the engine's prompts, new-token limit and
sampling parameters, or an APIError with the status and field the server would answer."""

import pytest

pytest.importorskip("pydantic")

from dlm.serve.app import ServeSettings  # noqa: E402
from dlm.serve.schemas import APIError, ChatCompletionRequest, CompletionRequest  # noqa: E402
from dlm.serve.validation import ANY_TOOL, NAMED_TOOL, RequestValidator, sampling_params  # noqa: E402

MASK = 7


@pytest.fixture
def validator(tiny_tokenizer):
    settings = ServeSettings(model_name="tiny", max_tokens_limit=32, completion_default_max_tokens=5)
    return RequestValidator(settings, tiny_tokenizer, vocab_size=320, max_positions=40, mask_token_id=MASK)


def refused(call, body, status=400, param=None, code=None):
    with pytest.raises(APIError) as e:
        call(body)
    assert e.value.status == status and e.value.param == param, (e.value.status, e.value.param, e.value.message)
    if code is not None:
        assert e.value.code == code
    return e.value


def test_completion_prompt_forms(validator):
    ids = validator.encode("Hello there")
    assert validator.completion(CompletionRequest(model="tiny", prompt="Hello there")).prompts == [ids]
    two = validator.completion(CompletionRequest(model="tiny", prompt=["Hello there", "Hi"], max_tokens=9))
    assert two.prompts == [ids, validator.encode("Hi")] and two.max_tokens == 9
    assert two.prompt_tokens == len(ids) + len(validator.encode("Hi"))
    assert validator.completion(CompletionRequest(model="tiny", prompt=[1, 2, 3])).prompts == [[1, 2, 3]]
    assert validator.completion(CompletionRequest(model="tiny", prompt=[[1], [2, 3]])).prompts == [[1], [2, 3]]
    assert validator.completion(CompletionRequest(model="tiny", prompt="x")).max_tokens == 5  # the default


def test_completion_refusals(validator):
    c = validator.completion
    refused(c, CompletionRequest(model="other", prompt="x"), 404, "model", "model_not_found")
    refused(c, CompletionRequest(model="tiny", prompt="x", max_tokens=33), 400, "max_tokens", "invalid_value")
    refused(
        c,
        CompletionRequest(model="tiny", prompt="x", echo=True, stream=True, logprobs=1),
        400,
        "echo",
        "unsupported_parameter",
    )
    assert c(CompletionRequest(model="tiny", prompt="x", echo=True, stream=True)).echo  # without logprobs: taken
    refused(c, CompletionRequest(model="tiny", prompt="x", max_tokens=0), 400, "max_tokens", "unsupported_parameter")
    refused(c, CompletionRequest(model="tiny", prompt=[]), 400, "prompt")
    refused(c, CompletionRequest(model="tiny", prompt=[[]]), 400, "prompt")
    refused(c, CompletionRequest(model="tiny", prompt=[320]), 400, "prompt")  # outside the vocabulary
    refused(c, CompletionRequest(model="tiny", prompt=[1, MASK]), 400, "prompt")  # the mask token
    long = CompletionRequest(model="tiny", prompt=[1] * 40)
    refused(c, long, 400, "prompt", "context_length_exceeded")


def test_completion_suffix(validator, tiny_tokenizer):
    """OpenAI's suffix (fill-in-the-middle): token ids for a decoder that fills the middle (mdm), within the
    context with the prompt and the answer; a 400 naming it for any other decoder, and for one that does not fit."""
    refused(validator.completion, CompletionRequest(model="tiny", prompt="x", suffix="y"), 400, "suffix")
    settings = ServeSettings(model_name="tiny", max_tokens_limit=32, completion_default_max_tokens=5)
    mdm = RequestValidator(
        settings, tiny_tokenizer, 320, 40, MASK, decoder="mdm", left_to_right=False, fills_middle=True
    )
    parsed = mdm.completion(CompletionRequest(model="tiny", prompt="x", suffix=" the end", max_tokens=4))
    assert parsed.suffix_ids == tuple(mdm.encode(" the end"))
    params = sampling_params(CompletionRequest(model="tiny", prompt="x"), 4, 0, suffix_ids=parsed.suffix_ids)
    assert params.suffix_ids == parsed.suffix_ids
    assert mdm.completion(CompletionRequest(model="tiny", prompt="x")).suffix_ids == ()
    too_long = CompletionRequest(model="tiny", prompt=[1] * 20, suffix="a b c d e f g h i j k l m n", max_tokens=16)
    refused(mdm.completion, too_long, 400, "suffix")


def test_chat(validator, tiny_tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    parsed = validator.chat(ChatCompletionRequest(model="tiny", messages=msgs, max_completion_tokens=4))
    text = tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert parsed.prompts == [validator.encode(text)] and parsed.max_tokens == 4
    assert validator.chat(ChatCompletionRequest(model="tiny", messages=msgs)).max_tokens == 32  # the limit
    refused(validator.chat, ChatCompletionRequest(model="tiny", messages=[]), 400, "messages")
    refused(validator.chat, ChatCompletionRequest(model="tiny", messages=msgs, max_tokens=99), 400, "max_tokens")


def test_sampling_params_per_choice():
    body = CompletionRequest(model="tiny", prompt="x", seed=10, temperature=0.5, top_k=-1, stop=["\n"])
    first, third = sampling_params(body, 6, 0), sampling_params(body, 6, 2)
    assert (first.seed, third.seed) == (10, 12)  # choice j samples with seed + j
    assert first.max_new_tokens == 6 and first.temperature == 0.5 and first.top_k == 0 and first.top_p == 1.0
    assert first.stop_strings == ("\n",)
    assert sampling_params(CompletionRequest(model="tiny", prompt="x"), 1, 3).seed is None


def test_logprobs_fields(validator, tiny_tokenizer):
    """Completions: ``logprobs`` k (0..20), with ``echo`` for the prompt too, ``max_tokens`` 0 with echo (the prompt
    only, one engine token); chat: ``logprobs`` true with ``top_logprobs`` k. A decoder without left-to-right tokens
    refuses them, naming the field."""
    from pydantic import ValidationError

    from dlm.decode.sampling import MAX_LOGPROBS
    from dlm.serve.schemas import MAX_LOGPROBS as API_MAX

    assert API_MAX == MAX_LOGPROBS
    body = CompletionRequest(model="tiny", prompt=[1, 2, 3], echo=True, logprobs=1, max_tokens=0)
    parsed = validator.completion(body)
    assert (parsed.logprobs, parsed.echo, parsed.max_tokens) == (1, True, 0)
    sp = sampling_params(body, parsed.max_tokens, 0, parsed.logprobs, parsed.echo)
    assert (sp.logprobs, sp.prompt_logprobs, sp.max_new_tokens) == (1, 1, 1)
    plain = validator.completion(CompletionRequest(model="tiny", prompt="x"))
    assert (plain.logprobs, plain.echo) == (None, False)
    assert sampling_params(CompletionRequest(model="tiny", prompt="x"), 3, 0).logprobs is None
    for bad in (-1, 21):
        with pytest.raises(ValidationError):
            CompletionRequest(model="tiny", prompt="x", logprobs=bad)
    msgs = [{"role": "user", "content": "Hi"}]
    assert validator.chat(ChatCompletionRequest(model="tiny", messages=msgs, logprobs=True)).logprobs == 0
    chat = validator.chat(ChatCompletionRequest(model="tiny", messages=msgs, logprobs=True, top_logprobs=4))
    assert chat.logprobs == 4 and not chat.echo
    assert validator.chat(ChatCompletionRequest(model="tiny", messages=msgs, logprobs=False)).logprobs is None
    refused(validator.chat, ChatCompletionRequest(model="tiny", messages=msgs, top_logprobs=2), 400, "top_logprobs")
    mdm = RequestValidator(validator.settings, tiny_tokenizer, 320, 40, MASK, decoder="mdm", left_to_right=False)
    e = refused(mdm.completion, CompletionRequest(model="tiny", prompt="x", logprobs=0), 400, "logprobs")
    assert "--decode ar or isd" in e.message
    refused(mdm.chat, ChatCompletionRequest(model="tiny", messages=msgs, logprobs=True), 400, "logprobs")
    for field, value in (("presence_penalty", 0.5), ("repetition_penalty", 1.2), ("logit_bias", {"3": 1.0})):
        body = CompletionRequest(model="tiny", prompt="x", **{field: value})
        refused(mdm.completion, body, 400, field)
        validator.completion(body)  # a left-to-right decoder takes it
    refused(validator.completion, CompletionRequest(model="tiny", prompt="x", logit_bias={"320": 1}), 400, "logit_bias")
    sp = sampling_params(
        CompletionRequest(model="tiny", prompt="x", logit_bias={"3": 2}, frequency_penalty=0.5, repetition_penalty=1.1),
        4,
        0,
    )
    assert (sp.logit_bias, sp.frequency_penalty, sp.repetition_penalty, sp.presence_penalty) == (
        ((3, 2.0),),
        0.5,
        1.1,
        0.0,
    )
    assert mdm.completion(CompletionRequest(model="tiny", prompt="x", echo=True)).echo  # echo alone needs no scores


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_tool_choice_makes_the_arguments_the_structured_output(validator):
    pytest.importorskip("llguidance")
    chat = validator.chat
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    p = chat(ChatCompletionRequest(model="tiny", messages=msgs, tools=[WEATHER], tool_choice=named))
    assert p.tool_call == NAMED_TOOL + "get_weather" and p.structured is not None
    assert p.structured.json is not None and '"city"' in p.structured.json
    req = chat(ChatCompletionRequest(model="tiny", messages=msgs, tools=[WEATHER], tool_choice="required"))
    assert req.tool_call == ANY_TOOL and '"minItems": 1' in (req.structured.json or "")
    # a function named "required", called by name, is that function (not tool_choice "required")
    called = dict(WEATHER, function=dict(WEATHER["function"], name="required"))
    by_name = {"type": "function", "function": {"name": "required"}}
    same = chat(ChatCompletionRequest(model="tiny", messages=msgs, tools=[called], tool_choice=by_name))
    assert same.tool_call == NAMED_TOOL + "required" != ANY_TOOL
    none = chat(ChatCompletionRequest(model="tiny", messages=msgs, tools=[WEATHER], tool_choice="none"))
    assert none.tool_call is None and none.structured is None
    for body, param, words in [
        # OpenAI's default with tools, and this template shows no tool-call format
        (dict(tools=[WEATHER]), "tool_choice", "--tool-call-parser hermes"),
        (dict(tool_choice="required"), "tool_choice", "needs 'tools'"),
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
            "tool_choice",
            "not among",
        ),
        (
            dict(tools=[WEATHER], tool_choice=named, response_format={"type": "json_object"}),
            "tool_choice",
            "drop response_format",
        ),
    ]:
        e = refused(chat, ChatCompletionRequest(model="tiny", messages=msgs, **body), param=param)
        assert words in e.message, e.message


def test_tools_and_earlier_calls_reach_the_chat_template(validator):
    """The functions reach the template as ``tools``; an assistant's earlier call its arguments as an object."""
    tok = validator.tokenizer
    saved = tok.chat_template
    tok.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} city={{ c.function.arguments.city }}]{% endfor %}"
        "{% if m.tool_call_id %}[id {{ m.tool_call_id }}]{% endif %}{% endfor %}"
    )
    try:
        msgs = [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        ]
        body = ChatCompletionRequest(model="tiny", messages=msgs, tools=[WEATHER], tool_choice="none")
        text = validator.chat_text(body.messages, tools=[t.model_dump(exclude_none=True) for t in body.tools])
        assert text.startswith("[tool get_weather]<user>Weather in Paris?")
        assert "[call get_weather city=Paris]" in text and "<tool>sunny[id c1]" in text
    finally:
        tok.chat_template = saved
