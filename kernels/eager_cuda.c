/* eager_cuda.c -- eager ops as CUDA kernels on the devices that run CUDA C
 * (cuda-sim, and the cuda device by name): the table lib/dispatch.c
 * consults for every eager op on such a device (ej_eager_install,
 * ej_eager_install_name), indexed by op id.
 *
 * Two kinds of entries:
 *  - single-op lowerings (pointwise ops incl. broadcasting, float casts,
 *    scalar ops and backward helpers; sum, mean, amax, sum_all, sum_to;
 *    softmax, log_softmax): the op becomes a one-node graph whose inputs
 *    have the call's dtypes and shapes, scheduled (sched.c), lowered to
 *    kernel IR (kir.c) and printed (print_cuda.c) exactly as a compiled
 *    graph's fused kernels are, built by the host C++ compiler for cuda-sim
 *    (ej_sim_build_module, through the kernel cache) or by NVRTC for the
 *    cuda device (ej_tmpl_get_unit), and launched with the
 *    shared host launch code (launch_cuda.c: strides per access, so views
 *    are read in place).  A reduction over another axis than the last reads
 *    its input through a permuted view (the axis last); one over several
 *    dims (sum_all, sum_to) first copies the permuted view contiguous so
 *    the reduced dims are one column run.  The built modules live in a
 *    process table keyed by the graph's canonical text (op, attributes,
 *    dtypes, shapes: all the generated code depends on; strides are launch
 *    arguments), so a repeated call builds nothing.
 *  - template kernels (templates/copy.cuh, templates/index.cuh,
 *    templates/fill.cuh through kernels/tmpl.h): strided copies (contiguous,
 *    reshape copies, view materialisation, expand copies, casts involving
 *    integers), cat, slice_backward, full, integer pointwise ops,
 *    index_select, index_add, gather, scatter_add, max with indices, topk,
 *    argsort.  Index ranges are checked on the host before the launch with
 *    the CPU kernels' message (in place on cuda-sim, whose memory is host
 *    memory; from a host copy on cuda).
 *  - adapters of the GEMM (kernels/tmpl_gemm.c: matmul, linear, the expert
 *    GEMMs moe_grouped_mm and its weight gradient), attention
 *    (kernels/tmpl_attention.c: sdpa and its backward), embedding / loss and
 *    the fused MoE ops (kernels/tmpl_moe.c: embedding, cross_entropy,
 *    moe_route, moe_permute, moe_unpermute, swiglu and their backwards)
 *    and the gated delta rule (kernels/tmpl_delta.c) templates.
 *
 * Every launch of this file's kernels counts in
 * kernels.launched.eager_cuda, every template launch in
 * kernels.launched.template (kernels/tmpl.c).  An entry that meets
 * a case it has no kernel for (integer reductions, empty inputs of a
 * reduction, k above 32 in moe_route) calls ej_eager_fallback (CPU
 * kernel, counted).  Every op has an entry; a NULL row would run the CPU
 * kernel the same way.  An op's entry is the one line
 * `[EJ_OP_X] = ej_cuda_op_x,`.
 */
#include "eager_cuda.h"

#include "ops_impl.h"

#include "kir.h"
#include "templates/args.h"
#include "tmpl.h"
#include "tmpl_attention.h"
#include "tmpl_gemm.h"
#include "tmpl_moe.h"

#include <pthread.h>
#include <stdio.h>

/* ---- common ------------------------------------------------------------ */

static bool is_float(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F32 || dt == EPJ_DTYPE_BF16 ||
	       dt == EPJ_DTYPE_F64;
}

static int64_t numel_of(const epj_tensor *t)
{
	return ej_numel(t->ndim, t->shape);
}

/* The CUDA C device ctx runs on, as kernels/tmpl.h names it. */
static const char *dev_name(const epj_ctx *ctx)
{
	return ctx->dev->name;
}

/* Whether ctx's device takes host shared objects (cuda-sim) rather than
 * cubins through the template table (cuda). */
static bool on_sim(const epj_ctx *ctx)
{
	return ctx->dev->desc->modules == EJ_MODULES_HOST_SO;
}

static void count_launch(epj_ctx *ctx)
{
	epj_counter_add(ctx, "kernels.launched.eager_cuda", 1);
}

/* A view of t (same storage) with the given geometry; NULL with an error
 * in ctx when out of memory. */
static epj_tensor *view_of(epj_tensor *t, int nd, const int64_t *shape,
			   const int64_t *stride, int64_t offset)
{
	return ej_tensor_view(t, nd, shape, stride, offset);
}

/* t's dims permuted by perm[0..nd). */
static epj_tensor *permuted(epj_tensor *t, const int *perm)
{
	int64_t sh[EPJ_MAX_DIMS], st[EPJ_MAX_DIMS];
	for (int d = 0; d < t->ndim; d++) {
		sh[d] = t->shape[perm[d]];
		st[d] = t->stride[perm[d]];
	}
	return view_of(t, t->ndim, sh, st, t->offset);
}

/* A contiguous t (numel elements) viewed with shape (nd, shape). */
static epj_tensor *reshaped(epj_tensor *t, int nd, const int64_t *shape)
{
	int64_t st[EPJ_MAX_DIMS];
	ej_contiguous_strides(nd, shape, st);
	return view_of(t, nd, shape, st, t->offset);
}

static epj_status nomem(epj_ctx *ctx, const ej_call *c)
{
	if (ctx->status != EPJ_OK)
		return ctx->status;
	return ej_op_error(ctx, c, EPJ_ERR_NOMEM,
			   "out of memory on the eager %s path", dev_name(ctx));
}

/* ---- single-op kernels through the kernel IR ------------------------------
 */

typedef struct kop {
	char *key; /* "cuda-sim\n" or "cuda\n" + the graph's canonical text */
	uint64_t hash;
	bool lowered; /* false: the scheduler made no single kernel of it */
	ej_graph *g;
	ej_arena *A;
	const ej_kernel *k;
	void *module, *fn; /* cuda-sim (cuda: NULL, kernels/tmpl.c has it) */
	const char *name, *cuda; /* in A: the kernel's unit, as NVRTC gets it */
	struct kop *next;
} kop;

#define KOP_BUCKETS 256

static pthread_mutex_t kop_lock = PTHREAD_MUTEX_INITIALIZER;
static kop *kop_table[KOP_BUCKETS];
static int kop_built;

int ej_eager_cuda_modules(void)
{
	pthread_mutex_lock(&kop_lock);
	int n = kop_built;
	pthread_mutex_unlock(&kop_lock);
	return n;
}

int ej_eager_cuda_each_source(void (*fn)(void *user, const char *name,
					 const char *cuda),
			      void *user)
{
	int n = 0;
	pthread_mutex_lock(&kop_lock);
	for (int b = 0; b < KOP_BUCKETS; b++)
		for (kop *e = kop_table[b]; e; e = e->next)
			if (e->lowered && e->cuda) {
				fn(user, e->name, e->cuda);
				n++;
			}
	pthread_mutex_unlock(&kop_lock);
	return n;
}

static const ej_tmpl_kernel kop_kernel[] = { { "epjk_0",
					       "struct ej_kargs_0" } };

static epj_status kop_build(epj_ctx *ctx, kop *e, const char *text, bool sim)
{
	e->A = ej_arena_new();
	ej_schedule *s = ej_sched_build(e->A, e->g);
	if (s->n_kernels != 1 || s->n_extern != 0 || s->n_steps != 1)
		return EPJ_OK; /* not lowered: the caller falls back */
	char gh[33], name[48];
	epj_hash_hex(epj_hash(text, strlen(text)), gh);
	snprintf(name, sizeof name, "e%.16s", gh);
	const char *cuda = ej_print_cuda(e->A, s, name);
	e->cuda = cuda;
	e->name = ej_arena_strdup(e->A, name);
	static const char *const kn[] = { "epjk_0" };
	static const char *const ty[] = { "struct ej_kargs_0" };
	if (!sim) {
		/* NVRTC for the GPU's arch through the kernel cache, loaded
		 * by the driver; the template table keeps the module (and is
		 * asked again at every launch: ej_tmpl_clear may unload it) */
		ej_tmpl *tm = NULL;
		epj_status st = ej_tmpl_get_unit(ctx, dev_name(ctx), e->name,
						 cuda, kop_kernel, 1, &tm);
		if (st != EPJ_OK)
			return st;
		e->k = s->kernels[0];
		e->lowered = true;
		epj_counter_add(ctx, "codegen.eager_modules", 1);
		return EPJ_OK;
	}
	epj_status st =
	    ej_sim_build_module(ctx, cuda, kn, ty, 1, name, &e->module);
	if (st != EPJ_OK)
		return st;
	e->fn = ej_device_sim.function(ej_device_sim.self, e->module, kn[0]);
	if (!e->fn)
		return ej_error(ctx, EPJ_ERR_BACKEND,
				"cuda-sim: eager kernel %s: entry missing from "
				"the module",
				name);
	e->k = s->kernels[0];
	e->lowered = true;
	epj_counter_add(ctx, "codegen.eager_modules", 1);
	return EPJ_OK;
}

static void kop_free(kop *e)
{
	if (!e)
		return;
	if (e->module)
		ej_device_sim.unload(ej_device_sim.self, e->module);
	ej_arena_free(e->A);
	ej_graph_free(e->g);
	free(e->key);
	free(e);
}

/* The single-op kernel of op (attrs) on inputs in[0..n_in) (their dtypes
 * and shapes) with output meta *om; *out NULL when the op does not lower
 * to one kernel. */
static epj_status kop_get(epj_ctx *ctx, int op, const ej_attrs *attrs,
			  epj_tensor *const *in, int n_in, const ej_meta *om,
			  kop **out)
{
	*out = NULL;
	ej_graph *g = ej_graph_new("eager");
	int ins[EPJ_MAX_DIMS + 8];
	EJ_ASSERT(n_in <= (int)EJ_ARRAY_LEN(ins));
	for (int i = 0; i < n_in; i++)
		ins[i] = ej_graph_add_input(g, EJ_IN_ACT, i, in[i]->dtype,
					    in[i]->ndim, in[i]->shape);
	int nn = ej_graph_add_node(g, op, attrs, ins, n_in, om, 1);
	ej_graph_add_output(g, g->nodes[nn].out[0]);
	const char *text = ej_graph_text(g);
	size_t len = strlen(text);
	/* keyed by the device's name and the graph's text */
	size_t pl = strlen(dev_name(ctx)) + 1;
	char *key = malloc(pl + len + 1);
	if (!key) {
		ej_graph_free(g);
		return ej_error(ctx, EPJ_ERR_NOMEM, "cuda-sim: out of memory");
	}
	bool sim = on_sim(ctx);
	memcpy(key, dev_name(ctx), pl - 1);
	key[pl - 1] = '\n';
	memcpy(key + pl, text, len + 1);
	epj_hash128 h = epj_hash(key, len + pl);
	uint64_t hv = h.lo;
	pthread_mutex_lock(&kop_lock);
	kop **slot = &kop_table[hv % KOP_BUCKETS];
	for (kop *e = *slot; e; e = e->next) {
		if (e->hash == hv && strcmp(e->key, key) == 0) {
			pthread_mutex_unlock(&kop_lock);
			free(key);
			ej_graph_free(g);
			*out = e->lowered ? e : NULL;
			return EPJ_OK;
		}
	}
	kop *e = calloc(1, sizeof *e);
	if (!e) {
		pthread_mutex_unlock(&kop_lock);
		free(key);
		ej_graph_free(g);
		return ej_error(ctx, EPJ_ERR_NOMEM, "cuda-sim: out of memory");
	}
	e->key = key;
	e->hash = hv;
	e->g = g;
	epj_status st = kop_build(ctx, e, text, sim);
	if (st != EPJ_OK) {
		pthread_mutex_unlock(&kop_lock);
		ej_error_prefix(ctx, "eager %s on %s", ej_ops[op].name,
				dev_name(ctx));
		kop_free(e);
		return st;
	}
	e->next = *slot;
	*slot = e;
	if (e->lowered)
		kop_built++;
	pthread_mutex_unlock(&kop_lock);
	*out = e->lowered ? e : NULL;
	return EPJ_OK;
}

/* Launches a single-op kernel: in[] the graph's inputs (any strides), out
 * contiguous with the graph output's shape. */
static epj_status kop_launch(epj_ctx *ctx, const kop *e, int op,
			     epj_tensor *const *in, epj_tensor *out)
{
	const ej_kernel *k = e->k;
	epj_tensor *kin[16];
	EJ_ASSERT(k->n_in <= 16 && k->n_out == 1);
	for (int i = 0; i < k->n_in; i++)
		kin[i] = in[e->g->values[k->in[i].value].input];
	size_t asz = ej_cuda_args_size(k);
	_Alignas(16) unsigned char args[asz + 16];
	ej_launch_out lo[1];
	ej_launch l;
	epj_tensor *outs[1] = { out };
	ej_cuda_launch_prepare(k, kin, outs, args, lo, &l);
	char kname[64];
	snprintf(kname, sizeof kname, "eager_%s", ej_ops[op].name);
	count_launch(ctx);
	if (!e->fn) { /* cuda */
		ej_tmpl *tm = NULL;
		epj_status st = ej_tmpl_get_unit(ctx, dev_name(ctx), e->name,
						 e->cuda, kop_kernel, 1, &tm);
		if (st != EPJ_OK)
			return st;
		return ej_tmpl_launch(ctx, tm, "epjk_0", &l);
	}
	return ej_device_sim.launch(ej_device_sim.self, ctx, e->fn, kname, &l);
}

/* op (attrs) on in[0..n_in) into out (contiguous, the output's shape as
 * infer gives it for these inputs) as one generated kernel.  *done false:
 * the op does not lower (the caller falls back). */
static epj_status kir_run(epj_ctx *ctx, int op, const ej_attrs *attrs,
			  epj_tensor *const *in, int n_in, epj_tensor *out,
			  bool *done)
{
	*done = false;
	ej_meta m;
	ej_call cc = { .op = op,
		       .attrs = attrs,
		       .in = in,
		       .n_in = n_in,
		       .out = NULL,
		       .n_out = 1 };
	epj_status st = ej_ops[op].infer(ctx, &cc, &m);
	if (st != EPJ_OK)
		return st;
	EJ_ASSERT(!m.is_view && m.dtype == out->dtype &&
		  ej_numel(m.ndim, m.shape) == numel_of(out));
	kop *e = NULL;
	st = kop_get(ctx, op, attrs, in, n_in, &m, &e);
	if (st != EPJ_OK || !e)
		return st;
	epj_tensor *ov = out;
	bool same = m.ndim == out->ndim;
	for (int d = 0; same && d < m.ndim; d++)
		same = m.shape[d] == out->shape[d];
	if (!same && !(ov = reshaped(out, m.ndim, m.shape)))
		return ctx->status;
	st = kop_launch(ctx, e, op, in, ov);
	if (ov != out)
		epj_tensor_free(ov);
	if (st == EPJ_OK)
		*done = true;
	return st;
}

/* ---- template kernels ---------------------------------------------------
 * The copy, index and fill templates, with their argument structs from
 * templates/args.h (the one declaration both sides compile). */

_Static_assert(EJ_COPY_DIMS == EPJ_MAX_DIMS, "template dims");

static const ej_tmpl_kernel copy_kernels[] = {
	{ "ej_copy", "struct ej_copy_args" },
	{ "ej_cat", "struct ej_cat_args" },
	{ "ej_slice_bw", "struct ej_slice_bw_args" },
	{ "ej_ipw", "struct ej_ipw_args" },
};
static const ej_tmpl_kernel index_kernels[] = {
	{ "ej_index_select", "struct ej_index_select_args" },
	{ "ej_gather", "struct ej_gather_args" },
	{ "ej_index_add", "struct ej_index_add_args" },
	{ "ej_scatter_add", "struct ej_scatter_add_args" },
	{ "ej_max_index", "struct ej_max_args" },
	{ "ej_topk", "struct ej_topk_args" },
	{ "ej_argsort", "struct ej_argsort_args" },
};
static const ej_tmpl_kernel fill_kernels[] = {
	{ "ej_fill", "struct ej_fill_args" },
};

/* Launches kernel `kernel` of template `name` over n work items (grid-
 * stride kernels: any geometry is correct); outs[0..n_out) are the buffers
 * it writes entirely (cuda-sim poisons and race-checks them). */
static epj_status tmpl_run(epj_ctx *ctx, const char *name,
			   const ej_tmpl_kernel *ks, int nk, const char *kernel,
			   int64_t n, const void *args, size_t args_size,
			   const ej_launch_out *outs, int n_out)
{
	ej_tmpl *m = NULL;
	epj_status st = ej_tmpl_get(ctx, dev_name(ctx), name, NULL, ks, nk, &m);
	if (st != EPJ_OK)
		return st;
	unsigned block = 128;
	if (n < 128)
		block = (unsigned)((n + 31) / 32 * 32);
	if (block == 0)
		block = 32;
	int64_t grid = (n + block - 1) / block;
	if (grid > 1024)
		grid = 1024;
	if (grid < 1)
		grid = 1;
	ej_launch l = { .grid = { (unsigned)grid, 1, 1 },
			.block = { block, 1, 1 },
			.smem = 0,
			.args = args,
			.args_size = args_size,
			.outs = outs,
			.n_out = n_out };
	count_launch(ctx);
	return ej_tmpl_launch(ctx, m, kernel, &l);
}

static ej_launch_out out_of(const epj_tensor *t)
{
	ej_launch_out o = { ej_data(t),
			    (size_t)numel_of(t) * ej_dtype_size(t->dtype),
			    ej_dtype_size(t->dtype) };
	return o;
}

/* dst (dst_st strides over src's shape) = src converted to dst's dtype.
 * `whole`: the copy writes every element of dst (listed for the checks). */
static epj_status copy_into(epj_ctx *ctx, const epj_tensor *src,
			    epj_tensor *dst, const int64_t *dst_st, bool whole)
{
	int64_t n = numel_of(src);
	if (n == 0)
		return EPJ_OK;
	struct ej_copy_args a;
	memset(&a, 0, sizeof a);
	a.src = ej_data(src);
	a.dst = ej_data(dst);
	a.n = n;
	a.ndim = src->ndim;
	a.sdt = src->dtype;
	a.ddt = dst->dtype;
	for (int d = 0; d < src->ndim; d++) {
		a.shape[d] = src->shape[d];
		a.src_st[d] = src->stride[d];
		a.dst_st[d] = dst_st[d];
	}
	ej_launch_out o = out_of(dst);
	return tmpl_run(ctx, "copy", copy_kernels, 4, "ej_copy", n, &a,
			sizeof a, &o, whole ? 1 : 0);
}

/* dst (contiguous, src's numel) = src in row-major order, converted. */
static epj_status copy_contig(epj_ctx *ctx, const epj_tensor *src,
			      epj_tensor *dst)
{
	int64_t st[EPJ_MAX_DIMS];
	ej_contiguous_strides(src->ndim, src->shape, st);
	return copy_into(ctx, src, dst, st, true);
}

/* A new contiguous copy of t (its dtype and shape); NULL on error. */
static epj_tensor *contig_copy(epj_ctx *ctx, epj_tensor *t)
{
	epj_tensor *r =
	    ej_tensor_alloc(ctx, t->dtype, t->ndim, t->shape, false);
	if (!r)
		return NULL;
	if (copy_contig(ctx, t, r) != EPJ_OK) {
		epj_tensor_free(r);
		return NULL;
	}
	return r;
}

/* ---- pointwise ------------------------------------------------------------
 */

static epj_status int_pointwise(epj_ctx *ctx, ej_call *c)
{
	int code;
	switch (c->op) {
	case EJ_OP_ADD:
		code = 0;
		break;
	case EJ_OP_SUB:
		code = 1;
		break;
	case EJ_OP_MUL:
		code = 2;
		break;
	case EJ_OP_EQ:
		code = 3;
		break;
	case EJ_OP_NEG:
		code = 4;
		break;
	case EJ_OP_MAXIMUM:
		code = 5;
		break;
	default:
		return ej_eager_fallback(ctx, c);
	}
	epj_tensor *out = c->out[0];
	struct ej_ipw_args a;
	memset(&a, 0, sizeof a);
	a.a = ej_data(c->in[0]);
	a.b = c->n_in > 1 ? ej_data(c->in[1]) : a.a;
	a.dst = ej_data(out);
	a.n = numel_of(out);
	a.ndim = out->ndim;
	a.op = code;
	a.dt = c->in[0]->dtype;
	int64_t st[EPJ_MAX_DIMS];
	ej_broadcast_strides(c->in[0], out->ndim, out->shape, st);
	for (int d = 0; d < out->ndim; d++) {
		a.shape[d] = out->shape[d];
		a.a_st[d] = st[d];
	}
	if (c->n_in > 1) {
		ej_broadcast_strides(c->in[1], out->ndim, out->shape, st);
		for (int d = 0; d < out->ndim; d++)
			a.b_st[d] = st[d];
	}
	ej_launch_out o = out_of(out);
	return tmpl_run(ctx, "copy", copy_kernels, 4, "ej_ipw", a.n, &a,
			sizeof a, &o, 1);
}

static epj_status eg_pointwise(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *out = c->out[0];
	if (numel_of(out) == 0)
		return EPJ_OK;
	bool flt = is_float(out->dtype);
	for (int i = 0; i < c->n_in; i++)
		flt = flt && is_float(c->in[i]->dtype);
	if (!flt) {
		if (c->op == EJ_OP_CAST) {
			/* broadcast-free: a cast keeps the shape */
			return copy_contig(ctx, c->in[0], out);
		}
		return int_pointwise(ctx, c);
	}
	bool done;
	epj_status st =
	    kir_run(ctx, c->op, c->attrs, c->in, c->n_in, out, &done);
	if (st == EPJ_OK && !done)
		return ej_eager_fallback(ctx, c);
	return st;
}

/* ---- reductions -----------------------------------------------------------
 */

/* Reduces x over the dims flagged in red[] with op (SUM, MEAN or AMAX; MEAN
 * only over one dim) into out (contiguous; its elements in the row-major
 * order of x's kept dims). */
static epj_status reduce_dims(epj_ctx *ctx, ej_call *c, int op, epj_tensor *x,
			      const bool *red, epj_tensor *out)
{
	int nd = x->ndim, perm[EPJ_MAX_DIMS], nk = 0, nr = 0;
	int64_t kept = 1, rn = 1;
	for (int d = 0; d < nd; d++)
		if (!red[d]) {
			perm[nk++] = d;
			kept *= x->shape[d];
		}
	for (int d = 0; d < nd; d++)
		if (red[d]) {
			perm[nk + nr++] = d;
			rn *= x->shape[d];
		}
	if (numel_of(out) == 0)
		return EPJ_OK;
	if (rn == 0 || !is_float(x->dtype))
		return ej_eager_fallback(ctx, c); /* no kernel for these */
	epj_tensor *xv = NULL, *tmp = NULL;
	epj_status st = EPJ_OK;
	if (nd == 0) {
		int64_t one = 1, zero = 0;
		xv = view_of(x, 1, &one, &zero, x->offset);
	} else if (nr <= 1) {
		/* one reduced dim (or none): read it last, in place */
		xv = permuted(x, perm);
	} else {
		/* several: the permuted view made contiguous, as [kept, rn] */
		epj_tensor *pv = permuted(x, perm);
		tmp = pv ? contig_copy(ctx, pv) : NULL;
		epj_tensor_free(pv);
		int64_t sh2[2] = { kept, rn };
		xv = tmp ? reshaped(tmp, 2, sh2) : NULL;
	}
	if (!xv) {
		st = nomem(ctx, c);
		goto done;
	}
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, xv->ndim - 1);
	ej_attrs_push_i(&at, 1);
	bool ok;
	st = kir_run(ctx, op, &at, &xv, 1, out, &ok);
	if (st == EPJ_OK && !ok)
		st = ej_eager_fallback(ctx, c);
done:
	epj_tensor_free(xv);
	epj_tensor_free(tmp);
	return st;
}

/* sum, mean, amax: i[0] = axis, i[1] = keepdim */
static epj_status eg_reduce_axis(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0];
	bool red[EPJ_MAX_DIMS] = { false };
	if (x->ndim > 0)
		red[ej_axis((int)c->attrs->i[0], x->ndim)] = true;
	return reduce_dims(ctx, c, c->op, x, red, c->out[0]);
}

static epj_status eg_sum_all(epj_ctx *ctx, ej_call *c)
{
	bool red[EPJ_MAX_DIMS];
	for (int d = 0; d < EPJ_MAX_DIMS; d++)
		red[d] = true;
	return reduce_dims(ctx, c, EJ_OP_SUM, c->in[0], red, c->out[0]);
}

static epj_status eg_sum_to(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0];
	int nt = c->attrs->n_i, lead = x->ndim - nt;
	bool red[EPJ_MAX_DIMS], any = false;
	for (int d = 0; d < x->ndim; d++) {
		red[d] = d < lead ||
			 (c->attrs->i[d - lead] == 1 && x->shape[d] != 1);
		any |= red[d];
	}
	if (!any) /* nothing to reduce: a copy */
		return copy_contig(ctx, x, c->out[0]);
	return reduce_dims(ctx, c, EJ_OP_SUM, x, red, c->out[0]);
}

/* softmax, log_softmax: i[0] = axis.  Another axis than the last: computed
 * on the permuted view (axis last) into a scratch buffer, then copied to
 * the output's layout. */
static epj_status eg_softmax(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0], *out = c->out[0];
	if (numel_of(out) == 0)
		return EPJ_OK;
	int nd = x->ndim;
	int axis = nd > 0 ? ej_axis((int)c->attrs->i[0], nd) : 0;
	bool ok = false;
	epj_status st;
	if (nd == 0 || axis == nd - 1) {
		st = kir_run(ctx, c->op, c->attrs, c->in, 1, out, &ok);
		if (st == EPJ_OK && !ok)
			st = ej_eager_fallback(ctx, c);
		return st;
	}
	int perm[EPJ_MAX_DIMS], k = 0;
	for (int d = 0; d < nd; d++)
		if (d != axis)
			perm[k++] = d;
	perm[k] = axis;
	epj_tensor *xv = permuted(x, perm);
	epj_tensor *tmp =
	    xv ? ej_tensor_alloc(ctx, x->dtype, nd, xv->shape, false) : NULL;
	if (!tmp) {
		epj_tensor_free(xv);
		return nomem(ctx, c);
	}
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, nd - 1);
	st = kir_run(ctx, c->op, &at, &xv, 1, tmp, &ok);
	if (st == EPJ_OK && ok) {
		/* tmp[j] (permuted order) -> out at the permuted strides */
		int64_t cst[EPJ_MAX_DIMS], dst[EPJ_MAX_DIMS];
		ej_contiguous_strides(nd, out->shape, cst);
		for (int d = 0; d < nd; d++)
			dst[d] = cst[perm[d]];
		st = copy_into(ctx, tmp, out, dst, true);
	} else if (st == EPJ_OK) {
		st = ej_eager_fallback(ctx, c);
	}
	epj_tensor_free(xv);
	epj_tensor_free(tmp);
	return st;
}

/* max: (values, indices i64) along i[0] */
static epj_status eg_max(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0], *vals = c->out[0], *inds = c->out[1];
	int64_t n = numel_of(vals);
	if (n == 0)
		return EPJ_OK;
	struct ej_max_args a;
	memset(&a, 0, sizeof a);
	a.x = ej_data(x);
	a.vals = ej_data(vals);
	a.inds = ej_data(inds);
	a.n = n;
	a.dt = x->dtype;
	if (x->ndim == 0) {
		a.len = 1;
	} else {
		int axis = ej_axis((int)c->attrs->i[0], x->ndim);
		a.len = x->shape[axis];
		a.ax_st = x->stride[axis];
		for (int d = 0; d < x->ndim; d++) {
			if (d == axis)
				continue;
			a.shape[a.ndim] = x->shape[d];
			a.x_st[a.ndim++] = x->stride[d];
		}
	}
	ej_launch_out o[2] = { out_of(vals), out_of(inds) };
	return tmpl_run(ctx, "index", index_kernels, 7, "ej_max_index", n, &a,
			sizeof a, o, 2);
}

/* ---- shape and movement ------------------------------------------------
 */

/* contiguous, reshape (when no view is possible) and view ops asked to
 * materialise: the row-major order of the (view of the) input. */
static epj_status eg_copy(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0], *out = c->out[0];
	if (c->op == EJ_OP_CONTIGUOUS || c->op == EJ_OP_RESHAPE)
		return copy_contig(ctx, x, out);
	ej_meta m;
	epj_status st = ej_ops[c->op].infer(ctx, c, &m);
	if (st != EPJ_OK)
		return st;
	if (!m.is_view)
		return copy_contig(ctx, x, out);
	epj_tensor *v = view_of(x, m.ndim, m.shape, m.stride, m.offset);
	if (!v)
		return nomem(ctx, c);
	st = copy_contig(ctx, v, out);
	epj_tensor_free(v);
	return st;
}

static epj_status eg_cat(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *out = c->out[0];
	int nd = out->ndim, axis = ej_axis((int)c->attrs->i[0], nd);
	if (numel_of(out) == 0)
		return EPJ_OK;
	if (c->n_in > EJ_CAT_MAX) {
		/* one strided copy per input into its part of out */
		int64_t at = 0;
		for (int k = 0; k < c->n_in; k++) {
			epj_tensor *t = c->in[k];
			epj_tensor *dv =
			    view_of(out, nd, t->shape, out->stride,
				    out->offset + at * out->stride[axis]);
			if (!dv)
				return nomem(ctx, c);
			epj_status st =
			    copy_into(ctx, t, dv, out->stride, false);
			epj_tensor_free(dv);
			if (st != EPJ_OK)
				return st;
			at += t->shape[axis];
		}
		return EPJ_OK;
	}
	struct ej_cat_args *a = calloc(1, sizeof *a);
	if (!a)
		return nomem(ctx, c);
	a->dst = ej_data(out);
	a->n = numel_of(out);
	a->ndim = nd;
	a->axis = axis;
	a->n_in = c->n_in;
	a->dt = out->dtype;
	for (int d = 0; d < nd; d++)
		a->shape[d] = out->shape[d];
	int64_t at = 0;
	for (int k = 0; k < c->n_in; k++) {
		const epj_tensor *t = c->in[k];
		/* an empty input has no storage to point at */
		a->src[k] = numel_of(t) > 0 ? ej_data(t) : ej_data(out);
		a->start[k] = at;
		for (int d = 0; d < nd; d++)
			a->src_st[k][d] = t->stride[d];
		at += t->shape[axis];
	}
	a->start[c->n_in] = at;
	ej_launch_out o = out_of(out);
	epj_status st = tmpl_run(ctx, "copy", copy_kernels, 4, "ej_cat", a->n,
				 a, sizeof *a, &o, 1);
	free(a);
	return st;
}

/* (grad) -> zeros of the input shape with grad at the slice; i[0..4) =
 * axis, start, end, step */
static epj_status eg_slice_backward(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *g = c->in[0], *out = c->out[0];
	int nd = out->ndim;
	if (numel_of(out) == 0)
		return EPJ_OK;
	struct ej_slice_bw_args a;
	memset(&a, 0, sizeof a);
	a.axis = ej_axis((int)c->attrs->i[0], nd);
	a.src = numel_of(g) > 0 ? ej_data(g) : ej_data(out);
	a.dst = ej_data(out);
	a.n = numel_of(out);
	a.ndim = nd;
	a.dt = out->dtype;
	a.start = c->attrs->i[1];
	a.end = c->attrs->i[2];
	a.step = c->attrs->i[3] > 0 ? c->attrs->i[3] : 1;
	a.glen = g->shape[a.axis];
	for (int d = 0; d < nd; d++) {
		a.shape[d] = out->shape[d];
		a.src_st[d] = g->stride[d];
	}
	ej_launch_out o = out_of(out);
	return tmpl_run(ctx, "copy", copy_kernels, 4, "ej_slice_bw", a.n, &a,
			sizeof a, &o, 1);
}

/* full: i[0] = dtype, f[0] = value, converted as the CPU kernel does */
static epj_status eg_full(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *out = c->out[0];
	int64_t n = numel_of(out);
	if (n == 0)
		return EPJ_OK;
	double v = c->attrs->f[0];
	unsigned long long bits = 0;
	switch (out->dtype) {
	case EPJ_DTYPE_F32: {
		float x = (float)v;
		uint32_t u;
		memcpy(&u, &x, 4);
		bits = u;
		break;
	}
	case EPJ_DTYPE_BF16:
		bits = epj_f32_to_bf16((float)v);
		break;
	case EPJ_DTYPE_F64:
		memcpy(&bits, &v, 8);
		break;
	case EPJ_DTYPE_I32:
		bits = (uint32_t)(int32_t)v;
		break;
	default:
		bits = (uint64_t)(int64_t)v;
		break;
	}
	if (v == 0.0 && !signbit(v))
		bits = 0;
	struct ej_fill_args a = { ej_data(out), n, bits,
				  (int)ej_dtype_size(out->dtype) };
	ej_launch_out o = out_of(out);
	return tmpl_run(ctx, "fill", fill_kernels, 1, "ej_fill", n, &a,
			sizeof a, &o, 1);
}

/* ---- indexing -------------------------------------------------------------
 */

/* Every value of index input `input` in [0, limit), or EPJ_ERR_INDEX with
 * the CPU kernels' message: read in place on cuda-sim (host memory), from
 * the host copy its maker pinned (ej_index_pin: the routing the AutoEP
 * layer built on the host), else from a host copy of the index on cuda. */
static epj_status check_index(epj_ctx *ctx, const ej_call *c, int input,
			      int64_t limit, const char *what)
{
	const epj_tensor *t = c->in[input];
	int64_t n = numel_of(t), idx[EPJ_MAX_DIMS] = { 0 };
	if (n == 0)
		return EPJ_OK;
	const char *base = ej_data(t);
	bool i64 = t->dtype == EPJ_DTYPE_I64;
	char *copy = NULL;
	const int64_t *pin = ej_index_pinned(ctx, t);
	if (pin) {
		/* i64 values of a dense t: its strides index them too */
		base = (const char *)pin;
		i64 = true;
	} else if (!ctx->dev->host_visible) {
		/* the span the index covers, element 0 first */
		int64_t last = 0;
		for (int d = 0; d < t->ndim; d++)
			last += (t->shape[d] - 1) * t->stride[d];
		size_t bytes = (size_t)(last + 1) * ej_dtype_size(t->dtype);
		copy = malloc(bytes);
		if (!copy)
			return nomem(ctx, c);
		const ej_device *dev = ctx->dev;
		if (dev->sync)
			dev->sync(dev->self);
		dev->copy(dev->self, copy, base, bytes);
		base = copy;
	}
	for (int64_t e = 0; e < n; e++) {
		int64_t off = ej_offset_of(t->ndim, idx, t->stride);
		int64_t x = i64 ? ((const int64_t *)base)[off]
				: ((const int32_t *)base)[off];
		if (x < 0 || x >= limit) {
			free(copy);
			char pos[160];
			ej_shape_str(t->ndim, idx, pos, sizeof pos);
			return ej_op_error(ctx, c, EPJ_ERR_INDEX,
					   "index value %lld at position %s "
					   "(flat %lld) of input %d is out of "
					   "range [0, %lld) for %s",
					   (long long)x, pos, (long long)e,
					   input, (long long)limit, what);
		}
		ej_index_next(t->ndim, t->shape, idx);
	}
	free(copy);
	return EPJ_OK;
}

static epj_status eg_index_select(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0], *index = c->in[1], *out = c->out[0];
	int axis = ej_axis((int)c->attrs->i[0], x->ndim);
	epj_status st = check_index(ctx, c, 1, x->shape[axis],
				    "the selected "
				    "axis");
	if (st != EPJ_OK || numel_of(out) == 0)
		return st;
	struct ej_index_select_args a;
	memset(&a, 0, sizeof a);
	a.a = ej_data(x);
	a.idx = ej_data(index);
	a.dst = ej_data(out);
	a.n = numel_of(out);
	a.ndim = out->ndim;
	a.axis = axis;
	a.es = (int)ej_dtype_size(x->dtype);
	a.idx64 = index->dtype == EPJ_DTYPE_I64;
	a.idx_st = index->ndim == 1 ? index->stride[0] : 0;
	a.limit = x->shape[axis];
	for (int d = 0; d < out->ndim; d++) {
		a.shape[d] = out->shape[d];
		a.a_st[d] = x->stride[d];
	}
	ej_launch_out o = out_of(out);
	return tmpl_run(ctx, "index", index_kernels, 7, "ej_index_select", a.n,
			&a, sizeof a, &o, 1);
}

static epj_status eg_gather(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0], *index = c->in[1], *out = c->out[0];
	int axis = ej_axis((int)c->attrs->i[0], x->ndim);
	epj_status st =
	    check_index(ctx, c, 1, x->shape[axis], "the gathered axis");
	if (st != EPJ_OK || numel_of(out) == 0)
		return st;
	struct ej_gather_args a;
	memset(&a, 0, sizeof a);
	a.a = ej_data(x);
	a.idx = ej_data(index);
	a.dst = ej_data(out);
	a.n = numel_of(out);
	a.ndim = index->ndim;
	a.axis = axis;
	a.es = (int)ej_dtype_size(x->dtype);
	a.idx64 = index->dtype == EPJ_DTYPE_I64;
	a.limit = x->shape[axis];
	for (int d = 0; d < index->ndim; d++) {
		a.shape[d] = index->shape[d];
		a.a_st[d] = x->stride[d];
		a.idx_st[d] = index->stride[d];
	}
	ej_launch_out o = out_of(out);
	return tmpl_run(ctx, "index", index_kernels, 7, "ej_gather", a.n, &a,
			sizeof a, &o, 1);
}

static epj_status eg_index_add(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0], *index = c->in[1], *src = c->in[2];
	epj_tensor *out = c->out[0];
	int axis = ej_axis((int)c->attrs->i[0], x->ndim);
	epj_status st =
	    check_index(ctx, c, 1, x->shape[axis], "the target axis");
	if (st != EPJ_OK || numel_of(out) == 0)
		return st;
	struct ej_index_add_args a;
	memset(&a, 0, sizeof a);
	a.a = ej_data(x);
	a.idx = numel_of(index) > 0 ? ej_data(index) : ej_data(x);
	a.src = numel_of(src) > 0 ? ej_data(src) : ej_data(x);
	a.dst = ej_data(out);
	a.n = numel_of(out);
	a.ndim = x->ndim;
	a.axis = axis;
	a.dt = x->dtype;
	a.idx64 = index->dtype == EPJ_DTYPE_I64;
	a.idx_st = index->ndim == 1 ? index->stride[0] : 0;
	a.nidx = index->ndim == 1 ? index->shape[0] : 1;
	for (int d = 0; d < x->ndim; d++) {
		a.shape[d] = x->shape[d];
		a.a_st[d] = x->stride[d];
		a.src_st[d] = src->stride[d];
	}
	ej_launch_out o = out_of(out);
	return tmpl_run(ctx, "index", index_kernels, 7, "ej_index_add", a.n, &a,
			sizeof a, &o, 1);
}

static epj_status eg_scatter_add(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0], *index = c->in[1], *src = c->in[2];
	epj_tensor *out = c->out[0];
	int axis = ej_axis((int)c->attrs->i[0], x->ndim);
	epj_status st =
	    check_index(ctx, c, 1, x->shape[axis], "the scattered axis");
	if (st != EPJ_OK || numel_of(out) == 0)
		return st;
	struct ej_scatter_add_args a;
	memset(&a, 0, sizeof a);
	a.a = ej_data(x);
	a.idx = numel_of(index) > 0 ? ej_data(index) : ej_data(x);
	a.src = numel_of(src) > 0 ? ej_data(src) : ej_data(x);
	a.dst = ej_data(out);
	a.n = numel_of(out);
	a.ndim = x->ndim;
	a.axis = axis;
	a.dt = x->dtype;
	a.idx64 = index->dtype == EPJ_DTYPE_I64;
	for (int d = 0; d < x->ndim; d++) {
		a.shape[d] = x->shape[d];
		a.ishape[d] = index->shape[d];
		a.a_st[d] = x->stride[d];
		a.idx_st[d] = index->stride[d];
		a.src_st[d] = src->stride[d];
	}
	ej_launch_out o = out_of(out);
	return tmpl_run(ctx, "index", index_kernels, 7, "ej_scatter_add", a.n,
			&a, sizeof a, &o, 1);
}

/* topk along the last axis: i[0] = k */
static epj_status eg_topk(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0], *vals = c->out[0], *inds = c->out[1];
	int nd = x->ndim;
	int64_t len = x->shape[nd - 1];
	if (numel_of(vals) == 0)
		return EPJ_OK;
	struct ej_topk_args a;
	memset(&a, 0, sizeof a);
	a.x = ej_data(x);
	a.vals = ej_data(vals);
	a.inds = ej_data(inds);
	a.rows = numel_of(x) / len;
	a.ndim = nd - 1;
	a.dt = x->dtype;
	a.len = len;
	a.ax_st = x->stride[nd - 1];
	a.k = c->attrs->i[0];
	for (int d = 0; d < nd - 1; d++) {
		a.shape[d] = x->shape[d];
		a.x_st[d] = x->stride[d];
	}
	ej_launch_out o[2] = { out_of(vals), out_of(inds) };
	return tmpl_run(ctx, "index", index_kernels, 7, "ej_topk", a.rows, &a,
			sizeof a, o, 2);
}

/* argsort along i[0], stable ascending */
static epj_status eg_argsort(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *x = c->in[0], *out = c->out[0];
	int nd = x->ndim;
	if (numel_of(out) == 0)
		return EPJ_OK;
	struct ej_argsort_args a;
	memset(&a, 0, sizeof a);
	a.x = ej_data(x);
	a.out = ej_data(out);
	a.dt = x->dtype;
	if (nd == 0) {
		a.rows = 1;
		a.len = 1;
	} else {
		int axis = ej_axis((int)c->attrs->i[0], nd);
		a.len = x->shape[axis];
		a.ax_st = x->stride[axis];
		a.out_ax = out->stride[axis];
		a.rows = numel_of(x) / a.len;
		for (int d = 0; d < nd; d++) {
			if (d == axis)
				continue;
			a.shape[a.ndim] = x->shape[d];
			a.x_st[a.ndim] = x->stride[d];
			a.out_st[a.ndim++] = out->stride[d];
		}
	}
	ej_launch_out o = out_of(out);
	return tmpl_run(ctx, "index", index_kernels, 7, "ej_argsort", a.rows,
			&a, sizeof a, &o, 1);
}

/* ---- GEMM_ADD: r copied into the output, then the GEMM accumulates onto
 * it (kernels/tmpl_gemm.c) ------------------------------------------------- */
static epj_status eg_gemm_add(epj_ctx *ctx, ej_call *c)
{
	epj_tensor *o = c->out[0];
	epj_status st;
	if (o->dtype != EPJ_DTYPE_BF16) {
		st = copy_contig(ctx, c->in[2], o);
		if (st == EPJ_OK)
			st = ej_cuda_gemm_acc(ctx, c, o, true);
	} else {
		/* bf16 rounds the product before the add, as the CPU kernel
		 * (and eager MATMUL + ADD) do: the product into a temporary,
		 * then one pointwise add */
		epj_tensor *t =
		    ej_tensor_alloc(ctx, o->dtype, o->ndim, o->shape, false);
		if (!t)
			return ctx->status;
		st = ej_cuda_gemm_acc(ctx, c, t, false);
		if (st == EPJ_OK) {
			epj_tensor *in[2] = { c->in[2], t };
			ej_attrs none = ej_attrs_none();
			ej_call add = { .op = EJ_OP_ADD,
					.attrs = &none,
					.in = in,
					.n_in = 2,
					.out = c->out,
					.n_out = 1 };
			st = eg_pointwise(ctx, &add);
		}
		epj_tensor_free(t);
	}
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "gemm_add");
	return st;
}

/* ---- ROPE, ROPE_BACKWARD: the op chain they replace, each op an eager
 * CUDA kernel (the compiler makes ROPE for the C backend only) ---------- */
static epj_status eg_rope(epj_ctx *ctx, ej_call *c)
{
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *a = c->in[0], *cs = c->in[1], *sn = c->in[2];
	bool bw = c->op == EJ_OP_ROPE_BACKWARD;
	int64_t d = a->shape[a->ndim - 1];
	/* forward: a * cos + cat(-a2, a1) * sin; backward (a = grad):
	 * a * cos + cat(u2, -u1) with u = a * sin */
	epj_tensor *u = bw ? epj_mul(ctx, a, sn) : epj_tensor_ref(a);
	epj_tensor *u1 = u ? epj_slice(ctx, u, -1, 0, d / 2, 1) : NULL;
	epj_tensor *u2 = u ? epj_slice(ctx, u, -1, d / 2, d, 1) : NULL;
	epj_tensor *nu = epj_neg(ctx, bw ? u1 : u2);
	epj_tensor *parts[2] = { bw ? u2 : nu, bw ? nu : u1 };
	epj_tensor *rot = nu && u1 && u2 ? epj_cat(ctx, parts, 2, -1) : NULL;
	epj_tensor *rs =
	    rot && !bw ? epj_mul(ctx, rot, sn) : epj_tensor_ref(rot);
	epj_tensor *xc = epj_mul(ctx, a, cs);
	epj_tensor *y = rs && xc ? epj_add(ctx, xc, rs) : NULL;
	epj_no_grad_exit(ctx, prev);
	epj_status st = y ? copy_contig(ctx, y, c->out[0]) : ctx->status;
	epj_tensor *t[] = { u, u1, u2, nu, rot, rs, xc, y };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return st;
}

/* ---- the table ----------------------------------------------------------
 * Every op has an entry: the single-op lowerings and copy/index templates
 * of this file, and the adapters of the GEMM (kernels/tmpl_gemm.c), attention
 * (kernels/tmpl_attention.c) and embedding/loss (kernels/tmpl_moe.c) templates.
 * A NULL row would run the CPU reference kernel (counted). */

const ej_eager_fn ej_eager_cuda_table[EJ_OP_COUNT] = {
	[EJ_OP_ADD] = eg_pointwise,
	[EJ_OP_SUB] = eg_pointwise,
	[EJ_OP_MUL] = eg_pointwise,
	[EJ_OP_DIV] = eg_pointwise,
	[EJ_OP_EQ] = eg_pointwise,
	[EJ_OP_WHERE] = eg_pointwise,
	[EJ_OP_ADD_SCALAR] = eg_pointwise,
	[EJ_OP_MUL_SCALAR] = eg_pointwise,
	[EJ_OP_POW_SCALAR] = eg_pointwise,
	[EJ_OP_CAST] = eg_pointwise,
/* the EJ_OP_FN rows of ops.def: one generated kernel each (kir_run) */
#define EJ_OP(ID, name, n_in, n_out, flags)
#define EJ_OP_FN(ID, name, n_in, flags) [EJ_OP_##ID] = eg_pointwise,
#include "ops.def"
#undef EJ_OP_FN
#undef EJ_OP
	[EJ_OP_SUM] = eg_reduce_axis,
	[EJ_OP_MEAN] = eg_reduce_axis,
	[EJ_OP_AMAX] = eg_reduce_axis,
	[EJ_OP_MAX] = eg_max,
	[EJ_OP_SUM_ALL] = eg_sum_all,
	[EJ_OP_SUM_TO] = eg_sum_to,
	[EJ_OP_SOFTMAX] = eg_softmax,
	[EJ_OP_LOG_SOFTMAX] = eg_softmax,
	[EJ_OP_MATMUL] = ej_cuda_op_matmul,
	[EJ_OP_LINEAR] = ej_cuda_op_linear,
	[EJ_OP_GEMM_ADD] = eg_gemm_add,
	[EJ_OP_ROPE] = eg_rope,
	[EJ_OP_ROPE_BACKWARD] = eg_rope,
	[EJ_OP_SDPA] = ej_cuda_op_sdpa,
	[EJ_OP_SDPA_BACKWARD] = ej_cuda_op_sdpa_backward,
	[EJ_OP_CROSS_ENTROPY] = ej_cuda_op_cross_entropy,
	[EJ_OP_CROSS_ENTROPY_BACKWARD] = ej_cuda_op_cross_entropy_backward,
	[EJ_OP_EMBEDDING] = ej_cuda_op_embedding,
	[EJ_OP_EMBEDDING_BACKWARD] = ej_cuda_op_embedding_backward,
	[EJ_OP_INDEX_SELECT] = eg_index_select,
	[EJ_OP_INDEX_ADD] = eg_index_add,
	[EJ_OP_GATHER] = eg_gather,
	[EJ_OP_SCATTER_ADD] = eg_scatter_add,
	[EJ_OP_TOPK] = eg_topk,
	[EJ_OP_ARGSORT] = eg_argsort,
	[EJ_OP_RESHAPE] = eg_copy,
	[EJ_OP_TRANSPOSE] = eg_copy,
	[EJ_OP_PERMUTE] = eg_copy,
	[EJ_OP_SLICE] = eg_copy,
	[EJ_OP_SLICE_BACKWARD] = eg_slice_backward,
	[EJ_OP_EXPAND] = eg_copy,
	[EJ_OP_CONTIGUOUS] = eg_copy,
	[EJ_OP_CAT] = eg_cat,
	[EJ_OP_FULL] = eg_full,
	[EJ_OP_GATED_DELTA] = ej_cuda_op_gated_delta,
	[EJ_OP_GATED_DELTA_BACKWARD] = ej_cuda_op_gated_delta_backward,
	[EJ_OP_MOE_ROUTE] = ej_cuda_op_moe_route,
	[EJ_OP_MOE_ROUTE_BACKWARD] = ej_cuda_op_moe_route_backward,
	[EJ_OP_MOE_PERMUTE] = ej_cuda_op_moe_permute,
	[EJ_OP_MOE_PERMUTE_BACKWARD] = ej_cuda_op_moe_permute_backward,
	[EJ_OP_MOE_UNPERMUTE] = ej_cuda_op_moe_unpermute,
	[EJ_OP_MOE_UNPERMUTE_BACKWARD] = ej_cuda_op_moe_unpermute_backward,
	[EJ_OP_MOE_GROUPED_MM] = ej_cuda_op_moe_grouped_mm,
	[EJ_OP_MOE_GROUPED_MM_WGRAD] = ej_cuda_op_moe_grouped_mm_wgrad,
	[EJ_OP_SWIGLU] = ej_cuda_op_swiglu,
	[EJ_OP_SWIGLU_BACKWARD] = ej_cuda_op_swiglu_backward,
	[EJ_OP_SOLVE_TRIANGULAR] = ej_cuda_op_solve_triangular,
	[EJ_OP_SOLVE_TRIANGULAR_BACKWARD] =
	    ej_cuda_op_solve_triangular_backward,
};

void ej_eager_cuda_install(void)
{
	ej_eager_install(&ej_device_sim, ej_eager_cuda_table);
	/* the same entries on the GPU: NVRTC cubins, device memory */
	ej_eager_install_name("cuda", ej_eager_cuda_table);
}

/* At library load: a cuda-sim context runs its eager ops here from its
 * first op on, whoever created it. */
__attribute__((constructor)) static void eager_cuda_load(void)
{
	ej_eager_cuda_install();
}
