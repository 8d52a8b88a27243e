"""One row's ISD state between steps: what the last forward drafted and what this step's chunk carries. The
decoder's own (``Row.state`` of an ISD row): the engine never reads or writes it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Mode = Literal["cold", "verify", "ar", "forced"]


@dataclass
class ISDRowState:
    """``mode``: what the row's next chunk is: ``'cold'`` (``[t0, masks]``: no drafts to verify), ``'verify'``
    (the drafts below, with masks for the next ones), ``'ar'`` (this step runs without drafts: ``[t0]``) or
    ``'forced'`` (``[t0, drafts]``: tokens a structured output forces, verified without masks)."""

    mode: Mode = "cold"
    drafts: list[int] | None = None  # d_1..d_{N-1} to verify (d_1 of the candidates' path: the first draw)
    q: torch.Tensor | None = None  # [N-1, V]: the drafts' distributions (None when greedy)
    conf: list[float] | None = None  # each draft's probability under its own distribution ('predict' routing)
    cands: list[int] | None = None  # the draft candidates for the next position (candidates > 1)
    branches: tuple[int, ...] | None = None  # the outcomes whose masks this step's verify chunk carries
    tree: tuple[int, bool] | None = None  # this step's candidate chunk: (K, with the rejection branch's mask F)
    # where ``q`` lies when the batched step drafted it: (the step's [rows, N-1, V] tensor, this row's index in it),
    # so the next step reads every row's q from that one tensor instead of stacking them
    q_src: tuple[torch.Tensor, int] | None = None

    def cold(self) -> None:
        """No drafts pending: the next drafting step cold-starts (``conf``/``cands`` are overwritten by the next
        drafts before they are read)."""
        self.mode, self.drafts, self.q, self.q_src = "cold", None, None, None

    def verify_drafts(self) -> list[int]:
        if self.drafts is None:
            raise RuntimeError("ISD: a verify step without drafts")
        return self.drafts

    def verify_cands(self) -> list[int]:
        if self.cands is None:
            raise RuntimeError("ISD: a candidate verify step without candidates")
        return self.cands

    def draft_q(self) -> torch.Tensor:
        if self.q is None:
            raise RuntimeError("ISD: a sampled verify step without the drafts' distributions")
        return self.q
