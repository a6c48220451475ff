/* backend_sim.c -- the cuda-sim backend: compiled graphs run the CUDA C the
 * cuda device would load, compiled by the host C++ compiler and executed by
 * the simulator (templates/cuda_sim.cuh) on the cuda-sim device.
 *
 *   build(g):  schedule (sched.c, the same as the C backend's)
 *              -> CUDA C (print_cuda.c: prelude + kernels, the exact unit
 *                 NVRTC gets)
 *              -> module source: simulator header + that unit + one launch
 *                 entry per kernel (EJ_SIM_ENTRY)
 *              -> kernel cache (key: the hash of the full module source, the
 *                 C++ compiler identity and the extra flags); miss: compile
 *                 with $EPJIT_CXX (hostcc.c, C++ mode), store
 *              -> load on ej_device_sim, look up ej_sim_epjk_<i>
 *   run(g):    as the C backend: steps in schedule order; a fused kernel
 *              gets fresh contiguous outputs and is launched through the
 *              shared host launch code (launch_cuda.c: geometry, argument
 *              packing); extern nodes (GEMM, attention, indexing, ...) run
 *              through ej_dispatch, i.e. the CPU reference kernels on the
 *              same host buffers.
 *
 * Modules get -fsanitize=address when this library is built with ASan
 * (or EPJIT_SIM_ASAN=1; =0 turns it off), so the simulator's global and
 * dynamic shared memory accesses are bounds-checked.
 */
#include "cc.h"
#include "kcache.h"
#include "kir.h"

#include "templates/cuda_sim_text.h"

#include <stdio.h>

#if defined(__SANITIZE_ADDRESS__)
#define LIB_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LIB_ASAN 1
#endif
#endif
#ifndef LIB_ASAN
#define LIB_ASAN 0
#endif

bool ej_sim_asan(void)
{
	const char *v = getenv("EPJIT_SIM_ASAN");
	if (v && *v)
		return strcmp(v, "0") != 0;
	return LIB_ASAN;
}

static const char *sim_flags(void)
{
	return ej_sim_asan() ? "-fsanitize=address -fno-omit-frame-pointer"
			     : "";
}

epj_status ej_sim_build_module(epj_ctx *ctx, const char *cuda_src,
			       const char *const *kernel,
			       const char *const *arg_type, int n,
			       const char *name, void **module)
{
	*module = NULL;
	ej_sbuf b = { 0 };
	ej_sb_puts(&b, ej_cuda_sim_text);
	ej_sb_puts(&b, cuda_src);
	ej_sb_puts(&b, "\n/* ---- cuda-sim launch entries ---- */\n");
	for (int i = 0; i < n; i++)
		ej_sb_printf(&b, "EJ_SIM_ENTRY(%s, %s)\n", kernel[i],
			     arg_type[i]);
	ej_arena *A = ej_arena_new();
	const char *src = ej_sb_finish(&b, A);
	if (!src) {
		ej_arena_free(A);
		return ej_error(ctx, EPJ_ERR_NOMEM, "cuda-sim: out of memory");
	}
	const char *flags = sim_flags();
	char key[EJ_KCACHE_KEY_LEN + 1];
	ej_artifact_key(key, "cuda-sim", ej_hostcxx_identity(), flags, "", src);

	ej_kcache *kc = ej_kcache_open_for_run(ctx, NULL);
	if (!kc) {
		if (epj_ctx_status(ctx) != EPJ_ERR_IO) {
			ej_error_prefix(ctx, "cuda-sim: kernel cache");
			ej_arena_free(A);
			return epj_ctx_status(ctx);
		}
		epj_log_msg(EPJ_LOG_WARN,
			    "cuda-sim: compiling without a kernel cache: %s",
			    epj_ctx_error(ctx));
		epj_ctx_clear_error(ctx);
	}
	void *so = NULL;
	size_t so_len = 0;
	int lock = -1;
	epj_status st =
	    kc ? ej_kcache_get_module(kc, ctx, key, &ej_device_sim, name,
				      module, &so, &so_len, &lock)
	       : EPJ_OK;
	if (st == EPJ_OK && !so) {
		char *log = NULL;
		st = ej_hostcxx_compile(ctx, src, name, flags, &so, &so_len,
					&log);
		if (st == EPJ_OK && log && *log)
			epj_log_msg(EPJ_LOG_INFO, "cuda-sim: %s: c++ said: %s",
				    name, log);
		free(log);
		if (st == EPJ_OK) {
			st = ej_device_sim.load(ej_device_sim.self, ctx, so,
						so_len, name, module);
			if (st != EPJ_OK)
				ej_error_prefix(ctx, "cuda-sim: the module "
						     "just compiled does not "
						     "load");
		}
		/* into the cache only what loaded */
		if (st == EPJ_OK && kc)
			st = ej_kcache_put(kc, key, so, so_len, src);
	}
	if (kc)
		ej_kcache_unlock(kc, lock);
	ej_kcache_close(kc);
	ej_arena_free(A);
	free(so);
	return st;
}

typedef struct sstate {
	ej_arena *A;
	ej_schedule *s;
	void *module;
	void **fn; /* per kernel: launch entry */
	int *last;
	size_t max_args;
	int max_in, max_out;
} sstate;

static void sstate_free(void *p)
{
	sstate *ss = p;
	if (!ss)
		return;
	ej_device_sim.unload(ej_device_sim.self, ss->module);
	free(ss->fn);
	free(ss->last);
	ej_arena_free(ss->A);
	free(ss);
}

static epj_status load_kernels(epj_ctx *ctx, sstate *ss, const char *name)
{
	const ej_schedule *s = ss->s;
	const char *cuda = ej_print_cuda(ss->A, s, name);
	const char **kn =
	    ej_arena_alloc(ss->A, sizeof(char *) * (size_t)(s->n_kernels + 1));
	const char **ty =
	    ej_arena_alloc(ss->A, sizeof(char *) * (size_t)(s->n_kernels + 1));
	for (int i = 0; i < s->n_kernels; i++) {
		kn[i] = ej_arena_printf(ss->A, "epjk_%d", i);
		ty[i] = ej_arena_printf(ss->A, "struct ej_kargs_%d", i);
	}
	epj_status st = ej_sim_build_module(ctx, cuda, kn, ty, s->n_kernels,
					    name, &ss->module);
	if (st != EPJ_OK)
		return st;
	ss->fn = calloc((size_t)s->n_kernels + 1, sizeof *ss->fn);
	if (!ss->fn)
		return ej_error(ctx, EPJ_ERR_NOMEM, "cuda-sim: out of memory");
	for (int i = 0; i < s->n_kernels; i++) {
		ss->fn[i] = ej_device_sim.function(ej_device_sim.self,
						   ss->module, kn[i]);
		if (!ss->fn[i])
			return ej_error(ctx, EPJ_ERR_BACKEND,
					"cuda-sim: %s: entry of %s missing "
					"from the module",
					name, kn[i]);
	}
	return EPJ_OK;
}

static epj_status build(epj_ctx *ctx, ej_jit *jit, ej_graph *g, void **state)
{
	(void)jit;
	*state = NULL;
	sstate *ss = calloc(1, sizeof *ss);
	if (!ss)
		return ej_error(ctx, EPJ_ERR_NOMEM, "cuda-sim: out of memory");
	ss->A = ej_arena_new();
	ss->s = ej_sched_build(ss->A, g);
	ej_schedule *s = ss->s;
	char name[48];
	ej_codegen_graph_name(g, name);
	ss->last = ej_last_use(g, s->n_steps, ej_sched_step_read, s);
	if (!ss->last) {
		sstate_free(ss);
		return ej_error(ctx, EPJ_ERR_NOMEM, "cuda-sim: out of memory");
	}
	ej_cuda_sched_maxima(s, &ss->max_args, &ss->max_in, &ss->max_out);
	epj_status st = EPJ_OK;
	if (s->n_kernels > 0)
		st = load_kernels(ctx, ss, name);
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "cuda-sim backend (%s)", name);
		sstate_free(ss);
		return st;
	}
	epj_counter_add(ctx, "codegen.kernels", s->n_kernels);
	*state = ss;
	return EPJ_OK;
}

/* One fused kernel: fresh outputs bound in env, launch on cuda-sim. */
static epj_status run_kernel(epj_ctx *ctx, sstate *ss, const ej_kernel *k,
			     epj_tensor **env)
{
	epj_tensor *in[ss->max_in + 1], *out[ss->max_out + 1];
	ej_launch_out lo[ss->max_out + 1];
	_Alignas(16) unsigned char args[ss->max_args + 16];
	for (int i = 0; i < k->n_in; i++)
		in[i] = env[k->in[i].value];
	for (int o = 0; o < k->n_out; o++) {
		const ej_value *v = &ss->s->g->values[k->out[o].value];
		out[o] =
		    ej_tensor_alloc(ctx, v->dtype, v->ndim, v->shape, false);
		if (!out[o])
			return ctx->status ? ctx->status
					   : ej_error(ctx, EPJ_ERR_NOMEM,
						      "kernel %d: cannot "
						      "allocate output %d",
						      k->id, o);
		env[k->out[o].value] = out[o];
	}
	ej_launch l;
	ej_cuda_launch_prepare(k, in, out, args, lo, &l);
	char kname[32];
	snprintf(kname, sizeof kname, "epjk_%d", k->id);
	return ej_device_sim.launch(ej_device_sim.self, ctx, ss->fn[k->id],
				    kname, &l);
}

static epj_status sim_kernel(epj_ctx *ctx, void *user, const ej_kernel *k,
			     epj_tensor **env)
{
	return run_kernel(ctx, user, k, env);
}

static epj_status run(epj_ctx *ctx, void *state, ej_graph *g,
		      epj_tensor *const *inputs, epj_tensor **outs)
{
	sstate *ss = state;
	return ej_sched_run(ctx, ss->s, g, ss->last, inputs, outs, sim_kernel,
			    ss);
}

const ej_schedule *ej_backend_sim_schedule(const void *state)
{
	return ((const sstate *)state)->s;
}

epj_status ej_backend_sim_run_kernel(epj_ctx *ctx, void *state, int kernel,
				     epj_tensor *const *in, epj_tensor **out)
{
	sstate *ss = state;
	return ej_sched_run_kernel(ctx, ss->s, kernel, in, out, sim_kernel, ss);
}

static int kernels(const void *state)
{
	return ej_backend_sim_schedule(state)->n_kernels;
}

static bool available(void)
{
	return true; /* the host C++ compiler is checked where it runs */
}

const ej_codegen_backend ej_backend_sim = {
	.name = "cuda-sim",
	.kind = EJ_BACKEND_CUDA_SIM,
	.available = available,
	.build = build,
	.run = run,
	.free_state = sstate_free,
	.kernels = kernels,
};
