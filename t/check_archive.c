/* check_archive.c -- kernel-cache archives (jit/kcache_archive.c).
 *
 * Entries are made here with random sources and artifacts under the keys
 * the backends compute (ej_backend_c_key, ej_nvrtc_cache_key), exported,
 * and imported into a fresh cache, which must then hold the same bytes.
 * Archives are damaged on purpose: a flipped byte anywhere, truncation at
 * a random length, an entry whose source was changed with every checksum
 * recomputed (only the key check can see it), an entry relabelled with
 * another compiler identity or generator build (checksums recomputed), an
 * arch outside EPJIT_CUDA_ARCH, another host compiler ($EPJIT_CC).  Each
 * must be refused with a message naming the reason, and the destination
 * cache must stay empty (a partial or corrupt archive imports nothing).
 */
#include "check_util.h"

#include "cc.h"
#include "jit_impl.h"
#include "kcache.h"
#include "kcache_archive.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers ---- */

typedef struct bytes {
	unsigned char *p;
	size_t n;
} bytes;

static bytes slurp(const char *path)
{
	bytes b = { 0 };
	FILE *f = fopen(path, "rb");
	ck_assert_ptr_nonnull(f);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	b.p = malloc((size_t)n + 1);
	b.n = fread(b.p, 1, (size_t)n, f);
	ck_assert_int_eq((long)b.n, n);
	fclose(f);
	return b;
}

static void spit(const char *path, const unsigned char *p, size_t n)
{
	FILE *f = fopen(path, "wb");
	ck_assert_ptr_nonnull(f);
	ck_assert_uint_eq(fwrite(p, 1, n, f), n);
	fclose(f);
}

static uint64_t get64(const unsigned char *p)
{
	uint64_t v = 0;
	for (int i = 0; i < 8; i++)
		v |= (uint64_t)p[i] << (8 * i);
	return v;
}

static void put64(unsigned char *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

/* A random printable source of n characters. */
static char *rand_source(size_t n)
{
	char *s = malloc(n + 1);
	for (size_t i = 0; i < n; i++)
		s[i] = (char)(' ' + tu_randint(0, 95));
	s[n] = '\0';
	return s;
}

/* Puts one C entry (random source and artifact); returns its key. */
static void put_c(ej_kcache *kc, char key[65])
{
	char *src = rand_source((size_t)tu_randint(10, 3000));
	size_t n = (size_t)tu_randint(1, 5000);
	unsigned char *art = malloc(n);
	for (size_t i = 0; i < n; i++)
		art[i] = (unsigned char)tu_randint(0, 256);
	ej_backend_c_key(src, key);
	ck_assert_int_eq(ej_kcache_put(kc, key, art, n, src), EPJ_OK);
	free(src);
	free(art);
}

static void put_nvrtc(ej_kcache *kc, const char *arch, char key[65])
{
	char *src = rand_source((size_t)tu_randint(10, 2000));
	unsigned char art[37];
	for (size_t i = 0; i < sizeof art; i++)
		art[i] = (unsigned char)tu_randint(0, 256);
	ej_nvrtc_cache_key(src, arch, NULL, 0, key);
	ck_assert_int_eq(ej_kcache_put(kc, key, art, sizeof art, src), EPJ_OK);
	free(src);
}

static int count_entries(ej_kcache *kc)
{
	return ej_kcache_list(kc, NULL, NULL);
}

/* Offsets of entry i's body length field (walks the format). */
static size_t entry_off(const bytes *b, int i)
{
	size_t off = 16; /* magic + count */
	for (int h = 0; h < 3; h++)
		off += 8 + (size_t)get64(b->p + off);
	for (int k = 0; k < i; k++)
		off += 8 + (size_t)get64(b->p + off) + 16;
	return off;
}

/* Recomputes entry i's checksum and the file checksum after an edit. */
static void reseal(bytes *b, int i)
{
	size_t off = entry_off(b, i);
	size_t len = (size_t)get64(b->p + off);
	epj_hash128 h = epj_hash(b->p + off + 8, len);
	put64(b->p + off + 8 + len, h.lo);
	put64(b->p + off + 8 + len + 8, h.hi);
	h = epj_hash(b->p, b->n - 24);
	put64(b->p + b->n - 16, h.lo);
	put64(b->p + b->n - 8, h.hi);
}

/* Offset of str field f (0 kind, 1 identity, 2 arch, 3 generator,
 * 4 artifact, 5 source) of entry i: its length field. */
static size_t field_off(const bytes *b, int i, int f)
{
	size_t off = entry_off(b, i) + 8 + 64;
	for (int k = 0; k < f; k++)
		off += 8 + (size_t)get64(b->p + off);
	return off;
}

typedef struct fixture {
	epj_ctx *ctx;
	char *src_dir, *dst_dir, *tmp;
	ej_kcache *src, *dst;
	char ar[4200], bad[4200];
} fixture;

static void fx_open(fixture *f)
{
	memset(f, 0, sizeof *f);
	f->ctx = tu_ctx();
	f->src_dir = tu_tmpdir_new("ar-src");
	f->dst_dir = tu_tmpdir_new("ar-dst");
	f->tmp = tu_tmpdir_new("ar-file");
	f->src = ej_kcache_open(f->ctx, f->src_dir);
	f->dst = ej_kcache_open(f->ctx, f->dst_dir);
	ck_assert_ptr_nonnull(f->src);
	ck_assert_ptr_nonnull(f->dst);
	snprintf(f->ar, sizeof f->ar, "%s/cache.epjka", f->tmp);
	snprintf(f->bad, sizeof f->bad, "%s/bad.epjka", f->tmp);
}

static void fx_close(fixture *f)
{
	ej_kcache_close(f->src);
	ej_kcache_close(f->dst);
	tu_tmpdir_free(f->src_dir);
	tu_tmpdir_free(f->dst_dir);
	tu_tmpdir_free(f->tmp);
	epj_ctx_free(f->ctx);
}

/* Import of f->bad must fail with status want and a message containing
 * word, and leave the destination empty. */
static void expect_refused(fixture *f, epj_status want, const char *word)
{
	int added = -1, present = -1;
	epj_status st =
	    ej_kcache_archive_import(f->ctx, f->dst, f->bad, &added, &present);
	ck_assert_msg(st == want, "import: status %d, want %d: %s", st, want,
		      epj_ctx_error(f->ctx));
	ck_assert_msg(strstr(epj_ctx_error(f->ctx), word),
		      "message lacks '%s': %s", word, epj_ctx_error(f->ctx));
	ck_assert_int_eq(added, 0);
	ck_assert_int_eq(count_entries(f->dst), 0);
	epj_ctx_clear_error(f->ctx);
}

/* ---- tests ---- */

START_TEST(test_roundtrip)
{
	fixture f;
	fx_open(&f);
	setenv("EPJIT_CUDA_ARCH", "sm_80,sm_90", 1);
	int n = (int)tu_randint(2, 7);
	char keys[8][65];
	for (int i = 0; i < n; i++)
		put_c(f.src, keys[i]);
	put_nvrtc(f.src, "sm_90", keys[n]);
	/* an entry no compiler here made (its key is not its source's) is
	 * not exported */
	char alien[65];
	memset(alien, 'a', 64);
	alien[64] = '\0';
	ck_assert_int_eq(ej_kcache_put(f.src, alien, "x", 1, "y"), EPJ_OK);
	int written = 0;
	ck_assert_int_eq(
	    ej_kcache_archive_export(f.ctx, f.src, f.ar, NULL, -1, &written),
	    EPJ_OK);
	ck_assert_int_eq(written, n + 1);
	int added = 0, present = 0;
	ck_assert_int_eq(
	    ej_kcache_archive_import(f.ctx, f.dst, f.ar, &added, &present),
	    EPJ_OK);
	ck_assert_int_eq(added, n + 1);
	ck_assert_int_eq(present, 0);
	ck_assert_int_eq(count_entries(f.dst), n + 1);
	for (int i = 0; i <= n; i++) {
		void *a = NULL, *b = NULL;
		size_t la = 0, lb = 0;
		char *sa = NULL, *sb = NULL;
		ck_assert_int_eq(
		    ej_kcache_get_with_source(f.src, keys[i], &a, &la, &sa),
		    EPJ_OK);
		ck_assert_int_eq(
		    ej_kcache_get_with_source(f.dst, keys[i], &b, &lb, &sb),
		    EPJ_OK);
		ck_assert_ptr_nonnull(b);
		ck_assert_uint_eq(la, lb);
		ck_assert(memcmp(a, b, la) == 0);
		ck_assert_str_eq(sa, sb);
		free(a);
		free(b);
		free(sa);
		free(sb);
	}
	/* again: everything already present */
	ck_assert_int_eq(
	    ej_kcache_archive_import(f.ctx, f.dst, f.ar, &added, &present),
	    EPJ_OK);
	ck_assert_int_eq(added, 0);
	ck_assert_int_eq(present, n + 1);
	/* a listed subset; a listed key missing from the cache is an error */
	const char *some[2] = { keys[0], keys[n] };
	ck_assert_int_eq(
	    ej_kcache_archive_export(f.ctx, f.src, f.bad, some, 2, &written),
	    EPJ_OK);
	ck_assert_int_eq(written, 2);
	char missing[65];
	memset(missing, 'b', 64);
	missing[64] = '\0';
	const char *gone[1] = { missing };
	ck_assert_int_eq(
	    ej_kcache_archive_export(f.ctx, f.src, f.bad, gone, 1, &written),
	    EPJ_ERR_STATE);
	ck_assert(strstr(epj_ctx_error(f.ctx), missing) != NULL);
	unsetenv("EPJIT_CUDA_ARCH");
	fx_close(&f);
}
END_TEST

START_TEST(test_corrupt_and_truncated)
{
	fixture f;
	fx_open(&f);
	int n = (int)tu_randint(2, 5);
	char key[65];
	for (int i = 0; i < n; i++)
		put_c(f.src, key);
	int written = 0;
	ck_assert_int_eq(
	    ej_kcache_archive_export(f.ctx, f.src, f.ar, NULL, -1, &written),
	    EPJ_OK);
	bytes b = slurp(f.ar);
	/* a flipped byte anywhere */
	for (int t = 0; t < 8; t++) {
		size_t at = (size_t)tu_randint(0, (int64_t)b.n);
		unsigned char keep = b.p[at];
		b.p[at] ^= (unsigned char)tu_randint(1, 256);
		spit(f.bad, b.p, b.n);
		expect_refused(&f, EPJ_ERR_FORMAT, "");
		b.p[at] = keep;
	}
	/* truncated at a random length, also inside the last entry */
	for (int t = 0; t < 8; t++) {
		size_t len = (size_t)tu_randint(0, (int64_t)b.n);
		spit(f.bad, b.p, len);
		expect_refused(&f, EPJ_ERR_FORMAT, "");
	}
	/* a good archive with trailing garbage after the end marker */
	unsigned char *longer = malloc(b.n + 5);
	memcpy(longer, b.p, b.n);
	memcpy(longer + b.n, "junk!", 5);
	spit(f.bad, longer, b.n + 5);
	expect_refused(&f, EPJ_ERR_FORMAT, "");
	free(longer);
	free(b.p);
	fx_close(&f);
}
END_TEST

START_TEST(test_tampered_entry)
{
	fixture f;
	fx_open(&f);
	int n = (int)tu_randint(2, 5);
	char key[65];
	for (int i = 0; i < n; i++)
		put_c(f.src, key);
	int written = 0;
	ck_assert_int_eq(
	    ej_kcache_archive_export(f.ctx, f.src, f.ar, NULL, -1, &written),
	    EPJ_OK);
	int victim = (int)tu_randint(0, n);
	/* the source of one entry changed, every checksum recomputed: only
	 * the key recomputed from the source can tell */
	bytes b = slurp(f.ar);
	size_t so = field_off(&b, victim, 5);
	size_t sl = (size_t)get64(b.p + so);
	size_t at = so + 8 + (size_t)tu_randint(0, (int64_t)sl);
	b.p[at] = b.p[at] == 'Z' ? 'Y' : 'Z';
	reseal(&b, victim);
	spit(f.bad, b.p, b.n);
	expect_refused(&f, EPJ_ERR_FORMAT, "does not match its source");
	free(b.p);
	/* the entry checksum alone left stale: refused as tampered */
	b = slurp(f.ar);
	size_t ao = field_off(&b, victim, 4);
	b.p[ao + 8] ^= 0x5a;
	epj_hash128 h = epj_hash(b.p, b.n - 24); /* file sum fixed only */
	put64(b.p + b.n - 16, h.lo);
	put64(b.p + b.n - 8, h.hi);
	spit(f.bad, b.p, b.n);
	expect_refused(&f, EPJ_ERR_FORMAT, "checksum");
	free(b.p);
	fx_close(&f);
}
END_TEST

/* Replaces str field fld of entry i by `text` and reseals. */
static void relabel(bytes *b, int i, int fld, const char *text)
{
	size_t fo = field_off(b, i, fld);
	size_t old = (size_t)get64(b->p + fo), nl = strlen(text);
	size_t n = b->n - old + nl;
	unsigned char *p = malloc(n);
	memcpy(p, b->p, fo);
	put64(p + fo, nl);
	memcpy(p + fo + 8, text, nl);
	memcpy(p + fo + 8 + nl, b->p + fo + 8 + old, b->n - fo - 8 - old);
	size_t eo = entry_off(b, i);
	put64(p + eo, get64(b->p + eo) - old + nl);
	free(b->p);
	b->p = p;
	b->n = n;
	reseal(b, i);
}

START_TEST(test_wrong_identity)
{
	fixture f;
	fx_open(&f);
	setenv("EPJIT_CUDA_ARCH", "sm_80,sm_90", 1);
	char key[65];
	put_c(f.src, key);
	put_nvrtc(f.src, "sm_80", key);
	int written = 0;
	ck_assert_int_eq(
	    ej_kcache_archive_export(f.ctx, f.src, f.ar, NULL, -1, &written),
	    EPJ_OK);
	ck_assert_int_eq(written, 2);
	bytes b = slurp(f.ar);
	/* which entry is the C one (keys are sorted, kinds are not) */
	size_t ko = field_off(&b, 0, 0);
	int c_entry = get64(b.p + ko) == 1 ? 0 : 1;
	int nv_entry = 1 - c_entry;
	/* another NVRTC version */
	bytes t = { malloc(b.n), b.n };
	memcpy(t.p, b.p, b.n);
	relabel(&t, nv_entry, 1, "nvrtc 11.8");
	spit(f.bad, t.p, t.n);
	expect_refused(&f, EPJ_ERR_UNSUPPORTED, "nvrtc 11.8");
	free(t.p);
	/* another generator build */
	t = (bytes){ malloc(b.n), b.n };
	memcpy(t.p, b.p, b.n);
	relabel(&t, c_entry, 3, "epjit 0.0, epjit-codegen 0, preludes x");
	spit(f.bad, t.p, t.n);
	expect_refused(&f, EPJ_ERR_UNSUPPORTED, "generated by");
	free(t.p);
	/* an arch this machine does not target */
	spit(f.bad, b.p, b.n);
	setenv("EPJIT_CUDA_ARCH", "sm_90", 1);
	expect_refused(&f, EPJ_ERR_UNSUPPORTED, "sm_80");
	setenv("EPJIT_CUDA_ARCH", "sm_80,sm_90", 1);
	/* another host compiler on the importing side */
	setenv("EPJIT_CC", "cc -w", 1);
	expect_refused(&f, EPJ_ERR_UNSUPPORTED, "host compiler");
	unsetenv("EPJIT_CC");
	/* unchanged, it imports */
	int added = 0, present = 0;
	ck_assert_int_eq(
	    ej_kcache_archive_import(f.ctx, f.dst, f.bad, &added, &present),
	    EPJ_OK);
	ck_assert_int_eq(added, 2);
	/* not an archive at all */
	spit(f.bad, (const unsigned char *)"hello", 5);
	ej_kcache_close(f.dst);
	tu_tmpdir_free(f.dst_dir);
	f.dst_dir = tu_tmpdir_new("ar-dst");
	f.dst = ej_kcache_open(f.ctx, f.dst_dir);
	expect_refused(&f, EPJ_ERR_FORMAT, "not an epjit");
	free(b.p);
	unsetenv("EPJIT_CUDA_ARCH");
	fx_close(&f);
}
END_TEST

/* An export of one kind holds only those entries: an archive of cubins
 * imports where the host compiler is another (what the GPU bundle relies
 * on), while the whole cache's archive is refused there. */
START_TEST(test_export_one_kind)
{
	fixture f;
	fx_open(&f);
	setenv("EPJIT_CUDA_ARCH", "sm_80,sm_90", 1);
	int nc = (int)tu_randint(1, 4), nn = (int)tu_randint(1, 4);
	char keys[8][65];
	for (int i = 0; i < nc; i++)
		put_c(f.src, keys[i]);
	for (int i = 0; i < nn; i++)
		put_nvrtc(f.src, i % 2 ? "sm_80" : "sm_90", keys[nc + i]);
	int written = 0;
	ck_assert_int_eq(ej_kcache_archive_export_kind(f.ctx, f.src, f.ar, NULL,
						       -1, "nvrtc", &written),
			 EPJ_OK);
	ck_assert_int_eq(written, nn);
	ck_assert_int_eq(
	    ej_kcache_archive_export(f.ctx, f.src, f.bad, NULL, -1, &written),
	    EPJ_OK);
	ck_assert_int_eq(written, nc + nn);
	/* another host compiler: the whole cache is refused, the cubins
	 * import */
	setenv("EPJIT_CC", "cc -w", 1);
	expect_refused(&f, EPJ_ERR_UNSUPPORTED, "host compiler");
	int added = 0, present = 0;
	ck_assert_msg(ej_kcache_archive_import(f.ctx, f.dst, f.ar, &added,
					       &present) == EPJ_OK,
		      "%s", epj_ctx_error(f.ctx));
	unsetenv("EPJIT_CC");
	ck_assert_int_eq(added, nn);
	ck_assert_int_eq(count_entries(f.dst), nn);
	for (int i = 0; i < nn; i++) {
		void *a = NULL;
		size_t la = 0;
		char *sa = NULL;
		ck_assert_int_eq(ej_kcache_get_with_source(f.dst, keys[nc + i],
							   &a, &la, &sa),
				 EPJ_OK);
		ck_assert_ptr_nonnull(a);
		free(a);
		free(sa);
	}
	/* and the shared objects of the C kind alone */
	ck_assert_int_eq(ej_kcache_archive_export_kind(f.ctx, f.src, f.bad,
						       NULL, -1, "c", &written),
			 EPJ_OK);
	ck_assert_int_eq(written, nc);
	unsetenv("EPJIT_CUDA_ARCH");
	fx_close(&f);
}
END_TEST

/* An export into a shared directory where another user planted the
 * temporary names the old code used ("<archive>.tmp.<pid>", and
 * "<archive>.tmp.<pid>.<host>"): a symlink to a file of ours and a file of
 * theirs.  The archive must be a new file of ours (neither the planted
 * file's inode nor written through the link), the planted names untouched,
 * and no temporary file left. */
START_TEST(test_export_planted_tmp)
{
	fixture f;
	fx_open(&f);
	char key[65];
	put_c(f.src, key);
	char *victim = tu_path(f.tmp, "victim");
	tu_write_text(victim, "precious\n");
	char link_name[4300], file_name[4300];
	snprintf(link_name, sizeof link_name, "%s.tmp.%d", f.ar, (int)getpid());
	snprintf(file_name, sizeof file_name, "%s.tmp.%ld.%s", f.ar,
		 (long)getpid(), ej_host_tag());
	ck_assert_int_eq(symlink(victim, link_name), 0);
	tu_write_text(file_name, "planted\n");
	struct stat planted, ar;
	ck_assert_int_eq(lstat(file_name, &planted), 0);
	int written = 0;
	ck_assert_msg(ej_kcache_archive_export(f.ctx, f.src, f.ar, NULL, -1,
					       &written) == EPJ_OK,
		      "%s", epj_ctx_error(f.ctx));
	ck_assert_int_eq(written, 1);
	ck_assert_int_eq(lstat(f.ar, &ar), 0);
	ck_assert(S_ISREG(ar.st_mode));
	ck_assert_msg(ar.st_ino != planted.st_ino,
		      "the archive is the file another user planted");
	char *v = tu_slurp(victim, NULL);
	ck_assert_str_eq(v, "precious\n");
	free(v);
	char *pl = tu_slurp(file_name, NULL);
	ck_assert_str_eq(pl, "planted\n");
	free(pl);
	ck_assert_int_eq(lstat(link_name, &planted), 0);
	ck_assert(S_ISLNK(planted.st_mode));
	/* it imports: the archive is whole */
	int added = 0, present = 0;
	ck_assert_int_eq(
	    ej_kcache_archive_import(f.ctx, f.dst, f.ar, &added, &present),
	    EPJ_OK);
	ck_assert_int_eq(added, 1);
	/* nothing else in the directory: archive, victim, the two planted */
	ck_assert_int_eq(tu_dir_count(f.tmp), 4);
	unlink(link_name);
	unlink(file_name);
	free(victim);
	fx_close(&f);
}
END_TEST

Suite *make_archive_suite(void)
{
	Suite *s = suite_create("archive");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_roundtrip);
	tcase_add_test(tc, test_corrupt_and_truncated);
	tcase_add_test(tc, test_tampered_entry);
	tcase_add_test(tc, test_wrong_identity);
	tcase_add_test(tc, test_export_one_kind);
	tcase_add_test(tc, test_export_planted_tmp);
	tcase_set_timeout(tc, 60);
	suite_add_tcase(s, tc);
	return s;
}
