"""Decoding: one token-id engine (KV cache, continuous batching, streaming) plus the samplers.

- :class:`dlm.decode.engine.Engine` runs ``ar`` and ``isd`` (KV-cache extends, requests join/leave per step);
- :func:`dlm.decode.mdm.mdm_generate` runs the masked-diffusion samplers (confidence / random / threshold);
- :func:`dlm.decode.block.block_generate` runs block diffusion (SDAR/BD3);
- :func:`generate` picks the right one from a decoder name, for the CLI and evaluation.
"""

from __future__ import annotations

DECODERS = ("ar", "mdm", "block", "isd")


def generate(model, prompts, decode: str = "ar", params=None, *, tokenizer=None, batch_size: int = 8,
             stride: int | None = None, draft: str = "sample", method: str = "confidence", steps: int | None = None,
             threshold: float | None = 0.9, block_length: int = 32, on_tokens=None):
    """Decode token-id prompts with ``decode`` in ar | mdm | block | isd; returns one GenerationResult per prompt
    (``token_ids`` = generated ids, ``text`` when a tokenizer is known, ``stats`` with forwards/TPF/acceptance)."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.errors import DLMError, closest

    params = params or SamplingParams()
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if decode in ("ar", "isd"):
        kw = {"stride": stride, "draft": draft} if decode == "isd" else {}
        engine = Engine(model, tokenizer, decoder=decode, max_batch_size=batch_size, **kw)
        return engine.generate(prompts, params, on_tokens=on_tokens)
    if decode not in DECODERS:
        raise DLMError(f"unknown decoder '{decode}' (--decode): did you mean {closest(decode, DECODERS)}?")
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    stop = frozenset(params.stop_token_ids or ()) if params.stop_token_ids is not None else \
        (frozenset() if params.ignore_eos or eos is None else frozenset([eos]))
    spec = getattr(model, "spec", None)
    if decode == "mdm":
        from dlm.decode.mdm import mdm_generate

        if spec is not None and spec.objective != "mdm":
            raise DLMError(f"--decode mdm needs a bidirectional masked-diffusion model (objective 'mdm'); this is "
                           f"a '{spec.objective}' model: use --decode {'isd' if spec.objective == 'idlm' else 'block'}")
        results = mdm_generate(model, [list(p) for p in prompts], params, method=method, steps=steps,
                               threshold=threshold if threshold is not None else 0.9, block_length=block_length,
                               stop_ids=stop)
    else:
        from dlm.decode.block import block_generate

        results = block_generate(model, [list(p) for p in prompts], params, steps=steps, threshold=threshold,
                                 stop_ids=stop)
    for r in results:
        if tokenizer is not None:
            r.text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
        if on_tokens is not None:
            on_tokens(r.request_id, r.token_ids, True)
    return results
