/* fuzz_ds_config.c -- DeepSpeed JSON configs (runtime/config.c): parse,
 * resolve the batch for a few world sizes. */
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
	ej_config cfg;
	if (ej_config_parse(ctx, text, "fuzz.json", &cfg) == EPJ_OK) {
		static const int worlds[] = { 1, 2, 3, 8 };
		for (int i = 0; i < 4; i++) {
			ej_config c = cfg;
			(void)ej_config_resolve_batch(ctx, &c, worlds[i]);
			epj_ctx_clear_error(ctx);
		}
	}
	free(text);
	return 0;
}
