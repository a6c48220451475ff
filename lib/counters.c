/* counters.c -- named int64 counters of a context, snapshots, diffs, JSON.
 *
 * The live table maps names to slots.  Each slot is its own heap object, so
 * a pointer returned by ej_counter_slot stays valid for the table's life:
 * hot paths (kernel launches) keep the pointer and increment it without a
 * lookup.  The table keeps its entries in an array sorted by name (binary
 * search; an insert shifts pointers, never slots).  Counters are few (tens),
 * and lookups by name happen off the hot paths.
 *
 * A snapshot (epj_counters) is an immutable copy: an array of (name, value)
 * sorted by name, owning its name strings.  Snapshots add memory.* from the
 * allocator and, on a device with a driver (cuda), <device>.* from the
 * driver's counts (ej_dev_counters), which win over a live counter of the
 * same name; epj_counter_get reads those too.
 *
 * Threading: one context = one thread, like the allocator.
 */
#include "core_impl.h"

#include <stdarg.h>
#include <time.h>

#include <jansson.h>
#include <string.h>

typedef struct slot {
	int64_t value; /* first: the slot pointer is &slot->value */
	char *name;
} slot;

struct ej_counter_table {
	slot **v; /* sorted by name */
	int n, cap;
	int64_t dropped; /* returned when a slot cannot be allocated */
};

ej_counter_table *ej_counter_table_new(void)
{
	return calloc(1, sizeof(ej_counter_table));
}

void ej_counter_table_free(ej_counter_table *t)
{
	if (!t)
		return;
	for (int i = 0; i < t->n; i++) {
		free(t->v[i]->name);
		free(t->v[i]);
	}
	free(t->v);
	free(t);
}

/* Index of name, or -(insertion point) - 1. */
static int table_find(const ej_counter_table *t, const char *name)
{
	int lo = 0, hi = t->n;
	while (lo < hi) {
		int mid = lo + (hi - lo) / 2;
		int c = strcmp(t->v[mid]->name, name);
		if (c == 0)
			return mid;
		if (c < 0)
			lo = mid + 1;
		else
			hi = mid;
	}
	return -lo - 1;
}

static int64_t *table_slot(ej_counter_table *t, const char *name)
{
	int i = table_find(t, name);
	if (i >= 0)
		return &t->v[i]->value;
	i = -i - 1;
	if (t->n == t->cap) {
		int cap = t->cap ? 2 * t->cap : 32;
		slot **v = realloc(t->v, (size_t)cap * sizeof *v);
		if (!v)
			goto oom;
		t->v = v;
		t->cap = cap;
	}
	slot *s = malloc(sizeof *s);
	char *nm = strdup(name);
	if (!s || !nm) {
		free(s);
		free(nm);
		goto oom;
	}
	s->value = 0;
	s->name = nm;
	memmove(t->v + i + 1, t->v + i, (size_t)(t->n - i) * sizeof *t->v);
	t->v[i] = s;
	t->n++;
	return &s->value;
oom:
	/* Counting must never fail a caller: count into a shared sink. */
	epj_log_msg(EPJ_LOG_WARN, "counters: out of memory creating \"%s\"",
		    name);
	return &t->dropped;
}

int64_t *ej_counter_slot(epj_ctx *ctx, const char *name)
{
	EJ_ASSERT(ctx && ctx->counters && name);
	return table_slot(ctx->counters, name);
}

static int64_t prof_now_ns(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

void ej_prof_begin(const epj_ctx *ctx, ej_prof *p)
{
	p->t0_ns = ctx && ctx->profile ? prof_now_ns() : 0;
}

void ej_prof_end(epj_ctx *ctx, ej_prof *p, const char *fmt, ...)
{
	if (!p->t0_ns || !ctx || !ctx->profile)
		return;
	int64_t us = (prof_now_ns() - p->t0_ns) / 1000;
	p->t0_ns = 0;
	char name[200], full[220];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(name, sizeof name, fmt, ap);
	va_end(ap);
	snprintf(full, sizeof full, "profile.%s.us", name);
	*ej_counter_slot(ctx, full) += us;
	snprintf(full, sizeof full, "profile.%s.calls", name);
	*ej_counter_slot(ctx, full) += 1;
}

void epj_counter_add(epj_ctx *ctx, const char *name, int64_t delta)
{
	if (!ctx || !name)
		return;
	*ej_counter_slot(ctx, name) += delta;
}

void epj_counter_set(epj_ctx *ctx, const char *name, int64_t value)
{
	if (!ctx || !name)
		return;
	*ej_counter_slot(ctx, name) = value;
}

/* The driver counters of ctx's device (ej_dev_counters) as (name, value)
 * pairs "<device>.<counter>"; the number written (0 when the device keeps
 * none).  names must hold EJ_DEV_COUNTERS entries of 64 bytes. */
#define EJ_DEV_COUNTERS 10
static int dev_counters(const epj_ctx *ctx, char names[][64], int64_t *values)
{
	const ej_device *d = ctx ? ctx->dev : NULL;
	if (!d || !d->counters)
		return 0;
	ej_dev_counters c;
	d->counters(d->self, &c);
	const struct {
		const char *name;
		int64_t v;
	} f[EJ_DEV_COUNTERS] = {
		{ "launches", c.launches },
		{ "graph_launches", c.graph_launches },
		{ "mem_alloc", c.mem_alloc },
		{ "mem_free", c.mem_free },
		{ "syncs", c.syncs },
		{ "bytes.h2d", c.bytes_h2d },
		{ "bytes.d2h", c.bytes_d2h },
		{ "bytes.d2d", c.bytes_d2d },
		{ "reserved", c.reserved },
		{ "peak_reserved", c.peak_reserved },
	};
	for (int i = 0; i < EJ_DEV_COUNTERS; i++) {
		snprintf(names[i], 64, "%s.%s", d->name, f[i].name);
		values[i] = f[i].v;
	}
	return EJ_DEV_COUNTERS;
}

int64_t epj_counter_get(const epj_ctx *ctx, const char *name)
{
	if (!ctx || !name)
		return 0;
	if (ctx->dev && ctx->dev->counters) {
		size_t n = strlen(ctx->dev->name);
		if (!strncmp(name, ctx->dev->name, n) && name[n] == '.') {
			char names[EJ_DEV_COUNTERS][64];
			int64_t v[EJ_DEV_COUNTERS];
			int k = dev_counters(ctx, names, v);
			for (int i = 0; i < k; i++)
				if (!strcmp(names[i], name))
					return v[i];
		}
	}
	if (!ctx->counters)
		return 0;
	int i = table_find(ctx->counters, name);
	return i >= 0 ? ctx->counters->v[i]->value : 0;
}

/* ---- snapshots
 * ---------------------------------------------------------------
 */

typedef struct entry {
	char *name;
	int64_t value;
} entry;

struct epj_counters {
	entry *v; /* sorted by name, unique */
	int n, cap;
};

void epj_counters_free(epj_counters *c)
{
	if (!c)
		return;
	for (int i = 0; i < c->n; i++)
		free(c->v[i].name);
	free(c->v);
	free(c);
}

static epj_counters *counters_new(int cap)
{
	epj_counters *c = calloc(1, sizeof *c);
	if (!c)
		return NULL;
	c->cap = cap > 0 ? cap : 1;
	c->v = malloc((size_t)c->cap * sizeof *c->v);
	if (!c->v) {
		free(c);
		return NULL;
	}
	return c;
}

/* Appends (name, value); the caller keeps the order sorted or sorts later.
 */
static bool counters_push(epj_counters *c, const char *name, int64_t value)
{
	if (c->n == c->cap) {
		int cap = 2 * c->cap;
		entry *v = realloc(c->v, (size_t)cap * sizeof *v);
		if (!v)
			return false;
		c->v = v;
		c->cap = cap;
	}
	char *nm = strdup(name);
	if (!nm)
		return false;
	c->v[c->n].name = nm;
	c->v[c->n].value = value;
	c->n++;
	return true;
}

static int entry_cmp(const void *a, const void *b)
{
	return strcmp(((const entry *)a)->name, ((const entry *)b)->name);
}

/* Sorts by name and drops duplicates; for equal names the LAST pushed wins
 * (snapshot pushes memory.* last).  Insertion sort: stable, and counters are
 * few tens, usually pushed in order already. */
static void counters_sort_unique(epj_counters *c)
{
	for (int i = 1; i < c->n; i++) {
		entry e = c->v[i];
		int j = i - 1;
		while (j >= 0 && entry_cmp(&c->v[j], &e) > 0) {
			c->v[j + 1] = c->v[j];
			j--;
		}
		c->v[j + 1] = e;
	}
	int w = 0;
	for (int i = 0; i < c->n; i++) {
		if (w > 0 && strcmp(c->v[w - 1].name, c->v[i].name) == 0) {
			free(c->v[w - 1].name);
			c->v[w - 1] = c->v[i]; /* later entry wins */
		} else {
			c->v[w++] = c->v[i];
		}
	}
	c->n = w;
}

epj_counters *epj_counters_snapshot(epj_ctx *ctx)
{
	if (!ctx)
		return NULL;
	const ej_counter_table *t = ctx->counters;
	int n = t ? t->n : 0;
	epj_counters *c = counters_new(n + 7);
	if (!c)
		goto oom;
	for (int i = 0; i < n; i++)
		if (!counters_push(c, t->v[i]->name, t->v[i]->value))
			goto oom;
	epj_memory_stats ms;
	epj_memory_stats_get(ctx, &ms);
	const struct {
		const char *name;
		uint64_t v;
	} mem[] = {
		{ "memory.allocated", ms.allocated },
		{ "memory.reserved", ms.reserved },
		{ "memory.peak_allocated", ms.peak_allocated },
		{ "memory.peak_reserved", ms.peak_reserved },
		{ "memory.num_allocs", ms.num_allocs },
		{ "memory.device_allocs", ms.num_device_allocs },
		{ "memory.device_frees", ms.num_device_frees },
	};
	for (size_t i = 0; i < EJ_ARRAY_LEN(mem); i++)
		if (!counters_push(c, mem[i].name, (int64_t)mem[i].v))
			goto oom;
	char dn[EJ_DEV_COUNTERS][64];
	int64_t dv[EJ_DEV_COUNTERS];
	int nd = dev_counters(ctx, dn, dv);
	for (int i = 0; i < nd; i++)
		if (!counters_push(c, dn[i], dv[i]))
			goto oom;
	counters_sort_unique(c);
	return c;
oom:
	epj_counters_free(c);
	ej_error(ctx, EPJ_ERR_NOMEM, "counters_snapshot: out of memory");
	return NULL;
}

epj_counters *epj_counters_diff(const epj_counters *a, const epj_counters *b)
{
	int na = a ? a->n : 0, nb = b ? b->n : 0;
	epj_counters *c = counters_new(na + nb);
	if (!c)
		return NULL;
	/* Merge of two sorted, unique lists. */
	int i = 0, j = 0;
	while (i < na || j < nb) {
		int cmp = i == na   ? 1
			  : j == nb ? -1
				    : strcmp(a->v[i].name, b->v[j].name);
		bool ok;
		if (cmp < 0) {
			ok = counters_push(c, a->v[i].name, -a->v[i].value);
			i++;
		} else if (cmp > 0) {
			ok = counters_push(c, b->v[j].name, b->v[j].value);
			j++;
		} else {
			ok = counters_push(c, a->v[i].name,
					   b->v[j].value - a->v[i].value);
			i++;
			j++;
		}
		if (!ok) {
			epj_counters_free(c);
			return NULL;
		}
	}
	return c;
}

static int counters_find(const epj_counters *c, const char *name)
{
	int lo = 0, hi = c->n;
	while (lo < hi) {
		int mid = lo + (hi - lo) / 2;
		int cmp = strcmp(c->v[mid].name, name);
		if (cmp == 0)
			return mid;
		if (cmp < 0)
			lo = mid + 1;
		else
			hi = mid;
	}
	return -1;
}

int64_t epj_counters_value(const epj_counters *c, const char *name)
{
	if (!c || !name)
		return 0;
	int i = counters_find(c, name);
	return i >= 0 ? c->v[i].value : 0;
}

int epj_counters_count(const epj_counters *c)
{
	return c ? c->n : 0;
}

const char *epj_counters_name_at(const epj_counters *c, int i)
{
	return c && i >= 0 && i < c->n ? c->v[i].name : NULL;
}

int64_t epj_counters_value_at(const epj_counters *c, int i)
{
	return c && i >= 0 && i < c->n ? c->v[i].value : 0;
}

/* ---- JSON
 * ----------------------------------------------------------------------
 */

char *epj_counters_to_json(const epj_counters *c)
{
	if (!c)
		return NULL;
	json_t *o = json_object();
	if (!o)
		return NULL;
	for (int i = 0; i < c->n; i++) {
		if (json_object_set_new(o, c->v[i].name,
					json_integer(c->v[i].value)) != 0) {
			json_decref(o);
			return NULL;
		}
	}
	char *s = json_dumps(o, JSON_SORT_KEYS | JSON_INDENT(2));
	json_decref(o);
	return s;
}

epj_counters *epj_counters_from_json(const char *json)
{
	if (!json)
		return NULL;
	json_error_t err;
	json_t *o = json_loads(json, JSON_REJECT_DUPLICATES, &err);
	if (!o) {
		epj_log_msg(EPJ_LOG_DEBUG,
			    "counters_from_json: line %d column %d: %s",
			    err.line, err.column, err.text);
		return NULL;
	}
	epj_counters *c = NULL;
	if (!json_is_object(o)) {
		epj_log_msg(EPJ_LOG_DEBUG,
			    "counters_from_json: top level is not an object");
		goto fail;
	}
	c = counters_new((int)json_object_size(o));
	if (!c)
		goto fail;
	const char *key;
	json_t *val;
	json_object_foreach(o, key, val)
	{
		if (!json_is_integer(val)) {
			epj_log_msg(
			    EPJ_LOG_DEBUG,
			    "counters_from_json: \"%s\" is not an integer",
			    key);
			goto fail;
		}
		if (!counters_push(c, key, (int64_t)json_integer_value(val)))
			goto fail;
	}
	json_decref(o);
	counters_sort_unique(c);
	return c;
fail:
	json_decref(o);
	epj_counters_free(c);
	return NULL;
}
