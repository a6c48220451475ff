/* print_c.c -- kernel IR -> one C11 translation unit per graph (the CPU
 * backend; compiled by the host cc with OpenMP and loaded with dlopen).
 *
 * Kernel i of the schedule becomes
 *
 *   void epjk_i(char *const *ptr, const int64_t *st)
 *     ptr: element 0 of each input, then of each output (contiguous)
 *     st:  per access a, `rank` strides in elements: st[a * rank + d]
 *
 * Shape of the code: the iteration space is rows x cols (cols = the last
 * dim, sizes are compile-time constants, strides run-time values).  The
 * outer loop runs over rows -- for pointwise kernels over (row, block of
 * EJ_C_BLOCK columns) units, so a long 1-D tensor still spreads over the
 * threads -- under `#pragma omp parallel for` when the kernel has more than
 * EJ_C_PAR_MIN elements.  A row computes its row values (loads that do not
 * vary by column, reductions, what depends only on them) in the row scope,
 * and each column loop computes the element values it needs and folds its
 * reductions (double accumulators for sums, as the reference kernels) or
 * stores its outputs (a loop with row sums runs 8 double lanes and a tail,
 * the eager row sum's order; see column_loop).  Every column loop is
 * printed twice: once for the common case where all column-varying
 * accesses have unit stride (plain p[b + j] indexing that the compiler
 * vectorises) and once with strides.
 *
 * Only the prelude (templates/prelude_c.h) is included: its text is pasted
 * at the top of the unit.
 */
#include "kir.h"

#include "../templates/prelude_c.h"

#include <math.h>
#include <stdio.h>

#define EJ_C_PAR_MIN 32768 /* elements; below this a kernel stays serial */
#define EJ_C_BLOCK   4096  /* columns per unit of a pointwise kernel */

/* Test hook, deliberately in no header: when non-NULL it replaces the
 * prelude pasted into every unit, so a test can change the generator's
 * output at run time and see that the kernel cache misses
 * (t/check_keys.c).  Not an interface of the jit. */
const char *ej_print_c_test_prelude;
const char *ej_print_c_test_prelude = NULL;

const char *ej_prelude_c(void)
{
	return ej_print_c_test_prelude ? ej_print_c_test_prelude
				       : ej_prelude_c_text;
}

static const char *storage_type(epj_dtype dt)
{
	switch (dt) {
	case EPJ_DTYPE_BF16:
		return "uint16_t";
	case EPJ_DTYPE_F64:
		return "double";
	default:
		return "float";
	}
}

/* A constant as an exact C literal of type t. */
static void literal(char *buf, size_t n, ej_ktype t, double c)
{
	const char *suf = t == EJ_KT_F32 ? "f" : "";
	if (isnan(c))
		snprintf(buf, n, "(%s)NAN", ej_kt_ctype(t));
	else if (isinf(c))
		snprintf(buf, n, "(%s)%sINFINITY", ej_kt_ctype(t),
			 c < 0 ? "-" : "");
	else
		snprintf(buf, n, "%a%s", c, suf);
}

static bool any_elem_access(const ej_kernel *k)
{
	for (int a = 0; a < k->n_acc; a++)
		if (k->acc[a].elem)
			return true;
	return false;
}

/* Row sums fold into EJ_C_LANES double lanes, lane l taking the columns
 * j0 + l, j0 + l + EJ_C_LANES, ..., and a tail for the last cols %
 * EJ_C_LANES columns, combined as the eager row sum combines them
 * (lib/ops_reduce.c, rowsum_*): the same order, so a fused sum equals the
 * op-by-op one bit for bit, and the lane loop vectorises (a strict
 * left-to-right double sum cannot, and it kept every other element
 * computation of its loop scalar). */
#define EJ_C_LANES 8

static bool loop_has_sum(const ej_kernel *k, int l)
{
	for (int v = 0; v < k->n_v; v++)
		if (k->v[v].op == EJ_K_RSUM && k->v[v].dep - 1 == l)
			return true;
	return false;
}

/* The column loop(s) of one copy: a plain loop over j0..j1, or with row
 * sums the lane loop and its tail.  Each carries EJ_IVDEP (the prelude):
 * outputs never alias inputs, and without it GCC does not vectorise a
 * kernel whose accesses need more than ten run-time alias checks. */
static void column_copy(ej_kpr *c, int l, bool lanes)
{
	if (!lanes) {
		ej_kpr_line(c, "EJ_IVDEP for (int64_t j = j0; j < j1; j++) {");
		c->ind++;
		ej_kpr_loop_body(c, l);
		c->ind--;
		ej_kpr_line(c, "}");
		return;
	}
	ej_kpr_line(c, "int64_t jb = j0;");
	ej_kpr_line(c, "for (; jb + %d <= j1; jb += %d) {", EJ_C_LANES,
		    EJ_C_LANES);
	c->ind++;
	ej_kpr_line(c, "EJ_IVDEP for (int64_t l = 0; l < %d; l++) {",
		    EJ_C_LANES);
	c->ind++;
	ej_kpr_line(c, "const int64_t j = jb + l;");
	c->acc_at = "[l]";
	ej_kpr_loop_body(c, l);
	c->ind--;
	ej_kpr_line(c, "}");
	c->ind--;
	ej_kpr_line(c, "}");
	ej_kpr_line(c, "EJ_IVDEP for (int64_t j = jb; j < j1; j++) {");
	c->ind++;
	c->acc_at = "_t";
	ej_kpr_loop_body(c, l);
	c->acc_at = NULL;
	c->ind--;
	ej_kpr_line(c, "}");
}

static void column_loop(ej_kpr *c, int l)
{
	const ej_kernel *k = c->k;
	bool lanes = loop_has_sum(k, l);
	/* row values first, then the accumulators */
	ej_kpr_pre_loop(c, l);
	for (int v = 0; v < k->n_v; v++) {
		const ej_kval *x = &k->v[v];
		if (!ej_kop_is_red(x->op) || x->dep - 1 != l)
			continue;
		if (x->op == EJ_K_RSUM)
			ej_kpr_line(c, "double acc%d[%d] = { 0 }, acc%d_t = 0;",
				    v, EJ_C_LANES, v);
		else
			ej_kpr_line(c, "%s acc%d = -(%s)INFINITY;",
				    ej_kt_ctype(x->t), v, ej_kt_ctype(x->t));
	}
	bool two = any_elem_access(k);
	for (int copy = 0; copy < (two ? 2 : 1); copy++) {
		c->unit = two && copy == 0;
		if (two)
			ej_kpr_line(c, copy == 0 ? "if (unit) {" : "} else {");
		c->ind += two;
		column_copy(c, l, lanes);
		c->ind -= two;
	}
	if (two)
		ej_kpr_line(c, "}");
	for (int v = 0; v < k->n_v; v++) {
		const ej_kval *x = &k->v[v];
		if (!ej_kop_is_red(x->op) || x->dep - 1 != l)
			continue;
		if (x->op == EJ_K_RSUM)
			ej_kpr_line(c,
				    "const double v%d = ((acc%d[0] + acc%d[4]) "
				    "+ (acc%d[1] + acc%d[5])) + ((acc%d[2] + "
				    "acc%d[6]) + (acc%d[3] + acc%d[7])) + "
				    "acc%d_t;",
				    v, v, v, v, v, v, v, v, v, v);
		else
			ej_kpr_line(c, "const %s v%d = acc%d;",
				    ej_kt_ctype(x->t), v, v);
		c->row_done[v] = true;
	}
}

static void print_kernel(ej_sbuf *s, const ej_kernel *k)
{
	ej_kpr c;
	ej_kpr_init(&c, s, k);
	c.literal = c.constant = literal;
	int r = k->rank;
	ej_sb_printf(s, "\n/* kernel %d: %s, space [", k->id,
		     k->reduce ? "row reduction" : "pointwise");
	for (int d = 0; d < r; d++)
		ej_sb_printf(s, "%s%lld", d ? "," : "", (long long)k->size[d]);
	ej_sb_printf(s, "], %d inputs, %d outputs */\n", k->n_in, k->n_out);
	ej_sb_printf(
	    s, "void epjk_%d(char *const *ptr, const int64_t *st)\n{\n", k->id);
	c.ind = 1;
	for (int i = 0; i < k->n_in; i++)
		ej_kpr_line(&c,
			    "const %s *restrict in%d = (const %s *)ptr[%d];",
			    storage_type(k->in[i].dtype), i,
			    storage_type(k->in[i].dtype), i);
	for (int o = 0; o < k->n_out; o++) {
		int n = k->n_in + o;
		ej_kpr_line(&c, "%s *restrict out%d = (%s *)ptr[%d];",
			    storage_type(k->out[o].dtype), n,
			    storage_type(k->out[o].dtype), n);
	}
	/* strides of the mapped dims */
	for (int a = 0; a < k->n_acc; a++)
		for (int d = 0; d < EPJ_MAX_DIMS; d++)
			if (k->acc[a].map[d] >= 0)
				ej_kpr_line(
				    &c, "const int64_t s%d_%d = st[%d];", a,
				    k->acc[a].map[d], a * r + k->acc[a].map[d]);
	if (any_elem_access(k)) {
		char cond[2048] = "1";
		size_t used = 1;
		for (int a = 0; a < k->n_acc; a++)
			if (k->acc[a].elem && used + 32 < sizeof cond)
				used += (size_t)snprintf(
				    cond + used, sizeof cond - used,
				    " && s%d_%d == 1", a, r - 1);
		ej_kpr_line(&c, "const int unit = %s;", cond);
	}
	int64_t nblk = 1;
	if (!k->reduce && k->cols > EJ_C_BLOCK)
		nblk = (k->cols + EJ_C_BLOCK - 1) / EJ_C_BLOCK;
	int64_t units = k->rows * nblk;
	if (k->numel > EJ_C_PAR_MIN)
		ej_kpr_line(&c, "#pragma omp parallel for schedule(static)");
	ej_kpr_line(&c, "for (int64_t u = 0; u < %lldLL; u++) {",
		    (long long)units);
	c.ind++;
	if (nblk > 1) {
		ej_kpr_line(&c, "const int64_t row = u / %lldLL;",
			    (long long)nblk);
		ej_kpr_line(&c, "const int64_t j0 = (u %% %lldLL) * %d;",
			    (long long)nblk, EJ_C_BLOCK);
		ej_kpr_line(
		    &c,
		    "const int64_t j1 = j0 + %d < %lldLL ? j0 + %d : %lldLL;",
		    EJ_C_BLOCK, (long long)k->cols, EJ_C_BLOCK,
		    (long long)k->cols);
	} else {
		ej_kpr_line(&c, "const int64_t row = u, j0 = 0, j1 = %lldLL;",
			    (long long)k->cols);
	}
	ej_kpr_line(&c, "const int64_t ob = row * %lldLL;", (long long)k->cols);
	/* row index -> i0..i(r-2) */
	if (r > 1) {
		ej_kpr_line(&c, "int64_t q = row;");
		for (int d = r - 2; d >= 0; d--) {
			if (d > 0) {
				ej_kpr_line(&c,
					    "const int64_t i%d = q %% %lldLL;",
					    d, (long long)k->size[d]);
				ej_kpr_line(&c, "q /= %lldLL;",
					    (long long)k->size[d]);
			} else {
				ej_kpr_line(&c, "const int64_t i0 = q;");
			}
		}
	}
	for (int a = 0; a < k->n_acc; a++) {
		char expr[512] = "";
		size_t used = 0;
		for (int d = 0; d < EPJ_MAX_DIMS; d++) {
			int m = k->acc[a].map[d];
			if (m < 0 || m == r - 1 || used + 64 > sizeof expr)
				continue;
			used += (size_t)snprintf(
			    expr + used, sizeof expr - used, "%si%d * s%d_%d",
			    used ? " + " : "", m, a, m);
		}
		ej_kpr_line(&c, "const int64_t b%d = %s;", a,
			    used ? expr : "0");
	}
	for (int d = 0; d < r - 1; d++)
		ej_kpr_line(&c, "(void)i%d;", d);
	ej_kpr_line(&c, "(void)ob;");
	for (int l = 0; l < k->n_loops; l++)
		column_loop(&c, l);
	for (int o = 0; o < k->n_out; o++) {
		if (!k->out[o].row)
			continue;
		ej_kpr_need_row(&c, k->out[o].v);
		ej_kpr_store(&c, o, "row");
	}
	c.ind--;
	ej_kpr_line(&c, "}");
	ej_sb_puts(s, "}\n");
	ej_kpr_fini(&c);
}

const char *ej_print_c(ej_arena *A, const ej_schedule *s, const char *name)
{
	ej_sbuf b = { 0 };
	ej_sb_printf(&b,
		     "/* epjit generated C: graph %s, %d kernels.\n"
		     " * Build: cc -std=c11 -O3 -fPIC -shared -fopenmp. */\n",
		     name ? name : "?", s->n_kernels);
	ej_sb_puts(&b, ej_prelude_c());
	for (int i = 0; i < s->n_kernels; i++)
		print_kernel(&b, s->kernels[i]);
	return ej_sb_finish(&b, A);
}
