/* debug.c -- EPJIT_DEBUG_DUMP=dir: the IR of every compiled graph after each
 * pass (dir/graphs/<sig>-<pass>.txt) and the counters (dir/counters.json).
 *
 * Dumping is best effort: a failure to write is logged, never an error of
 * the compile.
 */
#include "jit_impl.h"

#include <errno.h>
#include <stdio.h>
#include <sys/stat.h>

const char *ej_debug_dump_dir(void)
{
	const char *d = getenv("EPJIT_DEBUG_DUMP");
	return d && *d ? d : NULL;
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
