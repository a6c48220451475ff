/* keys.c -- what a kernel cache key is made of.
 *
 * Two rules (doc/design.md section 7) keep a key honest:
 *  - an artifact (a shared object, a cubin) is keyed by everything that
 *    decides its bytes: the generated source itself, the compiler's identity
 *    and version, the flags and the target (arch or ISA).  Because the
 *    source is in the key, any change of the generator that changes what it
 *    prints (printer, kernel IR, scheduler, prelude, passes) changes the
 *    key, with no version number to remember to bump;
 *  - anything cached *above* the source (an entry that would skip tracing
 *    and the passes) must be keyed with ej_build_id(): a hash, computed at
 *    build time, of the generator's own sources (lib/, jit/, templates/).
 * Keys never contain a rank, a device ordinal, a process-group name or a
 * path, so every process of a job computes the same key for the same work.
 */
#include "cc.h"
#include "kcache.h"

#include "jit/build_id.h"

void ej_artifact_key(char out[EJ_KCACHE_KEY_LEN + 1], const char *kind,
		     const char *compiler_identity, const char *flags,
		     const char *target, const char *source)
{
	EJ_ASSERT(kind && source);
	const char *parts[] = {
		"epjit artifact", kind, compiler_identity, flags, target, source
	};
	ej_kcache_key(out, parts, (int)EJ_ARRAY_LEN(parts));
}

const char *ej_build_id(void)
{
	return EJ_BUILD_ID;
}
