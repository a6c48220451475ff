"""The Dynamo backend: AOTAutograd's ATen graphs, partitioned into what
epjit compiles and what stays in torch, the former lowered to epjit graphs
(lower.py) and compiled by libepjit."""

import collections
import ctypes
import functools
import json
import math
import os
import threading
import warnings

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from . import _lib, lower

_lock = threading.Lock()
# one context serves the process: a graph runs under this lock
_run_lock = threading.RLock()
# (op, reason) -> nodes left to torch, counted once per compiled FX graph
fallback = collections.Counter()
stats = collections.Counter()

# ops that compute nothing: a partition of only these is left to torch
_NON_COMPUTE = {
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
    "aten.squeeze.default", "aten.permute.default", "aten.transpose.int",
    "aten.t.default", "aten.expand.default", "aten.alias.default",
    "aten.detach.default", "aten.slice.Tensor", "getitem",
}


def _op_name(node):
    t = node.target
    return str(t) if not callable(t) or isinstance(
        t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


def _left_to_torch(gm, why):
    """Counts every node of gm (an FX graph that runs in torch) as left to
    torch with the reason `why`."""
    counted = collections.Counter(
        (_op_name(n), why) for n in gm.graph.nodes
        if n.op == "call_function" and _op_name(n) != "getitem")
    with _lock:
        fallback.update(counted)


class _Support(OperatorSupportBase):
    def __init__(self):
        super().__init__()
        self.reasons = {}

    def is_node_supported(self, submodules, node):
        why = lower.why_unsupported(node)
        if why:
            self.reasons[node] = why
        return why is None


# ---- torch tensors over epjit memory ----------------------------------------

_TYPESTR = {_lib.F32: "<f4", _lib.BF16: "<u2", _lib.F64: "<f8",
            _lib.I32: "<i4", _lib.I64: "<i8"}
_SIZE = {_lib.F32: 4, _lib.BF16: 2, _lib.F64: 8, _lib.I32: 4, _lib.I64: 8}


class _Owner:
    """Keeps one epjit tensor alive while numpy or torch view its memory:
    host memory through __array_interface__, device memory (cuda) through
    __cuda_array_interface__ (version 2: no stream of its own; the graph's
    work is ordered before torch's current stream already; bf16 as int16,
    the 2-byte integer every torch reads from it, then viewed as bf16)."""

    def __init__(self, handle, ptr, shape, strides, dt, cuda=False):
        self.handle = handle
        iface = {"data": (ptr, False), "shape": tuple(shape),
                 "strides": tuple(s * _SIZE[dt] for s in strides),
                 "typestr": _TYPESTR[dt], "version": 3}
        if cuda:
            if dt == _lib.BF16:
                iface["typestr"] = "<i2"
            iface["version"] = 2
            self.__cuda_array_interface__ = iface
        else:
            self.__array_interface__ = iface

    def __del__(self):
        if self.handle:
            with _run_lock:  # the context's allocator is not thread-safe
                _lib.lib.epj_tensor_free(self.handle)
            self.handle = None


def _to_torch(handle, dtype, device, desc):
    """A torch tensor on device viewing the epjit tensor `handle` (desc:
    its address, epjit dtype, shape and strides; no copy); owns the
    reference."""
    L = _lib.lib
    ptr, dt, shape, strides = desc
    if 0 in shape:
        L.epj_tensor_free(handle)
        return torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cuda":
        t = torch.as_tensor(_Owner(handle, ptr, shape, strides, dt, True),
                            device=device)
    else:
        import numpy as np  # CPU outputs only: a GPU-only venv may lack it
        t = torch.from_numpy(np.asarray(
            _Owner(handle, ptr, shape, strides, dt)))
    if dt == _lib.BF16:
        t = t.view(torch.bfloat16)
    return t


def _memory_order(val):
    """The dims of val from the largest stride down when val is a dense
    permutation of a contiguous tensor other than itself, else None."""
    if val.is_contiguous() or val.dim() < 2 or 0 in val.shape:
        return None
    st = val.stride()
    order = sorted(range(val.dim()), key=lambda d: (-st[d], d))
    if order == list(range(val.dim())):
        return None
    return order if val.permute(order).is_contiguous() else None


def _view_of(handle, base, desc):
    """The torch view of base that the epjit tensor `handle` (a view of
    base's borrowed memory; desc: its address, shape and strides) is;
    drops the reference."""
    L = _lib.lib
    ptr, shape, strides = desc
    off = ptr - base.data_ptr() if ptr else 0
    L.epj_tensor_free(handle)
    size = base.element_size()
    if off % size:
        raise _lib.EpjitError("output view not aligned to its input")
    return base.as_strided(shape, strides, base.storage_offset() + off // size)


def _as_real(t):
    """A complex tensor as the real one epjit reads (view_as_real); a
    lazily conjugated or negated tensor resolved (a copy)."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
        stats["input_copies"] += 1
    return torch.view_as_real(t) if t.is_complex() else t


def _out_as(t, real, cx):
    """The output t (real: t as epjit sees it), complex when cx."""
    if t.is_complex() == cx:
        return t
    if not cx:
        return real
    st = real.stride()
    if st[-1] != 1 or real.storage_offset() % 2 or any(
            s % 2 for s in st[:-1]):
        real = real.contiguous()
    return torch.view_as_complex(real)


# ---- recording the compiled graphs (EPJIT_GRAPH_RECORD) --------------------

# the file epjit.record_graphs() set ("": off); unset (None):
# $EPJIT_GRAPH_RECORD
record_path = None
_recorded = set()  # (path, graph) already in the file, from this process
_DT_NAME = {_lib.F32: "f32", _lib.BF16: "bf16", _lib.I32: "i32",
            _lib.I64: "i64", _lib.F64: "f64"}


def _record_file():
    if record_path is not None:
        return record_path or None
    return os.environ.get("EPJIT_GRAPH_RECORD") or None


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]


@functools.lru_cache(maxsize=None)
def _openmp_runtime():
    """The OpenMP runtime libepjit's kernels link and name in their cache
    keys (the shared object that defines omp_get_max_threads for libepjit:
    ej_hostcc_openmp_runtime, doc/compilers.md), or None."""
    try:
        fn = ctypes.cast(_lib.lib.omp_get_max_threads, ctypes.c_void_p)
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not dladdr(fn, ctypes.byref(info)) or not info.fname:
        return None
    path = info.fname.decode(errors="replace")
    return path if path.startswith("/") and "omp" in path else None


def _json_float(f):
    f = float(f)
    if math.isfinite(f):
        return f
    return "nan" if math.isnan(f) else ("inf" if f > 0 else "-inf")


class _Recording(lower.Lowering):
    """A Lowering that also writes down its graph API calls (the graph
    file's format: tools/warmup_graphs.c)."""

    def __init__(self, ctx, graph):
        super().__init__(ctx, graph)
        self.rec = {"inputs": [], "nodes": [], "outputs": []}

    def input(self, node, val):
        v = super().input(node, val)
        self.rec["inputs"].append({"dtype": _DT_NAME[lower.DTYPES[val.dtype]],
                                   "shape": [int(d) for d in val.shape]})
        return v

    def op(self, name, ins, ints=(), floats=(), n_out=1, metas=None):
        v = super().op(name, ins, ints, floats, n_out, metas)
        self.rec["nodes"].append({
            "op": name, "in": [int(i) for i in ins],
            "ints": [int(i) for i in ints],
            "floats": [_json_float(f) for f in floats], "n_out": int(n_out)})
        return v


def _save_graph(path, graph):
    """Adds graph to the graph file at path unless it holds it already (the
    file is locked while read and rewritten: ranks may share it)."""
    import fcntl
    key = json.dumps(graph, sort_keys=True, separators=(",", ":"))
    with _lock:
        if (path, key) in _recorded:
            return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        with os.fdopen(fd, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            text = f.read()
            data = json.loads(text) if text.strip() else {
                "epjit_graphs": 1, "graphs": []}
            if not isinstance(data, dict) or data.get("epjit_graphs") != 1 \
                    or not isinstance(data.get("graphs"), list):
                raise ValueError("not an epjit graph file")
            rt = _openmp_runtime()
            if data.get("openmp_runtime") != rt and data["graphs"]:
                raise ValueError("recorded for the OpenMP runtime %s, this "
                                 "process has %s" % (
                                     data.get("openmp_runtime"), rt))
            have = {json.dumps(g, sort_keys=True, separators=(",", ":"))
                    for g in data["graphs"]}
            if key not in have:
                have.add(key)
                data["graphs"].append(graph)
                f.seek(0)
                f.truncate()
                head = {"epjit_graphs": 1}
                if rt:
                    head["openmp_runtime"] = rt
                f.write(json.dumps(head)[:-1] + ', "graphs": [\n')
                f.write(",\n".join(json.dumps(g, separators=(",", ":"))
                                   for g in data["graphs"]))
                f.write("\n]}\n")
    except (OSError, ValueError) as e:
        warnings.warn("epjit: graph file %s: not recorded: %s" % (path, e))
        return
    with _lock:
        _recorded.update((path, k) for k in have)


# ---- one lowered partition ----------------------------------------------------


class EpjitGraph(torch.nn.Module):
    """An FX partition compiled by epjit; called like the partition."""

    def __init__(self, sub):
        super().__init__()
        self.sub = sub
        self.graph = None
        self.failed = None  # the error when epjit could not compile it

    def _build(self, args):
        """Lowers and compiles the partition for the layouts of args (the
        first call's): a dense permutation of a contiguous tensor (a
        transposed weight) is read in its memory order and permuted back
        inside the graph, with no copy."""
        sub = self.sub
        self.device = _graph_device(sub, args)
        self.edev = lower.epjit_device(self.device)[0]
        self.ctx = _lib.context(self.edev)
        # keeps it alive while we live
        self.compiler = _lib.compiler(self.edev)
        g = ctypes.c_void_p()
        _lib.check(self.ctx, _lib.lib.epj_graph_new(self.ctx, ctypes.byref(g)),
                   "epj_graph_new")
        self.graph = g
        self.in_dtypes = []
        record = _record_file()
        L = (_Recording if record else lower.Lowering)(self.ctx, g)
        out_node = None
        places = [n for n in sub.graph.nodes if n.op == "placeholder"]
        self.orders = [_memory_order(a) for a in args]
        for node, order in zip(places, self.orders):
            val = lower.real_val(node.meta["val"])
            L.input(node, val.permute(order) if order else val)
            self.in_dtypes.append(val.dtype)
        for node, order in zip(places, self.orders):
            if order:
                inv = sorted(range(len(order)), key=order.__getitem__)
                val = lower.real_val(node.meta["val"])
                L.env[node] = L.op("permute", [L.env[node]], inv,
                                   metas=[(list(val.shape), val.dtype)])
        index = {n: i for i, n in enumerate(places)}
        for node in sub.graph.nodes:
            if node.op == "call_function":
                lower.lower_node(L, node)
            elif node.op == "output":
                out_node = node
        res = out_node.args[0]
        self.tuple_out = isinstance(res, (tuple, list))
        outs = list(res) if self.tuple_out else [res]
        self.out_cx = [lower._is_cx(o) for o in outs]
        n_in = len(self.in_dtypes)
        # per output: ("in", i) an input passed through, ("out", j) the
        # j-th epjit output
        self.plan, values, self.out_dtypes = [], [], []
        for o in outs:
            if o in index:
                self.plan.append(("in", index[o]))
                continue
            v = L.env[o]
            if v < n_in:
                self.plan.append(("in", v))
                continue
            if v not in values:
                values.append(v)
                self.out_dtypes.append(L.dtype(v))
            self.plan.append(("out", values.index(v)))
        for v in values:
            _lib.check(self.ctx, _lib.lib.epj_graph_output(self.ctx, g, v),
                       "graph output")
        self.n_out = len(values)
        if self.n_out:
            _lib.check(self.ctx, _lib.lib.epj_graph_compile(
                self.ctx, self.compiler, g), "epjit compile")
            if record:
                L.rec["outputs"] = list(values)
                _save_graph(record, L.rec)
        with _lock:
            stats["graphs"] += 1

    def __del__(self):
        if getattr(self, "graph", None):
            with _run_lock:
                _lib.lib.epj_graph_free(self.graph)
            self.graph = None

    def forward(self, *args):
        real = [_as_real(a) for a in args]
        with _run_lock:
            if self.graph is None and self.failed is None:
                try:
                    self._build(real)
                except _lib.EpjitError as e:
                    self._give_up(e)
                except Exception as e:  # noqa: BLE001 (a rule's own bug)
                    # what epjit cannot compile runs in torch, never fails
                    self._give_up("%s in lowering: %s"
                                  % (type(e).__name__, e))
            if self.failed is not None:
                return self.sub(*args)
            try:
                return self._run(real, args)
            except _lib.EpjitError as e:
                # a kernel this device lacks (found at the first run): the
                # partition runs in torch from now on; any other failure
                # is the caller's
                if e.status != _lib.ERR_UNSUPPORTED:
                    raise
                self._give_up(e, "epjit: not on device %s" % self.edev)
                return self.sub(*args)

    def _give_up(self, err, why="epjit compile failed"):
        """The partition runs in torch from now on; its nodes are counted
        as left to torch with the reason `why`."""
        self.failed = str(err)
        if self.graph:
            _lib.lib.epj_graph_free(self.graph)
            self.graph = None
        warnings.warn("epjit: a graph runs in torch: %s" % err)
        _left_to_torch(self.sub, why)

    def _run(self, args, orig):
        """Runs the graph on args (complex tensors as view_as_real); orig:
        the arguments as given.  On a GPU the graph's kernels come after
        the work queued on torch's current stream, and torch's later work
        after them."""
        L = _lib.lib
        keep = []
        n_in = len(args)
        stream = None
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device).cuda_stream
            _lib.check(self.ctx, L.epj_ctx_wait_stream(self.ctx, stream),
                       "epjit: waiting for torch's stream")
        for i, a in enumerate(args):
            if self.orders[i]:
                a = a.permute(self.orders[i])
            if a.dtype == torch.bool:  # epjit's bool is int32 0 / 1
                a = a.to(torch.int32)
                stats["input_copies"] += 1
            if not a.is_contiguous():
                a = a.contiguous()
                stats["input_copies"] += 1
            keep.append(a)
        # one call: the inputs' addresses in, the outputs' descriptions out
        ptrs = (ctypes.c_void_p * max(1, n_in))(
            *[a.data_ptr() for a in keep])
        outs = (ctypes.c_void_p * max(1, self.n_out))()
        res = []
        if self.n_out:
            W = _lib.GRAPH_DESC
            desc = (ctypes.c_int64 * (W * self.n_out))()
            st = L.epj_graph_run_data(self.ctx, self.graph, ptrs, n_in,
                                      outs, self.n_out, desc)
            _lib.check(self.ctx, st, "epjit run")
            if stream is not None:
                _lib.check(self.ctx, L.epj_stream_wait_ctx(self.ctx, stream),
                           "epjit: ordering torch's stream")
            d = desc[:]
            j = 0
            try:
                for j in range(self.n_out):
                    r = d[W * j:W * (j + 1)]
                    nd = r[2]
                    shape = r[4:4 + nd]
                    strides = r[4 + _lib.MAX_DIMS:4 + _lib.MAX_DIMS + nd]
                    if r[3] >= 0:  # a view of torch's input: the same
                        t = _view_of(outs[j], keep[r[3]],
                                     (r[0], shape, strides))
                    else:
                        t = _to_torch(outs[j], self.out_dtypes[j],
                                      self.device,
                                      (r[0], r[1], shape, strides))
                    outs[j] = None  # owned by t now
                    if self.out_dtypes[j] == torch.bool:
                        t = t.to(torch.bool)
                    res.append(t)
            finally:  # an error on the way: the rest are not leaked
                for k in range(j, self.n_out):
                    if outs[k]:
                        L.epj_tensor_free(outs[k])
        final = [_out_as(orig[i], args[i], cx) if kind == "in" else
                 _out_as(res[i], res[i], cx)
                 for (kind, i), cx in zip(self.plan, self.out_cx)]
        return tuple(final) if self.tuple_out else final[0]


def _graph_device(sub, args):
    """The torch device an FX partition's tensors are on (one: the support
    check keeps each node on one device, and _merge each partition)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    for n in sub.graph.nodes:
        d = lower.node_device(n)
        if d is not None:
            return d
    return torch.device("cpu")


# ---- compile an FX graph ------------------------------------------------------


def _has_compute(nodes):
    return any(_op_name(n) not in _NON_COMPUTE for n in nodes)


def _convex(group):
    """No path leaves the node set `group` and comes back into it (fusing
    it into one call keeps the graph acyclic)."""
    seen, todo = set(), [u for n in group for u in n.users if u not in group]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for u in n.users:
            if u in group:
                return False
            todo.append(u)
    return True


def _merge(partitions):
    """Greedily merges partitions whose union stays convex: independent
    parts of one layer (the partitioner fuses along edges) become one
    epjit graph, so the compiler fuses and schedules across them."""
    from torch.fx.passes.infra.partitioner import Partition
    groups = []  # [device, nodes]
    for p in partitions:
        dev = next((d for d in map(lower.node_device, p.nodes)
                    if d is not None), None)
        for g in groups:
            if g[0] != dev:  # one graph runs on one device
                continue
            union = g[1] | set(p.nodes)
            if _convex(union):
                g[1].update(p.nodes)
                break
        else:
            groups.append([dev, set(p.nodes)])
    groups = [g[1] for g in groups]
    order = {}
    for p in partitions:
        for n in p.nodes:
            order[n] = len(order)
    return [Partition(id=i, nodes=sorted(g, key=order.__getitem__))
            for i, g in enumerate(groups)]


# ---- graphs with symbolic shapes ---------------------------------------------

# distinct input shapes one graph with symbolic shapes is specialized to;
# calls with shapes past them run the graph in torch
MAX_SHAPES = 8


def _symbolic(example_inputs):
    """Whether Dynamo traced with dynamic shapes: a SymInt input or a
    tensor whose sizes or strides are symbolic."""
    for a in example_inputs:
        if isinstance(a, torch.SymInt):
            return True
        if isinstance(a, torch.Tensor) and any(
                not isinstance(d, int) for d in (*a.shape, *a.stride())):
            return True
    return False


def _specialize(gm, args):
    """A copy of gm whose shapes are those of args (concrete tensors and
    ints): metadata propagated again with static fake tensors, and every
    integer the graph computes from sizes (placeholders, sym_size, the
    arithmetic on them) folded into its users' arguments as a constant."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    g = torch.fx.GraphModule(gm, graph)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(a, static_shapes=True)
             if isinstance(a, torch.Tensor) else a for a in args]
    FakeTensorProp(g, mode).propagate_dont_convert_inputs(*fakes)
    for node in list(g.graph.nodes):
        val = node.meta.get("val")
        if node.op not in ("placeholder", "call_function") or \
                isinstance(val, bool) or not isinstance(val, int):
            continue
        for user in list(node.users):
            user.args = torch.fx.node.map_arg(
                user.args, lambda a: val if a is node else a)
            user.kwargs = torch.fx.node.map_arg(
                user.kwargs, lambda a: val if a is node else a)
        if node.op == "call_function":
            g.graph.erase_node(node)
    g.graph.lint()
    g.recompile()
    return g


class _Specialized:
    """A graph traced with symbolic shapes, compiled once per distinct
    set of input shapes (at most MAX_SHAPES; the rest run in torch,
    counted), each compile that of a static graph."""

    def __init__(self, gm):
        self.gm = gm
        self.by_shape = {}
        self.lock = threading.Lock()

    def __call__(self, *args):
        key = tuple((tuple(a.shape), tuple(a.stride()), a.dtype, a.device)
                    if isinstance(a, torch.Tensor) else
                    (type(a).__name__, a) for a in args)
        fn = self.by_shape.get(key)
        if fn is None:
            with self.lock:
                fn = self.by_shape.get(key)
                if fn is None:
                    fn = self._compile(args)
                    self.by_shape[key] = fn
        return fn(*args)

    def _compile(self, args):
        if len(self.by_shape) >= MAX_SHAPES:
            _left_to_torch(self.gm, "symbolic shape: more than %d shapes"
                           % MAX_SHAPES)
            return self.gm
        try:
            g = _specialize(self.gm, args)
        except Exception as e:  # noqa: BLE001 (never fails the step)
            warnings.warn("epjit: a graph with symbolic shapes runs in "
                          "torch: %s: %s" % (type(e).__name__, e))
            _left_to_torch(self.gm, "symbolic shape: not specialized")
            return self.gm
        with _lock:
            stats["specialized"] += 1
        return compile_graph(g, args)


def compile_graph(gm, example_inputs):
    """Partitions gm, lowers the supported partitions to epjit graphs and
    returns the GraphModule that calls them (the rest runs in torch).  A
    graph traced with symbolic shapes is compiled per concrete shape at
    its calls (_Specialized)."""
    if _symbolic(example_inputs):
        return _Specialized(gm)
    support = _Support()
    part = CapabilityBasedPartitioner(gm, support,
                                      allows_single_node_partition=True)
    partitions = part.propose_partitions()
    alone = set()
    kept = []
    for p in partitions:
        if _has_compute(p.nodes):
            kept.append(p)
        else:
            alone.update(p.nodes)
    kept = _merge(kept)
    in_part = set()
    for p in kept:
        in_part.update(p.nodes)
    counted = collections.Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in in_part or \
                _op_name(node) == "getitem":
            continue
        if node in alone:
            why = "no compute around it"
        else:
            why = support.reasons.get(node, "not partitioned")
        counted[(_op_name(node), why)] += 1
    fused = part.fuse_partitions(kept) if kept else gm
    for node in fused.graph.nodes:
        if node.op == "call_module" and node.target.startswith("fused_"):
            sub = getattr(fused, node.target)
            setattr(fused, node.target, EpjitGraph(sub))
    with _lock:
        fallback.update(counted)
        stats["fx_graphs"] += 1
    fused.recompile()
    return fused


def _boxed(fn):
    from functorch.compile import make_boxed_func
    return make_boxed_func(fn)


def backend(gm, example_inputs, **kwargs):
    """The Dynamo backend ("epjit"): AOTAutograd with epjit compiling the
    forward and the backward graphs."""
    from torch._dynamo.backends.common import aot_autograd

    def fw(g, ex):
        return _boxed(compile_graph(g, ex))

    return aot_autograd(fw_compiler=fw, bw_compiler=fw)(gm, example_inputs)
