/* comm.c -- what every collective backend shares: the process's world, the
 * parallel groups of an engine, and the checked wrappers through which the
 * library calls a comm (messages with context, counters).
 *
 * Backends: comm_self.c (a world of one) and comm_mpi.c (Open MPI).  The
 * world is `mpi` once epj_dist_init has started MPI (the process was
 * launched by mpirun / srun), else `self`.  comm_nccl.c makes the comm for
 * device buffers of the cuda device over the world's ranks
 * (ej_comm_device_select, comm.backend).
 */
#include "jit.h"
#include "runtime_impl.h"

#include "cuda_driver.h"

#include <ctype.h>
#include <string.h>
#include <time.h>

static ej_comm *g_world;   /* the process's world (owned) */
static bool g_mpi_started; /* epj_dist_init started MPI */

void ej_comm_free(ej_comm *c)
{
	if (!c)
		return;
	if (c->destroy)
		c->destroy(c->self);
	free(c);
}

ej_comm *ej_comm_world(void)
{
	if (!g_world)
		g_world = g_mpi_started ? ej_comm_mpi_world() : NULL;
	if (!g_world)
		g_world = ej_comm_self_new();
	EJ_ASSERT(g_world != NULL);
	return g_world;
}

ej_comm *ej_comm_world_set(ej_comm *c)
{
	ej_comm *prev = ej_comm_world();
	g_world = c;
	return prev;
}

epj_status epj_dist_init(char *err, size_t n)
{
	if (err && n)
		err[0] = '\0';
	if (g_mpi_started || g_world)
		return EPJ_OK;
	bool started = false;
	epj_status s = ej_mpi_init(err, n, &started);
	if (s != EPJ_OK)
		return s;
	g_mpi_started = started;
	ej_comm *w = ej_comm_world();
	/* several ranks: one debug-dump folder each (DIR/rank<N>) */
	ej_debug_dump_set_rank(w->rank, w->size);
	return EPJ_OK;
}

void epj_dist_finalize(bool ok)
{
	/* After a failure a peer may still wait in a collective: finalizing
	 * would wait for it.  The process exits instead and the launcher
	 * ends the others. */
	if (!ok)
		return;
	ej_comm_free(g_world);
	g_world = NULL;
	if (g_mpi_started)
		ej_mpi_finalize();
	g_mpi_started = false;
}

int epj_dist_rank(void)
{
	return ej_comm_world()->rank;
}

int epj_dist_size(void)
{
	return ej_comm_world()->size;
}

epj_status epj_dist_any(epj_engine *e, uint32_t local, uint32_t *any)
{
	EJ_ASSERT(e != NULL && any != NULL);
	ej_comm *w = e->model->has_groups ? e->model->groups.world : NULL;
	if (!w || w->size == 1) {
		*any = local;
		return EPJ_OK;
	}
	/* One count per bit: how many ranks set it (at most the world size,
	 * exact in f32), summed by the one reduction every comm has. */
	float n[32];
	for (int k = 0; k < 32; k++)
		n[k] = (float)((local >> k) & 1u);
	epj_status st = ej_comm_allreduce(e->ctx, w, "dist.any", n, 32);
	if (st != EPJ_OK)
		return st;
	uint32_t v = 0;
	for (int k = 0; k < 32; k++)
		if (n[k] > 0.5f)
			v |= 1u << k;
	*any = v;
	return EPJ_OK;
}

epj_status epj_dist_memory_max(epj_engine *e, epj_dist_memory *out)
{
	EJ_ASSERT(e != NULL && out != NULL);
	epj_memory_stats ms;
	epj_memory_stats_get(e->ctx, &ms);
	enum { N = 3 };
	int64_t mine[N] = { (int64_t)ms.peak_allocated,
			    (int64_t)ms.peak_reserved, (int64_t)ms.reserved };
	ej_comm *w = e->model->has_groups ? e->model->groups.world : NULL;
	int size = w ? w->size : 1;
	int64_t *all = mine, *counts = NULL;
	if (size > 1) {
		all = malloc(sizeof *all * N * (size_t)size);
		counts = malloc(sizeof *counts * (size_t)size);
		if (!all || !counts) {
			free(all);
			free(counts);
			return ej_error(e->ctx, EPJ_ERR_NOMEM,
					"dist.memory: out of memory");
		}
		for (int r = 0; r < size; r++)
			counts[r] = 1;
		epj_status st = ej_comm_allgather(
		    e->ctx, w, "dist.memory", mine, all, counts, sizeof mine);
		free(counts);
		if (st != EPJ_OK) {
			free(all);
			return st;
		}
	}
	/* the largest of each, the lowest rank on ties */
	int64_t best[N];
	int rank[N];
	for (int k = 0; k < N; k++) {
		best[k] = all[k];
		rank[k] = 0;
		for (int r = 1; r < size; r++)
			if (all[N * r + k] > best[k]) {
				best[k] = all[N * r + k];
				rank[k] = r;
			}
	}
	if (all != mine)
		free(all);
	*out = (epj_dist_memory){ .peak_allocated = (uint64_t)best[0],
				  .peak_reserved = (uint64_t)best[1],
				  .reserved = (uint64_t)best[2],
				  .peak_allocated_rank = rank[0],
				  .peak_reserved_rank = rank[1],
				  .reserved_rank = rank[2] };
	return EPJ_OK;
}

/* ---- groups ---------------------------------------------------------------
 */

epj_status ej_groups_new(epj_ctx *ctx, ej_comm *world, int ep_size,
			 ej_groups *out)
{
	memset(out, 0, sizeof *out);
	int W = world->size, r = world->rank;
	if (ep_size < 1 || W % ep_size != 0)
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"expert_parallel.autoep_size=%d does not "
				"divide the world size %d (comm '%s')",
				ep_size, W, world->name);
	out->world = world;
	out->dp = world;
	if (W == 1) {
		out->ep = out->edp = world;
		return EPJ_OK;
	}
	if (!world->split)
		return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
				"comm '%s' cannot make sub-groups (no split)",
				world->name);
	out->owned = true;
	/* EP group: ranks [g*ep, (g+1)*ep); EDP group: ranks with the same
	 * position r % ep in their EP group. */
	out->ep = world->split(world->self, r / ep_size, r, "ep");
	out->edp =
	    out->ep ? world->split(world->self, r % ep_size, r, "edp") : NULL;
	if (!out->ep || !out->edp) {
		const char *why =
		    world->error ? world->error(world->self) : "out of memory";
		ej_groups_free(out);
		return ej_error(ctx, EPJ_ERR_BACKEND,
				"comm '%s' (rank %d of %d): creating the "
				"expert-parallel groups (size %d) failed: %s",
				world->name, r, W, ep_size, why);
	}
	EJ_ASSERT(out->ep->size == ep_size && out->edp->size == W / ep_size);
	return EPJ_OK;
}

void ej_groups_free(ej_groups *g)
{
	if (g->owned) {
		ej_comm_free(g->ep);
		ej_comm_free(g->edp);
	}
	memset(g, 0, sizeof *g);
}

/* ---- checked wrappers -----------------------------------------------------
 */

static double wall_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static const char *group_of(const ej_comm *c)
{
	return c->group ? c->group : "world";
}

static epj_status comm_fail(epj_ctx *ctx, ej_comm *c, const char *call,
			    const char *what, epj_status s)
{
	if (s == EPJ_OK)
		s = EPJ_ERR_BACKEND;
	return ej_error(ctx, s,
			"comm '%s' (group %s, rank %d of %d): %s (%s) "
			"failed: %s",
			c->name, group_of(c), c->rank, c->size, call, what,
			c->error ? c->error(c->self) : epj_status_name(s));
}

static epj_status missing(epj_ctx *ctx, ej_comm *c, const char *call,
			  const char *what)
{
	return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
			"comm '%s' (group %s): %s (%s) is not provided",
			c->name, group_of(c), call, what);
}

/* The counter-name part of a purpose: words joined by dots, parentheses
 * dropped ("checkpoint save" -> checkpoint.save, "autoep.split_plan
 * (drain)" -> autoep.split_plan.drain), so that no counter name holds a
 * blank; the purpose itself stays as it is in messages. */
void ej_comm_purpose_part(const char *what, char *out, size_t n)
{
	size_t k = 0;
	bool dot = false;
	for (const char *p = what ? what : "unnamed"; *p && k + 2 < n; p++) {
		unsigned char ch = (unsigned char)*p;
		if (ch == '(' || ch == ')')
			continue;
		if (isspace(ch)) {
			dot = k > 0;
			continue;
		}
		if (dot && out[k - 1] != '.')
			out[k++] = '.';
		dot = false;
		out[k++] = isgraph(ch) ? (char)ch : '_';
	}
	out[k] = 0;
}

static void account(epj_ctx *ctx, ej_comm *c, const char *what, int64_t bytes,
		    double t0)
{
	double dt = wall_s() - t0;
	c->stat_calls++;
	c->stat_bytes += bytes;
	c->stat_seconds += dt;
	if (!ctx)
		return;
	epj_counter_add(ctx, "comm.calls", 1);
	epj_counter_add(ctx, "comm.bytes", bytes);
	epj_counter_add(ctx, "comm.us", (int64_t)(dt * 1e6));
	char name[160], part[96];
	ej_comm_purpose_part(what, part, sizeof part);
	snprintf(name, sizeof name, "comm.%s.bytes", part);
	epj_counter_add(ctx, name, bytes);
	/* by backend: comm.<backend>.calls / .bytes, and per purpose
	 * comm.<backend>.<what>.bytes (which comm carried what) */
	snprintf(name, sizeof name, "comm.%s.calls", c->name);
	epj_counter_add(ctx, name, 1);
	snprintf(name, sizeof name, "comm.%s.bytes", c->name);
	epj_counter_add(ctx, name, bytes);
	snprintf(name, sizeof name, "comm.%s.%s.bytes", c->name, part);
	epj_counter_add(ctx, name, bytes);
}

epj_status ej_comm_a2av(epj_ctx *ctx, ej_comm *c, const char *what,
			const void *send, const int64_t *send_counts,
			void *recv, const int64_t *recv_counts, size_t row)
{
	double t0 = wall_s();
	epj_status s =
	    c->all_to_all_v(c->self, send, send_counts, recv, recv_counts, row);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "all_to_all_v", what, s);
	int64_t b = 0;
	for (int p = 0; p < c->size; p++)
		if (p != c->rank)
			b += send_counts[p] * (int64_t)row;
	account(ctx, c, what, b, t0);
	return EPJ_OK;
}

epj_status ej_comm_a2av_start(epj_ctx *ctx, ej_comm *c, const char *what,
			      const void *send, const int64_t *send_counts,
			      void *recv, const int64_t *recv_counts,
			      size_t row, bool *started)
{
	*started = false;
	if (!c->all_to_all_v_start)
		return ej_comm_a2av(ctx, c, what, send, send_counts, recv,
				    recv_counts, row);
	double t0 = wall_s();
	epj_status s = c->all_to_all_v_start(c->self, send, send_counts, recv,
					     recv_counts, row);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "all_to_all_v_start", what, s);
	int64_t b = 0;
	for (int p = 0; p < c->size; p++)
		if (p != c->rank)
			b += send_counts[p] * (int64_t)row;
	account(ctx, c, what, b, t0);
	if (ctx)
		epj_counter_add(ctx, "comm.a2av.started", 1);
	*started = true;
	return EPJ_OK;
}

epj_status ej_comm_a2av_wait(epj_ctx *ctx, ej_comm *c, const char *what)
{
	if (!c->all_to_all_v_wait)
		return missing(ctx, c, "all_to_all_v_wait", what);
	epj_status s = c->all_to_all_v_wait(c->self);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "all_to_all_v_wait", what, s);
	if (ctx)
		epj_counter_add(ctx, "comm.a2av.waits", 1);
	return EPJ_OK;
}

epj_status ej_comm_a2a_i64(epj_ctx *ctx, ej_comm *c, const char *what,
			   const int64_t *send, int64_t *recv)
{
	double t0 = wall_s();
	epj_status s = c->all_to_all_i64(c->self, send, recv);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "all_to_all_i64", what, s);
	account(ctx, c, what, 8 * (int64_t)(c->size - 1), t0);
	return EPJ_OK;
}

epj_status ej_comm_a2a_i64_start(epj_ctx *ctx, ej_comm *c, const char *what,
				 const int64_t *send, int64_t *recv, int n_per,
				 ej_comm_req **req)
{
	*req = NULL;
	if (!c->all_to_all_i64_start)
		return missing(ctx, c, "all_to_all_i64_start", what);
	double t0 = wall_s();
	epj_status s = c->all_to_all_i64_start(c->self, send, recv, n_per, req);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "all_to_all_i64_start", what, s);
	account(ctx, c, what, 8 * (int64_t)n_per * (c->size - 1), t0);
	return EPJ_OK;
}

epj_status ej_comm_wait(epj_ctx *ctx, ej_comm *c, const char *what,
			ej_comm_req *req)
{
	if (!c->wait)
		return missing(ctx, c, "wait", what);
	double t0 = wall_s();
	epj_status s = c->wait(c->self, req);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "wait", what, s);
	account(ctx, c, what, 0, t0);
	return EPJ_OK;
}

epj_status ej_comm_allreduce(epj_ctx *ctx, ej_comm *c, const char *what,
			     float *buf, int64_t n)
{
	if (c->size == 1)
		return EPJ_OK;
	double t0 = wall_s();
	epj_status s = c->all_reduce_f32(c->self, buf, n);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "all_reduce", what, s);
	account(ctx, c, what, 4 * n, t0);
	return EPJ_OK;
}

epj_status ej_comm_reduce_scatter(epj_ctx *ctx, ej_comm *c, const char *what,
				  const float *send, float *recv,
				  const int64_t *counts)
{
	if (!c->reduce_scatter_f32)
		return missing(ctx, c, "reduce_scatter", what);
	double t0 = wall_s();
	epj_status s = c->reduce_scatter_f32(c->self, send, recv, counts);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "reduce_scatter", what, s);
	int64_t b = 0;
	for (int p = 0; p < c->size; p++)
		if (p != c->rank)
			b += 4 * counts[p];
	account(ctx, c, what, b, t0);
	return EPJ_OK;
}

epj_status ej_comm_allgather(epj_ctx *ctx, ej_comm *c, const char *what,
			     const void *send, void *recv,
			     const int64_t *counts, size_t row)
{
	if (!c->all_gather_v)
		return missing(ctx, c, "all_gather", what);
	double t0 = wall_s();
	epj_status s = c->all_gather_v(c->self, send, recv, counts, row);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "all_gather", what, s);
	account(ctx, c, what,
		(int64_t)(c->size - 1) * counts[c->rank] * (int64_t)row, t0);
	return EPJ_OK;
}

epj_status ej_comm_bcast(epj_ctx *ctx, ej_comm *c, const char *what, void *buf,
			 size_t bytes, int root)
{
	if (!c->broadcast)
		return missing(ctx, c, "broadcast", what);
	double t0 = wall_s();
	epj_status s = c->broadcast(c->self, buf, bytes, root);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "broadcast", what, s);
	account(ctx, c, what, c->rank == root ? (int64_t)bytes : 0, t0);
	return EPJ_OK;
}

epj_status ej_comm_barrier_c(epj_ctx *ctx, ej_comm *c, const char *what)
{
	double t0 = wall_s();
	epj_status s = c->barrier(c->self);
	if (s != EPJ_OK)
		return comm_fail(ctx, c, "barrier", what, s);
	account(ctx, c, what, 0, t0);
	return EPJ_OK;
}

/* ---- the comm for device buffers ----------------------------------------
 */

epj_status ej_comm_device_select(epj_ctx *ctx, const char *choice,
				 const char *device, ej_comm *world,
				 ej_comm **out)
{
	*out = NULL;
	const char *env = getenv("EPJIT_COMM");
	const char *from = "comm.backend";
	if (env && *env) {
		choice = env;
		from = "EPJIT_COMM";
	}
	if (!choice || !*choice)
		choice = "auto";
	/* a device whose collectives are NCCL's (its descriptor's comm) */
	const ej_device_desc *dd = ej_device_find(device);
	bool cuda = dd && dd->comm && !strcmp(dd->comm, "nccl");
	if (!strcmp(choice, "host"))
		return EPJ_OK;
	if (!strcmp(choice, "auto")) {
		/* one rank has nothing to exchange: no NCCL communicator */
		if (!cuda || !world || world->size < 2 ||
		    !ej_nccl_available(NULL))
			return EPJ_OK;
	} else if (!strcmp(choice, "nccl")) {
		if (!cuda)
			return ej_error(ctx, EPJ_ERR_CONFIG,
					"%s=\"nccl\" needs the cuda device "
					"(NCCL collectives run on device "
					"buffers); this context is on \"%s\"",
					from, device ? device : "");
	} else {
		return ej_error(ctx, EPJ_ERR_CONFIG,
				"%s=\"%s\" is not a comm backend (known: "
				"auto, host, nccl)",
				from, choice);
	}
	/* the library first: its absence is the likelier reason, and needs
	 * no GPU to report */
	ej_cuda_dev *dev = NULL;
	epj_status st = ej_nccl_available(ctx) ? EPJ_OK : epj_ctx_status(ctx);
	if (st == EPJ_OK)
		st = ej_cuda_open(ctx, &dev);
	if (st == EPJ_OK)
		st = ej_comm_nccl_new(ctx, world, dev, out);
	if (st != EPJ_OK)
		ej_error_prefix(ctx, "%s=\"%s\" (world '%s' of %d)", from,
				choice, world->name, world->size);
	return st;
}
