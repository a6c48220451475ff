/* check_parity.c -- the parity matrix of the region compiler: nested and
 * root layouts x activation checkpointing off/on x f32/bf16 x regional and
 * full-model compile, each through the library harness (epj_parity_run),
 * which compares outputs, loss, gradients by group and by parameter, FP32
 * master updates, the routing of every AutoEP call (replays included),
 * eager AutoEP call counts of both arms and compile-counter stability on a
 * measured batch other than the warm-up's.
 *
 * The harness's comparison functions (runtime_impl.h) are fed known-bad
 * signals -- a difference just past tolerance, a tensor missing, a reversed
 * sign, one parameter off among exact ones, a routing call missing or out
 * of order -- and must reject each; and a compiled kernel made wrong on
 * purpose (ej_compile_test_perturb: every compiled region's outputs 0.1%
 * off in f32, 5% off in bf16) must fail the whole run. */
#include "check_util.h"
#include "runtime_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* compile.c's test hook (in no header): compiled outputs x (1 + rel) */
extern void ej_compile_test_perturb(double rel);
/* parity.c's: arm 1 (eager) or 2 (compiled) makes one AutoEP call more */
extern void ej_parity_test_extra_call(int arm);

/* The table of one run (malloc'ed; caller frees), *passed its verdict. */
static char *run_table(const epj_parity_opts *o, bool *passed)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *out = open_memstream(&buf, &len);
	ck_assert_ptr_nonnull(out);
	epj_status st = epj_parity_run(o, out, passed);
	fclose(out);
	ck_assert_msg(st == EPJ_OK, "parity could not run: %s\n%s",
		      epj_status_name(st), buf ? buf : "");
	return buf;
}

/* The line of `row` in the table (a pointer into buf), NULL if none. */
static const char *table_row(const char *buf, const char *row)
{
	char key[64];
	snprintf(key, sizeof key, "  %s ", row);
	return strstr(buf, key);
}

static void run_case(epj_layout layout, bool ckpt, bool bf16, bool regional,
		     bool async_plan, const char *backend)
{
	epj_parity_opts o = { .backend = backend,
			      .layout = layout,
			      .checkpointing = ckpt,
			      .bf16 = bf16,
			      .regional = regional,
			      .async_split_plan = async_plan,
			      .batch = tu_randint(1, 4),
			      .seq = tu_randint(3, 12),
			      .seed = tu_seed() };
	char *buf = NULL;
	size_t len = 0;
	FILE *out = open_memstream(&buf, &len);
	ck_assert_ptr_nonnull(out);
	bool passed = false;
	epj_status st = epj_parity_run(&o, out, &passed);
	fclose(out);
	ck_assert_msg(
	    st == EPJ_OK && passed, "parity %s/%s/%s/%s/%s: status %s\n%s",
	    layout == EPJ_LAYOUT_ROOT ? "root" : "nested",
	    ckpt ? "ckpt" : "no-ckpt", bf16 ? "bf16" : "f32",
	    regional ? "regional" : "full-model", backend ? backend : "default",
	    epj_status_name(st), buf ? buf : "");
	/* the table must report every quantity */
	const char *rows[] = { "logits",
			       "loss",
			       "input grad",
			       "router grads",
			       "expert grads",
			       "dense grads",
			       "fp32 master update",
			       "routing mismatches",
			       "AutoEP calls eager",
			       "AutoEP calls compiled",
			       "measured batch differs",
			       "d stats.unique_graphs",
			       "d recompiles",
			       "update=-grad eager",
			       "update=-grad compiled",
			       "regions ran compiled",
			       "eager arm compiled" };
	for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
		ck_assert_msg(table_row(buf, rows[i]) != NULL,
			      "missing row %s:\n%s", rows[i], buf);
	/* the tiny model has AutoEP layers: no category may be n/a */
	ck_assert_msg(strstr(buf, "n/a") == NULL, "a category is empty:\n%s",
		      buf);
	/* the header names where it ran */
	const char *dev = getenv("EPJIT_DEVICE");
	char head[160];
	if (dev && dev[0] && strcmp(dev, "cpu") != 0) {
		free(buf);
		return; /* the header's device and backend are another's */
	}
	snprintf(head, sizeof head,
		 "parity: device cpu, backend %s, dtype %s, world size 1 "
		 "(EP 1, ZeRO 1), layout %s\n",
		 backend ? backend : "c", bf16 ? "bf16" : "f32",
		 layout == EPJ_LAYOUT_ROOT ? "root" : "nested");
	ck_assert_msg(strstr(buf, head) != NULL, "no header \"%s\":\n%s", head,
		      buf);
	free(buf);
}

START_TEST(test_matrix)
{
	/* _i encodes layout, checkpointing, dtype, mode */
	int i = _i;
	run_case(i & 1 ? EPJ_LAYOUT_ROOT : EPJ_LAYOUT_NESTED, i & 2, i & 4,
		 !(i & 8), false, NULL);
}
END_TEST

START_TEST(test_async_split_plan)
{
	run_case(EPJ_LAYOUT_NESTED, true, true, true, true, NULL);
}
END_TEST

/* The matrix above runs the default backend (generated C on the cpu); the
 * interpreter backend must agree too. */
START_TEST(test_interpreter)
{
	int i = _i;
	run_case(i & 1 ? EPJ_LAYOUT_ROOT : EPJ_LAYOUT_NESTED, i & 2, i & 4,
		 true, false, "interpreter");
}
END_TEST

/* ---- the comparison functions against known-bad signals ---------------- */

/* n random f32 tensors of odd sizes, with non-trivial values */
static epj_tensor **rand_params(epj_ctx *ctx, int n, double scale)
{
	epj_tensor **p = calloc((size_t)n, sizeof *p);
	ck_assert_ptr_nonnull(p);
	for (int i = 0; i < n; i++) {
		int64_t shape[2] = { tu_randint(1, 6), tu_randint(1, 40) };
		epj_tensor *r = tu_randn(ctx, EPJ_DTYPE_F32, 2, shape);
		p[i] = epj_mul_scalar(ctx, r, scale);
		epj_tensor_free(r);
		ck_assert_ptr_nonnull(p[i]);
	}
	return p;
}

static epj_tensor *scaled(epj_ctx *ctx, epj_tensor *t, double s)
{
	epj_tensor *r = epj_mul_scalar(ctx, t, s);
	ck_assert_ptr_nonnull(r);
	return r;
}

/* got[i] = ref[i] * (i == which or which < 0 ? s : 1), compared under tol */
static ej_parity_diff compare_scaled(epj_ctx *ctx, epj_tensor **ref, int n,
				     int which, double s,
				     const ej_parity_tol *tol)
{
	ej_parity_diff d = { 0 };
	for (int i = 0; i < n; i++) {
		epj_tensor *g =
		    scaled(ctx, ref[i], which < 0 || i == which ? s : 1.0);
		ej_parity_diff_add(ctx, &d, i, g, ref[i], tol);
		epj_tensor_free(g);
	}
	return d;
}

START_TEST(test_compare_rejects)
{
	/* _i: the quantity, bf16 or f32 */
	ej_parity_qty q = (ej_parity_qty)(_i % 4);
	bool bf16 = _i >= 4;
	ej_parity_tol tol = ej_parity_tolerance(q, bf16);
	epj_ctx *ctx = tu_ctx();
	int n = (int)tu_randint(3, 9);
	/* values well above atol, so that rtol and rel L2 decide */
	epj_tensor **ref = rand_params(ctx, n, 100 * tol.atol / tol.rtol);
	/* exact, and within tolerance (a tenth of rtol), pass */
	ej_parity_diff d = compare_scaled(ctx, ref, n, -1, 1.0, &tol);
	ck_assert_msg(ej_parity_diff_ok(&d) && d.max_abs == 0 &&
			  d.n_tensors == n,
		      "exact copies rejected");
	d = compare_scaled(ctx, ref, n, -1, 1 + tol.rtol / 10, &tol);
	ck_assert_msg(ej_parity_diff_ok(&d), "a tenth of rtol rejected");
	/* a difference past the tolerance (3 x rtol and 2 x rel L2 at
	 * once, the larger), on every tensor and on one of them only */
	double off = fmax(3 * tol.rtol, 2 * tol.rel_l2);
	d = compare_scaled(ctx, ref, n, -1, 1 + off, &tol);
	ck_assert_msg(!ej_parity_diff_ok(&d) && d.n_bad == n,
		      "%g off accepted (%d bad)", off, d.n_bad);
	int one = (int)tu_randint(0, n);
	d = compare_scaled(ctx, ref, n, one, 1 + off, &tol);
	ck_assert_msg(!ej_parity_diff_ok(&d) && d.n_bad == 1 &&
			  d.first_bad == one + 1,
		      "one parameter off: %d bad, first %d, want %d", d.n_bad,
		      d.first_bad, one + 1);
	/* a signal far too small, and a reversed one */
	d = compare_scaled(ctx, ref, n, -1, 1e-3, &tol);
	ck_assert_msg(!ej_parity_diff_ok(&d), "a 1000x smaller signal passed");
	d = compare_scaled(ctx, ref, n, -1, -1.0, &tol);
	ck_assert_msg(!ej_parity_diff_ok(&d) && d.n_bad == n,
		      "a reversed signal passed");
	/* missing on one side, either side */
	d = (ej_parity_diff){ 0 };
	for (int i = 0; i < n; i++)
		ej_parity_diff_add(ctx, &d, i, i == one ? NULL : ref[i], ref[i],
				   &tol);
	ck_assert_msg(!ej_parity_diff_ok(&d) && d.first_bad == one + 1,
		      "a missing tensor passed");
	d = (ej_parity_diff){ 0 };
	ej_parity_diff_add(ctx, &d, 0, ref[0], NULL, &tol);
	ck_assert(!ej_parity_diff_ok(&d));
	/* nothing compared: an empty category fails */
	d = (ej_parity_diff){ 0 };
	ej_parity_diff_add(ctx, &d, 0, NULL, NULL, &tol);
	ck_assert_msg(!ej_parity_diff_ok(&d) && d.n_tensors == 0,
		      "an empty list passed");
	/* another size, and a NaN where the reference has a number */
	epj_tensor *other = tu_randn(
	    ctx, EPJ_DTYPE_F32, 1, (int64_t[]){ epj_tensor_numel(ref[0]) + 1 });
	d = (ej_parity_diff){ 0 };
	ej_parity_diff_add(ctx, &d, 0, other, ref[0], &tol);
	ck_assert(!ej_parity_diff_ok(&d));
	epj_tensor *nan = scaled(ctx, ref[0], NAN);
	d = (ej_parity_diff){ 0 };
	ej_parity_diff_add(ctx, &d, 0, nan, ref[0], &tol);
	ck_assert_msg(!ej_parity_diff_ok(&d), "NaN passed");
	/* near zero, the absolute tolerance decides: an error of atol / 2
	 * on values of atol / 100 passes elementwise but not in rel L2 */
	epj_tensor *tiny = scaled(ctx, ref[0], 0);
	epj_tensor *err = tu_randn(ctx, EPJ_DTYPE_F32, epj_tensor_ndim(tiny),
				   epj_tensor_shape(tiny));
	epj_tensor *small = scaled(ctx, err, 0);
	double *v = tu_values(ctx, err);
	int64_t k = epj_tensor_numel(err);
	for (int64_t j = 0; j < k; j++)
		v[j] = tol.atol / 100 * (v[j] >= 0 ? 1 : -1);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, small, v), EPJ_OK);
	for (int64_t j = 0; j < k; j++)
		v[j] *= -1; /* the reversed tiny signal */
	ck_assert_int_eq(epj_tensor_from_f64(ctx, tiny, v), EPJ_OK);
	d = (ej_parity_diff){ 0 };
	ej_parity_diff_add(ctx, &d, 0, tiny, small, &tol);
	ck_assert_msg(!ej_parity_diff_ok(&d) && d.max_abs <= tol.atol,
		      "a reversed signal below atol passed (rel L2 %g)",
		      d.worst_rel);
	free(v);
	epj_tensor_free(tiny);
	epj_tensor_free(small);
	epj_tensor_free(err);
	epj_tensor_free(nan);
	epj_tensor_free(other);
	for (int i = 0; i < n; i++)
		epj_tensor_free(ref[i]);
	free(ref);
	epj_ctx_free(ctx);
}
END_TEST

/* An element's tolerance counts the tensor's scale: in a tensor of RMS
 * about 1, a small element (0.05) off by 1.5e-6 passes in f32 (two
 * summation orders of an embedding gradient do that; it failed against an
 * absolute 1e-6 before), while the same element off by 5 rtol x RMS fails
 * even though the tensor's relative L2 distance stays tiny. */
START_TEST(test_compare_scale)
{
	epj_ctx *ctx = tu_ctx();
	bool bf16 = _i;
	ej_parity_tol tol = ej_parity_tolerance(EJ_PARITY_GRAD, bf16);
	int64_t n = 2 * tu_randint(200, 400) + 1;
	double *v = malloc(sizeof *v * (size_t)n);
	ck_assert_ptr_nonnull(v);
	for (int64_t i = 0; i < n; i++)
		v[i] = (i % 2 ? 1.0 : -1.0) * tu_uniform(0.8, 1.2);
	int64_t k = tu_randint(0, n);
	v[k] = 0.05;
	epj_tensor *ref = epj_zeros(ctx, EPJ_DTYPE_F64, 1, &n);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, ref, v), EPJ_OK);
	double rms = 0;
	for (int64_t i = 0; i < n; i++)
		rms += v[i] * v[i];
	rms = sqrt(rms / (double)n);
	const double offs[2] = { bf16 ? 1.5e-3 : 1.5e-6, 5 * tol.rtol * rms };
	for (int w = 0; w < 2; w++) {
		v[k] = 0.05 + offs[w];
		epj_tensor *got = epj_zeros(ctx, EPJ_DTYPE_F64, 1, &n);
		ck_assert_int_eq(epj_tensor_from_f64(ctx, got, v), EPJ_OK);
		ej_parity_diff d = { 0 };
		ej_parity_diff_add(ctx, &d, 0, got, ref, &tol);
		ck_assert_msg(ej_parity_diff_ok(&d) == (w == 0),
			      "element 0.05 off by %g in a tensor of RMS %g: "
			      "%s (rel L2 %g)",
			      offs[w], rms, w ? "passed" : "failed",
			      d.worst_rel);
		ck_assert(d.worst_rel <= tol.rel_l2);
		epj_tensor_free(got);
	}
	free(v);
	epj_tensor_free(ref);
	epj_ctx_free(ctx);
}
END_TEST

/* The bf16 tolerances are DeepSpeed's AutoEP GPU suite's, quantity by quantity.
 */
START_TEST(test_tolerances)
{
	const double want[4][3] = { { 2e-2, 5e-3, 5e-2 },
				    { 2e-3, 5e-3, 5e-2 },
				    { 5e-3, 5e-3, 5e-2 },
				    { 5e-5, 5e-3, 5e-2 } };
	for (int q = 0; q < 4; q++) {
		ej_parity_tol b = ej_parity_tolerance(q, true);
		ej_parity_tol f = ej_parity_tolerance(q, false);
		ck_assert(b.atol == want[q][0] && b.rtol == want[q][1] &&
			  b.rel_l2 == want[q][2]);
		/* f32 never looser */
		ck_assert(f.atol <= b.atol && f.rtol <= b.rtol &&
			  f.rel_l2 <= b.rel_l2);
	}
}
END_TEST

static epj_tensor *assignment(epj_ctx *ctx, int64_t n, int64_t k, int E)
{
	int64_t shape[2] = { n, k };
	epj_tensor *t = epj_zeros(ctx, EPJ_DTYPE_I64, 2, shape);
	ck_assert_ptr_nonnull(t);
	double *v = malloc(sizeof *v * (size_t)(n * k));
	for (int64_t i = 0; i < n * k; i++)
		v[i] = (double)tu_randint(0, E);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, t, v), EPJ_OK);
	free(v);
	return t;
}

START_TEST(test_routes_rejects)
{
	epj_ctx *ctx = tu_ctx();
	/* 2 layers x (forward, replay), different assignments per call */
	const char *layers[2] = { "model.layers.0.mlp", "model.layers.1.mlp" };
	int64_t N = tu_randint(3, 17), K = 2;
	ej_parity_route ref[4], got[4];
	epj_tensor *a[4];
	for (int i = 0; i < 4; i++) {
		do {
			a[i] = assignment(ctx, N, K, 8);
			/* the replay's assignment must differ from the
			 * forward's for the reorder case to mean anything */
			if (i % 2 == 0)
				break;
			int64_t same = 0;
			for (int64_t j = 0; j < N * K; j++)
				same += epj_tensor_get_f64(a[i], j) ==
					epj_tensor_get_f64(a[i - 1], j);
			if (same < N * K)
				break;
			epj_tensor_free(a[i]);
		} while (1);
		ref[i] = (ej_parity_route){ .layer = layers[i / 2],
					    .call = i % 2,
					    .replay = i % 2,
					    .assign = a[i] };
		got[i] = ref[i];
	}
	int64_t mism = -1, total = -1;
	ej_parity_routes_compare(got, 4, ref, 4, &mism, &total);
	ck_assert_int_eq(mism, 0);
	ck_assert_int_eq(total, 4 * N * K);
	/* the replay missing (a harness that saw the last call only would
	 * compare half of them) */
	ej_parity_routes_compare(got, 3, ref, 4, &mism, &total);
	ck_assert_msg(mism >= N * K, "a missing replay: %lld", (long long)mism);
	/* a call the reference never made */
	ej_parity_routes_compare(got, 4, ref, 3, &mism, &total);
	ck_assert_msg(mism >= N * K, "an extra call: %lld", (long long)mism);
	/* forward and replay reversed */
	got[0].assign = a[1];
	got[1].assign = a[0];
	ej_parity_routes_compare(got, 4, ref, 4, &mism, &total);
	ck_assert_msg(mism > 0, "reversed calls passed");
	got[0] = ref[0];
	got[1] = ref[1];
	/* a replay reported as a forward */
	got[3].replay = false;
	ej_parity_routes_compare(got, 4, ref, 4, &mism, &total);
	ck_assert_msg(mism >= N * K, "a replay seen as a forward passed");
	got[3] = ref[3];
	/* one expert of one token in one call */
	epj_tensor *b = epj_zeros(ctx, EPJ_DTYPE_I64, 2, (int64_t[]){ N, K });
	double *v = tu_values(ctx, a[2]);
	int64_t at = tu_randint(0, N * K);
	v[at] = fmod(v[at] + 1, 8);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, b, v), EPJ_OK);
	got[2].assign = b;
	ej_parity_routes_compare(got, 4, ref, 4, &mism, &total);
	ck_assert_int_eq(mism, 1);
	free(v);
	epj_tensor_free(b);
	for (int i = 0; i < 4; i++)
		epj_tensor_free(a[i]);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_update_rejects)
{
	epj_ctx *ctx = tu_ctx();
	int n = (int)tu_randint(2, 7);
	epj_tensor **g = rand_params(ctx, n, 1e-2);
	epj_tensor **u = calloc((size_t)n, sizeof *u);
	double rms, rel;
	int64_t cnt;
	/* each row: scale of the update against -grad, world, passes? */
	const struct {
		double s;
		int world;
		bool ok;
	} rows[] = { { 1.0, 1, true },	 { 1.0 + 1e-3, 1, true },
		     { 0.5, 1, false },	 { 1e-3, 1, false },
		     { 0.0, 1, false },	 { -1.0, 1, false },
		     { 1.0, 2, true },	 { 0.5, 2, true },
		     { 1e-3, 2, false }, { 0.0, 2, false } };
	for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
		for (int i = 0; i < n; i++)
			u[i] = scaled(ctx, g[i], -rows[r].s);
		bool ok = ej_parity_update_follows(g, u, n, rows[r].world, &rms,
						   &rel, &cnt);
		ck_assert_msg(ok == rows[r].ok,
			      "update = %g x -grad at world %d: %s (rel %g)",
			      rows[r].s, rows[r].world,
			      ok ? "passed" : "failed", rel);
		for (int i = 0; i < n; i++)
			epj_tensor_free(u[i]);
	}
	/* an update missing where a gradient exists */
	for (int i = 0; i < n; i++)
		u[i] = i ? scaled(ctx, g[i], -1) : NULL;
	ck_assert(!ej_parity_update_follows(g, u, n, 1, &rms, &rel, &cnt));
	for (int i = 0; i < n; i++)
		epj_tensor_free(u[i]);
	/* no gradient at all: nothing was checked */
	epj_tensor **none = calloc((size_t)n, sizeof *none);
	ck_assert(
	    !ej_parity_update_follows(none, none, n, 1, &rms, &rel, &cnt));
	free(none);
	for (int i = 0; i < n; i++)
		epj_tensor_free(g[i]);
	free(g);
	free(u);
	epj_ctx_free(ctx);
}
END_TEST

/* A compiled kernel that is wrong on purpose fails the run: every
 * compiled region's outputs 0.1% off in f32, 5% off in bf16. */
START_TEST(test_perturbed_kernel)
{
	bool bf16 = _i & 1;
	epj_parity_opts o = { .layout =
				  _i & 2 ? EPJ_LAYOUT_ROOT : EPJ_LAYOUT_NESTED,
			      .checkpointing = _i & 2,
			      .bf16 = bf16,
			      .regional = true,
			      .batch = tu_randint(1, 4),
			      .seq = tu_randint(3, 12),
			      .seed = tu_seed() };
	bool passed = true;
	ej_compile_test_perturb(bf16 ? 5e-2 : 1e-3);
	char *buf = run_table(&o, &passed);
	ej_compile_test_perturb(0);
	ck_assert_msg(!passed, "a %s kernel off by %s passed:\n%s",
		      bf16 ? "bf16" : "f32", bf16 ? "5%" : "0.1%", buf);
	/* f32: the logits themselves fail.  bf16: the final norm takes out
	 * most of a uniform scale of the last region's output and bf16's
	 * atol is 2e-2, so the logits may pass; the gradients and master
	 * updates of the parameters behind a wrong region may not */
	const char *rows[] = { "logits",       "input grad",
			       "router grads", "expert grads",
			       "dense grads",  "fp32 master update" };
	int failed = 0;
	for (int i = 0; i < 6; i++) {
		const char *row = table_row(buf, rows[i]);
		const char *nl = row ? strchr(row, '\n') : NULL;
		const char *fail = row ? strstr(row, "FAIL") : NULL;
		failed += fail && fail < nl;
		if (i == 0 && !bf16)
			ck_assert_msg(fail && fail < nl,
				      "the logits row did not fail:\n%s", buf);
	}
	ck_assert_msg(failed > 0, "no quantity failed:\n%s", buf);
	ck_assert(strstr(buf, "parity: FAIL\n") != NULL);
	free(buf);
	/* unperturbed, the same case passes */
	buf = run_table(&o, &passed);
	ck_assert_msg(passed, "unperturbed:\n%s", buf);
	free(buf);
}
END_TEST

/* One AutoEP call too many in either arm's measured window (outside the
 * routing log) fails that arm's call count, and that alone fails the run. */
START_TEST(test_extra_autoep_call)
{
	int which = 1 + _i % 2; /* 1: eager arm, 2: compiled arm */
	epj_parity_opts o = { .layout =
				  _i & 2 ? EPJ_LAYOUT_ROOT : EPJ_LAYOUT_NESTED,
			      .checkpointing = _i & 2,
			      .regional = true,
			      .batch = tu_randint(1, 4),
			      .seq = tu_randint(3, 12),
			      .seed = tu_seed() };
	bool passed = true;
	ej_parity_test_extra_call(which);
	char *buf = run_table(&o, &passed);
	ej_parity_test_extra_call(0);
	ck_assert_msg(!passed, "an extra AutoEP call passed:\n%s", buf);
	const char *rows[2] = { "AutoEP calls eager", "AutoEP calls compiled" };
	for (int k = 0; k < 2; k++) {
		const char *row = table_row(buf, rows[k]);
		ck_assert_msg(row != NULL, "no row %s:\n%s", rows[k], buf);
		const char *nl = strchr(row, '\n');
		const char *fail = strstr(row, "FAIL");
		bool failed = fail && fail < nl;
		ck_assert_msg(failed == (k + 1 == which),
			      "row %s %s with the extra call in the %s "
			      "arm:\n%s",
			      rows[k], failed ? "failed" : "passed",
			      which == 1 ? "eager" : "compiled", buf);
	}
	/* the routing never saw the extra call: the count alone fails */
	const char *row = table_row(buf, "routing mismatches");
	ck_assert_msg(row && strstr(row, " ok\n") &&
			  strstr(row, " ok\n") < strchr(row, '\n'),
		      "%s", buf);
	free(buf);
}
END_TEST

/* With checkpointing the routing row compares the replays too: twice the
 * assignments of the same run without. */
START_TEST(test_routing_counts_replays)
{
	epj_parity_opts o = { .layout =
				  _i ? EPJ_LAYOUT_ROOT : EPJ_LAYOUT_NESTED,
			      .regional = true,
			      .batch = tu_randint(1, 4),
			      .seq = tu_randint(3, 12),
			      .seed = tu_seed() };
	long long n[2], calls[2];
	for (int ck = 0; ck < 2; ck++) {
		o.checkpointing = ck;
		bool passed = false;
		char *buf = run_table(&o, &passed);
		ck_assert_msg(passed, "%s", buf);
		const char *row = table_row(buf, "routing mismatches");
		long long mism = -1;
		ck_assert_msg(row && sscanf(row,
					    " routing mismatches %lld "
					    "%lld %lld",
					    &mism, &calls[ck], &n[ck]) == 3,
			      "%s", buf);
		ck_assert_int_eq(mism, 0);
		free(buf);
	}
	/* tokens x top_k x layers without; x 2 with the replays */
	ck_assert_msg(n[0] > 0 && n[1] == 2 * n[0] && calls[1] == 2 * calls[0],
		      "routes without / with checkpointing: %lld / %lld "
		      "(calls %lld / %lld)",
		      n[0], n[1], calls[0], calls[1]);
}
END_TEST

/* A model without AutoEP layers: the router, expert and routing rows are
 * n/a, never "0 ok", and everything else is still compared. */
START_TEST(test_dense_model)
{
	char path[] = "/tmp/epjit-parity-dense-XXXXXX";
	int fd = mkstemp(path);
	ck_assert_int_ge(fd, 0);
	FILE *f = fdopen(fd, "w");
	fputs("{\"architectures\": [\"Qwen3MoeForCausalLM\"],"
	      " \"model_type\": \"qwen3_moe\", \"vocab_size\": 64,"
	      " \"hidden_size\": 16, \"num_hidden_layers\": 1,"
	      " \"num_attention_heads\": 2, \"num_key_value_heads\": 1,"
	      " \"head_dim\": 8, \"intermediate_size\": 24,"
	      " \"num_experts\": 0, \"rms_norm_eps\": 1e-06,"
	      " \"max_position_embeddings\": 64,"
	      " \"initializer_range\": 0.02,"
	      " \"tie_word_embeddings\": false}",
	      f);
	fclose(f);
	epj_parity_opts o = { .model_config = path,
			      .layout = EPJ_LAYOUT_NESTED,
			      .regional = false,
			      .batch = 2,
			      .seq = tu_randint(3, 9),
			      .seed = tu_seed() };
	bool passed = false;
	char *buf = run_table(&o, &passed);
	unlink(path);
	ck_assert_msg(passed, "%s", buf);
	const char *na[] = { "router grads", "expert grads",
			     "routing mismatches" };
	for (int i = 0; i < 3; i++) {
		const char *row = table_row(buf, na[i]);
		ck_assert_msg(row && strstr(row, "n/a") &&
				  strstr(row, "n/a") < strchr(row, '\n'),
			      "%s is not n/a:\n%s", na[i], buf);
	}
	const char *row = table_row(buf, "dense grads");
	ck_assert_msg(row && strstr(row, " ok\n") &&
			  strstr(row, " ok\n") < strchr(row, '\n') + 1,
		      "%s", buf);
	free(buf);
}
END_TEST

/* Seed 174's synthetic stream repeats its first 7 tokens in the next 7 (the
 * chain sits in a state whose likeliest successor is itself): parity must
 * still measure on a batch unlike the warm-up's. */
START_TEST(test_repeating_stream)
{
	epj_ctx *ctx = tu_ctx();
	epj_corpus *c = epj_corpus_synthetic(ctx, 64, 174 + 17);
	ck_assert_ptr_nonnull(c);
	epj_tensor *a, *la, *b, *lb;
	ck_assert_int_eq(epj_corpus_next_batch(ctx, c, 1, 7, &a, &la), EPJ_OK);
	ck_assert_int_eq(epj_corpus_next_batch(ctx, c, 1, 7, &b, &lb), EPJ_OK);
	for (int k = 0; k < 7; k++) /* the premise of this test */
		ck_assert(epj_tensor_get_f64(a, k) == epj_tensor_get_f64(b, k));
	epj_tensor_free(a);
	epj_tensor_free(la);
	epj_tensor_free(b);
	epj_tensor_free(lb);
	epj_corpus_free(c);
	epj_ctx_free(ctx);
	epj_parity_opts o = { .layout = EPJ_LAYOUT_ROOT,
			      .regional = true,
			      .batch = 1,
			      .seq = 7,
			      .seed = 174 };
	bool passed = false;
	char *buf = run_table(&o, &passed);
	const char *row = table_row(buf, "measured batch differs");
	ck_assert_msg(passed && row && strstr(row, " ok\n") &&
			  strstr(row, " ok\n") < strchr(row, '\n'),
		      "%s", buf);
	free(buf);
}
END_TEST

Suite *make_parity_suite(void)
{
	Suite *s = suite_create("parity");
	TCase *tc = tcase_create("matrix");
	tcase_set_timeout(tc, 120);
	tcase_add_loop_test(tc, test_matrix, 0, 16);
	tcase_add_test(tc, test_async_split_plan);
	tcase_add_loop_test(tc, test_interpreter, 0, 8);
	suite_add_tcase(s, tc);
	TCase *self = tcase_create("self-test");
	tcase_set_timeout(self, 120);
	tcase_add_loop_test(self, test_compare_rejects, 0, 8);
	tcase_add_test(self, test_tolerances);
	tcase_add_loop_test(self, test_compare_scale, 0, 2);
	tcase_add_test(self, test_routes_rejects);
	tcase_add_test(self, test_update_rejects);
	tcase_add_loop_test(self, test_perturbed_kernel, 0, 4);
	tcase_add_loop_test(self, test_routing_counts_replays, 0, 2);
	tcase_add_loop_test(self, test_extra_autoep_call, 0, 4);
	tcase_add_test(self, test_dense_model);
	tcase_add_test(self, test_repeating_stream);
	suite_add_tcase(s, self);
	return s;
}
