"""The few-row CPU linear kernel of the decoding engine (dlm.decode.cpu_linear)."""

import pytest
import torch
from torch import nn

from dlm.decode import cpu_linear

ext = cpu_linear.extension()
needs_kernel = pytest.mark.skipif(ext is None, reason="the CPU kernel could not be built here (no compiler?)")


@needs_kernel
@pytest.mark.parametrize("n,k", [(96, 64), (100, 37), (7, 5), (1536, 576)])
def test_kernel_matches_f_linear_and_is_row_invariant(n, k):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    packed = ext.pack(w, False)
    assert torch.equal(ext.pack(w.t().contiguous(), True), packed)  # Conv1D layout packs to the same blocks
    alone = ext.linear(torch.randn(1, k, generator=torch.Generator().manual_seed(5)), packed, n, b)
    for m in (1, 2, 3, 8, 9, 17, cpu_linear.MAX_ROWS):
        x = torch.randn(m, k, generator=g)
        x[m // 2] = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
        y = ext.linear(x, packed, n, b)
        torch.testing.assert_close(y, nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
        # one row's output does not depend on how many rows share the call, nor on them: bit for bit
        assert torch.equal(y[m // 2], alone[0])
        assert torch.equal(ext.linear(x, packed, n, None) + b, y)  # the bias is one add after the sum


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))


@needs_kernel
def test_attach_routes_only_inside_active_without_grad():
    net = _net()
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        stock = net(x)
    assert cpu_linear.attach(net) and cpu_linear.attach(net)  # idempotent
    with torch.no_grad():
        assert torch.equal(net(x), stock)  # outside active(): the stock layers, bit for bit
        with cpu_linear.active():
            fast = net(x)
        with cpu_linear.active(False):
            assert torch.equal(net(x), stock)
    torch.testing.assert_close(fast, stock, rtol=1e-5, atol=1e-5)
    with cpu_linear.active():
        y = net(x)  # gradients on: the stock layers (the kernel has no backward)
        assert y.requires_grad and torch.equal(y.detach(), stock)
        with torch.inference_mode():
            z = net(x)
    torch.testing.assert_close(z, stock, rtol=1e-5, atol=1e-5)
    # more rows than MAX_ROWS: the stock layer
    big = torch.randn(cpu_linear.MAX_ROWS + 1, 24)
    with torch.no_grad(), cpu_linear.active():
        assert torch.equal(net(big), _net()(big))
    cpu_linear.detach(net)
    assert "forward" not in net[0].__dict__ and not hasattr(net[0], "_dlm_packed")


@needs_kernel
def test_packed_copy_follows_in_place_weight_updates():
    net = _net()
    cpu_linear.attach(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    x = torch.randn(4, 24)
    net(x).pow(2).sum().backward()
    opt.step()  # in place: the packed copy is now stale and must be rebuilt at the next call
    with torch.no_grad():
        ref = nn.functional.linear(nn.functional.relu(nn.functional.linear(x, net[0].weight, net[0].bias)),
                                   net[2].weight)
        with cpu_linear.active():
            got = net(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_off_switch(monkeypatch):
    monkeypatch.setenv(cpu_linear.ENV, "0")
    net = _net()
    assert cpu_linear.attach(net) is False
    assert "forward" not in net[0].__dict__


def test_not_for_other_dtypes():
    net = _net().to(torch.bfloat16)
    assert cpu_linear.attach(net) is False


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
        assert cpu_linear.attach(dlm)
        assert dlm.gated_lora.fast_delta is cpu_linear.adapter_delta
        calls = []
        dlm.gated_lora.fast_delta = lambda *a: calls.append(1) or cpu_linear.adapter_delta(*a)
        with cpu_linear.active():
            got = dlm(input_ids=ids).logits
            got1 = dlm(input_ids=ids[:1]).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got1, ref1, rtol=1e-4, atol=1e-4)
    assert len(calls) == len(dlm.gated_lora.adapters)  # every adapter of the batch-1 forward took the kernel
    dlm.gated_lora.fast_delta = cpu_linear.adapter_delta
    cpu_linear.detach(dlm)
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
    lm_head.forward = lambda x: seen.append(cpu_linear._active[0]) or stock(x)
    out = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4, temperature=0.0))[0]
    lm_head.forward = stock
    assert len(out.token_ids) == 4 and seen and all(seen)  # every engine forward ran inside active()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
