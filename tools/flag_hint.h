/* flag_hint.h -- "did you mean --X?" for an unknown command-line option of
 * a tool, drawn from the options its own --help text names (so the
 * candidates are exactly what the usage documents, and t/manpages.sh keeps
 * that equal to the man page).
 *
 * flag_hint(usage, arg, hint, n) renders usage() into memory, collects every
 * "--word" in it, and writes " (did you mean --word?)" into hint when the
 * nearest one (optimal string alignment distance of the option's name, the
 * part before any '=') is close: at most 2 edits, or a third of the name's
 * length for long names.  Otherwise hint is "".
 */
#ifndef EPJIT_TOOLS_FLAG_HINT_H
#define EPJIT_TOOLS_FLAG_HINT_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FLAG_HINT_MAX 64

/* Optimal string alignment distance (insertions, deletions, substitutions,
 * adjacent transpositions); strings longer than FLAG_HINT_MAX count as far
 * apart. */
static inline int flag_hint_distance(const char *a, const char *b)
{
	size_t la = strlen(a), lb = strlen(b);
	if (la > FLAG_HINT_MAX || lb > FLAG_HINT_MAX)
		return 1 << 20;
	int d[FLAG_HINT_MAX + 1][FLAG_HINT_MAX + 1];
	for (size_t i = 0; i <= la; i++)
		d[i][0] = (int)i;
	for (size_t j = 0; j <= lb; j++)
		d[0][j] = (int)j;
	for (size_t i = 1; i <= la; i++)
		for (size_t j = 1; j <= lb; j++) {
			int c = a[i - 1] != b[j - 1];
			int v = d[i - 1][j] + 1;
			if (d[i][j - 1] + 1 < v)
				v = d[i][j - 1] + 1;
			if (d[i - 1][j - 1] + c < v)
				v = d[i - 1][j - 1] + c;
			if (i > 1 && j > 1 && a[i - 1] == b[j - 2] &&
			    a[i - 2] == b[j - 1] && d[i - 2][j - 2] + 1 < v)
				v = d[i - 2][j - 2] + 1;
			d[i][j] = v;
		}
	return d[la][lb];
}

static inline void flag_hint(void (*usage)(FILE *), const char *arg, char *hint,
			     size_t n)
{
	if (n)
		hint[0] = 0;
	char name[FLAG_HINT_MAX + 1];
	size_t k = strcspn(arg, "=");
	if (k > FLAG_HINT_MAX || n == 0)
		return;
	memcpy(name, arg, k);
	name[k] = 0;
	char *text = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&text, &len);
	if (!f)
		return;
	usage(f);
	if (fclose(f) != 0 || !text) {
		free(text);
		return;
	}
	char best[FLAG_HINT_MAX + 1] = "";
	int best_d = 1 << 20;
	for (const char *p = strstr(text, "--"); p; p = strstr(p + 2, "--")) {
		if (p > text && p[-1] != ' ' && p[-1] != '\n' && p[-1] != '[')
			continue;
		size_t w = 2;
		while ((p[w] >= 'a' && p[w] <= 'z') ||
		       (p[w] >= '0' && p[w] <= '9') || p[w] == '-')
			w++;
		if (w <= 2 || w > FLAG_HINT_MAX)
			continue;
		char cand[FLAG_HINT_MAX + 1];
		memcpy(cand, p, w);
		cand[w] = 0;
		int dist = flag_hint_distance(name, cand);
		if (dist < best_d) {
			best_d = dist;
			memcpy(best, cand, w + 1);
		}
	}
	free(text);
	int far = (int)strlen(name) / 3;
	if (best[0] && best_d > 0 && (best_d <= 2 || best_d <= far))
		snprintf(hint, n, " (did you mean %s?)", best);
}

#endif
