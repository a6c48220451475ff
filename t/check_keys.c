/* check_keys.c -- what a kernel cache key covers (jit/keys.c) and the C
 * backend keying its artifacts by the generated source (jit/backend_c.c).
 *
 * Each part of an artifact's identity is changed alone and must change the
 * key: the source, the backend kind, the compiler identity, its flags and
 * the target (an NVRTC arch).  End to end, a region compiled by the C
 * backend into a cache made here misses the first time, hits from a new jit
 * (disk) and from the same jit (memory table, alive for the jit's
 * lifetime), and misses again when the generator's output changes (the
 * prelude replaced through a test hook) or the compiler does ($EPJIT_CC).
 * The key holds no rank: a process with other rank variables hits the same
 * entry.
 */
#include "check_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cc.h"
#include "jit.h"
#include "jit_impl.h"
#include "kcache.h"
#include "kir.h"

/* jit/print_c.c's test hook (deliberately in no header). */
extern const char *ej_print_c_test_prelude;

static void key_of(char out[EJ_KCACHE_KEY_LEN + 1], const char *kind,
		   const char *id, const char *flags, const char *target,
		   const char *src)
{
	ej_artifact_key(out, kind, id, flags, target, src);
	ck_assert_uint_eq(strlen(out), EJ_KCACHE_KEY_LEN);
	for (int i = 0; i < EJ_KCACHE_KEY_LEN; i++)
		ck_assert(strchr("0123456789abcdef", out[i]) != NULL);
}

START_TEST(test_artifact_key_parts)
{
	/* a fresh random source, so no key here is a constant */
	char src[96];
	snprintf(src, sizeof src,
		 "__global__ void k%lld(float *p) { p[0] = %g; }",
		 (long long)tu_randint(0, 1 << 30), tu_uniform(-1, 1));
	char base[EJ_KCACHE_KEY_LEN + 1], again[EJ_KCACHE_KEY_LEN + 1];
	key_of(base, "nvrtc", "nvrtc 13.0", "-default-device", "sm_90", src);
	key_of(again, "nvrtc", "nvrtc 13.0", "-default-device", "sm_90", src);
	ck_assert_str_eq(base, again);
	char src2[sizeof src];
	memcpy(src2, src, sizeof src);
	src2[strlen(src2) - 2] = 'X'; /* one character of the source */
	struct {
		const char *kind, *id, *flags, *target, *src, *what;
	} v[] = {
		{ "nvrtc", "nvrtc 13.0", "-default-device", "sm_90", src2,
		  "source" },
		{ "c", "nvrtc 13.0", "-default-device", "sm_90", src, "kind" },
		{ "nvrtc", "nvrtc 13.1", "-default-device", "sm_90", src,
		  "compiler identity" },
		{ "nvrtc", NULL, "-default-device", "sm_90", src,
		  "identity NULL" },
		{ "nvrtc", "nvrtc 13.0", "-default-device -lineinfo", "sm_90",
		  src, "flags" },
		{ "nvrtc", "nvrtc 13.0", "", "sm_90", src, "flags empty" },
		{ "nvrtc", "nvrtc 13.0", "-default-device", "sm_80", src,
		  "arch" },
		{ "nvrtc", "nvrtc 13.0", "-default-device", "sm_90a", src,
		  "arch suffix" },
		{ "nvrtc", "nvrtc 13.0", "-default-device", NULL, src,
		  "arch NULL" },
		/* parts are length-prefixed: moving a character from one
		 * part to the next is a different key */
		{ "nvrtc", "nvrtc 13.0-", "default-device", "sm_90", src,
		  "part boundary" },
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(v); i++) {
		char k[EJ_KCACHE_KEY_LEN + 1];
		key_of(k, v[i].kind, v[i].id, v[i].flags, v[i].target,
		       v[i].src);
		ck_assert_msg(strcmp(k, base) != 0,
			      "changing the %s kept the key", v[i].what);
	}
}
END_TEST

START_TEST(test_build_id)
{
	const char *id = ej_build_id();
	ck_assert_uint_eq(strlen(id), 32);
	for (int i = 0; i < 32; i++)
		ck_assert(strchr("0123456789abcdef", id[i]) != NULL);
}
END_TEST

/* y = rmsnorm-like row reduction + pointwise tail: one fused kernel at
 * least, on a fresh random input of odd shape. */
static epj_tensor *k_fn(epj_ctx *ctx, epj_tensor *x)
{
	epj_tensor *x2 = epj_mul(ctx, x, x);
	epj_tensor *ms = epj_mean(ctx, x2, -1, true);
	epj_tensor *r = epj_rsqrt(ctx, ms);
	epj_tensor *y = epj_mul(ctx, x, r);
	epj_tensor_free(x2);
	epj_tensor_free(ms);
	epj_tensor_free(r);
	return y;
}

static epj_status k_traced(void *user, epj_ctx *ctx, epj_tensor *const *in,
			   int n_in, epj_tensor **out, int n_out)
{
	(void)user;
	(void)n_in;
	(void)n_out;
	out[0] = k_fn(ctx, in[0]);
	return out[0] ? EPJ_OK : epj_ctx_status(ctx);
}

typedef struct cache_ctr {
	int64_t mem, disk, miss;
} cache_ctr;

static cache_ctr ctrs(epj_ctx *ctx)
{
	return (cache_ctr){ epj_counter_get(ctx, "cache.mem_hits"),
			    epj_counter_get(ctx, "cache.disk_hits"),
			    epj_counter_get(ctx, "cache.misses") };
}

/* Compiles and runs the region with a jit of its own (or `jit`), checks
 * the compiled output against eager, and returns the cache counter change. */
static cache_ctr compile_once(epj_ctx *ctx, ej_jit *jit, epj_tensor *x)
{
	cache_ctr a = ctrs(ctx);
	ej_jit *own = jit ? NULL : ej_jit_new(ctx, EJ_BACKEND_C);
	ej_trace *tr = NULL;
	epj_status st = ej_trace_region(ctx, jit ? jit : own, k_traced, NULL,
					&x, 1, 1, NULL, NULL, &tr);
	ck_assert_msg(st == EPJ_OK, "trace: %s", epj_ctx_error(ctx));
	ej_region_fn *f = NULL;
	st = ej_jit_compile(ctx, jit ? jit : own, tr, &f);
	ck_assert_msg(st == EPJ_OK, "compile: %s", epj_ctx_error(ctx));
	int64_t l0 = epj_counter_get(ctx, "kernels.launched.compiled");
	epj_tensor *y = NULL;
	st = ej_region_run(ctx, f, &x, 1, NULL, 0, NULL, NULL, &y, 1);
	ck_assert_msg(st == EPJ_OK, "run: %s", epj_ctx_error(ctx));
	ck_assert_int_gt(epj_counter_get(ctx, "kernels.launched.compiled"), l0);
	epj_tensor *ref = k_fn(ctx, x);
	tu_assert_tensors_close(ctx, y, ref, 1e-5, 1e-6, "compiled vs eager");
	epj_tensor_free(ref);
	epj_tensor_free(y);
	ej_region_fn_free(f);
	ej_jit_free(own);
	cache_ctr b = ctrs(ctx);
	return (cache_ctr){ b.mem - a.mem, b.disk - a.disk, b.miss - a.miss };
}

START_TEST(test_backend_c_key)
{
	char *dir = tu_tmpdir_new("keys");
	char *cdir = tu_path(dir, "kcache");
	/* restored at the end: without fork (valgrind) tests share the env */
	const char *env0 = getenv("EPJIT_CACHE_DIR");
	char *saved = env0 ? strdup(env0) : NULL;
	setenv("EPJIT_CACHE_DIR", cdir, 1);
	unsetenv("EPJIT_CC");
	epj_ctx *ctx = tu_ctx();
	bool prev = epj_no_grad_enter(ctx);
	int64_t shape[2] = { tu_randint(1, 9), 2 * tu_randint(3, 40) + 1 };
	epj_tensor *x = tu_randn(ctx, EPJ_DTYPE_F32, 2, shape);

	/* a cache made here: the first compile misses and stores */
	cache_ctr c = compile_once(ctx, NULL, x);
	ck_assert_int_gt(c.miss, 0);
	ck_assert_int_eq(c.disk + c.mem, 0);
	int64_t n = c.miss;
	/* a new jit: every artifact from disk */
	c = compile_once(ctx, NULL, x);
	ck_assert_int_eq(c.miss, 0);
	ck_assert_int_eq(c.disk, n);
	/* the same source built again by one jit: its memory table */
	{
		ej_jit *jit = ej_jit_new(ctx, EJ_BACKEND_C);
		c = compile_once(ctx, jit, x);
		ck_assert_int_eq(c.miss, 0);
		ck_assert_int_eq(c.disk, n);
		ej_trace *tr = NULL;
		ck_assert(ej_trace_region(ctx, jit, k_traced, NULL, &x, 1, 1,
					  NULL, NULL, &tr) == EPJ_OK);
		ej_region_fn *f = NULL;
		ck_assert(ej_jit_compile(ctx, jit, tr, &f) == EPJ_OK);
		ck_assert(f->n_steps >= 1 && !f->steps[0].is_break);
		ej_graph *g = f->steps[0].seg->fwd;
		cache_ctr a = ctrs(ctx);
		void *state = NULL;
		ck_assert_msg(ej_backend_c.build(ctx, jit, g, &state) == EPJ_OK,
			      "%s", epj_ctx_error(ctx));
		ej_backend_c.free_state(state);
		cache_ctr b = ctrs(ctx);
		ck_assert_int_eq(b.mem - a.mem, 1);
		ck_assert_int_eq(b.miss - a.miss, 0);
		ej_region_fn_free(f);
		ej_jit_free(jit);
	}
	/* the generator's output changes (same graph, other prelude): miss */
	char *pre = malloc(strlen(ej_prelude_c()) + 64);
	sprintf(pre, "/* prelude variant %lld */\n%s",
		(long long)tu_randint(0, 1 << 30), ej_prelude_c());
	ej_print_c_test_prelude = pre;
	c = compile_once(ctx, NULL, x);
	ej_print_c_test_prelude = NULL;
	free(pre);
	ck_assert_int_eq(c.miss, n);
	ck_assert_int_eq(c.disk + c.mem, 0);
	/* the compiler's identity changes ($EPJIT_CC words): miss */
	setenv("EPJIT_CC", "cc -w", 1);
	c = compile_once(ctx, NULL, x);
	unsetenv("EPJIT_CC");
	ck_assert_int_eq(c.miss, n);
	/* no rank in the key: other rank variables hit the same entries */
	setenv("RANK", "3", 1);
	setenv("LOCAL_RANK", "1", 1);
	setenv("OMPI_COMM_WORLD_RANK", "3", 1);
	c = compile_once(ctx, NULL, x);
	unsetenv("RANK");
	unsetenv("LOCAL_RANK");
	unsetenv("OMPI_COMM_WORLD_RANK");
	ck_assert_int_eq(c.miss, 0);
	ck_assert_int_eq(c.disk, n);

	epj_tensor_free(x);
	epj_no_grad_exit(ctx, prev);
	epj_ctx_free(ctx);
	if (saved)
		setenv("EPJIT_CACHE_DIR", saved, 1);
	else
		unsetenv("EPJIT_CACHE_DIR");
	free(saved);
	free(cdir);
	tu_tmpdir_free(dir);
}
END_TEST

Suite *make_keys_suite(void)
{
	Suite *s = suite_create("keys");
	TCase *tc = tcase_create("keys");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_artifact_key_parts);
	tcase_add_test(tc, test_build_id);
	tcase_add_test(tc, test_backend_c_key);
	suite_add_tcase(s, tc);
	return s;
}
