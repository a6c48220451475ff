/* ops_vexp.h -- an 8-lane f32 exp for the CPU kernels whose scalar libm expf
 * costs more than the rest of their loop: the flash attention rows and the
 * cross-entropy rows (lib/ops_attention.c), SwiGLU forward and backward
 * (lib/ops_moe.c).
 *
 * Range reduction x = n ln2 + r, |r| <= ln2 / 2, with ln2 split in two
 * (Cody and Waite), a degree-6 polynomial for exp(r) (the Cephes expf
 * coefficients), then 2^n through the exponent bits, in two factors so
 * that n = 128 (x just below the overflow threshold) stays finite.
 * Accuracy: within 1 ulp of exp rounded to f32 on [-87.3, 88.72] (case
 * vexp of t/check_ops_pointwise.c checks a window of 2^20 consecutive
 * floats and 2^18 random points); 0 below -87.3 (where
 * expf gives at most 1.2e-38); +inf from 88.7228394 on, as
 * expf; NaN in, NaN out.
 *
 * Written with GNU vector extensions over 8 lanes: AVX2 where the CPU has
 * it (the callers are built in an AVX2 clone, EJ_V8_CLONES), pairs of SSE2
 * ops otherwise, plain scalar code on other targets.  The lanes do not
 * interact, so a result does not depend on where in a row an element sits.
 * The function works in place through a pointer: a 32-byte vector passed
 * by value would change the calling convention between clones. */
#ifndef EPJIT_OPS_VEXP_H
#define EPJIT_OPS_VEXP_H

#include <stdint.h>

typedef float ej_v8f __attribute__((vector_size(32)));
typedef int32_t ej_v8i __attribute__((vector_size(32)));

/* An AVX2 clone and a baseline one of a static function (the loader picks
 * one); an ASan build keeps the baseline only, as the flash rows always
 * have.  No FMA in either clone, so both compute the same bits. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__SANITIZE_ADDRESS__)
#define EJ_V8_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define EJ_V8_CLONES
#endif

/* The smallest float whose expf is +inf (ln FLT_MAX = 88.7228391...). */
#define EJ_VEXP_OVERFLOW 88.72283935546875f
/* Below this the result is flushed to 0 (e^-87.3 = 1.2e-38). */
#define EJ_VEXP_UNDERFLOW -87.3f

/* *v = exp(*v), lane by lane. */
static inline __attribute__((always_inline)) void ej_v8_exp(ej_v8f *v)
{
	const ej_v8f z = { 0 };
	ej_v8f x = *v;
	const ej_v8i dead = x < EJ_VEXP_UNDERFLOW;
	const ej_v8i huge = x >= EJ_VEXP_OVERFLOW;
	/* lanes that give 0 or inf reduce a harmless 0 instead (NaN stays) */
	x = (ej_v8f)((ej_v8i)x & ~(dead | huge));
	/* n = round(x log2 e) through the 1.5 * 2^23 shifter */
	const ej_v8f shifter = z + 12582912.0f;
	ej_v8f t = x * 1.44269504088896341f + shifter;
	ej_v8f n = t - shifter;
	ej_v8i ni = (ej_v8i)t - (ej_v8i)shifter;
	ej_v8f r = x - n * 0.693359375f;
	r = r - n * -2.12194440e-4f;
	ej_v8f p = 1.9875691500e-4f * r + 1.3981999507e-3f;
	p = p * r + 8.3334519073e-3f;
	p = p * r + 4.1665795894e-2f;
	p = p * r + 1.6666665459e-1f;
	p = p * r + 5.0000001201e-1f;
	p = p * r * r + r + 1.0f;
	/* 2^n = 2^h 2^(n - h), h = n / 2: each factor is a normal float for
	 * -126 <= n <= 128, and the first product is exact */
	ej_v8i h = ni >> 1;
	p = p * (ej_v8f)((h + 127) << 23);
	p = p * (ej_v8f)((ni - h + 127) << 23);
	const ej_v8i inf = (ej_v8i){ 0 } + 0x7f800000;
	*v = (ej_v8f)(((ej_v8i)p & ~(dead | huge)) | (inf & huge));
}

#endif
