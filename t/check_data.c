/* check_data.c -- token files, the text converter and corpora.
 *
 * Token files are checked against header bytes built by hand from the spec
 * (doc/formats.md) and every malformed variant must fail with a message
 * naming the file.  The synthetic corpus is checked statistically against
 * its own claims: its stationary distribution against empirical unigram
 * frequencies, its entropy rate against the empirical conditional entropy
 * (plug-in estimate from transition counts) of a long sample.
 */
#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers --------------------------------------------------------------
 */

typedef struct tdir {
	char dir[64];
	char path[128];
} tdir;

static void tdir_new(tdir *d, const char *file)
{
	snprintf(d->dir, sizeof d->dir, "/tmp/epj-data-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(d->dir));
	snprintf(d->path, sizeof d->path, "%s/%s", d->dir, file);
}

static void tdir_free(tdir *d, const char *const *extra, int n)
{
	unlink(d->path);
	char p[256];
	for (int i = 0; i < n; i++) {
		snprintf(p, sizeof p, "%s/%s", d->dir, extra[i]);
		unlink(p);
	}
	ck_assert_msg(rmdir(d->dir) == 0, "leftover files in %s", d->dir);
}

static void le32(unsigned char *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static void le64(unsigned char *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

/* Bulk random numbers for big inputs (Check's asserts, which tu_randint
 * makes, are slow per call); seeded from the run's seed. */
typedef struct bulk_rng {
	uint64_t s;
} bulk_rng;

static bulk_rng bulk_new(void)
{
	return (bulk_rng){ (uint64_t)tu_randint(0, INT64_MAX) | 1 };
}

static uint32_t bulk_below(bulk_rng *r, uint32_t n)
{
	r->s ^= r->s << 13; /* xorshift64 */
	r->s ^= r->s >> 7;
	r->s ^= r->s << 17;
	return (uint32_t)((r->s >> 11) % n);
}

/* A token-file header built from the spec. */
static void make_header(unsigned char h[32], uint32_t version, uint32_t dtype,
			uint64_t count, uint32_t vocab, uint32_t reserved)
{
	memcpy(h, "EPJTOK\0\0", 8);
	le32(h + 8, version);
	le32(h + 12, dtype);
	le64(h + 16, count);
	le32(h + 24, vocab);
	le32(h + 28, reserved);
}

static void expect_read_error(const char *path, epj_status want,
			      const char *frag, const char *what)
{
	epj_ctx *ctx = tu_ctx();
	epj_tokens *t = (epj_tokens *)(uintptr_t)1;
	epj_status s = epj_tokens_read(ctx, path, &t);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(s == want, "%s: got %s want %s (%s)", what,
		      epj_status_name(s), epj_status_name(want), msg);
	ck_assert_ptr_null(t);
	ck_assert_msg(strstr(msg, path), "%s: no path in: %s", what, msg);
	ck_assert_msg(strstr(msg, frag), "%s: no '%s' in: %s", what, frag, msg);
	epj_ctx_free(ctx);
}

/* All elements of an i64 tensor. */
static int64_t *i64_values(epj_tensor *t)
{
	ck_assert_int_eq(epj_tensor_dtype(t), EPJ_DTYPE_I64);
	ck_assert(epj_tensor_is_contiguous(t));
	int64_t n = epj_tensor_numel(t);
	int64_t *v = malloc((size_t)n * sizeof *v);
	ck_assert_ptr_nonnull(v);
	memcpy(v, epj_tensor_data(t), (size_t)n * sizeof *v);
	return v;
}

/* ---- token files -----------------------------------------------------------
 */

START_TEST(test_tokens_roundtrip)
{
	epj_ctx *ctx = tu_ctx();
	tdir d;
	tdir_new(&d, "t.tok");
	for (int u16 = 0; u16 <= 1; u16++) {
		uint32_t vocab = u16 ? (uint32_t)tu_randint(300, 65537)
				     : (uint32_t)tu_randint(65537, 1 << 24);
		uint64_t count = (uint64_t)tu_randint(1, 5000) * 2 + 1;
		uint32_t *tok = malloc(count * sizeof *tok);
		ck_assert_ptr_nonnull(tok);
		bulk_rng r = bulk_new();
		for (uint64_t i = 0; i < count; i++)
			tok[i] = bulk_below(&r, vocab);
		tok[0] = vocab - 1; /* the largest valid token */
		ck_assert_int_eq(
		    epj_tokens_write(ctx, d.path, tok, count, vocab, u16),
		    EPJ_OK);

		/* The bytes, from the spec. */
		size_t n;
		unsigned char *b = tu_read_file(d.path, &n);
		size_t es = u16 ? 2 : 4;
		ck_assert_uint_eq(n, 32 + count * es);
		unsigned char h[32];
		make_header(h, 1, u16 ? 1 : 2, count, vocab, 0);
		ck_assert_int_eq(memcmp(b, h, 32), 0);
		uint64_t mismatches = 0;
		for (uint64_t i = 0; i < count; i++) {
			uint32_t v = 0;
			for (size_t k = 0; k < es; k++)
				v |= (uint32_t)b[32 + i * es + k] << (8 * k);
			mismatches += v != tok[i];
		}
		ck_assert_uint_eq(mismatches, 0);
		free(b);

		epj_tokens *t;
		ck_assert_msg(epj_tokens_read(ctx, d.path, &t) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		ck_assert_uint_eq(t->count, count);
		ck_assert_uint_eq(t->vocab_size, vocab);
		ck_assert_int_eq(memcmp(t->data, tok, count * 4), 0);
		epj_tokens_free(t);
		free(tok);
	}
	/* Empty files and unknown vocab are valid. */
	ck_assert_int_eq(epj_tokens_write(ctx, d.path, NULL, 0, 0, false),
			 EPJ_OK);
	epj_tokens *t;
	ck_assert_int_eq(epj_tokens_read(ctx, d.path, &t), EPJ_OK);
	ck_assert_uint_eq(t->count, 0);
	ck_assert_uint_eq(t->vocab_size, 0);
	epj_tokens_free(t);
	tdir_free(&d, NULL, 0);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_tokens_write_errors)
{
	epj_ctx *ctx = tu_ctx();
	tdir d;
	tdir_new(&d, "t.tok");
	uint32_t tok[5] = { 1, 2, 3, 4, 5 };
	ck_assert_int_eq(epj_tokens_write(ctx, d.path, tok, 5, 5, false),
			 EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "index 4"));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), d.path));
	tok[2] = 70000;
	ck_assert_int_eq(epj_tokens_write(ctx, d.path, tok, 5, 0, true),
			 EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "uint16"));
	ck_assert_int_eq(epj_tokens_write(ctx, d.path, tok, 5, 70001, true),
			 EPJ_ERR_INVALID);
	/* Nothing was written. */
	ck_assert_int_eq(access(d.path, F_OK), -1);
	/* Missing directory. */
	char bad[256];
	snprintf(bad, sizeof bad, "%s/no/such/dir.tok", d.dir);
	ck_assert_int_eq(epj_tokens_write(ctx, bad, tok, 5, 0, false),
			 EPJ_ERR_IO);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), bad));
	tdir_free(&d, NULL, 0);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_tokens_malformed)
{
	tdir d;
	tdir_new(&d, "bad.tok");
	unsigned char buf[32 + 4 * 8];
	memset(buf, 0, sizeof buf);
	/* A valid u16 file of 8 tokens below vocab 9 as the base. */
	for (int i = 0; i < 8; i++)
		buf[32 + 2 * i] = (unsigned char)(i + 1);

	make_header(buf, 1, 1, 8, 9, 0);
	tu_write_file(d.path, buf, 32 + 16);
	epj_ctx *ctx = tu_ctx();
	epj_tokens *t;
	ck_assert_msg(epj_tokens_read(ctx, d.path, &t) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_uint_eq(t->data[7], 8);
	epj_tokens_free(t);
	epj_ctx_free(ctx);

	tu_write_file(d.path, buf, 20);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "shorter than the 32-byte",
			  "short header");
	tu_write_file(d.path, buf, 32 + 15);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "truncated", "odd size");
	tu_write_file(d.path, buf, 32 + 14);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "truncated", "7 tokens of 8");
	tu_write_file(d.path, buf, 32 + 18);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "trailing", "9 tokens of 8");

	make_header(buf, 1, 1, UINT64_MAX / 2 + 3, 9, 0);
	tu_write_file(d.path, buf, 32 + 16);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "truncated", "huge count");

	make_header(buf, 1, 1, 8, 9, 0);
	buf[3] = 'X';
	tu_write_file(d.path, buf, 32 + 16);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "bad magic", "magic");

	make_header(buf, 2, 1, 8, 9, 0);
	tu_write_file(d.path, buf, 32 + 16);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "unsupported version 2",
			  "version");

	make_header(buf, 1, 3, 8, 9, 0);
	tu_write_file(d.path, buf, 32 + 16);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "unsupported token dtype 3",
			  "dtype");

	make_header(buf, 1, 1, 8, 9, 1);
	tu_write_file(d.path, buf, 32 + 16);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "reserved", "reserved");

	make_header(buf, 1, 1, 8, 8, 0); /* token 8 at index 7 */
	tu_write_file(d.path, buf, 32 + 16);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "index 7", "token >= vocab");

	/* u32 file, same count: the size must match 4-byte tokens. */
	make_header(buf, 1, 2, 8, 0, 0);
	tu_write_file(d.path, buf, 32 + 16);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "truncated", "u32 size");

	/* u32 file without vocab_size holding 0xFFFFFFFF: the vocabulary
	 * (max + 1) would wrap to 0, "unknown", and pass every check. */
	unsigned char b32[32 + 4 * 3];
	make_header(b32, 1, 2, 3, 0, 0);
	for (int i = 0; i < 12; i++)
		b32[32 + i] = (unsigned char)(i < 4 ? 7 : i < 8 ? 0xFF : 2);
	tu_write_file(d.path, b32, sizeof b32);
	expect_read_error(d.path, EPJ_ERR_FORMAT, "[0, 4294967294]",
			  "token 0xFFFFFFFF without vocab_size");
	epj_ctx *cx = tu_ctx();
	ck_assert_ptr_null(epj_corpus_from_tokens(cx, d.path));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(cx), "index 1"));
	epj_ctx_free(cx);

	/* A FIFO is refused at once, not waited on. */
	unlink(d.path);
	ck_assert_int_eq(mkfifo(d.path, 0600), 0);
	alarm(10);
	expect_read_error(d.path, EPJ_ERR_IO, "not a regular file (a FIFO)",
			  "FIFO");
	alarm(0);
	unlink(d.path);
	expect_read_error(d.path, EPJ_ERR_IO, "cannot open", "missing");
	expect_read_error(d.dir, EPJ_ERR_IO, "", "directory");
	tdir_free(&d, NULL, 0);
}
END_TEST

START_TEST(test_tokens_from_text)
{
	epj_ctx *ctx = tu_ctx();
	tdir d;
	tdir_new(&d, "out.tok");
	char txt[256];
	snprintf(txt, sizeof txt, "%s/in.txt", d.dir);
	size_t n = (size_t)tu_randint(1, 100000);
	unsigned char *text = malloc(n);
	ck_assert_ptr_nonnull(text);
	bulk_rng r = bulk_new();
	for (size_t i = 0; i < n; i++)
		text[i] = (unsigned char)bulk_below(&r, 256);
	text[0] = 0;
	if (n > 1)
		text[1] = 255;
	tu_write_file(txt, text, n);
	ck_assert_msg(epj_tokens_from_text(ctx, txt, d.path) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	size_t fn;
	unsigned char *raw = tu_read_file(d.path, &fn);
	unsigned char h[32];
	make_header(h, 1, 1, n, 256, 0);
	ck_assert_uint_eq(fn, 32 + 2 * n);
	ck_assert_int_eq(memcmp(raw, h, 32), 0);
	free(raw);
	epj_tokens *t;
	ck_assert_int_eq(epj_tokens_read(ctx, d.path, &t), EPJ_OK);
	ck_assert_uint_eq(t->count, n);
	size_t mismatches = 0;
	for (size_t i = 0; i < n; i++)
		mismatches += t->data[i] != text[i];
	ck_assert_uint_eq(mismatches, 0);
	epj_tokens_free(t);

	char missing[256];
	snprintf(missing, sizeof missing, "%s/none.txt", d.dir);
	ck_assert_int_eq(epj_tokens_from_text(ctx, missing, d.path),
			 EPJ_ERR_IO);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), missing));
	free(text);
	const char *extra[] = { "in.txt" };
	tdir_free(&d, extra, 1);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- synthetic corpus ------------------------------------------------------
 */

/* Fails unless the two batches are equal. */
static void assert_batches_equal(epj_tensor *a, epj_tensor *b, bool want)
{
	int64_t n = epj_tensor_numel(a);
	ck_assert_int_eq(n, epj_tensor_numel(b));
	int64_t *x = i64_values(a), *y = i64_values(b);
	bool eq = memcmp(x, y, (size_t)n * sizeof *x) == 0;
	free(x);
	free(y);
	ck_assert_msg(eq == want, "batches %s", want ? "differ" : "are equal");
}

/* Checks shapes, range, label shift and the continuation between rows
 * (row b + 1 starts with row b's last label); *carry is the label that the
 * next batch's first input must equal (-1: unknown). */
static void check_batch(epj_tensor *in, epj_tensor *lab, int64_t B, int64_t T,
			uint32_t vocab, int64_t *carry)
{
	ck_assert_int_eq(epj_tensor_ndim(in), 2);
	ck_assert_int_eq(epj_tensor_dim(in, 0), B);
	ck_assert_int_eq(epj_tensor_dim(in, 1), T);
	ck_assert_int_eq(epj_tensor_dim(lab, 0), B);
	ck_assert_int_eq(epj_tensor_dim(lab, 1), T);
	int64_t *x = i64_values(in), *y = i64_values(lab);
	/* One assertion at the end: Check's asserts are slow in hot loops. */
	int64_t bad = -1;
	for (int64_t b = 0; b < B; b++) {
		if (*carry >= 0 && x[b * T] != *carry && bad < 0)
			bad = b * T;
		for (int64_t t = 0; t < T; t++) {
			int64_t i = b * T + t;
			bool ok = x[i] >= 0 && x[i] < vocab && y[i] >= 0 &&
				  y[i] < vocab &&
				  (t + 1 == T || y[i] == x[i + 1]);
			if (!ok && bad < 0)
				bad = i;
		}
		*carry = y[b * T + T - 1];
	}
	ck_assert_msg(bad < 0,
		      "batch [%lld, %lld] wrong at flat index %lld: input %lld "
		      "label %lld (vocab %u)",
		      (long long)B, (long long)T, (long long)bad,
		      (long long)(bad >= 0 ? x[bad] : 0),
		      (long long)(bad >= 0 ? y[bad] : 0), vocab);
	free(x);
	free(y);
}

START_TEST(test_synthetic_determinism)
{
	epj_ctx *ctx = tu_ctx();
	uint32_t V = (uint32_t)tu_randint(2, 300);
	uint64_t seed = (uint64_t)tu_randint(0, INT64_MAX);
	epj_corpus *a = epj_corpus_synthetic(ctx, V, seed);
	epj_corpus *b = epj_corpus_synthetic(ctx, V, seed);
	epj_corpus *c = epj_corpus_synthetic(ctx, V, seed + 1);
	tu_ok(ctx, a);
	tu_ok(ctx, b);
	tu_ok(ctx, c);
	ck_assert_uint_eq(epj_corpus_vocab(a), V);
	ck_assert(epj_corpus_entropy_rate(a) == epj_corpus_entropy_rate(b));
	ck_assert(epj_corpus_entropy_rate(a) != epj_corpus_entropy_rate(c));
	epj_corpus *fa = epj_corpus_fork(ctx, a, 0);
	int64_t B = tu_randint(1, 6), T = tu_randint(1, 40) + 40;
	int64_t carry_a = -1, carry_c = -1;
	for (int step = 0; step < 3; step++) {
		epj_tensor *ia, *la, *ib, *lb, *ic, *lc;
		ck_assert_int_eq(epj_corpus_next_batch(ctx, a, B, T, &ia, &la),
				 EPJ_OK);
		ck_assert_int_eq(epj_corpus_next_batch(ctx, b, B, T, &ib, &lb),
				 EPJ_OK);
		ck_assert_int_eq(epj_corpus_next_batch(ctx, c, B, T, &ic, &lc),
				 EPJ_OK);
		check_batch(ia, la, B, T, V, &carry_a);
		check_batch(ic, lc, B, T, V, &carry_c);
		assert_batches_equal(ia, ib, true);
		assert_batches_equal(la, lb, true);
		if (V > 2)
			assert_batches_equal(la, lc, false);
		epj_tensor_free(ia);
		epj_tensor_free(la);
		epj_tensor_free(ib);
		epj_tensor_free(lb);
		epj_tensor_free(ic);
		epj_tensor_free(lc);
	}
	/* A fork of stream 0 replays the stream from its start (made after
	 * a was read from: independent of a's position); stream 1 is
	 * another path, the same for two forks. */
	epj_corpus *a2 = epj_corpus_synthetic(ctx, V, seed);
	epj_corpus *f1 = epj_corpus_fork(ctx, a, 1);
	epj_corpus *f1b = epj_corpus_fork(ctx, a2, 1);
	epj_corpus *f0 = epj_corpus_fork(ctx, a, 0);
	tu_ok(ctx, f1);
	ck_assert(epj_corpus_entropy_rate(f1) == epj_corpus_entropy_rate(a));
	epj_tensor *i0, *l0, *i2, *l2, *j1, *m1, *k1, *n1, *if0, *lf0;
	ck_assert_int_eq(epj_corpus_next_batch(ctx, f0, B, T, &i0, &l0),
			 EPJ_OK);
	ck_assert_int_eq(epj_corpus_next_batch(ctx, a2, B, T, &i2, &l2),
			 EPJ_OK);
	ck_assert_int_eq(epj_corpus_next_batch(ctx, fa, B, T, &if0, &lf0),
			 EPJ_OK);
	ck_assert_int_eq(epj_corpus_next_batch(ctx, f1, B, T, &j1, &m1),
			 EPJ_OK);
	ck_assert_int_eq(epj_corpus_next_batch(ctx, f1b, B, T, &k1, &n1),
			 EPJ_OK);
	assert_batches_equal(l0, l2, true);
	assert_batches_equal(lf0, l2, true);
	assert_batches_equal(m1, n1, true);
	if (V > 2)
		assert_batches_equal(m1, l0, false);
	epj_tensor *all[] = { i0, l0, i2, l2, j1, m1, k1, n1, if0, lf0 };
	for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
		epj_tensor_free(all[i]);
	epj_corpus *cs[] = { a, b, c, fa, a2, f1, f1b, f0 };
	for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
		epj_corpus_free(cs[i]);
	epj_ctx_free(ctx);
}
END_TEST

/* The computed stationary distribution and entropy rate against a long
 * sample: unigram frequencies vs pi (total variation), plug-in conditional
 * entropy  -1/N sum log(n(a,b) / n(a))  vs H.  With N = 2^19 transitions
 * over at most 41^2 cells the plug-in bias (cells / 2N < 0.2%) and the
 * sampling noise (~0.3%) are far inside the 3% tolerance. */
START_TEST(test_synthetic_entropy)
{
	epj_ctx *ctx = tu_ctx();
	uint32_t V = (uint32_t)tu_randint(3, 42);
	uint64_t seed = (uint64_t)tu_randint(0, INT64_MAX);
	epj_corpus *c = epj_corpus_synthetic(ctx, V, seed);
	tu_ok(ctx, c);
	const double *pi = epj_corpus_stationary(c);
	ck_assert_ptr_nonnull(pi);
	double sum = 0;
	for (uint32_t s = 0; s < V; s++) {
		ck_assert(pi[s] > 0);
		sum += pi[s];
	}
	ck_assert_double_eq_tol(sum, 1.0, 1e-12);
	double H = epj_corpus_entropy_rate(c);
	ck_assert_msg(H > 0 && H < log((double)V), "H = %g, V = %u", H, V);

	int64_t B = 64, T = 8192; /* 2^19 transitions */
	uint64_t *pair = calloc((size_t)V * V, sizeof *pair);
	uint64_t *from = calloc(V, sizeof *from);
	ck_assert_ptr_nonnull(pair);
	ck_assert_ptr_nonnull(from);
	epj_tensor *in, *lab;
	ck_assert_int_eq(epj_corpus_next_batch(ctx, c, B, T, &in, &lab),
			 EPJ_OK);
	int64_t carry = -1;
	check_batch(in, lab, B, T, V, &carry);
	int64_t *x = i64_values(in), *y = i64_values(lab);
	uint64_t N = (uint64_t)(B * T);
	for (uint64_t i = 0; i < N; i++) {
		pair[x[i] * V + y[i]]++;
		from[x[i]]++;
	}
	double tv = 0;
	for (uint32_t s = 0; s < V; s++)
		tv += fabs((double)from[s] / N - pi[s]);
	tv /= 2;
	ck_assert_msg(tv < 0.02, "unigram TV distance %g from pi (V %u)", tv,
		      V);
	double h = 0;
	for (uint32_t a = 0; a < V; a++)
		for (uint32_t b = 0; b < V; b++) {
			uint64_t k = pair[a * V + b];
			if (k)
				h -= (double)k * log((double)k / from[a]);
		}
	h /= N;
	ck_assert_msg(fabs(h - H) < 0.03 * H,
		      "empirical conditional entropy %.5f vs entropy rate "
		      "%.5f (V %u, seed %llu)",
		      h, H, V, (unsigned long long)seed);
	free(x);
	free(y);
	free(pair);
	free(from);
	epj_tensor_free(in);
	epj_tensor_free(lab);
	epj_corpus_free(c);
	epj_ctx_free(ctx);
}
END_TEST

/* A learnable default: at the trainer's vocab sizes the floor is well
 * below the uniform log V (so the loss curve has somewhere to go). */
START_TEST(test_synthetic_floor_range)
{
	epj_ctx *ctx = tu_ctx();
	static const uint32_t vs[] = { 64, 256, 1000 };
	for (size_t i = 0; i < sizeof vs / sizeof vs[0]; i++) {
		epj_corpus *c = epj_corpus_synthetic(
		    ctx, vs[i], (uint64_t)tu_randint(0, 1000));
		tu_ok(ctx, c);
		double H = epj_corpus_entropy_rate(c);
		ck_assert_msg(H > 0.3 && H < 0.5 * log((double)vs[i]),
			      "V %u: H %g", vs[i], H);
		epj_corpus_free(c);
	}
	ck_assert_ptr_null(epj_corpus_synthetic(ctx, 1, 0));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "corpus_synthetic"));
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_batch_errors)
{
	epj_ctx *ctx = tu_ctx();
	epj_corpus *c = epj_corpus_synthetic(ctx, 11, 3);
	tu_ok(ctx, c);
	epj_tensor *in = (epj_tensor *)(uintptr_t)1, *lab = in;
	ck_assert_int_eq(epj_corpus_next_batch(ctx, c, 0, 5, &in, &lab),
			 EPJ_ERR_INVALID);
	ck_assert_ptr_null(in);
	ck_assert_ptr_null(lab);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "corpus_next_batch"));
	ck_assert_int_eq(epj_corpus_next_batch(ctx, c, 3, -1, &in, &lab),
			 EPJ_ERR_INVALID);
	ck_assert_int_eq(
	    epj_corpus_next_batch(ctx, c, INT64_MAX / 2, 4, &in, &lab),
	    EPJ_ERR_INVALID);
	epj_corpus_free(c);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- file corpus ------------------------------------------------------------
 */

START_TEST(test_file_corpus)
{
	epj_ctx *ctx = tu_ctx();
	tdir d;
	tdir_new(&d, "c.tok");
	uint64_t n = (uint64_t)tu_randint(2, 60);
	uint32_t *tok = malloc(n * sizeof *tok);
	ck_assert_ptr_nonnull(tok);
	uint32_t mx = 0;
	for (uint64_t i = 0; i < n; i++) {
		tok[i] = (uint32_t)tu_randint(0, 1000);
		mx = tok[i] > mx ? tok[i] : mx;
	}
	ck_assert_int_eq(epj_tokens_write(ctx, d.path, tok, n, 0, false),
			 EPJ_OK);
	epj_corpus *c = epj_corpus_from_tokens(ctx, d.path);
	tu_ok(ctx, c);
	ck_assert_uint_eq(epj_corpus_vocab(c), mx + 1);
	ck_assert(isnan(epj_corpus_entropy_rate(c)));
	ck_assert_ptr_null(epj_corpus_stationary(c));
	/* Sequential windows of T + 1 tokens advancing by T, wrapping. */
	int64_t B = tu_randint(1, 5), T = tu_randint(1, 70);
	uint64_t pos = 0;
	for (int step = 0; step < 4; step++) {
		epj_tensor *in, *lab;
		ck_assert_int_eq(epj_corpus_next_batch(ctx, c, B, T, &in, &lab),
				 EPJ_OK);
		int64_t *x = i64_values(in), *y = i64_values(lab);
		for (int64_t b = 0; b < B; b++) {
			for (int64_t t = 0; t < T; t++) {
				ck_assert_int_eq(x[b * T + t],
						 tok[(pos + (uint64_t)t) % n]);
				ck_assert_int_eq(
				    y[b * T + t],
				    tok[(pos + (uint64_t)t + 1) % n]);
			}
			pos = (pos + (uint64_t)T) % n;
		}
		free(x);
		free(y);
		epj_tensor_free(in);
		epj_tensor_free(lab);
	}
	/* A fork restarts at token 0. */
	epj_corpus *f = epj_corpus_fork(ctx, c, 5);
	epj_tensor *in, *lab;
	ck_assert_int_eq(epj_corpus_next_batch(ctx, f, 1, 1, &in, &lab),
			 EPJ_OK);
	int64_t *x = i64_values(in), *y = i64_values(lab);
	ck_assert_int_eq(x[0], tok[0]);
	ck_assert_int_eq(y[0], tok[1]);
	free(x);
	free(y);
	epj_tensor_free(in);
	epj_tensor_free(lab);
	epj_corpus_free(f);
	epj_corpus_free(c);

	/* The file's vocab_size is the corpus vocab; one token is too few. */
	ck_assert_int_eq(epj_tokens_write(ctx, d.path, tok, n, 5000, true),
			 EPJ_OK);
	c = epj_corpus_from_tokens(ctx, d.path);
	tu_ok(ctx, c);
	ck_assert_uint_eq(epj_corpus_vocab(c), 5000);
	epj_corpus_free(c);
	ck_assert_int_eq(epj_tokens_write(ctx, d.path, tok, 1, 0, false),
			 EPJ_OK);
	ck_assert_ptr_null(epj_corpus_from_tokens(ctx, d.path));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), d.path));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "at least 2"));
	free(tok);
	tdir_free(&d, NULL, 0);
	ck_assert_ptr_null(epj_corpus_from_tokens(ctx, d.path));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_IO);
	epj_ctx_free(ctx);
}
END_TEST

/* epj_corpus_skip(n, B, T) leaves a stream exactly where n batches of
 * [B, T] would: the next batch is the same, for the synthetic corpus and
 * a token file (odd sizes, wrapping several times); a skip of 2^40 rows
 * of a token file is instant (constant time); bad arguments are refused. */
static void expect_same_next(epj_ctx *ctx, epj_corpus *a, epj_corpus *b,
			     int64_t B, int64_t T)
{
	epj_tensor *ia, *la, *ib, *lb;
	ck_assert_int_eq(epj_corpus_next_batch(ctx, a, B, T, &ia, &la), EPJ_OK);
	ck_assert_int_eq(epj_corpus_next_batch(ctx, b, B, T, &ib, &lb), EPJ_OK);
	int64_t *x = i64_values(ia), *y = i64_values(ib);
	int64_t *u = i64_values(la), *v = i64_values(lb);
	for (int64_t i = 0; i < B * T; i++) {
		ck_assert_int_eq(x[i], y[i]);
		ck_assert_int_eq(u[i], v[i]);
	}
	free(x);
	free(y);
	free(u);
	free(v);
	epj_tensor_free(ia);
	epj_tensor_free(la);
	epj_tensor_free(ib);
	epj_tensor_free(lb);
}

START_TEST(test_corpus_skip)
{
	epj_ctx *ctx = tu_ctx();
	tdir d;
	tdir_new(&d, "s.tok");
	uint64_t n = (uint64_t)tu_randint(2, 50);
	uint32_t *tok = malloc(n * sizeof *tok);
	ck_assert_ptr_nonnull(tok);
	for (uint64_t i = 0; i < n; i++)
		tok[i] = (uint32_t)tu_randint(0, 300);
	ck_assert_int_eq(epj_tokens_write(ctx, d.path, tok, n, 0, false),
			 EPJ_OK);
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	for (int kind = 0; kind < 2; kind++) {
		epj_corpus *a = kind ? epj_corpus_from_tokens(ctx, d.path)
				     : epj_corpus_synthetic(ctx, 13, seed);
		epj_corpus *b = kind ? epj_corpus_from_tokens(ctx, d.path)
				     : epj_corpus_synthetic(ctx, 13, seed);
		tu_ok(ctx, a);
		tu_ok(ctx, b);
		int64_t B = tu_randint(1, 4), T = tu_randint(1, 37);
		int64_t k = tu_randint(0, 9);
		for (int64_t i = 0; i < k; i++) {
			epj_tensor *in, *lab;
			ck_assert_int_eq(
			    epj_corpus_next_batch(ctx, a, B, T, &in, &lab),
			    EPJ_OK);
			epj_tensor_free(in);
			epj_tensor_free(lab);
		}
		ck_assert_int_eq(epj_corpus_skip(ctx, b, k, B, T), EPJ_OK);
		expect_same_next(ctx, a, b, B, T);
		ck_assert_int_eq(epj_corpus_skip(ctx, b, -1, B, T),
				 EPJ_ERR_INVALID);
		ck_assert_int_eq(epj_corpus_skip(ctx, b, 1, 0, T),
				 EPJ_ERR_INVALID);
		ck_assert_int_eq(epj_corpus_skip(ctx, b, INT64_MAX, 2, T),
				 EPJ_ERR_INVALID);
		epj_ctx_clear_error(ctx);
		epj_corpus_free(a);
		epj_corpus_free(b);
	}
	/* a token file: 2^40 rows of T tokens land at (2^40 * T) mod n */
	epj_corpus *c = epj_corpus_from_tokens(ctx, d.path);
	tu_ok(ctx, c);
	int64_t T = tu_randint(1, 9);
	ck_assert_int_eq(epj_corpus_skip(ctx, c, (int64_t)1 << 40, 1, T),
			 EPJ_OK);
	unsigned __int128 adv = ((unsigned __int128)1 << 40) * (uint64_t)T;
	uint64_t pos = (uint64_t)(adv % n);
	epj_tensor *in, *lab;
	ck_assert_int_eq(epj_corpus_next_batch(ctx, c, 1, 1, &in, &lab),
			 EPJ_OK);
	int64_t *x = i64_values(in);
	ck_assert_int_eq(x[0], tok[pos]);
	free(x);
	epj_tensor_free(in);
	epj_tensor_free(lab);
	epj_corpus_free(c);
	free(tok);
	tdir_free(&d, NULL, 0);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_data_suite(void)
{
	Suite *s = suite_create("data");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_tokens_roundtrip);
	tcase_add_test(tc, test_tokens_write_errors);
	tcase_add_test(tc, test_tokens_malformed);
	tcase_add_test(tc, test_tokens_from_text);
	tcase_add_test(tc, test_synthetic_determinism);
	tcase_add_test(tc, test_synthetic_entropy);
	tcase_add_test(tc, test_synthetic_floor_range);
	tcase_add_test(tc, test_batch_errors);
	tcase_add_test(tc, test_file_corpus);
	tcase_add_test(tc, test_corpus_skip);
	suite_add_tcase(s, tc);
	return s;
}
