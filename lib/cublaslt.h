/* cublaslt.h -- GEMMs on device pointers through cuBLASLt, and expert
 * (grouped) GEMMs through cuBLAS's grouped batched GEMM, both loaded at run
 * time with dlopen.  The library never links against either and never
 * includes their headers: the few types and constants used are declared in
 * cublaslt.c with the values of the cuBLAS ABI (cublasLt.h, cublas_api.h,
 * library_types.h; CUDA 12/13).
 *
 * Semantics: row-major, as the rest of epjit.  One GEMM is
 *
 *   d[m,n] = alpha * op(a)[m,k] . op(b)[k,n] + beta * c[m,n] + bias[n]
 *
 * with fp32 accumulation (CUBLAS_COMPUTE_32F), a and b in bf16 or f32, c, d
 * and bias in bf16 or f32 (f32 a/b need f32 c/d).  beta = 1 with c the
 * residual is the fused residual add; c may be d itself (in place).
 *
 * Invariants
 *  - The libraries are loaded once per process under a lock; a failed or
 *    refused load is remembered with its message and never retried.
 *    $EPJIT_CUBLASLT (and $EPJIT_CUBLAS for the grouped GEMM) names the
 *    library to load; "0" turns it off.  Without cuBLASLt, ej_cublaslt_new
 *    fails with EPJ_ERR_UNSUPPORTED and ej_cublaslt_available says false:
 *    the caller uses the NVRTC GEMM template (kernels/tmpl_gemm.c) instead.
 *  - Every library call goes through one check macro: a failure reads
 *    "cublaslt: <call> failed at cublaslt.c:<line>: <cublasLtGetStatusName>
 *    (<code>): <cublasLtGetStatusString>" plus the GEMM's shape.
 *  - The algorithm for a shape (dims, strides, transposes, dtypes, epilogue,
 *    beta, pointer alignment) is chosen once with
 *    cublasLtMatmulAlgoGetHeuristic and kept in the handle's table; later
 *    GEMMs of that shape reuse it (counted as cache hits).
 *  - "No algorithm" (the heuristic returns none or answers
 *    CUBLAS_STATUS_NOT_SUPPORTED, or cublasLtMatmul answers NOT_SUPPORTED)
 *    is never a failure: the GEMM is EPJ_ERR_UNSUPPORTED for the caller to
 *    run the template, counted in cublaslt.fallbacks, and the refusal is
 *    kept in the table like an algorithm (that shape is not asked again).
 *  - Work is issued on the cuda device's compute stream; the workspace is
 *    one block from the caller's allocator, held by the handle.
 */
#ifndef EPJIT_CUBLASLT_H
#define EPJIT_CUBLASLT_H

#include "cuda_driver.h"

#include <stdbool.h>
#include <stdint.h>

/* One row-major GEMM on device pointers (see above). */
typedef struct ej_lt_gemm {
	int64_t m, n, k;
	/* a is stored [k,m] when trans_a (op = transpose), else [m,k]; b is
	 * stored [n,k] when trans_b (a linear layer's [out,in] weight), else
	 * [k,n]. */
	bool trans_a, trans_b;
	epj_dtype ab_dtype; /* EPJ_DTYPE_BF16 or EPJ_DTYPE_F32: a and b */
	epj_dtype cd_dtype; /* EPJ_DTYPE_BF16 or EPJ_DTYPE_F32: c, d, bias */
	const void *a, *b;
	const void *c;	  /* read when beta != 0; NULL: d (in place) */
	void *d;	  /* [m,n] */
	const void *bias; /* [n], added to every row; NULL: none */
	/* row strides in elements (0: dense, the stored row width) */
	int64_t lda, ldb, ldc, ldd;
	float alpha, beta;
} ej_lt_gemm;

typedef struct ej_cublaslt ej_cublaslt;

/* True when cuBLASLt can be loaded (the first call tries); false means
 * GEMMs go to the NVRTC template.  ctx (may be NULL) gets the reason. */
bool ej_cublaslt_available(epj_ctx *ctx);
/* The files loaded (lib/cuda_libs.h: the loader's path, $CUDA_HOME, the
 * Python environments' nvidia/ * /lib): cuBLASLt, and cuBLAS for the grouped
 * GEMM ("" when none was loaded).  Valid once ej_cublaslt_available said
 * true. */
const char *ej_cublaslt_path(void);
const char *ej_cublas_path(void);

/* A handle on the process's cuda device c, with a workspace of
 * $EPJIT_CUBLASLT_WORKSPACE_MB MiB (default 32) taken from ws (borrowed;
 * it must outlive the handle).  Errors: EPJ_ERR_UNSUPPORTED "no cuBLASLt
 * (<lib> not found: <dlerror>)" or "cuBLASLt disabled (EPJIT_CUBLASLT=0)";
 * EPJ_ERR_NOMEM for the workspace; EPJ_ERR_BACKEND for a failing call. */
epj_status ej_cublaslt_new(epj_ctx *ctx, ej_cuda_dev *c, ej_allocator *ws,
			   ej_cublaslt **out);
void ej_cublaslt_free(ej_cublaslt *lt);

/* d = alpha op(a) op(b) + beta c + bias on the compute stream (not waited
 * for).  Bad shapes, strides or dtypes are refused before any library call
 * (EPJ_ERR_SHAPE / EPJ_ERR_DTYPE / EPJ_ERR_INVALID, naming the field); m or
 * n of 0 does nothing.  A problem cuBLASLt has no algorithm for (see above)
 * is EPJ_ERR_UNSUPPORTED, with nothing issued (the caller runs the
 * template instead); any other failing library call is EPJ_ERR_BACKEND. */
epj_status ej_cublaslt_gemm(epj_ctx *ctx, ej_cublaslt *lt, const ej_lt_gemm *g);

/* n GEMMs (one per expert; each its own shape and pointers), issued as one
 * cublasGemmGroupedBatchedEx when libcublas has it and the GEMMs allow it
 * (no bias, c == d, a/b/c/d of one dtype, all with the same dtypes), else
 * one ej_cublaslt_gemm each.  When the grouped call answers
 * CUBLAS_STATUS_NOT_SUPPORTED, that call and every later one of its dtype
 * run the loop instead.  GEMMs with m or n of 0 are skipped. */
epj_status ej_cublaslt_gemm_grouped(epj_ctx *ctx, ej_cublaslt *lt, int n,
				    const ej_lt_gemm *g);

typedef struct ej_cublaslt_stats {
	int64_t gemms;		 /* cublasLtMatmul calls */
	int64_t heuristic_calls; /* cublasLtMatmulAlgoGetHeuristic calls */
	int64_t cache_hits;	 /* GEMMs that reused a cached algorithm */
	int64_t cache_entries;	 /* shapes in the table (refused ones too) */
	int64_t fallbacks;	 /* GEMMs with no algorithm */
	int64_t grouped_native;	 /* cublasGemmGroupedBatchedEx calls */
	int64_t grouped_looped;	 /* grouped calls run as a loop */
	size_t workspace_bytes;
	bool grouped_available; /* libcublas with the grouped GEMM loaded */
} ej_cublaslt_stats;
void ej_cublaslt_stats_get(const ej_cublaslt *lt, ej_cublaslt_stats *out);

#endif /* EPJIT_CUBLASLT_H */
