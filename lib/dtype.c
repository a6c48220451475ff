/* dtype.c -- dtype names and sizes, bf16 <-> f32, scalar load/store.
 *
 * bf16 is the upper half of an IEEE f32.  f32 -> bf16 rounds to nearest,
 * ties to even, on the bit pattern: adding 0x7fff plus the lowest kept bit
 * carries into the exponent exactly when IEEE rounding would, so values
 * past the largest bf16 round to Inf and Inf stays Inf.  NaN is handled
 * first (the add could carry a NaN into Inf): it keeps its sign and top
 * payload bits and gets the quiet bit set.
 *
 * ej_store_f64 conventions (documented here, relied on by tensor.c):
 *  - to f32: C conversion (round to nearest even);
 *  - to bf16: double -> f32 (RNE) -> bf16 (RNE); the double rounding can
 *    differ from a direct double -> bf16 rounding in rare ties, as in
 *    PyTorch;
 *  - to i32/i64: truncation toward zero; NaN stores 0; values beyond the
 *    range saturate to the type's min/max (plain C conversion would be
 *    undefined behaviour there).
 */
#include "core_impl.h"
#include "ops_impl.h"

#include <math.h>
#include <string.h>

static const struct {
	const char *name;
	size_t size;
	bool is_float;
} dtype_info[EPJ_DTYPE_COUNT] = {
	[EPJ_DTYPE_F32] = { "f32", 4, true },
	[EPJ_DTYPE_BF16] = { "bf16", 2, true },
	[EPJ_DTYPE_I32] = { "i32", 4, false },
	[EPJ_DTYPE_I64] = { "i64", 8, false },
	[EPJ_DTYPE_F64] = { "f64", 8, true },
};

static bool dtype_valid(epj_dtype dt)
{
	return (int)dt >= 0 && (int)dt < EPJ_DTYPE_COUNT;
}

const char *epj_dtype_name(epj_dtype dt)
{
	return dtype_valid(dt) ? dtype_info[dt].name : "?";
}

size_t epj_dtype_size(epj_dtype dt)
{
	return dtype_valid(dt) ? dtype_info[dt].size : 0;
}

size_t ej_dtype_size(epj_dtype dt)
{
	EJ_ASSERT(dtype_valid(dt));
	return dtype_info[dt].size;
}

bool epj_dtype_is_float(epj_dtype dt)
{
	return dtype_valid(dt) && dtype_info[dt].is_float;
}

uint16_t epj_f32_to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof u);
	if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: quiet, keep sign */
		return (uint16_t)((u >> 16) | 0x0040u);
	uint32_t lsb = (u >> 16) & 1u;
	u += 0x7fffu + lsb;
	return (uint16_t)(u >> 16);
}

float epj_bf16_to_f32(uint16_t b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;
	memcpy(&f, &u, sizeof f);
	return f;
}

double ej_load_f64(const void *p, epj_dtype dt)
{
	switch (dt) {
	case EPJ_DTYPE_F32: {
		float v;
		memcpy(&v, p, sizeof v);
		return v;
	}
	case EPJ_DTYPE_BF16: {
		uint16_t v;
		memcpy(&v, p, sizeof v);
		return epj_bf16_to_f32(v);
	}
	case EPJ_DTYPE_I32: {
		int32_t v;
		memcpy(&v, p, sizeof v);
		return v;
	}
	case EPJ_DTYPE_I64: {
		int64_t v;
		memcpy(&v, p, sizeof v);
		return (double)v;
	}
	case EPJ_DTYPE_F64: {
		double v;
		memcpy(&v, p, sizeof v);
		return v;
	}
	default:
		break;
	}
	EJ_ASSERT(!"ej_load_f64: bad dtype");
	return 0.0;
}

/* Truncating, saturating double -> integer in [lo, hi] (see file comment).
 * The comparisons use doubles that are exact powers of two, so the bounds
 * are exact: hi + 1 is 2^31 or 2^63. */
static int64_t sat_trunc(double v, double lo, double hi_plus_1, int64_t ilo,
			 int64_t ihi)
{
	if (isnan(v))
		return 0;
	if (v <= lo)
		return ilo;
	if (v >= hi_plus_1)
		return ihi;
	return (int64_t)v;
}

void ej_store_f64(void *p, epj_dtype dt, double v)
{
	switch (dt) {
	case EPJ_DTYPE_F32: {
		float f = (float)v;
		memcpy(p, &f, sizeof f);
		return;
	}
	case EPJ_DTYPE_BF16: {
		uint16_t b = epj_f32_to_bf16((float)v);
		memcpy(p, &b, sizeof b);
		return;
	}
	case EPJ_DTYPE_I32: {
		int32_t i = (int32_t)sat_trunc(v, -2147483648.0, 2147483648.0,
					       INT32_MIN, INT32_MAX);
		memcpy(p, &i, sizeof i);
		return;
	}
	case EPJ_DTYPE_I64: {
		int64_t i =
		    sat_trunc(v, -9223372036854775808.0, 9223372036854775808.0,
			      INT64_MIN, INT64_MAX);
		memcpy(p, &i, sizeof i);
		return;
	}
	case EPJ_DTYPE_F64:
		memcpy(p, &v, sizeof v);
		return;
	default:
		break;
	}
	EJ_ASSERT(!"ej_store_f64: bad dtype");
}

EJ_ISA_CLONES void ej_cvt_bf16_to_f32(const uint16_t *restrict s,
				      float *restrict d, int64_t n)
{
#pragma omp simd
	for (int64_t i = 0; i < n; i++)
		d[i] = ej_bf16_load(s[i]);
}

EJ_ISA_CLONES void ej_cvt_f32_to_bf16(const float *restrict s,
				      uint16_t *restrict d, int64_t n)
{
#pragma omp simd
	for (int64_t i = 0; i < n; i++)
		d[i] = ej_bf16_store(s[i]);
}
