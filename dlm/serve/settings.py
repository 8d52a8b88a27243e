"""How the server answers (``dlm serve``'s HTTP flags), shared by the app, the request checks and the middleware."""

from __future__ import annotations

from dataclasses import dataclass

from dlm.errors import DLMError
from dlm.serve import reasoning, tool_calls


@dataclass
class ServeSettings:
    """How the app answers; see ``dlm serve --help`` for each field."""

    model_name: str = "dlm"
    max_tokens_limit: int = 1024
    completion_default_max_tokens: int = 16  # OpenAI's default for /v1/completions
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    tool_call_parser: str = "auto"  # the model's own tool-call format, read for tool_choice "auto"
    reasoning_parser: str = "auto"  # "think": <think> ... </think> sent as reasoning_content
    max_queue: int = 0  # engine requests waiting for a batch slot beyond which new ones get a 503 (0: no limit)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens_limit, int) or self.max_tokens_limit < 1:
            raise DLMError(f"--max-tokens-limit must be a positive integer, got {self.max_tokens_limit}")
        if isinstance(self.max_queue, bool) or not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise DLMError(f"--max-queue must be an integer >= 0 (0 = no limit), got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise DLMError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")

        for flag, value, choices in (
            ("--tool-call-parser", self.tool_call_parser, tool_calls.CHOICES),
            ("--reasoning-parser", self.reasoning_parser, reasoning.CHOICES),
        ):
            if value not in choices:
                raise DLMError(f"{flag} must be one of {', '.join(choices)}, got '{value}'")
        if self.api_key is not None and not self.api_key.strip():
            raise DLMError("--api-key is empty; give a non-empty key or leave the flag out")

    def needs_key(self, path: str) -> bool:
        """Whether a request to ``path`` must carry the API key (every route but ``/health``, the probe)."""
        return self.api_key is not None and path != "/health"
