"""The engine loop: one thread owns the model and the :class:`dlm.decode.engine.Engine`.

HTTP handlers (on the asyncio event loop) call :meth:`Scheduler.submit` / :meth:`Scheduler.abort`; both only put a
message in a thread-safe inbox and wake the loop. The loop, between two engine steps, drains the inbox (new
requests go to the engine's waiting list, aborts remove a request at once), then runs one ``engine.step()``: a
batched forward for the running rows plus the prefill of waiting requests while the batch has room
(``max_batch_size``) - continuous batching. Each request's new tokens are handed to its asyncio queue with
``loop.call_soon_threadsafe``, so the event loop never blocks on the model and the model never waits for a slow
client: a client that does not read just accumulates items in its own queue, and one that disconnects is aborted.

Items put on a request's queue (``tag`` is the caller's, e.g. the choice index)::

    (tag, "tokens", ([ids], logprobs))  newly committed token ids (may be several per step with ISD) and their
                                      TokenLogprob list (None unless the request asked for log-probabilities)
    (tag, "done", GenerationResult)   the request finished (finish_reason "stop" | "length")
    (tag, "error", (status, message)) the request failed (bad prompt: 400; engine failure: 500)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from dlm.decode.engine import Engine
from dlm.errors import DLMError
from dlm.serve.metrics import Metrics

log = logging.getLogger("dlm.serve")


@dataclass
class Handle:
    """One engine request as the HTTP side sees it."""

    request_id: str
    tag: object
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    done: bool = False

    def push(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, (self.tag, kind, payload))
        except RuntimeError:  # the event loop is closed (server shutting down): nobody is listening
            pass


class Scheduler:
    """Runs ``engine`` in a background thread; see the module docstring."""

    def __init__(self, engine, metrics=None, idle_wait: float = 0.5):
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.idle_wait = idle_wait
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: dict[str, Handle] = {}
        self._ids = itertools.count()
        self.failures = 0
        self._broken = False  # the last step failed: rebuild the engine before the next one

    # -- called from the event loop (any thread) ------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        params,
        tag=None,
        out: asyncio.Queue | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Handle:
        """Queue a request; its items arrive on ``out`` (created if not given)."""
        loop = loop or asyncio.get_running_loop()
        handle = Handle(f"req-{next(self._ids)}", tag, out if out is not None else asyncio.Queue(), loop)
        self._inbox.put(("add", handle, list(prompt_ids), params))
        self._wake.set()
        return handle

    def abort(self, handle: Handle) -> None:
        """Stop a request (client gone). Safe to call for a finished request."""
        if not handle.done:
            self._inbox.put(("abort", handle))
            self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def load(self) -> tuple[int, int]:
        """(waiting, running) request counts, approximate (read without a lock)."""
        eng = self.engine
        return self._inbox.qsize() + len(eng.waiting), len(eng.rows)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.alive:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="dlm-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        # whatever was still in flight gets a clean error instead of hanging forever
        self._drain()
        for h in list(self._handles.values()):
            h.done = True
            h.push("error", (503, "the server is shutting down; retry later"))
        self._handles.clear()

    # -- the loop -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        with torch.inference_mode():
            while not self._stop.is_set():
                if self._broken and not self._rebuild():
                    continue
                try:
                    self._iteration()
                except Exception as e:  # noqa: BLE001 - never let one bad step kill the server
                    log.exception("engine step failed")
                    self._fail_all(
                        f"the engine failed during a decoding step ({type(e).__name__}: {e}); "
                        f"the request was dropped, the server keeps serving"
                    )

    def _iteration(self) -> None:
        self._wake.clear()
        self._drain()
        if not self.engine.has_unfinished():
            self.metrics.set_load(0, 0)
            self._wake.wait(self.idle_wait)
            return
        events = self.engine.step()
        self._deliver(events)
        waiting, running = self.load()
        self.metrics.on_step(
            waiting,
            running,
            getattr(self.engine.decoder, "counts", None),
            self.engine.prefix.stored_tokens if self.engine.prefix is not None else None,
        )

    def _messages(self):
        """The inbox's messages, taken one by one until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain(self) -> None:
        for msg in self._messages():
            if msg[0] == "add":
                _, handle, prompt_ids, params = msg
                try:
                    self.engine.add(prompt_ids, params, request_id=handle.request_id)
                except DLMError as e:
                    handle.done = True
                    handle.push("error", (400, str(e)))
                    continue
                except Exception as e:  # noqa: BLE001 - a bug in add() fails this request, not the engine thread
                    log.exception("engine.add failed")
                    handle.done = True
                    handle.push(
                        "error",
                        (
                            500,
                            f"the engine could not take this request ({type(e).__name__}: "
                            f"{e}); the server keeps serving",
                        ),
                    )
                    continue
                self._handles[handle.request_id] = handle
            else:
                handle = msg[1]
                if handle.done or handle.request_id not in self._handles:
                    continue
                try:
                    self.engine.abort(handle.request_id)
                except Exception:  # noqa: BLE001 - the request is dropped below either way
                    log.exception("engine.abort failed")
                # aborted: nobody wants the text, but its tokens count in the metrics
                result = self.engine.results.pop(handle.request_id, None)
                handle.done = True
                del self._handles[handle.request_id]
                ttft = None if handle.first_token is None else handle.first_token - handle.arrival
                self.metrics.on_finished(
                    "abort",
                    result.stats if result is not None else _EmptyStats(),
                    ttft,
                    time.perf_counter() - handle.arrival,
                )

    def _deliver(self, events) -> None:
        now = time.perf_counter()
        for ev in events:
            handle = self._handles.get(ev.request_id)
            if handle is None:
                continue
            if ev.new_token_ids:
                if handle.first_token is None:
                    handle.first_token = now
                handle.push("tokens", (list(ev.new_token_ids), ev.logprobs))
            if ev.finished:
                result = self.engine.pop_result(ev.request_id)
                handle.done = True
                del self._handles[ev.request_id]
                ttft = None if handle.first_token is None else handle.first_token - handle.arrival
                self.metrics.on_finished(result.finish_reason, result.stats, ttft, now - handle.arrival)
                handle.push("done", result)

    def _fail_all(self, message: str) -> None:
        """After an engine exception: error every request in flight; the loop rebuilds the engine before its next
        step (a step that failed may have left the engine's rows, cache or decoder state half-updated)."""

        self.failures += 1
        for h in self._handles.values():  # first: whatever happens below, nobody waits forever
            h.done = True
            h.push("error", (500, message))
        self._handles.clear()
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - a broken engine may fail to close; the new one replaces it anyway
            log.exception("closing the failed engine")
        self._broken = True

    def _rebuild(self) -> bool:
        """Replace the failed engine by an empty one on the same model, decoder and options. When that fails too,
        the requests that arrived meanwhile get a 503 (nothing could serve them) and the next turn tries again."""
        old = self.engine
        try:
            self.engine = Engine(old.model, old.tokenizer, old.decoder, old.options)
        except Exception as e:  # noqa: BLE001 - keep the thread; the next turn tries again
            log.exception("could not rebuild the engine")
            self._refuse_waiting(
                f"the engine failed and could not be rebuilt ({type(e).__name__}: {e}); the server retries "
                f"every {self.idle_wait:g} s - retry the request later"
            )
            self._wake.wait(self.idle_wait)
            self._wake.clear()
            return False
        self._broken = False
        return True

    def _refuse_waiting(self, message: str) -> None:
        for msg in self._messages():
            if msg[0] == "add":
                msg[1].done = True
                msg[1].push("error", (503, message))


class _EmptyStats:
    prompt_tokens = new_tokens = forwards = cached_tokens = 0
    proposed: list = []
    accepted: list = []
