// The kernels for x86-64 CPUs with AVX-512F and BW (32 zmm registers: 8 input rows x 2 x 16 accumulators per pass),
// and their variant with AVX-512 VNNI.
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
// the int8-activation dot products (dot.inc) with AVX-512BW: maddubs (pairs of byte products in int16: at most 2 x
// 15 x 127 or 2 x 127 x 127, no saturation) and madd (the pairs summed in int32)
static inline __m512i dlm_pairs(__m512i acc, __m512i u, __m512i s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
// signed x signed as unsigned x signed: |x| times w with x's sign (w != -128)
static inline __m512i dlm_abs_x(__m512i x) { return _mm512_abs_epi8(x); }
static inline __m512i dlm_signed_w(__m512i w, __m512i x) {
  return _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(x), _mm512_setzero_si512(), w);
}
#define DLM_DOTU(acc, w, x) ((vi)dlm_pairs((__m512i)(acc), (__m512i)(w), (__m512i)(x)))
#define DLM_DOTS(acc, w, x) ((vi)dlm_pairs((__m512i)(acc), dlm_abs_x((__m512i)(x)), dlm_signed_w((__m512i)(w), (__m512i)(x))))
#define DLM_HALVES(p) ((vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))))
#include "kernels.inc"

// The same kernels with AVX-512 VNNI's dot products (one vpdpbusd for the four byte products and their sum):
// only the int8-activation kernels differ, so only they are compiled again
#pragma GCC push_options
#pragma GCC target("avx512vnni")
namespace DLM_NS {
namespace vnni {
#undef DLM_DOTU
#undef DLM_DOTS
#define DLM_DOTU(acc, w, x) ((vi)_mm512_dpbusd_epi32((__m512i)(acc), (__m512i)(w), (__m512i)(x)))
#define DLM_DOTS(acc, w, x) \
  ((vi)_mm512_dpbusd_epi32((__m512i)(acc), dlm_abs_x((__m512i)(x)), dlm_signed_w((__m512i)(w), (__m512i)(x))))
#define DLM_DOT_VARIANT
#include "dot.inc"
}  // namespace vnni
}  // namespace DLM_NS
#pragma GCC pop_options

namespace DLM_NS {
static const KernelTable table_vnni = [] {
  KernelTable t = table;
  t.name = "avx512vnni";
  t.dot_block = vnni::dot_block;
  return t;
}();
}  // namespace DLM_NS

const dlm_cpu::KernelTable* dlm_cpu::table_avx512vnni() { return &DLM_NS::table_vnni; }
#else
const dlm_cpu::KernelTable* dlm_cpu::table_avx512() { return nullptr; }
const dlm_cpu::KernelTable* dlm_cpu::table_avx512vnni() { return nullptr; }
#endif
