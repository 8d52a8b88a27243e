"""Soak test of `dlm serve`: a bounded time of mixed traffic at 16-64 concurrent clients, then the figures.

    python bench/soak.py                          # 10 minutes, a tiny random model, clients ramp 16 -> 64
    python bench/soak.py --minutes 3 --model smollm2-135m --clients 16,32
    python bench/soak.py --url http://127.0.0.1:8000 --pid 1234 --served-model-name smollm2-135m

It starts `python -m dlm serve` on a free loopback port (or drives --url; --pid then gives the process whose RSS
is read) and keeps N clients busy (N cycles through --clients, a new level every minute) with a mix of requests:
non-streamed and streamed completions and chat completions, n > 1, stop strings, log-probabilities (with echo),
structured outputs (a JSON schema, any object, a regex, a choice, a grammar; and one that does not compile), tool
calls (tool_choice auto - with a call the answer is made to write in the hermes format -, required, named, none) and
reasoning (an answer made to open a <think> block; the server reads both with --tool-call-parser hermes and
--reasoning-parser think), streams
the client cancels after a few chunks, and malformed requests (bad JSON, wrong types, unknown model, an over-limit body, an
unknown route) that must get a 4xx in the OpenAI error shape. Reported: requests served by kind, answers by
status code, anything unexpected (a 5xx, a 4xx to a well-formed request, a 2xx to a malformed one, an error body
not in the OpenAI shape, a dropped connection), p50/p99 latency of the well-formed requests, and the server's RSS
at the start, after the warm-up (the first 20% of the time) and at the end. Goal: no 5xx, nothing unexpected,
RSS growth after the warm-up under 10%. ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

SOAK_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0}},
    "required": ["name", "n"],
}

SOAK_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}},
                "required": ["name"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
SOAK_CALL_REGEX = (
    'Let me look\\.\\n<tool_call>\\n\\{"name": "lookup", "arguments": \\{"name": "cat"\\}\\}\\n</tool_call>'
)

PROMPTS = [
    "The cat sat on the",
    "Once upon a time",
    "To be, or not to be",
    "Numbers: 1 2 3",
    "The quick brown fox",
    "A diffusion language model",
    "First Citizen: Before we proceed",
    "Why is the sky blue?",
]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    model = args.model
    if model == "tiny":
        from dlm.testing import save_tiny

        model = str(save_tiny(Path(tempfile.mkdtemp(prefix="dlm-soak-")) / "tiny", "llama"))
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "dlm",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--decode",
        args.decode,
        "--max-tokens-limit",
        str(args.max_tokens_limit),
        "--served-model-name",
        "soak",
        "--log-level",
        "error",
        "--max-batch-size",
        str(args.max_batch_size),
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "think",
    ]
    log = open(os.path.join(tempfile.gettempdir(), f"dlm-soak-server-{port}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", "soak"


async def wait_ready(client, url: str, proc, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            r = await client.get(url + "/health", timeout=5)
            if r.status_code == 200:
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await asyncio.sleep(0.5)
    raise SystemExit(f"the server at {url} did not answer /health within {timeout:.0f} s")


def openai_error(r) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    return (
        isinstance(body, dict)
        and set(body) == {"error"}
        and isinstance(body["error"], dict)
        and set(body["error"]) == {"message", "type", "param", "code"}
        and bool(body["error"]["message"])
    )


class Soak:
    def __init__(self, url: str, model: str, max_tokens: int, seed: int = 0, scored: bool = True):
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.scored = scored  # the server's decoder gives log-probabilities (ar, isd)
        self.rng = random.Random(seed)
        self.kinds = Counter()
        self.status = Counter()
        self.unexpected: list[str] = []
        self.latency: list[float] = []

    def note(self, what: str) -> None:
        if len(self.unexpected) < 50:
            self.unexpected.append(what)
        else:
            self.unexpected.append("...")  # counted, not kept

    # -- one request of each kind -------------------------------------------------------------------------
    def body(self, chat: bool, **extra) -> dict:
        prompt = self.rng.choice(PROMPTS)
        b = {
            "model": self.model,
            "max_tokens": self.rng.randint(1, self.max_tokens),
            "temperature": self.rng.choice([0.0, 0.7, 1.0]),
            "seed": self.rng.randint(0, 1 << 30),
        }
        if chat:
            b["messages"] = [{"role": "user", "content": prompt}]
        else:
            b["prompt"] = prompt
        b.update(extra)
        return b

    async def well_formed(self, client, kind: str) -> None:
        chat = self.rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        extra: dict = (
            {"n": self.rng.randint(2, 4)}
            if kind == "n"
            else {"stop": [self.rng.choice([" the", ".", "\n", "e"])]}
            if kind == "stop"
            else {}
        )
        if kind in ("tools", "reasoning"):
            chat, path = True, "/v1/chat/completions"
        streamed = kind in ("stream", "cancel") or (
            kind in ("logprobs", "structured", "tools", "reasoning") and self.rng.random() < 0.5
        )
        want_call = None  # the call a non-streamed answer must hold
        if kind == "tools":
            extra = {"tools": SOAK_TOOLS, "max_tokens": 128, "temperature": 0.0}
            choice = self.rng.choice(["auto", "auto-call", "required", "named", "none"])
            if choice == "auto-call":  # the answer made to write one call in the model's (hermes) format
                extra["structured_outputs"] = {"regex": SOAK_CALL_REGEX}
                want_call = ("lookup", {"name": "cat"})
            elif choice == "named":
                extra["tool_choice"] = {"type": "function", "function": {"name": "lookup"}}
            elif choice != "auto":
                extra["tool_choice"] = choice
        if kind == "reasoning":  # an answer made to think first
            extra = {"structured_outputs": {"regex": "<think>[a-z ]{1,20}</think>\\n(yes|no)"}, "max_tokens": 64}
        if kind == "structured":  # a JSON schema, any object, a regex, a choice or a grammar
            extra = self.rng.choice(
                [
                    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SOAK_SCHEMA}}},
                    {"response_format": {"type": "json_object"}},
                    {"structured_outputs": {"regex": "[0-9]{1,4}( (cats|dogs))?"}},
                    {"structured_outputs": {"choice": ["yes", "no", "maybe not"]}},
                    {"structured_outputs": {"grammar": 'start: "(" /[a-z]+/ ("," /[a-z]+/)* ")"'}},
                ]
            )
        if kind == "logprobs":
            k = self.rng.randint(0, 5)
            extra = {"logprobs": True, "top_logprobs": k} if chat else {"logprobs": k}
            if not chat and not streamed and self.rng.random() < 0.5:
                extra["echo"] = True
        body = self.body(chat, **extra)
        t0 = time.perf_counter()
        if streamed:
            body["stream"] = True
            stop_after = self.rng.randint(0, 3) if kind == "cancel" else None
            async with client.stream("POST", self.url + path, json=body, timeout=300) as r:
                self.status[r.status_code] += 1
                if r.status_code != 200:
                    await r.aread()
                    self.note(f"{kind} {path}: {r.status_code} {r.text[:200]}")
                    return
                chunks, done = 0, False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    if '"error"' in line:
                        self.note(f"{kind} {path}: error in the stream {line[:200]}")
                    chunks += 1
                    if stop_after is not None and chunks > stop_after:
                        break  # the client goes away mid-stream
                if stop_after is None and not done:
                    self.note(f"{kind} {path}: the stream ended without [DONE]")
        else:
            r = await client.post(self.url + path, json=body, timeout=300)
            self.status[r.status_code] += 1
            if r.status_code != 200:
                self.note(f"{kind} {path}: {r.status_code} {r.text[:200]}")
                return
            choices = r.json().get("choices", [])
            if len(choices) != body.get("n", 1):
                self.note(f"{kind} {path}: {len(choices)} choices for n={body.get('n', 1)}")
            if kind == "logprobs" and any(c.get("logprobs") is None for c in choices):
                self.note(f"{kind} {path}: a choice without logprobs")
            for c in choices if want_call or kind == "reasoning" else []:
                m, finish = c.get("message") or {}, c.get("finish_reason")
                calls = [
                    (t["function"]["name"], json.loads(t["function"]["arguments"])) for t in m.get("tool_calls") or []
                ]
                if want_call and finish != "length" and (finish != "tool_calls" or calls != [want_call]):
                    self.note(f"{kind}: the answer's calls {calls} ({finish}), not {[want_call]}")
                if (
                    kind == "reasoning"
                    and finish == "stop"
                    and (not m.get("reasoning_content") or "<think>" in (m.get("content") or ""))
                ):
                    self.note(f"{kind}: reasoning not read apart: {m}")
        self.latency.append(time.perf_counter() - t0)

    async def malformed(self, client) -> None:
        case = self.rng.randrange(8 if self.scored else 7)
        path = self.rng.choice(["/v1/completions", "/v1/chat/completions"])
        if case == 0:
            r = await client.post(
                self.url + path,
                content=b'{"model": "soak", "prompt": ',
                timeout=60,
                headers={"content-type": "application/json"},
            )
        elif case == 1:
            r = await client.post(
                self.url + path,
                json={"model": self.model, "prompt": "x", "messages": "x", "max_tokens": "five"},
                timeout=60,
            )
        elif case == 2:
            r = await client.post(
                self.url + path, json=self.body(path.endswith("chat/completions"), model="no-such-model"), timeout=60
            )
        elif case == 3:
            r = await client.post(
                self.url + path, content=b"x" * (2 << 20), timeout=60, headers={"content-type": "application/json"}
            )
        elif case == 4:
            r = await client.get(self.url + "/v1/nothing-here", timeout=60)
        elif case == 5:
            r = await client.post(
                self.url + path, json=self.body(path.endswith("chat/completions"), max_tokens=10**9), timeout=60
            )
        elif case == 7:  # a regex that does not compile
            bad = self.body(path.endswith("chat/completions"), structured_outputs={"regex": "([a-z"})
            r = await client.post(self.url + path, json=bad, timeout=60)
        else:
            r = await client.post(self.url + path, json=[1, 2, 3], timeout=60)
        self.status[r.status_code] += 1
        if not 400 <= r.status_code < 500:
            self.note(f"malformed case {case} {path}: {r.status_code} {r.text[:200]}")
        elif not openai_error(r):
            self.note(f"malformed case {case} {path}: not the OpenAI error shape: {r.text[:200]}")

    async def one(self, client) -> None:
        kinds = ["plain", "stream", "cancel", "n", "stop", "logprobs", "structured", "tools", "reasoning", "malformed"]
        weights = [3, 3, 2, 1, 1] + [1 if self.scored else 0] * 4 + [2]
        kind = self.rng.choices(kinds, weights=weights)[0]
        self.kinds[kind] += 1
        try:
            if kind == "malformed":
                await self.malformed(client)
            else:
                await self.well_formed(client, kind)
        except Exception as e:  # noqa: BLE001 - a dropped connection or a timeout: counted as unexpected
            self.status[type(e).__name__] += 1
            self.note(f"{kind}: {type(e).__name__}: {e}")


async def run(args) -> dict:
    import httpx

    proc = None
    if args.url:
        url, model, pid = args.url.rstrip("/"), args.served_model_name, args.pid
    else:
        proc, url, model = start_server(args)
        pid = proc.pid
    levels = [int(x) for x in args.clients.split(",")]
    limits = httpx.Limits(max_connections=max(levels) + 8, max_keepalive_connections=max(levels) + 8)
    try:
        async with httpx.AsyncClient(limits=limits) as client:
            await wait_ready(client, url, proc)
            soak = Soak(url, model, args.max_tokens, seed=args.seed, scored=args.decode in ("ar", "isd"))
            rss = {"start": rss_kib(pid) if pid else None}
            t0 = time.monotonic()
            end = t0 + args.minutes * 60
            warm = t0 + args.minutes * 60 * 0.2
            active: set[asyncio.Task] = set()
            last_print = t0
            while time.monotonic() < end:
                now = time.monotonic()
                if rss.get("warm") is None and now >= warm and pid:
                    rss["warm"] = rss_kib(pid)
                target = levels[int((now - t0) // 60) % len(levels)]
                while len(active) < target:
                    task = asyncio.create_task(soak.one(client))
                    active.add(task)
                    task.add_done_callback(active.discard)
                await asyncio.sleep(0.01)
                if now - last_print > 30:
                    last_print = now
                    print(
                        f"  {now - t0:6.0f} s  clients {target:3d}  requests {sum(soak.kinds.values()):7d}  "
                        f"status {dict(soak.status)}",
                        file=sys.stderr,
                        flush=True,
                    )
            if active:
                await asyncio.wait(active, timeout=300)
            health = await client.get(url + "/health", timeout=30)
            rss["end"] = rss_kib(pid) if pid else None
            lat = sorted(soak.latency)
            pct = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else None  # noqa: E731
            five = sum(v for k, v in soak.status.items() if isinstance(k, int) and k >= 500)
            growth = None
            if rss.get("warm") and rss.get("end"):
                growth = round(100.0 * (rss["end"] - rss["warm"]) / rss["warm"], 1)
            return {
                "minutes": args.minutes,
                "clients": levels,
                "model": args.model if not args.url else model,
                "requests": sum(soak.kinds.values()),
                "by_kind": dict(soak.kinds),
                "by_status": {str(k): v for k, v in sorted(soak.status.items(), key=str)},
                "5xx": five,
                "unexpected": len(soak.unexpected),
                "unexpected_examples": soak.unexpected[:10],
                "latency_s": {"p50": pct(0.5), "p99": pct(0.99), "n": len(lat)},
                "rss_mib": {k: (round(v / 1024, 1) if v else None) for k, v in rss.items()},
                "rss_growth_after_warmup_pct": growth,
                "health_after": health.status_code,
            }
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to drive the server (default 10)")
    ap.add_argument("--clients", default="16,32,64", help="concurrent clients, one level per minute, cycled")
    ap.add_argument("--model", default="tiny", help="'tiny' (a random tiny Llama, default), a folder or an alias")
    ap.add_argument("--decode", default="isd")
    ap.add_argument("--max-tokens", type=int, default=24, help="each well-formed request asks for 1..this many")
    ap.add_argument("--max-tokens-limit", type=int, default=128)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--url", help="drive this running server instead of starting one")
    ap.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    ap.add_argument("--served-model-name", default="soak", help="with --url: the model name it serves")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.minutes <= 0:
        ap.error("--minutes must be positive")
    levels = [int(x) for x in args.clients.split(",") if x]
    if not levels or min(levels) < 1:
        ap.error("--clients takes positive numbers, e.g. 16,32,64")
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    ok = (
        result["5xx"] == 0
        and result["unexpected"] == 0
        and result["health_after"] == 200
        and (result["rss_growth_after_warmup_pct"] is None or result["rss_growth_after_warmup_pct"] < 10)
    )
    print(
        f"soak: {'PASS' if ok else 'FAIL'} ({result['requests']} requests, {result['5xx']} 5xx, "
        f"{result['unexpected']} unexpected, RSS growth after warm-up {result['rss_growth_after_warmup_pct']}%)",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
