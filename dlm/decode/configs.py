"""The decoders' settings, defined once: one dataclass per decoder (:class:`ARConfig`, :class:`MDMConfig`,
:class:`BlockConfig`, :class:`ISDConfig`, :class:`RenoiseConfig`) and :data:`REGISTRY`, mapping a decoder's name to its decoder class and
its config class.

Each field carries its help text, choices and command-line flag (:func:`dlm.fields.opt`), so the commands
(``dlm generate``, ``dlm serve``, ``dlm eval``, ``dlm quickstart``) build their decoder flags, defaults, help and
checks from here (:func:`add_decoder_arguments`, :func:`config_from_args`), and the Python API takes a config
object::

    from dlm.decode import generate
    from dlm.decode.configs import ISDConfig
    results = generate(model, prompts, ISDConfig(stride=3, fallback="all"), params)

A config checks its values when it is made, before any model is loaded (a :class:`~dlm.errors.DLMError` naming the
field and its flag). No torch here: ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from dlm import deprecations
from dlm.decode.schedule import make_policy
from dlm.errors import DLMError, closest
from dlm.fields import default_of, opt

MAX_CANDIDATES = 8  # ISD --isd-candidates
FALLBACK_MODES = ("predict", "all", "off")
DRAFT_MODES = ("sample", "argmax")
# Draft candidates beyond the first are verified only where the mask gives them at least this probability
# (measured: dlm.decode.isd.policy)
CANDIDATE_MIN_PROB = 0.05
MDM_SAMPLERS = ("confidence", "random", "threshold", "llada", "dream")
LLADA_REMASKING = ("low_confidence", "random")
DREAM_ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")
SDAR_REMASKING = ("sequential", "low_confidence_static", "low_confidence_dynamic")

FALLBACK_HELP = (
    "which outcomes of a verify step get masks for the next drafts. 'predict': the likeliest by the drafts' own "
    "probabilities (all accepted, or the first rejection at d_i), so a rejection need not cost a cold-start step, "
    "at the plain chunk's 2N-1 tokens; 'all': every outcome (N-1 + N(N-1) tokens: for hardware where extra tokens "
    "are free); 'off': only all-accepted (plain ISD). Output is the same in every case"
)
CANDIDATES_HELP = (
    "at stride 2: verify up to K likeliest drafts for the next position at once (greedy: the mask's top K; "
    "sampling: draws without replacement, recursive rejection sampling), each with its own mask for the draft "
    "after it: a chunk of 2K+2 tokens, acceptance = the drafts' top-K coverage. The 2nd..K-th are verified only "
    "where the mask gives them >= 5% (each costs two chunk tokens). 1 = plain ISD. Output is the same"
)
DRAFT_BUDGET_HELP = (
    "when ISD drafts: 'always' at every step; an integer T: only while running rows x (2N-1) <= T tokens per "
    "step, plain AR steps above; 'auto': measure per batch size whether drafting or plain AR steps commit more "
    "tokens per second and run the faster (seeded sampling then keeps the distribution, not the draws). Greedy "
    "output is the same in every case"
)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class DecoderConfig:
    """What every decoder config has: its registry ``name``; its fields are its decoder's settings (a decoder is
    constructed from its config: :func:`decoder_config`).

    It also knows which settings its caller chose (``given``: the fields passed to the constructor or assigned
    later); the others take a published family's defaults when the engine runs the config on such a model
    (:func:`with_family_defaults`), whether the config came from the CLI, the server or the caller's own
    ``BlockConfig()``."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        object.__setattr__(self, "given", frozenset(names[: len(args)]) | frozenset(kwargs))
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        # a field assigned after construction is the caller's choice too (the constructor's first assignments are
        # not: they are the fields' first values)
        if name != "given" and name in self.__dict__ and "given" in self.__dict__:
            object.__setattr__(self, "given", self.__dict__["given"] | {name})
        object.__setattr__(self, name, value)

    def _fail(self, field: str, message: str):
        f = next(f for f in dataclasses.fields(self) if f.name == field)
        raise DLMError(f"{_flag(f)} {message} ({type(self).__name__}.{field})")

    def _check_choices(self) -> None:
        for f in dataclasses.fields(self):
            choices, value = f.metadata.get("choices"), getattr(self, f.name)
            if choices and value is not None and value not in choices:
                hint = f" (did you mean {closest(str(value), choices)}?)" if isinstance(value, str) else ""
                self._fail(f.name, f"must be one of {', '.join(map(str, choices))}; got {value!r}{hint}")

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults (for logs and result files)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != default_of(f)
        }


@dataclass
class ARConfig(DecoderConfig):
    """Plain autoregressive decoding: one token per forward (greedy == transformers' ``generate``)."""

    name: ClassVar[str] = "ar"
    summary: ClassVar[str] = "autoregressive, one token per forward"

    prompt_lookup: int = opt(
        0,
        "prompt lookup decoding: up to K drafts per step, the tokens that followed the latest earlier occurrence of "
        "the output's last n-gram in the prompt or output (vLLM's 'ngram' speculation), verified in the same "
        "forward - exactly the AR output and distribution; pays where the answer copies (quotes, edits, "
        "extraction). 0 = off",
    )
    prompt_lookup_min: int = opt(2, "with --prompt-lookup: the shortest n-gram matched")
    prompt_lookup_max: int = opt(4, "with --prompt-lookup: the longest n-gram matched (longer matches first)")
    lookup_budget: int | str | object | None = opt(  # object: a policy of dlm.decode.schedule (Python only)
        None,
        "with --prompt-lookup: when a step drafts - 'always'; an integer T: while running rows x (K+1) <= T tokens "
        "per step; 'auto': measure per batch size whether drafting or plain steps commit more tokens per second "
        "and run the faster. The output is the same in every case; None: always",
        flag="--prompt-lookup-budget",
    )

    def __post_init__(self):
        if not _is_int(self.prompt_lookup) or not 0 <= self.prompt_lookup <= 32:
            self._fail("prompt_lookup", f"must be an integer from 0 (off) to 32, got {self.prompt_lookup!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not _is_int(lo) or lo < 1:
            self._fail("prompt_lookup_min", f"must be an integer >= 1, got {lo!r}")
        if not _is_int(hi) or hi < lo:
            self._fail("prompt_lookup_max", f"must be an integer >= --prompt-lookup-min ({lo}), got {hi!r}")
        self.lookup_budget = _drafting_policy(self.lookup_budget, 2, self.prompt_lookup + 1, "--prompt-lookup-budget")


def _drafting_policy(budget, stride: int, per_row: int | None = None, flag: str = "--isd-draft-budget"):
    """A drafting-policy setting as the config keeps it (a number given as text becomes the number), checked by
    building it once (DLMError naming ``flag``)."""
    if isinstance(budget, str) and budget.strip().isdigit():
        budget = int(budget)

    make_policy(budget, stride, per_row, flag)
    return budget


def _check_steps(cfg: MDMConfig | BlockConfig) -> None:
    steps = cfg.steps
    if steps is not None and (not _is_int(steps) or steps < 1):
        cfg._fail("steps", f"must be a positive integer, got {steps!r}")


# the settings that belong to one masked-diffusion sampler (0 / None: not set)
MDM_SAMPLER_SETTINGS = {"cfg_scale": "llada", "remasking": "llada", "alg": "dream", "alg_temp": "dream"}


@dataclass
class MDMConfig(DecoderConfig):
    """Masked-diffusion sampling for bidirectional DLMs (MDLM / DiffuLLaMA / LLaDA / Dream)."""

    name: ClassVar[str] = "mdm"
    summary: ClassVar[str] = "masked diffusion over the whole answer"

    sampler: str | None = opt(
        None,
        "the sampler; None: the model family's (llada, dream), else confidence",
        choices=MDM_SAMPLERS,
        flag="--sampler",
        old=(None, "method"),
    )
    steps: int | None = opt(None, "denoising passes per request; None: one per generated token")
    threshold: float | None = opt(0.9, "threshold sampler: commit every mask above this probability")
    semi_ar_block: int = opt(
        32,
        "threshold / llada samplers: length of a semi-autoregressive block",
        unit="tokens",
        old=("--block-length", "block_length"),
    )
    cfg_scale: float = opt(0.0, "llada sampler: classifier-free guidance scale (0 = none)")
    remasking: str | None = opt(
        None, "llada sampler: what scores the candidates; None: low_confidence", choices=LLADA_REMASKING
    )
    alg: str | None = opt(None, "dream sampler: which masks a pass reveals; None: origin", choices=DREAM_ALGS)
    alg_temp: float | None = opt(
        None, "dream sampler: > 0 draws the revealed masks from softmax(confidence / alg_temp)"
    )
    dream_top_k: int | None = opt(
        None,
        "dream sampler: the top-k it filters with where the request sets none, after top-p as Dream's code does "
        "(50 on Dream checkpoints: its diffusion_generate's hidden default); None or 0: none",
    )

    def __post_init__(self):
        self._check_choices()
        _check_steps(self)
        if not isinstance(self.cfg_scale, (int, float)) or self.cfg_scale < 0:
            self._fail("cfg_scale", f"must be >= 0 (0 = no guidance), got {self.cfg_scale!r}")
        if self.alg_temp is not None and self.alg_temp < 0:
            self._fail("alg_temp", f"must be >= 0, got {self.alg_temp!r}")
        if self.dream_top_k is not None and (not isinstance(self.dream_top_k, int) or self.dream_top_k < 0):
            self._fail("dream_top_k", f"must be an int >= 0 (0 = none), got {self.dream_top_k!r}")
        if self.sampler is not None:
            self.check_sampler(self.sampler)
        if self.sampler == "threshold" and not 0.0 <= float(self.threshold or 0.9) < 1.0:
            self._fail("threshold", f"must be in [0, 1) for the threshold sampler, got {self.threshold!r}")
        if not _is_int(self.semi_ar_block) or self.semi_ar_block < 1:
            self._fail("semi_ar_block", f"must be a positive integer, got {self.semi_ar_block!r}")

    def check_sampler(self, sampler: str) -> None:
        """Refuse a setting of another sampler than ``sampler`` (the one given, or the model family's where none
        was: the decoder checks again once it knows the model)."""
        for field, owner in MDM_SAMPLER_SETTINGS.items():
            value = getattr(self, field)
            if value is not None and value != 0 and sampler != owner:
                self._fail(field, f"is a setting of --sampler {owner}; drop it or use --sampler {owner}")


@dataclass
class BlockConfig(DecoderConfig):
    """Block diffusion (SDAR / BD3-LM): blocks left to right, denoising passes within a block."""

    name: ClassVar[str] = "block"
    summary: ClassVar[str] = "block diffusion, block by block"

    steps: int | None = opt(None, "denoising passes per block; None: the block size")
    threshold: float | None = opt(
        0.9, "commit every mask above this probability; None or <= 0: the top ceil(masks / steps) per pass"
    )
    remasking: str | None = opt(
        None,
        "SDAR's strategy (low_confidence_dynamic without a threshold is low_confidence_static); None: dlm's threshold "
        "/ top-k rule (SDAR and LLaDA2 checkpoints: low_confidence_dynamic, their own)",
        choices=SDAR_REMASKING,
    )
    editing_threshold: float | None = opt(
        None,
        "token editing (LLaDA2.1's sampler): each pass also replaces a generated token of the block whose new "
        "prediction differs with probability above this, and once the block's masks are filled passes go on until "
        "one edits nothing (at most --max-post-steps); None: off",
    )
    max_post_steps: int = opt(16, "with --editing-threshold: the most passes over a block after its masks are filled")
    quota_overflow: str | None = opt(
        None,
        "SDAR's strategies, when a pass's quota exceeds the masks left (a threshold pass committed more than its "
        "share, or the block holds the prompt's tail): 'rewrite' - the quotas split the block's length and such a "
        "pass's top-k also picks decoded positions of the block and rewrites them with the pass's proposal, as "
        "SDAR's generate.py does (never a prompt position); 'clip' - the quotas split the block's length and a pass "
        "commits at most the masks left, as LLaDA2's generate does; 'masks' - the quotas split the block's masks and "
        "only masks are written; None: masks (SDAR checkpoints: rewrite, LLaDA2's: clip)",
        choices=("rewrite", "clip", "masks"),
    )
    steps_cap: str | None = opt(
        None,
        "'new_tokens': a block runs at most max_new_tokens passes, as LLaDA2.0's generate does (not with "
        "--editing-threshold, whose loop has no schedule); None: no cap (LLaDA2 checkpoints: new_tokens)",
        choices=("new_tokens",),
    )

    def __post_init__(self):
        self._check_choices()
        _check_steps(self)
        edit = self.editing_threshold
        if edit is not None and (not isinstance(edit, (int, float)) or not 0.0 < float(edit) < 1.0):
            self._fail("editing_threshold", f"must be in (0, 1) (None = no editing), got {edit!r}")
        if not _is_int(self.max_post_steps) or self.max_post_steps < 0:
            self._fail("max_post_steps", f"must be an integer >= 0, got {self.max_post_steps!r}")
        top_k = self.threshold is None or float(self.threshold) <= 0.0
        if not top_k and not float(self.threshold or 0.0) < 1.0:
            self._fail("threshold", f"must be below 1 (or <= 0 for top-k commits), got {self.threshold!r}")


@dataclass
class ISDConfig(DecoderConfig):
    """Introspective strided decoding: N-1 drafts and their verification per forward, exactly the AR
    distribution (greedy output == greedy AR)."""

    name: ClassVar[str] = "isd"
    summary: ClassVar[str] = "introspective strided decoding: several tokens per forward, the AR distribution"

    stride: int | None = opt(
        None,
        "the stride N: N-1 drafts per step; None: the model's block_size + 1, and with --isd-draft-budget auto "
        "each step's stride is chosen from 2 up to it by measured speed",
    )
    draft: str = opt(
        "sample",
        "drafts sampled from the masks' q (exact) or their argmax (biased when sampling)",
        choices=DRAFT_MODES,
    )
    draft_budget: int | str | object | None = opt(  # object: a policy of dlm.decode.schedule (Python only)
        "auto",
        DRAFT_BUDGET_HELP
        + " ('auto' by default: ISD never runs much slower than plain AR steps where its drafts do not "
        "pay; 'always' for reproducible seeded draws); None: always",
        flag="--isd-draft-budget",
        old=("--isd-token-budget", "token_budget"),
    )
    fallback: str = opt("predict", FALLBACK_HELP, choices=FALLBACK_MODES, flag="--isd-fallback")
    candidates: int = opt(1, CANDIDATES_HELP, flag="--isd-candidates")
    candidate_min_prob: float = opt(
        CANDIDATE_MIN_PROB,
        "with --isd-candidates K > 1: verify the 2nd..K-th candidate only where the mask gives it at least this "
        "probability (each costs two chunk tokens; 0 = always all K)",
        flag="--isd-candidate-min-prob",
    )

    def __post_init__(self):
        self._check_choices()
        if self.stride is not None and (not _is_int(self.stride) or self.stride < 2):
            self._fail("stride", f"must be an integer >= 2 (N-1 drafts per step), got {self.stride!r}")
        self.draft_budget = _drafting_policy(self.draft_budget, self.stride or 2)
        if not _is_int(self.candidates) or not 1 <= self.candidates <= MAX_CANDIDATES:
            self._fail("candidates", f"must be an integer from 1 to {MAX_CANDIDATES}, got {self.candidates!r}")
        if self.candidates > 1 and self.stride not in (None, 2):
            raise DLMError(
                f"--isd-candidates {self.candidates} verifies several drafts for one position: it runs at "
                f"--stride 2 only, got --stride {self.stride}"
            )
        p = self.candidate_min_prob
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            self._fail("candidate_min_prob", f"must be a probability in [0, 1], got {p!r}")


@dataclass
class RenoiseConfig(DecoderConfig):
    """Uniform-noise ("renoising") block diffusion (DiffusionGemma): canvas by canvas, each starting as random
    tokens; a step samples every position, keeps the lowest-entropy ones within an entropy budget and draws the
    others at random again, until the canvas is stable and confident or the steps run out."""

    name: ClassVar[str] = "renoise"
    summary: ClassVar[str] = "uniform-noise block diffusion (DiffusionGemma), canvas by canvas"

    steps: int | None = opt(None, "denoising steps per canvas at most; None: the checkpoint's (48 by default)")
    entropy_bound: float | None = opt(
        None,
        "a step accepts the lowest-entropy positions while their entropies' sum less the largest stays within "
        "this bound (more = more tokens per step); None: the checkpoint's (0.1 by default)",
    )
    t_min: float | None = opt(None, "the temperature at the last step (linear schedule); None: the checkpoint's (0.4)")
    t_max: float | None = opt(None, "the temperature at the first step; None: the checkpoint's (0.8)")
    stability_threshold: int | None = opt(
        None,
        "a canvas stops early once its argmax stayed the same this many steps (0: stability not required) and "
        "it is confident; None: the checkpoint's (1)",
    )
    confidence_threshold: float | None = opt(
        None,
        "... and the mean entropy of its scaled predictions is below this; None: the checkpoint's (0.005)",
    )

    def __post_init__(self):
        _check_steps(self)
        for name in ("entropy_bound", "confidence_threshold"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                self._fail(name, f"must be a number > 0, got {v!r}")
        for name in ("t_min", "t_max"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                self._fail(name, f"must be a number >= 0, got {v!r}")
        if self.t_min is not None and self.t_max is not None and not self.t_max > self.t_min:
            self._fail("t_max", f"must be above --t-min ({self.t_min}), got {self.t_max!r}")
        s = self.stability_threshold
        if s is not None and (not _is_int(s) or s < 0):
            self._fail("stability_threshold", f"must be an integer >= 0, got {s!r}")


# What a request may ask that only some decoders do: the Decoder class attribute that says a decoder can, why one that
# cannot does not, and what to use instead. The engine, `dlm generate` and the server refuse with refusal()'s words.
CAPABILITIES: dict[str, tuple[str, str, str]] = {
    "scores": (  # log-probabilities, logit bias, penalties, a minimum length, structured outputs
        "causal",
        "commits tokens out of order, not from the model's next-token distribution",
        "a left-to-right decoder (--decode ar or isd)",
    ),
    "suffix": (  # text after the answer (fill-in-the-middle)
        "fills_middle",
        "writes the answer in order, with nothing after it",
        "--decode mdm on a bidirectional DLM, which sees both sides of the masks it fills",
    ),
}


def refusal_message(decoder_name: str, capability: str, what: str) -> str:
    """The message refusing ``what`` (the request's parameter as its user names it: ``logprobs``, ``--suffix``)
    on a decoder without ``capability`` (a key of :data:`CAPABILITIES`)."""
    _, why, use = CAPABILITIES[capability]
    return f"{what}: not with --decode {decoder_name}, which {why}; use {use}"


def refusal(decoder, capability: str, what: str) -> str | None:
    """None where ``decoder`` (a decoder or its class) has ``capability``; else :func:`refusal_message`."""
    if getattr(decoder, CAPABILITIES[capability][0], False):
        return None
    return refusal_message(decoder.name, capability, what)


@dataclass(frozen=True)
class DecoderEntry:
    """A registered decoder: its name, config class, decoder class (``module:Class``, imported when used) and the
    DLM objective it decodes (None: any causal LM; a plain AR model is converted on the fly to this objective)."""

    name: str
    config: type[DecoderConfig]
    decoder: str
    objective: str | None

    def decoder_class(self):
        module, cls = self.decoder.split(":")
        return getattr(importlib.import_module(module), cls)


REGISTRY: dict[str, DecoderEntry] = {
    e.name: e
    for e in (
        DecoderEntry("ar", ARConfig, "dlm.decode.ar:ARDecoder", None),
        DecoderEntry("mdm", MDMConfig, "dlm.decode.mdm:MDMDecoder", "mdm"),
        DecoderEntry("block", BlockConfig, "dlm.decode.block:BlockDecoder", "block"),
        DecoderEntry("isd", ISDConfig, "dlm.decode.isd:ISDDecoder", "idlm"),
        DecoderEntry("renoise", RenoiseConfig, "dlm.decode.renoise:RenoiseDecoder", "renoise"),
    )
}
DECODERS = tuple(REGISTRY)


def own_decoder(objective: str | None) -> str:
    """The decoder a model of ``objective`` runs by default (``"auto"``): ar for a causal LM, isd for an I-DLM, mdm /
    block for those objectives."""
    return next((n for n, e in REGISTRY.items() if e.objective == objective), "ar")


def entry(name: str) -> DecoderEntry:
    """The registered decoder ``name``; a DLMError listing the decoders (and the closest) otherwise."""
    if name not in REGISTRY:
        raise DLMError(
            f"unknown decoder {name!r} (--decode): use one of {', '.join(DECODERS)} "
            f"(did you mean {closest(str(name), DECODERS)}?)"
        )
    return REGISTRY[name]


def field_names(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(entry(name).config)}


def _owners(field: str) -> list[str]:
    return [n for n in DECODERS if field in field_names(n)]


def _not_a_setting(decoder: str, fields: list[str]) -> DLMError:
    owners = sorted({o for f in fields for o in _owners(f)})
    use = " or ".join(f"--decode {o}" for o in owners)
    if len(fields) == 1 and len(owners) == 1:
        return DLMError(
            f"{flag_of(fields[0])} is an {owners[0].upper()} setting; drop it or use {use} (got --decode {decoder})"
        )
    flags = ", ".join(sorted(flag_of(f) for f in fields))
    them = "it" if len(fields) == 1 else "them"
    return DLMError(f"{flags}: not a setting of --decode {decoder}; drop {them} or use {use}")


def _field(name: str) -> dataclasses.Field:
    for e in REGISTRY.values():
        for f in dataclasses.fields(e.config):
            if f.name == name:
                return f
    raise KeyError(name)


def flag_of(field: str) -> str:
    """The command-line flag of a decoder setting (``draft_budget`` -> ``--isd-draft-budget``)."""
    return _flag(_field(field))


def _renamed(config: type[DecoderConfig]) -> dict[str, str]:
    """Old Python spelling -> field name, for the fields renamed (accepted with a DeprecationWarning)."""
    return {f.metadata["old"][1]: f.name for f in dataclasses.fields(config) if f.metadata.get("old")}


def make_config(decoder: str | DecoderConfig, **settings) -> DecoderConfig:
    """``decoder`` as a config: a config object is returned as it is (``settings`` must then be empty); a name
    gets its config class built from ``settings`` (field name -> value; None values are "not given" and take
    the default). A setting that belongs to another decoder is refused, naming its flag and its decoder; an old
    spelling (``token_budget``, ``block_length``, ``method``) is accepted with a DeprecationWarning."""
    if isinstance(decoder, DecoderConfig):
        given = {k: v for k, v in settings.items() if v is not None}
        if given:
            raise DLMError(
                f"give the decoder settings in the {type(decoder).__name__} or as keywords, not both: "
                f"{', '.join(sorted(given))}"
            )
        return decoder
    cls = entry(decoder).config
    renamed = {old: new for e in REGISTRY.values() for old, new in _renamed(e.config).items()}
    kw: dict[str, Any] = {}
    for key, value in settings.items():
        if value is None:
            continue
        if key in renamed:
            deprecations.warn(
                "decoder keyword token_budget= / block_length= / method=", f"{key}=", 4, use=f"{renamed[key]}="
            )
            key = renamed[key]
        kw[key] = value
    foreign = [k for k in kw if k not in field_names(cls.name)]
    unknown = [k for k in foreign if not _owners(k)]
    if unknown:
        raise DLMError(f"unknown decoder setting(s) {', '.join(sorted(unknown))} for --decode {cls.name}")
    if foreign:
        raise _not_a_setting(cls.name, foreign)
    return _with_given(cls(**kw), kw)


def _with_given(config: DecoderConfig, given: dict[str, Any]) -> DecoderConfig:
    """``config`` marked with the settings its caller chose: the others may take a model family's defaults
    (:func:`with_family_defaults`)."""
    object.__setattr__(config, "given", frozenset(given))
    return config


def with_family_defaults(config: DecoderConfig, defaults: dict[str, Any]) -> DecoderConfig:
    """``config`` with ``defaults`` for the settings its caller left out (``given``: passed to the constructor,
    to :func:`make_config`, or assigned since)."""
    given: frozenset[str] = getattr(config, "given", frozenset())
    todo = {k: v for k, v in defaults.items() if k not in given}
    if not todo:
        return config
    out = dataclasses.replace(config, **todo)
    object.__setattr__(out, "given", given | frozenset(todo))
    return out


def build_decoder(config: DecoderConfig):
    """The decoder object that runs ``config``."""
    return entry(config.name).decoder_class()(config)


C = TypeVar("C", bound=DecoderConfig)


def decoder_config(cls: type[C], config: C | None) -> C:
    """The config a decoder is constructed from: ``config`` (an instance of ``cls``, the decoder's config class as
    registered), or ``cls``'s defaults when None. Each decoder's ``__init__`` takes it through here."""
    if config is None:
        return cls()
    if not isinstance(config, cls):
        raise DLMError(
            f"the {cls.name} decoder is constructed from its config, a {cls.__name__} object, not a "
            f"{type(config).__name__}; build one with {cls.__name__}(...) or "
            f"dlm.decode.configs.make_config({cls.name!r}, ...)"
        )
    return config


# -- command-line flags ---------------------------------------------------------------------------------------
def _parse_value(f: dataclasses.Field):
    """argparse ``type`` for a field: int / float from its annotation; strings (and int-or-str) as given."""
    ann = str(f.type)
    if ann.startswith("int | str") or ann.startswith("str"):
        return str
    if ann.startswith("int"):
        return int
    if ann.startswith("float"):
        return float
    return str


def _help(owners: list[tuple[str, dataclasses.Field]], command_defaults: dict[str, Any]) -> str:
    """``decoder: help (choices); default X`` per decoder that has the field, escaped for argparse."""
    parts = []
    for name, f in owners:
        default = command_defaults.get(f.name, default_of(f))
        choices = f.metadata.get("choices")
        parts.append(
            f"{name}: {f.metadata['help']}" + (f" ({' | '.join(choices)})" if choices else "") + f"; default {default}"
        )
    return ". ".join(parts).replace("%", "%%")


def add_decoder_arguments(
    parser: argparse.ArgumentParser,
    *,
    default: str = "ar",
    names: tuple[str, ...] = DECODERS,
    extra_names: tuple[str, ...] = (),
    command_defaults: dict[str, Any] | None = None,
    implied: str | None = None,
    old_flags: dict[str, str] | None = None,
    group_title: str = "decoding (the decoders' settings: docs/decoding.md#settings)",
) -> None:
    """Add ``--decode`` and every setting of ``names`` to ``parser``, built from the config classes: one flag per
    field (a field that several decoders share, e.g. ``--steps``, is one flag), its help naming the decoder(s)
    and the default, and each renamed field's old flag (hidden, with a deprecation note at parse time). Every
    flag defaults to None, meaning "not given": :func:`config_from_args` fills in the command's defaults
    (``command_defaults``: field -> value where this command differs from the config's, stated in the help).
    ``default=None, implied=NAME``: ``args.decode`` stays None when not given (the command tells "not given" from
    NAME) and the help says NAME is the default. ``old_flags``: field -> a command's own old spelling of its flag
    (accepted with a deprecation note)."""
    command_defaults = command_defaults or {}
    g = parser.add_argument_group(group_title)
    g.add_argument(
        "--decode",
        default=default,
        choices=tuple(extra_names) + tuple(names),
        help="decoder: "
        + "; ".join(f"{n} = {REGISTRY[n].config.summary}" for n in names)
        + f" (default {implied or default})",
    )
    seen: dict[str, list[tuple[str, dataclasses.Field]]] = {}
    for n in names:
        for f in dataclasses.fields(REGISTRY[n].config):
            seen.setdefault(f.name, []).append((n, f))
    for field_name, owners in seen.items():
        f = owners[0][1]
        kw: dict[str, Any] = {"dest": "decoder_" + field_name, "default": None, "type": _parse_value(f)}
        kw["metavar"] = {"candidates": "K", "stride": "N"}.get(f.name, f.name.upper())
        g.add_argument(_flag(f), help=_help(owners, command_defaults), **kw)
        olds = [f.metadata["old"][0]] if f.metadata.get("old") and f.metadata["old"][0] else []
        olds += [(old_flags or {})[field_name]] if field_name in (old_flags or {}) else []
        for old in olds:
            deprecated_flag(g, old, _flag(f), dest="decoder_" + field_name, type=_parse_value(f))


def deprecated_flag(parser, old: str, new: str, *, dest: str, type=str) -> None:
    """Accept ``old`` (hidden from ``--help``) as a renamed spelling of ``new``: it stores into ``dest`` and says
    on stderr that it is renamed."""
    parser.add_argument(old, dest=dest, type=type, action=_Deprecated, new_flag=new, help=argparse.SUPPRESS)


class _Deprecated(argparse.Action):
    """An old flag spelling: stores into the new flag's destination and says it is renamed."""

    def __init__(self, *args, new_flag: str, **kwargs):
        self.new_flag = new_flag
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"{parser.prog}: warning: {option_string} is renamed {self.new_flag} (the old spelling will be "
            f"removed in the next release)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def owning_decoders(fields) -> list[str]:
    """The decoders that have every one of ``fields`` (all of them for none); a DLMError when no decoder does."""
    fields = list(fields)
    names = [n for n in DECODERS if set(fields) <= field_names(n)]
    if not names:
        flags = ", ".join(sorted(flag_of(f) for f in fields))
        raise DLMError(f"{flags}: no one decoder takes all of these; give the settings of one --decode")
    return names


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The decoder settings given on the command line (field name -> value)."""
    return {k[len("decoder_") :]: v for k, v in vars(args).items() if k.startswith("decoder_") and v is not None}


def config_from_args(
    args: argparse.Namespace, decode: str | None = None, command_defaults: dict[str, Any] | None = None
) -> DecoderConfig:
    """The config of ``decode`` (default ``args.decode``) from the flags :func:`add_decoder_arguments` added:
    the given flags, the command's own defaults where not given, the config's otherwise. A flag of another
    decoder is refused (DLMError naming it). Call it before loading a model: bad values fail at once."""
    name = decode or args.decode
    if name is None:
        raise DLMError("no decoder: give --decode")
    given = given_settings(args)
    fields = field_names(name)
    foreign = [k for k in given if k not in fields]
    if foreign:
        raise _not_a_setting(name, foreign)
    for k, v in (command_defaults or {}).items():
        if k in fields and k not in given:
            given[k] = v
    return _with_given(entry(name).config(**given), given)


def parse_settings(values: dict[str, Any]) -> dict[str, Any]:
    """The decoder settings among ``values`` (e.g. lm-eval's ``model_args``: strings), by config field name, parsed
    by the field's type (``"16"`` -> 16; ``"None"`` / ``""`` -> not given); other keys are left out."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        try:
            f = _field(key)
        except KeyError:
            continue
        if value in (None, "", "None"):
            continue
        out[key] = _parse_value(f)(value) if isinstance(value, str) else value
    return out


def settings_table() -> str:
    """The Markdown table of every decoder's settings (docs/decoding.md#settings; a test keeps it in sync)."""
    rows = [
        "| decoder | field (Python) | flag | default | choices | what it sets |",
        "|---|---|---|---|---|---|",
    ]
    for n, e in REGISTRY.items():
        fs = dataclasses.fields(e.config)
        if not fs:
            rows.append(f"| `{n}` | - | - | - | - | {(e.config.__doc__ or n).split(':')[0].strip()} (no settings) |")
        for f in fs:
            choices = ", ".join(f.metadata.get("choices") or ()) or "-"
            old = f.metadata.get("old")
            flag = f"`{_flag(f)}`" + (f" (was `{old[0]}`)" if old and old[0] else "")
            text = f.metadata["help"].replace("|", "\\|")
            rows.append(f"| `{n}` | `{f.name}` | {flag} | `{default_of(f)!r}` | {choices} | {text} |")
    return "\n".join(rows) + "\n"
