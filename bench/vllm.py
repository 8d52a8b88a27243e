"""vLLM against dlm's engine, one run: vLLM AR, vLLM + dlm drafters (exact speculative decoding), dlm AR and dlm
ISD, on the same prompts at several concurrency levels, interleaved (every level runs each system in turn, the
order rotated per round, so a shared machine's load drift hits all alike).

    python bench/vllm.py --drafter idlm=runs/quickstart/train_b2 --drafter small=runs/drafter-l4 \\
        --isd-model runs/quickstart/train_b2 --output bench_vllm.json

Every system is a server started the way a user starts it (`dlm serve --engine vllm [--drafter DIR]`,
`dlm serve --decode ar|isd`), all up at once, each on its own loopback port, queried through the official
`openai` client with greedy chat requests (an answer ends at end-of-sequence or --max-tokens). Reported per system
and level: output tokens/s over the level's wall time, acceptance length (tokens per target forward: 1 + accepted
drafts per verify step from vLLM's spec-decode counters; dlm ISD: generated tokens / forwards from its /metrics),
and how many answers are identical to vLLM AR's. Needs vLLM beside dlm (scripts/install_vllm.sh).

Step cost = acceptance length / (tok/s vs vLLM AR): what one speculative step (drafter forward + verify) costs in
vLLM AR steps, i.e. the acceptance length a drafter must beat to win at that level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "bench"))
from serve import PROMPTS  # noqa: E402 - the same chat prompts as bench/serve.py, so the two compare
from shapes import machine  # noqa: E402

KEY = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, argv: list[str], kind: str, log_dir: Path):
        self.name, self.kind, self.port = name, kind, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "dlm.cli",
            "serve",
            *argv,
            "--port",
            str(self.port),
            "--api-key",
            KEY,
            "--served-model-name",
            "bench",
            "--max-batch-size",
            "32",
        ]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait(self, timeout: float) -> None:
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            if time.time() - t0 > timeout:
                raise SystemExit(f"{self.name} not up after {timeout} s: {self.log.read_text()[-2000:]}")
            time.sleep(2)

    def metrics(self) -> dict[str, float]:
        req = urllib.request.Request(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([-0-9.e+naif]+)$", line)
            if m:
                with contextlib.suppress(ValueError):
                    out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def forwards(kind: str, d: dict[str, float], tokens: int) -> tuple[float | None, float | None]:
    """(acceptance length = tokens per target forward, accepted drafts / proposed) of one level's metric deltas."""
    if kind == "vllm":
        drafts = d.get("vllm:spec_decode_num_drafts_total", d.get("vllm:spec_decode_num_drafts", 0.0))
        prop = d.get("vllm:spec_decode_num_draft_tokens_total", d.get("vllm:spec_decode_num_draft_tokens", 0.0))
        acc = d.get("vllm:spec_decode_num_accepted_tokens_total", d.get("vllm:spec_decode_num_accepted_tokens", 0.0))
        if drafts <= 0:
            return 1.0, None
        return 1.0 + acc / drafts, acc / max(prop, 1.0)
    fw = d.get("dlm_forwards_total", 0.0)
    prop, acc = d.get("dlm_draft_proposed_total", 0.0), d.get("dlm_draft_accepted_total", 0.0)
    return (d.get("dlm_generation_tokens_total", tokens) / fw if fw else None), (acc / prop if prop else None)


async def level(url: str, prompts: list[str], concurrency: int, max_tokens: int):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=1800)
    sem = asyncio.Semaphore(concurrency)

    async def one(i, p):
        async with sem:
            r = await client.chat.completions.create(
                model="bench", temperature=0, max_tokens=max_tokens, messages=[{"role": "user", "content": p}]
            )
            return i, r.choices[0].message.content, r.usage.completion_tokens

    t0 = time.perf_counter()
    try:
        res = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        await client.close()
    return res, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m", help="the served model (default smollm2-135m)")
    ap.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a dlm I-DLM (or exported drafter) for vLLM's speculative decoding; repeatable",
    )
    ap.add_argument(
        "--isd-model",
        help="the I-DLM dlm's ISD runs (its clean path must be --target; default: "
        "--target converted on the fly, untrained drafts)",
    )
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", default="8,16,32", help="requests per level (one value per --concurrency)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument(
        "--num-speculative-tokens",
        type=int,
        help="K for every drafter (default: each drafter's own, from its block size)",
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--systems",
        default="vllm-ar,vllm-drafters,dlm-ar,dlm-isd",
        help="which to run (vllm-drafters: one per --drafter)",
    )
    ap.add_argument(
        "--dlm-threads",
        default="1",
        help="--threads of the dlm servers (default 1: vLLM's CPU build computes on one core of a "
        "2-core machine, keeping the other for its API server)",
    )
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--output", help="write the results as JSON here")
    ap.add_argument("--log-dir", default="/tmp/dlm-bench-vllm")
    args = ap.parse_args()

    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.requests.split(",")]
    if len(counts) != len(levels):
        raise SystemExit("--requests needs one count per --concurrency level")
    wanted = set(args.systems.split(","))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    specs = []  # (name, argv, kind)
    if "vllm-ar" in wanted:
        specs.append(("vllm AR", ["--engine", "vllm", "--model", args.target], "vllm"))
    k_args = (
        [] if args.num_speculative_tokens is None else ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    )
    if "vllm-drafters" in wanted:
        for item in args.drafter:
            name, _, path = item.partition("=")
            argv = ["--engine", "vllm", "--model", args.target, "--drafter", path, *k_args]
            specs.append((f"vllm + {name} drafter", argv, "vllm"))
    if "dlm-ar" in wanted:
        specs.append(("dlm AR", ["--model", args.target, "--decode", "ar", "--threads", args.dlm_threads], "dlm"))
    if "dlm-isd" in wanted:
        specs.append(
            (
                "dlm ISD",
                ["--model", args.isd_model or args.target, "--decode", "isd", "--threads", args.dlm_threads],
                "dlm",
            )
        )
    servers: list[Server] = []
    try:
        t0 = time.time()
        for name, argv, kind in specs:
            servers.append(Server(name.replace(" ", "_").replace("+", ""), argv, kind, log_dir))
            servers[-1].label = name
        for s in servers:
            s.wait(args.start_timeout)
            asyncio.run(level(s.url, PROMPTS[:1], 1, 4))  # warm-up, not timed
        print(f"servers up in {time.time() - t0:.0f} s", flush=True)
        raw: dict = {}
        for rnd in range(args.rounds):
            for li, (c, n) in enumerate(zip(levels, counts)):
                prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
                k = rnd * len(levels) + li
                for s in servers[k % len(servers) :] + servers[: k % len(servers)]:
                    before = s.metrics()
                    res, wall = asyncio.run(level(s.url, prompts, c, args.max_tokens))
                    after = s.metrics()
                    d = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
                    acc = raw.setdefault((s.label, c), {"texts": {}, "tokens": 0, "wall": 0.0, "d": {}, "load": []})
                    for i, text, toks in res:
                        acc["texts"].setdefault(i, text)
                        acc["tokens"] += toks
                    acc["wall"] += wall
                    acc["load"].append(os.getloadavg()[0])
                    for key, v in d.items():
                        acc["d"][key] = acc["d"].get(key, 0.0) + v
                    toks = sum(t for _, _, t in res)
                    print(
                        f"  round {rnd + 1} {s.label:>24} c={c:<3} {toks / wall:7.1f} tok/s  "
                        f"load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
        rows = []
        for c in levels:
            ref = raw.get(("vllm AR", c), {}).get("texts")
            base_tps = None
            for s in servers:
                a = raw[(s.label, c)]
                tps = a["tokens"] / a["wall"]
                if s.label == "vllm AR":
                    base_tps = tps
                al, rate = forwards(s.kind, a["d"], a["tokens"])
                same = None if ref is None else sum(a["texts"][i] == ref[i] for i in ref)
                rows.append(
                    {
                        "system": s.label,
                        "concurrency": c,
                        "requests": len(a["texts"]),
                        "tokens": a["tokens"],
                        "tokens_per_s": tps,
                        "acceptance_length": al,
                        "draft_acceptance": rate,
                        "identical_to_vllm_ar": same,
                        "load": sum(a["load"]) / len(a["load"]),
                    }
                )
            for r in rows:
                if r["concurrency"] == c and base_tps:
                    r["vs_vllm_ar"] = r["tokens_per_s"] / base_tps
                    if r["acceptance_length"]:
                        r["step_cost"] = r["acceptance_length"] / r["vs_vllm_ar"]
    finally:
        for s in servers:
            s.stop()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    header = (
        f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit {commit}; greedy, <= {args.max_tokens} "
        f"tokens per answer"
    )
    lines = [
        header,
        "",
        "| system | concurrency | tok/s | vs vLLM AR | acceptance length | draft acceptance | "
        "step cost | identical to vLLM AR | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        da = f"{r['draft_acceptance']:.2f}" if r["draft_acceptance"] is not None else "-"
        same = f"{r['identical_to_vllm_ar']}/{r['requests']}" if r["identical_to_vllm_ar"] is not None else "-"
        cost = f"{r['step_cost']:.2f}" if r.get("step_cost") else "-"
        lines.append(
            f"| {r['system']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | "
            f"{r.get('vs_vllm_ar', float('nan')):.2f}x | {al} | {da} | {cost} | {same} | {r['load']:.1f} |"
        )
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text(json.dumps({"header": header, "rows": rows, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
