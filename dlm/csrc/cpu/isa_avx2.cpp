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
#define DLM_DOT4(acc, w, x) \
  ((vi)_mm256_add_epi32((__m256i)(acc), _mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)(w), (__m256i)(x)), _mm256_set1_epi16(1))))
#define DLM_HALVES(p) ((vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))
#include "kernels.inc"
#else
const dlm_cpu::KernelTable* dlm_cpu::table_avx2() { return nullptr; }
#endif
