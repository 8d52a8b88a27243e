"""The OpenAPI document (``GET /openapi.json``) as the server really answers.

Each route declares its own 200 answer and the errors its handler can return (:func:`ok`, :func:`streamed`,
:func:`errors`, used where :func:`dlm.serve.app.create_app` registers it); :func:`openapi_schema` adds what the
middleware answers in front of every route (:func:`middleware_errors`: 400 and 413 for the body limit, 401 where
``--api-key`` applies), drops FastAPI's 422 (the app answers validation errors with a 400) and writes the limits
that depend on how the server was started (``--max-tokens-limit``, the vocabulary, the served model name) into
the request schemas.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from dlm.serve.schemas import MAX_PROMPTS, MAX_STOP, ErrorResponse
from dlm.serve.settings import ServeSettings

# what each error status means, wherever it is documented
ERROR_DESCRIPTIONS = {
    400: "a malformed or unsupported request (the message names the field)",
    401: "missing or wrong API key",
    404: "the model named is not the one served here (see /v1/models)",
    413: "the body (or the Content-Length it declares) is over --max-body-bytes",
    500: "the engine failed during this request (the server keeps serving)",
    503: "the engine is not running (the server is shutting down, its engine thread stopped, or the engine failed "
    "and could not be rebuilt yet), or more requests wait than --max-queue (with Retry-After)",
}
BAD_CONTENT_LENGTH = "a Content-Length header that is not a number"


def ok(model: type[BaseModel], description: str = "Successful Response") -> dict[int | str, dict[str, Any]]:
    """A JSON 200 answer of ``model``."""
    return {200: {"model": model, "description": description}}


def streamed(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 answer that is ``model`` as JSON, or with ``stream=true`` server-sent events (``data: <chunk JSON>``
    lines ending with ``data: [DONE]``)."""
    return {
        200: {
            "model": model,
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
            "description": description,
        }
    }


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a route's handler can return, each an :class:`~dlm.serve.schemas.ErrorResponse`."""
    return {s: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[s]} for s in statuses}


def middleware_errors(path: str, settings: ServeSettings) -> dict[str, str]:
    """Status -> description of what :class:`~dlm.serve.middleware.LimitAndAuth` answers for a route before its
    handler runs: 401 where the API key is required, 413 for a body (or a declared Content-Length) over the limit,
    400 for a Content-Length that is not a number."""
    out = {"400": BAD_CONTENT_LENGTH, "413": ERROR_DESCRIPTIONS[413]}
    if settings.needs_key(path):
        out["401"] = ERROR_DESCRIPTIONS[401]
    return out


def openapi_schema(app: FastAPI, settings: ServeSettings) -> dict[str, Any]:
    """The OpenAPI document of ``app``'s routes as they answer; see the module docstring. Cached on the app."""
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
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    for sub in error_schema.get("$defs", {}).items():
        comps.setdefault(*sub)
    comps.setdefault("ErrorResponse", {k: v for k, v in error_schema.items() if k != "$defs"})
    comps["ErrorResponse"].pop("$defs", None)
    err = {"$ref": "#/components/schemas/ErrorResponse"}

    for path, item in doc.get("paths", {}).items():
        for op in item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)  # validation errors are answered with a 400
            for code, text in middleware_errors(path, settings).items():
                responses.setdefault(code, {"description": text})
            if "401" in responses:
                op["security"] = [{"bearer": []}]
            for code, r in responses.items():
                if code != "200":
                    r["content"] = {"application/json": {"schema": err}}
    if settings.api_key is not None:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    _request_limits(comps, settings, int(app.state.scheduler.engine.config.vocab_size))
    app.openapi_schema = doc
    return doc


def _request_limits(comps: dict[str, Any], settings: ServeSettings, vocab: int) -> None:
    """Write into the request schemas what the app checks beyond the pydantic types: the served model name (as
    the example), --max-tokens-limit, the stop-string and prompt limits, token ids within the vocabulary, and the
    logit bias's shape."""
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
        if "logit_bias" in props:  # token ids (as strings) of this model -> a bias in [-100, 100]
            props["logit_bias"] = {
                "anyOf": [
                    {
                        "type": "object",
                        "propertyNames": {"pattern": "^[0-9]+$"},
                        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                    },
                    {"type": "null"},
                ],
                "title": "Logit Bias",
            }
    completion = comps.get("CompletionRequest", {}).get("properties", {})

    def ids_schema(node: dict[str, Any]) -> None:  # token ids: 0 .. vocab-1 (the mask token is refused too, by message)
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
