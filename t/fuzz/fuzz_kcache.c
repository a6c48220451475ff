/* fuzz_kcache.c -- kernel cache entries (jit/kcache.c): the input is
 * written as the entry file of a fixed key in a private cache; a get must
 * be a miss (corrupt, removed) or a hit whose bytes are the entry's own. */
#include "fuzz.h"
#include "kcache.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char key[EJ_KCACHE_KEY_LEN + 1];
static char entry[8192];

static void rm_tree(void)
{
	char p[8192];
	unlink(entry);
	snprintf(p, sizeof p, "%s/c/v1/%.2s", fuzz_dir(), key);
	rmdir(p);
	snprintf(p, sizeof p, "%s/c/v1", fuzz_dir());
	rmdir(p);
	snprintf(p, sizeof p, "%s/c", fuzz_dir());
	rmdir(p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	epj_ctx *ctx = fuzz_ctx();
	char dir[4200];
	snprintf(dir, sizeof dir, "%s/c", fuzz_dir());
	if (!key[0]) {
		const char *parts[] = { "fuzz" };
		ej_kcache_key(key, parts, 1);
		snprintf(entry, sizeof entry, "%s/v1/%.2s/%s.bin", dir, key,
			 key);
		atexit(rm_tree);
	}
	ej_kcache *c = ej_kcache_open(ctx, dir);
	if (!c)
		abort();
	char shard[8192];
	snprintf(shard, sizeof shard, "%s/v1/%.2s", dir, key);
	mkdir(shard, 0700);
	int fd = open(entry, O_WRONLY | O_CREAT | O_TRUNC, 0600);
	if (fd < 0 || write(fd, data, size) != (ssize_t)size)
		abort();
	close(fd);
	void *d = NULL;
	size_t len = 0;
	char *src = NULL;
	if (ej_kcache_get_with_source(c, key, &d, &len, &src) == EPJ_OK && d) {
		/* a hit: the artifact is the entry's bytes after the header */
		if (size < 104 + len || memcmp(d, data + 104, len) != 0)
			abort();
	}
	free(d);
	free(src);
	ej_kcache_close(c);
	return 0;
}
