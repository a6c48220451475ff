/* tools/epjit_ckpt.c -- epjit-ckpt: inspect, export and reshard training
 * checkpoints (doc/ckpt.md, doc/epjit-ckpt.1).
 *
 *   info CKPT                     the set, its counters and its files
 *   to-hf CKPT DIR                one Hugging Face directory
 *   reshard CKPT --world N OUT    the checkpoint for another world / EP size
 *
 * A checkpoint is one of: a single-rank file (epj_engine_save on one
 * rank), a committed set (the record PATH of runtime/ckpt_set.c and its
 * files PATH.g<G>.rank<R>), or a legacy set (PATH.rank<R>, no record).
 * Every input is checked as the engine's load checks it (record, sizes,
 * checksums, generation, the same counters in every file) and against the
 * model: each rank's file must hold exactly the entries that its place in
 * the layout gives it.
 *
 * The layout (runtime/comm.c, runtime/autoep.c, runtime/optim.c): a world
 * of W ranks with EP size M.  Rank r holds the experts
 * [(r % M) L, (r % M + 1) L) of every MoE layer (L = E / M) and every dense
 * parameter.  A dense parameter's data-parallel group is the world (rank r
 * is its member r); an expert's is the W / M ranks with the same r % M
 * (member r / M).  With ZeRO stage >= 1 and a group of G > 1 ranks a
 * parameter of n elements is partitioned: member g holds the flat range
 * [g c, min(n, (g + 1) c)), c = ceil(n / G), as
 * "optimizer.master_shard.<name>" and "optimizer.<state>.<name>" (1-D);
 * otherwise its holders store the FP32 master under the HF name and the
 * state shaped like the parameter.  Gathering a parameter concatenates the
 * partitions in member order; resharding cuts the full values again for
 * the new layout.  Everything is float32 and moved bit for bit.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "runtime_impl.h"

#define PROG	     "epjit-ckpt"
#define TRAIN_FORMAT "epjit-train-checkpoint-1"
#define PATH_MAX_    4096

static void usage(FILE *fp)
{
	fputs("usage: " PROG " info CKPT [--model FILE]\n"
	      "       " PROG " to-hf CKPT DIR [--dtype bf16|f32] "
	      "[--max-shard-size BYTES]\n"
	      "                  [--model FILE] [--force]\n"
	      "       " PROG " reshard CKPT --world N [--ep M] OUT "
	      "[--model FILE] [--force]\n"
	      "Inspects, exports and reshards epjit training checkpoints "
	      "(single-rank files,\n"
	      "committed sets PATH + PATH.g<G>.rank<R>, legacy sets "
	      "PATH.rank<R>).\n"
	      "\n"
	      "  --model FILE           HF config.json of the model (default: "
	      "the config the\n"
	      "                         checkpoint carries)\n"
	      "  --dtype T              to-hf: f32 (default) or bf16\n"
	      "  --max-shard-size S     to-hf: bytes per file, e.g. 5GB "
	      "(default), 500MB,\n"
	      "                         2GiB, 4096\n"
	      "  --world N              reshard: the world size to resume on\n"
	      "  --ep M                 reshard: its expert_parallel."
	      "autoep_size (default:\n"
	      "                         the checkpoint's when it divides N, "
	      "else 1)\n"
	      "  --force                replace an existing DIR or OUT\n"
	      "  --help\n"
	      "Exit status: 0 ok, 1 error (an inconsistent checkpoint), 2 bad "
	      "command line.\n"
	      "See epjit-ckpt(1).\n",
	      fp);
}

static int fail_msg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int fail_msg(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs(PROG ": ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	return 1;
}

static int fail(const epj_ctx *ctx)
{
	const char *m = epj_ctx_error(ctx);
	return fail_msg("%s", m && *m ? m : "unknown error");
}

/* ---- the checkpoint ---------------------------------------------------- */

typedef struct rank_file {
	char path[PATH_MAX_];
	epj_st_file *f;
	int64_t bytes;
	char hash[33];
} rank_file;

typedef struct ckpt {
	const char *path;
	const char *kind; /* "single-rank file", "committed set", ... */
	int world, ep, zero;
	int64_t gen; /* 0: none */
	int64_t step, micro, opt;
	bool training;
	rank_file *r; /* [world] */
	/* the optimizer's state kinds besides the masters ("exp_avg", ...) */
	char kinds[8][32];
	int n_kinds;
} ckpt;

static void ckpt_free(ckpt *c)
{
	for (int i = 0; c->r && i < c->world; i++)
		epj_st_close(c->r[i].f);
	free(c->r);
	memset(c, 0, sizeof *c);
}

/* Metadata k of f as a whole decimal number in [0, max]; -1 when absent
 * or malformed. */
static int64_t meta_num_max(const epj_st_file *f, const char *k, int64_t max)
{
	const char *v = epj_st_metadata(f, k);
	if (!v || *v < '0' || *v > '9')
		return -1;
	char *end;
	errno = 0;
	long long x = strtoll(v, &end, 10);
	return errno || *end || x > max ? -1 : x;
}

/* The same in [0, INT32_MAX] (the step counters, the layout). */
static int64_t meta_num(const epj_st_file *f, const char *k)
{
	return meta_num_max(f, k, INT32_MAX);
}

static bool exists(const char *p)
{
	struct stat sb;
	return stat(p, &sb) == 0;
}

/* Opens r->path and hashes it. */
static epj_status open_rank(epj_ctx *ctx, rank_file *r)
{
	epj_status st = ej_file_hash(ctx, r->path, &r->bytes, r->hash);
	if (st == EPJ_OK)
		st = epj_st_open(ctx, r->path, &r->f);
	return st;
}

/* The counters and layout metadata of rank file i against the checkpoint
 * (set from rank 0's file or the record). */
static epj_status check_meta(epj_ctx *ctx, const ckpt *c, int i)
{
	const rank_file *r = &c->r[i];
	const epj_st_file *f = r->f;
	const char *fmt = epj_st_metadata(f, "format");
	if (!fmt || strcmp(fmt, TRAIN_FORMAT))
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: not a training checkpoint (metadata "
				"\"format\" is not \"%s\")",
				r->path, TRAIN_FORMAT);
	int64_t ws = meta_num(f, "world_size"), rk = meta_num(f, "rank");
	if (ws != c->world || rk != i)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint '%s': %s should be rank %d's file "
				"of a world of %d ranks; it says rank %s of "
				"%s",
				c->path, r->path, i, c->world,
				epj_st_metadata(f, "rank")
				    ? epj_st_metadata(f, "rank")
				    : "?",
				epj_st_metadata(f, "world_size")
				    ? epj_st_metadata(f, "world_size")
				    : "?");
	int64_t g = meta_num_max(f, "generation", EJ_CKPT_GEN_MAX);
	if (c->gen > 0 && g != c->gen)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint '%s' mixes saves: %s is generation "
				"%" PRId64 ", the set's is %" PRId64,
				c->path, r->path, g, c->gen);
	int64_t zs = meta_num(f, "zero_stage"), es = meta_num(f, "autoep_size");
	if (zs != c->zero || es != c->ep)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint '%s' mixes saves: %s has "
				"zero_stage %" PRId64 " and autoep_size "
				"%" PRId64 ", the set %d and %d",
				c->path, r->path, zs, es, c->zero, c->ep);
	int64_t s = meta_num(f, "step"), m = meta_num(f, "micro_step"),
		o = meta_num(f, "optimizer_steps");
	if (s != c->step || m != c->micro || o != c->opt)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint '%s' mixes saves: %s (rank %d) is "
				"at step %" PRId64 " (micro-step %" PRId64
				", optimizer step %" PRId64 "), %s at step "
				"%" PRId64 " (%" PRId64 ", %" PRId64 ")",
				c->path, r->path, i, s, m, o,
				c->gen > 0 ? "the record" : c->r[0].path,
				c->step, c->micro, c->opt);
	return EPJ_OK;
}

static epj_status open_set(epj_ctx *ctx, ckpt *c, const char *text, size_t len)
{
	ej_ckpt_set s;
	epj_status st = ej_ckpt_set_parse(ctx, c->path, text, len, &s);
	if (st != EPJ_OK)
		return st;
	c->kind = "committed set";
	c->world = (int)s.world;
	c->ep = (int)s.autoep_size;
	c->zero = (int)s.zero_stage;
	c->gen = s.generation;
	c->step = s.step;
	c->micro = s.micro_step;
	c->opt = s.optimizer_steps;
	c->training = true;
	c->r = calloc((size_t)c->world, sizeof *c->r);
	if (!c->r)
		st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	const char *sl = strrchr(c->path, '/');
	int dl = sl ? (int)(sl - c->path) + 1 : 0;
	for (int i = 0; st == EPJ_OK && i < c->world; i++) {
		rank_file *r = &c->r[i];
		snprintf(r->path, sizeof r->path, "%.*s%s", dl, c->path,
			 s.files[i].name);
		if (!exists(r->path)) {
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      "checkpoint set '%s' (generation "
				      "%" PRId64 ") is incomplete: rank %d's "
				      "file %s is missing",
				      c->path, c->gen, i, r->path);
			break;
		}
		st = ej_file_hash(ctx, r->path, &r->bytes, r->hash);
		if (st == EPJ_OK && (r->bytes != s.files[i].bytes ||
				     strcmp(r->hash, s.files[i].hash)))
			st = ej_error(
			    ctx, EPJ_ERR_FORMAT,
			    "checkpoint set '%s' (generation %" PRId64
			    "): rank %d's file %s is not the one the record "
			    "names (%" PRId64 " bytes, checksum %s; the "
			    "record: %" PRId64 " bytes, %s): a file of "
			    "another save or a damaged one",
			    c->path, c->gen, i, r->path, r->bytes, r->hash,
			    s.files[i].bytes, s.files[i].hash);
		if (st == EPJ_OK)
			st = epj_st_open(ctx, r->path, &r->f);
		if (st == EPJ_OK)
			st = check_meta(ctx, c, i);
	}
	ej_ckpt_set_free(&s);
	return st;
}

static epj_status open_legacy(epj_ctx *ctx, ckpt *c, const char *r0)
{
	rank_file first = { 0 };
	snprintf(first.path, sizeof first.path, "%s", r0);
	epj_status st = open_rank(ctx, &first);
	int64_t ws = st == EPJ_OK ? meta_num(first.f, "world_size") : 0;
	if (st == EPJ_OK && (ws < 2 || ws > 65536))
		st = ej_error(ctx, EPJ_ERR_FORMAT,
			      "%s: no \"world_size\" of 2 ranks or more in its "
			      "metadata: not a rank file",
			      r0);
	if (st != EPJ_OK) {
		epj_st_close(first.f);
		return st;
	}
	c->kind = "legacy set (no commit record)";
	c->world = (int)ws;
	c->ep = (int)meta_num(first.f, "autoep_size");
	c->zero = (int)meta_num(first.f, "zero_stage");
	c->step = meta_num(first.f, "step");
	c->micro = meta_num(first.f, "micro_step");
	c->opt = meta_num(first.f, "optimizer_steps");
	c->training = true;
	c->r = calloc((size_t)c->world, sizeof *c->r);
	if (!c->r) {
		epj_st_close(first.f);
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	}
	c->r[0] = first;
	st = check_meta(ctx, c, 0);
	for (int i = 1; st == EPJ_OK && i < c->world; i++) {
		rank_file *r = &c->r[i];
		snprintf(r->path, sizeof r->path, "%s.rank%d", c->path, i);
		if (!exists(r->path))
			st = ej_error(ctx, EPJ_ERR_FORMAT,
				      "checkpoint '%s' is incomplete: rank "
				      "%d's file %s is missing",
				      c->path, i, r->path);
		if (st == EPJ_OK)
			st = open_rank(ctx, r);
		if (st == EPJ_OK)
			st = check_meta(ctx, c, i);
	}
	return st;
}

/* Opens and checks checkpoint path (everything but the entries, which
 * need the model: check_entries). */
static epj_status ckpt_open(epj_ctx *ctx, const char *path, ckpt *c)
{
	memset(c, 0, sizeof *c);
	c->path = path;
	char *text = NULL;
	size_t len = 0;
	int rc = ej_ckpt_set_read(path, &text, &len);
	if (rc < 0)
		return ej_ckpt_set_read_error(ctx, path, rc);
	if (rc == 1) {
		epj_status st = open_set(ctx, c, text, len);
		free(text);
		return st;
	}
	char r0[PATH_MAX_];
	snprintf(r0, sizeof r0, "%s.rank0", path);
	if (!exists(path) && exists(r0))
		return open_legacy(ctx, c, r0);
	if (!exists(path))
		return ej_error(ctx, EPJ_ERR_IO,
				"%s: no such checkpoint (no file, no commit "
				"record, no %s)",
				path, r0);
	c->kind = "single-rank file";
	c->world = 1;
	c->ep = 1;
	c->r = calloc(1, sizeof *c->r);
	if (!c->r)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	snprintf(c->r[0].path, sizeof c->r[0].path, "%s", path);
	epj_status st = open_rank(ctx, &c->r[0]);
	if (st != EPJ_OK)
		return st;
	const epj_st_file *f = c->r[0].f;
	if (epj_st_metadata(f, "world_size") && epj_st_metadata(f, "rank"))
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"%s: rank %s's file of a checkpoint of %s "
				"ranks, not a checkpoint: give %s its set "
				"(the commit record, the path without "
				"\".g<G>.rank<R>\", or the legacy path without "
				"\".rank<R>\")",
				path, epj_st_metadata(f, "rank"),
				epj_st_metadata(f, "world_size"), PROG);
	const char *fmt = epj_st_metadata(f, "format");
	c->training = fmt && !strcmp(fmt, TRAIN_FORMAT);
	if (c->training) {
		c->step = meta_num(f, "step");
		c->micro = meta_num(f, "micro_step");
		c->opt = meta_num(f, "optimizer_steps");
		if (c->step < 0 || c->micro < 0 || c->opt < 0 ||
		    c->opt > c->step)
			return ej_error(ctx, EPJ_ERR_FORMAT,
					"%s: a training checkpoint without "
					"whole \"step\", \"micro_step\" and "
					"\"optimizer_steps\" metadata",
					path);
	}
	return EPJ_OK;
}

/* ---- the model ------------------------------------------------------- */

typedef struct param {
	const char *name; /* borrowed from the model */
	int ndim;
	int64_t shape[8];
	int64_t numel;
	int expert; /* index of the expert, -1 for a dense parameter */
} param;

typedef struct model_info {
	epj_model *m;
	param *p;
	int n;
	int experts; /* num_experts */
	char source[PATH_MAX_];
} model_info;

/* The expert index E of a name "... .experts.E. ...", else -1. */
static int expert_of(const char *name)
{
	const char *s = strstr(name, ".experts.");
	if (!s)
		return -1;
	s += 9;
	char *end;
	long e = strtol(s, &end, 10);
	return end > s && *end == '.' && e >= 0 && e < 1 << 20 ? (int)e : -1;
}

/* The model of --model FILE, else the config the checkpoint carries
 * (metadata "model_config"). */
static epj_status model_load(epj_ctx *ctx, const ckpt *c, const char *mpath,
			     model_info *mi)
{
	memset(mi, 0, sizeof *mi);
	epj_model_opts mo = { .layout = EPJ_LAYOUT_NESTED,
			      .seed = 1,
			      .dtype = EPJ_DTYPE_F32 };
	epj_status st;
	if (mpath) {
		snprintf(mi->source, sizeof mi->source, "%s", mpath);
		st = epj_model_new(ctx, mpath, &mo, &mi->m);
	} else {
		const char *txt = epj_st_metadata(c->r[0].f, "model_config");
		if (!txt)
			return ej_error(ctx, EPJ_ERR_INVALID,
					"%s: the checkpoint does not carry its "
					"model config (metadata "
					"\"model_config\"): give it with "
					"--model config.json",
					c->path);
		const char *td = getenv("TMPDIR");
		char tmp[PATH_MAX_];
		snprintf(tmp, sizeof tmp, "%s/epjit-ckpt-config.XXXXXX",
			 td && *td ? td : "/tmp");
		int fd = mkstemp(tmp);
		if (fd < 0)
			return ej_error(ctx, EPJ_ERR_IO, "%s: %s", tmp,
					strerror(errno));
		size_t n = strlen(txt);
		bool ok = write(fd, txt, n) == (ssize_t)n;
		close(fd);
		snprintf(mi->source, sizeof mi->source,
			 "the checkpoint's metadata");
		st = ok ? epj_model_new(ctx, tmp, &mo, &mi->m)
			: ej_error(ctx, EPJ_ERR_IO, "%s: write failed", tmp);
		unlink(tmp);
		if (st != EPJ_OK)
			ej_error_prefix(ctx, "%s: model_config", c->path);
	}
	if (st != EPJ_OK)
		return st;
	mi->n = epj_model_num_params(mi->m);
	mi->experts = mi->m->cfg.num_experts;
	mi->p = calloc((size_t)mi->n + 1, sizeof *mi->p);
	if (!mi->p)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	for (int i = 0; i < mi->n; i++) {
		epj_tensor *t = epj_model_param(mi->m, i);
		param *p = &mi->p[i];
		p->name = epj_model_param_name(mi->m, i);
		p->ndim = epj_tensor_ndim(t);
		EJ_ASSERT(p->ndim <= 8);
		memcpy(p->shape, epj_tensor_shape(t),
		       sizeof(int64_t) * (size_t)p->ndim);
		p->numel = epj_tensor_numel(t);
		p->expert = expert_of(p->name);
	}
	return EPJ_OK;
}

static void model_free(model_info *mi)
{
	free(mi->p);
	epj_model_free(mi->m);
	memset(mi, 0, sizeof *mi);
}

/* ---- the layout ------------------------------------------------------ */

typedef struct layout {
	int world, ep, zero, experts;
} layout;

/* The ranks holding p (in the order of their data-parallel group) and
 * whether it is partitioned over them.  holders has room for world. */
static int holders(const layout *l, const param *p, int *h, bool *sharded)
{
	int n = 0;
	if (p->expert < 0) {
		for (int r = 0; r < l->world; r++)
			h[n++] = r;
	} else {
		int per = l->experts / l->ep, q = p->expert / per;
		for (int g = 0; g < l->world / l->ep; g++)
			h[n++] = g * l->ep + q;
	}
	*sharded = l->zero >= 1 && n > 1;
	return n;
}

/* Member g's partition [lo, hi) of n elements over G (runtime/optim.c). */
static void partition(int64_t n, int G, int g, int64_t *lo, int64_t *hi)
{
	int64_t chunk = (n + G - 1) / G;
	int64_t a = (int64_t)g * chunk;
	*lo = a < n ? a : n;
	*hi = a + chunk < n ? a + chunk : n;
}

static layout ckpt_layout(const ckpt *c, const model_info *mi)
{
	return (layout){ c->world, c->ep, c->zero, mi->experts };
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The optimizer's state kinds of the checkpoint, from its rank 0 file. */
static epj_status find_kinds(epj_ctx *ctx, ckpt *c)
{
	const epj_st_file *f = c->r[0].f;
	for (int i = 0; i < epj_st_count(f); i++) {
		const char *nm = epj_st_name_at(f, i);
		if (strncmp(nm, "optimizer.", 10))
			continue;
		const char *k = nm + 10, *dot = strchr(k, '.');
		size_t kl = dot ? (size_t)(dot - k) : 0;
		if (!dot || kl == 0 || kl >= sizeof c->kinds[0])
			return ej_error(ctx, EPJ_ERR_FORMAT,
					"%s: entry \"%s\" is no optimizer "
					"state",
					c->r[0].path, nm);
		if (kl == 12 && !strncmp(k, "master_shard", 12))
			continue;
		bool seen = false;
		for (int j = 0; j < c->n_kinds && !seen; j++)
			seen = strlen(c->kinds[j]) == kl &&
			       !strncmp(c->kinds[j], k, kl);
		if (seen)
			continue;
		if (c->n_kinds == (int)EJ_ARRAY_LEN(c->kinds))
			return ej_error(ctx, EPJ_ERR_FORMAT,
					"%s: more than %d kinds of optimizer "
					"state",
					c->r[0].path,
					(int)EJ_ARRAY_LEN(c->kinds));
		memcpy(c->kinds[c->n_kinds], k, kl);
		c->kinds[c->n_kinds++][kl] = '\0';
	}
	return EPJ_OK;
}

/* Every rank file holds exactly the entries its place in the layout gives
 * it: each parameter it holds (the HF name, or its master shard) and each
 * state kind of it; nothing else.  Counts the sharded parameters. */
static epj_status check_entries(epj_ctx *ctx, const ckpt *c,
				const model_info *mi, int *n_sharded)
{
	layout l = ckpt_layout(c, mi);
	if (mi->experts > 0 && (c->ep < 1 || mi->experts % c->ep))
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"checkpoint '%s': autoep_size %d does not "
				"divide the model's %d experts (%s): the wrong "
				"--model?",
				c->path, c->ep, mi->experts, mi->source);
	int *h = malloc(sizeof *h * (size_t)c->world);
	size_t cap = (size_t)mi->n * (size_t)(c->n_kinds + 1) + 1;
	char **want = calloc(cap, sizeof *want);
	epj_status st =
	    h && want ? EPJ_OK : ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	*n_sharded = 0;
	for (int r = 0; st == EPJ_OK && r < c->world; r++) {
		size_t nw = 0;
		for (int i = 0; st == EPJ_OK && i < mi->n; i++) {
			const param *p = &mi->p[i];
			bool sh;
			int n = holders(&l, p, h, &sh);
			bool mine = false;
			for (int k = 0; k < n; k++)
				mine |= h[k] == r;
			if (!mine)
				continue;
			*n_sharded += sh && r == 0;
			char buf[1024];
			snprintf(buf, sizeof buf, "%s%s",
				 sh ? "optimizer.master_shard." : "", p->name);
			want[nw++] = strdup(buf);
			for (int k = 0; c->training && k < c->n_kinds; k++) {
				snprintf(buf, sizeof buf, "optimizer.%s.%s",
					 c->kinds[k], p->name);
				want[nw++] = strdup(buf);
			}
			if (!want[nw - 1])
				st = ej_error(ctx, EPJ_ERR_NOMEM,
					      "out of memory");
		}
		if (st == EPJ_OK)
			qsort(want, nw, sizeof *want, cmp_str);
		const epj_st_file *f = c->r[r].f;
		int nf = epj_st_count(f);
		size_t a = 0;
		int b = 0;
		while (st == EPJ_OK && (a < nw || b < nf)) {
			int d = a == nw ? 1
				: b == nf
				    ? -1
				    : strcmp(want[a], epj_st_name_at(f, b));
			if (d == 0) {
				a++, b++;
				continue;
			}
			if (d < 0)
				st = ej_error(
				    ctx, EPJ_ERR_FORMAT,
				    "checkpoint '%s': rank %d's file %s lacks "
				    "\"%s\" (world %d, autoep_size %d, ZeRO "
				    "stage %d; model from %s)",
				    c->path, r, c->r[r].path, want[a], c->world,
				    c->ep, c->zero, mi->source);
			else
				st = ej_error(
				    ctx, EPJ_ERR_FORMAT,
				    "checkpoint '%s': rank %d's file %s holds "
				    "\"%s\", which is not its part of the "
				    "layout (world %d, autoep_size %d, ZeRO "
				    "stage %d; model from %s)",
				    c->path, r, c->r[r].path,
				    epj_st_name_at(f, b), c->world, c->ep,
				    c->zero, mi->source);
		}
		for (size_t k = 0; k < nw; k++)
			free(want[k]);
		memset(want, 0, sizeof *want * nw);
	}
	free(want);
	free(h);
	return st;
}

/* Entry name of rank file r into dst[n] as f32. */
static epj_status read_entry(epj_ctx *ctx, const rank_file *r, const char *name,
			     int64_t n, float *dst)
{
	epj_tensor *t = epj_st_get(ctx, r->f, name);
	if (!t)
		return ctx->status;
	epj_tensor *c = epj_tensor_dtype(t) == EPJ_DTYPE_F32
			    ? epj_tensor_ref(t)
			    : epj_cast(ctx, t, EPJ_DTYPE_F32);
	epj_status st = c ? EPJ_OK : ctx->status;
	if (st == EPJ_OK && epj_tensor_numel(c) != n)
		st = ej_error(ctx, EPJ_ERR_SHAPE,
			      "%s: \"%s\" has %" PRId64 " elements; the "
			      "layout gives it %" PRId64,
			      r->path, name, epj_tensor_numel(c), n);
	if (st == EPJ_OK && n > 0)
		memcpy(dst, epj_tensor_data(c), sizeof(float) * (size_t)n);
	epj_tensor_free(c);
	epj_tensor_free(t);
	return st;
}

/* The full values of p's master (kind NULL) or of its state `kind`, in
 * buf[p->numel], gathered from the partitions. */
static epj_status gather(epj_ctx *ctx, const ckpt *c, const model_info *mi,
			 const param *p, const char *kind, float *buf)
{
	layout l = ckpt_layout(c, mi);
	int *h = malloc(sizeof *h * (size_t)c->world);
	if (!h)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	bool sh;
	int n = holders(&l, p, h, &sh);
	char nm[1024];
	if (!sh) {
		if (kind)
			snprintf(nm, sizeof nm, "optimizer.%s.%s", kind,
				 p->name);
		else
			snprintf(nm, sizeof nm, "%s", p->name);
		epj_status st = read_entry(ctx, &c->r[h[0]], nm, p->numel, buf);
		free(h);
		return st;
	}
	snprintf(nm, sizeof nm, "optimizer.%s.%s", kind ? kind : "master_shard",
		 p->name);
	epj_status st = EPJ_OK;
	for (int g = 0; st == EPJ_OK && g < n; g++) {
		int64_t lo, hi;
		partition(p->numel, n, g, &lo, &hi);
		st = read_entry(ctx, &c->r[h[g]], nm, hi - lo, buf + lo);
	}
	free(h);
	return st;
}

/* Opens CKPT, its model, and checks both together. */
static int load_all(epj_ctx *ctx, const char *path, const char *mpath, ckpt *c,
		    model_info *mi, int *n_sharded)
{
	if (ckpt_open(ctx, path, c) != EPJ_OK)
		return fail(ctx);
	if (find_kinds(ctx, c) != EPJ_OK ||
	    model_load(ctx, c, mpath, mi) != EPJ_OK ||
	    check_entries(ctx, c, mi, n_sharded) != EPJ_OK)
		return fail(ctx);
	return 0;
}

/* ---- info ------------------------------------------------------------ */

static int cmd_info(epj_ctx *ctx, const char *path, const char *mpath)
{
	ckpt c;
	model_info mi = { 0 };
	int n_sh = 0;
	int rc = load_all(ctx, path, mpath, &c, &mi, &n_sh);
	if (rc == 0) {
		printf("checkpoint: %s (%s", path, c.kind);
		if (c.gen > 0)
			printf(", generation %" PRId64, c.gen);
		printf(")\n");
		printf("world_size: %d\nautoep_size: %d\nzero_stage: %d\n",
		       c.world, c.ep, c.zero);
		if (c.training)
			printf("step: %" PRId64 "\nmicro_step: %" PRId64
			       "\noptimizer_steps: %" PRId64 "\n",
			       c.step, c.micro, c.opt);
		else
			printf("progress: none (weights only)\n");
		/* the dtypes of the entries, over every file */
		char dts[64] = "";
		for (int r = 0; r < c.world; r++)
			for (int i = 0; i < epj_st_count(c.r[r].f); i++) {
				const char *d =
				    epj_st_dtype_str_at(c.r[r].f, i);
				if (!strstr(dts, d) &&
				    strlen(dts) + strlen(d) + 2 < sizeof dts)
					snprintf(dts + strlen(dts),
						 sizeof dts - strlen(dts),
						 "%s%s", *dts ? " " : "", d);
			}
		printf("dtype: %s\n", dts);
		printf("optimizer state:");
		for (int k = 0; k < c.n_kinds; k++)
			printf(" %s", c.kinds[k]);
		printf("%s\n", c.n_kinds ? "" : " none");
		int64_t el = 0;
		for (int i = 0; i < mi.n; i++)
			el += mi.p[i].numel;
		printf("model: %s, %d parameters, %" PRId64 " elements, %d "
		       "experts\n",
		       mi.source, mi.n, el, mi.experts);
		printf("partitioned (ZeRO): %d parameters\n", n_sh);
		for (int r = 0; r < c.world; r++)
			printf("rank %d: %s %" PRId64 " bytes xxh3_128 %s%s\n",
			       r, c.r[r].path, c.r[r].bytes, c.r[r].hash,
			       c.gen > 0 ? " ok (the record's)" : "");
		printf("consistent: yes\n");
	}
	model_free(&mi);
	ckpt_free(&c);
	return rc;
}

/* ---- output folders and files ---------------------------------------- */

static epj_status put_text(epj_ctx *ctx, FILE *fp, const char *tmp, void *u)
{
	if (fputs(u, fp) == EOF)
		return ej_error(ctx, EPJ_ERR_IO, "write '%s'", tmp);
	return EPJ_OK;
}

/* ---- what a command must never replace or remove ---------------------
 *
 * An output never is, and never holds, a file the command reads: files are
 * compared by device and inode (so "./a.ckpt", a hard link and a symbolic
 * link to an input are the input), never by name. */

typedef struct file_id {
	dev_t dev;
	ino_t ino;
	const char *path; /* borrowed */
} file_id;

typedef struct inputs {
	file_id *id;
	int n;
} inputs;

static void inputs_add(inputs *in, const char *p)
{
	struct stat sb;
	if (p && stat(p, &sb) == 0)
		in->id[in->n++] = (file_id){ sb.st_dev, sb.st_ino, p };
}

/* The files a command reads: the checkpoint (its record or file), every
 * rank file, the --model file. */
static epj_status inputs_of(epj_ctx *ctx, const ckpt *c, const char *mpath,
			    inputs *in)
{
	in->n = 0;
	in->id = calloc((size_t)c->world + 2, sizeof *in->id);
	if (!in->id)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	inputs_add(in, c->path);
	for (int i = 0; i < c->world; i++)
		inputs_add(in, c->r[i].path);
	inputs_add(in, mpath);
	return EPJ_OK;
}

/* The input that sb is, or NULL. */
static const char *input_is(const inputs *in, const struct stat *sb)
{
	for (int i = 0; in && i < in->n; i++)
		if (in->id[i].dev == sb->st_dev && in->id[i].ino == sb->st_ino)
			return in->id[i].path;
	return NULL;
}

/* The input that path p names (itself, or what it links to), or NULL. */
static const char *input_at(const inputs *in, const char *p)
{
	struct stat sb;
	const char *r = NULL;
	if (lstat(p, &sb) == 0)
		r = input_is(in, &sb);
	if (!r && stat(p, &sb) == 0)
		r = input_is(in, &sb);
	return r;
}

/* A new folder "<base><tag>XXXXXX" of this process (mkdtemp: a name no one
 * else can have made, mode 0700), into buf[PATH_MAX_]. */
static int private_dir(const char *base, const char *tag, char *buf)
{
	if (snprintf(buf, PATH_MAX_, "%s%sXXXXXX", base, tag) >= PATH_MAX_)
		return fail_msg("%s: path too long", base);
	if (!mkdtemp(buf))
		return fail_msg("%s: cannot create: %s", buf, strerror(errno));
	return 0;
}

/* Removes dir, a folder this process made or moved into one it made, and
 * what it holds: entries are unlinked through the folder's descriptor (a
 * symbolic link is removed, never followed), subfolders down to `depth`
 * levels.  What cannot be removed stays, named in a warning. */
static void remove_tree(const char *dir, int depth)
{
	int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	DIR *dp = dfd >= 0 ? fdopendir(dfd) : NULL;
	struct dirent *de;
	while (dp && (de = readdir(dp))) {
		const char *nm = de->d_name;
		struct stat sb;
		char p[PATH_MAX_];
		if (!strcmp(nm, ".") || !strcmp(nm, "..") ||
		    fstatat(dfd, nm, &sb, AT_SYMLINK_NOFOLLOW) != 0)
			continue;
		if (!S_ISDIR(sb.st_mode))
			unlinkat(dfd, nm, 0);
		else if (depth > 0 && snprintf(p, sizeof p, "%s/%s", dir, nm) <
					  (int)sizeof p)
			remove_tree(p, depth - 1);
	}
	if (dp)
		closedir(dp);
	else if (dfd >= 0)
		close(dfd);
	if (rmdir(dir) != 0 && errno != ENOENT)
		fprintf(stderr, PROG ": warning: %s left in place: %s\n", dir,
			strerror(errno));
}

/* What an output path is now. */
enum { OUT_NONE, OUT_EMPTY_DIR, OUT_DIR, OUT_FILE };

/* The entries of folder dir: *n of them; 1 (a message printed) when one
 * is a folder (with force: to-hf replaces a folder of files only) or an
 * input. */
static int out_entries(const char *dir, bool force, const inputs *in, int *n)
{
	int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	DIR *dp = dfd >= 0 ? fdopendir(dfd) : NULL;
	if (!dp) {
		int e = errno;
		if (dfd >= 0)
			close(dfd);
		return fail_msg("%s: cannot read: %s", dir, strerror(e));
	}
	int rc = 0;
	struct dirent *de;
	*n = 0;
	while (rc == 0 && (de = readdir(dp))) {
		const char *nm = de->d_name, *is;
		struct stat sb;
		if (!strcmp(nm, ".") || !strcmp(nm, ".."))
			continue;
		++*n;
		if (fstatat(dfd, nm, &sb, AT_SYMLINK_NOFOLLOW) != 0)
			continue;
		if (S_ISDIR(sb.st_mode) && force)
			rc = fail_msg("%s holds the folder %s/%s: --force "
				      "replaces a folder of files only (remove "
				      "it yourself, or give another DIR)",
				      dir, dir, nm);
		else if ((is = input_is(in, &sb)))
			rc = fail_msg("%s holds %s/%s, an input of this "
				      "export (%s): give another DIR",
				      dir, dir, nm, is);
	}
	closedir(dp);
	return rc;
}

/* Whether to-hf may write DIR (replace it, with force): never a symbolic
 * link (what it points to is not the tool's to replace), never an input
 * or a folder holding one; *kind says what DIR is.  0, else 1 with a
 * message. */
static int out_check(const char *dir, bool force, const inputs *in, int *kind)
{
	struct stat sb;
	if (lstat(dir, &sb) != 0) {
		*kind = OUT_NONE;
		return errno == ENOENT
			   ? 0
			   : fail_msg("%s: %s", dir, strerror(errno));
	}
	if (S_ISLNK(sb.st_mode))
		return fail_msg(
		    "%s is a symbolic link: give the folder itself, "
		    "or remove the link (to-hf never writes into "
		    "or replaces what a link points to)",
		    dir);
	const char *is = input_is(in, &sb);
	if (is)
		return fail_msg("%s is an input of this export (%s): give "
				"another DIR",
				dir, is);
	int n = 1, rc = 0;
	if (S_ISDIR(sb.st_mode))
		rc = out_entries(dir, force, in, &n);
	*kind = !S_ISDIR(sb.st_mode) ? OUT_FILE : n ? OUT_DIR : OUT_EMPTY_DIR;
	if (rc == 0 && n && !force)
		rc = fail_msg("%s exists and is not an empty folder: give "
			      "another DIR, or --force to replace it",
			      dir);
	return rc;
}

/* "5GB" (10^9), "2GiB" (2^30), "500MB", "4096" -> bytes; -1 when bad. */
static int64_t parse_size(const char *s)
{
	char *end;
	errno = 0;
	long long v = strtoll(s, &end, 10);
	if (errno || end == s || v <= 0 || *s == '-')
		return -1;
	static const struct {
		const char *suf;
		int64_t mul;
	} u[] = { { "", 1 },	      { "B", 1 },	    { "KB", 1000 },
		  { "MB", 1000000 },  { "GB", 1000000000 }, { "KiB", 1 << 10 },
		  { "MiB", 1 << 20 }, { "GiB", 1 << 30 } };
	for (size_t i = 0; i < EJ_ARRAY_LEN(u); i++) {
		int64_t r;
		if (!strcmp(end, u[i].suf))
			return __builtin_mul_overflow((int64_t)v, u[i].mul, &r)
				   ? -1
				   : r;
	}
	return -1;
}

/* ---- to-hf ----------------------------------------------------------- */

/* text (malloc'ed, or NULL) with a final newline; NULL when out of memory. */
static char *with_newline(char *text)
{
	if (!text)
		return NULL;
	size_t n = strlen(text);
	char *t = realloc(text, n + 2);
	if (!t) {
		free(text);
		return NULL;
	}
	memcpy(t + n, "\n", 2);
	return t;
}

/* dir/name into p[PATH_MAX_]. */
static epj_status join(epj_ctx *ctx, char *p, const char *dir, const char *name)
{
	int n = snprintf(p, PATH_MAX_, "%s/%s", dir, name);
	if (n < 0 || n >= PATH_MAX_)
		return ej_error(ctx, EPJ_ERR_INVALID, "%s/%s: path too long",
				dir, name);
	return EPJ_OK;
}

typedef struct hf_opts {
	bool bf16, force;
	int64_t max_shard;
} hf_opts;

static epj_status write_hf(epj_ctx *ctx, const ckpt *c, const model_info *mi,
			   const hf_opts *o, const char *tmp)
{
	epj_status st = EPJ_OK;
	int64_t esz = o->bf16 ? 2 : 4, total = 0;
	/* shard k of n_shards holds parameters [first[k], first[k + 1]):
	 * HF's greedy split in model order (a tensor over the limit alone) */
	int *first = calloc((size_t)mi->n + 2, sizeof *first);
	if (!first)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	int n_shards = 0;
	int64_t cur = 0;
	for (int i = 0; i < mi->n; i++) {
		int64_t b = mi->p[i].numel * esz;
		if (n_shards == 0 || (cur > 0 && cur + b > o->max_shard)) {
			first[n_shards++] = i;
			cur = 0;
		}
		cur += b;
		total += b;
	}
	first[n_shards] = mi->n;
	json_t *wmap = json_object();
	float *buf = NULL;
	char fname[64], p[PATH_MAX_];
	for (int k = 0; st == EPJ_OK && k < n_shards; k++) {
		if (n_shards == 1)
			snprintf(fname, sizeof fname, "model.safetensors");
		else
			snprintf(fname, sizeof fname,
				 "model-%05d-of-%05d.safetensors", k + 1,
				 n_shards);
		epj_st_writer *w = NULL;
		st = epj_st_writer_new(ctx, &w);
		if (st == EPJ_OK)
			st = epj_st_writer_set_metadata(w, "format", "pt");
		for (int i = first[k]; st == EPJ_OK && i < first[k + 1]; i++) {
			const param *pa = &mi->p[i];
			free(buf);
			buf = malloc(sizeof(float) * (size_t)(pa->numel + 1));
			if (!buf) {
				st = ej_error(ctx, EPJ_ERR_NOMEM,
					      "out of memory for %s", pa->name);
				break;
			}
			st = gather(ctx, c, mi, pa, NULL, buf);
			epj_tensor *t =
			    st == EPJ_OK
				? epj_tensor_from_data(ctx, EPJ_DTYPE_F32,
						       pa->ndim, pa->shape, buf)
				: NULL;
			epj_tensor *x = t && o->bf16
					    ? epj_cast(ctx, t, EPJ_DTYPE_BF16)
					    : epj_tensor_ref(t);
			if (st == EPJ_OK)
				st = x ? epj_st_writer_add(w, pa->name, x)
				       : ctx->status;
			epj_tensor_free(x);
			epj_tensor_free(t);
			if (st == EPJ_OK && wmap)
				json_object_set_new(wmap, pa->name,
						    json_string(fname));
		}
		if (st == EPJ_OK)
			st = join(ctx, p, tmp, fname);
		if (st == EPJ_OK)
			st = epj_st_writer_save(w, p);
		epj_st_writer_free(w);
	}
	free(buf);
	free(first);
	if (st == EPJ_OK && n_shards > 1) {
		json_t *idx = json_pack("{s{sI}sO}", "metadata", "total_size",
					(json_int_t)total, "weight_map", wmap);
		char *text = idx ? with_newline(json_dumps(
				       idx, JSON_INDENT(2) | JSON_SORT_KEYS))
				 : NULL;
		json_decref(idx);
		st = join(ctx, p, tmp, "model.safetensors.index.json");
		if (st == EPJ_OK)
			st = text ? ej_write_atomic(ctx, "index", p, put_text,
						    text)
				  : ej_error(ctx, EPJ_ERR_NOMEM,
					     "out of memory");
		free(text);
	}
	json_decref(wmap);
	if (st == EPJ_OK) {
		char *cfg = with_newline(ej_model_config_json(
		    &mi->m->cfg, o->bf16 ? "bfloat16" : "float32"));
		st = join(ctx, p, tmp, "config.json");
		if (st == EPJ_OK)
			st =
			    cfg ? ej_write_atomic(ctx, "config", p, put_text,
						  cfg)
				: ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
		free(cfg);
	}
	if (st == EPJ_OK)
		printf(PROG ": %d parameters, %" PRId64 " bytes of %s in %d "
			    "file%s\n",
		       mi->n, total, o->bf16 ? "bf16" : "f32", n_shards,
		       n_shards == 1 ? "" : "s");
	return st;
}

/* The commit of a written folder work: it becomes dir, and what dir was
 * (kind; a file or a folder of files, checked) is moved into a private
 * folder, then removed.  0, else 1 with dir as it was. */
static int to_hf_commit(const char *work, const char *dir, int kind)
{
	char aside[PATH_MAX_] = "", old[PATH_MAX_];
	int rc = 0;
	bool moved = false;
	if (kind == OUT_DIR || kind == OUT_FILE) {
		rc = private_dir(dir, ".old.", aside);
		if (rc == 0 &&
		    snprintf(old, sizeof old, "%s/old", aside) >= PATH_MAX_)
			rc = fail_msg("%s: path too long", aside);
		if (rc == 0 && rename(dir, old) != 0)
			rc = fail_msg("%s: cannot move aside: %s", dir,
				      strerror(errno));
		moved = rc == 0;
	}
	if (rc == 0 && rename(work, dir) != 0) {
		rc = fail_msg("%s: cannot rename %s to it: %s", dir, work,
			      strerror(errno));
		if (moved && rename(old, dir) != 0) {
			fail_msg("%s: could not be put back: it is %s", dir,
				 old);
			return rc; /* aside stays: it holds the old DIR */
		}
	}
	if (*aside)
		remove_tree(aside, 1);
	return rc;
}

static int cmd_to_hf(epj_ctx *ctx, const char *path, const char *dir_arg,
		     const char *mpath, const hf_opts *o)
{
	/* "DIR/" names what DIR points to: the folder is DIR itself */
	char dir[PATH_MAX_];
	size_t dl = strlen(dir_arg);
	while (dl > 1 && dir_arg[dl - 1] == '/')
		dl--;
	if (dl >= sizeof dir)
		return fail_msg("%s: path too long", dir_arg);
	memcpy(dir, dir_arg, dl);
	dir[dl] = '\0';
	int kind;
	if (out_check(dir, o->force, NULL, &kind) != 0)
		return 1;
	ckpt c;
	model_info mi = { 0 };
	inputs in = { 0 };
	int n_sh = 0;
	int rc = load_all(ctx, path, mpath, &c, &mi, &n_sh);
	if (rc == 0 && inputs_of(ctx, &c, mpath, &in) != EPJ_OK)
		rc = fail(ctx);
	if (rc == 0)
		rc = out_check(dir, o->force, &in, &kind);
	/* written in a folder of this process, then renamed into place */
	char work[PATH_MAX_];
	bool made = false;
	if (rc == 0)
		made = (rc = private_dir(dir, ".tmp.", work)) == 0;
	if (rc == 0 && write_hf(ctx, &c, &mi, o, work) != EPJ_OK)
		rc = fail(ctx);
	mode_t um = umask(0);
	umask(um);
	if (rc == 0 && chmod(work, 0777 & ~um) != 0)
		rc = fail_msg("%s: chmod: %s", work, strerror(errno));
	/* DIR again, just before the commit: the whole folder appears at once
	 */
	if (rc == 0)
		rc = out_check(dir, o->force, &in, &kind);
	if (rc == 0)
		rc = to_hf_commit(work, dir, kind);
	if (made && rc != 0)
		remove_tree(work, 0);
	if (rc == 0)
		printf(PROG ": wrote %s\n", dir);
	free(in.id);
	model_free(&mi);
	ckpt_free(&c);
	return rc;
}

/* ---- reshard --------------------------------------------------------- */

typedef struct reshard_opts {
	int world, ep;
	bool force;
} reshard_opts;

static epj_status add_meta(epj_st_writer *w, const char *k, int64_t v)
{
	char b[32];
	snprintf(b, sizeof b, "%" PRId64, v);
	return epj_st_writer_set_metadata(w, k, b);
}

/* Adds p's full values buf (or member g of G's partition of them) to w
 * under name. */
static epj_status add_part(epj_ctx *ctx, epj_st_writer *w, const char *name,
			   const param *p, const float *buf, bool sh, int G,
			   int g)
{
	epj_tensor *t;
	if (sh) {
		int64_t lo, hi;
		partition(p->numel, G, g, &lo, &hi);
		int64_t len = hi - lo;
		t = epj_tensor_from_data(ctx, EPJ_DTYPE_F32, 1, &len, buf + lo);
	} else {
		t = epj_tensor_from_data(ctx, EPJ_DTYPE_F32, p->ndim, p->shape,
					 buf);
	}
	epj_status st = t ? epj_st_writer_add(w, name, t) : ctx->status;
	epj_tensor_free(t);
	return st;
}

/* The N writers' metadata: the progress, the layout (several ranks), the
 * model config. */
static epj_status reshard_meta(epj_ctx *ctx, const ckpt *c,
			       const model_info *mi, int N, int M,
			       int64_t micro, int64_t gen, epj_st_writer **w)
{
	epj_status st = EPJ_OK;
	for (int r = 0; st == EPJ_OK && r < N; r++) {
		st = epj_st_writer_new(ctx, &w[r]);
		if (st == EPJ_OK)
			st = epj_st_writer_set_metadata(w[r], "format",
							TRAIN_FORMAT);
		if (st == EPJ_OK)
			st = add_meta(w[r], "step", c->step);
		if (st == EPJ_OK)
			st = add_meta(w[r], "micro_step", micro);
		if (st == EPJ_OK)
			st = add_meta(w[r], "optimizer_steps", c->opt);
		if (st == EPJ_OK && N > 1) {
			st = add_meta(w[r], "world_size", N);
			if (st == EPJ_OK)
				st = add_meta(w[r], "rank", r);
			if (st == EPJ_OK)
				st = add_meta(w[r], "generation", gen);
			if (st == EPJ_OK)
				st = add_meta(w[r], "zero_stage", c->zero);
			if (st == EPJ_OK)
				st = add_meta(w[r], "autoep_size", M);
		}
		char *mc = st == EPJ_OK
			       ? ej_model_config_json(&mi->m->cfg, NULL)
			       : NULL;
		if (st == EPJ_OK)
			st = mc ? epj_st_writer_set_metadata(w[r],
							     "model_config", mc)
				: ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
		free(mc);
	}
	return st;
}

/* Every parameter (and its optimizer state) gathered once from the saved
 * shards and cut for every rank of the new layout that holds it. */
static epj_status reshard_params(epj_ctx *ctx, ckpt *c, model_info *mi, int N,
				 int M, epj_st_writer **w)
{
	epj_status st = EPJ_OK;
	layout nl = { N, M, c->zero, mi->experts };
	int *h = malloc(sizeof *h * (size_t)N);
	float *buf = NULL;
	if (!h)
		st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	for (int i = 0; st == EPJ_OK && i < mi->n; i++) {
		const param *p = &mi->p[i];
		bool sh;
		int G = holders(&nl, p, h, &sh);
		char nm[1024];
		for (int k = -1; st == EPJ_OK && k < c->n_kinds; k++) {
			const char *kind = k < 0 ? NULL : c->kinds[k];
			free(buf);
			buf = malloc(sizeof(float) * (size_t)(p->numel + 1));
			st =
			    buf ? gather(ctx, c, mi, p, kind, buf)
				: ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
			if (kind)
				snprintf(nm, sizeof nm, "optimizer.%s.%s", kind,
					 p->name);
			else if (sh)
				snprintf(nm, sizeof nm,
					 "optimizer.master_shard.%s", p->name);
			else
				snprintf(nm, sizeof nm, "%s", p->name);
			for (int g = 0; st == EPJ_OK && g < G; g++)
				st = add_part(ctx, w[h[g]], nm, p, buf, sh, G,
					      g);
		}
	}
	free(buf);
	free(h);
	return st;
}

/* The N files of a multi-rank set, then the record that commits them
 * (generation s->generation); a set that is never committed leaves no
 * file, and once it is, the files of prev (the record OUT held, or NULL)
 * are removed. */
static epj_status reshard_save_set(epj_ctx *ctx, const char *out,
				   epj_st_writer **w, int N, ej_ckpt_set *s,
				   const ej_ckpt_set *prev)
{
	const int64_t gen = s->generation;
	epj_status st = EPJ_OK;
	s->files = calloc((size_t)N, sizeof *s->files);
	if (!s->files)
		st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	int r = 0;
	for (; st == EPJ_OK && r < N; r++) {
		char f[PATH_MAX_];
		snprintf(f, sizeof f, "%s.g%" PRId64 ".rank%d", out, gen, r);
		if (!ej_ckpt_set_file_name(out, gen, r, s->files[r].name,
					   sizeof s->files[r].name))
			st = ej_error(ctx, EPJ_ERR_INVALID,
				      "%s: file name too long", f);
		if (st == EPJ_OK)
			st = epj_st_writer_save(w[r], f);
		if (st == EPJ_OK)
			st = ej_file_hash(ctx, f, &s->files[r].bytes,
					  s->files[r].hash);
	}
	if (st == EPJ_OK)
		st = ej_ckpt_set_write(ctx, out, s);
	if (st != EPJ_OK) /* never committed: no file stays */
		for (int k = 0; k < r && k < N; k++) {
			char f[PATH_MAX_];
			snprintf(f, sizeof f, "%s.g%" PRId64 ".rank%d", out,
				 gen, k);
			unlink(f);
		}
	if (st == EPJ_OK)
		ej_ckpt_set_prune(out, prev, 0, 1);
	return st;
}

/* Whether OUT may be written (replaced, with force) by a reshard to N
 * ranks: OUT is no folder; neither OUT, nor a file the new set writes,
 * nor one that OUT's record names (removed after the commit) is an input;
 * *prev is OUT's record (when it is one: prev->files set) and *gen the
 * generation to write.  0, else 1 with a message. */
static int reshard_out_check(epj_ctx *ctx, const char *out, bool force, int N,
			     const inputs *in, ej_ckpt_set *prev, int64_t *gen)
{
	memset(prev, 0, sizeof *prev);
	*gen = 1;
	struct stat sb;
	const char *is = input_at(in, out);
	if (is)
		return fail_msg("%s: cannot replace the input (it is %s)", out,
				is);
	if (lstat(out, &sb) == 0) {
		if (!force)
			return fail_msg("%s exists: give another OUT, or "
					"--force to replace it",
					out);
		if (S_ISDIR(sb.st_mode))
			return fail_msg("%s: cannot replace a folder", out);
		char *text = NULL;
		size_t len = 0;
		if (ej_ckpt_set_read(out, &text, &len) != 1 ||
		    ej_ckpt_set_parse(ctx, out, text, len, prev) != EPJ_OK)
			memset(prev, 0, sizeof *prev); /* no record: gen 1 */
		epj_ctx_clear_error(ctx);
		free(text);
		if (prev->files && prev->generation < EJ_CKPT_GEN_MAX)
			*gen = prev->generation + 1;
		else if (prev->files)
			return fail_msg("%s: its record is at generation "
					"%" PRId64 ", the last one a record "
					"can hold: give another OUT",
					out, prev->generation);
	}
	char p[PATH_MAX_], nm[EJ_CKPT_NAME_MAX];
	const char *sl = strrchr(out, '/');
	int dl = sl ? (int)(sl - out) + 1 : 0;
	for (int r = 0; N > 1 && r < N; r++) {
		snprintf(p, sizeof p, "%s.g%" PRId64 ".rank%d", out, *gen, r);
		if ((is = input_at(in, p)))
			return fail_msg("%s: cannot replace the input (it is "
					"%s)",
					p, is);
	}
	for (int64_t k = 0; N > 1 && prev->files && k < prev->world; k++) {
		if (!ej_ckpt_set_file_name(out, prev->generation, (int)k, nm,
					   sizeof nm) ||
		    strcmp(nm, prev->files[k].name) != 0)
			continue;
		snprintf(p, sizeof p, "%.*s%s", dl, out, nm);
		if ((is = input_at(in, p)))
			return fail_msg("%s: would be removed with the set it "
					"replaces, but it is the input %s",
					p, is);
	}
	return 0;
}

static int cmd_reshard(epj_ctx *ctx, const char *path, const char *out,
		       const char *mpath, reshard_opts *o)
{
	ckpt c;
	model_info mi = { 0 };
	int n_sh = 0;
	int rc = load_all(ctx, path, mpath, &c, &mi, &n_sh);
	const int N = o->world;
	if (rc == 0 && !c.training)
		rc = fail_msg("%s: holds weights only (no optimizer state, "
			      "no progress): nothing to reshard; it loads "
			      "as it is on any world",
			      path);
	if (rc == 0 && o->ep == 0)
		o->ep = N % c.ep == 0 ? c.ep : 1;
	const int M = o->ep;
	if (rc == 0 && (M < 1 || N % M != 0))
		rc = fail_msg("--ep %d does not divide --world %d", M, N);
	if (rc == 0 && mi.experts > 0 && mi.experts % M != 0)
		rc = fail_msg("--ep %d does not divide the model's %d "
			      "experts",
			      M, mi.experts);
	/* The data position: the saved run consumed micro * W micro-batches
	 * of the stream; the trainer skips micro_step * N of them. */
	int64_t consumed = c.micro * c.world, micro = consumed / N;
	if (rc == 0 && consumed % N != 0)
		rc = fail_msg("%s: the saved run consumed %" PRId64
			      " micro-batches (micro-step %" PRId64 " x %d "
			      "ranks), not a whole number per rank of a world "
			      "of %d",
			      path, consumed, c.micro, c.world, N);
	inputs in = { 0 };
	ej_ckpt_set prev = { 0 };
	int64_t gen = 1;
	if (rc == 0 && inputs_of(ctx, &c, mpath, &in) != EPJ_OK)
		rc = fail(ctx);
	if (rc == 0)
		rc = reshard_out_check(ctx, out, o->force, N, &in, &prev, &gen);
	epj_st_writer **w = rc == 0 ? calloc((size_t)N, sizeof *w) : NULL;
	if (rc == 0 && !w)
		rc = fail_msg("out of memory");
	epj_status st = EPJ_OK;
	if (rc == 0)
		st = reshard_meta(ctx, &c, &mi, N, M, micro, gen, w);
	/* every parameter gathered once, cut for every rank that holds it */
	if (rc == 0 && st == EPJ_OK)
		st = reshard_params(ctx, &c, &mi, N, M, w);
	/* the files, then (several ranks) the record that commits them */
	ej_ckpt_set s = { .generation = gen,
			  .world = N,
			  .zero_stage = c.zero,
			  .autoep_size = M,
			  .step = c.step,
			  .micro_step = micro,
			  .optimizer_steps = c.opt };
	if (rc == 0 && st == EPJ_OK && N == 1)
		st = epj_st_writer_save(w[0], out);
	if (rc == 0 && st == EPJ_OK && N > 1)
		st = reshard_save_set(ctx, out, w, N, &s,
				      prev.files ? &prev : NULL);
	ej_ckpt_set_free(&s);
	ej_ckpt_set_free(&prev);
	free(in.id);
	if (rc == 0 && st != EPJ_OK)
		rc = fail(ctx);
	if (rc == 0)
		printf(PROG ": %s (world %d, autoep_size %d, ZeRO stage %d, "
			    "step %" PRId64 ") -> %s (world %d, autoep_size "
			    "%d, micro_step %" PRId64 ")\n",
		       path, c.world, c.ep, c.zero, c.step, out, N, M, micro);
	for (int r = 0; w && r < N; r++)
		epj_st_writer_free(w[r]);
	free(w);
	model_free(&mi);
	ckpt_free(&c);
	return rc;
}

/* ---- command line ---------------------------------------------------- */

static int bad_usage(const char *fmt, const char *a)
{
	fputs(PROG ": ", stderr);
	fprintf(stderr, fmt, a);
	fputc('\n', stderr);
	usage(stderr);
	return 2;
}

static bool parse_int(const char *s, int lo, int hi, int *out)
{
	char *end;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || end == s || *end || v < lo || v > hi)
		return false;
	*out = (int)v;
	return true;
}

int main(int argc, char **argv)
{
	const char *pos[3] = { 0 }, *model = NULL, *dtype = "f32";
	int npos = 0;
	hf_opts ho = { .max_shard = 5000000000LL };
	reshard_opts ro = { 0 };
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			usage(stdout);
			return 0;
		}
		if (!strcmp(a, "--force")) {
			ho.force = ro.force = true;
			continue;
		}
		if (a[0] == '-' && a[1] == '-') {
			if (i + 1 >= argc)
				return bad_usage("%s needs a value", a);
			const char *v = argv[++i];
			if (!strcmp(a, "--model"))
				model = v;
			else if (!strcmp(a, "--dtype"))
				dtype = v;
			else if (!strcmp(a, "--max-shard-size")) {
				if ((ho.max_shard = parse_size(v)) <= 0)
					return bad_usage(
					    "--max-shard-size '%s': expected "
					    "bytes, e.g. 5GB, 500MB, 2GiB or "
					    "4096",
					    v);
			} else if (!strcmp(a, "--world")) {
				if (!parse_int(v, 1, 65536, &ro.world))
					return bad_usage("--world '%s': "
							 "expected 1 to 65536",
							 v);
			} else if (!strcmp(a, "--ep")) {
				if (!parse_int(v, 1, 65536, &ro.ep))
					return bad_usage("--ep '%s': expected "
							 "1 to 65536",
							 v);
			} else {
				return bad_usage("unknown option %s", a);
			}
			continue;
		}
		if (npos == 3)
			return bad_usage("unexpected argument '%s'", a);
		pos[npos++] = a;
	}
	if (!npos)
		return bad_usage("%s", "no command (info, to-hf or reshard)");
	const char *cmd = pos[0];
	int want = !strcmp(cmd, "info")	     ? 2
		   : !strcmp(cmd, "to-hf")   ? 3
		   : !strcmp(cmd, "reshard") ? 3
					     : -1;
	if (want < 0)
		return bad_usage("unknown command '%s' (info, to-hf or "
				 "reshard)",
				 cmd);
	if (npos != want)
		return bad_usage("%s: wrong number of arguments", cmd);
	if (strcmp(dtype, "f32") && strcmp(dtype, "bf16"))
		return bad_usage("--dtype '%s': expected f32 or bf16", dtype);
	ho.bf16 = !strcmp(dtype, "bf16");
	if (!strcmp(cmd, "reshard") && ro.world == 0)
		return bad_usage("%s", "reshard needs --world N");
	epj_ctx *ctx = NULL;
	if (epj_ctx_new("cpu", &ctx) != EPJ_OK || !ctx)
		return fail_msg("cannot create a cpu context");
	int rc;
	if (!strcmp(cmd, "info"))
		rc = cmd_info(ctx, pos[1], model);
	else if (!strcmp(cmd, "to-hf"))
		rc = cmd_to_hf(ctx, pos[1], pos[2], model, &ho);
	else
		rc = cmd_reshard(ctx, pos[1], pos[2], model, &ro);
	epj_ctx_free(ctx);
	return rc;
}
