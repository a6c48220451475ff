/* check_nccl.c -- the `nccl` comm (runtime/comm_nccl.c) and the choice of
 * the comm for device buffers (comm.backend, ej_comm_device_select) on
 * machines without a GPU.
 *
 * The cuda device runs on t/fake_cuda.c and NCCL on t/fake_nccl.c, a
 * one-process stand-in (communicators of one rank, NCCL's rules for
 * unique ids, groups and point-to-point to self).  A world of one is
 * bootstrapped over the `self` comm, without MPI.
 *
 *  - absence: a missing or disabled libnccl is a clear EPJ_ERR_UNSUPPORTED;
 *    "auto" falls back to the host comm, "nccl" fails and says why;
 *  - the bootstrap: one ncclGetUniqueId, ncclCommInitRank(1, id, 0);
 *  - every collective on fresh random device buffers, its results and the
 *    NCCL calls made (one send and one receive per peer in a group), on the
 *    cuda device's compute stream; host-buffer members go to the bootstrap
 *    comm; split;
 *  - errors carry the call, file:line and ncclGetErrorString (and
 *    ncclGetLastError), through comm.c's wrappers; a failure inside a group
 *    still ends it;
 *  - the all-to-all off the compute stream: on the communication stream
 *    between events; the stand-in driver refuses a copy that touches its
 *    buffers before the compute stream waited for it;
 *  - comm.backend: refused off the cuda device, EPJIT_COMM overrides it,
 *    and the engine applies it at initialize.
 */
#include "check_util.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cuda_driver.h"
#include "runtime_impl.h"

extern void ej_cuda_test_reset(void);
extern void ej_nccl_test_reset(void);

typedef struct fake_nccl_stats {
	long long unique_ids, inits, destroys, all_reduces, broadcasts, reduces,
	    all_gathers, reduce_scatters, sends, recvs, groups;
	long long bytes_moved;
	void *last_stream;
	int last_nranks, last_rank;
} fake_nccl_stats;

static void (*nccl_stats_get)(fake_nccl_stats *);

static fake_nccl_stats nstats(void)
{
	fake_nccl_stats s;
	nccl_stats_get(&s);
	return s;
}

static char *lib_path(const char *name, char *buf, size_t n)
{
	const char *b = getenv("top_builddir");
	snprintf(buf, n, "%s/t/.libs/%s", b ? b : ".", name);
	struct stat st;
	return stat(buf, &st) == 0 ? buf : NULL;
}

static void fresh(void)
{
	ej_cuda_test_reset();
	ej_nccl_test_reset();
	unsetenv("EPJIT_COMM");
	unsetenv("FAKE_NCCL_FAIL");
}

/* The stand-ins in place; false (the test returns) when not built. */
static bool use_fakes(void)
{
	char cu[4096], nc[4096];
	if (!lib_path("libfakecuda.so", cu, sizeof cu) ||
	    !lib_path("libfakenccl.so", nc, sizeof nc)) {
		fprintf(stderr, "check_nccl: stand-in libraries missing: "
				"cases skipped\n");
		return false;
	}
	setenv("EPJIT_CUDA_DRIVER", cu, 1);
	setenv("EPJIT_NCCL", nc, 1);
	void *h = dlopen(nc, RTLD_NOW | RTLD_LOCAL);
	ck_assert_msg(h, "dlopen %s: %s", nc, dlerror());
	void *p = dlsym(h, "fake_nccl_stats_get");
	memcpy(&nccl_stats_get, &p, sizeof p);
	ck_assert(nccl_stats_get);
	return true;
}

static void unset_all(void)
{
	unsetenv("EPJIT_CUDA_DRIVER");
	unsetenv("EPJIT_NCCL");
	unsetenv("EPJIT_COMM");
	unsetenv("FAKE_NCCL_FAIL");
}

/* ---- absence ------------------------------------------------------------- */

START_TEST(test_nccl_absent)
{
	fresh();
	epj_ctx *ctx = tu_ctx();
	setenv("EPJIT_NCCL", _i ? "0" : "/nonexistent/epjit/libnccl.so.2", 1);
	ck_assert(!ej_nccl_available(ctx));
	const char *want = _i ? "NCCL disabled (EPJIT_NCCL=0)"
			      : "no NCCL (/nonexistent/epjit/libnccl.so.2 not "
				"found: ";
	ck_assert_msg(strstr(epj_ctx_error(ctx), want) == epj_ctx_error(ctx),
		      "%s", epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
	ej_comm *boot = ej_comm_self_new(), *c = boot;
	ck_assert_int_eq(ej_comm_nccl_new(ctx, boot, NULL, &c),
			 EPJ_ERR_UNSUPPORTED);
	ck_assert_ptr_null(c);
	ck_assert(strstr(epj_ctx_error(ctx), want));
	/* "auto" on the cuda device: the host comm, no error */
	epj_ctx_clear_error(ctx);
	c = boot;
	ck_assert_int_eq(ej_comm_device_select(ctx, "auto", "cuda", boot, &c),
			 EPJ_OK);
	ck_assert_ptr_null(c);
	/* "nccl" asked for: the reason, and what asked */
	c = boot;
	ck_assert_int_eq(ej_comm_device_select(ctx, "nccl", "cuda", boot, &c),
			 EPJ_ERR_UNSUPPORTED);
	ck_assert_ptr_null(c);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "comm.backend=\"nccl\"") && strstr(msg, want),
		      "%s", msg);
	ej_comm_free(boot);
	unset_all();
	epj_ctx_free(ctx);
}
END_TEST

/* ---- a world of one ------------------------------------------------------ */

typedef struct nenv {
	epj_ctx *ctx;
	ej_cuda_dev *dev;
	const ej_device *vt;
	ej_allocator *a;
	ej_comm *boot, *c;
} nenv;

static bool nenv_open(nenv *e)
{
	memset(e, 0, sizeof *e);
	fresh();
	if (!use_fakes())
		return false;
	e->ctx = tu_ctx();
	ck_assert_msg(ej_cuda_open(e->ctx, &e->dev) == EPJ_OK, "%s",
		      epj_ctx_error(e->ctx));
	e->vt = ej_cuda_device(e->dev);
	e->a = ej_allocator_new(e->vt);
	e->boot = ej_comm_self_new();
	return true;
}

static void nenv_close(nenv *e)
{
	ej_comm_free(e->c);
	ej_comm_free(e->boot);
	ej_allocator_free(e->a);
	epj_ctx_free(e->ctx);
	unset_all();
}

/* n random bytes on the device; *host keeps them */
static void *dev_random(nenv *e, size_t n, unsigned char **host)
{
	*host = malloc(n ? n : 1);
	for (size_t i = 0; i < n; i++)
		(*host)[i] = (unsigned char)tu_randint(0, 256);
	void *p = ej_alloc(e->a, n ? n : 1);
	ck_assert_ptr_nonnull(p);
	e->vt->copy(e->vt->self, p, *host, n);
	return p;
}

static void dev_expect(nenv *e, const void *dev, const unsigned char *want,
		       size_t n, const char *what)
{
	unsigned char *back = malloc(n ? n : 1);
	e->vt->copy(e->vt->self, back, dev, n);
	ck_assert_msg(memcmp(back, want, n) == 0, "%s: %zu bytes differ", what,
		      n);
	free(back);
}

START_TEST(test_nccl_world1)
{
	nenv e;
	if (!nenv_open(&e))
		return;
	fake_nccl_stats s0 = nstats();
	ck_assert_msg(ej_comm_nccl_new(e.ctx, e.boot, e.dev, &e.c) == EPJ_OK,
		      "%s", epj_ctx_error(e.ctx));
	fake_nccl_stats s1 = nstats();
	ck_assert_str_eq(e.c->name, "nccl");
	ck_assert_int_eq(e.c->size, 1);
	ck_assert_int_eq(e.c->rank, 0);
	ck_assert_int_eq(s1.unique_ids, s0.unique_ids + 1);
	ck_assert_int_eq(s1.inits, s0.inits + 1);
	ck_assert_int_eq(s1.last_nranks, 1);
	ck_assert_int_eq(s1.last_rank, 0);
	void *stream = ej_cuda_compute_stream(e.dev);

	/* all-to-all-v: rows of an odd byte size to ourselves, through the
	 * checked wrapper (counters) */
	size_t row = (size_t)tu_randint(1, 40) | 1;
	int64_t rows = tu_randint(1, 200);
	unsigned char *h_send, *h_junk;
	void *send = dev_random(&e, rows * row, &h_send);
	void *recv = dev_random(&e, rows * row, &h_junk);
	ck_assert_msg(ej_comm_a2av(e.ctx, e.c, "test.a2av", send, &rows, recv,
				   &rows, row) == EPJ_OK,
		      "%s", epj_ctx_error(e.ctx));
	fake_nccl_stats s2 = nstats();
	ck_assert_int_eq(s2.sends, s1.sends + 1);
	ck_assert_int_eq(s2.recvs, s1.recvs + 1);
	ck_assert_int_eq(s2.groups, s1.groups + 1);
	ck_assert_ptr_eq(s2.last_stream, stream);
	ej_cuda_sync(e.ctx, e.dev);
	dev_expect(&e, recv, h_send, rows * row, "all_to_all_v");
	ck_assert_int_eq(epj_counter_get(e.ctx, "comm.calls"), 1);
	/* an empty exchange makes no NCCL transfer */
	int64_t zero = 0;
	ck_assert_int_eq(ej_comm_a2av(e.ctx, e.c, "test.a2av", send, &zero,
				      recv, &zero, row),
			 EPJ_OK);
	ck_assert_int_eq(nstats().sends, s2.sends);

	/* all-reduce in place: the sum over one rank */
	int64_t nf = tu_randint(1, 300);
	unsigned char *h_f;
	float *buf = dev_random(&e, 4 * (size_t)nf, &h_f);
	ck_assert_int_eq(e.c->all_reduce_f32(e.c->self, buf, nf), EPJ_OK);
	ck_assert_int_eq(nstats().all_reduces, s2.all_reduces + 1);
	dev_expect(&e, buf, h_f, 4 * (size_t)nf, "all_reduce");

	/* all-gather, reduce-scatter, broadcast */
	int64_t cnt = rows;
	unsigned char *h_g;
	void *g = dev_random(&e, rows * row, &h_g);
	ck_assert_int_eq(
	    ej_comm_allgather(e.ctx, e.c, "test.ag", send, g, &cnt, row),
	    EPJ_OK);
	ck_assert_int_eq(nstats().all_gathers, s2.all_gathers + 1);
	dev_expect(&e, g, h_send, rows * row, "all_gather");
	unsigned char *h_rs;
	float *rs = dev_random(&e, 4 * (size_t)nf, &h_rs);
	ck_assert_int_eq(
	    ej_comm_reduce_scatter(e.ctx, e.c, "test.rs", buf, rs, &nf),
	    EPJ_OK);
	ck_assert_int_eq(nstats().reduce_scatters, s2.reduce_scatters + 1);
	dev_expect(&e, rs, h_f, 4 * (size_t)nf, "reduce_scatter");
	ck_assert_int_eq(
	    ej_comm_bcast(e.ctx, e.c, "test.bcast", g, rows * row, 0), EPJ_OK);
	ck_assert_int_eq(nstats().broadcasts, s2.broadcasts + 1);
	dev_expect(&e, g, h_send, rows * row, "broadcast");
	ck_assert_int_eq(
	    ej_comm_bcast(e.ctx, e.c, "test.bcast", g, rows * row, 1),
	    EPJ_ERR_INVALID);
	ck_assert_msg(strstr(epj_ctx_error(e.ctx), "root out of range"), "%s",
		      epj_ctx_error(e.ctx));
	epj_ctx_clear_error(e.ctx);

	/* host-buffer members: the bootstrap comm, no NCCL call */
	fake_nccl_stats s3 = nstats();
	int64_t plan = tu_randint(0, 1000), got = -1;
	ck_assert_int_eq(ej_comm_a2a_i64(e.ctx, e.c, "test.plan", &plan, &got),
			 EPJ_OK);
	ck_assert_int_eq(got, plan);
	ej_comm_req *req = NULL;
	got = -1;
	ck_assert_int_eq(ej_comm_a2a_i64_start(e.ctx, e.c, "test.plan", &plan,
					       &got, 1, &req),
			 EPJ_OK);
	ck_assert_int_eq(ej_comm_wait(e.ctx, e.c, "test.plan", req), EPJ_OK);
	ck_assert_int_eq(got, plan);
	ck_assert_int_eq(ej_comm_barrier_c(e.ctx, e.c, "test.barrier"), EPJ_OK);
	fake_nccl_stats s4 = nstats();
	ck_assert_int_eq(s4.sends + s4.all_reduces + s4.broadcasts,
			 s3.sends + s3.all_reduces + s3.broadcasts);

	/* a split: another nccl comm of one, which works */
	ej_comm *ep = e.c->split(e.c->self, 0, 0, "ep");
	ck_assert_msg(ep, "%s", e.c->error(e.c->self));
	ck_assert_str_eq(ep->name, "nccl");
	ck_assert_str_eq(ep->group, "ep");
	ck_assert_int_eq(ep->size, 1);
	unsigned char *h_r2;
	void *r2 = dev_random(&e, rows * row, &h_r2);
	ck_assert_int_eq(
	    ej_comm_a2av(e.ctx, ep, "test.ep", send, &rows, r2, &rows, row),
	    EPJ_OK);
	dev_expect(&e, r2, h_send, rows * row, "split all_to_all_v");
	ej_comm_free(ep);

	long long destroys = nstats().destroys;
	ej_comm_free(e.c);
	e.c = NULL;
	ck_assert_int_eq(nstats().destroys, destroys + 1);
	void *bufs[] = { send, recv, buf, g, rs, r2 };
	unsigned char *hs[] = { h_send, h_junk, h_f, h_g, h_rs, h_r2 };
	for (int i = 0; i < 6; i++) {
		ej_dealloc(e.a, bufs[i]);
		free(hs[i]);
	}
	nenv_close(&e);
}
END_TEST

/* The all-to-all off the compute stream: all_to_all_v_start runs the
 * exchange on the communication stream, after the compute stream's writes
 * of the send buffer; a copy on the compute stream that reads the received
 * rows, or writes the send buffer, before all_to_all_v_wait is refused by
 * the stand-in driver's stream order check (as its result would be garbage
 * on a GPU); after the wait it runs, and the rows are right. */
START_TEST(test_nccl_stream_order)
{
	nenv e;
	if (!nenv_open(&e))
		return;
	ck_assert_msg(ej_comm_nccl_new(e.ctx, e.boot, e.dev, &e.c) == EPJ_OK,
		      "%s", epj_ctx_error(e.ctx));
	size_t row = (size_t)tu_randint(1, 40) | 1;
	int64_t rows = tu_randint(1, 200);
	const size_t n = (size_t)rows * row;
	unsigned char *h_send, *h_junk, *h_out;
	void *send = dev_random(&e, n, &h_send);
	void *recv = dev_random(&e, n, &h_junk);
	void *out = dev_random(&e, n, &h_out);
	bool started = false;
	fake_nccl_stats s0 = nstats();
	ck_assert_msg(ej_comm_a2av_start(e.ctx, e.c, "test.a2av", send, &rows,
					 recv, &rows, row, &started) == EPJ_OK,
		      "%s", epj_ctx_error(e.ctx));
	ck_assert(started);
	fake_nccl_stats s1 = nstats();
	ck_assert_int_eq(s1.sends, s0.sends + 1);
	ck_assert_ptr_eq(s1.last_stream, ej_cuda_comm_stream(e.dev));
	ck_assert_ptr_ne(s1.last_stream, ej_cuda_compute_stream(e.dev));
	ck_assert_int_eq(epj_counter_get(e.ctx, "comm.a2av.started"), 1);
	/* one exchange in flight at a time */
	ck_assert_int_eq(ej_comm_a2av_start(e.ctx, e.c, "test.a2av", send,
					    &rows, recv, &rows, row, &started),
			 EPJ_ERR_INVALID);
	ck_assert_msg(strstr(epj_ctx_error(e.ctx), "in flight"), "%s",
		      epj_ctx_error(e.ctx));
	epj_ctx_clear_error(e.ctx);

	/* the missing wait: the compute stream reads the received rows, or
	 * overwrites the send buffer, while the exchange may still run */
	e.vt->copy(e.vt->self, out, recv, n);
	ck_assert_msg(
	    strstr(ej_cuda_last_error(e.dev), "CUDA_ERROR_ILLEGAL_STATE"),
	    "a read of the received rows before the wait was not "
	    "caught: '%s'",
	    ej_cuda_last_error(e.dev));
	e.vt->memzero(e.vt->self, send, n);
	ck_assert_msg(
	    strstr(ej_cuda_last_error(e.dev), "cuMemsetD8Async") &&
		strstr(ej_cuda_last_error(e.dev), "CUDA_ERROR_ILLEGAL_STATE"),
	    "a write of the send buffer before the wait was not "
	    "caught: '%s'",
	    ej_cuda_last_error(e.dev));

	/* the wait: the compute stream is ordered after the exchange, with no
	 * host synchronization */
	ej_dev_counters c0, c1;
	ej_cuda_counters(&c0);
	ck_assert_msg(ej_comm_a2av_wait(e.ctx, e.c, "test.a2av") == EPJ_OK,
		      "%s", epj_ctx_error(e.ctx));
	ej_cuda_counters(&c1);
	ck_assert_int_eq(c1.syncs, c0.syncs);
	ck_assert_int_eq(epj_counter_get(e.ctx, "comm.a2av.waits"), 1);
	ck_assert_int_eq(ej_comm_a2av_wait(e.ctx, e.c, "test.a2av"),
			 EPJ_ERR_INVALID); /* nothing in flight */
	epj_ctx_clear_error(e.ctx);
	e.vt->copy(e.vt->self, out, recv, n); /* device to device: no sync */
	dev_expect(&e, out, h_send, n, "rows read after the wait");
	/* the next exchange reads a send buffer the compute stream wrote
	 * after the last one: the ready event orders it */
	e.vt->copy(e.vt->self, send, h_junk, n);
	ck_assert_msg(ej_comm_a2av_start(e.ctx, e.c, "test.a2av", send, &rows,
					 recv, &rows, row, &started) == EPJ_OK,
		      "%s", epj_ctx_error(e.ctx));
	ck_assert_int_eq(ej_comm_a2av_wait(e.ctx, e.c, "test.a2av"), EPJ_OK);
	dev_expect(&e, recv, h_junk, n, "the second exchange");

	/* the census: the order in which the work reached the streams.  The
	 * exchange waits for the compute stream's event (c:R m:W), runs and
	 * records its own (m:N m:R); the compute stream's copy of other
	 * buffers is issued meanwhile (c:C), then the wait (c:W), then the
	 * copy that reads the received rows (c:C) */
	ej_cuda_stream_log_reset();
	ck_assert_int_eq(ej_comm_a2av_start(e.ctx, e.c, "test.a2av", send,
					    &rows, recv, &rows, row, &started),
			 EPJ_OK);
	e.vt->copy(e.vt->self, out, h_send, n); /* independent work */
	ck_assert_int_eq(ej_comm_a2av_wait(e.ctx, e.c, "test.a2av"), EPJ_OK);
	e.vt->copy(e.vt->self, out, recv, n);
	char log[256];
	ej_cuda_stream_log(log, sizeof log);
	ck_assert_str_eq(log, "c:R m:W m:N m:R c:C c:W c:C");
	ck_assert_uint_eq(ej_cuda_stream_log(NULL, 0), strlen(log));
	dev_expect(&e, out, h_junk, n, "the third exchange");

	void *bufs[] = { send, recv, out };
	unsigned char *hs[] = { h_send, h_junk, h_out };
	for (int i = 0; i < 3; i++) {
		ej_dealloc(e.a, bufs[i]);
		free(hs[i]);
	}
	nenv_close(&e);
}
END_TEST

/* Errors: the call, file:line, ncclGetErrorString, ncclGetLastError,
 * through the wrappers; a failure inside a group ends the group. */
START_TEST(test_nccl_errors)
{
	nenv e;
	if (!nenv_open(&e))
		return;
	/* the bootstrap fails */
	setenv("FAKE_NCCL_FAIL", "ncclCommInitRank", 1);
	ck_assert_int_eq(ej_comm_nccl_new(e.ctx, e.boot, e.dev, &e.c),
			 EPJ_ERR_BACKEND);
	ck_assert_ptr_null(e.c);
	const char *msg = epj_ctx_error(e.ctx);
	ck_assert_msg(strstr(msg, "ncclCommInitRank(") &&
			  strstr(msg, "comm_nccl.c:") &&
			  strstr(msg, "internal error - please report this "
				      "issue to the NCCL developers (3)") &&
			  strstr(msg, "rank 0 of 1"),
		      "%s", msg);
	unsetenv("FAKE_NCCL_FAIL");
	epj_ctx_clear_error(e.ctx);
	ck_assert_int_eq(ej_comm_nccl_new(e.ctx, e.boot, e.dev, &e.c), EPJ_OK);
	size_t row = 8;
	int64_t rows = tu_randint(2, 50);
	unsigned char *h_send, *h_recv;
	void *send = dev_random(&e, rows * row, &h_send);
	void *recv = dev_random(&e, rows * row, &h_recv);
	/* a failing send inside the group */
	setenv("FAKE_NCCL_FAIL", "ncclSend", 1);
	ck_assert_int_eq(ej_comm_a2av(e.ctx, e.c, "autoep.dispatch", send,
				      &rows, recv, &rows, row),
			 EPJ_ERR_BACKEND);
	msg = epj_ctx_error(e.ctx);
	ck_assert_msg(strstr(msg, "comm 'nccl' (group world, rank 0 of 1)") &&
			  strstr(msg, "all_to_all_v (autoep.dispatch)") &&
			  strstr(msg, "ncclSend(") &&
			  strstr(msg, "comm_nccl.c:") &&
			  strstr(msg, "internal error - please report"),
		      "%s", msg);
	unsetenv("FAKE_NCCL_FAIL");
	epj_ctx_clear_error(e.ctx);
	/* the group was ended: the next exchange runs */
	ck_assert_int_eq(ej_comm_a2av(e.ctx, e.c, "autoep.dispatch", send,
				      &rows, recv, &rows, row),
			 EPJ_OK);
	dev_expect(&e, recv, h_send, rows * row, "after a failed group");
	/* NCCL's own refusal: unequal send and receive to self, with
	 * ncclGetLastError's text */
	int64_t fewer = rows - 1;
	ck_assert_int_eq(
	    ej_comm_a2av(e.ctx, e.c, "test", send, &rows, recv, &fewer, row),
	    EPJ_ERR_BACKEND);
	msg = epj_ctx_error(e.ctx);
	ck_assert_msg(strstr(msg, "ncclGroupEnd()") &&
			  strstr(msg, "invalid usage (run with NCCL_DEBUG=WARN "
				      "for details) (5): send and receive "
				      "sizes differ"),
		      "%s", msg);
	epj_ctx_clear_error(e.ctx);
	ej_dealloc(e.a, send);
	ej_dealloc(e.a, recv);
	free(h_send);
	free(h_recv);
	nenv_close(&e);
}
END_TEST

/* ---- comm.backend -------------------------------------------------------- */

START_TEST(test_nccl_select)
{
	nenv e;
	if (!nenv_open(&e))
		return;
	ej_comm *c = e.boot;
	/* off the cuda device: "nccl" refused, "auto" / "host" / unset are
	 * the host comm */
	ck_assert_int_eq(
	    ej_comm_device_select(e.ctx, "nccl", "cpu", e.boot, &c),
	    EPJ_ERR_CONFIG);
	ck_assert_ptr_null(c);
	ck_assert_msg(strstr(epj_ctx_error(e.ctx),
			     "comm.backend=\"nccl\" needs the cuda device") &&
			  strstr(epj_ctx_error(e.ctx), "\"cpu\""),
		      "%s", epj_ctx_error(e.ctx));
	epj_ctx_clear_error(e.ctx);
	const char *host[] = { "auto", "host", "", NULL };
	for (int i = 0; i < 4; i++) {
		c = e.boot;
		ck_assert_int_eq(ej_comm_device_select(e.ctx, host[i],
						       "cuda-sim", e.boot, &c),
				 EPJ_OK);
		ck_assert_ptr_null(c);
	}
	/* EPJIT_COMM overrides the config */
	setenv("EPJIT_COMM", "nccl", 1);
	ck_assert_int_eq(
	    ej_comm_device_select(e.ctx, "auto", "cpu", e.boot, &c),
	    EPJ_ERR_CONFIG);
	ck_assert(strstr(epj_ctx_error(e.ctx), "EPJIT_COMM=\"nccl\""));
	epj_ctx_clear_error(e.ctx);
	setenv("EPJIT_COMM", "gloo", 1);
	ck_assert_int_eq(
	    ej_comm_device_select(e.ctx, "auto", "cuda", e.boot, &c),
	    EPJ_ERR_CONFIG);
	ck_assert(strstr(epj_ctx_error(e.ctx), "known: auto, host, nccl"));
	epj_ctx_clear_error(e.ctx);
	unsetenv("EPJIT_COMM");
	/* on the cuda device: "nccl" makes the nccl comm; "auto" too, but
	 * only for two or more ranks (this world has one: none) */
	c = NULL;
	ck_assert_msg(
	    ej_comm_device_select(e.ctx, "nccl", "cuda", e.boot, &c) == EPJ_OK,
	    "%s", epj_ctx_error(e.ctx));
	ck_assert_ptr_nonnull(c);
	ck_assert_str_eq(c->name, "nccl");
	ej_comm_free(c);
	c = e.boot;
	ck_assert_int_eq(
	    ej_comm_device_select(e.ctx, "auto", "cuda", e.boot, &c), EPJ_OK);
	ck_assert_ptr_null(c);
	c = e.boot;
	ck_assert_int_eq(
	    ej_comm_device_select(e.ctx, "host", "cuda", e.boot, &c), EPJ_OK);
	ck_assert_ptr_null(c);
	nenv_close(&e);
}
END_TEST

/* The engine applies comm.backend at initialize: "nccl" on the cpu device
 * is refused with the key's name; "auto" (the default) is fine. */
START_TEST(test_nccl_engine)
{
	fresh();
	epj_ctx *ctx = tu_ctx();
	tu_tmpfile cfg = tu_tmpfile_new(
	    "nccl", "config.json",
	    "{\"model_type\": \"qwen3_moe\", \"vocab_size\": 16, "
	    "\"hidden_size\": 16, \"num_hidden_layers\": 1, "
	    "\"num_attention_heads\": 2, \"num_key_value_heads\": 1, "
	    "\"head_dim\": 8, \"intermediate_size\": 24, "
	    "\"moe_intermediate_size\": 12, \"num_experts\": 4, "
	    "\"num_experts_per_tok\": 2, \"norm_topk_prob\": true, "
	    "\"max_position_embeddings\": 64, \"initializer_range\": 0.02}");
	epj_model_opts o = { .layout = EPJ_LAYOUT_NESTED,
			     .seed = 7,
			     .dtype = EPJ_DTYPE_F32 };
	epj_model *m = NULL;
	ck_assert_msg(epj_model_new(ctx, cfg.path, &o, &m) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	tu_tmpfile_free(&cfg);
	epj_engine *e = NULL;
	ck_assert_int_eq(
	    epj_engine_initialize_json(
		ctx, m, "{\"comm\": {\"backend\": \"nccl\"}}", "nccl.json", &e),
	    EPJ_ERR_CONFIG);
	ck_assert_ptr_null(e);
	ck_assert_msg(strstr(epj_ctx_error(ctx),
			     "comm.backend=\"nccl\" needs the cuda device"),
		      "%s", epj_ctx_error(ctx));
	epj_ctx_clear_error(ctx);
	ck_assert_msg(epj_engine_initialize_json(
			  ctx, m, "{\"comm\": {\"backend\": \"auto\"}}",
			  "auto.json", &e) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert_ptr_null(e->dev_comm);
	epj_engine_free(e);
	epj_model_free(m);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_nccl_suite(void)
{
	Suite *s = suite_create("nccl");
	TCase *tc = tcase_create("nccl");
	tcase_set_timeout(tc, 60);
	tcase_add_loop_test(tc, test_nccl_absent, 0, 2);
	tcase_add_test(tc, test_nccl_world1);
	tcase_add_test(tc, test_nccl_stream_order);
	tcase_add_test(tc, test_nccl_errors);
	tcase_add_test(tc, test_nccl_select);
	tcase_add_test(tc, test_nccl_engine);
	suite_add_tcase(s, tc);
	return s;
}
