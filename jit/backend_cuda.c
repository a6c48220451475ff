/* backend_cuda.c -- the nvrtc backend: compiled graphs run the CUDA C of
 * print_cuda.c on the cuda device (lib/device_cuda.c), compiled by NVRTC for
 * the device's own arch.
 *
 *   build(g):  schedule (sched.c, as the C and cuda-sim backends)
 *              -> CUDA C (print_cuda.c), the exact unit cuda-sim runs
 *              -> kernel cache (ej_artifact_key: the source, NVRTC's
 *                 identity, the options, the arch); miss: NVRTC, store the
 *                 cubin (PTX for an arch newer than NVRTC knows)
 *              -> cuModuleLoadData on the device, cuModuleGetFunction
 *   run(g):    steps in schedule order.  On a "cuda" context the tensors
 *              are device memory: a fused kernel reads its inputs in place
 *              and writes fresh device tensors of the context; extern
 *              nodes (GEMM, attention, indexing) run through ej_dispatch as
 *              the context's eager CUDA kernels.  On a cpu context tensors
 *              live on the host: a fused kernel's inputs are copied to
 *              device buffers (the byte span each view covers, so strided
 *              views keep their strides), its outputs computed on the
 *              device and copied back into fresh host tensors (counted in
 *              nvrtc.host_roundtrips); extern nodes run on the CPU.  The
 *              launch is the host launch code cuda-sim shares
 *              (launch_cuda.c), with device pointers.
 *
 * CUDA graphs: a graph of fused kernels only is captured once (its
 * launches, into buffers that stay allocated with the state) and replayed
 * on every later run (cudagraph.captures, cudagraph.replays); inputs are
 * copied into the captured buffers first and outputs out of them after
 * (device to device on a cuda context, to and from the host otherwise).
 * EPJIT_CUDA_GRAPHS=0 turns this off.
 *
 * Memory: device buffers come from one caching allocator over the device
 * (the same bookkeeping as the host allocator, alloc.c), kept for the
 * process; ej_backend_cuda_memory_stats reads it.
 */
#include "cc.h"
#include "cuda_driver.h"
#include "kcache.h"
#include "kir.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static pthread_mutex_t alloc_lock = PTHREAD_MUTEX_INITIALIZER;
static ej_allocator *dev_alloc; /* over the process's cuda device */

/* The device and its allocator (opened at the first build). */
static epj_status device_get(epj_ctx *ctx, ej_cuda_dev **dev)
{
	epj_status st = ej_cuda_open(ctx, dev);
	if (st != EPJ_OK)
		return st;
	pthread_mutex_lock(&alloc_lock);
	if (!dev_alloc)
		dev_alloc = ej_allocator_new(ej_cuda_device(*dev));
	pthread_mutex_unlock(&alloc_lock);
	if (!dev_alloc)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"nvrtc backend: out of "
				"memory");
	return EPJ_OK;
}

/* Test hook, deliberately in no header: forget the device allocator (with
 * ej_cuda_test_reset; leaked). */
void ej_backend_cuda_test_reset(void);
void ej_backend_cuda_test_reset(void)
{
	pthread_mutex_lock(&alloc_lock);
	dev_alloc = NULL;
	pthread_mutex_unlock(&alloc_lock);
}

void ej_backend_cuda_memory_stats(epj_memory_stats *out)
{
	memset(out, 0, sizeof *out);
	pthread_mutex_lock(&alloc_lock);
	if (dev_alloc)
		ej_allocator_stats(dev_alloc, out);
	pthread_mutex_unlock(&alloc_lock);
}

/* A captured graph: the executable and the device buffers its launches
 * read and write (per graph value; NULL for values it never touches). */
typedef struct capture {
	void *exec;
	void **buf;
	size_t *bytes; /* per value: contiguous bytes */
} capture;

typedef struct cstate {
	struct cstate *next_live; /* the list of built states (tests) */
	ej_arena *A;
	ej_schedule *s;
	ej_cuda_dev *dev;
	const ej_device *vt;
	void *module;
	void **fn;	/* per kernel */
	unsigned *gcap; /* per kernel: its grid cap (occupancy), 0 none */
	int *last;
	size_t max_args;
	int max_in, max_out;
	const char *source; /* the CUDA C unit (arena) */
	char target[16];
	bool fused_only;
	capture *cap; /* NULL until captured */
} cstate;

static void capture_free(cstate *cs)
{
	capture *c = cs->cap;
	if (!c)
		return;
	ej_cuda_graph_free(cs->dev, c->exec);
	for (int v = 0; v < cs->s->g->n_values; v++)
		if (c->buf[v])
			ej_dealloc(dev_alloc, c->buf[v]);
	free(c->buf);
	free(c->bytes);
	free(c);
	cs->cap = NULL;
}

/* Built states with a module, for the tests' fake driver to find the CUDA
 * C of a module it is asked to run (ej_backend_cuda_test_source). */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static cstate *live;

static void live_add(cstate *cs)
{
	pthread_mutex_lock(&live_lock);
	cs->next_live = live;
	live = cs;
	pthread_mutex_unlock(&live_lock);
}

static void live_remove(cstate *cs)
{
	pthread_mutex_lock(&live_lock);
	for (cstate **p = &live; *p; p = &(*p)->next_live)
		if (*p == cs) {
			*p = cs->next_live;
			break;
		}
	pthread_mutex_unlock(&live_lock);
}

/* Test hook, deliberately in no header: the state whose module is `module`
 * (a driver module handle), or NULL. */
const void *ej_backend_cuda_test_state(const void *module);
const void *ej_backend_cuda_test_state(const void *module)
{
	pthread_mutex_lock(&live_lock);
	cstate *cs = live;
	while (cs && cs->module != module)
		cs = cs->next_live;
	pthread_mutex_unlock(&live_lock);
	return cs;
}

static void cstate_free(void *p)
{
	cstate *cs = p;
	if (!cs)
		return;
	live_remove(cs);
	capture_free(cs);
	if (cs->vt)
		cs->vt->unload(cs->vt->self, cs->module);
	free(cs->fn);
	free(cs->gcap);
	free(cs->last);
	ej_arena_free(cs->A);
	free(cs);
}

static epj_status load_kernels(epj_ctx *ctx, ej_jit *jit, cstate *cs,
			       const char *name)
{
	const ej_schedule *s = cs->s;
	cs->source = ej_print_cuda(cs->A, s, name);
	ej_cuda_dev_info info;
	ej_cuda_info(cs->dev, &info);
	snprintf(cs->target, sizeof cs->target, "%s", info.arch);
	ej_kcache *kc = NULL;
	bool own = false;
	epj_status st0 = ej_jit_kcache(ctx, jit, "nvrtc backend", &kc, &own);
	if (st0 != EPJ_OK)
		return st0;
	epj_status st =
	    ej_nvrtc_build_module(ctx, kc, cs->source, name, cs->target, cs->vt,
				  "nvrtc backend", &cs->module);
	if (own)
		ej_kcache_close(kc);
	if (st != EPJ_OK)
		return st;
	cs->fn = calloc((size_t)s->n_kernels + 1, sizeof *cs->fn);
	cs->gcap = calloc((size_t)s->n_kernels + 1, sizeof *cs->gcap);
	if (!cs->fn || !cs->gcap)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"nvrtc backend: out of memory");
	for (int i = 0; i < s->n_kernels; i++) {
		char kn[32];
		snprintf(kn, sizeof kn, "epjk_%d", i);
		cs->fn[i] = cs->vt->function(cs->vt->self, cs->module, kn);
		if (!cs->fn[i])
			return ej_error(ctx, EPJ_ERR_BACKEND,
					"nvrtc backend: %s: kernel %s missing "
					"from the module",
					name, kn);
		/* every generated kernel loops over its units with a grid
		 * stride (jit/print_cuda.c): one wave of resident blocks is
		 * enough, and more only adds block scheduling */
		unsigned grid[3], block[3];
		ej_cuda_launch_dims(s->kernels[i], grid, block);
		cs->gcap[i] = ej_cuda_grid_cap(cs->dev, cs->fn[i], block[0], 0);
	}
	return EPJ_OK;
}

static epj_status build(epj_ctx *ctx, ej_jit *jit, ej_graph *g, void **state)
{
	*state = NULL;
	cstate *cs = calloc(1, sizeof *cs);
	if (!cs)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"nvrtc backend: out of memory");
	cs->A = ej_arena_new();
	cs->s = ej_sched_build(cs->A, g);
	ej_schedule *s = cs->s;
	char name[48];
	ej_codegen_graph_name(g, name);
	cs->last = ej_last_use(g, s->n_steps, ej_sched_step_read, s);
	epj_status st = cs->last ? EPJ_OK
				 : ej_error(ctx, EPJ_ERR_NOMEM,
					    "nvrtc backend: out of memory");
	cs->fused_only = s->n_kernels > 0;
	for (int i = 0; i < s->n_steps; i++)
		cs->fused_only &= s->steps[i].k != NULL;
	ej_cuda_sched_maxima(s, &cs->max_args, &cs->max_in, &cs->max_out);
	if (st == EPJ_OK && s->n_kernels > 0) {
		st = device_get(ctx, &cs->dev);
		if (st == EPJ_OK) {
			cs->vt = ej_cuda_device(cs->dev);
			st = load_kernels(ctx, jit, cs, name);
		}
	}
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "nvrtc backend (%s)", name);
		cstate_free(cs);
		return st;
	}
	epj_counter_add(ctx, "codegen.kernels", s->n_kernels);
	if (cs->module)
		live_add(cs);
	*state = cs;
	return EPJ_OK;
}

/* Bytes from element 0 of t to its last element (strides >= 0). */
static size_t span_bytes(const epj_tensor *t)
{
	int64_t last = 0;
	for (int d = 0; d < t->ndim; d++) {
		if (t->shape[d] == 0)
			return 0;
		EJ_ASSERT(t->stride[d] >= 0);
		last += (t->shape[d] - 1) * t->stride[d];
	}
	return (size_t)(last + 1) * ej_dtype_size(t->dtype);
}

/* A view of t whose data is the device buffer `dev` (same shape and
 * strides; element 0 at dev).  Only for the launch code: never
 * refcounted, never freed. */
typedef struct dev_view {
	epj_tensor t;
	ej_storage st;
} dev_view;

static void dev_view_of(dev_view *v, const epj_tensor *t, void *dev,
			size_t bytes)
{
	v->t = *t;
	v->st = (ej_storage){ .refcount = 1, .data = dev, .bytes = bytes };
	v->t.storage = &v->st;
	v->t.offset = 0;
}

static epj_status dev_alloc_or_fail(epj_ctx *ctx, cstate *cs, size_t bytes,
				    void **p)
{
	*p = ej_alloc(dev_alloc, bytes ? bytes : 1);
	if (!*p)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"nvrtc backend: cannot allocate %zu bytes on "
				"the GPU (%s)",
				bytes, ej_cuda_last_error(cs->dev));
	return EPJ_OK;
}

static epj_status launch_one(epj_ctx *ctx, cstate *cs, const ej_kernel *k,
			     epj_tensor **in, epj_tensor **out)
{
	ej_launch_out lo[cs->max_out + 1];
	_Alignas(16) unsigned char args[cs->max_args + 16];
	ej_launch l;
	ej_cuda_launch_prepare(k, in, out, args, lo, &l);
	if (cs->gcap[k->id] && l.grid[0] > cs->gcap[k->id]) {
		l.grid[0] = cs->gcap[k->id];
		epj_counter_add(ctx, "nvrtc.grid_capped", 1);
	}
	char kname[32];
	snprintf(kname, sizeof kname, "epjk_%d", k->id);
	return cs->vt->launch(cs->vt->self, ctx, cs->fn[k->id], kname, &l);
}

/* One fused kernel on a cuda context: its tensors are device memory
 * already, so the kernel reads the inputs in place (any strides) and writes
 * fresh device tensors of the context bound in env. */
static epj_status run_kernel_resident(epj_ctx *ctx, cstate *cs,
				      const ej_kernel *k, epj_tensor **env)
{
	epj_tensor *in[cs->max_in + 1], *out[cs->max_out + 1];
	for (int i = 0; i < k->n_in; i++)
		in[i] = env[k->in[i].value];
	for (int o = 0; o < k->n_out; o++) {
		const ej_value *v = &cs->s->g->values[k->out[o].value];
		out[o] =
		    ej_tensor_alloc(ctx, v->dtype, v->ndim, v->shape, false);
		if (!out[o])
			return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
		env[k->out[o].value] = out[o];
	}
	epj_status st = launch_one(ctx, cs, k, in, out);
	if (st == EPJ_OK && *ej_cuda_last_error(cs->dev))
		st = ej_error(ctx, EPJ_ERR_BACKEND, "%s",
			      ej_cuda_last_error(cs->dev));
	return st;
}

/* One fused kernel on host tensors (a cpu context): inputs copied in,
 * outputs copied out into fresh host tensors bound in env. */
static epj_status run_kernel(epj_ctx *ctx, cstate *cs, const ej_kernel *k,
			     epj_tensor **env)
{
	if (ctx->dev == cs->vt)
		return run_kernel_resident(ctx, cs, k, env);
	epj_counter_add(ctx, "nvrtc.host_roundtrips", 1);
	dev_view vin[cs->max_in + 1], vout[cs->max_out + 1];
	epj_tensor *in[cs->max_in + 1], *out[cs->max_out + 1];
	void *din[cs->max_in + 1], *dout[cs->max_out + 1];
	size_t nout[cs->max_out + 1];
	int n_din = 0, n_dout = 0;
	epj_status st = EPJ_OK;
	for (int i = 0; i < k->n_in && st == EPJ_OK; i++) {
		const epj_tensor *h = env[k->in[i].value];
		size_t n = span_bytes(h);
		st = dev_alloc_or_fail(ctx, cs, n, &din[i]);
		if (st != EPJ_OK)
			break;
		n_din++;
		cs->vt->copy(cs->vt->self, din[i], ej_data(h), n);
		dev_view_of(&vin[i], h, din[i], n);
		in[i] = &vin[i].t;
	}
	for (int o = 0; o < k->n_out && st == EPJ_OK; o++) {
		const ej_value *v = &cs->s->g->values[k->out[o].value];
		epj_tensor *h =
		    ej_tensor_alloc(ctx, v->dtype, v->ndim, v->shape, false);
		if (!h) {
			st = ctx->status ? ctx->status : EPJ_ERR_NOMEM;
			break;
		}
		env[k->out[o].value] = h;
		nout[o] = span_bytes(h);
		st = dev_alloc_or_fail(ctx, cs, nout[o], &dout[o]);
		if (st != EPJ_OK)
			break;
		n_dout++;
		dev_view_of(&vout[o], h, dout[o], nout[o]);
		out[o] = &vout[o].t;
	}
	if (st == EPJ_OK)
		st = launch_one(ctx, cs, k, in, out);
	for (int o = 0; st == EPJ_OK && o < k->n_out; o++)
		cs->vt->copy(cs->vt->self, ej_data(env[k->out[o].value]),
			     dout[o], nout[o]);
	if (st == EPJ_OK && *ej_cuda_last_error(cs->dev))
		st = ej_error(ctx, EPJ_ERR_BACKEND, "%s",
			      ej_cuda_last_error(cs->dev));
	for (int i = 0; i < n_din; i++)
		ej_dealloc(dev_alloc, din[i]);
	for (int o = 0; o < n_dout; o++)
		ej_dealloc(dev_alloc, dout[o]);
	return st;
}

static epj_status cuda_kernel(epj_ctx *ctx, void *user, const ej_kernel *k,
			      epj_tensor **env)
{
	return run_kernel(ctx, user, k, env);
}

static bool graphs_on(void)
{
	const char *v = getenv("EPJIT_CUDA_GRAPHS");
	return !v || strcmp(v, "0") != 0;
}

/* Device buffer of value v in the capture (contiguous layout). */
static epj_status cap_buf(epj_ctx *ctx, cstate *cs, int v)
{
	capture *c = cs->cap;
	if (c->buf[v])
		return EPJ_OK;
	const ej_value *x = &cs->s->g->values[v];
	size_t n =
	    (size_t)ej_numel(x->ndim, x->shape) * ej_dtype_size(x->dtype);
	c->bytes[v] = n;
	return dev_alloc_or_fail(ctx, cs, n, &c->buf[v]);
}

/* A contiguous device view of value v's capture buffer. */
static epj_tensor *cap_view(cstate *cs, int v, dev_view *dv)
{
	const ej_value *x = &cs->s->g->values[v];
	epj_tensor t = { .dtype = x->dtype, .ndim = x->ndim };
	memcpy(t.shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
	int64_t st = 1;
	for (int d = x->ndim - 1; d >= 0; d--) {
		t.stride[d] = st;
		st *= x->shape[d];
	}
	dev_view_of(dv, &t, cs->cap->buf[v], cs->cap->bytes[v]);
	return &dv->t;
}

/* Captures the launch sequence of a fused-only graph into buffers of its
 * own (first run). */
static epj_status capture_graph(epj_ctx *ctx, cstate *cs)
{
	const ej_schedule *s = cs->s;
	const ej_graph *g = s->g;
	capture *c = calloc(1, sizeof *c);
	if (!c)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"nvrtc backend: out of "
				"memory");
	cs->cap = c;
	c->buf = calloc((size_t)g->n_values + 1, sizeof *c->buf);
	c->bytes = calloc((size_t)g->n_values + 1, sizeof *c->bytes);
	if (!c->buf || !c->bytes)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"nvrtc backend: out of "
				"memory");
	epj_status st = EPJ_OK;
	for (int i = 0; i < s->n_kernels && st == EPJ_OK; i++) {
		const ej_kernel *k = s->kernels[i];
		for (int j = 0; j < k->n_in && st == EPJ_OK; j++)
			st = cap_buf(ctx, cs, k->in[j].value);
		for (int o = 0; o < k->n_out && st == EPJ_OK; o++)
			st = cap_buf(ctx, cs, k->out[o].value);
	}
	if (st != EPJ_OK)
		return st;
	st = ej_cuda_capture_begin(ctx, cs->dev);
	for (int i = 0; i < s->n_steps && st == EPJ_OK; i++) {
		const ej_kernel *k = s->steps[i].k;
		dev_view vin[cs->max_in + 1], vout[cs->max_out + 1];
		epj_tensor *in[cs->max_in + 1], *out[cs->max_out + 1];
		for (int j = 0; j < k->n_in; j++)
			in[j] = cap_view(cs, k->in[j].value, &vin[j]);
		for (int o = 0; o < k->n_out; o++)
			out[o] = cap_view(cs, k->out[o].value, &vout[o]);
		st = launch_one(ctx, cs, k, in, out);
	}
	void *exec = NULL;
	epj_status st2 = ej_cuda_capture_end(ctx, cs->dev, &exec);
	if (st == EPJ_OK)
		st = st2;
	else if (exec)
		ej_cuda_graph_free(cs->dev, exec);
	if (st == EPJ_OK) {
		c->exec = exec;
		epj_counter_add(ctx, "cudagraph.captures", 1);
	}
	return st;
}

/* A fused-only graph through its captured launches. */
static epj_status run_graph(epj_ctx *ctx, cstate *cs, epj_tensor *const *inputs,
			    epj_tensor **outs)
{
	const ej_schedule *s = cs->s;
	const ej_graph *g = s->g;
	epj_status st = cs->cap ? EPJ_OK : capture_graph(ctx, cs);
	if (st != EPJ_OK) {
		capture_free(cs);
		return st;
	}
	capture *c = cs->cap;
	for (int i = 0; i < g->n_inputs; i++) {
		int v = g->inputs[i].value;
		if (!c->buf[v])
			continue; /* read by no kernel */
		epj_tensor *h = epj_contiguous(ctx, inputs[i]);
		if (!h)
			return ctx->status;
		if (ctx->dev != cs->vt)
			epj_counter_add(ctx, "nvrtc.host_roundtrips", 1);
		cs->vt->copy(cs->vt->self, c->buf[v], ej_data(h), c->bytes[v]);
		epj_counter_add(ctx, "cudagraph.copy_bytes",
				(int64_t)c->bytes[v]);
		epj_tensor_free(h);
	}
	st = ej_cuda_graph_launch(ctx, cs->dev, c->exec);
	int64_t n_launch = s->n_kernels;
	for (int i = 0; i < g->n_outputs && st == EPJ_OK; i++) {
		int v = g->outputs[i];
		const ej_value *x = &g->values[v];
		if (!c->buf[v]) {
			/* an output no kernel wrote: a graph input passed
			 * through */
			for (int j = 0; j < g->n_inputs; j++)
				if (g->inputs[j].value == v)
					outs[i] = epj_tensor_ref(inputs[j]);
			continue;
		}
		outs[i] =
		    ej_tensor_alloc(ctx, x->dtype, x->ndim, x->shape, false);
		if (!outs[i]) {
			st = ctx->status ? ctx->status : EPJ_ERR_NOMEM;
			break;
		}
		cs->vt->copy(cs->vt->self, ej_data(outs[i]), c->buf[v],
			     c->bytes[v]);
		epj_counter_add(ctx, "cudagraph.copy_bytes",
				(int64_t)c->bytes[v]);
	}
	if (st == EPJ_OK && *ej_cuda_last_error(cs->dev))
		st = ej_error(ctx, EPJ_ERR_BACKEND, "%s",
			      ej_cuda_last_error(cs->dev));
	if (st == EPJ_OK) {
		epj_counter_add(ctx, "cudagraph.replays", 1);
		epj_counter_add(ctx, "kernels.launched.compiled", n_launch);
	} else {
		for (int i = 0; i < g->n_outputs; i++) {
			epj_tensor_free(outs[i]);
			outs[i] = NULL;
		}
	}
	return st;
}

static epj_status run(epj_ctx *ctx, void *state, ej_graph *g,
		      epj_tensor *const *inputs, epj_tensor **outs)
{
	cstate *cs = state;
	for (int i = 0; i < g->n_outputs; i++)
		outs[i] = NULL;
	if (cs->fused_only && graphs_on())
		return run_graph(ctx, cs, inputs, outs);
	return ej_sched_run(ctx, cs->s, g, cs->last, inputs, outs, cuda_kernel,
			    cs);
}

const ej_schedule *ej_backend_cuda_schedule(const void *state)
{
	return ((const cstate *)state)->s;
}

const char *ej_backend_cuda_source(const void *state)
{
	return ((const cstate *)state)->source;
}

epj_status ej_backend_cuda_run_kernel(epj_ctx *ctx, void *state, int kernel,
				      epj_tensor *const *in, epj_tensor **out)
{
	cstate *cs = state;
	return ej_sched_run_kernel(ctx, cs->s, kernel, in, out, cuda_kernel,
				   cs);
}

static int kernels(const void *state)
{
	return ((const cstate *)state)->s->n_kernels;
}

static bool available(void)
{
	int major = 0, minor = 0;
	return ej_nvrtc_version(&major, &minor);
}

/* exactly what load_kernels prints and looks up */
static const char *artifact(ej_arena *A, const struct ej_schedule *s,
			    const char *name, const char *arch, char key[65])
{
	const char *src = ej_print_cuda(A, s, name);
	ej_nvrtc_cache_key(src, arch, NULL, 0, key);
	return src;
}

static epj_status compile(epj_ctx *ctx, const char *src, const char *name,
			  const char *arch, void **art, size_t *len)
{
	ej_nvrtc_result r = { 0 };
	epj_status st = ej_nvrtc_compile(ctx, src, name, arch, NULL, 0, &r);
	if (st == EPJ_OK) {
		*art = r.image;
		*len = r.size;
		r.image = NULL;
	}
	ej_nvrtc_result_free(&r);
	return st;
}

const ej_codegen_backend ej_backend_cuda = {
	.name = "nvrtc",
	.kind = EJ_BACKEND_NVRTC,
	.available = available,
	.build = build,
	.run = run,
	.free_state = cstate_free,
	.kernels = kernels,
	.artifact = artifact,
	.compile = compile,
	.per_arch = true,
	.device = "cuda",
};

/* ---- timing (bench/bench_gpu.c) ------------------------------------------ */

epj_status ej_backend_cuda_time_kernel(epj_ctx *ctx, void *state, int kernel,
				       epj_tensor *const *in, int iters,
				       double *us, double *bytes)
{
	cstate *cs = state;
	EJ_ASSERT(kernel >= 0 && kernel < cs->s->n_kernels && iters > 0);
	const ej_kernel *k = cs->s->kernels[kernel];
	dev_view vin[cs->max_in + 1], vout[cs->max_out + 1];
	epj_tensor *din[cs->max_in + 1], *dout[cs->max_out + 1];
	epj_tensor *hout[cs->max_out + 1];
	void *bin[cs->max_in + 1], *bout[cs->max_out + 1];
	int n_in = 0, n_out = 0;
	double moved = 0;
	epj_status st = EPJ_OK;
	for (int i = 0; i < k->n_in && st == EPJ_OK; i++) {
		size_t n = span_bytes(in[i]);
		st = dev_alloc_or_fail(ctx, cs, n, &bin[i]);
		if (st != EPJ_OK)
			break;
		n_in++;
		cs->vt->copy(cs->vt->self, bin[i], ej_data(in[i]), n);
		dev_view_of(&vin[i], in[i], bin[i], n);
		din[i] = &vin[i].t;
		moved += (double)n;
	}
	for (int o = 0; o < k->n_out && st == EPJ_OK; o++) {
		const ej_value *v = &cs->s->g->values[k->out[o].value];
		hout[o] =
		    ej_tensor_alloc(ctx, v->dtype, v->ndim, v->shape, false);
		if (!hout[o]) {
			st = ctx->status ? ctx->status : EPJ_ERR_NOMEM;
			break;
		}
		size_t n = span_bytes(hout[o]);
		st = dev_alloc_or_fail(ctx, cs, n, &bout[o]);
		if (st != EPJ_OK) {
			epj_tensor_free(hout[o]);
			break;
		}
		n_out++;
		dev_view_of(&vout[o], hout[o], bout[o], n);
		dout[o] = &vout[o].t;
		moved += (double)n;
	}
	void *e0 = NULL, *e1 = NULL;
	if (st == EPJ_OK)
		st = ej_cuda_event_new(ctx, cs->dev, &e0);
	if (st == EPJ_OK)
		st = ej_cuda_event_new(ctx, cs->dev, &e1);
	if (st == EPJ_OK)
		st = launch_one(ctx, cs, k, din, dout); /* warm-up */
	if (st == EPJ_OK)
		st = ej_cuda_event_record(ctx, cs->dev, e0, false);
	for (int r = 0; r < iters && st == EPJ_OK; r++)
		st = launch_one(ctx, cs, k, din, dout);
	if (st == EPJ_OK)
		st = ej_cuda_event_record(ctx, cs->dev, e1, false);
	double ms = 0;
	if (st == EPJ_OK)
		st = ej_cuda_event_elapsed_ms(ctx, cs->dev, e0, e1, &ms);
	ej_cuda_event_free(cs->dev, e0);
	ej_cuda_event_free(cs->dev, e1);
	for (int i = 0; i < n_in; i++)
		ej_dealloc(dev_alloc, bin[i]);
	for (int o = 0; o < n_out; o++) {
		ej_dealloc(dev_alloc, bout[o]);
		epj_tensor_free(hout[o]);
	}
	*us = ms * 1e3 / iters;
	*bytes = moved;
	return st;
}

epj_status ej_backend_cuda_copy_bandwidth(epj_ctx *ctx, size_t bytes, int iters,
					  double *gbps)
{
	ej_cuda_dev *dev = NULL;
	epj_status st = device_get(ctx, &dev);
	if (st != EPJ_OK)
		return st;
	const ej_device *vt = ej_cuda_device(dev);
	void *a = NULL, *b = NULL;
	cstate tmp = { .dev = dev };
	st = dev_alloc_or_fail(ctx, &tmp, bytes, &a);
	if (st == EPJ_OK)
		st = dev_alloc_or_fail(ctx, &tmp, bytes, &b);
	void *e0 = NULL, *e1 = NULL;
	if (st == EPJ_OK)
		st = ej_cuda_event_new(ctx, dev, &e0);
	if (st == EPJ_OK)
		st = ej_cuda_event_new(ctx, dev, &e1);
	if (st == EPJ_OK) {
		vt->copy(vt->self, b, a, bytes); /* warm-up */
		st = ej_cuda_event_record(ctx, dev, e0, false);
	}
	for (int r = 0; r < iters && st == EPJ_OK; r++)
		st = ej_cuda_copy_async(ctx, dev, b, a, bytes);
	if (st == EPJ_OK)
		st = ej_cuda_event_record(ctx, dev, e1, false);
	double ms = 0;
	if (st == EPJ_OK)
		st = ej_cuda_event_elapsed_ms(ctx, dev, e0, e1, &ms);
	ej_cuda_event_free(dev, e0);
	ej_cuda_event_free(dev, e1);
	if (a)
		ej_dealloc(dev_alloc, a);
	if (b)
		ej_dealloc(dev_alloc, b);
	/* a copy reads and writes every byte */
	*gbps = ms > 0 ? 2.0 * (double)bytes * iters / (ms * 1e6) : 0;
	return st;
}
