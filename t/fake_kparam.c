/* fake_kparam.c -- the byte size of a kernel's parameter buffer, from the
 * module image (fake_kparam.h), as the real CUDA driver learns it: the
 * stand-in driver (t/fake_cuda.c) needs it to copy a kernel's parameters
 * when a CUDA graph records the launch.
 *
 * A cubin (ELF64, little-endian, e_machine EM_CUDA = 190) carries one
 * section ".nv.info.<kernel>" (type SHT_LOPROC, 0x70000000) per kernel: a
 * run of attribute records, each a 4-byte header and maybe a payload,
 *
 *   u8 format, u8 attribute, u16 field, then for EIFMT_SVAL field bytes
 *
 *   EIFMT_NVAL 0x01  no value (field unused, 0)
 *   EIFMT_BVAL 0x02  a byte: the low byte of field (the high one is 0)
 *   EIFMT_HVAL 0x03  a 16-bit value: field
 *   EIFMT_SVAL 0x04  field bytes of payload after the header
 *
 * so a record is 4 bytes, or 4 + field for SVAL (all little-endian).  Read
 * off NVRTC 13.0's sm_90 / sm_90a cubins and checked against cuobjdump
 * -elf, which decodes the same bytes: "01 3e 00 00" is EIATTR_EXPLICIT_CLUSTER
 * (EIFMT_NVAL, no value) and the next record starts right after it;
 * "02 4c 01 00" is EIATTR_NUM_BARRIERS (EIFMT_BVAL) = 0x1.  (NVAL is not
 * 2 bytes nor BVAL 3: the header is always 4.)  The parameter buffer is
 * described three ways, all checked against cuobjdump and against the
 * .nv.constant0.<kernel> section, which is 0x210 (driver-reserved on
 * sm_90) + the parameter bytes:
 *
 *   EIATTR_CBANK_PARAM_SIZE 0x19, HVAL: the buffer's bytes (the end of
 *       the last parameter; "int, double, char, ptr" gives 0x20);
 *   EIATTR_PARAM_CBANK 0x0a, SVAL of 8: u32 symbol of the kernel's
 *       constant bank, u16 offset there (0x210), u16 size (= the above);
 *   EIATTR_KPARAM_INFO 0x17, SVAL of 12, one per parameter: u32 index,
 *       u16 ordinal, u16 offset, u32 flags whose bits 18..31 are the size
 *       (bits 0..17: pointee log-alignment, space, cbank 0x1f);
 *       EIATTR_KPARAM_INFO_V2 0x45 (where a parameter is over 4 KiB),
 *       the same but the last u32 has the size in bits 0..23 and the
 *       flags in bits 24..31 (sm_100 sets the space there: 0x05000008
 *       is a pointer of 8 bytes).
 *
 * The answer is CBANK_PARAM_SIZE, else PARAM_CBANK's size, else the end
 * of the last KPARAM_INFO parameter, else 0 (a kernel without parameters
 * has none of them).  Sizes that disagree, a parameter that ends past the
 * buffer, an attribute of an unexpected format or a record running past
 * its section make the image malformed (-1).
 *
 * PTX is the ".entry <kernel>(...)" parameter list: ".param .align A .b8
 * name[N]" (a struct by value) or ".param .u64 name" and the other scalar
 * types, each placed at its alignment (A, else its natural one; an .align
 * after .ptr is the pointee's, not the parameter's); the size is the end of
 * the last one, as CBANK_PARAM_SIZE counts it.
 *
 * Invariant: no byte outside image[0..size) is read, whatever the image
 * says (offsets and counts are checked before use, without overflow).
 *
 * Test code: built only for make check, never installed.
 */
#include "fake_kparam.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* ---- little-endian reads (bounds checked by the caller) ------------------
 */

static uint16_t rd16(const unsigned char *p)
{
	return (uint16_t)(p[0] | p[1] << 8);
}

static uint32_t rd32(const unsigned char *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
	       (uint32_t)p[3] << 24;
}

static uint64_t rd64(const unsigned char *p)
{
	return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32;
}

/* [off, off + len) lies within [0, size) */
static bool in_bounds(size_t size, uint64_t off, uint64_t len)
{
	return off <= size && len <= size - off;
}

/* ---- cubin --------------------------------------------------------------- */

enum {
	EM_CUDA = 190,
	SHT_CUDA_INFO = 0x70000000, /* SHT_LOPROC: .nv.info sections */
	EHDR_SIZE = 64,
	SHDR_SIZE = 64,
	SHN_XINDEX = 0xffff,
};
enum { EIFMT_NVAL = 1, EIFMT_BVAL = 2, EIFMT_HVAL = 3, EIFMT_SVAL = 4 };
enum {
	EIATTR_PARAM_CBANK = 0x0a,
	EIATTR_KPARAM_INFO = 0x17,
	EIATTR_CBANK_PARAM_SIZE = 0x19,
	EIATTR_KPARAM_INFO_V2 = 0x45,
};

typedef struct shdr {
	uint32_t name, type, link;
	uint64_t off, size;
} shdr;

typedef struct elf {
	const unsigned char *im;
	size_t size;
	uint64_t shoff, shnum;
	uint16_t shentsize;
} elf;

/* Section header i; false when it lies outside the image. */
static bool shdr_at(const elf *e, uint64_t i, shdr *s)
{
	if (i >= e->shnum)
		return false;
	/* no overflow: elf_open keeps every header inside the image */
	uint64_t o = e->shoff + i * e->shentsize;
	if (!in_bounds(e->size, o, SHDR_SIZE))
		return false;
	const unsigned char *p = e->im + o;
	s->name = rd32(p);
	s->type = rd32(p + 4);
	s->off = rd64(p + 24);
	s->size = rd64(p + 32);
	s->link = rd32(p + 40);
	return true;
}

/* The ELF header of a 64-bit little-endian CUDA ELF; false otherwise. */
static bool elf_open(const unsigned char *im, size_t size, elf *e,
		     uint64_t *shstrndx)
{
	static const unsigned char ident[6] = { 0x7f, 'E', 'L', 'F', 2, 1 };
	if (size < EHDR_SIZE || memcmp(im, ident, sizeof ident) != 0 ||
	    rd16(im + 18) != EM_CUDA)
		return false;
	e->im = im;
	e->size = size;
	e->shoff = rd64(im + 40);
	e->shentsize = rd16(im + 58);
	e->shnum = 1; /* header 0 first */
	*shstrndx = rd16(im + 62);
	shdr s0;
	if (e->shentsize < SHDR_SIZE || e->shoff == 0 || !shdr_at(e, 0, &s0))
		return false;
	/* extended numbering: counts from 0xff00 on live in header 0 */
	e->shnum = rd16(im + 60);
	if (e->shnum == 0)
		e->shnum = s0.size;
	if (*shstrndx == SHN_XINDEX)
		*shstrndx = s0.link;
	/* every header inside the image (so shoff + i * shentsize cannot
	 * overflow for i < shnum) */
	if (e->shnum == 0 || e->shnum > (size - e->shoff) / e->shentsize ||
	    *shstrndx >= e->shnum)
		return false;
	return true;
}

/* Whether the name at offset name of string table st is want[0..n) and a
 * NUL, all inside st and the image. */
static bool name_is(const elf *e, const shdr *st, uint32_t name,
		    const char *want, size_t n)
{
	if (!in_bounds(e->size, st->off, st->size) ||
	    !in_bounds(st->size, name, (uint64_t)n + 1))
		return false;
	const unsigned char *p = e->im + st->off + name;
	return memcmp(p, want, n) == 0 && p[n] == 0;
}

/* The parameter bytes from one .nv.info.<kernel> section p[0..n). */
static long nvinfo_params(const unsigned char *p, size_t n)
{
	long cbank = -1, pcbank = -1;
	uint64_t kend = 0;
	bool kparam = false;
	size_t i = 0;
	while (i < n) {
		if (n - i < 4)
			return -1; /* a header cut short */
		unsigned fmt = p[i], attr = p[i + 1];
		unsigned field = rd16(p + i + 2);
		const unsigned char *val = p + i + 4;
		size_t len = 0;
		if (fmt == EIFMT_SVAL) {
			len = field;
			if (len > n - i - 4)
				return -1; /* a payload past the section */
		} else if (fmt != EIFMT_NVAL && fmt != EIFMT_BVAL &&
			   fmt != EIFMT_HVAL) {
			return -1;
		}
		switch (attr) {
		case EIATTR_CBANK_PARAM_SIZE:
			if (fmt != EIFMT_HVAL || (cbank >= 0 && cbank != field))
				return -1;
			cbank = field;
			break;
		case EIATTR_PARAM_CBANK: {
			if (fmt != EIFMT_SVAL || len < 8)
				return -1;
			long s = rd16(val + 6);
			if (pcbank >= 0 && pcbank != s)
				return -1;
			pcbank = s;
			break;
		}
		case EIATTR_KPARAM_INFO:
		case EIATTR_KPARAM_INFO_V2: {
			if (fmt != EIFMT_SVAL || len < 12)
				return -1;
			uint64_t off = rd16(val + 6), v = rd32(val + 8);
			uint64_t sz =
			    attr == EIATTR_KPARAM_INFO ? v >> 18 : v & 0xffffff;
			if (off + sz > kend)
				kend = off + sz;
			kparam = true;
			break;
		}
		default:
			break;
		}
		i += 4 + len;
	}
	if (cbank >= 0 && pcbank >= 0 && cbank != pcbank)
		return -1;
	long total = cbank >= 0	   ? cbank
		     : pcbank >= 0 ? pcbank
		     : kparam	   ? (long)kend
				   : 0;
	if (kparam && kend > (uint64_t)total)
		return -1; /* a parameter past the buffer */
	return total;
}

static long cubin_size(const unsigned char *im, size_t size, const char *kernel)
{
	elf e;
	uint64_t shstrndx;
	if (!elf_open(im, size, &e, &shstrndx))
		return -1;
	shdr st;
	if (!shdr_at(&e, shstrndx, &st))
		return -1;
	static const char pre[] = ".nv.info.";
	size_t kl = strlen(kernel), pl = sizeof pre - 1;
	if (kl > 4096)
		return -1;
	char want[sizeof pre + 4096];
	memcpy(want, pre, pl);
	memcpy(want + pl, kernel, kl);
	for (uint64_t i = 0; i < e.shnum; i++) {
		shdr s;
		if (!shdr_at(&e, i, &s))
			return -1;
		if (s.type != SHT_CUDA_INFO ||
		    !name_is(&e, &st, s.name, want, pl + kl))
			continue;
		if (!in_bounds(size, s.off, s.size))
			return -1;
		return nvinfo_params(im + s.off, (size_t)s.size);
	}
	return -1; /* no such kernel */
}

/* ---- PTX ----------------------------------------------------------------- */

/* Tokens of PTX text t[0..n): a directive ".name", a word (identifier or
 * number: [A-Za-z0-9_$%]+), or one punctuation character; comments and
 * blanks are skipped. */
typedef struct lex {
	const char *t;
	size_t n, i;
	const char *tok; /* the current token, len bytes; len 0: the end */
	size_t len;
} lex;

static bool word_char(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
	       (c >= '0' && c <= '9') || c == '_' || c == '$' || c == '%';
}

static void next(lex *l)
{
	for (;;) {
		while (l->i < l->n &&
		       (l->t[l->i] == ' ' || l->t[l->i] == '\t' ||
			l->t[l->i] == '\n' || l->t[l->i] == '\r'))
			l->i++;
		if (l->n - l->i >= 2 && l->t[l->i] == '/' &&
		    l->t[l->i + 1] == '/') {
			while (l->i < l->n && l->t[l->i] != '\n')
				l->i++;
			continue;
		}
		if (l->n - l->i >= 2 && l->t[l->i] == '/' &&
		    l->t[l->i + 1] == '*') {
			l->i += 2;
			while (l->i < l->n &&
			       !(l->n - l->i >= 2 && l->t[l->i] == '*' &&
				 l->t[l->i + 1] == '/'))
				l->i++;
			l->i = l->i < l->n ? l->i + 2 : l->n;
			continue;
		}
		break;
	}
	l->tok = l->t + l->i;
	size_t j = l->i;
	if (j < l->n && l->t[j] == '.') {
		j++;
		while (j < l->n && word_char(l->t[j]))
			j++;
	} else if (j < l->n && word_char(l->t[j])) {
		while (j < l->n && word_char(l->t[j]))
			j++;
	} else if (j < l->n) {
		j++;
	}
	l->len = j - l->i;
	l->i = j;
}

static bool is(const lex *l, const char *s)
{
	size_t n = strlen(s);
	return l->len == n && memcmp(l->tok, s, n) == 0;
}

/* The current token as a number (decimal or 0x hex) up to 2^31; -1 when it
 * is none. */
static long number(const lex *l)
{
	size_t i = 0, base = 10;
	if (l->len > 2 && l->tok[0] == '0' &&
	    (l->tok[1] == 'x' || l->tok[1] == 'X')) {
		i = 2;
		base = 16;
	}
	if (i == l->len)
		return -1;
	long v = 0;
	for (; i < l->len; i++) {
		char c = l->tok[i];
		int d = c >= '0' && c <= '9'   ? c - '0'
			: c >= 'a' && c <= 'f' ? c - 'a' + 10
			: c >= 'A' && c <= 'F' ? c - 'A' + 10
					       : 99;
		if (d >= (int)base)
			return -1;
		v = v * (long)base + d;
		if (v > (1L << 31))
			return -1;
	}
	return v;
}

/* The byte size of a PTX fundamental type directive; 0 when it is none
 * a parameter may have. */
static long type_size(const lex *l)
{
	static const struct {
		const char *name;
		long size;
	} types[] = {
		{ ".b8", 1 },	 { ".s8", 1 },	   { ".u8", 1 },
		{ ".b16", 2 },	 { ".s16", 2 },	   { ".u16", 2 },
		{ ".f16", 2 },	 { ".bf16", 2 },   { ".b32", 4 },
		{ ".s32", 4 },	 { ".u32", 4 },	   { ".f32", 4 },
		{ ".f16x2", 4 }, { ".bf16x2", 4 }, { ".b64", 8 },
		{ ".s64", 8 },	 { ".u64", 8 },	   { ".f64", 8 },
		{ ".b128", 16 },
	};
	for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
		if (is(l, types[i].name))
			return types[i].size;
	return 0;
}

/* Enough for any parameter list (the driver's limit is 32764 bytes). */
#define PTX_MAX_PARAMS (1L << 20)

/* One ".param ..." of the list, l on ".param": its size and alignment;
 * false when it is malformed.  l ends on the token after it. */
static bool ptx_param(lex *l, long *size, long *align)
{
	long tsize = 0, vec = 1, al = 0, count = 1;
	bool ptr = false;
	for (next(l); l->len && l->tok[0] == '.'; next(l)) {
		long s = type_size(l);
		if (s) {
			if (tsize)
				return false; /* two types */
			tsize = s;
		} else if (is(l, ".align")) {
			next(l);
			long a = number(l);
			if (a < 1 || (a & (a - 1)) || a > 4096)
				return false;
			if (!ptr)
				al = a; /* after .ptr: the pointee's */
		} else if (is(l, ".ptr")) {
			ptr = true;
		} else if (is(l, ".v2") || is(l, ".v4") || is(l, ".v8")) {
			vec = l->tok[2] - '0';
		} else if (ptr && (is(l, ".global") || is(l, ".shared") ||
				   is(l, ".const") || is(l, ".local"))) {
			continue;
		} else {
			return false; /* a directive not known here */
		}
	}
	if (!tsize || !l->len || !word_char(l->tok[0]))
		return false; /* no type, or no name */
	for (next(l); is(l, "["); next(l)) {
		next(l);
		long c = number(l);
		next(l);
		if (c < 1 || !is(l, "]") || c > PTX_MAX_PARAMS / count)
			return false;
		count *= c;
	}
	long elem = tsize * vec;
	if (count > PTX_MAX_PARAMS / elem)
		return false;
	*size = elem * count;
	*align = al ? al : elem;
	return true;
}

static long ptx_size(const unsigned char *im, size_t size, const char *kernel)
{
	lex l = { .t = (const char *)im, .n = size };
	const void *nul = memchr(im, 0, size);
	if (nul)
		l.n = (size_t)((const unsigned char *)nul - im);
	size_t kl = strlen(kernel);
	for (next(&l); l.len; next(&l)) {
		if (!is(&l, ".entry"))
			continue;
		next(&l);
		if (l.len != kl || memcmp(l.tok, kernel, kl) != 0)
			continue;
		next(&l);
		if (is(&l, "{") || (l.len && l.tok[0] == '.'))
			return 0; /* ".entry k" with no list: no parameters */
		if (!is(&l, "("))
			return -1;
		long off = 0;
		next(&l);
		if (is(&l, ")"))
			return 0;
		for (;;) {
			long s, a;
			if (!is(&l, ".param") || !ptx_param(&l, &s, &a))
				return -1;
			off = (off + a - 1) / a * a + s;
			if (off > PTX_MAX_PARAMS)
				return -1;
			if (is(&l, ")"))
				return off;
			if (!is(&l, ","))
				return -1;
			next(&l);
		}
	}
	return -1; /* no such kernel */
}

long fake_kparam_size(const unsigned char *image, size_t size,
		      const char *kernel)
{
	if (!image || !kernel || !*kernel || size == 0)
		return -1;
	static const unsigned char elf_magic[4] = { 0x7f, 'E', 'L', 'F' };
	if (size >= 4 && memcmp(image, elf_magic, 4) == 0)
		return cubin_size(image, size, kernel);
	return ptx_size(image, size, kernel);
}
