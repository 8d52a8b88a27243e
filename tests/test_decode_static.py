"""The static decode step (dlm.decode.static): fixed shapes over preallocated KV buffers give the same tokens as the
growing cache for every decoder, with rows joining and leaving, different prompt lengths, ISD rollbacks, tree
chunks, re-fed rows, compaction and buffer growth; its layout operations and mask on their own."""

import itertools

import pytest
import torch

from dlm import convert_ar_to_dlm
from dlm.decode import static
from dlm.decode.configs import ISDConfig
from dlm.decode.engine import Engine, KVBatch
from dlm.decode.isd import ISDDecoder
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams
from dlm.testing import make_model, make_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# different lengths; more prompts than rows, and per-request lengths (below), so rows join and leave mid-run
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22], [30], [40, 41, 42, 43, 44, 45]]


def dlm_of(objective, arch="llama", seed=1, **kw):
    """A tiny random DLM whose attention is sharp (query/key weights scaled up): at the default init scale every
    score is ~0, attention is ~uniform and a wrong key would not change the tokens."""
    model = make_model(arch, seed=seed)
    with torch.no_grad():
        for name, m in model.named_modules():
            if name.endswith(("q_proj", "k_proj")):
                m.weight.mul_(6.0)
            elif name.endswith("c_attn"):  # GPT-2: q, k, v in one
                m.weight[:, : 2 * m.weight.shape[0]].mul_(6.0)
    return convert_ar_to_dlm(model, objective, tokenizer=make_tokenizer(), **kw)


def params(k=12, temperature=0.0):
    return [
        SamplingParams(max_new_tokens=k + 3 * (i % 3), temperature=temperature, top_k=20, seed=7 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]


def both(dlm, decoder, p, batch=3, **kw):
    """(dynamic tokens, static tokens, static engine); ISD drafting at every step (the measured policy's timing
    choices would differ between the two runs)."""
    if decoder == "isd":
        kw.setdefault("draft_budget", "always")
    dyn = Engine(dlm, decoder=decoder, options=EngineOptions(max_batch_size=batch), **kw).generate(PROMPTS, p)
    eng = Engine(dlm, decoder=decoder, options=EngineOptions(max_batch_size=batch, static_cache=True), **kw)
    st = eng.generate(PROMPTS, p)
    assert [r.stats.forwards for r in st] == [r.stats.forwards for r in dyn]
    return [r.token_ids for r in dyn], [r.token_ids for r in st], eng


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_static_ar_and_isd_equal_the_dynamic_path_and_greedy_isd_equals_ar(arch):
    dlm = dlm_of("idlm", arch, block_size=3)
    p = params()
    ar_dyn, ar_st, _ = both(dlm, "ar", p)
    assert ar_st == ar_dyn
    for stride, fallback in itertools.product((2, 3), ("predict", "all", "off")):
        dyn, st, eng = both(dlm, "isd", p, stride=stride, fallback=fallback)
        assert st == dyn == ar_dyn, (arch, stride, fallback)
        assert eng.kv.rows == 0 and not eng.has_unfinished()
    for batch in (1, 4):  # every row count, padded to buckets 1, 2, 4
        dyn, st, _ = both(dlm, "isd", p, batch=batch, stride=3)
        assert st == dyn == ar_dyn


def test_static_isd_candidates_and_sampling_equal_the_dynamic_path():
    dlm = dlm_of("idlm", "llama", block_size=2)
    dyn, st, _ = both(
        dlm, "isd", params(), candidates=2, candidate_min_prob=0.0
    )  # tree chunks: kept slots that are not a prefix
    assert st == dyn
    for decoder, kw in (("ar", {}), ("isd", dict(stride=3)), ("isd", dict(candidates=2))):
        dyn, st, _ = both(dlm, decoder, params(temperature=1.0), **kw)
        assert st == dyn, decoder


@pytest.mark.parametrize(
    "objective,kw,conv",
    [
        ("mdm", dict(sampler="confidence", steps=4), dict()),
        ("mdm", dict(sampler="threshold", semi_ar_block=4, threshold=0.9), dict(shift=False)),  # re-fed rows
        ("mdm", dict(sampler="llada", steps=4, cfg_scale=1.0), dict()),  # two copies per chunk (own positions)
        ("block", dict(steps=2, threshold=0.9), dict(block_size=4)),
        ("block", dict(steps=4), dict(block_size=4, shift=True)),
    ],
)
def test_static_diffusion_decoders_equal_the_dynamic_path(objective, kw, conv):
    dlm = dlm_of(objective, seed=3, **conv)
    for temperature in (0.0, 1.0):
        dyn, st, _ = both(dlm, objective, params(6, temperature), **kw)
        assert st == dyn, temperature


class OracleCandidates(ISDDecoder):
    """Candidates with the true next-next token of PROMPTS[0] at a random slot: every slot gets accepted
    sometimes, so a row's kept KV is not a prefix of its chunk (holes in the static layout)."""

    def __init__(self, truth, seed=0, **kw):
        super().__init__(ISDConfig(**kw))
        self.truth, self.rng = truth, torch.Generator().manual_seed(seed)

    def _draft(self, engine, row, mask_logits, first_pos):
        super()._draft(engine, row, mask_logits, first_pos)
        g = first_pos - len(PROMPTS[0])
        true = self.truth[g] if 0 <= g < len(self.truth) else 0
        cands = [(true + 1 + j) % 300 for j in range(self.candidates)]
        cands[int(torch.randint(self.candidates, (1,), generator=self.rng))] = true
        row.state.cands = cands


def test_holes_growth_compaction_and_the_captured_span_do_not_change_outputs(monkeypatch):
    """Tree chunks that keep a non-prefix (holes), buffers that start too small (row and slot growth mid-run),
    compaction when a row with holes runs out of room, and the key span of the captured form (a power of two
    >= 256, beyond the live slots)."""
    dlm = dlm_of("idlm", "qwen2", block_size=2)
    p = params(24)
    truth = Engine(dlm, decoder="ar").generate([PROMPTS[0]], SamplingParams(40, ignore_eos=True))[0].token_ids

    def run(**kw):
        eng = Engine(dlm, decoder=OracleCandidates(truth, candidates=3), options=EngineOptions(max_batch_size=3, **kw))
        return [r.token_ids for r in eng.generate(PROMPTS, p)], eng

    ref, _ = run()
    assert ref[0] == truth[: len(ref[0])]
    calls = []
    compact, after = static.StaticKV.compact, static.StaticKV.after_extend

    def counting(self):
        calls.append(self.holes())
        compact(self)

    holes = []

    def watching(self, keep):
        after(self, keep)
        holes.append(self.holes())

    monkeypatch.setattr(static.StaticKV, "compact", counting)
    monkeypatch.setattr(static.StaticKV, "after_extend", watching)
    monkeypatch.setattr(static, "INITIAL_CAPACITY", 8)
    monkeypatch.setattr(static, "SPAN_GRANULE", 8)
    monkeypatch.setattr(static.StaticKV, "plan", lambda self, slots: None)  # no room planned per request
    st, eng = run(static_cache=True)
    assert st == ref
    assert any(holes) and eng.kv.generation > 2 and calls and all(calls)  # holes, growth, compaction
    monkeypatch.setattr(static, "INITIAL_CAPACITY", 256)
    monkeypatch.setattr(static, "SPAN_GRANULE", 64)
    eng = Engine(
        dlm, decoder=OracleCandidates(truth, candidates=3), options=EngineOptions(max_batch_size=3, static_cache=True)
    )
    eng.kv.graphs = True  # the span rule of the captured form, run uncaptured
    assert [r.token_ids for r in eng.generate(PROMPTS, p)] == ref


def test_static_layout_operations():
    """merge / after_extend / select / compact keep each row's live keys in order, and the mask shows them."""
    kv = static.StaticKV("cpu", capacity=64)
    pre = KVBatch()
    keys = torch.arange(2 * 4, dtype=torch.float).view(2, 1, 4, 1)
    pre.cache.update(keys, keys + 100, 0)
    pre.valid = torch.tensor([[True, True, True, True], [False, True, True, False]])
    kv.merge(pre)
    assert kv.rows == 2 and kv.lens == [4, 3]

    def live(r):
        k = kv.bufs[0][0][r, 0, :, 0]
        return k[kv.valid[r]].tolist()

    assert live(0) == [0.0, 1.0, 2.0, 3.0] and live(1) == [5.0, 6.0]
    # a 3-token chunk: row 0 keeps 2 (a prefix), row 1 keeps chunk tokens 0 and 2 (a tree: a hole at 1)
    kv.span = kv.span_for(kv.seq_len + 3)
    kv.write_index = (torch.tensor(kv.lens)[:, None] + torch.arange(3))[:, None, :, None]
    new = torch.tensor([[[10.0], [11.0], [12.0]], [[20.0], [21.0], [22.0]]])[:, None]
    kv.cache.update(new, new, 0)
    kv.after_extend(torch.tensor([[True, True, False], [True, False, True]]))
    assert kv.lens == [6, 6] and live(0) == [0, 1, 2, 3, 10, 11] and live(1) == [5, 6, 20, 22]
    mask = static.static_mask(kv.valid, torch.tensor(kv.lens), torch.ones(2, 2, 2, dtype=torch.bool).tril(), 8)
    assert mask.shape == (2, 1, 2, 8)
    assert mask[1, 0].tolist() == [
        [False, True, True, True, False, True, True, False],
        [False, True, True, True, False, True, True, True],
    ]
    assert kv.holes()
    kv.compact()
    assert kv.lens == [6, 4] and live(0) == [0, 1, 2, 3, 10, 11] and live(1) == [5, 6, 20, 22]
    assert kv.bufs[0][0][1, 0, :4, 0].tolist() == [5, 6, 20, 22]
    kv.select(torch.tensor([1]))
    assert kv.rows == 1 and kv.lens == [4] and live(0) == [5, 6, 20, 22] and not kv.valid[1].any()


def test_room_is_planned_per_request_and_rows_preallocated():
    """A request's prompt + max_new_tokens is room in the buffers from its first allocation (no growth while it
    decodes: each growth would drop the captured graphs); ``rows`` preallocates buffer rows; a later, longer
    request grows them once, keeping the live rows."""
    kv = static.StaticKV("cpu", rows=5)
    kv.plan(700)
    pre = KVBatch()
    keys = torch.arange(3, dtype=torch.float).view(1, 1, 3, 1)
    pre.cache.update(keys, keys, 0)
    pre.valid = torch.ones(1, 3, dtype=torch.bool)
    kv.merge(pre)
    assert (kv.row_capacity, kv.capacity, kv.generation) == (8, 704, 1)
    kv.plan(2000)
    assert kv.capacity >= 2000 and kv.generation == 2 and kv.bufs[0][0][0, 0, :3, 0].tolist() == [0, 1, 2]
    dlm = dlm_of("idlm", "llama", block_size=3)
    eng = Engine(dlm, decoder="isd", stride=3, options=EngineOptions(max_batch_size=3, static_cache=True))
    eng.generate(PROMPTS[2:3], SamplingParams(max_new_tokens=300, ignore_eos=True))
    assert eng.kv.generation == 1 and eng.kv.capacity >= 300 + len(PROMPTS[2])


def test_buckets_and_graph_eligibility():
    assert [static.batch_bucket(b) for b in (1, 2, 3, 5, 8, 9, 17, 32, 33, 65)] == [1, 2, 4, 8, 8, 16, 32, 32, 64, 96]
    assert [static.chunk_bucket(q) for q in (1, 5, 8, 9, 16, 17)] == [1, 5, 8, 16, 16, 32]
    model = make_model("llama")
    assert static.graphs_unsupported(model) is None
    dlm = dlm_of("idlm", "llama", block_size=3)
    from dlm.model.lora import LoraSettings, prepare_model_for_lora

    prepare_model_for_lora(dlm, LoraSettings(r=4, alpha=4, gated=True, target_modules="q_proj,v_proj"))
    assert static.graphs_unsupported(dlm) is None  # the gate runs sync-free inside a capture
    handle = dlm.base_model_hf.model.layers[0].register_forward_hook(lambda m, a, o: None)
    assert "forward hooks" in static.graphs_unsupported(dlm)
    handle.remove()
    eng = Engine(dlm, decoder="ar", options=EngineOptions(static_cache=True))  # CPU: never captured
    assert eng._static is not None and not eng._static.graphs and eng._static.runner is None
    assert Engine(dlm, decoder="ar")._static is None  # a CPU's default: the growing cache
    assert (
        not Engine(dlm, decoder="ar", options=EngineOptions(static_cache=False))._static
        and Engine(dlm, options=EngineOptions(static_cache=True))._static
    )
    # CUDA's default: the static step (captured); the one rule for both, read without a GPU
    assert static.static_default("cuda") and static.static_default(torch.device("cuda", 1))
    assert not static.static_default("cpu") and not static.static_default("mps")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_equal_the_uncaptured_static_step():
    dlm = dlm_of("idlm", "llama", block_size=3).to("cuda")
    p = params()
    for decoder, kw in (("ar", {}), ("isd", dict(stride=3))):
        eager = Engine(
            dlm, decoder=decoder, options=EngineOptions(max_batch_size=3, static_cache=True, cuda_graphs=False), **kw
        )
        graphed = Engine(
            dlm, decoder=decoder, options=EngineOptions(max_batch_size=3, static_cache=True, cuda_graphs=True), **kw
        )
        a = [r.token_ids for r in eager.generate(PROMPTS, p)]
        assert [r.token_ids for r in graphed.generate(PROMPTS, p)] == a
        assert graphed._static.runner.replays > 0 and graphed._static.runner.failed is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_capture_gated_adapters_and_stay_lossless():
    """A gated-LoRA model is captured (its gate runs sync-free inside the graph); greedy ISD through the graphs with
    strong random adapters gives the base model's greedy tokens, as the uncaptured static step does."""
    from dlm.model.lora import LoraSettings, prepare_model_for_lora

    dlm = dlm_of("idlm", "llama", block_size=3).to("cuda")
    p = params()
    want = [
        r.token_ids for r in Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=3)).generate(PROMPTS, p)
    ]
    prepare_model_for_lora(dlm, LoraSettings(r=4, alpha=8, gated=True, target_modules="all-linear"))
    with torch.no_grad():
        for a in dlm.gated_lora.adapters.values():
            a.B.normal_(0, 0.3)
    graphed = Engine(
        dlm, decoder="isd", stride=3, options=EngineOptions(max_batch_size=3, static_cache=True, cuda_graphs=True)
    )
    assert [r.token_ids for r in graphed.generate(PROMPTS, p)] == want
    assert graphed._static.runner.replays > 0 and graphed._static.runner.failed is None
    assert not dlm.gated_lora.sync_free  # only inside the captured forwards


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_default_is_the_captured_static_step_with_the_growing_caches_tokens():
    """On CUDA an engine with no cache setting runs the static step captured as graphs (static_default), and in
    fp32 gives the growing cache's tokens for ar, isd and an mdm sampler, through the Engine and generate()."""
    from dlm.decode import generate

    p = params()
    for objective, decoder, kw in (("idlm", "ar", {}), ("idlm", "isd", dict(stride=3)), ("mdm", "mdm", {})):
        dlm = dlm_of(objective, "llama", **({"block_size": 3} if objective == "idlm" else {})).to("cuda")
        default = Engine(dlm, decoder=decoder, options=EngineOptions(max_batch_size=3), **kw)
        assert default._static is not None and default._static.graphs, decoder
        growing = Engine(dlm, decoder=decoder, options=EngineOptions(max_batch_size=3, static_cache=False), **kw)
        want = [r.token_ids for r in growing.generate(PROMPTS, p)]
        assert [r.token_ids for r in default.generate(PROMPTS, p)] == want, decoder
        assert default._static.runner.replays > 0 and default._static.runner.failed is None
    assert [r.token_ids for r in generate(dlm, PROMPTS, "mdm", p, options=EngineOptions(max_batch_size=3))] == want
