"""Decode prompts with ar | mdm | block | isd and print the text and, per prompt, forwards, tokens per forward
(TPF), ISD acceptance per draft position and tokens/s.

  dlm generate --model smollm2-135m --prompt "The capital of France is" --decode isd --stride 3
  dlm generate --model runs/idlm --prompts-file prompts.jsonl --decode isd --json > out.jsonl

A plain AR folder/alias with --decode isd is converted to an I-DLM on the fly (untrained masks: the output still
equals AR greedy, only slower). --prompts-file: one prompt per line, or JSONL with a "prompt" field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dlm.decode import options as engine_options


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m", help="AR or DLM model: hub id (org/name), local folder or alias")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts-file", help="one prompt per line, or JSONL with a 'prompt' field")
    from dlm.decode.configs import add_decoder_arguments

    add_decoder_arguments(p, default=None, implied="ar; renoise on a DiffusionGemma (renoising) model")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--suffix",
        help="text after the answer (fill-in-the-middle): the answer's --max-new-tokens masks sit between the prompt "
        "and it, and a bidirectional DLM fills them seeing both (--decode mdm)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide positive logits / multiply negative ones of tokens already in the prompt or output (1 = off; "
        "--decode ar or isd)",
    )
    p.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtract from tokens already in the output (-2..2)"
    )
    p.add_argument(
        "--min-tokens", type=int, default=0, help="no end-of-sequence before this many new tokens (--decode ar or isd)"
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtract this times a token's count in the output so far (-2..2)",
    )
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="structured output: a JSON value valid under this JSON schema (a file, or the schema itself); "
        "--decode ar or isd",
    )
    shape.add_argument("--json-object", action="store_true", help="structured output: any JSON object")
    shape.add_argument("--regex", help="structured output: text matching this regular expression in full")
    shape.add_argument(
        "--choice", action="append", default=None, help="structured output: exactly one of these (repeatable)"
    )
    shape.add_argument(
        "--grammar", metavar="LARK", help="structured output: a Lark grammar, start rule 'start' (a file, or the text)"
    )
    p.add_argument(
        "--compact-json",
        action="store_true",
        help="with --json-schema / --json-object: no free whitespace in the JSON (small models may loop on it)",
    )
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per line and prompt")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="each new token's log-probability under the model and its K most likely alternatives (0..20; "
        "--decode ar or isd): a 'logprobs' list in --json output, their sum in the summary line",
    )
    p.add_argument("--dtype", default="float32")
    engine_options.add_flags(p, engine_options.COMMANDS, "--batch-size", "prompts decoded together")
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar over the prompts (shown for more than one prompt, only when stderr is a terminal)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="say on stderr how the engine runs the model: which path each kind of linear layer takes on the CPU "
        "(the kernels' packing or torch's own layers) and the measured times that chose it",
    )


def read_prompts(args) -> list[str]:
    from dlm.errors import DLMError

    if args.prompt is not None:
        return [args.prompt]
    path = Path(args.prompts_file)
    if not path.is_file():
        raise DLMError(f"--prompts-file '{path}' does not exist")
    prompts = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DLMError(f"--prompts-file '{path}' line {i}: invalid JSON ({e})") from e
            if not isinstance(rec.get("prompt"), str):
                raise DLMError(f"--prompts-file '{path}' line {i}: a JSON line needs a string field 'prompt'")
            prompts.append(rec["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise DLMError(f"--prompts-file '{path}' holds no prompts")
    return prompts


def structured_from_args(args):
    """The --json-schema / --json-object / --regex / --choice / --grammar request (None without one), checked."""
    from dlm.decode.structured import StructuredOutput
    from dlm.errors import DLMError

    def text(value: str, flag: str, opening: str) -> str:
        """A file's text, or the value itself where it is the schema / grammar (not a missing file's name)."""
        path = Path(value)
        if path.is_file():
            return path.read_text()
        if not value.lstrip().startswith(opening):
            raise DLMError(f"{flag} '{value}' is no file (give a file, or the {flag[2:].replace('-', ' ')} itself)")
        return value

    fields: dict = {}
    if args.json_schema is not None:
        fields["json"] = text(args.json_schema, "--json-schema", "{")
    elif args.json_object:
        fields["json_object"] = True
    elif args.regex is not None:
        fields["regex"] = args.regex
    elif args.choice is not None:
        fields["choice"] = tuple(args.choice)
    elif args.grammar is not None:
        fields["grammar"] = text(args.grammar, "--grammar", "")
    if not fields:
        if args.compact_json:
            raise DLMError("--compact-json needs --json-schema or --json-object")
        return None
    flag = {
        "json": "--json-schema",
        "json_object": "--json-object",
        "regex": "--regex",
        "choice": "--choice",
        "grammar": "--grammar",
    }
    try:
        spec = StructuredOutput(**fields, disable_any_whitespace=args.compact_json)
        spec.check()
    except DLMError as e:
        raise DLMError(f"{flag[next(iter(fields))]}: {e}") from e
    return spec


def run(args) -> int:
    if not args.verbose:
        return _run(args)
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dlm generate: %(message)s"))
    logger = logging.getLogger("dlm.decode.cpu")  # the kernels' choice at attach (and its choice module)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return _run(args)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run(args) -> int:
    import warnings

    from dlm.decode import generate
    from dlm.decode.configs import config_from_args
    from dlm.decode.sampling import SamplingParams
    from dlm.device import get_device, get_dtype
    from dlm.errors import DLMError
    from dlm.model.convert import load_any
    from dlm.model.families import default_decoder
    from dlm.model.hub import resolve_model_path
    from dlm.progress import wanted

    args.decode = args.decode or default_decoder(args.model, "ar")
    decoder = config_from_args(args)  # bad values fail before the model loads
    options = engine_options.from_args(args)  # bad values fail before the model loads
    prompts = read_prompts(args)
    structured = structured_from_args(args)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_strings=tuple(args.stop),
        logprobs=args.logprobs,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
        structured=structured,
    )
    from dlm.decode.configs import entry
    from dlm.decode.engine import refuse

    decoder_class = entry(args.decode).decoder_class()  # what it can do: refused before the model loads
    if args.suffix is not None:
        refuse(decoder_class, "suffix", "--suffix (text after the answer: fill-in-the-middle)")
    used = [
        f
        for f, on in (
            ("--logprobs", params.logprobs is not None),
            ("a structured output", structured is not None),
            ("the penalties", params.adjusts and structured is None),
        )
        if on
    ]
    if used:
        refuse(decoder_class, "scores", " and ".join(used))
    device = get_device()
    folder = resolve_model_path(args.model)
    from dlm.model.families import inspect_folder

    objective = entry(args.decode).objective
    is_dlm = inspect_folder(folder).is_dlm  # a dlm folder or a published family's
    if is_dlm or args.decode != "ar":
        if not is_dlm and args.decode in ("mdm", "block"):
            print(
                f"dlm generate: note: '{args.model}' is a plain AR model; converting to an untrained "
                f"'{objective}' DLM on the fly (expect noise)",
                file=sys.stderr,
            )
        convert_kw = {}
        if not is_dlm and args.decode == "isd" and decoder.stride:
            convert_kw["block_size"] = decoder.stride - 1  # untrained anyway: no stride warning on the fly
        model = load_any(folder, convert_to=objective, dtype=get_dtype(args.dtype, device), device=device, **convert_kw)
    else:
        from dlm.model.hub import load_model, load_tokenizer

        model = load_model(folder, dtype=get_dtype(args.dtype, device), device=device)
        model.tokenizer = load_tokenizer(folder)
    tok = model.tokenizer
    if tok is None:
        raise DLMError(f"'{folder}' has no tokenizer files; save the tokenizer next to the model")
    ids = []
    for text in prompts:
        if args.chat:
            if not getattr(tok, "chat_template", None):
                raise DLMError(f"--chat: the tokenizer of '{args.model}' has no chat template; drop --chat")
            ids.append(
                tok.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        else:
            ids.append(tok(text)["input_ids"])
        if hasattr(ids[-1], "tolist"):
            ids[-1] = ids[-1].tolist()
        if isinstance(ids[-1], dict):
            ids[-1] = ids[-1]["input_ids"]
    if args.suffix:
        import dataclasses

        params = dataclasses.replace(params, suffix_ids=tuple(tok(args.suffix, add_special_tokens=False)["input_ids"]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        results = generate(
            model,
            ids,
            decoder,
            params,
            tokenizer=tok,
            options=options,
            progress=len(ids) > 1 and wanted(args.quiet),
        )
    for w in caught:
        if issubclass(w.category, UserWarning):
            print(f"dlm generate: warning: {w.message}", file=sys.stderr)
    for prompt, r in zip(prompts, results):
        s = r.stats
        if args.json:
            rec = {
                "prompt": prompt,
                "text": r.text,
                "token_ids": r.token_ids,
                "forwards": s.forwards,
                "tpf": round(s.tpf, 4),
                "acceptance": [round(a, 4) for a in s.acceptance],
                "tokens_per_s": round(s.tokens_per_s, 2),
                "finish_reason": r.finish_reason,
                "decode": args.decode,
            }
            if s.canvas_steps:
                rec["steps_per_canvas"] = list(s.canvas_steps)
            if r.logprobs is not None:
                rec["logprobs"] = [
                    {"token_id": t.token_id, "token": tok.decode([t.token_id]), "logprob": t.logprob, "top": t.top}
                    for t in r.logprobs
                ]
            print(json.dumps(rec, ensure_ascii=False))
        else:
            acc = " ".join(f"{a:.2f}" for a in s.acceptance) or "-"
            lp = "" if r.logprobs is None else f", log-probability {sum(t.logprob for t in r.logprobs):.3f}"
            print(f"=== {prompt!r}\n{r.text}")
            what = (
                f"denoising steps per canvas [{' '.join(map(str, s.canvas_steps))}]"
                if s.canvas_steps
                else f"acceptance per draft position [{acc}]"
            )
            print(
                f"--- {len(r.token_ids)} tokens, {s.forwards} forwards, TPF {s.tpf:.2f}, {what}, "
                f"{s.tokens_per_s:.1f} tokens/s ({r.finish_reason}{lp})"
            )
    return 0
