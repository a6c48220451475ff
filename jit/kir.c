/* kir.c -- lowering of one fused group of graph nodes to kernel IR (see
 * kir.h), plus the helpers shared by the scheduler and the printers (uses,
 * node classes, text dumps, string buffers).
 *
 * Lowering walks backwards from the group's outputs: a graph value is
 * evaluated "under a map" from its dims to the iteration dims, memoised on
 * (value, map), so a value read with two different broadcasts inside one
 * kernel is computed twice rather than materialised.  A value produced
 * outside the group becomes a load of a kernel input through that map.
 * Broadcasting (numpy rules), expand and reshapes that only add or drop
 * size-1 dims change the map; pointwise ops keep it; a reduction requires
 * its output to be read at its own row (a row kernel reads a row's sum in
 * that row only) and reads its input at the identity map of the space.
 * Anything else makes the group illegal (NULL + reason), which is how the
 * scheduler learns what it may fuse.
 *
 * The scalar op sequences reproduce lib/ops_pointwise.c and ops_reduce.c
 * (same formulas, same f32/f64 types, same scalar roundings) so fused
 * results equal op-by-op results up to summation order.
 */
#include "kir.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>

/* ---- uses ------------------------------------------------------------------
 */

ej_uses *ej_uses_build(ej_arena *A, const ej_graph *g)
{
	ej_uses *u = ej_arena_alloc(A, sizeof *u);
	int nv = g->n_values;
	u->start = ej_arena_alloc(A, sizeof(int) * (size_t)(nv + 1));
	u->is_output = ej_arena_alloc(A, sizeof(bool) * (size_t)(nv + 1));
	int total = 0;
	for (int i = 0; i < g->n_nodes; i++) {
		if (g->nodes[i].dead)
			continue;
		for (int k = 0; k < g->nodes[i].n_in; k++)
			u->start[g->nodes[i].in[k] + 1]++;
		total += g->nodes[i].n_in;
	}
	for (int v = 0; v < nv; v++)
		u->start[v + 1] += u->start[v];
	u->node = ej_arena_alloc(A, sizeof(int) * (size_t)(total + 1));
	int *fill = calloc((size_t)nv + 1, sizeof *fill);
	EJ_ASSERT(fill);
	for (int i = 0; i < g->n_nodes; i++) {
		if (g->nodes[i].dead)
			continue;
		for (int k = 0; k < g->nodes[i].n_in; k++) {
			int v = g->nodes[i].in[k];
			u->node[u->start[v] + fill[v]++] = i;
		}
	}
	free(fill);
	for (int i = 0; i < g->n_outputs; i++)
		u->is_output[g->outputs[i]] = true;
	return u;
}

/* ---- node classes ----------------------------------------------------------
 */

static bool is_float(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F32 || dt == EPJ_DTYPE_BF16 ||
	       dt == EPJ_DTYPE_F64;
}

static int64_t numel_of(const ej_value *v)
{
	return ej_numel(v->ndim, v->shape);
}

static bool same_shape(int na, const int64_t *a, int nb, const int64_t *b)
{
	if (na != nb)
		return false;
	for (int d = 0; d < na; d++)
		if (a[d] != b[d])
			return false;
	return true;
}

/* A reshape that only inserts or removes size-1 dims: the sizes other than
 * 1 are the same sequence. */
static bool unit_reshape_p(const ej_value *in, const ej_value *out)
{
	int i = 0, o = 0;
	for (;;) {
		while (i < in->ndim && in->shape[i] == 1)
			i++;
		while (o < out->ndim && out->shape[o] == 1)
			o++;
		if (i == in->ndim || o == out->ndim)
			return i == in->ndim && o == out->ndim;
		if (in->shape[i++] != out->shape[o++])
			return false;
	}
}

ej_kclass ej_kir_node_class(const ej_graph *g, int node)
{
	const ej_ir_node *n = &g->nodes[node];
	if (n->dead || n->op < 0 || n->n_out != 1)
		return EJ_KC_EXTERN;
	const ej_value *o = &g->values[n->out[0]];
	if (!is_float(o->dtype) || numel_of(o) == 0)
		return EJ_KC_EXTERN;
	for (int k = 0; k < n->n_in; k++) {
		const ej_value *x = &g->values[n->in[k]];
		if (!is_float(x->dtype) || numel_of(x) == 0)
			return EJ_KC_EXTERN;
	}
	const ej_value *x = n->n_in > 0 ? &g->values[n->in[0]] : NULL;
	if (ej_ops[n->op].flags & EJ_OPF_POINTWISE)
		return EJ_KC_POINTWISE;
	switch (n->op) {
	case EJ_OP_SUM:
	case EJ_OP_MEAN:
	case EJ_OP_AMAX:
		return x->ndim >= 1 && n->attrs.n_i >= 2 &&
			       n->attrs.i[0] == x->ndim - 1
			   ? EJ_KC_REDUCE
			   : EJ_KC_EXTERN;
	case EJ_OP_SOFTMAX:
	case EJ_OP_LOG_SOFTMAX:
		return x->ndim >= 1 && n->attrs.n_i >= 1 &&
			       n->attrs.i[0] == x->ndim - 1
			   ? EJ_KC_REDUCE
			   : EJ_KC_EXTERN;
	case EJ_OP_SUM_TO: {
		/* only a sum over the last axis, keeping it as 1 */
		int r = x->ndim;
		if (r < 1 || o->ndim != r || x->shape[r - 1] == 1 ||
		    o->shape[r - 1] != 1)
			return EJ_KC_EXTERN;
		for (int d = 0; d < r - 1; d++)
			if (o->shape[d] != x->shape[d])
				return EJ_KC_EXTERN;
		return EJ_KC_REDUCE;
	}
	case EJ_OP_EXPAND:
		return EJ_KC_VIEW;
	case EJ_OP_RESHAPE:
		return unit_reshape_p(x, o) ? EJ_KC_VIEW : EJ_KC_EXTERN;
	default:
		return EJ_KC_EXTERN;
	}
}

/* ---- lowering --------------------------------------------------------------
 */

#define KIR_MAX_VALS 4096 /* a group needing more SSA values is refused */

typedef struct memo {
	int map[EPJ_MAX_DIMS];
	int ssa;
	struct memo *next;
} memo;

typedef struct kb {
	const ej_graph *g;
	const bool *member;
	ej_arena *T; /* scratch */
	int rank;
	int64_t size[EPJ_MAX_DIMS];
	bool reduce;
	memo **memo;   /* per value */
	int *input_of; /* per value: kernel input or -1 */
	ej_kinput *in;
	int n_in, cap_in;
	ej_kaccess *acc;
	int n_acc, cap_acc;
	ej_kval *v;
	int n_v, cap_v;
	const char *why;
} kb;

#define GROW(arr, n, cap)                                                      \
	do {                                                                   \
		if ((n) == (cap)) {                                            \
			int nc_ = (cap) ? 2 * (cap) : 16;                      \
			void *p_ =                                             \
			    realloc((arr), sizeof *(arr) * (size_t)nc_);       \
			EJ_ASSERT(p_);                                         \
			(arr) = p_;                                            \
			(cap) = nc_;                                           \
		}                                                              \
	} while (0)

static int fail(kb *b, const char *why)
{
	if (!b->why)
		b->why = why;
	return -1;
}

static ej_ktype ktype_of(epj_dtype dt)
{
	return dt == EPJ_DTYPE_F64 ? EJ_KT_F64 : EJ_KT_F32;
}

static int emit(kb *b, ej_kop op, ej_ktype t, int a, int c2, double c)
{
	if (b->n_v >= KIR_MAX_VALS)
		return fail(b, "kernel too large");
	GROW(b->v, b->n_v, b->cap_v);
	ej_kval *x = &b->v[b->n_v];
	memset(x, 0, sizeof *x);
	x->op = op;
	x->t = t;
	x->a = a;
	x->b = c2;
	x->e = -1;
	x->acc = -1;
	x->c = c;
	return b->n_v++;
}

/* cond != 0 ? x : y, in type t (of x and y; cond may be of the other) */
static int emit_sel(kb *b, ej_ktype t, int cond, int x, int y)
{
	int r = emit(b, EJ_K_SEL, t, cond, x, 0);
	if (r >= 0)
		b->v[r].e = y;
	return r;
}

static int emit_const(kb *b, ej_ktype t, double c)
{
	return emit(b, EJ_K_CONST, t, -1, -1, t == EJ_KT_F32 ? (float)c : c);
}

/* After computing a value of dtype dt, round as the interpreter's store
 * would (bf16); f32/f64 values are exact in their compute type, and a
 * select picks one of two values of dt, each rounded already. */
static int round_to(kb *b, int v, epj_dtype dt)
{
	if (v < 0 || dt != EPJ_DTYPE_BF16 || b->v[v].op == EJ_K_RBF16 ||
	    b->v[v].op == EJ_K_LOAD || b->v[v].op == EJ_K_SEL)
		return v;
	return emit(b, EJ_K_RBF16, EJ_KT_F32, v, -1, 0);
}

/* The identity map of a value shaped like the space: -1 on size-1 dims. */
static void identity_map(const kb *b, int *map)
{
	for (int d = 0; d < b->rank; d++)
		map[d] = b->size[d] == 1 ? -1 : d;
}

/* map of a value of shape (n, shape): each dim of size > 1 must map to an
 * iteration dim of the same size; size-1 dims map to -1. */
static bool map_ok(const kb *b, int n, const int64_t *shape, const int *map)
{
	for (int d = 0; d < n; d++) {
		if (shape[d] == 1) {
			if (map[d] != -1)
				return false;
		} else if (map[d] < 0 || map[d] >= b->rank ||
			   b->size[map[d]] != shape[d]) {
			return false;
		}
	}
	return true;
}

/* Map of input value x (numpy-broadcast to output o, read at omap). */
static void broadcast_map(const ej_value *x, const ej_value *o, const int *omap,
			  int *imap)
{
	int off = o->ndim - x->ndim;
	for (int d = 0; d < x->ndim; d++)
		imap[d] = x->shape[d] == 1 || d + off < 0 ? -1 : omap[d + off];
}

/* Map of the input of a unit-dim reshape. */
static void reshape_map(const ej_value *x, const ej_value *o, const int *omap,
			int *imap)
{
	int oi = 0;
	for (int d = 0; d < x->ndim; d++) {
		imap[d] = -1;
		if (x->shape[d] == 1)
			continue;
		while (o->shape[oi] == 1)
			oi++;
		imap[d] = omap[oi++];
	}
}

static int load(kb *b, int value, const int *map)
{
	const ej_value *x = &b->g->values[value];
	int in = b->input_of[value];
	if (in < 0) {
		GROW(b->in, b->n_in, b->cap_in);
		ej_kinput *ki = &b->in[b->n_in];
		memset(ki, 0, sizeof *ki);
		ki->value = value;
		ki->dtype = x->dtype;
		ki->ndim = x->ndim;
		memcpy(ki->shape, x->shape, sizeof ki->shape);
		in = b->input_of[value] = b->n_in++;
	}
	int a = 0;
	for (; a < b->n_acc; a++)
		if (b->acc[a].input == in &&
		    memcmp(b->acc[a].map, map, sizeof(int) * (size_t)x->ndim) ==
			0)
			break;
	if (a == b->n_acc) {
		GROW(b->acc, b->n_acc, b->cap_acc);
		ej_kaccess *ka = &b->acc[b->n_acc++];
		memset(ka, 0, sizeof *ka);
		ka->input = in;
		for (int d = 0; d < EPJ_MAX_DIMS; d++)
			ka->map[d] = d < x->ndim ? map[d] : -1;
	}
	int v = emit(b, EJ_K_LOAD, ktype_of(x->dtype), -1, -1, 0);
	if (v >= 0)
		b->v[v].acc = a;
	return v;
}

static int eval(kb *b, int value, const int *map);

/* A reduction node's output must be read at its own row: output dim d < r-1
 * at iteration dim d (or -1 when that dim is 1). */
static bool row_map_p(const kb *b, const ej_value *o, const int *omap)
{
	for (int d = 0; d < o->ndim; d++) {
		int want = d < b->rank - 1 && b->size[d] != 1 ? d : -1;
		if (omap[d] != want)
			return false;
	}
	return true;
}

static int lower_reduce(kb *b, const ej_ir_node *n, const int *omap)
{
	const ej_value *x = &b->g->values[n->in[0]];
	const ej_value *o = &b->g->values[n->out[0]];
	if (!b->reduce || !same_shape(x->ndim, x->shape, b->rank, b->size))
		return fail(b, "reductions over different shapes");
	bool elem_out = n->op == EJ_OP_SOFTMAX || n->op == EJ_OP_LOG_SOFTMAX;
	int imap[EPJ_MAX_DIMS];
	identity_map(b, imap);
	if (elem_out ? memcmp(omap, imap, sizeof(int) * (size_t)b->rank) != 0
		     : !row_map_p(b, o, omap))
		return fail(b, "a reduction read outside its row");
	int xv = eval(b, n->in[0], imap);
	if (xv < 0)
		return -1;
	ej_ktype t = ktype_of(o->dtype);
	int r;
	switch (n->op) {
	case EJ_OP_SUM:
	case EJ_OP_SUM_TO:
	case EJ_OP_MEAN:
		r = emit(b, EJ_K_RSUM, EJ_KT_F64, xv, -1, 0);
		if (n->op == EJ_OP_MEAN) /* sum / n in double, as ops_reduce */
			r = emit(b, EJ_K_DIV, EJ_KT_F64, r,
				 emit_const(b, EJ_KT_F64,
					    (double)b->size[b->rank - 1]),
				 0);
		if (t == EJ_KT_F32)
			r = emit(b, EJ_K_CVT, EJ_KT_F32, r, -1, 0);
		return round_to(b, r, o->dtype);
	case EJ_OP_AMAX:
		return emit(b, EJ_K_RMAX, t, xv, -1, 0);
	default: { /* softmax, log_softmax (ops_reduce.c SOFTMAX_ROW) */
		int m = emit(b, EJ_K_RMAXS, t, xv, -1, 0);
		int d = emit(b, EJ_K_SUB, t, xv, m, 0);
		int e = emit(b, EJ_K_EXP, t, d, -1, 0);
		int s = emit(b, EJ_K_RSUM, EJ_KT_F64, e, -1, 0);
		if (n->op == EJ_OP_SOFTMAX) {
			int inv = emit(b, EJ_K_RECIP, EJ_KT_F64, s, -1, 0);
			if (t == EJ_KT_F32)
				inv = emit(b, EJ_K_CVT, t, inv, -1, 0);
			r = emit(b, EJ_K_MUL, t, e, inv, 0);
		} else {
			int ls = emit(b, EJ_K_LOG, EJ_KT_F64, s, -1, 0);
			if (t == EJ_KT_F32)
				ls = emit(b, EJ_K_CVT, t, ls, -1, 0);
			r = emit(b, EJ_K_SUB, t, d, ls, 0);
		}
		return round_to(b, r, o->dtype);
	}
	}
}

static int lower_cast(kb *b, int a, epj_dtype from, epj_dtype to)
{
	ej_ktype tf = ktype_of(from), tt = ktype_of(to);
	if (tf != tt)
		a = emit(b, EJ_K_CVT, tt, a, -1, 0);
	if (to == EPJ_DTYPE_BF16 && from != EPJ_DTYPE_BF16)
		a = emit(b, EJ_K_RBF16, EJ_KT_F32, a, -1, 0);
	return a;
}

static int lower_pointwise(kb *b, const ej_ir_node *n, const int *omap)
{
	const ej_value *o = &b->g->values[n->out[0]];
	int args[3] = { -1, -1, -1 };
	for (int k = 0; k < n->n_in && k < 3; k++) {
		const ej_value *x = &b->g->values[n->in[k]];
		int imap[EPJ_MAX_DIMS];
		if (x->ndim > o->ndim)
			return fail(b, "input of higher rank than output");
		broadcast_map(x, o, omap, imap);
		args[k] = eval(b, n->in[k], imap);
		if (args[k] < 0)
			return -1;
	}
	ej_ktype t = ktype_of(o->dtype);
	int a = args[0], c = args[1], r;
	double s = n->attrs.n_f > 0 ? n->attrs.f[0] : 0;
	switch (n->op) {
	case EJ_OP_ADD:
		r = emit(b, EJ_K_ADD, t, a, c, 0);
		break;
	case EJ_OP_SUB:
		r = emit(b, EJ_K_SUB, t, a, c, 0);
		break;
	case EJ_OP_MUL:
		r = emit(b, EJ_K_MUL, t, a, c, 0);
		break;
	case EJ_OP_DIV:
		r = emit(b, EJ_K_DIV, t, a, c, 0);
		break;
	case EJ_OP_EQ:
		r = emit(b, EJ_K_EQ, t, a, c, 0);
		break;
	case EJ_OP_WHERE: /* (cond, a, b): a and b in the output's type */
		r = emit_sel(b, t, a, c, args[2]);
		break;
	case EJ_OP_ADD_SCALAR:
		r = emit(b, EJ_K_ADD, t, a, emit_const(b, t, s), 0);
		break;
	case EJ_OP_MUL_SCALAR:
		r = emit(b, EJ_K_MUL, t, a, emit_const(b, t, s), 0);
		break;
	case EJ_OP_POW_SCALAR: {
		/* ops_pointwise: the exponent in the compute type; 2 is x*x,
		 * 1 is x */
		double e = t == EJ_KT_F32 ? (double)(float)s : s;
		if (e == 2)
			r = emit(b, EJ_K_MUL, t, a, a, 0);
		else if (e == 1)
			return a;
		else
			r = emit(b, EJ_K_POWC, t, a, -1, e);
		break;
	}
#define EJ_OP(ID, name, n_in, n_out, flags)
#define EJ_OP_FN(ID, name, n_in, flags)                                        \
	case EJ_OP_##ID:                                                       \
		r = emit(b, EJ_K_##ID, t, a, n_in > 1 ? c : -1, 0);            \
		break;
#include "ops.def"
#undef EJ_OP_FN
#undef EJ_OP
	case EJ_OP_CAST:
		return lower_cast(b, a, b->g->values[n->in[0]].dtype, o->dtype);
	default:
		return fail(b, "not a pointwise op");
	}
	return round_to(b, r, o->dtype);
}

static int eval(kb *b, int value, const int *map)
{
	const ej_value *x = &b->g->values[value];
	if (!map_ok(b, x->ndim, x->shape, map))
		return fail(b, "broadcast does not line up with the space");
	for (memo *m = b->memo[value]; m; m = m->next)
		if (memcmp(m->map, map, sizeof(int) * (size_t)x->ndim) == 0)
			return m->ssa;
	int r;
	int p = x->node;
	if (p < 0 || !b->member[p]) {
		r = load(b, value, map);
	} else {
		const ej_ir_node *n = &b->g->nodes[p];
		int imap[EPJ_MAX_DIMS];
		switch (ej_kir_node_class(b->g, p)) {
		case EJ_KC_POINTWISE:
			r = lower_pointwise(b, n, map);
			break;
		case EJ_KC_REDUCE:
			r = lower_reduce(b, n, map);
			break;
		case EJ_KC_VIEW: {
			const ej_value *in = &b->g->values[n->in[0]];
			if (n->op == EJ_OP_EXPAND)
				broadcast_map(in, x, map, imap);
			else
				reshape_map(in, x, map, imap);
			r = eval(b, n->in[0], imap);
			break;
		}
		default:
			return fail(b, "extern node in a group");
		}
	}
	if (r < 0)
		return -1;
	memo *m = ej_arena_alloc(b->T, sizeof *m);
	memcpy(m->map, map, sizeof(int) * (size_t)x->ndim);
	m->ssa = r;
	m->next = b->memo[value];
	b->memo[value] = m;
	return r;
}

static bool reduction_p(ej_kop op)
{
	return op == EJ_K_RSUM || op == EJ_K_RMAX || op == EJ_K_RMAXS;
}

/* Drops size-1 iteration dims (a row kernel keeps its columns), renumbers
 * the accesses, and sets elem/dep of every value and the column loops. */
static void finish(ej_kernel *k, const kb *b)
{
	int newd[EPJ_MAX_DIMS], r = 0;
	for (int d = 0; d < b->rank; d++) {
		bool keep = b->size[d] != 1 || (b->reduce && d == b->rank - 1);
		newd[d] = keep ? r : -1;
		if (keep)
			k->size[r++] = b->size[d];
	}
	if (r == 0)
		k->size[r++] = 1;
	k->rank = r;
	k->cols = k->size[r - 1];
	k->numel = ej_numel(r, k->size);
	k->rows = k->numel / k->cols;
	for (int a = 0; a < k->n_acc; a++) {
		ej_kaccess *x = &k->acc[a];
		x->elem = false;
		for (int d = 0; d < EPJ_MAX_DIMS; d++) {
			if (x->map[d] >= 0)
				x->map[d] = newd[x->map[d]];
			if (x->map[d] == r - 1)
				x->elem = true;
		}
	}
	int loops = 1;
	for (int i = 0; i < k->n_v; i++) {
		ej_kval *x = &k->v[i];
		if (x->op == EJ_K_LOAD) {
			x->elem = k->acc[x->acc].elem;
			x->dep = 0;
			continue;
		}
		x->elem = false;
		x->dep = 0;
		int args[3] = { x->a, x->b, x->e };
		for (int j = 0; j < 3; j++) {
			if (args[j] < 0)
				continue;
			x->elem |= k->v[args[j]].elem;
			if (k->v[args[j]].dep > x->dep)
				x->dep = k->v[args[j]].dep;
		}
		if (reduction_p(x->op)) {
			if (x->dep + 1 > loops)
				loops = x->dep + 1;
			x->dep++;
			x->elem = false;
		}
	}
	for (int i = 0; i < k->n_out; i++) {
		ej_koutput *o = &k->out[i];
		o->loop = o->row ? -1 : k->v[o->v].dep;
		if (!o->row && o->loop + 1 > loops)
			loops = o->loop + 1;
	}
	k->n_loops = loops;
}

ej_kernel *ej_kir_build(ej_arena *A, const ej_graph *g, const ej_uses *u,
			const bool *member, const int *nodes, int n_nodes,
			const char **why)
{
	kb b = { .g = g, .member = member };
	ej_kernel *k = NULL;
	int n_out = 0, *outs = malloc(sizeof(int) * (size_t)(n_nodes + 1));
	EJ_ASSERT(outs);
	b.T = ej_arena_new();
	b.memo =
	    ej_arena_alloc(b.T, sizeof(memo *) * (size_t)(g->n_values + 1));
	b.input_of =
	    ej_arena_alloc(b.T, sizeof(int) * (size_t)(g->n_values + 1));
	for (int v = 0; v < g->n_values; v++)
		b.input_of[v] = -1;
	/* outputs: values used outside the group or by the graph */
	const ej_value *first_red = NULL;
	bool any_compute = false;
	for (int i = 0; i < n_nodes; i++) {
		const ej_ir_node *n = &g->nodes[nodes[i]];
		ej_kclass kc = ej_kir_node_class(g, nodes[i]);
		if (kc == EJ_KC_EXTERN) {
			fail(&b, "extern node in a group");
			goto out;
		}
		any_compute |= kc != EJ_KC_VIEW;
		if (kc == EJ_KC_REDUCE && !first_red)
			first_red = &g->values[n->in[0]];
		int v = n->out[0];
		bool outside = u->is_output[v];
		for (int j = u->start[v]; j < u->start[v + 1] && !outside; j++)
			outside = !member[u->node[j]];
		if (outside)
			outs[n_out++] = v;
	}
	if (!any_compute || n_out == 0) {
		fail(&b, any_compute ? "no output" : "only views");
		goto out;
	}
	/* the space: the reductions' input, or the outputs' common shape */
	const ej_value *sp = first_red ? first_red : &g->values[outs[0]];
	b.reduce = first_red != NULL;
	b.rank = sp->ndim;
	memcpy(b.size, sp->shape, sizeof b.size);
	ej_koutput *ko = calloc((size_t)n_out, sizeof *ko);
	EJ_ASSERT(ko);
	for (int i = 0; i < n_out && !b.why; i++) {
		const ej_value *x = &g->values[outs[i]];
		int map[EPJ_MAX_DIMS];
		ko[i].value = outs[i];
		ko[i].dtype = x->dtype;
		identity_map(&b, map);
		if (same_shape(x->ndim, x->shape, b.rank, b.size)) {
			ko[i].row = false;
		} else if (b.reduce &&
			   (same_shape(x->ndim, x->shape, b.rank - 1, b.size) ||
			    (x->ndim == b.rank && x->shape[b.rank - 1] == 1 &&
			     same_shape(x->ndim - 1, x->shape, b.rank - 1,
					b.size)))) {
			ko[i].row = true;
			map[b.rank - 1] = -1;
		} else {
			fail(&b, "outputs of different shapes");
			break;
		}
		ko[i].v = eval(&b, outs[i], map);
	}
	if (b.why) {
		free(ko);
		goto out;
	}
	k = ej_arena_alloc(A, sizeof *k);
	k->reduce = b.reduce;
	k->n_in = b.n_in;
	k->in = ej_arena_alloc(A, sizeof *k->in * (size_t)(b.n_in + 1));
	memcpy(k->in, b.in, sizeof *k->in * (size_t)b.n_in);
	k->n_acc = b.n_acc;
	k->acc = ej_arena_alloc(A, sizeof *k->acc * (size_t)(b.n_acc + 1));
	memcpy(k->acc, b.acc, sizeof *k->acc * (size_t)b.n_acc);
	k->n_v = b.n_v;
	k->v = ej_arena_alloc(A, sizeof *k->v * (size_t)(b.n_v + 1));
	memcpy(k->v, b.v, sizeof *k->v * (size_t)b.n_v);
	k->n_out = n_out;
	k->out = ej_arena_alloc(A, sizeof *k->out * (size_t)n_out);
	memcpy(k->out, ko, sizeof *k->out * (size_t)n_out);
	free(ko);
	k->n_nodes = n_nodes;
	k->nodes = ej_arena_alloc(A, sizeof(int) * (size_t)n_nodes);
	memcpy(k->nodes, nodes, sizeof(int) * (size_t)n_nodes);
	finish(k, &b);
out:
	if (why)
		*why = b.why;
	free(outs);
	free(b.in);
	free(b.acc);
	free(b.v);
	ej_arena_free(b.T);
	return k;
}

/* ---- dumps -----------------------------------------------------------------
 */

static const char *const kop_names[EJ_K_COUNT] = {
	[EJ_K_LOAD] = "load",
	[EJ_K_CONST] = "const",
	[EJ_K_ADD] = "add",
	[EJ_K_SUB] = "sub",
	[EJ_K_MUL] = "mul",
	[EJ_K_DIV] = "div",
	[EJ_K_EQ] = "eq",
	[EJ_K_SEL] = "sel",
#define EJ_OP(ID, name, n_in, n_out, flags)
#define EJ_OP_FN(ID, name, n_in, flags) [EJ_K_##ID] = name,
#include "ops.def"
#undef EJ_OP_FN
#undef EJ_OP
	[EJ_K_POWC] = "powc",
	[EJ_K_RECIP] = "recip",
	[EJ_K_CVT] = "cvt",
	[EJ_K_RBF16] = "round_bf16",
	[EJ_K_RSUM] = "row_sum",
	[EJ_K_RMAX] = "row_max",
	[EJ_K_RMAXS] = "row_max_softmax",
};

const char *ej_kop_name(ej_kop op)
{
	return (unsigned)op < EJ_K_COUNT ? kop_names[op] : "?";
}

static void sb_shape(ej_sbuf *s, int n, const int64_t *shape)
{
	ej_sb_puts(s, "[");
	for (int d = 0; d < n; d++)
		ej_sb_printf(s, "%s%lld", d ? "," : "", (long long)shape[d]);
	ej_sb_puts(s, "]");
}

static void kernel_text(ej_sbuf *s, const ej_graph *g, const ej_kernel *k)
{
	ej_sb_printf(s, "kernel %d: %s, space ", k->id,
		     k->reduce ? "row reduction" : "pointwise");
	sb_shape(s, k->rank, k->size);
	ej_sb_printf(s, " = %lld rows x %lld cols, %d column loop%s\n",
		     (long long)k->rows, (long long)k->cols, k->n_loops,
		     k->n_loops == 1 ? "" : "s");
	ej_sb_puts(s, "  fuses:");
	for (int i = 0; i < k->n_nodes; i++)
		ej_sb_printf(s, " %s#%d", ej_ops[g->nodes[k->nodes[i]].op].name,
			     k->nodes[i]);
	ej_sb_puts(s, "\n");
	for (int i = 0; i < k->n_in; i++) {
		ej_sb_printf(s, "  in%d = %%%d %s", i, k->in[i].value,
			     epj_dtype_name(k->in[i].dtype));
		sb_shape(s, k->in[i].ndim, k->in[i].shape);
		ej_sb_puts(s, "\n");
	}
	for (int a = 0; a < k->n_acc; a++) {
		const ej_kaccess *x = &k->acc[a];
		ej_sb_printf(s, "  a%d = in%d dims->space (", a, x->input);
		for (int d = 0; d < k->in[x->input].ndim; d++)
			ej_sb_printf(s, "%s%d", d ? "," : "", x->map[d]);
		ej_sb_printf(s, ")%s\n", x->elem ? " varies by column" : "");
	}
	for (int i = 0; i < k->n_v; i++) {
		const ej_kval *x = &k->v[i];
		ej_sb_printf(s, "  v%d %s = %s", i,
			     x->t == EJ_KT_F64 ? "f64" : "f32",
			     ej_kop_name(x->op));
		if (x->op == EJ_K_LOAD)
			ej_sb_printf(s, " a%d", x->acc);
		if (x->op == EJ_K_CONST || x->op == EJ_K_POWC)
			ej_sb_printf(s, " %.9g", x->c);
		if (x->a >= 0)
			ej_sb_printf(s, " v%d", x->a);
		if (x->b >= 0)
			ej_sb_printf(s, " v%d", x->b);
		if (x->e >= 0)
			ej_sb_printf(s, " v%d", x->e);
		ej_sb_printf(s, "   (%s, dep %d)\n", x->elem ? "elem" : "row",
			     x->dep);
	}
	for (int i = 0; i < k->n_out; i++) {
		const ej_koutput *o = &k->out[i];
		if (o->row)
			ej_sb_printf(s, "  out%d: %%%d %s = v%d per row\n", i,
				     o->value, epj_dtype_name(o->dtype), o->v);
		else
			ej_sb_printf(s, "  out%d: %%%d %s = v%d in loop %d\n",
				     i, o->value, epj_dtype_name(o->dtype),
				     o->v, o->loop);
	}
}

const char *ej_sched_text(ej_arena *A, const ej_schedule *s)
{
	ej_sbuf b = { 0 };
	const ej_graph *g = s->g;
	ej_sb_printf(&b,
		     "schedule of %s: %d live nodes -> %d fused kernels + %d "
		     "extern nodes (%d steps)\n",
		     g->name ? g->name : "graph", ej_graph_live_nodes(g),
		     s->n_kernels, s->n_extern, s->n_steps);
	for (int i = 0; i < s->n_steps; i++) {
		const ej_step *st = &s->steps[i];
		if (st->k) {
			ej_sb_printf(&b, "step %d: kernel %d (%d nodes)\n", i,
				     st->k->id, st->k->n_nodes);
		} else {
			const ej_ir_node *n = &g->nodes[st->node];
			ej_sb_printf(&b, "step %d: extern #%d %s(", i, st->node,
				     ej_ops[n->op].name);
			for (int k = 0; k < n->n_in; k++)
				ej_sb_printf(&b, "%s%%%d", k ? ", " : "",
					     n->in[k]);
			ej_sb_puts(&b, ") ->");
			for (int j = 0; j < n->n_out; j++)
				ej_sb_printf(&b, " %%%d", n->out[j]);
			ej_sb_puts(&b, "\n");
		}
	}
	for (int i = 0; i < s->n_kernels; i++) {
		ej_sb_puts(&b, "\n");
		kernel_text(&b, g, s->kernels[i]);
	}
	return ej_sb_finish(&b, A);
}

/* ---- kernel body printing (print_c.c, print_cuda.c) ---------------------- */

void ej_kpr_init(ej_kpr *p, ej_sbuf *s, const ej_kernel *k)
{
	*p = (ej_kpr){ .s = s, .k = k, .lane = -1 };
	p->row_done = calloc((size_t)k->n_v + 1, sizeof(bool));
	p->elem_done = calloc((size_t)k->n_v + 1, sizeof(int));
	p->seen = calloc((size_t)k->n_v + 1, sizeof(int));
	EJ_ASSERT(p->row_done && p->elem_done && p->seen);
}

void ej_kpr_fini(ej_kpr *p)
{
	free(p->row_done);
	free(p->elem_done);
	free(p->seen);
}

void ej_kpr_line(ej_kpr *p, const char *fmt, ...)
{
	/* no length limit: a cut line would be code that means something
	 * else, or does not compile */
	va_list ap;
	for (int i = 0; i < p->ind; i++)
		ej_sb_puts(p->s, "\t");
	va_start(ap, fmt);
	ej_sb_vprintf(p->s, fmt, ap);
	va_end(ap);
	ej_sb_puts(p->s, "\n");
}

const char *ej_kt_ctype(ej_ktype t)
{
	return t == EJ_KT_F64 ? "double" : "float";
}

bool ej_kop_is_red(ej_kop op)
{
	return op == EJ_K_RSUM || op == EJ_K_RMAX || op == EJ_K_RMAXS;
}

/* Name of value v at the current lane. */
static void kpr_name(const ej_kpr *p, int v, char *buf, size_t n)
{
	if (p->lane >= 0 && p->k->v[v].elem)
		snprintf(buf, n, "v%d_%d", v, p->lane);
	else
		snprintf(buf, n, "v%d", v);
}

/* Expression of load x at the current point. */
static void kpr_load(const ej_kpr *p, const ej_kval *x, char *buf, size_t n)
{
	const ej_kernel *k = p->k;
	const ej_kaccess *a = &k->acc[x->acc];
	epj_dtype dt = k->in[a->input].dtype;
	if (a->elem && p->lane >= 0) { /* unpacked by the vector load */
		snprintf(buf, n, "l%d[%d]", x->acc, p->lane);
		return;
	}
	char idx[96];
	if (!a->elem)
		snprintf(idx, sizeof idx, "b%d", x->acc);
	else if (p->unit)
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
static void kpr_rhs(const ej_kpr *p, int v, char *buf, size_t n)
{
	const ej_kval *x = &p->k->v[v];
	bool d = x->t == EJ_KT_F64;
	const char *f = d ? "" : "f";	 /* libm suffix */
	const char *h = d ? "_d" : "_f"; /* prelude suffix */
	const char *one = d ? "1.0" : "1.0f";
	char a[32] = "", b[32] = "", e[32] = "", lit[64];
	if (x->a >= 0)
		kpr_name(p, x->a, a, sizeof a);
	if (x->b >= 0)
		kpr_name(p, x->b, b, sizeof b);
	if (x->e >= 0)
		kpr_name(p, x->e, e, sizeof e);
	switch (x->op) {
	case EJ_K_LOAD:
		kpr_load(p, x, buf, n);
		return;
	case EJ_K_CONST:
		p->constant(buf, n, x->t, x->c);
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
	case EJ_K_SEL: /* a's own type: 0 converts exactly */
		snprintf(buf, n, "%s != 0 ? %s : %s", a, b, e);
		return;
#define EJ_OP(ID, name, n_in, n_out, flags)
#define EJ_OP_FN(ID, name, n_in, flags)                                        \
	case EJ_K_##ID:                                                        \
		if (n_in > 1)                                                  \
			snprintf(buf, n, "ej_" name "%s(%s, %s)", h, a, b);    \
		else                                                           \
			snprintf(buf, n, "ej_" name "%s(%s)", h, a);           \
		return;
#include "ops.def"
#undef EJ_OP_FN
#undef EJ_OP
	case EJ_K_POWC:
		p->literal(lit, sizeof lit, x->t, x->c);
		snprintf(buf, n, "pow%s(%s, %s)", f, a, lit);
		return;
	case EJ_K_RECIP:
		snprintf(buf, n, "%s / %s", one, a);
		return;
	case EJ_K_CVT:
		snprintf(buf, n, "(%s)%s", ej_kt_ctype(x->t), a);
		return;
	case EJ_K_RBF16:
		snprintf(buf, n, "ej_rbf16(%s)", a);
		return;
	default:
		EJ_ASSERT(!"reduction has no expression");
	}
}

static void kpr_decl(ej_kpr *p, int v)
{
	char buf[256], name[32];
	kpr_rhs(p, v, buf, sizeof buf);
	kpr_name(p, v, name, sizeof name);
	ej_kpr_line(p, "const %s %s = %s;", ej_kt_ctype(p->k->v[v].t), name,
		    buf);
}

void ej_kpr_need_row(ej_kpr *p, int v)
{
	const ej_kval *x = &p->k->v[v];
	if (p->row_done[v])
		return;
	EJ_ASSERT(!x->elem && !ej_kop_is_red(x->op));
	if (x->a >= 0)
		ej_kpr_need_row(p, x->a);
	if (x->b >= 0)
		ej_kpr_need_row(p, x->b);
	if (x->e >= 0)
		ej_kpr_need_row(p, x->e);
	int lane = p->lane;
	p->lane = -1;
	kpr_decl(p, v);
	p->lane = lane;
	p->row_done[v] = true;
}

void ej_kpr_need_elem(ej_kpr *p, int v)
{
	const ej_kval *x = &p->k->v[v];
	if (!x->elem) {
		EJ_ASSERT(p->row_done[v]);
		return;
	}
	if (p->elem_done[v] == p->body)
		return;
	if (x->a >= 0)
		ej_kpr_need_elem(p, x->a);
	if (x->b >= 0)
		ej_kpr_need_elem(p, x->b);
	if (x->e >= 0)
		ej_kpr_need_elem(p, x->e);
	kpr_decl(p, v);
	p->elem_done[v] = p->body;
}

void ej_kpr_pre_row(ej_kpr *p, int v)
{
	const ej_kval *x = &p->k->v[v];
	if (!x->elem) {
		if (!ej_kop_is_red(x->op))
			ej_kpr_need_row(p, v);
		return;
	}
	if (p->seen[v] == p->stamp)
		return;
	p->seen[v] = p->stamp;
	if (x->a >= 0)
		ej_kpr_pre_row(p, x->a);
	if (x->b >= 0)
		ej_kpr_pre_row(p, x->b);
	if (x->e >= 0)
		ej_kpr_pre_row(p, x->e);
}

void ej_kpr_pre_loop(ej_kpr *p, int l)
{
	const ej_kernel *k = p->k;
	p->stamp++;
	for (int v = 0; v < k->n_v; v++)
		if (ej_kop_is_red(k->v[v].op) && k->v[v].dep - 1 == l)
			ej_kpr_pre_row(p, k->v[v].a);
	for (int o = 0; o < k->n_out; o++)
		if (!k->out[o].row && k->out[o].loop == l)
			ej_kpr_pre_row(p, k->out[o].v);
}

void ej_kpr_store(ej_kpr *p, int o, const char *idx)
{
	const ej_koutput *out = &p->k->out[o];
	char name[32];
	kpr_name(p, out->v, name, sizeof name);
	int n = p->k->n_in + o;
	if (out->dtype == EPJ_DTYPE_BF16)
		ej_kpr_line(p, "out%d[%s] = ej_f2bf(%s);", n, idx, name);
	else
		ej_kpr_line(p, "out%d[%s] = %s;", n, idx, name);
}

void ej_kpr_loop_body(ej_kpr *p, int l)
{
	const ej_kernel *k = p->k;
	p->body++;
	for (int v = 0; v < k->n_v; v++) {
		const ej_kval *x = &k->v[v];
		if (!ej_kop_is_red(x->op) || x->dep - 1 != l)
			continue;
		ej_kpr_need_elem(p, x->a);
		const char *cast = k->v[x->a].t == x->t ? "" : "(double)";
		if (x->op == EJ_K_RSUM)
			ej_kpr_line(p, "acc%d%s += %sv%d;", v,
				    p->acc_at ? p->acc_at : "", cast, x->a);
		else if (x->op == EJ_K_RMAX)
			ej_kpr_line(p, "acc%d = ej_maxnan%s(acc%d, v%d);", v,
				    x->t == EJ_KT_F64 ? "_d" : "_f", v, x->a);
		else
			ej_kpr_line(p, "acc%d = v%d > acc%d ? v%d : acc%d;", v,
				    x->a, v, x->a, v);
	}
	for (int o = 0; o < k->n_out; o++) {
		if (k->out[o].row || k->out[o].loop != l)
			continue;
		ej_kpr_need_elem(p, k->out[o].v);
		ej_kpr_store(p, o, "ob + j");
	}
}
