"""ISD's statistics: per request, drafts proposed and accepted per draft position (:class:`RequestStats`); per
decoder, decode steps by the drafting policy's choice and verify steps whose outcome had its masks in the chunk
(read by the server's /metrics and bench/decode.py)."""

from __future__ import annotations

from dlm.decode.sampling import RequestStats


def record_verify(stats: RequestStats, positions: int, proposed: int, accepted: int) -> None:
    """A verify step checked the first ``proposed`` of ``positions`` draft positions and accepted the first
    ``accepted``."""
    if len(stats.proposed) < positions:  # (a policy that chooses the stride may raise it mid-request)
        stats.proposed = list(stats.proposed) + [0] * (positions - len(stats.proposed))
        stats.accepted = list(stats.accepted) + [0] * (positions - len(stats.accepted))
    for i in range(proposed):
        stats.proposed[i] += 1
    for i in range(accepted):
        stats.accepted[i] += 1


class StepCounts:
    """Decoder-wide counters: ``mode_steps`` (decode steps that drafted / ran plain AR) and ``branch_steps``
    (verify steps; those whose outcome had its masks in the chunk, so the next step verified again)."""

    def __init__(self) -> None:
        self.mode_steps = {"draft": 0, "ar": 0}
        self.stride_steps: dict[int, int] = {}  # drafting steps by their stride
        self.branch_steps = {"verify": 0, "predicted": 0}

    def step(self, drafting: bool, stride: int) -> None:
        self.mode_steps["draft" if drafting else "ar"] += 1
        if drafting:
            self.stride_steps[stride] = self.stride_steps.get(stride, 0) + 1

    def verify(self, predicted: bool) -> None:
        self.branch_steps["verify"] += 1
        self.branch_steps["predicted"] += predicted
