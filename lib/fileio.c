/* fileio.c -- atomic file writes shared by safetensors, token files and
 * the kernel cache's users.
 *
 * Protocol: write to "<path>.tmp.<pid>.<host>" (O_NOFOLLOW), fflush, fsync,
 * rename over path, fsync the directory.  Any failure before the rename
 * removes the temporary file and leaves `path` exactly as it was.  A process
 * killed meanwhile leaves its temporary file: the next write of the same
 * path, or of any name path starts (ej_sweep_tmp; a checkpoint load too),
 * removes ours of dead processes of this host (and those of the older
 * "<path>.tmp.<pid>" form whose process is gone, when an hour old).
 */
#include "core_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

const char *ej_host_tag(void)
{
	static char tag[9];
	static atomic_int done;
	if (!atomic_load(&done)) {
		char h[256] = "", hex[33];
		if (gethostname(h, sizeof h - 1) != 0)
			h[0] = '\0';
		epj_hash_hex(epj_hash(h, strlen(h)), hex);
		memcpy(tag, hex, 8);
		tag[8] = '\0';
		atomic_store(&done, 1);
	}
	return tag;
}

FILE *ej_fopen_regular(const char *path, const char **why)
{
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0) {
		*why = strerror(errno);
		return NULL;
	}
	struct stat st;
	if (fstat(fd, &st) != 0) {
		*why = strerror(errno);
		close(fd);
		return NULL;
	}
	if (!S_ISREG(st.st_mode)) {
		*why = S_ISFIFO(st.st_mode) ? "not a regular file (a FIFO)"
		       : S_ISDIR(st.st_mode)
			   ? "not a regular file (a directory)"
		       : S_ISSOCK(st.st_mode) ? "not a regular file (a socket)"
					      : "not a regular file (a device)";
		close(fd);
		return NULL;
	}
	int fl = fcntl(fd, F_GETFL);
	FILE *fp = NULL;
	if (fl >= 0 && fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) == 0)
		fp = fdopen(fd, "rb");
	if (!fp) {
		*why = strerror(errno);
		close(fd);
	}
	return fp;
}

/* pid of "<pid>[.<n>...]" (0 when malformed) and *rest after the digits. */
static long tmp_pid(const char *s, const char **rest)
{
	char *end;
	errno = 0;
	long pid = strtol(s, &end, 10);
	*rest = end;
	return errno || end == s || pid <= 0 || *s < '0' || *s > '9' ? 0 : pid;
}

static bool pid_dead(long pid)
{
	return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

bool ej_tmp_is_dead(const char *after)
{
	const char *rest;
	long pid = tmp_pid(after, &rest);
	if (!pid || *rest != '.')
		return false;
	const char *host = strrchr(rest, '.');
	if (strcmp(host + 1, ej_host_tag()) != 0)
		return false;
	return pid_dead(pid);
}

bool ej_path_split(const char *path, ej_path_parts *out)
{
	out->buf = strdup(path);
	if (!out->buf)
		return false;
	char *slash = strrchr(out->buf, '/');
	out->dir = ".";
	out->base = path;
	if (slash) {
		*slash = '\0';
		out->dir = slash == out->buf ? "/" : out->buf;
		out->base = path + (slash - out->buf) + 1;
	}
	return true;
}

void ej_sweep_tmp(const char *path)
{
	ej_path_parts pp;
	if (!ej_path_split(path, &pp))
		return;
	const char *d = pp.dir, *base = pp.base;
	size_t bl = strlen(base);
	DIR *dp = opendir(d);
	struct dirent *de;
	time_t now = time(NULL);
	while (dp && (de = readdir(dp))) {
		const char *nm = de->d_name;
		if (strncmp(nm, base, bl) != 0)
			continue;
		/* "<base>[<suffix>].tmp.<pid>.<nonce>.<host>" */
		const char *t = strstr(nm + bl, ".tmp."), *next;
		while (t && (next = strstr(t + 1, ".tmp.")))
			t = next;
		if (!t)
			continue;
		const char *after = t + 5, *rest;
		long pid = tmp_pid(after, &rest);
		struct stat st;
		char p[4096];
		if (snprintf(p, sizeof p, "%s/%s", d, nm) >= (int)sizeof p ||
		    lstat(p, &st) != 0 || !S_ISREG(st.st_mode) ||
		    st.st_uid != geteuid())
			continue;
		bool old_form = t == nm + bl && pid && *rest == '\0' &&
				pid_dead(pid) && now - st.st_mtime > 3600;
		if (ej_tmp_is_dead(after) || old_form) {
			if (unlink(p) == 0)
				epj_log_msg(EPJ_LOG_INFO,
					    "removed %s, left by an "
					    "interrupted write of a process "
					    "that is gone",
					    p);
		}
	}
	if (dp)
		closedir(dp);
	free(pp.buf);
}

/* 64 unpredictable bits (getrandom; else the clock, the pid and a
 * counter: unique, if guessable). */
uint64_t (*ej_tmp_nonce_hook)(void);

static uint64_t tmp_nonce(void)
{
	if (ej_tmp_nonce_hook)
		return ej_tmp_nonce_hook();
	uint64_t r;
	if (getrandom(&r, sizeof r, GRND_NONBLOCK) == (ssize_t)sizeof r)
		return r;
	static atomic_uint_fast64_t k;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return ((uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull) ^
	       ((uint64_t)ts.tv_sec << 20) ^ ((uint64_t)getpid() << 40) ^
	       atomic_fetch_add(&k, 1);
}

int ej_tmp_create(const char *path, char *tmp, size_t n)
{
	/* A name no one else can have made: O_EXCL refuses anything already
	 * there (a file another user planted, a symlink: O_EXCL does not
	 * follow it), so the file we write is the one we created. */
	for (int attempt = 0; attempt < 64; attempt++) {
		if (snprintf(tmp, n, "%s.tmp.%ld.%016llx.%s", path,
			     (long)getpid(), (unsigned long long)tmp_nonce(),
			     ej_host_tag()) >= (int)n) {
			errno = ENAMETOOLONG;
			return -1;
		}
		int fd = open(
		    tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
		    0666);
		if (fd >= 0 || errno != EEXIST)
			return fd;
	}
	errno = EEXIST;
	return -1;
}

epj_status ej_write_atomic(epj_ctx *ctx, const char *what, const char *path,
			   ej_fill_fn fill, void *user)
{
	size_t n = strlen(path) + 48;
	char *tmp = malloc(n);
	if (!tmp)
		return ej_error(ctx, EPJ_ERR_NOMEM, "%s '%s': out of memory",
				what, path);
	ej_sweep_tmp(path);
	int fd = ej_tmp_create(path, tmp, n);
	if (fd < 0) {
		epj_status s =
		    ej_error(ctx, EPJ_ERR_IO, "%s '%s': cannot create '%s': %s",
			     what, path, tmp, strerror(errno));
		free(tmp);
		return s;
	}
	FILE *fp = fdopen(fd, "wb");
	if (!fp) {
		epj_status s = ej_error(ctx, EPJ_ERR_IO, "%s '%s': fdopen: %s",
					what, path, strerror(errno));
		close(fd);
		unlink(tmp);
		free(tmp);
		return s;
	}
	epj_status s = fill(ctx, fp, tmp, user);
	if (s == EPJ_OK && (fflush(fp) != 0 || ferror(fp)))
		s = ej_error(ctx, EPJ_ERR_IO, "%s '%s': write '%s': %s", what,
			     path, tmp, strerror(errno));
	if (s == EPJ_OK && fsync(fd) != 0)
		s = ej_error(ctx, EPJ_ERR_IO, "%s '%s': fsync '%s': %s", what,
			     path, tmp, strerror(errno));
	if (fclose(fp) != 0 && s == EPJ_OK)
		s = ej_error(ctx, EPJ_ERR_IO, "%s '%s': close '%s': %s", what,
			     path, tmp, strerror(errno));
	if (s == EPJ_OK && rename(tmp, path) != 0)
		s = ej_error(ctx, EPJ_ERR_IO, "%s '%s': rename '%s': %s", what,
			     path, tmp, strerror(errno));
	if (s != EPJ_OK) {
		unlink(tmp);
		free(tmp);
		return s;
	}
	free(tmp);

	/* Make the rename itself durable.  The new file is in place already,
	 * so a failure here (some filesystems refuse fsync on directories) is
	 * only worth a warning. */
	ej_path_parts pp;
	if (!ej_path_split(path, &pp))
		return EPJ_OK;
	const char *d = pp.dir;
	int dfd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0 || fsync(dfd) != 0)
		epj_log_msg(EPJ_LOG_WARN,
			    "%s '%s': fsync of directory '%s': %s", what, path,
			    d, strerror(errno));
	if (dfd >= 0)
		close(dfd);
	free(pp.buf);
	return EPJ_OK;
}
