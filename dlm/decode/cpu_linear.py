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

Around the matmuls, a decode forward at batch 1 is ~1300 small torch ops (SmolLM2-135M: ~12 ms of a ~35 ms
step here), as many for 1 token as for 8. Inside :func:`active` the same extension also runs, one call each and
each checked against the model's own code before use: RMSNorm (Llama's form; to rounding), the rotary embedding
(bit for bit transformers'), the gated SiLU MLP's gate and up projections with their product in one pass (to
rounding; not where a LoRA hook sits on them), and the attention of decode chunks of up to
:data:`ATTEND_MAX_QUERIES` queries over the KV cache (grouped-query, boolean mask; to rounding, and like the
linear bit for bit row-independent: a query's output is the same alone or in any chunk). Together about -4 to -6
ms per forward on SmolLM2-135M, i.e. ~12% of an AR step and of an ISD chunk.

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
from torch.nn.modules import module as _nn_module

# rows (tokens x batch) per call up to which the kernel is used; above, BLAS's compute-bound GEMM is faster.
# Measured (bench/gemm_rows.py, SmolLM2-135M shapes, 2-core AVX-512 Xeon): the kernel is at or under BLAS's time
# up to 96 rows (142 vs 148 ms per forward's matmuls at 96), ties at 128, and is 1.3x slower at 1024 (prefill).
# 96 = 32 requests x an N=2 verify chunk of 3 tokens, so a served batch of 32 stays on one kernel.
MAX_ROWS = 96
RAM_SHARE = 0.25  # pack only when the packed copy takes at most this share of physical memory
ENV = "DLM_CPU_KERNEL"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

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

// A packed weight: kind 0 fp32 [NB, K, 32] (32 output columns at a time, K contiguous); kind 1, a Q4_1-form weight
// (w = d * q + m per 32 consecutive inputs of an output, q in 0..15, the product and the sum each rounded in fp32:
// GGUF's Q4_1 dequantized) as uint8 [NB, K/32, 768]: per 32 columns x 32 inputs d[32] and m[32] (fp32), then 32 x
// 16 bytes of q (byte j: column j low nibble, column j+16 high); kind 2, a Q8_0-form weight (w = d * q, q int8)
// as int8 [NB, K/32, 1152]: d[32] (fp32), then 32 x 32 bytes of q. The quantized kinds rebuild exactly the fp32
// weights the model holds (checked on every block before packing) while streaming 5.3x / 3.6x fewer bytes.
constexpr int64_t Q4B = 768, Q8B = 1152;
struct WB {
  int kind;
  const char* p;
  int64_t K, bytes;  // inputs, bytes per column block
};
static WB wb_of(const torch::Tensor& t) {
  WB w;
  w.p = (const char*)t.data_ptr();
  if (t.scalar_type() == torch::kFloat) { w.kind = 0; w.K = t.size(1); w.bytes = w.K * COLS * 4; }
  else if (t.scalar_type() == torch::kByte) { w.kind = 1; w.K = t.size(1) * 32; w.bytes = t.size(1) * Q4B; }
  else { TORCH_CHECK(t.scalar_type() == torch::kChar, "packed weight of an unknown kind"); w.kind = 2;
         w.K = t.size(1) * 32; w.bytes = t.size(1) * Q8B; }
  TORCH_CHECK(t.is_contiguous() && t.dim() == 3, "packed weight: bad layout");
  return w;
}

typedef int32_t vi16q __attribute__((vector_size(64), aligned(4)));
typedef uint8_t vu8 __attribute__((vector_size(16), aligned(1)));
typedef int8_t vs8 __attribute__((vector_size(16), aligned(1)));
#if defined(__AVX512F__)
#include <immintrin.h>
// keeps a product in a register, unfused with what follows (the compiler may not contract it into an FMA)
#define DLM_BARRIER(a, b) asm("" : "+v"(a), "+v"(b))
#define DLM_QUANT true
// 16 bytes widened to 16 int32 (one vpmovzxbd / vpmovsxbd; the generic conversion is 16 scalar inserts)
static inline vi16q widen_u8(const char* p) { return (vi16q)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline vi16q widen_s8(const char* p) { return (vi16q)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
#else
#define DLM_BARRIER(a, b) do {} while (0)
#define DLM_QUANT false
static inline vi16q widen_u8(const char* p) { return __builtin_convertvector(*reinterpret_cast<const vu8*>(p), vi16q); }
static inline vi16q widen_s8(const char* p) { return __builtin_convertvector(*reinterpret_cast<const vs8*>(p), vi16q); }
#endif

template <int MB, int KIND>
static inline void rows_block(const float* x, int64_t ldx, const char* wpc, int64_t K, float* out,
                              int64_t ldo, int64_t ncols, const float* bias, float alpha, bool accumulate) {
  v16 a0[MB], a1[MB];
  for (int m = 0; m < MB; m++) { a0[m] = v16{}; a1[m] = v16{}; }
  if constexpr (KIND == 0) {
    const float* wp = reinterpret_cast<const float*>(wpc);
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
  } else {
    constexpr int64_t BB = KIND == 1 ? Q4B : Q8B;
    for (int64_t kb = 0; kb < K / 32; kb++) {
      const char* blk = wpc + kb * BB;
      for (int64_t l = 0; l < BB; l += 64) __builtin_prefetch(blk + 4 * BB + l, 0, 3);
      v16 d0 = *reinterpret_cast<const v16*>(blk), d1 = *reinterpret_cast<const v16*>(blk + 64);
      const float* xk = x + kb * 32;
      for (int64_t k = 0; k < 32; k++) {
        v16 w0, w1;
        if constexpr (KIND == 1) {
          v16 m0 = *reinterpret_cast<const v16*>(blk + 128), m1 = *reinterpret_cast<const v16*>(blk + 192);
          vi16q q = widen_u8(blk + 256 + 16 * k);
          v16 t0 = d0 * __builtin_convertvector(q & 15, v16), t1 = d1 * __builtin_convertvector(q >> 4, v16);
          // the product rounded on its own before the sum (no fused multiply-add), as the dequantization did
          DLM_BARRIER(t0, t1);
          w0 = t0 + m0;
          w1 = t1 + m1;
        } else {
          w0 = d0 * __builtin_convertvector(widen_s8(blk + 128 + 32 * k), v16);
          w1 = d1 * __builtin_convertvector(widen_s8(blk + 144 + 32 * k), v16);
          DLM_BARRIER(w0, w1);
        }
        for (int m = 0; m < MB; m++) {
          float xv = xk[m * ldx + k];
          a0[m] += w0 * xv;
          a1[m] += w1 * xv;
        }
      }
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

// rows_block for mb = 1..8 rows (the accumulators' count is a compile-time constant)
template <int KIND>
static inline void rows_kind(int64_t mb, const float* x, const char* wp, int64_t K, float* out, int64_t ldo,
                             int64_t ncols, const float* bias, float alpha, bool accumulate) {
  switch (mb) {
    case 1: rows_block<1, KIND>(x, K, wp, K, out, ldo, ncols, bias, alpha, accumulate); break;
    case 2: rows_block<2, KIND>(x, K, wp, K, out, ldo, ncols, bias, alpha, accumulate); break;
    case 3: rows_block<3, KIND>(x, K, wp, K, out, ldo, ncols, bias, alpha, accumulate); break;
    case 4: rows_block<4, KIND>(x, K, wp, K, out, ldo, ncols, bias, alpha, accumulate); break;
    case 5: rows_block<5, KIND>(x, K, wp, K, out, ldo, ncols, bias, alpha, accumulate); break;
    case 6: rows_block<6, KIND>(x, K, wp, K, out, ldo, ncols, bias, alpha, accumulate); break;
    case 7: rows_block<7, KIND>(x, K, wp, K, out, ldo, ncols, bias, alpha, accumulate); break;
    default: rows_block<8, KIND>(x, K, wp, K, out, ldo, ncols, bias, alpha, accumulate);
  }
}

// mb rows (<= 8) of x [mb, K] against column block nb of a packed weight
static inline void rows_block_n(int64_t mb, const float* x, const WB& w, int64_t nb, float* out, int64_t ldo,
                                int64_t ncols, const float* bias, float alpha, bool accumulate) {
  const char* p = w.p + nb * w.bytes;
  if (w.kind == 0) rows_kind<0>(mb, x, p, w.K, out, ldo, ncols, bias, alpha, accumulate);
  else if (w.kind == 1) rows_kind<1>(mb, x, p, w.K, out, ldo, ncols, bias, alpha, accumulate);
  else rows_kind<2>(mb, x, p, w.K, out, ldo, ncols, bias, alpha, accumulate);
}

bool quant_kinds() {  // whether this build takes the quantized kinds (DLM_BARRIER needs AVX-512's registers)
  return DLM_QUANT;
}

// out[M, N] (row stride ldo) = x[M, K] @ W.T (+ bias), or out += alpha * x @ W.T (accumulate); the column blocks
// past the NB of w come from tail (NBT blocks; a layer whose last rows are not in w's quantized form, e.g. tokens
// added to a GGUF model's vocabulary)
static void linear_into(const float* xp, int64_t M, const WB& w, int64_t NB, int64_t N,
                        const float* bp, float* op, int64_t ldo, float alpha, bool accumulate,
                        const WB* tail = nullptr, int64_t NBT = 0, bool threads = true) {
  auto blocks = [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; nb++) {
      int64_t ncols = std::min<int64_t>(COLS, N - nb * COLS);
      const float* bb = bp ? bp + nb * COLS : nullptr;
      const WB& ww = nb < NB ? w : *tail;
      int64_t j = nb < NB ? nb : nb - NB;
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        rows_block_n(std::min<int64_t>(8, M - m0), xp + m0 * w.K, ww, j, op + m0 * ldo + nb * COLS, ldo, ncols,
                     bb, alpha, accumulate);
    }
  };
  if (threads) at::parallel_for(0, NB + NBT, 1, blocks);
  else blocks(0, NB + NBT);
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                     c10::optional<torch::Tensor> tail) {
  // x: [M, K] contiguous fp32; packed: a packed weight (WB), tail: the packed weight of its last columns; -> [M, N]
  WB w = wb_of(packed), t = w;
  int64_t NBT = 0;
  if (tail.has_value() && tail->defined()) { t = wb_of(*tail); NBT = tail->size(0); }
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && w.K == x.size(1) && t.K == w.K &&
              (packed.size(0) + NBT) * COLS >= N && (NBT == 0 || packed.size(0) * COLS < N), "cpu_linear: bad shapes");
  int64_t M = x.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* bp = (bias.has_value() && bias->defined()) ? bias->data_ptr<float>() : nullptr;
  linear_into(x.data_ptr<float>(), M, w, packed.size(0), N, bp, out.data_ptr<float>(), N, 1.0f, false, &t, NBT);
  return out;
}

// Several linears of the same input in one threaded pass over all their column blocks (a layer's q, k and v
// projections): outs[i] [M, ns[i]] = x [M, K] @ W_i.T (+ bias_i; an empty tensor for none)
std::vector<torch::Tensor> linears(torch::Tensor x, std::vector<torch::Tensor> packed, std::vector<int64_t> ns,
                                   std::vector<torch::Tensor> biases) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && packed.size() == ns.size() && biases.size() == ns.size(),
              "linears: bad shapes");
  int64_t M = x.size(0), K = x.size(1), P = (int64_t)packed.size();
  std::vector<torch::Tensor> outs;
  std::vector<int64_t> start(P + 1, 0);
  std::vector<WB> ws;
  std::vector<const float*> bp(P);
  std::vector<float*> op(P);
  for (int64_t i = 0; i < P; i++) {
    ws.push_back(wb_of(packed[i]));
    TORCH_CHECK(ws[i].K == K && packed[i].size(0) * COLS >= ns[i], "linears: bad shapes");
    outs.push_back(torch::empty({M, ns[i]}, x.options()));
    start[i + 1] = start[i] + packed[i].size(0);
    bp[i] = biases[i].numel() ? biases[i].data_ptr<float>() : nullptr;
    op[i] = outs[i].data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, start[P], 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; blk++) {
      int64_t i = std::upper_bound(start.begin(), start.end(), blk) - start.begin() - 1;
      int64_t nb = blk - start[i], N = ns[i];
      int64_t ncols = std::min<int64_t>(COLS, N - nb * COLS);
      const float* bb = bp[i] ? bp[i] + nb * COLS : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        rows_block_n(std::min<int64_t>(8, M - m0), xp + m0 * K, ws[i], nb, op[i] + m0 * N + nb * COLS, N, ncols,
                     bb, 1.0f, false);
    }
  });
  return outs;
}

// out [M, N] += x [M, K] @ W.T in place (a residual connection around a projection: the sum rounded once, as
// out + (x @ W.T) is)
void linear_add_(torch::Tensor out, torch::Tensor x, torch::Tensor packed) {
  WB w = wb_of(packed);
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && out.dim() == 2 && out.stride(1) == 1 &&
              out.size(0) == x.size(0) && w.K == x.size(1) && packed.size(0) * COLS >= out.size(1),
              "linear_add_: bad shapes");
  linear_into(x.data_ptr<float>(), x.size(0), w, packed.size(0), out.size(1), nullptr, out.data_ptr<float>(),
              out.stride(0), 1.0f, true);
}

// RMSNorm of each row of x [..., D] (contiguous): w * (x * (1 / sqrt(mean(x^2) + eps))), the products rounded
// one at a time as transformers' LlamaRMSNorm does (only the sum of squares is summed in another order)
__attribute__((optimize("fp-contract=off")))
static void rms_row(const float* x, const float* w, float* o, int64_t D, float eps) {
  v16 acc = v16{};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) { v16 v = *reinterpret_cast<const v16*>(x + d); acc += v * v; }
  float ss = 0.f;
  for (int i = 0; i < 16; i++) ss += acc[i];
  for (; d < D; d++) ss += x[d] * x[d];
  float inv = 1.0f / std::sqrt(ss / (float)D + eps);
  for (d = 0; d < D; d++) { float t = x[d] * inv; o[d] = w[d] * t; }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(-1), "rms_norm: bad shapes");
  int64_t D = x.size(-1), M = x.numel() / D;
  auto o = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = o.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; m++) rms_row(xp + m * D, wp, op + m * D, D, (float)eps);
  });
  return o;
}

// Rotary embedding, x * cos + rotate_half(x) * sin, each product and sum rounded on its own (no fused
// multiply-add): bit for bit transformers' apply_rotary_pos_emb
__attribute__((optimize("fp-contract=off")))
static void rope_one(const float* x, const float* c, const float* s, float* o, int64_t h2) {
  for (int64_t d = 0; d < h2; d++) {
    float a = x[d] * c[d], b = x[d + h2] * s[d];
    o[d] = a - b;
    float e = x[d + h2] * c[d + h2], f = x[d] * s[d + h2];
    o[d + h2] = e + f;
  }
}

// x [B, H, T, D] (any strides, the last 1); cos, sin [B, T, D] (the last stride 1) -> contiguous [B, H, T, D]
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && sin.dim() == 3 && x.stride(3) == 1 && cos.stride(2) == 1 &&
              sin.stride(2) == 1 && x.size(3) % 2 == 0, "rope: bad shapes");
  int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  auto o = torch::empty({B, H, T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = o.data_ptr<float>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t t = 0; t < T; t++)
        rope_one(xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2), cp + b * cos.stride(0) + t * cos.stride(1),
                 sp + b * sin.stride(0) + t * sin.stride(1), op + ((b * H + h) * T + t) * D, D / 2);
  return o;
}

// act(x @ G.T) * (x @ U.T) for a gated MLP (Llama's SiLU): the two projections in one threaded pass over their
// column blocks, the product formed while the block's outputs are hot. silu(g) = g / (1 + exp(-g)).
static inline v16 vexp(v16 x);
torch::Tensor gate_up(torch::Tensor x, torch::Tensor packed_g, torch::Tensor packed_u, int64_t N) {
  WB wg = wb_of(packed_g), wu = wb_of(packed_u);
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && wg.K == x.size(1) && wu.K == x.size(1) &&
              packed_u.size(0) == packed_g.size(0), "gate_up: bad shapes");
  int64_t M = x.size(0), K = x.size(1), NB = packed_g.size(0);
  auto g = torch::empty({M, NB * COLS}, x.options());
  auto u = torch::empty({M, NB * COLS}, x.options());
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; nb++) {
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        int64_t mb = std::min<int64_t>(8, M - m0);
        for (int which = 0; which < 2; which++)
          rows_block_n(mb, xp + m0 * K, which ? wu : wg, nb, (which ? up : gp) + m0 * NB * COLS + nb * COLS,
                       NB * COLS, COLS, nullptr, 1.f, false);
        int64_t ncols = std::min<int64_t>(COLS, N - nb * COLS);
        for (int64_t m = m0; m < m0 + mb; m++) {
          const float* gg = gp + m * NB * COLS + nb * COLS;
          const float* uu = up + m * NB * COLS + nb * COLS;
          float* o = op + m * N + nb * COLS;
          float tmp[COLS];
          for (int64_t h = 0; h < COLS; h += 16) {
            v16 a = *reinterpret_cast<const v16*>(gg + h);
            v16 na = v16{} - a;
            na = na > 88.0f ? v16{} + 88.0f : na;  // exp(-g) overflows past 88: silu(g) -> 0 there anyway
            *reinterpret_cast<v16*>(tmp + h) = a / (1.0f + vexp(na)) * *reinterpret_cast<const v16*>(uu + h);
          }
          for (int64_t j = 0; j < ncols; j++) o[j] = tmp[j];
        }
      }
    }
  });
  return out;
}

// exp(x) for x <= 88 (Cephes' expf: 2^n * p(r), |r| <= ln2 / 2; ~1 ulp), 16 lanes
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
static inline v16 vexp(v16 x) {
  const v16 lo = v16{} - 87.3f;
  x = x < lo ? lo : x;
  v16 t = x * 1.44269504088896341f + 12582912.0f;  // round to nearest: n = t - 1.5 * 2^23
  v16 n = t - 12582912.0f;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = v16{} + 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  p = p * r * r + r + 1.0f;
  vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  return p * reinterpret_cast<v16&>(e);
}

// Attention of a few queries over a KV cache, grouped-query: q [B, H, T, D], k, v [B, Hk, S, D] (any strides, the
// last 1), mask [B, 1, T, S] bool (any strides) or none (every key), -> [B, T, H, D] contiguous. Each query's
// output is computed over the keys in order, whatever T and the other queries are (so a token's attention is bit
// for bit the same in a 1-token step and inside any chunk).
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                     double scale) {
  int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hk = k.size(1), S = k.size(2);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && D % 16 == 0 && v.size(3) == D &&
              H % Hk == 0 && k.size(0) == B && v.size(2) == S, "attend: bad shapes");
  bool has_mask = mask.has_value() && mask->defined();
  const bool* mp = has_mask ? mask->data_ptr<bool>() : nullptr;
  int64_t ms0 = has_mask ? mask->stride(0) : 0, ms2 = has_mask ? mask->stride(2) : 0,
          ms3 = has_mask ? mask->stride(3) : 0;
  auto out = torch::empty({B, T, H, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rep = H / Hk, SP = (S + 15) / 16 * 16, DV = D / 16;
  const float sc = (float)scale;
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(SP);
    float* w = buf.data();
    for (int64_t i = i0; i < i1; i++) {
      int64_t b = i / H, h = i % H, hk = h / rep;
      const float* kb = kp + b * k.stride(0) + hk * k.stride(1);
      const float* vb = vp + b * v.stride(0) + hk * v.stride(1);
      for (int64_t t = 0; t < T; t++) {
        const float* qq = qp + b * q.stride(0) + h * q.stride(1) + t * q.stride(2);
        const bool* mrow = has_mask ? mp + b * ms0 + t * ms2 : nullptr;
        float mx = -INFINITY;
        for (int64_t s = 0; s < S; s++) {
          if (mrow && !mrow[s * ms3]) { w[s] = -INFINITY; continue; }
          const float* kk = kb + s * k.stride(2);
          v16 acc = v16{};
          for (int64_t d = 0; d < DV; d++)
            acc += *reinterpret_cast<const v16*>(qq + 16 * d) * *reinterpret_cast<const v16*>(kk + 16 * d);
          float dot = 0.f;
          for (int j = 0; j < 16; j++) dot += acc[j];
          w[s] = dot * sc;
          mx = std::max(mx, w[s]);
        }
        float* o = op + ((b * T + t) * H + h) * D;
        if (mx == -INFINITY) { std::fill(o, o + D, 0.f); continue; }  // no key to attend to
        for (int64_t s = S; s < SP; s++) w[s] = -INFINITY;
        v16 tot = v16{};
        for (int64_t s = 0; s < SP; s += 16) {
          v16 x = *reinterpret_cast<v16*>(w + s);
          v16 e = vexp(x - mx);
          e = x == -INFINITY ? v16{} : e;
          *reinterpret_cast<v16*>(w + s) = e;
          tot += e;
        }
        float sum = 0.f;
        for (int j = 0; j < 16; j++) sum += tot[j];
        v16 acc[8];
        for (int64_t d = 0; d < DV && d < 8; d++) acc[d] = v16{};
        if (DV <= 8) {
          for (int64_t s = 0; s < S; s++) {
            float p = w[s];
            if (p == 0.f) continue;
            const float* vv = vb + s * v.stride(2);
            for (int64_t d = 0; d < DV; d++) acc[d] += *reinterpret_cast<const v16*>(vv + 16 * d) * p;
          }
          const float inv = 1.0f / sum;
          for (int64_t d = 0; d < DV; d++) *reinterpret_cast<v16*>(o + 16 * d) = acc[d] * inv;
        } else {  // wide heads: accumulate in the output row
          std::fill(o, o + D, 0.f);
          for (int64_t s = 0; s < S; s++) {
            float p = w[s];
            if (p == 0.f) continue;
            const float* vv = vb + s * v.stride(2);
            for (int64_t d = 0; d < D; d++) o[d] += p * vv[d];
          }
          const float inv = 1.0f / sum;
          for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
      }
    }
  });
  return out;
}

void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor packed_a, int64_t r, torch::Tensor packed_b,
              double scale) {
  // out[M, N] += scale * (x[M, K] @ A.T) @ B.T; out: rows of a contiguous layer output (row stride = N)
  TORCH_CHECK(x.is_contiguous() && out.stride(1) == 1 && out.size(0) == x.size(0), "cpu_linear: bad shapes");
  int64_t M = x.size(0), N = out.size(1);
  WB wa = wb_of(packed_a), wbb = wb_of(packed_b);
  TORCH_CHECK(wa.K == x.size(1) && wbb.K == r, "cpu_linear: bad shapes");
  auto h = torch::empty({M, r}, x.options());
  bool threads = M * (wa.K * r + r * N) > (1 << 18);  // a few mask rows: one thread (starting two costs more)
  linear_into(x.data_ptr<float>(), M, wa, packed_a.size(0), r, nullptr, h.data_ptr<float>(), r, 1.0f, false,
              nullptr, 0, threads);
  linear_into(h.data_ptr<float>(), M, wbb, packed_b.size(0), N, nullptr, out.data_ptr<float>(), out.stride(0),
              (float)scale, true, nullptr, 0, threads);
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
            mod = load_inline(f"dlm_cpu_linear_{tag}", cpp_sources=_SOURCE,
                              functions=["pack", "quant_kinds", "linear", "linears", "linear_add_", "lora_add", "rms_norm", "rope",
                                         "attend", "gate_up"],
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
    _attach_norms(model, mod)
    _attach_rope(model, mod)
    _attach_mlps(model, mod)
    _attach_layers(model, mod)
    return True


def _attach_mlps(model: nn.Module, mod) -> None:
    """Gated SiLU MLPs (Llama, Qwen, Mistral): gate and up projections in one kernel pass with the SiLU product."""
    for m in model.modules():
        gate, up = getattr(m, "gate_proj", None), getattr(m, "up_proj", None)
        if not type(m).__name__.endswith("MLP") or not isinstance(gate, nn.Linear) or not isinstance(up, nn.Linear) \
                or not isinstance(getattr(m, "down_proj", None), nn.Module) \
                or type(getattr(m, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation") \
                or gate.bias is not None or up.bias is not None or gate.weight.shape != up.weight.shape \
                or getattr(gate, "_dlm_packed", None) is None or getattr(up, "_dlm_packed", None) is None \
                or getattr(m.__dict__.get("forward"), "_dlm", False):
            continue
        m.forward = _make_mlp_forward(m, m.forward)


def _make_mlp_forward(module: nn.Module, stock):
    gate, up, down = module.gate_proj, module.up_proj, module.down_proj

    def forward(x):
        if not _active[0] or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled() \
                or gate._forward_hooks or up._forward_hooks or gate._forward_pre_hooks or up._forward_pre_hooks:
            return stock(x)
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not 0 < rows <= MAX_ROWS:
            return stock(x)
        _fresh(gate), _fresh(up)
        if gate._dlm_tail is not None or up._dlm_tail is not None:
            return stock(x)
        h = _module[0].gate_up(x.reshape(rows, k).contiguous(), gate._dlm_packed, up._dlm_packed, gate._dlm_out)
        return down(h.view(*x.shape[:-1], gate._dlm_out))

    forward._dlm = True
    return forward


# -- the elementwise ops around the matmuls ------------------------------------------------------------------
# At batch 1 a decode forward is ~1300 small torch ops besides the matmuls (SmolLM2-135M: ~12 ms of a ~35 ms
# step on this CPU), the same for 1 token as for 8. RMSNorm (7 ops: pow, mean = sum + div, add, rsqrt, 2 mul) and
# rotary embedding (7 per tensor: 2 slices, neg, cat, 2 mul, add) are most of them; inside active() they run as one
# call each. Both are checked against the model's own function on random input before they are used (a model whose
# norm or rotary differs, e.g. Gemma's (1 + w) norm or an interleaved rotary, keeps its own).

_checked: dict = {}  # class -> whether the fused RMSNorm matches its forward; modeling module -> rotary matches


def _norm_eps(m: nn.Module):
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return eps if isinstance(eps, float) else None


def _attach_norms(model: nn.Module, mod) -> None:
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not type(m).__name__.endswith("RMSNorm") or _norm_eps(m) is None or not isinstance(w, torch.Tensor) \
                or w.dim() != 1 or w.dtype != torch.float32 or w.device.type != "cpu" \
                or getattr(m.__dict__.get("forward"), "_dlm", False):
            continue
        if type(m) not in _checked:
            x = torch.randn(3, w.numel(), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                try:
                    ok = torch.allclose(m(x), mod.rms_norm(x, w.contiguous(), _norm_eps(m)), rtol=1e-5, atol=1e-5)
                except Exception:  # noqa: BLE001 - a norm of another shape or signature: keep its own forward
                    ok = False
            _checked[type(m)] = ok
        if _checked[type(m)]:
            m.forward = _make_norm_forward(m, m.forward)


def _make_norm_forward(module: nn.Module, stock):
    eps = _norm_eps(module)

    def forward(x):
        w = module.weight
        if not _active[0] or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled() \
                or w.dtype != torch.float32 or x.shape[-1] != w.numel():
            return stock(x)
        return _module[0].rms_norm(x.contiguous(), w, eps)

    forward._dlm = True
    return forward


def _attach_rope(model: nn.Module, mod) -> None:
    import sys

    for m in model.modules():
        if not type(m).__name__.endswith("Attention"):
            continue
        home = sys.modules.get(type(m).__module__)
        fn = getattr(home, "apply_rotary_pos_emb", None)
        if fn is None or getattr(fn, "_dlm", False) or _checked.get(home) is False:
            continue
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 5, 4, 8, generator=g).transpose(1, 2)  # [B, H, T, D] views, as attention makes them
        k = torch.randn(2, 5, 2, 8, generator=g).transpose(1, 2)
        cos, sin = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
        try:
            rq, rk = fn(q, k, cos, sin)
            ok = torch.equal(rq, mod.rope(q, cos, sin)) and torch.equal(rk, mod.rope(k, cos, sin))
        except Exception:  # noqa: BLE001 - another signature or layout: keep the model's own
            ok = False
        _checked[home] = ok
        if ok:
            home.apply_rotary_pos_emb = _make_rope(fn)


ATTEND_MAX_QUERIES = 16  # decode chunks (1 .. 2N-1 tokens, candidate trees up to ~12); prefill stays with SDPA


def attend(query, key, value, mask, scale):
    """Attention of a decode chunk through the kernel: ``query [B, H, T, D]``, ``key``/``value [B, Hk, S, D]``,
    ``mask`` a bool ``[B, 1, T, S]`` or None (every key; only for T = 1), ``scale`` (None: 1/sqrt(D)); returns
    ``[B, T, H, D]`` or None where it does not apply (outside :func:`active`, gradients, other dtypes or shapes)."""
    if not _active[0] or not _module or _module[0] is None or torch.is_grad_enabled():
        return None
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    b, h, t, d = query.shape
    if not 0 < t <= ATTEND_MAX_QUERIES or d % 16 or value.shape[-1] != d or h % key.shape[1] \
            or key.shape[0] != b or any(x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1
                                        for x in (query, key, value)):
        return None
    if mask is None:
        if t != 1:
            return None
    elif mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != t \
            or mask.shape[3] != key.shape[2] or mask.shape[0] not in (1, b):
        return None
    elif mask.shape[0] != b:
        mask = mask.expand(b, 1, t, key.shape[2])
    return _module[0].attend(query, key, value, mask, float(scale if scale is not None else d ** -0.5))


def _make_rope(stock):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not _active[0] or args or kwargs or torch.is_grad_enabled() or q.dim() != 4 or cos.dim() != 3 \
                or any(t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1
                       for t in (q, k, cos, sin)) \
                or cos.shape != sin.shape or tuple(cos.shape) != (q.shape[0], q.shape[2], q.shape[3]) \
                or (k.shape[0], k.shape[2], k.shape[3]) != tuple(cos.shape):
            return stock(q, k, cos, sin, *args, **kwargs)
        ext = _module[0]
        return ext.rope(q, cos, sin), ext.rope(k, cos, sin)

    apply_rotary_pos_emb._dlm = True
    apply_rotary_pos_emb._dlm_stock = stock
    return apply_rotary_pos_emb


# -- whole decoder layers ---------------------------------------------------------------------------------------
# With every op of a Llama-form layer in the extension, what is left of a decode forward's cost besides the
# arithmetic is Python: each layer is ~12 nn.Module calls (hooks checks, kwargs, transformers' decorators) around
# ~10 kernel calls. Inside active() a layer whose pieces are all attached runs as one Python function that calls
# the kernels directly (a linear with a hook on it, e.g. a gated-LoRA adapter, is still called as a module, so its
# hook runs). Checked once per layer class against the layer's own forward (on a deep copy without hooks) before
# it is used; a layer of another form (Qwen3's per-head q/k norms, Gemma's sandwich norms, ...) keeps its own.

_NO_BIAS = torch.empty(0)
_LAYER_KWARGS = frozenset(("attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                           "position_embeddings", "cache_position"))


def _layer_parts(layer: nn.Module):
    """The modules a Llama-form decoder layer is made of, or None where it is not one the fast path takes."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    n1, n2 = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
    if attn is None or mlp is None or n1 is None or n2 is None or any(
            hasattr(layer, a) for a in ("pre_feedforward_layernorm", "post_feedforward_layernorm")) \
            or any(hasattr(attn, a) for a in ("q_norm", "k_norm", "sinks")):
        return None
    projs = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if not all(isinstance(m, nn.Linear) and getattr(m, "_dlm_packed", None) is not None for m in projs):
        return None
    if not all(getattr(m.__dict__.get("forward"), "_dlm", False) for m in (n1, n2, mlp)):
        return None  # norms and MLP must be the fused ones (checked against their own code when attached)
    head_dim, groups, layer_idx = (getattr(attn, a, None) for a in ("head_dim", "num_key_value_groups", "layer_idx"))
    if not isinstance(head_dim, int) or not isinstance(groups, int) or not isinstance(layer_idx, int) \
            or head_dim % 16 or not isinstance(getattr(attn, "scaling", None), float):
        return None
    impl = getattr(getattr(attn, "config", None), "_attn_implementation", None)
    if impl not in ("sdpa", "dlm_sdpa"):
        return None
    return attn, mlp, n1, n2, projs


def _attach_layers(model: nn.Module, mod) -> None:
    for m in model.modules():
        if not type(m).__name__.endswith("DecoderLayer") or getattr(m.__dict__.get("forward"), "_dlm", False):
            continue
        parts = _layer_parts(m)
        if parts is None:
            continue
        if type(m) not in _checked:
            _checked[type(m)] = _check_layer(m, parts)
        if _checked[type(m)]:
            m.forward = _make_layer_forward(m, m.forward, parts)


def _check_layer(layer: nn.Module, parts) -> bool:
    """The fast path against the layer's own forward (with the kernels' norms/linears, inside active()) on random
    input: 3 tokens, causal mask, no cache; on a copy without hooks, so that adapters' gates do not interfere."""
    import copy

    attn = parts[0]
    try:
        twin = copy.deepcopy(layer)
        for sub in twin.modules():
            sub._forward_hooks.clear()
            sub._forward_pre_hooks.clear()
        for sub, orig in zip(twin.modules(), layer.modules()):  # forwards attach() bound to the original modules
            if getattr(sub.__dict__.get("forward"), "_dlm", False):
                del sub.forward
            if getattr(orig, "_dlm_packed", None) is not None:
                sub._dlm_packed, sub._dlm_tail, sub._dlm_out = orig._dlm_packed, orig._dlm_tail, orig._dlm_out
                sub._dlm_ptr, sub._dlm_version = sub.weight.data_ptr(), sub.weight._version
        _attach_norms(twin, _module[0])
        for sub in twin.modules():
            if getattr(sub, "_dlm_packed", None) is not None:
                sub.forward = _make_forward(sub, sub.forward)
        _attach_mlps(twin, _module[0])
        parts_t = _layer_parts(twin)
        if parts_t is None:
            return False
        d = attn.q_proj.in_features
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 3, d, generator=g)
        hd = attn.head_dim
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.arange(3, dtype=torch.float32)[:, None] * inv[None]
        emb = torch.cat([ang, ang], -1)[None]
        pe = (emb.cos(), emb.sin())
        mask = torch.ones(3, 3, dtype=torch.bool).tril_()[None, None]
        with torch.no_grad(), active(True):
            ref = twin.forward(x, attention_mask=mask, position_embeddings=pe, position_ids=torch.arange(3)[None])
            if not isinstance(ref, torch.Tensor):  # an older layer returning a tuple: keep its own
                return False
            got = _make_layer_forward(twin, None, parts_t)(x, attention_mask=mask, position_embeddings=pe,
                                                           position_ids=torch.arange(3)[None])
        return bool(torch.allclose(ref, got, rtol=1e-4, atol=1e-5))
    except Exception:  # noqa: BLE001 - another layer form or signature: keep its own forward
        return False


def _gated_delta(info, h: torch.Tensor, out: torch.Tensor) -> bool:
    """What a gated-LoRA hook (``info``: its (GatedLoRA, adapter)) does to ``out`` in a decode forward whose masks
    are one run of rows, done here directly through the adapters' own :meth:`GatedLoRA.span_delta` (the hook's
    call costs more than the kernel at batch 1); False where this shortcut does not apply (the hook then runs)."""
    if info is None:
        return False
    gated, adapter = info
    gate = gated._gate
    if gate is None or gate.numel() != h.shape[0]:
        return False
    if gated._n_gated == 0:
        return True  # no mask in this forward: the hook leaves the output as it is
    return gated.span_delta(adapter, h, out)


def _global_hooks() -> bool:
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks)


def _make_layer_forward(layer: nn.Module, stock, parts):
    attn, mlp, n1, n2, (qp, kp, vp, op) = parts
    hd, layer_idx, scaling = attn.head_dim, attn.layer_idx, attn.scaling
    eps1, eps2 = _norm_eps(n1), _norm_eps(n2)
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def lin(module, h, shape):  # h: [rows, in] contiguous
        if module._forward_pre_hooks or module._forward_hooks_with_kwargs or _global_hooks():
            return module(h.view(*shape, h.shape[-1])).reshape(h.shape[0], -1)
        _fresh(module)
        out = _module[0].linear(h, module._dlm_packed, module._dlm_out, module.bias, module._dlm_tail)
        return hooked(module, h, out, shape) if module._forward_hooks else out

    def hooked(module, h, out, shape):  # the module's forward hooks on its output, as a module call runs them
        hooks = tuple(module._forward_hooks.values())
        if len(hooks) == 1 and _gated_delta(getattr(hooks[0], "_dlm_gated", None), h, out):
            return out  # a gated-LoRA adapter's delta, applied directly
        x3, out3 = h.view(*shape, h.shape[-1]), out.view(*shape, out.shape[-1])
        for hook in hooks:
            res = hook(module, (x3,), out3)
            if res is not None:
                out3 = res
        return out3.reshape(h.shape[0], -1)

    def qkv(h, shape):  # the three projections in one kernel pass, then any adapter hooks on them
        for m in (qp, kp, vp):
            _fresh(m)
        if qp._forward_pre_hooks or kp._forward_pre_hooks or vp._forward_pre_hooks or _global_hooks() \
                or qp._forward_hooks_with_kwargs or kp._forward_hooks_with_kwargs or vp._forward_hooks_with_kwargs \
                or qp._dlm_tail is not None or kp._dlm_tail is not None or vp._dlm_tail is not None:
            return [lin(m, h, shape) for m in (qp, kp, vp)]
        outs = _module[0].linears(h, [qp._dlm_packed, kp._dlm_packed, vp._dlm_packed],
                                  [qp._dlm_out, kp._dlm_out, vp._dlm_out],
                                  [m.bias if m.bias is not None else _NO_BIAS for m in (qp, kp, vp)])
        return [hooked(m, h, o, shape) if m._forward_hooks else o for m, o in zip((qp, kp, vp), outs)]

    def forward(*args, **kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        if not _active[0] or len(args) > 1 or not isinstance(x, torch.Tensor) or x.dim() != 3 \
                or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled() or layer.training \
                or attn._forward_hooks or attn._forward_pre_hooks or mlp._forward_hooks or mlp._forward_pre_hooks \
                or n1._forward_hooks or n2._forward_hooks or n1._forward_pre_hooks or n2._forward_pre_hooks \
                or gate._forward_hooks or up._forward_hooks or gate._forward_pre_hooks or up._forward_pre_hooks \
                or not _LAYER_KWARGS.issuperset(kwargs.keys() - {"hidden_states"}):
            return stock(*args, **kwargs)
        b, t, d = x.shape
        pe, mask = kwargs.get("position_embeddings"), kwargs.get("attention_mask")
        rows = b * t
        if pe is None or not 0 < rows <= MAX_ROWS or t > ATTEND_MAX_QUERIES or \
                (mask is not None and (mask.dtype != torch.bool or mask.dim() != 4)) or (mask is None and t != 1):
            return stock(*args, **kwargs)
        cos, sin = pe
        if cos.dim() != 3 or tuple(cos.shape) != (b, t, hd) or cos.dtype != torch.float32 \
                or cos.stride(-1) != 1 or sin.stride(-1) != 1:
            return stock(*args, **kwargs)
        ext = _module[0]
        shape = (b, t)
        x2 = x.reshape(rows, d).contiguous()
        h = ext.rms_norm(x2, n1.weight, eps1)
        q, k, v = qkv(h, shape)
        q = q.view(b, t, -1, hd).transpose(1, 2)
        k = k.view(b, t, -1, hd).transpose(1, 2)
        v = v.view(b, t, -1, hd).transpose(1, 2)
        q, k = ext.rope(q, cos, sin), ext.rope(k, cos, sin)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            k, v = cache.update(k, v, layer_idx)
        if mask is not None and mask.shape[0] != b:
            mask = mask.expand(b, 1, t, mask.shape[-1])
        if mask is not None and (mask.shape[2] != t or mask.shape[3] != k.shape[2]):
            raise RuntimeError(f"attention mask {tuple(mask.shape)} does not match {t} queries x {k.shape[2]} keys")
        o = ext.attend(q, k, v, mask, scaling).view(rows, -1)
        x2 = x2 + lin(op, o, shape)
        h = ext.rms_norm(x2, n2.weight, eps2)
        _fresh(gate), _fresh(up), _fresh(down)
        if gate._dlm_tail is not None or up._dlm_tail is not None:
            return (x2 + mlp(h.view(b, t, d)).reshape(rows, d)).view(b, t, d)
        h = ext.gate_up(h, gate._dlm_packed, up._dlm_packed, gate._dlm_out)
        if down._forward_hooks or down._forward_pre_hooks or down.bias is not None or down._dlm_tail is not None:
            x2 = x2 + lin(down, h, shape)
        else:  # x2 is this function's own tensor: the residual added in place by the kernel
            ext.linear_add_(x2, h, down._dlm_packed)
        return x2.view(b, t, d)

    forward._dlm = True
    return forward


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
    key = (a.data_ptr(), a._version, b.data_ptr(), b._version)
    packed = adapter.__dict__.get("_dlm_packed")
    if packed is None or packed[0] != key:
        with torch.no_grad():
            packed = (key, ext.pack(a.detach(), False), ext.pack(b.detach(), False), a.shape[0])
        adapter.__dict__["_dlm_packed"] = packed
    ext.lora_add(out_rows, rows.contiguous(), packed[1], packed[3], packed[2], float(scale))
    return True


# -- weights that are a quantized format's exact values ---------------------------------------------------------
# A model loaded from a GGUF file (the embedded SmolLM2: Q4_1 projections, a Q8_0 embedding / lm_head) holds fp32
# weights that are, block by block, d * q + m (Q4_1) or d * q (Q8_0) with fp16 scales. At batch 1 a decode step
# streams every weight once, so such a layer is packed in that form (4.5 or 9 bits per weight + fp32 scales
# instead of 32) and the kernel rebuilds each weight in registers - exactly the fp32 value the model holds (every
# block is checked before it is packed this way; one block that does not fit keeps the whole layer in fp32), so
# the outputs are bit for bit those of the fp32 kernel. QUANT_ENV=0 turns it off.
QUANT_ENV = "DLM_CPU_QUANT"
_Q_MIN_WEIGHTS = 4096  # smaller matrices stay fp32 (nothing to gain, and the check would cost more than it saves)


def _fit_blocks(b: torch.Tensor, levels: int):
    """Blocks ``b [..., 32]`` as ``d * q + m`` (``levels`` 16: q in 0..15, Q4_1) or ``d * q`` (256: q int8, Q8_0)
    with d an fp16 value, each product and sum rounded in fp32 (what GGUF's dequantization computes). Returns d, q,
    m (None for Q8_0) and which blocks they reproduce bit for bit (``[...]`` bool)."""
    shape = b.shape
    flat = b.reshape(-1, 32)
    if levels == 16:
        m = flat.amin(-1, keepdim=True)
        est = (flat.amax(-1, keepdim=True) - m) / 15
    else:
        m = None
        est = flat.abs().amax(-1, keepdim=True) / 127
    bits = est.to(torch.float16).view(torch.int16)
    d, q = torch.zeros_like(est), torch.zeros_like(flat)
    done = torch.zeros(flat.shape[0], dtype=torch.bool)
    todo = None  # every block; then the indices of those not fitted yet
    for delta in (0, -1, 1, -2, 2):  # the fp16 scale nearest the estimate, or one or two steps off it
        x = flat if todo is None else flat[todo]
        cand = ((bits if todo is None else bits[todo]) + delta).view(torch.float16).float()
        cand = torch.where(torch.isfinite(cand) & (cand > 0), cand, torch.zeros_like(cand))
        safe = torch.where(cand > 0, cand, torch.ones_like(cand))
        if levels == 16:
            mm = m if todo is None else m[todo]
            qv = torch.round((x - mm) / safe).clamp_(0, 15)
            rec = cand * qv + mm  # two rounded ops, as the dequantization's (d * q) + m
        else:
            qv = torch.round(x / safe).clamp_(-128, 127)
            rec = cand * qv
        ok = (rec == x).all(-1)
        if todo is None:
            d, q, done = torch.where(ok[:, None], cand, d), torch.where(ok[:, None], qv, q), ok
        else:
            hit = todo[ok]
            d[hit], q[hit], done[hit] = cand[ok], qv[ok], True
        todo = (~done).nonzero().squeeze(1)
        if todo.numel() == 0:
            break
    return (d.view(*shape[:-1], 1), q.view(shape), None if m is None else m.view(*shape[:-1], 1),
            done.view(shape[:-1]))


def _quant_pack(w: torch.Tensor, mod):
    """``w [N, K]`` packed in the kernel's Q4_1 (uint8) or Q8_0 (int8) layout where its blocks fit, as (packed,
    tail): tail the fp32 packing of the last rows when only they do not fit (tokens added to a GGUF model's
    vocabulary, e.g. the mask token), else None; or None where the weight is not in either form."""
    n, k = w.shape
    if k % 32 or n * k < _Q_MIN_WEIGHTS or os.environ.get(QUANT_ENV, "1").strip() == "0":
        return None
    w = w.contiguous()
    for levels in (16, 256):
        if not bool(_fit_blocks(w[:64].reshape(-1, k // 32, 32), levels)[3].all()):  # a few rows first
            continue
        d, q, m, done = _fit_blocks(w.reshape(n, k // 32, 32), levels)
        bad = (~done.all(-1)).nonzero()
        n_fit = n if bad.numel() == 0 else int(bad[0]) // 32 * 32  # rows before the first misfit's block
        if n_fit < n / 2:
            continue
        tail = mod.pack(w[n_fit:], False) if n_fit < n else None
        d, q, m = d[:n_fit], q[:n_fit], (m[:n_fit] if m is not None else None)
        nb, kb = -(-n_fit // 32), k // 32
        pad = nb * 32 - n_fit

        def cols(t):  # [n, kb, c] -> [nb, kb, 32 columns, c], zero padded (a padded column is 0 * 0 + 0 = 0)
            if pad:
                t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
            return t.reshape(nb, 32, kb, t.shape[-1]).permute(0, 2, 1, 3)

        dd = cols(d)[..., 0].contiguous().view(torch.uint8)  # [nb, kb, 128]: 32 fp32 scales
        if levels == 16:
            mm = cols(m)[..., 0].contiguous().view(torch.uint8)
            qq = cols(q).to(torch.uint8).transpose(2, 3)  # [nb, kb, 32 inputs, 32 columns]
            nib = (qq[..., :16] | (qq[..., 16:] << 4)).reshape(nb, kb, 512)
            return torch.cat([dd, mm, nib], dim=-1).contiguous(), tail
        qq = cols(q).to(torch.int8).transpose(2, 3).reshape(nb, kb, 1024)
        return torch.cat([dd.view(torch.int8), qq], dim=-1).contiguous(), tail
    return None


def _pack(module: nn.Module, mod) -> None:
    w = module.weight
    transposed = not isinstance(module, nn.Linear)
    with torch.no_grad():
        packed = _quant_pack(w.detach().t() if transposed else w.detach(), mod) if mod.quant_kinds() else None
        module._dlm_packed, module._dlm_tail = packed if packed is not None else (mod.pack(w.detach(), transposed),
                                                                                   None)
    # what the copy was made from (storage, in-place version): a replaced or modified weight is packed again
    module._dlm_ptr, module._dlm_version = w.data_ptr(), w._version
    module._dlm_out = w.shape[1] if transposed else w.shape[0]


def _fresh(module: nn.Module) -> None:
    """Pack ``module`` again if its weight changed in place (training) or was replaced since it was packed."""
    w = module.weight
    if w._version != module._dlm_version or w.data_ptr() != module._dlm_ptr:
        _pack(module, _module[0])


def _make_forward(module: nn.Module, stock):
    def forward(x):
        if not _active[0] or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
            return stock(x)
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not 0 < rows <= MAX_ROWS:
            return stock(x)
        _fresh(module)
        out = _module[0].linear(x.reshape(rows, k).contiguous(), module._dlm_packed, module._dlm_out, module.bias,
                                module._dlm_tail)
        return out.view(*x.shape[:-1], module._dlm_out)

    forward._dlm = True
    return forward


def detach(model: nn.Module) -> None:
    """Undo :func:`attach`: stock forwards, packed copies freed. (The rotary function of a modeling module stays
    wrapped: it is shared by every model of that architecture and runs the stock code outside :func:`active`.)"""
    for m in model.modules():  # linear layers, norms, MLPs: every forward attach() wrapped
        if getattr(m.__dict__.get("forward"), "_dlm", False):
            del m.forward
    for m in _linear_layers(model):
        for name in ("_dlm_packed", "_dlm_tail", "_dlm_ptr", "_dlm_version", "_dlm_out"):
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
