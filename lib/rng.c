/* rng.c -- the context RNG: xoshiro256** seeded through splitmix64.
 *
 * Deterministic by construction: a seed fixes the whole sequence, and every
 * consumer (random factories, dropout) draws in a fixed order on one thread.
 * ej_rng_normal uses one Box-Muller pair per call and returns its cosine
 * half only: the state is just s[4], with no room to cache the sine half,
 * and one-value-per-call keeps the draw count per element fixed.
 */
#include "core_impl.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x)
{
	uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
	return (x << k) | (x >> (64 - k));
}

void ej_rng_seed(ej_rng *r, uint64_t seed)
{
	uint64_t x = seed;
	for (int i = 0; i < 4; i++)
		r->s[i] = splitmix64(&x);
	/* splitmix64 is a bijection of distinct counters, so the four words
	 * are never all zero (the one forbidden xoshiro state). */
}

uint64_t ej_rng_next(ej_rng *r)
{
	uint64_t *s = r->s;
	uint64_t result = rotl(s[1] * 5, 7) * 9;
	uint64_t t = s[1] << 17;
	s[2] ^= s[0];
	s[3] ^= s[1];
	s[1] ^= s[2];
	s[0] ^= s[3];
	s[2] ^= t;
	s[3] = rotl(s[3], 45);
	return result;
}

/* Top 53 bits as a double in [0, 1). */
double ej_rng_uniform(ej_rng *r)
{
	return (double)(ej_rng_next(r) >> 11) * 0x1.0p-53;
}

double ej_rng_normal(ej_rng *r)
{
	/* u1 in (0, 1] keeps log() finite. */
	double u1 = 1.0 - ej_rng_uniform(r);
	double u2 = ej_rng_uniform(r);
	return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}
