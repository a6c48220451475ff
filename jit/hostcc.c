/* hostcc.c -- generated C -> shared object with the host C compiler, and the
 * loader that dlopen()s such an object from bytes.
 *
 * A compiled module is code that runs with our rights, so nothing on the way
 * from source to dlopen may be reachable by another user:
 *
 * Compile: a private directory, <TMPDIR>/epjit-cc-<pid>.<host>-XXXXXX, is
 * made with mkdtemp and opened
 * (O_DIRECTORY | O_NOFOLLOW); through that descriptor it must be a directory
 * owned by geteuid() with no group or other permission bits, and the path
 * must still name it.  The source is written into it through the descriptor
 * as <name>.c; `$EPJIT_CC <ej_hostcc_cflags()> -c -o <name>.o <name>.c`
 * then `$EPJIT_CC -shared -o <name>.so <name>.o <the library's OpenMP
 * runtime> EJ_HOSTCC_LIBS` run through spawn_compiler (no shell; on Linux
 * a clone sharing our memory until exec, like posix_spawn's, so a large
 * multithreaded process is not copied, that sets PR_SET_PDEATHSIG: the
 * compiler dies with us, even by SIGKILL) with
 * their working directory set to the descriptor (fchdir, so renaming the
 * directory under it changes nothing), relative paths and TMPDIR="." (the
 * compiler's own temporaries stay in the private directory), stdout and
 * stderr captured together.  The .so is opened once, relative to the directory
 * descriptor, with O_NOFOLLOW | O_NONBLOCK; through that descriptor it must be
 * a regular file owned by us, not writable by group or others, with one link;
 * the bytes are read from that descriptor.  The directory is removed through
 * the descriptor (rmdir of the path only while it still names the same inode).
 * A failed compile keeps the directory with the source only, renamed to
 * <prefix>-kept-..., and the message names it.  The directory is locked
 * (flock) while its process works in it; those that processes killed
 * during a compile left behind (their pid dead, their lock free) are
 * removed before each new one is made (ej_privdir_sweep).
 *
 * Load: the bytes go to an anonymous memory file (memfd_create, sealed
 * against writes; where memfd_create is missing, an unlinked file of a
 * private directory checked as above) and the object is loaded with
 * dlopen("/proc/self/fd/<n>"): the descriptor, not a path anyone can change
 * between check and load.  glibc's dlopen returns an already loaded object
 * when the name string matches, so the descriptor stays open as long as the
 * object is loaded (its number, hence the name, cannot repeat meanwhile).
 *
 * Every libc/dl call that can fail goes through SYS_CHECK / EJ_DL_CALL, whose
 * message carries the statement, file:line and strerror()/dlerror().
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "cc.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sched.h>
#include <sys/prctl.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

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

/* ---- running the compiler ------------------------------------------------
 */

/* The two languages: C ($EPJIT_CC, generated kernels) and C++ ($EPJIT_CXX,
 * cuda-sim modules).  A compile or an identity runs in one of them; the
 * current one is per thread. */
typedef struct cc_lang {
	const char *env, *dflt, *ext, *what;
} cc_lang;
static const cc_lang lang_c = { "EPJIT_CC", "cc", "c", "C" };
static const cc_lang lang_cxx = { "EPJIT_CXX", "c++", "cc", "C++" };
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

/* The compile timeout in seconds: $EPJIT_CC_TIMEOUT (a whole number, 0 for
 * none; default 900, generous for the largest generated module on a loaded
 * host). */
static int cc_timeout_s(void)
{
	const char *v = getenv("EPJIT_CC_TIMEOUT");
	if (!v || !*v)
		return 900;
	char *end;
	errno = 0;
	long x = strtol(v, &end, 10);
	if (errno || *end || x < 0 || x > 86400 * 7)
		return 900;
	return (int)x;
}

#ifdef __linux__
/* What the compiler's child reads between clone and exec.  It shares our
 * memory (CLONE_VM) while the calling thread waits (CLONE_VFORK), so it
 * only makes system calls, and it reports a failed step in err / step. */
typedef struct spawn_args {
	const char *exe;
	char *const *argv, *const *envp;
	int out_fd, cwd_fd;
	pid_t parent;	  /* our pid before the clone */
	sigset_t mask;	  /* the caller's signal mask, restored for exec */
	int err;	  /* errno of the failed step, 0 when exec ran */
	const char *step; /* which step failed */
} spawn_args;

/* The child of spawn_compiler: its own process group, killed with SIGKILL
 * when the thread that started it dies (PR_SET_PDEATHSIG; if we died
 * before that took effect, getppid() is no longer us and it stops), stdin
 * /dev/null, stdout and stderr the pipe, working directory cwd_fd, umask
 * 077, then exec.  All signals are blocked on entry; our handlers are reset to
 * the default first, so that none runs here once the mask is restored. */
__attribute__((no_sanitize_address)) static int spawn_child(void *p)
{
	spawn_args *a = p;
	for (int sig = 1; sig < NSIG; sig++) {
		struct sigaction sa;
		if (sigaction(sig, NULL, &sa) != 0 ||
		    sa.sa_handler == SIG_IGN || sa.sa_handler == SIG_DFL)
			continue;
		sa.sa_handler = SIG_DFL;
		sa.sa_flags = 0;
		sigemptyset(&sa.sa_mask);
		sigaction(sig, &sa, NULL);
	}
#define CHILD_CHECK(stmt)                                                      \
	do {                                                                   \
		if ((stmt) < 0) {                                              \
			a->err = errno;                                        \
			a->step = #stmt;                                       \
			_exit(127);                                            \
		}                                                              \
	} while (0)
	CHILD_CHECK(setpgid(0, 0));
	CHILD_CHECK(prctl(PR_SET_PDEATHSIG, SIGKILL));
	if (getppid() != a->parent) /* we are gone already */
		_exit(127);
	for (int fd = 1; fd <= 2; fd++) {
		if (a->out_fd == fd) /* keep it open across exec */
			CHILD_CHECK(fcntl(fd, F_SETFD, 0));
		else
			CHILD_CHECK(dup2(a->out_fd, fd));
	}
	int in; /* after the pipe's copies: it may have been descriptor 0 */
	CHILD_CHECK(in = open("/dev/null", O_RDONLY));
	if (in != 0) {
		CHILD_CHECK(dup2(in, 0));
		close(in);
	}
	if (a->cwd_fd >= 0)
		CHILD_CHECK(fchdir(a->cwd_fd));
	/* what it writes is ours alone, whatever the caller's umask (002
	 * would make the module group-writable, and refused); the umask is
	 * the child's own (no CLONE_FS) */
	umask(077);
	CHILD_CHECK(sigprocmask(SIG_SETMASK, &a->mask, NULL));
	execve(a->exe, a->argv, a->envp);
	a->err = errno;
	a->step = "execve(exe, argv, envp)";
	_exit(127);
#undef CHILD_CHECK
}
#endif

/* Starts the compiler exe with argv and envp in a process group of its own,
 * stdin from /dev/null, stdout and stderr to out_fd, in the directory of the
 * descriptor cwd_fd (-1: ours); *pid its pid.  On Linux the compiler is
 * killed with SIGKILL when we die (PR_SET_PDEATHSIG, also for a kill -9):
 * only the process we start is covered, not what it starts in turn (cc1,
 * as, ld finish their step and exit).  It is a clone sharing our memory,
 * like posix_spawn's, so a large multithreaded process is not copied.
 * Returns 0 or an errno value with err_where saying which call failed. */
static int spawn_compiler(const char *exe, char *const *argv, char *const *envp,
			  int out_fd, int cwd_fd, pid_t *pid, char *err_where,
			  size_t err_len)
{
#ifdef __linux__
	enum { STACK = 256 << 10 };
	spawn_args a = { .exe = exe,
			 .argv = argv,
			 .envp = envp,
			 .out_fd = out_fd,
			 .cwd_fd = cwd_fd,
			 .parent = getpid() };
	char *stack = mmap(NULL, STACK, PROT_READ | PROT_WRITE,
			   MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
	if (stack == MAP_FAILED) {
		int err = errno;
		snprintf(err_where, err_len, "mmap(stack) at %s:%d",
			 ej_src_file(__FILE__), __LINE__);
		return err;
	}
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &a.mask);
	int err = 0;
	*pid = clone(spawn_child, stack + STACK,
		     CLONE_VM | CLONE_VFORK | SIGCHLD, &a);
	if (*pid < 0) {
		err = errno;
		snprintf(err_where, err_len,
			 "clone(CLONE_VM | CLONE_VFORK) at %s:%d",
			 ej_src_file(__FILE__), __LINE__);
	} else if (a.err) {
		/* it exited without running the compiler: reap it */
		err = a.err;
		snprintf(err_where, err_len, "%s in the child at %s:%d", a.step,
			 ej_src_file(__FILE__), __LINE__);
		while (waitpid(*pid, NULL, 0) < 0 && errno == EINTR)
			;
	}
	pthread_sigmask(SIG_SETMASK, &a.mask, NULL);
	munmap(stack, STACK);
	return err;
#else
	posix_spawn_file_actions_t fa;
	posix_spawnattr_t sa;
	bool fa_ok = false, sa_ok = false;
	int err = 0;
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
	RUN_CHECK(posix_spawn_file_actions_init(&fa));
	fa_ok = true;
	RUN_CHECK(
	    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0));
	RUN_CHECK(posix_spawn_file_actions_adddup2(&fa, out_fd, 1));
	RUN_CHECK(posix_spawn_file_actions_adddup2(&fa, out_fd, 2));
	if (cwd_fd >= 0) {
#ifdef HAVE_POSIX_SPAWN_FILE_ACTIONS_ADDFCHDIR_NP
		RUN_CHECK(posix_spawn_file_actions_addfchdir_np(&fa, cwd_fd));
#else
		err = ENOSYS;
		WHERE("posix_spawn_file_actions_addfchdir_np (missing)");
		goto out;
#endif
	}
	RUN_CHECK(posix_spawnattr_init(&sa));
	sa_ok = true;
	RUN_CHECK(posix_spawnattr_setflags(&sa, POSIX_SPAWN_SETPGROUP));
	RUN_CHECK(posix_spawnattr_setpgroup(&sa, 0));
	RUN_CHECK(posix_spawn(pid, exe, &fa, &sa, argv, envp));
out:
#undef RUN_CHECK
#undef WHERE
	if (fa_ok)
		posix_spawn_file_actions_destroy(&fa);
	if (sa_ok)
		posix_spawnattr_destroy(&sa);
	return err;
#endif
}

/* Runs argv (found by find_program, no shell), stdin from /dev/null, stdout and
 * stderr into *output (malloc'ed, NUL-terminated), in the directory of the
 * descriptor cwd_fd (-1: ours) with the environment envp (NULL: ours).
 * *wstatus is waitpid's status. Returns 0, or an errno value with err_where
 * saying which call failed (ETIMEDOUT: it ran longer than cc_timeout_s()).
 *
 * The compiler runs in a process group of its own (spawn_compiler; it dies
 * with us).  The run ends when the
 * compiler exits, not when its output reaches end of file: a child it left
 * behind may hold the pipe open for good.  Its group is then killed (what
 * it left, if anything), and the whole group is killed at the timeout. */
static int run_capture(char *const *argv, int cwd_fd, char *const *envp,
		       char **output, int *wstatus, char *err_where,
		       size_t err_len)
{
	int pfd[2] = { -1, -1 };
	size_t len = 0, cap = 4096;
	char *buf = malloc(cap);
	pid_t pid = -1;
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
	RUN_CHECK(fcntl(pfd[0], F_SETFL, O_NONBLOCK) ? errno : 0);
	err = spawn_compiler(exe, argv, envp ? envp : environ, pfd[1], cwd_fd,
			     &pid, err_where, err_len);
	if (err)
		goto out;
	close(pfd[1]);
	pfd[1] = -1;
	const int64_t limit_ms = (int64_t)cc_timeout_s() * 1000;
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	bool eof = false, exited = false;
	for (;;) {
		/* what the pipe holds now */
		while (!eof) {
			if (len + 1 == cap && cap < OUTPUT_MAX + 1) {
				char *nb = realloc(buf, cap * 2);
				if (nb) {
					buf = nb;
					cap *= 2;
				}
			}
			char drain[4096];
			bool full = len + 1 >= cap;
			ssize_t r =
			    full ? read(pfd[0], drain, sizeof drain)
				 : read(pfd[0], buf + len, cap - 1 - len);
			if (r < 0 && errno == EINTR)
				continue;
			if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
				break;
			if (r < 0) {
				if (!err) {
					err = errno;
					WHERE("read(pfd[0], ...)");
				}
				eof = true; /* still wait for the child */
				break;
			}
			if (r == 0)
				eof = true;
			else if (!full)
				len += (size_t)r;
		}
		if (exited)
			break;
		/* exited? (WNOWAIT: the zombie keeps its pid, so the group
		 * id below cannot be anyone else's yet) */
		siginfo_t si;
		memset(&si, 0, sizeof si);
		if (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) <
		    0) {
			if (errno == EINTR)
				continue;
			if (!err) {
				err = errno;
				WHERE("waitid(P_PID, pid, ...)");
			}
			break;
		}
		if (si.si_pid == pid) {
			exited = true; /* one more drain, then stop */
			continue;
		}
		clock_gettime(CLOCK_MONOTONIC, &t);
		int64_t ms = (int64_t)(t.tv_sec - t0.tv_sec) * 1000 +
			     (t.tv_nsec - t0.tv_nsec) / 1000000;
		if (limit_ms > 0 && ms >= limit_ms) {
			kill(-pid, SIGKILL);
			if (!err) {
				err = ETIMEDOUT;
				snprintf(err_where, err_len,
					 "the compiler ran longer than %d s "
					 "(EPJIT_CC_TIMEOUT); its process "
					 "group was killed",
					 cc_timeout_s());
			}
			break;
		}
		struct pollfd pf = { .fd = pfd[0], .events = POLLIN };
		if (eof)
			nanosleep(&(struct timespec){ 0, 10000000 }, NULL);
		else
			poll(&pf, 1, 100);
	}
	/* what the compiler left behind (a child holding the pipe) goes with
	 * its group; then the compiler is reaped */
	kill(-pid, SIGKILL);
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

/* ---- private directories --------------------------------------------------
 */

/* Depth of directories below a stale one that are emptied (the compiler
 * makes none; anything deeper stays, and so does the directory). */
#define STALE_DIR_DEPTH 16

/* The private directories that a process of this host removes for a dead
 * one (ej_privdir_sweep): the build directories of the host compilers, the
 * load directories where memfd_create is missing, and the kernel cache's
 * own directory of a process whose cache was refused (kcache.c). */
static const char *const swept_prefixes[] = { "epjit-cc", "epjit-so",
					      EJ_KCACHE_PRIVATE_PREFIX };

/* Empties the directory of the descriptor dfd (closed here) without ever
 * following a symbolic link: every entry is unlinked through dfd (a link
 * itself, not what it names), a subdirectory opened through dfd with
 * O_DIRECTORY | O_NOFOLLOW, emptied first and removed.  True when all went. */
static bool empty_dir_fd(int dfd, int depth)
{
	DIR *d = fdopendir(dfd);
	if (!d) {
		close(dfd);
		return false;
	}
	bool ok = true;
	struct dirent *de;
	while ((de = readdir(d))) {
		const char *nm = de->d_name;
		if (!strcmp(nm, ".") || !strcmp(nm, ".."))
			continue;
		struct stat st;
		if (fstatat(dirfd(d), nm, &st, AT_SYMLINK_NOFOLLOW) != 0) {
			ok = false;
			continue;
		}
		if (!S_ISDIR(st.st_mode)) {
			ok &= unlinkat(dirfd(d), nm, 0) == 0;
			continue;
		}
		int sub = depth > 0 ? openat(dirfd(d), nm,
					     O_RDONLY | O_DIRECTORY |
						 O_NOFOLLOW | O_CLOEXEC)
				    : -1;
		ok &= sub >= 0 && empty_dir_fd(sub, depth - 1) &&
		      unlinkat(dirfd(d), nm, AT_REMOVEDIR) == 0;
	}
	closedir(d);
	return ok;
}

/* The prefix of swept_prefixes that nm starts with, followed by '-' (NULL
 * for none); *owner is set to what follows the '-'. */
static const char *swept_prefix(const char *nm, const char **owner)
{
	for (size_t i = 0; i < sizeof swept_prefixes / sizeof swept_prefixes[0];
	     i++) {
		size_t pl = strlen(swept_prefixes[i]);
		if (!strncmp(nm, swept_prefixes[i], pl) && nm[pl] == '-') {
			*owner = nm + pl + 1;
			return swept_prefixes[i];
		}
	}
	return NULL;
}

/* Opens dir/nm, a stale-directory candidate: a real directory (lstat, then
 * opened with O_NOFOLLOW and checked to be the same inode) owned by us,
 * whose lock nobody holds (flock LOCK_EX | LOCK_NB: the process that made
 * it holds the lock as long as it lives, in any pid namespace).  The
 * descriptor, holding the lock, or -1. */
static int open_unlocked_dir(int dir, const char *nm)
{
	struct stat st, by_fd;
	if (fstatat(dir, nm, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
	    !S_ISDIR(st.st_mode) || st.st_uid != geteuid())
		return -1;
	int fd =
	    openat(dir, nm, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return -1;
	if (fstat(fd, &by_fd) != 0 || by_fd.st_dev != st.st_dev ||
	    by_fd.st_ino != st.st_ino || by_fd.st_uid != geteuid() ||
	    flock(fd, LOCK_EX | LOCK_NB) != 0) {
		close(fd);
		return -1;
	}
	return fd;
}

/* Removes the private directories <TMPDIR>/<prefix>-<pid>.<host>-XXXXXX
 * (every prefix of swept_prefixes) that a process of this host left when it
 * died (kill -9): a real directory owned by us whose pid is no longer alive
 * (ej_tmp_is_dead: kill(pid, 0) fails with ESRCH; another host's pid is
 * never judged) and whose lock is free (open_unlocked_dir: a live owner,
 * even one in another pid namespace, holds it; a directory made this
 * instant and not locked yet is removed, and its maker, which checks the
 * path after taking the lock, tries another name).  Kept directories of
 * failed compiles are named <prefix>-kept-... and stay.  Best effort: what
 * cannot be removed stays; one info line per directory removed. */
void ej_privdir_sweep(void)
{
	DIR *d = opendir(ej_tmpdir());
	if (!d)
		return;
	struct dirent *de;
	while ((de = readdir(d))) {
		const char *nm = de->d_name, *owner = NULL;
		const char *prefix = swept_prefix(nm, &owner);
		if (!prefix)
			continue;
		/* "<pid>.<host>" between the prefix and "-XXXXXX" */
		const char *dash = strrchr(owner, '-');
		char who[64];
		if (!dash || strlen(dash) != 7 ||
		    (size_t)(dash - owner) >= sizeof who)
			continue;
		memcpy(who, owner, (size_t)(dash - owner));
		who[dash - owner] = '\0';
		if (!ej_tmp_is_dead(who))
			continue;
		int fd = open_unlocked_dir(dirfd(d), nm);
		if (fd < 0)
			continue;
		/* the lock goes with the last descriptor: empty_dir_fd
		 * closes a duplicate */
		int dup_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
		if (dup_fd >= 0 && empty_dir_fd(dup_fd, STALE_DIR_DEPTH) &&
		    unlinkat(dirfd(d), nm, AT_REMOVEDIR) == 0)
			epj_log_msg(EPJ_LOG_INFO,
				    "removed %s/%s, the private directory of "
				    "process %.*s that is gone",
				    ej_tmpdir(), nm, (int)strcspn(who, "."),
				    who);
		close(fd);
	}
	closedir(d);
}

/* The mode a module file may have: no write permission for group or others
 * (the bits of a compiler's output under any sane umask). */
#define FOREIGN_WRITE (S_IWGRP | S_IWOTH)

/* Makes <TMPDIR>/<prefix>-<pid>.<host>-XXXXXX with mkdtemp, opens it and
 * locks it (flock LOCK_EX, held while the descriptor is open: the sign
 * that its owner lives, for ej_privdir_sweep); through the descriptor it
 * must be a directory owned by geteuid() with no permission bits for group
 * or others, and the path must name that same inode (nobody swapped it, or
 * swept it before it was locked, between mkdtemp and the lock).  On
 * success d->fd >= 0 and d->path is set; on failure d->fd is -1, nothing is
 * left behind and ctx has the reason. */
static epj_status privdir_make_once(epj_ctx *ctx, const char *prefix,
				    ej_privdir *d, bool *made)
{
	epj_status st = EPJ_OK;
	struct stat by_fd, by_path;
	d->fd = -1;
	/* the pid and host name who made it, for ej_privdir_sweep */
	int stem =
	    snprintf(d->path, sizeof d->path, "%s/%s-", ej_tmpdir(), prefix);
	snprintf(d->path + stem, sizeof d->path - (size_t)stem, "%ld.%s-XXXXXX",
		 (long)getpid(), ej_host_tag());
	d->stem = (size_t)stem;
	SYS_CHECK(ctx, mkdtemp(d->path), == NULL, "making a private directory");
	*made = true;
	d->fd = open(d->path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (d->fd < 0) {
		st = sys_fail(ctx, d->path, "open(dir, O_DIRECTORY|O_NOFOLLOW)",
			      __FILE__, __LINE__, errno);
		rmdir(d->path);
		goto out;
	}
	if (flock(d->fd, LOCK_EX | LOCK_NB) != 0) {
		st = sys_fail(ctx, d->path, "flock(dir, LOCK_EX|LOCK_NB)",
			      __FILE__, __LINE__, errno);
		goto out;
	}
	SYS_CHECK(ctx, fstat(d->fd, &by_fd), != 0, d->path);
	SYS_CHECK(ctx, lstat(d->path, &by_path), != 0, d->path);
	if (!S_ISDIR(by_fd.st_mode) || by_fd.st_uid != geteuid() ||
	    (by_fd.st_mode & 077) != 0 || by_fd.st_dev != by_path.st_dev ||
	    by_fd.st_ino != by_path.st_ino) {
		st = ej_error(ctx, EPJ_ERR_STATE,
			      "host cc: private directory %s is not private "
			      "after mkdtemp (owner uid %u, mode %04o, %s); "
			      "refusing to build code in it (is %s writable "
			      "by others?)",
			      d->path, (unsigned)by_fd.st_uid,
			      (unsigned)(by_fd.st_mode & 07777),
			      by_fd.st_ino == by_path.st_ino
				  ? "same inode"
				  : "the path now names another inode",
			      ej_tmpdir());
		close(d->fd);
		d->fd = -1;
		goto out;
	}
out:
	if (st != EPJ_OK && d->fd >= 0) {
		close(d->fd);
		d->fd = -1;
	}
	return st;
}

/* privdir_make_once, tried again with a fresh name when the directory was
 * made but did not check out (another user renamed or swapped it between
 * mkdtemp and open: that attempt is refused, the next one usually wins the
 * race); the last error after 8 attempts. */
epj_status ej_privdir_make(epj_ctx *ctx, const char *prefix, ej_privdir *d)
{
	epj_status st = EPJ_OK;
	ej_privdir_sweep();
	for (int i = 0; i < 8; i++) {
		bool made = false;
		st = privdir_make_once(ctx, prefix, d, &made);
		if (st == EPJ_OK || !made)
			break;
		epj_log_msg(EPJ_LOG_WARN, "%s; trying another name",
			    epj_ctx_error(ctx));
	}
	return st;
}

/* Renames d, kept for the user (the source of a failed compile), to
 * <prefix>-kept-<pid>.<host>-XXXXXX, a name ej_privdir_sweep leaves alone
 * (RENAME_NOREPLACE: when that name is taken, or the path no longer names
 * the directory of the descriptor, it keeps its name). */
static void privdir_keep(ej_privdir *d)
{
#ifdef RENAME_NOREPLACE
	char kept[sizeof d->path];
	struct stat a, b;
	if (d->fd < 0 || d->stem == 0 ||
	    snprintf(kept, sizeof kept, "%.*skept-%s", (int)d->stem, d->path,
		     d->path + d->stem) >= (int)sizeof kept ||
	    fstat(d->fd, &a) != 0 || lstat(d->path, &b) != 0 ||
	    a.st_dev != b.st_dev || a.st_ino != b.st_ino ||
	    renameat2(AT_FDCWD, d->path, AT_FDCWD, kept, RENAME_NOREPLACE) != 0)
		return;
	memcpy(d->path, kept, sizeof kept);
#else
	(void)d;
#endif
}

/* Removes name (may be NULL) from d, then d itself while its path still
 * names the directory of the descriptor; closes the descriptor. */
static void privdir_remove(ej_privdir *d, const char *const *names, int n,
			   bool keep_dir)
{
	if (d->fd < 0)
		return;
	for (int i = 0; i < n; i++)
		if (names[i])
			unlinkat(d->fd, names[i], 0);
	struct stat a, b;
	if (!keep_dir && fstat(d->fd, &a) == 0 && lstat(d->path, &b) == 0 &&
	    a.st_dev == b.st_dev && a.st_ino == b.st_ino && rmdir(d->path) != 0)
		epj_log_msg(
		    EPJ_LOG_WARN, "host cc: rmdir(dir) failed at %s:%d: %s: %s",
		    ej_src_file(__FILE__), __LINE__, d->path, strerror(errno));
	close(d->fd);
	d->fd = -1;
}

bool ej_privdir_remove_all(ej_privdir *d)
{
	if (d->fd < 0)
		return true;
	struct stat a, b;
	int dup_fd = fcntl(d->fd, F_DUPFD_CLOEXEC, 0);
	bool ok = dup_fd >= 0 && empty_dir_fd(dup_fd, STALE_DIR_DEPTH) &&
		  fstat(d->fd, &a) == 0 && lstat(d->path, &b) == 0 &&
		  a.st_dev == b.st_dev && a.st_ino == b.st_ino &&
		  rmdir(d->path) == 0;
	close(d->fd);
	d->fd = -1;
	return ok;
}

/* Checks an open module file: a regular file, owned by us, not writable by
 * group or others, one link.  EPJ_ERR_STATE naming `what` otherwise. */
static epj_status check_module_fd(epj_ctx *ctx, int fd, const char *what,
				  struct stat *sb)
{
	if (fstat(fd, sb) != 0)
		return sys_fail(ctx, what, "fstat(fd)", __FILE__, __LINE__,
				errno);
	if (!S_ISREG(sb->st_mode) || sb->st_uid != geteuid() ||
	    (sb->st_mode & FOREIGN_WRITE) || sb->st_nlink != 1)
		return ej_error(
		    ctx, EPJ_ERR_STATE,
		    "host cc: refusing module %s: %s (owner uid %u, mode "
		    "%04o, %u links); a module must be a regular file of "
		    "yours (uid %u) that only you can write (check the umask)",
		    what, S_ISREG(sb->st_mode) ? "not trusted" : "not a file",
		    (unsigned)sb->st_uid, (unsigned)(sb->st_mode & 07777),
		    (unsigned)sb->st_nlink, (unsigned)geteuid());
	return EPJ_OK;
}

/* Reads the whole (checked) file of fd into malloc'ed memory. */
static epj_status read_fd(epj_ctx *ctx, int fd, const char *path,
			  const struct stat *sb, void **data, size_t *size)
{
	epj_status st = EPJ_OK;
	char *buf = malloc(sb->st_size > 0 ? (size_t)sb->st_size : 1);
	if (!buf)
		return ej_error(ctx, EPJ_ERR_NOMEM, "host cc: %s: %lld bytes",
				path, (long long)sb->st_size);
	size_t got = 0;
	while (got < (size_t)sb->st_size) {
		ssize_t r;
		SYS_CHECK(ctx,
			  r = read(fd, buf + got, (size_t)sb->st_size - got),
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
	free(buf);
	return st;
}

/* Our environment with TMPDIR replaced by "." (the compiler's temporaries
 * go to its working directory, the private one).  NULL when out of memory;
 * free with free() (the strings are environ's, except the one literal). */
static char **env_with_private_tmpdir(void)
{
	size_t n = 0;
	while (environ && environ[n])
		n++;
	char **e = malloc((n + 2) * sizeof *e);
	if (!e)
		return NULL;
	size_t k = 0;
	for (size_t i = 0; i < n; i++)
		if (strncmp(environ[i], "TMPDIR=", 7) != 0)
			e[k++] = environ[i];
	e[k++] = (char *)"TMPDIR=.";
	e[k] = NULL;
	return e;
}

/* ---- the OpenMP runtime -----------------------------------------------------
 */

static pthread_once_t omp_once = PTHREAD_ONCE_INIT;
static char omp_path[PATH_MAX];

static void find_omp_runtime(void)
{
#ifdef _OPENMP
	int (*fn)(void) = omp_get_max_threads;
	void *addr;
	memcpy(&addr, &fn, sizeof addr);
	Dl_info info;
	if (dladdr(addr, &info) && info.dli_fname && info.dli_fname[0] == '/' &&
	    strstr(info.dli_fname, "omp"))
		snprintf(omp_path, sizeof omp_path, "%s", info.dli_fname);
#endif
}

const char *ej_hostcc_openmp_runtime(void)
{
	pthread_once(&omp_once, find_omp_runtime);
	return omp_path[0] ? omp_path : NULL;
}

void ej_hostcc_set_openmp_runtime(const char *path)
{
	pthread_once(&omp_once, find_omp_runtime);
	snprintf(omp_path, sizeof omp_path, "%s", path);
}

/* ---- instruction set of generated C --------------------------------------
 */

static const char *const isa_names[] = { "baseline", "x86-64-v2", "x86-64-v3",
					 "x86-64-v4", "native" };
enum { ISA_BASE, ISA_V2, ISA_V3, ISA_V4, ISA_NATIVE, ISA_N };

/* Whether this CPU runs code of level `isa` (x86-64 levels as gcc and
 * clang define them; elsewhere only baseline and native exist). */
static bool isa_runs(int isa)
{
	if (isa == ISA_BASE || isa == ISA_NATIVE)
		return true;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
	__builtin_cpu_init();
	bool v2 = __builtin_cpu_supports("sse4.2") &&
		  __builtin_cpu_supports("popcnt") &&
		  __builtin_cpu_supports("ssse3");
	bool v3 = v2 && __builtin_cpu_supports("avx2") &&
		  __builtin_cpu_supports("fma") &&
		  __builtin_cpu_supports("bmi2");
	bool v4 = v3 && __builtin_cpu_supports("avx512f") &&
		  __builtin_cpu_supports("avx512bw") &&
		  __builtin_cpu_supports("avx512vl") &&
		  __builtin_cpu_supports("avx512dq");
	return isa == ISA_V2 ? v2 : isa == ISA_V3 ? v3 : v4;
#else
	return false;
#endif
}

/* The level EPJIT_CC_ISA selects: unset or "auto" = the highest x86-64
 * level this CPU runs (baseline elsewhere); -1 for a value that is not a
 * level, or one this CPU cannot run. */
static int isa_selected(void)
{
	const char *v = getenv("EPJIT_CC_ISA");
	if (!v || !*v || strcmp(v, "auto") == 0) {
		for (int i = ISA_V4; i > ISA_BASE; i--)
			if (isa_runs(i))
				return i;
		return ISA_BASE;
	}
	for (int i = 0; i < ISA_N; i++)
		if (strcmp(v, isa_names[i]) == 0)
			return isa_runs(i) ? i : -1;
	return -1;
}

const char *ej_hostcc_isa(void)
{
	int i = isa_selected();
	return i < 0 ? NULL : isa_names[i];
}

epj_status ej_hostcc_isa_check(epj_ctx *ctx)
{
	if (isa_selected() >= 0)
		return EPJ_OK;
	const char *v = getenv("EPJIT_CC_ISA");
	for (int i = 0; i < ISA_N; i++)
		if (strcmp(v, isa_names[i]) == 0)
			return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
					"EPJIT_CC_ISA=%s: this CPU cannot run "
					"code built for it",
					v);
	return ej_error(ctx, EPJ_ERR_INVALID,
			"EPJIT_CC_ISA=\"%s\" is not an instruction set (auto, "
			"baseline, x86-64-v2, x86-64-v3, x86-64-v4, native)",
			v);
}

/* Every combination of OpenMP and level, made once (the strings live for
 * the process). */
static char cflags_tab[2][ISA_N][128];
static pthread_once_t cflags_once = PTHREAD_ONCE_INIT;

/* What -march=native means on this CPU, as a hash: the first processor's
 * vendor, model and feature lines of /proc/cpuinfo (0 when unreadable).
 * The flags carry it (-DEJ_NATIVE_CPU=...), so that the cache key of a
 * module built for "native" differs between CPUs that differ, and a cache
 * shared by nodes never hands one node's AVX-512 code to another. */
static uint64_t native_cpu_hash(void)
{
	FILE *f = fopen("/proc/cpuinfo", "r");
	if (!f)
		return 0;
	char line[8192], *acc = NULL;
	size_t n = 0;
	static const char *const keys[] = { "vendor_id",       "model name",
					    "cpu family",      "model",
					    "flags",	       "Features",
					    "CPU implementer", "CPU part" };
	while (fgets(line, sizeof line, f)) {
		if (line[0] == '\n')
			break; /* the first processor only */
		for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
			size_t kl = strlen(keys[k]);
			if (strncmp(line, keys[k], kl) != 0 ||
			    (line[kl] != ' ' && line[kl] != '\t' &&
			     line[kl] != ':'))
				continue;
			size_t l = strlen(line);
			char *a = realloc(acc, n + l + 1);
			if (!a)
				break;
			acc = a;
			memcpy(acc + n, line, l + 1);
			n += l;
		}
	}
	fclose(f);
	uint64_t h = acc ? epj_hash(acc, n).lo : 0;
	free(acc);
	return h;
}

static void cflags_init(void)
{
	for (int omp = 0; omp < 2; omp++)
		for (int i = 0; i < ISA_N; i++) {
			char march[64] = "";
			if (i == ISA_NATIVE)
				snprintf(march, sizeof march,
					 " -march=native "
					 "-DEJ_NATIVE_CPU=0x%016llx",
					 (unsigned long long)native_cpu_hash());
			else if (i != ISA_BASE)
				snprintf(march, sizeof march, " -march=%s",
					 isa_names[i]);
			snprintf(cflags_tab[omp][i], sizeof cflags_tab[omp][i],
				 "%s%s%s", EJ_HOSTCC_FLAGS, march,
				 omp ? " -fopenmp" : "");
		}
}

const char *ej_hostcc_cflags(void)
{
	pthread_once(&cflags_once, cflags_init);
	int i = isa_selected();
	return cflags_tab[ej_hostcc_openmp_runtime() != NULL]
			 [i < 0 ? ISA_BASE : i];
}

/* ---- one compiler step ----------------------------------------------------
 */

/* A step that ran and failed (the source is kept); never returned to
 * callers of ej_hostcc_compile. */
#define EJ_STEP_FAILED ((epj_status)-1)

/* Runs `$EPJIT_CC <flags> <args...>` in the private directory (empty args
 * are left out) and appends its output to *log.  EPJ_ERR_COMPILE when the
 * compiler cannot be run; EJ_STEP_FAILED (message set: what, exit status,
 * command, output) when it ran and failed. */
static epj_status cc_step(epj_ctx *ctx, ej_privdir *dir, char **envp,
			  const char *safe, const char *what, const char *flags,
			  const char *const *args, int n_args, char **log)
{
	char *words = NULL, *fl = NULL, *output = NULL, *argv[ARGV_MAX];
	const char *cc;
	epj_status st = EPJ_OK;
	int n = cc_words(&words, argv, ARGV_MAX - 24, &cc);
	if (n >= 1)
		n = add_words(&fl, flags, argv, n, ARGV_MAX - 16);
	if (n < 1) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "host cc: out of memory");
		goto out;
	}
	for (int i = 0; i < n_args && n < ARGV_MAX - 1; i++)
		if (args[i][0])
			argv[n++] = (char *)args[i];
	argv[n] = NULL;
	char where[160], cmd[1024], how[64];
	int ws = 0;
	join_argv(argv, cmd, sizeof cmd);
	int err =
	    run_capture(argv, dir->fd, envp, &output, &ws, where, sizeof where);
	if (err == ETIMEDOUT) {
		st = ej_error(ctx, EPJ_ERR_COMPILE,
			      "host cc: %s '%s' with the %s compiler '%s' "
			      "(%s=%s): %s; command (in %s): %s",
			      what, safe, cur_lang->what, argv[0],
			      cur_lang->env, cc, where, dir->path, cmd);
		goto out;
	}
	if (err) {
		st = ej_error(ctx, EPJ_ERR_COMPILE,
			      "host cc: %s '%s': cannot run the %s compiler "
			      "'%s' (%s=%s): %s failed: %s",
			      what, safe, cur_lang->what, argv[0],
			      cur_lang->env, cc, where, strerror(err));
		goto out;
	}
	if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
		describe_wait(ws, how, sizeof how);
		privdir_keep(dir); /* the source stays there */
		ej_error(ctx, EPJ_ERR_COMPILE,
			 "host cc: %s '%s' failed (%s; %s=%s); source "
			 "kept at %s/%s.%s; command (in %s): %s; output:\n%s",
			 what, safe, how, cur_lang->env, cc, dir->path, safe,
			 cur_lang->ext, dir->path, cmd,
			 output[0] ? output : "(none)\n");
		st = EJ_STEP_FAILED;
	}
out:
	if (output && *output) {
		size_t a = *log ? strlen(*log) : 0, b = strlen(output);
		char *j = realloc(*log, a + b + 1);
		if (j) {
			memcpy(j + a, output, b + 1);
			*log = j;
		}
	} else if (!*log) {
		*log = strdup("");
	}
	free(output);
	free(words);
	free(fl);
	return st;
}

/* ---- compiling ------------------------------------------------------------
 */

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

/* The compile and link flags of the current language (+ extra). */
static char *lang_flags(bool link, const char *extra)
{
	const char *base = cur_lang == &lang_c
			       ? (link ? "-shared" : ej_hostcc_cflags())
			       : (link ? "-shared" : EJ_HOSTCXX_FLAGS);
	char *f = NULL;
	if (asprintf(&f, "%s%s%s", base, extra && *extra ? " " : "",
		     extra ? extra : "") < 0)
		f = NULL;
	return f;
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
	if (cur_lang == &lang_c && ej_hostcc_isa_check(ctx) != EPJ_OK)
		return epj_ctx_status(ctx);
	epj_status st = EPJ_OK;
	char safe[64], src[80], obj[80], so[80], so_path[PATH_MAX + 80];
	char *output = NULL;
	char **envp = NULL;
	bool keep_source = false;
	ej_privdir dir = { .fd = -1 };
	ej_safe_name(name, safe, sizeof safe);
	snprintf(src, sizeof src, "%s.%s", safe, cur_lang->ext);
	snprintf(obj, sizeof obj, "%s.o", safe);
	snprintf(so, sizeof so, "%s.so", safe);

	st = ej_privdir_make(ctx, "epjit-cc", &dir);
	if (st != EPJ_OK)
		goto out;
	snprintf(so_path, sizeof so_path, "%s/%s", dir.path, so);
	int fd =
	    openat(dir.fd, src,
		   O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
	int err = fd < 0 ? errno : write_all(fd, source, strlen(source));
	if (fd >= 0 && close(fd) != 0 && !err)
		err = errno;
	if (err) {
		st = sys_fail(ctx, dir.path, "openat/write(src, source, n)",
			      __FILE__, __LINE__, err);
		goto out;
	}

	envp = env_with_private_tmpdir();
	if (!envp) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "host cc: out of memory");
		goto out;
	}
	/* Compile, then link against the library's own OpenMP runtime (or
	 * none): never a second runtime in the process. */
	const char *rt =
	    cur_lang == &lang_c ? ej_hostcc_openmp_runtime() : NULL;
	const char *libs =
	    cur_lang == &lang_c ? EJ_HOSTCC_LIBS : EJ_HOSTCXX_LIBS;
	char *cflags = lang_flags(false, extra),
	     *lflags = lang_flags(true, extra);
	if (!cflags || !lflags) {
		free(cflags);
		free(lflags);
		st = ej_error(ctx, EPJ_ERR_NOMEM, "host cc: out of memory");
		goto out;
	}
	const char *c_args[] = { "-c", "-o", obj, src };
	st = cc_step(ctx, &dir, envp, safe, "compiling", cflags, c_args, 4,
		     &output);
	if (st == EPJ_OK) {
		const char *l_args[] = { "-o", so, obj, rt ? rt : "", libs };
		st = cc_step(ctx, &dir, envp, safe, "linking", lflags, l_args,
			     5, &output);
	}
	free(cflags);
	free(lflags);
	if (st == EJ_STEP_FAILED) {
		keep_source = true;
		st = EPJ_ERR_COMPILE;
	}
	if (st != EPJ_OK)
		goto out;
	/* The module: opened once, checked and read through one descriptor. */
	struct stat sb;
	fd = openat(dir.fd, so, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0) {
		st = sys_fail(ctx, so_path, "openat(dir, so, O_NOFOLLOW)",
			      __FILE__, __LINE__, errno);
	} else {
		st = check_module_fd(ctx, fd, so_path, &sb);
		if (st == EPJ_OK)
			st = read_fd(ctx, fd, so_path, &sb, so_image, so_size);
		close(fd);
	}
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "host cc: reading back what '%s' built",
				so);

out:;
	/* Only files this function named can be there (and the compiler's
	 * temporaries, which it removes itself); a compiler that leaves
	 * others makes rmdir fail, which is logged. */
	const char *names[] = { so, obj, keep_source ? NULL : src };
	privdir_remove(&dir, names, 3, keep_source);
	free(envp);
	if (log)
		*log = output ? output : strdup("");
	else
		free(output);
	return st;
}

/* ---- loading ----------------------------------------------------------- */

/* A loaded module: the dlopen handle and the descriptor it was loaded
 * from, kept open while the handle lives (see the file comment). */
typedef struct hostcc_module {
	void *dl;
	int fd;
} hostcc_module;

/* A descriptor holding size bytes of so_image that nobody else can change:
 * a sealed memfd, or an unlinked file of a checked private directory. */
static epj_status image_fd(epj_ctx *ctx, const void *so_image, size_t size,
			   const char *safe, int *out)
{
	epj_status st = EPJ_OK;
	int fd = -1, err;
	*out = -1;
#ifdef HAVE_MEMFD_CREATE
	char nm[96];
	snprintf(nm, sizeof nm, "epjit-%s", safe);
	fd = memfd_create(nm, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd >= 0) {
		err = write_all(fd, so_image, size);
		if (!err && fcntl(fd, F_ADD_SEALS,
				  F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE |
				      F_SEAL_SEAL) != 0)
			err = errno;
		if (err) {
			close(fd);
			return sys_fail(ctx, "memfd", "write/seal(memfd)",
					__FILE__, __LINE__, err);
		}
		*out = fd;
		return EPJ_OK;
	}
	if (errno != ENOSYS)
		return sys_fail(ctx, "a module file", "memfd_create(name)",
				__FILE__, __LINE__, errno);
#endif
	ej_privdir dir = { .fd = -1 };
	char path[PATH_MAX + 80];
	st = ej_privdir_make(ctx, "epjit-so", &dir);
	if (st != EPJ_OK)
		return st;
	snprintf(path, sizeof path, "%s/m.so", dir.path);
	fd = openat(dir.fd, "m.so",
		    O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0500);
	err = fd < 0 ? errno : write_all(fd, so_image, size);
	struct stat sb;
	if (err)
		st = sys_fail(ctx, path, "openat/write(m.so)", __FILE__,
			      __LINE__, err);
	else
		st = check_module_fd(ctx, fd, path, &sb);
	const char *names[] = { "m.so" };
	privdir_remove(&dir, names, 1, false);
	if (st != EPJ_OK) {
		if (fd >= 0)
			close(fd);
		return st;
	}
	*out = fd;
	return EPJ_OK;
}

epj_status ej_hostcc_load(epj_ctx *ctx, const void *so_image, size_t size,
			  const char *name, void **handle)
{
	EJ_ASSERT(handle);
	*handle = NULL;
	if (!so_image || size == 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"host cc: loading '%s': empty image",
				name ? name : "(null)");
	char safe[64], path[64];
	ej_safe_name(name, safe, sizeof safe);
	hostcc_module *m = calloc(1, sizeof *m);
	if (!m)
		return ej_error(ctx, EPJ_ERR_NOMEM, "host cc: out of memory");
	epj_status st = image_fd(ctx, so_image, size, safe, &m->fd);
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "host cc: loading '%s'", safe);
		free(m);
		return st;
	}
	snprintf(path, sizeof path, "/proc/self/fd/%d", m->fd);
	char where[PATH_MAX + 160];
	const char *dl_err;
	EJ_DL_CALL(m->dl, dlopen(path, RTLD_NOW | RTLD_LOCAL), where, dl_err);
	if (!m->dl) {
		st =
		    ej_error(ctx, EPJ_ERR_BACKEND,
			     "host cc: loading '%s' (%zu bytes): %s failed: %s",
			     safe, size, where, dl_err);
		close(m->fd);
		free(m);
		return st;
	}
	*handle = m;
	return EPJ_OK;
}

void *ej_hostcc_sym(void *handle, const char *sym)
{
	hostcc_module *m = handle;
	return m && sym ? dlsym(m->dl, sym) : NULL;
}

void ej_hostcc_unload(void *handle)
{
	hostcc_module *m = handle;
	if (!m)
		return;
	if (dlclose(m->dl) != 0)
		epj_log_msg(EPJ_LOG_WARN, "host cc: dlclose failed: %s",
			    dlerror());
	/* An object that stays resident (dlclose need not unmap) keeps its
	 * descriptor, so that its name is never reused for another one. */
	char path[64];
	snprintf(path, sizeof path, "/proc/self/fd/%d", m->fd);
	void *still = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
	if (still)
		dlclose(still);
	else
		close(m->fd);
	free(m);
}

/* The cuda-sim device (lib/device_sim.c) loads its modules with these:
 * registered at library load, as eager_cuda.c installs its table. */
static const ej_so_loader sim_loader = {
	.load = ej_hostcc_load,
	.sym = ej_hostcc_sym,
	.unload = ej_hostcc_unload,
};

__attribute__((constructor)) static void sim_loader_register(void)
{
	ej_device_sim_set_loader(&sim_loader);
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
	int err =
	    run_capture(argv, -1, NULL, &output, &ws, where, sizeof where);
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
	if (cur_lang == &lang_c) {
		const char *rt = ej_hostcc_openmp_runtime();
		if (asprintf(&id, "%s | %s | %s | -shared %s%s%s", cc, version,
			     ej_hostcc_cflags(), rt ? rt : "", rt ? " " : "",
			     EJ_HOSTCC_LIBS) < 0)
			id = NULL;
	} else if (asprintf(&id, "%s | %s | %s | -shared %s", cc, version,
			    EJ_HOSTCXX_FLAGS, EJ_HOSTCXX_LIBS) < 0) {
		id = NULL;
	}
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

/* One computed identity per distinct value of the language's variable. */
static const char *identity_of(cc_ident **list)
{
	const char *env = getenv(cur_lang->env);
	/* the C identity holds the flags, which follow EPJIT_CC_ISA */
	char key[PATH_MAX + 128];
	snprintf(key, sizeof key, "%s\x1f%s", env ? env : "",
		 cur_lang == &lang_c ? ej_hostcc_cflags() : "");
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
