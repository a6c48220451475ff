/* tools/warmup_graphs.c -- the graphs of a graph file, compiled for
 * epjit-warmup --graphs.
 *
 * The Python package records every graph its Dynamo backend compiles
 * (EPJIT_GRAPH_RECORD, doc/torch.md) as the calls it made to the graph
 * API:
 *
 *   {"epjit_graphs": 1,
 *    "graphs": [{"inputs": [{"dtype": "f32", "shape": [4, 16]}, ...],
 *                "nodes": [{"op": "matmul", "in": [0, 1], "ints": [],
 *                           "floats": [], "n_out": 1}, ...],
 *                "outputs": [2]}, ...]}
 *
 * Values are numbered as the graph API numbers them (inputs, then each
 * node's outputs); a float attribute that JSON cannot spell is the string
 * "inf", "-inf" or "nan".  An optional top-level "openmp_runtime" names the
 * OpenMP runtime the recording process's kernels link (torch's libgomp
 * under torch), which is part of every C artifact's key.  Replaying the calls
 * builds the same graphs, so compiling them fills the kernel cache with the
 * keys the torch run looks up.  Every entry is checked (keys, types, ranges)
 * and every graph built before the first compile, so a bad file compiles
 * nothing.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "warmup_graphs.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cc.h"
#include "jit_impl.h"

static const char *type_name(const json_t *v)
{
	switch (json_typeof(v)) {
	case JSON_OBJECT:
		return "an object";
	case JSON_ARRAY:
		return "an array";
	case JSON_STRING:
		return "a string";
	case JSON_INTEGER:
	case JSON_REAL:
		return "a number";
	default:
		return "true, false or null";
	}
}

/* The file and the entry an error names. */
typedef struct where {
	const char *path;
	int graph;	  /* -1: none */
	const char *what; /* "input", "node", "output", or NULL */
	int index;
} where;

static epj_status bad(epj_ctx *ctx, const where *w, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static epj_status bad(epj_ctx *ctx, const where *w, const char *fmt, ...)
{
	char msg[256], at[96] = "";
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	if (w->graph >= 0 && w->what)
		snprintf(at, sizeof at, ": graph %d, %s %d", w->graph, w->what,
			 w->index);
	else if (w->graph >= 0)
		snprintf(at, sizeof at, ": graph %d", w->graph);
	return ej_error(ctx, EPJ_ERR_FORMAT, "graph file %s%s: %s", w->path, at,
			msg);
}

/* Every key of o is one of keys[] (NULL-terminated) and those marked
 * required (a leading '!') are there. */
static epj_status check_keys(epj_ctx *ctx, const where *w, json_t *o,
			     const char *const *keys)
{
	if (!json_is_object(o))
		return bad(ctx, w, "an object expected, got %s", type_name(o));
	const char *k;
	json_t *v;
	json_object_foreach(o, k, v)
	{
		bool known = false;
		for (int i = 0; keys[i] && !known; i++)
			known = !strcmp(k, keys[i] + (keys[i][0] == '!'));
		if (!known)
			return bad(ctx, w, "unknown key \"%s\"", k);
	}
	for (int i = 0; keys[i]; i++)
		if (keys[i][0] == '!' && !json_object_get(o, keys[i] + 1))
			return bad(ctx, w, "no \"%s\"", keys[i] + 1);
	return EPJ_OK;
}

/* o[key] as an array (an absent optional key: NULL, size 0). */
static epj_status get_array(epj_ctx *ctx, const where *w, json_t *o,
			    const char *key, json_t **out)
{
	*out = json_object_get(o, key);
	if (*out && !json_is_array(*out))
		return bad(ctx, w, "\"%s\": an array expected, got %s", key,
			   type_name(*out));
	return EPJ_OK;
}

/* The integers of array a (NULL: none) into a new buffer *out, each in
 * [lo, hi]. */
static epj_status get_ints(epj_ctx *ctx, const where *w, json_t *a,
			   const char *key, int64_t lo, int64_t hi,
			   int64_t **out, int *n)
{
	size_t len = a ? json_array_size(a) : 0;
	*out = NULL;
	*n = 0;
	if (len > 1u << 20)
		return bad(ctx, w, "\"%s\": %zu entries", key, len);
	*out = calloc(len + 1, sizeof **out);
	if (!*out)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	for (size_t i = 0; i < len; i++) {
		json_t *v = json_array_get(a, i);
		if (!json_is_integer(v))
			return bad(ctx, w,
				   "\"%s\"[%zu]: an integer expected, "
				   "got %s",
				   key, i, type_name(v));
		json_int_t x = json_integer_value(v);
		if (x < lo || x > hi)
			return bad(ctx, w,
				   "\"%s\"[%zu]: %lld is not in "
				   "[%lld, %lld]",
				   key, i, (long long)x, (long long)lo,
				   (long long)hi);
		(*out)[i] = (int64_t)x;
	}
	*n = (int)len;
	return EPJ_OK;
}

static epj_status get_floats(epj_ctx *ctx, const where *w, json_t *a,
			     double **out, int *n)
{
	size_t len = a ? json_array_size(a) : 0;
	*out = NULL;
	*n = 0;
	if (len > 1u << 20)
		return bad(ctx, w, "\"floats\": %zu entries", len);
	*out = calloc(len + 1, sizeof **out);
	if (!*out)
		return ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	for (size_t i = 0; i < len; i++) {
		json_t *v = json_array_get(a, i);
		const char *s = json_string_value(v);
		if (json_is_number(v))
			(*out)[i] = json_number_value(v);
		else if (s && !strcmp(s, "inf"))
			(*out)[i] = INFINITY;
		else if (s && !strcmp(s, "-inf"))
			(*out)[i] = -INFINITY;
		else if (s && !strcmp(s, "nan"))
			(*out)[i] = NAN;
		else
			return bad(ctx, w,
				   "\"floats\"[%zu]: a number, \"inf\", "
				   "\"-inf\" or \"nan\" expected",
				   i);
	}
	*n = (int)len;
	return EPJ_OK;
}

static epj_status add_input(epj_ctx *ctx, const where *w, epj_graph *g,
			    json_t *in)
{
	static const char *const keys[] = { "!dtype", "!shape", NULL };
	epj_status st = check_keys(ctx, w, in, keys);
	if (st != EPJ_OK)
		return st;
	const char *name = json_string_value(json_object_get(in, "dtype"));
	int dt = 0;
	while (dt < EPJ_DTYPE_COUNT &&
	       !(name && !strcmp(name, epj_dtype_name((epj_dtype)dt))))
		dt++;
	if (dt == EPJ_DTYPE_COUNT)
		return bad(ctx, w,
			   "\"dtype\": f32, bf16, i32, i64 or f64 "
			   "expected");
	json_t *shape;
	int64_t *dims;
	int nd;
	if ((st = get_array(ctx, w, in, "shape", &shape)) != EPJ_OK)
		return st;
	st = get_ints(ctx, w, shape, "shape", 0, INT64_MAX, &dims, &nd);
	if (st == EPJ_OK && nd > EPJ_MAX_DIMS)
		st = bad(ctx, w, "\"shape\": rank %d (at most %d)", nd,
			 EPJ_MAX_DIMS);
	int value;
	if (st == EPJ_OK)
		st = epj_graph_input(ctx, g, (epj_dtype)dt, nd, dims, &value);
	free(dims);
	return st;
}

static epj_status add_node(epj_ctx *ctx, const where *w, epj_graph *g,
			   json_t *nd)
{
	static const char *const keys[] = { "!op",    "!in",	"ints",
					    "floats", "!n_out", NULL };
	epj_status st = check_keys(ctx, w, nd, keys);
	if (st != EPJ_OK)
		return st;
	const char *op = json_string_value(json_object_get(nd, "op"));
	json_t *n_out = json_object_get(nd, "n_out");
	if (!op)
		return bad(ctx, w, "\"op\": a string expected");
	if (!json_is_integer(n_out) || json_integer_value(n_out) < 1 ||
	    json_integer_value(n_out) > 1024)
		return bad(ctx, w,
			   "\"n_out\": an integer in [1, 1024] "
			   "expected");
	json_t *a_in, *a_ints, *a_floats;
	int64_t *in64 = NULL, *ints = NULL;
	double *floats = NULL;
	int *in = NULL, n_in = 0, n_ints = 0, n_floats = 0;
	if ((st = get_array(ctx, w, nd, "in", &a_in)) == EPJ_OK &&
	    (st = get_array(ctx, w, nd, "ints", &a_ints)) == EPJ_OK &&
	    (st = get_array(ctx, w, nd, "floats", &a_floats)) == EPJ_OK &&
	    (st = get_ints(ctx, w, a_in, "in", 0, INT_MAX, &in64, &n_in)) ==
		EPJ_OK &&
	    (st = get_ints(ctx, w, a_ints, "ints", INT64_MIN, INT64_MAX, &ints,
			   &n_ints)) == EPJ_OK &&
	    (st = get_floats(ctx, w, a_floats, &floats, &n_floats)) == EPJ_OK) {
		in = calloc((size_t)n_in + 1, sizeof *in);
		if (!in)
			st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
		for (int i = 0; in && i < n_in; i++)
			in[i] = (int)in64[i];
	}
	int first;
	if (st == EPJ_OK)
		st = epj_graph_node(ctx, g, op, in, n_in, ints, n_ints, floats,
				    n_floats, (int)json_integer_value(n_out),
				    &first);
	free(in);
	free(in64);
	free(ints);
	free(floats);
	return st;
}

/* Graph gi of the file into *out (built, not compiled). */
static epj_status build_graph(epj_ctx *ctx, const char *path, int gi,
			      json_t *jg, epj_graph **out)
{
	static const char *const keys[] = { "!inputs", "!nodes", "!outputs",
					    NULL };
	where w = { path, gi, NULL, 0 };
	json_t *ins, *nodes, *outs;
	epj_status st = check_keys(ctx, &w, jg, keys);
	if (st == EPJ_OK)
		st = get_array(ctx, &w, jg, "inputs", &ins);
	if (st == EPJ_OK)
		st = get_array(ctx, &w, jg, "nodes", &nodes);
	if (st == EPJ_OK)
		st = get_array(ctx, &w, jg, "outputs", &outs);
	if (st == EPJ_OK && json_array_size(outs) == 0)
		st = bad(ctx, &w, "\"outputs\" is empty");
	if (st == EPJ_OK)
		st = epj_graph_new(ctx, out);
	if (st != EPJ_OK)
		return st;
	epj_graph *g = *out;
	w.what = "input";
	for (size_t i = 0; st == EPJ_OK && i < json_array_size(ins); i++) {
		w.index = (int)i;
		st = add_input(ctx, &w, g, json_array_get(ins, i));
	}
	w.what = "node";
	for (size_t i = 0; st == EPJ_OK && i < json_array_size(nodes); i++) {
		w.index = (int)i;
		st = add_node(ctx, &w, g, json_array_get(nodes, i));
	}
	w.what = NULL;
	for (size_t i = 0; st == EPJ_OK && i < json_array_size(outs); i++) {
		json_t *v = json_array_get(outs, i);
		if (!json_is_integer(v) || json_integer_value(v) < 0 ||
		    json_integer_value(v) > INT_MAX)
			st =
			    bad(ctx, &w,
				"\"outputs\"[%zu]: a value number expected", i);
		else
			st = epj_graph_output(ctx, g,
					      (int)json_integer_value(v));
	}
	if (st != EPJ_OK && ctx->status != EPJ_ERR_FORMAT)
		/* the graph API's own check (op, count, value) */
		ej_error_prefix(ctx, "graph file %s: graph %d", path, gi);
	return st;
}

static epj_status load(epj_ctx *ctx, const char *path, json_t **root,
		       json_t **graphs)
{
	json_error_t jerr;
	where w = { path, -1, NULL, 0 };
	*root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
	if (!*root && jerr.line < 1) /* not read */
		return ej_error(ctx, EPJ_ERR_IO, "graph file %s: %s", path,
				jerr.text);
	if (!*root)
		return ej_error(ctx, EPJ_ERR_FORMAT,
				"graph file %s: line %d, column %d: %s", path,
				jerr.line, jerr.column, jerr.text);
	static const char *const keys[] = { "!epjit_graphs", "!graphs",
					    "openmp_runtime", NULL };
	epj_status st = check_keys(ctx, &w, *root, keys);
	if (st != EPJ_OK)
		return st;
	json_t *ver = json_object_get(*root, "epjit_graphs");
	if (!json_is_integer(ver) || json_integer_value(ver) != 1)
		return bad(ctx, &w, "\"epjit_graphs\": version 1 expected");
	if ((st = get_array(ctx, &w, *root, "graphs", graphs)) != EPJ_OK)
		return st;
	if (json_array_size(*graphs) > INT_MAX / 2)
		return bad(ctx, &w, "too many graphs");
	json_t *rt = json_object_get(*root, "openmp_runtime");
	if (rt && (!json_is_string(rt) || json_string_value(rt)[0] != '/'))
		return bad(ctx, &w,
			   "\"openmp_runtime\": an absolute path "
			   "expected");
	if (rt && access(json_string_value(rt), R_OK) != 0)
		return ej_error(ctx, EPJ_ERR_IO,
				"graph file %s: \"openmp_runtime\" %s: %s (the "
				"kernels link the recording process's OpenMP "
				"runtime: warm up where it is installed)",
				path, json_string_value(rt), strerror(errno));
	if (rt)
		ej_hostcc_set_openmp_runtime(json_string_value(rt));
	return EPJ_OK;
}

epj_status warm_graphs_compile(epj_ctx *ctx, const char *path,
			       epj_compiler **cp, int *n_graphs)
{
	json_t *root = NULL, *graphs = NULL;
	epj_compiler *c = NULL;
	*n_graphs = 0;
	*cp = NULL;
	epj_status st = load(ctx, path, &root, &graphs);
	if (st == EPJ_OK)
		st = epj_compiler_new(ctx, NULL, &c);
	if (st == EPJ_OK)
		ej_compiler_jit(c)->defer_build = true;
	int n = st == EPJ_OK ? (int)json_array_size(graphs) : 0;
	epj_graph **g = calloc((size_t)n + 1, sizeof *g);
	if (!g && st == EPJ_OK)
		st = ej_error(ctx, EPJ_ERR_NOMEM, "out of memory");
	for (int i = 0; st == EPJ_OK && i < n; i++)
		st =
		    build_graph(ctx, path, i, json_array_get(graphs, i), &g[i]);
	for (int i = 0; st == EPJ_OK && i < n; i++) {
		st = epj_graph_compile(ctx, c, g[i]);
		if (st != EPJ_OK)
			ej_error_prefix(ctx, "graph file %s: graph %d", path,
					i);
	}
	for (int i = 0; g && i < n; i++)
		epj_graph_free(g[i]);
	free(g);
	json_decref(root);
	if (st == EPJ_OK)
		*n_graphs = n;
	else
		epj_compiler_free(c);
	*cp = st == EPJ_OK ? c : NULL;
	return st;
}
