"""What the masked-diffusion samplers share: the whole-sequence decoder base (also the block decoder's), the
proposal of tokens for masked positions, and the :class:`Sampler` interface each sampler module implements."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from dlm.decode.engine import Decoder, Engine, Row
from dlm.decode.sampling import SamplingParams, check_fits_context, probs_from_logits, sample, suppress

if TYPE_CHECKING:
    from dlm.decode.configs import MDMConfig
    from dlm.decode.mdm.decoder import MDMDecoder


def propose(logits: torch.Tensor, params: SamplingParams, mask_id: int | None, generator: torch.Generator):
    """[n, V] logits -> (tokens [n], confidence [n]) on the CPU, where the rows' sequences live (the logits may be
    on a GPU): argmax or a draw, and its probability (at temperature 1 for greedy, so confidences stay
    comparable)."""
    if params.greedy:
        probs = suppress(logits, mask_id).softmax(-1)
        tokens = probs.argmax(-1)
    else:
        probs = probs_from_logits(logits, params, mask_id)
        tokens = sample(probs, generator)
    return tokens.cpu(), probs.gather(-1, tokens[:, None]).squeeze(-1).cpu()


def no_positions() -> torch.Tensor:
    """An empty index tensor: a sampler state's positions before its first plan."""
    return torch.empty(0, dtype=torch.long)


def even_split(n: int, parts: int) -> list[int]:
    """``n`` split over ``parts`` as evenly as possible, the remainder to the first parts."""
    base, rest = divmod(n, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


class DiffusionDecoder(Decoder):
    """What the whole-sequence decoders (mdm, block) share: the row's sequence ``x`` (prompt + masks) laid out at
    once, emission of the resolved prefix in order, and the context check. The layout lives in ``row.state``:
    ``x`` (the sequence, a CPU tensor), ``p`` (the prompt's length), ``emitted`` (how far the answer was
    streamed), ``end`` (where a suffix begins, when there is one)."""

    causal = False
    shift: bool  # set by each decoder: the logit at i-1 scores position i

    fills_middle = False  # whether a request's suffix_ids (text after the answer) are taken (mdm)

    def check_request(self, engine: Engine, row: Row) -> None:
        extra = len(row.params.suffix_ids)
        check_fits_context(len(row.prompt_ids) + extra, row.params.max_new_tokens, engine.max_positions)

    def _layout(self, engine: Engine, row: Row) -> torch.Tensor:
        p, n, after = len(row.prompt_ids), row.params.max_new_tokens, list(row.params.suffix_ids)
        x = torch.tensor(row.prompt_ids + [engine.mask_token_id] * n + after)  # (a suffix: mdm only, checked)
        row.state.update(x=x, p=p, emitted=p)
        if after:
            row.state["end"] = p + n  # where the answer stops and the suffix begins
        return x

    def _scores(self, row: Row, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits scoring absolute ``positions``; ``logits[j]`` is the output at position ``row.pos + j``."""
        return logits[positions - row.pos - (1 if self.shift else 0)]

    def _emit(self, engine: Engine, row: Row) -> list[int]:
        """The newly resolved prefix of the answer (tokens are final once committed)."""
        x, start = row.state["x"], row.state["emitted"]
        masked = (x[start:] == engine.mask_token_id).nonzero()
        stop = start + int(masked[0]) if masked.numel() else x.numel()
        stop = min(stop, row.state.get("end", stop))  # never the suffix after the answer
        row.state["emitted"] = stop
        return x[start:stop].tolist()


class Sampler:
    """One masked-diffusion sampler behind :class:`~dlm.decode.mdm.decoder.MDMDecoder`, the decoder shell that the
    engine sees. A sampler keeps its per-row state in its own dataclass at ``row.state["sampler"]`` (beside the
    shared layout of :class:`DiffusionDecoder`) and decides, pass by pass, what the row feeds and commits.

    The default is a sampler over the whole sequence with nothing cached: each pass feeds it again at positions
    0.. and :meth:`commit` resolves some masks; :meth:`plan` decides what the next pass commits before its forward
    (so a pass that would commit nothing is never run), drawing its random numbers in the reference's order.
    """

    name: ClassVar[str]

    def __init__(self, decoder: MDMDecoder):
        self.decoder = decoder
        self.config: MDMConfig = decoder.config

    @property
    def shift(self) -> bool:
        return self.decoder.shift

    def check_request(self, engine: Engine, row: Row) -> None:
        """Refuse a request this sampler cannot run (at ``add``, not in the middle of a step)."""

    def start(self, engine: Engine, row: Row, steps: int):
        """The row's state at its prefill (its sequence laid out; ``steps`` passes)."""
        raise NotImplementedError

    def plan(self, engine: Engine, row: Row) -> None:
        """Decide what the row's next pass commits."""

    def prefill_suffix(self, engine: Engine, row: Row) -> list[int]:
        return row.state["x"][row.state["p"] :].tolist()  # the masks (and a suffix after them)

    def chunk(self, engine: Engine, row: Row) -> list[int]:
        return row.state["x"].tolist()  # the whole sequence, at positions 0.. (row.pos stays 0: nothing is cached)

    def chunk_attention(self, engine: Engine, row: Row, positions: torch.Tensor) -> torch.Tensor:
        n = positions.numel()
        return torch.ones(n, n, dtype=torch.bool)

    def chunk_positions(self, engine: Engine, row: Row, n: int) -> list[int] | None:
        return None

    def commit(self, engine: Engine, row: Row, logits: torch.Tensor) -> None:
        """One pass: write the committed tokens into ``row.state["x"]``."""
        raise NotImplementedError

    def consume(self, engine: Engine, row: Row, logits: torch.Tensor) -> tuple[list[int], int]:
        self.commit(engine, row, logits)
        out = self.decoder._emit(engine, row)
        if bool((row.state["x"] == engine.mask_token_id).any()):
            self.plan(engine, row)
        return out, -row.pos  # nothing is cached: the next pass feeds the whole sequence again

    @staticmethod
    def masked(engine: Engine, row: Row) -> torch.Tensor:
        """The positions of the row's sequence that are still masks."""
        return (row.state["x"] == engine.mask_token_id).nonzero().squeeze(-1)
