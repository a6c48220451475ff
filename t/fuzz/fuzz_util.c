/* fuzz_util.c -- the helpers of fuzz.h. */
#include "fuzz.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[4096];
static char file[4200];

static void cleanup(void)
{
	if (file[0])
		unlink(file);
	if (dir[0])
		rmdir(dir);
}

const char *fuzz_dir(void)
{
	if (!dir[0]) {
		const char *t = getenv("TMPDIR");
		snprintf(dir, sizeof dir, "%s/epjit-fuzz-XXXXXX",
			 t && *t ? t : "/tmp");
		if (!mkdtemp(dir)) {
			dir[0] = '\0';
			return NULL;
		}
		snprintf(file, sizeof file, "%s/input", dir);
		atexit(cleanup);
	}
	return dir;
}

const char *fuzz_file(const uint8_t *data, size_t size)
{
	if (!fuzz_dir())
		return NULL;
	int fd = open(file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (fd < 0)
		return NULL;
	size_t done = 0;
	while (done < size) {
		ssize_t w = write(fd, data + done, size - done);
		if (w <= 0) {
			close(fd);
			return NULL;
		}
		done += (size_t)w;
	}
	close(fd);
	return file;
}

static epj_ctx *ctx;

static void free_ctx(void)
{
	epj_ctx_free(ctx);
}

epj_ctx *fuzz_ctx(void)
{
	if (!ctx) {
		epj_log_level_set(EPJ_LOG_ERROR);
		if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
			abort();
		atexit(free_ctx);
	}
	epj_ctx_clear_error(ctx);
	return ctx;
}
