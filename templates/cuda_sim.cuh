/* cuda_sim.cuh -- the CUDA built-ins for running CUDA C on the CPU (the
 * cuda-sim device).  The build embeds this file as a C string
 * (templates/cuda_sim_text.h); jit/backend_sim.c pastes it in front of the
 * exact translation unit the cuda device hands NVRTC (prelude + kernels),
 * appends one launch entry per kernel, and compiles the whole with the host
 * C++ compiler ($EPJIT_CXX) into a shared object.
 *
 * Execution model.  The blocks of a grid run one after another on the
 * calling OS thread.  The threads of a block are cooperative fibers (one
 * 64 KiB stack per thread, allocated once per launch; switched by a
 * six-register stack switch on x86-64, by ucontext elsewhere and under
 * ASan, which understands swapcontext): a
 * thread runs until it reaches __syncthreads, a warp collective (shuffle,
 * vote, __syncwarp) or its end, then the next thread runs.  Warps are
 * threads 32w..32w+31 of the linear thread index, as on the GPU.
 *
 * What it reports (the launch fails with a message naming the kernel, the
 * block and the thread, instead of hanging or passing):
 *  - a __syncthreads that not every live thread of the block reaches: a
 *    thread exited while others wait, or threads wait at different
 *    __syncthreads (source lines differ), or some wait at a barrier while
 *    others wait in a warp collective;
 *  - a warp collective whose mask names a lane that does not exist, has
 *    exited, never arrives, or arrives with a different mask or operation;
 *    a mask without the calling lane; a shuffle reading a lane outside the
 *    mask; a width that is not a power of two <= 32;
 *  - the tensor-core helpers of the prelude (ej_mma_bf16_16816,
 *    ej_ldmatrix_x4[_trans]) are warp collectives with the PTX fragment
 *    layouts: a lane missing from one is reported as for a shuffle, and so
 *    is an ldmatrix row address that is not aligned shared memory;
 *    cp.async copies (ej_cp_async16) land in shared memory only at the
 *    cp.async_wait that completes their group, and a thread ending with
 *    copies not waited for is reported;
 *  - with EJ_SIM_RACECHECK: the grid runs twice, blocks and threads in
 *    forward and then in reverse order, from the same output contents;
 *    outputs must match bit for bit, and so must each block's shared
 *    memory at its end (a race between two barriers shows as a
 *    difference);
 *  - with EJ_SIM_POISON: outputs are filled with a NaN pattern before the
 *    launch and every element must have been overwritten;
 *  - built with -fsanitize=address, out-of-bounds accesses to global
 *    buffers (host allocations) and to dynamic shared memory beyond the
 *    launch's size (poisoned by hand) are reported by ASan.
 * Shared memory is filled with 0xff bytes (NaN as float or double) at the
 * start of every block.
 *
 * Memory model: one OS thread, so plain loads and stores are sequentially
 * consistent and atomics are plain read-modify-writes.  Static __shared__
 * variables live in the section "ej_shared" (so the simulator can fill,
 * hash and compare them).  Dynamic shared memory is reached through the
 * CUDA prelude's helper ej_dyn_smem() (on the GPU an `extern __shared__`
 * array; here the array ej_dsmem, at most EJ_SIM_DSMEM_MAX bytes): a raw
 * `extern __shared__` declaration does not compile here.  EJ_CUDA_SIM is
 * defined for the prelude to tell the two apart.
 */
/* The C library's <math.h>, not libstdc++'s wrapper: that one is <cmath>,
 * whose templates and special functions cost 0.3 s of every module's
 * compile (half of it).  The float overloads <cmath> gives (and CUDA gives
 * device code) follow, so that exp(float) is expf, as on the GPU; a call
 * that mixes float and double arguments does not compile (ambiguous)
 * instead of picking a precision silently.  abs(float) comes from
 * <stdlib.h> (libstdc++'s std::abs overloads). */
#define _GLIBCXX_INCLUDE_NEXT_C_HEADERS
#include <math.h>
#undef _GLIBCXX_INCLUDE_NEXT_C_HEADERS
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#define EJ_SIM_F1(N)                                                           \
	static inline float N(float x)                                         \
	{                                                                      \
		return N##f(x);                                                \
	}
#define EJ_SIM_F2(N)                                                           \
	static inline float N(float x, float y)                                \
	{                                                                      \
		return N##f(x, y);                                             \
	}
EJ_SIM_F1(acos)
EJ_SIM_F1(asin)
EJ_SIM_F1(atan)
EJ_SIM_F1(cbrt)
EJ_SIM_F1(ceil)
EJ_SIM_F1(cos)
EJ_SIM_F1(cosh)
EJ_SIM_F1(erf)
EJ_SIM_F1(erfc)
EJ_SIM_F1(exp)
EJ_SIM_F1(exp2)
EJ_SIM_F1(expm1)
EJ_SIM_F1(fabs)
EJ_SIM_F1(floor)
EJ_SIM_F1(lgamma)
EJ_SIM_F1(log)
EJ_SIM_F1(log10)
EJ_SIM_F1(log1p)
EJ_SIM_F1(log2)
EJ_SIM_F1(nearbyint)
EJ_SIM_F1(rint)
EJ_SIM_F1(round)
EJ_SIM_F1(sin)
EJ_SIM_F1(sinh)
EJ_SIM_F1(sqrt)
EJ_SIM_F1(tan)
EJ_SIM_F1(tanh)
EJ_SIM_F1(tgamma)
EJ_SIM_F1(trunc)
EJ_SIM_F2(atan2)
EJ_SIM_F2(copysign)
EJ_SIM_F2(fdim)
EJ_SIM_F2(fmax)
EJ_SIM_F2(fmin)
EJ_SIM_F2(fmod)
EJ_SIM_F2(hypot)
EJ_SIM_F2(nextafter)
EJ_SIM_F2(pow)
EJ_SIM_F2(remainder)
static inline float fma(float x, float y, float z)
{
	return fmaf(x, y, z);
}
static inline float ldexp(float x, int e)
{
	return ldexpf(x, e);
}
static inline float frexp(float x, int *e)
{
	return frexpf(x, e);
}
#undef EJ_SIM_F1
#undef EJ_SIM_F2

#if defined(__SANITIZE_ADDRESS__)
#define EJ_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EJ_SIM_ASAN 1
#endif
#endif
#ifdef EJ_SIM_ASAN
extern "C" void __asan_poison_memory_region(void const volatile *, size_t);
extern "C" void __asan_unpoison_memory_region(void const volatile *, size_t);
#endif

/* ---- the launch ABI (mirrored by lib/device_sim.c) ----------------------- */

#define EJ_CUDA_SIM	 1
#define EJ_SIM_ABI	 3
#define EJ_SIM_RACECHECK 1
#define EJ_SIM_POISON	 2
#define EJ_SIM_DSMEM_MAX (227u * 1024u)
#define EJ_SIM_STACK	 (64u * 1024u)

struct ej_sim_out {
	void *ptr;
	unsigned long long bytes;
	unsigned long long elem; /* element size: 2, 4 or 8 (poison) */
};
struct ej_sim_launch {
	unsigned abi;
	unsigned grid[3], block[3];
	unsigned long long smem;
	const void *args;
	const struct ej_sim_out *outs;
	int n_out;
	int flags;
	char msg[1024]; /* the report when the entry returns non-zero */
};

/* ---- language ------------------------------------------------------------ */

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__	__attribute__((noinline))
#define __restrict__	__restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__   static __attribute__((section("ej_shared")))
#define __constant__ static
#define warpSize     32

struct uint3 {
	unsigned x, y, z;
};
typedef uint3 dim3;

#define EJ_SIM_VEC2(T, N, A)                                                   \
	struct __attribute__((aligned(A))) N {                                 \
		T x, y;                                                        \
	};                                                                     \
	static inline N make_##N(T x, T y)                                     \
	{                                                                      \
		N r = { x, y };                                                \
		return r;                                                      \
	}
#define EJ_SIM_VEC4(T, N, A)                                                   \
	struct __attribute__((aligned(A))) N {                                 \
		T x, y, z, w;                                                  \
	};                                                                     \
	static inline N make_##N(T x, T y, T z, T w)                           \
	{                                                                      \
		N r = { x, y, z, w };                                          \
		return r;                                                      \
	}
EJ_SIM_VEC2(float, float2, 8)
EJ_SIM_VEC4(float, float4, 16)
EJ_SIM_VEC2(double, double2, 16)
EJ_SIM_VEC2(unsigned, uint2, 8)
EJ_SIM_VEC4(unsigned, uint4, 16)
EJ_SIM_VEC2(int, int2, 8)
EJ_SIM_VEC4(int, int4, 16)

/* ---- bit casts and math ---------------------------------------------------
 */

template <class D, class S> static inline D ej_sim_bits(S s)
{
	D d;
	memcpy(&d, &s, sizeof d);
	return d;
}
static inline float __int_as_float(int x)
{
	return ej_sim_bits<float>(x);
}
static inline float __uint_as_float(unsigned x)
{
	return ej_sim_bits<float>(x);
}
static inline int __float_as_int(float x)
{
	return ej_sim_bits<int>(x);
}
static inline unsigned __float_as_uint(float x)
{
	return ej_sim_bits<unsigned>(x);
}
static inline double __longlong_as_double(long long x)
{
	return ej_sim_bits<double>(x);
}
static inline long long __double_as_longlong(double x)
{
	return ej_sim_bits<long long>(x);
}
static inline float rsqrtf(float x)
{
	return 1.0f / sqrtf(x);
}
static inline double rsqrt(double x)
{
	return 1.0 / sqrt(x);
}
/* glibc declares __expf and __logf itself */
#define __expf(x) expf(x)
#define __logf(x) logf(x)
static inline float __fdividef(float a, float b)
{
	return a / b;
}
static inline float __frcp_rn(float x)
{
	return 1.0f / x;
}
static inline float __fmaf_rn(float a, float b, float c)
{
	return fmaf(a, b, c);
}
static inline float __saturatef(float x)
{
	return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x;
}
#define EJ_SIM_MINMAX(T)                                                       \
	static inline T min(T a, T b)                                          \
	{                                                                      \
		return a < b ? a : b;                                          \
	}                                                                      \
	static inline T max(T a, T b)                                          \
	{                                                                      \
		return a > b ? a : b;                                          \
	}
EJ_SIM_MINMAX(int)
EJ_SIM_MINMAX(unsigned)
EJ_SIM_MINMAX(long long)
EJ_SIM_MINMAX(unsigned long long)
static inline float min(float a, float b)
{
	return fminf(a, b);
}
static inline float max(float a, float b)
{
	return fmaxf(a, b);
}
static inline double min(double a, double b)
{
	return fmin(a, b);
}
static inline double max(double a, double b)
{
	return fmax(a, b);
}
template <class T> static inline T __ldg(const T *p)
{
	return *p;
}
static inline void __threadfence(void)
{
}
static inline void __threadfence_block(void)
{
}

/* ---- atomics (one OS thread: plain read-modify-write) --------------------- */

template <class T> static inline T atomicAdd(T *p, T v)
{
	T o = *p;
	*p = o + v;
	return o;
}
template <class T> static inline T atomicSub(T *p, T v)
{
	T o = *p;
	*p = o - v;
	return o;
}
template <class T> static inline T atomicExch(T *p, T v)
{
	T o = *p;
	*p = v;
	return o;
}
template <class T> static inline T atomicMax(T *p, T v)
{
	T o = *p;
	*p = o > v ? o : v;
	return o;
}
template <class T> static inline T atomicMin(T *p, T v)
{
	T o = *p;
	*p = o < v ? o : v;
	return o;
}
template <class T> static inline T atomicCAS(T *p, T cmp, T v)
{
	T o = *p;
	if (o == cmp)
		*p = v;
	return o;
}
template <class T> static inline T atomicAnd(T *p, T v)
{
	T o = *p;
	*p = o & v;
	return o;
}
template <class T> static inline T atomicOr(T *p, T v)
{
	T o = *p;
	*p = o | v;
	return o;
}
static inline unsigned atomicInc(unsigned *p, unsigned lim)
{
	unsigned o = *p;
	*p = o >= lim ? 0u : o + 1u;
	return o;
}

/* ---- fibers -------------------------------------------------------------- */

#if defined(__x86_64__) && !defined(EJ_SIM_ASAN)
/* ej_sim_switch(&from_sp, to_sp): saves the callee-saved registers on the
 * current stack, stores its stack pointer in *from_sp, continues on to_sp
 * (a stack saved the same way, or made by ej_sim_ctx_make). */
extern "C" __attribute__((visibility("hidden"))) void
ej_sim_switch(void **from_sp, void *to_sp);
__asm__(".text\n"
	".p2align 4\n"
	".globl ej_sim_switch\n"
	".hidden ej_sim_switch\n"
	".type ej_sim_switch, @function\n"
	"ej_sim_switch:\n"
	"\tpushq %rbp\n"
	"\tpushq %rbx\n"
	"\tpushq %r12\n"
	"\tpushq %r13\n"
	"\tpushq %r14\n"
	"\tpushq %r15\n"
	"\tmovq %rsp, (%rdi)\n"
	"\tmovq %rsi, %rsp\n"
	"\tpopq %r15\n"
	"\tpopq %r14\n"
	"\tpopq %r13\n"
	"\tpopq %r12\n"
	"\tpopq %rbx\n"
	"\tpopq %rbp\n"
	"\tret\n"
	".size ej_sim_switch, .-ej_sim_switch\n");
struct ej_sim_ctx {
	void *sp;
};
/* A context that starts fn (which never returns) on stack[0..size). */
static void ej_sim_ctx_make(ej_sim_ctx *c, char *stack, size_t size,
			    void (*fn)(void))
{
	uintptr_t top = ((uintptr_t)stack + size) & ~(uintptr_t)15;
	void **a = (void **)(top - 16); /* the return address slot */
	a[0] = (void *)fn;
	a[1] = NULL;
	void **sp = a - 6; /* r15 r14 r13 r12 rbx rbp */
	for (int i = 0; i < 6; i++)
		sp[i] = NULL;
	c->sp = sp;
}
static inline void ej_sim_ctx_swap(ej_sim_ctx *from, ej_sim_ctx *to)
{
	ej_sim_switch(&from->sp, to->sp);
}
#define ej_sim_fiber_begin(sched) ((void)(sched))
#else
/* ucontext; under ASan every switch is announced to the sanitizer
 * (__sanitizer_start/finish_switch_fiber) so that it, and LeakSanitizer,
 * know which stack is current. */
#ifdef EJ_SIM_ASAN
extern "C" void __sanitizer_start_switch_fiber(void **fake_stack_save,
					       const void *bottom, size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void *fake_stack_save,
						const void **bottom_old,
						size_t *size_old);
#endif
struct ej_sim_ctx {
	ucontext_t uc;
	const void *bottom; /* its stack (the scheduler's: learnt by the */
	size_t size;	    /* first fiber, ej_sim_fiber_begin) */
};
static void ej_sim_ctx_make(ej_sim_ctx *c, char *stack, size_t size,
			    void (*fn)(void))
{
	getcontext(&c->uc);
	c->uc.uc_stack.ss_sp = stack;
	c->uc.uc_stack.ss_size = size;
	c->uc.uc_link = NULL;
	c->bottom = stack;
	c->size = size;
	makecontext(&c->uc, fn, 0);
}
static inline void ej_sim_ctx_swap(ej_sim_ctx *from, ej_sim_ctx *to)
{
#ifdef EJ_SIM_ASAN
	void *fake = NULL;
	__sanitizer_start_switch_fiber(&fake, to->bottom, to->size);
	swapcontext(&from->uc, &to->uc);
	__sanitizer_finish_switch_fiber(fake, NULL, NULL);
#else
	swapcontext(&from->uc, &to->uc);
#endif
}
/* First thing on a new fiber: the stack it came from is the scheduler's. */
static inline void ej_sim_fiber_begin(ej_sim_ctx *sched)
{
#ifdef EJ_SIM_ASAN
	__sanitizer_finish_switch_fiber(NULL, &sched->bottom, &sched->size);
#else
	(void)sched;
#endif
}
#endif

enum { EJ_ST_NEW, EJ_ST_RUN, EJ_ST_BAR, EJ_ST_WARP, EJ_ST_DONE };
enum {
	EJ_W_SYNC,
	EJ_W_IDX,
	EJ_W_UP,
	EJ_W_DOWN,
	EJ_W_XOR,
	EJ_W_BALLOT,
	EJ_W_ANY,
	EJ_W_ALL,
	EJ_W_MMA,
	EJ_W_LDM,
	EJ_W_LDMT
};
static const char *const ej_sim_wname[] = {
	"__syncwarp",	    "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
	"__shfl_xor_sync", "__ballot_sync", "__any_sync",     "__all_sync",
	"mma.sync.m16n8k16 (ej_mma_bf16_16816)",
	"ldmatrix.x4 (ej_ldmatrix_x4)",
	"ldmatrix.x4.trans (ej_ldmatrix_x4_trans)"
};

/* One cp.async copy issued and not yet waited for: its 16 bytes as read at
 * issue (zero-filled past src_bytes), applied to shared memory by the
 * cp.async.wait_group that completes its group. */
#define EJ_SIM_CP_MAX 32
struct ej_sim_cp {
	void *dst;
	int grp; /* commit group, -1 while uncommitted */
	unsigned char data[16];
};

struct ej_sim_thr {
	ej_sim_ctx ctx;
	char *stack; /* EJ_SIM_STACK bytes */
	uint3 tid;
	unsigned lin;
	int state;
	int line;	       /* source line of the barrier / collective */
	int wop;	       /* warp operation waited in */
	unsigned wmask;	       /* its mask */
	int warg, wwidth;      /* lane / delta / lane mask; width */
	unsigned long long wv; /* value bits (shuffles), predicate (votes) */
	unsigned long long wr; /* result */
	int ncp, cpg;	       /* pending cp.async copies; groups committed */
	ej_sim_cp cp[EJ_SIM_CP_MAX];
};

struct ej_sim_blk {
	ej_sim_ctx sched;
	ej_sim_thr *t;
	unsigned n;
	uint3 bidx, bdim, gdim;
	const char *kernel;
	char *msg;
	int failed;
	void (*body)(const void *);
	const void *args;
};

/* The running fiber and block.  Plain statics, not thread_local: dynamic
 * TLS in dlopen()ed objects costs a __tls_get_addr per threadIdx and
 * confuses LeakSanitizer once modules are unloaded.  So one module runs
 * one launch at a time (each loaded copy has its own). */
static ej_sim_thr *ej_sim_cur;
static ej_sim_blk *ej_sim_b;

#define threadIdx (ej_sim_cur->tid)
#define blockIdx  (ej_sim_b->bidx)
#define blockDim  (ej_sim_b->bdim)
#define gridDim	  (ej_sim_b->gdim)

__attribute__((aligned(16))) static unsigned char ej_dsmem[EJ_SIM_DSMEM_MAX];
static inline unsigned char *ej_dyn_smem(void)
{
	return ej_dsmem;
}
extern "C" char __start_ej_shared[] __attribute__((weak));
extern "C" char __stop_ej_shared[] __attribute__((weak));

static void ej_sim_yield(void)
{
	ej_sim_ctx_swap(&ej_sim_cur->ctx, &ej_sim_b->sched);
}

/* Records the first report of the block, as "kernel K, block (..), thread
 * (..): what", and leaves the fiber for good. */
__attribute__((format(printf, 2, 3))) static void
ej_sim_fail(const ej_sim_thr *t, const char *fmt, ...)
{
	ej_sim_blk *b = ej_sim_b;
	if (!b->failed) {
		int n = snprintf(b->msg, 1024,
				 "cuda-sim: kernel %s, block (%u,%u,%u)",
				 b->kernel, b->bidx.x, b->bidx.y, b->bidx.z);
		if (t && n > 0 && n < 1024)
			n += snprintf(b->msg + n, (size_t)(1024 - n),
				      ", thread (%u,%u,%u)", t->tid.x,
				      t->tid.y, t->tid.z);
		if (n > 0 && n < 1020) {
			b->msg[n++] = ':';
			b->msg[n++] = ' ';
			va_list ap;
			va_start(ap, fmt);
			vsnprintf(b->msg + n, (size_t)(1024 - n), fmt, ap);
			va_end(ap);
		}
		b->failed = 1;
	}
	for (;;) /* never resumed */
		ej_sim_yield();
}

static void ej_sim_barrier(int line)
{
	ej_sim_cur->state = EJ_ST_BAR;
	ej_sim_cur->line = line;
	ej_sim_yield();
}
#define __syncthreads() ej_sim_barrier(__LINE__)

static ej_sim_thr *ej_sim_lane(unsigned warp, unsigned l)
{
	unsigned i = warp * 32u + l;
	return i < ej_sim_b->n ? &ej_sim_b->t[i] : NULL;
}

/* Source lane of lane l in a collective of t's kind, or -1: its own. */
static int ej_sim_src(const ej_sim_thr *t, unsigned l)
{
	unsigned w = (unsigned)t->wwidth, base = l & ~(w - 1u);
	unsigned a = (unsigned)t->warg;
	switch (t->wop) {
	case EJ_W_IDX:
		return (int)(base + (a & (w - 1u)));
	case EJ_W_UP:
		return (l - base) >= a ? (int)(l - a) : -1;
	case EJ_W_DOWN:
		return (l - base) + a < w ? (int)(l + a) : -1;
	case EJ_W_XOR: {
		unsigned s = l ^ (a & 31u);
		return s < base + w ? (int)s : -1;
	}
	}
	return -1;
}

/* ---- the tensor-core helpers of the CUDA prelude --------------------------
 *
 * mma.sync and ldmatrix are warp collectives like the shuffles (every lane
 * of the warp must arrive: a lane that exited or never comes is reported
 * the same way); each lane's wv holds the address of its operands.
 * Fragment layouts are PTX's for m16n8k16 with .bf16 inputs, with
 * groupID g = lane >> 2 and threadID_in_group t = lane % 4:
 *   A (16x16, row): reg r holds A[g + 8 (r & 1)][2t + 8 (r >> 1) + {0,1}]
 *   B (16x8, col):  reg r holds B[2t + 8 r + {0,1}][g]
 *   C, D (16x8 f32): element i is [g + 8 (i >> 1)][2t + (i & 1)]
 * (the lower-numbered element in the low 16 bits).  D = A B + C in fp32:
 * exact bf16 products, one fmaf per k in increasing k. */
struct ej_sim_mma_io {
	const unsigned *a, *b;
	const float *c;
	float *d;
};
struct ej_sim_ldm_io {
	const void *row;
	unsigned *r;
};

static bool ej_sim_in_shared(const void *p, size_t n)
{
	const char *c = (const char *)p;
	const char *d = (const char *)ej_dsmem;
	if (c >= d && c + n <= d + EJ_SIM_DSMEM_MAX)
		return true;
	return __start_ej_shared && c >= __start_ej_shared &&
	       c + n <= __stop_ej_shared;
}

static float ej_sim_bf(unsigned h)
{
	return ej_sim_bits<float>((h & 0xffffu) << 16);
}

static void ej_sim_mma_run(unsigned warp)
{
	float A[16][16], B[16][8], C[16][8];
	for (unsigned l = 0; l < 32; l++) {
		const ej_sim_mma_io *io =
		    (const ej_sim_mma_io *)(uintptr_t)ej_sim_lane(warp, l)->wv;
		unsigned g = l >> 2, t = l & 3u;
		for (unsigned r = 0; r < 4; r++) {
			unsigned row = g + 8u * (r & 1u);
			unsigned col = 2u * t + 8u * (r >> 1);
			A[row][col] = ej_sim_bf(io->a[r]);
			A[row][col + 1] = ej_sim_bf(io->a[r] >> 16);
		}
		for (unsigned r = 0; r < 2; r++) {
			unsigned k = 2u * t + 8u * r;
			B[k][g] = ej_sim_bf(io->b[r]);
			B[k + 1][g] = ej_sim_bf(io->b[r] >> 16);
		}
		for (unsigned i = 0; i < 4; i++)
			C[g + 8u * (i >> 1)][2u * t + (i & 1u)] = io->c[i];
	}
	/* every operand is read before any D is written: d may alias c */
	for (unsigned l = 0; l < 32; l++) {
		const ej_sim_mma_io *io =
		    (const ej_sim_mma_io *)(uintptr_t)ej_sim_lane(warp, l)->wv;
		unsigned g = l >> 2, t = l & 3u;
		for (unsigned i = 0; i < 4; i++) {
			unsigned row = g + 8u * (i >> 1), col = 2u * t + (i & 1u);
			float acc = C[row][col];
			for (unsigned k = 0; k < 16; k++)
				acc = fmaf(A[row][k], B[k][col], acc);
			io->d[i] = acc;
		}
	}
}

/* ldmatrix .m8n8.x4.b16: lanes 8j..8j+7 give the addresses of rows 0..7 of
 * matrix j (16 bytes each, 16-byte aligned, in shared memory); register j
 * of lane l gets row g, columns 2t and 2t+1 of matrix j (.trans: column g,
 * rows 2t and 2t+1). */
static void ej_sim_ldm_run(unsigned warp, bool trans)
{
	unsigned short M[4][8][8];
	for (unsigned l = 0; l < 32; l++) {
		ej_sim_thr *o = ej_sim_lane(warp, l);
		const ej_sim_ldm_io *io = (const ej_sim_ldm_io *)(uintptr_t)o->wv;
		if (((uintptr_t)io->row & 15u) || !ej_sim_in_shared(io->row, 16))
			ej_sim_fail(o,
				    "%s (line %d): row address %p of lane %u "
				    "is not 16-byte aligned shared memory",
				    ej_sim_wname[o->wop], o->line, io->row, l);
		memcpy(M[l >> 3][l & 7u], io->row, 16);
	}
	for (unsigned l = 0; l < 32; l++) {
		const ej_sim_ldm_io *io =
		    (const ej_sim_ldm_io *)(uintptr_t)ej_sim_lane(warp, l)->wv;
		unsigned g = l >> 2, t = l & 3u;
		for (unsigned j = 0; j < 4; j++) {
			unsigned lo = trans ? M[j][2u * t][g] : M[j][g][2u * t];
			unsigned hi = trans ? M[j][2u * t + 1u][g]
					    : M[j][g][2u * t + 1u];
			io->r[j] = lo | hi << 16;
		}
	}
}

/* Completes the collective of the lanes of `mask` in warp `warp` when all
 * of them wait in it; returns whether it did. */
static bool ej_sim_try_complete(unsigned warp, unsigned mask, int op)
{
	/* the usual miss first: a neighbour of the caller still running */
	unsigned me = ej_sim_cur->lin & 31u;
	for (int d = -1; d <= 1; d += 2) {
		unsigned l = (unsigned)((int)me + d);
		if (l < 32 && (mask >> l & 1u)) {
			const ej_sim_thr *o = ej_sim_lane(warp, l);
			if (o->state == EJ_ST_NEW || o->state == EJ_ST_RUN)
				return false;
		}
	}
	for (unsigned l = 0; l < 32; l++) {
		if (!(mask >> l & 1u))
			continue;
		ej_sim_thr *o = ej_sim_lane(warp, l);
		if (o->state == EJ_ST_DONE)
			ej_sim_fail(ej_sim_cur,
				    "%s with mask 0x%08x names lane %u, which "
				    "has exited",
				    ej_sim_wname[op], mask, l);
		if (o->state != EJ_ST_WARP || o->wmask != mask || o->wop != op)
			return false;
	}
	unsigned long long vote = 0;
	for (unsigned l = 0; l < 32; l++)
		if (mask >> l & 1u)
			vote |= (unsigned long long)(ej_sim_lane(warp, l)->wv !=
						     0)
				<< l;
	if (op == EJ_W_MMA)
		ej_sim_mma_run(warp);
	else if (op == EJ_W_LDM || op == EJ_W_LDMT)
		ej_sim_ldm_run(warp, op == EJ_W_LDMT);
	for (unsigned l = 0; l < 32; l++) {
		if (!(mask >> l & 1u))
			continue;
		ej_sim_thr *o = ej_sim_lane(warp, l);
		switch (op) {
		case EJ_W_SYNC:
		case EJ_W_MMA:
		case EJ_W_LDM:
		case EJ_W_LDMT:
			o->wr = 0;
			break;
		case EJ_W_BALLOT:
			o->wr = vote;
			break;
		case EJ_W_ANY:
			o->wr = vote != 0;
			break;
		case EJ_W_ALL:
			o->wr = vote == mask;
			break;
		default: {
			int s = ej_sim_src(o, l);
			if (s >= 0 && !(mask >> s & 1u)) {
				ej_sim_fail(o,
					    "%s with mask 0x%08x reads lane "
					    "%d, which is not in the mask",
					    ej_sim_wname[op], mask, s);
			}
			o->wr = s < 0 ? o->wv : ej_sim_lane(warp, (unsigned)s)->wv;
		}
		}
		o->state = EJ_ST_RUN;
	}
	return true;
}

static unsigned long long ej_sim_warp(int op, unsigned mask,
				      unsigned long long v, int arg, int width,
				      int line)
{
	ej_sim_thr *t = ej_sim_cur;
	unsigned lane = t->lin & 31u, warp = t->lin >> 5;
	if (!(mask >> lane & 1u))
		ej_sim_fail(t, "%s (line %d): mask 0x%08x does not name the "
			       "calling lane %u",
			    ej_sim_wname[op], line, mask, lane);
	if (width < 1 || width > 32 || (width & (width - 1)))
		ej_sim_fail(t, "%s (line %d): width %d is not a power of two "
			       "from 1 to 32",
			    ej_sim_wname[op], line, width);
	for (unsigned l = 0; l < 32; l++)
		if ((mask >> l & 1u) && !ej_sim_lane(warp, l))
			ej_sim_fail(t, "%s (line %d): mask 0x%08x names lane "
				       "%u, which does not exist (the block "
				       "has %u threads)",
				    ej_sim_wname[op], line, mask, l,
				    ej_sim_b->n);
	t->state = EJ_ST_WARP;
	t->wop = op;
	t->wmask = mask;
	t->wv = v;
	t->warg = arg;
	t->wwidth = width;
	t->line = line;
	if (!ej_sim_try_complete(warp, mask, op))
		ej_sim_yield();
	return t->wr;
}

template <class T> static inline unsigned long long ej_sim_put(T v)
{
	static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
	unsigned long long u = 0;
	memcpy(&u, &v, sizeof v);
	return u;
}
template <class T> static inline T ej_sim_get(unsigned long long u)
{
	T v;
	memcpy(&v, &u, sizeof v);
	return v;
}
template <class T>
static inline T ej_sim_shfl(int op, unsigned m, T v, int a, int w, int line)
{
	return ej_sim_get<T>(ej_sim_warp(op, m, ej_sim_put(v), a, w, line));
}
#define __shfl_sync(m, v, ...)                                                 \
	ej_sim_shfl(EJ_W_IDX, (m), (v), EJ_SIM_ARGW(__VA_ARGS__, 32), __LINE__)
#define __shfl_up_sync(m, v, ...)                                              \
	ej_sim_shfl(EJ_W_UP, (m), (v), EJ_SIM_ARGW(__VA_ARGS__, 32), __LINE__)
#define __shfl_down_sync(m, v, ...)                                            \
	ej_sim_shfl(EJ_W_DOWN, (m), (v), EJ_SIM_ARGW(__VA_ARGS__, 32),         \
		    __LINE__)
#define __shfl_xor_sync(m, v, ...)                                             \
	ej_sim_shfl(EJ_W_XOR, (m), (v), EJ_SIM_ARGW(__VA_ARGS__, 32), __LINE__)
/* (lane/delta [, width]) -> "lane, width" */
#define EJ_SIM_ARGW(a, w, ...) (int)(a), (int)(w)
/* __syncwarp([mask]): the line, then the optional mask */
struct ej_sim_syncwarp {
	int line;
	void operator()(unsigned m = 0xffffffffu) const
	{
		ej_sim_warp(EJ_W_SYNC, m, 0, 0, 32, line);
	}
};
#define __syncwarp(...) (ej_sim_syncwarp{ __LINE__ }(__VA_ARGS__))
#define __ballot_sync(m, p)                                                    \
	((unsigned)ej_sim_warp(EJ_W_BALLOT, (m), (p) != 0, 0, 32, __LINE__))
#define __any_sync(m, p)                                                       \
	((int)ej_sim_warp(EJ_W_ANY, (m), (p) != 0, 0, 32, __LINE__))
#define __all_sync(m, p)                                                       \
	((int)ej_sim_warp(EJ_W_ALL, (m), (p) != 0, 0, 32, __LINE__))
/* The prelude's tensor-core helpers (templates/prelude_cuda.h defines the
 * PTX versions outside EJ_CUDA_SIM): whole-warp collectives. */
static inline void ej_sim_mma(float *d, const unsigned *a, const unsigned *b,
			      const float *c, int line)
{
	ej_sim_mma_io io = { a, b, c, d };
	ej_sim_warp(EJ_W_MMA, 0xffffffffu, (uintptr_t)&io, 0, 32, line);
}
static inline void ej_sim_ldm(unsigned *r, const void *row, bool trans,
			      int line)
{
	ej_sim_ldm_io io = { row, r };
	ej_sim_warp(trans ? EJ_W_LDMT : EJ_W_LDM, 0xffffffffu, (uintptr_t)&io,
		    0, 32, line);
}
#define ej_mma_bf16_16816(d, a, b, c) ej_sim_mma((d), (a), (b), (c), __LINE__)
#define ej_ldmatrix_x4(r, p)	      ej_sim_ldm((r), (p), false, __LINE__)
#define ej_ldmatrix_x4_trans(r, p)    ej_sim_ldm((r), (p), true, __LINE__)

/* cp.async.cg.shared.global of 16 bytes (src_bytes of them read, the rest
 * zero), cp.async.commit_group and cp.async.wait_group n, deferred: the
 * source is read at issue but shared memory changes only when a wait
 * completes the copy's group, so a read of the tile before the wait (or
 * the barrier after it) sees the old contents.  A thread that ends with
 * copies not waited for is reported. */
static void ej_cp_async16(void *dst, const void *src, int src_bytes)
{
	ej_sim_thr *t = ej_sim_cur;
	if (((uintptr_t)dst & 15u) || !ej_sim_in_shared(dst, 16))
		ej_sim_fail(t, "cp.async: destination %p is not 16-byte "
			       "aligned shared memory",
			    dst);
	if (src_bytes < 0 || src_bytes > 16 ||
	    (src_bytes > 0 && ((uintptr_t)src & 15u)))
		ej_sim_fail(t, "cp.async: source %p with %d bytes (16-byte "
			       "aligned, 0 to 16 bytes)",
			    src, src_bytes);
	if (t->ncp == EJ_SIM_CP_MAX)
		ej_sim_fail(t, "cp.async: more than %d copies pending in one "
			       "thread (no cp.async.wait_group)",
			    EJ_SIM_CP_MAX);
	ej_sim_cp *e = &t->cp[t->ncp++];
	e->dst = dst;
	e->grp = -1;
	memset(e->data, 0, 16);
	if (src_bytes > 0)
		memcpy(e->data, src, (size_t)src_bytes);
}
static void ej_cp_async_commit(void)
{
	ej_sim_thr *t = ej_sim_cur;
	for (int i = 0; i < t->ncp; i++)
		if (t->cp[i].grp < 0)
			t->cp[i].grp = t->cpg;
	t->cpg++;
}
/* completes every committed group but the newest n */
static void ej_cp_async_wait(int n)
{
	ej_sim_thr *t = ej_sim_cur;
	int lim = t->cpg - n, k = 0;
	for (int i = 0; i < t->ncp; i++) {
		ej_sim_cp *e = &t->cp[i];
		if (e->grp >= 0 && e->grp < lim)
			memcpy(e->dst, e->data, 16);
		else
			t->cp[k++] = *e;
	}
	t->ncp = k;
}

/* the lanes of the caller's warp that have not exited */
static inline unsigned __activemask(void)
{
	unsigned warp = ej_sim_cur->lin >> 5, m = 0;
	for (unsigned l = 0; l < 32; l++) {
		ej_sim_thr *o = ej_sim_lane(warp, l);
		if (o && o->state != EJ_ST_DONE)
			m |= 1u << l;
	}
	return m;
}

/* ---- running a block ------------------------------------------------------
 */

static void ej_sim_entry(void)
{
	ej_sim_fiber_begin(&ej_sim_b->sched);
	ej_sim_b->body(ej_sim_b->args);
	if (ej_sim_cur->ncp)
		ej_sim_fail(ej_sim_cur,
			    "ends with %d cp.async copies never completed by "
			    "a cp.async.wait_group",
			    ej_sim_cur->ncp);
	ej_sim_cur->state = EJ_ST_DONE;
	for (;;) /* never resumed */
		ej_sim_yield();
}

static void ej_sim_stuck_report(void)
{
	ej_sim_blk *b = ej_sim_b;
	unsigned nb = 0, nd = 0;
	ej_sim_thr *bar = NULL, *done = NULL;
	for (unsigned i = 0; i < b->n; i++) {
		ej_sim_thr *t = &b->t[i];
		if (t->state == EJ_ST_WARP) {
			unsigned warp = t->lin >> 5;
			for (unsigned l = 0; l < 32; l++) {
				if (!(t->wmask >> l & 1u))
					continue;
				ej_sim_thr *o = ej_sim_lane(warp, l);
				if (o->state == EJ_ST_DONE)
					ej_sim_fail(t,
						    "%s (line %d) with mask "
						    "0x%08x names lane %u, "
						    "which has exited",
						    ej_sim_wname[t->wop],
						    t->line, t->wmask, l);
				if (o->state == EJ_ST_BAR)
					ej_sim_fail(t,
						    "%s (line %d) with mask "
						    "0x%08x waits for lane %u, "
						    "which waits at "
						    "__syncthreads (line %d)",
						    ej_sim_wname[t->wop],
						    t->line, t->wmask, l,
						    o->line);
				if (o->wop != t->wop || o->wmask != t->wmask)
					ej_sim_fail(t,
						    "%s (line %d) with mask "
						    "0x%08x waits for lane %u, "
						    "which is in %s (line %d) "
						    "with mask 0x%08x",
						    ej_sim_wname[t->wop],
						    t->line, t->wmask, l,
						    ej_sim_wname[o->wop],
						    o->line, o->wmask);
			}
			ej_sim_fail(t, "%s (line %d) never completes",
				    ej_sim_wname[t->wop], t->line);
		}
		if (t->state == EJ_ST_BAR) {
			nb++;
			if (!bar)
				bar = t;
			else if (bar->line != t->line)
				ej_sim_fail(t,
					    "divergent __syncthreads: this "
					    "thread waits at line %d, thread "
					    "(%u,%u,%u) at line %d",
					    t->line, bar->tid.x, bar->tid.y,
					    bar->tid.z, bar->line);
		}
		if (t->state == EJ_ST_DONE) {
			nd++;
			if (!done)
				done = t;
		}
	}
	if (bar && done)
		ej_sim_fail(done,
			    "divergent __syncthreads: this thread exited while "
			    "%u thread(s) wait at __syncthreads (line %d), "
			    "e.g. thread (%u,%u,%u)",
			    nb, bar->line, bar->tid.x, bar->tid.y, bar->tid.z);
}

static void ej_sim_report_entry(void)
{
	ej_sim_fiber_begin(&ej_sim_b->sched);
	ej_sim_stuck_report();
	for (;;) /* never resumed */
		ej_sim_yield();
}

static void ej_sim_block(ej_sim_blk *b, bool reverse)
{
	ej_sim_b = b;
	for (unsigned i = 0; i < b->n; i++) {
		b->t[i].state = EJ_ST_NEW;
		b->t[i].ncp = 0;
		b->t[i].cpg = 0;
	}
	for (;;) {
		bool ran = false;
		for (unsigned k = 0; k < b->n; k++) {
			ej_sim_thr *t = &b->t[reverse ? b->n - 1 - k : k];
			if (t->state != EJ_ST_NEW && t->state != EJ_ST_RUN)
				continue;
			if (t->state == EJ_ST_NEW)
				ej_sim_ctx_make(&t->ctx, t->stack,
						EJ_SIM_STACK, ej_sim_entry);
			t->state = EJ_ST_RUN;
			ej_sim_cur = t;
			ej_sim_ctx_swap(&b->sched, &t->ctx);
			ran = true;
			if (b->failed)
				return;
		}
		if (ran)
			continue;
		unsigned nb = 0, nd = 0;
		for (unsigned i = 0; i < b->n; i++) {
			nb += b->t[i].state == EJ_ST_BAR;
			nd += b->t[i].state == EJ_ST_DONE;
		}
		if (nd == b->n)
			return;
		if (nb == b->n) {
			int line = b->t[0].line;
			for (unsigned i = 0; i < b->n; i++)
				if (b->t[i].line != line)
					nb = 0;
			if (nb == b->n) {
				for (unsigned i = 0; i < b->n; i++)
					b->t[i].state = EJ_ST_RUN;
				continue;
			}
		}
		/* reports from the scheduler's own context: no fiber to
		 * leave, so run the report on a helper fiber */
		ej_sim_cur = &b->t[0];
		ej_sim_ctx_make(&b->t[0].ctx, b->t[0].stack, EJ_SIM_STACK,
				ej_sim_report_entry);
		ej_sim_ctx_swap(&b->sched, &b->t[0].ctx);
		if (!b->failed) {
			ej_sim_cur = NULL;
			snprintf(b->msg, 1024,
				 "cuda-sim: kernel %s, block (%u,%u,%u): "
				 "threads wait forever",
				 b->kernel, b->bidx.x, b->bidx.y, b->bidx.z);
			b->failed = 1;
		}
		return;
	}
}

static unsigned long long ej_sim_hash(const unsigned char *p, size_t n,
				      unsigned long long h)
{
	for (size_t i = 0; i < n; i++)
		h = (h ^ p[i]) * 0x100000001b3ull;
	return h;
}

static size_t ej_sim_static_smem(void)
{
	return __start_ej_shared && __stop_ej_shared
		   ? (size_t)(__stop_ej_shared - __start_ej_shared)
		   : 0;
}

static void ej_sim_fill_out(const ej_sim_out *o)
{
	static const unsigned char p2[2] = { 0xa5, 0x7f };
	static const unsigned char p4[4] = { 0xa5, 0xa5, 0xa5, 0x7f };
	static const unsigned char p8[8] = { 0xa5, 0xa5, 0xa5, 0xa5,
					     0xa5, 0xa5, 0xf4, 0x7f };
	const unsigned char *p = o->elem == 2 ? p2 : o->elem == 8 ? p8 : p4;
	size_t e = o->elem == 2 || o->elem == 8 ? o->elem : 4;
	for (size_t i = 0; i + e <= o->bytes; i += e)
		memcpy((char *)o->ptr + i, p, e);
}

static long long ej_sim_unwritten(const ej_sim_out *o)
{
	ej_sim_out probe = { NULL, 0, o->elem };
	size_t e = o->elem == 2 || o->elem == 8 ? o->elem : 4;
	unsigned char pat[8];
	probe.ptr = pat;
	probe.bytes = e;
	ej_sim_fill_out(&probe);
	for (size_t i = 0; i + e <= o->bytes; i += e)
		if (!memcmp((const char *)o->ptr + i, pat, e))
			return (long long)(i / e);
	return -1;
}

/* Runs the grid once; hash[] gets each block's shared memory at its end
 * (check: compare instead).  Returns 0 or 1 with b->msg set. */
static int ej_sim_grid(ej_sim_blk *b, const ej_sim_launch *L, bool reverse,
		       unsigned long long *hash, bool check)
{
	unsigned long long nblk = (unsigned long long)L->grid[0] *
				  L->grid[1] * L->grid[2];
	size_t sst = ej_sim_static_smem();
	for (unsigned long long k = 0; k < nblk; k++) {
		unsigned long long q = reverse ? nblk - 1 - k : k;
		b->bidx.x = (unsigned)(q % L->grid[0]);
		b->bidx.y = (unsigned)(q / L->grid[0] % L->grid[1]);
		b->bidx.z = (unsigned)(q / L->grid[0] / L->grid[1]);
		if (sst)
			memset(__start_ej_shared, 0xff, sst);
		memset(ej_dsmem, 0xff, (size_t)L->smem);
		ej_sim_block(b, reverse);
		if (b->failed)
			return 1;
		unsigned long long h = 0xcbf29ce484222325ull;
		if (sst)
			h = ej_sim_hash((const unsigned char *)__start_ej_shared,
					sst, h);
		h = ej_sim_hash(ej_dsmem, (size_t)L->smem, h);
		if (hash && !check)
			hash[q] = h;
		if (hash && check && hash[q] != h) {
			snprintf(b->msg, 1024,
				 "cuda-sim: kernel %s, block (%u,%u,%u): "
				 "shared-memory race: the block's shared "
				 "memory at its end differs between forward "
				 "and reverse thread order",
				 b->kernel, b->bidx.x, b->bidx.y, b->bidx.z);
			return 1;
		}
	}
	return 0;
}

/* The per-kernel entry's body: checks, the grid (twice with the race
 * check), the poison check.  0 or 1 with L->msg set. */
static int ej_sim_run(ej_sim_launch *L, const char *kernel,
		      void (*body)(const void *))
{
	L->msg[0] = 0;
	if (L->abi != EJ_SIM_ABI) {
		snprintf(L->msg, sizeof L->msg,
			 "cuda-sim: kernel %s: launch ABI %u, module has %u",
			 kernel, L->abi, (unsigned)EJ_SIM_ABI);
		return 1;
	}
	unsigned long long n = (unsigned long long)L->block[0] * L->block[1] *
			       L->block[2];
	unsigned long long nblk = (unsigned long long)L->grid[0] *
				  L->grid[1] * L->grid[2];
	if (n < 1 || n > 1024 || nblk < 1 || L->smem > EJ_SIM_DSMEM_MAX) {
		snprintf(L->msg, sizeof L->msg,
			 "cuda-sim: kernel %s: bad launch: grid (%u,%u,%u), "
			 "block (%u,%u,%u) (1 to 1024 threads), %llu bytes of "
			 "dynamic shared memory (at most %u)",
			 kernel, L->grid[0], L->grid[1], L->grid[2],
			 L->block[0], L->block[1], L->block[2], L->smem,
			 (unsigned)EJ_SIM_DSMEM_MAX);
		return 1;
	}
	ej_sim_blk b;
	memset(&b, 0, sizeof b);
	b.n = (unsigned)n;
	b.bdim.x = L->block[0];
	b.bdim.y = L->block[1];
	b.bdim.z = L->block[2];
	b.gdim.x = L->grid[0];
	b.gdim.y = L->grid[1];
	b.gdim.z = L->grid[2];
	b.kernel = kernel;
	b.msg = L->msg;
	b.body = body;
	b.args = L->args;
	size_t mem = (sizeof(ej_sim_thr) + EJ_SIM_STACK) * (size_t)n;
	b.t = (ej_sim_thr *)malloc(mem);
	bool race = (L->flags & EJ_SIM_RACECHECK) != 0;
	unsigned long long *hash =
	    race ? (unsigned long long *)malloc(nblk * sizeof *hash) : NULL;
	size_t total = 0;
	for (int o = 0; o < L->n_out; o++)
		total += (size_t)L->outs[o].bytes;
	char *save = race ? (char *)malloc(total + 1) : NULL;
	char *first = race ? (char *)malloc(total + 1) : NULL;
	int rc = 0;
	if (!b.t || (race && (!hash || !save || !first))) {
		snprintf(L->msg, sizeof L->msg,
			 "cuda-sim: kernel %s: out of memory for %llu fibers",
			 kernel, n);
		rc = 1;
		goto out;
	}
	memset(b.t, 0, sizeof(ej_sim_thr) * (size_t)n);
	for (unsigned i = 0; i < b.n; i++) {
		b.t[i].lin = i;
		b.t[i].stack = (char *)b.t + sizeof(ej_sim_thr) * (size_t)n +
			       (size_t)i * EJ_SIM_STACK;
		b.t[i].tid.x = i % L->block[0];
		b.t[i].tid.y = i / L->block[0] % L->block[1];
		b.t[i].tid.z = i / L->block[0] / L->block[1];
	}
#ifdef EJ_SIM_ASAN
	__asan_poison_memory_region(ej_dsmem + L->smem,
				    EJ_SIM_DSMEM_MAX - (size_t)L->smem);
#endif
	if (L->flags & EJ_SIM_POISON)
		for (int o = 0; o < L->n_out; o++)
			ej_sim_fill_out(&L->outs[o]);
	if (race) {
		size_t at = 0;
		for (int o = 0; o < L->n_out; o++) {
			memcpy(save + at, L->outs[o].ptr, L->outs[o].bytes);
			at += (size_t)L->outs[o].bytes;
		}
	}
	rc = ej_sim_grid(&b, L, false, hash, false);
	if (!rc && race) {
		size_t at = 0;
		for (int o = 0; o < L->n_out; o++) {
			memcpy(first + at, L->outs[o].ptr, L->outs[o].bytes);
			memcpy(L->outs[o].ptr, save + at, L->outs[o].bytes);
			at += (size_t)L->outs[o].bytes;
		}
		rc = ej_sim_grid(&b, L, true, hash, true);
		at = 0;
		for (int o = 0; !rc && o < L->n_out; o++) {
			const char *p = (const char *)L->outs[o].ptr;
			for (size_t i = 0; i < L->outs[o].bytes; i++)
				if (p[i] != first[at + i]) {
					size_t e = L->outs[o].elem
						       ? L->outs[o].elem
						       : 1;
					snprintf(L->msg, sizeof L->msg,
						 "cuda-sim: kernel %s: race: "
						 "output %d element %zu "
						 "differs between forward "
						 "and reverse block/thread "
						 "order",
						 kernel, o, i / e);
					rc = 1;
					break;
				}
			at += (size_t)L->outs[o].bytes;
		}
	}
	if (!rc && (L->flags & EJ_SIM_POISON))
		for (int o = 0; o < L->n_out; o++) {
			long long e = ej_sim_unwritten(&L->outs[o]);
			if (e >= 0) {
				snprintf(L->msg, sizeof L->msg,
					 "cuda-sim: kernel %s: output %d "
					 "element %lld (of %llu) was never "
					 "written",
					 kernel, o, e,
					 L->outs[o].bytes /
					     (L->outs[o].elem ? L->outs[o].elem
							      : 1));
				rc = 1;
				break;
			}
		}
out:
#ifdef EJ_SIM_ASAN
	__asan_unpoison_memory_region(ej_dsmem, EJ_SIM_DSMEM_MAX);
	if (b.t)
		__asan_unpoison_memory_region(b.t, mem);
#endif
	free(b.t);
	free(hash);
	free(save);
	free(first);
	ej_sim_cur = NULL;
	ej_sim_b = NULL;
	return rc;
}

/* EJ_SIM_ENTRY(k, S): the launch entry of kernel k taking struct S. */
#define EJ_SIM_ENTRY(k, S)                                                     \
	static void ej_sim_body_##k(const void *a)                             \
	{                                                                      \
		k(*(const S *)a);                                              \
	}                                                                      \
	extern "C" __attribute__((visibility("default"))) int ej_sim_##k(      \
	    ej_sim_launch *L)                                                  \
	{                                                                      \
		return ej_sim_run(L, #k, ej_sim_body_##k);                     \
	}
/* ---- end of the simulator; the CUDA translation unit follows ---- */
