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

// kind 3, GGUF Q4_1 values taken with int8 activations (KernelOptions.activations "int8"), uint8 [NB, K / 32,
// Q4IB]: per 32 columns x 32 inputs, d[32] and m[32] as fp16 (GGUF's own scales), then 8 groups of 4 inputs, 64
// bytes each: byte 4 * c + i of group g holds input 4 * g + i of column c (low nibble) and of column c + 16 (high
// nibble), so that one 32-bit lane holds a column's 4 consecutive inputs, as an integer dot product of 4 bytes
// wants them. The input rows are quantized first (quantize_row; qrow_bytes(K) per row): per 32 inputs, dx = max|x| /
// 127 and q = round-to-nearest-even(x / dx) in int8, and sx = the 32 inputs' sum in order; each block then adds
// (d * dx) * (sum over its 32 inputs of q_w * q_x, exact in int32) + m * sx to the column's sum. Not the fp32
// result: the activations' rounding (relative error ~1e-2 on an output), as llama.cpp computes these weights.
constexpr int64_t Q4I_D = 0, Q4I_M = 64, Q4I_Q = 128, Q4IB = 640;
static_assert(Q4I_M == Q4I_D + COLS * 2 && Q4I_Q == Q4I_M + COLS * 2 && Q4IB == Q4I_Q + 32 * 16,
              "Q4_1 int8 block: 32 fp16 scales, 32 fp16 minima, 8 groups of 4 inputs x 32 four-bit columns");
// kind 4, GGUF Q8_0 values taken with int8 activations, uint8 [NB, K / 32, Q8IB] (the bytes signed): d[32] (fp32),
// then 8 groups of 4 inputs, 128 bytes each: byte 4 * c + i of group g holds input 4 * g + i of column c. Each block
// adds (d * dx) * (sum over its inputs of q_w * q_x) to the column's sum; a weight of -128 keeps the exact layout.
constexpr int64_t Q8I_D = 0, Q8I_Q = 128, Q8IB = 1152;
static_assert(Q8I_Q == Q8I_D + COLS * 4 && Q8IB == Q8I_Q + 32 * 32, "Q8_0 int8 block: 32 fp32 scales, 32 x 32 int8");
// bytes of one quantized input row of K inputs: K int8, then K / 32 fp32 scales dx, then K / 32 fp32 sums sx
inline int64_t qrow_bytes(int64_t K) { return K + 8 * (K / 32); }

constexpr int64_t PREFETCH_FLOATS = 1024;  // prefetch distance along an fp32 weight stream (4 KiB)
constexpr int64_t PREFETCH_BLOCKS = 4;     // ... along a quantized one, in 32-input blocks

enum Kind : int { F32 = 0, Q4_1 = 1, Q8_0 = 2, Q4_1_I8 = 3, Q8_0_I8 = 4 };
inline bool int8_kind(int kind) { return kind == Q4_1_I8 || kind == Q8_0_I8; }

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
  // the same for the int8-activation kinds (Q4_1_I8, Q8_0_I8): xq the mb input rows quantized by quantize_row
  // (qrow_bytes(K) apart)
  void (*dot_block)(int kind, int64_t mb, const char* xq, const char* p, int64_t K, float* out, int64_t ldo,
                    int64_t ncols, const float* bias, float alpha, bool accumulate);
  // one input row of K inputs (a multiple of 32) quantized for dot_block: qrow_bytes(K) bytes at o
  void (*quantize_row)(const float* x, int64_t K, char* o);
  // o[n] = silu(g[n]) * u[n] for n a multiple of 16
  void (*silu_mul)(const float* g, const float* u, float* o, int64_t n);
  // RMSNorm of one row: w * (x * (1 / sqrt(mean(x^2) + eps))), each product rounded on its own
  void (*rms_row)(const float* x, const float* w, float* o, int64_t D, float eps);
  // rotary embedding of one head row (half width h2): x * cos + rotate_half(x) * sin, unfused
  void (*rope_row)(const float* x, const float* c, const float* s, float* o, int64_t h2);
  // one query's attention over S keys (row strides ks, vs; mask entries at mrow[s * ms], none: every key), the
  // same whatever masked slots lie between the keys attended; w: scratch of twice S rounded up to 16 floats; D a
  // multiple of 16
  void (*attend_query)(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, const bool* mrow,
                       int64_t ms, int64_t S, int64_t D, float scale, float* w, float* o);
  // the first index in [0, n) other than `skip` (-1: none) of x's largest value, a NaN above every number (the
  // first NaN wins); where every other value is -inf, the first column not skipped
  int64_t (*argmax_row)(const float* x, int64_t n, int64_t skip);
  // the sum over [0, n) but `skip` of exp(x[i] - mx) (the row's softmax denominator where mx is its largest value)
  float (*exp_sum_row)(const float* x, int64_t n, int64_t skip, float mx);
};

const KernelTable* table_generic();
const KernelTable* table_avx2();    // nullptr where not built (not x86-64)
const KernelTable* table_avx512();  // nullptr where not built
const KernelTable* table_avx512vnni();  // the same with AVX-512 VNNI's dot products; nullptr where not built

}  // namespace dlm_cpu
