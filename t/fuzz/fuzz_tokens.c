/* fuzz_tokens.c -- token files (runtime/data.c): read, and when accepted
 * make a corpus of them and draw a batch. */
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	epj_ctx *ctx = fuzz_ctx();
	const char *path = fuzz_file(data, size);
	epj_tokens *t = NULL;
	if (!path || epj_tokens_read(ctx, path, &t) != EPJ_OK)
		return 0;
	epj_tokens_free(t);
	epj_corpus *c = epj_corpus_from_tokens(ctx, path);
	if (c) {
		epj_tensor *ids = NULL, *lab = NULL;
		if (epj_corpus_next_batch(ctx, c, 2, 3, &ids, &lab) == EPJ_OK) {
			epj_tensor_free(ids);
			epj_tensor_free(lab);
		}
		epj_corpus_free(c);
	}
	return 0;
}
