/* kcache.c -- the kernel cache (kcache.h): a memory table in front of a
 * directory of verified entry files, safe for many concurrent processes.
 *
 * Disk layout: DIR/v1/<first two hex digits of the key>/<key>.bin.  An entry
 * file is, all integers little-endian:
 *
 *   offset  size  field
 *        0     8  magic "EPJKC\0\0\2" (the last byte is the format version)
 *        8    64  the key (ASCII hex)
 *       72     8  artifact length A (>= 1)
 *       80     8  source length S
 *       88    16  checksum: XXH3-128 (seed 0) of the 88 header bytes before
 *                 it (magic, key, both lengths) + artifact + source, low 64
 *                 bits first
 *      104     A  artifact bytes
 *    104+A     S  source bytes (no terminating NUL)
 *
 * and its size is exactly 104 + A + S.  Anything else is corrupt: counted,
 * removed (only if the path still names the inode that was read, so a fresh
 * entry renamed in meanwhile survives) and reported as a miss.  An entry
 * that verifies but that its caller cannot load is removed the same way by
 * ej_kcache_drop_unloadable (only while the file still holds the artifact
 * that failed), and the caller rebuilds it.
 *
 * Version 1 entries (checksum over key + artifact + source only, which let
 * the split between artifact and source move unnoticed) read as corrupt.
 *
 * Concurrency.  A writer fills DIR/v1/xx/<key>.tmp.<pid>.<n>.<host>, fsyncs
 * it and
 * renames it over <key>.bin: readers see the old file, the new one or none,
 * never a partial one; when several processes write the same key the last
 * rename wins and all are identical.  Eviction unlinks whole files; a reader
 * holding one open still reads it completely.  The directory itself is not
 * fsynced after the rename: after a crash an entry may be missing (a miss),
 * never half there.
 *
 * <host> is the first 8 hex digits of a hash of the host name: a temporary
 * file of this host whose pid is no longer alive is removed when a cache is
 * opened (any temporary older than STALE_TMP_SECONDS at eviction).
 * Processes that miss the same key take DIR/v1/xx/<key>.lock with flock
 * (ej_kcache_lock): one compiles, the others wait and then read its entry;
 * the kernel drops the lock of a process that dies.  Lock files stay.
 *
 * Security.  The directory as given must not be a symbolic link (also not
 * as "link/." or "link/"); it is resolved with realpath once and used by
 * that path from then on.  Every directory above the resolved one must be
 * owned by root or the user and not writable by group or others unless it
 * has the sticky bit (else another user could rename the cache away and put
 * theirs in its place), and so must the directory holding any symbolic
 * link on the given path (whose owner must be root or the user).  The
 * cache directory, v1/ and every shard directory are checked with lstat
 * before anything under them is read: owned by geteuid(), not group- or
 * world-writable, not a symbolic link.  Entry files are opened with
 * O_NOFOLLOW | O_NONBLOCK (a FIFO does not block) and must be regular files
 * owned by the user and not writable by group or others; others are
 * removed as corrupt.
 *
 * Degrading.  A directory that cannot be created, or an entry that cannot be
 * written (read-only file system, full disk, a directory in the way), makes
 * the cache keep working in memory only: warned once per process, counted
 * in cache.write_errors.  Only an insecure directory is an error.
 *
 * Memory table.  A plain array scanned linearly: a process holds a few
 * hundred kernels at most and a lookup happens once per compile, not per
 * step.  It holds copies of the artifacts and sources; its bytes are bounded
 * by the same cap as the disk (least recently used first).
 */
#include "kcache.h"

#include "cc.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
/* For XXH3_state_t on the stack (the header comes with the library). */
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#define HDR_SIZE	  104
#define MAGIC		  "EPJKC\0\0\2"
#define MAGIC_LEN	  8
#define DEFAULT_CAP_MB	  1024
#define STALE_TMP_SECONDS 3600 /* a temporary file this old is a crash's */

typedef struct mem_entry {
	char key[EJ_KCACHE_KEY_LEN + 1];
	unsigned char *data; /* artifact, len bytes (malloc'ed, maybe NULL) */
	size_t len;
	char *source; /* NUL-terminated (malloc'ed) */
	uint64_t tick;
} mem_entry;

struct ej_kcache {
	epj_ctx *ctx; /* borrowed */
	char *dir;    /* root as given or resolved */
	char *vdir;   /* dir/v1 */
	int64_t cap;  /* bytes */
	mem_entry *mem;
	int n_mem, cap_mem;
	int64_t mem_bytes; /* sum of len + strlen(source) over mem */
	uint64_t tick;
	bool no_disk;  /* degraded: memory table only */
	char *refused; /* why the directory asked for was refused */
};

/* Degradation is warned about once per process. */
static atomic_flag warned_write = ATOMIC_FLAG_INIT;
/* So is the first entry that does not load (ej_kcache_drop_unloadable). */
static atomic_flag warned_unloadable = ATOMIC_FLAG_INIT;
/* And the first refused directory (ej_kcache_open_for_run). */
static atomic_flag warned_refused = ATOMIC_FLAG_INIT;

/* Per-process counter for temporary file names (several caches or threads of
 * one process may write the same key at once). */
static atomic_uint_fast64_t tmp_seq;

/* ---- small helpers --------------------------------------------------------
 */

static char *str_printf(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
static char *str_printf(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(NULL, 0, fmt, ap);
	va_end(ap);
	if (n < 0)
		return NULL;
	char *s = malloc((size_t)n + 1);
	if (!s)
		return NULL;
	va_start(ap, fmt);
	vsnprintf(s, (size_t)n + 1, fmt, ap);
	va_end(ap);
	return s;
}

static bool key_valid(const char *key)
{
	if (!key)
		return false;
	for (int i = 0; i < EJ_KCACHE_KEY_LEN; i++)
		if (!((key[i] >= '0' && key[i] <= '9') ||
		      (key[i] >= 'a' && key[i] <= 'f')))
			return false;
	return key[EJ_KCACHE_KEY_LEN] == '\0';
}

static void put_u64(unsigned char *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_u64(const unsigned char *p)
{
	uint64_t v = 0;
	for (int i = 0; i < 8; i++)
		v |= (uint64_t)p[i] << (8 * i);
	return v;
}

/* XXH3-128 of the header before the checksum (hdr, 88 bytes: magic, key,
 * lengths) + artifact + source, 16 bytes low word first. */
static void entry_checksum(const unsigned char *hdr, const void *data,
			   size_t len, const char *src, size_t slen,
			   unsigned char out[16])
{
	XXH3_state_t st;
	XXH3_INITSTATE(&st);
	XXH3_128bits_reset(&st);
	XXH3_128bits_update(&st, hdr, 88);
	if (len)
		XXH3_128bits_update(&st, data, len);
	if (slen)
		XXH3_128bits_update(&st, src, slen);
	XXH128_hash_t h = XXH3_128bits_digest(&st);
	put_u64(out, h.low64);
	put_u64(out + 8, h.high64);
}

static epj_status write_all(int fd, const void *p, size_t n)
{
	const char *c = p;
	while (n > 0) {
		ssize_t w = write(fd, c, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return EPJ_ERR_IO;
		c += w;
		n -= (size_t)w;
	}
	return EPJ_OK;
}

/* Reads exactly n bytes; EPJ_ERR_FORMAT when the file ends first. */
static epj_status read_all(int fd, void *p, size_t n)
{
	char *c = p;
	while (n > 0) {
		ssize_t r = read(fd, c, n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return EPJ_ERR_IO;
		if (r == 0)
			return EPJ_ERR_FORMAT;
		c += r;
		n -= (size_t)r;
	}
	return EPJ_OK;
}

/* ---- directories ----------------------------------------------------------
 */

/* The security check of one directory (see the file comment). */
static epj_status check_dir(epj_ctx *ctx, const char *path)
{
	struct stat st;
	if (lstat(path, &st) != 0)
		return ej_error(ctx, EPJ_ERR_IO,
				"kernel cache: cannot inspect directory %s: %s",
				path, strerror(errno));
	if (S_ISLNK(st.st_mode))
		return ej_error(ctx, EPJ_ERR_STATE,
				"kernel cache: refusing %s: it is a symbolic "
				"link (set EPJIT_CACHE_DIR to the real "
				"directory); a cached module is code",
				path);
	if (!S_ISDIR(st.st_mode))
		return ej_error(ctx, EPJ_ERR_IO,
				"kernel cache: cannot use %s: not a directory",
				path);
	if (st.st_uid != geteuid())
		return ej_error(ctx, EPJ_ERR_STATE,
				"kernel cache: refusing directory %s: owned by "
				"uid %u, not you (uid %u); a cached module is "
				"code",
				path, (unsigned)st.st_uid, (unsigned)geteuid());
	if (st.st_mode & (S_IWGRP | S_IWOTH))
		return ej_error(
		    ctx, EPJ_ERR_STATE,
		    "kernel cache: refusing directory %s: it is "
		    "group- or world-writable (mode %04o); a cached "
		    "module is code (chmod go-w it)",
		    path, (unsigned)(st.st_mode & 07777));
	return EPJ_OK;
}

/* mkdir -p with mode 0700 for every directory it creates. */
static epj_status mkdir_p(epj_ctx *ctx, const char *path)
{
	char *p = strdup(path);
	if (!p)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"kernel cache: out of memory");
	size_t n = strlen(p);
	epj_status s = EPJ_OK;
	for (size_t i = 1; i <= n && s == EPJ_OK; i++) {
		if (p[i] != '/' && p[i] != '\0')
			continue;
		if (p[i - 1] == '/')
			continue; /* "//" */
		char saved = p[i];
		p[i] = '\0';
		if (mkdir(p, 0700) != 0 && errno != EEXIST)
			s = ej_error(ctx, EPJ_ERR_IO,
				     "kernel cache: cannot create directory "
				     "%s: %s",
				     p, strerror(errno));
		p[i] = saved;
	}
	free(p);
	return s;
}

/* Creates (0700) and checks one directory below a checked one. */
static epj_status subdir(epj_ctx *ctx, const char *path)
{
	if (mkdir(path, 0700) != 0 && errno != EEXIST)
		return ej_error(ctx, EPJ_ERR_IO,
				"kernel cache: cannot create directory %s: %s",
				path, strerror(errno));
	return check_dir(ctx, path);
}

/* The default directory (malloc'ed) or NULL with an error. */
static char *default_dir(epj_ctx *ctx)
{
	const char *e = getenv("EPJIT_CACHE_DIR");
	if (e && *e)
		return str_printf("%s", e);
	/* The XDG spec says to ignore a relative XDG_CACHE_HOME. */
	e = getenv("XDG_CACHE_HOME");
	if (e && e[0] == '/')
		return str_printf("%s/epjit", e);
	e = getenv("HOME");
	if (e && *e)
		return str_printf("%s/.cache/epjit", e);
	struct passwd pw, *res = NULL;
	char buf[4096];
	if (getpwuid_r(geteuid(), &pw, buf, sizeof buf, &res) == 0 && res &&
	    res->pw_dir && *res->pw_dir)
		return str_printf("%s/.cache/epjit", res->pw_dir);
	ej_error(ctx, EPJ_ERR_CONFIG,
		 "kernel cache: no directory: set EPJIT_CACHE_DIR (neither "
		 "XDG_CACHE_HOME nor HOME is set)");
	return NULL;
}

/* Cap in bytes from EPJIT_CACHE_MAX_MB; -1 with an error when malformed. */
static int64_t cap_from_env(epj_ctx *ctx)
{
	const char *e = getenv("EPJIT_CACHE_MAX_MB");
	if (!e || !*e)
		return (int64_t)DEFAULT_CAP_MB << 20;
	char *end;
	errno = 0;
	long long mb = strtoll(e, &end, 10);
	if (errno || *end || mb < 1 || mb > (INT64_MAX >> 20)) {
		ej_error(ctx, EPJ_ERR_CONFIG,
			 "kernel cache: EPJIT_CACHE_MAX_MB=%s: expected a "
			 "positive whole number of MiB",
			 e);
		return -1;
	}
	return (int64_t)mb << 20;
}

/* ---- trusted path ---------------------------------------------------------
 */

/* A directory above the cache (or holding a symbolic link on the way to
 * it): owned by root or the user, and not writable by group or others
 * unless sticky (then others cannot rename what is ours in it). */
static epj_status check_ancestor(epj_ctx *ctx, const char *path,
				 const char *dir)
{
	struct stat st;
	if (stat(path, &st) != 0)
		return ej_error(ctx, EPJ_ERR_IO,
				"kernel cache: cannot inspect %s: %s", path,
				strerror(errno));
	if (st.st_uid != 0 && st.st_uid != geteuid())
		return ej_error(ctx, EPJ_ERR_STATE,
				"kernel cache: refusing %s: the directory %s "
				"above it is owned by uid %u (neither root "
				"nor you), who could replace the cache; a "
				"cached module is code",
				dir, path, (unsigned)st.st_uid);
	if ((st.st_mode & (S_IWGRP | S_IWOTH)) && !(st.st_mode & S_ISVTX))
		return ej_error(ctx, EPJ_ERR_STATE,
				"kernel cache: refusing %s: the directory %s "
				"above it is group- or world-writable without "
				"the sticky bit (mode %04o), so others could "
				"replace the cache; a cached module is code",
				dir, path, (unsigned)(st.st_mode & 07777));
	return EPJ_OK;
}

/* Every proper prefix directory of the absolute, resolved path real. */
static epj_status check_ancestors(epj_ctx *ctx, const char *real,
				  const char *dir)
{
	char *p = strdup(real);
	if (!p)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"kernel cache: out of memory");
	epj_status s = check_ancestor(ctx, "/", dir);
	for (char *q = p + 1; s == EPJ_OK && (q = strchr(q, '/')); q++) {
		*q = '\0';
		s = check_ancestor(ctx, p, dir);
		*q = '/';
	}
	free(p);
	return s;
}

/* Each symbolic link on the given path (walked lexically): owned by root
 * or the user, in a directory that passes check_ancestor. */
static epj_status check_links(epj_ctx *ctx, const char *given)
{
	char *p = strdup(given);
	if (!p)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"kernel cache: out of memory");
	epj_status s = EPJ_OK;
	size_t n = strlen(p);
	for (size_t i = 1; i <= n && s == EPJ_OK; i++) {
		if (p[i] != '/' && p[i] != '\0')
			continue;
		char saved = p[i];
		p[i] = '\0';
		struct stat st;
		if (lstat(p, &st) == 0 && S_ISLNK(st.st_mode)) {
			if (st.st_uid != 0 && st.st_uid != geteuid()) {
				s = ej_error(
				    ctx, EPJ_ERR_STATE,
				    "kernel cache: refusing %s: the symbolic "
				    "link %s on its path is owned by uid %u "
				    "(neither root nor you); a cached module "
				    "is code",
				    given, p, (unsigned)st.st_uid);
			} else {
				char *slash = strrchr(p, '/');
				if (!slash) {
					/* a relative link in the cwd */
					s = check_ancestor(ctx, ".", given);
				} else {
					char keep = slash[1];
					slash[1] = '\0';
					s = check_ancestor(ctx, p, given);
					slash[1] = keep;
				}
			}
		}
		p[i] = saved;
	}
	free(p);
	return s;
}

/* Strips trailing "/" and "/." so that "link/." and "link/" are checked as
 * "link" itself (lstat on them would follow the link). */
static void strip_tail(char *d)
{
	for (size_t n = strlen(d); n > 1;) {
		if (d[n - 1] == '/')
			d[--n] = '\0';
		else if (n > 2 && d[n - 1] == '.' && d[n - 2] == '/')
			d[n -= 2] = '\0';
		else
			break;
	}
}

/* ---- stale temporaries ----------------------------------------------------
 */

/* Removes temporary files of dead processes of this host from every shard
 * (best effort: errors are ignored). */
static void sweep_dead_tmps(ej_kcache *c)
{
	DIR *d = opendir(c->vdir);
	if (!d)
		return;
	struct dirent *de;
	while ((de = readdir(d))) {
		if (strlen(de->d_name) != 2 ||
		    !isxdigit((unsigned char)de->d_name[0]))
			continue;
		char *shard = str_printf("%s/%s", c->vdir, de->d_name);
		DIR *sd = shard ? opendir(shard) : NULL;
		struct dirent *e;
		while (sd && (e = readdir(sd))) {
			const char *t = strstr(e->d_name, ".tmp.");
			if (!t || !ej_tmp_is_dead(t + 5))
				continue;
			char *p = str_printf("%s/%s", shard, e->d_name);
			struct stat st;
			if (p && lstat(p, &st) == 0 && S_ISREG(st.st_mode) &&
			    unlink(p) == 0)
				epj_counter_add(c->ctx,
						"cache.stale_tmp_removed", 1);
			free(p);
		}
		if (sd)
			closedir(sd);
		free(shard);
	}
	closedir(d);
}

/* ---- degrading ------------------------------------------------------------
 */

/* Counts a failed disk write and warns about the first of the process;
 * clears the error from ctx. */
static void write_failed(ej_kcache *c)
{
	epj_counter_add(c->ctx, "cache.write_errors", 1);
	if (!atomic_flag_test_and_set(&warned_write))
		epj_log_msg(EPJ_LOG_WARN,
			    "%s; kernels are kept in memory "
			    "only (warned once; counted in "
			    "cache.write_errors)",
			    epj_ctx_error(c->ctx));
	epj_ctx_clear_error(c->ctx);
}

/* ---- open / close ---------------------------------------------------------
 */

/* c, made memory-only with d (taken) as its directory; NULL (c and d
 * freed) when out of memory. */
static ej_kcache *memory_only(ej_kcache *c, char *d)
{
	c->no_disk = true;
	c->dir = d;
	c->vdir = str_printf("%s/v1", d);
	if (!c->vdir) {
		ej_error(c->ctx, EPJ_ERR_NOMEM, "kernel cache: out of memory");
		free(d);
		free(c);
		return NULL;
	}
	return c;
}

ej_kcache *ej_kcache_open(epj_ctx *ctx, const char *dir)
{
	EJ_ASSERT(ctx);
	int64_t cap = cap_from_env(ctx);
	if (cap < 0)
		return NULL;
	char *d = dir ? strdup(dir) : default_dir(ctx);
	if (!d) {
		if (dir)
			ej_error(ctx, EPJ_ERR_NOMEM,
				 "kernel cache: out of memory");
		return NULL;
	}
	strip_tail(d);
	ej_kcache *c = calloc(1, sizeof *c);
	char *real = NULL, *v = NULL;
	if (!c) {
		ej_error(ctx, EPJ_ERR_NOMEM, "kernel cache: out of memory");
		goto fail;
	}
	c->ctx = ctx;
	c->cap = cap;
	epj_status s = mkdir_p(ctx, d);
	if (s == EPJ_OK)
		s = check_dir(ctx, d);
	if (s == EPJ_OK) {
		real = realpath(d, NULL);
		if (!real)
			s = ej_error(ctx, EPJ_ERR_IO,
				     "kernel cache: cannot resolve %s: %s", d,
				     strerror(errno));
	}
	if (s == EPJ_OK)
		s = check_links(ctx, d);
	if (s == EPJ_OK)
		s = check_ancestors(ctx, real, d);
	if (s == EPJ_OK)
		s = check_dir(ctx, real);
	if (s == EPJ_OK) {
		v = str_printf("%s/v1", real);
		s = v ? subdir(ctx, v)
		      : ej_error(ctx, EPJ_ERR_NOMEM,
				 "kernel cache: out of memory");
	}
	if (s == EPJ_ERR_IO) {
		/* Not there and not creatable, or not a directory: an
		 * optimization lost, not a reason to stop. */
		write_failed(c);
		free(real);
		free(v);
		return memory_only(c, d);
	}
	if (s != EPJ_OK)
		goto fail;
	free(d);
	c->dir = real;
	c->vdir = v;
	sweep_dead_tmps(c);
	ej_privdir_sweep();
	return c;
fail:
	free(c);
	free(real);
	free(v);
	free(d);
	return NULL;
}

/* ---- a refused directory: the private directory of the process ----------
 *
 * A run whose cache directory is refused compiles into a directory of its
 * own instead: <TMPDIR>/epjit-kcache-<pid>.<host>-XXXXXX (ej_privdir_make:
 * mkdtemp, mode 0700, checked and locked through its descriptor), made at
 * the first refusal, shared by every cache the process opens afterwards
 * and removed at exit by the process that made it (a forked child leaves
 * its parent's alone).  A process killed before it exits leaves it locked
 * by nobody: a later cache open or compile removes it (ej_privdir_sweep).
 * Nothing from the refused directory is ever read. */

static pthread_mutex_t private_mu = PTHREAD_MUTEX_INITIALIZER;
static ej_privdir private_dir = { .fd = -1 };
static pid_t private_owner;

static void private_dir_remove(void)
{
	pthread_mutex_lock(&private_mu);
	if (private_dir.fd >= 0 && private_owner == getpid())
		ej_privdir_remove_all(&private_dir);
	pthread_mutex_unlock(&private_mu);
}

/* The path of the process's private cache directory (malloc'ed; made at
 * the first call), or NULL with ctx's error. */
static char *private_dir_path(epj_ctx *ctx)
{
	static bool at_exit;
	char *path = NULL;
	pthread_mutex_lock(&private_mu);
	epj_status st = EPJ_OK;
	if (private_dir.fd < 0) {
		st = ej_privdir_make(ctx, EJ_KCACHE_PRIVATE_PREFIX,
				     &private_dir);
		if (st == EPJ_OK)
			private_owner = getpid();
		if (st == EPJ_OK && !at_exit)
			at_exit = atexit(private_dir_remove) == 0;
	}
	if (st == EPJ_OK) {
		path = strdup(private_dir.path);
		if (!path)
			ej_error(ctx, EPJ_ERR_NOMEM,
				 "kernel cache: out of memory");
	}
	pthread_mutex_unlock(&private_mu);
	return path;
}

ej_kcache *ej_kcache_open_for_run(epj_ctx *ctx, const char *dir)
{
	ej_kcache *c = ej_kcache_open(ctx, dir);
	if (c || epj_ctx_status(ctx) != EPJ_ERR_STATE)
		return c;
	char *why = strdup(epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
	epj_counter_add(ctx, "cache.refused", 1);
	char *priv = why ? private_dir_path(ctx) : NULL;
	if (priv)
		c = ej_kcache_open(ctx, priv);
	char *instead = NULL;
	if (c) {
		instead = str_printf("compiling into %s instead, a private "
				     "directory removed at exit",
				     ej_kcache_dir(c));
	} else if (why && epj_ctx_status(ctx) != EPJ_ERR_NOMEM) {
		/* not even that: the memory table alone */
		instead = str_printf("no private directory either (%s): "
				     "kernels are kept in memory only",
				     epj_ctx_error(ctx));
		epj_ctx_clear_error(ctx);
		ej_kcache *m = calloc(1, sizeof *m);
		char *d = strdup(priv ? priv : ej_tmpdir());
		if (m && d) {
			m->ctx = ctx;
			m->cap = cap_from_env(ctx);
			c = memory_only(m, d);
		} else {
			free(m);
			free(d);
		}
	}
	free(priv);
	if (!c || !instead) {
		ej_kcache_close(c);
		free(why);
		free(instead);
		if (!epj_ctx_status(ctx))
			ej_error(ctx, EPJ_ERR_NOMEM,
				 "kernel cache: out of memory");
		return NULL;
	}
	if (!atomic_flag_test_and_set(&warned_refused))
		epj_log_msg(EPJ_LOG_WARN,
			    "%s; %s (warned once; counted in cache.refused)",
			    why, instead);
	free(instead);
	c->refused = why;
	return c;
}

const char *ej_kcache_refused(const ej_kcache *c)
{
	return c->refused;
}

static void mem_entry_clear(mem_entry *m)
{
	free(m->data);
	free(m->source);
}

void ej_kcache_close(ej_kcache *c)
{
	if (!c)
		return;
	for (int i = 0; i < c->n_mem; i++)
		mem_entry_clear(&c->mem[i]);
	free(c->mem);
	free(c->dir);
	free(c->vdir);
	free(c->refused);
	free(c);
}

const char *ej_kcache_dir(const ej_kcache *c)
{
	return c->dir;
}

void ej_kcache_set_cap_bytes(ej_kcache *c, int64_t bytes)
{
	EJ_ASSERT(bytes >= 0);
	c->cap = bytes;
}

bool ej_kcache_on_disk(const ej_kcache *c)
{
	return !c->no_disk;
}

/* ---- key ------------------------------------------------------------------
 */

void ej_kcache_key(char out[EJ_KCACHE_KEY_LEN + 1], const char *const *parts,
		   int n)
{
	EJ_ASSERT(n >= 0 && (n == 0 || parts));
	XXH3_state_t a, b;
	XXH3_INITSTATE(&a);
	XXH3_INITSTATE(&b);
	XXH3_128bits_reset(&a);
	XXH3_128bits_reset_withSeed(&b, EJ_KCACHE_KEY_SEED2);
	for (int i = 0; i < n; i++) {
		size_t len = parts[i] ? strlen(parts[i]) : 0;
		unsigned char lp[8];
		put_u64(lp, parts[i] ? (uint64_t)len : UINT64_MAX);
		XXH3_128bits_update(&a, lp, 8);
		XXH3_128bits_update(&b, lp, 8);
		if (len) {
			XXH3_128bits_update(&a, parts[i], len);
			XXH3_128bits_update(&b, parts[i], len);
		}
	}
	XXH128_hash_t ha = XXH3_128bits_digest(&a);
	XXH128_hash_t hb = XXH3_128bits_digest(&b);
	/* Same digit order as epj_hash_hex: high word first. */
	epj_hash128 h1 = { .lo = ha.low64, .hi = ha.high64 };
	epj_hash128 h2 = { .lo = hb.low64, .hi = hb.high64 };
	epj_hash_hex(h1, out);
	epj_hash_hex(h2, out + 32);
}

/* ---- memory table ---------------------------------------------------------
 */

static mem_entry *mem_find(ej_kcache *c, const char *key)
{
	for (int i = 0; i < c->n_mem; i++)
		if (memcmp(c->mem[i].key, key, EJ_KCACHE_KEY_LEN) == 0)
			return &c->mem[i];
	return NULL;
}

static int64_t mem_size(const mem_entry *m)
{
	return (int64_t)m->len + (int64_t)strlen(m->source);
}

/* Drops least recently used entries other than `keep` while over the cap. */
static void mem_trim(ej_kcache *c, const char *keep)
{
	while (c->mem_bytes > c->cap && c->n_mem > 1) {
		int lru = -1;
		for (int i = 0; i < c->n_mem; i++) {
			if (!memcmp(c->mem[i].key, keep, EJ_KCACHE_KEY_LEN))
				continue;
			if (lru < 0 || c->mem[i].tick < c->mem[lru].tick)
				lru = i;
		}
		if (lru < 0)
			return;
		c->mem_bytes -= mem_size(&c->mem[lru]);
		mem_entry_clear(&c->mem[lru]);
		c->mem[lru] = c->mem[--c->n_mem];
	}
}

/* Takes ownership of data and source (both malloc'ed; source non-NULL). */
static epj_status mem_insert(ej_kcache *c, const char *key, unsigned char *data,
			     size_t len, char *source)
{
	mem_entry *m = mem_find(c, key);
	if (m) {
		c->mem_bytes -= mem_size(m);
		mem_entry_clear(m);
	} else {
		if (c->n_mem == c->cap_mem) {
			int nc = c->cap_mem ? 2 * c->cap_mem : 16;
			mem_entry *nm =
			    realloc(c->mem, (size_t)nc * sizeof *nm);
			if (!nm) {
				free(data);
				free(source);
				return ej_error(c->ctx, EPJ_ERR_NOMEM,
						"kernel cache: out of memory");
			}
			c->mem = nm;
			c->cap_mem = nc;
		}
		m = &c->mem[c->n_mem++];
		memcpy(m->key, key, EJ_KCACHE_KEY_LEN + 1);
	}
	m->data = data;
	m->len = len;
	m->source = source;
	m->tick = ++c->tick;
	c->mem_bytes += mem_size(m);
	mem_trim(c, key);
	return EPJ_OK;
}

/* ---- disk entries ---------------------------------------------------------
 */

/* Removes a corrupt entry if path still names the inode that was read. */
static void drop_corrupt(ej_kcache *c, const char *path, const struct stat *st,
			 const char *why)
{
	struct stat now;
	if (lstat(path, &now) == 0 && now.st_dev == st->st_dev &&
	    now.st_ino == st->st_ino)
		unlink(path);
	epj_counter_add(c->ctx, "cache.corrupt", 1);
	epj_log_msg(EPJ_LOG_WARN,
		    "kernel cache: removed corrupt entry %s (%s); it will be "
		    "recompiled",
		    path, why);
}

/* Reads and verifies the entry file of key.  On success *found is true and
 * *data (malloc'ed, NULL when len is 0) and *source (malloc'ed) are set.
 * A missing or corrupt file leaves *found false and returns EPJ_OK. */
static epj_status disk_read(ej_kcache *c, const char *key, const char *shard,
			    const char *path, bool *found, unsigned char **data,
			    size_t *len, char **source)
{
	*found = false;
	struct stat st;
	if (lstat(shard, &st) != 0 && errno == ENOENT)
		return EPJ_OK;
	epj_status s = check_dir(c->ctx, shard);
	if (s == EPJ_ERR_IO) {
		/* not a directory: nothing to read, nothing insecure */
		epj_ctx_clear_error(c->ctx);
		return EPJ_OK;
	}
	if (s != EPJ_OK)
		return s;
	int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0) {
		if (errno == ENOENT)
			return EPJ_OK;
		if (errno == ELOOP && lstat(path, &st) == 0) {
			drop_corrupt(c, path, &st, "a symbolic link");
			return EPJ_OK;
		}
		return ej_error(c->ctx, EPJ_ERR_IO,
				"kernel cache: cannot open %s: %s", path,
				strerror(errno));
	}
	const char *why = NULL;
	unsigned char *buf = NULL;
	if (fstat(fd, &st) != 0) {
		s = ej_error(c->ctx, EPJ_ERR_IO,
			     "kernel cache: cannot inspect %s: %s", path,
			     strerror(errno));
		goto out;
	}
	if (!S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
		why = "not a regular file owned by you";
		goto out;
	}
	if (st.st_mode & (S_IWGRP | S_IWOTH)) {
		why = "writable by group or others; a cached module is code";
		goto out;
	}
	if (st.st_size < HDR_SIZE) {
		why = "truncated header";
		goto out;
	}
	if ((uint64_t)st.st_size > SIZE_MAX / 2) {
		why = "impossible size";
		goto out;
	}
	size_t size = (size_t)st.st_size;
	buf = malloc(size);
	if (!buf) {
		s = ej_error(c->ctx, EPJ_ERR_NOMEM,
			     "kernel cache: out of memory reading %s (%zu "
			     "bytes)",
			     path, size);
		goto out;
	}
	s = read_all(fd, buf, size);
	if (s == EPJ_ERR_FORMAT) {
		s = EPJ_OK;
		why = "shorter than its size";
		goto out;
	}
	if (s != EPJ_OK) {
		s = ej_error(c->ctx, EPJ_ERR_IO,
			     "kernel cache: cannot read %s: %s", path,
			     strerror(errno));
		goto out;
	}
	uint64_t alen = get_u64(buf + 72), slen = get_u64(buf + 80);
	unsigned char sum[16];
	if (memcmp(buf, MAGIC, MAGIC_LEN) != 0) {
		why = "bad magic";
	} else if (memcmp(buf + 8, key, EJ_KCACHE_KEY_LEN) != 0) {
		why = "holds a different key";
	} else if (alen == 0 || alen > size - HDR_SIZE ||
		   slen != size - HDR_SIZE - alen) {
		why = "bad lengths (empty artifact or not the file size)";
	} else {
		entry_checksum(buf, buf + HDR_SIZE, alen,
			       (char *)buf + HDR_SIZE + alen, slen, sum);
		if (memcmp(sum, buf + 88, 16) != 0)
			why = "checksum mismatch";
	}
	if (why)
		goto out;
	*data = alen ? malloc(alen) : NULL;
	*source = malloc(slen + 1);
	if ((alen && !*data) || !*source) {
		free(*data);
		free(*source);
		*data = NULL;
		*source = NULL;
		s = ej_error(c->ctx, EPJ_ERR_NOMEM,
			     "kernel cache: out of memory reading %s", path);
		goto out;
	}
	if (alen)
		memcpy(*data, buf + HDR_SIZE, alen);
	memcpy(*source, buf + HDR_SIZE + alen, slen);
	(*source)[slen] = '\0';
	*len = alen;
	*found = true;
	/* LRU: a hit makes the entry young (atime may be off: noatime). */
	const struct timespec ts[2] = { { .tv_nsec = UTIME_OMIT },
					{ .tv_nsec = UTIME_NOW } };
	(void)futimens(fd, ts);
out:
	if (why)
		drop_corrupt(c, path, &st, why);
	free(buf);
	close(fd);
	return s;
}

/* Writes the entry file atomically (see the file comment). */
static epj_status disk_write(ej_kcache *c, const char *key, const char *shard,
			     const char *path, const void *data, size_t len,
			     const char *source, size_t slen)
{
	epj_status s = subdir(c->ctx, shard);
	if (s != EPJ_OK)
		return s;
	unsigned char hdr[HDR_SIZE];
	memcpy(hdr, MAGIC, MAGIC_LEN);
	memcpy(hdr + 8, key, EJ_KCACHE_KEY_LEN);
	put_u64(hdr + 72, len);
	put_u64(hdr + 80, slen);
	entry_checksum(hdr, data, len, source, slen, hdr + 88);

	uint64_t seq = atomic_fetch_add(&tmp_seq, 1);
	char *tmp = str_printf("%s/%s.tmp.%ld.%" PRIu64 ".%s", shard, key,
			       (long)getpid(), seq, ej_host_tag());
	if (!tmp)
		return ej_error(c->ctx, EPJ_ERR_NOMEM,
				"kernel cache: out of memory");
	const char *what = "create";
	int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
		      0600);
	if (fd < 0)
		goto fail;
	what = "write";
	if (write_all(fd, hdr, HDR_SIZE) != EPJ_OK ||
	    (len && write_all(fd, data, len) != EPJ_OK) ||
	    (slen && write_all(fd, source, slen) != EPJ_OK))
		goto fail;
	what = "fsync";
	if (fsync(fd) != 0)
		goto fail;
	what = "close";
	int rc = close(fd);
	fd = -1;
	if (rc != 0)
		goto fail;
	what = "rename into place";
	if (rename(tmp, path) != 0)
		goto fail;
	free(tmp);
	epj_counter_add(c->ctx, "cache.bytes",
			(int64_t)(HDR_SIZE + len + slen));
	return EPJ_OK;
fail:;
	int err = errno;
	if (fd >= 0)
		close(fd);
	unlink(tmp);
	s = ej_error(c->ctx, EPJ_ERR_IO,
		     "kernel cache: cannot %s entry %s (via %s): %s", what,
		     path, tmp, strerror(err));
	free(tmp);
	return s;
}

/* ---- eviction -------------------------------------------------------------
 */

typedef struct disk_file {
	char *path;
	int64_t size;
	struct timespec mtime;
	bool keep;
} disk_file;

static int disk_file_cmp(const void *pa, const void *pb)
{
	const disk_file *a = pa, *b = pb;
	if (a->mtime.tv_sec != b->mtime.tv_sec)
		return a->mtime.tv_sec < b->mtime.tv_sec ? -1 : 1;
	if (a->mtime.tv_nsec != b->mtime.tv_nsec)
		return a->mtime.tv_nsec < b->mtime.tv_nsec ? -1 : 1;
	return strcmp(a->path, b->path);
}

static bool is_hex2(const char *s)
{
	for (int i = 0; i < 2; i++)
		if (!((s[i] >= '0' && s[i] <= '9') ||
		      (s[i] >= 'a' && s[i] <= 'f')))
			return false;
	return s[2] == '\0';
}

/* Appends the entries of one shard to *files; removes stale temporaries. */
static void scan_shard(const char *shard, const char *keep, disk_file **files,
		       int *n, int *cap, int64_t *total)
{
	DIR *d = opendir(shard);
	if (!d)
		return;
	time_t now = time(NULL);
	struct dirent *de;
	while ((de = readdir(d))) {
		const char *nm = de->d_name;
		size_t nl = strlen(nm);
		bool entry = nl == EJ_KCACHE_KEY_LEN + 4 &&
			     !strcmp(nm + EJ_KCACHE_KEY_LEN, ".bin");
		bool tmp = !entry && strstr(nm, ".tmp.") != NULL;
		if (!entry && !tmp)
			continue;
		char *p = str_printf("%s/%s", shard, nm);
		struct stat st;
		if (!p || lstat(p, &st) != 0 || !S_ISREG(st.st_mode)) {
			free(p);
			continue;
		}
		if (tmp) {
			if (now - st.st_mtime > STALE_TMP_SECONDS)
				unlink(p);
			free(p);
			continue;
		}
		if (*n == *cap) {
			int nc = *cap ? 2 * *cap : 64;
			disk_file *nf =
			    realloc(*files, (size_t)nc * sizeof *nf);
			if (!nf) {
				free(p);
				continue;
			}
			*files = nf;
			*cap = nc;
		}
		disk_file *f = &(*files)[(*n)++];
		f->path = p;
		f->size = (int64_t)st.st_size;
		f->mtime = st.st_mtim;
		f->keep = !strncmp(nm, keep, EJ_KCACHE_KEY_LEN);
		*total += f->size;
	}
	closedir(d);
}

/* Best effort: evicts least recently modified entries (other than keep)
 * while the entry files of the directory exceed the cap.  Failures to list
 * or remove are ignored (another process may be evicting the same files). */
static void evict(ej_kcache *c, const char *keep)
{
	DIR *d = opendir(c->vdir);
	if (!d)
		return;
	disk_file *files = NULL;
	int n = 0, cap = 0;
	int64_t total = 0;
	struct dirent *de;
	while ((de = readdir(d))) {
		if (!is_hex2(de->d_name))
			continue;
		char *shard = str_printf("%s/%s", c->vdir, de->d_name);
		struct stat st;
		if (shard && lstat(shard, &st) == 0 && S_ISDIR(st.st_mode))
			scan_shard(shard, keep, &files, &n, &cap, &total);
		free(shard);
	}
	closedir(d);
	if (total > c->cap) {
		qsort(files, (size_t)n, sizeof *files, disk_file_cmp);
		for (int i = 0; i < n && total > c->cap; i++) {
			if (files[i].keep)
				continue;
			if (unlink(files[i].path) == 0) {
				epj_counter_add(c->ctx, "cache.evictions", 1);
				epj_log_msg(EPJ_LOG_DEBUG,
					    "kernel cache: evicted %s (%" PRId64
					    " bytes)",
					    files[i].path, files[i].size);
				total -= files[i].size;
			} else if (errno == ENOENT) {
				total -= files[i].size;
			}
		}
	}
	for (int i = 0; i < n; i++)
		free(files[i].path);
	free(files);
}

/* ---- get / put ------------------------------------------------------------
 */

/* DIR/v1/xx and DIR/v1/xx/<key>.bin (malloc'ed) or EPJ_ERR_NOMEM. */
static epj_status entry_paths(ej_kcache *c, const char *key, char **shard,
			      char **path)
{
	*shard = str_printf("%s/%.2s", c->vdir, key);
	*path = *shard ? str_printf("%s/%s.bin", *shard, key) : NULL;
	if (*path)
		return EPJ_OK;
	free(*shard);
	*shard = NULL;
	return ej_error(c->ctx, EPJ_ERR_NOMEM, "kernel cache: out of memory");
}

static epj_status bad_key(ej_kcache *c, const char *fn, const char *key)
{
	return ej_error(c->ctx, EPJ_ERR_INVALID,
			"%s: key \"%.80s\" is not %d lowercase hex digits "
			"(make keys with ej_kcache_key)",
			fn, key ? key : "(null)", EJ_KCACHE_KEY_LEN);
}

/* Copies of a memory entry for the caller. */
static epj_status hand_out(ej_kcache *c, const mem_entry *m, void **data,
			   size_t *len, char **source)
{
	void *d = m->len ? malloc(m->len) : NULL;
	char *s = source ? strdup(m->source) : NULL;
	if ((m->len && !d) || (source && !s)) {
		free(d);
		free(s);
		return ej_error(c->ctx, EPJ_ERR_NOMEM,
				"kernel cache: out of memory");
	}
	if (m->len)
		memcpy(d, m->data, m->len);
	*data = d;
	*len = m->len;
	if (source)
		*source = s;
	return EPJ_OK;
}

/* A lookup; a miss adds to cache.misses only when count_miss (a re-check
 * under the key's lock follows a miss that was counted already). */
static epj_status lookup(ej_kcache *c, const char *key, void **data,
			 size_t *len, char **source, bool count_miss)
{
	EJ_ASSERT(c && data && len);
	*data = NULL;
	*len = 0;
	if (source)
		*source = NULL;
	if (!key_valid(key))
		return bad_key(c, "ej_kcache_get", key);
	mem_entry *m = mem_find(c, key);
	if (m) {
		m->tick = ++c->tick;
		epj_counter_add(c->ctx, "cache.mem_hits", 1);
		return hand_out(c, m, data, len, source);
	}
	if (c->no_disk) {
		if (count_miss)
			epj_counter_add(c->ctx, "cache.misses", 1);
		return EPJ_OK;
	}
	char *shard, *path;
	epj_status s = entry_paths(c, key, &shard, &path);
	if (s != EPJ_OK)
		return s;
	bool found;
	unsigned char *d = NULL;
	size_t n = 0;
	char *src = NULL;
	s = disk_read(c, key, shard, path, &found, &d, &n, &src);
	free(shard);
	free(path);
	if (s != EPJ_OK)
		return s;
	if (!found) {
		if (count_miss)
			epj_counter_add(c->ctx, "cache.misses", 1);
		return EPJ_OK;
	}
	epj_counter_add(c->ctx, "cache.disk_hits", 1);
	s = mem_insert(c, key, d, n, src);
	if (s != EPJ_OK)
		return s;
	m = mem_find(c, key);
	EJ_ASSERT(m);
	return hand_out(c, m, data, len, source);
}

epj_status ej_kcache_get_with_source(ej_kcache *c, const char *key, void **data,
				     size_t *len, char **source)
{
	return lookup(c, key, data, len, source, true);
}

epj_status ej_kcache_get(ej_kcache *c, const char *key, void **data,
			 size_t *len)
{
	return lookup(c, key, data, len, NULL, true);
}

epj_status ej_kcache_recheck(ej_kcache *c, const char *key, void **data,
			     size_t *len)
{
	return lookup(c, key, data, len, NULL, false);
}

/* *data loaded into *module, or it is dropped and NULL. */
static void load_or_drop(ej_kcache *c, epj_ctx *ctx, const char *key,
			 const ej_device *dev, const char *name, void **module,
			 void **data, size_t len)
{
	if (!*data ||
	    dev->load(dev->self, ctx, *data, len, name, module) == EPJ_OK)
		return;
	/* a cached artifact the device refuses: dropped and rebuilt, never
	 * the caller's error */
	ej_kcache_drop_unloadable(c, key, *data, len, epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
	free(*data);
	*data = NULL;
}

epj_status ej_kcache_get_module(ej_kcache *c, epj_ctx *ctx, const char *key,
				const ej_device *dev, const char *name,
				void **module, void **data, size_t *len,
				int *lock)
{
	*data = NULL;
	*len = 0;
	*lock = -1;
	epj_status st = ej_kcache_get(c, key, data, len);
	if (st == EPJ_OK)
		load_or_drop(c, ctx, key, dev, name, module, data, *len);
	/* a miss: of the processes that miss this key at once (the ranks of
	 * a node), one compiles and the others wait for its entry */
	if (st == EPJ_OK && !*data) {
		st = ej_kcache_lock(c, key, lock);
		if (st == EPJ_OK)
			st = ej_kcache_recheck(c, key, data, len);
		if (st == EPJ_OK)
			load_or_drop(c, ctx, key, dev, name, module, data,
				     *len);
	}
	return st;
}

epj_status ej_kcache_put(ej_kcache *c, const char *key, const void *data,
			 size_t len, const char *source)
{
	EJ_ASSERT(c);
	if (!key_valid(key))
		return bad_key(c, "ej_kcache_put", key);
	if (!data || len == 0)
		return ej_error(
		    c->ctx, EPJ_ERR_INVALID,
		    "ej_kcache_put: key %s: empty artifact (%s, %zu "
		    "bytes)",
		    key, data ? "data" : "NULL data", len);
	if (!source)
		source = "";
	size_t slen = strlen(source);
	unsigned char *d = len ? malloc(len) : NULL;
	char *src = strdup(source);
	if ((len && !d) || !src) {
		free(d);
		free(src);
		return ej_error(c->ctx, EPJ_ERR_NOMEM,
				"kernel cache: out of memory");
	}
	if (len)
		memcpy(d, data, len);
	epj_status s = mem_insert(c, key, d, len, src);
	if (s != EPJ_OK || c->no_disk)
		return s;
	char *shard, *path;
	s = entry_paths(c, key, &shard, &path);
	if (s != EPJ_OK)
		return s;
	s = disk_write(c, key, shard, path, data, len, source, slen);
	free(shard);
	free(path);
	if (s == EPJ_OK)
		evict(c, key);
	if (s == EPJ_ERR_IO) {
		write_failed(c);
		s = EPJ_OK;
	}
	return s;
}

/* ---- entries that do not load --------------------------------------------
 */

/* Unlinks the entry file at path if it still holds the artifact
 * data[0..len) (read through one O_NOFOLLOW descriptor, and the path still
 * names that inode): an entry another process rebuilt meanwhile stays.
 * True when the file was removed. */
static bool disk_drop_if_same(const char *path, const void *data, size_t len)
{
	int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return false;
	struct stat st, now;
	unsigned char hdr[HDR_SIZE];
	bool same = false;
	if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
	    (uint64_t)st.st_size >= HDR_SIZE + (uint64_t)len &&
	    read_all(fd, hdr, HDR_SIZE) == EPJ_OK &&
	    get_u64(hdr + 72) == (uint64_t)len) {
		unsigned char *buf = malloc(len);
		same = buf && read_all(fd, buf, len) == EPJ_OK &&
		       memcmp(buf, data, len) == 0;
		free(buf);
	}
	close(fd);
	return same && lstat(path, &now) == 0 && now.st_dev == st.st_dev &&
	       now.st_ino == st.st_ino && unlink(path) == 0;
}

void ej_kcache_drop_unloadable(ej_kcache *c, const char *key, const void *data,
			       size_t len, const char *why)
{
	EJ_ASSERT(c && data && len > 0);
	/* why may be the message of c->ctx, which the calls below reuse */
	char reason[1024];
	snprintf(reason, sizeof reason, "%s", why && *why ? why : "no reason");
	if (!key_valid(key))
		return;
	mem_entry *m = mem_find(c, key);
	if (m && m->len == len && memcmp(m->data, data, len) == 0) {
		c->mem_bytes -= mem_size(m);
		mem_entry_clear(m);
		*m = c->mem[--c->n_mem];
	}
	char *shard = NULL, *path = NULL;
	bool removed = false;
	if (!c->no_disk) {
		if (entry_paths(c, key, &shard, &path) == EPJ_OK)
			removed = disk_drop_if_same(path, data, len);
		else /* out of memory: the file stays, a later run retries */
			epj_ctx_clear_error(c->ctx);
	}
	/* the compile that follows is a miss's (compile.us, not cached_us) */
	epj_counter_add(c->ctx, "cache.unloadable", 1);
	epj_counter_add(c->ctx, "cache.misses", 1);
	bool first = !atomic_flag_test_and_set(&warned_unloadable);
	epj_log_msg(first ? EPJ_LOG_WARN : EPJ_LOG_INFO,
		    "kernel cache %s: entry %s passed its checks but does not "
		    "load (%s); %s, compiling it afresh (%scounted in "
		    "cache.unloadable)",
		    c->dir, path ? path : key, reason,
		    removed ? "removed it" : "dropped it",
		    first ? "warned once per process; " : "");
	free(shard);
	free(path);
}

/* ---- per-key lock ---------------------------------------------------------
 */

/* Seconds to wait for another process's compile (EPJIT_CACHE_LOCK_TIMEOUT,
 * default 600). */
static double lock_timeout(void)
{
	const char *e = getenv("EPJIT_CACHE_LOCK_TIMEOUT");
	char *end;
	double t = e && *e ? strtod(e, &end) : 600.0;
	if (e && *e && (*end || !(t >= 0)))
		t = 600.0;
	return t;
}

epj_status ej_kcache_lock(ej_kcache *c, const char *key, int *lock)
{
	EJ_ASSERT(c && lock);
	*lock = -1;
	if (!key_valid(key))
		return bad_key(c, "ej_kcache_lock", key);
	if (c->no_disk)
		return EPJ_OK;
	char *shard, *path;
	epj_status s = entry_paths(c, key, &shard, &path);
	if (s != EPJ_OK)
		return s;
	s = subdir(c->ctx, shard);
	char *lp = s == EPJ_OK ? str_printf("%s/%s.lock", shard, key) : NULL;
	int fd = -1;
	if (s == EPJ_OK && !lp)
		s = ej_error(c->ctx, EPJ_ERR_NOMEM,
			     "kernel cache: out of memory");
	if (s == EPJ_OK) {
		fd = open(
		    lp, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC,
		    0600);
		struct stat st;
		if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
			s = ej_error(c->ctx, EPJ_ERR_IO,
				     "kernel cache: cannot use lock file %s: "
				     "%s",
				     lp,
				     fd < 0 ? strerror(errno)
					    : "not a regular file");
	}
	if (s == EPJ_OK && flock(fd, LOCK_EX | LOCK_NB) != 0) {
		if (errno != EWOULDBLOCK) {
			s = ej_error(c->ctx, EPJ_ERR_IO,
				     "kernel cache: flock %s: %s", lp,
				     strerror(errno));
		} else {
			/* Another process compiles this key: wait for it
			 * (its death releases the lock), polling so that a
			 * hung compile cannot hold us forever. */
			epj_counter_add(c->ctx, "cache.lock_waits", 1);
			double limit = lock_timeout(), waited = 0;
			long us = 1000;
			int rc;
			while ((rc = flock(fd, LOCK_EX | LOCK_NB)) != 0 &&
			       errno == EWOULDBLOCK && waited < limit) {
				usleep((useconds_t)us);
				waited += (double)us / 1e6;
				us = us < 100000 ? us * 2 : 100000;
			}
			if (rc != 0) {
				epj_log_msg(EPJ_LOG_WARN,
					    "kernel cache: %s still locked "
					    "after %.0f s "
					    "(EPJIT_CACHE_LOCK_TIMEOUT); "
					    "compiling without the lock",
					    lp, limit);
				epj_counter_add(c->ctx, "cache.lock_timeouts",
						1);
				close(fd);
				fd = -1;
			}
		}
	}
	if (s == EPJ_ERR_IO) {
		/* no lock possible (read-only, full): compile anyway */
		write_failed(c);
		s = EPJ_OK;
	}
	if (s != EPJ_OK && fd >= 0) {
		close(fd);
		fd = -1;
	}
	*lock = fd;
	free(lp);
	free(shard);
	free(path);
	return s;
}

void ej_kcache_unlock(ej_kcache *c, int lock)
{
	(void)c;
	if (lock >= 0)
		close(lock); /* drops the flock */
}

/* ---- listing
 * ---------------------------------------------------------------
 */

int ej_kcache_list(ej_kcache *c, ej_kcache_list_fn fn, void *user)
{
	DIR *d = opendir(c->vdir);
	if (!d)
		return 0;
	int n = 0;
	struct dirent *de;
	while ((de = readdir(d))) {
		if (!is_hex2(de->d_name))
			continue;
		char *shard = str_printf("%s/%s", c->vdir, de->d_name);
		struct stat st;
		DIR *s = NULL;
		if (shard && lstat(shard, &st) == 0 && S_ISDIR(st.st_mode))
			s = opendir(shard);
		struct dirent *fe;
		while (s && (fe = readdir(s))) {
			const char *nm = fe->d_name;
			char key[EJ_KCACHE_KEY_LEN + 1];
			if (strlen(nm) != EJ_KCACHE_KEY_LEN + 4 ||
			    strcmp(nm + EJ_KCACHE_KEY_LEN, ".bin") != 0)
				continue;
			memcpy(key, nm, EJ_KCACHE_KEY_LEN);
			key[EJ_KCACHE_KEY_LEN] = '\0';
			char *p = str_printf("%s/%s", shard, nm);
			if (p && key_valid(key) && lstat(p, &st) == 0 &&
			    S_ISREG(st.st_mode)) {
				n++;
				if (fn)
					fn(user, key, (int64_t)st.st_size);
			}
			free(p);
		}
		if (s)
			closedir(s);
		free(shard);
	}
	closedir(d);
	return n;
}
