"""The ``mdm`` decoder: the engine's view of the masked-diffusion samplers. It lays out each row's sequence, checks
the model and streams the resolved prefix; the sampler (one module each: :data:`SAMPLERS`) decides every pass."""

from __future__ import annotations

import torch

from dlm.decode.configs import MDMConfig, decoder_config
from dlm.decode.engine import Engine, Row
from dlm.decode.mdm.base import DiffusionDecoder, Sampler
from dlm.decode.mdm.confidence import ConfidenceSampler
from dlm.decode.mdm.dream import DreamSampler
from dlm.decode.mdm.llada import LLaDASampler
from dlm.decode.mdm.random_order import RandomSampler
from dlm.decode.mdm.threshold import ThresholdSampler
from dlm.errors import DLMError
from dlm.model.families import sampler_defaults

# the samplers by name (MDMConfig.sampler; configs.MDM_SAMPLERS lists the same names for the command line)
SAMPLERS: dict[str, type[Sampler]] = {
    s.name: s for s in (ConfidenceSampler, RandomSampler, ThresholdSampler, LLaDASampler, DreamSampler)
}


class MDMDecoder(DiffusionDecoder):
    name = "mdm"
    fills_middle = True  # a bidirectional model sees the suffix while it fills the masks before it

    def __init__(self, config: MDMConfig | None = None):
        self.config = config = decoder_config(MDMConfig, config)
        self.threshold = 0.9 if config.threshold is None else float(config.threshold)
        self.shift = True
        # None: the sampler of the model's family (llada / dream), else confidence (chosen in check_model)
        self.sampler: Sampler | None = SAMPLERS[config.sampler](self) if config.sampler else None

    def check_model(self, engine: Engine) -> None:
        spec = engine.spec
        if spec is None or engine.mask_token_id is None:
            raise DLMError(
                "--decode mdm needs a DLM with a mask token; convert the model first (dlm convert --objective mdm)"
            )
        if spec.objective != "mdm":
            raise DLMError(
                f"--decode mdm needs a bidirectional masked-diffusion model (objective 'mdm'); this is "
                f"a '{spec.objective}' model: use --decode {'isd' if spec.objective == 'idlm' else 'block'}"
            )
        self.shift = bool(spec.shift)
        if self.sampler is None:
            name = sampler_defaults(engine.config, "mdm").get("sampler") or "confidence"
            self.config.check_sampler(name)  # a setting of another sampler is refused by name
            self.sampler = SAMPLERS[name](self)

    def _sampler(self) -> Sampler:
        if self.sampler is None:
            raise DLMError("the mdm decoder runs inside an engine (Engine checks the model and picks the sampler)")
        return self.sampler

    def check_request(self, engine: Engine, row: Row) -> None:
        super().check_request(engine, row)
        self._sampler().check_request(engine, row)

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        self._layout(engine, row)
        sampler = self._sampler()
        row.state["sampler"] = sampler.start(engine, row, self.config.steps or row.params.max_new_tokens)
        sampler.plan(engine, row)
        return sampler.prefill_suffix(engine, row)

    def chunk_attention(self, engine: Engine, row: Row, positions: torch.Tensor) -> torch.Tensor:
        return self._sampler().chunk_attention(engine, row, positions)

    def chunk_positions(self, engine: Engine, row: Row, n: int) -> list[int] | None:
        return self._sampler().chunk_positions(engine, row, n)

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        return self._sampler().chunk(engine, row)

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        return self._sampler().consume(engine, row, logits)
