/* check_data.c -- token files, the text converter and corpora.
 *
 * Token files are checked against header bytes built by hand from the spec
 * (doc/formats.md) and every malformed variant must fail with a message
 * naming the file.  The synthetic corpus is checked statistically against
 * its own claims: its stationary distribution against empirical unigram
 * frequencies, its entropy rate against the empirical conditional entropy
 * (plug-in estimate from transition counts) of a long sample.
 *
 * Token datasets (the "dataset" case) are checked against fixtures that
 * tools/epjit-tokenize and numpy wrote (t/data/dataset, with the ids the
 * tokenizer itself produced), against files built here byte by byte from
 * the Megatron and .npy layouts (every dtype code; hostile headers), and
 * their samples against the documents: every sample a window of the packed
 * documents, one epoch of a single document exactly the windows j*T in a
 * seeded order, blend shares within one sample of their weights, skip then
 * read equal to reading straight on.  A .idx's pairing record is built here
 * from its spec, and files are rewritten and truncated between the batches
 * of an open dataset (an error status, never a signal).
 */
#include "check_util.h"

#include <errno.h>
#include <fcntl.h>
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

/* ---- token datasets (runtime/dataset.c) ----------------------------------
 */

/* Fails unless got is the status want and ctx's error holds the needles. */
static void expect_status(epj_ctx *ctx, epj_status got, epj_status want,
			  const char *const *needles, int n)
{
	ck_assert_msg(got == want, "status %s, want %s: %s",
		      epj_status_name(got), epj_status_name(want),
		      epj_ctx_error(ctx));
	tu_assert_ctx_error(ctx, want, needles, n);
}

/* The rows of a fixture's NAME.expected: lines of ids (malloc'ed, flat;
 * rowoff[r] .. rowoff[r + 1] is row r). */
typedef struct rows {
	int64_t *v;
	int64_t rowoff[64];
	int n;
} rows;

static rows read_rows(const char *name)
{
	char p[512];
	snprintf(p, sizeof p, "%s/t/data/dataset/%s", tu_srcdir(), name);
	size_t sz;
	char *txt = (char *)tu_read_file(p, &sz);
	rows r = { malloc((sz + 1) * sizeof(int64_t)), { 0 }, 0 };
	ck_assert_ptr_nonnull(r.v);
	int64_t k = 0;
	char *save = NULL;
	char *buf = malloc(sz + 1);
	memcpy(buf, txt, sz);
	buf[sz] = '\0';
	for (char *line = strtok_r(buf, "\n", &save); line;
	     line = strtok_r(NULL, "\n", &save)) {
		ck_assert_int_lt(r.n, 63);
		char *e;
		for (char *q = line;; q = e) {
			long long v = strtoll(q, &e, 10);
			if (e == q)
				break;
			r.v[k++] = v;
		}
		r.rowoff[++r.n] = k;
	}
	free(buf);
	free(txt);
	return r;
}

static void fixture_path(char *p, size_t n, const char *name)
{
	snprintf(p, n, "%s/t/data/dataset/%s", tu_srcdir(), name);
}

/* docs, opened, hold exactly the rows of the .expected file */
static void check_docs_equal(const char *file, const char *expected)
{
	char p[512];
	fixture_path(p, sizeof p, file);
	epj_ctx *ctx = tu_ctx();
	epj_docs *d;
	ck_assert_msg(epj_docs_open(ctx, p, &d) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	rows r = read_rows(expected);
	ck_assert_uint_eq(epj_docs_count(d), (uint64_t)r.n);
	ck_assert_uint_eq(epj_docs_tokens(d), (uint64_t)r.rowoff[r.n]);
	for (int i = 0; i < r.n; i++) {
		uint64_t len = (uint64_t)(r.rowoff[i + 1] - r.rowoff[i]);
		ck_assert_uint_eq(epj_docs_len(d, (uint64_t)i), len);
		int64_t *x = malloc((len + 1) * sizeof *x);
		ck_assert_int_eq(epj_docs_read(ctx, d, (uint64_t)i, 0, len, x),
				 EPJ_OK);
		for (uint64_t j = 0; j < len; j++)
			ck_assert_msg(x[j] == r.v[r.rowoff[i] + (int64_t)j],
				      "%s doc %d token %llu: %lld, expected "
				      "%lld",
				      file, i, (unsigned long long)j,
				      (long long)x[j],
				      (long long)r.v[r.rowoff[i] + (int64_t)j]);
		free(x);
	}
	/* past the end of a document: refused */
	int64_t x[2];
	uint64_t len0 = epj_docs_len(d, 0);
	expect_status(ctx, epj_docs_read(ctx, d, 0, len0, 1, x), EPJ_ERR_INDEX,
		      TU_STRS("out of range"));
	expect_status(ctx, epj_docs_read(ctx, d, (uint64_t)r.n, 0, 1, x),
		      EPJ_ERR_INDEX, TU_STRS("out of range"));
	free(r.v);
	epj_docs_free(d);
	epj_ctx_free(ctx);
}

START_TEST(test_dataset_fixtures)
{
	/* written by tools/epjit-tokenize; ids recorded from the tokenizer */
	check_docs_equal("docs", "docs.expected");
	/* written by numpy: 1-D (one document) and 2-D, versions 1, 2, 3 */
	check_docs_equal("stream_u2.npy", "stream_u2.expected");
	check_docs_equal("rows_i8.npy", "rows_i8.expected");
	check_docs_equal("rows_u4.npy", "rows_u4.expected");
	check_docs_equal("stream_i4.npy", "stream_i4.expected");
}
END_TEST

/* Writes dir/name.bin and dir/name.idx: n sequences of lens[i] tokens
 * vals (flat) in Megatron dtype `code`, one document per sequence. */
static void write_mm(const char *dir, const char *name, int code,
		     const int32_t *lens, int n, const int64_t *vals)
{
	static const int esz[9] = { 0, 1, 1, 2, 4, 8, 8, 4, 2 };
	int s = esz[code];
	size_t total = 0;
	for (int i = 0; i < n; i++)
		total += (size_t)lens[i];
	unsigned char *bin = calloc(total * (size_t)s + 1, 1);
	ck_assert_ptr_nonnull(bin);
	for (size_t i = 0; i < total; i++) {
		if (code == 6) {
			double v = (double)vals[i];
			memcpy(bin + 8 * i, &v, 8);
		} else if (code == 7) {
			float v = (float)vals[i];
			memcpy(bin + 4 * i, &v, 4);
		} else {
			for (int b = 0; b < s; b++)
				bin[i * (size_t)s + (size_t)b] =
				    (unsigned char)((uint64_t)vals[i] >>
						    (8 * b));
		}
	}
	size_t isz = 34 + 12 * (size_t)n + 8 * ((size_t)n + 1);
	unsigned char *idx = calloc(isz, 1);
	memcpy(idx, "MMIDIDX\0\0", 9);
	le64(idx + 9, 1);
	idx[17] = (unsigned char)code;
	le64(idx + 18, (uint64_t)n);
	le64(idx + 26, (uint64_t)n + 1);
	uint64_t ptr = 0;
	for (int i = 0; i < n; i++) {
		le32(idx + 34 + 4 * i, (uint32_t)lens[i]);
		le64(idx + 34 + 4 * n + 8 * i, ptr);
		ptr += (uint64_t)lens[i] * (uint64_t)s;
	}
	for (int i = 0; i <= n; i++)
		le64(idx + 34 + 12 * n + 8 * i, (uint64_t)i);
	char p[512];
	snprintf(p, sizeof p, "%s/%s.bin", dir, name);
	tu_write_file(p, bin, total * (size_t)s);
	snprintf(p, sizeof p, "%s/%s.idx", dir, name);
	tu_write_file(p, idx, isz);
	free(bin);
	free(idx);
}

START_TEST(test_dataset_dtypes)
{
	char *dir = tu_tmpdir_new("dtypes");
	char prefix[512];
	snprintf(prefix, sizeof prefix, "%s/d", dir);
	/* the extremes of each dtype, and random values in its range */
	static const int64_t lo[9] = { 0,	  0, -128, -32768, INT32_MIN,
				       INT64_MIN, 0, 0,	   0 };
	static const int64_t hi[9] = { 0,	  255, 127, 32767, INT32_MAX,
				       INT64_MAX, 0,   0,   65535 };
	for (int code = 1; code <= 8; code++) {
		int32_t lens[3] = { 3, 0, (int32_t)tu_randint(1, 40) };
		int64_t v[64];
		int n = lens[0] + lens[2];
		uint64_t range = (uint64_t)hi[code] - (uint64_t)lo[code] + 1;
		for (int i = 0; i < n; i++) {
			uint64_t u = (uint64_t)tu_randint(0, INT64_MAX) << 1 ^
				     (uint64_t)tu_randint(0, 2);
			v[i] = code == 6 || code == 7 ? tu_randint(0, 1000)
			       : range == 0
				   ? (int64_t)u
				   : (int64_t)((uint64_t)lo[code] + u % range);
		}
		if (code != 6 && code != 7) {
			v[0] = lo[code];
			v[1] = hi[code];
		}
		write_mm(dir, "d", code, lens, 3, v);
		epj_ctx *ctx = tu_ctx();
		epj_docs *d = NULL;
		epj_status st = epj_docs_open(ctx, prefix, &d);
		if (code == 6 || code == 7) {
			expect_status(
			    ctx, st, EPJ_ERR_FORMAT,
			    TU_STRS("d.idx", "floating-point",
				    code == 6 ? "float64" : "float32"));
			epj_ctx_free(ctx);
			continue;
		}
		ck_assert_msg(st == EPJ_OK, "code %d: %s", code,
			      epj_ctx_error(ctx));
		ck_assert_uint_eq(epj_docs_count(d), 3);
		ck_assert_uint_eq(epj_docs_len(d, 1), 0);
		int64_t x[64];
		ck_assert_int_eq(epj_docs_read(ctx, d, 0, 0, 3, x), EPJ_OK);
		ck_assert_int_eq(
		    epj_docs_read(ctx, d, 2, 0, (uint64_t)lens[2], x + 3),
		    EPJ_OK);
		for (int i = 0; i < n; i++)
			ck_assert_msg(
			    x[i] == v[i], "code %d token %d: %lld, wrote %lld",
			    code, i, (long long)x[i], (long long)v[i]);
		epj_docs_free(d);
		epj_ctx_free(ctx);
	}
	/* codes outside 1..8 */
	for (int code = 0; code <= 9; code += 9) {
		int32_t lens[1] = { 2 };
		int64_t v[2] = { 1, 2 };
		write_mm(dir, "d", 1, lens, 1, v);
		char p[600];
		snprintf(p, sizeof p, "%s.idx", prefix);
		size_t n;
		unsigned char *b = tu_read_file(p, &n);
		b[17] = (unsigned char)code;
		tu_write_file(p, b, n);
		free(b);
		epj_ctx *ctx = tu_ctx();
		epj_docs *d = NULL;
		expect_status(ctx, epj_docs_open(ctx, prefix, &d),
			      EPJ_ERR_FORMAT,
			      TU_STRS("d.idx", "unknown dtype code"));
		epj_ctx_free(ctx);
	}
	tu_tmpdir_free(dir);
}
END_TEST

/* Opens prefix, expecting EPJ_ERR_FORMAT (or IO) with both needles. */
static void expect_docs_error(const char *path, epj_status st, const char *a,
			      const char *b, const char *what)
{
	epj_ctx *ctx = tu_ctx();
	epj_docs *d = NULL;
	epj_status got = epj_docs_open(ctx, path, &d);
	ck_assert_msg(got == st && !d, "%s: status %d, want %d (%s)", what,
		      (int)got, (int)st, epj_ctx_error(ctx));
	ck_assert_msg(strstr(epj_ctx_error(ctx), a) &&
			  strstr(epj_ctx_error(ctx), b),
		      "%s: message '%s' lacks '%s' / '%s'", what,
		      epj_ctx_error(ctx), a, b);
	epj_ctx_free(ctx);
}

START_TEST(test_dataset_megatron_hostile)
{
	char *dir = tu_tmpdir_new("mmhostile");
	char prefix[512], ip[600], bp[600];
	snprintf(prefix, sizeof prefix, "%s/h", dir);
	snprintf(ip, sizeof ip, "%s.idx", prefix);
	snprintf(bp, sizeof bp, "%s.bin", prefix);
	int32_t lens[3] = { 4, 2, 5 };
	int64_t v[11];
	for (int i = 0; i < 11; i++)
		v[i] = tu_randint(0, 50);
	write_mm(dir, "h", 8, lens, 3, v);
	size_t n;
	unsigned char *good = tu_read_file(ip, &n);
	unsigned char *b = malloc(n + 16);
	const size_t P = 34 + 12, D = 34 + 36; /* pointers, doc indices */

	/* every truncation of the index is refused, none crashes */
	for (size_t k = 0; k < n; k++) {
		tu_write_file(ip, good, k);
		expect_docs_error(prefix, EPJ_ERR_FORMAT, "h.idx",
				  k < 34 ? "truncated" : "", "truncated idx");
	}
#define MUTATE(stmt, a, bb, what)                                              \
	do {                                                                   \
		memcpy(b, good, n);                                            \
		stmt;                                                          \
		tu_write_file(ip, b, n);                                       \
		expect_docs_error(prefix, EPJ_ERR_FORMAT, a, bb, what);        \
	} while (0)
	MUTATE(b[2] = 'X', "h.idx", "bad magic", "magic");
	MUTATE(le64(b + 9, 2), "h.idx", "unsupported version 2", "version");
	MUTATE(le64(b + 18, 1000), "h.idx", "truncated", "sequence count");
	MUTATE(le64(b + 18, UINT64_MAX / 4), "h.idx", "truncated",
	       "huge sequence count");
	MUTATE(le64(b + 26, 99), "h.idx", "truncated", "document count");
	MUTATE(le64(b + 26, 1), "h.idx", "", "too few doc indices");
	MUTATE(le32(b + 34 + 4, (uint32_t)-3), "h.idx", "negative length",
	       "negative length");
	MUTATE(le64(b + P + 8, (uint64_t)-8), "h.idx", "negative pointer",
	       "negative pointer");
	MUTATE(le64(b + P + 16, 9), "h.idx", "not a multiple", "odd pointer");
	/* sequence 2 pointing past the .bin, or ending past it */
	MUTATE(le64(b + P + 16, 1 << 20), "h.bin", "outside", "pointer > bin");
	MUTATE(le32(b + 34 + 8, 6), "h.bin", "outside", "length past bin");
	/* sequences must lie end to end and fill the .bin (Megatron's
	 * layout): sequence 1 one token shorter leaves a gap before 2,
	 * sequence 2 one token shorter leaves the .bin's last token over */
	MUTATE(le32(b + 34 + 4, 1), "h.idx", "gap of 2 bytes", "gap");
	MUTATE(le32(b + 34 + 8, 4), "h.bin", "2 trailing bytes", "short");
	/* unsorted: sequence 1 before sequence 0's end */
	MUTATE(le64(b + P + 8, 2), "h.idx", "sorted", "unsorted pointers");
	MUTATE(le64(b + D, 1), "h.idx", "from 0", "doc index start");
	MUTATE(le64(b + D + 24, 2), "h.idx", "from 0", "doc index end");
	MUTATE(le64(b + D + 8, 3), "h.idx", "below", "doc index order");
#undef MUTATE
	/* trailing bytes: n mode bytes are Megatron's; anything else is not */
	memcpy(b, good, n);
	memset(b + n, 0, 16);
	tu_write_file(ip, b, n + 3);
	{
		epj_ctx *ctx = tu_ctx();
		epj_docs *d = NULL;
		ck_assert_msg(epj_docs_open(ctx, prefix, &d) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		epj_docs_free(d);
		epj_ctx_free(ctx);
	}
	tu_write_file(ip, b, n + 5);
	expect_docs_error(prefix, EPJ_ERR_FORMAT, "h.idx", "after the document",
			  "trailing");
	/* a truncated .bin */
	tu_write_file(ip, good, n);
	size_t bn;
	unsigned char *bin0 = tu_read_file(bp, &bn);
	unsigned char *bin = malloc(bn + 1);
	memcpy(bin, bin0, bn);
	free(bin0);
	tu_write_file(bp, bin, bn - 1);
	expect_docs_error(prefix, EPJ_ERR_FORMAT, "h.bin", "outside",
			  "short bin");
	bin[bn] = 0;
	tu_write_file(bp, bin, bn + 1);
	expect_docs_error(prefix, EPJ_ERR_FORMAT, "h.bin", "1 trailing byte",
			  "long bin");
	unlink(bp);
	expect_docs_error(prefix, EPJ_ERR_IO, "h.bin", "cannot open",
			  "missing bin");
	tu_write_file(bp, bin, bn);
	unlink(ip);
	expect_docs_error(prefix, EPJ_ERR_IO, "h.idx", "cannot open",
			  "missing idx");
	/* a FIFO is refused, not waited on */
	ck_assert_int_eq(mkfifo(ip, 0600), 0);
	alarm(10);
	expect_docs_error(prefix, EPJ_ERR_IO, "h.idx", "not a regular file",
			  "FIFO");
	alarm(0);
	free(bin);
	free(b);
	free(good);
	tu_tmpdir_free(dir);
}
END_TEST

/* The pairing record of doc/formats.md for a .bin of n bytes: "EPJPAIR1",
 * n, FNV-1a 64 of the whole .bin up to 64 blocks of 4096 bytes, else of the
 * 64 blocks at k (n - 4096) / 63, and 8 zero bytes. */
static void pair_record(unsigned char r[32], const unsigned char *bin,
			uint64_t n)
{
	uint64_t h = 0xcbf29ce484222325ull;
	for (uint64_t k = 0; k < (n <= 64 * 4096 ? 1 : 64); k++) {
		uint64_t off = n <= 64 * 4096 ? 0 : k * (n - 4096) / 63;
		uint64_t len = n <= 64 * 4096 ? n : 4096;
		for (uint64_t i = 0; i < len; i++)
			h = (h ^ bin[off + i]) * 0x100000001b3ull;
	}
	memcpy(r, "EPJPAIR1", 8);
	le64(r + 8, n);
	le64(r + 16, h);
	le64(r + 24, 0);
}

/* Opens prefix, expecting success, and reads its document 0 back. */
static void expect_docs_ok(const char *prefix, const int64_t *v, int32_t len0,
			   const char *what)
{
	epj_ctx *ctx = tu_ctx();
	epj_docs *d = NULL;
	ck_assert_msg(epj_docs_open(ctx, prefix, &d) == EPJ_OK, "%s: %s", what,
		      epj_ctx_error(ctx));
	int64_t *x = malloc((size_t)len0 * sizeof *x);
	ck_assert_int_eq(epj_docs_read(ctx, d, 0, 0, (uint64_t)len0, x),
			 EPJ_OK);
	ck_assert_msg(!memcmp(x, v, (size_t)len0 * sizeof *x), "%s", what);
	free(x);
	epj_docs_free(d);
	epj_ctx_free(ctx);
}

START_TEST(test_dataset_pairing)
{
	/* A .idx ending with a pairing record accepts only the .bin it
	 * describes: another size or another fingerprint is refused, naming
	 * both files; the record may follow Megatron's mode bytes. */
	char *dir = tu_tmpdir_new("pair");
	char prefix[512], ip[600], bp[600];
	snprintf(prefix, sizeof prefix, "%s/p", dir);
	snprintf(ip, sizeof ip, "%s.idx", prefix);
	snprintf(bp, sizeof bp, "%s.bin", prefix);
	for (int big = 0; big < 2; big++) {
		/* small: hashed whole; big: 150,000 uint16 tokens, sampled */
		int32_t lens[3] = { big ? 50000 : 7, big ? 60000 : 3,
				    big ? 40000 : 9 };
		int nv = lens[0] + lens[1] + lens[2];
		int64_t *v = malloc((size_t)nv * sizeof *v);
		for (int i = 0; i < nv; i++)
			v[i] = tu_randint(0, 60000);
		write_mm(dir, "p", 8, lens, 3, v);
		size_t in, bn;
		unsigned char *idx = tu_read_file(ip, &in);
		unsigned char *bin = tu_read_file(bp, &bn);
		unsigned char *pi = malloc(in + 3 + 32);
		memcpy(pi, idx, in);
		pair_record(pi + in, bin, bn);
		tu_write_file(ip, pi, in + 32);
		expect_docs_ok(prefix, v, lens[0], "paired");
		/* after 3 mode bytes */
		memset(pi + in, 0, 3);
		pair_record(pi + in + 3, bin, bn);
		tu_write_file(ip, pi, in + 3 + 32);
		expect_docs_ok(prefix, v, lens[0], "modes + pairing");
		/* one byte of the .bin changed, in a hashed block */
		uint64_t at =
		    big ? 10 * ((uint64_t)bn - 4096) / 63 + 7 : bn - 1;
		bin[at] ^= 1;
		tu_write_file(bp, bin, bn);
		expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.bin': fingerprint",
				  "p.idx' was written with", "changed byte");
		bin[at] ^= 1;
		tu_write_file(bp, bin, bn);
		expect_docs_ok(prefix, v, lens[0], "restored");
		if (big) {
			/* a byte outside every sampled block is not seen
			 * (the documented limit of the check) */
			bin[4096 + 1] ^= 1;
			tu_write_file(bp, bin, bn);
			epj_ctx *ctx = tu_ctx();
			epj_docs *d = NULL;
			ck_assert_msg(epj_docs_open(ctx, prefix, &d) == EPJ_OK,
				      "%s", epj_ctx_error(ctx));
			epj_docs_free(d);
			epj_ctx_free(ctx);
			bin[4096 + 1] ^= 1;
			tu_write_file(bp, bin, bn);
		}
		/* the record's size field says another size */
		le64(pi + in + 3 + 8, (uint64_t)bn + 2);
		tu_write_file(ip, pi, in + 3 + 32);
		expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.bin'",
				  "written with a .bin of", "record size");
		/* a 32-byte tail that is no record; a non-zero reserved word */
		pair_record(pi + in, bin, bn);
		pi[in] = 'X';
		tu_write_file(ip, pi, in + 32);
		expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.idx",
				  "32 bytes after the document indices",
				  "bad record magic");
		pair_record(pi + in, bin, bn);
		pi[in + 31] = 1;
		tu_write_file(ip, pi, in + 32);
		expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.idx",
				  "32 bytes after the document indices",
				  "reserved word");
		free(pi);
		free(bin);
		free(idx);
		free(v);
	}
	/* the fixture's record, written by epjit-tokenize, agrees with this
	 * reader; one token of its .bin changed is refused */
	char fp[512];
	size_t in, bn;
	fixture_path(fp, sizeof fp, "docs.idx");
	unsigned char *idx = tu_read_file(fp, &in);
	fixture_path(fp, sizeof fp, "docs.bin");
	unsigned char *bin = tu_read_file(fp, &bn);
	ck_assert(in > 32 && !memcmp(idx + in - 32, "EPJPAIR1", 8));
	tu_write_file(ip, idx, in);
	tu_write_file(bp, bin, bn);
	int64_t want[1] = { bin[0] | bin[1] << 8 }; /* uint16 */
	expect_docs_ok(prefix, want, 1, "fixture");
	bin[bn / 2] ^= 1;
	tu_write_file(bp, bin, bn);
	expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.bin': fingerprint",
			  "p.idx' was written with", "fixture changed");
	free(bin);
	free(idx);
	tu_tmpdir_free(dir);
}
END_TEST

/* A .npy file: header dict text (padded as numpy does) and data bytes. */
static void write_npy(const char *path, int major, const char *dict,
		      const void *data, size_t n)
{
	size_t hs = major == 1 ? 10 : 12, dl = strlen(dict);
	size_t tot = hs + dl + 1;
	size_t pad = (64 - tot % 64) % 64;
	size_t hl = dl + pad + 1;
	unsigned char *b = malloc(hs + hl + n + 1);
	memcpy(b, "\x93NUMPY", 6);
	b[6] = (unsigned char)major;
	b[7] = 0;
	if (major == 1) {
		b[8] = (unsigned char)hl;
		b[9] = (unsigned char)(hl >> 8);
	} else {
		le32(b + 8, (uint32_t)hl);
	}
	memcpy(b + hs, dict, dl);
	memset(b + hs + dl, ' ', pad);
	b[hs + hl - 1] = '\n';
	if (n)
		memcpy(b + hs + hl, data, n);
	tu_write_file(path, b, hs + hl + n);
	free(b);
}

START_TEST(test_dataset_npy_hostile)
{
	char *dir = tu_tmpdir_new("npyhostile");
	char p[512];
	snprintf(p, sizeof p, "%s/a.npy", dir);
	uint16_t u[12];
	for (int i = 0; i < 12; i++)
		u[i] = (uint16_t)tu_randint(0, 64);
	/* the base case reads back */
	write_npy(p, 1,
		  "{'descr': '<u2', 'fortran_order': False, 'shape': (3, 4), }",
		  u, sizeof u);
	epj_ctx *ctx = tu_ctx();
	epj_docs *d;
	ck_assert_msg(epj_docs_open(ctx, p, &d) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_uint_eq(epj_docs_count(d), 3);
	int64_t x[4];
	ck_assert_int_eq(epj_docs_read(ctx, d, 2, 0, 4, x), EPJ_OK);
	for (int i = 0; i < 4; i++)
		ck_assert_int_eq(x[i], u[8 + i]);
	epj_docs_free(d);
	epj_ctx_free(ctx);
	static const struct {
		const char *dict;
		size_t bytes;
		const char *needle, *what;
	} bad[] = {
		{ "{'descr': '>u2', 'fortran_order': False, 'shape': (12,), }",
		  24, "big-endian", "big-endian" },
		{ "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }",
		  24, "'<f4' is not a token type", "float" },
		{ "{'descr': '|u1', 'fortran_order': False, 'shape': (24,), }",
		  24, "not a token type", "uint8" },
		{ "{'descr': '<u2', 'fortran_order': True, 'shape': (3, 4), }",
		  24, "fortran_order", "fortran" },
		{ "{'descr': '<u2', 'fortran_order': False, 'shape': (2, 3, "
		  "2), "
		  "}",
		  24, "3-D", "3-D" },
		{ "{'descr': '<u2', 'fortran_order': False, 'shape': (), }", 24,
		  "0-D", "0-D" },
		{ "{'descr': '<u2', 'fortran_order': False, 'shape': (13,), }",
		  24, "does not match", "shape > data" },
		{ "{'descr': '<u2', 'fortran_order': False, 'shape': (11,), }",
		  24, "does not match", "shape < data" },
		{ "{'descr': '<u2', 'fortran_order': False, 'shape': "
		  "(4294967296, 4294967296), }",
		  24, "does not match", "overflowing shape" },
		{ "{'descr': '<u2', 'fortran_order': False, 'shape': (0,), }",
		  0, "no tokens", "empty" },
		{ "{'descr': '<u2', 'fortran_order': False}", 24, "malformed",
		  "no shape" },
		{ "{'descr': '<u2', 'fortran_order': Maybe, 'shape': (12,), }",
		  24, "malformed", "bad bool" },
		{ "{'descr': '<u2', 'shape': (12,), 'extra': 1, }", 24,
		  "malformed", "unknown key" },
		{ "['descr', '<u2']", 24, "malformed", "not a dict" },
	};
	for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
		write_npy(p, 1, bad[i].dict, u, bad[i].bytes);
		expect_docs_error(p, EPJ_ERR_FORMAT, "a.npy", bad[i].needle,
				  bad[i].what);
	}
	/* versions: 2.0 and 3.0 read, 4.0 refused */
	const char *ok =
	    "{'descr': '<u2', 'fortran_order': False, 'shape': (12,), }";
	for (int major = 2; major <= 4; major++) {
		write_npy(p, major, ok, u, 24);
		epj_ctx *c = tu_ctx();
		epj_status st = epj_docs_open(c, p, &d);
		if (major < 4) {
			ck_assert_msg(st == EPJ_OK, "%s", epj_ctx_error(c));
			epj_docs_free(d);
		} else {
			expect_status(c, st, EPJ_ERR_FORMAT,
				      TU_STRS("a.npy", "version 4.0"));
		}
		epj_ctx_free(c);
	}
	/* header length past the file; every truncation */
	write_npy(p, 1, ok, u, 24);
	size_t n;
	unsigned char *good = tu_read_file(p, &n);
	for (size_t k = 0; k < n; k++) {
		tu_write_file(p, good, k);
		expect_docs_error(p, EPJ_ERR_FORMAT, "a.npy", "", "truncated");
	}
	good[8] = 0xff;
	good[9] = 0x7f;
	tu_write_file(p, good, n);
	expect_docs_error(p, EPJ_ERR_FORMAT, "a.npy", "runs past", "hlen");
	memcpy(good, "\x93NUMPX", 6);
	tu_write_file(p, good, n);
	expect_docs_error(p, EPJ_ERR_FORMAT, "a.npy", "bad magic", "magic");
	free(good);
	tu_tmpdir_free(dir);
}
END_TEST

/* The loss mask beside a prefix p: p.lossmask (.bin + .idx, uint8) with
 * the token index's lengths, its tie record to p.bin (EPJMASK1: size,
 * fingerprint) and its own pairing record.  Mask value = token is even,
 * so that a batch says what the mask was. */
static void write_mask(const char *dir, const int32_t *lens, int n,
		       const int64_t *tok, int code, bool tie)
{
	int64_t total = 0;
	for (int i = 0; i < n; i++)
		total += lens[i];
	int64_t *m = malloc(sizeof *m * (size_t)(total + 1));
	for (int64_t i = 0; i < total; i++)
		m[i] = tok[i] % 2 == 0;
	write_mm(dir, "p.lossmask", code, lens, n, m);
	free(m);
	char ip[600], bp[600], tb[600];
	snprintf(ip, sizeof ip, "%s/p.lossmask.idx", dir);
	snprintf(bp, sizeof bp, "%s/p.lossmask.bin", dir);
	snprintf(tb, sizeof tb, "%s/p.bin", dir);
	size_t in, bn, tn;
	unsigned char *idx = tu_read_file(ip, &in);
	unsigned char *bin = tu_read_file(bp, &bn);
	unsigned char *tbin = tu_read_file(tb, &tn);
	unsigned char *out = malloc(in + 64);
	memcpy(out, idx, in);
	size_t k = in;
	if (tie) {
		pair_record(out + k, tbin, tn);
		memcpy(out + k, "EPJMASK1", 8);
		k += 32;
	}
	pair_record(out + k, bin, bn);
	tu_write_file(ip, out, k + 32);
	free(out);
	free(idx);
	free(bin);
	free(tbin);
}

START_TEST(test_dataset_loss_mask)
{
	char *dir = tu_tmpdir_new("lossmask");
	char prefix[512], mb[600], mi[600];
	snprintf(prefix, sizeof prefix, "%s/p", dir);
	snprintf(mb, sizeof mb, "%s.lossmask.bin", prefix);
	snprintf(mi, sizeof mi, "%s.lossmask.idx", prefix);
	int32_t lens[3] = { 17, 5, 23 };
	int64_t tok[45];
	for (int i = 0; i < 45; i++)
		tok[i] = tu_randint(0, 60);
	write_mm(dir, "p", 8, lens, 3, tok);
	write_mask(dir, lens, 3, tok, 1, true);
	epj_ctx *ctx = tu_ctx();
	epj_docs *d = NULL;
	ck_assert_msg(epj_docs_open(ctx, prefix, &d) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert(epj_docs_has_loss_mask(d));
	int64_t m[23];
	ck_assert_int_eq(epj_docs_read_mask(ctx, d, 2, 3, 20, m), EPJ_OK);
	for (int j = 0; j < 20; j++)
		ck_assert_int_eq(m[j], tok[22 + 3 + j] % 2 == 0);
	epj_docs_free(d);
	/* batches: a target whose mask value is 0 (an odd token) is -100 */
	epj_data_opts o = { .split = "1,0,0", .seed = 5, .vocab = 64 };
	epj_corpus *c = epj_corpus_dataset(ctx, prefix, &o);
	tu_ok(ctx, c);
	ck_assert(epj_corpus_has_loss_mask(c));
	int hidden = 0, shown = 0;
	for (int k = 0; k < 6; k++) {
		epj_tensor *in, *lab;
		ck_assert_int_eq(epj_corpus_next_batch(ctx, c, 2, 6, &in, &lab),
				 EPJ_OK);
		int64_t *x = i64_values(in), *y = i64_values(lab);
		for (int r = 0; r < 2; r++)
			for (int t = 0; t < 5; t++) {
				int64_t nx = x[r * 6 + t + 1], l = y[r * 6 + t];
				ck_assert_int_eq(l, nx % 2 ? -100 : nx);
				hidden += l == -100;
				shown += l != -100;
			}
		free(x);
		free(y);
		epj_tensor_free(in);
		epj_tensor_free(lab);
	}
	ck_assert(hidden > 0 && shown > 0);
	epj_corpus_free(c);
	/* a blend with an unmasked source: its targets all count */
	char blend[1300], np[600];
	snprintf(np, sizeof np, "%s/u.npy", dir);
	uint16_t u[40];
	for (int i = 0; i < 40; i++)
		u[i] = 61; /* odd: hidden were a mask applied; never in p */
	write_npy(np, 1,
		  "{'descr': '<u2', 'fortran_order': False, 'shape': "
		  "(40,), }",
		  u, sizeof u);
	snprintf(blend, sizeof blend, "1 %s 1 %s", prefix, np);
	c = epj_corpus_dataset(ctx, blend, &o);
	tu_ok(ctx, c);
	for (int k = 0; k < 4; k++) {
		epj_tensor *in, *lab;
		ck_assert_int_eq(epj_corpus_next_batch(ctx, c, 1, 6, &in, &lab),
				 EPJ_OK);
		int64_t *x = i64_values(in), *y = i64_values(lab);
		for (int t = 0; t < 5; t++)
			ck_assert_int_eq(y[t], x[t + 1] == 61 ? 61
					       : x[t + 1] % 2 ? -100
							      : x[t + 1]);
		free(x);
		free(y);
		epj_tensor_free(in);
		epj_tensor_free(lab);
	}
	epj_corpus_free(c);
	epj_ctx_free(ctx);
	/* hostile masks, each refused at open naming the mask's index */
	write_mask(dir, lens, 3, tok, 1, false);
	expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.lossmask.idx",
			  "tie record", "no tie record");
	write_mask(dir, lens, 3, tok, 8, true);
	expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.lossmask.idx", "uint8",
			  "uint16 mask");
	int32_t other[3] = { 17, 6, 22 };
	write_mask(dir, other, 3, tok, 1, true);
	expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.lossmask.idx",
			  "sequence 1 has 6 mask values for 5 tokens",
			  "other lengths");
	int32_t two[2] = { 17, 28 };
	write_mask(dir, two, 2, tok, 1, true);
	expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.lossmask.idx",
			  "2 sequences, but the token index has 3",
			  "other count");
	/* a mask of other tokens (the tie record names another .bin) */
	write_mask(dir, lens, 3, tok, 1, true);
	tok[0] ^= 2; /* p.bin rewritten: same size, other bytes */
	write_mm(dir, "p", 8, lens, 3, tok);
	expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.lossmask.idx",
			  "written for a token file", "other tokens");
	tok[0] ^= 2;
	write_mm(dir, "p", 8, lens, 3, tok);
	/* the mask's own pairing: a changed .bin; a missing .bin */
	write_mask(dir, lens, 3, tok, 1, true);
	size_t bn;
	unsigned char *bin = tu_read_file(mb, &bn);
	bin[3] ^= 1;
	tu_write_file(mb, bin, bn);
	expect_docs_error(prefix, EPJ_ERR_FORMAT, "p.lossmask.bin",
			  "fingerprint", "changed mask");
	/* a value 2 with the pairing record made for it: read, refused */
	bin[3] = 2;
	tu_write_file(mb, bin, bn);
	size_t in;
	unsigned char *idx = tu_read_file(mi, &in);
	pair_record(idx + in - 32, bin, bn);
	tu_write_file(mi, idx, in);
	ctx = tu_ctx();
	ck_assert_msg(epj_docs_open(ctx, prefix, &d) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	expect_status(
	    ctx, epj_docs_read_mask(ctx, d, 0, 0, 5, m), EPJ_ERR_FORMAT,
	    TU_STRS("p.lossmask.bin", "value 2 at index 3", "not 0 or 1"));
	epj_docs_free(d);
	epj_ctx_free(ctx);
	unlink(mb);
	expect_docs_error(prefix, EPJ_ERR_IO, "p.lossmask.bin", "cannot open",
			  "missing mask .bin");
	free(bin);
	free(idx);
	tu_tmpdir_free(dir);
}
END_TEST

/* A corpus over spec; the test fails when it cannot be opened. */
static epj_corpus *open_ds(epj_ctx *ctx, const char *spec, const char *split,
			   uint64_t seed, uint32_t vocab)
{
	epj_data_opts o = { .split = split, .seed = seed, .vocab = vocab };
	epj_corpus *c = epj_corpus_dataset(ctx, spec, &o);
	ck_assert_msg(c != NULL, "%s: %s", spec, epj_ctx_error(ctx));
	return c;
}

/* n rows of T + 1 tokens (B = 1 batches) into x[n][T + 1]. */
static void take_rows(epj_ctx *ctx, epj_corpus *c, int n, int64_t T, int64_t *x)
{
	for (int r = 0; r < n; r++) {
		epj_tensor *in, *lab;
		ck_assert_msg(epj_corpus_next_batch(ctx, c, 1, T, &in, &lab) ==
				  EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		const int64_t *a = epj_tensor_data(in),
			      *b = epj_tensor_data(lab);
		int64_t *row = x + (int64_t)r * (T + 1);
		memcpy(row, a, (size_t)T * sizeof *row);
		row[T] = b[T - 1];
		for (int64_t t = 0; t + 1 < T; t++)
			ck_assert_int_eq(b[t], a[t + 1]);
		epj_tensor_free(in);
		epj_tensor_free(lab);
	}
}

START_TEST(test_dataset_packing_shuffle)
{
	/* one document (a 1-D array) of fresh random tokens: epoch e's
	 * samples must be exactly the windows [j T, j T + T] for a
	 * permutation of j = 0 .. S - 1 */
	char *dir = tu_tmpdir_new("pack");
	char p[512];
	snprintf(p, sizeof p, "%s/s.npy", dir);
	int L = (int)tu_randint(60, 400);
	int64_t T = tu_randint(2, 12);
	int32_t *tok = malloc((size_t)L * sizeof *tok);
	for (int i = 0; i < L; i++)
		tok[i] = (int32_t)tu_randint(0, 1000);
	char dict[128];
	snprintf(dict, sizeof dict,
		 "{'descr': '<i4', 'fortran_order': False, 'shape': (%d,), }",
		 L);
	write_npy(p, 1, dict, tok, (size_t)L * 4);
	int S = (L - 1) / (int)T;
	epj_ctx *ctx = tu_ctx();
	uint64_t seed = (uint64_t)tu_randint(0, INT64_MAX);
	int64_t *x = malloc((size_t)(3 * S) * (size_t)(T + 1) * sizeof *x);
	int64_t *y = malloc((size_t)(3 * S) * (size_t)(T + 1) * sizeof *y);
	epj_corpus *c = open_ds(ctx, p, "1", seed, 1000);
	ck_assert_uint_eq(epj_corpus_split_tokens(c, 0), (uint64_t)L);
	ck_assert_uint_eq(epj_corpus_split_tokens(c, 1), 0);
	take_rows(ctx, c, 3 * S, T, x);
	int *seen = calloc((size_t)S, sizeof *seen);
	int moved = 0;
	for (int e = 0; e < 3; e++) {
		memset(seen, 0, (size_t)S * sizeof *seen);
		for (int k = 0; k < S; k++) {
			const int64_t *row = x + (int64_t)(e * S + k) * (T + 1);
			int j = -1;
			for (int q = 0; q < S && j < 0; q++) {
				bool eq = true;
				for (int64_t t = 0; t <= T && eq; t++)
					eq = row[t] == tok[q * T + t];
				if (eq && !seen[q])
					j = q;
			}
			ck_assert_msg(j >= 0,
				      "epoch %d sample %d is not an unused "
				      "window j*T (L %d, T %lld)",
				      e, k, L, (long long)T);
			seen[j] = 1;
			moved += j != k;
		}
	}
	/* shuffled (S >= 4: the identity 3 times has chance < 1/24^3) */
	ck_assert_int_gt(moved, 0);
	/* the same seed: the same samples; another seed: others */
	epj_corpus *c2 = open_ds(ctx, p, "1", seed, 1000);
	take_rows(ctx, c2, 3 * S, T, y);
	ck_assert(memcmp(x, y, (size_t)(3 * S) * (size_t)(T + 1) * 8) == 0);
	epj_corpus_free(c2);
	c2 = open_ds(ctx, p, "1", seed ^ 0x5a5a5a5aULL, 1000);
	take_rows(ctx, c2, 3 * S, T, y);
	ck_assert_msg(memcmp(x, y, (size_t)(3 * S) * (size_t)(T + 1) * 8) != 0,
		      "seeds %llu and %llu give the same samples",
		      (unsigned long long)seed,
		      (unsigned long long)(seed ^ 0x5a5a5a5aULL));
	epj_corpus_free(c2);
	/* tokens >= vocab are refused when read, naming the file */
	c2 = open_ds(ctx, p, "1", seed, 2);
	epj_tensor *in = NULL, *lab = NULL;
	expect_status(ctx, epj_corpus_next_batch(ctx, c2, 1, T, &in, &lab),
		      EPJ_ERR_FORMAT, TU_STRS("s.npy", "not below the vocab"));
	ck_assert_ptr_null(in);
	epj_corpus_free(c2);
	/* negative tokens too */
	for (int i = 0; i < L; i += (int)T)
		tok[i] = -7; /* one in every sample */
	write_npy(p, 1, dict, tok, (size_t)L * 4);
	c2 = open_ds(ctx, p, "1", seed, 1000);
	expect_status(ctx, epj_corpus_next_batch(ctx, c2, 1, T, &in, &lab),
		      EPJ_ERR_FORMAT, TU_STRS("s.npy", "-7", "negative"));
	epj_corpus_free(c2);
	epj_corpus_free(c);
	free(seen);
	free(x);
	free(y);
	free(tok);
	epj_ctx_free(ctx);
	tu_tmpdir_free(dir);
}
END_TEST

/* Whether x[0..n) is a window of some concatenation of distinct documents
 * from doc[lo..hi) (dl[i] tokens each): a suffix of one document, whole
 * others, a prefix of the last. */
static bool win_from(const int64_t *const *doc, const int64_t *dl, int lo,
		     int hi, uint64_t used, const int64_t *x, int64_t n)
{
	if (n == 0)
		return true;
	for (int i = lo; i < hi; i++) {
		if (used >> i & 1 || dl[i] == 0)
			continue;
		int64_t m = dl[i] < n ? dl[i] : n;
		if (!memcmp(doc[i], x, (size_t)m * 8) &&
		    win_from(doc, dl, lo, hi, used | 1ull << i, x + m, n - m))
			return true;
	}
	return false;
}

static bool is_window(const int64_t *const *doc, const int64_t *dl, int lo,
		      int hi, const int64_t *x, int64_t n)
{
	for (int i = lo; i < hi; i++)
		for (int64_t o = 0; o < dl[i]; o++) {
			int64_t m = dl[i] - o < n ? dl[i] - o : n;
			if (!memcmp(doc[i] + o, x, (size_t)m * 8) &&
			    win_from(doc, dl, lo, hi, 1ull << i, x + m, n - m))
				return true;
		}
	return false;
}

START_TEST(test_dataset_split_windows)
{
	/* the tokenizer's fixture: 16 documents; "8,2,0" puts documents
	 * 0..12 in train (round(0.8 * 16) = 13) and 13..15 in validation */
	rows r = read_rows("docs.expected");
	const int64_t *doc[64];
	int64_t dl[64];
	for (int i = 0; i < r.n; i++) {
		doc[i] = r.v + r.rowoff[i];
		dl[i] = r.rowoff[i + 1] - r.rowoff[i];
	}
	ck_assert_int_eq(r.n, 16);
	uint64_t train = 0, valid = 0;
	for (int i = 0; i < 16; i++)
		*(i < 13 ? &train : &valid) += (uint64_t)dl[i];
	char p[512];
	fixture_path(p, sizeof p, "docs");
	epj_ctx *ctx = tu_ctx();
	epj_corpus *c = open_ds(ctx, p, "8,2,0", 7, 64);
	ck_assert_uint_eq(epj_corpus_split_tokens(c, 0), train);
	ck_assert_uint_eq(epj_corpus_split_tokens(c, 1), valid);
	ck_assert_uint_eq(epj_corpus_split_tokens(c, 2), 0);
	int64_t T = tu_randint(3, 9);
	int n = 3 * (int)(train / (uint64_t)T);
	int64_t *x = malloc((size_t)n * (size_t)(T + 1) * sizeof *x);
	take_rows(ctx, c, n, T, x);
	for (int k = 0; k < n; k++)
		ck_assert_msg(is_window(doc, dl, 0, 13, x + k * (T + 1), T + 1),
			      "train sample %d is no window of documents "
			      "0..12",
			      k);
	epj_corpus *v = epj_corpus_fork(ctx, c, 1);
	tu_ok(ctx, v);
	int nv = (int)((valid - 1) / (uint64_t)T);
	take_rows(ctx, v, nv, T, x);
	for (int k = 0; k < nv; k++)
		ck_assert_msg(
		    is_window(doc, dl, 13, 16, x + k * (T + 1), T + 1),
		    "validation sample %d is no window of documents 13..15", k);
	epj_corpus_free(v);
	/* the test split is empty: a clear error, naming split and file */
	v = epj_corpus_fork(ctx, c, 2);
	tu_ok(ctx, v);
	epj_tensor *in = NULL, *lab = NULL;
	expect_status(ctx, epj_corpus_next_batch(ctx, v, 1, T, &in, &lab),
		      EPJ_ERR_INVALID,
		      TU_STRS("docs.bin", "test split holds 0 tokens"));
	epj_corpus_free(v);
	tu_assert_error(ctx, epj_corpus_fork(ctx, c, 3), EPJ_ERR_INVALID,
			TU_STRS("not a split"));
	epj_corpus_free(c);
	/* bad split strings */
	epj_data_opts o = { .split = "1,x", .seed = 1, .vocab = 64 };
	tu_assert_error(ctx, epj_corpus_dataset(ctx, p, &o), EPJ_ERR_INVALID,
			TU_STRS("data split '1,x'"));
	o.split = "0,0,0";
	tu_assert_error(ctx, epj_corpus_dataset(ctx, p, &o), EPJ_ERR_INVALID,
			TU_STRS("positive sum"));
	o.split = "1,1,1,1";
	tu_assert_error(ctx, epj_corpus_dataset(ctx, p, &o), EPJ_ERR_INVALID,
			TU_STRS("up to three"));
	/* weights that add up to infinity: refused, not all-train */
	o.split = "1e308,1e308,1e308";
	tu_assert_error(ctx, epj_corpus_dataset(ctx, p, &o), EPJ_ERR_INVALID,
			TU_STRS("1e308,1e308,1e308", "largest double"));
	free(x);
	free(r.v);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_dataset_blend_resume)
{
	/* source A's tokens are < 32, B's >= 32: each sample names its
	 * source.  Weights wa : wb; after every prefix of n samples the
	 * count of A must be within 1 of n * wa / (wa + wb). */
	char *dir = tu_tmpdir_new("blend");
	char pa[512], pb[512], spec[1200];
	snprintf(pa, sizeof pa, "%s/a.npy", dir);
	snprintf(pb, sizeof pb, "%s/b", dir);
	int na = (int)tu_randint(50, 200);
	uint16_t *ta = malloc((size_t)na * 2);
	for (int i = 0; i < na; i++)
		ta[i] = (uint16_t)tu_randint(0, 32);
	char dict[128];
	snprintf(dict, sizeof dict,
		 "{'descr': '<u2', 'fortran_order': False, 'shape': (%d,), }",
		 na);
	write_npy(pa, 1, dict, ta, (size_t)na * 2);
	int32_t lens[20];
	int64_t vb[20 * 30];
	int nb = 0;
	for (int i = 0; i < 20; i++) {
		lens[i] = (int32_t)tu_randint(1, 30);
		for (int j = 0; j < lens[i]; j++)
			vb[nb++] = tu_randint(32, 64);
	}
	write_mm(dir, "b", 4, lens, 20, vb);
	int wa = (int)tu_randint(1, 10), wb = (int)tu_randint(1, 10);
	snprintf(spec, sizeof spec, "%d %s %d.0 %s", wa, pa, wb, pb);
	epj_ctx *ctx = tu_ctx();
	ck_assert(epj_data_spec_p(spec));
	ck_assert(epj_data_spec_p(pa));
	ck_assert(epj_data_spec_p(pb));
	ck_assert(!epj_data_spec_p(dir));
	uint64_t seed = (uint64_t)tu_randint(0, INT64_MAX);
	int64_t T = tu_randint(2, 6);
	int N = 1000;
	int64_t *x = malloc((size_t)N * (size_t)(T + 1) * sizeof *x);
	epj_corpus *c = open_ds(ctx, spec, "1", seed, 64);
	take_rows(ctx, c, N, T, x);
	double share = (double)wa / (wa + wb);
	int a = 0;
	for (int k = 0; k < N; k++) {
		const int64_t *row = x + k * (T + 1);
		bool is_a = row[0] < 32;
		for (int64_t t = 0; t <= T; t++)
			ck_assert_msg((row[t] < 32) == is_a,
				      "sample %d mixes sources", k);
		a += is_a;
		ck_assert_msg(fabs(a - share * (k + 1)) <= 1.0,
			      "after %d samples %d from A, expected %.2f +- 1 "
			      "(weights %d:%d)",
			      k + 1, a, share * (k + 1), wa, wb);
	}
	/* resume: skip k rows, then read, equals reading straight on (also
	 * across epoch boundaries: N samples are several epochs here) */
	for (int rep = 0; rep < 4; rep++) {
		int k = (int)tu_randint(0, N - 50);
		int64_t *y = malloc((size_t)50 * (size_t)(T + 1) * sizeof *y);
		epj_corpus *c2 = open_ds(ctx, spec, "1", seed, 64);
		ck_assert_int_eq(epj_corpus_skip(ctx, c2, k, 1, T), EPJ_OK);
		take_rows(ctx, c2, 50, T, y);
		ck_assert_msg(!memcmp(y, x + (int64_t)k * (T + 1),
				      (size_t)50 * (size_t)(T + 1) * 8),
			      "skip %d then 50 rows differs from the straight "
			      "read",
			      k);
		epj_corpus_free(c2);
		free(y);
	}
	/* a skip in batches of B rows is B times as far */
	int64_t B = tu_randint(2, 5), k = tu_randint(1, 50);
	epj_corpus *c3 = open_ds(ctx, spec, "1", seed, 64);
	ck_assert_int_eq(epj_corpus_skip(ctx, c3, k, B, T), EPJ_OK);
	int64_t *y = malloc((size_t)(T + 1) * sizeof *y);
	take_rows(ctx, c3, 1, T, y);
	ck_assert(!memcmp(y, x + k * B * (T + 1), (size_t)(T + 1) * 8));
	free(y);
	epj_corpus_free(c3);
	/* blend syntax errors */
	epj_data_opts o = { .split = "1", .seed = 1, .vocab = 64 };
	snprintf(spec, sizeof spec, "1 %s 2", pa);
	tu_assert_error(ctx, epj_corpus_dataset(ctx, spec, &o), EPJ_ERR_INVALID,
			TU_STRS("WEIGHT PATH"));
	snprintf(spec, sizeof spec, "-1 %s 2 %s", pa, pb);
	tu_assert_error(ctx, epj_corpus_dataset(ctx, spec, &o), EPJ_ERR_INVALID,
			TU_STRS("weight '-1'", "a.npy"));
	snprintf(spec, sizeof spec, "1e308 %s 1e308 %s", pa, pb);
	tu_assert_error(ctx, epj_corpus_dataset(ctx, spec, &o), EPJ_ERR_INVALID,
			TU_STRS("data blend", "largest double"));
	snprintf(spec, sizeof spec, "1 %s 2 %s/nothing", pa, dir);
	tu_assert_error(ctx, epj_corpus_dataset(ctx, spec, &o), EPJ_ERR_IO,
			TU_STRS("nothing.idx", "cannot open"));
	epj_corpus_free(c);
	free(x);
	free(ta);
	epj_ctx_free(ctx);
	tu_tmpdir_free(dir);
}
END_TEST

/* Writes n bytes at byte off of path in place (the same inode, as a
 * rewrite by another process would). */
static void patch_file(const char *path, uint64_t off, const void *p, size_t n)
{
	int fd = open(path, O_WRONLY);
	ck_assert_msg(fd >= 0, "%s: %s", path, strerror(errno));
	ck_assert_int_eq(pwrite(fd, p, n, (off_t)off), (ssize_t)n);
	ck_assert_int_eq(close(fd), 0);
}

/* The next batch fails with EPJ_ERR_IO naming file and "shrank". */
static void expect_shrank(epj_ctx *ctx, epj_corpus *c, int64_t T,
			  const char *file)
{
	epj_tensor *in = NULL, *lab = NULL;
	epj_status st = epj_corpus_next_batch(ctx, c, 2, T, &in, &lab);
	expect_status(ctx, st, EPJ_ERR_IO, TU_STRS(file, "shrank"));
	ck_assert(!in && !lab);
}

START_TEST(test_dataset_live_files)
{
	/* Files changed between two batches of a run that has them open:
	 * an index rewritten in place changes nothing (what was validated at
	 * open is what is used: never a read outside the .bin), and a data
	 * file that shrank fails the batch with EPJ_ERR_IO naming it, never a
	 * SIGSEGV or SIGBUS (which Check's fork mode reports as failures). */
	char *dir = tu_tmpdir_new("live");
	char prefix[512], ip[600], bp[600], np[600];
	snprintf(prefix, sizeof prefix, "%s/m", dir);
	snprintf(ip, sizeof ip, "%s.idx", prefix);
	snprintf(bp, sizeof bp, "%s.bin", prefix);
	snprintf(np, sizeof np, "%s/a.npy", dir);
	enum { NDOC = 6, NROW = 8 };
	int32_t lens[NDOC];
	int64_t v[NDOC * 700];
	int nv = 0;
	for (int i = 0; i < NDOC; i++) {
		/* over a page of tokens: a truncated file's pages unmapped */
		lens[i] = (int32_t)tu_randint(600, 700);
		for (int j = 0; j < lens[i]; j++)
			v[nv++] = tu_randint(0, 64);
	}
	write_mm(dir, "m", 8, lens, NDOC, v);
	uint64_t seed = (uint64_t)tu_randint(0, INT64_MAX);
	int64_t T = tu_randint(4, 64);
	epj_ctx *ctx = tu_ctx();
	int64_t *want = malloc((size_t)NROW * (size_t)(T + 1) * sizeof *want);
	int64_t *got = malloc((size_t)NROW * (size_t)(T + 1) * sizeof *got);
	epj_corpus *ref = open_ds(ctx, prefix, "1", seed, 64);
	take_rows(ctx, ref, NROW, T, want);
	epj_corpus_free(ref);
	epj_corpus *c = open_ds(ctx, prefix, "1", seed, 64);
	epj_docs *d = NULL;
	ck_assert_int_eq(epj_docs_open(ctx, prefix, &d), EPJ_OK);
	take_rows(ctx, c, 2, T, got);
	/* every length INT32_MAX, every pointer 2^40, in place */
	for (int i = 0; i < NDOC; i++) {
		unsigned char w[8];
		le32(w, INT32_MAX);
		patch_file(ip, 34 + 4 * (uint64_t)i, w, 4);
		le64(w, (uint64_t)1 << 40);
		patch_file(ip, 34 + 4 * NDOC + 8 * (uint64_t)i, w, 8);
	}
	take_rows(ctx, c, NROW - 2, T, got + 2 * (T + 1));
	ck_assert_msg(
	    !memcmp(got, want, (size_t)NROW * (size_t)(T + 1) * sizeof *got),
	    "the rows after the index was rewritten differ from "
	    "the rows of the index as opened");
	ck_assert_uint_eq(epj_docs_len(d, 0), (uint64_t)lens[0]);
	int64_t x[700];
	ck_assert_int_eq(epj_docs_read(ctx, d, 0, 0, (uint64_t)lens[0], x),
			 EPJ_OK);
	ck_assert(!memcmp(x, v, (size_t)lens[0] * sizeof *x));
	/* the .bin cut after document 0: the last document is gone */
	ck_assert_int_eq(truncate(bp, (off_t)lens[0] * 2), 0);
	ck_assert_int_eq(epj_docs_read(ctx, d, 0, 0, (uint64_t)lens[0], x),
			 EPJ_OK);
	expect_status(
	    ctx,
	    epj_docs_read(ctx, d, NDOC - 1, 0, (uint64_t)lens[NDOC - 1], x),
	    EPJ_ERR_IO, TU_STRS("m.bin", "shrank", "document 5"));
	ck_assert_int_eq(truncate(bp, 0), 0);
	expect_shrank(ctx, c, T, "m.bin");
	epj_docs_free(d);
	epj_corpus_free(c);
	/* a .npy of 4 rows of 1024 tokens, emptied */
	uint16_t u[4 * 1024];
	for (int i = 0; i < 4 * 1024; i++)
		u[i] = (uint16_t)tu_randint(0, 64);
	write_npy(np, 1,
		  "{'descr': '<u2', 'fortran_order': False, 'shape': (4, "
		  "1024), }",
		  u, sizeof u);
	c = open_ds(ctx, np, "1", seed, 64);
	take_rows(ctx, c, 2, T, got);
	ck_assert_int_eq(truncate(np, 0), 0);
	expect_shrank(ctx, c, T, "a.npy");
	epj_corpus_free(c);
	free(want);
	free(got);
	epj_ctx_free(ctx);
	tu_tmpdir_free(dir);
}
END_TEST

/* Runs cmd (sh -c) and fails the test, showing log, when it fails. */
static void run_ok(const char *cmd, const char *log)
{
	int rc = system(cmd);
	if (rc != 0) {
		size_t n = 0;
		char *t = (char *)tu_read_file(log, &n);
		ck_abort_msg("'%s' exited %d:\n%.*s", cmd, rc, (int)n, t);
	}
}

START_TEST(test_dataset_trainer_dump)
{
	/* epjit-train on a Megatron dataset and on a .npy: 3 steps and a
	 * checkpoint, then --load and --dump-state: every row of the dumped
	 * batch is T + 1 consecutive tokens of the packed documents
	 * (input_ids and labels shifted by one) */
	const char *bd = getenv("top_builddir");
	char train[1024];
	snprintf(train, sizeof train, "%s/tools/epjit-train", bd ? bd : ".");
	char *abs = realpath(train, NULL);
	if (!abs || access(abs, X_OK) != 0) {
		fprintf(stderr,
			"test_dataset_trainer_dump: %s not built, "
			"not run\n",
			train);
		free(abs);
		return;
	}
	static const char *const data[2] = { "docs", "rows_i8.npy" };
	static const char *const exp[2] = { "docs.expected",
					    "rows_i8.expected" };
	for (int k = 0; k < 2; k++) {
		char *dir = tu_tmpdir_new("dsdump");
		char src[512], cmd[4096], log[600], st[600];
		char rel[512];
		fixture_path(rel, sizeof rel, data[k]);
		/* the trainer runs in dir: an absolute path (a Megatron
		 * prefix is not a file, so its .idx is resolved) */
		char idx[600];
		snprintf(idx, sizeof idx, "%s%s", rel,
			 strstr(rel, ".npy") ? "" : ".idx");
		char *ai = realpath(idx, NULL);
		ck_assert_ptr_nonnull(ai);
		snprintf(src, sizeof src, "%.*s",
			 (int)(strlen(ai) - (strstr(rel, ".npy") ? 0 : 4)), ai);
		free(ai);
		snprintf(log, sizeof log, "%s/log", dir);
		snprintf(st, sizeof st, "%s/d.st", dir);
		const char *env = "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1";
		snprintf(cmd, sizeof cmd,
			 "cd %s && %s EPJIT_CACHE_DIR=%s/cache %s --data '%s' "
			 "--split 1,0,0 --seq 8 --steps 3 --save ck >log 2>&1",
			 dir, env, dir, abs, src);
		run_ok(cmd, log);
		snprintf(cmd, sizeof cmd,
			 "cd %s && %s EPJIT_CACHE_DIR=%s/cache %s --data '%s' "
			 "--split 1,0,0 --seq 8 --load ck --dump-state d.st "
			 ">log 2>&1",
			 dir, env, dir, abs, src);
		run_ok(cmd, log);
		epj_ctx *ctx = tu_ctx();
		epj_st_file *f;
		ck_assert_msg(epj_st_open(ctx, st, &f) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		epj_tensor *in = epj_st_get(ctx, f, "input_ids");
		epj_tensor *lab = epj_st_get(ctx, f, "labels");
		tu_ok(ctx, in);
		tu_ok(ctx, lab);
		ck_assert_int_eq(epj_tensor_ndim(in), 2);
		int64_t B = epj_tensor_shape(in)[0],
			T = epj_tensor_shape(in)[1];
		ck_assert_int_eq(T, 8);
		double *a = tu_values(ctx, in), *b = tu_values(ctx, lab);
		rows r = read_rows(exp[k]);
		const int64_t *doc[64];
		int64_t dl[64];
		for (int i = 0; i < r.n; i++) {
			doc[i] = r.v + r.rowoff[i];
			dl[i] = r.rowoff[i + 1] - r.rowoff[i];
		}
		int64_t x[9];
		for (int64_t row = 0; row < B; row++) {
			for (int64_t t = 0; t < T; t++)
				x[t] = (int64_t)a[row * T + t];
			x[T] = (int64_t)b[row * T + T - 1];
			for (int64_t t = 0; t + 1 < T; t++)
				ck_assert_int_eq((int64_t)b[row * T + t],
						 x[t + 1]);
			ck_assert_msg(is_window(doc, dl, 0, r.n, x, T + 1),
				      "%s: dumped row %lld is no window of "
				      "the documents",
				      data[k], (long long)row);
		}
		free(a);
		free(b);
		free(r.v);
		epj_tensor_free(in);
		epj_tensor_free(lab);
		epj_st_close(f);
		epj_ctx_free(ctx);
		tu_tmpdir_free(dir);
	}
	free(abs);
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
	/* token datasets: Megatron, .npy, blends (runtime/dataset.c) */
	TCase *ds = tcase_create("dataset");
	tcase_set_timeout(ds, 300);
	tcase_add_test(ds, test_dataset_fixtures);
	tcase_add_test(ds, test_dataset_dtypes);
	tcase_add_test(ds, test_dataset_megatron_hostile);
	tcase_add_test(ds, test_dataset_npy_hostile);
	tcase_add_test(ds, test_dataset_pairing);
	tcase_add_test(ds, test_dataset_packing_shuffle);
	tcase_add_test(ds, test_dataset_split_windows);
	tcase_add_test(ds, test_dataset_blend_resume);
	tcase_add_test(ds, test_dataset_live_files);
	tcase_add_test(ds, test_dataset_trainer_dump);
	tcase_add_test(ds, test_dataset_loss_mask);
	suite_add_tcase(s, ds);
	return s;
}
