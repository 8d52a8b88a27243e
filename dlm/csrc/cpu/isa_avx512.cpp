// The kernels for x86-64 CPUs with AVX-512F (32 zmm registers: 8 input rows x 2 x 16 accumulators per pass).
#include "layout.h"
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512bw,avx2,fma,f16c")
#include <immintrin.h>

#define DLM_NS dlm_isa_avx512
#define DLM_V 16
#define DLM_ROWS 8
#define DLM_TABLE table_avx512
#define DLM_NAME "avx512"
#define DLM_WIDEN_U8(p) ((vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))
#define DLM_WIDEN_S8(p) ((vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))
#define DLM_BARRIER(a, b) asm("" : "+v"(a), "+v"(b))
#define DLM_DOT4(acc, w, x) \
  ((vi)_mm512_add_epi32((__m512i)(acc), _mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)(w), (__m512i)(x)), _mm512_set1_epi16(1))))
#define DLM_HALVES(p) ((vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))))
#include "kernels.inc"
#else
const dlm_cpu::KernelTable* dlm_cpu::table_avx512() { return nullptr; }
#endif
