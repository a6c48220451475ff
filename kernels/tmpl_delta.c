/* tmpl_delta.c -- host side of the gated delta rule's CUDA template
 * (templates/delta.cuh): the eager entries of GATED_DELTA and
 * GATED_DELTA_BACKWARD on the cuda-sim and cuda devices.
 *
 * The op's checks are the CPU op's (ej_infer_* ran at dispatch); here the
 * inputs are made contiguous (one copy each when strided) and the kernels
 * launched: blocks of 128 threads, one per (batch, head, tile of 8 state
 * columns).  A key head wider than the template's EJ_DELTA_MAXK (256),
 * whose state column slices the kernels keep in registers, runs the CPU
 * kernel instead (ej_eager_fallback, counted).
 *
 * The backward: ej_delta_bwd_keep keeps every CK-th state, then per
 * segment of time (from the last one back) ej_delta_bwd_seg walks the
 * segment backwards (dS carried between segments in two buffers, one read
 * and one written) and ej_delta_bwd_sum adds the column tiles' partial
 * sums of dq, dk, dbeta and dg.  The segment is as long as keeps the
 * partials under PART_BUDGET bytes (at least CK steps).  Its scratch, from
 * the template scratch cache: (ceil(T / CK) + CK + 2) B H states (each Dk x
 * Dv padded to multiples of 16 x 8) and the partials, in the compute type.
 */
#include "eager_cuda.h"
#include "templates/args.h"
#include "tmpl.h"

#include "ops_impl.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

/* EJ_DELTA_MAXK, EJ_DELTA_CK, EJ_DELTA_THREADS, EJ_DELTA_COLS */
enum { MAXK = 256, CK = 64, THREADS = 128, COLS = 8, SUM_THREADS = 256 };

#define PART_BUDGET ((int64_t)256 << 20)

static const ej_tmpl_kernel delta_kernels[] = {
	{ "ej_delta_fwd", "struct ej_delta_args" },
	{ "ej_delta_bwd_keep", "struct ej_delta_args" },
	{ "ej_delta_bwd_seg", "struct ej_delta_args" },
	{ "ej_delta_bwd_sum", "struct ej_delta_args" },
};

static _Atomic int64_t segment_hook;

void ej_cuda_delta_segment_hook(int64_t steps)
{
	atomic_store(&segment_hook, steps);
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

/* The template's instantiation for a's dtype and key width: f64 or f32
 * arithmetic, the keys per lane (EJ_DELTA_NU: Dk <= 16 NU). */
static epj_status launch1(epj_ctx *ctx, const char *kernel, unsigned grid,
			  unsigned block, const struct ej_delta_args *a,
			  const ej_launch_out *outs, int n_out)
{
	char defs[64];
	snprintf(defs, sizeof defs,
		 "#define EJ_DELTA_F64 %d\n#define EJ_DELTA_NU %d",
		 a->dt == 2 ? 1 : 0,
		 a->Dk <= 64	? 4
		 : a->Dk <= 128 ? 8
				: 16);
	ej_tmpl *m;
	epj_status st =
	    ej_tmpl_get(ctx, ctx->dev->name, "delta", defs, delta_kernels,
			(int)EJ_ARRAY_LEN(delta_kernels), &m);
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

/* The blocks of the column kernels: one per (batch, head, column tile). */
static unsigned col_grid(int64_t B, int64_t H, int64_t Dv)
{
	return grid_of(B * H * ((Dv + COLS - 1) / COLS));
}

epj_status ej_cuda_op_gated_delta(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *q = c->in[0], *v = c->in[2];
	const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2];
	const int64_t Dk = q->shape[3], Dv = v->shape[3];
	if (Dk > MAXK || ej_tmpl_dcode(q->dtype) < 0)
		return ej_eager_fallback(ctx, c);
	epj_tensor *in[5] = { 0 };
	epj_status st = dense_inputs(ctx, c, 0, 5, in);
	if (st == EPJ_OK && B * T * H * Dv > 0) {
		struct ej_delta_args a =
		    delta_args(in, B, T, H, Dk, Dv, ej_tmpl_dcode(q->dtype));
		a.o = ej_data(c->out[0]);
		size_t es = ej_dtype_size(q->dtype);
		ej_launch_out o = { a.o, (size_t)(B * T * H * Dv) * es, es };
		st = launch1(ctx, "ej_delta_fwd", col_grid(B, H, Dv), THREADS,
			     &a, &o, 1);
	}
	drop(in, 5);
	return st;
}

/* The backward's sizes, in elements of the compute type (cs bytes). */
typedef struct bwd_plan {
	int64_t nt, nck, ss, seg, nw;
	size_t cs, kept, chunk, ds, part; /* elements */
} bwd_plan;

static bwd_plan plan_of(int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv,
			size_t cs)
{
	bwd_plan p = { .nt = (Dv + COLS - 1) / COLS,
		       .nck = (T + CK - 1) / CK,
		       /* a state as the kernels store it, padded */
		       .ss = (Dk + 15) / 16 * 16 *
			     ((Dv + COLS - 1) / COLS * COLS),
		       .nw = 2 * Dk + 2,
		       .cs = cs };
	int64_t per = p.nt * B * H * p.nw * (int64_t)cs; /* bytes a step */
	per = per < 1 ? 1 : per;
	int64_t hook = atomic_load(&segment_hook);
	int64_t n = (hook > 0 ? hook : PART_BUDGET / per) / CK * CK;
	n = n < CK ? CK : n;
	p.seg = n < p.nck * CK ? n : p.nck * CK;
	p.kept = (size_t)(B * H * p.nck * p.ss);
	p.chunk = (size_t)(B * H * CK * p.ss);
	p.ds = (size_t)(B * H * p.ss);
	p.part = (size_t)(p.nt * B * p.seg * H * p.nw);
	return p;
}

/* The rows [t0, t1) of every batch of x [B, T, H, D] as launch outputs. */
static int rows_out(ej_launch_out *o, void *x, int64_t B, int64_t T, int64_t H,
		    int64_t D, int64_t t0, int64_t t1, size_t es)
{
	for (int64_t b = 0; b < B; b++)
		o[b] = (ej_launch_out){ (char *)x +
					    (size_t)((b * T + t0) * H * D) * es,
					(size_t)((t1 - t0) * H * D) * es, es };
	return (int)B;
}

/* The reverse sweep, segment by segment from the last; a.ws holds the kept
 * states, ws2 the rest of the scratch. */
static epj_status bwd_segments(epj_ctx *ctx, struct ej_delta_args *a,
			       const bwd_plan *p, char *ws2, size_t es)
{
	const int64_t B = a->B, T = a->T, H = a->H, Dk = a->Dk, Dv = a->Dv;
	ej_launch_out *o = malloc(sizeof *o * (size_t)(4 * B + 2));
	if (!o)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"gated delta backward: out of memory");
	void *ds[2] = { ws2, ws2 + p->ds * p->cs };
	a->chunk = ws2 + 2 * p->ds * p->cs;
	a->part = (char *)a->chunk + p->chunk * p->cs;
	epj_status st = EPJ_OK;
	int flip = 0;
	for (int64_t t0 = (T - 1) / p->seg * p->seg; st == EPJ_OK && t0 >= 0;
	     t0 -= p->seg, flip ^= 1) {
		a->t0 = t0;
		a->t1 = t0 + p->seg < T ? t0 + p->seg : T;
		a->dsin = ds[flip ^ 1];
		a->dsout = ds[flip];
		const int64_t rows = B * (a->t1 - a->t0) * H;
		o[0] = (ej_launch_out){ a->dsout, p->ds * p->cs, p->cs };
		o[1] = (ej_launch_out){ a->part,
					(size_t)(p->nt * rows * p->nw) * p->cs,
					p->cs };
		int n =
		    2 + rows_out(o + 2, a->dv, B, T, H, Dv, a->t0, a->t1, es);
		st = launch1(ctx, "ej_delta_bwd_seg", col_grid(B, H, Dv),
			     THREADS, a, o, n);
		if (st != EPJ_OK)
			break;
		n = rows_out(o, a->o, B, T, H, Dk, a->t0, a->t1, es);
		n += rows_out(o + n, a->dk, B, T, H, Dk, a->t0, a->t1, es);
		n += rows_out(o + n, a->dg, B, T, H, 1, a->t0, a->t1, es);
		n += rows_out(o + n, a->dbeta, B, T, H, 1, a->t0, a->t1, es);
		st = launch1(
		    ctx, "ej_delta_bwd_sum",
		    grid_of((rows * p->nw + SUM_THREADS - 1) / SUM_THREADS),
		    SUM_THREADS, a, o, n);
	}
	free(o);
	return st;
}

epj_status ej_cuda_op_gated_delta_backward(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *q = c->in[1], *v = c->in[3];
	const int64_t B = q->shape[0], T = q->shape[1], H = q->shape[2];
	const int64_t Dk = q->shape[3], Dv = v->shape[3];
	if (Dk > MAXK || ej_tmpl_dcode(q->dtype) < 0)
		return ej_eager_fallback(ctx, c);
	epj_tensor *in[6] = { 0 };
	epj_status st = dense_inputs(ctx, c, 0, 6, in);
	const size_t es = ej_dtype_size(q->dtype);
	const bwd_plan p =
	    plan_of(B, T, H, Dk, Dv, q->dtype == EPJ_DTYPE_F64 ? 8 : 4);
	char *ws = NULL;
	if (st == EPJ_OK && B * T * H > 0) {
		ws = ej_tmpl_scratch_alloc(
		    ctx, ctx->dev,
		    (p.kept + p.chunk + 2 * p.ds + p.part) * p.cs,
		    "gated delta backward states");
		if (!ws)
			st = epj_ctx_status(ctx);
	}
	if (st == EPJ_OK && B * T * H > 0) {
		struct ej_delta_args a = delta_args(in + 1, B, T, H, Dk, Dv,
						    ej_tmpl_dcode(q->dtype));
		a.go = ej_data(in[0]);
		a.o = ej_data(c->out[0]);
		a.dk = ej_data(c->out[1]);
		a.dv = ej_data(c->out[2]);
		a.dg = ej_data(c->out[3]);
		a.dbeta = ej_data(c->out[4]);
		a.ws = ws;
		ej_launch_out o = { ws, p.kept * p.cs, p.cs };
		st = launch1(ctx, "ej_delta_bwd_keep", col_grid(B, H, Dv),
			     THREADS, &a, &o, 1);
		if (st == EPJ_OK)
			st = bwd_segments(ctx, &a, &p, ws + p.kept * p.cs, es);
	}
	ej_tmpl_scratch_free(ctx, ctx->dev, ws);
	drop(in, 6);
	return st;
}
