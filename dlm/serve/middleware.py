"""The ASGI middleware in front of the app: the API key and the request body limit, checked before FastAPI parses
anything and answered in the OpenAI error shape."""

from __future__ import annotations

import hmac
import json
from typing import TYPE_CHECKING

from starlette.types import Message, Receive, Scope, Send

from dlm.serve.schemas import error_body
from dlm.serve.settings import ServeSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from dlm.serve.metrics import Metrics


class LimitAndAuth:
    """ASGI middleware in front of the app: bearer-key check (``--api-key``, all routes but ``/health``) and the
    request body limit (``Content-Length`` or the bytes actually received, whichever comes first), both answered
    in the OpenAI error shape before FastAPI parses anything."""

    def __init__(self, app: FastAPI, settings: ServeSettings, metrics: Metrics):
        self.app, self.settings, self.metrics = app, settings, metrics
        self.state = app.state  # so tests can reach app.state through the wrapper

    async def _reject(
        self, send: Send, status: int, message: str, code: str | None = None, param: str | None = None
    ) -> None:
        self.metrics.on_error(status)
        body = json.dumps(error_body(status, message, param, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = self.settings.api_key
        if key is not None and self.settings.needs_key(scope.get("path", "")):
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                return await self._reject(
                    send,
                    401,
                    "missing or wrong API key: send the header "
                    "'Authorization: Bearer <key>' with the server's --api-key",
                    code="invalid_api_key",
                )
        limit = self.settings.max_body_bytes
        length = headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await self._reject(send, 400, f"bad Content-Length header '{length}'")
            if n > limit:
                return await self._reject(
                    send,
                    413,
                    f"the request body has {n} bytes, over this server's limit of {limit} (--max-body-bytes)",
                    code="body_too_large",
                )
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        total = 0
        while True:  # read the whole body here, counting (chunked uploads have no Content-Length)
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            data = message.get("body", b"")
            total += len(data)
            if total > limit:
                return await self._reject(
                    send,
                    413,
                    f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)",
                    code="body_too_large",
                )
            chunks.append(data)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
