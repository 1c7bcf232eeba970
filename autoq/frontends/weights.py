"""What every importer ends with: weight parameters named as the user knows them, unused
ones dropped, batch norms and per-channel affine chains folded into the convolutions."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax

from autoq.ir.prepare import drop_unused_params, fold_affine, fold_batch_norm, rename_params
from autoq.ir.toolkit import with_main

__all__ = ["finish_import"]


def finish_import(
    mod: tvm.IRModule,
    func: relax.Function,
    rename: dict[relax.Var, str],
    params: dict[str, np.ndarray],
    fold_bn: bool,
    rewrite: Callable[[tvm.IRModule], tvm.IRModule] | None = None,
) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """``mod`` with ``func`` (its ``main``) after renaming the parameters in ``rename``,
    dropping weight parameters nothing uses, ``rewrite`` (an importer's own clean-up of the
    module) and, with ``fold_bn``, :func:`autoq.ir.prepare.fold_batch_norm` and
    :func:`autoq.ir.prepare.fold_affine`; ``params`` maps the new names to arrays."""
    func = rename_params(func, rename)
    func, params = drop_unused_params(func, params)
    mod = with_main(mod, func)
    if rewrite is not None:
        mod = rewrite(mod)
    if fold_bn:
        mod, params = fold_batch_norm(mod, params)
        mod, params = fold_affine(mod, params)
    return mod, params
