/* comm_nccl.c -- the `nccl` collective backend: collectives on device
 * buffers of the process's cuda device, through NCCL loaded with dlopen
 * (libnccl.so.2, or $EPJIT_NCCL; "0" turns it off).  The library never
 * links against NCCL and never includes nccl.h: the few types and values
 * used are declared below as NCCL's ABI has them (nccl.h, NCCL 2.x).
 *
 *   ej_comm_nccl_new   rank 0: ncclGetUniqueId -> broadcast over the
 *                      bootstrap comm (`mpi` when launched by mpirun,
 *                      `self` for a world of one, which needs no MPI) ->
 *                      every rank: ncclCommInitRank(size, id, rank)
 *
 * Buffers of the device members (all_to_all_v, all_reduce_f32,
 * reduce_scatter_f32, all_gather_v, broadcast) are device memory, and the
 * calls are issued on the cuda device's compute stream: they are ordered
 * with the kernels around them and return before they finish, as NCCL's
 * do.  all_to_all_v_start issues the same all-to-all on the device's
 * communication stream instead, between two events: the communication
 * stream waits for `ready`, recorded on the compute stream (the send
 * buffer is written), and records `done` after the exchange;
 * all_to_all_v_wait makes the compute stream wait for `done`, so the
 * kernels issued on the compute stream in between run while the exchange
 * does, and no host thread waits for anything.  One exchange per comm is
 * in flight at a time.  all_to_all_v is one ncclSend and one ncclRecv per peer
 * inside ncclGroupStart/End; all-gather and reduce-scatter use ncclAllGather /
 * ncclReduceScatter when every rank has the same count, else one
 * ncclBroadcast / ncclReduce per rank inside a group.  The members whose
 * buffers are host memory by the vtable's contract -- the split plan's
 * int64 exchange (all_to_all_i64 and its non-blocking form) -- and the
 * barrier go to the bootstrap comm (the barrier after the compute stream
 * has drained).
 *
 * Every NCCL call goes through one check (NC): on failure the comm's error
 * holds the call text, file:line, ncclGetErrorString and, where NCCL has
 * it, ncclGetLastError; the checked wrappers of comm.c add the group and
 * the rank.
 */
#include "cuda_libs.h"
#include "dynlib.h"
#include "runtime_impl.h"

#include "cuda_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the ABI subset (values as in nccl.h) -------------------------------- */

#define NCCL_ID_BYTES 128
typedef struct {
	char internal[NCCL_ID_BYTES];
} nc_id;			    /* ncclUniqueId */
typedef struct nc_comm_st *nc_comm; /* ncclComm_t */
typedef int nc_result;		    /* ncclSuccess = 0 */
enum {
	NC_SUCCESS = 0,
	NC_INT8 = 0,
	NC_INT64 = 4,
	NC_FLOAT32 = 7,
	NC_SUM = 0,
};

#define EJ_NCCL_ENTRY_POINTS(X)                                                \
	X(ncclGetVersion, (int *version))                                      \
	X(ncclGetUniqueId, (nc_id * id))                                       \
	X(ncclCommInitRank, (nc_comm * comm, int nranks, nc_id id, int rank))  \
	X(ncclCommDestroy, (nc_comm comm))                                     \
	X(ncclAllReduce, (const void *send, void *recv, size_t count,          \
			  int type, int op, nc_comm comm, ej_CUstream stream)) \
	X(ncclBroadcast,                                                       \
	  (const void *send, void *recv, size_t count, int type, int root,     \
	   nc_comm comm, ej_CUstream stream))                                  \
	X(ncclReduce, (const void *send, void *recv, size_t count, int type,   \
		       int op, int root, nc_comm comm, ej_CUstream stream))    \
	X(ncclAllGather, (const void *send, void *recv, size_t count,          \
			  int type, nc_comm comm, ej_CUstream stream))         \
	X(ncclReduceScatter,                                                   \
	  (const void *send, void *recv, size_t count, int type, int op,       \
	   nc_comm comm, ej_CUstream stream))                                  \
	X(ncclSend, (const void *send, size_t count, int type, int peer,       \
		     nc_comm comm, ej_CUstream stream))                        \
	X(ncclRecv, (void *recv, size_t count, int type, int peer,             \
		     nc_comm comm, ej_CUstream stream))                        \
	X(ncclGroupStart, (void))                                              \
	X(ncclGroupEnd, (void))

typedef struct nc_lib {
#define NC_FIELD(name, args) nc_result(*name) args;
	EJ_NCCL_ENTRY_POINTS(NC_FIELD)
#undef NC_FIELD
	const char *(*ncclGetErrorString)(nc_result r);
	/* optional: NCCL 2.13 and 2.18 */
	const char *(*ncclGetLastError)(nc_comm comm);
	nc_result (*ncclCommSplit)(nc_comm comm, int color, int key,
				   nc_comm *out, void *config);
	int version;	 /* ncclGetVersion: 22803 is 2.28.3 */
	char path[1024]; /* the file loaded */
} nc_lib;

static nc_lib lib;

/* Loads lib; false with err set. */
static bool lib_load(char *err, size_t n, epj_status *status)
{
	(void)status; /* EPJ_ERR_UNSUPPORTED, the default */
	const char *path = getenv("EPJIT_NCCL");
	if (path && !strcmp(path, "0")) {
		snprintf(err, n,
			 "NCCL disabled (EPJIT_NCCL=0): collectives stay on "
			 "the host comm");
		return false;
	}
	char why[1600];
	void *h;
	if (path && *path) {
		snprintf(lib.path, sizeof lib.path, "%s", path);
		h = ej_dynlib_open(path, why, sizeof why);
		ej_cuda_lib_where(h, lib.path, sizeof lib.path);
	} else { /* where CUDA libraries are looked for (cuda_libs.h) */
		static const char *const names[] = { "libnccl.so.2" };
		h = ej_cuda_lib_open(names, 1, lib.path, sizeof lib.path, why,
				     sizeof why);
	}
	path = lib.path;
	if (!h) {
		snprintf(err, n, "no NCCL (%s)", why);
		return false;
	}
	void *p;
#define NC_RESOLVE(name, args)                                                 \
	p = dlsym(h, #name);                                                   \
	if (!p) {                                                              \
		snprintf(err, n, "NCCL %s is unusable: it lacks %s", path,     \
			 #name);                                               \
		return false;                                                  \
	}                                                                      \
	memcpy(&lib.name, &p, sizeof p);
	EJ_NCCL_ENTRY_POINTS(NC_RESOLVE)
	NC_RESOLVE(ncclGetErrorString, ())
#undef NC_RESOLVE
	p = dlsym(h, "ncclGetLastError");
	memcpy(&lib.ncclGetLastError, &p, sizeof p);
	p = dlsym(h, "ncclCommSplit");
	memcpy(&lib.ncclCommSplit, &p, sizeof p);
	int v = 0;
	if (lib.ncclGetVersion(&v) != NC_SUCCESS || v < 2700) {
		/* versions below 2.9 are major*1000 + minor*100 + patch */
		snprintf(err, n,
			 "NCCL %s is too old (version code %d): epjit needs "
			 "2.7 or newer (ncclSend / ncclRecv)",
			 path, v);
		return false;
	}
	lib.version = v;
	return true;
}

static ej_dynlib nc_dl = EJ_DYNLIB_INIT(lib_load, EPJ_ERR_UNSUPPORTED);

static const nc_lib *lib_get(epj_ctx *ctx)
{
	return ej_dynlib_get(&nc_dl, ctx) ? &lib : NULL;
}

bool ej_nccl_available(epj_ctx *ctx)
{
	return lib_get(ctx) != NULL;
}

/* Test hook, deliberately in no header: forget the library. */
void ej_nccl_test_reset(void);
void ej_nccl_test_reset(void)
{
	ej_dynlib_reset(&nc_dl);
	memset(&lib, 0, sizeof lib);
}

/* ---- the comm ------------------------------------------------------------ */

typedef struct nccl_comm {
	const nc_lib *l;
	nc_comm comm;
	ej_cuda_dev *dev;
	ej_CUstream stream; /* the device's compute stream */
	/* all_to_all_v_start: the communication stream, the events (made
	 * at the first start) and whether an exchange awaits its wait */
	const ej_cuda_driver *d;
	ej_CUstream cstream;
	ej_CUevent ready, done;
	bool in_flight;
	ej_comm *boot; /* host-buffer members and bootstrap */
	bool own_boot; /* boot came from a split: freed with us */
	int rank, size;
	char err[640];
} nccl_comm;

static const char *src_file(const char *p)
{
	const char *s = strrchr(p, '/');
	return s ? s + 1 : p;
}

static epj_status nc_fail(nccl_comm *n, nc_result r, const char *what,
			  const char *file, int line)
{
	const char *str = n->l->ncclGetErrorString(r);
	const char *last = n->l->ncclGetLastError && n->comm
			       ? n->l->ncclGetLastError(n->comm)
			       : NULL;
	snprintf(n->err, sizeof n->err, "nccl: %s failed at %s:%d: %s (%d)%s%s",
		 what, src_file(file), line, str ? str : "?", r,
		 last && *last ? ": " : "", last && *last ? last : "");
	return EPJ_ERR_BACKEND;
}

/* The check: runs n->l->call; on failure records it and returns
 * EPJ_ERR_BACKEND from the enclosing function. */
#define NC(n, call)                                                            \
	do {                                                                   \
		nc_result nc_r_ = (n)->l->call;                                \
		if (nc_r_ != NC_SUCCESS)                                       \
			return nc_fail((n), nc_r_, #call, __FILE__, __LINE__); \
	} while (0)

static epj_status bad(nccl_comm *n, const char *fmt, const char *what)
{
	snprintf(n->err, sizeof n->err, "nccl: %s: %s", what, fmt);
	return EPJ_ERR_INVALID;
}

/* Ends a group opened by ncclGroupStart whatever happened inside it (a
 * group left open would capture every later call); the first failure
 * wins. */
static epj_status group_end(nccl_comm *n, epj_status st)
{
	nc_result r = n->l->ncclGroupEnd();
	if (r != NC_SUCCESS && st == EPJ_OK)
		return nc_fail(n, r, "ncclGroupEnd()", __FILE__, __LINE__);
	return st;
}

static epj_status nccl_a2av(void *self, const void *sendbuf,
			    const int64_t *send_counts, void *recvbuf,
			    const int64_t *recv_counts, size_t row)
{
	nccl_comm *n = self;
	if (!send_counts || !recv_counts)
		return bad(n, "no counts", "all_to_all_v");
	for (int p = 0; p < n->size; p++)
		if (send_counts[p] < 0 || recv_counts[p] < 0)
			return bad(n, "negative count", "all_to_all_v");
	NC(n, ncclGroupStart());
	epj_status st = EPJ_OK;
	size_t so = 0, ro = 0;
	for (int p = 0; p < n->size && st == EPJ_OK; p++) {
		size_t sb = (size_t)send_counts[p] * row;
		size_t rb = (size_t)recv_counts[p] * row;
		/* rows to p are at the prefix sum of the counts before p */
		nc_result r = NC_SUCCESS;
		const char *call = NULL;
		if (sb) {
			r = n->l->ncclSend((const char *)sendbuf + so, sb,
					   NC_INT8, p, n->comm, n->stream);
			call = "ncclSend((const char *)sendbuf + so, sb, "
			       "NC_INT8, p, n->comm, n->stream)";
		}
		if (r == NC_SUCCESS && rb) {
			r = n->l->ncclRecv((char *)recvbuf + ro, rb, NC_INT8, p,
					   n->comm, n->stream);
			call = "ncclRecv((char *)recvbuf + ro, rb, NC_INT8, p, "
			       "n->comm, n->stream)";
		}
		if (r != NC_SUCCESS)
			st = nc_fail(n, r, call, __FILE__, __LINE__);
		so += sb;
		ro += rb;
	}
	return group_end(n, st);
}

/* A failed driver call of the exchange's ordering, into the comm's error. */
static epj_status cu_fail(nccl_comm *n, ej_CUresult r, const char *what)
{
	const char *name = NULL;
	n->d->cuGetErrorName(r, &name);
	snprintf(n->err, sizeof n->err, "nccl: %s failed: %s (%d)", what,
		 name ? name : "?", r);
	return EPJ_ERR_BACKEND;
}
#define CUN(n, call)                                                           \
	do {                                                                   \
		ej_CUresult cu_r_ = (n)->d->call;                              \
		if (cu_r_ != EJ_CUDA_SUCCESS)                                  \
			return cu_fail((n), cu_r_, #call);                     \
	} while (0)

/* The all-to-all on the communication stream: ready (compute) -> wait
 * (comm) -> the exchange (comm) -> done (comm).  The compute stream goes
 * on; all_to_all_v_wait orders it after done. */
static epj_status nccl_a2av_start(void *self, const void *sendbuf,
				  const int64_t *send_counts, void *recvbuf,
				  const int64_t *recv_counts, size_t row)
{
	nccl_comm *n = self;
	if (n->in_flight)
		return bad(n, "an exchange is in flight already (wait first)",
			   "all_to_all_v_start");
	if (!n->ready)
		CUN(n, cuEventCreate(&n->ready, EJ_CU_EVENT_DEFAULT));
	if (!n->done)
		CUN(n, cuEventCreate(&n->done, EJ_CU_EVENT_DEFAULT));
	CUN(n, cuEventRecord(n->ready, n->stream));
	CUN(n, cuStreamWaitEvent(n->cstream, n->ready, 0));
	ej_CUstream compute = n->stream;
	n->stream = n->cstream; /* nccl_a2av issues on n->stream */
	epj_status st =
	    nccl_a2av(self, sendbuf, send_counts, recvbuf, recv_counts, row);
	n->stream = compute;
	if (st != EPJ_OK)
		return st;
	ej_cuda_stream_note(n->cstream, 'N');
	CUN(n, cuEventRecord(n->done, n->cstream));
	n->in_flight = true;
	return EPJ_OK;
}

static epj_status nccl_a2av_wait(void *self)
{
	nccl_comm *n = self;
	if (!n->in_flight)
		return bad(n, "no exchange in flight", "all_to_all_v_wait");
	n->in_flight = false;
	CUN(n, cuStreamWaitEvent(n->stream, n->done, 0));
	return EPJ_OK;
}

static epj_status nccl_a2a_i64(void *self, const int64_t *send, int64_t *recv)
{
	nccl_comm *n = self;
	return n->boot->all_to_all_i64(n->boot->self, send, recv);
}

static epj_status nccl_allreduce(void *self, float *buf, int64_t count)
{
	nccl_comm *n = self;
	if (count < 0)
		return bad(n, "negative count", "all_reduce");
	if (count == 0)
		return EPJ_OK;
	NC(n, ncclAllReduce(buf, buf, (size_t)count, NC_FLOAT32, NC_SUM,
			    n->comm, n->stream));
	return EPJ_OK;
}

static epj_status nccl_barrier(void *self)
{
	nccl_comm *n = self;
	epj_status st = ej_cuda_sync(NULL, n->dev);
	if (st != EPJ_OK) {
		snprintf(n->err, sizeof n->err,
			 "nccl: barrier: synchronizing the compute stream "
			 "failed");
		return st;
	}
	return n->boot->barrier(n->boot->self);
}

static bool equal_counts(const int64_t *counts, int size)
{
	for (int p = 1; p < size; p++)
		if (counts[p] != counts[0])
			return false;
	return true;
}

static epj_status nccl_reduce_scatter(void *self, const float *send,
				      float *recv, const int64_t *counts)
{
	nccl_comm *n = self;
	if (!counts)
		return bad(n, "no counts", "reduce_scatter");
	for (int p = 0; p < n->size; p++)
		if (counts[p] < 0)
			return bad(n, "negative count", "reduce_scatter");
	if (equal_counts(counts, n->size)) {
		if (counts[0] > 0)
			NC(n, ncclReduceScatter(send, recv, (size_t)counts[0],
						NC_FLOAT32, NC_SUM, n->comm,
						n->stream));
		return EPJ_OK;
	}
	/* uneven blocks: block p reduced onto rank p */
	NC(n, ncclGroupStart());
	epj_status st = EPJ_OK;
	size_t off = 0;
	for (int p = 0; p < n->size && st == EPJ_OK; p++) {
		if (counts[p] > 0) {
			nc_result r = n->l->ncclReduce(
			    send + off, p == n->rank ? recv : NULL,
			    (size_t)counts[p], NC_FLOAT32, NC_SUM, p, n->comm,
			    n->stream);
			if (r != NC_SUCCESS)
				st = nc_fail(n, r,
					     "ncclReduce(send + off, ..., "
					     "counts[p], NC_FLOAT32, NC_SUM, "
					     "p, n->comm, n->stream)",
					     __FILE__, __LINE__);
		}
		off += (size_t)counts[p];
	}
	return group_end(n, st);
}

static epj_status nccl_allgather(void *self, const void *send, void *recv,
				 const int64_t *counts, size_t row)
{
	nccl_comm *n = self;
	if (!counts)
		return bad(n, "no counts", "all_gather");
	for (int p = 0; p < n->size; p++)
		if (counts[p] < 0)
			return bad(n, "negative count", "all_gather");
	if (equal_counts(counts, n->size)) {
		if (counts[0] > 0)
			NC(n, ncclAllGather(send, recv, (size_t)counts[0] * row,
					    NC_INT8, n->comm, n->stream));
		return EPJ_OK;
	}
	/* uneven parts: rank p broadcasts its rows into their place */
	NC(n, ncclGroupStart());
	epj_status st = EPJ_OK;
	size_t off = 0;
	for (int p = 0; p < n->size && st == EPJ_OK; p++) {
		size_t b = (size_t)counts[p] * row;
		if (b) {
			nc_result r = n->l->ncclBroadcast(
			    p == n->rank ? send : NULL, (char *)recv + off, b,
			    NC_INT8, p, n->comm, n->stream);
			if (r != NC_SUCCESS)
				st = nc_fail(n, r,
					     "ncclBroadcast(send, (char *)recv "
					     "+ off, b, NC_INT8, p, n->comm, "
					     "n->stream)",
					     __FILE__, __LINE__);
		}
		off += b;
	}
	return group_end(n, st);
}

static epj_status nccl_bcast(void *self, void *buf, size_t bytes, int root)
{
	nccl_comm *n = self;
	if (root < 0 || root >= n->size)
		return bad(n, "root out of range", "broadcast");
	if (bytes)
		NC(n, ncclBroadcast(buf, buf, bytes, NC_INT8, root, n->comm,
				    n->stream));
	return EPJ_OK;
}

static epj_status nccl_a2a_i64_start(void *self, const int64_t *send,
				     int64_t *recv, int n_per,
				     ej_comm_req **req)
{
	nccl_comm *n = self;
	if (!n->boot->all_to_all_i64_start) {
		snprintf(n->err, sizeof n->err,
			 "nccl: the bootstrap comm '%s' has no non-blocking "
			 "exchange",
			 n->boot->name);
		return EPJ_ERR_UNSUPPORTED;
	}
	return n->boot->all_to_all_i64_start(n->boot->self, send, recv, n_per,
					     req);
}

static epj_status nccl_wait(void *self, ej_comm_req *req)
{
	nccl_comm *n = self;
	return n->boot->wait ? n->boot->wait(n->boot->self, req)
			     : EPJ_ERR_UNSUPPORTED;
}

static const char *nccl_error(void *self)
{
	nccl_comm *n = self;
	if (n->err[0])
		return n->err;
	/* a failure of a member delegated to the bootstrap comm */
	return n->boot->error ? n->boot->error(n->boot->self) : "";
}

static void nccl_destroy(void *self)
{
	nccl_comm *n = self;
	if (n->comm)
		n->l->ncclCommDestroy(n->comm);
	if (n->ready)
		n->d->cuEventDestroy(n->ready);
	if (n->done)
		n->d->cuEventDestroy(n->done);
	if (n->own_boot)
		ej_comm_free(n->boot);
	free(n);
}

static ej_comm *wrap(nccl_comm *n, const char *group)
{
	ej_comm *c = calloc(1, sizeof *c);
	if (!c)
		return NULL;
	c->name = "nccl";
	c->group = group;
	c->rank = n->rank;
	c->size = n->size;
	c->self = n;
	c->all_to_all_v = nccl_a2av;
	c->all_to_all_v_start = nccl_a2av_start;
	c->all_to_all_v_wait = nccl_a2av_wait;
	c->all_to_all_i64 = nccl_a2a_i64;
	c->all_reduce_f32 = nccl_allreduce;
	c->barrier = nccl_barrier;
	c->destroy = nccl_destroy;
	c->reduce_scatter_f32 = nccl_reduce_scatter;
	c->all_gather_v = nccl_allgather;
	c->broadcast = nccl_bcast;
	c->all_to_all_i64_start = nccl_a2a_i64_start;
	c->wait = nccl_wait;
	c->error = nccl_error;
	return c;
}

static ej_comm *nccl_split(void *self, int color, int key, const char *group)
{
	nccl_comm *n = self;
	if (!n->l->ncclCommSplit) {
		snprintf(n->err, sizeof n->err,
			 "nccl: split: %.400s has no ncclCommSplit (NCCL 2.18 "
			 "or newer)",
			 n->l->path);
		return NULL;
	}
	if (!n->boot->split) {
		snprintf(n->err, sizeof n->err,
			 "nccl: split: the bootstrap comm '%s' cannot split",
			 n->boot->name);
		return NULL;
	}
	nccl_comm *s = calloc(1, sizeof *s);
	if (!s)
		return NULL;
	*s = (nccl_comm){ .l = n->l,
			  .dev = n->dev,
			  .stream = n->stream,
			  .d = n->d,
			  .cstream = n->cstream };
	/* both sides are collective over this comm's ranks, in this order */
	s->boot = n->boot->split(n->boot->self, color, key, group);
	nc_result r = n->l->ncclCommSplit(n->comm, color, key, &s->comm, NULL);
	if (r != NC_SUCCESS || !s->boot) {
		if (r != NC_SUCCESS)
			nc_fail(n, r,
				"ncclCommSplit(n->comm, color, key, &s->comm, "
				"NULL)",
				__FILE__, __LINE__);
		else
			snprintf(n->err, sizeof n->err,
				 "nccl: split: splitting the bootstrap comm "
				 "'%s' failed",
				 n->boot->name);
		if (s->comm)
			n->l->ncclCommDestroy(s->comm);
		ej_comm_free(s->boot);
		free(s);
		return NULL;
	}
	s->own_boot = true;
	s->rank = s->boot->rank;
	s->size = s->boot->size;
	ej_comm *c = wrap(s, group);
	if (!c) {
		nccl_destroy(s);
		return NULL;
	}
	c->split = nccl_split;
	return c;
}

epj_status ej_comm_nccl_new(epj_ctx *ctx, ej_comm *boot, ej_cuda_dev *dev,
			    ej_comm **out)
{
	*out = NULL;
	const nc_lib *l = lib_get(ctx);
	if (!l)
		return epj_ctx_status(ctx);
	nccl_comm *n = calloc(1, sizeof *n);
	if (!n)
		return ej_error(ctx, EPJ_ERR_NOMEM, "nccl: out of memory");
	*n = (nccl_comm){ .l = l,
			  .dev = dev,
			  .stream = ej_cuda_compute_stream(dev),
			  .d = ej_cuda_driver_get(ctx),
			  .cstream = ej_cuda_comm_stream(dev),
			  .boot = boot,
			  .rank = boot->rank,
			  .size = boot->size };
	/* the unique id: made by rank 0, sent to the others over the
	 * bootstrap comm (a world of one sends nothing) */
	nc_id id;
	memset(&id, 0, sizeof id);
	epj_status st = EPJ_OK;
	if (n->rank == 0) {
		nc_result r = l->ncclGetUniqueId(&id);
		if (r != NC_SUCCESS)
			st = nc_fail(n, r, "ncclGetUniqueId(&id)", __FILE__,
				     __LINE__);
	}
	/* every rank joins the broadcast, also after a failure on rank 0
	 * (the others would wait for it): rank 0 then sends an all-zero id
	 * and returns its error; the others get theirs from
	 * ncclCommInitRank on an id that names no rank 0 */
	if (boot->size > 1) {
		epj_status bs = ej_comm_bcast(ctx, boot, "nccl.unique_id", &id,
					      sizeof id, 0);
		if (st == EPJ_OK && bs != EPJ_OK) {
			ej_error_prefix(ctx,
					"nccl: sending the unique id over "
					"comm '%s'",
					boot->name);
			free(n);
			return bs;
		}
	}
	if (st == EPJ_OK) {
		nc_result r =
		    l->ncclCommInitRank(&n->comm, n->size, id, n->rank);
		if (r != NC_SUCCESS)
			st = nc_fail(n, r,
				     "ncclCommInitRank(&n->comm, n->size, id, "
				     "n->rank)",
				     __FILE__, __LINE__);
	}
	if (st != EPJ_OK) {
		ej_error(ctx, st, "%s (rank %d of %d, NCCL %s)", n->err,
			 n->rank, n->size, l->path);
		free(n);
		return st;
	}
	ej_comm *c = wrap(n, boot->group ? boot->group : "world");
	if (!c) {
		nccl_destroy(n);
		return ej_error(ctx, EPJ_ERR_NOMEM, "nccl: out of memory");
	}
	c->split = nccl_split;
	*out = c;
	return EPJ_OK;
}
