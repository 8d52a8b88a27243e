"""The OpenAI-compatible HTTP app (FastAPI) over the :class:`~dlm.serve.scheduler.Scheduler`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text). Responses and stream chunks have the shapes the official ``openai`` client
reads; every error is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for anything the
client did (FastAPI's 422 validation shape is replaced by a 400 in that shape).

Typical use::

    engine = load_engine("smollm2-135m", decode="isd")
    app = create_app(Scheduler(engine), ServeSettings(model_name="smollm2-135m"))
    uvicorn.run(app, host="127.0.0.1", port=8000)       # or: with ServerThread(app) as srv: srv.url
"""

import asyncio
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from dlm.errors import DLMError, require
from dlm.serve.loader import load_engine  # noqa: F401 - re-exported: dlm.serve.app.load_engine
from dlm.serve.schemas import (
    APIError,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    error_body,
)

log = logging.getLogger("dlm.serve")

KEEPALIVE_S = 5.0  # an SSE comment this often while a stream waits (also notices dead clients)
DISCONNECT_POLL_S = 0.5  # non-streaming requests check for a gone client this often


@dataclass
class ServeSettings:
    """How the app answers; see ``dlm serve --help`` for each field."""

    model_name: str = "dlm"
    max_tokens_limit: int = 1024
    completion_default_max_tokens: int = 16  # OpenAI's default for /v1/completions
    api_key: str | None = None
    max_body_bytes: int = 1 << 20

    def __post_init__(self):
        if not isinstance(self.max_tokens_limit, int) or self.max_tokens_limit < 1:
            raise DLMError(f"--max-tokens-limit must be a positive integer, got {self.max_tokens_limit}")
        if self.max_body_bytes < 1024:
            raise DLMError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise DLMError("--api-key is empty; give a non-empty key or leave the flag out")


# -- incremental text ---------------------------------------------------------------------------------------
class TextStream:
    """Turns a request's growing token list into text deltas that are safe to send.

    Held back: a trailing U+FFFD (a multi-byte character cut between tokens) and the longest tail that could be
    the start of a stop string (the engine stops at the full string and cuts the final text there, so text that
    may belong to a stop string is never sent early).
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0  # characters already sent

    def _hold(self, text: str) -> int:
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def feed(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # a complete stop string: the engine has stopped, the text ends before it
            at = text.find(s)
            if at >= 0:
                safe = min(safe, at)
        safe -= self._hold(text[:safe])
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent : safe], safe
        return delta

    def finish(self, final_text: str | None) -> str:
        final_text = final_text or ""
        tail = final_text[self.sent :] if len(final_text) > self.sent else ""
        self.sent = max(self.sent, len(final_text))
        return tail


# -- the app --------------------------------------------------------------------------------------------------
def create_app(scheduler, settings: ServeSettings | None = None):
    """The FastAPI app serving ``scheduler``'s engine. Its lifespan starts and stops the engine thread."""
    require("fastapi", "serve")
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    settings = settings or ServeSettings()
    engine = scheduler.engine
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise DLMError("dlm serve needs a tokenizer next to the model (tokenizer.json / tokenizer_config.json)")
    metrics = scheduler.metrics
    created = int(time.time())
    vocab = int(engine.config.vocab_size)

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="dlm serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: openapi_schema(app, settings)
    app.state.scheduler = scheduler
    app.state.settings = settings

    def error(status: int, message: str, param=None, code=None) -> JSONResponse:
        metrics.on_error(status)
        return JSONResponse(error_body(status, message, param, code), status_code=status)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            ctx = first.get("ctx", {}).get("error", "")
            return error(400, f"the request body is not valid JSON ({ctx}); send a JSON object", code="invalid_json")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        # drop pydantic's union-member tags (e.g. 'str', 'list[int]') from the field path
        path = ".".join(p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool"))
        msg = first.get("msg", "invalid value")
        if not loc:
            message = f"the request body must be a JSON object with the API's fields ({msg})"
        else:
            message = f"invalid value for '{path}': {msg}"
        if len(errs) > 1:
            message += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
        return error(400, message, param=path or None, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        status = exc.status_code
        msg = str(exc.detail) if exc.detail else "error"
        if status == 404:
            msg = (
                f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, "
                f"/v1/chat/completions, /health, /metrics"
            )
        return error(status, msg)

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):  # pragma: no cover - a bug, but still the OpenAI shape
        log.exception("unexpected error")
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    # -- simple endpoints -----------------------------------------------------------------------------------
    @app.get("/health", response_model=None, responses={200: {"model": Health}, 503: {"model": ErrorResponse}})
    async def health():
        if not scheduler.alive:
            return error(503, "the engine thread is not running")
        waiting, running = scheduler.load()
        return {"status": "ok", "model": settings.model_name, "waiting": waiting, "running": running}

    @app.get(
        "/metrics",
        response_model=None,
        response_class=PlainTextResponse,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}
        },
    )
    async def get_metrics():
        waiting, running = scheduler.load()
        metrics.set_load(waiting, running)
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card():
        return {
            "id": settings.model_name,
            "object": "model",
            "created": created,
            "owned_by": "dlm",
            "max_model_len": engine.max_positions,
            "decoder": engine.decoder.name,
        }

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}})
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=None,
        responses={200: {"model": ModelCard}, 404: {"model": ErrorResponse}},
    )
    async def get_model(model_id: str):
        check_model(model_id)
        return model_card()

    # -- request -> engine requests -------------------------------------------------------------------------
    def check_model(name: str) -> None:
        if name != settings.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist here; this server serves '{settings.model_name}' (see /v1/models)",
                param="model",
                code="model_not_found",
            )

    def check_common(body, max_tokens: int | None, default_max: int) -> int:
        check_model(body.model)
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        if max_tokens is None:
            return default_max
        if max_tokens > settings.max_tokens_limit:
            raise APIError(
                400,
                f"max_tokens={max_tokens} is over this server's limit of "
                f"{settings.max_tokens_limit} (--max-tokens-limit); ask for fewer tokens",
                param="max_tokens",
                code="invalid_value",
            )
        return max_tokens

    def check_prompt(ids: list[int], param: str = "prompt") -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty (0 tokens); send some text", param=param)
        if len(ids) >= engine.max_positions:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens but the model's context is "
                f"{engine.max_positions}; shorten it to at most {engine.max_positions - 1} tokens",
                param=param,
                code="context_length_exceeded",
            )
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param=param)
        if engine.mask_token_id is not None and engine.mask_token_id in ids:
            raise APIError(
                400, f"the prompt contains the model's mask token (id {engine.mask_token_id}); remove it", param=param
            )
        return ids

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def sampling(body, max_tokens: int, choice: int):
        from dlm.decode.sampling import SamplingParams

        seed = None if body.seed is None else body.seed + choice
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=max(body.top_k or 0, 0),
            seed=seed,
            stop_strings=tuple(body.stop_list()),
            ignore_eos=body.ignore_eos,
        )

    async def run(request: Request, body, prompts: list[list[int]], max_tokens: int, chat: bool):
        n = body.n
        out: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        handles = []
        for pi, ids in enumerate(prompts):
            for j in range(n):
                handles.append(scheduler.submit(ids, sampling(body, max_tokens, j), tag=pi * n + j, out=out, loop=loop))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        prompt_tokens = sum(len(p) for p in prompts)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            gen = stream(request, handles, out, rid, chat, prompt_tokens, include_usage, body.stop_list())
            return StreamingResponse(
                gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
        return await collect(request, handles, out, rid, chat, prompt_tokens)

    def abort_all(handles) -> None:
        for h in handles:
            scheduler.abort(h)

    async def collect(request, handles, out, rid, chat, prompt_tokens):
        results = {}
        try:
            while len(results) < len(handles):
                try:
                    tag, kind, payload = await asyncio.wait_for(out.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        abort_all(handles)
                        return error(400, "the client disconnected before the answer was ready")
                    continue
                if kind == "error":
                    raise APIError(payload[0], payload[1])
                if kind == "done":
                    results[tag] = payload
        finally:
            if len(results) < len(handles):
                abort_all(handles)
        choices = []
        for i in range(len(handles)):
            r = results[i]
            if chat:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": r.text or ""},
                        "finish_reason": r.finish_reason,
                        "logprobs": None,
                    }
                )
            else:
                choices.append({"index": i, "text": r.text or "", "finish_reason": r.finish_reason, "logprobs": None})
        completion_tokens = sum(len(r.token_ids) for r in results.values())
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": settings.model_name,
            "choices": choices,
            "system_fingerprint": None,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    async def stream(request, handles, out, rid, chat, prompt_tokens, include_usage, stop):
        created_at = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        texts = [TextStream(tokenizer, stop) for _ in handles]
        finished = 0
        completion_tokens = 0

        def chunk(index, text=None, finish_reason=None, role=False):
            if chat:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
            return sse(
                {"id": rid, "object": obj, "created": created_at, "model": settings.model_name, "choices": [choice]}
            )

        try:
            if chat:
                for i in range(len(handles)):
                    yield chunk(i, "", role=True)
            while finished < len(handles):
                try:
                    tag, kind, payload = await asyncio.wait_for(out.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if kind == "tokens":
                    delta = texts[tag].feed(payload)
                    if delta:
                        yield chunk(tag, delta)
                elif kind == "done":
                    finished += 1
                    completion_tokens += len(payload.token_ids)
                    tail = texts[tag].finish(payload.text)
                    if tail:
                        yield chunk(tag, tail)
                    yield chunk(tag, None if chat else "", finish_reason=payload.finish_reason)
                else:  # error: tell the client in the stream (headers are gone already) and stop
                    metrics.on_error(payload[0])
                    yield sse(error_body(payload[0], payload[1]))
                    return
            if include_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": obj,
                        "created": created_at,
                        "model": settings.model_name,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens,
                        },
                    }
                )
            yield "data: [DONE]\n\n"
        finally:
            # normal end: all handles are done and this is a no-op; client gone / cancelled: free the batch slots
            abort_all(handles)

    # -- endpoints ------------------------------------------------------------------------------------------
    @app.post(
        "/v1/completions",
        response_model=None,
        responses={
            200: {
                "model": Completion,
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
                "description": "a completion, or with stream=true server-sent events",
            },
            404: {"model": ErrorResponse},
        },
    )
    async def completions(request: Request, body: CompletionRequest):
        max_tokens = check_common(body, body.max_tokens, settings.completion_default_max_tokens)
        p = body.prompt
        if isinstance(p, str):
            prompts = [encode(p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [encode(x) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            raise APIError(400, "the prompt is empty; send a string, a list of strings or token ids", param="prompt")
        prompts = [check_prompt(x) for x in prompts]
        return await run(request, body, prompts, max_tokens, chat=False)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={
            200: {
                "model": ChatCompletion,
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
                "description": "a chat completion, or with stream=true server-sent events",
            },
            404: {"model": ErrorResponse},
        },
    )
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = check_common(body, limit, settings.max_tokens_limit)
        if not body.messages:
            raise APIError(400, "'messages' is empty; send at least one message", param="messages")
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(
                400,
                f"the model '{settings.model_name}' has no chat template in its tokenizer; use "
                f"/v1/completions with a plain prompt",
                param="messages",
            )
        msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the client's to fix
            raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from e
        prompt = check_prompt(encode(text), param="messages")
        return await run(request, body, [prompt], max_tokens, chat=True)

    return LimitAndAuth(app, settings, metrics)


def openapi_schema(app, settings: ServeSettings) -> dict:
    """The OpenAPI document of the routes as they answer: FastAPI's, with its 422 validation responses replaced by
    the 400 the app sends (every error in the OpenAI shape), 413 on the POST routes (--max-body-bytes), 401 where
    --api-key applies, and the served model name as the example of every ``model`` field."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(
        title="dlm serve",
        version="1",
        routes=app.routes,
        description="OpenAI-compatible completions and chat completions of one diffusion LM",
    )
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    err = {"$ref": "#/components/schemas/ErrorResponse"}
    comps.setdefault("ErrorResponse", ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}"))
    for sub in ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {}).items():
        comps.setdefault(*sub)
    comps["ErrorResponse"].pop("$defs", None)

    def answer(text: str) -> dict:
        return {"description": text, "content": {"application/json": {"schema": err}}}

    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            had_422 = responses.pop("422", None) is not None
            if had_422 or method == "post":
                responses["400"] = answer("a malformed or unsupported request (the message names the field)")
            if method == "post":
                responses["413"] = answer("the body is over --max-body-bytes")
                responses["500"] = answer("the engine failed during this request (the server keeps serving)")
                responses["503"] = answer("the server is shutting down")
            if settings.api_key is not None and path != "/health":
                responses["401"] = answer("missing or wrong API key")
                op["security"] = [{"bearer": []}]
            for code, r in responses.items():
                if code != "200" and "content" in r:
                    r["content"] = {"application/json": {"schema": err}}
    if settings.api_key is not None:
        comps_root = doc["components"]
        comps_root["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    from dlm.serve.schemas import MAX_PROMPTS, MAX_STOP

    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = comps.get(name, {}).get("properties", {})
        if "model" in props:
            props["model"]["examples"] = [settings.model_name]
        for field in ("max_tokens", "max_completion_tokens"):  # --max-tokens-limit
            for branch in props.get(field, {}).get("anyOf", []):
                if branch.get("type") == "integer":
                    branch["maximum"] = settings.max_tokens_limit
        for branch in props.get("stop", {}).get("anyOf", []):
            if branch.get("type") == "array":
                branch["maxItems"] = MAX_STOP
                branch.setdefault("items", {})["minLength"] = 1
            elif branch.get("type") == "string":
                branch["minLength"] = 1
        for field in ("presence_penalty", "frequency_penalty"):  # accepted only at their neutral value
            if field in props:
                props[field] = {
                    "anyOf": [{"type": "number", "minimum": 0, "maximum": 0}, {"type": "null"}],
                    "title": props[field].get("title", field),
                }
        if "logit_bias" in props:
            props["logit_bias"] = {"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}]}
    completion = comps.get("CompletionRequest", {}).get("properties", {})
    vocab = int(app.state.scheduler.engine.config.vocab_size)

    def ids_schema(node):  # token ids: 0 .. vocab-1 (the mask token is refused too, by message)
        if node.get("type") == "integer":
            node.update(minimum=0, maximum=vocab - 1)
        elif node.get("type") == "array":
            node.update(minItems=1)
            ids_schema(node.get("items", {}))

    for branch in completion.get("prompt", {}).get("anyOf", []):
        if branch.get("type") == "array":
            branch.update(maxItems=MAX_PROMPTS)
            ids_schema(branch)
            if branch.get("items", {}).get("type") == "string":
                branch["items"]["minLength"] = 1
        elif branch.get("type") == "string":
            branch["minLength"] = 1
    for field, value in (("echo", False), ("logprobs", None), ("suffix", None)):
        if field in completion:
            completion[field] = {"const": value} if value is not None else {"type": "null"}
    chat = comps.get("ChatCompletionRequest", {}).get("properties", {})
    for field in ("logprobs", "tools"):
        if field in chat:
            chat[field] = (
                {"anyOf": [{"const": False}, {"type": "null"}]}
                if field == "logprobs"
                else {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}
            )
    app.openapi_schema = doc
    return doc


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class LimitAndAuth:
    """ASGI middleware in front of the app: bearer-key check (``--api-key``, all routes but ``/health``) and the
    request body limit (``Content-Length`` or the bytes actually received, whichever comes first), both answered
    in the OpenAI error shape before FastAPI parses anything."""

    def __init__(self, app, settings: ServeSettings, metrics):
        self.app, self.settings, self.metrics = app, settings, metrics
        self.state = app.state  # so tests can reach app.state through the wrapper

    async def _reject(self, send, status: int, message: str, code: str | None = None, param=None):
        self.metrics.on_error(status)
        body = json.dumps(error_body(status, message, param, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = self.settings.api_key
        if key is not None and scope.get("path") != "/health":
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
        chunks, total = [], 0
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

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


# -- running it -----------------------------------------------------------------------------------------------
class ServerThread:
    """Run an app with uvicorn in a background thread on a loopback port (tests, benchmarks)::

    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0):
        self.app, self.host, self.port, self.startup_timeout = app, host, port, startup_timeout
        self.server = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> "ServerThread":
        uvicorn = require("uvicorn", "serve")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="dlm-serve", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
