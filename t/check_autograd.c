/* check_autograd.c -- the autograd machinery itself: fan-out accumulation,
 * accumulation into .grad across backward calls, no_grad scopes, detach,
 * retained intermediate gradients, release of saved tensors, errors, an
 * exchange whose gradient travels while other nodes run. */
#include "check_util.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core_impl.h"

static epj_tensor *leaf(epj_ctx *ctx, int64_t n)
{
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F64, 1, &n);
	epj_tensor_set_requires_grad(x, true);
	return x;
}

/* y = x*x + 3x  used twice (fan-out): d sum(y)/dx = 2x + 3 */
START_TEST(test_fanout)
{
	epj_ctx *ctx = tu_ctx();
	int64_t n = tu_randint(3, 40);
	epj_tensor *x = leaf(ctx, n);
	epj_tensor *xx = epj_mul(ctx, x, x);
	epj_tensor *x3 = epj_mul_scalar(ctx, x, 3.0);
	epj_tensor *y = epj_add(ctx, xx, x3);
	epj_tensor *loss = epj_sum_all(ctx, y);
	tu_ok(ctx, loss);
	ck_assert_int_eq(epj_backward(ctx, loss, NULL), EPJ_OK);
	double *xv = tu_values(ctx, x);
	double *ref = malloc(sizeof *ref * (size_t)n);
	for (int64_t i = 0; i < n; i++)
		ref[i] = 2 * xv[i] + 3;
	tu_assert_close(ctx, epj_tensor_grad(x), ref, 1e-12, 1e-12, "fanout");
	free(ref);
	free(xv);
	epj_tensor_free(loss);
	epj_tensor_free(y);
	epj_tensor_free(x3);
	epj_tensor_free(xx);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

/* Two backward passes over two graphs accumulate into .grad. */
START_TEST(test_accumulate)
{
	epj_ctx *ctx = tu_ctx();
	int64_t n = tu_randint(2, 30);
	epj_tensor *x = leaf(ctx, n);
	double s1 = tu_uniform(0.5, 2.0), s2 = tu_uniform(-2.0, -0.5);
	for (int pass = 0; pass < 2; pass++) {
		epj_tensor *y = epj_mul_scalar(ctx, x, pass ? s2 : s1);
		epj_tensor *l = epj_sum_all(ctx, y);
		tu_ok(ctx, l);
		ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
		epj_tensor_free(l);
		epj_tensor_free(y);
	}
	double *ref = malloc(sizeof *ref * (size_t)n);
	for (int64_t i = 0; i < n; i++)
		ref[i] = s1 + s2;
	tu_assert_close(ctx, epj_tensor_grad(x), ref, 1e-12, 1e-12,
			"accumulated grad");
	ck_assert(epj_tensor_is_contiguous(epj_tensor_grad(x)));
	epj_tensor_zero_grad(x);
	ck_assert_ptr_null(epj_tensor_grad(x));
	free(ref);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_no_grad_and_detach)
{
	epj_ctx *ctx = tu_ctx();
	epj_tensor *x = leaf(ctx, 7);
	bool prev = epj_no_grad_enter(ctx);
	ck_assert(!epj_grad_enabled(ctx));
	bool inner = epj_no_grad_enter(ctx); /* nests */
	epj_tensor *y = epj_mul(ctx, x, x);
	epj_no_grad_exit(ctx, inner);
	ck_assert(!epj_grad_enabled(ctx));
	epj_no_grad_exit(ctx, prev);
	ck_assert(epj_grad_enabled(ctx));
	tu_ok(ctx, y);
	ck_assert(!epj_tensor_requires_grad(y));

	epj_tensor *d = epj_detach(ctx, x);
	tu_ok(ctx, d);
	ck_assert(!epj_tensor_requires_grad(d));
	ck_assert(epj_tensor_shares_storage(d, x));
	/* z = x * detach(x): gradient only through the first factor */
	epj_tensor *z = epj_mul(ctx, x, d);
	epj_tensor *l = epj_sum_all(ctx, z);
	tu_ok(ctx, l);
	ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
	double *xv = tu_values(ctx, x);
	tu_assert_close(ctx, epj_tensor_grad(x), xv, 1e-12, 1e-12,
			"detach stops gradient");
	free(xv);
	epj_tensor_free(l);
	epj_tensor_free(z);
	epj_tensor_free(d);
	epj_tensor_free(y);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

/* h = 2x (non-leaf, retained); loss = sum(h*h): h.grad = 2h = 4x */
START_TEST(test_retain_grad)
{
	epj_ctx *ctx = tu_ctx();
	int64_t n = tu_randint(3, 17);
	epj_tensor *x = leaf(ctx, n);
	epj_tensor *h = epj_mul_scalar(ctx, x, 2.0);
	tu_ok(ctx, h);
	ck_assert(!epj_tensor_is_leaf(h));
	epj_tensor_retain_grad(h);
	epj_tensor *hh = epj_mul(ctx, h, h);
	epj_tensor *l = epj_sum_all(ctx, hh);
	tu_ok(ctx, l);
	ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
	ck_assert_ptr_nonnull(epj_tensor_grad(h));
	double *xv = tu_values(ctx, x);
	double *ref = malloc(sizeof *ref * (size_t)n);
	for (int64_t i = 0; i < n; i++)
		ref[i] = 4 * xv[i];
	tu_assert_close(ctx, epj_tensor_grad(h), ref, 1e-12, 1e-12,
			"retained grad");
	for (int64_t i = 0; i < n; i++)
		ref[i] = 8 * xv[i];
	tu_assert_close(ctx, epj_tensor_grad(x), ref, 1e-12, 1e-12, "x grad");
	free(ref);
	free(xv);
	epj_tensor_free(l);
	epj_tensor_free(hh);
	epj_tensor_free(h);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

/* Saved tensors are released after use; a second backward is an error. */
START_TEST(test_saved_released)
{
	epj_ctx *ctx = tu_ctx();
	epj_tensor *x = leaf(ctx, 5);
	epj_tensor *h = epj_exp(ctx, x);
	epj_tensor *z = epj_mul(ctx, h, x);
	epj_tensor *l = epj_sum_all(ctx, z);
	tu_ok(ctx, l);
	ck_assert_ptr_nonnull(z->grad_fn);
	ck_assert_ptr_nonnull(z->grad_fn->saved_in[0]);
	ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
	ck_assert_ptr_null(z->grad_fn->saved_in[0]);
	ck_assert_ptr_null(z->grad_fn->saved_in[1]);
	ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_ERR_STATE);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "already"));
	epj_ctx_clear_error(ctx);
	epj_tensor_free(l);
	epj_tensor_free(z);
	epj_tensor_free(h);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_errors)
{
	epj_ctx *ctx = tu_ctx();
	epj_tensor *x = leaf(ctx, 4), *g3 = NULL;
	epj_tensor *y = epj_mul_scalar(ctx, x, 2.0);
	tu_ok(ctx, y);
	/* non-scalar root without an explicit grad */
	ck_assert_int_eq(epj_backward(ctx, y, NULL), EPJ_ERR_SHAPE);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "[4]"));
	/* grad of the wrong shape */
	int64_t s3 = 3;
	epj_tensor *g = epj_full(ctx, EPJ_DTYPE_F64, 1, &s3, 1.0);
	ck_assert_int_eq(epj_backward(ctx, y, g), EPJ_ERR_SHAPE);
	epj_tensor_free(g);
	/* explicit grad of the right shape works */
	int64_t s4 = 4;
	g = epj_full(ctx, EPJ_DTYPE_F64, 1, &s4, 0.5);
	ck_assert_int_eq(epj_backward(ctx, y, g), EPJ_OK);
	double ref[4] = { 1, 1, 1, 1 };
	tu_assert_close(ctx, epj_tensor_grad(x), ref, 1e-12, 1e-12, "x grad");
	epj_tensor_free(g);
	/* a tensor that does not require grad */
	epj_tensor *c = tu_randn(ctx, EPJ_DTYPE_F64, 1, &s4);
	ck_assert_int_eq(epj_backward(ctx, c, NULL), EPJ_ERR_INVALID);
	epj_tensor *c1 = epj_sum_all(ctx, c);
	ck_assert_int_eq(epj_backward(ctx, c1, NULL), EPJ_ERR_INVALID);
	/* NULL propagates through ops without replacing the first error */
	epj_ctx_clear_error(ctx);
	epj_tensor *bad =
	    epj_add(ctx, x, g3 = epj_full(ctx, EPJ_DTYPE_F64, 1, &s3, 1.0));
	ck_assert_ptr_null(bad);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_SHAPE);
	char first[1024];
	snprintf(first, sizeof first, "%s", epj_ctx_error(ctx));
	ck_assert_ptr_nonnull(strstr(first, "add"));
	epj_tensor *chained = epj_exp(ctx, bad);
	ck_assert_ptr_null(chained);
	ck_assert_str_eq(epj_ctx_error(ctx), first);
	epj_tensor_free(g3);
	epj_ctx_clear_error(ctx);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_OK);
	ck_assert_ptr_null(epj_exp(ctx, NULL));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_INVALID);
	epj_tensor_free(c1);
	epj_tensor_free(c);
	epj_tensor_free(y);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

/* A multi-output op with one output unused: top-k values only. */
START_TEST(test_unused_output)
{
	epj_ctx *ctx = tu_ctx();
	int64_t shape[2] = { 3, 6 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F64, 2, shape);
	epj_tensor_set_requires_grad(x, true);
	epj_tensor *v = NULL, *ix = NULL;
	ck_assert_int_eq(epj_topk(ctx, x, 2, &v, &ix), EPJ_OK);
	ck_assert(!epj_tensor_requires_grad(ix));
	epj_tensor *l = epj_sum_all(ctx, v);
	tu_ok(ctx, l);
	ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
	double *g = tu_values(ctx, epj_tensor_grad(x));
	double *iv = tu_values(ctx, ix);
	double want[18] = { 0 };
	for (int r = 0; r < 3; r++)
		for (int k = 0; k < 2; k++)
			want[r * 6 + (int)iv[r * 2 + k]] = 1;
	for (int i = 0; i < 18; i++)
		ck_assert_double_eq(g[i], want[i]);
	free(g);
	free(iv);
	epj_tensor_free(l);
	epj_tensor_free(v);
	epj_tensor_free(ix);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

/* Backward of a leaf root, and a broadcast gradient stored contiguously. */
START_TEST(test_leaf_root_and_broadcast)
{
	epj_ctx *ctx = tu_ctx();
	int64_t sb[2] = { 1, 5 }, sa[2] = { 4, 5 };
	epj_tensor *b = tu_randn(ctx, EPJ_DTYPE_F64, 2, sb);
	epj_tensor_set_requires_grad(b, true);
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F64, 2, sa);
	epj_tensor *y = epj_add(ctx, a, b);
	epj_tensor *l = epj_sum_all(ctx, y);
	tu_ok(ctx, l);
	ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
	double ref[5] = { 4, 4, 4, 4, 4 };
	tu_assert_close(ctx, epj_tensor_grad(b), ref, 1e-12, 1e-12,
			"broadcast grad");
	ck_assert(epj_tensor_is_contiguous(epj_tensor_grad(b)));
	epj_tensor_zero_grad(b);
	epj_tensor *g = epj_full(ctx, EPJ_DTYPE_F64, 2, sb, 2.5);
	ck_assert_int_eq(epj_backward(ctx, b, g), EPJ_OK);
	double ref2[5] = { 2.5, 2.5, 2.5, 2.5, 2.5 };
	tu_assert_close(ctx, epj_tensor_grad(b), ref2, 0, 0, "leaf root");
	epj_tensor_free(g);
	epj_tensor_free(l);
	epj_tensor_free(y);
	epj_tensor_free(a);
	epj_tensor_free(b);
	epj_ctx_free(ctx);
}
END_TEST

/* A leaf's first gradient is adopted, not copied, when a backward formula
 * made it fresh and nobody else holds it (w in w * c: mul's backward makes
 * g * c); it is copied when the same tensor is the gradient of two inputs
 * (a + b: add's backward hands both the fresh g * c2 of (a + b) * c2), when
 * it is the caller's (a leaf root), or a broadcast.  Copied or adopted, no
 * two .grads share memory, and writing one changes nothing else. */
START_TEST(test_grad_adopted_or_copied)
{
	epj_ctx *ctx = tu_ctx();
	int64_t n = tu_randint(3, 50);
	epj_tensor *w = leaf(ctx, n), *a = leaf(ctx, n), *b = leaf(ctx, n);
	epj_tensor *c = tu_randn(ctx, EPJ_DTYPE_F64, 1, &n);
	epj_tensor *c2 = tu_randn(ctx, EPJ_DTYPE_F64, 1, &n);
	epj_tensor *wc = epj_mul(ctx, w, c);
	epj_tensor *ab = epj_add(ctx, a, b);
	epj_tensor *abc = epj_mul(ctx, ab, c2);
	epj_tensor *y = epj_add(ctx, wc, abc);
	epj_tensor *l = epj_sum_all(ctx, y);
	tu_ok(ctx, l);
	int64_t ad0 = epj_counter_get(ctx, "autograd.grads_adopted");
	int64_t cp0 = epj_counter_get(ctx, "autograd.grad_copy_bytes");
	ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
	/* w's gradient adopted; a's and b's (one tensor) copied */
	ck_assert_int_eq(epj_counter_get(ctx, "autograd.grads_adopted") - ad0,
			 1);
	ck_assert_int_eq(epj_counter_get(ctx, "autograd.grad_copy_bytes") - cp0,
			 2 * n * (int64_t)sizeof(double));
	double *cv = tu_values(ctx, c);
	double *c2v = tu_values(ctx, c2);
	epj_tensor *gw = epj_tensor_grad(w), *ga = epj_tensor_grad(a),
		   *gb = epj_tensor_grad(b);
	tu_assert_close(ctx, gw, cv, 0, 0, "adopted grad of w");
	tu_assert_close(ctx, ga, c2v, 0, 0, "grad of a");
	tu_assert_close(ctx, gb, c2v, 0, 0, "grad of b");
	ck_assert(epj_tensor_data(ga) != epj_tensor_data(gb));
	ck_assert(epj_tensor_data(gw) != epj_tensor_data(ga) &&
		  epj_tensor_data(gw) != epj_tensor_data(gb));
	epj_tensor_set_f64(ga, 0, 42.0);
	ck_assert(epj_tensor_get_f64(gb, 0) == c2v[0]);
	/* a second backward accumulates into the adopted buffer's value */
	epj_tensor *wc2 = epj_mul(ctx, w, c);
	epj_tensor *l2 = epj_sum_all(ctx, wc2);
	ck_assert_int_eq(epj_backward(ctx, l2, NULL), EPJ_OK);
	for (int64_t i = 0; i < n; i++)
		cv[i] *= 2;
	tu_assert_close(ctx, epj_tensor_grad(w), cv, 0, 0,
			"adopted grad accumulated");
	/* a leaf root keeps a copy of the caller's gradient */
	epj_tensor_zero_grad(a);
	epj_tensor *g = tu_randn(ctx, EPJ_DTYPE_F64, 1, &n);
	ck_assert_int_eq(epj_backward(ctx, a, g), EPJ_OK);
	ck_assert(epj_tensor_data(epj_tensor_grad(a)) != epj_tensor_data(g));
	double g0 = epj_tensor_get_f64(g, 0);
	epj_tensor_set_f64(g, 0, g0 + 1.0);
	ck_assert(epj_tensor_get_f64(epj_tensor_grad(a), 0) == g0);
	free(cv);
	free(c2v);
	epj_tensor *t[] = { w, a, b, c, c2, wc, ab, abc, y, l, wc2, l2, g };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	epj_ctx_free(ctx);
}
END_TEST

/* ej_dispatch_into writes an op's result into a tensor that stays put
 * (no autograd node, the tensor's own storage), and refuses a tensor of
 * another shape or dtype. */
START_TEST(test_dispatch_into)
{
	epj_ctx *ctx = tu_ctx();
	int64_t s[2] = { tu_randint(1, 9), tu_randint(1, 17) };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_BF16, 2, s);
	epj_tensor_set_requires_grad(x, true);
	epj_tensor *acc = epj_zeros(ctx, EPJ_DTYPE_F32, 2, s);
	const void *data = epj_tensor_data(acc);
	ej_attrs at = ej_attrs_none();
	ej_attrs_push_i(&at, (int64_t)EPJ_DTYPE_F32);
	ck_assert_int_eq(ej_dispatch_into(ctx, EJ_OP_CAST, &x, 1, &at, acc),
			 EPJ_OK);
	ck_assert(epj_tensor_data(acc) == data);
	ck_assert_ptr_null(acc->grad_fn);
	double *want = tu_values(ctx, x);
	tu_assert_close(ctx, acc, want, 0, 0, "cast into");
	free(want);
	int64_t s2[2] = { s[0], s[1] + 1 };
	epj_tensor *wrong = epj_zeros(ctx, EPJ_DTYPE_F32, 2, s2);
	epj_tensor *wdt = epj_zeros(ctx, EPJ_DTYPE_F64, 2, s);
	ck_assert_int_eq(ej_dispatch_into(ctx, EJ_OP_CAST, &x, 1, &at, wrong),
			 EPJ_ERR_SHAPE);
	tu_assert_ctx_error(ctx, EPJ_ERR_SHAPE, TU_STRS("cast into"));
	ck_assert_int_eq(ej_dispatch_into(ctx, EJ_OP_CAST, &x, 1, &at, wdt),
			 EPJ_ERR_SHAPE);
	epj_tensor *t[] = { x, acc, wrong, wdt };
	for (size_t i = 0; i < EJ_ARRAY_LEN(t); i++)
		epj_tensor_free(t[i]);
	epj_ctx_free(ctx);
}
END_TEST

/* Every eager op call counts one kernel launch; views count none. */
START_TEST(test_launch_counter)
{
	epj_ctx *ctx = tu_ctx();
	int64_t s[2] = { 3, 4 };
	epj_tensor *a = tu_randn(ctx, EPJ_DTYPE_F32, 2, s);
	int64_t before = epj_counter_get(ctx, "kernels.launched.eager");
	epj_tensor *b = epj_exp(ctx, a);
	epj_tensor *c = epj_add(ctx, a, b);
	epj_tensor *t = epj_transpose(ctx, c, 0, 1);
	tu_ok(ctx, t);
	ck_assert_int_eq(
	    epj_counter_get(ctx, "kernels.launched.eager") - before, 2);
	epj_tensor_free(t);
	epj_tensor_free(c);
	epj_tensor_free(b);
	epj_tensor_free(a);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- an exchange whose gradient travels (custom_finish) ------------------
 * The stand-in: the backward hands out a buffer of NaN as each input's
 * gradient and keeps the true one (3 g) until its finish writes it there,
 * as a device exchange's receive buffer holds its rows only after the
 * compute stream's wait.  Any node that read the buffer before the finish
 * would see NaN.  Events: E the exchange's backward, F its finish, I a
 * comm-free custom node's backward, S another custom node's. */
static char ev[64];
static int nev;

static void ev_add(char c)
{
	if (nev < (int)sizeof ev - 1)
		ev[nev++] = c;
	ev[nev] = 0;
}

typedef struct exch {
	epj_tensor *buf[2], *val[2];
} exch;

static void exch_free(void *p)
{
	free(p);
}

static epj_status exch_bw(epj_ctx *ctx, ej_node *n, epj_tensor *const *g,
			  epj_tensor **gin)
{
	exch *x = n->custom;
	ev_add('E');
	ck_assert(n->bw_defer);
	for (int i = 0; i < n->n_in; i++) {
		x->val[i] = epj_mul_scalar(ctx, g[0], 3.0);
		gin[i] = epj_mul_scalar(ctx, g[0], NAN);
		x->buf[i] = epj_tensor_ref(gin[i]);
	}
	n->bw_in_flight = true;
	return EPJ_OK;
}

static epj_status exch_finish(epj_ctx *ctx, ej_node *n)
{
	exch *x = n->custom;
	ev_add('F');
	for (int i = 0; i < n->n_in; i++) {
		ck_assert_int_eq(epj_tensor_copy_(ctx, x->buf[i], x->val[i]),
				 EPJ_OK);
		epj_tensor_free(x->buf[i]);
		epj_tensor_free(x->val[i]);
		x->buf[i] = x->val[i] = NULL;
	}
	return EPJ_OK;
}

/* e = a0 + a1 (+ ...) forward, de/da_i = 3 in backward, by exch_bw. */
static epj_tensor *exchange(epj_ctx *ctx, epj_tensor **in, int n_in)
{
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *y = epj_tensor_ref(in[0]);
	for (int i = 1; i < n_in; i++) {
		epj_tensor *s = epj_add(ctx, y, in[i]);
		epj_tensor_free(y);
		y = s;
	}
	epj_tensor *own = y ? epj_mul_scalar(ctx, y, 1.0) : NULL;
	epj_tensor_free(y);
	y = own;
	epj_no_grad_exit(ctx, prev);
	tu_ok(ctx, y);
	ej_node *n = ej_node_custom(ctx, "exchange", in, n_in, &y, 1, exch_bw,
				    calloc(1, sizeof(exch)), exch_free);
	ck_assert_ptr_nonnull(n);
	n->custom_finish = exch_finish;
	return y;
}

static epj_status mark_bw(epj_ctx *ctx, ej_node *n, epj_tensor *const *g,
			  epj_tensor **gin)
{
	(void)ctx;
	ev_add(n->bw_comm_free ? 'I' : 'S');
	gin[0] = epj_tensor_ref(g[0]);
	return EPJ_OK;
}

/* x itself (a new tensor) behind a custom node that logs I or S. */
static epj_tensor *mark(epj_ctx *ctx, epj_tensor *x, bool comm_free)
{
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *y = epj_mul_scalar(ctx, x, 1.0);
	epj_no_grad_exit(ctx, prev);
	tu_ok(ctx, y);
	ej_node *n =
	    ej_node_custom(ctx, "mark", &x, 1, &y, 1, mark_bw, NULL, NULL);
	ck_assert_ptr_nonnull(n);
	n->bw_comm_free = comm_free;
	return y;
}

/* loss = sum(b) + sum(e) (the engine, depth first, takes e's path first);
 * returns x.grad as doubles. */
static double *grad_of(epj_ctx *ctx, epj_tensor *x, epj_tensor *e,
		       epj_tensor *b)
{
	epj_tensor *se = epj_sum_all(ctx, e), *sb = epj_sum_all(ctx, b);
	epj_tensor *loss = epj_add(ctx, sb, se);
	tu_ok(ctx, loss);
	nev = 0;
	ev[0] = 0;
	ck_assert_int_eq(epj_backward(ctx, loss, NULL), EPJ_OK);
	int64_t n = epj_tensor_numel(x);
	double *g = malloc(sizeof *g * (size_t)n);
	ck_assert_ptr_nonnull(x->grad);
	ck_assert_int_eq(epj_tensor_to_f64(ctx, x->grad, g), EPJ_OK);
	epj_tensor_free(x->grad);
	x->grad = NULL;
	epj_tensor *fr[] = { se, sb, loss, e, b };
	for (size_t i = 0; i < 5; i++)
		epj_tensor_free(fr[i]);
	return g;
}

/* The engine leaves an exchange's gradient in flight and runs the ready
 * nodes that do not read it meanwhile: a comm-free custom node runs
 * before the finish, any other custom node after it; adding another
 * gradient to the one in flight, the exchange adding its own twice, or
 * handing it to a leaf waits for it; every exchange finishes once, and
 * the gradients are exact. */
START_TEST(test_exchange_in_flight)
{
	epj_ctx *ctx = tu_ctx();
	int64_t n = tu_randint(2, 9);
	epj_tensor *x = leaf(ctx, n);
	double *xv = malloc(sizeof *xv * (size_t)n);
	ck_assert_int_eq(epj_tensor_to_f64(ctx, x, xv), EPJ_OK);
	for (int c = 0; c < 5; c++) {
		epj_tensor *a = epj_mul_scalar(ctx, x, 2.0);
		epj_tensor *xx = epj_mul(ctx, x, x);
		epj_tensor *e = NULL, *b = NULL, *in2[2] = { a, a };
		const char *want = NULL;
		switch (c) {
		case 0: /* independent comm-free work while it travels */
		case 1: /* a custom node that may communicate waits */
			e = exchange(ctx, &a, 1);
			b = mark(ctx, xx, c == 0);
			want = c == 0 ? "EIF" : "EFS";
			break;
		case 2: /* another gradient added to the one in flight */
			e = exchange(ctx, &a, 1);
			b = epj_mul(ctx, a, a);
			want = "EF";
			break;
		case 3: /* the exchange adds its two gradients of a */
			e = exchange(ctx, in2, 2);
			b = epj_mul_scalar(ctx, xx, 0.0);
			want = "EF";
			break;
		default: /* to a leaf */
			e = exchange(ctx, &x, 1);
			b = epj_mul_scalar(ctx, xx, 0.0);
			want = "EF";
		}
		double *g = grad_of(ctx, x, e, b);
		ck_assert_msg(!strcmp(ev, want), "case %d: events %s, want %s",
			      c, ev, want);
		for (int64_t i = 0; i < n; i++) {
			double w = c < 2    ? 6 + 2 * xv[i]
				   : c == 2 ? 6 + 8 * xv[i]
				   : c == 3 ? 12
					    : 3;
			ck_assert_msg(fabs(g[i] - w) <= 1e-12 * (1 + fabs(w)),
				      "case %d: grad[%lld] %g want %g", c,
				      (long long)i, g[i], w);
		}
		free(g);
		epj_tensor_free(a);
		epj_tensor_free(xx);
	}
	free(xv);
	epj_tensor_free(x);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_autograd_suite(void)
{
	Suite *s = suite_create("autograd");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_fanout);
	tcase_add_test(tc, test_accumulate);
	tcase_add_test(tc, test_no_grad_and_detach);
	tcase_add_test(tc, test_retain_grad);
	tcase_add_test(tc, test_saved_released);
	tcase_add_test(tc, test_errors);
	tcase_add_test(tc, test_unused_output);
	tcase_add_test(tc, test_leaf_root_and_broadcast);
	tcase_add_test(tc, test_launch_counter);
	tcase_add_test(tc, test_grad_adopted_or_copied);
	tcase_add_test(tc, test_dispatch_into);
	tcase_add_test(tc, test_exchange_in_flight);
	suite_add_tcase(s, tc);
	return s;
}
