/* check_jit.c -- the region compiler on small traced functions: tracing with
 * graph breaks, joint forward/backward graphs, passes, signatures, guards,
 * and compiled-vs-eager values and gradients (interpreter backend). */
#include "check_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cc.h"
#include "jit_impl.h"

/* A "block" on x [B,T,H] with weights w1 [H,H], w2 [H,H], g [H]:
 *   a = rmsnorm-ish(x) ; h = x + linear(silu(linear(a, w1)), w2)
 *   m = brk(h)            (eager callee: tanh(h) * 0.5, counted)
 *   y = h + m * g
 * brk stands for the AutoEP layer.  Every op appears twice or more so CSE
 * and DCE have work. */
typedef struct blk {
	epj_tensor *w1, *w2, *g;
	int breaks;
	bool trace_breaks; /* true while tracing: record, not run */
} blk;

static epj_tensor *brk_eager(epj_ctx *ctx, epj_tensor *h)
{
	epj_tensor *t = epj_tanh(ctx, h);
	epj_tensor *r = epj_mul_scalar(ctx, t, 0.5);
	epj_tensor_free(t);
	return r;
}

static epj_status blk_forward(void *user, epj_ctx *ctx, epj_tensor *const *in,
			      int n_in, epj_tensor **out, int n_out)
{
	blk *b = user;
	epj_tensor *x = in[0];
	epj_tensor *sq = epj_mul(ctx, x, x);
	epj_tensor *ms = epj_mean(ctx, sq, -1, true);
	epj_tensor *ms2 = epj_mean(ctx, sq, -1, true); /* CSE food */
	epj_tensor *ms3 = epj_add(ctx, ms, ms2);
	epj_tensor *e = epj_add_scalar(ctx, ms3, 1e-5);
	epj_tensor *r = epj_rsqrt(ctx, e);
	epj_tensor *a = epj_mul(ctx, x, r);
	epj_tensor *dead = epj_exp(ctx, a); /* DCE food */
	epj_tensor *l1 = epj_linear(ctx, a, b->w1, NULL);
	epj_tensor *s = epj_silu(ctx, l1);
	epj_tensor *l2 = epj_linear(ctx, s, b->w2, NULL);
	epj_tensor *h = epj_add(ctx, x, l2);
	epj_tensor *m = NULL;
	if (h && b->trace_breaks) {
		epj_status st = ej_trace_break(ctx, b, "test", &h, 1, &m, 1);
		if (st != EPJ_OK)
			m = NULL;
	} else if (h) {
		m = brk_eager(ctx, h);
		b->breaks++;
	}
	epj_tensor *mg = epj_mul(ctx, m, b->g);
	out[0] = epj_add(ctx, h, mg);
	epj_tensor *tmp[] = { sq,   ms, ms2, ms3, e, r, a,
			      dead, l1, s,   l2,  h, m, mg };
	for (size_t i = 0; i < sizeof tmp / sizeof tmp[0]; i++)
		epj_tensor_free(tmp[i]);
	(void)n_in;
	(void)n_out;
	return out[0] ? EPJ_OK : ctx->status;
}

static int slot_of(void *user, const epj_tensor *t)
{
	blk *b = user;
	if (t == b->w1)
		return 0;
	if (t == b->w2)
		return 1;
	if (t == b->g)
		return 2;
	return -1;
}

static epj_status brk_call(void *user, epj_ctx *ctx, void *callee,
			   epj_tensor *const *in, int n_in, epj_tensor **out,
			   int n_out)
{
	blk *b = callee;
	(void)user;
	(void)n_in;
	(void)n_out;
	b->breaks++;
	out[0] = brk_eager(ctx, in[0]);
	return out[0] ? EPJ_OK : ctx->status;
}

static void blk_init(epj_ctx *ctx, blk *b, int64_t H, epj_dtype dt)
{
	int64_t sw[2] = { H, H };
	memset(b, 0, sizeof *b);
	b->w1 = epj_randn(ctx, dt, 2, sw, 0.0, 0.5);
	b->w2 = epj_randn(ctx, dt, 2, sw, 0.0, 0.5);
	b->g = epj_randn(ctx, dt, 1, &H, 1.0, 0.3);
	epj_tensor_set_requires_grad(b->w1, true);
	epj_tensor_set_requires_grad(b->w2, true);
	epj_tensor_set_requires_grad(b->g, true);
}

static void blk_free(blk *b)
{
	epj_tensor_free(b->w1);
	epj_tensor_free(b->w2);
	epj_tensor_free(b->g);
}

static ej_region_fn *compile_blk(epj_ctx *ctx, ej_jit *jit, blk *b,
				 epj_tensor *x)
{
	ej_trace *tr = NULL;
	b->trace_breaks = true;
	epj_status st = ej_trace_region(ctx, jit, blk_forward, b, &x, 1, 1,
					slot_of, b, &tr);
	b->trace_breaks = false;
	ck_assert_msg(st == EPJ_OK, "trace: %s", epj_ctx_error(ctx));
	ej_region_fn *f = NULL;
	st = ej_jit_compile(ctx, jit, tr, &f);
	ck_assert_msg(st == EPJ_OK, "compile: %s", epj_ctx_error(ctx));
	return f;
}

/* eager vs compiled: output, input grad, weight grads */
static void parity(epj_dtype dt, double tol)
{
	epj_ctx *ctx = tu_ctx();
	int64_t B = tu_randint(1, 4), T = tu_randint(2, 7),
		H = tu_randint(3, 9);
	int64_t sx[3] = { B, T, H };
	blk b;
	blk_init(ctx, &b, H, dt);
	epj_tensor *x = epj_randn(ctx, dt, 3, sx, 0.0, 1.0);
	epj_tensor_set_requires_grad(x, true);
	ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_INTERPRETER);
	ej_region_fn *f = compile_blk(ctx, jit, &b, x);

	/* eager */
	epj_tensor *ye = NULL;
	ck_assert_int_eq(blk_forward(&b, ctx, &x, 1, &ye, 1), EPJ_OK);
	epj_tensor *le = epj_sum_all(ctx, ye);
	ck_assert_int_eq(epj_backward(ctx, le, NULL), EPJ_OK);
	epj_tensor *g_e[4] = { epj_detach(ctx, epj_tensor_grad(x)),
			       epj_detach(ctx, epj_tensor_grad(b.w1)),
			       epj_detach(ctx, epj_tensor_grad(b.w2)),
			       epj_detach(ctx, epj_tensor_grad(b.g)) };
	epj_tensor *ps[4] = { x, b.w1, b.w2, b.g };
	for (int i = 0; i < 4; i++)
		epj_tensor_zero_grad(ps[i]);

	/* compiled */
	int breaks0 = b.breaks;
	epj_tensor *params[3] = { b.w1, b.w2, b.g };
	ck_assert(ej_region_fn_guard_ok(f, ctx, &x, 1, params, 3));
	int64_t l0 = epj_counter_get(ctx, "kernels.launched.compiled");
	epj_tensor *yc = NULL;
	epj_status st =
	    ej_region_run(ctx, f, &x, 1, params, 3, brk_call, NULL, &yc, 1);
	ck_assert_msg(st == EPJ_OK, "run: %s", epj_ctx_error(ctx));
	ck_assert_int_eq(b.breaks, breaks0 + 1);
	ck_assert(epj_counter_get(ctx, "kernels.launched.compiled") > l0);
	epj_tensor *lc = epj_sum_all(ctx, yc);
	ck_assert_int_eq(epj_backward(ctx, lc, NULL), EPJ_OK);
	tu_assert_tensors_close(ctx, yc, ye, tol, tol, "compiled output");
	const char *what[4] = { "grad x", "grad w1", "grad w2", "grad g" };
	for (int i = 0; i < 4; i++) {
		ck_assert_ptr_nonnull(epj_tensor_grad(ps[i]));
		tu_assert_tensors_close(ctx, epj_tensor_grad(ps[i]), g_e[i],
					tol, tol, what[i]);
		epj_tensor_free(g_e[i]);
	}
	epj_tensor_free(le);
	epj_tensor_free(lc);
	epj_tensor_free(ye);
	epj_tensor_free(yc);
	ej_region_fn_free(f);
	ej_jit_free(jit);
	epj_tensor_free(x);
	blk_free(&b);
	epj_ctx_free(ctx);
}

START_TEST(test_parity_f64)
{
	parity(EPJ_DTYPE_F64, 1e-12);
}
END_TEST

START_TEST(test_parity_f32)
{
	parity(EPJ_DTYPE_F32, 1e-5);
}
END_TEST

START_TEST(test_parity_bf16)
{
	parity(EPJ_DTYPE_BF16, 2e-2);
}
END_TEST

/* The compiled gradients match finite differences too (not only eager). */
typedef struct fd_user {
	blk *b;
	ej_region_fn *f;
} fd_user;

static epj_tensor *fd_fn(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	fd_user *u = user;
	epj_tensor *params[3] = { in[1], in[2], in[3] };
	epj_tensor *y = NULL;
	ck_assert_int_eq(
	    ej_region_run(ctx, u->f, in, 1, params, 3, brk_call, NULL, &y, 1),
	    EPJ_OK);
	return y;
}

START_TEST(test_gradcheck_compiled)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sx[3] = { 2, 3, 5 };
	blk b;
	blk_init(ctx, &b, 5, EPJ_DTYPE_F64);
	epj_tensor *x = epj_randn(ctx, EPJ_DTYPE_F64, 3, sx, 0.0, 1.0);
	epj_tensor_set_requires_grad(x, true);
	ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_INTERPRETER);
	ej_region_fn *f = compile_blk(ctx, jit, &b, x);
	/* the numeric evaluations run the same variant under no-grad: a run
	 * without grad mode just skips the autograd node */
	fd_user u = { &b, f };
	epj_tensor *in[4] = { x, b.w1, b.w2, b.g };
	tu_gradcheck(ctx, fd_fn, in, 4, &u, 1e-6, 1e-5, 1e-7, "compiled blk");
	ej_region_fn_free(f);
	ej_jit_free(jit);
	epj_tensor_free(x);
	blk_free(&b);
	epj_ctx_free(ctx);
}
END_TEST

/* Identical blocks (other parameters, same shapes) share one signature:
 * compiling the second is a cache hit, so the number of unique graphs does
 * not grow with the number of blocks. */
START_TEST(test_signature_sharing)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sx[3] = { 2, 4, 6 };
	ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_INTERPRETER);
	blk b[3];
	ej_region_fn *f[3];
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sx);
	int64_t u0 = epj_counter_get(ctx, "stats.unique_graphs");
	for (int i = 0; i < 3; i++) {
		blk_init(ctx, &b[i], 6, EPJ_DTYPE_F32);
		f[i] = compile_blk(ctx, jit, &b[i], x);
	}
	/* two segments (before and after the break), compiled once */
	ck_assert_int_eq(epj_counter_get(ctx, "stats.unique_graphs") - u0, 2);
	ck_assert_int_eq(epj_counter_get(ctx, "stats.graph_cache_hits"), 4);
	ck_assert_int_eq(epj_counter_get(ctx, "graph_break.test"), 3);
	ck_assert_ptr_eq(f[0]->steps[0].seg, f[2]->steps[0].seg);
	/* a different shape is a different graph */
	int64_t sy[3] = { 2, 5, 6 };
	epj_tensor *y = tu_randn(ctx, EPJ_DTYPE_F32, 3, sy);
	ej_region_fn *g = compile_blk(ctx, jit, &b[0], y);
	ck_assert_int_eq(epj_counter_get(ctx, "stats.unique_graphs") - u0, 4);
	ck_assert(
	    strcmp(f[0]->steps[0].seg->sig_hex, g->steps[0].seg->sig_hex) != 0);
	/* guards: f[0] refuses y's shape, g accepts it */
	epj_tensor *p0[3] = { b[0].w1, b[0].w2, b[0].g };
	ck_assert(!ej_region_fn_guard_ok(f[0], ctx, &y, 1, p0, 3));
	ck_assert(ej_region_fn_guard_ok(g, ctx, &y, 1, p0, 3));
	char why[256];
	ej_region_fn_guard_explain(f[0], ctx, &y, 1, p0, 3, why, sizeof why);
	ck_assert_msg(strstr(why, "input 0") != NULL, "%s", why);
	/* grad mode is guarded */
	bool prev = epj_no_grad_enter(ctx);
	ck_assert(!ej_region_fn_guard_ok(f[0], ctx, &x, 1, p0, 3));
	epj_no_grad_exit(ctx, prev);
	ej_region_fn_free(g);
	for (int i = 0; i < 3; i++) {
		ej_region_fn_free(f[i]);
		blk_free(&b[i]);
	}
	ej_jit_free(jit);
	epj_tensor_free(x);
	epj_tensor_free(y);
	epj_ctx_free(ctx);
}
END_TEST

/* DCE removes the unused exp, CSE merges the duplicated mean. */
START_TEST(test_passes)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sx[3] = { 1, 3, 4 };
	ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_INTERPRETER);
	blk b;
	blk_init(ctx, &b, 4, EPJ_DTYPE_F32);
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sx);
	ej_region_fn *f = compile_blk(ctx, jit, &b, x);
	ck_assert_int_eq(f->n_steps, 3);
	ck_assert(!f->steps[0].is_break && f->steps[1].is_break &&
		  !f->steps[2].is_break);
	const char *txt = ej_graph_text(f->steps[0].seg->fwd);
	ck_assert_msg(strstr(txt, "exp(") == NULL, "DCE kept exp:\n%s", txt);
	const char *p = strstr(txt, "mean(");
	ck_assert_ptr_nonnull(p);
	ck_assert_msg(strstr(p + 1, "mean(") == NULL, "CSE kept 2 means:\n%s",
		      txt);
	/* x is an input of the second segment too (residual) */
	ck_assert_ptr_nonnull(f->steps[0].seg->bwd);
	/* parameter identity never enters the text: slots do */
	ck_assert_ptr_nonnull(strstr(txt, "param 0"));
	ej_region_fn_free(f);
	ej_jit_free(jit);
	epj_tensor_free(x);
	blk_free(&b);
	epj_ctx_free(ctx);
}
END_TEST

/* A trace error leaves nothing behind and names the failing op. */
static epj_status bad_forward(void *user, epj_ctx *ctx, epj_tensor *const *in,
			      int n_in, epj_tensor **out, int n_out)
{
	int64_t s[1] = { 3 };
	epj_tensor *w = epj_zeros(ctx, EPJ_DTYPE_F32, 1, s);
	out[0] = epj_add(ctx, in[0], w); /* [2,5] + [3]: not broadcastable */
	epj_tensor_free(w);
	(void)user;
	(void)n_in;
	(void)n_out;
	return out[0] ? EPJ_OK : ctx->status;
}

START_TEST(test_trace_error)
{
	epj_ctx *ctx = tu_ctx();
	int64_t s[2] = { 2, 5 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 2, s);
	ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_INTERPRETER);
	ej_trace *tr = NULL;
	epj_status st = ej_trace_region(ctx, jit, bad_forward, NULL, &x, 1, 1,
					NULL, NULL, &tr);
	ck_assert_int_eq(st, EPJ_ERR_SHAPE);
	ck_assert_ptr_null(tr);
	ck_assert(!ej_tracing(ctx));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "while tracing"));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "add"));
	ej_jit_free(jit);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_backend_parse)
{
	ej_backend_kind k;
	char msg[256];
	/* the default is the cpu device's code generator: generated C */
	ck_assert_int_eq(ej_backend_parse("", &k, msg, sizeof msg), EPJ_OK);
	ck_assert_int_eq(k, EJ_BACKEND_C);
	ck_assert_int_eq(ej_backend_parse("c", &k, msg, sizeof msg), EPJ_OK);
	ck_assert_int_eq(k, EJ_BACKEND_C);
	ck_assert_int_eq(ej_backend_parse("interpreter", &k, msg, sizeof msg),
			 EPJ_OK);
	/* nvrtc: available where the build has NVRTC (the GPU is checked by
	 * epj_engine_compile, not here) */
	int major = 0, minor = 0;
	if (ej_nvrtc_version(&major, &minor)) {
		ck_assert_int_eq(ej_backend_parse("nvrtc", &k, msg, sizeof msg),
				 EPJ_OK);
		ck_assert_int_eq(k, EJ_BACKEND_NVRTC);
	} else {
		ck_assert_int_eq(ej_backend_parse("nvrtc", &k, msg, sizeof msg),
				 EPJ_ERR_UNSUPPORTED);
		ck_assert_ptr_nonnull(strstr(msg, "nvrtc"));
	}
	ck_assert_int_eq(ej_backend_parse("inductor", &k, msg, sizeof msg),
			 EPJ_ERR_CONFIG);
	ck_assert_ptr_nonnull(strstr(msg, "inductor"));
}
END_TEST

/* The backend table: one entry per kind, found by its name; what each
 * entry says it does (the interpreter builds nothing; every backend that
 * builds runs, frees and counts kernels; the C and nvrtc backends have
 * warm-up artifacts, nvrtc per arch and on the cuda device; only C fuses
 * RoPE); the messages list the table's names; the default follows the
 * device's descriptor. */
START_TEST(test_backend_table)
{
	static const struct {
		ej_backend_kind k;
		const char *name;
		bool builds, warm, per_arch, rope;
		const char *device;
	} want[] = {
		{ EJ_BACKEND_INTERPRETER, "interpreter", false, false, false,
		  false, NULL },
		{ EJ_BACKEND_C, "c", true, true, false, true, NULL },
		{ EJ_BACKEND_NVRTC, "nvrtc", true, true, true, false, "cuda" },
		{ EJ_BACKEND_CUDA_SIM, "cuda-sim", true, false, false, false,
		  NULL },
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(want); i++) {
		const ej_codegen_backend *b = ej_backend_get(want[i].k);
		ck_assert_int_eq(b->kind, want[i].k);
		ck_assert_str_eq(b->name, want[i].name);
		ck_assert_str_eq(ej_backend_name(want[i].k), want[i].name);
		ck_assert_ptr_nonnull(b->run);
		ck_assert_ptr_nonnull(b->available);
		ck_assert_int_eq(b->build != NULL, want[i].builds);
		ck_assert_int_eq(b->free_state != NULL, want[i].builds);
		ck_assert_int_eq(b->kernels != NULL, want[i].builds);
		ck_assert_int_eq(b->artifact != NULL, want[i].warm);
		ck_assert_int_eq(b->compile != NULL, want[i].warm);
		ck_assert_int_eq(b->per_arch, want[i].per_arch);
		ck_assert_int_eq(b->rope_fusion, want[i].rope);
		if (want[i].device)
			ck_assert_str_eq(ej_backend_device(want[i].k),
					 want[i].device);
		else
			ck_assert_ptr_null(ej_backend_device(want[i].k));
		ej_backend_kind k = EJ_BACKEND_INTERPRETER;
		char msg[256];
		if (b->available()) {
			ck_assert_int_eq(
			    ej_backend_parse(want[i].name, &k, msg, sizeof msg),
			    EPJ_OK);
			ck_assert_int_eq(k, want[i].k);
		}
	}
	ej_backend_kind k;
	char msg[256];
	ck_assert_int_eq(ej_backend_parse("nope", &k, msg, sizeof msg),
			 EPJ_ERR_CONFIG);
	ck_assert_str_eq(msg, "unknown compile.backend \"nope\" (known: "
			      "interpreter, c, nvrtc, cuda-sim)");
	/* the default follows EPJIT_DEVICE's descriptor */
	const char *old = getenv("EPJIT_DEVICE");
	char *saved = old ? strdup(old) : NULL;
	setenv("EPJIT_DEVICE", "cuda-sim", 1);
	ck_assert_int_eq(ej_backend_parse("", &k, msg, sizeof msg), EPJ_OK);
	ck_assert_int_eq(k, EJ_BACKEND_CUDA_SIM);
	setenv("EPJIT_DEVICE", "cpu", 1);
	ck_assert_int_eq(ej_backend_parse("", &k, msg, sizeof msg), EPJ_OK);
	ck_assert_int_eq(k, EJ_BACKEND_C);
	setenv("EPJIT_DEVICE", "cuda", 1);
	ck_assert_int_eq(ej_backend_parse("", &k, msg, sizeof msg), EPJ_OK);
	ck_assert_int_eq(k, ej_backend_get(EJ_BACKEND_NVRTC)->available()
				? EJ_BACKEND_NVRTC
				: EJ_BACKEND_C);
	setenv("EPJIT_DEVICE", "tpu", 1);
	ck_assert_int_eq(ej_backend_parse("", &k, msg, sizeof msg),
			 EPJ_ERR_CONFIG);
	ck_assert_str_eq(msg, "EPJIT_DEVICE=\"tpu\" is not a device (known: "
			      "cpu, cuda-sim, cuda)");
	if (saved)
		setenv("EPJIT_DEVICE", saved, 1);
	else
		unsetenv("EPJIT_DEVICE");
	free(saved);
}
END_TEST

/* An f64 node of g with one output of the given shape. */
static int rp_node(ej_graph *g, int op, const int *in, int n_in,
		   const ej_attrs *a, int ndim, const int64_t *shape)
{
	ej_meta m;
	memset(&m, 0, sizeof m);
	m.dtype = EPJ_DTYPE_F64;
	m.ndim = ndim;
	memcpy(m.shape, shape, sizeof(int64_t) * (size_t)ndim);
	ej_attrs none = { 0 };
	int k = ej_graph_add_node(g, op, a ? a : &none, in, n_in, &m, 1);
	return g->nodes[k].out[0];
}

/* g's segment: gradients propagated, joint graph built and partitioned. */
static ej_segment *rp_segment(epj_ctx *ctx, ej_graph *g)
{
	ej_graph_propagate_grad(g);
	ej_segment *seg = calloc(1, sizeof *seg);
	ck_assert_ptr_nonnull(seg);
	seg->refcount = 1;
	ck_assert_int_eq(ej_autodiff_segment(ctx, g, seg), EPJ_OK);
	return seg;
}

/* Runs seg's forward on fin (one tensor per forward input) into fout, then
 * its backward into bout with dy the gradient of the (single) output; each
 * SAVED input is bound to the forward output or input it comes from. */
static void rp_run(epj_ctx *ctx, const ej_segment *seg, epj_tensor **fin,
		   epj_tensor *dy, epj_tensor **fout, epj_tensor **bout)
{
	epj_tensor *bin[8] = { 0 };
	ck_assert(seg->fwd->n_outputs <= 8);
	ck_assert(seg->bwd->n_inputs <= 8 && seg->bwd->n_outputs <= 8);
	ck_assert_int_eq(ej_interp_run(ctx, seg->fwd, fin, fout), EPJ_OK);
	for (int i = 0; i < seg->bwd->n_inputs; i++) {
		const ej_graph_input *gi = &seg->bwd->inputs[i];
		if (gi->kind == EJ_IN_GRAD) {
			bin[i] = dy;
			continue;
		}
		int src = seg->saved_src[gi->slot];
		bin[i] = src >= 0 ? fout[src] : fin[-(src + 1)];
	}
	ck_assert_int_eq(ej_interp_run(ctx, seg->bwd, bin, bout), EPJ_OK);
}

/* Partition with recomputation: in an RMSNorm y = x * rsqrt(mean(x*x) + eps)
 * * g the normalised product x * r (full size) is recomputed in the
 * backward from x (a forward input, kept by reference) and the small r,
 * so no saved node value is as large as x; the gradients, run through
 * the interpreter, match a double-precision reference. */
START_TEST(test_partition_recompute)
{
	epj_ctx *ctx = tu_ctx();
	int64_t R = 3, D = 2 * tu_randint(2, 5) + 1;
	int64_t sx[2] = { R, D }, sr[2] = { R, 1 }, sg[1] = { D };
	const double eps = 1e-5;
	ej_graph *g = ej_graph_new("rmsnorm");
	int x = ej_graph_add_input(g, EJ_IN_ACT, 0, EPJ_DTYPE_F64, 2, sx);
	int w = ej_graph_add_input(g, EJ_IN_PARAM, 0, EPJ_DTYPE_F64, 1, sg);
	g->values[x].requires_grad = g->values[w].requires_grad = true;
	ej_attrs am = { .i = { 1, 1 }, .n_i = 2 };
	ej_attrs ae = { .f = { eps }, .n_f = 1 };
	int xx[2] = { x, x };
	int sq = rp_node(g, EJ_OP_MUL, xx, 2, NULL, 2, sx);
	int ms = rp_node(g, EJ_OP_MEAN, &sq, 1, &am, 2, sr);
	int e = rp_node(g, EJ_OP_ADD_SCALAR, &ms, 1, &ae, 2, sr);
	int r = rp_node(g, EJ_OP_RSQRT, &e, 1, NULL, 2, sr);
	int xr[2] = { x, r };
	int a = rp_node(g, EJ_OP_MUL, xr, 2, NULL, 2, sx);
	int ag[2] = { a, w };
	int y = rp_node(g, EJ_OP_MUL, ag, 2, NULL, 2, sx);
	ej_graph_add_output(g, y);
	ej_segment *seg = rp_segment(ctx, g);
	int n_node_saved = 0;
	for (int q = 0; q < seg->n_saved; q++) {
		if (seg->saved_src[q] < 0)
			continue;
		const ej_value *v =
		    &seg->fwd->values[seg->fwd->outputs[seg->saved_src[q]]];
		ck_assert_msg(ej_numel(v->ndim, v->shape) < R * D,
			      "saved a full-size value:\n%s\n%s",
			      ej_graph_text(seg->fwd), ej_graph_text(seg->bwd));
		n_node_saved++;
	}
	ck_assert_int_eq(n_node_saved, 1); /* r */
	/* run forward and backward */
	epj_tensor *tx = tu_randn(ctx, EPJ_DTYPE_F64, 2, sx);
	epj_tensor *tg = tu_randn(ctx, EPJ_DTYPE_F64, 1, sg);
	epj_tensor *tdy = tu_randn(ctx, EPJ_DTYPE_F64, 2, sx);
	epj_tensor *fin[2], *fout[8] = { 0 }, *bout[8] = { 0 };
	ck_assert(seg->fwd->n_inputs == 2);
	for (int i = 0; i < 2; i++)
		fin[i] = seg->fwd->inputs[i].kind == EJ_IN_ACT ? tx : tg;
	rp_run(ctx, seg, fin, tdy, fout, bout);
	double *vx = tu_values(ctx, tx), *vg = tu_values(ctx, tg),
	       *vdy = tu_values(ctx, tdy);
	double *rdx = calloc((size_t)(R * D), sizeof(double));
	double *rdg = calloc((size_t)D, sizeof(double));
	double *ry = calloc((size_t)(R * D), sizeof(double));
	for (int64_t i = 0; i < R; i++) {
		const double *xi = vx + i * D, *dyi = vdy + i * D;
		double s = 0, t = 0;
		for (int64_t k = 0; k < D; k++)
			s += xi[k] * xi[k];
		double rr = 1.0 / sqrt(s / (double)D + eps);
		for (int64_t k = 0; k < D; k++)
			t += dyi[k] * vg[k] * xi[k];
		for (int64_t k = 0; k < D; k++) {
			ry[i * D + k] = xi[k] * rr * vg[k];
			rdx[i * D + k] = rr * vg[k] * dyi[k] -
					 xi[k] * rr * rr * rr * t / (double)D;
			rdg[k] += dyi[k] * xi[k] * rr;
		}
	}
	tu_assert_close(ctx, fout[0], ry, 1e-10, 1e-12, "recompute y");
	int ox = seg->fwd->inputs[0].kind == EJ_IN_ACT ? 0 : 1;
	tu_assert_close(ctx, bout[seg->grad_of_input[ox]], rdx, 1e-9, 1e-12,
			"recompute dx");
	tu_assert_close(ctx, bout[seg->grad_of_input[1 - ox]], rdg, 1e-9, 1e-12,
			"recompute dg");
	for (int i = 0; i < 8; i++) {
		epj_tensor_free(fout[i]);
		epj_tensor_free(bout[i]);
	}
	free(vx);
	free(vg);
	free(vdy);
	free(rdx);
	free(rdg);
	free(ry);
	epj_tensor_free(tx);
	epj_tensor_free(tg);
	epj_tensor_free(tdy);
	ej_segment_unref(seg);
	ej_graph_free(g);
	epj_ctx_free(ctx);
}
END_TEST

/* Recomputation through ROPE: y = rope(x * w, cos, sin) * z.  The backward
 * of the product needs the rotated value; it comes back from the forward
 * inputs (x, w, cos, sin: kept by reference) instead of being saved, so
 * the forward saves no node value at all; the gradients of x, w and z, run
 * through the interpreter, match a double-precision reference. */
START_TEST(test_partition_recompute_rope)
{
	epj_ctx *ctx = tu_ctx();
	int64_t R = tu_randint(2, 5), D = 2 * tu_randint(2, 6);
	int64_t sx[2] = { R, D }, sw[1] = { D };
	ej_graph *g = ej_graph_new("rope");
	int x = ej_graph_add_input(g, EJ_IN_ACT, 0, EPJ_DTYPE_F64, 2, sx);
	int w = ej_graph_add_input(g, EJ_IN_PARAM, 0, EPJ_DTYPE_F64, 1, sw);
	int c = ej_graph_add_input(g, EJ_IN_ACT, 1, EPJ_DTYPE_F64, 2, sx);
	int sn = ej_graph_add_input(g, EJ_IN_ACT, 2, EPJ_DTYPE_F64, 2, sx);
	int z = ej_graph_add_input(g, EJ_IN_ACT, 3, EPJ_DTYPE_F64, 2, sx);
	g->values[x].requires_grad = g->values[w].requires_grad = true;
	g->values[z].requires_grad = true;
	int xw[2] = { x, w };
	int a = rp_node(g, EJ_OP_MUL, xw, 2, NULL, 2, sx);
	int acs[3] = { a, c, sn };
	int q = rp_node(g, EJ_OP_ROPE, acs, 3, NULL, 2, sx);
	int qz[2] = { q, z };
	int y = rp_node(g, EJ_OP_MUL, qz, 2, NULL, 2, sx);
	ej_graph_add_output(g, y);
	ej_segment *seg = rp_segment(ctx, g);
	for (int k = 0; k < seg->n_saved; k++)
		ck_assert_msg(seg->saved_src[k] < 0,
			      "saved a node value:\n%s\n%s",
			      ej_graph_text(seg->fwd), ej_graph_text(seg->bwd));
	bool recomputed = false;
	for (int i = 0; i < seg->bwd->n_nodes; i++)
		recomputed |= seg->bwd->nodes[i].op == EJ_OP_ROPE;
	ck_assert_msg(recomputed, "no ROPE in the backward:\n%s",
		      ej_graph_text(seg->bwd));
	/* inputs by slot: x, cos, sin, z (ACT 0..3), w (PARAM 0) */
	epj_tensor *t[5];
	for (int i = 0; i < 5; i++)
		t[i] = tu_randn(ctx, EPJ_DTYPE_F64, i == 4 ? 1 : 2,
				i == 4 ? sw : sx);
	epj_tensor *tdy = tu_randn(ctx, EPJ_DTYPE_F64, 2, sx);
	epj_tensor *fin[5], *fout[8] = { 0 }, *bout[8] = { 0 };
	ck_assert(seg->fwd->n_inputs == 5);
	for (int i = 0; i < 5; i++) {
		const ej_graph_input *gi = &seg->fwd->inputs[i];
		fin[i] = gi->kind == EJ_IN_PARAM ? t[4] : t[gi->slot];
	}
	rp_run(ctx, seg, fin, tdy, fout, bout);
	double *v[5], *vdy = tu_values(ctx, tdy);
	for (int i = 0; i < 5; i++)
		v[i] = tu_values(ctx, t[i]);
	const double *vx = v[0], *vc = v[1], *vs = v[2], *vz = v[3], *vw = v[4];
	size_t n = (size_t)(R * D);
	double *ry = calloc(n, sizeof(double)),
	       *rdx = calloc(n, sizeof(double));
	double *rdz = calloc(n, sizeof(double));
	double *rdw = calloc((size_t)D, sizeof(double));
	int64_t h = D / 2;
	for (int64_t i = 0; i < R; i++)
		for (int64_t k = 0; k < D; k++) {
			int64_t o = i * D, p = k < h ? k + h : k - h;
			double sg = k < h ? -1 : 1;
			/* q = a cos + rot(a) sin, rot(a)_k = sg a_p */
			double qk = vx[o + k] * vw[k] * vc[o + k] +
				    sg * vx[o + p] * vw[p] * vs[o + k];
			ry[o + k] = qk * vz[o + k];
			rdz[o + k] = vdy[o + k] * qk;
			/* da_k = dq_k cos_k - sg dq_p sin_p (rot^T) */
			double dqk = vdy[o + k] * vz[o + k];
			double dqp = vdy[o + p] * vz[o + p];
			double da = dqk * vc[o + k] - sg * dqp * vs[o + p];
			rdx[o + k] = da * vw[k];
			rdw[k] += da * vx[o + k];
		}
	tu_assert_close(ctx, fout[0], ry, 1e-12, 1e-12, "rope y");
	for (int i = 0; i < 5; i++) {
		const ej_graph_input *gi = &seg->fwd->inputs[i];
		int slot = gi->kind == EJ_IN_PARAM ? 4 : gi->slot;
		int gk = seg->grad_of_input[i];
		if (slot == 0)
			tu_assert_close(ctx, bout[gk], rdx, 1e-12, 1e-12,
					"rope dx");
		else if (slot == 3)
			tu_assert_close(ctx, bout[gk], rdz, 1e-12, 1e-12,
					"rope dz");
		else if (slot == 4)
			tu_assert_close(ctx, bout[gk], rdw, 1e-12, 1e-12,
					"rope dw");
	}
	for (int i = 0; i < 8; i++) {
		epj_tensor_free(fout[i]);
		epj_tensor_free(bout[i]);
	}
	for (int i = 0; i < 5; i++) {
		free(v[i]);
		epj_tensor_free(t[i]);
	}
	free(vdy);
	free(ry);
	free(rdx);
	free(rdz);
	free(rdw);
	epj_tensor_free(tdy);
	ej_segment_unref(seg);
	ej_graph_free(g);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_jit_suite(void)
{
	Suite *s = suite_create("jit");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_parity_f64);
	tcase_add_test(tc, test_parity_f32);
	tcase_add_test(tc, test_parity_bf16);
	tcase_add_test(tc, test_gradcheck_compiled);
	tcase_add_test(tc, test_signature_sharing);
	tcase_add_test(tc, test_passes);
	tcase_add_test(tc, test_trace_error);
	tcase_add_test(tc, test_backend_parse);
	tcase_add_test(tc, test_backend_table);
	tcase_add_test(tc, test_partition_recompute);
	tcase_add_test(tc, test_partition_recompute_rope);
	suite_add_tcase(s, tc);
	return s;
}
