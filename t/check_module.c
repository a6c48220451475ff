/* check_module.c -- the module tree of the Qwen3-MoE model (runtime/module.c,
 * the tree built by runtime/qwen3.c and runtime/autoep.c).
 *
 * What is pinned down here: the dotted HF names of every module in both
 * layouts, their kinds, which modules have a forward (containers have none),
 * that compiler_disabled is set exactly on the AutoEP layers, the parameter
 * list (names exactly as in an HF Qwen3-MoE checkpoint, shapes from the
 * config, model order), dense MLP layers chosen by mlp_only_layers and
 * decoder_sparse_step, and the initialisation (deterministic in the seed,
 * independent of the context's RNG state and of the OpenMP thread count,
 * normal(0, initializer_range) for weights, ones for norms).
 *
 * The test configs are written as config.json files into a private temporary
 * directory (removed at the end of each test).
 */
#include "check_util.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "runtime_impl.h"

/* ---- helpers --------------------------------------------------------------
 */

/* The test model: vocab 11, hidden 10, 2 layers, 2 query heads and 1 KV
 * head of dim 4 (so q_proj [8, 10], o_proj [10, 8]), dense intermediate 7,
 * 3 experts of intermediate 5, top-2. */
#define T_V    11
#define T_H    10
#define T_HQ   2
#define T_HKV  1
#define T_D    4
#define T_I    7
#define T_MI   5
#define T_E    3
#define T_K    2
#define T_INIT 0.05
#define CFG_FMT                                                                \
	"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 11, "                 \
	"\"hidden_size\": 10, \"num_hidden_layers\": %d, "                     \
	"\"num_attention_heads\": 2, \"num_key_value_heads\": 1, "             \
	"\"head_dim\": 4, \"intermediate_size\": 7, "                          \
	"\"moe_intermediate_size\": 5, \"num_experts\": 3, "                   \
	"\"num_experts_per_tok\": 2, \"norm_topk_prob\": true, "               \
	"\"decoder_sparse_step\": %d, \"mlp_only_layers\": %s, "               \
	"\"initializer_range\": 0.05, \"max_position_embeddings\": 64, "       \
	"\"tie_word_embeddings\": false}"

static epj_model *new_model(epj_ctx *ctx, const char *path, epj_layout layout,
			    uint64_t seed)
{
	epj_model_opts o = { .layout = layout,
			     .seed = seed,
			     .fixed_routing = false,
			     .dtype = EPJ_DTYPE_F32 };
	epj_model *m = NULL;
	epj_status st = epj_model_new(ctx, path, &o, &m);
	ck_assert_msg(st == EPJ_OK && m, "epj_model_new(%s): %s",
		      path ? path : "tiny", epj_ctx_error(ctx));
	return m;
}

/* The test model with `layers` decoder layers, all MoE. */
static epj_model *new_test_model(epj_ctx *ctx, epj_layout layout, int layers,
				 uint64_t seed)
{
	char json[1024];
	snprintf(json, sizeof json, CFG_FMT, layers, 1, "[]");
	tu_tmpfile t = tu_tmpfile_new("module", "config.json", json);
	epj_model *m = new_model(ctx, t.path, layout, seed);
	tu_tmpfile_free(&t);
	return m;
}

static epj_module *find_ok(epj_module *root, const char *name)
{
	epj_module *m = epj_module_find(root, name);
	ck_assert_msg(m != NULL, "module \"%s\" not found", name);
	ck_assert_str_eq(epj_module_name(m), name);
	return m;
}

static void check_module(epj_module *root, const char *name, const char *kind,
			 bool has_forward, bool disabled)
{
	epj_module *m = find_ok(root, name);
	ck_assert_msg(!strcmp(epj_module_kind(m), kind),
		      "module \"%s\": kind %s, expected %s", name,
		      epj_module_kind(m), kind);
	ck_assert_msg(epj_module_has_forward(m) == has_forward,
		      "module \"%s\": has_forward %d, expected %d", name,
		      epj_module_has_forward(m), has_forward);
	ck_assert_msg(epj_module_compiler_disabled(m) == disabled,
		      "module \"%s\": compiler_disabled %d, expected %d", name,
		      epj_module_compiler_disabled(m), disabled);
}

/* Index of parameter `name` in the model's list, -1 if absent. */
static int param_index(const epj_model *m, const char *name)
{
	for (int i = 0; i < epj_model_num_params(m); i++)
		if (!strcmp(epj_model_param_name(m, i), name))
			return i;
	return -1;
}

/* Expected parameter: full HF name and shape (ndim 1 or 2). */
typedef struct exp_param {
	char name[96];
	int ndim;
	int64_t shape[2];
} exp_param;

typedef struct exp_list {
	exp_param p[256];
	int n;
} exp_list;

static void expect(exp_list *l, int ndim, int64_t d0, int64_t d1,
		   const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static void expect(exp_list *l, int ndim, int64_t d0, int64_t d1,
		   const char *fmt, ...)
{
	ck_assert_int_lt(l->n, 256);
	exp_param *p = &l->p[l->n++];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(p->name, sizeof p->name, fmt, ap);
	va_end(ap);
	p->ndim = ndim;
	p->shape[0] = d0;
	p->shape[1] = d1;
}

/* The HF Qwen3-MoE parameter names of one decoder layer under `pre`
 * ("model.layers.3." or "" for the root layout); moe selects the mlp. */
static void expect_block(exp_list *l, const char *pre, bool moe)
{
	expect(l, 2, T_HQ * T_D, T_H, "%sself_attn.q_proj.weight", pre);
	expect(l, 2, T_HKV * T_D, T_H, "%sself_attn.k_proj.weight", pre);
	expect(l, 2, T_HKV * T_D, T_H, "%sself_attn.v_proj.weight", pre);
	expect(l, 2, T_H, T_HQ * T_D, "%sself_attn.o_proj.weight", pre);
	expect(l, 1, T_D, 0, "%sself_attn.q_norm.weight", pre);
	expect(l, 1, T_D, 0, "%sself_attn.k_norm.weight", pre);
	expect(l, 1, T_H, 0, "%sinput_layernorm.weight", pre);
	expect(l, 1, T_H, 0, "%spost_attention_layernorm.weight", pre);
	if (!moe) {
		expect(l, 2, T_I, T_H, "%smlp.gate_proj.weight", pre);
		expect(l, 2, T_I, T_H, "%smlp.up_proj.weight", pre);
		expect(l, 2, T_H, T_I, "%smlp.down_proj.weight", pre);
		return;
	}
	expect(l, 2, T_E, T_H, "%smlp.gate.weight", pre);
	for (int e = 0; e < T_E; e++) {
		expect(l, 2, T_MI, T_H, "%smlp.experts.%d.gate_proj.weight",
		       pre, e);
		expect(l, 2, T_MI, T_H, "%smlp.experts.%d.up_proj.weight", pre,
		       e);
		expect(l, 2, T_H, T_MI, "%smlp.experts.%d.down_proj.weight",
		       pre, e);
	}
}

/* The model's parameter list is exactly l (as a set; each name once) with
 * the expected shapes, all f32 leaves that require grad. */
static void check_params(const epj_model *m, const exp_list *l)
{
	int n = epj_model_num_params(m);
	ck_assert_msg(n == l->n, "model has %d parameters, expected %d", n,
		      l->n);
	int64_t numel = 0;
	for (int i = 0; i < l->n; i++) {
		const exp_param *p = &l->p[i];
		int k = param_index(m, p->name);
		ck_assert_msg(k >= 0, "parameter \"%s\" missing", p->name);
		for (int j = k + 1; j < n; j++)
			ck_assert_msg(
			    strcmp(epj_model_param_name(m, j), p->name) != 0,
			    "parameter \"%s\" listed twice", p->name);
		epj_tensor *t = epj_model_param(m, k);
		char b[64];
		ck_assert_msg(
		    epj_tensor_ndim(t) == p->ndim &&
			epj_tensor_dim(t, 0) == p->shape[0] &&
			(p->ndim == 1 || epj_tensor_dim(t, 1) == p->shape[1]),
		    "parameter \"%s\": %s, expected [%lld%s%lld]", p->name,
		    epj_tensor_describe(t, b, sizeof b), (long long)p->shape[0],
		    p->ndim == 2 ? "," : "",
		    p->ndim == 2 ? (long long)p->shape[1] : 0LL);
		ck_assert_int_eq(epj_tensor_dtype(t), EPJ_DTYPE_F32);
		ck_assert(epj_tensor_requires_grad(t));
		ck_assert(epj_tensor_is_leaf(t));
		numel += epj_tensor_numel(t);
	}
	ck_assert_int_eq(epj_model_num_elements(m), numel);
	ck_assert_ptr_null(epj_model_param_name(m, n));
	ck_assert_ptr_null(epj_model_param_name(m, -1));
	ck_assert_ptr_null(epj_model_param(m, n));
}

/* Model order: names of layer i all come before those of layer i + 1;
 * within an MoE layer the router comes before the experts and experts are
 * in ascending order with gate/up/down each. */
static void check_order(const epj_model *m, int layers)
{
	int n = epj_model_num_params(m), prev_layer = -1, prev_expert = -1;
	ck_assert_str_eq(epj_model_param_name(m, 0),
			 "model.embed_tokens.weight");
	ck_assert_str_eq(epj_model_param_name(m, n - 2), "model.norm.weight");
	ck_assert_str_eq(epj_model_param_name(m, n - 1), "lm_head.weight");
	static const char *const proj[3] = { "gate_proj", "up_proj",
					     "down_proj" };
	int next_proj = 0;
	for (int i = 1; i < n - 2; i++) {
		const char *nm = epj_model_param_name(m, i);
		int layer = -1, e = -1, used = 0;
		ck_assert_msg(
		    sscanf(nm, "model.layers.%d.%n", &layer, &used) == 1 &&
			used > 0,
		    "parameter %d \"%s\" is not a layer parameter", i, nm);
		ck_assert_msg(layer == prev_layer || layer == prev_layer + 1,
			      "parameter \"%s\" out of layer order", nm);
		ck_assert_int_lt(layer, layers);
		if (layer != prev_layer)
			prev_expert = -1, next_proj = 0;
		prev_layer = layer;
		char p[32];
		if (sscanf(nm + used, "mlp.experts.%d.%31[a-z_]", &e, p) == 2) {
			if (e != prev_expert) {
				ck_assert_msg(
				    e == prev_expert + 1 && next_proj == 0,
				    "\"%s\": experts out of order", nm);
				prev_expert = e;
			}
			ck_assert_msg(!strcmp(p, proj[next_proj]),
				      "\"%s\": expected %s", nm,
				      proj[next_proj]);
			next_proj = (next_proj + 1) % 3;
		} else if (!strcmp(nm + used, "mlp.gate.weight")) {
			ck_assert_msg(prev_expert == -1,
				      "\"%s\" after the experts", nm);
		}
	}
	ck_assert_int_eq(prev_layer, layers - 1);
}

/* Visits every module (pre-order): the name is the parent's name + "." +
 * the last component, find() returns the module itself. */
typedef struct walk_state {
	epj_module *root;
	int n_modules, n_disabled, n_autoep;
} walk_state;

static void walk(walk_state *w, epj_module *m)
{
	w->n_modules++;
	const char *nm = epj_module_name(m);
	ck_assert_msg(epj_module_find(w->root, nm) == m,
		      "find(\"%s\") is another module", nm);
	bool autoep = !strcmp(epj_module_kind(m), "AutoEPMoELayer");
	w->n_autoep += autoep;
	w->n_disabled += epj_module_compiler_disabled(m);
	ck_assert_msg(epj_module_compiler_disabled(m) == autoep,
		      "\"%s\" (%s): compiler_disabled %d", nm,
		      epj_module_kind(m), epj_module_compiler_disabled(m));
	/* routing exists only on AutoEP layers (and only after a call) */
	if (!autoep)
		ck_assert_ptr_null(epj_module_routing(m));
	for (int i = 0; i < epj_module_num_children(m); i++) {
		epj_module *c = epj_module_child_at(m, i);
		ck_assert_ptr_nonnull(c);
		const char *cn = epj_module_name(c);
		size_t pl = strlen(nm);
		if (pl)
			ck_assert_msg(!strncmp(cn, nm, pl) && cn[pl] == '.' &&
					  cn[pl + 1] &&
					  !strchr(cn + pl + 1, '.'),
				      "child \"%s\" of \"%s\"", cn, nm);
		else
			ck_assert_msg(cn[0] && !strchr(cn, '.'),
				      "child \"%s\" of the root", cn);
		walk(w, c);
	}
	ck_assert_ptr_null(epj_module_child_at(m, epj_module_num_children(m)));
	ck_assert_ptr_null(epj_module_child_at(m, -1));
}

/* ---- tests ----------------------------------------------------------------
 */

START_TEST(test_nested_tree)
{
	epj_ctx *ctx = tu_ctx();
	epj_model *m = new_test_model(ctx, EPJ_LAYOUT_NESTED, 2, 5);
	epj_module *r = epj_model_root(m);
	ck_assert_str_eq(epj_module_name(r), "");
	ck_assert_ptr_eq(epj_module_find(r, ""), r);
	check_module(r, "", "Qwen3MoeForCausalLM", true, false);
	check_module(r, "model", "Qwen3MoeModel", false, false);
	check_module(r, "model.embed_tokens", "Embedding", false, false);
	check_module(r, "model.layers", "ModuleList", false, false);
	check_module(r, "model.norm", "Qwen3MoeRMSNorm", false, false);
	check_module(r, "lm_head", "Linear", false, false);
	for (int i = 0; i < 2; i++) {
		char nm[96];
#define AT(fmt) (snprintf(nm, sizeof nm, fmt, i), nm)
		check_module(r, AT("model.layers.%d"), "Qwen3MoeDecoderLayer",
			     true, false);
		check_module(r, AT("model.layers.%d.self_attn"),
			     "Qwen3MoeAttention", false, false);
		check_module(r, AT("model.layers.%d.self_attn.q_proj"),
			     "Linear", false, false);
		check_module(r, AT("model.layers.%d.self_attn.k_norm"),
			     "Qwen3MoeRMSNorm", false, false);
		check_module(r, AT("model.layers.%d.input_layernorm"),
			     "Qwen3MoeRMSNorm", false, false);
		check_module(r, AT("model.layers.%d.post_attention_layernorm"),
			     "Qwen3MoeRMSNorm", false, false);
		check_module(r, AT("model.layers.%d.mlp"), "AutoEPMoELayer",
			     true, true);
		check_module(r, AT("model.layers.%d.mlp.gate"), "Linear", false,
			     false);
		check_module(r, AT("model.layers.%d.mlp.experts"), "ModuleList",
			     false, false);
		check_module(r, AT("model.layers.%d.mlp.experts.2"),
			     "Qwen3MoeMLP", false, false);
		check_module(r, AT("model.layers.%d.mlp.experts.0.up_proj"),
			     "Linear", false, false);
#undef AT
	}
	/* the layer list holds exactly the blocks, in order */
	epj_module *layers = find_ok(r, "model.layers");
	ck_assert_int_eq(epj_module_num_children(layers), 2);
	ck_assert_str_eq(epj_module_name(epj_module_child_at(layers, 1)),
			 "model.layers.1");
	/* absent names */
	static const char *const absent[] = {
		"model.layers.2",
		"model.layers.0.mlp.experts.3",
		"model.layer",
		"layers",
		"model.layers.0.mlp.experts.0.up",
		"mlp",
		"model..layers",
		"model.layers.0.self_attn.q_proj.weight",
		"model.layers.0.", /* a trailing dot is no module name */
		".model",
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(absent); i++)
		ck_assert_msg(epj_module_find(r, absent[i]) == NULL,
			      "find(\"%s\") should be NULL, got \"%s\"",
			      absent[i],
			      epj_module_name(epj_module_find(r, absent[i])));
	walk_state w = { .root = r };
	walk(&w, r);
	ck_assert_int_eq(w.n_autoep, 2);
	ck_assert_int_eq(w.n_disabled, 2);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_root_tree)
{
	epj_ctx *ctx = tu_ctx();
	/* num_hidden_layers 2 in the file: the root layout holds one block */
	epj_model *m = new_test_model(ctx, EPJ_LAYOUT_ROOT, 2, 5);
	epj_module *r = epj_model_root(m);
	ck_assert_str_eq(epj_module_name(r), "");
	ck_assert(epj_module_has_forward(r));
	ck_assert(!epj_module_compiler_disabled(r));
	check_module(r, "embed_tokens", "Embedding", false, false);
	check_module(r, "self_attn", "Qwen3MoeAttention", false, false);
	check_module(r, "self_attn.q_proj", "Linear", false, false);
	check_module(r, "self_attn.q_norm", "Qwen3MoeRMSNorm", false, false);
	check_module(r, "input_layernorm", "Qwen3MoeRMSNorm", false, false);
	check_module(r, "post_attention_layernorm", "Qwen3MoeRMSNorm", false,
		     false);
	check_module(r, "mlp", "AutoEPMoELayer", true, true);
	check_module(r, "mlp.gate", "Linear", false, false);
	check_module(r, "mlp.experts.2.down_proj", "Linear", false, false);
	check_module(r, "norm", "Qwen3MoeRMSNorm", false, false);
	check_module(r, "lm_head", "Linear", false, false);
	ck_assert_ptr_null(epj_module_find(r, "model"));
	ck_assert_ptr_null(epj_module_find(r, "model.layers.0.mlp"));
	walk_state w = { .root = r };
	walk(&w, r);
	ck_assert_int_eq(w.n_autoep, 1);
	ck_assert_int_eq(w.n_disabled, 1);

	exp_list *l = calloc(1, sizeof *l);
	ck_assert_ptr_nonnull(l);
	expect(l, 2, T_V, T_H, "embed_tokens.weight");
	expect_block(l, "", true);
	expect(l, 1, T_H, 0, "norm.weight");
	expect(l, 2, T_V, T_H, "lm_head.weight");
	check_params(m, l);
	int n = epj_model_num_params(m);
	ck_assert_str_eq(epj_model_param_name(m, 0), "embed_tokens.weight");
	ck_assert_str_eq(epj_model_param_name(m, n - 1), "lm_head.weight");
	free(l);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_param_names_nested)
{
	epj_ctx *ctx = tu_ctx();
	const int L = 3;
	epj_model *m = new_test_model(ctx, EPJ_LAYOUT_NESTED, L, 9);
	exp_list *l = calloc(1, sizeof *l);
	ck_assert_ptr_nonnull(l);
	expect(l, 2, T_V, T_H, "model.embed_tokens.weight");
	for (int i = 0; i < L; i++) {
		char pre[32];
		snprintf(pre, sizeof pre, "model.layers.%d.", i);
		expect_block(l, pre, true);
	}
	expect(l, 1, T_H, 0, "model.norm.weight");
	expect(l, 2, T_V, T_H, "lm_head.weight");
	check_params(m, l);
	check_order(m, L);
	ck_assert_int_eq(epj_model_vocab_size(m), T_V);
	/* parameters are the module tree's own tensors */
	epj_module *up =
	    find_ok(epj_model_root(m), "model.layers.1.mlp.experts.0.up_proj");
	ck_assert_ptr_eq(
	    ej_module_param(up, "weight"),
	    epj_model_param(
		m,
		param_index(m, "model.layers.1.mlp.experts.0.up_proj.weight")));
	free(l);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* The built-in tiny model (NULL config) follows the same naming. */
START_TEST(test_builtin_tiny)
{
	epj_ctx *ctx = tu_ctx();
	epj_model *m = new_model(ctx, NULL, EPJ_LAYOUT_NESTED, 1);
	ej_model_config c;
	ej_model_config_tiny(&c);
	ck_assert_int_eq(epj_model_vocab_size(m), (int)c.vocab_size);
	int per_layer = 8 + 1 + 3 * c.num_experts;
	ck_assert_int_eq(epj_model_num_params(m),
			 3 + c.num_hidden_layers * per_layer);
	ck_assert_int_ge(param_index(m, "model.layers.1.mlp.gate.weight"), 0);
	char nm[96];
	snprintf(nm, sizeof nm,
		 "model.layers.0.mlp.experts.%d.down_proj.weight",
		 c.num_experts - 1);
	int k = param_index(m, nm);
	ck_assert_int_ge(k, 0);
	ck_assert_int_eq(epj_tensor_dim(epj_model_param(m, k), 0),
			 c.hidden_size);
	ck_assert_int_eq(epj_tensor_dim(epj_model_param(m, k), 1),
			 c.moe_intermediate_size);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* Dense layers: mlp_only_layers and decoder_sparse_step (HF rule: layer l
 * is MoE iff l not in mlp_only_layers and (l + 1) % step == 0). */
START_TEST(test_dense_layers)
{
	epj_ctx *ctx = tu_ctx();
	static const struct {
		int layers, step;
		const char *only;
		bool moe[4];
	} cases[] = {
		{ 3, 1, "[0]", { false, true, true } },
		{ 4, 2, "[]", { false, true, false, true } },
		{ 4, 2, "[3]", { false, true, false, false } },
		{ 2, 1, "[1, 0]", { false, false } },
	};
	for (size_t c = 0; c < EJ_ARRAY_LEN(cases); c++) {
		char json[1024];
		snprintf(json, sizeof json, CFG_FMT, cases[c].layers,
			 cases[c].step, cases[c].only);
		tu_tmpfile t = tu_tmpfile_new("module", "config.json", json);
		epj_model *m = new_model(ctx, t.path, EPJ_LAYOUT_NESTED, 3);
		tu_tmpfile_free(&t);
		epj_module *r = epj_model_root(m);
		exp_list *l = calloc(1, sizeof *l);
		ck_assert_ptr_nonnull(l);
		expect(l, 2, T_V, T_H, "model.embed_tokens.weight");
		int n_moe = 0;
		for (int i = 0; i < cases[c].layers; i++) {
			char pre[32], mlp[40];
			bool moe = cases[c].moe[i];
			snprintf(pre, sizeof pre, "model.layers.%d.", i);
			snprintf(mlp, sizeof mlp, "model.layers.%d.mlp", i);
			expect_block(l, pre, moe);
			n_moe += moe;
			check_module(r, mlp,
				     moe ? "AutoEPMoELayer" : "Qwen3MoeMLP",
				     true, moe);
		}
		expect(l, 1, T_H, 0, "model.norm.weight");
		expect(l, 2, T_V, T_H, "lm_head.weight");
		check_params(m, l);
		ck_assert_int_eq(m->n_moe, n_moe);
		walk_state w = { .root = r };
		walk(&w, r);
		ck_assert_int_eq(w.n_disabled, n_moe);
		/* the mixed model runs: finite loss, gradient on a dense
		 * projection */
		int64_t sh[2] = { 2, 5 };
		epj_tensor *ids =
		    epj_randint(ctx, EPJ_DTYPE_I64, 2, sh, 0, T_V);
		epj_tensor *lab =
		    epj_randint(ctx, EPJ_DTYPE_I64, 2, sh, 0, T_V);
		epj_tensor *loss = NULL;
		ck_assert_msg(
		    epj_model_forward(ctx, m, ids, lab, NULL, &loss) == EPJ_OK,
		    "%s", epj_ctx_error(ctx));
		ck_assert(isfinite(epj_tensor_get_f64(loss, 0)));
		ck_assert_int_eq(epj_backward(ctx, loss, NULL), EPJ_OK);
		int k = param_index(m, "model.layers.0.mlp.down_proj.weight");
		ck_assert_int_ge(k, 0);
		ck_assert_ptr_nonnull(epj_tensor_grad(epj_model_param(m, k)));
		epj_tensor_free(loss);
		epj_tensor_free(ids);
		epj_tensor_free(lab);
		free(l);
		epj_model_free(m);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* Calling a container through the module call path is an error naming it. */
START_TEST(test_call_container)
{
	epj_ctx *ctx = tu_ctx();
	epj_model *m = new_test_model(ctx, EPJ_LAYOUT_NESTED, 2, 5);
	epj_module *layers = find_ok(epj_model_root(m), "model.layers");
	int64_t sh[3] = { 1, 3, T_H };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 3, sh), *out = x;
	epj_status st = ej_module_call(ctx, layers, &x, 1, &out, 1);
	ck_assert_int_eq(st, EPJ_ERR_STATE);
	ck_assert_ptr_null(out);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "model.layers") != NULL, "%s",
		      epj_ctx_error(ctx));
	epj_tensor_free(x);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* Routing record: NULL before the first call, [N, k] after, and with fixed
 * routing the documented balanced assignment (n*k + j) % E. */
START_TEST(test_routing_record)
{
	epj_ctx *ctx = tu_ctx();
	char json[1024];
	snprintf(json, sizeof json, CFG_FMT, 2, 1, "[]");
	tu_tmpfile t = tu_tmpfile_new("module", "config.json", json);
	for (int fixed = 0; fixed < 2; fixed++) {
		epj_model_opts o = { .layout = EPJ_LAYOUT_NESTED,
				     .seed = 4,
				     .fixed_routing = fixed,
				     .dtype = EPJ_DTYPE_F32 };
		epj_model *m = NULL;
		ck_assert_int_eq(epj_model_new(ctx, t.path, &o, &m), EPJ_OK);
		epj_module *mlp =
		    find_ok(epj_model_root(m), "model.layers.1.mlp");
		ck_assert_ptr_null(epj_module_routing(mlp));
		int64_t sh[2] = { 3, 5 }, N = 15;
		epj_tensor *ids =
		    epj_randint(ctx, EPJ_DTYPE_I64, 2, sh, 0, T_V);
		epj_tensor *logits = NULL;
		ck_assert_int_eq(
		    epj_model_forward(ctx, m, ids, NULL, &logits, NULL),
		    EPJ_OK);
		epj_tensor *rt = epj_module_routing(mlp);
		ck_assert_ptr_nonnull(rt);
		ck_assert_int_eq(epj_tensor_dtype(rt), EPJ_DTYPE_I64);
		ck_assert_int_eq(epj_tensor_ndim(rt), 2);
		ck_assert_int_eq(epj_tensor_dim(rt, 0), N);
		ck_assert_int_eq(epj_tensor_dim(rt, 1), T_K);
		for (int64_t n = 0; n < N; n++) {
			int64_t a = (int64_t)epj_tensor_get_f64(rt, n * T_K);
			int64_t b =
			    (int64_t)epj_tensor_get_f64(rt, n * T_K + 1);
			ck_assert(a >= 0 && a < T_E && b >= 0 && b < T_E);
			ck_assert_int_ne(a, b);
			if (fixed) {
				ck_assert_int_eq(a, (n * T_K) % T_E);
				ck_assert_int_eq(b, (n * T_K + 1) % T_E);
			}
		}
		epj_tensor_free(ids);
		epj_tensor_free(logits);
		epj_model_free(m);
	}
	tu_tmpfile_free(&t);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- initialisation -------------------------------------------------------
 */

/* True when every parameter of a and b is bitwise equal. */
static bool params_equal(epj_ctx *ctx, const epj_model *a, const epj_model *b,
			 const char **first_diff)
{
	ck_assert_int_eq(epj_model_num_params(a), epj_model_num_params(b));
	for (int i = 0; i < epj_model_num_params(a); i++) {
		epj_tensor *x = epj_model_param(a, i),
			   *y = epj_model_param(b, i);
		ck_assert_str_eq(epj_model_param_name(a, i),
				 epj_model_param_name(b, i));
		ck_assert_int_eq(epj_tensor_numel(x), epj_tensor_numel(y));
		double *vx = tu_values(ctx, x), *vy = tu_values(ctx, y);
		bool same = !memcmp(
		    vx, vy, sizeof(double) * (size_t)epj_tensor_numel(x));
		free(vx);
		free(vy);
		if (!same) {
			if (first_diff)
				*first_diff = epj_model_param_name(a, i);
			return false;
		}
	}
	return true;
}

static bool is_norm(const char *name)
{
	return strstr(name, "norm.weight") != NULL; /* *_layernorm, *_norm */
}

START_TEST(test_init_seed)
{
	epj_ctx *ctx = tu_ctx();
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	epj_model *a = new_test_model(ctx, EPJ_LAYOUT_NESTED, 2, seed);
	/* the context's RNG has moved on meanwhile: init must not care */
	int64_t sh = 17;
	epj_tensor *junk = tu_randn(ctx, EPJ_DTYPE_F32, 1, &sh);
	epj_tensor_free(junk);
	epj_model *b = new_test_model(ctx, EPJ_LAYOUT_NESTED, 2, seed);
	epj_model *c = new_test_model(ctx, EPJ_LAYOUT_NESTED, 2, seed + 1);
	const char *diff = NULL;
	ck_assert_msg(params_equal(ctx, a, b, &diff),
		      "same seed, parameter %s differs", diff);
	/* a different seed: every weight (not the all-ones norms) differs */
	for (int i = 0; i < epj_model_num_params(a); i++) {
		const char *nm = epj_model_param_name(a, i);
		double *va = tu_values(ctx, epj_model_param(a, i));
		double *vc = tu_values(ctx, epj_model_param(c, i));
		int64_t n = epj_tensor_numel(epj_model_param(a, i)), same = 0;
		for (int64_t k = 0; k < n; k++)
			same += va[k] == vc[k];
		if (is_norm(nm))
			ck_assert_msg(same == n, "%s: norms differ", nm);
		else
			ck_assert_msg(same == 0,
				      "%s: %lld of %lld equal across seeds", nm,
				      (long long)same, (long long)n);
		free(va);
		free(vc);
	}
	epj_model_free(a);
	epj_model_free(b);
	epj_model_free(c);
	epj_ctx_free(ctx);
}
END_TEST

/* Building a model leaves the context's RNG stream where it was. */
START_TEST(test_init_keeps_ctx_rng)
{
	epj_ctx *ctx = tu_ctx();
	uint64_t s = (uint64_t)tu_randint(1, 1 << 30);
	int64_t sh = 9;
	epj_ctx_seed(ctx, s);
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F64, 1, &sh);
	epj_ctx_seed(ctx, s);
	epj_model *m = new_test_model(ctx, EPJ_LAYOUT_NESTED, 1, 77);
	epj_tensor *y = tu_randn(ctx, EPJ_DTYPE_F64, 1, &sh);
	tu_assert_tensors_close(ctx, y, x, 0, 0, "ctx RNG after model_new");
	epj_tensor_free(x);
	epj_tensor_free(y);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

/* Norm weights are ones; weights are normal(0, initializer_range): the
 * sample std of the embedding (vocab 512 x hidden 64 = 32768 values) is
 * within 3% of 0.05 (the sample std's relative standard error is
 * 1/sqrt(2n) = 0.4%, so 3% is > 7 sigma) and the mean within 6 standard
 * errors of 0; pooled over all weights likewise.  A few elements beyond 3
 * sigma must exist (not a uniform or truncated draw). */
START_TEST(test_init_distribution)
{
	epj_ctx *ctx = tu_ctx();
	tu_tmpfile t = tu_tmpfile_new(
	    "module", "config.json",
	    "{\"vocab_size\": 512, \"hidden_size\": 64, "
	    "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
	    "\"num_key_value_heads\": 2, \"head_dim\": 16, "
	    "\"intermediate_size\": 96, "
	    "\"moe_intermediate_size\": 48, \"num_experts\": 4, "
	    "\"num_experts_per_tok\": 2, "
	    "\"initializer_range\": 0.05}");
	epj_model *m = new_model(ctx, t.path, EPJ_LAYOUT_NESTED,
				 (uint64_t)tu_randint(1, 1 << 30));
	tu_tmpfile_free(&t);
	const double std = 0.05;
	double s1 = 0, s2 = 0;
	int64_t n_all = 0, beyond3 = 0;
	for (int i = 0; i < epj_model_num_params(m); i++) {
		const char *nm = epj_model_param_name(m, i);
		epj_tensor *p = epj_model_param(m, i);
		int64_t n = epj_tensor_numel(p);
		double *v = tu_values(ctx, p);
		if (is_norm(nm)) {
			for (int64_t k = 0; k < n; k++)
				ck_assert_msg(v[k] == 1.0, "%s[%lld] = %g", nm,
					      (long long)k, v[k]);
			free(v);
			continue;
		}
		double a1 = 0, a2 = 0;
		for (int64_t k = 0; k < n; k++) {
			a1 += v[k];
			a2 += v[k] * v[k];
			beyond3 += fabs(v[k]) > 3 * std;
		}
		s1 += a1;
		s2 += a2;
		n_all += n;
		if (!strcmp(nm, "model.embed_tokens.weight")) {
			double mean = a1 / (double)n;
			double sd = sqrt(a2 / (double)n - mean * mean);
			ck_assert_msg(fabs(sd - std) < 0.03 * std,
				      "embedding std %g, expected %g", sd, std);
			ck_assert_msg(fabs(mean) < 6 * std / sqrt((double)n),
				      "embedding mean %g", mean);
		}
		free(v);
	}
	double mean = s1 / (double)n_all;
	double sd = sqrt(s2 / (double)n_all - mean * mean);
	ck_assert_msg(fabs(sd - std) < 0.02 * std, "pooled std %g over %lld",
		      sd, (long long)n_all);
	ck_assert_msg(fabs(mean) < 6 * std / sqrt((double)n_all),
		      "pooled mean %g", mean);
	/* 0.27% of a normal sample lies beyond 3 sigma */
	ck_assert_msg(beyond3 > (int64_t)(0.001 * (double)n_all) &&
			  beyond3 < (int64_t)(0.005 * (double)n_all),
		      "%lld of %lld beyond 3 sigma", (long long)beyond3,
		      (long long)n_all);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_init_threads)
{
#ifdef _OPENMP
	epj_ctx *ctx = tu_ctx();
	int prev = omp_get_max_threads();
	uint64_t seed = (uint64_t)tu_randint(1, 1 << 30);
	/* large enough that a parallel fill would split it */
	tu_tmpfile t = tu_tmpfile_new(
	    "module", "config.json",
	    "{\"vocab_size\": 1031, \"hidden_size\": 48, "
	    "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
	    "\"head_dim\": 24, \"intermediate_size\": 64, "
	    "\"moe_intermediate_size\": 40, \"num_experts\": 3, "
	    "\"num_experts_per_tok\": 2}");
	omp_set_num_threads(1);
	epj_model *a = new_model(ctx, t.path, EPJ_LAYOUT_NESTED, seed);
	omp_set_num_threads(2);
	epj_model *b = new_model(ctx, t.path, EPJ_LAYOUT_NESTED, seed);
	omp_set_num_threads(3);
	epj_model *c = new_model(ctx, t.path, EPJ_LAYOUT_NESTED, seed);
	omp_set_num_threads(prev);
	tu_tmpfile_free(&t);
	const char *diff = NULL;
	ck_assert_msg(params_equal(ctx, a, b, &diff),
		      "1 vs 2 threads: parameter %s differs", diff);
	ck_assert_msg(params_equal(ctx, a, c, &diff),
		      "1 vs 3 threads: parameter %s differs", diff);
	epj_model_free(a);
	epj_model_free(b);
	epj_model_free(c);
	epj_ctx_free(ctx);
#endif
}
END_TEST

/* Bad model configs are refused with the key named; the root layout
 * refuses nothing but takes one block. */
START_TEST(test_model_new_errors)
{
	epj_ctx *ctx = tu_ctx();
	tu_tmpfile t = tu_tmpfile_new(
	    "module", "config.json",
	    "{\"vocab_size\": 11, \"hidden_size\": 10, "
	    "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
	    "\"head_dim\": 4, \"intermediate_size\": 7, "
	    "\"tie_word_embeddings\": true}");
	epj_model *m = (epj_model *)&t; /* must be reset to NULL */
	epj_status st = epj_model_new(ctx, t.path, NULL, &m);
	tu_tmpfile_free(&t);
	ck_assert_int_eq(st, EPJ_ERR_UNSUPPORTED);
	ck_assert_ptr_null(m);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "tie_word_embeddings"), "%s",
		      epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
	m = (epj_model *)&t;
	st = epj_model_new(ctx, "/nonexistent/epjit/config.json", NULL, &m);
	ck_assert_int_ne(st, EPJ_OK);
	ck_assert_ptr_null(m);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "/nonexistent/epjit"), "%s",
		      epj_ctx_error(ctx));
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_module_suite(void)
{
	Suite *s = suite_create("module");
	TCase *tc = tcase_create("tree");
	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, test_nested_tree);
	tcase_add_test(tc, test_root_tree);
	tcase_add_test(tc, test_param_names_nested);
	tcase_add_test(tc, test_builtin_tiny);
	tcase_add_test(tc, test_dense_layers);
	tcase_add_test(tc, test_call_container);
	tcase_add_test(tc, test_routing_record);
	suite_add_tcase(s, tc);
	TCase *ti = tcase_create("init");
	tcase_set_timeout(ti, 30);
	tcase_add_test(ti, test_init_seed);
	tcase_add_test(ti, test_init_keeps_ctx_rng);
	tcase_add_test(ti, test_init_distribution);
	tcase_add_test(ti, test_init_threads);
	tcase_add_test(ti, test_model_new_errors);
	suite_add_tcase(s, ti);
	return s;
}
