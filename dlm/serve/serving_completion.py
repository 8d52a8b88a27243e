"""``POST /v1/completions``: OpenAI's text completions (a prompt in any of its four forms, ``n`` choices each)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request

from dlm.serve.logprobs import Scored, Scorer, completion_logprobs
from dlm.serve.schemas import CompletionRequest
from dlm.serve.serving_base import OpenAIServing

if TYPE_CHECKING:
    from dlm.decode.engine import GenerationResult
    from dlm.serve.validation import ParsedRequest


class CompletionHandler(OpenAIServing):
    """Completions: one choice per (prompt, n); the stream's chunks carry ``text``. With ``echo`` the choice's text
    (and its log-probabilities) starts with the prompt - a stream's first chunk of each choice is its prompt;
    ``max_tokens`` 0 then answers the prompt alone."""

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"
    final_text = ""

    async def create(self, request: Request, body: CompletionRequest) -> Any:
        return await self.generate(request, body, self.validator.completion(body))

    def choice(self, index: int, result: GenerationResult, parsed: ParsedRequest) -> dict[str, Any]:
        entries: list[Scored] = []
        head = ""
        if parsed.echo:  # the prompt's tokens as they are (special ones included), the first without a logprob
            prompt = self.prompt_entries(result.prompt_ids, result.prompt_logprobs)
            head = "".join(e.token.text for e in prompt if e.width)
            entries += prompt
        if parsed.max_tokens > 0:
            text = head + (result.text or "")
            if parsed.logprobs is not None:  # token texts cost a few decodes a token: only when asked for
                entries += self.scored(result, offset=len(head))
            finish = result.finish_reason
        else:  # the prompt only: the token the engine ran is not part of the answer
            text, finish = head, "length"
        logprobs = completion_logprobs(entries) if parsed.logprobs is not None else None
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}

    def prompt_entries(self, ids: list[int], logprobs: list | None) -> list[Scored]:
        """The prompt's tokens as ``echo`` shows them: as they are (special ones included), scored where given."""
        return Scorer(self.validator.tokenizer, skip_special=False).feed(ids, logprobs)

    def echo_text(self, parsed: ParsedRequest, index: int, choices: int) -> str:
        if not parsed.echo:
            return ""
        ids = parsed.prompts[index // (choices // len(parsed.prompts))]  # choice index: prompt * n + j
        return "".join(e.token.text for e in self.prompt_entries(ids, None) if e.width)

    def chunk_choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: list[Scored] | None = None,
    ) -> dict[str, Any]:
        lps = None if logprobs is None else completion_logprobs(logprobs)
        return {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": lps}
