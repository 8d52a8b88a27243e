"""The token-id engine: AR parity with transformers generate, join/leave, stops, seeds, streaming, errors."""

import pytest
import torch

from dlm import convert_ar_to_dlm
from dlm.decode.engine import Engine, KVBatch
from dlm.decode.options import EngineOptions
from dlm.decode.sampling import SamplingParams
from dlm.errors import DLMError
from dlm.model.masks import decode_mask
from dlm.testing import make_model, make_tokenizer

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]


pytestmark = pytest.mark.usefixtures("one_thread")


def idlm(arch="llama", seed=1, block_size=3):
    dlm = convert_ar_to_dlm(make_model(arch, seed=seed), "idlm", block_size=block_size, tokenizer=make_tokenizer())
    dlm.model.generation_config.eos_token_id = None  # compare fixed-length outputs
    return dlm


def hf_greedy(model, prompts, k, batched=False):
    """transformers generate(do_sample=False): one by one, or as one left-padded batch."""
    if not batched:
        return [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=k, pad_token_id=3)[0, len(p) :].tolist()
            for p in prompts
        ]
    width = max(map(len, prompts))
    ids = torch.tensor([[3] * (width - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=att, do_sample=False, max_new_tokens=k, pad_token_id=3)
    return [row[width:].tolist() for row in out]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_ar_greedy_equals_transformers_generate(arch):
    dlm = idlm(arch)
    k = 16
    params = SamplingParams(max_new_tokens=k, ignore_eos=True)
    single = hf_greedy(dlm.model, PROMPTS, k)
    assert Engine(dlm, decoder="ar").generate([PROMPTS[0]], params)[0].token_ids == single[0]  # batch 1
    # a batch with different prompt lengths, fewer slots than prompts (requests join and leave)
    res = Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=3)).generate(PROMPTS, params)
    assert [r.token_ids for r in res] == single
    assert hf_greedy(dlm.model, PROMPTS, k, batched=True) == single
    assert all(r.stats.forwards == k and r.stats.tpf == 1.0 for r in res)


def test_plain_hf_model_runs_ar():
    model = make_model("llama", seed=2)
    model.generation_config.eos_token_id = None
    res = Engine(model, make_tokenizer(), decoder="ar").generate(PROMPTS[:2], SamplingParams(8, ignore_eos=True))
    assert [r.token_ids for r in res] == hf_greedy(model, PROMPTS[:2], 8)
    assert isinstance(res[0].text, str)


def test_decode_mask_and_kv_compaction():
    valid = torch.tensor([[True, False, True], [False, True, True]])
    m = decode_mask(valid, 2)
    assert m.shape == (2, 1, 2, 5)
    assert m[0, 0].tolist() == [[True, False, True, True, False], [True, False, True, True, True]]
    kv = KVBatch()
    kv.valid = valid.clone()
    keys = torch.arange(2 * 3, dtype=torch.float).view(2, 1, 3, 1)
    kv.cache.update(keys, keys.clone(), 0)
    kv.compact()
    assert kv.valid.tolist() == [[True, True], [True, True]]
    assert kv.cache.layers[0].keys.view(2, 2).tolist() == [[0.0, 2.0], [4.0, 5.0]]


def test_growing_cache_equals_concatenation(monkeypatch):
    """The in-place cache layer holds exactly what transformers' torch.cat layer holds through every KVBatch
    operation: appends, tail crops, selects, merges, compaction (each re-buffering or writing in place)."""
    from dlm.decode import engine as eng_mod

    g = torch.Generator().manual_seed(0)

    def run(growing: bool):
        monkeypatch.setattr(eng_mod, "GROWING_CACHE", growing)
        torch.manual_seed(1)
        kv, snapshots = KVBatch(), []

        def extend(batch, t, keep_from):
            for layer in range(2):
                k = torch.randn(batch, 2, t, 3, generator=g)
                kv.cache.update(k, k + 1, layer)
            keep = torch.zeros(batch, t, dtype=torch.bool)
            keep[:, :keep_from] = True
            kv.after_extend(keep)

        extend(2, 5, 5)
        for step in range(12):
            extend(2, 1 + step % 3, 1 + step % 2)  # ISD-like: some appended slots become holes, tails are cropped
            if step == 4:
                other = KVBatch()
                for layer in range(2):
                    k = torch.randn(1, 2, 3, 3, generator=g)
                    other.cache.update(k, k * 2, layer)
                other.after_extend(torch.ones(1, 3, dtype=torch.bool))
                kv.merge(other)
                kv.select(torch.tensor([0, 2]))
            if step == 8:
                kv.compact()
            snapshots.append([(layer.keys.clone(), layer.values.clone()) for layer in kv.cache.layers])
        return snapshots, kv.valid

    state = g.get_state()
    ref, ref_valid = run(False)
    g.set_state(state)
    got, got_valid = run(True)
    assert torch.equal(ref_valid, got_valid)
    for a, b in zip(ref, got):
        for (ka, va), (kb, vb) in zip(a, b):
            assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert eng_mod.KVBatch().cache.layer_class_to_replicate.__name__ == "GrowingLayer"


def test_growing_cache_appends_and_tail_crops_write_in_place():
    """Appending to the in-place layer and cropping its tail (ISD's rejected drafts) keep the one buffer: no copy
    of the cache until it is full, then one doubling; a crop from the left re-buffers once."""
    kv = KVBatch()
    g = torch.Generator().manual_seed(0)
    kept = []

    def extend(t, keep_from):
        k = torch.randn(1, 2, t, 3, generator=g)
        kv.cache.update(k, k + 1, 0)
        keep = torch.zeros(1, t, dtype=torch.bool)
        keep[:, :keep_from] = True
        kv.after_extend(keep)
        kept.append(k[:, :, :keep_from])

    extend(4, 4)
    layer = kv.cache.layers[0]
    start, cap = layer.keys.data_ptr(), layer._buf[0].shape[2]
    for step in range(20):
        extend(3, 1 + step % 3)  # the tail of a chunk cropped in two steps of three
        assert layer.keys.data_ptr() == start and layer._buf[0].shape[2] == cap
        # the crop leaves the layer's own views of its buffer (the next append finds them without checks)
        assert layer.keys is layer._buf[2] and layer.values is layer._buf[3]
        assert torch.equal(layer.keys, torch.cat(kept, 2)) and torch.equal(layer.values, torch.cat(kept, 2) + 1)
    n = layer.keys.shape[2]
    extend(cap - n + 1, cap - n + 1)  # one slot past the buffer: one doubling, the live keys kept
    assert layer._buf[0].shape[2] >= 2 * (cap + 1) and torch.equal(layer.keys, kv.cache.layers[0].keys)
    kv.valid[:, 0] = False
    kv.after_extend(torch.ones(1, 0, dtype=torch.bool))  # a dead head: cropped from the left
    head = layer.keys.data_ptr()
    extend(1, 1)
    assert layer.keys.data_ptr() != head and layer.keys.shape[2] == kv.valid.shape[1]


def test_holes_and_compaction_do_not_change_outputs():
    dlm = idlm("qwen3")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ref = [
        r.token_ids
        for r in Engine(dlm, decoder="isd", stride=3, options=EngineOptions(max_batch_size=1)).generate(PROMPTS, params)
    ]
    eng = Engine(dlm, decoder="isd", stride=3, options=EngineOptions(max_batch_size=4, compact_threshold=0.0))
    assert [r.token_ids for r in eng.generate(PROMPTS, params)] == ref


def test_stop_tokens_strings_max_tokens_and_streaming():
    dlm = idlm("llama")
    tok = dlm.tokenizer
    free = Engine(dlm, decoder="ar").generate([PROMPTS[0]], SamplingParams(12, ignore_eos=True))[0].token_ids
    stop = free[4]
    first = free.index(stop)
    streamed = []
    res = Engine(dlm, decoder="ar").generate(
        [PROMPTS[0]],
        SamplingParams(12, stop_token_ids=[stop]),
        on_tokens=lambda rid, new, done: streamed.append((list(new), done)),
    )[0]
    assert res.token_ids == free[: first + 1] and res.finish_reason == "stop"  # the stop token is kept in ids
    assert (
        [t for new, _ in streamed for t in new] == res.token_ids
        and streamed[-1][1]
        and not any(done for _, done in streamed[:-1])
    )
    # stop strings cut the text; max_new_tokens is respected exactly, also by ISD (which commits several)
    text = tok.decode(free, skip_special_tokens=True)
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    r = Engine(dlm, decoder="ar").generate([PROMPTS[0]], SamplingParams(12, stop_strings=[needle], ignore_eos=True))[0]
    assert needle not in r.text and text.startswith(r.text) and r.finish_reason == "stop"
    for k in (1, 2, 5):
        r = Engine(dlm, decoder="isd", stride=4).generate([PROMPTS[1]], SamplingParams(k, ignore_eos=True))[0]
        assert len(r.token_ids) == k and r.finish_reason == "length"


def test_seeded_sampling_reproducible_and_independent_of_neighbours():
    dlm = idlm("llama")
    p = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
    alone = Engine(dlm, decoder="ar").generate([PROMPTS[0]], p)[0].token_ids
    others = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in range(3)]
    mixed = Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=4)).generate(
        PROMPTS[1:] + [PROMPTS[0]], others + [p]
    )
    assert mixed[-1].token_ids == alone
    other_seed = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=8, ignore_eos=True)
    assert Engine(dlm, decoder="ar").generate([PROMPTS[0]], other_seed)[0].token_ids != alone


def test_mask_token_never_emitted():
    dlm = idlm("llama")
    with torch.no_grad():  # make the mask token the model's favourite by far
        dlm.model.lm_head.weight[dlm.mask_token_id] = dlm.model.lm_head.weight.sum(0) * 100
    for dec, p in [
        ("ar", SamplingParams(8, ignore_eos=True)),
        ("isd", SamplingParams(8, temperature=1.0, seed=0, ignore_eos=True)),
    ]:
        for r in (
            Engine(dlm, decoder=dec, stride=2).generate(PROMPTS, p)
            if dec == "isd"
            else Engine(dlm, decoder=dec).generate(PROMPTS, p)
        ):
            assert dlm.mask_token_id not in r.token_ids and len(r.token_ids) == 8


def test_clear_errors():
    dlm = idlm("llama")  # max_position_embeddings = 512
    with pytest.raises(DLMError, match="does not fit the model's context"):
        Engine(dlm, decoder="ar").add(list(range(5, 300)) * 2)
    with pytest.raises(DLMError, match="max-new-tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(DLMError, match="top-p"):
        SamplingParams(top_p=0.0)
    # generation stops at the end of the context instead of running past it
    r = Engine(dlm, decoder="isd", stride=3).generate(
        [list(range(5, 300)) + list(range(5, 210))], SamplingParams(50, ignore_eos=True)
    )[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 512 - 500  # positions 500..511


def gqa_parity(device="cpu"):
    """Logits of transformers' sdpa and of dlm_sdpa for a 3-token chunk and a 1-token step on a cache with holes."""
    from transformers import DynamicCache

    from dlm.decode import attention
    from dlm.model.convert import cache_kw

    model = make_model("llama", heads=4, kv_heads=2).to(device)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    prefix = torch.randint(5, 300, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    valid = torch.ones(2, 9, dtype=torch.bool, device=device)
    valid[0, 2:4] = False  # holes (rejected drafts / padding)
    kw = cache_kw(model)
    outs = {}
    for impl in ("sdpa", "dlm_sdpa"):
        if impl == "dlm_sdpa":
            assert attention.use_for_decoding(model)
        else:
            model.set_attn_implementation("sdpa")
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=prefix, use_cache=True, **{kw: cache})
            res = []
            for chunk in ([[7, 8, 9], [10, 11, 12]], [[13], [14]]):
                ids = torch.tensor(chunk, device=device)
                T, K = ids.shape[1], cache.get_seq_length()
                pos = torch.arange(K, K + T, device=device)[None].expand(2, T)
                extra = torch.ones(2, K - 9, dtype=torch.bool, device=device)
                mask = decode_mask(torch.cat([valid, extra], 1), T)
                res.append(
                    model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, **{kw: cache}).logits
                )
        outs[impl] = res
    return outs["sdpa"], outs["dlm_sdpa"]


@pytest.mark.parametrize("cpu_enable_gqa", [True, False])
def test_gqa_decode_attention_equals_sdpa(monkeypatch, cpu_enable_gqa):
    """dlm_sdpa (no repeated KV cache for masked chunks) gives transformers' sdpa logits, for a chunk of 3 tokens
    on a cache with holes and for a single masked token, in both of its forms (enable_gqa / packed queries)."""
    from dlm.decode import attention

    monkeypatch.setattr(attention, "CPU_ENABLE_GQA", cpu_enable_gqa)
    ref, got = gqa_parity("cpu")
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_generate_progress_counts_each_finished_prompt():
    """``generate(progress=bar)`` (dlm generate over a prompts file, eval's generation tasks) tells the bar of each
    request as it finishes, not all at the end: prompts with fewer new tokens finish first."""
    from dlm.decode import generate

    class Bar:
        def __init__(self):
            self.updates = []

        def update(self, n):
            self.updates.append(n)

    model, bar = make_model("llama"), Bar()
    lengths = [1, 3, 6, 9]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in lengths]
    out = generate(model, [[5, 6, 7]] * 4, "ar", params, options=EngineOptions(max_batch_size=4), progress=bar)
    assert [len(r.token_ids) for r in out] == lengths
    assert sum(bar.updates) == 4 and len(bar.updates) == 4  # one finished request per update here


def test_progress_bars_only_on_a_terminal_and_not_quiet(monkeypatch):
    import sys

    from dlm.progress import wanted

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert not wanted() and not wanted(quiet=True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert wanted() and not wanted(quiet=True)


def test_ar_batched_greedy_step_equals_row_by_row(monkeypatch):
    """The AR decoder's one argmax over all greedy rows of a step gives the row-by-row tokens (greedy rows beside
    sampled rows, which keep their own generators), never the mask token even where it has the top logit."""
    from dlm.decode.ar import ARDecoder
    from dlm.decode.engine import Decoder

    dlm = idlm()
    with torch.no_grad():
        dlm.model.lm_head.weight[dlm.mask_token_id] *= 50  # the mask token would win many argmaxes
    params = [
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        SamplingParams(max_new_tokens=9, ignore_eos=True),
    ]
    calls = []
    batched = ARDecoder.consume_batch

    def counted(self, engine, rows, logits, lengths):
        calls.append(len(rows))
        return batched(self, engine, rows, logits, lengths)

    monkeypatch.setattr(ARDecoder, "consume_batch", counted)
    got = [
        r.token_ids
        for r in Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=4)).generate(PROMPTS, params)
    ]
    assert max(calls) == 4
    monkeypatch.setattr(ARDecoder, "consume_batch", Decoder.consume_batch)
    want = [
        r.token_ids
        for r in Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=4)).generate(PROMPTS, params)
    ]
    assert got == want
    assert all(dlm.mask_token_id not in t for t in got)


@pytest.mark.parametrize("decoder", ["ar", "isd"])
def test_identical_prompts_are_prefilled_once(decoder):
    """``n`` choices of one prompt (or a prompt sent several times) joining together: one prefill row per distinct
    prompt, its KV and logits copied; every request's output is what it gets alone (greedy and seeded sampling)."""
    dlm = idlm("llama")
    prompts = [PROMPTS[0], PROMPTS[0], [30, 31, 32, 33, 34], PROMPTS[0], PROMPTS[1]]
    params = [
        SamplingParams(9, ignore_eos=True),
        SamplingParams(9, ignore_eos=True, temperature=1.0, seed=3),
        SamplingParams(9, ignore_eos=True),
        SamplingParams(9, ignore_eos=True, temperature=1.0, seed=4, prompt_logprobs=1),
        SamplingParams(9, ignore_eos=True),
    ]
    kw = {"stride": 3} if decoder == "isd" else {}
    eng = Engine(dlm, decoder=decoder, options=EngineOptions(max_batch_size=8), **kw)
    rows_fed = []
    forward = eng._forward

    def spy(ids, *a, **k):
        rows_fed.append(tuple(ids.shape))
        return forward(ids, *a, **k)

    eng._forward = spy
    got = eng.generate(prompts, params)
    prefills = [s for s in rows_fed if s[1] >= 5]  # the prompts of length 5 (+ ISD's masks) in one forward
    assert prefills[0][0] == 2  # two distinct prompts of length 5, four requests
    for p, sp, r in zip(prompts, params, got):
        alone = Engine(dlm, decoder=decoder, **kw).generate([p], sp)[0]
        assert r.token_ids == alone.token_ids
    assert got[3].prompt_logprobs is not None and len(got[3].prompt_logprobs) == len(PROMPTS[0])


@pytest.mark.parametrize("decoder,static", [("ar", False), ("isd", False), ("isd", True)])
def test_prefix_cache_reuses_a_prompts_kv_with_the_same_output(decoder, static):
    """A prompt that starts like one prefilled before feeds only its new tokens (the cached KV first), and every
    request's output is what it gets without the cache (greedy and seeded); eviction keeps the token budget."""
    from dlm.decode.prefix import PrefixCache

    dlm = idlm("llama")
    base = list(range(40, 80))  # 40 shared tokens (a system prompt, a document, a conversation so far)
    prompts = [base + [90, 91], base + [92, 93, 94, 95], base[:30] + [96], base + [90, 91, 97], [5, 6, 7]]
    params = [
        SamplingParams(8, ignore_eos=True),
        SamplingParams(8, ignore_eos=True, temperature=1.0, seed=5),
        SamplingParams(8, ignore_eos=True),
        SamplingParams(8, ignore_eos=True, logprobs=1),
        SamplingParams(8, ignore_eos=True),
    ]
    kw = {"stride": 3} if decoder == "isd" else {}
    want = [Engine(dlm, decoder=decoder, **kw).generate([p], sp)[0] for p, sp in zip(prompts, params)]
    eng = Engine(
        dlm, decoder=decoder, options=EngineOptions(max_batch_size=2, prefix_cache=1000, static_cache=static), **kw
    )
    fed = []
    forward = eng._forward

    def spy(ids, *a, **k):
        fed.append(ids.shape[1])
        return forward(ids, *a, **k)

    eng._forward = spy
    got = eng.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
    assert abs(got[3].logprobs[0].logprob - want[3].logprobs[0].logprob) < 1e-4
    # each prompt's KV but its last token is stored: prompt 1 reuses the 40 shared tokens of prompt 0, prompt 2 its
    # 30, prompt 3 at least the 41 stored of prompt 0 (42 where prompt 0's finished answer is stored already); their
    # prefills feed only the rest (ISD: its 2 masks after them, in a forward of their own over the prompt's KV)
    assert eng.prefix.hits == 3 and eng.prefix.reused_tokens >= 40 + 30 + 41
    assert {42, 4, 1, 3} <= set(fed)
    assert (2 in fed) == (decoder == "isd")
    cache = PrefixCache(max_tokens=60, min_tokens=4)
    kv = [(torch.zeros(1, 1, 50, 2), torch.zeros(1, 1, 50, 2))]
    cache.store(list(range(31)), kv)
    cache.store(list(range(100, 131)), kv)  # 30 + 30 tokens: both fit
    assert len(cache) == 2 and cache.lookup(list(range(10)) + [7])[0] == 10
    cache.store(list(range(200, 211)), kv)  # 70 > 60: the least recently used (the second) goes
    assert len(cache) == 2 and cache.lookup(list(range(100, 120))) is None and cache.stored_tokens == 40


def spelled_kv(tokens, layers=2):
    """KV that spells its tokens: per layer, keys[..., j, :] = (token j, layer) and values the negatives, so a
    lookup's answer shows which tokens' KV it joined, in which order."""
    t = torch.tensor(tokens, dtype=torch.float32)
    out = []
    for layer in range(layers):
        k = torch.stack([t, torch.full_like(t, layer)], dim=-1)[None, None].expand(1, 2, -1, -1).clone()
        out.append((k, -k))
    return out


def test_prefix_cache_shares_the_kv_of_shared_beginnings():
    """Prompts that start the same share the KV of that start: a conversation's turns, each stored whole, take the
    room of the longest; two branches the room of their common part and each one's rest. A lookup anywhere along
    them answers the longest stored prefix with exactly those tokens' KV, joined across the tree's nodes."""
    from dlm.decode.prefix import PrefixCache

    cache = PrefixCache(max_tokens=1000, min_tokens=4)
    turn1 = list(range(100, 130))
    turn2 = turn1 + list(range(200, 220))
    turn3 = turn2 + list(range(300, 340))
    for t in (turn1, turn2, turn3):
        cache.store(t, spelled_kv(t))
    assert cache.stored_tokens == len(turn3) - 1 and len(cache) == 1
    branch = turn1[:20] + list(range(400, 425))  # leaves turn 1 after 20 tokens
    cache.store(branch, spelled_kv(branch))
    assert cache.stored_tokens == len(turn3) - 1 + 24 and len(cache) == 2
    for prompt, c in [
        (turn3 + [1, 2], len(turn3) - 1),  # the longest stored (each stored prompt but its last token), and more
        (turn2[:45] + [7], 45),  # inside the second turn's run
        (turn1[:20] + [400, 401, 402, 9], 23),  # along the branch
        (branch, len(branch) - 1),  # itself: all but its last token (the prefill feeds one)
        (turn1[:3] + [5], None),  # under min_tokens
        ([1] + turn1, None),
    ]:
        got = cache.lookup(prompt)
        if c is None:
            assert got is None, prompt
            continue
        assert got[0] == c, prompt
        for (k, v), (wk, wv) in zip(got[1], spelled_kv(prompt[:c])):
            assert torch.equal(k[:, :, :c], wk) and torch.equal(v[:, :, :c], wv)
    # beyond the budget the least recently used leaves go, one by one; a shared start stays while a branch uses it
    small = PrefixCache(max_tokens=90, min_tokens=4)
    small.store(turn3, spelled_kv(turn3))  # 89 tokens
    small.store(branch, spelled_kv(branch))  # + 24 > 90: turn 3 after the shared 20 goes, not the newer branch
    assert small.stored_tokens == 20 + 24 and len(small) == 1
    assert small.lookup(turn3 + [1])[0] == 20 and small.lookup(branch)[0] == len(branch) - 1
    small.store(turn2, spelled_kv(turn2))  # + 29 (after the shared 20): 73
    assert small.lookup(branch + [5])[0] == len(branch) - 1  # the branch is used again, turn 2 is not
    other = list(range(500, 531))
    small.store(other, spelled_kv(other))  # + 30 > 90: turn 2's own 29 go
    assert small.stored_tokens == 20 + 24 + 30 and len(small) == 2
    assert small.lookup(turn2 + [1])[0] == 20 and small.lookup(other)[0] == 30
    got = small.lookup(branch)
    assert got[0] == 44 and all(torch.equal(k, w[0]) for (k, _), w in zip(got[1], spelled_kv(branch[:44])))


@pytest.mark.parametrize("decoder", ["ar", "isd"])
def test_prefix_cache_keeps_a_finished_answer_for_the_next_turn(decoder):
    """A finished request's prompt and output go into the prefix cache (from its live slots: ISD's rejected drafts
    and masks left holes), so a next turn that repeats them feeds only what follows, with the same output."""
    dlm = idlm("llama")
    kw = {"stride": 3} if decoder == "isd" else {}
    p1 = list(range(40, 60))
    eng = Engine(dlm, decoder=decoder, options=EngineOptions(max_batch_size=2, prefix_cache=1000), **kw)
    # beside a longer prompt, p1's row is left-padded with holes in the batch cache
    first = eng.generate([p1, list(range(100, 135))], SamplingParams(12, ignore_eos=True))[0].token_ids
    p2 = p1 + first + [90, 91, 92]
    hits = eng.prefix.reused_tokens
    second = eng.generate([p2], SamplingParams(8, ignore_eos=True))[0]
    assert eng.prefix.reused_tokens - hits == len(p1) + len(first) - 1  # all but the answer's last token
    assert second.stats.cached_tokens == len(p1) + len(first) - 1
    alone = Engine(dlm, decoder=decoder, **kw).generate([p2], SamplingParams(8, ignore_eos=True))[0]
    assert second.token_ids == alone.token_ids


def test_engine_options_are_one_object_checked_once_and_loose_keywords_are_refused_by_name(tmp_path):
    """The engine's settings travel as one EngineOptions (Engine, generate, load_engine, the server's rebuild): bad
    values fail when it is built, naming the flag; the old loose keywords are refused with the new spelling."""
    from dlm.decode import generate
    from dlm.eval import EvalSettings, run_eval
    from dlm.serve.loader import load_engine

    for bad, flag in [
        ({"max_batch_size": 0}, "--batch-size / --max-batch-size"),
        ({"max_batch_size": 2.0}, "--batch-size"),
        ({"threads": "many"}, "--threads"),
        ({"threads": 0}, "--threads"),
        ({"prefix_cache": -1}, "--prefix-cache-tokens"),
        ({"static_cache": "yes"}, "static_cache"),
        ({"compact_threshold": 1.5}, "compact_threshold"),
    ]:
        with pytest.raises(DLMError, match=flag):
            EngineOptions(**bad)
    assert EngineOptions(threads="AUTO").threads == "auto" and EngineOptions(threads="3").threads == 3
    assert EngineOptions(threads="torch").threads is None
    model = idlm()
    with pytest.raises(DLMError, match=r"options=EngineOptions\(max_batch_size=\.\.\.\), not max_batch_size="):
        Engine(model, decoder="ar", max_batch_size=2)
    with pytest.raises(DLMError, match=r"EngineOptions\(max_batch_size=\.\.\., prefix_cache=\.\.\.\)"):
        generate(model, [[5, 6]], "ar", batch_size=2, prefix_cache=16)
    with pytest.raises(DLMError, match=r"options=EngineOptions\(threads=\.\.\.\)"):
        load_engine(str(tmp_path), "ar", threads=1)  # before anything loads
    with pytest.raises(DLMError, match="takes an EngineOptions"):
        Engine(model, decoder="ar", options={"max_batch_size": 2})
    with pytest.raises(DLMError, match=r"EvalSettings\(limit=\.\.\.\)"):
        run_eval(model, "lambada", limit=2)
    with pytest.raises(DLMError, match="--limit"):
        EvalSettings(limit=-1)
    # the options reach the engine: batch 2 runs two rows at once, and the engine keeps the object it was given
    opts = EngineOptions(max_batch_size=2, prefix_cache=64)
    eng = Engine(model, decoder="ar", options=opts)
    assert eng.options is opts and eng.max_batch_size == 2 and eng.prefix is not None
    for p in ([5, 6, 7], [8, 9], [10, 11, 12, 13]):
        eng.add(p, SamplingParams(max_new_tokens=3, ignore_eos=True))
    eng.step()
    assert len(eng.rows) == 2 and len(eng.waiting) == 1


def test_isd_prefill_gives_the_prompt_ars_kv_bit_for_bit():
    """ISD feeds its first masks after the prompt in a forward of their own, so the prompt's KV is the one AR's
    prefill makes, bit for bit, whatever the prompt's length: in one forward over prompt and masks the prompt rows'
    attention was computed for the longer length (SDPA: other last bits for some lengths; under int8 activations
    other answers on 3 of 96 held-out prompts)."""
    dlm = idlm("llama")
    for n in range(20, 44):
        prompt = [5 + (7 * i) % 90 for i in range(n)]
        kvs = []
        for decoder, kw in (("ar", {}), ("isd", {"stride": 3})):
            eng = Engine(dlm, decoder=decoder, **kw)
            eng.add(prompt, SamplingParams(4, ignore_eos=True))
            eng.step()  # the prefill
            kvs.append([(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in eng.kv.cache.layers])
            eng.close()
        for (ka, va), (ki, vi) in zip(*kvs):
            assert torch.equal(ka, ki) and torch.equal(va, vi), n
