/* gen_config_doc.c -- writes the generated part of the configuration
 * reference (doc/config.md) from the key table of runtime/config.c.
 *
 *   gen-config-doc PAGE      replaces the lines from EJ_CONFIG_DOC_BEGIN to
 *                            EJ_CONFIG_DOC_END of PAGE with
 *                            ej_config_reference() (temporary file, then
 *                            rename); the rest of the page is kept
 *
 * Run by `make config-doc`.  check_config_doc fails while the committed
 * page differs from what this writes.  Exit status: 0 written, 1 error.
 */
#include "config_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *slurp(const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return NULL;
	size_t cap = 1 << 16, len = 0;
	char *s = malloc(cap);
	size_t got;
	while (s && (got = fread(s + len, 1, cap - len - 1, f)) > 0) {
		len += got;
		if (len + 1 >= cap) {
			char *ns = realloc(s, cap * 2);
			if (!ns) {
				free(s);
				s = NULL;
				break;
			}
			s = ns;
			cap *= 2;
		}
	}
	fclose(f);
	if (s)
		s[len] = '\0';
	return s;
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: gen-config-doc doc/config.md\n");
		return 1;
	}
	const char *path = argv[1];
	char *page = slurp(path);
	if (!page) {
		perror(path);
		return 1;
	}
	char *b = strstr(page, EJ_CONFIG_DOC_BEGIN "\n");
	char *e = b ? strstr(b, EJ_CONFIG_DOC_END "\n") : NULL;
	if (!b || !e) {
		fprintf(stderr,
			"%s: no generated part (the lines \"%s\" ... \"%s\")\n",
			path, EJ_CONFIG_DOC_BEGIN, EJ_CONFIG_DOC_END);
		free(page);
		return 1;
	}
	e += strlen(EJ_CONFIG_DOC_END "\n");
	char *gen = ej_config_reference();
	char tmp[4096];
	snprintf(tmp, sizeof tmp, "%s.tmp", path);
	FILE *f = gen ? fopen(tmp, "wb") : NULL;
	if (!f) {
		perror(tmp);
		free(gen);
		free(page);
		return 1;
	}
	fwrite(page, 1, (size_t)(b - page), f);
	fputs(gen, f);
	fputs(e, f);
	int bad = ferror(f);
	bad |= fclose(f) != 0;
	if (bad || rename(tmp, path) != 0) {
		perror(path);
		remove(tmp);
		free(gen);
		free(page);
		return 1;
	}
	free(gen);
	free(page);
	return 0;
}
