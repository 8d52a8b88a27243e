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

from dlm.errors import DLMError, require

require("lm_eval", "eval")

from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

from dlm.decode.configs import DecoderConfig, parse_settings  # noqa: E402
from dlm.eval.generation import generate_tokens, resolve_decoder  # noqa: E402
from dlm.eval.scoring import (  # noqa: E402
    DEFAULT_BATCH_TOKENS,
    as_eval_model,
    denoising_scores,
    encode,
    encode_pair,
    loglikelihoods,
)


def _bool_or_int(value, default):
    if value is None or value == "auto":
        return default
    return int(value)


@register_model("dlm")
class DLMHarnessModel(LM):
    """lm-evaluation-harness model over a :class:`~dlm.model.convert.DiffusionLM` or a plain HF causal LM."""

    def __init__(
        self,
        pretrained=None,
        objective: str | None = None,
        scoring: str = "auto",
        diffusion_steps: int = 32,
        seed: int = 0,
        decoder: str | DecoderConfig = "auto",
        score_batch_tokens: int = DEFAULT_BATCH_TOKENS,
        batch_size=8,
        device: str | None = None,
        dtype: str = "auto",
        diffusion_ll: str = "mean",
        tokenizer=None,
        max_batch_size=None,
        **unused,
    ):
        super().__init__()
        if pretrained is None:
            raise DLMError("lm_eval --model dlm needs --model_args pretrained=PATH_OR_ALIAS")
        if diffusion_ll not in ("mean", "sum"):
            raise DLMError(f"model_args diffusion_ll must be mean or sum, got '{diffusion_ll}'")
        if isinstance(pretrained, str):
            import json

            import torch

            from dlm.device import get_device, get_dtype
            from dlm.model.convert import load_any
            from dlm.model.hub import load_model, load_tokenizer, resolve_model_path

            if device and str(device).startswith("cuda") and not torch.cuda.is_available():
                # lm_eval's command line defaults to --device cuda; on a machine without CUDA run where we can.
                import warnings

                warnings.warn(
                    f"--device {device} requested but CUDA is not available; using {get_device()}", stacklevel=2
                )
                device = None
            dev = get_device(device)
            dt = get_dtype(dtype, dev)
            folder = resolve_model_path(pretrained)
            fields = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
            if "dlm_objective" in fields or objective:
                model = load_any(folder, objective=objective, dtype=dt, device=dev)
            else:
                model, tokenizer = load_model(folder, dtype=dt, device=dev), load_tokenizer(folder)
        else:
            model = pretrained  # an already loaded model object
        model.eval()
        self.model = model
        self.em = as_eval_model(model, tokenizer, scoring)
        from dlm import deprecations

        for old in ("decode", "gen_steps", "token_budget"):
            if unused.get(old) not in (None, "", "None"):
                deprecations.warn("lm-eval model_args decode / gen_steps / token_budget", f"model_args {old}")
        if unused.get("decode") not in (None, "", "None"):
            decoder = unused.pop("decode")
        if unused.get("token_budget") not in (None, "", "None"):
            score_batch_tokens = unused.pop("token_budget")
        if unused.get("gen_steps") not in (None, "", "None"):
            unused["steps"] = unused.pop("gen_steps")
        self.steps, self.seed = int(diffusion_steps), int(seed)
        # the generation decoder: a config, or a name / "auto" with its settings from the model_args
        self.decoder = resolve_decoder(self.em, decoder, **parse_settings(unused))
        self.batch_tokens = int(score_batch_tokens)
        self.batch_size = _bool_or_int(batch_size, 8)
        self.diffusion_ll = diffusion_ll

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

    def _score(self, pairs, keys) -> list[tuple[float, bool]]:
        if self.em.kind == "causal":
            return loglikelihoods(self.em, pairs, self.batch_tokens)
        scores = denoising_scores(
            self.em, pairs, keys, steps=self.steps, seed=self.seed, batch_tokens=self.batch_tokens
        )
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
                out.append(sum(ll for ll, _ in loglikelihoods(self.em, windows, self.batch_tokens)))
            else:  # an estimate of the total log-likelihood: minus (mean denoising CE x tokens)
                scores = denoising_scores(
                    self.em, windows, keys, steps=self.steps, seed=self.seed, batch_tokens=self.batch_tokens
                )
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
            seed=self.seed,
            batch_size=self.batch_size,
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
