/* comm_mpi.c -- the `mpi` collective backend (Open MPI), CPU ranks.
 *
 * Every collective is posted non-blocking (MPI_Ialltoallv, MPI_Iallreduce,
 * ...) and completed by polling MPI_Test against a deadline of
 * comm.timeout_s seconds (ej_comm_set_timeout), so a peer that stopped or
 * died makes the call fail with a message naming the call, the group and
 * the rank instead of hanging.  The library never aborts the job: after a
 * timeout the comm is marked broken (its posted request may still reference
 * the caller's buffers), every later call fails at once, and the trainer
 * exits non-zero, which makes the launcher end the other ranks.
 *
 * Every MPI call goes through one check (MPI_TRY and its forms MPI_TRY_M,
 * MPI_CK): on failure the message holds the statement text, file:line and
 * MPI_Error_string, and for a comm its rank and group.  Communicators use
 * MPI_ERRORS_RETURN.  Rows of any byte size travel as a contiguous derived
 * datatype of `row` bytes; counts and displacements (in rows) must fit in an
 * int, checked before posting.
 *
 * MPI is initialised by ej_mpi_init (from epj_dist_init, called by the
 * trainer) only when the process was started by an MPI launcher; a plain
 * run stays `self`.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif
#include "runtime_impl.h"

#include <stdlib.h>
#include <string.h>

#ifdef HAVE_MPI
#include <limits.h>
#include <mpi.h>
#include <time.h>
#endif

static const char *launcher_var(void)
{
	static const char *const vars[] = { "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
					    "PMIX_RANK" };
	for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
		if (getenv(vars[i]))
			return vars[i];
	return NULL;
}

#ifndef HAVE_MPI

epj_status ej_mpi_init(char *err, size_t n, bool *started)
{
	*started = false;
	const char *v = launcher_var();
	if (!v)
		return EPJ_OK;
	if (err && n)
		snprintf(err, n,
			 "started by an MPI launcher (%s=%s) but this epjit "
			 "was built without MPI: reconfigure with --with-mpi "
			 "(apt-get install openmpi-bin libopenmpi-dev)",
			 v, getenv(v));
	return EPJ_ERR_UNSUPPORTED;
}

void ej_mpi_finalize(void)
{
}

ej_comm *ej_comm_mpi_world(void)
{
	return NULL;
}

void ej_comm_set_timeout(ej_comm *c, double timeout_s)
{
	(void)c;
	(void)timeout_s;
}

#else /* HAVE_MPI */

static double g_timeout_s = 300.0;

typedef struct mpi_comm {
	MPI_Comm comm;
	ej_comm *pub;
	bool broken; /* a call timed out: the comm is unusable */
	char err[640];
} mpi_comm;

struct ej_comm_req {
	MPI_Request r;
};

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char *grp(const mpi_comm *m)
{
	return m->pub->group ? m->pub->group : "world";
}

/* The one check of every MPI call: MPI_TRY(err, n, stmt) runs stmt and
 * returns EPJ_OK, or EPJ_ERR_BACKEND with "stmt at file:line:
 * MPI_Error_string" in err[n] (err may be NULL).  MPI_TRY_M writes into the
 * comm's message and adds its rank and group; MPI_CK returns on failure. */
static epj_status mpi_rc(int rc, const char *stmt, const char *file, int line,
			 char *err, size_t n)
{
	if (rc == MPI_SUCCESS)
		return EPJ_OK;
	char es[MPI_MAX_ERROR_STRING];
	int len = 0;
	if (MPI_Error_string(rc, es, &len) != MPI_SUCCESS)
		snprintf(es, sizeof es, "MPI error %d", rc);
	if (err && n)
		snprintf(err, n, "%s at %s:%d: %s", stmt, file, line, es);
	return EPJ_ERR_BACKEND;
}

#define MPI_TRY(err, n, stmt) mpi_rc((stmt), #stmt, __FILE__, __LINE__, err, n)

static epj_status with_rank(mpi_comm *m, epj_status s)
{
	if (s != EPJ_OK) {
		size_t k = strlen(m->err);
		snprintf(m->err + k, sizeof m->err - k,
			 " (rank %d of %d, group %s)", m->pub->rank,
			 m->pub->size, grp(m));
	}
	return s;
}

#define MPI_TRY_M(m, stmt)                                                     \
	with_rank((m), MPI_TRY((m)->err, sizeof(m)->err, stmt))

#define MPI_CK(m, stmt)                                                        \
	do {                                                                   \
		epj_status s_ = MPI_TRY_M(m, stmt);                            \
		if (s_ != EPJ_OK)                                              \
			return s_;                                             \
	} while (0)

static epj_status bad(mpi_comm *m, const char *fmt, const char *call,
		      long long v)
{
	snprintf(m->err, sizeof m->err, "%s: ", call);
	size_t k = strlen(m->err);
	snprintf(m->err + k, sizeof m->err - k, fmt, v);
	return EPJ_ERR_INVALID;
}

static epj_status usable(mpi_comm *m, const char *call)
{
	if (!m->broken)
		return EPJ_OK;
	snprintf(m->err, sizeof m->err,
		 "%s: the comm is broken by an earlier timeout or failure "
		 "(rank %d of %d, group %s)",
		 call, m->pub->rank, m->pub->size, grp(m));
	return EPJ_ERR_STATE;
}

/* Polls req until it completes or comm.timeout_s passes. */
static epj_status wait_req(mpi_comm *m, MPI_Request *req, const char *call)
{
	double deadline = now_s() + g_timeout_s;
	long polls = 0;
	for (;;) {
		int flag = 0;
		epj_status s =
		    MPI_TRY_M(m, MPI_Test(req, &flag, MPI_STATUS_IGNORE));
		if (s != EPJ_OK) {
			m->broken = true;
			return s;
		}
		if (flag)
			return EPJ_OK;
		if (++polls % 256 == 0 && now_s() > deadline) {
			m->broken = true;
			snprintf(m->err, sizeof m->err,
				 "%s did not complete within %g s "
				 "(comm.timeout_s) on rank %d of %d (group "
				 "%s): a peer rank stopped, died or is in "
				 "another call",
				 call, g_timeout_s, m->pub->rank, m->pub->size,
				 grp(m));
			return EPJ_ERR_BACKEND;
		}
		if (polls > 2000) {
			struct timespec ts = { 0, 50000 };
			nanosleep(&ts, NULL);
		}
	}
}

/* Per-rank int counts and displacements of rows, checked against INT_MAX. */
static epj_status int_plan(mpi_comm *m, const char *call, const int64_t *c,
			   int *cnt, int *dsp)
{
	int64_t off = 0;
	for (int p = 0; p < m->pub->size; p++) {
		if (c[p] < 0)
			return bad(m, "negative count %lld", call,
				   (long long)c[p]);
		if (c[p] > INT_MAX || off > INT_MAX)
			return bad(m,
				   "%lld rows exceed what one MPI call carries "
				   "(INT_MAX rows)",
				   call, (long long)(c[p] > off ? c[p] : off));
		cnt[p] = (int)c[p];
		dsp[p] = (int)off;
		off += c[p];
	}
	return EPJ_OK;
}

static epj_status row_type(mpi_comm *m, const char *call, size_t row,
			   MPI_Datatype *t)
{
	if (row == 0 || row > INT_MAX)
		return bad(m, "row size %lld bytes is not in [1, INT_MAX]",
			   call, (long long)row);
	MPI_CK(m, MPI_Type_contiguous((int)row, MPI_BYTE, t));
	MPI_CK(m, MPI_Type_commit(t));
	return EPJ_OK;
}

static epj_status mpi_a2av(void *self, const void *sendbuf,
			   const int64_t *send_counts, void *recvbuf,
			   const int64_t *recv_counts, size_t row)
{
	mpi_comm *m = self;
	const char *call = "MPI_Ialltoallv";
	epj_status s = usable(m, call);
	if (s != EPJ_OK)
		return s;
	int P = m->pub->size;
	int *buf = malloc(sizeof(int) * 4 * (size_t)P);
	if (!buf)
		return EPJ_ERR_NOMEM;
	int *sc = buf, *sd = buf + P, *rc = buf + 2 * P, *rd = buf + 3 * P;
	MPI_Datatype t = MPI_DATATYPE_NULL;
	static char dummy[1];
	if ((s = int_plan(m, call, send_counts, sc, sd)) == EPJ_OK &&
	    (s = int_plan(m, call, recv_counts, rc, rd)) == EPJ_OK &&
	    (s = row_type(m, call, row, &t)) == EPJ_OK) {
		const void *sp = sendbuf ? sendbuf : dummy;
		void *rp = recvbuf ? recvbuf : dummy;
		MPI_Request req;
		s = MPI_TRY_M(m, MPI_Ialltoallv(sp, sc, sd, t, rp, rc, rd, t,
						m->comm, &req));
		if (s == EPJ_OK)
			s = wait_req(m, &req, call);
	}
	if (t != MPI_DATATYPE_NULL)
		(void)MPI_TRY(NULL, 0, MPI_Type_free(&t));
	free(buf);
	return s;
}

static epj_status mpi_a2a_i64_start(void *self, const int64_t *send,
				    int64_t *recv, int n_per, ej_comm_req **req)
{
	mpi_comm *m = self;
	*req = NULL;
	epj_status s = usable(m, "MPI_Ialltoall");
	if (s != EPJ_OK)
		return s;
	ej_comm_req *r = malloc(sizeof *r);
	if (!r)
		return EPJ_ERR_NOMEM;
	s = MPI_TRY_M(m, MPI_Ialltoall(send, n_per, MPI_INT64_T, recv, n_per,
				       MPI_INT64_T, m->comm, &r->r));
	if (s != EPJ_OK) {
		free(r);
		return s;
	}
	*req = r;
	return EPJ_OK;
}

static epj_status mpi_wait(void *self, ej_comm_req *req)
{
	mpi_comm *m = self;
	if (!req)
		return bad(m, "%lld: no request", "wait", 0);
	epj_status s = wait_req(m, &req->r, "MPI_Ialltoall (split plan)");
	free(req); /* a timed-out request is abandoned with the comm */
	return s;
}

static epj_status mpi_a2a_i64(void *self, const int64_t *send, int64_t *recv)
{
	ej_comm_req *r = NULL;
	epj_status s = mpi_a2a_i64_start(self, send, recv, 1, &r);
	return s == EPJ_OK ? mpi_wait(self, r) : s;
}

static epj_status mpi_allreduce(void *self, float *buf, int64_t n)
{
	mpi_comm *m = self;
	const char *call = "MPI_Iallreduce";
	epj_status s = usable(m, call);
	if (s != EPJ_OK)
		return s;
	if (n < 0 || n > INT_MAX)
		return bad(m, "%lld elements are not in [0, INT_MAX]", call,
			   (long long)n);
	if (n == 0)
		return EPJ_OK;
	MPI_Request req;
	MPI_CK(m, MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM,
				 m->comm, &req));
	return wait_req(m, &req, call);
}

static epj_status mpi_reduce_scatter(void *self, const float *send, float *recv,
				     const int64_t *counts)
{
	mpi_comm *m = self;
	const char *call = "MPI_Ireduce_scatter";
	epj_status s = usable(m, call);
	if (s != EPJ_OK)
		return s;
	int P = m->pub->size;
	int *buf = malloc(sizeof(int) * 2 * (size_t)P);
	if (!buf)
		return EPJ_ERR_NOMEM;
	static float dummy[1];
	if ((s = int_plan(m, call, counts, buf, buf + P)) == EPJ_OK) {
		const float *sp = send ? send : dummy;
		float *rp = recv ? recv : dummy;
		MPI_Request req;
		s = MPI_TRY_M(m, MPI_Ireduce_scatter(sp, rp, buf, MPI_FLOAT,
						     MPI_SUM, m->comm, &req));
		if (s == EPJ_OK)
			s = wait_req(m, &req, call);
	}
	free(buf);
	return s;
}

static epj_status mpi_allgather(void *self, const void *send, void *recv,
				const int64_t *counts, size_t row)
{
	mpi_comm *m = self;
	const char *call = "MPI_Iallgatherv";
	epj_status s = usable(m, call);
	if (s != EPJ_OK)
		return s;
	int P = m->pub->size;
	int *buf = malloc(sizeof(int) * 2 * (size_t)P);
	if (!buf)
		return EPJ_ERR_NOMEM;
	MPI_Datatype t = MPI_DATATYPE_NULL;
	static char dummy[1];
	if ((s = int_plan(m, call, counts, buf, buf + P)) == EPJ_OK &&
	    (s = row_type(m, call, row, &t)) == EPJ_OK) {
		const void *sp = send ? send : dummy;
		void *rp = recv ? recv : dummy;
		int mine = buf[m->pub->rank];
		MPI_Request req;
		s = MPI_TRY_M(m, MPI_Iallgatherv(sp, mine, t, rp, buf, buf + P,
						 t, m->comm, &req));
		if (s == EPJ_OK)
			s = wait_req(m, &req, call);
	}
	if (t != MPI_DATATYPE_NULL)
		(void)MPI_TRY(NULL, 0, MPI_Type_free(&t));
	free(buf);
	return s;
}

static epj_status mpi_bcast(void *self, void *b, size_t bytes, int root)
{
	mpi_comm *m = self;
	const char *call = "MPI_Ibcast";
	epj_status s = usable(m, call);
	if (s != EPJ_OK)
		return s;
	if (bytes > INT_MAX)
		return bad(m, "%lld bytes exceed INT_MAX", call,
			   (long long)bytes);
	if (root < 0 || root >= m->pub->size)
		return bad(m, "root %lld is not a rank of the group", call,
			   root);
	MPI_Request req;
	MPI_CK(m, MPI_Ibcast(b, (int)bytes, MPI_BYTE, root, m->comm, &req));
	return wait_req(m, &req, call);
}

static epj_status mpi_barrier(void *self)
{
	mpi_comm *m = self;
	epj_status s = usable(m, "MPI_Ibarrier");
	if (s != EPJ_OK)
		return s;
	MPI_Request req;
	MPI_CK(m, MPI_Ibarrier(m->comm, &req));
	return wait_req(m, &req, "MPI_Ibarrier");
}

static const char *mpi_error(void *self)
{
	mpi_comm *m = self;
	return m->err[0] ? m->err : "no MPI error recorded";
}

static void mpi_destroy(void *self)
{
	mpi_comm *m = self;
	if (!m)
		return;
	int fin = 0;
	if (MPI_TRY(NULL, 0, MPI_Finalized(&fin)) == EPJ_OK && !fin &&
	    !m->broken && m->comm != MPI_COMM_WORLD && m->comm != MPI_COMM_NULL)
		(void)MPI_TRY(NULL, 0, MPI_Comm_free(&m->comm));
	free(m);
}

static ej_comm *wrap(MPI_Comm comm, const char *group, char *err, size_t n);

static ej_comm *mpi_split(void *self, int color, int key, const char *group)
{
	mpi_comm *m = self;
	if (usable(m, "MPI_Comm_split") != EPJ_OK)
		return NULL;
	MPI_Comm nc = MPI_COMM_NULL;
	if (MPI_TRY_M(m, MPI_Comm_split(m->comm, color, key, &nc)) != EPJ_OK)
		return NULL;
	ej_comm *c = NULL;
	if (MPI_TRY_M(m, MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN)) ==
	    EPJ_OK) {
		c = wrap(nc, group, m->err, sizeof m->err);
		if (!c)
			with_rank(m, EPJ_ERR_BACKEND);
	}
	if (!c)
		(void)MPI_TRY(NULL, 0, MPI_Comm_free(&nc));
	return c;
}

/* A comm over comm (owned from now on when it is not the world); NULL with
 * the reason in err[n]. */
static ej_comm *wrap(MPI_Comm comm, const char *group, char *err, size_t n)
{
	int rank = 0, size = 1;
	if (MPI_TRY(err, n, MPI_Comm_rank(comm, &rank)) != EPJ_OK ||
	    MPI_TRY(err, n, MPI_Comm_size(comm, &size)) != EPJ_OK)
		return NULL;
	ej_comm *c = calloc(1, sizeof *c);
	mpi_comm *m = calloc(1, sizeof *m);
	if (!c || !m) {
		free(c);
		free(m);
		if (err && n)
			snprintf(err, n, "out of memory");
		return NULL;
	}
	m->comm = comm;
	m->pub = c;
	c->name = "mpi";
	c->group = group;
	c->rank = rank;
	c->size = size;
	c->self = m;
	c->all_to_all_v = mpi_a2av;
	c->all_to_all_i64 = mpi_a2a_i64;
	c->all_reduce_f32 = mpi_allreduce;
	c->barrier = mpi_barrier;
	c->destroy = mpi_destroy;
	c->reduce_scatter_f32 = mpi_reduce_scatter;
	c->all_gather_v = mpi_allgather;
	c->broadcast = mpi_bcast;
	c->all_to_all_i64_start = mpi_a2a_i64_start;
	c->wait = mpi_wait;
	c->split = mpi_split;
	c->error = mpi_error;
	return c;
}

ej_comm *ej_comm_mpi_world(void)
{
	int init = 0;
	if (MPI_TRY(NULL, 0, MPI_Initialized(&init)) != EPJ_OK || !init)
		return NULL;
	return wrap(MPI_COMM_WORLD, "world", NULL, 0);
}

void ej_comm_set_timeout(ej_comm *c, double timeout_s)
{
	(void)c; /* one deadline for every MPI comm of the process */
	if (timeout_s > 0)
		g_timeout_s = timeout_s;
}

epj_status ej_mpi_init(char *err, size_t n, bool *started)
{
	*started = false;
	const char *v = launcher_var();
	if (!v)
		return EPJ_OK;
	int init = 0, provided = 0;
	epj_status s = MPI_TRY(err, n, MPI_Initialized(&init));
	if (s == EPJ_OK && !init)
		s = MPI_TRY(err, n,
			    MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED,
					    &provided));
	if (s == EPJ_OK)
		s = MPI_TRY(
		    err, n,
		    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
	if (s != EPJ_OK) {
		if (err && n) {
			size_t k = strlen(err);
			snprintf(err + k, n - k,
				 " (started by a launcher: %s=%s)", v,
				 getenv(v));
		}
		return s;
	}
	*started = true;
	return EPJ_OK;
}

void ej_mpi_finalize(void)
{
	int fin = 0;
	if (MPI_TRY(NULL, 0, MPI_Finalized(&fin)) == EPJ_OK && !fin)
		(void)MPI_TRY(NULL, 0, MPI_Finalize());
}

#endif /* HAVE_MPI */
