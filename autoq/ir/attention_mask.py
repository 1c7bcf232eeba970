"""Attention masks of ``finfo(float32).min`` rewritten to a quantizable constant.

Transformer exports build the additive attention mask as ``(1 - mask) * finfo.min``
(``multiply``) or ``where(mask, 0, finfo.min)`` and add it to the attention scores before
the softmax. Values of -3.4e38 cannot share an int8 grid with the scores (see
:mod:`autoq.fallback.guard`, which otherwise keeps those layers in fp32). Canonicalization
(:data:`autoq.ir.canonicalize.RULES`, rows ``attention_mask_*``) replaces every constant of a
``multiply`` or ``where`` whose values are all at or below :data:`SENTINEL` by
:data:`MASK_VALUE`.

Why -100 and not -1e4 (BERT's original constant): the mask add is an int8 layer whose grid
must span the masked scores too. With -1e4 the grid step is ~40 and every real score
rounds to one value (measured on the tiny BERT block of test_attention_mask: relative
output error 0.28 vs 0.016 with the add kept fp32; -100: 0.038, -50: 0.025, -30: 0.021).

Why the float softmax stays equal within float32 precision: a masked score becomes
``s + MASK_VALUE``; softmax subtracts the row maximum ``m`` (an unmasked score), so each
masked key weighs ``exp(s - m + MASK_VALUE) <= exp(spread - 100)`` relative to the largest
one. For 128 keys whose scores span less than 78 that total is below 2**-24, half a float32
ulp of the normalizer: the unmasked probabilities are the same float32 numbers (up to one
ulp) and the masked ones are below 1e-8 instead of 0 (test_attention_mask checks a
BERT-style block). A row whose keys are *all* masked differs (uniform with ``finfo.min``;
the softmax of its raw scores here); such rows belong to padding queries, which sentence
poolings ignore.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from autoq.ir.toolkit import const_array

__all__ = ["MASK_VALUE", "SENTINEL", "mask_multiply", "mask_where", "rewrite_mask_constant"]

#: constants at or below this are mask sentinels (``finfo(float32).min`` is -3.4e38)
SENTINEL = -1e30

#: what they become (see the module docstring for the choice)
MASK_VALUE = -100.0


def _sentinel(e) -> bool:
    v = const_array(e)
    return v is not None and v.size > 0 and v.dtype.kind == "f" and bool(np.all(v <= SENTINEL))


def mask_multiply():
    x, c = wildcard(), is_const()
    return is_op("relax.multiply")(x, c), {"x": x, "c": c}


def mask_where():
    cond, a, b = wildcard(), wildcard(), wildcard()
    return is_op("relax.where")(cond, a, b), {"cond": cond, "a": a, "b": b}


def _replacement(e) -> relax.Expr:
    v = const_array(e)
    return relax.const(np.full(v.shape, MASK_VALUE, v.dtype), str(v.dtype))


def rewrite_mask_constant(m: dict, p: dict) -> relax.Expr | None:
    """The canonicalization rewrite of :func:`mask_multiply` / :func:`mask_where` matches:
    the sentinel constant replaced by :data:`MASK_VALUE`; None when there is none."""
    call = m["root"]
    args = list(call.args)
    hits = [i for i, a in enumerate(args) if _sentinel(a)]
    if not hits or (op := call.op.name) not in ("relax.multiply", "relax.where"):
        return None
    if op == "relax.where" and 0 in hits:
        return None  # the condition is not a value of the mask
    for i in hits:
        args[i] = _replacement(args[i])
    return relax.Call(call.op, args, call.attrs)
