/* ops_expf.h -- the f32 exp of the CPU's scalar pointwise code, one source in
 * two forms: EJ_EXPF_BODY is the body of `float ej_expf(float x)` as C code
 * (lib/ops_pointwise.c defines the function with it) and EJ_EXPF_TEXT the
 * same tokens as a string (templates/prelude_c.h pastes it into generated
 * C), so the op table's kernels and generated kernels compute the same bits.
 *
 * Why not libm's expf: a call per element keeps GCC from vectorising the
 * loop around it (glibc declares its vector expf only under -ffast-math),
 * and in the SwiGLU of a decoder layer the calls cost more than the rest of
 * the kernel.  This body is plain arithmetic, bit operations and selects,
 * which GCC vectorises at -O3 (generated C) or under `omp simd` (the op
 * table).
 *
 * It is lib/ops_vexp.h's 8-lane exp one lane at a time, operation for
 * operation (Cody-Waite reduction, the Cephes degree-6 polynomial, 2^n in
 * two factors), so it gives that function's bits and accuracy: within 1 ulp
 * of exp rounded to f32 on [-87.3, 88.72]; +0 below -87.3; +inf from
 * 88.7228394 on; NaN in, NaN out (t/check_ops_pointwise.c case vexp checks
 * both forms).  Unsigned arithmetic builds the exponents, so no input
 * (NaN, infinities) overflows a signed integer.  Both compilers build with
 * -std=c11, so GCC contracts no product and sum into an FMA; clang would
 * within an expression, so the function turns contraction off for it (the
 * pragma holds to the end of the compound statement).  C code defines the
 * function with EJ_EXPF_DEFINE(qualifiers), e.g. EJ_EXPF_DEFINE(static
 * inline).
 *
 * The CUDA prelude keeps the device's expf (templates/prelude_cuda.h).
 */
#ifndef EPJIT_EXPF_H
#define EPJIT_EXPF_H

#define EJ_EXPF_STR_(...) #__VA_ARGS__
#define EJ_EXPF_STR(...)  EJ_EXPF_STR_(__VA_ARGS__)

#define EJ_EXPF_BODY                                                           \
	union {                                                                \
		float f;                                                       \
		uint32_t u;                                                    \
	} t_, e_;                                                              \
	const int dead_ = x < -87.3f;                                          \
	const int huge_ = x >= 88.72283935546875f;                             \
	const float y_ = (dead_ | huge_) ? 0.0f : x;                           \
	t_.f = y_ * 1.44269504088896341f + 12582912.0f;                        \
	const float n_ = t_.f - 12582912.0f;                                   \
	const int32_t ni_ = (int32_t)(t_.u - 0x4b400000u);                     \
	float r_ = y_ - n_ * 0.693359375f;                                     \
	r_ = r_ - n_ * -2.12194440e-4f;                                        \
	float p_ = 1.9875691500e-4f * r_ + 1.3981999507e-3f;                   \
	p_ = p_ * r_ + 8.3334519073e-3f;                                       \
	p_ = p_ * r_ + 4.1665795894e-2f;                                       \
	p_ = p_ * r_ + 1.6666665459e-1f;                                       \
	p_ = p_ * r_ + 5.0000001201e-1f;                                       \
	p_ = p_ * r_ * r_ + r_ + 1.0f;                                         \
	const int32_t h_ = ni_ >> 1;                                           \
	e_.u = (uint32_t)(h_ + 127) << 23;                                     \
	p_ = p_ * e_.f;                                                        \
	e_.u = (uint32_t)(ni_ - h_ + 127) << 23;                               \
	p_ = p_ * e_.f;                                                        \
	return huge_ ? __builtin_inff() : dead_ ? 0.0f : p_;

/* clang: no contraction to the end of the enclosing compound statement */
#ifdef __clang__
#define EJ_EXPF_NO_CONTRACT _Pragma("clang fp contract(off)")
#else
#define EJ_EXPF_NO_CONTRACT
#endif

/* `QUAL float ej_expf(float x)`, defined */
#define EJ_EXPF_DEFINE(QUAL)                                                   \
	QUAL float ej_expf(float x)                                            \
	{                                                                      \
		EJ_EXPF_NO_CONTRACT                                            \
		EJ_EXPF_BODY                                                   \
	}

/* the C text of the function; EJ_SF is the prelude's qualifiers */
#define EJ_EXPF_TEXT                                                           \
	"EJ_SF float ej_expf(float x)\n"                                       \
	"{\n"                                                                  \
	"#ifdef __clang__\n"                                                   \
	"#pragma clang fp contract(off)\n"                                     \
	"#endif\n" EJ_EXPF_STR(EJ_EXPF_BODY) "\n}\n"

#endif /* EPJIT_EXPF_H */
