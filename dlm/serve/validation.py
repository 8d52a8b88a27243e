"""Request parsing and validation: an API body (:mod:`dlm.serve.schemas`, already type-checked by pydantic) to
the engine's requests - prompt token ids, a ``max_tokens``, one :class:`~dlm.decode.sampling.SamplingParams` per
choice - or an :class:`~dlm.serve.schemas.APIError` naming the field. What pydantic cannot know is checked here:
the served model name, ``--max-tokens-limit``, the context length, the vocabulary, the chat template.

No HTTP here: a :class:`RequestValidator` needs only the settings and the engine's tokenizer and limits::

    v = RequestValidator.for_engine(engine, ServeSettings(model_name="tiny"))
    parsed = v.completion(CompletionRequest(model="tiny", prompt="Hello", max_tokens=8))
    parsed.prompts, parsed.max_tokens      # ([[...ids...]], 8)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlm.decode.configs import refusal_message
from dlm.decode.sampling import SamplingParams
from dlm.decode.structured import StructuredOutput
from dlm.errors import DLMError
from dlm.serve import reasoning, tool_calls
from dlm.serve.reasoning import Thinking, opens_in_prompt
from dlm.serve.schemas import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequest
from dlm.serve.settings import ServeSettings
from dlm.serve.tool_calls import reader

# apply_chat_template's own arguments and what the request's fields set: not for chat_template_kwargs
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
ANY_TOOL = "*"  # ParsedRequest.tool_call of tool_choice "required" (no function name has a "*")
NAMED_TOOL = "="  # ParsedRequest.tool_call of a named tool_choice: "=" + the function's name


@dataclass
class ParsedRequest:
    """A checked request: the prompts (token ids; one per completion prompt, one for a chat), the new-token limit
    of each choice (0: the prompt only, a completion with echo), the alternatives per token of the answer's
    log-probabilities (None: none), whether the answer starts with the prompt (``echo``, with the prompt tokens'
    log-probabilities when ``logprobs`` is set), what the answer must match (``response_format`` /
    ``structured_outputs``, or a tool call's arguments; None: free text)."""

    prompts: list[list[int]]
    max_tokens: int
    logprobs: int | None = None
    echo: bool = False
    structured: StructuredOutput | None = None
    # chat: how the answer is read as tool calls (dlm.serve.tool_calls.reader): NAMED_TOOL + the function a named
    # tool_choice calls, ANY_TOOL ("required"), or the parser of the model's format ("auto"); None: plain text
    tool_call: str | None = None
    tool_names: frozenset[str] = frozenset()  # the functions the answer may call
    # chat: how the answer's reasoning is read (dlm.serve.reasoning): "open" (the prompt opened a <think> block),
    # "tags" (the answer may open one); None: no reasoning parser
    reasoning: str | None = None
    suffix_ids: tuple[int, ...] = ()  # completions' suffix: the text after the answer (fill-in-the-middle)

    def reader(self):
        """A fresh reader of one choice's answer as reasoning, content and tool calls, or None (all content)."""

        calls = None if self.tool_call is None else reader(self.tool_call, self.tool_names)
        return calls if self.reasoning is None else Thinking(self.reasoning == "open", then=calls)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def sampling_params(
    body: SamplingRequest,
    max_tokens: int,
    choice: int,
    logprobs: int | None = None,
    echo: bool = False,
    eos_ids: tuple[int, ...] = (),
    structured: StructuredOutput | None = None,
    suffix_ids: tuple[int, ...] = (),
) -> SamplingParams:
    """The engine's sampling parameters for choice ``choice`` of ``body`` (choice j samples with ``seed + j``);
    ``logprobs``: alternatives per token (None: none), for the prompt's tokens too with ``echo``. ``max_tokens``
    0 (the prompt only) runs one token, which the answer leaves out; ``eos_ids``: the model's end-of-sequence
    tokens, which ``stop_token_ids`` add to; ``structured``: the checked structured output; ``suffix_ids``: the
    text after the answer (a completion's ``suffix``)."""

    seed = None if body.seed is None else body.seed + choice
    stop_ids = None  # the engine's default: end-of-sequence (none with ignore_eos)
    if body.stop_token_ids:  # vLLM's: in addition to end-of-sequence
        stop_ids = sorted(set(body.stop_token_ids) | (set() if body.ignore_eos else set(eos_ids)))
    return SamplingParams(
        max_new_tokens=max(max_tokens, 1),
        repetition_penalty=1.0 if body.repetition_penalty is None else float(body.repetition_penalty),
        presence_penalty=float(body.presence_penalty or 0.0),
        frequency_penalty=float(body.frequency_penalty or 0.0),
        logit_bias=tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items()),
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=max(body.top_k or 0, 0),
        seed=seed,
        stop_strings=tuple(body.stop_list()),
        ignore_eos=body.ignore_eos,
        stop_token_ids=None if stop_ids is None else tuple(stop_ids),
        min_tokens=min(body.min_tokens, max(max_tokens, 1)),
        structured=structured,
        suffix_ids=suffix_ids,
    )


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it: role and content; an assistant's ``tool_calls`` with their arguments
    as objects (transformers' convention; OpenAI sends them as JSON text) and a tool message's ``tool_call_id``."""
    import json

    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            call = dict(call)
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass  # the template gets the text as it came
            call["function"] = fn
            calls.append(call)
        out["tool_calls"] = calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def max_tokens_of(body: SamplingRequest) -> int | None:
    """The new-token limit a body gives (chat: ``max_completion_tokens`` first), None where it gives none."""
    limit = getattr(body, "max_completion_tokens", None)
    return limit if limit is not None else body.max_tokens


class RequestValidator:
    """Checks request bodies against the server's settings and the model; see the module docstring."""

    def __init__(
        self,
        settings: ServeSettings,
        tokenizer: Any,
        vocab_size: int,
        max_positions: int,
        mask_token_id: int | None = None,
        decoder: str | None = None,
        left_to_right: bool = True,
        eos_ids: tuple[int, ...] = (),
        fills_middle: bool = False,
    ):
        self.settings = settings
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.mask_token_id = mask_token_id
        self.decoder = decoder  # the engine's decoder name (for messages)
        self.left_to_right = left_to_right  # whether its tokens have a log-probability (ar, isd)
        self.eos_ids = eos_ids  # the engine's default stop tokens
        self.fills_middle = fills_middle  # whether the decoder takes a suffix (mdm)

        self.tool_parser = tool_calls.resolve(settings.tool_call_parser, tokenizer)  # read for tool_choice "auto"
        self.reasoning_parser = tool_calls.resolve(settings.reasoning_parser, tokenizer, reasoning.detect)
        # a grammar can start after the reasoning block where <think> and </think> are one token each here
        self.thinks_in_tokens = self.reasoning_parser is not None and reasoning.tags_are_tokens(tokenizer)

    @classmethod
    def for_engine(cls, engine: Any, settings: ServeSettings) -> RequestValidator:
        """The validator of ``engine``'s model (its tokenizer, vocabulary, context length and mask token)."""
        return cls(
            settings,
            engine.tokenizer,
            int(engine.config.vocab_size),
            int(engine.max_positions),
            engine.mask_token_id,
            engine.decoder.name,
            bool(engine.decoder.causal),
            tuple(sorted(engine.default_stop)),
            bool(getattr(engine.decoder, "fills_middle", False)),
        )

    # -- the two request kinds -------------------------------------------------------------------------------
    def completion(self, body: CompletionRequest) -> ParsedRequest:
        """``/v1/completions``: OpenAI's four prompt forms (a string, strings, token ids, lists of token ids)."""
        max_tokens = self.common(body, body.max_tokens, self.settings.completion_default_max_tokens)
        p = body.prompt
        if isinstance(p, str):
            prompts = [self.encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [self.encode(x) for x in p]  # type: ignore[arg-type]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]  # type: ignore[arg-type]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            raise APIError(400, "the prompt is empty; send a string, a list of strings or token ids", param="prompt")
        self.scored(body.logprobs, "logprobs")
        prompt_ids = [self.prompt_ids(x) for x in prompts]
        suffix = self.suffix(body.suffix, prompt_ids, max_tokens) if body.suffix else ()
        return ParsedRequest(prompt_ids, max_tokens, body.logprobs, body.echo, self.structured(body), suffix_ids=suffix)

    def suffix(self, text: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, ...]:
        """A completion's ``suffix`` as token ids: 400 naming it unless the decoder fills the middle (mdm) and
        every prompt, its answer and the suffix fit the context together."""
        if not self.fills_middle:
            message = refusal_message(str(self.decoder), "suffix", "suffix (text after the answer: fill-in-the-middle)")
            raise APIError(400, message, param="suffix", code="unsupported_parameter")
        ids = self.encode(text)
        if self.mask_token_id is not None and self.mask_token_id in ids:
            raise APIError(400, "the suffix holds the mask token; remove it", param="suffix")
        longest = max(len(p) for p in prompts) + max(max_tokens, 1) + len(ids)
        if longest > self.max_positions:
            raise APIError(
                400,
                f"prompt + max_tokens + suffix is {longest} tokens, over the model's context of {self.max_positions}; "
                f"shorten one of them",
                param="suffix",
            )
        return tuple(ids)

    def chat(self, body: ChatCompletionRequest) -> ParsedRequest:
        """``/v1/chat/completions``: the messages through the model's chat template, with the generation prompt."""
        max_tokens = self.common(body, max_tokens_of(body), self.settings.max_tokens_limit)
        tool_call, calls = self.tool_call(body)
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tool_choice != "none" else []
        text = self.chat_text(
            body.messages,
            body.add_generation_prompt,
            tools=tools or None,
            continue_final_message=body.continue_final_message,
            extra=body.chat_template_kwargs,
        )
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self.scored(logprobs, "logprobs")
        prompt_ids = [self.prompt_ids(self.encode(text), param="messages")]
        structured = self.structured(body)
        if calls is not None:
            if structured is not None:
                raise APIError(
                    400,
                    "a tool call's arguments are the structured output: drop response_format / "
                    "structured_outputs, or set tool_choice to 'none'",
                    param="tool_choice",
                )
            structured = calls
        names = frozenset(t.function.name for t in body.tools or [])
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = "open" if opens_in_prompt(text) else "tags"
            if structured is not None and self.thinks_in_tokens:  # the reasoning stays free, then the grammar
                import dataclasses

                structured = dataclasses.replace(structured, after_thinking=reasoning)
        return ParsedRequest(
            prompt_ids,
            max_tokens,
            logprobs,
            structured=structured,
            tool_call=tool_call,
            tool_names=names,
            reasoning=reasoning,
        )

    def tool_call(self, body: ChatCompletionRequest) -> tuple[str | None, StructuredOutput | None]:
        """A chat's ``tool_choice`` over its ``tools``: (how its answer is read as calls - see
        :attr:`ParsedRequest.tool_call` -, the structured output a named or required call's arguments must match),
        or (None, None) for plain text. 400 naming the field for ``"auto"`` without a parser of the model's own
        tool-call format, a function that is not among the tools, or a named / required call with a decoder that
        does not draw tokens left to right."""

        choice, tools = body.tool_choice, body.tools or []
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "none":
            return None, None
        if not tools:
            raise APIError(400, "tool_choice needs 'tools' (the functions the answer may call)", param="tool_choice")
        if choice == "auto":
            if self.tool_parser is None:
                raise APIError(
                    400,
                    f"tool_choice 'auto' (the default with tools) reads the model's own tool-call format, and the chat "
                    f"template of '{self.settings.model_name}' shows none dlm serve knows; start dlm serve with "
                    f"--tool-call-parser hermes or llama3_json if the model writes one of those, or set tool_choice "
                    f"to 'required' (the answer calls one or more of the tools), to "
                    f"{{'type': 'function', 'function': {{'name': ...}}}} (it calls that one) or to 'none'",
                    param="tool_choice",
                    code="unsupported_parameter",
                )
            return self.tool_parser, None
        self.left_to_right_only("tool_choice")
        by_name = {t.function.name: t.function.parameters or {"type": "object"} for t in tools}
        if choice == "required":  # vLLM's shape: a list of {"name": ..., "parameters": {...}}
            schema = {
                "type": "array",
                "minItems": 1,
                "items": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                            "required": ["name", "parameters"],
                            "additionalProperties": False,
                        }
                        for name, params in by_name.items()
                    ]
                },
            }
            mode = ANY_TOOL
        else:
            assert not isinstance(choice, str)
            name = choice.function.name
            mode = NAMED_TOOL + name
            if name not in by_name:
                raise APIError(
                    400,
                    f"tool_choice names '{name}', which is not among the tools ({', '.join(by_name)})",
                    param="tool_choice",
                )
            schema = by_name[name]
        try:
            spec = StructuredOutput(json=schema, disable_any_whitespace=True)  # read by programs: no free space
            spec.check()
        except DLMError as e:
            raise APIError(
                400, f"tools: a function's parameters are not a usable JSON schema: {e}", param="tools"
            ) from e
        return mode, spec

    def chat_text(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The messages (with ``tools``, the functions the model may call) through the model's chat template, the
        last one left open with ``continue_final_message``, ``extra`` as more template variables (vLLM's
        ``chat_template_kwargs``, e.g. ``enable_thinking``); 400 naming ``messages`` for none, no template, or a
        template that refuses them, and ``chat_template_kwargs`` for a variable the server sets itself."""
        if not messages:
            raise APIError(400, "'messages' is empty; send at least one message", param="messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(
                400,
                f"the model '{self.settings.model_name}' has no chat template in its tokenizer; use "
                f"/v1/completions with a plain prompt",
                param="messages",
            )
        extra = dict(extra or {})
        taken = sorted(set(extra) & TEMPLATE_ARGUMENTS)
        if taken:
            raise APIError(
                400,
                f"chat_template_kwargs: {', '.join(taken)} set by the request's own fields or the server; "
                f"leave them out (messages, tools, add_generation_prompt, continue_final_message are fields)",
                param="chat_template_kwargs",
            )
        msgs = [_template_message(m) for m in messages]
        try:
            text: str = self.tokenizer.apply_chat_template(
                msgs,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                tools=tools,
                continue_final_message=continue_final_message,
                **extra,
            )
        except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the client's to fix
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from e
        return text

    # -- the checks ---------------------------------------------------------------------------------------
    def model(self, name: str) -> None:
        """404 unless ``name`` is the served model."""
        if name != self.settings.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist here; this server serves '{self.settings.model_name}' "
                f"(see /v1/models)",
                param="model",
                code="model_not_found",
            )

    def common(self, body: SamplingRequest, max_tokens: int | None, default_max: int) -> int:
        """The checks of both request kinds (model, fields set to what the server cannot do, --max-tokens-limit);
        returns the new-token limit (``default_max`` when the body gives none)."""
        self.model(body.model)
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        self.adjustments(body)
        if max_tokens is None:
            return default_max
        if max_tokens > self.settings.max_tokens_limit:
            raise APIError(
                400,
                f"max_tokens={max_tokens} is over this server's limit of "
                f"{self.settings.max_tokens_limit} (--max-tokens-limit); ask for fewer tokens",
                param="max_tokens",
                code="invalid_value",
            )
        return max_tokens

    def adjustments(self, body: SamplingRequest) -> None:
        """400 naming the field for stop tokens or a logit bias outside the vocabulary, a bias out of range,
        ``min_tokens`` over the limit, or any bias or penalty with a decoder that does not draw tokens left to
        right."""
        self.in_vocabulary(body.stop_token_ids or [], "stop_token_ids")
        limit = max_tokens_of(body)
        if body.min_tokens and limit is not None and body.min_tokens > limit:
            raise APIError(400, f"min_tokens={body.min_tokens} is more than max_tokens={limit}", param="min_tokens")
        for key, value in (body.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit() or not 0 <= int(key) < self.vocab_size:
                raise APIError(
                    400,
                    f"logit_bias key {key!r} is not a token id of this model (0..{self.vocab_size - 1})",
                    param="logit_bias",
                )
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias")
        for field in ("logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens"):
            value = getattr(body, field)
            if value not in (None, 0, 0.0, {}) and not (field == "repetition_penalty" and value == 1):
                self.left_to_right_only(field)

    def structured(self, body: SamplingRequest) -> StructuredOutput | None:
        """What the answer must match: ``response_format`` (OpenAI's) or ``structured_outputs`` (vLLM's), checked
        (400 naming the field for both at once, an invalid schema, regex or grammar, or a decoder that does not
        draw tokens left to right); None for free text."""

        fmt, so = body.response_format, body.structured_outputs
        if fmt is not None and fmt.type == "text":
            fmt = None
        if fmt is not None and so is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        if fmt is None and so is None:
            return None
        param = "response_format" if fmt is not None else "structured_outputs"
        self.left_to_right_only(param)
        try:
            if fmt is not None and fmt.type == "json_object":
                spec = StructuredOutput(json_object=True)
            elif fmt is not None:
                schema = fmt.json_schema.json_schema if fmt.json_schema is not None else None
                if schema is None:
                    raise DLMError("type 'json_schema' needs json_schema.schema (a JSON schema object)")
                spec = StructuredOutput(json=schema)
            else:
                assert so is not None
                spec = StructuredOutput(
                    json=so.json_,
                    json_object=bool(so.json_object),
                    regex=so.regex,
                    choice=None if so.choice is None else tuple(so.choice),
                    grammar=so.grammar,
                    disable_any_whitespace=so.disable_any_whitespace,
                )
            spec.check()
        except DLMError as e:
            raise APIError(400, f"{param}: {e}", param=param) from e
        return spec

    def scored(self, logprobs: int | None, param: str) -> None:
        """400 for log-probabilities from a decoder whose tokens have none."""
        if logprobs is not None:
            self.left_to_right_only(param)

    def left_to_right_only(self, param: str) -> None:
        """400 naming ``param`` (log-probabilities, a bias, a penalty) unless the decoder draws tokens left to
        right."""
        if not self.left_to_right:
            message = refusal_message(str(self.decoder), "scores", param)
            raise APIError(400, message, param=param, code="unsupported_parameter")

    def prompt_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        """``ids`` if the model can take them as a prompt: non-empty, shorter than the context, in the vocabulary,
        without the mask token."""
        if not ids:
            raise APIError(400, "the prompt is empty (0 tokens); send some text", param=param)
        if len(ids) >= self.max_positions:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but the model's context is "
                f"{self.max_positions}; shorten it to at most {self.max_positions - 1} tokens",
                param=param,
                code="context_length_exceeded",
            )
        self.in_vocabulary(ids, param)
        if self.mask_token_id is not None and self.mask_token_id in ids:
            raise APIError(
                400, f"the prompt contains the model's mask token (id {self.mask_token_id}); remove it", param=param
            )
        return ids

    def in_vocabulary(self, ids: list[int], param: str) -> None:
        """400 naming ``param`` for a token id outside the model's vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param=param)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids
