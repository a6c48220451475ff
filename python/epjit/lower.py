"""Lowering of ATen FX nodes to epjit graph nodes (the op table of
lib/ops.def), and the support test the partitioner asks.

Each rule takes the lowering state, the FX node and returns the epjit value
(or a tuple of values for multi-output ops).  `why_unsupported(node)` returns
None when a rule exists and the node's arguments fit it, else the reason the
node stays in torch.
"""

import math
import operator

import torch

from . import _lib

aten = torch.ops.aten

DTYPES = {
    torch.float32: _lib.F32,
    torch.bfloat16: _lib.BF16,
    torch.float64: _lib.F64,
    torch.int32: _lib.I32,
    torch.int64: _lib.I64,
    torch.bool: _lib.I32,  # 0 / 1; the backend converts at the boundary
}
FLOATS = (torch.float32, torch.bfloat16, torch.float64)


class Unsupported(Exception):
    """A node the rules cannot lower (its message is the reason)."""


def _val(x):
    v = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return v


def _norm_dim(d, ndim):
    return d + ndim if d < 0 else d


def _shape(x):
    return list(_val(x).shape)


# ---- support --------------------------------------------------------------


def epjit_device(dev):
    """The epjit device that runs graphs of torch device dev, and the GPU
    ordinal (None off the GPU)."""
    if dev.type == "cuda":
        return "cuda", dev.index if dev.index is not None else \
            torch.cuda.current_device()
    return _lib.cpu_device(), None


def node_device(node):
    """The torch device of the first tensor node makes or reads, or
    None."""
    for x in [node] + list(node.all_input_nodes):
        v = _val(x)
        for t in (v if isinstance(v, (tuple, list)) else [v]):
            if isinstance(t, torch.Tensor):
                return t.device
    return None


def device_why(dev):
    """None when epjit runs graphs of tensors on torch device dev, else
    the reason."""
    if dev.type not in ("cpu", "cuda"):
        return "device %s" % dev.type
    why = _lib.unusable(*epjit_device(dev))
    return "device %s: %s" % (dev, why) if why else None


def _mixed_devices(vals):
    """The reason a node whose tensor values are vals stays in torch when
    they are on more than one device (one graph runs on one device), else
    None."""
    devs = {str(v.device) for v in vals}
    return "tensors on %s" % " and ".join(sorted(devs)) \
        if len(devs) > 1 else None


def _tensor_ok(v):
    if not isinstance(v, torch.Tensor):
        return "no tensor meta"
    if v.dtype not in DTYPES:
        return "dtype %s" % str(v.dtype).replace("torch.", "")
    why = device_why(v.device)
    if why:
        return why
    if any(not isinstance(s, int) for s in v.shape):
        return "symbolic shape"
    if v.ndim > 8:
        return "rank %d" % v.ndim
    return None


def _metas_ok(node):
    vals = []
    for a in node.all_input_nodes:
        vals.append(_val(a))
    out = _val(node)
    # a multi-output op's outputs it was asked not to make are None
    vals.extend([o for o in out if o is not None]
                if isinstance(out, (tuple, list)) else [out])
    vals = [v for v in vals
            if not (v is None and node.target is operator.getitem)]
    for v in vals:
        why = _tensor_ok(v)
        if why:
            return why
    return _mixed_devices(vals)


def why_unsupported(node):
    """None when node lowers, else the reason it runs in torch."""
    if node.op != "call_function":
        return "not a call"
    if involves_complex(node):
        return why_complex(node)
    if node.target is operator.getitem:
        src = node.args[0]
        if src.op == "call_function" and src.target in RULES:
            return _metas_ok(node)
        return "getitem of an unsupported node"
    rule = RULES.get(node.target)
    if rule is None:
        return "no rule"
    why = _metas_ok(node)
    if why:
        return why
    check = CHECKS.get(node.target)
    return check(node) if check else None


# ---- the lowering state ------------------------------------------------------


class Lowering:
    """Builds one epjit graph from the nodes of an FX partition."""

    def __init__(self, ctx, graph):
        self.ctx = ctx
        self.g = graph
        self.env = {}  # fx node -> value (or tuple of values)
        self.meta = {}  # value -> (shape list, torch dtype)
        # bool value -> the float value (exactly 0 / 1) it was cast from,
        # so a select reads the float and fuses with what computed it
        self.fbool = {}

    def to_bool(self, v, shape):
        """v (a float of exact 0 / 1) as a bool, remembered in fbool."""
        r = self.op("cast", [v], [DTYPES[torch.bool]],
                    metas=[(list(shape), torch.bool)])
        self.fbool[r] = v
        return r

    def input(self, node, val):
        shape = list(val.shape)
        arr = (ctypes_int64 * max(1, len(shape)))(*shape)
        out = _lib.ctypes.c_int()
        _lib.check(self.ctx, _lib.lib.epj_graph_input(
            self.ctx, self.g, DTYPES[val.dtype], len(shape), arr,
            _lib.ctypes.byref(out)), "graph input %s" % node.name)
        self.env[node] = out.value
        self.meta[out.value] = (shape, val.dtype)
        return out.value

    def op(self, name, ins, ints=(), floats=(), n_out=1, metas=None):
        """Appends op `name`; metas: [(shape, dtype)] of its outputs."""
        ci = (_lib.ctypes.c_int * max(1, len(ins)))(*ins)
        cl = (ctypes_int64 * max(1, len(ints)))(*[int(i) for i in ints])
        cf = (_lib.ctypes.c_double * max(1, len(floats)))(
            *[float(f) for f in floats])
        out = _lib.ctypes.c_int()
        _lib.check(self.ctx, _lib.lib.epj_graph_node(
            self.ctx, self.g, name.encode(), ci, len(ins), cl, len(ints), cf,
            len(floats), n_out, _lib.ctypes.byref(out)), "graph node %s" % name)
        vals = list(range(out.value, out.value + n_out))
        for v, m in zip(vals, metas or []):
            self.meta[v] = m
        return vals[0] if n_out == 1 else tuple(vals)

    def arg(self, x):
        return self.env[x]

    def shape(self, v):
        return self.meta[v][0]

    def dtype(self, v):
        return self.meta[v][1]

    def cast(self, v, dtype):
        if self.dtype(v) == dtype:
            return v
        return self.op("cast", [v], [DTYPES[dtype]],
                       metas=[(self.shape(v), dtype)])


ctypes_int64 = _lib.ctypes.c_int64


def _out_meta(node):
    v = _val(node)
    return (list(v.shape), v.dtype)


# ---- rules ----------------------------------------------------------------

RULES = {}
CHECKS = {}


def _registrar(rules, checks):
    """A decorator that enters a rule (and its check) for each target into
    the tables rules and checks."""
    def register(*targets, check=None):
        def deco(fn):
            for t in targets:
                rules[t] = fn
                if check:
                    checks[t] = check
            return fn
        return deco
    return register


rule = _registrar(RULES, CHECKS)


def _is_tensor_arg(x):
    return isinstance(x, torch.fx.Node)


def _pointwise_in(L, node, x, dtype):
    """x as a value of dtype (a tensor argument, cast when needed)."""
    return L.cast(L.arg(x), dtype)


_BINARY = {
    aten.add.Tensor: "add", aten.sub.Tensor: "sub", aten.mul.Tensor: "mul",
    aten.div.Tensor: "div", aten.add.Scalar: "add", aten.sub.Scalar: "sub",
    aten.mul.Scalar: "mul", aten.div.Scalar: "div",
}


def _binary_check(node):
    if node.kwargs.get("rounding_mode") is not None:
        return "rounding_mode"
    a, b = node.args[0], node.args[1]
    if not _is_tensor_arg(a):
        return "scalar first operand"
    if not (_is_tensor_arg(b) or isinstance(b, (int, float))):
        return "operand of type %s" % type(b).__name__
    dt = _val(node).dtype
    if dt not in FLOATS:
        if dt == torch.bool or _BINARY[node.target] == "div":
            return "integer arithmetic"
        alpha = node.kwargs.get("alpha", 1)
        if not (isinstance(b, int) or _is_tensor_arg(b)) or not isinstance(
                alpha, int):
            return "integer arithmetic with a float"
    return None


def _int_full(L, v, k):
    """The integer k as a tensor of v's dtype and rank (ones as dims)."""
    dt = L.dtype(v)
    one = [1] * len(L.shape(v))
    return L.op("full", [], [DTYPES[dt]] + one, [float(k)], metas=[(one, dt)])


@rule(*_BINARY, check=_binary_check)
def _binary(L, node):
    name = _BINARY[node.target]
    m = _out_meta(node)
    dt = m[1]
    a = _pointwise_in(L, node, node.args[0], dt)
    b = node.args[1]
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2
                            else 1)
    if dt not in FLOATS:  # integers: exact int64 arithmetic, no scalar ops
        bv = (_pointwise_in(L, node, b, dt) if _is_tensor_arg(b)
              else _int_full(L, a, b))
        if alpha != 1:
            bv = L.op("mul", [bv, _int_full(L, bv, alpha)],
                      metas=[(L.shape(bv), dt)])
        return L.op(name, [a, bv], metas=[m])
    if not _is_tensor_arg(b):
        s = float(b) * float(alpha)
        if name == "add":
            return L.op("add_scalar", [a], floats=[s], metas=[m])
        if name == "sub":
            return L.op("add_scalar", [a], floats=[-s], metas=[m])
        if name == "mul":
            return L.op("mul_scalar", [a], floats=[s], metas=[m])
        return L.op("mul_scalar", [a], floats=[1.0 / s], metas=[m])
    bv = _pointwise_in(L, node, b, dt)
    if alpha != 1:
        bv = L.op("mul_scalar", [bv], floats=[float(alpha)],
                  metas=[(L.shape(bv), dt)])
    return L.op(name, [a, bv], metas=[m])


# ---- comparisons and logic (bool is int32 0 / 1) ----------------------------

_CMP = {
    aten.eq.Tensor: "eq", aten.eq.Scalar: "eq", aten.ne.Tensor: "ne",
    aten.ne.Scalar: "ne", aten.le.Tensor: "le", aten.le.Scalar: "le",
    aten.ge.Tensor: "ge", aten.ge.Scalar: "ge", aten.lt.Tensor: "lt",
    aten.lt.Scalar: "lt", aten.gt.Tensor: "gt", aten.gt.Scalar: "gt",
}


def _cmp_dtype(node):
    """The dtype torch compares node's operands in (None: neither integers
    nor floats)."""
    a, b = node.args[0], node.args[1]
    if _is_tensor_arg(b):
        dt = torch.result_type(_val(a), _val(b))
    elif isinstance(b, (int, float)) and not isinstance(b, bool):
        dt = torch.result_type(_val(a), b)
    else:
        return None
    return dt if dt in FLOATS + INTS else None


def _cmp_check(node):
    a, b = node.args[0], node.args[1]
    if not _is_tensor_arg(a):
        return "scalar first operand"
    dt = _cmp_dtype(node)
    if dt is None:
        return "comparison of %s" % str(_val(a).dtype).replace("torch.", "")
    return None


def _stack_amax(L, a, b, shape, dt):
    """max(a, b) broadcast to shape, NaN-propagating (the first NaN; a on
    ties): the maximum op, which fuses."""
    bs = _bshape(L.shape(a), L.shape(b))
    r = L.op("maximum", [a, b], metas=[(bs, dt)])
    return r if bs == list(shape) else _bcast(L, r, list(shape))


def _fle(L, a, b, shape, dt):
    """a <= b (1 / 0 in dt) of two floats of shape: amax(a, b) == b, false
    where either is NaN (amax propagates it, and NaN equals nothing)."""
    return L.op("eq", [_stack_amax(L, a, b, shape, dt), b],
                metas=[(shape, dt)])


def _float_cmp(L, node, dt):
    """Float comparisons as torch's, NaN included: a <= b is
    amax(a, b) == b (amax propagates NaN, which equals nothing), a < b is
    (a <= b) - (a == b), ge and gt swap the sides, ne is 1 - eq."""
    m = _out_meta(node)
    shape = list(m[0])
    a = _bcast(L, L.cast(L.arg(node.args[0]), dt), shape)
    b = node.args[1]
    if _is_tensor_arg(b):
        b = L.cast(L.arg(b), dt)
    else:
        one = [1] * len(shape)
        b = L.op("full", [], [DTYPES[dt]] + one, [float(b)],
                 metas=[(one, dt)])
    b = _bcast(L, b, shape)
    name = _CMP[node.target]
    if name in ("ge", "gt"):
        a, b = b, a
    if name in ("eq", "ne"):
        r = L.op("eq", [a, b], metas=[(shape, dt)])
        if name == "ne":
            r = L.op("add_scalar", [L.op("neg", [r], metas=[(shape, dt)])],
                     floats=[1.0], metas=[(shape, dt)])
    else:
        r = _fle(L, a, b, shape, dt)
        if name in ("lt", "gt"):
            eq = L.op("eq", [a, b], metas=[(shape, dt)])
            r = L.op("sub", [r, eq], metas=[(shape, dt)])
    return L.to_bool(r, shape)


@rule(*_CMP, check=_cmp_check)
def _cmp(L, node):
    """Integer comparisons, exact while the difference fits int64: a <= b is
    max(a - b, 0) == 0 (in f64, which keeps an integer's sign), the others
    by swapping sides and 1 - x; eq and ne through eq.  Floats:
    _float_cmp."""
    dt = _cmp_dtype(node)
    if dt in FLOATS:
        return _float_cmp(L, node, dt)
    m = _out_meta(node)
    i64, f64 = torch.int64, torch.float64
    a = L.cast(L.arg(node.args[0]), i64)
    b = node.args[1]
    b = L.cast(L.arg(b), i64) if _is_tensor_arg(b) else _int_full(L, a, b)
    name = _CMP[node.target]
    shape = list(m[0])
    if name in ("lt", "ge"):
        a, b = b, a
    if name in ("eq", "ne"):
        r = L.op("cast", [L.op("eq", [a, b], metas=[(shape, i64)])],
                 [DTYPES[torch.bool]], metas=[m])
        if name == "eq":
            return r
        one = _const(L, 1, torch.bool, len(shape))
        return L.op("sub", [one, r], metas=[m])
    d = L.cast(L.op("sub", [a, b], metas=[(shape, i64)]), f64)
    z = _const(L, 0.0, f64, len(shape))
    r = L.op("eq", [_max0(L, d, f64), z], metas=[(shape, f64)])
    if name in ("gt", "lt"):
        r = L.op("add_scalar", [L.op("neg", [r], metas=[(shape, f64)])],
                 floats=[1.0], metas=[(shape, f64)])
    return L.to_bool(r, shape)


def _isnan_check(node):
    return None if _val(node.args[0]).dtype in FLOATS else "isnan of integers"


@rule(aten.isnan.default, check=_isnan_check)
def _isnan(L, node):
    """1 - (x == x): only NaN differs from itself."""
    m = _out_meta(node)
    x = L.arg(node.args[0])
    shape, dt = list(L.shape(x)), L.dtype(x)
    r = L.op("cast", [L.op("eq", [x, x], metas=[(shape, dt)])],
             [DTYPES[torch.bool]], metas=[m])
    ones = L.op("full", [], [DTYPES[torch.bool]] + shape, [1.0], metas=[m])
    return L.op("sub", [ones, r], metas=[m])


def _logic_check(node):
    for x in node.args[:2]:
        if not _is_tensor_arg(x) or _val(x).dtype != torch.bool:
            return "bitwise op of non-bools"
    return None


@rule(aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.logical_and.default,
      aten.logical_or.default, check=_logic_check)
def _logic(L, node):
    """and = a b, or = a + b - a b on bools (0 / 1); in the float a
    comparison made them from (L.fbool), so the mask fuses with the
    comparisons and with a select on it, else in int32."""
    m = _out_meta(node)
    a, b = L.arg(node.args[0]), L.arg(node.args[1])
    is_and = node.target in (aten.bitwise_and.Tensor,
                             aten.logical_and.default)
    if a in L.fbool or b in L.fbool:
        fs = [L.fbool.get(x) for x in (a, b)]
        kinds = {L.dtype(f) for f in fs if f is not None}
        dt = kinds.pop() if len(kinds) == 1 else torch.float32
        fa, fb = (L.cast(f if f is not None else x, dt)
                  for f, x in zip(fs, (a, b)))
        bs = _bshape(L.shape(fa), L.shape(fb))
        r = L.op("mul", [fa, fb], metas=[(bs, dt)])
        if not is_and:
            r = L.op("sub", [L.op("add", [fa, fb], metas=[(bs, dt)]), r],
                     metas=[(bs, dt)])
        if bs != list(m[0]):
            r = _bcast(L, r, list(m[0]))
        return L.to_bool(r, m[0])
    ab = L.op("mul", [a, b], metas=[m])
    if is_and:
        return ab
    s = L.op("add", [a, b], metas=[m])
    return L.op("sub", [s, ab], metas=[m])


def _not_check(node):
    if _val(node.args[0]).dtype != torch.bool:
        return "bitwise_not of non-bools"
    return None


@rule(aten.bitwise_not.default, aten.logical_not.default, check=_not_check)
def _not(L, node):
    """1 - a on bools: in the float of a comparison when there is one."""
    m = _out_meta(node)
    a = L.arg(node.args[0])
    f = L.fbool.get(a)
    if f is not None:
        dt = L.dtype(f)
        r = L.op("add_scalar", [L.op("neg", [f], metas=[(L.shape(f), dt)])],
                 floats=[1.0], metas=[(L.shape(f), dt)])
        return L.to_bool(r, m[0])
    one = L.op("full", [], [DTYPES[torch.bool]] + [1] * len(m[0]), [1.0],
               metas=[([1] * len(m[0]), torch.bool)])
    return L.op("sub", [one, a], metas=[m])


def _arange_check(node):
    args = [a for a in node.args if a is not None]
    if not all(isinstance(a, (int, float)) for a in args):
        return "arange bounds"
    if _val(node).dtype in FLOATS:
        if not all(float(a).is_integer() for a in args):
            return "arange with a fractional bound"
        if max(abs(float(a)) for a in args) + _val(node).shape[0] * abs(
                float(args[2] if len(args) > 2 else 1)) >= 1 << 24:
            return "arange past 2^24"
    return None


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step,
      check=_arange_check)
def _arange(L, node):
    """start + step i: a range (doubling cats) scaled and shifted."""
    m = _out_meta(node)
    n = m[0][0]
    start = node.args[0] if node.target != aten.arange.default else 0
    step = node.args[2] if node.target == aten.arange.start_step else 1
    if n == 0:
        return L.op("full", [], [DTYPES[m[1]], 0], [0.0], metas=[m])
    # floats: integers below 2^24, exact in f32 (bf16 rounds once at the end)
    w = torch.float32 if m[1] == torch.bfloat16 else m[1]
    v = _iota(L, n, w)
    if step != 1:
        v = L.op("mul", [v, L.op("full", [], [DTYPES[w], 1],
                                 [float(step)], metas=[([1], w)])],
                 metas=[([n], w)])
    if start != 0:
        v = L.op("add", [v, L.op("full", [], [DTYPES[w], 1],
                                 [float(start)], metas=[([1], w)])],
                 metas=[([n], w)])
    return L.cast(v, m[1])


_UNARY = {
    aten.neg.default: "neg", aten.exp.default: "exp",
    aten.log.default: "log", aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt", aten.silu.default: "silu",
    aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh",
    aten.gelu.default: "gelu", aten.cos.default: "cos",
    aten.sin.default: "sin", aten.log1p.default: "log1p",
}


def _unary_check(node):
    if node.kwargs.get("approximate", "none") != "none":
        return "gelu approximate=%s" % node.kwargs["approximate"]
    if _val(node).dtype not in FLOATS:
        return "integer input"
    return None


@rule(*_UNARY, check=_unary_check)
def _unary(L, node):
    m = _out_meta(node)
    a = _pointwise_in(L, node, node.args[0], m[1])
    return L.op(_UNARY[node.target], [a], metas=[m])


def _abs_check(node):
    return None if _val(node).dtype in FLOATS + (torch.int32, torch.int64) \
        else "abs of %s" % str(_val(node).dtype).replace("torch.", "")


@rule(aten.abs.default, check=_abs_check)
def _abs(L, node):
    """maximum(x, -x) (NaN stays NaN), plus 0 for floats: -0 + 0 is +0, as
    torch's abs(-0)."""
    m = _out_meta(node)
    x = _pointwise_in(L, node, node.args[0], m[1])
    if m[1] in FLOATS:
        nx = L.op("neg", [x], metas=[m])
    else:
        nx = L.op("sub", [_const(L, 0, m[1], len(m[0])), x], metas=[m])
    r = L.op("maximum", [x, nx], metas=[m])
    return L.op("add_scalar", [r], floats=[0.0], metas=[m]) \
        if m[1] in FLOATS else r


def _sign_check(node):
    return None if _val(node).dtype in FLOATS else "sign of integers"


@rule(aten.sign.default, aten.sgn.default, check=_sign_check)
def _sign(L, node):
    """(x > 0) - (x < 0) in x's float: 1, -1, or +0 for +-0 and NaN (as
    torch's sign of real numbers)."""
    m = _out_meta(node)
    shape, dt = list(m[0]), m[1]
    x = _pointwise_in(L, node, node.args[0], dt)
    z = _bcast(L, _const(L, 0.0, dt, len(shape)), shape)

    def lt(a, b):  # a < b: (a <= b) - (a == b), 0 where either is NaN
        return L.op("sub", [_fle(L, a, b, shape, dt),
                            L.op("eq", [a, b], metas=[(shape, dt)])],
                    metas=[(shape, dt)])
    return L.op("sub", [lt(z, x), lt(x, z)], metas=[(shape, dt)])


def _expm1_check(node):
    dt = _val(node).dtype
    return None if dt in (torch.float32, torch.bfloat16) else \
        "expm1 of %s" % str(dt).replace("torch.", "")


@rule(aten.expm1.default, check=_expm1_check)
def _expm1(L, node):
    """exp(x) - 1 in f64, which keeps an f32 result's digits for |x| >=
    1e-5; below that x (1 + x / 2) (its error x^3 / 6 is under f64's
    rounding of x; -0 stays -0); rounded once to the result's dtype.  NaN,
    Inf and -Inf as torch's (NaN, Inf, -1)."""
    m = _out_meta(node)
    shape, f64 = list(m[0]), torch.float64
    x = L.cast(L.arg(node.args[0]), f64)
    w = (shape, f64)
    t = L.op("add_scalar", [L.op("exp", [x], metas=[w])], floats=[-1.0],
             metas=[w])
    half = L.op("add_scalar", [L.op("mul_scalar", [x], floats=[0.5],
                                    metas=[w])], floats=[1.0], metas=[w])
    small = L.op("mul", [x, half], metas=[w])  # x (1 + x / 2): -0 stays
    ax = L.op("maximum", [x, L.op("neg", [x], metas=[w])], metas=[w])
    near0 = _fle(L, ax, _bcast(L, _const(L, 1e-5, f64, len(shape)), shape),
                 shape, f64)
    return L.cast(_pick(L, near0, small, t, shape, f64), m[1])


def _pow_scalar_base_check(node):
    base = node.args[0]
    if _val(node).dtype not in FLOATS or \
            _val(node.args[1]).dtype not in FLOATS:
        return "pow of integers"
    if not isinstance(base, (int, float)) or isinstance(base, bool) or \
            not (0 < base < float("inf")):
        return "pow base %r" % (base,)
    return None


@rule(aten.pow.Scalar, check=_pow_scalar_base_check)
def _pow_scalar_base(L, node):
    """base ** x for a finite base > 0: exp(x ln(base)) in f64, rounded
    once (1 for base 1, whatever x, as torch's)."""
    m = _out_meta(node)
    base = float(node.args[0])
    if base == 1.0:
        return _bcast(L, _const(L, 1.0, m[1], len(m[0])), list(m[0]))
    f64 = torch.float64
    w = (list(m[0]), f64)
    x = L.cast(L.arg(node.args[1]), f64)
    e = L.op("mul_scalar", [x], floats=[math.log(base)], metas=[w])
    return L.cast(L.op("exp", [e], metas=[w]), m[1])


@rule(aten.reciprocal.default, check=_unary_check)
def _reciprocal(L, node):
    """1 / x (a division, as torch's: 1 / 0 is Inf, 1 / -0 is -Inf)."""
    m = _out_meta(node)
    a = _pointwise_in(L, node, node.args[0], m[1])
    return L.op("div", [_const(L, 1.0, m[1], len(m[0])), a], metas=[m])


def _softplus_args(node):
    """(beta, threshold) of softplus or softplus_backward."""
    k = 2 if node.target == aten.softplus_backward.default else 1
    a = list(node.args[k:k + 2])
    beta = a[0] if len(a) > 0 else node.kwargs.get("beta", 1)
    th = a[1] if len(a) > 1 else node.kwargs.get("threshold", 20)
    return beta, th


def _relu_check(node):
    dt = _val(node).dtype
    if dt not in FLOATS + (torch.int32, torch.int64):
        return "relu of %s" % str(dt).replace("torch.", "")
    return None


@rule(aten.relu.default, check=_relu_check)
def _relu(L, node):
    """max(x, 0) (NaN stays NaN, as torch's)."""
    m = _out_meta(node)
    return _max0(L, L.arg(node.args[0]), m[1])


def _clamp_check(node):
    dt = _val(node).dtype
    if dt not in FLOATS + (torch.int32, torch.int64):
        return "clamp of %s" % str(dt).replace("torch.", "")
    for b in _clamp_bounds(node):
        if b is not None and not isinstance(b, (int, float)):
            return "clamp bound"
        if isinstance(b, float) and dt not in FLOATS and b != int(b):
            return "clamp of integers to a fraction"
    return None


def _clamp_bounds(node):
    """(lo, hi) of clamp, clamp_min, clamp_max (None: no bound)."""
    a = list(node.args[1:]) + [None, None]
    if node.target == aten.clamp_min.default:
        return a[0], None
    if node.target == aten.clamp_max.default:
        return None, a[0]
    lo = a[0] if len(node.args) > 1 else node.kwargs.get("min")
    hi = a[1] if len(node.args) > 2 else node.kwargs.get("max")
    return lo, hi


@rule(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
      check=_clamp_check)
def _clamp(L, node):
    """min(max(x, lo), hi) with amax of stacked pairs, the min through the
    order-reversing map (NaN stays NaN, as torch's)."""
    m = _out_meta(node)
    shape, dt = list(m[0]), m[1]
    v = L.cast(L.arg(node.args[0]), dt)
    lo, hi = _clamp_bounds(node)
    r = len(shape)
    if lo is not None:
        v = _stack_amax(L, v, _const(L, lo, dt, r), shape, dt)
    if hi is not None:
        nv = _flip_order(L, v, dt, r)
        nh = _flip_order(L, _const(L, hi, dt, r), dt, r)
        v = _flip_order(L, _stack_amax(L, nv, nh, shape, dt), dt, r)
    return v


def _maximum_check(node):
    dt = _val(node).dtype
    if dt not in FLOATS + (torch.int32, torch.int64):
        return "%s of %s" % (node.target.__name__.split(".")[0],
                             str(dt).replace("torch.", ""))
    if not all(_is_tensor_arg(a) for a in node.args[:2]):
        return "maximum of a number"
    return None


@rule(aten.maximum.default, aten.minimum.default, check=_maximum_check)
def _maximum(L, node):
    """maximum: the maximum op (NaN-propagating); minimum through the
    order-reversing map, min(a, b) = f(max(f(a), f(b)))."""
    m = _out_meta(node)
    shape, dt = list(m[0]), m[1]
    r = len(shape)
    a, b = (L.cast(L.arg(x), dt) for x in node.args[:2])
    if node.target == aten.maximum.default:
        return _stack_amax(L, a, b, shape, dt)
    fa, fb = (_flip_order(L, x, dt, len(L.shape(x))) for x in (a, b))
    return _flip_order(L, _stack_amax(L, fa, fb, shape, dt), dt, r)


def _threshold_check(node):
    if _val(node).dtype not in FLOATS:
        return "threshold of integers"
    if not all(isinstance(a, (int, float)) for a in node.args[1:3]):
        return "threshold"
    return None


@rule(aten.threshold.default, check=_threshold_check)
def _threshold(L, node):
    """x where x > threshold, else value (NaN x stays, as torch's x <=
    threshold test is false there)."""
    m = _out_meta(node)
    shape, dt = list(m[0]), m[1]
    x = _bcast(L, L.cast(L.arg(node.args[0]), dt), shape)
    t = _bcast(L, _const(L, node.args[1], dt, len(shape)), shape)
    le = _fle(L, x, t, shape, dt)
    return _pick(L, le, _const(L, node.args[2], dt, len(shape)), x, shape,
                 dt)


def _threshold_backward_check(node):
    if _val(node).dtype not in FLOATS:
        return "threshold_backward of integers"
    if not isinstance(node.args[2], (int, float)):
        return "threshold"
    return None


@rule(aten.threshold_backward.default, check=_threshold_backward_check)
def _threshold_backward(L, node):
    """grad where x > threshold, else exactly 0 (NaN x keeps the grad, as
    torch's x <= threshold test is false there)."""
    m = _out_meta(node)
    shape, dt = list(m[0]), m[1]
    g = _bcast(L, L.cast(L.arg(node.args[0]), dt), shape)
    x = _bcast(L, L.cast(L.arg(node.args[1]), dt), shape)
    t = _bcast(L, _const(L, node.args[2], dt, len(shape)), shape)
    le = _fle(L, x, t, shape, dt)
    return _pick(L, le, _const(L, 0.0, dt, len(shape)), g, shape, dt)


def _softplus_check(node):
    beta, th = _softplus_args(node)
    if not isinstance(beta, (int, float)) or beta <= 0:
        return "softplus beta %s" % beta
    if not isinstance(th, (int, float)) or th < 20:
        return "softplus threshold %s" % th
    return None if _val(node).dtype in FLOATS else "integer input"


def _max0(L, v, dt):
    """max(v, 0): maximum with a zero that broadcasts (NaN stays NaN)."""
    shape = list(L.shape(v))
    return _stack_amax(L, v, _const(L, 0.0, dt, len(shape)), shape, dt)


@rule(aten.softplus.default, aten.softplus_backward.default,
      check=_softplus_check)
def _softplus(L, node):
    """softplus(x) = (m + log1p(exp(b x - 2 m))) / b with m = max(b x, 0),
    which never overflows and equals x above torch's threshold (>= 20,
    where exp(-b x) is below the ulp); its backward is g * sigmoid(b x).
    bf16 is computed in f32 and rounded once."""
    m = _out_meta(node)
    work = torch.float32 if m[1] == torch.bfloat16 else m[1]
    bw = node.target == aten.softplus_backward.default
    x = L.cast(L.arg(node.args[1 if bw else 0]), work)
    beta = float(_softplus_args(node)[0])
    shape = list(L.shape(x))
    w = (shape, work)
    bx = x if beta == 1.0 else L.op("mul_scalar", [x], floats=[beta],
                                    metas=[w])
    if bw:
        g = L.cast(L.arg(node.args[0]), work)
        sg = L.op("sigmoid", [bx], metas=[w])
        return L.cast(L.op("mul", [g, sg], metas=[w]), m[1])
    mx = _max0(L, bx, work)
    t = L.op("sub", [bx, L.op("add", [mx, mx], metas=[w])], metas=[w])
    y = L.op("add", [mx, L.op("log1p", [L.op("exp", [t], metas=[w])],
                                metas=[w])], metas=[w])
    if beta != 1.0:
        y = L.op("mul_scalar", [y], floats=[1.0 / beta], metas=[w])
    return L.cast(y, m[1])


def _pow_check(node):
    if not isinstance(node.args[1], (int, float)):
        return "tensor exponent"
    return None if _val(node).dtype in FLOATS else "integer input"


@rule(aten.pow.Tensor_Scalar, check=_pow_check)
def _pow(L, node):
    m = _out_meta(node)
    a = _pointwise_in(L, node, node.args[0], m[1])
    e = float(node.args[1])
    if e == 1.0:
        return a
    if e == 2.0:
        return L.op("mul", [a, a], metas=[m])
    return L.op("pow_scalar", [a], floats=[e], metas=[m])


@rule(aten.silu_backward.default, aten.gelu_backward.default,
      check=_unary_check)
def _act_backward(L, node):
    m = _out_meta(node)
    g = _pointwise_in(L, node, node.args[0], m[1])
    x = _pointwise_in(L, node, node.args[1], m[1])
    name = ("silu_backward" if node.target == aten.silu_backward.default
            else "gelu_backward")
    return L.op(name, [g, x], metas=[m])


@rule(aten.sigmoid_backward.default, aten.tanh_backward.default)
def _sat_backward(L, node):
    m = _out_meta(node)
    g = _pointwise_in(L, node, node.args[0], m[1])
    y = _pointwise_in(L, node, node.args[1], m[1])
    if node.target == aten.sigmoid_backward.default:
        ny = L.op("neg", [y], metas=[(L.shape(y), m[1])])
        one_m = L.op("add_scalar", [ny], floats=[1.0],
                     metas=[(L.shape(y), m[1])])
        d = L.op("mul", [y, one_m], metas=[(L.shape(y), m[1])])
    else:
        yy = L.op("mul", [y, y], metas=[(L.shape(y), m[1])])
        ny = L.op("neg", [yy], metas=[(L.shape(y), m[1])])
        d = L.op("add_scalar", [ny], floats=[1.0],
                 metas=[(L.shape(y), m[1])])
    return L.op("mul", [g, d], metas=[m])


def _reduce_dims(node):
    nd = len(_shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(nd - 1, -1, -1))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({_norm_dim(d, nd) for d in dims}, reverse=True)


def _keepdim(node):
    if len(node.args) > 2:
        return bool(node.args[2])
    return bool(node.kwargs.get("keepdim", False))


INTS = (torch.int32, torch.int64, torch.bool)


def _reduce_check(node):
    """Float reductions; sum, amax and amin (and max, min) also of integers
    and bools, exact (sums wrap in the output dtype, as torch's)."""
    out = _val(node)
    out = out[0] if isinstance(out, (tuple, list)) else out
    ints_ok = node.target not in (aten.mean.dim, aten.mean.default,
                                  aten._softmax.default,
                                  aten._log_softmax.default,
                                  aten._safe_softmax.default)
    if out.dtype not in FLOATS and not (ints_ok and out.dtype in INTS
                                        and _val(node.args[0]).dtype in INTS):
        return "integer reduction"
    if len(_shape(node.args[0])) == 0 and node.target in (
            aten._softmax.default, aten._log_softmax.default,
            aten._safe_softmax.default):
        return "reduction of a scalar"
    return None


def _flip_order(L, v, dt, rank):
    """An order-reversing map of v, its own inverse and exact: -v for
    floats (NaN stays NaN), -1 - v (~v) for integers, which never
    overflows; bools (0/1) go through int32.  min(v) = f(max(f(v)))."""
    if dt in FLOATS:
        return L.op("neg", [v], metas=[(L.shape(v), dt)])
    return L.op("sub", [_const(L, -1, dt, rank), v],
                metas=[(L.shape(v), dt)])


_MIN_OF = {aten.amin.default: aten.amax.default,
           aten.min.default: aten.max.default}


@rule(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default,
      aten.amin.default, check=_reduce_check)
def _reduce(L, node):
    target = _MIN_OF.get(node.target, node.target)
    name = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean",
            aten.amax.default: "amax"}[target]
    m = _out_meta(node)
    work = torch.int32 if m[1] == torch.bool else m[1]
    v = _pointwise_in(L, node, node.args[0], work)
    rank = len(L.shape(v))
    if rank == 0:  # a scalar reduces to itself
        return L.cast(v, m[1])
    if target is not node.target:
        v = _flip_order(L, v, work, rank)
    v = _reduce_each(L, name, v, _reduce_dims(node), _keepdim(node), work)
    if target is not node.target:
        v = _flip_order(L, v, work, len(L.shape(v)))
    return L.cast(v, m[1])


# ---- layer norm --------------------------------------------------------------


def _layer_norm_check(node):
    x = _val(node.args[0] if node.target == aten.native_layer_norm.default
             else node.args[1])
    return None if x.dtype in FLOATS else "integer input"


def _ln_acc(dt):
    """The dtype a layer norm computes in: f32 for bf16 (torch's
    accumulate type), else dt itself."""
    return torch.float32 if dt == torch.bfloat16 else dt


def _reduce_each(L, name, v, dims, keep, dt):
    """name (sum, mean or amax) of v over dims, one at a time (dims
    descending, so each index stays valid)."""
    shape = list(L.shape(v))
    for d in dims:
        if keep:
            shape[d] = 1
        else:
            del shape[d]
        v = L.op(name, [v], [d, int(keep)], metas=[(list(shape), dt)])
    return v


def _ln_dims(x_rank, normalized):
    """The normalized dims of a layer norm, descending: the last
    len(normalized) of x's."""
    return list(range(x_rank - 1, x_rank - 1 - len(normalized), -1))


@rule(aten.native_layer_norm.default, check=_layer_norm_check)
def _layer_norm(L, node):
    """(y, mean, rstd): mean and the biased variance over the normalized
    dims in the accumulate type, rstd = rsqrt(var + eps), y = (x - mean)
    rstd w + b."""
    x, normalized, w, b, eps = node.args[:5]
    outs = _val(node)
    acc = _ln_acc(_val(x).dtype)
    xv = L.cast(L.arg(x), acc)
    shape = list(L.shape(xv))
    dims = _ln_dims(len(shape), normalized)
    mu = _reduce_each(L, "mean", xv, dims, True, acc)
    ms = L.shape(mu)  # shape with the normalized dims 1
    xc = L.op("sub", [xv, mu], metas=[(shape, acc)])
    sq = L.op("mul", [xc, xc], metas=[(shape, acc)])
    var = _reduce_each(L, "mean", sq, dims, True, acc)
    rstd = L.op("rsqrt", [L.op("add_scalar", [var], floats=[float(eps)],
                                metas=[(ms, acc)])], metas=[(ms, acc)])
    y = L.op("mul", [xc, rstd], metas=[(shape, acc)])
    if w is not None:
        y = L.op("mul", [y, L.cast(L.arg(w), acc)], metas=[(shape, acc)])
    if b is not None:
        y = L.op("add", [y, L.cast(L.arg(b), acc)], metas=[(shape, acc)])
    return (L.cast(y, outs[0].dtype), L.cast(mu, outs[1].dtype),
            L.cast(rstd, outs[2].dtype))


@rule(aten.native_layer_norm_backward.default, check=_layer_norm_check)
def _layer_norm_backward(L, node):
    """With xhat = (x - mean) rstd and gw = g w: dx = rstd (gw - mean(gw) -
    xhat mean(gw xhat)) over the normalized dims; dw = the sum of g xhat
    and db the sum of g over the other dims."""
    go, x, normalized, mean, rstd, w, b, mask = node.args[:8]
    outs = _val(node)
    acc = _ln_acc(_val(x).dtype)
    g = L.cast(L.arg(go), acc)
    xv = L.cast(L.arg(x), acc)
    shape = list(L.shape(xv))
    dims = _ln_dims(len(shape), normalized)
    lead = list(range(len(shape) - len(normalized) - 1, -1, -1))
    m = lambda: [(shape, acc)]  # noqa: E731
    xc = L.op("sub", [xv, L.cast(L.arg(mean), acc)], metas=m())
    rs = L.cast(L.arg(rstd), acc)
    xhat = L.op("mul", [xc, rs], metas=m())
    res = [None, None, None]
    if mask[0]:
        gw = g if w is None else L.op("mul", [g, L.cast(L.arg(w), acc)],
                                      metas=m())
        m1 = _reduce_each(L, "mean", gw, dims, True, acc)
        m2 = _reduce_each(L, "mean", L.op("mul", [gw, xhat], metas=m()),
                          dims, True, acc)
        d = L.op("sub", [L.op("sub", [gw, m1], metas=m()),
                         L.op("mul", [xhat, m2], metas=m())], metas=m())
        res[0] = L.cast(L.op("mul", [d, rs], metas=m()), outs[0].dtype)
    if mask[1] and w is not None:
        gx = L.op("mul", [g, xhat], metas=m())
        res[1] = L.cast(_reduce_each(L, "sum", gx, lead, False, acc),
                        outs[1].dtype)
    if mask[2] and b is not None:
        res[2] = L.cast(_reduce_each(L, "sum", g, lead, False, acc),
                        outs[2].dtype)
    return tuple(res)


@rule(aten.max.default, aten.min.default, check=_reduce_check)
def _max_all(L, node):
    """The max (min) of every element, a 0-dim tensor: amax over each dim
    in turn (NaN wins, as torch's)."""
    m = _out_meta(node)
    work = torch.int32 if m[1] == torch.bool else m[1]
    v = L.cast(L.arg(node.args[0]), work)
    shape = list(L.shape(v))
    flip = node.target == aten.min.default
    if flip:
        v = _flip_order(L, v, work, len(shape))
    for d in range(len(shape) - 1, -1, -1):
        del shape[d]
        v = L.op("amax", [v], [d, 0], metas=[(list(shape), work)])
    if flip:
        v = _flip_order(L, v, work, 0)
    return L.cast(v, m[1])


def _any_check(node):
    if _val(node.args[0]).dtype not in FLOATS + INTS:
        return "any of %s" % str(_val(node.args[0]).dtype).replace(
            "torch.", "")
    return None


@rule(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default,
      aten.all.dim, aten.all.dims, check=_any_check)
def _any_all(L, node):
    """any: the amax of bool(x) (1 - (x == 0): NaN is true) over the dims;
    all: 1 - any(not bool(x))."""
    m = _out_meta(node)
    x = L.arg(node.args[0])
    shape = list(L.shape(x))
    b = _nonzero(L, x, (shape, torch.bool))
    is_all = node.target in (aten.all.default, aten.all.dim, aten.all.dims)
    one = _const(L, 1, torch.bool, len(shape))
    if is_all:
        b = L.op("sub", [one, b], metas=[(shape, torch.bool)])
    if node.target in (aten.any.default, aten.all.default):
        dims, keep = list(range(len(shape) - 1, -1, -1)), False
    else:
        d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        d = [d] if isinstance(d, int) else list(d or range(len(shape)))
        dims = sorted({_norm_dim(k, len(shape)) for k in d}, reverse=True)
        keep = _keepdim(node)
    for d in dims:
        if keep:
            shape[d] = 1
        else:
            del shape[d]
        b = L.op("amax", [b], [d, int(keep)], metas=[(list(shape), torch.bool)])
    if is_all:
        b = L.op("sub", [_const(L, 1, torch.bool, len(shape)), b],
                 metas=[(list(shape), torch.bool)])
    return L.cast(b, m[1])


def _max_dim_check(node):
    x = _val(node.args[0])
    if x.dtype not in FLOATS + INTS:
        return "max of %s" % str(x.dtype).replace("torch.", "")
    if x.ndim == 0:
        return "reduction of a scalar"
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if d is not None and x.shape[_norm_dim(d, x.ndim)] == 0:
        return "reduction of an empty dim"
    return None


@rule(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default,
      check=_max_dim_check)
def _max_dim(L, node):
    """Values and i64 indices of the max (min) along a dim: the max op,
    whose index is the first occurrence (the first NaN's when there is
    one), as torch's on the CPU; argmax/argmin without a dim flatten
    first."""
    x = _val(node.args[0])
    arg = node.target in (aten.argmax.default, aten.argmin.default)
    flip = node.target in (aten.min.dim, aten.argmin.default)
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keep = (bool(node.args[2]) if len(node.args) > 2
            else bool(node.kwargs.get("keepdim", False)))
    dt = x.dtype
    work = torch.int32 if dt == torch.bool else dt
    v = L.cast(L.arg(node.args[0]), work)
    shape = list(x.shape)
    if d is None:  # argmax of the flattened tensor
        n = x.numel()
        v = L.op("reshape", [v], [n], metas=[([n], work)])
        shape, d = [n], 0
    d = _norm_dim(d, len(shape))
    if flip:
        v = _flip_order(L, v, work, len(shape))
    out = list(shape)
    if keep:
        out[d] = 1
    else:
        del out[d]
    val, idx = L.op("max", [v], [d, int(keep)], n_out=2,
                    metas=[(list(out), work), (list(out), torch.int64)])
    if arg:
        if keep and len(x.shape) != len(out):  # flattened, keepdim
            ones = [1] * x.ndim
            idx = L.op("reshape", [idx], ones, metas=[(ones, torch.int64)])
        return idx
    if flip:
        val = _flip_order(L, val, work, len(out))
    return L.cast(val, dt), idx


@rule(aten.sum.default, check=_reduce_check)
def _sum_all(L, node):
    m = _out_meta(node)
    v = _pointwise_in(L, node, node.args[0], m[1])
    if len(L.shape(v)) == 0:
        return v
    return L.op("sum_all", [v], metas=[m])


@rule(aten.mean.default, check=_reduce_check)
def _mean_all(L, node):
    """The mean of every element: the mean op over the flattened tensor
    (summed in double, divided once)."""
    m = _out_meta(node)
    v = _pointwise_in(L, node, node.args[0], m[1])
    if len(L.shape(v)) == 0:
        return v
    n = _val(node.args[0]).numel()
    v = L.op("reshape", [v], [n], metas=[([n], m[1])])
    return L.op("mean", [v], [0, 0], metas=[m])


def _softmax_check(node):
    if len(node.args) > 2 and node.args[2]:
        return "half_to_float"
    return _reduce_check(node)


@rule(aten._softmax.default, aten._log_softmax.default,
      check=_softmax_check)
def _softmax(L, node):
    m = _out_meta(node)
    v = L.arg(node.args[0])
    d = _norm_dim(node.args[1], len(L.shape(v)))
    name = ("softmax" if node.target == aten._softmax.default
            else "log_softmax")
    return L.op(name, [v], [d], metas=[m])


def _safe_softmax_check(node):
    dt = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
    if dt is not None and dt not in FLOATS:
        return "softmax to %s" % str(dt).replace("torch.", "")
    return _reduce_check(node)


@rule(aten._safe_softmax.default, check=_safe_softmax_check)
def _safe_softmax(L, node):
    """softmax (of x in the output's dtype) with 0 in the rows whose
    elements are all -inf (torch's sdpa math path: a query no key may
    attend gets zeros, not nan); the row test is amax(x) == -inf, the
    zeros picked in exactly."""
    m = _out_meta(node)
    v = L.cast(L.arg(node.args[0]), m[1])
    shape = list(L.shape(v))
    d = _norm_dim(node.args[1], len(shape))
    s = L.op("softmax", [v], [d], metas=[m])
    red = list(shape)
    red[d] = 1
    top = L.op("amax", [v], [d, 1], metas=[(red, m[1])])
    ninf = L.op("full", [], [DTYPES[m[1]]] + red, [float("-inf")],
                metas=[(red, m[1])])
    gone = L.op("eq", [top, ninf], metas=[(red, m[1])])
    return _pick(L, gone, _const(L, 0.0, m[1], len(shape)), s, shape, m[1])


@rule(aten._softmax_backward_data.default,
      aten._log_softmax_backward_data.default)
def _softmax_backward(L, node):
    m = _out_meta(node)
    g = _pointwise_in(L, node, node.args[0], m[1])
    y = _pointwise_in(L, node, node.args[1], m[1])
    shape = L.shape(g)
    d = _norm_dim(node.args[2], len(shape))
    red = list(shape)
    red[d] = 1
    full = (list(shape), m[1])
    if node.target == aten._softmax_backward_data.default:
        gy = L.op("mul", [g, y], metas=[full])
        s = L.op("sum", [gy], [d, 1], metas=[(red, m[1])])
        diff = L.op("sub", [g, s], metas=[full])
        return L.op("mul", [y, diff], metas=[m])
    s = L.op("sum", [g], [d, 1], metas=[(red, m[1])])
    e = L.op("exp", [y], metas=[full])
    es = L.op("mul", [e, s], metas=[full])
    return L.op("sub", [g, es], metas=[m])


# ---- linear algebra ------------------------------------------------------


@rule(aten.mm.default, aten.bmm.default)
def _mm(L, node):
    m = _out_meta(node)
    a = _pointwise_in(L, node, node.args[0], m[1])
    b = _pointwise_in(L, node, node.args[1], m[1])
    return L.op("matmul", [a, b], metas=[m])


def _addmm_check(node):
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return "addmm with beta or alpha"
    return None


@rule(aten.addmm.default, check=_addmm_check)
def _addmm(L, node):
    m = _out_meta(node)
    bias = _pointwise_in(L, node, node.args[0], m[1])
    a = _pointwise_in(L, node, node.args[1], m[1])
    b = _pointwise_in(L, node, node.args[2], m[1])
    p = L.op("matmul", [a, b], metas=[m])
    return L.op("add", [p, bias], metas=[m])


# ---- shape and movement -----------------------------------------------------


@rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
      aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
      aten.squeeze.default)
def _reshape(L, node):
    m = _out_meta(node)
    v = L.arg(node.args[0])
    if L.shape(v) == m[0]:
        return v
    return L.op("reshape", [v], m[0], metas=[m])


@rule(aten.permute.default)
def _permute(L, node):
    m = _out_meta(node)
    v = L.arg(node.args[0])
    nd = len(L.shape(v))
    perm = [_norm_dim(d, nd) for d in node.args[1]]
    if perm == list(range(nd)):
        return v
    return L.op("permute", [v], perm, metas=[m])


@rule(aten.transpose.int, aten.t.default)
def _transpose(L, node):
    m = _out_meta(node)
    v = L.arg(node.args[0])
    nd = len(L.shape(v))
    if node.target == aten.t.default:
        if nd < 2:
            return v
        d0, d1 = 0, 1
    else:
        d0 = _norm_dim(node.args[1], nd)
        d1 = _norm_dim(node.args[2], nd)
    if d0 == d1:
        return v
    return L.op("transpose", [v], [d0, d1], metas=[m])


@rule(aten.expand.default)
def _expand(L, node):
    m = _out_meta(node)
    v = L.arg(node.args[0])
    if L.shape(v) == m[0]:
        return v
    return L.op("expand", [v], m[0], metas=[m])


def _clone_check(node):
    mf = node.kwargs.get("memory_format")
    if mf not in (None, torch.contiguous_format, torch.preserve_format):
        return "memory_format %s" % mf
    return None


@rule(aten.clone.default, check=_clone_check)
def _clone(L, node):
    return L.op("contiguous", [L.arg(node.args[0])], metas=[_out_meta(node)])


@rule(aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default)
def _alias(L, node):
    return L.arg(node.args[0])


def _slice_args(node, size):
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return dim, start, end, step


def _slice_check(node):
    step = node.args[4] if len(node.args) > 4 else 1
    return None if isinstance(step, int) and step >= 1 else "slice step"


@rule(aten.slice.Tensor, check=_slice_check)
def _slice(L, node):
    m = _out_meta(node)
    v = L.arg(node.args[0])
    shape = L.shape(v)
    d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
    _, start, end, step = _slice_args(node, shape[d])
    if start == 0 and end == shape[d] and step == 1:
        return v
    return L.op("slice", [v], [d, start, end, step], metas=[m])


@rule(aten.slice_backward.default)
def _slice_backward(L, node):
    m = _out_meta(node)
    g = L.arg(node.args[0])
    in_shape = list(node.args[1])
    d = _norm_dim(node.args[2], len(in_shape))
    size = in_shape[d]
    start, end, step = node.args[3], node.args[4], node.args[5]
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return L.op("slice_backward", [g], [d, start, end, step] + in_shape,
                metas=[m])


def _cat_check(node):
    xs = [x for x in node.args[0]
          if not (_val(x).ndim == 1 and _val(x).shape[0] == 0)]
    if len(xs) > 60:
        return "cat of %d tensors" % len(xs)
    return None if xs else "cat of empty tensors"


@rule(aten.cat.default, check=_cat_check)
def _cat(L, node):
    m = _out_meta(node)
    # torch.cat skips legacy empty 1-D tensors
    xs = [x for x in node.args[0]
          if not (_val(x).ndim == 1 and _val(x).shape[0] == 0)]
    if len(xs) == 1 and _shape(xs[0]) == m[0]:
        return L.cast(L.arg(xs[0]), m[1])
    ins = [_pointwise_in(L, node, x, m[1]) for x in xs]
    d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(m[0]))
    return L.op("cat", ins, [d], metas=[m])


@rule(aten.stack.default, check=_cat_check)
def _stack(L, node):
    """A cat of the tensors, each with a dim of 1 inserted at dim."""
    m = _out_meta(node)
    d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(m[0]))
    ins = []
    for x in node.args[0]:
        v = _pointwise_in(L, node, x, m[1])
        s = list(L.shape(v))
        s.insert(d, 1)
        ins.append(L.op("reshape", [v], s, metas=[(s, m[1])]))
    if len(ins) == 1:
        return ins[0]
    return L.op("cat", ins, [d], metas=[m])


def _to_copy_check(node):
    if node.kwargs.get("memory_format") not in (None, torch.preserve_format,
                                                torch.contiguous_format):
        return "memory_format"
    return None


def _to_bool_check(src, dst):
    """A value becomes bool only from bool (a cast of the 0/1 int32 that
    stands for bool would truncate, not test for nonzero)."""
    if dst.dtype == torch.bool and src.dtype != torch.bool:
        return "cast to bool"
    return None


@rule(aten._to_copy.default, check=_to_copy_check)
def _to_copy(L, node):
    m = _out_meta(node)
    v = L.arg(node.args[0])
    if L.dtype(v) == m[1]:
        return L.op("contiguous", [v], metas=[m])
    if m[1] == torch.bool:  # a test for nonzero, not a truncation
        return _nonzero(L, v, m)
    return L.op("cast", [v], [DTYPES[m[1]]], metas=[m])


# ---- indexing ----------------------------------------------------------------


@rule(aten.embedding.default)
def _embedding(L, node):
    """The lookup; padding_idx and scale_grad_by_freq change only the
    backward."""
    return L.op("embedding", [L.arg(node.args[0]), L.arg(node.args[1])],
                metas=[_out_meta(node)])


def _embedding_bw_check(node):
    scale = node.args[4] if len(node.args) > 4 else False
    return "scale_grad_by_freq" if scale else None


@rule(aten.embedding_dense_backward.default, check=_embedding_bw_check)
def _embedding_backward(L, node):
    """The rows' gradients summed per index; with padding_idx p, the rows
    whose index is p add nothing (their gradient selected to zero, so an
    Inf or NaN there stays out, as torch's)."""
    g = L.arg(node.args[0])
    ids = L.arg(node.args[1])
    pad = node.args[3] if len(node.args) > 3 else -1
    if pad >= 0:
        i64 = torch.int64
        iv = L.cast(ids, i64)
        hit = L.op("eq", [iv, _int_full(L, iv, pad)],
                   metas=[(list(L.shape(iv)), i64)])
        hs = list(L.shape(iv)) + [1]
        hit = L.op("reshape", [hit], hs, metas=[(hs, i64)])
        gs, gdt = list(L.shape(g)), L.dtype(g)
        g = _pick(L, hit, _const(L, 0.0, gdt, len(gs)), g, gs, gdt)
    return L.op("embedding_backward", [g, ids], [int(node.args[2])],
                metas=[_out_meta(node)])


# ---- scans and reversals --------------------------------------------------------


def _iota(L, n, dtype):
    """[0, 1, ..., n-1] in dtype, doubled by cats (no op makes a range)."""
    m = lambda k: ([k], dtype)  # noqa: E731
    v = L.op("full", [], [DTYPES[dtype], 1], [0.0], metas=[m(1)])
    k = 1
    while k < n:
        j = min(k, n - k)
        head = v if j == k else L.op("slice", [v], [0, 0, j, 1],
                                     metas=[m(j)])
        off = L.op("full", [], [DTYPES[dtype], j], [float(k)], metas=[m(j)])
        v = L.op("cat", [v, L.op("add", [head, off], metas=[m(j)])], [0],
                 metas=[m(k + j)])
        k += j
    return v


def _cumsum_check(node):
    x = _val(node.args[0])
    if x.ndim == 0:
        return "cumsum of a scalar"
    out = _val(node).dtype
    if x.dtype in FLOATS and out == x.dtype:
        return None
    # an integer or bool scan (transformers' packed-sequence test on
    # position ids and masks), exact in the integer output dtype
    ints = (torch.int32, torch.int64, torch.bool)
    if x.dtype in ints and out in (torch.int32, torch.int64):
        return None
    return "cumsum to %s" % str(out).replace("torch.", "")


@rule(aten.cumsum.default, check=_cumsum_check)
def _cumsum(L, node):
    """An inclusive scan by doubling shifts (Hillis-Steele): y += y shifted
    by s along the dim with zeros in front, s = 1, 2, 4, ...; bf16 is summed
    in f32 and rounded once, integers and bools in the integer output
    dtype (exact)."""
    m = _out_meta(node)
    work = torch.float32 if m[1] == torch.bfloat16 else m[1]
    y = L.cast(L.arg(node.args[0]), work)
    shape = list(L.shape(y))
    d = _norm_dim(node.args[1], len(shape))
    n, s = shape[d], 1
    while s < n:
        zs, keep = list(shape), list(shape)
        zs[d], keep[d] = s, n - s
        z = L.op("full", [], [DTYPES[work]] + zs, [0.0], metas=[(zs, work)])
        head = L.op("slice", [y], [d, 0, n - s, 1], metas=[(keep, work)])
        sh = L.op("cat", [z, head], [d], metas=[(shape, work)])
        y = L.op("add", [y, sh], metas=[(shape, work)])
        s *= 2
    return L.cast(y, m[1])


def _flip_check(node):
    if _val(node.args[0]).ndim == 0:
        return "flip of a scalar"
    return None


@rule(aten.flip.default, check=_flip_check)
def _flip(L, node):
    """A gather along each flipped dim with the index n-1, ..., 0 (an i64
    range, broadcast to the tensor's shape)."""
    m = _out_meta(node)
    v = L.arg(node.args[0])
    shape = list(L.shape(v))
    for d in sorted({_norm_dim(d, len(shape)) for d in node.args[1]}):
        n = shape[d]
        if n <= 1:
            continue
        io = _iota(L, n, torch.int64)
        last = L.op("full", [], [DTYPES[torch.int64], n], [float(n - 1)],
                    metas=[([n], torch.int64)])
        rev = L.op("sub", [last, io], metas=[([n], torch.int64)])
        one = [1] * len(shape)
        one[d] = n
        rev = L.op("reshape", [rev], one, metas=[(one, torch.int64)])
        rev = L.op("expand", [rev], shape, metas=[(shape, torch.int64)])
        v = L.op("gather", [v, rev], [d], metas=[(shape, m[1])])
    return v


def _tri_check(node):
    if _val(node.args[0]).ndim < 2:
        return "tril of rank %d" % _val(node.args[0]).ndim
    return None


@rule(aten.tril.default, aten.triu.default, check=_tri_check)
def _tri(L, node):
    """tril / triu of the last two dims: zero where d >= 0, d = j - i - k -
    1 (tril) or i - j + k - 1 (triu), found as max(d, 0) == d; a select
    (_pick, exact for any value, Inf and NaN included) that fuses."""
    m = _out_meta(node)
    v = L.arg(node.args[0])
    shape = list(L.shape(v))
    r, c = shape[-2], shape[-1]
    k = node.args[1] if len(node.args) > 1 else node.kwargs.get(
        "diagonal", 0)
    f = torch.float32
    ri = L.op("reshape", [_iota(L, r, f)], [r, 1], metas=[([r, 1], f)])
    ci = L.op("reshape", [_iota(L, c, f)], [1, c], metas=[([1, c], f)])
    if node.target == aten.tril.default:
        d = L.op("sub", [ci, ri], metas=[([r, c], f)])
        off = -(k + 1)
    else:
        d = L.op("sub", [ri, ci], metas=[([r, c], f)])
        off = k - 1
    if off:
        d = L.op("add_scalar", [d], floats=[float(off)], metas=[([r, c], f)])
    gone = L.op("eq", [_max0(L, d, f), d], metas=[([r, c], f)])
    return _pick(L, gone, _const(L, 0.0, m[1], len(shape)), v, shape, m[1])


# ---- depthwise convolution -------------------------------------------------------


def _conv_check(node):
    bw = node.target == aten.convolution_backward.default
    x, w = _val(node.args[1 if bw else 0]), _val(node.args[2 if bw else 1])
    stride, pad, dil, trans, _, groups = node.args[4 if bw else 3:
                                                   10 if bw else 9]
    if x.ndim != 3 or w.ndim != 3:
        return "convolution of rank %d" % x.ndim
    c = x.shape[1]
    if groups != c or w.shape[0] != c or w.shape[1] != 1 or trans:
        return "convolution not depthwise"
    if list(stride) != [1] or list(dil) != [1]:
        return "convolution stride or dilation"
    if x.dtype not in FLOATS:
        return "integer convolution"
    return None


def _conv_taps(L, x, w, pad, dt):
    """(xp, taps, tout): x zero-padded on the time dim, the weight's taps
    w[:, 0, k] as [C, 1], the output length."""
    b, c, t = L.shape(x)
    k = L.shape(w)[2]
    tp = t + 2 * pad
    xp = x
    if pad:
        xp = L.op("slice_backward", [x], [2, pad, pad + t, 1, b, c, tp],
                  metas=[([b, c, tp], dt)])
    taps = []
    for j in range(k):
        wj = L.op("slice", [w], [2, j, j + 1, 1], metas=[([c, 1, 1], dt)])
        taps.append(L.op("reshape", [wj], [c, 1], metas=[([c, 1], dt)]))
    return xp, taps, tp - k + 1


@rule(aten.convolution.default, check=_conv_check)
def _conv(L, node):
    """A depthwise 1-D convolution (Gated DeltaNet's short causal conv):
    the sum over the taps k of x padded, shifted by k, times w[:, 0, k]."""
    m = _out_meta(node)
    dt = m[1]
    x = L.cast(L.arg(node.args[0]), dt)
    w = L.cast(L.arg(node.args[1]), dt)
    pad = list(node.args[4])[0]
    b, c, _ = L.shape(x)
    xp, taps, tout = _conv_taps(L, x, w, pad, dt)
    acc = None
    for j, wj in enumerate(taps):
        xs = L.op("slice", [xp], [2, j, j + tout, 1], metas=[(m[0], dt)])
        term = L.op("mul", [xs, wj], metas=[m])
        acc = term if acc is None else L.op("add", [acc, term], metas=[m])
    if node.args[2] is not None:
        bias = L.op("reshape", [L.cast(L.arg(node.args[2]), dt)], [c, 1],
                    metas=[([c, 1], dt)])
        acc = L.op("add", [acc, bias], metas=[m])
    return acc


@rule(aten.convolution_backward.default, check=_conv_check)
def _conv_backward(L, node):
    """The depthwise convolution's gradients: the input's, the sum over k
    of g w_k placed at k (slice_backward), cropped; the weight's, the sum
    over batch and time of g times x padded and shifted by k; the bias's,
    the sum of g."""
    outs = _val(node)
    mask = node.args[10]
    dt = _val(node.args[0]).dtype
    g = L.arg(node.args[0])
    x = L.cast(L.arg(node.args[1]), dt)
    w = L.cast(L.arg(node.args[2]), dt)
    pad = list(node.args[5])[0]
    b, c, t = L.shape(x)
    k = L.shape(w)[2]
    xp, taps, tout = _conv_taps(L, x, w, pad, dt)
    tp = t + 2 * pad
    res = [None, None, None]
    if mask[0]:
        acc = None
        for j, wj in enumerate(taps):
            gw = L.op("mul", [g, wj], metas=[([b, c, tout], dt)])
            part = L.op("slice_backward", [gw], [2, j, j + tout, 1, b, c, tp],
                        metas=[([b, c, tp], dt)])
            acc = part if acc is None else L.op("add", [acc, part],
                                                metas=[([b, c, tp], dt)])
        if pad:
            acc = L.op("slice", [acc], [2, pad, pad + t, 1],
                       metas=[([b, c, t], dt)])
        res[0] = L.cast(acc, outs[0].dtype)
    if mask[1]:
        cols = []
        for j in range(k):
            xs = L.op("slice", [xp], [2, j, j + tout, 1],
                      metas=[([b, c, tout], dt)])
            p = L.op("mul", [g, xs], metas=[([b, c, tout], dt)])
            p = L.op("sum", [p], [2, 1], metas=[([b, c, 1], dt)])
            cols.append(L.op("sum", [p], [0, 0], metas=[([c, 1], dt)]))
        gw = cols[0] if k == 1 else L.op("cat", cols, [1],
                                         metas=[([c, k], dt)])
        gw = L.op("reshape", [gw], [c, 1, k], metas=[([c, 1, k], dt)])
        res[1] = L.cast(gw, outs[1].dtype)
    if mask[2]:
        s = L.op("sum", [g], [2, 0], metas=[([b, c], dt)])
        res[2] = L.cast(L.op("sum", [s], [0, 0], metas=[([c], dt)]),
                        outs[2].dtype)
    return tuple(res)


# ---- losses --------------------------------------------------------------------


def _nll_check(node):
    x, t = _val(node.args[1 if _is_bw(node) else 0]), _val(
        node.args[2 if _is_bw(node) else 1])
    w = node.args[3 if _is_bw(node) else 2]
    if w is not None:
        return "class weights"
    if x.ndim != 2 or t.ndim != 1:
        return "nll_loss of rank %d" % x.ndim
    if t.dtype not in (torch.int64, torch.int32):
        return "target dtype %s" % str(t.dtype).replace("torch.", "")
    if x.dtype not in FLOATS:
        return "integer input"
    if _nll_reduction(node) not in (0, 1, 2):
        return "reduction %s" % _nll_reduction(node)
    return None


def _is_bw(node):
    return node.target == aten.nll_loss_backward.default


def _nll_reduction(node):
    return node.args[4 if _is_bw(node) else 3]


def _nll_valid(L, t, ignore_index, dt):
    """(safe target [N, 1], weight [N] in dt): the weight 1 where the target
    is not ignore_index, else 0; the ignored targets read class 0."""
    n = L.shape(t)[0]
    it = L.dtype(t)
    m_i = ([n], it)
    ign = L.op("full", [], [DTYPES[it], n], [float(ignore_index)],
               metas=[m_i])
    one = L.op("full", [], [DTYPES[it], n], [1.0], metas=[m_i])
    hit = L.op("eq", [t, ign], metas=[m_i])
    valid = L.op("sub", [one, hit], metas=[m_i])
    safe = L.op("mul", [t, valid], metas=[m_i])
    safe = L.op("reshape", [safe], [n, 1], metas=[([n, 1], it)])
    return safe, L.op("cast", [valid], [DTYPES[dt]], metas=[([n], dt)])


@rule(aten.nll_loss_forward.default, check=_nll_check)
def _nll_loss(L, node):
    """-x[i, t_i] where t_i is not ignored; mean divides by the count of
    those (total_weight), which is the second output."""
    outs = _val(node)
    dt = outs[0].dtype
    x = L.cast(L.arg(node.args[0]), dt)
    t = L.arg(node.args[1])
    n = L.shape(x)[0]
    safe, w = _nll_valid(L, t, node.args[4], dt)
    picked = L.op("gather", [x, safe], [1], metas=[([n, 1], dt)])
    picked = L.op("reshape", [picked], [n], metas=[([n], dt)])
    pw = L.op("mul", [picked, w], metas=[([n], dt)])
    loss = L.op("neg", [pw], metas=[([n], dt)])
    tw_m = (list(outs[1].shape), outs[1].dtype)
    red = node.args[3]
    if red == 0:
        tw = L.op("full", [], [DTYPES[tw_m[1]]] + tw_m[0], [0.0],
                  metas=[tw_m])
        return loss, tw
    tw = L.cast(L.op("sum_all", [w], metas=[([], dt)]), tw_m[1])
    if tw_m[0] != []:
        tw = L.op("reshape", [tw], tw_m[0], metas=[tw_m])
    total = L.op("sum_all", [loss], metas=[([], dt)])
    if red == 1:
        twd = L.cast(tw, dt)
        if L.shape(twd) != []:
            twd = L.op("reshape", [twd], [], metas=[([], dt)])
        total = L.op("div", [total, twd], metas=[([], dt)])
    m0 = (list(outs[0].shape), dt)
    if m0[0] != []:
        total = L.op("reshape", [total], m0[0], metas=[m0])
    return total, tw


@rule(aten.nll_loss_backward.default, check=_nll_check)
def _nll_loss_backward(L, node):
    """Zeros with -grad (/ total_weight for mean) at [i, t_i] where t_i is
    not ignored: a scatter_add of one column."""
    m = _out_meta(node)
    dt = m[1]
    g = L.cast(L.arg(node.args[0]), dt)
    t = L.arg(node.args[2])
    n, c = m[0]
    safe, w = _nll_valid(L, t, node.args[5], dt)
    src = L.op("neg", [w], metas=[([n], dt)])
    if node.args[4] == 1:
        tw = L.cast(L.arg(node.args[6]), dt)
        if L.shape(tw) != []:
            tw = L.op("reshape", [tw], [], metas=[([], dt)])
        # every target ignored: total_weight is 0 and torch writes no
        # gradient (every w is 0); dividing by 1 there keeps 0 / 0 out
        zero = L.op("full", [], [DTYPES[dt]], [0.0], metas=[([], dt)])
        none = L.op("eq", [tw, zero], metas=[([], dt)])
        tw = L.op("add", [tw, none], metas=[([], dt)])
        src = L.op("div", [src, tw], metas=[([n], dt)])
    if L.shape(g) not in ([], [n]):
        g = L.op("reshape", [g], [n] if node.args[4] == 0 else [],
                 metas=[([n] if node.args[4] == 0 else [], dt)])
    src = L.op("mul", [src, g], metas=[([n], dt)])
    src = L.op("reshape", [src], [n, 1], metas=[([n, 1], dt)])
    zeros = L.op("full", [], [DTYPES[dt], n, c], [0.0], metas=[m])
    return L.op("scatter_add", [zeros, safe, src], [1], metas=[m])


def _scatter_check(node):
    x, idx = _val(node.args[0]), _val(node.args[2])
    if x.ndim == 0:
        return "scatter into a scalar"
    if x.dtype not in FLOATS + (torch.int32, torch.int64):
        return "scatter of %s" % str(x.dtype).replace("torch.", "")
    if idx.shape[_norm_dim(node.args[1], x.ndim)] != 1:
        return "scatter with repeated positions"
    if node.kwargs.get("reduce") is not None:
        return "scatter reduce"
    return None


@rule(aten.scatter.src, check=_scatter_check)
def _scatter(L, node):
    """x with src written at index along dim, where index has one position
    per slice (index.shape[dim] == 1, as in the backward of max.dim and
    min.dim), so no position is written twice: the written mask and the
    values are scatter_adds into zeros, the values picked in exactly."""
    m = _out_meta(node)
    shape, dt = list(m[0]), m[1]
    x = L.cast(L.arg(node.args[0]), dt)
    d = _norm_dim(node.args[1], len(shape))
    idx = L.arg(node.args[2])
    ish = list(L.shape(idx))
    src = L.cast(L.arg(node.args[3]), dt)
    for k, n in enumerate(ish):
        if L.shape(src)[k] != n:
            sh = list(L.shape(src))
            sh[k] = n
            src = L.op("slice", [src], [k, 0, n, 1], metas=[(sh, dt)])
    zeros = L.op("full", [], [DTYPES[dt]] + shape, [0.0], metas=[m])
    ones = L.op("full", [], [DTYPES[dt]] + ish, [1.0], metas=[(ish, dt)])
    hit = L.op("scatter_add", [zeros, idx, ones], [d], metas=[m])
    val = L.op("scatter_add", [zeros, idx, src], [d], metas=[m])
    return _pick(L, hit, val, x, shape, dt)


# ---- attention ----------------------------------------------------------------


def _sdpa_is_backward(node):
    return node.target == \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _sdpa_mask(node):
    return node.kwargs.get("attn_mask")


def _sdpa_causal(node):
    bw = _sdpa_is_backward(node)
    k = 7 if bw else 4
    return bool(node.args[k] if len(node.args) > k else node.kwargs.get(
        "is_causal", False))


def _sdpa_check(node):
    bw = _sdpa_is_backward(node)
    k = 6 if bw else 3
    dropout = node.args[k] if len(node.args) > k else node.kwargs.get(
        "dropout_p", 0.0)
    if dropout:
        return "dropout"
    q, kk = _val(node.args[1 if bw else 0]), _val(node.args[2 if bw else 1])
    if q.ndim != 4 or kk.ndim != 4 or q.shape[1] % kk.shape[1]:
        return "sdpa shapes"
    mask = _sdpa_mask(node)
    if mask is None:
        return None
    mv = _val(mask)
    if mv.dtype != torch.bool and mv.dtype not in FLOATS:
        return "attn_mask of dtype %s" % str(mv.dtype).replace("torch.", "")
    full = [q.shape[0], q.shape[1], q.shape[2], kk.shape[2]]
    if mv.ndim > 4 or any(a not in (1, b) for a, b in zip(
            reversed(list(mv.shape)), reversed(full))):
        return "attn_mask of shape %s" % list(mv.shape)
    return None


def _scale(node, default_pos):
    s = node.kwargs.get("scale")
    if s is None and len(node.args) > default_pos:
        s = node.args[default_pos]
    return 0.0 if s is None else float(s)


def _sdpa_extra(L, node, n):
    """(inputs, ints): the node's first n args (q, k, v at 0 in the
    forward, at 1 in the backward) and torch's mask, made 4-D, as the op's
    last input (bool: epjit's i32 0 / 1, which the op reads as keep or
    hide; float: additive, in q's dtype or f32); ints = [causal, flags]:
    1 a mask input follows, 2 causal aligned top-left (torch's alignment
    when T != S)."""
    ins = [L.arg(x) for x in node.args[:n]]
    iq = 1 if _sdpa_is_backward(node) else 0
    q, k = ins[iq], ins[iq + 1]
    causal = _sdpa_causal(node)
    flags = 2 if causal and L.shape(q)[2] != L.shape(k)[2] else 0
    mask = _sdpa_mask(node)
    if mask is not None:
        mv = L.arg(mask)
        shape = [1] * (4 - len(L.shape(mv))) + list(L.shape(mv))
        w = L.dtype(mv)
        if w != torch.bool and w not in (L.dtype(q), torch.float32):
            w = torch.float32
            mv = L.cast(mv, w)
        if L.shape(mv) != shape:
            mv = L.op("reshape", [mv], shape, metas=[(shape, w)])
        ins.append(mv)
        flags |= 1
    return ins, [int(causal), flags]


@rule(aten._scaled_dot_product_flash_attention_for_cpu.default,
      check=_sdpa_check)
def _sdpa(L, node):
    """sdpa, with torch's mask as the op's last input (no [B, H, T, S]
    scores in memory); a row whose keys are all masked gets out 0 and lse
    0, as torch's CPU flash kernel."""
    outs = _val(node)
    ins, ints = _sdpa_extra(L, node, 3)
    return L.op("sdpa", ins, ints, [_scale(node, 99)],
                n_out=2, metas=[(list(o.shape), o.dtype) for o in outs])


@rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
      check=_sdpa_check)
def _sdpa_backward(L, node):
    outs = _val(node)
    ins, ints = _sdpa_extra(L, node, 6)
    return L.op("sdpa_backward", ins, ints, [_scale(node, 99)], n_out=3,
                metas=[(list(o.shape), o.dtype) for o in outs])


def _bshape(*shapes):
    """The numpy broadcast of shapes (they are known to broadcast)."""
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        for i, d in enumerate(s):
            if d != 1:
                out[n - len(s) + i] = d
    return out


def _pick(L, cond, a, b, shape, dt):
    """a where cond (non-zero, any dtype) else b, broadcast to shape: the
    where op, which copies elements (exact for any value, Inf and NaN in
    the branch not taken included).  A bool condition is read through the
    float 0 / 1 it was cast from (L.fbool), else cast to dt (0 / 1 exact),
    so the select fuses with what computes its inputs (the fused kernels
    take float values only)."""
    if cond in L.fbool:
        cond = L.fbool[cond]
    elif L.dtype(cond) not in FLOATS:
        cond = L.cast(cond, dt)
    a, b = L.cast(a, dt), L.cast(b, dt)
    bs = _bshape(L.shape(cond), L.shape(a), L.shape(b))
    out = L.op("where", [cond, a, b], metas=[(bs, dt)])
    return out if bs == list(shape) else _bcast(L, out, list(shape))


def _const(L, value, dt, rank=0):
    one = [1] * rank
    return L.op("full", [], [DTYPES[dt]] + one, [float(value)],
                metas=[(one, dt)])


# ---- attention masks: the ops transformers builds a padding mask with ------


def _scalar_tensor_check(node):
    v = node.args[0]
    return None if isinstance(v, (int, float)) else "fill value"


@rule(aten.scalar_tensor.default, check=_scalar_tensor_check)
def _scalar_tensor(L, node):
    m = _out_meta(node)
    return L.op("full", [], [DTYPES[m[1]]] + m[0], [float(node.args[0])],
                metas=[m])


def _where_check(node):
    c = node.args[0]
    if not _is_tensor_arg(c) or _val(c).dtype != torch.bool:
        return "condition not bool"
    return None


@rule(aten.where.self, check=_where_check)
def _where(L, node):
    """a where the condition holds, else b: _pick (exact for any value)."""
    m = _out_meta(node)
    a, b = (L.arg(x) for x in node.args[1:3])
    return _pick(L, L.arg(node.args[0]), a, b, m[0], m[1])


def _scalar_of(x):
    """The value of a scalar_tensor node, else None."""
    if isinstance(x, torch.fx.Node) and \
            x.target == aten.scalar_tensor.default:
        return float(x.args[0])
    return None


def _nonzero(L, v, m):
    """bool(v): 1 - (v == 0) (NaN is true, -0.0 false, as in torch), in
    v's dtype when it is a float (a select on it fuses)."""
    dt = L.dtype(v)
    z = _const(L, 0.0, dt, len(L.shape(v)))
    if dt in FLOATS:
        sh = list(L.shape(v))
        e = L.op("eq", [v, z], metas=[(sh, dt)])
        r = L.op("add_scalar", [L.op("neg", [e], metas=[(sh, dt)])],
                 floats=[1.0], metas=[(sh, dt)])
        return L.to_bool(r, sh)
    e = L.op("cast", [L.op("eq", [v, z], metas=[(L.shape(v), dt)])],
             [DTYPES[torch.bool]], metas=[m])
    return L.op("sub", [_const(L, 1, torch.bool, len(m[0])), e], metas=[m])


def _index_check(node):
    x, idx = _val(node.args[0]), node.args[1]
    if any(i is None for i in idx) or not 0 < len(idx) <= x.ndim:
        return "index with None"
    for i in idx:
        if _val(i).dtype not in (torch.int64, torch.int32):
            return "index of dtype %s" % str(_val(i).dtype).replace(
                "torch.", "")
    return None


def _wrap_index(L, i, size, shape):
    """i (i64) with size added where negative, broadcast to shape."""
    i64, f64 = torch.int64, torch.float64
    f = L.cast(i, f64)
    ok = L.op("eq", [_max0(L, f, f64), f], metas=[(L.shape(i), f64)])
    add = L.op("add_scalar", [L.op("mul_scalar", [ok], floats=[-size],
                                   metas=[(L.shape(i), f64)])],
               floats=[float(size)], metas=[(L.shape(i), f64)])
    i = L.op("add", [i, L.cast(add, i64)], metas=[(L.shape(i), i64)])
    return _bcast(L, i, shape)


@rule(aten.index.Tensor, check=_index_check)
def _index(L, node):
    """x[i0, i1, ...] over x's leading dims: the flat row i0 n1 ... + i1 ...
    of x viewed as [n0 n1 ..., rest], an index_select of the rows."""
    m = _out_meta(node)
    x = L.arg(node.args[0])
    xs, idx = list(L.shape(x)), node.args[1]
    k, i64 = len(idx), torch.int64
    bshape = m[0][:len(m[0]) - (len(xs) - k)]
    lin, stride = None, 1
    for j in reversed(range(k)):
        i = _wrap_index(L, L.cast(L.arg(idx[j]), i64), xs[j], bshape)
        if stride != 1:
            i = L.op("mul", [i, _const(L, stride, i64, len(bshape))],
                     metas=[(bshape, i64)])
        lin = i if lin is None else L.op("add", [lin, i],
                                         metas=[(bshape, i64)])
        stride *= xs[j]
    n = 1
    for s in bshape:
        n *= s
    lin = L.op("reshape", [L.op("contiguous", [lin], metas=[(bshape, i64)])],
               [n], metas=[([n], i64)])
    rows = [stride] + xs[k:]
    x = L.op("reshape", [x], rows, metas=[(rows, m[1])])
    got = L.op("index_select", [x, lin], [0], metas=[([n] + xs[k:], m[1])])
    return L.op("reshape", [got], m[0], metas=[m])


# ---- creation -----------------------------------------------------------------


def _full_check(node):
    v = node.args[1]
    return None if isinstance(v, (int, float)) else "fill value"


@rule(aten.full.default, check=_full_check)
def _full(L, node):
    m = _out_meta(node)
    return L.op("full", [], [DTYPES[m[1]]] + m[0], [float(node.args[1])],
                metas=[m])


_FILL = {
    aten.zeros_like.default: 0.0, aten.ones_like.default: 1.0,
    aten.empty_like.default: 0.0, aten.new_zeros.default: 0.0,
    aten.new_ones.default: 1.0, aten.new_empty.default: 0.0,
    aten.new_empty_strided.default: 0.0, aten.full_like.default: None,
    aten.zeros.default: 0.0, aten.ones.default: 1.0,
    aten.empty.memory_format: 0.0, aten.empty_strided.default: 0.0,
}


def _fill_check(node):
    if node.target == aten.full_like.default and not isinstance(
            node.args[1], (int, float)):
        return "fill value"
    return None


@rule(*_FILL, check=_fill_check)
def _fill(L, node):
    """A new tensor of the node's meta filled with a constant (the contents
    of the empty ones are undefined: zeros)."""
    m = _out_meta(node)
    v = _FILL[node.target]
    if v is None:
        v = node.args[1]
    return L.op("full", [], [DTYPES[m[1]]] + m[0], [float(v)], metas=[m])


def _split_check(node):
    return None if _val(node.args[0]).ndim > 0 else "split of a scalar"


@rule(aten.split_with_sizes.default, aten.split.Tensor, check=_split_check)
def _split(L, node):
    v = L.arg(node.args[0])
    shape = L.shape(v)
    d = _norm_dim(node.args[2] if len(node.args) > 2 else
                  node.kwargs.get("dim", 0), len(shape))
    outs, start = [], 0
    for o in _val(node):
        n = o.shape[d]
        if start == 0 and n == shape[d]:
            outs.append(v)
        else:
            outs.append(L.op("slice", [v], [d, start, start + n, 1],
                             metas=[(list(o.shape), o.dtype)]))
        start += n
    return tuple(outs)


def _copy_check(node):
    a, b = _val(node.args[0]), _val(node.args[1])
    if a.ndim < b.ndim:
        return "copy from a higher rank"
    return _to_bool_check(b, a)


@rule(aten.copy.default, check=_copy_check)
def _copy(L, node):
    """Functional copy_: src in dst's dtype, broadcast to dst's shape."""
    m = _out_meta(node)
    src = L.cast(L.arg(node.args[1]), m[1])
    shape = L.shape(src)
    if shape == m[0]:
        return L.op("contiguous", [src], metas=[m])
    if len(shape) < len(m[0]):
        shape = [1] * (len(m[0]) - len(shape)) + shape
        src = L.op("reshape", [src], shape, metas=[(shape, m[1])])
    return L.op("contiguous", [L.op("expand", [src], m[0], metas=[m])],
                metas=[m])


def _masked_fill_check(node):
    v = node.args[2]
    if not isinstance(v, (int, float)):
        return "fill value"
    if _val(node.args[1]).dtype != torch.bool:
        return "mask of dtype %s" % str(_val(node.args[1]).dtype).replace(
            "torch.", "")
    if _val(node).dtype not in FLOATS:
        return "integer masked_fill"
    return None


@rule(aten.masked_fill.Scalar, check=_masked_fill_check)
def _masked_fill(L, node):
    """x where the mask is false, the value where it is true: _pick."""
    m = _out_meta(node)
    fill = _const(L, node.args[2], m[1], len(m[0]))
    return _pick(L, L.arg(node.args[1]), fill, L.arg(node.args[0]), m[0],
                 m[1])


def _bcast(L, v, shape):
    """v broadcast to shape (leading ones added, then expand)."""
    vs = list(L.shape(v))
    if vs == shape:
        return v
    dt = L.dtype(v)
    if len(vs) < len(shape):
        vs = [1] * (len(shape) - len(vs)) + vs
        v = L.op("reshape", [v], vs, metas=[(vs, dt)])
    return L.op("expand", [v], shape, metas=[(list(shape), dt)])


def _slice_scatter_check(node):
    step = node.args[5] if len(node.args) > 5 else node.kwargs.get("step", 1)
    return None if isinstance(step, int) and step >= 1 else "slice step"


def _scatter_strided(L, m, base, src, d, start, step):
    """base with src at start, start + step, ... along d: a gather from
    cat(base, src) whose index is p, or n + k at the k-th written place
    (exact for any value); the index is built from a range and two
    slice_backward placements of ones and of the range 0..k-1."""
    shape = list(L.shape(base))
    n, k = shape[d], L.shape(src)[d]
    f, i64 = torch.float32, torch.int64
    at = [0, start, start + (k - 1) * step + 1, step, n]
    ones = L.op("full", [], [DTYPES[f], k], [1.0], metas=[([k], f)])
    hit = L.op("slice_backward", [ones], at, metas=[([n], f)])
    kk = L.op("slice_backward", [_iota(L, k, f)], at, metas=[([n], f)])
    p = _iota(L, n, f)
    jump = L.op("sub", [L.op("add_scalar", [kk], floats=[float(n)],
                             metas=[([n], f)]), p], metas=[([n], f)])
    idx = L.op("add", [p, L.op("mul", [hit, jump], metas=[([n], f)])],
               metas=[([n], f)])
    idx = L.op("cast", [idx], [DTYPES[i64]], metas=[([n], i64)])
    one = [1] * len(shape)
    one[d] = n
    idx = L.op("reshape", [idx], one, metas=[(one, i64)])
    if one != shape:
        idx = L.op("expand", [idx], shape, metas=[(shape, i64)])
    wide = list(shape)
    wide[d] = n + k
    both = L.op("cat", [base, src], [d], metas=[(wide, m[1])])
    return L.op("gather", [both, idx], [d], metas=[m])


@rule(aten.slice_scatter.default, check=_slice_scatter_check)
def _slice_scatter(L, node):
    """base with src at [start, end) along dim: a cat of base's pieces
    around src; with a step, _scatter_strided."""
    m = _out_meta(node)
    base = L.arg(node.args[0])
    src = L.cast(L.arg(node.args[1]), m[1])
    shape = L.shape(base)
    d = _norm_dim(node.args[2] if len(node.args) > 2 else
                  node.kwargs.get("dim", 0), len(shape))
    size = shape[d]
    start = node.args[3] if len(node.args) > 3 else node.kwargs.get("start")
    end = node.args[4] if len(node.args) > 4 else node.kwargs.get("end")
    step = node.args[5] if len(node.args) > 5 else node.kwargs.get("step", 1)
    start = 0 if start is None else start
    end = size if end is None else end
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, start), size)
    if step != 1 and L.shape(src)[d] == 0:
        return L.op("contiguous", [L.cast(base, m[1])], metas=[m])
    if step != 1:
        return _scatter_strided(L, m, L.cast(base, m[1]), src, d, start,
                                step)
    parts = []
    for a, b in ((0, start), (None, None), (end, size)):
        if a is None:
            parts.append(src)
        elif b > a:
            ps = list(shape)
            ps[d] = b - a
            parts.append(L.op("slice", [base], [d, a, b, 1],
                              metas=[(ps, m[1])]))
    if len(parts) == 1:
        return L.op("contiguous", [src], metas=[m])
    return L.op("cat", parts, [d], metas=[m])


@rule(aten.select.int)
def _select(L, node):
    """x[..., index, ...]: a slice of one, reshaped to drop the dim."""
    m = _out_meta(node)
    v = L.arg(node.args[0])
    shape = list(L.shape(v))
    d = _norm_dim(node.args[1], len(shape))
    i = node.args[2] + shape[d] if node.args[2] < 0 else node.args[2]
    one = list(shape)
    one[d] = 1
    s = L.op("slice", [v], [d, i, i + 1, 1], metas=[(one, m[1])])
    return L.op("reshape", [s], m[0], metas=[m])


@rule(aten.select_backward.default)
def _select_backward(L, node):
    """The gradient of select: grad placed at index, zeros elsewhere."""
    m = _out_meta(node)
    g = L.arg(node.args[0])
    in_shape = list(node.args[1])
    d = _norm_dim(node.args[2], len(in_shape))
    i = node.args[3] + in_shape[d] if node.args[3] < 0 else node.args[3]
    one = list(in_shape)
    one[d] = 1
    g1 = L.op("reshape", [g], one, metas=[(one, m[1])])
    return L.op("slice_backward", [g1], [d, i, i + 1, 1] + in_shape,
                metas=[m])


@rule(aten.select_scatter.default)
def _select_scatter(L, node):
    """base with src at index along dim: a cat around src as a slab of
    one."""
    m = _out_meta(node)
    base = L.arg(node.args[0])
    shape = list(L.shape(base))
    d = _norm_dim(node.args[2], len(shape))
    i = node.args[3] + shape[d] if node.args[3] < 0 else node.args[3]
    one = list(shape)
    one[d] = 1
    src = L.cast(L.arg(node.args[1]), m[1])
    parts = []
    if i > 0:
        ps = list(shape)
        ps[d] = i
        parts.append(L.op("slice", [base], [d, 0, i, 1], metas=[(ps, m[1])]))
    parts.append(L.op("reshape", [src], one, metas=[(one, m[1])]))
    if i + 1 < shape[d]:
        ps = list(shape)
        ps[d] = shape[d] - i - 1
        parts.append(L.op("slice", [base], [d, i + 1, shape[d], 1],
                          metas=[(ps, m[1])]))
    if len(parts) == 1:
        return L.op("contiguous", [parts[0]], metas=[m])
    return L.op("cat", parts, [d], metas=[m])


def _pad_check(node):
    value = node.args[2] if len(node.args) > 2 else 0
    if not isinstance(value, (int, float)) or value != value or abs(
            value) == float("inf"):
        return "pad with value %s" % value
    return None


def _pad_value(L, node, v, value):
    """Padding with a constant (pad pairs run from the last dim backwards):
    a slice where a pad is negative (a crop), then a cat of full blocks of
    the value on either side (any dtype; the values are exact)."""
    m = _out_meta(node)
    pad = list(node.args[1])
    shape = list(L.shape(v))
    for k in range(len(pad) // 2):
        lo, hi = pad[2 * k], pad[2 * k + 1]
        d = len(shape) - 1 - k
        if lo < 0 or hi < 0:
            a, b = max(-lo, 0), shape[d] - max(-hi, 0)
            new = list(shape)
            new[d] = b - a
            v = L.op("slice", [v], [d, a, b, 1], metas=[(new, m[1])])
            shape = new
            lo, hi = max(lo, 0), max(hi, 0)
        parts = []
        for n in (lo, None, hi):
            if n is None:
                parts.append(v)
            elif n > 0:
                ps = list(shape)
                ps[d] = n
                parts.append(L.op("full", [], [DTYPES[m[1]]] + ps,
                                  [float(value)], metas=[(ps, m[1])]))
        if len(parts) > 1:
            shape = list(shape)
            shape[d] += lo + hi
            v = L.op("cat", parts, [d], metas=[(list(shape), m[1])])
    return v


@rule(aten.constant_pad_nd.default, check=_pad_check)
def _pad(L, node):
    """Zero padding of floats (pad pairs run from the last dim backwards): a
    slice where a pad is negative (a crop), then a slice_backward that
    places the result among zeros; other values and integers: _pad_value."""
    m = _out_meta(node)
    v = L.arg(node.args[0])
    value = node.args[2] if len(node.args) > 2 else 0
    if value != 0 or m[1] not in FLOATS:
        return _pad_value(L, node, v, value)
    pad = list(node.args[1])
    shape = list(L.shape(v))
    for k in range(len(pad) // 2):
        lo, hi = pad[2 * k], pad[2 * k + 1]
        d = len(shape) - 1 - k
        if lo < 0 or hi < 0:
            a, b = max(-lo, 0), shape[d] - max(-hi, 0)
            new = list(shape)
            new[d] = b - a
            v = L.op("slice", [v], [d, a, b, 1], metas=[(new, m[1])])
            shape = new
            lo, hi = max(lo, 0), max(hi, 0)
        if lo == 0 and hi == 0:
            continue
        new = list(shape)
        new[d] = shape[d] + lo + hi
        v = L.op("slice_backward", [v], [d, lo, lo + shape[d], 1] + new,
                 metas=[(new, m[1])])
        shape = new
    return v


# ---- complex tensors ---------------------------------------------------------
# A complex tensor of shape S is lowered as the real tensor of shape S + [2]
# that view_as_real makes (re, im in the last dim): view_as_complex and
# view_as_real are the same value, complex arithmetic is real arithmetic on
# the pairs.  A node with a complex input or output takes a rule of
# CX_RULES (or stays in torch); the graph's complex inputs and outputs
# cross as view_as_real / view_as_complex (_backend.py).

CPLX = {torch.complex64: torch.float32, torch.complex128: torch.float64}
CX_RULES = {}
CX_CHECKS = {}
# how many leading arguments a rule takes as tensors (1 when not here)
_CX_TENSOR_ARGS = {aten.polar.default: 2, aten.complex.default: 2,
                   aten.cat.default: 0, aten._conj.default: 0,
                   aten.full.default: 0, aten.zeros.default: 0,
                   aten.ones.default: 0, aten.empty.memory_format: 0,
                   aten.empty_strided.default: 0}


def _is_cx(x):
    v = _val(x)
    return isinstance(v, torch.Tensor) and v.is_complex()


def involves_complex(node):
    """Whether node reads or makes a complex tensor."""
    out = _val(node)
    outs = out if isinstance(out, (tuple, list)) else [out]
    return any(isinstance(v, torch.Tensor) and v.is_complex()
               for v in outs) or any(_is_cx(a) for a in node.all_input_nodes)


def real_val(val):
    """The real meta tensor standing for val (complex S: S + [2])."""
    if not (isinstance(val, torch.Tensor) and val.is_complex()):
        return val
    return torch.empty(list(val.shape) + [2], dtype=CPLX[val.dtype],
                       device="meta")


def _cx_tensor_ok(v):
    if not (isinstance(v, torch.Tensor) and v.is_complex()):
        return _tensor_ok(v)
    if v.dtype not in CPLX:
        return "dtype %s" % str(v.dtype).replace("torch.", "")
    why = device_why(v.device)
    if why:
        return why
    if any(not isinstance(s, int) for s in v.shape):
        return "symbolic shape"
    return "complex rank %d" % v.ndim if v.ndim > 7 else None


def why_complex(node):
    """why_unsupported for a node that involves complex tensors."""
    if node.target is operator.getitem:
        return "getitem of a complex op"
    if node.target not in CX_RULES:
        return "complex: no rule"
    out = _val(node)
    vals = [_val(a) for a in node.all_input_nodes] + list(
        out if isinstance(out, (tuple, list)) else [out])
    for v in vals:
        why = _cx_tensor_ok(v)
        if why:
            return why
    why = _mixed_devices(vals)
    if why:
        return why
    n = _CX_TENSOR_ARGS.get(node.target, 1)
    if not all(_is_tensor_arg(a) for a in node.args[:n]):
        return "complex op of a scalar"
    check = CX_CHECKS.get(node.target)
    return check(node) if check else None


cx_rule = _registrar(CX_RULES, CX_CHECKS)


def _cm(node):
    """The real (shape, dtype) of node's value (complex S: S + [2])."""
    v = _val(node)
    if v.is_complex():
        return (list(v.shape) + [2], CPLX[v.dtype])
    return (list(v.shape), v.dtype)


def _pair(L, x, dt):
    """The complex tensor argument x as pairs of dt (a real x gets a zero
    imaginary part)."""
    v = L.cast(L.arg(x), dt)
    if _is_cx(x):
        return v
    s = list(L.shape(v))
    one = s + [1]
    r = L.op("reshape", [v], one, metas=[(one, dt)])
    z = L.op("full", [], [DTYPES[dt]] + one, [0.0], metas=[(one, dt)])
    return L.op("cat", [r, z], [len(s)], metas=[(s + [2], dt)])


def _parts(L, v):
    """(re, im) of the pairs v, each of shape S + [1]."""
    s, dt = list(L.shape(v)), L.dtype(v)
    one = s[:-1] + [1]
    re = L.op("slice", [v], [len(s) - 1, 0, 1, 1], metas=[(one, dt)])
    im = L.op("slice", [v], [len(s) - 1, 1, 2, 1], metas=[(one, dt)])
    return re, im


def _join(L, re, im, m):
    """The pairs of meta m (S + [2]) from re and im (broadcast to S + [1])."""
    one = m[0][:-1] + [1]
    re, im = _bcast(L, re, one), _bcast(L, im, one)
    return L.op("cat", [re, im], [len(one) - 1], metas=[m])


def _const2(L, a, b, dt):
    """The constant pair [a, b] (shape [2])."""
    x = L.op("full", [], [DTYPES[dt], 1], [float(a)], metas=[([1], dt)])
    y = L.op("full", [], [DTYPES[dt], 1], [float(b)], metas=[([1], dt)])
    return L.op("cat", [x, y], [0], metas=[([2], dt)])


def _cmul(L, a, b, m):
    """(ar br - ai bi, ar bi + ai br) of the pairs a and b: the rotary op
    on the pairs of a (rotate_half of (ar, ai) is (-ai, ar)) with cos br
    and sin bi, a taken as the operand of the product's shape."""
    if L.shape(a) != m[0]:
        a, b = b, a
    a = _bcast(L, a, m[0])
    br, bi = _parts(L, b)
    return L.op("rope", [a, br, bi], metas=[m])


def _conj(L, v):
    dt = L.dtype(v)
    return L.op("mul", [v, _const2(L, 1, -1, dt)],
                metas=[(L.shape(v), dt)])


def _abs2(L, v):
    """re^2 + im^2 of the pairs v, shape S + [1]."""
    re, im = _parts(L, v)
    h = (L.shape(re), L.dtype(v))
    return L.op("add", [L.op("mul", [re, re], metas=[h]),
                        L.op("mul", [im, im], metas=[h])], metas=[h])


def _real_last(L, x, dt):
    """The real tensor argument x (cast to dt) with a trailing dim of one,
    to scale pairs."""
    v = L.cast(L.arg(x), dt)
    one = list(L.shape(v)) + [1]
    return L.op("reshape", [v], one, metas=[(one, dt)])


# ---- complex: views and copies ----


@cx_rule(aten.view_as_complex.default, aten.view_as_real.default,
         aten.alias.default, aten.detach.default,
         aten.lift_fresh_copy.default, aten.resolve_conj.default)
def _cx_same(L, node):
    return L.arg(node.args[0])


@cx_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default,
         aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
         aten.squeeze.default)
def _cx_reshape(L, node):
    m, v = _cm(node), L.arg(node.args[0])
    return v if L.shape(v) == m[0] else L.op("reshape", [v], m[0],
                                              metas=[m])


@cx_rule(aten.permute.default)
def _cx_permute(L, node):
    nd = _val(node).ndim
    perm = [_norm_dim(d, nd) for d in node.args[1]] + [nd]
    return L.op("permute", [L.arg(node.args[0])], perm, metas=[_cm(node)])


@cx_rule(aten.transpose.int, aten.t.default)
def _cx_transpose(L, node):
    nd, v = _val(node).ndim, L.arg(node.args[0])
    if node.target == aten.t.default:
        if nd < 2:
            return v
        d0, d1 = 0, 1
    else:
        d0, d1 = (_norm_dim(d, nd) for d in node.args[1:3])
    if d0 == d1:
        return v
    return L.op("transpose", [v], [d0, d1], metas=[_cm(node)])


@cx_rule(aten.expand.default)
def _cx_expand(L, node):
    return _bcast(L, L.arg(node.args[0]), _cm(node)[0])


@cx_rule(aten.clone.default, check=_clone_check)
def _cx_clone(L, node):
    return L.op("contiguous", [L.arg(node.args[0])], metas=[_cm(node)])


@cx_rule(aten.slice.Tensor, check=_slice_check)
def _cx_slice(L, node):
    v = L.arg(node.args[0])
    shape = _shape(node.args[0])
    d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(shape))
    _, start, end, step = _slice_args(node, shape[d])
    if start == 0 and end == shape[d] and step == 1:
        return v
    return L.op("slice", [v], [d, start, end, step], metas=[_cm(node)])


@cx_rule(aten.select.int)
def _cx_select(L, node):
    m, v = _cm(node), L.arg(node.args[0])
    shape = list(L.shape(v))
    d = _norm_dim(node.args[1], len(shape) - 1)
    i = node.args[2] + shape[d] if node.args[2] < 0 else node.args[2]
    one = list(shape)
    one[d] = 1
    s = L.op("slice", [v], [d, i, i + 1, 1], metas=[(one, m[1])])
    return L.op("reshape", [s], m[0], metas=[m])


@cx_rule(aten.slice_backward.default)
def _cx_slice_backward(L, node):
    """slice_backward of the pairs: the input shape gains the pair dim."""
    in_shape = list(node.args[1])
    d = _norm_dim(node.args[2], len(in_shape))
    size = in_shape[d]
    start, end, step = node.args[3], node.args[4], node.args[5]
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return L.op("slice_backward", [L.arg(node.args[0])],
                [d, start, end, step] + in_shape + [2], metas=[_cm(node)])


@cx_rule(aten.select_backward.default)
def _cx_select_backward(L, node):
    m = _cm(node)
    in_shape = list(node.args[1])
    d = _norm_dim(node.args[2], len(in_shape))
    i = node.args[3] + in_shape[d] if node.args[3] < 0 else node.args[3]
    one = list(m[0])
    one[d] = 1
    g1 = L.op("reshape", [L.arg(node.args[0])], one, metas=[(one, m[1])])
    return L.op("slice_backward", [g1], [d, i, i + 1, 1] + m[0], metas=[m])


@cx_rule(aten.cat.default, check=_cat_check)
def _cx_cat(L, node):
    m = _cm(node)
    xs = [x for x in node.args[0]
          if not (_val(x).ndim == 1 and _val(x).shape[0] == 0)]
    ins = [_pair(L, x, m[1]) for x in xs]
    if len(ins) == 1:
        return ins[0]
    d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(m[0]) - 1)
    return L.op("cat", ins, [d], metas=[m])


@cx_rule(aten._to_copy.default, check=_to_copy_check)
def _cx_to_copy(L, node):
    """Complex to complex (a cast of the pairs), real to complex (a zero
    imaginary part), complex to real (the real part, as torch)."""
    m = _cm(node)
    if _val(node).is_complex():
        return L.op("contiguous", [_pair(L, node.args[0], m[1])], metas=[m])
    re = _parts(L, L.arg(node.args[0]))[0]
    re = L.op("reshape", [re], m[0], metas=[(m[0], L.dtype(re))])
    return L.cast(re, m[1])


@cx_rule(aten._conj.default, aten.conj_physical.default)
def _cx_conj(L, node):
    x = node.args[0]
    if not _is_tensor_arg(x):  # a scalar's conjugate, as a 0-dim tensor
        return _scalar_pair(L, complex(x).conjugate(), _cm(node))
    return _conj(L, L.arg(x))


@cx_rule(aten.complex.default)
def _cx_complex(L, node):
    m = _cm(node)
    re, im = (_real_last(L, x, m[1]) for x in node.args[:2])
    return _join(L, re, im, m)


@cx_rule(aten.polar.default)
def _cx_polar(L, node):
    """abs cos(angle), abs sin(angle)."""
    m = _cm(node)
    a, t = (_real_last(L, x, m[1]) for x in node.args[:2])
    h = (list(L.shape(t)), m[1])
    c = L.op("cos", [t], metas=[h])
    s = L.op("sin", [t], metas=[h])
    one = (m[0][:-1] + [1], m[1])
    return _join(L, L.op("mul", [a, c], metas=[one]),
                 L.op("mul", [a, s], metas=[one]), m)


# ---- complex: arithmetic ----


def _cx_scalar_ok(x):
    return isinstance(x, (int, float, complex)) and not isinstance(x, bool)


def _cx_binary_check(node):
    a, b = node.args[0], node.args[1]
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2
                            else 1)
    if node.kwargs.get("rounding_mode") is not None:
        return "rounding_mode"
    if not _is_tensor_arg(a):
        return "scalar first operand"
    if not (_is_tensor_arg(b) or _cx_scalar_ok(b)):
        return "operand of type %s" % type(b).__name__
    if not _val(node).is_complex():
        return "complex arithmetic to %s" % _val(node).dtype
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return "complex alpha"
    if node.target in (aten.div.Tensor, aten.div.Scalar) and not \
            _is_tensor_arg(b) and b == 0:
        return "complex division by a zero scalar"
    return None


def _scalar_pair(L, s, m):
    """The scalar s (real or complex) as a constant pair."""
    s = complex(s)
    return _const2(L, s.real, s.imag, m[1])


@cx_rule(aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar,
         aten.sub.Scalar, check=_cx_binary_check)
def _cx_add(L, node):
    m = _cm(node)
    name = "add" if node.target in (aten.add.Tensor, aten.add.Scalar) \
        else "sub"
    a, b = _pair(L, node.args[0], m[1]), node.args[1]
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2
                            else 1)
    if not _is_tensor_arg(b):
        return L.op(name, [a, _scalar_pair(L, complex(b) * alpha, m)],
                    metas=[m])
    bv = _pair(L, b, m[1])
    if alpha != 1:
        bv = L.op("mul_scalar", [bv], floats=[float(alpha)],
                  metas=[(L.shape(bv), m[1])])
    return L.op(name, [a, bv], metas=[m])


def _cx_times(L, a, b, m):
    """The pairs a times the argument b (a complex or real tensor or a
    scalar)."""
    if not _is_tensor_arg(b):
        b = complex(b)
        if b.imag == 0:
            return L.op("mul_scalar", [a], floats=[b.real], metas=[m])
        return _cmul(L, a, _scalar_pair(L, b, m), m)
    if not _is_cx(b):
        return L.op("mul", [a, _real_last(L, b, m[1])], metas=[m])
    return _cmul(L, a, L.cast(L.arg(b), m[1]), m)


@cx_rule(aten.mul.Tensor, aten.mul.Scalar, check=_cx_binary_check)
def _cx_mul(L, node):
    """The complex product; by a real tensor or scalar, a scaling of both
    parts."""
    m = _cm(node)
    a, b = node.args[0], node.args[1]
    if _is_tensor_arg(b) and _is_cx(b) and not _is_cx(a):
        a, b = b, a
    return _cx_times(L, _pair(L, a, m[1]), b, m)


@cx_rule(aten.div.Tensor, aten.div.Scalar, check=_cx_binary_check)
def _cx_div(L, node):
    """a / b = a conj(b) / |b|^2 (a real b divides both parts)."""
    m = _cm(node)
    a, b = _pair(L, node.args[0], m[1]), node.args[1]
    if not _is_tensor_arg(b):
        return _cx_times(L, a, 1 / complex(b), m)
    if not _is_cx(b):
        return L.op("div", [a, _real_last(L, b, m[1])], metas=[m])
    bv = L.cast(L.arg(b), m[1])
    num = _cmul(L, a, _conj(L, bv), m)
    return L.op("div", [num, _abs2(L, bv)], metas=[m])


@cx_rule(aten.neg.default)
def _cx_neg(L, node):
    return L.op("neg", [L.arg(node.args[0])], metas=[_cm(node)])


@cx_rule(aten.abs.default)
def _cx_abs(L, node):
    """|z| = sqrt(re^2 + im^2)."""
    m = _cm(node)
    v = L.arg(node.args[0])
    r = L.op("sqrt", [_abs2(L, v)], metas=[(m[0] + [1], m[1])])
    return L.op("reshape", [r], m[0], metas=[m])


@cx_rule(aten.sgn.default)
def _cx_sgn(L, node):
    """z / |z|, 0 where z is 0 (divided by |z| + (|z| == 0))."""
    m = _cm(node)
    v = L.arg(node.args[0])
    h = (m[0][:-1] + [1], m[1])
    r = L.op("sqrt", [_abs2(L, v)], metas=[h])
    z = L.op("full", [], [DTYPES[m[1]]] + h[0], [0.0], metas=[h])
    r = L.op("add", [r, L.op("eq", [r, z], metas=[h])], metas=[h])
    return L.op("div", [v, r], metas=[m])


def _cx_sum_check(node):
    if node.kwargs.get("dtype") is not None:
        return "complex sum with a dtype"
    return None


@cx_rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim,
         aten.mean.default, check=_cx_sum_check)
def _cx_sum(L, node):
    """Sums (means) over the complex dims (never the pairs' last)."""
    v = L.arg(node.args[0])
    shape, dt = list(L.shape(v)), L.dtype(v)
    name = "sum" if node.target in (aten.sum.dim_IntList,
                                    aten.sum.default) else "mean"
    keep = node.target != aten.sum.default and _keepdim(node)
    dims = (_reduce_dims(node) if node.target != aten.sum.default
            else range(len(shape) - 2, -1, -1))
    for d in dims:
        if keep:
            shape[d] = 1
        else:
            del shape[d]
        v = L.op(name, [v], [d, int(keep)], metas=[(list(shape), dt)])
    return v


def _cx_fill_check(node):
    if node.target in (aten.full.default, aten.full_like.default) and \
            not _cx_scalar_ok(node.args[1]):
        return "fill value"
    return None


@cx_rule(aten.full.default, *_FILL, check=_cx_fill_check)
def _cx_fill(L, node):
    """A new complex tensor filled with a constant (the empty ones:
    zeros): the constant pair expanded."""
    m = _cm(node)
    v = _FILL.get(node.target)
    v = node.args[1] if v is None else v
    pair = _bcast(L, _scalar_pair(L, v, m), m[0])
    return L.op("contiguous", [pair], metas=[m])


@cx_rule(aten.real.default, aten.imag.default)
def _cx_part(L, node):
    m = _cm(node)
    p = _parts(L, L.arg(node.args[0]))[node.target == aten.imag.default]
    return L.op("reshape", [p], m[0], metas=[m])


# ---- triangular solve ---------------------------------------------------------


def _solve_tri_flags(node):
    """(upper, left, unitriangular) of a linalg_solve_triangular node."""
    a, kw = node.args, node.kwargs
    upper = a[2] if len(a) > 2 else kw.get("upper")
    left = a[3] if len(a) > 3 else kw.get("left", True)
    unit = a[4] if len(a) > 4 else kw.get("unitriangular", False)
    return upper, left, unit


def _solve_tri_check(node):
    upper, left, unit = _solve_tri_flags(node)
    if not all(isinstance(f, bool) for f in (upper, left, unit)):
        return "solve_triangular flags"
    if not left:
        return "solve_triangular left=False"
    if _val(node).dtype not in FLOATS:
        return "solve_triangular dtype"
    return None


@rule(aten.linalg_solve_triangular.default, check=_solve_tri_check)
def _solve_triangular(L, node):
    upper, left, unit = _solve_tri_flags(node)
    m = _out_meta(node)
    a = _pointwise_in(L, node, node.args[0], m[1])
    b = _pointwise_in(L, node, node.args[1], m[1])
    return L.op("solve_triangular", [a, b],
                [int(upper), int(unit), int(left)], metas=[m])


def lower_node(L, node):
    """Lowers node into L; records its value(s) in L.env."""
    if node.target is operator.getitem:
        L.env[node] = L.env[node.args[0]][node.args[1]]
        return
    rules = CX_RULES if involves_complex(node) else RULES
    L.env[node] = rules[node.target](L, node)
