// The torch operators of the CPU decode kernels (torch.ops.dlm_cpu.*): argument checks, threading over column
// blocks / rows / heads, and the choice of the instruction set's kernel table at run time (CPUID; set_isa).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <tuple>
#include <string>
#include <vector>

#include "layout.h"

using namespace dlm_cpu;

namespace {

bool cpu_has(const char* isa) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (std::string(isa) == "avx512vnni") return cpu_has("avx512") && __builtin_cpu_supports("avx512vnni");
  if (std::string(isa) == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
  if (std::string(isa) == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::string(isa) == "generic";
}

const KernelTable* table_of(const std::string& name) {
  if (!cpu_has(name.c_str())) return nullptr;
  if (name == "avx512vnni") return table_avx512vnni();
  if (name == "avx512") return table_avx512();
  if (name == "avx2") return table_avx2();
  if (name == "generic") return table_generic();
  return nullptr;
}

const KernelTable* best() {
  for (const char* n : {"avx512vnni", "avx512", "avx2", "generic"})
    if (const KernelTable* t = table_of(n)) return t;
  return table_generic();
}

const KernelTable* T = best();

struct WB {  // a packed weight as the kernels see it
  int kind;
  const char* p;
  int64_t K, bytes;  // inputs, bytes per column block
};

WB wb_of(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.dim() == 3, "dlm_cpu: a packed weight is a contiguous 3-d tensor");
  WB w;
  w.p = static_cast<const char*>(t.data_ptr());
  if (t.scalar_type() == at::kFloat) { w.kind = F32; w.K = t.size(1); w.bytes = w.K * COLS * 4; }
  else if (t.scalar_type() == at::kByte && t.size(2) == Q4IB) {
    w.kind = Q4_1_I8; w.K = t.size(1) * 32; w.bytes = t.size(1) * Q4IB;
  } else if (t.scalar_type() == at::kByte && t.size(2) == Q8IB) {
    w.kind = Q8_0_I8; w.K = t.size(1) * 32; w.bytes = t.size(1) * Q8IB;
  } else if (t.scalar_type() == at::kByte) { w.kind = Q4_1; w.K = t.size(1) * 32; w.bytes = t.size(1) * Q4B; }
  else {
    TORCH_CHECK(t.scalar_type() == at::kChar, "dlm_cpu: packed weight of an unknown kind");
    w.kind = Q8_0; w.K = t.size(1) * 32; w.bytes = t.size(1) * Q8B;
  }
  TORCH_CHECK(w.kind == F32 || int8_kind(w.kind) || t.size(2) == (w.kind == Q4_1 ? Q4B : Q8B),
              "dlm_cpu: bad quantized block size");
  return w;
}

// f(i0, i1) over [0, n) in chunks handed to the threads as each comes free, not in fixed equal shares: on a shared
// machine another process can slow one core, and fixed shares make every other thread wait for it. `per_thread`
// chunks per thread: many where each item is compute (several rows), few where it streams weights (one row: long
// contiguous ranges keep the prefetchers' streams). Each item's result does not depend on the thread running it.
template <class F>
void parallel_chunks(int64_t n, const F& f, int64_t per_thread = 8) {
  const int64_t T = std::min<int64_t>(at::get_num_threads(), n);
  if (T <= 1 || at::in_parallel_region()) { if (n > 0) f(0, n); return; }
  const int64_t chunk = std::max<int64_t>(1, n / (per_thread * T));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, T, 1, [&](int64_t, int64_t) {
    for (int64_t i0; (i0 = next.fetch_add(chunk)) < n;) f(i0, std::min(n, i0 + chunk));
  });
}

// chunks per thread of a pass over weight column blocks for M rows
inline int64_t chunks_per_thread(int64_t M) { return M >= 4 ? 8 : 2; }

// The input rows of a call as the kernels take them: fp32 (x, row stride ldx) and, where a weight of the call is
// of an int8-activation kind, quantized once for all its column blocks (q: qrow_bytes(K) per row; empty where none is)
struct Rows {
  const float* x;
  int64_t ldx;
  std::vector<char> q;
  Rows(const float* x_, int64_t M, int64_t ldx_, int64_t K, bool quantize) : x(x_), ldx(ldx_) {
    if (!quantize) return;
    const int64_t lq = qrow_bytes(K);
    q.resize(M * lq);
    for (int64_t m = 0; m < M; m++) T->quantize_row(x + m * ldx, K, q.data() + m * lq);
  }
};

// M rows of x against column block nb of w (the kernel takes them in register passes of T->rows)
inline void rows_n(int64_t M, const Rows& x, const WB& w, int64_t nb, float* out, int64_t ldo, int64_t ncols,
                   const float* bias, float alpha, bool accumulate) {
  if (int8_kind(w.kind)) {
    TORCH_CHECK(!x.q.empty(), "dlm_cpu: int8 weights without quantized inputs");
    T->dot_block(w.kind, M, x.q.data(), w.p + nb * w.bytes, w.K, out, ldo, ncols, bias, alpha, accumulate);
  } else {
    T->block(w.kind, M, x.x, x.ldx, w.p + nb * w.bytes, w.K, out, ldo, ncols, bias, alpha, accumulate);
  }
}

// out[M, N] (row stride ldo) = x @ W.T (+ bias) or += alpha * x @ W.T; column blocks past NB come from tail
void linear_into(const float* xp, int64_t M, const WB& w, int64_t NB, int64_t N, const float* bp, float* op,
                 int64_t ldo, float alpha, bool accumulate, const WB* tail = nullptr, int64_t NBT = 0) {
  const Rows x(xp, M, w.K, w.K, int8_kind(w.kind) || (NBT && int8_kind(tail->kind)));
  auto blocks = [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; nb++) {
      int64_t ncols = std::min<int64_t>(COLS, N - nb * COLS);
      const WB& ww = nb < NB ? w : *tail;
      rows_n(M, x, ww, nb < NB ? nb : nb - NB, op + nb * COLS, ldo, ncols, bp ? bp + nb * COLS : nullptr, alpha,
             accumulate);
    }
  };
  parallel_chunks(NB + NBT, blocks, chunks_per_thread(M));
}

const float* opt_ptr(const c10::optional<at::Tensor>& t) {
  return (t.has_value() && t->defined() && t->numel()) ? t->data_ptr<float>() : nullptr;
}

}  // namespace

// -- the operators ----------------------------------------------------------------------------------------------

std::string isa() { return T->name; }

// Use the kernels of `name` ("avx512", "avx2", "generic", or "auto": the best this CPU runs); returns the name in
// use, or raises where this CPU lacks the instruction set.
std::string set_isa(std::string name) {
  if (name == "auto") { T = best(); return T->name; }
  const KernelTable* t = table_of(name);
  TORCH_CHECK(t != nullptr, "dlm_cpu: this CPU (or build) has no '", name, "' kernels; choose auto, avx512, avx2 "
              "or generic");
  T = t;
  return T->name;
}

// the instruction sets this CPU can run, best first, comma separated
std::string isas() {
  std::string s;
  for (const char* n : {"avx512vnni", "avx512", "avx2", "generic"})
    if (table_of(n)) s += (s.empty() ? "" : ",") + std::string(n);
  return s;
}

at::Tensor pack(at::Tensor w, bool transposed) {
  // w: [N, K] (nn.Linear) or [K, N] (transposed: GPT-2's Conv1D) -> fp32 [ceil(N/32), K, 32], zero padded
  auto wt = transposed ? w.t() : w;
  int64_t N = wt.size(0), K = wt.size(1), NB = (N + COLS - 1) / COLS;
  auto padded = torch::zeros({NB * COLS, K}, w.options());
  padded.narrow(0, 0, N).copy_(wt);
  return padded.view({NB, COLS, K}).transpose(1, 2).contiguous();
}

at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias,
                  c10::optional<at::Tensor> tail) {
  // x: [M, K] contiguous fp32; packed: a packed weight; tail: the packed weight of its last columns -> [M, N]
  WB w = wb_of(packed), t = w;
  int64_t NBT = 0;
  if (tail.has_value() && tail->defined()) { t = wb_of(*tail); NBT = tail->size(0); }
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.scalar_type() == at::kFloat && w.K == x.size(1) &&
              t.K == w.K && (packed.size(0) + NBT) * COLS >= N && (NBT == 0 || packed.size(0) * COLS < N),
              "dlm_cpu.linear: bad shapes");
  int64_t M = x.size(0);
  auto out = torch::empty({M, N}, x.options());
  linear_into(x.data_ptr<float>(), M, w, packed.size(0), N, opt_ptr(bias), out.data_ptr<float>(), N, 1.0f, false,
              &t, NBT);
  return out;
}

namespace {
// outs[i] [ms[i], ns[i]] = xs[i] [ms[i], K] @ W_i.T (+ bias_i): one threaded pass over all the weights' column
// blocks (inputs of K columns, each weight its own input and rows: a layer's q / k / v projections of all rows and
// its adapters' A of the mask rows in the same pass)
void linears_into(const std::vector<const float*>& xs, const std::vector<int64_t>& ms, int64_t K,
                  const std::vector<WB>& ws, const std::vector<int64_t>& nbs, const std::vector<int64_t>& ns,
                  const std::vector<const float*>& bp, const std::vector<float*>& op) {
  const int64_t P = (int64_t)ws.size();
  std::vector<int64_t> start(P + 1, 0);
  for (int64_t i = 0; i < P; i++) start[i + 1] = start[i] + nbs[i];
  std::vector<std::unique_ptr<Rows>> own(P);  // each distinct input once (quantized once where a weight wants it)
  std::vector<const Rows*> of(P);
  for (int64_t i = 0; i < P; i++) {
    int64_t first = 0;
    while (xs[first] != xs[i]) first++;
    if (first == i) {
      bool quantize = false;
      for (int64_t j = i; j < P; j++) quantize |= xs[j] == xs[i] && int8_kind(ws[j].kind);
      own[i] = std::make_unique<Rows>(xs[i], ms[i], K, K, quantize);
    }
    of[i] = own[first].get();
  }
  parallel_chunks(start[P], [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; blk++) {
      int64_t i = std::upper_bound(start.begin(), start.end(), blk) - start.begin() - 1;
      int64_t nb = blk - start[i], N = ns[i];
      rows_n(ms[i], *of[i], ws[i], nb, op[i] + nb * COLS, N, std::min<int64_t>(COLS, N - nb * COLS),
             bp[i] ? bp[i] + nb * COLS : nullptr, 1.0f, false);
    }
  }, chunks_per_thread(ms[0]));
}

void linears_into(const float* xp, int64_t M, int64_t K, const std::vector<WB>& ws, const std::vector<int64_t>& nbs,
                  const std::vector<int64_t>& ns, const std::vector<const float*>& bp, const std::vector<float*>& op) {
  linears_into(std::vector<const float*>(ws.size(), xp), std::vector<int64_t>(ws.size(), M), K, ws, nbs, ns, bp, op);
}
}  // namespace

// Several linears of the same input in one threaded pass over all their column blocks (q, k, v):
// outs[i] [M, ns[i]] = x [M, K] @ W_i.T (+ bias_i; an empty tensor for none)
std::vector<at::Tensor> linears(at::Tensor x, std::vector<at::Tensor> packed, std::vector<int64_t> ns,
                                std::vector<at::Tensor> biases) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.scalar_type() == at::kFloat && packed.size() == ns.size() &&
              biases.size() == ns.size(), "dlm_cpu.linears: bad shapes");
  int64_t M = x.size(0), K = x.size(1), P = (int64_t)packed.size();
  std::vector<at::Tensor> outs;
  std::vector<WB> ws;
  std::vector<int64_t> nbs(P);
  std::vector<const float*> bp(P);
  std::vector<float*> op(P);
  for (int64_t i = 0; i < P; i++) {
    ws.push_back(wb_of(packed[i]));
    TORCH_CHECK(ws[i].K == K && packed[i].size(0) * COLS >= ns[i], "dlm_cpu.linears: bad shapes");
    outs.push_back(torch::empty({M, ns[i]}, x.options()));
    nbs[i] = packed[i].size(0);
    bp[i] = biases[i].numel() ? biases[i].data_ptr<float>() : nullptr;
    op[i] = outs[i].data_ptr<float>();
  }
  linears_into(x.data_ptr<float>(), M, K, ws, nbs, ns, bp, op);
  return outs;
}

// out [M, N] += x [M, K] @ W.T in place (a residual around a projection: the sum rounded once, as out + x @ W.T)
void linear_add_(at::Tensor out, at::Tensor x, at::Tensor packed) {
  WB w = wb_of(packed);
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && out.dim() == 2 && out.stride(1) == 1 &&
              out.size(0) == x.size(0) && w.K == x.size(1) && packed.size(0) * COLS >= out.size(1),
              "dlm_cpu.linear_add_: bad shapes");
  linear_into(x.data_ptr<float>(), x.size(0), w, packed.size(0), out.size(1), nullptr, out.data_ptr<float>(),
              out.stride(0), 1.0f, true);
}

namespace {
// out[M, N] (row stride ldo) += scale * (x[M, K] @ A.T) @ B.T: a low-rank adapter's delta on M rows
void lora_into(const float* xp, int64_t M, const WB& wa, int64_t nba, int64_t r, const WB& wb, int64_t nbb,
               int64_t N, float* op, int64_t ldo, float scale) {
  // threaded even for one row: the adapter's weights, not its arithmetic, are the cost (in a decode forward, where
  // they come from memory, one thread streaming them alone cost more than handing half to the other)
  std::vector<float> h(M * r);
  linear_into(xp, M, wa, nba, r, nullptr, h.data(), r, 1.0f, false);
  linear_into(h.data(), M, wb, nbb, N, nullptr, op, ldo, scale, true);
}
}  // namespace

// out[M, N] += scale * (x[M, K] @ A.T) @ B.T (a low-rank adapter's delta; out: rows of a layer output)
void lora_add(at::Tensor out, at::Tensor x, at::Tensor packed_a, int64_t r, at::Tensor packed_b, double scale) {
  TORCH_CHECK(x.is_contiguous() && out.stride(1) == 1 && out.size(0) == x.size(0), "dlm_cpu.lora_add: bad shapes");
  WB wa = wb_of(packed_a), wbb = wb_of(packed_b);
  TORCH_CHECK(wa.K == x.size(1) && wbb.K == r, "dlm_cpu.lora_add: bad shapes");
  lora_into(x.data_ptr<float>(), x.size(0), wa, packed_a.size(0), r, wbb, packed_b.size(0), out.size(1),
            out.data_ptr<float>(), out.stride(0), (float)scale);
}

// RMSNorm of each row of x [..., D] (contiguous), transformers' LlamaRMSNorm to rounding
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(-1) && x.scalar_type() == at::kFloat,
              "dlm_cpu.rms_norm: bad shapes");
  int64_t D = x.size(-1), M = x.numel() / D;
  auto o = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = o.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; m++) T->rms_row(xp + m * D, wp, op + m * D, D, (float)eps);
  });
  return o;
}

// Rotary embedding, bit for bit transformers' apply_rotary_pos_emb: x [B, H, T, D] (any strides, the last 1);
// cos, sin [B, T, D] (the last stride 1) -> contiguous [B, H, T, D]
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && sin.dim() == 3 && x.stride(3) == 1 && cos.stride(2) == 1 &&
              sin.stride(2) == 1 && x.size(3) % 2 == 0, "dlm_cpu.rope: bad shapes");
  int64_t B = x.size(0), H = x.size(1), Tn = x.size(2), D = x.size(3);
  auto o = torch::empty({B, H, Tn, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = o.data_ptr<float>();
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t t = 0; t < Tn; t++)
        T->rope_row(xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2),
                    cp + b * cos.stride(0) + t * cos.stride(1), sp + b * sin.stride(0) + t * sin.stride(1),
                    op + ((b * H + h) * Tn + t) * D, D / 2);
  return o;
}

// silu(x @ G.T) * (x @ U.T) for a gated MLP: both projections in one threaded pass over their column blocks
at::Tensor gate_up(at::Tensor x, at::Tensor packed_g, at::Tensor packed_u, int64_t N) {
  WB wg = wb_of(packed_g), wu = wb_of(packed_u);
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && wg.K == x.size(1) && wu.K == x.size(1) &&
              packed_u.size(0) == packed_g.size(0), "dlm_cpu.gate_up: bad shapes");
  int64_t M = x.size(0), K = x.size(1), NB = packed_g.size(0);
  auto out = torch::empty({M, N}, x.options());
  const Rows xr(x.data_ptr<float>(), M, K, K, int8_kind(wg.kind) || int8_kind(wu.kind));
  float* op = out.data_ptr<float>();
  parallel_chunks(NB, [&](int64_t b0, int64_t b1) {
    std::vector<float> g(M * COLS), u(M * COLS), s(COLS);
    for (int64_t nb = b0; nb < b1; nb++) {
      rows_n(M, xr, wg, nb, g.data(), COLS, COLS, nullptr, 1.f, false);
      rows_n(M, xr, wu, nb, u.data(), COLS, COLS, nullptr, 1.f, false);
      int64_t ncols = std::min<int64_t>(COLS, N - nb * COLS);
      for (int64_t m = 0; m < M; m++) {
        T->silu_mul(g.data() + m * COLS, u.data() + m * COLS, s.data(), COLS);
        std::copy(s.begin(), s.begin() + ncols, op + m * N + nb * COLS);
      }
    }
  }, chunks_per_thread(M));
  return out;
}

// Attention of a few queries over a KV cache, grouped-query: q [B, H, T, D], k, v [B, Hk, S, D] (any strides, the
// last 1), mask [B, 1, T, S] bool (any strides) or none (every key) -> [B, T, H, D] contiguous. Each query's output
// is computed over the keys in order whatever T and the other queries are.
at::Tensor attend(at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> mask, double scale) {
  int64_t B = q.size(0), H = q.size(1), Tn = q.size(2), D = q.size(3), Hk = k.size(1), S = k.size(2);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && D % 16 == 0 && v.size(3) == D &&
              H % Hk == 0 && k.size(0) == B && v.size(2) == S, "dlm_cpu.attend: bad shapes");
  bool has_mask = mask.has_value() && mask->defined();
  const bool* mp = has_mask ? mask->data_ptr<bool>() : nullptr;
  int64_t ms0 = has_mask ? mask->stride(0) : 0, ms2 = has_mask ? mask->stride(2) : 0,
          ms3 = has_mask ? mask->stride(3) : 0;
  auto out = torch::empty({B, Tn, H, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rep = H / Hk, SP = (S + 15) / 16 * 16;
  parallel_chunks(B * H, [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(2 * SP);  // (attend_query's scratch: scores, then slots)
    for (int64_t i = i0; i < i1; i++) {
      int64_t b = i / H, h = i % H, hk = h / rep;
      const float* kb = kp + b * k.stride(0) + hk * k.stride(1);
      const float* vb = vp + b * v.stride(0) + hk * v.stride(1);
      for (int64_t t = 0; t < Tn; t++)
        T->attend_query(qp + b * q.stride(0) + h * q.stride(1) + t * q.stride(2), kb, k.stride(2), vb, v.stride(2),
                        has_mask ? mp + b * ms0 + t * ms2 : nullptr, ms3, S, D, (float)scale, buf.data(),
                        op + ((b * Tn + t) * H + h) * D);
    }
  });
  return out;
}

// -- a Llama-form decoder layer in two calls (the KV cache's update between them stays the caller's) -----------
// Each is exactly the per-op sequence it replaces (the same kernels on the same data in the same order), so a
// layer's output is bit for bit that of rms_norm / linears / rope / attend / linear / gate_up / linear_add_.

// h = rms_norm(x); q, k, v = h @ Wq.T (+ bq), h @ Wk.T (+ bk), h @ Wv.T (+ bv); the rotary embedding of q and k.
// x [B * T, D] contiguous (rows b-major); cos, sin [B, T, hd] (the last stride 1) -> q [B, H, T, hd] and
// k [B, Hk, T, hd] contiguous, v [B, Hk, T, hd] (a view of [B, T, Hk, hd]).
namespace {
struct Deltas {  // gated adapters on q / k / v (layer_in_gated): their packed A, B, rank and scale; the mask rows
  bool has[3];
  WB a[3], b[3];
  int64_t nba[3], nbb[3];
  int64_t r;
  float scale;
  const at::Tensor* rows;
};

std::vector<at::Tensor> layer_in_impl(at::Tensor x, at::Tensor nw, double eps, at::Tensor pq, at::Tensor pk,
                                      at::Tensor pv, std::vector<int64_t> ns, std::vector<at::Tensor> biases,
                                      at::Tensor cos, at::Tensor sin, int64_t B, int64_t hd, const Deltas* lora) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.scalar_type() == at::kFloat && nw.is_contiguous() &&
              nw.numel() == x.size(1) && ns.size() == 3 && biases.size() == 3 && B > 0 && x.size(0) % B == 0 &&
              hd > 0 && hd % 2 == 0 && ns[0] % hd == 0 && ns[1] % hd == 0 && ns[2] % hd == 0,
              "dlm_cpu.layer_in: bad shapes");
  const int64_t M = x.size(0), D = x.size(1), Tn = M / B;
  TORCH_CHECK(cos.dim() == 3 && sin.dim() == 3 && cos.size(0) == B && cos.size(1) == Tn && cos.size(2) == hd &&
              sin.sizes() == cos.sizes() && cos.stride(2) == 1 && sin.stride(2) == 1,
              "dlm_cpu.layer_in: bad rotary shapes");
  std::vector<WB> ws = {wb_of(pq), wb_of(pk), wb_of(pv)};
  std::vector<int64_t> nbs = {pq.size(0), pk.size(0), pv.size(0)};
  for (int i = 0; i < 3; i++)
    TORCH_CHECK(ws[i].K == D && nbs[i] * COLS >= ns[i], "dlm_cpu.layer_in: bad weight shapes");
  auto h = torch::empty({M, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  for (int64_t m = 0; m < M; m++) T->rms_row(xp + m * D, nw.data_ptr<float>(), hp + m * D, D, (float)eps);
  std::vector<at::Tensor> lin;
  std::vector<const float*> bp(3);
  std::vector<float*> op(3);
  for (int i = 0; i < 3; i++) {
    lin.push_back(torch::empty({M, ns[i]}, x.options()));
    bp[i] = biases[i].numel() ? biases[i].data_ptr<float>() : nullptr;
    TORCH_CHECK(!bp[i] || biases[i].numel() == ns[i], "dlm_cpu.layer_in: bad bias");
    op[i] = lin[i].data_ptr<float>();
  }
  if (!lora) {
    linears_into(hp, M, D, ws, nbs, ns, bp, op);
  } else {
    // Each adapter's delta scale * B(A(h)) on the mask rows, the same kernels on the same data as lora_add on each
    // run of consecutive mask rows: the mask rows of h gathered (a row's products do not depend on the rows beside
    // it), their A products computed in the projections' threaded pass, then one threaded pass over the B blocks
    // adding each run's delta to its rows (at batch 1 a few rows: the adapters' weights, not the arithmetic, are
    // the cost, and one thread streaming them alone left the other idle)
    const int64_t n = lora->rows->numel(), r = lora->r;
    const int64_t* ri = lora->rows->data_ptr<int64_t>();
    std::vector<int64_t> runs;  // (first mask row, first row of h, length) per run of consecutive rows
    for (int64_t lo = 0; lo < n;) {
      int64_t hi = lo + 1;
      while (hi < n && ri[hi] == ri[hi - 1] + 1) hi++;
      TORCH_CHECK(0 <= ri[lo] && ri[lo] + (hi - lo) <= M && (lo == 0 || ri[lo] > ri[lo - 1]),
                  "dlm_cpu.layer_in_gated: mask rows out of range or not ascending");
      runs.insert(runs.end(), {lo, ri[lo], hi - lo});
      lo = hi;
    }
    std::vector<float> hm(n * D), u(3 * n * r);
    for (int64_t m = 0; m < n; m++) std::copy(hp + ri[m] * D, hp + (ri[m] + 1) * D, hm.data() + m * D);
    std::vector<const float*> xs(3, hp);
    std::vector<int64_t> ms(3, M);
    std::vector<int64_t> adapters;
    for (int i = 0; i < 3; i++)
      if (lora->has[i]) {
        adapters.push_back(i);
        xs.push_back(hm.data()), ms.push_back(n), ws.push_back(lora->a[i]), nbs.push_back(lora->nba[i]);
        ns.push_back(r), bp.push_back(nullptr), op.push_back(u.data() + i * n * r);
      }
    linears_into(xs, ms, D, ws, nbs, ns, bp, op);
    std::vector<int64_t> start(1, 0);
    for (int64_t i : adapters) start.push_back(start.back() + lora->nbb[i]);
    parallel_chunks(start.back(), [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; blk++) {
        int64_t j = std::upper_bound(start.begin(), start.end(), blk) - start.begin() - 1, i = adapters[j];
        int64_t nb = blk - start[j], N = ns[i];
        for (size_t x = 0; x < runs.size(); x += 3)
          rows_n(runs[x + 2], Rows(u.data() + (i * n + runs[x]) * r, runs[x + 2], r, r, false), lora->b[i], nb,
                 op[i] + runs[x + 1] * N + nb * COLS, N, std::min<int64_t>(COLS, N - nb * COLS), nullptr,
                 lora->scale, true);
      }
    }, chunks_per_thread(n));
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  std::vector<at::Tensor> outs;
  for (int i = 0; i < 2; i++) {  // q, k: [B, T, H, hd] -> roped [B, H, T, hd]
    const int64_t H = ns[i] / hd;
    auto o = torch::empty({B, H, Tn, hd}, x.options());
    float* o_ = o.data_ptr<float>();
    for (int64_t b = 0; b < B; b++)
      for (int64_t hh = 0; hh < H; hh++)
        for (int64_t t = 0; t < Tn; t++)
          T->rope_row(op[i] + (b * Tn + t) * ns[i] + hh * hd, cp + b * cos.stride(0) + t * cos.stride(1),
                      sp + b * sin.stride(0) + t * sin.stride(1), o_ + ((b * H + hh) * Tn + t) * hd, hd / 2);
    outs.push_back(o);
  }
  outs.push_back(lin[2].view({B, Tn, ns[2] / hd, hd}).transpose(1, 2));
  return outs;
}

}  // namespace

std::vector<at::Tensor> layer_in(at::Tensor x, at::Tensor nw, double eps, at::Tensor pq, at::Tensor pk,
                                 at::Tensor pv, std::vector<int64_t> ns, std::vector<at::Tensor> biases,
                                 at::Tensor cos, at::Tensor sin, int64_t B, int64_t hd) {
  return layer_in_impl(x, nw, eps, pq, pk, pv, ns, biases, cos, sin, B, hd, nullptr);
}

// layer_in with gated-LoRA adapters on q / k / v: after the three projections, each adapter's scale * B(A(h)) is
// added to its output's mask rows (`rows`: int64 indices into the B * T rows, ascending) before the rotary
// embedding - the same kernels on the same data as rms_norm / linears / lora_add (each run of consecutive mask
// rows one lora_add) / rope. a[i], b[i]: projection i's packed A [r, D] and B [N_i, r], or empty tensors for none.
namespace {
// the adapters' arguments of layer_in_gated checked and gathered
Deltas deltas_of(const at::Tensor& x, const at::Tensor& rows, const std::vector<at::Tensor>& a,
                 const std::vector<at::Tensor>& b, const std::vector<int64_t>& ns, int64_t r, double scale) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() && a.size() == 3 &&
              b.size() == 3 && ns.size() == 3 && r > 0, "dlm_cpu.layer_in_gated: bad adapter arguments");
  Deltas d;
  d.r = r;
  d.scale = (float)scale;
  d.rows = &rows;
  for (int i = 0; i < 3; i++) {
    d.has[i] = a[i].numel() > 0;
    if (!d.has[i]) continue;
    TORCH_CHECK(b[i].numel() > 0, "dlm_cpu.layer_in_gated: an adapter's A without its B");
    d.a[i] = wb_of(a[i]), d.b[i] = wb_of(b[i]);
    d.nba[i] = a[i].size(0), d.nbb[i] = b[i].size(0);
    TORCH_CHECK(d.a[i].K == x.size(1) && d.nba[i] * COLS >= r && d.b[i].K == r && d.nbb[i] * COLS >= ns[i],
                "dlm_cpu.layer_in_gated: bad adapter shapes");
  }
  return d;
}
}  // namespace

std::vector<at::Tensor> layer_in_gated(at::Tensor x, at::Tensor nw, double eps, at::Tensor pq, at::Tensor pk,
                                       at::Tensor pv, std::vector<int64_t> ns, std::vector<at::Tensor> biases,
                                       at::Tensor cos, at::Tensor sin, int64_t B, int64_t hd, at::Tensor rows,
                                       std::vector<at::Tensor> a, std::vector<at::Tensor> b, int64_t r,
                                       double scale) {
  Deltas d = deltas_of(x, rows, a, b, ns, r, scale);
  return layer_in_impl(x, nw, eps, pq, pk, pv, ns, biases, cos, sin, B, hd, &d);
}

// x + o_proj(attention(q, k, v)) -> y; then y + down(silu(gate(h)) * up(h)) with h = rms_norm(y): the rest of the
// layer. x [B * T, D] contiguous (not modified); q, k, v, mask as attend's; -> [B * T, D]
at::Tensor layer_out(at::Tensor x, at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> mask,
                     double scale, at::Tensor po, at::Tensor nw, double eps, at::Tensor pg, at::Tensor pu, int64_t ni,
                     at::Tensor pd) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2 && x.scalar_type() == at::kFloat && nw.is_contiguous() &&
              nw.numel() == x.size(1) && q.size(0) * q.size(2) == x.size(0), "dlm_cpu.layer_out: bad shapes");
  const int64_t M = x.size(0), D = x.size(1);
  WB wo = wb_of(po), wd = wb_of(pd);
  TORCH_CHECK(wo.K == q.size(1) * q.size(3) && po.size(0) * COLS >= D && wd.K == ni && pd.size(0) * COLS >= D,
              "dlm_cpu.layer_out: bad weight shapes");
  auto a = attend(q, k, v, mask, scale).view({M, -1});
  auto y = x.clone();
  float* yp = y.data_ptr<float>();
  linear_into(a.data_ptr<float>(), M, wo, po.size(0), D, nullptr, yp, D, 1.0f, true);
  auto h = torch::empty({M, D}, x.options());
  for (int64_t m = 0; m < M; m++) T->rms_row(yp + m * D, nw.data_ptr<float>(), h.data_ptr<float>() + m * D, D, (float)eps);
  auto g = gate_up(h, pg, pu, ni);
  linear_into(g.data_ptr<float>(), M, wd, pd.size(0), D, nullptr, yp, D, 1.0f, true);
  return y;
}

// A decoder stack's decode chunk in one call: for each layer, layer_in (layer_in_gated where the layer's q / k / v
// adapters are given), the chunk's keys and values written into the layer's KV buffers after the n cached ones,
// then layer_out over the n + T keys - the calls (and the cache update) the per-layer loop makes, in its order on
// its data, without returning to Python between layers. x [B * T, D] contiguous (not modified); mask as attend's
// (over the n + T keys) or none. Per layer, STACK_TENSORS tensors in `ts`: input norm weight, packed q, k, v, their
// biases (empty: none), packed o_proj, post-attention norm weight, packed gate, up, down, the key and value buffers
// [B, Hk, >= n + T, hd] (written in place), then the adapters' packed A and B of q, k, v (empty: none); 3 doubles in
// `fs` (input norm eps, post-attention norm eps, attention scale); 4 ints in `is` (q, k, v widths, MLP width).
// `rows`, `r`, `lscale`: the mask rows and the adapters' rank and scale (rows empty: no adapters act).
constexpr int64_t STACK_TENSORS = 20;

at::Tensor decode_stack(at::Tensor x, at::Tensor cos, at::Tensor sin, c10::optional<at::Tensor> mask, int64_t B,
                        int64_t hd, int64_t n, std::vector<at::Tensor> ts, std::vector<double> fs,
                        std::vector<int64_t> is, at::Tensor rows, int64_t r, double lscale) {
  const int64_t L = (int64_t)ts.size() / STACK_TENSORS;
  TORCH_CHECK(L > 0 && (int64_t)ts.size() == L * STACK_TENSORS && (int64_t)fs.size() == 3 * L &&
              (int64_t)is.size() == 4 * L && x.dim() == 2 && x.size(0) % B == 0 && n >= 0,
              "dlm_cpu.decode_stack: bad arguments");
  const int64_t Tn = x.size(0) / B;
  at::Tensor h = x;
  for (int64_t l = 0; l < L; l++) {
    const at::Tensor* t = ts.data() + l * STACK_TENSORS;
    std::vector<int64_t> ns = {is[4 * l], is[4 * l + 1], is[4 * l + 2]};
    std::vector<at::Tensor> biases = {t[4], t[5], t[6]};
    std::vector<at::Tensor> a = {t[14], t[15], t[16]}, b = {t[17], t[18], t[19]};
    const bool gated = rows.numel() > 0 && (a[0].numel() || a[1].numel() || a[2].numel());
    std::vector<at::Tensor> qkv;
    if (gated) {
      Deltas d = deltas_of(h, rows, a, b, ns, r, lscale);
      qkv = layer_in_impl(h, t[0], fs[3 * l], t[1], t[2], t[3], ns, biases, cos, sin, B, hd, &d);
    } else {
      qkv = layer_in_impl(h, t[0], fs[3 * l], t[1], t[2], t[3], ns, biases, cos, sin, B, hd, nullptr);
    }
    at::Tensor kb = t[12], vb = t[13];
    TORCH_CHECK(kb.dim() == 4 && vb.dim() == 4 && kb.size(0) == B && vb.size(0) == B && kb.size(2) >= n + Tn &&
                vb.size(2) >= n + Tn && kb.size(1) == qkv[1].size(1) && vb.size(1) == qkv[2].size(1) &&
                kb.size(3) == hd && vb.size(3) == qkv[2].size(3), "dlm_cpu.decode_stack: bad KV buffers");
    kb.narrow(2, n, Tn).copy_(qkv[1]);
    vb.narrow(2, n, Tn).copy_(qkv[2]);
    h = layer_out(h, qkv[0], kb.narrow(2, 0, n + Tn), vb.narrow(2, 0, n + Tn), mask, fs[3 * l + 2], t[7], t[8],
                  fs[3 * l + 1], t[9], t[10], is[4 * l + 3], t[11]);
  }
  return h;
}

// Each tensor's in-place version and data address, [2 * len(ts)] int64: what a kept decode_stack plan compares
// before each forward (dlm.decode.cpu.stack._StackPlan.valid) - a few hundred tensors in one pass, where reading
// them from Python cost ~0.4 ms a forward. Inference tensors keep no version: an error, as in Python.
at::Tensor stamps(at::TensorList ts) {
  at::Tensor out = at::empty({2 * (int64_t)ts.size()}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (size_t i = 0; i < ts.size(); i++) {
    o[2 * i] = (int64_t)ts[i]._version();
    o[2 * i + 1] = (int64_t)(intptr_t)ts[i].data_ptr();
  }
  return out;
}

// stamps(ts) == s, stopping at the first difference.
bool stamps_equal(at::TensorList ts, const at::Tensor& s) {
  if (s.scalar_type() != at::kLong || !s.is_contiguous() || s.numel() != 2 * (int64_t)ts.size()) return false;
  const int64_t* o = s.data_ptr<int64_t>();
  for (size_t i = 0; i < ts.size(); i++) {
    if (o[2 * i + 1] != (int64_t)(intptr_t)ts[i].data_ptr() || o[2 * i] != (int64_t)ts[i]._version()) return false;
  }
  return true;
}

namespace {
// The row width V of logits x [..., V] that the greedy scans take (float32, last dim contiguous; `name` in the error).
int64_t row_width(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0 && x.stride(-1) == 1, "dlm_cpu.", name,
              ": float32 [..., V] with a contiguous last dimension expected");
  return x.size(-1);
}

// f(r, row) for each row r of such an x on the threads; returns the shape of one value per row (x's without its
// last dimension).
template <class F>
std::vector<int64_t> each_row(const at::Tensor& x, const F& f) {
  const int64_t V = x.size(-1);
  at::Tensor rows = x.reshape({-1, V});  // (a view where the rows are evenly strided)
  const float* base = rows.data_ptr<float>();
  const int64_t ld = rows.stride(0);
  at::parallel_for(0, rows.size(0), 4, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; r++) f(r, base + r * ld);
  });
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}
}  // namespace

// The greedy token of each row of x [..., V]: the first index of the row's largest value, column `skip` left out
// (the mask token; -1: none), a NaN above every number (torch.argmax's order) - what
// dlm.decode.sampling.argmax_no_mask gives, in one vector pass (torch's argmax scans a 49k-vocabulary row at about
// a float a nanosecond: ~80 us of a decode step).
at::Tensor argmax_skip(const at::Tensor& x, int64_t skip) {
  const int64_t V = row_width(x, "argmax_skip");
  at::Tensor out = at::empty({x.numel() / V}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  auto shape = each_row(x, [&](int64_t r, const float* row) { o[r] = T->argmax_row(row, V, skip); });
  return out.view(shape);
}

// argmax_skip's tokens and, for each, its probability under the softmax of the row without column `skip` (float32;
// NaN where the row holds a NaN or no finite value, as softmax gives): what ISD's greedy drafts record of their own
// confidence, without the vocabulary-wide copies of a masked softmax.
std::tuple<at::Tensor, at::Tensor> argmax_skip_prob(const at::Tensor& x, int64_t skip) {
  const int64_t V = row_width(x, "argmax_skip_prob"), R = x.numel() / V;
  at::Tensor out = at::empty({R}, at::kLong), prob = at::empty({R}, at::kFloat);
  int64_t* o = out.data_ptr<int64_t>();
  float* p = prob.data_ptr<float>();
  auto shape = each_row(x, [&](int64_t r, const float* row) {
    o[r] = T->argmax_row(row, V, skip);
    const float mx = row[o[r]];
    p[r] = (mx == mx && mx > -std::numeric_limits<float>::infinity() && o[r] != skip)
               ? 1.0f / T->exp_sum_row(row, V, skip, mx)
               : std::numeric_limits<float>::quiet_NaN();
  });
  return std::make_tuple(out.view(shape), prob.view(shape));
}

TORCH_LIBRARY(dlm_cpu, m) {
  m.def("isa", &isa);
  m.def("isas", &isas);
  m.def("set_isa", &set_isa);
  m.def("pack", &pack);
  m.def("linear", &linear);
  m.def("linears", &linears);
  m.def("linear_add_", &linear_add_);
  m.def("lora_add", &lora_add);
  m.def("rms_norm", &rms_norm);
  m.def("rope", &rope);
  m.def("gate_up", &gate_up);
  m.def("attend", &attend);
  m.def("layer_in", &layer_in);
  m.def("layer_in_gated", &layer_in_gated);
  m.def("layer_out", &layer_out);
  m.def("decode_stack", &decode_stack);
  m.def("stamps", &stamps);
  m.def("stamps_equal", &stamps_equal);
  m.def("argmax_skip", &argmax_skip);
  m.def("argmax_skip_prob", &argmax_skip_prob);
}
