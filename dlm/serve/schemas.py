"""Request bodies of the OpenAI-compatible API and the OpenAI error shape.

Known fields are typed strictly (``"5"`` is not an integer, ``"yes"`` is not a boolean) so that a client bug is a
400 naming the field rather than a silent coercion; unknown fields are ignored, as OpenAI-compatible servers do
(clients send newer fields freely). Limits that depend on how the server was started (``--max-tokens-limit``,
the served model name, the context length) are checked by :mod:`dlm.serve.validation`, not here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

MAX_LOGPROBS = 20  # alternatives per token (= dlm.decode.sampling.MAX_LOGPROBS, without importing torch here)
MAX_N = 16  # choices per request
MAX_STOP = 8  # stop strings per request
MAX_PROMPTS = 64  # prompts in one /v1/completions batch


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Body):
    """``response_format.json_schema`` (OpenAI's): the schema under ``schema``; ``name``, ``description`` and
    ``strict`` are accepted (the schema is always enforced)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``{"type": "text"}`` (the default), ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON schema, as an object or its text),
    ``json_object``, ``regex``, ``choice`` or ``grammar`` (Lark, llguidance's dialect)."""

    json_: dict | StrictStr | None = Field(None, alias="json")
    json_object: StrictBool | None = None
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    disable_any_whitespace: StrictBool = False

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class SamplingRequest(_Body):
    """Fields shared by completions and chat completions."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)  # vLLM extension; -1 or 0 = off
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1)  # 64-bit, as OpenAI's (choice j: seed + j)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat | None = Field(None, gt=0.0)  # vLLM extension; 1 = off
    logit_bias: dict[str, StrictFloat | StrictInt] | None = None  # token id (as a string) -> bias in [-100, 100]
    ignore_eos: StrictBool = False  # vLLM extension (benchmarks use it to get fixed-length outputs)
    min_tokens: StrictInt = Field(0, ge=0)  # vLLM extension: no stop token before this many new tokens
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP)  # vLLM extension: stops besides EOS
    response_format: ResponseFormat | None = None  # OpenAI's structured outputs (vLLM takes it on completions too)
    structured_outputs: StructuredOutputs | None = None  # vLLM's

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a known field set to something this server cannot do, else None."""
        if len(self.stop_list()) > MAX_STOP:
            return "stop", f"at most {MAX_STOP} stop strings are allowed, got {len(self.stop_list())}"
        if any(s == "" for s in self.stop_list()):
            return "stop", "stop strings must be non-empty"
        return None


class CompletionRequest(SamplingRequest):
    # a string, a list of strings, a list of token ids, or a list of token-id lists (OpenAI's four forms)
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0: with echo, the prompt (and its logprobs) only
    echo: StrictBool = False  # the prompt's text (and, with logprobs, its tokens' log-probabilities) first
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens=0 returns the prompt only and needs echo=true; ask for at least 1 token"
        if self.echo and self.stream and self.logprobs is not None:
            return "echo", "echo with logprobs is not supported with stream=true; set stream to false (or drop one)"
        if isinstance(self.prompt, list) and len(self.prompt) > MAX_PROMPTS:
            return "prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(self.prompt)}"
        return super().unsupported()


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (given to the chat template)
    tool_call_id: StrictStr | None = None  # a tool message's answer to that call

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """An image (or audio, file) part is refused by its type: dlm serves text (a DiffusionGemma's vision tower
        is kept in its folder, not run)."""
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind != "text":
                    raise ValueError(
                        f"content part type {kind!r} is not supported: dlm serves text only; send 'text' parts"
                    )
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Body):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object (None: any object)


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    """``tool_choice`` naming the function the answer must call."""

    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    # "required" or a named function: the answer is a call, constrained to the functions' parameter schemas;
    # "none": plain text; "auto" (OpenAI's default with tools): free text read in the model's own tool-call format
    # (--tool-call-parser; dlm.serve.tool_calls)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # vLLM's: how the messages go through the chat template
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # more template variables (enable_thinking, ...)
    add_generation_prompt: StrictBool = True  # end with the template's opening of the assistant's answer
    continue_final_message: StrictBool = False  # the answer continues the last (assistant) message

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.continue_final_message and self.add_generation_prompt:
            return (
                "continue_final_message",
                "continue_final_message continues the last message: set add_generation_prompt to false",
            )
        if self.continue_final_message and (not self.messages or self.messages[-1].role != "assistant"):
            return "continue_final_message", "continue_final_message needs an assistant message last"
        return super().unsupported()


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or chat ``messages`` through the chat template; ``model`` may be
    left out."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[StrictInt]


# -- errors ---------------------------------------------------------------------------------------------------
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


class APIError(Exception):
    """Raised by handlers; rendered as :func:`error_body` with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # of the answer (Retry-After of a 503)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


# -- responses (documented in /openapi.json; the handlers build the same shapes as plain dicts) -----------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer of the server."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    decoder: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    waiting: int
    running: int


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """``GET /tokenizer_info`` (vLLM's): what a client needs to tokenize as the server does (lm-evaluation-harness's
    ``tokenizer_backend=remote``)."""

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per token of the choice's text (with echo: the prompt's first, the very first without a log-probability):
    its text, log-probability, the most likely tokens there with the chosen one, and where its text starts."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: None = None
    usage: Usage


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None: an answer that is only tool calls
    reasoning_content: str | None = None  # present when a thinking model's answer holds a <think> block
    tool_calls: list[ToolCall] | None = None  # present when the answer calls tools


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    system_fingerprint: None = None
    usage: Usage
