/* prelude_math.h -- the scalar math of the pointwise ops, written once for
 * both preludes (templates/prelude_c.h, templates/prelude_cuda.h) exactly
 * as lib/ops_pointwise.c writes it (same expressions, same float/double
 * functions), so generated kernels round like the op table's kernels.
 *
 * Each EJ_OP_FN row of lib/ops.def (ops named "name") has its scalar
 * functions here, ej_<name>_f and ej_<name>_d, which generated kernels
 * call (jit/kir.c).
 *
 * EJ_PRELUDE_MATH is a string literal the preludes paste where they want
 * it; each prelude defines EJ_SF, the qualifiers of a scalar function in
 * its language, before it (C: static inline; CUDA: __device__
 * __forceinline__), and ej_expf, the f32 exp every f32 function here calls
 * (C: lib/ops_expf.h's, as lib/ops_pointwise.c's; CUDA: the device's
 * expf).  Only what both languages compile goes here.
 */
#ifndef EPJIT_PRELUDE_MATH_H
#define EPJIT_PRELUDE_MATH_H

#define EJ_PRELUDE_MATH                                                        \
	"EJ_SF float ej_neg_f(float x)\n"                                      \
	"{\n"                                                                  \
	"\treturn -x;\n"                                                       \
	"}\n"                                                                  \
	"EJ_SF double ej_neg_d(double x)\n"                                    \
	"{\n"                                                                  \
	"\treturn -x;\n"                                                       \
	"}\n"                                                                  \
	"EJ_SF float ej_exp_f(float x)\n"                                      \
	"{\n"                                                                  \
	"\treturn ej_expf(x);\n"                                               \
	"}\n"                                                                  \
	"EJ_SF double ej_exp_d(double x)\n"                                    \
	"{\n"                                                                  \
	"\treturn exp(x);\n"                                                   \
	"}\n"                                                                  \
	"EJ_SF float ej_log_f(float x)\n"                                      \
	"{\n"                                                                  \
	"\treturn logf(x);\n"                                                  \
	"}\n"                                                                  \
	"EJ_SF double ej_log_d(double x)\n"                                    \
	"{\n"                                                                  \
	"\treturn log(x);\n"                                                   \
	"}\n"                                                                  \
	"EJ_SF float ej_sqrt_f(float x)\n"                                     \
	"{\n"                                                                  \
	"\treturn sqrtf(x);\n"                                                 \
	"}\n"                                                                  \
	"EJ_SF double ej_sqrt_d(double x)\n"                                   \
	"{\n"                                                                  \
	"\treturn sqrt(x);\n"                                                  \
	"}\n"                                                                  \
	"EJ_SF float ej_rsqrt_f(float x)\n"                                    \
	"{\n"                                                                  \
	"\treturn 1.0f / sqrtf(x);\n"                                          \
	"}\n"                                                                  \
	"EJ_SF double ej_rsqrt_d(double x)\n"                                  \
	"{\n"                                                                  \
	"\treturn 1.0 / sqrt(x);\n"                                            \
	"}\n"                                                                  \
	"EJ_SF float ej_cos_f(float x)\n"                                      \
	"{\n"                                                                  \
	"\treturn cosf(x);\n"                                                  \
	"}\n"                                                                  \
	"EJ_SF double ej_cos_d(double x)\n"                                    \
	"{\n"                                                                  \
	"\treturn cos(x);\n"                                                   \
	"}\n"                                                                  \
	"EJ_SF float ej_sin_f(float x)\n"                                      \
	"{\n"                                                                  \
	"\treturn sinf(x);\n"                                                  \
	"}\n"                                                                  \
	"EJ_SF double ej_sin_d(double x)\n"                                    \
	"{\n"                                                                  \
	"\treturn sin(x);\n"                                                   \
	"}\n"                                                                  \
	"EJ_SF float ej_log1p_f(float x)\n"                                    \
	"{\n"                                                                  \
	"\treturn log1pf(x);\n"                                                \
	"}\n"                                                                  \
	"EJ_SF double ej_log1p_d(double x)\n"                                  \
	"{\n"                                                                  \
	"\treturn log1p(x);\n"                                                 \
	"}\n"                                                                  \
	"EJ_SF float ej_tanh_f(float x)\n"                                     \
	"{\n"                                                                  \
	"\treturn tanhf(x);\n"                                                 \
	"}\n"                                                                  \
	"EJ_SF double ej_tanh_d(double x)\n"                                   \
	"{\n"                                                                  \
	"\treturn tanh(x);\n"                                                  \
	"}\n"                                                                  \
	"EJ_SF float ej_silu_f(float x)\n"                                     \
	"{\n"                                                                  \
	"\treturn x / (1.0f + ej_expf(-x));\n"                                 \
	"}\n"                                                                  \
	"EJ_SF double ej_silu_d(double x)\n"                                   \
	"{\n"                                                                  \
	"\treturn x / (1.0 + exp(-x));\n"                                      \
	"}\n"                                                                  \
	"EJ_SF float ej_sigmoid_f(float x)\n"                                  \
	"{\n"                                                                  \
	"\treturn 1.0f / (1.0f + ej_expf(-x));\n"                              \
	"}\n"                                                                  \
	"EJ_SF double ej_sigmoid_d(double x)\n"                                \
	"{\n"                                                                  \
	"\treturn 1.0 / (1.0 + exp(-x));\n"                                    \
	"}\n"                                                                  \
	"/* 0.5 x (1 + erf(x / sqrt 2)) */\n"                                  \
	"EJ_SF float ej_gelu_f(float x)\n"                                     \
	"{\n"                                                                  \
	"\treturn 0.5f * x * (1.0f + erff(x * "                                \
	"(float)0.70710678118654752440));\n"                                   \
	"}\n"                                                                  \
	"EJ_SF double ej_gelu_d(double x)\n"                                   \
	"{\n"                                                                  \
	"\treturn 0.5 * x * (1.0 + erf(x * 0.70710678118654752440));\n"        \
	"}\n"                                                                  \
	"/* g s (1 + x (1 - s)), s = sigmoid(x) */\n"                          \
	"EJ_SF float ej_silu_backward_f(float g, float x)\n"                   \
	"{\n"                                                                  \
	"\tfloat sg = 1.0f / (1.0f + ej_expf(-x));\n"                          \
	"\treturn g * sg * (1.0f + x * (1.0f - sg));\n"                        \
	"}\n"                                                                  \
	"EJ_SF double ej_silu_backward_d(double g, double x)\n"                \
	"{\n"                                                                  \
	"\tdouble sg = 1.0 / (1.0 + exp(-x));\n"                               \
	"\treturn g * sg * (1.0 + x * (1.0 - sg));\n"                          \
	"}\n"                                                                  \
	"/* g (Phi(x) + x phi(x)) */\n"                                        \
	"EJ_SF float ej_gelu_backward_f(float g, float x)\n"                   \
	"{\n"                                                                  \
	"\tfloat cdf = 0.5f * (1.0f + erff(x * "                               \
	"(float)0.70710678118654752440));\n"                                   \
	"\tfloat pdf = ej_expf(-0.5f * x * x) * "                              \
	"(float)0.39894228040143267794;\n"                                     \
	"\treturn g * (cdf + x * pdf);\n"                                      \
	"}\n"                                                                  \
	"EJ_SF double ej_gelu_backward_d(double g, double x)\n"                \
	"{\n"                                                                  \
	"\tdouble cdf = 0.5 * (1.0 + erf(x * 0.70710678118654752440));\n"      \
	"\tdouble pdf = exp(-0.5 * x * x) * 0.39894228040143267794;\n"         \
	"\treturn g * (cdf + x * pdf);\n"                                      \
	"}\n"                                                                  \
	"/* maximum(a, b): b where b > a or b is NaN, unless a is NaN */\n"   \
	"EJ_SF float ej_maximum_f(float a, float b)\n"                         \
	"{\n"                                                                  \
	"\treturn (b > a || b != b) && a == a ? b : a;\n"                      \
	"}\n"                                                                  \
	"EJ_SF double ej_maximum_d(double a, double b)\n"                      \
	"{\n"                                                                  \
	"\treturn (b > a || b != b) && a == a ? b : a;\n"                      \
	"}\n"                                                                  \
	"/* amax: the first NaN wins */\n"                                     \
	"EJ_SF float ej_maxnan_f(float m, float x)\n"                          \
	"{\n"                                                                  \
	"\treturn (x > m || x != x) && m == m ? x : m;\n"                      \
	"}\n"                                                                  \
	"EJ_SF double ej_maxnan_d(double m, double x)\n"                       \
	"{\n"                                                                  \
	"\treturn (x > m || x != x) && m == m ? x : m;\n"                      \
	"}\n"

#endif /* EPJIT_PRELUDE_MATH_H */
