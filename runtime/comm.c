/* comm.c -- collective backends behind the ej_comm vtable.
 *
 * Only `self` lives here for now: a world of one process (rank 0, size 1).
 * Its collectives are what any backend degenerates to with one rank: an
 * all-to-all sends every row to itself (a copy), an all-reduce of one
 * contribution is the identity, a barrier of one returns at once.  The MPI
 * (CPU collectives, launcher, bootstrap of NCCL's unique id) and NCCL (GPU
 * collectives) implementations come with the Distributed issue and fill the
 * same vtable.
 *
 * Buffers handed to `self` are host memory: the AutoEP layer never moves
 * device tensors through a world of one (it skips the exchange entirely), so
 * the copies below only see host-side split plans and test buffers.  The
 * vtable carries no context, so failures return a status without a message;
 * callers add the message with their own context.
 */
#include "runtime_impl.h"

#include <string.h>

/* send_counts[0] rows go to rank 0 (ourselves) and recv_counts[0] rows come
 * back from it: the two counts must agree. */
static epj_status self_all_to_all_v(void *self, const void *sendbuf,
				    const int64_t *send_counts, void *recvbuf,
				    const int64_t *recv_counts, size_t row)
{
	(void)self;
	if (!send_counts || !recv_counts || send_counts[0] < 0 ||
	    send_counts[0] != recv_counts[0])
		return EPJ_ERR_INVALID;
	size_t bytes = (size_t)send_counts[0] * row;
	if (bytes == 0)
		return EPJ_OK;
	if (!sendbuf || !recvbuf)
		return EPJ_ERR_INVALID;
	if (sendbuf != recvbuf)
		memmove(recvbuf, sendbuf, bytes);
	return EPJ_OK;
}

/* One int64 per rank: with one rank, recv[0] = send[0]. */
static epj_status self_all_to_all_i64(void *self, const int64_t *send,
				      int64_t *recv)
{
	(void)self;
	if (!send || !recv)
		return EPJ_ERR_INVALID;
	recv[0] = send[0];
	return EPJ_OK;
}

/* The sum over one rank is the buffer itself. */
static epj_status self_all_reduce_f32(void *self, float *buf, int64_t n)
{
	(void)self;
	if (n < 0 || (n > 0 && !buf))
		return EPJ_ERR_INVALID;
	return EPJ_OK;
}

static epj_status self_barrier(void *self)
{
	(void)self;
	return EPJ_OK;
}

static void self_destroy(void *self)
{
	(void)self; /* `self` holds no state */
}

ej_comm *ej_comm_self_new(void)
{
	ej_comm *c = calloc(1, sizeof *c);
	if (!c)
		return NULL;
	c->name = "self";
	c->rank = 0;
	c->size = 1;
	c->self = NULL;
	c->all_to_all_v = self_all_to_all_v;
	c->all_to_all_i64 = self_all_to_all_i64;
	c->all_reduce_f32 = self_all_reduce_f32;
	c->barrier = self_barrier;
	c->destroy = self_destroy;
	return c;
}

void ej_comm_free(ej_comm *c)
{
	if (!c)
		return;
	if (c->destroy)
		c->destroy(c->self);
	free(c);
}
