/* check_graph_api.c -- graphs described node by node (jit/graph_api.c) and
 * tensors over borrowed memory (epj_tensor_borrow).
 *
 * A graph built through the API, compiled by the c backend and run on
 * borrowed buffers must equal the same ops run eagerly; identical graphs
 * share one compiled graph; every misuse is a status with a message. */
#include "check_util.h"

#include <stdlib.h>
#include <string.h>

/* A borrowed tensor reads and writes the caller's buffer in place and
 * never frees it. */
START_TEST(borrow_in_place)
{
	epj_ctx *ctx = tu_ctx();
	float buf[6] = { 1, 2, 3, 4, 5, 6 };
	int64_t shape[2] = { 2, 3 };
	epj_tensor *t = epj_tensor_borrow(ctx, EPJ_DTYPE_F32, 2, shape, buf);
	tu_ok(ctx, t);
	ck_assert_ptr_eq(epj_tensor_data(t), buf);
	ck_assert(epj_tensor_is_contiguous(t));
	ck_assert_int_eq(epj_tensor_numel(t), 6);
	epj_tensor *y = epj_mul_scalar(ctx, t, 2.0);
	tu_ok(ctx, y);
	ck_assert(epj_tensor_get_f64(y, 5) == 12.0);
	epj_tensor_set_f64(t, 0, -7.0); /* writes the caller's memory */
	ck_assert(buf[0] == -7.0f);
	epj_tensor *v = epj_transpose(ctx, t, 0, 1);
	tu_ok(ctx, v);
	epj_tensor_free(t); /* the view keeps the storage; buf untouched */
	ck_assert(epj_tensor_get_f64(v, 1) == 4.0);
	epj_tensor_free(v);
	epj_tensor_free(y);
	ck_assert(buf[5] == 6.0f);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(borrow_bad_args)
{
	epj_ctx *ctx = tu_ctx();
	float buf[4];
	int64_t neg[1] = { -1 }, four[1] = { 4 };
	ck_assert_ptr_null(epj_tensor_borrow(ctx, EPJ_DTYPE_F32, 1, neg, buf));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_SHAPE);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "tensor_borrow"));
	epj_ctx_clear_error(ctx);
	ck_assert_ptr_null(
	    epj_tensor_borrow(ctx, EPJ_DTYPE_COUNT, 1, four, buf));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_INVALID);
	epj_ctx_clear_error(ctx);
	ck_assert_ptr_null(
	    epj_tensor_borrow(ctx, EPJ_DTYPE_F32, 1, four, NULL));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "NULL data"));
	epj_ctx_clear_error(ctx);
	epj_ctx_free(ctx);
}
END_TEST

#define B 2
#define T 8
#define H 4
#define D 16
#define F 24

/* The graph: y = silu(x @ w1^T) @ w2^T + x, then sum over the last axis
 * with keepdim (two outputs), as a framework would describe it. */
static epj_graph *mlp_graph(epj_ctx *ctx)
{
	epj_graph *g = NULL;
	ck_assert_int_eq(epj_graph_new(ctx, &g), EPJ_OK);
	int64_t xs[3] = { B, T, D }, w1s[2] = { F, D }, w2s[2] = { D, F };
	int x, w1, w2, h, a, p, y, s;
	ck_assert_int_eq(epj_graph_input(ctx, g, EPJ_DTYPE_F32, 3, xs, &x),
			 EPJ_OK);
	ck_assert_int_eq(epj_graph_input(ctx, g, EPJ_DTYPE_F32, 2, w1s, &w1),
			 EPJ_OK);
	ck_assert_int_eq(epj_graph_input(ctx, g, EPJ_DTYPE_F32, 2, w2s, &w2),
			 EPJ_OK);
	ck_assert_int_eq(x, 0);
	ck_assert_int_eq(w2, 2);
	int in_h[2] = { x, w1 };
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "linear", in_h, 2, NULL, 0, NULL, 0, 1, &h),
	    EPJ_OK);
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "silu", &h, 1, NULL, 0, NULL, 0, 1, &a),
	    EPJ_OK);
	int in_p[2] = { a, w2 };
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "linear", in_p, 2, NULL, 0, NULL, 0, 1, &p),
	    EPJ_OK);
	int in_y[2] = { p, x };
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "add", in_y, 2, NULL, 0, NULL, 0, 1, &y),
	    EPJ_OK);
	int64_t axis_keep[2] = { 2, 1 };
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "sum", &y, 1, axis_keep, 2, NULL, 0, 1, &s),
	    EPJ_OK);
	ck_assert_int_eq(epj_graph_output(ctx, g, y), EPJ_OK);
	ck_assert_int_eq(epj_graph_output(ctx, g, s), EPJ_OK);
	ck_assert_int_eq(epj_graph_n_outputs(g), 2);
	return g;
}

static float *random_buf(int64_t n)
{
	float *b = malloc((size_t)n * sizeof *b);
	ck_assert_ptr_nonnull(b);
	for (int64_t i = 0; i < n; i++)
		b[i] = (float)tu_uniform(-1, 1);
	return b;
}

/* Compiled and run on borrowed buffers, the graph equals the eager ops,
 * leaves the inputs as they were, and kernels of a compiled graph ran. */
START_TEST(graph_matches_eager)
{
	epj_ctx *ctx = tu_ctx();
	epj_compiler *c = NULL;
	ck_assert_int_eq(epj_compiler_new(ctx, "c", &c), EPJ_OK);
	epj_graph *g = mlp_graph(ctx);
	ck_assert_msg(epj_graph_compile(ctx, c, g) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	int64_t xs[3] = { B, T, D }, w1s[2] = { F, D }, w2s[2] = { D, F };
	float *bx = random_buf(B * T * D), *b1 = random_buf(F * D),
	      *b2 = random_buf(D * F);
	float *copy = malloc(sizeof(float) * B * T * D);
	ck_assert_ptr_nonnull(copy);
	memcpy(copy, bx, sizeof(float) * B * T * D);
	epj_tensor *in[3] = {
		epj_tensor_borrow(ctx, EPJ_DTYPE_F32, 3, xs, bx),
		epj_tensor_borrow(ctx, EPJ_DTYPE_F32, 2, w1s, b1),
		epj_tensor_borrow(ctx, EPJ_DTYPE_F32, 2, w2s, b2),
	};
	for (int i = 0; i < 3; i++)
		tu_ok(ctx, in[i]);
	int64_t k0 = epj_counter_get(ctx, "kernels.launched.compiled");
	epj_tensor *out[2];
	ck_assert_msg(epj_graph_run(ctx, g, in, 3, out, 2) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_gt(epj_counter_get(ctx, "kernels.launched.compiled"), k0);
	/* eager reference */
	epj_tensor *h = epj_linear(ctx, in[0], in[1], NULL);
	epj_tensor *a = epj_silu(ctx, h);
	epj_tensor *p = epj_linear(ctx, a, in[2], NULL);
	epj_tensor *y = epj_add(ctx, p, in[0]);
	epj_tensor *s = epj_sum(ctx, y, 2, true);
	tu_ok(ctx, s);
	tu_assert_tensors_close(ctx, out[0], y, 1e-5, 1e-5, "graph output 0");
	tu_assert_tensors_close(ctx, out[1], s, 1e-5, 1e-5, "graph output 1");
	ck_assert_int_eq(epj_tensor_dim(out[1], 2), 1);
	ck_assert(memcmp(copy, bx, sizeof(float) * B * T * D) == 0);
	epj_tensor *t[] = {
		h, a, p, y, s, out[0], out[1], in[0], in[1], in[2]
	};
	for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
		epj_tensor_free(t[i]);
	free(bx);
	free(b1);
	free(b2);
	free(copy);
	epj_graph_free(g);
	epj_compiler_free(c);
	epj_ctx_free(ctx);
}
END_TEST

/* epj_graph_run_data: the inputs' addresses in, the outputs and their
 * descriptions out in one call.  An output that views an input (a reshape
 * of x, a transpose of w) names that input and lies in its memory; a
 * computed one names none; shapes, strides, dtypes and values as
 * epj_graph_run gives them.  A wrong input count and NULL data for an
 * input with elements are errors. */
START_TEST(graph_run_data)
{
	epj_ctx *ctx = tu_ctx();
	epj_compiler *c = NULL;
	ck_assert_int_eq(epj_compiler_new(ctx, NULL, &c), EPJ_OK);
	int64_t rows = tu_randint(1, 6), cols = 2 * tu_randint(1, 9) + 1;
	int64_t xs[3] = { rows, 3, cols }, ws[2] = { 5, cols };
	epj_graph *g = NULL;
	ck_assert_int_eq(epj_graph_new(ctx, &g), EPJ_OK);
	int x, w, h, y, r, t;
	ck_assert_int_eq(epj_graph_input(ctx, g, EPJ_DTYPE_F32, 3, xs, &x),
			 EPJ_OK);
	ck_assert_int_eq(epj_graph_input(ctx, g, EPJ_DTYPE_F32, 2, ws, &w),
			 EPJ_OK);
	int xw[2] = { x, w };
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "linear", xw, 2, NULL, 0, NULL, 0, 1, &h),
	    EPJ_OK);
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "silu", &h, 1, NULL, 0, NULL, 0, 1, &y),
	    EPJ_OK);
	int64_t flat[2] = { rows * 3, cols }, sw[2] = { 0, 1 };
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "reshape", &x, 1, flat, 2, NULL, 0, 1, &r),
	    EPJ_OK);
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "transpose", &w, 1, sw, 2, NULL, 0, 1, &t),
	    EPJ_OK);
	int outs_v[3] = { y, r, t };
	for (int i = 0; i < 3; i++)
		ck_assert_int_eq(epj_graph_output(ctx, g, outs_v[i]), EPJ_OK);
	ck_assert_msg(epj_graph_compile(ctx, c, g) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	float *bx = random_buf(rows * 3 * cols), *bw = random_buf(5 * cols);
	void *data[2] = { bx, bw };
	epj_tensor *out[3], *ref[3];
	int64_t desc[3 * EPJ_GRAPH_DESC];
	ck_assert_msg(epj_graph_run_data(ctx, g, data, 2, out, 3, desc) ==
			  EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	epj_tensor *in[2] = { epj_tensor_borrow(ctx, EPJ_DTYPE_F32, 3, xs, bx),
			      epj_tensor_borrow(ctx, EPJ_DTYPE_F32, 2, ws,
						bw) };
	ck_assert_int_eq(epj_graph_run(ctx, g, in, 2, ref, 3), EPJ_OK);
	static const int views[3] = { -1, 0, 1 };
	for (int j = 0; j < 3; j++) {
		const int64_t *d = desc + j * EPJ_GRAPH_DESC;
		char what[64];
		snprintf(what, sizeof what, "output %d", j);
		tu_assert_tensors_close(ctx, out[j], ref[j], 0, 0, what);
		ck_assert_int_eq(d[0],
				 (int64_t)(intptr_t)epj_tensor_data(out[j]));
		ck_assert_int_eq(d[1], EPJ_DTYPE_F32);
		ck_assert_int_eq(d[2], epj_tensor_ndim(out[j]));
		ck_assert_int_eq(d[3], views[j]);
		for (int k = 0; k < d[2]; k++) {
			ck_assert_int_eq(d[4 + k], epj_tensor_dim(out[j], k));
			ck_assert_int_eq(d[4 + EPJ_MAX_DIMS + k],
					 epj_tensor_strides(out[j])[k]);
		}
	}
	/* the views lie in the caller's memory, the computed output not */
	ck_assert_int_eq(desc[EPJ_GRAPH_DESC], (int64_t)(intptr_t)bx);
	ck_assert_int_eq(desc[2 * EPJ_GRAPH_DESC], (int64_t)(intptr_t)bw);
	ck_assert_int_eq(desc[2 * EPJ_GRAPH_DESC + 4 + EPJ_MAX_DIMS], 1);
	ck_assert_int_eq(desc[2 * EPJ_GRAPH_DESC + 5 + EPJ_MAX_DIMS], cols);
	uintptr_t y0 = (uintptr_t)desc[0];
	ck_assert(y0 + 4 <= (uintptr_t)bx ||
		  y0 >= (uintptr_t)(bx + rows * 3 * cols));
	/* errors */
	epj_tensor *bad[3] = { NULL, NULL, NULL };
	ck_assert_int_eq(epj_graph_run_data(ctx, g, data, 1, bad, 3, desc),
			 EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "1 inputs"));
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(epj_graph_run_data(ctx, g, NULL, 2, bad, 3, desc),
			 EPJ_ERR_INVALID);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "no addresses"));
	epj_ctx_clear_error(ctx);
	void *nodata[2] = { bx, NULL };
	ck_assert_int_ne(epj_graph_run_data(ctx, g, nodata, 2, bad, 3, NULL),
			 EPJ_OK);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "input 1"));
	ck_assert_ptr_null(bad[0]);
	epj_ctx_clear_error(ctx);
	for (int j = 0; j < 3; j++) {
		epj_tensor_free(out[j]);
		epj_tensor_free(ref[j]);
	}
	epj_tensor_free(in[0]);
	epj_tensor_free(in[1]);
	free(bx);
	free(bw);
	epj_graph_free(g);
	epj_compiler_free(c);
	epj_ctx_free(ctx);
}
END_TEST

/* Two graphs of the same description (weights are inputs, so the data
 * differs but not the graph) compile once: the second finds the first by
 * signature. */
START_TEST(identical_graphs_share)
{
	epj_ctx *ctx = tu_ctx();
	epj_compiler *c = NULL;
	ck_assert_int_eq(epj_compiler_new(ctx, NULL, &c), EPJ_OK);
	epj_graph *g1 = mlp_graph(ctx), *g2 = mlp_graph(ctx);
	ck_assert_int_eq(epj_graph_compile(ctx, c, g1), EPJ_OK);
	int64_t u = epj_counter_get(ctx, "stats.unique_graphs");
	int64_t hits = epj_counter_get(ctx, "stats.graph_cache_hits");
	ck_assert_int_gt(u, 0);
	ck_assert_int_eq(epj_graph_compile(ctx, c, g2), EPJ_OK);
	ck_assert_int_eq(epj_counter_get(ctx, "stats.unique_graphs"), u);
	ck_assert_int_gt(epj_counter_get(ctx, "stats.graph_cache_hits"), hits);
	epj_graph_free(g1);
	epj_graph_free(g2);
	epj_compiler_free(c);
	epj_ctx_free(ctx);
}
END_TEST

static void expect_error(epj_ctx *ctx, epj_status got, epj_status want,
			 const char *needle)
{
	ck_assert_msg(got == want, "status %s, want %s (%s)",
		      epj_status_name(got), epj_status_name(want),
		      epj_ctx_error(ctx));
	ck_assert_msg(strstr(epj_ctx_error(ctx), needle), "message \"%s\"",
		      epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
}

/* Every misuse is a status and a message naming the node or input. */
START_TEST(graph_bad_input)
{
	epj_ctx *ctx = tu_ctx();
	epj_compiler *c = NULL;
	expect_error(ctx, epj_compiler_new(ctx, "no-such-backend", &c),
		     EPJ_ERR_CONFIG, "no-such-backend");
	ck_assert_ptr_null(c);
	ck_assert_int_eq(epj_compiler_new(ctx, "c", &c), EPJ_OK);
	epj_graph *g = NULL;
	ck_assert_int_eq(epj_graph_new(ctx, &g), EPJ_OK);
	int64_t s2[2] = { 3, 4 }, s3[2] = { 5, 6 };
	int a, b, v;
	ck_assert_int_eq(epj_graph_input(ctx, g, EPJ_DTYPE_F32, 2, s2, &a),
			 EPJ_OK);
	ck_assert_int_eq(epj_graph_input(ctx, g, EPJ_DTYPE_F32, 2, s3, &b),
			 EPJ_OK);
	int ab[2] = { a, b }, bad[2] = { a, 7 };
	expect_error(ctx,
		     epj_graph_node(ctx, g, "frobnicate", ab, 2, NULL, 0, NULL,
				    0, 1, &v),
		     EPJ_ERR_INVALID, "frobnicate");
	expect_error(
	    ctx, epj_graph_node(ctx, g, "add", bad, 2, NULL, 0, NULL, 0, 1, &v),
	    EPJ_ERR_INDEX, "value 7");
	expect_error(
	    ctx, epj_graph_node(ctx, g, "add", ab, 1, NULL, 0, NULL, 0, 1, &v),
	    EPJ_ERR_INVALID, "takes 2 inputs");
	expect_error(ctx, epj_graph_compile(ctx, c, g), EPJ_ERR_INVALID,
		     "no output");
	/* shapes [3, 4] + [5, 6] do not broadcast: found at compile */
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "add", ab, 2, NULL, 0, NULL, 0, 1, &v),
	    EPJ_OK);
	expect_error(ctx, epj_graph_input(ctx, g, EPJ_DTYPE_F32, 2, s2, &v),
		     EPJ_ERR_STATE, "after the first node");
	ck_assert_int_eq(epj_graph_output(ctx, g, v), EPJ_OK);
	expect_error(ctx, epj_graph_output(ctx, g, 99), EPJ_ERR_INDEX,
		     "value 99");
	epj_status st = epj_graph_compile(ctx, c, g);
	ck_assert_int_ne(st, EPJ_OK);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "graph node 0 (add)"), "%s",
		      epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
	epj_tensor *out[2];
	expect_error(ctx, epj_graph_run(ctx, g, NULL, 0, out, 1), EPJ_ERR_STATE,
		     "before epj_graph_compile");
	epj_graph_free(g);

	/* a compiled graph run on inputs of other shapes */
	ck_assert_int_eq(epj_graph_new(ctx, &g), EPJ_OK);
	ck_assert_int_eq(epj_graph_input(ctx, g, EPJ_DTYPE_F32, 2, s2, &a),
			 EPJ_OK);
	ck_assert_int_eq(
	    epj_graph_node(ctx, g, "exp", &a, 1, NULL, 0, NULL, 0, 1, &v),
	    EPJ_OK);
	ck_assert_int_eq(epj_graph_output(ctx, g, v), EPJ_OK);
	ck_assert_int_eq(epj_graph_compile(ctx, c, g), EPJ_OK);
	expect_error(
	    ctx, epj_graph_node(ctx, g, "exp", &a, 1, NULL, 0, NULL, 0, 1, &v),
	    EPJ_ERR_STATE, "after epj_graph_compile");
	float buf[30] = { 0 };
	epj_tensor *x = epj_tensor_borrow(ctx, EPJ_DTYPE_F32, 2, s3, buf);
	tu_ok(ctx, x);
	expect_error(ctx, epj_graph_run(ctx, g, &x, 1, out, 1), EPJ_ERR_SHAPE,
		     "differ from the compiled");
	ck_assert_ptr_null(out[0]);
	expect_error(ctx, epj_graph_run(ctx, g, &x, 1, out, 2), EPJ_ERR_INVALID,
		     "2 outputs");
	epj_tensor_free(x);
	epj_graph_free(g);
	epj_compiler_free(c);
	epj_ctx_free(ctx);
}
END_TEST

/* A graph with a triangular solve (an extern node) of a transposed A and a
 * scaled B, compiled by the device's default backend, equals the eager
 * ops on the cpu and on cuda-sim (where nothing falls back to the CPU). */
START_TEST(graph_solve_triangular)
{
	const int64_t as[3] = { 2, 5, 5 }, bs[3] = { 2, 5, 3 };
	double av[50], bv[30];
	for (int p = 0; p < 2; p++)
		for (int i = 0; i < 5; i++)
			for (int j = 0; j < 5; j++)
				av[(p * 5 + i) * 5 + j] =
				    i == j  ? 2 + 0.1 * p
				    : j < i ? tu_uniform(-0.3, 0.3)
					    : 60; /* never read */
	for (int i = 0; i < 30; i++)
		bv[i] = tu_uniform(-1, 1);
	for (int dev = 0; dev < 2; dev++) {
		epj_ctx *ctx = NULL;
		ck_assert_int_eq(epj_ctx_new(dev ? "cuda-sim" : "cpu", &ctx),
				 EPJ_OK);
		epj_compiler *c = NULL;
		ck_assert_int_eq(epj_compiler_new(ctx, NULL, &c), EPJ_OK);
		epj_graph *g = NULL;
		ck_assert_int_eq(epj_graph_new(ctx, &g), EPJ_OK);
		int a, b, at, b2, x, y;
		ck_assert_int_eq(
		    epj_graph_input(ctx, g, EPJ_DTYPE_F32, 3, as, &a), EPJ_OK);
		ck_assert_int_eq(
		    epj_graph_input(ctx, g, EPJ_DTYPE_F32, 3, bs, &b), EPJ_OK);
		int64_t dims[2] = { 1, 2 }, tri[3] = { 1, 0, 1 };
		double two = 2;
		ck_assert_int_eq(epj_graph_node(ctx, g, "transpose", &a, 1,
						dims, 2, NULL, 0, 1, &at),
				 EPJ_OK);
		ck_assert_int_eq(epj_graph_node(ctx, g, "mul_scalar", &b, 1,
						NULL, 0, &two, 1, 1, &b2),
				 EPJ_OK);
		int in_x[2] = { at, b2 };
		ck_assert_int_eq(epj_graph_node(ctx, g, "solve_triangular",
						in_x, 2, tri, 3, NULL, 0, 1,
						&x),
				 EPJ_OK);
		int in_y[2] = { x, b };
		ck_assert_int_eq(epj_graph_node(ctx, g, "add", in_y, 2, NULL, 0,
						NULL, 0, 1, &y),
				 EPJ_OK);
		ck_assert_int_eq(epj_graph_output(ctx, g, y), EPJ_OK);
		ck_assert_msg(epj_graph_compile(ctx, c, g) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		epj_tensor *a64 =
		    epj_tensor_from_data(ctx, EPJ_DTYPE_F64, 3, as, av);
		epj_tensor *b64 =
		    epj_tensor_from_data(ctx, EPJ_DTYPE_F64, 3, bs, bv);
		epj_tensor *in[2] = { epj_cast(ctx, a64, EPJ_DTYPE_F32),
				      epj_cast(ctx, b64, EPJ_DTYPE_F32) };
		tu_ok(ctx, in[1]);
		int64_t fb0 =
		    epj_counter_get(ctx, "kernels.eager_cpu_fallback");
		epj_tensor *out = NULL;
		ck_assert_msg(epj_graph_run(ctx, g, in, 2, &out, 1) == EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		ck_assert_int_eq(
		    epj_counter_get(ctx, "kernels.eager_cpu_fallback"), fb0);
		epj_tensor *ta = epj_transpose(ctx, in[0], 1, 2);
		epj_tensor *tb = epj_mul_scalar(ctx, in[1], 2);
		epj_tensor *ex =
		    epj_solve_triangular(ctx, ta, tb, true, false, true);
		epj_tensor *ey = epj_add(ctx, ex, in[1]);
		tu_ok(ctx, ey);
		tu_assert_tensors_close(ctx, out, ey, 1e-5, 1e-5,
					dev ? "graph solve cuda-sim"
					    : "graph solve cpu");
		epj_tensor *t[] = {
			a64, b64, in[0], in[1], out, ta, tb, ex, ey
		};
		for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
			epj_tensor_free(t[i]);
		epj_graph_free(g);
		epj_compiler_free(c);
		epj_ctx_free(ctx);
	}
}
END_TEST

Suite *make_graph_api_suite(void)
{
	Suite *s = suite_create("graph_api");
	TCase *tc = tcase_create("graph_api");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, borrow_in_place);
	tcase_add_test(tc, borrow_bad_args);
	tcase_add_test(tc, graph_matches_eager);
	tcase_add_test(tc, graph_run_data);
	tcase_add_test(tc, identical_graphs_share);
	tcase_add_test(tc, graph_bad_input);
	tcase_add_test(tc, graph_solve_triangular);
	suite_add_tcase(s, tc);
	return s;
}
