/* data.c -- training data: token files, a byte-level text converter, and
 * corpora (endless token streams cut into [B, T] batches).
 *
 * Token file (doc/formats.md): 32-byte header -- magic "EPJTOK\0\0", u32
 * version (1), u32 dtype (1 = uint16, 2 = uint32), u64 count, u32
 * vocab_size (0 = unknown), u32 reserved (0) -- then `count` tokens, all
 * little endian.  A file is valid only when its size is exactly 32 + count *
 * token size and, with a vocab_size, every token is below it.
 *
 * Synthetic corpus: a first-order Markov chain over V states fixed by the
 * seed.  State s has K = min(4, V) distinct successors with log-normal
 * weights q(s, .) (skewed, so a tiny model finds the structure quickly), and
 * every transition is smoothed:  P(s, t) = EPS / V + (1 - EPS) q(s, t).
 * P > 0 everywhere, so the chain is irreducible and aperiodic; its
 * stationary distribution pi comes from power iteration in double and its
 * entropy rate H = sum_s pi(s) H(P(s, .)) is the exact floor of the mean
 * next-token cross-entropy (nats/token) of any model.  The stream starts in
 * a state drawn from pi, so every position of every batch is stationary and
 * the floor holds per position, not only asymptotically.
 *
 * Token datasets (Megatron .bin/.idx, .npy, blends) are read, split,
 * shuffled and packed by runtime/dataset.c; a corpus over one holds an
 * ej_dstream, its split's position.
 *
 * Invariants: the static part of a corpus (chain or token array) lives in a
 * refcounted `corpus_src` shared by forks; a corpus itself only holds its
 * stream position (RNG + current state, or file offset).  Everything is
 * single threaded and deterministic in the seed; a corpus is not thread
 * safe (the source refcount is plain).
 */
#include "core_impl.h"
#include "dataset_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
	       "token files assume a little-endian host");

#define TOK_MAGIC     "EPJTOK\0\0"
#define TOK_HEADER    32
#define TOK_VERSION   1
#define TOK_DTYPE_U16 1
#define TOK_DTYPE_U32 2
#define TOK_CHUNK     65536 /* tokens converted per I/O call */

#define SYN_SUCC	4    /* successors per state */
#define SYN_EPS		0.01 /* uniform smoothing mass */
#define SYN_SIGMA	1.5  /* log-normal weight spread */
#define SYN_MAX_VOCAB	(1u << 20)
#define SYN_POWER_TOL	1e-13 /* L1 change that ends power iteration */
#define SYN_POWER_ITERS 5000  /* a cap: error shrinks >= (1 - EPS) per step */

/* ---- token files --------------------------------------------------------- */

static void put_u32(unsigned char *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static void put_u64(unsigned char *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get_u32(const unsigned char *p)
{
	uint32_t v = 0;
	for (int i = 3; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static uint64_t get_u64(const unsigned char *p)
{
	uint64_t v = 0;
	for (int i = 7; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

typedef struct tok_write {
	const char *path;
	const uint32_t *tokens;
	uint64_t count;
	uint32_t vocab;
	bool u16;
} tok_write;

static epj_status tok_fill(epj_ctx *ctx, FILE *fp, const char *tmp, void *user)
{
	const tok_write *tw = user;
	unsigned char hdr[TOK_HEADER] = { 0 };
	memcpy(hdr, TOK_MAGIC, 8);
	put_u32(hdr + 8, TOK_VERSION);
	put_u32(hdr + 12, tw->u16 ? TOK_DTYPE_U16 : TOK_DTYPE_U32);
	put_u64(hdr + 16, tw->count);
	put_u32(hdr + 24, tw->vocab);
	put_u32(hdr + 28, 0);
	bool ok = fwrite(hdr, 1, TOK_HEADER, fp) == TOK_HEADER;
	if (ok && !tw->u16 && tw->count)
		ok = fwrite(tw->tokens, 4, tw->count, fp) == tw->count;
	if (ok && tw->u16) {
		uint16_t buf[TOK_CHUNK];
		for (uint64_t i = 0; ok && i < tw->count; i += TOK_CHUNK) {
			size_t n = tw->count - i < TOK_CHUNK
				       ? (size_t)(tw->count - i)
				       : TOK_CHUNK;
			for (size_t j = 0; j < n; j++)
				buf[j] = (uint16_t)tw->tokens[i + j];
			ok = fwrite(buf, 2, n, fp) == n;
		}
	}
	if (!ok)
		return ej_error(ctx, EPJ_ERR_IO,
				"token file '%s': write '%s': %s", tw->path,
				tmp, strerror(errno));
	return EPJ_OK;
}

epj_status epj_tokens_write(epj_ctx *ctx, const char *path,
			    const uint32_t *tokens, uint64_t count,
			    uint32_t vocab_size, bool u16)
{
	if (!path || (count && !tokens))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"epj_tokens_write: %s is NULL",
				path ? "tokens" : "path");
	if (u16 && vocab_size > 65536)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"token file '%s': vocab_size %u does not fit "
				"uint16 tokens (max 65536)",
				path, vocab_size);
	uint64_t limit = vocab_size ? vocab_size : u16 ? 65536 : 0;
	for (uint64_t i = 0; limit && i < count; i++)
		if (tokens[i] >= limit)
			return ej_error(ctx, EPJ_ERR_INVALID,
					"token file '%s': token %u at index "
					"%llu is >= %s %llu",
					path, tokens[i], (unsigned long long)i,
					vocab_size ? "vocab_size"
						   : "the uint16 limit",
					(unsigned long long)limit);
	tok_write tw = { path, tokens, count, vocab_size, u16 };
	return ej_write_atomic(ctx, "token file", path, tok_fill, &tw);
}

/* "token file '<path>': <message>" with status s. */
static epj_status tok_error(epj_ctx *ctx, epj_status s, const char *path,
			    const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static epj_status tok_error(epj_ctx *ctx, epj_status s, const char *path,
			    const char *fmt, ...)
{
	char msg[768];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	return ej_error(ctx, s, "token file '%s': %s", path, msg);
}

static epj_status tok_read_fp(epj_ctx *ctx, const char *path, FILE *fp,
			      epj_tokens *t)
{
	struct stat st;
	if (fstat(fileno(fp), &st) != 0)
		return tok_error(ctx, EPJ_ERR_IO, path, "stat: %s",
				 strerror(errno));
	if (!S_ISREG(st.st_mode))
		return tok_error(ctx, EPJ_ERR_IO, path, "not a regular file");
	uint64_t size = (uint64_t)st.st_size;
	unsigned char hdr[TOK_HEADER];
	if (size < TOK_HEADER)
		return tok_error(ctx, EPJ_ERR_FORMAT, path,
				 "file is %llu bytes, shorter than the "
				 "%d-byte header",
				 (unsigned long long)size, TOK_HEADER);
	if (fread(hdr, 1, TOK_HEADER, fp) != TOK_HEADER)
		return tok_error(ctx, EPJ_ERR_IO, path, "read header: %s",
				 ferror(fp) ? strerror(errno) : "short read");
	if (memcmp(hdr, TOK_MAGIC, 8) != 0)
		return tok_error(ctx, EPJ_ERR_FORMAT, path,
				 "bad magic (not an epjit token file; "
				 "expected \"EPJTOK\\0\\0\")");
	uint32_t version = get_u32(hdr + 8), dtype = get_u32(hdr + 12);
	uint64_t count = get_u64(hdr + 16);
	uint32_t vocab = get_u32(hdr + 24), reserved = get_u32(hdr + 28);
	if (version != TOK_VERSION)
		return tok_error(ctx, EPJ_ERR_FORMAT, path,
				 "unsupported version %u (this build reads "
				 "version %d)",
				 version, TOK_VERSION);
	if (dtype != TOK_DTYPE_U16 && dtype != TOK_DTYPE_U32)
		return tok_error(ctx, EPJ_ERR_FORMAT, path,
				 "unsupported token dtype %u (1 = uint16, "
				 "2 = uint32)",
				 dtype);
	if (reserved != 0)
		return tok_error(ctx, EPJ_ERR_FORMAT, path,
				 "reserved header field is %u, must be 0",
				 reserved);
	size_t es = dtype == TOK_DTYPE_U16 ? 2 : 4;
	uint64_t have = size - TOK_HEADER, need;
	if (__builtin_mul_overflow(count, (uint64_t)es, &need) || need > have)
		return tok_error(ctx, EPJ_ERR_FORMAT, path,
				 "truncated: header says %llu tokens (%llu "
				 "bytes of data) but the file holds %llu",
				 (unsigned long long)count,
				 (unsigned long long)count * es,
				 (unsigned long long)have);
	if (need < have)
		return tok_error(ctx, EPJ_ERR_FORMAT, path,
				 "%llu trailing bytes after %llu tokens",
				 (unsigned long long)(have - need),
				 (unsigned long long)count);
	if (count > SIZE_MAX / 4)
		return tok_error(ctx, EPJ_ERR_NOMEM, path,
				 "%llu tokens do not fit in memory",
				 (unsigned long long)count);
	t->count = count;
	t->vocab_size = vocab;
	t->data = malloc(count ? (size_t)count * 4 : 1);
	if (!t->data)
		return tok_error(ctx, EPJ_ERR_NOMEM, path,
				 "out of memory for %llu tokens",
				 (unsigned long long)count);
	if (es == 4) {
		if (fread(t->data, 4, count, fp) != count)
			return tok_error(ctx, EPJ_ERR_IO, path, "read: %s",
					 ferror(fp) ? strerror(errno)
						    : "short read");
	} else {
		uint16_t buf[TOK_CHUNK];
		for (uint64_t i = 0; i < count; i += TOK_CHUNK) {
			size_t n = count - i < TOK_CHUNK ? (size_t)(count - i)
							 : TOK_CHUNK;
			if (fread(buf, 2, n, fp) != n)
				return tok_error(ctx, EPJ_ERR_IO, path,
						 "read: %s",
						 ferror(fp) ? strerror(errno)
							    : "short read");
			for (size_t j = 0; j < n; j++)
				t->data[i + j] = buf[j];
		}
	}
	/* Without a vocab_size the vocabulary is max + 1, which must fit in
	 * 32 bits: 0xFFFFFFFF would wrap it to 0 (unknown). */
	for (uint64_t i = 0; !vocab && i < count; i++)
		if (t->data[i] == UINT32_MAX)
			return tok_error(ctx, EPJ_ERR_FORMAT, path,
					 "token %u at index %llu: without a "
					 "vocab_size token ids must be in "
					 "[0, %u]",
					 t->data[i], (unsigned long long)i,
					 UINT32_MAX - 1);
	for (uint64_t i = 0; vocab && i < count; i++)
		if (t->data[i] >= vocab)
			return tok_error(ctx, EPJ_ERR_FORMAT, path,
					 "token %u at index %llu is >= "
					 "vocab_size %u",
					 t->data[i], (unsigned long long)i,
					 vocab);
	return EPJ_OK;
}

epj_status epj_tokens_read(epj_ctx *ctx, const char *path, epj_tokens **out)
{
	if (!out || !path)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"epj_tokens_read: %s is NULL",
				out ? "path" : "out");
	*out = NULL;
	const char *why = NULL;
	FILE *fp = ej_fopen_regular(path, &why);
	if (!fp)
		return tok_error(ctx, EPJ_ERR_IO, path, "cannot open: %s", why);
	epj_tokens *t = calloc(1, sizeof *t);
	epj_status s = t ? tok_read_fp(ctx, path, fp, t)
			 : tok_error(ctx, EPJ_ERR_NOMEM, path, "out of memory");
	fclose(fp);
	if (s != EPJ_OK) {
		epj_tokens_free(t);
		return s;
	}
	*out = t;
	return EPJ_OK;
}

void epj_tokens_free(epj_tokens *t)
{
	if (!t)
		return;
	free(t->data);
	free(t);
}

epj_status epj_tokens_from_text(epj_ctx *ctx, const char *text_path,
				const char *out_path)
{
	if (!text_path || !out_path)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"epj_tokens_from_text: %s is NULL",
				text_path ? "out_path" : "text_path");
	const char *why = NULL;
	FILE *fp = ej_fopen_regular(text_path, &why);
	if (!fp)
		return ej_error(ctx, EPJ_ERR_IO,
				"text file '%s': cannot open: %s", text_path,
				why);
	uint32_t *tok = NULL;
	size_t n = 0, cap = 0;
	unsigned char buf[TOK_CHUNK];
	size_t got;
	epj_status s = EPJ_OK;
	while ((got = fread(buf, 1, sizeof buf, fp)) > 0) {
		if (n + got > cap) {
			size_t ncap = cap ? 2 * cap : 2 * TOK_CHUNK;
			while (ncap < n + got)
				ncap *= 2;
			uint32_t *p = realloc(tok, ncap * sizeof *p);
			if (!p) {
				s = ej_error(ctx, EPJ_ERR_NOMEM,
					     "text file '%s': out of memory",
					     text_path);
				break;
			}
			tok = p;
			cap = ncap;
		}
		for (size_t i = 0; i < got; i++)
			tok[n + i] = buf[i];
		n += got;
	}
	if (s == EPJ_OK && ferror(fp))
		s = ej_error(ctx, EPJ_ERR_IO, "text file '%s': read: %s",
			     text_path, strerror(errno));
	fclose(fp);
	if (s == EPJ_OK)
		s = epj_tokens_write(ctx, out_path, tok, n, 256, true);
	free(tok);
	return s;
}

/* ---- corpora ------------------------------------------------------------- */

typedef enum { SRC_SYNTHETIC, SRC_TOKENS, SRC_DATASET } src_kind;

typedef struct corpus_src {
	int refcount;
	src_kind kind;
	uint32_t vocab;
	uint64_t seed;
	/* synthetic: succ/cdf are [vocab][k]; cdf is the cumulative q */
	int k;
	uint32_t *succ;
	double *cdf;
	double *pi; /* [vocab] stationary distribution */
	double entropy;
	/* token file */
	epj_tokens *tok;
	/* token dataset (runtime/dataset.c) */
	ej_dsrc *ds;
} corpus_src;

struct epj_corpus {
	corpus_src *src;
	ej_rng rng;	 /* synthetic: the sample path */
	uint32_t cur;	 /* synthetic: current state */
	uint64_t pos;	 /* token file: index of the next row's first token */
	ej_dstream *dst; /* token dataset: the split's reader */
};

static void src_unref(corpus_src *s)
{
	if (!s || --s->refcount > 0)
		return;
	free(s->succ);
	free(s->cdf);
	free(s->pi);
	epj_tokens_free(s->tok);
	ej_dsrc_free(s->ds);
	free(s);
}

/* splitmix64 finaliser: decorrelates the stream seeds from the chain seed. */
static uint64_t mix64(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform integer in [0, n) without modulo bias. */
static uint32_t rng_below(ej_rng *r, uint32_t n)
{
	uint64_t limit = UINT64_MAX - UINT64_MAX % n;
	uint64_t x;
	do
		x = ej_rng_next(r);
	while (x >= limit);
	return (uint32_t)(x % n);
}

/* Probability that state s moves to its i-th successor. */
static double succ_prob(const corpus_src *c, uint32_t s, int i)
{
	const double *cdf = c->cdf + (size_t)s * c->k;
	double q = cdf[i] - (i ? cdf[i - 1] : 0.0);
	return SYN_EPS / c->vocab + (1.0 - SYN_EPS) * q;
}

/* Power iteration pi <- pi P until the L1 change is below SYN_POWER_TOL.
 * (pi P)(t) = EPS/V + (1 - EPS) sum_s pi(s) q(s, t), using sum(pi) = 1. */
static epj_status stationary(epj_ctx *ctx, corpus_src *c)
{
	uint32_t V = c->vocab;
	double *next = malloc((size_t)V * sizeof *next);
	c->pi = malloc((size_t)V * sizeof *c->pi);
	if (!next || !c->pi) {
		free(next);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"corpus_synthetic: out of memory (vocab %u)",
				V);
	}
	for (uint32_t s = 0; s < V; s++)
		c->pi[s] = 1.0 / V;
	for (int it = 0; it < SYN_POWER_ITERS; it++) {
		for (uint32_t t = 0; t < V; t++)
			next[t] = SYN_EPS / V;
		for (uint32_t s = 0; s < V; s++) {
			const double *cdf = c->cdf + (size_t)s * c->k;
			const uint32_t *succ = c->succ + (size_t)s * c->k;
			double prev = 0.0;
			for (int i = 0; i < c->k; i++) {
				next[succ[i]] += (1.0 - SYN_EPS) * c->pi[s] *
						 (cdf[i] - prev);
				prev = cdf[i];
			}
		}
		double sum = 0.0, diff = 0.0;
		for (uint32_t t = 0; t < V; t++)
			sum += next[t];
		for (uint32_t t = 0; t < V; t++) {
			next[t] /= sum;
			diff += fabs(next[t] - c->pi[t]);
		}
		double *tmp = c->pi;
		c->pi = next;
		next = tmp;
		if (diff < SYN_POWER_TOL)
			break;
	}
	free(next);
	return EPJ_OK;
}

/* H = sum_s pi(s) H(P(s, .)): the k successors carry their own mass, the
 * other V - k states EPS / V each. */
static double entropy_rate(const corpus_src *c)
{
	uint32_t V = c->vocab;
	double u = SYN_EPS / V;
	double rest = (double)(V - (uint32_t)c->k) * (u > 0 ? -u * log(u) : 0);
	double h = 0.0;
	for (uint32_t s = 0; s < V; s++) {
		double hs = rest;
		for (int i = 0; i < c->k; i++) {
			double p = succ_prob(c, s, i);
			hs -= p * log(p);
		}
		h += c->pi[s] * hs;
	}
	return h;
}

/* Draws the state after s. */
static uint32_t chain_step(const corpus_src *c, ej_rng *r, uint32_t s)
{
	double u = ej_rng_uniform(r);
	if (u < SYN_EPS) {
		/* Conditioned on u < EPS, u / EPS is uniform in [0, 1). */
		uint32_t t = (uint32_t)(u / SYN_EPS * c->vocab);
		return t < c->vocab ? t : c->vocab - 1;
	}
	u = (u - SYN_EPS) / (1.0 - SYN_EPS);
	const double *cdf = c->cdf + (size_t)s * c->k;
	int i = 0;
	while (i < c->k - 1 && u >= cdf[i])
		i++;
	return c->succ[(size_t)s * c->k + i];
}

static epj_corpus *corpus_new(epj_ctx *ctx, corpus_src *src, uint64_t stream)
{
	epj_corpus *c = calloc(1, sizeof *c);
	if (!c) {
		ej_error(ctx, EPJ_ERR_NOMEM, "corpus: out of memory");
		return NULL;
	}
	if (src->kind == SRC_DATASET) {
		/* stream 0 reads the train split, 1 validation, 2 test */
		if (stream > 2) {
			ej_error(ctx, EPJ_ERR_INVALID,
				 "dataset corpus: stream %llu is not a split "
				 "(0 train, 1 validation, 2 test)",
				 (unsigned long long)stream);
			free(c);
			return NULL;
		}
		c->dst = ej_dstream_new(ctx, src->ds, (int)stream);
		if (!c->dst) {
			free(c);
			return NULL;
		}
	}
	src->refcount++;
	c->src = src;
	if (src->kind == SRC_SYNTHETIC) {
		ej_rng_seed(&c->rng, mix64(src->seed ^ mix64(stream + 1)));
		/* First state from pi (inverse CDF). */
		double u = ej_rng_uniform(&c->rng), acc = 0.0;
		c->cur = src->vocab - 1;
		for (uint32_t s = 0; s < src->vocab; s++) {
			acc += src->pi[s];
			if (u < acc) {
				c->cur = s;
				break;
			}
		}
	}
	return c;
}

epj_corpus *epj_corpus_synthetic(epj_ctx *ctx, uint32_t vocab, uint64_t seed)
{
	if (vocab < 2 || vocab > SYN_MAX_VOCAB) {
		ej_error(ctx, EPJ_ERR_INVALID,
			 "corpus_synthetic: vocab %u out of range [2, %u]",
			 vocab, SYN_MAX_VOCAB);
		return NULL;
	}
	corpus_src *c = calloc(1, sizeof *c);
	if (!c) {
		ej_error(ctx, EPJ_ERR_NOMEM, "corpus_synthetic: out of memory");
		return NULL;
	}
	c->refcount = 1;
	c->kind = SRC_SYNTHETIC;
	c->vocab = vocab;
	c->seed = seed;
	c->k = vocab < SYN_SUCC ? (int)vocab : SYN_SUCC;
	c->succ = malloc((size_t)vocab * c->k * sizeof *c->succ);
	c->cdf = malloc((size_t)vocab * c->k * sizeof *c->cdf);
	if (!c->succ || !c->cdf) {
		ej_error(ctx, EPJ_ERR_NOMEM,
			 "corpus_synthetic: out of memory (vocab %u)", vocab);
		src_unref(c);
		return NULL;
	}
	/* The chain: k distinct successors per state, log-normal weights. */
	ej_rng r;
	ej_rng_seed(&r, seed);
	for (uint32_t s = 0; s < vocab; s++) {
		uint32_t *succ = c->succ + (size_t)s * c->k;
		double *cdf = c->cdf + (size_t)s * c->k;
		double sum = 0.0;
		for (int i = 0; i < c->k; i++) {
			bool dup;
			do {
				succ[i] = rng_below(&r, vocab);
				dup = false;
				for (int j = 0; j < i; j++)
					dup |= succ[j] == succ[i];
			} while (dup);
			cdf[i] = exp(SYN_SIGMA * ej_rng_normal(&r));
			sum += cdf[i];
		}
		double acc = 0.0;
		for (int i = 0; i < c->k; i++) {
			acc += cdf[i] / sum;
			cdf[i] = acc;
		}
		cdf[c->k - 1] = 1.0;
	}
	if (stationary(ctx, c) != EPJ_OK) {
		src_unref(c);
		return NULL;
	}
	c->entropy = entropy_rate(c);
	epj_corpus *out = corpus_new(ctx, c, 0);
	src_unref(c); /* the corpus holds its own reference (if any) */
	return out;
}

epj_corpus *epj_corpus_from_tokens(epj_ctx *ctx, const char *path)
{
	epj_tokens *tok;
	if (epj_tokens_read(ctx, path, &tok) != EPJ_OK)
		return NULL;
	if (tok->count < 2) {
		tok_error(ctx, EPJ_ERR_INVALID, path,
			  "%llu tokens; a corpus needs at least 2",
			  (unsigned long long)tok->count);
		epj_tokens_free(tok);
		return NULL;
	}
	corpus_src *c = calloc(1, sizeof *c);
	if (!c) {
		ej_error(ctx, EPJ_ERR_NOMEM, "corpus '%s': out of memory",
			 path);
		epj_tokens_free(tok);
		return NULL;
	}
	c->refcount = 1;
	c->kind = SRC_TOKENS;
	c->tok = tok;
	c->vocab = tok->vocab_size;
	if (!c->vocab) {
		uint32_t mx = 0;
		for (uint64_t i = 0; i < tok->count; i++)
			mx = tok->data[i] > mx ? tok->data[i] : mx;
		c->vocab = mx + 1;
	}
	c->entropy = NAN;
	epj_corpus *out = corpus_new(ctx, c, 0);
	src_unref(c);
	return out;
}

epj_corpus *epj_corpus_dataset(epj_ctx *ctx, const char *spec,
			       const epj_data_opts *o)
{
	ej_dsrc *ds = ej_dsrc_open(ctx, spec, o);
	if (!ds)
		return NULL;
	corpus_src *c = calloc(1, sizeof *c);
	if (!c) {
		ej_error(ctx, EPJ_ERR_NOMEM, "dataset '%s': out of memory",
			 spec);
		ej_dsrc_free(ds);
		return NULL;
	}
	c->refcount = 1;
	c->kind = SRC_DATASET;
	c->ds = ds;
	c->vocab = ej_dsrc_vocab(ds);
	c->entropy = NAN;
	epj_corpus *out = corpus_new(ctx, c, 0);
	src_unref(c);
	return out;
}

bool epj_corpus_has_loss_mask(const epj_corpus *c)
{
	return c && c->src->kind == SRC_DATASET &&
	       ej_dsrc_has_loss_mask(c->src->ds);
}

uint64_t epj_corpus_split_tokens(const epj_corpus *c, int split)
{
	if (!c || c->src->kind != SRC_DATASET)
		return UINT64_MAX;
	return ej_dsrc_split_tokens(c->src->ds, split);
}

bool epj_data_spec_p(const char *spec)
{
	if (!spec || !*spec)
		return false;
	if (strpbrk(spec, " \t\n"))
		return true;
	size_t n = strlen(spec);
	if (n >= 4 && !strcmp(spec + n - 4, ".npy"))
		return true;
	char *idx = malloc(n + 5);
	if (!idx)
		return false;
	snprintf(idx, n + 5, "%s.idx", spec);
	bool ok = access(idx, F_OK) == 0;
	free(idx);
	return ok;
}

epj_corpus *epj_corpus_fork(epj_ctx *ctx, const epj_corpus *c, uint64_t stream)
{
	if (!c) {
		ej_error(ctx, EPJ_ERR_INVALID, "corpus_fork: corpus is NULL");
		return NULL;
	}
	return corpus_new(ctx, c->src, stream);
}

void epj_corpus_free(epj_corpus *c)
{
	if (!c)
		return;
	ej_dstream_free(c->dst);
	src_unref(c->src);
	free(c);
}

uint32_t epj_corpus_vocab(const epj_corpus *c)
{
	return c ? c->src->vocab : 0;
}

double epj_corpus_entropy_rate(const epj_corpus *c)
{
	return c ? c->src->entropy : NAN;
}

const double *epj_corpus_stationary(const epj_corpus *c)
{
	return c && c->src->kind == SRC_SYNTHETIC ? c->src->pi : NULL;
}

static epj_status next_batch(epj_ctx *ctx, epj_corpus *c, int64_t B, int64_t T,
			     epj_tensor **input_ids, epj_tensor **labels);

/* Timed as profile.data under EPJIT_PROFILE. */
epj_status epj_corpus_next_batch(epj_ctx *ctx, epj_corpus *c, int64_t B,
				 int64_t T, epj_tensor **input_ids,
				 epj_tensor **labels)
{
	ej_prof pf;
	ej_prof_begin(ctx, &pf);
	epj_status st = next_batch(ctx, c, B, T, input_ids, labels);
	ej_prof_end(ctx, &pf, "data");
	return st;
}

epj_status epj_corpus_skip(epj_ctx *ctx, epj_corpus *c, int64_t n, int64_t B,
			   int64_t T)
{
	int64_t rows;
	if (!c || n < 0 || B < 1 || T < 1 ||
	    __builtin_mul_overflow(n, B, &rows))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"corpus_skip: %s (n=%lld, B=%lld, T=%lld)",
				!c ? "corpus is NULL"
				   : "n must be >= 0, B and T >= 1",
				(long long)n, (long long)B, (long long)T);
	const corpus_src *src = c->src;
	if (src->kind == SRC_DATASET)
		return ej_dstream_skip(ctx, c->dst, (uint64_t)rows);
	if (src->kind == SRC_SYNTHETIC) {
		/* a Markov chain: stepped token by token, as next_batch
		 * would, without building the batches */
		uint32_t x = c->cur;
		for (int64_t r = 0; r < rows; r++)
			for (int64_t t = 0; t < T; t++)
				x = chain_step(src, &c->rng, x);
		c->cur = x;
		return EPJ_OK;
	}
	/* a token file: each row advances the position by T, modulo the
	 * token count */
	uint64_t cnt = src->tok->count;
	unsigned __int128 adv = (unsigned __int128)(uint64_t)rows * (uint64_t)T;
	c->pos = (uint64_t)(((unsigned __int128)c->pos + adv % cnt) % cnt);
	return EPJ_OK;
}

static epj_status next_batch(epj_ctx *ctx, epj_corpus *c, int64_t B, int64_t T,
			     epj_tensor **input_ids, epj_tensor **labels)
{
	if (input_ids)
		*input_ids = NULL;
	if (labels)
		*labels = NULL;
	if (!c || !input_ids || !labels)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"corpus_next_batch: %s is NULL",
				!c ? "corpus" : "an output pointer");
	int64_t n;
	if (B < 1 || T < 1 || __builtin_mul_overflow(B, T, &n) ||
	    n > INT64_MAX / 8)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"corpus_next_batch: B=%lld, T=%lld: both must "
				"be >= 1 and B*T must fit in memory",
				(long long)B, (long long)T);
	int64_t *in = malloc((size_t)n * sizeof *in);
	int64_t *lab = malloc((size_t)n * sizeof *lab);
	if (!in || !lab) {
		free(in);
		free(lab);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"corpus_next_batch: out of memory for "
				"[%lld, %lld]",
				(long long)B, (long long)T);
	}
	const corpus_src *src = c->src;
	for (int64_t b = 0; b < B; b++) {
		int64_t *row_in = in + b * T, *row_lab = lab + b * T;
		if (src->kind == SRC_DATASET) {
			epj_status st =
			    ej_dstream_row(ctx, c->dst, T, row_in, row_lab);
			if (st != EPJ_OK) {
				free(in);
				free(lab);
				return st;
			}
		} else if (src->kind == SRC_SYNTHETIC) {
			uint32_t x = c->cur;
			for (int64_t t = 0; t < T; t++) {
				row_in[t] = x;
				x = chain_step(src, &c->rng, x);
				row_lab[t] = x;
			}
			c->cur = x;
		} else {
			const uint32_t *d = src->tok->data;
			uint64_t cnt = src->tok->count, p = c->pos;
			for (int64_t t = 0; t < T; t++) {
				row_in[t] = d[p];
				p = p + 1 == cnt ? 0 : p + 1;
				row_lab[t] = d[p];
			}
			c->pos = p;
		}
	}
	int64_t shape[2] = { B, T };
	*input_ids = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2, shape, in);
	*labels = *input_ids
		      ? epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2, shape, lab)
		      : NULL;
	free(in);
	free(lab);
	if (!*labels) {
		epj_tensor_free(*input_ids);
		*input_ids = NULL;
		return ctx->status != EPJ_OK ? ctx->status : EPJ_ERR_NOMEM;
	}
	return EPJ_OK;
}
