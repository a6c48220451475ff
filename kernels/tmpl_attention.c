/* tmpl_attention.c -- host side of templates/attention.cuh (see
 * tmpl_attention.h): checks the sizes, picks the module (dtype, head-dim
 * registers) and the tile sizes that fit the shared memory, and launches
 *
 *   forward:  ej_attn_fwd (f32, f64)       -> out, lse
 *             ej_attn_fwd_tc (bf16: tensor cores)
 *   backward: ej_attn_bwd_dq   -> dq, di   (di = rowsum(dO * O), scratch
 *                                           from the context's allocator)
 *             ej_attn_bwd_dkdv -> dk, dv   (reads di)
 *   bf16 backward on tensor cores: ej_attn_bwd_dq_tc (dq, di), then
 *             ej_attn_bwd_dkdv_tc twice (dv, dk; per query head, summed
 *             by ej_attn_bwd_kv_sum when Hq > Hkv)
 *
 * The eager adapters of SDPA and SDPA_BACKWARD validate a call with the op
 * table's own shape inference and hand the tensors' strides to the kernels.
 */
#include "tmpl_attention.h"
#include "templates/args.h"

#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>

/* Geometry of the template (attention.cuh: EJ_AT_NT, EJ_AT_BQ, EJ_AT_BKB). */
#define AT_NT  128
#define AT_BQ  16
#define AT_BKB 16
/* Shared memory the tile choice aims to stay under (the default per-block
 * limit; the cuda device opts in to more when a launch needs it). */
#define AT_SMEM_SOFT (48u * 1024u)
#define AT_GRID_YZ   65535

static const ej_tmpl_kernel attn_kernels[] = {
	{ "ej_attn_fwd", "struct ej_attn_args" },
	{ "ej_attn_bwd_dq", "struct ej_attn_args" },
	{ "ej_attn_bwd_dkdv", "struct ej_attn_args" },
	/* bf16 modules only: */
	{ "ej_attn_fwd_tc", "struct ej_attn_args" },
	{ "ej_attn_bwd_dq_tc", "struct ej_attn_args" },
	{ "ej_attn_bwd_dkdv_tc", "struct ej_attn_args" },
	{ "ej_attn_bwd_kv_sum", "struct ej_attn_args" },
	{ "ej_attn_doc_spans", "struct ej_attn_args" },
	/* bf16 modules for head dims up to 128 only: */
	{ "ej_attn_bwd_dkdv1_tc", "struct ej_attn_args" },
};

/* The tensor-core forward's geometry (attention.cuh: EJ_TC_BQ, EJ_TC_BK). */
#define TC_BQ 64
/* dk and dv in one pass (ej_attn_bwd_dkdv1_tc) up to head dim 32 * this;
 * past it the two accumulators would spill, and two passes run. */
#define TC_ONE_PASS_DL 4
static int tc_bk(int dl)
{
	return dl <= 4 ? 64 : 32;
}

/* Launches of the tensor-core kernels (ej_attn_*_tc) so far (the tests
 * check that bf16 took the tensor-core path): a test hook in no header. */
static atomic_ulong tc_launches, span_launches;
unsigned long ej_attn_test_tc_launches(void);
unsigned long ej_attn_test_tc_launches(void)
{
	return atomic_load(&tc_launches);
}

/* Launches of ej_attn_doc_spans (the tensor-core backward with document
 * ids), for the tests. */
unsigned long ej_attn_test_span_launches(void);
unsigned long ej_attn_test_span_launches(void)
{
	return atomic_load(&span_launches);
}

/* Does dtype dt run on the tensor-core kernels? */
static bool use_tc(epj_dtype dt)
{
	return dt == EPJ_DTYPE_BF16;
}

static epj_dtype acc_dtype(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64 ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32;
}

static epj_status check_shape(epj_ctx *ctx, const char *what, epj_dtype dt,
			      const ej_attn_shape *m)
{
	if (dt != EPJ_DTYPE_F32 && dt != EPJ_DTYPE_BF16 && dt != EPJ_DTYPE_F64)
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"%s: dtype %s is not supported (f32, bf16, "
				"f64)",
				what, epj_dtype_name(dt));
	if (m->b < 0 || m->hq < 0 || m->hkv < 1 || m->t < 0 || m->s < 0 ||
	    m->d < 0 || m->dv < 0 || m->hq % m->hkv != 0)
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"%s: q [B=%lld, Hq=%lld, T=%lld, D=%lld], k/v "
				"[Hkv=%lld, S=%lld, Dv=%lld]: sizes must be "
				">= 0, Hkv >= 1 and Hq a multiple of Hkv",
				what, (long long)m->b, (long long)m->hq,
				(long long)m->t, (long long)m->d,
				(long long)m->hkv, (long long)m->s,
				(long long)m->dv);
	if (m->d > EJ_ATTN_MAX_HEAD_DIM || m->dv > EJ_ATTN_MAX_HEAD_DIM)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: head dims D=%lld, Dv=%lld: the template "
				"holds at most %d",
				what, (long long)m->d, (long long)m->dv,
				EJ_ATTN_MAX_HEAD_DIM);
	if (m->t > INT_MAX - 64 || m->s > INT_MAX - 64 ||
	    m->b * m->hq > INT_MAX || (m->t + AT_BQ - 1) / AT_BQ > AT_GRID_YZ ||
	    (m->s + AT_BKB - 1) / AT_BKB > AT_GRID_YZ)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: B*Hq=%lld, T=%lld, S=%lld exceed the "
				"launch grid (B*Hq < 2^31, T and S up to "
				"%d)",
				what, (long long)(m->b * m->hq),
				(long long)m->t, (long long)m->s,
				AT_GRID_YZ * AT_BQ);
	if (!(m->scale > 0) || !isfinite(m->scale))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s: scale %g must be finite and > 0", what,
				m->scale);
	if (m->mask && m->mask_dt != EPJ_DTYPE_I32 && m->mask_dt != dt &&
	    m->mask_dt != EPJ_DTYPE_F32)
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"%s: a mask of dtype %s (the dtype of q, f32 "
				"or i32)",
				what, epj_dtype_name(m->mask_dt));
	if (m->seg && m->t != m->s)
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"%s: document ids need T == S (T=%lld, "
				"S=%lld)",
				what, (long long)m->t, (long long)m->s);
	return EPJ_OK;
}

/* Registers for head dims up to 32 * dl (EJ_ATTN_DL). */
static int head_dl(const ej_attn_shape *m)
{
	int64_t hd = m->d > m->dv ? m->d : m->dv;
	return hd <= 32 ? 1 : (int)((hd + 31) / 32);
}

/* The module for dtype dt with registers for head dims up to 32 * dl; the
 * bf16 one has the tensor-core forward too. */
static epj_status get_module(epj_ctx *ctx, const char *device, epj_dtype dt,
			     const ej_attn_shape *m, ej_tmpl **out)
{
	int dl = head_dl(m);
	int code = dt == EPJ_DTYPE_F64 ? 2 : dt == EPJ_DTYPE_BF16 ? 1 : 0;
	char defs[96];
	snprintf(defs, sizeof defs,
		 "#define EJ_ATTN_DT %d\n#define EJ_ATTN_DL %d", code, dl);
	return ej_tmpl_get(ctx, device, "attention", defs, attn_kernels,
			   dt != EPJ_DTYPE_BF16	  ? 3
			   : dl <= TC_ONE_PASS_DL ? 9
						  : 8,
			   out);
}

static void args_init(struct ej_attn_args *a, const ej_attn_shape *m)
{
	memset(a, 0, sizeof *a);
	a->b = (int)m->b;
	a->hq = (int)m->hq;
	a->hkv = (int)m->hkv;
	a->t = (int)m->t;
	a->s = (int)m->s;
	a->d = (int)m->d;
	a->dv = (int)m->dv;
	a->causal = m->causal;
	a->scale = m->scale;
	a->seg = m->seg;
	a->sgs[0] = (long long)m->seg_st[0];
	a->sgs[1] = (long long)m->seg_st[1];
	a->seg8 = m->seg_i64;
	a->coff = m->top_left ? 0 : (int)(m->s - m->t);
	a->mask = m->mask;
	for (int i = 0; i < 4; i++)
		a->mks[i] = (long long)m->mask_st[i];
	a->mdt = m->mask_dt == EPJ_DTYPE_BF16  ? 1
		 : m->mask_dt == EPJ_DTYPE_F64 ? 2
		 : m->mask_dt == EPJ_DTYPE_I32 ? 3
					       : 0;
}

static void strides(long long *dst, const ej_attn_operand *o, int n)
{
	for (int i = 0; i < n; i++)
		dst[i] = (long long)o->st[i];
}

/* Shared bytes of the forward (key tile bk), the dq kernel (bk) and the
 * dkdv kernel (query tile bq); es: compute-type bytes. */
static size_t smem_fwd(const ej_attn_shape *m, int bk, size_t es)
{
	return (size_t)(AT_BQ * m->d + bk * (m->d + 1) + bk * m->dv +
			AT_BQ * bk) *
	       es;
}

static size_t smem_dq(const ej_attn_shape *m, int bk, size_t es)
{
	return (size_t)(AT_BQ * m->d + AT_BQ * m->dv + bk * (m->d + 1) +
			bk * (m->dv + 1) + AT_BQ * bk) *
	       es;
}

static size_t smem_dkdv(const ej_attn_shape *m, int bq, size_t es)
{
	return (size_t)(AT_BKB * (m->d + 1) + AT_BKB * (m->dv + 1) + bq * m->d +
			bq * m->dv + 2 * bq + 2 * bq * (AT_BKB + 1)) *
	       es;
}

/* Shared bytes of ej_attn_fwd_tc: bf16 tiles q [64][ld(D)], k [bk][ld(D)],
 * v [bk][ld(Dv)], ld(n) = n rounded up to 16, plus 8 (ej_tc_ld). */
static size_t smem_tc(const ej_attn_shape *m)
{
	size_t ldq = (size_t)(m->d + 15) / 16 * 16 + 8;
	size_t ldv = (size_t)(m->dv + 15) / 16 * 16 + 8;
	size_t bk = (size_t)tc_bk(head_dl(m));
	return ((TC_BQ + bk) * ldq + bk * ldv) * 2;
}

/* Shared bytes of ej_attn_bwd_dq_tc (q and dO [64], k and v [bk]) and of
 * ej_attn_bwd_dkdv_tc (k and v [64], q and dO [bk], lse and Di [bk] f32). */
static size_t smem_tc_bwd(const ej_attn_shape *m)
{
	size_t ldq = (size_t)(m->d + 15) / 16 * 16 + 8;
	size_t ldv = (size_t)(m->dv + 15) / 16 * 16 + 8;
	size_t bk = (size_t)tc_bk(head_dl(m));
	return (TC_BQ + bk) * (ldq + ldv) * 2 + 2 * bk * 4;
}

/* The largest tile of 32, 16, 8 whose shared memory fits the soft limit
 * (8 otherwise). */
static int pick_tile(size_t (*smem)(const ej_attn_shape *, int, size_t),
		     const ej_attn_shape *m, size_t es)
{
	int t = 32;
	while (t > 8 && smem(m, t, es) > AT_SMEM_SOFT)
		t /= 2;
	return t;
}

epj_status ej_tmpl_attention_fwd(epj_ctx *ctx, const char *device, epj_dtype dt,
				 const ej_attn_shape *m,
				 const ej_attn_operand *q,
				 const ej_attn_operand *k,
				 const ej_attn_operand *v, void *out, void *lse)
{
	epj_status st = check_shape(ctx, "attention forward", dt, m);
	if (st != EPJ_OK)
		return st;
	int64_t rows = m->b * m->hq * m->t;
	if (rows == 0)
		return EPJ_OK;
	ej_tmpl *mod = NULL;
	if ((st = get_module(ctx, device, dt, m, &mod)) != EPJ_OK)
		return st;
	size_t es = ej_dtype_size(acc_dtype(dt)), eo = ej_dtype_size(dt);
	struct ej_attn_args a;
	args_init(&a, m);
	a.q = q->p;
	a.k = k->p;
	a.v = v->p;
	strides(a.qs, q, 4);
	strides(a.ks, k, 4);
	strides(a.vs, v, 4);
	a.out = out;
	a.lse = lse;
	a.bk = pick_tile(smem_fwd, m, es);
	ej_launch_out lo[2] = { { out, (size_t)(rows * m->dv) * eo, eo },
				{ lse, (size_t)rows * es, es } };
	int n_out = 0;
	ej_launch_out outs[2];
	for (int i = 0; i < 2; i++)
		if (lo[i].bytes)
			outs[n_out++] = lo[i];
	/* bf16: the tensor-core kernel, 64 queries a block */
	bool tc = use_tc(dt);
	int bq = tc ? TC_BQ : AT_BQ;
	ej_launch l = { .grid = { (unsigned)(m->b * m->hq),
				  (unsigned)((m->t + bq - 1) / bq), 1 },
			.block = { AT_NT, 1, 1 },
			.smem = tc ? smem_tc(m) : smem_fwd(m, a.bk, es),
			.args = &a,
			.args_size = sizeof a,
			.outs = outs,
			.n_out = n_out };
	if (tc)
		atomic_fetch_add(&tc_launches, 1);
	return ej_tmpl_launch(ctx, mod, tc ? "ej_attn_fwd_tc" : "ej_attn_fwd",
			      &l);
}

/* One launch of a dk/dv kernel: a block per 64 keys and query head (grid
 * B * Hq x ceil(S / 64)), writing outs (none when the first is empty). */
static epj_status launch_kv(epj_ctx *ctx, ej_tmpl *mod, const ej_attn_shape *m,
			    struct ej_attn_args *a, const char *name,
			    size_t smem, ej_launch_out *outs, int n_out)
{
	ej_launch l = { .grid = { (unsigned)(m->b * m->hq),
				  (unsigned)((m->s + TC_BQ - 1) / TC_BQ), 1 },
			.block = { AT_NT, 1, 1 },
			.smem = smem,
			.args = a,
			.args_size = sizeof *a,
			.outs = outs,
			.n_out = outs->bytes ? n_out : 0 };
	atomic_fetch_add(&tc_launches, 1);
	return ej_tmpl_launch(ctx, mod, name, &l);
}

/* The backward on the tensor-core kernels (a filled in, di allocated):
 * dq and di, then dv and dk in two passes over the keys (a block per 64
 * keys and query head: B * Hq * ceil(S / 64) blocks); with Hq > Hkv the
 * passes write f32 partials per query head, which ej_attn_bwd_kv_sum adds
 * up in head order (no atomics: the same bits for any schedule); up to
 * head dim 128 one pass (ej_attn_bwd_dkdv1_tc) does both.  With document
 * ids, ej_attn_doc_spans first finds the queries each block of keys can
 * meet, and the passes visit only those. */
static epj_status bwd_tc(epj_ctx *ctx, ej_tmpl *mod, const ej_attn_shape *m,
			 struct ej_attn_args *a)
{
	const ej_device *dev = ej_tmpl_device(mod);
	int64_t rows = m->b * m->hq * m->t, krows = m->b * m->hkv * m->s;
	size_t smem = smem_tc_bwd(m);
	epj_status st = EPJ_OK;
	if (rows > 0) {
		ej_launch_out lo[2] = { { a->grad_q, (size_t)(rows * m->d) * 2,
					  2 },
					{ a->di, (size_t)rows * 4, 4 } };
		ej_launch l = {
			.grid = { (unsigned)(m->b * m->hq),
				  (unsigned)((m->t + TC_BQ - 1) / TC_BQ), 1 },
			.block = { AT_NT, 1, 1 },
			.smem = smem,
			.args = a,
			.args_size = sizeof *a,
			.outs = m->d > 0 ? lo : lo + 1,
			.n_out = m->d > 0 ? 2 : 1
		};
		atomic_fetch_add(&tc_launches, 1);
		st = ej_tmpl_launch(ctx, mod, "ej_attn_bwd_dq_tc", &l);
	}
	if (st != EPJ_OK || krows == 0)
		return st;
	bool split = m->hq > m->hkv;
	size_t np = (size_t)(m->b * m->hq * m->s);
	size_t pbytes = np * (size_t)(m->d + m->dv) * 4;
	if (split && pbytes > 0) {
		a->kv_part = ej_tmpl_scratch_alloc(
		    ctx, dev, pbytes, "attention backward: dk, dv per head");
		if (!a->kv_part)
			return EPJ_ERR_NOMEM;
	}
	int64_t nkb = (m->s + TC_BQ - 1) / TC_BQ;
	if (a->seg && m->t > 0) {
		/* the queries each block of keys meets (documents) */
		size_t sbytes = (size_t)(m->b * nkb) * 2 * sizeof(int);
		a->spans = ej_tmpl_scratch_alloc(ctx, dev, sbytes,
						 "attention backward: spans");
		if (!a->spans)
			st = EPJ_ERR_NOMEM;
		ej_launch_out lo = { a->spans, sbytes, 4 };
		ej_launch l = { .grid = { (unsigned)m->b, (unsigned)nkb, 1 },
				.block = { AT_NT, 1, 1 },
				.args = a,
				.args_size = sizeof *a,
				.outs = &lo,
				.n_out = 1 };
		if (st == EPJ_OK) {
			atomic_fetch_add(&span_launches, 1);
			st = ej_tmpl_launch(ctx, mod, "ej_attn_doc_spans", &l);
		}
	}
	if (st == EPJ_OK && head_dl(m) <= TC_ONE_PASS_DL) {
		/* one pass writes both (or both partials) */
		ej_launch_out lo[2] = {
			{ a->grad_k, (size_t)(krows * m->d) * 2, 2 },
			{ a->grad_v, (size_t)(krows * m->dv) * 2, 2 }
		};
		if (a->kv_part)
			lo[0] = (ej_launch_out){ a->kv_part, pbytes, 4 };
		int n_out = a->kv_part ? 1 : 2;
		ej_launch_out *o = lo;
		if (!a->kv_part && m->d == 0) {
			o = lo + 1;
			n_out = 1;
		}
		st = launch_kv(ctx, mod, m, a, "ej_attn_bwd_dkdv1_tc", smem, o,
			       n_out);
	}
	for (int part = 0;
	     part < 2 && st == EPJ_OK && head_dl(m) > TC_ONE_PASS_DL; part++) {
		a->part = part;
		size_t w = (size_t)(part ? m->d : m->dv);
		ej_launch_out lo = { part ? a->grad_k : a->grad_v,
				     (size_t)krows * w * 2, 2 };
		if (a->kv_part)
			lo = (ej_launch_out){ (char *)a->kv_part +
						  (part ? 0 : np * m->d * 4),
					      np * w * 4, 4 };
		st = launch_kv(ctx, mod, m, a, "ej_attn_bwd_dkdv_tc", smem, &lo,
			       1);
	}
	if (st == EPJ_OK && a->kv_part) {
		ej_launch_out lo[2] = {
			{ a->grad_k, (size_t)(krows * m->d) * 2, 2 },
			{ a->grad_v, (size_t)(krows * m->dv) * 2, 2 }
		};
		int64_t n = krows * (m->d + m->dv),
			nb = (n + AT_NT - 1) / AT_NT;
		ej_launch l = { .grid = { (unsigned)(nb < 65535 ? nb : 65535),
					  1, 1 },
				.block = { AT_NT, 1, 1 },
				.args = a,
				.args_size = sizeof *a,
				.outs = m->d > 0 ? lo : lo + 1,
				.n_out = m->d > 0 ? 2 : 1 };
		st = ej_tmpl_launch(ctx, mod, "ej_attn_bwd_kv_sum", &l);
	}
	ej_tmpl_scratch_free(ctx, dev, a->kv_part);
	ej_tmpl_scratch_free(ctx, dev, a->spans);
	a->kv_part = NULL;
	a->spans = NULL;
	return st;
}

epj_status
ej_tmpl_attention_bwd(epj_ctx *ctx, const char *device, epj_dtype dt,
		      const ej_attn_shape *m, const ej_attn_operand *go,
		      const ej_attn_operand *q, const ej_attn_operand *k,
		      const ej_attn_operand *v, const ej_attn_operand *o,
		      const ej_attn_operand *lse, void *dq, void *dk, void *dv)
{
	epj_status st = check_shape(ctx, "attention backward", dt, m);
	if (st != EPJ_OK)
		return st;
	int64_t rows = m->b * m->hq * m->t, krows = m->b * m->hkv * m->s;
	if (krows == 0 && rows == 0)
		return EPJ_OK;
	ej_tmpl *mod = NULL;
	if ((st = get_module(ctx, device, dt, m, &mod)) != EPJ_OK)
		return st;
	const ej_device *dev = ej_tmpl_device(mod);
	size_t es = ej_dtype_size(acc_dtype(dt)), eo = ej_dtype_size(dt);
	struct ej_attn_args a;
	args_init(&a, m);
	a.q = q->p;
	a.k = k->p;
	a.v = v->p;
	a.o = o->p;
	a.go = go->p;
	a.lse_in = lse->p;
	strides(a.qs, q, 4);
	strides(a.ks, k, 4);
	strides(a.vs, v, 4);
	strides(a.os, o, 4);
	strides(a.gs, go, 4);
	strides(a.ls, lse, 3);
	a.grad_q = dq;
	a.grad_k = dk;
	a.grad_v = dv;
	void *di = NULL;
	if (rows > 0) {
		/* the context's caching allocator (no cuMemAlloc/cuMemFree
		 * per layer and step) */
		di = ej_tmpl_scratch_alloc(ctx, dev, (size_t)rows * es,
					   "attention backward: row sums");
		if (!di)
			return EPJ_ERR_NOMEM;
		a.di = di;
	}
	if (use_tc(dt)) {
		st = bwd_tc(ctx, mod, m, &a);
		ej_tmpl_scratch_free(ctx, dev, di);
		return st;
	}
	if (rows > 0) {
		/* dq and di: one block per 16 queries of a (b, h) */
		a.bk = pick_tile(smem_dq, m, es);
		ej_launch_out lo[2] = { { dq, (size_t)(rows * m->d) * eo, eo },
					{ di, (size_t)rows * es, es } };
		ej_launch l = {
			.grid = { (unsigned)(m->b * m->hq),
				  (unsigned)((m->t + AT_BQ - 1) / AT_BQ), 1 },
			.block = { AT_NT, 1, 1 },
			.smem = smem_dq(m, a.bk, es),
			.args = &a,
			.args_size = sizeof a,
			.outs = m->d > 0 ? lo : lo + 1,
			.n_out = m->d > 0 ? 2 : 1
		};
		st = ej_tmpl_launch(ctx, mod, "ej_attn_bwd_dq", &l);
	}
	if (st == EPJ_OK && krows > 0) {
		/* dk and dv: one block per 16 keys of a (b, kv head) */
		a.bq = pick_tile(smem_dkdv, m, es);
		ej_launch_out lo[2] = { { dk, (size_t)(krows * m->d) * eo, eo },
					{ dv, (size_t)(krows * m->dv) * eo,
					  eo } };
		int n_out = 0;
		ej_launch_out outs[2];
		for (int i = 0; i < 2; i++)
			if (lo[i].bytes)
				outs[n_out++] = lo[i];
		ej_launch l = {
			.grid = { (unsigned)(m->b * m->hkv),
				  (unsigned)((m->s + AT_BKB - 1) / AT_BKB), 1 },
			.block = { AT_NT, 1, 1 },
			.smem = smem_dkdv(m, a.bq, es),
			.args = &a,
			.args_size = sizeof a,
			.outs = outs,
			.n_out = n_out
		};
		st = ej_tmpl_launch(ctx, mod, "ej_attn_bwd_dkdv", &l);
	}
	ej_tmpl_scratch_free(ctx, dev, di);
	return st;
}

/* ---- eager adapters ------------------------------------------------------
 */

/* Element 0 of t (NULL for a tensor without storage: no elements). */
static void *data_of(const epj_tensor *t)
{
	return t->storage ? ej_data(t) : NULL;
}

static ej_attn_operand operand_of(const epj_tensor *t)
{
	ej_attn_operand o = { data_of(t), { 0, 0, 0, 0 } };
	for (int i = 0; i < t->ndim && i < 4; i++)
		o.st[i] = t->stride[i];
	return o;
}

/* The call's sizes from q, k, v = in[iq..iq+2] and its attrs (the scale
 * resolved as the op resolves it). */
static ej_attn_shape shape_of(const ej_call *c, int iq)
{
	const epj_tensor *q = c->in[iq], *k = c->in[iq + 1], *v = c->in[iq + 2];
	ej_attn_shape m = { .b = q->shape[0],
			    .hq = q->shape[1],
			    .hkv = k->shape[1],
			    .t = q->shape[2],
			    .s = k->shape[2],
			    .d = q->shape[3],
			    .dv = v->shape[3] };
	const ej_attrs *at = c->attrs;
	m.causal = at && at->n_i > 0 && at->i[0] != 0;
	int64_t flags = at && at->n_i > 1 ? at->i[1] : 0;
	m.top_left = (flags & 2) != 0;
	double sc = at && at->n_f > 0 ? at->f[0] : 0.0;
	m.scale = sc > 0 ? sc : 1.0 / sqrt((double)(m.d > 1 ? m.d : 1));
	/* the document ids, then the mask (flag 1), follow the op's other
	 * inputs; a broadcast dim of the mask reads stride 0 */
	int is = iq == 0 ? 3 : 6;
	if (flags & 1) {
		const epj_tensor *x = c->in[c->n_in - 1];
		m.mask = data_of(x);
		m.mask_dt = x->dtype;
		for (int i = 0; i < 4; i++)
			m.mask_st[i] = x->shape[i] == 1 ? 0 : x->stride[i];
	}
	if (c->n_in - ((flags & 1) ? 1 : 0) > is) {
		const epj_tensor *g = c->in[is];
		m.seg = data_of(g);
		m.seg_st[0] = g->stride[0];
		m.seg_st[1] = g->stride[1];
		m.seg_i64 = g->dtype == EPJ_DTYPE_I64;
	}
	return m;
}

/* Validates c with the op's shape inference and requires its outputs to be
 * contiguous and of the inferred shapes. */
static epj_status check_call(epj_ctx *ctx, ej_call *c, int op, int n_in,
			     int n_out)
{
	const char *name = ej_ops[op].name;
	/* n_in, or up to two more: the document ids, the mask (the op's
	 * shape inference checks which) */
	if (c->n_in < n_in || c->n_in > n_in + 2 || c->n_out != n_out)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"%s (cuda template): %d inputs and %d outputs "
				"given, %d (or %d) and %d expected",
				name, c->n_in, c->n_out, n_in, n_in + 1, n_out);
	ej_meta meta[3];
	epj_status st = ej_ops[op].infer(ctx, c, meta);
	if (st != EPJ_OK)
		return st;
	for (int i = 0; i < n_out; i++) {
		const epj_tensor *t = c->out[i];
		if (t->dtype != meta[i].dtype || t->ndim != meta[i].ndim ||
		    memcmp(t->shape, meta[i].shape,
			   sizeof(int64_t) * (size_t)t->ndim) != 0)
			return ej_error(ctx, EPJ_ERR_SHAPE,
					"%s (cuda template): output %d is %s "
					"of %d dims, not as the op infers",
					name, i, epj_dtype_name(t->dtype),
					t->ndim);
		if (!ej_is_contiguous(t))
			return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
					"%s (cuda template): output %d is not "
					"contiguous",
					name, i);
	}
	return EPJ_OK;
}

epj_status ej_cuda_op_sdpa(epj_ctx *ctx, ej_call *c)
{
	epj_status st = check_call(ctx, c, EJ_OP_SDPA, 3, 2);
	if (st != EPJ_OK)
		return st;
	ej_attn_shape m = shape_of(c, 0);
	ej_attn_operand q = operand_of(c->in[0]), k = operand_of(c->in[1]),
			v = operand_of(c->in[2]);
	return ej_tmpl_attention_fwd(ctx, ctx->dev->name, c->in[0]->dtype, &m,
				     &q, &k, &v, data_of(c->out[0]),
				     data_of(c->out[1]));
}

epj_status ej_cuda_op_sdpa_backward(epj_ctx *ctx, ej_call *c)
{
	epj_status st = check_call(ctx, c, EJ_OP_SDPA_BACKWARD, 6, 3);
	if (st != EPJ_OK)
		return st;
	ej_attn_shape m = shape_of(c, 1);
	ej_attn_operand go = operand_of(c->in[0]), q = operand_of(c->in[1]),
			k = operand_of(c->in[2]), v = operand_of(c->in[3]),
			o = operand_of(c->in[4]), lse = operand_of(c->in[5]);
	return ej_tmpl_attention_bwd(
	    ctx, ctx->dev->name, c->in[1]->dtype, &m, &go, &q, &k, &v, &o, &lse,
	    data_of(c->out[0]), data_of(c->out[1]), data_of(c->out[2]));
}
