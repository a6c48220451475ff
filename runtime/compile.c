/* STUB: replaced by the real implementation. */
#include "runtime_impl.h"

void ej_engine_compile_free(epj_engine *e)
{
	(void)e;
}

epj_status epj_engine_compile(epj_engine *e)
{
	return ej_error(e->ctx, EPJ_ERR_UNSUPPORTED, "compile: not yet");
}
