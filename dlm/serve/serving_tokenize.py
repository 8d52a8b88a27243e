"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` - the served
model's tokenizer for clients that have no copy of it (lm-evaluation-harness's ``tokenizer_backend=remote``
counts tokens and builds its log-likelihood requests with them)."""

from __future__ import annotations

from typing import Any

from dlm.serve.schemas import APIError, DetokenizeRequest, TokenizeRequest
from dlm.serve.validation import RequestValidator


class TokenizeHandler:
    """The tokenizer of one served model, as the engine uses it."""

    def __init__(self, validator: RequestValidator):
        self.validator = validator
        self.tokenizer = validator.tokenizer

    def _model(self, name: str | None) -> None:
        if name is not None:
            self.validator.model(name)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self._model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(
                400, "send either 'prompt' (text) or 'messages' (a chat), not both or neither", param="prompt"
            )
        if body.messages is not None:
            text = self.validator.chat_text(body.messages, body.add_generation_prompt)
            special = bool(body.add_special_tokens)  # the template writes the special tokens itself
        else:
            text = body.prompt or ""
            special = body.add_special_tokens is not False
        ids: list[int] = list(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.validator.max_positions, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]
        return out

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self._model(body.model)
        self.validator.in_vocabulary(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def tokenizer_info(self) -> dict[str, Any]:
        tok = self.tokenizer

        def text(name: str) -> str | None:
            value = getattr(tok, name, None)
            return None if value is None else str(value)

        template = getattr(tok, "chat_template", None)
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": text("eos_token"),
            "bos_token": text("bos_token"),
            "pad_token": text("pad_token"),
            "unk_token": text("unk_token"),
            "chat_template": template if isinstance(template, str) else None,
            "model_max_length": self.validator.max_positions,
        }
