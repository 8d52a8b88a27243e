"""Reading a chat answer as OpenAI's ``content`` and ``tool_calls`` (:mod:`dlm.serve.tool_calls`) and vLLM's
``reasoning_content`` (:mod:`dlm.serve.reasoning`): each format's calls, reasoning and content, the same message
however the text is cut into streamed pieces, the format found in a chat template, and the request checks that pick
the reader."""

from __future__ import annotations

import json

import pytest

from dlm.errors import DLMError
from dlm.serve.tool_calls import Call, detect, read_all, reader, resolve, template_in_folder

NAMES = frozenset({"get_weather", "now"})
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'


def streamed(mode: str, text: str, cuts: list[int]) -> tuple[str, list[Call]]:
    """``text`` fed to a reader in pieces cut at ``cuts``, joined the way a streaming client joins its deltas."""
    r = reader(mode, NAMES)
    pieces = []
    bounds = [0, *sorted(cuts), len(text)]
    for a, b in zip(bounds, bounds[1:]):
        pieces += r.feed(text[a:b])
    pieces += r.finish()
    content, calls = "", []
    for kind, value in pieces:
        if kind == "content":
            content += value
        elif kind == "call":
            calls.append(Call(value.name, value.arguments))
        else:
            calls[-1].arguments += value
    return content, calls


def same_however_cut(mode: str, text: str) -> tuple[str, list[Call]]:
    """The message of ``text`` read whole, asserted equal to it read in two pieces at every cut and a character at
    a time (what a stream sends must add up to what a collected answer holds)."""
    whole = read_all(reader(mode, NAMES), text)[:2]
    for k in range(len(text) + 1):
        assert streamed(mode, text, [k]) == whole, (mode, text, k)
    assert streamed(mode, text, list(range(len(text)))) == whole
    return whole


def calls(*pairs):
    return [Call(n, a) for n, a in pairs]


@pytest.mark.parametrize(
    "text, content, want",
    [
        # Qwen2.5 / Qwen3's own layout: a line before, each call on its own lines
        (
            f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" + '{"name": "now"}\n</tool_call>',
            "Let me check.",
            [("get_weather", '{"city": "Paris", "unit": "°C"}'), ("now", "{}")],
        ),
        (f"<tool_call>{WEATHER}</tool_call>\nDone.", "\nDone.", [("get_weather", '{"city": "Paris", "unit": "°C"}')]),
        # arguments written as JSON text are read as the object they spell
        (
            '<tool_call>{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
            "",
            [("now", '{"tz": "UTC"}')],
        ),
        # a closing tag an argument spells does not close the block
        (
            '<tool_call>{"name": "now", "arguments": {"s": "a</tool_call>\\""}}</tool_call>',
            "",
            [("now", '{"s": "a</tool_call>\\""}')],
        ),
        # the last block left open by the end of the answer (EOS before the closing tag)
        ('Sure <tool_call>{"name": "now", "arguments": {}}', "Sure", [("now", "{}")]),
        # not calls: an unknown function, broken JSON, arguments that are not an object, a block cut short
        ('a <tool_call>{"name": "launch", "arguments": {}}</tool_call> b', None, []),
        ("a <tool_call>{not json}</tool_call>", None, []),
        ('<tool_call>{"name": "now", "arguments": [1]}</tool_call>', None, []),
        ('<tool_call>{"name": "now", "argu', None, []),
        # plain answers: the text as it is, trailing space and a tag's first letters included
        ("It is sunny. <tool_", None, []),
        ("Two lines\n\n", None, []),
        ("", None, []),
    ],
)
def test_hermes(text, content, want):
    got_content, got_calls = same_however_cut("hermes", text)
    assert got_calls == calls(*want)
    assert got_content == (text if content is None else content)


def test_llama3_json():
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert same_however_cut("llama3_json", one) == ("", calls(("get_weather", '{"city": "Oslo"}')))
    two = ' {"name": "now", "parameters": {}}; ' + one
    assert same_however_cut("llama3_json", two)[1] == calls(("now", "{}"), ("get_weather", '{"city": "Oslo"}'))
    # prose, JSON that is not a call, and text after the calls
    for text in ['The answer is {"name": "now"}', '{"answer": 42}', "", "  \n"]:
        assert same_however_cut("llama3_json", text) == (text, []), text
    assert same_however_cut("llama3_json", one + " Anything else?") == (
        "Anything else?",  # the separators after a call are not text
        calls(("get_weather", '{"city": "Oslo"}')),
    )
    assert same_however_cut("llama3_json", '{"name": "now", "parameters": {"tz"') == (
        '{"name": "now", "parameters": {"tz"',
        [],
    )


def test_required_list_and_named_arguments():
    listed = '[{"name":"now","parameters":{}},{"name":"get_weather","parameters":{"city":"Oslo"}}]'
    assert same_however_cut("*", listed) == ("", calls(("now", "{}"), ("get_weather", '{"city": "Oslo"}')))
    # cut short: the calls that closed, the rest as text
    cut = listed[:-12]
    content, got = same_however_cut("*", cut)
    assert got == calls(("now", "{}")) and content == cut[len('[{"name":"now","parameters":{}},') :]
    # named: the text is the arguments, sent as they come (a cut answer: the arguments so far)
    for text in ['{"city":"Oslo"}', '{"ci', ""]:
        assert same_however_cut("=get_weather", text) == ("", calls(("get_weather", text)))
    r = reader("=get_weather", NAMES)
    assert r.feed('{"ci') == [("call", Call("get_weather")), ("arguments", '{"ci')]
    assert r.feed('ty":1}') == [("arguments", 'ty":1}')] and r.finish() == []


QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    'For each function call, return a json object within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{%- endif %}'
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
LLAMA_LIKE = (
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools %}{{- 'Environment: ipython\\n' }}"
    "{%- endif %}{%- for m in messages %}{{ m.content }}{%- if m.tool_calls %}{{- '<|python_tag|>' }}{% endif %}"
    "{% endfor %}"
)


class _Tok:
    def __init__(self, template):
        self.chat_template = template


def test_the_format_is_found_in_the_chat_template():
    assert detect(_Tok(QWEN_LIKE)) == "hermes"
    assert detect(_Tok(LLAMA_LIKE)) == "llama3_json"
    assert detect(_Tok({"default": QWEN_LIKE, "tool_use": LLAMA_LIKE})) == "llama3_json"  # tools: tool_use's
    assert detect({"default": QWEN_LIKE, "rag": LLAMA_LIKE}) == "hermes"
    for tok in (_Tok("{% for m in messages %}{{ m.content }}{% endfor %}"), _Tok(None), object()):
        assert detect(tok) is None
    assert resolve("auto", QWEN_LIKE) == "hermes" and resolve("auto", None) is None
    assert resolve("auto", _Tok(QWEN_LIKE)) == "hermes" and resolve("none", _Tok(QWEN_LIKE)) is None
    assert resolve("llama3_json", _Tok(None)) == "llama3_json"  # a flag given by hand is taken as it is
    from dlm.serve.settings import ServeSettings

    with pytest.raises(DLMError, match="--tool-call-parser must be one of auto, none, hermes, llama3_json"):
        ServeSettings(tool_call_parser="qwen")


def test_the_template_is_read_from_a_model_folder(tmp_path):
    """``--engine vllm`` finds the format without loading the tokenizer: the template file or the field that
    transformers saves, whichever the folder has."""
    from dlm.testing import make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = QWEN_LIKE
    tok.save_pretrained(tmp_path / "saved")
    assert template_in_folder(tmp_path / "saved") == QWEN_LIKE
    (tmp_path / "field").mkdir()
    (tmp_path / "field" / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA_LIKE}))
    assert resolve("auto", template_in_folder(tmp_path / "field")) == "llama3_json"
    (tmp_path / "named").mkdir()
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": QWEN_LIKE}]
    (tmp_path / "named" / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert template_in_folder(tmp_path / "named") == {"default": "plain", "tool_use": QWEN_LIKE}
    assert resolve("auto", template_in_folder(tmp_path / "named")) == "hermes"
    assert template_in_folder(tmp_path) is None


def test_tool_choice_auto_with_a_template_that_writes_tool_calls():
    """With a chat template in the hermes format, ``"auto"`` (given or by default with tools) is accepted, free
    text (no structured output), streamable; ``--tool-call-parser none`` refuses it again, naming the field."""
    pytest.importorskip("fastapi")
    from dlm.serve.schemas import APIError, ChatCompletionRequest
    from dlm.serve.settings import ServeSettings
    from dlm.serve.validation import RequestValidator
    from dlm.testing import make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = QWEN_LIKE
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Time?"}]
    v = RequestValidator(ServeSettings(model_name="tiny"), tok, vocab_size=320, max_positions=512)
    for extra in ({}, {"tool_choice": "auto"}, {"stream": True}):
        p = v.chat(ChatCompletionRequest(model="tiny", messages=msgs, tools=tools, **extra))
        assert p.tool_call == "hermes" and p.structured is None and p.tool_names == {"now"}
    prompt = tok.decode(p.prompts[0])
    assert '"name": "now"' in prompt and "<tool_call>" in prompt  # the tools reach the template
    off = RequestValidator(ServeSettings(model_name="tiny", tool_call_parser="none"), tok, 320, 512)
    with pytest.raises(APIError) as e:
        off.chat(ChatCompletionRequest(model="tiny", messages=msgs, tools=tools))
    assert e.value.param == "tool_choice" and "--tool-call-parser" in e.value.message


def thought(text: str, inside: bool, tools: str | None = None) -> tuple[str, list[Call], str | None]:
    """``text`` through the reasoning reader (``tools``: then a tool-call reader), asserted the same however cut."""
    from dlm.serve.reasoning import Thinking

    def make():
        return Thinking(inside, then=None if tools is None else reader(tools, NAMES))

    whole = read_all(make(), text)
    for cuts in [[k] for k in range(len(text) + 1)] + [list(range(len(text)))]:
        r, pieces = make(), []
        bounds = [0, *cuts, len(text)]
        for a, b in zip(bounds, bounds[1:]):
            pieces += r.feed(text[a:b])
        pieces += r.finish()
        content = "".join(v for k, v in pieces if k == "content")
        got_calls = [v for k, v in pieces if k == "call"]
        parts = [v for k, v in pieces if k == "reasoning"]
        assert (content, got_calls, "".join(parts) if parts else None) == whole, (text, cuts)
    return whole


def test_reasoning_is_split_from_the_content():
    # the model opens the block (Qwen3)
    assert thought("<think>\nplan it</think>\n\nIt is 12.", inside=False) == ("It is 12.", [], "\nplan it")
    assert thought("\n<think>a</think>b", inside=False) == ("b", [], "a")
    assert thought("<think></think>\n\nOK", inside=False) == ("OK", [], None)  # enable_thinking off: empty
    for plain in ["It is 12.", "x <think>y</think>", "<thin", " ", ""]:  # no block at the start: all content
        assert thought(plain, inside=False) == (plain, [], None), plain
    # the template opened it at the end of the prompt (DeepSeek-R1, thinking-only Qwen3)
    assert thought("plan</think>\n\nAnswer", inside=True) == ("Answer", [], "plan")
    # left open by max_tokens: all reasoning
    assert thought("<think>plan </thi", inside=False) == ("", [], "plan </thi")
    assert thought("plan", inside=True) == ("", [], "plan")
    # a call the model only thinks about is not a call; the one after the block is
    call = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    text = f"<think>maybe {call}?</think>\nSure.\n{call}"
    assert thought(text, inside=False, tools="hermes") == ("Sure.", [Call("now", "{}")], f"maybe {call}?")


def test_the_reasoning_format_is_found_in_the_chat_template():
    from dlm.serve.reasoning import detect as detect_reasoning
    from dlm.serve.reasoning import opens_in_prompt
    from dlm.serve.settings import ServeSettings

    qwen3 = QWEN_LIKE + "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{% endif %}"
    assert detect_reasoning(_Tok(qwen3)) == "think" and detect_reasoning(_Tok(QWEN_LIKE)) is None
    assert detect_reasoning(_Tok(None)) is None
    assert resolve("auto", _Tok(qwen3), detect=detect_reasoning) == "think"
    assert (
        resolve("none", _Tok(qwen3), detect_reasoning) is None
        and resolve("think", _Tok(None), detect_reasoning) == "think"
    )
    assert opens_in_prompt("<|im_start|>assistant\n<think>\n") and not opens_in_prompt("<think>\n\n</think>\n\n")
    with pytest.raises(DLMError, match="--reasoning-parser must be one of auto, none, think"):
        ServeSettings(reasoning_parser="qwen3")


def test_chat_template_fields_reach_the_template():
    """vLLM's ``chat_template_kwargs`` (e.g. Qwen3's ``enable_thinking``), ``add_generation_prompt`` and
    ``continue_final_message`` shape the prompt; variables the server sets itself and contradictory fields are a
    400 naming the field; a prompt the template leaves inside ``<think>`` has its answer read as reasoning first."""
    pytest.importorskip("fastapi")
    from dlm.serve.schemas import APIError, ChatCompletionRequest
    from dlm.serve.settings import ServeSettings
    from dlm.serve.validation import RequestValidator
    from dlm.testing import make_tokenizer

    tok = make_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if not (continue_final_message and loop.last) %}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n"
        "{% endif %}{% endif %}"
    )
    v = RequestValidator(ServeSettings(model_name="tiny"), tok, vocab_size=320, max_positions=512)
    msgs = [{"role": "user", "content": "Time?"}]

    def prompt(**kw):
        p = v.chat(ChatCompletionRequest(model="tiny", messages=kw.pop("messages", msgs), **kw))
        return tok.decode(p.prompts[0]), p

    text, p = prompt()
    assert text.endswith("<think>\n") and p.reasoning == "open"  # found in the template: the answer starts inside
    text, p = prompt(chat_template_kwargs={"enable_thinking": False})
    assert text.endswith("</think>\n\n") and p.reasoning == "tags"
    text, _ = prompt(add_generation_prompt=False)
    assert text.endswith("Time?<|im_end|>\n")
    partial = msgs + [{"role": "assistant", "content": "It is"}]
    text, _ = prompt(messages=partial, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nIt is")
    for kw, param in [
        (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs"),
        (dict(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
        (dict(messages=partial, continue_final_message=True), "continue_final_message"),  # and a generation prompt
        (dict(add_generation_prompt=False, continue_final_message=True), "continue_final_message"),  # user last
    ]:
        with pytest.raises(APIError) as e:
            prompt(**kw)
        assert e.value.param == param, kw
    off = RequestValidator(ServeSettings(model_name="tiny", reasoning_parser="none"), tok, 320, 512)
    assert off.chat(ChatCompletionRequest(model="tiny", messages=msgs)).reasoning is None


def test_structured_outputs_leave_the_reasoning_free():
    """With a reasoning parser and ``<think>`` / ``</think>`` one token each, a structured output (and a tool
    call's arguments) starts after the reasoning block - ``open`` where the prompt opened it, ``tags`` where the
    answer may; where the tags are several tokens it constrains the whole answer, as without a parser."""
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    from dlm.serve.schemas import ChatCompletionRequest
    from dlm.serve.settings import ServeSettings
    from dlm.serve.validation import RequestValidator
    from dlm.testing import make_tokenizer

    tok = make_tokenizer(318)
    tok.add_tokens(["<think>", "</think>"])
    opening = "{% for m in messages %}{{ m.content }}{% endfor %}<|im_start|>assistant\n"
    msgs = [{"role": "user", "content": "Time?"}]
    fmt = {"type": "json_object"}
    for template, mode in [(opening + "<think>\n", "open"), (opening + "{# <think> #}", "tags")]:
        tok.chat_template = template
        v = RequestValidator(ServeSettings(model_name="tiny"), tok, vocab_size=320, max_positions=512)
        p = v.chat(ChatCompletionRequest(model="tiny", messages=msgs, response_format=fmt))
        assert p.reasoning == mode and p.structured.after_thinking == mode
        named = {"type": "function", "function": {"name": "now"}}
        tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
        call = v.chat(ChatCompletionRequest(model="tiny", messages=msgs, tools=tools, tool_choice=named))
        assert call.structured.after_thinking == mode
        off = RequestValidator(ServeSettings(model_name="tiny", reasoning_parser="none"), tok, 320, 512)
        assert (
            off.chat(ChatCompletionRequest(model="tiny", messages=msgs, response_format=fmt)).structured.after_thinking
            is None
        )
    plain = make_tokenizer()  # "<think>" is several tokens here
    plain.chat_template = opening + "<think>\n"
    v = RequestValidator(ServeSettings(model_name="tiny"), plain, vocab_size=320, max_positions=512)
    p = v.chat(ChatCompletionRequest(model="tiny", messages=msgs, response_format=fmt))
    assert p.reasoning == "open" and p.structured.after_thinking is None
