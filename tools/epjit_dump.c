/* epjit_dump.c -- epjit-dump: reads counter snapshots and debug dumps.
 *
 *   epjit-dump FILE.json          the counters, sorted by name, aligned
 *   epjit-dump --diff A.json B.json
 *                                 each counter's change B - A; compile
 *                                 counters are marked, and the exit status
 *                                 is 1 when any of them changed (the
 *                                 measured window of a run must show none)
 *   epjit-dump DIR                a debug dump directory (EPJIT_DEBUG_DUMP):
 *                                 its files, then DIR/counters.json
 *
 * Compile counters: frames.*, stats.*, recompiles, graph_break.*,
 * compile.*, cache.misses.  Exit status: 0 ok (no compile-counter change),
 * 1 compile counters changed, 2 usage or input error.  Uses only the public
 * API (epjit.h).
 */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "epjit.h"

enum { EXIT_CHANGED = 1, EXIT_USAGE = 2 };

static void usage(FILE *f)
{
	fprintf(f, "usage: epjit-dump FILE.json\n"
		   "       epjit-dump --diff A.json B.json\n"
		   "       epjit-dump DIR   (an EPJIT_DEBUG_DUMP directory)\n"
		   "Prints counter snapshots; --diff exits 1 when a compile "
		   "counter\n(frames.*, stats.*, recompiles, graph_break.*, "
		   "compile.*, cache.misses)\nchanged between A and B.\n");
}

static bool is_compile_counter(const char *n)
{
	static const char *const prefixes[] = { "frames.", "stats.",
						"graph_break.", "compile." };
	for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++)
		if (!strncmp(n, prefixes[i], strlen(prefixes[i])))
			return true;
	return !strcmp(n, "recompiles") || !strcmp(n, "cache.misses");
}

/* Whole file as a NUL-terminated string, NULL with a message on stderr. */
static char *read_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f) {
		fprintf(stderr, "epjit-dump: cannot open %s: %s\n", path,
			strerror(errno));
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

static epj_counters *load(const char *path)
{
	char *js = read_file(path);
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

/* Indices of c's counters sorted by name (malloc'ed). */
static int *sorted(const epj_counters *c, int *n)
{
	int cnt = epj_counters_count(c);
	int *ix = malloc(sizeof *ix * (size_t)(cnt + 1));
	if (!ix)
		return NULL;
	for (int i = 0; i < cnt; i++)
		ix[i] = i;
	/* insertion sort: counter sets are small (tens to hundreds) */
	for (int i = 1; i < cnt; i++) {
		int v = ix[i], j = i;
		while (j > 0 && strcmp(epj_counters_name_at(c, ix[j - 1]),
				       epj_counters_name_at(c, v)) > 0) {
			ix[j] = ix[j - 1];
			j--;
		}
		ix[j] = v;
	}
	*n = cnt;
	return ix;
}

static int print_counters(const char *path)
{
	epj_counters *c = load(path);
	if (!c)
		return EXIT_USAGE;
	int n = 0;
	int *ix = sorted(c, &n);
	if (!ix) {
		epj_counters_free(c);
		fprintf(stderr, "epjit-dump: out of memory\n");
		return EXIT_USAGE;
	}
	int w = 0;
	for (int i = 0; i < n; i++) {
		int l = (int)strlen(epj_counters_name_at(c, i));
		w = l > w ? l : w;
	}
	printf("# %s: %d counters\n", path, n);
	for (int i = 0; i < n; i++)
		printf("%-*s %20" PRId64 "\n", w,
		       epj_counters_name_at(c, ix[i]),
		       epj_counters_value_at(c, ix[i]));
	free(ix);
	epj_counters_free(c);
	return 0;
}

static int diff(const char *pa, const char *pb)
{
	epj_counters *a = load(pa);
	epj_counters *b = a ? load(pb) : NULL;
	epj_counters *d = b ? epj_counters_diff(a, b) : NULL;
	if (!d) {
		if (b)
			fprintf(stderr, "epjit-dump: out of memory\n");
		epj_counters_free(a);
		epj_counters_free(b);
		return EXIT_USAGE;
	}
	int n = 0;
	int *ix = sorted(d, &n);
	if (!ix) {
		fprintf(stderr, "epjit-dump: out of memory\n");
		n = -1;
	}
	int w = 7;
	for (int i = 0; i < n; i++) {
		int l = (int)strlen(epj_counters_name_at(d, i));
		w = l > w ? l : w;
	}
	int changed = 0, compile_changed = 0;
	if (n >= 0)
		printf("# %s -> %s (C = compile counter)\n%-*s %16s %16s "
		       "%16s\n",
		       pa, pb, w + 2, "counter", "A", "B", "B - A");
	for (int i = 0; i < n; i++) {
		const char *nm = epj_counters_name_at(d, ix[i]);
		int64_t dv = epj_counters_value_at(d, ix[i]);
		bool cc = is_compile_counter(nm);
		changed += dv != 0;
		compile_changed += cc && dv != 0;
		printf("%c %-*s %16" PRId64 " %16" PRId64 " %+16" PRId64 "%s\n",
		       cc ? 'C' : ' ', w, nm, epj_counters_value(a, nm),
		       epj_counters_value(b, nm), dv,
		       cc && dv ? "  <- compile counter changed" : "");
	}
	if (n >= 0)
		printf("# %d counter(s) changed; compile counters: %s\n",
		       changed, compile_changed ? "CHANGED" : "unchanged");
	free(ix);
	epj_counters_free(a);
	epj_counters_free(b);
	epj_counters_free(d);
	if (n < 0)
		return EXIT_USAGE;
	return compile_changed ? EXIT_CHANGED : 0;
}

static int cmp_str(const void *x, const void *y)
{
	return strcmp(*(char *const *)x, *(char *const *)y);
}

/* Files of dir (and of its subdirectories, one level: graphs/), sorted. */
static int list_dir(const char *dir, const char *rel, int depth)
{
	char path[4096];
	snprintf(path, sizeof path, "%s%s%s", dir, rel[0] ? "/" : "", rel);
	DIR *d = opendir(path);
	if (!d) {
		fprintf(stderr, "epjit-dump: cannot open directory %s: %s\n",
			path, strerror(errno));
		return EXIT_USAGE;
	}
	char **names = NULL;
	int n = 0, cap = 0;
	struct dirent *de;
	while ((de = readdir(d))) {
		if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
			continue;
		if (n == cap) {
			cap = cap ? cap * 2 : 64;
			char **nn = realloc(names, sizeof *nn * (size_t)cap);
			if (!nn)
				break;
			names = nn;
		}
		names[n] = strdup(de->d_name);
		if (names[n])
			n++;
	}
	closedir(d);
	if (n)
		qsort(names, (size_t)n, sizeof *names, cmp_str);
	for (int i = 0; i < n; i++) {
		char sub[4096], full[8192];
		snprintf(sub, sizeof sub, "%s%s%s", rel, rel[0] ? "/" : "",
			 names[i]);
		snprintf(full, sizeof full, "%s/%s", dir, sub);
		struct stat sb;
		if (stat(full, &sb) == 0 && S_ISDIR(sb.st_mode)) {
			printf("  %s/\n", sub);
			if (depth < 1)
				list_dir(dir, sub, depth + 1);
		} else {
			printf("  %-60s %10lld bytes\n", sub,
			       stat(full, &sb) == 0 ? (long long)sb.st_size
						    : -1LL);
		}
		free(names[i]);
	}
	free(names);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 2 &&
	    (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
		usage(stdout);
		return 0;
	}
	if (argc == 4 && !strcmp(argv[1], "--diff"))
		return diff(argv[2], argv[3]);
	if (argc != 2 || argv[1][0] == '-') {
		usage(stderr);
		return EXIT_USAGE;
	}
	struct stat sb;
	if (stat(argv[1], &sb) != 0) {
		fprintf(stderr, "epjit-dump: %s: %s\n", argv[1],
			strerror(errno));
		return EXIT_USAGE;
	}
	if (!S_ISDIR(sb.st_mode))
		return print_counters(argv[1]);
	printf("# debug dump %s\n", argv[1]);
	int st = list_dir(argv[1], "", 0);
	if (st != 0)
		return st;
	char path[4096];
	snprintf(path, sizeof path, "%s/counters.json", argv[1]);
	if (stat(path, &sb) != 0) {
		fprintf(stderr,
			"epjit-dump: %s has no counters.json (written when "
			"the engine is freed)\n",
			argv[1]);
		return EXIT_USAGE;
	}
	return print_counters(path);
}
