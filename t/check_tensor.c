/* check_tensor.c -- dtypes and bf16 rounding, errors and logging, tensor
 * geometry, views, element access, copy_, refcounts, RNG and factories.
 *
 * References are computed here independently of the library: bf16 rounding
 * by comparing distances to the two neighbouring bf16 values in double,
 * strided element positions by explicit index arithmetic.  Non-contiguous
 * views are made with ej_tensor_view directly, so this suite does not depend
 * on the view ops of ops_shape.c.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check_util.h"
#include "core_impl.h"

static float f32_of_bits(uint32_t u)
{
	float f;
	memcpy(&f, &u, sizeof f);
	return f;
}

static uint32_t bits_of_f32(float f)
{
	uint32_t u;
	memcpy(&u, &f, sizeof u);
	return u;
}

/* Value of a non-NaN bf16 pattern as double; the pattern just past the
 * largest finite magnitude (Inf) counts as 2^128, where IEEE rounding puts
 * the overflow threshold. */
static double bf16_value_for_rounding(uint32_t b)
{
	if ((b & 0x7fffu) == 0x7f80u)
		return (b & 0x8000u) ? -0x1p128 : 0x1p128;
	return (double)f32_of_bits(b << 16);
}

/* Reference f32 -> bf16 for non-NaN inputs: pick the nearer of the two bf16
 * patterns bracketing f (truncation and its successor in magnitude), ties to
 * the even pattern. */
static uint16_t ref_bf16(float f)
{
	uint32_t u = bits_of_f32(f);
	uint32_t lo = u >> 16; /* truncation toward zero */
	if ((u & 0xffffu) == 0)
		return (uint16_t)lo;
	if ((lo & 0x7fffu) == 0x7f80u)
		return (uint16_t)lo; /* Inf itself */
	uint32_t hi = lo + 1;	     /* next magnitude up, same sign */
	double x = fabs((double)f);
	double dlo = x - fabs(bf16_value_for_rounding(lo));
	double dhi = fabs(bf16_value_for_rounding(hi)) - x;
	if (dlo < dhi)
		return (uint16_t)lo;
	if (dhi < dlo)
		return (uint16_t)hi;
	return (uint16_t)((lo & 1u) ? hi : lo);
}

/* Fast local bit source for the large bf16 sweeps (tu_randint is checked
 * and slow in a loop); seeded from the run's seed. */
static uint64_t bits_state;
static uint32_t rand_u32(void)
{
	if (!bits_state)
		bits_state = (uint64_t)tu_randint(1, INT64_MAX);
	bits_state ^= bits_state << 13;
	bits_state ^= bits_state >> 7;
	bits_state ^= bits_state << 17;
	return (uint32_t)(bits_state >> 16);
}

/* ---- dtypes ----------------------------------------------------------------
 */

START_TEST(test_dtype_names_sizes)
{
	static const char *names[] = { "f32", "bf16", "i32", "i64", "f64" };
	static const size_t sizes[] = { 4, 2, 4, 8, 8 };
	static const bool isf[] = { true, true, false, false, true };
	for (int d = 0; d < EPJ_DTYPE_COUNT; d++) {
		ck_assert_str_eq(epj_dtype_name((epj_dtype)d), names[d]);
		ck_assert_uint_eq(epj_dtype_size((epj_dtype)d), sizes[d]);
		ck_assert_uint_eq(ej_dtype_size((epj_dtype)d), sizes[d]);
		ck_assert(epj_dtype_is_float((epj_dtype)d) == isf[d]);
	}
	ck_assert_str_eq(epj_status_name(EPJ_ERR_SHAPE), "EPJ_ERR_SHAPE");
	ck_assert_str_eq(epj_status_name(EPJ_OK), "EPJ_OK");
	ck_assert_ptr_nonnull(epj_status_name((epj_status)999));
}
END_TEST

START_TEST(test_bf16_special)
{
	/* exact values, ties to even, just above/below ties */
	ck_assert_uint_eq(epj_f32_to_bf16(1.0f), 0x3f80);
	ck_assert_uint_eq(epj_f32_to_bf16(f32_of_bits(0x3f808000u)), 0x3f80);
	ck_assert_uint_eq(epj_f32_to_bf16(f32_of_bits(0x3f818000u)), 0x3f82);
	ck_assert_uint_eq(epj_f32_to_bf16(f32_of_bits(0x3f808001u)), 0x3f81);
	ck_assert_uint_eq(epj_f32_to_bf16(f32_of_bits(0x3f807fffu)), 0x3f80);
	ck_assert_uint_eq(epj_f32_to_bf16(f32_of_bits(0xbf818000u)), 0xbf82);
	/* subnormals and zeros */
	ck_assert_uint_eq(epj_f32_to_bf16(f32_of_bits(0x00008000u)), 0x0000);
	ck_assert_uint_eq(epj_f32_to_bf16(f32_of_bits(0x00018000u)), 0x0002);
	ck_assert_uint_eq(epj_f32_to_bf16(-0.0f), 0x8000);
	/* Inf and overflow */
	ck_assert_uint_eq(epj_f32_to_bf16(INFINITY), 0x7f80);
	ck_assert_uint_eq(epj_f32_to_bf16(-INFINITY), 0xff80);
	ck_assert_uint_eq(epj_f32_to_bf16(FLT_MAX), 0x7f80);
	ck_assert_uint_eq(epj_f32_to_bf16(-FLT_MAX), 0xff80);
	ck_assert_uint_eq(epj_f32_to_bf16(f32_of_bits(0x7f7f7fffu)), 0x7f7f);
	ck_assert_uint_eq(epj_f32_to_bf16(f32_of_bits(0x7f7f8000u)), 0x7f80);
	ck_assert_uint_eq(epj_f32_to_bf16(f32_of_bits(0x7f7e8000u)), 0x7f7e);
	/* NaN: quiet, sign kept, never Inf */
	const uint32_t nans[] = { 0x7fc00000u, 0x7f800001u, 0xff800001u,
				  0x7fffffffu, 0xffc12345u, 0x7f80ffffu };
	for (size_t i = 0; i < EJ_ARRAY_LEN(nans); i++) {
		uint16_t b = epj_f32_to_bf16(f32_of_bits(nans[i]));
		ck_assert_msg((b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0,
			      "NaN %08x -> %04x not NaN", nans[i], b);
		ck_assert_msg(b & 0x0040u, "NaN %08x -> %04x not quiet",
			      nans[i], b);
		ck_assert_uint_eq(b & 0x8000u, (nans[i] >> 16) & 0x8000u);
		ck_assert(isnan(epj_bf16_to_f32(b)));
	}
}
END_TEST

START_TEST(test_bf16_random_vs_reference)
{
	for (int i = 0; i < 100000; i++) {
		uint32_t u = rand_u32();
		/* a third of the draws sit on or next to a rounding tie */
		if (i % 3 == 1)
			u = (u & 0xffff0000u) |
			    (0x7fffu + (uint32_t)(i % 9) / 3);
		float f = f32_of_bits(u);
		if (isnan(f))
			continue;
		uint16_t got = epj_f32_to_bf16(f), want = ref_bf16(f);
		ck_assert_msg(got == want,
			      "f32 bits %08x: got bf16 %04x want %04x (seed "
			      "%llu)",
			      u, got, want, (unsigned long long)tu_seed());
	}
}
END_TEST

START_TEST(test_bf16_roundtrip_all)
{
	for (uint32_t b = 0; b < 0x10000u; b++) {
		float f = epj_bf16_to_f32((uint16_t)b);
		tu_assert(bits_of_f32(f) == b << 16);
		if (!isnan(f))
			tu_assert(epj_f32_to_bf16(f) == b);
	}
}
END_TEST

START_TEST(test_load_store)
{
	unsigned char buf[8];
	for (int i = 0; i < 1000; i++) {
		double v = tu_uniform(-1e6, 1e6);
		ej_store_f64(buf, EPJ_DTYPE_F64, v);
		tu_assert(ej_load_f64(buf, EPJ_DTYPE_F64) == v);
		ej_store_f64(buf, EPJ_DTYPE_F32, v);
		tu_assert(ej_load_f64(buf, EPJ_DTYPE_F32) == (double)(float)v);
		ej_store_f64(buf, EPJ_DTYPE_BF16, v);
		tu_assert(ej_load_f64(buf, EPJ_DTYPE_BF16) ==
			  (double)epj_bf16_to_f32(ref_bf16((float)v)));
		ej_store_f64(buf, EPJ_DTYPE_I32, v);
		tu_assert(ej_load_f64(buf, EPJ_DTYPE_I32) == trunc(v));
		ej_store_f64(buf, EPJ_DTYPE_I64, v);
		tu_assert(ej_load_f64(buf, EPJ_DTYPE_I64) == trunc(v));
	}
	/* saturation and NaN for integers (documented in dtype.c) */
	ej_store_f64(buf, EPJ_DTYPE_I32, 1e12);
	tu_assert(ej_load_f64(buf, EPJ_DTYPE_I32) == 2147483647.0);
	ej_store_f64(buf, EPJ_DTYPE_I32, -1e12);
	tu_assert(ej_load_f64(buf, EPJ_DTYPE_I32) == -2147483648.0);
	ej_store_f64(buf, EPJ_DTYPE_I32, NAN);
	tu_assert(ej_load_f64(buf, EPJ_DTYPE_I32) == 0.0);
	ej_store_f64(buf, EPJ_DTYPE_I64, -1e30);
	int64_t i64;
	memcpy(&i64, buf, 8);
	tu_assert(i64 == INT64_MIN);
	ej_store_f64(buf, EPJ_DTYPE_I64, -2.75);
	memcpy(&i64, buf, 8);
	tu_assert(i64 == -2);
}
END_TEST

/* ---- errors and logging
 * --------------------------------------------------------
 */

/* An empty shape whose other dimensions multiply past int64: its
 * contiguous strides cannot be represented, so it is refused with the
 * range; it used to overflow computing them. */
START_TEST(test_empty_huge_shape)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sh[3] = { 0, (int64_t)1 << 62, (int64_t)1 << 62 };
	for (int p = 0; p < 3; p++) {
		int64_t s[3] = { sh[(p + 0) % 3], sh[(p + 1) % 3],
				 sh[(p + 2) % 3] };
		epj_tensor *t = epj_zeros(ctx, EPJ_DTYPE_F32, 3, s);
		ck_assert_ptr_null(t);
		ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_SHAPE);
		ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx),
					     "non-zero dimensions must be at "
					     "most 1152921504606846975"));
	}
	/* an empty tensor with moderate dimensions is fine */
	int64_t ok[3] = { 0, 1 << 20, (int64_t)tu_randint(1, 1 << 20) };
	epj_tensor *t = epj_zeros(ctx, EPJ_DTYPE_F32, 3, ok);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(epj_tensor_numel(t), 0);
	epj_tensor_free(t);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_errors)
{
	epj_ctx *ctx = tu_ctx();
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_OK);
	ck_assert_str_eq(epj_ctx_error(ctx), "");
	ck_assert_int_eq(ej_error(ctx, EPJ_ERR_INDEX, "idx %d of %s", 7, "foo"),
			 EPJ_ERR_INDEX);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_INDEX);
	ck_assert_str_eq(epj_ctx_error(ctx), "idx 7 of foo");
	ej_error_prefix(ctx, "layer %d", 3);
	ck_assert_str_eq(epj_ctx_error(ctx), "layer 3: idx 7 of foo");
	/* re-raising the current message through %s is safe */
	ej_error(ctx, EPJ_ERR_STATE, "again: %s", epj_ctx_error(ctx));
	ck_assert_str_eq(epj_ctx_error(ctx), "again: layer 3: idx 7 of foo");
	/* long messages are truncated, never overflowed */
	char big[3000];
	memset(big, 'x', sizeof big - 1);
	big[sizeof big - 1] = '\0';
	ej_error(ctx, EPJ_ERR_IO, "%s", big);
	ck_assert_uint_eq(strlen(epj_ctx_error(ctx)), sizeof ctx->errmsg - 1);
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_OK);
	ck_assert_str_eq(epj_ctx_error(ctx), "");

	char buf[64];
	const int64_t sh[] = { 2, 3, 4 };
	ck_assert_str_eq(ej_shape_str(3, sh, buf, sizeof buf), "[2,3,4]");
	ck_assert_str_eq(ej_shape_str(0, sh, buf, sizeof buf), "[]");
	ck_assert_str_eq(ej_shape_str(3, sh, buf, 4), "[2,");
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_log_level)
{
	epj_log_level prev = epj_log_level_get();
	ck_assert(prev >= EPJ_LOG_ERROR && prev <= EPJ_LOG_TRACE);
	epj_log_level_set(EPJ_LOG_TRACE);
	ck_assert_int_eq(epj_log_level_get(), EPJ_LOG_TRACE);
	epj_log_level_set(EPJ_LOG_ERROR);
	ck_assert_int_eq(epj_log_level_get(), EPJ_LOG_ERROR);
	epj_log_msg(EPJ_LOG_INFO, "not shown %d", 1); /* filtered out */
	epj_log_level_set(prev);
}
END_TEST

/* ---- geometry and views
 * ---------------------------------------------------------
 */

START_TEST(test_alloc_geometry)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t sh[] = { 3, 5, 7 };
	epj_tensor *t = ej_tensor_alloc(ctx, EPJ_DTYPE_BF16, 3, sh, true);
	tu_ok(ctx, t);
	ck_assert_int_eq(epj_tensor_ndim(t), 3);
	ck_assert_int_eq(epj_tensor_numel(t), 105);
	ck_assert_int_eq(epj_tensor_dim(t, -1), 7);
	ck_assert_int_eq(epj_tensor_dim(t, 0), 3);
	ck_assert_int_eq(epj_tensor_strides(t)[0], 35);
	ck_assert_int_eq(epj_tensor_strides(t)[2], 1);
	ck_assert(epj_tensor_is_contiguous(t));
	ck_assert(epj_tensor_is_leaf(t));
	ck_assert_int_eq(t->value_id, -1);
	ck_assert_ptr_eq(t->ctx, ctx);
	ck_assert_int_eq(epj_tensor_dim(t, 3), -1);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_INDEX);
	epj_ctx_clear_error(ctx);
	char buf[64];
	ck_assert_str_eq(epj_tensor_describe(t, buf, sizeof buf),
			 "bf16[3,5,7]");
	for (int64_t i = 0; i < 105; i++)
		ck_assert(epj_tensor_get_f64(t, i) == 0.0);

	epj_tensor *s = ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 0, NULL, true);
	tu_ok(ctx, s);
	ck_assert_int_eq(epj_tensor_numel(s), 1);
	ck_assert_str_eq(epj_tensor_describe(s, buf, sizeof buf), "f32[]");
	epj_tensor_set_f64(s, 0, 2.5);
	ck_assert(epj_tensor_get_f64(s, 0) == 2.5);

	const int64_t z[] = { 4, 0, 3 };
	epj_tensor *e = ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 3, z, false);
	tu_ok(ctx, e);
	ck_assert_int_eq(epj_tensor_numel(e), 0);
	ck_assert(epj_tensor_is_contiguous(e));

	/* bad shapes */
	const int64_t nine[9] = { 1, 1, 1, 1, 1, 1, 1, 1, 1 };
	ck_assert_ptr_null(ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 9, nine, true));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_SHAPE);
	const int64_t neg[] = { 2, -1 };
	ck_assert_ptr_null(ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 2, neg, true));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_SHAPE);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "[2,-1]"));
	ck_assert_ptr_null(ej_tensor_meta(ctx, EPJ_DTYPE_F32, 2, neg));
	const int64_t huge[] = { (int64_t)1 << 40, (int64_t)1 << 40 };
	ck_assert_ptr_null(ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 2, huge, true));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_SHAPE);

	epj_tensor *m = ej_tensor_meta(ctx, EPJ_DTYPE_I64, 3, sh);
	tu_ok(ctx, m);
	ck_assert_ptr_null(m->storage);
	ck_assert_ptr_null(epj_tensor_data(m));
	ck_assert_int_eq(m->value_id, -1);
	ck_assert_int_eq(m->stride[1], 7);
	epj_ctx_clear_error(ctx);
	ck_assert(isnan(epj_tensor_get_f64(m, 0)));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_STATE);
	double tmp[105];
	ck_assert_int_eq(epj_tensor_to_f64(ctx, m, tmp), EPJ_ERR_STATE);

	epj_tensor_free(m);
	epj_tensor_free(e);
	epj_tensor_free(s);
	epj_tensor_free(t);
	epj_tensor_free(NULL);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_contiguity_rules)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t sh[] = { 4, 6 };
	epj_tensor *t = ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 2, sh, false);
	tu_ok(ctx, t);
	/* size-1 dims' strides do not matter */
	const int64_t s1[] = { 1, 6 }, st1[] = { 999, 1 };
	epj_tensor *v1 = ej_tensor_view(t, 2, s1, st1, 6);
	ck_assert(ej_is_contiguous(v1));
	/* transposed: not contiguous */
	const int64_t s2[] = { 6, 4 }, st2[] = { 1, 6 };
	epj_tensor *v2 = ej_tensor_view(t, 2, s2, st2, 0);
	ck_assert(!ej_is_contiguous(v2));
	/* every other column: not contiguous */
	const int64_t s3[] = { 4, 3 }, st3[] = { 6, 2 };
	epj_tensor *v3 = ej_tensor_view(t, 2, s3, st3, 1);
	ck_assert(!ej_is_contiguous(v3));
	ck_assert_int_eq(ej_axis(-1, 3), 2);
	ck_assert_int_eq(ej_axis(-3, 3), 0);
	ck_assert_int_eq(ej_axis(-4, 3), -1);
	ck_assert_int_eq(ej_axis(3, 3), -1);
	ck_assert_int_eq(ej_axis(-1, 0), -1);
	int64_t cs[3];
	const int64_t sh3[] = { 2, 1, 5 };
	ej_contiguous_strides(3, sh3, cs);
	ck_assert(cs[0] == 5 && cs[1] == 5 && cs[2] == 1);
	ck_assert_int_eq(ej_numel(0, NULL), 1);
	epj_tensor_free(v1);
	epj_tensor_free(v2);
	epj_tensor_free(v3);
	epj_tensor_free(t);
	epj_ctx_free(ctx);
}
END_TEST

/* A view writes into the base and the base into the view. */
START_TEST(test_views_share_storage)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t R = 5, C = 7, sh[] = { 5, 7 };
	epj_tensor *t = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	const int64_t tsh[] = { C, R }, tst[] = { 1, C };
	epj_tensor *tv = ej_tensor_view(t, 2, tsh, tst, 0); /* transpose */
	tu_ok(ctx, tv);
	ck_assert(epj_tensor_shares_storage(t, tv));
	ck_assert_int_eq(epj_tensor_dtype(tv), EPJ_DTYPE_F32);
	ck_assert(!epj_tensor_requires_grad(tv));
	for (int k = 0; k < 20; k++) {
		int64_t i = tu_randint(0, C), j = tu_randint(0, R);
		double v = tu_uniform(-3, 3);
		epj_tensor_set_f64(tv, i * R + j, v);
		ck_assert(epj_tensor_get_f64(t, j * C + i) == (double)(float)v);
		float *p = epj_tensor_data(t);
		p[j * C + i] = (float)(v + 1);
		ck_assert(epj_tensor_get_f64(tv, i * R + j) ==
			  (double)(float)(v + 1));
	}
	/* a row slice with an offset */
	const int64_t rsh[] = { C }, rst[] = { 1 };
	epj_tensor *row = ej_tensor_view(t, 1, rsh, rst, 3 * C);
	ck_assert_ptr_eq(epj_tensor_data(row),
			 (float *)epj_tensor_data(t) + 3 * C);
	ck_assert_int_eq(epj_tensor_offset(row), 3 * C);
	epj_tensor_set_f64(row, 4, 42.0);
	ck_assert(epj_tensor_get_f64(t, 3 * C + 4) == 42.0);

	epj_tensor *other = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	ck_assert(!epj_tensor_shares_storage(t, other));
	epj_tensor_free(other);
	epj_tensor_free(row);
	epj_tensor_free(tv);
	epj_tensor_free(t);
	epj_ctx_free(ctx);
}
END_TEST

/* to_f64 / from_f64 / get / set through a strided, offset view, for every
 * dtype, against explicit index arithmetic on the base buffer. */
START_TEST(test_strided_f64_access)
{
	epj_ctx *ctx = tu_ctx();
	for (int d = 0; d < EPJ_DTYPE_COUNT; d++) {
		epj_dtype dt = (epj_dtype)d;
		const int64_t R = 13, C = 6, bsh[] = { 13, 6 };
		epj_tensor *base = ej_tensor_alloc(ctx, dt, 2, bsh, false);
		tu_ok(ctx, base);
		double bv[13 * 6];
		for (int i = 0; i < R * C; i++)
			bv[i] = epj_dtype_is_float(dt)
				    ? tu_uniform(-4, 4)
				    : (double)tu_randint(-50, 50);
		ck_assert_int_eq(epj_tensor_from_f64(ctx, base, bv), EPJ_OK);
		double br[13 * 6];
		ck_assert_int_eq(epj_tensor_to_f64(ctx, base, br), EPJ_OK);
		for (int i = 0; i < R * C; i++) {
			double want = bv[i];
			if (dt == EPJ_DTYPE_F32)
				want = (float)want;
			else if (dt == EPJ_DTYPE_BF16)
				want = epj_bf16_to_f32(ref_bf16((float)want));
			tu_assert(br[i] == want);
		}
		/* view [3, 13]: columns 1, 3, 5, transposed */
		const int64_t vsh[] = { 3, 13 }, vst[] = { 2, 6 };
		epj_tensor *v = ej_tensor_view(base, 2, vsh, vst, 1);
		double got[39];
		ck_assert_int_eq(epj_tensor_to_f64(ctx, v, got), EPJ_OK);
		for (int a = 0; a < 3; a++)
			for (int b = 0; b < 13; b++) {
				tu_assert(got[a * 13 + b] ==
					  br[b * 6 + 1 + 2 * a]);
				tu_assert(epj_tensor_get_f64(v, a * 13 + b) ==
					  br[b * 6 + 1 + 2 * a]);
			}
		/* write through the view: only its elements change */
		double in[39];
		for (int i = 0; i < 39; i++)
			in[i] = (double)tu_randint(-100, 100);
		ck_assert_int_eq(epj_tensor_from_f64(ctx, v, in), EPJ_OK);
		double after[13 * 6];
		ck_assert_int_eq(epj_tensor_to_f64(ctx, base, after), EPJ_OK);
		for (int r = 0; r < R; r++)
			for (int c = 0; c < C; c++) {
				double want = (c % 2 == 1)
						  ? in[(c / 2) * 13 + r]
						  : br[r * 6 + c];
				ck_assert_msg(after[r * 6 + c] == want,
					      "%s [%d,%d]: %g want %g",
					      epj_dtype_name(dt), r, c,
					      after[r * 6 + c], want);
			}
		/* out of range */
		epj_ctx_clear_error(ctx);
		tu_assert(isnan(epj_tensor_get_f64(v, 39)));
		ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_INDEX);
		tu_assert(isnan(epj_tensor_get_f64(v, -1)));
		epj_tensor_set_f64(v, 39, 1.0);
		ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_INDEX);
		epj_ctx_clear_error(ctx);
		epj_tensor_free(v);
		epj_tensor_free(base);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* Random geometry: a random permutation and step of a random 3-d buffer. */
START_TEST(test_copy_conversion)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t sh[] = { 3, 5, 7 };
	for (int sd = 0; sd < EPJ_DTYPE_COUNT; sd++)
		for (int dd = 0; dd < EPJ_DTYPE_COUNT; dd++) {
			epj_dtype sdt = (epj_dtype)sd, ddt = (epj_dtype)dd;
			/* src: a [7,5,3] buffer viewed as [3,5,7] (reversed) */
			const int64_t bsh[] = { 7, 5, 3 };
			epj_tensor *buf =
			    ej_tensor_alloc(ctx, sdt, 3, bsh, false);
			tu_ok(ctx, buf);
			double vals[105];
			for (int i = 0; i < 105; i++)
				vals[i] = epj_dtype_is_float(sdt)
					      ? tu_uniform(-100, 100)
					      : (double)tu_randint(-1000, 1000);
			ck_assert_int_eq(epj_tensor_from_f64(ctx, buf, vals),
					 EPJ_OK);
			ck_assert_int_eq(epj_tensor_to_f64(ctx, buf, vals),
					 EPJ_OK); /* values as stored */
			const int64_t sst[] = { 1, 3, 15 };
			epj_tensor *src = ej_tensor_view(buf, 3, sh, sst, 0);
			/* dst: contiguous, or every second element */
			bool strided = (sd + dd) % 2;
			epj_tensor *dst;
			epj_tensor *dbuf = NULL;
			if (strided) {
				const int64_t dbsh[] = { 3, 5, 14 };
				dbuf = ej_tensor_alloc(ctx, ddt, 3, dbsh, true);
				const int64_t dst_st[] = { 70, 14, 2 };
				dst = ej_tensor_view(dbuf, 3, sh, dst_st, 1);
			} else {
				dst = ej_tensor_alloc(ctx, ddt, 3, sh, false);
			}
			tu_ok(ctx, dst);
			ck_assert_int_eq(epj_tensor_copy_(ctx, dst, src),
					 EPJ_OK);
			for (int i = 0; i < 3; i++)
				for (int j = 0; j < 5; j++)
					for (int k = 0; k < 7; k++) {
						double x =
						    vals[k * 15 + j * 3 + i];
						double want;
						if (ddt == EPJ_DTYPE_F32)
							want = (float)x;
						else if (ddt == EPJ_DTYPE_BF16)
							want = epj_bf16_to_f32(
							    ref_bf16((float)x));
						else if (ddt == EPJ_DTYPE_F64)
							want = x;
						else
							want = trunc(x);
						double got = epj_tensor_get_f64(
						    dst, (i * 5 + j) * 7 + k);
						ck_assert_msg(
						    got == want,
						    "copy %s->%s [%d,%d,%d]: "
						    "%g "
						    "want %g",
						    epj_dtype_name(sdt),
						    epj_dtype_name(ddt), i, j,
						    k, got, want);
					}
			if (dbuf) /* the gaps stay untouched (zero) */
				for (int64_t i = 0; i < 210; i += 2)
					tu_assert(epj_tensor_get_f64(dbuf, i) ==
						  0);
			epj_tensor_free(dbuf);
			epj_tensor_free(dst);
			epj_tensor_free(src);
			epj_tensor_free(buf);
		}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_copy_errors_and_exact_ints)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t a[] = { 3, 5 }, b[] = { 5, 3 };
	epj_tensor *x = ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 2, a, true);
	epj_tensor *y = ej_tensor_alloc(ctx, EPJ_DTYPE_BF16, 2, b, true);
	ck_assert_int_eq(epj_tensor_copy_(ctx, x, y), EPJ_ERR_SHAPE);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_ptr_nonnull(strstr(msg, "copy_"));
	ck_assert_ptr_nonnull(strstr(msg, "f32[3,5]"));
	ck_assert_ptr_nonnull(strstr(msg, "bf16[5,3]"));
	/* writing into an expanded (stride 0) view is refused */
	const int64_t est[] = { 0, 1 }, esh[] = { 5, 3 };
	epj_tensor *row = ej_tensor_view(x, 2, esh, est, 0);
	ck_assert_int_eq(epj_tensor_copy_(ctx, row, y), EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "copy_"));
	/* but reading from one is fine: broadcast a row */
	double rv[3] = { 1.5, -2.0, 7.25 };
	const int64_t r3[] = { 3 };
	epj_tensor *r = epj_tensor_from_data(ctx, EPJ_DTYPE_F64, 1, r3, rv);
	const int64_t bst[] = { 0, 1 };
	epj_tensor *rb = ej_tensor_view(r, 2, esh, bst, 0);
	ck_assert_int_eq(epj_tensor_copy_(ctx, y, rb), EPJ_OK);
	for (int i = 0; i < 15; i++)
		ck_assert(epj_tensor_get_f64(y, i) == rv[i % 3]);
	/* symbolic tensors have no data */
	epj_tensor *m = ej_tensor_meta(ctx, EPJ_DTYPE_F32, 2, a);
	ck_assert_int_eq(epj_tensor_copy_(ctx, m, x), EPJ_ERR_STATE);
	ck_assert_int_eq(epj_tensor_copy_(ctx, x, m), EPJ_ERR_STATE);
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(epj_tensor_copy_(ctx, x, NULL), EPJ_ERR_INVALID);

	/* i64 values beyond 2^53 survive i64 -> i64 strided copies exactly */
	const int64_t n7[] = { 7 }, n14[] = { 14 }, two[] = { 2 };
	int64_t big[14];
	for (int i = 0; i < 14; i++)
		big[i] = ((int64_t)1 << 60) + 2 * i + 1;
	epj_tensor *bi = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 1, n14, big);
	epj_tensor *bv = ej_tensor_view(bi, 1, n7, two, 1);
	epj_tensor *bo = ej_tensor_alloc(ctx, EPJ_DTYPE_I64, 1, n7, false);
	ck_assert_int_eq(epj_tensor_copy_(ctx, bo, bv), EPJ_OK);
	const int64_t *bd = epj_tensor_data(bo);
	for (int i = 0; i < 7; i++)
		ck_assert(bd[i] == big[2 * i + 1]);
	/* i32 -> i64 via the strided path is exact */
	int32_t small[14];
	for (int i = 0; i < 14; i++)
		small[i] = (int32_t)tu_randint(INT32_MIN, INT32_MAX);
	epj_tensor *si =
	    epj_tensor_from_data(ctx, EPJ_DTYPE_I32, 1, n14, small);
	epj_tensor *sv = ej_tensor_view(si, 1, n7, two, 0);
	ck_assert_int_eq(epj_tensor_copy_(ctx, bo, sv), EPJ_OK);
	for (int i = 0; i < 7; i++)
		ck_assert(bd[i] == small[2 * i]);

	epj_tensor_free(si);
	epj_tensor_free(sv);
	epj_tensor_free(bo);
	epj_tensor_free(bv);
	epj_tensor_free(bi);
	epj_tensor_free(m);
	epj_tensor_free(rb);
	epj_tensor_free(r);
	epj_tensor_free(row);
	epj_tensor_free(x);
	epj_tensor_free(y);
	epj_ctx_free(ctx);
}
END_TEST

/* Overlapping views of one storage: copy_ behaves as if src were read
 * first (memmove semantics), contiguous or strided. */
START_TEST(test_copy_overlap)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t n[] = { 21 }, one[] = { 1 }, two[] = { 2 };
	double orig[21];
	for (int i = 0; i < 21; i++)
		orig[i] = (double)tu_randint(-1000, 1000);
	for (int variant = 0; variant < 4; variant++) {
		epj_tensor *b =
		    ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 1, n, false);
		ck_assert_int_eq(epj_tensor_from_f64(ctx, b, orig), EPJ_OK);
		int64_t len = variant < 2 ? 15 : 8;
		const int64_t *st = variant < 2 ? one : two;
		/* shift 5 (contiguous) or 4 (stride 2: the same elements
		 * parity, so a forward element loop would read its own
		 * writes) */
		int64_t sh = variant < 2 ? 5 : 4;
		int64_t doff = variant % 2 ? sh : 0,
			soff = variant % 2 ? 0 : sh;
		const int64_t l[] = { len };
		epj_tensor *d = ej_tensor_view(b, 1, l, st, doff);
		epj_tensor *s = ej_tensor_view(b, 1, l, st, soff);
		ck_assert_int_eq(epj_tensor_copy_(ctx, d, s), EPJ_OK);
		double want[21];
		memcpy(want, orig, sizeof want);
		for (int64_t i = 0; i < len; i++)
			want[doff + i * st[0]] = orig[soff + i * st[0]];
		double got[21];
		ck_assert_int_eq(epj_tensor_to_f64(ctx, b, got), EPJ_OK);
		for (int i = 0; i < 21; i++)
			ck_assert_msg(got[i] == want[i],
				      "variant %d [%d]: %g want %g", variant, i,
				      got[i], want[i]);
		epj_tensor_free(d);
		epj_tensor_free(s);
		epj_tensor_free(b);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* A device that is not host-visible (memory is really host memory here):
 * element access and copies must go through dev->copy. */
static int fake_copies;
static void fake_copy(void *self, void *dst, const void *src, size_t n)
{
	(void)self;
	fake_copies++;
	memcpy(dst, src, n);
}

START_TEST(test_not_host_visible)
{
	epj_ctx *ctx = tu_ctx();
	ej_device fake = ej_device_cpu;
	fake.host_visible = false;
	fake.copy = fake_copy;
	fake.memzero = NULL; /* exercises the zero-page fallback */
	const ej_device *saved = ctx->dev;
	ctx->dev = &fake;

	const int64_t sh[] = { 6, 5 };
	epj_tensor *t = ej_tensor_alloc(ctx, EPJ_DTYPE_F32, 2, sh, true);
	tu_ok(ctx, t);
	ck_assert_int_gt(fake_copies, 0);
	ck_assert_ptr_null(epj_tensor_data(t));
	double v[30];
	for (int i = 0; i < 30; i++)
		v[i] = tu_uniform(-1, 1);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, t, v), EPJ_OK);
	const int64_t tsh[] = { 5, 3 }, tst[] = { 1, 10 };
	epj_tensor *tv = ej_tensor_view(t, 2, tsh, tst, 1); /* strided */
	double got[15];
	ck_assert_int_eq(epj_tensor_to_f64(ctx, tv, got), EPJ_OK);
	for (int i = 0; i < 5; i++)
		for (int j = 0; j < 3; j++)
			ck_assert(got[i * 3 + j] == (float)v[1 + i + 10 * j]);
	epj_tensor_set_f64(tv, 4, 9.0); /* [1,1] -> base flat 1 + 1 + 10 */
	ck_assert(epj_tensor_get_f64(t, 12) == 9.0);
	epj_tensor *d = ej_tensor_alloc(ctx, EPJ_DTYPE_F64, 2, tsh, false);
	ck_assert_int_eq(epj_tensor_copy_(ctx, d, tv), EPJ_OK);
	ck_assert(epj_tensor_get_f64(d, 4) == 9.0);
	ck_assert(epj_tensor_get_f64(d, 14) == (float)v[1 + 4 + 20]);
	epj_tensor *r = epj_randn(ctx, EPJ_DTYPE_BF16, 2, sh, 0, 1);
	tu_ok(ctx, r);
	epj_tensor_free(r);
	epj_tensor_free(d);
	epj_tensor_free(tv);
	epj_tensor_free(t);
	ctx->dev = saved;
	epj_ctx_free(ctx);
}
END_TEST

/* ---- refcounts and autograd fields
 * ---------------------------------------------
 */

START_TEST(test_refcount_lifetime)
{
	epj_ctx *ctx = tu_ctx();
	epj_memory_stats ms0, ms;
	epj_memory_stats_get(ctx, &ms0);
	const int64_t sh[] = { 7, 3 };
	epj_tensor *t = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	ck_assert_int_eq(t->refcount, 1);
	ck_assert_ptr_eq(epj_tensor_ref(t), t);
	ck_assert_int_eq(t->refcount, 2);
	epj_tensor_free(t);
	ck_assert_int_eq(t->refcount, 1);

	double v[21];
	ck_assert_int_eq(epj_tensor_to_f64(ctx, t, v), EPJ_OK);
	const int64_t csh[] = { 7 }, cst[] = { 3 };
	epj_tensor *col = ej_tensor_view(t, 1, csh, cst, 2);
	ck_assert_int_eq(t->storage->refcount, 2);
	epj_tensor *det = epj_detach(ctx, t);
	ck_assert(epj_tensor_shares_storage(det, t));
	ck_assert_int_eq(t->storage->refcount, 3);
	epj_tensor_free(t); /* views keep the storage alive */
	epj_tensor_free(det);
	epj_memory_stats_get(ctx, &ms);
	ck_assert_uint_gt(ms.allocated, ms0.allocated);
	for (int i = 0; i < 7; i++)
		ck_assert(epj_tensor_get_f64(col, i) == v[i * 3 + 2]);
	epj_tensor_free(col); /* last reference: storage returned */
	epj_memory_stats_get(ctx, &ms);
	ck_assert_uint_eq(ms.allocated, ms0.allocated);
	ck_assert_uint_eq(ms.num_frees, ms0.num_frees + 1);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_grad_fields)
{
	epj_ctx *ctx = tu_ctx();
	epj_log_level lvl = epj_log_level_get();
	epj_log_level_set(EPJ_LOG_ERROR); /* expected warnings below */
	const int64_t sh[] = { 3, 5 };
	epj_tensor *p = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	ck_assert(!epj_tensor_requires_grad(p));
	epj_tensor_set_requires_grad(p, true);
	ck_assert(epj_tensor_requires_grad(p));
	ck_assert(epj_tensor_is_leaf(p));
	ck_assert_ptr_null(epj_tensor_grad(p));

	epj_tensor *ids = epj_randint(ctx, EPJ_DTYPE_I64, 2, sh, 0, 9);
	epj_tensor_set_requires_grad(ids, true); /* ignored: not float */
	ck_assert(!epj_tensor_requires_grad(ids));

	epj_tensor *g = tu_randn(ctx, EPJ_DTYPE_F32, 2, sh);
	epj_tensor_set_grad(p, g);
	ck_assert_ptr_eq(epj_tensor_grad(p), g);
	ck_assert_int_eq(g->refcount, 2);
	epj_tensor_set_grad(p, g); /* same gradient again: no double free */
	ck_assert_int_eq(g->refcount, 2);
	epj_tensor *wrong =
	    tu_randn(ctx, EPJ_DTYPE_F32, 2, (int64_t[]){ 5, 3 });
	epj_tensor_set_grad(p, wrong);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_SHAPE);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "set_grad"));
	ck_assert_ptr_eq(epj_tensor_grad(p), g);
	epj_tensor_zero_grad(p); /* set_to_none semantics */
	ck_assert_ptr_null(epj_tensor_grad(p));
	ck_assert_int_eq(g->refcount, 1);
	epj_tensor_set_grad(p, g);
	epj_tensor_set_grad(p, NULL);
	ck_assert_ptr_null(epj_tensor_grad(p));

	epj_tensor *d = epj_detach(ctx, p);
	ck_assert(!epj_tensor_requires_grad(d));
	ck_assert(epj_tensor_is_leaf(d));
	epj_tensor_set_f64(d, 0, 123.0);
	ck_assert(epj_tensor_get_f64(p, 0) == 123.0);

	/* symbolic tensor: detach keeps the IR value */
	epj_tensor *m = ej_tensor_meta(ctx, EPJ_DTYPE_BF16, 2, sh);
	m->value_id = 17;
	m->trace_owner = m;
	m->requires_grad = true;
	epj_tensor *md = epj_detach(ctx, m);
	ck_assert_int_eq(md->value_id, 17);
	ck_assert_ptr_eq(md->trace_owner, m);
	ck_assert(!md->requires_grad);
	ck_assert_ptr_null(md->storage);
	ck_assert_ptr_null(epj_detach(ctx, NULL));

	epj_tensor_set_grad(p, g); /* freed with p */
	epj_tensor_free(md);
	epj_tensor_free(m);
	epj_tensor_free(d);
	epj_tensor_free(wrong);
	epj_tensor_free(g);
	epj_tensor_free(ids);
	epj_tensor_free(p);
	epj_log_level_set(lvl);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_from_data)
{
	epj_ctx *ctx = tu_ctx();
	const int64_t sh[] = { 3, 7 };
	float src[21];
	for (int i = 0; i < 21; i++)
		src[i] = (float)tu_uniform(-9, 9);
	epj_tensor *t = epj_tensor_from_data(ctx, EPJ_DTYPE_F32, 2, sh, src);
	tu_ok(ctx, t);
	float keep = src[0];
	src[0] = 1000.0f; /* a copy, not a borrow */
	for (int i = 0; i < 21; i++)
		ck_assert(epj_tensor_get_f64(t, i) == (i ? src[i] : keep));
	ck_assert_ptr_null(
	    epj_tensor_from_data(ctx, EPJ_DTYPE_F32, 2, sh, NULL));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_INVALID);
	epj_tensor_free(t);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- RNG
 * -------------------------------------------------------------------------
 */

START_TEST(test_rng_determinism)
{
	uint64_t seed = tu_seed() ^ (uint64_t)tu_randint(0, 1 << 30);
	ej_rng a, b, c;
	ej_rng_seed(&a, seed);
	ej_rng_seed(&b, seed);
	ej_rng_seed(&c, seed + 1);
	int same_c = 0;
	for (int i = 0; i < 1000; i++) {
		uint64_t x = ej_rng_next(&a), y = ej_rng_next(&b);
		tu_assert(x == y);
		same_c += ej_rng_next(&c) == x;
	}
	ck_assert_int_lt(same_c, 2);

	/* factories: same seed, same tensors, in row-major order */
	epj_ctx *c1 = tu_ctx(), *c2 = tu_ctx();
	epj_ctx_seed(c1, seed);
	epj_ctx_seed(c2, seed);
	const int64_t sh[] = { 13, 7 };
	epj_tensor *x1 = epj_randn(c1, EPJ_DTYPE_F32, 2, sh, 1.0, 2.0);
	epj_tensor *x2 = epj_randn(c2, EPJ_DTYPE_F32, 2, sh, 1.0, 2.0);
	tu_ok(c1, x1);
	tu_ok(c2, x2);
	ej_rng r;
	ej_rng_seed(&r, seed);
	for (int64_t i = 0; i < 91; i++) {
		double want = (float)(1.0 + 2.0 * ej_rng_normal(&r));
		tu_assert(epj_tensor_get_f64(x1, i) == want);
		tu_assert(epj_tensor_get_f64(x2, i) == want);
	}
	epj_tensor *u = epj_rand_uniform(c1, EPJ_DTYPE_F64, 2, sh, -3.0, 5.0);
	epj_tensor *k = epj_randint(c1, EPJ_DTYPE_I32, 2, sh, -4, 3);
	tu_ok(c1, u);
	tu_ok(c1, k);
	int hits[7] = { 0 };
	for (int64_t i = 0; i < 91; i++) {
		double uv = epj_tensor_get_f64(u, i);
		tu_assert(uv >= -3.0 && uv < 5.0);
		double kv = epj_tensor_get_f64(k, i);
		tu_assert(kv >= -4 && kv < 3 && kv == trunc(kv));
		hits[(int)kv + 4]++;
	}
	for (int i = 0; i < 7; i++)
		ck_assert_int_gt(hits[i], 0); /* P(miss) ~ 7 * (6/7)^91 */
	/* i64 extremes */
	epj_tensor *kb =
	    epj_randint(c1, EPJ_DTYPE_I64, 2, sh, INT64_MIN, INT64_MAX);
	tu_ok(c1, kb);
	/* bad arguments */
	ck_assert_ptr_null(epj_randn(c1, EPJ_DTYPE_I32, 2, sh, 0, 1));
	ck_assert_int_eq(epj_ctx_status(c1), EPJ_ERR_DTYPE);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(c1), "randn"));
	ck_assert_ptr_null(epj_randint(c1, EPJ_DTYPE_I32, 2, sh, 3, 3));
	ck_assert_int_eq(epj_ctx_status(c1), EPJ_ERR_INVALID);
	epj_tensor_free(kb);
	epj_tensor_free(k);
	epj_tensor_free(u);
	epj_tensor_free(x1);
	epj_tensor_free(x2);
	epj_ctx_free(c1);
	epj_ctx_free(c2);
}
END_TEST

START_TEST(test_rng_moments)
{
	ej_rng r;
	ej_rng_seed(&r, tu_seed());
	const int N = 100000;
	double s = 0, s2 = 0, us = 0, s4 = 0;
	int tail = 0;
	for (int i = 0; i < N; i++) {
		double z = ej_rng_normal(&r);
		tu_assert(isfinite(z));
		s += z;
		s2 += z * z;
		s4 += z * z * z * z;
		tail += fabs(z) > 1.959964;
		double u = ej_rng_uniform(&r);
		tu_assert(u >= 0.0 && u < 1.0);
		us += u;
	}
	double mean = s / N, var = s2 / N - mean * mean;
	/* standard errors: mean 1/sqrt(N) = 0.0032, var ~ 0.0045; 6 sigma */
	ck_assert_msg(fabs(mean) < 0.02, "normal mean %g", mean);
	ck_assert_msg(fabs(sqrt(var) - 1) < 0.02, "normal std %g", sqrt(var));
	ck_assert_msg(fabs(s4 / N - 3) < 0.2, "normal kurtosis %g", s4 / N);
	ck_assert_msg(fabs((double)tail / N - 0.05) < 0.005, "tail %g",
		      (double)tail / N);
	ck_assert_msg(fabs(us / N - 0.5) < 0.006, "uniform mean %g", us / N);
}
END_TEST

Suite *make_tensor_suite(void)
{
	Suite *s = suite_create("tensor");
	TCase *tc = tcase_create("dtype");
	tcase_add_test(tc, test_dtype_names_sizes);
	tcase_add_test(tc, test_bf16_special);
	tcase_add_test(tc, test_bf16_random_vs_reference);
	tcase_add_test(tc, test_bf16_roundtrip_all);
	tcase_add_test(tc, test_load_store);
	suite_add_tcase(s, tc);

	tc = tcase_create("error");
	tcase_add_test(tc, test_errors);
	tcase_add_test(tc, test_empty_huge_shape);
	tcase_add_test(tc, test_log_level);
	suite_add_tcase(s, tc);

	tc = tcase_create("tensor");
	tcase_add_test(tc, test_alloc_geometry);
	tcase_add_test(tc, test_contiguity_rules);
	tcase_add_test(tc, test_views_share_storage);
	tcase_add_test(tc, test_strided_f64_access);
	tcase_add_test(tc, test_copy_conversion);
	tcase_add_test(tc, test_copy_errors_and_exact_ints);
	tcase_add_test(tc, test_copy_overlap);
	tcase_add_test(tc, test_not_host_visible);
	tcase_add_test(tc, test_refcount_lifetime);
	tcase_add_test(tc, test_grad_fields);
	tcase_add_test(tc, test_from_data);
	suite_add_tcase(s, tc);

	tc = tcase_create("rng");
	tcase_add_test(tc, test_rng_determinism);
	tcase_add_test(tc, test_rng_moments);
	suite_add_tcase(s, tc);
	return s;
}
