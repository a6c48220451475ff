/* dataset_impl.h -- the token datasets of runtime/dataset.c as data.c's
 * corpora see them.
 *
 * An ej_dsrc is the static part (the opened sources, blend weights, the
 * document split); an ej_dstream is one reader of one split (train 0,
 * validation 1, test 2) holding only its position and the cached order of
 * its current epoch. */
#ifndef EPJIT_DATASET_IMPL_H
#define EPJIT_DATASET_IMPL_H

#include "core_impl.h"

typedef struct ej_dsrc ej_dsrc;
typedef struct ej_dstream ej_dstream;

ej_dsrc *ej_dsrc_open(epj_ctx *ctx, const char *spec, const epj_data_opts *o);
void ej_dsrc_free(ej_dsrc *d); /* NULL ok */
uint32_t ej_dsrc_vocab(const ej_dsrc *d);
/* Does a source of d have a loss mask (PREFIX.lossmask)? */
bool ej_dsrc_has_loss_mask(const ej_dsrc *d);
uint64_t ej_dsrc_split_tokens(const ej_dsrc *d, int split);

ej_dstream *ej_dstream_new(epj_ctx *ctx, const ej_dsrc *d, int split);
void ej_dstream_free(ej_dstream *s); /* NULL ok */
/* One sample of T + 1 tokens x: in[t] = x[t], lab[t] = x[t + 1], or -100
 * where the source's loss mask of x[t + 1] is 0. */
epj_status ej_dstream_row(epj_ctx *ctx, ej_dstream *s, int64_t T, int64_t *in,
			  int64_t *lab);
/* Advances as `rows` calls of ej_dstream_row would, reading no tokens. */
epj_status ej_dstream_skip(epj_ctx *ctx, ej_dstream *s, uint64_t rows);

#endif
