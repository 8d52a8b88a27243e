"""Serve a model over an OpenAI-compatible HTTP API with continuous batching.

    dlm serve --model smollm2-135m --decode isd --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}'

Endpoints: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics (Prometheus text). Streaming
(server-sent events) and not; n, stop, max_tokens, temperature (default 1.0, as OpenAI), top_p, seed, usage.
A plain AR folder/alias is converted on the fly to an I-DLM, so --decode isd runs on it (output = AR greedy).
Binds to 127.0.0.1 unless --host says otherwise; --api-key makes every route but /health require the key.

--engine vllm runs vLLM's OpenAI server instead, on the same --host/--port/--api-key/--served-model-name (a
gated-LoRA I-DLM is served as its clean path, the base model); --drafter DIR adds a dlm I-DLM as vLLM's parallel
drafter (exact speculative decoding, K = its block size + 1). It prints the equivalent `vllm serve` line:

    dlm serve --engine vllm --model smollm2-135m --drafter runs/quickstart/train_b2 --port 8000
"""

from __future__ import annotations

import argparse

from dlm.decode import options as engine_options
from dlm.serve.reasoning import CHOICES as REASONING_CHOICES
from dlm.serve.tool_calls import CHOICES as TOOL_PARSER_CHOICES
from dlm.settings import env

# a server's load varies: drafting in a large batch can cost more than it gains (prompt lookup's drafts; ISD's
# measure it by default everywhere: ISDConfig.draft_budget)
SERVE_DEFAULTS = {"lookup_budget": "auto"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="DLM or AR model: hub id (org/name), local folder or alias (default smollm2-135m)",
    )
    p.add_argument(
        "--engine",
        default="dlm",
        choices=("dlm", "vllm"),
        help="dlm (default): dlm's engine, every decoder; vllm: vLLM's OpenAI server (AR, or exact "
        "speculative decoding with --drafter); needs vLLM (scripts/install_vllm.sh)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    engine_options.add_flags(p, engine_options.SERVER, "--max-batch-size", "requests in the running batch")
    p.add_argument(
        "--max-tokens-limit",
        type=int,
        default=1024,
        help="largest max_tokens a request may ask for; also the chat default (default 1024)",
    )
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (default 1 MiB)")
    p.add_argument(
        "--max-queue",
        type=int,
        default=0,
        help="requests waiting for a batch slot beyond which new ones get a 503 with Retry-After (n choices count "
        "n; default 0: no limit)",
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: no key; also $DLM_API_KEY)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the --model string)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, mps (default: $DLM_DEVICE or the best available)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=TOOL_PARSER_CHOICES,
        help="the format the model writes tool calls in, read for tool_choice 'auto' (the default with tools): "
        "hermes (<tool_call> tags: Qwen2.5/3, Dream, SDAR, I-DLM) or llama3_json; auto (default): the one its chat "
        "template asks for, if any; none: tool_choice 'auto' refused",
    )
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=REASONING_CHOICES,
        help="think: a <think> ... </think> block of the answer (Qwen3, SDAR, I-DLM, DeepSeek-R1) is sent as "
        "reasoning_content; auto (default): think where the chat template writes <think>; none: all content "
        "(--engine vllm: give vLLM's own with --vllm-arg=--reasoning-parser=qwen3)",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    from dlm.decode.configs import add_decoder_arguments

    add_decoder_arguments(
        p, default=None, implied="isd; renoise on a DiffusionGemma (renoising) model", command_defaults=SERVE_DEFAULTS
    )
    v = p.add_argument_group("--engine vllm")
    v.add_argument(
        "--drafter",
        help="dlm I-DLM folder (or `dlm export --drafter` output) to draft for vLLM's exact "
        "speculative decoding; exported on the fly when needed",
    )
    v.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="drafts per step (default: the drafter's block size + 1, as it was trained)",
    )
    v.add_argument(
        "--vllm-python",
        help="the Python that has vLLM (default: $DLM_VLLM_PYTHON, this one if it has "
        "vLLM, else scripts/install_vllm.sh's venv)",
    )
    v.add_argument(
        "--compile",
        action="store_true",
        help="let vLLM compile the model (CUDA graphs / torch.compile; start-up takes minutes) instead "
        "of --enforce-eager",
    )
    v.add_argument("--max-model-len", type=int, help="vLLM's context limit (default: the model's)")
    v.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for vLLM's server, repeatable (e.g. --vllm-arg=--seed=0)",
    )
    v.add_argument(
        "--print-command",
        action="store_true",
        help="print the vLLM command lines (python -m ... and vllm serve) and exit",
    )


def run_vllm(args) -> int:
    """--engine vllm: vLLM's OpenAI server as a child process, on a folder vLLM reads as this model means."""
    import subprocess

    from dlm.errors import DLMError
    from dlm.serve import vllm
    from dlm.serve.tool_calls import resolve, template_in_folder

    if args.decode not in (None, "ar"):
        raise DLMError(
            f"--decode {args.decode} runs on dlm's engine only: --engine vllm decodes AR, exactly "
            f"sped up with --drafter DIR (a dlm I-DLM); drop --decode or use --engine dlm"
        )
    from dlm.decode.configs import ARConfig, flag_of, given_settings

    given = given_settings(args)
    lookup = {k: given.pop(k) for k in ("prompt_lookup", "prompt_lookup_min", "prompt_lookup_max") if k in given}
    dlm_only = [flag_of(k) for k in given]
    if dlm_only:
        raise DLMError(f"{', '.join(dlm_only)}: dlm engine flags; --engine vllm does not take them")
    ngram = None
    if lookup:  # vLLM's own n-gram speculation, the same proposals
        cfg = ARConfig(**lookup)
        if cfg.prompt_lookup and args.drafter:
            raise DLMError("--prompt-lookup and --drafter are two ways to draft for vLLM: give one of them")
        if cfg.prompt_lookup:
            ngram = {
                "method": "ngram",
                "num_speculative_tokens": cfg.prompt_lookup,
                "prompt_lookup_max": cfg.prompt_lookup_max,
                "prompt_lookup_min": cfg.prompt_lookup_min,
            }
    if not 0 < args.port < 65536:
        raise DLMError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue:
        raise DLMError("--max-queue is dlm's engine's; vLLM queues without a limit (drop the flag)")
    if args.reasoning_parser != "auto":
        raise DLMError(
            "--reasoning-parser is dlm's engine's; vLLM has its own parsers: --vllm-arg=--reasoning-parser=qwen3 "
            "(or deepseek_r1, ...)"
        )
    if args.num_speculative_tokens is not None and not args.drafter:
        raise DLMError("--num-speculative-tokens needs --drafter DIR")
    python = vllm.vllm_python(args.vllm_python)
    version = vllm.check_vllm(python)
    folder = vllm.vllm_model_folder(args.model)
    spec = (
        vllm.speculative_config(args.drafter, target=folder, num_speculative_tokens=args.num_speculative_tokens)
        if args.drafter
        else ngram
    )
    api_key = args.api_key or env("DLM_API_KEY") or None
    # the dtype dlm's engine would run on this machine (vLLM's own "auto" turns a float32 checkpoint into bfloat16 on
    # a CPU, whose greedy output then drifts from the float32 model's)
    from dlm.device import get_device, get_dtype

    dtype = str(get_dtype(args.dtype, get_device(args.device))).replace("torch.", "")
    server = vllm.VLLMServer(
        folder,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model,
        api_key=api_key,
        spec=spec,
        enforce_eager=not args.compile,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_batch_size,
        dtype=dtype,
        prefix_caching=args.prefix_cache_tokens > 0,
        tool_call_parser=resolve(args.tool_call_parser, template_in_folder(folder)),
        extra=tuple(args.vllm_arg or ()),
    ).args()
    cmd = vllm.server_command(python, server)
    print(
        f"dlm serve: vLLM {version} serving '{args.served_model_name or args.model}' ({folder})"
        + (f" with drafter {spec['model']} (K={spec['num_speculative_tokens']})" if spec and "model" in spec else "")
        + (f" with prompt lookup (K={spec['num_speculative_tokens']})" if spec and "model" not in spec else "")
        + f" on http://{args.host}:{args.port}/v1",
        flush=True,
    )
    print("dlm serve: runs  " + " ".join(vllm.redact(cmd)), flush=True)
    print("dlm serve: same as  " + vllm.vllm_serve_command(server), flush=True)
    if args.print_command:
        return 0
    proc = subprocess.Popen(cmd, env=vllm.server_env())
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise


def run(args) -> int:
    import logging

    from dlm.errors import DLMError, require

    if args.engine == "vllm":
        return run_vllm(args)
    for flag, val in (
        ("--drafter", args.drafter),
        ("--num-speculative-tokens", args.num_speculative_tokens),
        ("--vllm-python", args.vllm_python),
        ("--max-model-len", args.max_model_len),
        ("--vllm-arg", args.vllm_arg or None),
    ):
        if val is not None:
            raise DLMError(
                f"{flag} goes with --engine vllm (dlm's own engine drafts with the model itself: --decode isd)"
            )
    from dlm.decode.configs import config_from_args
    from dlm.model.families import default_decoder

    args.decode = args.decode or default_decoder(args.model, "isd")
    decoder = config_from_args(args, command_defaults=SERVE_DEFAULTS)  # bad values fail before the model loads
    require("fastapi", "serve")
    uvicorn = require("uvicorn", "serve")
    from dlm.serve.app import ServeSettings, create_app, load_engine
    from dlm.serve.scheduler import Scheduler

    options = engine_options.from_args(args)  # bad values fail before the model loads
    if not 0 < args.port < 65536:
        raise DLMError(f"--port must be in 1..65535, got {args.port}")
    settings = ServeSettings(
        model_name=args.served_model_name or args.model,
        max_tokens_limit=args.max_tokens_limit,
        api_key=args.api_key or env("DLM_API_KEY") or None,
        max_body_bytes=args.max_body_bytes,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        max_queue=args.max_queue,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = load_engine(
        args.model,
        decoder,
        options=options,
        device=args.device,
        dtype=args.dtype,
    )
    app = create_app(Scheduler(engine), settings)
    stride = getattr(engine.decoder, "stride", None)
    policy = getattr(getattr(engine.decoder, "policy", None), "name", None)
    parser = app.state.validator.tool_parser
    thinking = app.state.validator.reasoning_parser
    print(
        f"dlm serve: '{settings.model_name}' with {args.decode}"
        + (f" (stride {stride}, drafting: {policy})" if stride else "")
        + (f", tool calls read as {parser}" if parser else "")
        + (", <think> sent as reasoning_content" if thinking else "")
        + f", batch {args.max_batch_size}, on http://{args.host}:{args.port}/v1",
        flush=True,
    )
    if engine.kernels is not None:  # which path each kind of linear layer takes, and why (the measured times)
        print(f"dlm serve: CPU kernels: {engine.kernels.describe()}", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        logging.getLogger("dlm.serve").warning(
            "binding %s without --api-key: anyone who can reach this port can use the model", args.host
        )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
