/* fuzz_safetensors.c -- the safetensors reader (lib/safetensors.c): open,
 * list every entry and its metadata, read every tensor (their data lies
 * in the file, so they are no larger than the input). */
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	epj_ctx *ctx = fuzz_ctx();
	const char *path = fuzz_file(data, size);
	epj_st_file *f = NULL;
	if (!path || epj_st_open(ctx, path, &f) != EPJ_OK)
		return 0;
	for (int i = 0; i < epj_st_count(f); i++) {
		const char *nm = epj_st_name_at(f, i);
		(void)epj_st_dtype_str_at(f, i);
		(void)epj_st_find(f, nm);
		epj_tensor *t = epj_st_get(ctx, f, nm);
		if (t && epj_tensor_numel(t) > 0)
			(void)epj_tensor_get_f64(t, 0);
		epj_tensor_free(t);
		epj_ctx_clear_error(ctx);
	}
	for (int i = 0; i < epj_st_metadata_count(f); i++)
		(void)epj_st_metadata(f, epj_st_metadata_key_at(f, i));
	epj_st_close(f);
	return 0;
}
