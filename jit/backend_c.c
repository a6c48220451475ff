/* STUB: the C backend arrives with the code generator. */
#include "jit_impl.h"

const ej_codegen_backend ej_backend_c = { "c", NULL, NULL, NULL };
