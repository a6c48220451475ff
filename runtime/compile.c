/* compile.c -- the engine's compile (the user's engine.compile()): mode,
 * fail-fast validation, region discovery, installation of compiled-forward
 * wrappers with rollback, and the wrapper itself.
 *
 *   epj_engine_compile(e)
 *     mode      = autoep_non_moe (config option) or model (full-model)
 *     validate  = config support boundary (option on: DeepSpeed's
 *                 engine-level checks; off: what full-model mode cannot
 *                 honour), backend of this build, then (option on, in
 *                 DeepSpeed's order) an AutoEP layer exists, fullgraph and
 *                 dynamic, each layer's region (nothing is changed when any
 *                 of it fails)
 *     regions   = autoep_non_moe: the callable direct parent of every AutoEP
 *                 layer, deduplicated, in the order of the layers in
 *                 named_modules() (pre-order); model: the root
 *     install   = per region: orig_forward = forward, forward = wrapper;
 *                 a failure part-way restores every region already changed
 *   region_forward (first call and every guard miss)
 *     trace orig_forward (TRACE mode; AutoEP calls become graph breaks
 *     through the runtime's break hook) -> ej_jit_compile -> a variant;
 *     then ej_region_run (compiled segments + eager AutoEP calls).
 *
 * Invariants
 *  - The engine's compile state owns every region state.  A region's module
 *    points at it (m->compiled) while the wrapper is installed; the module's
 *    compiled_free only detaches it (the model may be freed first), the
 *    engine frees it and restores the module in ej_engine_compile_free.
 *  - A region's parameter table is its subtree's parameters without the
 *    subtrees of compiler_disabled modules (those run eagerly in the break)
 *    except their region_owned children's (dense work the region does
 *    under the MoE block's name), in model order; slots are indices into
 *    it.  It holds borrowed pointers
 *    refreshed at every call (epj_model_set_param replaces tensors).
 *  - Variants of a region are bounded by the recompile limit (8, as torch's
 *    cache_size_limit; EPJIT_RECOMPILE_LIMIT overrides, read at compile
 *    time).  A guard miss at the limit runs the original forward eagerly.
 *
 * Counters kept here: frames.total (traces started), frames.ok (variants
 * compiled), recompiles (variants beyond a region's first compiled because
 * a call's guards failed, as Dynamo counts them), frames.precompiled
 * (variants compiled ahead of their first call by a warm-up) and
 * frames.fallback_eager (calls run eagerly because of the limit).  The jit
 * keeps the others (stats.*, graph_break.*, cache.*, compile.*).
 */
#include "cuda_driver.h"
#include "jit.h"
#include "runtime_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_RECOMPILE_LIMIT 8
#define AUTOEP_PREFIX		"compile.autoep_non_moe=true"

typedef struct region {
	struct ej_engine_compile *owner;
	epj_module *m; /* NULL once the module was freed (detached) */
	int index;
	const char *name; /* m->name while attached; "" shown as root */
	/* compiled variants, at most owner->recompile_limit */
	ej_region_fn **variants;
	int n_variants;
	bool warned_limit;
	/* calls that ran a compiled variant / the original forward (limit),
	 * and the compiled kernel launches those calls made */
	int64_t compiled_calls, eager_calls, compiled_launches;
	/* current parameter table (borrowed, refreshed per call) */
	epj_tensor **params;
	int n_params, cap_params;
	/* the module fields installation replaced (restored exactly) */
	ej_forward_fn saved_forward, saved_orig;
	void *saved_compiled;
	void (*saved_compiled_free)(void *);
} region;

struct ej_engine_compile {
	bool autoep_non_moe; /* the mode, fixed at the first compile */
	ej_backend_kind backend;
	ej_jit *jit;
	int recompile_limit;
	region **regions;
	int n_regions;
};

/* ---- test hook ----------------------------------------------------------- */

/* One-shot failure injection for the rollback tests: the next
 * epj_engine_compile of `inject_engine` fails while installing region
 * `inject_index`.  The hook is consumed (reset) by that compile call, whether
 * or not it reaches the region.  A global rather than engine state because
 * the engine has no compile state before its first compile. */
static const epj_engine *inject_engine;
static int inject_index = -1;

void ej_compile_inject_failure(epj_engine *e, int region_index);
void ej_compile_inject_failure(epj_engine *e, int region_index)
{
	inject_engine = e;
	inject_index = region_index;
}

/* A wrong compiled kernel on purpose, for the parity harness's own tests
 * (t/check_parity.c): while rel is not 0, every call of a compiled variant
 * returns its floating outputs scaled by (1 + rel).  A global for the same
 * reason as the failure injection above. */
static double perturb_rel;

void ej_compile_test_perturb(double rel);
void ej_compile_test_perturb(double rel)
{
	perturb_rel = rel;
}

static epj_status perturb_outputs(epj_ctx *ctx, epj_tensor **out, int n_out)
{
	for (int j = 0; j < n_out; j++) {
		if (!out[j] || !epj_dtype_is_float(epj_tensor_dtype(out[j])))
			continue;
		epj_tensor *t = epj_mul_scalar(ctx, out[j], 1.0 + perturb_rel);
		if (!t)
			return ctx->status ? ctx->status : EPJ_ERR_NOMEM;
		epj_tensor_free(out[j]);
		out[j] = t;
	}
	return EPJ_OK;
}

/* ---- parameter table ----------------------------------------------------- */

static epj_status params_push(epj_ctx *ctx, region *r, epj_tensor *t)
{
	if (r->n_params == r->cap_params) {
		int nc = r->cap_params ? r->cap_params * 2 : 32;
		epj_tensor **np = realloc(r->params, sizeof *np * (size_t)nc);
		if (!np)
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"compile: out of memory listing the "
					"parameters of region \"%s\"",
					r->name);
		r->params = np;
		r->cap_params = nc;
	}
	r->params[r->n_params++] = t;
	return EPJ_OK;
}

/* A compiler_disabled module below the region: only its region_owned
 * children's parameters are the region's. */
static bool in_break(const region *r, const epj_module *m)
{
	return m != r->m && m->compiler_disabled;
}

/* Parameters of m's subtree, model order (pre-order, a module's own
 * parameters before its children's), skipping compiler_disabled subtrees
 * below the region but for their region_owned children. */
static epj_status params_walk(epj_ctx *ctx, region *r, epj_module *m)
{
	if (in_break(r, m)) {
		for (int i = 0; i < m->n_children; i++) {
			epj_status st =
			    m->children[i]->region_owned
				? params_walk(ctx, r, m->children[i])
				: EPJ_OK;
			if (st != EPJ_OK)
				return st;
		}
		return EPJ_OK;
	}
	for (int i = 0; i < m->n_params; i++) {
		epj_status st = params_push(ctx, r, m->params[i]);
		if (st != EPJ_OK)
			return st;
	}
	for (int i = 0; i < m->n_children; i++) {
		epj_status st = params_walk(ctx, r, m->children[i]);
		if (st != EPJ_OK)
			return st;
	}
	return EPJ_OK;
}

static epj_status params_refresh(epj_ctx *ctx, region *r)
{
	r->n_params = 0;
	return params_walk(ctx, r, r->m);
}

/* Fills names[n..cap) with the full names of the parameters of m's
 * subtree in params_walk's order (slot i of the region's table is
 * names[i]); returns n plus the parameters walked.  A name that cannot be
 * allocated stays NULL (dumped as ""). */
static int names_walk(const region *r, const epj_module *m, char **names,
		      int cap, int n)
{
	if (in_break(r, m)) {
		for (int i = 0; i < m->n_children; i++)
			if (m->children[i]->region_owned)
				n = names_walk(r, m->children[i], names, cap,
					       n);
		return n;
	}
	for (int i = 0; i < m->n_params; i++) {
		if (n < cap) {
			size_t len =
			    strlen(m->name) + strlen(m->param_names[i]) + 2;
			names[n] = malloc(len);
			if (names[n])
				snprintf(names[n], len, "%s%s%s", m->name,
					 m->name[0] ? "." : "",
					 m->param_names[i]);
		}
		n++;
	}
	for (int i = 0; i < m->n_children; i++)
		n = names_walk(r, m->children[i], names, cap, n);
	return n;
}

static const char *module_path(const void *callee)
{
	const epj_module *m = callee;
	return m ? (m->name[0] ? m->name : "<root>") : "";
}

/* EPJIT_DEBUG_DUMP: the provenance line of r's newest variant f. */
static void dump_provenance(const region *r, const ej_region_fn *f)
{
	if (!ej_debug_dump_dir())
		return;
	char **names = calloc((size_t)r->n_params + 1, sizeof *names);
	if (!names)
		return;
	int n = names_walk(r, r->m, names, r->n_params, 0);
	if (n > r->n_params)
		n = r->n_params;
	ej_debug_dump_provenance(f, r->name, r->m->kind, r->n_variants,
				 (const char *const *)names, n, module_path);
	for (int i = 0; i < n; i++)
		free(names[i]);
	free(names);
}

/* ej_param_slot_fn: pointer identity against the table. */
static int param_slot(void *user, const epj_tensor *t)
{
	const region *r = user;
	for (int i = 0; i < r->n_params; i++)
		if (r->params[i] == t)
			return i;
	return -1;
}

/* ---- region state -------------------------------------------------------- */

static void region_free(region *r)
{
	if (!r)
		return;
	for (int i = 0; i < r->n_variants; i++)
		ej_region_fn_free(r->variants[i]);
	free(r->variants);
	free(r->params);
	free(r);
}

/* compiled_free of a module: the module is being freed before the engine
 * (the engine owns the state): forget the module. */
static void region_detach(void *p)
{
	region *r = p;
	if (r) {
		r->m = NULL;
		r->name = "(freed module)";
	}
}

/* Puts back what installation replaced. */
static void region_restore(region *r)
{
	epj_module *m = r->m;
	if (!m)
		return;
	EJ_ASSERT(m->compiled == r);
	m->forward = r->saved_forward;
	m->orig_forward = r->saved_orig;
	m->compiled = r->saved_compiled;
	m->compiled_free = r->saved_compiled_free;
}

/* ---- the wrapper --------------------------------------------------------- */

static epj_status region_forward(epj_ctx *ctx, epj_module *m,
				 epj_tensor *const *in, int n_in,
				 epj_tensor **out, int n_out);

/* ej_break_hook.on_call while a region is traced: a call of a
 * compiler_disabled module becomes a graph-break node. */
static epj_status on_break(void *self, epj_ctx *ctx, epj_module *m,
			   epj_tensor *const *in, int n_in, epj_tensor **out,
			   int n_out)
{
	(void)self;
	/* an AutoEP layer, or (full-model mode) a checkpointed block that
	 * runs eagerly with its checkpointing (module.c) */
	const char *reason = !strcmp(m->kind, "AutoEPMoELayer") ? "autoep"
			     : m->compiler_disabled ? "compiler_disabled"
						    : "checkpoint";
	return ej_trace_break(ctx, m, reason, in, n_in, out, n_out);
}

/* ej_traced_fn: the region's original forward on symbolic inputs. */
static epj_status traced_fn(void *user, epj_ctx *ctx, epj_tensor *const *in,
			    int n_in, epj_tensor **out, int n_out)
{
	region *r = user;
	return r->m->orig_forward(ctx, r->m, in, n_in, out, n_out);
}

/* ej_break_call_fn: performs a graph break eagerly (the AutoEP layer records
 * its own autograd nodes and counts its call). */
static epj_status break_call(void *user, epj_ctx *ctx, void *callee,
			     epj_tensor *const *in, int n_in, epj_tensor **out,
			     int n_out)
{
	(void)user;
	return ej_module_call(ctx, callee, in, n_in, out, n_out);
}

/* Traces and compiles a new variant of r for this call. */
static epj_status compile_variant(epj_ctx *ctx, region *r,
				  epj_tensor *const *in, int n_in, int n_out,
				  ej_region_fn **out)
{
	struct ej_engine_compile *c = r->owner;
	*out = NULL;
	epj_counter_add(ctx, "frames.total", 1);
	const ej_break_hook *prev = ej_get_break_hook(ctx);
	ej_break_hook hook = { .self = r, .on_call = on_break };
	ej_set_break_hook(ctx, &hook);
	ej_trace *t = NULL;
	epj_status st = ej_trace_region(ctx, c->jit, traced_fn, r, in, n_in,
					n_out, param_slot, r, &t);
	ej_set_break_hook(ctx, prev);
	ej_region_fn *f = NULL;
	if (st == EPJ_OK)
		st = ej_jit_compile(ctx, c->jit, t, &f); /* owns t */
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "compiling region \"%s\" (%s)", r->name,
				r->m->kind);
		return st;
	}
	r->variants[r->n_variants++] = f;
	epj_counter_add(ctx, "frames.ok", 1);
	dump_provenance(r, f);
	*out = f;
	return EPJ_OK;
}

/* Why no variant of r accepts this call: each variant's first failing
 * guard, "; "-separated (for the logs). */
static void explain_miss(const region *r, const epj_ctx *ctx,
			 epj_tensor *const *in, int n_in, char *buf, size_t n)
{
	size_t o = 0;
	buf[0] = 0;
	for (int i = 0; i < r->n_variants && o + 1 < n; i++) {
		char why[256];
		ej_region_fn_guard_explain(r->variants[i], ctx, in, n_in,
					   r->params, r->n_params, why,
					   sizeof why);
		int k = snprintf(buf + o, n - o, "%svariant %d: %s",
				 i ? "; " : "", i + 1, why);
		if (k < 0)
			break;
		o += (size_t)k;
	}
}

/* Before a region compiles a variant beyond its first.  For a call that
 * no variant's guards accept (warm == false), counts it in `recompiles`, as
 * Dynamo counts a recompile, and logs (and dumps) why.  A variant compiled
 * ahead of its first call (epj_engine_precompile, epjit-warmup: warm ==
 * true) is no guard failure: it counts in frames.precompiled instead and
 * is logged as such. */
static void note_recompile(epj_ctx *ctx, const region *r, epj_tensor *const *in,
			   int n_in, bool warm)
{
	if (warm)
		epj_counter_add(ctx, "frames.precompiled", 1);
	if (r->n_variants == 0)
		return;
	char why[1024];
	explain_miss(r, ctx, in, n_in, why, sizeof why);
	if (warm) {
		epj_log_msg(EPJ_LOG_INFO,
			    "region \"%s\": precompiling variant %d: %s",
			    r->name, r->n_variants + 1, why);
		return;
	}
	epj_log_msg(EPJ_LOG_INFO, "region \"%s\": recompiling (variant %d): %s",
		    r->name, r->n_variants + 1, why);
	ej_debug_dump_recompile(r->name, r->n_variants + 1, why);
	epj_counter_add(ctx, "recompiles", 1);
}

static epj_status region_forward(epj_ctx *ctx, epj_module *m,
				 epj_tensor *const *in, int n_in,
				 epj_tensor **out, int n_out)
{
	region *r = m->compiled;
	EJ_ASSERT(r && r->m == m && m->orig_forward);
	for (int j = 0; j < n_out; j++)
		out[j] = NULL;
	/* Called while an enclosing region is traced (a region nested in
	 * another): inline the original forward into that trace. */
	if (ej_tracing(ctx))
		return m->orig_forward(ctx, m, in, n_in, out, n_out);
	epj_status st = params_refresh(ctx, r);
	if (st != EPJ_OK)
		return st;
	ej_region_fn *f = NULL;
	for (int i = 0; i < r->n_variants && !f; i++)
		if (ej_region_fn_guard_ok(r->variants[i], ctx, in, n_in,
					  r->params, r->n_params))
			f = r->variants[i];
	if (!f && r->n_variants >= r->owner->recompile_limit) {
		if (!r->warned_limit) {
			char why[1024];
			explain_miss(r, ctx, in, n_in, why, sizeof why);
			epj_log_msg(EPJ_LOG_WARN,
				    "region \"%s\": recompile limit %d reached "
				    "(%s); calls that match no compiled "
				    "variant run eagerly "
				    "(EPJIT_RECOMPILE_LIMIT raises the limit)",
				    r->name, r->owner->recompile_limit, why);
			r->warned_limit = true;
		}
		epj_counter_add(ctx, "frames.fallback_eager", 1);
		r->eager_calls++;
		return m->orig_forward(ctx, m, in, n_in, out, n_out);
	}
	if (!f) {
		note_recompile(ctx, r, in, n_in, false);
		st = compile_variant(ctx, r, in, n_in, n_out, &f);
		if (st != EPJ_OK)
			return st;
	}
	int64_t k0 = epj_counter_get(ctx, "kernels.launched.compiled");
	ej_prof pf;
	ej_prof_begin(ctx, &pf);
	st = ej_region_run(ctx, f, in, n_in, r->params, r->n_params, break_call,
			   r, out, n_out);
	ej_prof_end(ctx, &pf, "region.forward");
	r->compiled_calls++;
	r->compiled_launches +=
	    epj_counter_get(ctx, "kernels.launched.compiled") - k0;
	if (st == EPJ_OK && perturb_rel != 0)
		st = perturb_outputs(ctx, out, n_out);
	return st;
}

/* ---- discovery ----------------------------------------------------------- */

typedef struct module_list {
	epj_module **v;
	int n, cap;
} module_list;

static epj_status list_push(epj_ctx *ctx, module_list *l, epj_module *m)
{
	for (int i = 0; i < l->n; i++)
		if (l->v[i] == m)
			return EPJ_OK; /* dedupe */
	if (l->n == l->cap) {
		int nc = l->cap ? l->cap * 2 : 16;
		epj_module **nv = realloc(l->v, sizeof *nv * (size_t)nc);
		if (!nv)
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"compile: out of memory");
		l->v = nv;
		l->cap = nc;
	}
	l->v[l->n++] = m;
	return EPJ_OK;
}

static const char *shown(const char *name)
{
	return name[0] ? name : "<root>";
}

/* Collects every compiler_disabled module (the AutoEP layers) in pre-order,
 * as torch's named_modules() lists them, not below another one (those run
 * inside it eagerly). */
static epj_status find_autoep(epj_ctx *ctx, epj_module *m, module_list *layers)
{
	if (m->compiler_disabled)
		return list_push(ctx, layers, m);
	for (int i = 0; i < m->n_children; i++) {
		epj_status st = find_autoep(ctx, m->children[i], layers);
		if (st != EPJ_OK)
			return st;
	}
	return EPJ_OK;
}

/* The region of AutoEP layer m: its direct parent, which must exist, be
 * callable and not be compiled yet (DeepSpeed's per-layer checks, in its
 * order, with its wording first). */
static epj_status autoep_region(epj_ctx *ctx, epj_module *m, epj_module **out)
{
	epj_module *p = m->parent;
	*out = NULL;
	if (!p)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				AUTOEP_PREFIX
				" cannot compile an AutoEPMoELayer at the "
				"model root: the AutoEP layer (%s) has no "
				"surrounding region to compile; wrap it in a "
				"callable module",
				m->kind);
	if (!p->forward)
		return ej_error(
		    ctx, EPJ_ERR_UNSUPPORTED,
		    AUTOEP_PREFIX
		    ": AutoEP compile region '%s' has no forward "
		    "implementation. The MoE layer must be a direct child of a "
		    "callable module (the parent (%s) of AutoEP layer \"%s\" "
		    "is not: e.g. a layer list, not a decoder block)",
		    shown(p->name), p->kind, m->name);
	if (p->orig_forward)
		return ej_error(ctx, EPJ_ERR_STATE,
				AUTOEP_PREFIX
				": AutoEP compile region '%s' is already "
				"compiled (%s; by another engine on the same "
				"model?)",
				shown(p->name), p->kind);
	*out = p;
	return EPJ_OK;
}

/* Regions of the mode, validated; *out is empty on failure.  With the
 * option on, in DeepSpeed's order: the model has an AutoEP layer, then
 * fullgraph and dynamic (ej_config_validate_autoep_kwargs), then each layer's
 * region; the regions are the layers' parents, deduplicated, in the order of
 * their first AutoEP child in named_modules() (a root whose AutoEP child
 * comes after a block's follows that block). */
static epj_status discover(epj_ctx *ctx, epj_module *root, const ej_config *cfg,
			   module_list *out)
{
	memset(out, 0, sizeof *out);
	epj_status st = EPJ_OK;
	if (!cfg->compile.autoep_non_moe) {
		if (!root->forward)
			st = ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				      "compile: the model root (%s) has no "
				      "forward",
				      root->kind);
		else if (root->compiler_disabled)
			st = ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				      "compile: the model root (%s) is "
				      "compiler_disabled",
				      root->kind);
		else if (root->orig_forward)
			st = ej_error(ctx, EPJ_ERR_STATE,
				      "compile: the model root (%s) is "
				      "already compiled (by another engine "
				      "on the same model?)",
				      root->kind);
		else
			st = list_push(ctx, out, root);
	} else {
		module_list layers = { 0 };
		st = find_autoep(ctx, root, &layers);
		if (st == EPJ_OK && layers.n == 0)
			st = ej_error(
			    ctx, EPJ_ERR_UNSUPPORTED,
			    AUTOEP_PREFIX
			    " requires at least one AutoEPMoELayer, and the "
			    "model (%s) has no AutoEP layer (num_experts is 0 "
			    "or every layer is in mlp_only_layers): enable MoE "
			    "layers or set compile.autoep_non_moe to false",
			    root->kind);
		if (st == EPJ_OK)
			st = ej_config_validate_autoep_kwargs(ctx, cfg);
		for (int i = 0; st == EPJ_OK && i < layers.n; i++) {
			epj_module *p = NULL;
			st = autoep_region(ctx, layers.v[i], &p);
			if (st == EPJ_OK)
				st = list_push(ctx, out, p); /* dedupes */
		}
		free(layers.v);
	}
	if (st != EPJ_OK) {
		free(out->v);
		memset(out, 0, sizeof *out);
	}
	return st;
}

/* ---- installation -------------------------------------------------------- */

static int recompile_limit(void)
{
	const char *s = getenv("EPJIT_RECOMPILE_LIMIT");
	if (!s || !*s)
		return DEFAULT_RECOMPILE_LIMIT;
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || *end || v < 1 || v > INT_MAX / 2) {
		epj_log_msg(EPJ_LOG_WARN,
			    "EPJIT_RECOMPILE_LIMIT=\"%s\" is not an integer "
			    ">= 1; using %d",
			    s, DEFAULT_RECOMPILE_LIMIT);
		return DEFAULT_RECOMPILE_LIMIT;
	}
	return (int)v;
}

static void compile_state_free(struct ej_engine_compile *c)
{
	if (!c)
		return;
	for (int i = 0; i < c->n_regions; i++) {
		region_restore(c->regions[i]);
		region_free(c->regions[i]);
	}
	free(c->regions);
	ej_jit_free(c->jit);
	free(c);
}

/* Installs the wrapper on every region; on failure restores the regions
 * already changed (compile_state_free) and returns the error. */
static epj_status install(epj_ctx *ctx, struct ej_engine_compile *c,
			  const module_list *mods, int inject)
{
	c->regions = calloc((size_t)mods->n + 1, sizeof *c->regions);
	if (!c->regions)
		return ej_error(ctx, EPJ_ERR_NOMEM, "compile: out of memory");
	for (int i = 0; i < mods->n; i++) {
		epj_module *m = mods->v[i];
		region *r = calloc(1, sizeof *r);
		if (r)
			r->variants = calloc((size_t)c->recompile_limit,
					     sizeof *r->variants);
		if (!r || !r->variants) {
			region_free(r);
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"compile: out of memory installing "
					"region \"%s\"",
					m->name);
		}
		r->owner = c;
		r->m = m;
		r->index = i;
		r->name = m->name;
		epj_status st = EPJ_OK;
		if (m->orig_forward || !m->forward)
			st = ej_error(ctx, EPJ_ERR_STATE,
				      "compile: region \"%s\" changed during "
				      "compile",
				      shown(m->name));
		else if (i == inject)
			st = ej_error(ctx, EPJ_ERR_COMPILE,
				      "injected compile failure at region %d "
				      "(%s)",
				      i, m->name);
		else
			st = params_refresh(ctx, r);
		if (st != EPJ_OK) {
			region_free(r);
			return st;
		}
		r->saved_forward = m->forward;
		r->saved_orig = m->orig_forward;
		r->saved_compiled = m->compiled;
		r->saved_compiled_free = m->compiled_free;
		m->orig_forward = m->forward;
		m->forward = region_forward;
		m->compiled = r;
		m->compiled_free = region_detach;
		c->regions[c->n_regions++] = r;
	}
	return EPJ_OK;
}

/* ---- engine API ---------------------------------------------------------- */

epj_status epj_engine_compile(epj_engine *e)
{
	epj_ctx *ctx = e->ctx;
	bool autoep = e->cfg.compile.autoep_non_moe;
	int inject = -1;
	if (inject_engine == e) {
		inject = inject_index;
		inject_engine = NULL;
		inject_index = -1;
	}
	if (e->compiled) {
		if (e->compiled->autoep_non_moe == autoep)
			return EPJ_OK;
		return ej_error(ctx, EPJ_ERR_STATE,
				"Engine is already compiled; "
				"compile.autoep_non_moe cannot be changed "
				"after compilation.");
	}
	/* 1. the configuration: with the option on, DeepSpeed's engine-level
	 * boundary (fullgraph and dynamic come with the regions, in
	 * DeepSpeed's order); full-model mode refuses what it cannot
	 * honour */
	epj_status st = autoep ? ej_config_validate_autoep_engine(ctx, &e->cfg)
			       : ej_config_validate_model_compile(ctx, &e->cfg);
	if (st != EPJ_OK)
		return st;
	/* 2. the backend must be in this build */
	ej_backend_kind backend;
	char msg[256];
	/* no compile.backend: the config's "device"'s own (cuda-sim: the
	 * cuda-sim one, cuda: nvrtc, cpu: c), else that of the context's
	 * device when it runs CUDA C, else the default (jit/pipeline.c) */
	const char *bname = e->cfg.compile.backend;
	const ej_device_desc *dd =
	    e->cfg.device[0] ? ej_device_find(e->cfg.device) : ctx->dev->desc;
	if (!bname[0] && dd && (e->cfg.device[0] || dd->runs_cuda))
		bname = dd->backend;
	st = ej_backend_parse(bname, &backend, msg, sizeof msg);
	if (st != EPJ_OK) {
		if (autoep)
			return ej_error(ctx, st, AUTOEP_PREFIX ": %s", msg);
		return ej_error(ctx, st, "compile: %s", msg);
	}
	/* a backend whose artifacts need a device (nvrtc: the GPU) fails
	 * here without it, not at the first call */
	const char *need = ej_backend_device(backend);
	if (need) {
		const ej_device_desc *nd = ej_device_find(need);
		const ej_device *dev = NULL;
		st = nd ? nd->open(ctx, &dev) : EPJ_ERR_STATE;
		if (st != EPJ_OK) {
			ej_error_prefix(ctx, "%s: compile.backend \"%s\"",
					autoep ? AUTOEP_PREFIX : "compile",
					ej_backend_name(backend));
			return st;
		}
	}
	/* 3. regions (and, option on, fullgraph and dynamic) */
	module_list mods;
	st = discover(ctx, e->model->root, &e->cfg, &mods);
	if (st != EPJ_OK)
		return st;
	/* 4. install, with rollback */
	struct ej_engine_compile *c = calloc(1, sizeof *c);
	if (c) {
		c->autoep_non_moe = autoep;
		c->backend = backend;
		c->recompile_limit = recompile_limit();
		c->jit = ej_jit_new(ctx, backend);
	}
	if (!c || !c->jit) {
		free(c);
		free(mods.v);
		return ej_error(ctx, EPJ_ERR_NOMEM, "compile: out of memory");
	}
	st = install(ctx, c, &mods, inject);
	free(mods.v);
	if (st != EPJ_OK) {
		compile_state_free(c); /* rollback */
		return st;
	}
	e->compiled = c;
	epj_log_msg(EPJ_LOG_INFO,
		    "compile: mode %s, backend %s, %d region(s), recompile "
		    "limit %d",
		    epj_engine_compile_mode(e), ej_backend_name(backend),
		    c->n_regions, c->recompile_limit);
	return EPJ_OK;
}

const char *ej_engine_backend_name(const epj_engine *e)
{
	return e->compiled ? ej_backend_name(e->compiled->backend) : "none";
}

const char *epj_engine_compile_mode(const epj_engine *e)
{
	if (!e->compiled)
		return "none";
	return e->compiled->autoep_non_moe ? "autoep_non_moe" : "model";
}

int epj_engine_num_regions(const epj_engine *e)
{
	return e->compiled ? e->compiled->n_regions : 0;
}

struct ej_jit *ej_engine_jit(const epj_engine *e)
{
	return e->compiled ? e->compiled->jit : NULL;
}

const char *epj_engine_region_name(const epj_engine *e, int i)
{
	if (!e->compiled || i < 0 || i >= e->compiled->n_regions)
		return NULL;
	return e->compiled->regions[i]->name;
}

epj_status epj_engine_region_stats(const epj_engine *e, int i,
				   epj_region_stats *out)
{
	memset(out, 0, sizeof *out);
	if (!e->compiled || i < 0 || i >= e->compiled->n_regions)
		return ej_error(e->ctx, EPJ_ERR_INVALID,
				"region index %d out of range [0, %d)", i,
				e->compiled ? e->compiled->n_regions : 0);
	const region *r = e->compiled->regions[i];
	out->name = r->name;
	out->variants = r->n_variants;
	out->compiled_calls = r->compiled_calls;
	out->eager_calls = r->eager_calls;
	out->compiled_launches = r->compiled_launches;
	return EPJ_OK;
}

void ej_engine_compile_free(epj_engine *e)
{
	if (!e)
		return;
	/* EPJIT_DEBUG_DUMP: the counters at teardown (best effort: a failure
	 * is logged and leaves the context's error state as it was). */
	const char *dir = ej_debug_dump_dir();
	if (dir && e->ctx) {
		epj_ctx *ctx = e->ctx;
		epj_status prev_st = ctx->status;
		char prev_msg[sizeof ctx->errmsg];
		memcpy(prev_msg, ctx->errmsg, sizeof prev_msg);
		if (ej_debug_dump_counters(ctx, dir) != EPJ_OK)
			epj_log_msg(EPJ_LOG_WARN, "%s", ctx->errmsg);
		ctx->status = prev_st;
		memcpy(ctx->errmsg, prev_msg, sizeof prev_msg);
	}
	compile_state_free(e->compiled);
	e->compiled = NULL;
}

/* ---- offline CUDA C (epjit-train --emit-cuda) ------------------------------
 */

epj_status epj_engine_emit_cuda(epj_engine *e, epj_tensor *input_ids,
				epj_tensor *labels, const char *dir,
				bool nvrtc_check, int *n_units)
{
	epj_ctx *ctx = e->ctx;
	*n_units = 0;
	epj_status st = epj_engine_compile(e);
	if (st != EPJ_OK)
		return st;
	/* Trace every region at this batch shape: one forward and backward on
	 * the CPU (gradients dropped, no optimizer step). */
	epj_tensor *loss = NULL;
	st = epj_model_forward(ctx, e->model, input_ids, labels, NULL, &loss);
	if (st == EPJ_OK && loss)
		st = epj_backward(ctx, loss, NULL);
	epj_tensor_free(loss);
	for (int i = 0; i < e->model->params.n; i++)
		epj_tensor_zero_grad(e->model->params.params[i]);
	if (st != EPJ_OK)
		return st;
	return ej_jit_emit_cuda(ctx, e->compiled->jit, dir, nvrtc_check,
				n_units);
}

/* ---- offline warm-up -------------------------------------------------------
 */

/* One call of region r: arguments as storage-less tensors (requires_grad
 * for activations when rg), grad mode `grad`; compiles a variant unless one
 * accepts the call. */
static epj_status warm_call(epj_ctx *ctx, region *r, const ej_region_arg *a,
			    int n_in, int n_out, bool grad, bool rg,
			    int *n_variants)
{
	epj_tensor *in[EJ_REGION_MAX_ARGS] = { 0 };
	epj_status st = EPJ_OK;
	for (int i = 0; i < n_in && st == EPJ_OK; i++) {
		in[i] = ej_tensor_meta(ctx, a[i].dtype, a[i].ndim, a[i].shape);
		if (!in[i])
			st = ctx->status ? ctx->status : EPJ_ERR_NOMEM;
		else
			in[i]->requires_grad = rg && a[i].activation;
	}
	bool prev = ctx->grad_enabled;
	ctx->grad_enabled = grad;
	if (st == EPJ_OK)
		st = params_refresh(ctx, r);
	bool found = false;
	for (int i = 0; st == EPJ_OK && i < r->n_variants && !found; i++)
		found = ej_region_fn_guard_ok(r->variants[i], ctx, in, n_in,
					      r->params, r->n_params);
	if (st == EPJ_OK && !found) {
		if (r->n_variants >= r->owner->recompile_limit) {
			st =
			    ej_error(ctx, EPJ_ERR_STATE,
				     "warm-up: region \"%s\" needs more than "
				     "the recompile limit of %d variants",
				     shown(r->name), r->owner->recompile_limit);
		} else {
			ej_region_fn *f = NULL;
			note_recompile(ctx, r, in, n_in, true);
			st = compile_variant(ctx, r, in, n_in, n_out, &f);
			if (st == EPJ_OK)
				(*n_variants)++;
		}
	}
	ctx->grad_enabled = prev;
	for (int i = 0; i < n_in; i++)
		epj_tensor_free(in[i]);
	return st;
}

epj_status ej_engine_compile_trace_all(epj_engine *e, int64_t B, int64_t T,
				       int *n_variants)
{
	epj_ctx *ctx = e->ctx;
	*n_variants = 0;
	if (!e->compiled)
		return ej_error(ctx, EPJ_ERR_STATE,
				"warm-up: the engine is not compiled");
	epj_status st = EPJ_OK;
	for (int i = 0; st == EPJ_OK && i < e->compiled->n_regions; i++) {
		region *r = e->compiled->regions[i];
		ej_region_arg a[EJ_REGION_MAX_ARGS];
		int n_in = 0, n_out = 0;
		st = ej_model_region_args(ctx, e->model, r->m, B, T, a, &n_in,
					  &n_out);
		if (st != EPJ_OK)
			break;
		/* the training step: a checkpointed region runs its forward
		 * without grad on inputs that require grad, then replays it
		 * with grad in the backward (checkpoint.c) */
		if (r->m->checkpoint) {
			st = warm_call(ctx, r, a, n_in, n_out, false, true,
				       n_variants);
			if (st == EPJ_OK) {
				ctx->rt_replay_depth++;
				st = warm_call(ctx, r, a, n_in, n_out, true,
					       true, n_variants);
				ctx->rt_replay_depth--;
			}
		} else {
			st = warm_call(ctx, r, a, n_in, n_out, true, true,
				       n_variants);
		}
		/* the evaluation: no grad anywhere */
		if (st == EPJ_OK)
			st = warm_call(ctx, r, a, n_in, n_out, false, false,
				       n_variants);
	}
	return st;
}

epj_status epj_engine_precompile(epj_engine *e, int64_t seq_len,
				 int *n_variants)
{
	int n = 0;
	if (n_variants)
		*n_variants = 0;
	if (!e)
		return EPJ_ERR_INVALID;
	if (!e->compiled)
		return ej_error(e->ctx, EPJ_ERR_STATE,
				"precompile: the engine is not compiled (call "
				"epj_engine_compile first)");
	if (seq_len < 1)
		return ej_error(
		    e->ctx, EPJ_ERR_INVALID,
		    "precompile: seq_len must be >= 1, got %" PRId64, seq_len);
	epj_status st = ej_engine_compile_trace_all(
	    e, e->cfg.micro_batch_per_gpu, seq_len, &n);
	if (n_variants)
		*n_variants = n;
	return st;
}
