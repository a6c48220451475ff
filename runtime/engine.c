/* engine.c -- the training engine: DeepSpeed-style initialize / train_step /
 * eval / save / load on one rank.
 *
 *   epj_engine_initialize(model, ds.json)
 *       parse + validate the config (unknown keys, types, ranges: config.c),
 *       refuse what this build cannot run on one rank, resolve the batch,
 *       apply bf16 (bf16 parameters, FP32 masters in the optimizer), routing
 *       options, activation checkpointing, and build the optimizer.
 *   epj_engine_train_step(ids, labels)   one micro-batch: forward, backward,
 *       accumulate; at every gradient_accumulation_steps-th micro-batch an
 *       optimizer step (clip, update masters, copy to params, lr schedule).
 *
 * Checkpoints are safetensors files: the FP32 master weights under their HF
 * names (so a training checkpoint is also a plain f32 HF checkpoint), the
 * optimizer state under "optimizer.*" and the counters of progress in the
 * metadata.  Loading a plain HF checkpoint sets the weights and keeps a fresh
 * optimizer.  Writes are atomic (safetensors.c).
 */
#include "optim_impl.h"
#include "runtime_impl.h"

#include <math.h>
#include <string.h>

#define CKPT_FORMAT "epjit-train-checkpoint-1"

/* Settings that need more than one rank or features this build does not
 * have are refused here, whatever compile mode is used later. */
static epj_status check_supported(epj_ctx *ctx, const ej_config *c,
				  const epj_model *m)
{
	const char *src = c->source;
	if (strcmp(c->expert_parallel.comm_backend, "comm") != 0)
		return ej_error(
		    ctx, EPJ_ERR_UNSUPPORTED,
		    "%s: expert_parallel.comm_backend=\"%s\" is not "
		    "available in epjit; use \"comm\"",
		    src, c->expert_parallel.comm_backend);
	if (c->zero.stage == 3)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: zero_optimization.stage=3 is not "
				"supported; use stage 0, 1 or 2",
				src);
	if (c->zero.offload_optimizer.active || c->zero.offload_param.active)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: zero_optimization.%s is not supported; "
				"remove it or set {\"device\": \"none\"}",
				src,
				c->zero.offload_optimizer.active
				    ? "offload_optimizer"
				    : "offload_param");
	if (c->sequence_parallel_size > 1 || c->pipeline_stages > 1 ||
	    c->autotp_size > 1)
		return ej_error(
		    ctx, EPJ_ERR_UNSUPPORTED,
		    "%s: %s > 1 needs more than one rank, which "
		    "this build does not run yet",
		    src,
		    c->sequence_parallel_size > 1 ? "sequence_parallel_size"
		    : c->pipeline_stages > 1	  ? "pipeline.stages"
					     : "tensor_parallel.autotp_size");
	if (c->expert_parallel.autoep_size > 1)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: expert_parallel.autoep_size=%d needs %d "
				"ranks; this run has 1",
				src, c->expert_parallel.autoep_size,
				c->expert_parallel.autoep_size);
	if (c->expert_parallel.top_k &&
	    c->expert_parallel.top_k != m->cfg.num_experts_per_tok)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: expert_parallel.top_k=%d differs from the "
				"model's num_experts_per_tok=%d",
				src, c->expert_parallel.top_k,
				m->cfg.num_experts_per_tok);
	if (c->expert_parallel.route_norm >= 0 &&
	    (c->expert_parallel.route_norm != 0) != m->cfg.norm_topk_prob)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: expert_parallel.route_norm differs from "
				"the model's norm_topk_prob",
				src);
	if (c->expert_parallel.route_scale != 1.0)
		return ej_error(
		    ctx, EPJ_ERR_UNSUPPORTED,
		    "%s: expert_parallel.route_scale other than 1.0 "
		    "is not supported",
		    src);
	return EPJ_OK;
}

static epj_status engine_setup(epj_engine *e)
{
	epj_ctx *ctx = e->ctx;
	epj_model *m = e->model;
	ej_config *c = &e->cfg;
	/* With compile.autoep_non_moe the support boundary of the feature is
	 * reported first, in its own words (DESIGN.md section 5). */
	epj_status st = ej_config_validate_autoep_compile(ctx, c);
	if (st == EPJ_OK)
		st = check_supported(ctx, c, m);
	if (st == EPJ_OK)
		st = ej_config_resolve_batch(ctx, c, 1);
	if (st != EPJ_OK)
		return st;
	if (c->expert_parallel.has_load_balance)
		epj_log_msg(EPJ_LOG_INFO,
			    "expert_parallel.load_balance_coeff: aux-loss-free "
			    "expert-bias balancing is not implemented; "
			    "routing uses the router logits only");
	for (int i = 0; i < m->n_moe; i++)
		ej_autoep_set_routing(m->moe[i],
				      c->expert_parallel.fixed_routing,
				      c->expert_parallel.async_split_plan);
	if (c->activation_checkpointing.enabled)
		epj_model_set_checkpointing(m, true);
	/* bf16: parameters become bf16 (RNE of the f32 init); FP32 masters
	 * live in the optimizer, created from the bf16 values. */
	if (c->bf16_enabled) {
		bool prev = epj_no_grad_enter(ctx);
		for (int i = 0; st == EPJ_OK && i < m->params.n; i++) {
			if (epj_tensor_dtype(m->params.params[i]) ==
			    EPJ_DTYPE_BF16)
				continue;
			epj_tensor *b =
			    epj_cast(ctx, m->params.params[i], EPJ_DTYPE_BF16);
			st =
			    b ? epj_model_set_param(ctx, m, i, b) : ctx->status;
			epj_tensor_free(b);
		}
		epj_no_grad_exit(ctx, prev);
	}
	if (st != EPJ_OK)
		return st;
	e->optim =
	    ej_optim_new(ctx, c, m->params.params,
			 (const char *const *)m->params.names, m->params.n);
	return e->optim ? EPJ_OK : (ctx->status ? ctx->status : EPJ_ERR_NOMEM);
}

static epj_status engine_new(epj_ctx *ctx, epj_model *model,
			     const ej_config *cfg, epj_engine **out)
{
	*out = NULL;
	if (!model)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"engine_initialize: model is NULL");
	epj_engine *e = calloc(1, sizeof *e);
	if (!e)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	e->ctx = ctx;
	e->model = model;
	e->cfg = *cfg;
	epj_status st = engine_setup(e);
	if (st != EPJ_OK) {
		epj_engine_free(e);
		return st;
	}
	*out = e;
	return EPJ_OK;
}

epj_status epj_engine_initialize(epj_ctx *ctx, epj_model *model,
				 const char *ds_config_path, epj_engine **out)
{
	ej_config cfg;
	epj_status st;
	*out = NULL;
	if (ds_config_path)
		st = ej_config_load(ctx, ds_config_path, &cfg);
	else
		st = ej_config_parse(ctx, "{}", "<defaults>", &cfg);
	if (st != EPJ_OK)
		return st;
	return engine_new(ctx, model, &cfg, out);
}

epj_status epj_engine_initialize_json(epj_ctx *ctx, epj_model *model,
				      const char *json, const char *source,
				      epj_engine **out)
{
	ej_config cfg;
	*out = NULL;
	epj_status st = ej_config_parse(ctx, json, source, &cfg);
	if (st != EPJ_OK)
		return st;
	return engine_new(ctx, model, &cfg, out);
}

void epj_engine_free(epj_engine *e)
{
	if (!e)
		return;
	ej_engine_compile_free(e);
	ej_optim_free(e->optim);
	free(e);
}

epj_status epj_engine_train_step(epj_engine *e, epj_tensor *input_ids,
				 epj_tensor *labels, epj_step_info *info)
{
	epj_ctx *ctx = e->ctx;
	epj_tensor *loss = NULL;
	if (info)
		memset(info, 0, sizeof *info);
	if (!labels)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"train_step: labels are required");
	epj_status st =
	    epj_model_forward(ctx, e->model, input_ids, labels, NULL, &loss);
	if (st != EPJ_OK)
		return st;
	double lv = epj_tensor_get_f64(loss, 0);
	st = epj_backward(ctx, loss, NULL);
	epj_tensor_free(loss);
	if (st == EPJ_OK)
		st = ej_optim_accumulate(e->optim);
	if (st != EPJ_OK)
		return st;
	e->micro_step++;
	e->accum_loss += lv;
	e->accum_n++;
	epj_counter_add(ctx, "train.micro_steps", 1);
	int64_t gas = e->cfg.gradient_accumulation_steps;
	bool boundary = e->micro_step % gas == 0;
	if (boundary) {
		double lr = ej_sched_lr(&e->cfg, e->step);
		double norm = 0;
		st = ej_optim_step(e->optim, lr, 1.0 / (double)gas, &norm);
		if (st != EPJ_OK)
			return st;
		e->step++;
		e->last_lr = lr;
		e->last_grad_norm = norm;
		epj_counter_add(ctx, "train.steps", 1);
	}
	if (info) {
		info->loss = lv;
		info->mean_loss = e->accum_loss / (double)e->accum_n;
		info->stepped = boundary;
		info->step = e->step;
		info->micro_step = e->micro_step;
		info->lr = e->last_lr;
		info->grad_norm = e->last_grad_norm;
	}
	if (boundary) {
		e->accum_loss = 0;
		e->accum_n = 0;
	}
	return EPJ_OK;
}

epj_status epj_engine_eval(epj_engine *e, epj_tensor *input_ids,
			   epj_tensor *labels, double *loss_out)
{
	epj_ctx *ctx = e->ctx;
	epj_tensor *loss = NULL;
	bool prev = epj_no_grad_enter(ctx);
	epj_status st =
	    epj_model_forward(ctx, e->model, input_ids, labels, NULL, &loss);
	epj_no_grad_exit(ctx, prev);
	if (st != EPJ_OK)
		return st;
	if (loss_out)
		*loss_out = loss ? epj_tensor_get_f64(loss, 0) : NAN;
	epj_tensor_free(loss);
	return EPJ_OK;
}

int64_t epj_engine_micro_batch_size(const epj_engine *e)
{
	return e->cfg.micro_batch_per_gpu;
}

int64_t epj_engine_grad_accum_steps(const epj_engine *e)
{
	return e->cfg.gradient_accumulation_steps;
}

int64_t epj_engine_steps_per_print(const epj_engine *e)
{
	return e->cfg.steps_per_print;
}

int64_t epj_engine_seed(const epj_engine *e)
{
	return e->cfg.seed;
}

int64_t epj_engine_step_count(const epj_engine *e)
{
	return e->step;
}

bool epj_engine_bf16(const epj_engine *e)
{
	return e->cfg.bf16_enabled;
}

epj_model *epj_engine_model(epj_engine *e)
{
	return e->model;
}

/* ---- checkpoints
 * ---------------------------------------------------------------- */

static epj_status add_meta_i64(epj_st_writer *w, const char *k, int64_t v)
{
	char buf[32];
	snprintf(buf, sizeof buf, "%lld", (long long)v);
	return epj_st_writer_set_metadata(w, k, buf);
}

epj_status epj_engine_save(epj_engine *e, const char *path)
{
	epj_ctx *ctx = e->ctx;
	epj_st_writer *w = NULL;
	epj_status st = epj_st_writer_new(ctx, &w);
	if (st != EPJ_OK)
		return st;
	ej_param_list *pl = &e->model->params;
	/* FP32 master values under the HF names. */
	for (int i = 0; st == EPJ_OK && i < pl->n; i++) {
		epj_tensor *p = pl->params[i];
		epj_tensor *master = ej_optim_master(e->optim, i);
		st = epj_st_writer_add(w, pl->names[i], master ? master : p);
	}
	for (int i = 0; st == EPJ_OK && i < ej_optim_state_count(e->optim);
	     i++) {
		const char *nm = ej_optim_state_name(e->optim, i);
		if (!strncmp(nm, "optimizer.master.", 17))
			continue; /* already saved under the HF name */
		st = epj_st_writer_add(w, nm,
				       ej_optim_state_tensor(e->optim, i));
	}
	if (st == EPJ_OK)
		st = epj_st_writer_set_metadata(w, "format", CKPT_FORMAT);
	if (st == EPJ_OK)
		st = add_meta_i64(w, "step", e->step);
	if (st == EPJ_OK)
		st = add_meta_i64(w, "micro_step", e->micro_step);
	if (st == EPJ_OK)
		st = add_meta_i64(w, "optimizer_steps",
				  ej_optim_step_count(e->optim));
	if (st == EPJ_OK)
		st = epj_st_writer_save(w, path);
	epj_st_writer_free(w);
	return st;
}

/* Copies entry `name` into dst (shapes were checked by check_entry;
 * epj_tensor_copy_ refuses a mismatch anyway). */
static epj_status load_into(epj_ctx *ctx, epj_st_file *f, const char *name,
			    epj_tensor *dst)
{
	epj_tensor *t = epj_st_get(ctx, f, name);
	if (!t)
		return ctx->status;
	epj_status st = epj_tensor_copy_(ctx, dst, t);
	epj_tensor_free(t);
	return st;
}

static int64_t meta_i64(const epj_st_file *f, const char *k)
{
	const char *v = epj_st_metadata(f, k);
	return v ? strtoll(v, NULL, 10) : 0;
}

/* Entry `name` of f exists with the shape of dst; else an error naming
 * the file, the kind of entry and the tensor. */
static epj_status check_entry(epj_ctx *ctx, const epj_st_file *f,
			      const char *path, const char *kind,
			      const char *name, const epj_tensor *dst,
			      const char *hint)
{
	int k = epj_st_find(f, name);
	if (k < 0)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: %s \"%s\" is missing%s", path, kind, name,
				hint);
	bool same = epj_st_ndim_at(f, k) == epj_tensor_ndim(dst);
	for (int d = 0; same && d < epj_tensor_ndim(dst); d++)
		same = epj_st_shape_at(f, k)[d] == epj_tensor_dim(dst, d);
	if (same)
		return EPJ_OK;
	char a[96], b[96];
	return ej_error(ctx, EPJ_ERR_SHAPE,
			"%s: %s \"%s\" is %s in the file, the model expects %s",
			path, kind, name,
			ej_shape_str(epj_st_ndim_at(f, k),
				     epj_st_shape_at(f, k), a, sizeof a),
			epj_tensor_describe(dst, b, sizeof b));
}

epj_status epj_engine_load(epj_engine *e, const char *path)
{
	epj_ctx *ctx = e->ctx;
	epj_st_file *f = NULL;
	epj_status st = epj_st_open(ctx, path, &f);
	if (st != EPJ_OK)
		return st;
	ej_param_list *pl = &e->model->params;
	/* Every name in the file must be known: a parameter or optimizer
	 * state.  Every parameter must be present. */
	for (int i = 0; st == EPJ_OK && i < epj_st_count(f); i++) {
		const char *nm = epj_st_name_at(f, i);
		bool known = !strncmp(nm, "optimizer.", 10);
		for (int k = 0; !known && k < pl->n; k++)
			known = !strcmp(pl->names[k], nm);
		if (!known)
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      "%s: tensor \"%s\" is not a parameter of "
				      "this model",
				      path, nm);
	}
	/* Validate every entry before the first copy: a failed load changes
	 * nothing. */
	for (int i = 0; st == EPJ_OK && i < pl->n; i++)
		st = check_entry(ctx, f, path, "parameter", pl->names[i],
				 pl->params[i], "");
	bool training = false;
	const char *fmt = st == EPJ_OK ? epj_st_metadata(f, "format") : NULL;
	if (fmt && !strcmp(fmt, CKPT_FORMAT))
		training = true;
	/* optimizer state of a training checkpoint (masters are the
	 * parameters' entries) */
	for (int i = 0;
	     st == EPJ_OK && training && i < ej_optim_state_count(e->optim);
	     i++) {
		const char *nm = ej_optim_state_name(e->optim, i);
		if (strncmp(nm, "optimizer.master.", 17) != 0)
			st = check_entry(ctx, f, path, "optimizer state", nm,
					 ej_optim_state_tensor(e->optim, i),
					 " (saved with another optimizer?)");
	}
	/* everything checked: copy */
	for (int i = 0; st == EPJ_OK && i < pl->n; i++) {
		epj_tensor *master = ej_optim_master(e->optim, i);
		st = load_into(ctx, f, pl->names[i],
			       master ? master : pl->params[i]);
	}
	for (int i = 0;
	     st == EPJ_OK && training && i < ej_optim_state_count(e->optim);
	     i++) {
		const char *nm = ej_optim_state_name(e->optim, i);
		if (!strncmp(nm, "optimizer.master.", 17))
			continue;
		st = load_into(ctx, f, nm, ej_optim_state_tensor(e->optim, i));
	}
	if (st == EPJ_OK)
		st = ej_optim_sync_params(e->optim);
	if (st == EPJ_OK) {
		if (training) {
			e->step = meta_i64(f, "step");
			e->micro_step = meta_i64(f, "micro_step");
			ej_optim_set_step_count(e->optim,
						meta_i64(f, "optimizer_steps"));
		} else {
			e->step = e->micro_step = 0;
			ej_optim_set_step_count(e->optim, 0);
		}
		e->accum_loss = 0;
		e->accum_n = 0;
	}
	epj_st_close(f);
	return st;
}

bool epj_engine_csv_monitor_dir(const epj_engine *e, char *dir, size_t n)
{
	const struct ej_csv_monitor_config *m = &e->cfg.csv_monitor;
	if (!m->enabled)
		return false;
	if (m->output_path[0])
		snprintf(dir, n, "%s/%s", m->output_path, m->job_name);
	else
		snprintf(dir, n, "%s", m->job_name);
	return true;
}
