"""ctypes bindings of libepjit's public C API (lib/epjit.h) used by the
package: contexts, graphs run on the caller's memory, stream joins,
counters."""

import ctypes
import os
import threading

_HERE = os.path.dirname(os.path.abspath(__file__))

c_int64_p = ctypes.POINTER(ctypes.c_int64)
c_int_p = ctypes.POINTER(ctypes.c_int)
c_double_p = ctypes.POINTER(ctypes.c_double)
vp = ctypes.c_void_p

# epj_dtype
F32, BF16, I32, I64, F64 = 0, 1, 2, 3, 4


# lib/epjit.h: EPJ_MAX_DIMS, and the int64 per output of
# epj_graph_run_data's description
MAX_DIMS = 8
GRAPH_DESC = 4 + 2 * MAX_DIMS

# epj_status values the package acts on
ERR_UNSUPPORTED = 9


class EpjitError(RuntimeError):
    """A failed libepjit call: status name and the library's message;
    .status is the epj_status (0 when not from a call)."""

    status = 0


def _candidates():
    env = os.environ.get("EPJIT_LIB")
    if env:
        yield env
        return
    yield os.path.join(_HERE, "lib", "libepjit.so")
    yield "libepjit.so"


def _load():
    errs = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL), path
        except OSError as e:
            errs.append("%s: %s" % (path, e))
    raise ImportError("epjit: cannot load libepjit.so (set EPJIT_LIB to its "
                      "path): " + "; ".join(errs))


lib, path = _load()

_SIGS = {
    "epj_status_name": (ctypes.c_char_p, [ctypes.c_int]),
    "epj_ctx_new": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(vp)]),
    "epj_ctx_free": (None, [vp]),
    "epj_ctx_error": (ctypes.c_char_p, [vp]),
    "epj_ctx_clear_error": (None, [vp]),
    "epj_tensor_free": (None, [vp]),
    "epj_ctx_wait_stream": (ctypes.c_int, [vp, vp]),
    "epj_stream_wait_ctx": (ctypes.c_int, [vp, vp]),
    "epj_ctx_cuda_ordinal": (ctypes.c_int, [vp]),
    "epj_compiler_new": (ctypes.c_int, [vp, ctypes.c_char_p,
                                        ctypes.POINTER(vp)]),
    "epj_compiler_free": (None, [vp]),
    "epj_graph_new": (ctypes.c_int, [vp, ctypes.POINTER(vp)]),
    "epj_graph_free": (None, [vp]),
    "epj_graph_input": (ctypes.c_int, [vp, vp, ctypes.c_int, ctypes.c_int,
                                       c_int64_p, c_int_p]),
    "epj_graph_node": (ctypes.c_int, [vp, vp, ctypes.c_char_p, c_int_p,
                                      ctypes.c_int, c_int64_p, ctypes.c_int,
                                      c_double_p, ctypes.c_int,
                                      ctypes.c_int, c_int_p]),
    "epj_graph_output": (ctypes.c_int, [vp, vp, ctypes.c_int]),
    "epj_graph_compile": (ctypes.c_int, [vp, vp, vp]),
    "epj_graph_run_data": (ctypes.c_int, [vp, vp, ctypes.POINTER(vp),
                                          ctypes.c_int, ctypes.POINTER(vp),
                                          ctypes.c_int, c_int64_p]),
    "epj_debug_dump": (ctypes.c_int, [vp]),
    "epj_counters_snapshot": (vp, [vp]),
    "epj_counters_free": (None, [vp]),
    "epj_counters_count": (ctypes.c_int, [vp]),
    "epj_counters_name_at": (ctypes.c_char_p, [vp, ctypes.c_int]),
    "epj_counters_value_at": (ctypes.c_int64, [vp, ctypes.c_int]),
    "epj_counter_set": (None, [vp, ctypes.c_char_p, ctypes.c_int64]),
}

for _name, (_res, _args) in _SIGS.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args


def check(ctx, status, what):
    """Raises EpjitError for a non-zero status, with the context's message."""
    if status != 0:
        name = lib.epj_status_name(status).decode()
        msg = lib.epj_ctx_error(ctx).decode(errors="replace") if ctx else ""
        if ctx:
            lib.epj_ctx_clear_error(ctx)
        e = EpjitError("%s: %s: %s" % (what, name, msg))
        e.status = status
        raise e


# epjit device name -> its context and compiler (created at first use,
# under _make_lock: threads may compile at once)
_make_lock = threading.RLock()
_ctxs = {}
_compilers = {}
# epjit device name -> why it cannot serve torch (None: it can)
_unusable = {}
CPU_DEVICES = ("cpu", "cuda-sim")


def cpu_device():
    """The epjit device that runs graphs of CPU tensors: cpu, or cuda-sim
    (EPJIT_TORCH_CPU_DEVICE=cuda-sim: the CUDA C a GPU would run, on the
    CPU, over the same host memory; for tests)."""
    d = os.environ.get("EPJIT_TORCH_CPU_DEVICE") or "cpu"
    if d not in CPU_DEVICES:
        raise EpjitError("EPJIT_TORCH_CPU_DEVICE=%r: not one of %s"
                         % (d, ", ".join(CPU_DEVICES)))
    return d


def context(device="cpu", ordinal=None):
    """The process's context on the epjit device `device` (created at first
    use).  cuda: the GPU torch numbers `ordinal` (EPJIT_CUDA_DEVICE, when
    set, must name the same one)."""
    c = _ctxs.get(device)
    if c is not None:
        return c
    with _make_lock:
        if device not in _ctxs:
            _ctxs[device] = _new_context(device, ordinal)
        return _ctxs[device]


def _new_context(device, ordinal):
    c = vp()
    env = os.environ.get("EPJIT_CUDA_DEVICE")
    if device == "cuda" and ordinal is not None and not env:
        os.environ["EPJIT_CUDA_DEVICE"] = str(ordinal)
    try:
        st = lib.epj_ctx_new(device.encode(), ctypes.byref(c))
    finally:
        if device == "cuda" and ordinal is not None and not env:
            del os.environ["EPJIT_CUDA_DEVICE"]
    check(None, st, "epj_ctx_new(%s)" % device)
    return c


def unusable(device, ordinal=None):
    """None when graphs of torch tensors can run on the epjit device
    `device`, else why not (kept: asked once per process)."""
    key = (device, ordinal) if device == "cuda" else device
    if key in _unusable:
        return _unusable[key]
    why = None
    try:
        c = context(device, ordinal)
        if device == "cuda":
            have = lib.epj_ctx_cuda_ordinal(c)
            if ordinal is not None and have != ordinal:
                why = "epjit's GPU is cuda:%d" % have
    except EpjitError as e:
        why = "no epjit %s device (%s)" % (device, e)
    _unusable[key] = why
    return why


def compiler(device="cpu"):
    """The process's compiler on `device` (its cache of compiled graphs).
    EPJIT_TORCH_BACKEND picks the code generator (default: the device's
    own)."""
    c = _compilers.get(device)
    if c is not None:
        return c
    with _make_lock:
        if device not in _compilers:
            ctx = context(device)
            c = vp()
            backend = os.environ.get("EPJIT_TORCH_BACKEND", "").encode()
            check(ctx, lib.epj_compiler_new(ctx, backend, ctypes.byref(c)),
                  "epj_compiler_new")
            _compilers[device] = c
        return _compilers[device]


def contexts():
    """The contexts made so far, by device name."""
    return dict(_ctxs)


def counters_raw(device=None):
    """All counters of the contexts as {name: value} (summed over
    devices), or of the context on `device` alone ({} when none)."""
    out = {}
    ctxs = _ctxs.values() if device is None else \
        [c for d, c in _ctxs.items() if d == device]
    for ctx in ctxs:
        snap = lib.epj_counters_snapshot(ctx)
        if not snap:
            continue
        try:
            n = lib.epj_counters_count(snap)
            for i in range(n):
                k = lib.epj_counters_name_at(snap, i).decode()
                out[k] = out.get(k, 0) + lib.epj_counters_value_at(snap, i)
        finally:
            lib.epj_counters_free(snap)
    return out
