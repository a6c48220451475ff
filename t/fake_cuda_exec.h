/* fake_cuda_exec.h -- the stand-in driver runs kernels on cuda-sim from
 * their CUDA C (t/fake_cuda_exec.c), where t/fake_nvrtc.c is preloaded.
 *
 * Test code: built only for make check, never installed.
 */
#ifndef EPJIT_FAKE_CUDA_EXEC_H
#define EPJIT_FAKE_CUDA_EXEC_H

#include <stdbool.h>
#include <stddef.h>

/* Whether the NVRTC pass-through is in the process. */
bool fake_exec_available(void);
/* The CUDA C of an image NVRTC produced in this process, or NULL. */
const char *fake_exec_source(const void *image, size_t size);
/* Runs kernel `kernel` of the module built from src (*sim: built at the
 * first launch, kept by the caller; of the kernels of src, those in the
 * module's image[0..image_size)) on cuda-sim; 0 when it ran, else 1 with
 * a line on stderr. */
int fake_exec_launch(void **sim, const char *src, const void *image,
		     size_t image_size, const char *kernel,
		     const unsigned *grid, const unsigned *block, unsigned smem,
		     const void *args, size_t args_size);
void fake_exec_unload(void *sim);

#endif /* EPJIT_FAKE_CUDA_EXEC_H */
