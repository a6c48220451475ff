/* args.h -- the argument structs of the CUDA C templates, declared once.
 *
 * Every template kernel takes one of these by value.  The host side
 * (kernels/tmpl_*.c, kernels/eager_cuda.c) includes this header and fills the
 * struct; kernels/tmpl.c pastes the same text in front of every template
 * before NVRTC or the host C++ compiler (cuda-sim) sees it, so both sides
 * lay out one declaration.  Plain C that is also C++: pointers, long long,
 * int, double; no references, no templates.
 */
#ifndef EJ_TEMPLATE_ARGS_H
#define EJ_TEMPLATE_ARGS_H

/* the most dims of the copy and index templates, the most inputs of cat */
#define EJ_COPY_DIMS  8
#define EJ_CAT_MAX    16
#define EJ_INDEX_DIMS 8

/* ---- templates/fill.cuh ---- */
struct ej_fill_args {
	void *out;
	long long n; /* elements */
	unsigned long long bits;
	int elem; /* bytes per element */
};

/* ---- templates/gemm.cuh ---- */
struct ej_gemm_args {
	const void *a, *b;
	void *c;
	const void *bias, *res;
	const long long *goff; /* grouped: groups + 1 row offsets, or NULL */
	long long m, n, k;     /* m: rows of a batch (grouped: unused) */
	long long a_rs, a_cs, b_rs, b_cs, ldc, ldr, bias_cs;
	long long sa0, sa1, sb0, sb1, sc0, sc1, sr0, sr1, sbias;
	int nb1;    /* inner batch count (gridDim.z = nb0 * nb1) */
	int groups; /* grouped: number of groups */
	int a_vec, b_vec;
	int c_bf16, bias_bf16, res_bf16; /* bf16 kernel: else f32 */
	int act;
};

/* ---- templates/attention.cuh ---- */
/* One argument struct for the three kernels.  Strides are in elements;
 * unused members are NULL / 0. */
struct ej_attn_args {
	const void *q, *k, *v;		/* inputs, dtype EJ_ATTN_DT */
	const void *o, *go;		/* backward: out and grad_out */
	const void *lse_in;		/* backward: lse (compute type) */
	void *out, *lse;		/* forward outputs (contiguous) */
	void *grad_q, *grad_k, *grad_v; /* backward outputs (contiguous) */
	void *di; /* [B, Hq, T]: Di, written by dq, read by dkdv */
	long long qs[4], ks[4], vs[4], os[4], gs[4];
	long long ls[3]; /* lse_in strides */
	const void *seg; /* [B, S] document ids (NULL: none), strides sgs */
	long long sgs[2];
	int seg8; /* seg is i64 (1) or i32 (0) */
	int b, hq, hkv, t, s, d, dv;
	int causal;
	int bk; /* key tile of fwd and dq, 1..32 */
	int bq; /* query tile of dkdv, >= 1 */
	double scale;
	/* tensor-core backward: ej_attn_bwd_dkdv_tc's pass (0 dv, 1 dk) and,
	 * with Hq > Hkv, its f32 partials per query head ([B, Hq, S, D] dk,
	 * then [B, Hq, S, Dv] dv; NULL: written to grad_k/grad_v) */
	int part;
	void *kv_part;
	/* key j is hidden from query i when j > i + coff under the causal
	 * mask (S - T: bottom-right; 0: top-left) */
	int coff;
	/* a mask read through element strides mks (0 on broadcast dims),
	 * NULL: none; mdt 0 f32, 1 bf16, 2 f64 (added to the scaled scores),
	 * 3 i32 (0 hides the key) */
	const void *mask;
	long long mks[4];
	int mdt;
	/* with seg, for ej_attn_bwd_dkdv_tc: per (batch row, block of 64
	 * keys) the queries [spans[0], spans[1]) that hold every query of
	 * the keys' documents (ej_attn_doc_spans; NULL: every query) */
	int *spans;
};

/* ---- templates/moe.cuh ---- */
struct ej_moe_route_args {
	const void *logits;
	long long sl0, sl1; /* element strides of logits [N, E] */
	int ldt;	    /* dtype code of logits */
	int rdt;	    /* dtype code of probs and w: 0 or 2 */
	long long N;
	int E, k, norm;
	int fixed;	/* 1: experts (n k + j) % E instead of the top k */
	void *probs;	/* [N, E] rdt */
	void *w;	/* [N, k] rdt */
	long long *idx; /* [N, k] */
};

struct ej_moe_sort_args {
	const long long *key; /* [n], values in [0, B) */
	long long n;
	int B;
	long long *counts;  /* [B] */
	long long *offsets; /* [B + 1] */
	long long *order;   /* [n] */
	long long *pos;	    /* [n] */
	long long *scratch; /* [G * B]: each block's count of each key */
	long long *base;    /* [G * B]: the counts of the blocks before it */
	long long G;	    /* blocks of EJ_MOE_SORT_T keys each */
};

struct ej_moe_permute_args {
	const void *x; /* [N, H], element strides sx0, sx1 */
	long long sx0, sx1;
	const long long *order; /* [R] */
	int k;
	long long R, H;
	int elem;  /* bytes per element: 2, 4 or 8 */
	void *out; /* [R, H] contiguous */
	int vec;   /* rows of 16-byte vectors: x, out, rows 16-byte aligned */
	int i32;   /* every index fits 32-bit math */
};

struct ej_moe_permute_bw_args {
	const void *dxs;      /* [R, H] contiguous, dtype dt */
	const long long *pos; /* [N * k] */
	long long N;
	int k;
	long long H;
	int dt;
	void *dx; /* [N, H] contiguous, dtype dt */
	int vec;  /* H a multiple of the 16-byte lanes, dxs and dx aligned */
	int i32;  /* every index fits 32-bit math */
};

struct ej_moe_combine_args {
	const void *y;	      /* [R, H] contiguous, dtype dt */
	const void *w;	      /* [N, k] contiguous, dtype wdt (0 or 2) */
	const long long *pos; /* [N * k] */
	const void *dout;     /* [N, H] contiguous, dtype dt (backward) */
	long long N;
	int k;
	long long H;
	int dt, wdt;
	void *out; /* forward: [N, H] dt; bw_y: dy [R, H] dt; bw_w: dw [N, k] */
	int vec;   /* H a multiple of the 16-byte lanes, rows aligned */
	int i32;   /* every index fits 32-bit math */
};

/* SwiGLU forward (y = silu(g) u) and backward (dg, du from d, g, u): n
 * elements of each contiguous buffer, dtype code dt */
struct ej_swiglu_args {
	const void *g, *u;
	const void *d; /* backward: the gradient of y */
	void *y;       /* forward: y; backward: dg */
	void *du;      /* backward: du */
	long long n;
	int dt;
	int vec; /* every buffer 16-byte aligned: 16-byte accesses */
	int i32; /* n and the grid fit 32-bit index math */
};

struct ej_moe_route_bw_args {
	const void *probs;    /* [N, E] rdt (ej_moe_route's) */
	const long long *idx; /* [N, k] */
	const void *dw;	      /* [N, k] rdt: gradient of the routing weights */
	long long N;
	int E, k, norm, rdt;
	void *dlogits; /* [N, E] rdt */
};

/* ---- templates/embedding.cuh ---- */
struct ej_embed_args {
	const void *src;      /* fwd: weight [V, D]; bwd: grad [n, D] */
	long long s0, s1;     /* element strides of src */
	const long long *ids; /* [n] */
	long long n, V, D;
	int elem;  /* fwd: bytes per element (2, 4, 8) */
	int dt;	   /* bwd: dtype code of src and out */
	void *out; /* fwd: [n, D]; bwd: [V, D] contiguous */
};

struct ej_ce_args {
	const void *x; /* logits [N, V], element strides s0, s1 */
	long long s0, s1;
	const long long *tgt; /* [N] */
	long long N, V, ign;
	int dt;		  /* logits' dtype code */
	double *loss_row; /* [N] scratch */
	long long *cnt;	  /* [1] non-ignored rows */
	const void *g;	  /* bwd: upstream scalar, dtype gdt */
	int gdt;
	void *out; /* reduce: loss []; bwd: dlogits [N, V] */
};

/* ---- templates/optim.cuh ---- */
/* The *_in pointers are read, the others written; they are equal for an
 * update in place (cuda), distinct on cuda-sim, whose host API snapshots
 * the inputs so that every written buffer is a checked output.  `first`
 * is the tensor's first block: tensor i owns blocks [first_i, first_{i+1})
 * (ceil(n / chunk) of them; the last tensor up to gridDim.x), and a block
 * finds its tensor by a binary search over the descriptors, so the table
 * is n descriptors whatever the number of blocks, and stays the same from
 * step to step (the host keeps it on the device). */
struct ej_optim_tensor {
	const float *master_in, *s1_in, *s2_in;
	float *master;	  /* [n] */
	const void *grad; /* [n], dtype gdt */
	float *s1;	  /* momentum or exp_avg [n]; SGD: NULL = no momentum */
	float *s2;	  /* exp_avg_sq [n] (Adam) */
	void *model;	  /* [n] model copy (dtype mdt) or NULL */
	long long n;
	long long first; /* the tensor's first block */
};

struct ej_optim_args {
	const struct ej_optim_tensor *t; /* [n_t] */
	int n_t;
	long long chunk;
	int adam; /* 0: SGD, 1: Adam/AdamW */
	int gdt, mdt;
	int nesterov;
	double lr, gs, wd, mom;			   /* SGD */
	double b1, omb1, b2, omb2, eps, l2, decay; /* Adam */
	double step_size, bc2_sqrt;		   /* Adam */
};

struct ej_optim_sumsq_args {
	const struct ej_optim_tensor *t; /* [n_t]; grad, n, first are read */
	int n_t;
	long long chunk;
	int gdt;
	long long n_items; /* blocks of ej_optim_sumsq */
	double *partial;   /* [n_items] */
	double *out;	   /* [1] */
};

/* ---- templates/copy.cuh ---- */
struct ej_copy_args {
	const void *src;
	void *dst;
	long long n;
	long long shape[EJ_COPY_DIMS];
	long long src_st[EJ_COPY_DIMS];
	long long dst_st[EJ_COPY_DIMS];
	int ndim;
	int sdt, ddt;
	int pad;
};

struct ej_cat_args {
	void *dst;
	long long n;
	long long shape[EJ_COPY_DIMS];
	const void *src[EJ_CAT_MAX];
	long long start[EJ_CAT_MAX + 1];
	long long src_st[EJ_CAT_MAX][EJ_COPY_DIMS];
	int ndim, axis, n_in, dt;
};

struct ej_slice_bw_args {
	const void *src;
	void *dst;
	long long n;
	long long shape[EJ_COPY_DIMS];
	long long src_st[EJ_COPY_DIMS];
	long long start, end, step, glen;
	int ndim, axis, dt, pad;
};

struct ej_ipw_args {
	const void *a, *b;
	void *dst;
	long long n;
	long long shape[EJ_COPY_DIMS];
	long long a_st[EJ_COPY_DIMS];
	long long b_st[EJ_COPY_DIMS];
	int ndim, op, dt, pad;
};

/* ---- templates/index.cuh ---- */
struct ej_index_select_args {
	const void *a;
	const void *idx;
	void *dst;
	long long n;
	long long shape[EJ_INDEX_DIMS];
	long long a_st[EJ_INDEX_DIMS];
	long long idx_st, limit;
	int ndim, axis, es, idx64;
};

struct ej_gather_args {
	const void *a;
	const void *idx;
	void *dst;
	long long n;
	long long shape[EJ_INDEX_DIMS];
	long long a_st[EJ_INDEX_DIMS];
	long long idx_st[EJ_INDEX_DIMS];
	long long limit;
	int ndim, axis, es, idx64;
};

struct ej_index_add_args {
	const void *a;
	const void *idx;
	const void *src;
	void *dst;
	long long n;
	long long shape[EJ_INDEX_DIMS];
	long long a_st[EJ_INDEX_DIMS];
	long long src_st[EJ_INDEX_DIMS];
	long long idx_st, nidx;
	int ndim, axis, dt, idx64;
};

struct ej_scatter_add_args {
	const void *a;
	const void *idx;
	const void *src;
	void *dst;
	long long n;
	long long shape[EJ_INDEX_DIMS];
	long long ishape[EJ_INDEX_DIMS];
	long long a_st[EJ_INDEX_DIMS];
	long long idx_st[EJ_INDEX_DIMS];
	long long src_st[EJ_INDEX_DIMS];
	int ndim, axis, dt, idx64;
};

struct ej_max_args {
	const void *x;
	void *vals;
	long long *inds;
	long long n;
	long long shape[EJ_INDEX_DIMS];
	long long x_st[EJ_INDEX_DIMS];
	long long len, ax_st;
	int ndim, dt;
};

struct ej_topk_args {
	const void *x;
	void *vals;
	long long *inds;
	long long rows;
	long long shape[EJ_INDEX_DIMS];
	long long x_st[EJ_INDEX_DIMS];
	long long len, ax_st, k;
	int ndim, dt;
};

struct ej_argsort_args {
	const void *x;
	long long *out;
	long long rows;
	long long shape[EJ_INDEX_DIMS];
	long long x_st[EJ_INDEX_DIMS];
	long long out_st[EJ_INDEX_DIMS];
	long long len, ax_st, out_ax;
	int ndim, dt;
};

/* ---- templates/delta.cuh ---- */
struct ej_delta_args {
	const void *q, *k, *v, *g, *beta, *go; /* go: bwd only */
	long long B, T, H, Dk, Dv;
	int dt;
	void *o;		    /* fwd: o; bwd: dq */
	void *dk, *dv, *dg, *dbeta; /* bwd */
	void *ws;		    /* bwd: the kept states */
	void *chunk;		    /* bwd: a chunk's recomputed states */
	const void *dsin;	    /* bwd: dS after the segment */
	void *dsout;		    /* bwd: dS before the segment */
	void *part;		    /* bwd: the column tiles' partial sums */
	long long t0, t1;	    /* bwd: the segment [t0, t1) */
};

/* ---- templates/trsm.cuh ---- */
struct ej_trsm_args {
	const void *a, *b; /* a [nb, n, n], b [nb, n, k], dense, dtype dt */
	void *x;	   /* [nb, n, k] in the compute type (f32; f64) */
	void *out;	   /* [nb, n, k] in dt; may be x */
	const void *xs;	   /* ej_trsm_da: the solution [nb, n, k], dt */
	void *da;	   /* ej_trsm_da: [nb, n, n], dt */
	long long nb, n, k;
	int dt, upper, unit, trans;
};

#endif
