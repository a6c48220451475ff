/* blas_core.c -- OpenBLAS's kernels on x86 CPUs newer than its release.
 *
 * An OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels when it
 * is loaded, from the CPU's family and model.  A model newer than the
 * release is not in its table: OpenBLAS 0.3.21 (Debian 12) on a Xeon of
 * model 207 falls back to "Prescott", the SSE3 kernels, and sgemm runs
 * about 5 times slower than on the AVX-512 kernels the CPU runs (measured:
 * bench/RESULTS.md, "OpenBLAS on a CPU it does not know").  OpenBLAS reads
 * OPENBLAS_CORETYPE only when it is loaded, before this library's code
 * runs, so before the first BLAS call the library looks at OpenBLAS's
 * choice and, when it is a core without AVX (or Sandy Bridge's, AVX
 * without FMA) while the CPU and the OS support more, re-runs OpenBLAS's
 * selection with the core the CPU's features (not its model) call for:
 * Cooperlake (AVX-512 with BF16), SkylakeX (AVX-512), Haswell (AVX2 and
 * FMA) or Sandybridge (AVX).
 *
 * Left alone: a user's OPENBLAS_CORETYPE, an OpenBLAS without DYNAMIC_ARCH
 * or without the entry points (gotoblas_dynamic_init/quit, exported by
 * DYNAMIC_ARCH builds), any other BLAS, a choice with AVX2 or better, and
 * everything when EPJIT_OPENBLAS_CORE=0.  The entry points are looked up
 * at run time, so the library links against any CBLAS.  The selection
 * runs once, under a lock, before this library's first BLAS call; a BLAS
 * call that another part of the process makes at that moment is not
 * covered (OpenBLAS's own selection is not either).
 */
#include "core_impl.h"
#include "ops_impl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#define EJ_X86 1
#else
#define EJ_X86 0
#endif

/* The x86 cores this file knows, in groups from the weakest; a core's
 * rank is its group's index. */
static const char *const core_rank[][12] = {
	/* 0: no AVX (OpenBLAS's fallbacks for unknown models) */
	{ "Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom",
	  "Katmai", "Coppermine", "Northwood", "Banias", NULL },
	{ "Sandybridge", NULL },		  /* 1: AVX */
	{ "Haswell", "Zen", NULL },		  /* 2: AVX2 + FMA */
	{ "SkylakeX", NULL },			  /* 3: AVX-512 */
	{ "Cooperlake", "SapphireRapids", NULL }, /* 4: AVX-512 + BF16 */
};

static int rank_of(const char *core)
{
	for (int r = 0; r < (int)(sizeof core_rank / sizeof core_rank[0]); r++)
		for (int i = 0; core_rank[r][i]; i++)
			if (!strcasecmp(core, core_rank[r][i]))
				return r;
	return -1;
}

const char *ej_blas_core_pick(const char *chosen, unsigned feats)
{
	static const char *const target[] = { NULL, "Sandybridge", "Haswell",
					      "SkylakeX", "Cooperlake" };
	int have = rank_of(chosen ? chosen : "");
	if (have < 0 || have > 1)
		return NULL; /* unknown, or AVX2 and better: OpenBLAS knew */
	int want = 0;
	if (feats & EJ_CPU_AVX)
		want = 1;
	if ((feats & EJ_CPU_AVX) && (feats & EJ_CPU_AVX2_FMA))
		want = 2;
	if (want == 2 && (feats & EJ_CPU_AVX512))
		want = 3;
	if (want == 3 && (feats & EJ_CPU_AVX512_BF16))
		want = 4;
	return want > have ? target[want] : NULL;
}

unsigned ej_cpu_features(void)
{
	unsigned f = 0;
#if EJ_X86
	unsigned a, b, c, d;
	if (!__get_cpuid(1, &a, &b, &c, &d))
		return 0;
	/* OSXSAVE (the OS saves the state xgetbv reports) and AVX */
	if (!(c & (1u << 27)) || !(c & (1u << 28)))
		return 0;
	bool fma = c & (1u << 12);
	unsigned lo, hi;
	__asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
	(void)hi;
	if ((lo & 6u) != 6u) /* XMM and YMM state */
		return 0;
	f |= EJ_CPU_AVX;
	if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
		return f;
	if ((b & (1u << 5)) && fma) /* AVX2 */
		f |= EJ_CPU_AVX2_FMA;
	/* AVX-512 F, DQ, CD, BW, VL and the opmask/ZMM state (XCR0 5-7) */
	unsigned need =
	    (1u << 16) | (1u << 17) | (1u << 28) | (1u << 30) | (1u << 31);
	if ((b & need) == need && (lo & 0xe0u) == 0xe0u) {
		f |= EJ_CPU_AVX512;
		unsigned a1, b1, c1, d1;
		if (a >= 1 && __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) &&
		    (a1 & (1u << 5)))
			f |= EJ_CPU_AVX512_BF16;
	}
#endif
	return f;
}

const char *ej_blas_core_name(void)
{
	const char *(*corename)(void) =
	    (const char *(*)(void))dlsym(RTLD_DEFAULT, "openblas_get_corename");
	return corename ? corename() : NULL;
}

bool ej_blas_core_select(const char *name)
{
	const char *(*config)(void) =
	    (const char *(*)(void))dlsym(RTLD_DEFAULT, "openblas_get_config");
	void (*init)(void) =
	    (void (*)(void))dlsym(RTLD_DEFAULT, "gotoblas_dynamic_init");
	void (*quit)(void) =
	    (void (*)(void))dlsym(RTLD_DEFAULT, "gotoblas_dynamic_quit");
	if (!config || !init || !quit || !strstr(config(), "DYNAMIC_ARCH"))
		return false;
	if (setenv("OPENBLAS_CORETYPE", name, 1) != 0)
		return false;
	quit();
	init();
	unsetenv("OPENBLAS_CORETYPE");
	return true;
}

static pthread_mutex_t core_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_bool core_done;

static void core_select(void)
{
	const char *env = getenv("EPJIT_OPENBLAS_CORE");
	if (env && !strcmp(env, "0"))
		return;
	if (env && *env && strcmp(env, "auto") != 0) {
		epj_log_msg(EPJ_LOG_WARN,
			    "EPJIT_OPENBLAS_CORE=\"%s\": unknown value (known: "
			    "auto, 0); using auto",
			    env);
	}
	const char *user = getenv("OPENBLAS_CORETYPE");
	if (user && *user)
		return;
	const char *chosen = ej_blas_core_name();
	const char *pick =
	    chosen ? ej_blas_core_pick(chosen, ej_cpu_features()) : NULL;
	if (!pick)
		return;
	char was[32];
	snprintf(was, sizeof was, "%s", chosen);
	if (!ej_blas_core_select(pick))
		return;
	const char *now = ej_blas_core_name();
	if (now && !strcasecmp(now, pick))
		epj_log_msg(EPJ_LOG_INFO,
			    "OpenBLAS chose its %s kernels for this CPU; "
			    "using %s, which the CPU supports "
			    "(EPJIT_OPENBLAS_CORE=0 keeps OpenBLAS's choice)",
			    was, pick);
	else
		epj_log_msg(EPJ_LOG_WARN,
			    "OpenBLAS chose its %s kernels for this CPU; "
			    "selecting %s gave %s",
			    was, pick, now ? now : "(unknown)");
}

void ej_blas_ready(void)
{
	if (atomic_load_explicit(&core_done, memory_order_acquire))
		return;
	pthread_mutex_lock(&core_lock);
	if (!atomic_load_explicit(&core_done, memory_order_relaxed)) {
		core_select();
		atomic_store_explicit(&core_done, true, memory_order_release);
	}
	pthread_mutex_unlock(&core_lock);
}

void ej_blas_ready_reset(void)
{
	pthread_mutex_lock(&core_lock);
	atomic_store_explicit(&core_done, false, memory_order_release);
	pthread_mutex_unlock(&core_lock);
}
