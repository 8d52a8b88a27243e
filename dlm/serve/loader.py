"""Load a model for the server: a DLM folder, AR folder or alias, converted on the fly where the decoder needs it,
and the :class:`~dlm.decode.engine.Engine` that runs it."""

from __future__ import annotations

from dlm import deprecations
from dlm.decode.configs import DecoderConfig, entry, make_config
from dlm.decode.engine import Engine
from dlm.decode.options import EngineOptions, misplaced
from dlm.device import get_device, get_dtype
from dlm.errors import DLMError
from dlm.model.convert import load_any


def load_engine(
    model: str,
    decoder: str | DecoderConfig = "isd",
    options: EngineOptions | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    decode: str | None = None,
    isd_token_budget=None,
    **settings,
):
    """Load ``model`` (DLM folder, AR folder or alias; a plain AR model is converted on the fly: to an I-DLM for
    ``isd``/``ar``, to an untrained mdm/block DLM for those decoders) and build the decoding
    :class:`~dlm.decode.engine.Engine` running ``decoder``: a config of :mod:`dlm.decode.configs` (e.g.
    ``ISDConfig(stride=3, draft_budget="auto")``) or a decoder name for its defaults, with ``options``
    (:class:`~dlm.decode.options.EngineOptions`; ``dlm serve`` passes :data:`~dlm.decode.options.SERVER`'s defaults
    and its flags). Bad settings fail before the model loads. ``settings`` (the config's fields as keywords) and the
    old ``decode=`` / ``isd_token_budget=`` keywords are deprecated: pass a config."""

    misplaced(settings, "load_engine()")
    if decode is not None or isd_token_budget is not None or settings:
        deprecations.warn("load_engine(decode=..., **settings)")
    if decode is not None:
        decoder = decode
    if isd_token_budget is not None:
        settings["draft_budget"] = isd_token_budget
    if options is not None and not isinstance(options, EngineOptions):
        raise DLMError(f"load_engine(options=...) takes an EngineOptions, got {type(options).__name__}")
    config = make_config(decoder, **settings)
    dev = get_device(device)
    dlm = load_any(
        model,
        convert_to=entry(config.name).objective or "idlm",  # ar runs on an I-DLM's clean path: the same model
        dtype=get_dtype(dtype, dev),
        device=dev,
    )
    return Engine(dlm, dlm.tokenizer, config, options)
