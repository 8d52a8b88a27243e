"""Load a model for the server: a DLM folder, AR folder or alias, converted on the fly where the decoder needs it,
and the :class:`~dlm.decode.engine.Engine` that runs it."""

from dlm.errors import DLMError


def load_engine(
    model: str,
    decode: str = "isd",
    stride: int | None = None,
    max_batch_size: int = 16,
    device: str | None = None,
    dtype: str | None = None,
    draft: str = "sample",
    isd_token_budget: int | str | None = None,
    fallback: str | None = None,
    candidates: int | None = None,
    threads=None,
    **diffusion_kw,
):
    """Load ``model`` (DLM folder, AR folder or alias; a plain AR model is converted on the fly: to an I-DLM for
    ``isd``/``ar``, to an untrained mdm/block DLM for those decoders) and build the decoding
    :class:`~dlm.decode.engine.Engine` for ``decode``. ``isd_token_budget``: ISD drafts only while running rows x
    (2N-1) stays within it, plain AR steps above; ``'auto'`` measures per batch size whether drafting pays
    (:mod:`dlm.decode.schedule`). ``fallback``, ``candidates``: ISD's fallback drafts and draft candidates
    (:class:`dlm.decode.isd.ISDDecoder`). ``diffusion_kw``:
    the mdm sampler's ``method``, ``steps``, ``threshold``, ``block_length``; block's ``steps``, ``threshold``."""
    from dlm.decode import check_isd_flags, decoder_options
    from dlm.decode.engine import Engine
    from dlm.device import get_device, get_dtype
    from dlm.model.convert import load_any

    if decode not in ("isd", "ar", "mdm", "block"):
        raise DLMError(f"--decode must be one of isd, ar, mdm, block; got '{decode}'")
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise DLMError(f"--max-batch-size must be a positive integer, got {max_batch_size}")
    # bad values fail before the model loads
    check_isd_flags(
        decode,
        {
            "stride": stride,
            "isd-token-budget": isd_token_budget,
            "isd-fallback": fallback,
            "isd-candidates": candidates,
        },
        stride=stride,
    )
    extra = {k for k, v in diffusion_kw.items() if v is not None} - set(decoder_options(decode))
    if extra:
        flags = ", ".join("--" + ("sampler" if k == "method" else k.replace("_", "-")) for k in sorted(extra))
        raise DLMError(
            f"{flags}: not a setting of --decode {decode} (mdm takes --sampler, --steps, --threshold, "
            f"--block-length; block takes --steps, --threshold)"
        )
    if isd_token_budget is not None:
        from dlm.decode.schedule import make_policy

        make_policy(isd_token_budget, stride or 2)  # a bad value fails before the model loads
    dev = get_device(device)
    dlm = load_any(
        model, convert_to={"mdm": "mdm", "block": "block"}.get(decode, "idlm"), dtype=get_dtype(dtype, dev), device=dev
    )
    kw = decoder_options(
        decode,
        stride=stride,
        draft=draft,
        token_budget=isd_token_budget,
        fallback=fallback,
        candidates=candidates,
        **{k: v for k, v in diffusion_kw.items() if v is not None},
    )
    return Engine(dlm, dlm.tokenizer, decoder=decode, max_batch_size=max_batch_size, threads=threads, **kw)
