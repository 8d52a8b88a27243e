"""Running an app with uvicorn in a background thread on a loopback port (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from dlm.errors import require


class ServerThread:
    """Run an app with uvicorn in a background thread on a loopback port (tests, benchmarks)::

    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0):
        self.app, self.host, self.port, self.startup_timeout = app, host, port, startup_timeout
        self.server: Any = None  # uvicorn.Server
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
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

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(30)
