"""The operators NKI instructions take (``op=``, ``op0=``, ``reduce_op=``) and the activation functions, as listed in
aws-neuron-sdk @81ce03ae ``nki/api/nki.api.shared.rst`` ("Supported Math Operators for NKI ISA", "Supported Activation
Functions for NKI ISA", with their valid input ranges).

* ``kind``: ``arith`` (binary, computed in float32), ``bitvec`` (integer bit patterns), ``unary`` (arithmetic unary:
  abs, square, relu, rsqrt, reciprocal), ``act`` (ScalarE activation only).
* ``reducible``: the table's "Legal Reduction op" column.
* ``activation``: accepted by ``nisa.activation`` (ScalarE), with its valid input range; an input outside it yields NaN
  here ("the Scalar Engine will generate invalid output results").
Every activation evaluates exactly in float32 (numpy / torch), except under :func:`perturbed`, which applies a bounded
relative error to the approximated ones (:data:`APPROXIMATED`), see :mod:`.scalar_engine`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .rules import SHARED, rule

TABLE = rule("OP-TABLE", SHARED, "Many :ref:`nki.isa <nki-isa>` APIs (instructions) allow programmable operators through the "
             "``op`` field", "operators and activation functions are those of the shared tables, each with its kind; "
             "anything else is refused")
ACT_RANGE = rule("ACT-RANGE", SHARED, "if input values fall outside the supported **Valid Input Range** listed below, the "
                 "Scalar Engine will generate invalid output results",
                 "an activation input outside its valid range (log, sin, arctan, sqrt, rsqrt, reciprocal) gives NaN")


CALL: list = [None]  # language_ops.apply, installed by that module (it builds on this one)


class Op:
    """A named operator or activation function."""

    def __init__(self, name, kind, fn, reducible=False, activation=False, valid=None, identity=None):
        self.name, self.kind, self.fn = name, kind, fn
        self.reducible, self.activation, self.valid, self.identity = reducible, activation, valid, identity

    def __call__(self, *args, **kwargs):
        """``nl.add(a, b)`` on tiles: lowered by :mod:`.language_ops` (which installs :data:`CALL`)."""
        return CALL[0](self, *args, **kwargs)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


def _t(fn):
    """A float32 function through torch (erf and friends numpy lacks)."""
    return lambda x: fn(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()


def _sig(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


SQRT_2_PI = math.sqrt(2.0 / math.pi)
_ARITH = dict(
    add=(np.add, True, 0.0), subtract=(np.subtract, True, None), multiply=(np.multiply, True, 1.0),
    maximum=(np.maximum, True, -np.inf), minimum=(np.minimum, True, np.inf), divide=(np.divide, False, None),
    equal=(lambda a, b: (a == b).astype(np.float32), False, None),
    not_equal=(lambda a, b: (a != b).astype(np.float32), False, None),
    greater_equal=(lambda a, b: (a >= b).astype(np.float32), False, None),
    greater=(lambda a, b: (a > b).astype(np.float32), False, None),
    less_equal=(lambda a, b: (a <= b).astype(np.float32), False, None),
    less=(lambda a, b: (a < b).astype(np.float32), False, None),
    logical_and=(lambda a, b: ((a != 0) & (b != 0)).astype(np.float32), True, 1.0),
    logical_or=(lambda a, b: ((a != 0) | (b != 0)).astype(np.float32), True, 0.0),
    logical_xor=(lambda a, b: ((a != 0) ^ (b != 0)).astype(np.float32), True, 0.0),
    power=(np.power, False, None),
    abs_max=(lambda a, b: np.where(np.abs(a) > np.abs(b), a, b), False, None),
    abs_min=(lambda a, b: np.where(np.abs(a) < np.abs(b), a, b), False, None),
)
_BITVEC = dict(
    bitwise_and=(np.bitwise_and, True), bitwise_or=(np.bitwise_or, True), bitwise_xor=(np.bitwise_xor, True),
    left_shift=(np.left_shift, False), right_shift=(np.right_shift, False),
)
_UNARY = dict(abs=np.abs, square=np.square, relu=lambda x: np.maximum(x, 0.0),
              rsqrt=lambda x: 1.0 / np.sqrt(x), reciprocal=lambda x: 1.0 / x)
_ACT = dict(
    copy=(lambda x: x, None), square=(np.square, None), sigmoid=(_sig, None), relu=(lambda x: np.maximum(x, 0.0), None),
    gelu=(lambda x: 0.5 * x * (1.0 + _t(torch.erf)(x / math.sqrt(2.0))), None),
    gelu_dx=(lambda x: 0.5 * (1.0 + _t(torch.erf)(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi), None),
    gelu_apprx_tanh=(lambda x: 0.5 * x * (1.0 + np.tanh(SQRT_2_PI * (x + 0.044715 * x ** 3))), None),
    gelu_apprx_sigmoid=(lambda x: x * _sig(1.702 * x), None),
    gelu_apprx_sigmoid_dx=(lambda x: _sig(1.702 * x) * (1.0 + 1.702 * x * (1.0 - _sig(1.702 * x))), None),
    silu=(lambda x: x * _sig(x), None), silu_dx=(lambda x: _sig(x) * (1.0 + x * (1.0 - _sig(x))), None),
    tanh=(np.tanh, None), softplus=(lambda x: np.logaddexp(0.0, x), None),
    mish=(lambda x: x * np.tanh(np.logaddexp(0.0, x)), None), erf=(_t(torch.erf), None),
    erf_dx=(lambda x: 2.0 / math.sqrt(math.pi) * np.exp(-x * x), None), exp=(np.exp, None),
    log=(np.log, (2.0 ** -64, 2.0 ** 64)), sin=(np.sin, (-math.pi, math.pi)), arctan=(np.arctan, (-math.pi / 2, math.pi / 2)),
    sqrt=(np.sqrt, (2.0 ** -116, 2.0 ** 118)), rsqrt=(lambda x: 1.0 / np.sqrt(x), (2.0 ** -87, 2.0 ** 97)),
    reciprocal=(lambda x: 1.0 / x, ("abs", 2.0 ** -42, 2.0 ** 42)), sign=(np.sign, None), abs=(np.abs, None),
)
# Functions a piece-wise polynomial cannot represent exactly (the others are identity, sign, abs, relu, square).
APPROXIMATED = ("sigmoid", "gelu", "gelu_dx", "gelu_apprx_tanh", "gelu_apprx_sigmoid", "gelu_apprx_sigmoid_dx", "silu",
                "silu_dx", "tanh", "softplus", "mish", "erf", "erf_dx", "exp", "log", "sin", "arctan", "sqrt", "rsqrt",
                "reciprocal")

OPS: dict[str, Op] = {}
for _n, (_f, _red, _ident) in _ARITH.items():
    OPS[_n] = Op(_n, "arith", _f, reducible=_red, identity=_ident)
for _n, (_f, _red) in _BITVEC.items():
    OPS[_n] = Op(_n, "bitvec", _f, reducible=_red)
OPS["invert"] = Op("invert", "bitvec_unary", np.invert)
for _n, _f in _UNARY.items():
    OPS[_n] = Op(_n, "unary", _f)
for _n, (_f, _valid) in _ACT.items():
    if _n in OPS:  # abs, square, relu, rsqrt, reciprocal: ALU unary operators and activation functions
        OPS[_n].activation, OPS[_n].valid, OPS[_n].act_fn = True, _valid, _f
    else:
        OPS[_n] = Op(_n, "act", _f, activation=True, valid=_valid)
for _op in OPS.values():
    if not hasattr(_op, "act_fn"):
        _op.act_fn = _op.fn
OPS["prelu"] = Op("prelu", "act", None)  # needs relu_param: activate2 (NeuronCore-v4) only
OPS["bypass"] = Op("bypass", "bypass", None)


def need(op, kinds, what: str) -> Op:
    """``op`` as an operator of one of ``kinds`` (refused otherwise)."""
    TABLE.check(isinstance(op, Op) and op.kind in kinds,
                f"{what} {op!r} is not an operator this instruction takes (it takes {', '.join(kinds)} operators)")
    return op


def need_activation(op, what: str = "activation op") -> Op:
    TABLE.check(isinstance(op, Op) and op.activation and op.act_fn is not None,
                f"{what} {op!r} is not an activation function the Scalar Engine accepts (shared table)")
    return op


def out_of_range(op: Op, x: np.ndarray) -> np.ndarray | None:
    """Mask of inputs outside ``op``'s valid range (:data:`ACT_RANGE`), or None."""
    if op.valid is None:
        return None
    if op.valid[0] == "abs":
        a = np.abs(x)
        return ~((a >= op.valid[1]) & (a <= op.valid[2]))
    return ~((x >= op.valid[0]) & (x <= op.valid[1]))
