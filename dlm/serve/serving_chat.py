"""``POST /v1/chat/completions``: OpenAI's chat completions (the messages through the model's chat template)."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request

from dlm.serve.logprobs import Scored, chat_logprobs
from dlm.serve.schemas import ChatCompletionRequest
from dlm.serve.serving_base import OpenAIServing
from dlm.serve.validation import ANY_TOOL

if TYPE_CHECKING:
    from dlm.decode.engine import GenerationResult
    from dlm.serve.validation import ParsedRequest


class ChatHandler(OpenAIServing):
    """Chat completions: ``n`` assistant messages; the stream opens each choice with its role, then ``delta``s."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    final_text = None
    opens_with_role = True

    async def create(self, request: Request, body: ChatCompletionRequest) -> Any:
        return await self.generate(request, body, self.validator.chat(body))

    def choice(self, index: int, result: GenerationResult, parsed: ParsedRequest) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": result.text or ""}
        finish = result.finish_reason
        calls = tool_calls(result.text or "", parsed.tool_call) if parsed.tool_call and finish == "stop" else None
        if calls is not None:  # OpenAI's: the calls, no content; "tool_calls" unless the function was named
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = "tool_calls" if parsed.tool_call == ANY_TOOL else "stop"
        logprobs = chat_logprobs(self.scored(result)) if parsed.logprobs is not None else None
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}

    def chunk_choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: list[Scored] | None = None,
    ) -> dict[str, Any]:
        delta: dict[str, str] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        lps = None if logprobs is None else chat_logprobs(logprobs)
        return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": lps}


def tool_calls(text: str, tool_call: str) -> list[dict[str, Any]] | None:
    """The answer of a chat whose ``tool_choice`` named a function (``tool_call``: its name; the text is the
    arguments) or was ``"required"`` (``ANY_TOOL``; the text is a list of ``{"name", "parameters"}``) as OpenAI's
    ``tool_calls``; None where the text does not parse (an answer cut short)."""
    if tool_call != ANY_TOOL:
        calls = [(tool_call, text)]
    else:
        try:
            items = json.loads(text)
        except ValueError:
            return None
        calls = [(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    return [
        {"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": {"name": name, "arguments": args}}
        for name, args in calls
    ]
