/* warmup.c -- the artifacts of a jit's compiled graphs, for the offline
 * cache warm-up (epjit-warmup): list them (key, generated source) and
 * compile the ones the kernel cache lacks, in parallel worker processes.
 *
 *   plan:     every unique segment of the jit (its segment cache holds each
 *             graph once, whatever the depth of the model) -> forward and
 *             backward graph -> schedule -> the backend's artifact (its
 *             vtable: the source its build prints and the key it looks
 *             up, once or once per target arch); duplicate keys are
 *             dropped.
 *   compile:  keys already in the cache are skipped; the others are split
 *             round-robin over N forked workers, each with its own context
 *             and cache handle (the disk cache is safe across processes),
 *             compiling (the backend's compile) and putting its share.
 *             The parent then counts what is in the cache.
 */
#include "warmup.h"
#include "cc.h"
#include "jit_impl.h"
#include "kcache.h"
#include "kir.h"

#include <errno.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

void ej_warm_plan_free(ej_warm_plan *p)
{
	if (!p)
		return;
	for (int i = 0; i < p->n; i++)
		free(p->jobs[i].source);
	free(p->jobs);
	memset(p, 0, sizeof *p);
}

static epj_status plan_push(epj_ctx *ctx, ej_warm_plan *p, const char *key,
			    const char *src, const char *name, const char *arch,
			    const char *what)
{
	for (int i = 0; i < p->n; i++)
		if (!strcmp(p->jobs[i].key, key))
			return EPJ_OK; /* the same artifact twice */
	if (p->n == p->cap) {
		int nc = p->cap ? 2 * p->cap : 32;
		ej_warm_job *nj = realloc(p->jobs, sizeof *nj * (size_t)nc);
		if (!nj)
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"warm-up: out of memory");
		p->jobs = nj;
		p->cap = nc;
	}
	ej_warm_job *j = &p->jobs[p->n];
	memset(j, 0, sizeof *j);
	j->source = strdup(src);
	if (!j->source)
		return ej_error(ctx, EPJ_ERR_NOMEM, "warm-up: out of memory");
	memcpy(j->key, key, sizeof j->key);
	snprintf(j->name, sizeof j->name, "%s", name);
	snprintf(j->arch, sizeof j->arch, "%s", arch ? arch : "");
	snprintf(j->what, sizeof j->what, "%s", what);
	p->n++;
	return EPJ_OK;
}

static epj_status plan_graph(epj_ctx *ctx, ej_warm_plan *p,
			     const ej_codegen_backend *b, ej_graph *g,
			     char archs[][EJ_CUDA_ARCH_MAX], int n_archs,
			     const char *what)
{
	char name[48];
	ej_codegen_graph_name(g, name);
	p->n_graphs++;
	ej_arena *A = ej_arena_new();
	ej_schedule *s = ej_sched_build(A, g);
	epj_status st = EPJ_OK;
	if (s->n_kernels == 0) {
		ej_arena_free(A);
		return EPJ_OK; /* every node is an extern op: no artifact */
	}
	/* exactly what the backend's build prints and looks up: once, or
	 * once per target arch */
	for (int a = 0; st == EPJ_OK && a < (b->per_arch ? n_archs : 1); a++) {
		const char *arch = b->per_arch ? archs[a] : NULL;
		char key[EJ_KCACHE_KEY_LEN + 1];
		const char *src = b->artifact(A, s, name, arch, key);
		st = src ? plan_push(ctx, p, key, src, name, arch, what)
			 : ej_error(ctx, EPJ_ERR_NOMEM,
				    "warm-up: out of memory");
	}
	ej_arena_free(A);
	return st;
}

epj_status ej_warm_plan_build(epj_ctx *ctx, ej_jit *jit, ej_backend_kind kind,
			      const char *arch_list, ej_warm_plan *out)
{
	memset(out, 0, sizeof *out);
	const ej_codegen_backend *b = ej_backend_get(kind);
	if (!b->artifact)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"warm-up: the %s backend builds no cached "
				"artifacts",
				b->name);
	out->backend = kind;
	char archs[8][EJ_CUDA_ARCH_MAX];
	int n_archs = 0;
	if (b->per_arch) {
		n_archs = ej_cuda_archs_parse(
		    ctx, "--arch", arch_list ? arch_list : EJ_CUDA_ARCH_DEFAULT,
		    archs, 8);
		if (n_archs < 1)
			return ctx->status;
	}
	epj_status st = EPJ_OK;
	for (int i = 0; st == EPJ_OK && i < jit->cache_cap; i++) {
		ej_segment *s = jit->cache[i];
		if (!s)
			continue;
		out->n_segments++;
		st = plan_graph(ctx, out, b, s->fwd, archs, n_archs, "forward");
		if (st == EPJ_OK && s->bwd)
			st = plan_graph(ctx, out, b, s->bwd, archs, n_archs,
					"backward");
	}
	if (st != EPJ_OK)
		ej_warm_plan_free(out);
	return st;
}

/* Whether key is in the cache (a verified hit). */
static bool cached(ej_kcache *kc, const char *key)
{
	void *d = NULL;
	size_t n = 0;
	epj_status st = ej_kcache_get(kc, key, &d, &n);
	free(d);
	return st == EPJ_OK && d != NULL;
}

/* Compiles one job of plan p and stores it. */
static epj_status compile_job(epj_ctx *ctx, ej_kcache *kc,
			      const ej_warm_plan *p, const ej_warm_job *j)
{
	void *art = NULL;
	size_t len = 0;
	epj_status st = ej_backend_get(p->backend)
			    ->compile(ctx, j->source, j->name,
				      j->arch[0] ? j->arch : NULL, &art, &len);
	if (st == EPJ_OK)
		st = ej_kcache_put(kc, j->key, art, len, j->source);
	free(art);
	return st;
}

/* A worker: jobs w, w + n, ... of the missing ones.  Exit status 0 when
 * all of them were compiled and stored. */
static int worker(const char *dir, const ej_warm_plan *p, const int *todo,
		  int n_todo, int w, int n)
{
	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK)
		return 1;
	ej_kcache *kc = ej_kcache_open(ctx, dir);
	int rc = kc ? 0 : 1;
	if (!kc)
		fprintf(stderr, "epjit-warmup: %s\n", epj_ctx_error(ctx));
	for (int i = w; kc && i < n_todo; i += n) {
		const ej_warm_job *j = &p->jobs[todo[i]];
		if (compile_job(ctx, kc, p, j) != EPJ_OK) {
			fprintf(stderr, "epjit-warmup: %s %s%s%s: %s\n",
				j->name, j->what, j->arch[0] ? " " : "",
				j->arch, epj_ctx_error(ctx));
			epj_ctx_clear_error(ctx);
			rc = 1;
		}
	}
	ej_kcache_close(kc);
	epj_ctx_free(ctx);
	return rc;
}

epj_status ej_warm_plan_compile(epj_ctx *ctx, ej_warm_plan *p, const char *dir,
				int n_workers)
{
	ej_kcache *kc = ej_kcache_open(ctx, dir);
	if (!kc)
		return ctx->status;
	int *todo = malloc(sizeof *todo * (size_t)(p->n + 1));
	if (!todo) {
		ej_kcache_close(kc);
		return ej_error(ctx, EPJ_ERR_NOMEM, "warm-up: out of memory");
	}
	int n_todo = 0;
	p->n_cached = p->n_compiled = p->n_failed = 0;
	for (int i = 0; i < p->n; i++) {
		p->jobs[i].was_cached = cached(kc, p->jobs[i].key);
		if (p->jobs[i].was_cached)
			p->n_cached++;
		else
			todo[n_todo++] = i;
	}
	if (n_workers < 1)
		n_workers = 1;
	if (n_workers > n_todo)
		n_workers = n_todo;
	pid_t pids[256];
	if (n_workers > (int)EJ_ARRAY_LEN(pids))
		n_workers = (int)EJ_ARRAY_LEN(pids);
	int started = 0;
	fflush(NULL);
	for (int w = 0; w < n_workers; w++) {
		pid_t pid = fork();
		if (pid == 0)
			_exit(worker(ej_kcache_dir(kc), p, todo, n_todo, w,
				     n_workers));
		if (pid < 0) {
			epj_log_msg(EPJ_LOG_WARN,
				    "warm-up: fork failed (%s); compiling the "
				    "rest here",
				    strerror(errno));
			break;
		}
		pids[started++] = pid;
	}
	/* when no worker could start, this process compiles everything */
	if (started == 0 && n_todo > 0 &&
	    worker(ej_kcache_dir(kc), p, todo, n_todo, 0, 1) != 0)
		epj_log_msg(EPJ_LOG_WARN, "warm-up: some compiles failed");
	for (int w = 0; w < started; w++) {
		int status = 0;
		while (waitpid(pids[w], &status, 0) < 0 && errno == EINTR)
			;
	}
	/* a worker that could not start leaves its share undone: count what
	 * the cache holds now (a fresh handle: the memory table of kc does
	 * not know what the workers stored) */
	ej_kcache_close(kc);
	kc = ej_kcache_open(ctx, dir);
	for (int i = 0; kc && i < n_todo; i++) {
		ej_warm_job *j = &p->jobs[todo[i]];
		j->compiled = cached(kc, j->key);
		if (j->compiled)
			p->n_compiled++;
		else
			p->n_failed++;
	}
	ej_kcache_close(kc);
	free(todo);
	if (p->n_failed > 0)
		return ej_error(ctx, EPJ_ERR_COMPILE,
				"warm-up: %d of %d artifact%s could not be "
				"compiled (see the messages above)",
				p->n_failed, p->n, p->n == 1 ? "" : "s");
	return EPJ_OK;
}
