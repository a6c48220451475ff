/* check_util.h -- shared helpers of the Check suites.
 *
 * Randomness: every suite draws from a seed that is fresh per run (time and
 * pid) unless EPJIT_TEST_SEED is set; the runner prints the seed first, so a
 * failing run can be replayed exactly.
 */
#ifndef EPJIT_CHECK_UTIL_H
#define EPJIT_CHECK_UTIL_H

#include <check.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "epjit.h"

/* Suites (one per module), listed in check_main.c. */
Suite *make_tensor_suite(void);
Suite *make_alloc_suite(void);
Suite *make_autograd_suite(void);
Suite *make_counters_suite(void);
Suite *make_ops_pointwise_suite(void);
Suite *make_ops_reduce_suite(void);
Suite *make_ops_linalg_suite(void);
Suite *make_ops_attention_suite(void);
Suite *make_ops_index_suite(void);
Suite *make_ops_shape_suite(void);
Suite *make_config_suite(void);
Suite *make_model_config_suite(void);
Suite *make_safetensors_suite(void);
Suite *make_data_suite(void);
Suite *make_autoep_suite(void);
Suite *make_module_suite(void);
Suite *make_optim_suite(void);
Suite *make_model_suite(void);
Suite *make_engine_suite(void);
Suite *make_save_suite(void);
Suite *make_jit_suite(void);
Suite *make_compile_suite(void);
Suite *make_parity_suite(void);
Suite *make_kcache_suite(void);
Suite *make_cc_suite(void);
Suite *make_codegen_suite(void);
Suite *make_keys_suite(void);
Suite *make_graph_api_suite(void);
Suite *make_sim_suite(void);
Suite *make_cuda_suite(void);
Suite *make_gpu_suite(void);
Suite *make_archive_suite(void);
Suite *make_config_doc_suite(void);
Suite *make_templates_suite(void);
Suite *make_tmpl_gemm_suite(void);
Suite *make_tmpl_attention_suite(void);
Suite *make_tmpl_moe_suite(void);
Suite *make_eager_sim_suite(void);
Suite *make_cublaslt_suite(void);
Suite *make_nccl_suite(void);
Suite *make_eager_cuda_suite(void);
Suite *make_gemm_cuda_suite(void);
Suite *make_ops_moe_suite(void);

/* The run's base seed. */
uint64_t tu_seed(void);
/* tcase_add_loop_test(tc, fn, 0, n), or, when EPJIT_CHECK_QUICK is set
 * (and not "0"), a window of (n + 2) / 3 of the n variants at an offset
 * drawn from tu_seed(): every test still runs, on fewer variants (the
 * sanitizer phase of .ci/run; doc/testing.md). */
void tu_add_loop_test(TCase *tc, const TTest *fn, int n);
/* Whether item i of a test's own list runs: always, or, under
 * EPJIT_CHECK_QUICK, every third item at an offset drawn from tu_seed()
 * (for a test that loops over many slow units itself: NVRTC compiles of
 * every template, where a sanitized build checks nothing more than the
 * plain one). */
bool tu_quick_keep(int i);
/* A fresh context (cpu) seeded from tu_seed() and a per-call counter. */
epj_ctx *tu_ctx(void);
/* Uniform integer in [lo, hi) from the test RNG (seeded from tu_seed). */
int64_t tu_randint(int64_t lo, int64_t hi);
double tu_uniform(double lo, double hi);

/* Random normal tensor (mean 0, std 1) from ctx's RNG. */
epj_tensor *tu_randn(epj_ctx *ctx, epj_dtype dt, int ndim,
		     const int64_t *shape);
/* Same values as t, stored non-contiguously (a transposed or strided buffer
 * viewed back to t's shape).  t must have ndim >= 1. */
epj_tensor *tu_noncontig(epj_ctx *ctx, epj_tensor *t);
/* All elements as a malloc'ed double array (caller frees). */
double *tu_values(epj_ctx *ctx, const epj_tensor *t);

/* Fails the test unless every element satisfies
 * |t - ref| <= atol + rtol * |ref| (NaN only matches NaN, Inf equal Inf).
 * Prints the worst element on failure. */
void tu_assert_close(epj_ctx *ctx, const epj_tensor *t, const double *ref,
		     double rtol, double atol, const char *what);
/* Same between two tensors of one shape. */
void tu_assert_tensors_close(epj_ctx *ctx, const epj_tensor *a,
			     const epj_tensor *b, double rtol, double atol,
			     const char *what);
/* Fails with the context message when t is NULL. */
#define tu_ok(ctx, t) ck_assert_msg((t) != NULL, "%s", epj_ctx_error(ctx))

/* Like ck_assert, but sends nothing to Check's parent process unless the
 * condition fails: for asserts in hot loops (ck_assert costs a message per
 * check). */
#define tu_assert(c)                                                           \
	do {                                                                   \
		if (!(c))                                                      \
			ck_abort_msg(                                          \
			    "%s:%d: assertion '%s' failed (seed %llu)",        \
			    __FILE__, __LINE__, #c,                            \
			    (unsigned long long)tu_seed());                    \
	} while (0)

/* ---- row-major index arithmetic for double references ---------------- */

/* Product of shape[0..nd) (1 for nd == 0). */
int64_t tu_numel(int nd, const int64_t *shape);
/* Row-major flat index of multi-index m, and back. */
int64_t tu_flat(int nd, const int64_t *shape, const int64_t *m);
void tu_unflat(int64_t f, int nd, const int64_t *shape, int64_t *m);
/* Advances a row-major multi-index; false after the last one. */
bool tu_next_index(int nd, const int64_t *shape, int64_t *idx);
/* Fails unless t has exactly the dims shape[0..nd). */
void tu_assert_shape(const epj_tensor *t, int nd, const int64_t *shape);

/* t itself, or when nc (and t has ndim >= 1) its non-contiguous copy
 * (tu_noncontig) with t freed: takes t. */
epj_tensor *tu_maybe_noncontig(epj_ctx *ctx, epj_tensor *t, bool nc);
/* tu_randn, non-contiguous when nc (see tu_maybe_noncontig). */
epj_tensor *tu_randn_nc(epj_ctx *ctx, epj_dtype dt, int nd,
			const int64_t *shape, bool nc);

/* ---- expected errors ---------------------------------------------------- */

/* Fails unless ctx holds an error of status st whose message contains every
 * non-NULL needles[i], i < n; then clears the error. */
void tu_assert_ctx_error(epj_ctx *ctx, epj_status st,
			 const char *const *needles, int n);
/* Same, after failing unless result is NULL (the call that reported the
 * error returns NULL on failure). */
void tu_assert_error(epj_ctx *ctx, const void *result, epj_status st,
		     const char *const *needles, int n);
/* A needle list written inline, as the two arguments needles, n:
 *   tu_assert_error(ctx, epj_add(ctx, a, b), EPJ_ERR_SHAPE,
 *                   TU_STRS("add", "[2,3]")); */
#define TU_STRS(...)                                                           \
	(const char *const[]){ __VA_ARGS__ },                                  \
	    (int)(sizeof((const char *const[]){ __VA_ARGS__ }) /               \
		  sizeof(const char *))

/* Appends printf-style text to the NUL-terminated report in buf (capacity
 * n), cut at the capacity: data-driven tests collect every failing case and
 * fail once with all of them. */
void tu_report(char *buf, size_t n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- compiled regions (the jit's tests) ------------------------------ */

struct ej_jit;
struct ej_region_fn;

/* A function of tensors traced as a region with one output. */
typedef epj_tensor *(*tu_region_fn)(epj_ctx *ctx, epj_tensor *const *in);
typedef struct tu_region_user {
	tu_region_fn fn;
} tu_region_user;
/* The ej_traced_fn that calls ((tu_region_user *)user)->fn. */
epj_status tu_traced(void *user, epj_ctx *ctx, epj_tensor *const *in, int n_in,
		     epj_tensor **out, int n_out);
/* Traces fn over in[0..n_in) with jit and compiles it (the test fails on
 * any error); the caller frees the result (ej_region_fn_free). */
struct ej_region_fn *tu_compile_region(epj_ctx *ctx, struct ej_jit *jit,
				       tu_region_fn fn, epj_tensor *const *in,
				       int n_in);

/* ---- files -------------------------------------------------------------- */

/* $top_srcdir (set by `make check`), else ".". */
const char *tu_srcdir(void);
/* A fresh private directory /tmp/epjit-<tag>-XXXXXX (malloc'ed). */
/* The tiny MoE model of the engine and device tests, as config.json:
 * vocab 16, hidden 16, 2 layers (2 heads / 1 KV head of dim 8), 4 experts
 * of dim 12, top-2 renormalised. */
extern const char *const TU_TINY_MOE_JSON;

char *tu_tmpdir_new(const char *tag);
/* Number of entries of directory d other than . and .. (fails the test
 * when d cannot be opened). */
int tu_dir_count(const char *d);
/* Removes dir and everything under it (rm -rf, never following links;
 * fails the test when something cannot be removed), then frees dir. */
void tu_tmpdir_free(char *dir);
/* A file `name` holding `text` in a fresh temporary directory, for APIs
 * that read a path; tu_tmpfile_free removes the directory with everything
 * in it. */
typedef struct tu_tmpfile {
	char *dir;
	char *path;
} tu_tmpfile;
tu_tmpfile tu_tmpfile_new(const char *tag, const char *name, const char *text);
void tu_tmpfile_free(tu_tmpfile *f);
/* "dir/name", malloc'ed. */
char *tu_path(const char *dir, const char *name);
bool tu_exists(const char *path); /* stat() succeeds (links followed) */
/* Writes n bytes (or the string s) as the whole file at path. */
void tu_write_file(const char *path, const void *p, size_t n);
void tu_write_text(const char *path, const char *s);
/* The whole file at path, malloc'ed with a NUL after the last byte; *n (when
 * n is not NULL) its size.  tu_read_file fails the test when the file cannot
 * be opened, tu_slurp returns NULL. */
unsigned char *tu_read_file(const char *path, size_t *n);
char *tu_slurp(const char *path, size_t *n);
/* The first line of a file (newline stripped), NULL when unreadable. */
char *tu_first_line(const char *path);
/* The names in dir (only subdirectories when dirs_only), "." files left
 * out, sorted by strcmp, into *out (malloc'ed, like each name).  Returns
 * their number, or -1 when dir cannot be opened. */
int tu_list_dir(const char *dir, bool dirs_only, char ***out);
void tu_free_names(char **names, int n);

/* Gradient check.  fn maps the inputs to one output tensor.  The check draws
 * a random weight w shaped like the output, backpropagates sum(out * w)
 * through fn, and compares every input's gradient (for inputs with
 * requires_grad set) against central differences of sum(out * w) computed
 * in double with step eps.  Use f64 inputs wherever the op allows. */
typedef epj_tensor *(*tu_fn)(epj_ctx *ctx, epj_tensor *const *in, void *user);
void tu_gradcheck(epj_ctx *ctx, tu_fn fn, epj_tensor *const *in, int n_in,
		  void *user, double eps, double rtol, double atol,
		  const char *what);

/* The stand-in CUDA driver (t/fake_cuda.c) for a "cuda" context, defined
 * in check_cuda.c: usable says whether it and NVRTC are there; begin
 * points EPJIT_CUDA_DRIVER at it (the driver state reset) and makes its
 * launches run on cuda-sim, with FAKE_CUDA_GUARD=1 unless set; end undoes
 * the hook. */
bool tu_fake_cuda_usable(void);
bool tu_fake_cuda_begin(void);
void tu_fake_cuda_end(void);
/* The cuda context's GEMM set on a real GPU through cuBLASLt (defined in
 * check_gemm_cuda.c; i 0: f32, 1: bf16). */
void tu_gpu_gemm_run(int i);

/* The gpu suite (CK_RUN_SUITE=gpu, run by tools/gpu-check) runs the bodies
 * of the stand-in cases (eager ops, MoE rows, attention, the optimizer,
 * grouped GEMMs, CUDA-graph replay, training) on whatever driver the
 * machine has: tu_gpu_setup, the checked fixture of its TCases, opens
 * $EPJIT_CUDA_DRIVER (default libcuda.so.1) and NVRTC, and from then on
 * tu_fake_cuda_usable says whether that worked and tu_fake_cuda_begin
 * uses that driver as it is (a real GPU runs the kernels; the stand-in,
 * when the variable names it, runs them on cuda-sim through the hook) and
 * the machine's cuBLASLt; tu_gpu_teardown ends it.  Without a usable
 * driver each case says so and passes, unless EPJIT_GPU_STRICT=1 (what
 * tools/gpu-check sets), which makes every such skip a failure. */
void tu_gpu_setup(void);
void tu_gpu_teardown(void);
/* Whether the gpu suite's cases are worth registering: a driver library
 * loads ($EPJIT_CUDA_DRIVER or libcuda.so.1; dlopen only: the parent of
 * forked cases must never initialise CUDA), or EPJIT_GPU_STRICT is set
 * (then they run and fail).  Without it make check on a machine without
 * a GPU registers none of them. */
bool tu_gpu_wanted(void);
/* EPJIT_GPU_STRICT is set (and not "0"). */
bool tu_gpu_strict(void);
/* In a gpu-suite case on a real driver (not the stand-in). */
bool tu_gpu_on_machine(void);
/* Says why a gpu case cannot run: under EPJIT_GPU_STRICT a failure, else
 * a skip (false returned). */
bool tu_gpu_skip(const char *why);
/* The gpu suite's TCases of other files: gpu_eager (check_eager_sim.c),
 * gpu_step (check_cuda_step.c), gpu_gemm (check_gemm_cuda.c). */
void tu_add_gpu_eager_cases(Suite *s);
void tu_add_gpu_step_cases(Suite *s);
void tu_add_gpu_gemm_cases(Suite *s);

#endif

/* The next batch of corpus c (B x T ids and labels) whose rows are not all
 * constant.  A batch of constant rows (a likely self-transition of the
 * synthetic chain) makes every value of an attention row the same, so the
 * gradients of q_proj, k_proj and the QK norms are zero up to rounding;
 * AdamW turns that rounding into steps of up to lr either way, and two
 * devices then diverge by whole steps.  Tests that compare training runs
 * across devices draw their batches with this. */
void tu_next_batch_varied(epj_ctx *ctx, epj_corpus *c, int64_t B, int64_t T,
			  epj_tensor **ids, epj_tensor **labels);
