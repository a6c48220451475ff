/* prelude_c.h -- the text pasted at the top of every generated C translation
 * unit (jit/print_c.c), kept here as a C string so the library carries it
 * (no file is read at run time) and its hash enters the kernel cache key.
 *
 * Contents: the includes a generated kernel needs, bf16 helpers (bf16 ->
 * f32 is the high half; f32 -> bf16 rounds to nearest even with NaN kept
 * quiet -- bit for bit lib/dtype.c's epj_f32_to_bf16), and the math of the
 * pointwise ops written exactly as lib/ops_pointwise.c writes them (same
 * expressions, same float/double functions), so generated kernels round
 * like the op table's kernels.  Every helper is `static inline`: unused ones
 * cost nothing and raise no warning.
 *
 * Edit the C text between the quotes; keep it free of anything that depends
 * on the machine (it is compiled where the cache entry is made).
 */
#ifndef EPJIT_PRELUDE_C_H
#define EPJIT_PRELUDE_C_H

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
    "static inline float ej_silu_f(float x)\n"
    "{\n"
    "\treturn x / (1.0f + expf(-x));\n"
    "}\n"
    "static inline double ej_silu_d(double x)\n"
    "{\n"
    "\treturn x / (1.0 + exp(-x));\n"
    "}\n"
    "static inline float ej_sigmoid_f(float x)\n"
    "{\n"
    "\treturn 1.0f / (1.0f + expf(-x));\n"
    "}\n"
    "static inline double ej_sigmoid_d(double x)\n"
    "{\n"
    "\treturn 1.0 / (1.0 + exp(-x));\n"
    "}\n"
    "/* 0.5 x (1 + erf(x / sqrt 2)) */\n"
    "static inline float ej_gelu_f(float x)\n"
    "{\n"
    "\treturn 0.5f * x * (1.0f + erff(x * (float)0.70710678118654752440));\n"
    "}\n"
    "static inline double ej_gelu_d(double x)\n"
    "{\n"
    "\treturn 0.5 * x * (1.0 + erf(x * 0.70710678118654752440));\n"
    "}\n"
    "/* g s (1 + x (1 - s)), s = sigmoid(x) */\n"
    "static inline float ej_silu_bw_f(float g, float x)\n"
    "{\n"
    "\tfloat sg = 1.0f / (1.0f + expf(-x));\n"
    "\treturn g * sg * (1.0f + x * (1.0f - sg));\n"
    "}\n"
    "static inline double ej_silu_bw_d(double g, double x)\n"
    "{\n"
    "\tdouble sg = 1.0 / (1.0 + exp(-x));\n"
    "\treturn g * sg * (1.0 + x * (1.0 - sg));\n"
    "}\n"
    "/* g (Phi(x) + x phi(x)) */\n"
    "static inline float ej_gelu_bw_f(float g, float x)\n"
    "{\n"
    "\tfloat cdf = 0.5f * (1.0f + erff(x * (float)0.70710678118654752440));\n"
    "\tfloat pdf = expf(-0.5f * x * x) * (float)0.39894228040143267794;\n"
    "\treturn g * (cdf + x * pdf);\n"
    "}\n"
    "static inline double ej_gelu_bw_d(double g, double x)\n"
    "{\n"
    "\tdouble cdf = 0.5 * (1.0 + erf(x * 0.70710678118654752440));\n"
    "\tdouble pdf = exp(-0.5 * x * x) * 0.39894228040143267794;\n"
    "\treturn g * (cdf + x * pdf);\n"
    "}\n"
    "/* amax: the first NaN wins */\n"
    "static inline float ej_maxnan_f(float m, float x)\n"
    "{\n"
    "\treturn (x > m || x != x) && m == m ? x : m;\n"
    "}\n"
    "static inline double ej_maxnan_d(double m, double x)\n"
    "{\n"
    "\treturn (x > m || x != x) && m == m ? x : m;\n"
    "}\n"
    "/* ---- end of prelude ---- */\n";

#endif /* EPJIT_PRELUDE_C_H */
