/* sched.c -- the fusion scheduler: groups a graph's nodes into fused
 * kernels and extern nodes, and orders them.
 *
 * Every fusable node (ej_kir_node_class: float pointwise ops, row
 * reductions over the last axis, expand / unit-dim reshape) starts as its
 * own group; extern nodes (matmul, linear, sdpa, cross_entropy, indexing,
 * cat, other views, ...) are never grouped.  Then, until nothing changes,
 * every producer -> consumer edge between two groups is offered for a
 * merge, which is taken when
 *   - the merged group stays convex: no path leaves it and comes back
 *     through another node (so the group graph stays acyclic and every
 *     consumer outside a kernel runs after it);
 *   - every view node of the group has all its consumers inside (a view
 *     that is also read elsewhere stays a free extern view instead of
 *     being materialised);
 *   - the kernel IR builder accepts the union (ej_kir_build is the one
 *     legality test: shapes line up, reductions are read in their row...).
 * A group of views only is run as extern views.  Merging over every edge in
 * graph order lets a pointwise prologue join its reduction and the
 * reduction's pointwise epilogue join too (RMSNorm forward: one kernel).
 *
 * Order: groups are emitted in a topological order of the group graph,
 * picking among the ready ones the group with the smallest first node, so
 * the schedule follows the traced program order.
 *
 * Memory: buffers inside a kernel are never materialised (they are SSA
 * scalars); buffers between steps are tensors freed after their last use by
 * the backend, and the caching allocator reuses freed blocks of the same
 * size class -- that reuse is the memory plan (a static offset plan would
 * only matter for a device without a caching allocator).
 */
#include "kir.h"

typedef struct sched {
	const ej_graph *g;
	const ej_uses *u;
	ej_kclass *cls;
	int *gid;	  /* group of each node */
	int *head, *next; /* member lists (node order not kept) */
	int *size;
	int *stamp, cur;
	int *stack;
	bool *member; /* scratch mask for legality tests */
	int *list;    /* scratch node list */
} sched;

static int max_node(const sched *s, int grp)
{
	int m = -1;
	for (int n = s->head[grp]; n >= 0; n = s->next[n])
		if (n > m)
			m = n;
	return m;
}

/* Is there a path from group a to group b through a node outside both? */
static bool path_via_outside(sched *s, int a, int b)
{
	int limit = max_node(s, b); /* graph order is topological */
	int sp = 0;
	s->cur++;
	for (int n = s->head[a]; n >= 0; n = s->next[n]) {
		const ej_ir_node *x = &s->g->nodes[n];
		for (int j = 0; j < x->n_out; j++) {
			int v = x->out[j];
			for (int q = s->u->start[v]; q < s->u->start[v + 1];
			     q++) {
				int c = s->u->node[q];
				if (s->gid[c] == a || s->gid[c] == b ||
				    c > limit || s->stamp[c] == s->cur)
					continue;
				s->stamp[c] = s->cur;
				s->stack[sp++] = c;
			}
		}
	}
	while (sp > 0) {
		int n = s->stack[--sp];
		const ej_ir_node *x = &s->g->nodes[n];
		for (int j = 0; j < x->n_out; j++) {
			int v = x->out[j];
			for (int q = s->u->start[v]; q < s->u->start[v + 1];
			     q++) {
				int c = s->u->node[q];
				if (s->gid[c] == b)
					return true;
				if (s->gid[c] == a || c > limit ||
				    s->stamp[c] == s->cur)
					continue;
				s->stamp[c] = s->cur;
				s->stack[sp++] = c;
			}
		}
	}
	return false;
}

/* Views of the union must have all their consumers inside it. */
static bool views_closed(const sched *s, int a, int b)
{
	for (int pass = 0; pass < 2; pass++) {
		int grp = pass ? b : a;
		for (int n = s->head[grp]; n >= 0; n = s->next[n]) {
			if (s->cls[n] != EJ_KC_VIEW)
				continue;
			int v = s->g->nodes[n].out[0];
			if (s->u->is_output[v])
				return false;
			for (int q = s->u->start[v]; q < s->u->start[v + 1];
			     q++) {
				int c = s->u->node[q];
				if (s->gid[c] != a && s->gid[c] != b)
					return false;
			}
		}
	}
	return true;
}

static int sort_int(const void *x, const void *y)
{
	int a = *(const int *)x, b = *(const int *)y;
	return (a > b) - (a < b);
}

/* Members of the union of groups a and b (b may be -1) into s->list,
 * sorted, with s->member set; returns the count.  Clear with unmark(). */
static int mark(sched *s, int a, int b)
{
	int n = 0;
	for (int pass = 0; pass < 2; pass++) {
		int grp = pass ? b : a;
		if (grp < 0)
			continue;
		for (int x = s->head[grp]; x >= 0; x = s->next[x]) {
			s->list[n++] = x;
			s->member[x] = true;
		}
	}
	qsort(s->list, (size_t)n, sizeof(int), sort_int);
	return n;
}

static void unmark(sched *s, int n)
{
	for (int i = 0; i < n; i++)
		s->member[s->list[i]] = false;
}

static bool try_merge(sched *s, int a, int b)
{
	if (!views_closed(s, a, b) || path_via_outside(s, a, b) ||
	    path_via_outside(s, b, a))
		return false;
	int n = mark(s, a, b);
	ej_arena *T = ej_arena_new();
	ej_kernel *k = ej_kir_build(T, s->g, s->u, s->member, s->list, n, NULL);
	ej_arena_free(T);
	unmark(s, n);
	if (!k)
		return false;
	/* relabel the smaller group */
	if (s->size[a] < s->size[b]) {
		int t = a;
		a = b;
		b = t;
	}
	int last = -1;
	for (int x = s->head[b]; x >= 0; x = s->next[x]) {
		s->gid[x] = a;
		last = x;
	}
	s->next[last] = s->head[a];
	s->head[a] = s->head[b];
	s->head[b] = -1;
	s->size[a] += s->size[b];
	s->size[b] = 0;
	return true;
}

static bool fusable(const sched *s, int n)
{
	return s->cls[n] != EJ_KC_EXTERN;
}

ej_schedule *ej_sched_build(ej_arena *A, const ej_graph *g)
{
	int N = g->n_nodes;
	sched s = { .g = g };
	s.u = ej_uses_build(A, g);
	size_t ni = sizeof(int) * (size_t)(N + 1);
	s.cls = calloc((size_t)N + 1, sizeof *s.cls);
	s.gid = malloc(ni);
	s.head = malloc(ni);
	s.next = malloc(ni);
	s.size = malloc(ni);
	s.stamp = calloc((size_t)N + 1, sizeof(int));
	s.stack = malloc(ni);
	s.member = calloc((size_t)N + 1, sizeof(bool));
	s.list = malloc(ni);
	EJ_ASSERT(s.cls && s.gid && s.head && s.next && s.size && s.stamp &&
		  s.stack && s.member && s.list);
	for (int n = 0; n < N; n++) {
		s.cls[n] = ej_kir_node_class(g, n);
		s.gid[n] = n;
		s.head[n] = g->nodes[n].dead ? -1 : n;
		s.next[n] = -1;
		s.size[n] = g->nodes[n].dead ? 0 : 1;
	}
	/* merge over producer -> consumer edges until a fixed point */
	for (bool changed = true; changed;) {
		changed = false;
		for (int n = 0; n < N; n++) {
			if (g->nodes[n].dead || !fusable(&s, n))
				continue;
			for (int k = 0; k < g->nodes[n].n_in; k++) {
				int p = g->values[g->nodes[n].in[k]].node;
				if (p < 0 || !fusable(&s, p) ||
				    s.gid[p] == s.gid[n])
					continue;
				if (try_merge(&s, s.gid[p], s.gid[n]))
					changed = true;
			}
		}
	}

	/* steps: groups in a topological order (smallest first node among the
	 * ready ones); a group is ready when every producer group is done */
	ej_schedule *sc = ej_arena_alloc(A, sizeof *sc);
	sc->g = g;
	sc->steps = ej_arena_alloc(A, sizeof(ej_step) * (size_t)(N + 1));
	sc->kernels = ej_arena_alloc(A, sizeof(ej_kernel *) * (size_t)(N + 1));
	int *first = malloc(ni), *pending = calloc((size_t)N + 1, sizeof(int));
	bool *done = calloc((size_t)N + 1, sizeof(bool));
	EJ_ASSERT(first && pending && done);
	for (int grp = 0; grp < N; grp++)
		first[grp] = s.head[grp] >= 0 ? N : -1;
	for (int n = 0; n < N; n++) {
		if (g->nodes[n].dead)
			continue;
		int grp = s.gid[n];
		if (n < first[grp])
			first[grp] = n;
		for (int k = 0; k < g->nodes[n].n_in; k++) {
			int p = g->values[g->nodes[n].in[k]].node;
			if (p >= 0 && s.gid[p] != grp)
				pending[grp]++;
		}
	}
	for (;;) {
		int best = -1;
		for (int grp = 0; grp < N; grp++)
			if (first[grp] >= 0 && !done[grp] && !pending[grp] &&
			    (best < 0 || first[grp] < first[best]))
				best = grp;
		if (best < 0)
			break;
		done[best] = true;
		int n = mark(&s, best, -1);
		bool compute = false;
		for (int i = 0; i < n; i++)
			compute |= s.cls[s.list[i]] != EJ_KC_VIEW;
		ej_kernel *k = NULL;
		if (compute && fusable(&s, s.list[0]))
			k = ej_kir_build(A, g, s.u, s.member, s.list, n, NULL);
		unmark(&s, n);
		if (k) {
			k->id = sc->n_kernels;
			sc->kernels[sc->n_kernels++] = k;
			sc->steps[sc->n_steps++] =
			    (ej_step){ .k = k, .node = -1 };
		} else {
			for (int i = 0; i < n; i++) {
				sc->steps[sc->n_steps++] =
				    (ej_step){ .k = NULL, .node = s.list[i] };
				sc->n_extern++;
			}
		}
		/* release consumers */
		for (int i = 0; i < n; i++) {
			const ej_ir_node *x = &g->nodes[s.list[i]];
			for (int j = 0; j < x->n_out; j++) {
				int v = x->out[j];
				for (int q = s.u->start[v];
				     q < s.u->start[v + 1]; q++) {
					int c = s.u->node[q];
					if (s.gid[c] != best)
						pending[s.gid[c]]--;
				}
			}
		}
	}
	for (int grp = 0; grp < N; grp++)
		EJ_ASSERT(first[grp] < 0 || done[grp]);
	free(first);
	free(pending);
	free(done);
	free(s.cls);
	free(s.gid);
	free(s.head);
	free(s.next);
	free(s.size);
	free(s.stamp);
	free(s.stack);
	free(s.member);
	free(s.list);
	return sc;
}
