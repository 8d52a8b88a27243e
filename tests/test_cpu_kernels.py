"""The decoding engine's CPU kernels (dlm.decode.cpu): every instruction set this CPU runs, the choice at attach."""

from pathlib import Path

import pytest
import torch
from torch import nn

from dlm.decode import cpu
from dlm.decode.cpu import packing, runtime
from dlm.decode.cpu import stack as cpu_stack
from dlm.decode.cpu.adapters import AdapterDelta
from dlm.decode.cpu.modules import packed_of
from dlm.decode.cpu.packing import Packed
from dlm.decode.options import EngineOptions, parse_threads
from dlm.testing import CallCounter

ext = cpu.extension()
needs_kernel = pytest.mark.skipif(ext is None, reason="the CPU kernels could not be built here (no compiler?)")
ISAS = ext.isas().split(",") if ext is not None else []


@pytest.fixture(params=ISAS)
def each_isa(request):
    """Run the test once per instruction set this CPU runs (the native one and every fallback)."""
    cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa("auto")


@needs_kernel
@pytest.mark.parametrize("n,k", [(96, 64), (100, 37), (7, 5), (1536, 576)])
def test_kernel_matches_f_linear_and_is_row_invariant(n, k, each_isa):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = ext.pack(w, False)
    assert torch.equal(ext.pack(w.t().contiguous(), True), packed)  # Conv1D layout packs to the same blocks
    alone = ext.linear(torch.randn(1, k, generator=torch.Generator().manual_seed(5)), packed, n, b, None)
    for m in (1, 2, 3, 8, 9, 17, cpu.MAX_ROWS):
        x = torch.randn(m, k, generator=g)
        x[m // 2] = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
        y = ext.linear(x, packed, n, b, None)
        torch.testing.assert_close(y, nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
        # one row's output does not depend on how many rows share the call, nor on them: bit for bit
        assert torch.equal(y[m // 2], alone[0])
        assert torch.equal(ext.linear(x, packed, n, None, None) + b, y)  # the bias is one add after the sum


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))


@needs_kernel
def test_attach_routes_only_inside_active_without_grad():
    net = _net()
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        stock = net(x)
    assert cpu.attach(net) and cpu.attach(net)  # idempotent
    with torch.no_grad():
        assert torch.equal(net(x), stock)  # outside active(): the stock layers, bit for bit
        with cpu.active():
            fast = net(x)
        with cpu.active(False):
            assert torch.equal(net(x), stock)
    torch.testing.assert_close(fast, stock, rtol=1e-5, atol=1e-5)
    with cpu.active():
        y = net(x)  # gradients on: the stock layers (the kernel has no backward)
        assert y.requires_grad and torch.equal(y.detach(), stock)
        with torch.inference_mode():
            z = net(x)
    torch.testing.assert_close(z, stock, rtol=1e-5, atol=1e-5)
    # more rows than MAX_ROWS: the stock layer
    big = torch.randn(cpu.MAX_ROWS + 1, 24)
    with torch.no_grad(), cpu.active():
        assert torch.equal(net(big), _net()(big))
    cpu.detach(net)
    assert "forward" not in net[0].__dict__


@needs_kernel
def test_stamps_see_in_place_updates_and_swapped_data():
    """A kept decode_stack plan is taken while stamps_equal(tensors, stamps(tensors)) holds: each tensor's in-place
    version and data address; an in-place update, a ``.data`` swap, another tensor or another count breaks it."""
    ts = [torch.randn(5) for _ in range(40)] + [nn.Parameter(torch.randn(3, 4))]
    s = ext.stamps(ts)
    assert s.dtype == torch.long and s.shape == (2 * len(ts),)
    assert ext.stamps_equal(ts, s)
    ts[17].add_(1.0)  # an optimizer step's kind of update
    assert not ext.stamps_equal(ts, s)
    s = ext.stamps(ts)
    with torch.no_grad():
        ts[-1].data = torch.zeros(3, 4)  # same version, other data
    assert not ext.stamps_equal(ts, s)
    s = ext.stamps(ts)
    assert not ext.stamps_equal([*ts[:3], torch.randn(5), *ts[4:]], s)
    assert not ext.stamps_equal(ts[:-1], s)
    assert ext.stamps_equal(ts, s)
    with torch.inference_mode():
        frozen = torch.randn(2)
    with pytest.raises(RuntimeError):  # inference tensors keep no version: no plan is kept for them
        ext.stamps([frozen])


@needs_kernel
def test_greedy_scan_gives_torchs_index_on_every_isa(each_isa, monkeypatch):
    """argmax_no_mask on float32 CPU logits takes the kernels' scan (argmax_skip) where they are loaded: the index
    torch's own path gives - the first of tied maxima, never the mask token's column, the first NaN, the first
    other column where every other value is -inf - for rows of any vocabulary size (vector blocks and scalar ends),
    batch shapes, strided rows and 1-D logits; greedy_with_prob gives the same tokens and their masked-softmax
    probabilities."""
    from dlm.decode import sampling

    g = torch.Generator().manual_seed(3)
    cases = []
    for v in (1, 2, 5, 16, 17, 33, 64, 65, 1000, 4099):
        for trial in range(7):
            x = torch.randn(3, v, generator=g)
            if trial == 1:
                x = torch.randint(0, 3, (3, v), generator=g).float()  # ties everywhere
            elif trial == 2:
                x[1, v // 3] = float("nan")
                x[2, -1] = float("nan")
            elif trial == 3:
                x[:] = float("-inf")
            elif trial == 4:
                x[0] = 5.0
            elif trial == 5:
                x[:, ::2] = float("-inf")
            elif trial == 6:
                x[:, -1] = 50.0  # the largest in the scalar end
            for m in (None, 0, 1, v // 2, v - 1, v + 3):
                if v > 1 or m != 0:  # (a vocabulary of the mask alone has no greedy token)
                    cases.append((x, m))
    wide = torch.randn(4, 2, 3, 1000, generator=g)
    cases += [(wide, 7), (wide[:, 1], 999), (wide[0, 0, 0], 0), (wide[..., 1:999:1], 500)]
    assert runtime.STATE.ops is not None or cpu.attach(_net())
    want = []
    with monkeypatch.context() as mp:
        mp.setattr(runtime.STATE, "ops", None)  # torch's path
        want = [sampling.argmax_no_mask(x, m) for x, m in cases]
        want_p = [sampling.greedy_with_prob(x, m) for x, m in cases]
    counting = CallCounter(runtime.STATE.ops)
    monkeypatch.setattr(runtime.STATE, "ops", counting)
    for (x, m), w, (wd, wp) in zip(cases, want, want_p):
        got = sampling.argmax_no_mask(x, m)
        assert got.dtype == torch.long and torch.equal(got, w), (x.shape, m)
        # with each token its probability under the masked softmax (NaN where that has none)
        d, p = sampling.greedy_with_prob(x, m)
        assert torch.equal(d, wd) and p.dtype == torch.float32
        torch.testing.assert_close(p, wp, rtol=2e-6, atol=1e-7, equal_nan=True)
    assert counting.calls.get("argmax_skip", 0) == counting.calls.get("argmax_skip_prob", 0) == len(cases)


@needs_kernel
def test_packed_copy_follows_in_place_weight_updates():
    net = _net()
    cpu.attach(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    x = torch.randn(4, 24)
    net(x).pow(2).sum().backward()
    opt.step()  # in place: the packed copy is now stale and must be rebuilt at the next call
    with torch.no_grad():
        ref = nn.functional.linear(
            nn.functional.relu(nn.functional.linear(x, net[0].weight, net[0].bias)), net[2].weight
        )
        with cpu.active():
            got = net(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_off_switch(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "0")
    net = _net()
    assert not cpu.attach(net)
    assert "forward" not in net[0].__dict__


def test_not_for_other_dtypes():
    net = _net().to(torch.bfloat16)
    assert not cpu.attach(net)


@needs_kernel
def test_gated_adapters_and_conv1d_through_the_kernel(tiny_model_dir):
    """A gated-LoRA GPT-2 (Conv1D layers, biases) gives the same logits through the kernel as through BLAS, the
    mask rows' adapter deltas included."""
    from dlm.model.convert import convert_ar_to_dlm
    from dlm.model.lora import LoraSettings, prepare_model_for_lora

    dlm = convert_ar_to_dlm(tiny_model_dir("gpt2"), "idlm", block_size=2)
    prepare_model_for_lora(dlm, LoraSettings(r=4, alpha=8, gated=True))
    with torch.no_grad():
        for a in dlm.gated_lora.adapters.values():
            a.B.normal_(0, 0.1)
    dlm.eval()
    ids = torch.randint(5, 90, (2, 7))
    ids[:, -2:] = dlm.mask_token_id
    with torch.no_grad():
        ref = dlm(input_ids=ids).logits
        ref1 = dlm(input_ids=ids[:1]).logits  # batch 1: the masks are one run of rows (the in-place delta path)
        assert cpu.attach(dlm)
        fast = dlm.gated_lora.fast_delta
        assert isinstance(fast, AdapterDelta)
        calls = []
        dlm.gated_lora.fast_delta = lambda *a: calls.append(1) or fast(*a)
        with cpu.active():
            got = dlm(input_ids=ids).logits
            got1 = dlm(input_ids=ids[:1]).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got1, ref1, rtol=1e-4, atol=1e-4)
    assert len(calls) == len(dlm.gated_lora.adapters)  # every adapter of the batch-1 forward took the kernel
    dlm.gated_lora.fast_delta = fast
    cpu.detach(dlm)
    assert dlm.gated_lora.fast_delta is None


@needs_kernel
def test_engine_decodes_through_the_kernel_and_leaves_the_model_stock_outside(tiny_model_dir):
    """The engine routes its own forwards through the kernel; the same model called directly (e.g. by
    transformers' generate, the baseline the benchmarks compare with) still runs the stock layers, bit for bit."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import load_any

    model = load_any(tiny_model_dir("llama"))
    ids = torch.randint(5, 90, (1, 9))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    engine = Engine(model, decoder="ar")
    assert engine._cpu_kernel
    seen = []
    lm_head = model.model.get_output_embeddings() if hasattr(model, "model") else model.get_output_embeddings()
    stock = lm_head.__dict__["forward"]
    lm_head.forward = lambda x: seen.append(runtime.STATE.depth) or stock(x)
    out = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4, temperature=0.0))[0]
    lm_head.forward = stock
    assert len(out.token_ids) == 4 and seen and all(seen)  # every engine forward ran inside active()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)


@needs_kernel
def test_rotary_and_rmsnorm_fused_exactly_where_they_match_the_model(each_isa):
    """Inside active() a Llama's RMSNorm runs as one call (to float rounding: its sum of squares is added in another
    order) and the kernels' rotary embedding is bit for bit transformers' apply_rotary_pos_emb, which attach() does
    not rebind; outside active(), with gradients, or for a norm that is not Llama's, the model's own code."""
    from transformers.models.llama import modeling_llama as ml

    from dlm.testing import make_model

    model = make_model("llama", hidden=64, heads=4, kv_heads=2).eval()
    ids = torch.randint(5, 90, (2, 9))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
    assert cpu.attach(model)
    assert not isinstance(ml.apply_rotary_pos_emb, runtime.KernelForward)  # no process-wide rebinding
    norms = [m for m in model.modules() if isinstance(m, ml.LlamaRMSNorm)]
    assert norms and all(runtime.patched(m) for m in norms)

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 4, 16, generator=g).transpose(1, 2)  # [B, H, T, D] views, as attention makes them
    k = torch.randn(2, 5, 2, 16, generator=g).transpose(1, 2)
    cos, sin = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    ref = ml.apply_rotary_pos_emb(q, k, cos, sin)
    with torch.no_grad(), cpu.active():
        got = ext.rope(q, cos, sin), ext.rope(k, cos, sin)
        x = torch.randn(3, 7, 64, generator=g)
        normed = norms[0](x)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    torch.testing.assert_close(normed, type(norms[0]).forward(norms[0], x), rtol=1e-5, atol=1e-6)
    with torch.no_grad(), cpu.active():
        fast = model(input_ids=ids).logits
    torch.testing.assert_close(fast, stock, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock)  # outside active(): stock, bit for bit
    with cpu.active():
        assert torch.equal(model(input_ids=ids).logits.detach(), stock)  # with gradients: stock too

    class OffsetRMSNorm(nn.Module):  # Gemma's form, w * (1 + ...): the fused norm must not take it
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)

    net = nn.Sequential(nn.Linear(64, 64), OffsetRMSNorm())
    assert cpu.attach(net)
    assert "forward" not in net[1].__dict__
    cpu.detach(model)
    assert not any("forward" in m.__dict__ for m in norms)


@needs_kernel
def test_decode_attention_matches_sdpa_and_is_query_invariant(each_isa):
    """The kernel's attention of a decode chunk (grouped-query, a bool mask with holes and a tree) equals SDPA's to
    float rounding, and each query's output is bit for bit what it gets alone (a 1-token step): the property that
    keeps greedy ISD's verify rows equal to AR steps."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    b, h, hk, t, s, d = 2, 6, 2, 8, 37, 32
    q = torch.randn(b, t, h, d, generator=g).transpose(1, 2)  # [B, H, T, D] views, as attention makes them
    kbuf = torch.randn(b, hk, s + 11, d, generator=g)  # a cache buffer with spare capacity: strided views
    k, v = kbuf[:, :, :s], torch.randn(b, hk, s + 11, d, generator=g)[:, :, :s]
    mask = torch.rand(b, 1, t, s, generator=g) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    with torch.no_grad(), cpu.active():
        got = cpu.attend(q, k, v, mask, None)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for i in (0, 3, t - 1):
            alone = cpu.attend(q[:, :, i : i + 1], k, v, mask[:, :, i : i + 1], None)
            assert torch.equal(alone[:, 0], got[:, i])
        one = cpu.attend(q[:, :, :1], k, v, None, 0.3)  # no mask: every key (1-token steps)
        full = cpu.attend(q[:, :, :1], k, v, torch.ones(b, 1, 1, s, dtype=torch.bool), 0.3)
        assert torch.equal(one, full)
        torch.testing.assert_close(
            one,
            F.scaled_dot_product_attention(q[:, :, :1], k, v, scale=0.3, enable_gqa=True).transpose(1, 2),
            rtol=1e-5,
            atol=1e-5,
        )
        assert cpu.attend(q, k, v, None, None) is None  # several queries need a mask: SDPA's business
        assert cpu.attend(q.double(), k.double(), v.double(), mask, None) is None
    with torch.no_grad():
        assert cpu.attend(q, k, v, mask, None) is None  # outside active()


@needs_kernel
@pytest.mark.parametrize("s", [5, 37, 70])
def test_decode_attention_over_a_cache_with_holes_is_that_over_its_keys_alone(s, each_isa):
    """A query's attention over a cache whose mask leaves holes (a rejected draft's slot, a draft candidate not
    taken) is bit for bit its attention over the attended keys alone, packed with no holes - what an AR step sees
    after the same tokens. Where the holes fell in the softmax's vector lanes once changed the sum's last bits, and
    under int8 activations that moved the next layer's rounding: a 2-candidate ISD diverged from AR on 5 of 8
    held-out prompts."""
    g = torch.Generator().manual_seed(s)
    b, h, hk, d = 1, 6, 2, 32
    k, v = torch.randn(b, hk, s, d, generator=g), torch.randn(b, hk, s, d, generator=g)
    q = torch.randn(b, h, 1, d, generator=g)
    for holes in ([1], [s - 2], [0, 3, 4], list(range(1, s, 3))):
        keep = torch.ones(s, dtype=torch.bool)
        keep[holes] = False
        got = ext.attend(q, k, v, keep.view(1, 1, 1, s).expand(b, 1, 1, s), 0.17)
        alone = ext.attend(q, k[:, :, keep].contiguous(), v[:, :, keep].contiguous(), None, 0.17)
        assert torch.equal(got, alone), holes


@needs_kernel
def test_gated_mlp_in_one_pass_and_not_under_adapters():
    """A Llama MLP inside active() runs gate and up projections in one kernel pass with the SiLU product (equal to
    the stock MLP to rounding); with a LoRA hook on gate_proj (all-linear adapters) it keeps the stock path."""
    from transformers.models.llama import modeling_llama as ml

    from dlm.testing import make_model

    model = make_model("llama", hidden=64).eval()
    mlp = next(m for m in model.modules() if isinstance(m, ml.LlamaMLP))
    x = torch.randn(2, 5, 64) * 3
    with torch.no_grad():
        ref = mlp(x)
    assert cpu.attach(model) and runtime.patched(mlp)
    calls = []
    with torch.no_grad(), cpu.active():
        torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-5)
        handle = mlp.gate_proj.register_forward_hook(lambda *a: calls.append(1))
        torch.testing.assert_close(mlp(x), ref, rtol=1e-5, atol=1e-5)
        handle.remove()
    assert calls == [1]  # the hooked projection ran as a module (its hook fired)
    cpu.detach(model)
    assert "forward" not in mlp.__dict__


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_decoder_layer_in_one_call_where_it_matches_the_model(arch, monkeypatch):
    """Inside active() a Llama-form decoder layer (Llama, Qwen2 with its q/k/v biases, Mistral) runs as one Python
    function over the kernels: a cached decode chunk with a mask gives the stock model's logits to rounding, a hook
    on a projection (a gated-LoRA adapter) still fires, and outside active() the layer is stock bit for bit. Qwen3's
    per-head q/k norms are not that form: its layers keep their own forward."""
    from transformers import DynamicCache

    from dlm.testing import make_model

    model = make_model(arch, hidden=64, heads=4, kv_heads=2)
    ids = torch.randint(5, 90, (2, 9))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
    assert cpu.attach(model)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    fast = [runtime.patched(m) for m in layers]
    assert fast == [arch != "qwen3"] * len(layers)
    counting = CallCounter(runtime.STATE.ops)
    monkeypatch.setattr(runtime.STATE, "ops", counting)
    seen = []
    handle = layers[0].self_attn.q_proj.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    mask = torch.ones(2, 1, 3, 9, dtype=torch.bool)
    mask[..., 6:] = torch.ones(3, 3, dtype=torch.bool).tril_()
    with torch.no_grad(), cpu.active():
        cache = DynamicCache()
        model(input_ids=ids[:, :6], cache=cache, use_cache=True)  # prefill (beyond the kernels' rows: stock)
        got = model(
            input_ids=ids[:, 6:],
            cache=cache,
            use_cache=True,
            attention_mask=mask,
            position_ids=torch.arange(6, 9)[None].expand(2, 3),
        ).logits
    handle.remove()
    torch.testing.assert_close(got, stock[:, 6:], rtol=1e-4, atol=1e-4)
    assert seen[-1] == (2, 3, 64)  # the hooked projection was called as a module, on [B, T, D]
    if arch != "qwen3":  # one kernel attention per layer of the chunk (the hooked layer's per-op, the others' fused)
        assert counting.calls.get("attend") == 1 and counting.calls.get("layer_out") == len(layers) - 1
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock)
    cpu.detach(model)
    assert not any("forward" in m.__dict__ for m in layers)


def _prefill_chunk_step(model, ids, mask):
    """Inside active(): a 6-token prefill of 2 rows, a 3-token chunk with ``mask``, a 1-token step without one;
    the chunk's and the step's outputs and the cache."""
    from transformers import DynamicCache

    with torch.no_grad(), cpu.active():
        cache = DynamicCache()
        model(input_ids=ids[:, :6], cache=cache, use_cache=True)
        pos = torch.arange(6, 9)[None].expand(2, 3)
        chunk = model(input_ids=ids[:, 6:9], cache=cache, use_cache=True, attention_mask=mask, position_ids=pos)
        step = model(input_ids=ids[:, 9:], cache=cache, use_cache=True, position_ids=torch.tensor([[9], [9]]))
    return chunk, step, cache


@needs_kernel
@pytest.mark.parametrize("decoder", ["ar", "isd"])
def test_engine_decode_steps_take_the_stack_in_one_call(tiny_model_dir, decoder, monkeypatch):
    """The engine's decode steps (its growing KV cache, 2 requests batched, ISD's masked chunks) run the decoder
    stack as one decode_stack call each - the prefills, of a fresh cache, the layer loop - and decode the same
    tokens as with the loop."""
    from dlm.decode.configs import ISDConfig
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import load_any

    model = load_any(tiny_model_dir("llama"), "idlm")
    config = ISDConfig(stride=2) if decoder == "isd" else decoder
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)

    def run(one: bool | None):
        kernels = cpu.KernelOptions.from_env() if one is None else cpu.KernelOptions.from_env(one_call=one)
        with Engine(model, decoder=config, options=EngineOptions(max_batch_size=2, kernels=kernels)) as engine:
            assert engine.kernels.options is kernels
            counting = CallCounter(runtime.STATE.ops)
            monkeypatch.setattr(runtime.STATE, "ops", counting)
            out = [r.token_ids for r in engine.generate(prompts, params)]
            monkeypatch.setattr(runtime.STATE, "ops", counting.mod)
            return out, counting.calls, engine.total_forwards

    out, calls, forwards = run(None)  # the default: one call
    out_l, calls_l, _ = run(False)
    assert out == out_l and all(len(o) == 6 for o in out)
    assert 0 < calls.get("decode_stack", 0) and "layer_out" in calls  # the prefills: the loop
    assert calls["decode_stack"] + calls["layer_out"] // model.base_model_hf.config.num_hidden_layers == forwards
    assert "decode_stack" not in calls_l


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_layer_in_two_kernel_calls_is_the_per_op_path_bit_for_bit(arch, monkeypatch, each_isa):
    """Without hooks on its projections a fused layer runs as two kernel calls around the cache update (layer_in:
    norm, q/k/v with their biases, rotary; layer_out: attention, o_proj and its residual, norm, MLP and its
    residual); a no-op hook on every o_proj sends it through one kernel call per op instead. The logits of a
    cached chunk with a mask (a hole in one row's cache, causal among the chunk) and of a 1-token step without one
    are bit for bit the same both ways."""

    from dlm.testing import make_model

    model = make_model(arch, hidden=64, heads=4, kv_heads=2)
    ids = torch.randint(5, 90, (2, 10), generator=torch.Generator().manual_seed(1))
    assert cpu.attach(model)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    mask = torch.ones(2, 1, 3, 9, dtype=torch.bool)
    mask[0, ..., 2] = False
    mask[..., 6:] = torch.ones(3, 3, dtype=torch.bool).tril_()
    ext_ = runtime.STATE.ops

    def run(hooked):
        hooks = [m.self_attn.o_proj.register_forward_hook(lambda *a: None) for m in layers] if hooked else []
        counting = CallCounter(ext_)
        monkeypatch.setattr(runtime.STATE, "ops", counting)
        chunk, step, cache = _prefill_chunk_step(model, ids, mask)
        for h in hooks:
            h.remove()
        return chunk.logits, step.logits, counting.calls

    chunk, step, calls = run(False)
    chunk_ops, step_ops, calls_ops = run(True)
    assert calls.get("layer_in") == calls.get("layer_out") == 2 * len(layers) and "attend" not in calls
    assert "layer_out" not in calls_ops and calls_ops.get("attend") == 2 * len(layers)
    assert torch.equal(chunk, chunk_ops) and torch.equal(step, step_ops)
    cpu.detach(model)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("chunk_mask", ["hole", "none"])
def test_decoder_stack_in_one_loop_is_the_per_layer_path_bit_for_bit(arch, chunk_mask, monkeypatch, each_isa):
    """Inside active() a base model whose layers are all fused runs a decode chunk as one loop over the layers'
    bodies (no base-model forward, no module call per layer). A cached chunk with a 4-D mask (a hole in one row)
    or without one (causal: the stack builds the mask the model would) and a 1-token step without one give the
    same logits, bit for bit, as the base model's own forward over the
    same fused layers (sent there by a no-op hook on one layer, which then fires once per forward); the same cache;
    one layer_in / layer_out per layer either way. Qwen3's layers keep their own forward, so its base model does
    too; outside active() and after detach the model is its own."""

    from dlm.testing import make_model

    model = make_model(arch, hidden=64, heads=4, kv_heads=2)
    base = model.model
    ids = torch.randint(5, 90, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
    assert cpu.attach(model)
    assert runtime.patched(base) == (arch != "qwen3")
    layers = list(base.layers)
    mask = torch.ones(2, 1, 3, 9, dtype=torch.bool)
    mask[1, ..., 4] = False
    mask[..., 6:] = torch.ones(3, 3, dtype=torch.bool).tril_()
    mask = mask if chunk_mask == "hole" else None
    ext_ = runtime.STATE.ops

    calls_as_module = []
    own_call = type(layers[0])._call_impl
    monkeypatch.setattr(
        type(layers[0]), "_call_impl", lambda self, *a, **k: calls_as_module.append(1) or own_call(self, *a, **k)
    )

    def run(hooked):
        fired = []
        calls_as_module.clear()
        handle = layers[-1].register_forward_hook(lambda *a: fired.append(1)) if hooked else None
        counting = CallCounter(ext_)
        monkeypatch.setattr(runtime.STATE, "ops", counting)
        chunk, step, cache = _prefill_chunk_step(model, ids, mask)
        if handle is not None:
            handle.remove()
        return chunk.logits, step.logits, cache, counting.calls, len(fired), len(calls_as_module)

    chunk, step, cache, calls, _, as_modules = run(False)
    chunk_l, step_l, cache_l, calls_l, fired, as_modules_l = run(True)
    # the prefill (beyond the kernels' rows) runs the base model's own loop; the chunk and the step (fused) not
    assert as_modules == (len(layers) if arch != "qwen3" else 3 * len(layers))
    assert fired == 3 and as_modules_l == 3 * len(layers)  # with a hook on a layer: the model's own loop each time
    assert torch.equal(chunk, chunk_l) and torch.equal(step, step_l)
    for a, b in zip(cache.layers, cache_l.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    if arch != "qwen3":
        assert calls.get("layer_in") == calls.get("layer_out") == 2 * len(layers)
        assert calls_l.get("layer_in") == calls_l.get("layer_out") == 2 * len(layers)
    # row 0 has no hole (nor has row 1 without the mask): the stock model's logits to rounding
    rows = 1 if chunk_mask == "hole" else 2
    torch.testing.assert_close(chunk[:rows], stock[:rows, 6:9], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step[:rows], stock[:rows, 9:], rtol=1e-4, atol=1e-4)
    with torch.no_grad(), cpu.active():  # what the stack path leaves to the model's own forward
        out = model(input_ids=ids[:, :1], output_hidden_states=True)
        assert len(out.hidden_states) == len(layers) + 1
        embeds = base.embed_tokens(ids[:, :1])
        torch.testing.assert_close(model(inputs_embeds=embeds).logits, stock[:, :1], rtol=1e-4, atol=1e-4)
    cpu.detach(model)
    assert "forward" not in base.__dict__
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock)


@needs_kernel
def test_decoder_stack_check_refuses_a_stack_path_that_differs(monkeypatch):
    """The stack path is used only where it matched the model's own forward bit for bit when attached: a stack
    forward that skipped the final norm is refused (the model keeps its own forward, its layers stay fused)."""
    from dlm.testing import make_model

    real = cpu_stack.StackForward

    def skipping_norm(model, stock, parts, options):
        emb, layers, norm, rot, fwds = parts
        return real(model, stock, (emb, layers, nn.Identity(), rot, fwds), options)

    monkeypatch.setattr(cpu_stack, "StackForward", skipping_norm)
    for key in list(runtime.CHECKED):  # a fresh check
        monkeypatch.delitem(runtime.CHECKED, key)
    model = make_model("llama", hidden=64, heads=4, kv_heads=2)
    assert cpu.attach(model)
    assert not runtime.patched(model.model) and all(runtime.patched(m) for m in model.model.layers)
    cpu.detach(model)


@needs_kernel
def test_attach_inside_inference_mode_fuses_the_layers_and_the_stack(monkeypatch):
    """An engine built inside ``torch.inference_mode()`` attaches the same fused forwards as one built outside: the
    decoder layers and the stack checked and patched (the checks used to fail on inference tensors, and the cached
    failure kept the whole process on the per-op path)."""
    from dlm.testing import make_model

    for key in list(runtime.CHECKED):  # a fresh check, made inside inference mode
        monkeypatch.delitem(runtime.CHECKED, key)
    model = make_model("llama", hidden=64, heads=4, kv_heads=2)
    with torch.inference_mode():
        assert cpu.attach(model)
        assert runtime.patched(model.model) and all(runtime.patched(m) for m in model.model.layers)
    cpu.detach(model)


def _q4_1_form(n, k, g):
    """A weight as GGUF's Q4_1 dequantizes it: per 32 inputs (d * q) + m, d and m fp16 values, q in 0..15 (the
    block's smallest weight has q = 0, its largest q = 15, as the quantizer makes them)."""
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(n, k)


def _q8_0_form(n, k, g):
    """A weight as GGUF's Q8_0 dequantizes it: per 32 inputs d * q, d fp16, q int8 (one |q| = 127 per block)."""
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 3] = -127
    return (d * q).reshape(n, k)


@needs_kernel
def test_quantized_form_weights_stream_compressed_and_compute_bit_for_bit_the_same(each_isa):
    """Weights that are exactly Q4_1 / Q8_0 values (a model loaded from a GGUF file) are packed in that form and
    the kernel's outputs are bit for bit the fp32 kernel's, at every row count; a weight with one block off the
    form (or plain random weights) stays fp32."""
    g = torch.Generator().manual_seed(0)
    for make, n, k, dtype in (
        (_q4_1_form, 100, 64, torch.uint8),
        (_q4_1_form, 300, 576, torch.uint8),
        (_q8_0_form, 70, 96, torch.int8),
    ):
        w = make(n, k, g)
        (packed, tail), plain = packing.quant_pack(w, ext), ext.pack(w, False)
        assert tail is None and packed.dtype == dtype
        assert packed.numel() * packed.element_size() < plain.numel() * 4 / 3
        for rows in (1, 3, 8, 11):
            x = torch.randn(rows, k, generator=g)
            got = ext.linear(x, packed, n, None, None)
            assert torch.equal(got, ext.linear(x, plain, n, None, None))
            torch.testing.assert_close(got, x @ w.T, rtol=1e-4, atol=1e-4)
        off = w.clone()
        off[n // 4, 7] += 1e-3  # one weight off its block's grid
        assert packing.quant_pack(off, ext) is None
        off = torch.cat([w, torch.randn(3, k, generator=g)])  # rows added at the end (new tokens): an fp32 tail
        packed, tail = packing.quant_pack(off, ext)
        assert packed.dtype == dtype and tail.dtype == torch.float32
        x = torch.randn(5, k, generator=g)
        assert torch.equal(
            ext.linear(x, packed, n + 3, None, tail), ext.linear(x, ext.pack(off, False), n + 3, None, None)
        )
    assert packing.quant_pack(torch.randn(256, 64, generator=g), ext) is None


@needs_kernel
@pytest.mark.parametrize("form", ["q4_1", "q8_0"])
def test_quantized_weights_rebuilt_once_for_many_rows_give_each_row_its_one_row_result(form, each_isa):
    """Past one register pass of rows (4 on AVX2, 8 on AVX-512) a quantized block's weights are rebuilt once and
    applied to every pass: each row's output (with a bias, added in place, through gate_up and linears) is bit for
    bit its output alone, at row counts that fill passes and groups or leave them part full, for an odd number of
    32-input blocks and a last column block only part used."""
    g = torch.Generator().manual_seed(3)
    make = _q4_1_form if form == "q4_1" else _q8_0_form
    for n, k in ((70, 96), (96, 576)):
        w, w2, b = make(n, k, g), make(n, k, g), torch.randn(n, generator=g)
        p, p2 = packing.quant_pack(w, ext)[0], packing.quant_pack(w2, ext)[0]
        plain = ext.pack(w, False)
        for rows in (*range(2, 18), 31, 32, 33, 47, cpu.MAX_ROWS):
            x = torch.randn(rows, k, generator=g)
            one = [x[i : i + 1] for i in range(rows)]
            y = ext.linear(x, p, n, b, None)
            assert torch.equal(y, torch.cat([ext.linear(r, p, n, b, None) for r in one])), rows
            assert torch.equal(y, ext.linear(x, plain, n, b, None)), rows
            base = torch.randn(rows, n, generator=g)
            added = base.clone()
            ext.linear_add_(added, x, p)
            for i, r in enumerate(one):
                alone = base[i : i + 1].clone()
                ext.linear_add_(alone, r, p)
                assert torch.equal(added[i], alone[0]), (rows, i)
            gu = ext.gate_up(x, p, p2, n)
            assert torch.equal(gu, torch.cat([ext.gate_up(r, p, p2, n) for r in one])), rows
            both = ext.linears(x, [p, p2], [n, n], [b, torch.empty(0)])
            assert torch.equal(both[0], y) and torch.equal(both[1], ext.linear(x, p2, n, None, None)), rows


def _gguf_like():
    """A tiny Llama in the embedded SmolLM2's layout: Q4_1 projections, a Q8_0 tied embedding / lm_head."""
    from dlm.testing import make_model

    g = torch.Generator().manual_seed(1)
    model = make_model("llama", hidden=128, heads=4, kv_heads=2, vocab_size=320, tie=True)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and mod is not model.lm_head:
                mod.weight.copy_(_q4_1_form(*mod.weight.shape, g))
        model.get_input_embeddings().weight.copy_(_q8_0_form(*model.get_input_embeddings().weight.shape, g))
    return model


def _int8_reference(x, w, levels=16):
    """What the int8-activation kernels compute for Q4_1-form (``levels`` 16) or Q8_0-form (256) ``w [n, k]``
    (layout.h, kinds Q4_1_I8 / Q8_0_I8), in float64 from the integer parts: per 32 inputs dx = max|x| / 127,
    q = round(x / dx), sx = sum(x); each block adds (d * dx) * sum(q_w * q_x) (+ m * sx for Q4_1)."""
    n, k = w.shape
    xb = x.reshape(x.shape[0], k // 32, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    qx = torch.where(dx > 0, torch.round(xb / torch.where(dx > 0, dx, torch.ones_like(dx))), torch.zeros_like(xb))
    d, qw, m, done = packing._fit_blocks(w.reshape(n, k // 32, 32), levels)
    assert bool(done.all())
    isum = torch.einsum("mbk,nbk->mnb", qx.double(), qw.double())
    out = (d[..., 0].double()[None] * dx[..., 0].double()[:, None] * isum).sum(-1)
    return out if m is None else out + (m[..., 0].double()[None] * xb.sum(-1).double()[:, None]).sum(-1)


@needs_kernel
@pytest.mark.parametrize("form", ["q4_1", "q8_0"])
def test_int8_activations_take_gguf_weights_as_integer_dot_products(form, each_isa):
    """With activations "int8" a Q4_1-form weight whose scales and minima are fp16 values (as GGUF stores them),
    or a Q8_0-form one, packs in its integer-dot layout (640 / 1152 bytes per block): each output equals the int8
    scheme computed from its integer parts (to fp32 rounding), lies within the activations' rounding of the fp32
    result, and is bit for bit the same whatever the other rows are - through linear (with a bias and an fp32
    tail), linear_add_, gate_up and linears sharing one input with an fp32 weight. A Q4_1 block whose minimum is
    not an fp16 value keeps the exact layout."""
    g = torch.Generator().manual_seed(5)
    make, levels, size = (_q4_1_form, 16, 640) if form == "q4_1" else (_q8_0_form, 256, 1152)
    for n, k in ((100, 64), (300, 576), (64, 1536)):
        w, w2, b = make(n, k, g), make(n, k, g), torch.randn(n, generator=g)
        (p, tail), p2 = packing.quant_pack(w, ext, "int8"), packing.quant_pack(w2, ext, "int8")[0]
        assert tail is None and p.dtype == torch.uint8 and p.shape[-1] == size and p2.shape[-1] == size
        f = ext.pack(torch.randn(40, k, generator=g), False)
        for rows in (1, 2, 3, 5, 8, 9, 17, 33):
            x = torch.randn(rows, k, generator=g)
            y = ext.linear(x, p, n, b, None)
            ref = _int8_reference(x, w, levels) + b.double()
            torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-6 * float(ref.abs().max()))
            full = x @ w.T + b
            assert float((y - full).abs().max()) < 0.05 * float(full.abs().max()), rows
            one = [x[i : i + 1] for i in range(rows)]
            assert torch.equal(y, torch.cat([ext.linear(r, p, n, b, None) for r in one])), rows
            base = torch.randn(rows, n, generator=g)
            added = base.clone()
            ext.linear_add_(added, x, p)
            assert torch.equal(added, torch.cat([ext.linear(r, p, n, None, None) + base[i] for i, r in enumerate(one)]))
            gu = ext.gate_up(x, p, p2, n)
            assert torch.equal(gu, torch.cat([ext.gate_up(r, p, p2, n) for r in one])), rows
            torch.testing.assert_close(gu, nn.functional.silu(y - b) * ext.linear(x, p2, n, None, None))
            both = ext.linears(x, [p, f], [n, 40], [b, torch.empty(0)])
            assert torch.equal(both[0], y) and torch.equal(both[1], ext.linear(x, f, 40, None, None)), rows
        wide = torch.cat([w, torch.randn(3, k, generator=g)])  # rows past the form: an fp32 tail
        p3, tail = packing.quant_pack(wide, ext, "int8")
        assert p3.shape[-1] == size and tail.dtype == torch.float32
        x = torch.randn(4, k, generator=g)
        y, fit = ext.linear(x, p3, n + 3, None, tail), p3.shape[0] * 32  # (whole blocks of 32 columns)
        assert torch.equal(y[:, :fit], ext.linear(x, p, n, None, None)[:, :fit])
        assert torch.equal(y[:, fit:], ext.linear(x, ext.pack(wide[fit:], False), n + 3 - fit, None, None))
    if form == "q8_0":  # (a Q8_0 block's scale is max|w| / 127, so its values are -127..127)
        return
    d = (torch.rand(64, 2, 1, generator=g) * 0.01 + 1e-4).half().float()
    q = torch.randint(0, 16, (64, 2, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    m = (-torch.rand(64, 2, 1, generator=g) * 0.05).half().float()
    m[5, 1] += 1e-7  # one block's minimum off the fp16 grid: still exactly Q4_1 in fp32, not GGUF's fp16 form
    assert not bool((m.half().float() == m).all())
    packed = packing.quant_pack((d * q + m).reshape(64, 64), ext, "int8")
    assert packed is not None and packed[0].shape[-1] == 768


@needs_kernel
def test_int8_activations_in_the_engine_keep_isd_equal_to_ar(each_isa, monkeypatch):
    """KernelOptions(activations="int8") on a GGUF-form model: its Q4_1 layers and its Q8_0 lm_head pack in the
    integer-dot layouts, the fused decoder layers and stack still pass their checks (made under int8 here), greedy
    ISD equals greedy AR token for token on those kernels, and a chunk's logits stay near the fp32 path's (the
    activations' rounding)."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import convert_ar_to_dlm
    from dlm.testing import make_tokenizer

    logits, sizes = {}, {}
    for acts in ("f32", "int8"):
        for key in list(runtime.CHECKED):  # each fused form checked again, with these kernels
            monkeypatch.delitem(runtime.CHECKED, key)
        dlm = convert_ar_to_dlm(_gguf_like(), "idlm", block_size=2, tokenizer=make_tokenizer(320))
        options = EngineOptions(kernels=cpu.KernelOptions(mode="on", activations=acts))
        outs, calls = [], {}
        for d in ("ar", "isd"):
            engine = Engine(dlm, decoder=d, options=options)
            counting = CallCounter(runtime.STATE.ops)
            monkeypatch.setattr(runtime.STATE, "ops", counting)
            outs.append(engine.generate([[5, 6, 7, 8], [9, 3]], SamplingParams(max_new_tokens=12, temperature=0.0)))
            monkeypatch.setattr(runtime.STATE, "ops", counting.mod)
            calls[d] = counting.calls.get("decode_stack", 0)
        assert calls["ar"] > 0 and calls["isd"] > 0, (acts, calls)
        assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]], acts
        sizes[acts] = {
            (str(p.packed.dtype), p.packed.shape[-1])
            for p in map(packed_of, dlm.modules())
            if p is not None and p.packed.dtype != torch.float32
        }
        with torch.no_grad(), cpu.active():
            logits[acts] = dlm(input_ids=torch.tensor([[5, 6, 7, 8, dlm.mask_token_id]])).logits
        cpu.detach(dlm)
    assert sizes == {
        "f32": {("torch.uint8", 768), ("torch.int8", 1152)},
        "int8": {("torch.uint8", 640), ("torch.uint8", 1152)},
    }
    assert not torch.equal(logits["f32"], logits["int8"])
    assert float((logits["f32"] - logits["int8"]).abs().max()) < 0.05 * float(logits["f32"].abs().max())


@needs_kernel
def test_int8_activations_give_a_sequence_the_same_numbers_whatever_its_batch(monkeypatch):
    """Under int8 activations a prompt's prefill is the same arithmetic beside other prompts as alone: a batch of
    short sequences whose rows together exceed what a decode call takes (MAX_ROWS) still goes through the int8
    kernels, bit for bit each sequence alone - not BLAS in fp32, whose numbers differ by the inputs' rounding (the
    KV of 5 held-out prompts prefilled together differed by up to 1.9, and their answers from those made alone)."""
    for key in list(runtime.CHECKED):
        monkeypatch.delitem(runtime.CHECKED, key)
    model = _gguf_like().eval()
    assert cpu.attach(model, cpu.KernelOptions(mode="on", activations="int8"))
    n = cpu.MAX_ROWS // 3 + 1  # tokens a sequence; 4 of them exceed MAX_ROWS
    ids = torch.randint(5, 300, (4, n), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), cpu.active():
        together = model(input_ids=ids).logits
        alone = torch.cat([model(input_ids=ids[i : i + 1]).logits for i in range(4)])
    assert torch.equal(together, alone)
    cpu.detach(model)


def test_activations_option_is_checked(monkeypatch):
    monkeypatch.setenv("DLM_CPU_ACTIVATIONS", "int4")
    with pytest.raises(Exception, match="DLM_CPU_ACTIVATIONS='int4'"):
        cpu.KernelOptions.from_env()
    monkeypatch.setenv("DLM_CPU_ACTIVATIONS", "INT8")
    assert cpu.KernelOptions.from_env().activations == "int8"
    with pytest.raises(Exception, match="KernelOptions.activations"):
        cpu.KernelOptions(activations="bf16")


@needs_kernel
def test_engine_on_a_quantized_form_model_matches_fp32_packing_exactly(monkeypatch, each_isa):
    """A Llama whose projections are Q4_1 values and whose embedding / lm_head is Q8_0 (the embedded SmolLM2's
    layout): attach() packs them compressed, and the engine's greedy AR and ISD outputs and a chunk's logits are
    bit for bit those with every layer packed fp32."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import convert_ar_to_dlm
    from dlm.testing import make_tokenizer

    runs = {}
    for quant in ("0", "1"):
        monkeypatch.setenv(cpu.QUANT_ENV, quant)
        # the mask token is a row added to the tied embedding / lm_head: off the Q8_0 grid, an fp32 tail
        dlm = convert_ar_to_dlm(_gguf_like(), "idlm", block_size=2, tokenizer=make_tokenizer(320))
        outs = []
        for decoder in ("ar", "isd"):
            engine = Engine(dlm, decoder=decoder)
            outs.append(
                engine.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=12, temperature=0.0))[0].token_ids
            )
        kinds = {
            str(t.dtype)
            for p in map(packed_of, dlm.modules())
            if p is not None
            for t in (p.packed, p.tail)
            if t is not None
        }
        ids = torch.tensor([[5, 6, 7, 8, dlm.mask_token_id]])
        with torch.no_grad(), cpu.active():
            outs.append(dlm(input_ids=ids).logits)
        runs[quant] = outs, kinds
        cpu.detach(dlm)
    assert runs["0"][1] == {"torch.float32"} and runs["1"][1] == {"torch.uint8", "torch.int8", "torch.float32"}
    (ar0, isd0, lg0), (ar1, isd1, lg1) = runs["0"][0], runs["1"][0]
    assert ar0 == ar1 == isd0 == isd1
    assert torch.equal(lg0, lg1)


# -- the choice at attach: never slower than stock ----------------------------------------------------------------


@pytest.fixture
def auto_choice(monkeypatch, tmp_path):
    """DLM_CPU_KERNEL=auto with an empty choice cache of its own."""
    monkeypatch.setenv(cpu.ENV, "auto")
    monkeypatch.setenv("DLM_HOME", str(tmp_path))
    return tmp_path


def _fake_measure(monkeypatch, stock_ms, kernel_ms, fp32_ms=None):
    """Replace the micro-benchmark's timings (what a faster or slower machine would measure); counts calls."""
    from dlm.decode.cpu import choice

    calls = []

    def measure(layers, ops, names=None):
        calls.append(len(layers))
        f32 = fp32_ms if fp32_ms is not None else kernel_ms
        quant = kernel_ms <= f32
        best = kernel_ms if quant else f32
        return choice.Choice(
            use=best <= stock_ms,
            quant=quant,
            stock_ms={"1": stock_ms, "4": stock_ms},
            kernel_ms={"1": best, "4": best},
            fp32_ms={"1": f32, "4": f32},
            fp32_kinds=[] if quant else [lab for lab in choice.labels(layers, names or [""] * len(layers))],
            isa=ops.isa(),
            rounds=choice.ROUNDS,
        )

    monkeypatch.setattr(choice, "measure", measure)
    return calls


@needs_kernel
def test_auto_keeps_the_stock_layers_where_the_kernels_are_slower_and_remembers(auto_choice, monkeypatch):
    calls = _fake_measure(monkeypatch, stock_ms=1.0, kernel_ms=1.5)
    net = _net()
    handle = cpu.attach(net)
    assert not handle and handle.choice is not None and not handle.choice.use
    assert "forward" not in net[0].__dict__  # the model is untouched
    assert calls == [2]
    # a decision for the stock layers is measured again until a second measurement confirms it ...
    again = cpu.attach(_net())
    assert not again and not again.choice.cached and again.choice.confirmed == 2 and calls == [2, 2]
    # ... then it is the cached decision, not a third measurement
    third = cpu.attach(_net())
    assert not third and third.choice.cached and calls == [2, 2]
    assert (auto_choice / "cpu_kernel_choice.json").is_file()


@needs_kernel
def test_auto_uses_the_kernels_where_they_are_faster(auto_choice, monkeypatch):
    calls = _fake_measure(monkeypatch, stock_ms=2.0, kernel_ms=1.0)
    net = _net()
    handle = cpu.attach(net)
    assert handle and handle.choice.use and calls == [2]
    x = torch.randn(3, 24)
    with torch.no_grad(), cpu.active():
        torch.testing.assert_close(net(x), _net()(x), rtol=1e-5, atol=1e-5)
    handle.detach()
    assert "forward" not in net[0].__dict__


@needs_kernel
def test_auto_prefers_fp32_packing_where_the_quantized_one_is_slower(auto_choice, monkeypatch):
    model = _q4_llama()
    _fake_measure(monkeypatch, stock_ms=3.0, kernel_ms=2.0, fp32_ms=1.0)
    handle = cpu.attach(model)
    assert handle and not handle.choice.quant
    assert {p.packed.dtype for p in map(packed_of, model.modules()) if p is not None} == {torch.float32}
    cpu.detach(model)


@needs_kernel
def test_the_real_measurement_times_each_layer_kind(auto_choice):
    """The measurement itself (no fake): medians of interleaved rounds for 1 and 4 rows, a decision consistent
    with them, and the path each layer kind takes."""
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    handle = cpu.attach(net)
    ch = handle.choice
    assert set(ch.stock_ms) == set(ch.kernel_ms) == {"1", "4"} and all(v > 0 for v in ch.stock_ms.values())
    assert ch.use == all(ch.kernel_ms[r] <= ch.stock_ms[r] for r in ch.stock_ms) == bool(handle)
    assert ch.isa == ext.isa() and "x" in ch.summary() and ch.rounds >= 5
    assert set(ch.kinds) == {"0 256x64 fp32", "2 64x256 fp32"} and "x1:" in ch.paths()
    cpu.detach(net)


def _q4_llama(seed=3):
    from dlm.testing import make_model

    g = torch.Generator().manual_seed(seed)
    model = make_model("llama", hidden=128, heads=4, kv_heads=2).eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and mod is not model.lm_head:
                mod.weight.copy_(_q4_1_form(*mod.weight.shape, g))
    return model


def _plant_timings(monkeypatch, ms, slow=None):
    """Replace each timed call's duration: ``ms[variant]`` milliseconds, or ``slow(variant, n)`` where it returns
    a number (n: that variant's call count so far) - a slow moment of the machine planted at a known place."""
    from dlm.decode.cpu import choice

    seen = {v: 0 for v in ms}

    def timed(variant, fn, x):
        n, seen[variant] = seen[variant], seen[variant] + 1
        t = slow(variant, n) if slow is not None else None
        return (t if t is not None else ms[variant]) * 1e-3

    monkeypatch.setattr(choice, "_timed", timed)
    return seen


@needs_kernel
def test_a_slow_moment_during_the_measurement_is_not_cached(auto_choice, monkeypatch):
    """The kernels at half the stock time, except for one round in which every kernel call took 30x (a compile,
    another job): the median of the rounds still picks the kernels and the quantized packing, and so does the
    cached record. Measured once, as the earlier code did, that moment decided for the stock layers forever."""
    from dlm.decode.cpu import choice

    model = _q4_llama()
    n_layers = len(cpu._linear_layers(model))
    _plant_timings(
        monkeypatch,
        {"stock": 2.0, "kernel": 1.0, "f32": 1.5},
        slow=lambda v, n: 30.0 if v == "kernel" and n < 2 * n_layers else None,  # the whole first round
    )
    handle = cpu.attach(model)
    ch = handle.choice
    assert handle and ch.use and ch.quant and not ch.fp32_kinds and ch.rounds == choice.ROUNDS
    assert ch.kernel_ms["1"] == pytest.approx(n_layers * 1.0, rel=1e-3)  # the median, not the slow round
    rec = choice.cached(choice.cache_key(cpu._linear_layers(model), ext.isa()))
    assert rec is not None and rec.use and rec.quant
    cpu.detach(model)


@needs_kernel
def test_the_decision_agrees_with_the_figures_it_records(auto_choice, monkeypatch):
    """Kernels slower than the stock layers by less than the record's precision (4 decimals of a millisecond):
    the record shows a tie, and the decision reads as its figures do (a tie keeps the kernels). Decided on the
    unrounded sums, a cached record said 'kernel <= stock' at every row count and 'use: no' beside it."""
    net = _net()
    _plant_timings(monkeypatch, {"stock": 0.01, "kernel": 0.0100001, "f32": 0.0100001})
    ch = cpu.attach(net).choice
    assert ch.kernel_ms == ch.stock_ms
    assert ch.use == all(ch.kernel_ms[r] <= ch.stock_ms[r] for r in ch.stock_ms) is True
    cpu.detach(net)


@needs_kernel
def test_a_measurement_that_contradicts_the_machine_is_taken_again(auto_choice, monkeypatch):
    """This machine's other model shapes run the kernels; a first measurement that says 'stock' (a slow moment
    that lasted all its rounds) is taken again: the second, which agrees with the machine, is what is used and
    cached."""
    from dlm.decode.cpu import choice
    from dlm.fsutil import write_record

    other = choice.machine_key(ext.isa()) + "|othershape00"
    write_record(choice.CACHE_FILE, other, {"use": True, "quant": True})
    net = _net()
    n_layers = len(cpu._linear_layers(net))
    per_measure = 2 * n_layers * choice.ROUNDS  # kernel calls of one measurement (no near ties: no extra rounds)
    calls = _plant_timings(
        monkeypatch,
        {"stock": 2.0, "kernel": 1.0, "f32": 1.0},
        slow=lambda v, n: 10.0 if v == "kernel" and n < per_measure else None,
    )
    handle = cpu.attach(net)
    assert handle and handle.choice.use and "taken again" in handle.choice.note
    assert calls["kernel"] == 2 * per_measure
    key = choice.cache_key(cpu._linear_layers(net), ext.isa())
    assert choice.cached(key).use
    cpu.detach(net)

    # a shape that really is slower on the kernels here: both measurements say so, and that is cached, confirmed
    (auto_choice / choice.CACHE_FILE).unlink()
    write_record(choice.CACHE_FILE, other, {"use": True, "quant": True})
    calls = _plant_timings(monkeypatch, {"stock": 2.0, "kernel": 10.0, "f32": 10.0})
    handle = cpu.attach(_net())
    assert not handle and "confirmed" in handle.choice.note and calls["kernel"] == 2 * per_measure
    rec = choice.cached(key)
    assert rec is not None and not rec.use and rec.confirmed == choice.CONFIRM


@needs_kernel
def test_steps_much_slower_than_predicted_drop_the_cached_choice(auto_choice, monkeypatch):
    from dlm.decode.cpu import choice

    _plant_timings(monkeypatch, {"stock": 2.0, "kernel": 1.0, "f32": 1.0})
    net = _net()
    handle = cpu.attach(net)
    key = choice.cache_key(cpu._linear_layers(net), ext.isa())
    assert handle and choice.cached(key) is not None
    predicted = handle.choice.predicted_ms(1) * 1e-3
    for _ in range(cpu.WATCH):  # as predicted (the rest of a forward costs something too): kept
        handle.observe(2 * predicted)
    assert choice.cached(key) is not None
    for _ in range(cpu.WATCH):
        handle.observe(5 * predicted)
    assert choice.cached(key) is None  # the next attach measures again
    cpu.detach(net)
    assert not cpu.attach(_net()).choice.cached


@needs_kernel
def test_large_models_are_timed_on_an_even_sample_of_their_layers(monkeypatch):
    from dlm.decode.cpu import choice

    model = _q4_llama()
    layers = []
    for m in cpu._linear_layers(model):
        p = object.__new__(Packed)
        p.out, p.packed, p.tail = m.weight.shape[0], torch.zeros(1), None
        layers.append((m, p))
    kinds = [choice._kind_of(m) for m in layers]
    total = sum(m.weight.numel() * 4 for m, _ in layers)
    monkeypatch.setattr(choice, "WORKING_SET", total // 3)
    chosen = choice._working_set(layers, kinds)
    assert len(chosen) < len(layers) and {kinds[i] for i in chosen} == set(kinds)
    monkeypatch.setattr(choice, "WORKING_SET", total)
    assert choice._working_set(layers, kinds) == list(range(len(layers)))


@needs_kernel
def test_attach_keeps_its_state_on_its_own_objects_and_copies_stay_apart(monkeypatch):
    """The kernels keep nothing on a model's modules but their ``forward`` (one of dlm's KernelForward objects,
    holding the packed weights and plans): every other attribute of every module is the same object before attach,
    while attached and after detach. A deep copy of an attached model runs on its own weights: its forwards are
    bound to the copy's modules, its outputs follow the copy's weights, and detaching one leaves the other attached."""
    import copy

    from dlm.testing import make_model

    monkeypatch.setenv(cpu.ENV, "1")
    model = make_model("llama", hidden=64, heads=4, kv_heads=2)
    before = {name: dict(vars(m)) for name, m in model.named_modules()}

    def unchanged(m, old) -> bool:
        now = vars(m)
        return now.keys() - {"forward"} == old.keys() - {"forward"} and all(now[k] is v for k, v in old.items())

    handle = cpu.attach(model)
    assert handle and runtime.patched(model.model)  # down to the stack path
    for name, m in model.named_modules():
        assert unchanged(m, before[name]), name
        assert "forward" not in vars(m) or isinstance(vars(m)["forward"], runtime.KernelForward), name
    ids = torch.tensor([[3, 4, 5]])
    twin = copy.deepcopy(model)
    own = {id(m) for m in twin.modules()}
    for m in twin.modules():
        f = runtime.forward_of(m)
        if f is not None:
            slots = [n for k in type(f).__mro__ for n in getattr(k, "__slots__", ())]
            bound = [v for v in map(f.__getattribute__, slots) if isinstance(v, nn.Module)]
            assert bound and all(id(b) in own for b in bound), type(f).__name__
    with torch.no_grad():
        twin.lm_head.weight.mul_(2)
        with cpu.active():
            ref, got = model(ids).logits, twin(ids).logits
    assert not torch.allclose(ref, got)
    with torch.no_grad():
        assert torch.allclose(got, twin(ids).logits, atol=1e-4)  # the copy's kernels read the copy's weights
    cpu.detach(twin)
    assert runtime.patched(model.model) and not any(runtime.patched(m) for m in twin.modules())
    handle.detach()
    for name, m in model.named_modules():
        assert unchanged(m, before[name]) and "forward" not in vars(m), name


@needs_kernel
def test_kernel_options_are_the_attachs_own_and_checked(monkeypatch):
    """How the kernels run is one KernelOptions per attached model: from the environment where none is passed,
    shared by the model's handles (what its forwards read), a second attach asking for other options refused by
    name, a bad value refused naming its variable; EngineOptions carries it to the engine's attach."""
    from dlm.decode.engine import Engine
    from dlm.errors import DLMError
    from dlm.testing import make_model

    monkeypatch.setenv(cpu.ENV, "1")
    monkeypatch.setenv(cpu.QUANT_ENV, "0")
    model = make_model("llama", hidden=64, heads=4, kv_heads=2)
    h1 = cpu.attach(model)
    assert h1.options == cpu.KernelOptions(mode="on", quant=False)
    h2 = cpu.attach(model, cpu.KernelOptions.from_env())  # equal options: the same attach
    assert h2.options is h1.options and runtime.forward_of(model.model).options is h1.options
    with pytest.raises(DLMError, match="KernelOptions"):
        cpu.attach(model, cpu.KernelOptions.from_env(one_call=False))
    with pytest.raises(DLMError, match="DLM_CPU_KERNEL"):
        cpu.KernelOptions(mode="fast")
    with pytest.raises(DLMError, match="EngineOptions.kernels"):
        EngineOptions(kernels={"one_call": False})
    h1.detach(), h2.detach()
    loop = cpu.KernelOptions.from_env(one_call=False)
    with Engine(model, decoder="ar", options=EngineOptions(kernels=loop)) as engine:
        assert engine.kernels.options is loop and runtime.forward_of(model.model).options is loop
    assert not runtime.patched(model.model)


@needs_kernel
def test_handles_share_one_packing_and_the_last_detach_restores_the_model():
    net = _net()
    own = lambda x: net[0].__class__.forward(net[0], x)  # noqa: E731 - an instance forward of the caller's
    net[0].forward = own
    h1, h2 = cpu.attach(net), cpu.attach(net)
    assert h1 and h2 and net[0].__dict__["forward"] is not own
    h1.detach()
    h1.detach()  # idempotent
    assert runtime.patched(net[0])  # h2 still open
    h2.detach()
    assert net[0].__dict__["forward"] is own
    assert "forward" not in net[2].__dict__


@needs_kernel
def test_engine_close_gives_the_model_back_as_it_was(tiny_model_dir):
    """An engine patches the caller's model (CPU kernels, the GQA attention implementation); close() undoes it."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.convert import load_any

    model = load_any(tiny_model_dir("llama"))
    hf = model.model if hasattr(model, "model") else model
    impl = hf.config._attn_implementation
    with Engine(model, decoder="ar") as engine:
        assert engine._cpu_kernel and hf.config._attn_implementation == "dlm_sdpa"
        engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert hf.config._attn_implementation == impl
    assert not any(runtime.patched(m) for m in model.modules())


@needs_kernel
@pytest.mark.integration
def test_isa_env_forces_an_instruction_set_and_refuses_one_the_cpu_lacks(tmp_path):
    """DLM_CPU_ISA picks the kernels' instruction set at load (the non-native fallbacks are testable on any CPU);
    one this CPU cannot run is an error naming the variable."""
    import subprocess
    import sys

    code = "from dlm.decode import cpu; print(cpu.isa())"
    env = {**__import__("os").environ, cpu.ISA_ENV: "generic", cpu.ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "generic"
    from dlm.errors import DLMError

    with pytest.raises(DLMError, match=cpu.ISA_ENV):
        cpu.set_isa("sse9")
    if "avx512" not in ISAS:
        with pytest.raises(DLMError, match="avx512"):
            cpu.set_isa("avx512")
    assert cpu.set_isa("auto") == ISAS[0]


def test_thread_policy_uses_the_idle_cores_and_puts_the_callers_count_back(monkeypatch):
    from dlm.decode import threads
    from dlm.errors import DLMError

    saved = torch.get_num_threads()
    monkeypatch.setattr(threads, "cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda: 1)  # another process keeps one core busy
    pol = threads.ThreadPolicy("auto")
    pol.tick()
    assert torch.get_num_threads() == 1
    monkeypatch.setattr(threads, "busy_cores", lambda: 0)
    pol.tick()  # within INTERVAL: not looked at again
    assert torch.get_num_threads() == 1
    pol._next = 0.0
    pol.tick()
    assert torch.get_num_threads() == 2
    pol.restore()
    assert torch.get_num_threads() == saved
    monkeypatch.setattr(threads, "busy_cores", lambda: 5)
    assert threads.auto_threads() == 1  # never below one
    assert parse_threads("torch") is None and parse_threads("3") == 3 and parse_threads(2) == 2
    for bad in ("0", 0, True, 1.5, "two"):
        with pytest.raises(DLMError, match="--threads"):
            parse_threads(bad)


def test_busy_cores_counts_other_processes_runnable_tasks_only(monkeypatch):
    """busy = the machine's runnable tasks minus this process's own running threads (median of the samples);
    None where /proc/loadavg cannot be read."""
    from dlm.decode import threads

    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    totals = iter([4, 3, 9, 3, 3])  # one outlier sample
    monkeypatch.setattr(threads, "_running_total", lambda: next(totals))
    monkeypatch.setattr(threads, "_running_own", lambda: 2)
    assert threads.busy_cores() == 1
    monkeypatch.setattr(threads, "_running_total", lambda: 1)
    assert threads.busy_cores() == 0  # never below zero
    monkeypatch.setattr(threads, "_running_total", lambda: None)
    assert threads.busy_cores() is None
    monkeypatch.setattr(threads, "cores", lambda: 2)
    assert threads.auto_threads() == 2  # unknown load: every core


@needs_kernel
def test_outputs_do_not_depend_on_the_thread_count():
    """The column blocks and heads are handed to the threads in chunks as each comes free: linear (with an fp32
    tail), linears, gate_up, linear_add_ and attend give bit for bit the one-thread result with 2 and 3 threads, at
    one row (few long chunks) and at many (many chunks), for enough blocks that every thread takes several."""
    g = torch.Generator().manual_seed(5)
    saved = torch.get_num_threads()
    n, k = 32 * 40 + 7, 96
    w, w2 = _q4_1_form(n, k, g), _q4_1_form(n, k, g)
    full = torch.cat([w, torch.randn(5, k, generator=g)])
    (p, tail), p1, p2 = packing.quant_pack(full, ext), packing.quant_pack(w, ext)[0], packing.quant_pack(w2, ext)[0]
    b, h, hk, s, d = 3, 8, 2, 45, 32
    q, kk, vv = (torch.randn(b, x, t, d, generator=g) for x, t in ((h, 2), (hk, s), (hk, s)))
    mask = torch.rand(b, 1, 2, s, generator=g) > 0.2
    mask[..., 0] = True

    def run(rows):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        added = torch.ones(rows, n)
        ext.linear_add_(added, x, p2)
        return [
            ext.linear(x, p, n + 5, None, tail),
            *ext.linears(x, [p2, p1], [n, n], [torch.empty(0), torch.empty(0)]),
            ext.gate_up(x, p1, p2, n),
            added,
            ext.attend(q, kk, vv, mask, 0.2),
        ]

    try:
        for rows in (1, 13):
            torch.set_num_threads(1)
            want = run(rows)
            for threads in (2, 3):
                torch.set_num_threads(threads)
                assert all(torch.equal(a, b) for a, b in zip(run(rows), want)), (rows, threads)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.integration
def test_a_build_killed_midway_does_not_hang_later_processes():
    """torch's build guard is a ``lock`` file that a killed build leaves in the build folder; a later process then
    waited for it forever. dlm builds under an flock (released when its holder dies) and removes such a file."""
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    from dlm.decode.cpu.build import _tag

    stale = Path(_get_build_directory(f"dlm_cpu_{_tag()}", False)) / "lock"
    stale.touch()  # what a killed build leaves
    code = "from dlm.decode.cpu.build import extension; import sys; sys.exit(0 if extension() is not None else 3)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert run.returncode in (0, 3), run.stderr[-2000:]  # (3: no compiler here - but it did not hang)
    assert not stale.exists()
