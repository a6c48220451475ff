/* check_main.c -- the one Check runner: every module's suite, one exit status.
 *
 * Usage: check_epjit [--list | SUITE...].  With no argument every suite
 * runs, in the order of the table below; with names, only those (an
 * unknown name is an error).  make check runs the suites in parts (the
 * t/check-*.part files, through t/check_part.sh), so that make -j runs
 * them side by side; t/check_parts.sh checks that the parts name every
 * suite of --list exactly once.  CK_RUN_SUITE / CK_RUN_CASE narrow a run
 * further, as Check documents.  Every run gets an empty kernel cache of
 * its own, removed at the end, unless EPJIT_CHECK_KCACHE names one to use
 * (tools/gpu-check: the run's private cache with the GPU bundle's
 * pre-warmed cubins).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_util.h"

/* t/check_cuda_step.c (not in check_util.h, which other suites share) */
Suite *make_cuda_step_suite(void);
/* t/check_cuda_syncs.c: host synchronizations of a cuda training step */
Suite *make_cuda_syncs_suite(void);
/* t/check_ptxas.c: ptxas's resource report of the CUDA kernels */
Suite *make_ptxas_suite(void);
/* t/check_kparam.c: kernel parameter sizes from images (t/fake_kparam.c) */
Suite *make_kparam_suite(void);
/* t/check_tensorboard.c: the trainer's TensorBoard event writer */
Suite *make_tensorboard_suite(void);
/* t/check_router_loss.c: the router losses of the AutoEP layers */
Suite *make_router_loss_suite(void);
/* t/check_docs.c: packed documents and the per-token loss */
Suite *make_docs_suite(void);

/* Every suite by name, in the order a full run takes. */
static const struct {
	const char *name;
	Suite *(*make)(void);
} suites[] = {
	{ "tensor", make_tensor_suite },
	{ "alloc", make_alloc_suite },
	{ "autograd", make_autograd_suite },
	{ "counters", make_counters_suite },
	{ "ops_pointwise", make_ops_pointwise_suite },
	{ "ops_reduce", make_ops_reduce_suite },
	{ "ops_linalg", make_ops_linalg_suite },
	{ "ops_attention", make_ops_attention_suite },
	{ "ops_index", make_ops_index_suite },
	{ "ops_shape", make_ops_shape_suite },
	{ "config", make_config_suite },
	{ "model_config", make_model_config_suite },
	{ "safetensors", make_safetensors_suite },
	{ "data", make_data_suite },
	{ "autoep", make_autoep_suite },
	{ "module", make_module_suite },
	{ "optim", make_optim_suite },
	{ "model", make_model_suite },
	{ "engine", make_engine_suite },
	{ "save", make_save_suite },
	{ "jit", make_jit_suite },
	{ "compile", make_compile_suite },
	{ "parity", make_parity_suite },
	{ "kcache", make_kcache_suite },
	{ "cc", make_cc_suite },
	{ "codegen", make_codegen_suite },
	{ "keys", make_keys_suite },
	{ "graph_api", make_graph_api_suite },
	{ "sim", make_sim_suite },
	{ "cuda", make_cuda_suite },
	{ "gpu", make_gpu_suite },
	{ "archive", make_archive_suite },
	{ "config_doc", make_config_doc_suite },
	{ "templates", make_templates_suite },
	{ "tmpl_gemm", make_tmpl_gemm_suite },
	{ "ops_moe", make_ops_moe_suite },
	{ "ptxas", make_ptxas_suite },
	{ "tmpl_attention", make_tmpl_attention_suite },
	{ "tmpl_moe", make_tmpl_moe_suite },
	{ "eager_sim", make_eager_sim_suite },
	{ "eager_cuda", make_eager_cuda_suite },
	{ "cublaslt", make_cublaslt_suite },
	{ "nccl", make_nccl_suite },
	{ "gemm_cuda", make_gemm_cuda_suite },
	{ "cuda_step", make_cuda_step_suite },
	{ "kparam", make_kparam_suite },
	{ "cuda_syncs", make_cuda_syncs_suite },
	{ "tensorboard", make_tensorboard_suite },
	{ "router_loss", make_router_loss_suite },
	{ "docs", make_docs_suite },
};
#define N_SUITES (sizeof suites / sizeof suites[0])

static int suite_index(const char *name)
{
	for (size_t i = 0; i < N_SUITES; i++)
		if (!strcmp(suites[i].name, name))
			return (int)i;
	return -1;
}

int main(int argc, char **argv)
{
	if (argc == 2 && !strcmp(argv[1], "--list")) {
		for (size_t i = 0; i < N_SUITES; i++)
			printf("%s\n", suites[i].name);
		return EXIT_SUCCESS;
	}
	bool want[N_SUITES];
	for (size_t i = 0; i < N_SUITES; i++)
		want[i] = argc < 2;
	for (int a = 1; a < argc; a++) {
		int k = suite_index(argv[a]);
		if (k < 0) {
			fprintf(stderr,
				"epjit check: no suite named '%s' (--list "
				"names them)\n",
				argv[a]);
			return EXIT_FAILURE;
		}
		want[k] = true;
	}
	printf("epjit check: seed %llu (set EPJIT_TEST_SEED to replay)\n",
	       (unsigned long long)tu_seed());
	/* A kernel cache this run creates, empty: no test may pass on an
	 * artifact an earlier build made (forked tests inherit it; tests
	 * about the cache make their own). */
	char cache[] = "/tmp/epjit-check-kcache-XXXXXX";
	/* EPJIT_CHECK_KCACHE=DIR: that cache instead (tools/gpu-check: the
	 * GPU bundle's pre-warmed cubins), kept */
	const char *given = getenv("EPJIT_CHECK_KCACHE");
	if (given && *given) {
		setenv("EPJIT_CACHE_DIR", given, 1);
	} else {
		if (!mkdtemp(cache)) {
			perror("epjit check: mkdtemp for the kernel cache");
			return EXIT_FAILURE;
		}
		setenv("EPJIT_CACHE_DIR", cache, 1);
		given = NULL;
	}
	/* Each case's timeout catches a hang, not a slow machine: a
	 * sanitized build runs 2 to 3 times slower, and a machine busy with
	 * other jobs slower again.  Check scales the timeouts set below (and
	 * its 4 s default) by CK_TIMEOUT_MULTIPLIER, read when a suite is
	 * made: 3 unless the caller chose. */
	setenv("CK_TIMEOUT_MULTIPLIER", "3", 0);
	SRunner *sr = srunner_create(NULL);
	for (size_t i = 0; i < N_SUITES; i++)
		if (want[i])
			srunner_add_suite(sr, suites[i].make());
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	/* the tree the tests left: entry files in shard directories */
	char cmd[sizeof cache + 16];
	snprintf(cmd, sizeof cmd, "rm -rf '%s'", cache);
	if (!given && system(cmd) != 0)
		fprintf(stderr, "epjit check: could not remove %s\n", cache);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
