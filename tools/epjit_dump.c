/* epjit_dump.c -- epjit-dump: reads counter snapshots and debug dumps.
 *
 *   epjit-dump [--json] FILE.json  the counters, grouped as in
 *                                 doc/counters.md
 *   epjit-dump [--json] DIR        a debug dump (EPJIT_DEBUG_DUMP): the
 *                                 counters grouped, graph breaks with their
 *                                 reasons, recompiles with their guard
 *                                 failures (recompiles.txt), and each
 *                                 compiled segment (graphs.jsonl) with its
 *                                 signature, segment, node and kernel
 *                                 counts, compile time and the paths of its
 *                                 IR after each pass and its generated
 *                                 sources.  A dump with rank<N>/ folders
 *                                 (one per rank of a job) is summarized
 *                                 side by side, one column a rank.
 *   epjit-dump [--json] --diff A B
 *                                 each counter's change B - A (A and B are
 *                                 counter files or dump folders); compile
 *                                 counters are marked, and the exit status
 *                                 is 1 when any of them changed (the
 *                                 measured window of a run must show none).
 *                                 Two dumps with rank<N>/ folders are
 *                                 diffed rank by rank (the same ranks on
 *                                 both sides), 1 when any rank's compile
 *                                 counters changed.
 *
 * Compile counters: frames.*, stats.*, recompiles, graph_break.*,
 * compile.*, cache.misses.  Exit status: 0 ok (no compile-counter change),
 * 1 compile counters changed, 2 usage or input error.  Uses the public API
 * (epjit.h) and jansson for the graphs index and --json.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "epjit.h"

enum { EXIT_CHANGED = 1, EXIT_USAGE = 2, MAX_RANKS = 64 };

static bool json_out;

static void usage(FILE *f)
{
	fprintf(f,
		"usage: epjit-dump [--json] FILE.json\n"
		"       epjit-dump [--json] DIR     (an EPJIT_DEBUG_DUMP "
		"directory)\n"
		"       epjit-dump [--json] --diff A B   (counter files or "
		"dump directories)\n"
		"       epjit-dump --help\n"
		"Prints counters grouped (frames, graphs, graph breaks, "
		"recompiles, compile,\n"
		"cache, kernels, AutoEP, memory, train, other), and for a "
		"dump directory the\n"
		"recompiles with their guard failures and every compiled "
		"segment with its IR\n"
		"and source files; rank<N>/ folders are shown side by side.  "
		"--diff exits 1\n"
		"when a compile counter (frames.*, stats.*, recompiles, "
		"graph_break.*,\n"
		"compile.*, cache.misses) changed between A and B; wall "
		"times (*.ms, *.us,\n"
		"*_ms, *_us) are marked t and never count.  Two dumps with "
		"rank<N>/ folders\n"
		"are diffed rank by rank (the same ranks on both sides).  "
		"--json: one JSON\n"
		"object.\n");
}

static bool has_prefix(const char *s, const char *p)
{
	return !strncmp(s, p, strlen(p));
}

static bool has_suffix(const char *s, const char *x)
{
	size_t ls = strlen(s), lx = strlen(x);
	return ls >= lx && !strcmp(s + ls - lx, x);
}

/* A wall-time counter (compile.ms, compile.us, compile.cc_us,
 * compile.cached_us, comm.us, profile.*.us: a name ending in .ms, .us,
 * _ms or _us): it moves between any two runs, warm ones included, although
 * the work is the same, so it is reported but never makes a diff's compile
 * verdict.  The compile work itself is counted by frames.*, stats.*,
 * recompiles, graph_break.* and cache.misses. */
static bool is_wall_time(const char *n)
{
	return has_suffix(n, ".ms") || has_suffix(n, ".us") ||
	       has_suffix(n, "_ms") || has_suffix(n, "_us");
}

static bool is_compile_counter(const char *n)
{
	static const char *const prefixes[] = { "frames.", "stats.",
						"graph_break.", "compile." };
	for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++)
		if (has_prefix(n, prefixes[i]))
			return true;
	return !strcmp(n, "recompiles") || !strcmp(n, "cache.misses");
}

/* ---- groups (doc/counters.md) ---- */

static const char *const group_names[] = {
	"frames",  "graphs", "graph breaks", "compile", "cache",
	"kernels", "autoep", "memory",	     "train",	"other",
};
enum { N_GROUPS = sizeof group_names / sizeof group_names[0] };

static int group_of(const char *n)
{
	if (has_prefix(n, "frames.") || !strcmp(n, "recompiles"))
		return 0;
	if (has_prefix(n, "stats."))
		return 1;
	if (has_prefix(n, "graph_break."))
		return 2;
	if (has_prefix(n, "compile.") || has_prefix(n, "codegen."))
		return 3;
	if (has_prefix(n, "cache."))
		return 4;
	if (has_prefix(n, "kernels."))
		return 5;
	if (has_prefix(n, "autoep."))
		return 6;
	if (has_prefix(n, "memory."))
		return 7;
	if (has_prefix(n, "train."))
		return 8;
	return 9;
}

/* ---- files ---- */

/* Whole file as a NUL-terminated string, NULL (quiet when `quiet`). */
static char *read_file(const char *path, bool quiet)
{
	/* a regular file only, opened without blocking: a FIFO or a device
	 * named here would hang or never end */
	int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
	struct stat st;
	const char *why = NULL;
	if (fd < 0)
		why = strerror(errno);
	else if (fstat(fd, &st) != 0)
		why = strerror(errno);
	else if (!S_ISREG(st.st_mode))
		why = "not a regular file";
	else if (fcntl(fd, F_SETFL, O_RDONLY) != 0)
		why = strerror(errno);
	FILE *f = why ? NULL : fdopen(fd, "rb");
	if (!f) {
		if (!why)
			why = strerror(errno);
		if (fd >= 0)
			close(fd);
		if (!quiet)
			fprintf(stderr, "epjit-dump: cannot open %s: %s\n",
				path, why);
		return NULL;
	}
	size_t cap = 4096, n = 0;
	char *buf = malloc(cap);
	while (buf) {
		if (n + 1 >= cap) {
			char *nb = realloc(buf, cap * 2);
			if (!nb) {
				free(buf);
				buf = NULL;
				break;
			}
			buf = nb;
			cap *= 2;
		}
		size_t k = fread(buf + n, 1, cap - 1 - n, f);
		n += k;
		if (k == 0)
			break;
	}
	bool err = ferror(f);
	fclose(f);
	if (!buf || err) {
		fprintf(stderr, "epjit-dump: cannot read %s%s\n", path,
			buf ? "" : ": out of memory");
		free(buf);
		return NULL;
	}
	buf[n] = 0;
	return buf;
}

static bool is_dir(const char *p)
{
	struct stat sb;
	return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* Counters of a file, or of DIR/counters.json. */
static epj_counters *load(const char *path)
{
	char buf[4200];
	if (is_dir(path)) {
		snprintf(buf, sizeof buf, "%s/counters.json", path);
		struct stat sb;
		if (stat(buf, &sb) != 0) {
			fprintf(stderr,
				"epjit-dump: %s has no counters.json (written "
				"when the engine is freed)\n",
				path);
			return NULL;
		}
		path = buf;
	}
	char *js = read_file(path, false);
	if (!js)
		return NULL;
	epj_counters *c = epj_counters_from_json(js);
	free(js);
	if (!c)
		fprintf(stderr,
			"epjit-dump: %s is not a counters JSON object "
			"({\"name\": integer, ...})\n",
			path);
	return c;
}

/* The counters of a dump folder.  A folder without counters.json (the
 * engine writes it when freed, so a run killed by a signal leaves none)
 * that holds a dump's other files (graphs.jsonl, recompiles.txt, graphs/)
 * is still read: no counters, *partial set, and the rest shown. */
static epj_counters *load_dump(const char *dir, bool *partial)
{
	*partial = false;
	char p[4200];
	struct stat sb;
	snprintf(p, sizeof p, "%s/counters.json", dir);
	if (stat(p, &sb) == 0)
		return load(dir);
	static const char *const parts[] = { "graphs.jsonl", "recompiles.txt",
					     "graphs" };
	for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
		snprintf(p, sizeof p, "%s/%s", dir, parts[i]);
		if (stat(p, &sb) == 0) {
			*partial = true;
			fprintf(stderr,
				"epjit-dump: note: %s has no counters.json "
				"(written when the engine is freed: the run "
				"was killed or has not ended); its graphs and "
				"recompiles follow without counters\n",
				dir);
			return epj_counters_from_json("{}");
		}
	}
	return load(dir); /* says what is missing */
}

/* Indices of c's counters sorted by (group, name) (malloc'ed). */
static int *sorted(const epj_counters *c, int *n)
{
	int cnt = epj_counters_count(c);
	int *ix = malloc(sizeof *ix * (size_t)(cnt + 1));
	if (!ix)
		return NULL;
	for (int i = 0; i < cnt; i++)
		ix[i] = i;
	for (int i = 1; i < cnt; i++) {
		int v = ix[i], j = i;
		const char *nv = epj_counters_name_at(c, v);
		while (j > 0) {
			const char *np = epj_counters_name_at(c, ix[j - 1]);
			int gp = group_of(np), gv = group_of(nv);
			if (gp < gv || (gp == gv && strcmp(np, nv) <= 0))
				break;
			ix[j] = ix[j - 1];
			j--;
		}
		ix[j] = v;
	}
	*n = cnt;
	return ix;
}

/* ---- counters ---- */

static json_t *counters_json(const epj_counters *c)
{
	json_t *o = json_object();
	for (int g = 0; g < N_GROUPS; g++)
		json_object_set_new(o, group_names[g], json_object());
	for (int i = 0; i < epj_counters_count(c); i++) {
		const char *nm = epj_counters_name_at(c, i);
		json_object_set_new(
		    json_object_get(o, group_names[group_of(nm)]), nm,
		    json_integer(epj_counters_value_at(c, i)));
	}
	return o;
}

static void print_grouped(const epj_counters *c)
{
	int n = 0;
	int *ix = sorted(c, &n);
	if (!ix)
		return;
	int w = 0;
	for (int i = 0; i < n; i++) {
		int l = (int)strlen(epj_counters_name_at(c, i));
		w = l > w ? l : w;
	}
	int last = -1;
	for (int i = 0; i < n; i++) {
		const char *nm = epj_counters_name_at(c, ix[i]);
		int g = group_of(nm);
		if (g != last)
			printf("== %s\n", group_names[g]);
		last = g;
		printf("  %-*s %20" PRId64 "\n", w, nm,
		       epj_counters_value_at(c, ix[i]));
	}
	free(ix);
}

static int print_counters(const char *path)
{
	epj_counters *c = load(path);
	if (!c)
		return EXIT_USAGE;
	if (json_out) {
		json_t *o = json_object();
		json_object_set_new(o, "file", json_string(path));
		json_object_set_new(o, "counters", counters_json(c));
		json_dumpf(o, stdout, JSON_INDENT(2) | JSON_SORT_KEYS);
		putchar('\n');
		json_decref(o);
	} else {
		printf("# %s: %d counters\n", path, epj_counters_count(c));
		print_grouped(c);
	}
	epj_counters_free(c);
	return 0;
}

/* ---- diff ---- */

/* What one diff of two counter sets found. */
typedef struct diff_out {
	int changed;	     /* counters that changed */
	int compile_changed; /* compile counters among them */
	json_t *counters;    /* --json: the rows */
} diff_out;

/* Diffs the counters of pa and pb (files or dump folders): with --json the
 * rows go to out->counters, else a header and the table are printed.
 * Returns 0, or EXIT_USAGE (message printed) when either cannot be read. */
static int diff_pair(const char *pa, const char *pb, diff_out *out)
{
	out->changed = out->compile_changed = 0;
	out->counters = json_array();
	epj_counters *a = load(pa);
	epj_counters *b = a ? load(pb) : NULL;
	epj_counters *d = b ? epj_counters_diff(a, b) : NULL;
	int n = 0;
	int *ix = d ? sorted(d, &n) : NULL;
	if (!ix) {
		if (b)
			fprintf(stderr, "epjit-dump: out of memory\n");
		epj_counters_free(a);
		epj_counters_free(b);
		epj_counters_free(d);
		return EXIT_USAGE;
	}
	int w = 7;
	for (int i = 0; i < n; i++) {
		int l = (int)strlen(epj_counters_name_at(d, i));
		w = l > w ? l : w;
	}
	if (!json_out)
		printf("# %s -> %s (C = compile counter, t = time of cache "
		       "hits: not a compile)\n%-*s %16s %16s "
		       "%16s\n",
		       pa, pb, w + 2, "counter", "A", "B", "B - A");
	for (int i = 0; i < n; i++) {
		const char *nm = epj_counters_name_at(d, ix[i]);
		int64_t dv = epj_counters_value_at(d, ix[i]);
		int64_t va = epj_counters_value(a, nm);
		int64_t vb = epj_counters_value(b, nm);
		bool cc = is_compile_counter(nm) && !is_wall_time(nm);
		out->changed += dv != 0;
		out->compile_changed += cc && dv != 0;
		if (json_out) {
			json_array_append_new(
			    out->counters,
			    json_pack("{s:s, s:s, s:I, s:I, s:I, s:b}", "name",
				      nm, "group", group_names[group_of(nm)],
				      "a", (json_int_t)va, "b", (json_int_t)vb,
				      "delta", (json_int_t)dv, "compile", cc));
			continue;
		}
		printf("%c %-*s %16" PRId64 " %16" PRId64 " %+16" PRId64 "%s\n",
		       cc		  ? 'C'
		       : is_wall_time(nm) ? 't'
					  : ' ',
		       w, nm, va, vb, dv,
		       cc && dv ? "  <- compile counter changed" : "");
	}
	free(ix);
	epj_counters_free(a);
	epj_counters_free(b);
	epj_counters_free(d);
	return 0;
}

static int find_ranks(const char *dir, int ranks[MAX_RANKS]);

/* "0,1,3" from n ranks. */
static void rank_list(char *buf, size_t cap, const int *ranks, int n)
{
	size_t k = 0;
	buf[0] = '\0';
	for (int i = 0; i < n && k < cap; i++)
		k += (size_t)snprintf(buf + k, cap - k, "%s%d", i ? "," : "",
				      ranks[i]);
}

/* Two multi-rank dumps (rank<N>/ folders), rank by rank: the same ranks
 * on both sides, each rank's counters diffed as two single dumps; the
 * verdict is CHANGED when any rank's compile counters changed. */
static int diff_ranks(const char *pa, const char *pb, const int *ra, int na,
		      const int *rb, int nb)
{
	bool same = na == nb;
	for (int i = 0; same && i < na; i++)
		same = ra[i] == rb[i];
	if (!same) {
		char la[512], lb[512];
		rank_list(la, sizeof la, ra, na);
		rank_list(lb, sizeof lb, rb, nb);
		fprintf(stderr,
			"epjit-dump: --diff: %s has ranks %s, %s has ranks "
			"%s; multi-rank dumps are diffed rank by rank and "
			"need the same ranks\n",
			pa, la, pb, lb);
		return EXIT_USAGE;
	}
	json_t *ranks = json_object();
	int changed = 0, compile_changed = 0, rc = 0;
	char changed_on[512] = "";
	for (int i = 0; i < na && !rc; i++) {
		char sa[4200], sb[4200], k[32];
		snprintf(sa, sizeof sa, "%s/rank%d", pa, ra[i]);
		snprintf(sb, sizeof sb, "%s/rank%d", pb, ra[i]);
		snprintf(k, sizeof k, "rank%d", ra[i]);
		if (!json_out)
			printf("%s## %s\n", i ? "\n" : "", k);
		diff_out o;
		rc = diff_pair(sa, sb, &o);
		changed += o.changed;
		compile_changed += o.compile_changed;
		if (o.compile_changed) {
			size_t l = strlen(changed_on);
			snprintf(changed_on + l, sizeof changed_on - l, " %s",
				 k);
		}
		if (!rc && json_out)
			json_object_set_new(
			    ranks, k,
			    json_pack("{s:o, s:i, s:b}", "counters", o.counters,
				      "changed", o.changed, "compile_changed",
				      o.compile_changed > 0));
		else
			json_decref(o.counters);
		if (!rc && !json_out)
			printf("# %s: %d counter(s) changed; compile "
			       "counters: %s\n",
			       k, o.changed,
			       o.compile_changed ? "CHANGED" : "unchanged");
	}
	if (!rc && json_out) {
		json_t *o = json_pack("{s:s, s:s, s:o, s:i, s:b}", "a", pa, "b",
				      pb, "ranks", ranks, "changed", changed,
				      "compile_changed", compile_changed > 0);
		json_dumpf(o, stdout, JSON_INDENT(2));
		putchar('\n');
		json_decref(o);
	} else {
		json_decref(ranks);
	}
	if (!rc && !json_out)
		printf("\n# %d ranks, rank by rank: %d counter(s) changed; "
		       "compile counters: %s%s\n",
		       na, changed,
		       compile_changed ? "CHANGED on" : "unchanged",
		       changed_on);
	if (rc)
		return rc;
	return compile_changed ? EXIT_CHANGED : 0;
}

static int diff(const char *pa, const char *pb)
{
	int ra[MAX_RANKS], rb[MAX_RANKS];
	int na = is_dir(pa) ? find_ranks(pa, ra) : 0;
	int nb = is_dir(pb) ? find_ranks(pb, rb) : 0;
	if (na > 0 && nb > 0)
		return diff_ranks(pa, pb, ra, na, rb, nb);
	if (na > 0 || nb > 0) {
		fprintf(stderr,
			"epjit-dump: --diff: %s is a multi-rank dump (rank<N>/ "
			"folders) and %s is not; diff two multi-rank dumps, "
			"or one rank's folder (%s/rank<N>) with a single "
			"dump\n",
			na > 0 ? pa : pb, na > 0 ? pb : pa, na > 0 ? pa : pb);
		return EXIT_USAGE;
	}
	diff_out o;
	int rc = diff_pair(pa, pb, &o);
	if (rc) {
		json_decref(o.counters);
		return rc;
	}
	if (json_out) {
		json_t *j =
		    json_pack("{s:s, s:s, s:o, s:i, s:b}", "a", pa, "b", pb,
			      "counters", o.counters, "changed", o.changed,
			      "compile_changed", o.compile_changed > 0);
		json_dumpf(j, stdout, JSON_INDENT(2));
		putchar('\n');
		json_decref(j);
	} else {
		json_decref(o.counters);
		printf("# %d counter(s) changed; compile counters: %s\n",
		       o.changed, o.compile_changed ? "CHANGED" : "unchanged");
	}
	return o.compile_changed ? EXIT_CHANGED : 0;
}

/* ---- a dump directory ---- */

/* graphs.jsonl as an array (empty when absent; malformed lines are
 * reported and skipped). */
static int64_t jint(const json_t *o, const char *k)
{
	return (int64_t)json_integer_value(json_object_get(o, k));
}

static const char *jstr(const json_t *o, const char *k)
{
	const char *s = json_string_value(json_object_get(o, k));
	return s ? s : "?";
}

/* DIR/NAME, one JSON object a line, as an array (empty when absent). */
static json_t *load_jsonl(const char *dir, const char *name)
{
	char path[4200];
	snprintf(path, sizeof path, "%s/%s", dir, name);
	json_t *arr = json_array();
	char *text = read_file(path, true);
	if (!text)
		return arr;
	int line = 0;
	for (char *p = text; *p;) {
		char *nl = strchr(p, '\n');
		if (nl)
			*nl = '\0';
		line++;
		if (*p) {
			json_error_t err;
			json_t *o = json_loads(p, 0, &err);
			if (o && json_is_object(o))
				json_array_append_new(arr, o);
			else {
				fprintf(stderr,
					"epjit-dump: %s:%d: not a JSON object "
					"(%s); skipped\n",
					path, line, err.text);
				json_decref(o);
			}
		}
		if (!nl)
			break;
		p = nl + 1;
	}
	free(text);
	return arr;
}

static json_t *load_graphs(const char *dir)
{
	return load_jsonl(dir, "graphs.jsonl");
}

/* provenance.jsonl: per compiled region variant, its module, the name of
 * each "param i" and its steps (jit/debug.c). */
static json_t *load_provenance(const char *dir)
{
	return load_jsonl(dir, "provenance.jsonl");
}

static void print_provenance(const json_t *prov)
{
	printf("== provenance: %zu compiled region variant%s\n",
	       json_array_size(prov), json_array_size(prov) == 1 ? "" : "s");
	if (json_array_size(prov) == 0) {
		printf("  (none: no provenance.jsonl)\n");
		return;
	}
	for (size_t i = 0; i < json_array_size(prov); i++) {
		const json_t *v = json_array_get(prov, i);
		printf("  %s variant %" PRId64 " %s (%s)\n", jstr(v, "region"),
		       jint(v, "variant"), jstr(v, "mode"), jstr(v, "kind"));
		const json_t *ps = json_object_get(v, "params");
		for (size_t k = 0; k < json_array_size(ps); k++)
			printf("    param %zu = %s\n", k,
			       json_string_value(json_array_get(ps, k))
				   ? json_string_value(json_array_get(ps, k))
				   : "?");
		const json_t *st = json_object_get(v, "steps");
		for (size_t k = 0; k < json_array_size(st); k++) {
			const json_t *o = json_array_get(st, k);
			if (json_object_get(o, "break"))
				printf("    step %zu: break %s", k,
				       jstr(o, "break"));
			else
				printf("    step %zu: segment %s", k,
				       jstr(o, "segment"));
			const json_t *in = json_object_get(o, "inputs");
			for (size_t j = 0; j < json_array_size(in); j++)
				printf("%s act %zu = %s", j ? "," : ";", j,
				       json_string_value(json_array_get(in, j))
					   ? json_string_value(
						 json_array_get(in, j))
					   : "?");
			putchar('\n');
		}
	}
}

/* recompiles.txt as an array of {region, variant, reason}. */
static json_t *load_recompiles(const char *dir)
{
	char path[4200];
	snprintf(path, sizeof path, "%s/recompiles.txt", dir);
	json_t *arr = json_array();
	char *text = read_file(path, true);
	if (!text)
		return arr;
	for (char *p = text; *p;) {
		char *nl = strchr(p, '\n');
		if (nl)
			*nl = '\0';
		char *t1 = strchr(p, '\t');
		char *t2 = t1 ? strchr(t1 + 1, '\t') : NULL;
		if (t1 && t2) {
			*t1 = *t2 = '\0';
			json_array_append_new(
			    arr,
			    json_pack("{s:s, s:i, s:s}", "region", p, "variant",
				      atoi(t1 + 1), "reason", t2 + 1));
		}
		if (!nl)
			break;
		p = nl + 1;
	}
	free(text);
	return arr;
}

static void print_paths(const char *what, const json_t *arr)
{
	size_t n = json_array_size(arr);
	if (!n)
		return;
	printf("      %s:", what);
	for (size_t i = 0; i < n; i++)
		printf(" %s", json_string_value(json_array_get(arr, i)));
	putchar('\n');
}

static void print_dump(const char *dir, const epj_counters *c,
		       const json_t *graphs, const json_t *rec,
		       const json_t *prov, bool partial)
{
	printf("# debug dump %s: %d counters%s, %zu compiled segment%s\n", dir,
	       epj_counters_count(c),
	       partial ? " (no counters.json: the run did not end)" : "",
	       json_array_size(graphs),
	       json_array_size(graphs) == 1 ? "" : "s");
	print_grouped(c);
	printf("== graph breaks by reason\n");
	int nb = 0;
	for (int i = 0; i < epj_counters_count(c); i++) {
		const char *nm = epj_counters_name_at(c, i);
		if (has_prefix(nm, "graph_break.")) {
			printf("  %-20s %" PRId64 "\n", nm + 12,
			       epj_counters_value_at(c, i));
			nb++;
		}
	}
	if (!nb)
		printf("  (none)\n");
	if (partial)
		printf("== recompiles: %zu (guard failures, from "
		       "recompiles.txt)\n",
		       json_array_size(rec));
	else
		printf("== recompiles: %" PRId64 " (guard failures)\n",
		       epj_counters_value(c, "recompiles"));
	for (size_t i = 0; i < json_array_size(rec); i++) {
		const json_t *r = json_array_get(rec, i);
		printf("  %s variant %" PRId64 ": %s\n", jstr(r, "region"),
		       jint(r, "variant"), jstr(r, "reason"));
	}
	print_provenance(prov);
	printf("== compiled segments\n");
	if (json_array_size(graphs) == 0) {
		printf("  (none: no graphs.jsonl)\n");
		return;
	}
	printf("  %-3s %-32s %-5s %3s %7s %7s %7s %7s %10s\n", "seq",
	       "signature", "mode", "seg", "fwd.n", "fwd.k", "bwd.n", "bwd.k",
	       "ms");
	for (size_t i = 0; i < json_array_size(graphs); i++) {
		const json_t *g = json_array_get(graphs, i);
		printf("  %03" PRId64 " %-32s %-5s %3" PRId64 " %7" PRId64
		       " %7" PRId64 " %7" PRId64 " %7" PRId64 " %10.3f\n",
		       jint(g, "seq"), jstr(g, "signature"), jstr(g, "mode"),
		       jint(g, "segment"), jint(g, "fwd_nodes"),
		       jint(g, "fwd_kernels"), jint(g, "bwd_nodes"),
		       jint(g, "bwd_kernels"),
		       json_number_value(json_object_get(g, "compile_ms")));
		print_paths("ir", json_object_get(g, "ir"));
		print_paths("sources", json_object_get(g, "sources"));
	}
}

static json_t *dump_json(const char *dir, const epj_counters *c, json_t *graphs,
			 json_t *rec, bool partial)
{
	json_t *prov = load_provenance(dir);
	json_t *br = json_object();
	for (int i = 0; i < epj_counters_count(c); i++) {
		const char *nm = epj_counters_name_at(c, i);
		if (has_prefix(nm, "graph_break."))
			json_object_set_new(
			    br, nm + 12,
			    json_integer(epj_counters_value_at(c, i)));
	}
	return json_pack("{s:s, s:o, s:o, s:o, s:o, s:o, s:b}", "dir", dir,
			 "counters", counters_json(c), "graph_breaks", br,
			 "recompiles", rec, "graphs", graphs, "provenance",
			 prov, "counters_missing", partial);
}

/* rank<N>/ subfolders of dir, sorted by N; returns their count. */
static int find_ranks(const char *dir, int ranks[MAX_RANKS])
{
	DIR *d = opendir(dir);
	if (!d)
		return 0;
	int n = 0;
	struct dirent *de;
	while ((de = readdir(d)) && n < MAX_RANKS) {
		char *end;
		if (strncmp(de->d_name, "rank", 4) != 0 || !de->d_name[4])
			continue;
		long r = strtol(de->d_name + 4, &end, 10);
		char sub[4200];
		snprintf(sub, sizeof sub, "%s/%s", dir, de->d_name);
		if (*end || r < 0 || r > 1000000 || !is_dir(sub))
			continue;
		ranks[n++] = (int)r;
	}
	closedir(d);
	for (int i = 1; i < n; i++)
		for (int j = i; j > 0 && ranks[j - 1] > ranks[j]; j--) {
			int t = ranks[j];
			ranks[j] = ranks[j - 1];
			ranks[j - 1] = t;
		}
	return n;
}

/* Side by side: the union of the ranks' counters, one column a rank; a
 * '*' marks counters that differ between ranks. */
static int print_ranks(const char *dir, const int *ranks, int n)
{
	epj_counters *c[MAX_RANKS] = { 0 };
	json_t *graphs[MAX_RANKS] = { 0 };
	bool partial[MAX_RANKS] = { 0 };
	int rc = 0;
	for (int i = 0; i < n && !rc; i++) {
		char sub[4200];
		snprintf(sub, sizeof sub, "%s/rank%d", dir, ranks[i]);
		c[i] = load_dump(sub, &partial[i]);
		graphs[i] = load_graphs(sub);
		if (!c[i])
			rc = EXIT_USAGE;
	}
	if (!rc) {
		/* the union of names: a diff against an empty set */
		epj_counters *none = epj_counters_from_json("{}");
		epj_counters *u = epj_counters_diff(none, c[0]);
		for (int i = 1; u && i < n; i++) {
			epj_counters *m = epj_counters_diff(u, c[i]);
			epj_counters_free(u);
			u = m;
		}
		int m = 0;
		int *ix = u ? sorted(u, &m) : NULL;
		if (json_out) {
			json_t *o = json_object();
			for (int i = 0; i < n; i++) {
				char sub[4200], k[32];
				snprintf(sub, sizeof sub, "%s/rank%d", dir,
					 ranks[i]);
				snprintf(k, sizeof k, "rank%d", ranks[i]);
				json_object_set_new(
				    o, k,
				    dump_json(sub, c[i], json_incref(graphs[i]),
					      load_recompiles(sub),
					      partial[i]));
			}
			json_t *top =
			    json_pack("{s:s, s:o}", "dir", dir, "ranks", o);
			json_dumpf(top, stdout, JSON_INDENT(2));
			putchar('\n');
			json_decref(top);
		} else {
			printf("# debug dump %s: %d ranks side by side (* = "
			       "differs between ranks)\n",
			       dir, n);
			int w = 8;
			for (int i = 0; i < m; i++) {
				int l = (int)strlen(epj_counters_name_at(u, i));
				w = l > w ? l : w;
			}
			printf("  %-*s", w + 2, "counter");
			for (int i = 0; i < n; i++) {
				char k[32];
				snprintf(k, sizeof k, "rank%d", ranks[i]);
				printf(" %14s", k);
			}
			putchar('\n');
			int last = -1;
			for (int j = 0; j < m; j++) {
				const char *nm = epj_counters_name_at(u, ix[j]);
				int g = group_of(nm);
				if (g != last)
					printf("== %s\n", group_names[g]);
				last = g;
				bool differs = false;
				for (int i = 1; i < n; i++)
					differs |=
					    epj_counters_value(c[i], nm) !=
					    epj_counters_value(c[0], nm);
				printf("%c %-*s", differs ? '*' : ' ', w + 2,
				       nm);
				for (int i = 0; i < n; i++)
					printf(" %14" PRId64,
					       epj_counters_value(c[i], nm));
				putchar('\n');
			}
			printf("  %-*s", w + 2, "compiled segments");
			for (int i = 0; i < n; i++)
				printf(" %14zu", json_array_size(graphs[i]));
			putchar('\n');
		}
		free(ix);
		epj_counters_free(u);
		epj_counters_free(none);
	}
	for (int i = 0; i < n; i++) {
		epj_counters_free(c[i]);
		json_decref(graphs[i]);
	}
	return rc;
}

static int show_dir(const char *dir)
{
	int ranks[MAX_RANKS];
	int n = find_ranks(dir, ranks);
	if (n > 0)
		return print_ranks(dir, ranks, n);
	bool partial;
	epj_counters *c = load_dump(dir, &partial);
	if (!c)
		return EXIT_USAGE;
	json_t *graphs = load_graphs(dir), *rec = load_recompiles(dir);
	if (json_out) {
		json_t *o = dump_json(dir, c, graphs, rec, partial);
		json_dumpf(o, stdout, JSON_INDENT(2));
		putchar('\n');
		json_decref(o);
	} else {
		json_t *prov = load_provenance(dir);
		print_dump(dir, c, graphs, rec, prov, partial);
		json_decref(graphs);
		json_decref(rec);
		json_decref(prov);
	}
	epj_counters_free(c);
	return 0;
}

int main(int argc, char **argv)
{
	int i = 1;
	if (argc == 2 &&
	    (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
		usage(stdout);
		return 0;
	}
	if (i < argc && !strcmp(argv[i], "--json")) {
		json_out = true;
		i++;
	}
	if (argc - i == 3 && !strcmp(argv[i], "--diff"))
		return diff(argv[i + 1], argv[i + 2]);
	if (argc - i != 1 || argv[i][0] == '-') {
		usage(stderr);
		return EXIT_USAGE;
	}
	struct stat sb;
	if (stat(argv[i], &sb) != 0) {
		fprintf(stderr, "epjit-dump: %s: %s\n", argv[i],
			strerror(errno));
		return EXIT_USAGE;
	}
	if (S_ISDIR(sb.st_mode))
		return show_dir(argv[i]);
	return print_counters(argv[i]);
}
