"""Decoding: one token-id engine (KV cache, continuous batching, streaming) and the decoders that plug into it.

- :class:`dlm.decode.engine.Engine` runs every decoder: requests join and leave the running batch between steps;
- ``ar`` (:mod:`dlm.decode.ar`), ``isd`` (:mod:`dlm.decode.isd`): causal, KV-cache extends;
- ``mdm`` (:mod:`dlm.decode.mdm`): the masked-diffusion samplers (confidence / random / threshold / llada / dream);
- ``block`` (:mod:`dlm.decode.block`): block diffusion (SDAR/BD3, SDAR's remasking strategies);
- :func:`generate` runs a list of prompts with a decoder name, for the CLI and evaluation.
"""

from __future__ import annotations

DECODERS = ("ar", "mdm", "block", "isd")
FALLBACK_MODES = ("predict", "all", "off")  # ISD --isd-fallback (dlm.decode.isd.ISDDecoder)
FALLBACK_HELP = (
    "ISD: which outcomes of a verify step get masks for the next drafts. 'predict' (default): the "
    "likeliest by the drafts' own probabilities (all accepted, or the first rejection at d_i), so a "
    "rejection need not cost a cold-start step, at the plain chunk's 2N-1 tokens; 'all': every outcome "
    "(N-1 + N(N-1) tokens: for hardware where extra tokens are free); 'off': only all-accepted "
    "(plain ISD). Output is the same in every case"
)


def check_fallback(fallback) -> None:
    """Refuse an unknown ISD fallback mode (before any model is loaded)."""
    if fallback not in FALLBACK_MODES:
        from dlm.errors import DLMError

        raise DLMError(
            f"unknown ISD fallback mode {fallback!r}: --isd-fallback must be one of {', '.join(FALLBACK_MODES)}"
        )


MAX_CANDIDATES = 8  # ISD --isd-candidates
CANDIDATES_HELP = (
    "ISD at stride 2: verify up to K likeliest drafts for the next position at once (greedy: the "
    "mask's top K; sampling: draws without replacement, recursive rejection sampling), each with its "
    "own mask for the draft after it: a chunk of 2K+2 tokens, acceptance = the drafts' top-K coverage. "
    "The 2nd..K-th are verified only where the mask gives them >= 5%% (each costs two chunk tokens). "
    "Default 1 (plain ISD). Output is the same"
)


def check_candidates(candidates, stride=None) -> None:
    """Refuse a bad ISD ``--isd-candidates`` (before any model is loaded)."""
    from dlm.errors import DLMError

    if isinstance(candidates, bool) or not isinstance(candidates, int) or not 1 <= candidates <= MAX_CANDIDATES:
        raise DLMError(f"--isd-candidates must be an integer from 1 to {MAX_CANDIDATES}, got {candidates!r}")
    if candidates > 1 and stride not in (None, 2):
        raise DLMError(
            f"--isd-candidates {candidates} verifies several drafts for one position: it runs at "
            f"--stride 2 only, got --stride {stride}"
        )


def check_isd_flags(decode: str, flags: dict, stride: int | None = None) -> None:
    """Before any model is loaded: refuse the ISD-only ``flags`` (flag name -> value, e.g. ``{"isd-fallback":
    ...}``) that are set for another decoder, and a bad ``isd-fallback`` / ``isd-candidates`` value (the latter
    checked against ``stride``)."""
    from dlm.errors import DLMError

    for name, value in flags.items():
        if value is not None and decode != "isd":
            raise DLMError(f"--{name} is an ISD setting; drop it or use --decode isd (got --decode {decode})")
    if flags.get("isd-fallback") is not None:
        check_fallback(flags["isd-fallback"])
    if flags.get("isd-candidates") is not None:
        check_candidates(flags["isd-candidates"], stride)


def decoder_options(
    decode: str,
    *,
    stride: int | None = None,
    draft: str = "sample",
    token_budget=None,
    fallback: str | None = None,
    candidates: int | None = None,
    method: str | None = None,
    steps: int | None = None,
    threshold: float | None = 0.9,
    block_length: int = 32,
    cfg_scale: float = 0.0,
    remasking: str | None = None,
    alg: str | None = None,
    alg_temp: float | None = None,
) -> dict:
    """The keyword arguments of ``decode``'s decoder, picked from the union of every decoder's options
    (``method=None``: the sampler of the model's family, llada / dream, else confidence; ``cfg_scale``,
    ``remasking``: the llada sampler's; ``alg``, ``alg_temp``: dream's; block's ``remasking``: SDAR's)."""
    if decode == "isd":
        return {
            "stride": stride,
            "draft": draft,
            "token_budget": token_budget,
            "fallback": fallback or "predict",
            "candidates": candidates or 1,
        }
    if decode == "mdm":
        return {
            "method": method,
            "steps": steps,
            "threshold": threshold,
            "block_length": block_length,
            "cfg_scale": cfg_scale or 0.0,
            "remasking": remasking,
            "alg": alg,
            "alg_temp": alg_temp,
        }
    if decode == "block":
        return {"steps": steps, "threshold": threshold, "remasking": remasking}
    return {}


def generate(
    model,
    prompts,
    decode: str = "ar",
    params=None,
    *,
    tokenizer=None,
    batch_size: int = 8,
    stride: int | None = None,
    draft: str = "sample",
    token_budget=None,
    fallback: str | None = None,
    candidates: int | None = None,
    method: str | None = None,
    steps: int | None = None,
    threshold: float | None = 0.9,
    block_length: int = 32,
    on_tokens=None,
    threads=None,
    progress=None,
    cfg_scale: float = 0.0,
    remasking: str | None = None,
    alg: str | None = None,
    alg_temp: float | None = None,
):
    """Decode token-id prompts with ``decode`` in ar | mdm | block | isd, ``batch_size`` at a time with continuous
    batching; ``params``: one SamplingParams for all prompts or one per prompt. Returns one GenerationResult per
    prompt (``token_ids`` = generated ids, ``text`` when a tokenizer is known, ``stats`` with forwards/TPF/
    acceptance). ``threshold=None`` (or <= 0) selects block's top-k commits. ``token_budget`` (ISD): ``None``
    drafts at every step, an int drafts while rows x (2N-1) <= it, ``'auto'`` measures whether drafting pays
    (:mod:`dlm.decode.schedule`). ``fallback`` (ISD): which outcomes of a verify step get masks for the next
    drafts (:class:`dlm.decode.isd.ISDDecoder`; default ``'predict'``); ``candidates`` (ISD, stride 2): drafts
    verified per position (default 1). ``threads``: CPU threads while decoding (None: torch's setting; an int;
    ``'auto'``: the cores other processes leave idle, :mod:`dlm.decode.threads`). ``progress``: ``None``, ``True``
    (a bar on stderr: prompts done, rate, ETA) or an object with ``update(n)``, told of each finished prompt."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.errors import DLMError, closest

    if decode not in DECODERS:
        raise DLMError(f"unknown decoder '{decode}' (--decode): did you mean {closest(decode, DECODERS)}?")
    params = params or SamplingParams()
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    kw = decoder_options(
        decode,
        stride=stride,
        draft=draft,
        token_budget=token_budget,
        fallback=fallback,
        candidates=candidates,
        method=method,
        steps=steps,
        threshold=threshold,
        block_length=block_length,
        cfg_scale=cfg_scale,
        remasking=remasking,
        alg=alg,
        alg_temp=alg_temp,
    )
    from dlm.progress import bar as progress_bar

    own_bar = progress is True
    bar = progress_bar(len(prompts), f"generate {decode}", "prompt") if own_bar else progress or None
    try:
        with Engine(model, tokenizer, decoder=decode, max_batch_size=batch_size, threads=threads, **kw) as engine:
            return engine.generate([list(p) for p in prompts], params, on_tokens=on_tokens, progress=bar)
    finally:
        if own_bar:
            bar.close()
