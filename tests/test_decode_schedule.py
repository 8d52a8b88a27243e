"""When ISD drafts: the policies of dlm.decode.schedule (always, a token budget, measured goodput) pick the
faster mode per batch size, and whatever they pick the greedy output is AR's, token for token."""

import random

import pytest

from dlm import convert_ar_to_dlm
from dlm.decode.engine import Engine
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams
from dlm.decode.schedule import AlwaysDraft, MeasuredDraft, PolicyMemory, TokenBudget, make_policy
from dlm.errors import DLMError
from dlm.testing import make_model, make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22], [30, 31, 32, 33]]


def run(policy, steps, rows, draft_cost, acceptance, noise=0.1, seed=0):
    """Runs ``steps`` decode steps at batch ``rows`` on a synthetic device with ISD N=2: an AR step costs 1
    (+-noise) and commits one token per row; a drafting step costs ``draft_cost`` and each row commits one token
    from a cold start (then verifies next step) or, verifying, two with probability ``acceptance`` (and verifies
    again) else one (and cold-starts): TPF 2 / (2 - a). Returns the modes chosen and the tokens/s against AR
    steps alone (one token a row per unit of time)."""
    rng = random.Random(seed)
    verifying = [False] * rows
    modes, time, committed = [], 0.0, 0
    for _ in range(steps):
        d = policy.drafting(rows)
        cost = (draft_cost if d else 1.0) * (1 + rng.uniform(-noise, noise))
        tokens = 0
        for i in range(rows):
            if not d:
                tokens, verifying[i] = tokens + 1, False
            elif not verifying[i]:
                tokens, verifying[i] = tokens + 1, True
            else:
                ok = rng.random() < acceptance
                tokens, verifying[i] = tokens + (2 if ok else 1), ok
        policy.observe(rows, d, cost, tokens)
        modes.append(d)
        time, committed = time + cost, committed + tokens
    return modes, committed / time / rows


def simulate(policy, steps, rows, draft_cost, acceptance, noise=0.1, seed=0):
    """:func:`run`'s modes."""
    return run(policy, steps, rows, draft_cost, acceptance, noise, seed)[0]


def test_a_first_process_pays_little_to_learn_that_drafting_loses():
    """The default 30-minute quickstart checkpoint on a 2-core AVX2 CPU drafts at 0.7x AR's tokens/s (TPF 1.3 at
    1.86x an AR step's cost); its report measures 16 prompts x 64 tokens, ~1000 steps at batch 1, in a fresh
    process. Learning that drafting loses must cost at most ~2% of that run (0.93x AR was measured when the
    exploration period doubled from 24); where drafting pays, the policy keeps most of its gain."""
    for rows in (1, 4, 16):
        loses = [run(MeasuredDraft(), 1000, rows, 1.86, 0.46, seed=s)[1] for s in range(8)]
        assert sum(loses) / len(loses) >= 0.98 and min(loses) >= 0.97, (rows, loses)
        pays = [run(MeasuredDraft(), 1000, rows, 1.15, 0.46, seed=s)[1] for s in range(8)]  # always drafting: 1.13x
        assert sum(pays) / len(pays) >= 1.08, (rows, pays)


def run_strides(policy, steps, rows, cost, acceptance, noise=0.1, seed=0):
    """:func:`run` for a policy that answers a stride (0: AR; True: the largest in ``cost``): a drafting step at
    stride s costs ``cost[s]``; a verifying row accepts each of its s-1 drafts in turn with probability
    ``acceptance`` and commits the accepted ones plus one, verifying again when all were accepted, else
    cold-starting (one token); a row whose drafts were made at another stride cold-starts. Returns the modes and
    the tokens/s against AR steps alone."""
    rng = random.Random(seed)
    drafted_at = [0] * rows  # the stride a row's pending drafts were made at (0: none)
    modes, time, committed = [], 0.0, 0
    for _ in range(steps):
        m = policy.drafting(rows)
        s = max(cost) if m is True else int(m)
        step_cost = (cost[s] if s else 1.0) * (1 + rng.uniform(-noise, noise))
        tokens = 0
        for i in range(rows):
            if not s:
                tokens, drafted_at[i] = tokens + 1, 0
            elif drafted_at[i] != s:
                tokens, drafted_at[i] = tokens + 1, s
            else:
                j = 0
                while j < s - 1 and rng.random() < acceptance:
                    j += 1
                tokens, drafted_at[i] = tokens + j + 1, (s if j == s - 1 else 0)
        policy.observe(rows, m, step_cost, tokens)
        modes.append(s)
        time, committed = time + step_cost, committed + tokens
    return modes, committed / time / rows


class Stride(AlwaysDraft):
    """Drafts at one stride at every step."""

    def __init__(self, n):
        self.n = n

    def drafting(self, rows):
        return self.n


def test_the_measured_policy_chooses_the_stride_that_pays():
    """Given strides 2..4 (ISD's default with a model trained for 3 masks), the policy runs the fastest: on a CPU,
    where each chunk token costs, N=2 at 1.15x an AR step pays (TPF 1.30) and N=3 / N=4 do not; on a device where
    the chunk is nearly free (a GPU at batch 1), N=4 pays most; where no stride pays, it steps AR and pays no
    more to learn that than with one stride."""
    cpu = {2: 1.15, 3: 1.6, 4: 2.0}
    gpu = {2: 1.02, 3: 1.03, 4: 1.04}
    losing = {2: 1.86, 3: 2.4, 4: 2.9}
    for seed in range(4):
        fixed = {n: run_strides(Stride(n), 1000, 1, cpu, 0.46, seed=seed)[1] for n in (2, 3, 4)}
        modes, rate = run_strides(MeasuredDraft(strides=[2, 3, 4]), 1000, 1, cpu, 0.46, seed=seed)
        assert fixed[2] > fixed[3] > fixed[4] and fixed[3] < 1.0, fixed
        assert modes[200:].count(2) >= 0.7 * 800 and rate >= 0.95 * fixed[2], (seed, rate, fixed)
        fixed = {n: run_strides(Stride(n), 1000, 1, gpu, 0.8, seed=seed)[1] for n in (2, 3, 4)}
        modes, rate = run_strides(MeasuredDraft(strides=[2, 3, 4]), 1000, 1, gpu, 0.8, seed=seed)
        assert fixed[4] > fixed[3] > fixed[2] > 1.2, fixed
        assert modes[300:].count(3) + modes[300:].count(4) >= 0.8 * 700 and rate >= 0.9 * fixed[4], (seed, rate, fixed)
        for rows in (1, 4):
            modes, rate = run_strides(MeasuredDraft(strides=[2, 3, 4]), 1000, rows, losing, 0.46, seed=seed)
            one = run_strides(MeasuredDraft(strides=[2]), 1000, rows, losing, 0.46, seed=seed)[1]
            assert set(modes) == {0, 2} and rate >= 0.97 and rate >= one - 0.005, (rows, rate, one)


def test_measured_policy_drafts_where_it_pays_and_steps_ar_where_it_does_not():
    """The CPU figures of bench/forward_cost.py: a verify step costs ~1.15x an AR step at batch 1 and ~1.45x at
    batch 8; with acceptance 0.46 (TPF 1.3) drafting is 1.13x faster alone and 0.9x in a batch of 8."""
    alone, busy = [], []
    for seed in range(4):  # the choice is statistical: a few independent runs, each with its own policy
        p = MeasuredDraft()
        alone += simulate(p, 600, 1, draft_cost=1.15, acceptance=0.46, seed=seed)[100:]
        busy += simulate(p, 600, 8, draft_cost=1.45, acceptance=0.46, seed=seed + 10)
    assert sum(alone) / len(alone) > 0.8  # drafting, with short AR exploration bursts
    assert sum(busy) / len(busy) < 0.1  # AR, with short drafting exploration bursts
    # exploration backs off once the choice is made: the drafting bursts (each a 10% loss for its 4 steps here) come
    # at least max_period apart, from the first choice on
    p = MeasuredDraft()
    busy = simulate(p, 600, 8, draft_cost=1.45, acceptance=0.46)
    starts = [i for i in range(1, len(busy)) if busy[i] and not busy[i - 1]]
    assert len(starts) >= 3 and all(b - a >= p.max_period for a, b in zip(starts, starts[1:]))
    assert p.bucket_of(1) != p.bucket_of(8) and p.bucket_of(5) == p.bucket_of(8) and p.bucket_of(9) != p.bucket_of(8)


def test_exploration_of_a_far_slower_mode_backs_off_until_it_costs_little():
    """Drafting 3 candidates at 32 requests on a 2-core CPU runs at ~0.2x AR's tokens/s. Bursts of it every
    max_period (96) steps cost ~13% of the throughput; backing off until a burst costs explore_cost (1%) of the
    time between bursts keeps >= 0.97x pure AR's tokens/s (the back-off's first doublings included), at a 5x and at
    a 2x costlier drafting step alike; where drafting pays (1.2x cost, TPF ~1.46) the policy drafts."""

    def goodput(policy, draft_cost):
        rows, rng, verifying, time, tokens = 32, random.Random(0), [False] * 32, 0.0, 0
        for step in range(3000):
            d = policy.drafting(rows)
            cost = (draft_cost if d else 1.0) * (1 + rng.uniform(-0.1, 0.1))
            n = 0
            for i in range(rows):
                if not d or not verifying[i]:
                    n, verifying[i] = n + 1, d
                else:
                    ok = rng.random() < 0.46
                    n, verifying[i] = n + (2 if ok else 1), ok
            policy.observe(rows, d, cost, n)
            if step >= 500:
                time, tokens = time + cost, tokens + n
        return tokens / time / rows  # tokens/s against pure AR's (1 token a row per unit of time)

    assert goodput(MeasuredDraft(), 5.0) >= 0.97
    assert goodput(MeasuredDraft(explore_cost=1e9), 5.0) < 0.9  # capped at max_period: the cost this avoids
    assert goodput(MeasuredDraft(), 2.0) >= max(0.97, goodput(MeasuredDraft(explore_cost=1e9), 2.0))
    assert goodput(MeasuredDraft(), 1.2) > 1.03


def test_measured_policy_stops_drafting_when_acceptance_drops():
    p = MeasuredDraft()
    before = simulate(p, 400, 2, draft_cost=1.1, acceptance=0.6)
    assert sum(before[100:]) / 300 > 0.9
    after = simulate(p, 400, 2, draft_cost=1.1, acceptance=0.0, seed=2)  # drafts now always rejected
    # the running mode's window is fresh: the switch comes within about one window of drafting steps
    assert sum(after[40:]) / 360 < 0.15


def test_a_new_batch_size_starts_from_what_its_neighbours_measured():
    """Drafting's relative cost grows with the batch: AR measured better at batch 8 means a batch of 32 starts
    with AR steps (no costly drafting burst first); drafting measured better at batch 4 means batch 1 starts
    drafting. Each still tries the other mode after its first period."""
    p = MeasuredDraft()
    simulate(p, 200, 8, draft_cost=1.45, acceptance=0.46)
    big = simulate(p, 200, 32, draft_cost=1.6, acceptance=0.46)
    assert not any(big[: p.base_period - 1]) and sum(big) / len(big) < 0.1
    p = MeasuredDraft()
    simulate(p, 200, 4, draft_cost=1.1, acceptance=0.6, seed=3)
    small = simulate(p, 200, 1, draft_cost=1.05, acceptance=0.6, seed=4)
    assert all(small[: p.base_period - 1]) and sum(small) / len(small) > 0.8
    # ... and how far the neighbour's exploration backed off: its period, not the first one, before the first burst
    p = MeasuredDraft()
    simulate(p, 600, 8, draft_cost=2.5, acceptance=0.46)
    backed_off = p.explore_period(8)
    assert backed_off > p.base_period
    big = simulate(p, backed_off + 40, 32, draft_cost=5.0, acceptance=0.46)
    assert not any(big[: backed_off - 1]) and any(big)


def test_a_later_process_starts_from_what_an_earlier_one_learnt(tmp_path, monkeypatch):
    """Drafting at half AR's speed (batch 8): the first process pays a drafting burst at its start; what it
    learnt (AR, and how far its exploration backed off) is written, and the next process with the same key starts
    with AR steps and first tries drafting at that backed-off period, not at once. A record of another key
    carries nothing. Its throughput over a short run (64 steps, a one-shot batch) is higher than the first's."""
    monkeypatch.setenv("DLM_HOME", str(tmp_path))

    def goodput(modes, draft_cost, tpf=1.3):
        return sum(tpf if d else 1.0 for d in modes) / sum(draft_cost if d else 1.0 for d in modes)

    first = MeasuredDraft(memory=PolicyMemory("model|machine|isd N=2"))
    modes = simulate(first, 600, 8, draft_cost=2.0, acceptance=0.46)
    assert modes[0] and not modes[-1]  # it started with a drafting burst and settled on AR
    learnt = first.explore_period(8)
    assert learnt > first.base_period
    rec = PolicyMemory("model|machine|isd N=2").get(first.bucket_of(8))
    assert rec is not None and rec["draft"] is False and rec["period"] == learnt
    assert rec["tok_s"][0] < rec["tok_s"][1]

    later = MeasuredDraft(memory=PolicyMemory("model|machine|isd N=2"))
    assert later.peek(8) is False  # a joining request's prefill already knows: no first masks
    modes = simulate(later, learnt + 40, 8, draft_cost=2.0, acceptance=0.46, seed=1)
    assert not any(modes[: learnt - 1]) and any(modes[learnt - 1 :])  # explores, at the learnt period
    assert later.describe(8)["carried"] == "ar"
    cold = simulate(MeasuredDraft(), 64, 8, draft_cost=2.0, acceptance=0.46, seed=2)
    warm = simulate(MeasuredDraft(memory=PolicyMemory("model|machine|isd N=2")), 64, 8, 2.0, 0.46, seed=2)
    assert goodput(warm, 2.0) == 1.0 and goodput(cold, 2.0) < 0.98
    other = simulate(MeasuredDraft(memory=PolicyMemory("model|machine|isd N=3")), 8, 8, 2.0, 0.46)
    assert other[0]  # nothing carried: the first burst again


def test_a_carried_choice_that_no_longer_holds_is_corrected_and_rewritten(tmp_path, monkeypatch):
    """A record says drafting wins at batch 1 (an earlier, better-trained checkpoint in the same place, say); here
    drafting loses: the policy starts drafting, its first AR burst at the carried period shows AR faster, it
    switches and writes the new choice."""
    monkeypatch.setenv("DLM_HOME", str(tmp_path))
    key = "model|machine|isd N=2"
    PolicyMemory(key).put(0, {"draft": True, "period": 48, "tok_s": [12.0, 10.0]})
    p = MeasuredDraft(memory=PolicyMemory(key))
    modes = simulate(p, 400, 1, draft_cost=1.3, acceptance=0.1)
    assert all(modes[:47]) and sum(modes[200:]) / 200 < 0.15
    assert PolicyMemory(key).get(0)["draft"] is False
    PolicyMemory(key).put(0, {"draft": "yes", "period": 48})  # a damaged record is ignored, not trusted
    assert PolicyMemory(key).get(0) is None


def test_engines_on_one_folder_share_what_the_policy_learnt(tmp_path, monkeypatch):
    """The ISD decoder's 'auto' policy keeps its record under the folder, machine and setting: a second engine on
    the same folder and stride reads it, another stride or a folder rewritten (new weights) does not, and a model
    built in memory (no folder) keeps nothing."""
    import os

    from dlm.decode.isd.policy import memory_key
    from dlm.model.hub import load_model

    monkeypatch.setenv("DLM_HOME", str(tmp_path / "home"))
    folder = tmp_path / "m"
    idlm().save_pretrained(folder)
    model = load_model(str(folder))
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    eng = Engine(model, decoder="isd", stride=2, options=EngineOptions(max_batch_size=2))
    eng.generate(PROMPTS[:2], params)
    assert eng.decoder.policy.memory is not None
    key = eng.decoder.policy.memory.key
    assert PolicyMemory(key).buckets  # written once a choice was measured
    again = Engine(model, decoder="isd", stride=2, options=EngineOptions(max_batch_size=2))
    assert again.decoder.policy.memory.key == key and again.decoder.policy.memory.buckets
    other = Engine(model, decoder="isd", stride=3, options=EngineOptions(max_batch_size=2))
    assert other.decoder.policy.memory.key != key
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert memory_key(again, "x") is not None and memory_key(built := Engine(idlm(), decoder="ar"), "x") is None
    built.close()
    moved = Engine(model, decoder="isd", stride=2, options=EngineOptions(max_batch_size=2))
    assert moved.decoder.policy.memory.key != key
    fresh = Engine(idlm(), decoder="isd", stride=2)
    assert fresh.decoder.policy.memory is None
    always = Engine(model, decoder="isd", stride=2, draft_budget="always")
    assert not isinstance(always.decoder.policy, MeasuredDraft)


def test_policy_values_and_errors():
    assert isinstance(make_policy(None, 2), AlwaysDraft) and isinstance(make_policy("always", 2), AlwaysDraft)
    assert isinstance(make_policy("auto", 2), MeasuredDraft) and isinstance(make_policy("AUTO", 3), MeasuredDraft)
    b = make_policy("6", 2)
    assert isinstance(b, TokenBudget) and b.drafting(2) and not b.drafting(3)  # 2 x 3 <= 6 < 3 x 3
    for bad in (0, -1, "x", "1.5", True):
        with pytest.raises(DLMError, match="--isd-draft-budget"):
            make_policy(bad, 2)


def idlm():
    return convert_ar_to_dlm(make_model("llama", seed=1), "idlm", block_size=2, tokenizer=make_tokenizer())


class Alternate(AlwaysDraft):
    """Drafts on two steps of every four (a cold start, then a verify), and records what the engine reports."""

    def __init__(self):
        self.i, self.seen = 0, []

    def drafting(self, rows):
        self.i += 1
        return self.i % 4 in (1, 2)

    def peek(self, rows):
        return True

    def observe(self, rows, drafted, seconds, tokens):
        self.seen.append((rows, drafted, seconds, tokens))


@pytest.mark.parametrize("budget", [None, 5, "auto", "alternate"])
def test_any_policy_keeps_greedy_isd_equal_to_ar(budget):
    dlm = idlm()
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ar = [
        r.token_ids
        for r in Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=3)).generate(PROMPTS, params)
    ]
    policy = Alternate() if budget == "alternate" else budget
    eng = Engine(dlm, decoder="isd", stride=3, draft_budget=policy, options=EngineOptions(max_batch_size=3))
    out = eng.generate(PROMPTS, params)
    assert [r.token_ids for r in out] == ar
    if budget == "alternate":
        assert {d for _, d, _, _ in policy.seen} == {True, False}  # both kinds of step ran
        assert all(s > 0 and 1 <= rows <= 3 for rows, _, s, _ in policy.seen)
        # every token after each request's first (which its prefill gives) came from an observed decode step
        assert sum(t for *_, t in policy.seen) == sum(len(r.token_ids) - 1 for r in out)
        assert sum(sum(r.stats.proposed) for r in out) > 0


class RandomStrides(AlwaysDraft):
    """Answers a random stride (0: a plain AR step) for every step and every prefill, as a policy that chooses the
    stride may: rows drafted at one stride meet steps at another, prefills' masks differ from the next step's."""

    def __init__(self, strides, seed=0):
        self.rng, self.strides, self.seen = random.Random(seed), strides, []

    def drafting(self, rows):
        return self.rng.choice(self.strides)

    def peek(self, rows):
        return self.rng.choice(self.strides)

    def observe(self, rows, drafted, seconds, tokens):
        self.seen.append(drafted)


def test_a_policy_that_changes_the_stride_keeps_greedy_isd_equal_to_ar():
    """Without a stride given, 'auto' chooses among the strides the model was trained for (2..block_size+1); a
    stride given is fixed, and draft candidates run at 2. Whatever stride each step and each prefill runs at, the
    greedy output is AR's token for token, on the per-row and on the batched verify path."""
    dlm = convert_ar_to_dlm(make_model("llama", seed=1), "idlm", block_size=3, tokenizer=make_tokenizer())
    assert Engine(dlm, decoder="isd").decoder.policy.strides == [2, 3, 4]
    assert Engine(dlm, decoder="isd", stride=3).decoder.policy.strides is None
    assert Engine(dlm, decoder="isd", candidates=3).decoder.policy.strides is None
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = [
        r.token_ids
        for r in Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=3)).generate(PROMPTS, params)
    ]
    for seed in range(3):
        for batched in (False, True):
            policy = RandomStrides([0, 2, 3, 4], seed)
            eng = Engine(dlm, decoder="isd", draft_budget=policy, options=EngineOptions(max_batch_size=3))
            eng.decoder.batch_verify = batched
            out = eng.generate(PROMPTS, params)
            assert [r.token_ids for r in out] == ar, (seed, batched)
            assert set(policy.seen) == {0, 2, 3, 4}
            assert sum(eng.decoder.counts.stride_steps.values()) == eng.decoder.counts.mode_steps["draft"] > 0
            assert len(out[0].stats.proposed) <= 3 and sum(sum(r.stats.proposed) for r in out) > 0
    bad = RandomStrides([5])
    with pytest.raises(DLMError, match="stride 2..4"):
        Engine(dlm, decoder="isd", draft_budget=bad).generate(PROMPTS[:1], params)


def test_token_budget_drafts_alone_and_steps_ar_when_busy():
    """With a budget of one ISD row (5 tokens at stride 3), a lone request drafts and concurrent ones run AR
    steps."""
    dlm = idlm()
    sp = SamplingParams(max_new_tokens=10, ignore_eos=True)
    eng = Engine(dlm, decoder="isd", stride=3, draft_budget=5, options=EngineOptions(max_batch_size=8))
    assert eng.decoder.verify_len == 5  # 'predict' carries one branch of masks: the plain verify chunk's length
    lone = eng.generate([PROMPTS[0]], sp)[0]
    assert sum(lone.stats.proposed) > 0
    busy = eng.generate(PROMPTS[:4], sp)
    assert all(sum(r.stats.proposed) == 0 for r in busy)  # 4 rows x 5 tokens > 5: never verified drafts
    assert busy[0].token_ids == lone.token_ids


def test_generate_cli_checks_the_budget_flag(tmp_path, capsys):
    from dlm.cli import main

    assert main(["generate", "--model", "x", "--prompt", "hi", "--decode", "ar", "--isd-draft-budget", "4"]) != 0
    assert "--isd-draft-budget is an ISD setting" in capsys.readouterr().err
    assert main(["generate", "--model", "x", "--prompt", "hi", "--decode", "ar", "--isd-token-budget", "4"]) != 0
    err = capsys.readouterr().err  # the old spelling: still read, with a note naming the new one
    assert "--isd-token-budget is renamed --isd-draft-budget" in err and "--isd-draft-budget is an ISD" in err
    assert main(["generate", "--model", "x", "--prompt", "hi", "--decode", "isd", "--isd-token-budget", "soon"]) != 0
    assert "positive integer, 'auto' or 'always'" in capsys.readouterr().err


def test_the_policy_file_keeps_the_most_recent_records(tmp_path, monkeypatch):
    """A folder retrained in place gets a new key each time: the file keeps the KEEP most recently written
    records, dropping the oldest, and a record written again counts as recent."""
    monkeypatch.setenv("DLM_HOME", str(tmp_path))
    monkeypatch.setattr(PolicyMemory, "KEEP", 3)
    clock = iter(range(100, 200))
    monkeypatch.setattr("dlm.decode.schedule.time.time", lambda: float(next(clock)))
    for k in "abcd":
        PolicyMemory(k).put(0, {"draft": True, "period": 24, "tok_s": [2.0, 1.0]})
    assert [PolicyMemory(k).get(0) is not None for k in "abcd"] == [False, True, True, True]
    PolicyMemory("b").put(1, {"draft": False, "period": 48, "tok_s": [1.0, 2.0]})  # b is the newest now
    PolicyMemory("e").put(0, {"draft": True, "period": 24, "tok_s": [2.0, 1.0]})
    assert [PolicyMemory(k).get(0) is not None for k in "bcde"] == [True, False, True, True]
    assert PolicyMemory("b").get(1)["period"] == 48
