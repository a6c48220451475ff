"""ctypes bindings of libepjit's public C API (lib/epjit.h) used by the
package: the context, borrowed tensors, graphs, counters."""

import ctypes
import os

_HERE = os.path.dirname(os.path.abspath(__file__))

c_int64_p = ctypes.POINTER(ctypes.c_int64)
c_int_p = ctypes.POINTER(ctypes.c_int)
c_double_p = ctypes.POINTER(ctypes.c_double)
vp = ctypes.c_void_p

# epj_dtype
F32, BF16, I32, I64, F64 = 0, 1, 2, 3, 4


class EpjitError(RuntimeError):
    """A failed libepjit call: status name and the library's message."""


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
    "epj_tensor_borrow": (vp, [vp, ctypes.c_int, ctypes.c_int, c_int64_p,
                               vp]),
    "epj_tensor_free": (None, [vp]),
    "epj_tensor_dtype": (ctypes.c_int, [vp]),
    "epj_tensor_ndim": (ctypes.c_int, [vp]),
    "epj_tensor_shape": (c_int64_p, [vp]),
    "epj_tensor_strides": (c_int64_p, [vp]),
    "epj_tensor_data": (vp, [vp]),
    "epj_tensor_shares_storage": (ctypes.c_bool, [vp, vp]),
    "epj_tensor_numel": (ctypes.c_int64, [vp]),
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
    "epj_graph_run": (ctypes.c_int, [vp, vp, ctypes.POINTER(vp),
                                     ctypes.c_int, ctypes.POINTER(vp),
                                     ctypes.c_int]),
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
        raise EpjitError("%s: %s: %s" % (what, name, msg))


_ctx = None
_compiler = None


def context():
    """The process's cpu context (created at first use)."""
    global _ctx
    if _ctx is None:
        c = vp()
        st = lib.epj_ctx_new(b"cpu", ctypes.byref(c))
        check(None, st, "epj_ctx_new(cpu)")
        _ctx = c
    return _ctx


def compiler():
    """The process's compiler (the cache of compiled graphs)."""
    global _compiler
    if _compiler is None:
        ctx = context()
        c = vp()
        backend = os.environ.get("EPJIT_TORCH_BACKEND", "").encode()
        check(ctx, lib.epj_compiler_new(ctx, backend, ctypes.byref(c)),
              "epj_compiler_new")
        _compiler = c
    return _compiler


def counters_raw():
    """All counters of the context as {name: value}."""
    ctx = context()
    snap = lib.epj_counters_snapshot(ctx)
    if not snap:
        return {}
    try:
        n = lib.epj_counters_count(snap)
        return {lib.epj_counters_name_at(snap, i).decode():
                lib.epj_counters_value_at(snap, i) for i in range(n)}
    finally:
        lib.epj_counters_free(snap)
