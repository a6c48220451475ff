/* hash.c -- content hashing for cache keys: XXH3-128 (seed 0) from libxxhash.
 *
 * The hex form prints the high word first, then the low word, each as 16
 * lowercase digits, so it reads as one 128-bit number (XXH128 canonical
 * order).
 */
#include "core_impl.h"

#include <xxhash.h>

epj_hash128 epj_hash(const void *data, size_t len)
{
	static const char empty;
	XXH128_hash_t h = XXH3_128bits(data ? data : &empty, data ? len : 0);
	epj_hash128 r = { .lo = h.low64, .hi = h.high64 };
	return r;
}

void epj_hash_hex(epj_hash128 h, char out[33])
{
	snprintf(out, 33, "%016llx%016llx", (unsigned long long)h.hi,
		 (unsigned long long)h.lo);
}
