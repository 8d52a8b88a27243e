// The kernels for any CPU, with the compiler's baseline instruction set (SSE2 on x86-64, NEON on arm64).
#include "layout.h"

namespace dlm_generic_detail {
constexpr int LANES = 4;  // one 128-bit register per vector (SSE2, NEON): wider generic vectors compile poorly
typedef unsigned char vu8 __attribute__((vector_size(LANES), aligned(1)));
typedef signed char vs8 __attribute__((vector_size(LANES), aligned(1)));
}  // namespace dlm_generic_detail
static_assert(dlm_generic_detail::LANES == 4, "DLM_V below must match");

#define DLM_NS dlm_isa_generic
#define DLM_V 4  // = dlm_generic_detail::LANES
#define DLM_ROWS 4
#define DLM_TABLE table_generic
#define DLM_NAME "generic"
#define DLM_WIDEN_U8(p) __builtin_convertvector(*reinterpret_cast<const dlm_generic_detail::vu8*>(p), vi)
#define DLM_WIDEN_S8(p) __builtin_convertvector(*reinterpret_cast<const dlm_generic_detail::vs8*>(p), vi)
#if defined(__aarch64__)
#define DLM_BARRIER(a, b) asm("" : "+w"(a), "+w"(b))  // NEON has FMA: keep GGUF's separate rounding
#else
#define DLM_BARRIER(a, b) do { } while (0)  // the x86-64 baseline has no FMA to contract into
#endif
#include "kernels.inc"
