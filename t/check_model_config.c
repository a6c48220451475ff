/* check_model_config.c -- the Hugging Face model config
 * (runtime/model_config.c).
 *
 * Data-driven half: t/model_configs/<case>/config.json with `error` (the
 * parse must fail with EPJ_ERR_CONFIG and a message containing that line) or
 * `ok`; a missing or empty folder or a case without exactly one expectation
 * fails.  Unit half: the published Qwen3-30B-A3B config
 * (../shared/models/ relative to $top_srcdir) parses to its known numbers,
 * the MoE layer rule against a reference written here on random layouts,
 * defaults, the built-in tiny model, and I/O errors.
 */
#include "check_util.h"
#include "config_impl.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

START_TEST(test_model_config_cases)
{
	char dir[1024];
	snprintf(dir, sizeof dir, "%s/t/model_configs", tu_srcdir());
	char **names = NULL;
	int n = tu_list_dir(dir, false, &names);
	ck_assert_msg(n >= 0, "model config case folder %s is missing", dir);
	ck_assert_msg(n >= 15, "model config case folder %s has only %d cases",
		      dir, n);
	static char fails[16384];
	fails[0] = '\0';
	int nfail = 0, n_ok = 0, n_err = 0;
	for (int i = 0; i < n; i++) {
		char base[2048], cfgp[2200], errp[2200], okp[2200];
		snprintf(base, sizeof base, "%s/%s", dir, names[i]);
		snprintf(cfgp, sizeof cfgp, "%s/config.json", base);
		snprintf(errp, sizeof errp, "%s/error", base);
		snprintf(okp, sizeof okp, "%s/ok", base);
		bool is_err = tu_exists(errp), is_ok = tu_exists(okp);
		if (!tu_exists(cfgp) || is_err == is_ok) {
			tu_report(fails, sizeof fails,
				  "%s: needs config.json and exactly one of "
				  "error, ok\n",
				  names[i]);
			nfail++;
			continue;
		}
		epj_ctx *ctx = tu_ctx();
		ej_model_config m;
		epj_status s = ej_model_config_load(ctx, cfgp, &m);
		const char *msg = epj_ctx_error(ctx);
		if (is_err) {
			n_err++;
			char *want = tu_first_line(errp);
			char prefix[2400];
			snprintf(prefix, sizeof prefix,
				 "config error in %s: ", cfgp);
			if (!want || !want[0] || s != EPJ_ERR_CONFIG ||
			    strncmp(msg, prefix, strlen(prefix)) != 0 ||
			    !strstr(msg, want)) {
				tu_report(fails, sizeof fails,
					  "%s: want EPJ_ERR_CONFIG \"%s\", got "
					  "%s \"%s\"\n",
					  names[i], want ? want : "(empty)",
					  epj_status_name(s), msg);
				nfail++;
			}
			/* A failed parse leaves a zeroed config. */
			if (m.hidden_size != 0 || m.num_hidden_layers != 0) {
				tu_report(fails, sizeof fails,
					  "%s: config not zeroed on failure\n",
					  names[i]);
				nfail++;
			}
			free(want);
		} else {
			n_ok++;
			if (s != EPJ_OK) {
				tu_report(fails, sizeof fails,
					  "%s: parse failed: %s\n", names[i],
					  msg);
				nfail++;
			} else if (m.hidden_size < 1 || m.head_dim < 1 ||
				   m.num_attention_heads %
					   m.num_key_value_heads !=
				       0) {
				tu_report(fails, sizeof fails,
					  "%s: accepted an invalid geometry\n",
					  names[i]);
				nfail++;
			}
		}
		epj_ctx_free(ctx);
	}
	tu_free_names(names, n);
	ck_assert_msg(nfail == 0, "%d of %d model config cases failed:\n%s",
		      nfail, n, fails);
	ck_assert(n_ok > 0 && n_err > 0);
}
END_TEST

START_TEST(test_qwen3_30b_a3b)
{
	char path[4096];
	snprintf(path, sizeof path,
		 "%s/../shared/models/qwen3-30b-a3b.config.json", tu_srcdir());
	if (!tu_exists(path)) {
		/* Only where the shared folder is not checked out. */
		fprintf(stderr, "SKIP test_qwen3_30b_a3b: %s absent\n", path);
		return;
	}
	epj_ctx *ctx = tu_ctx();
	ej_model_config m;
	ck_assert_msg(ej_model_config_load(ctx, path, &m) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(m.vocab_size, 151936);
	ck_assert_int_eq(m.hidden_size, 2048);
	ck_assert_int_eq(m.num_hidden_layers, 48);
	ck_assert_int_eq(m.num_attention_heads, 32);
	ck_assert_int_eq(m.num_key_value_heads, 4);
	ck_assert_int_eq(m.head_dim, 128);
	ck_assert_int_eq(m.intermediate_size, 6144);
	ck_assert_int_eq(m.moe_intermediate_size, 768);
	ck_assert_int_eq(m.num_experts, 128);
	ck_assert_int_eq(m.num_experts_per_tok, 8);
	ck_assert(m.norm_topk_prob);
	ck_assert_int_eq(m.decoder_sparse_step, 1);
	ck_assert_int_eq(m.n_mlp_only_layers, 0);
	ck_assert(m.rms_norm_eps == 1e-6);
	ck_assert(m.rope_theta == 1000000.0);
	ck_assert_int_eq(m.max_position_embeddings, 40960);
	ck_assert(!m.tie_word_embeddings);
	ck_assert(m.initializer_range == 0.02);
	ck_assert_str_eq(m.torch_dtype, "bfloat16");
	/* transformers' auxiliary loss: off, its coefficient kept */
	ck_assert(!m.output_router_logits);
	ck_assert(m.router_aux_loss_coef == 0.001);
	for (int l = 0; l < m.num_hidden_layers; l++)
		ck_assert(ej_model_layer_is_moe(&m, l));
	epj_ctx_free(ctx);
}
END_TEST

/* Reference for the HF rule, written independently of the library. */
static bool ref_is_moe(const int *mlp_only, int n_only, int n_experts, int step,
		       int layer)
{
	bool only = false;
	for (int i = 0; i < n_only; i++)
		only |= mlp_only[i] == layer;
	return !only && n_experts > 0 && (layer + 1) % step == 0;
}

START_TEST(test_moe_layer_rule)
{
	epj_ctx *ctx = tu_ctx();
	for (int iter = 0; iter < 50; iter++) {
		int layers = (int)tu_randint(1, 40);
		int step = (int)tu_randint(1, 5);
		int experts = iter % 7 == 0 ? 0 : (int)tu_randint(1, 17);
		int only[40], n_only = 0;
		for (int l = 0; l < layers; l++)
			if (tu_randint(0, 4) == 0)
				only[n_only++] = l;
		/* Shuffle the list: order must not matter. */
		for (int i = n_only - 1; i > 0; i--) {
			int j = (int)tu_randint(0, i + 1), t = only[i];
			only[i] = only[j];
			only[j] = t;
		}
		char json[2048], list[512] = "";
		size_t o = 0;
		for (int i = 0; i < n_only; i++)
			o += (size_t)snprintf(list + o, sizeof list - o, "%s%d",
					      i ? ", " : "", only[i]);
		snprintf(
		    json, sizeof json,
		    "{\"vocab_size\": 11, \"hidden_size\": 12, "
		    "\"num_hidden_layers\": %d, \"num_attention_heads\": "
		    "3, \"num_key_value_heads\": 1, \"intermediate_size\": "
		    "5, \"num_experts\": %d, \"num_experts_per_tok\": 1, "
		    "\"moe_intermediate_size\": 7, \"decoder_sparse_step\": "
		    "%d, \"mlp_only_layers\": [%s]}",
		    layers, experts, step, list);
		ej_model_config m;
		ck_assert_msg(
		    ej_model_config_parse(ctx, json, "rule.json", &m) == EPJ_OK,
		    "%s\n%s", epj_ctx_error(ctx), json);
		ck_assert_int_eq(m.head_dim, 4);
		ck_assert_int_eq(m.n_mlp_only_layers, n_only);
		for (int l = 0; l < layers; l++)
			ck_assert_msg(
			    ej_model_layer_is_moe(&m, l) ==
				ref_is_moe(only, n_only, experts, step, l),
			    "layer %d of %s", l, json);
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_defaults_and_tiny)
{
	epj_ctx *ctx = tu_ctx();
	ej_model_config m;
	/* Only the required keys: HF defaults fill the rest. */
	ck_assert_int_eq(
	    ej_model_config_parse(ctx,
				  "{\"vocab_size\": 100, \"hidden_size\": 64, "
				  "\"num_hidden_layers\": 3, "
				  "\"num_attention_heads\": 8, "
				  "\"intermediate_size\": 96}",
				  "min.json", &m),
	    EPJ_OK);
	ck_assert_int_eq(m.num_key_value_heads, 8);
	ck_assert_int_eq(m.head_dim, 8);
	ck_assert_int_eq(m.num_experts, 0);
	ck_assert_int_eq(m.decoder_sparse_step, 1);
	ck_assert(m.rms_norm_eps == 1e-6 && m.rope_theta == 10000.0);
	ck_assert_int_eq(m.max_position_embeddings, 32768);
	ck_assert(m.initializer_range == 0.02);
	ck_assert(!m.norm_topk_prob && !m.tie_word_embeddings);
	ck_assert_str_eq(m.torch_dtype, "");
	for (int l = 0; l < 3; l++)
		ck_assert(!ej_model_layer_is_moe(&m, l));

	/* transformers 5 spells the expert count num_local_experts: the same
	 * MoE model, never a dense one */
	int ne = (int)tu_randint(2, 9);
	char js[512];
	snprintf(js, sizeof js,
		 "{\"vocab_size\": 100, \"hidden_size\": 64, "
		 "\"num_hidden_layers\": 3, \"num_attention_heads\": 8, "
		 "\"intermediate_size\": 96, \"model_type\": \"qwen3_moe\", "
		 "\"num_local_experts\": %d, \"num_experts_per_tok\": 2, "
		 "\"moe_intermediate_size\": 24, \"rope_parameters\": "
		 "{\"rope_type\": \"default\", \"rope_theta\": 5e5}}",
		 ne);
	ck_assert_msg(ej_model_config_parse(ctx, js, "t5.json", &m) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert_int_eq(m.num_experts, ne);
	ck_assert(m.rope_theta == 5e5);
	for (int l = 0; l < 3; l++)
		ck_assert(ej_model_layer_is_moe(&m, l));

	ej_model_config_tiny(&m);
	ck_assert_int_eq(m.vocab_size, 64);
	ck_assert_int_eq(m.hidden_size, 32);
	ck_assert_int_eq(m.num_hidden_layers, 2);
	ck_assert_int_eq(m.num_attention_heads, 4);
	ck_assert_int_eq(m.num_key_value_heads, 2);
	ck_assert_int_eq(m.head_dim, 8);
	ck_assert_int_eq(m.intermediate_size, 64);
	ck_assert_int_eq(m.moe_intermediate_size, 32);
	ck_assert_int_eq(m.num_experts, 4);
	ck_assert_int_eq(m.num_experts_per_tok, 2);
	ck_assert(m.norm_topk_prob && !m.tie_word_embeddings);
	ck_assert(m.rope_theta == 10000.0 && m.rms_norm_eps == 1e-6);
	ck_assert_int_eq(m.max_position_embeddings, 256);
	ck_assert(m.initializer_range == 0.02);
	ck_assert(ej_model_layer_is_moe(&m, 0) && ej_model_layer_is_moe(&m, 1));

	/* transformers >= 5 moves rope_theta into rope_parameters. */
	ck_assert_int_eq(
	    ej_model_config_parse(ctx,
				  "{\"vocab_size\": 10, \"hidden_size\": 8, "
				  "\"num_hidden_layers\": 1, "
				  "\"num_attention_heads\": 2, "
				  "\"intermediate_size\": 4, "
				  "\"rope_parameters\": {\"rope_type\": "
				  "\"default\", \"rope_theta\": 5e5}}",
				  "v5.json", &m),
	    EPJ_OK);
	ck_assert(m.rope_theta == 5e5);
	epj_ctx_free(ctx);
}
END_TEST

/* Every field of a and b (ej_model_config_json's round trip). */
static void same_config(const ej_model_config *a, const ej_model_config *b,
			const char *what)
{
	ck_assert_msg(
	    a->vocab_size == b->vocab_size &&
		a->hidden_size == b->hidden_size &&
		a->num_hidden_layers == b->num_hidden_layers &&
		a->num_attention_heads == b->num_attention_heads &&
		a->num_key_value_heads == b->num_key_value_heads &&
		a->head_dim == b->head_dim &&
		a->intermediate_size == b->intermediate_size &&
		a->moe_intermediate_size == b->moe_intermediate_size &&
		a->num_experts == b->num_experts &&
		a->num_experts_per_tok == b->num_experts_per_tok &&
		a->norm_topk_prob == b->norm_topk_prob &&
		a->decoder_sparse_step == b->decoder_sparse_step &&
		a->n_mlp_only_layers == b->n_mlp_only_layers &&
		a->rms_norm_eps == b->rms_norm_eps &&
		a->rope_theta == b->rope_theta &&
		a->max_position_embeddings == b->max_position_embeddings &&
		a->tie_word_embeddings == b->tie_word_embeddings &&
		a->initializer_range == b->initializer_range &&
		a->output_router_logits == b->output_router_logits &&
		a->router_aux_loss_coef == b->router_aux_loss_coef &&
		a->family == b->family && a->rope_type == b->rope_type &&
		a->rope_factor == b->rope_factor &&
		a->rope_original_max == b->rope_original_max &&
		a->rope_beta_fast == b->rope_beta_fast &&
		a->rope_beta_slow == b->rope_beta_slow &&
		a->rope_mscale == b->rope_mscale &&
		a->rope_mscale_all_dim == b->rope_mscale_all_dim &&
		a->rope_attention_factor == b->rope_attention_factor &&
		a->rope_truncate == b->rope_truncate && a->mla == b->mla &&
		a->q_lora_rank == b->q_lora_rank &&
		a->kv_lora_rank == b->kv_lora_rank &&
		a->qk_nope_head_dim == b->qk_nope_head_dim &&
		a->qk_rope_head_dim == b->qk_rope_head_dim &&
		a->v_head_dim == b->v_head_dim &&
		a->rope_interleave == b->rope_interleave &&
		a->first_k_dense_replace == b->first_k_dense_replace &&
		a->n_shared_experts == b->n_shared_experts &&
		a->routed_scaling_factor == b->routed_scaling_factor &&
		a->scoring == b->scoring && a->groups == b->groups &&
		a->n_group == b->n_group && a->topk_group == b->topk_group &&
		a->score_bias == b->score_bias &&
		a->norm_offset == b->norm_offset &&
		a->attn_output_gate == b->attn_output_gate &&
		a->partial_rotary_factor == b->partial_rotary_factor &&
		a->rotary_dim == b->rotary_dim &&
		a->linear_conv_kernel_dim == b->linear_conv_kernel_dim &&
		a->linear_key_head_dim == b->linear_key_head_dim &&
		a->linear_value_head_dim == b->linear_value_head_dim &&
		a->linear_num_key_heads == b->linear_num_key_heads &&
		a->linear_num_value_heads == b->linear_num_value_heads,
	    "%s: a field changed in the round trip", what);
	for (int i = 0; i < a->n_mlp_only_layers; i++)
		ck_assert_int_eq(a->mlp_only_layers[i], b->mlp_only_layers[i]);
}

/* ej_model_config_json writes what ej_model_config_parse reads back to the
 * same config (the config.json of epjit-ckpt to-hf and of a checkpoint's
 * metadata), with the torch_dtype asked for, as an HF Qwen3-MoE config. */
START_TEST(test_config_json_roundtrip)
{
	epj_ctx *ctx = tu_ctx();
	ej_model_config a, b;
	ej_model_config_tiny(&a);
	char *t = ej_model_config_json(&a, NULL);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(ej_model_config_parse(ctx, t, "tiny", &b), EPJ_OK);
	same_config(&a, &b, "tiny");
	ck_assert_str_eq(b.torch_dtype, "float32");
	json_t *o = json_loads(t, 0, NULL);
	ck_assert_ptr_nonnull(o);
	ck_assert_str_eq(json_string_value(json_array_get(
			     json_object_get(o, "architectures"), 0)),
			 "Qwen3MoeForCausalLM");
	ck_assert_str_eq(json_string_value(json_object_get(o, "model_type")),
			 "qwen3_moe");
	json_decref(o);
	free(t);
	/* odd values: mlp-only layers, a sparse step, eps and theta that are
	 * not short decimals, a torch_dtype of its own */
	ck_assert_int_eq(
	    ej_model_config_parse(
		ctx,
		"{\"vocab_size\": 1001, \"hidden_size\": 24, "
		"\"num_hidden_layers\": 5, \"num_attention_heads\": 3, "
		"\"num_key_value_heads\": 1, \"head_dim\": 6, "
		"\"intermediate_size\": 40, \"moe_intermediate_size\": 12, "
		"\"num_experts\": 6, \"num_experts_per_tok\": 3, "
		"\"decoder_sparse_step\": 2, \"mlp_only_layers\": [3, 0], "
		"\"rms_norm_eps\": 3.3e-7, \"rope_theta\": 123456.789, "
		"\"max_position_embeddings\": 77, "
		"\"initializer_range\": 0.0123, \"torch_dtype\": "
		"\"bfloat16\", \"output_router_logits\": true, "
		"\"router_aux_loss_coef\": 0.037}",
		"odd.json", &a),
	    EPJ_OK);
	ck_assert(a.output_router_logits && a.router_aux_loss_coef == 0.037);
	t = ej_model_config_json(&a, NULL);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(ej_model_config_parse(ctx, t, "odd", &b), EPJ_OK);
	same_config(&a, &b, "odd");
	ck_assert_str_eq(b.torch_dtype, "bfloat16");
	for (int l = 0; l < a.num_hidden_layers; l++)
		ck_assert(ej_model_layer_is_moe(&a, l) ==
			  ej_model_layer_is_moe(&b, l));
	free(t);
	t = ej_model_config_json(&a, "float32");
	ck_assert_int_eq(ej_model_config_parse(ctx, t, "odd32", &b), EPJ_OK);
	ck_assert_str_eq(b.torch_dtype, "float32");
	free(t);
	epj_ctx_free(ctx);
}
END_TEST

/* Mixtral as transformers 5 writes it (t/model_configs/mixtral_8x7b is the
 * published 8x7B): every layer sparse, num_local_experts experts of
 * intermediate_size, top-k always renormalised, no q/k norm, MixtralConfig's
 * defaults; a sliding_window is kept; the JSON writer gives a Mixtral
 * config back with the same fields and no Qwen3-MoE keys. */
START_TEST(test_mixtral)
{
	epj_ctx *ctx = tu_ctx();
	ej_model_config a, b;
	char path[1024];
	snprintf(path, sizeof path,
		 "%s/t/model_configs/mixtral_8x7b/config.json", tu_srcdir());
	ck_assert_int_eq(ej_model_config_load(ctx, path, &a), EPJ_OK);
	ck_assert_int_eq(a.family, EJ_FAMILY_MIXTRAL);
	ck_assert(!a.qk_norm);
	ck_assert_int_eq(a.num_experts, 8);
	ck_assert_int_eq(a.num_experts_per_tok, 2);
	ck_assert_int_eq(a.moe_intermediate_size, 14336);
	ck_assert(a.norm_topk_prob);
	ck_assert_int_eq(a.head_dim, 128);
	ck_assert_int_eq(a.num_key_value_heads, 8);
	ck_assert(a.rope_theta == 1e6 && a.rms_norm_eps == 1e-5);
	ck_assert_int_eq(a.sliding_window, 0);
	for (int l = 0; l < a.num_hidden_layers; l++)
		ck_assert(ej_model_layer_is_moe(&a, l));
	/* MixtralConfig's defaults, a window, Qwen3-MoE's keys ignored */
	ck_assert_int_eq(
	    ej_model_config_parse(
		ctx,
		"{\"model_type\": \"mixtral\", \"vocab_size\": 33, "
		"\"hidden_size\": 12, \"num_hidden_layers\": 3, "
		"\"num_attention_heads\": 2, \"intermediate_size\": 10, "
		"\"num_local_experts\": 6, \"num_experts_per_tok\": 3, "
		"\"sliding_window\": 17, \"norm_topk_prob\": false, "
		"\"moe_intermediate_size\": 999, \"decoder_sparse_step\": 2}",
		"mx.json", &a),
	    EPJ_OK);
	ck_assert(a.rope_theta == 1e6 && a.rms_norm_eps == 1e-5);
	ck_assert_int_eq(a.max_position_embeddings, 131072);
	ck_assert_int_eq(a.sliding_window, 17);
	ck_assert_int_eq(a.moe_intermediate_size, 10);
	ck_assert(a.norm_topk_prob);
	ck_assert_int_eq(a.decoder_sparse_step, 1);
	char *t = ej_model_config_json(&a, NULL);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(ej_model_config_parse(ctx, t, "mx-rt", &b), EPJ_OK);
	same_config(&a, &b, "mixtral");
	ck_assert_int_eq(b.family, EJ_FAMILY_MIXTRAL);
	ck_assert_int_eq(b.sliding_window, 17);
	json_t *o = json_loads(t, 0, NULL);
	ck_assert_ptr_nonnull(o);
	ck_assert_str_eq(json_string_value(json_array_get(
			     json_object_get(o, "architectures"), 0)),
			 "MixtralForCausalLM");
	ck_assert_str_eq(json_string_value(json_object_get(o, "model_type")),
			 "mixtral");
	ck_assert_int_eq(
	    json_integer_value(json_object_get(o, "num_local_experts")), 6);
	ck_assert_ptr_null(json_object_get(o, "moe_intermediate_size"));
	ck_assert_ptr_null(json_object_get(o, "num_experts"));
	ck_assert_ptr_null(json_object_get(o, "norm_topk_prob"));
	json_decref(o);
	free(t);
	/* a Qwen3-MoE config keeps its q/k norm */
	ej_model_config_tiny(&a);
	ck_assert_int_eq(a.family, EJ_FAMILY_QWEN3_MOE);
	t = ej_model_config_json(&a, NULL);
	ck_assert_int_eq(ej_model_config_parse(ctx, t, "tiny", &b), EPJ_OK);
	ck_assert(b.qk_norm);
	ck_assert_int_eq(b.family, EJ_FAMILY_QWEN3_MOE);
	free(t);
	epj_ctx_free(ctx);
}
END_TEST

/* DeepSeek-V3 as published and as transformers 5 writes it
 * (t/model_configs/deepseek_v3), and the tiny DeepSeek-V2 transformers
 * made for the golden files: every DeepSeek field, the dense first
 * layers, and the JSON writer's round trip (rope_parameters included). */
START_TEST(test_deepseek)
{
	epj_ctx *ctx = tu_ctx();
	ej_model_config a, b;
	char path[1024];
	snprintf(path, sizeof path,
		 "%s/t/model_configs/deepseek_v3/config.json", tu_srcdir());
	ck_assert_int_eq(ej_model_config_load(ctx, path, &a), EPJ_OK);
	ck_assert_int_eq(a.family, EJ_FAMILY_DEEPSEEK_V3);
	ck_assert(a.mla && !a.qk_norm && a.rope_interleave && a.score_bias);
	ck_assert_int_eq(a.q_lora_rank, 1536);
	ck_assert_int_eq(a.kv_lora_rank, 512);
	ck_assert(a.qk_nope_head_dim == 128 && a.qk_rope_head_dim == 64 &&
		  a.v_head_dim == 128 && a.head_dim == 64);
	ck_assert(a.num_experts == 256 && a.num_experts_per_tok == 8 &&
		  a.n_shared_experts == 1 && a.moe_intermediate_size == 2048);
	ck_assert(a.scoring == EJ_SCORE_SIGMOID && a.groups == EJ_GROUPS_TOP2 &&
		  a.n_group == 8 && a.topk_group == 4);
	ck_assert(a.norm_topk_prob && a.routed_scaling_factor == 2.5);
	ck_assert(a.rope_type == EJ_ROPE_YARN && a.rope_factor == 40 &&
		  a.rope_original_max == 4096 && a.rope_mscale == 1 &&
		  a.rope_mscale_all_dim == 1 && a.rope_beta_fast == 32 &&
		  a.rope_beta_slow == 1 && a.rope_truncate);
	ck_assert_int_eq(a.first_k_dense_replace, 3);
	ck_assert(!ej_model_layer_is_moe(&a, 2) &&
		  ej_model_layer_is_moe(&a, 3) &&
		  ej_model_layer_is_moe(&a, 60));
	char *t = ej_model_config_json(&a, NULL);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(ej_model_config_parse(ctx, t, "v3-rt", &b), EPJ_OK);
	same_config(&a, &b, "deepseek_v3");
	free(t);

	snprintf(path, sizeof path, "%s/t/golden/hf/deepseek_v2/config.json",
		 tu_srcdir());
	ck_assert_int_eq(ej_model_config_load(ctx, path, &a), EPJ_OK);
	ck_assert_int_eq(a.family, EJ_FAMILY_DEEPSEEK_V2);
	ck_assert(a.mla && a.q_lora_rank == 0 && a.rope_interleave &&
		  !a.score_bias && !a.norm_topk_prob);
	ck_assert(a.scoring == EJ_SCORE_SOFTMAX && a.groups == EJ_GROUPS_MAX &&
		  a.n_group == 4 && a.topk_group == 2);
	ck_assert(a.rope_type == EJ_ROPE_LINEAR && a.rope_factor == 2 &&
		  a.routed_scaling_factor == 1.5 && a.n_shared_experts == 2);
	ck_assert(!ej_model_layer_is_moe(&a, 0) &&
		  ej_model_layer_is_moe(&a, 1));
	t = ej_model_config_json(&a, NULL);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(ej_model_config_parse(ctx, t, "v2-rt", &b), EPJ_OK);
	same_config(&a, &b, "deepseek_v2");
	free(t);
	epj_ctx_free(ctx);
}
END_TEST

/* Qwen3.5-MoE's text model as transformers 5 writes it
 * (t/model_configs/qwen3_5_moe_text, the published sizes): its Gated
 * DeltaNet sizes and layer kinds, the partial rope, the shared expert,
 * zero-centred norms, and the JSON writer's round trip. */
START_TEST(test_qwen35)
{
	epj_ctx *ctx = tu_ctx();
	ej_model_config a, b;
	char path[1024];
	snprintf(path, sizeof path,
		 "%s/t/model_configs/qwen3_5_moe_text/config.json",
		 tu_srcdir());
	ck_assert_int_eq(ej_model_config_load(ctx, path, &a), EPJ_OK);
	ck_assert_int_eq(a.family, EJ_FAMILY_QWEN3_5_MOE);
	ck_assert(a.qk_norm && a.norm_offset && a.attn_output_gate &&
		  a.norm_topk_prob);
	ck_assert(a.head_dim == 256 && a.rotary_dim == 64 &&
		  a.partial_rotary_factor == 0.25);
	ck_assert(
	    a.linear_conv_kernel_dim == 4 && a.linear_key_head_dim == 128 &&
	    a.linear_value_head_dim == 128 && a.linear_num_key_heads == 16 &&
	    a.linear_num_value_heads == 32);
	ck_assert(a.num_experts == 256 && a.num_experts_per_tok == 8 &&
		  a.shared_expert_intermediate_size == 512);
	for (int i = 0; i < 40; i++) {
		ck_assert_int_eq(a.linear_layer[i], (i + 1) % 4 != 0);
		ck_assert(ej_model_layer_is_moe(&a, i));
	}
	char *t = ej_model_config_json(&a, NULL);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(ej_model_config_parse(ctx, t, "q35-rt", &b), EPJ_OK);
	same_config(&a, &b, "qwen3_5_moe");
	ck_assert(b.rotary_dim == 64 && b.attn_output_gate);
	for (int i = 0; i < 40; i++)
		ck_assert_int_eq(a.linear_layer[i], b.linear_layer[i]);
	free(t);
	epj_ctx_free(ctx);
}
END_TEST

/* Qwen2-MoE as transformers 5 writes it (t/model_configs/qwen2_moe_small,
 * saved by transformers): q/k/v bias, a shared expert, no q/k norm; the
 * JSON writer gives a Qwen2-MoE config back (qkv_bias, the shared expert's
 * width, no attention_bias). */
START_TEST(test_qwen2_moe)
{
	epj_ctx *ctx = tu_ctx();
	ej_model_config a, b;
	char path[1024];
	snprintf(path, sizeof path,
		 "%s/t/model_configs/qwen2_moe_small/config.json", tu_srcdir());
	ck_assert_int_eq(ej_model_config_load(ctx, path, &a), EPJ_OK);
	ck_assert_int_eq(a.family, EJ_FAMILY_QWEN2_MOE);
	ck_assert(!a.qk_norm && a.qkv_bias);
	ck_assert_int_eq(a.shared_expert_intermediate_size, 16);
	ck_assert_int_eq(a.moe_intermediate_size, 12);
	ck_assert_int_eq(a.num_experts, 6);
	ck_assert(!a.norm_topk_prob);
	ck_assert(ej_model_layer_is_moe(&a, 0) &&
		  !ej_model_layer_is_moe(&a, 1));
	a.qkv_bias = false; /* a value other than the default survives */
	char *t = ej_model_config_json(&a, NULL);
	ck_assert_ptr_nonnull(t);
	ck_assert_int_eq(ej_model_config_parse(ctx, t, "q2-rt", &b), EPJ_OK);
	same_config(&a, &b, "qwen2_moe");
	ck_assert_int_eq(b.family, EJ_FAMILY_QWEN2_MOE);
	ck_assert(!b.qkv_bias);
	ck_assert_int_eq(b.shared_expert_intermediate_size, 16);
	json_t *o = json_loads(t, 0, NULL);
	ck_assert_ptr_nonnull(o);
	ck_assert_str_eq(json_string_value(json_array_get(
			     json_object_get(o, "architectures"), 0)),
			 "Qwen2MoeForCausalLM");
	ck_assert_ptr_null(json_object_get(o, "attention_bias"));
	json_decref(o);
	free(t);
	/* qkv_bias defaults to true, as in Qwen2MoeConfig */
	ck_assert_int_eq(
	    ej_model_config_parse(
		ctx,
		"{\"model_type\": \"qwen2_moe\", \"vocab_size\": 33, "
		"\"hidden_size\": 12, \"num_hidden_layers\": 1, "
		"\"num_attention_heads\": 2, \"intermediate_size\": 10, "
		"\"num_experts\": 4, \"num_experts_per_tok\": 2, "
		"\"moe_intermediate_size\": 6, "
		"\"shared_expert_intermediate_size\": 8}",
		"q2.json", &a),
	    EPJ_OK);
	ck_assert(a.qkv_bias);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_model_io_errors)
{
	epj_ctx *ctx = tu_ctx();
	ej_model_config m;
	const char *missing = "/nonexistent-epjit-dir/config.json";
	ck_assert_int_eq(ej_model_config_load(ctx, missing, &m), EPJ_ERR_IO);
	ck_assert(strstr(epj_ctx_error(ctx), missing));
	ck_assert_int_eq(
	    ej_model_config_parse(ctx, "{\"vocab_size\": 3,", "t", &m),
	    EPJ_ERR_CONFIG);
	ck_assert(strstr(epj_ctx_error(ctx), "config error in t: invalid JSON "
					     "at line 1, column"));
	ck_assert_int_eq(ej_model_config_parse(ctx, NULL, "t", &m),
			 EPJ_ERR_INVALID);
	epj_ctx_free(ctx);
}
END_TEST

/* --model-override: KEY=VALUE edits of t/models/qwen3-30b-a3b.json before
 * it is checked, each value read as a JSON scalar; every other key as in
 * the file. */
START_TEST(test_overrides)
{
	char path[4096];
	snprintf(path, sizeof path, "%s/t/models/qwen3-30b-a3b.json",
		 tu_srcdir());
	epj_ctx *ctx = tu_ctx();
	ej_model_config base, m;
	ck_assert_msg(ej_model_config_load(ctx, path, &base) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_int_eq(base.num_hidden_layers, 48);
	/* random small sizes, so no fixed value can pass by chance */
	int layers = (int)tu_randint(1, 5), experts = 2 * (int)tu_randint(1, 9);
	double eps = 1e-5 * (double)tu_randint(1, 9);
	char o1[64], o2[64], o3[64];
	snprintf(o1, sizeof o1, "num_hidden_layers=%d", layers);
	snprintf(o2, sizeof o2, "num_experts=%d", experts);
	snprintf(o3, sizeof o3, "rms_norm_eps=%.17g", eps);
	const char *ov[] = { o1,
			     o2,
			     "num_experts_per_tok=2",
			     o3,
			     "norm_topk_prob=false",
			     "torch_dtype=float32",
			     "hidden_act=\"silu\"" };
	ck_assert_msg(ej_model_config_load_overrides(
			  ctx, path, ov, (int)(sizeof ov / sizeof *ov), &m) ==
			  EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert_int_eq(m.num_hidden_layers, layers);
	ck_assert_int_eq(m.num_experts, experts);
	ck_assert_int_eq(m.num_experts_per_tok, 2);
	ck_assert(m.rms_norm_eps == eps);
	ck_assert(!m.norm_topk_prob);
	ck_assert_str_eq(m.torch_dtype, "float32"); /* a bare word */
	/* the rest is the file's */
	ej_model_config want = base;
	want.num_hidden_layers = layers;
	want.num_experts = experts;
	want.num_experts_per_tok = 2;
	want.rms_norm_eps = eps;
	want.norm_topk_prob = false;
	snprintf(want.torch_dtype, sizeof want.torch_dtype, "float32");
	ck_assert(memcmp(&want, &m, sizeof m) == 0);
	/* a later edit of the same key wins; a key the file lacks but the
	 * model reads (head_dim is in the file; decoder_sparse_step too) */
	const char *twice[] = { "num_hidden_layers=3", "num_hidden_layers=2" };
	ck_assert(ej_model_config_load_overrides(ctx, path, twice, 2, &m) ==
		  EPJ_OK);
	ck_assert_int_eq(m.num_hidden_layers, 2);
	/* the result is checked as a file would be */
	const char *bad[] = { "num_experts_per_tok=200" };
	ck_assert(ej_model_config_load_overrides(ctx, path, bad, 1, &m) ==
		  EPJ_ERR_CONFIG);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "must not exceed"), "%s",
		      epj_ctx_error(ctx));
	/* errors name the override and the key */
	static const struct {
		const char *ov, *want;
	} errs[] = {
		{ "num_hiden_layers=1",
		  "unknown key \"num_hiden_layers\" (did you mean "
		  "\"num_hidden_layers\"?)" },
		{ "max_window_layer=4",
		  "(did you mean \"max_window_layers\"?)" }, /* file's own */
		{ "num_experts=[4]", "must be a JSON scalar" },
		{ "=4", "must be KEY=VALUE" },
		{ "num_experts", "must be KEY=VALUE" },
		{ "num_hidden_layers=1.5", "\"num_hidden_layers\" must be" },
	};
	for (size_t i = 0; i < sizeof errs / sizeof *errs; i++) {
		const char *one[] = { errs[i].ov };
		ck_assert_int_eq(
		    ej_model_config_load_overrides(ctx, path, one, 1, &m),
		    EPJ_ERR_CONFIG);
		ck_assert_msg(strstr(epj_ctx_error(ctx), errs[i].want),
			      "%s: want \"%s\" in \"%s\"", errs[i].ov,
			      errs[i].want, epj_ctx_error(ctx));
		ck_assert_int_eq(m.num_hidden_layers, 0); /* zeros on error */
	}
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_model_config_suite(void)
{
	Suite *s = suite_create("model_config");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_model_config_cases);
	tcase_add_test(tc, test_qwen3_30b_a3b);
	tcase_add_test(tc, test_moe_layer_rule);
	tcase_add_test(tc, test_defaults_and_tiny);
	tcase_add_test(tc, test_model_io_errors);
	tcase_add_test(tc, test_config_json_roundtrip);
	tcase_add_test(tc, test_mixtral);
	tcase_add_test(tc, test_qwen2_moe);
	tcase_add_test(tc, test_deepseek);
	tcase_add_test(tc, test_qwen35);
	tcase_add_test(tc, test_overrides);
	suite_add_tcase(s, tc);
	return s;
}
