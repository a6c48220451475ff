/* check_kparam.c -- t/fake_kparam.c: the byte size of a kernel's parameter
 * buffer read from the module image, as the real driver reads it (the
 * stand-in driver needs it to copy a kernel's parameters into a CUDA graph).
 *
 * Every size is checked against one known apart from the image:
 *  - kernels written here take structs that this C compiler lays out too
 *    (one X-macro gives the C type and the CUDA C text): sizeof; and a list
 *    of scalar parameters, laid out as the members of a C struct: the end
 *    of the last member;
 *  - epjit's own template kernels (each takes its argument struct by
 *    value): the struct's sizeof from the host C++ compiler that builds
 *    the cuda-sim modules of the same unit (cuda-sim and cuLaunchKernel
 *    see one layout: kernels/tmpl.h);
 * each read from NVRTC's sm_90 cubin and from NVRTC's PTX.  Damaged images
 * (every truncation of a cubin's headers and of the kernel's .nv.info
 * section, bytes of those overwritten, junk) give -1, or at worst a wrong
 * number, and never a read outside the image: each copy is a heap block of
 * exactly its size, so the sanitizer build (--enable-sanitizers) catches
 * any overread.  Skipped (77-style, a message) without NVRTC.
 */
#include "check_util.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cc.h"
#include "fake_kparam.h"
#include "tmpl.h"

/* the simulator's C++ text (static; a copy here) */
#include "templates/cuda_sim_text.h"

static bool have_nvrtc(const char *what)
{
	int maj = 0, min = 0;
	if (ej_nvrtc_version(&maj, &min))
		return true;
	fprintf(stderr, "check_kparam: %s: built without NVRTC, skipped\n",
		what);
	return false;
}

/* An image compiled from src: a cubin for sm_90, or PTX (from an arch newer
 * than NVRTC knows: its newest compute_XX). */
static void compile(epj_ctx *ctx, const char *src, const char *name, bool ptx,
		    ej_nvrtc_result *r)
{
	memset(r, 0, sizeof *r);
	epj_status st = ej_nvrtc_compile(ctx, src, name,
					 ptx ? "sm_999" : "sm_90", NULL, 0, r);
	ck_assert_msg(st == EPJ_OK, "%s: %s", name, epj_ctx_error(ctx));
	ck_assert_msg(r->is_ptx == ptx, "%s: is_ptx %d", name, r->is_ptx);
	ck_assert_uint_gt(r->size, 64);
}

static long size_of(const ej_nvrtc_result *r, const char *kernel)
{
	/* an exact-size copy: any overread is past a heap block */
	unsigned char *c = malloc(r->size);
	ck_assert_ptr_nonnull(c);
	memcpy(c, r->image, r->size);
	long s = fake_kparam_size(c, r->size, kernel);
	free(c);
	return s;
}

/* ---- kernels written here ------------------------------------------------
 */

/* name, then the struct's body: its C and CUDA C text at once.  Sizes 1
 * (a byte), 24 (padding between members), 16 (an over-aligned struct of
 * one int), 34 -> 40 (tail padding), 4000 and 12000 (parameters over
 * 4 KiB, described by EIATTR_KPARAM_INFO_V2). */
#define KP_STRUCTS(X)                                                          \
	X(kp_byte, , { char c; })                                              \
	X(kp_ptrs, , {                                                         \
		float *x;                                                      \
		int n;                                                         \
		float *y;                                                      \
	})                                                                     \
	X(kp_al16, __attribute__((aligned(16))), { int a; })                   \
	X(kp_tail, , {                                                         \
		long long q;                                                   \
		short s[13];                                                   \
	})                                                                     \
	X(kp_4k, , { float v[1000]; })                                         \
	X(kp_12k, , {                                                          \
		double d[1500];                                                \
		char c;                                                        \
	})

/* the C types: struct <attributes> <name> <body>; and a name-size table */
#define KP_DECL(n, attr, ...) struct attr n __VA_ARGS__;
KP_STRUCTS(KP_DECL)
#undef KP_DECL
#define KP_ROW(n, attr, ...) { #n, sizeof(struct n) },
static const struct {
	const char *name;
	size_t size;
} kp_sizes[] = { KP_STRUCTS(KP_ROW) };
#undef KP_ROW

/* A list of scalar parameters and the C struct of the same members: the
 * buffer ends where its last member does (no tail padding). */
struct kp_list {
	int a;
	double b;
	char c;
	float *o;
	short s;
};
#define KP_LIST_SIZE (offsetof(struct kp_list, s) + sizeof(short))

/* The CUDA C unit: the same structs, one kernel per struct,
 * k_<name>(struct <name>), reading a byte of it; k_list(int, double, char,
 * float *, short); a kernel without parameters; k_two(struct kp_ptrs,
 * double *): 24 + 8. */
#define KP_TEXT(n, attr, ...) "struct " #attr " " #n " " #__VA_ARGS__ ";\n"
#define KP_KERNEL(n, attr, ...)                                                \
	"extern \"C\" __global__ void k_" #n "(struct " #n " a) { "            \
	"if (((const unsigned char *)&a)[threadIdx.x % sizeof a] == 7) "       \
	"asm volatile(\"trap;\"); }\n"
#define KP_MORE                                                                \
	"extern \"C\" __global__ void k_list(int a, double b, char c, "        \
	"float *o, short s) { o[threadIdx.x] = a + b + c + s; }\n"             \
	"extern \"C\" __global__ void k_none() { }\n"                          \
	"extern \"C\" __global__ void k_two(struct kp_ptrs a, double *o) "     \
	"{ o[threadIdx.x] = a.x[threadIdx.x] * a.n; }\n"
static const char kp_unit[] = KP_STRUCTS(KP_TEXT) KP_STRUCTS(KP_KERNEL) KP_MORE;

/* _i 0: cubin, 1: PTX.  Every kernel's size is the C compiler's; unknown
 * names (also a prefix of a kernel's name) are -1. */
START_TEST(test_kparam_own)
{
	if (!have_nvrtc("test_kparam_own"))
		return;
	epj_ctx *ctx = tu_ctx();
	ej_nvrtc_result r;
	compile(ctx, kp_unit, "kparam", _i == 1, &r);
	for (size_t i = 0; i < EJ_ARRAY_LEN(kp_sizes); i++) {
		char k[64];
		snprintf(k, sizeof k, "k_%s", kp_sizes[i].name);
		long got = size_of(&r, k);
		ck_assert_msg(got == (long)kp_sizes[i].size,
			      "%s (%s): %ld bytes, sizeof says %zu", k,
			      _i ? "PTX" : "cubin", got, kp_sizes[i].size);
	}
	ck_assert_int_eq(sizeof(struct kp_byte), 1);
	ck_assert_int_eq(sizeof(struct kp_al16), 16);
	ck_assert_int_gt(sizeof(struct kp_12k), 4096);
	ck_assert_int_eq(size_of(&r, "k_list"), (long)KP_LIST_SIZE);
	ck_assert_int_eq(KP_LIST_SIZE, 34);
	ck_assert_int_eq(size_of(&r, "k_none"), 0);
	ck_assert_int_eq(size_of(&r, "k_two"),
			 (long)(sizeof(struct kp_ptrs) + sizeof(double *)));
	ck_assert_int_eq(size_of(&r, "k_missing"), -1);
	ck_assert_int_eq(size_of(&r, "k_kp"), -1);
	ck_assert_int_eq(size_of(&r, "k_kp_byt"), -1);
	ej_nvrtc_result_free(&r);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- epjit's templates -----------------------------------------------------
 */

typedef struct tkernel {
	char name[64], type[80]; /* type: "struct <name>" */
} tkernel;

static const char *skip_blank(const char *p)
{
	while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
		p++;
	return p;
}

static const char *ident(const char *p, char *out, size_t n)
{
	size_t i = 0;
	while ((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') ||
	       (*p >= '0' && *p <= '9') || *p == '_') {
		if (i + 1 < n)
			out[i++] = *p;
		p++;
	}
	out[i] = 0;
	return p;
}

/* The kernels of unit src that take one struct by value:
 *   __global__ void [__launch_bounds__(...)] name([const] struct T a)
 * into k[0..max); their count. */
static int find_kernels(const char *src, tkernel *k, int max)
{
	int n = 0;
	for (const char *p = strstr(src, "__global__ void"); p && n < max;
	     p = strstr(p + 1, "__global__ void")) {
		const char *q = skip_blank(p + strlen("__global__ void"));
		if (!strncmp(q, "__launch_bounds__", 17)) {
			q = strchr(q, ')');
			if (!q)
				break;
			q = skip_blank(q + 1);
		}
		char w[64];
		q = skip_blank(ident(q, k[n].name, sizeof k[n].name));
		if (*q != '(' || !k[n].name[0])
			continue;
		q = skip_blank(ident(skip_blank(q + 1), w, sizeof w));
		if (!strcmp(w, "const"))
			q = skip_blank(ident(q, w, sizeof w));
		if (strcmp(w, "struct"))
			continue;
		q = skip_blank(ident(q, w, sizeof w));
		snprintf(k[n].type, sizeof k[n].type, "struct %s", w);
		q = skip_blank(ident(q, w, sizeof w));
		if (*q == ')' && w[0])
			n++;
	}
	return n;
}

/* sizeof each k[i].type by the host C++ compiler of cuda-sim modules, on
 * the simulator's text + src (as ej_sim_build_module builds it). */
static void host_sizes(epj_ctx *ctx, const char *src, const tkernel *k, int n,
		       size_t *size)
{
	size_t cap =
	    strlen(ej_cuda_sim_text) + strlen(src) + 256 * (size_t)n + 64;
	char *u = malloc(cap);
	ck_assert_ptr_nonnull(u);
	int len = snprintf(u, cap, "%s%s\n", ej_cuda_sim_text, src);
	for (int i = 0; i < n; i++)
		len += snprintf(u + len, cap - (size_t)len,
				"extern \"C\" __attribute__((visibility("
				"\"default\"))) const unsigned long "
				"kp_size_%d = sizeof(%s);\n",
				i, k[i].type);
	ck_assert_int_lt(len, (int)cap);
	void *so = NULL, *h = NULL;
	size_t so_len = 0;
	char *log = NULL;
	/* -O0: only the sizes are wanted, not fast kernels */
	epj_status st = ej_hostcxx_compile(ctx, u, "kparam_sizes", "-O0", &so,
					   &so_len, &log);
	ck_assert_msg(st == EPJ_OK, "%s", epj_ctx_error(ctx));
	st = ej_hostcc_load(ctx, so, so_len, "kparam_sizes", &h);
	ck_assert_msg(st == EPJ_OK, "%s", epj_ctx_error(ctx));
	for (int i = 0; i < n; i++) {
		char sym[32];
		snprintf(sym, sizeof sym, "kp_size_%d", i);
		const unsigned long *v = ej_hostcc_sym(h, sym);
		ck_assert_msg(v != NULL, "%s missing", sym);
		size[i] = *v;
	}
	ej_hostcc_unload(h);
	free(so);
	free(log);
	free(u);
}

/* Every kernel of every template that takes its struct by value: the
 * cubin's and the PTX's sizes are the host compiler's sizeof. */
START_TEST(test_kparam_templates)
{
	if (!have_nvrtc("test_kparam_templates"))
		return;
	epj_ctx *ctx = tu_ctx();
	int total = 0, structs = 0, tmpl = 0;
	size_t seen[256];
	for (const char *const *t = ej_tmpl_names(); *t; t++) {
		ej_arena *A = ej_arena_new();
		/* attention's bf16 module: it has the FMA kernels and the
		 * tensor-core ones (which the f32 and f64 modules leave out) */
		const char *defs = strcmp(*t, "attention") == 0
				       ? "#define EJ_ATTN_DT 1"
				       : NULL;
		const char *src = ej_tmpl_source(ctx, A, *t, defs);
		ck_assert_msg(src != NULL, "%s: %s", *t, epj_ctx_error(ctx));
		tkernel k[64];
		int n = find_kernels(src, k, 64);
		if (n == 0) {
			ej_arena_free(A);
			continue;
		}
		size_t want[64];
		host_sizes(ctx, src, k, n, want);
		for (int i = 0; i < n; i++) {
			bool known = false;
			for (int j = 0; j < structs; j++)
				known = known || seen[j] == want[i];
			if (!known && structs < 256)
				seen[structs++] = want[i];
			total++;
		}
		/* the NVRTC compiles: a third of the templates under
		 * EPJIT_CHECK_QUICK */
		if (!tu_quick_keep(tmpl++)) {
			ej_arena_free(A);
			continue;
		}
		ej_nvrtc_result cubin, ptx;
		compile(ctx, src, *t, false, &cubin);
		compile(ctx, src, *t, true, &ptx);
		for (int i = 0; i < n; i++) {
			long c = size_of(&cubin, k[i].name);
			long p = size_of(&ptx, k[i].name);
			ck_assert_msg(c == (long)want[i] && p == (long)want[i],
				      "template %s, kernel %s (%s): cubin %ld, "
				      "PTX %ld, sizeof %zu",
				      *t, k[i].name, k[i].type, c, p, want[i]);
		}
		ej_nvrtc_result_free(&cubin);
		ej_nvrtc_result_free(&ptx);
		ej_arena_free(A);
	}
	/* the gemm, moe, optim, ... kernels: many, of several sizes */
	ck_assert_int_ge(total, 30);
	ck_assert_int_ge(structs, 10);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- damaged images --------------------------------------------------------
 */

static uint64_t le(const unsigned char *p, int n)
{
	uint64_t v = 0;
	for (int i = n - 1; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

/* fake_kparam_size on a[0..n) (copied to a block of exactly n bytes) */
static long on_copy(const unsigned char *a, size_t n, const char *kernel)
{
	unsigned char *c = malloc(n ? n : 1);
	ck_assert_ptr_nonnull(c);
	memcpy(c, a, n);
	long s = fake_kparam_size(c, n, kernel);
	free(c);
	return s;
}

/* The header offset, data offset and size of section `name` of the
 * (well-formed) cubin im. */
static void section_of(const unsigned char *im, const char *name, size_t *hdr,
		       size_t *off, size_t *size)
{
	uint64_t shoff = le(im + 40, 8), shent = le(im + 58, 2);
	uint64_t shnum = le(im + 60, 2), stx = le(im + 62, 2);
	const unsigned char *st = im + shoff + stx * shent;
	uint64_t stoff = le(st + 24, 8);
	for (uint64_t i = 0; i < shnum; i++) {
		const unsigned char *s = im + shoff + i * shent;
		if (!strcmp((const char *)im + stoff + le(s, 4), name)) {
			*hdr = (size_t)(shoff + i * shent);
			*off = le(s + 24, 8);
			*size = le(s + 32, 8);
			return;
		}
	}
	ck_abort_msg("no section %s", name);
}

/* Writes the n-byte little-endian v at p. */
static void put(unsigned char *p, int n, uint64_t v)
{
	for (int b = 0; b < n; b++)
		p[b] = (unsigned char)(v >> (8 * b));
}

/* A cubin and PTX cut short or overwritten: -1 where what the answer
 * needs is gone or broken; never a read outside the image (each case on an
 * exact-size copy).  The cubin's section headers are cut at every length
 * and the kernel's .nv.info section at every length (its size field
 * patched to match), bytes of both are overwritten, and junk is no image. */
START_TEST(test_kparam_damaged)
{
	if (!have_nvrtc("test_kparam_damaged"))
		return;
	epj_ctx *ctx = tu_ctx();
	ej_nvrtc_result cu, px;
	compile(ctx, kp_unit, "kparam", false, &cu);
	compile(ctx, kp_unit, "kparam", true, &px);
	const unsigned char *im = cu.image;
	size_t n = cu.size;
	const char *kern = "k_kp_ptrs";
	long want = (long)sizeof(struct kp_ptrs);
	ck_assert_int_eq(on_copy(im, n, kern), want);

	/* arguments */
	ck_assert_int_eq(fake_kparam_size(NULL, n, kern), -1);
	ck_assert_int_eq(fake_kparam_size(im, 0, kern), -1);
	ck_assert_int_eq(fake_kparam_size(im, n, NULL), -1);
	ck_assert_int_eq(fake_kparam_size(im, n, ""), -1);

	/* every truncation: the section headers sit at the end of the
	 * file, so an image cut anywhere before them is refused; past them
	 * the answer stays right */
	uint64_t shend = le(im + 40, 8) + le(im + 58, 2) * le(im + 60, 2);
	ck_assert_uint_le(shend, n);
	for (size_t t = 0; t < n; t++) {
		long s = on_copy(im, t, kern);
		if (t < shend)
			tu_assert(s == -1);
		else
			tu_assert(s == want);
	}

	/* the kernel's .nv.info section cut at every length, its size
	 * patched: the answer needs the record with the parameter size
	 * (EIATTR_CBANK_PARAM_SIZE, then EIATTR_PARAM_CBANK at the end of
	 * the section), so a cut section is -1 or still the right size
	 * (cut after those records), never another number */
	char sec[64];
	snprintf(sec, sizeof sec, ".nv.info.%s", kern);
	size_t shdr, soff, ssize;
	section_of(im, sec, &shdr, &soff, &ssize);
	ck_assert_uint_gt(ssize, 16);
	unsigned char *c = malloc(n);
	ck_assert_ptr_nonnull(c);
	unsigned char *szf = c + shdr + 32; /* its sh_size */
	for (size_t cut = 0; cut < ssize; cut++) {
		memcpy(c, im, n);
		put(szf, 8, cut);
		long s = on_copy(c, n, kern);
		/* 0: cut before any parameter record, a well-formed section
		 * of a kernel without parameters */
		tu_assert(s == -1 || s == want || s == 0);
		if (cut % 4)
			tu_assert(s == -1); /* inside a record */
	}
	/* a section whose size runs past the image */
	memcpy(c, im, n);
	put(szf, 8, n - soff + 1);
	ck_assert_int_eq(on_copy(c, n, kern), -1);
	put(szf, 8, UINT64_MAX);
	ck_assert_int_eq(on_copy(c, n, kern), -1);
	put(szf, 8, ssize);
	put(szf - 8, 8, UINT64_MAX - 8); /* sh_offset */
	ck_assert_int_eq(on_copy(c, n, kern), -1);

	/* one record's length past the section, an unknown format, the
	 * parameter size with the wrong format, and two sizes that
	 * disagree: each -1 */
	memcpy(c, im, n);
	ck_assert_int_eq(c[soff], 0x04); /* the first record: an SVAL */
	c[soff + 2] = 0xff;
	c[soff + 3] = 0x7f;
	ck_assert_int_eq(on_copy(c, n, kern), -1);
	memcpy(c, im, n);
	c[soff] = 0x09;
	ck_assert_int_eq(on_copy(c, n, kern), -1);
	size_t at = 0; /* EIATTR_CBANK_PARAM_SIZE: 03 19 <u16> */
	for (size_t i = soff; i + 4 <= soff + ssize && !at;
	     i += im[i] == 0x04 ? 4 + le(im + i + 2, 2) : 4)
		if (im[i] == 0x03 && im[i + 1] == 0x19)
			at = i;
	ck_assert_msg(at, "no EIATTR_CBANK_PARAM_SIZE in %s", sec);
	ck_assert_int_eq(le(im + at + 2, 2), want);
	memcpy(c, im, n);
	c[at + 2]++; /* disagrees with EIATTR_PARAM_CBANK */
	ck_assert_int_eq(on_copy(c, n, kern), -1);
	memcpy(c, im, n);
	c[at] = 0x02; /* a BVAL parameter size */
	ck_assert_int_eq(on_copy(c, n, kern), -1);

	/* the ELF header: magic, class, byte order, machine, and the
	 * section header table's place, entry size, count and names */
	uint64_t shnum = le(im + 60, 2);
	static const struct {
		size_t at;
		int bytes;
		uint64_t v; /* UINT64_MAX - 1: the image size */
	} hdr[] = {
		{ 1, 1, 'X' },		   /* magic */
		{ 4, 1, 1 },		   /* ELFCLASS32 */
		{ 5, 1, 2 },		   /* big-endian */
		{ 18, 2, 62 },		   /* EM_X86_64 */
		{ 40, 8, 0 },		   /* no section headers */
		{ 40, 8, UINT64_MAX - 1 }, /* past the end */
		{ 40, 8, UINT64_MAX - 63 },
		{ 58, 2, 32 },	   /* entries too small */
		{ 60, 2, 0xffff }, /* too many */
		{ 60, 2, 0 },	   /* 0: the count is section 0's size, 0 */
		{ 62, 2, 0xffff }, /* names in section 0's link, 0: NULL */
		{ 62, 2, 0 },	   /* names in the NULL section */
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(hdr); i++) {
		memcpy(c, im, n);
		put(c + hdr[i].at, hdr[i].bytes,
		    hdr[i].v == UINT64_MAX - 1 ? n : hdr[i].v);
		ck_assert_msg(on_copy(c, n, kern) == -1, "header case %zu", i);
	}
	memcpy(c, im, n);
	put(c + 62, 2, shnum); /* the names' section out of range */
	ck_assert_int_eq(on_copy(c, n, kern), -1);

	/* random overwrites of the ELF header, the section headers and the
	 * section: any answer, no read outside (the sanitizer build checks
	 * that) */
	uint64_t shoff = le(im + 40, 8);
	for (int it = 0; it < 4000; it++) {
		memcpy(c, im, n);
		int k = 1 + (int)tu_randint(0, 4);
		for (int j = 0; j < k; j++) {
			int64_t r = tu_randint(0, 3);
			size_t p =
			    r == 0 ? (size_t)tu_randint(0, 64)
			    : r == 1
				? (size_t)tu_randint((int64_t)shoff,
						     (int64_t)shend)
				: soff + (size_t)tu_randint(0, (int64_t)ssize);
			c[p] = (unsigned char)tu_randint(0, 256);
		}
		long s = on_copy(c, n, kern);
		tu_assert(s >= -1);
	}
	free(c);

	/* PTX cut at every length: -1 until the kernel's list is whole */
	const unsigned char *pt = px.image;
	size_t pn = px.size;
	const char *e = strstr((const char *)pt, ".entry k_kp_ptrs(");
	ck_assert_ptr_nonnull(e);
	const char *close = strchr(e, ')');
	ck_assert_ptr_nonnull(close);
	size_t whole = (size_t)(close - (const char *)pt) + 1;
	for (size_t t = 0; t < pn; t++) {
		long s = on_copy(pt, t, kern);
		if (t < whole)
			tu_assert(s == -1);
		else
			tu_assert(s == want);
	}
	/* without its NUL, and with junk after it */
	ck_assert_int_eq(on_copy(pt, pn - 1, kern), want);
	/* a malformed list */
	static const char *const bad[] = {
		".entry k_kp_ptrs(.param .align 8 .b8 a[24]",
		".entry k_kp_ptrs(.param .align 3 .b8 a[24])",
		".entry k_kp_ptrs(.param .align 8 .b8 a[])",
		".entry k_kp_ptrs(.param .align 8 .b8 a[99999999999])",
		".entry k_kp_ptrs(.param .b8 .u32 a)",
		".entry k_kp_ptrs(.param .pred p)",
		".entry k_kp_ptrs(.param .u32)",
		".entry k_kp_ptrs(.param .u32 a .param .u32 b)",
		".entry k_kp_ptrs(.reg .u32 a)",
		".entry k_kp_ptrs",
		"/* .entry k_kp_ptrs(.param .u32 a) */",
		"// .entry k_kp_ptrs(.param .u32 a)\n",
		"\x7f"
		"ELF junk",
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(bad); i++)
		ck_assert_msg(on_copy((const unsigned char *)bad[i],
				      strlen(bad[i]), kern) == -1,
			      "%s", bad[i]);
	/* and well-formed ones: alignment, .ptr's own .align, vectors,
	 * comments, no list */
	static const struct {
		const char *text;
		long size;
	} good[] = {
		{ ".entry k_kp_ptrs(.param .u8 a, .param .u64 b)", 16 },
		{ ".entry k_kp_ptrs(.param .u8 a, .param .u64 .ptr .global "
		  ".align 16 b, .param .u16 c)",
		  18 },
		{ ".entry k_kp_ptrs( // the list\n .param .u32 a, /* x */ "
		  ".param .align 16 .b8 s[20] )",
		  36 },
		{ ".entry k_kp_ptrs(.param .v4 .f32 v, .param .u8 c)", 17 },
		{ ".visible .entry k_kp_ptrs()\n{\n}", 0 },
		{ ".entry k_kp_ptrs\n{\n}", 0 },
		{ ".entry k_kp_ptr(.param .u8 a) .entry k_kp_ptrs(.param .u32 "
		  "a)",
		  4 },
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(good); i++)
		ck_assert_msg(on_copy((const unsigned char *)good[i].text,
				      strlen(good[i].text),
				      kern) == good[i].size,
			      "%s", good[i].text);
	unsigned char junk[4096];
	for (size_t i = 0; i < sizeof junk; i++)
		junk[i] = (unsigned char)tu_randint(0, 256);
	ck_assert_int_eq(on_copy(junk, sizeof junk, kern), -1);
	ej_nvrtc_result_free(&cu);
	ej_nvrtc_result_free(&px);
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_kparam_suite(void)
{
	Suite *s = suite_create("kparam");
	TCase *tc = tcase_create("kparam");
	tcase_set_timeout(tc, 300);
	tcase_add_loop_test(tc, test_kparam_own, 0, 2);
	tcase_add_test(tc, test_kparam_templates);
	tcase_add_test(tc, test_kparam_damaged);
	suite_add_tcase(s, tc);
	return s;
}
