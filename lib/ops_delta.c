/* ops_delta.c -- the gated delta rule, the recurrence of Gated DeltaNet
 * (Qwen3.5-MoE's linear attention), and its backward.
 *
 * GATED_DELTA (q, k, v, g, beta) -> (o): q, k [B, T, H, Dk], v [B, T, H, Dv],
 * g, beta [B, T, H], one float dtype; o [B, T, H, Dv].  Per batch b and head
 * h, a state S (Dk x Dv) starts at zero and for t = 0 .. T-1:
 *
 *   S~  = exp(g_t) S                      decay
 *   d   = beta_t (v_t - S~^T k_t)         the delta (Dv)
 *   S   = S~ + k_t d^T                    write
 *   o_t = S^T q_t                         read
 *
 * which is transformers' torch_recurrent_gated_delta_rule (and, in exact
 * arithmetic, its chunked form) after the caller's l2-normalisation of q, k
 * and the 1/sqrt(Dk) scale of q.  Grouped heads (fewer key heads than value
 * heads) are the caller's repeat of q, k.
 *
 * GATED_DELTA_BACKWARD (grad_o, q, k, v, g, beta) -> (dq, dk, dv, dg, dbeta)
 * runs the recurrence backwards with dS, the gradient of the loss in S_t:
 *
 *   dS += q_t do_t^T;  dq_t = S_t do_t
 *   dk_t = dS d;  dd = dS^T k_t
 *   dbeta_t = dd . (v_t - m);  dv_t = beta_t dd;  dm = -beta_t dd
 *   dS~ = dS + k_t dm^T;  dk_t += S~ dm
 *   dg_t = exp(g_t) <dS~, S_{t-1}>;  dS = exp(g_t) dS~
 *
 * with m = S~^T k_t.  It needs S_{t-1} at every step, backwards: the
 * forward states are kept at every CK-th step and those in between
 * recomputed, so memory is (T / CK + CK) states per (b, h), not T.
 *
 * Both CPU reference kernels read any strides and compute in double (the
 * reference the CUDA side and the compiled regions are held to); outputs
 * are written in the inputs' dtype.  The op is an extern node in compiled
 * regions (an op-table call); the CUDA devices run templates/delta.cuh
 * (kernels/tmpl_delta.c), held to these kernels by the tests.
 */
#include "ops_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { CK = 64 }; /* states kept every CK steps in the backward */

/* The dimensions of a call whose q is c->in[iq]. */
typedef struct delta_dims {
	int64_t b, t, h, dk, dv;
} delta_dims;

static epj_status delta_check(epj_ctx *ctx, const ej_call *c, int iq,
			      delta_dims *m)
{
	epj_status s;
	for (int i = iq; i < iq + 5; i++)
		if ((s = ej_check_float(ctx, c, i)) ||
		    (s = ej_check_same_dtype(ctx, c, iq, i)))
			return s;
	const epj_tensor *q = c->in[iq], *k = c->in[iq + 1], *v = c->in[iq + 2];
	const epj_tensor *g = c->in[iq + 3], *be = c->in[iq + 4];
	if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4 || g->ndim != 3 ||
	    be->ndim != 3)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "q, k, v must be [B, T, H, D] and g, beta "
				   "[B, T, H]");
	*m = (delta_dims){ q->shape[0], q->shape[1], q->shape[2], q->shape[3],
			   v->shape[3] };
	int64_t bth[3] = { m->b, m->t, m->h };
	if (memcmp(k->shape, q->shape, 4 * sizeof *q->shape) != 0 ||
	    memcmp(v->shape, bth, sizeof bth) != 0 ||
	    memcmp(g->shape, bth, sizeof bth) != 0 ||
	    memcmp(be->shape, bth, sizeof bth) != 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "k must have q's shape [B, T, H, Dk], v "
				   "[B, T, H, Dv] and g, beta [B, T, H]");
	return EPJ_OK;
}

epj_status ej_infer_GATED_DELTA(epj_ctx *ctx, const ej_call *c, ej_meta *out)
{
	delta_dims m;
	epj_status s = delta_check(ctx, c, 0, &m);
	if (s != EPJ_OK)
		return s;
	int64_t os[4] = { m.b, m.t, m.h, m.dv };
	ej_meta_set(&out[0], c->in[0]->dtype, 4, os);
	return EPJ_OK;
}

/* Every element of t, in row-major order, as doubles into dst. */
static void load_all(const epj_tensor *t, double *dst)
{
	int64_t idx[EPJ_MAX_DIMS] = { 0 };
	const char *base = ej_data(t);
	size_t es = ej_dtype_size(t->dtype);
	int64_t n = ej_numel(t->ndim, t->shape), i = 0;
	if (n == 0)
		return;
	do {
		dst[i++] = ej_load_f64(
		    base + (size_t)ej_offset_of(t->ndim, idx, t->stride) * es,
		    t->dtype);
	} while (ej_index_next(t->ndim, t->shape, idx));
}

/* dst (a fresh contiguous output) from n doubles. */
static void store_all(epj_tensor *t, const double *src, int64_t n)
{
	char *base = ej_data(t);
	size_t es = ej_dtype_size(t->dtype);
	for (int64_t i = 0; i < n; i++)
		ej_store_f64(base + (size_t)i * es, t->dtype, src[i]);
}

/* The inputs of one call as double arrays in [B, T, H, ...] order. */
typedef struct delta_in {
	delta_dims m;
	double *q, *k, *v, *g, *be;
} delta_in;

static void delta_in_free(delta_in *d)
{
	free(d->q); /* one block */
	memset(d, 0, sizeof *d);
}

static epj_status delta_in_load(epj_ctx *ctx, const ej_call *c, int iq,
				const delta_dims *m, delta_in *d)
{
	int64_t nk = m->b * m->t * m->h * m->dk,
		nv = m->b * m->t * m->h * m->dv;
	int64_t ns = m->b * m->t * m->h;
	d->m = *m;
	d->q = malloc(sizeof(double) * (size_t)(2 * nk + nv + 2 * ns + 1));
	if (!d->q)
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM, "out of memory");
	d->k = d->q + nk;
	d->v = d->k + nk;
	d->g = d->v + nv;
	d->be = d->g + ns;
	load_all(c->in[iq], d->q);
	load_all(c->in[iq + 1], d->k);
	load_all(c->in[iq + 2], d->v);
	load_all(c->in[iq + 3], d->g);
	load_all(c->in[iq + 4], d->be);
	return EPJ_OK;
}

/* One step of the forward on the state S [dk, dv] of (b, h) at time t:
 * S <- exp(g) S + k d^T; the delta into d (dv) and, when m is not NULL,
 * the read of the decayed state S~^T k into m. */
static void delta_step(const delta_in *x, int64_t b, int64_t t, int64_t h,
		       double *S, double *d, double *mo)
{
	const delta_dims *m = &x->m;
	const int64_t r = (b * m->t + t) * m->h + h;
	const double *k = x->k + r * m->dk, *v = x->v + r * m->dv;
	const double a = exp(x->g[r]), be = x->be[r];
	for (int64_t i = 0; i < m->dk * m->dv; i++)
		S[i] *= a;
	for (int64_t j = 0; j < m->dv; j++) {
		double s = 0;
		for (int64_t i = 0; i < m->dk; i++)
			s += S[i * m->dv + j] * k[i];
		if (mo)
			mo[j] = s;
		d[j] = be * (v[j] - s);
	}
	for (int64_t i = 0; i < m->dk; i++)
		for (int64_t j = 0; j < m->dv; j++)
			S[i * m->dv + j] += k[i] * d[j];
}

epj_status ej_kernel_GATED_DELTA(epj_ctx *ctx, const ej_call *c)
{
	delta_dims m;
	delta_in x;
	epj_status s = delta_check(ctx, c, 0, &m);
	if (s != EPJ_OK || (s = delta_in_load(ctx, c, 0, &m, &x)) != EPJ_OK)
		return s;
	int64_t no = m.b * m.t * m.h * m.dv;
	double *o = malloc(sizeof *o * (size_t)(no + m.dk * m.dv + m.dv + 1));
	if (!o) {
		delta_in_free(&x);
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM, "out of memory");
	}
	double *S = o + no, *d = S + m.dk * m.dv;
	for (int64_t b = 0; b < m.b; b++)
		for (int64_t h = 0; h < m.h; h++) {
			memset(S, 0, sizeof *S * (size_t)(m.dk * m.dv));
			for (int64_t t = 0; t < m.t; t++) {
				delta_step(&x, b, t, h, S, d, NULL);
				const int64_t r = (b * m.t + t) * m.h + h;
				const double *q = x.q + r * m.dk;
				for (int64_t j = 0; j < m.dv; j++) {
					double y = 0;
					for (int64_t i = 0; i < m.dk; i++)
						y += S[i * m.dv + j] * q[i];
					o[r * m.dv + j] = y;
				}
			}
		}
	store_all(c->out[0], o, no);
	free(o);
	delta_in_free(&x);
	return EPJ_OK;
}

epj_status ej_backward_GATED_DELTA(epj_ctx *ctx, const ej_call *c,
				   epj_tensor *const *grad_out,
				   const bool *needs, epj_tensor **grad_in)
{
	epj_tensor *in[6] = { grad_out[0], c->in[0], c->in[1],
			      c->in[2],	   c->in[3], c->in[4] };
	epj_tensor *outs[5] = { 0 };
	epj_status s = ej_dispatch(ctx, EJ_OP_GATED_DELTA_BACKWARD, in, 6,
				   c->attrs, outs, 5);
	if (s != EPJ_OK)
		return s;
	for (int i = 0; i < 5; i++) {
		if (needs[i])
			grad_in[i] = outs[i];
		else
			epj_tensor_free(outs[i]);
	}
	return EPJ_OK;
}

epj_tensor *epj_gated_delta(epj_ctx *ctx, epj_tensor *q, epj_tensor *k,
			    epj_tensor *v, epj_tensor *g, epj_tensor *beta)
{
	if (!q || !k || !v || !g || !beta)
		return NULL;
	ej_attrs at = ej_attrs_none();
	epj_tensor *in[5] = { q, k, v, g, beta }, *out = NULL;
	if (ej_dispatch(ctx, EJ_OP_GATED_DELTA, in, 5, &at, &out, 1) != EPJ_OK)
		return NULL;
	return out;
}

/* ---- GATED_DELTA_BACKWARD ------------------------------------------------ */

epj_status ej_infer_GATED_DELTA_BACKWARD(epj_ctx *ctx, const ej_call *c,
					 ej_meta *out)
{
	delta_dims m;
	epj_status s = delta_check(ctx, c, 1, &m);
	if (s != EPJ_OK || (s = ej_check_same_dtype(ctx, c, 0, 1)))
		return s;
	int64_t os[4] = { m.b, m.t, m.h, m.dv };
	const epj_tensor *go = c->in[0];
	if (go->ndim != 4 || memcmp(go->shape, os, sizeof os) != 0)
		return ej_op_error(ctx, c, EPJ_ERR_SHAPE,
				   "grad_out must be [B, T, H, Dv]");
	for (int i = 0; i < 5; i++)
		ej_meta_from(&out[i], c->in[1 + i]);
	return EPJ_OK;
}

epj_status ej_kernel_GATED_DELTA_BACKWARD(epj_ctx *ctx, const ej_call *c)
{
	delta_dims m;
	delta_in x;
	epj_status s = delta_check(ctx, c, 1, &m);
	if (s != EPJ_OK || (s = delta_in_load(ctx, c, 1, &m, &x)) != EPJ_OK)
		return s;
	const int64_t T = m.t, Dk = m.dk, Dv = m.dv, SS = Dk * Dv;
	const int64_t nk = m.b * T * m.h * Dk, nv = m.b * T * m.h * Dv;
	const int64_t ns = m.b * T * m.h, nck = T / CK + 1;
	/* do, dq, dk, dv, dg, dbeta; per (b, h): the kept states, the states
	 * of the current chunk, dS, S~, the delta, m, dd, dm */
	size_t n = (size_t)(nv + 2 * nk + nv + 2 * ns) +
		   (size_t)(SS * (nck + CK + 1 + 2)) + (size_t)(4 * Dv) + 1;
	double *go = malloc(sizeof *go * n);
	if (!go) {
		delta_in_free(&x);
		return ej_op_error(ctx, c, EPJ_ERR_NOMEM, "out of memory");
	}
	memset(go, 0, sizeof *go * n);
	double *dq = go + nv, *dk = dq + nk, *dv = dk + nk, *dg = dv + nv;
	double *db = dg + ns, *kept = db + ns, *chunk = kept + SS * nck;
	double *dS = chunk + SS * (CK + 1), *St = dS + SS, *dl = St + SS;
	double *mm = dl + Dv, *dd = mm + Dv, *dm = dd + Dv;
	load_all(c->in[0], go);
	for (int64_t b = 0; b < m.b; b++)
		for (int64_t h = 0; h < m.h; h++) {
			/* forward: keep S_{c CK - 1} (the state before step
			 * c CK; zeros for c = 0) */
			double *S = chunk;
			memset(S, 0, sizeof *S * (size_t)SS);
			for (int64_t t = 0; t < T; t++) {
				if (t % CK == 0)
					memcpy(kept + SS * (t / CK), S,
					       sizeof *S * (size_t)SS);
				delta_step(&x, b, t, h, S, dl, NULL);
			}
			memset(dS, 0, sizeof *dS * (size_t)SS);
			for (int64_t c0 = ((T - 1) / CK) * CK; c0 >= 0 && T > 0;
			     c0 -= CK) {
				/* chunk[j] = the state before step c0 + j */
				int64_t len = T - c0 < CK ? T - c0 : CK;
				memcpy(chunk, kept + SS * (c0 / CK),
				       sizeof *chunk * (size_t)SS);
				for (int64_t j = 0; j < len; j++) {
					memcpy(chunk + SS * (j + 1),
					       chunk + SS * j,
					       sizeof *chunk * (size_t)SS);
					delta_step(&x, b, c0 + j, h,
						   chunk + SS * (j + 1), dl,
						   NULL);
				}
				for (int64_t j = len - 1; j >= 0; j--) {
					const int64_t t = c0 + j;
					const int64_t r = (b * T + t) * m.h + h;
					const double *Sp = chunk + SS * j;
					const double *Sn = chunk + SS * (j + 1);
					const double *q = x.q + r * Dk;
					const double *k = x.k + r * Dk;
					const double *v = x.v + r * Dv;
					const double *dO = go + r * Dv;
					const double a = exp(x.g[r]);
					const double be = x.be[r];
					/* S~ and the forward's m, d */
					for (int64_t i = 0; i < SS; i++)
						St[i] = a * Sp[i];
					for (int64_t jj = 0; jj < Dv; jj++) {
						double s2 = 0;
						for (int64_t i = 0; i < Dk; i++)
							s2 += St[i * Dv + jj] *
							      k[i];
						mm[jj] = s2;
						dl[jj] = be * (v[jj] - s2);
					}
					/* o_t = S_t^T q */
					for (int64_t i = 0; i < Dk; i++) {
						double y = 0;
						for (int64_t jj = 0; jj < Dv;
						     jj++) {
							dS[i * Dv + jj] +=
							    q[i] * dO[jj];
							y += Sn[i * Dv + jj] *
							     dO[jj];
						}
						dq[r * Dk + i] = y;
					}
					/* S_t = S~ + k d^T */
					for (int64_t jj = 0; jj < Dv; jj++) {
						double s2 = 0;
						for (int64_t i = 0; i < Dk; i++)
							s2 += dS[i * Dv + jj] *
							      k[i];
						dd[jj] = s2;
					}
					double dbeta = 0;
					for (int64_t i = 0; i < Dk; i++) {
						double s2 = 0;
						for (int64_t jj = 0; jj < Dv;
						     jj++)
							s2 += dS[i * Dv + jj] *
							      dl[jj];
						dk[r * Dk + i] = s2;
					}
					for (int64_t jj = 0; jj < Dv; jj++) {
						dbeta +=
						    dd[jj] * (v[jj] - mm[jj]);
						dv[r * Dv + jj] = be * dd[jj];
						dm[jj] = -be * dd[jj];
					}
					db[r] = dbeta;
					/* m = S~^T k: dS~ = dS + k dm^T */
					for (int64_t i = 0; i < Dk; i++) {
						double s2 = 0;
						for (int64_t jj = 0; jj < Dv;
						     jj++) {
							s2 += St[i * Dv + jj] *
							      dm[jj];
							dS[i * Dv + jj] +=
							    k[i] * dm[jj];
						}
						dk[r * Dk + i] += s2;
					}
					/* S~ = a S_{t-1} */
					double da = 0;
					for (int64_t i = 0; i < SS; i++) {
						da += dS[i] * Sp[i];
						dS[i] *= a;
					}
					dg[r] = da * a;
				}
			}
		}
	for (int i = 0; i < 5; i++) {
		const double *src = i == 0   ? dq
				    : i == 1 ? dk
				    : i == 2 ? dv
				    : i == 3 ? dg
					     : db;
		store_all(c->out[i], src,
			  ej_numel(c->out[i]->ndim, c->out[i]->shape));
	}
	free(go);
	delta_in_free(&x);
	return EPJ_OK;
}
