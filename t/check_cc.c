/* check_cc.c -- the compilers (jit/cc.h): NVRTC to cubin (and the PTX
 * fallback for archs newer than NVRTC), the EPJIT_CUDA_ARCH list, the host C
 * compiler and loader, the CUDA driver probe.
 *
 * The NVRTC tests need a build with NVRTC; without one they check that the
 * compile says "built without NVRTC" and print "skipped: no NVRTC" (a Check
 * test cannot report SKIP).  No test needs a GPU or a driver.  Tests that set
 * EPJIT_CC or EPJIT_CUDA_ARCH restore them (the suite also runs with
 * CK_FORK=no). */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "check_util.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <link.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cc.h"
#include "jit_impl.h"

Suite *make_cc_suite(void);

/* ---- helpers ------------------------------------------------------------ */

/* Saved value of an environment variable, restored by env_restore. */
typedef struct saved_env {
	const char *name;
	char *value; /* NULL when it was unset */
} saved_env;

static saved_env env_set(const char *name, const char *value)
{
	const char *old = getenv(name);
	saved_env s = { name, old ? strdup(old) : NULL };
	if (value)
		setenv(name, value, 1);
	else
		unsetenv(name);
	return s;
}

static void env_restore(saved_env s)
{
	if (s.value)
		setenv(s.name, s.value, 1);
	else
		unsetenv(s.name);
	free(s.value);
}

/* The OpenMP runtimes (libgomp*, libomp*, libiomp*) mapped in the process,
 * counted by their real path. */
typedef struct omp_count {
	int n;
	char names[4][PATH_MAX];
} omp_count;

static int count_omp(struct dl_phdr_info *info, size_t size, void *data)
{
	(void)size;
	omp_count *c = data;
	const char *nm = info->dlpi_name;
	const char *base = nm ? strrchr(nm, '/') : NULL;
	base = base ? base + 1 : nm;
	if (!base || !(strncmp(base, "libgomp", 7) == 0 ||
		       strncmp(base, "libomp", 6) == 0 ||
		       strncmp(base, "libiomp", 7) == 0))
		return 0;
	char real[PATH_MAX];
	if (!realpath(nm, real))
		snprintf(real, sizeof real, "%.*s", (int)sizeof real - 1, nm);
	for (int i = 0; i < c->n && i < 4; i++)
		if (!strcmp(c->names[i], real))
			return 0;
	if (c->n < 4)
		memcpy(c->names[c->n], real, strlen(real) + 1);
	c->n++;
	return 0;
}

/* The path after "source kept at " in msg (up to a blank or ';'), copied
 * into buf; false when absent. */
static bool kept_path(const char *msg, char *buf, size_t n)
{
	const char *p = strstr(msg, "source kept at ");
	if (!p)
		return false;
	p += strlen("source kept at ");
	size_t len = strcspn(p, " ;\n");
	if (len == 0 || len >= n)
		return false;
	memcpy(buf, p, len);
	buf[len] = '\0';
	return true;
}

/* ---- NVRTC --------------------------------------------------------------- */

/* y = a*x + y over n elements; bf16-free, one block dimension. */
static const char axpy_src[] =
    "extern \"C\" __global__ void epj_axpy(float a, const float *x,\n"
    "                                      float *y, int n)\n"
    "{\n"
    "\tint i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "\tif (i < n)\n"
    "\t\ty[i] = a * x[i] + y[i];\n"
    "}\n";

#ifdef HAVE_NVRTC

/* A cubin is an ELF for the CUDA machine (EM_CUDA = 190) that holds the
 * kernel's name in its symbol table. */
static void assert_cubin(const ej_nvrtc_result *r, const char *kernel)
{
	const unsigned char *b = r->image;
	ck_assert_ptr_nonnull(b);
	ck_assert_uint_gt(r->size, 64);
	ck_assert_msg(!r->is_ptx, "cubin expected, got PTX");
	ck_assert_msg(memcmp(b,
			     "\x7f"
			     "ELF",
			     4) == 0,
		      "no ELF magic: %02x %02x %02x %02x", b[0], b[1], b[2],
		      b[3]);
	ck_assert_int_eq(b[4], 2);		     /* ELFCLASS64 */
	ck_assert_int_eq(b[18] | (b[19] << 8), 190); /* e_machine: EM_CUDA */
	ck_assert_msg(memmem(b, r->size, kernel, strlen(kernel)) != NULL,
		      "kernel %s not in the cubin", kernel);
}

START_TEST(test_nvrtc_cubin)
{
	epj_ctx *ctx = tu_ctx();
	const char *archs[] = { "sm_80", "sm_90" };
	for (size_t i = 0; i < EJ_ARRAY_LEN(archs); i++) {
		ej_nvrtc_result r;
		epj_status st = ej_nvrtc_compile(ctx, axpy_src, "axpy",
						 archs[i], NULL, 0, &r);
		ck_assert_msg(st == EPJ_OK, "%s: %s", archs[i],
			      epj_ctx_error(ctx));
		assert_cubin(&r, "epj_axpy");
		ck_assert_str_eq(r.target, archs[i]);
		ck_assert_ptr_nonnull(r.log);
		ck_assert_msg(!ej_nvrtc_log_has_warning(r.log),
			      "%s: warnings:\n%s", archs[i], r.log);
		ej_nvrtc_result_free(&r);
		ck_assert_ptr_null(r.image);
	}
	/* Extra options pass through. */
	const char *opts[] = { "-lineinfo", "--std=c++17" };
	ej_nvrtc_result r;
	ck_assert_msg(ej_nvrtc_compile(ctx, axpy_src, "axpy", "sm_90", opts, 2,
				       &r) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	assert_cubin(&r, "epj_axpy");
	ej_nvrtc_result_free(&r);
	/* A bad option is a compile error naming the failed call. */
	const char *bad[] = { "--no-such-option" };
	ck_assert_int_eq(
	    ej_nvrtc_compile(ctx, axpy_src, "axpy", "sm_90", bad, 1, &r),
	    EPJ_ERR_COMPILE);
	ck_assert_ptr_null(r.image);
	ck_assert_ptr_nonnull(
	    strstr(epj_ctx_error(ctx), "nvrtcCompileProgram"));
	char path[4096];
	if (kept_path(epj_ctx_error(ctx), path, sizeof path)) {
		unlink(path);
		strcpy(path + strlen(path) - 3, ".log");
		unlink(path);
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_nvrtc_warning)
{
	epj_ctx *ctx = tu_ctx();
	static const char src[] =
	    "extern \"C\" __global__ void epj_warn(float *x)\n"
	    "{\n"
	    "\tint unused_var;\n"
	    "\tx[threadIdx.x] += 1.0f;\n"
	    "}\n";
	ej_nvrtc_result r;
	ck_assert_msg(
	    ej_nvrtc_compile(ctx, src, "warn", "sm_90", NULL, 0, &r) == EPJ_OK,
	    "%s", epj_ctx_error(ctx));
	ck_assert_msg(ej_nvrtc_log_has_warning(r.log),
		      "warning not detected in:\n%s", r.log);
	ck_assert_ptr_nonnull(strstr(r.log, "unused_var"));
	ej_nvrtc_result_free(&r);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_nvrtc_syntax_error)
{
	epj_ctx *ctx = tu_ctx();
	/* A missing ';' on line 3, and a random constant so every run's source
	 * differs (the kept file must hold exactly this text). */
	char src[512];
	snprintf(src, sizeof src,
		 "extern \"C\" __global__ void epj_bad(float *x)\n"
		 "{\n"
		 "\tx[threadIdx.x] += %.9gf\n"
		 "}\n",
		 tu_uniform(0.5, 2.0));
	ej_nvrtc_result r;
	epj_status st =
	    ej_nvrtc_compile(ctx, src, "bad kernel/1", "sm_90", NULL, 0, &r);
	ck_assert_int_eq(st, EPJ_ERR_COMPILE);
	ck_assert_ptr_null(r.image);
	ck_assert_ptr_null(r.log);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "error: expected a \";\"") != NULL,
		      "no NVRTC error text in: %s", msg);
	ck_assert_msg(strstr(msg, "nvrtcCompileProgram(") != NULL &&
			  strstr(msg, "nvrtc.c:") != NULL &&
			  strstr(msg, "NVRTC_ERROR_COMPILATION") != NULL &&
			  strstr(msg, "bad kernel/1") != NULL &&
			  strstr(msg, "sm_90") != NULL,
		      "statement, file:line, error, name or arch missing: %s",
		      msg);
	char path[4096];
	ck_assert_msg(kept_path(msg, path, sizeof path), "no path in: %s", msg);
	ck_assert_msg(strstr(path, "epjit-nvrtc-") != NULL &&
			  strstr(path, "/") != NULL &&
			  strstr(path, "bad_kernel_1.cu") != NULL,
		      "path %s", path);
	struct stat sb;
	ck_assert_int_eq(stat(path, &sb), 0);
	ck_assert_int_eq(sb.st_mode & 077, 0); /* private */
	char *kept = tu_slurp(path, NULL);
	ck_assert_ptr_nonnull(kept);
	ck_assert_str_eq(kept, src);
	free(kept);
	unlink(path);
	/* The full log sits next to it. */
	strcpy(path + strlen(path) - 3, ".log");
	char *log = tu_slurp(path, NULL);
	ck_assert_ptr_nonnull(log);
	ck_assert_ptr_nonnull(strstr(log, "expected a \";\""));
	free(log);
	unlink(path);
	epj_ctx_free(ctx);
}
END_TEST

/* Archs NVRTC does not know: newer -> PTX for the newest compute_XX (the
 * documented fallback); older or in a gap -> EPJ_ERR_UNSUPPORTED; junk ->
 * EPJ_ERR_INVALID.  Never a crash. */
START_TEST(test_nvrtc_arch_fallback)
{
	epj_ctx *ctx = tu_ctx();
	ej_nvrtc_result r;
	ck_assert_msg(ej_nvrtc_compile(ctx, axpy_src, "axpy", "sm_200", NULL, 0,
				       &r) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert(r.is_ptx);
	ck_assert_uint_gt(r.size, 1);
	const char *ptx = r.image;
	ck_assert_int_eq(ptx[r.size - 1], '\0');
	ck_assert_uint_eq(strlen(ptx), r.size - 1);
	ck_assert_ptr_nonnull(strstr(ptx, ".entry epj_axpy"));
	ck_assert_msg(strncmp(r.target, "compute_", 8) == 0, "target %s",
		      r.target);
	char want[32];
	snprintf(want, sizeof want, ".target sm_%s", r.target + 8);
	ck_assert_msg(strstr(ptx, want) != NULL, "no '%s' in the PTX", want);
	ck_assert_msg(strstr(r.log, "sm_200") && strstr(r.log, "PTX") &&
			  strstr(r.log, r.target),
		      "fallback not in the log: %s", r.log);
	ck_assert(!ej_nvrtc_log_has_warning(r.log));
	ej_nvrtc_result_free(&r);

	ck_assert_int_eq(
	    ej_nvrtc_compile(ctx, axpy_src, "axpy", "sm_35", NULL, 0, &r),
	    EPJ_ERR_UNSUPPORTED);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "sm_35"));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "sm_90"));
	ck_assert_int_eq(
	    ej_nvrtc_compile(ctx, axpy_src, "axpy", "sm_85", NULL, 0, &r),
	    EPJ_ERR_UNSUPPORTED);
	const char *junk[] = { "compute_90", "sm90",   "sm_9",	 "sm_090",
			       "",	     "sm_90x", "sm_1000" };
	for (size_t i = 0; i < EJ_ARRAY_LEN(junk); i++) {
		ck_assert_msg(ej_nvrtc_compile(ctx, axpy_src, "axpy", junk[i],
					       NULL, 0, &r) == EPJ_ERR_INVALID,
			      "'%s' accepted", junk[i]);
		ck_assert_ptr_null(r.image);
		char q[32];
		snprintf(q, sizeof q, "'%s'", junk[i]);
		ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), q));
	}
	/* An arch-specific name NVRTC supports stays a cubin. */
	ck_assert_msg(ej_nvrtc_compile(ctx, axpy_src, "axpy", "sm_90a", NULL, 0,
				       &r) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	assert_cubin(&r, "epj_axpy");
	ck_assert_str_eq(r.target, "sm_90a");
	ej_nvrtc_result_free(&r);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_nvrtc_identity)
{
	int major = -1, minor = -1;
	ck_assert(ej_nvrtc_version(&major, &minor));
	ck_assert_int_ge(major, 11);
	ck_assert_int_ge(minor, 0);
	char want[32];
	snprintf(want, sizeof want, "nvrtc %d.%d", major, minor);
	ck_assert_str_eq(ej_nvrtc_identity(), want);
}
END_TEST

#else /* !HAVE_NVRTC */

/* Without NVRTC the tests are no-ops that say so; the compile itself must
 * still fail cleanly. */
static void no_nvrtc(void)
{
	epj_ctx *ctx = tu_ctx();
	ej_nvrtc_result r;
	ck_assert_int_eq(
	    ej_nvrtc_compile(ctx, axpy_src, "axpy", "sm_90", NULL, 0, &r),
	    EPJ_ERR_UNSUPPORTED);
	ck_assert_ptr_nonnull(
	    strstr(epj_ctx_error(ctx), "built without NVRTC"));
	ck_assert_ptr_null(r.image);
	int major, minor;
	ck_assert(!ej_nvrtc_version(&major, &minor));
	ck_assert_str_eq(ej_nvrtc_identity(), "nvrtc none");
	epj_ctx_free(ctx);
	printf("check_cc: skipped: no NVRTC\n");
}

START_TEST(test_nvrtc_cubin)
{
	no_nvrtc();
}
END_TEST

START_TEST(test_nvrtc_warning)
{
	no_nvrtc();
}
END_TEST

START_TEST(test_nvrtc_syntax_error)
{
	no_nvrtc();
}
END_TEST

START_TEST(test_nvrtc_arch_fallback)
{
	no_nvrtc();
}
END_TEST

START_TEST(test_nvrtc_identity)
{
	no_nvrtc();
}
END_TEST

#endif /* HAVE_NVRTC */

START_TEST(test_nvrtc_log_warning_text)
{
	ck_assert(!ej_nvrtc_log_has_warning(NULL));
	ck_assert(!ej_nvrtc_log_has_warning(""));
	ck_assert(!ej_nvrtc_log_has_warning("note: sm_200 is newer; PTX\n"));
	ck_assert(!ej_nvrtc_log_has_warning("k.cu(1): error: expected\n"));
	ck_assert(ej_nvrtc_log_has_warning(
	    "k.cu(3): warning #177-D: variable \"v\" was declared\n"));
	ck_assert(ej_nvrtc_log_has_warning("\nwarning: something\n"));
	/* A kernel or file named "warning" is not a warning. */
	ck_assert(!ej_nvrtc_log_has_warning("warning_k.cu(2): error: x\n"
					    "  void nowarning(): x\n"));
	ck_assert(!ej_nvrtc_log_has_warning(
	    "k.cu(2): error: warning_count undeclared\n"));
}
END_TEST

/* ---- arch list ----------------------------------------------------------- */

START_TEST(test_cuda_archs)
{
	epj_ctx *ctx = tu_ctx();
	char a[4][EJ_CUDA_ARCH_MAX];
	saved_env env = env_set("EPJIT_CUDA_ARCH", NULL);
	ck_assert_int_eq(ej_cuda_archs(ctx, a, 4), 2);
	ck_assert_str_eq(a[0], "sm_80");
	ck_assert_str_eq(a[1], "sm_90");
	setenv("EPJIT_CUDA_ARCH", "  ", 1); /* blank = unset */
	ck_assert_int_eq(ej_cuda_archs(ctx, a, 4), 2);
	setenv("EPJIT_CUDA_ARCH", " sm_90a , sm_100,sm_90a,sm_86 ", 1);
	ck_assert_int_eq(ej_cuda_archs(ctx, a, 4), 3);
	ck_assert_str_eq(a[0], "sm_90a");
	ck_assert_str_eq(a[1], "sm_100");
	ck_assert_str_eq(a[2], "sm_86");
	setenv("EPJIT_CUDA_ARCH", "sm_80,bogus", 1);
	ck_assert_int_eq(ej_cuda_archs(ctx, a, 4), -1);
	ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_CONFIG);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "EPJIT_CUDA_ARCH"));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "'bogus'"));
	env_restore(env);

	const char *bad[] = { "sm_80,,sm_90", "sm_80,",
			      ",sm_80",	      "90",
			      "sm_80 sm_90",  "compute_80",
			      "sm_8",	      "sm_80,sm_123456789012345" };
	for (size_t i = 0; i < EJ_ARRAY_LEN(bad); i++) {
		epj_ctx_clear_error(ctx);
		ck_assert_msg(ej_cuda_archs_parse(ctx, "archs", bad[i], a, 4) ==
				  -1,
			      "'%s' accepted", bad[i]);
		ck_assert_int_eq(epj_ctx_status(ctx), EPJ_ERR_CONFIG);
		ck_assert_msg(strstr(epj_ctx_error(ctx), bad[i]) != NULL,
			      "value missing: %s", epj_ctx_error(ctx));
	}
	ck_assert_int_eq(ej_cuda_archs_parse(ctx, "archs", "", a, 4), -1);
	ck_assert_int_eq(
	    ej_cuda_archs_parse(ctx, "archs", "sm_80,sm_86,sm_89", a, 2), -1);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "more than 2"));
	ck_assert_int_eq(ej_cuda_archs_parse(ctx, "archs", "sm_120f", a, 1), 1);
	ck_assert_str_eq(a[0], "sm_120f");
	epj_ctx_free(ctx);
}
END_TEST

/* ---- host cc ------------------------------------------------------------- */

START_TEST(test_hostcc_compile_load)
{
	epj_ctx *ctx = tu_ctx();
	/* f(x) = a*x*x + sin(x) (libm) + b; g(n) = sum_{i<n} i*a with an
	 * OpenMP reduction; the source refuses to build without -std=c11
	 * -fopenmp.  a and b are fresh per run. */
	double a = tu_uniform(-3.0, 3.0), b = tu_uniform(1.0, 2.0);
	char src[1024];
	snprintf(src, sizeof src,
		 "#if !defined(_OPENMP) || __STDC_VERSION__ != 201112L\n"
		 "#error not compiled with -std=c11 -fopenmp\n"
		 "#endif\n"
		 "#include <math.h>\n"
		 "double f(double x) { return %.17g * x * x + sin(x) + %.17g; "
		 "}\n"
		 "double g(int n)\n"
		 "{\n"
		 "\tdouble s = 0;\n"
		 "#pragma omp parallel for reduction(+ : s)\n"
		 "\tfor (int i = 0; i < n; i++)\n"
		 "\t\ts += i * %.17g;\n"
		 "\treturn s;\n"
		 "}\n",
		 a, b, a);
	void *img = NULL;
	size_t size = 0;
	char *log = NULL;
	epj_status st = ej_hostcc_compile(ctx, src, "f", &img, &size, &log);
	ck_assert_msg(st == EPJ_OK, "%s", epj_ctx_error(ctx));
	ck_assert_ptr_nonnull(log);
	ck_assert_uint_gt(size, 64);
	ck_assert(memcmp(img,
			 "\x7f"
			 "ELF",
			 4) == 0);

	/* Two loads of one image are two objects; both work. */
	void *h1 = NULL, *h2 = NULL;
	ck_assert_msg(ej_hostcc_load(ctx, img, size, "f", &h1) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_msg(ej_hostcc_load(ctx, img, size, "f", &h2) == EPJ_OK, "%s",
		      epj_ctx_error(ctx));
	ck_assert_ptr_ne(h1, h2);
	double (*f)(double) = (double (*)(double))ej_hostcc_sym(h1, "f");
	double (*g)(int) = (double (*)(int))ej_hostcc_sym(h2, "g");
	ck_assert_ptr_nonnull(f);
	ck_assert_ptr_nonnull(g);
	ck_assert_ptr_null(ej_hostcc_sym(h1, "no_such_symbol"));
	for (int k = 0; k < 5; k++) {
		double x = tu_uniform(-4.0, 4.0);
		double want = a * x * x + sin(x) + b;
		ck_assert_msg(fabs(f(x) - want) <= 1e-12 * (1 + fabs(want)),
			      "f(%g) = %.17g, want %.17g", x, f(x), want);
	}
	int n = (int)tu_randint(1000, 5000);
	double want = a * (double)n * (n - 1) / 2;
	ck_assert_msg(fabs(g(n) - want) <= 1e-9 * (1 + fabs(want)),
		      "g(%d) = %.17g, want %.17g", n, g(n), want);
	/* One OpenMP runtime in the process: the library's own (the module
	 * with its parallel loop was linked against it, not -fopenmp's). */
	omp_count oc = { 0 };
	dl_iterate_phdr(count_omp, &oc);
	const char *rt = ej_hostcc_openmp_runtime();
	ck_assert_msg(oc.n == (rt ? 1 : 0),
		      "%d OpenMP runtimes loaded (%s%s%s), library's: %s", oc.n,
		      oc.names[0], oc.n > 1 ? ", " : "",
		      oc.n > 1 ? oc.names[1] : "", rt ? rt : "none");
	if (rt)
		ck_assert_ptr_nonnull(strstr(ej_hostcc_identity(), rt));
	ej_hostcc_unload(h1);
	ej_hostcc_unload(h2);
	ej_hostcc_unload(NULL);
	free(img);
	free(log);

	/* Garbage bytes do not load; the message has dlopen's reason. */
	void *h = (void *)1;
	char junk[256];
	for (size_t i = 0; i < sizeof junk; i++)
		junk[i] = (char)tu_randint(0, 256);
	ck_assert_int_eq(ej_hostcc_load(ctx, junk, sizeof junk, "junk", &h),
			 EPJ_ERR_BACKEND);
	ck_assert_ptr_null(h);
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "dlopen("));
	ck_assert_ptr_nonnull(strstr(epj_ctx_error(ctx), "'junk'"));
	epj_ctx_free(ctx);
}
END_TEST

/* A group-writable umask (002: a shared-group setup, or a tree unpacked
 * that way) or none at all (000) changes nothing: what the compiler writes
 * in the private directory is ours alone, so the module passes its checks
 * and loads. */
START_TEST(test_hostcc_umask)
{
	epj_ctx *ctx = tu_ctx();
	const mode_t masks[] = { 002, 000 };
	for (size_t i = 0; i < EJ_ARRAY_LEN(masks); i++) {
		mode_t old = umask(masks[i]);
		void *img = NULL, *h = NULL;
		size_t n = 0;
		epj_status st = ej_hostcc_compile(
		    ctx, "int f(int x) { return 3 * x + 1; }\n", "f", &img, &n,
		    NULL);
		umask(old);
		ck_assert_msg(st == EPJ_OK, "umask %03o: %s",
			      (unsigned)masks[i], epj_ctx_error(ctx));
		ck_assert_msg(ej_hostcc_load(ctx, img, n, "f", &h) == EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		int (*f)(int) = NULL;
		*(void **)&f = ej_hostcc_sym(h, "f");
		ck_assert_ptr_nonnull(f);
		ck_assert_int_eq(f(4), 13);
		ej_hostcc_unload(h);
		free(img);
	}
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_hostcc_compile_error)
{
	epj_ctx *ctx = tu_ctx();
	char src[256];
	snprintf(src, sizeof src,
		 "double f(double x) { return x * undeclared_thing_%d; }\n",
		 (int)tu_randint(0, 1000000));
	void *img = (void *)1;
	size_t size = 7;
	char *log = NULL;
	epj_status st =
	    ej_hostcc_compile(ctx, src, "broken", &img, &size, &log);
	ck_assert_int_eq(st, EPJ_ERR_COMPILE);
	ck_assert_ptr_null(img);
	ck_assert_uint_eq(size, 0);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "undeclared_thing_") != NULL &&
			  strstr(msg, "error") != NULL &&
			  strstr(msg, "exit status") != NULL &&
			  strstr(msg, "'broken'") != NULL,
		      "compiler message missing: %s", msg);
	ck_assert_ptr_nonnull(log);
	ck_assert_ptr_nonnull(strstr(log, "undeclared_thing_"));
	char path[4096];
	ck_assert_msg(kept_path(msg, path, sizeof path), "no path in: %s", msg);
	/* named so that the sweep of dead processes' directories keeps it */
	char want[64];
	snprintf(want, sizeof want, "/epjit-cc-kept-%d.", (int)getpid());
	ck_assert_msg(strstr(path, want) != NULL, "%s lacks %s", path, want);
	char *kept = tu_slurp(path, NULL);
	ck_assert_ptr_nonnull(kept);
	ck_assert_str_eq(kept, src);
	free(kept);
	unlink(path);
	*strrchr(path, '/') = '\0'; /* the private directory */
	ck_assert_int_eq(rmdir(path), 0);
	free(log);

	/* Also without asking for the log. */
	st = ej_hostcc_compile(ctx, src, "broken", &img, &size, NULL);
	ck_assert_int_eq(st, EPJ_ERR_COMPILE);
	ck_assert(kept_path(epj_ctx_error(ctx), path, sizeof path));
	unlink(path);
	*strrchr(path, '/') = '\0';
	ck_assert_int_eq(rmdir(path), 0);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_hostcc_missing_compiler)
{
	epj_ctx *ctx = tu_ctx();
	const char *id_default = ej_hostcc_identity();
	saved_env env = env_set("EPJIT_CC", "/nonexistent/epjit-cc");
	void *img = NULL;
	size_t size = 0;
	char *log = NULL;
	epj_status st =
	    ej_hostcc_compile(ctx, "int x;\n", "x", &img, &size, &log);
	ck_assert_int_eq(st, EPJ_ERR_COMPILE);
	ck_assert_ptr_null(img);
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "/nonexistent/epjit-cc") != NULL &&
			  strstr(msg, "EPJIT_CC") != NULL &&
			  strstr(msg, strerror(ENOENT)) != NULL,
		      "%s", msg);
	free(log);
	/* A bare name is searched in PATH. */
	setenv("EPJIT_CC", "epjit-no-such-cc --flag", 1);
	st = ej_hostcc_compile(ctx, "int x;\n", "x", &img, &size, NULL);
	ck_assert_int_eq(st, EPJ_ERR_COMPILE);
	ck_assert_msg(strstr(epj_ctx_error(ctx), "'epjit-no-such-cc'") != NULL,
		      "%s", epj_ctx_error(ctx));
	setenv("EPJIT_CC", "/nonexistent/epjit-cc", 1);
	/* The identity follows EPJIT_CC and says the compiler is missing. */
	const char *id = ej_hostcc_identity();
	ck_assert_ptr_nonnull(strstr(id, "/nonexistent/epjit-cc"));
	ck_assert_ptr_nonnull(strstr(id, "cannot run"));
	ck_assert_str_ne(id, id_default);
	env_restore(env);
	ck_assert_str_eq(ej_hostcc_identity(), id_default);
	epj_ctx_free(ctx);
}
END_TEST

START_TEST(test_hostcc_identity)
{
	const char *id = ej_hostcc_identity();
	ck_assert_ptr_nonnull(id);
	ck_assert_uint_gt(strlen(id), 10);
	ck_assert_ptr_nonnull(strstr(id, EJ_HOSTCC_FLAGS));
	ck_assert_ptr_nonnull(strstr(id, "-O3"));
	ck_assert_ptr_null(strstr(id, "cannot run"));
	ck_assert_ptr_null(strchr(id, '\n'));
	char *copy = strdup(id);
	ck_assert_str_eq(ej_hostcc_identity(), copy);
	ck_assert_ptr_eq(ej_hostcc_identity(), id);
	free(copy);
}
END_TEST

/* The instruction set of generated C: auto picks a level this CPU runs,
 * the level is in the flags, the identity and so the cache key, a module
 * built for it runs, and a bad or unrunnable level is refused. */
START_TEST(test_hostcc_isa)
{
	epj_ctx *ctx = tu_ctx();
	char *saved =
	    getenv("EPJIT_CC_ISA") ? strdup(getenv("EPJIT_CC_ISA")) : NULL;
	unsetenv("EPJIT_CC_ISA");
	const char *isa = ej_hostcc_isa();
	ck_assert_ptr_nonnull(isa);
	const char *flags = ej_hostcc_cflags();
	char want[64];
	snprintf(want, sizeof want, " -march=%s", isa);
	if (strcmp(isa, "baseline") == 0)
		ck_assert_ptr_null(strstr(flags, "-march"));
	else
		ck_assert_msg(strstr(flags, want), "%s lacks %s", flags, want);
	ck_assert_ptr_nonnull(strstr(ej_hostcc_identity(), flags));
#if defined(__x86_64__)
	/* every x86-64 machine this project targets has AVX2 and FMA */
	if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
	    __builtin_cpu_supports("bmi2"))
		ck_assert_msg(strcmp(isa, "x86-64-v3") == 0 ||
				  strcmp(isa, "x86-64-v4") == 0,
			      "auto picked %s on an AVX2 machine", isa);
#endif
	char key_auto[65], key_base[65];
	const char *src = "double f(double x) { return x * 3.0 + 1.0; }\n";
	ej_backend_c_key(src, key_auto);
	/* a module built for the level runs */
	void *img = NULL;
	size_t size = 0;
	const char *fsrc = "void f(const float *a, float *o, int n)\n"
			   "{ for (int i = 0; i < n; i++) o[i] = a[i] * a[i] "
			   "+ 0.5f; }\n";
	ck_assert_msg(ej_hostcc_compile(ctx, fsrc, "isa", &img, &size, NULL) ==
			  EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	free(img);

	setenv("EPJIT_CC_ISA", "baseline", 1);
	ck_assert_str_eq(ej_hostcc_isa(), "baseline");
	ck_assert_ptr_null(strstr(ej_hostcc_cflags(), "-march"));
	ck_assert_ptr_null(strstr(ej_hostcc_identity(), "-march"));
	ej_backend_c_key(src, key_base);
	if (strcmp(isa, "baseline") != 0)
		ck_assert_str_ne(key_auto, key_base);

	/* native: the key says which CPU (a hash of its model and features),
	 * not the literal -march=native that means another ISA elsewhere */
	setenv("EPJIT_CC_ISA", "native", 1);
	ck_assert_str_eq(ej_hostcc_isa(), "native");
	const char *nf = strstr(ej_hostcc_cflags(), "-DEJ_NATIVE_CPU=0x");
	ck_assert_msg(nf != NULL, "%s", ej_hostcc_cflags());
	if (tu_exists("/proc/cpuinfo"))
		ck_assert_msg(strncmp(nf + 18, "0000000000000000", 16) != 0,
			      "no CPU fingerprint: %s", ej_hostcc_cflags());
	char key_native[65];
	ej_backend_c_key(src, key_native);
	ck_assert_str_ne(key_native, key_base);

	setenv("EPJIT_CC_ISA", "pentium9", 1);
	ck_assert_ptr_null(ej_hostcc_isa());
	epj_status st = ej_hostcc_compile(ctx, fsrc, "isa", &img, &size, NULL);
	ck_assert_int_eq(st, EPJ_ERR_INVALID);
	tu_assert_ctx_error(
	    ctx, EPJ_ERR_INVALID,
	    (const char *const[]){ "EPJIT_CC_ISA", "pentium9", "x86-64-v3" },
	    3);
#if defined(__x86_64__)
	if (!__builtin_cpu_supports("avx512f")) {
		setenv("EPJIT_CC_ISA", "x86-64-v4", 1);
		st = ej_hostcc_compile(ctx, fsrc, "isa", &img, &size, NULL);
		ck_assert_int_eq(st, EPJ_ERR_UNSUPPORTED);
		tu_assert_ctx_error(ctx, EPJ_ERR_UNSUPPORTED,
				    (const char *const[]){ "cannot run" }, 1);
	}
#endif
	if (saved)
		setenv("EPJIT_CC_ISA", saved, 1);
	else
		unsetenv("EPJIT_CC_ISA");
	free(saved);
	ck_assert_str_eq(ej_hostcc_isa(), isa);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- compiles that do not end ------------------------------------------
 *
 * A compiler that leaves a child holding its output pipe (a daemon, a
 * wrapper's background job) must not hang the compile: the run ends when
 * the compiler exits and the child, in the compiler's process group, is
 * killed.  A compiler that never ends is killed at EPJIT_CC_TIMEOUT and the
 * compile fails naming the timeout.  The bounds on the clock are only there
 * to fail instead of hanging (the child sleeps 300 s). */

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static bool pid_gone(pid_t pid)
{
	/* gone, or a zombie waiting for whoever adopted it */
	for (int i = 0; i < 600; i++) {
		char p[64], st[512];
		snprintf(p, sizeof p, "/proc/%d/stat", (int)pid);
		FILE *f = fopen(p, "r");
		if (!f)
			return true;
		size_t n = fread(st, 1, sizeof st - 1, f);
		fclose(f);
		st[n] = '\0';
		const char *rp = strrchr(st, ')');
		if (rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X'))
			return true;
		usleep(100000);
	}
	return false;
}

START_TEST(test_hostcc_child_and_timeout)
{
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("ccwait");
	char *pidfile = tu_path(dir, "child.pid");
	char *lingers = tu_path(dir, "lingers.sh");
	char *stalls = tu_path(dir, "stalls.sh");
	char text[8192];
	snprintf(text, sizeof text,
		 "#!/bin/sh\n"
		 "sleep 300 &\n"
		 "echo $! > '%s'\n"
		 "exec cc \"$@\"\n",
		 pidfile);
	tu_write_text(lingers, text);
	tu_write_text(stalls,
		      "#!/bin/sh\n"
		      "case \"$1\" in --version) exec cc \"$@\";; esac\n"
		      "sleep 300\n");
	ck_assert_int_eq(chmod(lingers, 0755), 0);
	ck_assert_int_eq(chmod(stalls, 0755), 0);
	int k = (int)tu_randint(2, 1000);
	char src[128];
	snprintf(src, sizeof src, "int f(int x) { return %d * x; }\n", k);

	saved_env cc = env_set("EPJIT_CC", lingers);
	double t0 = now_s();
	void *img = NULL;
	size_t n = 0;
	ck_assert_msg(ej_hostcc_compile(ctx, src, "f", &img, &n, NULL) ==
			  EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	double dt = now_s() - t0;
	ck_assert_msg(dt < 120, "the compile waited %.0f s for the child", dt);
	void *m = NULL;
	ck_assert_int_eq(ej_hostcc_load(ctx, img, n, "f", &m), EPJ_OK);
	int (*f)(int) = (int (*)(int))ej_hostcc_sym(m, "f");
	ck_assert_ptr_nonnull(f);
	ck_assert_int_eq(f(3), 3 * k);
	ej_hostcc_unload(m);
	free(img);
	char *pid_text = tu_slurp(pidfile, NULL);
	ck_assert_ptr_nonnull(pid_text);
	pid_t child = (pid_t)atoi(pid_text);
	free(pid_text);
	ck_assert_int_gt(child, 1);
	ck_assert_msg(pid_gone(child), "the compiler's child %d lives on",
		      (int)child);
	env_restore(cc);

	cc = env_set("EPJIT_CC", stalls);
	saved_env to = env_set("EPJIT_CC_TIMEOUT", "2");
	t0 = now_s();
	img = NULL;
	ck_assert_int_eq(ej_hostcc_compile(ctx, src, "f", &img, &n, NULL),
			 EPJ_ERR_COMPILE);
	dt = now_s() - t0;
	const char *msg = epj_ctx_error(ctx);
	ck_assert_msg(strstr(msg, "EPJIT_CC_TIMEOUT") &&
			  strstr(msg, "longer than 2 s"),
		      "%s", msg);
	ck_assert_msg(dt < 120, "the timeout took %.0f s", dt);
	ck_assert_ptr_null(img);
	env_restore(to);
	env_restore(cc);
	free(pidfile);
	free(lingers);
	free(stalls);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- what a killed process leaves -----------------------------------------
 *
 * A process killed with SIGKILL while it compiles takes its compiler with it
 * (PR_SET_PDEATHSIG on the process the compile starts), and its build
 * directory, $TMPDIR/epjit-cc-<pid>.<host>-XXXXXX, is removed by the next
 * compile or kernel-cache open once the pid is dead and nobody holds the
 * directory's lock (its maker holds it while it lives), without following
 * any symbolic link in it. */

/* The host tag of build directory names (ej_host_tag). */
static const char *host_tag(void)
{
	return ej_host_tag();
}

/* A pid that is certainly dead: a child that has exited and was reaped. */
static pid_t dead_pid(void)
{
	fflush(NULL);
	pid_t p = fork();
	ck_assert_int_ge(p, 0);
	if (p == 0)
		_exit(0);
	ck_assert_int_eq(waitpid(p, NULL, 0), p);
	return p;
}

/* mkdir dir/name (0700); its path, malloc'ed. */
static char *mkdir_in(const char *dir, const char *name)
{
	char *p = tu_path(dir, name);
	ck_assert_msg(mkdir(p, 0700) == 0, "mkdir %s: %s", p, strerror(errno));
	return p;
}

/* Sets the mtime (and atime) of path, not following a link, to `age`
 * seconds ago. */
static void age_path(const char *path, int age)
{
	struct timespec ts[2];
	clock_gettime(CLOCK_REALTIME, &ts[0]);
	ts[0].tv_sec -= age;
	ts[1] = ts[0];
	ck_assert_int_eq(utimensat(AT_FDCWD, path, ts, AT_SYMLINK_NOFOLLOW), 0);
}

START_TEST(test_hostcc_stale_dirs)
{
	epj_ctx *ctx = tu_ctx();
	char *t = tu_tmpdir_new("ccstale");
	char *out = tu_tmpdir_new("ccout");
	char *target = tu_path(out, "precious");
	tu_write_text(target, "keep me\n");
	char *keep_dir = mkdir_in(out, "dir");
	char *keep_file = tu_path(keep_dir, "inside");
	tu_write_text(keep_file, "keep me too\n");
	pid_t dead = dead_pid();
	char name[256];

	/* the build directory of a dead process: files, a subdirectory and
	 * symbolic links to what lies outside */
	snprintf(name, sizeof name, "epjit-cc-%d.%s-Ab1Cd2", (int)dead,
		 host_tag());
	char *stale = mkdir_in(t, name);
	char *p = tu_path(stale, "g.c");
	tu_write_text(p, "int x;\n");
	free(p);
	p = tu_path(stale, "g.o");
	tu_write_text(p, "obj");
	free(p);
	char *sub = mkdir_in(stale, "ccAbCdEf");
	p = tu_path(sub, "cc1.s");
	tu_write_text(p, "asm");
	free(p);
	p = tu_path(stale, "link");
	ck_assert_int_eq(symlink(target, p), 0);
	free(p);
	p = tu_path(stale, "dirlink");
	ck_assert_int_eq(symlink(keep_dir, p), 0);
	free(p);
	age_path(sub, 3600);
	age_path(stale, 3600);

	/* a young one (made a moment ago) of a dead process and nobody's
	 * lock: gone too, as are the other kinds of private directory */
	const char *young_fmt[] = { "epjit-cc-%d.%s-Yo1ung",
				    "epjit-so-%d.%s-Yo2ung",
				    "epjit-kcache-%d.%s-Yo3ung" };
	char *young[3];
	for (int i = 0; i < 3; i++) {
		snprintf(name, sizeof name, young_fmt[i], (int)dead,
			 host_tag());
		young[i] = mkdir_in(t, name);
		p = tu_path(young[i], "g.c");
		tu_write_text(p, "int x;\n");
		free(p);
	}

	/* what stays: a live pid, another host, a directory whose lock a
	 * live process holds (its maker, seen from another pid namespace),
	 * a kept one, another name, and a symbolic link in the pattern */
	const char *stay_fmt[] = { "epjit-cc-%d.%s-Li1ve2",
				   "epjit-cc-%d.0badc0de-Ot1her",
				   "epjit-cc-%d.%s-Lo1ckd",
				   "epjit-cc-kept-%d.%s-Ke1pt2",
				   "epjit-other-%d.%s-Na1me2" };
	const int stay_pid[] = { (int)getpid(), (int)dead, (int)dead, (int)dead,
				 (int)dead };
	char *stay[6];
	for (int i = 0; i < 5; i++) {
		if (i == 1)
			snprintf(name, sizeof name, stay_fmt[i], stay_pid[i]);
		else
			snprintf(name, sizeof name, stay_fmt[i], stay_pid[i],
				 host_tag());
		stay[i] = mkdir_in(t, name);
		p = tu_path(stay[i], "g.c");
		tu_write_text(p, "int x;\n");
		free(p);
		age_path(stay[i], 3600);
	}
	int held = open(stay[2], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	ck_assert_int_ge(held, 0);
	ck_assert_int_eq(flock(held, LOCK_EX | LOCK_NB), 0);
	snprintf(name, sizeof name, "epjit-cc-%d.%s-Sy1mln", (int)dead,
		 host_tag());
	stay[5] = tu_path(t, name);
	ck_assert_int_eq(symlink(keep_dir, stay[5]), 0);
	age_path(stay[5], 3600);

	saved_env env = env_set("TMPDIR", t);
	void *img = NULL;
	size_t n = 0;
	ck_assert_msg(ej_hostcc_compile(ctx, "int f(int x) { return x + 1; }\n",
					"f", &img, &n, NULL) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	free(img);
	env_restore(env);

	ck_assert_msg(!tu_exists(stale), "%s was not removed", stale);
	for (int i = 0; i < 3; i++) {
		ck_assert_msg(!tu_exists(young[i]), "%s was not removed",
			      young[i]);
		free(young[i]);
	}
	close(held);
	for (int i = 0; i < 6; i++) {
		struct stat st;
		ck_assert_msg(lstat(stay[i], &st) == 0, "%s was removed",
			      stay[i]);
	}
	ck_assert_int_eq(tu_dir_count(t), 6); /* the compile's own went too */
	char *text = tu_slurp(target, NULL);
	ck_assert_ptr_nonnull(text);
	ck_assert_str_eq(text, "keep me\n");
	free(text);
	text = tu_slurp(keep_file, NULL);
	ck_assert_ptr_nonnull(text);
	ck_assert_str_eq(text, "keep me too\n");
	free(text);

	for (int i = 0; i < 6; i++)
		free(stay[i]);
	free(sub);
	free(stale);
	free(keep_file);
	free(keep_dir);
	free(target);
	tu_tmpdir_free(out);
	tu_tmpdir_free(t);
	epj_ctx_free(ctx);
}
END_TEST

/* Entries of dir whose name starts with prefix. */
static int count_prefixed(const char *dir, const char *prefix)
{
	DIR *d = opendir(dir);
	ck_assert_ptr_nonnull(d);
	int n = 0;
	struct dirent *de;
	while ((de = readdir(d)))
		n += !strncmp(de->d_name, prefix, strlen(prefix));
	closedir(d);
	return n;
}

START_TEST(test_hostcc_killed_compiler)
{
	char *t = tu_tmpdir_new("cckill");
	char *pidfile = tu_path(t, "cc.pid");
	char *slow = tu_path(t, "slowcc.sh");
	char text[8192];
	/* the compiler (this very process: exec) writes its pid and sleeps */
	snprintf(text, sizeof text,
		 "#!/bin/sh\n"
		 "case \"$1\" in --version) exec cc \"$@\";; esac\n"
		 "echo $$ > '%s.tmp' && mv '%s.tmp' '%s'\n"
		 "exec sleep 300\n",
		 pidfile, pidfile, pidfile);
	tu_write_text(slow, text);
	ck_assert_int_eq(chmod(slow, 0755), 0);
	fflush(NULL);
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0) {
		setenv("EPJIT_CC", slow, 1);
		setenv("TMPDIR", t, 1);
		epj_ctx *cx = NULL;
		if (epj_ctx_new("cpu", &cx) != EPJ_OK)
			_exit(2);
		void *img = NULL;
		size_t n = 0;
		ej_hostcc_compile(cx, "int x;\n", "x", &img, &n, NULL);
		_exit(3); /* not reached: killed first */
	}
	/* wait (up to 60 s) for the compiler to start */
	char *pid_text = NULL;
	for (int i = 0; i < 600 && !pid_text; i++) {
		pid_text = tu_slurp(pidfile, NULL);
		if (!pid_text)
			usleep(100000);
	}
	ck_assert_msg(pid_text != NULL, "the compiler never started");
	pid_t cc = (pid_t)atoi(pid_text);
	free(pid_text);
	ck_assert_int_gt(cc, 1);
	ck_assert_int_eq(kill(child, SIGKILL), 0);
	int ws;
	ck_assert_int_eq(waitpid(child, &ws, 0), child);
	ck_assert(WIFSIGNALED(ws) && WTERMSIG(ws) == SIGKILL);
	bool gone = pid_gone(cc); /* polls up to 60 s */
	if (!gone)
		kill(cc, SIGKILL); /* do not leave it behind */
	ck_assert_msg(gone, "the compiler %d outlived the killed process %d",
		      (int)cc, (int)child);

	/* its build directory is there, and the next compile, right away,
	 * removes it: the pid is dead and nobody holds its lock */
	char prefix[64];
	snprintf(prefix, sizeof prefix, "epjit-cc-%d.", (int)child);
	ck_assert_int_eq(count_prefixed(t, prefix), 1);
	saved_env env = env_set("TMPDIR", t);
	epj_ctx *ctx = tu_ctx();
	void *img = NULL;
	size_t n = 0;
	ck_assert_msg(ej_hostcc_compile(ctx, "int f(int x) { return x + 1; }\n",
					"f", &img, &n, NULL) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	free(img);
	env_restore(env);
	ck_assert_int_eq(count_prefixed(t, "epjit-cc-"), 0);
	epj_ctx_free(ctx);
	free(pidfile);
	free(slow);
	tu_tmpdir_free(t);
}
END_TEST

/* ---- another user swapping files ----------------------------------------
 *
 * A world-writable directory without the sticky bit (a badly set up TMPDIR):
 * another user may rename or replace anything in it.  A swapper process
 * (uid 65534 when the test runs as root and may change user, else
 * ourselves) replaces regular files it sees there with a module whose
 * constructor leaves a marker file, and as another user renames every
 * directory it sees away, putting its own directory (holding its module as
 * f.so) in its place.  Loading by path from there runs its code;
 * ej_hostcc_compile + ej_hostcc_load must not.
 *
 * The swapper never touches what it made itself: it remembers the inodes
 * it wrote or created (its own uid cannot tell them apart when it could not
 * become another user).  As ourselves it attacks only the old way's files
 * (epjit-so-old-*): our own private build directories are no boundary
 * against our own uid. */

enum { SWAP_MAX_OWN = 4096 };

/* The swapper's loop (never returns).  It writes one byte to report_fd
 * before its first round: '1' if it became another user, '0' if not. */
static void swapper_run(const char *dir, const void *evil, size_t n,
			int report_fd)
{
	static ino_t own[SWAP_MAX_OWN];
	size_t n_own = 0;
	bool other = false;
	if (geteuid() == 0 && setgid(65534) == 0) {
		if (setuid(65534) != 0)
			_exit(3);
		other = true;
	}
	if (write(report_fd, other ? "1" : "0", 1) != 1)
		_exit(6);
	close(report_fd);
	for (unsigned long k = 0;; k++) {
		DIR *d = opendir(dir);
		if (!d)
			_exit(4);
		struct dirent *de;
		while ((de = readdir(d))) {
			const char *nm = de->d_name;
			if (nm[0] == '.' || !strncmp(nm, "swap", 4) ||
			    !strcmp(nm, "PWNED") || !strncmp(nm, "moved", 5))
				continue;
			if (!other && strncmp(nm, "epjit-so-old-", 13))
				continue;
			char p[4096], q[4200];
			snprintf(p, sizeof p, "%s/%s", dir, nm);
			struct stat st;
			if (lstat(p, &st) != 0)
				continue;
			if (other && st.st_uid == geteuid())
				continue;
			bool mine = false;
			for (size_t i = 0; i < n_own && !mine; i++)
				mine = own[i] == st.st_ino;
			if (mine)
				continue;
			if (S_ISREG(st.st_mode)) {
				snprintf(q, sizeof q, "%s/swap.%lu", dir, k);
				int fd =
				    open(q, O_WRONLY | O_CREAT | O_EXCL, 0755);
				if (fd < 0)
					continue;
				ssize_t w = write(fd, evil, n);
				struct stat sq;
				if (fstat(fd, &sq) == 0 && n_own < SWAP_MAX_OWN)
					own[n_own++] = sq.st_ino;
				close(fd);
				if (w == (ssize_t)n)
					rename(q, p);
				unlink(q);
			} else if (S_ISDIR(st.st_mode) && other) {
				snprintf(q, sizeof q, "%s/moved.%lu", dir, k);
				if (rename(p, q) != 0 || mkdir(p, 0777) != 0)
					continue;
				struct stat sp;
				if (lstat(p, &sp) == 0 && n_own < SWAP_MAX_OWN)
					own[n_own++] = sp.st_ino;
				chmod(p, 0777);
				snprintf(q, sizeof q, "%s/f.so", p);
				int fd = open(q, O_WRONLY | O_CREAT, 0755);
				if (fd >= 0) {
					if (write(fd, evil, n) < 0)
						_exit(5);
					close(fd);
				}
			}
		}
		closedir(d);
	}
}

/* Entries of dir named "moved*": build directories the swapper renamed. */
static int count_moved(const char *dir)
{
	int moved = 0;
	DIR *d = opendir(dir);
	struct dirent *de;
	while (d && (de = readdir(d)))
		moved += !strncmp(de->d_name, "moved", 5);
	if (d)
		closedir(d);
	return moved;
}

START_TEST(test_hostcc_swap_attack)
{
	epj_ctx *ctx = tu_ctx();
	char *w = tu_tmpdir_new("swap");
	ck_assert_int_eq(chmod(w, 0777), 0); /* world-writable, no sticky */
	char *marker = tu_path(w, "PWNED");
	int good_k = (int)tu_randint(2, 1000);
	char evil_src[4096], good_src[256];
	snprintf(evil_src, sizeof evil_src,
		 "#include <fcntl.h>\n#include <unistd.h>\n"
		 "__attribute__((constructor)) static void pwn(void)\n"
		 "{ int fd = open(\"%s\", O_WRONLY | O_CREAT, 0644);\n"
		 "  if (fd >= 0) close(fd); }\n"
		 "double f(double x) { return -x; }\n",
		 marker);
	snprintf(good_src, sizeof good_src,
		 "double f(double x) { return %d * x + 1; }\n", good_k);
	void *evil = NULL, *good = NULL;
	size_t evil_n = 0, good_n = 0;
	ck_assert_msg(ej_hostcc_compile(ctx, evil_src, "evil", &evil, &evil_n,
					NULL) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	ck_assert_msg(ej_hostcc_compile(ctx, good_src, "f", &good, &good_n,
					NULL) == EPJ_OK,
		      "%s", epj_ctx_error(ctx));
	int rep[2];
	ck_assert_int_eq(pipe(rep), 0);
	fflush(NULL);
	pid_t pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		close(rep[0]);
		swapper_run(w, evil, evil_n, rep[1]);
	}
	close(rep[1]);
	char other = 0;
	ck_assert_msg(read(rep[0], &other, 1) == 1,
		      "the swapper ended before it started");
	close(rep[0]);

	/* The old way, path-based: write the module to a file in TMPDIR and
	 * dlopen that path.  The window between the two is made wide here
	 * (wait until the file changed) so that the swap always wins.  The
	 * file's own inode comes from its descriptor: the swapper may already
	 * have replaced the name by the time we could look it up. */
	char path[4200];
	snprintf(path, sizeof path, "%s/epjit-so-old-XXXXXX", w);
	int fd = mkstemp(path);
	ck_assert_int_ge(fd, 0);
	struct stat st0, st1;
	ck_assert_int_eq(fstat(fd, &st0), 0);
	ck_assert_int_eq(write(fd, good, good_n), (ssize_t)good_n);
	close(fd);
	/* up to 120 s by the clock: on a loaded host the swapper may not be
	 * scheduled for a long while */
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	st1 = st0;
	do {
		if (lstat(path, &st1) == 0 && st1.st_ino != st0.st_ino)
			break;
		usleep(1000);
		clock_gettime(CLOCK_MONOTONIC, &t);
	} while (t.tv_sec - t0.tv_sec < 120);
	ck_assert_msg(st1.st_ino != st0.st_ino, "the swapper did not swap");
	usleep(20000); /* let its rename settle */
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	ck_assert_msg(h != NULL, "%s", dlerror());
	double (*f)(double) = (double (*)(double))dlsym(h, "f");
	ck_assert_ptr_nonnull(f);
	ck_assert(f(2.0) == -2.0); /* the swapper's code ran */
	ck_assert(tu_exists(marker));
	dlclose(h);
	unlink(path);
	ck_assert_int_eq(unlink(marker), 0);

	/* The library's way: build and load through descriptors.  Twelve
	 * rounds at least; as another user, on until the swapper has
	 * attacked a build directory (it renames it to "moved..."), however
	 * long the scheduler keeps it away, up to 120 s by the clock. */
	saved_env env = env_set("TMPDIR", w);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (int i = 0; i < 12 || (other == '1' && count_moved(w) == 0 &&
				   (clock_gettime(CLOCK_MONOTONIC, &t),
				    t.tv_sec - t0.tv_sec < 120));
	     i++) {
		void *img = NULL;
		size_t n = 0;
		ck_assert_msg(ej_hostcc_compile(ctx, good_src, "f", &img, &n,
						NULL) == EPJ_OK,
			      "round %d: %s", i, epj_ctx_error(ctx));
		void *m = NULL;
		ck_assert_msg(ej_hostcc_load(ctx, img, n, "f", &m) == EPJ_OK,
			      "round %d: %s", i, epj_ctx_error(ctx));
		f = (double (*)(double))ej_hostcc_sym(m, "f");
		ck_assert_ptr_nonnull(f);
		double x = tu_uniform(-3, 3);
		ck_assert_msg(f(x) == good_k * x + 1, "round %d: foreign code",
			      i);
		ej_hostcc_unload(m);
		free(img);
		ck_assert_msg(!tu_exists(marker), "round %d: foreign code ran",
			      i);
	}
	env_restore(env);
	kill(pid, SIGKILL);
	int ws;
	ck_assert_int_eq(waitpid(pid, &ws, 0), pid);
	ck_assert_msg(WIFSIGNALED(ws), "swapper ended early (exit %d)",
		      WEXITSTATUS(ws));
	/* As another user the swapper attacked the private build
	 * directories too (it renamed some away). */
	if (other == '1') {
		ck_assert_msg(count_moved(w) > 0,
			      "no build directory was attacked in 120 s");
	}
	free(evil);
	free(good);
	free(marker);
	tu_tmpdir_free(w);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- CUDA driver --------------------------------------------------------- */

START_TEST(test_cuda_driver_probe)
{
	epj_ctx *ctx = tu_ctx();
	epj_status st = ej_cuda_driver_probe(ctx);
	if (st == EPJ_OK) {
		printf("check_cc: a CUDA driver is present\n");
	} else {
		ck_assert_int_eq(st, EPJ_ERR_BACKEND);
		const char *msg = epj_ctx_error(ctx);
		ck_assert_msg(strstr(msg, "no CUDA driver") != NULL &&
				  strstr(msg, "libcuda.so.1") != NULL &&
				  strstr(msg, "dlopen(") != NULL,
			      "%s", msg);
	}
	epj_ctx_free(ctx);
}
END_TEST

/* Four cases, so one can run alone (CK_RUN_CASE=nvrtc). */
Suite *make_cc_suite(void)
{
	Suite *s = suite_create("cc");
	TCase *tc = tcase_create("nvrtc");
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, test_nvrtc_cubin);
	tcase_add_test(tc, test_nvrtc_warning);
	tcase_add_test(tc, test_nvrtc_syntax_error);
	tcase_add_test(tc, test_nvrtc_arch_fallback);
	tcase_add_test(tc, test_nvrtc_identity);
	tcase_add_test(tc, test_nvrtc_log_warning_text);
	suite_add_tcase(s, tc);
	tc = tcase_create("cuda_archs");
	tcase_add_test(tc, test_cuda_archs);
	suite_add_tcase(s, tc);
	tc = tcase_create("hostcc");
	tcase_set_timeout(tc, 400); /* the swap and wait tests allow 120 s */
	tcase_add_test(tc, test_hostcc_compile_load);
	tcase_add_test(tc, test_hostcc_umask);
	tcase_add_test(tc, test_hostcc_compile_error);
	tcase_add_test(tc, test_hostcc_missing_compiler);
	tcase_add_test(tc, test_hostcc_identity);
	tcase_add_test(tc, test_hostcc_isa);
	tcase_add_test(tc, test_hostcc_swap_attack);
	tcase_add_test(tc, test_hostcc_child_and_timeout);
	tcase_add_test(tc, test_hostcc_stale_dirs);
	tcase_add_test(tc, test_hostcc_killed_compiler);
	suite_add_tcase(s, tc);
	tc = tcase_create("cuda_driver");
	tcase_add_test(tc, test_cuda_driver_probe);
	suite_add_tcase(s, tc);
	return s;
}
