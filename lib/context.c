/* context.c -- epj_ctx: backend device, allocator, error state, grad mode,
 * RNG, counters and the trace hook.
 *
 * One context is used by one thread at a time.  "cuda" opens the process's
 * GPU through the dlopen'ed driver (device_cuda.c); an unknown or
 * unavailable backend is a clean error, never a crash.
 */
#include "core_impl.h"

#include <string.h>

epj_status epj_ctx_new(const char *backend, epj_ctx **out)
{
	*out = NULL;
	const ej_device_desc *desc = ej_device_find(backend ? backend : "cpu");
	if (!desc) {
		epj_log_msg(EPJ_LOG_ERROR, "unknown backend \"%s\" (known: %s)",
			    backend, epj_device_names());
		return EPJ_ERR_INVALID;
	}
	/* the device (cuda: the process's GPU, its driver, device and
	 * streams; without a driver its verdict: "no CUDA driver
	 * (libcuda.so.1 not found: ...)") */
	epj_ctx probe = { 0 };
	const ej_device *dev = NULL;
	if (desc->open(&probe, &dev) != EPJ_OK || !dev) {
		epj_log_msg(EPJ_LOG_ERROR, "backend \"%s\": %s", desc->name,
			    probe.errmsg);
		return EPJ_ERR_BACKEND;
	}
	epj_ctx *ctx = calloc(1, sizeof *ctx);
	if (!ctx)
		return EPJ_ERR_NOMEM;
	/* cuda-sim: host memory too; compiled regions default to the
	 * cuda-sim backend (runtime/compile.c).  cuda: tensors live in device
	 * memory under this context's caching allocator over cuMemAlloc */
	ctx->dev = dev;
	ctx->alloc = ej_allocator_new(ctx->dev);
	ctx->counters = ej_counter_table_new();
	if (!ctx->alloc || !ctx->counters) {
		epj_ctx_free(ctx);
		return EPJ_ERR_NOMEM;
	}
	ctx->grad_enabled = true;
	ej_rng_seed(&ctx->rng, 42);
	ctx->ctr_eager_launches =
	    ej_counter_slot(ctx, "kernels.launched.eager");
	const char *prof = getenv("EPJIT_PROFILE");
	ctx->profile = prof && *prof && strcmp(prof, "0") != 0;
	const char *wc = getenv("EPJIT_BF16_WEIGHT_CACHE");
	ctx->no_wcache = wc && !strcmp(wc, "0");
	ctx->wepoch = 1;
	const char *amx = getenv("EPJIT_CPU_AMX");
	ctx->no_amx = amx && !strcmp(amx, "0");
	const char *sdpa = getenv("EPJIT_SDPA");
	if (sdpa && *sdpa && strcmp(sdpa, "flash") != 0) {
		if (strcmp(sdpa, "reference") != 0) {
			epj_log_msg(EPJ_LOG_ERROR,
				    "EPJIT_SDPA=\"%s\": unknown attention "
				    "kernel (known: flash, reference)",
				    sdpa);
			epj_ctx_free(ctx);
			return EPJ_ERR_INVALID;
		}
		ctx->sdpa_reference = true;
	}
	*out = ctx;
	return EPJ_OK;
}

void epj_ctx_free(epj_ctx *ctx)
{
	if (!ctx)
		return;
	if (ctx->gemm_sel && ctx->gemm_sel_free)
		ctx->gemm_sel_free(ctx->gemm_sel);
	if (ctx->alloc)
		ej_allocator_free(ctx->alloc);
	if (ctx->host_alloc)
		ej_allocator_free(ctx->host_alloc);
	if (ctx->counters)
		ej_counter_table_free(ctx->counters);
	free(ctx);
}

void epj_ctx_seed(epj_ctx *ctx, uint64_t seed)
{
	ej_rng_seed(&ctx->rng, seed);
}

bool epj_no_grad_enter(epj_ctx *ctx)
{
	bool prev = ctx->grad_enabled;
	ctx->grad_enabled = false;
	return prev;
}

void epj_no_grad_exit(epj_ctx *ctx, bool prev)
{
	ctx->grad_enabled = prev;
}

bool epj_grad_enabled(const epj_ctx *ctx)
{
	return ctx->grad_enabled;
}
