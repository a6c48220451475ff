/* prelude_c.h -- the text pasted at the top of every generated C translation
 * unit (jit/print_c.c), kept here as a C string so the library carries it
 * (no file is read at run time) and its hash enters the kernel cache key.
 *
 * Contents: the includes a generated kernel needs, bf16 helpers (bf16 ->
 * f32 is the high half; f32 -> bf16 rounds to nearest even with NaN kept
 * quiet -- bit for bit lib/dtype.c's epj_f32_to_bf16), and the math of the
 * pointwise ops written exactly as lib/ops_pointwise.c writes them (same
 * expressions, same float/double functions, the f32 exp of
 * lib/ops_expf.h), so generated kernels round like the op table's
 * kernels.  Every helper is `static inline`: unused ones
 * cost nothing and raise no warning.
 *
 * Edit the C text between the quotes; keep it free of anything that depends
 * on the machine (it is compiled where the cache entry is made).
 */
#ifndef EPJIT_PRELUDE_C_H
#define EPJIT_PRELUDE_C_H

#include "../lib/ops_expf.h"
#include "prelude_math.h"

static const char ej_prelude_c_text[] =
    "/* ---- epjit C prelude (templates/prelude_c.h) ---- */\n"
    "#include <math.h>\n"
    "#include <stdint.h>\n"
    "#include <string.h>\n"
    "\n"
    "static inline float ej_bf2f(uint16_t b)\n"
    "{\n"
    "\tuint32_t u = (uint32_t)b << 16;\n"
    "\tfloat f;\n"
    "\tmemcpy(&f, &u, sizeof f);\n"
    "\treturn f;\n"
    "}\n"
    "\n"
    "/* round to nearest even; NaN stays NaN (made quiet) */\n"
    "static inline uint16_t ej_f2bf(float f)\n"
    "{\n"
    "\tuint32_t u;\n"
    "\tmemcpy(&u, &f, sizeof u);\n"
    "\tif ((u & 0x7fffffffu) > 0x7f800000u)\n"
    "\t\treturn (uint16_t)((u >> 16) | 0x0040u);\n"
    "\tu += 0x7fffu + ((u >> 16) & 1u);\n"
    "\treturn (uint16_t)(u >> 16);\n"
    "}\n"
    "\n"
    "/* an f32 rounded to bf16 precision, as a store + load would */\n"
    "static inline float ej_rbf16(float f)\n"
    "{\n"
    "\treturn ej_bf2f(ej_f2bf(f));\n"
    "}\n"
    "\n"
    "/* before a column loop: its iterations touch distinct elements (a\n"
    " * kernel's outputs are fresh buffers, never its inputs), so the\n"
    " * compiler may vectorise without run-time alias checks; GCC gives up\n"
    " * past ten of them (a kernel of four inputs and four outputs) */\n"
    "#if defined(__clang__)\n"
    "#define EJ_IVDEP _Pragma(\"clang loop vectorize(assume_safety)\")\n"
    "#elif defined(__GNUC__)\n"
    "#define EJ_IVDEP _Pragma(\"GCC ivdep\")\n"
    "#else\n"
    "#define EJ_IVDEP\n"
    "#endif\n"
    "\n"
    "#define EJ_SF static inline\n" EJ_EXPF_TEXT EJ_PRELUDE_MATH
    "/* ---- end of prelude ---- */\n";

#endif /* EPJIT_PRELUDE_C_H */
