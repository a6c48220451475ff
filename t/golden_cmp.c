/* golden_cmp.c -- compares an epjit-train --dump-state file with a golden
 * file of Hugging Face transformers (t/golden/hf_make.py):
 *
 *   t/golden_cmp GOLDEN DUMP TOL
 *
 * Every tensor of GOLDEN (logits, loss, NAME.grad) must be in DUMP with
 * the same shape, and match it to a relative L2 difference of at most TOL,
 * ||dump - golden|| / ||golden|| (in double).  A golden tensor that is all
 * zeros (the gradient of an expert no token reached) must be zeros in the
 * dump.  Every gradient of DUMP must be in GOLDEN: a parameter the
 * reference does not have is as wrong as one that is missing.  Prints the
 * worst difference per kind (logits, loss, gradients) and the worst
 * tensor; exit 0 when all match, 1 when not, 2 on a usage or read error.
 *
 * Test code: built only for make check, never installed.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epjit.h"

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

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: golden_cmp GOLDEN DUMP TOL\n");
		return 2;
	}
	double tol = atof(argv[3]);
	epj_ctx *ctx = NULL;
	epj_st_file *g = NULL, *d = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return 2;
	if (epj_st_open(ctx, argv[1], &g) != EPJ_OK ||
	    epj_st_open(ctx, argv[2], &d) != EPJ_OK) {
		fprintf(stderr, "golden_cmp: %s\n", epj_ctx_error(ctx));
		return 2;
	}
	int bad = 0, n_grad = 0, n_other = 0;
	/* logits, loss, gradients, other tensors (a dump as the reference) */
	double worst[4] = { 0, 0, 0, 0 };
	char worst_name[256] = "";
	double worst_all = -1;
	for (int i = 0; i < epj_st_count(g); i++) {
		const char *nm = epj_st_name_at(g, i);
		epj_tensor *a = epj_st_get(ctx, g, nm);
		epj_tensor *b = a ? epj_st_get(ctx, d, nm) : NULL;
		if (!a || !b) {
			printf("MISSING %s: %s\n", nm, epj_ctx_error(ctx));
			epj_ctx_clear_error(ctx);
			epj_tensor_free(a);
			bad++;
			continue;
		}
		int same = epj_tensor_ndim(a) == epj_tensor_ndim(b);
		for (int k = 0; same && k < epj_tensor_ndim(a); k++)
			same = epj_tensor_dim(a, k) == epj_tensor_dim(b, k);
		double *va = same ? values(ctx, a) : NULL;
		double *vb = same ? values(ctx, b) : NULL;
		if (!same || !va || !vb) {
			printf("SHAPE %s: the dump's shape differs or cannot "
			       "be read\n",
			       nm);
			bad++;
		} else {
			double num = 0, den = 0;
			for (int64_t k = 0; k < epj_tensor_numel(a); k++) {
				num += (vb[k] - va[k]) * (vb[k] - va[k]);
				den += va[k] * va[k];
			}
			double rel = den > 0	? sqrt(num / den)
				     : num == 0 ? 0
						: INFINITY;
			int kind = !strcmp(nm, "logits")    ? 0
				   : !strcmp(nm, "loss")    ? 1
				   : ends_with(nm, ".grad") ? 2
							    : 3;
			n_grad += kind == 2;
			n_other += kind == 3;
			if (rel > worst[kind])
				worst[kind] = rel;
			if (rel > worst_all) {
				worst_all = rel;
				snprintf(worst_name, sizeof worst_name, "%s",
					 nm);
			}
			if (!(rel <= tol)) {
				printf("DIFF %s: relative L2 %.3e > %.1e\n", nm,
				       rel, tol);
				bad++;
			}
		}
		free(va);
		free(vb);
		epj_tensor_free(a);
		epj_tensor_free(b);
	}
	/* every gradient of the dump is one the reference has */
	int extra = 0;
	for (int i = 0; i < epj_st_count(d); i++) {
		const char *nm = epj_st_name_at(d, i);
		int found = 0;
		for (int j = 0; !found && j < epj_st_count(g); j++)
			found = !strcmp(nm, epj_st_name_at(g, j));
		if (ends_with(nm, ".grad") && !found) {
			printf("EXTRA %s: not in the reference\n", nm);
			extra++;
		}
	}
	bad += extra;
	printf("golden_cmp: logits %.3e, loss %.3e, %d gradients worst %.3e, "
	       "%d other tensors worst %.3e (worst tensor %s); tolerance "
	       "%.1e: %s\n",
	       worst[0], worst[1], n_grad, worst[2], n_other, worst[3],
	       worst_name, tol, bad ? "FAIL" : "ok");
	epj_st_close(g);
	epj_st_close(d);
	epj_ctx_free(ctx);
	return bad ? 1 : 0;
}
