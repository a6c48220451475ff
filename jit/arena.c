/* arena.c -- bump allocator for one compile's IR, kernel IR and strings.
 *
 * Blocks of at least 64 KiB are chained; everything is released at once by
 * ej_arena_free.  Nothing allocated here is ever freed on its own.
 */
#include "jit_impl.h"

#include <stdarg.h>
#include <stdio.h>

typedef struct arena_block {
	struct arena_block *next;
	size_t used, cap;
	_Alignas(16) unsigned char data[];
} arena_block;

struct ej_arena {
	arena_block *head;
};

ej_arena *ej_arena_new(void)
{
	ej_arena *a = calloc(1, sizeof *a);
	EJ_ASSERT(a);
	return a;
}

void ej_arena_free(ej_arena *a)
{
	if (!a)
		return;
	for (arena_block *b = a->head, *n; b; b = n) {
		n = b->next;
		free(b);
	}
	free(a);
}

void *ej_arena_alloc(ej_arena *a, size_t n)
{
	n = (n + 15) & ~(size_t)15;
	if (!a->head || a->head->used + n > a->head->cap) {
		size_t cap = n > 65536 ? n : 65536;
		arena_block *b = malloc(sizeof *b + cap);
		EJ_ASSERT(b);
		b->used = 0;
		b->cap = cap;
		b->next = a->head;
		a->head = b;
	}
	void *p = a->head->data + a->head->used;
	a->head->used += n;
	memset(p, 0, n);
	return p;
}

char *ej_arena_strdup(ej_arena *a, const char *s)
{
	size_t n = strlen(s) + 1;
	char *d = ej_arena_alloc(a, n);
	memcpy(d, s, n);
	return d;
}

char *ej_arena_printf(ej_arena *a, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(NULL, 0, fmt, ap);
	va_end(ap);
	EJ_ASSERT(n >= 0);
	char *s = ej_arena_alloc(a, (size_t)n + 1);
	va_start(ap, fmt);
	vsnprintf(s, (size_t)n + 1, fmt, ap);
	va_end(ap);
	return s;
}

/* ---- string buffer ------------------------------------------------------- */

void ej_sb_vprintf(ej_sbuf *s, const char *fmt, va_list ap)
{
	va_list aq;
	va_copy(aq, ap);
	int n = vsnprintf(NULL, 0, fmt, aq);
	va_end(aq);
	EJ_ASSERT(n >= 0);
	if (s->len + (size_t)n + 1 > s->cap) {
		size_t nc = s->cap ? s->cap * 2 : 4096;
		while (nc < s->len + (size_t)n + 1)
			nc *= 2;
		char *p = realloc(s->p, nc);
		EJ_ASSERT(p);
		s->p = p;
		s->cap = nc;
	}
	vsnprintf(s->p + s->len, (size_t)n + 1, fmt, ap);
	s->len += (size_t)n;
}

void ej_sb_printf(ej_sbuf *s, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	ej_sb_vprintf(s, fmt, ap);
	va_end(ap);
}

void ej_sb_puts(ej_sbuf *s, const char *str)
{
	ej_sb_printf(s, "%s", str);
}

const char *ej_sb_finish(ej_sbuf *s, ej_arena *A)
{
	const char *r = ej_arena_strdup(A, s->p ? s->p : "");
	free(s->p);
	memset(s, 0, sizeof *s);
	return r;
}
