/* check_config_doc.c -- the configuration reference (doc/config.md) names
 * every key the parser knows (ej_config_key_at), so that a key added to
 * runtime/config.c without its documentation fails make check.
 *
 * A key a.b.c counts as documented when the page has `a.b.c`, or `a.b.c.`
 * (a section documented through its sub-keys), or a brace group
 * `a.b.{..., c, ...}`, or `c` in backticks inside the part of the page
 * under a heading that names `a` (up to the next heading of the same or a
 * higher level).  The check also fails when the parser lists no keys or
 * the page cannot be read: it must not pass by checking nothing.
 *
 * The page's key reference is generated from the key table of
 * runtime/config.c (ej_config_reference, `make config-doc`); the second
 * test fails while the committed page differs from what the table makes,
 * naming the first line that differs.
 */
#include "check_util.h"
#include "config_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *slurp(const char *path)
{
	FILE *f = fopen(path, "rb");
	ck_assert_msg(f != NULL, "cannot open %s", path);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	char *s = malloc((size_t)n + 1);
	ck_assert_uint_eq(fread(s, 1, (size_t)n, f), (size_t)n);
	s[n] = '\0';
	fclose(f);
	return s;
}

static bool has(const char *doc, const char *fmt, const char *a)
{
	char want[512];
	snprintf(want, sizeof want, fmt, a);
	return strstr(doc, want) != NULL;
}

/* `last` in backticks under a heading naming `top`. */
static bool under_heading(const char *doc, const char *top, const char *last)
{
	char head[320], tick[320];
	snprintf(head, sizeof head, "`%s`", top);
	snprintf(tick, sizeof tick, "`%s`", last);
	for (const char *p = doc; (p = strstr(p, "\n#")) != NULL; p++) {
		const char *eol = strchr(p + 1, '\n');
		if (!eol)
			return false;
		int level = 0;
		while (p[1 + level] == '#')
			level++;
		char line[400];
		size_t ln = (size_t)(eol - p - 1);
		if (ln >= sizeof line)
			ln = sizeof line - 1;
		memcpy(line, p + 1, ln);
		line[ln] = '\0';
		if (!strstr(line, head))
			continue;
		/* the block: up to the next heading of this level or higher */
		const char *end = eol;
		for (;;) {
			end = strstr(end, "\n#");
			if (!end)
				break;
			int l2 = 0;
			while (end[1 + l2] == '#')
				l2++;
			if (l2 <= level)
				break;
			end++;
		}
		size_t bl = end ? (size_t)(end - eol) : strlen(eol);
		char *block = strndup(eol, bl);
		bool found = strstr(block, tick) != NULL;
		free(block);
		if (found)
			return true;
	}
	return false;
}

START_TEST(test_every_key_documented)
{
	char path[1024];
	snprintf(path, sizeof path, "%s/doc/config.md", tu_srcdir());
	char *doc = slurp(path);
	char key[300], missing[4096] = "";
	int n = 0, bad = 0;
	for (; ej_config_key_at(n, key, sizeof key); n++) {
		char top[300], parent[320];
		snprintf(top, sizeof top, "%s", key);
		char *dot = strchr(top, '.');
		if (dot)
			*dot = '\0';
		const char *last = strrchr(key, '.');
		last = last ? last + 1 : key;
		snprintf(parent, sizeof parent, "%.*s", (int)(last - key), key);
		bool ok = has(doc, "`%s`", key) || has(doc, "`%s.", key);
		if (!ok && parent[0]) {
			/* `a.b.{x, c, y}` */
			char brace[340];
			snprintf(brace, sizeof brace, "`%s{", parent);
			const char *b = strstr(doc, brace);
			if (b) {
				const char *e = strchr(b, '}');
				char *grp = strndup(b, e ? (size_t)(e - b) : 0);
				char *w = grp;
				size_t ll = strlen(last);
				while (!ok && (w = strstr(w, last)) != NULL) {
					ok = (w[-1] == '{' || w[-1] == ' ') &&
					     (w[ll] == ',' || w[ll] == '\0');
					w += ll;
				}
				free(grp);
			}
			if (!ok)
				ok = under_heading(doc, top, last);
		}
		if (!ok) {
			bad++;
			tu_report(missing, sizeof missing, " %s", key);
		}
	}
	ck_assert_int_gt(n, 50);
	ck_assert_msg(bad == 0,
		      "%d of %d config keys are not in doc/config.md:%s", bad,
		      n, missing);
	free(doc);
}
END_TEST

START_TEST(test_reference_is_generated)
{
	char path[1024];
	snprintf(path, sizeof path, "%s/doc/config.md", tu_srcdir());
	char *doc = slurp(path);
	char *gen = ej_config_reference();
	ck_assert_ptr_nonnull(gen);
	/* The generated text is the reference: it has every key's row. */
	ck_assert_ptr_nonnull(strstr(gen, "| `zero_optimization.stage` |"));
	ck_assert_ptr_nonnull(strstr(gen, "| `seed` | a non-negative integer "
					  "| 42 |"));
	const char *b = strstr(doc, EJ_CONFIG_DOC_BEGIN "\n");
	ck_assert_msg(b != NULL, "doc/config.md has no generated part (%s)",
		      EJ_CONFIG_DOC_BEGIN);
	const char *e = strstr(b, EJ_CONFIG_DOC_END "\n");
	ck_assert_msg(e != NULL, "doc/config.md: no %s", EJ_CONFIG_DOC_END);
	size_t have = (size_t)(e - b) + strlen(EJ_CONFIG_DOC_END "\n");
	if (have != strlen(gen) || memcmp(b, gen, have) != 0) {
		/* the first line that differs */
		size_t i = 0, line = 1;
		while (i < have && gen[i] && b[i] == gen[i]) {
			if (b[i] == '\n')
				line++;
			i++;
		}
		size_t ls = i;
		while (ls > 0 && gen[ls - 1] != '\n')
			ls--;
		const char *ge = strchr(gen + ls, '\n');
		const char *pe = strchr(b + ls, '\n');
		ck_abort_msg("doc/config.md is not what the key table makes "
			     "(run make config-doc): line %zu of the generated "
			     "part is\n  %.*s\nin the table and\n  %.*s\non "
			     "the page",
			     line, (int)(ge ? ge - (gen + ls) : 200), gen + ls,
			     (int)(pe ? pe - (b + ls) : 200), b + ls);
	}
	free(gen);
	free(doc);
}
END_TEST

Suite *make_config_doc_suite(void)
{
	Suite *s = suite_create("config_doc");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_every_key_documented);
	tcase_add_test(tc, test_reference_is_generated);
	suite_add_tcase(s, tc);
	return s;
}
