/* cublaslt.c -- row-major GEMMs on device pointers through cuBLASLt, expert
 * GEMMs through cuBLAS's grouped batched GEMM (cublaslt.h).
 *
 *   ej_cublaslt_new     dlopen libcublasLt ($EPJIT_CUBLASLT) -> dlsym every
 *                       entry point -> cublasLtCreate; libcublas
 *                       ($EPJIT_CUBLAS) with cublasGemmGroupedBatchedEx when
 *                       present; workspace from the caller's allocator
 *   ej_cublaslt_gemm    validate -> map to column-major -> descriptors ->
 *                       algorithm (table, else the heuristic, once per
 *                       shape) -> cublasLtMatmul on the compute stream
 *
 * Row-major to column-major.  A row-major [r,c] matrix with row stride s is,
 * read column-major, its transpose: a c x r matrix with leading dimension s.
 * So the row-major d[m,n] = op(a) op(b) is computed as the column-major
 *
 *   d^T (n x m, ld ldd) = op(b)^T (n x k) . op(a)^T (k x m)
 *
 * cuBLASLt's A is our b and its B is our a.  Our b stored [k,n] (no
 * transpose) reads as the n x k matrix op(b)^T itself (TRANSA = N, layout
 * n x k, ld ldb); stored [n,k] (trans_b) it reads as k x n, the transpose
 * of what is needed (TRANSA = T, layout k x n).  Likewise for a with
 * TRANSB.  The bias, one value per column of the row-major d, is one per
 * row of the column-major d^T: the CUBLASLT_EPILOGUE_BIAS vector, whose
 * length is D's row count (n).
 *
 * cuBLASLt assumes for an algorithm the pointer alignment it was chosen
 * for; the table key holds each pointer's alignment (capped at 256 bytes)
 * and the preference tells the heuristic those alignments.
 *
 * "No algorithm" is an answer, not a failure.  cuBLASLt says it three ways,
 * each documented (cublasLt.h, cuBLAS guide): the heuristic succeeds with
 * no result (or a result whose state is not SUCCESS), the heuristic
 * answers CUBLAS_STATUS_NOT_SUPPORTED ("no heuristic function available
 * for current configuration", what a real GPU says for a layout or type
 * it has no kernel for), or cublasLtMatmul answers NOT_SUPPORTED ("current
 * implementation on selected device doesn't support configured
 * operation"; checked before anything is launched).  All three make the
 * GEMM EPJ_ERR_UNSUPPORTED, for the caller to run the template instead,
 * counted in cublaslt.fallbacks, and the refusal is kept in the table like
 * an algorithm, so the problem is not asked about again.  NOT_SUPPORTED
 * from cublasGemmGroupedBatchedEx (a type combination it lacks) makes that
 * dtype's grouped calls loop over single GEMMs from then on.  Every other
 * status stays a hard EPJ_ERR_BACKEND naming the call.
 */
#include "cublaslt.h"
#include "cuda_libs.h"
#include "dynlib.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the ABI subset (values as in cublasLt.h, cublas_api.h,
 * library_types.h) ---------------------------------------------------------
 */
typedef int ej_cublas_status; /* CUBLAS_STATUS_SUCCESS = 0 */
typedef struct {
	uint64_t data[8];
} ej_lt_algo; /* cublasLtMatmulAlgo_t */
typedef struct {
	ej_lt_algo algo;
	size_t workspace_size;
	ej_cublas_status state;
	float waves;
	int reserved[4];
} ej_lt_heur; /* cublasLtMatmulHeuristicResult_t */

enum {
	LT_SUCCESS = 0,
	LT_NOT_SUPPORTED = 15, /* CUBLAS_STATUS_NOT_SUPPORTED */
	LT_R_32F = 0,	       /* CUDA_R_32F */
	LT_R_16BF = 14,	       /* CUDA_R_16BF */
	LT_COMPUTE_32F = 68,
	LT_OP_N = 0,
	LT_OP_T = 1,
	LT_DESC_TRANSA = 3,
	LT_DESC_TRANSB = 4,
	LT_DESC_EPILOGUE = 7,
	LT_DESC_BIAS_POINTER = 8,
	LT_EPILOGUE_DEFAULT = 1,
	LT_EPILOGUE_BIAS = 4,
	LT_PREF_MAX_WORKSPACE = 1,
	LT_PREF_ALIGN_A = 5, /* ... _B 6, _C 7, _D 8 */
};

#define EJ_LT_ENTRY_POINTS(X)                                                  \
	X(cublasLtCreate, (void **handle))                                     \
	X(cublasLtDestroy, (void *handle))                                     \
	X(cublasLtMatmulDescCreate, (void **desc, int compute, int scale))     \
	X(cublasLtMatmulDescDestroy, (void *desc))                             \
	X(cublasLtMatmulDescSetAttribute,                                      \
	  (void *desc, int attr, const void *buf, size_t size))                \
	X(cublasLtMatrixLayoutCreate,                                          \
	  (void **layout, int type, uint64_t rows, uint64_t cols, int64_t ld)) \
	X(cublasLtMatrixLayoutDestroy, (void *layout))                         \
	X(cublasLtMatmulPreferenceCreate, (void **pref))                       \
	X(cublasLtMatmulPreferenceDestroy, (void *pref))                       \
	X(cublasLtMatmulPreferenceSetAttribute,                                \
	  (void *pref, int attr, const void *buf, size_t size))                \
	X(cublasLtMatmulAlgoGetHeuristic,                                      \
	  (void *handle, void *desc, void *adesc, void *bdesc, void *cdesc,    \
	   void *ddesc, void *pref, int requested, ej_lt_heur *results,        \
	   int *returned))                                                     \
	X(cublasLtMatmul,                                                      \
	  (void *handle, void *desc, const void *alpha, const void *A,         \
	   void *adesc, const void *B, void *bdesc, const void *beta,          \
	   const void *C, void *cdesc, void *D, void *ddesc,                   \
	   const ej_lt_algo *algo, void *workspace, size_t workspace_size,     \
	   ej_CUstream stream))

#define EJ_CUBLAS_ENTRY_POINTS(X)                                              \
	X(cublasCreate_v2, (void **handle))                                    \
	X(cublasDestroy_v2, (void *handle))                                    \
	X(cublasSetStream_v2, (void *handle, ej_CUstream stream))              \
	X(cublasSetWorkspace_v2, (void *handle, void *ws, size_t size))        \
	X(cublasGemmGroupedBatchedEx,                                          \
	  (void *handle, const int *transa, const int *transb, const int *m,   \
	   const int *n, const int *k, const void *alpha,                      \
	   const void *const *A, int atype, const int *lda,                    \
	   const void *const *B, int btype, const int *ldb, const void *beta,  \
	   void *const *C, int ctype, const int *ldc, int group_count,         \
	   const int *group_size, int compute))

typedef struct lt_lib {
#define LT_FIELD(name, args) ej_cublas_status(*name) args;
	EJ_LT_ENTRY_POINTS(LT_FIELD)
	EJ_CUBLAS_ENTRY_POINTS(LT_FIELD)
#undef LT_FIELD
	const char *(*status_name)(ej_cublas_status);
	const char *(*status_string)(ej_cublas_status);
	const char *(*blas_status_name)(ej_cublas_status);
	const char *(*blas_status_string)(ej_cublas_status);
	bool grouped; /* libcublas and its grouped GEMM were found */
	char path[1024], blas_path[1024]; /* the files loaded */
} lt_lib;

static lt_lib lib;
static bool lib_load(char *err, size_t n, epj_status *status);
static ej_dynlib lt_dl = EJ_DYNLIB_INIT(lib_load, EPJ_ERR_UNSUPPORTED);

static const char *src_file(const char *p)
{
	const char *s = strrchr(p, '/');
	return s ? s + 1 : p;
}

/* dlopen of the override, else of the first of the default names found
 * where CUDA libraries are looked for (lib/cuda_libs.h: the loader's
 * path, $CUDA_HOME, the Python environments' nvidia/ * /lib); *path gets
 * the file loaded; NULL with why filled. */
static void *open_lib(const char *env, const char *const *names, int n,
		      char *path, size_t path_n, char *why, size_t why_n)
{
	const char *ov = getenv(env);
	if (ov && *ov) {
		snprintf(path, path_n, "%s", ov);
		void *h = ej_dynlib_open(ov, why, why_n);
		ej_cuda_lib_where(h, path, path_n);
		return h;
	}
	return ej_cuda_lib_open(names, n, path, path_n, why, why_n);
}

static void *sym(void *h, const char *name)
{
	return dlsym(h, name);
}

/* The optional libcublas: the grouped GEMM, or nothing (loop instead). */
static void blas_load(void)
{
	static const char *const names[] = { "libcublas.so.13",
					     "libcublas.so.12",
					     "libcublas.so" };
	const char *ov = getenv("EPJIT_CUBLAS");
	if (ov && !strcmp(ov, "0"))
		return;
	char why[1600];
	void *h = open_lib("EPJIT_CUBLAS", names, 3, lib.blas_path,
			   sizeof lib.blas_path, why, sizeof why);
	if (!h) {
		epj_log_msg(EPJ_LOG_INFO,
			    "cublaslt: no grouped GEMM (%s): expert GEMMs "
			    "run one by one",
			    why);
		return;
	}
	bool all = true;
	void *p;
#define BLAS_RESOLVE(name, args)                                               \
	p = sym(h, #name);                                                     \
	memcpy(&lib.name, &p, sizeof p);                                       \
	all = all && p;
	EJ_CUBLAS_ENTRY_POINTS(BLAS_RESOLVE)
#undef BLAS_RESOLVE
	p = sym(h, "cublasGetStatusName");
	memcpy(&lib.blas_status_name, &p, sizeof p);
	p = sym(h, "cublasGetStatusString");
	memcpy(&lib.blas_status_string, &p, sizeof p);
	lib.grouped = all && lib.blas_status_name && lib.blas_status_string;
	if (!lib.grouped)
		epj_log_msg(EPJ_LOG_INFO,
			    "cublaslt: %s has no cublasGemmGroupedBatchedEx "
			    "(cuBLAS 12.5 or newer): expert GEMMs run one by "
			    "one",
			    lib.blas_path);
}

/* Loads lib; false with err (and *status) set. */
static bool lib_load(char *err, size_t n, epj_status *status)
{
	static const char *const names[] = { "libcublasLt.so.13",
					     "libcublasLt.so.12",
					     "libcublasLt.so" };
	*status = EPJ_ERR_UNSUPPORTED;
	const char *ov = getenv("EPJIT_CUBLASLT");
	if (ov && !strcmp(ov, "0")) {
		snprintf(err, n,
			 "cuBLASLt disabled (EPJIT_CUBLASLT=0): GEMMs use "
			 "the NVRTC template");
		return false;
	}
	char why[1600];
	void *h = open_lib("EPJIT_CUBLASLT", names, 3, lib.path,
			   sizeof lib.path, why, sizeof why);
	if (!h) {
		snprintf(err, n,
			 "no cuBLASLt (%s): GEMMs use the NVRTC template", why);
		return false;
	}
	void *p;
#define LT_RESOLVE(name, args)                                                 \
	p = sym(h, #name);                                                     \
	if (!p) {                                                              \
		snprintf(err, n, "cuBLASLt %s is unusable: it lacks %s",       \
			 lib.path, #name);                                     \
		return false;                                                  \
	}                                                                      \
	memcpy(&lib.name, &p, sizeof p);
	EJ_LT_ENTRY_POINTS(LT_RESOLVE)
#undef LT_RESOLVE
	p = sym(h, "cublasLtGetStatusName");
	memcpy(&lib.status_name, &p, sizeof p);
	p = sym(h, "cublasLtGetStatusString");
	memcpy(&lib.status_string, &p, sizeof p);
	if (!lib.status_name || !lib.status_string) {
		snprintf(err, n,
			 "cuBLASLt %s is unusable: it lacks "
			 "cublasLtGetStatusName or cublasLtGetStatusString",
			 lib.path);
		return false;
	}
	blas_load();
	return true;
}

/* The table, loaded at the first call; NULL with the reason in ctx. */
static const lt_lib *lib_get(epj_ctx *ctx)
{
	return ej_dynlib_get(&lt_dl, ctx) ? &lib : NULL;
}

bool ej_cublaslt_available(epj_ctx *ctx)
{
	return lib_get(ctx) != NULL;
}

const char *ej_cublaslt_path(void)
{
	return lib_get(NULL) ? lib.path : "";
}

const char *ej_cublas_path(void)
{
	return lib_get(NULL) && lib.grouped ? lib.blas_path : "";
}

/* Test hook, deliberately in no header: forget the libraries (the handles
 * stay open), so one process can load another stand-in. */
void ej_cublaslt_test_reset(void);
void ej_cublaslt_test_reset(void)
{
	ej_dynlib_reset(&lt_dl);
	memset(&lib, 0, sizeof lib);
}

static epj_status lt_error(epj_ctx *ctx, const lt_lib *l, bool blas,
			   ej_cublas_status r, const char *what,
			   const char *file, int line)
{
	const char *name = NULL, *str = NULL;
	if (blas) {
		name = l->blas_status_name ? l->blas_status_name(r) : NULL;
		str = l->blas_status_string ? l->blas_status_string(r) : NULL;
	} else {
		name = l->status_name ? l->status_name(r) : NULL;
		str = l->status_string ? l->status_string(r) : NULL;
	}
	return ej_error(
	    ctx, EPJ_ERR_BACKEND, "%s: %s failed at %s:%d: %s (%d): %s",
	    blas ? "cublas" : "cublaslt", what, src_file(file), line,
	    name ? name : "CUBLAS_STATUS_?", r, str ? str : "no description");
}

/* The check macro: runs l->call; a failure sets ctx's error and stores the
 * status in st (EPJ_OK otherwise). */
#define EJ_LT_TRY(st, ctx, l, call)                                            \
	do {                                                                   \
		ej_cublas_status ej_lt_r_ = (l)->call;                         \
		(st) = ej_lt_r_ == LT_SUCCESS                                  \
			   ? EPJ_OK                                            \
			   : lt_error((ctx), (l), false, ej_lt_r_, #call,      \
				      __FILE__, __LINE__);                     \
	} while (0)
/* The same for a call whose CUBLAS_STATUS_NOT_SUPPORTED is an answer ("no
 * algorithm", file comment), not a failure: st is EPJ_OK for it too and r
 * holds the library's status. */
#define EJ_ANSWER_(st, r, ctx, l, blas, call)                                  \
	do {                                                                   \
		(r) = (l)->call;                                               \
		(st) = (r) == LT_SUCCESS || (r) == LT_NOT_SUPPORTED            \
			   ? EPJ_OK                                            \
			   : lt_error((ctx), (l), (blas), (r), #call,          \
				      __FILE__, __LINE__);                     \
	} while (0)
#define EJ_LT_ANSWER(st, r, ctx, l, call) EJ_ANSWER_(st, r, ctx, l, false, call)
#define EJ_BLAS_ANSWER(st, r, ctx, l, call)                                    \
	EJ_ANSWER_(st, r, ctx, l, true, call)
#define EJ_BLAS_TRY(st, ctx, l, call)                                          \
	do {                                                                   \
		ej_cublas_status ej_lt_r_ = (l)->call;                         \
		(st) = ej_lt_r_ == LT_SUCCESS                                  \
			   ? EPJ_OK                                            \
			   : lt_error((ctx), (l), true, ej_lt_r_, #call,       \
				      __FILE__, __LINE__);                     \
	} while (0)

/* ---- the handle ---------------------------------------------------------- */

/* What an algorithm is chosen for: everything cublasLtMatmulAlgoGetHeuristic
 * sees.  Compared with memcmp: always memset before filling. */
typedef struct lt_key {
	int64_t m, n, k, lda, ldb, ldc, ldd;
	int32_t trans_a, trans_b, ab, cd, bias, beta, in_place;
	int32_t align[5]; /* a, b, c, d, bias */
} lt_key;

/* Why cuBLASLt has no algorithm for a problem (file comment). */
typedef enum lt_refusal {
	LT_HAS_ALGO = 0,
	LT_NO_RESULT,	     /* the heuristic succeeded with no usable result */
	LT_HEUR_UNSUPPORTED, /* the heuristic answered NOT_SUPPORTED */
	LT_MATMUL_UNSUPPORTED, /* cublasLtMatmul answered NOT_SUPPORTED */
} lt_refusal;

typedef struct lt_entry {
	lt_key key;
	ej_lt_algo algo;
	size_t workspace;
	lt_refusal refused; /* LT_HAS_ALGO, else why there is none */
} lt_entry;

struct ej_cublaslt {
	const lt_lib *l;
	ej_cuda_dev *dev;
	ej_allocator *ws_alloc;
	void *handle; /* cublasLtHandle_t */
	void *blas;   /* cublasHandle_t, when grouped */
	void *ws;     /* workspace (device), ws_bytes */
	size_t ws_bytes;
	pthread_mutex_t lock; /* the table and the statistics */
	lt_entry *tab;
	int n_tab, cap_tab;
	/* cublasGemmGroupedBatchedEx answered NOT_SUPPORTED for bf16 (bit 0)
	 * or f32 (bit 1): those grouped calls loop instead */
	unsigned grouped_refused;
	ej_cublaslt_stats st;
};

static size_t workspace_bytes(void)
{
	const char *v = getenv("EPJIT_CUBLASLT_WORKSPACE_MB");
	char *end = NULL;
	long mb = v && *v ? strtol(v, &end, 10) : -1;
	if (v && *v && *end == 0 && mb >= 0 && mb <= 4096)
		return (size_t)mb << 20;
	return (size_t)32 << 20; /* what NVIDIA advises for Hopper */
}

epj_status ej_cublaslt_new(epj_ctx *ctx, ej_cuda_dev *c, ej_allocator *ws,
			   ej_cublaslt **out)
{
	*out = NULL;
	const lt_lib *l = lib_get(ctx);
	if (!l)
		return epj_ctx_status(ctx);
	ej_cublaslt *lt = calloc(1, sizeof *lt);
	if (!lt)
		return ej_error(ctx, EPJ_ERR_NOMEM, "cublaslt: out of memory");
	lt->l = l;
	lt->dev = c;
	lt->ws_alloc = ws;
	pthread_mutex_init(&lt->lock, NULL);
	epj_status st;
	EJ_LT_TRY(st, ctx, l, cublasLtCreate(&lt->handle));
	if (st != EPJ_OK) {
		ej_cublaslt_free(lt);
		return st;
	}
	lt->ws_bytes = workspace_bytes();
	if (lt->ws_bytes) {
		lt->ws = ej_alloc(ws, lt->ws_bytes);
		if (!lt->ws) {
			size_t n = lt->ws_bytes;
			ej_cublaslt_free(lt);
			return ej_error(ctx, EPJ_ERR_NOMEM,
					"cublaslt: cannot allocate the %zu "
					"byte workspace on the device",
					n);
		}
	}
	if (l->grouped) {
		EJ_BLAS_TRY(st, ctx, l, cublasCreate_v2(&lt->blas));
		if (st == EPJ_OK)
			EJ_BLAS_TRY(st, ctx, l,
				    cublasSetStream_v2(
					lt->blas, ej_cuda_compute_stream(c)));
		/* cuBLAS shares the handle's workspace: both run on the one
		 * compute stream, never at once */
		if (st == EPJ_OK && lt->ws)
			EJ_BLAS_TRY(st, ctx, l,
				    cublasSetWorkspace_v2(lt->blas, lt->ws,
							  lt->ws_bytes));
		if (st != EPJ_OK) {
			ej_cublaslt_free(lt);
			return st;
		}
	}
	lt->st.workspace_bytes = lt->ws_bytes;
	lt->st.grouped_available = l->grouped;
	*out = lt;
	return EPJ_OK;
}

void ej_cublaslt_free(ej_cublaslt *lt)
{
	if (!lt)
		return;
	if (lt->blas)
		lt->l->cublasDestroy_v2(lt->blas);
	if (lt->handle)
		lt->l->cublasLtDestroy(lt->handle);
	if (lt->ws)
		ej_dealloc(lt->ws_alloc, lt->ws);
	pthread_mutex_destroy(&lt->lock);
	free(lt->tab);
	free(lt);
}

void ej_cublaslt_stats_get(const ej_cublaslt *lt, ej_cublaslt_stats *out)
{
	ej_cublaslt *m = (ej_cublaslt *)lt;
	pthread_mutex_lock(&m->lock);
	*out = lt->st;
	out->cache_entries = lt->n_tab;
	pthread_mutex_unlock(&m->lock);
}

/* ---- one GEMM ------------------------------------------------------------ */

static int lt_type(epj_dtype dt)
{
	return dt == EPJ_DTYPE_BF16 ? LT_R_16BF : LT_R_32F;
}

static int32_t align_of(const void *p)
{
	uintptr_t u = (uintptr_t)p;
	int32_t a = 256;
	while (a > 1 && u % (uintptr_t)a)
		a /= 2;
	return a;
}

/* Refuses what cuBLASLt would refuse, with the field's name; fills the
 * dense strides. */
static epj_status validate(epj_ctx *ctx, const ej_lt_gemm *g, ej_lt_gemm *o)
{
	*o = *g;
	if (g->m < 0 || g->n < 0 || g->k < 1 || g->m > INT_MAX ||
	    g->n > INT_MAX || g->k > INT_MAX)
		return ej_error(ctx, EPJ_ERR_SHAPE,
				"cublaslt: GEMM m=%lld n=%lld k=%lld: m and n "
				"must be in [0, 2^31), k in [1, 2^31)",
				(long long)g->m, (long long)g->n,
				(long long)g->k);
	bool ab_ok =
	    g->ab_dtype == EPJ_DTYPE_BF16 || g->ab_dtype == EPJ_DTYPE_F32;
	bool cd_ok =
	    g->cd_dtype == EPJ_DTYPE_BF16 || g->cd_dtype == EPJ_DTYPE_F32;
	if (!ab_ok || !cd_ok ||
	    (g->ab_dtype == EPJ_DTYPE_F32 && g->cd_dtype != EPJ_DTYPE_F32))
		return ej_error(ctx, EPJ_ERR_DTYPE,
				"cublaslt: GEMM with a/b %s and c/d %s: "
				"supported are bf16 a/b with bf16 or f32 c/d, "
				"and f32 throughout",
				epj_dtype_name(g->ab_dtype),
				epj_dtype_name(g->cd_dtype));
	int64_t wa = g->trans_a ? g->m : g->k; /* stored row widths */
	int64_t wb = g->trans_b ? g->k : g->n;
	o->lda = g->lda ? g->lda : wa;
	o->ldb = g->ldb ? g->ldb : wb;
	o->ldd = g->ldd ? g->ldd : g->n;
	o->ldc = g->c && g->c != g->d ? (g->ldc ? g->ldc : g->n) : o->ldd;
	const struct {
		const char *name;
		int64_t ld, min;
	} lds[] = { { "lda", o->lda, wa },
		    { "ldb", o->ldb, wb },
		    { "ldc", o->ldc, g->n },
		    { "ldd", o->ldd, g->n } };
	for (int i = 0; i < 4; i++)
		if (lds[i].ld < lds[i].min || lds[i].ld > INT_MAX)
			return ej_error(ctx, EPJ_ERR_INVALID,
					"cublaslt: GEMM m=%lld n=%lld k=%lld: "
					"%s=%lld is below the stored row "
					"width %lld",
					(long long)g->m, (long long)g->n,
					(long long)g->k, lds[i].name,
					(long long)lds[i].ld,
					(long long)lds[i].min);
	if (g->m && g->n && (!g->a || !g->b || !g->d))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"cublaslt: GEMM m=%lld n=%lld k=%lld: a, b "
				"and d must be device pointers",
				(long long)g->m, (long long)g->n,
				(long long)g->k);
	return EPJ_OK;
}

static lt_key key_of(const ej_lt_gemm *g)
{
	lt_key k;
	memset(&k, 0, sizeof k);
	k.m = g->m;
	k.n = g->n;
	k.k = g->k;
	k.lda = g->lda;
	k.ldb = g->ldb;
	k.ldc = g->ldc;
	k.ldd = g->ldd;
	k.trans_a = g->trans_a;
	k.trans_b = g->trans_b;
	k.ab = g->ab_dtype;
	k.cd = g->cd_dtype;
	k.bias = g->bias != NULL;
	k.beta = g->beta != 0;
	k.in_place = !g->c || g->c == g->d;
	k.align[0] = align_of(g->a);
	k.align[1] = align_of(g->b);
	k.align[2] = align_of(g->c ? g->c : g->d);
	k.align[3] = align_of(g->d);
	k.align[4] = g->bias ? align_of(g->bias) : 0;
	return k;
}

/* The cached entry for k, or NULL (lt->lock held). */
static const lt_entry *lookup(const ej_cublaslt *lt, const lt_key *k)
{
	for (int i = 0; i < lt->n_tab; i++)
		if (!memcmp(&lt->tab[i].key, k, sizeof *k))
			return &lt->tab[i];
	return NULL;
}

/* The descriptors of one call (cuBLASLt's A is our b, its B our a). */
typedef struct lt_descs {
	void *op, *la, *lb, *lc, *ld, *pref;
} lt_descs;

static void descs_free(const lt_lib *l, lt_descs *d)
{
	if (d->pref)
		l->cublasLtMatmulPreferenceDestroy(d->pref);
	if (d->ld)
		l->cublasLtMatrixLayoutDestroy(d->ld);
	if (d->lc)
		l->cublasLtMatrixLayoutDestroy(d->lc);
	if (d->lb)
		l->cublasLtMatrixLayoutDestroy(d->lb);
	if (d->la)
		l->cublasLtMatrixLayoutDestroy(d->la);
	if (d->op)
		l->cublasLtMatmulDescDestroy(d->op);
}

static epj_status descs_make(epj_ctx *ctx, const lt_lib *l, const ej_lt_gemm *g,
			     lt_descs *d)
{
	memset(d, 0, sizeof *d);
	epj_status st;
	int32_t ta = g->trans_b ? LT_OP_T : LT_OP_N; /* cuBLASLt's A = b */
	int32_t tb = g->trans_a ? LT_OP_T : LT_OP_N; /* cuBLASLt's B = a */
	uint32_t epi = g->bias ? LT_EPILOGUE_BIAS : LT_EPILOGUE_DEFAULT;
	EJ_LT_TRY(st, ctx, l,
		  cublasLtMatmulDescCreate(&d->op, LT_COMPUTE_32F, LT_R_32F));
	if (st == EPJ_OK)
		EJ_LT_TRY(st, ctx, l,
			  cublasLtMatmulDescSetAttribute(d->op, LT_DESC_TRANSA,
							 &ta, sizeof ta));
	if (st == EPJ_OK)
		EJ_LT_TRY(st, ctx, l,
			  cublasLtMatmulDescSetAttribute(d->op, LT_DESC_TRANSB,
							 &tb, sizeof tb));
	if (st == EPJ_OK)
		EJ_LT_TRY(st, ctx, l,
			  cublasLtMatmulDescSetAttribute(
			      d->op, LT_DESC_EPILOGUE, &epi, sizeof epi));
	if (st == EPJ_OK && g->bias)
		EJ_LT_TRY(
		    st, ctx, l,
		    cublasLtMatmulDescSetAttribute(d->op, LT_DESC_BIAS_POINTER,
						   &g->bias, sizeof g->bias));
	int tab = lt_type(g->ab_dtype), tcd = lt_type(g->cd_dtype);
	/* column-major layouts of the stored matrices (file comment) */
	uint64_t a_rows = (uint64_t)(g->trans_b ? g->k : g->n);
	uint64_t a_cols = (uint64_t)(g->trans_b ? g->n : g->k);
	uint64_t b_rows = (uint64_t)(g->trans_a ? g->m : g->k);
	uint64_t b_cols = (uint64_t)(g->trans_a ? g->k : g->m);
	if (st == EPJ_OK)
		EJ_LT_TRY(st, ctx, l,
			  cublasLtMatrixLayoutCreate(&d->la, tab, a_rows,
						     a_cols, g->ldb));
	if (st == EPJ_OK)
		EJ_LT_TRY(st, ctx, l,
			  cublasLtMatrixLayoutCreate(&d->lb, tab, b_rows,
						     b_cols, g->lda));
	if (st == EPJ_OK)
		EJ_LT_TRY(st, ctx, l,
			  cublasLtMatrixLayoutCreate(&d->lc, tcd,
						     (uint64_t)g->n,
						     (uint64_t)g->m, g->ldc));
	if (st == EPJ_OK)
		EJ_LT_TRY(st, ctx, l,
			  cublasLtMatrixLayoutCreate(&d->ld, tcd,
						     (uint64_t)g->n,
						     (uint64_t)g->m, g->ldd));
	if (st != EPJ_OK)
		descs_free(l, d);
	return st;
}

/* Chooses the algorithm for g (the heuristic's first answer). */
static epj_status choose(epj_ctx *ctx, ej_cublaslt *lt, const ej_lt_gemm *g,
			 const lt_key *k, lt_descs *d, lt_entry *e)
{
	const lt_lib *l = lt->l;
	epj_status st;
	EJ_LT_TRY(st, ctx, l, cublasLtMatmulPreferenceCreate(&d->pref));
	if (st != EPJ_OK)
		return st;
	uint64_t ws = lt->ws_bytes;
	EJ_LT_TRY(st, ctx, l,
		  cublasLtMatmulPreferenceSetAttribute(
		      d->pref, LT_PREF_MAX_WORKSPACE, &ws, sizeof ws));
	for (int i = 0; i < 4 && st == EPJ_OK; i++) {
		/* cuBLASLt's A is our b: alignments b, a, c, d */
		static const int which[4] = { 1, 0, 2, 3 };
		uint32_t al = (uint32_t)k->align[which[i]];
		EJ_LT_TRY(st, ctx, l,
			  cublasLtMatmulPreferenceSetAttribute(
			      d->pref, LT_PREF_ALIGN_A + i, &al, sizeof al));
	}
	if (st != EPJ_OK)
		return st;
	ej_lt_heur h[1];
	memset(h, 0, sizeof h);
	int got = 0;
	ej_cublas_status r;
	EJ_LT_ANSWER(st, r, ctx, l,
		     cublasLtMatmulAlgoGetHeuristic(lt->handle, d->op, d->la,
						    d->lb, d->lc, d->ld,
						    d->pref, 1, h, &got));
	pthread_mutex_lock(&lt->lock);
	lt->st.heuristic_calls++;
	pthread_mutex_unlock(&lt->lock);
	if (st != EPJ_OK)
		return st;
	memset(e, 0, sizeof *e);
	e->key = *k;
	if (r == LT_NOT_SUPPORTED)
		e->refused = LT_HEUR_UNSUPPORTED;
	else if (got < 1 || h[0].state != LT_SUCCESS)
		e->refused = LT_NO_RESULT;
	else {
		e->algo = h[0].algo;
		e->workspace = h[0].workspace_size;
	}
	return EPJ_OK;
}

/* The answer for a GEMM cuBLASLt has no algorithm for (file comment):
 * counted, and EPJ_ERR_UNSUPPORTED saying why. */
static epj_status no_algo(epj_ctx *ctx, ej_cublaslt *lt, const ej_lt_gemm *g,
			  lt_refusal why, bool remembered)
{
	pthread_mutex_lock(&lt->lock);
	lt->st.fallbacks++;
	pthread_mutex_unlock(&lt->lock);
	if (ctx)
		epj_counter_add(ctx, "cublaslt.fallbacks", 1);
	const char *how =
	    why == LT_HEUR_UNSUPPORTED
		? "cublasLtMatmulAlgoGetHeuristic answered "
		  "CUBLAS_STATUS_NOT_SUPPORTED (15)"
	    : why == LT_MATMUL_UNSUPPORTED
		? "cublasLtMatmul answered CUBLAS_STATUS_NOT_SUPPORTED (15)"
		: "the heuristic returned no usable result";
	return ej_error(ctx, EPJ_ERR_UNSUPPORTED,
			"cublaslt: no algorithm for the GEMM m=%lld n=%lld "
			"k=%lld (%s a/b, %s c/d%s) within a %zu byte "
			"workspace: %s%s; left to the template",
			(long long)g->m, (long long)g->n, (long long)g->k,
			epj_dtype_name(g->ab_dtype),
			epj_dtype_name(g->cd_dtype), g->bias ? ", bias" : "",
			lt->ws_bytes, how, remembered ? " (remembered)" : "");
}

/* Keeps e in the table; an entry of the same key is replaced (a refusal
 * by cublasLtMatmul overrides the algorithm the heuristic gave). */
static epj_status remember(epj_ctx *ctx, ej_cublaslt *lt, const lt_entry *e)
{
	epj_status st = EPJ_OK;
	pthread_mutex_lock(&lt->lock);
	lt_entry *old = (lt_entry *)lookup(lt, &e->key);
	if (old) {
		*old = *e;
	} else {
		if (lt->n_tab == lt->cap_tab) {
			int cap = lt->cap_tab ? 2 * lt->cap_tab : 16;
			lt_entry *t = realloc(lt->tab, sizeof *t * (size_t)cap);
			if (!t)
				st = ej_error(ctx, EPJ_ERR_NOMEM,
					      "cublaslt: out of memory");
			else {
				lt->tab = t;
				lt->cap_tab = cap;
			}
		}
		if (st == EPJ_OK)
			lt->tab[lt->n_tab++] = *e;
	}
	pthread_mutex_unlock(&lt->lock);
	return st;
}

static epj_status gemm_one(epj_ctx *ctx, ej_cublaslt *lt, const ej_lt_gemm *g)
{
	const lt_lib *l = lt->l;
	lt_key k = key_of(g);
	lt_entry e;
	bool hit = false;
	pthread_mutex_lock(&lt->lock);
	const lt_entry *c = lookup(lt, &k);
	if (c) {
		e = *c;
		hit = true;
		if (!e.refused)
			lt->st.cache_hits++;
	}
	pthread_mutex_unlock(&lt->lock);
	epj_status st;
	lt_descs d;
	if (hit && e.refused) {
		/* refused before: not asked again */
		st = no_algo(ctx, lt, g, e.refused, true);
		goto out;
	}
	st = descs_make(ctx, l, g, &d);
	if (st != EPJ_OK)
		goto out;
	if (!hit) {
		st = choose(ctx, lt, g, &k, &d, &e);
		if (st == EPJ_OK)
			st = remember(ctx, lt, &e);
		if (st == EPJ_OK && e.refused)
			st = no_algo(ctx, lt, g, e.refused, false);
		if (st != EPJ_OK)
			goto done;
	}
	const void *cp = g->c ? g->c : g->d;
	ej_cublas_status r;
	EJ_LT_ANSWER(st, r, ctx, l,
		     cublasLtMatmul(lt->handle, d.op, &g->alpha, g->b, d.la,
				    g->a, d.lb, &g->beta, cp, d.lc, g->d, d.ld,
				    &e.algo, lt->ws, lt->ws_bytes,
				    ej_cuda_compute_stream(lt->dev)));
	if (st == EPJ_OK && r == LT_NOT_SUPPORTED) {
		/* refused before launching anything: remembered */
		e.refused = LT_MATMUL_UNSUPPORTED;
		st = remember(ctx, lt, &e);
		if (st == EPJ_OK)
			st = no_algo(ctx, lt, g, e.refused, false);
	} else if (st == EPJ_OK) {
		pthread_mutex_lock(&lt->lock);
		lt->st.gemms++;
		pthread_mutex_unlock(&lt->lock);
		if (ctx) {
			epj_counter_add(ctx, "cublaslt.gemms", 1);
			if (hit)
				epj_counter_add(ctx, "cublaslt.cache_hits", 1);
		}
	}
done:
	descs_free(l, &d);
out:
	if (st != EPJ_OK)
		ej_error_prefix(ctx,
				"cublaslt: GEMM m=%lld n=%lld k=%lld "
				"trans_a=%d trans_b=%d %s/%s%s beta=%g",
				(long long)g->m, (long long)g->n,
				(long long)g->k, g->trans_a, g->trans_b,
				epj_dtype_name(g->ab_dtype),
				epj_dtype_name(g->cd_dtype),
				g->bias ? " bias" : "", (double)g->beta);
	return st;
}

epj_status ej_cublaslt_gemm(epj_ctx *ctx, ej_cublaslt *lt, const ej_lt_gemm *g)
{
	ej_lt_gemm v;
	epj_status st = validate(ctx, g, &v);
	if (st != EPJ_OK)
		return st;
	if (v.m == 0 || v.n == 0)
		return EPJ_OK;
	return gemm_one(ctx, lt, &v);
}

/* ---- grouped ------------------------------------------------------------- */

static bool groupable(const ej_lt_gemm *g, const ej_lt_gemm *first)
{
	return !g->bias && (!g->c || g->c == g->d) &&
	       g->ab_dtype == g->cd_dtype && g->ab_dtype == first->ab_dtype &&
	       g->cd_dtype == first->cd_dtype;
}

/* The grouped_refused bit of a dtype. */
static unsigned grouped_bit(epj_dtype dt)
{
	return dt == EPJ_DTYPE_BF16 ? 1u : 2u;
}

/* One cublasGemmGroupedBatchedEx over the n validated, non-empty GEMMs v:
 * one group per GEMM (each its own shape), group size 1.  The pointer
 * arrays live in device memory (cuBLAS reads them there): one block of
 * the caller's allocator, filled by a copy.  *refused: cuBLAS answered
 * NOT_SUPPORTED (nothing ran; st is EPJ_OK and the caller loops). */
static epj_status grouped_native(epj_ctx *ctx, ej_cublaslt *lt, int n,
				 const ej_lt_gemm *v, bool *refused)
{
	*refused = false;
	const lt_lib *l = lt->l;
	size_t ints = (size_t)n * 7, ptrs = (size_t)n * 3;
	int *iv = malloc(sizeof(int) * ints);
	float *ab = malloc(sizeof(float) * 2 * (size_t)n);
	void **hp = malloc(sizeof(void *) * ptrs);
	void **dp = ej_alloc(lt->ws_alloc, sizeof(void *) * ptrs);
	epj_status st = EPJ_OK;
	if (!iv || !ab || !hp || !dp) {
		st = ej_error(ctx, EPJ_ERR_NOMEM,
			      "cublaslt: grouped GEMM of %d: out of memory", n);
		goto out;
	}
	int *ta = iv, *tb = iv + n, *m = iv + 2 * n, *nn = iv + 3 * n,
	    *k = iv + 4 * n, *lda = iv + 5 * n, *ldb = iv + 6 * n;
	int *ldc = malloc(sizeof(int) * (size_t)n),
	    *gs = malloc(sizeof(int) * (size_t)n);
	if (!ldc || !gs) {
		free(ldc);
		free(gs);
		st = ej_error(ctx, EPJ_ERR_NOMEM,
			      "cublaslt: grouped GEMM of %d: out of memory", n);
		goto out;
	}
	for (int i = 0; i < n; i++) {
		/* the same column-major reading as one GEMM: A = b, B = a */
		ta[i] = v[i].trans_b ? LT_OP_T : LT_OP_N;
		tb[i] = v[i].trans_a ? LT_OP_T : LT_OP_N;
		m[i] = (int)v[i].n;
		nn[i] = (int)v[i].m;
		k[i] = (int)v[i].k;
		lda[i] = (int)v[i].ldb;
		ldb[i] = (int)v[i].lda;
		ldc[i] = (int)v[i].ldd;
		gs[i] = 1;
		ab[i] = v[i].alpha;
		ab[n + i] = v[i].beta;
		hp[i] = (void *)v[i].b;
		hp[n + i] = (void *)v[i].a;
		hp[2 * n + i] = v[i].d;
	}
	const ej_device *dev = ej_cuda_device(lt->dev);
	dev->copy(dev->self, dp, hp, sizeof(void *) * ptrs);
	int t = lt_type(v[0].ab_dtype);
	ej_cublas_status r;
	EJ_BLAS_ANSWER(st, r, ctx, l,
		       cublasGemmGroupedBatchedEx(
			   lt->blas, ta, tb, m, nn, k, ab,
			   (const void *const *)dp, t, lda,
			   (const void *const *)(dp + n), t, ldb, ab + n,
			   dp + 2 * n, t, ldc, n, gs, LT_COMPUTE_32F));
	free(ldc);
	free(gs);
	if (st == EPJ_OK && r == LT_NOT_SUPPORTED) {
		/* a type combination it lacks: this dtype loops from now on */
		pthread_mutex_lock(&lt->lock);
		lt->grouped_refused |= grouped_bit(v[0].ab_dtype);
		pthread_mutex_unlock(&lt->lock);
		if (ctx)
			epj_counter_add(ctx, "cublaslt.grouped_refused", 1);
		*refused = true;
	} else if (st == EPJ_OK) {
		pthread_mutex_lock(&lt->lock);
		lt->st.grouped_native++;
		pthread_mutex_unlock(&lt->lock);
		if (ctx)
			epj_counter_add(ctx, "cublaslt.grouped", 1);
	} else {
		ej_error_prefix(ctx, "cublaslt: grouped GEMM of %d (%s)", n,
				epj_dtype_name(v[0].ab_dtype));
	}
out:
	/* the block goes back to the cache: later work on the compute stream
	 * is ordered after the GEMM that reads it */
	if (dp)
		ej_dealloc(lt->ws_alloc, dp);
	free(iv);
	free(ab);
	free(hp);
	return st;
}

epj_status ej_cublaslt_gemm_grouped(epj_ctx *ctx, ej_cublaslt *lt, int n,
				    const ej_lt_gemm *g)
{
	if (n < 0 || (n > 0 && !g))
		return ej_error(ctx, EPJ_ERR_INVALID,
				"cublaslt: grouped GEMM of %d", n);
	ej_lt_gemm *v = malloc(sizeof *v * (size_t)(n ? n : 1));
	if (!v)
		return ej_error(ctx, EPJ_ERR_NOMEM, "cublaslt: out of memory");
	int live = 0;
	bool native = lt->blas != NULL;
	epj_status st = EPJ_OK;
	unsigned grouped_refused;
	pthread_mutex_lock(&lt->lock);
	grouped_refused = lt->grouped_refused;
	pthread_mutex_unlock(&lt->lock);
	for (int i = 0; i < n && st == EPJ_OK; i++) {
		st = validate(ctx, &g[i], &v[live]);
		if (st != EPJ_OK) {
			ej_error_prefix(ctx, "cublaslt: grouped GEMM %d of %d",
					i, n);
			break;
		}
		if (v[live].m == 0 || v[live].n == 0)
			continue; /* an expert without tokens */
		native = native && groupable(&v[live], &v[0]) &&
			 !(grouped_refused & grouped_bit(v[live].ab_dtype));
		live++;
	}
	if (st == EPJ_OK && live > 0) {
		bool refused = false;
		if (native)
			st = grouped_native(ctx, lt, live, v, &refused);
		if (!native || refused) {
			for (int i = 0; i < live && st == EPJ_OK; i++)
				st = gemm_one(ctx, lt, &v[i]);
			pthread_mutex_lock(&lt->lock);
			lt->st.grouped_looped++;
			pthread_mutex_unlock(&lt->lock);
		}
	}
	free(v);
	return st;
}
