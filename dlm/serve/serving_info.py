"""The endpoints that only describe the server: ``GET /health`` (the probe), ``GET /metrics`` (Prometheus text),
``GET /v1/models`` and ``GET /v1/models/{model_id}``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, PlainTextResponse

from dlm.serve.error_handlers import error_response
from dlm.serve.settings import ServeSettings
from dlm.serve.validation import RequestValidator

if TYPE_CHECKING:
    from dlm.serve.scheduler import Scheduler


class InfoHandler:
    """Health, metrics and the model list of one served model."""

    def __init__(self, scheduler: Scheduler, settings: ServeSettings, validator: RequestValidator):
        self.scheduler = scheduler
        self.settings = settings
        self.validator = validator
        self.metrics = scheduler.metrics
        self.created = int(time.time())
        self.max_model_len = scheduler.engine.max_positions
        self.decoder = scheduler.engine.decoder.name

    async def health(self) -> dict[str, Any] | JSONResponse:
        if not self.scheduler.alive:
            return error_response(self.metrics, 503, "the engine thread is not running")
        waiting, running = self.scheduler.load()
        return {"status": "ok", "model": self.settings.model_name, "waiting": waiting, "running": running}

    async def metrics_text(self) -> PlainTextResponse:
        waiting, running = self.scheduler.load()
        self.metrics.set_load(waiting, running)
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.settings.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "dlm",
            "max_model_len": self.max_model_len,
            "decoder": self.decoder,
        }

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    async def get_model(self, model_id: str) -> dict[str, Any]:
        self.validator.model(model_id)
        return self.model_card()
