"""The default Relax CPU pipeline, cut at fusion so that autoq can act on the fused kernels.

``tvm.relax.get_default_pipeline(llvm)`` runs library dispatch, legalization + fusion
(``LegalizeOps``, ``AnnotateTIROpPattern``, ``FoldConstant``, ``FuseOps``, ``FuseTIR``), the
dataflow lowering and the VM finalization. :func:`fused` is its first half (MetaSchedule
extracts its tuning tasks from exactly that module); :func:`cpu_pipeline` is the whole
pipeline with a transform of the fused module in the middle (apply a tuning database), for
``tvm.compile(mod, target, relax_pipeline=...)``. :func:`unfused_pipeline` is the same for
``tvm.compile``'s own default pipeline, which legalizes without fusing (one kernel per op).
Both end with :func:`drop_unused_kernels`: ``RewriteDataflowReshape`` turns reshape kernels
into views and leaves the kernels behind, which LLVM would compile for nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax

__all__ = ["cpu_pipeline", "drop_unused_kernels", "fused", "unfused_pipeline"]


def _passes():
    # relax.pipeline.dataflow_lower_passes(llvm target) fails in 0.27 (the CPU backend
    # package does not re-export it): use the CPU backend's module directly
    from tvm.relax.backend.cpu_generic import pipeline

    return pipeline


def drop_unused_kernels(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` without the PrimFuncs that none of its Relax functions calls: after the
    dataflow lowering, the reshape kernels that became views. The code run is unchanged.

    >>> import tvm
    >>> from tvm import relax, te
    >>> bb = relax.BlockBuilder()
    >>> x = relax.Var("x", relax.TensorType([2, 3], "float32"))
    >>> with bb.function("main", [x]):
    ...     double = lambda a: te.compute(a.shape, lambda i, j: a[i, j] * 2)
    ...     y = bb.emit_te(double, x, primfunc_name_hint="double")
    ...     _ = bb.add_func(tvm.tirx.PrimFunc([], tvm.tirx.Evaluate(0)), "unused")
    ...     _ = bb.emit_func_output(y)
    >>> sorted(gv.name_hint for gv, _ in bb.get().functions_items())
    ['double', 'main', 'unused']
    >>> sorted(gv.name_hint for gv, _ in drop_unused_kernels(bb.get()).functions_items())
    ['double', 'main']
    """
    called: set[str] = set()

    def visit(node):
        if isinstance(node, tvm.ir.GlobalVar):
            called.add(node.name_hint)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, visit)
    items = mod.functions_items()
    keep = {gv: f for gv, f in items if not _unused(f, gv.name_hint, called)}
    if len(keep) == len(items):
        return mod
    return tvm.IRModule(keep, attrs=mod.attrs, global_infos=mod.global_infos)


def _unused(func, name: str, called: set[str]) -> bool:
    """Whether ``func`` is a PrimFunc that no Relax function calls (autoq's and TVM's
    kernels call no other PrimFunc: a Relax call is the only use of one)."""
    return isinstance(func, tvm.tirx.PrimFunc) and name not in called


def _fuse_passes(target) -> list:
    p = _passes()
    return p.library_dispatch_passes(target) + p.legalize_passes(target)


def fused(mod: tvm.IRModule, target) -> tvm.IRModule:
    """``mod`` lowered to fused TIR kernels, exactly as the default CPU pipeline fuses it."""
    with target:
        return tvm.transform.Sequential(_fuse_passes(target))(mod)


def cpu_pipeline(target, after_fusion: Callable[[tvm.IRModule], tvm.IRModule]):
    """The default CPU pipeline with ``after_fusion(fused module)`` applied between fusion
    and lowering (called inside ``with target``)."""

    @tvm.transform.module_pass(opt_level=0)
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        p = _passes()
        with target:
            mod = after_fusion(tvm.transform.Sequential(_fuse_passes(target))(mod))
            rest = p.dataflow_lower_passes(target) + p.finalize_passes(target)
            return drop_unused_kernels(tvm.transform.Sequential(rest)(mod))

    return _pipeline


def unfused_pipeline(
    target,
    after_legalize: Callable[[tvm.IRModule], tvm.IRModule],
    name: str = "_pipeline",
    legalize_map: dict | None = None,
):
    """``tvm.compile``'s default pipeline (``relax.pipeline.default_build_pipeline``: one
    kernel per op, no fusion) with ``after_legalize(module)`` applied once the ops are
    kernels. ``name``: the pass's name (``autoq.*`` names key the compile cache,
    :mod:`autoq.ir.compile_cache`: one name per ``after_legalize``); ``legalize_map``:
    ``LegalizeOps``' own legalization of some ops (e.g. :func:`autoq.ir.any_shape.legalize_map`)."""
    from tvm.relax import backend
    from tvm.relax import transform as T

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            mod = tvm.transform.Sequential(
                [
                    backend.DispatchSampling(),
                    backend.DispatchSortScan(),
                    T.LegalizeOps(legalize_map),
                ]
            )(mod)
            mod = after_legalize(mod)
            rest = [
                T.RewriteDataflowReshape(),
                T.ToNonDataflow(),
                T.RemovePurityChecking(),
                T.CallTIRRewrite(),
                T.StaticPlanBlockMemory(),
                T.RewriteCUDAGraph(),
                T.LowerAllocTensor(),
                T.KillAfterLastUse(),
                T.LowerRuntimeBuiltin(),
                T.ComputePrimValue(),
                T.VMShapeLower(),
                T.AttachGlobalSymbol(),
            ]
            return drop_unused_kernels(tvm.transform.Sequential(rest)(mod))

    return _pipeline
