/* check_safetensors.c -- safetensors reader/writer against the format.
 *
 * The format is checked against bytes written by hand (and against the byte
 * vectors of HF's own serializer tests), not only against our reader; every
 * malformed case of HF's validation is built byte by byte into a temporary
 * directory and must fail with EPJ_ERR_FORMAT and a message naming the
 * file; saves must be atomic (a failed save leaves the old file intact and
 * no temporary file behind).
 */
#include "check_util.h"

#include "core_impl.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers --------------------------------------------------------------
 */

/* A safetensors file: header length `n` (as declared), header text, then
 * `data_len` bytes of data (a counting pattern). */
static void write_st(const char *path, uint64_t n, const char *hdr,
		     size_t data_len)
{
	size_t hl = strlen(hdr);
	size_t total = 8 + hl + data_len;
	unsigned char *b = malloc(total);
	ck_assert_ptr_nonnull(b);
	for (int i = 0; i < 8; i++)
		b[i] = (unsigned char)(n >> (8 * i));
	memcpy(b + 8, hdr, hl);
	for (size_t i = 0; i < data_len; i++)
		b[8 + hl + i] = (unsigned char)(i * 7 + 1);
	tu_write_file(path, b, total);
	free(b);
}

/* Fails unless opening `path` fails with status `want` and a message that
 * names the file and contains `frag`. */
static void expect_open_error(const char *path, epj_status want,
			      const char *frag, const char *what)
{
	epj_ctx *ctx = tu_ctx();
	epj_st_file *f = (epj_st_file *)(uintptr_t)1;
	epj_status s = epj_st_open(ctx, path, &f);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(s == want, "%s: got %s want %s (%s)", what,
		      epj_status_name(s), epj_status_name(want), msg);
	ck_assert_msg(f == NULL, "%s: *out not NULL on failure", what);
	ck_assert_msg(strstr(msg, path), "%s: message lacks the path: %s", what,
		      msg);
	ck_assert_msg(strstr(msg, frag), "%s: message lacks '%s': %s", what,
		      frag, msg);
	epj_ctx_free(ctx);
}

/* Random tensor of any dtype (integers in a wide range, negatives too). */
static epj_tensor *rand_tensor(epj_ctx *ctx, epj_dtype dt, int nd,
			       const int64_t *shape)
{
	epj_tensor *t;
	if (epj_dtype_is_float(dt))
		t = tu_randn(ctx, dt, nd, shape);
	else
		t = epj_randint(ctx, dt, nd, shape, -1000000, 1000000);
	tu_ok(ctx, t);
	return t;
}

/* Exact equality of two tensors' values (bit-exact for every dtype here:
 * doubles hold i32, bf16, f32, f64 exactly and the i64 values are small). */
static void assert_same(epj_ctx *ctx, epj_tensor *a, epj_tensor *b,
			const char *what)
{
	ck_assert_int_eq(epj_tensor_dtype(a), epj_tensor_dtype(b));
	ck_assert_int_eq(epj_tensor_ndim(a), epj_tensor_ndim(b));
	for (int i = 0; i < epj_tensor_ndim(a); i++)
		ck_assert_int_eq(epj_tensor_dim(a, i), epj_tensor_dim(b, i));
	double *ref = tu_values(ctx, a);
	tu_assert_close(ctx, b, ref, 0, 0, what);
	free(ref);
}

/* ---- round trip -----------------------------------------------------------
 */

START_TEST(test_roundtrip)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("st");
	char *path = tu_path(dir, "model.safetensors");
	static const epj_dtype dts[] = { EPJ_DTYPE_F32, EPJ_DTYPE_BF16,
					 EPJ_DTYPE_I64, EPJ_DTYPE_I32,
					 EPJ_DTYPE_F64 };
	enum { NT = 15 };
	epj_tensor *ts[NT];
	char names[NT][32];
	epj_st_writer *w;
	ck_assert_int_eq(epj_st_writer_new(ctx, &w), EPJ_OK);
	for (int i = 0; i < NT; i++) {
		epj_dtype dt = dts[i % 5];
		int nd = i < 5 ? 0 : (int)tu_randint(1, 5);
		int64_t shape[EPJ_MAX_DIMS];
		for (int d = 0; d < nd; d++)
			shape[d] = 2 * tu_randint(1, 4) + 1; /* odd sizes */
		epj_tensor *t = rand_tensor(ctx, dt, nd, shape);
		/* Half of them non-contiguous (rank >= 1). */
		if (nd > 0 && i % 2) {
			epj_tensor *nc = tu_noncontig(ctx, t);
			ck_assert(!epj_tensor_is_contiguous(nc));
			epj_tensor_free(t);
			t = nc;
		}
		ts[i] = t;
		/* Names out of order so that sorting is exercised. */
		snprintf(names[i], sizeof names[i], "model.layers.%d.w_%s",
			 (int)((i * 7) % NT), epj_dtype_name(dt));
		ck_assert_int_eq(epj_st_writer_add(w, names[i], t), EPJ_OK);
	}
	ck_assert_int_eq(epj_st_writer_set_metadata(w, "format", "pt"), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_set_metadata(w, "step", "1"), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_set_metadata(w, "step", "12"),
			 EPJ_OK); /* replaces */
	ck_assert_int_eq(epj_st_writer_save(w, path), EPJ_OK);
	epj_st_writer_free(w);
	ck_assert_int_eq(tu_dir_count(dir), 1); /* no temporary file left */

	/* The data is aligned: the header length is a multiple of 8. */
	size_t n;
	unsigned char *raw = tu_read_file(path, &n);
	uint64_t hl = 0;
	for (int i = 7; i >= 0; i--)
		hl = hl << 8 | raw[i];
	ck_assert_uint_eq(hl % 8, 0);
	free(raw);

	epj_st_file *f;
	ck_assert_msg(epj_st_open(ctx, path, &f) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_st_count(f), NT);
	for (int i = 1; i < NT; i++)
		ck_assert_int_lt(
		    strcmp(epj_st_name_at(f, i - 1), epj_st_name_at(f, i)), 0);
	ck_assert_str_eq(epj_st_metadata(f, "format"), "pt");
	ck_assert_str_eq(epj_st_metadata(f, "step"), "12");
	ck_assert_ptr_null(epj_st_metadata(f, "missing"));
	ck_assert_int_eq(epj_st_metadata_count(f), 2);
	ck_assert_str_eq(epj_st_metadata_key_at(f, 0), "format");
	for (int i = 0; i < NT; i++) {
		int k = epj_st_find(f, names[i]);
		ck_assert_int_ge(k, 0);
		ck_assert_int_eq(epj_st_dtype_at(f, k),
				 epj_tensor_dtype(ts[i]));
		ck_assert_int_eq(epj_st_ndim_at(f, k), epj_tensor_ndim(ts[i]));
		epj_tensor *g = epj_st_get(ctx, f, names[i]);
		tu_ok(ctx, g);
		ck_assert(epj_tensor_is_contiguous(g));
		assert_same(ctx, ts[i], g, names[i]);
		epj_tensor_free(g);
	}
	ck_assert_int_eq(epj_st_find(f, "nope"), -1);
	epj_tensor *missing = epj_st_get(ctx, f, "nope");
	ck_assert_ptr_null(missing);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), path));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "nope"));
	epj_st_close(f);

	for (int i = 0; i < NT; i++)
		epj_tensor_free(ts[i]);
	free(path);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* A writer with no tensors, and tensors with a zero-size dimension. */
START_TEST(test_roundtrip_empty_and_zero_size)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("st");
	char *path = tu_path(dir, "z.safetensors");
	epj_st_writer *w;
	ck_assert_int_eq(epj_st_writer_new(ctx, &w), EPJ_OK);
	int64_t s0[2] = { 3, 0 }, s1[1] = { 5 };
	epj_tensor *z = epj_zeros(ctx, EPJ_DTYPE_F32, 2, s0);
	tu_ok(ctx, z);
	epj_tensor *r = rand_tensor(ctx, EPJ_DTYPE_F32, 1, s1);
	ck_assert_int_eq(epj_st_writer_add(w, "empty", z), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_add(w, "r", r), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_save(w, path), EPJ_OK);
	epj_st_writer_free(w);
	epj_st_file *f;
	ck_assert_msg(epj_st_open(ctx, path, &f) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	epj_tensor *g = epj_st_get(ctx, f, "empty");
	tu_ok(ctx, g);
	ck_assert_int_eq(epj_tensor_numel(g), 0);
	ck_assert_int_eq(epj_tensor_dim(g, 0), 3);
	epj_tensor_free(g);
	g = epj_st_get(ctx, f, "r");
	tu_ok(ctx, g);
	assert_same(ctx, r, g, "after zero-size");
	epj_tensor_free(g);
	epj_st_close(f);
	epj_tensor_free(z);
	epj_tensor_free(r);

	/* No tensors at all: HF writes "{}" padded to 8 bytes. */
	ck_assert_int_eq(epj_st_writer_new(ctx, &w), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_save(w, path), EPJ_OK);
	epj_st_writer_free(w);
	size_t n;
	unsigned char *b = tu_read_file(path, &n);
	static const unsigned char want[] = {
		8, 0, 0, 0, 0, 0, 0, 0, 123, 125, 32, 32, 32, 32, 32, 32
	};
	ck_assert_uint_eq(n, sizeof want);
	ck_assert_int_eq(memcmp(b, want, n), 0);
	free(b);
	ck_assert_int_eq(epj_st_open(ctx, path, &f), EPJ_OK);
	ck_assert_int_eq(epj_st_count(f), 0);
	epj_st_close(f);
	free(path);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- exact bytes ----------------------------------------------------------
 */

/* HF safetensors' own test vector (tensor.rs test_serialization): one F32
 * tensor "attn.0" [1,2,3] holding 0..5. */
static const unsigned char hf_attn[] = {
	64,  0,	  0,   0,   0,	 0,   0,   0,	123, 34,  97,  116, 116, 110,
	46,  48,  34,  58,  123, 34,  100, 116, 121, 112, 101, 34,  58,	 34,
	70,  51,  50,  34,  44,	 34,  115, 104, 97,  112, 101, 34,  58,	 91,
	49,  44,  50,  44,  51,	 93,  44,  34,	100, 97,  116, 97,  95,	 111,
	102, 102, 115, 101, 116, 115, 34,  58,	91,  48,  44,  50,  52,	 93,
	125, 125, 0,   0,   0,	 0,   0,   0,	128, 63,  0,   0,   0,	 64,
	0,   0,	  64,  64,  0,	 0,   128, 64,	0,   0,	  160, 64
};

START_TEST(test_exact_bytes_hf_vector)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("st");
	char *path = tu_path(dir, "attn.safetensors");
	float v[6] = { 0, 1, 2, 3, 4, 5 };
	int64_t shape[3] = { 1, 2, 3 };
	epj_tensor *t = epj_tensor_from_data(ctx, EPJ_DTYPE_F32, 3, shape, v);
	tu_ok(ctx, t);
	epj_st_writer *w;
	ck_assert_int_eq(epj_st_writer_new(ctx, &w), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_add(w, "attn.0", t), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_save(w, path), EPJ_OK);
	epj_st_writer_free(w);
	size_t n;
	unsigned char *b = tu_read_file(path, &n);
	ck_assert_uint_eq(n, sizeof hf_attn);
	ck_assert_int_eq(memcmp(b, hf_attn, n), 0);
	free(b);

	/* And HF's documented I32 example, read by us: N = 60, 16 zero
	 * bytes of data. */
	const char *hdr = "{\"test\":{\"dtype\":\"I32\",\"shape\":[2,2],"
			  "\"data_offsets\":[0,16]}}";
	ck_assert_uint_eq(strlen(hdr), 60);
	unsigned char file[8 + 60 + 16] = { 60 };
	memcpy(file + 8, hdr, 60);
	file[8 + 60] = 5; /* element [0,0] = 5 */
	tu_write_file(path, file, sizeof file);
	epj_st_file *f;
	ck_assert_msg(epj_st_open(ctx, path, &f) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	epj_tensor *g = epj_st_get(ctx, f, "test");
	tu_ok(ctx, g);
	double want[4] = { 5, 0, 0, 0 };
	tu_assert_close(ctx, g, want, 0, 0, "HF I32 example");
	epj_tensor_free(g);
	epj_st_close(f);
	epj_tensor_free(t);
	free(path);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* Several dtypes and metadata, written out by hand from the spec: data is
 * ordered I64, F32, BF16 (HF's descending dtype order), "__metadata__" comes
 * first with sorted keys, fields are dtype, shape, data_offsets; the 202
 * header bytes are padded with 6 spaces to 208 = 0xd0. */
START_TEST(test_exact_bytes_by_hand)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("st");
	char *path = tu_path(dir, "hand.safetensors");
	const char *hdr =
	    "{\"__metadata__\":{\"format\":\"pt\",\"z\":\"1\"},"
	    "\"c\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]},"
	    "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]},"
	    "\"a\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[16,"
	    "22]}}      ";
	ck_assert_uint_eq(strlen(hdr), 208);
	static const unsigned char data[22] = {
		7,    0,    0,	  0,	0,    0,   0, 0, /* i64 7 */
		0,    0,    0x80, 0x3f,			 /* f32 1.0 */
		0,    0,    0x20, 0xc0,			 /* f32 -2.5 */
		0x80, 0x3f, 0,	  0x3f, 0x40, 0xc0	 /* bf16 1, .5, -3 */
	};
	unsigned char want[8 + 208 + 22] = { 0xd0 };
	memcpy(want + 8, hdr, 208);
	memcpy(want + 8 + 208, data, sizeof data);

	int64_t s2 = 2, s3 = 3;
	int64_t iv = 7;
	float fv[2] = { 1.0f, -2.5f };
	double bv[3] = { 1.0, 0.5, -3.0 };
	epj_tensor *c = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 0, NULL, &iv);
	epj_tensor *b = epj_tensor_from_data(ctx, EPJ_DTYPE_F32, 1, &s2, fv);
	epj_tensor *a = epj_zeros(ctx, EPJ_DTYPE_BF16, 1, &s3);
	tu_ok(ctx, c);
	tu_ok(ctx, b);
	tu_ok(ctx, a);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, a, bv), EPJ_OK);
	epj_st_writer *w;
	ck_assert_int_eq(epj_st_writer_new(ctx, &w), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_add(w, "a", a), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_add(w, "b", b), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_add(w, "c", c), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_set_metadata(w, "z", "1"), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_set_metadata(w, "format", "pt"), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_save(w, path), EPJ_OK);
	epj_st_writer_free(w);
	size_t n;
	unsigned char *got = tu_read_file(path, &n);
	ck_assert_uint_eq(n, sizeof want);
	for (size_t i = 0; i < n; i++)
		ck_assert_msg(got[i] == want[i],
			      "byte %zu: got 0x%02x want 0x%02x", i, got[i],
			      want[i]);
	free(got);

	/* Our reader on the hand-made bytes (written independently). */
	tu_write_file(path, want, sizeof want);
	epj_st_file *f;
	ck_assert_msg(epj_st_open(ctx, path, &f) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_st_count(f), 3);
	ck_assert_str_eq(epj_st_name_at(f, 0), "a");
	ck_assert_str_eq(epj_st_dtype_str_at(f, 0), "BF16");
	ck_assert_int_eq(epj_st_ndim_at(f, 2), 0);
	epj_tensor *g = epj_st_get(ctx, f, "a");
	tu_ok(ctx, g);
	tu_assert_close(ctx, g, bv, 0, 0, "bf16 by hand");
	epj_tensor_free(g);
	g = epj_st_get(ctx, f, "c");
	tu_ok(ctx, g);
	double cv = 7;
	tu_assert_close(ctx, g, &cv, 0, 0, "i64 by hand");
	epj_tensor_free(g);
	epj_st_close(f);
	epj_tensor_free(a);
	epj_tensor_free(b);
	epj_tensor_free(c);
	free(path);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- malformed files ------------------------------------------------------
 */

#define F32x2(off) "{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":" off "}"

static const struct bad_case {
	const char *what;
	const char *hdr; /* NULL: raw cases handled in the test */
	int64_t n_delta; /* declared length = strlen(hdr) + n_delta */
	size_t data;	 /* data bytes after the header */
	epj_status want;
	const char *frag;
} bad_cases[] = {
	{ "not json", "{\"a\": ", 0, 0, EPJ_ERR_FORMAT, "not valid JSON" },
	{ "array header", "[1, 2]", 0, 0, EPJ_ERR_FORMAT, "not a JSON object" },
	{ "string header", "\"x\"", 0, 0, EPJ_ERR_FORMAT, "not a JSON object" },
	{ "entry not object", "{\"a\": 3}", 0, 0, EPJ_ERR_FORMAT,
	  "'a' is not an object" },
	{ "no dtype", "{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 0, 8,
	  EPJ_ERR_FORMAT, "no \"dtype\"" },
	{ "no shape", "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 0,
	  8, EPJ_ERR_FORMAT, "no \"shape\"" },
	{ "no offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 0, 8,
	  EPJ_ERR_FORMAT, "no \"data_offsets\"" },
	{ "dtype number",
	  "{\"a\":{\"dtype\":4,\"shape\":[2],\"data_offsets\":[0,8]}}", 0, 8,
	  EPJ_ERR_FORMAT, "not a string" },
	{ "unknown dtype",
	  "{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 0,
	  8, EPJ_ERR_FORMAT, "unknown dtype \"F33\"" },
	{ "shape not array",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 0,
	  8, EPJ_ERR_FORMAT, "\"shape\" is not an array" },
	{ "shape string dim",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}"
	  "}",
	  0, 8, EPJ_ERR_FORMAT, "shape[0] is not an integer" },
	{ "shape real dim",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}",
	  0, 8, EPJ_ERR_FORMAT, "shape[0] is not an integer" },
	{ "negative dim",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,-1],\"data_offsets\":[0,8]}}",
	  0, 8, EPJ_ERR_FORMAT, "negative dimension" },
	{ "numel overflow",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[1099511627776,"
	  "1099511627776],\"data_offsets\":[0,8]}}",
	  0, 8, EPJ_ERR_FORMAT, "overflows" },
	{ "one huge dim",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,16],"
	  "\"data_offsets\":[0,8]}}",
	  0, 8, EPJ_ERR_FORMAT, "shape too large" },
	{ "empty with huge dims",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[0,4611686018427387904,"
	  "4611686018427387904],\"data_offsets\":[0,0]}}",
	  0, 0, EPJ_ERR_FORMAT, "non-zero dimensions must be at most" },
	{ "offsets one value",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 0,
	  8, EPJ_ERR_FORMAT, "data_offsets" },
	{ "offsets negative",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}}",
	  0, 8, EPJ_ERR_FORMAT, "non-negative" },
	{ "offsets strings",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[\"0\",8]}"
	  "}",
	  0, 8, EPJ_ERR_FORMAT, "data_offsets" },
	{ "end before begin",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", 0,
	  8, EPJ_ERR_FORMAT, "end 0 < begin 8" },
	{ "size mismatch",
	  "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 0,
	  8, EPJ_ERR_FORMAT, "needs 12" },
	{ "overlap", "{\"a\":" F32x2("[0,8]") ",\"b\":" F32x2("[4,12]") "}", 0,
	  12, EPJ_ERR_FORMAT, "overlaps" },
	{ "gap", "{\"a\":" F32x2("[0,8]") ",\"b\":" F32x2("[12,20]") "}", 0, 20,
	  EPJ_ERR_FORMAT, "gap of 4 bytes" },
	{ "offsets beyond buffer", "{\"a\":" F32x2("[0,8]") "}", 0, 5,
	  EPJ_ERR_FORMAT, "truncated" },
	{ "truncated data",
	  "{\"a\":" F32x2("[0,8]") ",\"b\":" F32x2("[8,16]") "}", 0, 12,
	  EPJ_ERR_FORMAT, "truncated" },
	{ "trailing bytes", "{\"a\":" F32x2("[0,8]") "}", 0, 9, EPJ_ERR_FORMAT,
	  "trailing" },
	{ "duplicate names",
	  "{\"a\":" F32x2("[0,8]") ",\"a\":" F32x2("[8,16]") "}", 0, 16,
	  EPJ_ERR_FORMAT, "duplicate" },
	{ "metadata not object", "{\"__metadata__\":[1]}", 0, 0, EPJ_ERR_FORMAT,
	  "\"__metadata__\" is not an object" },
	{ "metadata value number", "{\"__metadata__\":{\"k\":1}}", 0, 0,
	  EPJ_ERR_FORMAT, "value of 'k' is not a string" },
	{ "header longer than file", "{}", 100, 0, EPJ_ERR_FORMAT,
	  "larger than the rest of the file" },
	{ "absurd header length", "{}", 200000000, 0, EPJ_ERR_FORMAT,
	  "100 MB" },
	{ "empty header", "", 0, 0, EPJ_ERR_FORMAT, "not valid JSON" },
	{ "invalid utf-8", "{\"\xff\xfe\":" F32x2("[0,8]") "}", 0, 8,
	  EPJ_ERR_FORMAT, "not valid JSON" },
};

START_TEST(test_malformed)
{
	char *dir = tu_tmpdir_new("st");
	char *path = tu_path(dir, "bad.safetensors");
	for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
		const struct bad_case *c = &bad_cases[i];
		write_st(path, (uint64_t)((int64_t)strlen(c->hdr) + c->n_delta),
			 c->hdr, c->data);
		expect_open_error(path, c->want, c->frag, c->what);
	}
	/* Files shorter than the length field. */
	tu_write_file(path, "", 0);
	expect_open_error(path, EPJ_ERR_FORMAT, "shorter than", "empty file");
	tu_write_file(path, "\x02\0\0\0\0", 5);
	expect_open_error(path, EPJ_ERR_FORMAT, "shorter than", "5-byte file");
	/* A header length with the top bit set (negative as i64). */
	unsigned char big[16] = { 0, 0, 0, 0, 0, 0, 0, 0x80, '{', '}' };
	tu_write_file(path, big, sizeof big);
	expect_open_error(path, EPJ_ERR_FORMAT, "100 MB", "2^63 length");
	/* Missing file, directory. */
	expect_open_error(dir, EPJ_ERR_IO, "not a regular file", "directory");
	unlink(path);
	expect_open_error(path, EPJ_ERR_IO, "cannot open", "missing file");
	free(path);
	tu_tmpdir_free(dir);
}
END_TEST

/* A valid file (for HF) holding an F16 tensor: it opens and lists it, and
 * only reading that tensor fails. */
START_TEST(test_unsupported_dtype)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("st");
	char *path = tu_path(dir, "f16.safetensors");
	const char *hdr =
	    "{\"h\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]},"
	    "\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}";
	write_st(path, strlen(hdr), hdr, 8);
	epj_st_file *f;
	ck_assert_msg(epj_st_open(ctx, path, &f) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_st_dtype_at(f, 0), EPJ_DTYPE_COUNT);
	ck_assert_str_eq(epj_st_dtype_str_at(f, 0), "F16");
	ck_assert_ptr_null(epj_st_get(ctx, f, "h"));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_UNSUPPORTED);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "F16"));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), path));
	epj_tensor *x = epj_st_get(ctx, f, "x");
	tu_ok(ctx, x);
	ck_assert_int_eq(epj_tensor_numel(x), 1);
	epj_tensor_free(x);
	epj_st_close(f);
	free(path);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- writer errors and atomic saves ------------------------------------- */

START_TEST(test_writer_errors)
{
	epj_ctx *ctx = tu_ctx();
	int64_t s = 3;
	epj_tensor *t = rand_tensor(ctx, EPJ_DTYPE_F32, 1, &s);
	epj_st_writer *w;
	ck_assert_int_eq(epj_st_writer_new(ctx, &w), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_add(w, "w", t), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_add(w, "w", t), EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "duplicate"));
	ck_assert_int_eq(epj_st_writer_add(w, "__metadata__", t),
			 EPJ_ERR_INVALID);
	ck_assert_int_eq(epj_st_writer_add(w, "bad\xff", t), EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "UTF-8"));
	ck_assert_int_eq(epj_st_writer_set_metadata(w, "k", "\xc3"),
			 EPJ_ERR_INVALID);
	/* A NULL tensor from a failed op keeps that op's message. */
	int64_t s2[2] = { 2, 3 }, s3[2] = { 4, 5 };
	epj_tensor *a = rand_tensor(ctx, EPJ_DTYPE_F32, 2, s2);
	epj_tensor *b = rand_tensor(ctx, EPJ_DTYPE_F32, 2, s3);
	epj_tensor *bad = epj_matmul(ctx, a, b);
	ck_assert_ptr_null(bad);
	epj_status st = epj_ctx_status(ctx);
	char msg[1024];
	snprintf(msg, sizeof msg, "%s", epj_ctx_error(ctx));
	ck_assert_int_eq(epj_st_writer_add(w, "m", bad), st);
	ck_assert_str_eq(epj_ctx_error(ctx), msg);
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(epj_st_writer_add(w, "m", NULL), EPJ_ERR_INVALID);
	/* The writer keeps its own reference. */
	epj_tensor_free(t);
	char *dir = tu_tmpdir_new("st");
	char *path = tu_path(dir, "w.safetensors");
	ck_assert_int_eq(epj_st_writer_save(w, path), EPJ_OK);
	epj_st_writer_free(w);
	epj_st_file *f;
	ck_assert_int_eq(epj_st_open(ctx, path, &f), EPJ_OK);
	ck_assert_int_eq(epj_st_count(f), 1);
	epj_st_close(f);
	epj_tensor_free(a);
	epj_tensor_free(b);
	free(path);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* Writes a one-tensor file at path holding n f32 values. */
static epj_st_writer *writer_with(epj_ctx *ctx, int64_t n, epj_tensor **t)
{
	*t = rand_tensor(ctx, EPJ_DTYPE_F32, 1, &n);
	epj_st_writer *w;
	ck_assert_int_eq(epj_st_writer_new(ctx, &w), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_add(w, "p", *t), EPJ_OK);
	return w;
}

/* ej_tmp_create: names that differ call by call (three temporary files of
 * one path at once, each new and empty), and a name that is taken (a file
 * planted where the next draw lands) is skipped, never opened: the planted
 * file keeps its content and the descriptor is a new file. */
static uint64_t nonce_seq;
static uint64_t nonce_next(void)
{
	return nonce_seq++;
}

START_TEST(test_tmp_create)
{
	char *dir = tu_tmpdir_new("tmpc");
	char *path = tu_path(dir, "ck.safetensors");
	char names[3][4200];
	int fds[3];
	for (int i = 0; i < 3; i++) {
		fds[i] = ej_tmp_create(path, names[i], sizeof names[i]);
		ck_assert_msg(fds[i] >= 0, "%s: %s", names[i], strerror(errno));
		ck_assert(!strncmp(names[i], path, strlen(path)));
		for (int j = 0; j < i; j++)
			ck_assert_str_ne(names[i], names[j]);
	}
	for (int i = 0; i < 3; i++) {
		struct stat st;
		ck_assert_int_eq(fstat(fds[i], &st), 0);
		ck_assert(S_ISREG(st.st_mode) && st.st_size == 0);
		close(fds[i]);
		ck_assert_int_eq(unlink(names[i]), 0);
	}
	/* the next draw is planted: the one after it is used */
	uint64_t k = (uint64_t)tu_randint(1, 1 << 30);
	char planted[4200];
	snprintf(planted, sizeof planted, "%s.tmp.%ld.%016llx.%s", path,
		 (long)getpid(), (unsigned long long)k, ej_host_tag());
	tu_write_text(planted, "planted\n");
	nonce_seq = k;
	ej_tmp_nonce_hook = nonce_next;
	char name[4200];
	int fd = ej_tmp_create(path, name, sizeof name);
	ej_tmp_nonce_hook = NULL;
	ck_assert_msg(fd >= 0, "%s", strerror(errno));
	ck_assert_str_ne(name, planted);
	ck_assert_int_eq(nonce_seq, k + 2);
	ck_assert_int_eq(write(fd, "ours", 4), 4);
	close(fd);
	char *pl = tu_slurp(planted, NULL);
	ck_assert_str_eq(pl, "planted\n");
	free(pl);
	ck_assert_int_eq(unlink(name), 0);
	ck_assert_int_eq(unlink(planted), 0);
	free(path);
	tu_tmpdir_free(dir);
}
END_TEST

/* A set of shards with model.safetensors.index.json opens as one file: the
 * union of the shards' tensors, each read from its shard with its values;
 * an index that points outside its folder, names a tensor its shard lacks,
 * misses a shard's tensor or a shard file is refused naming what. */
START_TEST(test_shards)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("shards");
	const int n_t = 5; /* tensors t0..t4: t0, t2, t4 in a, t1, t3 in b */
	epj_tensor *t[5];
	epj_st_writer *wa = NULL, *wb = NULL;
	ck_assert_int_eq(epj_st_writer_new(ctx, &wa), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_new(ctx, &wb), EPJ_OK);
	for (int i = 0; i < n_t; i++) {
		int64_t shp[2] = { 2 + i, 3 };
		t[i] = epj_randn(ctx, i % 2 ? EPJ_DTYPE_BF16 : EPJ_DTYPE_F32, 2,
				 shp, 0.0, 1.0);
		char nm[8];
		snprintf(nm, sizeof nm, "t%d", i);
		ck_assert_int_eq(epj_st_writer_add(i % 2 ? wb : wa, nm, t[i]),
				 EPJ_OK);
	}
	char *pa = tu_path(dir, "model-00001-of-00002.safetensors");
	char *pb = tu_path(dir, "model-00002-of-00002.safetensors");
	ck_assert_int_eq(epj_st_writer_save(wa, pa), EPJ_OK);
	ck_assert_int_eq(epj_st_writer_save(wb, pb), EPJ_OK);
	char *idx = tu_path(dir, "model.safetensors.index.json");
	const char *good =
	    "{\"metadata\": {\"total_size\": 1}, \"weight_map\": {"
	    "\"t0\": \"model-00001-of-00002.safetensors\", "
	    "\"t1\": \"model-00002-of-00002.safetensors\", "
	    "\"t2\": \"model-00001-of-00002.safetensors\", "
	    "\"t3\": \"model-00002-of-00002.safetensors\", "
	    "\"t4\": \"model-00001-of-00002.safetensors\"}}";
	tu_write_text(idx, good);
	epj_st_file *f = NULL;
	ck_assert_msg(epj_st_open(ctx, idx, &f) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(epj_st_count(f), n_t);
	for (int i = 0; i < n_t; i++) {
		char nm[8];
		snprintf(nm, sizeof nm, "t%d", i);
		ck_assert_str_eq(epj_st_name_at(f, i), nm); /* sorted */
		epj_tensor *g = epj_st_get(ctx, f, nm);
		ck_assert_ptr_nonnull(g);
		ck_assert_int_eq(epj_tensor_dtype(g), epj_tensor_dtype(t[i]));
		ck_assert_int_eq(epj_tensor_dim(g, 0), 2 + i);
		double *a = tu_values(ctx, t[i]), *b = tu_values(ctx, g);
		for (int64_t k = 0; k < epj_tensor_numel(g); k++)
			ck_assert(a[k] == b[k]);
		free(a);
		free(b);
		epj_tensor_free(g);
	}
	epj_st_close(f);
	/* refusals, each naming what is wrong */
	static const struct {
		const char *index, *want;
	} bad[] = {
		{ "{\"weight_map\": {\"t0\": \"../x.safetensors\"}}",
		  "shard '../x.safetensors' is not a file name next to the "
		  "index" },
		{ "{\"weight_map\": {\"t0\": \"/etc/passwd\"}}",
		  "is not a file name next to the index" },
		{ "{\"weight_map\": {}}", "no \"weight_map\"" },
		{ "{\"weight_map\": {\"t0\": "
		  "\"model-00001-of-00002.safetensors\", \"t1\": "
		  "\"nope.safetensors\"}}",
		  "nope.safetensors" },
		/* t4 unlisted: the shards hold more than the index names */
		{ "{\"weight_map\": {"
		  "\"t0\": \"model-00001-of-00002.safetensors\", "
		  "\"t1\": \"model-00002-of-00002.safetensors\", "
		  "\"t2\": \"model-00001-of-00002.safetensors\", "
		  "\"t3\": \"model-00002-of-00002.safetensors\", "
		  "\"t5\": \"model-00001-of-00002.safetensors\"}}",
		  "is not in the index under that shard" },
		/* t1 said to be in the first shard, where it is not */
		{ "{\"weight_map\": {"
		  "\"t0\": \"model-00001-of-00002.safetensors\", "
		  "\"t1\": \"model-00001-of-00002.safetensors\", "
		  "\"t2\": \"model-00001-of-00002.safetensors\", "
		  "\"t3\": \"model-00002-of-00002.safetensors\", "
		  "\"t4\": \"model-00001-of-00002.safetensors\"}}",
		  "tensor 't1' of shard 'model-00002-of-00002.safetensors' is "
		  "not in the index under that shard" },
		/* t9 in no shard */
		{ "{\"weight_map\": {"
		  "\"t0\": \"model-00001-of-00002.safetensors\", "
		  "\"t1\": \"model-00002-of-00002.safetensors\", "
		  "\"t2\": \"model-00001-of-00002.safetensors\", "
		  "\"t3\": \"model-00002-of-00002.safetensors\", "
		  "\"t4\": \"model-00001-of-00002.safetensors\", "
		  "\"t9\": \"model-00002-of-00002.safetensors\"}}",
		  "the index names 6 tensors, its 2 shards hold 5" },
		{ "[1, 2", "invalid JSON" },
	};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		tu_write_text(idx, bad[i].index);
		f = NULL;
		epj_status st = epj_st_open(ctx, idx, &f);
		ck_assert_msg(st != EPJ_OK && !f, "case %zu accepted", i);
		ck_assert_msg(strstr(epj_ctx_error(ctx), bad[i].want),
			      "case %zu: want \"%s\", got \"%s\"", i,
			      bad[i].want, epj_ctx_error(ctx));
		epj_ctx_clear_error(ctx);
	}
	for (int i = 0; i < n_t; i++)
		epj_tensor_free(t[i]);
	epj_st_writer_free(wa);
	epj_st_writer_free(wb);
	free(pa);
	free(pb);
	free(idx);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_atomic_save)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("st");
	char *path = tu_path(dir, "ckpt.safetensors");
	epj_tensor *old_t, *new_t;
	epj_st_writer *w_old = writer_with(ctx, 7, &old_t);
	ck_assert_int_eq(epj_st_writer_save(w_old, path), EPJ_OK);
	size_t n_old;
	unsigned char *old = tu_read_file(path, &n_old);
	epj_st_writer *w = writer_with(ctx, 16384, &new_t); /* 64 KiB */

	/* 1. Someone planted the temporary name the old code used (a name
	 * anyone could compute: pid and host tag) as a file of theirs: the
	 * save must not write into it (it would become the checkpoint, owned
	 * by them) nor touch it; the checkpoint is a new file of ours. */
	char tmp[4096];
	snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%s", path, (long)getpid(),
		 ej_host_tag());
	tu_write_text(tmp, "planted\n");
	struct stat st, planted;
	ck_assert_int_eq(lstat(tmp, &planted), 0);
	ck_assert_msg(epj_st_writer_save(w_old, path) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(lstat(path, &st), 0);
	ck_assert_msg(st.st_ino != planted.st_ino,
		      "the checkpoint is the planted file");
	char *pl = tu_slurp(tmp, NULL);
	ck_assert_str_eq(pl, "planted\n");
	free(pl);
	ck_assert_int_eq(unlink(tmp), 0);
	size_t n;
	unsigned char *now = tu_read_file(path, &n);
	ck_assert_uint_eq(n, n_old);
	ck_assert_int_eq(memcmp(now, old, n), 0);
	free(now);

	/* 2. Writing fails midway (file size limit): temp file removed, old
	 * file intact. */
	struct rlimit rl_old, rl;
	ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &rl_old), 0);
	void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
	rl = rl_old;
	rl.rlim_cur = 4096;
	ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
	epj_status s = epj_st_writer_save(w, path);
	ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &rl_old), 0);
	signal(SIGXFSZ, prev);
	ck_assert_msg(s == EPJ_ERR_IO, "got %s: %s", epj_status_name(s),
		      epj_ctx_error(ctx));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), path));
	ck_assert_int_eq(stat(tmp, &st), -1);
	ck_assert_int_eq(tu_dir_count(dir), 1);
	now = tu_read_file(path, &n);
	ck_assert_uint_eq(n, n_old);
	ck_assert_int_eq(memcmp(now, old, n), 0);
	free(now);

	/* 3. Target directory missing. */
	char *nodir = tu_path(dir, "missing/ckpt.safetensors");
	ck_assert_int_eq(epj_st_writer_save(w, nodir), EPJ_ERR_IO);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), nodir));
	free(nodir);

	/* 4. A successful save replaces the file; nothing else is left. */
	ck_assert_int_eq(epj_st_writer_save(w, path), EPJ_OK);
	ck_assert_int_eq(tu_dir_count(dir), 1);
	epj_st_file *f;
	ck_assert_int_eq(epj_st_open(ctx, path, &f), EPJ_OK);
	epj_tensor *g = epj_st_get(ctx, f, "p");
	tu_ok(ctx, g);
	assert_same(ctx, new_t, g, "replaced");
	epj_tensor_free(g);
	epj_st_close(f);

	free(old);
	epj_st_writer_free(w_old);
	epj_st_writer_free(w);
	epj_tensor_free(old_t);
	epj_tensor_free(new_t);
	free(path);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* The file shrinks after open: reading fails cleanly with EPJ_ERR_IO. */
START_TEST(test_file_changed_after_open)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("st");
	char *path = tu_path(dir, "c.safetensors");
	epj_tensor *t;
	epj_st_writer *w = writer_with(ctx, 33, &t);
	ck_assert_int_eq(epj_st_writer_save(w, path), EPJ_OK);
	epj_st_file *f;
	ck_assert_int_eq(epj_st_open(ctx, path, &f), EPJ_OK);
	ck_assert_int_eq(truncate(path, 40), 0);
	ck_assert_ptr_null(epj_st_get(ctx, f, "p"));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_IO);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), path));
	epj_st_close(f);
	epj_st_writer_free(w);
	epj_tensor_free(t);
	free(path);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_safetensors_suite(void)
{
	Suite *s = suite_create("safetensors");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_roundtrip);
	tcase_add_test(tc, test_roundtrip_empty_and_zero_size);
	tcase_add_test(tc, test_exact_bytes_hf_vector);
	tcase_add_test(tc, test_exact_bytes_by_hand);
	tcase_add_test(tc, test_malformed);
	tcase_add_test(tc, test_unsupported_dtype);
	tcase_add_test(tc, test_writer_errors);
	tcase_add_test(tc, test_tmp_create);
	tcase_add_test(tc, test_atomic_save);
	tcase_add_test(tc, test_shards);
	tcase_add_test(tc, test_file_changed_after_open);
	suite_add_tcase(s, tc);
	return s;
}
