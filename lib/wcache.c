/* wcache.c -- the f32 view of each bf16 parameter, converted once per write.
 *
 * A bf16 linear or matmul computes in f32 (lib/ops_linalg.c), so every call
 * used to widen its weight into a fresh temporary: in the forward, again
 * for dx in the backward, and again in each checkpoint replay.  Instead, a
 * parameter's storage (marked by ej_module_add_param) carries one f32 copy
 * of its values, from the same allocator, filled on first use and reused
 * until something may have written the parameter.
 *
 * Staleness is tracked by the context's write epoch (ctx->wepoch): a copy
 * filled at epoch E is valid while ctx->wepoch == E.  Everything that can
 * write a parameter bumps the epoch (ej_params_written):
 *   - every epj_model_forward (so nothing done between two forwards, by
 *     the library or by the caller, is ever missed: the optimizer, a
 *     checkpoint load, ZeRO's gather, a broadcast);
 *   - the optimizer's step, after its writes;
 *   - the public writers: epj_tensor_data (a writable pointer), _from_f64,
 *     _set_f64, _copy_, epj_model_set_param.
 * A forward and its backward (with its checkpoint replays) see one epoch,
 * so each bf16 weight is widened once per micro-batch.  The widening is
 * exact, so results are bit for bit those of converting per call.
 * Counters: kernels.bf16_weight_fills (a copy filled), .._hits (reused).
 * EPJIT_BF16_WEIGHT_CACHE=0 turns it off (the per-call conversion).
 */
#include "ops_impl.h"

void ej_params_written(epj_ctx *ctx)
{
	if (ctx)
		ctx->wepoch++;
}

void ej_param_write(epj_ctx *ctx, const epj_tensor *t)
{
	if (t && t->storage && t->storage->param)
		ej_params_written(ctx);
}

void ej_storage_mark_param(epj_tensor *t)
{
	if (t && t->storage)
		t->storage->param = true;
}

const float *ej_param_f32(epj_ctx *ctx, const epj_tensor *t)
{
	if (!t || t->dtype != EPJ_DTYPE_BF16 || !t->storage ||
	    !t->storage->param || !t->storage->alloc || !ctx ||
	    ctx->no_wcache || !ctx->dev || !ctx->dev->host_visible)
		return NULL;
	ej_storage *s = t->storage;
	size_t n = s->bytes / sizeof(uint16_t);
	if (!s->f32) {
		s->f32 = ej_alloc(s->alloc, n * sizeof(float) + 1);
		if (!s->f32)
			return NULL;
		s->f32_epoch = 0;
	}
	if (s->f32_epoch != ctx->wepoch) {
		ej_cvt_bf16_to_f32((const uint16_t *)s->data, s->f32,
				   (int64_t)n);
		s->f32_epoch = ctx->wepoch;
		epj_counter_add(ctx, "kernels.bf16_weight_fills", 1);
	} else {
		epj_counter_add(ctx, "kernels.bf16_weight_hits", 1);
	}
	return s->f32 + t->offset;
}
