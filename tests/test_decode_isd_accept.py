"""ISD's pure parts on their own (dlm.decode.isd.accept / tree / policy / stats): tensors and ints in, verdicts
out, no engine or model. The model-level exactness tests are in tests/test_decode_isd.py."""

import math

import pytest
import torch

from dlm.decode.isd import (
    branch_layout,
    branch_masks,
    candidate_count,
    fallback_branches,
    greedy_candidate,
    record_verify,
    verify_greedy,
    verify_len,
    verify_sampled,
)
from dlm.decode.sampling import RequestStats, sample


def test_verify_greedy_accepts_the_leading_drafts_equal_to_the_argmax():
    # target = argmax of p_1..p_N: N entries for N-1 drafts (the last one is the free token's)
    assert verify_greedy([4, 5, 6], [4, 5, 6, 7]) == (3, None)
    assert verify_greedy([4, 5, 6], [4, 9, 6, 7]) == (1, 9)  # d_3 matches but comes after the rejection
    assert verify_greedy([4, 5, 6], [8, 5, 6, 7]) == (0, 8)
    assert verify_greedy([4], [4, 2]) == (1, None)


def test_verify_sampled_rejects_where_p_has_no_mass_and_accepts_where_p_equals_q():
    g = torch.Generator().manual_seed(0)
    one_hot = torch.eye(4)
    # p puts everything on token 2, q on token 1: d_1 = 1 is always rejected, the correction is always 2
    for _ in range(20):
        assert verify_sampled(one_hot[[2, 2]], one_hot[[1]], [1], g) == (0, 2)
    # p == q: every draft is accepted (u * q(d) < p(d) for u < 1)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 3)
    for _ in range(20):
        drafts = [int(sample(p[0], g)), int(sample(p[1], g))]
        assert verify_sampled(p, p[:2], drafts, g) == (2, None)


def test_verify_sampled_emits_the_target_distribution_and_accepts_at_the_overlap():
    """The token at d_1's position (the draft if accepted, else the correction) has distribution p_1 exactly,
    and d_1 is accepted with probability sum_x min(p_1(x), q_1(x))."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]])
    q = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.7, 0.1, 0.1, 0.1]])
    g = torch.Generator().manual_seed(1)
    n = 6000
    counts, accepted_first = torch.zeros(4), 0
    for _ in range(n):
        drafts = [int(sample(q[0], g)), int(sample(q[1], g))]
        accepted, correction = verify_sampled(p, q, drafts, g)
        token = drafts[0] if accepted >= 1 else correction
        counts[token] += 1
        accepted_first += accepted >= 1
    eps = math.sqrt((4 * math.log(2) + math.log(1e4)) / (2 * n))  # P(TV > eps) <= 1e-4
    assert 0.5 * float((counts / n - p[0]).abs().sum()) < eps
    overlap = float(torch.minimum(p[0], q[0]).sum())  # 0.5
    assert abs(accepted_first / n - overlap) < 4 * math.sqrt(overlap * (1 - overlap) / n)


def test_greedy_candidate_is_the_one_equal_to_the_ar_token():
    assert greedy_candidate([7, 3, 9], 3) == 1
    assert greedy_candidate([7, 3, 9], 7) == 0
    assert greedy_candidate([7, 3, 9], 5) is None


def test_fallback_branches_pick_the_likeliest_outcome():
    """P(all accepted) = prod a_i; P(first rejection at d_i) = a_1 .. a_{i-1} (1 - a_i); all-accepted wins ties."""
    assert fallback_branches("off", 3, [0.1, 0.1]) == (0,)
    assert fallback_branches("all", 3, [0.9, 0.9]) == (0, 1, 2)
    for a, want in [
        ([0.9, 0.9], (0,)),  # P(0) .81
        ([0.3, 0.9], (1,)),  # P(1) .7
        ([0.9, 0.3], (2,)),  # P(2) .63
        ([0.6, 0.6], (1,)),  # P(0) .36, P(1) .4, P(2) .24
        ([0.5], (0,)),  # a tie: P(0) = P(1) = .5
        ([0.2], (1,)),
    ]:
        assert fallback_branches("predict", len(a) + 1, a) == want, a


@pytest.mark.parametrize("n", [2, 3, 4])
def test_branch_masks_sit_where_the_layout_puts_them(n):
    """An outcome's masks start at the chunk index branch_masks gives, and the next d_1 sits one position after
    the first of them (a mask predicts the token after its own position)."""
    branches = tuple(range(n))
    offsets, _ = branch_layout(n, branches)
    assert len(offsets) == verify_len(n, "all", 1)
    for outcome in branches:
        first, next_d1 = branch_masks(n, branches, outcome)
        assert first == n + outcome * (n - 1)
        assert next_d1 == offsets[first] + 1
    assert branch_masks(n, (0,), 1) is None
    assert branch_masks(n, (1,), 1) == (n, 2)


def test_verify_len_and_candidate_count():
    assert [verify_len(n, "predict", 1) for n in (2, 3, 4)] == [3, 5, 7]  # 2N-1
    assert verify_len(3, "all", 1) == 3 + 3 * 2  # c, d_1, d_2, then N-1 masks for each of the N outcomes
    assert verify_len(2, "predict", 3) == 8 and verify_len(2, "off", 3) == 7  # 2K+1 (+ F)
    assert candidate_count(torch.tensor([0.7, 0.2, 0.03]), 0.05) == 2
    assert candidate_count(torch.tensor([0.7, 0.2, 0.03]), 0.0) == 3
    assert candidate_count(torch.tensor([0.97, 0.02, 0.01]), 0.05) == 1


def test_record_verify_counts_per_draft_position():
    s = RequestStats()
    record_verify(s, 3, 3, 3)
    record_verify(s, 3, 2, 1)
    record_verify(s, 3, 1, 0)
    assert s.proposed == [3, 2, 1] and s.accepted == [2, 1, 1]
    assert s.acceptance == [2 / 3, 0.5, 1.0]


def test_the_decoder_is_built_from_its_config():
    from dlm.decode.configs import BlockConfig, ISDConfig
    from dlm.decode.isd import ISDDecoder
    from dlm.decode.schedule import MeasuredDraft, TokenBudget
    from dlm.errors import DLMError

    config = ISDConfig(stride=3, draft_budget=6)
    dec = ISDDecoder(config)
    assert dec.config is config and dec.stride == 3
    assert dec.draft_budget == 6 and isinstance(dec.policy, TokenBudget) and dec.policy.budget == 6
    assert isinstance(ISDDecoder(ISDConfig(stride=3, draft_budget="auto")).policy, MeasuredDraft)
    with pytest.raises(DLMError, match=r"constructed from its config, a ISDConfig object, not a BlockConfig"):
        ISDDecoder(BlockConfig())
    with pytest.raises(TypeError):
        ISDDecoder(stride=3)  # no keyword spelling of a setting: the config is the one place
