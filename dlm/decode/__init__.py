"""Decoding: one token-id engine (KV cache, continuous batching, streaming) and the decoders that plug into it.

- :class:`dlm.decode.engine.Engine` runs every decoder: requests join and leave the running batch between steps;
- ``ar`` (:mod:`dlm.decode.ar`), ``isd`` (:mod:`dlm.decode.isd`): causal, KV-cache extends;
- ``mdm`` (:mod:`dlm.decode.mdm`): the masked-diffusion samplers (confidence / random / threshold / llada / dream);
- ``block`` (:mod:`dlm.decode.block`): block diffusion (SDAR/BD3, SDAR's remasking strategies);
- :mod:`dlm.decode.configs`: one config class per decoder (``ARConfig``, ``MDMConfig``, ``BlockConfig``,
  ``ISDConfig``) and the registry of decoders; every command builds its decoder flags from them;
- :class:`EngineOptions` (:mod:`dlm.decode.options`): the engine's own settings (batch, threads, caches), one
  default each;
- :func:`generate` runs a list of prompts with a decoder config (or name), for the CLI and evaluation.
"""

from __future__ import annotations

from dlm import deprecations
from dlm import progress as bars
from dlm.decode.configs import (
    CANDIDATES_HELP,
    DECODERS,
    FALLBACK_HELP,
    FALLBACK_MODES,
    MAX_CANDIDATES,
    ARConfig,
    BlockConfig,
    DecoderConfig,
    ISDConfig,
    MDMConfig,
    make_config,
)
from dlm.decode.options import EngineOptions, misplaced

__all__ = [
    "ARConfig",
    "BlockConfig",
    "CANDIDATES_HELP",
    "DECODERS",
    "DecoderConfig",
    "EngineOptions",
    "FALLBACK_HELP",
    "FALLBACK_MODES",
    "ISDConfig",
    "MAX_CANDIDATES",
    "MDMConfig",
    "generate",
    "make_config",
]


def generate(
    model,
    prompts,
    decoder: str | DecoderConfig = "ar",
    params=None,
    *,
    tokenizer=None,
    options: EngineOptions | None = None,
    on_tokens=None,
    progress=None,
    **settings,
):
    """Decode token-id prompts with ``decoder`` (a config, :mod:`dlm.decode.configs`, e.g. ``ISDConfig(stride=3)``;
    or a decoder name for its defaults) with continuous batching; ``params``: one SamplingParams for all prompts or
    one per prompt. Returns one GenerationResult per prompt (``token_ids`` = generated ids, ``text`` when a tokenizer
    is known, ``stats`` with forwards/TPF/acceptance). ``options``: the engine's settings
    (:class:`~dlm.decode.options.EngineOptions`: rows batched together, CPU threads, the static step, the prefix
    cache). ``progress``: ``None``, ``True`` (a bar on stderr: prompts done, rate, ETA) or an object with
    ``update(n)``, told of each finished prompt. ``settings``: the decoder's fields as keywords
    (``generate(model, prompts, "isd", stride=3)``), deprecated: pass a config."""
    # torch: `dlm --help` imports this package for the decoders' flags
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams

    misplaced(settings, "generate()")
    if settings:
        deprecations.warn("generate(..., **settings)")
    config = make_config(decoder, **settings)
    params = params or SamplingParams()
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    own_bar = progress is True
    bar = bars.bar(len(prompts), f"generate {config.name}", "prompt") if own_bar else progress or None
    try:
        with Engine(model, tokenizer, config, options) as engine:
            return engine.generate([list(p) for p in prompts], params, on_tokens=on_tokens, progress=bar)
    finally:
        if own_bar and bar is not None:
            bar.close()
