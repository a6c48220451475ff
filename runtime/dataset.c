/* dataset.c -- token datasets as data pipelines write them: Megatron-LM
 * indexed datasets and numpy .npy arrays, read with pread(), split,
 * shuffled, packed into samples and blended (doc/formats.md).
 *
 * Readers (epj_docs).  Every header field and size is checked against the
 * file sizes before a token is touched: a Megatron .idx must hold exactly
 * its header, lengths, pointers and document indices (plus, optionally, one
 * mode byte per sequence, a loss mask's tie record and epjit-tokenize's
 * pairing record), the
 * sequences must lie end to end from byte 0 and fill the .bin exactly, the
 * .bin must match the pairing record when there is one, and the document
 * indices must run from 0 to the sequence count without decreasing.  The
 * index's lengths and pointers are copied at open; tokens are read with
 * pread() at each batch, so a file changed under a running reader is an
 * error status, never a crash.  A .npy header must be a
 * little-endian integer dtype, C order, 1-D or 2-D, and the data exactly
 * the shape's size.  Token values are checked as they are read (negative
 * or >= vocab is an error naming the file and document), so opening a
 * large dataset costs one pass over the index and, for a paired .bin, at
 * most 256 KiB of it (the fingerprint), none over the other tokens.
 *
 * Loss masks (supervised fine-tuning; doc/formats.md).  Beside a Megatron
 * prefix P, the Megatron indexed dataset P.lossmask (P.lossmask.bin +
 * .idx, uint8) holds one byte per token: 1 where the token, as a target,
 * counts in the loss (a completion), 0 where it does not (a prompt).  It
 * is opened with every check of a token index, and must have the token
 * index's sequence lengths and a tie record naming the size and
 * fingerprint of P.bin; its values are checked (0 or 1) as they are read.
 * A target whose mask byte is 0 becomes the label -100 (ignored).
 *
 * Streams.  A Megatron sequence, a .npy row (or the whole 1-D array) is one
 * document.  Documents [0, n) of a source are split into contiguous
 * train / validation / test ranges by the split weights (Megatron's rule:
 * the running sum of the normalised weights times n, rounded).  Epoch e of
 * a split is: the split's documents in an order shuffled from (seed,
 * source, split, e), concatenated into L tokens as stored -- no token is
 * inserted between documents: the tokenizer appends the end-of-document
 * token (epjit-tokenize --append-eod, Megatron's preprocess_data.py
 * --append-eod), as GPTDataset also assumes -- then cut into S = (L - 1) / T
 * samples of T + 1 tokens (sample j starts at token j * T), taken in an
 * order shuffled from the same key.  The tail of fewer than T tokens is not
 * seen in that epoch.  Sample g of a stream is sample g mod S of epoch
 * g / S, so a position is one counter per source and skipping reads no
 * token; a stream caches the orders of its current epoch only.
 *
 * Blends.  Sample i of a blend comes from the source j maximising
 * w_j * (i + 1) - taken_j (ties: the first), Megatron's greedy
 * blending: after i samples every source is within one sample of its
 * share w_j * i.
 */
#include "core_impl.h"
#include "dataset_impl.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define IDX_MAGIC     "MMIDIDX\0\0"
#define IDX_MAGIC_LEN 9
#define IDX_HEADER    34 /* magic, u64 version, u8 dtype, u64 n, u64 d */
#define NPY_MAGIC     "\x93NUMPY"
#define MAX_SOURCES   64
#define SPLITS	      3

static const char *const split_names[SPLITS] = { "train", "validation",
						 "test" };

/* ---- files ------------------------------------------------------------- */

/* Opens path read-only, a regular file (a FIFO is refused, not waited on),
 * and gives its size. */
static epj_status open_file(epj_ctx *ctx, const char *what, const char *path,
			    int *fd, uint64_t *size)
{
	*fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
	if (*fd < 0)
		return ej_error(ctx, EPJ_ERR_IO, "%s '%s': cannot open: %s",
				what, path, strerror(errno));
	struct stat st;
	if (fstat(*fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		int e = errno;
		bool reg = S_ISREG(st.st_mode);
		close(*fd);
		*fd = -1;
		return ej_error(ctx, EPJ_ERR_IO, "%s '%s': %s", what, path,
				reg ? strerror(e) : "not a regular file");
	}
	*size = (uint64_t)st.st_size;
	return EPJ_OK;
}

/* Reads n bytes at byte off of fd into buf: the count read, short only at
 * the end of the file, or -1 with errno set. */
static int64_t read_at(int fd, void *buf, size_t n, uint64_t off)
{
	size_t got = 0;
	while (got < n) {
		if (off + got > (uint64_t)INT64_MAX)
			return (int64_t)got; /* past any file: its end */
		ssize_t r =
		    pread(fd, (char *)buf + got, n - got, (off_t)(off + got));
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -1;
		if (r == 0)
			break;
		got += (size_t)r;
	}
	return (int64_t)got;
}

static uint64_t le64(const unsigned char *p)
{
	uint64_t v;
	memcpy(&v, p, 8); /* little-endian host (data.c asserts it) */
	return v;
}

static uint32_t le32(const unsigned char *p)
{
	uint32_t v;
	memcpy(&v, p, 4);
	return v;
}

/* ---- epj_docs ------------------------------------------------------------ */

/* Nothing is read from a live mapping: what was validated at open is what
 * is used (a Megatron index is copied: lengths and pointers, 12 bytes a
 * sequence), and tokens are read with pread() from the file opened then, so
 * a file rewritten, truncated or replaced while a run reads it gives an
 * error status (or, rewritten in place, other token values, still checked
 * against the vocabulary), never a read outside the data or a SIGBUS. */
struct epj_docs {
	char *name;	/* the data file, for messages */
	int fd;		/* the .bin or .npy, read with pread(); -1: none */
	uint64_t size;	/* its size when opened */
	int esz;	/* bytes per token */
	bool is_signed; /* int8/16/32/64 */
	uint64_t ndocs, ntokens;
	/* Megatron: the index's validated lengths and byte pointers */
	uint32_t *lens;
	uint64_t *ptrs;
	/* npy: documents of rowlen tokens from byte off */
	uint64_t off, rowlen;
	/* the loss mask (PREFIX.lossmask), NULL: none */
	struct epj_docs *mask;
};

static epj_status docs_err(epj_ctx *ctx, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static epj_status docs_err(epj_ctx *ctx, const char *path, const char *fmt, ...)
{
	char msg[768];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	return ej_error(ctx, EPJ_ERR_FORMAT, "dataset '%s': %s", path, msg);
}

/* Megatron dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
 * 6 float64, 7 float32, 8 uint16. */
static epj_status idx_dtype(epj_ctx *ctx, const char *path, unsigned code,
			    epj_docs *d)
{
	static const int size[9] = { 0, 1, 1, 2, 4, 8, 8, 4, 2 };
	if (code == 6 || code == 7)
		return docs_err(ctx, path,
				"dtype code %u (%s) holds floating-point "
				"values; token ids must be integers (codes 1-5 "
				"and 8)",
				code, code == 6 ? "float64" : "float32");
	if (code < 1 || code > 8)
		return docs_err(ctx, path,
				"unknown dtype code %u (Megatron's codes are "
				"1-8)",
				code);
	d->esz = size[code];
	d->is_signed = code >= 2 && code <= 5;
	return EPJ_OK;
}

/* The pairing record epjit-tokenize appends to a .idx (after the document
 * indices and any mode bytes; Megatron's readers ignore it): the size and
 * the fingerprint of the .bin written with it (doc/formats.md). */
#define PAIR_MAGIC "EPJPAIR1"
#define PAIR_LEN   32 /* magic, u64 .bin bytes, u64 fingerprint, u64 0 */
#define FP_BLOCK   4096
#define FP_BLOCKS  64
#define FNV_OFFSET 0xcbf29ce484222325ull
#define FNV_PRIME  0x100000001b3ull

/* The tie record of a loss mask's .idx (before its pairing record): the
 * size and fingerprint of the token .bin it was written with. */
#define MASK_MAGIC "EPJMASK1"

/* What the header of a Megatron index says, read and checked. */
typedef struct idx_info {
	int fd;
	uint64_t size, nseq, ndoc;
	bool paired; /* a pairing record ends the file */
	uint64_t pair_bytes, pair_fp;
	bool tied; /* a loss mask's tie record precedes it */
	uint64_t tie_bytes, tie_fp;
} idx_info;

/* Reads the 32-byte record that ends at byte end of the index: true (with
 * its two values) when it has magic and a zero reserved field. */
static bool idx_record(const idx_info *x, uint64_t end, const char *magic,
		       uint64_t *bytes, uint64_t *fp)
{
	unsigned char t[PAIR_LEN];
	if (end < PAIR_LEN ||
	    read_at(x->fd, t, PAIR_LEN, end - PAIR_LEN) != PAIR_LEN)
		return false;
	if (memcmp(t, magic, 8) != 0 || le64(t + 24) != 0)
		return false;
	*bytes = le64(t + 8);
	*fp = le64(t + 16);
	return true;
}

/* The header, the counts against the file size, and what follows the
 * document indices: nothing, n mode bytes, a pairing record, or both. */
static epj_status idx_header(epj_ctx *ctx, const char *path, idx_info *x,
			     epj_docs *d)
{
	unsigned char p[IDX_HEADER];
	uint64_t isz = x->size;
	if (isz < IDX_HEADER || read_at(x->fd, p, IDX_HEADER, 0) != IDX_HEADER)
		return docs_err(
		    ctx, path,
		    "truncated: %llu bytes, shorter than the %d-byte "
		    "header",
		    (unsigned long long)isz, IDX_HEADER);
	if (memcmp(p, IDX_MAGIC, IDX_MAGIC_LEN) != 0)
		return docs_err(ctx, path,
				"bad magic (not a Megatron index; expected "
				"\"MMIDIDX\\0\\0\")");
	uint64_t version = le64(p + 9);
	if (version != 1)
		return docs_err(ctx, path,
				"unsupported version %llu (this build reads "
				"version 1)",
				(unsigned long long)version);
	epj_status s = idx_dtype(ctx, path, p[17], d);
	if (s != EPJ_OK)
		return s;
	uint64_t nseq = le64(p + 18), ndoc = le64(p + 26);
	/* header + 4 n + 8 n + 8 d bytes, plus n mode bytes (multimodal) */
	uint64_t need, a, b;
	if (__builtin_mul_overflow(nseq, (uint64_t)12, &a) ||
	    __builtin_mul_overflow(ndoc, (uint64_t)8, &b) ||
	    __builtin_add_overflow(a, b, &need) ||
	    __builtin_add_overflow(need, (uint64_t)IDX_HEADER, &need) ||
	    need > isz)
		return docs_err(ctx, path,
				"truncated: %llu sequences and %llu document "
				"indices need more than the file's %llu bytes",
				(unsigned long long)nseq,
				(unsigned long long)ndoc,
				(unsigned long long)isz);
	/* after the arrays: [modes (nseq)] [tie record] [pairing record] */
	uint64_t extra = isz - need, end = isz;
	x->paired = x->tied = false;
	if (extra >= PAIR_LEN &&
	    idx_record(x, end, PAIR_MAGIC, &x->pair_bytes, &x->pair_fp)) {
		x->paired = true;
		extra -= PAIR_LEN;
		end -= PAIR_LEN;
	}
	if (extra >= PAIR_LEN &&
	    idx_record(x, end, MASK_MAGIC, &x->tie_bytes, &x->tie_fp)) {
		x->tied = true;
		extra -= PAIR_LEN;
	}
	if (extra != 0 && extra != nseq)
		return docs_err(ctx, path,
				"%llu bytes after the document indices "
				"(expected 0, %llu sequence modes, and/or a "
				"%d-byte \"" MASK_MAGIC "\" tie record and a "
				"\"" PAIR_MAGIC "\" pairing record)",
				(unsigned long long)extra,
				(unsigned long long)nseq, PAIR_LEN);
	if (nseq == 0)
		return docs_err(ctx, path, "no sequences");
	x->nseq = nseq;
	x->ndoc = ndoc;
	return EPJ_OK;
}

/* Copies the lengths and pointers into d, and checks that the document
 * indices run from 0 to n without decreasing (read in chunks, not kept). */
static epj_status idx_arrays(epj_ctx *ctx, const char *path, idx_info *x,
			     epj_docs *d)
{
	uint64_t n = x->nseq;
	d->lens = malloc((size_t)n * sizeof *d->lens);
	d->ptrs = malloc((size_t)n * sizeof *d->ptrs);
	if (!d->lens || !d->ptrs)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"dataset index '%s': out of memory for %llu "
				"sequences",
				path, (unsigned long long)n);
	if (read_at(x->fd, d->lens, (size_t)n * 4, IDX_HEADER) !=
		(int64_t)(n * 4) ||
	    read_at(x->fd, d->ptrs, (size_t)n * 8, IDX_HEADER + 4 * n) !=
		(int64_t)(n * 8))
		return docs_err(ctx, path, "truncated while read");
	if (x->ndoc < 2)
		goto bad_range;
	uint64_t prev = 0, buf[1024];
	for (uint64_t i = 0; i < x->ndoc; i += 1024) {
		uint64_t k = x->ndoc - i < 1024 ? x->ndoc - i : 1024;
		if (read_at(x->fd, buf, (size_t)k * 8,
			    IDX_HEADER + 12 * n + 8 * i) != (int64_t)(k * 8))
			return docs_err(ctx, path, "truncated while read");
		for (uint64_t j = 0; j < k; j++) {
			if (i + j == 0 && buf[0] != 0)
				goto bad_range;
			if (buf[j] < prev)
				return docs_err(
				    ctx, path,
				    "document index %llu (%lld) is below "
				    "the one before it",
				    (unsigned long long)(i + j),
				    (long long)buf[j]);
			prev = buf[j];
		}
	}
	if (prev != n)
		goto bad_range;
	return EPJ_OK;
bad_range:
	return docs_err(ctx, path,
			"document indices must run from 0 to the sequence "
			"count %llu (%llu of them)",
			(unsigned long long)n, (unsigned long long)x->ndoc);
}

/* Megatron's writer lays the sequences end to end from byte 0 (pointer
 * i = the bytes of sequences 0..i-1) and the .bin holds nothing else: so
 * the index accounts for every byte of its .bin, and a .bin of another
 * size is not this index's. */
static epj_status bin_layout(epj_ctx *ctx, const char *idx_path,
			     const char *bin_path, epj_docs *d)
{
	uint64_t bsz = d->size, end = 0, total = 0;
	for (uint64_t i = 0; i < d->ndocs; i++) {
		int32_t len = (int32_t)d->lens[i];
		int64_t ptr = (int64_t)d->ptrs[i];
		uint64_t bytes =
		    (uint64_t)(len < 0 ? 0 : len) * (uint64_t)d->esz;
		if (len < 0 || ptr < 0)
			return docs_err(
			    ctx, idx_path, "sequence %llu: negative %s %lld",
			    (unsigned long long)i,
			    len < 0 ? "length" : "pointer",
			    len < 0 ? (long long)len : (long long)ptr);
		if ((uint64_t)ptr % (uint64_t)d->esz != 0)
			return docs_err(ctx, idx_path,
					"sequence %llu: pointer %lld is not a "
					"multiple of the %d-byte token size",
					(unsigned long long)i, (long long)ptr,
					d->esz);
		if ((uint64_t)ptr < end)
			return docs_err(
			    ctx, idx_path,
			    "sequence %llu: pointer %lld is before the "
			    "end %llu of sequence %llu (pointers must "
			    "be sorted, sequences disjoint)",
			    (unsigned long long)i, (long long)ptr,
			    (unsigned long long)end,
			    (unsigned long long)(i - 1));
		if ((uint64_t)ptr > bsz || bytes > bsz - (uint64_t)ptr)
			return docs_err(
			    ctx, bin_path,
			    "sequence %llu: bytes [%lld, %llu) are "
			    "outside the %llu-byte file",
			    (unsigned long long)i, (long long)ptr,
			    (unsigned long long)((uint64_t)ptr + bytes),
			    (unsigned long long)bsz);
		if ((uint64_t)ptr > end)
			return docs_err(
			    ctx, idx_path,
			    "sequence %llu: pointer %lld leaves a gap of %llu "
			    "bytes after %s (Megatron's sequences are "
			    "contiguous from byte 0)",
			    (unsigned long long)i, (long long)ptr,
			    (unsigned long long)((uint64_t)ptr - end),
			    i ? "the sequence before it" : "byte 0");
		end = (uint64_t)ptr + bytes;
		total += (uint64_t)len;
	}
	if (end != bsz)
		return docs_err(ctx, bin_path,
				"%llu bytes, but its index '%s' accounts for "
				"%llu (%llu trailing bytes: a .bin and .idx "
				"from different runs?)",
				(unsigned long long)bsz, idx_path,
				(unsigned long long)end,
				(unsigned long long)(bsz - end));
	d->ntokens = total;
	return EPJ_OK;
}

/* FNV-1a (64 bits) of the sampled bytes of d's file: all of it up to
 * FP_BLOCKS blocks of FP_BLOCK bytes, else FP_BLOCKS blocks of FP_BLOCK bytes
 * at k (size - FP_BLOCK) / (FP_BLOCKS - 1), k = 0 .. FP_BLOCKS - 1 (the
 * first and the last block included). */
static epj_status bin_fingerprint(epj_ctx *ctx, const epj_docs *d, uint64_t *fp)
{
	unsigned char buf[FP_BLOCK];
	uint64_t h = FNV_OFFSET, S = d->size;
	bool whole = S <= (uint64_t)FP_BLOCKS * FP_BLOCK;
	uint64_t nblk = whole ? (S + FP_BLOCK - 1) / FP_BLOCK : FP_BLOCKS;
	for (uint64_t k = 0; k < nblk; k++) {
		uint64_t off =
		    whole ? k * FP_BLOCK
			  : (uint64_t)((unsigned __int128)k * (S - FP_BLOCK) /
				       (FP_BLOCKS - 1));
		size_t n =
		    whole && S - off < FP_BLOCK ? (size_t)(S - off) : FP_BLOCK;
		if (read_at(d->fd, buf, n, off) != (int64_t)n)
			return ej_error(ctx, EPJ_ERR_IO,
					"dataset '%s': cannot read bytes "
					"[%llu, %llu): %s",
					d->name, (unsigned long long)off,
					(unsigned long long)(off + n),
					errno ? strerror(errno)
					      : "the file shrank");
		for (size_t i = 0; i < n; i++)
			h = (h ^ buf[i]) * FNV_PRIME;
	}
	*fp = h;
	return EPJ_OK;
}

/* The .bin against the pairing record of its .idx, when it has one: its
 * size, and with `content` its fingerprint too. */
static epj_status bin_paired(epj_ctx *ctx, const char *idx_path,
			     const idx_info *x, const epj_docs *d, bool content)
{
	if (!x->paired || (x->pair_bytes == d->size && !content))
		return EPJ_OK;
	uint64_t fp = 0;
	if (x->pair_bytes == d->size) {
		errno = 0;
		epj_status s = bin_fingerprint(ctx, d, &fp);
		if (s != EPJ_OK)
			return s;
		if (fp == x->pair_fp)
			return EPJ_OK;
	}
	if (x->pair_bytes != d->size)
		return docs_err(ctx, d->name,
				"%llu bytes, but its index '%s' was written "
				"with a .bin of %llu bytes (its pairing "
				"record): an interrupted epjit-tokenize, or "
				"files of two runs; write both again",
				(unsigned long long)d->size, idx_path,
				(unsigned long long)x->pair_bytes);
	return docs_err(ctx, d->name,
			"fingerprint %016llx, but its index '%s' was written "
			"with a .bin of fingerprint %016llx (its pairing "
			"record): an interrupted epjit-tokenize, or files of "
			"two runs; write both again",
			(unsigned long long)fp, idx_path,
			(unsigned long long)x->pair_fp);
}

static epj_status megatron_files(epj_ctx *ctx, const char *prefix, epj_docs *d,
				 idx_info *x);
static void docs_close(epj_docs *d);

/* The loss mask of the token docs d (prefix), when PREFIX.lossmask.idx
 * exists: every check of a token index, dtype uint8, the tokens' sequence
 * lengths, and a tie record naming the size and fingerprint of d's .bin. */
static epj_status mask_open(epj_ctx *ctx, const char *prefix, epj_docs *d)
{
	size_t n = strlen(prefix) + sizeof ".lossmask.idx";
	char *mp = malloc(n), *ip = malloc(n);
	epj_docs *m = calloc(1, sizeof *m);
	idx_info x = { .fd = -1 };
	epj_status s = EPJ_OK;
	if (!mp || !ip || !m) {
		s = ej_error(ctx, EPJ_ERR_NOMEM, "dataset '%s': out of memory",
			     prefix);
		goto out;
	}
	snprintf(mp, n, "%s.lossmask", prefix);
	snprintf(ip, n, "%s.lossmask.idx", prefix);
	m->fd = -1;
	if (access(ip, F_OK) != 0)
		goto out; /* no mask */
	if ((s = megatron_files(ctx, mp, m, &x)) != EPJ_OK)
		goto out;
	/* the tie first: it names the likelier cause (files of two runs) */
	uint64_t fp = 0;
	if (!x.tied)
		s = docs_err(ctx, ip,
			     "no \"" MASK_MAGIC "\" tie record naming its "
			     "token file (epjit-tokenize writes one)");
	if (s == EPJ_OK && x.tie_bytes == d->size) {
		errno = 0;
		s = bin_fingerprint(ctx, d, &fp);
	}
	if (s == EPJ_OK && (x.tie_bytes != d->size || fp != x.tie_fp))
		s = docs_err(ctx, ip,
			     "written for a token file of %llu bytes and "
			     "fingerprint %016llx, not '%s' (%llu bytes, "
			     "fingerprint %016llx): a mask of other data, or "
			     "an interrupted epjit-tokenize; write both again",
			     (unsigned long long)x.tie_bytes,
			     (unsigned long long)x.tie_fp, d->name,
			     (unsigned long long)d->size,
			     (unsigned long long)fp);
	if (s == EPJ_OK && (m->esz != 1 || m->is_signed))
		s = docs_err(ctx, ip,
			     "a loss mask holds uint8 values (dtype code 1)");
	else if (s == EPJ_OK && m->ndocs != d->ndocs)
		s = docs_err(
		    ctx, ip, "%llu sequences, but the token index has %llu",
		    (unsigned long long)m->ndocs, (unsigned long long)d->ndocs);
	for (uint64_t i = 0; s == EPJ_OK && i < m->ndocs; i++)
		if (m->lens[i] != d->lens[i])
			s = docs_err(ctx, ip,
				     "sequence %llu has %u mask values for "
				     "%u tokens",
				     (unsigned long long)i, m->lens[i],
				     d->lens[i]);
	if (s == EPJ_OK) {
		d->mask = m;
		m = NULL;
	}
out:
	if (m)
		docs_close(m);
	free(mp);
	free(ip);
	return s;
}

static epj_status megatron_open(epj_ctx *ctx, const char *prefix, epj_docs *d)
{
	idx_info x = { .fd = -1 };
	epj_status s = megatron_files(ctx, prefix, d, &x);
	return s == EPJ_OK ? mask_open(ctx, prefix, d) : s;
}

/* The index and data files of prefix into d; x: what the index says. */
static epj_status megatron_files(epj_ctx *ctx, const char *prefix, epj_docs *d,
				 idx_info *x)
{
	size_t n = strlen(prefix);
	char *idx_path = malloc(n + 5), *bin_path = malloc(n + 5);
	epj_status s = EPJ_OK;
	if (!idx_path || !bin_path) {
		s = ej_error(ctx, EPJ_ERR_NOMEM, "dataset '%s': out of memory",
			     prefix);
		goto out;
	}
	snprintf(idx_path, n + 5, "%s.idx", prefix);
	snprintf(bin_path, n + 5, "%s.bin", prefix);
	d->name = strdup(bin_path);
	if (!d->name) {
		s = ej_error(ctx, EPJ_ERR_NOMEM, "dataset '%s': out of memory",
			     prefix);
		goto out;
	}
	if ((s = open_file(ctx, "dataset index", idx_path, &x->fd, &x->size)) !=
		EPJ_OK ||
	    (s = idx_header(ctx, idx_path, x, d)) != EPJ_OK ||
	    (s = idx_arrays(ctx, idx_path, x, d)) != EPJ_OK)
		goto out;
	d->ndocs = x->nseq;
	/* the pairing record's size first: it names the likelier cause */
	if ((s = open_file(ctx, "dataset", bin_path, &d->fd, &d->size)) !=
		EPJ_OK ||
	    (s = bin_paired(ctx, idx_path, x, d, false)) != EPJ_OK ||
	    (s = bin_layout(ctx, idx_path, bin_path, d)) != EPJ_OK ||
	    (s = bin_paired(ctx, idx_path, x, d, true)) != EPJ_OK)
		goto out;
out:
	if (x->fd >= 0)
		close(x->fd);
	x->fd = -1;
	free(idx_path);
	free(bin_path);
	return s;
}

/* ---- .npy header: a Python dict literal ---- */

typedef struct npy_hdr {
	char descr[16];
	int fortran; /* -1 missing */
	int ndim;    /* -1 missing */
	uint64_t shape[3];
} npy_hdr;

static const char *skip_ws(const char *p, const char *e)
{
	while (p < e && (*p == ' ' || *p == '\t' || *p == '\n'))
		p++;
	return p;
}

/* A quoted string into out (cap bytes); NULL on a syntax error. */
static const char *npy_str(const char *p, const char *e, char *out, size_t cap)
{
	if (p >= e || (*p != '\'' && *p != '"'))
		return NULL;
	char q = *p++;
	size_t n = 0;
	while (p < e && *p != q) {
		if (n + 1 >= cap)
			return NULL;
		out[n++] = *p++;
	}
	if (p >= e)
		return NULL;
	out[n] = '\0';
	return p + 1;
}

/* Parses {'descr': '<u2', 'fortran_order': False, 'shape': (3, 4), }. */
static bool npy_parse(const char *p, const char *e, npy_hdr *h)
{
	h->descr[0] = '\0';
	h->fortran = -1;
	h->ndim = -1;
	p = skip_ws(p, e);
	if (p >= e || *p++ != '{')
		return false;
	for (;;) {
		p = skip_ws(p, e);
		if (p < e && *p == '}')
			break;
		char key[32];
		if (!(p = npy_str(p, e, key, sizeof key)))
			return false;
		p = skip_ws(p, e);
		if (p >= e || *p++ != ':')
			return false;
		p = skip_ws(p, e);
		if (!strcmp(key, "descr")) {
			if (!(p = npy_str(p, e, h->descr, sizeof h->descr)))
				return false;
		} else if (!strcmp(key, "fortran_order")) {
			if (e - p >= 4 && !memcmp(p, "True", 4)) {
				h->fortran = 1;
				p += 4;
			} else if (e - p >= 5 && !memcmp(p, "False", 5)) {
				h->fortran = 0;
				p += 5;
			} else {
				return false;
			}
		} else if (!strcmp(key, "shape")) {
			if (p >= e || *p++ != '(')
				return false;
			h->ndim = 0;
			for (;;) {
				p = skip_ws(p, e);
				if (p < e && *p == ')')
					break;
				if (p >= e || !isdigit((unsigned char)*p) ||
				    h->ndim == 3)
					return false;
				uint64_t v = 0;
				while (p < e && isdigit((unsigned char)*p)) {
					if (v > (UINT64_MAX - 9) / 10)
						return false;
					v = v * 10 + (uint64_t)(*p++ - '0');
				}
				if (p < e && *p == 'L') /* Python 2 longs */
					p++;
				h->shape[h->ndim++] = v;
				p = skip_ws(p, e);
				if (p < e && *p == ',')
					p++;
				else if (p >= e || *p != ')')
					return false;
			}
			p++;
		} else {
			return false;
		}
		p = skip_ws(p, e);
		if (p < e && *p == ',')
			p++;
		else if (p >= e || *p != '}')
			return false;
	}
	p = skip_ws(p + 1, e);
	return p == e && h->descr[0] && h->fortran >= 0 && h->ndim >= 0;
}

#define NPY_MAX_HEADER (1u << 20)

static epj_status npy_open(epj_ctx *ctx, const char *path, epj_docs *d)
{
	d->name = strdup(path);
	if (!d->name)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"dataset '%s': out of memory", path);
	uint64_t size;
	epj_status s = open_file(ctx, "dataset", path, &d->fd, &size);
	if (s != EPJ_OK)
		return s;
	d->size = size;
	unsigned char p[12];
	if (size < 10 || read_at(d->fd, p, 10, 0) != 10 ||
	    memcmp(p, NPY_MAGIC, 6) != 0)
		return docs_err(ctx, path,
				"bad magic (not a numpy .npy file; expected "
				"\"\\x93NUMPY\")");
	unsigned major = p[6], minor = p[7];
	if (major < 1 || major > 3 || minor != 0)
		return docs_err(ctx, path,
				"unsupported .npy format version %u.%u (this "
				"build reads 1.0, 2.0 and 3.0)",
				major, minor);
	uint64_t hstart = major == 1 ? 10 : 12, hlen;
	if (size < hstart || read_at(d->fd, p, hstart, 0) != (int64_t)hstart)
		return docs_err(ctx, path, "truncated header");
	hlen = major == 1 ? (uint64_t)(p[8] | p[9] << 8) : le32(p + 8);
	if (hlen > size - hstart)
		return docs_err(ctx, path,
				"header of %llu bytes runs past the %llu-byte "
				"file",
				(unsigned long long)hlen,
				(unsigned long long)size);
	if (hlen > NPY_MAX_HEADER)
		return docs_err(ctx, path,
				"header of %llu bytes (this build reads "
				"headers of up to %u bytes)",
				(unsigned long long)hlen, NPY_MAX_HEADER);
	char *text = malloc(hlen ? (size_t)hlen : 1);
	if (!text)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"dataset '%s': out of memory", path);
	if (read_at(d->fd, text, (size_t)hlen, hstart) != (int64_t)hlen) {
		free(text);
		return docs_err(ctx, path, "truncated header");
	}
	npy_hdr h;
	bool parsed = npy_parse(text, text + hlen, &h);
	free(text);
	if (!parsed)
		return docs_err(ctx, path,
				"malformed header (expected {'descr': ..., "
				"'fortran_order': ..., 'shape': (...)})");
	static const struct {
		const char *descr;
		int esz;
		bool is_signed;
	} types[] = { { "<u2", 2, false },
		      { "<u4", 4, false },
		      { "<i4", 4, true },
		      { "<i8", 8, true } };
	int t = -1;
	for (int i = 0; i < 4; i++)
		if (!strcmp(h.descr, types[i].descr))
			t = i;
	if (t < 0)
		return docs_err(ctx, path,
				"dtype '%s' is not a token type (accepted: "
				"<u2, <u4, <i4, <i8%s)",
				h.descr,
				h.descr[0] == '>' ? "; big-endian data is not "
						    "read"
						  : "");
	if (h.fortran)
		return docs_err(ctx, path,
				"fortran_order is True; token arrays must be "
				"C order");
	if (h.ndim != 1 && h.ndim != 2)
		return docs_err(ctx, path,
				"%d-D array; token arrays are 1-D (one "
				"document) or 2-D (one document per row)",
				h.ndim);
	d->esz = types[t].esz;
	d->is_signed = types[t].is_signed;
	d->ndocs = h.ndim == 1 ? 1 : h.shape[0];
	d->rowlen = h.ndim == 1 ? h.shape[0] : h.shape[1];
	uint64_t have = size - hstart - hlen, need;
	if (__builtin_mul_overflow(d->ndocs, d->rowlen, &d->ntokens) ||
	    __builtin_mul_overflow(d->ntokens, (uint64_t)d->esz, &need) ||
	    need != have)
		return docs_err(ctx, path,
				"shape (%llu, %llu) of %d-byte tokens does not "
				"match the %llu data bytes",
				(unsigned long long)d->ndocs,
				(unsigned long long)d->rowlen, d->esz,
				(unsigned long long)have);
	if (d->ntokens == 0)
		return docs_err(ctx, path, "no tokens");
	d->off = hstart + hlen;
	return EPJ_OK;
}

static bool has_suffix(const char *s, const char *suf)
{
	size_t n = strlen(s), k = strlen(suf);
	return n >= k && !strcmp(s + n - k, suf);
}

epj_status epj_docs_open(epj_ctx *ctx, const char *path, epj_docs **out)
{
	if (!path || !out)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"epj_docs_open: %s is NULL",
				path ? "out" : "path");
	*out = NULL;
	epj_docs *d = calloc(1, sizeof *d);
	if (!d)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"dataset '%s': out of memory", path);
	d->fd = -1;
	epj_status s = has_suffix(path, ".npy") ? npy_open(ctx, path, d)
						: megatron_open(ctx, path, d);
	if (s != EPJ_OK) {
		epj_docs_free(d);
		return s;
	}
	*out = d;
	return EPJ_OK;
}

static void docs_close(epj_docs *d)
{
	if (!d)
		return;
	docs_close(d->mask);
	if (d->fd >= 0)
		close(d->fd);
	free(d->lens);
	free(d->ptrs);
	free(d->name);
	free(d);
}

void epj_docs_free(epj_docs *d)
{
	docs_close(d);
}

bool epj_docs_has_loss_mask(const epj_docs *d)
{
	return d && d->mask;
}

epj_status epj_docs_read_mask(epj_ctx *ctx, const epj_docs *d, uint64_t doc,
			      uint64_t off, uint64_t n, int64_t *out)
{
	if (!d || !d->mask) {
		for (uint64_t i = 0; out && i < n; i++)
			out[i] = 1;
		return EPJ_OK;
	}
	epj_status s = epj_docs_read(ctx, d->mask, doc, off, n, out);
	for (uint64_t i = 0; s == EPJ_OK && i < n; i++)
		if (out[i] != 0 && out[i] != 1)
			s = ej_error(ctx, EPJ_ERR_FORMAT,
				     "loss mask '%s': value %lld at index %llu "
				     "of sequence %llu is not 0 or 1",
				     d->mask->name, (long long)out[i],
				     (unsigned long long)(off + i),
				     (unsigned long long)doc);
	return s;
}

uint64_t epj_docs_count(const epj_docs *d)
{
	return d ? d->ndocs : 0;
}

uint64_t epj_docs_tokens(const epj_docs *d)
{
	return d ? d->ntokens : 0;
}

uint64_t epj_docs_len(const epj_docs *d, uint64_t doc)
{
	if (!d || doc >= d->ndocs)
		return 0;
	return d->lens ? d->lens[doc] : d->rowlen;
}

/* Byte offset of document doc in the data file (validated at open). */
static uint64_t doc_pos(const epj_docs *d, uint64_t doc)
{
	if (d->lens)
		return d->ptrs[doc];
	return d->off + doc * d->rowlen * (uint64_t)d->esz;
}

static int64_t tok_at(const epj_docs *d, const unsigned char *p)
{
	switch (d->esz) {
	case 1:
		return d->is_signed ? (int64_t)(int8_t)p[0] : (int64_t)p[0];
	case 2: {
		uint16_t v;
		memcpy(&v, p, 2);
		return d->is_signed ? (int64_t)(int16_t)v : (int64_t)v;
	}
	case 4: {
		uint32_t v;
		memcpy(&v, p, 4);
		return d->is_signed ? (int64_t)(int32_t)v : (int64_t)v;
	}
	default: {
		int64_t v;
		memcpy(&v, p, 8);
		return v;
	}
	}
}

epj_status epj_docs_read(epj_ctx *ctx, const epj_docs *d, uint64_t doc,
			 uint64_t off, uint64_t n, int64_t *out)
{
	if (!d || (n && !out))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"epj_docs_read: %s is NULL",
				d ? "out" : "docs");
	uint64_t len = epj_docs_len(d, doc);
	if (doc >= d->ndocs || off > len || n > len - off)
		return ej_error(
		    ctx, EPJ_ERR_INDEX,
		    "dataset '%s': tokens [%llu, %llu) of document "
		    "%llu are out of range (%llu documents; this "
		    "one has %llu tokens)",
		    d->name, (unsigned long long)off,
		    (unsigned long long)(off + n), (unsigned long long)doc,
		    (unsigned long long)d->ndocs, (unsigned long long)len);
	if (n == 0)
		return EPJ_OK;
	/* The raw tokens go to the tail of out and are widened front to
	 * back: token i (at byte (8 - esz) n + i esz) is read before out[i]
	 * is written, and out[i] ends where token i + 1 begins, or before. */
	size_t esz = (size_t)d->esz, bytes = (size_t)n * esz;
	unsigned char *raw = (unsigned char *)out + (8 - esz) * (size_t)n;
	uint64_t pos = doc_pos(d, doc) + off * esz;
	errno = 0;
	int64_t got = read_at(d->fd, raw, bytes, pos);
	if (got != (int64_t)bytes) {
		int e = errno;
		struct stat st;
		long long now =
		    fstat(d->fd, &st) == 0 ? (long long)st.st_size : -1;
		char why[160];
		if (got < 0)
			snprintf(why, sizeof why, "%s", strerror(e));
		else
			snprintf(why, sizeof why,
				 "the file ends at byte %lld; it had %llu "
				 "bytes when opened: it shrank while in use",
				 now, (unsigned long long)d->size);
		return ej_error(
		    ctx, EPJ_ERR_IO,
		    "dataset '%s': cannot read tokens [%llu, %llu) of "
		    "document %llu (bytes [%llu, %llu)): %s",
		    d->name, (unsigned long long)off,
		    (unsigned long long)(off + n), (unsigned long long)doc,
		    (unsigned long long)pos, (unsigned long long)(pos + bytes),
		    why);
	}
	for (uint64_t i = 0; i < n; i++)
		out[i] = tok_at(d, raw + i * esz);
	return EPJ_OK;
}

/* ---- sources, splits, blends --------------------------------------------- */

typedef struct source {
	epj_docs *docs;
	double weight;			 /* normalised */
	uint64_t lo[SPLITS], hi[SPLITS]; /* document range of each split */
	uint64_t tokens[SPLITS];
} source;

struct ej_dsrc {
	int n;
	source src[MAX_SOURCES];
	uint64_t seed;
	uint32_t vocab;
};

static epj_status parse_split(epj_ctx *ctx, const char *spec, double w[3])
{
	const char *p = spec;
	int k = 0;
	w[0] = w[1] = w[2] = 0;
	while (*p) {
		if (k == SPLITS)
			goto bad;
		char *end;
		errno = 0;
		double v = strtod(p, &end);
		if (end == p || errno || !isfinite(v) || v < 0)
			goto bad;
		w[k++] = v;
		p = end;
		while (*p == ' ')
			p++;
		if (*p == ',' || *p == '/')
			p++;
		else if (*p)
			goto bad;
	}
	if (k == 0 || w[0] + w[1] + w[2] <= 0)
		goto bad;
	if (!isfinite(w[0] + w[1] + w[2]))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"data split '%s': the weights add up to more "
				"than the largest double (%g); use smaller "
				"weights (e.g. \"969,30,1\")",
				spec, DBL_MAX);
	return EPJ_OK;
bad:
	return ej_error(ctx, EPJ_ERR_INVALID,
			"data split '%s': expected up to three non-negative "
			"weights \"train,validation,test\" with a positive sum "
			"(e.g. \"969,30,1\")",
			spec);
}

/* Megatron's rule: boundaries at round(cumulative normalised weight * n),
 * shifted so that the last one is n. */
static void split_docs(source *s, const double w[3])
{
	double sum = w[0] + w[1] + w[2];
	uint64_t n = s->docs->ndocs;
	int64_t b[SPLITS + 1] = { 0 };
	for (int i = 0; i < SPLITS; i++)
		b[i + 1] = b[i] + (int64_t)llround(w[i] / sum * (double)n);
	int64_t shift = b[SPLITS] - (int64_t)n;
	for (int i = 1; i <= SPLITS; i++) {
		b[i] -= shift;
		if (b[i] < 0)
			b[i] = 0;
		if (b[i] < b[i - 1])
			b[i] = b[i - 1];
	}
	for (int i = 0; i < SPLITS; i++) {
		s->lo[i] = (uint64_t)b[i];
		s->hi[i] = (uint64_t)b[i + 1];
		s->tokens[i] = 0;
		for (uint64_t j = s->lo[i]; j < s->hi[i]; j++)
			s->tokens[i] += epj_docs_len(s->docs, j);
	}
}

void ej_dsrc_free(ej_dsrc *d)
{
	if (!d)
		return;
	for (int i = 0; i < d->n; i++)
		epj_docs_free(d->src[i].docs);
	free(d);
}

/* Splits a blend "W1 P1 W2 P2 ..." (or a single path) into sources. */
ej_dsrc *ej_dsrc_open(epj_ctx *ctx, const char *spec, const epj_data_opts *o)
{
	if (!spec || !o) {
		ej_error(ctx, EPJ_ERR_INVALID, "corpus_dataset: %s is NULL",
			 spec ? "opts" : "spec");
		return NULL;
	}
	if (o->vocab < 2) {
		ej_error(ctx, EPJ_ERR_INVALID,
			 "dataset '%s': vocab %u, must be >= 2", spec,
			 o->vocab);
		return NULL;
	}
	double w[3];
	const char *split = o->split ? o->split : "969,30,1";
	if (parse_split(ctx, split, w) != EPJ_OK)
		return NULL;
	ej_dsrc *d = calloc(1, sizeof *d);
	char *copy = strdup(spec);
	if (!d || !copy) {
		free(d);
		free(copy);
		ej_error(ctx, EPJ_ERR_NOMEM, "dataset '%s': out of memory",
			 spec);
		return NULL;
	}
	d->seed = o->seed;
	d->vocab = o->vocab;
	char *words[2 * MAX_SOURCES + 1];
	int nw = 0;
	for (char *save = NULL, *t = strtok_r(copy, " \t\n", &save); t;
	     t = strtok_r(NULL, " \t\n", &save)) {
		if (nw == 2 * MAX_SOURCES + 1) {
			ej_error(ctx, EPJ_ERR_INVALID,
				 "data blend '%s': more than %d sources", spec,
				 MAX_SOURCES);
			goto fail;
		}
		words[nw++] = t;
	}
	bool blend = nw != 1;
	if (nw == 0 || (blend && nw % 2)) {
		ej_error(ctx, EPJ_ERR_INVALID,
			 "data blend '%s': expected \"WEIGHT PATH\" pairs",
			 spec);
		goto fail;
	}
	double wsum = 0;
	for (int i = 0; i < (blend ? nw / 2 : 1); i++) {
		source *s = &d->src[i];
		const char *path = blend ? words[2 * i + 1] : words[0];
		s->weight = 1;
		if (blend) {
			char *end;
			errno = 0;
			s->weight = strtod(words[2 * i], &end);
			if (*end || errno || !isfinite(s->weight) ||
			    s->weight <= 0) {
				ej_error(ctx, EPJ_ERR_INVALID,
					 "data blend '%s': weight '%s' of '%s' "
					 "is not a positive number",
					 spec, words[2 * i], path);
				goto fail;
			}
		}
		wsum += s->weight;
		if (epj_docs_open(ctx, path, &s->docs) != EPJ_OK)
			goto fail;
		d->n = i + 1;
		split_docs(s, w);
	}
	if (!isfinite(wsum)) {
		ej_error(ctx, EPJ_ERR_INVALID,
			 "data blend '%s': the weights add up to more than "
			 "the largest double (%g); use smaller weights",
			 spec, DBL_MAX);
		goto fail;
	}
	for (int i = 0; i < d->n; i++)
		d->src[i].weight /= wsum;
	free(copy);
	return d;
fail:
	free(copy);
	ej_dsrc_free(d);
	return NULL;
}

uint32_t ej_dsrc_vocab(const ej_dsrc *d)
{
	return d->vocab;
}

bool ej_dsrc_has_loss_mask(const ej_dsrc *d)
{
	for (int i = 0; i < d->n; i++)
		if (epj_docs_has_loss_mask(d->src[i].docs))
			return true;
	return false;
}

uint64_t ej_dsrc_split_tokens(const ej_dsrc *d, int split)
{
	if (split < 0 || split >= SPLITS)
		return 0;
	uint64_t m = UINT64_MAX;
	for (int i = 0; i < d->n; i++)
		if (d->src[i].tokens[split] < m)
			m = d->src[i].tokens[split];
	return m;
}

/* ---- streams ------------------------------------------------------------- */

/* One source's reader: next sample index and the current epoch's orders. */
typedef struct sstate {
	uint64_t next;	  /* samples taken */
	uint64_t epoch;	  /* of the cached orders; UINT64_MAX: none */
	int64_t T;	  /* the cache's sample length - 1 */
	uint64_t nsamp;	  /* S of the cached epoch */
	uint64_t *doc;	  /* [docs in split] shuffled document ids */
	uint64_t *prefix; /* [docs + 1] token offsets in the epoch */
	uint64_t *samp;	  /* [S] shuffled sample starts / T */
} sstate;

struct ej_dstream {
	const ej_dsrc *d;
	int split;
	uint64_t taken; /* samples of the blend */
	sstate st[MAX_SOURCES];
};

ej_dstream *ej_dstream_new(epj_ctx *ctx, const ej_dsrc *d, int split)
{
	if (split < 0 || split >= SPLITS) {
		ej_error(ctx, EPJ_ERR_INVALID,
			 "dataset corpus: stream %d is not a split (0 train, "
			 "1 validation, 2 test)",
			 split);
		return NULL;
	}
	ej_dstream *s = calloc(1, sizeof *s);
	if (!s) {
		ej_error(ctx, EPJ_ERR_NOMEM, "dataset corpus: out of memory");
		return NULL;
	}
	s->d = d;
	s->split = split;
	for (int i = 0; i < d->n; i++)
		s->st[i].epoch = UINT64_MAX;
	return s;
}

static void sstate_drop(sstate *t)
{
	free(t->doc);
	free(t->prefix);
	free(t->samp);
	t->doc = t->prefix = t->samp = NULL;
	t->epoch = UINT64_MAX;
}

void ej_dstream_free(ej_dstream *s)
{
	if (!s)
		return;
	for (int i = 0; i < s->d->n; i++)
		sstate_drop(&s->st[i]);
	free(s);
}

/* splitmix64 finaliser */
static uint64_t mix64(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ull;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint64_t below(ej_rng *r, uint64_t n)
{
	uint64_t limit = UINT64_MAX - UINT64_MAX % n, x;
	do
		x = ej_rng_next(r);
	while (x >= limit);
	return x % n;
}

/* Fisher-Yates over a[0..n) with r. */
static void shuffle(ej_rng *r, uint64_t *a, uint64_t n)
{
	for (uint64_t i = n; i > 1; i--) {
		uint64_t j = below(r, i), t = a[i - 1];
		a[i - 1] = a[j];
		a[j] = t;
	}
}

/* Samples per epoch of source i's split at sample length T + 1. */
static uint64_t epoch_samples(const ej_dstream *s, int i, int64_t T)
{
	uint64_t L = s->d->src[i].tokens[s->split];
	return L > (uint64_t)T ? (L - 1) / (uint64_t)T : 0;
}

/* Builds the orders of epoch e of source i. */
static epj_status build_epoch(epj_ctx *ctx, ej_dstream *s, int i, uint64_t e,
			      int64_t T)
{
	const source *src = &s->d->src[i];
	sstate *t = &s->st[i];
	uint64_t lo = src->lo[s->split], n = src->hi[s->split] - lo;
	uint64_t S = epoch_samples(s, i, T);
	sstate_drop(t);
	t->doc = malloc((n ? n : 1) * sizeof *t->doc);
	t->prefix = malloc((n + 1) * sizeof *t->prefix);
	t->samp = malloc((S ? S : 1) * sizeof *t->samp);
	if (!t->doc || !t->prefix || !t->samp) {
		sstate_drop(t);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"dataset '%s': out of memory for an epoch of "
				"%llu documents and %llu samples",
				src->docs->name, (unsigned long long)n,
				(unsigned long long)S);
	}
	ej_rng r;
	ej_rng_seed(&r, mix64(s->d->seed ^
			      mix64(((uint64_t)i << 2 | (uint64_t)s->split) ^
				    mix64(e))));
	for (uint64_t k = 0; k < n; k++)
		t->doc[k] = lo + k;
	shuffle(&r, t->doc, n);
	t->prefix[0] = 0;
	for (uint64_t k = 0; k < n; k++)
		t->prefix[k + 1] =
		    t->prefix[k] + epj_docs_len(src->docs, t->doc[k]);
	for (uint64_t k = 0; k < S; k++)
		t->samp[k] = k;
	shuffle(&r, t->samp, S);
	t->epoch = e;
	t->T = T;
	t->nsamp = S;
	return EPJ_OK;
}

/* Tokens [o, o + n) of the cached epoch of source i into out, checked,
 * and (mask not NULL) their loss-mask values (1 without a mask). */
static epj_status epoch_tokens(epj_ctx *ctx, const ej_dstream *s, int i,
			       uint64_t o, uint64_t n, int64_t *out,
			       int64_t *mask)
{
	const sstate *t = &s->st[i];
	const source *src = &s->d->src[i];
	uint64_t ndoc = src->hi[s->split] - src->lo[s->split];
	/* the last k with prefix[k] <= o */
	uint64_t a = 0, b = ndoc;
	while (b - a > 1) {
		uint64_t m = a + (b - a) / 2;
		if (t->prefix[m] <= o)
			a = m;
		else
			b = m;
	}
	uint64_t k = a, got = 0;
	while (got < n) {
		while (k < ndoc && t->prefix[k + 1] <= o + got)
			k++; /* skip empty documents */
		EJ_ASSERT(k < ndoc);
		uint64_t doc = t->doc[k], off = o + got - t->prefix[k];
		uint64_t m = t->prefix[k + 1] - (o + got);
		if (m > n - got)
			m = n - got;
		epj_status st =
		    epj_docs_read(ctx, src->docs, doc, off, m, out + got);
		if (st == EPJ_OK && mask)
			st = epj_docs_read_mask(ctx, src->docs, doc, off, m,
						mask + got);
		if (st != EPJ_OK)
			return st;
		for (uint64_t j = 0; j < m; j++)
			if (out[got + j] < 0 ||
			    out[got + j] >= (int64_t)s->d->vocab)
				return ej_error(
				    ctx, EPJ_ERR_FORMAT,
				    "dataset '%s': token %lld at index %llu of "
				    "document %llu is %s",
				    src->docs->name, (long long)out[got + j],
				    (unsigned long long)(off + j),
				    (unsigned long long)doc,
				    out[got + j] < 0 ? "negative"
						     : "not below the vocab "
						       "size");
		got += m;
		k++;
	}
	return EPJ_OK;
}

/* The source of blend sample number i (0-based) given the counts taken. */
static int pick_source(const ej_dstream *s, uint64_t i)
{
	int best = 0;
	double be = -HUGE_VAL;
	for (int j = 0; j < s->d->n; j++) {
		double err = s->d->src[j].weight * (double)(i + 1) -
			     (double)s->st[j].next;
		if (err > be) {
			be = err;
			best = j;
		}
	}
	return best;
}

epj_status ej_dstream_row(epj_ctx *ctx, ej_dstream *s, int64_t T, int64_t *in,
			  int64_t *lab)
{
	int i = pick_source(s, s->taken);
	sstate *t = &s->st[i];
	const source *src = &s->d->src[i];
	uint64_t S = epoch_samples(s, i, T);
	if (S == 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"dataset '%s': the %s split holds %llu tokens "
				"(documents %llu..%llu), fewer than one sample "
				"of seq + 1 = %lld",
				src->docs->name, split_names[s->split],
				(unsigned long long)src->tokens[s->split],
				(unsigned long long)src->lo[s->split],
				(unsigned long long)src->hi[s->split],
				(long long)T + 1);
	uint64_t e = t->next / S, j = t->next % S;
	if (t->epoch != e || t->T != T) {
		epj_status st = build_epoch(ctx, s, i, e, T);
		if (st != EPJ_OK)
			return st;
	}
	/* the tokens x, and the loss mask mk of a blend with one */
	bool masked = ej_dsrc_has_loss_mask(s->d);
	int64_t *x = malloc(((size_t)T + 1) * sizeof *x);
	int64_t *mk = masked ? malloc(((size_t)T + 1) * sizeof *mk) : NULL;
	if (!x || (masked && !mk)) {
		free(x);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"dataset corpus: out of memory");
	}
	epj_status st = epoch_tokens(ctx, s, i, t->samp[j] * (uint64_t)T,
				     (uint64_t)T + 1, x, mk);
	if (st == EPJ_OK) {
		memcpy(in, x, (size_t)T * sizeof *x);
		memcpy(lab, x + 1, (size_t)T * sizeof *x);
		/* a target the mask leaves out is ignored */
		for (int64_t q = 0; mk && q < T; q++)
			if (!mk[q + 1])
				lab[q] = -100;
		t->next++;
		s->taken++;
	}
	free(x);
	free(mk);
	return st;
}

epj_status ej_dstream_skip(epj_ctx *ctx, ej_dstream *s, uint64_t rows)
{
	(void)ctx;
	if (s->d->n == 1) {
		s->st[0].next += rows;
		s->taken += rows;
		return EPJ_OK;
	}
	for (uint64_t r = 0; r < rows; r++) {
		s->st[pick_source(s, s->taken)].next++;
		s->taken++;
	}
	return EPJ_OK;
}
