"""``POST /v1/chat/completions``: OpenAI's chat completions (the messages through the model's chat template)."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request

from dlm.serve.logprobs import Scored, chat_logprobs
from dlm.serve.schemas import ChatCompletionRequest
from dlm.serve.serving_base import OpenAIServing
from dlm.serve.tool_calls import Call, read_all
from dlm.serve.validation import NAMED_TOOL

if TYPE_CHECKING:
    from dlm.decode.engine import GenerationResult
    from dlm.serve.tool_calls import Piece, Reader
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

    def reader(self, parsed: ParsedRequest) -> Reader | None:
        return parsed.reader()

    def finish_reason(self, parsed: ParsedRequest, finish: str, called: bool) -> str:
        # OpenAI's: "tool_calls" for an answer that ends in calls, "stop" where the function was named
        named = parsed.tool_call is not None and parsed.tool_call.startswith(NAMED_TOOL)
        return "tool_calls" if called and finish == "stop" and not named else finish

    def choice(self, index: int, result: GenerationResult, parsed: ParsedRequest) -> dict[str, Any]:
        text = result.text or ""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        r = self.reader(parsed)
        calls: list[Call] = []
        if r is not None:
            content, calls, reasoning = read_all(r, text)
            message["content"] = content or (None if calls else "")
            if reasoning is not None:
                message["reasoning_content"] = reasoning
        if calls:  # OpenAI's shape; the arguments are JSON text
            message["tool_calls"] = [
                {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls
            ]
        finish = self.finish_reason(parsed, result.finish_reason, bool(calls))
        logprobs = chat_logprobs(self.scored(result)) if parsed.logprobs is not None else None
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}

    def piece_choice(self, index: int, piece: Piece, logprobs: list[Scored] | None, calls: int) -> dict[str, Any]:
        kind, value = piece
        if kind == "content":
            return self.chunk_choice(index, value, None, logprobs=logprobs)
        lps = None if logprobs is None else chat_logprobs(logprobs)
        if kind == "reasoning":
            return {"index": index, "delta": {"reasoning_content": value}, "finish_reason": None, "logprobs": lps}
        if kind == "call":  # a call opens: its id, name and the arguments known so far
            delta = {
                "index": calls - 1,
                "id": call_id(),
                "type": "function",
                "function": {"name": value.name, "arguments": value.arguments},
            }
        else:  # more arguments of the open call
            delta = {"index": calls - 1, "function": {"arguments": value}}
        return {"index": index, "delta": {"tool_calls": [delta]}, "finish_reason": None, "logprobs": lps}

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


def call_id() -> str:
    """A new tool call's id (OpenAI's form)."""
    return "call_" + uuid.uuid4().hex[:24]
