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
 * Index math is 32-bit (int) when no index a loop computes can pass
 * INT32_MAX, else 64-bit (idx_64bit): every input has fewer than 2^31 - 1
 * elements, and the space's element count plus the widest grid stride
 * (CU_MAX_STRIDE; a loop index steps past its bound by one stride before
 * the test ends the loop) is at most 2^31.  Contract for the launcher: in
 * 32-bit mode every access's largest element offset must fit in an int
 * (true for any input whose shape fits unless it is a view into a larger
 * storage: such an input is made contiguous first).
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
#include <stdlib.h>

#define CU_PW_TPB   256
#define CU_MAX_GRID 65535u
/* The widest step a grid-stride loop adds to its index: pointwise units
 * step by gridDim.x * blockDim.x <= CU_MAX_GRID * CU_PW_TPB (launchers only
 * ever lower the grid of ej_cuda_launch_dims), rows by gridDim.x and
 * columns by blockDim.x, both smaller. */
#define CU_MAX_STRIDE ((int64_t)CU_MAX_GRID * CU_PW_TPB)

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
	ej_kpr p;	 /* the shared body printer */
	const char *idx; /* "int" or "long long" */
	int lanes;	 /* V */
} cu;

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
		if (fabsf(f) < 1e6f && f == (float)(int)f)
			snprintf(buf, n, "%d.0f", (int)f);
		else
			snprintf(buf, n, "__int_as_float(0x%08x)", u);
	} else {
		uint64_t u;
		memcpy(&u, &c, sizeof u);
		if (fabs(c) < 1e6 && c == (double)(int)c)
			snprintf(buf, n, "%d.0", (int)c);
		else
			snprintf(buf, n, "__longlong_as_double(0x%016llxLL)",
				 (unsigned long long)u);
	}
}

/* A CONST value: infinities and NaN through the prelude. */
static void constant(char *buf, size_t n, ej_ktype t, double c)
{
	const char *h = t == EJ_KT_F64 ? "_d" : "_f";
	if (isinf(c))
		snprintf(buf, n, "%sej_inf%s()", c < 0 ? "-" : "", h);
	else if (isnan(c))
		snprintf(buf, n, "(ej_inf%s() - ej_inf%s())", h, h);
	else
		literal(buf, n, t, c);
}

/* ---- shared prologue ---------------------------------------------------- */

static void kargs_struct(cu *c)
{
	const ej_kernel *k = c->p.k;
	ej_sb_printf(c->p.s, "struct ej_kargs_%d {\n", k->id);
	for (int i = 0; i < k->n_in; i++)
		ej_sb_printf(c->p.s, "\tconst %s *in%d;\n",
			     stype(k->in[i].dtype), i);
	for (int o = 0; o < k->n_out; o++)
		ej_sb_printf(c->p.s, "\t%s *out%d;\n", stype(k->out[o].dtype),
			     k->n_in + o);
	int ns = k->n_acc * k->rank;
	ej_sb_printf(c->p.s, "\tlong long st[%d];\n};\n", ns > 0 ? ns : 1);
}

static void prologue(cu *c)
{
	const ej_kernel *k = c->p.k;
	int r = k->rank;
	for (int i = 0; i < k->n_in; i++)
		ej_kpr_line(&c->p, "const %s *__restrict__ in%d = a.in%d;",
			    stype(k->in[i].dtype), i, i);
	for (int o = 0; o < k->n_out; o++)
		ej_kpr_line(&c->p, "%s *__restrict__ out%d = a.out%d;",
			    stype(k->out[o].dtype), k->n_in + o, k->n_in + o);
	for (int x = 0; x < k->n_acc; x++)
		for (int d = 0; d < EPJ_MAX_DIMS; d++)
			if (k->acc[x].map[d] >= 0)
				ej_kpr_line(&c->p,
					    "const %s s%d_%d = (%s)a.st[%d];",
					    c->idx, x, k->acc[x].map[d], c->idx,
					    x * r + k->acc[x].map[d]);
}

/* row index `row` -> i0..i(r-2) and the bases b<a> of every access */
static void row_bases(cu *c)
{
	const ej_kernel *k = c->p.k;
	int r = k->rank;
	if (r > 1) {
		ej_kpr_line(&c->p, "%s q = row;", c->idx);
		for (int d = r - 2; d >= 1; d--) {
			ej_kpr_line(&c->p, "const %s i%d = q %% %lld;", c->idx,
				    d, (long long)k->size[d]);
			ej_kpr_line(&c->p, "q /= %lld;", (long long)k->size[d]);
		}
		ej_kpr_line(&c->p, "const %s i0 = q;", c->idx);
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
		ej_kpr_line(&c->p, "const %s b%d = %s;", c->idx, x,
			    used ? expr : "0");
	}
	for (int d = 0; d < r - 1; d++)
		ej_kpr_line(&c->p, "(void)i%d;", d);
}

/* ---- pointwise ---------------------------------------------------------- */

static void pw_scalar_lanes(cu *c, const char *j0, const char *jend)
{
	const ej_kernel *k = c->p.k;
	ej_kpr_line(&c->p, "for (%s j = %s; j < %s; j++) {", c->idx, j0, jend);
	c->p.ind++;
	c->p.body++;
	for (int o = 0; o < k->n_out; o++) {
		ej_kpr_need_elem(&c->p, k->out[o].v);
		ej_kpr_store(&c->p, o, "ob + j");
	}
	c->p.ind--;
	ej_kpr_line(&c->p, "}");
}

static void pw_vector(cu *c)
{
	const ej_kernel *k = c->p.k;
	int V = c->lanes;
	/* unpacked lanes of every column access */
	for (int x = 0; x < k->n_acc; x++) {
		if (!k->acc[x].elem)
			continue;
		epj_dtype dt = k->in[k->acc[x].input].dtype;
		ej_kpr_line(&c->p, "%s l%d[%d];",
			    dt == EPJ_DTYPE_F64 ? "double" : "float", x, V);
		ej_kpr_line(&c->p, "ej_vld_%sx%d(in%d + b%d + j0, l%d);",
			    vsuffix(dt), V, k->acc[x].input, x, x);
	}
	/* each lane's chain, names carrying the lane */
	for (int l = 0; l < V; l++) {
		c->p.lane = l;
		c->p.body++;
		for (int o = 0; o < k->n_out; o++)
			ej_kpr_need_elem(&c->p, k->out[o].v);
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
		ej_kpr_line(&c->p, "{");
		c->p.ind++;
		ej_kpr_line(&c->p, "const %s w[%d] = { %s };",
			    ej_kt_ctype(k->v[out->v].t), V, list);
		ej_kpr_line(&c->p, "ej_vst_%sx%d(out%d + ob + j0, w);",
			    vsuffix(out->dtype), V, k->n_in + o);
		c->p.ind--;
		ej_kpr_line(&c->p, "}");
	}
	c->p.lane = -1;
}

static void print_pointwise(cu *c)
{
	const ej_kernel *k = c->p.k;
	int V = c->lanes;
	int64_t upr = (k->cols + V - 1) / V;
	int64_t units = k->rows * upr;
	ej_kpr_line(&c->p,
		    "for (%s u = (%s)blockIdx.x * blockDim.x + threadIdx.x; "
		    "u < %lld; u += (%s)gridDim.x * blockDim.x) {",
		    c->idx, c->idx, (long long)units, c->idx);
	c->p.ind++;
	ej_kpr_line(&c->p, "const %s row = u / %lld, j0 = (u %% %lld) * %d;",
		    c->idx, (long long)upr, (long long)upr, V);
	ej_kpr_line(&c->p, "const %s ob = row * %lld;", c->idx,
		    (long long)k->cols);
	row_bases(c);
	/* row values (loads broadcast along the columns...) once per unit */
	c->p.stamp++;
	for (int o = 0; o < k->n_out; o++)
		ej_kpr_pre_row(&c->p, k->out[o].v);
	if (V == 1) {
		ej_kpr_line(&c->p, "const %s j1 = j0 + 1;", c->idx);
		pw_scalar_lanes(c, "j0", "j1");
	} else {
		/* vector path: full vector, unit column strides, aligned;
		 * one test per elementwise input and per output, however
		 * many (the condition has no length limit: a missing test
		 * would let a misaligned view take the vector loads) */
		ej_sbuf cond = { 0 };
		ej_sb_printf(&cond, "j0 + %d <= %lld", V, (long long)k->cols);
		for (int x = 0; x < k->n_acc; x++)
			if (k->acc[x].elem)
				ej_sb_printf(
				    &cond,
				    " && s%d_%d == 1 && ej_aligned(in%d + b%d "
				    "+ j0, %zu)",
				    x, k->rank - 1, k->acc[x].input, x,
				    (size_t)V *
					dt_size(k->in[k->acc[x].input].dtype));
		for (int o = 0; o < k->n_out; o++)
			ej_sb_printf(
			    &cond, " && ej_aligned(out%d + ob + j0, %zu)",
			    k->n_in + o, (size_t)V * dt_size(k->out[o].dtype));
		ej_kpr_line(&c->p, "if (%s) {", cond.p);
		free(cond.p);
		c->p.ind++;
		pw_vector(c);
		c->p.ind--;
		ej_kpr_line(&c->p, "} else {");
		c->p.ind++;
		ej_kpr_line(
		    &c->p, "const %s j1 = j0 + %d < %lld ? j0 + %d : %lld;",
		    c->idx, V, (long long)k->cols, V, (long long)k->cols);
		pw_scalar_lanes(c, "j0", "j1");
		c->p.ind--;
		ej_kpr_line(&c->p, "}");
	}
	c->p.ind--;
	ej_kpr_line(&c->p, "}");
}

/* ---- row reductions ------------------------------------------------------ */

static void reduce_loop(cu *c, int l)
{
	const ej_kernel *k = c->p.k;
	ej_kpr_pre_loop(&c->p, l);
	for (int v = 0; v < k->n_v; v++) {
		const ej_kval *x = &k->v[v];
		if (!ej_kop_is_red(x->op) || x->dep - 1 != l)
			continue;
		if (x->op == EJ_K_RSUM)
			ej_kpr_line(&c->p, "double acc%d = 0.0;", v);
		else
			ej_kpr_line(&c->p, "%s acc%d = -ej_inf%s();",
				    ej_kt_ctype(x->t), v,
				    x->t == EJ_KT_F64 ? "_d" : "_f");
	}
	ej_kpr_line(&c->p,
		    "for (%s j = threadIdx.x; j < %lld; j += blockDim.x) {",
		    c->idx, (long long)k->cols);
	c->p.ind++;
	ej_kpr_loop_body(&c->p, l);
	c->p.ind--;
	ej_kpr_line(&c->p, "}");
	for (int v = 0; v < k->n_v; v++) {
		const ej_kval *x = &k->v[v];
		if (!ej_kop_is_red(x->op) || x->dep - 1 != l)
			continue;
		const char *h = x->t == EJ_KT_F64 ? "_d" : "_f";
		if (x->op == EJ_K_RSUM)
			ej_kpr_line(
			    &c->p,
			    "const double v%d = ej_block_sum(acc%d, ej_sh);", v,
			    v);
		else
			ej_kpr_line(
			    &c->p,
			    "const %s v%d = ej_block_%smax%s(acc%d, (%s "
			    "*)ej_sh, "
			    "-ej_inf%s());",
			    ej_kt_ctype(x->t), v, x->op == EJ_K_RMAX ? "" : "s",
			    h, v, ej_kt_ctype(x->t), h);
		c->p.row_done[v] = true;
	}
}

static void print_rows(cu *c)
{
	const ej_kernel *k = c->p.k;
	ej_kpr_line(&c->p, "__shared__ double ej_sh[32];");
	ej_kpr_line(&c->p,
		    "for (%s row = blockIdx.x; row < %lld; row += gridDim.x) {",
		    c->idx, (long long)k->rows);
	c->p.ind++;
	ej_kpr_line(&c->p, "const %s ob = row * %lld;", c->idx,
		    (long long)k->cols);
	ej_kpr_line(&c->p, "(void)ob;");
	row_bases(c);
	for (int l = 0; l < k->n_loops; l++)
		reduce_loop(c, l);
	bool any_row = false;
	for (int o = 0; o < k->n_out; o++)
		if (k->out[o].row) {
			ej_kpr_need_row(&c->p, k->out[o].v);
			any_row = true;
		}
	if (any_row) {
		ej_kpr_line(&c->p, "if (threadIdx.x == 0) {");
		c->p.ind++;
		for (int o = 0; o < k->n_out; o++)
			if (k->out[o].row)
				ej_kpr_store(&c->p, o, "row");
		c->p.ind--;
		ej_kpr_line(&c->p, "}");
	}
	/* the next row's reductions reuse ej_sh */
	c->p.ind--;
	ej_kpr_line(&c->p, "}");
}

/* Whether kernel k needs 64-bit index math.  Each loop index stays below
 * its bound (units, rows or columns: at most numel) until it steps past it
 * by one grid stride, so 32-bit math needs numel - 1 + CU_MAX_STRIDE <=
 * INT32_MAX; offsets into an input stay below its element count. */
static bool idx_64bit(const ej_kernel *k)
{
	bool big = k->numel > (int64_t)INT32_MAX + 1 - CU_MAX_STRIDE;
	for (int i = 0; i < k->n_in; i++)
		big |= ej_numel(k->in[i].ndim, k->in[i].shape) >= INT32_MAX;
	return big;
}

static void print_kernel(ej_sbuf *s, const ej_kernel *k)
{
	cu c;
	ej_kpr_init(&c.p, s, k);
	c.p.literal = literal;
	c.p.constant = constant;
	bool big = idx_64bit(k);
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
	c.p.ind = 1;
	prologue(&c);
	if (k->reduce)
		print_rows(&c);
	else
		print_pointwise(&c);
	ej_sb_puts(s, "}\n");
	ej_kpr_fini(&c.p);
}

const char *ej_print_cuda(ej_arena *A, const ej_schedule *s, const char *name)
{
	ej_sbuf b = { 0 };
	ej_sb_printf(&b,
		     "/* epjit generated CUDA C: graph %s, %d kernels.\n"
		     " * NVRTC: -arch=sm_XX, no include path needed. */\n",
		     name ? name : "?", s->n_kernels);
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
