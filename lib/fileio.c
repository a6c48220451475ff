/* fileio.c -- atomic file writes shared by safetensors, token files and
 * the kernel cache's users.
 *
 * Protocol: write to "<path>.tmp.<pid>" (O_NOFOLLOW), fflush, fsync, rename
 * over path, fsync the directory.  Any failure before the rename removes the
 * temporary file and leaves `path` exactly as it was.
 */
#include "core_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

epj_status ej_write_atomic(epj_ctx *ctx, const char *what, const char *path,
			   ej_fill_fn fill, void *user)
{
	size_t n = strlen(path) + 32;
	char *tmp = malloc(n);
	if (!tmp)
		return ej_error(ctx, EPJ_ERR_NOMEM, "%s '%s': out of memory",
				what, path);
	snprintf(tmp, n, "%s.tmp.%ld", path, (long)getpid());

	/* O_NOFOLLOW: never write through a symlink planted at the temp
	 * name; a directory there fails with EISDIR. */
	int fd = open(
	    tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0666);
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
	char *dir = strdup(path);
	if (!dir)
		return EPJ_OK;
	char *slash = strrchr(dir, '/');
	const char *d = ".";
	if (slash == dir)
		d = "/";
	else if (slash) {
		*slash = '\0';
		d = dir;
	}
	int dfd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0 || fsync(dfd) != 0)
		epj_log_msg(EPJ_LOG_WARN,
			    "%s '%s': fsync of directory '%s': %s", what, path,
			    d, strerror(errno));
	if (dfd >= 0)
		close(dfd);
	free(dir);
	return EPJ_OK;
}
