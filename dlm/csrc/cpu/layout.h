// The packed weight layouts of the CPU decode kernels and the table of per-ISA kernel functions.
//
// Only plain C++ here (no torch headers): the ISA files include this with their own target pragma, and an inline
// function of a shared header compiled once per ISA would break the one-definition rule.
#pragma once
#include <stdint.h>

namespace dlm_cpu {

// Output columns per packed block. Every layout keeps 32 output columns x K inputs of a weight together, so that
// one pass over a block feeds 32 accumulators per input row.
constexpr int64_t COLS = 32;

// kind 0, fp32: [NB, K, 32] floats (for each input k, the 32 columns' weights contiguous).
constexpr int64_t F32_BLOCK_FLOATS_PER_K = COLS;

// kind 1, GGUF Q4_1 values (w = d * q + m per 32 consecutive inputs of an output; q in 0..15; the product and the
// sum each rounded in fp32, as GGUF's dequantization computes them), uint8 [NB, K / 32, Q4B]: per 32 columns x 32
// inputs, d[32] and m[32] (fp32; d an fp16 value, so d * q is exact in fp32), then 32 x 16 bytes of q: byte j of input k holds column j (low nibble) and column
// j + 16 (high nibble).
constexpr int64_t Q4_D = 0, Q4_M = 128, Q4_Q = 256, Q4B = 768;
static_assert(Q4_M == Q4_D + COLS * 4 && Q4_Q == Q4_M + COLS * 4 && Q4B == Q4_Q + 32 * 16,
              "Q4_1 block: 32 fp32 scales, 32 fp32 minima, 32 inputs x 32 four-bit columns");

// kind 2, GGUF Q8_0 values (w = d * q, q int8), int8 [NB, K / 32, Q8B]: d[32] (fp32), then 32 x 32 bytes of q
// (byte j of input k: column j).
constexpr int64_t Q8_D = 0, Q8_Q = 128, Q8B = 1152;
static_assert(Q8_Q == Q8_D + COLS * 4 && Q8B == Q8_Q + 32 * 32, "Q8_0 block: 32 fp32 scales, 32 x 32 int8");

constexpr int64_t PREFETCH_FLOATS = 1024;  // prefetch distance along an fp32 weight stream (4 KiB)
constexpr int64_t PREFETCH_BLOCKS = 4;     // ... along a quantized one, in 32-input blocks

enum Kind : int { F32 = 0, Q4_1 = 1, Q8_0 = 2 };

// The kernels one instruction set provides. Threading is the caller's (ops.cpp); each function does one unit.
struct KernelTable {
  const char* name;  // "avx512", "avx2", "generic"
  int rows;          // input rows one register pass of `block` holds (more rows: further passes)
  // out[m, j] (row stride ldo) for mb rows of x (row stride ldx) and the packed column block p of `kind` with K
  // inputs: = x @ W.T (+ bias[j]), or += alpha * x @ W.T (accumulate); only the first ncols columns written.
  // Each output is one multiply-add chain over k = 0 .. K-1 in order: bit for bit the same whatever mb is. Past
  // `rows` rows a quantized block's weights are rebuilt once for all the passes (not once per pass).
  void (*block)(int kind, int64_t mb, const float* x, int64_t ldx, const char* p, int64_t K, float* out,
                int64_t ldo, int64_t ncols, const float* bias, float alpha, bool accumulate);
  // o[n] = silu(g[n]) * u[n] for n a multiple of 16
  void (*silu_mul)(const float* g, const float* u, float* o, int64_t n);
  // RMSNorm of one row: w * (x * (1 / sqrt(mean(x^2) + eps))), each product rounded on its own
  void (*rms_row)(const float* x, const float* w, float* o, int64_t D, float eps);
  // rotary embedding of one head row (half width h2): x * cos + rotate_half(x) * sin, unfused
  void (*rope_row)(const float* x, const float* c, const float* s, float* o, int64_t h2);
  // one query's attention over S keys (row strides ks, vs; mask entries at mrow[s * ms], none: every key);
  // w: scratch of at least S rounded up to 16 floats; D a multiple of 16
  void (*attend_query)(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, const bool* mrow,
                       int64_t ms, int64_t S, int64_t D, float scale, float* w, float* o);
};

const KernelTable* table_generic();
const KernelTable* table_avx2();    // nullptr where not built (not x86-64)
const KernelTable* table_avx512();  // nullptr where not built

}  // namespace dlm_cpu
