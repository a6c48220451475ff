/* cc.h -- the compilers that turn generated source into loadable artifacts:
 * NVRTC (CUDA C -> cubin, or PTX when the arch is newer than NVRTC knows)
 * and the host C compiler (C -> shared object, loaded with dlopen); plus a
 * probe for the CUDA driver, which is dlopen()ed so that the library builds
 * and runs where there is none.
 *
 * Contract
 *  - Artifacts come back as bytes (malloc'ed), never as paths: the kernel
 *    cache stores them and the loaders take them back.  Temporary files
 *    live in private places (mkdtemp, O_EXCL, mode 0600/0700) and are
 *    removed, except the source of a failed compile, which is kept and
 *    named in the error message.
 *  - Every foreign call (NVRTC, dlopen, exec, file I/O) goes through a check
 *    macro; a failure sets the context message with the statement, file:line
 *    and the library's own error string (and, for NVRTC, the program log).
 *  - The identity strings (ej_nvrtc_identity, ej_hostcc_identity) name the
 *    compiler, its version and the fixed options; they belong in every cache
 *    key of an artifact the compiler made.
 *  - All functions are thread-safe (NVRTC programs are per call; the
 *    identities are computed under a lock).
 *  - Built without NVRTC (configure found no toolkit), the NVRTC functions
 *    return EPJ_ERR_UNSUPPORTED "built without NVRTC"; the rest works.
 */
#ifndef EPJIT_CC_H
#define EPJIT_CC_H

#include "core_impl.h"

#include <dlfcn.h>
#include <limits.h>
#include <string.h>

/* ---- NVRTC ---------------------------------------------------------------
 */

/* Result of one NVRTC compile; every pointer member is malloc'ed and owned
 * by the struct (ej_nvrtc_result_free).
 *  image:  cubin (an ELF) or, when is_ptx, PTX text; for PTX, size counts
 *          the terminating NUL (cuModuleLoadData wants it).
 *  log:    the NVRTC program log, NUL-terminated ("" when quiet); on a PTX
 *          fallback it begins with a "note:" line saying so.
 *  target: the -arch value actually used ("sm_90", or "compute_121" on a
 *          fallback); part of the cache key.
 *  ptx:    with EJ_NVRTC_OPT_KEEP_PTX among the options, the PTX the cubin
 *          was made from (NUL-terminated); else NULL. */
typedef struct ej_nvrtc_result {
	void *image;
	size_t size;
	bool is_ptx;
	char *log;
	char target[16];
	char *ptx;
} ej_nvrtc_result;

/* Frees the members and zeroes *r; NULL ok. */
void ej_nvrtc_result_free(ej_nvrtc_result *r);

/* Compiles one CUDA C translation unit `source` (program name `name`, used
 * in the log as "<name>.cu") for `arch` ("sm_80", "sm_90a", ...).  Options:
 * -arch=<target>, then extra_opts[0..n_opts) verbatim (e.g. "-lineinfo"),
 * but EJ_NVRTC_OPT_KEEP_PTX, which only keeps the PTX.
 *  - arch newer than every arch this NVRTC supports: PTX for the newest
 *    supported compute_XX (is_ptx = true; the log says so);
 *  - arch older than the oldest, or between supported ones but not one of
 *    them: EPJ_ERR_UNSUPPORTED naming the supported range;
 *  - arch not of the form sm_<digits>[a|f]: EPJ_ERR_INVALID;
 *  - failed compile: EPJ_ERR_COMPILE; the message has the failing call,
 *    file:line, the NVRTC error, the path of a file holding the source
 *    ($TMPDIR/epjit-nvrtc-<pid>-<n>-<name>.cu, next to it the full log as
 *    .log) and the program log (truncated to fit the message).
 * On success *out owns the artifact; on failure *out is zeroed. */
epj_status ej_nvrtc_compile(epj_ctx *ctx, const char *source, const char *name,
			    const char *arch, const char *const *extra_opts,
			    int n_opts, ej_nvrtc_result *out);

/* NVRTC's version; false (0.0) when built without NVRTC. */
bool ej_nvrtc_version(int *major, int *minor);
/* "nvrtc 13.0" ("nvrtc none" without NVRTC); static storage. */
const char *ej_nvrtc_identity(void);
/* Kernel-cache key of the NVRTC artifact of CUDA C `source` for `arch` with
 * extra options opts[0..n_opts) (the -arch option is implied): the source,
 * ej_nvrtc_identity(), the arch and the options.  Whatever stores or loads
 * an NVRTC artifact uses this function (64 hex digits + NUL into key). */
void ej_nvrtc_cache_key(const char *source, const char *arch,
			const char *const *opts, int n_opts, char key[65]);
/* The one NVRTC build of a module: the module of CUDA C `source` (named
 * `name`) for `arch` on the device vt, from the kernel cache kc (NULL: none)
 * when it holds an image the device loads (one it refuses is dropped),
 * else compiled with NVRTC (no options besides -arch, the key warm-up
 * computes too), loaded, and only then put into kc; of the processes that
 * miss a key at once, one compiles (the cache's per-key lock).  A failed
 * load of a fresh image is prefixed "<what>: the image just compiled does
 * not load".  Used by the nvrtc backend and the CUDA templates. */
struct ej_kcache;
epj_status ej_nvrtc_build_module(epj_ctx *ctx, struct ej_kcache *kc,
				 const char *source, const char *name,
				 const char *arch, const ej_device *vt,
				 const char *what, void **module);
/* Whether an NVRTC log reports a warning ("k.cu(3): warning #177-D: ..."). */
bool ej_nvrtc_log_has_warning(const char *log);

/* ---- ptxas resource report -----------------------------------------------
 */

/* The NVRTC option (for extra_opts) that has ptxas write its resource
 * report into the program log, per function:
 *   ptxas info    : Compiling entry function 'k' for 'sm_90'
 *   ptxas info    : Function properties for k
 *   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes
 *                       spill loads                       (one line)
 *   ptxas info    : Used 40 registers, used 1 barriers, ...
 * (and "Compile time" lines).  A cubin compile only: PTX output runs no
 * ptxas. */
#define EJ_NVRTC_OPT_PTXAS_REPORT "--ptxas-options=-v"

/* Not an NVRTC option: in extra_opts it is taken out of what NVRTC sees and
 * keeps the PTX of a cubin compile in result->ptx (t/check_ptxas.c reads
 * the instructions a kernel uses from it). */
#define EJ_NVRTC_OPT_KEEP_PTX "epjit:keep-ptx"

/* What ptxas reports for one function. */
typedef struct ej_ptxas_usage {
	char name[128];	  /* as ptxas prints it (mangled unless extern "C") */
	bool entry;	  /* a kernel ("Compiling entry function") */
	int registers;	  /* -1 when the report gives none */
	int stack;	  /* bytes of stack frame (local memory) per thread */
	int spill_stores; /* bytes per thread */
	int spill_loads;  /* bytes per thread */
} ej_ptxas_usage;

/* Parses the ptxas resource report of an NVRTC log (a compile with
 * EJ_NVRTC_OPT_PTXAS_REPORT) into u[0..max), one entry per function in the
 * order the report first names them; numbers the report leaves out stay
 * -1 (registers) or 0.  Returns the number of functions, 0 for a log with
 * no report (NULL ok), or -1 when there are more than max. */
int ej_ptxas_report_parse(const char *log, ej_ptxas_usage *u, int max);

/* ---- target arch list ----------------------------------------------------
 */

#define EJ_CUDA_ARCH_DEFAULT "sm_80,sm_90"
#define EJ_CUDA_ARCH_MAX     16 /* longest arch name + NUL */

/* Parses a comma-separated arch list ("sm_80, sm_90a"; blanks around
 * entries are ignored, duplicates dropped, order kept) into archs[0..max).
 * Returns the count (>= 1), or -1 with EPJ_ERR_CONFIG in ctx naming `what`
 * (e.g. "EPJIT_CUDA_ARCH") and the offending value: an entry that is not
 * sm_<digits>[a|f], an empty entry or list, more than max entries. */
int ej_cuda_archs_parse(epj_ctx *ctx, const char *what, const char *spec,
			char archs[][EJ_CUDA_ARCH_MAX], int max);
/* The list from EPJIT_CUDA_ARCH (unset or blank: EJ_CUDA_ARCH_DEFAULT). */
int ej_cuda_archs(epj_ctx *ctx, char archs[][EJ_CUDA_ARCH_MAX], int max);

/* ---- CUDA driver ---------------------------------------------------------
 */

/* Checks that the CUDA driver can be loaded (dlopen libcuda.so.1 and find
 * cuInit).  EPJ_OK, or EPJ_ERR_BACKEND "no CUDA driver (libcuda.so.1 not
 * found: <dlerror>)".  Loads nothing for good: the handle is closed. */
epj_status ej_cuda_driver_probe(epj_ctx *ctx);

/* ---- host C compiler -----------------------------------------------------
 */

/* The fixed compile flags (also part of the identity; ej_hostcc_cflags adds
 * the instruction set and -fopenmp when the library runs on an OpenMP
 * runtime). */
#define EJ_HOSTCC_FLAGS "-std=c11 -O3 -fPIC"
#define EJ_HOSTCC_LIBS	"-lm"

/* The OpenMP runtime this library itself runs on: the absolute path of the
 * shared object defining omp_get_max_threads (libgomp.so.1 under gcc,
 * libomp.so.5 under clang), or NULL when the library was built without
 * OpenMP.  A module is linked against exactly that object (by path, not
 * -fopenmp's default), so a process never holds two OpenMP runtimes; without
 * one, modules are compiled without -fopenmp (serial).  gcc's GOMP calls
 * work with either runtime; clang's need libomp. */
const char *ej_hostcc_openmp_runtime(void);
/* Makes path the runtime of ej_hostcc_openmp_runtime() (modules link it and
 * the identity names it) instead of the library's own: epjit-warmup builds
 * the kernels of another process (a torch run whose libgomp is torch's).
 * Call before the first compile or identity. */
void ej_hostcc_set_openmp_runtime(const char *path);
/* EJ_HOSTCC_FLAGS, plus " -march=<level>" for the instruction set of
 * ej_hostcc_isa() other than baseline, plus " -fopenmp" when there is a
 * runtime (static storage).  The flags are part of the compiler identity,
 * so the instruction set is part of every C artifact's cache key. */
const char *ej_hostcc_cflags(void);
/* The instruction set generated C is compiled for: $EPJIT_CC_ISA, one of
 * "baseline" (the compiler's default), "x86-64-v2", "x86-64-v3",
 * "x86-64-v4", "native"; unset or "auto": the highest x86-64 level this CPU
 * runs (baseline on other machines).  NULL when $EPJIT_CC_ISA names no
 * level or one this CPU cannot run (ej_hostcc_isa_check says which). */
const char *ej_hostcc_isa(void);
/* EPJ_OK, or the error for a bad $EPJIT_CC_ISA: EPJ_ERR_INVALID for an
 * unknown value, EPJ_ERR_UNSUPPORTED for a level this CPU cannot run.  C
 * compiles (ej_hostcc_compile) check it first. */
epj_status ej_hostcc_isa_check(epj_ctx *ctx);

/* Compiles C `source` to a shared object with $EPJIT_CC (default "cc"; split
 * at blanks, so "ccache gcc" works, no shell quoting) run directly (no
 * shell) in a private temporary directory (mkdtemp, checked after creation:
 * owned by us, mode 0700) that is its working directory by descriptor.  The
 * .so is opened once (O_NOFOLLOW), checked through that descriptor (regular,
 * owned by us, not writable by group or others) and read from it.  On
 * success *so_image and *so_size hold the .so bytes (malloc'ed, caller
 * frees) and the directory is gone.  *log (may be NULL) receives the
 * compiler's output, malloc'ed, "" when quiet, also on failure.  On failure:
 * EPJ_ERR_COMPILE with the command, the exit status, the path where the
 * source was kept, and the output; EPJ_ERR_STATE when the private directory
 * or the module is not private. */
epj_status ej_hostcc_compile(epj_ctx *ctx, const char *source, const char *name,
			     void **so_image, size_t *so_size, char **log);

/* Loads a shared object from bytes: copies them into a sealed memfd (no path
 * another user could swap) and dlopen()s "/proc/self/fd/<n>" (RTLD_NOW |
 * RTLD_LOCAL).  *handle is for ej_hostcc_sym and ej_hostcc_unload (it holds
 * the descriptor as long as the object is loaded).  dlopen failure:
 * EPJ_ERR_BACKEND with dlerror(). */
epj_status ej_hostcc_load(epj_ctx *ctx, const void *so_image, size_t size,
			  const char *name, void **handle);
/* Address of `sym` in a loaded object, NULL when absent. */
void *ej_hostcc_sym(void *handle, const char *sym);
/* dlclose; NULL ok. */
void ej_hostcc_unload(void *handle);

/* C++ mode, for the cuda-sim device: $EPJIT_CXX (default "c++"), source
 * <name>.cc, these fixed flags, then `extra_flags` (blank-separated words,
 * e.g. "-fsanitize=address"; NULL for none; callers put them in their
 * cache key), otherwise exactly ej_hostcc_compile.
 *
 * -O0: a cuda-sim module is a test device's, built for a few launches on
 * small shapes, so its compile costs more than its run.  At -O2, 70% of a
 * typical module's 0.5 s compile went to optimising the simulator's own
 * code; at -O0 the eager_sim, tmpl_moe and cuda suites spent 45%, 39% and
 * about half less CPU in all, running included (doc/cuda-sim.md).  Results
 * are the same bits: no -march, no fast-math, so no contraction into FMA
 * at either level. */
#define EJ_HOSTCXX_FLAGS                                                       \
	"-std=c++17 -O0 -fPIC -fno-strict-aliasing -fno-exceptions "           \
	"-fno-rtti"
#define EJ_HOSTCXX_LIBS "-lm"
epj_status ej_hostcxx_compile(epj_ctx *ctx, const char *source,
			      const char *name, const char *extra_flags,
			      void **so_image, size_t *so_size, char **log);
/* As ej_hostcc_identity, for $EPJIT_CXX and the C++ flags. */
const char *ej_hostcxx_identity(void);

/* "<cc> | <first line of cc --version> | <flags> <libs>", computed once per
 * distinct $EPJIT_CC value; static storage.  Never empty: when the compiler
 * cannot be run the version part says why. */
const char *ej_hostcc_identity(void);

/* ---- shared helpers (jit/hostcc.c) --------------------------------------- */

/* "nvrtc.c" from __FILE__ (out-of-tree builds pass absolute paths). */
static inline const char *ej_src_file(const char *path)
{
	const char *s = strrchr(path, '/');
	return s ? s + 1 : path;
}

/* The check macro of dlopen/dlsym: runs `stmt`, assigns it to `var`; when
 * that is NULL, `err` gets dlerror() (never NULL) and the char array `where`
 * "<stmt> at <file>:<line>". */
#define EJ_DL_CALL(var, stmt, where, err)                                      \
	do {                                                                   \
		dlerror();                                                     \
		(var) = (stmt);                                                \
		(err) = NULL;                                                  \
		if (!(var)) {                                                  \
			(err) = dlerror();                                     \
			if (!(err))                                            \
				(err) = "unknown dl error";                    \
			snprintf((where), sizeof(where), "%s at %s:%d", #stmt, \
				 ej_src_file(__FILE__), __LINE__);             \
		}                                                              \
	} while (0)

/* The directory for temporary files: $TMPDIR when set and non-empty, else
 * "/tmp". */
const char *ej_tmpdir(void);

/* ---- private directories --------------------------------------------------
 */

/* A private directory of this process: <TMPDIR>/<prefix>-<pid>.<host>-XXXXXX
 * (host: ej_host_tag()), its path (for messages) and a descriptor of it
 * (for everything else) that holds an exclusive flock on it: the sign that
 * its owner lives. */
typedef struct ej_privdir {
	char path[PATH_MAX];
	int fd;
	size_t stem; /* length of "<TMPDIR>/<prefix>-" in path */
} ej_privdir;

/* The prefix of the kernel cache's private directory (kcache.c). */
#define EJ_KCACHE_PRIVATE_PREFIX "epjit-kcache"

/* Removes the private directories of every kind (epjit-cc, epjit-so,
 * EJ_KCACHE_PRIVATE_PREFIX) that dead processes of this host left in
 * $TMPDIR: a real directory of ours (never through a symbolic link), its
 * pid gone, its lock free; emptied without following symbolic links.  Best
 * effort (what cannot be removed stays); each removal is logged at info
 * level.  ej_privdir_make and ej_kcache_open call it. */
void ej_privdir_sweep(void);
/* ej_privdir_sweep, then makes <TMPDIR>/<prefix>-<pid>.<host>-XXXXXX
 * with mkdtemp (mode 0700), opens it (O_DIRECTORY | O_NOFOLLOW), locks it
 * and checks it through the descriptor (a directory owned by geteuid(),
 * no group or other bits, the path still naming it), trying another name
 * when that fails.  On success d->fd >= 0; on failure d->fd is -1 and ctx
 * has the reason (EPJ_ERR_IO, EPJ_ERR_STATE). */
epj_status ej_privdir_make(epj_ctx *ctx, const char *prefix, ej_privdir *d);
/* Removes everything in d (without following symbolic links) and d itself
 * while its path still names the descriptor's directory, then closes the
 * descriptor (releasing the lock).  True when all of it went.  d->fd -1 is
 * fine. */
bool ej_privdir_remove_all(ej_privdir *d);
/* Copies name into buf (capacity n >= 2) keeping [A-Za-z0-9_.-] and mapping
 * anything else to '_', truncated; "" becomes "unnamed".  Returns buf. */
char *ej_safe_name(const char *name, char *buf, size_t n);
/* Creates path exclusively (O_CREAT | O_EXCL, mode 0600) and writes n bytes.
 * Returns 0, or an errno value (the file is removed on a write failure). */
int ej_write_new_file(const char *path, const void *data, size_t n);

#endif /* EPJIT_CC_H */
