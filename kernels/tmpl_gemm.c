/* tmpl_gemm.c -- the GEMM template's host side (see tmpl_gemm.h).
 *
 *   ej_gemm(desc)
 *       -> check dtypes, sizes, group table
 *       -> kernel: ej_gemm_bf16 (tensor cores) or ej_gemm_simt_f32/f64
 *       -> per operand: may tiles load with 16-byte cp.async?  (the
 *          contiguous stride is 1, the other stride and the batch strides
 *          are multiples of 8 elements, the base is 16-byte aligned)
 *       -> grid (n tiles, m tiles or the groups' tiles, batches), launch
 *          through ej_tmpl_get / ej_tmpl_launch (one module, no defines)
 *
 * The op adapters map tensors onto descriptors: strides come straight from
 * the tensors (any view: transposed, sliced, expanded), matmul's broadcast
 * batch dims become batch strides (0 on a broadcast dim), two batch dims go
 * to the kernel and any further leading ones are launched one by one.
 */
#include "tmpl_gemm.h"

#include "cublaslt.h"
#include "templates/args.h"
#include "tmpl.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

/* tile sizes of templates/gemm.cuh */
#define BF_BM	    64
#define BF_BN	    64
#define SIMT_BM	    32
#define SIMT_BN	    32
#define MAX_GRID_YZ 65535

static const ej_tmpl_kernel gemm_kernels[] = {
	{ "ej_gemm_bf16", "struct ej_gemm_args" },
	{ "ej_gemm_simt_f32", "struct ej_gemm_args" },
	{ "ej_gemm_simt_f64", "struct ej_gemm_args" },
};

void ej_gemm_desc_init(ej_gemm_desc *d, epj_dtype dt, int64_t m, int64_t n,
		       int64_t k)
{
	memset(d, 0, sizeof *d);
	d->dtype = dt;
	d->out_dtype = dt;
	d->bias_dtype = dt;
	d->res_dtype = dt;
	d->m = m;
	d->n = n;
	d->k = k;
	d->ldc = n;
	d->nb0 = 1;
	d->nb1 = 1;
	d->bias_cs = 1;
	d->act = EJ_GEMM_ACT_NONE;
}

void ej_gemm_set_a(ej_gemm_desc *d, const void *a, int64_t lda, bool ta)
{
	d->a = a;
	d->a_rs = ta ? 1 : lda;
	d->a_cs = ta ? lda : 1;
}

void ej_gemm_set_b(ej_gemm_desc *d, const void *b, int64_t ldb, bool tb)
{
	d->b = b;
	d->b_rs = tb ? 1 : ldb;
	d->b_cs = tb ? ldb : 1;
}

static bool mult8(int64_t v)
{
	return v % 8 == 0;
}

/* cp.async for a [rows, k] operand with strides rs (rows) and cs (k):
 * the kernel keeps it k-major unless rows are the contiguous direction
 * (the same test as the template's) and copies 8 elements along it. */
static bool vec_ok(const void *p, int64_t rs, int64_t cs, int64_t s0,
		   int64_t s1, bool grouped_rows)
{
	bool kmaj = !(rs == 1 && cs != 1);
	if ((uintptr_t)p % 16 || !mult8(s0) || !mult8(s1))
		return false;
	if (kmaj)
		return cs == 1 && mult8(rs);
	/* grouped row offsets move a rows-contiguous operand by single
	 * elements: no alignment */
	return !grouped_rows && rs == 1 && mult8(cs);
}

static bool out_dtype_ok(epj_dtype in, epj_dtype x)
{
	return in == EPJ_DTYPE_BF16
		   ? (x == EPJ_DTYPE_BF16 || x == EPJ_DTYPE_F32)
		   : x == in;
}

/* The kernels' arguments for descriptor d (checked) with nb0 x nb1
 * batches. */
static void gemm_fill_args(const ej_gemm_desc *d, int64_t nb0, int64_t nb1,
			   struct ej_gemm_args *ap)
{
	const bool grouped = d->group_off != NULL;
	const bool bf = d->dtype == EPJ_DTYPE_BF16;
	struct ej_gemm_args a;
	memset(&a, 0, sizeof a);
	a.a = d->a;
	a.b = d->b;
	a.c = d->c;
	a.bias = d->bias;
	a.res = d->res;
	a.goff = (const long long *)d->group_off;
	a.m = d->m;
	a.n = d->n;
	a.k = d->k;
	/* strides of size-1 dims never matter: 0 lets the vector test pass */
	a.a_rs = !grouped && d->m <= 1 ? 0 : d->a_rs;
	a.a_cs = d->k <= 1 ? 0 : d->a_cs;
	a.b_rs = d->k <= 1 ? 0 : d->b_rs;
	a.b_cs = d->n <= 1 ? 0 : d->b_cs;
	a.ldc = d->ldc;
	a.ldr = d->ldr;
	a.bias_cs = d->bias_cs;
	a.sa0 = nb0 > 1 ? d->sa0 : 0;
	a.sa1 = nb1 > 1 ? d->sa1 : 0;
	a.sb0 = nb0 > 1 || grouped ? d->sb0 : 0;
	a.sb1 = nb1 > 1 ? d->sb1 : 0;
	a.sc0 = d->sc0;
	a.sc1 = d->sc1;
	a.sr0 = d->sr0;
	a.sr1 = d->sr1;
	a.sbias = d->sbias;
	a.nb1 = (int)nb1;
	a.groups = grouped ? d->groups : 0;
	if (bf && d->k > 0) {
		a.a_vec = vec_ok(d->a, a.a_rs, a.a_cs, a.sa0, a.sa1, grouped);
		/* B as [n, k]: rows walk n (b_cs), k walks b_rs */
		a.b_vec = vec_ok(d->b, a.b_cs, a.b_rs, a.sb0, a.sb1, false);
	}
	a.c_bf16 = d->out_dtype == EPJ_DTYPE_BF16;
	a.bias_bf16 = d->bias && d->bias_dtype == EPJ_DTYPE_BF16;
	a.res_bf16 = d->res && d->res_dtype == EPJ_DTYPE_BF16;
	a.act = (int)d->act;
	*ap = a;
}

/* The descriptor's dtypes, sizes and pointers are ones the kernels take;
 * *nb0, *nb1: its batch counts (at least 1). */
static epj_status gemm_check(epj_ctx *ctx, const ej_gemm_desc *d, int64_t *nb0_,
			     int64_t *nb1_)
{
	epj_dtype dt = d->dtype;
	if (dt != EPJ_DTYPE_BF16 && dt != EPJ_DTYPE_F32 && dt != EPJ_DTYPE_F64)
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"gemm: inputs are %s (the kernels take bf16, "
				"f32 or f64)",
				epj_dtype_name(dt));
	if (!out_dtype_ok(dt, d->out_dtype) ||
	    (d->bias && !out_dtype_ok(dt, d->bias_dtype)) ||
	    (d->res && !out_dtype_ok(dt, d->res_dtype)))
		return ej_error(
		    ctx, EPJ_ERR_DTYPE,
		    "gemm: %s inputs with output %s, bias %s, residual %s "
		    "(bf16 inputs take f32 or bf16 for these, f32 and f64 "
		    "inputs their own dtype)",
		    epj_dtype_name(dt), epj_dtype_name(d->out_dtype),
		    d->bias ? epj_dtype_name(d->bias_dtype) : "none",
		    d->res ? epj_dtype_name(d->res_dtype) : "none");
	bool grouped = d->group_off != NULL;
	int64_t nb0 = d->nb0 < 1 ? 1 : d->nb0, nb1 = d->nb1 < 1 ? 1 : d->nb1;
	*nb0_ = nb0;
	*nb1_ = nb1;
	if (d->m < 0 || d->n < 0 || d->k < 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"gemm: negative size m=%lld n=%lld k=%lld",
				(long long)d->m, (long long)d->n,
				(long long)d->k);
	if ((unsigned)d->act > EJ_GEMM_ACT_GELU)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"gemm: activation %d (none, silu, gelu)",
				(int)d->act);
	if (grouped && (d->groups < 1 || nb0 * nb1 != 1))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"gemm: grouped GEMM with %d groups and %lld "
				"batches (at least one group, no batches)",
				d->groups, (long long)(nb0 * nb1));
	if (d->m == 0 || d->n == 0)
		return EPJ_OK; /* nothing to check: nothing runs */
	if (d->m > 1 && d->ldc < d->n)
		return ej_error(ctx, EPJ_ERR_INVALID, "gemm: ldc %lld < n %lld",
				(long long)d->ldc, (long long)d->n);
	if (!d->c || (d->k > 0 && (!d->a || !d->b)))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"gemm: missing A, B or C pointer (m=%lld "
				"n=%lld k=%lld)",
				(long long)d->m, (long long)d->n,
				(long long)d->k);
	return EPJ_OK;
}

epj_status ej_gemm(epj_ctx *ctx, const char *device, const ej_gemm_desc *d)
{
	const epj_dtype dt = d->dtype;
	const bool grouped = d->group_off != NULL;
	int64_t nb0 = 1, nb1 = 1;
	epj_status st0 = gemm_check(ctx, d, &nb0, &nb1);
	if (st0 != EPJ_OK || d->m == 0 || d->n == 0)
		return st0;
	bool bf = dt == EPJ_DTYPE_BF16;
	int64_t bm = bf ? BF_BM : SIMT_BM, bn = bf ? BF_BN : SIMT_BN;
	int64_t gx = (d->n + bn - 1) / bn;
	int64_t gy =
	    grouped ? (d->m + bm - 1) / bm + d->groups : (d->m + bm - 1) / bm;
	if (gx > INT32_MAX || gy > MAX_GRID_YZ || nb0 * nb1 > MAX_GRID_YZ)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"gemm: m=%lld n=%lld with %lld batches (or "
				"%d groups) needs a grid of (%lld, %lld, %lld) "
				"blocks, beyond (2^31-1, 65535, 65535)",
				(long long)d->m, (long long)d->n,
				(long long)(nb0 * nb1), d->groups,
				(long long)gx, (long long)gy,
				(long long)(nb0 * nb1));

	struct ej_gemm_args a;
	gemm_fill_args(d, nb0, nb1, &a);

	/* C as one dense block: poisoned and race-checked on cuda-sim */
	size_t csz = ej_dtype_size(d->out_dtype);
	int64_t mn = d->m * d->n;
	bool dense = (d->m <= 1 || d->ldc == d->n) &&
		     (nb1 <= 1 || d->sc1 == mn) &&
		     (nb0 <= 1 || d->sc0 == nb1 * mn) && d->res != d->c;
	ej_launch_out lo = { d->c, (size_t)(mn * nb0 * nb1) * csz, csz };

	/* cuda-sim runs a grid twice (race check) from the same C: a residual
	 * read from C itself would be added twice, so it reads a copy (host
	 * memory on cuda-sim) and C becomes a checked output */
	void *res_copy = NULL;
	const ej_device_desc *dd = ej_device_find(device);
	if (d->res && d->res == d->c && dd && dd->reruns_grids) {
		int64_t span = grouped
				   ? (d->m - 1) * d->ldc + d->n
				   : (nb0 - 1) * d->sc0 + (nb1 - 1) * d->sc1 +
					 (d->m - 1) * d->ldc + d->n;
		size_t bytes = (size_t)span * ej_dtype_size(d->res_dtype);
		res_copy = malloc(bytes);
		if (!res_copy)
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"gemm: out of memory copying the "
					"residual (%zu bytes)",
					bytes);
		memcpy(res_copy, d->c, bytes);
		a.res = res_copy;
		dense = (d->m <= 1 || d->ldc == d->n) &&
			(nb1 <= 1 || d->sc1 == mn) &&
			(nb0 <= 1 || d->sc0 == nb1 * mn);
	}

	ej_tmpl *m = NULL;
	epj_status st =
	    ej_tmpl_get(ctx, device, "gemm", NULL, gemm_kernels, 3, &m);
	if (st != EPJ_OK) {
		free(res_copy);
		return st;
	}
	const char *kernel = bf			   ? "ej_gemm_bf16"
			     : dt == EPJ_DTYPE_F32 ? "ej_gemm_simt_f32"
						   : "ej_gemm_simt_f64";
	ej_launch l = { .grid = { (unsigned)gx, (unsigned)gy,
				  (unsigned)(nb0 * nb1) },
			.block = { bf ? 128u : 256u, 1, 1 },
			.smem = 0,
			.args = &a,
			.args_size = sizeof a,
			.outs = &lo,
			.n_out = dense ? 1 : 0 };
	st = ej_tmpl_launch(ctx, m, kernel, &l);
	free(res_copy);
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "gemm %s m=%lld n=%lld k=%lld",
				epj_dtype_name(dt), (long long)d->m,
				(long long)d->n, (long long)d->k);
	return st;
}

/* ---- op adapters ---------------------------------------------------------
 */

static const char *ctx_device(epj_ctx *ctx)
{
	return ctx->dev->name;
}

/* A batched problem over nbd leading dims shape[0..nbd): per operand
 * (0: A, 1: B, 2: C) the stride of each batch dim. */
typedef struct batch_plan {
	int nbd;
	int64_t shape[EPJ_MAX_DIMS];
	int64_t st[3][EPJ_MAX_DIMS];
} batch_plan;

/* Merges adjacent batch dims that every operand walks as one, and drops
 * size-1 dims. */
static void plan_merge(batch_plan *p)
{
	int n = 0;
	for (int d = 0; d < p->nbd; d++) {
		if (p->shape[d] == 1)
			continue;
		if (n > 0) {
			bool ok = true;
			for (int o = 0; o < 3; o++)
				ok = ok && p->st[o][n - 1] ==
					       p->st[o][d] * p->shape[d];
			if (ok) {
				p->shape[n - 1] *= p->shape[d];
				for (int o = 0; o < 3; o++)
					p->st[o][n - 1] = p->st[o][d];
				continue;
			}
		}
		p->shape[n] = p->shape[d];
		for (int o = 0; o < 3; o++)
			p->st[o][n] = p->st[o][d];
		n++;
	}
	p->nbd = n;
}

/* ---- the GEMM path: cuBLASLt or the template -----------------------------
 * On a cuda context a GEMM runs through cuBLASLt (lib/cublaslt.c) when the
 * library loaded and can express the problem (bf16 or f32 inputs, fp32
 * accumulation, each operand dense along one of its dims, bias as the bias
 * epilogue, an accumulating residual as beta = 1, no activation); else, and
 * on cuda-sim, through the template.  The choice is made once per problem
 * class (sizes, dtypes, transposes, epilogue) and kept in the context's
 * table: a problem cuBLASLt's heuristic finds no algorithm for runs the
 * template from then on (gemm.cublaslt_refused).  EPJIT_GEMM=template,
 * read at a context's first GEMM, forces the template. */

typedef struct gsel_key {
	int64_t m, n, k, batches;
	int dtype, out_dtype;
	bool ta, tb, bias, beta;
} gsel_key;

typedef struct gsel_entry {
	gsel_key key;
	bool lt; /* cuBLASLt; false: the template */
} gsel_entry;

typedef struct gsel {
	bool forced;	  /* EPJIT_GEMM=template */
	bool lt_absent;	  /* cuBLASLt did not load */
	ej_allocator *ws; /* the handle's workspace, over ctx's device */
	ej_cublaslt *lt;
	gsel_entry *tab;
	int n_tab, cap_tab;
	/* host copies of index tensors (ej_index_pin) */
	struct counts_pin *pins;
	int n_pins, cap_pins;
} gsel;

static void pins_free(gsel *s);

static void gsel_free(void *p)
{
	gsel *s = p;
	pins_free(s);
	if (s->lt)
		ej_cublaslt_free(s->lt);
	if (s->ws)
		ej_allocator_free(s->ws);
	free(s->tab);
	free(s);
}

/* ctx's selector, made at its first GEMM; NULL with ctx's error set. */
static gsel *gsel_get(epj_ctx *ctx)
{
	if (ctx->gemm_sel)
		return ctx->gemm_sel;
	const char *v = getenv("EPJIT_GEMM");
	if (v && *v && strcmp(v, "auto") != 0 && strcmp(v, "template") != 0) {
		ej_error(ctx, EPJ_ERR_INVALID,
			 "EPJIT_GEMM=\"%s\": unknown GEMM path (known: auto, "
			 "template)",
			 v);
		return NULL;
	}
	gsel *s = calloc(1, sizeof *s);
	if (!s) {
		ej_error(ctx, EPJ_ERR_NOMEM, "gemm: out of memory");
		return NULL;
	}
	s->forced = v && strcmp(v, "template") == 0;
	s->lt_absent = !s->forced && !ej_cublaslt_available(NULL);
	ctx->gemm_sel = s;
	ctx->gemm_sel_free = gsel_free;
	return s;
}

/* The handle, made at the first GEMM cuBLASLt takes; NULL with ctx's
 * error set (a failing library call). */
static ej_cublaslt *gsel_handle(epj_ctx *ctx, gsel *s)
{
	if (s->lt)
		return s->lt;
	ej_cuda_dev *dev = NULL;
	epj_status st = ej_cuda_open(ctx, &dev);
	if (st != EPJ_OK)
		return NULL;
	if (!s->ws)
		s->ws = ej_allocator_new(ctx->dev);
	if (!s->ws) {
		ej_error(ctx, EPJ_ERR_NOMEM, "gemm: out of memory");
		return NULL;
	}
	st = ej_cublaslt_new(ctx, dev, s->ws, &s->lt);
	return st == EPJ_OK ? s->lt : NULL;
}

/* A row-major [rows, cols] operand with element (i, p) at i * rs + p * cs
 * as BLAS takes it: stored as is (trans false, row stride ld) or as its
 * transpose [cols, rows] (trans true); false when neither fits. */
static bool lt_operand(int64_t rows, int64_t cols, int64_t rs, int64_t cs,
		       bool *trans, int64_t *ld)
{
	if ((cs == 1 || cols == 1) && (rows <= 1 || rs >= cols)) {
		*trans = false;
		*ld = rows <= 1 ? cols : rs;
	} else if ((rs == 1 || rows == 1) && (cols <= 1 || cs >= rows)) {
		*trans = true;
		*ld = cols <= 1 ? rows : cs;
	} else {
		return false;
	}
	return *ld <= INT_MAX;
}

/* d (one batch: pointers as given) as a cuBLASLt GEMM; false when cuBLASLt
 * cannot express it. */
static bool lt_form(const ej_gemm_desc *d, ej_lt_gemm *g)
{
	epj_dtype dt = d->dtype, ot = d->out_dtype;
	if (d->act != EJ_GEMM_ACT_NONE || d->group_off || d->k < 1 ||
	    d->m > INT_MAX || d->n > INT_MAX || d->k > INT_MAX)
		return false;
	if ((dt != EPJ_DTYPE_BF16 && dt != EPJ_DTYPE_F32) ||
	    !out_dtype_ok(dt, ot))
		return false;
	if (d->bias && (d->bias_dtype != ot || (d->bias_cs != 1 && d->n > 1)))
		return false;
	if (d->res && d->res_dtype != ot)
		return false;
	memset(g, 0, sizeof *g);
	g->m = d->m;
	g->n = d->n;
	g->k = d->k;
	g->ab_dtype = dt;
	g->cd_dtype = ot;
	if (!lt_operand(d->m, d->k, d->a_rs, d->a_cs, &g->trans_a, &g->lda))
		return false;
	/* op(B) [k, n]: stored [k, n] (b_cs 1) or, transposed, [n, k] */
	if (!lt_operand(d->k, d->n, d->b_rs, d->b_cs, &g->trans_b, &g->ldb))
		return false;
	g->ldd = d->m <= 1 ? d->n : d->ldc;
	if (g->ldd < d->n || g->ldd > INT_MAX)
		return false;
	g->a = d->a;
	g->b = d->b;
	g->d = d->c;
	g->bias = d->bias;
	g->alpha = 1.0f;
	if (d->res) {
		g->beta = 1.0f;
		if (d->res != d->c) {
			g->c = d->res;
			g->ldc = d->m <= 1 ? d->n : d->ldr;
			if (g->ldc < d->n || g->ldc > INT_MAX)
				return false;
		}
	}
	return true;
}

/* Batch (z0, z1) of d as a GEMM of its own. */
static void batch_of(const ej_gemm_desc *d, int64_t z0, int64_t z1,
		     ej_gemm_desc *o)
{
	size_t es = ej_dtype_size(d->dtype), cs = ej_dtype_size(d->out_dtype);
	*o = *d;
	o->nb0 = o->nb1 = 1;
	o->sa0 = o->sa1 = o->sb0 = o->sb1 = o->sc0 = o->sc1 = 0;
	o->sr0 = o->sr1 = o->sbias = 0;
	if (d->a)
		o->a = (const char *)d->a +
		       (size_t)(z0 * d->sa0 + z1 * d->sa1) * es;
	if (d->b)
		o->b = (const char *)d->b +
		       (size_t)(z0 * d->sb0 + z1 * d->sb1) * es;
	o->c = (char *)d->c + (size_t)(z0 * d->sc0 + z1 * d->sc1) * cs;
	if (d->bias)
		o->bias =
		    (const char *)d->bias +
		    (size_t)(z0 * d->sbias) * ej_dtype_size(d->bias_dtype);
	if (d->res)
		o->res = d->res == d->c
			     ? o->c
			     : (const char *)d->res +
				   (size_t)(z0 * d->sr0 + z1 * d->sr1) *
				       ej_dtype_size(d->res_dtype);
}

static gsel_entry *gsel_find(gsel *s, const gsel_key *k)
{
	for (int i = 0; i < s->n_tab; i++)
		if (!memcmp(&s->tab[i].key, k, sizeof *k))
			return &s->tab[i];
	return NULL;
}

static gsel_entry *gsel_add(epj_ctx *ctx, gsel *s, const gsel_key *k, bool lt)
{
	if (s->n_tab == s->cap_tab) {
		int cap = s->cap_tab ? 2 * s->cap_tab : 16;
		gsel_entry *t = realloc(s->tab, sizeof *t * (size_t)cap);
		if (!t) {
			ej_error(ctx, EPJ_ERR_NOMEM, "gemm: out of memory");
			return NULL;
		}
		s->tab = t;
		s->cap_tab = cap;
	}
	gsel_entry *e = &s->tab[s->n_tab++];
	memset(e, 0, sizeof *e);
	e->key = *k;
	e->lt = lt;
	return e;
}

static epj_status gemm_template(epj_ctx *ctx, const ej_gemm_desc *d)
{
	epj_counter_add(ctx, "gemm.template", 1);
	return ej_gemm(ctx, ctx_device(ctx), d);
}

/* The one place a GEMM of the op adapters picks its path (see above). */
static epj_status gemm_run(epj_ctx *ctx, const ej_gemm_desc *d)
{
	if (!ctx->dev->desc->gemm_library || d->m == 0 || d->n == 0)
		return gemm_template(ctx, d);
	gsel *s = gsel_get(ctx);
	if (!s)
		return ctx->status;
	ej_lt_gemm g;
	if (s->forced || s->lt_absent || !lt_form(d, &g))
		return gemm_template(ctx, d);
	int64_t nb0 = d->nb0 < 1 ? 1 : d->nb0, nb1 = d->nb1 < 1 ? 1 : d->nb1;
	gsel_key key;
	memset(&key, 0, sizeof key);
	key.m = d->m;
	key.n = d->n;
	key.k = d->k;
	key.batches = nb0 * nb1;
	key.dtype = (int)d->dtype;
	key.out_dtype = (int)d->out_dtype;
	key.ta = g.trans_a;
	key.tb = g.trans_b;
	key.bias = d->bias != NULL;
	key.beta = d->res != NULL;
	gsel_entry *e = gsel_find(s, &key);
	if (e && !e->lt)
		return gemm_template(ctx, d);
	ej_cublaslt *lt = gsel_handle(ctx, s);
	if (!lt) {
		ej_error_prefix(ctx, "gemm m=%lld n=%lld k=%lld",
				(long long)d->m, (long long)d->n,
				(long long)d->k);
		return ctx->status;
	}
	epj_status st = EPJ_OK;
	for (int64_t z = 0; z < nb0 * nb1 && st == EPJ_OK; z++) {
		ej_gemm_desc one;
		batch_of(d, z / nb1, z % nb1, &one);
		bool ok = lt_form(&one, &g);
		EJ_ASSERT(ok);
		st = ej_cublaslt_gemm(ctx, lt, &g);
		if (st == EPJ_ERR_UNSUPPORTED) {
			/* no algorithm for it: the template, from now on */
			epj_ctx_clear_error(ctx);
			epj_counter_add(ctx, "gemm.cublaslt_refused", 1);
			if (!e && !gsel_add(ctx, s, &key, false))
				return ctx->status;
			e = gsel_find(s, &key);
			e->lt = false;
			if (z == 0)
				return gemm_template(ctx, d);
			st = gemm_template(ctx, &one);
			continue;
		}
		if (st == EPJ_OK && !e) {
			e = gsel_add(ctx, s, &key, true);
			if (!e)
				return ctx->status;
		}
	}
	if (st == EPJ_OK)
		epj_counter_add(ctx, "gemm.cublaslt", 1);
	return st;
}

/* n GEMMs of their own shapes and pointers (expert GEMMs: no bias, no
 * residual, so a GEMM may be run again), as one cuBLASLt grouped call
 * (ej_cublaslt_gemm_grouped: cuBLAS's grouped batched GEMM where it is
 * there) when cuBLASLt takes all of them; else each through gemm_run.
 * A GEMM with k = 0 (an expert without rows, in a weight gradient) writes
 * zeros: a device fill for a dense C, else the template. */
static epj_status gemm_run_grouped(epj_ctx *ctx, int n, const ej_gemm_desc *d)
{
	bool grouped = ctx->dev->desc->gemm_library;
	gsel *s = NULL;
	if (grouped) {
		s = gsel_get(ctx);
		if (!s)
			return ctx->status;
		grouped = !s->forced && !s->lt_absent;
	}
	ej_lt_gemm *g = calloc((size_t)(n > 0 ? n : 1), sizeof *g);
	bool *rest = calloc((size_t)(n > 0 ? n : 1), sizeof *rest);
	epj_status st = EPJ_OK;
	if (!g || !rest) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "gemm: out of memory");
		goto out;
	}
	int live = 0;
	for (int i = 0; i < n && st == EPJ_OK; i++) {
		if (d[i].m == 0 || d[i].n == 0)
			continue;
		if (d[i].k == 0) {
			/* a dense C: zeros without a GEMM */
			if ((d[i].m > 1 && d[i].ldc != d[i].n) ||
			    !ctx->dev->memzero) {
				st = gemm_template(ctx, &d[i]);
				continue;
			}
			const ej_device *dev = ctx->dev;
			dev->memzero(dev->self, d[i].c,
				     (size_t)(d[i].m * d[i].n) *
					 ej_dtype_size(d[i].out_dtype));
			continue;
		}
		rest[i] = true;
		if (grouped && !lt_form(&d[i], &g[live]))
			grouped = false;
		live++;
	}
	if (st != EPJ_OK || live == 0)
		goto out;
	if (grouped) {
		ej_cublaslt *lt = gsel_handle(ctx, s);
		st = lt ? ej_cublaslt_gemm_grouped(ctx, lt, live, g)
			: ctx->status;
		if (st == EPJ_OK) {
			epj_counter_add(ctx, "gemm.cublaslt_grouped", 1);
			goto out;
		}
		if (st != EPJ_ERR_UNSUPPORTED)
			goto out;
		/* no algorithm for one of them: each on its own path */
		epj_ctx_clear_error(ctx);
		epj_counter_add(ctx, "gemm.cublaslt_refused", 1);
		st = EPJ_OK;
	}
	for (int i = 0; i < n && st == EPJ_OK; i++)
		if (rest[i])
			st = gemm_run(ctx, &d[i]);
out:
	free(g);
	free(rest);
	return st;
}

/* Runs d once per index of the batch dims beyond the last two of p; the
 * last two become the kernel's nb0 x nb1 batches. */
static epj_status run_batched(epj_ctx *ctx, ej_gemm_desc *d,
			      const batch_plan *p)
{
	/* an accumulating GEMM (GEMM_ADD): the residual is C itself */
	bool acc = d->res && d->res == d->c;
	int outer = p->nbd > 2 ? p->nbd - 2 : 0;
	int64_t nouter = ej_numel(outer, p->shape);
	size_t es = ej_dtype_size(d->dtype), cs = ej_dtype_size(d->out_dtype);
	const char *a0 = d->a, *b0 = d->b;
	char *c0 = d->c;
	if (p->nbd - outer == 2) {
		d->nb0 = p->shape[outer];
		d->nb1 = p->shape[outer + 1];
		d->sa0 = p->st[0][outer];
		d->sa1 = p->st[0][outer + 1];
		d->sb0 = p->st[1][outer];
		d->sb1 = p->st[1][outer + 1];
		d->sc0 = p->st[2][outer];
		d->sc1 = p->st[2][outer + 1];
	} else if (p->nbd - outer == 1) {
		d->nb1 = p->shape[outer];
		d->sa1 = p->st[0][outer];
		d->sb1 = p->st[1][outer];
		d->sc1 = p->st[2][outer];
	}
	if (acc) {
		d->ldr = d->ldc;
		d->sr0 = d->sc0;
		d->sr1 = d->sc1;
		d->res_dtype = d->out_dtype;
	}
	for (int64_t q = 0; q < nouter; q++) {
		int64_t rem = q, oa = 0, ob = 0, oc = 0;
		for (int dd = outer - 1; dd >= 0; dd--) {
			int64_t i = rem % p->shape[dd];
			rem /= p->shape[dd];
			oa += i * p->st[0][dd];
			ob += i * p->st[1][dd];
			oc += i * p->st[2][dd];
		}
		d->a = a0 ? a0 + (size_t)oa * es : NULL;
		d->b = b0 ? b0 + (size_t)ob * es : NULL;
		d->c = c0 + (size_t)oc * cs;
		if (acc)
			d->res = d->c;
		epj_status st = gemm_run(ctx, d);
		if (st != EPJ_OK)
			return st;
	}
	return EPJ_OK;
}

static epj_status check_dtype(epj_ctx *ctx, const ej_call *c, const char *op)
{
	epj_dtype dt = c->out[0]->dtype;
	for (int i = 0; i < c->n_in; i++)
		if (c->in[i]->dtype != dt)
			break;
		else if (i == c->n_in - 1 &&
			 (dt == EPJ_DTYPE_BF16 || dt == EPJ_DTYPE_F32 ||
			  dt == EPJ_DTYPE_F64))
			return EPJ_OK;
	char s[96];
	epj_tensor_describe(c->in[0], s, sizeof s);
	return ej_error(ctx, EPJ_ERR_DTYPE,
			"%s on %s: inputs %s and output %s (f32, bf16 or f64, "
			"all the same)",
			op, ctx_device(ctx), s, epj_dtype_name(dt));
}

/* a [..., M, K] @ b [..., K, N] -> out [..., M, N], batch dims broadcast */
static epj_status matmul_on(epj_ctx *ctx, const ej_call *c, epj_tensor *o,
			    bool acc)
{
	epj_status st;
	const epj_tensor *a = c->in[0], *b = c->in[1];
	int nd = o->ndim, nbd = nd - 2;
	if (ej_numel(nd, o->shape) == 0)
		return EPJ_OK;
	int64_t m = o->shape[nd - 2], n = o->shape[nd - 1];
	int64_t k = a->shape[a->ndim - 1];
	ej_gemm_desc d;
	ej_gemm_desc_init(&d, o->dtype, m, n, k);
	d.a = ej_data(a);
	d.b = ej_data(b);
	d.c = ej_data(o);
	d.a_rs = a->stride[a->ndim - 2];
	d.a_cs = a->stride[a->ndim - 1];
	d.b_rs = b->stride[b->ndim - 2];
	d.b_cs = b->stride[b->ndim - 1];
	d.ldc = n;
	if (acc)
		d.res = d.c;
	batch_plan p;
	p.nbd = nbd;
	for (int dd = 0; dd < nbd; dd++) {
		p.shape[dd] = o->shape[dd];
		int da = dd - (nbd - (a->ndim - 2)),
		    db = dd - (nbd - (b->ndim - 2));
		p.st[0][dd] = da < 0 || a->shape[da] == 1 ? 0 : a->stride[da];
		p.st[1][dd] = db < 0 || b->shape[db] == 1 ? 0 : b->stride[db];
		p.st[2][dd] = o->stride[dd];
	}
	plan_merge(&p);
	st = run_batched(ctx, &d, &p);
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "matmul");
	return st;
}

epj_status ej_cuda_op_matmul(epj_ctx *ctx, ej_call *c)
{
	epj_status st = check_dtype(ctx, c, "matmul");
	if (st != EPJ_OK)
		return st;
	return matmul_on(ctx, c, c->out[0], false);
}

/* x [..., in] @ w [out, in]^T (+ bias [out]) -> out [..., out] */
static epj_status linear_on(epj_ctx *ctx, const ej_call *c, epj_tensor *o,
			    bool acc)
{
	epj_status st;
	const epj_tensor *x = c->in[0], *w = c->in[1];
	const epj_tensor *bias = c->n_in == 3 && !acc ? c->in[2] : NULL;
	int64_t fin = w->shape[1], fout = w->shape[0];
	if (ej_numel(o->ndim, o->shape) == 0)
		return EPJ_OK;
	/* x's leading dims: the last is M, the others batch dims (merged
	 * into rows of M where the strides allow) */
	int lead = x->ndim - 1;
	int64_t m = lead > 0 ? x->shape[lead - 1] : 1;
	ej_gemm_desc d;
	ej_gemm_desc_init(&d, o->dtype, m, fout, fin);
	d.a = ej_data(x);
	d.b = ej_data(w);
	d.c = ej_data(o);
	d.a_rs = lead > 0 ? x->stride[lead - 1] : 0;
	d.a_cs = x->stride[lead];
	d.b_rs = w->stride[1]; /* op(B) = w^T: (p, j) is w[j, p] */
	d.b_cs = w->stride[0];
	d.ldc = fout;
	if (bias) {
		d.bias = ej_data(bias);
		d.bias_cs = bias->stride[0];
	}
	if (acc)
		d.res = d.c;
	batch_plan p;
	p.nbd = lead > 0 ? lead - 1 : 0;
	for (int dd = 0; dd < p.nbd; dd++) {
		p.shape[dd] = x->shape[dd];
		p.st[0][dd] = x->stride[dd];
		p.st[1][dd] = 0;
		p.st[2][dd] = o->stride[dd];
	}
	plan_merge(&p);
	/* the innermost batch dim folds into M when it steps over M rows */
	while (p.nbd > 0 && p.st[0][p.nbd - 1] == d.a_rs * d.m &&
	       p.st[2][p.nbd - 1] == d.ldc * d.m) {
		d.m *= p.shape[p.nbd - 1];
		p.nbd--;
	}
	st = run_batched(ctx, &d, &p);
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "linear");
	return st;
}

epj_status ej_cuda_op_linear(epj_ctx *ctx, ej_call *c)
{
	epj_status st = check_dtype(ctx, c, "linear");
	if (st != EPJ_OK)
		return st;
	return linear_on(ctx, c, c->out[0], false);
}

/* GEMM_ADD: out (r's shape, already holding r) += a @ op(b), the template
 * reading C as its residual (res = c); acc false: out = a @ op(b).  The
 * product's shape is a view of out's contiguous buffer. */
epj_status ej_cuda_gemm_acc(epj_ctx *ctx, const ej_call *c, epj_tensor *out,
			    bool acc)
{
	bool lin = c->attrs->i[0] != 0;
	epj_tensor *in2[2] = { c->in[0], c->in[1] };
	ej_attrs none = ej_attrs_none();
	ej_call sub = { .op = lin ? EJ_OP_LINEAR : EJ_OP_MATMUL,
			.attrs = &none,
			.in = in2,
			.n_in = 2,
			.out = &out,
			.n_out = 1 };
	ej_meta prod;
	epj_status st = lin ? ej_infer_LINEAR(ctx, &sub, &prod)
			    : ej_infer_MATMUL(ctx, &sub, &prod);
	if (st != EPJ_OK)
		return st;
	epj_tensor po = *out; /* same storage and offset, product shape */
	po.ndim = prod.ndim;
	memcpy(po.shape, prod.shape, sizeof po.shape);
	ej_contiguous_strides(po.ndim, po.shape, po.stride);
	epj_tensor *outs[1] = { &po };
	sub.out = outs;
	st = check_dtype(ctx, &sub, lin ? "linear" : "matmul");
	if (st != EPJ_OK)
		return st;
	if (ej_numel(po.ndim, po.shape) == 0)
		return EPJ_OK;
	return lin ? linear_on(ctx, &sub, &po, acc)
		   : matmul_on(ctx, &sub, &po, acc);
}

/* ---- expert GEMMs (lib/ops_moe.c's semantics) ---------------------------- */

/* Pinned index values.  Every grouped GEMM needs its group counts on the
 * host; reading them from the device is a stream synchronization, and the
 * AutoEP layer runs three grouped GEMMs forward, three dgrad and three
 * wgrad ones backward and three more per checkpoint replay, all over one
 * counts tensor that it built from host values.  The layer pins that
 * tensor (ej_index_pin) with the values it was built from; a GEMM over a
 * pinned tensor takes them from here instead of the device, and the eager
 * index ops (kernels/eager_cuda.c) validate a pinned index from here.
 *
 * An entry is keyed by the storage, element offset and element count of a
 * dense tensor (autograd saves its inputs as aliases: same storage, new
 * tensor struct; a dense view of the same elements reads the same values
 * in the same order) and holds a reference on the storage, so a storage
 * cannot be freed and its address reused by another tensor while pinned:
 * a new tensor always misses.  Only a tensor nobody else can write may be
 * pinned (the layer's own, never handed out), so the values cannot change
 * in place either.  An entry whose storage only the table still holds can
 * never be looked up again and is dropped at the next pin. */
typedef struct counts_pin {
	ej_storage *storage; /* referenced */
	int64_t offset, n;   /* elements */
	int64_t *v;	     /* n values */
} counts_pin;

static void pin_drop(counts_pin *p)
{
	ej_storage_unref(p->storage);
	free(p->v);
}

static void pins_free(gsel *s)
{
	for (int i = 0; i < s->n_pins; i++)
		pin_drop(&s->pins[i]);
	free(s->pins);
	s->pins = NULL;
	s->n_pins = s->cap_pins = 0;
}

static bool pinnable(const epj_tensor *t)
{
	return t && t->storage &&
	       (t->dtype == EPJ_DTYPE_I64 || t->dtype == EPJ_DTYPE_I32) &&
	       ej_is_contiguous(t);
}

static bool pin_matches(const counts_pin *p, const epj_tensor *t)
{
	return pinnable(t) && t->storage == p->storage &&
	       t->offset == p->offset && ej_numel(t->ndim, t->shape) == p->n;
}

epj_status ej_index_pin(epj_ctx *ctx, const epj_tensor *t, const int64_t *v)
{
	if (!ej_dev_runs_cuda(ctx->dev) || !pinnable(t))
		return EPJ_OK; /* not pinned: readers read the device */
	gsel *s = gsel_get(ctx);
	if (!s)
		return epj_ctx_status(ctx);
	int j = 0; /* sweep: keep entries someone else still holds */
	for (int i = 0; i < s->n_pins; i++) {
		if (s->pins[i].storage->refcount > 1)
			s->pins[j++] = s->pins[i];
		else
			pin_drop(&s->pins[i]);
	}
	s->n_pins = j;
	for (int i = 0; i < s->n_pins; i++)
		if (pin_matches(&s->pins[i], t))
			return EPJ_OK; /* pinned already: same elements */
	if (s->n_pins == s->cap_pins) {
		int cap = s->cap_pins ? 2 * s->cap_pins : 16;
		counts_pin *np = realloc(s->pins, sizeof *np * (size_t)cap);
		if (!np)
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"gemm: out of memory");
		s->pins = np;
		s->cap_pins = cap;
	}
	int64_t n = ej_numel(t->ndim, t->shape);
	int64_t *c = malloc(sizeof *c * (size_t)(n > 0 ? n : 1));
	if (!c)
		return ej_error(ctx, EPJ_ERR_NOMEM, "gemm: out of memory");
	memcpy(c, v, sizeof *c * (size_t)n);
	ej_storage_ref(t->storage);
	s->pins[s->n_pins++] = (counts_pin){
		.storage = t->storage, .offset = t->offset, .n = n, .v = c
	};
	return EPJ_OK;
}

const int64_t *ej_index_pinned(const epj_ctx *ctx, const epj_tensor *t)
{
	const gsel *s = ctx->gemm_sel;
	for (int i = 0; s && i < s->n_pins; i++)
		if (pin_matches(&s->pins[i], t))
			return s->pins[i].v;
	return NULL;
}

/* The group counts of input `input` (any device) on the host, each >= 0,
 * summing to rows: pinned values (ej_index_pin), else read from the device (a
 * stream synchronization on cuda). */
static epj_status read_counts(epj_ctx *ctx, const ej_call *c, int input,
			      int64_t rows, int64_t **out)
{
	const epj_tensor *t = c->in[input];
	int64_t G = t->shape[0], sum = 0;
	double *v = malloc(sizeof *v * (size_t)(G > 0 ? G : 1));
	int64_t *cnt = malloc(sizeof *cnt * (size_t)(G > 0 ? G : 1));
	epj_status st = EPJ_OK;
	const int64_t *pin = ej_index_pinned(ctx, t);
	if (!v || !cnt)
		st = ej_error(ctx, EPJ_ERR_NOMEM, "gemm: out of memory");
	else if (!pin)
		st = epj_tensor_to_f64(ctx, t, v);
	for (int64_t g = 0; g < G && st == EPJ_OK; g++) {
		cnt[g] = pin ? pin[g] : (int64_t)v[g];
		if (cnt[g] < 0)
			st = ej_op_error(ctx, c, EPJ_ERR_INVALID,
					 "group count %lld of group %lld",
					 (long long)cnt[g], (long long)g);
		sum += cnt[g];
	}
	if (st == EPJ_OK && sum != rows)
		st = ej_op_error(ctx, c, EPJ_ERR_INVALID,
				 "group counts sum to %lld, expected %lld "
				 "(rows)",
				 (long long)sum, (long long)rows);
	free(v);
	if (st != EPJ_OK) {
		free(cnt);
		cnt = NULL;
	}
	*out = cnt;
	return st;
}

static epj_status check_float_dtype(epj_ctx *ctx, const epj_tensor *t,
				    const char *op)
{
	epj_dtype dt = t->dtype;
	if (dt == EPJ_DTYPE_BF16 || dt == EPJ_DTYPE_F32 || dt == EPJ_DTYPE_F64)
		return EPJ_OK;
	return ej_error(ctx, EPJ_ERR_DTYPE, "%s on %s: %s (f32, bf16 or f64)",
			op, ctx_device(ctx), epj_dtype_name(dt));
}

/* The start of a grouped op: x's dtype checked, the group counts (input
 * `counts_in`, summing to R) read to the host, one descriptor per group
 * allocated.  On success the caller frees *cnt and *d. */
static epj_status grouped_begin(epj_ctx *ctx, ej_call *c, const epj_tensor *x,
				int counts_in, int64_t R, int G, const char *op,
				int64_t **cnt, ej_gemm_desc **d)
{
	epj_status st = check_float_dtype(ctx, x, op);
	if (st == EPJ_OK)
		st = read_counts(ctx, c, counts_in, R, cnt);
	if (st != EPJ_OK)
		return st;
	*d = calloc((size_t)(G > 0 ? G : 1), sizeof **d);
	if (!*d) {
		free(*cnt);
		return ej_error(ctx, EPJ_ERR_NOMEM, "gemm: out of memory");
	}
	return EPJ_OK;
}

/* MOE_GROUPED_MM: y [R, M], block g (counts[g] rows of x [R, K]) times
 * w_g^T (w_trans, w_g [M, K]) or w_g ([K, M]). */
epj_status ej_cuda_op_moe_grouped_mm(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *x = c->in[0];
	epj_tensor *o = c->out[0];
	const int G = c->n_in - 2;
	const bool wtr = c->attrs->i[0] != 0;
	const int64_t R = x->shape[0], K = x->shape[1], M = o->shape[1];
	int64_t *cnt = NULL;
	ej_gemm_desc *d = NULL;
	epj_status st =
	    grouped_begin(ctx, c, x, 1, R, G, "moe_grouped_mm", &cnt, &d);
	if (st != EPJ_OK)
		return st;
	size_t es = ej_dtype_size(x->dtype);
	int64_t r0 = 0;
	for (int g = 0; g < G; r0 += cnt[g], g++) {
		const epj_tensor *w = c->in[2 + g];
		ej_gemm_desc_init(&d[g], o->dtype, cnt[g], M, K);
		d[g].a =
		    (const char *)ej_data(x) + (size_t)(r0 * x->stride[0]) * es;
		d[g].a_rs = x->stride[0];
		d[g].a_cs = x->stride[1];
		d[g].b = ej_data(w);
		d[g].b_rs = wtr ? w->stride[1] : w->stride[0];
		d[g].b_cs = wtr ? w->stride[0] : w->stride[1];
		d[g].c = (char *)ej_data(o) + (size_t)(r0 * M) * es;
		d[g].ldc = M;
	}
	st = R > 0 && M > 0 ? gemm_run_grouped(ctx, G, d) : EPJ_OK;
	free(d);
	free(cnt);
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "moe_grouped_mm");
	return st;
}

/* MOE_GROUPED_MM_WGRAD: out_g [A, B] = a_g^T b_g over the counts[g] rows
 * of a [R, A] and b [R, B] (zeros for an empty group). */
epj_status ej_cuda_op_moe_grouped_mm_wgrad(epj_ctx *ctx, ej_call *c)
{
	const epj_tensor *a = c->in[0], *b = c->in[1];
	const int G = c->n_out;
	const int64_t R = a->shape[0], A = a->shape[1], B = b->shape[1];
	int64_t *cnt = NULL;
	ej_gemm_desc *d = NULL;
	epj_status st =
	    grouped_begin(ctx, c, a, 2, R, G, "moe_grouped_mm_wgrad", &cnt, &d);
	if (st != EPJ_OK)
		return st;
	size_t es = ej_dtype_size(a->dtype);
	int64_t r0 = 0;
	for (int g = 0; g < G; r0 += cnt[g], g++) {
		ej_gemm_desc_init(&d[g], c->out[g]->dtype, A, B, cnt[g]);
		/* op(A) [A, c] = a_g^T, op(B) [c, B] = b_g */
		d[g].a =
		    (const char *)ej_data(a) + (size_t)(r0 * a->stride[0]) * es;
		d[g].a_rs = a->stride[1];
		d[g].a_cs = a->stride[0];
		d[g].b =
		    (const char *)ej_data(b) + (size_t)(r0 * b->stride[0]) * es;
		d[g].b_rs = b->stride[0];
		d[g].b_cs = b->stride[1];
		d[g].c = ej_data(c->out[g]);
		d[g].ldc = B;
	}
	st = gemm_run_grouped(ctx, G, d);
	free(d);
	free(cnt);
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "moe_grouped_mm_wgrad");
	return st;
}
