/* engine.c -- the training engine: DeepSpeed-style initialize / train_step /
 * eval / save / load on one rank.
 *
 *   epj_engine_initialize(model, ds.json)
 *       parse + validate the config (unknown keys, types, ranges: config.c),
 *       refuse what epjit does not implement (compile options are
 *       epj_engine_compile's to check, compile.c), resolve the batch,
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
#include "router_loss_impl.h"
#include "runtime_impl.h"

#include "cuda_driver.h"
#include "kernels.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CKPT_FORMAT "epjit-train-checkpoint-1"

/* Features epjit does not implement at all are refused here, whatever
 * compile mode is used later, each with "... is not implemented in epjit"
 * (DeepSpeed's name of the feature first): a message distinct from the
 * compile contract's (compile.c), which refuses what only concerns
 * compilation and only at epj_engine_compile.  An EPJIT_DEVICE that names
 * no device is refused too (a run would otherwise silently use the cpu). */
static epj_status check_supported(epj_ctx *ctx, const ej_config *c,
				  const epj_model *m, int W)
{
	const char *src = c->source;
	const char *dev = getenv("EPJIT_DEVICE");
	if (dev && dev[0] && !epj_device_known(dev))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"EPJIT_DEVICE=\"%s\" is not a device (known: "
				"%s)",
				dev, epj_device_names());
	if (strcmp(c->expert_parallel.comm_backend, "comm") != 0)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: the DeepEP comm backend "
				"(expert_parallel.comm_backend=\"%s\") is not "
				"implemented in epjit; use \"comm\"",
				src, c->expert_parallel.comm_backend);
	if (c->zero.stage == 3)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: ZeRO Stage 3 (zero_optimization.stage=3) "
				"is not implemented in epjit; use stage 0, 1 "
				"or 2",
				src);
	if (c->zero.offload_optimizer.active || c->zero.offload_param.active)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: %s offload (zero_optimization.%s) is not "
				"implemented in epjit; remove it or set "
				"{\"device\": \"none\"}",
				src,
				c->zero.offload_optimizer.active ? "optimizer"
								 : "parameter",
				c->zero.offload_optimizer.active
				    ? "offload_optimizer"
				    : "offload_param");
	if (c->sequence_parallel_size > 1)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: sequence parallelism "
				"(sequence_parallel_size=%d) is not "
				"implemented in epjit; set it to 1",
				src, c->sequence_parallel_size);
	if (c->pipeline_stages > 1)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: pipeline parallelism (pipeline.stages=%d) "
				"is not implemented in epjit; set it to 1",
				src, c->pipeline_stages);
	if (c->autotp_size > 1)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: AutoTP (tensor_parallel.autotp_size=%d) "
				"is not implemented in epjit; set it to 1",
				src, c->autotp_size);
	const int ep = c->expert_parallel.autoep_size;
	if (ep > 1 && W % ep != 0)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%s: expert_parallel.autoep_size=%d needs a "
				"world of a multiple of %d ranks; this run has "
				"%d (launch with mpirun -np N)",
				src, ep, ep, W);
	if (ep > 1 && m->n_moe > 0 && m->cfg.num_experts % ep != 0)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: the model's num_experts=%d is not "
				"divisible by expert_parallel.autoep_size=%d",
				src, m->cfg.num_experts, ep);
	return ej_config_check_model(ctx, c, &m->cfg);
}

/* Parameter i belongs to an expert of an AutoEP layer (owner: the
 * projection Linear, under expert N, under the experts list). */
static bool is_expert_param(const epj_model *m, int i)
{
	const epj_module *o = m->params.owners[i];
	return o && o->parent && o->parent->parent &&
	       o->parent->parent->parent &&
	       !strcmp(o->parent->parent->local, "experts") &&
	       !strcmp(o->parent->parent->parent->kind, "AutoEPMoELayer");
}

/* The world a shape-only engine (epjit-warmup) stands for: it has no
 * ranks and no comm, and compiles what one rank of that world would.
 * ctx->meta_world when set; else the config's: train_batch_size /
 * (micro-batch x accumulation) when all three are given (DeepSpeed's
 * rule), else expert_parallel.autoep_size, the smallest world an
 * expert-parallel config allows.  The world changes only the derived
 * batch sizes: an AutoEP layer is a graph break whose experts are no
 * region's parameters, so a rank's share of the experts changes no
 * compiled shape.  The model is not sharded (setup_parallel: a world of
 * one). */
static int meta_world_size(const epj_ctx *ctx, const ej_config *c)
{
	if (ctx->meta_world > 0)
		return ctx->meta_world;
	int64_t per_rank =
	    c->micro_batch_per_gpu * c->gradient_accumulation_steps;
	if (c->train_batch_size_given && c->micro_batch_given && c->gas_given &&
	    per_rank > 0 && c->train_batch_size % per_rank == 0 &&
	    c->train_batch_size / per_rank <= INT32_MAX)
		return (int)(c->train_batch_size / per_rank);
	return c->expert_parallel.autoep_size > 1
		   ? c->expert_parallel.autoep_size
		   : 1;
}

/* More than one rank: the parallel groups (kept by the model, whose AutoEP
 * layers use the expert-parallel group) and, with autoep_size > 1, the
 * experts sharded over the EP group (the model's parameter list then holds
 * this rank's experts).  A model is sharded once; a later engine must ask
 * for the same expert-parallel size. */
static epj_status setup_parallel(epj_ctx *ctx, const ej_config *c, epj_model *m,
				 ej_comm *world)
{
	const int ep = c->expert_parallel.autoep_size;
	if (m->has_groups) {
		if (m->groups.ep->size != ep)
			return ej_error(
			    ctx, EPJ_ERR_STATE,
			    "%s: expert_parallel.autoep_size=%d, but this "
			    "model was sharded for autoep_size=%d by an "
			    "earlier engine; build a new model",
			    c->source, ep, m->groups.ep->size);
		return EPJ_OK;
	}
	if (world->size == 1)
		return EPJ_OK;
	epj_status st = ej_groups_new(ctx, world, ep, &m->groups);
	if (st != EPJ_OK)
		return st;
	m->has_groups = true;
	if (ep == 1)
		return EPJ_OK;
	for (int i = 0; st == EPJ_OK && i < m->n_moe; i++)
		st = ej_autoep_shard(ctx, m->moe[i], m->groups.ep);
	if (st != EPJ_OK)
		return st;
	ej_param_list_free(&m->params);
	return ej_module_params(ctx, m->root, &m->params);
}

/* Several ranks on a context with device memory (cuda): every collective
 * on device buffers goes over NCCL -- e->dev_comm (world = DP group) and
 * its counterparts of the EP and EDP groups, each an `nccl` comm
 * bootstrapped over the host group (its own unique id; any NCCL >= 2.7,
 * no ncclCommSplit needed).  Host scalars (the split plan's counts, the
 * loss, the grad-norm partial sums) stay on the host comms.  Without a
 * device comm such a run is refused here, not at its first exchange. */
static epj_status setup_dev_groups(epj_engine *e, ej_comm *world)
{
	epj_ctx *ctx = e->ctx;
	epj_model *m = e->model;
	if (ctx->dev->host_visible || world->size == 1)
		return EPJ_OK;
	if (!e->dev_comm) {
		const char *env = getenv("EPJIT_COMM");
		const char *choice = env && *env ? env
				     : *e->cfg.comm_backend
					 ? e->cfg.comm_backend
					 : "auto";
		char why[512] = "";
		if (strcmp(choice, "host") != 0 && !ej_nccl_available(ctx)) {
			snprintf(why, sizeof why, ": %s", epj_ctx_error(ctx));
			epj_ctx_clear_error(ctx);
		}
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"%d ranks on the %s device: gradients and "
				"expert rows are device memory and need NCCL "
				"(comm.backend \"%s\"%s%s)",
				world->size, ctx->dev->name, choice,
				env && *env ? ", from EPJIT_COMM" : "", why);
	}
	EJ_ASSERT(m->has_groups);
	ej_cuda_dev *dev = NULL;
	epj_status st = ej_cuda_open(ctx, &dev);
	if (st == EPJ_OK && m->groups.ep->size > 1)
		st = ej_comm_nccl_new(ctx, m->groups.ep, dev, &e->dev_ep);
	if (st == EPJ_OK && m->groups.edp->size > 1)
		st = ej_comm_nccl_new(ctx, m->groups.edp, dev, &e->dev_edp);
	if (st != EPJ_OK) {
		ej_error_prefix(ctx, "the device counterparts of the %s group",
				e->dev_ep ? "edp" : "ep");
		return st;
	}
	for (int i = 0; i < m->n_moe; i++)
		ej_autoep_set_dev_comm(m->moe[i], e->dev_ep);
	return EPJ_OK;
}

static epj_status engine_setup(epj_engine *e)
{
	epj_ctx *ctx = e->ctx;
	epj_model *m = e->model;
	ej_config *c = &e->cfg;
	/* Only what epjit cannot run at all: the compile options
	 * (compile.autoep_non_moe's contract included) are epj_engine_compile's
	 * to check, so a config with them trains eagerly. */
	ej_comm *world = ej_comm_world();
	const int W = ctx->meta ? meta_world_size(ctx, c) : world->size;
	epj_status st = check_supported(ctx, c, m, W);
	/* Megatron's router losses (moe.*), refused with transformers' */
	if (st == EPJ_OK &&
	    (st = ej_rloss_configure(ctx, m->rloss, &c->moe, world)) != EPJ_OK)
		ej_error_prefix(ctx, "%s", c->source);
	ej_comm_set_timeout(world, c->comm_timeout_s);
	if (st == EPJ_OK)
		st = ej_config_resolve_batch(ctx, c, W);
	if (st == EPJ_OK)
		st = setup_parallel(ctx, c, m, world);
	if (st == EPJ_OK)
		st = ej_comm_device_select(ctx, c->comm_backend, ctx->dev->name,
					   world, &e->dev_comm);
	if (st == EPJ_OK)
		st = setup_dev_groups(e, world);
	if (st != EPJ_OK)
		return st;
	if (c->expert_parallel.has_load_balance &&
	    c->expert_parallel.load_balance_coeff > 0 && !m->cfg.score_bias)
		epj_log_msg(EPJ_LOG_INFO,
			    "expert_parallel.load_balance_coeff: this model "
			    "has no expert score bias (DeepSeek-V3's "
			    "e_score_correction_bias); routing uses the "
			    "router logits only");
	for (int i = 0; i < m->n_moe; i++)
		ej_autoep_set_routing(m->moe[i],
				      c->expert_parallel.fixed_routing,
				      c->expert_parallel.async_split_plan);
	if (c->activation_checkpointing.enabled)
		epj_model_set_checkpointing(m, true);
	if ((st = ej_engine_batch_init(e)) != EPJ_OK)
		return st;
	/* bf16: parameters become bf16 (RNE of the f32 init); FP32 masters
	 * live in the optimizer, created from the bf16 values. */
	if (c->bf16_enabled) {
		bool prev = epj_no_grad_enter(ctx);
		for (int i = 0; st == EPJ_OK && i < m->params.n; i++) {
			/* buffers (untrained state, such as DeepSeek-V3's
			 * e_score_correction_bias) stay f32, as transformers
			 * keeps them */
			if (epj_tensor_dtype(m->params.params[i]) ==
				EPJ_DTYPE_BF16 ||
			    !epj_tensor_requires_grad(m->params.params[i]))
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
	ej_optim_dist d = { 0 };
	bool *expert = NULL;
	if (world->size > 1) {
		expert = calloc((size_t)m->params.n + 1, sizeof *expert);
		if (!expert)
			return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
		for (int i = 0; i < m->params.n; i++)
			expert[i] = is_expert_param(m, i);
		d = (ej_optim_dist){ .zero_stage = c->zero.stage,
				     .dp = m->groups.dp,
				     .edp = m->groups.edp,
				     .world = world,
				     .grad_scale = 1.0 / world->size,
				     .expert = expert,
				     .dev_dp = e->dev_comm,
				     .dev_edp = e->dev_edp };
	}
	e->optim = ej_optim_new_dist(ctx, c, m->params.params,
				     (const char *const *)m->params.names,
				     m->params.n, world->size > 1 ? &d : NULL);
	free(expert);
	return e->optim ? EPJ_OK : (ctx->status ? ctx->status : EPJ_ERR_NOMEM);
}

static epj_status engine_new(epj_ctx *ctx, epj_model *model,
			     const ej_config *cfg, epj_engine **out)
{
	/* eager ops of a cuda-sim context run as CUDA kernels (installed at
	 * library load too; this keeps statically linked programs honest) */
	ej_eager_cuda_install();
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

epj_status epj_engine_new(epj_ctx *ctx, epj_model *model, const epj_config *cfg,
			  epj_engine **out)
{
	EJ_ASSERT(out);
	*out = NULL;
	if (!cfg)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"engine_new: config is NULL");
	return engine_new(ctx, model, &cfg->cfg, out);
}

/* epj_engine_new on a config made by load(ctx, ...) (freed after). */
static epj_status engine_from(epj_ctx *ctx, epj_model *model, epj_status st,
			      epj_config *cfg, epj_engine **out)
{
	*out = NULL;
	if (st == EPJ_OK)
		st = epj_engine_new(ctx, model, cfg, out);
	epj_config_free(cfg);
	return st;
}

epj_status epj_engine_initialize(epj_ctx *ctx, epj_model *model,
				 const char *ds_config_path, epj_engine **out)
{
	epj_config *cfg = NULL;
	epj_status st = epj_config_load(ctx, ds_config_path, NULL, &cfg);
	return engine_from(ctx, model, st, cfg, out);
}

epj_status epj_engine_initialize_auto(epj_ctx *ctx, epj_model *model,
				      const char *ds_config_path,
				      const char *auto_json, epj_engine **out)
{
	epj_config *cfg = NULL;
	epj_status st = epj_config_load(ctx, ds_config_path, auto_json, &cfg);
	return engine_from(ctx, model, st, cfg, out);
}

epj_status epj_engine_initialize_json(epj_ctx *ctx, epj_model *model,
				      const char *json, const char *source,
				      epj_engine **out)
{
	epj_config *cfg = NULL;
	epj_status st = json ? epj_config_parse(ctx, json, source, NULL, &cfg)
			     : ej_error(ctx, EPJ_ERR_INVALID,
					"engine_initialize_json: json is NULL");
	return engine_from(ctx, model, st, cfg, out);
}

void epj_engine_free(epj_engine *e)
{
	if (!e)
		return;
	ej_save_bg_free(e->bg); /* waits for its writer */
	ej_engine_compile_free(e);
	ej_optim_free(e->optim);
	free(e->loads);
	free(e->step_loads);
	if (e->dev_ep)
		for (int i = 0; i < e->model->n_moe; i++)
			ej_autoep_set_dev_comm(e->model->moe[i], NULL);
	ej_comm_free(e->dev_ep);
	ej_comm_free(e->dev_edp);
	ej_comm_free(e->dev_comm);
	free(e);
}

/* Aux-loss-free balancing after an optimizer step (DeepSeek-V3's rule,
 * expert_parallel.load_balance_coeff when given): every layer with a score
 * bias moves it by the coefficient against its experts' loads over the
 * step, summed over the world; a skipped step only restarts the loads. */
static epj_status balance_experts(epj_engine *e, bool skipped)
{
	const ej_config *c = &e->cfg;
	epj_model *m = e->model;
	if (!c->expert_parallel.has_load_balance ||
	    !(c->expert_parallel.load_balance_coeff > 0))
		return EPJ_OK;
	ej_comm *world = m->has_groups ? m->groups.world : NULL;
	double rate = skipped ? 0 : c->expert_parallel.load_balance_coeff;
	for (int i = 0; i < m->n_moe; i++) {
		epj_status st =
		    ej_autoep_balance(e->ctx, m->moe[i], world, rate);
		if (st != EPJ_OK)
			return st;
	}
	/* the biases are buffers (no gradient): their masters (ZeRO shards)
	 * follow them, so the next all-gather and a save keep the move */
	for (int i = 0; rate > 0 && i < m->params.n; i++) {
		if (epj_tensor_requires_grad(m->params.params[i]))
			continue;
		epj_status st = ej_optim_master_from_param(e->optim, i);
		if (st != EPJ_OK)
			return st;
	}
	return EPJ_OK;
}

static int moe_layer_index(const epj_model *m, int i);

/* The expert-load metrics, while on.  Around the forward of every
 * micro-batch: the layers' counts restart before it and are added to the
 * step's (e->step_loads) after it, so that only training forwards count
 * (a checkpointed one runs without grad; an evaluation between
 * micro-batches does not count).  first: the step's first micro-batch. */
static epj_status expert_load_forward(epj_engine *e, bool before, bool first)
{
	epj_model *m = e->model;
	if (!e->track_load)
		return EPJ_OK;
	if (!e->step_loads) {
		int64_t n = 0;
		for (int i = 0; i < m->n_moe; i++)
			n += ej_autoep_step_load_add(m->moe[i], NULL);
		e->step_loads =
		    calloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
		e->loads = calloc((size_t)(m->n_moe > 0 ? m->n_moe : 1),
				  sizeof *e->loads);
		if (!e->step_loads || !e->loads) {
			free(e->step_loads);
			free(e->loads);
			e->step_loads = NULL;
			e->loads = NULL;
			return ej_error(e->ctx, EPJ_ERR_NOMEM,
					"expert load metrics: out of host "
					"memory");
		}
	}
	int64_t at = 0;
	for (int i = 0; i < m->n_moe; i++) {
		const int E = ej_autoep_step_load_add(m->moe[i], NULL);
		if (!before)
			ej_autoep_step_load_add(m->moe[i], e->step_loads + at);
		else if (first)
			memset(e->step_loads + at, 0,
			       sizeof *e->step_loads * (size_t)E);
		if (before)
			ej_autoep_step_load_reset(m->moe[i]);
		at += E;
	}
	return EPJ_OK;
}

/* The figures of the step just taken: the step's loads summed over the
 * world in one all-reduce, then each layer's (e->loads). */
static epj_status expert_load_step(epj_engine *e)
{
	epj_model *m = e->model;
	if (!e->track_load || !e->step_loads)
		return EPJ_OK;
	ej_comm *world = m->has_groups ? m->groups.world : NULL;
	int64_t n = 0;
	for (int i = 0; i < m->n_moe; i++)
		n += ej_autoep_step_load_add(m->moe[i], NULL);
	epj_status st = ej_expert_load_reduce(e->ctx, world, e->step_loads, n);
	int64_t at = 0;
	for (int i = 0; st == EPJ_OK && i < m->n_moe; i++) {
		const int E = ej_autoep_step_load_add(m->moe[i], NULL);
		epj_expert_load *x = &e->loads[i];
		ej_expert_load_summary(e->step_loads + at, E, x);
		x->layer = moe_layer_index(m, i);
		at += E;
	}
	e->loads_valid = st == EPJ_OK;
	return st;
}

static epj_status train_step(epj_engine *e, epj_tensor *input_ids,
			     epj_tensor *labels, epj_step_info *info)
{
	epj_ctx *ctx = e->ctx;
	epj_tensor *loss = NULL;
	ej_prof pf;
	if (info)
		memset(info, 0, sizeof *info);
	if (!labels)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"train_step: labels are required");
	epj_tensor *logits = NULL;
	epj_status st = expert_load_forward(e, true, e->accum_n == 0);
	if (st != EPJ_OK)
		return st;
	int64_t ntok = 0;
	ej_prof_begin(ctx, &pf);
	st = ej_engine_forward(e, input_ids, labels, e->probe ? &logits : NULL,
			       &loss, &ntok);
	if (st == EPJ_OK)
		st = expert_load_forward(e, false, false);
	/* per-token: the backward of the micro-batch's sum of token losses
	 * (runtime/batch.c); none counted, no gradient (the router losses'
	 * too: ej_rloss_add_to_loss) */
	epj_tensor *bl = NULL;
	if (st == EPJ_OK) {
		bl = e->batch.per_token_loss
			 ? epj_mul_scalar(ctx, loss, (double)ntok)
			 : epj_tensor_ref(loss);
		if (!bl)
			st = ctx->status;
	}
	ej_prof_end(ctx, &pf, "forward");
	if (st != EPJ_OK) {
		epj_tensor_free(logits);
		epj_tensor_free(loss);
		return st;
	}
	double lv = epj_tensor_get_f64(loss, 0);
	ej_prof_begin(ctx, &pf);
	st = epj_backward(ctx, bl, NULL);
	ej_prof_end(ctx, &pf, "backward");
	epj_tensor_free(bl);
	epj_tensor_free(loss);
	if (st == EPJ_OK && e->probe)
		st = e->probe->on_backward(e->probe->self, e, logits, lv);
	epj_tensor_free(logits);
	ej_prof_begin(ctx, &pf);
	if (st == EPJ_OK)
		st = ej_optim_accumulate(e->optim);
	ej_prof_end(ctx, &pf, "optimizer.accumulate");
	if (st != EPJ_OK)
		return st;
	ej_rloss_accumulate(e->model->rloss);
	e->micro_step++;
	e->accum_loss += e->batch.per_token_loss ? (ntok ? lv * ntok : 0) : lv;
	e->accum_n++;
	e->accum_tokens += ntok;
	epj_counter_add(ctx, "train.micro_steps", 1);
	int64_t gas = e->cfg.gradient_accumulation_steps;
	bool boundary = e->micro_step % gas == 0;
	bool skipped = false;
	double mean = e->accum_loss / (double)e->accum_n;
	if (boundary) {
		double lr = ej_sched_lr(&e->cfg, e->step);
		double norm = 0, gscale = 1.0 / (double)gas;
		/* per-token: the global batch's sum over its tokens */
		if (e->batch.per_token_loss &&
		    (st = ej_engine_token_mean(e, &mean, &gscale)) != EPJ_OK)
			return st;
		/* A non-finite loss or gradient norm never reaches the
		 * weights: the step fails, or is skipped when asked for. */
		ej_prof_begin(ctx, &pf);
		if (!isfinite(mean)) {
			st = ej_optim_drop_grads(e->optim);
			norm = NAN;
		} else {
			st = ej_optim_step(e->optim, lr, gscale, &norm);
		}
		if (st != EPJ_OK)
			return st;
		ej_prof_end(ctx, &pf, "optimizer.step");
		if (!isfinite(mean) || !isfinite(norm)) {
			if (!e->cfg.skip_nonfinite_steps) {
				e->accum_loss = 0;
				e->accum_n = 0;
				e->accum_tokens = 0;
				return ej_error(
				    ctx, EPJ_ERR_STATE,
				    "train step %" PRId64 ": %s is %g (lr %g); "
				    "stopped before the update (lower the "
				    "learning rate, or set "
				    "\"skip_nonfinite_steps\": true to skip "
				    "such steps)",
				    e->step + 1,
				    !isfinite(mean) ? "the mean loss"
						    : "the gradient norm",
				    !isfinite(mean) ? mean : norm, lr);
			}
			skipped = true;
			epj_counter_add(ctx, "train.skipped_steps", 1);
			epj_log_msg(EPJ_LOG_WARN,
				    "train step %" PRId64 ": %s is %g; step "
				    "skipped (skip_nonfinite_steps)",
				    e->step + 1,
				    !isfinite(mean) ? "the mean loss"
						    : "the gradient norm",
				    !isfinite(mean) ? mean : norm);
		}
		e->step++;
		e->last_lr = lr;
		e->last_grad_norm = norm;
		epj_counter_add(ctx, "train.steps", 1);
		if ((st = balance_experts(e, skipped)) != EPJ_OK)
			return st;
		if ((st = expert_load_step(e)) != EPJ_OK)
			return st;
	}
	if (e->batch.per_token_loss && !boundary)
		mean = e->accum_tokens ? e->accum_loss / (double)e->accum_tokens
				       : NAN;
	ej_comm *world = e->model->has_groups ? e->model->groups.world : NULL;
	if (boundary && world && world->size > 1 && !e->batch.per_token_loss) {
		/* the mean over the global batch (equal micro-batches) */
		float hl[2] = { (float)mean, 0 };
		hl[1] = (float)(mean - (double)hl[0]);
		st = ej_comm_allreduce(ctx, world, "train.loss", hl, 2);
		if (st != EPJ_OK)
			return st;
		mean = ((double)hl[0] + (double)hl[1]) / world->size;
	}
	if (boundary &&
	    (st = ej_rloss_step_end(ctx, e->model->rloss, world)) != EPJ_OK)
		return st;
	if (info) {
		info->loss = lv; /* the micro-batch's mean */
		info->mean_loss = mean;
		info->stepped = boundary;
		info->step = e->step;
		info->micro_step = e->micro_step;
		info->lr = e->last_lr;
		info->grad_norm = e->last_grad_norm;
		info->skipped = skipped;
	}
	if (boundary) {
		e->accum_loss = 0;
		e->accum_n = 0;
		e->accum_tokens = 0;
	}
	return EPJ_OK;
}

epj_status epj_engine_train_step(epj_engine *e, epj_tensor *input_ids,
				 epj_tensor *labels, epj_step_info *info)
{
	ej_prof pf;
	ej_prof_begin(e->ctx, &pf);
	epj_status st = train_step(e, input_ids, labels, info);
	ej_prof_end(e->ctx, &pf, "step");
	return st;
}

epj_status epj_engine_eval_tokens(epj_engine *e, epj_tensor *input_ids,
				  epj_tensor *labels, double *loss_out,
				  int64_t *tokens)
{
	epj_ctx *ctx = e->ctx;
	epj_tensor *loss = NULL;
	int64_t n = 0;
	bool prev = epj_no_grad_enter(ctx);
	epj_status st =
	    ej_engine_forward(e, input_ids, labels, NULL, &loss, &n);
	epj_no_grad_exit(ctx, prev);
	if (tokens)
		*tokens = n;
	if (st != EPJ_OK)
		return st;
	if (loss_out)
		*loss_out = loss ? epj_tensor_get_f64(loss, 0) : NAN;
	epj_tensor_free(loss);
	return EPJ_OK;
}

bool epj_engine_router_loss(const epj_engine *e, int i, const char **name,
			    double *value)
{
	return e && ej_rloss_metric(e->model->rloss, i, name, value);
}

epj_status epj_engine_eval(epj_engine *e, epj_tensor *input_ids,
			   epj_tensor *labels, double *loss_out)
{
	return epj_engine_eval_tokens(e, input_ids, labels, loss_out, NULL);
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

const char *epj_engine_device(const epj_engine *e)
{
	return e->cfg.device;
}

int64_t epj_engine_step_count(const epj_engine *e)
{
	return e->step;
}

int64_t epj_engine_micro_step_count(const epj_engine *e)
{
	return e->micro_step;
}

bool epj_engine_bf16(const epj_engine *e)
{
	return e->cfg.bf16_enabled;
}

int epj_engine_zero_stage(const epj_engine *e)
{
	return e->cfg.zero.stage;
}

/* autoep_size whatever expert_parallel.enabled says: "enabled" is parsed
 * only (every MoE layer is an AutoEP layer), and setup_parallel shards the
 * experts by autoep_size alone. */
int epj_engine_ep_size(const epj_engine *e)
{
	return e->cfg.expert_parallel.autoep_size;
}

/* Value of dotted key path in the JSON object o, NULL when absent. */
static json_t *json_at(json_t *o, const char *path)
{
	char buf[300];
	snprintf(buf, sizeof buf, "%s", path);
	char *save = NULL;
	for (char *t = strtok_r(buf, ".", &save); t && o;
	     t = strtok_r(NULL, ".", &save))
		o = json_is_object(o) ? json_object_get(o, t) : NULL;
	return o;
}

bool epj_engine_auto_value(const epj_engine *e, int i, char *key, size_t kn,
			   char *val, size_t vn)
{
	const char *p = e->cfg.auto_keys;
	for (; i > 0 && *p; i--)
		p = strchr(p, '\n') + 1;
	if (i < 0 || !*p)
		return false;
	int len = (int)(strchr(p, '\n') - p);
	snprintf(key, kn, "%.*s", len, p);
	snprintf(val, vn, "?");
	if (!strcmp(key, "expert_parallel.top_k") &&
	    e->cfg.expert_parallel.top_k == 0) {
		snprintf(val, vn, "%d", e->model->cfg.num_experts_per_tok);
		return true;
	}
	char *text = ej_config_to_json(&e->cfg);
	json_t *root = text ? json_loads(text, 0, NULL) : NULL;
	json_t *v = root ? json_at(root, key) : NULL;
	char *dump = v ? json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT |
					   JSON_REAL_PRECISION(15))
		       : NULL;
	if (dump)
		snprintf(val, vn, "%s", dump);
	free(dump);
	json_decref(root);
	free(text);
	return true;
}

epj_model *epj_engine_model(epj_engine *e)
{
	return e->model;
}

void epj_engine_track_expert_load(epj_engine *e, bool on)
{
	e->track_load = on;
}

int epj_engine_num_moe_layers(const epj_engine *e)
{
	return e->model->n_moe;
}

/* MoE layer i's decoder layer: N of "model.layers.N.mlp", or i (the root
 * layout). */
static int moe_layer_index(const epj_model *m, int i)
{
	const char *l = strstr(m->moe[i]->name, "layers.");
	return l ? atoi(l + strlen("layers.")) : i;
}

bool epj_engine_expert_load(const epj_engine *e, int i, epj_expert_load *out)
{
	const epj_model *m = e->model;
	if (i < 0 || i >= m->n_moe)
		return false;
	if (e->loads_valid) {
		*out = e->loads[i];
		return true;
	}
	memset(out, 0, sizeof *out);
	out->layer = moe_layer_index(m, i);
	out->num_experts = ej_autoep_step_load_add(m->moe[i], NULL);
	out->max_over_mean = out->cv = NAN;
	return false;
}

/* ---- checkpoints
 * ---------------------------------------------------------------- */

ej_comm *ej_engine_world(const epj_engine *e)
{
	return e->model->has_groups && e->model->groups.world->size > 1
		   ? e->model->groups.world
		   : NULL;
}

/* The world of a multi-rank engine, NULL for a world of one. */
static ej_comm *multi_world(const epj_engine *e)
{
	return ej_engine_world(e);
}

/* The file of `rank` of a multi-rank checkpoint PATH: PATH.rank<R>. */
static void rank_file(char *buf, size_t n, const char *path, int rank)
{
	snprintf(buf, n, "%s.rank%d", path, rank);
}

/* Whether p names something (stat, never open: opening a FIFO would block;
 * what it is, the loader checks). */
static bool file_exists(const char *p)
{
	struct stat sb;
	return stat(p, &sb) == 0;
}

/* Every rank learns whether all ranks succeeded (st is this rank's); a
 * failure elsewhere becomes an error here naming the failing ranks' count. */
static epj_status agree(epj_ctx *ctx, ej_comm *world, epj_status st,
			const char *what)
{
	float f = st == EPJ_OK ? 0.0f : 1.0f;
	epj_status cs = ej_comm_allreduce(ctx, world, what, &f, 1);
	if (st != EPJ_OK)
		return st;
	if (cs != EPJ_OK)
		return cs;
	if (f > 0)
		return ej_error(ctx, EPJ_ERR_IO,
				"%s failed on %g other rank%s (see their "
				"messages)",
				what, f, f == 1 ? "" : "s");
	return EPJ_OK;
}

static epj_status engine_save_file(epj_engine *e, const char *path,
				   int64_t generation);

/* The commit record at path as world's rank 0 reads it, shared with every
 * rank (a record need not be on a filesystem the other ranks see): *have
 * false when path is no record.  Collective: every rank calls it. */
static epj_status share_record(epj_ctx *ctx, ej_comm *world, const char *path,
			       ej_ckpt_set *set, bool *have)
{
	*have = false;
	memset(set, 0, sizeof *set);
	char *text = NULL;
	size_t len = 0;
	/* n: the record's length, or -1: no record, -2: a read error, -3:
	 * over EJ_CKPT_SET_MAX_BYTES */
	int64_t n = -1;
	if (world->rank == 0) {
		int rc = ej_ckpt_set_read(path, &text, &len);
		n = rc == 1 ? (int64_t)len : rc == 0 ? -1 : rc - 1;
	}
	epj_status st =
	    ej_comm_bcast(ctx, world, "checkpoint set", &n, sizeof n, 0);
	if (st == EPJ_OK && n >= 0 && world->rank != 0 &&
	    !(text = malloc((size_t)n + 1)))
		st = ej_error(ctx, EPJ_ERR_NOMEM,
			      "checkpoint set '%s': out "
			      "of memory",
			      path);
	/* every rank joins the second broadcast once the first said so */
	char dummy = 0;
	if (n >= 0) {
		epj_status bs = ej_comm_bcast(ctx, world, "checkpoint set",
					      text ? text : &dummy,
					      text ? (size_t)n : 0, 0);
		if (st == EPJ_OK)
			st = bs;
	}
	if (st == EPJ_OK && n < -1)
		st = ej_ckpt_set_read_error(ctx, path, (int)n + 1);
	if (st == EPJ_OK && n >= 0) {
		st = ej_ckpt_set_parse(ctx, path, text, (size_t)n, set);
		*have = st == EPJ_OK;
	}
	free(text);
	return st;
}

/* The file of `rank` of generation g of set PATH: PATH.g<G>.rank<R>. */
static void gen_file(char *buf, size_t n, const char *path, int64_t g, int rank)
{
	snprintf(buf, n, "%s.g%" PRId64 ".rank%d", path, g, rank);
}

/* Test hook: EPJIT_TEST_SAVE_KILL_RANK=R kills rank R of a multi-rank save
 * after it wrote its file, before the commit (a preemption mid-save). */
static void save_fault(int rank)
{
	const char *v = getenv("EPJIT_TEST_SAVE_KILL_RANK");
	if (v && *v && atoi(v) == rank)
		raise(SIGKILL);
}

/* Test hook: EPJIT_TEST_SAVE_COMMIT_FAULT=R makes rank R of a multi-rank
 * save take the commit's agreement as failed after joining it (a link that
 * breaks just then): the rank cannot tell whether the record was
 * committed. */
static bool commit_fault(int rank)
{
	const char *v = getenv("EPJIT_TEST_SAVE_COMMIT_FAULT");
	return v && *v && atoi(v) == rank;
}

void (*ej_save_phase_hook)(const char *phase, int rank, int64_t step);

void ej_save_hold(const char *phase, int rank, int64_t step)
{
	if (ej_save_phase_hook)
		ej_save_phase_hook(phase, rank, step);
	const char *v = getenv("EPJIT_TEST_SAVE_HOLD");
	if (!v || !*v)
		return;
	size_t n = strcspn(v, ":");
	long long r = -1, s = -1;
	if (v[n] == ':') {
		char *end;
		if (v[n + 1] != ':' && v[n + 1])
			r = strtoll(v + n + 1, &end, 10);
		const char *c = strchr(v + n + 1, ':');
		if (c && c[1])
			s = strtoll(c + 1, &end, 10);
	}
	if (n != strlen(phase) || strncmp(v, phase, n) != 0 ||
	    (r >= 0 && r != rank) || (s >= 0 && s != step))
		return;
	fprintf(stderr,
		"epjit: EPJIT_TEST_SAVE_HOLD: rank %d holds the save of step "
		"%" PRId64 " at '%s' (pid %ld) until it is killed\n",
		rank, step, phase, (long)getpid());
	fflush(stderr);
	for (;;)
		pause();
}

void ej_save_plan_free(ej_save_plan *pl)
{
	ej_ckpt_set_free(&pl->prev);
	ej_ckpt_set_free(&pl->drop);
	pl->have_prev = pl->have_drop = false;
}

/* The record of generation d that its copy holds (path's copy name),
 * shared from rank 0 when it is one of this set's: generation d, the
 * world's size.  Anything else there is not this set's to remove. */
static void share_drop(epj_ctx *ctx, ej_comm *world, ej_save_plan *pl,
		       int64_t d)
{
	char cp[4300];
	if (!ej_ckpt_set_copy_path(pl->path, d, cp, sizeof cp))
		return;
	epj_status st = share_record(ctx, world, cp, &pl->drop, &pl->have_drop);
	if (st != EPJ_OK)
		epj_ctx_clear_error(ctx); /* not a record: not ours */
	if (pl->have_drop &&
	    (pl->drop.generation != d || pl->drop.world != world->size)) {
		ej_ckpt_set_free(&pl->drop);
		pl->have_drop = false;
	}
}

epj_status ej_save_prepare(epj_engine *e, const char *path, ej_save_plan *pl)
{
	epj_ctx *ctx = e->ctx;
	ej_comm *world = multi_world(e);
	memset(pl, 0, sizeof *pl);
	pl->keep = e->save_keep > 1 ? e->save_keep : 1;
	pl->counts = (ej_save_counts){ e->step, e->micro_step,
				       ej_optim_step_count(e->optim) };
	if (snprintf(pl->path, sizeof pl->path, "%s", path) >=
	    (int)sizeof pl->path)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"checkpoint '%.64s...': the path is too long",
				path);
	ej_sweep_tmp(path);
	if (!world) {
		pl->world = 1;
		snprintf(pl->file, sizeof pl->file, "%s", path);
		return EPJ_OK;
	}
	pl->rank = world->rank;
	pl->world = world->size;
	epj_status st =
	    share_record(ctx, world, path, &pl->prev, &pl->have_prev);
	if (st != EPJ_OK) {
		/* a corrupt record there is replaced by this save (the files
		 * it names are left alone) */
		epj_log_msg(EPJ_LOG_WARN, "%s (replaced by this save)",
			    epj_ctx_error(ctx));
		epj_ctx_clear_error(ctx);
	}
	/* the same record on every rank: all return here, or none */
	if (pl->have_prev && pl->prev.generation >= EJ_CKPT_GEN_MAX) {
		st = ej_error(ctx, EPJ_ERR_UNSUPPORTED,
			      "checkpoint set '%s': its record is at "
			      "generation %" PRId64 ", the last one a record "
			      "can hold: nothing saved (save to another path)",
			      path, pl->prev.generation);
		ej_save_plan_free(pl);
		return st;
	}
	pl->gen = pl->have_prev ? pl->prev.generation + 1 : 1;
	gen_file(pl->file, sizeof pl->file, path, pl->gen, world->rank);
	/* the generation the commit drops, when its record is not prev */
	int64_t d = pl->gen - pl->keep;
	if (pl->keep > 1 && d >= 1)
		share_drop(ctx, world, pl, d);
	return EPJ_OK;
}

/* Rank 0: writes the record of generation g as its copy beside path when
 * there is none of that generation (a set saved with --keep 1 before). */
static epj_status write_copy(epj_ctx *ctx, const char *path,
			     const ej_ckpt_set *s, bool only_if_absent)
{
	char cp[4300];
	if (!ej_ckpt_set_copy_path(path, s->generation, cp, sizeof cp))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"checkpoint '%s': the name of the record of "
				"generation %" PRId64 " is too long",
				path, s->generation);
	if (only_if_absent && file_exists(cp))
		return EPJ_OK;
	return ej_ckpt_set_write(ctx, cp, s);
}

/* Rank 0's part of the commit: the record of generation pl->gen naming
 * every rank's file (rows: sizes and checksums), written atomically; with
 * several generations kept, first as its copy beside path (and the
 * previous generation's copy when it has none).  An error means path was
 * not replaced. */
static epj_status save_record(epj_engine *e, const ej_save_plan *pl,
			      const ej_save_row *rows)
{
	epj_ctx *ctx = e->ctx;
	const char *path = pl->path;
	int world = pl->world;
	ej_ckpt_set s = {
		.generation = pl->gen,
		.world = world,
		.zero_stage = e->cfg.zero.stage,
		.autoep_size = e->cfg.expert_parallel.autoep_size,
		.step = pl->counts.step,
		.micro_step = pl->counts.micro_step,
		.optimizer_steps = pl->counts.optimizer_steps,
	};
	s.files = calloc((size_t)world, sizeof *s.files);
	epj_status cs = s.files
			    ? EPJ_OK
			    : ej_error(ctx, EPJ_ERR_NOMEM,
				       "checkpoint '%s': out of memory", path);
	for (int r = 0; cs == EPJ_OK && r < world; r++) {
		s.files[r].bytes = rows[r].bytes;
		memcpy(s.files[r].hash, rows[r].hash, 33);
		s.files[r].hash[32] = '\0';
		if (!ej_ckpt_set_file_name(path, pl->gen, r, s.files[r].name,
					   sizeof s.files[r].name))
			cs = ej_error(ctx, EPJ_ERR_INVALID,
				      "checkpoint '%s': the file name of rank "
				      "%d is too long",
				      path, r);
	}
	if (cs == EPJ_OK && pl->keep > 1 && pl->have_prev)
		cs = write_copy(ctx, path, &pl->prev, true);
	if (cs == EPJ_OK && pl->keep > 1)
		cs = write_copy(ctx, path, &s, false);
	if (cs == EPJ_OK)
		cs = ej_ckpt_set_write(ctx, path, &s);
	ej_ckpt_set_free(&s);
	return cs;
}

/* Once every rank knows generation pl->gen is committed: the generation
 * d = gen - keep goes -- the files its record names (prev when d is the
 * previous generation, else the copy ej_save_prepare shared), each rank
 * its own, and rank 0 removes the copy of d's record.  Never a file of
 * generation gen or of the keep - 1 before it. */
static void save_drop(const ej_save_plan *pl)
{
	int64_t d = pl->gen - pl->keep;
	if (d < 1)
		return;
	const ej_ckpt_set *rec = pl->have_prev && pl->prev.generation == d
				     ? &pl->prev
				 : pl->have_drop ? &pl->drop
						 : NULL;
	if (rec)
		ej_ckpt_set_prune(pl->path, rec, pl->rank, pl->world);
	char cp[4300], *text = NULL;
	size_t len = 0;
	ej_ckpt_set c;
	if (pl->rank != 0 || !ej_ckpt_set_copy_path(pl->path, d, cp, sizeof cp))
		return;
	/* the copy is removed when it is a record of generation d (a
	 * parse error has no context to go to: the copy then stays) */
	if (ej_ckpt_set_read(cp, &text, &len) == 1 &&
	    ej_ckpt_set_parse(NULL, cp, text, len, &c) == EPJ_OK) {
		if (c.generation == d && unlink(cp) == 0)
			epj_log_msg(EPJ_LOG_INFO,
				    "removed %s: generation %" PRId64
				    " is no longer kept",
				    cp, d);
		ej_ckpt_set_free(&c);
	}
	free(text);
}

/* The end of a save, on every rank: rank 0 commits the record when every
 * rank wrote its file (st, this rank's status so far, is the same on all
 * of them unless a collective failed), then every rank learns the outcome.
 * A rank removes its new file only when it knows the record was not
 * committed, and the files of an older generation only when the ranks
 * agreed that it was: no rank ever removes a file that the newest
 * committed record names, whatever happens to the agreement.  Collective. */
static epj_status save_commit(epj_engine *e, const ej_save_plan *pl,
			      const ej_save_row *rows, bool mine_ok,
			      epj_status st)
{
	epj_ctx *ctx = e->ctx;
	ej_comm *world = multi_world(e);
	const char *path = pl->path, *f = pl->file;
	epj_status cs = EPJ_OK;
	if (world->rank == 0 && st == EPJ_OK)
		cs = save_record(e, pl, rows);
	bool i_committed = world->rank == 0 && st == EPJ_OK && cs == EPJ_OK;
	if (i_committed)
		ej_save_hold("committed", 0, pl->counts.step);
	/* the agreement, summed over the ranks: [failures, committed] */
	float v[2] = { st == EPJ_OK && cs == EPJ_OK ? 0.0f : 1.0f,
		       i_committed ? 1.0f : 0.0f };
	char first[512] = "", why[512] = "";
	epj_status fs = st != EPJ_OK ? st : cs;
	if (fs != EPJ_OK)
		snprintf(first, sizeof first, "%s", epj_ctx_error(ctx));
	epj_status as =
	    ej_comm_allreduce(ctx, world, "checkpoint commit", v, 2);
	if (as == EPJ_OK && commit_fault(world->rank))
		as = ej_error(ctx, EPJ_ERR_IO,
			      "checkpoint commit: failed "
			      "(EPJIT_TEST_SAVE_COMMIT_FAULT)");
	if (as != EPJ_OK)
		snprintf(why, sizeof why, "%s", epj_ctx_error(ctx));
	/* 1: committed, 0: not, -1: this rank cannot tell.  Rank 0 knows;
	 * it commits only when every rank's file was written, so a rank whose
	 * own file failed knows too. */
	int committed = world->rank == 0 ? i_committed
			: !mine_ok	 ? 0
			: as == EPJ_OK	 ? v[1] > 0
					 : -1;
	if (committed == 0) {
		unlink(f); /* never committed */
		char cp[4300];
		if (world->rank == 0 && pl->keep > 1 &&
		    ej_ckpt_set_copy_path(path, pl->gen, cp, sizeof cp))
			unlink(cp); /* nor is its copy */
		if (fs != EPJ_OK)
			return ej_error(ctx, fs, "%s", first);
		if (as != EPJ_OK)
			return as;
		return ej_error(ctx, EPJ_ERR_IO,
				"checkpoint '%s' not saved: the commit failed "
				"on %g other rank%s (see their messages); the "
				"previous generation stays",
				path, (double)v[0], v[0] == 1 ? "" : "s");
	}
	if (committed < 0)
		return ej_error(ctx, EPJ_ERR_IO,
				"checkpoint '%s': rank %d cannot tell whether "
				"generation %" PRId64 " was committed (%s): "
				"its file %s stays, and %s names either this "
				"generation or the previous one, complete",
				path, world->rank, pl->gen, why, f, path);
	if (as != EPJ_OK || v[0] > 0)
		return ej_error(ctx, EPJ_ERR_IO,
				"checkpoint '%s': generation %" PRId64 " is "
				"committed, but not every rank confirmed it "
				"(%s): the older generations' files stay",
				path, pl->gen,
				as != EPJ_OK ? why
					     : "a failure on another rank");
	save_drop(pl);
	return EPJ_OK;
}

epj_status ej_save_commit(epj_engine *e, const ej_save_plan *pl,
			  const ej_save_row *mine, epj_status st)
{
	epj_ctx *ctx = e->ctx;
	ej_comm *world = multi_world(e);
	ej_save_row *rows = calloc((size_t)world->size, sizeof *rows);
	int64_t *counts = calloc((size_t)world->size, sizeof *counts);
	for (int r = 0; rows && counts && r < world->size; r++)
		counts[r] = 1;
	epj_status gs =
	    rows && counts
		? ej_comm_allgather(ctx, world, "checkpoint save", mine, rows,
				    counts, sizeof *mine)
		: ej_error(ctx, EPJ_ERR_NOMEM, "checkpoint '%s': out of memory",
			   pl->path);
	if (st == EPJ_OK)
		st = gs;
	int bad = 0;
	for (int r = 0; st == EPJ_OK && r < world->size; r++)
		bad += !rows[r].ok;
	if (st == EPJ_OK && bad)
		st = ej_error(ctx, EPJ_ERR_IO,
			      "checkpoint '%s' not saved: the save failed on "
			      "%d other rank%s (see their messages); the "
			      "previous generation stays",
			      pl->path, bad, bad == 1 ? "" : "s");
	st = save_commit(e, pl, rows, mine->ok, st);
	free(rows);
	free(counts);
	return st;
}

/* With several ranks a save is one generation G of a checkpoint set (see
 * ckpt_set.c): every rank writes the state it owns -- its experts, its
 * ZeRO partitions, and (replicated state) the dense parameters -- to
 * PATH.g<G>.rank<R>; then rank 0 commits the record PATH naming every
 * file's checksum; then the files of generation G - keep go
 * (epj_engine_set_save_keep).  A background save in flight is committed
 * first (ckpt_async.c). */
epj_status epj_engine_save(epj_engine *e, const char *path)
{
	int64_t unused;
	epj_status st = epj_engine_save_finish(e, &unused);
	if (st != EPJ_OK)
		return st;
	ej_comm *world = multi_world(e);
	if (!world)
		return engine_save_file(e, path, 0);
	epj_ctx *ctx = e->ctx;
	ej_save_plan pl;
	st = ej_save_prepare(e, path, &pl);
	if (st != EPJ_OK)
		return st;
	ej_save_row mine = { 0 };
	st = engine_save_file(e, pl.file, pl.gen);
	if (st == EPJ_OK)
		st = ej_file_hash(ctx, pl.file, &mine.bytes, mine.hash);
	mine.ok = st == EPJ_OK;
	save_fault(world->rank);
	st = ej_save_commit(e, &pl, &mine, st);
	ej_save_plan_free(&pl);
	return st;
}

epj_status epj_engine_set_save_keep(epj_engine *e, int keep)
{
	if (keep < 1)
		return ej_error(e->ctx, EPJ_ERR_INVALID,
				"checkpoints kept: %d, expected 1 or more",
				keep);
	if (keep > 1 && !multi_world(e))
		return ej_error(e->ctx, EPJ_ERR_UNSUPPORTED,
				"keeping %d checkpoints needs a checkpoint set "
				"(several ranks): a world of one saves one "
				"file, replaced at each save",
				keep);
	e->save_keep = keep;
	return EPJ_OK;
}

/* A checkpoint never holds a non-finite value: EPJ_ERR_STATE naming the
 * entry and its first non-finite element when tensor t (entry `name`) has
 * one.  The common case costs one sum on t's device (finite when every
 * element is, unless a sum of finite values overflows: then the elements
 * are read one by one to tell). */
static epj_status check_finite(epj_ctx *ctx, const char *path, const char *name,
			       epj_tensor *t)
{
	int64_t n = epj_tensor_numel(t);
	if (!epj_dtype_is_float(epj_tensor_dtype(t)) || n == 0)
		return EPJ_OK;
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *sum = epj_sum_all(ctx, t);
	epj_no_grad_exit(ctx, prev);
	double v = NAN;
	epj_status st =
	    sum ? epj_tensor_to_f64(ctx, sum, &v) : epj_ctx_status(ctx);
	epj_tensor_free(sum);
	if (st != EPJ_OK || isfinite(v))
		return st;
	double *h = malloc(sizeof *h * (size_t)n);
	if (!h)
		return ej_error(ctx, EPJ_ERR_STATE,
				"checkpoint '%s' not saved: '%s' holds a "
				"non-finite value (the file there is left as "
				"it was)",
				path, name);
	st = epj_tensor_to_f64(ctx, t, h);
	int64_t bad = -1;
	for (int64_t i = 0; st == EPJ_OK && i < n && bad < 0; i++)
		if (!isfinite(h[i]))
			bad = i;
	double bv = bad >= 0 ? h[bad] : 0;
	free(h);
	if (st != EPJ_OK || bad < 0)
		return st;
	return ej_error(ctx, EPJ_ERR_STATE,
			"checkpoint '%s' not saved: '%s' element %lld is %g "
			"(a non-finite weight or optimizer state: the last "
			"update diverged; the file there is left as it was)",
			path, name, (long long)bad, bv);
}

static epj_status sink_i64(const ej_save_sink *s, const char *k, int64_t v)
{
	char buf[32];
	snprintf(buf, sizeof buf, "%lld", (long long)v);
	return s->meta(s->self, k, buf);
}

epj_status ej_engine_save_entries(epj_engine *e, const char *path,
				  int64_t generation, const ej_save_sink *s)
{
	epj_ctx *ctx = e->ctx;
	epj_status st = EPJ_OK;
	ej_param_list *pl = &e->model->params;
	/* FP32 master values under the HF names (partitioned masters are
	 * optimizer state: "optimizer.master_shard.<name>"). */
	for (int i = 0; st == EPJ_OK && i < pl->n; i++) {
		epj_tensor *p = pl->params[i];
		epj_tensor *master = ej_optim_master(e->optim, i);
		if (ej_optim_sharded(e->optim, i, NULL, NULL))
			continue;
		st = s->tensor(s->self, pl->names[i], master ? master : p);
	}
	ej_comm *world = multi_world(e);
	if (world && st == EPJ_OK)
		st = sink_i64(s, "world_size", world->size);
	if (world && st == EPJ_OK)
		st = sink_i64(s, "rank", world->rank);
	if (generation > 0 && st == EPJ_OK)
		st = sink_i64(s, "generation", generation);
	if (world && st == EPJ_OK)
		st = sink_i64(s, "zero_stage", e->cfg.zero.stage);
	if (world && st == EPJ_OK)
		st = sink_i64(s, "autoep_size",
			      e->cfg.expert_parallel.autoep_size);
	for (int i = 0; st == EPJ_OK && i < ej_optim_state_count(e->optim);
	     i++) {
		const char *nm = ej_optim_state_name(e->optim, i);
		if (!strncmp(nm, "optimizer.master.", 17))
			continue; /* already saved under the HF name */
		st = s->tensor(s->self, nm, ej_optim_state_tensor(e->optim, i));
	}
	if (st == EPJ_OK)
		st = s->meta(s->self, "format", CKPT_FORMAT);
	if (st == EPJ_OK)
		st = sink_i64(s, "step", e->step);
	if (st == EPJ_OK)
		st = sink_i64(s, "micro_step", e->micro_step);
	if (st == EPJ_OK)
		st = sink_i64(s, "optimizer_steps",
			      ej_optim_step_count(e->optim));
	/* the model's config.json, so that epjit-ckpt can rebuild the
	 * parameter shapes of the ZeRO partitions without being told */
	char *mc =
	    st == EPJ_OK ? ej_model_config_json(&e->model->cfg, NULL) : NULL;
	if (st == EPJ_OK)
		st = mc ? s->meta(s->self, "model_config", mc)
			: ej_error(ctx, EPJ_ERR_NOMEM,
				   "checkpoint '%s': out of memory", path);
	free(mc);
	return st;
}

/* engine_save_file's sink: every tensor checked finite, into the writer. */
typedef struct file_sink {
	epj_ctx *ctx;
	const char *path;
	epj_st_writer *w;
} file_sink;

static epj_status file_tensor(void *self, const char *name, epj_tensor *t)
{
	file_sink *fs = self;
	epj_status st = check_finite(fs->ctx, fs->path, name, t);
	return st == EPJ_OK ? epj_st_writer_add(fs->w, name, t) : st;
}

static epj_status file_meta(void *self, const char *key, const char *value)
{
	file_sink *fs = self;
	return epj_st_writer_set_metadata(fs->w, key, value);
}

static epj_status engine_save_file(epj_engine *e, const char *path,
				   int64_t generation)
{
	file_sink fs = { .ctx = e->ctx, .path = path };
	epj_status st = epj_st_writer_new(e->ctx, &fs.w);
	if (st != EPJ_OK)
		return st;
	ej_save_sink s = { &fs, file_tensor, file_meta };
	st = ej_engine_save_entries(e, path, generation, &s);
	if (st == EPJ_OK)
		st = epj_st_writer_save(fs.w, path);
	epj_st_writer_free(fs.w);
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

/* Largest step / micro_step / optimizer_steps a checkpoint may carry (a run
 * of more than 2^31 - 1 optimizer steps is not a thing; larger values are
 * corruption and would overflow the micro-batch count of a resume). */
#define CKPT_STEP_MAX INT32_MAX

/* Metadata k of a training checkpoint as a whole decimal number in
 * [0, CKPT_STEP_MAX]; else EPJ_ERR_FORMAT naming the file and the field. */
static epj_status meta_i64(epj_ctx *ctx, const epj_st_file *f, const char *path,
			   const char *k, int64_t *out)
{
	const char *v = epj_st_metadata(f, k);
	if (!v)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: training checkpoint without metadata "
				"\"%s\"",
				path, k);
	char *end;
	errno = 0;
	long long x = strtoll(v, &end, 10);
	bool digits = *v >= '0' && *v <= '9';
	if (!digits || *end || errno || x < 0 || x > CKPT_STEP_MAX)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: metadata \"%s\" is \"%.40s\": expected a "
				"whole number in [0, %d]",
				path, k, v, CKPT_STEP_MAX);
	*out = x;
	return EPJ_OK;
}

/* The file's entry i holds a floating-point dtype (what a parameter or an
 * optimizer state can be loaded from); else EPJ_ERR_DTYPE. */
static epj_status check_float(epj_ctx *ctx, const epj_st_file *f,
			      const char *path, const char *kind,
			      const char *name)
{
	int k = epj_st_find(f, name);
	epj_dtype dt = k >= 0 ? epj_st_dtype_at(f, k) : EPJ_DTYPE_F32;
	if (dt == EPJ_DTYPE_F32 || dt == EPJ_DTYPE_BF16 || dt == EPJ_DTYPE_F64)
		return EPJ_OK;
	return ej_error(ctx, EPJ_ERR_DTYPE,
			"%s: %s \"%s\" has dtype %s in the file; expected a "
			"floating-point dtype (F32, BF16 or F64)",
			path, kind, name, epj_st_dtype_str_at(f, k));
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

/* What a load of one rank's file is checked against: the commit record of
 * the set (NULL for a legacy set or a plain file) and the name of each
 * rank's file, for messages. */
typedef struct load_plan {
	const ej_ckpt_set *set;
	const char *path; /* as given */
} load_plan;

static epj_status engine_load_file(epj_engine *e, const char *file,
				   bool rank_file, ej_comm *world,
				   const load_plan *plan);

/* Rank `rank`'s file of the set, for messages. */
static void plan_file(const load_plan *pl, int rank, char *buf, size_t n)
{
	if (pl->set) {
		const char *s = strrchr(pl->path, '/');
		int dl = s ? (int)(s - pl->path) + 1 : 0;
		snprintf(buf, n, "%.*s%s", dl, pl->path,
			 pl->set->files[rank].name);
	} else {
		rank_file(buf, n, pl->path, rank);
	}
}

/* This rank's file of a committed set: it exists, and its size and
 * checksum are the record's. */
static epj_status check_set_file(epj_ctx *ctx, const ej_ckpt_set *set,
				 const char *path, const char *f, int rank)
{
	const ej_ckpt_file *rf = &set->files[rank];
	if (!file_exists(f))
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint set '%s' (generation %" PRId64
				") is incomplete: rank %d's file %s is "
				"missing",
				path, set->generation, rank, f);
	int64_t bytes = 0;
	char hex[33];
	epj_status st = ej_file_hash(ctx, f, &bytes, hex);
	if (st == EPJ_OK && (bytes != rf->bytes || strcmp(hex, rf->hash)))
		st = ej_error(ctx, EPJ_ERR_FORMAT,
			      "checkpoint set '%s' (generation %" PRId64
			      "): rank %d's file %s is not the one the "
			      "record names (%" PRId64 " bytes, checksum %s; "
			      "the record: %" PRId64 " bytes, %s): a file "
			      "of another save or a damaged one",
			      path, set->generation, rank, f, bytes, hex,
			      rf->bytes, rf->hash);
	return st;
}

/* With several ranks: a committed set (PATH is its record) loads
 * PATH.g<G>.rank<R> on each rank after checking it against the record;
 * an older set without a record loads PATH.rank<R>; else PATH loads as
 * plain weights on every rank (an HF checkpoint: every rank takes its
 * parameters).  Either way the ranks compare their counters before
 * anything is copied. */
/* A Hugging Face folder (epjit-ckpt to-hf, save_pretrained) loads as its
 * model.safetensors.index.json (a set of shards, opened as one file by
 * epj_st_open) or its model.safetensors, into hf[n]. */
static epj_status hf_folder(epj_ctx *ctx, const char *path, char *hf, size_t n)
{
	snprintf(hf, n, "%s/model.safetensors.index.json", path);
	if (file_exists(hf))
		return EPJ_OK;
	snprintf(hf, n, "%s/model.safetensors", path);
	if (!file_exists(hf))
		return ej_error(ctx, EPJ_ERR_IO,
				"%s: a folder without model.safetensors or "
				"model.safetensors.index.json",
				path);
	return EPJ_OK;
}

epj_status epj_engine_load(epj_engine *e, const char *path)
{
	epj_ctx *ctx = e->ctx;
	ej_comm *world = multi_world(e);
	char f[4096], hf[3968];
	struct stat sb;
	if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
		epj_status hs = hf_folder(ctx, path, hf, sizeof hf);
		if (hs != EPJ_OK)
			return hs;
		path = hf;
	}
	ej_sweep_tmp(path);
	if (!world) {
		char *text = NULL;
		size_t len = 0;
		int rec = ej_ckpt_set_read(path, &text, &len);
		ej_ckpt_set s;
		bool parsed = rec == 1 && ej_ckpt_set_parse(ctx, path, text,
							    len, &s) == EPJ_OK;
		free(text);
		if (rec < 0)
			return ej_ckpt_set_read_error(ctx, path, rec);
		if (rec == 1 && !parsed)
			return ctx->status;
		if (rec != 0) {
			int64_t w = parsed ? s.world : 0;
			if (parsed)
				ej_ckpt_set_free(&s);
			return ej_error(
			    ctx, EPJ_ERR_UNSUPPORTED,
			    "%s: the record of a checkpoint of %" PRId64
			    " ranks: resume it under mpirun with the world "
			    "size it was saved with, or rewrite it for this "
			    "world with 'epjit-ckpt reshard %s --world 1 OUT' "
			    "(see 'epjit-ckpt info %s')",
			    path, w, path, path);
		}
		rank_file(f, sizeof f, path, 0);
		if (!file_exists(path) && file_exists(f))
			return ej_error(
			    ctx, EPJ_ERR_UNSUPPORTED,
			    "%s: a checkpoint of several ranks (%s, ...): "
			    "resume it under mpirun with the world size it "
			    "was saved with, or rewrite it for this world "
			    "with 'epjit-ckpt reshard %s --world 1 OUT' (see "
			    "'epjit-ckpt info %s')",
			    path, f, path, path);
		return engine_load_file(e, path, false, NULL, NULL);
	}
	ej_ckpt_set set;
	bool have = false;
	epj_status st = share_record(ctx, world, path, &set, &have);
	if (st != EPJ_OK)
		return st; /* the same on every rank: nothing else was sent */
	load_plan plan = { .set = have ? &set : NULL, .path = path };
	if (have && set.world != world->size) {
		st = ej_error(ctx, EPJ_ERR_UNSUPPORTED,
			      "%s: saved by a world of %" PRId64 " ranks; "
			      "this run has %d: rewrite it for this world "
			      "with 'epjit-ckpt reshard %s --world %d OUT' "
			      "(see 'epjit-ckpt info %s')",
			      path, set.world, world->size, path, world->size,
			      path);
		ej_ckpt_set_free(&set);
		return st;
	}
	if (have) {
		plan_file(&plan, world->rank, f, sizeof f);
		st = check_set_file(ctx, &set, path, f, world->rank);
		st = agree(ctx, world, st, "checkpoint load");
		if (st == EPJ_OK)
			st = engine_load_file(e, f, true, world, &plan);
		ej_ckpt_set_free(&set);
		return st;
	}
	rank_file(f, sizeof f, path, world->rank);
	return file_exists(f) ? engine_load_file(e, f, true, world, &plan)
			      : engine_load_file(e, path, false, world, &plan);
}

/* Metadata k as an integer, 0 when absent or malformed (check_world_meta:
 * any mismatch with this run is refused there). */
static int64_t meta_int(const epj_st_file *f, const char *k)
{
	const char *v = epj_st_metadata(f, k);
	return v ? strtoll(v, NULL, 10) : 0;
}

/* The metadata of a rank file must match this run. */
static epj_status check_world_meta(epj_engine *e, const epj_st_file *f,
				   const char *path)
{
	ej_comm *world = multi_world(e);
	const char *ws = epj_st_metadata(f, "world_size");
	int64_t zs = meta_int(f, "zero_stage"), es = meta_int(f, "autoep_size");
	if (!ws || strtoll(ws, NULL, 10) != world->size ||
	    meta_int(f, "rank") != world->rank)
		return ej_error(
		    e->ctx, EPJ_ERR_UNSUPPORTED,
		    "%s: saved by rank %lld of a world of %s ranks; "
		    "this is rank %d of %d: rewrite the checkpoint for "
		    "this world with 'epjit-ckpt reshard CKPT --world %d "
		    "OUT' (see 'epjit-ckpt info CKPT')",
		    path, (long long)meta_int(f, "rank"), ws ? ws : "1",
		    world->rank, world->size, world->size);
	if (zs != e->cfg.zero.stage || es != e->cfg.expert_parallel.autoep_size)
		return ej_error(e->ctx, EPJ_ERR_UNSUPPORTED,
				"%s: saved with zero_optimization.stage=%lld "
				"and expert_parallel.autoep_size=%lld; this "
				"run has %d and %d: the partitions differ "
				"(an EP size: 'epjit-ckpt reshard CKPT "
				"--world %d --ep %d OUT')",
				path, (long long)zs, (long long)es,
				e->cfg.zero.stage,
				e->cfg.expert_parallel.autoep_size, world->size,
				e->cfg.expert_parallel.autoep_size);
	return EPJ_OK;
}

/* Validates every entry of f against the engine before anything is copied
 * (a failed load changes nothing). */
static epj_status load_check(epj_engine *e, epj_st_file *f, const char *path,
			     bool rank_file, bool *training_out, int64_t *meta)
{
	epj_ctx *ctx = e->ctx;
	epj_status st = EPJ_OK;
	ej_param_list *pl = &e->model->params;
	const bool sharded_experts =
	    e->model->has_groups && e->model->groups.ep->size > 1;
	if (rank_file)
		st = check_world_meta(e, f, path);
	else if (epj_st_metadata(f, "world_size") && epj_st_metadata(f, "rank"))
		st = ej_error(
		    ctx, EPJ_ERR_UNSUPPORTED,
		    "%s: one rank's file (rank %s) of a checkpoint of %s "
		    "ranks, not a checkpoint: load the set through its "
		    "record (the path without \".g<G>.rank<R>\"), or merge "
		    "it with 'epjit-ckpt reshard CKPT --world %d OUT' (see "
		    "'epjit-ckpt info CKPT')",
		    path, epj_st_metadata(f, "rank"),
		    epj_st_metadata(f, "world_size"),
		    multi_world(e) ? multi_world(e)->size : 1);
	else if (multi_world(e) && epj_st_metadata(f, "format") &&
		 !strcmp(epj_st_metadata(f, "format"), CKPT_FORMAT))
		st = ej_error(ctx, EPJ_ERR_UNSUPPORTED,
			      "%s: a training checkpoint of a world of %s "
			      "rank(s); this run has %d ranks: rewrite it "
			      "for this world with 'epjit-ckpt reshard %s "
			      "--world %d OUT' (its weights alone load from "
			      "an HF checkpoint: 'epjit-ckpt to-hf')",
			      path,
			      epj_st_metadata(f, "world_size")
				  ? epj_st_metadata(f, "world_size")
				  : "1",
			      multi_world(e)->size, path, multi_world(e)->size);
	/* Every name in the file must be known: a parameter or optimizer
	 * state (or, with sharded experts, another rank's expert).  Every
	 * parameter must be present. */
	for (int i = 0; st == EPJ_OK && i < epj_st_count(f); i++) {
		const char *nm = epj_st_name_at(f, i);
		bool opt = !strncmp(nm, "optimizer.", 10), known = false;
		for (int k = 0;
		     !known && opt && k < ej_optim_state_count(e->optim); k++)
			known = !strcmp(ej_optim_state_name(e->optim, k), nm) &&
				strncmp(nm, "optimizer.master.", 17) != 0;
		/* a rank's file holds its optimizer shards (checked by
		 * check_world_meta and the entries below); with sharded
		 * experts a full file holds other ranks' experts */
		known |= opt && rank_file;
		known |=
		    sharded_experts && !rank_file && strstr(nm, ".experts.");
		for (int k = 0; !known && !opt && k < pl->n; k++)
			known = !strcmp(pl->names[k], nm);
		if (!known)
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      opt ? "%s: tensor \"%s\" is not a state "
					    "of this optimizer (saved with "
					    "another optimizer?)"
					  : "%s: tensor \"%s\" is not a "
					    "parameter of this model",
				      path, nm);
	}
	/* Validate every entry before the first copy: a failed load changes
	 * nothing. */
	for (int i = 0; st == EPJ_OK && i < pl->n; i++) {
		if (rank_file && ej_optim_sharded(e->optim, i, NULL, NULL))
			continue;
		st = check_entry(ctx, f, path, "parameter", pl->names[i],
				 pl->params[i], "");
		if (st == EPJ_OK)
			st = check_float(ctx, f, path, "parameter",
					 pl->names[i]);
	}
	bool training = false;
	const char *fmt = st == EPJ_OK ? epj_st_metadata(f, "format") : NULL;
	if (fmt && !strcmp(fmt, CKPT_FORMAT))
		training = true;
	int64_t m_step = 0, m_micro = 0, m_opt = 0;
	if (st == EPJ_OK && training) {
		st = meta_i64(ctx, f, path, "step", &m_step);
		if (st == EPJ_OK)
			st = meta_i64(ctx, f, path, "micro_step", &m_micro);
		if (st == EPJ_OK)
			st = meta_i64(ctx, f, path, "optimizer_steps", &m_opt);
		if (st == EPJ_OK && m_opt > m_step)
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      "%s: metadata \"optimizer_steps\" is "
				      "%" PRId64 ": expected at most \"step\" "
				      "(%" PRId64 ")",
				      path, m_opt, m_step);
	}
	if (st == EPJ_OK && training) {
		meta[0] = m_step;
		meta[1] = m_micro;
		meta[2] = m_opt;
	}
	*training_out = training;
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
		if (st == EPJ_OK && strncmp(nm, "optimizer.master.", 17) != 0)
			st = check_float(ctx, f, path, "optimizer state", nm);
	}
	return st;
}

/* Copies the checked entries into masters, parameters and state. */
static epj_status load_copy(epj_engine *e, epj_st_file *f, bool rank_file,
			    bool training)
{
	epj_ctx *ctx = e->ctx;
	ej_param_list *pl = &e->model->params;
	epj_status st = EPJ_OK;
	/* everything checked: copy */
	for (int i = 0; st == EPJ_OK && i < pl->n; i++) {
		epj_tensor *master = ej_optim_master(e->optim, i);
		bool sharded = ej_optim_sharded(e->optim, i, NULL, NULL);
		if (sharded && rank_file)
			continue; /* optimizer.master_shard.<name> below */
		st = load_into(ctx, f, pl->names[i],
			       master && !sharded ? master : pl->params[i]);
	}
	if (st == EPJ_OK && !training)
		st = ej_optim_masters_from_params(e->optim);
	for (int i = 0;
	     st == EPJ_OK && training && i < ej_optim_state_count(e->optim);
	     i++) {
		const char *nm = ej_optim_state_name(e->optim, i);
		if (!strncmp(nm, "optimizer.master.", 17))
			continue;
		st = load_into(ctx, f, nm, ej_optim_state_tensor(e->optim, i));
	}
	return st;
}

/* One rank's row of the load's exchange. */
typedef struct load_row {
	int64_t ok, rank_file, training, step, micro, opt, gen;
} load_row;

/* The counters of every rank's file agree (and a set's with its record):
 * EPJ_ERR_FORMAT naming the first rank whose file differs from this
 * rank's.  rows[world->size] from the exchange; mine is this rank's. */
static epj_status compare_rows(epj_ctx *ctx, ej_comm *world,
			       const load_plan *plan, const load_row *rows,
			       const load_row *mine)
{
	char a[4096], b[4096];
	const ej_ckpt_set *set = plan ? plan->set : NULL;
	const char *path = plan ? plan->path : "?";
	if (set && mine->training &&
	    (mine->gen != set->generation || mine->step != set->step ||
	     mine->micro != set->micro_step ||
	     mine->opt != set->optimizer_steps)) {
		plan_file(plan, world->rank, a, sizeof a);
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint set '%s': %s is generation %" PRId64
				" at step %" PRId64 " (micro-step %" PRId64
				", optimizer step %" PRId64 "); the record "
				"names generation %" PRId64 " at step %" PRId64
				" (%" PRId64 ", %" PRId64 ")",
				path, a, mine->gen, mine->step, mine->micro,
				mine->opt, set->generation, set->step,
				set->micro_step, set->optimizer_steps);
	}
	for (int r = 0; r < world->size; r++) {
		const load_row *o = &rows[r];
		if (!o->ok)
			continue; /* its own message; agree() reports it */
		if (o->rank_file != mine->rank_file) {
			int with = mine->rank_file ? world->rank : r;
			int without = mine->rank_file ? r : world->rank;
			plan_file(plan, with, a, sizeof a);
			plan_file(plan, without, b, sizeof b);
			return ej_error(ctx, EPJ_ERR_FORMAT,
					"checkpoint '%s' is incomplete: rank "
					"%d has its file %s, rank %d has no "
					"%s",
					path, with, a, without, b);
		}
		if (o->training == mine->training && o->step == mine->step &&
		    o->micro == mine->micro && o->opt == mine->opt &&
		    o->gen == mine->gen)
			continue;
		plan_file(plan, world->rank, a, sizeof a);
		plan_file(plan, r, b, sizeof b);
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint '%s' mixes saves: %s (rank %d) is "
				"at step %" PRId64 " (micro-step %" PRId64
				", optimizer step %" PRId64
				"), %s (rank %d) at step %" PRId64 " (%" PRId64
				", %" PRId64 "): the rank files "
				"come from different saves; refusing to load "
				"them together",
				path, a, world->rank, mine->step, mine->micro,
				mine->opt, b, r, o->step, o->micro, o->opt);
	}
	return EPJ_OK;
}

/* Every rank shares its counters and compares them with every other's
 * (collective: called whatever happened locally). */
static epj_status exchange_counters(epj_ctx *ctx, ej_comm *world,
				    const load_plan *plan, epj_status st,
				    const load_row *mine)
{
	load_row *rows = calloc((size_t)world->size, sizeof *rows);
	int64_t *counts = calloc((size_t)world->size, sizeof *counts);
	for (int r = 0; rows && counts && r < world->size; r++)
		counts[r] = 1;
	epj_status gs =
	    rows && counts
		? ej_comm_allgather(ctx, world, "checkpoint counters", mine,
				    rows, counts, sizeof *mine)
		: ej_error(ctx, EPJ_ERR_NOMEM,
			   "checkpoint load: out of memory");
	if (st == EPJ_OK)
		st = gs;
	if (st == EPJ_OK)
		st = compare_rows(ctx, world, plan, rows, mine);
	free(rows);
	free(counts);
	return st;
}

/* With several ranks (world) every rank takes part in the same agreements
 * whatever happens locally: the counters' exchange and an agreement after
 * the checks (nothing changed yet when a rank fails them), one after the
 * copies; then the collective refresh of the parameters from their
 * masters. */
static epj_status engine_load_file(epj_engine *e, const char *path,
				   bool rank_file, ej_comm *world,
				   const load_plan *plan)
{
	epj_ctx *ctx = e->ctx;
	epj_st_file *f = NULL;
	bool training = false;
	int64_t meta[3] = { 0 }; /* step, micro_step, optimizer_steps */
	epj_status st = epj_st_open(ctx, path, &f);
	if (st == EPJ_OK)
		st = load_check(e, f, path, rank_file, &training, meta);
	if (world) {
		load_row mine = {
			.ok = st == EPJ_OK,
			.rank_file = rank_file,
			.training = training,
			.step = meta[0],
			.micro = meta[1],
			.opt = meta[2],
			.gen = st == EPJ_OK && f &&
				       epj_st_metadata(f, "generation")
				   ? meta_int(f, "generation")
				   : 0,
		};
		st = exchange_counters(ctx, world, plan, st, &mine);
		st = agree(ctx, world, st, "checkpoint load");
	}
	if (st == EPJ_OK)
		st = load_copy(e, f, rank_file, training);
	if (world)
		st = agree(ctx, world, st, "checkpoint load (copy)");
	if (st == EPJ_OK)
		st = ej_optim_sync_params(e->optim);
	if (st == EPJ_OK) {
		if (training) {
			e->step = meta[0];
			e->micro_step = meta[1];
			ej_optim_set_step_count(e->optim, meta[2]);
		} else {
			e->step = e->micro_step = 0;
			ej_optim_set_step_count(e->optim, 0);
		}
		e->accum_loss = 0;
		e->accum_n = 0;
		e->accum_tokens = 0;
	}
	if (f)
		epj_st_close(f);
	return st;
}

/* A monitor's folder: output_path/job_name, or job_name alone when
 * output_path is "" (DeepSpeed's os.path.join: trailing slashes of
 * output_path are not doubled, "logs/" gives logs/job). */
static bool monitor_dir(const struct ej_csv_monitor_config *m, char *dir,
			size_t n)
{
	if (!m->enabled)
		return false;
	int len = (int)strlen(m->output_path);
	while (len > 1 && m->output_path[len - 1] == '/')
		len--;
	if (len == 1 && m->output_path[0] == '/')
		snprintf(dir, n, "/%s", m->job_name);
	else if (len > 0)
		snprintf(dir, n, "%.*s/%s", len, m->output_path, m->job_name);
	else
		snprintf(dir, n, "%s", m->job_name);
	return true;
}

bool epj_engine_csv_monitor_dir(const epj_engine *e, char *dir, size_t n)
{
	return monitor_dir(&e->cfg.csv_monitor, dir, n);
}

bool epj_engine_tensorboard_dir(const epj_engine *e, char *dir, size_t n)
{
	return monitor_dir(&e->cfg.tensorboard, dir, n);
}

const char *epj_engine_data_path(const epj_engine *e)
{
	return e && e->cfg.data.path[0] ? e->cfg.data.path : NULL;
}

const char *epj_engine_data_split(const epj_engine *e)
{
	return e && e->cfg.data.split[0] ? e->cfg.data.split : NULL;
}

bool epj_engine_data_seed(const epj_engine *e, uint64_t *seed)
{
	if (!e || !e->cfg.data.seed_given)
		return false;
	if (seed)
		*seed = (uint64_t)e->cfg.data.seed;
	return true;
}
