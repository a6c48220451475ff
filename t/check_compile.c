/* check_compile.c -- the engine's compile (runtime/compile.c): modes,
 * fail-fast validation as data-driven cases (t/compile_cases/), region
 * discovery, rollback, and compiled-vs-eager parity of whole models.
 *
 * Parity: two models built from one (fresh random) seed, one compiled, one
 * eager, see the same batch.  The compiled model runs the default backend
 * (generated C compiled by the host cc, on the cpu device) through a kernel
 * cache that this test run created (make check gives every test program a
 * fresh empty EPJIT_CACHE_DIR).  Each step proves which arm ran what: the
 * compiled model makes compiled launches in every region
 * (epj_engine_region_stats: a compiled call, compiled launches, no eager
 * fallback) and the eager one makes none.  Tolerances are tight f32 ones
 * (rtol 1e-5, atol 1e-6), far below DeepSpeed's AutoEP bf16 GPU gates.
 *
 * Observed counters (tiny model, 2 MoE layers, nested layout):
 *  - autoep_non_moe, no checkpointing: step 1 frames.total = frames.ok = 2
 *    (one trace per region), recompiles 0, stats.unique_graphs 2 (the block
 *    before and after its AutoEP break; both blocks share them),
 *    graph_break.autoep 2; step 2 adds no compile counter.
 *  - with checkpointing: the no-grad forward and the grad-mode replay in
 *    backward are two guard variants: step 1 frames.total = 4, recompiles 2;
 *    step 2 adds nothing; autoep.calls.forward + replay = 2 per block.
 *  - full-model mode (region = root): frames.total 1 (2 with checkpointing in
 *    the root layout).  In the nested layout the checkpointed blocks become
 *    graph breaks of the root's graph (graph_break.checkpoint) and run
 *    eagerly with their checkpointing, so AutoEP is still replayed.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "check_util.h"

#include <dirent.h>
#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "jit.h"
#include "runtime_impl.h"

/* Test hook defined in runtime/compile.c and deliberately in no header: it
 * is not an interface of the runtime, only the rollback tests' way to make
 * the next epj_engine_compile of e fail while installing region
 * `region_index` (one shot: consumed by that compile call). */
extern void ej_compile_inject_failure(epj_engine *e, int region_index);

#define RTOL 1e-5
#define ATOL 1e-6

/* ---- temporary files ----------------------------------------------------- */

/* The tiny model's config with `layers` decoder layers, in dir/config.json;
 * returns the path (malloc'ed). */
static char *write_model_config(const char *dir, int layers)
{
	char *path = malloc(strlen(dir) + 32);
	ck_assert_ptr_nonnull(path);
	sprintf(path, "%s/config.json", dir);
	FILE *f = fopen(path, "w");
	ck_assert_ptr_nonnull(f);
	fprintf(f,
		"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 64, "
		"\"hidden_size\": 32, \"num_hidden_layers\": %d, "
		"\"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
		"\"head_dim\": 8, \"intermediate_size\": 64, "
		"\"moe_intermediate_size\": 32, \"num_experts\": 4, "
		"\"num_experts_per_tok\": 2, \"norm_topk_prob\": true, "
		"\"max_position_embeddings\": 256, "
		"\"tie_word_embeddings\": false}\n",
		layers);
	ck_assert_int_eq(fclose(f), 0);
	return path;
}

/* ---- models, engines, batches -------------------------------------------- */

static epj_model *model_new(epj_ctx *ctx, epj_layout layout,
			    const char *config_path, uint64_t seed)
{
	epj_model_opts o = { .layout = layout,
			     .seed = seed,
			     .dtype = EPJ_DTYPE_F32 };
	epj_model *m = NULL;
	epj_status st = epj_model_new(ctx, config_path, &o, &m);
	ck_assert_msg(st == EPJ_OK, "model: %s", epj_ctx_error(ctx));
	return m;
}

static epj_engine *engine_new(epj_ctx *ctx, epj_model *m, const char *json)
{
	epj_engine *e = NULL;
	epj_status st = epj_engine_initialize_json(ctx, m, json, "test", &e);
	ck_assert_msg(st == EPJ_OK, "engine: %s", epj_ctx_error(ctx));
	return e;
}

/* Engine config: SGD lr 1.0 (the parity harness' update), options. */
static void engine_json(char *buf, size_t n, bool autoep, bool ckpt, bool bf16)
{
	snprintf(buf, n,
		 "{\"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": "
		 "1.0}}, \"bf16\": {\"enabled\": %s}, "
		 "\"activation_checkpointing\": {\"enabled\": %s}, "
		 "\"compile\": {\"autoep_non_moe\": %s}}",
		 bf16 ? "true" : "false", ckpt ? "true" : "false",
		 autoep ? "true" : "false");
}

static void batch(epj_ctx *ctx, int64_t B, int64_t T, epj_tensor **ids,
		  epj_tensor **labels)
{
	int64_t shp[2] = { B, T };
	*ids = epj_randint(ctx, EPJ_DTYPE_I64, 2, shp, 0, 64);
	*labels = epj_randint(ctx, EPJ_DTYPE_I64, 2, shp, 0, 64);
	tu_ok(ctx, *ids);
	tu_ok(ctx, *labels);
}

/* Forward (loss) + backward; returns the loss. */
static double fwd_bwd(epj_ctx *ctx, epj_model *m, epj_tensor *ids,
		      epj_tensor *labels)
{
	epj_tensor *loss = NULL;
	epj_status st = epj_model_forward(ctx, m, ids, labels, NULL, &loss);
	ck_assert_msg(st == EPJ_OK, "forward: %s", epj_ctx_error(ctx));
	double v = epj_tensor_get_f64(loss, 0);
	st = epj_backward(ctx, loss, NULL);
	ck_assert_msg(st == EPJ_OK, "backward: %s", epj_ctx_error(ctx));
	epj_tensor_free(loss);
	ck_assert_msg(isfinite(v), "loss %g", v);
	return v;
}

static void zero_grads(epj_model *m)
{
	for (int i = 0; i < epj_model_num_params(m); i++)
		epj_tensor_set_grad(epj_model_param(m, i), NULL);
}

static void assert_loss_close(double a, double b, const char *what)
{
	ck_assert_msg(fabs(a - b) <= ATOL + RTOL * fabs(b),
		      "%s: loss %.9g vs eager %.9g", what, a, b);
}

/* Every parameter's gradient of a (compiled) against b (eager). */
static void assert_grads_close(epj_ctx *ctx, epj_model *a, epj_model *b,
			       double rtol, double atol, const char *what)
{
	ck_assert_int_eq(epj_model_num_params(a), epj_model_num_params(b));
	for (int i = 0; i < epj_model_num_params(a); i++) {
		epj_tensor *ga = epj_tensor_grad(epj_model_param(a, i));
		epj_tensor *gb = epj_tensor_grad(epj_model_param(b, i));
		char nm[256];
		snprintf(nm, sizeof nm, "%s: grad %s", what,
			 epj_model_param_name(a, i));
		ck_assert_msg((ga == NULL) == (gb == NULL),
			      "%s: present in one model only", nm);
		if (ga)
			tu_assert_tensors_close(ctx, ga, gb, rtol, atol, nm);
	}
}

static void assert_params_close(epj_ctx *ctx, epj_model *a, epj_model *b,
				double rtol, double atol, const char *what)
{
	for (int i = 0; i < epj_model_num_params(a); i++) {
		char nm[256];
		snprintf(nm, sizeof nm, "%s: param %s", what,
			 epj_model_param_name(a, i));
		tu_assert_tensors_close(ctx, epj_model_param(a, i),
					epj_model_param(b, i), rtol, atol, nm);
	}
}

/* Routing assignments of every AutoEP layer must be identical. */
static void assert_routing_equal(epj_ctx *ctx, epj_model *a, epj_model *b,
				 const char *what)
{
	ck_assert_int_eq(a->n_moe, b->n_moe);
	for (int i = 0; i < a->n_moe; i++) {
		epj_tensor *ra = epj_module_routing(a->moe[i]);
		epj_tensor *rb = epj_module_routing(b->moe[i]);
		ck_assert_ptr_nonnull(ra);
		ck_assert_ptr_nonnull(rb);
		ck_assert_int_eq(epj_tensor_numel(ra), epj_tensor_numel(rb));
		double *va = tu_values(ctx, ra), *vb = tu_values(ctx, rb);
		for (int64_t k = 0; k < epj_tensor_numel(ra); k++)
			ck_assert_msg(va[k] == vb[k],
				      "%s: routing of %s differs at %lld", what,
				      a->moe[i]->name, (long long)k);
		free(va);
		free(vb);
	}
}

static int64_t ctr(epj_ctx *ctx, const char *name)
{
	return epj_counter_get(ctx, name);
}

static void compile_ok(epj_engine *e)
{
	epj_status st = epj_engine_compile(e);
	ck_assert_msg(st == EPJ_OK, "compile: %s", epj_ctx_error(e->ctx));
}

/* ---- module snapshots (rollback, "nothing changed") ---------------------- */

typedef struct mod_snap {
	epj_module *m;
	ej_forward_fn forward, orig;
	void *compiled;
	void (*compiled_free)(void *);
} mod_snap;

typedef struct snap {
	mod_snap v[512];
	int n;
} snap;

static void snap_walk(snap *s, epj_module *m)
{
	ck_assert_int_lt(s->n, 512);
	s->v[s->n++] = (mod_snap){ m, m->forward, m->orig_forward, m->compiled,
				   m->compiled_free };
	for (int i = 0; i < m->n_children; i++)
		snap_walk(s, m->children[i]);
}

static void snap_take(snap *s, epj_module *root)
{
	s->n = 0;
	snap_walk(s, root);
}

static void snap_assert_same(const snap *s, epj_module *root, const char *what)
{
	snap now;
	snap_take(&now, root);
	ck_assert_int_eq(now.n, s->n);
	for (int i = 0; i < s->n; i++) {
		const mod_snap *a = &s->v[i], *b = &now.v[i];
		ck_assert_msg(a->m == b->m && a->forward == b->forward &&
				  a->orig == b->orig &&
				  a->compiled == b->compiled &&
				  a->compiled_free == b->compiled_free,
			      "%s: module \"%s\" changed", what, a->m->name);
	}
}

/* ---- data-driven cases ----------------------------------------------------
 * t/compile_cases/<case>/
 *   ds.json   the DeepSpeed config given to the engine
 *   model     optional: the word "root" (root layout of the tiny model) or
 *             a model config.json (HF keys); default: the tiny model, nested
 *   backend   optional: a compile.backend value set on the engine's config
 *             after initialize (for names the config parser itself refuses)
 *   error     line 1: the message's start; further lines: substrings
 *   error-no-nvrtc  optional: the same, in a build without NVRTC (no CUDA
 *             toolkit at configure time), where a case's message differs
 *   ok        line 1 "mode <m>", line 2 "regions <n>", then one region name
 *             per line ("<root>" for the root)
 *   init_error  optional: the config names a feature epjit does not
 *             implement (e.g. "deepep", ZeRO-3): epj_engine_initialize must
 *             refuse it with a message containing each line, containing
 *             "is not implemented in epjit" and not beginning with the
 *             compile contract's "compile.autoep_non_moe"; the compile-time
 *             check is then tested by initializing with defaults and
 *             assigning the parsed config to the engine.
 * Without init_error, initialize must accept the config and, for an error
 * case, the engine must train one step eagerly before compile refuses:
 * options that only concern compilation are checked at compile, as
 * DeepSpeed's engine.compile() does. */

/* Lines of a file without their newline (NULL-terminated array). */
static char **read_lines(const char *path, int *n)
{
	FILE *f = fopen(path, "r");
	*n = 0;
	if (!f)
		return NULL;
	char **v = calloc(64, sizeof *v);
	char buf[1024];
	while (v && *n < 63 && fgets(buf, sizeof buf, f)) {
		size_t l = strlen(buf);
		while (l && (buf[l - 1] == '\n' || buf[l - 1] == '\r'))
			buf[--l] = 0;
		v[(*n)++] = strdup(buf);
	}
	fclose(f);
	return v;
}

static void free_lines(char **v, int n)
{
	for (int i = 0; v && i < n; i++)
		free(v[i]);
	free(v);
}

/* Runs one case; returns false with a line in fails. */
static bool run_case(const char *dir, const char *name, char *fails, size_t nf)
{
	char base[2048], p_ds[2200], p_model[2200], p_backend[2200],
	    p_err[2200], p_ok[2200], p_init[2200];
	snprintf(base, sizeof base, "%s/%s", dir, name);
	snprintf(p_ds, sizeof p_ds, "%s/ds.json", base);
	snprintf(p_model, sizeof p_model, "%s/model", base);
	snprintf(p_backend, sizeof p_backend, "%s/backend", base);
	snprintf(p_err, sizeof p_err, "%s/error", base);
#ifndef HAVE_NVRTC
	{
		char p_alt[sizeof p_err];
		snprintf(p_alt, sizeof p_alt, "%s/error-no-nvrtc", base);
		if (tu_exists(p_alt))
			snprintf(p_err, sizeof p_err, "%s", p_alt);
	}
#endif
	snprintf(p_ok, sizeof p_ok, "%s/ok", base);
	snprintf(p_init, sizeof p_init, "%s/init_error", base);
	bool want_err = tu_exists(p_err), want_ok = tu_exists(p_ok);
	bool want_init_err = tu_exists(p_init);
	if (!tu_exists(p_ds) || want_err == want_ok) {
		tu_report(fails, nf, "%s: needs ds.json and one of error, ok\n",
			  name);
		return false;
	}
	int n_exp = 0;
	char **exp = read_lines(want_err ? p_err : p_ok, &n_exp);
	if (!exp || n_exp < 1 || !exp[0][0]) {
		tu_report(fails, nf, "%s: empty expectation\n", name);
		free_lines(exp, n_exp);
		return false;
	}
	epj_ctx *ctx = tu_ctx();
	epj_layout layout = EPJ_LAYOUT_NESTED;
	const char *cfg_path = NULL;
	if (tu_exists(p_model)) {
		int nl = 0;
		char **ml = read_lines(p_model, &nl);
		if (nl >= 1 && !strcmp(ml[0], "root"))
			layout = EPJ_LAYOUT_ROOT;
		else
			cfg_path = p_model;
		free_lines(ml, nl);
	}
	epj_model *m = model_new(ctx, layout, cfg_path, 7);
	epj_engine *e = NULL;
	bool ok = true;
	epj_status ist = epj_engine_initialize(ctx, m, p_ds, &e);
	if (want_init_err) {
		/* a feature epjit does not implement: refused at initialize,
		 * in words distinct from the compile contract's */
		int n_ie = 0;
		char **ie = read_lines(p_init, &n_ie);
		const char *msg = epj_ctx_error(ctx);
		bool good = ist != EPJ_OK && n_ie >= 1 &&
			    strstr(msg, "is not implemented in epjit") &&
			    strncmp(msg, "compile.autoep_non_moe", 22) != 0;
		for (int i = 0; good && i < n_ie; i++)
			good = strstr(msg, ie[i]) != NULL;
		if (!good) {
			tu_report(fails, nf,
				  "%s: want initialize to refuse \"%s\" (not "
				  "implemented in epjit), got %s \"%s\"\n",
				  name, n_ie ? ie[0] : "?",
				  epj_status_name(ist), msg);
			ok = false;
		}
		free_lines(ie, n_ie);
		epj_engine_free(e);
		e = NULL;
		/* test the compile-time check on the parsed config */
		ej_config cfg;
		if (ok && ej_config_load(ctx, p_ds, &cfg) != EPJ_OK) {
			tu_report(fails, nf, "%s: ds.json: %s\n", name,
				  epj_ctx_error(ctx));
			ok = false;
		} else if (ok) {
			e = engine_new(ctx, m, "{}");
			e->cfg = cfg;
		}
	} else if (ist != EPJ_OK) {
		tu_report(fails, nf,
			  "%s: initialize refused a config that only compile "
			  "may refuse: %s\n",
			  name, epj_ctx_error(ctx));
		ok = false;
	} else if (want_err) {
		/* a compile-only option: the engine trains eagerly */
		epj_tensor *ids, *labels;
		batch(ctx, 2, 5, &ids, &labels);
		epj_step_info info;
		if (epj_engine_train_step(e, ids, labels, &info) != EPJ_OK ||
		    strcmp(epj_engine_compile_mode(e), "none") != 0) {
			tu_report(fails, nf,
				  "%s: eager train step before compile: %s\n",
				  name, epj_ctx_error(ctx));
			ok = false;
		}
		epj_tensor_free(ids);
		epj_tensor_free(labels);
	}
	if (ok && tu_exists(p_backend)) {
		int nl = 0;
		char **bl = read_lines(p_backend, &nl);
		snprintf(e->cfg.compile.backend, sizeof e->cfg.compile.backend,
			 "%s", nl ? bl[0] : "");
		free_lines(bl, nl);
	}
	if (ok) {
		snap before;
		snap_take(&before, m->root);
		epj_ctx_clear_error(ctx);
		epj_status st = epj_engine_compile(e);
		const char *msg = epj_ctx_error(ctx);
		if (want_err) {
			bool good = st != EPJ_OK &&
				    !strncmp(msg, exp[0], strlen(exp[0]));
			for (int i = 1; good && i < n_exp; i++)
				good = strstr(msg, exp[i]) != NULL;
			/* option on: every message starts with it; off: none */
			const char *pfx = "compile.autoep_non_moe=true";
			if (good && (e->cfg.compile.autoep_non_moe !=
				     !strncmp(msg, pfx, strlen(pfx))))
				good = false;
			if (!good) {
				tu_report(fails, nf,
					  "%s: want error \"%s\"..., got %s "
					  "\"%s\"\n",
					  name, exp[0], epj_status_name(st),
					  msg);
				ok = false;
			} else if (epj_engine_num_regions(e) != 0 ||
				   strcmp(epj_engine_compile_mode(e), "none")) {
				tu_report(fails, nf,
					  "%s: failed compile left a mode\n",
					  name);
				ok = false;
			} else {
				snap_assert_same(&before, m->root, name);
			}
		} else if (st != EPJ_OK) {
			tu_report(fails, nf, "%s: compile failed: %s\n", name,
				  msg);
			ok = false;
		} else {
			char got[1024];
			int nr = epj_engine_num_regions(e);
			snprintf(got, sizeof got, "mode %s",
				 epj_engine_compile_mode(e));
			bool good = !strcmp(got, exp[0]);
			snprintf(got, sizeof got, "regions %d", nr);
			good = good && n_exp >= 2 && !strcmp(got, exp[1]) &&
			       n_exp == 2 + nr;
			for (int i = 0; good && i < nr; i++) {
				const char *rn = epj_engine_region_name(e, i);
				good =
				    !strcmp(rn[0] ? rn : "<root>", exp[2 + i]);
			}
			if (!good) {
				tu_report(fails, nf,
					  "%s: mode/regions differ from ok "
					  "(mode %s, %d regions)\n",
					  name, epj_engine_compile_mode(e), nr);
				ok = false;
			} else {
				/* and it runs: one eval of a small batch */
				epj_tensor *ids, *labels;
				batch(ctx, 2, 5, &ids, &labels);
				double l = NAN;
				if (epj_engine_eval(e, ids, labels, &l) !=
					EPJ_OK ||
				    !isfinite(l)) {
					tu_report(
					    fails, nf,
					    "%s: eval after compile: %s\n",
					    name, epj_ctx_error(ctx));
					ok = false;
				}
				epj_tensor_free(ids);
				epj_tensor_free(labels);
			}
		}
	}
	epj_engine_free(e);
	/* the engine restored every module */
	snap after;
	snap_take(&after, m->root);
	for (int i = 0; i < after.n; i++)
		if (after.v[i].m->orig_forward || after.v[i].m->compiled) {
			tu_report(fails, nf,
				  "%s: engine free left \"%s\" wrapped\n", name,
				  after.v[i].m->name);
			ok = false;
		}
	epj_model_free(m);
	epj_ctx_free(ctx);
	free_lines(exp, n_exp);
	return ok;
}

START_TEST(test_compile_cases)
{
	/* the cases assume a machine without a CUDA driver (the nvrtc
	 * backend's refusal names this path) */
	setenv("EPJIT_CUDA_DRIVER", "/nonexistent/epjit/libcuda.so.1", 1);
	char dir[1024];
	snprintf(dir, sizeof dir, "%s/t/compile_cases", tu_srcdir());
	char **names = NULL;
	int n = tu_list_dir(dir, true, &names);
	ck_assert_msg(n >= 0, "compile case folder %s is missing", dir);
	ck_assert_msg(n >= 20, "compile case folder %s has only %d cases", dir,
		      n);
	static char fails[16384];
	fails[0] = 0;
	int nfail = 0;
	for (int i = 0; i < n; i++) {
		if (!run_case(dir, names[i], fails, sizeof fails))
			nfail++;
	}
	tu_free_names(names, n);
	/* every failure on stderr; Check's message holds about 4 KiB */
	if (nfail)
		fputs(fails, stderr);
	ck_assert_msg(nfail == 0, "%d of %d compile cases failed:\n%.3000s",
		      nfail, n, fails);
}
END_TEST

/* ---- discovery ----------------------------------------------------------- */

START_TEST(test_discovery_layouts)
{
	epj_ctx *ctx = tu_ctx();
	char js[512];
	/* nested, autoep_non_moe: the decoder blocks */
	epj_model *m = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, 3);
	engine_json(js, sizeof js, true, false, false);
	epj_engine *e = engine_new(ctx, m, js);
	ck_assert_str_eq(epj_engine_compile_mode(e), "none");
	ck_assert_int_eq(epj_engine_num_regions(e), 0);
	ck_assert_ptr_null(epj_engine_region_name(e, 0));
	epj_module *b0 = epj_module_find(m->root, "model.layers.0");
	ej_forward_fn fwd0 = b0->forward;
	compile_ok(e);
	ck_assert_str_eq(epj_engine_compile_mode(e), "autoep_non_moe");
	ck_assert_int_eq(epj_engine_num_regions(e), 2);
	ck_assert_str_eq(epj_engine_region_name(e, 0), "model.layers.0");
	ck_assert_str_eq(epj_engine_region_name(e, 1), "model.layers.1");
	ck_assert_ptr_null(epj_engine_region_name(e, 2));
	ck_assert_ptr_null(epj_engine_region_name(e, -1));
	ck_assert(b0->orig_forward == fwd0 && b0->forward != fwd0);
	ck_assert_ptr_nonnull(b0->compiled);
	/* the root and the AutoEP layers are untouched */
	ck_assert_ptr_null(m->root->orig_forward);
	ck_assert_ptr_null(m->moe[0]->orig_forward);
	/* compile again, same mode: no-op */
	void *state = e->compiled;
	compile_ok(e);
	ck_assert_ptr_eq(e->compiled, state);
	ck_assert_int_eq(epj_engine_num_regions(e), 2);
	/* the mode cannot change */
	e->cfg.compile.autoep_non_moe = false;
	ck_assert_int_eq(epj_engine_compile(e), EPJ_ERR_STATE);
	ck_assert_str_eq(epj_ctx_error(ctx),
			 "Engine is already compiled; compile.autoep_non_moe "
			 "cannot be changed after compilation.");
	ck_assert_str_eq(epj_engine_compile_mode(e), "autoep_non_moe");
	ck_assert_int_eq(epj_engine_num_regions(e), 2);
	e->cfg.compile.autoep_non_moe = true;
	/* a second engine on the same model finds the regions compiled */
	epj_engine *e2 = engine_new(ctx, m, js);
	snap before;
	snap_take(&before, m->root);
	ck_assert_int_eq(epj_engine_compile(e2), EPJ_ERR_STATE);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "already compiled"));
	ck_assert(
	    !strncmp(epj_ctx_error(ctx), "compile.autoep_non_moe=true", 27));
	snap_assert_same(&before, m->root, "second engine");
	epj_engine_free(e2);
	/* engine free restores */
	epj_engine_free(e);
	ck_assert(b0->forward == fwd0 && !b0->orig_forward && !b0->compiled &&
		  !b0->compiled_free);
	epj_model_free(m);

	/* root layout, autoep_non_moe: the root is the region */
	m = model_new(ctx, EPJ_LAYOUT_ROOT, NULL, 3);
	e = engine_new(ctx, m, js);
	compile_ok(e);
	ck_assert_int_eq(epj_engine_num_regions(e), 1);
	ck_assert_str_eq(epj_engine_region_name(e, 0), "");
	epj_engine_free(e);
	epj_model_free(m);

	/* full-model mode: one region, the root; mode fixed too */
	m = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, 3);
	engine_json(js, sizeof js, false, false, false);
	e = engine_new(ctx, m, js);
	compile_ok(e);
	ck_assert_str_eq(epj_engine_compile_mode(e), "model");
	ck_assert_int_eq(epj_engine_num_regions(e), 1);
	ck_assert_str_eq(epj_engine_region_name(e, 0), "");
	ck_assert(!epj_module_find(m->root, "model.layers.0")->orig_forward);
	compile_ok(e);
	e->cfg.compile.autoep_non_moe = true;
	ck_assert_int_eq(epj_engine_compile(e), EPJ_ERR_STATE);
	ck_assert_str_eq(epj_ctx_error(ctx),
			 "Engine is already compiled; compile.autoep_non_moe "
			 "cannot be changed after compilation.");
	ck_assert_str_eq(epj_engine_compile_mode(e), "model");
	epj_engine_free(e);
	ck_assert_ptr_null(m->root->orig_forward);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* A hand-built tree (no Qwen3 model): toy forwards on h [B, T, H]. */
#define TOY_H 8

static epj_status toy_blk_forward(epj_ctx *ctx, epj_module *m,
				  epj_tensor *const *in, int n_in,
				  epj_tensor **out, int n_out)
{
	/* a = moe_a(h); b = moe_b(a + h); out = tanh(a) * w + b */
	(void)n_in;
	(void)n_out;
	epj_tensor *a = NULL, *b = NULL;
	epj_status st =
	    ej_module_call(ctx, ej_module_child(m, "moe_a"), in, 1, &a, 1);
	epj_tensor *s = st == EPJ_OK ? epj_add(ctx, a, in[0]) : NULL;
	if (s)
		st = ej_module_call(ctx, ej_module_child(m, "moe_b"), &s, 1, &b,
				    1);
	epj_tensor *t = epj_tanh(ctx, a);
	epj_tensor *tw = epj_mul(ctx, t, ej_module_param(m, "w"));
	out[0] = st == EPJ_OK ? epj_add(ctx, tw, b) : NULL;
	epj_tensor *tmp[] = { a, b, s, t, tw };
	for (int i = 0; i < 5; i++)
		epj_tensor_free(tmp[i]);
	return out[0] ? EPJ_OK : (st ? st : ctx->status);
}

static epj_status toy_root_forward(epj_ctx *ctx, epj_module *m,
				   epj_tensor *const *in, int n_in,
				   epj_tensor **out, int n_out)
{
	/* x = blk(h); y = mlp(x * 0.5); out = silu(y) + x */
	(void)n_in;
	(void)n_out;
	epj_tensor *x = NULL, *y = NULL;
	epj_status st =
	    ej_module_call(ctx, ej_module_child(m, "blk"), in, 1, &x, 1);
	epj_tensor *xs = st == EPJ_OK ? epj_mul_scalar(ctx, x, 0.5) : NULL;
	if (xs)
		st = ej_module_call(ctx, ej_module_child(m, "mlp"), &xs, 1, &y,
				    1);
	epj_tensor *sy = st == EPJ_OK ? epj_silu(ctx, y) : NULL;
	out[0] = epj_add(ctx, sy, x);
	epj_tensor *tmp[] = { x, y, xs, sy };
	for (int i = 0; i < 4; i++)
		epj_tensor_free(tmp[i]);
	return out[0] ? EPJ_OK : (st ? st : ctx->status);
}

static epj_module *toy_autoep(epj_ctx *ctx, epj_module *parent,
			      const char *local)
{
	ej_autoep_opts o = { .num_experts = 3,
			     .top_k = 2,
			     .norm_topk_prob = true };
	epj_module *a = ej_autoep_new(ctx, parent, local, TOY_H, 5, &o,
				      EPJ_DTYPE_F32, 0.3, NULL);
	tu_ok(ctx, a);
	return a;
}

/* A model and an engine around a hand-built root (no optimizer: compile
 * needs only ctx, model->root and cfg). */
typedef struct toy {
	epj_model model;
	epj_engine e;
} toy;

static void toy_init(toy *t, epj_ctx *ctx, epj_module *root)
{
	memset(t, 0, sizeof *t);
	t->model.root = root;
	t->e.ctx = ctx;
	t->e.model = &t->model;
	ej_config_defaults(&t->e.cfg);
	t->e.cfg.compile.autoep_non_moe = true;
}

START_TEST(test_discovery_refusals)
{
	epj_ctx *ctx = tu_ctx();
	/* AutoEP layer under a ModuleList (no forward) */
	epj_module *root = ej_module_new(NULL, "", "ToyLM", toy_root_forward);
	epj_module *list = ej_module_new(root, "layers", "ModuleList", NULL);
	toy_autoep(ctx, list, "0");
	toy t;
	toy_init(&t, ctx, root);
	snap before;
	snap_take(&before, root);
	/* DeepSpeed's order: fullgraph and dynamic before each layer's
	 * region */
	t.e.cfg.compile.fullgraph = EJ_JSON_TRUE;
	ck_assert_int_eq(epj_engine_compile(&t.e), EPJ_ERR_CONFIG);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "requires fullgraph=False"), "%s", msg);
	t.e.cfg.compile.fullgraph = EJ_JSON_FALSE;
	ck_assert_int_eq(epj_engine_compile(&t.e), EPJ_ERR_UNSUPPORTED);
	msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "AutoEP compile region 'layers' has no "
				  "forward implementation. The MoE layer must "
				  "be a direct child of a callable module") &&
			  !strncmp(msg, "compile.autoep_non_moe=true", 27),
		      "%s", msg);
	snap_assert_same(&before, root, "ModuleList parent");
	ck_assert_int_eq(epj_engine_num_regions(&t.e), 0);
	ej_engine_compile_free(&t.e);
	ej_module_free(root);

	/* the AutoEP layer is the model root */
	root = toy_autoep(ctx, NULL, "");
	toy_init(&t, ctx, root);
	ck_assert_int_eq(epj_engine_compile(&t.e), EPJ_ERR_UNSUPPORTED);
	msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "cannot compile an AutoEPMoELayer at the "
				  "model root") &&
			  strstr(msg, "no surrounding region") &&
			  !strncmp(msg, "compile.autoep_non_moe=true", 27),
		      "%s", msg);
	ck_assert_ptr_null(root->orig_forward);
	/* full-model mode refuses it too (nothing around it to trace) */
	t.e.cfg.compile.autoep_non_moe = false;
	ck_assert_int_ne(epj_engine_compile(&t.e), EPJ_OK);
	ck_assert_ptr_null(root->orig_forward);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* Nested regions and two breaks in one region: root (callable) has a block
 * with two AutoEP children, then an AutoEP child of its own -> regions
 * "blk", "" (deduplicated, in the order of their first AutoEP child in
 * named_modules(), as DeepSpeed lists them); the block is inlined into the
 * root's trace. */
START_TEST(test_nested_regions_parity)
{
	epj_ctx *ctx = tu_ctx();
	epj_module *root = ej_module_new(NULL, "", "ToyLM", toy_root_forward);
	epj_module *blk =
	    ej_module_new(root, "blk", "ToyBlock", toy_blk_forward);
	int64_t H = TOY_H;
	ej_module_add_param(blk, "w",
			    epj_randn(ctx, EPJ_DTYPE_F32, 1, &H, 1.0, 0.5));
	toy_autoep(ctx, blk, "moe_a");
	toy_autoep(ctx, blk, "moe_b");
	toy_autoep(ctx, root, "mlp");
	ej_param_list pl;
	ck_assert_int_eq(ej_module_params(ctx, root, &pl), EPJ_OK);
	int64_t shp[3] = { tu_randint(1, 3), tu_randint(3, 8), H };
	epj_tensor *h = tu_randn(ctx, EPJ_DTYPE_F32, 3, shp);
	epj_tensor_set_requires_grad(h, true);
	/* eager reference: output, input grad, every parameter grad */
	epj_tensor *y0 = NULL;
	ck_assert_int_eq(ej_module_call(ctx, root, &h, 1, &y0, 1), EPJ_OK);
	epj_tensor *w = tu_randn(ctx, EPJ_DTYPE_F32, 3, shp);
	epj_tensor *yw = epj_mul(ctx, y0, w);
	epj_tensor *l = epj_sum_all(ctx, yw);
	ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
	epj_tensor **g0 = calloc((size_t)pl.n + 1, sizeof *g0);
	for (int i = 0; i < pl.n; i++) {
		g0[i] = epj_tensor_ref(epj_tensor_grad(pl.params[i]));
		epj_tensor_set_grad(pl.params[i], NULL);
	}
	epj_tensor *gh0 = epj_tensor_ref(epj_tensor_grad(h));
	epj_tensor_set_grad(h, NULL);
	epj_tensor_free(yw);
	epj_tensor_free(l);

	toy t;
	toy_init(&t, ctx, root);
	compile_ok(&t.e);
	ck_assert_int_eq(epj_engine_num_regions(&t.e), 2);
	ck_assert_str_eq(epj_engine_region_name(&t.e, 0), "blk");
	ck_assert_str_eq(epj_engine_region_name(&t.e, 1), "");
	int64_t ft = ctr(ctx, "frames.total"),
		gb = ctr(ctx, "graph_break.autoep");
	for (int rep = 0; rep < 2; rep++) {
		epj_tensor *y1 = NULL;
		ck_assert_msg(ej_module_call(ctx, root, &h, 1, &y1, 1) ==
				  EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		tu_assert_tensors_close(ctx, y1, y0, RTOL, ATOL, "toy output");
		yw = epj_mul(ctx, y1, w);
		l = epj_sum_all(ctx, yw);
		ck_assert_int_eq(epj_backward(ctx, l, NULL), EPJ_OK);
		tu_assert_tensors_close(ctx, epj_tensor_grad(h), gh0, RTOL,
					ATOL, "toy input grad");
		for (int i = 0; i < pl.n; i++) {
			/* an expert that received no token has no gradient,
			 * eagerly and compiled alike (same routing) */
			if (!g0[i]) {
				ck_assert_msg(
				    epj_tensor_grad(pl.params[i]) == NULL,
				    "grad for %s, none eagerly", pl.names[i]);
				continue;
			}
			ck_assert_msg(epj_tensor_grad(pl.params[i]) != NULL,
				      "no grad for %s", pl.names[i]);
			tu_assert_tensors_close(ctx,
						epj_tensor_grad(pl.params[i]),
						g0[i], RTOL, ATOL, pl.names[i]);
			epj_tensor_set_grad(pl.params[i], NULL);
		}
		epj_tensor_set_grad(h, NULL);
		epj_tensor_free(y1);
		epj_tensor_free(yw);
		epj_tensor_free(l);
	}
	/* one trace (the root; blk inlined), three breaks, no recompile */
	ck_assert_int_eq(ctr(ctx, "frames.total") - ft, 1);
	ck_assert_int_eq(ctr(ctx, "graph_break.autoep") - gb, 3);
	ej_engine_compile_free(&t.e);
	ck_assert_ptr_null(root->orig_forward);
	ck_assert_ptr_null(blk->orig_forward);
	for (int i = 0; i < pl.n; i++)
		epj_tensor_free(g0[i]);
	free(g0);
	epj_tensor_free(gh0);
	epj_tensor_free(y0);
	epj_tensor_free(w);
	epj_tensor_free(h);
	ej_param_list_free(&pl);
	ej_module_free(root);
	epj_ctx_free(ctx);
}
END_TEST

/* Region order: DeepSpeed lists a region when it meets its first AutoEP
 * child in named_modules() (pre-order), not where the region itself sits in
 * the tree, so a root whose AutoEP child follows a block comes after the
 * block, and before it when the AutoEP child comes first. */
START_TEST(test_region_order)
{
	epj_ctx *ctx = tu_ctx();
	for (int mlp_first = 0; mlp_first < 2; mlp_first++) {
		epj_module *root =
		    ej_module_new(NULL, "", "ToyLM", toy_root_forward);
		if (mlp_first)
			toy_autoep(ctx, root, "mlp");
		epj_module *blk =
		    ej_module_new(root, "blk", "ToyBlock", toy_blk_forward);
		toy_autoep(ctx, blk, "moe_a");
		toy_autoep(ctx, blk, "moe_b");
		if (!mlp_first)
			toy_autoep(ctx, root, "mlp");
		toy t;
		toy_init(&t, ctx, root);
		compile_ok(&t.e);
		ck_assert_int_eq(epj_engine_num_regions(&t.e), 2);
		ck_assert_str_eq(epj_engine_region_name(&t.e, 0),
				 mlp_first ? "" : "blk");
		ck_assert_str_eq(epj_engine_region_name(&t.e, 1),
				 mlp_first ? "blk" : "");
		ej_engine_compile_free(&t.e);
		ej_module_free(root);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- DeepSpeed's messages -------------------------------------------------
 * DeepSpeed's own tests (tests/unit/moe/test_autoep_unit.py of PR #8380)
 * match each rejection with a regex (pytest.raises(match=...), re.search).
 * Every one of them must match epjit's message, here as a POSIX extended
 * regex (the same patterns: none uses a Python-only construct). */

/* The compile message of case `name` (t/compile_cases/<name>); a config that
 * initialize refuses is assigned to an engine made with defaults. */
static void case_compile_message(const char *name, char *msg, size_t n)
{
	char dir[2048], p_ds[2200], p_model[2200];
	snprintf(dir, sizeof dir, "%s/t/compile_cases/%s", tu_srcdir(), name);
	snprintf(p_ds, sizeof p_ds, "%s/ds.json", dir);
	snprintf(p_model, sizeof p_model, "%s/model", dir);
	ck_assert_msg(tu_exists(p_ds), "no compile case %s", name);
	epj_ctx *ctx = tu_ctx();
	epj_model *m = model_new(ctx, EPJ_LAYOUT_NESTED,
				 tu_exists(p_model) ? p_model : NULL, 7);
	epj_engine *e = NULL;
	if (epj_engine_initialize(ctx, m, p_ds, &e) != EPJ_OK) {
		ej_config cfg;
		ck_assert_msg(ej_config_load(ctx, p_ds, &cfg) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		e = engine_new(ctx, m, "{}");
		e->cfg = cfg;
	}
	ck_assert_msg(epj_engine_compile(e) != EPJ_OK, "case %s compiled",
		      name);
	snprintf(msg, n, "%s", epj_ctx_error(ctx));
	epj_engine_free(e);
	epj_model_free(m);
	epj_ctx_free(ctx);
}

static bool ds_match(const char *regex, const char *msg)
{
	regex_t re;
	int rc = regcomp(&re, regex, REG_EXTENDED | REG_NOSUB);
	ck_assert_msg(rc == 0, "regex %s does not compile", regex);
	rc = regexec(&re, msg, 0, NULL, 0);
	regfree(&re);
	return rc == 0;
}

/* Records a failure in fails unless DeepSpeed's regex matches msg. */
static void ds_expect(char *fails, size_t nf, int *nfail, const char *what,
		      const char *regex, const char *msg)
{
	if (ds_match(regex, msg))
		return;
	tu_report(fails, nf, "%s: /%s/ does not match \"%s\"\n", what, regex,
		  msg);
	(*nfail)++;
}

START_TEST(test_deepspeed_messages)
{
	/* DeepSpeed's test and parameter, its regex, the compile case that
	 * makes the same configuration here */
	static const struct {
		const char *ds_test, *regex, *compile_case;
	} rows[] = {
		{ "engine_rejects deepcompile",
		  "cannot be combined with DeepCompile", "reject_deepcompile" },
		{ "engine_rejects deepep", "comm_backend='comm'",
		  "reject_deepep" },
		{ "engine_rejects autotp", "AutoEP\\+AutoTP folding",
		  "reject_autotp" },
		{ "engine_rejects sequence_parallel", "sequence parallelism",
		  "reject_sequence_parallel" },
		{ "engine_rejects pipeline_parallel", "pipeline parallelism",
		  "reject_pipeline" },
		{ "engine_rejects zero3", "ZeRO Stage 3", "reject_zero3" },
		{ "engine_rejects optimizer_offload",
		  "optimizer or parameter offload",
		  "reject_offload_optimizer_cpu" },
		{ "engine_rejects param_offload",
		  "optimizer or parameter offload",
		  "reject_offload_param_cpu" },
		{ "engine_rejects param_offload (nvme)",
		  "optimizer or parameter offload",
		  "reject_offload_param_nvme" },
		{ "engine_rejects schedule", "DeepCompile schedules",
		  "reject_schedule" },
		{ "engine_rejects compiled_autograd", "compiled autograd",
		  "reject_compiled_autograd" },
		{ "compile_kwargs fullgraph True", "fullgraph=False",
		  "reject_fullgraph_true" },
		{ "compile_kwargs fullgraph None", "fullgraph=False",
		  "reject_fullgraph_null" },
		{ "compile_kwargs dynamic True", "dynamic=False",
		  "reject_dynamic_true" },
		{ "compile_kwargs dynamic None", "dynamic=False",
		  "reject_dynamic_null" },
		{ "model_without_autoep_layers",
		  "requires at least one AutoEPMoELayer", "reject_no_experts" },
		{ "model_without_autoep_layers (mlp_only_layers)",
		  "requires at least one AutoEPMoELayer",
		  "reject_all_mlp_only" },
	};
	static char fails[8192];
	fails[0] = 0;
	int nfail = 0;
	char msg[1024];
	for (size_t i = 0; i < EJ_ARRAY_LEN(rows); i++) {
		char what[256];
		snprintf(what, sizeof what, "%s (%s)", rows[i].ds_test,
			 rows[i].compile_case);
		case_compile_message(rows[i].compile_case, msg, sizeof msg);
		ds_expect(fails, sizeof fails, &nfail, what, rows[i].regex,
			  msg);
	}

	/* the hand-built trees of DeepSpeed's discovery tests */
	epj_ctx *ctx = tu_ctx();
	epj_module *root = toy_autoep(ctx, NULL, "");
	toy t;
	toy_init(&t, ctx, root);
	ck_assert_int_ne(epj_engine_compile(&t.e), EPJ_OK);
	ds_expect(fails, sizeof fails, &nfail, "rejects_bare_autoep_model_root",
		  "AutoEPMoELayer at the model root", epj_ctx_error(ctx));
	ej_module_free(root);
	root = ej_module_new(NULL, "", "ToyLM", toy_root_forward);
	epj_module *list = ej_module_new(root, "layers", "ModuleList", NULL);
	toy_autoep(ctx, list, "0");
	toy_init(&t, ctx, root);
	ck_assert_int_ne(epj_engine_compile(&t.e), EPJ_OK);
	ds_expect(fails, sizeof fails, &nfail,
		  "rejects_non_callable_parent_region",
		  "has no forward implementation", epj_ctx_error(ctx));
	ej_module_free(root);

	/* the mode cannot change once compiled (RuntimeError "already
	 * compiled"); a second engine finds the regions compiled */
	epj_model *m = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, 3);
	char js[512];
	engine_json(js, sizeof js, true, false, false);
	epj_engine *e = engine_new(ctx, m, js);
	compile_ok(e);
	e->cfg.compile.autoep_non_moe = false;
	ck_assert_int_ne(epj_engine_compile(e), EPJ_OK);
	ds_expect(fails, sizeof fails, &nfail, "tracks_regional_compile_mode",
		  "already compiled", epj_ctx_error(ctx));
	e->cfg.compile.autoep_non_moe = true;
	epj_engine *e2 = engine_new(ctx, m, js);
	ck_assert_int_ne(epj_engine_compile(e2), EPJ_OK);
	ds_expect(fails, sizeof fails, &nfail, "region already compiled",
		  "AutoEP compile region 'model\\.layers\\.0' is already "
		  "compiled",
		  epj_ctx_error(ctx));
	epj_engine_free(e2);
	epj_engine_free(e);
	epj_model_free(m);
	epj_ctx_free(ctx);
	if (nfail)
		fputs(fails, stderr);
	ck_assert_msg(nfail == 0,
		      "%d of DeepSpeed's regexes do not match:\n%.3000s", nfail,
		      fails);
}
END_TEST

/* ---- rollback ------------------------------------------------------------ */

START_TEST(test_rollback)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("check-compile");
	char *cfg = write_model_config(dir, 4);
	epj_model *m = model_new(ctx, EPJ_LAYOUT_NESTED, cfg, 11);
	char js[512];
	engine_json(js, sizeof js, true, false, false);
	epj_engine *e = engine_new(ctx, m, js);
	snap before;
	snap_take(&before, m->root);
	for (int k = 0; k < 4; k++) {
		ej_compile_inject_failure(e, k);
		ck_assert_int_eq(epj_engine_compile(e), EPJ_ERR_COMPILE);
		char want[128];
		snprintf(want, sizeof want,
			 "injected compile failure at region %d "
			 "(model.layers.%d)",
			 k, k);
		ck_assert_str_eq(epj_ctx_error(ctx), want);
		ck_assert_str_eq(epj_engine_compile_mode(e), "none");
		ck_assert_int_eq(epj_engine_num_regions(e), 0);
		snap_assert_same(&before, m->root, want);
	}
	/* the model still trains eagerly */
	epj_tensor *ids, *labels;
	batch(ctx, 2, 5, &ids, &labels);
	int64_t ft = ctr(ctx, "frames.total");
	epj_step_info info;
	ck_assert_msg(epj_engine_train_step(e, ids, labels, &info) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert(isfinite(info.loss));
	ck_assert_int_eq(ctr(ctx, "frames.total"), ft);
	/* the hook was consumed: a clean compile succeeds */
	compile_ok(e);
	ck_assert_int_eq(epj_engine_num_regions(e), 4);
	ck_assert_msg(epj_engine_train_step(e, ids, labels, &info) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert(isfinite(info.loss));
	ck_assert_int_eq(ctr(ctx, "frames.total") - ft, 4);
	epj_tensor_free(ids);
	epj_tensor_free(labels);
	epj_engine_free(e);
	snap_assert_same(&before, m->root, "after engine free");
	epj_model_free(m);
	free(cfg);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- execution: compiled vs eager ---------------------------------------- */

typedef struct pcase {
	epj_layout layout;
	bool ckpt;
	bool autoep; /* else full-model mode */
} pcase;

static const pcase pcases[] = {
	{ EPJ_LAYOUT_NESTED, false, true },  { EPJ_LAYOUT_NESTED, true, true },
	{ EPJ_LAYOUT_ROOT, false, true },    { EPJ_LAYOUT_ROOT, true, true },
	{ EPJ_LAYOUT_NESTED, false, false }, { EPJ_LAYOUT_NESTED, true, false },
	{ EPJ_LAYOUT_ROOT, false, false },   { EPJ_LAYOUT_ROOT, true, false },
};

START_TEST(test_parity)
{
	const pcase *pc = &pcases[_i];
	char what[128];
	snprintf(what, sizeof what, "%s layout, checkpointing %s, mode %s",
		 pc->layout == EPJ_LAYOUT_ROOT ? "root" : "nested",
		 pc->ckpt ? "on" : "off",
		 pc->autoep ? "autoep_non_moe" : "model");
	epj_ctx *ctx = tu_ctx();
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	epj_model *ma = model_new(ctx, pc->layout, NULL, seed);
	epj_model *mb = model_new(ctx, pc->layout, NULL, seed);
	char js[512];
	engine_json(js, sizeof js, pc->autoep, pc->ckpt, false);
	epj_engine *ea = engine_new(ctx, ma, js);
	epj_engine *eb = engine_new(ctx, mb, js);
	compile_ok(ea);
	int R = epj_engine_num_regions(ea);
	int n_moe = ma->n_moe;
	ck_assert_int_eq(
	    R, pc->autoep && pc->layout == EPJ_LAYOUT_NESTED ? n_moe : 1);
	/* Does checkpointing apply to the compiled region itself?  Not in
	 * full-model mode of the nested layout: there the checkpointed blocks
	 * become graph breaks of the root's graph and run eagerly with their
	 * checkpointing (module.c), so AutoEP is still replayed. */
	bool region_ckpt =
	    pc->ckpt && (pc->autoep || pc->layout == EPJ_LAYOUT_ROOT);
	int variants = region_ckpt ? 2 : 1;
	int64_t B = tu_randint(1, 3), T = 2 * tu_randint(2, 5) + 1;
	int64_t ft0 = ctr(ctx, "frames.total"), fo0 = ctr(ctx, "frames.ok");
	int64_t rc0 = ctr(ctx, "recompiles");
	int64_t ug1 = 0, cc1 = 0, ft1 = 0, rc1 = 0;
	for (int step = 0; step < 2; step++) {
		epj_tensor *ids, *labels;
		batch(ctx, B, T, &ids, &labels);
		int64_t af = ctr(ctx, "autoep.calls.forward");
		int64_t ar = ctr(ctx, "autoep.calls.replay");
		int64_t kc0 = ctr(ctx, "kernels.launched.compiled");
		epj_region_stats rs0[8];
		ck_assert_int_le(R, 8);
		for (int i = 0; i < R; i++)
			ck_assert(epj_engine_region_stats(ea, i, &rs0[i]) ==
				  EPJ_OK);
		double la = fwd_bwd(ctx, ma, ids, labels);
		int64_t daf = ctr(ctx, "autoep.calls.forward") - af;
		int64_t dar = ctr(ctx, "autoep.calls.replay") - ar;
		int64_t kc1 = ctr(ctx, "kernels.launched.compiled");
		double lb = fwd_bwd(ctx, mb, ids, labels);
		/* which arm ran compiled code: the compiled model launched
		 * compiled kernels in every region and fell back nowhere; the
		 * eager model launched none */
		ck_assert_int_gt(kc1 - kc0, 0);
		ck_assert_int_eq(ctr(ctx, "kernels.launched.compiled"), kc1);
		for (int i = 0; i < R; i++) {
			epj_region_stats rs;
			ck_assert(epj_engine_region_stats(ea, i, &rs) ==
				  EPJ_OK);
			ck_assert_int_ge(
			    rs.compiled_calls - rs0[i].compiled_calls, 1);
			ck_assert_int_eq(rs.eager_calls, rs0[i].eager_calls);
			ck_assert_int_gt(
			    rs.compiled_launches - rs0[i].compiled_launches, 0);
		}
		assert_loss_close(la, lb, what);
		assert_grads_close(ctx, ma, mb, RTOL, ATOL, what);
		assert_routing_equal(ctx, ma, mb, what);
		/* eager AutoEP calls of the compiled model */
		ck_assert_int_eq(daf, n_moe);
		ck_assert_int_eq(dar, pc->ckpt ? n_moe : 0);
		if (step == 0) {
			ft1 = ctr(ctx, "frames.total");
			rc1 = ctr(ctx, "recompiles");
			ug1 = ctr(ctx, "stats.unique_graphs");
			cc1 = ctr(ctx, "stats.calls_captured");
			ck_assert_int_eq(ft1 - ft0, (int64_t)R * variants);
			ck_assert_int_eq(ctr(ctx, "frames.ok") - fo0,
					 (int64_t)R * variants);
			ck_assert_int_eq(rc1 - rc0,
					 (int64_t)R * (variants - 1));
			ck_assert_int_gt(ctr(ctx, "graph_break.autoep") +
					     ctr(ctx, "graph_break.checkpoint"),
					 0);
		} else {
			/* the measured step: no compile counter moves */
			ck_assert_int_eq(ctr(ctx, "frames.total"), ft1);
			ck_assert_int_eq(ctr(ctx, "recompiles"), rc1);
			ck_assert_int_eq(ctr(ctx, "stats.unique_graphs"), ug1);
			ck_assert_int_eq(ctr(ctx, "stats.calls_captured"), cc1);
		}
		zero_grads(ma);
		zero_grads(mb);
		epj_tensor_free(ids);
		epj_tensor_free(labels);
	}
	/* one engine step each (SGD, lr 1.0): same updated parameters */
	epj_tensor *ids, *labels;
	batch(ctx, B, T, &ids, &labels);
	epj_step_info ia, ib;
	ck_assert_msg(epj_engine_train_step(ea, ids, labels, &ia) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert_msg(epj_engine_train_step(eb, ids, labels, &ib) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	assert_loss_close(ia.loss, ib.loss, what);
	assert_params_close(ctx, ma, mb, RTOL, ATOL, what);
	ck_assert_int_eq(ctr(ctx, "frames.total"), ft1);
	epj_tensor_free(ids);
	epj_tensor_free(labels);
	epj_engine_free(ea);
	epj_engine_free(eb);
	epj_model_free(ma);
	epj_model_free(mb);
	epj_ctx_free(ctx);
}
END_TEST

/* bf16 parameters (engine bf16.enabled): same kernels, so the compiled
 * forward still matches; gradients within bf16 rounding of the joint graph's
 * summation order. */
START_TEST(test_parity_bf16)
{
	epj_ctx *ctx = tu_ctx();
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	for (int layout = 0; layout < 2; layout++) {
		epj_model *ma = model_new(ctx, (epj_layout)layout, NULL, seed);
		epj_model *mb = model_new(ctx, (epj_layout)layout, NULL, seed);
		char js[512];
		engine_json(js, sizeof js, true, layout == 1, true);
		epj_engine *ea = engine_new(ctx, ma, js);
		epj_engine *eb = engine_new(ctx, mb, js);
		compile_ok(ea);
		epj_tensor *ids, *labels;
		batch(ctx, 2, 7, &ids, &labels);
		double la = fwd_bwd(ctx, ma, ids, labels);
		double lb = fwd_bwd(ctx, mb, ids, labels);
		ck_assert_msg(fabs(la - lb) <= 1e-3 * fabs(lb),
			      "bf16 loss %g %g", la, lb);
		assert_grads_close(ctx, ma, mb, 2e-2, 1e-3, "bf16");
		assert_routing_equal(ctx, ma, mb, "bf16");
		epj_tensor_free(ids);
		epj_tensor_free(labels);
		epj_engine_free(ea);
		epj_engine_free(eb);
		epj_model_free(ma);
		epj_model_free(mb);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* stats.unique_graphs of an 8-layer model equals that of a 2-layer one. */
START_TEST(test_unique_graphs_depth)
{
	char *dir = tu_tmpdir_new("check-compile");
	char *cfg8 = write_model_config(dir, 8);
	int64_t ug[2], ft[2];
	for (int k = 0; k < 2; k++) {
		epj_ctx *ctx = tu_ctx();
		epj_model *m =
		    model_new(ctx, EPJ_LAYOUT_NESTED, k ? cfg8 : NULL, 5);
		char js[512];
		engine_json(js, sizeof js, true, false, false);
		epj_engine *e = engine_new(ctx, m, js);
		compile_ok(e);
		ck_assert_int_eq(epj_engine_num_regions(e), k ? 8 : 2);
		epj_tensor *ids, *labels;
		batch(ctx, 2, 5, &ids, &labels);
		fwd_bwd(ctx, m, ids, labels);
		ug[k] = ctr(ctx, "stats.unique_graphs");
		ft[k] = ctr(ctx, "frames.total");
		ck_assert_int_eq(ctr(ctx, "graph_break.autoep"), k ? 8 : 2);
		epj_tensor_free(ids);
		epj_tensor_free(labels);
		epj_engine_free(e);
		epj_model_free(m);
		epj_ctx_free(ctx);
	}
	ck_assert_int_gt(ug[0], 0);
	ck_assert_int_eq(ug[1], ug[0]);
	ck_assert_int_eq(ft[0], 2);
	ck_assert_int_eq(ft[1], 8);
	free(cfg8);
	tu_tmpdir_free(dir);
}
END_TEST

/* Sum of profile.<prefix>*.<suffix> in a snapshot. */
static int64_t prof_sum(const epj_counters *c, const char *prefix,
			const char *suffix, int *n_names)
{
	int64_t sum = 0;
	size_t lp = strlen(prefix), ls = strlen(suffix);
	for (int i = 0; i < epj_counters_count(c); i++) {
		const char *nm = epj_counters_name_at(c, i);
		size_t l = strlen(nm);
		if (l > lp + ls && strncmp(nm, prefix, lp) == 0 &&
		    strcmp(nm + l - ls, suffix) == 0) {
			sum += epj_counters_value_at(c, i);
			if (n_names)
				(*n_names)++;
		}
	}
	return sum;
}

/* EPJIT_PROFILE covers the whole step: forward, backward and optimizer
 * inside the step, every compiled region call, every compiled graph run
 * and its fused kernels, the AutoEP layers; without it no profile counter
 * exists. */
START_TEST(test_profile_whole_step)
{
	for (int on = 0; on < 2; on++) {
		if (on)
			setenv("EPJIT_PROFILE", "1", 1);
		else
			unsetenv("EPJIT_PROFILE");
		epj_ctx *ctx = tu_ctx();
		unsetenv("EPJIT_PROFILE");
		epj_model *m = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, 9);
		char js[512];
		engine_json(js, sizeof js, true, false, false);
		epj_engine *e = engine_new(ctx, m, js);
		compile_ok(e);
		epj_tensor *ids, *labels;
		batch(ctx, 2, 5, &ids, &labels);
		epj_counters *c0 = epj_counters_snapshot(ctx);
		for (int step = 0; step < 2; step++)
			ck_assert_msg(epj_engine_train_step(e, ids, labels,
							    NULL) == EPJ_OK,
				      "%s", epj_ctx_error(ctx));
		epj_counters *c1 = epj_counters_snapshot(ctx);
		epj_counters *d = epj_counters_diff(c0, c1);
		int n_prof = 0;
		prof_sum(d, "profile.", ".calls", &n_prof);
		if (!on) {
			ck_assert_int_eq(n_prof, 0);
		} else {
			int64_t step_us =
			    epj_counters_value(d, "profile.step.us");
			ck_assert_int_eq(
			    epj_counters_value(d, "profile.step.calls"), 2);
			static const char *const parts[] = {
				"forward", "backward", "optimizer.accumulate",
				"optimizer.step"
			};
			int64_t parts_us = 0;
			char nm[96];
			for (int i = 0; i < 4; i++) {
				snprintf(nm, sizeof nm, "profile.%s.calls",
					 parts[i]);
				ck_assert_msg(epj_counters_value(d, nm) == 2,
					      "%s", nm);
				snprintf(nm, sizeof nm, "profile.%s.us",
					 parts[i]);
				parts_us += epj_counters_value(d, nm);
			}
			/* sequential parts of the step: never more than it */
			ck_assert_int_le(parts_us, step_us);
			ck_assert_int_gt(step_us, 0);
			int64_t region_calls = 0;
			for (int i = 0; i < epj_engine_num_regions(e); i++) {
				epj_region_stats rs;
				ck_assert_int_eq(
				    epj_engine_region_stats(e, i, &rs), EPJ_OK);
				region_calls += rs.compiled_calls;
			}
			ck_assert_int_gt(region_calls, 0);
			ck_assert_int_eq(epj_counters_value(
					     d, "profile.region.forward.calls"),
					 region_calls);
			ck_assert_int_le(
			    epj_counters_value(d, "profile.region.forward.us"),
			    epj_counters_value(d, "profile.forward.us"));
			/* forward and backward graph runs */
			int n_graphs = 0, n_fused = 0;
			ck_assert_int_ge(
			    prof_sum(d, "profile.graph.", ".calls", &n_graphs),
			    2 * region_calls);
			int64_t fused =
			    prof_sum(d, "profile.fused.", ".calls", &n_fused);
			ck_assert_int_gt(fused, 0);
			ck_assert_int_le(
			    fused,
			    epj_counters_value(d, "kernels.launched.compiled"));
			ck_assert_int_ge(n_fused, n_graphs);
			ck_assert_int_eq(
			    epj_counters_value(d,
					       "profile.autoep.forward.calls"),
			    epj_counters_value(d, "autoep.calls.forward") +
				epj_counters_value(d, "autoep.calls.replay"));
			ck_assert_int_gt(epj_counters_value(
					     d, "profile.autoep.forward.calls"),
					 0);
		}
		epj_counters_free(d);
		epj_counters_free(c0);
		epj_counters_free(c1);
		epj_tensor_free(ids);
		epj_tensor_free(labels);
		epj_engine_free(e);
		epj_model_free(m);
		epj_ctx_free(ctx);
	}
}
END_TEST

/* A new sequence length recompiles each region once (guard on the input
 * shape) and still computes what eager computes; eval is one more
 * variant (grad mode). */
START_TEST(test_recompile_on_shape)
{
	epj_ctx *ctx = tu_ctx();
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	epj_model *ma = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, seed);
	epj_model *mb = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, seed);
	char js[512];
	engine_json(js, sizeof js, true, false, false);
	epj_engine *ea = engine_new(ctx, ma, js);
	epj_engine *eb = engine_new(ctx, mb, js);
	compile_ok(ea);
	int R = epj_engine_num_regions(ea);
	int64_t T = tu_randint(3, 8);
	int64_t Ts[3] = { T, T + 2, T };
	int64_t want_rc[3] = { 0, R, R }, want_ft[3] = { R, 2 * R, 2 * R };
	for (int k = 0; k < 3; k++) {
		epj_tensor *ids, *labels;
		batch(ctx, 2, Ts[k], &ids, &labels);
		double la = fwd_bwd(ctx, ma, ids, labels);
		double lb = fwd_bwd(ctx, mb, ids, labels);
		assert_loss_close(la, lb, "shape change");
		assert_grads_close(ctx, ma, mb, RTOL, ATOL, "shape change");
		zero_grads(ma);
		zero_grads(mb);
		ck_assert_int_eq(ctr(ctx, "recompiles"), want_rc[k]);
		ck_assert_int_eq(ctr(ctx, "frames.total"), want_ft[k]);
		epj_tensor_free(ids);
		epj_tensor_free(labels);
	}
	/* eval: grad mode off is another guard variant */
	epj_tensor *ids, *labels;
	batch(ctx, 2, T, &ids, &labels);
	double la, lb;
	ck_assert_int_eq(epj_engine_eval(ea, ids, labels, &la), EPJ_OK);
	ck_assert_int_eq(epj_engine_eval(eb, ids, labels, &lb), EPJ_OK);
	assert_loss_close(la, lb, "eval");
	ck_assert_int_eq(ctr(ctx, "recompiles"), 2 * R);
	ck_assert_int_eq(ctr(ctx, "frames.fallback_eager"), 0);
	/* a replaced parameter is picked up (the table is refreshed) */
	for (int i = 0; i < epj_model_num_params(ma); i++) {
		if (!strstr(epj_model_param_name(ma, i),
			    "layers.1.self_attn.q_proj"))
			continue;
		epj_tensor *p = epj_model_param(ma, i);
		epj_tensor *nw =
		    tu_randn(ctx, EPJ_DTYPE_F32, epj_tensor_ndim(p),
			     epj_tensor_shape(p));
		ck_assert_int_eq(epj_model_set_param(ctx, ma, i, nw), EPJ_OK);
		ck_assert_int_eq(epj_model_set_param(ctx, mb, i, nw), EPJ_OK);
		epj_tensor_free(nw);
	}
	la = fwd_bwd(ctx, ma, ids, labels);
	lb = fwd_bwd(ctx, mb, ids, labels);
	assert_loss_close(la, lb, "replaced parameter");
	assert_grads_close(ctx, ma, mb, RTOL, ATOL, "replaced parameter");
	ck_assert_int_eq(ctr(ctx, "recompiles"), 2 * R);
	epj_tensor_free(ids);
	epj_tensor_free(labels);
	epj_engine_free(ea);
	epj_engine_free(eb);
	epj_model_free(ma);
	epj_model_free(mb);
	epj_ctx_free(ctx);
}
END_TEST

/* epj_engine_precompile compiles every variant a training step and an
 * evaluation at the config's micro-batch x T need, so that they compile
 * nothing and run compiled code that agrees with an eager model; another
 * shape still compiles at its first call.  With and without activation
 * checkpointing (its no-grad forward and replay are variants of their
 * own). */
START_TEST(test_precompile)
{
	for (int ck = 0; ck < 2; ck++) {
		epj_ctx *ctx = tu_ctx();
		uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
		epj_model *ma = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, seed);
		epj_model *mb = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, seed);
		char js[512];
		engine_json(js, sizeof js, true, ck, false);
		epj_engine *ea = engine_new(ctx, ma, js);
		int nv = -1;
		ck_assert_int_eq(epj_engine_precompile(ea, 4, &nv),
				 EPJ_ERR_STATE);
		ck_assert_int_eq(nv, 0);
		compile_ok(ea);
		int R = epj_engine_num_regions(ea);
		ck_assert_int_gt(R, 0);
		int64_t T = tu_randint(3, 9);
		int64_t B = epj_engine_micro_batch_size(ea);
		ck_assert_int_eq(epj_engine_precompile(ea, 0, &nv),
				 EPJ_ERR_INVALID);
		ck_assert_msg(epj_engine_precompile(ea, T, &nv) == EPJ_OK, "%s",
			      epj_ctx_error(ctx));
		/* train (+ replay) and eval variants of every region */
		ck_assert_int_ge(nv, 2 * R);
		int64_t ft = ctr(ctx, "frames.total");
		ck_assert_int_eq(ft, nv);
		ck_assert_int_eq(ctr(ctx, "frames.ok"), nv);
		/* variants compiled ahead are no guard failures (Dynamo's
		 * recompiles): frames.precompiled, not recompiles */
		ck_assert_int_eq(ctr(ctx, "frames.precompiled"), nv);
		ck_assert_int_eq(ctr(ctx, "recompiles"), 0);
		int64_t k0 = ctr(ctx, "kernels.launched.compiled");
		epj_tensor *ids, *labels;
		batch(ctx, B, T, &ids, &labels);
		double la = fwd_bwd(ctx, ma, ids, labels);
		double lb = fwd_bwd(ctx, mb, ids, labels);
		assert_loss_close(la, lb, "precompiled");
		assert_grads_close(ctx, ma, mb, RTOL, ATOL, "precompiled");
		ck_assert_int_gt(ctr(ctx, "kernels.launched.compiled"), k0);
		ck_assert_int_eq(epj_engine_eval(ea, ids, labels, &la), EPJ_OK);
		ck_assert_int_eq(ctr(ctx, "frames.total"), ft);
		ck_assert_int_eq(ctr(ctx, "frames.fallback_eager"), 0);
		ck_assert_int_eq(ctr(ctx, "recompiles"), 0);
		epj_tensor_free(ids);
		epj_tensor_free(labels);
		/* another shape: compiled at its first call, a guard failure
		 * (input shape) counted as a recompile */
		batch(ctx, B, T + 1, &ids, &labels);
		fwd_bwd(ctx, ma, ids, labels);
		ck_assert_int_gt(ctr(ctx, "frames.total"), ft);
		ck_assert_int_gt(ctr(ctx, "recompiles"), 0);
		ck_assert_int_eq(ctr(ctx, "frames.precompiled"), nv);
		epj_tensor_free(ids);
		epj_tensor_free(labels);
		epj_engine_free(ea);
		epj_model_free(ma);
		epj_model_free(mb);
		epj_ctx_free(ctx);
	}
}
END_TEST

/* EPJIT_RECOMPILE_LIMIT=2: the third shape runs eagerly (counted, still
 * right); shapes already compiled keep running compiled. */
START_TEST(test_recompile_limit)
{
	setenv("EPJIT_RECOMPILE_LIMIT", "2", 1);
	epj_ctx *ctx = tu_ctx();
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	epj_model *ma = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, seed);
	epj_model *mb = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, seed);
	char js[512];
	engine_json(js, sizeof js, true, false, false);
	epj_engine *ea = engine_new(ctx, ma, js);
	epj_engine *eb = engine_new(ctx, mb, js);
	compile_ok(ea);
	unsetenv("EPJIT_RECOMPILE_LIMIT"); /* read at compile time */
	int R = epj_engine_num_regions(ea);
	int64_t T = tu_randint(3, 6);
	int64_t Ts[4] = { T, T + 1, T + 2, T };
	int64_t want_fb[4] = { 0, 0, R, R },
		want_ft[4] = { R, 2 * R, 2 * R, 2 * R };
	for (int k = 0; k < 4; k++) {
		epj_tensor *ids, *labels;
		batch(ctx, 1, Ts[k], &ids, &labels);
		double la = fwd_bwd(ctx, ma, ids, labels);
		double lb = fwd_bwd(ctx, mb, ids, labels);
		assert_loss_close(la, lb, "recompile limit");
		assert_grads_close(ctx, ma, mb, RTOL, ATOL, "recompile limit");
		zero_grads(ma);
		zero_grads(mb);
		ck_assert_int_eq(ctr(ctx, "frames.fallback_eager"), want_fb[k]);
		ck_assert_int_eq(ctr(ctx, "frames.total"), want_ft[k]);
		ck_assert_int_eq(ctr(ctx, "recompiles"), k ? R : 0);
		epj_tensor_free(ids);
		epj_tensor_free(labels);
	}
	epj_engine_free(ea);
	epj_engine_free(eb);
	epj_model_free(ma);
	epj_model_free(mb);
	epj_ctx_free(ctx);
}
END_TEST

/* EPJIT_DEBUG_DUMP: counters.json at engine teardown, graphs per pass. */
START_TEST(test_debug_dump)
{
	char *dir = tu_tmpdir_new("check-compile");
	setenv("EPJIT_DEBUG_DUMP", dir, 1);
	epj_ctx *ctx = tu_ctx();
	epj_model *m = model_new(ctx, EPJ_LAYOUT_NESTED, NULL, 9);
	char js[512];
	engine_json(js, sizeof js, true, false, false);
	epj_engine *e = engine_new(ctx, m, js);
	compile_ok(e);
	epj_tensor *ids, *labels;
	batch(ctx, 2, 5, &ids, &labels);
	fwd_bwd(ctx, m, ids, labels);
	epj_tensor_free(ids);
	epj_tensor_free(labels);
	char path[1024];
	snprintf(path, sizeof path, "%s/counters.json", dir);
	ck_assert(!tu_exists(path)); /* written at teardown */
	epj_engine_free(e);
	unsetenv("EPJIT_DEBUG_DUMP");
	ck_assert_msg(tu_exists(path), "%s missing", path);
	FILE *f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	char buf[16384];
	size_t n = fread(buf, 1, sizeof buf - 1, f);
	buf[n] = 0;
	fclose(f);
	epj_counters *c = epj_counters_from_json(buf);
	ck_assert_ptr_nonnull(c);
	ck_assert_int_eq(epj_counters_value(c, "frames.total"), 2);
	ck_assert_int_eq(epj_counters_value(c, "frames.ok"), 2);
	ck_assert_int_eq(epj_counters_value(c, "graph_break.autoep"), 2);
	ck_assert_int_eq(epj_counters_value(c, "stats.unique_graphs"),
			 ctr(ctx, "stats.unique_graphs"));
	epj_counters_free(c);
	snprintf(path, sizeof path, "%s/graphs", dir);
	DIR *d = opendir(path);
	ck_assert_msg(d != NULL, "%s missing", path);
	int files = 0;
	struct dirent *de;
	while ((de = readdir(d)))
		files += de->d_name[0] != '.';
	closedir(d);
	ck_assert_int_gt(files, 0);
	epj_model_free(m);
	epj_ctx_free(ctx);
	tu_tmpdir_free(dir);
}
END_TEST

Suite *make_compile_suite(void)
{
	Suite *s = suite_create("compile");
	TCase *tc = tcase_create("core");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_compile_cases);
	tcase_add_test(tc, test_discovery_layouts);
	tcase_add_test(tc, test_discovery_refusals);
	tcase_add_test(tc, test_nested_regions_parity);
	tcase_add_test(tc, test_region_order);
	tcase_add_test(tc, test_deepspeed_messages);
	tcase_add_test(tc, test_rollback);
	tcase_add_loop_test(tc, test_parity, 0,
			    (int)(sizeof pcases / sizeof pcases[0]));
	tcase_add_test(tc, test_parity_bf16);
	tcase_add_test(tc, test_unique_graphs_depth);
	tcase_add_test(tc, test_recompile_on_shape);
	tcase_add_test(tc, test_precompile);
	tcase_add_test(tc, test_recompile_limit);
	tcase_add_test(tc, test_debug_dump);
	tcase_add_test(tc, test_profile_whole_step);
	suite_add_tcase(s, tc);
	return s;
}
