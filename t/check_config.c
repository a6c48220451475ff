/* check_config.c -- the DeepSpeed-style training config (runtime/config.c).
 *
 * Two halves.  The data-driven half walks t/configs/<case>/ (under
 * $top_srcdir, which `make check` exports): each case holds ds.json and
 * exactly one expectation file, `error` (the parse must fail with
 * EPJ_ERR_CONFIG and a message containing each of its lines: a file's
 * errors are reported together), `ok` (the parse must succeed; a first
 * line, when there is one, is the list of keys the parse names as having
 * no effect, ej_config.no_effect), `compile_error` (the parse succeeds and
 * ej_config_validate_autoep_compile fails with a message beginning
 * "compile.autoep_non_moe=true" and containing that line), `compile_ok`,
 * or, with a `model` file naming a family of t/golden/hf, `init_error`
 * (epj_engine_initialize on that model fails with a message beginning with
 * the path and containing each line: the AutoEP keys checked against the
 * model) or `init_ok`.
 * A missing or empty folder, or a case without exactly one expectation, is a
 * failure: the suite must not pass by checking nothing.  The unit half checks
 * defaults, every parsed field, batch resolution against a reference written
 * here for random sizes, null/false/true distinctions, the JSON dump's round
 * trip on random configs, and I/O errors.
 */
#include "check_util.h"
#include "config_impl.h"
/* epjit-train's values of "auto" (auto_config) */
#include "../tools/train_defaults.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- helpers ---------------------------------------------------------------
 */

static bool starts_with(const char *s, const char *prefix)
{
	return strncmp(s, prefix, strlen(prefix)) == 0;
}

/* ---- data-driven cases ----------------------------------------------------
 */

/* Whether msg contains every non-empty line of the file at path; when not,
 * *missing (freed and replaced) is the first line it lacks. */
static bool contains_every_line(const char *msg, const char *path,
				char **missing)
{
	FILE *f = fopen(path, "r");
	ck_assert_msg(f != NULL, "cannot read %s", path);
	char line[1024];
	bool ok = true;
	while (ok && fgets(line, sizeof line, f)) {
		line[strcspn(line, "\n")] = '\0';
		if (line[0] && !strstr(msg, line)) {
			ok = false;
			free(*missing);
			*missing = strdup(line);
		}
	}
	fclose(f);
	return ok;
}

/* An init_error / init_ok case (kind 4 / 5): epj_engine_initialize of
 * config path on the model its `model` file names (a family of
 * t/golden/hf); init_error: EPJ_ERR_CONFIG or EPJ_ERR_UNSUPPORTED, the
 * message starting with the path and holding each line of the file.  A
 * failure is reported into fails; returns whether the case passed. */
static bool init_case(const char *base, const char *path, int kind,
		      const char *name, char *fails, size_t n)
{
	char mp[2200], cfgp[2400], ep[2200];
	snprintf(mp, sizeof mp, "%s/model", base);
	char *fam = tu_first_line(mp);
	if (!fam || !fam[0]) {
		tu_report(fails, n, "%s: no family in %s\n", name, mp);
		free(fam);
		return false;
	}
	snprintf(cfgp, sizeof cfgp, "%s/t/golden/hf/%s/config.json",
		 tu_srcdir(), fam);
	free(fam);
	epj_ctx *ctx = tu_ctx();
	epj_model *m = NULL;
	epj_engine *e = NULL;
	bool ok = true;
	if (epj_model_new(ctx, cfgp, NULL, &m) != EPJ_OK) {
		tu_report(fails, n, "%s: model %s: %s\n", name, cfgp,
			  epj_ctx_error(ctx));
		ok = false;
		goto out;
	}
	epj_status s = epj_engine_initialize(ctx, m, path, &e);
	const char *msg = epj_ctx_error(ctx);
	char *want = NULL;
	if (kind == 5 && s != EPJ_OK) {
		tu_report(fails, n, "%s: initialize failed: %s\n", name, msg);
		ok = false;
	} else if (kind == 4) {
		snprintf(ep, sizeof ep, "%s/init_error", base);
		if ((s != EPJ_ERR_CONFIG && s != EPJ_ERR_UNSUPPORTED) ||
		    !starts_with(msg, path) ||
		    !contains_every_line(msg, ep, &want)) {
			tu_report(fails, n,
				  "%s: want initialize to fail with \"%s\", "
				  "got %s \"%s\"\n",
				  name, want ? want : "(each line)",
				  epj_status_name(s), msg);
			ok = false;
		}
		if (e)
			ok = false;
	}
	free(want);
out:
	epj_engine_free(e);
	epj_model_free(m);
	epj_ctx_free(ctx);
	return ok;
}

START_TEST(test_config_cases)
{
	char dir[1024];
	snprintf(dir, sizeof dir, "%s/t/configs", tu_srcdir());
	char **names = NULL;
	int n = tu_list_dir(dir, true, &names);
	ck_assert_msg(n >= 0, "config case folder %s is missing", dir);
	ck_assert_msg(n >= 20, "config case folder %s has only %d cases", dir,
		      n);
	static char fails[16384];
	fails[0] = '\0';
	int nfail = 0;
	int kinds[6] = { 0 };
	for (int i = 0; i < n; i++) {
		char base[2048], path[2200];
		snprintf(base, sizeof base, "%s/%s", dir, names[i]);
		static const char *const expect[] = {
			"error",      "ok",	    "compile_error",
			"compile_ok", "init_error", "init_ok"
		};
		int kind = -1, nexp = 0;
		for (int k = 0; k < 6; k++) {
			snprintf(path, sizeof path, "%s/%s", base, expect[k]);
			if (tu_exists(path)) {
				kind = k;
				nexp++;
			}
		}
		snprintf(path, sizeof path, "%s/ds.json", base);
		if (nexp != 1 || !tu_exists(path)) {
			tu_report(
			    fails, sizeof fails,
			    "%s: needs ds.json and exactly one of error, ok, "
			    "compile_error, compile_ok, init_error, init_ok "
			    "(has %d)\n",
			    names[i], nexp);
			nfail++;
			continue;
		}
		kinds[kind]++;
		if (kind >= 4) {
			if (!init_case(base, path, kind, names[i], fails,
				       sizeof fails))
				nfail++;
			continue;
		}
		char *want = NULL;
		if (kind == 1) {
			char ep[2200];
			snprintf(ep, sizeof ep, "%s/ok", base);
			want = tu_first_line(ep);
		}
		if (kind == 0 || kind == 2) {
			char ep[2200];
			snprintf(ep, sizeof ep, "%s/%s", base, expect[kind]);
			want = tu_first_line(ep);
			if (!want || !want[0]) {
				tu_report(fails, sizeof fails,
					  "%s: empty expectation file %s\n",
					  names[i], expect[kind]);
				nfail++;
				free(want);
				continue;
			}
		}
		epj_ctx *ctx = tu_ctx();
		ej_config cfg;
		epj_status s = ej_config_load(ctx, path, &cfg);
		const char *msg = epj_ctx_error(ctx);
		char prefix[2400];
		snprintf(prefix, sizeof prefix, "config error in %s: ", path);
		if (kind == 0) {
			char ep[2200];
			snprintf(ep, sizeof ep, "%s/error", base);
			if (s != EPJ_ERR_CONFIG || !starts_with(msg, prefix) ||
			    !contains_every_line(msg, ep, &want)) {
				tu_report(
				    fails, sizeof fails,
				    "%s: want EPJ_ERR_CONFIG \"%s\", got %s "
				    "\"%s\"\n",
				    names[i], want, epj_status_name(s), msg);
				nfail++;
			}
		} else if (s != EPJ_OK) {
			tu_report(fails, sizeof fails, "%s: parse failed: %s\n",
				  names[i], msg);
			nfail++;
		} else if (kind == 1 && want && want[0] &&
			   strcmp(cfg.no_effect, want) != 0) {
			tu_report(
			    fails, sizeof fails,
			    "%s: want no-effect keys \"%s\", got \"%s\"\n",
			    names[i], want, cfg.no_effect);
			nfail++;
		} else if (kind >= 2) {
			s = ej_config_validate_autoep_compile(ctx, &cfg);
			msg = epj_ctx_error(ctx);
			if (kind == 2 &&
			    (s != EPJ_ERR_CONFIG ||
			     !starts_with(msg, "compile.autoep_non_moe=true") ||
			     !strstr(msg, want))) {
				tu_report(
				    fails, sizeof fails,
				    "%s: want compile error \"%s\", got %s "
				    "\"%s\"\n",
				    names[i], want, epj_status_name(s), msg);
				nfail++;
			} else if (kind == 3 && s != EPJ_OK) {
				tu_report(fails, sizeof fails,
					  "%s: compile validation failed: %s\n",
					  names[i], msg);
				nfail++;
			}
		}
		free(want);
		epj_ctx_free(ctx);
	}
	tu_free_names(names, n);
	ck_assert_msg(nfail == 0, "%d of %d config cases failed:\n%s", nfail, n,
		      fails);
	/* Every kind of expectation must be exercised. */
	for (int k = 0; k < 6; k++)
		ck_assert_msg(kinds[k] > 0, "no config case of kind %d", k);
}
END_TEST

/* ---- defaults and parsed values ------------------------------------------
 */

static void parse_ok(epj_ctx *ctx, const char *json, ej_config *cfg)
{
	epj_status s = ej_config_parse(ctx, json, "test.json", cfg);
	ck_assert_msg(s == EPJ_OK, "parse failed: %s\n%s", epj_ctx_error(ctx),
		      json);
}

static void parse_err(epj_ctx *ctx, const char *json, const char *want)
{
	ej_config cfg;
	epj_status s = ej_config_parse(ctx, json, "test.json", &cfg);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(s == EPJ_ERR_CONFIG, "want error \"%s\", got %s for %s",
		      want, epj_status_name(s), json);
	ck_assert_msg(starts_with(msg, "config error in test.json: "),
		      "message lacks prefix: %s", msg);
	ck_assert_msg(strstr(msg, want), "want \"%s\" in \"%s\"", want, msg);
	/* A failed parse leaves the defaults. */
	ej_config def;
	ej_config_defaults(&def);
	snprintf(def.source, sizeof def.source, "%s", cfg.source);
	ck_assert_int_eq(cfg.zero.stage, def.zero.stage);
	ck_assert_int_eq(cfg.compile.autoep_non_moe, false);
	ck_assert_int_eq(cfg.steps_per_print, 10);
}

START_TEST(test_defaults)
{
	epj_ctx *ctx = tu_ctx();
	ej_config c;
	parse_ok(ctx, "{}", &c);
	ck_assert_str_eq(c.source, "test.json");
	ck_assert(!c.train_batch_size_given && !c.micro_batch_given &&
		  !c.gas_given);
	ck_assert(!c.bf16_enabled);
	ck_assert(!c.optimizer.given);
	ck_assert_int_eq(c.optimizer.type, EJ_OPTIM_ADAMW);
	ck_assert(c.optimizer.lr == 1e-3);
	ck_assert(c.optimizer.betas[0] == 0.9 && c.optimizer.betas[1] == 0.999);
	ck_assert(c.optimizer.eps == 1e-8);
	ck_assert(c.optimizer.weight_decay == 0.0);
	ck_assert(c.optimizer.adam_w_mode);
	ck_assert_int_eq(c.scheduler.type, EJ_SCHED_NONE);
	ck_assert(c.gradient_clipping == 0.0);
	ck_assert_int_eq(c.zero.stage, 0);
	ck_assert(!c.zero.offload_optimizer.present &&
		  !c.zero.offload_optimizer.active);
	ck_assert(!c.zero.offload_param.present &&
		  !c.zero.offload_param.active);
	ck_assert_int_eq(c.zero.reduce_bucket_size, 500000000);
	ck_assert(c.zero.contiguous_gradients && !c.zero.overlap_comm);
	ck_assert(!c.activation_checkpointing.enabled);
	ck_assert(!c.expert_parallel.enabled);
	ck_assert_int_eq(c.expert_parallel.autoep_size, 1);
	ck_assert_str_eq(c.expert_parallel.comm_backend, "comm");
	ck_assert_int_eq(c.expert_parallel.top_k, 0);
	ck_assert_int_eq(c.expert_parallel.route_norm, -1);
	ck_assert(c.expert_parallel.has_load_balance &&
		  c.expert_parallel.load_balance_coeff == 0);
	ck_assert(!c.compile.autoep_non_moe);
	ck_assert_str_eq(c.compile.backend, "");
	ck_assert_int_eq(c.compile.fullgraph, EJ_JSON_FALSE);
	ck_assert_int_eq(c.compile.dynamic, EJ_JSON_FALSE);
	ck_assert(!c.compile.fullgraph_given && !c.compile.dynamic_given);
	ck_assert(!c.compile.deepcompile && !c.compile.compiled_autograd &&
		  !c.compile.schedule_present);
	ck_assert_int_eq(c.sequence_parallel_size, 1);
	ck_assert_int_eq(c.pipeline_stages, 1);
	ck_assert_int_eq(c.autotp_size, 1);
	ck_assert_int_eq(c.steps_per_print, 10);
	ck_assert_int_eq(c.seed, 42);
	ck_assert(!c.wall_clock_breakdown);
	/* The default config passes the autoep compile boundary, and so does
	 * the option itself with nothing else set. */
	ck_assert_int_eq(ej_config_validate_autoep_compile(ctx, &c), EPJ_OK);
	parse_ok(ctx, "{\"compile\": {\"autoep_non_moe\": true}}", &c);
	ck_assert(c.compile.autoep_non_moe);
	ck_assert_int_eq(ej_config_validate_autoep_compile(ctx, &c), EPJ_OK);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_full_config_values)
{
	epj_ctx *ctx = tu_ctx();
	/* Random values so that a parser that ignores a key cannot pass by
	 * matching a default. */
	int64_t micro = tu_randint(1, 9), gas = tu_randint(1, 7);
	int64_t world = tu_randint(1, 5);
	double lr = tu_uniform(1e-5, 1e-2), clip = tu_uniform(0.1, 3.0);
	double b1 = tu_uniform(0.5, 0.95), b2 = tu_uniform(0.95, 0.9999);
	double wd = tu_uniform(0, 0.2), eps = tu_uniform(1e-9, 1e-6);
	int64_t warm = tu_randint(0, 100), total = warm + tu_randint(1, 1000);
	int stage = (int)tu_randint(0, 4), ep = (int)tu_randint(1, 17);
	int topk = (int)tu_randint(1, 9);
	int64_t seed = tu_randint(0, 1000000), spp = tu_randint(1, 50);
	char json[4096];
	snprintf(
	    json, sizeof json,
	    "{\"train_batch_size\": %" PRId64
	    ", \"train_micro_batch_size_per_gpu\": %" PRId64 ",\n"
	    " \"gradient_accumulation_steps\": %" PRId64 ",\n"
	    " \"bf16\": {\"enabled\": true}, \"fp16\": {\"enabled\": "
	    "false, \"loss_scale\": 0},\n"
	    " \"optimizer\": {\"type\": \"adamw\", \"params\": {\"lr\": "
	    "%.17g, \"betas\": [%.17g, %.17g], \"eps\": %.17g, "
	    "\"weight_decay\": %.17g}},\n"
	    " \"scheduler\": {\"type\": \"WarmupCosineLR\", \"params\": "
	    "{\"total_num_steps\": %" PRId64 ", \"warmup_num_steps\": "
	    "%" PRId64 ", \"cos_min_ratio\": 0.25, \"warmup_min_ratio\": "
	    "0.125, \"warmup_type\": \"linear\"}},\n"
	    " \"gradient_clipping\": %.17g,\n"
	    " \"zero_optimization\": {\"stage\": %d, \"offload_optimizer\": "
	    "{\"device\": \"cpu\", \"pin_memory\": true}, "
	    "\"offload_param\": {\"device\": \"none\"}, "
	    "\"reduce_bucket_size\": 2e8, \"allgather_bucket_size\": "
	    "300000000, \"overlap_comm\": true, \"contiguous_gradients\": "
	    "false},\n"
	    " \"activation_checkpointing\": {\"enabled\": true, "
	    "\"partition_activations\": true, \"cpu_checkpointing\": false, "
	    "\"contiguous_memory_optimization\": true, "
	    "\"number_checkpoints\": 4, "
	    "\"synchronize_checkpoint_boundary\": true, \"profile\": "
	    "true},\n"
	    " \"expert_parallel\": {\"enabled\": true, \"autoep_size\": %d, "
	    "\"comm_backend\": \"deepep\", \"async_split_plan\": true, "
	    "\"top_k\": %d, \"fixed_routing\": true, "
	    "\"load_balance_coeff\": null, \"route_norm\": false, "
	    "\"route_scale\": 2.5, \"preset_model\": \"qwen3_moe\", "
	    "\"routed_scaling_factor\": 1.75, \"score_func\": \"sigmoid\", "
	    "\"score_apply\": \"post\", \"num_expert_groups\": 8, "
	    "\"num_limited_groups\": 3},\n"
	    " \"compile\": {\"autoep_non_moe\": true, \"backend\": "
	    "\"cuda-sim\", \"fullgraph\": true, \"dynamic\": null, "
	    "\"deepcompile\": true, \"compiled_autograd\": true, "
	    "\"schedule\": [[0, [\"z1\"]]]},\n"
	    " \"sequence_parallel_size\": 3, \"pipeline\": {\"stages\": 5}, "
	    "\"tensor_parallel\": {\"autotp_size\": 7},\n"
	    " \"steps_per_print\": %" PRId64 ", \"seed\": %" PRId64
	    ", \"wall_clock_breakdown\": true}",
	    micro * gas * world, micro, gas, lr, b1, b2, eps, wd, total, warm,
	    clip, stage, ep, topk, spp, seed);
	ej_config c;
	parse_ok(ctx, json, &c);
	ck_assert(c.train_batch_size_given && c.micro_batch_given &&
		  c.gas_given);
	ck_assert_int_eq(c.train_batch_size, micro * gas * world);
	ck_assert_int_eq(c.micro_batch_per_gpu, micro);
	ck_assert_int_eq(c.gradient_accumulation_steps, gas);
	ck_assert(c.bf16_enabled);
	ck_assert(c.optimizer.given && c.optimizer.type == EJ_OPTIM_ADAMW);
	ck_assert(c.optimizer.lr == lr && c.optimizer.eps == eps);
	ck_assert(c.optimizer.betas[0] == b1 && c.optimizer.betas[1] == b2);
	ck_assert(c.optimizer.weight_decay == wd && c.optimizer.adam_w_mode);
	ck_assert_int_eq(c.scheduler.type, EJ_SCHED_WARMUP_COSINE_LR);
	ck_assert_int_eq(c.scheduler.total_num_steps, total);
	ck_assert_int_eq(c.scheduler.warmup_num_steps, warm);
	ck_assert(c.scheduler.cos_min_ratio == 0.25);
	ck_assert(c.scheduler.warmup_min_ratio == 0.125);
	ck_assert_int_eq(c.scheduler.warmup_type, EJ_WARMUP_LINEAR);
	ck_assert(c.gradient_clipping == clip);
	ck_assert_int_eq(c.zero.stage, stage);
	ck_assert(c.zero.offload_optimizer.present &&
		  c.zero.offload_optimizer.active &&
		  c.zero.offload_optimizer.device == EJ_OFFLOAD_CPU &&
		  c.zero.offload_optimizer.pin_memory);
	ck_assert(c.zero.offload_param.present && !c.zero.offload_param.active);
	ck_assert_int_eq(c.zero.reduce_bucket_size, 200000000);
	ck_assert_int_eq(c.zero.allgather_bucket_size, 300000000);
	ck_assert(c.zero.overlap_comm && !c.zero.contiguous_gradients);
	ck_assert(c.activation_checkpointing.enabled &&
		  c.activation_checkpointing.partition_activations &&
		  !c.activation_checkpointing.cpu_checkpointing &&
		  c.activation_checkpointing.contiguous_memory_optimization &&
		  c.activation_checkpointing.synchronize_checkpoint_boundary &&
		  c.activation_checkpointing.profile);
	ck_assert_int_eq(c.activation_checkpointing.number_checkpoints, 4);
	ck_assert(c.expert_parallel.enabled &&
		  c.expert_parallel.async_split_plan &&
		  c.expert_parallel.fixed_routing);
	ck_assert_int_eq(c.expert_parallel.autoep_size, ep);
	ck_assert_int_eq(c.expert_parallel.top_k, topk);
	ck_assert_str_eq(c.expert_parallel.comm_backend, "deepep");
	ck_assert_str_eq(c.expert_parallel.preset_model, "qwen3_moe");
	ck_assert(!c.expert_parallel.has_load_balance);
	ck_assert_int_eq(c.expert_parallel.route_norm, 0);
	ck_assert(c.expert_parallel.route_scale == 2.5);
	ck_assert(c.expert_parallel.has_routed_scaling_factor &&
		  c.expert_parallel.routed_scaling_factor == 1.75);
	ck_assert_str_eq(c.expert_parallel.score_func, "sigmoid");
	ck_assert_str_eq(c.expert_parallel.score_apply, "post");
	ck_assert_int_eq(c.expert_parallel.num_expert_groups, 8);
	ck_assert_int_eq(c.expert_parallel.num_limited_groups, 3);
	ck_assert(c.compile.autoep_non_moe && c.compile.deepcompile &&
		  c.compile.compiled_autograd && c.compile.schedule_present);
	ck_assert_str_eq(c.compile.backend, "cuda-sim");
	ck_assert(c.compile.fullgraph == EJ_JSON_TRUE &&
		  c.compile.fullgraph_given);
	ck_assert(c.compile.dynamic == EJ_JSON_NULL && c.compile.dynamic_given);
	ck_assert_int_eq(c.sequence_parallel_size, 3);
	ck_assert_int_eq(c.pipeline_stages, 5);
	ck_assert_int_eq(c.autotp_size, 7);
	ck_assert_int_eq(c.steps_per_print, spp);
	ck_assert_int_eq(c.seed, seed);
	ck_assert(c.wall_clock_breakdown);
	/* Everything unsupported at once: the first check reports. */
	ck_assert_int_eq(ej_config_validate_autoep_compile(ctx, &c),
			 EPJ_ERR_CONFIG);
	ck_assert(strstr(epj_ctx_error(ctx), "DeepCompile"));
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_null_false_true)
{
	epj_ctx *ctx = tu_ctx();
	static const char *const vals[] = { "false", "true", "null" };
	static const ej_json_bool want[] = { EJ_JSON_FALSE, EJ_JSON_TRUE,
					     EJ_JSON_NULL };
	for (int i = 0; i < 3; i++) {
		for (int k = 0; k < 2; k++) {
			char json[200];
			snprintf(json, sizeof json,
				 "{\"compile\": {\"autoep_non_moe\": true, "
				 "\"%s\": %s}}",
				 k ? "dynamic" : "fullgraph", vals[i]);
			ej_config c;
			parse_ok(ctx, json, &c);
			ej_json_bool got =
			    k ? c.compile.dynamic : c.compile.fullgraph;
			ck_assert_int_eq(got, want[i]);
			ck_assert(k ? c.compile.dynamic_given
				    : c.compile.fullgraph_given);
			epj_status s =
			    ej_config_validate_autoep_compile(ctx, &c);
			ck_assert_int_eq(s, i == 0 ? EPJ_OK : EPJ_ERR_CONFIG);
			if (i) {
				/* DeepSpeed's wording, then the value */
				char w[64], ds[64];
				snprintf(w, sizeof w, "(compile.%s is %s)",
					 k ? "dynamic" : "fullgraph", vals[i]);
				snprintf(ds, sizeof ds, "requires %s=False",
					 k ? "dynamic" : "fullgraph");
				ck_assert_msg(
				    strstr(epj_ctx_error(ctx), w) &&
					strstr(epj_ctx_error(ctx), ds),
				    "%s", epj_ctx_error(ctx));
			}
		}
	}
	/* schedule: absent and null are "not present", [] and {} are. */
	static const char *const sched[] = { "null", "[]", "{}" };
	for (int i = 0; i < 3; i++) {
		char json[200];
		snprintf(json, sizeof json, "{\"compile\": {\"schedule\": %s}}",
			 sched[i]);
		ej_config c;
		parse_ok(ctx, json, &c);
		ck_assert_int_eq(c.compile.schedule_present, i > 0);
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_optimizer_names_and_params)
{
	epj_ctx *ctx = tu_ctx();
	static const char *const names[] = { "sgd",  "SGD",   "Sgd",  "adam",
					     "ADAM", "AdamW", "adamw" };
	static const ej_optim_type want[] = { EJ_OPTIM_SGD,  EJ_OPTIM_SGD,
					      EJ_OPTIM_SGD,  EJ_OPTIM_ADAM,
					      EJ_OPTIM_ADAM, EJ_OPTIM_ADAMW,
					      EJ_OPTIM_ADAMW };
	for (size_t i = 0; i < EJ_ARRAY_LEN(names); i++) {
		char json[200];
		snprintf(json, sizeof json,
			 "{\"optimizer\": {\"type\": \"%s\"}}", names[i]);
		ej_config c;
		parse_ok(ctx, json, &c);
		ck_assert_int_eq(c.optimizer.type, want[i]);
		ck_assert_int_eq(c.optimizer.adam_w_mode,
				 want[i] != EJ_OPTIM_SGD);
	}
	ej_config c;
	double mom = tu_uniform(0.1, 0.99);
	char json[300];
	snprintf(json, sizeof json,
		 "{\"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": 1, "
		 "\"momentum\": %.17g, \"nesterov\": true}}}",
		 mom);
	parse_ok(ctx, json, &c);
	ck_assert(c.optimizer.momentum == mom && c.optimizer.nesterov);
	ck_assert(c.optimizer.lr == 1.0);
	parse_ok(ctx,
		 "{\"optimizer\": {\"type\": \"Adam\", \"params\": "
		 "{\"adam_w_mode\": false}}}",
		 &c);
	ck_assert(!c.optimizer.adam_w_mode);
	parse_err(ctx,
		  "{\"optimizer\": {\"type\": \"AdamW\", \"params\": "
		  "{\"momentum\": 0.9}}}",
		  "\"optimizer.params.momentum\" is not a parameter of "
		  "optimizer type AdamW");
	parse_err(ctx, "{\"optimizer\": {\"params\": {\"lr\": 0.1}}}",
		  "\"optimizer.type\" is required");
	parse_err(ctx,
		  "{\"optimizer\": {\"type\": \"SGD\", \"params\": {\"lr\": "
		  "-0.5}}}",
		  "\"optimizer.params.lr\" must be a number >= 0, got -0.5");
	parse_err(
	    ctx,
	    "{\"optimizer\": {\"type\": \"Adam\", \"params\": {\"betas\": "
	    "[0.9]}}}",
	    "\"optimizer.params.betas\" must be an array of 2 numbers");
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_scheduler_values)
{
	epj_ctx *ctx = tu_ctx();
	ej_config c;
	parse_ok(ctx, "{\"scheduler\": {\"type\": \"WarmupLR\"}}", &c);
	ck_assert_int_eq(c.scheduler.type, EJ_SCHED_WARMUP_LR);
	ck_assert(c.scheduler.warmup_min_lr == 0 &&
		  c.scheduler.warmup_max_lr == 1e-3);
	ck_assert_int_eq(c.scheduler.warmup_num_steps, 1000);
	ck_assert_int_eq(c.scheduler.warmup_type, EJ_WARMUP_LOG);
	ck_assert_int_eq(c.scheduler.last_batch_iteration, -1);
	int64_t total = tu_randint(10, 100000);
	char json[300];
	snprintf(json, sizeof json,
		 "{\"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": "
		 "{\"total_num_steps\": %" PRId64
		 ", \"warmup_min_lr\": 1e-5, \"warmup_max_lr\": 3e-4, "
		 "\"warmup_num_steps\": 7}}}",
		 total);
	parse_ok(ctx, json, &c);
	ck_assert_int_eq(c.scheduler.type, EJ_SCHED_WARMUP_DECAY_LR);
	ck_assert_int_eq(c.scheduler.total_num_steps, total);
	ck_assert(c.scheduler.warmup_min_lr == 1e-5 &&
		  c.scheduler.warmup_max_lr == 3e-4);
	ck_assert_int_eq(c.scheduler.warmup_num_steps, 7);
	/* Scheduler names are exact (DeepSpeed looks the class up). */
	parse_err(ctx, "{\"scheduler\": {\"type\": \"warmuplr\"}}",
		  "(did you mean \"WarmupLR\"?)");
	parse_err(ctx,
		  "{\"scheduler\": {\"type\": \"WarmupLR\", \"params\": "
		  "{\"cos_min_ratio\": 0.1}}}",
		  "\"scheduler.params.cos_min_ratio\" is not a parameter of "
		  "scheduler type WarmupLR");
	parse_err(ctx,
		  "{\"scheduler\": {\"type\": \"WarmupLR\", \"params\": "
		  "{\"warmup_type\": \"cosine\"}}}",
		  "\"scheduler.params.warmup_type\" value \"cosine\" is not "
		  "supported");
	epj_ctx_free(ctx);
}
END_TEST

/* The compile checks by mode: with compile.autoep_non_moe, DeepSpeed's
 * engine-level boundary and its fullgraph/dynamic checks are two steps (the
 * engine checks the second after it found an AutoEP layer); without it,
 * full-model compile refuses by name what it cannot honour and accepts the
 * rest.  Neither is initialize's business (check_compile's cases). */
START_TEST(test_compile_checks_by_mode)
{
	epj_ctx *ctx = tu_ctx();
	ej_config c;
	/* option on: fullgraph/dynamic are the kwargs step only */
	parse_ok(ctx,
		 "{\"compile\": {\"autoep_non_moe\": true, \"fullgraph\": "
		 "true, \"dynamic\": true}}",
		 &c);
	ck_assert_int_eq(ej_config_validate_autoep_engine(ctx, &c), EPJ_OK);
	ck_assert_int_eq(ej_config_validate_autoep_kwargs(ctx, &c),
			 EPJ_ERR_CONFIG);
	ck_assert(strstr(epj_ctx_error(ctx), "requires fullgraph=False"));
	ck_assert_int_eq(ej_config_validate_autoep_compile(ctx, &c),
			 EPJ_ERR_CONFIG);
	ck_assert_int_eq(ej_config_validate_model_compile(ctx, &c), EPJ_OK);
	/* ... and the engine-level ones come first */
	parse_ok(ctx,
		 "{\"compile\": {\"autoep_non_moe\": true, \"fullgraph\": "
		 "true, \"compiled_autograd\": true}}",
		 &c);
	ck_assert_int_eq(ej_config_validate_autoep_engine(ctx, &c),
			 EPJ_ERR_CONFIG);
	ck_assert(strstr(epj_ctx_error(ctx), "compiled autograd"));
	ck_assert_int_eq(ej_config_validate_autoep_compile(ctx, &c),
			 EPJ_ERR_CONFIG);
	ck_assert(strstr(epj_ctx_error(ctx), "compiled autograd"));

	/* option off: each refused by name, EPJ_ERR_UNSUPPORTED */
	static const struct {
		const char *compile, *want;
	} off[] = {
		{ "\"deepcompile\": true", "compile.deepcompile=true" },
		{ "\"schedule\": []", "compile.schedule is set" },
		{ "\"schedule\": {}", "compile.schedule is set" },
		{ "\"compiled_autograd\": true",
		  "compile.compiled_autograd=true" },
		{ "\"fullgraph\": true", "compile.fullgraph=true" },
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(off); i++) {
		char json[200];
		snprintf(json, sizeof json,
			 "{\"compile\": {\"autoep_non_moe\": false, %s}}",
			 off[i].compile);
		parse_ok(ctx, json, &c);
		ck_assert_int_eq(ej_config_validate_autoep_compile(ctx, &c),
				 EPJ_OK);
		ck_assert_int_eq(ej_config_validate_model_compile(ctx, &c),
				 EPJ_ERR_UNSUPPORTED);
		const char *msg = epj_ctx_error(ctx);
		ck_assert_msg(starts_with(msg, "compile: ") &&
				  strstr(msg, off[i].want) &&
				  strstr(msg, "not implemented"),
			      "%s: %s", json, msg);
	}
	/* accepted in full-model mode: what it honours or need not act on */
	static const char *const ok[] = {
		"\"fullgraph\": false", "\"fullgraph\": null",
		"\"dynamic\": true",	"\"dynamic\": null",
		"\"schedule\": null",	"\"deepcompile\": false",
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(ok); i++) {
		char json[200];
		snprintf(json, sizeof json, "{\"compile\": {%s}}", ok[i]);
		parse_ok(ctx, json, &c);
		ck_assert_msg(ej_config_validate_model_compile(ctx, &c) ==
				  EPJ_OK,
			      "%s: %s", json, epj_ctx_error(ctx));
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_offload_forms)
{
	epj_ctx *ctx = tu_ctx();
	/* Each form is a format with one %s for the key name. */
	static const char *const forms[] = {
		"",
		", \"%s\": null",
		", \"%s\": {}",
		", \"%s\": {\"device\": \"none\"}",
		", \"%s\": {\"device\": \"none\", \"pin_memory\": true}",
		", \"%s\": {\"device\": \"cpu\"}",
		", \"%s\": {\"device\": \"nvme\", \"nvme_path\": \"/nvme\"}",
	};
	static const bool present[] = { 0, 0, 1, 1, 1, 1, 1 };
	static const bool active[] = { 0, 0, 0, 0, 0, 1, 1 };
	for (int which = 0; which < 2; which++) {
		for (size_t i = 0; i < EJ_ARRAY_LEN(forms); i++) {
			char form[200], json[400];
			snprintf(form, sizeof form, forms[i],
				 which ? "offload_param" : "offload_optimizer");
			snprintf(json, sizeof json,
				 "{\"compile\": {\"autoep_non_moe\": true}, "
				 "\"zero_optimization\": {\"stage\": 2%s}}",
				 form);
			ej_config c;
			parse_ok(ctx, json, &c);
			const ej_offload_config *o =
			    which ? &c.zero.offload_param
				  : &c.zero.offload_optimizer;
			ck_assert_msg(o->present == present[i] &&
					  o->active == active[i],
				      "%s", json);
			epj_status s =
			    ej_config_validate_autoep_compile(ctx, &c);
			ck_assert_int_eq(s,
					 active[i] ? EPJ_ERR_CONFIG : EPJ_OK);
			if (active[i])
				ck_assert_msg(
				    strstr(epj_ctx_error(ctx),
					   "optimizer or parameter offload") &&
					strstr(epj_ctx_error(ctx),
					       which ? "offload_param.device"
						     : "offload_optimizer."
						       "device"),
				    "%s", epj_ctx_error(ctx));
		}
	}
	epj_ctx_free(ctx);
}
END_TEST

/* ---- batch resolution ------------------------------------------------------
 */

START_TEST(test_resolve_batch)
{
	epj_ctx *ctx = tu_ctx();
	for (int iter = 0; iter < 200; iter++) {
		int64_t mb = tu_randint(1, 9), ga = tu_randint(1, 6);
		int w = (int)tu_randint(1, 9);
		int64_t tb = mb * ga * w;
		int mask = (int)tu_randint(0, 8); /* which keys are given */
		char json[300];
		size_t o = (size_t)snprintf(json, sizeof json, "{");
		if (mask & 1)
			o += (size_t)snprintf(
			    json + o, sizeof json - o,
			    "\"train_batch_size\": %" PRId64 ",", tb);
		if (mask & 2)
			o += (size_t)snprintf(
			    json + o, sizeof json - o,
			    "\"train_micro_batch_size_per_gpu\": %" PRId64 ",",
			    mb);
		if (mask & 4)
			o += (size_t)snprintf(
			    json + o, sizeof json - o,
			    "\"gradient_accumulation_steps\": %" PRId64 ",",
			    ga);
		snprintf(json + o, sizeof json - o, "\"seed\": 1}");
		ej_config c;
		parse_ok(ctx, json, &c);
		ck_assert_int_eq(ej_config_resolve_batch(ctx, &c, w), EPJ_OK);
		/* Reference: DeepSpeed's rules. */
		int64_t etb, emb, ega;
		switch (mask) {
		case 7:
		case 3:
		case 5:
		case 6:
			etb = tb, emb = mb, ega = ga;
			break;
		case 1:
			etb = tb, ega = 1, emb = tb / w;
			break;
		case 2:
			etb = mb * w, emb = mb, ega = 1;
			break;
		case 4:
			etb = ga * w, emb = 1, ega = ga;
			break;
		default:
			etb = w, emb = 1, ega = 1;
			break;
		}
		ck_assert_msg(
		    c.train_batch_size == etb && c.micro_batch_per_gpu == emb &&
			c.gradient_accumulation_steps == ega,
		    "mask %d w %d: got %" PRId64 "/%" PRId64 "/%" PRId64
		    " want %" PRId64 "/%" PRId64 "/%" PRId64,
		    mask, w, c.train_batch_size, c.micro_batch_per_gpu,
		    c.gradient_accumulation_steps, etb, emb, ega);
		ck_assert_int_eq(c.batch_world_size, w);
		/* Idempotent. */
		ck_assert_int_eq(ej_config_resolve_batch(ctx, &c, w), EPJ_OK);
		ck_assert_int_eq(c.train_batch_size, etb);
	}
	/* Inconsistent for the world size: the message names the three values
	 * and the world size. */
	int64_t mb = tu_randint(2, 9), ga = tu_randint(2, 6);
	int w = (int)tu_randint(2, 5);
	char json[300];
	snprintf(json, sizeof json,
		 "{\"train_batch_size\": %" PRId64
		 ", \"train_micro_batch_size_per_gpu\": %" PRId64
		 ", \"gradient_accumulation_steps\": %" PRId64 "}",
		 mb * ga * w, mb, ga);
	ej_config c;
	parse_ok(ctx, json, &c);
	ck_assert_int_eq(ej_config_resolve_batch(ctx, &c, w + 1),
			 EPJ_ERR_CONFIG);
	char want[300];
	snprintf(want, sizeof want,
		 "train_batch_size (%" PRId64
		 ") must equal train_micro_batch_size_per_gpu (%" PRId64
		 ") * gradient_accumulation_steps (%" PRId64
		 ") * world size (%d)",
		 mb * ga * w, mb, ga, w + 1);
	ck_assert_msg(strstr(epj_ctx_error(ctx), want), "%s",
		      epj_ctx_error(ctx));
	ck_assert(starts_with(epj_ctx_error(ctx), "config error in test.json"));
	/* train_batch_size alone not divisible by the world size. */
	parse_ok(ctx, "{\"train_batch_size\": 7}", &c);
	ck_assert_int_eq(ej_config_resolve_batch(ctx, &c, 2), EPJ_ERR_CONFIG);
	ck_assert_int_eq(ej_config_resolve_batch(ctx, &c, 7), EPJ_OK);
	ck_assert_int_eq(c.micro_batch_per_gpu, 1);
	ck_assert_int_eq(ej_config_resolve_batch(ctx, &c, 0), EPJ_ERR_INVALID);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- dump round trip -------------------------------------------------------
 */

static void expect_same(const ej_config *a, const ej_config *b)
{
	/* Flags that record how a value was written, not the value. */
	ej_config x = *a, y = *b;
	y.optimizer.given = x.optimizer.given;
	y.compile.fullgraph_given = x.compile.fullgraph_given;
	y.compile.dynamic_given = x.compile.dynamic_given;
	y.train_batch_size_given = x.train_batch_size_given;
	y.micro_batch_given = x.micro_batch_given;
	y.gas_given = x.gas_given;
	y.batch_world_size = x.batch_world_size;
	memcpy(y.source, x.source, sizeof x.source);
	memcpy(y.no_effect, x.no_effect, sizeof x.no_effect);
	memcpy(y.auto_keys, x.auto_keys, sizeof x.auto_keys);
	ck_assert_int_eq(x.train_batch_size, y.train_batch_size);
	ck_assert(x.optimizer.lr == y.optimizer.lr);
	ck_assert(x.scheduler.cos_min_ratio == y.scheduler.cos_min_ratio);
	ck_assert_str_eq(x.compile.backend, y.compile.backend);
	ck_assert_msg(memcmp(&x, &y, sizeof x) == 0,
		      "config differs after a JSON round trip");
}

/* A random value with 6 decimals, as configs are written: the dump's 15
 * significant digits reproduce it exactly. */
static double qu(double lo, double hi)
{
	return round(tu_uniform(lo, hi) * 1e6) / 1e6;
}

START_TEST(test_dump_round_trip)
{
	epj_ctx *ctx = tu_ctx();
	for (int iter = 0; iter < 30; iter++) {
		ej_config c;
		ej_config_defaults(&c);
		if (iter % 3 == 0) {
			c.micro_batch_per_gpu = tu_randint(1, 9);
			c.micro_batch_given = true;
			c.gradient_accumulation_steps = tu_randint(1, 9);
			c.gas_given = true;
			ck_assert_int_eq(ej_config_resolve_batch(
					     ctx, &c, (int)tu_randint(1, 5)),
					 EPJ_OK);
		}
		c.bf16_enabled = tu_randint(0, 2);
		c.optimizer.type = (ej_optim_type)tu_randint(0, 3);
		c.optimizer.lr = qu(0, 1);
		c.optimizer.weight_decay = qu(0, 1);
		if (c.optimizer.type == EJ_OPTIM_SGD) {
			c.optimizer.momentum = qu(0.1, 0.9);
			c.optimizer.nesterov = tu_randint(0, 2);
			c.optimizer.adam_w_mode = false;
		} else {
			c.optimizer.betas[0] = qu(0, 0.99);
			c.optimizer.betas[1] = qu(0, 0.99);
			c.optimizer.eps =
			    qu(1e-6, 1e-3); /* > 0 after rounding */
			c.optimizer.adam_w_mode =
			    c.optimizer.type == EJ_OPTIM_ADAMW ||
			    tu_randint(0, 2);
		}
		c.scheduler.type = (ej_sched_type)tu_randint(0, 4);
		if (c.scheduler.type != EJ_SCHED_NONE) {
			c.scheduler.warmup_num_steps = tu_randint(0, 100);
			c.scheduler.warmup_type =
			    (ej_warmup_type)tu_randint(0, 2);
			c.scheduler.last_batch_iteration = tu_randint(-1, 10);
			if (c.scheduler.type == EJ_SCHED_WARMUP_COSINE_LR) {
				c.scheduler.cos_min_ratio = qu(0, 1);
				c.scheduler.warmup_min_ratio = qu(0, 1);
			} else {
				c.scheduler.warmup_min_lr = qu(0, 1);
				c.scheduler.warmup_max_lr = qu(0, 1);
			}
			if (c.scheduler.type != EJ_SCHED_WARMUP_LR)
				c.scheduler.total_num_steps =
				    tu_randint(100, 1000);
		}
		c.gradient_clipping = qu(0, 2);
		c.zero.stage = (int)tu_randint(0, 4);
		if (tu_randint(0, 2)) {
			c.zero.offload_optimizer.present = true;
			c.zero.offload_optimizer.device =
			    (ej_offload_device)tu_randint(0, 2);
			c.zero.offload_optimizer.active =
			    c.zero.offload_optimizer.device != EJ_OFFLOAD_NONE;
			c.zero.offload_optimizer.pin_memory = tu_randint(0, 2);
		}
		c.zero.reduce_bucket_size = tu_randint(1, 1000000000);
		c.zero.overlap_comm = tu_randint(0, 2);
		c.activation_checkpointing.enabled = tu_randint(0, 2);
		c.activation_checkpointing.number_checkpoints =
		    tu_randint(0, 5);
		c.expert_parallel.enabled = tu_randint(0, 2);
		c.expert_parallel.autoep_size = (int)tu_randint(1, 64);
		c.expert_parallel.top_k = (int)tu_randint(0, 9);
		c.expert_parallel.route_norm = (int)tu_randint(-1, 2);
		c.expert_parallel.route_scale = qu(-2, 2);
		c.expert_parallel.has_routed_scaling_factor = tu_randint(0, 2);
		c.expert_parallel.routed_scaling_factor =
		    c.expert_parallel.has_routed_scaling_factor ? qu(-1, 3) : 0;
		static const char *const sf[] = { "auto", "softmax",
						  "sigmoid" };
		static const char *const sa[] = { "auto", "pre", "post" };
		snprintf(c.expert_parallel.score_func,
			 sizeof c.expert_parallel.score_func, "%s",
			 sf[tu_randint(0, 3)]);
		snprintf(c.expert_parallel.score_apply,
			 sizeof c.expert_parallel.score_apply, "%s",
			 sa[tu_randint(0, 3)]);
		c.expert_parallel.num_expert_groups = (int)tu_randint(0, 9);
		c.expert_parallel.num_limited_groups =
		    c.expert_parallel.num_expert_groups
			? (int)tu_randint(
			      0, c.expert_parallel.num_expert_groups + 1)
			: (int)tu_randint(0, 4);
		c.expert_parallel.has_load_balance = tu_randint(0, 2);
		c.expert_parallel.load_balance_coeff =
		    c.expert_parallel.has_load_balance ? qu(0, 1) : 0;
		c.expert_parallel.async_split_plan = tu_randint(0, 2);
		c.compile.autoep_non_moe = tu_randint(0, 2);
		c.compile.fullgraph = (ej_json_bool)tu_randint(0, 3);
		c.compile.dynamic = (ej_json_bool)tu_randint(0, 3);
		c.compile.schedule_present = tu_randint(0, 2);
		c.compile.deepcompile = tu_randint(0, 2);
		if (tu_randint(0, 2))
			snprintf(c.compile.backend, sizeof c.compile.backend,
				 "%s", "nvrtc");
		c.sequence_parallel_size = (int)tu_randint(1, 4);
		c.pipeline_stages = (int)tu_randint(1, 4);
		c.autotp_size = (int)tu_randint(1, 4);
		c.steps_per_print = tu_randint(1, 100);
		c.seed = tu_randint(0, 1 << 30);
		c.wall_clock_breakdown = tu_randint(0, 2);

		char *text = ej_config_to_json(&c);
		ck_assert_ptr_nonnull(text);
		ej_config back;
		epj_status s = ej_config_parse(ctx, text, "dump", &back);
		ck_assert_msg(s == EPJ_OK, "%s\n%s", epj_ctx_error(ctx), text);
		expect_same(&c, &back);
		free(text);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* The moe section (Megatron's router losses): random coefficients read
 * into their fields; null is 0 (off); a negative number or a string is an
 * error naming the key; the writer gives the values back, and writes no
 * moe section when every loss is off. */
START_TEST(test_moe_losses)
{
	epj_ctx *ctx = tu_ctx();
	const char *key[4] = { "aux_loss_coeff", "seq_aux_loss_coeff",
			       "global_aux_loss_coeff", "z_loss_coeff" };
	for (int iter = 0; iter < 8; iter++) {
		double v[4];
		char json[512];
		for (int i = 0; i < 4; i++)
			v[i] = tu_randint(0, 3) ? qu(1e-4, 2.0) : 0;
		snprintf(json, sizeof json,
			 "{\"moe\": {\"%s\": %.17g, \"%s\": %.17g, "
			 "\"%s\": %.17g, \"%s\": %.17g}}",
			 key[0], v[0], key[1], v[1], key[2], v[2], key[3],
			 v[3]);
		ej_config c, back;
		parse_ok(ctx, json, &c);
		const double got[4] = { c.moe.aux_loss_coeff,
					c.moe.seq_aux_loss_coeff,
					c.moe.global_aux_loss_coeff,
					c.moe.z_loss_coeff };
		for (int i = 0; i < 4; i++)
			ck_assert_msg(got[i] == v[i], "%s: %.17g, want %.17g",
				      key[i], got[i], v[i]);
		char *text = ej_config_to_json(&c);
		ck_assert_ptr_nonnull(text);
		parse_ok(ctx, text, &back);
		expect_same(&c, &back);
		bool on = v[0] > 0 || v[1] > 0 || v[2] > 0 || v[3] > 0;
		ck_assert_msg(on == (strstr(text, "\"moe\"") != NULL), "%s",
			      text);
		free(text);
	}
	ej_config c;
	parse_ok(ctx,
		 "{\"moe\": {\"aux_loss_coeff\": null, \"z_loss_coeff\": "
		 "null}}",
		 &c);
	ck_assert(c.moe.aux_loss_coeff == 0 && c.moe.z_loss_coeff == 0);
	parse_err(ctx, "{\"moe\": {\"seq_aux_loss_coeff\": -0.1}}",
		  "\"moe.seq_aux_loss_coeff\" must be");
	parse_err(ctx, "{\"moe\": {\"z_loss_coeff\": \"1e-3\"}}",
		  "\"moe.z_loss_coeff\"");
	parse_err(ctx, "{\"moe\": {\"aux_loss_coef\": 0.01}}",
		  "\"moe.aux_loss_coeff\"");
	epj_ctx_free(ctx);
}
END_TEST

/* ---- "auto" ----------------------------------------------------------------
 */

/* Every key that takes "auto", written "auto" (test_auto_every_key checks
 * the list against the reference's "auto" column). */
static const char every_auto[] =
    "{\"train_batch_size\": \"auto\", "
    "\"train_micro_batch_size_per_gpu\": \"auto\", "
    "\"gradient_accumulation_steps\": \"auto\", "
    "\"gradient_clipping\": \"auto\", "
    "\"bf16\": {\"enabled\": \"auto\"}, "
    "\"fp16\": {\"enabled\": \"auto\"}, "
    "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\", "
    "\"betas\": \"auto\", \"eps\": \"auto\", \"weight_decay\": \"auto\"}}, "
    "\"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": {"
    "\"warmup_min_lr\": \"auto\", \"warmup_max_lr\": \"auto\", "
    "\"warmup_num_steps\": \"auto\", \"total_num_steps\": \"auto\"}}, "
    "\"zero_optimization\": {\"stage\": 2, \"reduce_bucket_size\": \"auto\", "
    "\"allgather_bucket_size\": \"auto\", "
    "\"stage3_prefetch_bucket_size\": \"auto\", "
    "\"prefetch_bucket_size\": \"auto\", "
    "\"stage3_param_persistence_threshold\": \"auto\", "
    "\"param_persistence_threshold\": \"auto\", "
    "\"model_persistence_threshold\": \"auto\", "
    "\"stage3_max_live_parameters\": \"auto\", "
    "\"max_live_parameters\": \"auto\", "
    "\"stage3_max_reuse_distance\": \"auto\", "
    "\"max_reuse_distance\": \"auto\"}, "
    "\"expert_parallel\": {\"top_k\": \"auto\"}}";

/* Every row of the generated reference whose "auto" column is not
 * "refused" names a key of every_auto, and the count matches. */
START_TEST(test_auto_every_key)
{
	char *ref = ej_config_reference();
	ck_assert_ptr_nonnull(ref);
	int n_auto = 0, n_rows = 0;
	for (char *line = strtok(ref, "\n"); line; line = strtok(NULL, "\n")) {
		if (strncmp(line, "| `", 3) != 0)
			continue;
		n_rows++;
		char key[400], col[8][400];
		int nc = 0;
		char *cell = line + 2;
		while (nc < 8 && cell) {
			char *end = strstr(cell, " | ");
			size_t len = end ? (size_t)(end - cell) : strlen(cell);
			snprintf(col[nc++], sizeof col[0], "%.*s", (int)len,
				 cell);
			cell = end ? end + 3 : NULL;
		}
		ck_assert_msg(nc >= 6, "short reference row: %s", line);
		if (strcmp(col[4], "refused") == 0)
			continue;
		n_auto++;
		/* `a.b.c` -> "c": "auto" */
		snprintf(key, sizeof key, "%.398s", col[0] + 1);
		key[strcspn(key, "`")] = '\0';
		const char *last = strrchr(key, '.');
		char want[440];
		snprintf(want, sizeof want, "\"%s\": \"auto\"",
			 last ? last + 1 : key);
		ck_assert_msg(strstr(every_auto, want),
			      "%s takes \"auto\" (%s) but the test does not "
			      "write it",
			      key, col[4]);
	}
	ck_assert_int_gt(n_rows, 150);
	int in_test = 0;
	for (const char *q = every_auto; (q = strstr(q, "\"auto\"")); q++)
		in_test++;
	ck_assert_int_eq(n_auto, in_test);
	free(ref);
}
END_TEST

/* Under epjit-train (its auto_config), "auto" is the trainer's value:
 * the same config as one that writes those values out. */
START_TEST(test_auto_trainer_values)
{
	epj_ctx *ctx = tu_ctx();
	char autos[1024];
	auto_config(autos, sizeof autos, 123);
	ej_config c, want;
	ck_assert_msg(ej_config_parse_auto(ctx, every_auto, "auto.json", autos,
					   &c) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert(c.micro_batch_given && c.micro_batch_per_gpu == 8);
	ck_assert(c.gas_given && c.gradient_accumulation_steps == 1);
	ck_assert(!c.train_batch_size_given);
	ck_assert(!c.bf16_enabled);
	ck_assert(c.optimizer.lr == 3e-3);
	ck_assert(c.optimizer.betas[0] == 0.9 && c.optimizer.betas[1] == 0.95);
	ck_assert(c.optimizer.eps == 1e-8);
	ck_assert(c.optimizer.weight_decay == 0.01);
	ck_assert(c.scheduler.warmup_min_lr == 0);
	ck_assert(c.scheduler.warmup_max_lr == 3e-3);
	ck_assert_int_eq(c.scheduler.warmup_num_steps, 20);
	ck_assert_int_eq(c.scheduler.total_num_steps, 123);
	ck_assert(c.gradient_clipping == 1.0);
	ck_assert_int_eq(c.zero.reduce_bucket_size, 500000000);
	ck_assert_int_eq(c.zero.allgather_bucket_size, 500000000);
	ck_assert_int_eq(c.expert_parallel.top_k, 0);
	/* train_batch_size: micro x accumulation x world */
	ck_assert_int_eq(ej_config_resolve_batch(ctx, &c, 3), EPJ_OK);
	ck_assert_int_eq(c.train_batch_size, 24);
	/* the same config with the values written out */
	parse_ok(
	    ctx,
	    "{\"train_micro_batch_size_per_gpu\": 8, "
	    "\"gradient_accumulation_steps\": 1, "
	    "\"gradient_clipping\": 1.0, "
	    "\"bf16\": {\"enabled\": false}, "
	    "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-3, "
	    "\"betas\": [0.9, 0.95], \"eps\": 1e-8, "
	    "\"weight_decay\": 0.01}}, "
	    "\"scheduler\": {\"type\": \"WarmupDecayLR\", \"params\": {"
	    "\"warmup_min_lr\": 0, \"warmup_max_lr\": 3e-3, "
	    "\"warmup_num_steps\": 20, \"total_num_steps\": 123}}, "
	    "\"zero_optimization\": {\"stage\": 2}}",
	    &want);
	ck_assert_int_eq(ej_config_resolve_batch(ctx, &want, 3), EPJ_OK);
	expect_same(&want, &c);
	epj_ctx_free(ctx);
}
END_TEST

/* Without the caller's values, "auto" is the key as if absent, except
 * warmup_max_lr (the optimizer's lr) and total_num_steps (an error). */
START_TEST(test_auto_library_values)
{
	epj_ctx *ctx = tu_ctx();
	/* every_auto with WarmupLR (no total_num_steps) and lr 2.5e-4 */
	char text[sizeof every_auto + 64];
	snprintf(text, sizeof text, "%s", every_auto);
	char *t = strstr(text, "WarmupDecayLR");
	ck_assert_ptr_nonnull(t);
	memmove(t + strlen("WarmupLR"), t + strlen("WarmupDecayLR"),
		strlen(t + strlen("WarmupDecayLR")) + 1);
	memcpy(t, "WarmupLR", strlen("WarmupLR"));
	t = strstr(text, ", \"total_num_steps\": \"auto\"");
	ck_assert_ptr_nonnull(t);
	memmove(t, t + strlen(", \"total_num_steps\": \"auto\""),
		strlen(t + strlen(", \"total_num_steps\": \"auto\"")) + 1);
	t = strstr(text, "\"lr\": \"auto\"");
	ck_assert_ptr_nonnull(t);
	memmove(t + strlen("\"lr\": 2.5e-4"), t + strlen("\"lr\": \"auto\""),
		strlen(t + strlen("\"lr\": \"auto\"")) + 1);
	memcpy(t, "\"lr\": 2.5e-4", strlen("\"lr\": 2.5e-4"));
	ej_config c, want;
	parse_ok(ctx, text, &c);
	ck_assert(!c.micro_batch_given && !c.gas_given &&
		  !c.train_batch_size_given);
	ck_assert(c.optimizer.lr == 2.5e-4);
	ck_assert(c.optimizer.betas[0] == 0.9 && c.optimizer.betas[1] == 0.999);
	ck_assert(c.optimizer.eps == 1e-8 && c.optimizer.weight_decay == 0);
	ck_assert(c.scheduler.warmup_min_lr == 0);
	ck_assert(c.scheduler.warmup_max_lr == 2.5e-4);
	ck_assert_int_eq(c.scheduler.warmup_num_steps, 1000);
	ck_assert(c.gradient_clipping == 0 && !c.bf16_enabled);
	ck_assert_int_eq(c.zero.reduce_bucket_size, 500000000);
	ck_assert_int_eq(ej_config_resolve_batch(ctx, &c, 2), EPJ_OK);
	ck_assert_int_eq(c.micro_batch_per_gpu, 1);
	ck_assert_int_eq(c.gradient_accumulation_steps, 1);
	ck_assert_int_eq(c.train_batch_size, 2);
	parse_ok(ctx,
		 "{\"optimizer\": {\"type\": \"AdamW\", \"params\": "
		 "{\"lr\": 2.5e-4}}, \"scheduler\": {\"type\": \"WarmupLR\", "
		 "\"params\": {\"warmup_max_lr\": 2.5e-4}}, "
		 "\"zero_optimization\": {\"stage\": 2}}",
		 &want);
	ck_assert_int_eq(ej_config_resolve_batch(ctx, &want, 2), EPJ_OK);
	expect_same(&want, &c);
	/* the library has no run length */
	parse_err(ctx, every_auto,
		  "\"scheduler.params.total_num_steps\" is \"auto\" and "
		  "nothing gives it a value");
	/* a key without a rule refuses "auto" by name */
	parse_err(ctx,
		  "{\"optimizer\": {\"type\": \"SGD\", \"params\": "
		  "{\"momentum\": \"auto\"}}}",
		  "\"optimizer.params.momentum\" does not accept \"auto\"");
	epj_ctx_free(ctx);
}
END_TEST

/* ---- every error of a file in one report ----------------------------------
 */

START_TEST(test_all_errors_reported)
{
	epj_ctx *ctx = tu_ctx();
	/* three errors in three sections, and one inside a section that
	 * also has an unknown key */
	const char *json =
	    "{\"gradient_clippin\": 1, \"zero_optimization\": {\"stage\": 9, "
	    "\"overlap_comm\": 3}, \"optimizer\": {\"type\": \"AdamW\", "
	    "\"params\": {\"lr\": -1}}, \"seed\": \"auto\"}";
	ej_config c;
	ck_assert_int_eq(ej_config_parse(ctx, json, "t.json", &c),
			 EPJ_ERR_CONFIG);
	const char *msg = epj_ctx_error(ctx);
	static const char *const want[] = {
		"config error in t.json: 5 errors:\n  ",
		"\n  unknown key \"gradient_clippin\"",
		"\n  \"zero_optimization.stage\" must be an integer in [0, 3], "
		"got 9",
		"\n  \"zero_optimization.overlap_comm\" must be a boolean",
		"\n  \"optimizer.params.lr\" must be a number >= 0, got -1",
		"\n  \"seed\" does not accept \"auto\"",
	};
	for (size_t i = 0; i < sizeof want / sizeof *want; i++)
		ck_assert_msg(strstr(msg, want[i]), "want \"%s\" in:\n%s",
			      want[i], msg);
	/* a failed parse leaves the defaults */
	ck_assert_int_eq(c.zero.stage, 0);
	ck_assert(c.gradient_clipping == 0);

	/* more errors than the message holds: whole lines, then a count */
	char big[8192];
	size_t o = (size_t)snprintf(big, sizeof big, "{");
	for (int i = 0; i < 60; i++)
		o += (size_t)snprintf(big + o, sizeof big - o,
				      "%s\"no_such_key_%02d\": 1",
				      i ? ", " : "", i);
	snprintf(big + o, sizeof big - o, "}");
	/* (each error is logged too, since not all fit) */
	ck_assert_int_eq(ej_config_parse(ctx, big, "t.json", &c),
			 EPJ_ERR_CONFIG);
	msg = epj_ctx_error(ctx);
	ck_assert_msg(
	    strstr(msg, "60 errors:\n  unknown key \"no_such_key_00\""), "%s",
	    msg);
	const char *more = strstr(msg, "\n  ... and ");
	ck_assert_msg(more != NULL, "%s", msg);
	int shown = 0;
	for (const char *q = msg; (q = strstr(q, "\n  unknown key")); q++)
		shown++;
	int rest = atoi(more + strlen("\n  ... and "));
	ck_assert_int_eq(shown + rest, 60);
	ck_assert_int_gt(shown, 5);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- messages, I/O ---------------------------------------------------------
 */

START_TEST(test_messages)
{
	epj_ctx *ctx = tu_ctx();
	parse_err(ctx, "{\"compile\": {\"autoep_non_mo\": true}}",
		  "unknown key \"compile.autoep_non_mo\" (did you mean "
		  "\"compile.autoep_non_moe\"?)");
	parse_err(ctx, "{\"train_micro_batch_size_per_gpu\": \"4\"}",
		  "\"train_micro_batch_size_per_gpu\" must be a positive "
		  "integer, got string");
	parse_err(ctx, "{\"train_micro_batch_size_per_gpu\": 2.5}",
		  "must be a positive integer, got real 2.5");
	parse_err(ctx, "{\"zero_optimization\": {\"stage\": -1}}",
		  "\"zero_optimization.stage\" must be an integer in [0, 3], "
		  "got -1");
	parse_err(ctx, "{\"steps_per_print\": 0}",
		  "\"steps_per_print\" must be a positive integer, got 0");
	parse_err(ctx, "{\"Seed\": 3}", "(did you mean \"seed\"?)");
	parse_err(ctx, "{\"xyzzy_plugh\": 3}", "unknown key \"xyzzy_plugh\"");
	parse_err(ctx, "{\"seed\": 1,\n \"seed\": 2}", "duplicate object key");
	parse_err(ctx, "{\"seed\": 1,\n  \"bf16\": {\"enabled\": tru}}",
		  "invalid JSON at line 2, column");
	parse_err(ctx, "[1, 2]", "the top level must be a JSON object");
	parse_err(ctx, "", "invalid JSON at line");
	/* NULL source name and NULL text. */
	ej_config c;
	ck_assert_int_eq(ej_config_parse(ctx, "{\"seed\": \"x\"}", NULL, &c),
			 EPJ_ERR_CONFIG);
	ck_assert(
	    starts_with(epj_ctx_error(ctx), "config error in <string>: "));
	ck_assert_int_eq(ej_config_parse(ctx, NULL, "x.json", &c),
			 EPJ_ERR_INVALID);
	/* Edit distance: substitutions, insertions, transpositions, case. */
	ck_assert_int_eq(ej_edit_distance("kitten", "sitting"), 3);
	ck_assert_int_eq(ej_edit_distance("stage", "stgae"), 1);
	ck_assert_int_eq(ej_edit_distance("Stage", "stage"), 0);
	ck_assert_int_eq(ej_edit_distance("", "abc"), 3);
	ck_assert_int_eq(ej_edit_distance("abc", ""), 3);
	static const char *const keys[] = { "stage", "overlap_comm" };
	ck_assert_str_eq(ej_nearest_key("stgae", keys, 2), "stage");
	ck_assert_ptr_null(ej_nearest_key("zzzzzz", keys, 2));
	ck_assert_str_eq(ej_optim_type_name(EJ_OPTIM_ADAMW), "AdamW");
	ck_assert_str_eq(ej_sched_type_name(EJ_SCHED_WARMUP_COSINE_LR),
			 "WarmupCosineLR");
	epj_ctx_free(ctx);
}
END_TEST

/* comm.timeout_s: default, a drawn value, the range. */
START_TEST(test_comm_timeout)
{
	epj_ctx *ctx = tu_ctx();
	ej_config c;
	parse_ok(ctx, "{}", &c);
	ck_assert(c.comm_timeout_s == 300.0);
	double t = 0.25 + (double)tu_randint(0, 10000) / 8.0;
	char js[96];
	snprintf(js, sizeof js, "{\"comm\": {\"timeout_s\": %.17g}}", t);
	parse_ok(ctx, js, &c);
	ck_assert(c.comm_timeout_s == t);
	parse_err(ctx, "{\"comm\": {\"timeout_s\": 0}}",
		  "\"comm.timeout_s\" must be a number in (0, 604800]");
	parse_err(ctx, "{\"comm\": {\"timeout_s\": \"10\"}}",
		  "\"comm.timeout_s\" must be");
	parse_err(ctx, "{\"comm\": {\"timeout\": 10}}",
		  "unknown key \"comm.timeout\"");
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_load_errors)
{
	epj_ctx *ctx = tu_ctx();
	ej_config c;
	const char *missing = "/nonexistent-epjit-dir/ds.json";
	ck_assert_int_eq(ej_config_load(ctx, missing, &c), EPJ_ERR_IO);
	ck_assert_msg(strstr(epj_ctx_error(ctx), missing), "%s",
		      epj_ctx_error(ctx));
	ck_assert(strstr(epj_ctx_error(ctx), "No such file"));
	/* A directory is not a config. */
	ck_assert_int_ne(ej_config_load(ctx, "/", &c), EPJ_OK);
	/* Truncated file: every prefix of a valid config fails cleanly. */
	char tmpl[] = "/tmp/epjit-cfg-XXXXXX";
	int fd = mkstemp(tmpl);
	ck_assert_int_ge(fd, 0);
	const char *full = "{\"zero_optimization\": {\"stage\": 2}, "
			   "\"bf16\": {\"enabled\": true}}";
	for (size_t cut = 0; cut < strlen(full); cut++) {
		tu_write_file(tmpl, full, cut);
		ck_assert_int_eq(ej_config_load(ctx, tmpl, &c), EPJ_ERR_CONFIG);
		ck_assert(strstr(epj_ctx_error(ctx), "invalid JSON at line 1"));
	}
	tu_write_text(tmpl, full);
	ck_assert_int_eq(ej_config_load(ctx, tmpl, &c), EPJ_OK);
	ck_assert_int_eq(c.zero.stage, 2);
	ck_assert_str_eq(c.source, tmpl);
	/* An embedded NUL byte is rejected rather than parsed as a prefix. */
	tu_write_file(tmpl, "{}\0{\"x\": 1}", 11);
	ck_assert_int_eq(ej_config_load(ctx, tmpl, &c), EPJ_ERR_CONFIG);
	ck_assert(strstr(epj_ctx_error(ctx), "NUL byte"));
	close(fd);
	unlink(tmpl);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- the public config object (epj_config) ------------------------------
 */

/* Walks the JSON object o (the config written back) and checks that every
 * value at a key path reads back through the getter of its JSON type:
 * the getters and the writer see the same fields. */
static int check_getters_at(epj_ctx *ctx, const epj_config *c, json_t *o,
			    const char *prefix)
{
	int n = 0;
	const char *k;
	json_t *v;
	json_object_foreach(o, k, v)
	{
		char path[256];
		snprintf(path, sizeof path, "%s%s%s", prefix,
			 *prefix ? "." : "", k);
		int64_t i = -7;
		double d = -7;
		bool b;
		const char *str = NULL;
		if (json_is_object(v)) {
			ck_assert_int_eq(epj_config_int(ctx, c, path, &i),
					 EPJ_ERR_INVALID);
			ck_assert_msg(
			    strstr(epj_ctx_error(ctx), "is a section"),
			    "%s: %s", path, epj_ctx_error(ctx));
			n += check_getters_at(ctx, c, v, path);
			continue;
		}
		if (json_is_string(v) && !strcmp(json_string_value(v), "auto"))
			continue; /* a stored "auto" (top_k 0, ...) */
		if (json_is_integer(v)) {
			ck_assert_msg(epj_config_int(ctx, c, path, &i) ==
					  EPJ_OK,
				      "%s: %s", path, epj_ctx_error(ctx));
			ck_assert_int_eq(i, json_integer_value(v));
			ck_assert_int_eq(epj_config_bool(ctx, c, path, &b),
					 EPJ_ERR_INVALID);
			ck_assert_msg(strstr(epj_ctx_error(ctx),
					     "is an integer, not what "
					     "epj_config_bool reads"),
				      "%s", epj_ctx_error(ctx));
		} else if (json_is_real(v)) {
			ck_assert_msg(epj_config_real(ctx, c, path, &d) ==
					  EPJ_OK,
				      "%s: %s", path, epj_ctx_error(ctx));
			ck_assert(d == json_real_value(v));
		} else if (json_is_boolean(v)) {
			/* a true/false/null key reads as a string */
			if (epj_config_bool(ctx, c, path, &b) == EPJ_OK) {
				ck_assert(b == json_is_true(v));
			} else {
				ck_assert_msg(epj_config_str(ctx, c, path,
							     &str) == EPJ_OK,
					      "%s: %s", path,
					      epj_ctx_error(ctx));
				ck_assert_str_eq(
				    str, json_is_true(v) ? "true" : "false");
			}
		} else if (json_is_string(v)) {
			ck_assert_msg(epj_config_str(ctx, c, path, &str) ==
					  EPJ_OK,
				      "%s: %s", path, epj_ctx_error(ctx));
			ck_assert_str_eq(str, json_string_value(v));
		} else {
			continue; /* null, pairs */
		}
		n++;
	}
	return n;
}

/* Every key the config writes back reads the same through the getters,
 * on the defaults and on a config with drawn values. */
START_TEST(test_public_getters_every_key)
{
	epj_ctx *ctx = tu_ctx();
	char js[1024];
	int64_t seed = tu_randint(0, 1 << 30), mb = tu_randint(1, 64);
	double lr = (double)tu_randint(1, 1000) / 1e5;
	snprintf(js, sizeof js,
		 "{\"seed\": %" PRId64 ", \"train_micro_batch_size_per_gpu\": "
		 "%" PRId64 ", \"bf16\": {\"enabled\": true}, "
		 "\"optimizer\": {\"type\": \"Adam\", \"params\": {\"lr\": "
		 "%.17g}}, \"device\": \"cuda-sim\", \"compile\": "
		 "{\"dynamic\": null}, \"zero_optimization\": {\"stage\": 1, "
		 "\"offload_optimizer\": {\"device\": \"none\"}}, "
		 "\"data\": {\"path\": \"x.txt\", \"seed\": 5}, "
		 "\"checkpoint\": {\"writer\": {\"decoupled\": true}}}",
		 seed, mb, lr);
	const char *texts[] = { NULL, js };
	for (int t = 0; t < 2; t++) {
		epj_config *c = NULL;
		ck_assert_msg(epj_config_parse(ctx, texts[t], "ds", NULL, &c) ==
				  EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		char *text = epj_config_to_json(c);
		ck_assert_ptr_nonnull(text);
		json_t *root = json_loads(text, 0, NULL);
		ck_assert_ptr_nonnull(root);
		ck_assert_int_ge(check_getters_at(ctx, c, root, ""), 40);
		json_decref(root);
		free(text);
		epj_config_free(c);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* The values the trainer and the warm-up read, by name; what the file
 * sets; a config that fails to parse makes no object. */
START_TEST(test_public_getters_values)
{
	epj_ctx *ctx = tu_ctx();
	int64_t seed = tu_randint(0, 1 << 30), gas = tu_randint(1, 16);
	char js[512];
	snprintf(
	    js, sizeof js,
	    "{\"seed\": %" PRId64 ", \"gradient_accumulation_steps\": "
	    "%" PRId64 ", \"device\": \"cuda-sim\", \"bf16\": "
	    "{\"enabled\": \"auto\"}, \"compile\": {\"backend\": "
	    "\"interpreter\"}, \"zero_optimization\": "
	    "{\"offload_optimizer\": {\"device\": \"none\", "
	    "\"pin_memory\": true}}, \"expert_parallel\": {\"autoep_size\": "
	    "1}, \"activation_checkpointing\": {\"enabled\": true}}",
	    seed, gas);
	epj_config *c = NULL;
	ck_assert_int_eq(epj_config_parse(ctx, js, "a.json",
					  "{\"bf16\": {\"enabled\": true}}",
					  &c),
			 EPJ_OK);
	int64_t i = 0;
	double d = 0;
	bool b = false;
	const char *s = NULL;
	ck_assert_str_eq(epj_config_source(c), "a.json");
	ck_assert_int_eq(epj_config_int(ctx, c, "seed", &i), EPJ_OK);
	ck_assert_int_eq(i, seed);
	ck_assert_int_eq(
	    epj_config_int(ctx, c, "gradient_accumulation_steps", &i), EPJ_OK);
	ck_assert_int_eq(i, gas);
	/* not given: 0 until the engine resolves it for its world */
	ck_assert_int_eq(
	    epj_config_int(ctx, c, "train_micro_batch_size_per_gpu", &i),
	    EPJ_OK);
	ck_assert_int_eq(i, 0);
	ck_assert_int_eq(epj_config_str(ctx, c, "device", &s), EPJ_OK);
	ck_assert_str_eq(s, "cuda-sim");
	ck_assert_int_eq(epj_config_bool(ctx, c, "bf16.enabled", &b), EPJ_OK);
	ck_assert(b); /* "auto" took the caller's value */
	ck_assert_int_eq(epj_config_str(ctx, c, "compile.backend", &s), EPJ_OK);
	ck_assert_str_eq(s, "interpreter");
	ck_assert_int_eq(epj_config_str(ctx, c, "compile.dynamic", &s), EPJ_OK);
	ck_assert_str_eq(s, "false");
	ck_assert_int_eq(epj_config_str(ctx, c, "optimizer.type", &s), EPJ_OK);
	ck_assert_str_eq(s, "AdamW");
	ck_assert_int_eq(epj_config_real(ctx, c, "optimizer.params.lr", &d),
			 EPJ_OK);
	ck_assert(d == 1e-3);
	/* an offload section's keys are at its own base */
	ck_assert_int_eq(
	    epj_config_bool(
		ctx, c, "zero_optimization.offload_optimizer.pin_memory", &b),
	    EPJ_OK);
	ck_assert(b);
	ck_assert_int_eq(
	    epj_config_bool(ctx, c,
			    "zero_optimization.offload_param.pin_memory", &b),
	    EPJ_OK);
	ck_assert(!b);
	ck_assert_int_eq(
	    epj_config_int(ctx, c, "expert_parallel.autoep_size", &i), EPJ_OK);
	ck_assert_int_eq(i, 1);
	ck_assert_int_eq(
	    epj_config_bool(ctx, c, "activation_checkpointing.enabled", &b),
	    EPJ_OK);
	ck_assert(b);
	ck_assert(epj_config_given(c, "seed"));
	ck_assert(epj_config_given(c, "bf16.enabled"));
	ck_assert(!epj_config_given(c, "steps_per_print"));
	ck_assert(!epj_config_given(c, "data.seed"));
	ck_assert(!epj_config_given(c, "no.such.key"));
	epj_config_free(c);

	/* a bad file makes no object and names the key */
	c = (epj_config *)&c;
	ck_assert_int_eq(
	    epj_config_parse(ctx, "{\"seed\": \"x\"}", "b.json", NULL, &c),
	    EPJ_ERR_CONFIG);
	ck_assert_ptr_null(c);
	ck_assert(strstr(epj_ctx_error(ctx), "config error in b.json: "));
	ck_assert(strstr(epj_ctx_error(ctx), "\"seed\""));
	ck_assert_int_eq(
	    epj_config_load(ctx, "/nonexistent-epjit/ds.json", NULL, &c),
	    EPJ_ERR_IO);
	ck_assert_ptr_null(c);
	ck_assert(strstr(epj_ctx_error(ctx), "/nonexistent-epjit/ds.json"));
	ck_assert_int_eq(epj_config_load(ctx, NULL, NULL, &c), EPJ_OK);
	ck_assert_int_eq(epj_config_int(ctx, c, "seed", &i), EPJ_OK);
	ck_assert_int_eq(i, 42);
	epj_config_free(c);
	epj_ctx_free(ctx);
}
END_TEST

/* A getter's mistakes: each names the key and what it holds. */
START_TEST(test_public_getter_errors)
{
	epj_ctx *ctx = tu_ctx();
	epj_config *c = NULL;
	ck_assert_int_eq(epj_config_parse(ctx, "{}", NULL, NULL, &c), EPJ_OK);
	int64_t i = 99;
	double d = 99;
	bool b = true;
	const char *s = "unchanged";
	ck_assert_int_eq(epj_config_int(ctx, c, "sed", &i), EPJ_ERR_INVALID);
	ck_assert_str_eq(epj_ctx_error(ctx),
			 "epj_config_int: \"sed\" is not a key of the training "
			 "config (doc/config.md) (did you mean \"seed\"?)");
	ck_assert_int_eq(i, 99);
	ck_assert_int_eq(epj_config_int(ctx, c, "bf16.enable", &i),
			 EPJ_ERR_INVALID);
	ck_assert(
	    strstr(epj_ctx_error(ctx), "(did you mean \"bf16.enabled\"?)"));
	ck_assert_int_eq(epj_config_int(ctx, c, "seed.x", &i), EPJ_ERR_INVALID);
	ck_assert(strstr(epj_ctx_error(ctx), "\"seed.x\" is not a key"));
	ck_assert_int_eq(epj_config_bool(ctx, c, "seed", &b), EPJ_ERR_INVALID);
	ck_assert_str_eq(epj_ctx_error(ctx),
			 "epj_config_bool: \"seed\" is an integer, not what "
			 "epj_config_bool reads");
	ck_assert(b);
	ck_assert_int_eq(epj_config_int(ctx, c, "device", &i), EPJ_ERR_INVALID);
	ck_assert(strstr(epj_ctx_error(ctx), "\"device\" is a string"));
	ck_assert_int_eq(epj_config_str(ctx, c, "optimizer.params.betas", &s),
			 EPJ_ERR_INVALID);
	ck_assert(strstr(epj_ctx_error(ctx), "is a pair of numbers"));
	ck_assert_str_eq(s, "unchanged");
	ck_assert_int_eq(epj_config_real(ctx, c, "bf16", &d), EPJ_ERR_INVALID);
	ck_assert(strstr(epj_ctx_error(ctx),
			 "\"bf16\" is a section (name one of its keys)"));
	ck_assert_int_eq(epj_config_bool(ctx, c, "flops_profiler.enabled", &b),
			 EPJ_ERR_INVALID);
	ck_assert(
	    strstr(epj_ctx_error(ctx),
		   "\"flops_profiler.enabled\" is accepted and not kept"));
	/* no context: the status alone */
	ck_assert_int_eq(epj_config_int(NULL, c, "sed", &i), EPJ_ERR_INVALID);
	ck_assert(d == 99);
	epj_config_free(c);
	epj_ctx_free(ctx);
}
END_TEST

/* epj_engine_new copies the config: the engine keeps its values after the
 * object is freed, and resolves the batch for its world. */
START_TEST(test_engine_new_from_config)
{
	epj_ctx *ctx = tu_ctx();
	int64_t seed = tu_randint(0, 1 << 30), mb = tu_randint(1, 8),
		gas = tu_randint(1, 4);
	char js[256];
	snprintf(js, sizeof js,
		 "{\"seed\": %" PRId64 ", \"train_micro_batch_size_per_gpu\": "
		 "%" PRId64 ", \"gradient_accumulation_steps\": %" PRId64 "}",
		 seed, mb, gas);
	epj_config *c = NULL;
	ck_assert_int_eq(epj_config_parse(ctx, js, "e.json", NULL, &c), EPJ_OK);
	epj_model_opts mo = { .seed = 1, .dtype = EPJ_DTYPE_F32 };
	epj_model *m = NULL;
	ck_assert_int_eq(epj_model_new(ctx, NULL, &mo, &m), EPJ_OK);
	epj_engine *e = NULL;
	ck_assert_msg(epj_engine_new(ctx, m, c, &e) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	epj_config_free(c);
	ck_assert_int_eq(epj_engine_seed(e), seed);
	ck_assert_int_eq(epj_engine_micro_batch_size(e), mb);
	ck_assert_int_eq(epj_engine_grad_accum_steps(e), gas);
	epj_engine_free(e);
	e = (epj_engine *)&e;
	ck_assert_int_eq(epj_engine_new(ctx, m, NULL, &e), EPJ_ERR_INVALID);
	ck_assert_ptr_null(e);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_config_suite(void)
{
	Suite *s = suite_create("config");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_config_cases);
	tcase_add_test(tc, test_defaults);
	tcase_add_test(tc, test_full_config_values);
	tcase_add_test(tc, test_null_false_true);
	tcase_add_test(tc, test_optimizer_names_and_params);
	tcase_add_test(tc, test_scheduler_values);
	tcase_add_test(tc, test_compile_checks_by_mode);
	tcase_add_test(tc, test_offload_forms);
	tcase_add_test(tc, test_resolve_batch);
	tcase_add_test(tc, test_dump_round_trip);
	tcase_add_test(tc, test_comm_timeout);
	tcase_add_test(tc, test_messages);
	tcase_add_test(tc, test_load_errors);
	tcase_add_test(tc, test_auto_every_key);
	tcase_add_test(tc, test_auto_trainer_values);
	tcase_add_test(tc, test_auto_library_values);
	tcase_add_test(tc, test_all_errors_reported);
	tcase_add_test(tc, test_moe_losses);
	tcase_add_test(tc, test_public_getters_every_key);
	tcase_add_test(tc, test_public_getters_values);
	tcase_add_test(tc, test_public_getter_errors);
	tcase_add_test(tc, test_engine_new_from_config);
	suite_add_tcase(s, tc);
	return s;
}
