/* error.c -- status names, the context's error message, assertions, logging.
 *
 * Two tiers (STYLE.md): a user's mistake or an environment failure sets
 * ctx->status and ctx->errmsg through ej_error() and returns the status; a
 * broken invariant goes to ej_assert_fail(), which prints file:line and
 * aborts.  The library never calls exit().
 *
 * Invariants
 *  - ctx->errmsg is always NUL-terminated; it is "" exactly when no error
 *    has been recorded since the last epj_ctx_clear_error().
 *  - Messages longer than the buffer are truncated, never overflowed.
 *  - The log level is read from EPJIT_LOG once (first use) and is process
 *    wide; it is an atomic so any thread may log.
 */
#include "core_impl.h"

#include <stdatomic.h>
#include <string.h>
#include <strings.h>

const char *epj_status_name(epj_status s)
{
	switch (s) {
	case EPJ_OK:
		return "EPJ_OK";
	case EPJ_ERR_INVALID:
		return "EPJ_ERR_INVALID";
	case EPJ_ERR_SHAPE:
		return "EPJ_ERR_SHAPE";
	case EPJ_ERR_DTYPE:
		return "EPJ_ERR_DTYPE";
	case EPJ_ERR_INDEX:
		return "EPJ_ERR_INDEX";
	case EPJ_ERR_NOMEM:
		return "EPJ_ERR_NOMEM";
	case EPJ_ERR_IO:
		return "EPJ_ERR_IO";
	case EPJ_ERR_FORMAT:
		return "EPJ_ERR_FORMAT";
	case EPJ_ERR_CONFIG:
		return "EPJ_ERR_CONFIG";
	case EPJ_ERR_UNSUPPORTED:
		return "EPJ_ERR_UNSUPPORTED";
	case EPJ_ERR_BACKEND:
		return "EPJ_ERR_BACKEND";
	case EPJ_ERR_COMPILE:
		return "EPJ_ERR_COMPILE";
	case EPJ_ERR_STATE:
		return "EPJ_ERR_STATE";
	}
	return "EPJ_ERR_UNKNOWN";
}

/* ---- errors -------------------------------------------------------------- */

epj_status ej_verror(epj_ctx *ctx, epj_status s, const char *fmt, va_list ap)
{
	/* Format into a scratch buffer first: the arguments may point into
	 * ctx->errmsg itself (re-raising the current message). */
	char msg[sizeof ctx->errmsg];
	vsnprintf(msg, sizeof msg, fmt, ap);
	if (ctx) {
		ctx->status = s;
		memcpy(ctx->errmsg, msg, sizeof msg);
	}
	epj_log_msg(EPJ_LOG_DEBUG, "error %s: %s", epj_status_name(s), msg);
	return s;
}

epj_status ej_error(epj_ctx *ctx, epj_status s, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	ej_verror(ctx, s, fmt, ap);
	va_end(ap);
	return s;
}

/* Appends the string s to buf (capacity cap, length *len), truncating. */
static void append(char *buf, size_t cap, size_t *len, const char *s)
{
	size_t n = strlen(s);
	if (n > cap - 1 - *len)
		n = cap - 1 - *len;
	memcpy(buf + *len, s, n);
	*len += n;
	buf[*len] = '\0';
}

void ej_error_prefix(epj_ctx *ctx, const char *fmt, ...)
{
	if (!ctx)
		return;
	char prefix[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(prefix, sizeof prefix, fmt, ap);
	va_end(ap);
	char msg[sizeof ctx->errmsg];
	size_t len = 0;
	msg[0] = '\0';
	append(msg, sizeof msg, &len, prefix);
	if (ctx->errmsg[0]) {
		append(msg, sizeof msg, &len, ": ");
		append(msg, sizeof msg, &len, ctx->errmsg);
	}
	memcpy(ctx->errmsg, msg, len + 1);
}

epj_status epj_ctx_status(const epj_ctx *ctx)
{
	return ctx ? ctx->status : EPJ_ERR_INVALID;
}

const char *epj_ctx_error(const epj_ctx *ctx)
{
	return ctx ? ctx->errmsg : "no context";
}

void epj_ctx_clear_error(epj_ctx *ctx)
{
	if (!ctx)
		return;
	ctx->status = EPJ_OK;
	ctx->errmsg[0] = '\0';
}

void ej_assert_fail(const char *expr, const char *file, int line,
		    const char *func)
{
	fprintf(stderr, "epjit: assertion failed: %s at %s:%d (%s)\n", expr,
		file, line, func);
	fflush(stderr);
	abort();
}

char *ej_shape_str(int ndim, const int64_t *shape, char *buf, size_t n)
{
	if (!buf || n == 0)
		return buf;
	size_t used = 0;
	buf[0] = '\0';
#define EJ_PUT(...)                                                            \
	do {                                                                   \
		if (used < n) {                                                \
			int w_ = snprintf(buf + used, n - used, __VA_ARGS__);  \
			used += w_ > 0 ? (size_t)w_ : 0;                       \
		}                                                              \
	} while (0)
	EJ_PUT("[");
	for (int i = 0; i < ndim; i++)
		EJ_PUT(i ? ",%lld" : "%lld", (long long)shape[i]);
	EJ_PUT("]");
#undef EJ_PUT
	return buf;
}

/* ---- logging ---------------------------------------------------------------
 * -1 means "not read yet"; the first reader parses EPJIT_LOG.  Two threads
 * racing on the first read both compute the same value, so a plain atomic
 * store is enough. */

static _Atomic int log_level = -1;

static int parse_level(const char *s)
{
	static const char *const names[] = { "error", "warn", "info", "debug",
					     "trace" };
	if (!s || !*s)
		return EPJ_LOG_WARN;
	for (int i = 0; i < (int)EJ_ARRAY_LEN(names); i++)
		if (strcasecmp(s, names[i]) == 0)
			return i;
	if (strcasecmp(s, "warning") == 0)
		return EPJ_LOG_WARN;
	if (s[0] >= '0' && s[0] <= '4' && s[1] == '\0')
		return s[0] - '0';
	fprintf(stderr,
		"epjit: [warn] EPJIT_LOG=%s not understood (want "
		"error|warn|info|debug|trace or 0..4); using warn\n",
		s);
	return EPJ_LOG_WARN;
}

epj_log_level epj_log_level_get(void)
{
	int lvl = atomic_load_explicit(&log_level, memory_order_relaxed);
	if (lvl < 0) {
		lvl = parse_level(getenv("EPJIT_LOG"));
		atomic_store_explicit(&log_level, lvl, memory_order_relaxed);
	}
	return (epj_log_level)lvl;
}

void epj_log_level_set(epj_log_level lvl)
{
	if ((int)lvl < EPJ_LOG_ERROR)
		lvl = EPJ_LOG_ERROR;
	if (lvl > EPJ_LOG_TRACE)
		lvl = EPJ_LOG_TRACE;
	atomic_store_explicit(&log_level, (int)lvl, memory_order_relaxed);
}

void epj_log_msg(epj_log_level lvl, const char *fmt, ...)
{
	static const char *const tags[] = { "error", "warn", "info", "debug",
					    "trace" };
	if ((int)lvl < 0 || lvl > EPJ_LOG_TRACE || lvl > epj_log_level_get())
		return;
	/* One fprintf per line so that lines of concurrent threads do not
	 * interleave mid-line. */
	char msg[2048];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	size_t len = strlen(msg);
	bool nl = len > 0 && msg[len - 1] == '\n';
	fprintf(stderr, "epjit: [%s] %s%s", tags[lvl], msg, nl ? "" : "\n");
}
