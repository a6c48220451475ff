/* pipeline.c -- the compile pipeline of a traced region, the cache of
 * compiled segments, guards, and execution.
 *
 *   compile(trace):
 *     split at graph breaks -> segments
 *     per segment:  forward graph F (inputs: activations, params, consts)
 *                   signature(F) -> cache hit?  reuse
 *                   else  dce(F); cse(F);
 *                         joint graph + partition (autodiff.c) -> F', B
 *                         dce; cse; compact (F', B)
 *                         backend (interpreter: nothing to build)
 *   run(region, inputs, params):
 *     for each step: segment -> run F, hang one autograd node whose
 *                    backward runs B;  break -> runtime callback (eager)
 *
 * EPJIT_DEBUG_DUMP=dir writes each graph after each pass (debug.c).
 */
#include "cc.h"
#include "jit_impl.h"
#include "kcache.h"

#include <pthread.h>
#include <stdio.h>
#include <time.h>

/* ---- backends ------------------------------------------------------------ */

/* Indexed by ej_backend_kind: the rows of jit/backends.def. */
static const ej_codegen_backend *const backends[EJ_BACKEND_COUNT] = {
#define EJ_BACKEND(KIND, sym) [EJ_BACKEND_##KIND] = &sym,
#include "backends.def"
#undef EJ_BACKEND
};

const ej_codegen_backend *ej_backend_get(ej_backend_kind k)
{
	EJ_ASSERT((unsigned)k < EJ_ARRAY_LEN(backends) && backends[k]);
	return backends[k];
}

const char *ej_backend_device(ej_backend_kind k)
{
	return ej_backend_get(k)->device;
}

const char *ej_backend_name(ej_backend_kind k)
{
	return (unsigned)k < EJ_ARRAY_LEN(backends) ? backends[k]->name : "?";
}

static const char *backend_names[EJ_BACKEND_COUNT];
static pthread_once_t backend_names_once = PTHREAD_ONCE_INIT;

static void backend_names_fill(void)
{
	for (int i = 0; i < EJ_BACKEND_COUNT; i++)
		backend_names[i] = backends[i]->name;
}

const char *const *ej_backend_names(int *n)
{
	pthread_once(&backend_names_once, backend_names_fill);
	*n = EJ_BACKEND_COUNT;
	return backend_names;
}

/* The names of the backends, all or the available ones: "a, b, c". */
static void backend_list(char *buf, size_t n, bool only_available)
{
	size_t off = 0;
	buf[0] = 0;
	for (unsigned i = 0; i < EJ_ARRAY_LEN(backends) && off < n; i++)
		if (!only_available || backends[i]->available())
			off += (size_t)snprintf(buf + off, n - off, "%s%s",
						off ? ", " : "",
						backends[i]->name);
}

epj_status ej_backend_parse(const char *name, ej_backend_kind *out, char *msg,
			    size_t msg_len)
{
	if (msg && msg_len)
		msg[0] = 0;
	if (!name || !name[0]) {
		/* the run's device's (EPJIT_DEVICE, else cpu) own code
		 * generator (its descriptor's backend) when this build has
		 * it; else generated C */
		const char *dev = getenv("EPJIT_DEVICE");
		const ej_device_desc *d =
		    ej_device_find(dev && *dev ? dev : "cpu");
		if (!d) {
			if (msg)
				snprintf(msg, msg_len,
					 "EPJIT_DEVICE=\"%s\" is not a device "
					 "(known: %s)",
					 dev, epj_device_names());
			return EPJ_ERR_CONFIG;
		}
		*out = EJ_BACKEND_C;
		ej_backend_kind k;
		if (ej_backend_parse(d->backend, &k, NULL, 0) == EPJ_OK)
			*out = k;
		return EPJ_OK;
	}
	char list[128];
	for (unsigned i = 0; i < EJ_ARRAY_LEN(backends); i++) {
		if (strcmp(name, backends[i]->name) != 0)
			continue;
		if (backends[i]->available()) {
			*out = (ej_backend_kind)i;
			return EPJ_OK;
		}
		if (msg) {
			backend_list(list, sizeof list, true);
			snprintf(msg, msg_len,
				 "compile.backend \"%s\" is not available in "
				 "this build (available: %s)",
				 name, list);
		}
		return EPJ_ERR_UNSUPPORTED;
	}
	if (msg) {
		backend_list(list, sizeof list, false);
		snprintf(msg, msg_len,
			 "unknown compile.backend \"%s\" (known: %s)", name,
			 list);
	}
	return EPJ_ERR_CONFIG;
}

/* ---- jit state and segment cache --------------------------------------------
 */

ej_jit *ej_jit_new(epj_ctx *ctx, ej_backend_kind backend)
{
	ej_jit *j = calloc(1, sizeof *j);
	if (!j)
		return NULL;
	j->ctx = ctx;
	j->backend = backend;
	return j;
}

void ej_segment_unref(ej_segment *s)
{
	if (!s || --s->refcount > 0)
		return;
	if (s->backend && s->backend->free_state) {
		s->backend->free_state(s->fwd_state);
		s->backend->free_state(s->bwd_state);
	}
	ej_graph_free(s->fwd);
	ej_graph_free(s->bwd);
	free(s->grad_of_input);
	free(s->saved_src);
	free(s);
}

/* The jit's kernel cache, opened at its first use and kept for the jit's
 * lifetime (so the memory table serves every later build).  *kc is NULL
 * when there is none to use: no jit (a lone build, e.g. in tests) opens a
 * cache of its own that the caller closes (*own = true); a directory that
 * cannot be created or read costs only the caching (warned once per jit);
 * an unsafe one is never read: the process caches in a private directory
 * instead (ej_kcache_open_for_run).  who names the backend in messages. */
epj_status ej_jit_kcache(epj_ctx *ctx, ej_jit *jit, const char *who,
			 ej_kcache **kc, bool *own)
{
	*own = jit == NULL;
	if (jit && jit->kc_opened) {
		*kc = jit->kc;
		return EPJ_OK;
	}
	*kc = ej_kcache_open_for_run(ctx, NULL);
	if (!*kc) {
		if (epj_ctx_status(ctx) != EPJ_ERR_IO) {
			ej_error_prefix(ctx, "%s: kernel cache", who);
			return epj_ctx_status(ctx);
		}
		epj_log_msg(EPJ_LOG_WARN,
			    "%s: compiling without a kernel cache: %s", who,
			    epj_ctx_error(ctx));
		epj_ctx_clear_error(ctx);
	}
	if (jit) {
		jit->kc = *kc;
		jit->kc_opened = true;
	}
	return EPJ_OK;
}

void ej_jit_free(ej_jit *j)
{
	if (!j)
		return;
	for (int i = 0; i < j->cache_cap; i++)
		ej_segment_unref(j->cache[i]);
	free(j->cache);
	ej_kcache_close(j->kc);
	free(j);
}

static ej_segment *cache_find(ej_jit *j, epj_hash128 sig)
{
	if (!j->cache_cap)
		return NULL;
	for (int i = (int)(sig.lo & (uint64_t)(j->cache_cap - 1));;
	     i = (i + 1) & (j->cache_cap - 1)) {
		ej_segment *s = j->cache[i];
		if (!s)
			return NULL;
		if (s->sig.lo == sig.lo && s->sig.hi == sig.hi)
			return s;
	}
}

static epj_status cache_insert(epj_ctx *ctx, ej_jit *j, ej_segment *s)
{
	if ((j->cache_n + 1) * 2 > j->cache_cap) {
		int nc = j->cache_cap ? j->cache_cap * 2 : 64;
		ej_segment **nt = calloc((size_t)nc, sizeof *nt);
		if (!nt)
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"jit: out of memory");
		for (int i = 0; i < j->cache_cap; i++) {
			ej_segment *x = j->cache[i];
			if (!x)
				continue;
			int k = (int)(x->sig.lo & (uint64_t)(nc - 1));
			while (nt[k])
				k = (k + 1) & (nc - 1);
			nt[k] = x;
		}
		free(j->cache);
		j->cache = nt;
		j->cache_cap = nc;
	}
	int k = (int)(s->sig.lo & (uint64_t)(j->cache_cap - 1));
	while (j->cache[k])
		k = (k + 1) & (j->cache_cap - 1);
	j->cache[k] = s;
	s->refcount++;
	j->cache_n++;
	return EPJ_OK;
}

static double now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* ---- splitting a trace into steps
 * ------------------------------------------------ */

typedef struct build {
	ej_region_fn *rf;
	ej_trace *t;
	int *use_after; /* per trace value: last node index using it (or
			   n_nodes for region outputs) */
} build;

/* The segment of trace nodes [lo, hi): its forward graph and the step. */
static ej_graph *segment_graph(build *b, int lo, int hi, ej_region_step *st)
{
	ej_graph *tg = b->t->g;
	ej_graph *f = ej_graph_new("segment");
	ej_arena *A = b->rf->arena;
	int *map = malloc(sizeof *map * (size_t)(tg->n_values + 1));
	EJ_ASSERT(map);
	for (int v = 0; v < tg->n_values; v++)
		map[v] = -1;
	/* inputs: values used in [lo,hi) defined outside it, in order of
	 * first use; activations get ACT slots in order */
	int n_act = 0;
	int *act = ej_arena_alloc(A, sizeof(int) * (size_t)(tg->n_values + 1));
	for (int i = lo; i < hi; i++) {
		const ej_ir_node *n = &tg->nodes[i];
		for (int k = 0; k < n->n_in; k++) {
			int v = n->in[k];
			const ej_value *x = &tg->values[v];
			if (map[v] >= 0 || (x->node >= lo && x->node < hi))
				continue;
			ej_input_kind kind = EJ_IN_ACT;
			int slot = n_act;
			epj_tensor *konst = NULL;
			if (x->input >= 0 &&
			    tg->inputs[x->input].kind == EJ_IN_PARAM) {
				kind = EJ_IN_PARAM;
				slot = tg->inputs[x->input].slot;
			} else if (x->input >= 0 &&
				   tg->inputs[x->input].kind == EJ_IN_CONST) {
				kind = EJ_IN_CONST;
				slot = -1;
				konst = tg->inputs[x->input].konst;
			} else {
				act[n_act++] = v;
			}
			int nv = ej_graph_add_input(f, kind, slot, x->dtype,
						    x->ndim, x->shape);
			f->values[nv].requires_grad = x->requires_grad;
			if (konst)
				f->inputs[f->values[nv].input].konst =
				    epj_tensor_ref(konst);
			map[v] = nv;
		}
	}
	for (int i = lo; i < hi; i++) {
		const ej_ir_node *n = &tg->nodes[i];
		int ins[64];
		ej_meta m[16];
		for (int k = 0; k < n->n_in; k++)
			ins[k] = map[n->in[k]];
		for (int j = 0; j < n->n_out; j++) {
			const ej_value *x = &tg->values[n->out[j]];
			memset(&m[j], 0, sizeof m[j]);
			m[j].dtype = x->dtype;
			m[j].ndim = x->ndim;
			memcpy(m[j].shape, x->shape, sizeof x->shape);
		}
		int k = ej_graph_add_node(f, n->op, &n->attrs, ins, n->n_in, m,
					  n->n_out);
		for (int j = 0; j < n->n_out; j++) {
			map[n->out[j]] = f->nodes[k].out[j];
			f->values[map[n->out[j]]].requires_grad =
			    tg->values[n->out[j]].requires_grad;
		}
	}
	/* outputs: values defined here and used after hi */
	int n_out = 0;
	int *outs = ej_arena_alloc(A, sizeof(int) * (size_t)(tg->n_values + 1));
	for (int i = lo; i < hi; i++) {
		const ej_ir_node *n = &tg->nodes[i];
		for (int j = 0; j < n->n_out; j++) {
			int v = n->out[j];
			if (b->use_after[v] >= hi) {
				outs[n_out++] = v;
				ej_graph_add_output(f, map[v]);
			}
		}
	}
	st->is_break = false;
	st->n_in = n_act;
	st->in = act;
	st->n_out = n_out;
	st->out = outs;
	free(map);
	return f;
}

static void dump(ej_jit *jit, ej_graph *g, const char *pass)
{
	if (ej_debug_dump_dir())
		ej_debug_dump_graph(jit, g, pass);
}

/* The code-generating backends' GEMM epilogues (ej_pass_gemm_epilogue),
 * then DCE and compaction; the interpreter runs the graph op for op. */
static void epilogue(ej_jit *jit, ej_graph **g, const char *name,
		     const char *pass)
{
	if (ej_pass_gemm_epilogue(*g) == 0)
		return;
	ej_pass_dce(*g);
	ej_graph *c = ej_graph_compact(*g, name);
	ej_graph_free(*g);
	*g = c;
	dump(jit, c, pass);
}

/* Compiles one segment's forward graph (takes ownership of f). */
static epj_status compile_segment(epj_ctx *ctx, ej_jit *jit, ej_graph *f,
				  bool grad_mode, int index, ej_segment **out)
{
	*out = NULL;
	double t0 = now_ms();
	/* the signature covers the graph, its inputs' requires_grad, the
	 * grad mode and the backend */
	const char *text = ej_graph_text(f);
	char *key = ej_arena_printf(f->arena, "%s\nmode %s\nbackend %s\n", text,
				    grad_mode ? "train" : "eval",
				    ej_backend_name(jit->backend));
	epj_hash128 sig = epj_hash(key, strlen(key));
	ej_segment *hit = cache_find(jit, sig);
	if (hit) {
		epj_counter_add(ctx, "stats.graph_cache_hits", 1);
		hit->refcount++;
		ej_graph_free(f);
		*out = hit;
		return EPJ_OK;
	}
	epj_counter_add(ctx, "stats.graph_cache_misses", 1);
	ej_segment *s = calloc(1, sizeof *s);
	if (!s) {
		ej_graph_free(f);
		return ej_error(ctx, EPJ_ERR_NOMEM, "jit: out of memory");
	}
	s->refcount = 1;
	s->sig = sig;
	epj_hash_hex(sig, s->sig_hex);
	jit->compile_seq++;
	f->name = ej_arena_printf(f->arena, "%s", s->sig_hex);
	dump(jit, f, "0-traced");
	ej_pass_dce(f);
	ej_pass_cse(f);
	ej_pass_dce(f);
	ej_graph *fc = ej_graph_compact(f, s->sig_hex);
	ej_graph_free(f);
	dump(jit, fc, "1-dce-cse");
	const ej_codegen_backend *be = ej_backend_get(jit->backend);
	/* RoPE as one op (forward and backward), where the backend has a
	 * fused kernel for it */
	if (be->rope_fusion && ej_pass_rope(fc) > 0) {
		ej_pass_dce(fc);
		ej_graph *r = ej_graph_compact(fc, s->sig_hex);
		ej_graph_free(fc);
		fc = r;
		dump(jit, fc, "1-rope");
	}
	bool any_rg = false;
	for (int i = 0; i < fc->n_inputs; i++)
		any_rg |= fc->values[fc->inputs[i].value].requires_grad;
	epj_status st = EPJ_OK;
	bool built = false; /* a code-generating backend built the segment */
	int64_t misses0 = epj_counter_get(ctx, "cache.misses");
	if (grad_mode && any_rg) {
		st = ej_autodiff_segment(ctx, fc, s);
		ej_graph_free(fc);
		if (st == EPJ_OK) {
			s->fwd->name =
			    ej_arena_strdup(s->fwd->arena, s->sig_hex);
			s->bwd->name =
			    ej_arena_strdup(s->bwd->arena, s->sig_hex);
			dump(jit, s->fwd, "2-joint-forward");
			dump(jit, s->bwd, "2-joint-backward");
			ej_pass_cse(s->fwd);
			ej_pass_dce(s->fwd);
			ej_pass_cse(s->bwd);
			ej_pass_dce(s->bwd);
			ej_graph *a = ej_graph_compact(s->fwd, s->sig_hex);
			ej_graph *b = ej_graph_compact(s->bwd, s->sig_hex);
			ej_graph_free(s->fwd);
			ej_graph_free(s->bwd);
			s->fwd = a;
			s->bwd = b;
			dump(jit, s->fwd, "3-forward-final");
			dump(jit, s->bwd, "3-backward-final");
		}
	} else {
		s->fwd = fc;
		s->n_seg_out = fc->n_outputs;
		dump(jit, s->fwd, "3-forward-final");
	}
	if (st == EPJ_OK && be->build) {
		epilogue(jit, &s->fwd, s->sig_hex, "4-forward-epilogue");
		if (s->bwd)
			epilogue(jit, &s->bwd, s->sig_hex,
				 "4-backward-epilogue");
	}
	s->backend = &ej_backend_interp;
	if (st == EPJ_OK && !jit->defer_build && be->build) {
		s->backend = be;
		built = true;
		st = s->backend->build(ctx, jit, s->fwd, &s->fwd_state);
		if (st == EPJ_OK && s->bwd)
			st = s->backend->build(ctx, jit, s->bwd, &s->bwd_state);
	}
	if (st == EPJ_OK)
		st = cache_insert(ctx, jit, s);
	if (st != EPJ_OK) {
		ej_segment_unref(s);
		return st;
	}
	s->compile_ms = now_ms() - t0;
	ej_debug_dump_compile_time(jit, s->sig_hex, s->compile_ms,
				   ej_graph_live_nodes(s->fwd),
				   s->bwd ? ej_graph_live_nodes(s->bwd) : 0);
	ej_debug_dump_segment(jit, s, grad_mode, index);
	epj_counter_add(ctx, "stats.unique_graphs", 1);
	/* compile.us/ms count compilation: a segment whose artifacts were all
	 * found in the kernel cache (or that had none to build) ran no
	 * compiler; its passes, printing and loading go to
	 * compile.cached_us instead (doc/counters.md). */
	if (built && epj_counter_get(ctx, "cache.misses") == misses0) {
		epj_counter_add(ctx, "compile.cached_us",
				(int64_t)(s->compile_ms * 1000.0));
	} else {
		epj_counter_add(ctx, "compile.us",
				(int64_t)(s->compile_ms * 1000.0));
		epj_counter_add(ctx, "compile.ms",
				(int64_t)(s->compile_ms + 0.5));
	}
	*out = s;
	return EPJ_OK;
}

void ej_region_fn_free(ej_region_fn *f)
{
	if (!f)
		return;
	for (int i = 0; i < f->n_steps; i++)
		if (!f->steps[i].is_break)
			ej_segment_unref(f->steps[i].seg);
	ej_trace_free(f->trace);
	ej_arena_free(f->arena);
}

epj_status ej_jit_compile(epj_ctx *ctx, ej_jit *jit, ej_trace *trace,
			  ej_region_fn **out)
{
	*out = NULL;
	ej_arena *A = ej_arena_new();
	ej_region_fn *rf = ej_arena_alloc(A, sizeof *rf);
	rf->arena = A;
	rf->trace = trace;
	ej_graph *tg = trace->g;
	/* requires_grad through the trace: break outputs are set by the
	 * tracer; node outputs follow their inputs */
	build b = { .rf = rf, .t = trace };
	b.use_after =
	    ej_arena_alloc(A, sizeof(int) * (size_t)(tg->n_values + 1));
	for (int v = 0; v < tg->n_values; v++)
		b.use_after[v] = -1;
	for (int i = 0; i < tg->n_nodes; i++)
		for (int k = 0; k < tg->nodes[i].n_in; k++)
			b.use_after[tg->nodes[i].in[k]] = i;
	for (int i = 0; i < tg->n_outputs; i++)
		b.use_after[tg->outputs[i]] = tg->n_nodes;
	rf->steps = ej_arena_alloc(A, sizeof(ej_region_step) *
					  (size_t)(2 * tg->n_nodes + 2));
	epj_status st = EPJ_OK;
	int lo = 0, n_segments = 0;
	for (int i = 0; i <= tg->n_nodes && st == EPJ_OK; i++) {
		bool at_break =
		    i < tg->n_nodes && tg->nodes[i].op == EJ_IR_BREAK;
		if ((at_break || i == tg->n_nodes) && i > lo) {
			ej_region_step *s = &rf->steps[rf->n_steps];
			ej_graph *f = segment_graph(&b, lo, i, s);
			st = compile_segment(ctx, jit, f, trace->grad_mode,
					     n_segments++, &s->seg);
			if (st == EPJ_OK)
				rf->n_steps++;
		}
		if (at_break && st == EPJ_OK) {
			const ej_ir_node *n = &tg->nodes[i];
			ej_region_step *s = &rf->steps[rf->n_steps++];
			s->is_break = true;
			s->callee = n->callee;
			s->n_in = n->n_in;
			s->n_out = n->n_out;
			s->in =
			    ej_arena_alloc(A, sizeof(int) * (size_t)n->n_in);
			s->out =
			    ej_arena_alloc(A, sizeof(int) * (size_t)n->n_out);
			memcpy(s->in, n->in, sizeof(int) * (size_t)n->n_in);
			memcpy(s->out, n->out, sizeof(int) * (size_t)n->n_out);
		}
		if (at_break)
			lo = i + 1;
	}
	if (st != EPJ_OK) {
		rf->trace = NULL;
		ej_region_fn_free(rf);
		ej_trace_free(trace);
		return st;
	}
	rf->n_values = tg->n_values;
	rf->n_out = tg->n_outputs;
	rf->out = tg->outputs;
	/* last step using each trace value (region outputs: never freed) */
	rf->last_use =
	    ej_arena_alloc(A, sizeof(int) * (size_t)(tg->n_values + 1));
	for (int v = 0; v < tg->n_values; v++)
		rf->last_use[v] = -1;
	for (int s = 0; s < rf->n_steps; s++)
		for (int k = 0; k < rf->steps[s].n_in; k++)
			rf->last_use[rf->steps[s].in[k]] = s;
	for (int i = 0; i < tg->n_outputs; i++)
		rf->last_use[tg->outputs[i]] = rf->n_steps;
	epj_counter_add(ctx, "stats.regions_compiled", 1);
	*out = rf;
	return EPJ_OK;
}

/* ---- execution
 * ----------------------------------------------------------------- */

typedef struct seg_node_state {
	ej_segment *seg;
	epj_tensor **saved; /* n_saved (owned refs) */
	int n_saved;
	int *node_in_to_fwd_in; /* autograd input i -> fwd input index */
} seg_node_state;

static void seg_state_free(void *p)
{
	seg_node_state *s = p;
	if (!s)
		return;
	for (int i = 0; i < s->n_saved; i++)
		epj_tensor_free(s->saved[i]);
	free(s->saved);
	free(s->node_in_to_fwd_in);
	ej_segment_unref(s->seg);
	free(s);
}

static epj_status seg_backward(epj_ctx *ctx, ej_node *n,
			       epj_tensor *const *grad_out,
			       epj_tensor **grad_in)
{
	seg_node_state *s = n->custom;
	ej_graph *b = s->seg->bwd;
	epj_tensor **bin = calloc((size_t)b->n_inputs + 1, sizeof *bin);
	epj_tensor **bout = calloc((size_t)b->n_outputs + 1, sizeof *bout);
	epj_status st = EPJ_OK;
	if (!bin || !bout) {
		st = ej_error(ctx, EPJ_ERR_NOMEM,
			      "compiled backward: out of "
			      "memory");
		goto out;
	}
	for (int i = 0; i < b->n_inputs && st == EPJ_OK; i++) {
		const ej_graph_input *gi = &b->inputs[i];
		if (gi->kind == EJ_IN_SAVED) {
			bin[i] = epj_tensor_ref(s->saved[gi->slot]);
			continue;
		}
		EJ_ASSERT(gi->kind == EJ_IN_GRAD);
		if (gi->slot < n->n_out && grad_out[gi->slot]) {
			bin[i] = epj_tensor_ref(grad_out[gi->slot]);
		} else {
			const ej_value *x = &b->values[gi->value];
			bin[i] = epj_zeros(ctx, x->dtype, x->ndim, x->shape);
			if (!bin[i])
				st = ctx->status;
		}
	}
	if (st == EPJ_OK)
		st = s->seg->backend->run(ctx, s->seg->bwd_state, b, bin, bout);
	if (st == EPJ_OK) {
		for (int i = 0; i < n->n_in; i++) {
			int k = s->node_in_to_fwd_in[i];
			int o = s->seg->grad_of_input[k];
			grad_in[i] = o >= 0 ? epj_tensor_ref(bout[o]) : NULL;
		}
	}
out:
	for (int i = 0; bin && i < b->n_inputs; i++)
		epj_tensor_free(bin[i]);
	for (int i = 0; bout && i < b->n_outputs; i++)
		epj_tensor_free(bout[i]);
	free(bin);
	free(bout);
	return st;
}

static epj_tensor *alias(epj_tensor *t)
{
	return ej_tensor_view(t, t->ndim, t->shape, t->stride, t->offset);
}

/* Runs segment step `st` with env bindings; fills env with its outputs. */
static epj_status run_segment(epj_ctx *ctx, const ej_region_step *step,
			      epj_tensor **env, epj_tensor *const *params,
			      int n_params)
{
	ej_segment *seg = step->seg;
	ej_graph *f = seg->fwd;
	epj_status st = EPJ_OK;
	epj_tensor **fin = calloc((size_t)f->n_inputs + 1, sizeof *fin);
	epj_tensor **fout = calloc((size_t)f->n_outputs + 1, sizeof *fout);
	epj_tensor **res = calloc((size_t)seg->n_seg_out + 1, sizeof *res);
	if (!fin || !fout || !res) {
		st = ej_error(ctx, EPJ_ERR_NOMEM,
			      "compiled forward: out of "
			      "memory");
		goto out;
	}
	for (int i = 0; i < f->n_inputs; i++) {
		const ej_graph_input *gi = &f->inputs[i];
		switch (gi->kind) {
		case EJ_IN_ACT:
			fin[i] = env[step->in[gi->slot]];
			break;
		case EJ_IN_PARAM:
			EJ_ASSERT(gi->slot < n_params);
			fin[i] = params[gi->slot];
			break;
		case EJ_IN_CONST:
			fin[i] = gi->konst;
			break;
		default:
			EJ_ASSERT(!"unexpected forward input kind");
		}
		EJ_ASSERT(fin[i]);
	}
	st = seg->backend->run(ctx, seg->fwd_state, f, fin, fout);
	if (st != EPJ_OK)
		goto out;
	for (int j = 0; j < seg->n_seg_out; j++) {
		res[j] = alias(fout[j]);
		if (!res[j]) {
			st = ctx->status ? ctx->status : EPJ_ERR_NOMEM;
			goto out;
		}
	}
	if (ctx->grad_enabled && seg->bwd) {
		seg_node_state *s = calloc(1, sizeof *s);
		epj_tensor **nin = calloc((size_t)f->n_inputs + 1, sizeof *nin);
		if (!s || !nin) {
			free(s);
			free(nin);
			st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
			goto out;
		}
		s->seg = seg;
		seg->refcount++;
		s->n_saved = seg->n_saved;
		s->saved = calloc((size_t)seg->n_saved + 1, sizeof *s->saved);
		s->node_in_to_fwd_in =
		    calloc((size_t)f->n_inputs + 1, sizeof(int));
		int n_nin = 0;
		for (int i = 0; i < f->n_inputs; i++) {
			if (f->inputs[i].kind == EJ_IN_CONST)
				continue;
			s->node_in_to_fwd_in[n_nin] = i;
			nin[n_nin++] = fin[i];
		}
		for (int q = 0; q < seg->n_saved; q++) {
			int src = seg->saved_src[q];
			epj_tensor *t = src >= 0 ? fout[src] : fin[-(src + 1)];
			s->saved[q] = alias(t);
		}
		ej_node *node = ej_node_custom(ctx, "compiled segment", nin,
					       n_nin, res, seg->n_seg_out,
					       seg_backward, s, seg_state_free);
		free(nin);
		if (!node) {
			seg_state_free(s);
			st = ctx->status;
			goto out;
		}
		/* a compiled segment never communicates: its backward may
		 * run while an exchange's gradient travels */
		node->bw_comm_free = true;
	}
	for (int j = 0; j < seg->n_seg_out; j++) {
		env[step->out[j]] = res[j];
		res[j] = NULL;
	}
out:
	for (int j = 0; fout && j < f->n_outputs; j++)
		epj_tensor_free(fout[j]);
	for (int j = 0; res && j < seg->n_seg_out; j++)
		epj_tensor_free(res[j]);
	free(fin);
	free(fout);
	free(res);
	return st;
}

epj_status ej_region_run(epj_ctx *ctx, ej_region_fn *f, epj_tensor *const *in,
			 int n_in, epj_tensor *const *params, int n_params,
			 ej_break_call_fn brk, void *brk_user, epj_tensor **out,
			 int n_out)
{
	for (int j = 0; j < n_out; j++)
		out[j] = NULL;
	if (n_in != f->trace->n_in || n_out != f->n_out)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"compiled region: called with %d inputs / %d "
				"outputs, compiled for %d / %d",
				n_in, n_out, f->trace->n_in, f->n_out);
	epj_tensor **env = calloc((size_t)f->n_values + 1, sizeof *env);
	if (!env)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	ej_graph *tg = f->trace->g;
	for (int i = 0; i < tg->n_inputs; i++) {
		const ej_graph_input *gi = &tg->inputs[i];
		if (gi->kind == EJ_IN_ACT)
			env[gi->value] = epj_tensor_ref(in[gi->slot]);
	}
	epj_status st = EPJ_OK;
	for (int s = 0; s < f->n_steps && st == EPJ_OK; s++) {
		const ej_region_step *step = &f->steps[s];
		if (step->is_break) {
			epj_tensor *bi[16], *bo[16] = { 0 };
			for (int k = 0; k < step->n_in; k++) {
				int v = step->in[k];
				const ej_value *x = &tg->values[v];
				if (env[v]) {
					bi[k] = env[v];
				} else if (x->input >= 0 &&
					   tg->inputs[x->input].kind ==
					       EJ_IN_PARAM) {
					bi[k] =
					    params[tg->inputs[x->input].slot];
				} else {
					EJ_ASSERT(x->input >= 0);
					bi[k] = tg->inputs[x->input].konst;
				}
			}
			st = brk(brk_user, ctx, step->callee, bi, step->n_in,
				 bo, step->n_out);
			for (int j = 0; j < step->n_out && st == EPJ_OK; j++)
				env[step->out[j]] = bo[j];
		} else {
			st = run_segment(ctx, step, env, params, n_params);
		}
		/* release values whose last use was this step */
		for (int k = 0; k < step->n_in; k++) {
			int v = step->in[k];
			if (f->last_use[v] == s) {
				epj_tensor_free(env[v]);
				env[v] = NULL;
			}
		}
	}
	if (st == EPJ_OK) {
		for (int j = 0; j < n_out; j++) {
			int v = f->out[j];
			const ej_value *x = &tg->values[v];
			epj_tensor *t = env[v];
			if (!t && x->input >= 0)
				t = tg->inputs[x->input].kind == EJ_IN_PARAM
					? params[tg->inputs[x->input].slot]
					: tg->inputs[x->input].konst;
			EJ_ASSERT(t);
			out[j] = epj_tensor_ref(t);
		}
	}
	for (int v = 0; v < f->n_values; v++)
		epj_tensor_free(env[v]);
	free(env);
	return st;
}

/* ---- guards
 * ------------------------------------------------------------------- */

static bool guard_check(const ej_region_fn *f, const epj_ctx *ctx,
			epj_tensor *const *in, int n_in,
			epj_tensor *const *params, int n_params, char *buf,
			size_t n)
{
	const ej_trace *t = f->trace;
	if (buf && n)
		buf[0] = 0;
	if (n_in != t->n_in) {
		if (buf)
			snprintf(buf, n, "%d inputs instead of %d", n_in,
				 t->n_in);
		return false;
	}
	if (ctx->grad_enabled != t->grad_mode) {
		if (buf)
			snprintf(buf, n, "grad mode %s instead of %s",
				 ctx->grad_enabled ? "train" : "eval",
				 t->grad_mode ? "train" : "eval");
		return false;
	}
	for (int i = 0; i < n_in; i++) {
		const ej_meta *m = &t->in_meta[i];
		bool ok = in[i]->dtype == m->dtype && in[i]->ndim == m->ndim;
		for (int d = 0; ok && d < m->ndim; d++)
			ok = in[i]->shape[d] == m->shape[d];
		if (!ok) {
			if (buf) {
				char a[64], b[64];
				snprintf(
				    buf, n,
				    "input %d is %s, compiled for "
				    "%s %s",
				    i, epj_tensor_describe(in[i], a, sizeof a),
				    epj_dtype_name(m->dtype),
				    ej_shape_str(m->ndim, m->shape, b,
						 sizeof b));
			}
			return false;
		}
		if (in[i]->requires_grad != t->in_rg[i]) {
			if (buf)
				snprintf(buf, n,
					 "input %d requires_grad "
					 "changed",
					 i);
			return false;
		}
	}
	if (n_params < t->n_params) {
		if (buf)
			snprintf(buf, n, "%d parameters instead of %d",
				 n_params, t->n_params);
		return false;
	}
	for (int i = 0; i < t->n_params; i++) {
		if (t->param_dtype[i] == EPJ_DTYPE_COUNT)
			continue;
		if (params[i]->dtype != t->param_dtype[i] ||
		    (params[i]->requires_grad && ctx->grad_enabled) !=
			t->param_rg[i]) {
			if (buf)
				snprintf(buf, n,
					 "parameter %d dtype or "
					 "requires_grad changed",
					 i);
			return false;
		}
	}
	return true;
}

bool ej_region_fn_guard_ok(const ej_region_fn *f, const epj_ctx *ctx,
			   epj_tensor *const *in, int n_in,
			   epj_tensor *const *params, int n_params)
{
	return guard_check(f, ctx, in, n_in, params, n_params, NULL, 0);
}

void ej_region_fn_guard_explain(const ej_region_fn *f, const epj_ctx *ctx,
				epj_tensor *const *in, int n_in,
				epj_tensor *const *params, int n_params,
				char *buf, size_t n)
{
	if (guard_check(f, ctx, in, n_in, params, n_params, buf, n) && n)
		snprintf(buf, n, "all guards pass");
}
