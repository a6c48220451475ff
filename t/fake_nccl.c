/* fake_nccl.c -- a stand-in for libnccl.so.2 that runtime/comm_nccl.c's
 * tests load through $EPJIT_NCCL on machines without a GPU: one process,
 * communicators of one rank, buffers in host memory (t/fake_cuda.c's
 * "device" memory is host memory).
 *
 * It keeps NCCL's rules where the comm code relies on them:
 *  - ncclCommInitRank accepts only an id this process's ncclGetUniqueId
 *    made, nranks = 1 and rank 0 (ncclInvalidArgument otherwise);
 *  - collectives of one rank: an all-reduce / reduce / reduce-scatter sum
 *    over one contribution, a broadcast or all-gather from rank 0, each
 *    copying send to recv when they differ;
 *  - point to point: ncclSend / ncclRecv to self are legal only inside
 *    ncclGroupStart/End; ncclGroupEnd pairs the i-th send with the i-th
 *    receive and refuses unequal sizes (ncclInvalidUsage); a send or
 *    receive outside a group is ncclInvalidUsage (it would never finish);
 *  - types and reduction ops out of range are ncclInvalidArgument.
 * FAKE_NCCL_FAIL=<entry point> makes that call fail with
 * ncclInternalError; fake_nccl_stats_get reports the calls.
 *
 * Test code: built only for make check, never installed.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
	char internal[128];
} ncclUniqueId;

enum {
	OK = 0,
	E_CUDA = 1,
	E_SYSTEM = 2,
	E_INTERNAL = 3,
	E_ARG = 4,
	E_USAGE = 5,
};

typedef struct comm {
	unsigned magic;
	int nranks, rank;
} comm;
#define MAGIC 0x4e43434cu

/* what the test reads back */
typedef struct fake_nccl_stats {
	long long unique_ids, inits, destroys, all_reduces, broadcasts, reduces,
	    all_gathers, reduce_scatters, sends, recvs, groups;
	long long bytes_moved; /* bytes copied by sends, broadcasts, ... */
	void *last_stream;
	int last_nranks, last_rank;
} fake_nccl_stats;

static fake_nccl_stats S;
static char issued[128]; /* the last id made */
static bool issued_any;

#define MAX_P2P 256
static struct {
	int depth;
	struct p2p {
		const void *send;
		void *recv;
		size_t bytes;
	} s[MAX_P2P], r[MAX_P2P];
	int ns, nr;
	bool broken; /* a call inside the group failed */
} G;

void fake_nccl_stats_get(fake_nccl_stats *out);
void fake_nccl_stats_get(fake_nccl_stats *out)
{
	*out = S;
}

static bool failing(const char *name)
{
	const char *f = getenv("FAKE_NCCL_FAIL");
	return f && !strcmp(f, name);
}
#define ENTER(name)                                                            \
	do {                                                                   \
		if (failing(name))                                             \
			return E_INTERNAL;                                     \
	} while (0)

static size_t type_size(int t)
{
	static const size_t sz[] = { 1, 1, 4, 4, 8, 8, 2, 4, 8, 2 };
	return t >= 0 && t < 10 ? sz[t] : 0;
}

static bool comm_ok(const comm *c)
{
	return c && c->magic == MAGIC;
}

const char *ncclGetErrorString(int r);
const char *ncclGetErrorString(int r)
{
	switch (r) {
	case OK:
		return "no error";
	case E_CUDA:
		return "unhandled cuda error (run with NCCL_DEBUG=INFO for "
		       "details)";
	case E_SYSTEM:
		return "unhandled system error (run with NCCL_DEBUG=INFO for "
		       "details)";
	case E_INTERNAL:
		return "internal error - please report this issue to the NCCL "
		       "developers";
	case E_ARG:
		return "invalid argument (run with NCCL_DEBUG=WARN for "
		       "details)";
	case E_USAGE:
		return "invalid usage (run with NCCL_DEBUG=WARN for details)";
	}
	return "unknown result code";
}

static char last_global[256];

/* the text of the process's last failure, as NCCL keeps it */
const char *ncclGetLastError(comm *c);
const char *ncclGetLastError(comm *c)
{
	(void)c;
	return last_global;
}

static int fail(comm *c, int r, const char *why)
{
	(void)c;
	snprintf(last_global, sizeof last_global, "%s", why);
	if (G.depth > 0)
		G.broken = true;
	return r;
}

int ncclGetVersion(int *v);
int ncclGetVersion(int *v)
{
	*v = 22803; /* 2.28.3 */
	return OK;
}

int ncclGetUniqueId(ncclUniqueId *id);
int ncclGetUniqueId(ncclUniqueId *id)
{
	ENTER("ncclGetUniqueId");
	for (int i = 0; i < 128; i++)
		issued[i] = (char)(rand() & 0xff);
	issued[0] = 'F'; /* never all zero */
	memcpy(id->internal, issued, 128);
	issued_any = true;
	S.unique_ids++;
	return OK;
}

int ncclCommInitRank(comm **out, int nranks, ncclUniqueId id, int rank);
int ncclCommInitRank(comm **out, int nranks, ncclUniqueId id, int rank)
{
	ENTER("ncclCommInitRank");
	if (!out)
		return fail(NULL, E_ARG, "comm is NULL");
	if (!issued_any || memcmp(id.internal, issued, 128) != 0)
		return fail(NULL, E_ARG,
			    "unique id was not made by ncclGetUniqueId");
	if (nranks != 1 || rank != 0)
		return fail(NULL, E_ARG,
			    "the stand-in has one process: nranks 1, rank 0");
	comm *c = calloc(1, sizeof *c);
	if (!c)
		return E_SYSTEM;
	c->magic = MAGIC;
	c->nranks = nranks;
	c->rank = rank;
	*out = c;
	S.inits++;
	S.last_nranks = nranks;
	S.last_rank = rank;
	return OK;
}

int ncclCommDestroy(comm *c);
int ncclCommDestroy(comm *c)
{
	if (!comm_ok(c))
		return E_ARG;
	c->magic = 0;
	free(c);
	S.destroys++;
	return OK;
}

int ncclCommSplit(comm *c, int color, int key, comm **out, void *config);
int ncclCommSplit(comm *c, int color, int key, comm **out, void *config)
{
	(void)key;
	(void)config;
	ENTER("ncclCommSplit");
	if (!comm_ok(c) || !out)
		return fail(c, E_ARG, "bad communicator");
	if (color < 0) { /* NCCL_SPLIT_NOCOLOR */
		*out = NULL;
		return OK;
	}
	comm *n = calloc(1, sizeof *n);
	if (!n)
		return E_SYSTEM;
	*n = *c;
	*out = n;
	return OK;
}

/* a collective's common checks */
static int coll(comm *c, int type, int op, void *stream)
{
	if (!comm_ok(c))
		return fail(NULL, E_ARG, "invalid communicator");
	if (!type_size(type))
		return fail(c, E_ARG, "invalid data type");
	if (op < 0 || op > 4)
		return fail(c, E_ARG, "invalid reduction operation");
	S.last_stream = stream;
	return OK;
}

static void copy(void *dst, const void *src, size_t n)
{
	if (dst != src && n)
		memmove(dst, src, n);
	S.bytes_moved += (long long)n;
}

int ncclAllReduce(const void *s, void *r, size_t n, int t, int op, comm *c,
		  void *stream);
int ncclAllReduce(const void *s, void *r, size_t n, int t, int op, comm *c,
		  void *stream)
{
	ENTER("ncclAllReduce");
	int e = coll(c, t, op, stream);
	if (e)
		return e;
	if (n && (!s || !r))
		return fail(c, E_ARG, "NULL buffer");
	copy(r, s, n * type_size(t)); /* the sum over one rank */
	S.all_reduces++;
	return OK;
}

int ncclBroadcast(const void *s, void *r, size_t n, int t, int root, comm *c,
		  void *stream);
int ncclBroadcast(const void *s, void *r, size_t n, int t, int root, comm *c,
		  void *stream)
{
	ENTER("ncclBroadcast");
	int e = coll(c, t, 0, stream);
	if (e)
		return e;
	if (root != 0)
		return fail(c, E_ARG, "root out of range");
	if (n && (!s || !r))
		return fail(c, E_ARG, "NULL buffer");
	copy(r, s, n * type_size(t));
	S.broadcasts++;
	return OK;
}

int ncclReduce(const void *s, void *r, size_t n, int t, int op, int root,
	       comm *c, void *stream);
int ncclReduce(const void *s, void *r, size_t n, int t, int op, int root,
	       comm *c, void *stream)
{
	ENTER("ncclReduce");
	int e = coll(c, t, op, stream);
	if (e)
		return e;
	if (root != 0)
		return fail(c, E_ARG, "root out of range");
	if (n && (!s || !r))
		return fail(c, E_ARG, "NULL buffer");
	copy(r, s, n * type_size(t));
	S.reduces++;
	return OK;
}

int ncclAllGather(const void *s, void *r, size_t n, int t, comm *c,
		  void *stream);
int ncclAllGather(const void *s, void *r, size_t n, int t, comm *c,
		  void *stream)
{
	ENTER("ncclAllGather");
	int e = coll(c, t, 0, stream);
	if (e)
		return e;
	if (n && (!s || !r))
		return fail(c, E_ARG, "NULL buffer");
	copy(r, s, n * type_size(t));
	S.all_gathers++;
	return OK;
}

int ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, comm *c,
		      void *stream);
int ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, comm *c,
		      void *stream)
{
	ENTER("ncclReduceScatter");
	int e = coll(c, t, op, stream);
	if (e)
		return e;
	if (n && (!s || !r))
		return fail(c, E_ARG, "NULL buffer");
	copy(r, s, n * type_size(t));
	S.reduce_scatters++;
	return OK;
}

static int p2p(comm *c, int t, int peer, void *stream, const char *what)
{
	int e = coll(c, t, 0, stream);
	if (e)
		return e;
	if (peer != 0)
		return fail(c, E_ARG, "peer out of range");
	if (G.depth == 0)
		return fail(c, E_USAGE, what);
	if (G.ns >= MAX_P2P || G.nr >= MAX_P2P)
		return fail(c, E_INTERNAL, "too many operations in a group");
	return OK;
}

int ncclSend(const void *s, size_t n, int t, int peer, comm *c, void *stream);
int ncclSend(const void *s, size_t n, int t, int peer, comm *c, void *stream)
{
	ENTER("ncclSend");
	int e = p2p(c, t, peer, stream, "send to self outside a group");
	if (e)
		return e;
	G.s[G.ns++] = (struct p2p){ .send = s, .bytes = n * type_size(t) };
	S.sends++;
	return OK;
}

int ncclRecv(void *r, size_t n, int t, int peer, comm *c, void *stream);
int ncclRecv(void *r, size_t n, int t, int peer, comm *c, void *stream)
{
	ENTER("ncclRecv");
	int e = p2p(c, t, peer, stream, "receive from self outside a group");
	if (e)
		return e;
	G.r[G.nr++] = (struct p2p){ .recv = r, .bytes = n * type_size(t) };
	S.recvs++;
	return OK;
}

int ncclGroupStart(void);
int ncclGroupStart(void)
{
	ENTER("ncclGroupStart");
	if (G.depth++ == 0) {
		G.ns = G.nr = 0;
		G.broken = false;
	}
	return OK;
}

int ncclGroupEnd(void);
int ncclGroupEnd(void)
{
	if (G.depth == 0)
		return fail(NULL, E_USAGE, "ncclGroupEnd without a start");
	if (--G.depth > 0)
		return OK;
	S.groups++;
	if (failing("ncclGroupEnd"))
		return E_INTERNAL;
	if (G.broken)
		return fail(NULL, E_USAGE, "an operation of the group failed");
	if (G.ns != G.nr)
		return fail(NULL, E_USAGE,
			    "sends and receives to self do not pair up");
	for (int i = 0; i < G.ns; i++)
		if (G.s[i].bytes != G.r[i].bytes)
			return fail(NULL, E_USAGE,
				    "send and receive sizes differ");
	for (int i = 0; i < G.ns; i++)
		copy(G.r[i].recv, G.s[i].send, G.s[i].bytes);
	return OK;
}
