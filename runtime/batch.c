/* batch.c -- what a training batch becomes before the model sees it:
 * packed documents (Megatron's reset_attention_mask, reset_position_ids
 * and eod_mask_loss) and the per-token loss (calculate_per_token_loss).
 *
 * Documents.  A row of T tokens holds documents packed end to end, each
 * ended by the end-of-document token (the tokenizer's --append-eod), as
 * Megatron's get_ltor_masks_and_position_ids reads them: the EOD belongs
 * to the document it ends, and the next token starts a new one.  Per row:
 *   doc_ids[t]   the number of EODs in input_ids[0 .. t-1]
 *                (reset_attention_mask: attention hides every other id);
 *   positions[t] t minus the index of the first token of t's document
 *                (reset_position_ids: the rope tables' rows);
 *   labels[t]    -100 where input_ids[t] is the EOD (eod_mask_loss: the
 *                loss of predicting the next document's first token).
 * They are made on the host from the batch and given to the model as
 * tensors, inputs of its forward, so a compiled region keeps one graph
 * whatever the boundaries.
 *
 * Per-token loss.  Each micro-batch's backward runs on the sum of its
 * counted token losses (its mean cross-entropy times its count n: the same
 * gradients as a sum reduction, exactly, and none at all when n is 0); at
 * the step the counts and sums of every micro-batch of every rank are
 * gathered (exactly: int64 and double, summed in rank order) and the
 * gradients scaled by 1 / N, N the counted tokens of the global batch:
 * the sum of the masked token losses over the tokens that count, not a
 * mean of per-micro-batch means (which weighs a token of a short
 * completion more than one of a long one).
 */
#include "runtime_impl.h"

#include <math.h>
#include <string.h>

#define IGNORE_INDEX -100

epj_status epj_batch_documents(epj_ctx *ctx, epj_tensor *input_ids,
			       epj_tensor *labels, const epj_batch_opts *o,
			       epj_tensor **position_ids, epj_tensor **doc_ids,
			       epj_tensor **labels_out)
{
	if (position_ids)
		*position_ids = NULL;
	if (doc_ids)
		*doc_ids = NULL;
	if (labels_out)
		*labels_out = NULL;
	if (!input_ids || !o || !labels_out || !position_ids || !doc_ids)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"batch_documents: %s is NULL",
				!input_ids ? "input_ids"
				: !o	   ? "opts"
					   : "an output pointer");
	bool docs = o->reset_attention_mask || o->reset_position_ids ||
		    o->eod_mask_loss;
	if (docs && o->eod_token < 0)
		return ej_error(ctx, EPJ_ERR_INVALID,
				"batch_documents: reset_attention_mask, "
				"reset_position_ids and eod_mask_loss need "
				"the end-of-document token (eod_token)");
	if (epj_tensor_ndim(input_ids) != 2 ||
	    (labels &&
	     (epj_tensor_ndim(labels) != 2 ||
	      epj_tensor_dim(labels, 0) != epj_tensor_dim(input_ids, 0) ||
	      epj_tensor_dim(labels, 1) != epj_tensor_dim(input_ids, 1))))
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"batch_documents: input_ids must be [B, T] "
				"and labels of its shape");
	if (!docs) { /* nothing to make: no host copy of the batch */
		*labels_out = labels ? epj_tensor_ref(labels) : NULL;
		return EPJ_OK;
	}
	const int64_t B = epj_tensor_dim(input_ids, 0);
	const int64_t T = epj_tensor_dim(input_ids, 1), n = B * T;
	double *ids = malloc(sizeof *ids * (size_t)(n + 1));
	double *lab = malloc(sizeof *lab * (size_t)(n + 1));
	int64_t *pos = malloc(sizeof *pos * (size_t)(n + 1));
	int64_t *doc = malloc(sizeof *doc * (size_t)(n + 1));
	int64_t *nl = malloc(sizeof *nl * (size_t)(n + 1));
	epj_status st = EPJ_OK;
	if (!ids || !lab || !pos || !doc || !nl) {
		st = ej_error(ctx, EPJ_ERR_NOMEM,
			      "batch_documents: out of memory for [%lld, %lld]",
			      (long long)B, (long long)T);
		goto done;
	}
	if ((st = epj_tensor_to_f64(ctx, input_ids, ids)) != EPJ_OK ||
	    (labels && (st = epj_tensor_to_f64(ctx, labels, lab)) != EPJ_OK))
		goto done;
	const double eod = (double)o->eod_token;
	for (int64_t b = 0; b < B; b++) {
		int64_t d = 0, start = 0;
		for (int64_t t = 0; t < T; t++) {
			int64_t i = b * T + t;
			pos[i] = t - start;
			doc[i] = d;
			nl[i] = labels ? (int64_t)lab[i] : IGNORE_INDEX;
			if (docs && ids[i] == eod) {
				if (o->eod_mask_loss)
					nl[i] = IGNORE_INDEX;
				d++;
				start = t + 1;
			}
		}
	}
	int64_t shp[2] = { B, T };
	if (o->reset_position_ids && !(*position_ids = epj_tensor_from_data(
					   ctx, EPJ_DTYPE_I64, 2, shp, pos)))
		st = ctx->status;
	if (st == EPJ_OK && o->reset_attention_mask &&
	    !(*doc_ids = epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2, shp, doc)))
		st = ctx->status;
	if (st == EPJ_OK && labels) {
		*labels_out =
		    o->eod_mask_loss
			? epj_tensor_from_data(ctx, EPJ_DTYPE_I64, 2, shp, nl)
			: epj_tensor_ref(labels);
		if (!*labels_out)
			st = ctx->status;
	}
	if (st != EPJ_OK) {
		epj_tensor_free(*position_ids);
		epj_tensor_free(*doc_ids);
		*position_ids = *doc_ids = NULL;
	}
done:
	free(ids);
	free(lab);
	free(pos);
	free(doc);
	free(nl);
	return st;
}

/* ---- the engine's options ------------------------------------------------ */

void epj_engine_batch_opts(const epj_engine *e, epj_batch_opts *o)
{
	*o = e->batch;
}

/* o against the model: the EOD token in the vocabulary when a document
 * option needs it. */
static epj_status batch_check(epj_ctx *ctx, const epj_model *m,
			      const epj_batch_opts *o, const char *what)
{
	bool docs = o->reset_attention_mask || o->reset_position_ids ||
		    o->eod_mask_loss;
	if (docs && o->eod_token < 0)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: reset_attention_mask, reset_position_ids "
				"and eod_mask_loss need the end-of-document "
				"token: set data.eod_token (--eod-token)",
				what);
	if (docs && o->eod_token >= m->cfg.vocab_size)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s: eod_token %lld is not below the model's "
				"vocab_size %lld",
				what, (long long)o->eod_token,
				(long long)m->cfg.vocab_size);
	return EPJ_OK;
}

epj_status ej_engine_batch_init(epj_engine *e)
{
	const struct ej_data_config *d = &e->cfg.data;
	epj_batch_opts o = { .reset_attention_mask = d->reset_attention_mask,
			     .reset_position_ids = d->reset_position_ids,
			     .eod_mask_loss = d->eod_mask_loss,
			     .eod_token = d->eod_token,
			     .per_token_loss =
				 d->per_token_loss || d->eod_mask_loss };
	epj_status st = batch_check(e->ctx, e->model, &o, e->cfg.source);
	if (st != EPJ_OK)
		return st;
	e->batch = o;
	e->model->docs_pos = o.reset_position_ids;
	e->model->docs_attn = o.reset_attention_mask;
	return EPJ_OK;
}

epj_status epj_engine_set_batch_opts(epj_engine *e, const epj_batch_opts *o)
{
	if (!o)
		return ej_error(e->ctx, EPJ_ERR_INVALID,
				"set_batch_opts: opts is NULL");
	epj_batch_opts c = *o;
	c.per_token_loss = o->per_token_loss || o->eod_mask_loss;
	/* the ids change what a compiled region's forward takes */
	bool graph = c.reset_attention_mask != e->batch.reset_attention_mask ||
		     c.reset_position_ids != e->batch.reset_position_ids;
	const epj_batch_opts *p = &e->batch;
	bool same = !graph && c.eod_mask_loss == p->eod_mask_loss &&
		    c.eod_token == p->eod_token &&
		    c.per_token_loss == p->per_token_loss;
	if (!same && (e->micro_step > 0 || (graph && e->compiled)))
		return ej_error(e->ctx, EPJ_ERR_STATE,
				"set_batch_opts: the batch options are set "
				"before the first step (reset_attention_mask "
				"and reset_position_ids before "
				"epj_engine_compile)");
	epj_status st = batch_check(e->ctx, e->model, &c, "batch options");
	if (st != EPJ_OK)
		return st;
	e->batch = c;
	e->model->docs_pos = c.reset_position_ids;
	e->model->docs_attn = c.reset_attention_mask;
	return EPJ_OK;
}

/* ---- forward and the step's normalisation -------------------------------- */

/* The labels that count (not -100). */
static epj_status count_tokens(epj_ctx *ctx, epj_tensor *labels, int64_t *n)
{
	int64_t k = epj_tensor_numel(labels);
	double *v = malloc(sizeof *v * (size_t)(k + 1));
	if (!v)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"out of memory counting the labels");
	epj_status st = epj_tensor_to_f64(ctx, labels, v);
	*n = 0;
	for (int64_t i = 0; st == EPJ_OK && i < k; i++)
		*n += v[i] != IGNORE_INDEX;
	free(v);
	return st;
}

epj_status ej_engine_forward(epj_engine *e, epj_tensor *input_ids,
			     epj_tensor *labels, epj_tensor **logits,
			     epj_tensor **loss, int64_t *tokens)
{
	epj_ctx *ctx = e->ctx;
	const epj_batch_opts *o = &e->batch;
	epj_tensor *pos = NULL, *docs = NULL, *lab = NULL;
	*tokens = 0;
	epj_status st =
	    epj_batch_documents(ctx, input_ids, labels, o, &pos, &docs, &lab);
	if (st == EPJ_OK && lab && o->per_token_loss)
		st = count_tokens(ctx, lab, tokens);
	if (st == EPJ_OK)
		st = epj_model_forward_docs(ctx, e->model, input_ids, lab, pos,
					    docs, logits, loss);
	epj_tensor_free(pos);
	epj_tensor_free(docs);
	epj_tensor_free(lab);
	return st;
}

epj_status epj_engine_forward(epj_engine *e, epj_tensor *input_ids,
			      epj_tensor *labels, epj_tensor **logits,
			      epj_tensor **loss)
{
	int64_t n = 0;
	return ej_engine_forward(e, input_ids, labels, logits, loss, &n);
}

epj_status ej_engine_token_mean(epj_engine *e, double *mean, double *scale)
{
	ej_comm *world = e->model->has_groups ? e->model->groups.world : NULL;
	int W = world ? world->size : 1;
	/* this rank's sum and count, then every rank's in rank order */
	struct {
		double sum;
		int64_t n;
	} mine = { e->accum_loss, e->accum_tokens }, *all = &mine;
	double total = mine.sum;
	int64_t N = mine.n;
	if (W > 1) {
		all = calloc((size_t)W, sizeof *all);
		int64_t *counts = calloc((size_t)W, sizeof *counts);
		epj_status st = all && counts ? EPJ_OK
					      : ej_error(e->ctx, EPJ_ERR_NOMEM,
							 "out of memory");
		for (int r = 0; r < W; r++)
			if (counts)
				counts[r] = 1;
		if (st == EPJ_OK)
			st = ej_comm_allgather(e->ctx, world, "train.tokens",
					       &mine, all, counts, sizeof mine);
		free(counts);
		if (st != EPJ_OK) {
			free(all);
			return st;
		}
		total = 0;
		N = 0;
		for (int r = 0; r < W; r++) {
			total += all[r].sum;
			N += all[r].n;
		}
		free(all);
	}
	/* the optimizer scales by 1 / W after its sum over the ranks */
	*mean = N > 0 ? total / (double)N : NAN;
	*scale = N > 0 ? (double)W / (double)N : 0.0;
	return EPJ_OK;
}
