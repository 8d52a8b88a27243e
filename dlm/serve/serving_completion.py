"""``POST /v1/completions``: OpenAI's text completions (a prompt in any of its four forms, ``n`` choices each)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request

from dlm.serve.schemas import CompletionRequest
from dlm.serve.serving_base import OpenAIServing

if TYPE_CHECKING:
    from dlm.decode.engine import GenerationResult


class CompletionHandler(OpenAIServing):
    """Completions: one choice per (prompt, n); the stream's chunks carry ``text``."""

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"
    final_text = ""

    async def create(self, request: Request, body: CompletionRequest) -> Any:
        return await self.generate(request, body, self.validator.completion(body))

    def choice(self, index: int, result: GenerationResult) -> dict[str, Any]:
        return {"index": index, "text": result.text or "", "finish_reason": result.finish_reason, "logprobs": None}

    def chunk_choice(
        self, index: int, text: str | None, finish_reason: str | None, role: bool = False
    ) -> dict[str, Any]:
        return {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
