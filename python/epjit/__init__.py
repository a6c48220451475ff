"""epjit as a torch.compile backend.

    import torch, epjit
    model = torch.compile(model, backend="epjit")   # or backend=epjit.backend
    epjit.counters()   # graphs, unique_graphs, kernels, compiles, caches, fallback
    epjit.reset()

See doc/torch.md in the source tree.
"""

import atexit
import json
import os

from . import _lib
from ._backend import backend  # noqa: F401

__all__ = ["backend", "counters", "reset", "dump", "record_graphs"]
__version__ = "0.1.0"


def counters():
    """What epjit did in this process since the last reset().

    graphs: FX partitions lowered to epjit graphs and compiled;
    unique_graphs: of their segments, those compiled (not found by signature
    in the compiler's graph cache); graph_cache_hits / graph_cache_misses:
    lookups of that cache; kernels: kernels run by compiled graphs;
    compiles: host C compiler runs; cache_hits / cache_misses: the kernel
    cache (memory and disk); fallback: {op: {reason: nodes}} left to torch,
    counted per compiled FX graph; fallback_nodes: their total;
    input_copies: inputs torch copied before a graph read them (a layout
    other than the first call's); specialized: FX graphs traced with
    symbolic shapes (torch.compile's default dynamic=None after a shape
    changed, or dynamic=True) compiled for one concrete set of input
    shapes; raw: every libepjit counter."""
    from . import _backend as be
    raw = _lib.counters_raw()
    fb = {}
    for (op, why), n in sorted(be.fallback.items()):
        fb.setdefault(op, {})[why] = n
    return {
        "graphs": be.stats["graphs"],
        "unique_graphs": raw.get("stats.unique_graphs", 0),
        "graph_cache_hits": raw.get("stats.graph_cache_hits", 0),
        "graph_cache_misses": raw.get("stats.graph_cache_misses", 0),
        "kernels": raw.get("kernels.launched.compiled", 0),
        "compiles": raw.get("codegen.cc_compiles", 0),
        "cache_hits": raw.get("cache.mem_hits", 0) +
        raw.get("cache.disk_hits", 0),
        "cache_misses": raw.get("cache.misses", 0),
        "fallback": fb,
        "fallback_nodes": sum(be.fallback.values()),
        "input_copies": be.stats["input_copies"],
        "specialized": be.stats["specialized"],
        "raw": raw,
    }


def record_graphs(path):
    """From now on, adds every graph the backend compiles to the graph file
    at path (created when missing; graphs already there are not added
    again), for epjit-warmup --graphs to fill a kernel cache with.  Takes
    precedence over EPJIT_GRAPH_RECORD; None stops recording."""
    from . import _backend as be
    be.record_path = os.fspath(path) if path is not None else ""


def reset():
    """Zeroes the counters and starts a new compiler (an empty in-memory
    graph cache; the disk kernel cache stays).  Graphs compiled before keep
    working.  Does not reset Dynamo (torch._dynamo.reset())."""
    from . import _backend as be
    names = [n.encode() for n in _lib.counters_raw()
             if not n.startswith("memory.")]
    for ctx in _lib.contexts().values():
        for name in names:
            _lib.lib.epj_counter_set(ctx, name, 0)
    be.fallback.clear()
    be.stats.clear()
    _lib._compilers.clear()


def dump():
    """With EPJIT_DEBUG_DUMP=dir: writes dir/counters.json (libepjit's
    counters) and dir/torch_counters.json (what counters() returns, without
    raw: the graphs and the nodes left to torch)."""
    d = os.environ.get("EPJIT_DEBUG_DUMP")
    ctxs = _lib.contexts()
    if not d or not ctxs:
        return
    # counters.json: the context of the CPU tensors when there is one
    # (a second context's file would replace it)
    dev = "cpu" if "cpu" in ctxs else sorted(ctxs)[0]
    _lib.check(ctxs[dev], _lib.lib.epj_debug_dump(ctxs[dev]), "debug dump")
    c = counters()
    c.pop("raw")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "torch_counters.json"), "w") as f:
        json.dump(c, f, indent=1, sort_keys=True)


atexit.register(dump)
