/* tmpl_trsm.c -- host side of the triangular solve's CUDA template
 * (templates/trsm.cuh): the eager entries of SOLVE_TRIANGULAR and
 * SOLVE_TRIANGULAR_BACKWARD on the cuda-sim and cuda devices.
 *
 * The op's checks are the CPU op's (ej_infer_* ran at dispatch).  Every
 * input is expanded to the solution's batch shape and made dense (one copy
 * when strided or broadcast, e.g. the backward's A).  f32 and f64 solve in
 * the output itself; bf16 keeps the substitution in an f32 buffer from the
 * template scratch cache and rounds once into the output.  The backward's
 * dB is the transposed solve of grad (into an f32 buffer for bf16, which
 * dA then reads unrounded, as the CPU kernel does).
 */
#include "eager_cuda.h"
#include "templates/args.h"
#include "tmpl.h"

#include "ops_impl.h"

static const ej_tmpl_kernel trsm_kernels[] = {
	{ "ej_trsm", "struct ej_trsm_args" },
	{ "ej_trsm_da", "struct ej_trsm_args" },
};

enum { THREADS = 128 };

static epj_status launch(epj_ctx *ctx, const char *kernel, int64_t items,
			 const struct ej_trsm_args *a,
			 const ej_launch_out *outs, int n_out)
{
	ej_tmpl *m;
	epj_status st =
	    ej_tmpl_get(ctx, ctx->dev->name, "trsm", NULL, trsm_kernels,
			(int)EJ_ARRAY_LEN(trsm_kernels), &m);
	if (st != EPJ_OK)
		return st;
	int64_t blocks = (items + THREADS - 1) / THREADS;
	unsigned grid = blocks < 1	 ? 1u
			: blocks > 65535 ? 65535u
					 : (unsigned)blocks;
	return ej_tmpl_launch_1d(ctx, m, kernel, grid, THREADS, a, sizeof *a,
				 outs, n_out);
}

/* t ([..., r, q]) expanded to [bs[0..nbd), r, q] and dense: a new
 * reference, NULL on error (set in ctx). */
static epj_tensor *dense_as(epj_ctx *ctx, epj_tensor *t, int nbd,
			    const int64_t *bs)
{
	int64_t shape[EPJ_MAX_DIMS];
	memcpy(shape, bs, sizeof *shape * (size_t)nbd);
	shape[nbd] = t->shape[t->ndim - 2];
	shape[nbd + 1] = t->shape[t->ndim - 1];
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *e = epj_expand(ctx, t, nbd + 2, shape);
	epj_tensor *d = e ? epj_contiguous(ctx, e) : NULL;
	epj_no_grad_exit(ctx, prev);
	epj_tensor_free(e);
	return d;
}

/* Dense copies of the call's inputs in[0..n) at batch shape bs. */
static epj_status dense_inputs(epj_ctx *ctx, const ej_call *c, int n, int nbd,
			       const int64_t *bs, epj_tensor **out)
{
	for (int i = 0; i < n; i++)
		if (!(out[i] = dense_as(ctx, c->in[i], nbd, bs)))
			return epj_ctx_status(ctx);
	return EPJ_OK;
}

static void drop(epj_tensor **t, int n)
{
	for (int i = 0; i < n; i++)
		epj_tensor_free(t[i]);
}

/* The compute-type buffer of a solution [nb, n, k] of dtype dt: o's data
 * for f32 and f64, else scratch (NULL on error). */
static void *solve_buffer(epj_ctx *ctx, epj_tensor *o, int64_t elems)
{
	if (o->dtype != EPJ_DTYPE_BF16)
		return ej_data(o);
	return ej_tmpl_scratch_alloc(ctx, ctx->dev,
				     (size_t)(elems > 0 ? elems : 1) * 4,
				     "triangular solve");
}

epj_status ej_cuda_op_solve_triangular(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *o = c->out[0];
	const int nbd = o->ndim - 2;
	const int64_t n = o->shape[nbd], k = o->shape[nbd + 1];
	const int64_t nb = ej_numel(nbd, o->shape);
	const int dt = ej_tmpl_dcode(o->dtype);
	if (dt < 0)
		return ej_eager_fallback(ctx, c);
	if (nb * n * k == 0)
		return EPJ_OK;
	epj_tensor *in[2] = { 0 };
	epj_status st = dense_inputs(ctx, c, 2, nbd, o->shape, in);
	void *x = st == EPJ_OK ? solve_buffer(ctx, o, nb * n * k) : NULL;
	if (st == EPJ_OK && !x)
		st = epj_ctx_status(ctx);
	if (st == EPJ_OK) {
		struct ej_trsm_args a = { .a = ej_data(in[0]),
					  .b = ej_data(in[1]),
					  .x = x,
					  .out = ej_data(o),
					  .nb = nb,
					  .n = n,
					  .k = k,
					  .dt = dt,
					  .upper = c->attrs->i[0] != 0,
					  .unit = c->attrs->i[1] != 0 };
		ej_launch_out outs[2] = {
			ej_tmpl_out(ej_data(o), nb * n * k,
				    ej_dtype_size(o->dtype)),
			ej_tmpl_out(x, nb * n * k, 4),
		};
		st = launch(ctx, "ej_trsm", nb * k, &a, outs,
			    x == ej_data(o) ? 1 : 2);
	}
	if (x && x != ej_data(o))
		ej_tmpl_scratch_free(ctx, ctx->dev, x);
	drop(in, 2);
	return st;
}

epj_status ej_cuda_op_solve_triangular_backward(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *oa = c->out[0], *ob = c->out[1];
	const int nbd = ob->ndim - 2;
	const int64_t n = ob->shape[nbd], k = ob->shape[nbd + 1];
	const int64_t nb = ej_numel(nbd, ob->shape);
	const int dt = ej_tmpl_dcode(ob->dtype);
	if (dt < 0)
		return ej_eager_fallback(ctx, c);
	if (nb * n == 0)
		return EPJ_OK;
	epj_tensor *in[3] = { 0 }; /* grad, A, X */
	epj_status st = dense_inputs(ctx, c, 3, nbd, ob->shape, in);
	void *x = st == EPJ_OK ? solve_buffer(ctx, ob, nb * n * k) : NULL;
	if (st == EPJ_OK && !x)
		st = epj_ctx_status(ctx);
	struct ej_trsm_args a = { .nb = nb,
				  .n = n,
				  .k = k,
				  .dt = dt,
				  .upper = c->attrs->i[0] != 0,
				  .unit = c->attrs->i[1] != 0,
				  .trans = 1 };
	const size_t es = ej_dtype_size(ob->dtype);
	if (st == EPJ_OK && k > 0) {
		/* dB = A^-T grad */
		a.a = ej_data(in[1]);
		a.b = ej_data(in[0]);
		a.x = x;
		a.out = ej_data(ob);
		ej_launch_out outs[2] = {
			ej_tmpl_out(ej_data(ob), nb * n * k, es),
			ej_tmpl_out(x, nb * n * k, 4),
		};
		st = launch(ctx, "ej_trsm", nb * k, &a, outs,
			    x == ej_data(ob) ? 1 : 2);
	}
	if (st == EPJ_OK) {
		/* dA = -dB X^T in A's triangle */
		a.x = x;
		a.xs = ej_data(in[2]);
		a.da = ej_data(oa);
		ej_launch_out o = ej_tmpl_out(ej_data(oa), nb * n * n, es);
		st = launch(ctx, "ej_trsm_da", nb * n * n, &a, &o, 1);
	}
	if (x && x != ej_data(ob))
		ej_tmpl_scratch_free(ctx, ctx->dev, x);
	drop(in, 3);
	return st;
}
