/* fake_kparam.h -- the byte size of a kernel's parameter buffer, read from
 * the loaded image as the real CUDA driver reads it, for the stand-in
 * driver (t/fake_cuda.c: CUDA-graph capture copies a kernel's parameters
 * when it records the launch, so it must know how many bytes they are).
 *
 * Test code: built only for make check, never installed.
 */
#ifndef EPJIT_FAKE_KPARAM_H
#define EPJIT_FAKE_KPARAM_H

#include <stddef.h>

/* The total byte size of the parameter buffer of kernel `kernel` in the
 * module image image[0..size): the end of its last parameter, padding
 * between parameters included (0 for a kernel without parameters).
 * image is what cuModuleLoadData takes:
 *  - an ELF64 cubin (NVRTC's for sm_XX): the kernel's ".nv.info.<kernel>"
 *    section (EIATTR_CBANK_PARAM_SIZE, else EIATTR_PARAM_CBANK, else the
 *    EIATTR_KPARAM_INFO records);
 *  - PTX text (NUL-terminated or not): the parameter list of
 *    ".entry <kernel>(...)", each parameter at its alignment.
 * -1 when the size is unknown: no such kernel (or a name over 4096
 * bytes), another kind of image (a fatbin), or an image that is truncated
 * or malformed.  Every read is
 * bounds-checked against size: a hostile image gives -1 (or a wrong
 * number), never a read outside it.  Thread-safe (no state). */
long fake_kparam_size(const unsigned char *image, size_t size,
		      const char *kernel);

#endif /* EPJIT_FAKE_KPARAM_H */
