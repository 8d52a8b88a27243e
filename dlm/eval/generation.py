"""Generation tasks (LAMBADA, poem reversal) through the decoding engine, so any decoder can be evaluated.

The tasks call one function, :func:`generate_tokens` ``(em, prompts, max_new_tokens, decoder, seed, batch_size)
-> list[list[int]]`` (greedy), which runs :func:`dlm.decode.generate` with ``decoder``: a decoder config
(:mod:`dlm.decode.configs`), a decoder name, or ``"auto"``: the model's own decoder (``ar`` for AR models, ``isd``
for I-DLM, ``mdm`` / ``block`` for those objectives) with its defaults. Any function with the same signature can be
passed as ``generate_fn`` instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from dlm import progress as bars
from dlm.decode import generate
from dlm.decode.configs import DecoderConfig, ISDConfig, field_names, make_config, own_decoder
from dlm.decode.isd import default_stride
from dlm.decode.options import COMMANDS, EngineOptions
from dlm.decode.sampling import SamplingParams, draft_totals
from dlm.errors import DLMError
from dlm.eval.scoring import EvalModel, encode, encode_pair, stderr_of_mean
from dlm.eval.tasks.base import GenExample

GenerateFn = Callable[..., list[list[int]]]


def resolve_decoder(em: EvalModel, decoder: str | DecoderConfig = "auto", **settings) -> DecoderConfig:
    """``decoder`` as a config for this model: ``"auto"`` is the model's own decoder; ``settings`` (config fields,
    e.g. ``steps``) are applied where that decoder has them. A diffusion decoder on a plain AR model is refused."""
    if decoder == "auto":
        decoder = own_decoder(em.objective)
    if isinstance(decoder, str):
        decoder = make_config(decoder, **{k: v for k, v in settings.items() if k in field_names(decoder)})
    if decoder.name in ("mdm", "block", "isd") and em.mask_token_id is None:
        raise DLMError(
            f"--decode {decoder.name} needs a diffusion LM (mask token); this is a plain AR model: use --decode ar"
        )
    return decoder


def generate_tokens(
    em: EvalModel,
    prompts: Sequence[list[int]],
    max_new_tokens: Sequence[int],
    decoder: str | DecoderConfig = "auto",
    seed: int = 0,
    batch_size: int = 8,
    progress=None,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids) through :func:`dlm.decode.generate`; ``max_new_tokens[i]``
    tokens for prompt i (fewer if the model stops at EOS). One engine run: requests of different lengths share the
    batch. ``progress``: as :func:`dlm.decode.generate`'s (a bar, or ``True`` for one on stderr)."""

    config = resolve_decoder(em, decoder)
    model = em.dlm if em.dlm is not None else em.model
    params = [SamplingParams(max_new_tokens=int(n), temperature=0.0, seed=seed) for n in max_new_tokens]
    results = generate(
        model,
        [list(p) for p in prompts],
        config,
        params,
        tokenizer=em.tokenizer,
        # prompts under one chat template or few-shot preamble prefill only what differs
        options=EngineOptions(max_batch_size=batch_size, prefix_cache=COMMANDS.prefix_cache),
        progress=progress,
    )
    return [list(r.token_ids) for r in results]


def _prompt_ids(em: EvalModel, ex: GenExample) -> list[int]:
    if ex.chat and getattr(em.tokenizer, "chat_template", None):
        text = em.tokenizer.apply_chat_template(
            [{"role": "user", "content": ex.prompt}], tokenize=False, add_generation_prompt=True
        )
        return encode(em.tokenizer, text)
    ids = encode(em.tokenizer, ex.prompt)
    return ids or [em.prefix_token_id]


def evaluate_generation(
    em: EvalModel,
    examples: Sequence[GenExample],
    task: str,
    decoder: str | DecoderConfig = "auto",
    seed: int = 0,
    batch_size: int = 8,
    generate_fn: GenerateFn | None = None,
    keep_predictions: bool = False,
    progress: bool = False,
) -> dict:
    """Accuracy of a generation task, decoded by ``decoder`` (a config, a name or ``"auto"``: see
    :func:`resolve_decoder`). ``progress``: a bar on stderr over the prompts (default ``generate_fn``).

    ``max_new_tokens is None`` (LAMBADA): generate exactly as many tokens as the target has (the target encoded
    after the prompt with its leading space) and count an exact match of the stripped text. Otherwise (poem
    reversal) generate that many tokens and count a hit when the target occurs in the text.
    """
    t0 = time.perf_counter()
    config = resolve_decoder(em, decoder)
    fn = generate_fn or generate_tokens
    prompts, lengths, exact = [], [], []
    for ex in examples:
        if ex.max_new_tokens is None:
            ctx, cont = encode_pair(em, ex.prompt, " " + ex.target)
            prompts.append(ctx)
            lengths.append(len(cont))
            exact.append(True)
        else:
            prompts.append(_prompt_ids(em, ex))
            lengths.append(int(ex.max_new_tokens))
            exact.append(False)
    kw = {}
    if progress and generate_fn is None:
        kw["progress"] = bars.bar(len(prompts), f"dlm eval {task}", "prompt")
    try:
        outputs = fn(em, prompts, lengths, decoder=config, seed=seed, batch_size=batch_size, **kw)
    finally:
        if kw:
            kw["progress"].close()
    hits, preds = [], []
    for ex, out, is_exact in zip(examples, outputs, exact):
        text = em.tokenizer.decode(out, skip_special_tokens=True)
        hit = text.strip() == ex.target.strip() if is_exact else ex.target in text
        hits.append(float(hit))
        preds.append({"id": ex.id, "target": ex.target, "output": text, "hit": bool(hit)})
    result = {
        "acc": sum(hits) / len(hits),
        "acc_stderr": stderr_of_mean(hits),
        "n": len(hits),
        "decode": config.name,
        "seconds": time.perf_counter() - t0,
    }
    if keep_predictions:
        result["predictions"] = preds
    return result


def evaluate_drafting(
    em: EvalModel,
    examples: Sequence[GenExample],
    task: str,
    decoder: ISDConfig | None = None,
    batch_size: int = 8,
    keep_predictions: bool = False,
    progress: bool = False,
) -> dict:
    """Greedy ISD on the examples' prompts: acceptance per draft position, TPF, and the share of prompts whose ISD
    output equals the model's own greedy ``ar`` output (1.0 for a correct decoder; with gated LoRA that output is
    the base model's). ``acc`` = first-position acceptance; ``acc_stderr`` its binomial standard error over the
    drafts (drafts of one answer are not independent, so read it as a lower bound). ``decoder``: the ISD settings
    (default ``ISDConfig()``: the stride is the model's trained ``block_size + 1``; ``candidates`` > 1: the
    acceptance is the drafts' top-K coverage). ``progress``: a bar on stderr over the ISD then AR runs."""

    if em.dlm is None or em.objective != "idlm":
        what = "a plain AR model" if em.dlm is None else f"a '{em.objective}' model"
        raise DLMError(
            f"{task} measures the drafts of an I-DLM (objective 'idlm'); this is {what}. Convert it "
            f"with dlm convert --objective idlm, or drop {task} from --eval-tasks"
        )
    t0 = time.perf_counter()
    decoder = decoder or ISDConfig()
    prompts = [_prompt_ids(em, ex) for ex in examples]
    params = [SamplingParams(max_new_tokens=int(ex.max_new_tokens), temperature=0.0) for ex in examples]
    bar = None
    if progress:
        bar = bars.bar(2 * len(prompts), f"dlm eval {task} (isd, then ar)", "prompt")
    options = EngineOptions(max_batch_size=batch_size)
    try:
        isd = generate(em.dlm, prompts, decoder, params, tokenizer=em.tokenizer, options=options, progress=bar)
        ar = generate(em.dlm, prompts, "ar", params, tokenizer=em.tokenizer, options=options, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    proposed, accepted = draft_totals(r.stats for r in isd)
    tokens = forwards = same = 0
    preds = []
    for ex, r, a in zip(examples, isd, ar):
        tokens += len(r.token_ids)
        forwards += r.stats.forwards
        equal = list(r.token_ids) == list(a.token_ids)
        same += equal
        preds.append(
            {
                "id": ex.id,
                "output": em.tokenizer.decode(r.token_ids, skip_special_tokens=True),
                "identical_to_ar": equal,
                "forwards": r.stats.forwards,
                "tokens": len(r.token_ids),
            }
        )
    rates = [a / p if p else 0.0 for a, p in zip(accepted, proposed)]
    first = rates[0] if rates else 0.0
    n0 = proposed[0] if proposed else 0
    result = {
        "acc": first,
        "acc_stderr": (first * (1 - first) / n0) ** 0.5 if n0 else 0.0,
        "acceptance": rates,
        "drafts": proposed,
        "tpf": tokens / max(forwards, 1),
        "identical": same / len(examples),
        "n": len(examples),
        "decode": "isd",
        "stride": decoder.stride or default_stride(em.dlm.block_size, decoder.candidates),
        "candidates": decoder.candidates,
        "seconds": time.perf_counter() - t0,
    }
    for i, rate in enumerate(rates[1:], 2):  # flat numbers, so eval histories keep every position
        result[f"acc_pos{i}"] = rate
    if keep_predictions:
        result["predictions"] = preds
    return result
