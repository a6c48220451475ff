/* check_autoep.c -- the AutoEP MoE layer (runtime/autoep.c) and the `self`
 * comm (runtime/comm.c).
 *
 * The layer is checked against a dense reference written here in double:
 * for every token the router softmax, its top-k (lower index first on ties),
 * the optional renormalisation and sum_k w_k * SwiGLU_{e_k}(x), using the
 * layer's own parameter values.  Routing is piecewise constant, so a token
 * whose k-th and (k+1)-th probabilities nearly tie may legitimately route
 * differently in f32 than in double; for such tokens (gap below a stated
 * threshold) the reference adopts the layer's choice, and every other token
 * must route exactly as the reference does.  Gradients of the router, the
 * experts and the input are checked by finite differences on f64 layers
 * whose inputs are redrawn until no token is near a tie.
 */
#include "check_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime_impl.h"

/* ---- helpers --------------------------------------------------------------
 */

static ej_autoep_opts mk_opts(int E, int k, bool norm, bool fixed)
{
	ej_autoep_opts o = { .num_experts = E,
			     .top_k = k,
			     .norm_topk_prob = norm,
			     .fixed_routing = fixed,
			     .async_split_plan = false };
	return o;
}

static epj_module *new_layer(epj_ctx *ctx, epj_module *parent,
			     const char *local, int H, int I,
			     const ej_autoep_opts *o, epj_dtype dt, double std)
{
	epj_module *m =
	    ej_autoep_new(ctx, parent, local, H, I, o, dt, std, NULL);
	ck_assert_msg(m != NULL, "ej_autoep_new: %s", epj_ctx_error(ctx));
	return m;
}

/* One call through the module contract; returns the output (owned). */
static epj_tensor *call_layer(epj_ctx *ctx, epj_module *m, epj_tensor *x)
{
	epj_tensor *out = NULL;
	epj_status s = ej_module_call(ctx, m, &x, 1, &out, 1);
	ck_assert_msg(s == EPJ_OK && out != NULL, "%s: %s", m->name,
		      epj_ctx_error(ctx));
	return out;
}

static epj_tensor *param_of(epj_module *m, const char *path)
{
	/* path like "experts.3.down_proj" or "gate" */
	char buf[128];
	snprintf(buf, sizeof buf, "%s", path);
	epj_module *cur = m;
	for (char *tok = strtok(buf, "."); tok; tok = strtok(NULL, ".")) {
		cur = ej_module_child(cur, tok);
		ck_assert_msg(cur != NULL, "no child %s in %s", tok, path);
	}
	epj_tensor *w = ej_module_param(cur, "weight");
	ck_assert_ptr_nonnull(w);
	return w;
}

static epj_tensor *expert_param(epj_module *m, int e, const char *proj)
{
	char path[64];
	snprintf(path, sizeof path, "experts.%d.%s", e, proj);
	return param_of(m, path);
}

/* ---- double reference -----------------------------------------------------
 */

typedef struct ref_layer {
	int E, H, I, k;
	bool norm, fixed;
	double *gate;	      /* [E, H] */
	double *gp, *up, *dn; /* per expert [I, H], [I, H], [H, I] */
} ref_layer;

static void ref_load(epj_ctx *ctx, epj_module *m, ref_layer *r, int H, int I,
		     const ej_autoep_opts *o)
{
	r->E = o->num_experts;
	r->H = H;
	r->I = I;
	r->k = o->top_k;
	r->norm = o->norm_topk_prob;
	r->fixed = o->fixed_routing;
	r->gate = tu_values(ctx, param_of(m, "gate"));
	size_t per = (size_t)I * (size_t)H;
	r->gp = malloc(sizeof(double) * per * (size_t)r->E);
	r->up = malloc(sizeof(double) * per * (size_t)r->E);
	r->dn = malloc(sizeof(double) * per * (size_t)r->E);
	ck_assert(r->gp && r->up && r->dn);
	for (int e = 0; e < r->E; e++) {
		ck_assert_int_eq(
		    epj_tensor_to_f64(ctx, expert_param(m, e, "gate_proj"),
				      r->gp + per * (size_t)e),
		    EPJ_OK);
		ck_assert_int_eq(
		    epj_tensor_to_f64(ctx, expert_param(m, e, "up_proj"),
				      r->up + per * (size_t)e),
		    EPJ_OK);
		ck_assert_int_eq(
		    epj_tensor_to_f64(ctx, expert_param(m, e, "down_proj"),
				      r->dn + per * (size_t)e),
		    EPJ_OK);
	}
}

static void ref_free(ref_layer *r)
{
	free(r->gate);
	free(r->gp);
	free(r->up);
	free(r->dn);
}

/* Router in double: probs [N, E]; route [N, k] (largest first, lower index
 * first on ties; fixed mode: (n*k + j) % E); gap[n] = p(k-th chosen) - max p
 * over the unchosen (INFINITY when nothing is unchosen or fixed). */
static void ref_route(const ref_layer *r, const double *x, int64_t N,
		      double *probs, int64_t *route, double *gap)
{
	int E = r->E, H = r->H, k = r->k;
	bool *chosen = malloc(sizeof *chosen * (size_t)E);
	for (int64_t n = 0; n < N; n++) {
		double *p = probs + n * E, mx = -INFINITY, s = 0;
		for (int e = 0; e < E; e++) {
			double l = 0;
			for (int h = 0; h < H; h++)
				l += x[n * H + h] * r->gate[e * H + h];
			p[e] = l;
			mx = fmax(mx, l);
		}
		for (int e = 0; e < E; e++)
			s += (p[e] = exp(p[e] - mx));
		for (int e = 0; e < E; e++)
			p[e] /= s;
		gap[n] = INFINITY;
		if (r->fixed) {
			for (int j = 0; j < k; j++)
				route[n * k + j] = (n * k + j) % E;
			continue;
		}
		for (int e = 0; e < E; e++)
			chosen[e] = false;
		for (int j = 0; j < k; j++) {
			int best = -1;
			for (int e = 0; e < E; e++)
				if (!chosen[e] && (best < 0 || p[e] > p[best]))
					best = e;
			chosen[best] = true;
			route[n * k + j] = best;
		}
		double rest = -INFINITY;
		for (int e = 0; e < E; e++)
			if (!chosen[e])
				rest = fmax(rest, p[e]);
		if (k < E)
			gap[n] = p[route[n * k + k - 1]] - rest;
	}
	free(chosen);
}

/* out[N, H] = sum_j w_j * SwiGLU_{route[n, j]}(x_n), with w from probs at
 * the route (renormalised when r->norm). */
static void ref_output(const ref_layer *r, const double *x, int64_t N,
		       const double *probs, const int64_t *route, double *out)
{
	int E = r->E, H = r->H, I = r->I, k = r->k;
	double *hbuf = malloc(sizeof *hbuf * (size_t)I);
	for (int64_t n = 0; n < N; n++) {
		const double *xn = x + n * H;
		double wsum = 0;
		for (int j = 0; j < k; j++)
			wsum += probs[n * E + route[n * k + j]];
		for (int h = 0; h < H; h++)
			out[n * H + h] = 0;
		for (int j = 0; j < k; j++) {
			int e = (int)route[n * k + j];
			double w = probs[n * E + e];
			if (r->norm)
				w /= wsum;
			const double *gp = r->gp + (size_t)e * I * H;
			const double *up = r->up + (size_t)e * I * H;
			const double *dn = r->dn + (size_t)e * H * I;
			for (int i = 0; i < I; i++) {
				double g = 0, u = 0;
				for (int h = 0; h < H; h++) {
					g += gp[i * H + h] * xn[h];
					u += up[i * H + h] * xn[h];
				}
				hbuf[i] = g / (1 + exp(-g)) * u;
			}
			for (int h = 0; h < H; h++) {
				double y = 0;
				for (int i = 0; i < I; i++)
					y += dn[h * I + i] * hbuf[i];
				out[n * H + h] += w * y;
			}
		}
	}
	free(hbuf);
}

static bool same_set(const int64_t *a, const int64_t *b, int k)
{
	for (int i = 0; i < k; i++) {
		bool found = false;
		for (int j = 0; j < k; j++)
			found = found || a[i] == b[j];
		if (!found)
			return false;
	}
	return true;
}

/* Runs the layer on x and checks output and routing against the double
 * reference.  Tokens within `tie` of a routing tie adopt the layer's route.
 * Returns how many tokens did. */
static int check_layer_vs_ref(epj_ctx *ctx, epj_module *m, epj_tensor *x, int H,
			      int I, const ej_autoep_opts *o, double tie,
			      double rtol, double atol_rel, const char *what)
{
	int E = o->num_experts, k = o->top_k;
	int64_t N = epj_tensor_numel(x) / H;
	ref_layer r;
	ref_load(ctx, m, &r, H, I, o);
	double *xv = tu_values(ctx, x);
	double *probs = malloc(sizeof(double) * (size_t)(N * E));
	double *gap = malloc(sizeof(double) * (size_t)N);
	double *ref = malloc(sizeof(double) * (size_t)(N * H));
	int64_t *route = malloc(sizeof(int64_t) * (size_t)(N * k));
	ref_route(&r, xv, N, probs, route, gap);

	epj_tensor *out = call_layer(ctx, m, x);
	ck_assert_int_eq(epj_tensor_dtype(out), epj_tensor_dtype(x));
	ck_assert_int_eq(epj_tensor_ndim(out), epj_tensor_ndim(x));
	for (int i = 0; i < epj_tensor_ndim(x); i++)
		ck_assert_int_eq(epj_tensor_dim(out, i), epj_tensor_dim(x, i));
	epj_tensor *rt = ej_autoep_last_routing(m);
	ck_assert_ptr_nonnull(rt);
	ck_assert_int_eq(epj_tensor_dtype(rt), EPJ_DTYPE_I64);
	ck_assert_int_eq(epj_tensor_ndim(rt), 2);
	ck_assert_int_eq(epj_tensor_dim(rt, 0), N);
	ck_assert_int_eq(epj_tensor_dim(rt, 1), k);
	ck_assert(!epj_tensor_requires_grad(rt));
	double *lr = tu_values(ctx, rt);
	int adopted = 0;
	for (int64_t n = 0; n < N; n++) {
		int64_t got[16];
		for (int j = 0; j < k; j++) {
			got[j] = (int64_t)lr[n * k + j];
			ck_assert(got[j] >= 0 && got[j] < E);
		}
		if (same_set(got, route + n * k, k))
			continue;
		ck_assert_msg(gap[n] < tie,
			      "%s: token %lld routed to a different set "
			      "(first %lld vs %lld), routing gap %g (seed "
			      "%llu)",
			      what, (long long)n, (long long)got[0],
			      (long long)route[n * k], gap[n],
			      (unsigned long long)tu_seed());
		for (int j = 0; j < k; j++)
			route[n * k + j] = got[j];
		adopted++;
	}
	ref_output(&r, xv, N, probs, route, ref);
	double scale = 0;
	for (int64_t i = 0; i < N * H; i++)
		scale = fmax(scale, fabs(ref[i]));
	tu_assert_close(ctx, out, ref, rtol, atol_rel * scale, what);

	epj_tensor_free(out);
	free(lr);
	free(xv);
	free(probs);
	free(gap);
	free(ref);
	free(route);
	ref_free(&r);
	return adopted;
}

/* ---- (1) forward against the dense reference ------------------------------
 */

static void forward_case(int B, int T, int H, int I, int E, int k, bool norm,
			 bool fixed, bool noncontig, const char *what)
{
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(E, k, norm, fixed);
	epj_module *m =
	    new_layer(ctx, root, "mlp", H, I, &o, EPJ_DTYPE_F32, 0.4);
	int64_t sh[3] = { B, T, H };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	if (noncontig) {
		epj_tensor *nc = tu_noncontig(ctx, x);
		epj_tensor_free(x);
		x = nc;
		ck_assert(!epj_tensor_is_contiguous(x));
	}
	int adopted =
	    check_layer_vs_ref(ctx, m, x, H, I, &o, 1e-4, 1e-4, 2e-5, what);
	ck_assert_int_le(adopted, 1);
	epj_tensor_free(x);
	ej_module_free(root);
	epj_ctx_free(ctx);
}

START_TEST(test_forward_k2_norm)
{
	forward_case(2, 5, 12, 7, 5, 2, true, false, false, "k=2 norm");
}
END_TEST

START_TEST(test_forward_k1)
{
	forward_case(2, 5, 12, 7, 5, 1, true, false, true, "k=1 norm");
}
END_TEST

START_TEST(test_forward_no_norm)
{
	forward_case(2, 5, 12, 7, 5, 2, false, false, true, "k=2 no norm");
}
END_TEST

START_TEST(test_forward_k_all)
{
	/* k = E: every expert sees every token */
	forward_case(3, 3, 5, 3, 3, 3, false, false, false, "k=E");
}
END_TEST

START_TEST(test_forward_fixed)
{
	forward_case(2, 5, 12, 7, 5, 2, true, true, false, "fixed k=2");
	forward_case(1, 7, 6, 5, 3, 2, false, true, true, "fixed no norm");
}
END_TEST

/* Module tree: names, kinds, shapes, flags, and the documented init order
 * (gate, then experts' gate_proj, up_proj, down_proj) from the ctx RNG. */
START_TEST(test_tree_and_init)
{
	const int H = 6, I = 5, E = 3;
	const uint64_t seed = tu_seed() * 31 + 11;
	epj_ctx *ctx = tu_ctx();
	epj_ctx_seed(ctx, seed);
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	epj_module *model = ej_module_new(root, "model", "Model", NULL);
	epj_module *layers = ej_module_new(model, "layers", "ModuleList", NULL);
	epj_module *l3 = ej_module_new(layers, "3", "DecoderLayer", NULL);
	ej_autoep_opts o = mk_opts(E, 2, true, false);
	epj_module *m =
	    new_layer(ctx, l3, "mlp", H, I, &o, EPJ_DTYPE_F32, 0.02);
	ck_assert_str_eq(m->name, "model.layers.3.mlp");
	ck_assert_str_eq(m->kind, "AutoEPMoELayer");
	ck_assert(m->compiler_disabled);
	ck_assert_ptr_nonnull(m->forward);
	ck_assert_ptr_null(ej_autoep_last_routing(m));
	ck_assert_ptr_null(ej_autoep_last_routing(l3));
	epj_module *ex = ej_module_child(m, "experts");
	ck_assert_ptr_nonnull(ex);
	ck_assert_str_eq(ex->kind, "ModuleList");
	ck_assert_ptr_null(ex->forward);
	ck_assert_int_eq(ex->n_children, E);
	ck_assert_str_eq(ej_module_child(m, "gate")->kind, "Linear");
	ck_assert_str_eq(ex->children[1]->kind, "Qwen3MoeMLP");

	ej_param_list l;
	ck_assert_int_eq(ej_module_params(ctx, root, &l), EPJ_OK);
	ck_assert_int_eq(l.n, 1 + 3 * E);
	ck_assert_str_eq(l.names[0], "model.layers.3.mlp.gate.weight");
	ck_assert_int_eq(epj_tensor_dim(l.params[0], 0), E);
	ck_assert_int_eq(epj_tensor_dim(l.params[0], 1), H);
	/* replay the RNG: same seed, same draws in the documented order */
	epj_ctx *c2 = NULL;
	ck_assert_int_eq(epj_ctx_new("cpu", &c2), EPJ_OK);
	epj_ctx_seed(c2, seed);
	int64_t sh_gate[2] = { E, H }, sh_in[2] = { I, H },
		sh_out[2] = { H, I };
	static const char *const proj[3] = { "gate_proj", "up_proj",
					     "down_proj" };
	for (int i = 0; i < l.n; i++) {
		const int64_t *sh = i == 0	       ? sh_gate
				    : (i - 1) % 3 == 2 ? sh_out
						       : sh_in;
		if (i > 0) {
			char want[128];
			snprintf(want, sizeof want,
				 "model.layers.3.mlp.experts.%d.%s.weight",
				 (i - 1) / 3, proj[(i - 1) % 3]);
			ck_assert_str_eq(l.names[i], want);
		}
		ck_assert_int_eq(epj_tensor_dtype(l.params[i]), EPJ_DTYPE_F32);
		ck_assert(epj_tensor_requires_grad(l.params[i]));
		ck_assert(epj_tensor_is_leaf(l.params[i]));
		ck_assert_int_eq(epj_tensor_dim(l.params[i], 0), sh[0]);
		ck_assert_int_eq(epj_tensor_dim(l.params[i], 1), sh[1]);
		epj_tensor *want = epj_randn(c2, EPJ_DTYPE_F32, 2, sh, 0, 0.02);
		tu_ok(c2, want);
		tu_assert_tensors_close(ctx, l.params[i], want, 0, 0,
					l.names[i]);
		epj_tensor_free(want);
	}
	ej_param_list_free(&l);
	epj_ctx_free(c2);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- (2) gradients on f64 layers ------------------------------------------
 */

typedef struct grad_user {
	epj_module *m;
} grad_user;

static epj_tensor *grad_fn(epj_ctx *ctx, epj_tensor *const *in, void *user)
{
	grad_user *u = user;
	epj_tensor *out = NULL;
	epj_tensor *x = in[0];
	if (ej_module_call(ctx, u->m, &x, 1, &out, 1) != EPJ_OK)
		return NULL;
	return out;
}

static void grad_case(int B, int T, int H, int I, int E, int k, bool norm,
		      bool fixed, const char *what)
{
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(E, k, norm, fixed);
	epj_module *m =
	    new_layer(ctx, root, "moe", H, I, &o, EPJ_DTYPE_F64, 0.7);
	int64_t N = (int64_t)B * T;
	int64_t sh[3] = { B, T, H };
	ref_layer r;
	ref_load(ctx, m, &r, H, I, &o);
	double *probs = malloc(sizeof(double) * (size_t)(N * E));
	double *gap = malloc(sizeof(double) * (size_t)N);
	int64_t *route = malloc(sizeof(int64_t) * (size_t)(N * k));
	/* Finite differences step 1e-6 across a routing tie would see a
	 * jump: redraw until every token is clear of ties. */
	epj_tensor *x = NULL;
	for (int tries = 0; tries < 200; tries++) {
		epj_tensor_free(x);
		x = tu_randn(ctx, EPJ_DTYPE_F64, 3, sh);
		double *xv = tu_values(ctx, x);
		ref_route(&r, xv, N, probs, route, gap);
		free(xv);
		double mg = INFINITY;
		for (int64_t n = 0; n < N; n++)
			mg = fmin(mg, gap[n]);
		if (mg > 1e-3)
			break;
	}
	epj_tensor_set_requires_grad(x, true);

	/* inputs: x, the router, and the experts that receive rows (an expert
	 * without rows takes no part in the graph and gets no gradient) */
	bool *used = calloc((size_t)E, sizeof *used);
	for (int64_t i = 0; i < N * k; i++)
		used[route[i]] = true;
	epj_tensor *in[1 + 1 + 3 * 16];
	int n_in = 0;
	in[n_in++] = x;
	in[n_in++] = param_of(m, "gate");
	for (int e = 0; e < E; e++) {
		epj_tensor *ps[3] = { expert_param(m, e, "gate_proj"),
				      expert_param(m, e, "up_proj"),
				      expert_param(m, e, "down_proj") };
		for (int j = 0; j < 3; j++) {
			epj_tensor_zero_grad(ps[j]);
			if (used[e])
				in[n_in++] = ps[j];
		}
	}
	grad_user u = { m };
	tu_gradcheck(ctx, grad_fn, in, n_in, &u, 1e-6, 1e-5, 1e-7, what);
	/* the routing recorded during the check matches the reference */
	double *lr = tu_values(ctx, ej_autoep_last_routing(m));
	for (int64_t n = 0; n < N; n++) {
		int64_t got[16];
		for (int j = 0; j < k; j++)
			got[j] = (int64_t)lr[n * k + j];
		ck_assert_msg(same_set(got, route + n * k, k),
			      "%s: token %lld routed differently", what,
			      (long long)n);
	}
	free(lr);
	/* unused experts: no gradient (or an all-zero one) */
	for (int e = 0; e < E; e++) {
		if (used[e])
			continue;
		epj_tensor *g = epj_tensor_grad(expert_param(m, e, "up_proj"));
		if (g) {
			double *gv = tu_values(ctx, g);
			for (int64_t i = 0; i < epj_tensor_numel(g); i++)
				ck_assert(gv[i] == 0);
			free(gv);
		}
	}
	free(used);
	free(probs);
	free(gap);
	free(route);
	ref_free(&r);
	epj_tensor_free(x);
	ej_module_free(root);
	epj_ctx_free(ctx);
}

START_TEST(test_grad_topk)
{
	grad_case(2, 3, 5, 3, 4, 2, true, false, "grad k=2 norm");
}
END_TEST

START_TEST(test_grad_k1_no_norm)
{
	grad_case(1, 5, 4, 3, 3, 1, false, false, "grad k=1 no norm");
}
END_TEST

START_TEST(test_grad_fixed)
{
	grad_case(1, 5, 3, 2, 3, 2, true, true, "grad fixed");
}
END_TEST

/* ---- (3) routing records --------------------------------------------------
 */

START_TEST(test_fixed_routing_exact)
{
	const int H = 7, I = 3, E = 5, k = 3;
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(E, k, true, true);
	epj_module *m =
	    new_layer(ctx, root, "mlp", H, I, &o, EPJ_DTYPE_F32, 0.1);
	int64_t sh[3] = { 3, 4, H };
	int64_t *first = NULL;
	for (int call = 0; call < 2; call++) {
		epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
		epj_tensor *out = call_layer(ctx, m, x);
		double *lr = tu_values(ctx, ej_autoep_last_routing(m));
		ck_assert_int_eq(epj_tensor_dim(ej_autoep_last_routing(m), 0),
				 12);
		if (!first)
			first = malloc(sizeof *first * 12 * k);
		for (int64_t n = 0; n < 12; n++)
			for (int j = 0; j < k; j++) {
				int64_t v = (int64_t)lr[n * k + j];
				ck_assert_int_eq(v, (n * k + j) % E);
				if (call == 0)
					first[n * k + j] = v;
				else
					ck_assert_int_eq(v, first[n * k + j]);
			}
		free(lr);
		epj_tensor_free(out);
		epj_tensor_free(x);
	}
	free(first);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* Same seed, same layer, same input: identical routing and output; the
 * second run plans its split asynchronously, which must not change a bit. */
START_TEST(test_routing_deterministic)
{
	const int H = 9, I = 4, E = 6, k = 2;
	const uint64_t seed = tu_seed() * 7 + 3;
	double *outs[2];
	double *routes[2];
	int64_t sh[3] = { 2, 7, H };
	for (int run = 0; run < 2; run++) {
		epj_ctx *ctx = NULL;
		ck_assert_int_eq(epj_ctx_new("cpu", &ctx), EPJ_OK);
		epj_ctx_seed(ctx, seed);
		epj_module *root = ej_module_new(NULL, "", "Root", NULL);
		ej_autoep_opts o = mk_opts(E, k, true, false);
		o.async_split_plan = run == 1;
		epj_module *m =
		    new_layer(ctx, root, "mlp", H, I, &o, EPJ_DTYPE_F32, 0.3);
		epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
		epj_tensor *out = call_layer(ctx, m, x);
		outs[run] = tu_values(ctx, out);
		routes[run] = tu_values(ctx, ej_autoep_last_routing(m));
		epj_tensor_free(out);
		epj_tensor_free(x);
		ej_module_free(root);
		epj_ctx_free(ctx);
	}
	ck_assert(memcmp(routes[0], routes[1], sizeof(double) * 14 * k) == 0);
	ck_assert(memcmp(outs[0], outs[1], sizeof(double) * 14 * H) == 0);
	for (int i = 0; i < 2; i++) {
		free(outs[i]);
		free(routes[i]);
	}
}
END_TEST

/* ---- DeepSeek routing ----------------------------------------------------
 */

/* qsort of expert indices by value descending, index ascending */
static const double *g_cmp_vals;
static int cmp_desc(const void *a, const void *b)
{
	int i = *(const int *)a, j = *(const int *)b;
	double u = g_cmp_vals[i], v = g_cmp_vals[j];
	return u > v ? -1 : u < v ? 1 : i - j;
}

/* The reference of ej_autoep_select, by sorting: group scores from each
 * group sorted, the groups sorted, the allowed experts sorted. */
static void ref_select(const double *sc, const double *bias, int E, int k,
		       ej_route_groups g, int ng, int tg, int *out)
{
	double c[64], gs[64], allowed[64];
	int ord[64];
	for (int e = 0; e < E; e++)
		c[e] = sc[e] + (bias ? bias[e] : 0);
	for (int e = 0; e < E; e++)
		allowed[e] = c[e];
	if (g != EJ_GROUPS_NONE) {
		int per = E / ng;
		for (int q = 0; q < ng; q++) {
			for (int i = 0; i < per; i++)
				ord[i] = q * per + i;
			g_cmp_vals = c;
			qsort(ord, (size_t)per, sizeof *ord, cmp_desc);
			gs[q] =
			    c[ord[0]] + (g == EJ_GROUPS_TOP2 ? c[ord[1]] : 0);
		}
		for (int q = 0; q < ng; q++)
			ord[q] = q;
		g_cmp_vals = gs;
		qsort(ord, (size_t)ng, sizeof *ord, cmp_desc);
		for (int q = tg; q < ng; q++)
			for (int i = 0; i < per; i++)
				allowed[ord[q] * per + i] = -INFINITY;
	}
	for (int e = 0; e < E; e++)
		ord[e] = e;
	g_cmp_vals = allowed;
	qsort(ord, (size_t)E, sizeof *ord, cmp_desc);
	for (int j = 0; j < k; j++)
		out[j] = ord[j];
}

/* ej_autoep_select against ref_select on random scores, biases, group
 * layouts and k (ties included: scores drawn from a few values). */
START_TEST(test_select_reference)
{
	for (int trial = 0; trial < 200; trial++) {
		int ng = (int)tu_randint(1, 7), per = (int)tu_randint(1, 6);
		int E = ng * per;
		ej_route_groups g = (ej_route_groups)tu_randint(0, 3);
		if (g == EJ_GROUPS_TOP2 && per < 2)
			g = EJ_GROUPS_MAX;
		int tg = (int)tu_randint(1, ng + 1);
		int cap = g == EJ_GROUPS_NONE ? E : tg * per;
		int k = (int)tu_randint(1, cap + 1);
		bool ties = tu_randint(0, 4) == 0, has_b = tu_randint(0, 2);
		const int n = 5;
		double sc[5 * 36], bias[36];
		for (int i = 0; i < n * E; i++)
			sc[i] = ties ? (double)tu_randint(0, 3) / 4
				     : tu_uniform(0, 1);
		for (int e = 0; e < E; e++)
			bias[e] = ties ? 0 : tu_uniform(-0.3, 0.3);
		int64_t got[5 * 36];
		ej_autoep_select(sc, has_b ? bias : NULL, n, E, k, g, ng, tg,
				 got);
		for (int t = 0; t < n; t++) {
			int want[36];
			ref_select(sc + t * E, has_b ? bias : NULL, E, k, g, ng,
				   tg, want);
			for (int j = 0; j < k; j++)
				ck_assert_msg(got[t * k + j] == want[j],
					      "trial %d token %d slot %d: E %d "
					      "groups %d/%d mode %d k %d: got "
					      "%lld, want %d",
					      trial, t, j, E, tg, ng, (int)g, k,
					      (long long)got[t * k + j],
					      want[j]);
		}
	}
}
END_TEST

/* DeepSeek-V3's router in a layer: sigmoid scores, experts chosen by score
 * + e_score_correction_bias within the 2 best of 3 groups (a group's best
 * two), the weights the scores alone, renormalised, times 2.5; against
 * the double reference.  The bias is a buffer (no gradient, not trained)
 * and changes only the choice: the output with the bias zeroed routes
 * differently. */
START_TEST(test_scored_routing_v3)
{
	const int H = 7, I = 5, E = 6, k = 3;
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(E, k, true, false);
	o.scoring = EJ_SCORE_SIGMOID;
	o.groups = EJ_GROUPS_TOP2;
	o.n_group = 3;
	o.topk_group = 2;
	o.routed_scaling_factor = 2.5;
	o.score_bias = true;
	epj_module *m =
	    new_layer(ctx, root, "mlp", H, I, &o, EPJ_DTYPE_F32, 0.5);
	epj_tensor *b = ej_module_param(ej_module_child(m, "gate"),
					"e_score_correction_bias");
	ck_assert_ptr_nonnull(b);
	ck_assert(!epj_tensor_requires_grad(b));
	double bias[6];
	for (int e = 0; e < E; e++)
		bias[e] = tu_uniform(-0.4, 0.4);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, b, bias), EPJ_OK);
	ref_layer r;
	ref_load(ctx, m, &r, H, I, &o);
	r.norm = false; /* the weights below are final */
	int64_t sh[3] = { 3, 5, H }, N = 15;
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	epj_tensor *out = call_layer(ctx, m, x);
	double *xv = tu_values(ctx, x), *ov = tu_values(ctx, out);
	double *wt = calloc((size_t)(N * E), sizeof *wt), sc[6];
	double *want = malloc(sizeof *want * (size_t)(N * H));
	int64_t route[15 * 3];
	double *routed = tu_values(ctx, ej_autoep_last_routing(m));
	for (int64_t n = 0; n < N; n++) {
		for (int e = 0; e < E; e++) {
			double l = 0;
			for (int h = 0; h < H; h++)
				l += xv[n * H + h] * r.gate[e * H + h];
			sc[e] = 1 / (1 + exp(-l));
		}
		int pick[3];
		ref_select(sc, bias, E, k, EJ_GROUPS_TOP2, 3, 2, pick);
		double sum = 0;
		for (int j = 0; j < k; j++)
			sum += sc[pick[j]];
		for (int j = 0; j < k; j++) {
			route[n * k + j] = pick[j];
			wt[n * E + pick[j]] = sc[pick[j]] / sum * 2.5;
			ck_assert_int_eq((int64_t)routed[n * k + j], pick[j]);
		}
	}
	ref_output(&r, xv, N, wt, route, want);
	for (int64_t i = 0; i < N * H; i++)
		ck_assert_msg(
		    fabs(ov[i] - want[i]) <= 1e-5 * (1 + fabs(want[i])),
		    "out[%lld] %g, want %g", (long long)i, ov[i], want[i]);
	/* backward: the gate trains, the bias gets no gradient */
	epj_tensor *loss = epj_sum(ctx, out, -1, false);
	epj_tensor *l2 = epj_sum(ctx, loss, -1, false);
	epj_tensor *l3 = epj_sum(ctx, l2, -1, false);
	ck_assert_int_eq(epj_backward(ctx, l3, NULL), EPJ_OK);
	ck_assert_ptr_nonnull(epj_tensor_grad(param_of(m, "gate")));
	ck_assert_ptr_null(epj_tensor_grad(b));
	free(xv);
	free(ov);
	free(wt);
	free(want);
	free(routed);
	ref_free(&r);
	epj_tensor_free(loss);
	epj_tensor_free(l2);
	epj_tensor_free(l3);
	epj_tensor_free(out);
	epj_tensor_free(x);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* Aux-loss-free balancing: after training forwards (a no-grad forward does
 * not count) the bias moves by rate * sign(mean load - load) per expert,
 * the loads taken from the routings; the loads then restart (a second
 * call changes nothing). */
START_TEST(test_balance_rule)
{
	const int H = 6, I = 3, E = 8, k = 2;
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(E, k, true, false);
	o.scoring = EJ_SCORE_SIGMOID;
	o.groups = EJ_GROUPS_TOP2;
	o.n_group = 4;
	o.topk_group = 2;
	o.score_bias = true;
	epj_module *m =
	    new_layer(ctx, root, "mlp", H, I, &o, EPJ_DTYPE_F32, 0.8);
	epj_tensor *b = ej_module_param(ej_module_child(m, "gate"),
					"e_score_correction_bias");
	double b0[8], b1[8], b2[8], load[8] = { 0 };
	for (int e = 0; e < E; e++)
		b0[e] = tu_uniform(-0.1, 0.1);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, b, b0), EPJ_OK);
	for (int call = 0; call < 3; call++) {
		int64_t sh[3] = { 2, 3 + call, H };
		epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
		bool prev = call == 2 ? epj_no_grad_enter(ctx) : false;
		epj_tensor *out = call_layer(ctx, m, x);
		if (call == 2)
			epj_no_grad_exit(ctx, prev);
		double *rt = tu_values(ctx, ej_autoep_last_routing(m));
		for (int64_t i = 0; call < 2 && i < sh[0] * sh[1] * k; i++)
			load[(int)rt[i]] += 1;
		free(rt);
		epj_tensor_free(out);
		epj_tensor_free(x);
	}
	ck_assert_int_eq(ej_autoep_balance(ctx, m, NULL, 0.01), EPJ_OK);
	ck_assert_int_eq(epj_tensor_to_f64(ctx, b, b1), EPJ_OK);
	double mean = 0;
	for (int e = 0; e < E; e++)
		mean += load[e] / E;
	int moved = 0;
	for (int e = 0; e < E; e++) {
		double want =
		    b0[e] + 0.01 * ((load[e] < mean) - (load[e] > mean));
		ck_assert_msg(fabs(b1[e] - want) < 1e-7,
			      "expert %d (load %g, mean %g): bias %g, want %g",
			      e, load[e], mean, b1[e], want);
		moved += b1[e] != b0[e];
	}
	ck_assert_int_gt(moved, 0);
	ck_assert_int_eq(ej_autoep_balance(ctx, m, NULL, 0.01), EPJ_OK);
	ck_assert_int_eq(epj_tensor_to_f64(ctx, b, b2), EPJ_OK);
	ck_assert(memcmp(b1, b2, sizeof b1) == 0);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- (4) counters ---------------------------------------------------------
 */

START_TEST(test_counters)
{
	const int H = 5, I = 3, E = 3;
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(E, 2, true, false);
	epj_module *m =
	    new_layer(ctx, root, "mlp", H, I, &o, EPJ_DTYPE_F32, 0.2);
	int64_t sh[3] = { 1, 3, H };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	int64_t f0 = epj_counter_get(ctx, "autoep.calls.forward");
	int64_t r0 = epj_counter_get(ctx, "autoep.calls.replay");
	for (int i = 1; i <= 3; i++) {
		epj_tensor *out = call_layer(ctx, m, x);
		epj_tensor_free(out);
		ck_assert_int_eq(epj_counter_get(ctx, "autoep.calls.forward"),
				 f0 + i);
		ck_assert_int_eq(epj_counter_get(ctx, "autoep.calls.replay"),
				 r0);
	}
	/* a call during a checkpoint replay counts as a replay */
	ctx->rt_replay_depth = 1;
	epj_tensor *out = call_layer(ctx, m, x);
	ctx->rt_replay_depth = 0;
	epj_tensor_free(out);
	ck_assert_int_eq(epj_counter_get(ctx, "autoep.calls.forward"), f0 + 3);
	ck_assert_int_eq(epj_counter_get(ctx, "autoep.calls.replay"), r0 + 1);
	/* a failed call counts nothing */
	int64_t bad_sh[3] = { 1, 3, H + 1 };
	epj_tensor *bad = tu_randn(ctx, EPJ_DTYPE_F32, 3, bad_sh);
	epj_tensor *o2 = NULL;
	ck_assert_int_ne(ej_module_call(ctx, m, &bad, 1, &o2, 1), EPJ_OK);
	ck_assert_int_eq(epj_counter_get(ctx, "autoep.calls.forward"), f0 + 3);
	epj_tensor_free(bad);
	epj_tensor_free(x);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* Activation checkpointing around the layer: one forward, one replay in
 * backward, and the same gradients as without checkpointing. */
START_TEST(test_checkpoint_replay)
{
	const int H = 6, I = 4, E = 4;
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(E, 2, true, false);
	epj_module *m =
	    new_layer(ctx, root, "mlp", H, I, &o, EPJ_DTYPE_F32, 0.3);
	int64_t sh[3] = { 2, 3, H };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	epj_tensor_set_requires_grad(x, true);
	epj_tensor *gw = param_of(m, "gate");
	double *g_plain[2] = { NULL, NULL };
	for (int ck = 0; ck < 2; ck++) {
		m->checkpoint = ck == 1;
		epj_tensor_zero_grad(x);
		epj_tensor_zero_grad(gw);
		int64_t f0 = epj_counter_get(ctx, "autoep.calls.forward");
		int64_t r0 = epj_counter_get(ctx, "autoep.calls.replay");
		epj_tensor *out = call_layer(ctx, m, x);
		epj_tensor *sq = epj_mul(ctx, out, out);
		epj_tensor *loss = epj_sum_all(ctx, sq);
		tu_ok(ctx, loss);
		ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		ck_assert_int_eq(epj_counter_get(ctx, "autoep.calls.forward"),
				 f0 + 1);
		ck_assert_int_eq(epj_counter_get(ctx, "autoep.calls.replay"),
				 r0 + ck);
		ck_assert_ptr_nonnull(epj_tensor_grad(x));
		ck_assert_ptr_nonnull(epj_tensor_grad(gw));
		if (ck == 0) {
			g_plain[0] = tu_values(ctx, epj_tensor_grad(x));
			g_plain[1] = tu_values(ctx, epj_tensor_grad(gw));
		} else {
			tu_assert_close(ctx, epj_tensor_grad(x), g_plain[0],
					1e-5, 1e-6, "checkpointed d/dx");
			tu_assert_close(ctx, epj_tensor_grad(gw), g_plain[1],
					1e-5, 1e-6, "checkpointed d/dgate");
		}
		epj_tensor_free(loss);
		epj_tensor_free(sq);
		epj_tensor_free(out);
	}
	free(g_plain[0]);
	free(g_plain[1]);
	epj_tensor_free(x);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_no_grad)
{
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(3, 1, false, false);
	epj_module *m =
	    new_layer(ctx, root, "mlp", 4, 3, &o, EPJ_DTYPE_F32, 0.3);
	int64_t sh[3] = { 1, 5, 4 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *out = call_layer(ctx, m, x);
	epj_no_grad_exit(ctx, prev);
	ck_assert(!epj_tensor_requires_grad(out));
	epj_tensor_free(out);
	epj_tensor_free(x);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- (5) bf16 against f32 on the same weights -----------------------------
 */

/* Tolerance: a bf16 layer rounds the router logits and each expert
 * intermediate (gate_proj, up_proj, silu, product, down_proj: six roundings
 * of 2^-9 relative each) to 8 significant bits; the combine runs in f32.
 * Errors compound to about 1-2% of the row's magnitude, so rows are
 * compared with rtol 0.04 plus atol 0.03 of the largest output.  Tokens
 * whose routing changed through the rounded logits are skipped, but only
 * when the reference routing gap is below 0.03 and for at most a quarter of
 * the tokens. */
START_TEST(test_bf16_vs_f32)
{
	const int B = 3, T = 5, H = 12, I = 7, E = 5, k = 2;
	const int64_t N = B * T;
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(E, k, true, false);
	epj_module *mf =
	    new_layer(ctx, root, "f32", H, I, &o, EPJ_DTYPE_F32, 0.4);
	epj_module *mb =
	    new_layer(ctx, root, "bf16", H, I, &o, EPJ_DTYPE_BF16, 0.4);
	ck_assert_str_eq(mb->name, "bf16");
	ej_param_list lf, lb;
	ck_assert_int_eq(ej_module_params(ctx, mf, &lf), EPJ_OK);
	ck_assert_int_eq(ej_module_params(ctx, mb, &lb), EPJ_OK);
	ck_assert_int_eq(lf.n, lb.n);
	for (int i = 0; i < lf.n; i++) {
		ck_assert_int_eq(epj_tensor_dtype(lb.params[i]),
				 EPJ_DTYPE_BF16);
		/* f32 -> bf16 (rounded) -> f32: both hold the same values */
		ck_assert_int_eq(
		    epj_tensor_copy_(ctx, lb.params[i], lf.params[i]), EPJ_OK);
		ck_assert_int_eq(
		    epj_tensor_copy_(ctx, lf.params[i], lb.params[i]), EPJ_OK);
	}
	ej_param_list_free(&lf);
	ej_param_list_free(&lb);
	int64_t sh[3] = { B, T, H };
	epj_tensor *x0 = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	epj_tensor *xb = epj_cast(ctx, x0, EPJ_DTYPE_BF16);
	epj_tensor *xf = epj_cast(ctx, xb, EPJ_DTYPE_F32);
	tu_ok(ctx, xf);
	epj_tensor *of = call_layer(ctx, mf, xf);
	epj_tensor *ob = call_layer(ctx, mb, xb);
	ck_assert_int_eq(epj_tensor_dtype(ob), EPJ_DTYPE_BF16);
	double *vf = tu_values(ctx, of), *vb = tu_values(ctx, ob);
	double *rf = tu_values(ctx, ej_autoep_last_routing(mf));
	double *rb = tu_values(ctx, ej_autoep_last_routing(mb));
	/* reference routing gaps (double) on the shared weights */
	ref_layer r;
	ref_load(ctx, mf, &r, H, I, &o);
	double *xv = tu_values(ctx, xf);
	double *probs = malloc(sizeof(double) * (size_t)(N * E));
	double *gap = malloc(sizeof(double) * (size_t)N);
	int64_t *route = malloc(sizeof(int64_t) * (size_t)(N * k));
	ref_route(&r, xv, N, probs, route, gap);
	double scale = 0;
	for (int64_t i = 0; i < N * H; i++)
		scale = fmax(scale, fabs(vf[i]));
	int skipped = 0;
	for (int64_t n = 0; n < N; n++) {
		int64_t a[2] = { (int64_t)rf[n * k], (int64_t)rf[n * k + 1] };
		int64_t b[2] = { (int64_t)rb[n * k], (int64_t)rb[n * k + 1] };
		if (!same_set(a, b, k)) {
			ck_assert_msg(gap[n] < 0.03,
				      "bf16 routing of token %lld differs "
				      "with gap %g",
				      (long long)n, gap[n]);
			skipped++;
			continue;
		}
		for (int h = 0; h < H; h++) {
			double want = vf[n * H + h], got = vb[n * H + h];
			ck_assert_msg(fabs(got - want) <=
					  0.04 * fabs(want) + 0.03 * scale,
				      "bf16 vs f32 at token %lld, %d: %g vs "
				      "%g (scale %g, seed %llu)",
				      (long long)n, h, got, want, scale,
				      (unsigned long long)tu_seed());
		}
	}
	ck_assert_int_le(skipped, N / 4);
	ref_free(&r);
	free(xv);
	free(probs);
	free(gap);
	free(route);
	free(vf);
	free(vb);
	free(rf);
	free(rb);
	epj_tensor_free(of);
	epj_tensor_free(ob);
	epj_tensor_free(x0);
	epj_tensor_free(xb);
	epj_tensor_free(xf);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- (6) errors -----------------------------------------------------------
 */

static void expect_call_error(epj_ctx *ctx, epj_module *m, epj_tensor *x,
			      epj_status want, const char *needle)
{
	epj_tensor *out = NULL;
	epj_ctx_clear_error(ctx);
	epj_status s = ej_module_call(ctx, m, &x, 1, &out, 1);
	ck_assert_msg(s == want, "got %s want %s: %s", epj_status_name(s),
		      epj_status_name(want), epj_ctx_error(ctx));
	ck_assert_ptr_null(out);
	ck_assert_msg(strstr(epj_ctx_error(ctx), m->name) != NULL,
		      "message does not name %s: %s", m->name,
		      epj_ctx_error(ctx));
	if (needle)
		ck_assert_msg(strstr(epj_ctx_error(ctx), needle) != NULL,
			      "message lacks '%s': %s", needle,
			      epj_ctx_error(ctx));
}

START_TEST(test_bad_input)
{
	const int H = 8, I = 3;
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	epj_module *model = ej_module_new(root, "model", "Model", NULL);
	ej_autoep_opts o = mk_opts(4, 2, true, false);
	epj_module *m =
	    new_layer(ctx, model, "mlp", H, I, &o, EPJ_DTYPE_F32, 0.2);
	ck_assert_str_eq(m->name, "model.mlp");
	int64_t sh_bad[3] = { 2, 3, H + 1 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh_bad);
	expect_call_error(ctx, m, x, EPJ_ERR_SHAPE, "f32[2,3,9]");
	epj_tensor_free(x);
	int64_t sh1[1] = { H };
	x = tu_randn(ctx, EPJ_DTYPE_F32, 1, sh1);
	expect_call_error(ctx, m, x, EPJ_ERR_SHAPE, NULL);
	epj_tensor_free(x);
	int64_t sh[3] = { 2, 3, H };
	x = tu_randn(ctx, EPJ_DTYPE_F64, 3, sh);
	expect_call_error(ctx, m, x, EPJ_ERR_DTYPE, "f64");
	epj_tensor_free(x);
	int64_t sh0[3] = { 0, 3, H };
	x = epj_zeros(ctx, EPJ_DTYPE_F32, 3, sh0);
	tu_ok(ctx, x);
	expect_call_error(ctx, m, x, EPJ_ERR_SHAPE, "empty");
	epj_tensor_free(x);
	/* the layer still works afterwards */
	x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	epj_tensor *out = call_layer(ctx, m, x);
	epj_tensor_free(out);
	epj_tensor_free(x);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_bad_options)
{
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(4, 5, true, false);
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 8, 4, &o,
					 EPJ_DTYPE_F32, 0.02, NULL));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "top_k"));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "mlp"));
	o = mk_opts(0, 1, true, false);
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 8, 4, &o,
					 EPJ_DTYPE_F32, 0.02, NULL));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "num_experts"));
	/* group-limited routing: groups that do not divide the experts,
	 * and a top_k past the kept groups' experts */
	o = mk_opts(6, 2, true, false);
	o.groups = EJ_GROUPS_MAX;
	o.n_group = 4;
	o.topk_group = 1;
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 8, 4, &o,
					 EPJ_DTYPE_F32, 0.02, NULL));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "group-limited"));
	o.n_group = 3;
	o.top_k = 3;
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 8, 4, &o,
					 EPJ_DTYPE_F32, 0.02, NULL));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "top 3"));
	/* 2^30 experts: refused with the allowed range before any count
	 * (1 + 3 x experts parameters) can overflow. */
	o = mk_opts(1 << 30, 2, true, false);
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 8, 4, &o,
					 EPJ_DTYPE_F32, 0.02, NULL));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx),
				     "num_experts 1073741824 is out of "
				     "range [1, 65536]"));
	/* Many experts of huge matrices: the element count overflows. */
	o = mk_opts(65536, 2, true, false);
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 1 << 30, 1 << 30, &o,
					 EPJ_DTYPE_F32, 0.02, NULL));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "overflow 64 bits"));
	o = mk_opts(4, 2, true, false);
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 0, 4, &o,
					 EPJ_DTYPE_F32, 0.02, NULL));
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 8, 4, &o,
					 EPJ_DTYPE_I64, 0.02, NULL));
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_DTYPE);
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 8, 4, &o,
					 EPJ_DTYPE_F32, -1.0, NULL));
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 8, 4, NULL,
					 EPJ_DTYPE_F32, 0.02, NULL));
	/* nothing half-built was left in the parent */
	ck_assert_int_eq(root->n_children, 0);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* A pretend two-rank comm: the split plan mirrors send into recv; the token
 * exchange fails as a vanished peer would, with the backend's text. */
typedef struct fake_comm {
	int plan_calls, starts, waits;
	epj_status wait_status;
} fake_comm;

static epj_status fake_a2a_v(void *self, const void *sendbuf,
			     const int64_t *send_counts, void *recvbuf,
			     const int64_t *recv_counts, size_t row)
{
	fake_comm *f = self;
	int64_t rows = send_counts[0] + send_counts[1];
	ck_assert_int_eq(rows, recv_counts[0] + recv_counts[1]);
	/* the [P][L] plan travels as one row per rank; 6 routed rows of
	 * tokens never do */
	if (row != 2 * sizeof(int64_t) || send_counts[0] != 1 ||
	    send_counts[1] != 1)
		return EPJ_ERR_BACKEND;
	f->plan_calls++;
	memcpy(recvbuf, sendbuf, (size_t)rows * row);
	return EPJ_OK;
}

static epj_status fake_a2a_i64(void *self, const int64_t *send, int64_t *recv)
{
	fake_comm *f = self;
	f->plan_calls++;
	recv[0] = send[0];
	recv[1] = send[1];
	return EPJ_OK;
}

static epj_status fake_start(void *self, const int64_t *send, int64_t *recv,
			     int n_per, ej_comm_req **req)
{
	fake_comm *f = self;
	f->starts++;
	memcpy(recv, send, sizeof(int64_t) * 2 * (size_t)n_per);
	*req = (ej_comm_req *)f;
	return EPJ_OK;
}

static epj_status fake_wait(void *self, ej_comm_req *req)
{
	fake_comm *f = self;
	ck_assert_ptr_eq(req, f);
	f->waits++;
	return f->wait_status;
}

static const char *fake_error(void *self)
{
	(void)self;
	return "peer 1 is gone";
}

static epj_status fake_ok(void *self)
{
	(void)self;
	return EPJ_OK;
}

START_TEST(test_multi_rank_comm_failure)
{
	fake_comm f = { 0 };
	ej_comm fake = { .name = "fake2",
			 .rank = 0,
			 .size = 2,
			 .self = &f,
			 .all_to_all_v = fake_a2a_v,
			 .all_to_all_i64 = fake_a2a_i64,
			 .all_reduce_f32 = NULL,
			 .barrier = fake_ok,
			 .destroy = NULL,
			 .group = "ep",
			 .all_to_all_i64_start = fake_start,
			 .wait = fake_wait,
			 .error = fake_error };
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(3, 1, true, false);
	/* 3 experts cannot be split over 2 ranks */
	ck_assert_ptr_null(ej_autoep_new(ctx, root, "mlp", 4, 3, &o,
					 EPJ_DTYPE_F32, 0.1, &fake));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "fake2"));
	o = mk_opts(4, 2, true, false);
	epj_module *m = ej_autoep_new(ctx, root, "mlp", 4, 3, &o, EPJ_DTYPE_F32,
				      0.1, &fake);
	ck_assert_msg(m != NULL, "%s", epj_ctx_error(ctx));
	/* rank 0 of 2 holds global experts 0 and 1 */
	epj_module *ex = ej_module_child(m, "experts");
	ck_assert_int_eq(ex->n_children, 2);
	ck_assert_ptr_nonnull(ej_module_child(ex, "0"));
	ck_assert_ptr_nonnull(ej_module_child(ex, "1"));
	int64_t sh[3] = { 1, 3, 4 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	int64_t f0 = epj_counter_get(ctx, "autoep.calls.forward");
	/* synchronous plan: exchanged (2 calls), then the dispatch fails
	 * with a message naming the comm, group, rank, call and cause */
	expect_call_error(ctx, m, x, EPJ_ERR_BACKEND, "peer 1 is gone");
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "mlp") && strstr(msg, "fake2") &&
			  strstr(msg, "group ep, rank 0 of 2") &&
			  strstr(msg, "all_to_all_v (autoep.dispatch)"),
		      "%s", msg);
	ck_assert_int_eq(f.plan_calls, 2);
	ck_assert_int_eq(f.starts, 0);
	ck_assert_int_eq(epj_counter_get(ctx, "autoep.split_plan.sync"), 1);
	/* asynchronous plan: posted and waited for (another code path) */
	ck_assert_int_eq(ej_autoep_set_routing(m, false, true), EPJ_OK);
	expect_call_error(ctx, m, x, EPJ_ERR_BACKEND, "peer 1 is gone");
	ck_assert_int_eq(f.plan_calls, 2);
	ck_assert_int_eq(f.starts, 1);
	ck_assert_int_eq(f.waits, 1);
	ck_assert_int_eq(epj_counter_get(ctx, "autoep.split_plan.async"), 1);
	ck_assert_int_gt(
	    epj_counter_get(ctx, "autoep.split_plan.overlapped_ops"), 0);
	/* a failing wait names the split plan */
	f.wait_status = EPJ_ERR_BACKEND;
	expect_call_error(ctx, m, x, EPJ_ERR_BACKEND, "split plan");
	ck_assert_int_eq(f.waits, 2);
	/* an error while the plan is in flight (allocation n fails, for
	 * every n up to past the dispatch): every posted plan is waited for
	 * before the error returns, and some of those errors hit the window
	 * between post and wait (drained) */
	f.wait_status = EPJ_OK;
	int64_t drained0 = epj_counter_get(ctx, "autoep.split_plan.drained");
	for (int64_t n = 1; n <= 200; n++) {
		f.starts = f.waits = 0;
		epj_ctx_clear_error(ctx);
		ej_allocator_fail_after(ctx->alloc, n);
		epj_tensor *out = NULL;
		epj_status st = ej_module_call(ctx, m, &x, 1, &out, 1);
		ej_allocator_fail_after(ctx->alloc, 0);
		ck_assert_int_ne(st, EPJ_OK); /* NOMEM, or the fake dispatch */
		ck_assert_ptr_null(out);
		ck_assert_msg(f.waits == f.starts,
			      "allocation %lld: %d plans posted, %d waited",
			      (long long)n, f.starts, f.waits);
	}
	ck_assert_int_gt(epj_counter_get(ctx, "autoep.split_plan.drained"),
			 drained0);
	ck_assert_int_eq(epj_counter_get(ctx, "autoep.calls.forward"), f0);
	epj_tensor_free(x);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- comm: the world of one -----------------------------------------------
 */

START_TEST(test_comm_self)
{
	ej_comm *c = ej_comm_self_new();
	ck_assert_ptr_nonnull(c);
	ck_assert_str_eq(c->name, "self");
	ck_assert_int_eq(c->rank, 0);
	ck_assert_int_eq(c->size, 1);
	float send[3 * 5], recv[3 * 5];
	for (int i = 0; i < 15; i++) {
		send[i] = (float)tu_uniform(-1, 1);
		recv[i] = 0;
	}
	int64_t n3 = 3, n2 = 2;
	ck_assert_int_eq(
	    c->all_to_all_v(c->self, send, &n3, recv, &n3, 5 * sizeof(float)),
	    EPJ_OK);
	ck_assert(memcmp(send, recv, sizeof send) == 0);
	ck_assert_int_ne(
	    c->all_to_all_v(c->self, send, &n3, recv, &n2, 5 * sizeof(float)),
	    EPJ_OK);
	int64_t a = tu_randint(0, 1000), b = -1;
	ck_assert_int_eq(c->all_to_all_i64(c->self, &a, &b), EPJ_OK);
	ck_assert_int_eq(a, b);
	float before[15];
	memcpy(before, send, sizeof send);
	ck_assert_int_eq(c->all_reduce_f32(c->self, send, 15), EPJ_OK);
	ck_assert(memcmp(before, send, sizeof send) == 0);
	ck_assert_int_eq(c->barrier(c->self), EPJ_OK);
	/* per-purpose counter names: no blank, whatever the purpose's
	 * wording */
	static const char *const purpose[][2] = {
		{ "checkpoint save", "checkpoint.save" },
		{ "autoep.split_plan (drain)", "autoep.split_plan.drain" },
		{ "zero1.all_reduce", "zero1.all_reduce" },
		{ "  a \t b  ", "a.b" },
		{ "", "" },
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(purpose); i++) {
		char part[64];
		ej_comm_purpose_part(purpose[i][0], part, sizeof part);
		ck_assert_str_eq(part, purpose[i][1]);
	}
	char tiny[4];
	ej_comm_purpose_part("checkpoint save", tiny, sizeof tiny);
	ck_assert_uint_lt(strlen(tiny), sizeof tiny);
	ej_comm_free(c);
	ej_comm_free(NULL);
}
END_TEST

/* ---- (6) fused ops against the op sequence ---------------------------------
 */

/* The largest |a - b| over the largest |b| (0 when both are empty). */
static double rel_diff(epj_ctx *ctx, const epj_tensor *a, const epj_tensor *b)
{
	ck_assert_int_eq(epj_tensor_numel(a), epj_tensor_numel(b));
	double *av = tu_values(ctx, a), *bv = tu_values(ctx, b);
	double d = 0, mx = 0;
	for (int64_t i = 0; i < epj_tensor_numel(a); i++) {
		d = fmax(d, fabs(av[i] - bv[i]));
		mx = fmax(mx, fabs(bv[i]));
	}
	free(av);
	free(bv);
	return mx > 0 ? d / mx : d;
}

/* One forward + backward of the layer with the fused ops and one with the
 * generic op sequence (ej_autoep_set_fused) on the same weights and input:
 * same routing, output, input gradient and parameter gradients (an expert
 * without rows gets none in either), and the fused arm runs fewer than half
 * the kernels. */
static void fused_case(epj_dtype dt, int B, int T, int H, int I, int E, int k,
		       bool norm, bool fixed, double tol)
{
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(E, k, norm, fixed);
	epj_module *m = new_layer(ctx, root, "moe", H, I, &o, dt, 0.4);
	int64_t sh[3] = { B, T, H };
	epj_tensor *x = tu_randn(ctx, dt, 3, sh);
	epj_tensor *r = tu_randn(ctx, dt, 3, sh);
	epj_tensor_set_requires_grad(x, true);
	const int np = 1 + 3 * E;
	epj_tensor **ps = calloc((size_t)np, sizeof *ps);
	ps[0] = param_of(m, "gate");
	static const char *const proj[3] = { "gate_proj", "up_proj",
					     "down_proj" };
	for (int e = 0; e < E; e++)
		for (int j = 0; j < 3; j++)
			ps[1 + 3 * e + j] = expert_param(m, e, proj[j]);
	epj_tensor *out[2], *dx[2], *route[2];
	epj_tensor **grads[2];
	int64_t launches[2], fwd[2];
	for (int arm = 0; arm < 2; arm++) { /* 0: sequence, 1: fused */
		ck_assert_int_eq(ej_autoep_set_fused(m, arm == 1), EPJ_OK);
		epj_tensor_zero_grad(x);
		for (int i = 0; i < np; i++)
			epj_tensor_zero_grad(ps[i]);
		int64_t l0 = epj_counter_get(ctx, "kernels.launched.eager");
		out[arm] = call_layer(ctx, m, x);
		fwd[arm] = epj_counter_get(ctx, "kernels.launched.eager") - l0;
		epj_tensor *prod = epj_mul(ctx, out[arm], r);
		epj_tensor *loss = epj_sum_all(ctx, prod);
		tu_ok(ctx, loss);
		ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		launches[arm] =
		    epj_counter_get(ctx, "kernels.launched.eager") - l0;
		epj_tensor_free(prod);
		epj_tensor_free(loss);
		dx[arm] = epj_tensor_ref(epj_tensor_grad(x));
		route[arm] = epj_tensor_ref(ej_autoep_last_routing(m));
		grads[arm] = calloc((size_t)np, sizeof(epj_tensor *));
		for (int i = 0; i < np; i++) {
			epj_tensor *g = epj_tensor_grad(ps[i]);
			grads[arm][i] = g ? epj_tensor_ref(g) : NULL;
		}
	}
	char what[96];
	snprintf(what, sizeof what, "%s E %d k %d%s%s", epj_dtype_name(dt), E,
		 k, norm ? " norm" : "", fixed ? " fixed" : "");
	ck_assert_msg(rel_diff(ctx, route[1], route[0]) == 0,
		      "%s: routing differs", what);
	double d = rel_diff(ctx, out[1], out[0]);
	ck_assert_msg(d <= tol, "%s: output differs by %g", what, d);
	ck_assert_ptr_nonnull(dx[0]);
	ck_assert_ptr_nonnull(dx[1]);
	d = rel_diff(ctx, dx[1], dx[0]);
	ck_assert_msg(d <= tol, "%s: d/dx differs by %g", what, d);
	int with_grad = 0;
	for (int i = 0; i < np; i++) {
		ck_assert_msg((grads[0][i] == NULL) == (grads[1][i] == NULL),
			      "%s: parameter %d has a gradient in one arm "
			      "only",
			      what, i);
		if (!grads[0][i])
			continue;
		with_grad++;
		d = rel_diff(ctx, grads[1][i], grads[0][i]);
		ck_assert_msg(d <= tol,
			      "%s: gradient of parameter %d differs "
			      "by %g",
			      what, i, d);
	}
	ck_assert_int_ge(with_grad, 4); /* the gate and one expert at least */
	/* the loss (mul, sum_all) and its backward are in both counts */
	printf("autoep %s: kernels forward / backward: fused %lld / %lld, "
	       "sequence %lld / %lld\n",
	       what, (long long)fwd[1], (long long)(launches[1] - fwd[1]),
	       (long long)fwd[0], (long long)(launches[0] - fwd[0]));
	ck_assert_msg(2 * launches[1] < launches[0],
		      "%s: fused arm ran %lld kernels, sequence %lld", what,
		      (long long)launches[1], (long long)launches[0]);
	for (int arm = 0; arm < 2; arm++) {
		epj_tensor_free(out[arm]);
		epj_tensor_free(dx[arm]);
		epj_tensor_free(route[arm]);
		for (int i = 0; i < np; i++)
			epj_tensor_free(grads[arm][i]);
		free(grads[arm]);
	}
	free(ps);
	epj_tensor_free(x);
	epj_tensor_free(r);
	ej_module_free(root);
	epj_ctx_free(ctx);
}

START_TEST(test_fused_vs_sequence)
{
	/* odd token counts; with E = 7 and 5 tokens of k = 1 some experts
	 * get no token */
	fused_case(EPJ_DTYPE_F32, 3, 7, 12, 5, 6, 2, true, false, 2e-5);
	fused_case(EPJ_DTYPE_F32, 1, 5, 9, 4, 7, 1, false, false, 2e-5);
	fused_case(EPJ_DTYPE_F32, 2, 9, 8, 6, 5, 3, false, true, 2e-5);
	fused_case(EPJ_DTYPE_F64, 1, 11, 7, 3, 4, 2, true, true, 1e-12);
	/* bf16: the fused SwiGLU rounds once where the sequence rounds
	 * silu(gate) and the product separately */
	fused_case(EPJ_DTYPE_BF16, 2, 13, 16, 8, 8, 2, true, false, 3e-2);
	fused_case(EPJ_DTYPE_BF16, 2, 8, 16, 8, 4, 2, true, true, 3e-2);
}
END_TEST

/* EPJIT_AUTOEP_OPS picks the kernels when a layer is built: "sequence"
 * runs the generic ops (more launches), an unknown value is an error that
 * names the variable. */
START_TEST(test_ops_env)
{
	const char *old = getenv("EPJIT_AUTOEP_OPS");
	char *keep = old ? strdup(old) : NULL;
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "Root", NULL);
	ej_autoep_opts o = mk_opts(4, 2, true, false);
	int64_t sh[3] = { 1, 7, 6 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh);
	int64_t n[2];
	const char *val[2] = { "sequence", "fused" };
	for (int i = 0; i < 2; i++) {
		setenv("EPJIT_AUTOEP_OPS", val[i], 1);
		epj_module *m =
		    new_layer(ctx, root, val[i], 6, 5, &o, EPJ_DTYPE_F32, 0.3);
		int64_t l0 = epj_counter_get(ctx, "kernels.launched.eager");
		epj_tensor *out = call_layer(ctx, m, x);
		n[i] = epj_counter_get(ctx, "kernels.launched.eager") - l0;
		epj_tensor_free(out);
	}
	ck_assert_msg(n[1] < n[0], "fused %lld launches, sequence %lld",
		      (long long)n[1], (long long)n[0]);
	setenv("EPJIT_AUTOEP_OPS", "fast", 1);
	tu_assert_error(
	    ctx,
	    ej_autoep_new(ctx, root, "bad", 6, 5, &o, EPJ_DTYPE_F32, 0.3, NULL),
	    EPJ_ERR_CONFIG, TU_STRS("EPJIT_AUTOEP_OPS", "fast", "sequence"));
	if (keep)
		setenv("EPJIT_AUTOEP_OPS", keep, 1);
	else
		unsetenv("EPJIT_AUTOEP_OPS");
	free(keep);
	epj_tensor_free(x);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_autoep_suite(void)
{
	Suite *s = suite_create("autoep");
	TCase *tc = tcase_create("forward");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_forward_k2_norm);
	tcase_add_test(tc, test_forward_k1);
	tcase_add_test(tc, test_forward_no_norm);
	tcase_add_test(tc, test_forward_k_all);
	tcase_add_test(tc, test_forward_fixed);
	tcase_add_test(tc, test_tree_and_init);
	tcase_add_test(tc, test_fixed_routing_exact);
	tcase_add_test(tc, test_routing_deterministic);
	tcase_add_test(tc, test_counters);
	tcase_add_test(tc, test_checkpoint_replay);
	tcase_add_test(tc, test_no_grad);
	tcase_add_test(tc, test_bf16_vs_f32);
	tcase_add_test(tc, test_fused_vs_sequence);
	tcase_add_test(tc, test_ops_env);
	tcase_add_test(tc, test_select_reference);
	tcase_add_test(tc, test_scored_routing_v3);
	tcase_add_test(tc, test_balance_rule);
	suite_add_tcase(s, tc);
	TCase *tg = tcase_create("grad");
	tcase_set_timeout(tg, 60);
	tcase_add_test(tg, test_grad_topk);
	tcase_add_test(tg, test_grad_k1_no_norm);
	tcase_add_test(tg, test_grad_fixed);
	suite_add_tcase(s, tg);
	TCase *te = tcase_create("errors");
	tcase_add_test(te, test_bad_input);
	tcase_add_test(te, test_bad_options);
	tcase_add_test(te, test_multi_rank_comm_failure);
	tcase_add_test(te, test_comm_self);
	suite_add_tcase(s, te);
	return s;
}
