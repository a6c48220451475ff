/* check_main.c -- the one Check runner: every module's suite, one exit status.
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

int main(void)
{
	Suite *(*suites[])(void) = {
		make_tensor_suite,	  make_alloc_suite,
		make_autograd_suite,	  make_counters_suite,
		make_ops_pointwise_suite, make_ops_reduce_suite,
		make_ops_linalg_suite,	  make_ops_attention_suite,
		make_ops_index_suite,	  make_ops_shape_suite,
		make_config_suite,	  make_model_config_suite,
		make_safetensors_suite,	  make_data_suite,
		make_autoep_suite,	  make_module_suite,
		make_optim_suite,	  make_model_suite,
		make_engine_suite,	  make_jit_suite,
		make_compile_suite,	  make_parity_suite,
		make_kcache_suite,	  make_cc_suite,
		make_codegen_suite,	  make_keys_suite,
		make_sim_suite,		  make_cuda_suite,
		make_gpu_suite,		  make_archive_suite,
		make_config_doc_suite,	  make_templates_suite,
		make_tmpl_gemm_suite,	  make_ops_moe_suite,
		make_ptxas_suite,
	};
	/* the CUDA C templates' suites, one per area */
	Suite *(*tmpl_suites[])(void) = {
		make_tmpl_attention_suite,
		make_tmpl_moe_suite,
		make_eager_sim_suite,
		make_eager_cuda_suite,
	};
	/* the GPU libraries on their stand-ins */
	Suite *(*gpu_lib_suites[])(void) = {
		make_cublaslt_suite,  make_nccl_suite,	 make_gemm_cuda_suite,
		make_cuda_step_suite, make_kparam_suite, make_cuda_syncs_suite,
	};
	printf("epjit check: seed %llu (set EPJIT_TEST_SEED to replay)\n",
	       (unsigned long long)tu_seed());
	/* A kernel cache this run creates, empty: no test may pass on an
	 * artifact an earlier build made (forked tests inherit it; tests
	 * about the cache make their own). */
	char cache[] = "/tmp/epjit-check-kcache-XXXXXX";
	if (!mkdtemp(cache)) {
		perror("epjit check: mkdtemp for the kernel cache");
		return EXIT_FAILURE;
	}
	setenv("EPJIT_CACHE_DIR", cache, 1);
	SRunner *sr = srunner_create(NULL);
	for (size_t i = 0; i < sizeof suites / sizeof suites[0]; i++)
		srunner_add_suite(sr, suites[i]());
	for (size_t i = 0; i < sizeof tmpl_suites / sizeof tmpl_suites[0]; i++)
		srunner_add_suite(sr, tmpl_suites[i]());
	for (size_t i = 0; i < sizeof gpu_lib_suites / sizeof gpu_lib_suites[0];
	     i++)
		srunner_add_suite(sr, gpu_lib_suites[i]());
	srunner_run_all(sr, CK_NORMAL);
	int failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	/* the tree the tests left: entry files in shard directories */
	char cmd[sizeof cache + 16];
	snprintf(cmd, sizeof cmd, "rm -rf '%s'", cache);
	if (system(cmd) != 0)
		fprintf(stderr, "epjit check: could not remove %s\n", cache);
	return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
