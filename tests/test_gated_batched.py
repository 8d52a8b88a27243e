"""Gated LoRA inside the adapted modules' own forward (one gather and one A matmul per group of linears reading the
same input, no hook per module) against the same adapters as per-module forward hooks - the form dlm used before,
kept here as the reference: clean rows bit for bit the base model's, mask rows and gradients equal to the hooks',
checkpoints interchangeable, and the CPU kernels' fused layers adding the same deltas."""

import copy

import pytest
import torch
from torch import nn

from dlm.decode.options import EngineOptions
from dlm.model import masks
from dlm.model.convert import AutoDLMForCausalLM, convert_ar_to_dlm
from dlm.model.lora import ADAPTER_FILE, CONFIG_KEY, GatedLoRA, LoraSettings, _Group, prepare_model_for_lora
from dlm.testing import CallCounter, make_model, make_tokenizer


class _HookGated(nn.Module):
    """The reference: the same adapters as forward hooks on each targeted linear, a pre-hook computing the gate and
    a hook on the input embedding (dense torch.where with many masks and gradients, else gathered rows and
    index_add, or an addmm_ on the masks' run of rows without gradients)."""

    def __init__(self, hf, mask_id: int, names: list[str], scale: float, state: dict):
        super().__init__()
        self.mask_id, self.scale, self.dense_fraction = mask_id, scale, 0.25
        self.A = nn.ParameterDict(
            {n.replace(".", "__"): nn.Parameter(state[f"{n.replace('.', '__')}.A"].clone()) for n in names}
        )
        self.B = nn.ParameterDict(
            {n.replace(".", "__"): nn.Parameter(state[f"{n.replace('.', '__')}.B"].clone()) for n in names}
        )
        self.mask_embedding = nn.Parameter(state["mask_embedding"].clone())
        modules = dict(hf.named_modules())
        self.handles = [hf.register_forward_pre_hook(self._set_gate, with_kwargs=True)]
        self.handles.append(hf.get_input_embeddings().register_forward_hook(self._embed))
        for n in names:
            self.handles.append(modules[n].register_forward_hook(self._hook(n.replace(".", "__"))))

    def _set_gate(self, module, args, kwargs):
        gate = kwargs["input_ids"] == self.mask_id
        self.gate, n = gate, int(gate.sum())
        self.n = n
        self.dense = torch.is_grad_enabled() and n >= self.dense_fraction * gate.numel()
        self.idx = gate.reshape(-1).nonzero().squeeze(1) if n and not self.dense else None
        self.span = None
        if self.idx is not None and not torch.is_grad_enabled():
            lo, hi = int(self.idx[0]), int(self.idx[-1]) + 1
            self.span = (lo, hi) if hi - lo == n else None

    def _embed(self, module, args, out):
        return torch.where(self.gate[..., None], self.mask_embedding, out) if self.n else out

    def _hook(self, key):
        def hook(module, args, out):
            if not self.n:
                return out
            x, a, b = args[0], self.A[key], self.B[key]
            if self.dense:
                return torch.where(self.gate[..., None], out + (x @ a.t()) @ b.t() * self.scale, out)
            flat_x, flat = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
            if self.span is not None and out.is_contiguous():
                lo, hi = self.span
                out.view(-1, out.shape[-1])[lo:hi].addmm_(flat_x[lo:hi] @ a.t(), b.t(), alpha=self.scale)
                return out
            delta = (flat_x.index_select(0, self.idx) @ a.t()) @ b.t()
            if torch.is_grad_enabled():
                return flat.index_add(0, self.idx, delta, alpha=self.scale).view_as(out)
            flat.index_add_(0, self.idx, delta, alpha=self.scale)
            return out

        return hook


def _pair(arch="llama", targets="all-linear", dtype=torch.float32, seed=0, **config):
    """(dlm with gated LoRA, the same model with the reference hooks, the bare base model), equal random adapters."""
    tok = make_tokenizer()
    dlm = convert_ar_to_dlm(make_model(arch, **config).to(dtype), "idlm", tokenizer=tok)
    ref, base = copy.deepcopy(dlm), copy.deepcopy(dlm.model)
    prepare_model_for_lora(dlm, LoraSettings(r=4, alpha=8, gated=True, target_modules=targets))
    g = dlm.gated_lora
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for a in g.adapters.values():
            a.B.copy_(torch.randn(a.B.shape, generator=gen, dtype=dtype) * 0.3)
        g.mask_embedding.add_(torch.randn(g.mask_embedding.shape, generator=gen, dtype=dtype))
    for p in ref.base_model_hf.parameters():
        p.requires_grad_(False)
    ref.hooked = _HookGated(ref.base_model_hf, dlm.mask_token_id, g.module_names, g.scale, g.adapter_state())
    return dlm, ref, base


def _ids(B, L, masks_at, mask_id, seed=0):
    x = torch.randint(5, 300, (B, L), generator=torch.Generator().manual_seed(seed))
    for r, c in masks_at:
        x[r, c] = mask_id
    return x


# masks: one run at batch 1 (decoding's in-place span path), in the middle of a row (clean rows after the run),
# scattered over two rows (gathered rows), most of the rows (dense with gradients)
LAYOUTS = {
    "span_end": (1, 9, [(0, 7), (0, 8)]),
    "span_mid": (1, 9, [(0, 3), (0, 4), (0, 5)]),
    "scattered": (2, 9, [(0, 2), (0, 6), (1, 4)]),
    "many": (2, 8, [(r, c) for r in range(2) for c in range(1, 8) if c % 3]),
}


def _linear_io(model):
    """Record every linear's (input, output) of the next forward."""
    seen, handles = [], []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D":
            handles.append(m.register_forward_hook(lambda mod, args, out, n=name: seen.append((n, mod, args[0], out))))
    return seen, handles


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("grad", [False, True])
def test_clean_rows_bit_for_bit_and_mask_rows_as_the_hooks(arch, layout, grad):
    """Each adapted linear's output is the base layer's at every row that is not a mask, bit for bit (torch.equal on
    its recorded input); the logits of rows before the first mask are the base model's bit for bit; and every row
    equals the hook reference (bit for bit where the maths is the same ops - groups of one, the in-place span -
    else to 2e-6 relative: the group's one matmul by the stacked A against one per adapter)."""
    dlm, ref, base = _pair(arch)
    B, L, where = LAYOUTS[layout]
    x = _ids(B, L, where, dlm.mask_token_id)
    gate = x == dlm.mask_token_id
    with torch.set_grad_enabled(grad):
        seen, handles = _linear_io(dlm.base_model_hf)
        got = dlm(input_ids=x).logits
        for h in handles:
            h.remove()
        want = ref(input_ids=x).logits
        bare = base(input_ids=x).logits
    assert dlm.gated_lora._dense == (grad and len(where) >= 0.25 * B * L)
    assert (dlm.gated_lora._span is not None) == (not grad and layout.startswith("span"))
    clean = ~gate.reshape(-1)
    adapted = {n for n in dlm.gated_lora.module_names}
    assert {n for n, *_ in seen} >= adapted
    for name, mod, inp, out in seen:
        if name not in adapted:
            continue
        w = mod.weight if isinstance(mod, nn.Linear) else mod.weight.t()
        plain = torch.nn.functional.linear(inp, w, mod.bias).reshape(-1, out.shape[-1])
        assert torch.equal(out.reshape(-1, out.shape[-1])[clean], plain[clean]), name
        assert not torch.allclose(out.reshape(-1, out.shape[-1])[~clean], plain[~clean], atol=1e-4), name
    for r in range(B):
        c = int(gate[r].float().argmax()) if gate[r].any() else L
        assert torch.equal(got[r, :c], bare[r, :c])
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert not torch.allclose(got[gate], bare[gate], atol=1e-3)  # the adapters act on masks


def test_groups_of_shared_input_one_matmul_each(monkeypatch):
    """q/k/v and gate/up are groups (one row gather and one A matmul per layer input), o_proj and down_proj groups
    of one; no adapted module carries a hook, and the model's state dict is the base model's."""
    dlm, _, base = _pair("llama")
    hf = dlm.base_model_hf
    assert [n for n, m in hf.named_modules() if m._forward_hooks or m._forward_pre_hooks] == [""]  # the gate only
    assert list(hf.state_dict()) == list(base.state_dict())
    rows = []
    real = _Group._rows
    monkeypatch.setattr(_Group, "_rows", lambda self, x: rows.append(len(self.adapters)) or real(self, x))
    layers = hf.config.num_hidden_layers
    for grad in (False, True):
        rows.clear()
        with torch.set_grad_enabled(grad):
            dlm(input_ids=_ids(1, 9, [(0, 7), (0, 8)], dlm.mask_token_id))
        # every group gathered its rows and took its A product once: q/k/v, gate/up, and o/down alone
        assert sorted(rows) == sorted([3, 2, 1, 1] * layers)
        assert all(g.x is None and g.u is None for g in dlm.gated_lora._pending)  # nothing held after the forward


@pytest.mark.parametrize("dense", [True, False])
def test_gradients_equal_the_hooks(dense):
    """The I-DLM training step ([x_t | x0], introspective mask) gives the hooks' loss and gradients (adapters and
    mask embedding), dense (torch.where) and through gathered rows: float64 to 1e-12 relative, float32 to 1e-5
    (the stacked A matmul rounds differently from one per adapter)."""
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        dlm, ref, _ = _pair("llama", dtype=dtype)
        frac = 0.0 if dense else 1.0
        dlm.gated_lora.dense_fraction = ref.hooked.dense_fraction = frac
        x0 = _ids(2, 12, [], dlm.mask_token_id)
        xt = x0.clone()
        xt[:, 6:] = dlm.mask_token_id
        xt[0, 2] = dlm.mask_token_id
        am = masks.dense(masks.introspective(12, 2), 2, 24)
        pos = torch.arange(12).repeat(2)[None].expand(2, -1)
        grads = []
        for m in (dlm, ref):
            m.train()
            logits = m(input_ids=torch.cat([xt, x0], 1), attention_mask=am, position_ids=pos).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :12].reshape(-1, logits.shape[-1]), x0.reshape(-1))
            loss.backward()
            grads.append({"loss": loss.detach(), **_named_grads(m)})
        assert dlm.gated_lora._dense == dense
        assert grads[0].keys() == grads[1].keys()
        for k in grads[0]:
            torch.testing.assert_close(grads[0][k], grads[1][k], rtol=tol, atol=tol * 1e-2, msg=k)
        assert all(float(v.abs().max()) > 0 for k, v in grads[0].items() if k.endswith(".A"))


def _named_grads(m):
    if getattr(m, "hooked", None) is not None:
        h = m.hooked
        out = {f"{k}.A": h.A[k].grad for k in h.A}
        out.update({f"{k}.B": h.B[k].grad for k in h.B})
        out["mask_embedding"] = h.mask_embedding.grad
        return out
    g = m.gated_lora
    out = {f"{k}.A": a.A.grad for k, a in g.adapters.items()}
    out.update({f"{k}.B": a.B.grad for k, a in g.adapters.items()})
    out["mask_embedding"] = g.mask_embedding.grad
    return out


def test_checkpoints_load_both_ways(tmp_path):
    """A checkpoint written now has the layout the hooks read (the same tensor keys and config entry): its base
    model with the hooks on its tensors gives the hooks' logits bit for bit; the hooks' tensors written in that
    layout load here as the same model."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    dlm, ref, _ = _pair("llama", targets="q_proj,v_proj")
    x = _ids(2, 10, [(0, 8), (0, 9), (1, 3)], dlm.mask_token_id)
    with torch.no_grad():
        want = ref.base_model_hf(input_ids=x).logits
        got = dlm.base_model_hf(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    dlm.save_pretrained(tmp_path / "new")
    state = load_file(str(tmp_path / "new" / ADAPTER_FILE))
    keys = {"mask_embedding"} | {f"{n.replace('.', '__')}.{p}" for n in dlm.gated_lora.module_names for p in "AB"}
    assert set(state) == keys
    entry = json.loads((tmp_path / "new" / "config.json").read_text())[CONFIG_KEY]
    assert entry["target_modules"] == dlm.gated_lora.module_names and entry["gated"] is True
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "new", attn_implementation="sdpa")
    _HookGated(plain, dlm.mask_token_id, entry["target_modules"], entry["alpha"] / entry["r"], state)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=x).logits, want)
    h = ref.hooked
    old = {"mask_embedding": h.mask_embedding.detach()}
    old.update({f"{k}.A": v.detach() for k, v in h.A.items()})
    old.update({f"{k}.B": v.detach() for k, v in h.B.items()})
    save_file(old, str(tmp_path / "new" / ADAPTER_FILE), metadata={"format": "dlm-gated-lora"})
    loaded = AutoDLMForCausalLM.from_pretrained(tmp_path / "new")
    with torch.no_grad():
        assert torch.equal(loaded.base_model_hf(input_ids=x).logits, got)


def test_remove_gives_the_base_modules_back():
    dlm, _, base = _pair("gpt2")
    hf = dlm.base_model_hf
    g = dlm.gated_lora
    g.remove()
    from dlm.model.lora import EMB_SLOT, SLOT

    assert not any(SLOT in m.__dict__ or EMB_SLOT in m.__dict__ for m in hf.modules())
    assert not hf._forward_pre_hooks
    assert [type(m) for m in hf.modules()] == [type(m) for m in base.modules()]
    x = _ids(1, 6, [(0, 5)], dlm.mask_token_id)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=x).logits, base(input_ids=x).logits)
    GatedLoRA(hf, dlm.mask_token_id, g.settings, g.module_names)  # and it can be gated again


# -- through the CPU kernels (dlm.decode.cpu): the fused decoder layers add the same deltas ---------------------


def _kernels():
    from dlm.decode import cpu

    if cpu.extension() is None:
        pytest.skip("the CPU kernels could not be built here (no compiler?)")
    return cpu


def _cached_chunk(hf, ids, kernels: bool, mask=None):
    """The logits of ``ids[:, 6:]`` (positions 6..) as a cached chunk after a 6-token prefill of ``ids[:, :6]``,
    through the CPU kernels or not."""
    from transformers import DynamicCache

    from dlm.decode import cpu

    b, t = ids.shape
    pos = torch.arange(6, t)[None].expand(b, t - 6)
    with torch.no_grad(), cpu.active(kernels):
        cache = DynamicCache()
        hf(input_ids=ids[:, :6], past_key_values=cache, use_cache=True)
        return hf(
            input_ids=ids[:, 6:], past_key_values=cache, use_cache=True, attention_mask=mask, position_ids=pos
        ).logits


@pytest.mark.parametrize("targets", ["q_proj,v_proj", "all-linear"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_layers_add_the_deltas(targets, batch, monkeypatch):
    """A cached decode chunk [clean, clean, M, M] through the kernels' fused decoder layers: every row equals the
    same model's stock forward to 1e-4 (the kernels round differently from BLAS); the clean rows equal the kernels'
    own run of the same chunk with the adapters idle - bit for bit with q/v adapters (the fused layer's two halves
    are the same kernels; all-linear adapters send the MLP through linears + its own activation, to 1e-5). With q/v
    adapters each layer of the chunk is its two kernel calls (the deltas inside the first, layer_in_gated); with
    all-linear ones, at batch 1, each adapter's delta is one lora_add kernel call."""

    from dlm.decode.cpu import runtime

    cpu = _kernels()
    dlm, _, _ = _pair("llama", targets=targets, hidden=64, heads=4, kv_heads=2)
    hf, g, m = dlm.base_model_hf, dlm.gated_lora, dlm.mask_token_id
    ids = _ids(batch, 10, [(r, c) for r in range(batch) for c in (8, 9)], m, seed=3)

    def chunk(kernels: bool, idle: bool = False):
        g.mask_token_id = -1 if idle else m
        out = _cached_chunk(hf, ids, kernels)
        g.mask_token_id = m
        return out

    stock = chunk(False)
    assert cpu.attach(dlm)
    counting = CallCounter(runtime.STATE.ops)
    monkeypatch.setattr(runtime.STATE, "ops", counting)
    got = chunk(True)
    calls = dict(counting.calls)
    idle = chunk(True, idle=True)
    torch.testing.assert_close(got, stock, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got[:, 2:], idle[:, 2:], atol=1e-3)  # the adapters acted on the masks
    if targets == "q_proj,v_proj":
        assert torch.equal(got[:, :2], idle[:, :2])
        assert calls.get("layer_in_gated") == hf.config.num_hidden_layers and "lora_add" not in calls
        assert calls.get("layer_out") == hf.config.num_hidden_layers  # (the prompt, 6 tokens, takes SDPA)
    else:
        torch.testing.assert_close(got[:, :2], idle[:, :2], rtol=1e-5, atol=1e-5)
        if batch == 1:
            assert calls.get("lora_add") == len(g.adapters)
    cpu.detach(dlm)


def _isas():
    from dlm.decode import cpu

    ext = cpu.extension()
    return ext.isas().split(",") if ext is not None else ["none"]


# chunk [4 tokens] after a 6-token prompt: the masks at its end (batch 1), in its middle with a clean row after them
# (batch 1), and at the ends of two rows (batch 2, as the engine batches ISD chunks: flattened rows 2-3 and 7)
QKV_LAYOUTS = {"end": (1, [(0, 8), (0, 9)]), "middle": (1, [(0, 7), (0, 8)]), "rows": (2, [(0, 8), (0, 9), (1, 9)])}


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("layout", sorted(QKV_LAYOUTS))
@pytest.mark.parametrize("targets", ["q_proj,v_proj", "q_proj,k_proj,v_proj"])
def test_qkv_deltas_inside_the_layers_first_call_are_the_per_op_path(targets, layout, isa, monkeypatch):
    """With gated adapters on q/k/v only and mask rows in the forward, each fused layer adds the deltas inside its
    first kernel call (layer_in_gated: after the projections, before the rotary embedding) and runs as two calls
    like a model without adapters. It is the per-op path's kernels on the same rows (rms_norm, linears, one lora_add
    per run of consecutive mask rows, rope): at batch 1 (the masks one run) the logits are that path's bit for bit,
    mask rows included; with masks closing several rows of a batch the per-op path adds the deltas with torch's
    index_add, so there the clean rows are bit for bit and the mask rows to 1e-5. On every instruction set this
    CPU runs; the stock model's logits to 1e-4."""

    from dlm.decode.cpu import layer as cpu_layer
    from dlm.decode.cpu import runtime

    cpu = _kernels()
    batch, masks_at = QKV_LAYOUTS[layout]
    dlm, _, _ = _pair("llama", targets=targets, hidden=64, heads=4, kv_heads=2, seed=5)
    hf, m = dlm.base_model_hf, dlm.mask_token_id
    ids = _ids(batch, 10, masks_at, m, seed=6)
    gated = (ids[:, 6:] == m)[..., None].expand(batch, 4, hf.config.vocab_size)

    def chunk(kernels: bool):
        return _cached_chunk(hf, ids, kernels)

    stock = chunk(False)
    assert cpu.attach(dlm)
    cpu.set_isa(isa)
    try:
        ext_ = runtime.STATE.ops
        counting = CallCounter(ext_)
        monkeypatch.setattr(runtime.STATE, "ops", counting)
        got = chunk(True)
        assert counting.calls.get("layer_in_gated") == hf.config.num_hidden_layers
        assert "lora_add" not in counting.calls and "rope" not in counting.calls
        counting = CallCounter(ext_)
        monkeypatch.setattr(runtime.STATE, "ops", counting)
        with monkeypatch.context() as mp:
            mp.setattr(cpu_layer, "qkv_deltas", lambda projs, rows, form: None)  # the per-op path
            per_op = chunk(True)
        assert "layer_in_gated" not in counting.calls and counting.calls.get("rope")
    finally:
        cpu.set_isa("auto")
        cpu.detach(dlm)
    if batch == 1:
        assert torch.equal(got, per_op)
    else:
        assert torch.equal(got[~gated], per_op[~gated])
        torch.testing.assert_close(got, per_op, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, stock, rtol=1e-4, atol=1e-4)


def test_qkv_deltas_follow_adapters_updated_in_place(monkeypatch):
    """Training between decodes (an optimizer step on the adapters, in place): the next fused forward repacks them,
    so its mask rows are the updated adapters' - bit for bit the per-op path's - and no longer the old ones'."""
    from dlm.decode.cpu import layer as cpu_layer

    cpu = _kernels()
    dlm, _, _ = _pair("llama", targets="q_proj,v_proj", hidden=64, heads=4, kv_heads=2, seed=7)
    hf, m = dlm.base_model_hf, dlm.mask_token_id
    ids = _ids(1, 10, [(0, 8), (0, 9)], m, seed=8)
    assert cpu.attach(dlm)
    try:
        before = _cached_chunk(hf, ids, True)
        with torch.no_grad():
            for a in dlm.gated_lora.adapters.values():
                a.B.mul_(-2.0)
        after = _cached_chunk(hf, ids, True)
        with monkeypatch.context() as mp:
            mp.setattr(cpu_layer, "qkv_deltas", lambda projs, rows, form: None)  # the per-op path
            per_op = _cached_chunk(hf, ids, True)
    finally:
        cpu.detach(dlm)
    assert torch.equal(after, per_op)
    assert torch.equal(after[:, :2], before[:, :2])  # the clean rows: the base model's either way
    assert not torch.allclose(after[:, 2:], before[:, 2:], atol=1e-3)


@pytest.mark.parametrize("targets", ["q_proj,v_proj", "all-linear"])
def test_fused_layers_without_mask_rows_take_the_two_call_path(targets, monkeypatch):
    """A forward without a mask token (an AR step of a gated model) adds no delta anywhere: with q/v adapters each
    fused layer runs as its two kernel calls (layer_in, layer_out) like a model without adapters, its logits bit
    for bit those of the per-op path the adapters take with mask rows (so greedy ISD still equals the model's own
    AR); adapters on gate/up keep the per-op path (the MLP's own activation, which rounds differently from the
    fused one). Both the stock model's logits to rounding."""

    from dlm.decode.cpu import layer as cpu_layer
    from dlm.decode.cpu import runtime

    cpu = _kernels()
    dlm, _, _ = _pair("llama", targets=targets, hidden=64, heads=4, kv_heads=2)
    hf = dlm.base_model_hf
    ids = _ids(2, 10, [], dlm.mask_token_id, seed=4)
    mask = torch.ones(2, 1, 4, 10, dtype=torch.bool)
    mask[..., 6:] = torch.ones(4, 4, dtype=torch.bool).tril_()

    def chunk(kernels: bool):
        return _cached_chunk(hf, ids, kernels, mask)

    stock = chunk(False)
    assert cpu.attach(dlm)
    ext_ = runtime.STATE.ops
    counting = CallCounter(ext_)
    monkeypatch.setattr(runtime.STATE, "ops", counting)
    got = chunk(True)
    two_calls = hf.config.num_hidden_layers if targets == "q_proj,v_proj" else None
    assert counting.calls.get("layer_in") == two_calls and "lora_add" not in counting.calls
    counting = CallCounter(ext_)
    monkeypatch.setattr(runtime.STATE, "ops", counting)
    monkeypatch.setattr(cpu_layer, "gates", lambda m: runtime.gated(m) is not None)  # any adapter: the per-op path
    per_op = chunk(True)
    assert "layer_in" not in counting.calls
    assert torch.equal(got, per_op)
    torch.testing.assert_close(got, stock, rtol=1e-4, atol=1e-4)
    cpu.detach(dlm)


@pytest.mark.parametrize("targets", ["q_proj,v_proj", "all-linear"])
def test_engine_isd_with_gated_adapters_is_the_base_model(targets):
    """Lossless end to end: the engine's greedy ISD (through the CPU kernels where they build) on a model with
    strong random gated adapters gives the base model's greedy tokens (transformers generate on the model before
    the adapters)."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams

    tok = make_tokenizer()
    dlm = convert_ar_to_dlm(
        make_model("llama", seed=1, hidden=64, heads=4, kv_heads=2), "idlm", block_size=3, tokenizer=tok
    )
    dlm.model.generation_config.eos_token_id = None
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    k = 12
    want = [
        dlm.model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=k, pad_token_id=3)[0, len(p) :].tolist()
        for p in prompts
    ]
    prepare_model_for_lora(dlm, LoraSettings(r=4, alpha=8, gated=True, target_modules=targets))
    with torch.no_grad():
        for a in dlm.gated_lora.adapters.values():
            a.B.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    res = Engine(dlm, decoder="isd", stride=3, options=EngineOptions(max_batch_size=2)).generate(
        prompts, SamplingParams(k, ignore_eos=True)
    )
    assert [r.token_ids for r in res] == want


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("grad", [False, True])
def test_sync_free_gate_reads_nothing_on_the_host_and_keeps_clean_rows(arch, layout, grad):
    """With ``sync_free`` (what a CUDA graph capture runs) a forward of the gated model reads on the host exactly what
    the bare base model's forward reads (the counter sees the gate's mask count and row index otherwise); clean rows
    of every adapted linear are the base layer's bit for bit, the logits before the first mask the base model's bit
    for bit, and every row equals the counted path's to 2e-6 (its deltas in another order of operations)."""
    from dlm.model.lora import attached, sync_free
    from dlm.testing import HostReads

    dlm, _, base = _pair(arch)
    B, L, where = LAYOUTS[layout]
    x = _ids(B, L, where, dlm.mask_token_id)
    gate = x == dlm.mask_token_id
    with torch.set_grad_enabled(grad):
        with HostReads() as bare_reads:
            bare = base(input_ids=x).logits
        with HostReads() as counted_reads:
            counted = dlm(input_ids=x).logits
        assert attached(dlm) == attached(dlm.base_model_hf) == [dlm.gated_lora]
        with sync_free(dlm):
            assert dlm.gated_lora.sync_free
            seen, handles = _linear_io(dlm.base_model_hf)
            with HostReads() as free_reads:
                got = dlm(input_ids=x).logits
            for h in handles:
                h.remove()
        assert not dlm.gated_lora.sync_free  # put back
    assert free_reads.seen == bare_reads.seen
    assert len(counted_reads.seen) > len(bare_reads.seen)
    clean = ~gate.reshape(-1)
    adapted = set(dlm.gated_lora.module_names)
    for name, mod, inp, out in seen:
        if name in adapted:
            w = mod.weight if isinstance(mod, nn.Linear) else mod.weight.t()
            plain = torch.nn.functional.linear(inp, w, mod.bias).reshape(-1, out.shape[-1])
            assert torch.equal(out.reshape(-1, out.shape[-1])[clean], plain[clean]), name
    for r in range(B):
        c = int(gate[r].float().argmax()) if gate[r].any() else L
        assert torch.equal(got[r, :c], bare[r, :c])
    torch.testing.assert_close(got, counted, rtol=2e-6, atol=2e-6)
    assert not torch.allclose(got[gate], bare[gate], atol=1e-3)


def test_sync_free_gradients_equal_the_counted_path():
    """Training through the sync-free gate (dense on every row) gives the counted path's gradients."""
    from dlm.model.lora import sync_free

    grads = []
    for free in (False, True):
        dlm, _, _ = _pair("llama", seed=3)
        x = _ids(*LAYOUTS["scattered"][:2], LAYOUTS["scattered"][2], dlm.mask_token_id)
        with sync_free(dlm) if free else torch.enable_grad():
            dlm(input_ids=x).logits.square().mean().backward()
        g = dlm.gated_lora
        grads.append([p.grad.clone() for p in g.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(a.abs().sum() > 0 for a in grads[1])


@pytest.mark.parametrize("static_cache", [False, True])
def test_engine_isd_with_a_sync_free_gate_is_the_base_model(static_cache):
    """Lossless with the gate a CUDA graph would capture: greedy ISD through the sync-free gate (here on the CPU,
    in the growing and the static cache) gives the base model's greedy tokens."""
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams
    from dlm.model.lora import sync_free

    dlm = convert_ar_to_dlm(
        make_model("llama", seed=1, hidden=64, heads=4, kv_heads=2), "idlm", block_size=3, tokenizer=make_tokenizer()
    )
    dlm.model.generation_config.eos_token_id = None
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    want = [
        dlm.model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, pad_token_id=3)[0, len(p) :].tolist()
        for p in prompts
    ]
    prepare_model_for_lora(dlm, LoraSettings(r=4, alpha=8, gated=True, target_modules="all-linear"))
    with torch.no_grad():
        for a in dlm.gated_lora.adapters.values():
            a.B.normal_(0, 0.3, generator=torch.Generator().manual_seed(0))
    eng = Engine(dlm, decoder="isd", stride=3, options=EngineOptions(max_batch_size=2, static_cache=static_cache))
    with sync_free(dlm):
        res = eng.generate(prompts, SamplingParams(12, ignore_eos=True))
        assert dlm.gated_lora._n_gated == -1  # the forwards went through the uncounted gate
    assert [r.token_ids for r in res] == want


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("acting", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decoder_stack_in_one_call_is_the_layer_loop_bit_for_bit(arch, acting, isa, monkeypatch):
    """With the engine's growing KV cache, a decode chunk whose every layer takes its two kernel calls runs as one
    ``decode_stack`` call (the layers and the cache writes in C++). On a prefill of 2 rows, a 4-token chunk with a
    hole in one row's cache and masks closing both rows (the gated q/v adapters acting on them, or idle), then a
    1-token step without a mask: logits and every layer's cached keys and values bit for bit the per-layer loop's
    (one call per forward there, none of the loop's per-layer calls); Qwen2's q/k/v biases included."""
    from dlm.decode.cpu import runtime
    from dlm.decode.engine import KVBatch

    cpu = _kernels()
    dlm, _, _ = _pair(arch, targets="q_proj,v_proj", hidden=64, heads=4, kv_heads=2, seed=7)
    hf, g, m = dlm.base_model_hf, dlm.gated_lora, dlm.mask_token_id
    ids = _ids(2, 11, [(0, 8), (0, 9), (1, 9)], m, seed=8)
    if not acting:
        g.mask_token_id = -1
    mask = torch.ones(2, 1, 4, 10, dtype=torch.bool)
    mask[1, ..., 3] = False  # a hole in row 1's cache
    mask[..., 6:] = torch.ones(4, 4, dtype=torch.bool).tril_()
    handle = cpu.attach(dlm)
    assert handle
    cpu.set_isa(isa)
    ext_ = runtime.STATE.ops

    def run(one: bool):
        monkeypatch.setattr(handle.options, "one_call", one)  # (the forwards read the attach's options)
        counting = CallCounter(ext_)
        monkeypatch.setattr(runtime.STATE, "ops", counting)
        kv = KVBatch()
        with torch.no_grad(), cpu.active():
            hf(input_ids=ids[:, :6], past_key_values=kv.cache, use_cache=True)
            pos = torch.arange(6, 10)[None].expand(2, 4)
            chunk = hf(input_ids=ids[:, 6:10], past_key_values=kv.cache, attention_mask=mask, position_ids=pos)
            step = hf(input_ids=ids[:, 10:], past_key_values=kv.cache, position_ids=torch.tensor([[10], [10]]))
        return chunk.logits, step.logits, kv.cache, counting.calls

    try:
        chunk, step, cache, calls = run(True)
        chunk_l, step_l, cache_l, calls_l = run(False)
    finally:
        cpu.set_isa("auto")
        cpu.detach(dlm)
        g.mask_token_id = m
    assert calls.get("decode_stack") == 2 and "layer_out" not in calls and "layer_in_gated" not in calls
    assert "decode_stack" not in calls_l and calls_l.get("layer_out") == 2 * hf.config.num_hidden_layers
    assert calls_l.get("layer_in_gated", 0) == (hf.config.num_hidden_layers if acting else 0)
    assert torch.equal(chunk, chunk_l) and torch.equal(step, step_l)
    for a, b in zip(cache.layers, cache_l.layers):
        assert a.keys.shape[2] == 11 and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_decode_stack_plans_follow_the_model_between_forwards(monkeypatch):
    """decode_stack's arguments are kept from one forward to the next (dlm.decode.cpu.stack._StackPlan) and built again where
    what they came from changed: a projection's weight updated in place (an optimizer step) or replaced, a norm's
    weight replaced, a weight's data swapped (``.data =``), the adapters updated in place, a hook registered on a projection and removed again, the
    adapters taken off. Forwards over the engine's growing cache with such changes between them - chunks whose
    masks the adapters act on and 1-token steps - give the per-layer loop's logits bit for bit at every forward
    (the loop runs every layer's checks each time), and the forwards without a hook take one decode_stack call."""
    from dlm.decode.cpu import runtime
    from dlm.decode.engine import KVBatch

    cpu = _kernels()

    def run(one: bool):
        dlm, _, _ = _pair("llama", targets="q_proj,v_proj", hidden=64, heads=4, kv_heads=2, seed=9)
        hf, g, m = dlm.base_model_hf, dlm.gated_lora, dlm.mask_token_id
        layers = hf.model.layers
        handles = []

        def hook(mod, args, out):
            return out + 0.25

        q0, v1, down1, norm0 = (
            layers[0].self_attn.q_proj,
            layers[1].self_attn.v_proj,
            layers[1].mlp.down_proj,
            layers[0].input_layernorm,
        )
        # (chunk length, the change before it): 3 = a chunk closed by a mask in both rows (the adapters act), 1 = a
        # 1-token step; each change comes before a forward whose kept plan would otherwise still be taken
        schedule = [
            (3, None),
            (1, None),
            (3, None),
            (1, None),
            (3, lambda: q0.weight.mul_(1.5)),
            (1, None),
            (3, lambda: setattr(v1, "weight", nn.Parameter(v1.weight * 0.5))),
            (1, None),
            (3, lambda: setattr(norm0, "weight", nn.Parameter(norm0.weight * 2))),
            (1, None),
            (3, lambda: [a.B.mul_(-2.0) for a in g.adapters.values()]),
            (1, None),
            (3, lambda: setattr(down1.weight, "data", down1.weight * 0.75)),
            (1, None),
            (3, lambda: handles.append(layers[1].self_attn.q_proj.register_forward_hook(hook))),
            (1, None),
            (3, lambda: handles.pop().remove()),
            (3, None),
            (3, g.remove),
            (1, None),
        ]
        gen = torch.Generator().manual_seed(10)
        assert cpu.attach(dlm, runtime.KernelOptions.from_env(one_call=one))
        counting = CallCounter(runtime.STATE.ops)
        monkeypatch.setattr(runtime.STATE, "ops", counting)
        kv, out, stacked = KVBatch(), [], []
        try:
            with torch.no_grad(), cpu.active():
                hf(input_ids=torch.randint(5, 300, (2, 6), generator=gen), past_key_values=kv.cache, use_cache=True)
                n = 6
                for t, change in schedule:
                    if change is not None:
                        change()
                    ids = torch.randint(5, 300, (2, t), generator=gen)
                    mask = None
                    if t > 1:
                        ids[:, -1] = m
                        mask = torch.ones(2, 1, t, n + t, dtype=torch.bool)
                        mask[..., n:] = torch.ones(t, t, dtype=torch.bool).tril_()
                    pos = torch.arange(n, n + t)[None].expand(2, t)
                    before = counting.calls.get("decode_stack", 0)
                    out.append(
                        hf(input_ids=ids, past_key_values=kv.cache, attention_mask=mask, position_ids=pos).logits
                    )
                    stacked.append(counting.calls.get("decode_stack", 0) - before)
                    n += t
        finally:
            monkeypatch.setattr(runtime.STATE, "ops", counting.mod)
            cpu.detach(dlm)
        return out, stacked

    got, stacked = run(True)
    want, stacked_l = run(False)
    assert stacked == [0 if i in (14, 15) else 1 for i in range(20)] and not any(stacked_l)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"forward {i}"


def _big_adapters(seed: int):
    """A gated I-DLM whose q/v adapters are large enough (r = 32 on a 128-wide model) for the kernels' 8-bit form."""
    tok = make_tokenizer()
    dlm = convert_ar_to_dlm(make_model("llama", hidden=128, heads=4, kv_heads=2), "idlm", tokenizer=tok)
    prepare_model_for_lora(dlm, LoraSettings(r=32, alpha=32, gated=True, target_modules="q_proj,v_proj"))
    g = dlm.gated_lora
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for a in g.adapters.values():
            a.B.copy_(torch.randn(a.B.shape, generator=gen) * 0.3)
    return dlm


def test_adapters_in_8_bit_blocks_are_the_model_with_rounded_adapters(monkeypatch):
    """By default the kernels hold the gated adapters in 8-bit blocks (packing.q8_rounded: the fp16 scale nearest
    max|w| / 127 per 32 inputs, as GGUF's Q8_0). A cached chunk [clean, clean, M, M] through the fused layers: the
    clean rows are bit for bit those with the adapters exact (the base model's), the mask rows are the stock forward
    of the same model with its adapter matrices replaced by their rounded values (to 1e-4, BLAS rounding) and not
    the exact adapters' rows; DLM_CPU_ADAPTERS=f32 gives the exact adapters'. Greedy ISD on the engine still
    decodes the model's own AR tokens."""
    from dlm.decode import cpu as cpu_kernels
    from dlm.decode.configs import ISDConfig
    from dlm.decode.cpu import packing, runtime
    from dlm.decode.engine import Engine
    from dlm.decode.sampling import SamplingParams

    cpu = _kernels()
    dlm = _big_adapters(seed=11)
    hf, m = dlm.base_model_hf, dlm.mask_token_id
    ids = _ids(1, 10, [(0, 8), (0, 9)], m, seed=12)
    rounded = copy.deepcopy(dlm)
    with torch.no_grad():
        n_rounded = 0
        for a in rounded.gated_lora.adapters.values():
            for p in (a.A, a.B):
                r = packing.q8_rounded(p)
                if r is not None:
                    p.copy_(r[1])
                    n_rounded += 1
    assert n_rounded >= 3  # A of q and v, B of q (v's B has under 4,096 weights: exact)
    want = _cached_chunk(rounded.base_model_hf, ids, False)

    def chunk(form):
        monkeypatch.setenv(runtime.ADAPTER_ENV, form)
        assert cpu_kernels.attach(dlm)
        try:
            return _cached_chunk(hf, ids, True)
        finally:
            cpu_kernels.detach(dlm)

    q8, exact = chunk("q8_0"), chunk("f32")
    assert torch.equal(q8[:, :2], exact[:, :2])
    torch.testing.assert_close(q8, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(q8[:, 2:], exact[:, 2:], rtol=0, atol=1e-5)
    torch.testing.assert_close(exact, _cached_chunk(hf, ids, False), rtol=1e-4, atol=1e-4)
    # on the engine's cache (one decode_stack call, its arguments kept between forwards): the form switched between
    # two forwards is the one the second takes
    from dlm.decode.engine import KVBatch

    def stacked():
        kv = KVBatch()
        with torch.no_grad(), cpu_kernels.active():
            hf(input_ids=ids[:, :6], past_key_values=kv.cache, use_cache=True)
            hf(input_ids=ids[:, 6:7], past_key_values=kv.cache, position_ids=torch.tensor([[6]]))  # the buffers
            pos = torch.arange(7, 10)[None]
            return hf(input_ids=ids[:, 7:], past_key_values=kv.cache, position_ids=pos).logits

    monkeypatch.delenv(runtime.ADAPTER_ENV)
    handle = cpu_kernels.attach(dlm)
    assert handle and handle.options.adapter_form == "q8_0"  # (DLM_CPU_ADAPTERS unset: the default)
    try:
        first = stacked()
        monkeypatch.setattr(handle.options, "adapter_form", "f32")
        second = stacked()
    finally:
        cpu_kernels.detach(dlm)
    torch.testing.assert_close(first[:, 1:], q8[:, 2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(second[:, 1:], exact[:, 2:], rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(runtime.ADAPTER_ENV, "int4")
    with pytest.raises(Exception, match="DLM_CPU_ADAPTERS='int4'"):
        cpu_kernels.attach(dlm)
    monkeypatch.delenv(runtime.ADAPTER_ENV)
    assert cpu.attach(dlm)
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
        with Engine(dlm, decoder="ar", options=EngineOptions(max_batch_size=2)) as e:
            ar = [r.token_ids for r in e.generate(prompts, params)]
        with Engine(dlm, decoder=ISDConfig(stride=2), options=EngineOptions(max_batch_size=2)) as e:
            isd = [r.token_ids for r in e.generate(prompts, params)]
    finally:
        cpu.detach(dlm)
    assert isd == ar


def test_q8_rounded_packing_is_the_rounded_weights_bit_for_bit():
    """packing.q8_rounded: the kernels' product with its packing is bit for bit their product with the fp32 packing of
    the weights it stands for (d * q is exact in fp32); each weight within half a step (d / 2) of the original; the
    scale an fp16 value; nothing for K not a multiple of 32 or under 4,096 weights."""
    from dlm.decode.cpu import packing

    ops = _kernels().extension()
    w = torch.randn(80, 96, generator=torch.Generator().manual_seed(13))
    w[3, :32] = 0.0  # an all-zero block: scale 0, weights 0
    packed, deq = packing.q8_rounded(w)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(14))
    assert torch.equal(ops.linear(x, packed, 80, None, None), ops.linear(x, ops.pack(deq, False), 80, None, None))
    d = (w.reshape(80, 3, 32).abs().amax(-1, keepdim=True) / 127).half().float()
    assert torch.all((deq.reshape(80, 3, 32) - w.reshape(80, 3, 32)).abs() <= d / 2 + 1e-12)
    assert torch.equal(deq[3, :32], torch.zeros(32))
    assert packing.q8_rounded(torch.randn(200, 40)) is None and packing.q8_rounded(torch.randn(20, 64)) is None
