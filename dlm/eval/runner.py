"""``run_eval``: the one entry point of evaluation, used by ``dlm eval`` and the trainer's scheduled evaluation."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from dlm import deprecations
from dlm.decode.configs import DecoderConfig, ISDConfig
from dlm.errors import DLMError
from dlm.eval.generation import GenerateFn, evaluate_drafting, evaluate_generation, resolve_decoder
from dlm.eval.multiple_choice import evaluate_multiple_choice
from dlm.eval.scoring import DEFAULT_BATCH_TOKENS, as_eval_model
from dlm.eval.tasks import DEFAULT_TASKS, TASKS, load_task, parse_task_list
from dlm.eval.tasks.base import limit as _limit
from dlm.eval.tasks.poem_reverse import GEN_LENGTH as POEM_GEN_LENGTH
from dlm.model.convert import dense_mask_attention
from dlm.progress import bar


def _bar(name: str, examples, em, steps: int):
    """A progress bar over the scored rows of a multiple-choice task: (context, choice) pairs, times the denoising
    steps for a diffusion model (an upper bound: a step that masks no token is skipped)."""

    pairs = sum(len(ex.choices) for ex in examples)
    total = pairs if em.kind == "causal" else pairs * steps
    return bar(total, f"dlm eval {name}", "row")


@dataclass(frozen=True)
class EvalSettings:
    """How :func:`run_eval` evaluates: which examples, how multiple choice is scored, how generation tasks decode.
    ``dlm eval``'s flags, the trainer's ``eval.*`` fields and lm-evaluation-harness's ``model_args`` all become
    one of these."""

    data_dir: str | Path | None = None
    """Folder with ``<task>/`` files."""
    paths: Mapping[str, str | Path] | None = None
    """A file or folder per task (``{"piqa": FILE_OR_DIR}``), before ``data_dir``."""
    limit: int | None = None
    """The first N examples of each task (None: all)."""
    scoring: str = "auto"
    """Multiple choice: ``auto`` follows the model's kind (the exact AR log-likelihood for AR models and I-DLM, the
    denoising score for mdm / block DLMs), ``causal`` or ``diffusion``."""
    diffusion_steps: int = 32
    """Masks of the denoising score (mdm / block DLMs)."""
    score_batch_tokens: int = DEFAULT_BATCH_TOKENS
    """Tokens (rows x padded length) per scoring forward."""
    seed: int = 0
    """Seeds the denoising score's masks and the generations: a run is deterministic for it."""
    decoder: str | DecoderConfig = "auto"
    """Generation tasks (lambada, poem_reverse) decode greedily with this: a config (:mod:`dlm.decode.configs`,
    e.g. ``MDMConfig(steps=16)``), a decoder name, or ``auto`` (the model's own). ``isd_acceptance`` (I-DLM only)
    takes its ``ISDConfig``'s stride and candidates when it is one."""
    batch_size: int = 8
    """Prompts decoded together by the generation tasks."""
    poem_direction: str = "ftb"
    """poem_reverse: ``ftb`` (first line given, the next asked) or ``btf``."""
    poem_gen_length: int = POEM_GEN_LENGTH
    """poem_reverse: tokens generated per answer."""
    keep_predictions: bool = False
    """Keep each example's prediction in the result (``predictions``)."""

    def __post_init__(self):
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise DLMError(
                f"--batch-size (EvalSettings.batch_size) must be a positive integer, got {self.batch_size!r}"
            )
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 0):
            raise DLMError(f"--limit (EvalSettings.limit) must be an integer >= 0, got {self.limit!r}")


SETTING_NAMES = frozenset(f.name for f in fields(EvalSettings))
_OLD = {"decode", "gen_steps", "stride", "candidates", "token_budget"}  # their new spellings: dlm.deprecations


def _with_deprecated(settings: EvalSettings, deprecated: dict) -> tuple[EvalSettings, ISDConfig, dict]:
    """(settings, the ISD config of isd_acceptance, settings for an "auto" decoder), with the deprecated keywords of
    run_eval mapped onto them (a DeprecationWarning each); settings given as loose keywords are refused by name."""
    loose = sorted(set(deprecated) & SETTING_NAMES)
    if loose:
        fix = ", ".join(f"{k}=..." for k in loose)
        raise DLMError(f"run_eval() takes its settings as EvalSettings({fix}), not {', '.join(k + '=' for k in loose)}")
    unknown = set(deprecated) - _OLD
    if unknown:
        raise TypeError(f"run_eval() got unexpected keyword arguments {', '.join(sorted(unknown))}")
    for k in deprecated:
        deprecations.warn(
            "run_eval(decode= / gen_steps= / stride= / candidates= / token_budget=)", f"run_eval({k}=...)", 4
        )
    decoder = settings.decoder
    if deprecated.get("decode") is not None:
        decoder = deprecated["decode"]
    if deprecated.get("token_budget") is not None:
        settings = replace(settings, score_batch_tokens=int(deprecated["token_budget"]))
    isd = {k: deprecated[k] for k in ("stride", "candidates") if deprecated.get(k) is not None}
    # isd_acceptance measures the masks' drafts: every step drafts (a policy's plain AR steps would only hide them)
    drafting = replace(decoder if isinstance(decoder, ISDConfig) else ISDConfig(**isd), draft_budget="always")
    if decoder == "isd" and isd:
        decoder = drafting
    gen = {"steps": deprecated["gen_steps"]} if deprecated.get("gen_steps") is not None else {}
    return replace(settings, decoder=decoder), drafting, gen


def run_eval(
    model,
    tasks: str | Sequence[str] = DEFAULT_TASKS,
    settings: EvalSettings | None = None,
    *,
    tokenizer=None,
    generate_fn: GenerateFn | None = None,
    log=None,
    progress: bool = False,
    **deprecated,
) -> dict:
    """Evaluate ``model`` on ``tasks`` with ``settings`` (:class:`EvalSettings`: the examples, the scoring, the
    generation decoder) and return ``{task: {"acc", "acc_stderr", ["acc_norm", ...], "n", "seconds", ...}}``.

    - ``model``: a :class:`~dlm.model.convert.DiffusionLM` (carries its tokenizer) or a plain HF causal LM with
      ``tokenizer=``.
    - ``isd_acceptance`` (I-DLM only) decodes greedily with ISD and reports acceptance per draft position, TPF and
      whether the output equals greedy AR.
    - ``generate_fn``: replaces the generation tasks' decoding (tests).
    - Deprecated keywords (one release): ``decode`` (-> ``decoder``), ``gen_steps`` (-> the config's ``steps``),
      ``stride`` / ``candidates`` (-> ``ISDConfig``), ``token_budget`` (-> ``score_batch_tokens``).
    - Deterministic for a seed. Runs without gradients; the model's train/eval mode is restored afterwards,
      so a training loop can call this between steps. ``log(str)`` receives one line per finished task;
      ``progress``: a progress bar per task on stderr (rate, ETA): rows scored, or prompts generated.
    Flatten the result with :func:`dlm.eval.history.flatten_metrics` / append it with
    :func:`dlm.eval.history.append_history`.
    """
    if settings is None:
        settings = EvalSettings()
    elif not isinstance(settings, EvalSettings):
        raise DLMError(f"run_eval(settings=...) takes an EvalSettings, got {type(settings).__name__}")
    s, drafting, gen_settings = _with_deprecated(settings, deprecated)
    names = parse_task_list(tasks)
    em = as_eval_model(model, tokenizer, s.scoring)
    was_training = model.training
    results: dict = {}
    # Load every task first: a bad file fails in a second, not after an hour of scoring the tasks before it.
    loaded = {}
    for name in names:
        options = {"direction": s.poem_direction, "gen_length": s.poem_gen_length} if name == "poem_reverse" else {}
        loaded[name] = _limit(load_task(name, s.data_dir, s.paths, **options), s.limit)
    model.eval()
    with dense_mask_attention(model):
        try:
            for name in names:
                module = TASKS[name]
                t0 = time.perf_counter()
                examples = loaded[name]
                if not examples:
                    raise DLMError(f"{name}: --limit {s.limit} leaves no examples; use a positive --limit")
                if module.KIND == "isd":
                    res = evaluate_drafting(
                        em,
                        examples,
                        name,
                        drafting,
                        batch_size=s.batch_size,
                        keep_predictions=s.keep_predictions,
                        progress=progress,
                    )
                elif module.KIND == "mc":
                    bar = _bar(name, examples, em, s.diffusion_steps) if progress else None
                    try:
                        res = evaluate_multiple_choice(
                            em,
                            examples,
                            name,
                            steps=s.diffusion_steps,
                            seed=s.seed,
                            batch_tokens=s.score_batch_tokens,
                            keep_predictions=s.keep_predictions,
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
                        decoder=resolve_decoder(em, s.decoder, **gen_settings),
                        seed=s.seed,
                        batch_size=s.batch_size,
                        generate_fn=generate_fn,
                        keep_predictions=s.keep_predictions,
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
