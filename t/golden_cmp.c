/* golden_cmp.c -- compares an epjit-train --dump-state file with a golden
 * file of Hugging Face transformers (t/golden/hf_make.py):
 *
 *   t/golden_cmp GOLDEN DUMP         a tolerance per tensor, derived below
 *   t/golden_cmp GOLDEN DUMP TOL     one tolerance for every tensor (0:
 *                                    the very same values)
 *
 * Every tensor of GOLDEN (logits, loss, NAME.grad) must be in DUMP with
 * the same shape, and match it to a relative L2 difference of at most its
 * tolerance, ||dump - golden|| / ||golden|| (in double).  A golden tensor
 * that is all zeros (the gradient of an expert no token reached) must be
 * zeros in the dump.  Every gradient of DUMP must be in GOLDEN: a
 * parameter the reference does not have is as wrong as one that is
 * missing.  Prints the worst difference per kind (logits, loss,
 * gradients) and the tensor nearest its tolerance; exit 0 when all match,
 * 1 when not, 2 on a usage or read error.
 *
 * The derived tolerance (doc/testing.md, "How close to transformers").  A
 * value computed with unit roundoff u through reductions of total length
 * K (a dot product of length k adds k) is off by about u sqrt(K) relative
 * when the roundings are independent (Higham and Mary's probabilistic
 * bound; u K is the worst case, never approached by blocked sums); the
 * conditioning of the tensor (terms that cancel) and the constant of the
 * bound are the safety factor S.  Per tensor
 *
 *   tol = S sqrt(K (a_d^2 + a_g^2) + D (r_d^2 + r_g^2)),  S = 10
 *
 * a: the unit roundoff of the accumulations, r: that of the values each of
 * the D operations on the path reads and writes; _d the dump's, _g the
 * golden's.  f32: a = r = 2^-24; bf16 (the dump's metadata bf16 "true":
 * bf16 values, f32 accumulation): a = 2^-24, r = 2^-8; f64: 2^-53.  The
 * golden's precision is its metadata "compute" (hf_make.py writes "F64"),
 * else that of its tensors' dtype, F64 counted as F32 (goldens computed
 * partly in f32 stored as F64); the dump's is its metadata "compute", else
 * bf16 when its metadata says so, else its tensors' dtype.
 *
 * K and D are counted from the golden's own names and shapes (no config
 * needed): the logits [B, T, V] give the tokens N = B T; each gradient
 * tensor [o, i...] (the routed experts of a layer once: they run side by
 * side) is one operation with a reduction of its fan-in i... forward and
 * of its fan-out o backward (1-D: its length both ways, a bias none); each
 * layer model.layers.L adds T both ways (attention or a recurrence over
 * the sequence); the other tensors (final norm, lm_head) are the top,
 * which adds V forward (the softmax of the loss).  Every value depends on
 * the whole forward, Kf = the sum of all forward reductions; the gradient
 * of a tensor of layer L also on the backward of the top and of the
 * layers from L up, and on its own sum over the N tokens:
 *   logits, loss:      K = Kf
 *   layer L:           K = Kf + Kb(top) + sum over l >= L of Kb(l) + N
 *   the top:           K = Kf + Kb(top) + N
 *   the embedding:     K = Kf + Kb(top) + sum over all l of Kb(l) + N
 * D likewise, with 1 per tensor (and 1 per layer) for each reduction.
 *
 * Test code: built only for make check, never installed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epjit.h"

#define SAFETY	  10.0
#define MAX_LAYER 4096

/* Unit roundoff: of the accumulations (acc) and of the stored values. */
typedef struct {
	double acc, val;
	const char *name;
} precision;

/* Forward and backward reduction lengths (k) and operation counts (d). */
typedef struct {
	double kf, kb, df, db;
} path;

typedef struct {
	path layer[MAX_LAYER], top;
	int nlayer;
	double ntok; /* B T */
	path fwd;    /* the whole forward */
} model_paths;

static double *values(epj_ctx *ctx, epj_tensor *t)
{
	int64_t n = epj_tensor_numel(t);
	double *v = malloc(sizeof *v * (size_t)(n > 0 ? n : 1));
	if (v && epj_tensor_to_f64(ctx, t, v) != EPJ_OK) {
		free(v);
		v = NULL;
	}
	return v;
}

static int ends_with(const char *s, const char *suf)
{
	size_t a = strlen(s), b = strlen(suf);
	return a >= b && !strcmp(s + a - b, suf);
}

static precision precision_named(const char *s)
{
	if (s && !strcmp(s, "F64"))
		return (precision){ ldexp(1, -53), ldexp(1, -53), "f64" };
	if (s && !strcmp(s, "BF16"))
		return (precision){ ldexp(1, -24), ldexp(1, -8), "bf16" };
	return (precision){ ldexp(1, -24), ldexp(1, -24), "f32" };
}

/* The precision file f was computed in (see the header comment); a
 * golden's F64 tensors without "compute" count as f32. */
static precision precision_of(const epj_st_file *f, int golden)
{
	const char *c = epj_st_metadata(f, "compute");
	if (c)
		return precision_named(c);
	const char *b = epj_st_metadata(f, "bf16");
	if (!golden && b && !strcmp(b, "true"))
		return precision_named("BF16");
	int i = epj_st_find(f, "logits");
	const char *dt = i >= 0 ? epj_st_dtype_str_at(f, i) : "F32";
	return precision_named(golden && !strcmp(dt, "F64") ? "F32" : dt);
}

/* The layer of a tensor name, -1 for the embedding, -2 for the top. */
static int layer_of(const char *nm)
{
	const char *p = strstr(nm, "layers.");
	if (p) {
		char *end;
		long l = strtol(p + 7, &end, 10);
		if (end != p + 7 && *end == '.' && l >= 0 && l < MAX_LAYER)
			return (int)l;
	}
	return strstr(nm, "embed_tokens") ? -1 : -2;
}

/* nm with ".experts.<n>." as ".experts.*." (the routed experts of a layer
 * run side by side: on the path once). */
static void expert_key(const char *nm, char *out, size_t cap)
{
	snprintf(out, cap, "%s", nm);
	char *p = strstr(out, ".experts.");
	if (!p)
		return;
	char *q = p + 9, *e = q;
	while (*e >= '0' && *e <= '9')
		e++;
	if (e > q && *e == '.') {
		*q = '*';
		memmove(q + 1, e, strlen(e) + 1);
	}
}

/* Counts the paths of every layer and the top from g's gradient shapes
 * and its logits [B, T, V]; 0, or -1 without logits of rank 3. */
static int paths_count(const epj_st_file *g, model_paths *m)
{
	memset(m, 0, sizeof *m);
	int li = epj_st_find(g, "logits");
	if (li < 0 || epj_st_ndim_at(g, li) != 3)
		return -1;
	const int64_t *ls = epj_st_shape_at(g, li);
	double T = (double)ls[1], V = (double)ls[2];
	m->ntok = (double)ls[0] * T;
	m->top = (path){ V, 0, 1, 0 }; /* the softmax of the loss */
	int n = epj_st_count(g), nkeys = 0;
	char(*keys)[256] = calloc((size_t)(n > 0 ? n : 1), sizeof *keys);
	if (!keys)
		return -1;
	for (int i = 0; i < n; i++) {
		const char *nm = epj_st_name_at(g, i);
		int l = layer_of(nm), nd = epj_st_ndim_at(g, i), dup = 0;
		if (!ends_with(nm, ".grad") || l == -1)
			continue;
		expert_key(nm, keys[nkeys], sizeof keys[nkeys]);
		for (int k = 0; k < nkeys && !dup; k++)
			dup = !strcmp(keys[k], keys[nkeys]);
		if (dup)
			continue;
		nkeys++;
		const int64_t *s = epj_st_shape_at(g, i);
		double out = nd > 0 ? (double)s[0] : 1, in = 1;
		for (int k = 1; k < nd; k++)
			in *= (double)s[k];
		if (nd <= 1)
			in = out = ends_with(nm, ".bias.grad") ? 0 : out;
		path *p = l >= 0 ? &m->layer[l] : &m->top;
		if (l >= 0 && p->df == 0) /* the layer's mixing over T */
			*p = (path){ T, T, 1, 1 };
		if (l >= m->nlayer)
			m->nlayer = l + 1;
		p->kf += in;
		p->kb += out;
		p->df += 1;
		p->db += 1;
	}
	free(keys);
	m->fwd = (path){ m->top.kf, 0, m->top.df, 0 };
	for (int l = 0; l < m->nlayer; l++) {
		m->fwd.kf += m->layer[l].kf;
		m->fwd.df += m->layer[l].df;
	}
	return 0;
}

/* The derived tolerance of tensor nm (see the header comment); *K, *D the
 * path's reduction length and operation count. */
static double derived_tol(const model_paths *m, const char *nm, precision d,
			  precision g, double *K, double *D)
{
	*K = m->fwd.kf;
	*D = m->fwd.df;
	if (strcmp(nm, "logits") && strcmp(nm, "loss")) {
		int l = layer_of(nm);
		int from = l >= 0 ? l : l == -1 ? 0 : m->nlayer;
		*K += m->top.kb + m->ntok;
		*D += m->top.db + 1;
		for (int j = from; j < m->nlayer; j++) {
			*K += m->layer[j].kb;
			*D += m->layer[j].db;
		}
	}
	double a2 = d.acc * d.acc + g.acc * g.acc;
	double r2 = d.val * d.val + g.val * g.val;
	return SAFETY * sqrt(*K * a2 + *D * r2);
}

/* ||b - a|| / ||a||; 0 when both are zeros, infinity when only a is or
 * when a value is not finite (NaN would compare as no difference). */
static double rel_l2(const double *a, const double *b, int64_t n)
{
	double num = 0, den = 0;
	for (int64_t k = 0; k < n; k++) {
		num += (b[k] - a[k]) * (b[k] - a[k]);
		den += a[k] * a[k];
	}
	if (!isfinite(num) || !isfinite(den))
		return INFINITY;
	return den > 0 ? sqrt(num / den) : num == 0 ? 0 : INFINITY;
}

/* The relative L2 difference of tensor nm between g and d; -1 (with a
 * line printed) when it is missing or its shape differs. */
static double compare_one(epj_ctx *ctx, epj_st_file *g, epj_st_file *d,
			  const char *nm)
{
	epj_tensor *a = epj_st_get(ctx, g, nm);
	epj_tensor *b = a ? epj_st_get(ctx, d, nm) : NULL;
	if (!a || !b) {
		printf("MISSING %s: %s\n", nm, epj_ctx_error(ctx));
		epj_ctx_clear_error(ctx);
		epj_tensor_free(a);
		return -1;
	}
	int same = epj_tensor_ndim(a) == epj_tensor_ndim(b);
	for (int k = 0; same && k < epj_tensor_ndim(a); k++)
		same = epj_tensor_dim(a, k) == epj_tensor_dim(b, k);
	double *va = same ? values(ctx, a) : NULL;
	double *vb = same ? values(ctx, b) : NULL;
	double rel = -1;
	if (!same || !va || !vb)
		printf("SHAPE %s: the dump's shape differs or cannot be read\n",
		       nm);
	else
		rel = rel_l2(va, vb, epj_tensor_numel(a));
	free(va);
	free(vb);
	epj_tensor_free(a);
	epj_tensor_free(b);
	return rel;
}

/* Every gradient of d is one g has; the number that is not. */
static int extra_grads(const epj_st_file *g, const epj_st_file *d)
{
	int extra = 0;
	for (int i = 0; i < epj_st_count(d); i++) {
		const char *nm = epj_st_name_at(d, i);
		if (ends_with(nm, ".grad") && epj_st_find(g, nm) < 0) {
			printf("EXTRA %s: not in the reference\n", nm);
			extra++;
		}
	}
	return extra;
}

/* Compares every tensor of g with d; fixed >= 0: that tolerance for all,
 * else derived ones.  Returns the number of failures, -1 when the
 * tolerances cannot be derived. */
static int compare(epj_ctx *ctx, epj_st_file *g, epj_st_file *d, double fixed)
{
	static model_paths m;
	precision pd = precision_of(d, 0), pg = precision_of(g, 1);
	if (fixed < 0 && paths_count(g, &m) != 0) {
		fprintf(stderr, "golden_cmp: derived tolerances need the "
				"golden's logits [B, T, V]\n");
		return -1;
	}
	int bad = 0, n_grad = 0, n_other = 0;
	/* logits, loss, gradients, other tensors (a dump as the reference) */
	double worst[4] = { 0, 0, 0, 0 }, worst_frac = -1;
	double tmin = INFINITY, tmax = 0;
	char worst_name[256] = "";
	for (int i = 0; i < epj_st_count(g); i++) {
		const char *nm = epj_st_name_at(g, i);
		double K = 0, D = 0, tol = fixed;
		if (fixed < 0)
			tol = derived_tol(&m, nm, pd, pg, &K, &D);
		tmin = tol < tmin ? tol : tmin;
		tmax = tol > tmax ? tol : tmax;
		double rel = compare_one(ctx, g, d, nm);
		if (rel < 0) {
			bad++;
			continue;
		}
		int kind = !strcmp(nm, "logits")    ? 0
			   : !strcmp(nm, "loss")    ? 1
			   : ends_with(nm, ".grad") ? 2
						    : 3;
		n_grad += kind == 2;
		n_other += kind == 3;
		worst[kind] = rel > worst[kind] ? rel : worst[kind];
		double frac = tol > 0 ? rel / tol : rel > 0 ? INFINITY : 0;
		if (frac > worst_frac) {
			worst_frac = frac;
			snprintf(worst_name, sizeof worst_name, "%s", nm);
		}
		if (!(rel <= tol)) {
			printf("DIFF %s: relative L2 %.3e > %.3e", nm, rel,
			       tol);
			if (fixed < 0)
				printf(" (K %.0f, D %.0f)", K, D);
			printf("\n");
			bad++;
		}
	}
	bad += extra_grads(g, d);
	printf("golden_cmp: logits %.3e, loss %.3e, %d gradients worst %.3e, "
	       "%d other tensors worst %.3e (worst tensor %s, %.2f of its "
	       "tolerance); ",
	       worst[0], worst[1], n_grad, worst[2], n_other, worst[3],
	       worst_name, worst_frac);
	if (fixed >= 0)
		printf("tolerance %.1e", fixed);
	else
		printf("tolerances %.1e to %.1e (%s against %s, S %.0f)", tmin,
		       tmax, pd.name, pg.name, SAFETY);
	printf(": %s\n", bad ? "FAIL" : "ok");
	return bad;
}

int main(int argc, char **argv)
{
	char *end = NULL;
	double fixed = -1;
	if (argc == 4)
		fixed = strtod(argv[3], &end);
	if ((argc != 3 && argc != 4) ||
	    (argc == 4 && (end == argv[3] || *end || !(fixed >= 0)))) {
		fprintf(stderr, "usage: golden_cmp GOLDEN DUMP [TOL]\n");
		return 2;
	}
	epj_ctx *ctx = NULL;
	epj_st_file *g = NULL, *d = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return 2;
	if (epj_st_open(ctx, argv[1], &g) != EPJ_OK ||
	    epj_st_open(ctx, argv[2], &d) != EPJ_OK) {
		fprintf(stderr, "golden_cmp: %s\n", epj_ctx_error(ctx));
		epj_st_close(g);
		epj_ctx_free(ctx);
		return 2;
	}
	int bad = compare(ctx, g, d, fixed);
	epj_st_close(g);
	epj_st_close(d);
	epj_ctx_free(ctx);
	return bad < 0 ? 2 : bad ? 1 : 0;
}
