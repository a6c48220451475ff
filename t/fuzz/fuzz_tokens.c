/* fuzz_tokens.c -- token files (runtime/data.c) and token datasets
 * (runtime/dataset.c).  Every input is tried three ways: as an epjit token
 * file (read; when accepted, a corpus and a batch of it), as a numpy .npy
 * file and as a Megatron index whose .bin holds the same bytes (opened;
 * when accepted, every document read and a dataset corpus drawn from). */
#include "fuzz.h"

#include <stdio.h>
#include <stdlib.h>

static void write_to(const char *path, const uint8_t *data, size_t size)
{
	FILE *f = fopen(path, "wb");
	if (!f)
		return;
	if (size)
		fwrite(data, 1, size, f);
	fclose(f);
}

/* Opens spec as docs, reads each document, draws two batches. */
static void try_dataset(epj_ctx *ctx, const char *spec)
{
	epj_docs *d = NULL;
	if (epj_docs_open(ctx, spec, &d) != EPJ_OK)
		return;
	for (uint64_t i = 0; i < epj_docs_count(d); i++) {
		uint64_t n = epj_docs_len(d, i);
		int64_t *x = malloc((n ? n : 1) * sizeof *x);
		if (x)
			(void)epj_docs_read(ctx, d, i, 0, n, x);
		free(x);
	}
	epj_docs_free(d);
	epj_data_opts o = { .split = "3,1", .seed = 1, .vocab = 1u << 20 };
	epj_corpus *c = epj_corpus_dataset(ctx, spec, &o);
	for (int k = 0; c && k < 2; k++) {
		epj_tensor *ids = NULL, *lab = NULL;
		if (epj_corpus_next_batch(ctx, c, 2, 3, &ids, &lab) == EPJ_OK) {
			epj_tensor_free(ids);
			epj_tensor_free(lab);
		}
	}
	epj_corpus_free(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	epj_ctx *ctx = fuzz_ctx();
	const char *path = fuzz_file(data, size);
	if (!path)
		return 0;
	char p[4096];
	snprintf(p, sizeof p, "%s/f.npy", fuzz_dir());
	write_to(p, data, size);
	try_dataset(ctx, p);
	snprintf(p, sizeof p, "%s/m.idx", fuzz_dir());
	write_to(p, data, size);
	snprintf(p, sizeof p, "%s/m.bin", fuzz_dir());
	write_to(p, data, size);
	snprintf(p, sizeof p, "%s/m", fuzz_dir());
	try_dataset(ctx, p);

	epj_tokens *t = NULL;
	if (epj_tokens_read(ctx, path, &t) != EPJ_OK)
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
