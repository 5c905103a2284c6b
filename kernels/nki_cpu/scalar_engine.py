"""ScalarE: ``activation`` (with its accumulator-register reduction), ``activation_reduce``, and ``activate2``
(NeuronCore-v4 only) - aws-neuron-sdk @81ce03ae ``nki/api/nki/isa/__init__.py`` and ``nki/api/nki.api.shared.rst``;
rules ``SE-*``. ScalarE's ``tensor_scalar`` operator combinations are checked with ``tensor_scalar``
(:mod:`.vector_engine`).

Numerics: the Scalar Engine approximates its activation functions "with piece-wise polynomials" (shared.rst); AWS
documents no accuracy for them. By default they are evaluated exactly in float32 here (so accuracy measured in the
interpreter is a best case). :func:`perturbed` multiplies every approximated function's result (``operators.
APPROXIMATED``) by ``1 + eps * r``, ``r`` in [-1, 1] (``uniform``: seeded random per element; ``high`` / ``low``: all
+1 / -1, a systematic bias) - the bound ``eps`` is the caller's, stated where it is used (tests/test_nki_perturbation.py).
"""

from __future__ import annotations

import contextlib

import numpy as np

from . import dtypes as dt
from . import operators as ops
from .engines import count, per_partition, same_layout, tile
from .enums import coerce, reduce_cmd
from .machine import PMAX, current
from .rules import ISA, SHARED, NkiValidationError, rule
from .tensor import read, write

SCALE = rule("SE-SCALE", ISA, "The ``scale`` parameter must have a float32 data type, while the ``bias`` parameter can be "
             "any supported dtype except tfloat32", "activation: scale a scalar or a float32 [P, 1] tile; bias a scalar or a "
             "[P, 1] tile of any dtype but tfloat32")
BIAS = rule("SE-BIAS-SCALAR", ISA, "starting NeuronCore-v3, ``bias`` can either be a compile-time constant scalar or a "
            "``[N, 1]`` vector", "a compile-time scalar bias is accepted (Trn2 is NeuronCore-v3)")
REDUCE = rule("SE-REDUCE", ISA, "``reduce_op`` must be ``nl.add``", "activation's reduction: reduce_op nl.add; reduce_cmd "
              "reset / reduce / reset_reduce drive the 128 per-lane registers; reduce_res ([P, 1]) reads them out")
ACTIVATE2 = rule("SE-ACTIVATE2", ISA, "Available only on NeuronCore-v4 and newer", "activate2 is refused on Trn2")
APPROXIMATE = rule("SE-APPROX", SHARED, "These activation functions are approximated with piece-wise polynomials on Scalar "
                   "Engine", "exact float32 by default; perturbed(eps) applies a stated relative bound to the approximated ones")


_PERTURB: list = []  # [(eps, mode, rng)] while perturbed() is active


@contextlib.contextmanager
def perturbed(eps: float, mode: str = "uniform", seed: int = 0):
    """Within the block, approximated activation results carry a relative error of at most ``eps``."""
    if mode not in ("uniform", "high", "low") or not eps >= 0:
        raise ValueError(f"perturbed(eps={eps!r}, mode={mode!r}): eps >= 0, mode uniform / high / low")
    _PERTURB.append((float(eps), mode, np.random.default_rng(seed)))
    try:
        yield
    finally:
        _PERTURB.pop()


def evaluate(op: ops.Op, x: np.ndarray) -> np.ndarray:
    """``op`` on float32 inputs as ScalarE computes it here (NaN outside the valid range; perturbed if asked)."""
    with np.errstate(all="ignore"):
        y = np.asarray(op.act_fn(x), dtype=np.float32)
    bad = ops.out_of_range(op, x)
    if bad is not None and bad.any():
        y = np.where(bad, np.float32(np.nan), y)
    if _PERTURB and op.name in ops.APPROXIMATED:
        eps, mode, rng = _PERTURB[-1]
        r = rng.uniform(-1.0, 1.0, size=y.shape) if mode == "uniform" else (1.0 if mode == "high" else -1.0)
        y = (y * (1.0 + eps * r)).astype(np.float32)
    return y


def _regs() -> np.ndarray:
    m = current()
    if m.reduce_regs is None:
        m.reduce_regs = np.full(PMAX, np.nan, dtype=np.float32)  # never reset: garbage
    return m.reduce_regs


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=reduce_cmd.idle, name=None) -> None:
    """dst = op(data * scale + bias) on ScalarE, optionally reducing the activated values into its lane registers."""
    op = ops.need_activation(op)
    data, dst = tile(data, "activation data"), tile(dst, "activation dst")
    same_layout(dst, data, "activation")
    shape = dst.shape
    x = read(data, "activation data").reshape(shape)
    x = x * per_partition(scale, dst, "activation scale", float32_only=True, rule_=SCALE)
    if bias is not None:
        if not isinstance(bias, (int, float, np.floating, np.integer)):
            SCALE.check(getattr(bias, "dtype", None) is not dt.tfloat32, "activation bias is tfloat32")
        x = x + per_partition(bias, dst, "activation bias")
    y = evaluate(op, x)
    write(dst, y)
    _reduce(y, dst, reduce_op, reduce_res, reduce_cmd)
    count("scalar", "activation", data)


def _reduce(y: np.ndarray, dst, reduce_op, reduce_res, cmd) -> None:
    cmd = coerce(reduce_cmd, cmd)
    if reduce_op is None and reduce_res is None and cmd in (None, reduce_cmd.idle):
        return
    REDUCE.check(cmd in (None, reduce_cmd.idle, reduce_cmd.reset, reduce_cmd.reduce, reduce_cmd.reset_reduce),
                 f"activation reduce_cmd={cmd!r}: idle, reset, reduce or reset_reduce")
    p = dst.shape[0]
    regs = _regs()
    if cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        regs[:p] = 0.0
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce):
        REDUCE.check(getattr(reduce_op, "name", None) == "add", f"activation reduce_op={reduce_op!r}: it must be nl.add")
        regs[:p] = regs[:p] + y.reshape(p, -1).sum(axis=1, dtype=np.float32)
    if reduce_res is not None:
        res = tile(reduce_res, "activation reduce_res")
        REDUCE.check(res.shape[0] == p and res.size == p, f"activation reduce_res {res.shape}: it must be [{p}, 1]")
        if np.isnan(regs[:p]).any():
            raise NkiValidationError("activation reduce_res reads ScalarE accumulator registers never reset "
                                     "(reduce_cmd=reset or reset_reduce first)")
        write(res, regs[:p].reshape(res.shape))


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None) -> None:
    """``activation`` with ``reduce_cmd=reset_reduce`` and ``reduce_res`` (kept for backward compatibility)."""
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
               reduce_cmd=reduce_cmd.reset_reduce)


def activate2(dst, op, data, imm0, imm1, op0, op1, *args, **kwargs) -> None:
    raise ACTIVATE2.error("nisa.activate2 is a NeuronCore-v4 (Trn3) instruction; on Trn2 use nisa.activation "
                          "(scale / bias) or nisa.tensor_scalar before it")
