/* fake_cublaslt.c -- a stand-in for libcublasLt.so (and for the part of
 * libcublas.so epjit uses: the grouped batched GEMM) that lib/cublaslt.c's
 * tests load through $EPJIT_CUBLASLT / $EPJIT_CUBLAS on machines without a
 * GPU.  Its "device" memory is host memory, as t/fake_cuda.c's is.
 *
 * It computes what the libraries' documentation defines, independently of
 * lib/cublaslt.c, on the CPU with fp32 accumulation:
 *
 *  - column-major matrices: element (i, j) of a layout with leading
 *    dimension ld is at i + j * ld; op(A) is A (CUBLAS_OP_N) or its
 *    transpose (CUBLAS_OP_T, the layout then being k x m);
 *  - D = alpha * op(A) op(B) + beta * C, then CUBLASLT_EPILOGUE_BIAS adds
 *    bias[i] to every column of row i (the bias has D's row count, in D's
 *    type unless CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE says otherwise);
 *  - bf16 results are rounded to nearest even.
 *
 * and refuses, with CUBLAS_STATUS_INVALID_VALUE, what the real library
 * refuses: op(A), op(B), C and D dims that do not agree, a leading dimension
 * below the row count, mixed or unsupported types, C == D with different
 * layouts, a bias epilogue without a bias pointer, a workspace smaller than
 * the algorithm needs.  An algorithm is valid only for the problem it was
 * chosen for (cublasLtMatmulAlgoGetHeuristic stamps it with a fingerprint
 * of the descriptors and the alignments it assumed), so a stale cached
 * algorithm is caught; its workspace need is 64 KiB when the preference
 * allows that and k >= 16, else 0.
 *
 * FAKE_CUBLASLT_FAIL=<entry point> makes that call fail with
 * CUBLAS_STATUS_INTERNAL_ERROR; FAKE_CUBLASLT_NO_ALGO=1 makes the heuristic
 * find no algorithm (success, zero results), as for a problem the library
 * has no kernel for.  FAKE_CUBLASLT_NOT_SUPPORTED=<entry point> makes one
 * of the calls that document CUBLAS_STATUS_NOT_SUPPORTED answer it, after
 * the argument checks and before any work, as a real GPU does for a
 * layout or type it has no kernel for: cublasLtMatmulAlgoGetHeuristic ("no
 * heuristic function available for current configuration"; counted as a
 * heuristic call), cublasLtMatmul ("current implementation on selected
 * device doesn't support configured operation") or
 * cublasGemmGroupedBatchedEx (a type combination it lacks); the value is
 * ignored by the other entry points.  fake_cublaslt_stats_get reports the
 * calls (not_supported: the NOT_SUPPORTED answers).
 *
 * Under t/fake_cuda.c's guard (FAKE_CUDA_GUARD=1: "device" memory is
 * inaccessible outside driver calls) the computing entry points open the
 * guard through the fake driver's fake_cuda_device_access, found in the
 * library $EPJIT_CUDA_DRIVER names when that one is loaded.
 *
 * Test code: built only for make check, never installed.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
	S_OK = 0,
	S_NOT_INITIALIZED = 1,
	S_ALLOC_FAILED = 3,
	S_INVALID_VALUE = 7,
	S_INTERNAL_ERROR = 14,
	S_NOT_SUPPORTED = 15,
};
enum { R_32F = 0, R_16BF = 14, COMPUTE_32F = 68 };
enum { OP_N = 0, OP_T = 1 };
enum { EPI_DEFAULT = 1, EPI_BIAS = 4 };

#define MAGIC_HANDLE 0x4c54484eu
#define MAGIC_DESC   0x4c544445u
#define MAGIC_LAYOUT 0x4c544c41u
#define MAGIC_PREF   0x4c545052u
#define MAGIC_ALGO   0x4c54414c474fULL
#define MAGIC_BLAS   0x424c4153u

typedef struct {
	uint64_t data[8];
} algo_t;
typedef struct {
	algo_t algo;
	size_t workspace_size;
	int state;
	float waves;
	int reserved[4];
} heur_t;

typedef struct {
	unsigned magic;
} handle_t;
typedef struct {
	unsigned magic;
	int compute, scale, transa, transb, epilogue, bias_type;
	const void *bias;
} desc_t;
typedef struct {
	unsigned magic;
	int type;
	uint64_t rows, cols;
	int64_t ld;
} layout_t;
typedef struct {
	unsigned magic;
	uint64_t max_ws;
	uint32_t align[4];
} pref_t;

/* what the test reads back */
typedef struct fake_lt_stats {
	long long heuristics, matmuls, grouped, grouped_problems;
	long long refused;	 /* calls answered INVALID_VALUE */
	long long not_supported; /* calls answered NOT_SUPPORTED */
	void *last_stream;
	uint64_t last_m, last_n, last_k; /* of the last matmul (column-major) */
	int last_transa, last_transb, last_epilogue;
	size_t last_workspace;
} fake_lt_stats;

static fake_lt_stats S;

void fake_cublaslt_stats_get(fake_lt_stats *out);
void fake_cublaslt_stats_get(fake_lt_stats *out)
{
	*out = S;
}

static bool failing(const char *name)
{
	const char *f = getenv("FAKE_CUBLASLT_FAIL");
	return f && !strcmp(f, name);
}
/* FAKE_CUBLASLT_NOT_SUPPORTED names name (one of the entry points that
 * document NOT_SUPPORTED; see above): true, counted. */
static bool unsupported(const char *name)
{
	const char *f = getenv("FAKE_CUBLASLT_NOT_SUPPORTED");
	if (!f || strcmp(f, name))
		return false;
	S.not_supported++;
	return true;
}
#define ENTER(name)                                                            \
	do {                                                                   \
		if (failing(name))                                             \
			return S_INTERNAL_ERROR;                               \
	} while (0)

/* The fake driver's guard (see above); a no-op without it. */
/* The stand-in driver's count-only mode (FAKE_CUDA_COUNT_ONLY=1, see
 * t/fake_cuda.c): calls are accepted and counted, nothing is computed. */
static bool count_only(void)
{
	const char *v = getenv("FAKE_CUDA_COUNT_ONLY");
	return v && !strcmp(v, "1");
}

static void device_access(int open)
{
	static void (*fn)(int);
	static bool looked;
	if (!looked) {
		looked = true;
		const char *drv = getenv("EPJIT_CUDA_DRIVER");
		void *h = drv ? dlopen(drv, RTLD_NOW | RTLD_NOLOAD) : NULL;
		void *p = h ? dlsym(h, "fake_cuda_device_access") : NULL;
		memcpy(&fn, &p, sizeof p);
	}
	if (fn)
		fn(open);
}

static int refuse(void)
{
	S.refused++;
	return S_INVALID_VALUE;
}

static const char *status_name(int s)
{
	switch (s) {
	case S_OK:
		return "CUBLAS_STATUS_SUCCESS";
	case S_NOT_INITIALIZED:
		return "CUBLAS_STATUS_NOT_INITIALIZED";
	case S_ALLOC_FAILED:
		return "CUBLAS_STATUS_ALLOC_FAILED";
	case S_INVALID_VALUE:
		return "CUBLAS_STATUS_INVALID_VALUE";
	case S_INTERNAL_ERROR:
		return "CUBLAS_STATUS_INTERNAL_ERROR";
	case S_NOT_SUPPORTED:
		return "CUBLAS_STATUS_NOT_SUPPORTED";
	}
	return "CUBLAS_STATUS_UNKNOWN";
}

static const char *status_string(int s)
{
	switch (s) {
	case S_OK:
		return "success";
	case S_NOT_INITIALIZED:
		return "the library was not initialized";
	case S_ALLOC_FAILED:
		return "the resource allocation failed";
	case S_INVALID_VALUE:
		return "an invalid numeric value was used as an argument";
	case S_INTERNAL_ERROR:
		return "an internal operation failed";
	case S_NOT_SUPPORTED:
		return "the functionality requested is not supported";
	}
	return "unknown error";
}

const char *cublasLtGetStatusName(int s);
const char *cublasLtGetStatusName(int s)
{
	return status_name(s);
}
const char *cublasLtGetStatusString(int s);
const char *cublasLtGetStatusString(int s)
{
	return status_string(s);
}
const char *cublasGetStatusName(int s);
const char *cublasGetStatusName(int s)
{
	return status_name(s);
}
const char *cublasGetStatusString(int s);
const char *cublasGetStatusString(int s)
{
	return status_string(s);
}

/* ---- bf16 ---------------------------------------------------------------- */

static float bf16_to_f32(uint16_t b)
{
	uint32_t u = (uint32_t)b << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static uint16_t f32_to_bf16(float f)
{
	uint32_t u;
	memcpy(&u, &f, 4);
	if (isnan(f))
		return (uint16_t)((u >> 16) | 0x40);
	u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
	return (uint16_t)(u >> 16);
}

static float load(const void *p, int type, size_t i)
{
	if (type == R_16BF)
		return bf16_to_f32(((const uint16_t *)p)[i]);
	return ((const float *)p)[i];
}

static void store(void *p, int type, size_t i, float v)
{
	if (type == R_16BF)
		((uint16_t *)p)[i] = f32_to_bf16(v);
	else
		((float *)p)[i] = v;
}

/* ---- handles and descriptors --------------------------------------------- */

int cublasLtCreate(void **h);
int cublasLtCreate(void **h)
{
	ENTER("cublasLtCreate");
	handle_t *x = calloc(1, sizeof *x);
	if (!x)
		return S_ALLOC_FAILED;
	x->magic = MAGIC_HANDLE;
	*h = x;
	return S_OK;
}

int cublasLtDestroy(void *h);
int cublasLtDestroy(void *h)
{
	handle_t *x = h;
	if (!x || x->magic != MAGIC_HANDLE)
		return S_NOT_INITIALIZED;
	x->magic = 0;
	free(x);
	return S_OK;
}

int cublasLtMatmulDescCreate(void **d, int compute, int scale);
int cublasLtMatmulDescCreate(void **d, int compute, int scale)
{
	ENTER("cublasLtMatmulDescCreate");
	desc_t *x = calloc(1, sizeof *x);
	if (!x)
		return S_ALLOC_FAILED;
	*x = (desc_t){ .magic = MAGIC_DESC,
		       .compute = compute,
		       .scale = scale,
		       .transa = OP_N,
		       .transb = OP_N,
		       .epilogue = EPI_DEFAULT,
		       .bias_type = -1 };
	*d = x;
	return S_OK;
}

int cublasLtMatmulDescDestroy(void *d);
int cublasLtMatmulDescDestroy(void *d)
{
	desc_t *x = d;
	if (!x || x->magic != MAGIC_DESC)
		return S_INVALID_VALUE;
	x->magic = 0;
	free(x);
	return S_OK;
}

/* attributes by number (cublasLt.h): TRANSA 3, TRANSB 4, EPILOGUE 7,
 * BIAS_POINTER 8, BIAS_DATA_TYPE 26; sizes as the header gives them */
int cublasLtMatmulDescSetAttribute(void *d, int attr, const void *buf,
				   size_t n);
int cublasLtMatmulDescSetAttribute(void *d, int attr, const void *buf, size_t n)
{
	ENTER("cublasLtMatmulDescSetAttribute");
	desc_t *x = d;
	if (!x || x->magic != MAGIC_DESC || !buf)
		return refuse();
	switch (attr) {
	case 3:
	case 4: {
		int32_t v;
		if (n != sizeof v)
			return refuse();
		memcpy(&v, buf, sizeof v);
		if (v != OP_N && v != OP_T)
			return refuse();
		*(attr == 3 ? &x->transa : &x->transb) = v;
		return S_OK;
	}
	case 7: {
		uint32_t v;
		if (n != sizeof v)
			return refuse();
		memcpy(&v, buf, sizeof v);
		x->epilogue = (int)v;
		return S_OK;
	}
	case 8:
		if (n != sizeof(void *))
			return refuse();
		memcpy(&x->bias, buf, sizeof(void *));
		return S_OK;
	case 26: {
		int32_t v;
		if (n != sizeof v)
			return refuse();
		memcpy(&v, buf, sizeof v);
		x->bias_type = v;
		return S_OK;
	}
	}
	return S_NOT_SUPPORTED; /* attributes epjit does not use */
}

int cublasLtMatrixLayoutCreate(void **l, int type, uint64_t rows, uint64_t cols,
			       int64_t ld);
int cublasLtMatrixLayoutCreate(void **l, int type, uint64_t rows, uint64_t cols,
			       int64_t ld)
{
	ENTER("cublasLtMatrixLayoutCreate");
	layout_t *x = calloc(1, sizeof *x);
	if (!x)
		return S_ALLOC_FAILED;
	*x = (layout_t){ .magic = MAGIC_LAYOUT,
			 .type = type,
			 .rows = rows,
			 .cols = cols,
			 .ld = ld };
	*l = x;
	return S_OK;
}

int cublasLtMatrixLayoutDestroy(void *l);
int cublasLtMatrixLayoutDestroy(void *l)
{
	layout_t *x = l;
	if (!x || x->magic != MAGIC_LAYOUT)
		return S_INVALID_VALUE;
	x->magic = 0;
	free(x);
	return S_OK;
}

int cublasLtMatmulPreferenceCreate(void **p);
int cublasLtMatmulPreferenceCreate(void **p)
{
	ENTER("cublasLtMatmulPreferenceCreate");
	pref_t *x = calloc(1, sizeof *x);
	if (!x)
		return S_ALLOC_FAILED;
	x->magic = MAGIC_PREF;
	for (int i = 0; i < 4; i++)
		x->align[i] = 256; /* the header's default */
	*p = x;
	return S_OK;
}

int cublasLtMatmulPreferenceDestroy(void *p);
int cublasLtMatmulPreferenceDestroy(void *p)
{
	pref_t *x = p;
	if (!x || x->magic != MAGIC_PREF)
		return S_INVALID_VALUE;
	x->magic = 0;
	free(x);
	return S_OK;
}

/* MAX_WORKSPACE_BYTES 1 (uint64_t), MIN_ALIGNMENT_{A,B,C,D}_BYTES 5..8
 * (uint32_t) */
int cublasLtMatmulPreferenceSetAttribute(void *p, int attr, const void *buf,
					 size_t n);
int cublasLtMatmulPreferenceSetAttribute(void *p, int attr, const void *buf,
					 size_t n)
{
	ENTER("cublasLtMatmulPreferenceSetAttribute");
	pref_t *x = p;
	if (!x || x->magic != MAGIC_PREF || !buf)
		return refuse();
	if (attr == 1) {
		if (n != sizeof(uint64_t))
			return refuse();
		memcpy(&x->max_ws, buf, n);
		return S_OK;
	}
	if (attr >= 5 && attr <= 8) {
		if (n != sizeof(uint32_t))
			return refuse();
		memcpy(&x->align[attr - 5], buf, n);
		return S_OK;
	}
	return S_NOT_SUPPORTED;
}

/* ---- the problem ----------------------------------------------------------
 */

typedef struct problem {
	uint64_t m, n, k;
	const desc_t *op;
	const layout_t *a, *b, *c, *d;
} problem;

static bool layout_ok(const layout_t *l)
{
	return l && l->magic == MAGIC_LAYOUT &&
	       (l->type == R_32F || l->type == R_16BF) &&
	       l->ld >= (int64_t)l->rows && l->rows > 0 && l->cols > 0;
}

/* The documented rules: false when the real library refuses. */
static bool problem_of(void *h, void *opd, void *la, void *lb, void *lc,
		       void *ld, problem *p)
{
	const handle_t *hx = h;
	const desc_t *op = opd;
	if (!hx || hx->magic != MAGIC_HANDLE || !op || op->magic != MAGIC_DESC)
		return false;
	const layout_t *a = la, *b = lb, *c = lc, *d = ld;
	if (!layout_ok(a) || !layout_ok(b) || !layout_ok(c) || !layout_ok(d))
		return false;
	if (op->compute != COMPUTE_32F || op->scale != R_32F)
		return false;
	if (a->type != b->type || c->type != d->type)
		return false;
	if (a->type == R_32F && d->type != R_32F)
		return false;
	uint64_t am = op->transa == OP_N ? a->rows : a->cols;
	uint64_t ak = op->transa == OP_N ? a->cols : a->rows;
	uint64_t bk = op->transb == OP_N ? b->rows : b->cols;
	uint64_t bn = op->transb == OP_N ? b->cols : b->rows;
	if (am != d->rows || bn != d->cols || ak != bk)
		return false;
	if (c->rows != d->rows || c->cols != d->cols)
		return false;
	if (op->epilogue != EPI_DEFAULT && op->epilogue != EPI_BIAS)
		return false;
	int bt = op->bias_type < 0 ? d->type : op->bias_type;
	if (op->epilogue == EPI_BIAS && bt != R_32F && bt != R_16BF)
		return false;
	*p = (problem){ .m = d->rows,
			.n = d->cols,
			.k = ak,
			.op = op,
			.a = a,
			.b = b,
			.c = c,
			.d = d };
	return true;
}

static uint64_t mix(uint64_t h, uint64_t v)
{
	h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
	return h;
}

static uint64_t layout_fp(uint64_t h, const layout_t *l)
{
	h = mix(h, (uint64_t)l->type);
	h = mix(h, l->rows);
	h = mix(h, l->cols);
	return mix(h, (uint64_t)l->ld);
}

static uint64_t fingerprint(const problem *p)
{
	uint64_t h = 1469598103934665603ULL;
	h = mix(h, (uint64_t)p->op->transa);
	h = mix(h, (uint64_t)p->op->transb);
	h = mix(h, (uint64_t)p->op->epilogue);
	h = mix(h, (uint64_t)(int64_t)p->op->bias_type);
	h = layout_fp(h, p->a);
	h = layout_fp(h, p->b);
	h = layout_fp(h, p->c);
	return layout_fp(h, p->d);
}

int cublasLtMatmulAlgoGetHeuristic(void *h, void *op, void *la, void *lb,
				   void *lc, void *ld, void *pref, int req,
				   heur_t *res, int *ret);
int cublasLtMatmulAlgoGetHeuristic(void *h, void *op, void *la, void *lb,
				   void *lc, void *ld, void *pref, int req,
				   heur_t *res, int *ret)
{
	ENTER("cublasLtMatmulAlgoGetHeuristic");
	S.heuristics++;
	const pref_t *pr = pref;
	problem p;
	if (req <= 0 || !res || !ret || !pr || pr->magic != MAGIC_PREF ||
	    !problem_of(h, op, la, lb, lc, ld, &p))
		return refuse();
	if (unsupported("cublasLtMatmulAlgoGetHeuristic")) {
		*ret = 0;
		return S_NOT_SUPPORTED;
	}
	const char *na = getenv("FAKE_CUBLASLT_NO_ALGO");
	if (na && !strcmp(na, "1")) {
		*ret = 0;
		return S_OK;
	}
	memset(&res[0], 0, sizeof res[0]);
	res[0].algo.data[0] = MAGIC_ALGO;
	res[0].algo.data[1] = fingerprint(&p);
	for (int i = 0; i < 4; i++)
		res[0].algo.data[2 + i] = pr->align[i];
	size_t need = pr->max_ws >= 65536 && p.k >= 16 ? 65536 : 0;
	res[0].algo.data[6] = need;
	res[0].workspace_size = need;
	res[0].state = S_OK;
	res[0].waves = 1.0f;
	*ret = 1;
	return S_OK;
}

static bool aligned(const void *ptr, uint64_t a)
{
	return a == 0 || (uintptr_t)ptr % a == 0;
}

int cublasLtMatmul(void *h, void *opd, const void *alpha, const void *A,
		   void *la, const void *B, void *lb, const void *beta,
		   const void *C, void *lc, void *D, void *ld,
		   const algo_t *algo, void *ws, size_t ws_size, void *stream);
int cublasLtMatmul(void *h, void *opd, const void *alpha, const void *A,
		   void *la, const void *B, void *lb, const void *beta,
		   const void *C, void *lc, void *D, void *ld,
		   const algo_t *algo, void *ws, size_t ws_size, void *stream)
{
	ENTER("cublasLtMatmul");
	problem p;
	if (!alpha || !beta || !A || !B || !C || !D ||
	    !problem_of(h, opd, la, lb, lc, ld, &p))
		return refuse();
	/* in place: C's layout must be D's */
	if (C == D && (p.c->ld != p.d->ld || p.c->type != p.d->type))
		return refuse();
	if (p.op->epilogue == EPI_BIAS && !p.op->bias)
		return refuse();
	/* the algorithm: chosen for this problem, its alignments met, its
	 * workspace given (NULL algo: the library's own pick) */
	if (algo) {
		if (algo->data[0] != MAGIC_ALGO ||
		    algo->data[1] != fingerprint(&p))
			return refuse();
		if (!aligned(A, algo->data[2]) || !aligned(B, algo->data[3]) ||
		    !aligned(C, algo->data[4]) || !aligned(D, algo->data[5]))
			return refuse();
		if (algo->data[6] > ws_size || (algo->data[6] && !ws))
			return refuse();
	}
	if (unsupported("cublasLtMatmul"))
		return S_NOT_SUPPORTED;
	S.matmuls++;
	S.last_stream = stream;
	S.last_m = p.m;
	S.last_n = p.n;
	S.last_k = p.k;
	S.last_transa = p.op->transa;
	S.last_transb = p.op->transb;
	S.last_epilogue = p.op->epilogue;
	S.last_workspace = ws_size;
	float al, be;
	memcpy(&al, alpha, 4);
	memcpy(&be, beta, 4);
	if (count_only())
		return S_OK; /* the driver's memory has no backing */
	device_access(1);
	int ta = p.a->type, td = p.d->type;
	int bt = p.op->bias_type < 0 ? td : p.op->bias_type;
	/* D may alias C: each element is read before it is written */
	for (uint64_t j = 0; j < p.n; j++)
		for (uint64_t i = 0; i < p.m; i++) {
			float acc = 0;
			for (uint64_t q = 0; q < p.k; q++) {
				size_t ia = p.op->transa == OP_N
						? i + q * (size_t)p.a->ld
						: q + i * (size_t)p.a->ld;
				size_t ib = p.op->transb == OP_N
						? q + j * (size_t)p.b->ld
						: j + q * (size_t)p.b->ld;
				acc += load(A, ta, ia) * load(B, ta, ib);
			}
			float v = al * acc;
			if (be != 0)
				v += be * load(C, p.c->type,
					       i + j * (size_t)p.c->ld);
			if (p.op->epilogue == EPI_BIAS)
				v += load(p.op->bias, bt, i);
			store(D, td, i + j * (size_t)p.d->ld, v);
		}
	device_access(0);
	return S_OK;
}

/* ---- libcublas: the grouped batched GEMM ----------------------------------
 */

typedef struct {
	unsigned magic;
	void *stream;
	void *ws;
	size_t ws_size;
} blas_t;

int cublasCreate_v2(void **h);
int cublasCreate_v2(void **h)
{
	ENTER("cublasCreate_v2");
	blas_t *x = calloc(1, sizeof *x);
	if (!x)
		return S_ALLOC_FAILED;
	x->magic = MAGIC_BLAS;
	*h = x;
	return S_OK;
}

int cublasDestroy_v2(void *h);
int cublasDestroy_v2(void *h)
{
	blas_t *x = h;
	if (!x || x->magic != MAGIC_BLAS)
		return S_NOT_INITIALIZED;
	x->magic = 0;
	free(x);
	return S_OK;
}

int cublasSetStream_v2(void *h, void *stream);
int cublasSetStream_v2(void *h, void *stream)
{
	ENTER("cublasSetStream_v2");
	blas_t *x = h;
	if (!x || x->magic != MAGIC_BLAS)
		return S_NOT_INITIALIZED;
	x->stream = stream;
	return S_OK;
}

int cublasSetWorkspace_v2(void *h, void *ws, size_t n);
int cublasSetWorkspace_v2(void *h, void *ws, size_t n)
{
	ENTER("cublasSetWorkspace_v2");
	blas_t *x = h;
	if (!x || x->magic != MAGIC_BLAS)
		return S_NOT_INITIALIZED;
	x->ws = ws;
	x->ws_size = n;
	return S_OK;
}

/* For problem j of group i (problems numbered consecutively over the
 * groups): C_j = alpha_i op(A_j) op(B_j) + beta_i C_j, column-major, A_j
 * m x k after op, B_j k x n, C_j m x n; the pointer arrays are in device
 * memory; alpha and beta are host arrays of floats (compute 32F). */
int cublasGemmGroupedBatchedEx(void *h, const int *transa, const int *transb,
			       const int *m, const int *n, const int *k,
			       const void *alpha, const void *const *A,
			       int atype, const int *lda, const void *const *B,
			       int btype, const int *ldb, const void *beta,
			       void *const *C, int ctype, const int *ldc,
			       int groups, const int *group_size, int compute);
int cublasGemmGroupedBatchedEx(void *h, const int *transa, const int *transb,
			       const int *m, const int *n, const int *k,
			       const void *alpha, const void *const *A,
			       int atype, const int *lda, const void *const *B,
			       int btype, const int *ldb, const void *beta,
			       void *const *C, int ctype, const int *ldc,
			       int groups, const int *group_size, int compute)
{
	ENTER("cublasGemmGroupedBatchedEx");
	blas_t *x = h;
	if (!x || x->magic != MAGIC_BLAS)
		return S_NOT_INITIALIZED;
	if (groups < 0 || compute != COMPUTE_32F || atype != btype ||
	    atype != ctype || (atype != R_32F && atype != R_16BF))
		return refuse();
	for (int g = 0; g < groups; g++) {
		if (m[g] < 0 || n[g] < 0 || k[g] < 0 || group_size[g] < 0 ||
		    (transa[g] != OP_N && transa[g] != OP_T) ||
		    (transb[g] != OP_N && transb[g] != OP_T))
			return refuse();
		int ar = transa[g] == OP_N ? m[g] : k[g];
		int br = transb[g] == OP_N ? k[g] : n[g];
		if (lda[g] < (ar > 1 ? ar : 1) || ldb[g] < (br > 1 ? br : 1) ||
		    ldc[g] < (m[g] > 1 ? m[g] : 1))
			return refuse();
	}
	if (unsupported("cublasGemmGroupedBatchedEx"))
		return S_NOT_SUPPORTED;
	S.grouped++;
	S.last_stream = x->stream;
	const float *al = alpha, *be = beta;
	int t = atype;
	int j = 0;
	if (count_only())
		return S_OK;
	device_access(1);
	for (int g = 0; g < groups; g++)
		for (int s = 0; s < group_size[g]; s++, j++) {
			S.grouped_problems++;
			for (int cj = 0; cj < n[g]; cj++)
				for (int i = 0; i < m[g]; i++) {
					float acc = 0;
					for (int q = 0; q < k[g]; q++) {
						size_t ia =
						    transa[g] == OP_N
							? (size_t)i +
							      (size_t)q * lda[g]
							: (size_t)q +
							      (size_t)i *
								  lda[g];
						size_t ib =
						    transb[g] == OP_N
							? (size_t)q +
							      (size_t)cj *
								  ldb[g]
							: (size_t)cj +
							      (size_t)q *
								  ldb[g];
						acc += load(A[j], t, ia) *
						       load(B[j], t, ib);
					}
					size_t ic =
					    (size_t)i + (size_t)cj * ldc[g];
					float v = al[g] * acc;
					if (be[g] != 0)
						v += be[g] * load(C[j], t, ic);
					store(C[j], t, ic, v);
				}
		}
	device_access(0);
	return S_OK;
}
