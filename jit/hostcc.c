/* hostcc.c -- generated C -> shared object with the host C compiler, and the
 * loader that dlopen()s such an object from bytes.
 *
 * Compile: the source goes into a private directory (mkdtemp, 0700) as
 * <name>.c; `$EPJIT_CC EJ_HOSTCC_FLAGS -o <name>.so <name>.c EJ_HOSTCC_LIBS`
 * runs through posix_spawnp (no shell: paths and names need no quoting; a
 * spawn rather than fork, so a large multithreaded process is not copied)
 * with stdout and stderr captured together; the .so is read back into
 * memory for the cache and the directory removed.  A failed compile keeps
 * the directory with the source only, and the message names it.
 *
 * Load: the bytes go to a private temporary file whose name is unique in
 * this process (pid + counter + mkstemp): glibc's dlopen returns an already
 * loaded object when the path string matches, so a name must never repeat
 * while an object loaded from it is alive.  The file is unlinked right after
 * dlopen; the mapping stays.
 *
 * Every libc/dl call that can fail goes through SYS_CHECK / EJ_DL_CALL, whose
 * message carries the statement, file:line and strerror()/dlerror().
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "cc.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <spawn.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* Compiler output kept (the rest is drained and dropped). */
#define OUTPUT_MAX (4u << 20)

/* ---- shared helpers -------------------------------------------------------
 */

const char *ej_tmpdir(void)
{
	const char *t = getenv("TMPDIR");
	return t && *t ? t : "/tmp";
}

char *ej_safe_name(const char *name, char *buf, size_t n)
{
	EJ_ASSERT(n >= 2);
	if (!name || !*name)
		name = "unnamed";
	size_t i = 0;
	for (; name[i] && i + 1 < n; i++) {
		unsigned char c = (unsigned char)name[i];
		buf[i] = isalnum(c) || c == '_' || c == '.' || c == '-'
			     ? (char)c
			     : '_';
	}
	buf[i] = '\0';
	if (buf[0] == '.') /* no hidden files, no ".." */
		buf[0] = '_';
	return buf;
}

/* Writes n bytes to fd; 0 or an errno value. */
static int write_all(int fd, const void *data, size_t n)
{
	const char *p = data;
	while (n > 0) {
		ssize_t w = write(fd, p, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return w < 0 ? errno : EIO;
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

int ej_write_new_file(const char *path, const void *data, size_t n)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
	if (fd < 0)
		return errno;
	int err = write_all(fd, data, n);
	if (close(fd) != 0 && !err)
		err = errno;
	if (err)
		unlink(path);
	return err;
}

/* Sets EPJ_ERR_IO for a failed libc call. */
static epj_status sys_fail(epj_ctx *ctx, const char *what, const char *stmt,
			   const char *file, int line, int err)
{
	return ej_error(ctx, EPJ_ERR_IO, "host cc: %s: %s failed at %s:%d: %s",
			what, stmt, ej_src_file(file), line, strerror(err));
}

/* Runs `stmt`; when `stmt failed` holds (e.g. `< 0`, `== NULL`), sets the
 * message (sys_fail, errno) and jumps to the caller's `out` with `st` set. */
#define SYS_CHECK(ctx, stmt, failed, what)                                     \
	do {                                                                   \
		if ((stmt)failed) {                                            \
			st = sys_fail(ctx, what, #stmt, __FILE__, __LINE__,    \
				      errno);                                  \
			goto out;                                              \
		}                                                              \
	} while (0)

/* Reads a whole file into malloc'ed memory. */
static epj_status read_all(epj_ctx *ctx, const char *path, void **data,
			   size_t *size)
{
	epj_status st = EPJ_OK;
	char *buf = NULL;
	struct stat sb;
	int fd = -1;
	SYS_CHECK(ctx, fd = open(path, O_RDONLY | O_CLOEXEC), < 0, path);
	SYS_CHECK(ctx, fstat(fd, &sb), != 0, path);
	buf = malloc(sb.st_size > 0 ? (size_t)sb.st_size : 1);
	if (!buf) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "host cc: %s: %lld bytes",
			      path, (long long)sb.st_size);
		goto out;
	}
	size_t got = 0;
	while (got < (size_t)sb.st_size) {
		ssize_t r;
		SYS_CHECK(ctx,
			  r = read(fd, buf + got, (size_t)sb.st_size - got),
			  < 0 && errno != EINTR, path);
		if (r == 0) {
			st = ej_error(ctx, EPJ_ERR_IO,
				      "host cc: %s: file shrank while read",
				      path);
			goto out;
		}
		if (r > 0)
			got += (size_t)r;
	}
	*data = buf;
	*size = got;
	buf = NULL;
out:
	if (fd >= 0)
		close(fd);
	free(buf);
	return st;
}

/* ---- running the compiler ------------------------------------------------
 */

/* The two languages: C ($EPJIT_CC) and C++ ($EPJIT_CXX, for cuda-sim). */
typedef struct cc_lang {
	const char *env, *dflt, *ext, *flags, *libs, *what;
} cc_lang;
static const cc_lang lang_c = { "EPJIT_CC",	 "cc",		 "c",
				EJ_HOSTCC_FLAGS, EJ_HOSTCC_LIBS, "C" };
static const cc_lang lang_cxx = { "EPJIT_CXX",	    "c++",	     "cc",
				  EJ_HOSTCXX_FLAGS, EJ_HOSTCXX_LIBS, "C++" };
static _Thread_local const cc_lang *cur_lang = &lang_c;

/* Words of $EPJIT_CC (default "cc"; $EPJIT_CXX / "c++" in C++ mode), split
 * at blanks, in a malloc'ed copy (*store) that argv points into.  Returns
 * the count (>= 1). */
static int cc_words(char **store, char **argv, int max, const char **cc)
{
	const char *env = getenv(cur_lang->env);
	bool blank = true;
	for (const char *c = env; c && *c; c++)
		blank &= isspace((unsigned char)*c) != 0;
	*cc = blank ? cur_lang->dflt : env;
	*store = strdup(*cc);
	if (!*store)
		return -1;
	int n = 0;
	char *save = NULL;
	for (char *w = strtok_r(*store, " \t\n", &save); w && n < max;
	     w = strtok_r(NULL, " \t\n", &save))
		argv[n++] = w;
	return n;
}

/* Appends the words of `flags` (a malloc'ed copy in *store) to argv. */
static int add_words(char **store, const char *flags, char **argv, int n,
		     int max)
{
	*store = strdup(flags);
	if (!*store)
		return -1;
	char *save = NULL;
	for (char *w = strtok_r(*store, " ", &save); w && n < max;
	     w = strtok_r(NULL, " ", &save))
		argv[n++] = w;
	return n;
}

/* argv joined with blanks, for messages. */
static void join_argv(char *const *argv, char *buf, size_t n)
{
	size_t used = 0;
	buf[0] = '\0';
	for (int i = 0; argv[i] && used < n; i++)
		used += (size_t)snprintf(buf + used, n - used, "%s%s",
					 i ? " " : "", argv[i]);
}

/* Finds the executable `prog` as execvp would (a name with a '/' as is,
 * else the first executable regular file in $PATH, default
 * "/usr/local/bin:/usr/bin:/bin") and writes its path to out.  Returns 0 or
 * an errno value (ENOENT, EACCES).  Resolving first, rather than leaving it
 * to posix_spawnp, makes a missing compiler a clean error everywhere: where
 * the spawn is emulated with fork (valgrind, other libcs) a failed exec only
 * shows as exit status 127. */
static int find_program(const char *prog, char *out, size_t n)
{
	struct stat sb;
	if (strchr(prog, '/')) {
		if (stat(prog, &sb) != 0)
			return errno;
		if (!S_ISREG(sb.st_mode) || access(prog, X_OK) != 0)
			return EACCES;
		snprintf(out, n, "%s", prog);
		return 0;
	}
	const char *path = getenv("PATH");
	if (!path || !*path)
		path = "/usr/local/bin:/usr/bin:/bin";
	int err = ENOENT;
	for (const char *p = path;;) {
		size_t len = strcspn(p, ":");
		/* An empty PATH entry means the current directory. */
		if ((size_t)snprintf(out, n, "%.*s%s%s", (int)len, p,
				     len ? "/" : "", prog) < n &&
		    stat(out, &sb) == 0) {
			if (S_ISREG(sb.st_mode) && access(out, X_OK) == 0)
				return 0;
			err = EACCES;
		}
		if (p[len] == '\0')
			break;
		p += len + 1;
	}
	return err;
}

/* Runs argv (found by find_program, no shell), stdin from /dev/null, stdout and
 * stderr into *output (malloc'ed, NUL-terminated).  *wstatus is waitpid's
 * status. Returns 0, or an errno value with err_where saying which call failed.
 */
static int run_capture(char *const *argv, char **output, int *wstatus,
		       char *err_where, size_t err_len)
{
	int pfd[2] = { -1, -1 };
	posix_spawn_file_actions_t fa;
	bool fa_ok = false;
	size_t len = 0, cap = 4096;
	char *buf = malloc(cap);
	pid_t pid;
	int err = 0;
	char exe[PATH_MAX];
	*output = NULL;
	/* The check macro of this function: records the failed call in
	 * err_where and its errno-style result in err. */
#define WHERE(text)                                                            \
	snprintf(err_where, err_len, "%s at %s:%d", text,                      \
		 ej_src_file(__FILE__), __LINE__)
#define RUN_CHECK(stmt)                                                        \
	do {                                                                   \
		if ((err = (stmt)) != 0) {                                     \
			WHERE(#stmt);                                          \
			goto out;                                              \
		}                                                              \
	} while (0)
	if (!buf) {
		err = ENOMEM;
		WHERE("malloc(cap)");
		goto out;
	}
	RUN_CHECK(find_program(argv[0], exe, sizeof exe));
	RUN_CHECK(pipe2(pfd, O_CLOEXEC) ? errno : 0);
	RUN_CHECK(posix_spawn_file_actions_init(&fa));
	fa_ok = true;
	RUN_CHECK(
	    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0));
	RUN_CHECK(posix_spawn_file_actions_adddup2(&fa, pfd[1], 1));
	RUN_CHECK(posix_spawn_file_actions_adddup2(&fa, pfd[1], 2));
	RUN_CHECK(posix_spawn(&pid, exe, &fa, NULL, argv, environ));
	close(pfd[1]);
	pfd[1] = -1;
	for (;;) {
		if (len + 1 == cap && cap < OUTPUT_MAX + 1) {
			char *nb = realloc(buf, cap * 2);
			if (nb) {
				buf = nb;
				cap *= 2;
			}
		}
		char drain[4096];
		bool full = len + 1 >= cap;
		ssize_t r = full ? read(pfd[0], drain, sizeof drain)
				 : read(pfd[0], buf + len, cap - 1 - len);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			err = errno;
			WHERE("read(pfd[0], ...)");
			break; /* still reap the child below */
		}
		if (r == 0)
			break;
		if (!full)
			len += (size_t)r;
	}
	while (waitpid(pid, wstatus, 0) < 0) {
		if (errno != EINTR) {
			if (!err) {
				err = errno;
				WHERE("waitpid(pid, wstatus, 0)");
			}
			break;
		}
	}
out:
#undef RUN_CHECK
#undef WHERE
	if (fa_ok)
		posix_spawn_file_actions_destroy(&fa);
	if (pfd[0] >= 0)
		close(pfd[0]);
	if (pfd[1] >= 0)
		close(pfd[1]);
	if (buf)
		buf[len] = '\0';
	if (err) {
		free(buf);
		buf = NULL;
	}
	*output = buf;
	return err;
}

/* "exit status 1" / "killed by signal 9". */
static void describe_wait(int ws, char *buf, size_t n)
{
	if (WIFEXITED(ws))
		snprintf(buf, n, "exit status %d", WEXITSTATUS(ws));
	else if (WIFSIGNALED(ws))
		snprintf(buf, n, "killed by signal %d", WTERMSIG(ws));
	else
		snprintf(buf, n, "wait status %#x", ws);
}

#define ARGV_MAX 64

static epj_status compile_lang(epj_ctx *ctx, const char *source,
			       const char *name, const char *extra,
			       void **so_image, size_t *so_size, char **log);

epj_status ej_hostcc_compile(epj_ctx *ctx, const char *source, const char *name,
			     void **so_image, size_t *so_size, char **log)
{
	cur_lang = &lang_c;
	return compile_lang(ctx, source, name, NULL, so_image, so_size, log);
}

epj_status ej_hostcxx_compile(epj_ctx *ctx, const char *source,
			      const char *name, const char *extra_flags,
			      void **so_image, size_t *so_size, char **log)
{
	cur_lang = &lang_cxx;
	epj_status st = compile_lang(ctx, source, name, extra_flags, so_image,
				     so_size, log);
	cur_lang = &lang_c;
	return st;
}

static epj_status compile_lang(epj_ctx *ctx, const char *source,
			       const char *name, const char *extra,
			       void **so_image, size_t *so_size, char **log)
{
	EJ_ASSERT(so_image && so_size);
	*so_image = NULL;
	*so_size = 0;
	if (log)
		*log = NULL;
	if (!source)
		return ej_error(ctx, EPJ_ERR_INVALID, "host cc: no source");
	epj_status st = EPJ_OK;
	char safe[64], dir[PATH_MAX], src[PATH_MAX + 80], so[PATH_MAX + 80];
	char *words = NULL, *flags = NULL, *libs = NULL, *output = NULL;
	char *xflags = NULL;
	char *argv[ARGV_MAX];
	const char *cc;
	bool made_dir = false, keep_source = false;
	ej_safe_name(name, safe, sizeof safe);

	snprintf(dir, sizeof dir, "%s/epjit-cc-XXXXXX", ej_tmpdir());
	SYS_CHECK(ctx, mkdtemp(dir), == NULL, "making a private directory");
	made_dir = true;
	snprintf(src, sizeof src, "%s/%s.%s", dir, safe, cur_lang->ext);
	snprintf(so, sizeof so, "%s/%s.so", dir, safe);
	int err = ej_write_new_file(src, source, strlen(source));
	if (err) {
		st = sys_fail(ctx, src, "ej_write_new_file(src, source, n)",
			      __FILE__, __LINE__, err);
		goto out;
	}

	/* argv: $EPJIT_CC words (at most ARGV_MAX - 24), flags, -o so, src,
	 * libs, NULL. */
	int n = cc_words(&words, argv, ARGV_MAX - 24, &cc);
	if (n >= 1)
		n = add_words(&flags, cur_lang->flags, argv, n, ARGV_MAX - 16);
	if (n >= 1 && extra && *extra)
		n = add_words(&xflags, extra, argv, n, ARGV_MAX - 8);
	if (n < 1) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "host cc: out of memory");
		goto out;
	}
	argv[n++] = "-o";
	argv[n++] = so;
	argv[n++] = src;
	n = add_words(&libs, cur_lang->libs, argv, n, ARGV_MAX - 1);
	if (n < 1) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "host cc: out of memory");
		goto out;
	}
	argv[n] = NULL;

	char where[160], cmd[1024], how[64];
	int ws = 0;
	join_argv(argv, cmd, sizeof cmd);
	err = run_capture(argv, &output, &ws, where, sizeof where);
	if (err) {
		st = ej_error(ctx, EPJ_ERR_COMPILE,
			      "host cc: compiling '%s': cannot run the %s "
			      "compiler '%s' (%s=%s): %s failed: %s",
			      safe, cur_lang->what, argv[0], cur_lang->env, cc,
			      where, strerror(err));
		goto out;
	}
	if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
		describe_wait(ws, how, sizeof how);
		keep_source = true;
		st = ej_error(ctx, EPJ_ERR_COMPILE,
			      "host cc: compiling '%s' failed (%s; %s=%s); "
			      "source kept at %s; command: %s; output:\n%s",
			      safe, how, cur_lang->env, cc, src, cmd,
			      output[0] ? output : "(none)\n");
		goto out;
	}
	st = read_all(ctx, so, so_image, so_size);
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "host cc: reading back what '%s' built",
				cmd);

out:
	if (made_dir) {
		/* Only files this function named can be there; a compiler
		 * that leaves others makes rmdir fail, which is logged. */
		unlink(so);
		if (!keep_source)
			unlink(src);
		if (!keep_source && rmdir(dir) != 0)
			epj_log_msg(EPJ_LOG_WARN,
				    "host cc: rmdir(dir) failed at %s:%d: "
				    "%s: %s",
				    ej_src_file(__FILE__), __LINE__, dir,
				    strerror(errno));
	}
	free(words);
	free(flags);
	free(xflags);
	free(libs);
	if (log)
		*log = output ? output : strdup("");
	else
		free(output);
	return st;
}

/* ---- loading ----------------------------------------------------------- */

static atomic_uint load_seq;

epj_status ej_hostcc_load(epj_ctx *ctx, const void *so_image, size_t size,
			  const char *name, void **handle)
{
	EJ_ASSERT(handle);
	*handle = NULL;
	if (!so_image || size == 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"host cc: loading '%s': empty image",
				name ? name : "(null)");
	epj_status st = EPJ_OK;
	char safe[64], path[PATH_MAX];
	ej_safe_name(name, safe, sizeof safe);
	snprintf(path, sizeof path, "%s/epjit-so-%d-%u-%s-XXXXXX", ej_tmpdir(),
		 (int)getpid(), atomic_fetch_add(&load_seq, 1), safe);
	int fd = -1;
	bool made = false;
	SYS_CHECK(ctx, fd = mkstemp(path), < 0, "a temporary file for dlopen");
	made = true;
	int err = write_all(fd, so_image, size);
	if (close(fd) != 0 && !err)
		err = errno;
	if (err) {
		st = sys_fail(ctx, path, "write_all(fd, so_image, size)",
			      __FILE__, __LINE__, err);
		goto out;
	}
	char where[PATH_MAX + 160];
	const char *dl_err;
	void *h;
	EJ_DL_CALL(h, dlopen(path, RTLD_NOW | RTLD_LOCAL), where, dl_err);
	if (!h) {
		st =
		    ej_error(ctx, EPJ_ERR_BACKEND,
			     "host cc: loading '%s' (%zu bytes): %s failed: %s",
			     safe, size, where, dl_err);
		goto out;
	}
	*handle = h;
out:
	if (made)
		unlink(path);
	return st;
}

void *ej_hostcc_sym(void *handle, const char *sym)
{
	return handle && sym ? dlsym(handle, sym) : NULL;
}

void ej_hostcc_unload(void *handle)
{
	if (handle && dlclose(handle) != 0)
		epj_log_msg(EPJ_LOG_WARN, "host cc: dlclose failed: %s",
			    dlerror());
}

/* ---- identity ------------------------------------------------------------
 */

/* One computed identity per distinct $EPJIT_CC value, never freed (the
 * returned strings must stay valid for the process). */
typedef struct cc_ident {
	struct cc_ident *next;
	char *cc;
	char *identity;
} cc_ident;

static pthread_mutex_t ident_lock = PTHREAD_MUTEX_INITIALIZER;

static char *compute_identity(void)
{
	char *words = NULL, *argv[ARGV_MAX], *output = NULL, version[256];
	const char *cc;
	int n = cc_words(&words, argv, ARGV_MAX - 2, &cc);
	if (n < 1)
		return NULL;
	argv[n++] = "--version";
	argv[n] = NULL;
	char where[160];
	int ws = 0;
	int err = run_capture(argv, &output, &ws, where, sizeof where);
	if (err) {
		snprintf(version, sizeof version, "(cannot run: %s)",
			 strerror(err));
	} else if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
		snprintf(version, sizeof version, "(--version failed)");
	} else {
		size_t l = strcspn(output, "\n");
		while (l > 0 && isspace((unsigned char)output[l - 1]))
			l--;
		snprintf(version, sizeof version, "%.*s", (int)l, output);
	}
	free(output);
	char *id = NULL;
	if (asprintf(&id, "%s | %s | %s %s", cc, version, cur_lang->flags,
		     cur_lang->libs) < 0)
		id = NULL;
	free(words);
	return id;
}

static const char *identity_of(cc_ident **list);

const char *ej_hostcc_identity(void)
{
	static cc_ident *c_idents;
	cur_lang = &lang_c;
	return identity_of(&c_idents);
}

const char *ej_hostcxx_identity(void)
{
	static cc_ident *cxx_idents;
	cur_lang = &lang_cxx;
	const char *id = identity_of(&cxx_idents);
	cur_lang = &lang_c;
	return id;
}

static const char *identity_of(cc_ident **list)
{
	const char *env = getenv(cur_lang->env);
	const char *key = env ? env : "";
	pthread_mutex_lock(&ident_lock);
	cc_ident *e = *list;
	while (e && strcmp(e->cc, key) != 0)
		e = e->next;
	if (!e) {
		e = calloc(1, sizeof *e);
		char *id = compute_identity();
		if (e && id && (e->cc = strdup(key)) != NULL) {
			e->identity = id;
			e->next = *list;
			*list = e;
		} else {
			free(e);
			free(id);
			e = NULL;
		}
	}
	pthread_mutex_unlock(&ident_lock);
	/* Out of memory: still non-empty, and distinct from any real one. */
	return e ? e->identity : "host cc identity unavailable";
}
