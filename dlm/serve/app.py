"""The OpenAI-compatible HTTP app (FastAPI) over the :class:`~dlm.serve.scheduler.Scheduler`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text). Responses and stream chunks have the shapes the official ``openai`` client
reads; every error is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for anything the
client did (FastAPI's 422 validation shape is replaced by a 400 in that shape).

The parts (this module only assembles them):

- :mod:`~dlm.serve.settings` the server's flags; :mod:`~dlm.serve.schemas` request and response models;
- :mod:`~dlm.serve.validation` a body to checked engine requests (no HTTP);
- :mod:`~dlm.serve.serving_completion`, :mod:`~dlm.serve.serving_chat` the two generating endpoint families,
  sharing :mod:`~dlm.serve.serving_base` (submit, collect, stream) and :mod:`~dlm.serve.streaming` (SSE, text
  deltas); :mod:`~dlm.serve.serving_info` health, metrics, models;
- :mod:`~dlm.serve.error_handlers` every error in the OpenAI shape; :mod:`~dlm.serve.middleware` API key and
  body limit; :mod:`~dlm.serve.openapi` the document; :mod:`~dlm.serve.scheduler` the engine loop;
  :mod:`~dlm.serve.server` uvicorn in a thread; :mod:`~dlm.serve.loader` the engine from a model name.

Typical use::

    engine = load_engine("smollm2-135m", ISDConfig(stride=3))   # or a decoder name: load_engine(model, "isd")
    app = create_app(Scheduler(engine), ServeSettings(model_name="smollm2-135m"))
    uvicorn.run(app, host="127.0.0.1", port=8000)       # or: with ServerThread(app) as srv: srv.url
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from dlm.errors import DLMError, require
from dlm.serve.error_handlers import install_error_handlers
from dlm.serve.loader import load_engine
from dlm.serve.middleware import LimitAndAuth
from dlm.serve.openapi import errors, ok, openapi_schema, streamed
from dlm.serve.schemas import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeResponse,
    TokenizerInfo,
)
from dlm.serve.server import ServerThread
from dlm.serve.serving_chat import ChatHandler
from dlm.serve.serving_completion import CompletionHandler
from dlm.serve.serving_info import InfoHandler
from dlm.serve.serving_tokenize import TokenizeHandler
from dlm.serve.settings import ServeSettings
from dlm.serve.streaming import TextStream
from dlm.serve.validation import RequestValidator

if TYPE_CHECKING:
    from fastapi import FastAPI

    from dlm.serve.middleware import LimitAndAuth
    from dlm.serve.scheduler import Scheduler

__all__ = ["ServeSettings", "ServerThread", "TextStream", "create_app", "load_engine"]


def create_app(scheduler: Scheduler, settings: ServeSettings | None = None) -> LimitAndAuth:
    """The FastAPI app serving ``scheduler``'s engine (behind the key and body-limit middleware). Its lifespan
    starts and stops the engine thread."""
    require("fastapi", "serve")
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    settings = settings or ServeSettings()
    if scheduler.engine.tokenizer is None:
        raise DLMError("dlm serve needs a tokenizer next to the model (tokenizer.json / tokenizer_config.json)")
    validator = RequestValidator.for_engine(scheduler.engine, settings)
    info = InfoHandler(scheduler, settings, validator)
    completion = CompletionHandler(scheduler, settings, validator)
    chat = ChatHandler(scheduler, settings, validator)
    tokenize = TokenizeHandler(validator)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="dlm serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: openapi_schema(app, settings)  # type: ignore[method-assign]
    app.state.scheduler = scheduler
    app.state.settings = settings
    app.state.validator = validator
    install_error_handlers(app, scheduler.metrics)

    # route names are the operation ids' stems (health_health_get, ...), as they were when these were closures
    get, post = ["GET"], ["POST"]
    app.add_api_route(
        "/health", info.health, methods=get, name="health", response_model=None, responses={**ok(Health), **errors(503)}
    )
    app.add_api_route(
        "/metrics",
        info.metrics_text,
        methods=get,
        name="get_metrics",
        response_model=None,
        response_class=PlainTextResponse,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}
        },
    )
    app.add_api_route(
        "/v1/models", info.list_models, methods=get, name="list_models", response_model=None, responses=ok(ModelList)
    )
    app.add_api_route(
        "/v1/models/{model_id:path}",
        info.get_model,
        methods=get,
        name="get_model",
        response_model=None,
        responses={**ok(ModelCard), **errors(404)},
    )
    generating = errors(400, 404, 500, 503)
    app.add_api_route(
        "/v1/completions",
        completion.create,
        methods=post,
        name="completions",
        response_model=None,
        responses={**streamed(Completion, "a completion, or with stream=true server-sent events"), **generating},
    )
    app.add_api_route(
        "/v1/chat/completions",
        chat.create,
        methods=post,
        name="chat_completions",
        response_model=None,
        responses={
            **streamed(ChatCompletion, "a chat completion, or with stream=true server-sent events"),
            **generating,
        },
    )
    app.add_api_route(
        "/tokenize",
        tokenize.tokenize,
        methods=post,
        name="tokenize",
        response_model=None,
        responses={**ok(TokenizeResponse), **errors(400, 404)},
    )
    app.add_api_route(
        "/detokenize",
        tokenize.detokenize,
        methods=post,
        name="detokenize",
        response_model=None,
        responses={**ok(DetokenizeResponse), **errors(400, 404)},
    )
    app.add_api_route(
        "/tokenizer_info",
        tokenize.tokenizer_info,
        methods=get,
        name="tokenizer_info",
        response_model=None,
        responses=ok(TokenizerInfo),
    )
    return LimitAndAuth(app, settings, scheduler.metrics)
