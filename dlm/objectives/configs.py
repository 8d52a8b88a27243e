"""The objectives' settings, defined once: the ``mdm``, ``block``, ``idlm`` and ``renoise`` sections of ``dlm train``'s
configuration are these classes (:mod:`dlm.config`), and each objective is built from one. Field names are the
YAML keys; the help texts are ``dlm train --help``'s. No torch here."""

from __future__ import annotations

from dataclasses import dataclass

from dlm.errors import DLMError
from dlm.fields import check_choices, opt

BLOCK_SIZE_HELP = "masks per block; None: the checkpoint's, else it must match it (set by model.block_size)"


def _positive_eps(section: str, eps: float) -> None:
    if not 0.0 <= eps < 1.0:
        raise DLMError(f"{section}.eps must be in [0, 1), got {eps!r}")


@dataclass
class MDMConfig:
    """Masked diffusion (DiffuLLaMA / MDLM / LLaDA)."""

    eps: float = opt(1e-3, "smallest masking ratio t (t ~ U(eps, 1))")
    antithetic: bool = opt(False, "stratified t across the batch (lower-variance loss)")
    normalize: str = opt(
        "masked", "loss divisor: masked tokens (DiffuLLaMA) or all tokens (MDLM)", choices=("masked", "all")
    )
    shift: bool | None = opt(None, "logit i-1 scores position i (DiffuLLaMA); None: the checkpoint's")
    attention: str = opt(
        "annealed",
        "attention during training: annealed causal-to-full, or full from step 0",
        choices=("annealed", "full"),
    )
    anneal_steps: int = opt(1000, "steps over which annealed attention opens to full", unit="optimizer steps")

    def __post_init__(self):
        check_choices(self, "mdm")
        _positive_eps("mdm", self.eps)
        if self.anneal_steps < 0:
            raise DLMError(f"mdm.anneal_steps must be >= 0, got {self.anneal_steps!r}")


@dataclass
class BlockConfig:
    """Block diffusion (BD3-LM / SDAR)."""

    block_size: int | None = opt(None, BLOCK_SIZE_HELP)
    t_per: str = opt("sample", "one masking ratio per sample (SDAR) or per block (BD3-LM)", choices=("sample", "block"))
    eps: float = opt(1e-3, "smallest masking ratio t")
    antithetic: bool = opt(False, "stratified t across the batch")
    normalize: str = opt("masked", "loss divisor: masked tokens or all tokens", choices=("masked", "all"))
    shift: bool | None = opt(None, "logit i-1 scores position i; None: the checkpoint's (SDAR: no shift)")

    def __post_init__(self):
        check_choices(self, "block")
        _positive_eps("block", self.eps)


@dataclass
class IDLMConfig:
    """Introspective diffusion (I-DLM): masks draft, the clean pass verifies."""

    block_size: int | None = opt(None, BLOCK_SIZE_HELP)
    ce_alpha: float = opt(0.2, "weight of the clean pass's causal CE next to the masks' CE")
    loss_auto_balance: bool = opt(False, "scale the clean CE to the noisy CE's magnitude each step (I-DLM b3)")
    idlm_loss_type: str = opt(
        "ar", "masks learn hard labels (ar) or the clean pass's soft distribution (distill)", choices=("ar", "distill")
    )
    distill_temperature: float = opt(1.0, "temperature of the soft targets (distill)")
    fast_path: bool | None = opt(
        None,
        "None/True: the clean pass once, then the noisy pass on its cache (faster); False: one forward over [x_t | x0]",
    )

    def __post_init__(self):
        check_choices(self, "idlm")
        if self.ce_alpha < 0:
            raise DLMError(f"idlm.ce_alpha must be >= 0, got {self.ce_alpha!r}")
        if self.distill_temperature <= 0:
            raise DLMError(f"idlm.distill_temperature must be > 0, got {self.distill_temperature!r}")


@dataclass
class RenoiseConfig:
    """Uniform-noise ("renoising") block diffusion (DiffusionGemma)."""

    block_size: int | None = opt(
        None, "canvas length (tokens per canvas); None: the checkpoint's, else it must match it (model.block_size)"
    )
    noise_min: float = opt(1e-3, "smallest noise level t: the share of a canvas's tokens replaced by random ones")
    noise_max: float = opt(1.0 - 1e-3, "largest noise level t (t ~ U(noise_min, noise_max), one per sequence)")
    weighting: str = opt(
        "constant",
        "the canvas loss's weight per sequence: constant (1) or reweighted (1 / (1 - t), the rectified-flow ELBO "
        "weight, clipped at weight_clip)",
        choices=("constant", "reweighted"),
    )
    weight_clip: float | None = opt(None, "upper bound of the reweighted weight (None: none)")
    self_conditioning: float = opt(
        0.5,
        "probability that a sequence is self-conditioned: a first no-grad pass predicts the canvases, and the "
        "trained pass reads that prediction's soft embedding (0 = never)",
    )
    encoder_weight: float = opt(1.0, "weight of the context's causal next-token loss beside the canvas loss (0 = none)")

    def __post_init__(self):
        check_choices(self, "renoise")
        if not 0.0 <= self.noise_min <= self.noise_max <= 1.0:
            raise DLMError(
                f"renoise.noise_min / noise_max must satisfy 0 <= min <= max <= 1, got {self.noise_min!r}, "
                f"{self.noise_max!r}"
            )
        if not 0.0 <= self.self_conditioning <= 1.0:
            raise DLMError(f"renoise.self_conditioning must be a probability in [0, 1], got {self.self_conditioning!r}")
        if self.encoder_weight < 0:
            raise DLMError(f"renoise.encoder_weight must be >= 0, got {self.encoder_weight!r}")
        if self.weight_clip is not None and self.weight_clip <= 0:
            raise DLMError(f"renoise.weight_clip must be > 0 (None: no clip), got {self.weight_clip!r}")


CONFIGS: dict[str, type] = {
    "mdm": MDMConfig,
    "block": BlockConfig,
    "idlm": IDLMConfig,
    "renoise": RenoiseConfig,
}
