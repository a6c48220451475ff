/* fuzz.h -- shared by the fuzz targets of t/fuzz/.
 *
 * Each target defines LLVMFuzzerTestOneInput (libFuzzer's entry point).
 * Built with clang -fsanitize=fuzzer (t/fuzz/build.sh) it is a fuzzer; built
 * with replay.c (make check) it is a program that runs every file of the
 * directories or files on its command line through the same function: the
 * seed corpus (t/fuzz/corpus/<target>/) and every past crash
 * (t/fuzz/crashes/<target>/) are replayed on every `make check`.
 *
 * A target must not crash, leak, hang or trip a sanitizer on any input; a
 * refused input is fine (that is what the readers are for).
 */
#ifndef EPJIT_FUZZ_H
#define EPJIT_FUZZ_H

#include <stddef.h>
#include <stdint.h>

#include "epjit.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Writes data to this process's scratch file (made once under $TMPDIR, a
 * fresh private directory) and returns its path; NULL when that fails. */
const char *fuzz_file(const uint8_t *data, size_t size);
/* The scratch directory of fuzz_file (for targets that need more files). */
const char *fuzz_dir(void);
/* A context for this process (created once; errors are cleared per
 * input); logging quiet. */
epj_ctx *fuzz_ctx(void);

#endif /* EPJIT_FUZZ_H */
