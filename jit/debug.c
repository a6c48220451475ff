/* debug.c -- EPJIT_DEBUG_DUMP=dir: the IR of every compiled graph after each
 * pass (dir/graphs/<seq>-<sig>-<pass>.txt), an index of the compiled
 * segments (dir/graphs.jsonl, one JSON object a line), the recompiles with
 * their guard failures (dir/recompiles.txt), the provenance of every
 * compiled region variant (dir/provenance.jsonl: its module, the parameter
 * name behind each "param i" of its graphs, its steps in order with each
 * segment's signature or each break's module, and where each step's
 * activation inputs come from) and the counters (dir/counters.json).
 * epjit-dump reads them.
 *
 * Dumping is best effort: a failure to write is logged, never an error of
 * the compile.
 */
#include "jit_impl.h"
#include "kir.h"

#include <errno.h>
#include <stdio.h>
#include <sys/stat.h>

/* rank of a multi-rank run (ej_debug_dump_set_rank), -1 for a world of one */
static int dump_rank = -1;

void ej_debug_dump_set_rank(int rank, int size)
{
	dump_rank = size > 1 ? rank : -1;
}

const char *ej_debug_dump_dir(void)
{
	const char *d = getenv("EPJIT_DEBUG_DUMP");
	if (!d || !*d)
		return NULL;
	if (dump_rank < 0)
		return d;
	/* one folder per rank, DIR/rank<N> (epjit-dump shows them side by
	 * side); the buffer is rebuilt each call, the variable may change */
	static _Thread_local char buf[4096];
	if (mkdir(d, 0755) != 0 && errno != EEXIST)
		return d;
	snprintf(buf, sizeof buf, "%s/rank%d", d, dump_rank);
	return buf;
}

static void mkdir_p(const char *dir)
{
	if (mkdir(dir, 0755) != 0 && errno != EEXIST)
		epj_log_msg(EPJ_LOG_WARN, "debug dump: cannot create %s: %s",
			    dir, strerror(errno));
}

void ej_debug_dump_graph(ej_jit *jit, ej_graph *g, const char *pass)
{
	const char *dir = ej_debug_dump_dir();
	if (!dir)
		return;
	char sub[4096], path[4200];
	mkdir_p(dir);
	snprintf(sub, sizeof sub, "%s/graphs", dir);
	mkdir_p(sub);
	snprintf(path, sizeof path, "%s/%03d-%.12s-%s.txt", sub,
		 jit->compile_seq, g->name, pass);
	FILE *f = fopen(path, "w");
	if (!f) {
		epj_log_msg(EPJ_LOG_WARN, "debug dump: cannot write %s: %s",
			    path, strerror(errno));
		return;
	}
	fprintf(f, "# %s after %s (%d live nodes)\n%s", g->name, pass,
		ej_graph_live_nodes(g), ej_graph_text(g));
	fclose(f);
}

void ej_debug_dump_compile_time(ej_jit *jit, const char *sig, double ms,
				int fwd_nodes, int bwd_nodes)
{
	const char *dir = ej_debug_dump_dir();
	if (!dir)
		return;
	char path[4200];
	mkdir_p(dir);
	snprintf(path, sizeof path, "%s/compile_times.txt", dir);
	FILE *f = fopen(path, "a");
	if (!f) {
		epj_log_msg(EPJ_LOG_WARN, "debug dump: cannot write %s: %s",
			    path, strerror(errno));
		return;
	}
	fprintf(f, "%03d %s %.3f ms forward %d nodes backward %d nodes (%s)\n",
		jit->compile_seq, sig, ms, fwd_nodes, bwd_nodes,
		ej_backend_name(jit->backend));
	fclose(f);
}

epj_status ej_debug_dump_counters(epj_ctx *ctx, const char *dir)
{
	char path[4200];
	mkdir_p(dir);
	snprintf(path, sizeof path, "%s/counters.json", dir);
	epj_counters *c = epj_counters_snapshot(ctx);
	char *js = c ? epj_counters_to_json(c) : NULL;
	epj_counters_free(c);
	if (!js)
		return ej_error(ctx, EPJ_ERR_NOMEM,
				"debug dump: out of memory");
	FILE *f = fopen(path, "w");
	if (!f) {
		free(js);
		return ej_error(ctx, EPJ_ERR_IO,
				"debug dump: cannot write %s: %s", path,
				strerror(errno));
	}
	fputs(js, f);
	fputc('\n', f);
	free(js);
	if (fclose(f) != 0)
		return ej_error(ctx, EPJ_ERR_IO, "debug dump: error writing %s",
				path);
	return EPJ_OK;
}

/* Appends `rel` to the JSON array text in sb when dir/rel exists. */
static void add_path(ej_sbuf *sb, const char *dir, const char *rel, int *n)
{
	char full[8400];
	struct stat st;
	snprintf(full, sizeof full, "%s/%s", dir, rel);
	if (stat(full, &st) != 0)
		return;
	ej_sb_printf(sb, "%s\"%s\"", (*n)++ ? ", " : "", rel);
}

static int kernels_of(const ej_segment *s, void *state)
{
	if (!state || !s->backend->kernels)
		return 0;
	return s->backend->kernels(state);
}

void ej_debug_dump_segment(ej_jit *jit, const ej_segment *s, bool train,
			   int segment)
{
	const char *dir = ej_debug_dump_dir();
	if (!dir)
		return;
	static const char *const passes[] = {
		"0-traced",	    "1-dce-cse",       "2-joint-forward",
		"2-joint-backward", "3-forward-final", "3-backward-final",
	};
	ej_sbuf sb = { 0 };
	ej_sb_printf(&sb,
		     "{\"seq\": %d, \"signature\": \"%s\", \"mode\": "
		     "\"%s\", \"backend\": \"%s\", \"segment\": %d, "
		     "\"fwd_nodes\": %d, \"bwd_nodes\": %d, "
		     "\"fwd_kernels\": %d, \"bwd_kernels\": %d, "
		     "\"compile_ms\": %.3f, \"ir\": [",
		     jit->compile_seq, s->sig_hex, train ? "train" : "eval",
		     ej_backend_name(jit->backend), segment,
		     ej_graph_live_nodes(s->fwd),
		     s->bwd ? ej_graph_live_nodes(s->bwd) : 0,
		     kernels_of(s, s->fwd_state), kernels_of(s, s->bwd_state),
		     s->compile_ms);
	int n = 0;
	char rel[256];
	for (size_t i = 0; i < EJ_ARRAY_LEN(passes); i++) {
		snprintf(rel, sizeof rel, "graphs/%03d-%.12s-%s.txt",
			 jit->compile_seq, s->sig_hex, passes[i]);
		add_path(&sb, dir, rel, &n);
	}
	ej_sb_puts(&sb, "], \"sources\": [");
	n = 0;
	ej_graph *gs[2] = { s->fwd, s->bwd };
	static const char *const exts[] = { "txt", "c", "cu" };
	for (int g = 0; g < 2; g++) {
		if (!gs[g])
			continue;
		char name[48];
		ej_codegen_graph_name(gs[g], name);
		for (size_t e = 0; e < EJ_ARRAY_LEN(exts); e++) {
			snprintf(rel, sizeof rel, "kernels/%03d-%s.%s",
				 jit->compile_seq, name, exts[e]);
			add_path(&sb, dir, rel, &n);
		}
	}
	ej_sb_puts(&sb, "]}\n");
	char path[4200];
	mkdir_p(dir);
	snprintf(path, sizeof path, "%s/graphs.jsonl", dir);
	FILE *f = fopen(path, "a");
	if (!f) {
		epj_log_msg(EPJ_LOG_WARN, "debug dump: cannot write %s: %s",
			    path, strerror(errno));
	} else {
		fputs(sb.p ? sb.p : "", f);
		fclose(f);
	}
	free(sb.p);
}

void ej_debug_dump_recompile(const char *region, int variant,
			     const char *reason)
{
	const char *dir = ej_debug_dump_dir();
	if (!dir)
		return;
	char path[4200];
	mkdir_p(dir);
	snprintf(path, sizeof path, "%s/recompiles.txt", dir);
	FILE *f = fopen(path, "a");
	if (!f) {
		epj_log_msg(EPJ_LOG_WARN, "debug dump: cannot write %s: %s",
			    path, strerror(errno));
		return;
	}
	/* one line: tabs and newlines of the reason become blanks */
	fprintf(f, "%s\t%d\t", region[0] ? region : "<root>", variant);
	for (const char *c = reason; *c; c++)
		fputc(*c == '\t' || *c == '\n' ? ' ' : *c, f);
	fputc('\n', f);
	fclose(f);
}

/* A JSON string of s (quotes, backslashes and control bytes escaped). */
static void sb_json_str(ej_sbuf *sb, const char *s)
{
	ej_sb_puts(sb, "\"");
	for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
		if (*c == '"' || *c == '\\')
			ej_sb_printf(sb, "\\%c", *c);
		else if (*c < 0x20)
			ej_sb_printf(sb, "\\u%04x", *c);
		else
			ej_sb_printf(sb, "%c", *c);
	}
	ej_sb_puts(sb, "\"");
}

/* What trace value v of f is, for a reader of the IR: a region input, or an
 * output of an earlier step. */
static void sb_value_origin(ej_sbuf *sb, const ej_region_fn *f, int v)
{
	if (v < f->trace->n_in) {
		ej_sb_printf(sb, "\"region input %d\"", v);
		return;
	}
	for (int k = 0; k < f->n_steps; k++)
		for (int o = 0; o < f->steps[k].n_out; o++)
			if (f->steps[k].out[o] == v) {
				ej_sb_printf(sb, "\"output %d of step %d\"", o,
					     k);
				return;
			}
	ej_sb_printf(sb, "\"value %d\"", v);
}

void ej_debug_dump_provenance(const ej_region_fn *f, const char *region,
			      const char *kind, int variant,
			      const char *const *params, int n_params,
			      const char *(*callee_name)(const void *callee))
{
	const char *dir = ej_debug_dump_dir();
	if (!dir || !f)
		return;
	ej_sbuf sb = { 0 };
	ej_sb_puts(&sb, "{\"region\": ");
	sb_json_str(&sb, region[0] ? region : "<root>");
	ej_sb_puts(&sb, ", \"kind\": ");
	sb_json_str(&sb, kind ? kind : "");
	ej_sb_printf(&sb, ", \"variant\": %d, \"mode\": \"%s\", \"params\": [",
		     variant, f->trace->grad_mode ? "train" : "eval");
	for (int i = 0; i < n_params; i++) {
		if (i)
			ej_sb_puts(&sb, ", ");
		sb_json_str(&sb, params[i] ? params[i] : "");
	}
	ej_sb_puts(&sb, "], \"steps\": [");
	for (int k = 0; k < f->n_steps; k++) {
		const ej_region_step *st = &f->steps[k];
		if (k)
			ej_sb_puts(&sb, ", ");
		if (st->is_break) {
			ej_sb_puts(&sb, "{\"break\": ");
			sb_json_str(&sb,
				    callee_name ? callee_name(st->callee) : "");
		} else {
			ej_sb_printf(&sb, "{\"segment\": \"%s\"",
				     st->seg->sig_hex);
		}
		ej_sb_puts(&sb, ", \"inputs\": [");
		for (int j = 0; j < st->n_in; j++) {
			if (j)
				ej_sb_puts(&sb, ", ");
			sb_value_origin(&sb, f, st->in[j]);
		}
		ej_sb_puts(&sb, "]}");
	}
	ej_sb_puts(&sb, "]}\n");
	char path[4200];
	mkdir_p(dir);
	snprintf(path, sizeof path, "%s/provenance.jsonl", dir);
	FILE *fp = fopen(path, "a");
	if (!fp) {
		epj_log_msg(EPJ_LOG_WARN, "debug dump: cannot write %s: %s",
			    path, strerror(errno));
	} else {
		fputs(sb.p ? sb.p : "", fp);
		fclose(fp);
	}
	free(sb.p);
}
