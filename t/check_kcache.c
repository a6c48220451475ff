/* check_kcache.c -- the kernel cache (jit/kcache.c) against its contract.
 *
 * Entry files are checked byte by byte against the format of doc/cache.md
 * (header fields and a checksum recomputed here with epj_hash over a buffer
 * built independently), not only by reading them back.  Corrupt entries are
 * made by hand (flipped bytes, truncation, wrong magic, another key's file,
 * a symbolic link) and must come back as counted misses with the file gone.
 * Insecure directories (group/world-writable, another owner when running as
 * root, symbolic links) must be refused before anything is read.  Many
 * processes write the same keys into one directory while others read: every
 * read must be complete and right, and nothing temporary may be left.
 * Every directory is a fresh mkdtemp under /tmp, removed at the end.
 */
#include "check_util.h"

#include "jit.h"
#include "kcache.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define HDR 104 /* header bytes of an entry file (doc/cache.md) */

/* ---- helpers --------------------------------------------------------------
 */

static char *path_of(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
static char *path_of(const char *fmt, ...)
{
	static char bufs[4][4096];
	static int next;
	char *b = bufs[next++ % 4];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(b, sizeof bufs[0], fmt, ap);
	va_end(ap);
	return b;
}

static char *entry_path(const char *dir, const char *key)
{
	return path_of("%s/v1/%.2s/%s.bin", dir, key, key);
}

static bool exists(const char *p)
{
	struct stat st;
	return lstat(p, &st) == 0;
}

static int64_t ctr(epj_ctx *ctx, const char *name)
{
	return epj_counter_get(ctx, name);
}

/* A key unique to this run (the run's seed is one of the parts). */
static void make_key(char out[65], const char *tag, int i)
{
	char seed[32], idx[16];
	snprintf(seed, sizeof seed, "%llu", (unsigned long long)tu_seed());
	snprintf(idx, sizeof idx, "%d", i);
	const char *parts[] = { "check_kcache", tag, idx, seed };
	ej_kcache_key(out, parts, 4);
}

/* The artifact of a key: deterministic bytes of a length in [1, 256 KiB]
 * (large enough that a non-atomic writer would be caught half-way), so that
 * every writer of a key writes the same content.  Caller frees. */
static unsigned char *blob_of(const char *key, size_t *len)
{
	uint64_t x = epj_hash(key, strlen(key)).lo | 1;
	*len = 1 + (size_t)(x % (256 << 10));
	unsigned char *b = malloc(*len);
	ck_assert_ptr_nonnull(b);
	for (size_t i = 0; i < *len; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		b[i] = (unsigned char)(x >> 24);
	}
	return b;
}

static unsigned char *random_bytes(size_t n)
{
	unsigned char *b = malloc(n ? n : 1);
	ck_assert_ptr_nonnull(b);
	for (size_t i = 0; i < n; i++)
		b[i] = (unsigned char)tu_randint(0, 256);
	return b;
}

static uint64_t le64(const unsigned char *p)
{
	uint64_t v = 0;
	for (int i = 7; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static ej_kcache *open_ok(epj_ctx *ctx, const char *dir)
{
	ej_kcache *c = ej_kcache_open(ctx, dir);
	ck_assert_msg(c != NULL, "open %s: %s", dir ? dir : "(default)",
		      epj_ctx_error(ctx));
	return c;
}

static void assert_refused(epj_ctx *ctx, const char *dir, const char *what,
			   const char *why)
{
	tu_assert_error(ctx, ej_kcache_open(ctx, dir), EPJ_ERR_STATE,
			TU_STRS(what, why));
}

/* Gets key and asserts a hit with exactly want[0..n). */
static void assert_hit(epj_ctx *ctx, ej_kcache *c, const char *key,
		       const void *want, size_t n)
{
	void *d = NULL;
	size_t len = 12345;
	ck_assert_int_eq(ej_kcache_get(c, key, &d, &len), EPJ_OK);
	ck_assert_msg(d != NULL || n == 0, "miss for %s", key);
	ck_assert_uint_eq(len, n);
	ck_assert(n == 0 || memcmp(d, want, n) == 0);
	free(d);
	(void)ctx;
}

static void assert_miss(ej_kcache *c, const char *key)
{
	void *d = (void *)1;
	size_t len = 12345;
	ck_assert_int_eq(ej_kcache_get(c, key, &d, &len), EPJ_OK);
	ck_assert_ptr_null(d);
	ck_assert_uint_eq(len, 0);
}

/* Number of names in the tree under dir containing `part`. */
static int count_names(const char *dir, const char *part)
{
	DIR *d = opendir(dir);
	ck_assert_ptr_nonnull(d);
	int n = 0;
	struct dirent *de;
	while ((de = readdir(d))) {
		if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
			continue;
		char p[4096];
		snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
		struct stat st;
		ck_assert_int_eq(lstat(p, &st), 0);
		if (S_ISDIR(st.st_mode))
			n += count_names(p, part);
		else
			n += strstr(de->d_name, part) != NULL;
	}
	closedir(d);
	return n;
}

/* ---- round trip and format ------------------------------------------------
 */

START_TEST(test_roundtrip)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("kc");
	char key[65], other[65];
	make_key(key, "roundtrip", 0);
	make_key(other, "roundtrip", 1);
	size_t n = (size_t)tu_randint(1, 5000) * 2 + 1; /* odd, >= 3 */
	unsigned char *blob = random_bytes(n);
	char src[64];
	snprintf(src, sizeof src, "extern \"C\" __global__ void k%d(void) {}",
		 (int)tu_randint(0, 1000));

	ej_kcache *c = open_ok(ctx, dir);
	ck_assert_str_eq(ej_kcache_dir(c), dir);
	ck_assert_int_eq(ej_kcache_put(c, key, blob, n, src), EPJ_OK);
	ck_assert_int_eq(ctr(ctx, "cache.bytes"), HDR + n + strlen(src));
	assert_hit(ctx, c, key, blob, n);
	ck_assert_int_eq(ctr(ctx, "cache.mem_hits"), 1);
	ck_assert_int_eq(ctr(ctx, "cache.disk_hits"), 0);
	assert_miss(c, other);
	ck_assert_int_eq(ctr(ctx, "cache.misses"), 1);
	ej_kcache_close(c);

	/* The file, byte by byte. */
	size_t fn;
	unsigned char *f = tu_read_file(entry_path(dir, key), &fn);
	ck_assert_uint_eq(fn, HDR + n + strlen(src));
	ck_assert(memcmp(f, "EPJKC\0\0\2", 8) == 0);
	ck_assert(memcmp(f + 8, key, 64) == 0);
	ck_assert_uint_eq(le64(f + 72), n);
	ck_assert_uint_eq(le64(f + 80), strlen(src));
	ck_assert(memcmp(f + HDR, blob, n) == 0);
	ck_assert(memcmp(f + HDR + n, src, strlen(src)) == 0);
	/* The checksum covers the header before it (magic, key, lengths),
	 * the artifact and the source. */
	size_t cn = 88 + n + strlen(src);
	unsigned char *cat = malloc(cn);
	ck_assert_ptr_nonnull(cat);
	memcpy(cat, f, 88);
	memcpy(cat + 88, blob, n);
	memcpy(cat + 88 + n, src, strlen(src));
	epj_hash128 h = epj_hash(cat, cn);
	ck_assert_uint_eq(le64(f + 88), h.lo);
	ck_assert_uint_eq(le64(f + 96), h.hi);
	free(cat);
	free(f);
	struct stat st;
	ck_assert_int_eq(stat(entry_path(dir, key), &st), 0);
	ck_assert_int_eq(st.st_mode & 077, 0);
	ck_assert_int_eq(stat(path_of("%s/v1/%.2s", dir, key), &st), 0);
	ck_assert_int_eq(st.st_mode & 077, 0);
	ck_assert_int_eq(count_names(dir, ".tmp."), 0);

	/* A fresh cache on the same directory: disk hit, then memory hit. */
	c = open_ok(ctx, dir);
	void *d = NULL;
	size_t len = 0;
	char *s = NULL;
	ck_assert_int_eq(ej_kcache_get_with_source(c, key, &d, &len, &s),
			 EPJ_OK);
	ck_assert_ptr_nonnull(d);
	ck_assert_uint_eq(len, n);
	ck_assert(memcmp(d, blob, n) == 0);
	ck_assert_str_eq(s, src);
	free(d);
	free(s);
	ck_assert_int_eq(ctr(ctx, "cache.disk_hits"), 1);
	assert_hit(ctx, c, key, blob, n);
	ck_assert_int_eq(ctr(ctx, "cache.mem_hits"), 2);
	ck_assert_int_eq(ctr(ctx, "cache.disk_hits"), 1);

	/* Without source; an empty artifact is refused (*data NULL always
	 * means a miss). */
	ck_assert_int_eq(ej_kcache_put(c, other, NULL, 0, NULL),
			 EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "empty artifact"));
	ck_assert_int_eq(ej_kcache_put(c, other, blob, 0, NULL),
			 EPJ_ERR_INVALID);
	ck_assert_int_eq(ej_kcache_put(c, other, blob + 1, 1, NULL), EPJ_OK);
	ej_kcache_close(c);
	c = open_ok(ctx, dir);
	ck_assert_int_eq(ej_kcache_get_with_source(c, other, &d, &len, &s),
			 EPJ_OK);
	ck_assert_ptr_nonnull(d);
	ck_assert_uint_eq(len, 1);
	ck_assert_int_eq(*(unsigned char *)d, blob[1]);
	ck_assert_str_eq(s, "");
	free(d);
	free(s);
	ck_assert_int_eq(ctr(ctx, "cache.disk_hits"), 2);
	ck_assert_int_eq(ctr(ctx, "cache.misses"), 1);

	/* Malformed keys name files: refused. */
	char upper[65], longer[66], dots[65];
	for (int i = 0; i < 65; i++)
		upper[i] = (char)toupper((unsigned char)key[i]);
	snprintf(longer, sizeof longer, "%s0", key);
	memcpy(dots, "../../", 6); /* 64 characters, 6 of them not hex */
	memcpy(dots + 6, key, 58);
	dots[64] = '\0';
	const char *bad[] = { "abc", "", upper, longer, dots, NULL };
	for (size_t i = 0; i < EJ_ARRAY_LEN(bad); i++) {
		ck_assert_int_eq(ej_kcache_get(c, bad[i], &d, &len),
				 EPJ_ERR_INVALID);
		ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "key"));
		ck_assert_int_eq(ej_kcache_put(c, bad[i], blob, n, NULL),
				 EPJ_ERR_INVALID);
		ck_assert_ptr_nonnull(
		    strstr(epj_ctx_error(ctx), "ej_kcache_put"));
	}
	ej_kcache_close(c);
	free(blob);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- keys -------------------------------------------------------------------
 */

START_TEST(test_key)
{
	char buf[32];
	snprintf(buf, sizeof buf, "sig-%lld",
		 (long long)tu_randint(0, 1 << 30));
	const char *base[] = { buf,   "cuda",	   "sm_90",    "nvrtc 13.0",
			       "-O3", "codegen 1", "tmpl-ab12" };
	int np = (int)EJ_ARRAY_LEN(base);
	char k0[65], k1[65];
	ej_kcache_key(k0, base, np);
	ck_assert_uint_eq(strlen(k0), 64);
	for (int i = 0; i < 64; i++)
		ck_assert(strchr("0123456789abcdef", k0[i]) != NULL);
	ej_kcache_key(k1, base, np);
	ck_assert_str_eq(k0, k1);

	/* Any part changed (one byte, appended, emptied) changes the key. */
	for (int i = 0; i < np; i++) {
		const char *p[EJ_ARRAY_LEN(base)];
		char alt[64];
		memcpy(p, base, sizeof p);
		snprintf(alt, sizeof alt, "%s", base[i]);
		alt[0] ^= 1;
		p[i] = alt;
		ej_kcache_key(k1, p, np);
		ck_assert_str_ne(k0, k1);
		snprintf(alt, sizeof alt, "%s ", base[i]);
		ej_kcache_key(k1, p, np);
		ck_assert_str_ne(k0, k1);
		p[i] = "";
		ej_kcache_key(k1, p, np);
		ck_assert_str_ne(k0, k1);
	}
	ej_kcache_key(k1, base, np - 1);
	ck_assert_str_ne(k0, k1);

	/* Joined unambiguously. */
	const char *a[] = { "ab", "c" }, *b[] = { "a", "bc" }, *c[] = { "abc" };
	const char *d[] = { "a" }, *e[] = { "a", "" }, *f[] = { "a", NULL };
	char ka[65], kb[65], kc[65], kd[65], ke[65], kf[65];
	ej_kcache_key(ka, a, 2);
	ej_kcache_key(kb, b, 2);
	ej_kcache_key(kc, c, 1);
	ej_kcache_key(kd, d, 1);
	ej_kcache_key(ke, e, 2);
	ej_kcache_key(kf, f, 2);
	ck_assert_str_ne(ka, kb);
	ck_assert_str_ne(ka, kc);
	ck_assert_str_ne(kd, ke);
	ck_assert_str_ne(ke, kf);
	ck_assert_str_ne(kd, kf);

	/* The first half is epj_hash of the documented encoding. */
	unsigned char enc[256];
	size_t m = 0;
	for (int i = 0; i < 2; i++) {
		uint64_t l = strlen(a[i]);
		for (int j = 0; j < 8; j++)
			enc[m++] = (unsigned char)(l >> (8 * j));
		memcpy(enc + m, a[i], l);
		m += l;
	}
	char hex[33];
	epj_hash_hex(epj_hash(enc, m), hex);
	ck_assert(strncmp(ka, hex, 32) == 0);
	ck_assert(strncmp(ka + 32, hex, 32) != 0);
}
END_TEST

/* ---- corrupt entries ------------------------------------------------------
 */

enum {
	CORRUPT_FLIP_ARTIFACT,
	CORRUPT_FLIP_SOURCE,
	CORRUPT_FLIP_CHECKSUM,
	CORRUPT_LENGTH_FIELD,
	CORRUPT_TRUNCATE,
	CORRUPT_TRUNCATE_HEADER,
	CORRUPT_EMPTY,
	CORRUPT_APPEND,
	CORRUPT_MAGIC,
	CORRUPT_OTHER_KEY,
	CORRUPT_SYMLINK,
	CORRUPT_V1_FORGED,   /* format 1 with its checksum recomputed */
	CORRUPT_OLD_SUM,     /* format 2, checksum of key + artifact + source */
	CORRUPT_SPLIT,	     /* one artifact byte moved to the source */
	CORRUPT_MODE_0666,   /* a valid entry others can write */
	CORRUPT_GROUP_WRITE, /* a valid entry the group can write */
	CORRUPT_FIFO,	     /* must not block */
	CORRUPT_COUNT
};

static void put_le64(unsigned char *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

/* The checksum of format 1 (key + artifact + source, no lengths), which
 * anyone can recompute, written into f's header. */
static void old_style_sum(unsigned char *f, size_t fn)
{
	size_t cn = 64 + (fn - HDR);
	unsigned char *cat = malloc(cn);
	ck_assert_ptr_nonnull(cat);
	memcpy(cat, f + 8, 64);
	memcpy(cat + 64, f + HDR, fn - HDR);
	epj_hash128 h = epj_hash(cat, cn);
	put_le64(f + 88, h.lo);
	put_le64(f + 96, h.hi);
	free(cat);
}

static void on_alarm(int sig)
{
	(void)sig;
	ck_abort_msg("blocked reading a FIFO entry");
}

START_TEST(test_corrupt)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("kc");
	epj_log_level lvl = epj_log_level_get();
	epj_log_level_set(EPJ_LOG_ERROR); /* the warnings are expected */
	for (int kind = 0; kind < CORRUPT_COUNT; kind++) {
		char key[65], key2[65];
		make_key(key, "corrupt", kind);
		make_key(key2, "corrupt-other", kind);
		size_t n = (size_t)tu_randint(3, 3000);
		unsigned char *blob = random_bytes(n);
		const char *src = "int k(void) { return 7; }";
		ej_kcache *c = open_ok(ctx, dir);
		ck_assert_int_eq(ej_kcache_put(c, key, blob, n, src), EPJ_OK);
		ck_assert_int_eq(ej_kcache_put(c, key2, blob, n, src), EPJ_OK);
		ej_kcache_close(c);

		char *p = entry_path(dir, key);
		size_t fn;
		unsigned char *f = tu_read_file(p, &fn);
		size_t at;
		switch (kind) {
		case CORRUPT_FLIP_ARTIFACT:
			at = HDR + (size_t)tu_randint(0, (int64_t)n);
			f[at] ^= (unsigned char)(1 << tu_randint(0, 8));
			tu_write_file(p, f, fn);
			break;
		case CORRUPT_FLIP_SOURCE:
			f[fn - 1] ^= 0x20;
			tu_write_file(p, f, fn);
			break;
		case CORRUPT_FLIP_CHECKSUM:
			f[88 + tu_randint(0, 16)] ^= 0x80;
			tu_write_file(p, f, fn);
			break;
		case CORRUPT_LENGTH_FIELD:
			f[72] ^= 1; /* artifact length off by one */
			tu_write_file(p, f, fn);
			break;
		case CORRUPT_TRUNCATE:
			tu_write_file(p, f,
				      HDR + (size_t)tu_randint(0, (int64_t)n));
			break;
		case CORRUPT_TRUNCATE_HEADER:
			tu_write_file(p, f, (size_t)tu_randint(1, HDR));
			break;
		case CORRUPT_EMPTY:
			tu_write_file(p, f, 0);
			break;
		case CORRUPT_APPEND:
			f[fn] = 'x'; /* tu_read_file left one spare byte */
			tu_write_file(p, f, fn + 1);
			break;
		case CORRUPT_MAGIC:
			f[7] = 3; /* a future format version */
			tu_write_file(p, f, fn);
			break;
		case CORRUPT_OTHER_KEY: {
			/* key2's valid entry (same artifact and source) at
			 * key's path: only the key inside tells them apart. */
			size_t gn;
			unsigned char *g =
			    tu_read_file(entry_path(dir, key2), &gn);
			tu_write_file(p, g, gn);
			free(g);
			break;
		}
		case CORRUPT_SYMLINK:
			ck_assert_int_eq(unlink(p), 0);
			ck_assert_int_eq(symlink(entry_path(dir, key2), p), 0);
			break;
		case CORRUPT_V1_FORGED:
			f[7] = 1;
			f[HDR] ^= 0x55; /* a forged artifact */
			old_style_sum(f, fn);
			tu_write_file(p, f, fn);
			break;
		case CORRUPT_OLD_SUM:
			f[HDR] ^= 0x55;
			old_style_sum(f, fn);
			tu_write_file(p, f, fn);
			break;
		case CORRUPT_SPLIT:
			/* Same bytes after the header, one more in the
			 * source: key + artifact + source is unchanged. */
			put_le64(f + 72, le64(f + 72) - 1);
			put_le64(f + 80, le64(f + 80) + 1);
			old_style_sum(f, fn);
			tu_write_file(p, f, fn);
			break;
		case CORRUPT_MODE_0666:
			ck_assert_int_eq(chmod(p, 0666), 0);
			break;
		case CORRUPT_GROUP_WRITE:
			ck_assert_int_eq(chmod(p, 0620), 0);
			break;
		case CORRUPT_FIFO:
			ck_assert_int_eq(unlink(p), 0);
			ck_assert_int_eq(mkfifo(p, 0600), 0);
			break;
		}
		free(f);

		int64_t corrupt0 = ctr(ctx, "cache.corrupt");
		int64_t miss0 = ctr(ctx, "cache.misses");
		c = open_ok(ctx, dir);
		signal(SIGALRM, on_alarm);
		alarm(10);
		assert_miss(c, key);
		alarm(0);
		ck_assert_msg(ctr(ctx, "cache.corrupt") == corrupt0 + 1,
			      "kind %d not counted corrupt", kind);
		ck_assert_int_eq(ctr(ctx, "cache.misses"), miss0 + 1);
		ck_assert_msg(!exists(entry_path(dir, key)),
			      "kind %d: corrupt file kept", kind);
		/* The other entry is untouched; a new put works. */
		assert_hit(ctx, c, key2, blob, n);
		ck_assert_int_eq(ej_kcache_put(c, key, blob, n, src), EPJ_OK);
		ej_kcache_close(c);
		c = open_ok(ctx, dir);
		int64_t disk0 = ctr(ctx, "cache.disk_hits");
		assert_hit(ctx, c, key, blob, n);
		ck_assert_int_eq(ctr(ctx, "cache.disk_hits"), disk0 + 1);
		ck_assert_int_eq(ctr(ctx, "cache.corrupt"), corrupt0 + 1);
		ej_kcache_close(c);
		free(blob);
	}
	epj_log_level_set(lvl);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- directory security ---------------------------------------------------
 */

START_TEST(test_insecure_dir)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("kc");
	char key[65];
	make_key(key, "insecure", 0);
	unsigned char b[3] = { 1, 2, 3 };
	ej_kcache *c = open_ok(ctx, dir);
	ck_assert_int_eq(ej_kcache_put(c, key, b, 3, "s"), EPJ_OK);
	ej_kcache_close(c);

	ck_assert_int_eq(chmod(dir, 0777), 0);
	assert_refused(ctx, dir, dir, "group- or world-writable (mode 0777)");
	ck_assert_int_eq(chmod(dir, 0775), 0);
	assert_refused(ctx, dir, dir, "group- or world-writable (mode 0775)");
	ck_assert_int_eq(chmod(dir, 0702), 0);
	assert_refused(ctx, dir, dir, "(mode 0702)");
	ck_assert_int_eq(chmod(dir, 0755), 0); /* readable by others: fine */
	c = open_ok(ctx, dir);
	ej_kcache_close(c);

	/* v1/ and the shard directories are checked too. */
	char *v1 = strdup(path_of("%s/v1", dir));
	ck_assert_int_eq(chmod(v1, 0770), 0);
	assert_refused(ctx, dir, v1, "(mode 0770)");
	ck_assert_int_eq(chmod(v1, 0700), 0);
	char *shard = strdup(path_of("%s/v1/%.2s", dir, key));
	ck_assert_int_eq(chmod(shard, 0777), 0);
	c = open_ok(ctx, dir);
	void *d = NULL;
	size_t len;
	ck_assert_int_eq(ej_kcache_get(c, key, &d, &len), EPJ_ERR_STATE);
	ck_assert_ptr_null(d);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), shard));
	ck_assert_int_eq(ej_kcache_put(c, key, b, 3, "s"), EPJ_ERR_STATE);
	ck_assert_int_eq(chmod(shard, 0700), 0);
	ej_kcache_close(c);

	/* A file where the directory should be: not insecure, only useless:
	 * a cache in memory (counted), which still works. */
	char *file = strdup(path_of("%s/plain", dir));
	tu_write_file(file, "x", 1);
	int64_t werr0 = ctr(ctx, "cache.write_errors");
	c = ej_kcache_open(ctx, file);
	ck_assert_ptr_nonnull(c);
	ck_assert(!ej_kcache_on_disk(c));
	ck_assert_int_eq(ctr(ctx, "cache.write_errors"), werr0 + 1);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_OK);
	assert_miss(c, key);
	ck_assert_int_eq(ej_kcache_put(c, key, b, 3, "s"), EPJ_OK);
	assert_hit(ctx, c, key, b, 3);
	ej_kcache_close(c);

	/* Another owner: only root can make one. */
	if (geteuid() == 0) {
		ck_assert_int_eq(chown(dir, 65534, 65534), 0);
		assert_refused(ctx, dir, dir, "owned by uid 65534, not you");
		ck_assert_int_eq(chown(dir, 0, 0), 0);
		/* An entry file of another user is not loaded either. */
		ck_assert_int_eq(chown(entry_path(dir, key), 65534, 65534), 0);
		epj_log_level lvl = epj_log_level_get();
		epj_log_level_set(EPJ_LOG_ERROR);
		c = open_ok(ctx, dir);
		assert_miss(c, key);
		ck_assert_int_eq(ctr(ctx, "cache.corrupt"), 1);
		ej_kcache_close(c);
		epj_log_level_set(lvl);
	}
	free(v1);
	free(shard);
	free(file);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_symlink_dir)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("kc");
	char *real = strdup(path_of("%s/real", dir));
	char *link = strdup(path_of("%s/link", dir));
	ck_assert_int_eq(mkdir(real, 0700), 0);
	ck_assert_int_eq(symlink(real, link), 0);
	assert_refused(ctx, link, link, "symbolic link");
	char *slash = strdup(path_of("%s/", link));
	assert_refused(ctx, slash, link, "symbolic link");
	/* Nothing was created through the link. */
	ck_assert(!exists(path_of("%s/v1", real)));
	/* v1 as a link to a directory elsewhere is refused too. */
	char *other = strdup(path_of("%s/other", dir));
	ck_assert_int_eq(mkdir(other, 0700), 0);
	ck_assert_int_eq(symlink(other, path_of("%s/v1", real)), 0);
	assert_refused(ctx, real, "v1", "symbolic link");
	ck_assert_int_eq(unlink(path_of("%s/v1", real)), 0);
	/* "link/." names the link's target through the link: refused too,
	 * also with more dots and slashes. */
	char *dot = strdup(path_of("%s/.", link));
	assert_refused(ctx, dot, link, "symbolic link");
	char *dots = strdup(path_of("%s/././/", link));
	assert_refused(ctx, dots, link, "symbolic link");
	ck_assert(!exists(path_of("%s/v1", real)));
	/* A link higher up (ours, in a directory only we can write) is
	 * resolved: the cache uses the real path. */
	char *below = strdup(path_of("%s/sub", link));
	ej_kcache *c = open_ok(ctx, below);
	ck_assert_str_eq(ej_kcache_dir(c), path_of("%s/sub", real));
	ej_kcache_close(c);
	/* A directory above the cache that others may write without the
	 * sticky bit: they could rename the cache and put theirs there. */
	char *open_dir = strdup(path_of("%s/open", dir));
	ck_assert_int_eq(mkdir(open_dir, 0700), 0);
	ck_assert_int_eq(chmod(open_dir, 0777), 0);
	char *inside = strdup(path_of("%s/cache", open_dir));
	assert_refused(ctx, inside, open_dir, "without the sticky bit");
	ck_assert_int_eq(chmod(open_dir, 01777), 0); /* like /tmp */
	c = open_ok(ctx, inside);
	ej_kcache_close(c);
	/* ... and a link in such a directory can be repointed by others. */
	char *link2 = strdup(path_of("%s/link2", open_dir));
	ck_assert_int_eq(symlink(real, link2), 0);
	ck_assert_int_eq(chmod(open_dir, 0777), 0);
	char *via = strdup(path_of("%s/sub", link2));
	assert_refused(ctx, via, open_dir, "without the sticky bit");
	/* Relative paths through a link in the working directory. */
	int cwd = open(".", O_RDONLY | O_DIRECTORY);
	ck_assert_int_ge(cwd, 0);
	ck_assert_int_eq(chdir(dir), 0);
	ck_assert_int_eq(symlink("real", "rel"), 0);
	assert_refused(ctx, "rel", "rel", "symbolic link");
	c = open_ok(ctx, "rel/sub2");
	ck_assert_str_eq(ej_kcache_dir(c), path_of("%s/sub2", real));
	ej_kcache_close(c);
	ck_assert_int_eq(fchdir(cwd), 0);
	close(cwd);
	free(dot);
	free(dots);
	free(below);
	free(open_dir);
	free(inside);
	free(link2);
	free(via);
	free(real);
	free(link);
	free(slash);
	free(other);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- default directory and size cap from the environment ----------------
 */

static const char *const env_names[] = { "EPJIT_CACHE_DIR", "XDG_CACHE_HOME",
					 "HOME", "EPJIT_CACHE_MAX_MB" };

static void assert_default(epj_ctx *ctx, const char *want)
{
	ej_kcache *c = open_ok(ctx, NULL);
	ck_assert_str_eq(ej_kcache_dir(c), want);
	ej_kcache_close(c);
	struct stat st;
	ck_assert_int_eq(lstat(want, &st), 0);
	ck_assert(S_ISDIR(st.st_mode));
	ck_assert_int_eq(st.st_mode & 0777, 0700);
	ck_assert_int_eq(lstat(path_of("%s/v1", want), &st), 0);
}

START_TEST(test_default_dir)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("kc");
	char *saved[EJ_ARRAY_LEN(env_names)];
	for (size_t i = 0; i < EJ_ARRAY_LEN(env_names); i++) {
		const char *v = getenv(env_names[i]);
		saved[i] = v ? strdup(v) : NULL;
		unsetenv(env_names[i]);
	}

	ck_assert_int_eq(setenv("EPJIT_CACHE_DIR", path_of("%s/a", dir), 1), 0);
	ck_assert_int_eq(setenv("XDG_CACHE_HOME", path_of("%s/x", dir), 1), 0);
	ck_assert_int_eq(setenv("HOME", path_of("%s/h", dir), 1), 0);
	assert_default(ctx, path_of("%s/a", dir));
	ck_assert_int_eq(setenv("EPJIT_CACHE_DIR", "", 1), 0); /* = unset */
	assert_default(ctx, path_of("%s/x/epjit", dir));
	struct stat st;
	ck_assert_int_eq(lstat(path_of("%s/x", dir), &st), 0);
	ck_assert_int_eq(st.st_mode & 0777, 0700); /* parents made 0700 */
	ck_assert_int_eq(setenv("XDG_CACHE_HOME", "relative/cache", 1), 0);
	assert_default(ctx, path_of("%s/h/.cache/epjit", dir));
	unsetenv("XDG_CACHE_HOME");
	unsetenv("EPJIT_CACHE_DIR");
	assert_default(ctx, path_of("%s/h/.cache/epjit", dir));

	/* EPJIT_CACHE_MAX_MB must be a positive number of MiB. */
	const char *badmb[] = { "abc", "0", "-5", "12x", "1e3" };
	for (size_t i = 0; i < EJ_ARRAY_LEN(badmb); i++) {
		ck_assert_int_eq(setenv("EPJIT_CACHE_MAX_MB", badmb[i], 1), 0);
		ck_assert_ptr_null(ej_kcache_open(ctx, dir));
		ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_CONFIG);
		ck_assert_ptr_nonnull(
		    strstr(epj_ctx_error(ctx), "EPJIT_CACHE_MAX_MB"));
	}
	ck_assert_int_eq(setenv("EPJIT_CACHE_MAX_MB", "3", 1), 0);
	ej_kcache *c = open_ok(ctx, dir);
	ej_kcache_close(c);

	for (size_t i = 0; i < EJ_ARRAY_LEN(env_names); i++) {
		if (saved[i])
			setenv(env_names[i], saved[i], 1);
		else
			unsetenv(env_names[i]);
		free(saved[i]);
	}
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- eviction ---------------------------------------------------------------
 */

static void set_mtime(const char *p, time_t t)
{
	struct timespec ts[2] = { { .tv_sec = t }, { .tv_sec = t } };
	ck_assert_int_eq(utimensat(AT_FDCWD, p, ts, AT_SYMLINK_NOFOLLOW), 0);
}

static int64_t file_size(const char *p)
{
	struct stat st;
	ck_assert_int_eq(stat(p, &st), 0);
	return (int64_t)st.st_size;
}

START_TEST(test_eviction)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("kc");
	enum { NK = 5 };
	char key[NK][65];
	unsigned char *blob[NK];
	size_t len[NK];
	for (int i = 0; i < NK; i++) {
		make_key(key[i], "evict", i);
		len[i] = (size_t)tu_randint(100, 900) * 2 + 1;
		blob[i] = random_bytes(len[i]);
	}
	ej_kcache *c = open_ok(ctx, dir);
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(ej_kcache_put(c, key[i], blob[i], len[i], "s"),
				 EPJ_OK);
	ej_kcache_close(c);
	ck_assert_int_eq(ctr(ctx, "cache.evictions"), 0);
	/* Ages: key0 oldest, then key1, key2. */
	time_t now = time(NULL);
	for (int i = 0; i < 3; i++)
		set_mtime(entry_path(dir, key[i]), now - 3000 + 1000 * i);
	int64_t sz[NK];
	for (int i = 0; i < 3; i++)
		sz[i] = file_size(entry_path(dir, key[i]));

	/* A disk hit makes key0 the youngest. */
	c = open_ok(ctx, dir);
	assert_hit(ctx, c, key[0], blob[0], len[0]);
	struct stat st;
	ck_assert_int_eq(stat(entry_path(dir, key[0]), &st), 0);
	ck_assert_int_ge(st.st_mtime, now - 1);

	/* Stale temporaries of a crashed writer are swept; fresh ones (a
	 * writer at work) are not. */
	char *stale =
	    strdup(path_of("%s/v1/%.2s/%s.tmp.999999.1", dir, key[0], key[0]));
	char *fresh =
	    strdup(path_of("%s/v1/%.2s/%s.tmp.999999.2", dir, key[0], key[0]));
	tu_write_file(stale, "x", 1);
	tu_write_file(fresh, "x", 1);
	set_mtime(stale, now - 7200);

	/* Room for key0, key2 and key3 but not key1 too: key1 goes. */
	int64_t sz3 = HDR + (int64_t)len[3] + 1;
	ej_kcache_set_cap_bytes(c, sz[0] + sz[2] + sz3 + sz[1] / 2);
	ck_assert_int_eq(ej_kcache_put(c, key[3], blob[3], len[3], "s"),
			 EPJ_OK);
	ck_assert_int_eq(ctr(ctx, "cache.evictions"), 1);
	ck_assert(exists(entry_path(dir, key[0])));
	ck_assert(!exists(entry_path(dir, key[1])));
	ck_assert(exists(entry_path(dir, key[2])));
	ck_assert(exists(entry_path(dir, key[3])));
	ck_assert(!exists(stale));
	ck_assert(exists(fresh));
	ck_assert_int_eq(unlink(fresh), 0);

	/* A cap below one entry: everything but the new entry goes, and the
	 * memory table keeps only it as well. */
	ej_kcache_set_cap_bytes(c, 1);
	ck_assert_int_eq(ej_kcache_put(c, key[4], blob[4], len[4], "s"),
			 EPJ_OK);
	ck_assert_int_eq(ctr(ctx, "cache.evictions"), 4);
	ck_assert_int_eq(count_names(dir, ".bin"), 1);
	int64_t mem0 = ctr(ctx, "cache.mem_hits");
	assert_hit(ctx, c, key[4], blob[4], len[4]);
	ck_assert_int_eq(ctr(ctx, "cache.mem_hits"), mem0 + 1);
	assert_miss(c, key[0]);
	ej_kcache_close(c);
	c = open_ok(ctx, dir);
	assert_hit(ctx, c, key[4], blob[4], len[4]);
	ej_kcache_close(c);

	for (int i = 0; i < NK; i++)
		free(blob[i]);
	free(stale);
	free(fresh);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- concurrent writers and readers ---------------------------------------
 */

enum { N_WRITERS = 6, N_READERS = 3, N_KEYS = 20, READER_ROUNDS = 25 };

/* Child exit codes. */
enum { CHILD_OK = 0, CHILD_WRONG = 10, CHILD_CORRUPT, CHILD_ERROR };

static int child_run(const char *dir, char keys[][65], int role, int gate)
{
	char c1;
	if (read(gate, &c1, 1) < 0) /* EOF when the parent opens the gate */
		return CHILD_ERROR;
	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return CHILD_ERROR;
	int rc = CHILD_OK;
	if (role < N_WRITERS) {
		/* Each writer starts at another key, twice round. */
		ej_kcache *c = ej_kcache_open(ctx, dir);
		if (!c)
			rc = CHILD_ERROR;
		for (int r = 0; c && r < 2 * N_KEYS && rc == CHILD_OK; r++) {
			const char *k = keys[(r + 3 * role) % N_KEYS];
			size_t n;
			unsigned char *b = blob_of(k, &n);
			if (ej_kcache_put(c, k, b, n, k) != EPJ_OK)
				rc = CHILD_ERROR;
			free(b);
		}
		ej_kcache_close(c);
	} else {
		/* Readers open a fresh cache each round so that every hit
		 * comes from the disk. */
		for (int r = 0; r < READER_ROUNDS && rc == CHILD_OK; r++) {
			ej_kcache *c = ej_kcache_open(ctx, dir);
			if (!c) {
				rc = CHILD_ERROR;
				break;
			}
			for (int i = 0; i < N_KEYS && rc == CHILD_OK; i++) {
				const char *k = keys[(i + r) % N_KEYS];
				void *d = NULL;
				size_t len = 0;
				char *src = NULL;
				if (ej_kcache_get_with_source(c, k, &d, &len,
							      &src) != EPJ_OK) {
					rc = CHILD_ERROR;
					break;
				}
				if (src) {
					size_t n;
					unsigned char *b = blob_of(k, &n);
					if (len != n || memcmp(d, b, n) != 0 ||
					    strcmp(src, k) != 0)
						rc = CHILD_WRONG;
					free(b);
				}
				free(d);
				free(src);
			}
			ej_kcache_close(c);
		}
	}
	if (rc == CHILD_OK && epj_counter_get(ctx, "cache.corrupt") != 0)
		rc = CHILD_CORRUPT;
	if (rc == CHILD_ERROR)
		fprintf(stderr, "kcache child %d: %s\n", role,
			epj_ctx_error(ctx));
	epj_ctx_free(ctx);
	return rc;
}

START_TEST(test_concurrent)
{
	/* Nothing is malloc'ed before the fork: under valgrind (CK_FORK=no)
	 * each child's exit runs a leak check too. */
	char dir[] = "/tmp/epj-kc-XXXXXX";
	ck_assert_ptr_nonnull(mkdtemp(dir));
	char keys[N_KEYS][65];
	for (int i = 0; i < N_KEYS; i++)
		make_key(keys[i], "concurrent", i);
	int gate[2];
	ck_assert_int_eq(pipe(gate), 0);
	fflush(NULL);
	pid_t pid[N_WRITERS + N_READERS];
	for (int r = 0; r < N_WRITERS + N_READERS; r++) {
		pid[r] = fork();
		ck_assert_int_ge(pid[r], 0);
		if (pid[r] == 0) {
			close(gate[1]);
			_exit(child_run(dir, keys, r, gate[0]));
		}
	}
	/* Everybody starts at once. */
	close(gate[0]);
	close(gate[1]);
	for (int r = 0; r < N_WRITERS + N_READERS; r++) {
		int st;
		ck_assert_int_eq(waitpid(pid[r], &st, 0), pid[r]);
		ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == CHILD_OK,
			      "%s %d: %s %d (exit %d: wrong data, %d: corrupt "
			      "entry seen, %d: error)",
			      r < N_WRITERS ? "writer" : "reader", r,
			      WIFEXITED(st) ? "exit" : "signal",
			      WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st),
			      CHILD_WRONG, CHILD_CORRUPT, CHILD_ERROR);
	}

	/* Every entry is there, verified and right; nothing else is. */
	ck_assert_int_eq(count_names(dir, ".tmp."), 0);
	ck_assert_int_eq(count_names(dir, ".bin"), N_KEYS);
	epj_ctx *ctx = tu_ctx();
	ej_kcache *c = open_ok(ctx, dir);
	for (int i = 0; i < N_KEYS; i++) {
		size_t n;
		unsigned char *b = blob_of(keys[i], &n);
		assert_hit(ctx, c, keys[i], b, n);
		free(b);
	}
	ck_assert_int_eq(ctr(ctx, "cache.disk_hits"), N_KEYS);
	ck_assert_int_eq(ctr(ctx, "cache.corrupt"), 0);
	ej_kcache_close(c);
	tu_tmpdir_free(strdup(dir));
	epj_ctx_free(ctx);
}
END_TEST

/* ---- degrading ------------------------------------------------------------
 */

/* A full disk (RLIMIT_FSIZE below the entry's size; SIGXFSZ ignored, so the
 * write fails with EFBIG), a directory where the entry should go, and (not
 * as root) a read-only cache: every put still succeeds in memory, counts
 * cache.write_errors, leaves no temporary file. */
START_TEST(test_degrade)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("kc");
	epj_log_level lvl = epj_log_level_get();
	epj_log_level_set(EPJ_LOG_ERROR);
	char key[65], key2[65], key3[65];
	make_key(key, "degrade", 0);
	make_key(key2, "degrade", 1);
	make_key(key3, "degrade", 2);
	size_t n = (size_t)tu_randint(5000, 20000);
	unsigned char *blob = random_bytes(n);
	ej_kcache *c = open_ok(ctx, dir);

	struct rlimit old, tiny = { .rlim_cur = 2048 };
	ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &old), 0);
	tiny.rlim_max = old.rlim_max;
	void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
	ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &tiny), 0);
	epj_status st = ej_kcache_put(c, key, blob, n, "src");
	ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &old), 0);
	signal(SIGXFSZ, prev);
	ck_assert_int_eq(st, EPJ_OK);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_OK);
	ck_assert_int_eq(ctr(ctx, "cache.write_errors"), 1);
	ck_assert(!exists(entry_path(dir, key)));
	ck_assert_int_eq(count_names(dir, ".tmp."), 0);
	assert_hit(ctx, c, key, blob, n); /* from memory */

	/* A directory where the entry file should be made. */
	/* (its fan-out directory exists when the two keys share a prefix) */
	ck_assert(mkdir(path_of("%s/v1/%.2s", dir, key2), 0700) == 0 ||
		  errno == EEXIST);
	ck_assert_int_eq(mkdir(entry_path(dir, key2), 0700), 0);
	ck_assert_int_eq(mkdir(path_of("%s/x", entry_path(dir, key2)), 0700),
			 0);
	ck_assert_int_eq(ej_kcache_put(c, key2, blob, n, "src"), EPJ_OK);
	ck_assert_int_eq(ctr(ctx, "cache.write_errors"), 2);
	ck_assert_int_eq(count_names(dir, ".tmp."), 0);
	assert_hit(ctx, c, key2, blob, n);
	ej_kcache_close(c);

	/* A file where a shard directory should be. */
	if (!exists(path_of("%s/v1/%.2s", dir, key3))) {
		tu_write_file(path_of("%s/v1/%.2s", dir, key3), "x", 1);
		c = open_ok(ctx, dir);
		assert_miss(c, key3);
		ck_assert_int_eq(ej_kcache_put(c, key3, blob, n, "s"), EPJ_OK);
		ck_assert_int_eq(ctr(ctx, "cache.write_errors"), 3);
		assert_hit(ctx, c, key3, blob, n);
		ck_assert_int_eq(epj_ctx_status(ctx), EPJ_OK);
		ej_kcache_close(c);
	}

	/* A cache that cannot be created under a read-only directory (only
	 * without root: root writes anyway). */
	if (geteuid() != 0) {
		char *ro = strdup(path_of("%s/ro", dir));
		ck_assert_int_eq(mkdir(ro, 0500), 0);
		c = ej_kcache_open(ctx, path_of("%s/cache", ro));
		ck_assert_ptr_nonnull(c);
		ck_assert(!ej_kcache_on_disk(c));
		ck_assert_int_eq(ej_kcache_put(c, key, blob, n, "s"), EPJ_OK);
		assert_hit(ctx, c, key, blob, n);
		ej_kcache_close(c);
		free(ro);
	}
	/* An insecure shard stays an error. */
	c = open_ok(ctx, dir);
	char *shard = strdup(path_of("%s/v1/%.2s", dir, key2));
	ck_assert_int_eq(chmod(shard, 0777), 0);
	ck_assert_int_eq(ej_kcache_put(c, key2, blob, n, "src"), EPJ_ERR_STATE);
	ck_assert_int_eq(chmod(shard, 0700), 0);
	ej_kcache_close(c);
	free(shard);
	epj_log_level_set(lvl);
	free(blob);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* The host tag of temporary file names (kcache.c): 8 hex digits of
 * epj_hash of the host name. */
static void host_tag(char out[9])
{
	char h[256] = "", hex[33];
	ck_assert_int_eq(gethostname(h, sizeof h - 1), 0);
	epj_hash_hex(epj_hash(h, strlen(h)), hex);
	memcpy(out, hex, 8);
	out[8] = '\0';
}

START_TEST(test_stale_tmp)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("kc");
	char key[65], tag[9];
	make_key(key, "stale", 0);
	host_tag(tag);
	unsigned char b[3] = { 4, 5, 6 };
	ej_kcache *c = open_ok(ctx, dir);
	ck_assert_int_eq(ej_kcache_put(c, key, b, 3, "s"), EPJ_OK);
	ej_kcache_close(c);
	/* A dead process of this host: a child that has exited. */
	pid_t dead = fork();
	ck_assert_int_ge(dead, 0);
	if (dead == 0)
		_exit(0);
	ck_assert_int_eq(waitpid(dead, NULL, 0), dead);
	const char *sh = path_of("%s/v1/%.2s", dir, key);
	char *gone =
	    strdup(path_of("%s/%s.tmp.%d.7.%s", sh, key, (int)dead, tag));
	char *live =
	    strdup(path_of("%s/%s.tmp.%d.7.%s", sh, key, (int)getpid(), tag));
	char *other =
	    strdup(path_of("%s/%s.tmp.%d.7.0badc0de", sh, key, (int)dead));
	tu_write_file(gone, "partial", 7);
	tu_write_file(live, "partial", 7);
	tu_write_file(other, "partial", 7);
	c = open_ok(ctx, dir);
	ck_assert(!exists(gone));
	ck_assert(exists(live));  /* a writer at work */
	ck_assert(exists(other)); /* another host's pid means nothing here */
	ck_assert_int_eq(ctr(ctx, "cache.stale_tmp_removed"), 1);
	assert_hit(ctx, c, key, b, 3);
	ej_kcache_close(c);
	free(gone);
	free(live);
	free(other);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- per-key lock -----------------------------------------------------------
 */

/* A child takes the lock and reports through a pipe; the parent's lock
 * waits (counted) until the child is killed with SIGKILL, then is taken at
 * once: a dead holder never blocks. */
START_TEST(test_lock)
{
	char dir[] = "/tmp/epj-kcl-XXXXXX";
	ck_assert_ptr_nonnull(mkdtemp(dir));
	char key[65], other[65];
	make_key(key, "lock", 0);
	make_key(other, "lock", 1);
	int up[2];
	ck_assert_int_eq(pipe(up), 0);
	fflush(NULL);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		epj_ctx *cx = NULL;
		if (epj_ctx_new("cpu", &cx) != EPJ_OK)
			_exit(2);
		ej_kcache *c = ej_kcache_open(cx, dir);
		int lk = -1;
		if (!c || ej_kcache_lock(c, key, &lk) != EPJ_OK || lk < 0)
			_exit(3);
		if (write(up[1], "L", 1) != 1)
			_exit(4);
		for (;;)
			pause();
	}
	close(up[1]); /* a child that fails closes the pipe: read sees EOF */
	char ch;
	ck_assert_int_eq(read(up[0], &ch, 1), 1);
	epj_ctx *ctx = tu_ctx();
	ej_kcache *c = open_ok(ctx, dir);
	/* Another key is not held up. */
	int lk = -1;
	ck_assert_int_eq(ej_kcache_lock(c, other, &lk), EPJ_OK);
	ck_assert_int_ge(lk, 0);
	ej_kcache_unlock(c, lk);
	ck_assert_int_eq(ctr(ctx, "cache.lock_waits"), 0);
	/* The held key: kill the holder while we wait. */
	pid_t killer = fork();
	ck_assert_int_ge(killer, 0);
	if (killer == 0) {
		usleep(300000);
		kill(pid, SIGKILL);
		_exit(0);
	}
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	ck_assert_int_eq(ej_kcache_lock(c, key, &lk), EPJ_OK);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	ck_assert_int_ge(lk, 0);
	double waited = (double)(t1.tv_sec - t0.tv_sec) +
			(double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
	ck_assert_msg(waited >= 0.25 && waited < 5, "waited %.3f s", waited);
	ck_assert_int_eq(ctr(ctx, "cache.lock_waits"), 1);
	ej_kcache_unlock(c, lk);
	int ws;
	ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
	ck_assert(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
	ck_assert_int_eq(waitpid(killer, &ws, 0), killer);
	/* Taken again at once; a timeout of 0 gives up a held lock. */
	ck_assert_int_eq(ej_kcache_lock(c, key, &lk), EPJ_OK);
	ck_assert_int_ge(lk, 0);
	ej_kcache *c2 = open_ok(ctx, dir);
	setenv("EPJIT_CACHE_LOCK_TIMEOUT", "0", 1);
	epj_log_level lvl = epj_log_level_get();
	epj_log_level_set(EPJ_LOG_ERROR);
	int lk2 = 7;
	ck_assert_int_eq(ej_kcache_lock(c2, key, &lk2), EPJ_OK);
	epj_log_level_set(lvl);
	unsetenv("EPJIT_CACHE_LOCK_TIMEOUT");
	ck_assert_int_eq(lk2, -1);
	ck_assert_int_eq(ctr(ctx, "cache.lock_timeouts"), 1);
	ej_kcache_unlock(c, lk);
	ej_kcache_close(c2);
	ej_kcache_close(c);
	close(up[0]);
	tu_tmpdir_free(strdup(dir));
	epj_ctx_free(ctx);
}
END_TEST

/* ---- many processes compiling into one fresh cache --------------------------
 *
 * N_COMPILERS processes start at once on an empty cache and compile the same
 * G_GRAPHS graphs with the C backend: each key is compiled by exactly one of
 * them (the per-key lock; codegen.cc_compiles summed over all is the number
 * of entries), all get identical outputs that agree with eager execution,
 * and every entry verifies afterwards.  A second round kills some of them
 * with SIGKILL at random points: no corrupt entry, no temporary file after
 * the next open, and a fresh process then compiles everything without
 * waiting for a lock. */

enum { N_COMPILERS = 8, G_GRAPHS = 3 };

/* y = sigmoid(x * (0.37 + g) + b) * tanh(x) - x / 3, graph g. */
typedef struct cg_graph {
	int g;
} cg_graph;

static epj_tensor *cg_eval(epj_ctx *ctx, int g, epj_tensor *const *in)
{
	epj_tensor *xs = epj_mul_scalar(ctx, in[0], 0.37 + g);
	epj_tensor *h = epj_add(ctx, xs, in[1]);
	epj_tensor *s = epj_sigmoid(ctx, h);
	epj_tensor *t = epj_tanh(ctx, in[0]);
	epj_tensor *p = epj_mul(ctx, s, t);
	epj_tensor *x3 = epj_mul_scalar(ctx, in[0], 1.0 / 3.0);
	epj_tensor *y = epj_sub(ctx, p, x3);
	epj_tensor *tmp[] = { xs, h, s, t, p, x3 };
	for (size_t i = 0; i < EJ_ARRAY_LEN(tmp); i++)
		epj_tensor_free(tmp[i]);
	return y;
}

static epj_status cg_traced(void *user, epj_ctx *ctx, epj_tensor *const *in,
			    int n_in, epj_tensor **out, int n_out)
{
	(void)n_in;
	(void)n_out;
	out[0] = cg_eval(ctx, ((cg_graph *)user)->g, in);
	return out[0] ? EPJ_OK : epj_ctx_status(ctx);
}

/* Deterministic inputs of graph g: x [3 + g, 5 + 2g], b [5 + 2g]. */
static void cg_inputs(epj_ctx *ctx, int g, uint64_t seed, epj_tensor **in)
{
	int64_t sx[2] = { 3 + g, 5 + 2 * g }, sb = 5 + 2 * g;
	in[0] = epj_zeros(ctx, EPJ_DTYPE_F32, 2, sx);
	in[1] = epj_zeros(ctx, EPJ_DTYPE_F32, 1, &sb);
	uint64_t x = seed * 2654435761u + (uint64_t)g + 1;
	for (int k = 0; k < 2; k++)
		for (int64_t i = 0; i < epj_tensor_numel(in[k]); i++) {
			x ^= x << 13;
			x ^= x >> 7;
			x ^= x << 17;
			epj_tensor_set_f64(in[k], i,
					   (double)(x % 20001) / 5000.0 - 2.0);
		}
}

/* What a compiling process reports through its pipe. */
typedef struct cg_report {
	uint64_t out_hash[G_GRAPHS]; /* epj_hash of the compiled output */
	int64_t cc_compiles, lock_waits;
	int ok; /* 1: every output matched eager */
} cg_report;

static int compile_child(const char *dir, uint64_t seed, int gate, int out)
{
	char c1;
	if (read(gate, &c1, 1) < 0)
		return 2;
	setenv("EPJIT_CACHE_DIR", dir, 1);
	/* Build directories of killed compiles stay: keep them in the test's
	 * directory, not in /tmp. */
	char tmp[4200];
	snprintf(tmp, sizeof tmp, "%s/tmp", dir);
	mkdir(tmp, 0700);
	setenv("TMPDIR", tmp, 1);
	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return 3;
	cg_report r = { .ok = 1 };
	ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_C);
	bool prev = epj_no_grad_enter(ctx);
	for (int g = 0; g < G_GRAPHS && r.ok; g++) {
		epj_tensor *in[2];
		cg_inputs(ctx, g, seed, in);
		cg_graph u = { g };
		ej_trace *tr = NULL;
		ej_region_fn *f = NULL;
		epj_tensor *y = NULL, *ref = cg_eval(ctx, g, in);
		int64_t l0 = epj_counter_get(ctx, "kernels.launched.compiled");
		if (ej_trace_region(ctx, jit, cg_traced, &u, in, 2, 1, NULL,
				    NULL, &tr) != EPJ_OK ||
		    ej_jit_compile(ctx, jit, tr, &f) != EPJ_OK ||
		    ej_region_run(ctx, f, in, 2, NULL, 0, NULL, NULL, &y, 1) !=
			EPJ_OK) {
			fprintf(stderr, "compile child: %s\n",
				epj_ctx_error(ctx));
			r.ok = 0;
		}
		/* compiled code ran, and agrees with eager */
		if (r.ok &&
		    epj_counter_get(ctx, "kernels.launched.compiled") == l0)
			r.ok = 0;
		for (int64_t i = 0; r.ok && i < epj_tensor_numel(y); i++) {
			double a = epj_tensor_get_f64(y, i);
			double b = epj_tensor_get_f64(ref, i);
			if (!(fabs(a - b) <= 1e-5 * (1 + fabs(b))))
				r.ok = 0;
		}
		if (r.ok)
			r.out_hash[g] =
			    epj_hash(epj_tensor_data(y),
				     (size_t)epj_tensor_numel(y) * 4)
				.lo;
		epj_tensor_free(y);
		epj_tensor_free(ref);
		ej_region_fn_free(f);
		epj_tensor_free(in[0]);
		epj_tensor_free(in[1]);
	}
	epj_no_grad_exit(ctx, prev);
	r.cc_compiles = epj_counter_get(ctx, "codegen.cc_compiles");
	r.lock_waits = epj_counter_get(ctx, "cache.lock_waits");
	ej_jit_free(jit);
	epj_ctx_free(ctx);
	return write(out, &r, sizeof r) == (ssize_t)sizeof r && r.ok ? 0 : 4;
}

/* Starts n compiling processes at once; kill_ms[i] >= 0 kills process i
 * with SIGKILL that many ms after the start.  Fills rep[i] (zeroed for a
 * killed or failed one) and returns how many were killed before reporting.
 */
static int run_compilers(const char *dir, uint64_t seed, int n,
			 const int *kill_ms, cg_report *rep, int *status)
{
	int gate[2], pipes[N_COMPILERS][2];
	ck_assert_int_eq(pipe(gate), 0);
	pid_t pid[N_COMPILERS];
	fflush(NULL);
	for (int i = 0; i < n; i++) {
		ck_assert_int_eq(pipe(pipes[i]), 0);
		pid[i] = fork();
		ck_assert_int_ge(pid[i], 0);
		if (pid[i] == 0) {
			close(gate[1]);
			close(pipes[i][0]);
			_exit(compile_child(dir, seed, gate[0], pipes[i][1]));
		}
		close(pipes[i][1]);
	}
	close(gate[0]);
	close(gate[1]); /* go */
	struct timespec t0;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (int done = 0; kill_ms && !done;) {
		struct timespec t;
		clock_gettime(CLOCK_MONOTONIC, &t);
		int64_t ms = (int64_t)(t.tv_sec - t0.tv_sec) * 1000 +
			     (t.tv_nsec - t0.tv_nsec) / 1000000;
		done = 1;
		for (int i = 0; i < n; i++) {
			if (kill_ms[i] < 0)
				continue;
			if (ms >= kill_ms[i])
				kill(pid[i], SIGKILL);
			else
				done = 0;
		}
		usleep(2000);
	}
	int killed = 0;
	for (int i = 0; i < n; i++) {
		memset(&rep[i], 0, sizeof rep[i]);
		ssize_t got = read(pipes[i][0], &rep[i], sizeof rep[i]);
		close(pipes[i][0]);
		ck_assert_int_eq(waitpid(pid[i], &status[i], 0), pid[i]);
		if (WIFSIGNALED(status[i]) && WTERMSIG(status[i]) == SIGKILL &&
		    got != (ssize_t)sizeof rep[i])
			killed++;
	}
	return killed;
}

/* Every entry of dir verifies (a fresh cache; no corrupt one); returns the
 * number of entries. */
static int verify_entries(const char *dir)
{
	epj_ctx *ctx = tu_ctx();
	ej_kcache *c = open_ok(ctx, dir);
	int n = 0;
	DIR *v = opendir(path_of("%s/v1", dir));
	ck_assert_ptr_nonnull(v);
	struct dirent *de;
	while ((de = readdir(v))) {
		if (de->d_name[0] == '.')
			continue;
		char *sh = strdup(path_of("%s/v1/%s", dir, de->d_name));
		DIR *s = opendir(sh);
		ck_assert_ptr_nonnull(s);
		struct dirent *e;
		while ((e = readdir(s))) {
			size_t l = strlen(e->d_name);
			if (l != 68 || strcmp(e->d_name + 64, ".bin"))
				continue;
			char key[65];
			memcpy(key, e->d_name, 64);
			key[64] = '\0';
			void *d = NULL;
			size_t len = 0;
			ck_assert_int_eq(ej_kcache_get(c, key, &d, &len),
					 EPJ_OK);
			ck_assert_msg(d != NULL, "entry %s does not verify",
				      key);
			ck_assert(len > 4 && !memcmp(d,
						     "\x7f"
						     "ELF",
						     4));
			free(d);
			n++;
		}
		closedir(s);
		free(sh);
	}
	closedir(v);
	ck_assert_int_eq(ctr(ctx, "cache.corrupt"), 0);
	ej_kcache_close(c);
	epj_ctx_free(ctx);
	return n;
}

START_TEST(test_many_compilers)
{
	char dir[] = "/tmp/epj-kcc-XXXXXX";
	ck_assert_ptr_nonnull(mkdtemp(dir));
	uint64_t seed = tu_seed();
	cg_report rep[N_COMPILERS];
	int status[N_COMPILERS];
	ck_assert_int_eq(
	    run_compilers(dir, seed, N_COMPILERS, NULL, rep, status), 0);
	int64_t compiles = 0, waits = 0;
	for (int i = 0; i < N_COMPILERS; i++) {
		ck_assert_msg(WIFEXITED(status[i]) &&
				  WEXITSTATUS(status[i]) == 0,
			      "compiler %d failed (status %#x)", i, status[i]);
		ck_assert_int_eq(rep[i].ok, 1);
		for (int g = 0; g < G_GRAPHS; g++)
			ck_assert_msg(rep[i].out_hash[g] == rep[0].out_hash[g],
				      "graph %d: process %d differs", g, i);
		compiles += rep[i].cc_compiles;
		waits += rep[i].lock_waits;
	}
	int entries = verify_entries(dir);
	ck_assert_int_ge(entries, G_GRAPHS);
	ck_assert_msg(compiles == entries,
		      "%lld compiles for %d entries: not one per key",
		      (long long)compiles, entries);
	printf("check_kcache: %d processes, %d entries, %lld compiles, "
	       "%lld lock waits\n",
	       N_COMPILERS, entries, (long long)compiles, (long long)waits);
	ck_assert_int_eq(count_names(dir, ".tmp."), 0);
	tu_tmpdir_free(strdup(dir));
}
END_TEST

START_TEST(test_compilers_killed)
{
	char dir[] = "/tmp/epj-kck-XXXXXX";
	ck_assert_ptr_nonnull(mkdtemp(dir));
	uint64_t seed = tu_seed();
	cg_report rep[N_COMPILERS];
	int status[N_COMPILERS], kill_ms[N_COMPILERS];
	for (int round = 0; round < 2; round++) {
		/* about half of them die at a random point of their work */
		for (int i = 0; i < N_COMPILERS; i++)
			kill_ms[i] =
			    tu_randint(0, 2) ? (int)tu_randint(0, 700) : -1;
		int killed =
		    run_compilers(dir, seed, N_COMPILERS, kill_ms, rep, status);
		for (int i = 0; i < N_COMPILERS; i++)
			ck_assert_msg((WIFSIGNALED(status[i]) &&
				       WTERMSIG(status[i]) == SIGKILL) ||
					  (WIFEXITED(status[i]) &&
					   WEXITSTATUS(status[i]) == 0),
				      "compiler %d: status %#x", i, status[i]);
		printf("check_kcache: round %d: %d of %d killed (at", round,
		       killed, N_COMPILERS);
		for (int i = 0; i < N_COMPILERS; i++)
			if (kill_ms[i] >= 0)
				printf(" %d%s", kill_ms[i],
				       WIFSIGNALED(status[i]) ? "" : "(done)");
		printf(" ms)\n");
		verify_entries(dir); /* also sweeps dead temporaries */
		ck_assert_int_eq(count_names(dir, ".tmp."), 0);
	}
	/* A fresh process finishes everything at once: no stuck lock. */
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	ck_assert_int_eq(run_compilers(dir, seed, 1, NULL, rep, status), 0);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	ck_assert(WIFEXITED(status[0]) && WEXITSTATUS(status[0]) == 0);
	ck_assert_int_eq(rep[0].lock_waits, 0);
	ck_assert_int_lt(t1.tv_sec - t0.tv_sec, 30);
	ck_assert_int_eq(verify_entries(dir), G_GRAPHS);
	tu_tmpdir_free(strdup(dir));
}
END_TEST

/* A compiler that "succeeds" but writes junk: the module does not load,
 * the build fails naming it, and nothing is cached (every later run would
 * load the junk and fail until the cache was cleared).  A good compiler
 * afterwards builds and caches normally. */
START_TEST(test_junk_not_cached)
{
	char *dir = tu_tmpdir_new("kcj");
	char *script = tu_path(dir, "junkcc.sh");
	tu_write_text(script, "out=\n"
			      "while [ $# -gt 0 ]; do\n"
			      "  [ \"$1\" = -o ] && out=$2\n"
			      "  shift\n"
			      "done\n"
			      "printf 'not an ELF object' > \"$out\"\n");
	char *cache = tu_path(dir, "cache");
	char cc[4200];
	snprintf(cc, sizeof cc, "sh %s", script);
	char *old_cc = getenv("EPJIT_CC") ? strdup(getenv("EPJIT_CC")) : NULL;
	char *old_dir = getenv("EPJIT_CACHE_DIR")
			    ? strdup(getenv("EPJIT_CACHE_DIR"))
			    : NULL;
	setenv("EPJIT_CC", cc, 1);
	setenv("EPJIT_CACHE_DIR", cache, 1);
	epj_ctx *ctx = tu_ctx();
	uint64_t seed = tu_seed();
	bool prev = epj_no_grad_enter(ctx);
	for (int round = 0; round < 2; round++) {
		ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_C);
		epj_tensor *in[2];
		cg_inputs(ctx, 1, seed, in);
		cg_graph u = { 1 };
		ej_trace *tr = NULL;
		ej_region_fn *f = NULL;
		ck_assert_int_eq(ej_trace_region(ctx, jit, cg_traced, &u, in, 2,
						 1, NULL, NULL, &tr),
				 EPJ_OK);
		epj_status st = ej_jit_compile(ctx, jit, tr, &f);
		if (round == 0) {
			ck_assert_int_ne(st, EPJ_OK);
			ck_assert_msg(strstr(epj_ctx_error(ctx), "dlopen") ||
					  strstr(epj_ctx_error(ctx), "loading"),
				      "%s", epj_ctx_error(ctx));
			ck_assert_int_eq(count_names(cache, ".bin"), 0);
			epj_ctx_clear_error(ctx);
			/* the real compiler again */
			if (old_cc)
				setenv("EPJIT_CC", old_cc, 1);
			else
				unsetenv("EPJIT_CC");
		} else {
			ck_assert_msg(st == EPJ_OK, "%s", epj_ctx_error(ctx));
			ck_assert_int_eq(count_names(cache, ".bin"), 1);
		}
		ej_region_fn_free(f);
		ej_jit_free(jit);
		epj_tensor_free(in[0]);
		epj_tensor_free(in[1]);
	}
	epj_no_grad_exit(ctx, prev);
	if (old_dir)
		setenv("EPJIT_CACHE_DIR", old_dir, 1);
	else
		unsetenv("EPJIT_CACHE_DIR");
	free(old_cc);
	free(old_dir);
	free(script);
	free(cache);
	epj_ctx_free(ctx);
	tu_tmpdir_free(dir);
}
END_TEST

/* ---- an entry that does not load -----------------------------------------
 *
 * An entry that passes every check of the cache (key, lengths, checksum) but
 * is no code this process can load (imported with epjit-warmup --import, or
 * built against another glibc) must not fail the compiled run: it is dropped
 * (cache.unloadable, a warning naming the cache directory and the entry),
 * compiled afresh and replaced on disk by a loadable entry, which the next
 * run loads without dropping or compiling anything. */

/* Compiles graph g with a fresh C-backend jit on ctx, runs it and compares
 * with eager; fails the test on any error. */
static void cg_run_ok(epj_ctx *ctx, int g, uint64_t seed)
{
	bool prev = epj_no_grad_enter(ctx);
	ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_C);
	epj_tensor *in[2];
	cg_inputs(ctx, g, seed, in);
	cg_graph u = { g };
	ej_trace *tr = NULL;
	ej_region_fn *f = NULL;
	epj_tensor *y = NULL, *ref = cg_eval(ctx, g, in);
	ck_assert_int_eq(
	    ej_trace_region(ctx, jit, cg_traced, &u, in, 2, 1, NULL, NULL, &tr),
	    EPJ_OK);
	ck_assert_msg(ej_jit_compile(ctx, jit, tr, &f) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_msg(
	    ej_region_run(ctx, f, in, 2, NULL, 0, NULL, NULL, &y, 1) == EPJ_OK,
	    "%s", epj_ctx_error(ctx));
	tu_assert_tensors_close(ctx, y, ref, 1e-5, 1e-5, "compiled vs eager");
	epj_tensor_free(y);
	epj_tensor_free(ref);
	ej_region_fn_free(f);
	epj_tensor_free(in[0]);
	epj_tensor_free(in[1]);
	ej_jit_free(jit);
	epj_no_grad_exit(ctx, prev);
}

static void key_collect(void *user, const char *key, int64_t bytes)
{
	(void)bytes;
	char *out = user; /* the first key only */
	if (!out[0])
		memcpy(out, key, 65);
}

START_TEST(test_unloadable_entry)
{
	char *dir = tu_tmpdir_new("kcu");
	char *cache = tu_path(dir, "cache");
	char *log = tu_path(dir, "stderr");
	char *old_dir = getenv("EPJIT_CACHE_DIR")
			    ? strdup(getenv("EPJIT_CACHE_DIR"))
			    : NULL;
	setenv("EPJIT_CACHE_DIR", cache, 1);
	uint64_t seed = tu_seed();
	int g = (int)tu_randint(0, G_GRAPHS);

	/* a warm cache of one loadable entry */
	epj_ctx *ctx = tu_ctx();
	cg_run_ok(ctx, g, seed);
	ck_assert_int_eq(ctr(ctx, "codegen.cc_compiles"), 1);
	ej_kcache *c = open_ok(ctx, cache);
	char key[65] = "";
	ck_assert_int_eq(ej_kcache_list(c, key_collect, key), 1);
	void *good = NULL;
	size_t good_n = 0;
	char *src = NULL;
	ck_assert_int_eq(
	    ej_kcache_get_with_source(c, key, &good, &good_n, &src), EPJ_OK);
	ck_assert_ptr_nonnull(good);
	/* Planted through the cache's own put, so it has a valid checksum:
	 * an ELF magic, then bytes dlopen refuses. */
	size_t bad_n = 4096 + (size_t)tu_randint(0, 4096);
	unsigned char *bad = random_bytes(bad_n);
	memcpy(bad, "\177ELF", 4);
	ck_assert_int_eq(ej_kcache_put(c, key, bad, bad_n, src), EPJ_OK);
	ej_kcache_close(c);
	epj_ctx_free(ctx);
	ctx = tu_ctx();
	c = open_ok(ctx, cache);
	assert_hit(ctx, c, key, bad, bad_n); /* it verifies */
	ck_assert_int_eq(ctr(ctx, "cache.corrupt"), 0);
	ej_kcache_close(c);
	epj_ctx_free(ctx);

	/* The compiled run succeeds; the entry was dropped, counted, warned
	 * about and rebuilt. */
	ctx = tu_ctx();
	fflush(stderr);
	int saved = dup(2);
	FILE *f = fopen(log, "w");
	ck_assert(saved >= 0 && f);
	dup2(fileno(f), 2);
	epj_log_level lvl = epj_log_level_get();
	epj_log_level_set(EPJ_LOG_INFO); /* the warning is once per process */
	cg_run_ok(ctx, g, seed);
	epj_log_level_set(lvl);
	fflush(stderr);
	dup2(saved, 2);
	close(saved);
	fclose(f);
	ck_assert_int_eq(ctr(ctx, "cache.unloadable"), 1);
	ck_assert_int_eq(ctr(ctx, "codegen.cc_compiles"), 1);
	ck_assert_int_eq(ctr(ctx, "cache.corrupt"), 0);
	char *text = tu_slurp(log, NULL);
	ck_assert_ptr_nonnull(text);
	char *real = realpath(cache, NULL);
	ck_assert_ptr_nonnull(real);
	char file[80];
	snprintf(file, sizeof file, "%s.bin", key);
	ck_assert_msg(strstr(text, real) && strstr(text, file) &&
			  strstr(text, "does not load") &&
			  strstr(text, "cache.unloadable"),
		      "warning lacks the cache, the entry or the counter: %s",
		      text);
	free(text);
	free(real);
	epj_ctx_free(ctx);
	ctx = tu_ctx();
	c = open_ok(ctx, cache);
	void *now = NULL;
	size_t now_n = 0;
	ck_assert_int_eq(ej_kcache_get(c, key, &now, &now_n), EPJ_OK);
	ck_assert_msg(now != NULL, "the entry was not rebuilt");
	ck_assert(now_n > 4 && !memcmp(now, "\177ELF", 4));
	ck_assert(now_n != bad_n || memcmp(now, bad, bad_n) != 0);
	free(now);
	ej_kcache_close(c);
	epj_ctx_free(ctx);

	/* A second run hits the rebuilt entry: nothing dropped, nothing
	 * compiled. */
	ctx = tu_ctx();
	cg_run_ok(ctx, g, seed);
	ck_assert_int_eq(ctr(ctx, "cache.unloadable"), 0);
	ck_assert_int_eq(ctr(ctx, "codegen.cc_compiles"), 0);
	ck_assert_int_eq(ctr(ctx, "cache.misses"), 0);
	ck_assert_int_eq(ctr(ctx, "cache.disk_hits"), 1);
	epj_ctx_free(ctx);

	if (old_dir)
		setenv("EPJIT_CACHE_DIR", old_dir, 1);
	else
		unsetenv("EPJIT_CACHE_DIR");
	free(old_dir);
	free(good);
	free(src);
	free(bad);
	free(cache);
	free(log);
	tu_tmpdir_free(dir);
}
END_TEST

/* ---- a refused directory does not stop a run ------------------------------
 *
 * A cache directory below a group-writable one (what `git archive | tar -x`
 * as root, or umask 002, gives) is refused: ej_kcache_open fails.  What a
 * run's builders call, ej_kcache_open_for_run, opens a cache in a private
 * directory of the process instead ($TMPDIR/epjit-kcache-<pid>.<host>-
 * XXXXXX, mode 0700), counts cache.refused and warns once, in one line
 * that says why and where; a C-backend compile with the refused directory
 * as EPJIT_CACHE_DIR works and writes nothing there.  The directory goes
 * at exit; one left by a process killed with SIGKILL goes at the next
 * open.  The work runs in a child (fresh process state: the warning is once
 * per process, the directory is the process's) with stderr in a file. */

#define CHILD_CHECK(cond)                                                      \
	do {                                                                   \
		if (!(cond)) {                                                 \
			fprintf(stderr, "child check failed, line %d: %s\n",   \
				__LINE__, #cond);                              \
			_exit(10);                                             \
		}                                                              \
	} while (0)

/* Graph 0 compiled by a C-backend jit of ctx, run and compared with eager;
 * false (message on stderr) when any of it fails. */
static bool refused_compile_ok(epj_ctx *ctx)
{
	ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_C);
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *in[2];
	cg_inputs(ctx, 0, 7, in);
	cg_graph u = { 0 };
	ej_trace *tr = NULL;
	ej_region_fn *f = NULL;
	epj_tensor *y = NULL, *ref = cg_eval(ctx, 0, in);
	bool ok =
	    ej_trace_region(ctx, jit, cg_traced, &u, in, 2, 1, NULL, NULL,
			    &tr) == EPJ_OK &&
	    ej_jit_compile(ctx, jit, tr, &f) == EPJ_OK &&
	    ej_region_run(ctx, f, in, 2, NULL, 0, NULL, NULL, &y, 1) == EPJ_OK;
	if (!ok)
		fprintf(stderr, "compile: %s\n", epj_ctx_error(ctx));
	for (int64_t i = 0; ok && i < epj_tensor_numel(y); i++) {
		double a = epj_tensor_get_f64(y, i);
		double b = epj_tensor_get_f64(ref, i);
		ok = fabs(a - b) <= 1e-5 * (1 + fabs(b));
	}
	ok = ok && epj_counter_get(ctx, "codegen.cc_compiles") == 1;
	epj_tensor_free(y);
	epj_tensor_free(ref);
	ej_region_fn_free(f);
	epj_tensor_free(in[0]);
	epj_tensor_free(in[1]);
	epj_no_grad_exit(ctx, prev);
	ej_jit_free(jit);
	return ok;
}

/* The child: refused is the cache directory (below a group-writable
 * one), tmp its TMPDIR; ends with exit(0), or SIGKILL when die. */
static void refused_child(const char *refused, const char *tmp,
			  const char *errf, bool die)
{
	int fd = open(errf, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	if (fd < 0 || dup2(fd, 2) < 0)
		_exit(2);
	close(fd);
	setenv("TMPDIR", tmp, 1);
	setenv("EPJIT_CACHE_DIR", refused, 1);
	epj_ctx *ctx = NULL;
	CHILD_CHECK(epj_ctx_new("cpu", &ctx) == EPJ_OK);
	/* the strict open refuses it, as before */
	CHILD_CHECK(ej_kcache_open(ctx, NULL) == NULL);
	CHILD_CHECK(epj_ctx_status(ctx) == EPJ_ERR_STATE);
	epj_ctx_clear_error(ctx);

	ej_kcache *c = ej_kcache_open_for_run(ctx, NULL);
	CHILD_CHECK(c != NULL && ej_kcache_on_disk(c));
	CHILD_CHECK(ej_kcache_refused(c) &&
		    strstr(ej_kcache_refused(c), "group- or world-writable"));
	char want[4200];
	snprintf(want, sizeof want, "%s/epjit-kcache-%d.", tmp, (int)getpid());
	char priv[4200];
	snprintf(priv, sizeof priv, "%s", ej_kcache_dir(c));
	CHILD_CHECK(!strncmp(priv, want, strlen(want)));
	struct stat st;
	CHILD_CHECK(lstat(priv, &st) == 0 && S_ISDIR(st.st_mode) &&
		    (st.st_mode & 07777) == 0700 && st.st_uid == geteuid());
	CHILD_CHECK(epj_counter_get(ctx, "cache.refused") == 1);
	char key[65];
	make_key(key, "refused", 0);
	unsigned char b[3] = { 4, 5, 6 };
	CHILD_CHECK(ej_kcache_put(c, key, b, 3, "s") == EPJ_OK);
	CHILD_CHECK(exists(entry_path(priv, key)));
	/* a second open: the same private directory, counted again */
	ej_kcache *c2 = ej_kcache_open_for_run(ctx, refused);
	CHILD_CHECK(c2 && !strcmp(ej_kcache_dir(c2), priv));
	CHILD_CHECK(epj_counter_get(ctx, "cache.refused") == 2);
	ej_kcache_close(c2);
	ej_kcache_close(c);

	/* a compiled region with the refused directory as EPJIT_CACHE_DIR */
	CHILD_CHECK(refused_compile_ok(ctx));
	CHILD_CHECK(epj_counter_get(ctx, "cache.refused") == 3);
	CHILD_CHECK(count_names(priv, ".bin") >= 2);
	/* nothing went into the refused directory */
	CHILD_CHECK(!exists(path_of("%s/v1", refused)));
	epj_ctx_free(ctx);
	fflush(NULL);
	if (die)
		raise(SIGKILL);
	exit(0); /* atexit removes the private directory */
}

/* Lines of text that contain part. */
static int count_lines_with(const char *text, const char *part)
{
	int n = 0;
	for (const char *l = text; l && *l;) {
		const char *e = strchr(l, '\n');
		size_t len = e ? (size_t)(e - l) : strlen(l);
		const char *hit = strstr(l, part);
		n += hit && (size_t)(hit - l) < len;
		l = e ? e + 1 : NULL;
	}
	return n;
}

/* Runs refused_child; its wait status. */
static int refused_run(const char *refused, const char *tmp, const char *errf,
		       bool die)
{
	fflush(NULL);
	pid_t p = fork();
	ck_assert_int_ge(p, 0);
	if (p == 0)
		refused_child(refused, tmp, errf, die);
	int ws;
	ck_assert_int_eq(waitpid(p, &ws, 0), p);
	return ws;
}

START_TEST(test_refused_private_dir)
{
	char *top = tu_tmpdir_new("kcref");
	char *open_dir = strdup(path_of("%s/shared", top));
	ck_assert_int_eq(mkdir(open_dir, 0700), 0);
	ck_assert_int_eq(chmod(open_dir, 0775), 0); /* umask 002 */
	char *refused = strdup(path_of("%s/kc", open_dir));
	char *tmp = strdup(path_of("%s/tmp", top));
	ck_assert_int_eq(mkdir(tmp, 0700), 0);
	char *errf = strdup(path_of("%s/stderr.txt", top));

	int ws = refused_run(refused, tmp, errf, false);
	char *err = tu_slurp(errf, NULL);
	ck_assert_ptr_nonnull(err);
	ck_assert_msg(WIFEXITED(ws) && WEXITSTATUS(ws) == 0,
		      "child: status %#x: %s", ws, err);
	/* one warning line: the reason and where compiles go instead */
	ck_assert_int_eq(count_lines_with(err, "refusing"), 1);
	char *line = strstr(err, "refusing");
	ck_assert_ptr_nonnull(line);
	char *eol = strchr(line, '\n');
	ck_assert_ptr_nonnull(eol);
	*eol = '\0';
	ck_assert_msg(strstr(line, "group- or world-writable") &&
			  strstr(line, "compiling into ") &&
			  strstr(line, "/epjit-kcache-") &&
			  strstr(line, "cache.refused"),
		      "warning: %s", line);
	free(err);
	/* the private directory went at exit */
	ck_assert_int_eq(tu_dir_count(tmp), 0);

	/* killed: the directory stays until the next open removes it */
	ws = refused_run(refused, tmp, errf, true);
	err = tu_slurp(errf, NULL);
	ck_assert_msg(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL,
		      "child: status %#x: %s", ws, err ? err : "");
	free(err);
	ck_assert_int_eq(tu_dir_count(tmp), 1);
	char *good = tu_tmpdir_new("kcgood");
	epj_ctx *ctx = tu_ctx();
	char *saved = getenv("TMPDIR") ? strdup(getenv("TMPDIR")) : NULL;
	setenv("TMPDIR", tmp, 1);
	ej_kcache *c = open_ok(ctx, good);
	if (saved)
		setenv("TMPDIR", saved, 1);
	else
		unsetenv("TMPDIR");
	free(saved);
	ck_assert_int_eq(tu_dir_count(tmp), 0);
	ej_kcache_close(c);
	epj_ctx_free(ctx);
	tu_tmpdir_free(good);
	free(errf);
	free(tmp);
	free(refused);
	free(open_dir);
	tu_tmpdir_free(top);
}
END_TEST

Suite *make_kcache_suite(void)
{
	Suite *s = suite_create("kcache");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_roundtrip);
	tcase_add_test(tc, test_key);
	tcase_add_test(tc, test_corrupt);
	tcase_add_test(tc, test_insecure_dir);
	tcase_add_test(tc, test_symlink_dir);
	tcase_add_test(tc, test_default_dir);
	tcase_add_test(tc, test_eviction);
	tcase_add_test(tc, test_degrade);
	tcase_add_test(tc, test_stale_tmp);
	tcase_set_timeout(tc, 30);
	suite_add_tcase(s, tc);
	TCase *tp = tcase_create("concurrent");
	tcase_add_test(tp, test_concurrent);
	tcase_add_test(tp, test_lock);
	tcase_add_test(tp, test_many_compilers);
	tcase_add_test(tp, test_compilers_killed);
	tcase_add_test(tp, test_junk_not_cached);
	tcase_add_test(tp, test_unloadable_entry);
	tcase_add_test(tp, test_refused_private_dir);
	tcase_set_timeout(tp, 180);
	suite_add_tcase(s, tp);
	return s;
}
