/* ops.c -- builds the op table ej_ops[] from ops.def.
 *
 * Infer and kernel functions are required for every op; a backward function
 * is optional: it is referenced weakly, so an op whose family file defines no
 * ej_backward_ID gets a NULL formula (not differentiable).
 */
#include "ops_impl.h"

#define EJ_OP(id, name, nin, nout, flags)                                      \
	extern epj_status ej_backward_##id(                                    \
	    epj_ctx *, const ej_call *, epj_tensor *const *, const bool *,     \
	    epj_tensor **) __attribute__((weak));
#include "ops.def"
#undef EJ_OP

const ej_op_info ej_ops[EJ_OP_COUNT] = {
#define EJ_OP(id, nm, nin, nout, fl)                                           \
	[EJ_OP_##id] = { .name = nm,                                           \
			 .n_in = nin,                                          \
			 .n_out = nout,                                        \
			 .flags = fl,                                          \
			 .infer = ej_infer_##id,                               \
			 .cpu_kernel = ej_kernel_##id,                         \
			 .backward = ej_backward_##id },
#include "ops.def"
#undef EJ_OP
};
