/* fuzz_ckpt_set.c -- the commit record of a multi-rank checkpoint
 * (runtime/ckpt_set.c): read it as a load does (a file at PATH), parse and
 * validate it, and write a parsed record back and read that again (it must
 * parse to the same generation and files). */
#include "fuzz.h"

#include "runtime_impl.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	epj_ctx *ctx = fuzz_ctx();
	const char *path = fuzz_file(data, size);
	char *text = NULL;
	size_t len = 0;
	if (!path || ej_ckpt_set_read(path, &text, &len) != 1)
		return 0;
	ej_ckpt_set s, t;
	if (ej_ckpt_set_parse(ctx, path, text, len, &s) == EPJ_OK) {
		char out[4096];
		snprintf(out, sizeof out, "%s.again", path);
		char *t2 = NULL;
		size_t l2 = 0;
		if (ej_ckpt_set_write(ctx, out, &s) != EPJ_OK ||
		    ej_ckpt_set_read(out, &t2, &l2) != 1 ||
		    ej_ckpt_set_parse(ctx, out, t2, l2, &t) != EPJ_OK)
			abort();
		if (t.generation != s.generation || t.world != s.world ||
		    strcmp(t.files[0].name, s.files[0].name) != 0)
			abort();
		ej_ckpt_set_free(&t);
		free(t2);
		remove(out);
		ej_ckpt_set_free(&s);
	}
	epj_ctx_clear_error(ctx);
	free(text);
	return 0;
}
