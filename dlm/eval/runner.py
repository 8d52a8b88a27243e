"""``run_eval``: the one entry point of evaluation, used by ``dlm eval`` and the trainer's scheduled evaluation."""

from __future__ import annotations

import time
from collections.abc import Sequence

from dlm import deprecations
from dlm.decode.configs import DecoderConfig, ISDConfig
from dlm.errors import DLMError
from dlm.eval.generation import GenerateFn, evaluate_drafting, evaluate_generation, resolve_decoder
from dlm.eval.multiple_choice import evaluate_multiple_choice
from dlm.eval.scoring import DEFAULT_BATCH_TOKENS, as_eval_model
from dlm.eval.tasks import DEFAULT_TASKS, TASKS, load_task, parse_task_list
from dlm.eval.tasks.base import limit as _limit
from dlm.model.convert import dense_mask_attention


def _bar(name: str, examples, em, steps: int):
    """A progress bar over the scored rows of a multiple-choice task: (context, choice) pairs, times the denoising
    steps for a diffusion model (an upper bound: a step that masks no token is skipped)."""
    from dlm.progress import bar

    pairs = sum(len(ex.choices) for ex in examples)
    total = pairs if em.kind == "causal" else pairs * steps
    return bar(total, f"dlm eval {name}", "row")


def _settings(decoder, score_batch_tokens: int, deprecated: dict):
    """(generation decoder, ISD config of isd_acceptance, scoring batch, settings for an "auto" decoder), with the
    deprecated keywords of run_eval mapped onto them (a DeprecationWarning each)."""
    known = {"decode", "gen_steps", "stride", "candidates", "token_budget"}  # their new spellings: dlm.deprecations
    unknown = set(deprecated) - known
    if unknown:
        raise TypeError(f"run_eval() got unexpected keyword arguments {', '.join(sorted(unknown))}")
    for k in deprecated:
        deprecations.warn(
            "run_eval(decode= / gen_steps= / stride= / candidates= / token_budget=)", f"run_eval({k}=...)", 4
        )
    if deprecated.get("decode") is not None:
        decoder = deprecated["decode"]
    if deprecated.get("token_budget") is not None:
        score_batch_tokens = deprecated["token_budget"]
    isd = {k: deprecated[k] for k in ("stride", "candidates") if deprecated.get(k) is not None}
    if isinstance(decoder, ISDConfig):
        drafting = decoder
    else:
        drafting = ISDConfig(**isd)
    if decoder == "isd" and isd:
        decoder = drafting
    gen = {"steps": deprecated["gen_steps"]} if deprecated.get("gen_steps") is not None else {}
    return decoder, drafting, int(score_batch_tokens), gen


def run_eval(
    model,
    tasks: str | Sequence[str] = DEFAULT_TASKS,
    *,
    tokenizer=None,
    data_dir=None,
    paths: dict | None = None,
    limit: int | None = None,
    scoring: str = "auto",
    diffusion_steps: int = 32,
    seed: int = 0,
    decoder: str | DecoderConfig = "auto",
    poem_direction: str = "ftb",
    poem_gen_length: int = 28,
    batch_size: int = 8,
    score_batch_tokens: int = DEFAULT_BATCH_TOKENS,
    keep_predictions: bool = False,
    generate_fn: GenerateFn | None = None,
    log=None,
    progress: bool = False,
    **deprecated,
) -> dict:
    """Evaluate ``model`` on ``tasks`` and return ``{task: {"acc", "acc_stderr", ["acc_norm", ...], "n",
    "seconds", ...}}``.

    - ``model``: a :class:`~dlm.model.convert.DiffusionLM` (carries its tokenizer) or a plain HF causal LM with
      ``tokenizer=``. Scoring follows the model's kind (``scoring="auto"``): the exact AR log-likelihood for AR
      models and I-DLM, the denoising score with ``diffusion_steps`` masks for mdm/block DLMs, in batches of at most
      ``score_batch_tokens`` tokens (rows x padded length) per forward.
    - Task data: ``paths={"piqa": FILE_OR_DIR, ...}`` per task, else ``data_dir/<task>/``. ``limit``: first N
      examples of each task.
    - Generation tasks (lambada, poem_reverse) decode greedily with ``decoder``: a decoder config
      (:mod:`dlm.decode.configs`, e.g. ``MDMConfig(steps=16)``), a decoder name, or ``"auto"``: the model's own.
    - ``isd_acceptance`` (I-DLM only) decodes greedily with ISD, with ``decoder``'s settings when it is an
      :class:`~dlm.decode.configs.ISDConfig` (``stride``, default the model's ``block_size + 1``; ``candidates``),
      and reports acceptance per draft position, TPF and whether the output equals greedy AR.
    - Deprecated keywords (one release): ``decode`` (-> ``decoder``), ``gen_steps`` (-> the config's ``steps``),
      ``stride`` / ``candidates`` (-> ``ISDConfig``), ``token_budget`` (-> ``score_batch_tokens``).
    - Deterministic for a ``seed``. Runs without gradients; the model's train/eval mode is restored afterwards,
      so a training loop can call this between steps. ``log(str)`` receives one line per finished task;
      ``progress``: a progress bar per task on stderr (rate, ETA): rows scored, or prompts generated.
    Flatten the result with :func:`dlm.eval.history.flatten_metrics` / append it with
    :func:`dlm.eval.history.append_history`.
    """
    decoder, drafting, score_batch_tokens, gen_settings = _settings(decoder, score_batch_tokens, deprecated)
    names = parse_task_list(tasks)
    em = as_eval_model(model, tokenizer, scoring)
    was_training = model.training
    results: dict = {}
    # Load every task first: a bad file fails in a second, not after an hour of scoring the tasks before it.
    loaded = {}
    for name in names:
        options = {"direction": poem_direction, "gen_length": poem_gen_length} if name == "poem_reverse" else {}
        loaded[name] = _limit(load_task(name, data_dir, paths, **options), limit)
    model.eval()
    with dense_mask_attention(model):
        try:
            for name in names:
                module = TASKS[name]
                t0 = time.perf_counter()
                examples = loaded[name]
                if not examples:
                    raise DLMError(f"{name}: --limit {limit} leaves no examples; use a positive --limit")
                if module.KIND == "isd":
                    res = evaluate_drafting(
                        em,
                        examples,
                        name,
                        drafting,
                        batch_size=batch_size,
                        keep_predictions=keep_predictions,
                        progress=progress,
                    )
                elif module.KIND == "mc":
                    bar = _bar(name, examples, em, diffusion_steps) if progress else None
                    try:
                        res = evaluate_multiple_choice(
                            em,
                            examples,
                            name,
                            steps=diffusion_steps,
                            seed=seed,
                            batch_tokens=score_batch_tokens,
                            keep_predictions=keep_predictions,
                            progress=bar,
                        )
                    finally:
                        if bar is not None:
                            bar.close()
                else:
                    res = evaluate_generation(
                        em,
                        examples,
                        name,
                        decoder=resolve_decoder(em, decoder, **gen_settings),
                        seed=seed,
                        batch_size=batch_size,
                        generate_fn=generate_fn,
                        keep_predictions=keep_predictions,
                        progress=progress,
                    )
                res["seconds"] = time.perf_counter() - t0
                results[name] = res
                if log is not None and module.KIND == "isd":
                    k = f" K={res['candidates']}" if res["candidates"] > 1 else ""
                    log(
                        f"{name}: N={res['stride']}{k} acceptance {', '.join(f'{a:.3f}' for a in res['acceptance'])}, "
                        f"TPF {res['tpf']:.3f}, identical to AR {res['identical']:.0%} on {res['n']} prompts "
                        f"({res['seconds']:.1f} s)"
                    )
                elif log is not None:
                    log(
                        f"{name}: acc {res['acc']:.4f} +- {res['acc_stderr']:.4f} on {res['n']} examples "
                        f"({res['seconds']:.1f} s)"
                    )
        finally:
            if was_training:
                model.train()
    return results
