/* nvrtc.c -- CUDA C -> cubin with NVRTC; the target arch list
 * (EPJIT_CUDA_ARCH); the CUDA driver probe.
 *
 * One call compiles one translation unit for one arch: a program is created,
 * compiled with -arch=<target> plus the caller's options, its log and image
 * copied out, and destroyed, so concurrent compiles share nothing but the
 * once-computed facts about this NVRTC (version, supported archs).
 *
 * Arch policy.  A cubin for exactly the requested sm_XX; when XX is newer
 * than every arch this NVRTC knows (nvrtcGetSupportedArchs), PTX for the
 * newest compute_YY it knows instead, which a newer driver JIT-compiles at
 * load time (the log and result->target say so).  An arch older than the
 * oldest supported one, or one in the range that NVRTC does not list, is
 * refused before compiling: NVRTC would only say "invalid value for
 * --gpu-architecture".
 *
 * ptxas report.  With EJ_NVRTC_OPT_PTXAS_REPORT in the options the log
 * carries ptxas's resource report (registers, stack frame, spills per
 * kernel); ej_ptxas_report_parse reads it (t/check_ptxas.c).
 *
 * Errors.  Every NVRTC call goes through NVRTC_CHECK, which on failure
 * records the statement, file:line, nvrtcGetErrorString(), writes the source
 * (and the full log) to files named in the message, and appends the program
 * log.  The ctx message holds 1 KiB, so the log comes last and the files
 * hold it whole.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "cc.h"
#include "kcache.h"

#include <ctype.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#ifdef HAVE_NVRTC
#include <nvrtc.h>
#endif

/* ---- arch names ----------------------------------------------------------
 */

/* Parses s[0..len) as sm_<2-3 digits>[a|f] into its number and suffix
 * ('\0' when none).  False when malformed. */
static bool arch_parse(const char *s, size_t len, int *num, char *suffix)
{
	if (len < 5 || strncmp(s, "sm_", 3) != 0)
		return false;
	size_t i = 3;
	int n = 0;
	while (i < len && isdigit((unsigned char)s[i]) && i < 6)
		n = n * 10 + (s[i++] - '0');
	if (i - 3 < 2 || s[3] == '0')
		return false;
	char suf = '\0';
	if (i < len && (s[i] == 'a' || s[i] == 'f'))
		suf = s[i++];
	if (i != len)
		return false;
	*num = n;
	*suffix = suf;
	return true;
}

int ej_cuda_archs_parse(epj_ctx *ctx, const char *what, const char *spec,
			char archs[][EJ_CUDA_ARCH_MAX], int max)
{
	static const char expect[] =
	    "expected a comma-separated list such as sm_80,sm_90 (each "
	    "sm_<digits>, optionally with an a or f suffix)";
	if (!spec) {
		ej_error(ctx, EPJ_ERR_CONFIG, "%s: no arch list; %s", what,
			 expect);
		return -1;
	}
	int n = 0;
	const char *p = spec;
	for (;;) {
		const char *end = strchr(p, ',');
		if (!end)
			end = p + strlen(p);
		const char *b = p, *e = end;
		while (b < e && isspace((unsigned char)*b))
			b++;
		while (e > b && isspace((unsigned char)e[-1]))
			e--;
		size_t len = (size_t)(e - b);
		int num;
		char suf;
		if (len == 0) {
			ej_error(ctx, EPJ_ERR_CONFIG,
				 "%s='%s': empty entry at offset %d; %s", what,
				 spec, (int)(p - spec), expect);
			return -1;
		}
		if (len >= EJ_CUDA_ARCH_MAX ||
		    !arch_parse(b, len, &num, &suf)) {
			ej_error(ctx, EPJ_ERR_CONFIG,
				 "%s='%s': '%.*s' is not a CUDA arch; %s", what,
				 spec, (int)len, b, expect);
			return -1;
		}
		bool dup = false;
		for (int i = 0; i < n; i++)
			dup |= strlen(archs[i]) == len &&
			       memcmp(archs[i], b, len) == 0;
		if (!dup) {
			if (n == max) {
				ej_error(ctx, EPJ_ERR_CONFIG,
					 "%s='%s': more than %d archs", what,
					 spec, max);
				return -1;
			}
			memcpy(archs[n], b, len);
			archs[n][len] = '\0';
			n++;
		}
		if (*end == '\0')
			break;
		p = end + 1;
	}
	return n;
}

int ej_cuda_archs(epj_ctx *ctx, char archs[][EJ_CUDA_ARCH_MAX], int max)
{
	const char *env = getenv("EPJIT_CUDA_ARCH");
	bool blank = true;
	for (const char *c = env; c && *c; c++)
		blank &= isspace((unsigned char)*c) != 0;
	return ej_cuda_archs_parse(ctx, "EPJIT_CUDA_ARCH",
				   blank ? EJ_CUDA_ARCH_DEFAULT : env, archs,
				   max);
}

epj_status ej_nvrtc_build_module(epj_ctx *ctx, ej_kcache *kc,
				 const char *source, const char *name,
				 const char *arch, const ej_device *vt,
				 const char *what, void **module)
{
	char key[EJ_KCACHE_KEY_LEN + 1];
	ej_nvrtc_cache_key(source, arch, NULL, 0, key);
	void *image = NULL;
	size_t size = 0;
	int lock = -1;
	epj_status st = kc ? ej_kcache_get_module(kc, ctx, key, vt, name,
						  module, &image, &size, &lock)
			   : EPJ_OK;
	if (st == EPJ_OK && !image) {
		ej_nvrtc_result r = { 0 };
		st = ej_nvrtc_compile(ctx, source, name, arch, NULL, 0, &r);
		if (st == EPJ_OK) {
			image = r.image;
			size = r.size;
			r.image = NULL;
			if (r.log && *r.log)
				epj_log_msg(EPJ_LOG_INFO, "nvrtc: %s: %s", name,
					    r.log);
		}
		ej_nvrtc_result_free(&r);
		if (st == EPJ_OK) {
			st = vt->load(vt->self, ctx, image, size, name, module);
			if (st != EPJ_OK)
				ej_error_prefix(ctx,
						"%s: the image just compiled "
						"does not load",
						what);
		}
		/* into the cache only what the device accepted */
		if (st == EPJ_OK && kc)
			st = ej_kcache_put(kc, key, image, size, source);
	}
	if (kc)
		ej_kcache_unlock(kc, lock);
	free(image);
	return st;
}

bool ej_nvrtc_log_has_warning(const char *log)
{
	/* NVRTC writes "<name>.cu(<line>): warning #<n>-D: <text>"; a warning
	 * without a location starts its line with "warning:" or "warning #".
	 * Names and source excerpts that merely contain "warning" do not
	 * count. */
	if (!log)
		return false;
	for (const char *line = log; *line;) {
		const char *nl = strchr(line, '\n');
		size_t len = nl ? (size_t)(nl - line) : strlen(line);
		if (strncmp(line, "warning:", 8) == 0 ||
		    strncmp(line, "warning #", 9) == 0)
			return true;
		for (size_t i = 0; i + 11 <= len; i++)
			if (memcmp(line + i, "): warning", 10) == 0 &&
			    (line[i + 10] == ' ' || line[i + 10] == ':'))
				return true;
		if (!nl)
			break;
		line = nl + 1;
	}
	return false;
}

/* The entry of function name[0..len) in u[0..*n), added (registers -1)
 * when new; NULL when u is full. */
static ej_ptxas_usage *ptxas_fn(ej_ptxas_usage *u, int *n, int max,
				const char *name, size_t len)
{
	if (len >= sizeof u->name)
		len = sizeof u->name - 1;
	for (int i = 0; i < *n; i++)
		if (strncmp(u[i].name, name, len) == 0 && u[i].name[len] == 0)
			return &u[i];
	if (*n == max)
		return NULL;
	ej_ptxas_usage *f = &u[(*n)++];
	memset(f, 0, sizeof *f);
	memcpy(f->name, name, len);
	f->registers = -1;
	return f;
}

int ej_ptxas_report_parse(const char *log, ej_ptxas_usage *u, int max)
{
	static const char entry[] = "Compiling entry function '";
	static const char props[] = "Function properties for ";
	int n = 0;
	ej_ptxas_usage *cur = NULL;
	for (const char *line = log; line && *line;) {
		const char *nl = strchr(line, '\n');
		size_t len = nl ? (size_t)(nl - line) : strlen(line);
		/* one line at a time, NUL-terminated (report lines are
		 * short); the stack line starts "ptxas         ." in NVRTC's
		 * log and with blanks in ptxas's own output */
		char buf[512];
		if (len >= sizeof buf)
			len = sizeof buf - 1;
		memcpy(buf, line, len);
		buf[len] = '\0';
		line = nl ? nl + 1 : line + len;
		const char *p;
		int a, b, c;
		if ((p = strstr(buf, entry)) != NULL) {
			p += sizeof entry - 1;
			const char *q = strchr(p, '\'');
			cur = ptxas_fn(u, &n, max, p,
				       q ? (size_t)(q - p) : strlen(p));
			if (!cur)
				return -1;
			cur->entry = true;
		} else if ((p = strstr(buf, props)) != NULL) {
			p += sizeof props - 1;
			cur = ptxas_fn(u, &n, max, p, strcspn(p, " \t\r"));
			if (!cur)
				return -1;
		} else if (cur && (p = strstr(buf, "Used ")) != NULL &&
			   sscanf(p, "Used %d registers", &a) == 1) {
			cur->registers = a;
		} else if (cur && (p = strpbrk(buf, "0123456789")) != NULL &&
			   sscanf(p,
				  "%d bytes stack frame, %d bytes spill "
				  "stores, %d bytes spill loads",
				  &a, &b, &c) == 3) {
			cur->stack = a;
			cur->spill_stores = b;
			cur->spill_loads = c;
		}
	}
	return n;
}

void ej_nvrtc_result_free(ej_nvrtc_result *r)
{
	if (!r)
		return;
	free(r->image);
	free(r->log);
	free(r->ptx);
	memset(r, 0, sizeof *r);
}

/* ---- NVRTC ---------------------------------------------------------------
 */

#ifdef HAVE_NVRTC

/* What this NVRTC is, queried once.  init_err is "" or the failed query's
 * statement and error, reported by every later compile. */
static struct {
	pthread_once_t once;
	int major, minor;
	int archs[64]; /* ascending, as NVRTC returns them */
	int n_archs;
	char identity[32];
	char init_err[256];
} nv = { .once = PTHREAD_ONCE_INIT };

#define NVRTC_QUERY(stmt)                                                      \
	do {                                                                   \
		nvrtcResult r_ = (stmt);                                       \
		if (r_ != NVRTC_SUCCESS) {                                     \
			snprintf(nv.init_err, sizeof nv.init_err,              \
				 "%s failed at %s:%d: %s", #stmt,              \
				 ej_src_file(__FILE__), __LINE__,              \
				 nvrtcGetErrorString(r_));                     \
			return;                                                \
		}                                                              \
	} while (0)

static void nv_init(void)
{
	snprintf(nv.identity, sizeof nv.identity, "nvrtc unknown");
	NVRTC_QUERY(nvrtcVersion(&nv.major, &nv.minor));
	snprintf(nv.identity, sizeof nv.identity, "nvrtc %d.%d", nv.major,
		 nv.minor);
	int n = 0;
	NVRTC_QUERY(nvrtcGetNumSupportedArchs(&n));
	if (n <= 0 || n > (int)EJ_ARRAY_LEN(nv.archs)) {
		snprintf(nv.init_err, sizeof nv.init_err,
			 "nvrtcGetNumSupportedArchs returned %d archs", n);
		return;
	}
	NVRTC_QUERY(nvrtcGetSupportedArchs(nv.archs));
	nv.n_archs = n;
}

static epj_status nv_ready(epj_ctx *ctx)
{
	pthread_once(&nv.once, nv_init);
	if (nv.init_err[0])
		return ej_error(ctx, EPJ_ERR_BACKEND, "nvrtc: %s", nv.init_err);
	return EPJ_OK;
}

bool ej_nvrtc_version(int *major, int *minor)
{
	pthread_once(&nv.once, nv_init);
	*major = nv.major;
	*minor = nv.minor;
	return nv.major > 0;
}

const char *ej_nvrtc_identity(void)
{
	pthread_once(&nv.once, nv_init);
	return nv.identity;
}

/* Chooses the -arch value for `arch` (policy at the top of the file).
 * note receives the log's fallback line ("" when none). */
static epj_status nv_target(epj_ctx *ctx, const char *arch, char *target,
			    bool *is_ptx, char *note, size_t note_len)
{
	int num;
	char suf;
	size_t len = strlen(arch);
	if (len >= EJ_CUDA_ARCH_MAX || !arch_parse(arch, len, &num, &suf))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"nvrtc: '%s' is not a CUDA arch (expected "
				"sm_<digits>[a|f], e.g. sm_90)",
				arch);
	int newest = nv.archs[nv.n_archs - 1];
	note[0] = '\0';
	*is_ptx = false;
	if (num > newest) {
		/* Archs have at most 3 digits (arch_parse); the cast tells
		 * the compiler that the name fits. */
		snprintf(target, EJ_CUDA_ARCH_MAX, "compute_%u",
			 (unsigned short)newest);
		snprintf(note, note_len,
			 "note: %s is newer than %s supports (newest sm_%d); "
			 "compiled PTX for %s instead, which the driver "
			 "compiles at load time\n",
			 arch, nv.identity, newest, target);
		*is_ptx = true;
		return EPJ_OK;
	}
	for (int i = 0; i < nv.n_archs; i++) {
		if (nv.archs[i] == num) {
			memcpy(target, arch, len + 1);
			return EPJ_OK;
		}
	}
	char list[256];
	size_t used = 0;
	list[0] = '\0';
	for (int i = 0; i < nv.n_archs && used < sizeof list; i++)
		used += (size_t)snprintf(list + used, sizeof list - used,
					 "%ssm_%d", i ? " " : "", nv.archs[i]);
	return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
			"nvrtc: %s is not supported by %s (supported: %s)",
			arch, nv.identity, list);
}

/* One compile's state, for NVRTC_CHECK's failure path. */
typedef struct nv_job {
	epj_ctx *ctx;
	nvrtcProgram prog; /* NULL until created */
	const char *source;
	const char *name;
	const char *target;
} nv_job;

static atomic_uint nv_fail_seq;

/* Keeps the source (and the full log) in files, sets EPJ_ERR_COMPILE with
 * the failed statement, file:line, NVRTC's error string, the file paths and
 * as much of the log as fits. */
static epj_status nv_fail(nv_job *job, const char *stmt, const char *file,
			  int line, nvrtcResult res)
{
	char *log = NULL;
	size_t log_size = 0;
	if (job->prog &&
	    nvrtcGetProgramLogSize(job->prog, &log_size) == NVRTC_SUCCESS &&
	    log_size > 0 && (log = malloc(log_size)) != NULL &&
	    nvrtcGetProgramLog(job->prog, log) != NVRTC_SUCCESS) {
		free(log);
		log = NULL;
	}
	char safe[64], base[PATH_MAX], path[PATH_MAX + 8];
	char log_path[PATH_MAX + 8], saved[2 * PATH_MAX + 64];
	ej_safe_name(job->name, safe, sizeof safe);
	int err = EEXIST;
	for (int tries = 0; err == EEXIST && tries < 100; tries++) {
		snprintf(base, sizeof base, "%s/epjit-nvrtc-%d-%u-%s",
			 ej_tmpdir(), (int)getpid(),
			 atomic_fetch_add(&nv_fail_seq, 1), safe);
		snprintf(path, sizeof path, "%s.cu", base);
		err = ej_write_new_file(path, job->source, strlen(job->source));
	}
	if (err == 0) {
		snprintf(log_path, sizeof log_path, "%s.log", base);
		const char *text = log ? log : "";
		if (ej_write_new_file(log_path, text, strlen(text)) == 0)
			snprintf(saved, sizeof saved,
				 "source kept at %s (full log: %s)", path,
				 log_path);
		else
			snprintf(saved, sizeof saved, "source kept at %s",
				 path);
	} else {
		snprintf(saved, sizeof saved,
			 "source not kept (writing %s: %s)", path,
			 strerror(err));
	}
	epj_status st = ej_error(
	    job->ctx, EPJ_ERR_COMPILE,
	    "nvrtc: compiling '%s' for %s: %s failed at %s:%d: %s; %s; "
	    "log:\n%s",
	    job->name, job->target, stmt, ej_src_file(file), line,
	    nvrtcGetErrorString(res), saved, log && log[0] ? log : "(empty)\n");
	free(log);
	return st;
}

/* Runs an NVRTC call; on failure sets the message (nv_fail) and jumps to the
 * caller's `out` label with `st` set. */
#define NVRTC_CHECK(job, stmt)                                                 \
	do {                                                                   \
		nvrtcResult r_ = (stmt);                                       \
		if (r_ != NVRTC_SUCCESS) {                                     \
			st = nv_fail(job, #stmt, __FILE__, __LINE__, r_);      \
			goto out;                                              \
		}                                                              \
	} while (0)

epj_status ej_nvrtc_compile(epj_ctx *ctx, const char *source, const char *name,
			    const char *arch, const char *const *extra_opts,
			    int n_opts, ej_nvrtc_result *out)
{
	EJ_ASSERT(out);
	memset(out, 0, sizeof *out);
	if (!source || !name || !arch || n_opts < 0 || (n_opts && !extra_opts))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"nvrtc: compile needs source, name, arch and "
				"n_opts >= 0 options");
	epj_status st = nv_ready(ctx);
	if (st != EPJ_OK)
		return st;
	char target[EJ_CUDA_ARCH_MAX], note[256];
	bool is_ptx;
	st = nv_target(ctx, arch, target, &is_ptx, note, sizeof note);
	if (st != EPJ_OK)
		return st;

	char arch_opt[32], prog_name[80], safe[64];
	snprintf(arch_opt, sizeof arch_opt, "-arch=%s", target);
	snprintf(prog_name, sizeof prog_name, "%s.cu",
		 ej_safe_name(name, safe, sizeof safe));
	nv_job job = { ctx, NULL, source, name, target };
	char *log = NULL, *ptx = NULL;
	void *image = NULL;
	size_t log_size = 0, size = 0;
	const char **opts = malloc(sizeof *opts * (size_t)(n_opts + 1));
	if (!opts)
		return ej_error(ctx, EPJ_ERR_NOMEM, "nvrtc: out of memory");
	opts[0] = arch_opt;
	int n_nv = 1;
	bool keep_ptx = false;
	for (int i = 0; i < n_opts; i++) {
		if (strcmp(extra_opts[i], EJ_NVRTC_OPT_KEEP_PTX) == 0)
			keep_ptx = true;
		else
			opts[n_nv++] = extra_opts[i];
	}

	NVRTC_CHECK(&job, nvrtcCreateProgram(&job.prog, source, prog_name, 0,
					     NULL, NULL));
	NVRTC_CHECK(&job, nvrtcCompileProgram(job.prog, n_nv, opts));
	NVRTC_CHECK(&job, nvrtcGetProgramLogSize(job.prog, &log_size));
	size_t note_len = strlen(note);
	log = malloc(note_len + log_size + 1);
	if (!log) {
		st = ej_error(ctx, EPJ_ERR_NOMEM, "nvrtc: out of memory");
		goto out;
	}
	memcpy(log, note, note_len);
	log[note_len] = '\0';
	if (log_size > 0)
		NVRTC_CHECK(&job, nvrtcGetProgramLog(job.prog, log + note_len));
	if (is_ptx)
		NVRTC_CHECK(&job, nvrtcGetPTXSize(job.prog, &size));
	else
		NVRTC_CHECK(&job, nvrtcGetCUBINSize(job.prog, &size));
	if (size == 0) {
		st = ej_error(ctx, EPJ_ERR_COMPILE,
			      "nvrtc: compiling '%s' for %s produced an empty "
			      "%s",
			      name, target, is_ptx ? "PTX" : "cubin");
		goto out;
	}
	image = malloc(size);
	if (!image) {
		st =
		    ej_error(ctx, EPJ_ERR_NOMEM,
			     "nvrtc: out of memory for a %zu-byte image", size);
		goto out;
	}
	if (is_ptx)
		NVRTC_CHECK(&job, nvrtcGetPTX(job.prog, image));
	else
		NVRTC_CHECK(&job, nvrtcGetCUBIN(job.prog, image));
	if (keep_ptx && !is_ptx) {
		size_t n = 0;
		NVRTC_CHECK(&job, nvrtcGetPTXSize(job.prog, &n));
		if (!(ptx = malloc(n + 1))) {
			st = ej_error(ctx, EPJ_ERR_NOMEM,
				      "nvrtc: out of memory for %zu bytes of "
				      "PTX",
				      n);
			goto out;
		}
		ptx[n] = '\0';
		NVRTC_CHECK(&job, nvrtcGetPTX(job.prog, ptx));
	}

out:
	if (job.prog) {
		nvrtcResult r = nvrtcDestroyProgram(&job.prog);
		if (r != NVRTC_SUCCESS)
			epj_log_msg(EPJ_LOG_WARN,
				    "nvrtc: nvrtcDestroyProgram(&job.prog) "
				    "failed at %s:%d: %s",
				    ej_src_file(__FILE__), __LINE__,
				    nvrtcGetErrorString(r));
	}
	free(opts);
	if (st != EPJ_OK) {
		free(image);
		free(log);
		free(ptx);
		return st;
	}
	out->ptx = ptx;
	out->image = image;
	out->size = size;
	out->is_ptx = is_ptx;
	out->log = log;
	memcpy(out->target, target, sizeof target);
	return EPJ_OK;
}

#else /* !HAVE_NVRTC */

epj_status ej_nvrtc_compile(epj_ctx *ctx, const char *source, const char *name,
			    const char *arch, const char *const *extra_opts,
			    int n_opts, ej_nvrtc_result *out)
{
	if (out)
		memset(out, 0, sizeof *out);
	return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
			"nvrtc: cannot compile '%s' for %s: built without "
			"NVRTC (configure found no CUDA toolkit; see "
			"doc/building.md)",
			name ? name : "(null)", arch ? arch : "(null)");
}

bool ej_nvrtc_version(int *major, int *minor)
{
	*major = 0;
	*minor = 0;
	return false;
}

const char *ej_nvrtc_identity(void)
{
	return "nvrtc none";
}

#endif /* HAVE_NVRTC */

/* ---- cache key ------------------------------------------------------------
 */

void ej_nvrtc_cache_key(const char *source, const char *arch,
			const char *const *opts, int n_opts, char key[65])
{
	/* the artifact rule (ej_artifact_key): source, NVRTC's identity, the
	 * options (blank-joined), the arch */
	char flags[1024] = "";
	size_t o = 0;
	EJ_ASSERT(n_opts >= 0);
	for (int i = 0; i < n_opts && o < sizeof flags; i++) {
		int k = snprintf(flags + o, sizeof flags - o, "%s%s",
				 i ? " " : "", opts[i]);
		EJ_ASSERT(k >= 0 && (size_t)k < sizeof flags - o);
		o += (size_t)k;
	}
	ej_artifact_key(key, "nvrtc", ej_nvrtc_identity(), flags, arch, source);
}

/* ---- CUDA driver ---------------------------------------------------------
 */

epj_status ej_cuda_driver_probe(epj_ctx *ctx)
{
	char where[160];
	const char *err;
	void *h, *init;
	EJ_DL_CALL(h, dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL), where,
		   err);
	if (!h)
		return ej_error(ctx, EPJ_ERR_BACKEND,
				"no CUDA driver (libcuda.so.1 not found: %s) "
				"[%s]",
				err, where);
	EJ_DL_CALL(init, dlsym(h, "cuInit"), where, err);
	epj_status st = EPJ_OK;
	if (!init)
		st = ej_error(ctx, EPJ_ERR_BACKEND,
			      "CUDA driver unusable: libcuda.so.1 has no "
			      "cuInit (%s) [%s]",
			      err, where);
	dlclose(h);
	return st;
}
