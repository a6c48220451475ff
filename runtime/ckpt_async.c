/* ckpt_async.c -- background saves: the state copied between two optimizer
 * steps, a writer thread that writes it, the commit at a later boundary.
 *
 *   epj_engine_save_async        (every rank, between two optimizer steps)
 *     the save in flight, if any, is finished first: at most one in flight
 *     ej_save_prepare            generation G, the records (as a save)
 *     snapshot                   every entry of the checkpoint (the FP32
 *                                masters, the optimizer state, the counters
 *                                and metadata: ej_engine_save_entries, what
 *                                a foreground save writes) copied into one
 *                                host buffer, page-locked on the cuda device
 *                                (copies issued together, one wait); the
 *                                ranks agree every snapshot succeeded
 *     the writer thread starts
 *   writer thread                its own cpu context and the snapshot only:
 *                                never the engine, its context or a comm
 *     every float entry checked finite (a checkpoint never holds a NaN)
 *     ej_write_atomic of PATH.g<G>.rank<R> (a world of one: PATH): the
 *     bytes go through a tee that hashes them (XXH3-128) on their way to
 *     the temporary file; fsync; rename; fsync of the folder
 *     then, and only then, its row (ok, bytes, checksum) is published
 *   epj_engine_save_pending      this rank's writer at work or not (local)
 *   epj_engine_save_finish       (every rank, at a step boundary: the
 *                                trainer calls it once its agreement says
 *                                no rank's writer is still at work)
 *     wait for the writer; exchange the rows; rank 0 commits the record
 *     only when every rank's file is written (ej_save_commit); the ranks
 *     agree on the commit; the dropped generation is pruned after that.
 *
 * MPI is initialised with MPI_THREAD_FUNNELED (comm_mpi.c): only the thread
 * that trains calls it.  So the writer never communicates; the ranks learn
 * about each other's writers through collectives the training thread makes
 * (the trainer's step agreement, then ej_save_commit).  A SIGKILL at any
 * moment leaves the newest committed record and every file it names: the
 * writer only creates files of generation G, and the record is replaced
 * (renamed) after every rank's file of G is in place.
 *
 * The writer thread starts with every signal blocked: a stop signal goes
 * to the training thread, whose handler the application installed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* fopencookie */
#endif
#include "runtime_impl.h"

#include "cuda_driver.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

/* One entry of the snapshot: a tensor of the checkpoint, its bytes at
 * off in the host buffer. */
typedef struct bg_entry {
	char *name;
	epj_tensor *src;  /* the engine's tensor (a reference, snapshot only) */
	epj_tensor *view; /* the writer's: its bytes in the host buffer */
	size_t off, bytes;
} bg_entry;

struct ej_save_bg {
	epj_engine *e;
	/* the host buffer, kept from save to save (the entries keep their
	 * sizes); pinned: from ej_cuda_host_alloc */
	char *host;
	size_t host_bytes;
	bool pinned;
	ej_cuda_dev *cuda;
	/* the save in flight: its plan, entries and the writer's own context
	 * and safetensors writer over the host buffer */
	ej_save_plan plan;
	bg_entry *ent;
	int n_ent, cap_ent;
	epj_ctx *wctx;
	epj_st_writer *w;
	pthread_t th;
	bool started;	   /* th runs (joined by finish or free) */
	bool started_file; /* a writer was started for plan.file */
	/* guarded by mu: the writer's state and result */
	pthread_mutex_t mu;
	pthread_cond_t cv;
	epj_save_state state;
	epj_status status;
	char msg[1024];
	ej_save_row row;
	/* the writer's own: the size and checksum of the bytes it wrote */
	ej_save_row fill;
};

/* ---- the snapshot (training thread) ---- */

static epj_status bg_add(void *self, const char *name, epj_tensor *t)
{
	struct ej_save_bg *b = self;
	if (b->n_ent == b->cap_ent) {
		int cap = b->cap_ent ? 2 * b->cap_ent : 64;
		bg_entry *v = realloc(b->ent, (size_t)cap * sizeof *v);
		if (!v)
			return ej_error(b->e->ctx, EPJ_ERR_NOMEM,
					"checkpoint '%s': out of memory",
					b->plan.path);
		b->ent = v;
		b->cap_ent = cap;
	}
	bg_entry *x = &b->ent[b->n_ent];
	x->name = strdup(name);
	if (!x->name)
		return ej_error(b->e->ctx, EPJ_ERR_NOMEM,
				"checkpoint '%s': out of memory", b->plan.path);
	x->src = epj_tensor_ref(t);
	x->view = NULL;
	x->bytes =
	    (size_t)epj_tensor_numel(t) * epj_dtype_size(epj_tensor_dtype(t));
	b->n_ent++;
	return EPJ_OK;
}

static epj_status bg_meta(void *self, const char *key, const char *value)
{
	struct ej_save_bg *b = self;
	if (epj_st_writer_set_metadata(b->w, key, value) == EPJ_OK)
		return EPJ_OK;
	return ej_error(b->e->ctx, epj_ctx_status(b->wctx), "%s",
			epj_ctx_error(b->wctx));
}

/* The engine's tensors are the snapshot's only while it copies them. */
static void bg_release_sources(struct ej_save_bg *b)
{
	for (int i = 0; i < b->n_ent; i++) {
		epj_tensor_free(b->ent[i].src);
		b->ent[i].src = NULL;
	}
}

static void bg_entries_free(struct ej_save_bg *b)
{
	bg_release_sources(b);
	for (int i = 0; i < b->n_ent; i++) {
		free(b->ent[i].name);
		epj_tensor_free(b->ent[i].view);
	}
	b->n_ent = 0;
}

/* The host buffer for `bytes`: the one of the last save when it fits,
 * else a new one (page-locked on the cuda device; pageable memory when
 * that fails, the copies then wait each). */
static epj_status bg_host(struct ej_save_bg *b, size_t bytes)
{
	epj_ctx *ctx = b->e->ctx;
	if (b->host && b->host_bytes >= bytes)
		return EPJ_OK;
	if (b->pinned)
		ej_cuda_host_free(b->cuda, b->host);
	else
		free(b->host);
	b->host = NULL;
	b->host_bytes = 0;
	b->pinned = false;
	size_t n = bytes ? bytes : 1;
	if (b->cuda) {
		void *p = NULL;
		if (ej_cuda_host_alloc(ctx, b->cuda, n, &p) == EPJ_OK) {
			b->host = p;
			b->pinned = true;
		} else {
			epj_log_msg(EPJ_LOG_WARN,
				    "checkpoint '%s': %s; the snapshot goes "
				    "to pageable memory",
				    b->plan.path, epj_ctx_error(ctx));
			epj_ctx_clear_error(ctx);
		}
	}
	if (!b->host && posix_memalign((void **)&b->host, 4096, n) != 0)
		b->host = NULL;
	if (!b->host)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"checkpoint '%s': cannot allocate %zu bytes of "
				"host memory for the snapshot",
				b->plan.path, n);
	b->host_bytes = n;
	return EPJ_OK;
}

/* Copies entry x (its contiguous bytes) into the host buffer: on the cuda
 * device queued on the compute stream (the caller waits once). */
static epj_status bg_copy(struct ej_save_bg *b, bg_entry *x)
{
	epj_ctx *ctx = b->e->ctx;
	epj_tensor *t = x->src, *c = NULL;
	if (!x->bytes)
		return EPJ_OK;
	if (!epj_tensor_is_contiguous(t)) {
		c = ej_tensor_alloc(ctx, epj_tensor_dtype(t),
				    epj_tensor_ndim(t), epj_tensor_shape(t),
				    false);
		if (!c || epj_tensor_copy_(ctx, c, t) != EPJ_OK) {
			epj_tensor_free(c);
			return epj_ctx_status(ctx) != EPJ_OK
				   ? epj_ctx_status(ctx)
				   : ej_error(ctx, EPJ_ERR_NOMEM,
					      "checkpoint '%s': out of memory",
					      b->plan.path);
		}
		t = c;
	}
	void *dst = b->host + x->off;
	const void *src = ej_data(t);
	epj_status st = EPJ_OK;
	if (ctx->dev->host_visible)
		memcpy(dst, src, x->bytes);
	else if (b->cuda && b->pinned && !c)
		st = ej_cuda_copy_async(ctx, b->cuda, dst, src, x->bytes);
	else
		ctx->dev->copy(ctx->dev->self, dst, src, x->bytes);
	epj_tensor_free(c);
	return st;
}

/* The writer's tensors: each entry's bytes in the host buffer, as a cpu
 * tensor of the writer's context that borrows them. */
static epj_status bg_views(struct ej_save_bg *b)
{
	for (int i = 0; i < b->n_ent; i++) {
		bg_entry *x = &b->ent[i];
		epj_tensor *v = ej_tensor_meta(
		    b->wctx, epj_tensor_dtype(x->src), epj_tensor_ndim(x->src),
		    epj_tensor_shape(x->src));
		ej_storage *s = v ? calloc(1, sizeof *s) : NULL;
		if (!s) {
			epj_tensor_free(v);
			return ej_error(b->e->ctx, EPJ_ERR_NOMEM,
					"checkpoint '%s': out of memory",
					b->plan.path);
		}
		*s = (ej_storage){ .refcount = 1,
				   .data = b->host + x->off,
				   .bytes = x->bytes }; /* borrowed */
		v->storage = s;
		x->view = v;
		epj_status st = epj_st_writer_add(b->w, x->name, v);
		if (st != EPJ_OK)
			return ej_error(b->e->ctx, st, "%s",
					epj_ctx_error(b->wctx));
	}
	return EPJ_OK;
}

/* Everything the writer writes, copied now: the entries into the host
 * buffer and the metadata into its safetensors writer. */
static epj_status bg_snapshot(struct ej_save_bg *b)
{
	epj_engine *e = b->e;
	epj_ctx *ctx = e->ctx;
	epj_status st = b->wctx ? EPJ_OK : epj_ctx_new("cpu", &b->wctx);
	if (st != EPJ_OK)
		return ej_error(ctx, st,
				"checkpoint '%s': cannot create the writer's "
				"context",
				b->plan.path);
	epj_ctx_clear_error(b->wctx);
	st = epj_st_writer_new(b->wctx, &b->w);
	ej_save_sink sink = { b, bg_add, bg_meta };
	if (st == EPJ_OK)
		st =
		    ej_engine_save_entries(e, b->plan.file, b->plan.gen, &sink);
	size_t total = 0;
	for (int i = 0; st == EPJ_OK && i < b->n_ent; i++) {
		b->ent[i].off = total;
		total += (b->ent[i].bytes + 63) & ~(size_t)63;
	}
	if (st == EPJ_OK)
		st = bg_host(b, total);
	for (int i = 0; st == EPJ_OK && i < b->n_ent; i++)
		st = bg_copy(b, &b->ent[i]);
	if (b->cuda && b->pinned) {
		epj_status ss = ej_cuda_sync(ctx, b->cuda);
		if (st == EPJ_OK)
			st = ss;
	}
	if (st == EPJ_OK)
		st = bg_views(b);
	bg_release_sources(b); /* the engine's tensors are not the writer's */
	return st;
}

/* ---- the writer thread ---- */

/* The tee between the safetensors bytes and the temporary file. */
typedef struct bg_tee {
	struct ej_save_bg *b;
	FILE *fp;
	XXH3_state_t *h;
	int64_t n;
	int err; /* errno of a failed write */
} bg_tee;

static ssize_t tee_write(void *cookie, const char *buf, size_t n)
{
	bg_tee *t = cookie;
	if (fwrite(buf, 1, n, t->fp) != n) {
		t->err = errno ? errno : EIO;
		return -1;
	}
	XXH3_128bits_update(t->h, buf, n);
	bool first = t->n == 0;
	t->n += (int64_t)n;
	if (first) { /* part of the bytes in the temporary file */
		fflush(t->fp);
		ej_save_hold("write", t->b->plan.rank, t->b->plan.counts.step);
	}
	return (ssize_t)n;
}

/* ej_write_atomic's fill: the snapshot's safetensors bytes, hashed on
 * their way to fp. */
static epj_status tee_fill(epj_ctx *ctx, FILE *fp, const char *tmp, void *u)
{
	struct ej_save_bg *b = u;
	bg_tee t = { .b = b, .fp = fp, .h = XXH3_createState() };
	cookie_io_functions_t io = { .write = tee_write };
	FILE *tf = t.h ? fopencookie(&t, "w", io) : NULL;
	if (!tf) {
		XXH3_freeState(t.h);
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"checkpoint '%s': out of memory", b->plan.file);
	}
	XXH3_128bits_reset(t.h);
	epj_status st = ej_st_writer_write(b->w, tf, b->plan.file, tmp);
	if (fclose(tf) != 0 && st == EPJ_OK)
		st =
		    ej_error(ctx, EPJ_ERR_IO, "checkpoint '%s': write '%s': %s",
			     b->plan.file, tmp, strerror(t.err ? t.err : EIO));
	XXH128_hash_t d = XXH3_128bits_digest(t.h);
	XXH3_freeState(t.h);
	if (st != EPJ_OK)
		return st;
	epj_hash_hex((epj_hash128){ .lo = d.low64, .hi = d.high64 },
		     b->fill.hash);
	b->fill.bytes = t.n;
	/* every byte is in the temporary file (or its stdio buffer), neither
	 * synced nor renamed */
	ej_save_hold("filled", b->plan.rank, b->plan.counts.step);
	return EPJ_OK;
}

/* Every float entry of the snapshot is finite: a checkpoint never holds a
 * NaN or an infinity (the foreground save's check, on the host copy). */
static epj_status bg_finite(struct ej_save_bg *b)
{
	for (int i = 0; i < b->n_ent; i++) {
		epj_tensor *t = b->ent[i].view;
		epj_dtype dt = epj_tensor_dtype(t);
		int64_t n = epj_tensor_numel(t);
		const char *p = epj_tensor_data(t);
		int64_t bad = -1;
		double bv = 0;
		if (dt == EPJ_DTYPE_F32) {
			/* an exponent of all ones: Inf or NaN (a loop the
			 * compiler vectorises; the state is mostly f32) */
			const uint32_t *w = (const void *)p;
			uint32_t any = 0;
			for (int64_t k = 0; k < n; k++)
				any |= (uint32_t)((w[k] & 0x7f800000u) ==
						  0x7f800000u);
			n = any ? n : 0; /* else find the element below */
		}
		for (int64_t k = 0; k < n && bad < 0; k++) {
			double v = 0;
			if (dt == EPJ_DTYPE_F32)
				v = ((const float *)p)[k];
			else if (dt == EPJ_DTYPE_BF16)
				v = epj_bf16_to_f32(((const uint16_t *)p)[k]);
			else if (dt == EPJ_DTYPE_F64)
				v = ((const double *)p)[k];
			else
				break; /* not a float: nothing to check */
			if (!isfinite(v)) {
				bad = k;
				bv = v;
			}
		}
		if (bad >= 0)
			return ej_error(
			    b->wctx, EPJ_ERR_STATE,
			    "checkpoint '%s' not saved: '%s' element %lld is "
			    "%g (a non-finite weight or optimizer state: the "
			    "last update diverged; the file there is left as "
			    "it was)",
			    b->plan.path, b->ent[i].name, (long long)bad, bv);
	}
	return EPJ_OK;
}

/* The writer's report: its status and row, the state WRITTEN.  From then
 * on the training thread may commit the file, so it is made only once the
 * file is fsynced and renamed into place (or the write failed). */
static void bg_report(struct ej_save_bg *b, epj_status st, ej_save_row row)
{
	pthread_mutex_lock(&b->mu);
	b->status = st;
	snprintf(b->msg, sizeof b->msg, "%s",
		 st == EPJ_OK ? "" : epj_ctx_error(b->wctx));
	b->row = row;
	b->state = EPJ_SAVE_WRITTEN;
	pthread_cond_broadcast(&b->cv);
	pthread_mutex_unlock(&b->mu);
}

static void *bg_main(void *arg)
{
	struct ej_save_bg *b = arg;
	ej_save_row row = { 0 };
	ej_save_hold("start", b->plan.rank, b->plan.counts.step);
	epj_status st = bg_finite(b);
	if (st == EPJ_OK)
		st = ej_write_atomic(b->wctx, "checkpoint", b->plan.file,
				     tee_fill, b);
	if (st == EPJ_OK) {
		/* fsynced and renamed into place: only now is it reported */
		ej_save_hold("written", b->plan.rank, b->plan.counts.step);
		row = b->fill;
		row.ok = 1;
	}
	bg_report(b, st, row);
	return NULL;
}

/* Starts the writer with every signal blocked (it inherits the mask). */
static epj_status bg_start(struct ej_save_bg *b)
{
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	pthread_mutex_lock(&b->mu);
	b->state = EPJ_SAVE_WRITING;
	b->status = EPJ_OK;
	b->msg[0] = '\0';
	pthread_mutex_unlock(&b->mu);
	int rc = pthread_create(&b->th, NULL, bg_main, b);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc != 0) {
		b->state = EPJ_SAVE_NONE;
		return ej_error(b->e->ctx, EPJ_ERR_STATE,
				"checkpoint '%s': cannot start the writer "
				"thread: %s",
				b->plan.path, strerror(rc));
	}
	b->started = b->started_file = true;
	return EPJ_OK;
}

/* ---- the engine's side ---- */

static struct ej_save_bg *bg_get(epj_engine *e)
{
	if (e->bg)
		return e->bg;
	struct ej_save_bg *b = calloc(1, sizeof *b);
	if (!b) {
		ej_error(e->ctx, EPJ_ERR_NOMEM,
			 "background save: out of memory");
		return NULL;
	}
	b->e = e;
	pthread_mutex_init(&b->mu, NULL);
	pthread_cond_init(&b->cv, NULL);
	if (!e->ctx->dev->host_visible && !strcmp(e->ctx->dev->name, "cuda") &&
	    ej_cuda_open(e->ctx, &b->cuda) != EPJ_OK) {
		epj_ctx_clear_error(e->ctx); /* pageable memory then */
		b->cuda = NULL;
	}
	e->bg = b;
	return b;
}

/* Waits for the writer's report (bg_report); its result is then in b. */
static void bg_wait(struct ej_save_bg *b)
{
	pthread_mutex_lock(&b->mu);
	while (b->state == EPJ_SAVE_WRITING)
		pthread_cond_wait(&b->cv, &b->mu);
	pthread_mutex_unlock(&b->mu);
}

/* Waits for the writer thread to end (it ends right after its report). */
static void bg_join(struct ej_save_bg *b)
{
	if (!b->started)
		return;
	bg_wait(b);
	pthread_join(b->th, NULL);
	b->started = false;
}

/* The save in flight is over (committed, failed or abandoned). */
static void bg_reset(struct ej_save_bg *b)
{
	epj_st_writer_free(b->w);
	b->w = NULL;
	bg_entries_free(b);
	ej_save_plan_free(&b->plan);
	b->state = EPJ_SAVE_NONE;
	b->started_file = false;
}

/* Whether every rank's snapshot succeeded (st is this one's). */
static epj_status bg_agree(epj_engine *e, epj_status st)
{
	ej_comm *world = ej_engine_world(e);
	if (!world)
		return st;
	float f = st == EPJ_OK ? 0.0f : 1.0f;
	epj_status cs =
	    ej_comm_allreduce(e->ctx, world, "checkpoint snapshot", &f, 1);
	if (st != EPJ_OK)
		return st;
	if (cs != EPJ_OK)
		return cs;
	if (f > 0)
		return ej_error(
		    e->ctx, EPJ_ERR_IO,
		    "checkpoint '%s' not saved: the snapshot failed "
		    "on %g other rank%s (see their messages)",
		    e->bg->plan.path, f, f == 1 ? "" : "s");
	return EPJ_OK;
}

epj_status epj_engine_save_async(epj_engine *e, const char *path)
{
	int64_t unused;
	epj_status st = epj_engine_save_finish(e, &unused);
	if (st != EPJ_OK)
		return st;
	struct ej_save_bg *b = bg_get(e);
	if (!b)
		return epj_ctx_status(e->ctx);
	struct timespec t0, t1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	st = ej_save_prepare(e, path, &b->plan);
	if (st != EPJ_OK)
		return st;
	st = bg_snapshot(b);
	size_t bytes = 0;
	for (int i = 0; i < b->n_ent; i++)
		bytes += b->ent[i].bytes;
	/* the writer starts before the agreement: a rank whose snapshot
	 * failed has none, and those that started one wait for it below */
	if (st == EPJ_OK)
		st = bg_start(b);
	st = bg_agree(e, st);
	if (st != EPJ_OK) {
		bg_join(b);
		if (b->started_file && ej_engine_world(e))
			unlink(b->plan.file); /* never committed */
		bg_reset(b);
		return st;
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	epj_ctx *ctx = e->ctx;
	epj_counter_add(ctx, "save.background", 1);
	epj_counter_add(ctx, "save.snapshot.bytes", (int64_t)bytes);
	if (b->pinned)
		epj_counter_add(ctx, "save.snapshot.pinned_bytes",
				(int64_t)bytes);
	epj_counter_add(ctx, "save.snapshot.us",
			(int64_t)(t1.tv_sec - t0.tv_sec) * 1000000 +
			    (t1.tv_nsec - t0.tv_nsec) / 1000);
	return EPJ_OK;
}

epj_save_state epj_engine_save_pending(const epj_engine *e)
{
	struct ej_save_bg *b = e->bg;
	if (!b)
		return EPJ_SAVE_NONE;
	pthread_mutex_lock(&b->mu);
	epj_save_state s = b->state;
	pthread_mutex_unlock(&b->mu);
	return s;
}

epj_status epj_engine_save_finish(epj_engine *e, int64_t *step)
{
	struct ej_save_bg *b = e->bg;
	*step = -1;
	if (!b || b->state == EPJ_SAVE_NONE)
		return EPJ_OK;
	bg_wait(b);
	epj_status st = b->status;
	if (st != EPJ_OK)
		ej_error(e->ctx, st, "%s", b->msg);
	if (ej_engine_world(e))
		st = ej_save_commit(e, &b->plan, &b->row, st);
	if (st == EPJ_OK)
		*step = b->plan.counts.step;
	bg_join(b);
	bg_reset(b);
	return st;
}

bool epj_engine_save_decoupled(const epj_engine *e)
{
	return e->cfg.checkpoint_decoupled;
}

void ej_save_bg_free(struct ej_save_bg *b)
{
	if (!b)
		return;
	bg_join(b);
	bg_reset(b);
	free(b->ent);
	if (b->pinned)
		ej_cuda_host_free(b->cuda, b->host);
	else
		free(b->host);
	epj_ctx_free(b->wctx);
	pthread_cond_destroy(&b->cv);
	pthread_mutex_destroy(&b->mu);
	free(b);
}
