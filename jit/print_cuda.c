/* print_cuda.c -- kernel IR -> CUDA C for NVRTC: one translation unit per
 * graph, one `extern "C" __global__` kernel per fused kernel.  GEMM,
 * attention and the other extern nodes are not printed (they stay host-side
 * calls); only our prelude (templates/prelude_cuda.h) is included, so NVRTC
 * needs no toolkit header.
 *
 * Calling convention: kernel i takes one struct by value,
 *
 *   struct ej_kargs_i { const T *in0; ...; T *out<n_in>; ...;
 *                       long long st[n_acc * rank]; };
 *
 * (pointers to element 0, strides in elements per access and iteration
 * dim, as the C backend's st[]), launched with ej_cuda_launch_dims().
 *
 * Index math is 32-bit (int) when the space and every input have fewer than
 * 2^31 elements, else 64-bit.  Contract for the launcher: in 32-bit mode
 * every access's largest element offset must fit in an int (true for any
 * input whose shape fits unless it is a view into a larger storage: such an
 * input is made contiguous first).
 *
 * Pointwise kernels: grid-stride over units of V consecutive columns of a
 * row (V = 16 bytes / the widest element read or written by column, so the
 * widest stream moves in 16-byte loads: float4, 8 x bf16, double2; narrower
 * ones in 8- or 4-byte loads).  A unit whose column-varying inputs and
 * outputs have unit column stride and 16-byte aligned addresses takes the
 * vector path; any other unit (a misaligned view, the end of a row whose
 * length is not a multiple of V: the scalar tail) runs scalar with
 * strides.
 *
 * Row kernels: a block per row (grid-stride over rows), blockDim.x =
 * EJ_TPB(cols) threads striding over the columns in every column loop;
 * each reduction ends with a block reduction (warp shuffles, then shared
 * memory across warps) that hands the row's value to every thread, which
 * then computes the row values redundantly.  Row outputs are stored by
 * thread 0.
 */
#include "kir.h"

#include "../templates/prelude_cuda.h"

#include <math.h>
#include <stdio.h>

#define CU_PW_TPB   256
#define CU_MAX_GRID 65535u

const char *ej_prelude_cuda(void)
{
	return ej_prelude_cuda_text;
}

/* Threads of a row kernel: a power of two from 32 to 256 covering cols. */
static unsigned row_tpb(int64_t cols)
{
	unsigned t = 32;
	while (t < 256 && (int64_t)t < cols)
		t *= 2;
	return t;
}

static size_t dt_size(epj_dtype dt)
{
	return dt == EPJ_DTYPE_BF16 ? 2 : dt == EPJ_DTYPE_F64 ? 8 : 4;
}

/* Lanes of a pointwise kernel's vector path (1: none). */
static int vec_lanes(const ej_kernel *k)
{
	if (k->reduce)
		return 1;
	size_t wide = 0;
	for (int a = 0; a < k->n_acc; a++)
		if (k->acc[a].elem &&
		    dt_size(k->in[k->acc[a].input].dtype) > wide)
			wide = dt_size(k->in[k->acc[a].input].dtype);
	for (int o = 0; o < k->n_out; o++)
		if (dt_size(k->out[o].dtype) > wide)
			wide = dt_size(k->out[o].dtype);
	int v = (int)(16 / wide);
	/* no vector path when a row is shorter than one vector */
	return k->cols >= v ? v : 1;
}

void ej_cuda_launch_dims(const ej_kernel *k, unsigned grid[3],
			 unsigned block[3])
{
	grid[1] = grid[2] = block[1] = block[2] = 1;
	if (k->reduce) {
		block[0] = row_tpb(k->cols);
		grid[0] =
		    k->rows < CU_MAX_GRID ? (unsigned)k->rows : CU_MAX_GRID;
		return;
	}
	int v = vec_lanes(k);
	int64_t upr = (k->cols + v - 1) / v;
	int64_t units = k->rows * upr;
	int64_t blocks = (units + CU_PW_TPB - 1) / CU_PW_TPB;
	block[0] = CU_PW_TPB;
	grid[0] = blocks < CU_MAX_GRID ? (unsigned)blocks : CU_MAX_GRID;
}

typedef struct cu {
	ej_sbuf *s;
	const ej_kernel *k;
	const char *idx; /* "int" or "long long" */
	bool *row_done;
	int *elem_done; /* per value: stamp of the body that has it */
	int body;
	int *seen, stamp;
	int lane;  /* vector path: lane being printed; -1 scalar */
	int lanes; /* V */
	int ind;
} cu;

static void line(cu *c, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void line(cu *c, const char *fmt, ...)
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

static const char *stype(epj_dtype dt)
{
	return dt == EPJ_DTYPE_BF16  ? "ej_bf16"
	       : dt == EPJ_DTYPE_F64 ? "double"
				     : "float";
}

static const char *vsuffix(epj_dtype dt)
{
	return dt == EPJ_DTYPE_BF16  ? "bf16"
	       : dt == EPJ_DTYPE_F64 ? "f64"
				     : "f32";
}

/* Exact literal: the bit pattern through an intrinsic (no hex floats, no
 * math.h macros). */
static void literal(char *buf, size_t n, ej_ktype t, double c)
{
	if (t == EJ_KT_F32) {
		float f = (float)c;
		uint32_t u;
		memcpy(&u, &f, sizeof u);
		if (f == (float)(int)f && fabsf(f) < 1e6f)
			snprintf(buf, n, "%d.0f", (int)f);
		else
			snprintf(buf, n, "__int_as_float(0x%08x)", u);
	} else {
		uint64_t u;
		memcpy(&u, &c, sizeof u);
		if (c == (double)(int)c && fabs(c) < 1e6)
			snprintf(buf, n, "%d.0", (int)c);
		else
			snprintf(buf, n, "__longlong_as_double(0x%016llxLL)",
				 (unsigned long long)u);
	}
}

/* Name of value v at the current lane. */
static void vname(const cu *c, int v, char *buf, size_t n)
{
	if (c->lane >= 0 && c->k->v[v].elem)
		snprintf(buf, n, "v%d_%d", v, c->lane);
	else
		snprintf(buf, n, "v%d", v);
}

static void load_expr(cu *c, const ej_kval *x, char *buf, size_t n)
{
	const ej_kernel *k = c->k;
	const ej_kaccess *a = &k->acc[x->acc];
	epj_dtype dt = k->in[a->input].dtype;
	if (a->elem && c->lane >= 0) { /* unpacked by the vector load */
		snprintf(buf, n, "l%d[%d]", x->acc, c->lane);
		return;
	}
	char idx[96];
	if (!a->elem)
		snprintf(idx, sizeof idx, "b%d", x->acc);
	else
		snprintf(idx, sizeof idx, "b%d + j * s%d_%d", x->acc, x->acc,
			 k->rank - 1);
	if (dt == EPJ_DTYPE_BF16)
		snprintf(buf, n, "ej_bf2f(in%d[%s])", a->input, idx);
	else
		snprintf(buf, n, "in%d[%s]", a->input, idx);
}

static void rhs(cu *c, int v, char *buf, size_t n)
{
	const ej_kval *x = &c->k->v[v];
	bool d = x->t == EJ_KT_F64;
	const char *f = d ? "" : "f";
	const char *h = d ? "_d" : "_f";
	const char *one = d ? "1.0" : "1.0f";
	char a[32] = "", b[32] = "", lit[64];
	if (x->a >= 0)
		vname(c, x->a, a, sizeof a);
	if (x->b >= 0)
		vname(c, x->b, b, sizeof b);
	switch (x->op) {
	case EJ_K_LOAD:
		load_expr(c, x, buf, n);
		return;
	case EJ_K_CONST:
		literal(buf, n, x->t, x->c);
		if (isinf(x->c))
			snprintf(buf, n, "%sej_inf%s()", x->c < 0 ? "-" : "",
				 h);
		else if (isnan(x->c))
			snprintf(buf, n, "(ej_inf%s() - ej_inf%s())", h, h);
		return;
	case EJ_K_ADD:
		snprintf(buf, n, "%s + %s", a, b);
		return;
	case EJ_K_SUB:
		snprintf(buf, n, "%s - %s", a, b);
		return;
	case EJ_K_MUL:
		snprintf(buf, n, "%s * %s", a, b);
		return;
	case EJ_K_DIV:
		snprintf(buf, n, "%s / %s", a, b);
		return;
	case EJ_K_EQ:
		snprintf(buf, n, "%s == %s ? %s : %s", a, b, one,
			 d ? "0.0" : "0.0f");
		return;
	case EJ_K_NEG:
		snprintf(buf, n, "-%s", a);
		return;
	case EJ_K_EXP:
		snprintf(buf, n, "exp%s(%s)", f, a);
		return;
	case EJ_K_LOG:
		snprintf(buf, n, "log%s(%s)", f, a);
		return;
	case EJ_K_SQRT:
		snprintf(buf, n, "sqrt%s(%s)", f, a);
		return;
	case EJ_K_RSQRT:
		snprintf(buf, n, "%s / sqrt%s(%s)", one, f, a);
		return;
	case EJ_K_SILU:
		snprintf(buf, n, "ej_silu%s(%s)", h, a);
		return;
	case EJ_K_SIGMOID:
		snprintf(buf, n, "ej_sigmoid%s(%s)", h, a);
		return;
	case EJ_K_TANH:
		snprintf(buf, n, "tanh%s(%s)", f, a);
		return;
	case EJ_K_GELU:
		snprintf(buf, n, "ej_gelu%s(%s)", h, a);
		return;
	case EJ_K_SILU_BW:
		snprintf(buf, n, "ej_silu_bw%s(%s, %s)", h, a, b);
		return;
	case EJ_K_GELU_BW:
		snprintf(buf, n, "ej_gelu_bw%s(%s, %s)", h, a, b);
		return;
	case EJ_K_POWC:
		literal(lit, sizeof lit, x->t, x->c);
		snprintf(buf, n, "pow%s(%s, %s)", f, a, lit);
		return;
	case EJ_K_RECIP:
		snprintf(buf, n, "%s / %s", one, a);
		return;
	case EJ_K_CVT:
		snprintf(buf, n, "(%s)%s", ctype(x->t), a);
		return;
	case EJ_K_RBF16:
		snprintf(buf, n, "ej_rbf16(%s)", a);
		return;
	default:
		EJ_ASSERT(!"reduction has no expression");
	}
}

static void decl(cu *c, int v)
{
	char buf[256], name[32];
	rhs(c, v, buf, sizeof buf);
	vname(c, v, name, sizeof name);
	line(c, "const %s %s = %s;", ctype(c->k->v[v].t), name, buf);
}

static bool is_red(ej_kop op)
{
	return op == EJ_K_RSUM || op == EJ_K_RMAX || op == EJ_K_RMAXS;
}

static void need_row(cu *c, int v)
{
	const ej_kval *x = &c->k->v[v];
	if (c->row_done[v])
		return;
	EJ_ASSERT(!x->elem && !is_red(x->op));
	if (x->a >= 0)
		need_row(c, x->a);
	if (x->b >= 0)
		need_row(c, x->b);
	int lane = c->lane;
	c->lane = -1;
	decl(c, v);
	c->lane = lane;
	c->row_done[v] = true;
}

static void need_elem(cu *c, int v)
{
	const ej_kval *x = &c->k->v[v];
	if (!x->elem) {
		EJ_ASSERT(c->row_done[v]);
		return;
	}
	if (c->elem_done[v] == c->body)
		return;
	if (x->a >= 0)
		need_elem(c, x->a);
	if (x->b >= 0)
		need_elem(c, x->b);
	decl(c, v);
	c->elem_done[v] = c->body;
}

static void pre_row(cu *c, int v)
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

static void store_scalar(cu *c, int o, const char *idx)
{
	const ej_koutput *out = &c->k->out[o];
	char name[32];
	vname(c, out->v, name, sizeof name);
	int n = c->k->n_in + o;
	if (out->dtype == EPJ_DTYPE_BF16)
		line(c, "out%d[%s] = ej_f2bf(%s);", n, idx, name);
	else
		line(c, "out%d[%s] = %s;", n, idx, name);
}

/* ---- shared prologue ---------------------------------------------------- */

static void kargs_struct(cu *c)
{
	const ej_kernel *k = c->k;
	ej_sb_printf(c->s, "struct ej_kargs_%d {\n", k->id);
	for (int i = 0; i < k->n_in; i++)
		ej_sb_printf(c->s, "\tconst %s *in%d;\n", stype(k->in[i].dtype),
			     i);
	for (int o = 0; o < k->n_out; o++)
		ej_sb_printf(c->s, "\t%s *out%d;\n", stype(k->out[o].dtype),
			     k->n_in + o);
	int ns = k->n_acc * k->rank;
	ej_sb_printf(c->s, "\tlong long st[%d];\n};\n", ns > 0 ? ns : 1);
}

static void prologue(cu *c)
{
	const ej_kernel *k = c->k;
	int r = k->rank;
	for (int i = 0; i < k->n_in; i++)
		line(c, "const %s *__restrict__ in%d = a.in%d;",
		     stype(k->in[i].dtype), i, i);
	for (int o = 0; o < k->n_out; o++)
		line(c, "%s *__restrict__ out%d = a.out%d;",
		     stype(k->out[o].dtype), k->n_in + o, k->n_in + o);
	for (int x = 0; x < k->n_acc; x++)
		for (int d = 0; d < EPJ_MAX_DIMS; d++)
			if (k->acc[x].map[d] >= 0)
				line(c, "const %s s%d_%d = (%s)a.st[%d];",
				     c->idx, x, k->acc[x].map[d], c->idx,
				     x * r + k->acc[x].map[d]);
}

/* row index `row` -> i0..i(r-2) and the bases b<a> of every access */
static void row_bases(cu *c)
{
	const ej_kernel *k = c->k;
	int r = k->rank;
	if (r > 1) {
		line(c, "%s q = row;", c->idx);
		for (int d = r - 2; d >= 1; d--) {
			line(c, "const %s i%d = q %% %lld;", c->idx, d,
			     (long long)k->size[d]);
			line(c, "q /= %lld;", (long long)k->size[d]);
		}
		line(c, "const %s i0 = q;", c->idx);
	}
	for (int x = 0; x < k->n_acc; x++) {
		char expr[512] = "";
		size_t used = 0;
		for (int d = 0; d < EPJ_MAX_DIMS; d++) {
			int m = k->acc[x].map[d];
			if (m < 0 || m == r - 1 || used + 64 > sizeof expr)
				continue;
			used += (size_t)snprintf(
			    expr + used, sizeof expr - used, "%si%d * s%d_%d",
			    used ? " + " : "", m, x, m);
		}
		line(c, "const %s b%d = %s;", c->idx, x, used ? expr : "0");
	}
	for (int d = 0; d < r - 1; d++)
		line(c, "(void)i%d;", d);
}

/* ---- pointwise ---------------------------------------------------------- */

static void pw_scalar_lanes(cu *c, const char *j0, const char *jend)
{
	const ej_kernel *k = c->k;
	line(c, "for (%s j = %s; j < %s; j++) {", c->idx, j0, jend);
	c->ind++;
	c->body++;
	for (int o = 0; o < k->n_out; o++) {
		need_elem(c, k->out[o].v);
		store_scalar(c, o, "ob + j");
	}
	c->ind--;
	line(c, "}");
}

static void pw_vector(cu *c)
{
	const ej_kernel *k = c->k;
	int V = c->lanes;
	/* unpacked lanes of every column access */
	for (int x = 0; x < k->n_acc; x++) {
		if (!k->acc[x].elem)
			continue;
		epj_dtype dt = k->in[k->acc[x].input].dtype;
		line(c, "%s l%d[%d];", dt == EPJ_DTYPE_F64 ? "double" : "float",
		     x, V);
		line(c, "ej_vld_%sx%d(in%d + b%d + j0, l%d);", vsuffix(dt), V,
		     k->acc[x].input, x, x);
	}
	/* each lane's chain, names carrying the lane */
	for (int l = 0; l < V; l++) {
		c->lane = l;
		c->body++;
		for (int o = 0; o < k->n_out; o++)
			need_elem(c, k->out[o].v);
	}
	for (int o = 0; o < k->n_out; o++) {
		const ej_koutput *out = &k->out[o];
		char list[512] = "";
		size_t used = 0;
		for (int l = 0; l < V; l++)
			used += (size_t)snprintf(list + used,
						 sizeof list - used, "%sv%d_%d",
						 l ? ", " : "", out->v, l);
		if (!k->v[out->v].elem) {
			used = 0;
			for (int l = 0; l < V; l++)
				used += (size_t)snprintf(
				    list + used, sizeof list - used, "%sv%d",
				    l ? ", " : "", out->v);
		}
		line(c, "{");
		c->ind++;
		line(c, "const %s w[%d] = { %s };", ctype(k->v[out->v].t), V,
		     list);
		line(c, "ej_vst_%sx%d(out%d + ob + j0, w);",
		     vsuffix(out->dtype), V, k->n_in + o);
		c->ind--;
		line(c, "}");
	}
	c->lane = -1;
}

static void print_pointwise(cu *c)
{
	const ej_kernel *k = c->k;
	int V = c->lanes;
	int64_t upr = (k->cols + V - 1) / V;
	int64_t units = k->rows * upr;
	line(c,
	     "for (%s u = (%s)blockIdx.x * blockDim.x + threadIdx.x; "
	     "u < %lld; u += (%s)gridDim.x * blockDim.x) {",
	     c->idx, c->idx, (long long)units, c->idx);
	c->ind++;
	line(c, "const %s row = u / %lld, j0 = (u %% %lld) * %d;", c->idx,
	     (long long)upr, (long long)upr, V);
	line(c, "const %s ob = row * %lld;", c->idx, (long long)k->cols);
	row_bases(c);
	/* row values (loads broadcast along the columns...) once per unit */
	c->stamp++;
	for (int o = 0; o < k->n_out; o++)
		pre_row(c, k->out[o].v);
	if (V == 1) {
		line(c, "const %s j1 = j0 + 1;", c->idx);
		pw_scalar_lanes(c, "j0", "j1");
	} else {
		/* vector path: full vector, unit column strides, aligned */
		char cond[2048];
		size_t used =
		    (size_t)snprintf(cond, sizeof cond, "j0 + %d <= %lld", V,
				     (long long)k->cols);
		for (int x = 0; x < k->n_acc; x++)
			if (k->acc[x].elem && used + 96 < sizeof cond)
				used += (size_t)snprintf(
				    cond + used, sizeof cond - used,
				    " && s%d_%d == 1 && ej_aligned(in%d + b%d "
				    "+ "
				    "j0, %zu)",
				    x, k->rank - 1, k->acc[x].input, x,
				    (size_t)V *
					dt_size(k->in[k->acc[x].input].dtype));
		for (int o = 0; o < k->n_out && used + 64 < sizeof cond; o++)
			used += (size_t)snprintf(
			    cond + used, sizeof cond - used,
			    " && ej_aligned(out%d + ob + j0, %zu)", k->n_in + o,
			    (size_t)V * dt_size(k->out[o].dtype));
		line(c, "if (%s) {", cond);
		c->ind++;
		pw_vector(c);
		c->ind--;
		line(c, "} else {");
		c->ind++;
		line(c, "const %s j1 = j0 + %d < %lld ? j0 + %d : %lld;",
		     c->idx, V, (long long)k->cols, V, (long long)k->cols);
		pw_scalar_lanes(c, "j0", "j1");
		c->ind--;
		line(c, "}");
	}
	c->ind--;
	line(c, "}");
}

/* ---- row reductions ------------------------------------------------------ */

static void reduce_loop(cu *c, int l)
{
	const ej_kernel *k = c->k;
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
			line(c, "double acc%d = 0.0;", v);
		else
			line(c, "%s acc%d = -ej_inf%s();", ctype(x->t), v,
			     x->t == EJ_KT_F64 ? "_d" : "_f");
	}
	line(c, "for (%s j = threadIdx.x; j < %lld; j += blockDim.x) {", c->idx,
	     (long long)k->cols);
	c->ind++;
	c->body++;
	for (int v = 0; v < k->n_v; v++) {
		const ej_kval *x = &k->v[v];
		if (!is_red(x->op) || x->dep - 1 != l)
			continue;
		need_elem(c, x->a);
		const char *cast = k->v[x->a].t == x->t ? "" : "(double)";
		const char *h = x->t == EJ_KT_F64 ? "_d" : "_f";
		if (x->op == EJ_K_RSUM)
			line(c, "acc%d += %sv%d;", v, cast, x->a);
		else if (x->op == EJ_K_RMAX)
			line(c, "acc%d = ej_maxnan%s(acc%d, v%d);", v, h, v,
			     x->a);
		else
			line(c, "acc%d = v%d > acc%d ? v%d : acc%d;", v, x->a,
			     v, x->a, v);
	}
	for (int o = 0; o < k->n_out; o++) {
		if (k->out[o].row || k->out[o].loop != l)
			continue;
		need_elem(c, k->out[o].v);
		store_scalar(c, o, "ob + j");
	}
	c->ind--;
	line(c, "}");
	for (int v = 0; v < k->n_v; v++) {
		const ej_kval *x = &k->v[v];
		if (!is_red(x->op) || x->dep - 1 != l)
			continue;
		const char *h = x->t == EJ_KT_F64 ? "_d" : "_f";
		if (x->op == EJ_K_RSUM)
			line(c,
			     "const double v%d = ej_block_sum(acc%d, ej_sh);",
			     v, v);
		else
			line(c,
			     "const %s v%d = ej_block_%smax%s(acc%d, (%s "
			     "*)ej_sh, "
			     "-ej_inf%s());",
			     ctype(x->t), v, x->op == EJ_K_RMAX ? "" : "s", h,
			     v, ctype(x->t), h);
		c->row_done[v] = true;
	}
}

static void print_rows(cu *c)
{
	const ej_kernel *k = c->k;
	line(c, "__shared__ double ej_sh[32];");
	line(c, "for (%s row = blockIdx.x; row < %lld; row += gridDim.x) {",
	     c->idx, (long long)k->rows);
	c->ind++;
	line(c, "const %s ob = row * %lld;", c->idx, (long long)k->cols);
	line(c, "(void)ob;");
	row_bases(c);
	for (int l = 0; l < k->n_loops; l++)
		reduce_loop(c, l);
	bool any_row = false;
	for (int o = 0; o < k->n_out; o++)
		if (k->out[o].row) {
			need_row(c, k->out[o].v);
			any_row = true;
		}
	if (any_row) {
		line(c, "if (threadIdx.x == 0) {");
		c->ind++;
		for (int o = 0; o < k->n_out; o++)
			if (k->out[o].row)
				store_scalar(c, o, "row");
		c->ind--;
		line(c, "}");
	}
	/* the next row's reductions reuse ej_sh */
	c->ind--;
	line(c, "}");
}

static void print_kernel(ej_sbuf *s, const ej_kernel *k)
{
	cu c = { .s = s, .k = k, .lane = -1 };
	c.row_done = calloc((size_t)k->n_v + 1, sizeof(bool));
	c.elem_done = calloc((size_t)k->n_v + 1, sizeof(int));
	c.seen = calloc((size_t)k->n_v + 1, sizeof(int));
	EJ_ASSERT(c.row_done && c.elem_done && c.seen);
	bool big = k->numel >= INT32_MAX;
	for (int i = 0; i < k->n_in; i++)
		big |= ej_numel(k->in[i].ndim, k->in[i].shape) >= INT32_MAX;
	c.idx = big ? "long long" : "int";
	c.lanes = vec_lanes(k);
	unsigned grid[3], block[3];
	ej_cuda_launch_dims(k, grid, block);
	ej_sb_printf(s, "\n/* kernel %d: %s, space [", k->id,
		     k->reduce ? "row reduction" : "pointwise");
	for (int d = 0; d < k->rank; d++)
		ej_sb_printf(s, "%s%lld", d ? "," : "", (long long)k->size[d]);
	ej_sb_printf(s, "], %s indices, %s; launch grid %u block %u */\n",
		     big ? "64-bit" : "32-bit",
		     k->reduce ? "one block per row"
			       : (c.lanes > 1 ? "vector lanes" : "scalar"),
		     grid[0], block[0]);
	kargs_struct(&c);
	ej_sb_printf(s,
		     "extern \"C\" __global__ void __launch_bounds__(%u)\n"
		     "epjk_%d(const struct ej_kargs_%d a)\n{\n",
		     block[0], k->id, k->id);
	c.ind = 1;
	prologue(&c);
	if (k->reduce)
		print_rows(&c);
	else
		print_pointwise(&c);
	ej_sb_puts(s, "}\n");
	free(c.row_done);
	free(c.elem_done);
	free(c.seen);
}

const char *ej_print_cuda(ej_arena *A, const ej_schedule *s, const char *name)
{
	ej_sbuf b = { 0 };
	ej_sb_printf(&b,
		     "/* epjit generated CUDA C (%s): graph %s, %d kernels.\n"
		     " * NVRTC: -arch=sm_XX, no include path needed. */\n",
		     EJ_CODEGEN_VERSION, name ? name : "?", s->n_kernels);
	ej_sb_puts(&b, ej_prelude_cuda_text);
	for (int i = 0; i < s->n_kernels; i++)
		print_kernel(&b, s->kernels[i]);
	return ej_sb_finish(&b, A);
}

epj_status ej_codegen_emit_cuda(epj_ctx *ctx, ej_graph *g, const char *name,
				char **source)
{
	*source = NULL;
	ej_arena *A = ej_arena_new();
	ej_schedule *s = ej_sched_build(A, g);
	int n = s->n_kernels;
	if (n > 0)
		*source = strdup(ej_print_cuda(A, s, name));
	ej_arena_free(A);
	if (n > 0 && !*source)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"emit cuda (%s): out of memory", name);
	return EPJ_OK;
}
