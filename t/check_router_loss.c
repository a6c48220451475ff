/* check_router_loss.c -- the router losses (runtime/router_loss.c):
 * transformers' auxiliary loss, Megatron's aux_loss, seq_aux_loss,
 * global_aux_loss and z-loss.
 *
 *  - values: random f64 router logits of 2 or 3 layers, softmax and
 *    sigmoid routers, several sequences; each loss (alone, and all
 *    together) against a reference written here from the definitions
 *    (transformers' load_balancing_loss_func, Megatron's
 *    switch_load_balancing_loss_func, its per-sequence and global callers
 *    and z_loss_func), the global one over two micro-batches (the running
 *    average of the counts) and after the step's reset; the step's metrics
 *    (the mean over the micro-batches);
 *  - Megatron's own values: the losses of t/golden/megatron/ (Megatron
 *    Core's functions run by t/golden/megatron_make.py) on its logits;
 *  - gradients: the gradient the losses' node adds to the logits against
 *    central differences of the losses' value (f64, step 1e-5), on logits
 *    drawn with every top-k clear of ties;
 *  - the model: an f64 tiny model whose router losses are on (nested and
 *    root layouts) gives the same loss and gradients with activation
 *    checkpointing as without, on two micro-batches of a step
 *    (the loss counted once, the gradient added once, by the replay), its
 *    loss exceeds the plain one by the losses' coefficients times their
 *    values, and its gate gradient matches central differences of the
 *    whole loss; evaluation adds transformers' loss and not Megatron's;
 *  - the engine refuses transformers' loss with a balancing loss of moe.*,
 *    and reports each loss as a metric of the step;
 *  - parity: eager against compiled with Megatron's losses on,
 *    checkpointing off and on, nested and root layouts, f32 and bf16.
 */
#include "check_util.h"
#include "router_loss_impl.h"
#include "runtime_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

Suite *make_router_loss_suite(void);

/* ---- the reference ------------------------------------------------------- */

typedef struct rcase {
	int L, E, k;
	int64_t B, T;
	ej_route_scoring sc;
	double coef[EJ_RLOSS_N];
} rcase;

/* The scores of transformers and Megatron (compute_routing_scores_for_
 * aux_loss): softmax, or the sigmoid normalised by its sum + 1e-20. */
static void ref_scores(const rcase *c, const double *z, double *p)
{
	const int64_t N = c->B * c->T;
	for (int64_t n = 0; n < N; n++) {
		const double *zr = z + n * c->E;
		double *pr = p + n * c->E, s = 0, mx = -INFINITY;
		for (int e = 0; e < c->E; e++)
			mx = fmax(mx, zr[e]);
		for (int e = 0; e < c->E; e++) {
			pr[e] = c->sc == EJ_SCORE_SOFTMAX
				    ? exp(zr[e] - mx)
				    : 1 / (1 + exp(-zr[e]));
			s += pr[e];
		}
		for (int e = 0; e < c->E; e++)
			pr[e] /= c->sc == EJ_SCORE_SOFTMAX ? s : s + 1e-20;
	}
}

/* counts[b][e]: tokens of sequence b whose top k of p take e. */
static void ref_counts(const rcase *c, const double *p, double *cnt)
{
	const int E = c->E;
	memset(cnt, 0, sizeof *cnt * (size_t)(c->B * E));
	for (int64_t n = 0; n < c->B * c->T; n++) {
		bool taken[64] = { false };
		for (int j = 0; j < c->k; j++) {
			int best = -1;
			for (int e = 0; e < E; e++)
				if (!taken[e] &&
				    (best < 0 ||
				     p[n * E + e] > p[n * E + best]))
					best = e;
			taken[best] = true;
			cnt[(n / c->T) * E + best] += 1;
		}
	}
}

/* The values of one forward (v by kind; Megatron's: the mean over the
 * layers) and the objective (sum of coef x loss, Megatron's summed over the
 * layers); ga[l][e] the global counts of the step's earlier micro-batches
 * (ga_n of them), updated. */
static double ref_forward(const rcase *c, double *const *z, double *ga,
			  int *ga_n, double v[EJ_RLOSS_N])
{
	const int E = c->E, k = c->k, L = c->L;
	const int64_t B = c->B, T = c->T, N = B * T;
	double *p = malloc(sizeof *p * (size_t)(N * E));
	double *cnt = malloc(sizeof *cnt * (size_t)(B * E));
	double C[64] = { 0 }, S[64] = { 0 }, obj = 0;
	memset(v, 0, sizeof(double) * EJ_RLOSS_N);
	for (int l = 0; l < L; l++) {
		ref_scores(c, z[l], p);
		ref_counts(c, p, cnt);
		double aux = 0, seq = 0, glob = 0, zl = 0;
		for (int e = 0; e < E; e++) {
			double ce = 0, pe = 0;
			for (int64_t b = 0; b < B; b++) {
				double pb = 0;
				for (int64_t t = 0; t < T; t++)
					pb += p[(b * T + t) * E + e];
				ce += cnt[b * E + e];
				pe += pb;
				/* seq_aux_loss: columns (b, e), T tokens */
				seq += E * pb * cnt[b * E + e] /
				       (k * (double)T * T) / B;
			}
			C[e] += ce;
			S[e] += pe;
			aux += E * pe * ce / (k * (double)N * N);
			ga[l * E + e] += ce;
			glob += E * pe * (ga[l * E + e] / (ga_n[l] + 1)) /
				(k * (double)N * N);
		}
		ga_n[l]++;
		for (int64_t n = 0; n < N; n++) {
			double mx = -INFINITY, s = 0;
			for (int e = 0; e < E; e++)
				mx = fmax(mx, z[l][n * E + e]);
			for (int e = 0; e < E; e++)
				s += exp(z[l][n * E + e] - mx);
			zl += pow(mx + log(s), 2) / N;
		}
		const double per[EJ_RLOSS_N] = { 0, aux, seq, glob, zl };
		for (int i = EJ_RLOSS_AUX; i < EJ_RLOSS_N; i++) {
			v[i] += per[i] / L;
			obj += c->coef[i] * per[i];
		}
	}
	double hf = 0;
	for (int e = 0; e < E; e++)
		hf += E * C[e] * S[e] / ((double)L * N * (double)L * N);
	v[EJ_RLOSS_HF] = hf;
	obj += c->coef[EJ_RLOSS_HF] * hf;
	for (int i = 0; i < EJ_RLOSS_N; i++)
		if (c->coef[i] == 0)
			v[i] = 0;
	free(p);
	free(cnt);
	return obj;
}

/* ---- the library's forward ------------------------------------------------
 */

static ej_rloss *new_rloss(epj_ctx *ctx, const rcase *c)
{
	ej_rloss *rl =
	    ej_rloss_new(c->L, c->E, c->k, c->sc, c->coef[EJ_RLOSS_HF] != 0,
			 c->coef[EJ_RLOSS_HF]);
	ck_assert_ptr_nonnull(rl);
	struct ej_moe_config mc = { c->coef[EJ_RLOSS_AUX],
				    c->coef[EJ_RLOSS_SEQ],
				    c->coef[EJ_RLOSS_GLOBAL],
				    c->coef[EJ_RLOSS_Z] };
	ck_assert_int_eq(ej_rloss_configure(ctx, rl, &mc, NULL), EPJ_OK);
	return rl;
}

/* One forward of the layers' logits z[l] (f64 [N, E]); the objective; with
 * za, the tensors to route with (the nodes' outputs) in za[l]. */
static double lib_forward(epj_ctx *ctx, ej_rloss *rl, const rcase *c,
			  epj_tensor *const *z, epj_tensor **za)
{
	const int64_t N = c->B * c->T;
	ej_rloss_begin(rl, true);
	for (int l = 0; l < c->L; l++) {
		epj_tensor *a = NULL;
		ck_assert_int_eq(ej_rloss_attach(ctx, rl, l, z[l], c->T, &a),
				 EPJ_OK);
		if (ej_rloss_wants_choice(ctx, rl)) {
			epj_tensor *tv = NULL, *ti = NULL;
			ck_assert_int_eq(epj_topk(ctx, z[l], c->k, &tv, &ti),
					 EPJ_OK);
			double *sd = tu_values(ctx, ti);
			int64_t sel[512];
			for (int64_t i = 0; i < N * c->k; i++)
				sel[i] = (int64_t)sd[i];
			free(sd);
			ck_assert_int_eq(ej_rloss_count(ctx, rl, l, sel, N),
					 EPJ_OK);
			epj_tensor_free(tv);
			epj_tensor_free(ti);
		}
		if (za)
			za[l] = a;
		else
			epj_tensor_free(a);
	}
	double add = NAN;
	ck_assert_msg(ej_rloss_end(ctx, rl, &add) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	return add;
}

/* Logits [N, E] whose rows have well-separated values (gaps >= 0.25 in
 * each row, so neither central differences nor f64 rounding turn a
 * top-k). */
static epj_tensor *spread_logits(epj_ctx *ctx, const rcase *c, double **host)
{
	const int64_t N = c->B * c->T;
	double *v = malloc(sizeof *v * (size_t)(N * c->E));
	for (int64_t n = 0; n < N; n++) {
		int perm[64];
		for (int e = 0; e < c->E; e++)
			perm[e] = e;
		for (int e = c->E - 1; e > 0; e--) {
			int j = (int)tu_randint(0, e + 1), t = perm[e];
			perm[e] = perm[j];
			perm[j] = t;
		}
		double shift = tu_uniform(-2, 2);
		for (int e = 0; e < c->E; e++)
			v[n * c->E + e] =
			    shift + 0.6 * perm[e] + tu_uniform(-0.15, 0.15);
	}
	const int64_t sh[2] = { N, c->E };
	epj_tensor *t = epj_tensor_from_data(ctx, EPJ_DTYPE_F64, 2, sh, v);
	ck_assert_ptr_nonnull(t);
	if (host)
		*host = v;
	else
		free(v);
	return t;
}

static const char *const kind_name[EJ_RLOSS_N] = { "hf", "aux", "seq", "global",
						   "z" };

/* A case with loss `which` on (EJ_RLOSS_N: every loss that combines: all of
 * Megatron's; with hf also the z-loss), random sizes and coefficients. */
static rcase draw_case(int which, ej_route_scoring sc)
{
	rcase c = { .L = (int)tu_randint(2, 4),
		    .E = (int)tu_randint(4, 8),
		    .B = tu_randint(1, 4),
		    .T = tu_randint(2, 5),
		    .sc = sc };
	c.k = (int)tu_randint(1, c.E - 1);
	for (int i = 0; i < EJ_RLOSS_N; i++) {
		bool on = which == i ||
			  (which == EJ_RLOSS_N && i != EJ_RLOSS_HF) ||
			  (which == EJ_RLOSS_N + 1 &&
			   (i == EJ_RLOSS_HF || i == EJ_RLOSS_Z));
		c.coef[i] = on ? tu_uniform(0.05, 1.5) : 0;
	}
	return c;
}

/* ---- values against the reference ------------------------------------- */

static void values_case(int which, ej_route_scoring sc)
{
	epj_ctx *ctx = tu_ctx();
	rcase c = draw_case(which, sc);
	ej_rloss *rl = new_rloss(ctx, &c);
	epj_tensor *z[4] = { 0 };
	double *zh[4] = { 0 }, ga[4 * 64] = { 0 }, v[EJ_RLOSS_N],
	       got[EJ_RLOSS_N];
	int ga_n[4] = { 0 };
	double mean[EJ_RLOSS_N] = { 0 };
	/* two micro-batches, then a step, then a third one */
	for (int mb = 0; mb < 3; mb++) {
		if (mb == 2) {
			ck_assert_int_eq(ej_rloss_step_end(ctx, rl, NULL),
					 EPJ_OK);
			for (int i = 0; i < EJ_RLOSS_N; i++) {
				const char *nm = NULL;
				double mv = NAN;
				bool on = c.coef[i] != 0;
				/* the metrics list the losses that are on */
				int idx = 0;
				for (int j = 0; j < i; j++)
					idx += c.coef[j] != 0;
				if (!on)
					continue;
				ck_assert(ej_rloss_metric(rl, idx, &nm, &mv));
				ck_assert_msg(fabs(mv - mean[i] / 2) <=
						  1e-12 * fabs(mean[i]),
					      "%s metric %.17g, want %.17g", nm,
					      mv, mean[i] / 2);
			}
			memset(ga, 0, sizeof ga);
			memset(ga_n, 0, sizeof ga_n);
		}
		for (int l = 0; l < c.L; l++)
			z[l] = spread_logits(ctx, &c, &zh[l]);
		double want = ref_forward(&c, zh, ga, ga_n, v);
		double add = lib_forward(ctx, rl, &c, z, NULL);
		ej_rloss_values(rl, got);
		ej_rloss_accumulate(rl);
		ck_assert_msg(fabs(add - want) <= 1e-12 * fabs(want),
			      "%s %s micro-batch %d: objective %.17g, want "
			      "%.17g",
			      which < EJ_RLOSS_N ? kind_name[which] : "all",
			      sc ? "sigmoid" : "softmax", mb, add, want);
		for (int i = 0; i < EJ_RLOSS_N; i++) {
			ck_assert_msg(fabs(got[i] - v[i]) <= 1e-12 * fabs(v[i]),
				      "%s: %.17g, want %.17g", kind_name[i],
				      got[i], v[i]);
			if (mb < 2)
				mean[i] += v[i];
		}
		for (int l = 0; l < c.L; l++) {
			epj_tensor_free(z[l]);
			free(zh[l]);
		}
	}
	/* past the last loss that is on */
	int n_on = 0;
	for (int i = 0; i < EJ_RLOSS_N; i++)
		n_on += c.coef[i] != 0;
	ck_assert(!ej_rloss_metric(rl, n_on, NULL, NULL));
	ej_rloss_free(rl);
	epj_ctx_free(ctx);
}

START_TEST(test_values)
{
	/* _i: the loss (EJ_RLOSS_N: Megatron's together, + 1: hf + z) x
	 * scoring */
	int which = _i % (EJ_RLOSS_N + 2);
	ej_route_scoring sc =
	    _i / (EJ_RLOSS_N + 2) ? EJ_SCORE_SIGMOID : EJ_SCORE_SOFTMAX;
	values_case(which, sc);
}
END_TEST

/* ---- Megatron's own values -------------------------------------------------
 */

/* t/golden/megatron/router_losses.safetensors (t/golden/megatron_make.py:
 * Megatron Core's switch_load_balancing_loss_func, z_loss_func and
 * compute_routing_scores_for_aux_loss run on its logits, router.py's
 * callers followed): each loss alone, coefficient 1, over the file's two
 * micro-batches, for softmax and sigmoid routers: the objective (the sum
 * over the layers) and the value (their mean) within 1e-6 of Megatron's,
 * which computes the scores in f32. */
START_TEST(test_megatron_golden)
{
	epj_ctx *ctx = tu_ctx();
	char path[2048];
	snprintf(path, sizeof path,
		 "%s/t/golden/megatron/router_losses.safetensors", tu_srcdir());
	epj_st_file *f = NULL;
	ck_assert_msg(epj_st_open(ctx, path, &f) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	const char *about = epj_st_metadata(f, "about");
	ck_assert_msg(about && strstr(about, "k="), "%s: no k", path);
	const char *kinds[4] = { "aux_loss", "seq_aux_loss", "global_aux_loss",
				 "z_loss" };
	const char *sfs[2] = { "softmax", "sigmoid" };
	int checked = 0;
	for (int si = 0; si < 2; si++) {
		char nm[64];
		snprintf(nm, sizeof nm, "%s.logits", sfs[si]);
		epj_tensor *lg = epj_st_get(ctx, f, nm);
		ck_assert_msg(lg && epj_tensor_ndim(lg) == 5, "%s: %s", nm,
			      epj_ctx_error(ctx));
		const int64_t M = epj_tensor_dim(lg, 0);
		rcase c = { .L = (int)epj_tensor_dim(lg, 1),
			    .B = epj_tensor_dim(lg, 2),
			    .T = epj_tensor_dim(lg, 3),
			    .E = (int)epj_tensor_dim(lg, 4),
			    .k = atoi(strstr(about, "k=") + 2),
			    .sc = si ? EJ_SCORE_SIGMOID : EJ_SCORE_SOFTMAX };
		double *lv = tu_values(ctx, lg);
		const int64_t per = c.B * c.T * c.E;
		for (int kd = 0; kd < 4; kd++) {
			snprintf(nm, sizeof nm, "%s.%s", sfs[si], kinds[kd]);
			epj_tensor *gt = epj_st_get(ctx, f, nm);
			ck_assert_msg(gt && epj_tensor_numel(gt) == M * c.L,
				      "%s", nm);
			double *want = tu_values(ctx, gt);
			const int kind = EJ_RLOSS_AUX + kd;
			rcase ck = c;
			ck.coef[kind] = 1;
			ej_rloss *rl = new_rloss(ctx, &ck);
			for (int64_t m = 0; m < M; m++) {
				epj_tensor *z[8] = { 0 };
				double sum = 0, v[EJ_RLOSS_N];
				for (int l = 0; l < c.L; l++) {
					const int64_t sh[2] = { c.B * c.T,
								c.E };
					z[l] = epj_tensor_from_data(
					    ctx, EPJ_DTYPE_F64, 2, sh,
					    lv + (m * c.L + l) * per);
					sum += want[m * c.L + l];
				}
				double add = lib_forward(ctx, rl, &ck, z, NULL);
				ej_rloss_values(rl, v);
				ck_assert_msg(
				    fabs(add - sum) <= 1e-6 * fabs(sum) &&
					fabs(v[kind] - sum / c.L) <=
					    1e-6 * fabs(sum / c.L),
				    "%s micro-batch %lld: %.12g (value %.12g), "
				    "Megatron's %.12g",
				    nm, (long long)m, add, v[kind], sum);
				for (int l = 0; l < c.L; l++)
					epj_tensor_free(z[l]);
				checked++;
			}
			ej_rloss_free(rl);
			free(want);
			epj_tensor_free(gt);
		}
		free(lv);
		epj_tensor_free(lg);
	}
	ck_assert_int_eq(checked, 16);
	epj_st_close(f);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- gradients against central differences ------------------------------
 */

static void grad_case(int which, ej_route_scoring sc)
{
	epj_ctx *ctx = tu_ctx();
	rcase c = draw_case(which, sc);
	ej_rloss *rl = new_rloss(ctx, &c);
	epj_tensor *z[4] = { 0 }, *za[4] = { 0 };
	double *zh[4] = { 0 };
	for (int l = 0; l < c.L; l++) {
		z[l] = spread_logits(ctx, &c, &zh[l]);
		epj_tensor_set_requires_grad(z[l], true);
	}
	/* the analytic gradient: a backward that reaches every node with a
	 * zero gradient of its own (root = 0 x the outputs) */
	lib_forward(ctx, rl, &c, z, za);
	epj_tensor *root = NULL;
	for (int l = 0; l < c.L; l++) {
		ck_assert(epj_tensor_requires_grad(za[l]));
		epj_tensor *m = epj_mul_scalar(ctx, za[l], 0.0);
		epj_tensor *s = epj_sum_all(ctx, m);
		epj_tensor *r =
		    root ? epj_add(ctx, root, s) : epj_tensor_ref(s);
		epj_tensor_free(root);
		epj_tensor_free(m);
		epj_tensor_free(s);
		epj_tensor_free(za[l]);
		root = r;
	}
	ck_assert_msg(epj_backward(ctx, root, NULL) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	epj_tensor_free(root);
	const int64_t n = c.B * c.T * c.E;
	const double h = 1e-5;
	bool prev = epj_no_grad_enter(ctx);
	for (int l = 0; l < c.L; l++) {
		epj_tensor *g = epj_tensor_grad(z[l]);
		ck_assert_ptr_nonnull(g);
		double *gv = tu_values(ctx, g), gmax = 0;
		for (int64_t i = 0; i < n; i++)
			gmax = fmax(gmax, fabs(gv[i]));
		/* transformers' load-balancing loss is E sum_e f_e P_e over
		 * all layers' tokens, f_e the (constant) fraction routed to
		 * e: when the draw routes every expert the same fraction,
		 * sum_e P_e = 1 per token leaves nothing to differentiate,
		 * and the central differences below must then be 0 too
		 * (seed 117740451364030) */
		ck_assert_msg(gmax > 0 || which == EJ_RLOSS_HF,
			      "%s: no gradient reached layer %d",
			      which < EJ_RLOSS_N ? kind_name[which] : "all", l);
		for (int64_t i = 0; i < n; i++) {
			double x = zh[l][i], f[2];
			for (int s = 0; s < 2; s++) {
				epj_tensor_set_f64(z[l], i, x + (s ? -h : h));
				f[s] = lib_forward(ctx, rl, &c, z, NULL);
			}
			epj_tensor_set_f64(z[l], i, x);
			double fd = (f[0] - f[1]) / (2 * h);
			ck_assert_msg(fabs(fd - gv[i]) <= 1e-7 + 1e-6 * gmax,
				      "%s %s: d/dz[%d][%lld] %.12g, central "
				      "difference %.12g",
				      which < EJ_RLOSS_N ? kind_name[which]
							 : "all",
				      sc ? "sigmoid" : "softmax", l,
				      (long long)i, gv[i], fd);
		}
		free(gv);
	}
	epj_no_grad_exit(ctx, prev);
	for (int l = 0; l < c.L; l++) {
		epj_tensor_free(z[l]);
		free(zh[l]);
	}
	ej_rloss_free(rl);
	epj_ctx_free(ctx);
}

START_TEST(test_grad)
{
	int which = _i % (EJ_RLOSS_N + 2);
	ej_route_scoring sc =
	    _i / (EJ_RLOSS_N + 2) ? EJ_SCORE_SIGMOID : EJ_SCORE_SOFTMAX;
	grad_case(which, sc);
}
END_TEST

/* ---- the model ------------------------------------------------------------
 */

/* The built-in tiny model's config.json with edits (tu_tmpfile_free). */
static tu_tmpfile tiny_config(void)
{
	ej_model_config m;
	ej_model_config_tiny(&m);
	char *text = ej_model_config_json(&m, NULL);
	ck_assert_ptr_nonnull(text);
	tu_tmpfile f = tu_tmpfile_new("rloss", "config.json", text);
	free(text);
	return f;
}

/* The tiny model from cfg with overrides, seed 7: in f64 with its
 * Megatron losses set from moe, in f32 without them (moe NULL). */
static epj_layout tiny_layout = EPJ_LAYOUT_NESTED;

static epj_model *tiny_model(epj_ctx *ctx, const char *cfg, const char **ov,
			     int n_ov, const struct ej_moe_config *moe)
{
	epj_model_opts o = { .layout = tiny_layout,
			     .seed = 7,
			     .dtype = moe ? EPJ_DTYPE_F64 : EPJ_DTYPE_F32,
			     .config_overrides = ov,
			     .n_config_overrides = n_ov };
	epj_model *m = NULL;
	ck_assert_msg(epj_model_new(ctx, cfg, &o, &m) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	if (moe)
		ck_assert_int_eq(ej_rloss_configure(ctx, m->rloss, moe, NULL),
				 EPJ_OK);
	return m;
}

/* loss of one forward (and backward when bw) on ids / labels. */
static double model_loss(epj_ctx *ctx, epj_model *m, epj_tensor *ids,
			 epj_tensor *lab, bool bw)
{
	epj_tensor *loss = NULL;
	for (int i = 0; bw && i < m->params.n; i++)
		epj_tensor_set_grad(m->params.params[i], NULL);
	ck_assert_msg(epj_model_forward(ctx, m, ids, lab, NULL, &loss) ==
			  EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	double v = epj_tensor_get_f64(loss, 0);
	if (bw)
		ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
	epj_tensor_free(loss);
	return v;
}

static epj_tensor *gate_of(epj_model *m, int layer)
{
	return ej_module_param(ej_module_child(m->moe[layer], "gate"),
			       "weight");
}

/* Central differences of the whole training loss in a few elements of
 * MoE layer 0's gate against its gradient (grads of the last backward);
 * an element whose step turns a routing choice is skipped (at most 2). */
static void gate_fd(epj_ctx *ctx, epj_model *m, epj_tensor *ids,
		    epj_tensor *lab, const char *what)
{
	epj_tensor *w = gate_of(m, 0);
	double *g = tu_values(ctx, epj_tensor_grad(w)), gmax = 0;
	const int64_t n = epj_tensor_numel(w);
	for (int64_t i = 0; i < n; i++)
		gmax = fmax(gmax, fabs(g[i]));
	double *r0 = tu_values(ctx, ej_autoep_last_routing(m->moe[0]));
	const int64_t nr = epj_tensor_numel(ej_autoep_last_routing(m->moe[0]));
	int checked = 0, skipped = 0;
	const double h = 1e-6;
	for (int t = 0; t < 8; t++) {
		int64_t i = tu_randint(0, n);
		double x = epj_tensor_get_f64(w, i), f[2];
		bool turned = false;
		for (int s = 0; s < 2; s++) {
			epj_tensor_set_f64(w, i, x + (s ? -h : h));
			ej_params_written(ctx);
			f[s] = model_loss(ctx, m, ids, lab, false);
			double *r =
			    tu_values(ctx, ej_autoep_last_routing(m->moe[0]));
			for (int64_t j = 0; j < nr; j++)
				turned |= r[j] != r0[j];
			free(r);
		}
		epj_tensor_set_f64(w, i, x);
		ej_params_written(ctx);
		if (turned) {
			skipped++;
			continue;
		}
		double fd = (f[0] - f[1]) / (2 * h);
		ck_assert_msg(fabs(fd - g[i]) <= 1e-7 + 1e-5 * gmax,
			      "%s: d loss / d gate[%lld] %.12g, central "
			      "difference %.12g",
			      what, (long long)i, g[i], fd);
		checked++;
	}
	ck_assert_msg(skipped <= 2 && checked > 0,
		      "%s: %d elements turned a routing choice", what, skipped);
	free(g);
	free(r0);
}

/* Gradients of a and b (same parameters) equal to 1e-12 relative. */
static void same_grads(epj_ctx *ctx, epj_model *a, epj_model *b,
		       const char *what)
{
	for (int i = 0; i < a->params.n; i++) {
		epj_tensor *ga = epj_tensor_grad(a->params.params[i]);
		epj_tensor *gb = epj_tensor_grad(b->params.params[i]);
		ck_assert_msg((ga == NULL) == (gb == NULL), "%s: %s", what,
			      a->params.names[i]);
		if (!ga)
			continue;
		double *x = tu_values(ctx, ga), *y = tu_values(ctx, gb), m = 0;
		for (int64_t j = 0; j < epj_tensor_numel(ga); j++)
			m = fmax(m, fabs(x[j]));
		for (int64_t j = 0; j < epj_tensor_numel(ga); j++)
			ck_assert_msg(fabs(x[j] - y[j]) <= 1e-12 * (1 + m),
				      "%s: %s[%lld] %.17g with checkpointing, "
				      "%.17g without",
				      what, a->params.names[i], (long long)j,
				      y[j], x[j]);
		free(x);
		free(y);
	}
}

/* _i 0: Megatron's four losses; 1: transformers' (config.json) with the
 * z-loss; 2: Megatron's in the root layout (with checkpointing the root
 * module, loss and all, is replayed). */
START_TEST(test_model)
{
	epj_ctx *ctx = tu_ctx();
	tu_tmpfile cf = tiny_config();
	const bool hf = _i == 1;
	tiny_layout = _i == 2 ? EPJ_LAYOUT_ROOT : EPJ_LAYOUT_NESTED;
	struct ej_moe_config moe = { hf ? 0 : tu_uniform(0.1, 1),
				     hf ? 0 : tu_uniform(0.1, 1),
				     hf ? 0 : tu_uniform(0.1, 1),
				     tu_uniform(0.01, 0.1) };
	const char *ov[2] = { "output_router_logits=true",
			      "router_aux_loss_coef=0.4" };
	const struct ej_moe_config off = { 0 };
	epj_model *plain = tiny_model(ctx, cf.path, NULL, 0, &off);
	epj_model *a = tiny_model(ctx, cf.path, ov, hf ? 2 : 0, &moe);
	epj_model *b = tiny_model(ctx, cf.path, ov, hf ? 2 : 0, &moe);
	epj_model_set_checkpointing(b, true);
	const int64_t sh[2] = { 2, 5 };
	epj_tensor *ids = epj_randint(ctx, EPJ_DTYPE_I64, 2, sh, 0, 64);
	epj_tensor *lab = epj_randint(ctx, EPJ_DTYPE_I64, 2, sh, 0, 64);
	double l0 = model_loss(ctx, plain, ids, lab, true);
	double la = model_loss(ctx, a, ids, lab, true);
	double v[EJ_RLOSS_N];
	ej_rloss_values(a->rloss, v);
	const int L = a->n_moe;
	double obj = hf ? 0.4 * v[EJ_RLOSS_HF] : 0;
	const double c[EJ_RLOSS_N] = { 0, moe.aux_loss_coeff,
				       moe.seq_aux_loss_coeff,
				       moe.global_aux_loss_coeff,
				       moe.z_loss_coeff };
	for (int i = EJ_RLOSS_AUX; i < EJ_RLOSS_N; i++)
		obj += c[i] * L * v[i];
	ck_assert(obj > 0 && v[EJ_RLOSS_Z] > 0);
	ck_assert_msg(fabs(la - l0 - obj) <= 1e-12 * la,
		      "loss %.17g, plain %.17g: the router losses %.17g", la,
		      l0, obj);
	/* checkpointing: the same loss, the same gradients */
	double lb = model_loss(ctx, b, ids, lab, true);
	ck_assert_msg(fabs(la - lb) <= 1e-13 * la, "%.17g vs %.17g", la, lb);
	ck_assert_msg(epj_counter_get(ctx, "autoep.calls.replay") > 0,
		      "no checkpoint replay ran");
	same_grads(ctx, a, b, hf ? "hf" : "megatron");
	/* a second micro-batch of the step: the global aux loss averages
	 * the counts of both, counted once each with checkpointing too */
	epj_tensor *ids2 = epj_randint(ctx, EPJ_DTYPE_I64, 2, sh, 0, 64);
	la = model_loss(ctx, a, ids2, lab, true);
	lb = model_loss(ctx, b, ids2, lab, true);
	ck_assert_msg(fabs(la - lb) <= 1e-13 * la,
		      "micro-batch 2: %.17g vs "
		      "%.17g",
		      la, lb);
	same_grads(ctx, a, b, hf ? "hf, micro-batch 2" : "megatron, 2");
	epj_tensor_free(ids2);
	/* a new step on the first batch (the global counts restart), whose
	 * counts the central differences below keep */
	ck_assert_int_eq(ej_rloss_step_end(ctx, a->rloss, NULL), EPJ_OK);
	ck_assert_int_eq(ej_rloss_step_end(ctx, b->rloss, NULL), EPJ_OK);
	model_loss(ctx, a, ids, lab, true);
	model_loss(ctx, b, ids, lab, true);
	/* the router losses move the routers' gradients */
	double *g0 = tu_values(ctx, epj_tensor_grad(gate_of(plain, 0)));
	double *g1 = tu_values(ctx, epj_tensor_grad(gate_of(a, 0)));
	double d = 0, nrm = 0;
	for (int64_t j = 0; j < epj_tensor_numel(gate_of(a, 0)); j++) {
		d += (g1[j] - g0[j]) * (g1[j] - g0[j]);
		nrm += g0[j] * g0[j];
	}
	ck_assert_msg(d > 1e-6 * nrm, "the router losses leave the gate's "
				      "gradient as it was");
	free(g0);
	free(g1);
	gate_fd(ctx, b, ids, lab, hf ? "hf, checkpointing" : "megatron, ckpt");
	/* evaluation: transformers' loss, not Megatron's */
	bool prev = epj_no_grad_enter(ctx);
	double e0 = model_loss(ctx, plain, ids, lab, false);
	double ea = model_loss(ctx, a, ids, lab, false);
	epj_no_grad_exit(ctx, prev);
	ej_rloss_values(a->rloss, v);
	double want = hf ? 0.4 * v[EJ_RLOSS_HF] : 0;
	ck_assert(!hf || want > 0);
	ck_assert_msg(fabs(ea - e0 - want) <= 1e-12 * ea,
		      "evaluation loss %.17g, plain %.17g, want + %.17g", ea,
		      e0, want);
	epj_tensor_free(ids);
	epj_tensor_free(lab);
	epj_model_free(plain);
	epj_model_free(a);
	epj_model_free(b);
	tu_tmpfile_free(&cf);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- the engine -----------------------------------------------------------
 */

/* transformers' loss with a balancing loss of moe.* is refused by name; the
 * z-loss combines with it. */
START_TEST(test_engine_refuses_two_balancing_losses)
{
	epj_ctx *ctx = tu_ctx();
	tu_tmpfile cf = tiny_config();
	const char *ov[1] = { "output_router_logits=true" };
	const char *keys[3] = { "aux_loss_coeff", "seq_aux_loss_coeff",
				"global_aux_loss_coeff" };
	for (int i = 0; i < 4; i++) {
		epj_model *m = tiny_model(ctx, cf.path, ov, 1, NULL);
		char js[256];
		snprintf(js, sizeof js, "{\"moe\": {\"%s\": 0.01}}",
			 i < 3 ? keys[i] : "z_loss_coeff");
		epj_engine *e = NULL;
		epj_status s = epj_engine_initialize_json(ctx, m, js, "t", &e);
		if (i == 3) {
			ck_assert_msg(s == EPJ_OK, "%s", epj_ctx_error(ctx));
			epj_engine_free(e);
		} else {
			char want[160];
			snprintf(want, sizeof want,
				 "moe.%s is 0.01 and the "
				 "model's config.json has "
				 "\"output_router_logits\": true",
				 keys[i]);
			ck_assert_int_eq(s, EPJ_ERR_CONFIG);
			ck_assert_msg(
			    strstr(epj_ctx_error(ctx), want) &&
				!strncmp(epj_ctx_error(ctx), "t: ", 3),
			    "%s", epj_ctx_error(ctx));
		}
		epj_model_free(m);
	}
	tu_tmpfile_free(&cf);
	epj_ctx_free(ctx);
}
END_TEST

/* The step's metrics: the losses that are on, by name, each the mean of
 * its micro-batches' values; none without router losses. */
START_TEST(test_engine_metrics)
{
	epj_ctx *ctx = tu_ctx();
	epj_model *m = NULL;
	ck_assert_int_eq(epj_model_new(ctx, NULL, NULL, &m), EPJ_OK);
	epj_engine *e = NULL;
	ck_assert_int_eq(
	    epj_engine_initialize_json(
		ctx, m,
		"{\"train_micro_batch_size_per_gpu\": 2, "
		"\"gradient_accumulation_steps\": 2, \"optimizer\": {\"type\": "
		"\"SGD\", \"params\": {\"lr\": 0.1}}, \"moe\": "
		"{\"aux_loss_coeff\": 0.01, \"seq_aux_loss_coeff\": 0.02, "
		"\"global_aux_loss_coeff\": 0.03, \"z_loss_coeff\": 0.001}}",
		"t", &e),
	    EPJ_OK);
	epj_corpus *c = epj_corpus_synthetic(ctx, 64, tu_seed());
	double sum[EJ_RLOSS_N] = { 0 };
	for (int mb = 0; mb < 2; mb++) {
		epj_tensor *ids = NULL, *lab = NULL;
		ck_assert_int_eq(
		    epj_corpus_next_batch(ctx, c, 2, 6, &ids, &lab), EPJ_OK);
		epj_step_info info;
		ck_assert_msg(epj_engine_train_step(e, ids, lab, &info) ==
				  EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		ck_assert(info.stepped == (mb == 1));
		double v[EJ_RLOSS_N];
		ej_rloss_values(m->rloss, v);
		for (int i = 0; i < EJ_RLOSS_N; i++)
			sum[i] += v[i];
		epj_tensor_free(ids);
		epj_tensor_free(lab);
	}
	const char *names[4] = { "load_balancing_loss",
				 "seq_load_balancing_loss",
				 "global_load_balancing_loss", "z_loss" };
	for (int i = 0; i < 4; i++) {
		const char *nm = NULL;
		double val = NAN;
		ck_assert(epj_engine_router_loss(e, i, &nm, &val));
		ck_assert_str_eq(nm, names[i]);
		ck_assert_msg(val > 0 &&
				  fabs(val - sum[i + 1] / 2) <= 1e-12 * val,
			      "%s %.17g, want %.17g", nm, val, sum[i + 1] / 2);
	}
	ck_assert(!epj_engine_router_loss(e, 4, NULL, NULL));
	epj_corpus_free(c);
	epj_engine_free(e);
	epj_model_free(m);
	/* no router loss: no metric */
	ck_assert_int_eq(epj_model_new(ctx, NULL, NULL, &m), EPJ_OK);
	ck_assert_int_eq(epj_engine_initialize_json(ctx, m, "{}", "t", &e),
			 EPJ_OK);
	ck_assert(!epj_engine_router_loss(e, 0, NULL, NULL));
	epj_engine_free(e);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* Eager against compiled with Megatron's four losses on (regional), with
 * checkpointing off (_i & 1 0) and on, nested layout and root (_i & 2: the
 * checkpointed root holds the loss), f32 and bf16 (_i & 4: bf16 logits). */
START_TEST(test_parity)
{
	epj_parity_opts o = {
		.layout = _i & 2 ? EPJ_LAYOUT_ROOT : EPJ_LAYOUT_NESTED,
		.checkpointing = _i & 1,
		.bf16 = _i & 4,
		.regional = true,
		.batch = 2,
		.seq = tu_randint(3, 9),
		.seed = tu_seed(),
		.moe_json = "{\"aux_loss_coeff\": 0.3, \"seq_aux_loss_coeff\": "
			    "0.2, \"global_aux_loss_coeff\": 0.1, "
			    "\"z_loss_coeff\": 0.05}"
	};
	char *buf = NULL;
	size_t len = 0;
	FILE *out = open_memstream(&buf, &len);
	ck_assert_ptr_nonnull(out);
	bool passed = false;
	epj_status st = epj_parity_run(&o, out, &passed);
	fclose(out);
	ck_assert_msg(st == EPJ_OK && passed,
		      "parity with router losses, %s, %s, %s: %s\n%s",
		      _i & 4 ? "bf16" : "f32", _i & 2 ? "root" : "nested",
		      _i & 1 ? "checkpointing" : "no checkpointing",
		      epj_status_name(st), buf ? buf : "");
	free(buf);
}
END_TEST

Suite *make_router_loss_suite(void)
{
	Suite *s = suite_create("router_loss");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 300);
	tcase_add_loop_test(tc, test_values, 0, 2 * (EJ_RLOSS_N + 2));
	tcase_add_loop_test(tc, test_grad, 0, 2 * (EJ_RLOSS_N + 2));
	tcase_add_test(tc, test_megatron_golden);
	tcase_add_loop_test(tc, test_model, 0, 3);
	tcase_add_test(tc, test_engine_refuses_two_balancing_losses);
	tcase_add_test(tc, test_engine_metrics);
	tcase_add_loop_test(tc, test_parity, 0, 8);
	suite_add_tcase(s, tc);
	return s;
}
