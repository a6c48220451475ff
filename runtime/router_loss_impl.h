/* router_loss_impl.h -- the router losses of a model's AutoEP layers
 * (runtime/router_loss.c; doc/trainer.md, "Router losses").
 *
 * One ej_rloss per model, shared by its AutoEP layers (layer i is the i-th
 * MoE layer in model order).  A model forward brackets the layers' calls
 * with ej_rloss_begin / ej_rloss_end; each layer call hands its router
 * logits to ej_rloss_attach before routing and its top-k choice to
 * ej_rloss_count after.  The losses' values are counted by the forward
 * that is not a checkpoint replay (once per layer and forward), and their
 * gradient is added once, by an identity node on the router logits made
 * by the call that runs with grad: the forward itself, or its checkpoint
 * replay in the backward.
 */
#ifndef EPJIT_ROUTER_LOSS_IMPL_H
#define EPJIT_ROUTER_LOSS_IMPL_H

#include "config_impl.h"
#include "core_impl.h"

/* The losses, in the order of the metrics. */
typedef enum ej_rloss_kind {
	EJ_RLOSS_HF,	 /* transformers' load_balancing_loss_func */
	EJ_RLOSS_AUX,	 /* Megatron's aux_loss */
	EJ_RLOSS_SEQ,	 /* Megatron's seq_aux_loss */
	EJ_RLOSS_GLOBAL, /* Megatron's global_aux_loss */
	EJ_RLOSS_Z,	 /* Megatron's z-loss */
	EJ_RLOSS_N
} ej_rloss_kind;

typedef struct ej_rloss ej_rloss;
struct ej_comm;

/* The losses of a model of n_layers MoE layers of E experts, top k, whose
 * routers score by `scoring`, with transformers' auxiliary loss times
 * hf_coef when hf (output_router_logits); Megatron's off until
 * ej_rloss_configure.  NULL: out of memory. */
ej_rloss *ej_rloss_new(int n_layers, int E, int k, ej_route_scoring scoring,
		       bool hf, double hf_coef);
void ej_rloss_free(ej_rloss *rl);
/* Megatron's losses of the training config (moe.*) and the group the
 * global aux loss sums its counts over (borrowed; NULL: one rank).  An
 * EPJ_ERR_CONFIG error when a balancing loss of moe.* comes with
 * transformers' (config.json output_router_logits). */
epj_status ej_rloss_configure(epj_ctx *ctx, ej_rloss *rl,
			      const struct ej_moe_config *moe,
			      struct ej_comm *world);
/* Whether any loss is on (else every call below is a no-op). */
bool ej_rloss_on(const ej_rloss *rl);

/* A model forward begins: training (grad enabled at the model's call)
 * counts Megatron's losses too, evaluation transformers' alone. */
void ej_rloss_begin(ej_rloss *rl, bool training);
/* Whether a layer's call is one of a training forward's, not a replay:
 * true also without grad, which the calls of checkpointed layers run
 * without (whatever losses are on; false outside a model forward). */
bool ej_rloss_training(const epj_ctx *ctx, const ej_rloss *rl);
/* ... and ends: the values of the forward, *add the sum of the counted
 * losses times their coefficients (to add to the training loss), and
 * the gradient coefficients of every counted layer. */
epj_status ej_rloss_end(epj_ctx *ctx, ej_rloss *rl, double *add);
/* *loss (the forward's training loss, replaced) plus add, ej_rloss_end's
 * sum, through a node whose backward keeps the gradient that reaches the
 * loss: the router losses' gradient is scaled by it, as the rest of the
 * loss's is (the engine's per-token loss backpropagates a micro-batch's
 * sum of token losses, the loss times its counted tokens). */
epj_status ej_rloss_add_to_loss(epj_ctx *ctx, ej_rloss *rl, double add,
				epj_tensor **loss);

/* Layer `layer`'s router logits [N, E] (N = B T tokens, T per sequence)
 * before routing: *out the tensor to route with, logits itself (a new
 * reference) or an alias whose autograd node adds the losses' gradient
 * in the backward.  Counting calls also take the values (sums of the
 * router's probabilities, of logsumexp^2) as tensors read at
 * ej_rloss_end. */
epj_status ej_rloss_attach(epj_ctx *ctx, ej_rloss *rl, int layer,
			   epj_tensor *logits, int64_t T, epj_tensor **out);
/* Whether this call of a layer counts a balancing loss (a forward's call,
 * not a replay): the caller then gives ej_rloss_count the top-k choice. */
bool ej_rloss_wants_choice(const epj_ctx *ctx, const ej_rloss *rl);
/* The experts sel [N, k] that the top-k of layer `layer`'s router
 * probabilities chose for each token (transformers' and Megatron's
 * routing map, which ignores the layer's fixed routing, groups and score
 * bias); the global aux loss sums the counts over the ranks here. */
epj_status ej_rloss_count(epj_ctx *ctx, ej_rloss *rl, int layer,
			  const int64_t *sel, int64_t N);

/* The training loss of the last forward (ej_rloss_end) enters the
 * current optimizer step's metrics. */
void ej_rloss_accumulate(ej_rloss *rl);
/* An optimizer step ends: the metrics become the step's (the mean over
 * its micro-batches, over the ranks of world as transformers and Megatron
 * reduce them: the mean, the global aux loss the sum; world NULL: one
 * rank), and the global aux loss restarts its running counts. */
epj_status ej_rloss_step_end(epj_ctx *ctx, ej_rloss *rl, struct ej_comm *world);
/* The i-th loss that is on: its metric name and the last step's value;
 * false past the last. */
bool ej_rloss_metric(const ej_rloss *rl, int i, const char **name,
		     double *value);
/* The values of the last forward, kind by kind (0 where off). */
void ej_rloss_values(const ej_rloss *rl, double v[EJ_RLOSS_N]);

#endif
