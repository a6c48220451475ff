/* tmpl.c -- CUDA C templates built for the cuda-sim or cuda device (see
 * tmpl.h).
 *
 *   ej_tmpl_get(device, name, defines, kernels)
 *       -> process table hit?  the loaded module
 *       -> unit: prelude + defines + templates/<name>.cuh
 *       -> cuda-sim: ej_sim_build_module (host C++, kernel cache)
 *          cuda:     NVRTC for the device's arch (kernel cache under
 *                    ej_nvrtc_cache_key), cuModuleLoadData
 *       -> resolve every kernel, insert into the table
 */
#include "tmpl.h"

#include "cc.h"
#include "cuda_driver.h"
#include "kcache.h"
#include "kir.h"

#include "templates/prelude_cuda.h"
#include "templates/templates_text.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

const char *ej_tmpl_text(const char *name)
{
	for (int i = 0; ej_templates[i].name; i++)
		if (strcmp(ej_templates[i].name, name) == 0)
			return ej_templates[i].text;
	return NULL;
}

const char *const *ej_tmpl_names(void)
{
	return ej_template_names;
}

const char *ej_tmpl_source(epj_ctx *ctx, ej_arena *A, const char *name,
			   const char *defines)
{
	const char *t = ej_tmpl_text(name);
	if (!t) {
		ej_error(ctx, EPJ_ERR_INVALID,
			 "no CUDA template \"%s\" (templates/%s.cuh)", name,
			 name);
		return NULL;
	}
	ej_sbuf b = { 0 };
	ej_sb_puts(&b, ej_prelude_cuda_text);
	ej_sb_puts(&b, ej_tmpl_args_text); /* the host's own declarations */
	ej_sb_printf(&b, "/* ---- template %s ---- */\n", name);
	if (defines && *defines) {
		ej_sb_puts(&b, defines);
		ej_sb_puts(&b, "\n");
	}
	ej_sb_puts(&b, t);
	const char *src = ej_sb_finish(&b, A);
	if (!src)
		ej_error(ctx, EPJ_ERR_NOMEM, "template %s: out of memory",
			 name);
	return src;
}

struct ej_tmpl {
	char *key; /* device NUL-separated name and defines, for lookup */
	size_t key_len;
	const ej_device *dev;
	void *module;
	int n;
	char **kname, **ktype;
	void **fn;
	size_t *args_size; /* of the last launch of each kernel */
	char *source;	   /* the unit compiled (kept for the test hooks) */
	struct ej_tmpl *next;
};

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static ej_tmpl *table;

static void tmpl_free(ej_tmpl *m)
{
	if (!m)
		return;
	if (m->module && m->dev && m->dev->unload)
		m->dev->unload(m->dev->self, m->module);
	for (int i = 0; i < m->n; i++) {
		free(m->kname ? m->kname[i] : NULL);
		free(m->ktype ? m->ktype[i] : NULL);
	}
	free(m->kname);
	free(m->ktype);
	free(m->args_size);
	free(m->source);
	free(m->fn);
	free(m->key);
	free(m);
}

void ej_tmpl_clear(void)
{
	pthread_mutex_lock(&table_lock);
	ej_tmpl *m = table;
	table = NULL;
	pthread_mutex_unlock(&table_lock);
	while (m) {
		ej_tmpl *next = m->next;
		tmpl_free(m);
		m = next;
	}
}

const ej_device *ej_tmpl_device(const ej_tmpl *m)
{
	return m->dev;
}

/* NVRTC for the cuda device's arch, through the kernel cache. */
static epj_status build_cuda(epj_ctx *ctx, const char *src, const char *name,
			     const ej_device **dev_out, void **module)
{
	ej_cuda_dev *dev = NULL;
	epj_status st = ej_cuda_open(ctx, &dev);
	if (st != EPJ_OK)
		return st;
	const ej_device *vt = ej_cuda_device(dev);
	ej_cuda_dev_info info;
	ej_cuda_info(dev, &info);
	ej_kcache *kc = ej_kcache_open_for_run(ctx, NULL);
	if (!kc) {
		if (epj_ctx_status(ctx) != EPJ_ERR_IO) {
			ej_error_prefix(ctx, "template %s: kernel cache", name);
			return epj_ctx_status(ctx);
		}
		epj_log_msg(EPJ_LOG_WARN,
			    "template %s: compiling without a kernel cache: %s",
			    name, epj_ctx_error(ctx));
		epj_ctx_clear_error(ctx);
	}
	char what[128];
	snprintf(what, sizeof what, "template %s", name);
	st = ej_nvrtc_build_module(ctx, kc, src, name, info.arch, vt, what,
				   module);
	ej_kcache_close(kc);
	*dev_out = vt;
	return st;
}

static ej_tmpl *lookup(const char *key, size_t len)
{
	for (ej_tmpl *m = table; m; m = m->next)
		if (m->key_len == len && memcmp(m->key, key, len) == 0)
			return m;
	return NULL;
}

/* The module of template `name` with `defines` (unit NULL), or of the
 * ready CUDA C `unit` named `name` (defines then ignored). */
static epj_status get_module(epj_ctx *ctx, const char *device, const char *name,
			     const char *defines, const char *unit,
			     const ej_tmpl_kernel *k, int n, ej_tmpl **out)
{
	*out = NULL;
	if (!defines)
		defines = "";
	if (unit)
		defines = unit;
	/* how the device takes modules: shared objects from the host C++
	 * compiler (cuda-sim) or cubins from NVRTC (cuda) */
	const ej_device_desc *dd = ej_device_find(device);
	if (!dd || !dd->runs_cuda)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"template %s: device \"%s\" runs no CUDA C",
				name, device);
	bool sim = dd->modules == EJ_MODULES_HOST_SO;
	size_t dl = strlen(device), nl = strlen(name), fl = strlen(defines);
	size_t len = dl + 1 + nl + 1 + fl;
	char *key = malloc(len + 1);
	if (!key)
		return ej_error(ctx, EPJ_ERR_NOMEM, "template: out of memory");
	memcpy(key, device, dl + 1);
	memcpy(key + dl + 1, name, nl + 1);
	memcpy(key + dl + 1 + nl + 1, defines, fl + 1);

	/* one build at a time: concurrent callers of the same template wait
	 * for the first instead of compiling it twice */
	pthread_mutex_lock(&table_lock);
	ej_tmpl *hit = lookup(key, len);
	if (hit) {
		pthread_mutex_unlock(&table_lock);
		free(key);
		*out = hit;
		return EPJ_OK;
	}
	epj_status st = EPJ_OK;
	ej_tmpl *m = calloc(1, sizeof *m);
	ej_arena *A = ej_arena_new();
	if (!m || !A) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "template: out of memory");
		goto done;
	}
	m->key = key;
	m->key_len = len;
	key = NULL;
	const char *src = unit ? unit : ej_tmpl_source(ctx, A, name, defines);
	if (!src) {
		st = epj_ctx_status(ctx);
		goto done;
	}
	char mname[96];
	snprintf(mname, sizeof mname, "%s%s", unit ? "" : "tmpl_", name);
	if (sim) {
		const char **kn =
		    ej_arena_alloc(A, sizeof(char *) * (size_t)(n + 1));
		const char **ty =
		    ej_arena_alloc(A, sizeof(char *) * (size_t)(n + 1));
		if (!kn || !ty) {
			st = ej_error(ctx, EPJ_ERR_NOMEM,
				      "template: out of memory");
			goto done;
		}
		for (int i = 0; i < n; i++) {
			kn[i] = k[i].name;
			ty[i] = k[i].arg_type;
		}
		m->dev = &ej_device_sim;
		st =
		    ej_sim_build_module(ctx, src, kn, ty, n, mname, &m->module);
	} else {
		st = build_cuda(ctx, src, mname, &m->dev, &m->module);
	}
	if (st != EPJ_OK)
		goto done;
	m->kname = calloc((size_t)n + 1, sizeof *m->kname);
	m->ktype = calloc((size_t)n + 1, sizeof *m->ktype);
	m->fn = calloc((size_t)n + 1, sizeof *m->fn);
	m->args_size = calloc((size_t)n + 1, sizeof *m->args_size);
	m->source = strdup(src);
	if (!m->kname || !m->ktype || !m->fn || !m->args_size || !m->source) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "template: out of memory");
		goto done;
	}
	for (int i = 0; i < n; i++) {
		m->kname[i] = strdup(k[i].name);
		m->ktype[i] = strdup(k[i].arg_type);
		m->n = i + 1;
		if (!m->kname[i] || !m->ktype[i]) {
			st = ej_error(ctx, EPJ_ERR_NOMEM,
				      "template: out of memory");
			goto done;
		}
		m->fn[i] = m->dev->function(m->dev->self, m->module, k[i].name);
		if (!m->fn[i]) {
			st = ej_error(ctx, EPJ_ERR_BACKEND,
				      "template %s (%s): kernel %s missing "
				      "from the module",
				      name, device, k[i].name);
			goto done;
		}
	}
	m->next = table;
	table = m;
	*out = m;
	m = NULL;
done:
	pthread_mutex_unlock(&table_lock);
	ej_arena_free(A);
	tmpl_free(m);
	free(key);
	return st;
}

epj_status ej_tmpl_get(epj_ctx *ctx, const char *device, const char *name,
		       const char *defines, const ej_tmpl_kernel *k, int n,
		       ej_tmpl **out)
{
	return get_module(ctx, device, name, defines, NULL, k, n, out);
}

epj_status ej_tmpl_get_unit(epj_ctx *ctx, const char *device, const char *name,
			    const char *unit, const ej_tmpl_kernel *k, int n,
			    ej_tmpl **out)
{
	return get_module(ctx, device, name, NULL, unit, k, n, out);
}

epj_status ej_tmpl_launch(epj_ctx *ctx, ej_tmpl *m, const char *kernel,
			  const ej_launch *l)
{
	for (int i = 0; i < m->n; i++)
		if (strcmp(m->kname[i], kernel) == 0) {
			m->args_size[i] = l ? l->args_size : 0;
			epj_counter_add(ctx, "kernels.launched.template", 1);
			return m->dev->launch(m->dev->self, ctx, m->fn[i],
					      kernel, l);
		}
	return ej_error(ctx, EPJ_ERR_INVALID,
			"template module: kernel %s was not named when it was "
			"loaded",
			kernel);
}

/* ---- what the host APIs of the templates share (tmpl.h) ----------------- */

/* ctx's allocator hands out memory that dev's kernels address. */
static bool ctx_memory_p(const epj_ctx *ctx, const ej_device *dev)
{
	const ej_device *c = ctx->dev;
	return c == dev || strcmp(c->name, dev->name) == 0 ||
	       (c->host_visible && dev->host_visible);
}

void *ej_tmpl_scratch_alloc(epj_ctx *ctx, const ej_device *dev, size_t bytes,
			    const char *what)
{
	if (!bytes)
		bytes = 1;
	void *p = ctx_memory_p(ctx, dev) ? ej_alloc(ctx->alloc, bytes)
					 : dev->alloc(dev->self, bytes);
	if (!p)
		ej_error(ctx, EPJ_ERR_NOMEM,
			 "%s: out of %s memory for %zu bytes of scratch", what,
			 dev->name, bytes);
	return p;
}

void ej_tmpl_scratch_free(epj_ctx *ctx, const ej_device *dev, void *p)
{
	if (!p)
		return;
	if (ctx_memory_p(ctx, dev))
		ej_dealloc(ctx->alloc, p);
	else
		dev->free(dev->self, p);
}

int ej_tmpl_dcode(epj_dtype dt)
{
	switch (dt) {
	case EPJ_DTYPE_F32:
		return 0;
	case EPJ_DTYPE_BF16:
		return 1;
	case EPJ_DTYPE_F64:
		return 2;
	default:
		return -1;
	}
}

ej_launch_out ej_tmpl_out(void *p, int64_t n, size_t elem)
{
	ej_launch_out o = { p, (size_t)n * elem, elem };
	return o;
}

epj_status ej_tmpl_launch_1d(epj_ctx *ctx, ej_tmpl *m, const char *kernel,
			     unsigned grid, unsigned block, const void *args,
			     size_t size, const ej_launch_out *outs, int n_out)
{
	ej_launch l = { .grid = { grid, 1, 1 },
			.block = { block, 1, 1 },
			.args = args,
			.args_size = size,
			.outs = outs,
			.n_out = n_out };
	return ej_tmpl_launch(ctx, m, kernel, &l);
}

/* Test hooks, deliberately in no header (t/check_cuda.c: the stand-in
 * driver runs a launch of a template module on cuda-sim, so it needs the
 * module's unit, kernels and argument sizes). */
int ej_tmpl_test_module(const void *module, const char **source,
			const char *const **kernels,
			const char *const **arg_types);
size_t ej_tmpl_test_args_size(const void *module, const char *kernel);

int ej_tmpl_test_module(const void *module, const char **source,
			const char *const **kernels,
			const char *const **arg_types)
{
	for (ej_tmpl *m = table; m; m = m->next)
		if (m->module == module) {
			*source = m->source;
			*kernels = (const char *const *)m->kname;
			*arg_types = (const char *const *)m->ktype;
			return m->n;
		}
	return -1;
}

size_t ej_tmpl_test_args_size(const void *module, const char *kernel)
{
	for (ej_tmpl *m = table; m; m = m->next)
		if (m->module == module)
			for (int i = 0; i < m->n; i++)
				if (strcmp(m->kname[i], kernel) == 0)
					return m->args_size[i];
	return 0;
}
