/* fuzz_archive.c -- warm-up archives (jit/kcache_archive.c): the input is
 * imported into a fresh private cache.  Whatever the bytes, the import must
 * not crash, and an import that is refused must leave the cache empty (a
 * partial or corrupt archive imports nothing). */
#include "fuzz.h"
#include "kcache.h"
#include "kcache_archive.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Removes dir and everything under it (the cache of one input). */
static void rm_rf(const char *dir)
{
	char cmd[8300];
	snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
	if (system(cmd) != 0)
		abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	epj_ctx *ctx = fuzz_ctx();
	const char *path = fuzz_file(data, size);
	if (!path)
		return 0;
	char dir[8192];
	snprintf(dir, sizeof dir, "%s/ac", fuzz_dir());
	rm_rf(dir);
	ej_kcache *c = ej_kcache_open(ctx, dir);
	if (!c)
		abort(); /* a fresh private directory must open */
	int added = 0, present = 0;
	epj_status st =
	    ej_kcache_archive_import(ctx, c, path, &added, &present);
	int n = ej_kcache_list(c, NULL, NULL);
	if (st != EPJ_OK && n != 0) {
		fprintf(stderr,
			"fuzz_archive: a refused import (%s) left %d "
			"entries in the cache\n",
			epj_ctx_error(ctx), n);
		abort();
	}
	if (st == EPJ_OK && n != added + present)
		abort();
	ej_kcache_close(c);
	rm_rf(dir);
	return 0;
}
