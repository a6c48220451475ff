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
 * Communicators of several ranks (one process each, e.g. under mpirun; the
 * id is sent over the caller's bootstrap as with NCCL) exchange through
 * files in a folder named by the unique id under $FAKE_NCCL_DIR (else
 * $TMPDIR, else /tmp): every collective is numbered per communicator and
 * each rank writes its part (a header of call, count, type, op and root,
 * then its data) before reading the others', so ranks that call
 * different collectives, counts, types, ops or roots get
 * ncclInvalidUsage naming both calls, and a rank that never calls makes
 * the others fail with ncclRemoteError after $FAKE_NCCL_TIMEOUT_S seconds
 * (default 30) instead of hanging; a communicator that failed stays
 * failed.  Reductions add in rank order (the same bits on every rank).
 * Point to point: a send writes its bytes to a file per (sender,
 * receiver, n-th message), the receive reads and removes it; in a group,
 * every send is written before any receive waits (NCCL's deadlock-free
 * grouping), and a receive whose size differs from the matching send is
 * ncclInvalidUsage.  Calls run when issued (a group's point-to-point at
 * ncclGroupEnd), which keeps them in the order of the stream they are
 * issued on: the stand-in driver runs its kernels and copies when issued
 * too.  With FAKE_CUDA_GUARD=1 the stand-in driver's "device" memory is
 * opened (fake_cuda_device_access, resolved in the already loaded
 * $EPJIT_CUDA_DRIVER) only while the stand-in reads or writes it.
 *
 * Stream order: every send and receive reports its buffer and stream to
 * the stand-in driver (fake_cuda_stream_access, when it is loaded), which
 * refuses it -- ncclInvalidUsage, with a "stream order" line on stderr --
 * when a kernel or copy of another stream touched the buffer and this
 * stream is not ordered after it (a cuStreamWaitEvent on an event
 * recorded after it, or a host synchronization), and then makes every
 * later kernel, copy or fill of another stream that touches the buffer
 * fail until that stream has waited for an event recorded after the send
 * or receive: no kernel reads an exchange's rows before its completion
 * event, and none overwrites its send buffer while it is read.
 *
 * Test code: built only for make check, never installed.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

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
	E_REMOTE = 6,
};

typedef struct comm {
	unsigned magic;
	int nranks, rank;
	/* several ranks: the exchange folder, the next collective's number,
	 * messages sent to / received from each peer, failed */
	char dir[512];
	long long seq;
	long long *sent, *recvd;
	bool broken;
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
		int peer;
		struct comm *c;
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
	case E_REMOTE:
		return "remote process exited or there was a network error";
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

/* ---- several ranks: the exchange through files --------------------------- */

/* the stand-in driver's guard, when it is loaded and has one */
static void (*g_access)(int);
static bool g_tried;

static void dev_open(void)
{
	if (!g_tried) {
		g_tried = true;
		const char *d = getenv("EPJIT_CUDA_DRIVER");
		void *h = d && *d ? dlopen(d, RTLD_NOW | RTLD_NOLOAD) : NULL;
		void *f = h ? dlsym(h, "fake_cuda_device_access") : NULL;
		memcpy(&g_access, &f, sizeof f);
	}
	if (g_access)
		g_access(1);
}

static void dev_close(void)
{
	if (g_access)
		g_access(0);
}

/* The stand-in driver's stream order check (0: allowed, or no driver). */
static int (*g_order)(void *, const void *, size_t, int, const char *);
static bool g_order_tried;

static int stream_access(void *stream, const void *p, size_t n, int write,
			 const char *what)
{
	if (!g_order_tried) {
		g_order_tried = true;
		const char *d = getenv("EPJIT_CUDA_DRIVER");
		void *h = d && *d ? dlopen(d, RTLD_NOW | RTLD_NOLOAD) : NULL;
		void *f = h ? dlsym(h, "fake_cuda_stream_access") : NULL;
		memcpy(&g_order, &f, sizeof f);
	}
	return g_order ? g_order(stream, p, n, write, what) : 0;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double timeout_s(void)
{
	const char *t = getenv("FAKE_NCCL_TIMEOUT_S");
	double v = t ? atof(t) : 0;
	return v > 0 ? v : 30.0;
}

static void path_of(const comm *c, char *buf, size_t n, const char *fmt,
		    long long a, long long b, long long k)
{
	char name[96];
	snprintf(name, sizeof name, fmt, a, b, k);
	snprintf(buf, n, "%s/%s", c->dir, name);
}

/* Writes hdr + data as one file, atomically (a reader never sees a part). */
static bool put_file(const comm *c, const char *path, const void *hdr,
		     size_t hn, const void *data, size_t dn)
{
	char tmp[640];
	snprintf(tmp, sizeof tmp, "%s/.tmp.%d.%ld", c->dir, c->rank,
		 (long)getpid());
	FILE *f = fopen(tmp, "wb");
	if (!f)
		return false;
	bool ok = fwrite(hdr, 1, hn, f) == hn;
	if (ok && dn) {
		dev_open();
		ok = fwrite(data, 1, dn, f) == dn;
		dev_close();
	}
	ok = fclose(f) == 0 && ok;
	return ok && rename(tmp, path) == 0;
}

/* Waits for path (timeout) and reads it whole: malloc'ed, *n bytes; NULL
 * after the timeout (*timed_out) or on an I/O error. */
static unsigned char *get_file(const char *path, size_t *n, bool *timed_out)
{
	*timed_out = false;
	double end = now_s() + timeout_s();
	long wait_ns = 20000;
	for (;;) {
		FILE *f = fopen(path, "rb");
		if (f) {
			fseek(f, 0, SEEK_END);
			long len = ftell(f);
			fseek(f, 0, SEEK_SET);
			unsigned char *b = malloc((size_t)len + 1);
			bool ok =
			    b && fread(b, 1, (size_t)len, f) == (size_t)len;
			fclose(f);
			if (!ok) {
				free(b);
				return NULL;
			}
			*n = (size_t)len;
			return b;
		}
		if (errno != ENOENT || now_s() > end) {
			*timed_out = errno == ENOENT;
			return NULL;
		}
		struct timespec ts = { 0, wait_ns };
		nanosleep(&ts, NULL);
		if (wait_ns < 2000000)
			wait_ns *= 2;
	}
}

static int broken(comm *c, int r, const char *why)
{
	c->broken = true;
	return fail(c, r, why);
}

static const char *kind_name(int k)
{
	static const char *const n[] = { "ncclAllReduce", "ncclBroadcast",
					 "ncclReduce", "ncclAllGather",
					 "ncclReduceScatter" };
	return k >= 0 && k < 5 ? n[k] : "?";
}
enum { K_ALLREDUCE, K_BCAST, K_REDUCE, K_ALLGATHER, K_REDSCAT };

typedef struct coll_hdr {
	int kind, type, op, root;
	unsigned long long count, bytes; /* count as called; data bytes */
} coll_hdr;

/* One collective of several ranks: this rank's part (mine, mine_bytes) out,
 * every rank's part in parts[p] (malloc'ed, freed by the caller), after
 * the headers were checked against this rank's. */
static int exchange(comm *c, const coll_hdr *h, const void *mine,
		    size_t mine_bytes, unsigned char **parts)
{
	char path[640], why[256];
	if (c->broken)
		return fail(c, E_USAGE, "the communicator failed earlier");
	long long k = c->seq++;
	/* every peer has finished collective k - 2 (it wrote k - 1) */
	if (k >= 2) {
		path_of(c, path, sizeof path, "coll.%lld.%lld%.0lld", k - 2,
			c->rank, 0);
		unlink(path);
	}
	coll_hdr mh = *h;
	mh.bytes = mine_bytes;
	path_of(c, path, sizeof path, "coll.%lld.%lld%.0lld", k, c->rank, 0);
	if (!put_file(c, path, &mh, sizeof mh, mine, mine_bytes))
		return broken(c, E_SYSTEM, "writing the exchange file failed");
	for (int p = 0; p < c->nranks; p++)
		parts[p] = NULL;
	for (int p = 0; p < c->nranks; p++) {
		size_t n = 0;
		bool to = false;
		path_of(c, path, sizeof path, "coll.%lld.%lld%.0lld", k, p, 0);
		unsigned char *b = get_file(path, &n, &to);
		if (!b) {
			snprintf(why, sizeof why,
				 "%s (collective %lld): rank %d %s within "
				 "%g s",
				 kind_name(h->kind), k, p,
				 to ? "did not join" : "unreadable",
				 timeout_s());
			return broken(c, E_REMOTE, why);
		}
		coll_hdr ph;
		memcpy(&ph, b, sizeof ph);
		if (n < sizeof ph || ph.kind != h->kind || ph.type != h->type ||
		    ph.op != h->op || ph.root != h->root ||
		    ph.count != h->count || n - sizeof ph != ph.bytes) {
			snprintf(why, sizeof why,
				 "ranks disagree on collective %lld: rank %d "
				 "called %s(count %llu, type %d, op %d, root "
				 "%d), rank %d %s(count %llu, type %d, op %d, "
				 "root %d)",
				 k, c->rank, kind_name(h->kind), h->count,
				 h->type, h->op, h->root, p, kind_name(ph.kind),
				 ph.count, ph.type, ph.op, ph.root);
			free(b);
			return broken(c, E_USAGE, why);
		}
		memmove(b, b + sizeof ph, n - sizeof ph);
		parts[p] = b;
	}
	return OK;
}

static void free_parts(comm *c, unsigned char **parts)
{
	for (int p = 0; p < c->nranks; p++)
		free(parts[p]);
}

/* acc[0..n) = acc op x, elementwise, of type t */
#define RED_LOOP(T)                                                            \
	do {                                                                   \
		T *a = acc;                                                    \
		const T *b = x;                                                \
		for (size_t i = 0; i < n; i++)                                 \
			a[i] = op == 1	 ? (T)(a[i] * b[i])                    \
			       : op == 2 ? (a[i] > b[i] ? a[i] : b[i])         \
			       : op == 3 ? (a[i] < b[i] ? a[i] : b[i])         \
					 : (T)(a[i] + b[i]);                   \
	} while (0)

static bool reduce_into(void *acc, const void *x, size_t n, int t, int op)
{
	switch (t) {
	case 0:
		RED_LOOP(int8_t);
		return true;
	case 1:
		RED_LOOP(uint8_t);
		return true;
	case 2:
		RED_LOOP(int32_t);
		return true;
	case 3:
		RED_LOOP(uint32_t);
		return true;
	case 4:
		RED_LOOP(int64_t);
		return true;
	case 5:
		RED_LOOP(uint64_t);
		return true;
	case 7:
		RED_LOOP(float);
		return true;
	case 8:
		RED_LOOP(double);
		return true;
	}
	return false; /* half types: not in the stand-in */
}

static void avg_of(void *acc, size_t n, int t, int nranks)
{
	if (t == 7)
		for (size_t i = 0; i < n; i++)
			((float *)acc)[i] /= (float)nranks;
	else if (t == 8)
		for (size_t i = 0; i < n; i++)
			((double *)acc)[i] /= nranks;
}

/* The reduction over the ranks' parts, each `bytes` long from offset off,
 * in rank order, into a malloc'ed buffer (NULL: a type the stand-in does
 * not reduce). */
static void *reduce_parts(comm *c, unsigned char **parts, size_t off, size_t n,
			  int t, int op)
{
	size_t bytes = n * type_size(t);
	unsigned char *acc = malloc(bytes ? bytes : 1);
	if (!acc)
		return NULL;
	memcpy(acc, parts[0] + off, bytes);
	for (int p = 1; p < c->nranks; p++)
		if (!reduce_into(acc, parts[p] + off, n, t, op)) {
			free(acc);
			return NULL;
		}
	if (op == 4)
		avg_of(acc, n, t, c->nranks);
	return acc;
}

static void put_dev(void *dst, const void *src, size_t n)
{
	if (!n)
		return;
	dev_open();
	memmove(dst, src, n);
	dev_close();
	S.bytes_moved += (long long)n;
}

/* point to point of several ranks: a send's file, a receive's read */
static int p2p_send(comm *c, int peer, const void *s, size_t bytes)
{
	char path[640];
	path_of(c, path, sizeof path, "p2p.%lld.%lld.%lld", c->rank, peer,
		c->sent[peer]++);
	unsigned long long b = bytes;
	if (!put_file(c, path, &b, sizeof b, s, bytes))
		return broken(c, E_SYSTEM, "writing a send's file failed");
	S.bytes_moved += (long long)bytes;
	return OK;
}

static int p2p_recv(comm *c, int peer, void *r, size_t bytes)
{
	char path[640], why[256];
	long long k = c->recvd[peer]++;
	path_of(c, path, sizeof path, "p2p.%lld.%lld.%lld", peer, c->rank, k);
	size_t n = 0;
	bool to = false;
	unsigned char *b = get_file(path, &n, &to);
	if (!b) {
		snprintf(why, sizeof why,
			 "ncclRecv of %zu bytes from rank %d (message %lld): "
			 "%s within %g s",
			 bytes, peer, k, to ? "nothing sent" : "unreadable",
			 timeout_s());
		return broken(c, E_REMOTE, why);
	}
	unlink(path);
	unsigned long long sb;
	memcpy(&sb, b, sizeof sb);
	if (n < sizeof sb || sb != bytes) {
		snprintf(why, sizeof why,
			 "ncclRecv of %zu bytes from rank %d, which sent %llu "
			 "(message %lld): send and receive sizes differ",
			 bytes, peer, sb, k);
		free(b);
		return broken(c, E_USAGE, why);
	}
	put_dev(r, b + sizeof sb, bytes);
	free(b);
	return OK;
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
	/* rank 0 of several jobs may run at once: the folder's name (the
	 * first bytes) from the process, the time and a count */
	static unsigned long long made;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	for (int i = 0; i < 128; i++)
		issued[i] = (char)(rand() & 0xff);
	snprintf(issued, 64, "F%lx-%llx-%lx", (long)getpid(), ++made,
		 (long)(ts.tv_nsec ^ ts.tv_sec));
	issued[0] = 'F'; /* never all zero */
	memcpy(id->internal, issued, 128);
	issued_any = true;
	S.unique_ids++;
	return OK;
}

/* Several ranks: the folder of the id, a hello from each rank (which
 * checks that they agree on nranks and that no rank joins twice). */
static int init_many(comm **out, int nranks, ncclUniqueId id, int rank)
{
	if (id.internal[0] != 'F' || !memchr(id.internal, 0, 64))
		return fail(NULL, E_ARG,
			    "unique id was not made by ncclGetUniqueId");
	comm *c = calloc(1, sizeof *c);
	if (!c)
		return E_SYSTEM;
	c->magic = MAGIC;
	c->nranks = nranks;
	c->rank = rank;
	c->sent = calloc((size_t)nranks, sizeof *c->sent);
	c->recvd = calloc((size_t)nranks, sizeof *c->recvd);
	const char *base = getenv("FAKE_NCCL_DIR");
	if (!base || !*base)
		base = getenv("TMPDIR");
	if (!base || !*base)
		base = "/tmp";
	snprintf(c->dir, sizeof c->dir, "%s/fakenccl-%s", base, id.internal);
	char path[640], why[256];
	int r = OK;
	if (!c->sent || !c->recvd ||
	    (mkdir(c->dir, 0700) != 0 && errno != EEXIST))
		r = fail(NULL, E_SYSTEM, "cannot make the exchange folder");
	path_of(c, path, sizeof path, "hello.%lld%.0lld%.0lld", rank, 0, 0);
	int fd = r == OK ? open(path, O_CREAT | O_EXCL | O_WRONLY, 0600) : -1;
	if (r == OK && fd < 0) {
		snprintf(why, sizeof why, "rank %d joined twice", rank);
		r = fail(NULL, E_ARG, why);
	}
	if (fd >= 0) {
		if (write(fd, &nranks, sizeof nranks) != sizeof nranks)
			r = fail(NULL, E_SYSTEM, "writing the hello failed");
		close(fd);
	}
	for (int p = 0; p < nranks && r == OK; p++) {
		size_t n = 0;
		bool to = false;
		path_of(c, path, sizeof path, "hello.%lld%.0lld%.0lld", p, 0,
			0);
		/* a hello is written in place: wait until it is whole */
		unsigned char *b = NULL;
		double end = now_s() + timeout_s();
		while ((b = get_file(path, &n, &to)) && n < sizeof(int) &&
		       now_s() < end) {
			free(b);
			b = NULL;
		}
		int pn = 0;
		if (b && n >= sizeof pn)
			memcpy(&pn, b, sizeof pn);
		free(b);
		if (!b || n < sizeof pn) {
			snprintf(why, sizeof why,
				 "ncclCommInitRank: rank %d did not join "
				 "within %g s",
				 p, timeout_s());
			r = fail(NULL, E_REMOTE, why);
		} else if (pn != nranks) {
			snprintf(why, sizeof why,
				 "ncclCommInitRank: rank %d has nranks %d, "
				 "rank %d %d",
				 rank, nranks, p, pn);
			r = fail(NULL, E_ARG, why);
		}
	}
	if (r != OK) {
		free(c->sent);
		free(c->recvd);
		free(c);
		return r;
	}
	*out = c;
	S.inits++;
	S.last_nranks = nranks;
	S.last_rank = rank;
	return OK;
}

/* The last rank to destroy a communicator of several removes its folder
 * (every rank had finished its calls when it wrote its bye). */
static void destroy_many(comm *c)
{
	char path[640];
	path_of(c, path, sizeof path, "bye.%lld%.0lld%.0lld", c->rank, 0, 0);
	int fd = open(path, O_CREAT | O_WRONLY, 0600);
	if (fd >= 0)
		close(fd);
	for (int p = 0; p < c->nranks; p++) {
		path_of(c, path, sizeof path, "bye.%lld%.0lld%.0lld", p, 0, 0);
		if (access(path, F_OK) != 0)
			return;
	}
	DIR *d = opendir(c->dir);
	struct dirent *e;
	while (d && (e = readdir(d))) {
		if (e->d_name[0] == '.' &&
		    (!e->d_name[1] || (e->d_name[1] == '.' && !e->d_name[2])))
			continue;
		char full[1024];
		snprintf(full, sizeof full, "%s/%s", c->dir, e->d_name);
		unlink(full);
	}
	if (d)
		closedir(d);
	rmdir(c->dir);
}

int ncclCommInitRank(comm **out, int nranks, ncclUniqueId id, int rank);
int ncclCommInitRank(comm **out, int nranks, ncclUniqueId id, int rank)
{
	ENTER("ncclCommInitRank");
	if (!out)
		return fail(NULL, E_ARG, "comm is NULL");
	if (nranks < 1 || rank < 0 || rank >= nranks)
		return fail(NULL, E_ARG, "rank out of range");
	if (nranks > 1)
		return init_many(out, nranks, id, rank);
	if (!issued_any || memcmp(id.internal, issued, 128) != 0)
		return fail(NULL, E_ARG,
			    "unique id was not made by ncclGetUniqueId");
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
	if (c->nranks > 1)
		destroy_many(c);
	c->magic = 0;
	free(c->sent);
	free(c->recvd);
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
	if (c->nranks > 1)
		return fail(c, E_INTERNAL,
			    "the stand-in splits only communicators of one "
			    "rank (bootstrap one per group instead)");
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

/* A collective of several ranks (n: NCCL's count of the call). */
static int many(comm *c, int kind, const void *s, void *r, size_t n, int t,
		int op, int root)
{
	const size_t ts = type_size(t), P = (size_t)c->nranks;
	size_t mine = kind == K_BCAST	  ? (c->rank == root ? n * ts : 0)
		      : kind == K_REDSCAT ? n * P * ts
					  : n * ts;
	coll_hdr h = {
		.kind = kind, .type = t, .op = op, .root = root, .count = n
	};
	unsigned char **parts = calloc(P, sizeof *parts);
	if (!parts)
		return fail(c, E_SYSTEM, "out of memory");
	int e = exchange(c, &h, s, mine, parts);
	if (e) {
		free(parts);
		return e;
	}
	void *acc = NULL;
	switch (kind) {
	case K_BCAST:
		put_dev(r, parts[root], n * ts);
		break;
	case K_ALLGATHER:
		for (size_t p = 0; p < P; p++)
			put_dev((char *)r + p * n * ts, parts[p], n * ts);
		break;
	case K_ALLREDUCE:
	case K_REDUCE:
	case K_REDSCAT:
		if (kind == K_REDUCE && c->rank != root)
			break;
		acc = reduce_parts(
		    c, parts, kind == K_REDSCAT ? (size_t)c->rank * n * ts : 0,
		    n, t, op);
		if (!acc)
			e = fail(c, E_INTERNAL,
				 "the stand-in reduces no half types");
		else
			put_dev(r, acc, n * ts);
		free(acc);
		break;
	}
	free_parts(c, parts);
	free(parts);
	return e;
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
	S.all_reduces++;
	if (c->nranks > 1)
		return many(c, K_ALLREDUCE, s, r, n, t, op, 0);
	copy(r, s, n * type_size(t)); /* the sum over one rank */
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
	if (root < 0 || root >= c->nranks)
		return fail(c, E_ARG, "root out of range");
	if (n && (!r || (c->rank == root && !s)))
		return fail(c, E_ARG, "NULL buffer");
	S.broadcasts++;
	if (c->nranks > 1)
		return many(c, K_BCAST, s, r, n, t, 0, root);
	copy(r, s, n * type_size(t));
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
	if (root < 0 || root >= c->nranks)
		return fail(c, E_ARG, "root out of range");
	if (n && (!s || (c->rank == root && !r)))
		return fail(c, E_ARG, "NULL buffer");
	S.reduces++;
	if (c->nranks > 1)
		return many(c, K_REDUCE, s, r, n, t, op, root);
	copy(r, s, n * type_size(t));
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
	S.all_gathers++;
	if (c->nranks > 1)
		return many(c, K_ALLGATHER, s, r, n, t, 0, 0);
	copy(r, s, n * type_size(t));
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
	S.reduce_scatters++;
	if (c->nranks > 1)
		return many(c, K_REDSCAT, s, r, n, t, op, 0);
	copy(r, s, n * type_size(t));
	return OK;
}

static int p2p(comm *c, int t, int peer, void *stream, const char *what)
{
	int e = coll(c, t, 0, stream);
	if (e)
		return e;
	if (peer < 0 || peer >= c->nranks)
		return fail(c, E_ARG, "peer out of range");
	if (c->broken)
		return fail(c, E_USAGE, "the communicator failed earlier");
	if (G.depth == 0 && c->nranks == 1)
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
	if (stream_access(stream, s, n * type_size(t), 0, "ncclSend"))
		return fail(c, E_USAGE,
			    "stream order: the send buffer is "
			    "not ordered after its writer");
	S.sends++;
	if (G.depth == 0) /* several ranks, outside a group: now */
		return p2p_send(c, peer, s, n * type_size(t));
	G.s[G.ns++] = (struct p2p){
		.send = s, .bytes = n * type_size(t), .peer = peer, .c = c
	};
	return OK;
}

int ncclRecv(void *r, size_t n, int t, int peer, comm *c, void *stream);
int ncclRecv(void *r, size_t n, int t, int peer, comm *c, void *stream)
{
	ENTER("ncclRecv");
	int e = p2p(c, t, peer, stream, "receive from self outside a group");
	if (e)
		return e;
	if (stream_access(stream, r, n * type_size(t), 1, "ncclRecv"))
		return fail(c, E_USAGE,
			    "stream order: the receive buffer is "
			    "not ordered after its last user");
	S.recvs++;
	if (G.depth == 0)
		return p2p_recv(c, peer, r, n * type_size(t));
	G.r[G.nr++] = (struct p2p){
		.recv = r, .bytes = n * type_size(t), .peer = peer, .c = c
	};
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
	/* communicators of several ranks: every send out, then every
	 * receive in; those of one rank pair up below */
	int e = OK;
	for (int i = 0; i < G.ns; i++)
		if (G.s[i].c->nranks > 1 && e == OK)
			e = p2p_send(G.s[i].c, G.s[i].peer, G.s[i].send,
				     G.s[i].bytes);
	for (int i = 0; i < G.nr; i++)
		if (G.r[i].c->nranks > 1 && e == OK)
			e = p2p_recv(G.r[i].c, G.r[i].peer, G.r[i].recv,
				     G.r[i].bytes);
	if (e != OK)
		return e;
	int k = 0;
	for (int i = 0; i < G.ns; i++)
		if (G.s[i].c->nranks == 1)
			G.s[k++] = G.s[i];
	G.ns = k;
	k = 0;
	for (int i = 0; i < G.nr; i++)
		if (G.r[i].c->nranks == 1)
			G.r[k++] = G.r[i];
	G.nr = k;
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
