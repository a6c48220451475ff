/* fuzz_hf_config.c -- HF config.json of a Qwen3-MoE model
 * (runtime/model_config.c): parse from text and load from a file. */
#include "config_impl.h"
#include "fuzz.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	epj_ctx *ctx = fuzz_ctx();
	char *text = malloc(size + 1);
	if (!text)
		return 0;
	memcpy(text, data, size);
	text[size] = '\0';
	ej_model_config m;
	(void)ej_model_config_parse(ctx, text, "config.json", &m);
	epj_ctx_clear_error(ctx);
	const char *path = fuzz_file(data, size);
	if (path)
		(void)ej_model_config_load(ctx, path, &m);
	free(text);
	return 0;
}
