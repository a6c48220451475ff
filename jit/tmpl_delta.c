/* tmpl_delta.c -- host side of the gated delta rule's CUDA template
 * (templates/delta.cuh): the eager entries of GATED_DELTA and
 * GATED_DELTA_BACKWARD on the cuda-sim and cuda devices.
 *
 * The op's checks are the CPU op's (ej_infer_* ran at dispatch); here the
 * inputs are made contiguous (one copy each when strided) and the kernel
 * launched.  A key head wider than the template's EJ_DELTA_MAXK (256),
 * which the forward keeps a state column of in registers, runs the CPU
 * kernel instead (ej_eager_fallback, counted).  The backward's scratch
 * (the kept and recomputed states of every (batch, head)) comes from the
 * template scratch cache.
 */
#include "eager_cuda.h"
#include "templates/args.h"
#include "tmpl.h"
#include "tmpl_moe.h"

#include "ops_impl.h"

enum { MAXK = 256, CK = 64 }; /* EJ_DELTA_MAXK, EJ_DELTA_CK */

static const ej_tmpl_kernel delta_kernels[] = {
	{ "ej_delta_fwd", "struct ej_delta_args" },
	{ "ej_delta_bwd", "struct ej_delta_args" },
};

static int dcode(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F32    ? 0
	       : dt == EPJ_DTYPE_BF16 ? 1
	       : dt == EPJ_DTYPE_F64  ? 2
				      : -1;
}

/* Contiguous views of the call's inputs from `first` on (n of them): new
 * references, or copies of strided ones. */
static epj_status dense_inputs(epj_ctx *ctx, const ej_call *c, int first, int n,
			       epj_tensor **out)
{
	bool prev = epj_no_grad_enter(ctx);
	epj_status st = EPJ_OK;
	for (int i = 0; i < n; i++) {
		out[i] = epj_contiguous(ctx, c->in[first + i]);
		if (!out[i])
			st = epj_ctx_status(ctx);
	}
	epj_no_grad_exit(ctx, prev);
	return st;
}

static void drop(epj_tensor **t, int n)
{
	for (int i = 0; i < n; i++)
		epj_tensor_free(t[i]);
}

static epj_status launch1(epj_ctx *ctx, const char *kernel, unsigned grid,
			  unsigned block, const struct ej_delta_args *a,
			  const ej_launch_out *outs, int n_out)
{
	ej_tmpl *m;
	epj_status st = ej_tmpl_get(ctx, ctx->dev->name, "delta", NULL,
				    delta_kernels, 2, &m);
	if (st != EPJ_OK)
		return st;
	ej_launch l = { .grid = { grid, 1, 1 },
			.block = { block, 1, 1 },
			.args = a,
			.args_size = sizeof *a,
			.outs = outs,
			.n_out = n_out };
	return ej_tmpl_launch(ctx, m, kernel, &l);
}

static unsigned grid_of(int64_t n)
{
	return n < 1 ? 1u : n > 65535 ? 65535u : (unsigned)n;
}

/* The arguments of both kernels for inputs q, k, v, g, beta (dense) of
 * [B, T, H, Dk or Dv]; the outputs are the caller's. */
static struct ej_delta_args delta_args(epj_tensor *const *in, int64_t B,
				       int64_t T, int64_t H, int64_t Dk,
				       int64_t Dv, int dt)
{
	struct ej_delta_args a = { .q = ej_data(in[0]),
				   .k = ej_data(in[1]),
				   .v = ej_data(in[2]),
				   .g = ej_data(in[3]),
				   .beta = ej_data(in[4]),
				   .B = B,
				   .T = T,
				   .H = H,
				   .Dk = Dk,
				   .Dv = Dv,
				   .dt = dt };
	return a;
}

epj_status ej_cuda_op_gated_delta(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *q = c->in[0], *v = c->in[2];
	const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2];
	const int64_t Dk = q->shape[3], Dv = v->shape[3];
	if (Dk > MAXK || dcode(q->dtype) < 0)
		return ej_eager_fallback(ctx, c);
	epj_tensor *in[5] = { 0 };
	epj_status st = dense_inputs(ctx, c, 0, 5, in);
	if (st == EPJ_OK && B * T * H * Dv > 0) {
		struct ej_delta_args a =
		    delta_args(in, B, T, H, Dk, Dv, dcode(q->dtype));
		a.o = ej_data(c->out[0]);
		size_t es = ej_dtype_size(q->dtype);
		ej_launch_out o = { a.o, (size_t)(B * T * H * Dv) * es, es };
		unsigned th =
		    Dv >= 128 ? 128u : (unsigned)((Dv + 31) / 32 * 32);
		st =
		    launch1(ctx, "ej_delta_fwd", grid_of(B * H), th, &a, &o, 1);
	}
	drop(in, 5);
	return st;
}

epj_status ej_cuda_op_gated_delta_backward(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *q = c->in[1], *v = c->in[3];
	const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2];
	const int64_t Dk = q->shape[3], Dv = v->shape[3];
	if (dcode(q->dtype) < 0)
		return ej_eager_fallback(ctx, c);
	epj_tensor *in[6] = { 0 };
	epj_status st = dense_inputs(ctx, c, 0, 6, in);
	const size_t cs = q->dtype == EPJ_DTYPE_F64 ? 8 : 4;
	const int64_t per = (T / CK + 1 + CK + 1 + 2) * Dk * Dv + 4 * Dv;
	void *ws = NULL;
	if (st == EPJ_OK && B * T * H > 0) {
		ws = ej_tmpl_scratch_alloc(ctx, ctx->dev,
					   (size_t)(B * H * per) * cs,
					   "gated delta backward states");
		if (!ws)
			st = epj_ctx_status(ctx);
	}
	if (st == EPJ_OK && B * T * H > 0) {
		struct ej_delta_args a =
		    delta_args(in + 1, B, T, H, Dk, Dv, dcode(q->dtype));
		a.go = ej_data(in[0]);
		a.o = ej_data(c->out[0]);
		a.dk = ej_data(c->out[1]);
		a.dv = ej_data(c->out[2]);
		a.dg = ej_data(c->out[3]);
		a.dbeta = ej_data(c->out[4]);
		a.ws = ws;
		size_t es = ej_dtype_size(q->dtype);
		int64_t nk = B * T * H * Dk, nv = B * T * H * Dv,
			ns = B * T * H;
		ej_launch_out o[5] = {
			{ a.o, (size_t)nk * es, es },
			{ a.dk, (size_t)nk * es, es },
			{ a.dv, (size_t)nv * es, es },
			{ a.dg, (size_t)ns * es, es },
			{ a.dbeta, (size_t)ns * es, es },
		};
		/* one thread per (batch, head) */
		unsigned th = B * H >= 32 ? 32u : (unsigned)(B * H);
		st = launch1(ctx, "ej_delta_bwd",
			     grid_of((B * H + th - 1) / th), th, &a, o, 5);
	}
	ej_tmpl_scratch_free(ctx, ctx->dev, ws);
	drop(in, 6);
	return st;
}
