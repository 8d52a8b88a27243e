"""lm-evaluation-harness adapter: the ``dlm`` model, so any harness task runs on a DLM or AR model.

Importing this module registers the model class under the name ``dlm`` in lm-eval's registry. lm-eval 0.4.x has
no plug-in discovery for external models (its ``--include_path`` loads task YAMLs only, and the registry reads no
entry points), so the plain ``lm_eval`` command cannot see a model it never imports. dlm therefore ships
``dlm-lm-eval`` (also ``python -m dlm.eval.lm_eval``): lm-eval's own command line, unchanged, with ``dlm``
registered first::

    dlm-lm-eval --model dlm --model_args pretrained=PATH,diffusion_steps=32 --tasks piqa --include_path DIR

In Python: ``import dlm.eval.lm_eval`` then ``lm_eval.simple_evaluate(model="dlm", model_args=...)``, or pass an
instance: ``simple_evaluate(model=DLMHarnessModel(dlm_model))``.

Model arguments (``--model_args k=v,...``): ``pretrained`` (DLM folder, AR folder or alias), ``objective``
(convert an AR model on the fly), ``scoring`` (auto | causal | diffusion), ``diffusion_steps`` (32), ``seed`` (0),
``decoder`` (auto | ar | mdm | block | isd) and that decoder's settings by their config field names (``steps``,
``sampler``, ``stride``, ... : :mod:`dlm.decode.configs`; in Python also a config object), ``score_batch_tokens``
(tokens per scoring forward), ``device``, ``dtype``,
``diffusion_ll`` (mean | sum: what a diffusion model's loglikelihood returns, minus the mean denoising score
(so the harness's ``acc`` equals ``dlm eval``'s) or minus the per-token mean times the number of tokens).
Deprecated (one release): ``decode`` (-> ``decoder``), ``gen_steps`` (-> ``steps``), ``token_budget`` (->
``score_batch_tokens``).

The same code as ``dlm eval`` does the work: :mod:`dlm.eval.scoring` (exact causal log-likelihood, batched
denoising score) and :func:`dlm.eval.generation.generate_tokens` (the decoding engine).
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import replace

from dlm import deprecations
from dlm.device import get_device, get_dtype
from dlm.errors import DLMError, require
from dlm.model.convert import load_any
from dlm.model.hub import load_model, load_tokenizer, resolve_model_path

require("lm_eval", "eval")

from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

from dlm.decode.configs import DecoderConfig, parse_settings  # noqa: E402
from dlm.eval.generation import generate_tokens, resolve_decoder  # noqa: E402
from dlm.eval.runner import EvalSettings  # noqa: E402
from dlm.eval.scoring import (  # noqa: E402
    as_eval_model,
    denoising_scores,
    encode,
    encode_pair,
    loglikelihoods,
)

HARNESS_SETTINGS = ("scoring", "diffusion_steps", "seed", "decoder", "score_batch_tokens", "batch_size")
_DEPRECATED = {"decode": "decoder", "gen_steps": "steps", "token_budget": "score_batch_tokens"}


def _settings(model_args: dict) -> tuple[EvalSettings, dict]:
    """The :class:`EvalSettings` in ``model_args`` (lm-eval passes strings: numbers are converted) and what is
    left: the decoder's own settings. lm-eval's ``max_batch_size`` is not used; ``batch_size`` ``auto`` is 8."""

    args = {k: v for k, v in model_args.items() if k != "max_batch_size"}
    for old, new in _DEPRECATED.items():
        value = args.pop(old, None)
        if value not in (None, "", "None"):
            deprecations.warn("lm-eval model_args decode / gen_steps / token_budget", f"model_args {old}")
            args[new] = value
    given = {k: args.pop(k) for k in HARNESS_SETTINGS if k in args}
    if given.get("batch_size") in (None, "auto"):
        given.pop("batch_size", None)
    for k in ("diffusion_steps", "seed", "score_batch_tokens", "batch_size"):
        if k in given:
            try:
                given[k] = int(given[k])
            except (TypeError, ValueError):
                raise DLMError(f"model_args {k} must be an integer, got {given[k]!r}") from None
    return EvalSettings(**given), parse_settings(args)


def _load(pretrained: str, objective, device, dtype):
    """(model, tokenizer or None) of a path or alias: a DLM folder (or ``objective``: an AR model converted on the
    fly) loads with its tokenizer, a plain AR folder as a causal LM."""
    import json
    import warnings

    import torch

    if device and str(device).startswith("cuda") and not torch.cuda.is_available():
        # lm_eval's command line defaults to --device cuda; on a machine without CUDA run where we can.
        warnings.warn(f"--device {device} requested but CUDA is not available; using {get_device()}", stacklevel=3)
        device = None
    dev = get_device(device)
    dt = get_dtype(dtype, dev)
    folder = resolve_model_path(pretrained)
    fields = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if "dlm_objective" in fields or objective:
        return load_any(folder, objective=objective, dtype=dt, device=dev), None
    return load_model(folder, dtype=dt, device=dev), load_tokenizer(folder)


@register_model("dlm")
class DLMHarnessModel(LM):
    """lm-evaluation-harness model over a :class:`~dlm.model.convert.DiffusionLM` or a plain HF causal LM."""

    def __init__(
        self,
        pretrained=None,
        objective: str | None = None,
        device: str | None = None,
        dtype: str = "auto",
        diffusion_ll: str = "mean",
        tokenizer=None,
        **model_args,
    ):
        """``pretrained``: a path / alias or a loaded model; ``objective``, ``device``, ``dtype``: how a path loads;
        ``model_args``: the :class:`~dlm.eval.runner.EvalSettings` fields the harness uses (``scoring``,
        ``diffusion_steps``, ``seed``, ``decoder``, ``score_batch_tokens``, ``batch_size``) and the decoder's own
        settings by their config names (see the module doc)."""
        super().__init__()
        if pretrained is None:
            raise DLMError("lm_eval --model dlm needs --model_args pretrained=PATH_OR_ALIAS")
        if diffusion_ll not in ("mean", "sum"):
            raise DLMError(f"model_args diffusion_ll must be mean or sum, got '{diffusion_ll}'")
        settings, decoder_settings = _settings(model_args)  # bad values fail before the model loads
        if isinstance(pretrained, str):
            model, tokenizer = _load(pretrained, objective, device, dtype)
        else:
            model = pretrained  # an already loaded model object
        model.eval()
        self.model = model
        self.em = as_eval_model(model, tokenizer, settings.scoring)
        # the generation decoder: a config, or a name / "auto" with its settings from the model_args
        self.settings = replace(settings, decoder=resolve_decoder(self.em, settings.decoder, **decoder_settings))
        self.diffusion_ll = diffusion_ll

    @property
    def decoder(self) -> DecoderConfig:
        """The generation tasks' decoder config."""
        return self.settings.decoder

    # -- lm-eval API --------------------------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.em.tokenizer, "name_or_path", "dlm")).replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        return self.em.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def chat_template(self, chat_template=False):
        return getattr(self.em.tokenizer, "chat_template", None)

    def _denoising(self, pairs, keys) -> list[float]:
        """The denoising scores of (context, continuation) pairs under the settings' steps, seed and batch."""
        s = self.settings
        return denoising_scores(
            self.em, pairs, keys, steps=s.diffusion_steps, seed=s.seed, batch_tokens=s.score_batch_tokens
        )

    def _score(self, pairs, keys) -> list[tuple[float, bool]]:
        if self.em.kind == "causal":
            return loglikelihoods(self.em, pairs, self.settings.score_batch_tokens)
        scores = self._denoising(pairs, keys)
        if self.diffusion_ll == "sum":
            return [(-s * len(cont), False) for s, (_, cont) in zip(scores, pairs)]
        return [(-s, False) for s in scores]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs, keys = [], []
        for req in requests:
            context, continuation = req.args[0], req.args[1]
            pairs.append(encode_pair(self.em, context, continuation))
            keys.append(zlib.crc32(context.encode()))  # the choices of one question share their mask draws
        return self._score(pairs, keys)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            text = req.args[0]
            tokens = encode(self.em.tokenizer, text)
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=tokens,
                    prefix_token=self.em.prefix_token_id,
                    max_seq_len=self.em.max_length,
                    context_len=1,
                )
            ]
            keys = [zlib.crc32(f"{text}:{i}".encode()) for i in range(len(windows))]
            if self.em.kind == "causal":
                out.append(sum(ll for ll, _ in loglikelihoods(self.em, windows, self.settings.score_batch_tokens)))
            else:  # an estimate of the total log-likelihood: minus (mean denoising CE x tokens)
                scores = self._denoising(windows, keys)
                out.append(-sum(s * len(c) for s, (_, c) in zip(scores, windows)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, lengths, stops = [], [], []
        for req in requests:
            context, gen_kwargs = req.args[0], dict(req.args[1] or {})
            until = gen_kwargs.get("until") or []
            if isinstance(until, str):
                until = [until]
            max_new = int(gen_kwargs.get("max_gen_toks", 256))
            ids = encode(self.em.tokenizer, context) or [self.em.prefix_token_id]
            room = self.em.max_length - max_new
            prompts.append(ids[-room:] if room > 0 else ids[-1:])
            lengths.append(max_new)
            stops.append(until)
        outs = generate_tokens(
            self.em,
            prompts,
            lengths,
            decoder=self.decoder,
            seed=self.settings.seed,
            batch_size=self.settings.batch_size,
        )
        texts = []
        for out, until in zip(outs, stops):
            text = self.em.tokenizer.decode(out, skip_special_tokens=True)
            cuts = [text.find(s) for s in until if s and s in text]
            texts.append(text[: min(cuts)] if cuts else text)
        return texts


def main(argv: list[str] | None = None) -> None:
    """``dlm-lm-eval``: lm-eval's command line with the ``dlm`` model registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    cli_evaluate()


if __name__ == "__main__":
    main()
