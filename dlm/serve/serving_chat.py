"""``POST /v1/chat/completions``: OpenAI's chat completions (the messages through the model's chat template)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request

from dlm.serve.logprobs import Scored, chat_logprobs
from dlm.serve.schemas import ChatCompletionRequest
from dlm.serve.serving_base import OpenAIServing

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
        message = {"role": "assistant", "content": result.text or ""}
        logprobs = chat_logprobs(self.scored(result)) if parsed.logprobs is not None else None
        return {"index": index, "message": message, "finish_reason": result.finish_reason, "logprobs": logprobs}

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
