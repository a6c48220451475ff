/* replay.c -- runs files through a fuzz target without libFuzzer.
 *
 *   replay_<target> PATH...
 *
 * Each PATH is a file or a directory (its files, in name order, not
 * recursive; a missing directory is fine: no past crashes yet).  Prints the
 * number of inputs replayed; a crash, sanitizer report or abort fails the
 * program like it would fail the fuzzer.
 */
#include "fuzz.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int run_file(const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f) {
		fprintf(stderr, "replay: cannot open %s\n", path);
		return 1;
	}
	size_t cap = 4096, n = 0;
	unsigned char *buf = malloc(cap);
	size_t got;
	while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
		n += got;
		if (n == cap) {
			unsigned char *nb = realloc(buf, cap * 2);
			if (!nb) {
				free(buf);
				buf = NULL;
				break;
			}
			buf = nb;
			cap *= 2;
		}
	}
	fclose(f);
	if (!buf)
		return 1;
	LLVMFuzzerTestOneInput(buf, n);
	free(buf);
	return 0;
}

static int cmp(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv)
{
	int inputs = 0, bad = 0;
	for (int i = 1; i < argc; i++) {
		struct stat st;
		if (stat(argv[i], &st) != 0)
			continue; /* e.g. no crashes directory yet */
		if (!S_ISDIR(st.st_mode)) {
			bad += run_file(argv[i]);
			inputs++;
			continue;
		}
		DIR *d = opendir(argv[i]);
		if (!d)
			return 1;
		char **names = NULL;
		int n = 0, cap = 0;
		struct dirent *de;
		while ((de = readdir(d))) {
			if (de->d_name[0] == '.')
				continue;
			if (n == cap) {
				cap = cap ? 2 * cap : 64;
				names =
				    realloc(names, (size_t)cap * sizeof *names);
				if (!names)
					return 1;
			}
			names[n++] = strdup(de->d_name);
		}
		closedir(d);
		qsort(names, (size_t)n, sizeof *names, cmp);
		for (int k = 0; k < n; k++) {
			char p[8192];
			snprintf(p, sizeof p, "%s/%s", argv[i], names[k]);
			if (stat(p, &st) == 0 && S_ISREG(st.st_mode)) {
				bad += run_file(p);
				inputs++;
			}
			free(names[k]);
		}
		free(names);
	}
	printf("replayed %d inputs\n", inputs);
	return bad ? 1 : 0;
}
