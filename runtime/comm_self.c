/* comm_self.c -- the `self` collective backend: a world of one process
 * (rank 0, size 1).
 *
 * Its collectives are what any backend degenerates to with one rank: an
 * all-to-all sends every row to itself (a copy), an all-reduce of one
 * contribution is the identity, a barrier of one returns at once, a split
 * gives another world of one.  The `mpi` backend (comm_mpi.c) fills the
 * same vtable.
 *
 * Buffers handed to `self` are host memory: the AutoEP layer never moves
 * device tensors through a world of one (it skips the exchange entirely), so
 * the copies below only see host-side split plans and test buffers.
 * Failures return a status; `error` gives a fixed text.
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

static epj_status self_reduce_scatter_f32(void *self, const float *send,
					  float *recv, const int64_t *counts)
{
	(void)self;
	if (!counts || counts[0] < 0 || (counts[0] > 0 && (!send || !recv)))
		return EPJ_ERR_INVALID;
	if (counts[0] > 0 && send != recv)
		memmove(recv, send, sizeof(float) * (size_t)counts[0]);
	return EPJ_OK;
}

static epj_status self_all_gather_v(void *self, const void *send, void *recv,
				    const int64_t *counts, size_t row)
{
	(void)self;
	if (!counts || counts[0] < 0)
		return EPJ_ERR_INVALID;
	size_t bytes = (size_t)counts[0] * row;
	if (bytes == 0)
		return EPJ_OK;
	if (!send || !recv)
		return EPJ_ERR_INVALID;
	if (send != recv)
		memmove(recv, send, bytes);
	return EPJ_OK;
}

static epj_status self_broadcast(void *self, void *buf, size_t bytes, int root)
{
	(void)self;
	return root == 0 && (bytes == 0 || buf) ? EPJ_OK : EPJ_ERR_INVALID;
}

/* A posted exchange of one rank completes at once: the request is a
 * marker. */
static epj_status self_a2a_i64_start(void *self, const int64_t *send,
				     int64_t *recv, int n_per,
				     ej_comm_req **req)
{
	static char done_marker;
	(void)self;
	if (!req)
		return EPJ_ERR_INVALID;
	*req = NULL;
	if (n_per < 0 || (n_per > 0 && (!send || !recv)))
		return EPJ_ERR_INVALID;
	if (n_per > 0 && send != recv)
		memmove(recv, send, sizeof(int64_t) * (size_t)n_per);
	*req = (ej_comm_req *)&done_marker;
	return EPJ_OK;
}

static epj_status self_wait(void *self, ej_comm_req *req)
{
	(void)self;
	return req ? EPJ_OK : EPJ_ERR_INVALID;
}

static ej_comm *self_split(void *self, int color, int key, const char *group)
{
	(void)self;
	(void)color;
	(void)key;
	ej_comm *c = ej_comm_self_new();
	if (c)
		c->group = group;
	return c;
}

static const char *self_error(void *self)
{
	(void)self;
	return "invalid arguments for a world of one";
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
	c->group = "world";
	c->reduce_scatter_f32 = self_reduce_scatter_f32;
	c->all_gather_v = self_all_gather_v;
	c->broadcast = self_broadcast;
	c->all_to_all_i64_start = self_a2a_i64_start;
	c->wait = self_wait;
	c->split = self_split;
	c->error = self_error;
	return c;
}
