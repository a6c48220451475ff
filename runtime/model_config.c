/* model_config.c -- the Hugging Face config.json of a Qwen3-MoE, Mixtral,
 * Qwen2-MoE, DeepSeek-V2/V3 or Qwen3.5-MoE model (model_type "qwen3_moe",
 * the default when absent, "mixtral", "qwen2_moe", "deepseek_v2",
 * "deepseek_v3" or "qwen3_5_moe_text").
 *
 * The reader accepts a published config as is: HF files carry many keys the
 * trainer has no use for (token ids, architectures, use_cache ...), so keys
 * outside the table below are listed once at debug level and otherwise
 * ignored.  Keys the model builder reads are type- and range-checked, and
 * keys whose values would change the model in ways this library does not
 * implement (sliding windows, attention bias, RoPE scaling other than
 * linear and YaRN, another activation or model family, dropout) are
 * errors that
 * name the key, so a model is never silently built differently from the
 * checkpoint's definition.  A missing required key names any unused key that
 * looks like a typo of it.
 *
 * Invariants
 *  - On failure *out is all zeros; on success every field is set (defaults
 *    for optional keys, as HF's Qwen3MoeConfig would fill them, except that
 *    the MoE sizes are required when num_experts > 0).
 *  - mlp_only_layers holds distinct indices in [0, num_hidden_layers).
 */
#include "config_impl.h"

#include <inttypes.h>
#include <math.h>
#include <string.h>

#define SIZE_MAX_ ((int64_t)1 << 30) /* bound of every size and count */

/* Keys the model builder reads or checks; all others are "unused". */
static const char *const used_keys[] = {
	"vocab_size",
	"hidden_size",
	"num_hidden_layers",
	"num_attention_heads",
	"num_key_value_heads",
	"head_dim",
	"intermediate_size",
	"moe_intermediate_size",
	"num_experts",
	"num_local_experts",
	"num_experts_per_tok",
	"norm_topk_prob",
	"decoder_sparse_step",
	"mlp_only_layers",
	"rms_norm_eps",
	"rope_theta",
	"rope_parameters",
	"max_position_embeddings",
	"tie_word_embeddings",
	"initializer_range",
	"torch_dtype",
	"use_sliding_window",
	"attention_bias",
	"rope_scaling",
	"hidden_act",
	"model_type",
	"attention_dropout",
	"output_router_logits",
	"router_aux_loss_coef",
	"sliding_window",
	"router_jitter_noise",
	"qkv_bias",
	"shared_expert_intermediate_size",
	"layer_types",
	/* DeepSeek-V2/V3 */
	"n_routed_experts",
	"n_shared_experts",
	"routed_scaling_factor",
	"n_group",
	"topk_group",
	"topk_method",
	"scoring_func",
	"first_k_dense_replace",
	"q_lora_rank",
	"kv_lora_rank",
	"qk_nope_head_dim",
	"qk_rope_head_dim",
	"qk_head_dim",
	"v_head_dim",
	"rope_interleave",
	/* Qwen3.5-MoE */
	"linear_conv_kernel_dim",
	"linear_key_head_dim",
	"linear_value_head_dim",
	"linear_num_key_heads",
	"linear_num_value_heads",
	"partial_rotary_factor",
};

typedef struct mp {
	epj_ctx *ctx;
	const char *src;
	json_t *root;
	/* Keys of root not in used_keys (borrowed from root). */
	const char *unused[256];
	int n_unused;
} mp;

/* An EPJ_ERR_CONFIG error naming the config's source (ej_config_error). */
#define mp_err(p, ...) ej_config_error((p)->ctx, (p)->src, __VA_ARGS__)

static epj_status missing(mp *p, const char *key, const char *why)
{
	char hint[160] = "";
	const char *near = ej_nearest_key(key, p->unused, p->n_unused);
	if (near)
		snprintf(hint, sizeof hint, " (found \"%s\": a typo?)", near);
	return mp_err(p, "missing required key \"%s\"%s%s", key, why, hint);
}

/* Reads root[key] as an integer in [lo, SIZE_MAX_].  Absent or null: OK,
 * *out untouched, *given false. */
static epj_status rd_int(mp *p, const char *key, int64_t lo, int64_t *out,
			 bool *given)
{
	json_t *v = json_object_get(p->root, key);
	*given = false;
	if (!v || json_is_null(v))
		return EPJ_OK;
	const char *what = lo == 1   ? "a positive integer"
			   : lo == 0 ? "a non-negative integer"
				     : "an integer";
	int64_t x;
	char g[100];
	if (!ej_json_as_int(v, &x))
		return mp_err(p, "\"%s\" must be %s, got %s", key, what,
			      ej_json_describe(v, g, sizeof g));
	if (x < lo)
		return mp_err(p, "\"%s\" must be %s, got %" PRId64, key, what,
			      x);
	if (x > SIZE_MAX_)
		return mp_err(
		    p, "\"%s\" must be at most %" PRId64 ", got %" PRId64, key,
		    SIZE_MAX_, x);
	*out = x;
	*given = true;
	return EPJ_OK;
}

static epj_status rd_req(mp *p, const char *key, int64_t *out)
{
	bool given;
	epj_status s = rd_int(p, key, 1, out, &given);
	if (s == EPJ_OK && !given)
		return missing(p, key, "");
	return s;
}

/* A positive (or, with allow_zero, non-negative) finite number. */
static epj_status rd_num(mp *p, json_t *obj, const char *key, bool allow_zero,
			 double *out)
{
	json_t *v = json_object_get(obj, key);
	if (!v || json_is_null(v))
		return EPJ_OK;
	char g[100];
	const char *what = allow_zero ? "a number >= 0" : "a number > 0";
	if (!json_is_number(v))
		return mp_err(p, "\"%s\" must be %s, got %s", key, what,
			      ej_json_describe(v, g, sizeof g));
	double x = json_number_value(v);
	if (!(allow_zero ? x >= 0 : x > 0))
		return mp_err(p, "\"%s\" must be %s, got %g", key, what, x);
	*out = x;
	return EPJ_OK;
}

static epj_status rd_bool(mp *p, const char *key, bool *out)
{
	json_t *v = json_object_get(p->root, key);
	if (!v || json_is_null(v))
		return EPJ_OK;
	if (!json_is_boolean(v)) {
		char g[100];
		return mp_err(p, "\"%s\" must be a boolean, got %s", key,
			      ej_json_describe(v, g, sizeof g));
	}
	*out = json_is_true(v);
	return EPJ_OK;
}

/* Keys whose values select features this library does not implement;
 * m->family from model_type. */
static epj_status check_unsupported(mp *p, ej_model_config *m)
{
	epj_status s;
	bool b = false;
	char g[100];
	json_t *v;
	if ((s = rd_bool(p, "use_sliding_window", &b)))
		return s;
	if (b)
		return mp_err(p, "\"use_sliding_window\" is true: "
				 "sliding-window attention is not implemented "
				 "(set it to false)");
	b = false;
	if ((s = rd_bool(p, "attention_bias", &b)))
		return s;
	if (b)
		return mp_err(p, "\"attention_bias\" is true: attention "
				 "projections with bias are not implemented "
				 "(set it to false)");
	if ((v = json_object_get(p->root, "hidden_act")) && !json_is_null(v)) {
		if (!json_is_string(v))
			return mp_err(p,
				      "\"hidden_act\" must be a string, got %s",
				      ej_json_describe(v, g, sizeof g));
		if (strcmp(json_string_value(v), "silu") != 0)
			return mp_err(p,
				      "\"hidden_act\" is \"%.60s\": only "
				      "\"silu\" (SwiGLU) is implemented",
				      json_string_value(v));
	}
	if ((v = json_object_get(p->root, "model_type")) && !json_is_null(v)) {
		if (!json_is_string(v))
			return mp_err(p,
				      "\"model_type\" must be a string, got %s",
				      ej_json_describe(v, g, sizeof g));
		if (!strcmp(json_string_value(v), "mixtral"))
			m->family = EJ_FAMILY_MIXTRAL;
		else if (!strcmp(json_string_value(v), "qwen2_moe"))
			m->family = EJ_FAMILY_QWEN2_MOE;
		else if (!strcmp(json_string_value(v), "deepseek_v2"))
			m->family = EJ_FAMILY_DEEPSEEK_V2;
		else if (!strcmp(json_string_value(v), "deepseek_v3"))
			m->family = EJ_FAMILY_DEEPSEEK_V3;
		else if (!strcmp(json_string_value(v), "qwen3_5_moe_text"))
			m->family = EJ_FAMILY_QWEN3_5_MOE;
		else if (!strcmp(json_string_value(v), "qwen3_5_moe"))
			return mp_err(p, "\"model_type\" is \"qwen3_5_moe\": "
					 "the multimodal Qwen3.5-MoE config; "
					 "give its \"text_config\" (model_type "
					 "\"qwen3_5_moe_text\"): epjit builds "
					 "the text model");
		else if (strcmp(json_string_value(v), "qwen3_moe") != 0)
			return mp_err(p,
				      "\"model_type\" is \"%.60s\": the "
				      "model families implemented are "
				      "\"qwen3_moe\" (Qwen3-MoE), "
				      "\"mixtral\" (Mixtral), "
				      "\"qwen2_moe\" (Qwen2-MoE), "
				      "\"deepseek_v2\", \"deepseek_v3\" "
				      "(DeepSeek-V2/V3) and "
				      "\"qwen3_5_moe_text\" (Qwen3.5-MoE)",
				      json_string_value(v));
	}
	/* transformers 5's per-layer attention kinds: full attention only
	 * (Qwen3.5-MoE's linear attention: parse_qwen35) */
	if (m->family != EJ_FAMILY_QWEN3_5_MOE &&
	    (v = json_object_get(p->root, "layer_types")) && !json_is_null(v)) {
		if (!json_is_array(v))
			return mp_err(p,
				      "\"layer_types\" must be an array of "
				      "strings, got %s",
				      ej_json_describe(v, g, sizeof g));
		size_t i;
		json_t *x;
		json_array_foreach(v, i, x)
		{
			if (json_is_string(x) &&
			    !strcmp(json_string_value(x), "full_attention"))
				continue;
			char q[80];
			if (json_is_string(x))
				snprintf(q, sizeof q, "\"%.60s\"",
					 json_string_value(x));
			return mp_err(p,
				      "\"layer_types[%zu]\" is %s: only "
				      "\"full_attention\" is implemented "
				      "(sliding-window and linear attention "
				      "are not)",
				      i,
				      json_is_string(x)
					  ? q
					  : ej_json_describe(x, g, sizeof g));
		}
	}
	if (m->family == EJ_FAMILY_MIXTRAL) {
		double jitter = 0;
		if ((s = rd_num(p, p->root, "router_jitter_noise", true,
				&jitter)))
			return s;
		if (jitter != 0)
			return mp_err(p,
				      "\"router_jitter_noise\" is %g: router "
				      "jitter is not implemented (set it to "
				      "0)",
				      jitter);
	}
	double dropout = 0;
	if ((s = rd_num(p, p->root, "attention_dropout", true, &dropout)))
		return s;
	if (dropout != 0)
		return mp_err(p,
			      "\"attention_dropout\" is %g: dropout is not "
			      "implemented (set it to 0)",
			      dropout);
	return EPJ_OK;
}

/* A number of the rope object `o` (named `on`) into *out when present:
 * > 0, or >= 0 with allow_zero. */
static epj_status rope_num(mp *p, json_t *o, const char *on, const char *key,
			   bool allow_zero, double *out)
{
	json_t *v = json_object_get(o, key);
	char g[100];
	if (!v || json_is_null(v))
		return EPJ_OK;
	if (!json_is_number(v) || !(allow_zero ? json_number_value(v) >= 0
					       : json_number_value(v) > 0))
		return mp_err(p, "\"%s.%s\" must be a number %s, got %s", on,
			      key, allow_zero ? ">= 0" : "> 0",
			      ej_json_describe(v, g, sizeof g));
	*out = json_number_value(v);
	return EPJ_OK;
}

/* rope_theta, and the RoPE scaling of rope_parameters (transformers >= 5:
 * rope_type, rope_theta, factor, ...) or of the older rope_scaling (type or
 * rope_type, factor, ...): "default", "linear" (factor) or "yarn" (factor,
 * original_max_position_embeddings, beta_fast, beta_slow, mscale,
 * mscale_all_dim, attention_factor, truncate), as transformers'
 * modeling_rope_utils reads them; any other type is refused by name. */
static epj_status parse_rope(mp *p, ej_model_config *m)
{
	epj_status s;
	char g[100];
	if ((s = rd_num(p, p->root, "rope_theta", false, &m->rope_theta)) ||
	    (s = rd_num(p, p->root, "partial_rotary_factor", false,
			&m->partial_rotary_factor)))
		return s;
	json_t *rp = json_object_get(p->root, "rope_parameters");
	json_t *rs = json_object_get(p->root, "rope_scaling");
	const char *on = "rope_parameters";
	if (rp && !json_is_null(rp) && rs && !json_is_null(rs))
		return mp_err(p, "both \"rope_parameters\" and "
				 "\"rope_scaling\" are given: give one "
				 "(transformers 5 writes rope_parameters)");
	if (!rp || json_is_null(rp)) {
		rp = rs;
		on = "rope_scaling";
	}
	if (!rp || json_is_null(rp))
		return EPJ_OK;
	if (!json_is_object(rp))
		return mp_err(p, "\"%s\" must be an object, got %s", on,
			      ej_json_describe(rp, g, sizeof g));
	json_t *t = json_object_get(rp, "rope_type");
	if (!t || json_is_null(t))
		t = json_object_get(rp, "type");
	const char *ty = json_is_string(t) ? json_string_value(t) : "default";
	if (t && !json_is_null(t) && !json_is_string(t))
		return mp_err(p, "\"%s.rope_type\" must be a string, got %s",
			      on, ej_json_describe(t, g, sizeof g));
	if (!strcmp(ty, "default"))
		m->rope_type = EJ_ROPE_DEFAULT;
	else if (!strcmp(ty, "linear"))
		m->rope_type = EJ_ROPE_LINEAR;
	else if (!strcmp(ty, "yarn"))
		m->rope_type = EJ_ROPE_YARN;
	else
		return mp_err(p,
			      "\"%s.rope_type\" is \"%.40s\": the RoPE "
			      "types implemented are \"default\", "
			      "\"linear\" and \"yarn\"",
			      on, ty);
	if ((s = rope_num(p, rp, on, "rope_theta", false, &m->rope_theta)) ||
	    (s = rope_num(p, rp, on, "partial_rotary_factor", false,
			  &m->partial_rotary_factor)))
		return s;
	if (m->rope_type == EJ_ROPE_DEFAULT)
		return EPJ_OK;
	m->rope_factor = 0;
	if ((s = rope_num(p, rp, on, "factor", false, &m->rope_factor)))
		return s;
	if (m->rope_factor == 0)
		return mp_err(p,
			      "\"%s.factor\" is required by rope type "
			      "\"%s\"",
			      on, ty);
	if (m->rope_type == EJ_ROPE_LINEAR)
		return EPJ_OK;
	double om = 0;
	if ((s = rope_num(p, rp, on, "original_max_position_embeddings", false,
			  &om)) ||
	    (s = rope_num(p, rp, on, "beta_fast", false, &m->rope_beta_fast)) ||
	    (s = rope_num(p, rp, on, "beta_slow", false, &m->rope_beta_slow)) ||
	    (s = rope_num(p, rp, on, "mscale", true, &m->rope_mscale)) ||
	    (s = rope_num(p, rp, on, "mscale_all_dim", true,
			  &m->rope_mscale_all_dim)) ||
	    (s = rope_num(p, rp, on, "attention_factor", false,
			  &m->rope_attention_factor)))
		return s;
	m->rope_original_max = (int64_t)om;
	json_t *tr = json_object_get(rp, "truncate");
	if (tr && !json_is_null(tr)) {
		if (!json_is_boolean(tr))
			return mp_err(p,
				      "\"%s.truncate\" must be a boolean, "
				      "got %s",
				      on, ej_json_describe(tr, g, sizeof g));
		m->rope_truncate = json_is_true(tr);
	}
	return EPJ_OK;
}

static epj_status parse_mlp_only(mp *p, ej_model_config *m)
{
	json_t *v = json_object_get(p->root, "mlp_only_layers");
	char g[100];
	if (!v || json_is_null(v))
		return EPJ_OK;
	if (!json_is_array(v))
		return mp_err(p,
			      "\"mlp_only_layers\" must be an array of layer "
			      "indices, got %s",
			      ej_json_describe(v, g, sizeof g));
	size_t i;
	json_t *x;
	json_array_foreach(v, i, x)
	{
		int64_t l;
		if (!ej_json_as_int(x, &l))
			return mp_err(p,
				      "\"mlp_only_layers[%zu]\" must be an "
				      "integer, got %s",
				      i, ej_json_describe(x, g, sizeof g));
		if (l < 0 || l >= m->num_hidden_layers)
			return mp_err(p,
				      "\"mlp_only_layers[%zu]\" = %" PRId64
				      " is not a layer index in [0, %d) "
				      "(num_hidden_layers)",
				      i, l, m->num_hidden_layers);
		for (int j = 0; j < m->n_mlp_only_layers; j++)
			if (m->mlp_only_layers[j] == l)
				return mp_err(p,
					      "\"mlp_only_layers[%zu]\" = "
					      "%" PRId64 " is listed twice",
					      i, l);
		m->mlp_only_layers[m->n_mlp_only_layers++] = (int)l;
	}
	return EPJ_OK;
}

/* num_experts_per_tok: required (`why` says when), at most the expert
 * count m->num_experts, which the config gave as count_key. */
static epj_status rd_top_k(mp *p, ej_model_config *m, const char *count_key,
			   const char *why)
{
	int64_t x = 0;
	bool given;
	epj_status s = rd_int(p, "num_experts_per_tok", 1, &x, &given);
	if (s)
		return s;
	if (!given)
		return missing(p, "num_experts_per_tok", why);
	if (x > m->num_experts)
		return mp_err(p,
			      "\"num_experts_per_tok\" (%" PRId64
			      ") must not exceed \"%s\" (%d)",
			      x, count_key, m->num_experts);
	m->num_experts_per_tok = (int)x;
	return EPJ_OK;
}

/* Mixtral's MoE: every layer a sparse block of num_local_experts experts
 * of intermediate_size, top num_experts_per_tok renormalised (Mixtral has
 * no norm_topk_prob: it always renormalises); sliding_window null or a
 * length (the model refuses a longer sequence).  Qwen3-MoE's MoE keys are
 * not Mixtral's and are ignored, as MixtralConfig ignores them. */
static epj_status parse_mixtral_moe(mp *p, ej_model_config *m)
{
	epj_status s;
	int64_t x = 0;
	bool given;
	const char *why = " (Mixtral's expert count; every layer is sparse)";
	if ((s = rd_int(p, "num_local_experts", 1, &x, &given)))
		return s;
	if (!given)
		return missing(p, "num_local_experts", why);
	if (x > (1 << 16)) /* the AutoEP layer's limit */
		return mp_err(p,
			      "\"num_local_experts\" (%" PRId64
			      ") is out of range [1, %d]",
			      x, 1 << 16);
	m->num_experts = (int)x;
	if ((s = rd_top_k(p, m, "num_local_experts", why)))
		return s;
	m->moe_intermediate_size = m->intermediate_size;
	m->norm_topk_prob = true;
	m->decoder_sparse_step = 1;
	m->n_mlp_only_layers = 0;
	return rd_int(p, "sliding_window", 1, &m->sliding_window, &given);
}

/* A string key of the root that must be one of `ok` (n of them) when given;
 * *out the index found, untouched when absent. */
static epj_status rd_choice(mp *p, const char *key, const char *const *ok,
			    int n, const char *known, int *out)
{
	json_t *v = json_object_get(p->root, key);
	char g[100];
	if (!v || json_is_null(v))
		return EPJ_OK;
	for (int i = 0; json_is_string(v) && i < n; i++)
		if (!strcmp(json_string_value(v), ok[i])) {
			*out = i;
			return EPJ_OK;
		}
	return mp_err(p, "\"%s\" is %s: %s", key,
		      ej_json_describe(v, g, sizeof g), known);
}

/* DeepSeek: transformers' defaults, and the latent attention's head sizes
 * and LoRA ranks. */
static epj_status deepseek_mla(mp *p, ej_model_config *m)
{
	const bool v3 = m->family == EJ_FAMILY_DEEPSEEK_V3;
	const char *fam = v3 ? "DeepSeek-V3" : "DeepSeek-V2";
	epj_status s;
	int64_t x;
	bool given;
	m->mla = true;
	m->qk_norm = false;
	if (m->num_key_value_heads != m->num_attention_heads)
		return mp_err(p,
			      "\"num_key_value_heads\" (%d) must equal "
			      "\"num_attention_heads\" (%d): %s's latent "
			      "attention expands keys and values to every "
			      "head",
			      m->num_key_value_heads, m->num_attention_heads,
			      fam);
	/* transformers' defaults */
	m->q_lora_rank = 1536;
	m->kv_lora_rank = 512;
	m->qk_nope_head_dim = 128;
	m->qk_rope_head_dim = 64;
	m->v_head_dim = 128;
	m->rope_interleave = true; /* V2's complex rope is interleaved */
	m->first_k_dense_replace = v3 ? 3 : 0;
	m->n_shared_experts = v3 ? 1 : 2;
	m->routed_scaling_factor = v3 ? 2.5 : 1.0;
	m->norm_topk_prob = v3;
	m->max_position_embeddings = v3 ? 4096 : 2048;
	json_t *ql = json_object_get(p->root, "q_lora_rank");
	if (ql && json_is_null(ql))
		m->q_lora_rank = 0; /* q_proj */
	else if ((s = rd_int(p, "q_lora_rank", 1, &m->q_lora_rank, &given)))
		return s;
	if ((s = rd_int(p, "kv_lora_rank", 1, &m->kv_lora_rank, &given)))
		return s;
	x = m->qk_nope_head_dim;
	if ((s = rd_int(p, "qk_nope_head_dim", 1, &x, &given)))
		return s;
	m->qk_nope_head_dim = (int)x;
	x = m->qk_rope_head_dim;
	if ((s = rd_int(p, "qk_rope_head_dim", 1, &x, &given)))
		return s;
	m->qk_rope_head_dim = (int)x;
	x = m->v_head_dim;
	if ((s = rd_int(p, "v_head_dim", 1, &x, &given)))
		return s;
	m->v_head_dim = (int)x;
	if (m->qk_rope_head_dim % 2 != 0)
		return mp_err(p,
			      "\"qk_rope_head_dim\" (%d) must be even: rotary "
			      "embeddings rotate pairs of dimensions",
			      m->qk_rope_head_dim);
	x = 0;
	if ((s = rd_int(p, "qk_head_dim", 1, &x, &given)))
		return s;
	if (given && x != m->qk_nope_head_dim + m->qk_rope_head_dim)
		return mp_err(p,
			      "\"qk_head_dim\" (%" PRId64 ") must be "
			      "qk_nope_head_dim + qk_rope_head_dim (%d)",
			      x, m->qk_nope_head_dim + m->qk_rope_head_dim);
	/* transformers sets head_dim to the rope part (the rope tables') */
	m->head_dim = m->qk_rope_head_dim;
	if (v3 && (s = rd_bool(p, "rope_interleave", &m->rope_interleave)))
		return s;

	return EPJ_OK;
}

/* DeepSeek's routed and shared experts and dense first layers. */
static epj_status deepseek_experts(mp *p, ej_model_config *m)
{
	const bool v3 = m->family == EJ_FAMILY_DEEPSEEK_V3;
	epj_status s;
	int64_t x;
	bool given;
	/* experts: n_routed_experts, or the name transformers maps to it */
	const char *alias = v3 ? "num_local_experts" : "num_experts";
	int64_t xa = 0;
	bool given_a;
	x = 0;
	if ((s = rd_int(p, "n_routed_experts", 1, &x, &given)) ||
	    (s = rd_int(p, alias, 1, &xa, &given_a)))
		return s;
	if (given && given_a && x != xa)
		return mp_err(p,
			      "\"n_routed_experts\" (%" PRId64 ") and \"%s\" "
			      "(%" PRId64 ") disagree: they name the same "
			      "expert count",
			      x, alias, xa);
	if (!given && !given_a)
		return missing(p, "n_routed_experts",
			       " (the routed expert count; also read as "
			       "num_local_experts / num_experts)");
	if (!given)
		x = xa;
	if (x > (1 << 16))
		return mp_err(p,
			      "\"n_routed_experts\" (%" PRId64 ") is out of "
			      "range [1, %d]",
			      x, 1 << 16);
	m->num_experts = (int)x;
	if ((s = rd_top_k(p, m, "n_routed_experts", "")))
		return s;
	if ((s = rd_int(p, "moe_intermediate_size", 1,
			&m->moe_intermediate_size, &given)))
		return s;
	if (!given)
		return missing(p, "moe_intermediate_size", "");
	x = m->n_shared_experts;
	if ((s = rd_int(p, "n_shared_experts", 1, &x, &given)))
		return s;
	m->n_shared_experts = (int)x;
	x = m->first_k_dense_replace;
	if ((s = rd_int(p, "first_k_dense_replace", 0, &x, &given)))
		return s;
	if (x > m->num_hidden_layers)
		return mp_err(p,
			      "\"first_k_dense_replace\" (%" PRId64 ") must "
			      "not exceed \"num_hidden_layers\" (%d)",
			      x, m->num_hidden_layers);
	m->first_k_dense_replace = (int)x;
	if ((s = rd_num(p, p->root, "routed_scaling_factor", false,
			&m->routed_scaling_factor)))
		return s;
	if (v3 && (s = rd_bool(p, "norm_topk_prob", &m->norm_topk_prob)))
		return s;

	return EPJ_OK;
}

/* DeepSeek's scoring, top-k method and expert groups. */
static epj_status deepseek_routing(mp *p, ej_model_config *m)
{
	const bool v3 = m->family == EJ_FAMILY_DEEPSEEK_V3;
	epj_status s;
	bool given;

	/* scoring and the top-k method */
	static const char *const v2_methods[] = { "greedy",
						  "group_limited_greedy" };
	static const char *const v3_methods[] = { "noaux_tc" };
	static const char *const v2_score[] = { "softmax" };
	static const char *const v3_score[] = { "sigmoid" };
	int method = 0, score = 0;
	if ((s = rd_choice(p, "topk_method", v3 ? v3_methods : v2_methods,
			   v3 ? 1 : 2,
			   v3 ? "DeepSeek-V3 routes by \"noaux_tc\" only"
			      : "the methods implemented are \"greedy\" and "
				"\"group_limited_greedy\"",
			   &method)) ||
	    (s = rd_choice(p, "scoring_func", v3 ? v3_score : v2_score, 1,
			   v3 ? "DeepSeek-V3 scores by \"sigmoid\" only"
			      : "DeepSeek-V2 scores by \"softmax\" only",
			   &score)))
		return s;
	m->scoring = v3 ? EJ_SCORE_SIGMOID : EJ_SCORE_SOFTMAX;
	m->score_bias = v3;
	m->groups = v3		  ? EJ_GROUPS_TOP2
		    : method == 1 ? EJ_GROUPS_MAX
				  : EJ_GROUPS_NONE;
	m->n_group = m->topk_group = 0;
	if (m->groups != EJ_GROUPS_NONE) {
		int64_t ng = v3 ? 8 : 0, tg = v3 ? 4 : 0;
		if ((s = rd_int(p, "n_group", 1, &ng, &given)) ||
		    (s = rd_int(p, "topk_group", 1, &tg, &given)))
			return s;
		if (ng == 0 || tg == 0)
			return missing(p, ng == 0 ? "n_group" : "topk_group",
				       " (group-limited routing)");
		if (m->num_experts % ng != 0)
			return mp_err(p,
				      "\"n_routed_experts\" (%d) must be a "
				      "multiple of \"n_group\" (%" PRId64 ")",
				      m->num_experts, ng);
		if (tg > ng)
			return mp_err(p,
				      "\"topk_group\" (%" PRId64 ") must not "
				      "exceed \"n_group\" (%" PRId64 ")",
				      tg, ng);
		if (v3 && m->num_experts / ng < 2)
			return mp_err(p,
				      "\"n_group\" (%" PRId64 ") leaves fewer "
				      "than 2 experts a group: DeepSeek-V3 "
				      "scores a group by its best two",
				      ng);
		if (m->num_experts_per_tok > tg * (m->num_experts / ng))
			return mp_err(p,
				      "\"num_experts_per_tok\" (%d) exceeds "
				      "the %" PRId64 " experts of the "
				      "\"topk_group\" groups kept",
				      m->num_experts_per_tok,
				      tg * (m->num_experts / ng));
		m->n_group = (int)ng;
		m->topk_group = (int)tg;
	}
	return EPJ_OK;
}

/* DeepSeek-V2 / V3 (transformers' DeepseekV2Config / DeepseekV3Config):
 * multi-head latent attention, first_k_dense_replace dense layers, every
 * other layer a MoE of n_routed_experts with n_shared_experts shared ones.
 * V2 routes by softmax, greedy or group-limited (topk_method), times
 * routed_scaling_factor, never renormalised (transformers' V2 router has
 * no renormalisation); V3 by sigmoid plus the e_score_correction_bias,
 * always group-limited (n_group, topk_group; the sum of a group's two
 * best), renormalised when norm_topk_prob, times routed_scaling_factor. */
static epj_status parse_deepseek(mp *p, ej_model_config *m)
{
	epj_status s;
	if ((s = deepseek_mla(p, m)) || (s = deepseek_experts(p, m)) ||
	    (s = deepseek_routing(p, m)))
		return s;
	m->decoder_sparse_step = 1;
	m->n_mlp_only_layers = 0;
	return EPJ_OK;
}

/* Qwen3.5-MoE (transformers' Qwen3_5MoeTextConfig): Qwen3-MoE's keys (every
 * layer a MoE, always renormalised, with Qwen2's gated shared expert), the
 * Gated DeltaNet sizes, layer_types (default: full attention every 4th
 * layer) and the partial rope; after the rest (parse_rope). */
static epj_status parse_qwen35(mp *p, ej_model_config *m)
{
	epj_status s;
	int64_t x;
	bool given;
	char g[100];
	struct {
		const char *key;
		int *f;
	} lin[] = {
		{ "linear_conv_kernel_dim", &m->linear_conv_kernel_dim },
		{ "linear_key_head_dim", &m->linear_key_head_dim },
		{ "linear_value_head_dim", &m->linear_value_head_dim },
		{ "linear_num_key_heads", &m->linear_num_key_heads },
		{ "linear_num_value_heads", &m->linear_num_value_heads },
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(lin); i++) {
		x = *lin[i].f;
		if ((s = rd_int(p, lin[i].key, 1, &x, &given)))
			return s;
		*lin[i].f = (int)x;
	}
	if (m->linear_num_value_heads % m->linear_num_key_heads != 0)
		return mp_err(p,
			      "\"linear_num_value_heads\" (%d) must be a "
			      "multiple of \"linear_num_key_heads\" (%d)",
			      m->linear_num_value_heads,
			      m->linear_num_key_heads);
	json_t *v = json_object_get(p->root, "layer_types");
	if (!v || json_is_null(v)) {
		for (int i = 0; i < m->num_hidden_layers; i++)
			m->linear_layer[i] = (i + 1) % 4 != 0;
	} else {
		if (!json_is_array(v) ||
		    json_array_size(v) != (size_t)m->num_hidden_layers)
			return mp_err(p,
				      "\"layer_types\" must be an array of "
				      "num_hidden_layers (%d) strings, got %s",
				      m->num_hidden_layers,
				      ej_json_describe(v, g, sizeof g));
		size_t i;
		json_t *e;
		json_array_foreach(v, i, e)
		{
			const char *t =
			    json_is_string(e) ? json_string_value(e) : "";
			if (strcmp(t, "linear_attention") &&
			    strcmp(t, "full_attention"))
				return mp_err(p,
					      "\"layer_types[%zu]\" is %s: "
					      "Qwen3.5-MoE's kinds are "
					      "\"linear_attention\" and "
					      "\"full_attention\"",
					      i,
					      ej_json_describe(e, g, sizeof g));
			m->linear_layer[i] = t[0] == 'l';
		}
	}
	m->norm_offset = true;
	m->attn_output_gate = true;
	m->norm_topk_prob = true; /* its router always renormalises */
	m->decoder_sparse_step = 1;
	m->n_mlp_only_layers = 0;
	return EPJ_OK;
}

/* The rope's dimensions: head_dim times partial_rotary_factor (Qwen3.5),
 * even; any other family rotates whole heads. */
static epj_status parse_rotary(mp *p, ej_model_config *m)
{
	if (m->family != EJ_FAMILY_QWEN3_5_MOE) {
		if (m->partial_rotary_factor != 1)
			return mp_err(p,
				      "\"partial_rotary_factor\" is %g: a "
				      "partial rope is implemented for "
				      "Qwen3.5-MoE only",
				      m->partial_rotary_factor);
		return EPJ_OK;
	}
	if (m->partial_rotary_factor > 1)
		return mp_err(p, "\"partial_rotary_factor\" is %g: at most 1",
			      m->partial_rotary_factor);
	m->rotary_dim = (int)(m->head_dim * m->partial_rotary_factor);
	if (m->rotary_dim < 2 || m->rotary_dim % 2 != 0)
		return mp_err(p,
			      "head_dim (%d) x partial_rotary_factor (%g) = %d "
			      "rope dimensions: must be even and at least 2",
			      m->head_dim, m->partial_rotary_factor,
			      m->rotary_dim);
	return EPJ_OK;
}

/* The family's defaults that differ from Qwen3-MoE's (before the keys are
 * read, so that given keys win). */
static epj_status family_defaults(mp *p, ej_model_config *m)
{
	epj_status s;
	m->qk_norm = m->family == EJ_FAMILY_QWEN3_MOE ||
		     m->family == EJ_FAMILY_QWEN3_5_MOE;
	if (m->family == EJ_FAMILY_QWEN3_5_MOE)
		m->partial_rotary_factor = 0.25; /* transformers' default */
	if (m->family == EJ_FAMILY_QWEN2_MOE) {
		m->qkv_bias = true; /* Qwen2MoeConfig's default */
		if ((s = rd_bool(p, "qkv_bias", &m->qkv_bias)))
			return s;
	}
	if (m->family == EJ_FAMILY_MIXTRAL) {
		/* MixtralConfig's defaults */
		m->rms_norm_eps = 1e-5;
		m->rope_theta = 1e6;
		m->max_position_embeddings = 4096 * 32;
	}
	return EPJ_OK;
}

/* The required sizes and the attention heads. */
static epj_status parse_sizes(mp *p, ej_model_config *m)
{
	epj_status s;
	int64_t x;
	bool given;
	/* Required sizes. */
	if ((s = rd_req(p, "vocab_size", &m->vocab_size)) ||
	    (s = rd_req(p, "hidden_size", &m->hidden_size)))
		return s;
	if ((s = rd_req(p, "num_hidden_layers", &x)))
		return s;
	if (x > EJ_MODEL_MAX_LAYERS)
		return mp_err(p,
			      "\"num_hidden_layers\" is %" PRId64
			      ": at most %d layers are supported",
			      x, EJ_MODEL_MAX_LAYERS);
	m->num_hidden_layers = (int)x;
	if ((s = rd_req(p, "num_attention_heads", &x)))
		return s;
	m->num_attention_heads = (int)x;
	/* Qwen3.5-MoE has no dense MLP, so no intermediate_size */
	if (m->family == EJ_FAMILY_QWEN3_5_MOE
		? (s = rd_int(p, "intermediate_size", 1, &m->intermediate_size,
			      &given))
		: (s = rd_req(p, "intermediate_size", &m->intermediate_size)))
		return s;

	/* Attention geometry. */
	x = m->num_attention_heads;
	if ((s = rd_int(p, "num_key_value_heads", 1, &x, &given)))
		return s;
	m->num_key_value_heads = (int)x;
	if (m->num_attention_heads % m->num_key_value_heads != 0)
		return mp_err(p,
			      "\"num_attention_heads\" (%d) must be a multiple "
			      "of \"num_key_value_heads\" (%d)",
			      m->num_attention_heads, m->num_key_value_heads);
	return EPJ_OK;
}

/* head_dim: given, the family's default, or hidden / heads; even. */
static epj_status parse_head_dim(mp *p, ej_model_config *m)
{
	epj_status s;
	int64_t x;
	bool given;
	if ((s = rd_int(p, "head_dim", 1, &x, &given)))
		return s;
	if (given) {
		m->head_dim = (int)x;
	} else if (m->family == EJ_FAMILY_QWEN3_5_MOE) {
		m->head_dim = 256; /* Qwen3_5MoeTextConfig's default */
	} else {
		if (m->hidden_size % m->num_attention_heads != 0)
			return mp_err(p,
				      "\"head_dim\" is absent and "
				      "\"hidden_size\" (%" PRId64
				      ") is not divisible by "
				      "\"num_attention_heads\" (%d): give "
				      "head_dim",
				      m->hidden_size, m->num_attention_heads);
		m->head_dim = (int)(m->hidden_size / m->num_attention_heads);
	}
	if (m->head_dim % 2 != 0)
		return mp_err(p,
			      "\"head_dim\" (%d) must be even: rotary "
			      "embeddings rotate pairs of dimensions",
			      m->head_dim);

	return EPJ_OK;
}

/* The experts of Qwen3-MoE, Qwen2-MoE and Qwen3.5-MoE, and which layers
 * are MoE layers. */
static epj_status parse_qwen_experts(mp *p, ej_model_config *m)
{
	epj_status s;
	int64_t x;
	bool given;

	/* Experts: "num_experts" (transformers 4's Qwen3-MoE spelling) or
	 * "num_local_experts" (the spelling transformers 5 writes); both given
	 * must agree.  Neither given in a config that has MoE keys
	 * (num_experts_per_tok, moe_intermediate_size) or says qwen3_moe is an
	 * error, never a dense model: transformers itself would build 128
	 * experts there (its default), so a dense model would silently train
	 * something else. */
	x = 0;
	int64_t xl = 0;
	bool given_l = false;
	if ((s = rd_int(p, "num_experts", 0, &x, &given)))
		return s;
	if ((s = rd_int(p, "num_local_experts", 0, &xl, &given_l)))
		return s;
	if (given && given_l && x != xl)
		return mp_err(p,
			      "\"num_experts\" (%" PRId64
			      ") and \"num_local_experts\" (%" PRId64
			      ") disagree: they name the same expert count",
			      x, xl);
	if (!given && given_l) {
		x = xl;
		given = true;
	}
	if (!given) {
		json_t *mt = json_object_get(p->root, "model_type");
		const char *moe_key =
		    json_object_get(p->root, "num_experts_per_tok")
			? "num_experts_per_tok"
		    : json_object_get(p->root, "moe_intermediate_size")
			? "moe_intermediate_size"
		    : json_is_string(mt) &&
			    !strcmp(json_string_value(mt), "qwen3_moe")
			? "model_type \"qwen3_moe\""
		    : json_is_string(mt) &&
			    !strcmp(json_string_value(mt), "qwen2_moe")
			? "model_type \"qwen2_moe\""
			: NULL;
		if (moe_key)
			return mp_err(
			    p,
			    "no expert count: looked for "
			    "\"num_experts\" and \"num_local_experts\" "
			    "and found neither, but the config has "
			    "%s; set one (0 for a dense model)",
			    moe_key);
	}
	if (x > (1 << 16)) /* the AutoEP layer's limit */
		return mp_err(p,
			      "\"num_experts\" (%" PRId64 ") is out of range "
			      "[0, %d]",
			      x, 1 << 16);
	m->num_experts = (int)x;
	if (m->num_experts > 0) {
		const char *why = " (num_experts > 0)";
		if ((s = rd_top_k(p, m, "num_experts", why)))
			return s;
		if ((s = rd_int(p, "moe_intermediate_size", 1,
				&m->moe_intermediate_size, &given)))
			return s;
		if (!given)
			return missing(p, "moe_intermediate_size", why);
		if (m->family == EJ_FAMILY_QWEN2_MOE ||
		    m->family == EJ_FAMILY_QWEN3_5_MOE) {
			/* the shared expert of every MoE layer */
			if ((s = rd_int(p, "shared_expert_intermediate_size", 1,
					&m->shared_expert_intermediate_size,
					&given)))
				return s;
			if (!given)
				return missing(
				    p, "shared_expert_intermediate_size",
				    " (Qwen2-MoE or Qwen3.5-MoE with "
				    "num_experts > 0)");
		}
	} else {
		/* Still type-check them: a typo'd value should not pass. */
		int64_t unused;
		if ((s = rd_int(p, "num_experts_per_tok", 1, &unused,
				&given)) ||
		    (s = rd_int(p, "moe_intermediate_size", 1, &unused,
				&given)))
			return s;
	}
	x = 1;
	if ((s = rd_int(p, "decoder_sparse_step", 1, &x, &given)))
		return s;
	m->decoder_sparse_step = (int)x;
	if ((s = rd_bool(p, "norm_topk_prob", &m->norm_topk_prob)) ||
	    (s = parse_mlp_only(p, m)))
		return s;
	return EPJ_OK;
}

/* transformers' auxiliary load-balancing loss: output_router_logits (false)
 * and router_aux_loss_coef (0.001, the default of Qwen3MoeConfig,
 * MixtralConfig, Qwen2MoeConfig and Qwen3_5MoeTextConfig).  DeepSeek-V2/V3
 * read both as their configs do; their modeling code in transformers adds
 * no auxiliary loss, so neither does epjit (runtime/router_loss.c). */
static epj_status parse_router_loss(mp *p, ej_model_config *m)
{
	epj_status s;
	if ((s = rd_bool(p, "output_router_logits", &m->output_router_logits)))
		return s;
	json_t *v = json_object_get(p->root, "router_aux_loss_coef");
	if (v && !json_is_null(v) &&
	    (!json_is_number(v) || !isfinite(json_number_value(v)))) {
		char g[100];
		return mp_err(p,
			      "\"router_aux_loss_coef\" must be a finite "
			      "number, got %s",
			      ej_json_describe(v, g, sizeof g));
	}
	if (v && !json_is_null(v))
		m->router_aux_loss_coef = json_number_value(v);
	return EPJ_OK;
}

/* What every family reads alike: norms, rope, positions, ties, init,
 * dtype, the router loss. */
static epj_status parse_common(mp *p, ej_model_config *m)
{
	epj_status s;
	bool given;
	char g[100];
	if ((s = rd_num(p, p->root, "rms_norm_eps", false, &m->rms_norm_eps)) ||
	    (s = parse_rope(p, m)) ||
	    (s = rd_int(p, "max_position_embeddings", 1,
			&m->max_position_embeddings, &given)) ||
	    (s = rd_bool(p, "tie_word_embeddings", &m->tie_word_embeddings)) ||
	    (s = rd_num(p, p->root, "initializer_range", true,
			&m->initializer_range)))
		return s;
	if (m->family == EJ_FAMILY_QWEN3_5_MOE && (s = parse_qwen35(p, m)))
		return s;
	if ((s = parse_rotary(p, m)) || (s = parse_router_loss(p, m)))
		return s;
	json_t *v = json_object_get(p->root, "torch_dtype");
	if (v && !json_is_null(v)) {
		if (!json_is_string(v))
			return mp_err(
			    p, "\"torch_dtype\" must be a string, got %s",
			    ej_json_describe(v, g, sizeof g));
		snprintf(m->torch_dtype, sizeof m->torch_dtype, "%s",
			 json_string_value(v));
	}
	return EPJ_OK;
}

static epj_status parse_model(mp *p, ej_model_config *m)
{
	epj_status s;
	if ((s = check_unsupported(p, m)) || (s = family_defaults(p, m)) ||
	    (s = parse_sizes(p, m)))
		return s;
	if (m->family == EJ_FAMILY_DEEPSEEK_V2 ||
	    m->family == EJ_FAMILY_DEEPSEEK_V3)
		s = parse_deepseek(p, m);
	else if ((s = parse_head_dim(p, m)) == EPJ_OK)
		s = m->family == EJ_FAMILY_MIXTRAL ? parse_mixtral_moe(p, m)
						   : parse_qwen_experts(p, m);
	return s ? s : parse_common(p, m);
}

static void model_defaults(ej_model_config *m)
{
	/* HF Qwen3MoeConfig's defaults for the optional keys. */
	memset(m, 0, sizeof *m);
	m->family = EJ_FAMILY_QWEN3_MOE;
	m->qk_norm = true;
	m->decoder_sparse_step = 1;
	m->rms_norm_eps = 1e-6;
	m->rope_theta = 10000.0;
	m->max_position_embeddings = 32768;
	m->initializer_range = 0.02;
	m->rope_beta_fast = 32;
	m->rope_beta_slow = 1;
	m->rope_truncate = true;
	m->routed_scaling_factor = 1.0;
	m->partial_rotary_factor = 1.0;
	m->router_aux_loss_coef = 0.001;
	/* Qwen3_5MoeTextConfig's defaults (read for that family only) */
	m->linear_conv_kernel_dim = 4;
	m->linear_key_head_dim = 128;
	m->linear_value_head_dim = 128;
	m->linear_num_key_heads = 16;
	m->linear_num_value_heads = 32;
}

epj_status ej_model_config_parse(epj_ctx *ctx, const char *json_text,
				 const char *source_name, ej_model_config *out)
{
	EJ_ASSERT(out);
	memset(out, 0, sizeof *out);
	mp p = { .ctx = ctx, .src = source_name ? source_name : "<string>" };
	json_t *root;
	epj_status s = ej_config_json_object(ctx, json_text, p.src, &root);
	if (s != EPJ_OK)
		return s;
	p.root = root;

	/* Unused keys, listed once at debug level. */
	char list[900];
	size_t o = 0;
	list[0] = '\0';
	const char *key;
	json_t *val;
	json_object_foreach(root, key, val)
	{
		bool used = false;
		for (size_t i = 0; i < EJ_ARRAY_LEN(used_keys) && !used; i++)
			used = strcmp(key, used_keys[i]) == 0;
		if (used)
			continue;
		if (p.n_unused < (int)EJ_ARRAY_LEN(p.unused))
			p.unused[p.n_unused++] = key;
		if (o < sizeof list)
			o += (size_t)snprintf(list + o, sizeof list - o, "%s%s",
					      o ? ", " : "", key);
	}
	if (p.n_unused)
		epj_log_msg(EPJ_LOG_DEBUG, "%s: keys not used by epjit: %s",
			    p.src, list);

	ej_model_config *tmp = malloc(sizeof *tmp);
	if (!tmp) {
		json_decref(root);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"config error in %s: out of memory", p.src);
	}
	model_defaults(tmp);
	s = parse_model(&p, tmp);
	if (s == EPJ_OK)
		*out = *tmp;
	free(tmp);
	json_decref(root);
	return s;
}

epj_status ej_model_config_load(epj_ctx *ctx, const char *path,
				ej_model_config *out)
{
	EJ_ASSERT(out && path);
	memset(out, 0, sizeof *out);
	char *text = ej_config_read_file(ctx, path);
	if (!text)
		return epj_ctx_status(ctx);
	epj_status s = ej_model_config_parse(ctx, text, path, out);
	free(text);
	return s;
}

/* One "KEY=VALUE" edit of root (the config of src). */
static epj_status apply_override(epj_ctx *ctx, const char *src, json_t *root,
				 const char *ov)
{
	const char *eq = strchr(ov, '=');
	if (!eq || eq == ov)
		return ej_config_error(
		    ctx, src, "override \"%.200s\" must be KEY=VALUE", ov);
	char key[128];
	if ((size_t)(eq - ov) >= sizeof key)
		return ej_config_error(ctx, src,
				       "override \"%.200s\": the key is too "
				       "long",
				       ov);
	memcpy(key, ov, (size_t)(eq - ov));
	key[eq - ov] = '\0';
	/* The file's own keys, then those the model reads. */
	const char *cands[256 + EJ_ARRAY_LEN(used_keys)];
	int n = 0;
	bool known = false;
	const char *k;
	json_t *v;
	json_object_foreach(root, k, v)
	{
		if (n < 256)
			cands[n++] = k;
		known |= strcmp(k, key) == 0;
	}
	for (size_t i = 0; i < EJ_ARRAY_LEN(used_keys); i++) {
		cands[n++] = used_keys[i];
		known |= strcmp(used_keys[i], key) == 0;
	}
	if (!known) {
		const char *near = ej_nearest_key(key, cands, n);
		char hint[200] = "";
		if (near)
			snprintf(hint, sizeof hint, " (did you mean \"%s\"?)",
				 near);
		return ej_config_error(ctx, src,
				       "override \"%.200s\": unknown key "
				       "\"%s\"%s: it is neither in the file "
				       "nor a key the model reads",
				       ov, key, hint);
	}
	const char *text = eq + 1;
	json_t *val = json_loads(text, JSON_DECODE_ANY, NULL);
	if (!val)
		val = json_string(text); /* a bare word: silu, bfloat16 */
	if (!val)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"config error in %s: out of memory", src);
	if (json_is_object(val) || json_is_array(val)) {
		json_decref(val);
		return ej_config_error(ctx, src,
				       "override \"%.200s\": the value must be "
				       "a JSON scalar (integer, real, true, "
				       "false, null or a string)",
				       ov);
	}
	if (json_object_set_new(root, key, val) != 0)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"config error in %s: out of memory", src);
	epj_log_msg(EPJ_LOG_INFO, "%s: override %s", src, ov);
	return EPJ_OK;
}

epj_status ej_model_config_load_overrides(epj_ctx *ctx, const char *path,
					  const char *const *overrides, int n,
					  ej_model_config *out)
{
	EJ_ASSERT(out && path && n >= 0 && (n == 0 || overrides));
	if (n == 0)
		return ej_model_config_load(ctx, path, out);
	memset(out, 0, sizeof *out);
	char *text = ej_config_read_file(ctx, path);
	if (!text)
		return epj_ctx_status(ctx);
	json_t *root;
	epj_status s = ej_config_json_object(ctx, text, path, &root);
	free(text);
	if (s != EPJ_OK)
		return s;
	for (int i = 0; i < n && s == EPJ_OK; i++)
		s = apply_override(ctx, path, root, overrides[i]);
	if (s == EPJ_OK) {
		/* the edited file, as text for the one parser (17 digits:
		 * every double reads back exactly) */
		char *edited = json_dumps(root, JSON_PRESERVE_ORDER |
						    JSON_REAL_PRECISION(17));
		s = edited
			? ej_model_config_parse(ctx, edited, path, out)
			: ej_error(ctx, EPJ_ERR_NOMEM,
				   "config error in %s: out of memory", path);
		free(edited);
	}
	json_decref(root);
	return s;
}

void ej_model_config_tiny(ej_model_config *m)
{
	model_defaults(m);
	m->vocab_size = 64;
	m->hidden_size = 32;
	m->num_hidden_layers = 2;
	m->num_attention_heads = 4;
	m->num_key_value_heads = 2;
	m->head_dim = 8;
	m->intermediate_size = 64;
	m->moe_intermediate_size = 32;
	m->num_experts = 4;
	m->num_experts_per_tok = 2;
	m->norm_topk_prob = true;
	m->rope_theta = 10000.0;
	m->rms_norm_eps = 1e-6;
	m->max_position_embeddings = 256;
	m->tie_word_embeddings = false;
}

bool ej_model_layer_is_moe(const ej_model_config *m, int layer)
{
	EJ_ASSERT(m && layer >= 0 && layer < m->num_hidden_layers);
	for (int i = 0; i < m->n_mlp_only_layers; i++)
		if (m->mlp_only_layers[i] == layer)
			return false;
	return m->num_experts > 0 && layer >= m->first_k_dense_replace &&
	       (layer + 1) % m->decoder_sparse_step == 0;
}

/* DeepseekV2Config / DeepseekV3Config's keys in place of Qwen3-MoE's. */
static bool deepseek_json(const ej_model_config *m, json_t *o)
{
	const bool v3 = m->family == EJ_FAMILY_DEEPSEEK_V3;
	static const char *const qwen_only[] = {
		"num_experts",	   "decoder_sparse_step",
		"mlp_only_layers", "use_sliding_window",
		"head_dim",	   "router_aux_loss_coef",
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(qwen_only); i++)
		json_object_del(o, qwen_only[i]);
	if (!v3)
		json_object_del(o, "norm_topk_prob");
	bool ok =
	    !json_object_set_new(
		o, "model_type",
		json_string(v3 ? "deepseek_v3" : "deepseek_v2")) &&
	    !json_object_set_new(o, "n_routed_experts",
				 json_integer(m->num_experts)) &&
	    !json_object_set_new(o, "n_shared_experts",
				 json_integer(m->n_shared_experts)) &&
	    !json_object_set_new(o, "routed_scaling_factor",
				 json_real(m->routed_scaling_factor)) &&
	    !json_object_set_new(o, "first_k_dense_replace",
				 json_integer(m->first_k_dense_replace)) &&
	    !json_object_set_new(o, "q_lora_rank",
				 m->q_lora_rank ? json_integer(m->q_lora_rank)
						: json_null()) &&
	    !json_object_set_new(o, "kv_lora_rank",
				 json_integer(m->kv_lora_rank)) &&
	    !json_object_set_new(o, "qk_nope_head_dim",
				 json_integer(m->qk_nope_head_dim)) &&
	    !json_object_set_new(o, "qk_rope_head_dim",
				 json_integer(m->qk_rope_head_dim)) &&
	    !json_object_set_new(o, "v_head_dim",
				 json_integer(m->v_head_dim)) &&
	    !json_object_set_new(o, "topk_method",
				 json_string(v3 ? "noaux_tc"
					     : m->groups == EJ_GROUPS_MAX
						 ? "group_limited_greedy"
						 : "greedy")) &&
	    !json_object_set_new(o, "n_group",
				 m->n_group ? json_integer(m->n_group)
					    : json_null()) &&
	    !json_object_set_new(o, "topk_group",
				 m->topk_group ? json_integer(m->topk_group)
					       : json_null());
	if (ok && v3)
		ok = !json_object_set_new(o, "rope_interleave",
					  json_boolean(m->rope_interleave));
	return ok;
}

/* Qwen3_5MoeTextConfig's keys in place of Qwen3-MoE's. */
static bool qwen35_json(const ej_model_config *m, json_t *o)
{
	static const char *const qwen3_only[] = {
		"decoder_sparse_step", "mlp_only_layers",   "norm_topk_prob",
		"use_sliding_window",  "intermediate_size",
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(qwen3_only); i++)
		json_object_del(o, qwen3_only[i]);
	json_t *lt = json_array();
	bool ok = lt != NULL;
	for (int i = 0; ok && i < m->num_hidden_layers; i++)
		ok = !json_array_append_new(
		    lt, json_string(m->linear_layer[i] ? "linear_attention"
						       : "full_attention"));
	if (!ok) {
		json_decref(lt);
		return false;
	}
	return !json_object_set_new(o, "model_type",
				    json_string("qwen3_5_moe_text")) &&
	       !json_object_set_new(o, "layer_types", lt) &&
	       !json_object_set_new(
		   o, "shared_expert_intermediate_size",
		   json_integer(m->shared_expert_intermediate_size)) &&
	       !json_object_set_new(o, "linear_conv_kernel_dim",
				    json_integer(m->linear_conv_kernel_dim)) &&
	       !json_object_set_new(o, "linear_key_head_dim",
				    json_integer(m->linear_key_head_dim)) &&
	       !json_object_set_new(o, "linear_value_head_dim",
				    json_integer(m->linear_value_head_dim)) &&
	       !json_object_set_new(o, "linear_num_key_heads",
				    json_integer(m->linear_num_key_heads)) &&
	       !json_object_set_new(o, "linear_num_value_heads",
				    json_integer(m->linear_num_value_heads));
}

/* rope_parameters (transformers 5's spelling) of a scaled or partial
 * RoPE. */
static bool rope_json(const ej_model_config *m, json_t *o)
{
	json_t *r = json_object();
	bool ok = r != NULL;
	const bool yarn = m->rope_type == EJ_ROPE_YARN;
	const char *ty = yarn				  ? "yarn"
			 : m->rope_type == EJ_ROPE_LINEAR ? "linear"
							  : "default";
	ok = ok && !json_object_set_new(r, "rope_type", json_string(ty)) &&
	     !json_object_set_new(r, "rope_theta", json_real(m->rope_theta));
	if (ok && m->rope_type != EJ_ROPE_DEFAULT)
		ok = !json_object_set_new(r, "factor",
					  json_real(m->rope_factor));
	if (ok && m->partial_rotary_factor != 1)
		ok = !json_object_set_new(r, "partial_rotary_factor",
					  json_real(m->partial_rotary_factor));
	if (ok && yarn) {
		ok = !json_object_set_new(r, "beta_fast",
					  json_real(m->rope_beta_fast)) &&
		     !json_object_set_new(r, "beta_slow",
					  json_real(m->rope_beta_slow)) &&
		     !json_object_set_new(r, "truncate",
					  json_boolean(m->rope_truncate));
		if (ok && m->rope_original_max)
			ok = !json_object_set_new(
			    r, "original_max_position_embeddings",
			    json_integer(m->rope_original_max));
		if (ok && m->rope_mscale)
			ok = !json_object_set_new(r, "mscale",
						  json_real(m->rope_mscale));
		if (ok && m->rope_mscale_all_dim)
			ok = !json_object_set_new(
			    r, "mscale_all_dim",
			    json_real(m->rope_mscale_all_dim));
		if (ok && m->rope_attention_factor)
			ok = !json_object_set_new(
			    r, "attention_factor",
			    json_real(m->rope_attention_factor));
	}
	if (!ok) {
		json_decref(r);
		return false;
	}
	json_object_del(o, "rope_theta");
	return !json_object_set_new(o, "rope_parameters", r);
}

char *ej_model_config_json(const ej_model_config *m, const char *torch_dtype)
{
	json_t *o = json_object(), *only = json_array();
	bool ok = o && only;
	for (int i = 0; ok && i < m->n_mlp_only_layers; i++)
		ok = !json_array_append_new(
		    only, json_integer(m->mlp_only_layers[i]));
	const char *dt = torch_dtype	     ? torch_dtype
			 : m->torch_dtype[0] ? m->torch_dtype
					     : "float32";
	const bool mx = m->family == EJ_FAMILY_MIXTRAL;
	const bool q2 = m->family == EJ_FAMILY_QWEN2_MOE;
	const bool v2 = m->family == EJ_FAMILY_DEEPSEEK_V2;
	const bool v3 = m->family == EJ_FAMILY_DEEPSEEK_V3;
	const bool q35 = m->family == EJ_FAMILY_QWEN3_5_MOE;
	json_t *arch = json_pack("[s]", mx    ? "MixtralForCausalLM"
					: q2  ? "Qwen2MoeForCausalLM"
					: v2  ? "DeepseekV2ForCausalLM"
					: v3  ? "DeepseekV3ForCausalLM"
					: q35 ? "Qwen3_5MoeForCausalLM"
					      : "Qwen3MoeForCausalLM");
	ok = ok && arch && !json_object_set_new(o, "architectures", arch);
	if (!ok)
		json_decref(arch);
	/* HF's key order of Qwen3MoeConfig.to_dict is not needed by any
	 * reader; this is the order of t/models/byte.json */
	struct {
		const char *k;
		json_t *v;
	} kv[] = {
		{ "model_type", json_string("qwen3_moe") },
		{ "vocab_size", json_integer(m->vocab_size) },
		{ "hidden_size", json_integer(m->hidden_size) },
		{ "num_hidden_layers", json_integer(m->num_hidden_layers) },
		{ "num_attention_heads", json_integer(m->num_attention_heads) },
		{ "num_key_value_heads", json_integer(m->num_key_value_heads) },
		{ "head_dim", json_integer(m->head_dim) },
		{ "intermediate_size", json_integer(m->intermediate_size) },
		{ "moe_intermediate_size",
		  json_integer(m->moe_intermediate_size) },
		{ "num_experts", json_integer(m->num_experts) },
		{ "num_experts_per_tok", json_integer(m->num_experts_per_tok) },
		{ "norm_topk_prob", json_boolean(m->norm_topk_prob) },
		{ "decoder_sparse_step", json_integer(m->decoder_sparse_step) },
		{ "mlp_only_layers", json_incref(only) },
		{ "hidden_act", json_string("silu") },
		{ "rms_norm_eps", json_real(m->rms_norm_eps) },
		{ "rope_theta", json_real(m->rope_theta) },
		{ "max_position_embeddings",
		  json_integer(m->max_position_embeddings) },
		{ "initializer_range", json_real(m->initializer_range) },
		{ "tie_word_embeddings", json_boolean(m->tie_word_embeddings) },
		{ "attention_bias", json_false() },
		{ "attention_dropout", json_real(0.0) },
		{ "use_sliding_window", json_false() },
		{ "output_router_logits",
		  json_boolean(m->output_router_logits) },
		{ "router_aux_loss_coef", json_real(m->router_aux_loss_coef) },
		{ "torch_dtype", json_string(dt) },
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(kv); i++) {
		if (ok && kv[i].v)
			ok = !json_object_set_new(o, kv[i].k, kv[i].v);
		else
			ok = false, json_decref(kv[i].v);
	}
	if (ok && mx) {
		/* MixtralConfig's spelling: num_local_experts, its experts
		 * of intermediate_size, always renormalised, every layer
		 * sparse, no attention bias key */
		static const char *const qwen_only[] = {
			"moe_intermediate_size", "num_experts",
			"norm_topk_prob",	 "decoder_sparse_step",
			"mlp_only_layers",	 "attention_bias",
			"use_sliding_window",
		};
		for (size_t i = 0; i < EJ_ARRAY_LEN(qwen_only); i++)
			json_object_del(o, qwen_only[i]);
		ok = !json_object_set_new(o, "model_type",
					  json_string("mixtral")) &&
		     !json_object_set_new(o, "num_local_experts",
					  json_integer(m->num_experts)) &&
		     !json_object_set_new(
			 o, "intermediate_size",
			 json_integer(m->moe_intermediate_size)) &&
		     !json_object_set_new(o, "sliding_window",
					  m->sliding_window
					      ? json_integer(m->sliding_window)
					      : json_null()) &&
		     !json_object_set_new(o, "router_jitter_noise",
					  json_real(0.0));
	}
	if (ok && q2) {
		/* Qwen2MoeConfig: qkv_bias instead of attention_bias, and the
		 * shared expert */
		json_object_del(o, "attention_bias");
		ok = !json_object_set_new(o, "model_type",
					  json_string("qwen2_moe")) &&
		     !json_object_set_new(o, "qkv_bias",
					  json_boolean(m->qkv_bias)) &&
		     !json_object_set_new(
			 o, "shared_expert_intermediate_size",
			 json_integer(m->shared_expert_intermediate_size));
	}
	if (ok && (v2 || v3))
		ok = deepseek_json(m, o);
	if (ok && q35)
		ok = qwen35_json(m, o);
	if (ok && (m->rope_type != EJ_ROPE_DEFAULT || q35))
		ok = rope_json(m, o);
	char *text = ok ? json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER |
					    JSON_REAL_PRECISION(17))
			: NULL;
	json_decref(only);
	json_decref(o);
	return text;
}
