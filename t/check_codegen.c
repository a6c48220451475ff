/* check_codegen.c -- the code generator: fusion schedule, kernel IR, the C
 * backend (generated C, host cc, dlopen) against the interpreter, and the
 * CUDA C printer under NVRTC.
 *
 * Every case traces a small function (RMSNorm, RoPE, SwiGLU, softmax,
 * residual chains...) on random odd-sized inputs, compiles it once with the
 * C backend and once with the interpreter, and compares outputs and input
 * gradients (f64 1e-12, f32 1e-5, bf16 two ulps: fused kernels keep every
 * bf16 rounding of the op-by-op run, so they differ only by the order of
 * double sums, which can flip a bf16 tie).  Then every generated kernel is
 * checked alone: its group of nodes becomes a graph of its own, run on
 * fresh random, non-contiguous inputs by both backends.  Launch counts: the
 * C backend launches fewer kernels than the interpreter (RMSNorm forward:
 * one).  Every graph's CUDA C compiles under NVRTC for sm_80 and sm_90
 * without a warning (when NVRTC is built in).
 *
 * The kernel cache goes to a private temporary directory per test.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cc.h"
#include "jit_impl.h"
#include "kir.h"

/* ---- private cache directory ------------------------------------------ */

static char *cache_dir;

static void cache_setup(void)
{
	cache_dir = tu_tmpdir_new("codegen");
	setenv("EPJIT_CACHE_DIR", cache_dir, 1);
}

static void cache_teardown(void)
{
	tu_tmpdir_free(cache_dir);
	cache_dir = NULL;
}

/* ---- traced functions
 * --------------------------------------------------------- */

typedef tu_region_fn cg_fn;

/* RMSNorm as the model writes it (runtime/qwen3.c): f32 inside. */
static epj_tensor *rmsnorm(epj_ctx *ctx, epj_tensor *x, epj_tensor *w)
{
	bool up = epj_tensor_dtype(x) == EPJ_DTYPE_BF16;
	epj_tensor *xf =
	    up ? epj_cast(ctx, x, EPJ_DTYPE_F32) : epj_tensor_ref(x);
	epj_tensor *sq = epj_pow_scalar(ctx, xf, 2.0);
	epj_tensor *var = epj_mean(ctx, sq, -1, true);
	epj_tensor *ve = epj_add_scalar(ctx, var, 1e-6);
	epj_tensor *rs = epj_rsqrt(ctx, ve);
	epj_tensor *nx = epj_mul(ctx, xf, rs);
	epj_tensor *nc =
	    up ? epj_cast(ctx, nx, epj_tensor_dtype(x)) : epj_tensor_ref(nx);
	epj_tensor *y = epj_mul(ctx, w, nc);
	epj_tensor *t[] = { xf, sq, var, ve, rs, nx, nc };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

static epj_tensor *f_rmsnorm(epj_ctx *ctx, epj_tensor *const *in)
{
	return rmsnorm(ctx, in[0], in[1]);
}

/* x [B,H,T,D] * cos + rotate_half(x) * sin; cos, sin [T,D]. */
static epj_tensor *f_rope(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *x = in[0];
	int64_t d = epj_tensor_dim(x, -1);
	epj_tensor *x1 = epj_slice(ctx, x, -1, 0, d / 2, 1);
	epj_tensor *x2 = epj_slice(ctx, x, -1, d / 2, d, 1);
	epj_tensor *nx2 = epj_neg(ctx, x2);
	epj_tensor *parts[2] = { nx2, x1 };
	epj_tensor *rot = epj_cat(ctx, parts, 2, -1);
	epj_tensor *xc = epj_mul(ctx, x, in[1]);
	epj_tensor *rs = epj_mul(ctx, rot, in[2]);
	epj_tensor *y = epj_add(ctx, xc, rs);
	epj_tensor *t[] = { x1, x2, nx2, rot, xc, rs };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

/* down(silu(gate(x)) * up(x)); weights are inputs here. */
static epj_tensor *f_swiglu(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *g = epj_linear(ctx, in[0], in[1], NULL);
	epj_tensor *s = epj_silu(ctx, g);
	epj_tensor *u = epj_linear(ctx, in[0], in[2], NULL);
	epj_tensor *m = epj_mul(ctx, s, u);
	epj_tensor *y = epj_linear(ctx, m, in[3], NULL);
	epj_tensor *t[] = { g, s, u, m };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

/* softmax(x * scale + mask) + log_softmax(x) + a hand-written softmax. */
static epj_tensor *f_softmax(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *x = in[0];
	epj_tensor *xs = epj_mul_scalar(ctx, x, 0.37);
	epj_tensor *xm = epj_add(ctx, xs, in[1]);
	epj_tensor *p = epj_softmax(ctx, xm, -1);
	epj_tensor *lp = epj_log_softmax(ctx, x, -1);
	epj_tensor *m = epj_amax(ctx, x, -1, true);
	epj_tensor *d = epj_sub(ctx, x, m);
	epj_tensor *e = epj_exp(ctx, d);
	epj_tensor *s = epj_sum(ctx, e, -1, true);
	epj_tensor *q = epj_div(ctx, e, s);
	epj_tensor *a = epj_add(ctx, p, lp);
	epj_tensor *y = epj_add(ctx, a, q);
	epj_tensor *t[] = { xs, xm, p, lp, m, d, e, s, q, a };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

/* h = x + a; y = (h * g + b) * sigmoid(h) - tanh(h) / 3 + gelu(x)
 * with g [T,1], b [H] broadcast, then a cast round trip. */
static epj_tensor *f_residual(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *h = epj_add(ctx, in[0], in[1]);
	epj_tensor *hg = epj_mul(ctx, h, in[2]);
	epj_tensor *hb = epj_add(ctx, hg, in[3]);
	epj_tensor *sg = epj_sigmoid(ctx, h);
	epj_tensor *p = epj_mul(ctx, hb, sg);
	epj_tensor *th = epj_tanh(ctx, h);
	epj_tensor *t3 = epj_mul_scalar(ctx, th, 1.0 / 3.0);
	epj_tensor *dd = epj_sub(ctx, p, t3);
	epj_tensor *ge = epj_gelu(ctx, in[0]);
	epj_tensor *y = epj_add(ctx, dd, ge);
	epj_tensor *t[] = { h, hg, hb, sg, p, th, t3, dd, ge };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

/* ---- compile and compare ------------------------------------------------- */

typedef struct run_out {
	epj_tensor *y;
	epj_tensor *grad[8];
	int64_t launches_fwd, launches_bwd;
} run_out;

/* Compiles fn with `backend` and runs it; with train, also backward of
 * sum(y * w) into the grads of the inputs that require grad. */
static ej_region_fn *run_backend(epj_ctx *ctx, ej_jit *jit, cg_fn fn,
				 epj_tensor *const *in, int n_in, epj_tensor *w,
				 run_out *r)
{
	memset(r, 0, sizeof *r);
	ej_region_fn *f = tu_compile_region(ctx, jit, fn, in, n_in);
	int64_t l0 = epj_counter_get(ctx, "kernels.launched.compiled");
	epj_status st =
	    ej_region_run(ctx, f, in, n_in, NULL, 0, NULL, NULL, &r->y, 1);
	ck_assert_msg(st == EPJ_OK, "run: %s", epj_ctx_error(ctx));
	int64_t l1 = epj_counter_get(ctx, "kernels.launched.compiled");
	r->launches_fwd = l1 - l0;
	if (w) {
		epj_tensor *yw = epj_mul(ctx, r->y, w);
		epj_tensor *loss = epj_sum_all(ctx, yw);
		tu_ok(ctx, loss);
		ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		r->launches_bwd =
		    epj_counter_get(ctx, "kernels.launched.compiled") - l1;
		for (int i = 0; i < n_in; i++) {
			epj_tensor *g = epj_tensor_grad(in[i]);
			r->grad[i] = g ? epj_detach(ctx, g) : NULL;
			epj_tensor_zero_grad(in[i]);
			epj_tensor_set_grad(in[i], NULL);
		}
		epj_tensor_free(yw);
		epj_tensor_free(loss);
	}
	return f;
}

static void run_out_free(run_out *r)
{
	epj_tensor_free(r->y);
	for (int i = 0; i < 8; i++)
		epj_tensor_free(r->grad[i]);
}

static double tol_of(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64   ? 1e-12
	       : dt == EPJ_DTYPE_F32 ? 1e-5
				     : 1.6e-2;
}

static void check_kernels_of(epj_ctx *ctx, ej_graph *g, void *state,
			     epj_dtype dt);
static void nvrtc_check(epj_ctx *ctx, ej_graph *const *gs, void *const *states,
			int n_g);

/* The shape of the cases: compiles fn with both backends (train: inputs
 * require grad, forward and backward), compares outputs and gradients,
 * checks every kernel of every graph alone and under NVRTC, and returns
 * launch counts and the first forward's schedule size. */
typedef struct case_res {
	int64_t c_fwd, c_bwd, i_fwd, i_bwd;
	int fwd_kernels, fwd_extern;
} case_res;

static case_res run_case(epj_ctx *ctx, cg_fn fn, epj_tensor *const *in,
			 int n_in, bool train, const char *what)
{
	case_res cr = { 0 };
	epj_dtype dt = epj_tensor_dtype(in[0]);
	double tol = tol_of(dt);
	bool prev = false;
	if (!train)
		prev = epj_no_grad_enter(ctx);
	epj_tensor *w = NULL;
	if (train) {
		for (int i = 0; i < n_in; i++)
			epj_tensor_set_requires_grad(in[i], true);
	}
	ej_jit *jc = ej_jit_new(ctx, EJ_BACKEND_C);
	ej_jit *ji = ej_jit_new(ctx, EJ_BACKEND_INTERPRETER);
	run_out rc, ri;
	/* the output's shape, for the random weight of the loss */
	{
		bool p2 = epj_no_grad_enter(ctx);
		epj_tensor *y = fn(ctx, in);
		tu_ok(ctx, y);
		if (train)
			w = tu_randn(ctx, epj_tensor_dtype(y),
				     epj_tensor_ndim(y), epj_tensor_shape(y));
		epj_tensor_free(y);
		epj_no_grad_exit(ctx, p2);
	}
	ej_region_fn *fc = run_backend(ctx, jc, fn, in, n_in, w, &rc);
	ej_region_fn *fi = run_backend(ctx, ji, fn, in, n_in, w, &ri);
	char buf[128];
	snprintf(buf, sizeof buf, "%s %s output", what, epj_dtype_name(dt));
	tu_assert_tensors_close(ctx, rc.y, ri.y, tol, tol, buf);
	for (int i = 0; train && i < n_in; i++) {
		snprintf(buf, sizeof buf, "%s %s grad of input %d", what,
			 epj_dtype_name(dt), i);
		ck_assert_msg(rc.grad[i] && ri.grad[i], "%s missing", buf);
		tu_assert_tensors_close(ctx, rc.grad[i], ri.grad[i], tol, tol,
					buf);
	}
	cr.c_fwd = rc.launches_fwd;
	cr.c_bwd = rc.launches_bwd;
	cr.i_fwd = ri.launches_fwd;
	cr.i_bwd = ri.launches_bwd;
	/* kernel-level checks and NVRTC on every graph compiled */
	for (int s = 0; s < fc->n_steps; s++) {
		ej_segment *seg = fc->steps[s].seg;
		if (fc->steps[s].is_break)
			continue;
		ej_graph *gs[2] = { seg->fwd, seg->bwd };
		void *states[2] = { seg->fwd_state, seg->bwd_state };
		int n_g = seg->bwd ? 2 : 1;
		for (int k = 0; k < n_g; k++)
			check_kernels_of(ctx, gs[k], states[k], dt);
		nvrtc_check(ctx, gs, states, n_g);
		if (s == 0) {
			ej_arena *A = ej_arena_new();
			ej_schedule *sc = ej_sched_build(A, seg->fwd);
			cr.fwd_kernels = sc->n_kernels;
			cr.fwd_extern = sc->n_extern;
			ej_arena_free(A);
		}
	}
	run_out_free(&rc);
	run_out_free(&ri);
	ej_region_fn_free(fc);
	ej_region_fn_free(fi);
	ej_jit_free(jc);
	ej_jit_free(ji);
	epj_tensor_free(w);
	if (!train)
		epj_no_grad_exit(ctx, prev);
	return cr;
}

/* ---- kernel-level: each kernel as a graph of its own ------------------------
 */

/* Fresh inputs: |N(0,1)| + 0.25 (positive, so log/sqrt/rsqrt stay finite),
 * every second one non-contiguous. */
static epj_tensor *fresh_input(epj_ctx *ctx, const ej_value *v, int i)
{
	epj_tensor *r = tu_randn(ctx, v->dtype, v->ndim, v->shape);
	int64_t n = epj_tensor_numel(r);
	for (int64_t q = 0; q < n; q++)
		epj_tensor_set_f64(r, q, fabs(epj_tensor_get_f64(r, q)) + 0.25);
	if (i % 2 == 1 && v->ndim >= 1) {
		epj_tensor *nc = tu_noncontig(ctx, r);
		epj_tensor_free(r);
		r = nc;
	}
	return r;
}

/* Appends kernel k of g to sub: its inputs become sub inputs (numbered
 * from *n_in on), its nodes are copied, its outputs become sub outputs. */
static void add_kernel(ej_graph *sub, const ej_graph *g, const ej_kernel *k,
		       int *n_in)
{
	int *map = calloc((size_t)g->n_values + 1, sizeof(int));
	ck_assert_ptr_nonnull(map);
	for (int i = 0; i < k->n_in; i++) {
		const ej_value *v = &g->values[k->in[i].value];
		map[k->in[i].value] = ej_graph_add_input(
		    sub, EJ_IN_ACT, (*n_in)++, v->dtype, v->ndim, v->shape);
	}
	for (int i = 0; i < k->n_nodes; i++) {
		const ej_ir_node *n = &g->nodes[k->nodes[i]];
		int ins[64];
		ej_meta m;
		const ej_value *o = &g->values[n->out[0]];
		memset(&m, 0, sizeof m);
		m.dtype = o->dtype;
		m.ndim = o->ndim;
		memcpy(m.shape, o->shape, sizeof m.shape);
		for (int j = 0; j < n->n_in; j++)
			ins[j] = map[n->in[j]];
		int nn = ej_graph_add_node(sub, n->op, &n->attrs, ins, n->n_in,
					   &m, 1);
		map[n->out[0]] = sub->nodes[nn].out[0];
	}
	for (int o = 0; o < k->n_out; o++)
		ej_graph_add_output(sub, map[k->out[o].value]);
	free(map);
}

/* Every fused kernel of a built graph alone, on fresh random inputs (every
 * second one non-contiguous), against its nodes run op by op. */
static void check_kernels_of(epj_ctx *ctx, ej_graph *g, void *state,
			     epj_dtype dt)
{
	const ej_schedule *s = ej_backend_c_schedule(state);
	for (int ki = 0; ki < s->n_kernels; ki++) {
		const ej_kernel *k = s->kernels[ki];
		ej_graph *sub = ej_graph_new("kernel");
		int n_in = 0;
		add_kernel(sub, g, k, &n_in);
		epj_tensor *in[64], *oc[16] = { 0 }, *oi[16] = { 0 };
		ck_assert(k->n_in <= 64 && k->n_out <= 16);
		for (int i = 0; i < k->n_in; i++)
			in[i] = fresh_input(
			    ctx, &sub->values[sub->inputs[i].value], i);
		int64_t l0 = epj_counter_get(ctx, "kernels.launched.compiled");
		epj_status st = ej_backend_c_run_kernel(ctx, state, ki, in, oc);
		ck_assert_msg(st == EPJ_OK, "run: %s", epj_ctx_error(ctx));
		ck_assert_int_eq(
		    epj_counter_get(ctx, "kernels.launched.compiled") - l0, 1);
		st = ej_interp_run(ctx, sub, in, oi);
		ck_assert_msg(st == EPJ_OK, "interp: %s", epj_ctx_error(ctx));
		for (int o = 0; o < k->n_out; o++) {
			char what[96];
			snprintf(what, sizeof what, "kernel %d output %d (%s)",
				 ki, o, epj_dtype_name(dt));
			tu_assert_tensors_close(ctx, oc[o], oi[o], tol_of(dt),
						tol_of(dt), what);
			epj_tensor_free(oc[o]);
			epj_tensor_free(oi[o]);
		}
		for (int i = 0; i < k->n_in; i++)
			epj_tensor_free(in[i]);
		ej_graph_free(sub);
	}
}

/* ---- NVRTC ------------------------------------------------------------------
 */

/* The kernels of a segment's forward and backward, side by side in one
 * graph (the same kernels again, nothing extern), as one CUDA C unit
 * through NVRTC for sm_80 and sm_90: no error, no warning, a cubin. */
static void nvrtc_check(epj_ctx *ctx, ej_graph *const *gs, void *const *states,
			int n_g)
{
	ej_graph *sub = ej_graph_new("kernels");
	int n_in = 0, n_kernels = 0;
	for (int i = 0; i < n_g; i++) {
		const ej_schedule *s = ej_backend_c_schedule(states[i]);
		for (int k = 0; k < s->n_kernels; k++)
			add_kernel(sub, gs[i], s->kernels[k], &n_in);
		n_kernels += s->n_kernels;
	}
	ej_arena *A = ej_arena_new();
	ej_schedule *s2 = ej_sched_build(A, sub);
	ck_assert_int_eq(s2->n_kernels, n_kernels);
	ck_assert_int_eq(s2->n_extern, 0);
	ej_arena_free(A);
#ifdef HAVE_NVRTC
	char *src = NULL;
	epj_status st = ej_codegen_emit_cuda(ctx, sub, "cg_test", &src);
	ck_assert_msg(st == EPJ_OK, "emit cuda: %s", epj_ctx_error(ctx));
	ck_assert(n_kernels == 0 || src);
	const char *archs[2] = { "sm_80", "sm_90" };
	for (int a = 0; src && a < 2; a++) {
		ej_nvrtc_result r = { 0 };
		st = ej_nvrtc_compile(ctx, src, "cg_test", archs[a], NULL, 0,
				      &r);
		ck_assert_msg(st == EPJ_OK, "nvrtc %s: %s", archs[a],
			      epj_ctx_error(ctx));
		ck_assert_msg(!ej_nvrtc_log_has_warning(r.log),
			      "nvrtc %s warned:\n%s\n%s", archs[a], r.log, src);
		ck_assert_msg(r.size > 0 && !r.is_ptx, "no cubin for %s",
			      archs[a]);
		ej_nvrtc_result_free(&r);
	}
	free(src);
#else
	(void)ctx;
#endif
	ej_graph_free(sub);
}

/* ---- cases ------------------------------------------------------------------
 */

static int count_op(const ej_graph *g, int op)
{
	int n = 0;
	for (int i = 0; g && i < g->n_nodes; i++)
		n += !g->nodes[i].dead && g->nodes[i].op == op;
	return n;
}

static const epj_dtype dtypes[3] = { EPJ_DTYPE_F32, EPJ_DTYPE_F64,
				     EPJ_DTYPE_BF16 };

START_TEST(test_rmsnorm)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	epj_dtype dt = dtypes[_i];
	int64_t B = tu_randint(1, 4), T = 2 * tu_randint(1, 4) + 1,
		H = 2 * tu_randint(2, 9) + 1;
	int64_t sx[3] = { B, T, H };
	epj_tensor *x = tu_randn(ctx, dt, 3, sx);
	epj_tensor *xn = tu_noncontig(ctx, x);
	epj_tensor *w = tu_randn(ctx, dt, 1, &H);
	epj_tensor *in[2] = { xn, w };
	/* eval: the whole norm is one kernel */
	case_res e = run_case(ctx, f_rmsnorm, in, 2, false, "rmsnorm eval");
	ck_assert_int_eq(e.c_fwd, 1);
	ck_assert_int_eq(e.fwd_kernels, 1);
	ck_assert_int_eq(e.fwd_extern, 0);
	ck_assert_int_lt(e.c_fwd, e.i_fwd);
	/* train: forward stays one kernel, backward is fused too */
	case_res t = run_case(ctx, f_rmsnorm, in, 2, true, "rmsnorm train");
	ck_assert_int_eq(t.c_fwd, 1);
	ck_assert_int_lt(t.c_bwd, t.i_bwd);
	ck_assert_int_le(t.c_bwd, 3); /* row kernel + pointwise + w's sum */
	epj_tensor_free(x);
	epj_tensor_free(xn);
	epj_tensor_free(w);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

START_TEST(test_rope)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	epj_dtype dt = dtypes[_i];
	int64_t B = tu_randint(1, 3), Hh = 2 * tu_randint(1, 3) + 1,
		T = 2 * tu_randint(1, 4) + 1, D = 2 * tu_randint(2, 6);
	int64_t sx[4] = { B, Hh, T, D }, sc[2] = { T, D };
	epj_tensor *x = tu_randn(ctx, dt, 4, sx);
	epj_tensor *xt = tu_noncontig(ctx, x);
	epj_tensor *c = tu_randn(ctx, dt, 2, sc);
	epj_tensor *s = tu_randn(ctx, dt, 2, sc);
	epj_tensor *in[3] = { xt, c, s };
	case_res t = run_case(ctx, f_rope, in, 3, true, "rope");
	ck_assert_int_lt(t.c_fwd, t.i_fwd);
	/* the C backend runs the chain as one ROPE op, and its backward
	 * (slices, neg, zero-filled slice_backward copies, adds) as one
	 * ROPE_BACKWARD plus the cos / sin gradients */
	ck_assert_int_eq(t.c_fwd, 1);
	ck_assert_int_lt(t.c_fwd + t.c_bwd, t.i_fwd + t.i_bwd);
	ej_jit *jc = ej_jit_new(ctx, EJ_BACKEND_C);
	ej_region_fn *f = tu_compile_region(ctx, jc, f_rope, in, 3);
	ej_segment *seg = f->steps[0].seg;
	ck_assert_int_eq(count_op(seg->fwd, EJ_OP_ROPE), 1);
	ck_assert_int_eq(count_op(seg->fwd, EJ_OP_CAT), 0);
	ck_assert_int_eq(count_op(seg->fwd, EJ_OP_NEG), 0);
	ck_assert_int_eq(count_op(seg->bwd, EJ_OP_ROPE_BACKWARD), 1);
	ck_assert_int_eq(count_op(seg->bwd, EJ_OP_SLICE_BACKWARD), 0);
	ej_region_fn_free(f);
	ej_jit_free(jc);
	epj_tensor_free(x);
	epj_tensor_free(xt);
	epj_tensor_free(c);
	epj_tensor_free(s);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

/* The ROPE / ROPE_BACKWARD ops on unit-stride rows (the model's layout:
 * a [B,T,H,D] tensor viewed as [B,H,T,D], column stride 1: the vectorised
 * path of lib/ops_rope.c).  Bit for bit the eager op chain (forward) and
 * its autograd gradient (backward); the same bits as the generic strided
 * rows on the same values; within the roundings of a double reference.
 * Odd row counts, half widths that are no multiple of the vector width. */
START_TEST(test_rope_unit)
{
	epj_ctx *ctx = tu_ctx();
	epj_dtype dt = dtypes[_i];
	int64_t B = tu_randint(1, 3), Hh = 2 * tu_randint(1, 3) + 1,
		T = 2 * tu_randint(1, 6) + 1,
		D = 2 * (8 * tu_randint(0, 3) + tu_randint(1, 8));
	int64_t sx[4] = { B, T, Hh, D }, sg[4] = { B, Hh, T, D },
		sc[2] = { T, D };
	epj_tensor *x0 = tu_randn(ctx, dt, 4, sx);
	epj_tensor *x = epj_transpose(ctx, x0, 1, 2);
	tu_ok(ctx, x);
	ck_assert_int_eq(epj_tensor_strides(x)[3], 1);
	ck_assert(!epj_tensor_is_contiguous(x));
	epj_tensor *c = tu_randn(ctx, dt, 2, sc);
	epj_tensor *s = tu_randn(ctx, dt, 2, sc);
	epj_tensor *g = tu_randn(ctx, dt, 4, sg);
	ej_attrs at = ej_attrs_none();
	epj_tensor *in[3] = { x, c, s }, *gin[3] = { g, c, s };
	epj_tensor *y = ej_call1(ctx, EJ_OP_ROPE, in, 3, &at);
	epj_tensor *dx = ej_call1(ctx, EJ_OP_ROPE_BACKWARD, gin, 3, &at);
	tu_ok(ctx, y);
	tu_ok(ctx, dx);
	/* the op chain, eager, and its gradient by autograd */
	epj_tensor *xl = epj_contiguous(ctx, x);
	epj_tensor_set_requires_grad(xl, true);
	epj_tensor *cin[3] = { xl, c, s };
	epj_tensor *yc = f_rope(ctx, cin);
	tu_ok(ctx, yc);
	ck_assert(epj_backward(ctx, yc, g) == EPJ_OK);
	epj_tensor *dxc = epj_tensor_grad(xl); /* borrowed */
	tu_ok(ctx, dxc);
	tu_assert_tensors_close(ctx, y, yc, 0, 0, "rope unit rows vs chain");
	tu_assert_tensors_close(ctx, dx, dxc, 0, 0,
				"rope_backward unit rows vs chain gradient");
	/* generic rows: the same values with a strided last dim */
	epj_tensor *xn = tu_noncontig(ctx, x), *gn = tu_noncontig(ctx, g);
	ck_assert_int_ne(epj_tensor_strides(xn)[3], 1);
	epj_tensor *nin[3] = { xn, c, s }, *ngin[3] = { gn, c, s };
	epj_tensor *yn = ej_call1(ctx, EJ_OP_ROPE, nin, 3, &at);
	epj_tensor *dxn = ej_call1(ctx, EJ_OP_ROPE_BACKWARD, ngin, 3, &at);
	tu_ok(ctx, yn);
	tu_ok(ctx, dxn);
	tu_assert_tensors_close(ctx, y, yn, 0, 0, "rope unit vs strided rows");
	tu_assert_tensors_close(ctx, dx, dxn, 0, 0,
				"rope_backward unit vs strided rows");
	/* double reference: y = x c + rot(x) s, dx = g c + rot^T(g s) */
	double *vx = tu_values(ctx, x), *vc = tu_values(ctx, c),
	       *vs = tu_values(ctx, s), *vg = tu_values(ctx, g),
	       *vy = tu_values(ctx, y), *vd = tu_values(ctx, dx);
	double eps = dt == EPJ_DTYPE_BF16  ? 3.0 / 256
		     : dt == EPJ_DTYPE_F32 ? 3e-7
					   : 1e-15;
	int64_t h = D / 2, rows = B * Hh * T;
	for (int64_t r = 0; r < rows; r++)
		for (int64_t j = 0; j < D; j++) {
			int64_t t = r % T, i = r * D + j, cj = t * D + j;
			int64_t k = j < h ? j + h : j - h, ik = r * D + k,
				ck = t * D + k;
			double sg1 = j < h ? -1 : 1;
			double a = vx[i] * vc[cj], b = sg1 * vx[ik] * vs[cj];
			double e = vg[i] * vc[cj], f = -sg1 * vg[ik] * vs[ck];
			if (!(fabs(vy[i] - (a + b)) <=
			      eps * (fabs(a) + fabs(b)) + 1e-30))
				ck_abort_msg("rope row %lld col %lld: %g vs %g",
					     (long long)r, (long long)j, vy[i],
					     a + b);
			if (!(fabs(vd[i] - (e + f)) <=
			      eps * (fabs(e) + fabs(f)) + 1e-30))
				ck_abort_msg(
				    "rope_backward row %lld col %lld: %g vs %g",
				    (long long)r, (long long)j, vd[i], e + f);
		}
	free(vx);
	free(vc);
	free(vs);
	free(vg);
	free(vy);
	free(vd);
	epj_tensor *t[] = { x0, x, c, s, g, y, dx, xl, yc, xn, gn, yn, dxn };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	epj_ctx_free(ctx);
}
END_TEST

/* GEMM_ADD in bf16 against eager's product + add, bit for bit: the
 * epilogue (product rounded to bf16, added to r, rounded again) runs in
 * chunks of 16384 values through an ISA-cloned loop; odd sizes over
 * several chunks, a tail chunk, both the matmul and the linear form. */
START_TEST(test_gemm_add_bf16)
{
	epj_ctx *ctx = tu_ctx();
	epj_dtype dt = EPJ_DTYPE_BF16;
	int64_t M = 2 * tu_randint(90, 110) + 1,
		N = 2 * tu_randint(140, 160) + 1, K = 2 * tu_randint(5, 20) + 1;
	int64_t sa[2] = { M, K }, sb[2] = { K, N }, sw[2] = { N, K },
		sr[2] = { M, N };
	epj_tensor *a = tu_randn(ctx, dt, 2, sa), *b = tu_randn(ctx, dt, 2, sb),
		   *w = tu_randn(ctx, dt, 2, sw), *r = tu_randn(ctx, dt, 2, sr);
	for (int lin = 0; lin < 2; lin++) {
		ej_attrs at = ej_attrs_none();
		at.i[0] = lin;
		at.n_i = 1;
		epj_tensor *in[3] = { a, lin ? w : b, r };
		epj_tensor *y = ej_call1(ctx, EJ_OP_GEMM_ADD, in, 3, &at);
		tu_ok(ctx, y);
		epj_tensor *p =
		    lin ? epj_linear(ctx, a, w, NULL) : epj_matmul(ctx, a, b);
		epj_tensor *ref = epj_add(ctx, r, p);
		tu_ok(ctx, ref);
		tu_assert_tensors_close(
		    ctx, y, ref, 0, 0,
		    lin ? "gemm_add (linear) bf16 vs eager"
			: "gemm_add (matmul) bf16 vs eager");
		epj_tensor_free(y);
		epj_tensor_free(p);
		epj_tensor_free(ref);
	}
	epj_tensor_free(a);
	epj_tensor_free(b);
	epj_tensor_free(w);
	epj_tensor_free(r);
	epj_ctx_free(ctx);
}
END_TEST

/* Fused row sums fold 8 double lanes and a tail in the eager row sum's
 * order (jit/print_c.c, lib/ops_reduce.c): the fused RMSNorm forward (one
 * kernel, sum of squares in its first column loop) equals the op-by-op
 * run bit for bit, f64 included (where another summation order shows in
 * the last bits), for row lengths below, at and above the lane count,
 * through the unit-stride and the strided loop copies. */
START_TEST(test_rowsum_lanes)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	epj_dtype dt = dtypes[_i];
	int64_t lens[4] = { tu_randint(1, 8), 8 * tu_randint(1, 4),
			    8 * tu_randint(2, 40) + tu_randint(1, 8),
			    8 * tu_randint(2, 40) + tu_randint(1, 8) };
	for (int k = 0; k < 4; k++) {
		int64_t sx[2] = { 2 * tu_randint(2, 30) + 1, lens[k] };
		epj_tensor *x = tu_randn_nc(ctx, dt, 2, sx, k == 3);
		epj_tensor *w = tu_randn(ctx, dt, 1, &sx[1]);
		epj_tensor *in[2] = { x, w };
		ej_jit *jc = ej_jit_new(ctx, EJ_BACKEND_C);
		ej_jit *ji = ej_jit_new(ctx, EJ_BACKEND_INTERPRETER);
		run_out rc, ri;
		bool prev = epj_no_grad_enter(ctx);
		ej_region_fn *fc =
		    run_backend(ctx, jc, f_rmsnorm, in, 2, NULL, &rc);
		ej_region_fn *fi =
		    run_backend(ctx, ji, f_rmsnorm, in, 2, NULL, &ri);
		epj_no_grad_exit(ctx, prev);
		/* the compiled arm ran one fused kernel, op by op ran 6+ */
		ck_assert_int_eq(rc.launches_fwd, 1);
		ck_assert_int_gt(ri.launches_fwd, 4);
		char what[96];
		snprintf(what, sizeof what, "rmsnorm %s, %lld columns%s",
			 epj_dtype_name(dt), (long long)sx[1],
			 k == 3 ? ", strided" : "");
		tu_assert_tensors_close(ctx, rc.y, ri.y, 0, 0, what);
		run_out_free(&rc);
		run_out_free(&ri);
		ej_region_fn_free(fc);
		ej_region_fn_free(fi);
		ej_jit_free(jc);
		ej_jit_free(ji);
		epj_tensor_free(x);
		epj_tensor_free(w);
	}
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

START_TEST(test_swiglu)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	epj_dtype dt = dtypes[_i];
	int64_t N = 2 * tu_randint(1, 5) + 1, H = 2 * tu_randint(1, 4) + 1,
		I = 2 * tu_randint(1, 5) + 1;
	int64_t sx[2] = { N, H }, sg[2] = { I, H }, sd[2] = { H, I };
	epj_tensor *in[4] = { tu_randn(ctx, dt, 2, sx),
			      tu_randn(ctx, dt, 2, sg),
			      tu_randn(ctx, dt, 2, sg),
			      tu_randn(ctx, dt, 2, sd) };
	case_res t = run_case(ctx, f_swiglu, in, 4, true, "swiglu");
	ck_assert_int_eq(t.c_fwd, 4); /* 3 GEMMs + silu*mul */
	ck_assert_int_eq(t.i_fwd, 5);
	ck_assert_int_lt(t.c_bwd, t.i_bwd);
	for (int i = 0; i < 4; i++)
		epj_tensor_free(in[i]);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

START_TEST(test_softmax)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	epj_dtype dt = dtypes[_i];
	int64_t R = 2 * tu_randint(1, 5) + 1, C = 2 * tu_randint(1, 9) + 1;
	int64_t sx[2] = { R, C }, sm[2] = { 1, C };
	epj_tensor *x = tu_randn(ctx, dt, 2, sx);
	epj_tensor *xn = tu_noncontig(ctx, x);
	epj_tensor *in[2] = { xn, tu_randn(ctx, dt, 2, sm) };
	case_res t = run_case(ctx, f_softmax, in, 2, true, "softmax");
	ck_assert_int_eq(t.c_fwd, 1); /* everything is one row kernel */
	ck_assert_int_lt(t.c_fwd + t.c_bwd, t.i_fwd + t.i_bwd);
	epj_tensor_free(x);
	epj_tensor_free(xn);
	epj_tensor_free(in[1]);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

START_TEST(test_residual)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	epj_dtype dt = dtypes[_i];
	int64_t T = 2 * tu_randint(1, 6) + 1, H = 2 * tu_randint(1, 8) + 1;
	int64_t sx[2] = { T, H }, sg[2] = { T, 1 };
	epj_tensor *x = tu_randn(ctx, dt, 2, sx);
	epj_tensor *a = tu_randn(ctx, dt, 2, sx);
	epj_tensor *an = tu_noncontig(ctx, a);
	epj_tensor *in[4] = { x, an, tu_randn(ctx, dt, 2, sg),
			      tu_randn(ctx, dt, 1, &H) };
	case_res t = run_case(ctx, f_residual, in, 4, true, "residual");
	ck_assert_int_eq(t.c_fwd, 1);
	ck_assert_int_eq(t.i_fwd, 10);
	ck_assert_int_lt(t.c_fwd + t.c_bwd, t.i_fwd + t.i_bwd);
	epj_tensor_free(x);
	epj_tensor_free(a);
	epj_tensor_free(an);
	epj_tensor_free(in[2]);
	epj_tensor_free(in[3]);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

/* GEMM epilogues: y = exp(r) + linear(x, w1) + x2 @ m (through a reshape)
 * -- the first residual is a fresh intermediate that dies at the GEMM (in
 * place), the second a GEMM_ADD output; backward sums dx = g w1 + ...
 * (g = g + A @ B).  f_gemm_live has residuals that must not be written:
 * a graph input r (r + linear(x, w1)) and e = exp(r), read again after
 * its add (y = (h1 + e + x2 @ m) * e). */
static epj_tensor *f_gemm(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *e = epj_exp(ctx, in[0]);
	epj_tensor *l = epj_linear(ctx, in[1], in[2], NULL);
	epj_tensor *h = epj_add(ctx, e, l);
	int64_t rows = epj_tensor_dim(in[1], 0) * epj_tensor_dim(in[1], 1);
	int64_t s2[2] = { rows, epj_tensor_dim(in[1], 2) };
	epj_tensor *x2 = epj_reshape(ctx, in[1], 2, s2);
	epj_tensor *mm = epj_matmul(ctx, x2, in[3]);
	epj_tensor *mr =
	    epj_reshape(ctx, mm, epj_tensor_ndim(h), epj_tensor_shape(h));
	epj_tensor *y = epj_add(ctx, mr, h);
	epj_tensor *t[] = { e, l, h, x2, mm, mr };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

/* y = linear(x, w1) + b: the bias joins the linear */
static epj_tensor *f_gemm_bias(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *l = epj_linear(ctx, in[1], in[2], NULL);
	epj_tensor *y = epj_add(ctx, l, in[0]);
	epj_tensor_free(l);
	return y;
}

static epj_tensor *f_gemm_live(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *l = epj_linear(ctx, in[1], in[2], NULL);
	epj_tensor *h1 = epj_add(ctx, in[0], l);
	epj_tensor *e = epj_exp(ctx, in[0]);
	int64_t rows = epj_tensor_dim(in[1], 0) * epj_tensor_dim(in[1], 1);
	int64_t s2[2] = { rows, epj_tensor_dim(in[1], 2) };
	epj_tensor *x2 = epj_reshape(ctx, in[1], 2, s2);
	epj_tensor *mm = epj_matmul(ctx, x2, in[3]);
	epj_tensor *mr =
	    epj_reshape(ctx, mm, epj_tensor_ndim(e), epj_tensor_shape(e));
	epj_tensor *h2 = epj_add(ctx, e, mr);
	epj_tensor *hs = epj_add(ctx, h1, h2);
	epj_tensor *y = epj_mul(ctx, hs, e);
	epj_tensor *t[] = { l, h1, e, x2, mm, mr, h2, hs };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	return y;
}

START_TEST(test_gemm_epilogue)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	epj_dtype dt = dtypes[_i];
	int64_t B = tu_randint(1, 3), T = 2 * tu_randint(1, 5) + 1;
	int64_t K = 2 * tu_randint(1, 8) + 1, N = 2 * tu_randint(1, 8) + 1;
	int64_t sr[3] = { B, T, N }, sx[3] = { B, T, K }, sw[2] = { N, K },
		sm[2] = { K, N };
	for (int live = 0; live < 3; live++) {
		bool bias = live == 2;
		epj_tensor *in[4] = { bias ? tu_randn(ctx, dt, 1, &N)
					   : tu_randn(ctx, dt, 3, sr),
				      tu_randn(ctx, dt, 3, sx),
				      tu_randn(ctx, dt, 2, sw),
				      tu_randn(ctx, dt, 2, sm) };
		epj_tensor *r0 = epj_detach(ctx, in[0]);
		epj_tensor *keep = epj_mul_scalar(ctx, r0, 1.0);
		cg_fn fn = bias ? f_gemm_bias : live ? f_gemm_live : f_gemm;
		int n_in = bias ? 3 : 4;
		const char *what = bias	  ? "gemm epilogue, bias"
				   : live ? "gemm epilogue, live residual"
					  : "gemm epilogue";
		/* compiled (C) against the interpreter, forward and backward */
		int64_t ip0 = epj_counter_get(ctx, "kernels.gemm_add.in_place");
		run_case(ctx, fn, in, n_in, true, what);
		int64_t ip =
		    epj_counter_get(ctx, "kernels.gemm_add.in_place") - ip0;
		/* the residual input is never written */
		tu_assert_tensors_close(ctx, in[0], keep, 0, 0,
					"residual input after the run");
		/* the graphs the C backend runs hold GEMM_ADD nodes and no
		 * add or separate product any more; the forward runs fewer
		 * steps than op by op */
		ej_jit *jc = ej_jit_new(ctx, EJ_BACKEND_C);
		ej_region_fn *f = tu_compile_region(ctx, jc, fn, in, n_in);
		epj_tensor *y = NULL;
		int64_t fp0 = epj_counter_get(ctx, "kernels.gemm_add.in_place");
		ck_assert(ej_region_run(ctx, f, in, n_in, NULL, 0, NULL, NULL,
					&y, 1) == EPJ_OK);
		int64_t ip_fwd =
		    epj_counter_get(ctx, "kernels.gemm_add.in_place") - fp0;
		ej_segment *seg = f->steps[0].seg;
		ck_assert_int_eq(count_op(seg->fwd, EJ_OP_GEMM_ADD),
				 bias ? 0 : 2);
		ck_assert_int_eq(count_op(seg->fwd, EJ_OP_ADD), live == 1);
		ck_assert_int_eq(count_op(seg->fwd, EJ_OP_LINEAR), bias);
		ck_assert_int_eq(count_op(seg->fwd, EJ_OP_MATMUL), 0);
		const ej_schedule *sc = ej_backend_c_schedule(seg->fwd_state);
		ck_assert_int_eq(sc->n_extern, bias ? 1 : 3);
		ck_assert_int_eq(sc->n_kernels, bias ? 0 : live ? 2 : 1);
		if (bias)
			ck_assert_int_eq(
			    seg->fwd->nodes[sc->steps[0].node].n_in, 3);
		if (!live)
			/* dx = g w1 + reshape(g m^T): one gemm_add */
			ck_assert_int_ge(count_op(seg->bwd, EJ_OP_GEMM_ADD), 1);
		/* f32 / f64 accumulate in place when the residual dies there:
		 * exp(r) in the forward, a gradient term in backward; never
		 * with the live residual's graph input */
		if (dt != EPJ_DTYPE_BF16 && !live)
			ck_assert_int_eq(ip_fwd, 2);
		if (dt != EPJ_DTYPE_BF16 && live != 2) /* and in backward */
			ck_assert_int_ge(ip, live ? 1 : 3);
		if (live == 1)
			ck_assert_int_eq(ip_fwd, 0);
		epj_tensor_free(y);
		ej_region_fn_free(f);
		ej_jit_free(jc);
		for (int i = 0; i < 4; i++)
			epj_tensor_free(in[i]);
		epj_tensor_free(r0);
		epj_tensor_free(keep);
	}
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

/* The schedule of RMSNorm: one row kernel whose IR has one reduction and
 * stores only the output; the debug dump writes schedule and source. */
START_TEST(test_schedule_dump)
{
	cache_setup();
	char dump[300];
	snprintf(dump, sizeof dump, "%s/dump", cache_dir);
	setenv("EPJIT_DEBUG_DUMP", dump, 1);
	epj_ctx *ctx = tu_ctx();
	int64_t sx[2] = { 5, 7 }, h = 7;
	epj_tensor *in[2] = { tu_randn(ctx, EPJ_DTYPE_F32, 2, sx),
			      tu_randn(ctx, EPJ_DTYPE_F32, 1, &h) };
	bool prev = epj_no_grad_enter(ctx);
	ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_C);
	ej_region_fn *f = tu_compile_region(ctx, jit, f_rmsnorm, in, 2);
	ej_graph *g = f->steps[0].seg->fwd;
	ej_arena *A = ej_arena_new();
	ej_schedule *s = ej_sched_build(A, g);
	ck_assert_int_eq(s->n_kernels, 1);
	const ej_kernel *k = s->kernels[0];
	ck_assert(k->reduce);
	ck_assert_int_eq(k->rows, 5);
	ck_assert_int_eq(k->cols, 7);
	ck_assert_int_eq(k->n_out, 1);
	ck_assert_int_eq(k->n_loops, 2);
	int nred = 0;
	for (int i = 0; i < k->n_v; i++)
		nred += k->v[i].op == EJ_K_RSUM;
	ck_assert_int_eq(nred, 1);
	const char *txt = ej_sched_text(A, s);
	ck_assert_ptr_nonnull(strstr(txt, "row_sum"));
	const char *c = ej_print_c(A, s, "t");
	ck_assert_ptr_nonnull(strstr(c, "void epjk_0("));
	ck_assert_ptr_nonnull(strstr(c, "ej_f2bf")); /* the prelude */
	/* the dump has the schedule and the source */
	char cmd[400];
	snprintf(cmd, sizeof cmd, "grep -q row_sum %s/kernels/*.txt", dump);
	ck_assert_int_eq(system(cmd), 0);
	snprintf(cmd, sizeof cmd, "grep -q epjk_0 %s/kernels/*.c", dump);
	ck_assert_int_eq(system(cmd), 0);
	ej_arena_free(A);
	ej_region_fn_free(f);
	ej_jit_free(jit);
	epj_no_grad_exit(ctx, prev);
	epj_tensor_free(in[0]);
	epj_tensor_free(in[1]);
	epj_ctx_free(ctx);
	unsetenv("EPJIT_DEBUG_DUMP");
	cache_teardown();
}
END_TEST

/* Regular files anywhere under dir (find -type f). */
static int files_under(const char *dir)
{
	char cmd[4200];
	snprintf(cmd, sizeof cmd, "find '%s' -type f | wc -l", dir);
	FILE *p = popen(cmd, "r");
	ck_assert_ptr_nonnull(p);
	int n = -1;
	ck_assert_int_eq(fscanf(p, "%d", &n), 1);
	pclose(p);
	return n;
}

/* The second compile of the same graph (a new jit, so no segment cache)
 * comes from the disk cache; a cold compile with a failing compiler is an
 * error that names the backend. */
START_TEST(test_cache_hit)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	int64_t sx[2] = { 3, 5 };
	epj_tensor *in[4] = { tu_randn(ctx, EPJ_DTYPE_F32, 2, sx),
			      tu_randn(ctx, EPJ_DTYPE_F32, 2, sx), NULL, NULL };
	int64_t sg[2] = { 3, 1 }, h = 5;
	in[2] = tu_randn(ctx, EPJ_DTYPE_F32, 2, sg);
	in[3] = tu_randn(ctx, EPJ_DTYPE_F32, 1, &h);
	bool prev = epj_no_grad_enter(ctx);
	ej_jit *j1 = ej_jit_new(ctx, EJ_BACKEND_C);
	ej_region_fn *f1 = tu_compile_region(ctx, j1, f_residual, in, 4);
	int64_t hits = epj_counter_get(ctx, "cache.disk_hits");
	ej_jit *j2 = ej_jit_new(ctx, EJ_BACKEND_C);
	ej_region_fn *f2 = tu_compile_region(ctx, j2, f_residual, in, 4);
	ck_assert_int_eq(epj_counter_get(ctx, "cache.disk_hits"), hits + 1);
	epj_tensor *y1 = NULL, *y2 = NULL;
	ck_assert_int_eq(
	    ej_region_run(ctx, f1, in, 4, NULL, 0, NULL, NULL, &y1, 1), EPJ_OK);
	ck_assert_int_eq(
	    ej_region_run(ctx, f2, in, 4, NULL, 0, NULL, NULL, &y2, 1), EPJ_OK);
	tu_assert_tensors_close(ctx, y1, y2, 0, 0, "cached kernel");
	/* a cold compile with a failing compiler is an error naming it */
	cache_teardown();
	cache_setup();
	setenv("EPJIT_CC", "false", 1);
	/* the source of the failed compile is kept in $TMPDIR: a private one */
	char *tmp = tu_tmpdir_new("codegen-cc");
	setenv("TMPDIR", tmp, 1);
	ej_jit *j3 = ej_jit_new(ctx, EJ_BACKEND_C);
	ej_trace *tr = NULL;
	tu_region_user u = { f_residual };
	ck_assert_int_eq(
	    ej_trace_region(ctx, j3, tu_traced, &u, in, 4, 1, NULL, NULL, &tr),
	    EPJ_OK);
	ej_region_fn *f3 = NULL;
	epj_status st = ej_jit_compile(ctx, j3, tr, &f3);
	ck_assert_int_ne(st, EPJ_OK);
	ck_assert_ptr_null(f3);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "c backend") != NULL &&
			  strstr(epj_ctx_error(ctx), tmp) != NULL,
		      "%s", epj_ctx_error(ctx));
	unsetenv("EPJIT_CC");
	unsetenv("TMPDIR");
	tu_tmpdir_free(tmp);
	/* a group-writable cache directory is refused: nothing is loaded
	 * from it or written into it, and the compile goes to a private
	 * directory of the process instead (counted), so the run goes on
	 * (a new jit: a jit opens its cache once, at its first build) */
	ck_assert_int_eq(chmod(cache_dir, 0777), 0);
	int entries = files_under(cache_dir);
	int64_t refused = epj_counter_get(ctx, "cache.refused");
	ej_jit *j4 = ej_jit_new(ctx, EJ_BACKEND_C);
	ck_assert_int_eq(
	    ej_trace_region(ctx, j4, tu_traced, &u, in, 4, 1, NULL, NULL, &tr),
	    EPJ_OK);
	ej_region_fn *f4 = NULL;
	st = ej_jit_compile(ctx, j4, tr, &f4);
	ck_assert_msg(st == EPJ_OK && f4, "%s", epj_ctx_error(ctx));
	ck_assert_int_gt(epj_counter_get(ctx, "cache.refused"), refused);
	ck_assert_int_eq(files_under(cache_dir), entries);
	ej_region_fn_free(f4);
	ck_assert_int_eq(chmod(cache_dir, 0700), 0);
	epj_tensor_free(y1);
	epj_tensor_free(y2);
	ej_region_fn_free(f1);
	ej_region_fn_free(f2);
	ej_jit_free(j1);
	ej_jit_free(j2);
	ej_jit_free(j3);
	ej_jit_free(j4);
	epj_no_grad_exit(ctx, prev);
	for (int i = 0; i < 4; i++)
		epj_tensor_free(in[i]);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

/* Sizes past the parallel threshold: OpenMP loops, pointwise column blocks
 * (a row longer than one block), row kernels with many rows. */
START_TEST(test_large)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	int64_t T = 9, H = 4099 + 2 * tu_randint(0, 8);
	int64_t sx[2] = { T, H }, sg[2] = { T, 1 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 2, sx);
	epj_tensor *in[4] = { tu_randn(ctx, EPJ_DTYPE_F32, 2, sx),
			      tu_noncontig(ctx, a),
			      tu_randn(ctx, EPJ_DTYPE_F32, 2, sg),
			      tu_randn(ctx, EPJ_DTYPE_F32, 1, &H) };
	case_res r = run_case(ctx, f_residual, in, 4, false, "large residual");
	ck_assert_int_eq(r.c_fwd, 1);
	int64_t ss[2] = { 1, H };
	epj_tensor *sm[2] = { in[0], tu_randn(ctx, EPJ_DTYPE_F32, 2, ss) };
	r = run_case(ctx, f_softmax, sm, 2, false, "large softmax");
	ck_assert_int_eq(r.c_fwd, 1);
	epj_tensor_free(sm[1]);
	epj_tensor_free(a);
	for (int i = 0; i < 4; i++)
		epj_tensor_free(in[i]);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

/* NaN, infinities, signed zeros and bf16 rounding ties through fused
 * casts, pointwise math and row reductions: bit-compatible with the
 * interpreter (NaN matches NaN). */
static epj_tensor *f_special(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *b = epj_cast(ctx, in[0], EPJ_DTYPE_BF16);
	epj_tensor *e = epj_exp(ctx, b);
	epj_tensor *l = epj_log(ctx, b);
	/* NaN as maximum's second value where b < 0 (log), first where b is */
	epj_tensor *mx = epj_maximum(ctx, b, l);
	epj_tensor *s = epj_add(ctx, e, mx);
	epj_tensor *m = epj_amax(ctx, s, -1, true);
	epj_tensor *sm = epj_softmax(ctx, s, -1);
	epj_tensor *t = epj_sub(ctx, sm, m);
	epj_tensor *y = epj_cast(ctx, t, EPJ_DTYPE_F32);
	epj_tensor *x[] = { b, e, l, mx, s, m, sm, t };
	for (size_t i = 0; i < EJ_ARRAY_LEN(x); i++)
		epj_tensor_free(x[i]);
	return y;
}

START_TEST(test_special)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	int64_t sx[2] = { 7, 9 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 2, sx);
	/* row 0: a NaN; row 1: +inf; row 2: all -inf; row 3: bf16 ties
	 * (1 + 2^-8 rounds to 1, 1 + 3 * 2^-8 rounds up); row 4: zeros */
	epj_tensor_set_f64(x, 4, NAN);
	epj_tensor_set_f64(x, 9 + 2, INFINITY);
	for (int j = 0; j < 9; j++) {
		epj_tensor_set_f64(x, 18 + j, -INFINITY);
		epj_tensor_set_f64(x, 27 + j, 1.0 + (2 * j + 1) / 256.0);
		epj_tensor_set_f64(x, 36 + j, j % 2 ? -0.0 : 0.0);
	}
	run_case(ctx, f_special, &x, 1, false, "special values");
	epj_tensor_free(x);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

/* where in generated code: t = where(c, 2x, exp(y)) with c [R, 1] broadcast
 * (zeros of both signs, NaN, non-zero), then out = where(x == amax(x),
 * t, y) + t, the second condition an element value computed from a row
 * reduction.  x holds NaN and y +Inf in rows the first condition does not
 * pick.  Everything is one row kernel; the C backend against the
 * interpreter (the op table's kernel), forward and backward, every kernel
 * alone, NVRTC. */
static epj_tensor *f_where(epj_ctx *ctx, epj_tensor *const *in)
{
	epj_tensor *x2 = epj_mul_scalar(ctx, in[0], 2.0);
	epj_tensor *ey = epj_exp(ctx, in[1]);
	epj_tensor *t = epj_where(ctx, in[2], x2, ey);
	epj_tensor *m = epj_amax(ctx, in[0], -1, true);
	epj_tensor *top = epj_eq(ctx, in[0], m);
	epj_tensor *u = epj_where(ctx, top, t, in[1]);
	epj_tensor *y = epj_add(ctx, u, t);
	epj_tensor *x[] = { x2, ey, t, m, top, u };
	for (size_t i = 0; i < EJ_ARRAY_LEN(x); i++)
		epj_tensor_free(x[i]);
	return y;
}

START_TEST(test_where)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	epj_dtype dt = dtypes[_i];
	int64_t R = 2 * tu_randint(3, 6) + 1, C = 2 * tu_randint(2, 9) + 1;
	int64_t sx[2] = { R, C }, sc[2] = { R, 1 };
	epj_tensor *x = tu_randn(ctx, dt, 2, sx);
	epj_tensor *y = tu_randn(ctx, dt, 2, sx);
	epj_tensor *c = tu_randn(ctx, dt, 2, sc);
	static const double cv[] = { 0.0, -0.0, NAN, 0.5 };
	for (int64_t r = 0; r < R; r++) {
		double v = cv[r % 4];
		epj_tensor_set_f64(c, r, v);
		if (v == 0) /* the branch not taken: NaN in x */
			epj_tensor_set_f64(x, r * C + r % C, NAN);
		else /* and +Inf in y */
			epj_tensor_set_f64(y, r * C + (r + 1) % C, INFINITY);
	}
	epj_tensor *yn = tu_noncontig(ctx, y);
	epj_tensor *in[3] = { x, yn, c };
	case_res t = run_case(ctx, f_where, in, 3, true, "where");
	ck_assert_int_eq(t.c_fwd, 1); /* one row kernel */
	ck_assert_int_eq(t.i_fwd, 7);
	ck_assert_int_lt(t.c_bwd, t.i_bwd);
	epj_tensor_free(x);
	epj_tensor_free(y);
	epj_tensor_free(yn);
	epj_tensor_free(c);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

/* The EJ_OP_FN rows of lib/ops.def: the compiler takes each from its row
 * alone (opcode, lowering, name and printing in jit/kir.c; the scalar
 * functions of the prelude).  For every row: its kernel-IR opcode carries
 * the op's name; a one-node graph of it is one generated kernel that calls
 * ej_<name>_f (f32) or ej_<name>_d (f64); and through run_case it matches
 * the interpreter (the op table's kernels), forward and, where the op is
 * differentiable, backward, with every kernel run alone and built by NVRTC
 * where this build has it.  Inputs are positive (log, sqrt, rsqrt) and
 * odd-sized. */
static const struct {
	int op, n_in;
	const char *name;
	bool grad;
} fn_rows[] = {
#define EJ_OP(ID, name, n_in, n_out, flags)
#define EJ_OP_FN(ID, name, n_in, flags)                                        \
	{ EJ_OP_##ID, n_in, name, !((flags)&EJ_OPF_NO_GRAD) },
#include "ops.def"
#undef EJ_OP_FN
#undef EJ_OP
};
static int fn_op;

static epj_tensor *f_fn_row(epj_ctx *ctx, epj_tensor *const *in)
{
	ej_attrs at = ej_attrs_none();
	return ej_call1(ctx, fn_op, in, ej_ops[fn_op].n_in, &at);
}

/* The C and CUDA C of the one-node graph of row r in dt: one kernel that
 * calls the row's scalar function. */
static void assert_fn_row_printed(int r, epj_dtype dt)
{
	int64_t shape[2] = { 3, 5 };
	ej_graph *g = ej_graph_new("fn row");
	int x[2];
	for (int i = 0; i < fn_rows[r].n_in; i++)
		x[i] = ej_graph_add_input(g, EJ_IN_ACT, i, dt, 2, shape);
	ej_meta m;
	memset(&m, 0, sizeof m);
	m.dtype = dt;
	m.ndim = 2;
	memcpy(m.shape, shape, sizeof shape);
	ej_attrs a = ej_attrs_none();
	int n =
	    ej_graph_add_node(g, fn_rows[r].op, &a, x, fn_rows[r].n_in, &m, 1);
	ej_graph_add_output(g, g->nodes[n].out[0]);
	ck_assert_int_eq(ej_kir_node_class(g, n), EJ_KC_POINTWISE);
	ej_arena *A = ej_arena_new();
	ej_schedule *s = ej_sched_build(A, g);
	ck_assert_int_eq(s->n_kernels, 1);
	ck_assert_int_eq(s->n_extern, 0);
	char call[64];
	snprintf(call, sizeof call, "ej_%s_%c(", fn_rows[r].name,
		 dt == EPJ_DTYPE_F64 ? 'd' : 'f');
	const char *srcs[2] = { ej_print_c(A, s, "fn_row"),
				ej_print_cuda(A, s, "fn_row") };
	for (int k = 0; k < 2; k++) {
		ck_assert_ptr_nonnull(srcs[k]);
		const char *kern = strstr(srcs[k], "kernel 0");
		ck_assert_msg(kern && strstr(kern, call),
			      "%s %s: the %s kernel does not call %s", "fn row",
			      fn_rows[r].name, k ? "CUDA C" : "C", call);
	}
	/* the column loop tells the compiler its iterations are independent
	 * (without it GCC does not vectorise a kernel of many accesses) */
	ck_assert_msg(strstr(srcs[0], "EJ_IVDEP for (int64_t j = j0;"),
		      "fn row %s: the C column loop has no EJ_IVDEP",
		      fn_rows[r].name);
	ej_arena_free(A);
	ej_graph_free(g);
}

START_TEST(test_fn_rows)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	ck_assert_int_ge((int)EJ_ARRAY_LEN(fn_rows), 11);
	for (size_t r = 0; r < EJ_ARRAY_LEN(fn_rows); r++) {
		fn_op = fn_rows[r].op;
		ck_assert_int_eq(ej_ops[fn_op].n_in, fn_rows[r].n_in);
		ck_assert(ej_ops[fn_op].flags & EJ_OPF_POINTWISE);
		ck_assert_str_eq(ej_ops[fn_op].name, fn_rows[r].name);
		epj_dtype dts[2] = { EPJ_DTYPE_F32, EPJ_DTYPE_F64 };
		for (int d = 0; d < 2; d++) {
			assert_fn_row_printed((int)r, dts[d]);
			int64_t sh[2] = { 7, 11 };
			epj_tensor *in[2] = { NULL, NULL };
			for (int i = 0; i < fn_rows[r].n_in; i++) {
				in[i] = tu_randn(ctx, dts[d], 2, sh);
				for (int64_t e = 0; e < 77; e++)
					epj_tensor_set_f64(
					    in[i], e,
					    fabs(epj_tensor_get_f64(in[i], e)) +
						0.05);
			}
			case_res cr =
			    run_case(ctx, f_fn_row, in, fn_rows[r].n_in,
				     fn_rows[r].grad, fn_rows[r].name);
			/* the compiled arm ran generated code: one kernel */
			ck_assert_int_eq(cr.fwd_kernels, 1);
			ck_assert_int_eq(cr.fwd_extern, 0);
			ck_assert_int_ge(cr.c_fwd, 1);
			for (int i = 0; i < fn_rows[r].n_in; i++)
				epj_tensor_free(in[i]);
		}
	}
	/* the kernel IR names the opcodes of these rows after their ops */
	static const struct {
		ej_kop k;
		const char *name;
	} names[] = { { EJ_K_EXP, "exp" },
		      { EJ_K_RSQRT, "rsqrt" },
		      { EJ_K_SILU_BACKWARD, "silu_backward" } };
	for (size_t i = 0; i < EJ_ARRAY_LEN(names); i++)
		ck_assert_str_eq(ej_kop_name(names[i].k), names[i].name);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

/* The f32 exp of generated C (lib/ops_expf.h in the C prelude) is the op
 * table's, bit for bit: every f32 row of lib/ops.def that calls it (exp,
 * silu, sigmoid, silu_backward, gelu_backward), compiled by the C backend as
 * one kernel, gives the eager op's bits on [-100, 100] (both sides of the
 * flush to 0 below -87.3 and of the overflow at 88.72, where a vector loop
 * and its scalar tail must agree) and the specials: +-0, +-inf, NaN. */
START_TEST(test_fn_rows_exp_bits)
{
	cache_setup();
	epj_ctx *ctx = tu_ctx();
	static const int ops[] = { EJ_OP_EXP, EJ_OP_SILU, EJ_OP_SIGMOID,
				   EJ_OP_SILU_BACKWARD, EJ_OP_GELU_BACKWARD };
	static const float special[] = { 0.0f,	       -0.0f,	    INFINITY,
					 -INFINITY,    NAN,	    -87.3f,
					 -87.30001f,   88.7228394f, 88.7228317f,
					 -88.7228394f, 87.3f,	    1e-30f,
					 -1e-30f,      0.5f };
	int64_t sh[2] = { 7, 37 }; /* 259: vector bodies and a tail */
	const int64_t n = sh[0] * sh[1];
	ej_jit *jc = ej_jit_new(ctx, EJ_BACKEND_C);
	for (size_t o = 0; o < EJ_ARRAY_LEN(ops); o++) {
		fn_op = ops[o];
		epj_tensor *in[2];
		for (int i = 0; i < ej_ops[fn_op].n_in; i++) {
			in[i] = epj_zeros(ctx, EPJ_DTYPE_F32, 2, sh);
			for (int64_t e = 0; e < n; e++) {
				double v = tu_uniform(-100, 100);
				/* the specials at several places in a row */
				if (e % 19 == 0)
					v = special[(e / 19 + (size_t)i) %
						    EJ_ARRAY_LEN(special)];
				epj_tensor_set_f64(in[i], e, v);
			}
		}
		run_out rc;
		ej_region_fn *f = run_backend(ctx, jc, f_fn_row, in,
					      ej_ops[fn_op].n_in, NULL, &rc);
		ck_assert_int_eq(rc.launches_fwd, 1);
		epj_tensor *y = f_fn_row(ctx, in);
		tu_ok(ctx, y);
		for (int64_t e = 0; e < n; e++) {
			float a = (float)epj_tensor_get_f64(rc.y, e);
			float b = (float)epj_tensor_get_f64(y, e);
			ck_assert_msg(
			    (isnan(a) && isnan(b)) ||
				memcmp(&a, &b, sizeof a) == 0,
			    "%s element %lld (x %.9g): %.9g compiled, "
			    "%.9g eager",
			    ej_ops[fn_op].name, (long long)e,
			    epj_tensor_get_f64(in[0], e), a, b);
		}
		epj_tensor_free(y);
		run_out_free(&rc);
		ej_region_fn_free(f);
		for (int i = 0; i < ej_ops[fn_op].n_in; i++)
			epj_tensor_free(in[i]);
	}
	ej_jit_free(jc);
	epj_ctx_free(ctx);
	cache_teardown();
}
END_TEST

/* The CUDA C of a one-node graph, op applied to one f32 input of shape
 * [rows, cols], as ej_print_cuda prints it; malloc'ed. */
static char *one_op_cuda(int op, int64_t rows, int64_t cols)
{
	int64_t shape[2] = { rows, cols };
	ej_graph *g = ej_graph_new("index width");
	int x = ej_graph_add_input(g, EJ_IN_ACT, 0, EPJ_DTYPE_F32, 2, shape);
	ej_meta m;
	memset(&m, 0, sizeof m);
	m.dtype = EPJ_DTYPE_F32;
	m.ndim = 2;
	memcpy(m.shape, shape, sizeof shape);
	ej_attrs a = { 0 };
	if (op == EJ_OP_SOFTMAX) {
		a.i[0] = 1; /* the last dim: a row kernel */
		a.n_i = 1;
	}
	int n = ej_graph_add_node(g, op, &a, &x, 1, &m, 1);
	ej_graph_add_output(g, g->nodes[n].out[0]);
	ej_arena *A = ej_arena_new();
	ej_schedule *s = ej_sched_build(A, g);
	ck_assert_int_eq(s->n_kernels, 1);
	ck_assert_int_eq(s->kernels[0]->numel, rows * cols);
	char *src = strdup(ej_print_cuda(A, s, "index_width"));
	ck_assert_ptr_nonnull(src);
	ej_arena_free(A);
	ej_graph_free(g);
	return src;
}

/* op over [rows, cols] prints 64-bit (wide) or 32-bit index math, in its
 * comment and in its grid-stride loop. */
static void assert_index_width(int op, int64_t rows, int64_t cols, bool wide)
{
	char *src = one_op_cuda(op, rows, cols);
	const char *ty = wide ? "long long" : "int";
	char want[96];
	if (op == EJ_OP_SOFTMAX)
		snprintf(want, sizeof want, "for (%s row = blockIdx.x;", ty);
	else
		snprintf(want, sizeof want, "for (%s u = (%s)blockIdx.x", ty,
			 ty);
	/* the kernel after the prelude, short enough for Check's message */
	const char *kern = strstr(src, "\n/* kernel 0:");
	ck_assert_msg(strstr(src, wide ? "64-bit indices" : "32-bit indices") &&
			  strstr(src, want),
		      "%s over [%lld, %lld]: expected %s index math "
		      "(\"%s\"):%.700s",
		      op == EJ_OP_SOFTMAX ? "softmax" : "neg", (long long)rows,
		      (long long)cols, wide ? "64-bit" : "32-bit", want,
		      kern ? kern : src);
	free(src);
}

/* 32-bit index math only where no grid-stride loop index can pass
 * INT32_MAX: a loop index reaches its bound minus one plus a whole grid
 * stride (up to 65535 blocks of 256 threads) before the test ends the loop.
 * So 2^31 - 2 elements need 64-bit indices: a pointwise kernel of rows of 3
 * (scalar: one unit per element, u < 2^31 - 2) and a row kernel of
 * 2^31 - 2 rows of 1 (row < 2^31 - 2) would step an int past INT32_MAX,
 * wrap negative and run on out of bounds.  numel + the widest stride = 2^31
 * is the largest 32-bit space.  Prints only: nothing is allocated. */
START_TEST(test_index_width)
{
	const int64_t stride = 65535LL * 256, edge = (1LL << 31) - stride;
	assert_index_width(EJ_OP_NEG, (INT32_MAX - 1) / 3, 3, true);
	assert_index_width(EJ_OP_SOFTMAX, INT32_MAX - 1, 1, true);
	assert_index_width(EJ_OP_NEG, edge + 1, 1, true);
	assert_index_width(EJ_OP_NEG, edge, 1, false);
	assert_index_width(EJ_OP_SOFTMAX, edge, 1, false);
	assert_index_width(EJ_OP_NEG, 5, 7, false);
	assert_index_width(EJ_OP_NEG, (int64_t)INT32_MAX + 5, 1, true);
}
END_TEST

/* The vector path of a pointwise kernel tests every elementwise input and
 * every output for alignment, however many there are: a sum of 48 inputs
 * (each test is about 70 characters: over 3 KiB of condition, more than a
 * fixed buffer held before) prints one ej_aligned test per input and one
 * for the output, on one line. */
START_TEST(test_align_guard_every_input)
{
	enum { NIN = 48 };
	int64_t shape[2] = { 3, 64 };
	ej_graph *g = ej_graph_new("align guard");
	ej_meta m;
	memset(&m, 0, sizeof m);
	m.dtype = EPJ_DTYPE_F32;
	m.ndim = 2;
	memcpy(m.shape, shape, sizeof shape);
	int acc = ej_graph_add_input(g, EJ_IN_ACT, 0, EPJ_DTYPE_F32, 2, shape);
	for (int i = 1; i < NIN; i++) {
		int x = ej_graph_add_input(g, EJ_IN_ACT, i, EPJ_DTYPE_F32, 2,
					   shape);
		int ab[2] = { acc, x };
		ej_attrs a = { 0 };
		int n = ej_graph_add_node(g, EJ_OP_ADD, &a, ab, 2, &m, 1);
		acc = g->nodes[n].out[0];
	}
	ej_graph_add_output(g, acc);
	ej_arena *A = ej_arena_new();
	ej_schedule *s = ej_sched_build(A, g);
	ck_assert_int_eq(s->n_kernels, 1);
	ck_assert_int_eq(s->kernels[0]->n_in, NIN);
	const char *src = ej_print_cuda(A, s, "align_guard");
	const char *line = strstr(src, "if (j0 + ");
	ck_assert_msg(line, "no vector path in:%.600s", src);
	const char *eol = strchr(line, '\n');
	ck_assert_ptr_nonnull(eol);
	char want[96];
	for (int i = 0; i < NIN; i++) {
		snprintf(want, sizeof want, "ej_aligned(in%d + b", i);
		const char *at = strstr(line, want);
		ck_assert_msg(at && at < eol,
			      "input %d has no alignment test on the vector "
			      "path's line (%zu characters)",
			      i, (size_t)(eol - line));
	}
	snprintf(want, sizeof want, "ej_aligned(out%d + ob + j0", NIN);
	const char *at = strstr(line, want);
	ck_assert_msg(at && at < eol, "the output has no alignment test");
	ck_assert_msg(eol[-1] == '{', "the condition line is cut: ...%.40s",
		      eol - 40);
	ej_arena_free(A);
	ej_graph_free(g);
}
END_TEST

Suite *make_codegen_suite(void)
{
	Suite *s = suite_create("codegen");
	TCase *tc = tcase_create("codegen");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_align_guard_every_input);
	tcase_add_loop_test(tc, test_rmsnorm, 0, 3);
	tcase_add_loop_test(tc, test_rope, 0, 3);
	tcase_add_loop_test(tc, test_rope_unit, 0, 3);
	tcase_add_test(tc, test_gemm_add_bf16);
	tcase_add_loop_test(tc, test_rowsum_lanes, 0, 3);
	tcase_add_loop_test(tc, test_swiglu, 0, 3);
	tcase_add_loop_test(tc, test_softmax, 0, 3);
	tcase_add_loop_test(tc, test_residual, 0, 3);
	tcase_add_loop_test(tc, test_where, 0, 3);
	tcase_add_loop_test(tc, test_gemm_epilogue, 0, 3);
	tcase_add_test(tc, test_schedule_dump);
	tcase_add_test(tc, test_cache_hit);
	tcase_add_test(tc, test_large);
	tcase_add_test(tc, test_special);
	tcase_add_test(tc, test_fn_rows);
	tcase_add_test(tc, test_fn_rows_exp_bits);
	tcase_add_test(tc, test_index_width);
	suite_add_tcase(s, tc);
	return s;
}
