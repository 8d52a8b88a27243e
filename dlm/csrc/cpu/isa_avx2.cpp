// The kernels for x86-64 CPUs with AVX2 and FMA (16 ymm registers: 4 input rows x 2 x 8 accumulators per pass).
#include "layout.h"
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#define DLM_NS dlm_isa_avx2
#define DLM_V 8
#define DLM_ROWS 4
#define DLM_TABLE table_avx2
#define DLM_NAME "avx2"
#define DLM_WIDEN_U8(p) ((vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))
#define DLM_WIDEN_S8(p) ((vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))))
#define DLM_BARRIER(a, b) asm("" : "+v"(a), "+v"(b))
// the int8-activation dot products (dot.inc): maddubs (pairs of byte products in int16, no saturation: at most
// 2 x 15 x 127 or 2 x 127 x 127) and madd (the pairs summed in int32); signed weights as |x| times w with x's sign
static inline __m256i dlm_pairs(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#define DLM_DOTU(acc, w, x) ((vi)dlm_pairs((__m256i)(acc), (__m256i)(w), (__m256i)(x)))
#define DLM_DOTS(acc, w, x) \
  ((vi)dlm_pairs((__m256i)(acc), _mm256_sign_epi8((__m256i)(x), (__m256i)(x)), _mm256_sign_epi8((__m256i)(w), (__m256i)(x))))
#define DLM_HALVES(p) ((vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))
#include "kernels.inc"
#else
const dlm_cpu::KernelTable* dlm_cpu::table_avx2() { return nullptr; }
#endif
