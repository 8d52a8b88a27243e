"""A few-row fp32 linear kernel for CPU decoding: why an ISD chunk of 3-8 tokens can cost what 1 token costs.

At batch 1 a decode forward of a small model on a CPU is bound by streaming the weights from memory: a 1-token
step reads every weight once and does 2 FLOPs per weight. A chunk of M tokens reads the same weights, so with a
kernel that keeps up it should cost about the same. The BLAS kernels do not: measured on a 2-core Xeon (AVX-512),
SmolLM2-135M's 211 projections (lm_head included) through ``F.linear`` cost 1.19x / 1.65x / 2.07x of the 1-row
time for M = 3 / 4 / 8 rows (``bench/gemm_rows.py``), so ISD's extra tokens were not free there.

This kernel streams a pre-packed copy of each weight (``[ceil(N/32), K, 32]``: 32 output columns at a time, K
contiguous) once per call, keeps M x 32 accumulators in vector registers (8 rows per pass; further passes re-read
the packed block from L2) and prefetches the weight stream ahead of the arithmetic, so that the multiply-adds of
up to 8 rows overlap the memory traffic: measured 0.90x / 0.99x / 1.07x of ``F.linear``'s 1-row time for
M = 1 / 3 / 8.

Exactness: every output element is one fused multiply-add chain over ``k = 0 .. K-1`` in order, whatever M and
whatever the other rows are. A row's result is therefore bit-for-bit the same alone or inside any chunk or batch
(the BLAS kernels do not promise that: they pick different blockings for different M), so greedy ISD, whose verify
rows share a forward with drafts and masks, equals greedy AR through this kernel exactly at the linear layers. It
differs from ``F.linear`` by float rounding (~1e-5 relative), as any other kernel would.

Use: :func:`attach` packs a model's linear layers (nn.Linear and GPT-2's Conv1D; an extra copy of their weights,
so it is skipped when that copy would not fit comfortably in RAM) and routes their forward through the kernel only
inside :func:`active` (the decoding engine wraps its forwards in it), only without gradients, for fp32 CPU inputs
of at most :data:`MAX_ROWS` rows. Everything else (training, the base model's own ``generate``, GPUs) runs the
stock layer. The packed copy follows the weights: a layer whose weight changed in place since it was packed (an
optimizer step between two evaluations) is packed again at its next call.

The kernel is C++ compiled on first use with torch's ``cpp_extension`` (30-40 s, cached under
``TORCH_EXTENSIONS_DIR``; needs a C++ compiler and ninja). ``DLM_CPU_KERNEL=0`` turns it off; ``=1`` makes a
failed build an error instead of a warning and a fallback to ``F.linear``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import warnings

import torch
from torch import nn

MAX_ROWS = 64  # rows (tokens x batch) per call up to which the kernel is used; above, BLAS is compute-efficient
RAM_SHARE = 0.25  # pack only when the packed copy takes at most this share of physical memory
ENV = "DLM_CPU_KERNEL"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>

// 16 floats; aligned(4): loads and stores through it are unaligned ones
typedef float v16 __attribute__((vector_size(64), aligned(4)));
constexpr int64_t COLS = 32;   // output columns per packed block (two 16-float vectors)
constexpr int64_t PF = 1024;   // prefetch distance in floats along the packed weight stream (4 KiB)

torch::Tensor pack(torch::Tensor w, bool transposed) {
  // w: [N, K] (nn.Linear) or [K, N] (transposed: GPT-2's Conv1D) -> [ceil(N/32), K, 32], zero padded
  auto wt = transposed ? w.t() : w;
  int64_t N = wt.size(0), K = wt.size(1), NB = (N + COLS - 1) / COLS;
  auto padded = torch::zeros({NB * COLS, K}, w.options());
  padded.narrow(0, 0, N).copy_(wt);
  return padded.view({NB, COLS, K}).transpose(1, 2).contiguous();
}

template <int MB>
static inline void rows_block(const float* x, int64_t ldx, const float* wp, int64_t K, float* out,
                              int64_t ldo, int64_t ncols, const float* bias, float alpha, bool accumulate) {
  v16 a0[MB], a1[MB];
  for (int m = 0; m < MB; m++) { a0[m] = v16{}; a1[m] = v16{}; }
  for (int64_t k = 0; k < K; k++) {
    const float* w = wp + k * COLS;
    __builtin_prefetch(w + PF, 0, 3);
    __builtin_prefetch(w + PF + 16, 0, 3);
    v16 w0 = *reinterpret_cast<const v16*>(w);
    v16 w1 = *reinterpret_cast<const v16*>(w + 16);
    for (int m = 0; m < MB; m++) {
      float xv = x[m * ldx + k];
      a0[m] += w0 * xv;
      a1[m] += w1 * xv;
    }
  }
  for (int m = 0; m < MB; m++) {
    float tmp[COLS];
    *reinterpret_cast<v16*>(tmp) = a0[m];
    *reinterpret_cast<v16*>(tmp + 16) = a1[m];
    float* o = out + m * ldo;
    if (accumulate) for (int64_t j = 0; j < ncols; j++) o[j] += alpha * tmp[j];
    else if (bias) for (int64_t j = 0; j < ncols; j++) o[j] = tmp[j] + bias[j];
    else for (int64_t j = 0; j < ncols; j++) o[j] = tmp[j];
  }
}

// out[M, N] (row stride ldo) = x[M, K] @ W.T (+ bias), or out += alpha * x @ W.T (accumulate)
static void linear_into(const float* xp, int64_t M, int64_t K, const float* pp, int64_t NB, int64_t N,
                        const float* bp, float* op, int64_t ldo, float alpha, bool accumulate) {
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; nb++) {
      int64_t ncols = std::min<int64_t>(COLS, N - nb * COLS);
      const float* w = pp + nb * K * COLS;
      const float* bb = bp ? bp + nb * COLS : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const float* xx = xp + m0 * K;
        float* oo = op + m0 * ldo + nb * COLS;
        switch (std::min<int64_t>(8, M - m0)) {
          case 1: rows_block<1>(xx, K, w, K, oo, ldo, ncols, bb, alpha, accumulate); break;
          case 2: rows_block<2>(xx, K, w, K, oo, ldo, ncols, bb, alpha, accumulate); break;
          case 3: rows_block<3>(xx, K, w, K, oo, ldo, ncols, bb, alpha, accumulate); break;
          case 4: rows_block<4>(xx, K, w, K, oo, ldo, ncols, bb, alpha, accumulate); break;
          case 5: rows_block<5>(xx, K, w, K, oo, ldo, ncols, bb, alpha, accumulate); break;
          case 6: rows_block<6>(xx, K, w, K, oo, ldo, ncols, bb, alpha, accumulate); break;
          case 7: rows_block<7>(xx, K, w, K, oo, ldo, ncols, bb, alpha, accumulate); break;
          default: rows_block<8>(xx, K, w, K, oo, ldo, ncols, bb, alpha, accumulate);
        }
      }
    }
  });
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  // x: [M, K] contiguous fp32; packed: [NB, K, 32]; -> [M, N]
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && packed.size(1) == x.size(1), "cpu_linear: bad shapes");
  int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty({M, N}, x.options());
  const float* bp = (bias.has_value() && bias->defined()) ? bias->data_ptr<float>() : nullptr;
  linear_into(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), packed.size(0), N, bp, out.data_ptr<float>(),
              N, 1.0f, false);
  return out;
}

void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor packed_a, int64_t r, torch::Tensor packed_b,
              double scale) {
  // out[M, N] += scale * (x[M, K] @ A.T) @ B.T; out: rows of a contiguous layer output (row stride = N)
  TORCH_CHECK(x.is_contiguous() && out.stride(1) == 1 && out.size(0) == x.size(0), "cpu_linear: bad shapes");
  int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  auto h = torch::empty({M, r}, x.options());
  linear_into(x.data_ptr<float>(), M, K, packed_a.data_ptr<float>(), packed_a.size(0), r, nullptr,
              h.data_ptr<float>(), r, 1.0f, false);
  linear_into(h.data_ptr<float>(), M, r, packed_b.data_ptr<float>(), packed_b.size(0), N, nullptr,
              out.data_ptr<float>(), out.stride(0), (float)scale, true);
}
"""

_module = []  # [compiled extension or None]
_active = [0]


def _mode() -> str:
    v = os.environ.get(ENV, "auto").strip().lower()
    return {"0": "off", "false": "off", "off": "off", "1": "on", "true": "on", "on": "on"}.get(v, "auto")


def extension():
    """The compiled kernel (built on first call), or None where it is off or cannot be built."""
    if _module:
        return _module[0]
    mod = None
    if _mode() != "off":
        try:
            from torch.utils.cpp_extension import load_inline

            cap = torch.backends.cpu.get_cpu_capability()
            tag = hashlib.sha1((_SOURCE + cap + torch.__version__).encode()).hexdigest()[:10]
            mod = load_inline(f"dlm_cpu_linear_{tag}", cpp_sources=_SOURCE, functions=["pack", "linear", "lora_add"],
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                              verbose=False)  # -fopenmp: at::parallel_for is inline; without it, one thread
        except Exception as e:  # noqa: BLE001 - no compiler / ninja / headers: the stock layers still work
            if _mode() == "on":
                from dlm.errors import DLMError

                raise DLMError(f"{ENV}=1 but the CPU linear kernel could not be built ({type(e).__name__}: "
                               f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); install a C++ "
                               f"compiler and ninja (pip install ninja) or unset {ENV}") from e
            warnings.warn(f"dlm: the CPU decode kernel could not be built ({type(e).__name__}); decoding uses "
                          f"torch's own linear layers (slower chunks). Set {ENV}=0 to skip the attempt.",
                          stacklevel=2)
            mod = None
    _module.append(mod)
    return mod


def _linear_layers(model: nn.Module):
    from dlm.model.lora import _linear_shape  # nn.Linear or GPT-2's Conv1D, as the adapters see them

    return (m for m in model.modules() if _linear_shape(m) is not None)


def _key(*tensors) -> tuple:
    """What a packed copy was made from: changes when a tensor is replaced or modified in place."""
    return tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors)


def _plain_fp32_cpu(w) -> bool:
    """A whole fp32 CPU weight (not a DTensor / FSDP shard / DeepSpeed ZeRO-3 placeholder)."""
    return (isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
            and w.numel() > 0 and type(w) in (nn.Parameter, torch.Tensor) and not hasattr(w, "ds_id"))


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def attach(model: nn.Module) -> bool:
    """Pack the fp32 CPU linear layers of ``model`` for the kernel and route their forward through it inside
    :func:`active`. Idempotent; returns whether the model uses the kernel."""
    layers = [m for m in _linear_layers(model) if _plain_fp32_cpu(m.weight)]
    if not layers or _mode() == "off":
        return False
    if all(getattr(m, "_dlm_packed", None) is not None for m in layers):
        return True
    extra = sum(m.weight.numel() for m in layers) * 4
    mem = _physical_memory()
    if _mode() == "auto" and mem and extra > RAM_SHARE * mem:
        return False
    mod = extension()
    if mod is None:
        return False
    for m in layers:
        _pack(m, mod)
        if not getattr(m.__dict__.get("forward"), "_dlm", False):
            m.forward = _make_forward(m, m.forward)
    gated = getattr(model, "gated_lora", None)
    if gated is not None and hasattr(gated, "fast_delta"):
        gated.fast_delta = adapter_delta  # the mask rows' low-rank deltas through the kernel too
    return True


def adapter_delta(adapter: nn.Module, rows: torch.Tensor, out_rows: torch.Tensor, scale: float) -> bool:
    """``out_rows += scale * B(A(rows))`` for a gated-LoRA adapter through the kernel, in one call; False (nothing
    done) outside :func:`active` or for inputs it does not take. At batch 1 these are two tiny matmuls per adapted
    layer, and BLAS spends more on starting its threads than on the arithmetic."""
    if not _active[0] or rows.dtype != torch.float32 or rows.device.type != "cpu" or torch.is_grad_enabled() \
            or not _module or _module[0] is None or not 0 < rows.shape[0] <= MAX_ROWS \
            or out_rows.stride(-1) != 1:
        return False
    ext = _module[0]
    a, b = adapter.A, adapter.B
    key = _key(a, b)
    packed = adapter.__dict__.get("_dlm_packed")
    if packed is None or packed[0] != key:
        with torch.no_grad():
            packed = (key, ext.pack(a.detach(), False), ext.pack(b.detach(), False), a.shape[0])
        adapter.__dict__["_dlm_packed"] = packed
    ext.lora_add(out_rows, rows.contiguous(), packed[1], packed[3], packed[2], float(scale))
    return True


def _pack(module: nn.Module, mod) -> None:
    w = module.weight
    transposed = not isinstance(module, nn.Linear)
    with torch.no_grad():
        module._dlm_packed = mod.pack(w.detach(), transposed)
    module._dlm_packed_of = _key(w)
    module._dlm_out = w.shape[1] if transposed else w.shape[0]


def _make_forward(module: nn.Module, stock):
    def forward(x):
        if not _active[0] or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return stock(x)
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not 0 < rows <= MAX_ROWS:
            return stock(x)
        w = module.weight
        if module._dlm_packed_of != _key(w):
            _pack(module, _module[0])  # the weight changed in place (training) since it was packed
        bias = module.bias
        out = _module[0].linear(x.reshape(rows, k).contiguous(), module._dlm_packed, module._dlm_out,
                                None if bias is None else bias.detach())
        return out.view(*x.shape[:-1], module._dlm_out)

    forward._dlm = True
    return forward


def detach(model: nn.Module) -> None:
    """Undo :func:`attach`: stock forwards, packed copies freed."""
    for m in _linear_layers(model):
        if getattr(m.__dict__.get("forward"), "_dlm", False):
            del m.forward
        for name in ("_dlm_packed", "_dlm_packed_of", "_dlm_out"):
            if hasattr(m, name):
                delattr(m, name)
    gated = getattr(model, "gated_lora", None)
    if gated is not None and getattr(gated, "fast_delta", None) is adapter_delta:
        gated.fast_delta = None
        for adapter in gated.adapters.values():
            adapter.__dict__.pop("_dlm_packed", None)


@contextlib.contextmanager
def active(on: bool = True):
    """Route attached layers through the kernel for the forwards inside this block."""
    if not on:
        yield
        return
    _active[0] += 1
    try:
        yield
    finally:
        _active[0] -= 1
