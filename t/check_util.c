/* check_util.c -- shared helpers of the Check suites: seeds, random tensors,
 * row-major index arithmetic and comparisons for double references, expected
 * error messages, temporary directories and whole-file I/O, and the
 * finite-difference gradient check every differentiable op is tested with.
 * Every helper fails the calling test (ck_assert) rather than returning an
 * error, except where its comment says it returns NULL. */
#include "check_util.h"

#include "jit.h"

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static uint64_t seed_value;
static bool seed_done;
static uint64_t rng_state;
static uint64_t ctx_counter;

uint64_t tu_seed(void)
{
	if (!seed_done) {
		const char *e = getenv("EPJIT_TEST_SEED");
		if (e && *e)
			seed_value = strtoull(e, NULL, 0);
		else
			seed_value =
			    ((uint64_t)time(NULL) << 16) ^ (uint64_t)getpid();
		rng_state = seed_value * 0x9E3779B97F4A7C15ull + 1;
		seed_done = true;
	}
	return seed_value;
}

void tu_add_loop_test(TCase *tc, const TTest *fn, int n)
{
	const char *q = getenv("EPJIT_CHECK_QUICK");
	if (!q || !*q || !strcmp(q, "0") || n <= 1) {
		tcase_add_loop_test(tc, fn, 0, n);
		return;
	}
	int k = (n + 2) / 3;
	int lo = (int)(tu_seed() % (uint64_t)(n - k + 1));
	tcase_add_loop_test(tc, fn, lo, lo + k);
}

bool tu_quick_keep(int i)
{
	const char *q = getenv("EPJIT_CHECK_QUICK");
	if (!q || !*q || !strcmp(q, "0"))
		return true;
	return (tu_seed() + (uint64_t)i) % 3 == 0;
}

static uint64_t next_u64(void)
{
	tu_seed();
	/* splitmix64 */
	uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
	return z ^ (z >> 31);
}

int64_t tu_randint(int64_t lo, int64_t hi)
{
	ck_assert(hi > lo);
	return lo + (int64_t)(next_u64() % (uint64_t)(hi - lo));
}

double tu_uniform(double lo, double hi)
{
	return lo + (hi - lo) * ((double)(next_u64() >> 11) * 0x1.0p-53);
}

epj_ctx *tu_ctx(void)
{
	epj_ctx *ctx = NULL;
	ck_assert_int_eq(epj_ctx_new("cpu", &ctx), EPJ_OK);
	epj_ctx_seed(ctx, tu_seed() + 7919 * ++ctx_counter + next_u64());
	return ctx;
}

epj_tensor *tu_randn(epj_ctx *ctx, epj_dtype dt, int ndim, const int64_t *shape)
{
	epj_tensor *t = epj_randn(ctx, dt, ndim, shape, 0.0, 1.0);
	tu_ok(ctx, t);
	return t;
}

double *tu_values(epj_ctx *ctx, const epj_tensor *t)
{
	int64_t n = epj_tensor_numel(t);
	double *v = malloc(sizeof *v * (size_t)(n > 0 ? n : 1));
	ck_assert_ptr_nonnull(v);
	ck_assert_int_eq(epj_tensor_to_f64(ctx, t, v), EPJ_OK);
	return v;
}

epj_tensor *tu_noncontig(epj_ctx *ctx, epj_tensor *t)
{
	int nd = epj_tensor_ndim(t);
	const int64_t *sh = epj_tensor_shape(t);
	double *vals = tu_values(ctx, t);
	bool prev = epj_no_grad_enter(ctx);
	epj_tensor *view = NULL;
	if (nd >= 2) {
		/* Storage laid out with the dims reversed, viewed back. */
		int64_t rsh[EPJ_MAX_DIMS];
		int perm[EPJ_MAX_DIMS];
		for (int i = 0; i < nd; i++) {
			rsh[i] = sh[nd - 1 - i];
			perm[i] = nd - 1 - i;
		}
		epj_tensor *buf = epj_zeros(ctx, epj_tensor_dtype(t), nd, rsh);
		tu_ok(ctx, buf);
		view = epj_permute(ctx, buf, perm);
		epj_tensor_free(buf);
	} else if (nd == 1) {
		/* Every second element of a buffer twice as long. */
		int64_t n2 = sh[0] * 2;
		epj_tensor *buf = epj_zeros(ctx, epj_tensor_dtype(t), 1, &n2);
		tu_ok(ctx, buf);
		view = epj_slice(ctx, buf, 0, 1, n2, 2);
		epj_tensor_free(buf);
	} else {
		view = epj_zeros(ctx, epj_tensor_dtype(t), 0, sh);
	}
	tu_ok(ctx, view);
	ck_assert_int_eq(epj_tensor_from_f64(ctx, view, vals), EPJ_OK);
	epj_no_grad_exit(ctx, prev);
	free(vals);
	return view;
}

epj_tensor *tu_maybe_noncontig(epj_ctx *ctx, epj_tensor *t, bool nc)
{
	if (!nc || epj_tensor_ndim(t) < 1)
		return t;
	epj_tensor *v = tu_noncontig(ctx, t);
	epj_tensor_free(t);
	return v;
}

epj_tensor *tu_randn_nc(epj_ctx *ctx, epj_dtype dt, int nd,
			const int64_t *shape, bool nc)
{
	return tu_maybe_noncontig(ctx, tu_randn(ctx, dt, nd, shape), nc);
}

/* ---- row-major index arithmetic ----------------------------------------- */

int64_t tu_numel(int nd, const int64_t *shape)
{
	int64_t n = 1;
	for (int i = 0; i < nd; i++)
		n *= shape[i];
	return n;
}

int64_t tu_flat(int nd, const int64_t *shape, const int64_t *m)
{
	int64_t f = 0;
	for (int i = 0; i < nd; i++)
		f = f * shape[i] + m[i];
	return f;
}

void tu_unflat(int64_t f, int nd, const int64_t *shape, int64_t *m)
{
	for (int i = nd - 1; i >= 0; i--) {
		m[i] = f % shape[i];
		f /= shape[i];
	}
}

bool tu_next_index(int nd, const int64_t *shape, int64_t *idx)
{
	for (int i = nd - 1; i >= 0; i--) {
		if (++idx[i] < shape[i])
			return true;
		idx[i] = 0;
	}
	return false;
}

void tu_assert_shape(const epj_tensor *t, int nd, const int64_t *shape)
{
	ck_assert_int_eq(epj_tensor_ndim(t), nd);
	for (int i = 0; i < nd; i++)
		ck_assert_int_eq(epj_tensor_dim(t, i), shape[i]);
}

/* ---- expected errors ---------------------------------------------------- */

void tu_assert_ctx_error(epj_ctx *ctx, epj_status st,
			 const char *const *needles, int n)
{
	ck_assert_msg(epj_ctx_status(ctx) == st, "status %s, want %s: %s",
		      epj_status_name(epj_ctx_status(ctx)), epj_status_name(st),
		      epj_ctx_error(ctx));
	for (int i = 0; i < n; i++)
		if (needles[i])
			ck_assert_msg(strstr(epj_ctx_error(ctx), needles[i]) !=
					  NULL,
				      "error \"%s\" lacks \"%s\"",
				      epj_ctx_error(ctx), needles[i]);
	epj_ctx_clear_error(ctx);
}

void tu_assert_error(epj_ctx *ctx, const void *result, epj_status st,
		     const char *const *needles, int n)
{
	ck_assert_msg(result == NULL, "call succeeded; want %s",
		      epj_status_name(st));
	tu_assert_ctx_error(ctx, st, needles, n);
}

void tu_report(char *buf, size_t n, const char *fmt, ...)
{
	size_t o = strlen(buf);
	if (o + 1 >= n)
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf + o, n - o, fmt, ap);
	va_end(ap);
}

/* ---- files -------------------------------------------------------------- */

const char *tu_srcdir(void)
{
	const char *s = getenv("top_srcdir");
	return s && *s ? s : ".";
}

const char *const TU_TINY_MOE_JSON =
    "{\"model_type\": \"qwen3_moe\", \"vocab_size\": 16, \"hidden_size\": "
    "16, \"num_hidden_layers\": 2, \"num_attention_heads\": 2, "
    "\"num_key_value_heads\": 1, \"head_dim\": 8, \"intermediate_size\": 24, "
    "\"moe_intermediate_size\": 12, \"num_experts\": 4, "
    "\"num_experts_per_tok\": 2, \"norm_topk_prob\": true, "
    "\"max_position_embeddings\": 64, \"initializer_range\": 0.02}";

char *tu_tmpdir_new(const char *tag)
{
	char *d = malloc(strlen(tag) + 32);
	ck_assert_ptr_nonnull(d);
	sprintf(d, "/tmp/epjit-%s-XXXXXX", tag);
	ck_assert_msg(mkdtemp(d) != NULL, "mkdtemp %s: %s", d, strerror(errno));
	return d;
}

int tu_dir_count(const char *d)
{
	DIR *dir = opendir(d);
	ck_assert_msg(dir != NULL, "opendir %s: %s", d, strerror(errno));
	int n = 0;
	struct dirent *de;
	while ((de = readdir(dir)))
		n += strcmp(de->d_name, ".") && strcmp(de->d_name, "..");
	closedir(dir);
	return n;
}

static int rm_one(const char *p, const struct stat *st, int flag,
		  struct FTW *ftw)
{
	(void)st;
	(void)ftw;
	if (flag == FTW_DP)
		return rmdir(p) != 0;
	return unlink(p) != 0;
}

void tu_tmpdir_free(char *dir)
{
	/* Tests may leave the directory without write permission. */
	chmod(dir, 0700);
	ck_assert_msg(nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS) == 0,
		      "cannot remove %s: %s", dir, strerror(errno));
	free(dir);
}

char *tu_path(const char *dir, const char *name)
{
	size_t n = strlen(dir) + strlen(name) + 2;
	char *p = malloc(n);
	ck_assert_ptr_nonnull(p);
	snprintf(p, n, "%s/%s", dir, name);
	return p;
}

tu_tmpfile tu_tmpfile_new(const char *tag, const char *name, const char *text)
{
	tu_tmpfile f = { tu_tmpdir_new(tag), NULL };
	f.path = tu_path(f.dir, name);
	tu_write_text(f.path, text);
	return f;
}

void tu_tmpfile_free(tu_tmpfile *f)
{
	free(f->path);
	tu_tmpdir_free(f->dir);
	f->path = f->dir = NULL;
}

bool tu_exists(const char *path)
{
	struct stat st;
	return stat(path, &st) == 0;
}

void tu_write_file(const char *path, const void *p, size_t n)
{
	FILE *f = fopen(path, "wb");
	ck_assert_msg(f != NULL, "open %s: %s", path, strerror(errno));
	ck_assert_uint_eq(fwrite(p, 1, n, f), n);
	ck_assert_int_eq(fclose(f), 0);
}

void tu_write_text(const char *path, const char *s)
{
	tu_write_file(path, s, strlen(s));
}

char *tu_slurp(const char *path, size_t *n)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return NULL;
	ck_assert_int_eq(fseek(f, 0, SEEK_END), 0);
	long sz = ftell(f);
	ck_assert_int_ge(sz, 0);
	rewind(f);
	char *b = malloc((size_t)sz + 1);
	ck_assert_ptr_nonnull(b);
	ck_assert_uint_eq(fread(b, 1, (size_t)sz, f), (size_t)sz);
	fclose(f);
	b[sz] = '\0';
	if (n)
		*n = (size_t)sz;
	return b;
}

unsigned char *tu_read_file(const char *path, size_t *n)
{
	char *b = tu_slurp(path, n);
	ck_assert_msg(b != NULL, "open %s: %s", path, strerror(errno));
	return (unsigned char *)b;
}

char *tu_first_line(const char *path)
{
	char *s = tu_slurp(path, NULL);
	if (s)
		s[strcspn(s, "\r\n")] = '\0';
	return s;
}

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

int tu_list_dir(const char *dir, bool dirs_only, char ***out)
{
	DIR *d = opendir(dir);
	if (!d)
		return -1;
	int n = 0, cap = 16;
	char **names = malloc(sizeof *names * (size_t)cap);
	ck_assert_ptr_nonnull(names);
	struct dirent *e;
	while ((e = readdir(d))) {
		if (e->d_name[0] == '.')
			continue;
		if (dirs_only) {
			char *p = tu_path(dir, e->d_name);
			struct stat st;
			bool is_dir = stat(p, &st) == 0 && S_ISDIR(st.st_mode);
			free(p);
			if (!is_dir)
				continue;
		}
		if (n == cap) {
			cap *= 2;
			names = realloc(names, sizeof *names * (size_t)cap);
			ck_assert_ptr_nonnull(names);
		}
		names[n] = strdup(e->d_name);
		ck_assert_ptr_nonnull(names[n]);
		n++;
	}
	closedir(d);
	qsort(names, (size_t)n, sizeof *names, cmp_str);
	*out = names;
	return n;
}

void tu_free_names(char **names, int n)
{
	for (int i = 0; i < n; i++)
		free(names[i]);
	free(names);
}

static bool close_enough(double a, double r, double rtol, double atol)
{
	if (isnan(r))
		return isnan(a);
	if (isinf(r))
		return a == r;
	return fabs(a - r) <= atol + rtol * fabs(r);
}

void tu_assert_close(epj_ctx *ctx, const epj_tensor *t, const double *ref,
		     double rtol, double atol, const char *what)
{
	int64_t n = epj_tensor_numel(t);
	double *v = tu_values(ctx, t);
	int64_t worst = -1, bad = 0;
	double worst_err = -1;
	for (int64_t i = 0; i < n; i++) {
		if (close_enough(v[i], ref[i], rtol, atol))
			continue;
		bad++;
		double err = fabs(v[i] - ref[i]) / (atol + rtol * fabs(ref[i]));
		if (isnan(err) || err > worst_err) {
			worst_err = isnan(err) ? INFINITY : err;
			worst = i;
		}
	}
	double got = worst >= 0 ? v[worst] : 0,
	       want = worst >= 0 ? ref[worst] : 0;
	free(v);
	ck_assert_msg(bad == 0,
		      "%s: %lld of %lld elements differ; worst at %lld: got "
		      "%.9g want %.9g (rtol %g atol %g, seed %llu)",
		      what, (long long)bad, (long long)n, (long long)worst, got,
		      want, rtol, atol, (unsigned long long)tu_seed());
}

void tu_assert_tensors_close(epj_ctx *ctx, const epj_tensor *a,
			     const epj_tensor *b, double rtol, double atol,
			     const char *what)
{
	ck_assert_int_eq(epj_tensor_ndim(a), epj_tensor_ndim(b));
	for (int i = 0; i < epj_tensor_ndim(a); i++)
		ck_assert_int_eq(epj_tensor_dim(a, i), epj_tensor_dim(b, i));
	double *rb = tu_values(ctx, b);
	tu_assert_close(ctx, a, rb, rtol, atol, what);
	free(rb);
}

/* sum(out * w) in double, for a forward evaluation under no-grad. */
static double weighted_sum(epj_ctx *ctx, tu_fn fn, epj_tensor *const *in,
			   void *user, const double *w, int64_t nw)
{
	epj_tensor *out = fn(ctx, in, user);
	tu_ok(ctx, out);
	ck_assert_int_eq(epj_tensor_numel(out), nw);
	double *v = tu_values(ctx, out);
	double s = 0;
	for (int64_t i = 0; i < nw; i++)
		s += v[i] * w[i];
	free(v);
	epj_tensor_free(out);
	return s;
}

void tu_gradcheck(epj_ctx *ctx, tu_fn fn, epj_tensor *const *in, int n_in,
		  void *user, double eps, double rtol, double atol,
		  const char *what)
{
	for (int i = 0; i < n_in; i++)
		if (in[i])
			epj_tensor_zero_grad(in[i]);
	epj_tensor *out = fn(ctx, in, user);
	tu_ok(ctx, out);
	ck_assert_msg(epj_tensor_requires_grad(out),
		      "%s: output does not require grad", what);
	int64_t nw = epj_tensor_numel(out);
	epj_tensor *wt =
	    epj_randn(ctx, epj_tensor_dtype(out), epj_tensor_ndim(out),
		      epj_tensor_shape(out), 0.0, 1.0);
	tu_ok(ctx, wt);
	double *w = tu_values(ctx, wt);
	epj_tensor *prod = epj_mul(ctx, out, wt);
	epj_tensor *loss = epj_sum_all(ctx, prod);
	tu_ok(ctx, loss);
	ck_assert_msg(epj_backward(ctx, loss, NULL) == EPJ_OK, "%s: %s", what,
		      epj_ctx_error(ctx));
	epj_tensor_free(loss);
	epj_tensor_free(prod);
	epj_tensor_free(out);
	epj_tensor_free(wt);

	bool prev = epj_no_grad_enter(ctx);
	for (int i = 0; i < n_in; i++) {
		if (!in[i] || !epj_tensor_requires_grad(in[i]))
			continue;
		epj_tensor *g = epj_tensor_grad(in[i]);
		ck_assert_msg(g != NULL, "%s: input %d got no gradient", what,
			      i);
		double *ga = tu_values(ctx, g);
		int64_t n = epj_tensor_numel(in[i]);
		/* Large inputs: check a random subset of elements. */
		int64_t checks = n <= 400 ? n : 200;
		for (int64_t c = 0; c < checks; c++) {
			int64_t k = n <= 400 ? c : tu_randint(0, n);
			double x0 = epj_tensor_get_f64(in[i], k);
			epj_tensor_set_f64(in[i], k, x0 + eps);
			double lp = weighted_sum(ctx, fn, in, user, w, nw);
			epj_tensor_set_f64(in[i], k, x0 - eps);
			double lm = weighted_sum(ctx, fn, in, user, w, nw);
			epj_tensor_set_f64(in[i], k, x0);
			double num = (lp - lm) / (2 * eps);
			ck_assert_msg(close_enough(ga[k], num, rtol, atol),
				      "%s: d/d input %d [%lld]: analytic %.9g "
				      "numeric %.9g (eps %g rtol %g atol %g, "
				      "seed %llu)",
				      what, i, (long long)k, ga[k], num, eps,
				      rtol, atol,
				      (unsigned long long)tu_seed());
		}
		free(ga);
	}
	epj_no_grad_exit(ctx, prev);
	free(w);
}

/* ---- compiled regions --------------------------------------------------- */

epj_status tu_traced(void *user, epj_ctx *ctx, epj_tensor *const *in, int n_in,
		     epj_tensor **out, int n_out)
{
	(void)n_in;
	(void)n_out;
	out[0] = ((tu_region_user *)user)->fn(ctx, in);
	return out[0] ? EPJ_OK : epj_ctx_status(ctx);
}

ej_region_fn *tu_compile_region(epj_ctx *ctx, ej_jit *jit, tu_region_fn fn,
				epj_tensor *const *in, int n_in)
{
	tu_region_user u = { fn };
	ej_trace *tr = NULL;
	epj_status st = ej_trace_region(ctx, jit, tu_traced, &u, in, n_in, 1,
					NULL, NULL, &tr);
	ck_assert_msg(st == EPJ_OK, "trace: %s", epj_ctx_error(ctx));
	ej_region_fn *f = NULL;
	st = ej_jit_compile(ctx, jit, tr, &f);
	ck_assert_msg(st == EPJ_OK, "compile: %s", epj_ctx_error(ctx));
	return f;
}

void tu_next_batch_varied(epj_ctx *ctx, epj_corpus *c, int64_t B, int64_t T,
			  epj_tensor **ids, epj_tensor **labels)
{
	for (int tries = 0;; tries++) {
		ck_assert_int_eq(
		    epj_corpus_next_batch(ctx, c, B, T, ids, labels), EPJ_OK);
		bool varied = false;
		for (int64_t b = 0; b < B && !varied; b++)
			for (int64_t t = 1; t < T && !varied; t++)
				varied = epj_tensor_get_f64(*ids, b * T + t) !=
					 epj_tensor_get_f64(*ids, b * T);
		if (varied)
			return;
		ck_assert_msg(tries < 32, "32 batches of constant rows");
		epj_tensor_free(*ids);
		epj_tensor_free(*labels);
	}
}
