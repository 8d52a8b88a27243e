"""What completions and chat completions share: a checked request goes to the engine loop as one engine request
per (prompt, choice), and the answer is either collected into one JSON response or streamed as server-sent
events. A subclass (:mod:`dlm.serve.serving_completion`, :mod:`dlm.serve.serving_chat`) says how to parse its
body and how its choices and stream chunks look."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from dlm.serve.error_handlers import error_response
from dlm.serve.logprobs import Scored, Scorer
from dlm.serve.schemas import APIError, SamplingRequest, error_body
from dlm.serve.settings import ServeSettings
from dlm.serve.streaming import SSE_DONE, SSE_KEEPALIVE, TextStream, sse
from dlm.serve.validation import ParsedRequest, RequestValidator, sampling_params

if TYPE_CHECKING:
    from dlm.decode.engine import GenerationResult
    from dlm.serve.scheduler import Handle, Scheduler
    from dlm.serve.tool_calls import Piece, Reader

KEEPALIVE_S = 5.0  # an SSE comment this often while a stream waits (also notices dead clients)
DISCONNECT_POLL_S = 0.5  # non-streaming requests check for a gone client this often

Item = tuple[int, str, Any]  # (tag, kind, payload) as the scheduler puts them on a request's queue


class OpenAIServing:
    """One endpoint family that generates text; see the module docstring. Subclasses set the class attributes
    and implement :meth:`choice` and :meth:`chunk_choice`."""

    id_prefix: ClassVar[str]  # of the response id: "cmpl-", "chatcmpl-"
    object: ClassVar[str]  # of the JSON answer
    chunk_object: ClassVar[str]  # of each stream chunk
    final_text: ClassVar[str | None]  # the text of a choice's last chunk (the one with its finish_reason)
    opens_with_role: ClassVar[bool] = False  # a first chunk per choice with only the role (chat)

    def __init__(self, scheduler: Scheduler, settings: ServeSettings, validator: RequestValidator):
        self.scheduler = scheduler
        self.settings = settings
        self.validator = validator
        self.metrics = scheduler.metrics

    # -- what a subclass says ---------------------------------------------------------------------------
    def choice(self, index: int, result: GenerationResult, parsed: ParsedRequest) -> dict[str, Any]:
        """Choice ``index`` of the JSON answer."""
        raise NotImplementedError

    def chunk_choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: list[Scored] | None = None,
    ) -> dict[str, Any]:
        """The choice of one stream chunk: new ``text`` (None: none), the ``finish_reason`` of the last one, the
        log-probabilities of the tokens whose text it carries (None: not asked for)."""
        raise NotImplementedError

    def reader(self, parsed: ParsedRequest) -> Reader | None:
        """A fresh reader of one choice's text as message pieces (chat: reasoning, tool calls), or None: all content."""
        return None

    def piece_choice(self, index: int, piece: Piece, logprobs: list[Scored] | None, calls: int) -> dict[str, Any]:
        """The choice of the stream chunk that sends one piece of a reader (``calls``: the calls opened so far in
        this choice, the new one included)."""
        assert piece[0] == "content"
        return self.chunk_choice(index, piece[1], None, logprobs=logprobs)

    def finish_reason(self, parsed: ParsedRequest, finish: str, called: bool) -> str:
        """A choice's ``finish_reason`` from the engine's (``called``: whether its answer holds tool calls)."""
        return finish

    def scored(self, result: GenerationResult, offset: int = 0) -> list[Scored]:
        """The answer's tokens with their log-probabilities (:mod:`dlm.serve.logprobs`); ``offset``: where its text
        starts in the choice's text."""
        return Scorer(self.validator.tokenizer, offset=offset).feed(result.token_ids, result.logprobs)

    # -- the shared path ------------------------------------------------------------------------------------
    async def generate(self, request: Request, body: SamplingRequest, parsed: ParsedRequest) -> Any:
        """Submit ``body.n`` engine requests per prompt; the collected answer, or a stream with ``stream=true``."""
        n = body.n
        self.admit(len(parsed.prompts) * n)
        out: asyncio.Queue[Item] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        handles = []
        for pi, ids in enumerate(parsed.prompts):
            for j in range(n):
                params = sampling_params(
                    body,
                    parsed.max_tokens,
                    j,
                    parsed.logprobs,
                    parsed.echo,
                    self.validator.eos_ids,
                    parsed.structured,
                    parsed.suffix_ids,
                )
                handles.append(self.scheduler.submit(ids, params, tag=pi * n + j, out=out, loop=loop))
        rid = self.id_prefix + uuid.uuid4().hex[:24]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self.stream(handles, out, rid, parsed, include_usage, body.stop_list())
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self.collect(request, handles, out, rid, parsed)

    def admit(self, requests: int) -> None:
        """503 with ``Retry-After`` where ``requests`` more engine requests would make more than ``--max-queue``
        wait for a batch slot (a server past its capacity answers at once instead of growing a queue whose
        requests time out anyway; clients such as openai's retry a 503 after a back-off)."""
        limit = self.settings.max_queue
        if not limit:
            return
        waiting, _ = self.scheduler.load()
        if waiting + requests > limit:
            raise APIError(
                503,
                f"the server is at capacity: {waiting} requests wait for a batch slot and this one adds {requests} "
                f"(--max-queue {limit}); retry in a moment",
                code="server_overloaded",
                headers={"Retry-After": "1"},
            )

    def abort_all(self, handles: list[Handle]) -> None:
        for h in handles:
            self.scheduler.abort(h)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def echo_text(self, parsed: ParsedRequest, index: int, choices: int) -> str:
        """The text a streamed choice starts with before its answer (completions' ``echo``: the prompt)."""
        return ""

    async def collect(
        self, request: Request, handles: list[Handle], out: asyncio.Queue[Item], rid: str, parsed: ParsedRequest
    ) -> dict[str, Any] | JSONResponse:
        """Wait for every choice (aborting them if the client goes away) and answer them in one JSON body."""
        results: dict[int, GenerationResult] = {}
        try:
            while len(results) < len(handles):
                try:
                    tag, kind, payload = await asyncio.wait_for(out.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self.abort_all(handles)
                        return error_response(self.metrics, 400, "the client disconnected before the answer was ready")
                    continue
                if kind == "error":
                    raise APIError(payload[0], payload[1])
                if kind == "done":
                    results[tag] = payload
        finally:
            if len(results) < len(handles):
                self.abort_all(handles)
        # max_tokens 0 (echo): the one token the engine ran is not part of the answer
        completion_tokens = sum(len(r.token_ids) for r in results.values()) if parsed.max_tokens else 0
        return {
            "id": rid,
            "object": self.object,
            "created": int(time.time()),
            "model": self.settings.model_name,
            "choices": [self.choice(i, results[i], parsed) for i in range(len(handles))],
            "system_fingerprint": None,
            "usage": self.usage(parsed.prompt_tokens, completion_tokens),
        }

    async def stream(
        self,
        handles: list[Handle],
        out: asyncio.Queue[Item],
        rid: str,
        parsed: ParsedRequest,
        include_usage: bool,
        stop: list[str],
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer: text deltas as the engine commits tokens (with the
        log-probabilities of the tokens whose text each carries), each choice's finish, the usage
        (``stream_options.include_usage``) and ``[DONE]``; an engine error ends the stream with an error event.
        Leaving early (client gone) aborts the engine requests."""
        created_at = int(time.time())
        texts = [TextStream(self.validator.tokenizer, stop) for _ in handles]
        readers = [self.reader(parsed) for _ in handles]
        calls = [0] * len(handles)  # tool calls opened per choice
        scorers = [Scorer(self.validator.tokenizer) for _ in handles] if parsed.logprobs is not None else None
        pending: list[list[Scored]] = [[] for _ in handles]  # scored tokens whose text is not sent yet
        finished = 0
        completion_tokens = 0

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            head = {"id": rid, "object": self.chunk_object, "created": created_at, "model": self.settings.model_name}
            return sse({**head, "choices": choices, **extra})

        def send(tag: int, text: str, lps: list[Scored] | None, final: bool = False) -> list[str]:
            """The chunks of new ``text`` of choice ``tag`` (through its reader), ``lps`` with the first; the
            log-probabilities go back to ``pending`` where the reader holds all of the text back."""
            r = readers[tag]
            pieces: list[Piece] = [] if r is None else r.feed(text) + (r.finish() if final else [])
            if r is None and text:
                pieces = [("content", text)]
            if not pieces:
                if lps:
                    pending[tag] = lps + pending[tag]
                return []
            out = []
            for piece in pieces:
                calls[tag] += piece[0] == "call"
                out.append(chunk([self.piece_choice(tag, piece, lps, calls[tag])]))
                lps = [] if lps is not None else None
            return out

        try:
            if self.opens_with_role:
                for i in range(len(handles)):
                    yield chunk([self.chunk_choice(i, "", None, role=True)])
            for i in range(len(handles)):  # echo: each choice starts with its prompt
                head = self.echo_text(parsed, i, len(handles))
                if head:
                    yield chunk([self.chunk_choice(i, head, None)])
            while finished < len(handles):
                try:
                    tag, kind, payload = await asyncio.wait_for(out.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield SSE_KEEPALIVE
                    continue
                if kind == "tokens" and parsed.max_tokens == 0:
                    continue  # the prompt only (echo): the one token the engine runs is not part of the answer
                if kind == "done" and parsed.max_tokens == 0:
                    finished += 1
                    yield chunk([self.chunk_choice(tag, self.final_text, "length")])
                elif kind == "tokens":
                    ids, logprobs = payload
                    delta = texts[tag].feed(ids)
                    if scorers is not None:
                        pending[tag] += scorers[tag].feed(ids, logprobs)
                    if delta:
                        lps = None
                        if scorers is not None:  # the tokens whose text starts in what is sent by now
                            lps = [e for e in pending[tag] if e.offset < texts[tag].sent]
                            pending[tag] = pending[tag][len(lps) :]
                        for c in send(tag, delta, lps):
                            yield c
                elif kind == "done":
                    finished += 1
                    completion_tokens += len(payload.token_ids)
                    tail = texts[tag].finish(payload.text)
                    rest = pending[tag] if scorers is not None else None  # tokens not sent yet (a stop's too)
                    pending[tag] = []
                    sent = send(tag, tail, rest, final=True)
                    for c in sent:
                        yield c
                    if sent:
                        rest = [] if rest is not None else None
                    elif rest is not None:
                        rest = pending[tag]
                    finish = self.finish_reason(parsed, payload.finish_reason, calls[tag] > 0)
                    yield chunk([self.chunk_choice(tag, self.final_text, finish, logprobs=rest)])
                else:  # error: tell the client in the stream (headers are gone already) and stop
                    self.metrics.on_error(payload[0])
                    yield sse(error_body(payload[0], payload[1]))
                    return
            if include_usage:
                yield chunk([], usage=self.usage(parsed.prompt_tokens, completion_tokens))
            yield SSE_DONE
        finally:
            # normal end: all handles are done and this is a no-op; client gone / cancelled: free the batch slots
            self.abort_all(handles)
