/* backend_c.c -- the C backend: compiled graphs run generated C.
 *
 *   build(g):  schedule (sched.c: fused kernels + extern nodes)
 *              -> print C (print_c.c)
 *              -> kernel cache lookup (the jit's cache, open for its
 *                 lifetime; key: ej_artifact_key of the source, the host
 *                 cc identity and flags)
 *              -> miss: host cc (hostcc.c), store
 *              -> dlopen the shared object, look up epjk_<i>
 *   run(g):    the interpreter's calling convention (inputs bound to
 *              g->inputs in order, outs[] new references for g->outputs,
 *              grad disabled).  Steps run in schedule order: a fused kernel
 *              gets its inputs' element-0 pointers and per-access strides
 *              (views are read in place) and fresh contiguous outputs; an
 *              extern node runs through ej_dispatch exactly as in the
 *              interpreter.  Each kernel and each extern op that launches
 *              a kernel counts one kernels.launched.compiled.
 *
 * Memory plan: a value lives from the step producing it to its last use
 * (liveness computed at build); it is freed right after that step, so the
 * caching allocator hands its block to the next allocation of the same
 * size class.  Values internal to a fused kernel never exist in memory.
 *
 * EPJIT_DEBUG_DUMP=dir writes dir/kernels/<seq>-<graph>.txt (schedule and
 * kernel IR), <seq>-<graph>.c (the generated source) and <seq>-<graph>.cu
 * (the CUDA C of the same kernels) per built graph.
 */
#include "cc.h"
#include "kcache.h"
#include "kir.h"

#include <errno.h>
#include <stdio.h>
#include <sys/stat.h>
#include <time.h>

typedef void (*ckernel_fn)(char *const *ptr, const int64_t *st);

typedef struct cstate {
	ej_arena *A;
	ej_schedule *s;
	void *handle;
	ckernel_fn *fn; /* per kernel */
	int *last;	/* per value: last step reading it; n_steps for graph
			   outputs; -1 never read */
	int max_ptr, max_st;
} cstate;

static void cstate_free(void *p)
{
	cstate *cs = p;
	if (!cs)
		return;
	ej_hostcc_unload(cs->handle);
	free(cs->fn);
	free(cs->last);
	ej_arena_free(cs->A);
	free(cs);
}

static void dump_file(ej_jit *jit, const char *name, const char *ext,
		      const char *text)
{
	const char *dir = ej_debug_dump_dir();
	char path[4200];
	snprintf(path, sizeof path, "%s", dir);
	mkdir(path, 0755);
	snprintf(path, sizeof path, "%s/kernels", dir);
	if (mkdir(path, 0755) != 0 && errno != EEXIST) {
		epj_log_msg(EPJ_LOG_WARN, "debug dump: cannot create %s: %s",
			    path, strerror(errno));
		return;
	}
	snprintf(path, sizeof path, "%s/kernels/%03d-%s.%s", dir,
		 jit ? jit->compile_seq : 0, name, ext);
	FILE *f = fopen(path, "w");
	if (!f) {
		epj_log_msg(EPJ_LOG_WARN, "debug dump: cannot write %s: %s",
			    path, strerror(errno));
		return;
	}
	fputs(text, f);
	fclose(f);
}

void ej_codegen_graph_name(ej_graph *g, char name[48])
{
	char gh[33];
	const char *text = ej_graph_text(g);
	epj_hash_hex(epj_hash(text, strlen(text)), gh);
	snprintf(name, 48, "g%.16s", gh);
}

/* The key of the shared object built from C `src`: the artifact rule
 * (ej_artifact_key) with the host compiler's identity and flags; warm-up
 * and archive import compute keys through here too. */
void ej_backend_c_key(const char *src, char key[EJ_KCACHE_KEY_LEN + 1])
{
	ej_artifact_key(key, "c", ej_hostcc_identity(), ej_hostcc_cflags(), "",
			src);
}

static epj_status find_kernels(epj_ctx *ctx, cstate *cs, const char *name);

/* Loads the shared object so[0..so_len) and finds its kernels. */
static epj_status load_so(epj_ctx *ctx, cstate *cs, const void *so,
			  size_t so_len, const char *name)
{
	epj_status st = ej_hostcc_load(ctx, so, so_len, name, &cs->handle);
	if (st == EPJ_OK)
		st = find_kernels(ctx, cs, name);
	return st;
}

/* Loads the artifact *so that the cache handed out (none: nothing to do).
 * One that does not load (dlopen fails, a kernel symbol is missing: built
 * against another glibc, say, or imported) is dropped from the cache
 * (ej_kcache_drop_unloadable: counted, warned once) and *so freed and set
 * to NULL, so that the caller compiles as on a miss: a cache entry is never
 * the run's error, and this returns EPJ_OK either way. */
static epj_status load_cached(epj_ctx *ctx, ej_kcache *kc, const char *key,
			      cstate *cs, void **so, size_t so_len,
			      const char *name)
{
	if (!*so)
		return EPJ_OK;
	epj_status st = load_so(ctx, cs, *so, so_len, name);
	if (st == EPJ_OK)
		return EPJ_OK;
	ej_hostcc_unload(cs->handle);
	cs->handle = NULL;
	free(cs->fn);
	cs->fn = NULL;
	ej_kcache_drop_unloadable(kc, key, *so, so_len, epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
	free(*so);
	*so = NULL;
	return EPJ_OK;
}

/* Finds or makes the shared object of the schedule and loads it.  The key
 * is that of the artifact (ej_artifact_key): the generated source, the host
 * compiler's identity and its flags, so that any change of the generator
 * that changes the source misses.  On a miss (or a cached object that does
 * not load, dropped by load_cached) one process per key compiles (the others
 * wait for its entry under the key's lock); what is put is only what loaded
 * and has every symbol.  A freshly compiled object that does not load is an
 * error, and says so. */
static epj_status load_kernels(epj_ctx *ctx, ej_jit *jit, ej_graph *g,
			       cstate *cs, const char *name)
{
	(void)g;
	const char *src = ej_print_c(cs->A, cs->s, name);
	if (ej_debug_dump_dir())
		dump_file(jit, name, "c", src);
	char key[EJ_KCACHE_KEY_LEN + 1];
	ej_backend_c_key(src, key);

	ej_kcache *kc = NULL;
	bool own = false;
	epj_status st = ej_jit_kcache(ctx, jit, "c backend", &kc, &own);
	if (st != EPJ_OK)
		return st;
	void *so = NULL;
	size_t so_len = 0;
	st = kc ? ej_kcache_get(kc, key, &so, &so_len) : EPJ_OK;
	if (st == EPJ_OK)
		st = load_cached(ctx, kc, key, cs, &so, so_len, name);
	int lock = -1;
	if (st == EPJ_OK && !so && kc) {
		st = ej_kcache_lock(kc, key, &lock);
		if (st == EPJ_OK)
			st = ej_kcache_recheck(kc, key, &so, &so_len);
		if (st == EPJ_OK)
			st = load_cached(ctx, kc, key, cs, &so, so_len, name);
	}
	if (st == EPJ_OK && !so) {
		char *log = NULL;
		struct timespec t0, t1;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		st = ej_hostcc_compile(ctx, src, name, &so, &so_len, &log);
		epj_counter_add(ctx, "codegen.cc_compiles", 1);
		clock_gettime(CLOCK_MONOTONIC, &t1);
		/* the host compiler's share of compile.us: 0 on a warm cache */
		epj_counter_add(ctx, "compile.cc_us",
				(int64_t)(t1.tv_sec - t0.tv_sec) * 1000000 +
				    (t1.tv_nsec - t0.tv_nsec) / 1000);
		if (st == EPJ_OK && log && *log)
			epj_log_msg(EPJ_LOG_INFO, "c backend: %s: cc said: %s",
				    name, log);
		free(log);
		if (st == EPJ_OK) {
			st = load_so(ctx, cs, so, so_len, name);
			if (st != EPJ_OK)
				ej_error_prefix(ctx, "the shared object just "
						     "compiled does not load");
		}
		if (st == EPJ_OK && kc)
			st = ej_kcache_put(kc, key, so, so_len, src);
	}
	if (kc)
		ej_kcache_unlock(kc, lock);
	if (own)
		ej_kcache_close(kc);
	free(so);
	return st;
}

/* Looks up epjk_<i> of every kernel in the loaded object. */
static epj_status find_kernels(epj_ctx *ctx, cstate *cs, const char *name)
{
	cs->fn = calloc((size_t)cs->s->n_kernels + 1, sizeof *cs->fn);
	if (!cs->fn)
		return ej_error(ctx, EPJ_ERR_NOMEM, "c backend: out of memory");
	for (int i = 0; i < cs->s->n_kernels; i++) {
		char sym[32];
		snprintf(sym, sizeof sym, "epjk_%d", i);
		void *p = ej_hostcc_sym(cs->handle, sym);
		if (!p)
			return ej_error(ctx, EPJ_ERR_BACKEND,
					"c backend: %s: symbol %s missing from "
					"the compiled object",
					name, sym);
		/* POSIX: a data pointer from dlsym converts to a function
		 * pointer */
		memcpy(&cs->fn[i], &p, sizeof p);
	}
	return EPJ_OK;
}

static epj_status build(epj_ctx *ctx, ej_jit *jit, ej_graph *g, void **state)
{
	*state = NULL;
	cstate *cs = calloc(1, sizeof *cs);
	if (!cs)
		return ej_error(ctx, EPJ_ERR_NOMEM, "c backend: out of memory");
	cs->A = ej_arena_new();
	cs->s = ej_sched_build(cs->A, g);
	ej_schedule *s = cs->s;
	char name[48];
	ej_codegen_graph_name(g, name);

	/* liveness by step */
	cs->last = ej_last_use(g, s->n_steps, ej_sched_step_read, s);
	if (!cs->last) {
		cstate_free(cs);
		return ej_error(ctx, EPJ_ERR_NOMEM, "c backend: out of memory");
	}
	for (int i = 0; i < s->n_steps; i++) {
		const ej_kernel *k = s->steps[i].k;
		if (!k)
			continue;
		int np = k->n_in + k->n_out;
		int ns = k->n_acc * k->rank;
		cs->max_ptr = np > cs->max_ptr ? np : cs->max_ptr;
		cs->max_st = ns > cs->max_st ? ns : cs->max_st;
	}
	if (ej_debug_dump_dir()) {
		dump_file(jit, name, "txt", ej_sched_text(cs->A, s));
		if (s->n_kernels > 0) /* what the CUDA path would compile */
			dump_file(jit, name, "cu",
				  ej_print_cuda(cs->A, s, name));
	}
	epj_status st = EPJ_OK;
	if (s->n_kernels > 0)
		st = load_kernels(ctx, jit, g, cs, name);
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "c backend (%s)", name);
		cstate_free(cs);
		return st;
	}
	epj_counter_add(ctx, "codegen.kernels", s->n_kernels);
	*state = cs;
	return EPJ_OK;
}

/* One fused kernel: pointers, strides, outputs, call. */
static epj_status run_kernel(epj_ctx *ctx, cstate *cs, const ej_kernel *k,
			     epj_tensor **env, char **ptr, int64_t *st)
{
	int r = k->rank;
	for (int i = 0; i < k->n_in; i++) {
		epj_tensor *t = env[k->in[i].value];
		EJ_ASSERT(t && t->ndim == k->in[i].ndim);
		ptr[i] = ej_data(t);
	}
	for (int a = 0; a < k->n_acc; a++) {
		const ej_kaccess *x = &k->acc[a];
		const epj_tensor *t = env[k->in[x->input].value];
		int64_t *sa = st + (size_t)a * (size_t)r;
		for (int d = 0; d < r; d++)
			sa[d] = 0;
		for (int d = 0; d < t->ndim; d++)
			if (x->map[d] >= 0)
				sa[x->map[d]] += t->stride[d];
	}
	for (int o = 0; o < k->n_out; o++) {
		const ej_value *v = &cs->s->g->values[k->out[o].value];
		epj_tensor *t =
		    ej_tensor_alloc(ctx, v->dtype, v->ndim, v->shape, false);
		if (!t)
			return ctx->status ? ctx->status
					   : ej_error(ctx, EPJ_ERR_NOMEM,
						      "kernel %d: cannot "
						      "allocate output %d",
						      k->id, o);
		env[k->out[o].value] = t;
		ptr[k->n_in + o] = ej_data(t);
	}
	cs->fn[k->id](ptr, st);
	return EPJ_OK;
}

/* A run's scratch: kernel pointers and strides, sized for the widest
 * kernel of the schedule. */
typedef struct crun {
	cstate *cs;
	char **ptr;
	int64_t *st;
} crun;

static epj_status c_kernel(epj_ctx *ctx, void *user, const ej_kernel *k,
			   epj_tensor **env)
{
	crun *r = user;
	return run_kernel(ctx, r->cs, k, env, r->ptr, r->st);
}

static epj_status crun_init(epj_ctx *ctx, cstate *cs, crun *r)
{
	r->cs = cs;
	r->ptr = calloc((size_t)cs->max_ptr + 1, sizeof *r->ptr);
	r->st = calloc((size_t)cs->max_st + 1, sizeof *r->st);
	if (r->ptr && r->st)
		return EPJ_OK;
	free(r->ptr);
	free(r->st);
	return ej_error(ctx, EPJ_ERR_NOMEM, "c backend: out of memory");
}

static void crun_free(crun *r)
{
	free(r->ptr);
	free(r->st);
}

static epj_status run(epj_ctx *ctx, void *state, ej_graph *g,
		      epj_tensor *const *inputs, epj_tensor **outs)
{
	cstate *cs = state;
	crun r;
	epj_status st = crun_init(ctx, cs, &r);
	if (st != EPJ_OK) {
		for (int i = 0; i < g->n_outputs; i++)
			outs[i] = NULL;
		return st;
	}
	st = ej_sched_run(ctx, cs->s, g, cs->last, inputs, outs, c_kernel, &r);
	crun_free(&r);
	return st;
}

const ej_schedule *ej_backend_c_schedule(const void *state)
{
	return ((const cstate *)state)->s;
}

epj_status ej_backend_c_run_kernel(epj_ctx *ctx, void *state, int kernel,
				   epj_tensor *const *in, epj_tensor **out)
{
	cstate *cs = state;
	crun r;
	epj_status st = crun_init(ctx, cs, &r);
	if (st == EPJ_OK)
		st = ej_sched_run_kernel(ctx, cs->s, kernel, in, out, c_kernel,
					 &r);
	crun_free(&r);
	return st;
}

static int kernels(const void *state)
{
	return ej_backend_c_schedule(state)->n_kernels;
}

static bool available(void)
{
	return true; /* the host compiler is checked where it runs */
}

/* exactly what build prints and looks up */
static const char *artifact(ej_arena *A, const struct ej_schedule *s,
			    const char *name, const char *arch, char key[65])
{
	(void)arch;
	const char *src = ej_print_c(A, s, name);
	ej_backend_c_key(src, key);
	return src;
}

static epj_status compile(epj_ctx *ctx, const char *src, const char *name,
			  const char *arch, void **art, size_t *len)
{
	(void)arch;
	char *log = NULL;
	epj_status st = ej_hostcc_compile(ctx, src, name, art, len, &log);
	free(log);
	return st;
}

const ej_codegen_backend ej_backend_c = {
	.name = "c",
	.kind = EJ_BACKEND_C,
	.available = available,
	.rope_fusion = true,
	.build = build,
	.run = run,
	.free_state = cstate_free,
	.kernels = kernels,
	.artifact = artifact,
	.compile = compile,
};
