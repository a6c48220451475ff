/* kcache_archive.c -- kernel-cache archives (kcache_archive.h), built on the
 * public functions of kcache.h only.
 *
 * File format, all integers u64 little-endian, a "str" being a u64 length
 * followed by that many bytes (no NUL):
 *
 *   magic      8  "EPJKAR\0\1" (the last byte is the format version)
 *   count      8  number of entries
 *   str           generator build id of the exporter (ej_kcache_generator_id)
 *   str           host compiler identity of the exporter (ej_hostcc_identity)
 *   str           NVRTC identity of the exporter (ej_nvrtc_identity)
 *   count times:
 *     len      8  length L of the entry body
 *     body     L  key (64 hex digits), str kind ("c" or "nvrtc"),
 *                 str compiler identity, str arch ("" for c), str generator
 *                 build id, str artifact, str source
 *     sum     16  XXH3-128 of the body (epj_hash), low 64 bits first
 *   end        8  "EPJKAEND"
 *   sum       16  XXH3-128 of every byte before "EPJKAEND"
 *
 * Import reads the whole file, checks everything (file checksum, each
 * entry's checksum, identities, arch, key recomputed from the source), and
 * only then stores the entries: a partial or corrupt archive adds nothing.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "kcache_archive.h"

#include "cc.h"
#include "jit_impl.h"
#include "kir.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifndef PACKAGE_VERSION
#define PACKAGE_VERSION "0"
#endif

#define AR_MAGIC "EPJKAR\0\1"
#define AR_END	 "EPJKAEND"

const char *ej_kcache_generator_id(void)
{
	/* the generator's build id (jit/keys.c): a hash of its own sources,
	 * made at build time, so another build of the code generator can
	 * never pass for this one */
	static char id[128];
	if (!id[0])
		snprintf(id, sizeof id, "epjit %s, build %s", PACKAGE_VERSION,
			 ej_build_id());
	return id;
}

/* ---- a growable byte buffer ---- */

typedef struct buf {
	unsigned char *p;
	size_t len, cap;
	bool oom;
} buf;

static void b_put(buf *b, const void *d, size_t n)
{
	if (b->oom)
		return;
	if (b->len + n > b->cap) {
		size_t nc = b->cap ? b->cap : 4096;
		while (nc < b->len + n)
			nc *= 2;
		unsigned char *np = realloc(b->p, nc);
		if (!np) {
			b->oom = true;
			return;
		}
		b->p = np;
		b->cap = nc;
	}
	if (n)
		memcpy(b->p + b->len, d, n);
	b->len += n;
}

static void b_u64(buf *b, uint64_t v)
{
	unsigned char x[8];
	for (int i = 0; i < 8; i++)
		x[i] = (unsigned char)(v >> (8 * i));
	b_put(b, x, 8);
}

static void b_str(buf *b, const void *s, size_t n)
{
	b_u64(b, n);
	b_put(b, s, n);
}

static void b_sum(buf *b, const void *d, size_t n)
{
	epj_hash128 h = epj_hash(d, n);
	b_u64(b, h.lo);
	b_u64(b, h.hi);
}

/* ---- what an entry is: recomputing its key here ---- */

/* Archs tried for an NVRTC entry whose arch is not recorded in the cache
 * (entries store key, artifact and source only). */
static const char *const known_archs[] = {
	"sm_50",   "sm_52",  "sm_53",	"sm_60",   "sm_61",  "sm_62",
	"sm_70",   "sm_72",  "sm_75",	"sm_80",   "sm_86",  "sm_87",
	"sm_88",   "sm_89",  "sm_90",	"sm_90a",  "sm_100", "sm_100a",
	"sm_100f", "sm_101", "sm_103",	"sm_103a", "sm_110", "sm_120",
	"sm_120a", "sm_121", "sm_121a",
};

/* kind and arch of the entry (key, source), when its key is the one this
 * machine's compilers give; false otherwise. */
static bool classify(const char *key, const char *src, const char **kind,
		     const char **arch)
{
	char k[EJ_KCACHE_KEY_LEN + 1];
	ej_backend_c_key(src, k);
	if (!strcmp(k, key)) {
		*kind = "c";
		*arch = "";
		return true;
	}
	for (size_t i = 0; i < EJ_ARRAY_LEN(known_archs); i++) {
		ej_nvrtc_cache_key(src, known_archs[i], NULL, 0, k);
		if (!strcmp(k, key)) {
			*kind = "nvrtc";
			*arch = known_archs[i];
			return true;
		}
	}
	return false;
}

/* ---- export ---- */

typedef struct keylist {
	char **v;
	int n, cap;
	bool oom;
} keylist;

static void collect(void *user, const char *key, int64_t bytes)
{
	(void)bytes;
	keylist *l = user;
	if (l->oom)
		return;
	if (l->n == l->cap) {
		int nc = l->cap ? 2 * l->cap : 64;
		char **nv = realloc(l->v, sizeof *nv * (size_t)nc);
		if (!nv) {
			l->oom = true;
			return;
		}
		l->v = nv;
		l->cap = nc;
	}
	l->v[l->n] = strdup(key);
	if (!l->v[l->n])
		l->oom = true;
	else
		l->n++;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

static epj_status write_file(epj_ctx *ctx, const char *path, const buf *b)
{
	size_t n = strlen(path) + 64;
	char *tmp = malloc(n);
	if (!tmp)
		return ej_error(ctx, EPJ_ERR_NOMEM, "archive: out of memory");
	/* created exclusively under an unpredictable name: in a shared
	 * directory no one else can own, or point elsewhere, the file that
	 * becomes the archive */
	int fd = ej_tmp_create(path, tmp, n);
	FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
	epj_status st = EPJ_OK;
	if (!f) {
		st = ej_error(ctx, EPJ_ERR_IO, "archive: cannot create %s: %s",
			      tmp, strerror(errno));
		if (fd >= 0) {
			close(fd);
			unlink(tmp);
		}
	} else {
		bool ok = fwrite(b->p, 1, b->len, f) == b->len;
		ok &= fflush(f) == 0 && fsync(fileno(f)) == 0;
		ok &= fclose(f) == 0;
		if (!ok || rename(tmp, path) != 0) {
			st = ej_error(ctx, EPJ_ERR_IO,
				      "archive: error writing %s: %s", path,
				      strerror(errno));
			unlink(tmp);
		}
	}
	free(tmp);
	return st;
}

epj_status ej_kcache_archive_export(epj_ctx *ctx, ej_kcache *c,
				    const char *path, const char *const *keys,
				    int n_keys, int *n_written)
{
	return ej_kcache_archive_export_kind(ctx, c, path, keys, n_keys, NULL,
					     n_written);
}

epj_status ej_kcache_archive_export_kind(epj_ctx *ctx, ej_kcache *c,
					 const char *path,
					 const char *const *keys, int n_keys,
					 const char *only_kind, int *n_written)
{
	*n_written = 0;
	keylist all = { 0 };
	if (n_keys < 0) {
		ej_kcache_list(c, collect, &all);
		if (all.oom) {
			for (int i = 0; i < all.n; i++)
				free(all.v[i]);
			free(all.v);
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"archive: out of memory");
		}
		qsort(all.v, (size_t)all.n, sizeof *all.v, cmp_str);
		keys = (const char *const *)all.v;
		n_keys = all.n;
	}
	buf body = { 0 }, out = { 0 };
	epj_status st = EPJ_OK;
	int n = 0, skipped = 0;
	/* entries first (their count goes into the header) */
	buf entries = { 0 };
	for (int i = 0; st == EPJ_OK && i < n_keys; i++) {
		void *art = NULL;
		size_t len = 0;
		char *src = NULL;
		st = ej_kcache_get_with_source(c, keys[i], &art, &len, &src);
		if (st == EPJ_OK && !art)
			st = ej_error(ctx, EPJ_ERR_STATE,
				      "archive: entry %s is not in the kernel "
				      "cache %s (or was corrupt)",
				      keys[i], ej_kcache_dir(c));
		const char *kind = NULL, *arch = NULL;
		if (st == EPJ_OK &&
		    !classify(keys[i], src ? src : "", &kind, &arch)) {
			epj_log_msg(EPJ_LOG_WARN,
				    "archive: entry %s was not built by this "
				    "host compiler (%s) or this NVRTC (%s); "
				    "not exported",
				    keys[i], ej_hostcc_identity(),
				    ej_nvrtc_identity());
			skipped++;
			kind = NULL;
		}
		if (st == EPJ_OK && kind && only_kind &&
		    strcmp(kind, only_kind) != 0)
			kind = NULL; /* another kind: not asked for */
		if (st == EPJ_OK && kind) {
			const char *ident = !strcmp(kind, "c")
						? ej_hostcc_identity()
						: ej_nvrtc_identity();
			const char *gen = ej_kcache_generator_id();
			body.len = 0;
			b_put(&body, keys[i], EJ_KCACHE_KEY_LEN);
			b_str(&body, kind, strlen(kind));
			b_str(&body, ident, strlen(ident));
			b_str(&body, arch, strlen(arch));
			b_str(&body, gen, strlen(gen));
			b_str(&body, art, len);
			b_str(&body, src, strlen(src));
			b_u64(&entries, body.len);
			b_put(&entries, body.p, body.len);
			b_sum(&entries, body.p, body.len);
			n++;
		}
		free(art);
		free(src);
	}
	if (st == EPJ_OK) {
		const char *gen = ej_kcache_generator_id();
		b_put(&out, AR_MAGIC, 8);
		b_u64(&out, (uint64_t)n);
		b_str(&out, gen, strlen(gen));
		b_str(&out, ej_hostcc_identity(), strlen(ej_hostcc_identity()));
		b_str(&out, ej_nvrtc_identity(), strlen(ej_nvrtc_identity()));
		b_put(&out, entries.p, entries.len);
		size_t covered = out.len;
		b_put(&out, AR_END, 8);
		if (!out.oom)
			b_sum(&out, out.p, covered);
		if (out.oom || body.oom || entries.oom)
			st = ej_error(ctx, EPJ_ERR_NOMEM,
				      "archive: out of memory");
	}
	if (st == EPJ_OK)
		st = write_file(ctx, path, &out);
	if (st == EPJ_OK)
		*n_written = n;
	if (skipped)
		epj_log_msg(EPJ_LOG_WARN,
			    "archive: %d entr%s of other compilers skipped",
			    skipped, skipped == 1 ? "y" : "ies");
	free(body.p);
	free(entries.p);
	free(out.p);
	for (int i = 0; i < all.n; i++)
		free(all.v[i]);
	free(all.v);
	return st;
}

/* ---- import ---- */

typedef struct rd {
	const unsigned char *p;
	size_t len, off;
} rd;

static bool r_u64(rd *r, uint64_t *v)
{
	if (r->len - r->off < 8)
		return false;
	*v = 0;
	for (int i = 0; i < 8; i++)
		*v |= (uint64_t)r->p[r->off + (size_t)i] << (8 * i);
	r->off += 8;
	return true;
}

/* A str: pointer into the buffer and its length. */
static bool r_str(rd *r, const unsigned char **s, size_t *n)
{
	uint64_t l;
	if (!r_u64(r, &l) || l > r->len - r->off)
		return false;
	*s = r->p + r->off;
	*n = (size_t)l;
	r->off += (size_t)l;
	return true;
}

static bool r_sum_ok(rd *r, const void *d, size_t n)
{
	uint64_t lo, hi;
	if (!r_u64(r, &lo) || !r_u64(r, &hi))
		return false;
	epj_hash128 h = epj_hash(d, n);
	return h.lo == lo && h.hi == hi;
}

typedef struct ar_entry {
	char key[EJ_KCACHE_KEY_LEN + 1];
	const unsigned char *art;
	size_t art_len;
	char *src; /* malloc'ed, NUL-terminated */
} ar_entry;

static bool str_is(const unsigned char *s, size_t n, const char *want)
{
	return strlen(want) == n && memcmp(s, want, n) == 0;
}

/* Checks entry i's body; fills e.  Error naming the entry otherwise. */
static epj_status check_entry(epj_ctx *ctx, const char *path, int i,
			      const unsigned char *body, size_t len,
			      ar_entry *e)
{
	rd r = { body, len, 0 };
	const unsigned char *kind, *ident, *arch, *gen, *art, *src;
	size_t kn, in, an, gn, arn, sn;
	if (len < EJ_KCACHE_KEY_LEN)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: entry %d is truncated", path, i);
	memcpy(e->key, body, EJ_KCACHE_KEY_LEN);
	e->key[EJ_KCACHE_KEY_LEN] = '\0';
	r.off = EJ_KCACHE_KEY_LEN;
	if (!r_str(&r, &kind, &kn) || !r_str(&r, &ident, &in) ||
	    !r_str(&r, &arch, &an) || !r_str(&r, &gen, &gn) ||
	    !r_str(&r, &art, &arn) || !r_str(&r, &src, &sn) || r.off != len)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: entry %d (%.16s...) is malformed", path, i,
				e->key);
	bool is_c = str_is(kind, kn, "c");
	if (!is_c && !str_is(kind, kn, "nvrtc"))
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: entry %d (%.16s...) has an unknown kind "
				"\"%.*s\"",
				path, i, e->key, (int)kn, (const char *)kind);
	const char *mine = is_c ? ej_hostcc_identity() : ej_nvrtc_identity();
	if (!str_is(ident, in, mine))
		return ej_error(
		    ctx, EPJ_ERR_UNSUPPORTED,
		    "%s: entry %d (%.16s...) was built by %s \"%.*s\"; "
		    "this machine has \"%s\": refused (rebuild it "
		    "with epjit-warmup here)",
		    path, i, e->key, is_c ? "host compiler" : "NVRTC", (int)in,
		    (const char *)ident, mine);
	if (!str_is(gen, gn, ej_kcache_generator_id()))
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: entry %d (%.16s...) was generated by "
				"\"%.*s\", this build is \"%s\": refused",
				path, i, e->key, (int)gn, (const char *)gen,
				ej_kcache_generator_id());
	char a[EJ_CUDA_ARCH_MAX] = "";
	if (!is_c) {
		if (an == 0 || an >= sizeof a)
			return ej_error(ctx, EPJ_ERR_FORMAT,
					"%s: entry %d (%.16s...) has no valid "
					"arch",
					path, i, e->key);
		memcpy(a, arch, an);
		a[an] = '\0';
		char archs[16][EJ_CUDA_ARCH_MAX];
		int na = ej_cuda_archs(ctx, archs, 16);
		if (na < 0)
			return ctx->status;
		bool ok = false;
		for (int k = 0; k < na; k++)
			ok |= !strcmp(archs[k], a);
		if (!ok)
			return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
					"%s: entry %d (%.16s...) is for %s, "
					"not a target of this machine "
					"(EPJIT_CUDA_ARCH=%s): refused",
					path, i, e->key, a,
					getenv("EPJIT_CUDA_ARCH")
					    ? getenv("EPJIT_CUDA_ARCH")
					    : EJ_CUDA_ARCH_DEFAULT);
	} else if (an != 0) {
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: entry %d (%.16s...) is a C entry with an "
				"arch",
				path, i, e->key);
	}
	if (arn == 0)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: entry %d (%.16s...) has an empty artifact",
				path, i, e->key);
	e->src = malloc(sn + 1);
	if (!e->src)
		return ej_error(ctx, EPJ_ERR_NOMEM, "archive: out of memory");
	memcpy(e->src, src, sn);
	e->src[sn] = '\0';
	if (memchr(src, '\0', sn))
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: entry %d (%.16s...): the source contains "
				"a NUL byte",
				path, i, e->key);
	char k[EJ_KCACHE_KEY_LEN + 1];
	if (is_c)
		ej_backend_c_key(e->src, k);
	else
		ej_nvrtc_cache_key(e->src, a, NULL, 0, k);
	if (strcmp(k, e->key) != 0)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: entry %d: key %s does not match its "
				"source (which gives %s): refused",
				path, i, e->key, k);
	e->art = art;
	e->art_len = arn;
	return EPJ_OK;
}

static epj_status read_whole(epj_ctx *ctx, const char *path,
			     unsigned char **data, size_t *len)
{
	*data = NULL;
	*len = 0;
	/* a regular file only: a FIFO would block, /dev/zero never end */
	const char *why = NULL;
	FILE *f = ej_fopen_regular(path, &why);
	if (!f)
		return ej_error(ctx, EPJ_ERR_IO, "archive: cannot open %s: %s",
				path, why);
	buf b = { 0 };
	unsigned char chunk[65536];
	size_t n;
	while ((n = fread(chunk, 1, sizeof chunk, f)) > 0)
		b_put(&b, chunk, n);
	bool err = ferror(f);
	fclose(f);
	if (err || b.oom) {
		free(b.p);
		return ej_error(ctx, err ? EPJ_ERR_IO : EPJ_ERR_NOMEM,
				"archive: cannot read %s", path);
	}
	*data = b.p;
	*len = b.len;
	return EPJ_OK;
}

epj_status ej_kcache_archive_import(epj_ctx *ctx, ej_kcache *c,
				    const char *path, int *n_added,
				    int *n_present)
{
	*n_added = *n_present = 0;
	unsigned char *data = NULL;
	size_t len = 0;
	epj_status st = read_whole(ctx, path, &data, &len);
	if (st != EPJ_OK)
		return st;
	rd r = { data, len, 0 };
	uint64_t count = 0;
	const unsigned char *s;
	size_t sn;
	ar_entry *ents = NULL;
	int n_ok = 0;
	if (len < 8 + 8 || memcmp(data, AR_MAGIC, 8) != 0) {
		st = ej_error(ctx, EPJ_ERR_FORMAT,
			      "%s: not an epjit kernel-cache archive (bad "
			      "magic)",
			      path);
		goto out;
	}
	/* the file checksum first: truncation or any flipped byte */
	if (len < 8 + 16 || memcmp(data + len - 24, AR_END, 8) != 0) {
		st = ej_error(ctx, EPJ_ERR_FORMAT,
			      "%s: truncated archive (no end marker); nothing "
			      "imported",
			      path);
		goto out;
	}
	{
		rd t = { data, len, len - 16 };
		if (!r_sum_ok(&t, data, len - 24)) {
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      "%s: archive checksum mismatch (corrupt "
				      "or truncated); nothing imported",
				      path);
			goto out;
		}
	}
	r.len = len - 24; /* the entries end before the end marker */
	r.off = 8;
	if (!r_u64(&r, &count) || count > len) {
		st = ej_error(ctx, EPJ_ERR_FORMAT, "%s: bad entry count", path);
		goto out;
	}
	for (int h = 0; h < 3; h++)
		if (!r_str(&r, &s, &sn)) {
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      "%s: truncated header", path);
			goto out;
		}
	ents = calloc((size_t)count + 1, sizeof *ents);
	if (!ents) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "archive: out of memory");
		goto out;
	}
	for (uint64_t i = 0; i < count; i++) {
		uint64_t bl;
		if (!r_u64(&r, &bl) || bl > r.len - r.off) {
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      "%s: entry %d is truncated; nothing "
				      "imported",
				      path, (int)i);
			goto out;
		}
		const unsigned char *body = data + r.off;
		r.off += (size_t)bl;
		if (!r_sum_ok(&r, body, (size_t)bl)) {
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      "%s: entry %d: checksum mismatch "
				      "(tampered or corrupt); nothing "
				      "imported",
				      path, (int)i);
			goto out;
		}
		st = check_entry(ctx, path, (int)i, body, (size_t)bl, &ents[i]);
		n_ok++;
		if (st != EPJ_OK) {
			ej_error_prefix(ctx, "nothing imported");
			goto out;
		}
	}
	if (r.off != r.len) {
		st = ej_error(ctx, EPJ_ERR_FORMAT,
			      "%s: %zu bytes after the last entry; nothing "
			      "imported",
			      path, r.len - r.off);
		goto out;
	}
	/* everything verified: store */
	for (uint64_t i = 0; st == EPJ_OK && i < count; i++) {
		void *d = NULL;
		size_t dl = 0;
		st = ej_kcache_get(c, ents[i].key, &d, &dl);
		if (st == EPJ_OK && d) {
			(*n_present)++;
		} else if (st == EPJ_OK) {
			st = ej_kcache_put(c, ents[i].key, ents[i].art,
					   ents[i].art_len, ents[i].src);
			if (st == EPJ_OK)
				(*n_added)++;
		}
		free(d);
	}
out:
	for (int i = 0; ents && i < n_ok; i++)
		free(ents[i].src);
	free(ents);
	free(data);
	return st;
}
