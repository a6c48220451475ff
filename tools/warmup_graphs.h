/* tools/warmup_graphs.h -- epjit-warmup --graphs: the graphs of a graph file
 * (recorded by the Python package, doc/torch.md) compiled through the public
 * graph API (tools/warmup_graphs.c).
 */
#ifndef EPJIT_WARMUP_GRAPHS_H
#define EPJIT_WARMUP_GRAPHS_H

#include "epjit.h"

/* Reads the graph file at path, validates every entry, then builds each
 * graph with epj_graph_input/node/output and compiles it, its backend
 * build deferred, through a new compiler of the device's default backend
 * (*c, the caller frees it; NULL on failure), as the Python package makes
 * it.  The file's OpenMP runtime, when it names one, becomes the one the
 * kernels link (ej_hostcc_set_openmp_runtime), so that their keys are
 * those the recording process looks up.  *n_graphs: the graphs of the
 * file.  A file that is not one (JSON, keys, types, dtypes, ops, counts,
 * values) is EPJ_ERR_FORMAT or the graph API's error, naming the file and
 * the entry; nothing is compiled then. */
epj_status warm_graphs_compile(epj_ctx *ctx, const char *path, epj_compiler **c,
			       int *n_graphs);

#endif /* EPJIT_WARMUP_GRAPHS_H */
