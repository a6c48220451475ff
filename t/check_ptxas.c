/* check_ptxas.c -- what ptxas makes of our CUDA C: every template and a
 * sample of generated fused kernels compiled for sm_90 through NVRTC with
 * ptxas's resource report (EJ_NVRTC_OPT_PTXAS_REPORT), read back with
 * ej_ptxas_report_parse.  Prints one table row per kernel (registers, stack
 * frame, spill stores and loads, bytes per thread) and fails on any stack
 * frame or spill in a GEMM, attention, gated delta, MoE, optimizer or
 * fused kernel: per-thread arrays that ptxas cannot index statically, or
 * registers it runs out of, land in local memory, which the cuda-sim tests
 * cannot see and which costs the kernel its speed on a GPU.  The other
 * templates are reported only.  Case widths counts the 16-byte global
 * accesses of the MoE copy kernels in their PTX.
 *
 * What is compiled:
 *  - every template of ej_tmpl_names() as the library builds it; attention
 *    for each instantiation in attn_inst below (dtype x head-dim
 *    registers), the others with their default defines;
 *  - the CUDA C of the tiny Qwen3-MoE model's compiled regions
 *    (epj_engine_emit_cuda: every segment's forward and backward graph),
 *    f32 and bf16, model regions (autoep_non_moe) and the full model.
 * Without NVRTC (configure found no toolkit) the compiling cases print why
 * and return; the parser's case runs everywhere.  About 25 s of CPU,
 * almost all of it in ptxas.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "check_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cc.h"
#include "jit_impl.h"
#include "tmpl.h"

Suite *make_ptxas_suite(void);

#define PTXAS_ARCH "sm_90"
#define MAX_FNS	   64

/* Attention instantiations compiled (EJ_ATTN_DT: 0 f32, 1 bf16, 2 f64;
 * EJ_ATTN_DL: head dims up to 32 * DL): head dim 128 in every dtype, and
 * the other head dims in bf16, the training dtype, up to 256 (MLA's 192
 * at DL 6), where the tensor-core forward's accumulators are largest.  The
 * other six (f32 and f64 at DL 1-3), a few seconds of ptxas each, were clean
 * too when this list was made (doc/templates.md has all twelve). */
static const struct {
	int dt, dl;
} attn_inst[] = { { 0, 4 }, { 1, 4 }, { 2, 4 }, { 1, 1 },
		  { 1, 2 }, { 1, 3 }, { 1, 6 }, { 1, 8 } };

/* Gated delta rule instantiations (EJ_DELTA_F64, EJ_DELTA_NU: keys per
 * lane, Dk up to 16 NU): every one the host builds. */
static const struct {
	int f64, nu;
} delta_inst[] = {
	{ 0, 4 }, { 0, 8 }, { 0, 16 }, { 1, 4 }, { 1, 8 }, { 1, 16 }
};

static bool have_nvrtc(const char *test)
{
	int maj = 0, min = 0;
	if (ej_nvrtc_version(&maj, &min))
		return true;
	printf("%s: built without NVRTC (configure found no CUDA toolkit), "
	       "skipped\n",
	       test);
	return false;
}

static void table_head(const char *what)
{
	printf("\nptxas %s, %s (bytes per thread)\n", PTXAS_ARCH, what);
	printf("%-34s %-22s %5s %6s %6s %6s  %s\n", "unit", "kernel", "regs",
	       "stack", "spillS", "spillL", "");
}

/* Compiles source (unit name `unit`) for PTXAS_ARCH with the report, prints
 * a row per function and appends every problem of a strict unit to
 * fails[0..n).  Returns the number of entry functions reported. */
static int ptxas_unit(epj_ctx *ctx, const char *unit, const char *source,
		      bool strict, char *fails, size_t n)
{
	const char *opts[] = { EJ_NVRTC_OPT_PTXAS_REPORT };
	ej_nvrtc_result r = { 0 };
	epj_status st =
	    ej_nvrtc_compile(ctx, source, unit, PTXAS_ARCH, opts, 1, &r);
	ck_assert_msg(st == EPJ_OK, "%s: %s", unit, epj_ctx_error(ctx));
	ck_assert_msg(!r.is_ptx, "%s: no cubin for %s", unit, PTXAS_ARCH);
	ej_ptxas_usage u[MAX_FNS];
	int nf = ej_ptxas_report_parse(r.log, u, MAX_FNS);
	ck_assert_msg(nf >= 1, "%s: no ptxas report in the log:\n%.600s", unit,
		      r.log);
	int entries = 0;
	for (int i = 0; i < nf; i++) {
		const ej_ptxas_usage *f = &u[i];
		entries += f->entry;
		bool bad = f->stack || f->spill_stores || f->spill_loads;
		const char *mark = !bad ? "" : strict ? "FAIL" : "(reported)";
		printf("%-34s %-22s %5d %6d %6d %6d  %s\n", unit, f->name,
		       f->registers, f->stack, f->spill_stores, f->spill_loads,
		       mark);
		if (strict && bad)
			tu_report(
			    fails, n,
			    "\n  %s %s: %d bytes stack frame, %d/%d bytes "
			    "spill stores/loads",
			    unit, f->name, f->stack, f->spill_stores,
			    f->spill_loads);
		ck_assert_msg(!f->entry || f->registers >= 0,
			      "%s %s: no register count", unit, f->name);
	}
	ej_nvrtc_result_free(&r);
	return entries;
}

/* ---- the parser ------------------------------------------------------------
 */

/* NVRTC 13's log with -Xptxas -v: an entry with a frame and spills, a
 * device function reported before the entries, lines that are not part
 * of the report, and too many functions for the array. */
START_TEST(test_parse)
{
	static const char log[] =
	    "ptxas info    : 0 bytes gmem\n"
	    "ptxas info    : Function properties for _Z6helperi\n"
	    "    16 bytes stack frame, 4 bytes spill stores, 8 bytes spill "
	    "loads\n"
	    "ptxas info    : Compiling entry function 'ej_attn_bwd_dkdv' for "
	    "'sm_90'\n"
	    "ptxas info    : Function properties for ej_attn_bwd_dkdv\n"
	    "ptxas         .     128 bytes stack frame, 32 bytes spill "
	    "stores, 44 bytes spill loads\n"
	    "ptxas info    : Used 40 registers, used 1 barriers, 128 bytes "
	    "cumulative stack size\n"
	    "ptxas info    : Compile time = 2364.010 ms\n"
	    "k.cu(3): warning #177-D: variable \"x\" was declared but never "
	    "referenced\n"
	    "ptxas info    : Compiling entry function 'ej_fill' for 'sm_90'\n"
	    "ptxas info    : Function properties for ej_fill\n"
	    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, "
	    "0 bytes spill loads\n"
	    "ptxas info    : Used 24 registers, 384 bytes cmem[0]";
	ej_ptxas_usage u[4];
	ck_assert_int_eq(ej_ptxas_report_parse(log, u, 4), 3);
	ck_assert_str_eq(u[0].name, "_Z6helperi");
	ck_assert(!u[0].entry);
	ck_assert_int_eq(u[0].registers, -1);
	ck_assert_int_eq(u[0].stack, 16);
	ck_assert_int_eq(u[0].spill_stores, 4);
	ck_assert_int_eq(u[0].spill_loads, 8);
	ck_assert_str_eq(u[1].name, "ej_attn_bwd_dkdv");
	ck_assert(u[1].entry);
	ck_assert_int_eq(u[1].registers, 40);
	ck_assert_int_eq(u[1].stack, 128);
	ck_assert_int_eq(u[1].spill_stores, 32);
	ck_assert_int_eq(u[1].spill_loads, 44);
	ck_assert_str_eq(u[2].name, "ej_fill");
	ck_assert(u[2].entry);
	ck_assert_int_eq(u[2].registers, 24);
	ck_assert_int_eq(u[2].stack + u[2].spill_stores + u[2].spill_loads, 0);
	ck_assert_int_eq(ej_ptxas_report_parse(log, u, 2), -1);
	ck_assert_int_eq(ej_ptxas_report_parse("", u, 4), 0);
	ck_assert_int_eq(ej_ptxas_report_parse(NULL, u, 4), 0);
	ck_assert_int_eq(
	    ej_ptxas_report_parse("k.cu(1): error: expected a \";\"\n", u, 4),
	    0);
}
END_TEST

/* ---- templates
 * ---------------------------------------------------------------
 */

static void template_unit(epj_ctx *ctx, const char *name, const char *defines,
			  const char *unit, char *fails, size_t n)
{
	ej_arena *A = ej_arena_new();
	const char *src = ej_tmpl_source(ctx, A, name, defines);
	ck_assert_msg(src != NULL, "%s: %s", name, epj_ctx_error(ctx));
	bool strict = strcmp(name, "gemm") == 0 ||
		      strcmp(name, "attention") == 0 ||
		      strcmp(name, "delta") == 0 || strcmp(name, "moe") == 0 ||
		      strcmp(name, "optim") == 0;
	int entries = ptxas_unit(ctx, unit, src, strict, fails, n);
	ck_assert_msg(entries >= 1, "%s: no entry function reported", unit);
	ej_arena_free(A);
}

START_TEST(test_templates)
{
	if (!have_nvrtc("test_templates"))
		return;
	epj_ctx *ctx = tu_ctx();
	char fails[4096] = "";
	table_head("templates");
	/* units: every template, every attention and delta instantiation
	 * (a third of them under EPJIT_CHECK_QUICK: tu_quick_keep) */
	int n_attn = 0, units = 0;
	for (const char *const *t = ej_tmpl_names(); *t; t++) {
		if (strcmp(*t, "delta") == 0) {
			for (size_t i = 0; i < EJ_ARRAY_LEN(delta_inst); i++) {
				char defs[96], unit[64];
				snprintf(defs, sizeof defs,
					 "#define EJ_DELTA_F64 %d\n"
					 "#define EJ_DELTA_NU %d",
					 delta_inst[i].f64, delta_inst[i].nu);
				snprintf(unit, sizeof unit, "delta %s dk<=%d",
					 delta_inst[i].f64 ? "f64" : "f32",
					 16 * delta_inst[i].nu);
				if (tu_quick_keep(units++))
					template_unit(ctx, *t, defs, unit,
						      fails, sizeof fails);
			}
			continue;
		}
		if (strcmp(*t, "attention") != 0) {
			if (tu_quick_keep(units++))
				template_unit(ctx, *t, NULL, *t, fails,
					      sizeof fails);
			continue;
		}
		for (size_t i = 0; i < EJ_ARRAY_LEN(attn_inst); i++) {
			char defs[96], unit[64];
			snprintf(defs, sizeof defs,
				 "#define EJ_ATTN_DT %d\n#define EJ_ATTN_DL %d",
				 attn_inst[i].dt, attn_inst[i].dl);
			snprintf(unit, sizeof unit, "attention %s hd<=%d",
				 attn_inst[i].dt == 2	? "f64"
				 : attn_inst[i].dt == 1 ? "bf16"
							: "f32",
				 32 * attn_inst[i].dl);
			if (tu_quick_keep(units++))
				template_unit(ctx, *t, defs, unit, fails,
					      sizeof fails);
			n_attn++;
		}
	}
	ck_assert_int_eq(n_attn, (int)EJ_ARRAY_LEN(attn_inst));
	ck_assert_msg(!fails[0], "local memory in strict kernels:%s", fails);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- load and store widths of the MoE copy kernels -------------------------
 */

/* The PTX of kernel fn in ptx: from its ".entry fn(" to the next entry
 * (*end; NULL when it is the last), or NULL when ptx has no such entry. */
static const char *ptx_entry(const char *ptx, const char *fn, const char **end)
{
	char head[160];
	snprintf(head, sizeof head, ".entry %s(", fn);
	const char *p = strstr(ptx, head);
	*end = p ? strstr(p + 1, ".entry ") : NULL;
	return p;
}

/* The 16-byte global loads and stores in the PTX of entry `fn` of ptx
 * (ld.global[.nc][.vN].<type><bits>, st.global likewise).  Returns false
 * when the entry is not in ptx. */
static bool ptx_widths(const char *ptx, const char *fn, int *ld, int *st)
{
	const char *end, *p = ptx_entry(ptx, fn, &end);
	if (!p)
		return false;
	*ld = *st = 0;
	for (const char *q = p;
	     (q = strstr(q, ".global.")) && (!end || q < end); q++) {
		const char *op = q;
		while (op > p && op[-1] != '\t' && op[-1] != ' ' &&
		       op[-1] != '\n')
			op--;
		bool is_ld = strncmp(op, "ld.", 3) == 0;
		bool is_st = strncmp(op, "st.", 3) == 0;
		if (!is_ld && !is_st)
			continue;
		int vec = 1, bits = 0;
		const char *t = q + strlen(".global");
		while (*t == '.') {
			t++;
			if (t[0] == 'v' && (t[1] == '2' || t[1] == '4'))
				vec = t[1] - '0';
			else if (strchr("ubsf", t[0]) && t[1] >= '0' &&
				 t[1] <= '9')
				bits = atoi(t + 1);
			while (*t && *t != '.' && *t != ' ' && *t != '\t')
				t++;
		}
		if (vec * bits / 8 == 16)
			++*(is_ld ? ld : st);
	}
	return true;
}

/* The kernels that move rows or elements of activations: each has a path
 * of 16-byte loads and stores for aligned data (the host takes it when
 * rows and buffers allow, counting moe.rows.vec16).  Narrower accesses
 * there would cost the copy most of its bandwidth on a GPU, and cuda-sim
 * cannot see it: this case counts the 16-byte accesses in the PTX.  The
 * least each kernel must have: one per array it moves in every
 * instantiation, 3 dtypes x 2 index widths (the permute moves raw 16-byte
 * words: 2 instantiations); unrolling only adds to these. */
static const struct {
	const char *fn;
	int ld, st; /* arrays loaded and stored */
	int inst;
} moe_copy_kernels[] = {
	{ "ej_moe_permute", 1, 1, 2 }, { "ej_moe_permute_bw", 1, 1, 6 },
	{ "ej_moe_combine", 1, 1, 6 }, { "ej_moe_combine_bw_y", 1, 1, 6 },
	{ "ej_swiglu_fwd", 2, 1, 6 },  { "ej_swiglu_bwd", 3, 2, 6 },
};

START_TEST(test_widths)
{
	if (!have_nvrtc("test_widths"))
		return;
	epj_ctx *ctx = tu_ctx();
	ej_arena *A = ej_arena_new();
	const char *src = ej_tmpl_source(ctx, A, "moe", NULL);
	ck_assert_msg(src != NULL, "moe: %s", epj_ctx_error(ctx));
	const char *opts[] = { EJ_NVRTC_OPT_KEEP_PTX };
	ej_nvrtc_result r = { 0 };
	ck_assert_msg(ej_nvrtc_compile(ctx, src, "moe", PTXAS_ARCH, opts, 1,
				       &r) == EPJ_OK,
		      "moe: %s", epj_ctx_error(ctx));
	ck_assert_msg(r.ptx != NULL, "moe: no PTX kept");
	printf("\n16-byte global loads and stores, moe, PTX for %s\n",
	       PTXAS_ARCH);
	char fails[1024] = "";
	for (size_t i = 0; i < EJ_ARRAY_LEN(moe_copy_kernels); i++) {
		int ld = 0, st = 0;
		const char *fn = moe_copy_kernels[i].fn;
		const int n = moe_copy_kernels[i].inst;
		const int want_ld = moe_copy_kernels[i].ld * n;
		const int want_st = moe_copy_kernels[i].st * n;
		ck_assert_msg(ptx_widths(r.ptx, fn, &ld, &st),
			      "%s: not in the PTX", fn);
		printf("%-22s %3d %3d (at least %d %d)\n", fn, ld, st, want_ld,
		       want_st);
		if (ld < want_ld || st < want_st)
			tu_report(fails, sizeof fails,
				  "\n  %s: %d 16-byte loads, %d stores; "
				  "expected at least %d and %d",
				  fn, ld, st, want_ld, want_st);
	}
	/* the parser itself, on lines of the forms it reads */
	static const char probe[] =
	    ".visible .entry k(\n\tld.global.nc.v4.u32 {%r1, %r2, %r3, "
	    "%r4}, [%rd1];\n\tld.global.u16 %rs1, [%rd2];\n\t"
	    "st.global.v2.f64 [%rd3], {%fd1, %fd2};\n\tst.global.b8 [%rd4], "
	    "%rs2;\n}\n.visible .entry k2(\n\tld.global.v2.u64 {%rd5, "
	    "%rd6}, [%rd7];\n}\n";
	int ld = 0, st = 0;
	ck_assert(ptx_widths(probe, "k", &ld, &st));
	ck_assert_int_eq(ld, 1);
	ck_assert_int_eq(st, 1);
	ck_assert(ptx_widths(probe, "k2", &ld, &st));
	ck_assert_int_eq(ld, 1);
	ck_assert_int_eq(st, 0);
	ck_assert(!ptx_widths(probe, "k3", &ld, &st));
	ej_nvrtc_result_free(&r);
	ej_arena_free(A);
	epj_ctx_free(ctx);
	ck_assert_msg(!fails[0], "MoE copy kernels short of 16-byte access:%s",
		      fails);
}
END_TEST

/* ---- fused kernels
 * -----------------------------------------------------------
 */

/* The tiny model of the compile tests (t/check_compile.c), two layers. */
static char *write_model_config(const char *dir)
{
	char *path = tu_path(dir, "config.json");
	tu_write_text(path,
		      "{\"model_type\": \"qwen3_moe\", \"vocab_size\": 64, "
		      "\"hidden_size\": 32, \"num_hidden_layers\": 2, "
		      "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
		      "\"head_dim\": 8, \"intermediate_size\": 64, "
		      "\"moe_intermediate_size\": 32, \"num_experts\": 4, "
		      "\"num_experts_per_tok\": 2, \"norm_topk_prob\": true, "
		      "\"max_position_embeddings\": 256, "
		      "\"tie_word_embeddings\": false}\n");
	return path;
}

/* The CUDA C units of the model's regions (bf16 or f32; autoep: model
 * regions, else the full model) compiled with the report, every kernel
 * strict.  Returns the number of kernels. */
static int fused_units(epj_ctx *ctx, const char *cfg, bool bf16, bool autoep,
		       char *fails, size_t n)
{
	epj_model_opts o = { .layout = EPJ_LAYOUT_NESTED,
			     .seed = 7,
			     .dtype = EPJ_DTYPE_F32 };
	epj_model *m = NULL;
	ck_assert_msg(epj_model_new(ctx, cfg, &o, &m) == EPJ_OK, "model: %s",
		      epj_ctx_error(ctx));
	char json[256];
	snprintf(json, sizeof json,
		 "{\"train_micro_batch_size_per_gpu\": 3, \"bf16\": "
		 "{\"enabled\": %s}, \"compile\": {\"autoep_non_moe\": %s, "
		 "\"backend\": \"interpreter\"}}",
		 bf16 ? "true" : "false", autoep ? "true" : "false");
	epj_engine *e = NULL;
	ck_assert_msg(epj_engine_initialize_json(ctx, m, json, "ptxas", &e) ==
			  EPJ_OK,
		      "engine: %s", epj_ctx_error(ctx));
	int64_t shp[2] = { 3, 13 };
	epj_tensor *ids = epj_randint(ctx, EPJ_DTYPE_I64, 2, shp, 0, 64);
	epj_tensor *lab = epj_randint(ctx, EPJ_DTYPE_I64, 2, shp, 0, 64);
	tu_ok(ctx, ids);
	tu_ok(ctx, lab);
	char *dir = tu_tmpdir_new("ptxas-emit");
	int units = 0;
	ck_assert_msg(epj_engine_emit_cuda(e, ids, lab, dir, false, &units) ==
			  EPJ_OK,
		      "emit: %s", epj_ctx_error(ctx));
	ck_assert_int_ge(units, 1);
	char **names = NULL;
	int nn = tu_list_dir(dir, false, &names), kernels = 0, seen = 0;
	for (int i = 0; i < nn; i++) {
		size_t l = strlen(names[i]);
		if (l < 4 || strcmp(names[i] + l - 3, ".cu") != 0)
			continue;
		char *path = tu_path(dir, names[i]);
		char *src = tu_slurp(path, NULL);
		ck_assert_ptr_nonnull(src);
		int globals = 0;
		for (const char *p = src; (p = strstr(p, "__global__")); p++)
			globals++;
		/* "<16 hex digits of the graph>-forward.cu": 8 of them */
		char unit[96];
		size_t cut = l > 20 && names[i][16] == '-' ? 8 : 0;
		snprintf(unit, sizeof unit, "%s %s %.8s%.*s",
			 bf16 ? "bf16" : "f32", autoep ? "regions" : "full",
			 names[i], (int)(l - 3 - 8 - cut), names[i] + 8 + cut);
		int entries = ptxas_unit(ctx, unit, src, true, fails, n);
		ck_assert_msg(entries == globals,
			      "%s: %d kernels, %d in the report", unit, globals,
			      entries);
		kernels += entries;
		seen++;
		free(src);
		free(path);
	}
	ck_assert_int_eq(seen, units);
	tu_free_names(names, nn);
	tu_tmpdir_free(dir);
	epj_tensor_free(ids);
	epj_tensor_free(lab);
	epj_engine_free(e);
	epj_model_free(m);
	return kernels;
}

START_TEST(test_fused)
{
	if (!have_nvrtc("test_fused"))
		return;
	epj_ctx *ctx = tu_ctx();
	char *dir = tu_tmpdir_new("ptxas-model");
	char *cfg = write_model_config(dir);
	char fails[4096] = "";
	table_head("fused kernels of the tiny Qwen3-MoE model");
	int kernels = 0;
	for (int bf16 = 0; bf16 < 2; bf16++)
		for (int autoep = 1; autoep >= 0; autoep--)
			kernels += fused_units(ctx, cfg, bf16, autoep, fails,
					       sizeof fails);
	ck_assert_int_ge(kernels, 4);
	ck_assert_msg(!fails[0], "local memory in fused kernels:%s", fails);
	free(cfg);
	tu_tmpdir_free(dir);
	epj_ctx_free(ctx);
}
END_TEST

/* ---- tensor cores in the attention template ------------------------------
 * The bf16 attention module's tensor-core kernels (forward, dq, dk/dv in
 * two passes, and in one up to head dim 128) issue mma.sync m16n8k16 and
 * ldmatrix: the PTX of the sm_90 compile (kept
 * with EJ_NVRTC_OPT_KEEP_PTX, what ptxas read) is searched between each
 * kernel's .entry and the next one.  Head dims up to 128, 192 (MLA) and
 * 256. */
static int count_in(const char *from, const char *to, const char *what)
{
	int n = 0;
	for (const char *p = strstr(from, what); p && (!to || p < to);
	     p = strstr(p + 1, what))
		n++;
	return n;
}

START_TEST(test_attn_tensor_cores)
{
	if (!have_nvrtc("test_attn_tensor_cores"))
		return;
	epj_ctx *ctx = tu_ctx();
	static const int dls[] = { 4, 6, 8 };
	for (size_t i = 0; i < EJ_ARRAY_LEN(dls); i++) {
		if (!tu_quick_keep((int)i))
			continue;
		char defs[96];
		snprintf(defs, sizeof defs,
			 "#define EJ_ATTN_DT 1\n#define EJ_ATTN_DL %d", dls[i]);
		ej_arena *A = ej_arena_new();
		const char *src = ej_tmpl_source(ctx, A, "attention", defs);
		ck_assert_msg(src != NULL, "%s", epj_ctx_error(ctx));
		ej_nvrtc_result r = { 0 };
		const char *opts[] = { EJ_NVRTC_OPT_KEEP_PTX };
		ck_assert_msg(ej_nvrtc_compile(ctx, src, "attention",
					       PTXAS_ARCH, opts, 1,
					       &r) == EPJ_OK,
			      "DL %d: %s", dls[i], epj_ctx_error(ctx));
		ck_assert_msg(r.ptx != NULL, "DL %d: no PTX", dls[i]);
		/* dk/dv in one pass only up to head dim 128 (DL 4) */
		static const char *const kn[] = { "ej_attn_fwd_tc",
						  "ej_attn_bwd_dq_tc",
						  "ej_attn_bwd_dkdv_tc",
						  "ej_attn_bwd_dkdv1_tc" };
		size_t nk = EJ_ARRAY_LEN(kn) - (dls[i] > 4);
		for (size_t k = 0; k < nk; k++) {
			const char *next, *e = ptx_entry(r.ptx, kn[k], &next);
			ck_assert_msg(e != NULL, "DL %d: no %s", dls[i], kn[k]);
			int mma = count_in(
			    e, next,
			    "mma.sync.aligned.m16n8k16.row.col.f32.bf16");
			int ldm = count_in(e, next, "ldmatrix.sync.aligned");
			printf("attention bf16 hd<=%d %s: %d mma.sync, %d "
			       "ldmatrix in the PTX\n",
			       32 * dls[i], kn[k], mma, ldm);
			ck_assert_msg(mma > 0 && ldm > 0,
				      "DL %d: %s has %d mma.sync and %d "
				      "ldmatrix",
				      dls[i], kn[k], mma, ldm);
		}
		ej_nvrtc_result_free(&r);
		ej_arena_free(A);
	}
	epj_ctx_free(ctx);
}
END_TEST

Suite *make_ptxas_suite(void)
{
	Suite *s = suite_create("ptxas");
	TCase *tc = tcase_create("parse");
	tcase_add_test(tc, test_parse);
	suite_add_tcase(s, tc);
	tc = tcase_create("templates");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_templates);
	tcase_add_test(tc, test_attn_tensor_cores);
	suite_add_tcase(s, tc);
	tc = tcase_create("fused");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_fused);
	suite_add_tcase(s, tc);
	tc = tcase_create("widths");
	tcase_set_timeout(tc, 300);
	tcase_add_test(tc, test_widths);
	suite_add_tcase(s, tc);
	return s;
}
