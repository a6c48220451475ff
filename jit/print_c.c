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
 * stores its outputs.  Every column loop is printed twice: once for the
 * common case where all column-varying accesses have unit stride (plain
 * p[b + j] indexing that the compiler vectorises) and once with strides.
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

const char *ej_prelude_c(void)
{
	return ej_prelude_c_text;
}

typedef struct pc {
	ej_sbuf *s;
	const ej_kernel *k;
	bool *row_done;
	bool *elem_done;
	int *seen, stamp;
	bool unit; /* printing the unit-stride copy of a loop */
	int ind;   /* indent (tabs) */
} pc;

static void line(pc *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void line(pc *c, const char *fmt, ...)
{
	char buf[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof buf, fmt, ap);
	va_end(ap);
	for (int i = 0; i < c->ind; i++)
		ej_sb_puts(c->s, "\t");
	ej_sb_puts(c->s, buf);
	ej_sb_puts(c->s, "\n");
}

static const char *ctype(ej_ktype t)
{
	return t == EJ_KT_F64 ? "double" : "float";
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
		snprintf(buf, n, "(%s)NAN", ctype(t));
	else if (isinf(c))
		snprintf(buf, n, "(%s)%sINFINITY", ctype(t), c < 0 ? "-" : "");
	else
		snprintf(buf, n, "%a%s", c, suf);
}

/* Expression of load v (access a) at the current point. */
static void load_expr(pc *c, const ej_kval *x, char *buf, size_t n)
{
	const ej_kernel *k = c->k;
	const ej_kaccess *a = &k->acc[x->acc];
	epj_dtype dt = k->in[a->input].dtype;
	char idx[96];
	if (!a->elem)
		snprintf(idx, sizeof idx, "b%d", x->acc);
	else if (c->unit)
		snprintf(idx, sizeof idx, "b%d + j", x->acc);
	else
		snprintf(idx, sizeof idx, "b%d + j * s%d_%d", x->acc, x->acc,
			 k->rank - 1);
	if (dt == EPJ_DTYPE_BF16)
		snprintf(buf, n, "ej_bf2f(in%d[%s])", a->input, idx);
	else
		snprintf(buf, n, "in%d[%s]", a->input, idx);
}

/* The right-hand side of SSA value v (not reductions). */
static void rhs(pc *c, int v, char *buf, size_t n)
{
	const ej_kval *x = &c->k->v[v];
	bool d = x->t == EJ_KT_F64;
	const char *f = d ? "" : "f";	 /* libm suffix */
	const char *h = d ? "_d" : "_f"; /* prelude suffix */
	const char *one = d ? "1.0" : "1.0f";
	int a = x->a, b = x->b;
	char lit[64];
	switch (x->op) {
	case EJ_K_LOAD:
		load_expr(c, x, buf, n);
		return;
	case EJ_K_CONST:
		literal(buf, n, x->t, x->c);
		return;
	case EJ_K_ADD:
		snprintf(buf, n, "v%d + v%d", a, b);
		return;
	case EJ_K_SUB:
		snprintf(buf, n, "v%d - v%d", a, b);
		return;
	case EJ_K_MUL:
		snprintf(buf, n, "v%d * v%d", a, b);
		return;
	case EJ_K_DIV:
		snprintf(buf, n, "v%d / v%d", a, b);
		return;
	case EJ_K_EQ:
		snprintf(buf, n, "v%d == v%d ? %s : 0", a, b, one);
		return;
	case EJ_K_NEG:
		snprintf(buf, n, "-v%d", a);
		return;
	case EJ_K_EXP:
		snprintf(buf, n, "exp%s(v%d)", f, a);
		return;
	case EJ_K_LOG:
		snprintf(buf, n, "log%s(v%d)", f, a);
		return;
	case EJ_K_SQRT:
		snprintf(buf, n, "sqrt%s(v%d)", f, a);
		return;
	case EJ_K_RSQRT:
		snprintf(buf, n, "%s / sqrt%s(v%d)", one, f, a);
		return;
	case EJ_K_SILU:
		snprintf(buf, n, "ej_silu%s(v%d)", h, a);
		return;
	case EJ_K_SIGMOID:
		snprintf(buf, n, "ej_sigmoid%s(v%d)", h, a);
		return;
	case EJ_K_TANH:
		snprintf(buf, n, "tanh%s(v%d)", f, a);
		return;
	case EJ_K_GELU:
		snprintf(buf, n, "ej_gelu%s(v%d)", h, a);
		return;
	case EJ_K_SILU_BW:
		snprintf(buf, n, "ej_silu_bw%s(v%d, v%d)", h, a, b);
		return;
	case EJ_K_GELU_BW:
		snprintf(buf, n, "ej_gelu_bw%s(v%d, v%d)", h, a, b);
		return;
	case EJ_K_POWC:
		literal(lit, sizeof lit, x->t, x->c);
		snprintf(buf, n, "pow%s(v%d, %s)", f, a, lit);
		return;
	case EJ_K_RECIP:
		snprintf(buf, n, "%s / v%d", one, a);
		return;
	case EJ_K_CVT:
		snprintf(buf, n, "(%s)v%d", ctype(x->t), a);
		return;
	case EJ_K_RBF16:
		snprintf(buf, n, "ej_rbf16(v%d)", a);
		return;
	default:
		EJ_ASSERT(!"reduction has no expression");
	}
}

static void decl(pc *c, int v)
{
	char buf[256];
	rhs(c, v, buf, sizeof buf);
	line(c, "const %s v%d = %s;", ctype(c->k->v[v].t), v, buf);
}

static bool is_red(ej_kop op)
{
	return op == EJ_K_RSUM || op == EJ_K_RMAX || op == EJ_K_RMAXS;
}

/* Row value v into the row scope (once per row). */
static void need_row(pc *c, int v)
{
	const ej_kval *x = &c->k->v[v];
	if (c->row_done[v])
		return;
	EJ_ASSERT(!x->elem && !is_red(x->op));
	if (x->a >= 0)
		need_row(c, x->a);
	if (x->b >= 0)
		need_row(c, x->b);
	decl(c, v);
	c->row_done[v] = true;
}

/* Element value v into the current loop body. */
static void need_elem(pc *c, int v)
{
	const ej_kval *x = &c->k->v[v];
	if (!x->elem) {
		EJ_ASSERT(c->row_done[v]);
		return;
	}
	if (c->elem_done[v])
		return;
	if (x->a >= 0)
		need_elem(c, x->a);
	if (x->b >= 0)
		need_elem(c, x->b);
	decl(c, v);
	c->elem_done[v] = true;
}

/* Before a loop: the row values its element values read. */
static void pre_row(pc *c, int v)
{
	const ej_kval *x = &c->k->v[v];
	if (!x->elem) {
		if (!is_red(x->op))
			need_row(c, v);
		return;
	}
	if (c->seen[v] == c->stamp)
		return;
	c->seen[v] = c->stamp;
	if (x->a >= 0)
		pre_row(c, x->a);
	if (x->b >= 0)
		pre_row(c, x->b);
}

static void store(pc *c, int o, bool row)
{
	const ej_koutput *out = &c->k->out[o];
	int n = c->k->n_in + o;
	const char *idx = row ? "row" : "ob + j";
	if (out->dtype == EPJ_DTYPE_BF16)
		line(c, "out%d[%s] = ej_f2bf(v%d);", n, idx, out->v);
	else
		line(c, "out%d[%s] = v%d;", n, idx, out->v);
}

/* Body of column loop l (reductions folded, outputs stored). */
static void loop_body(pc *c, int l)
{
	const ej_kernel *k = c->k;
	memset(c->elem_done, 0, sizeof(bool) * (size_t)k->n_v);
	for (int v = 0; v < k->n_v; v++) {
		const ej_kval *x = &k->v[v];
		if (!is_red(x->op) || x->dep - 1 != l)
			continue;
		need_elem(c, x->a);
		const char *cast = k->v[x->a].t == x->t ? "" : "(double)";
		if (x->op == EJ_K_RSUM)
			line(c, "acc%d += %sv%d;", v, cast, x->a);
		else if (x->op == EJ_K_RMAX)
			line(c, "acc%d = ej_maxnan%s(acc%d, v%d);", v,
			     x->t == EJ_KT_F64 ? "_d" : "_f", v, x->a);
		else
			line(c, "acc%d = v%d > acc%d ? v%d : acc%d;", v, x->a,
			     v, x->a, v);
	}
	for (int o = 0; o < k->n_out; o++) {
		if (k->out[o].row || k->out[o].loop != l)
			continue;
		need_elem(c, k->out[o].v);
		store(c, o, false);
	}
}

static bool any_elem_access(const ej_kernel *k)
{
	for (int a = 0; a < k->n_acc; a++)
		if (k->acc[a].elem)
			return true;
	return false;
}

static void column_loop(pc *c, int l)
{
	const ej_kernel *k = c->k;
	/* row values first, then the accumulators */
	c->stamp++;
	for (int v = 0; v < k->n_v; v++)
		if (is_red(k->v[v].op) && k->v[v].dep - 1 == l)
			pre_row(c, k->v[v].a);
	for (int o = 0; o < k->n_out; o++)
		if (!k->out[o].row && k->out[o].loop == l)
			pre_row(c, k->out[o].v);
	for (int v = 0; v < k->n_v; v++) {
		const ej_kval *x = &k->v[v];
		if (!is_red(x->op) || x->dep - 1 != l)
			continue;
		if (x->op == EJ_K_RSUM)
			line(c, "double acc%d = 0;", v);
		else
			line(c, "%s acc%d = -(%s)INFINITY;", ctype(x->t), v,
			     ctype(x->t));
	}
	bool two = any_elem_access(k);
	for (int copy = 0; copy < (two ? 2 : 1); copy++) {
		c->unit = two && copy == 0;
		if (two)
			line(c, copy == 0 ? "if (unit) {" : "} else {");
		c->ind += two;
		line(c, "for (int64_t j = j0; j < j1; j++) {");
		c->ind++;
		loop_body(c, l);
		c->ind--;
		line(c, "}");
		c->ind -= two;
	}
	if (two)
		line(c, "}");
	for (int v = 0; v < k->n_v; v++) {
		const ej_kval *x = &k->v[v];
		if (!is_red(x->op) || x->dep - 1 != l)
			continue;
		line(c, "const %s v%d = acc%d;", ctype(x->t), v, v);
		c->row_done[v] = true;
	}
}

static void print_kernel(ej_sbuf *s, const ej_kernel *k)
{
	pc c = { .s = s, .k = k };
	c.row_done = calloc((size_t)k->n_v + 1, sizeof(bool));
	c.elem_done = calloc((size_t)k->n_v + 1, sizeof(bool));
	c.seen = calloc((size_t)k->n_v + 1, sizeof(int));
	EJ_ASSERT(c.row_done && c.elem_done && c.seen);
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
		line(&c, "const %s *restrict in%d = (const %s *)ptr[%d];",
		     storage_type(k->in[i].dtype), i,
		     storage_type(k->in[i].dtype), i);
	for (int o = 0; o < k->n_out; o++) {
		int n = k->n_in + o;
		line(&c, "%s *restrict out%d = (%s *)ptr[%d];",
		     storage_type(k->out[o].dtype), n,
		     storage_type(k->out[o].dtype), n);
	}
	/* strides of the mapped dims */
	for (int a = 0; a < k->n_acc; a++)
		for (int d = 0; d < EPJ_MAX_DIMS; d++)
			if (k->acc[a].map[d] >= 0)
				line(&c, "const int64_t s%d_%d = st[%d];", a,
				     k->acc[a].map[d],
				     a * r + k->acc[a].map[d]);
	if (any_elem_access(k)) {
		char cond[2048] = "1";
		size_t used = 1;
		for (int a = 0; a < k->n_acc; a++)
			if (k->acc[a].elem && used + 32 < sizeof cond)
				used += (size_t)snprintf(
				    cond + used, sizeof cond - used,
				    " && s%d_%d == 1", a, r - 1);
		line(&c, "const int unit = %s;", cond);
	}
	int64_t nblk = 1;
	if (!k->reduce && k->cols > EJ_C_BLOCK)
		nblk = (k->cols + EJ_C_BLOCK - 1) / EJ_C_BLOCK;
	int64_t units = k->rows * nblk;
	if (k->numel > EJ_C_PAR_MIN)
		line(&c, "#pragma omp parallel for schedule(static)");
	line(&c, "for (int64_t u = 0; u < %lldLL; u++) {", (long long)units);
	c.ind++;
	if (nblk > 1) {
		line(&c, "const int64_t row = u / %lldLL;", (long long)nblk);
		line(&c, "const int64_t j0 = (u %% %lldLL) * %d;",
		     (long long)nblk, EJ_C_BLOCK);
		line(&c,
		     "const int64_t j1 = j0 + %d < %lldLL ? j0 + %d : %lldLL;",
		     EJ_C_BLOCK, (long long)k->cols, EJ_C_BLOCK,
		     (long long)k->cols);
	} else {
		line(&c, "const int64_t row = u, j0 = 0, j1 = %lldLL;",
		     (long long)k->cols);
	}
	line(&c, "const int64_t ob = row * %lldLL;", (long long)k->cols);
	/* row index -> i0..i(r-2) */
	if (r > 1) {
		line(&c, "int64_t q = row;");
		for (int d = r - 2; d >= 0; d--) {
			if (d > 0) {
				line(&c, "const int64_t i%d = q %% %lldLL;", d,
				     (long long)k->size[d]);
				line(&c, "q /= %lldLL;", (long long)k->size[d]);
			} else {
				line(&c, "const int64_t i0 = q;");
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
		line(&c, "const int64_t b%d = %s;", a, used ? expr : "0");
	}
	for (int d = 0; d < r - 1; d++)
		line(&c, "(void)i%d;", d);
	line(&c, "(void)ob;");
	for (int l = 0; l < k->n_loops; l++)
		column_loop(&c, l);
	for (int o = 0; o < k->n_out; o++) {
		if (!k->out[o].row)
			continue;
		need_row(&c, k->out[o].v);
		store(&c, o, true);
	}
	c.ind--;
	line(&c, "}");
	ej_sb_puts(s, "}\n");
	free(c.row_done);
	free(c.elem_done);
	free(c.seen);
}

const char *ej_print_c(ej_arena *A, const ej_schedule *s, const char *name)
{
	ej_sbuf b = { 0 };
	ej_sb_printf(&b,
		     "/* epjit generated C (%s): graph %s, %d kernels.\n"
		     " * Build: cc -std=c11 -O3 -fPIC -shared -fopenmp. */\n",
		     EJ_CODEGEN_VERSION, name ? name : "?", s->n_kernels);
	ej_sb_puts(&b, ej_prelude_c_text);
	for (int i = 0; i < s->n_kernels; i++)
		print_kernel(&b, s->kernels[i]);
	return ej_sb_finish(&b, A);
}
