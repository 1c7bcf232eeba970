"""The pretend NPU's code generator, registered as TVM's external codegen ``relax.ext.autoq_npu``.

``relax.transform.RunCodegen`` collects every function that ``MergeCompositeFunctions``
marked ``Codegen="autoq_npu"`` and calls the registered global function
``relax.ext.autoq_npu(functions, options, constant_names)``; it must return one runtime
module per function that exports the function's ``global_symbol`` as a packed function
with TVM's destination-passing convention (inputs, then the output buffer). The VM calls
it through ``R.call_dps_packed``.

This "NPU" compiles each offloaded region to **one** TIR kernel:

1. the composite functions (one per autoq layer) are inlined into one dataflow function;
2. ``LegalizeOps`` lowers each ``qnn.*`` / Relax op to a TIR PrimFunc (autoq registers the
   legalizations of its qnn ops);
3. ``FuseTIR`` fuses the whole region into a single PrimFunc (intermediates become local
   buffers: what an NPU's on-chip memory would hold);
4. ``tvm.tirx.build`` compiles it for the host CPU, named after the region's symbol.

A real vendor replaces steps 2-4 with its own compiler (read the composite names,
``Composite="autoq_npu.conv2d_bias_requantize"``, and their constant arguments) and returns
its runtime module. The partition uses ``bind_constants=False``: weights, biases, tables
and qparams reach the kernel as arguments of the call (TIR kernels cannot hold tensor
constants); a JSON-runtime backend would bind them and read them from
``constant_names`` instead.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax

from autoq.ir.toolkit import bindings, remap_expr

__all__ = ["CODEGEN", "codegen", "lower_region"]

#: the codegen name: the prefix of every pattern name (``autoq_npu.<shape>``)
CODEGEN = "autoq_npu"


def _emit_inlined(bb: relax.BlockBuilder, func: relax.Function, args) -> relax.Expr:
    """Emit ``func``'s bindings with its parameters bound to ``args``, calls of local
    (composite) functions inlined; returns the result expression."""
    vmap = dict(zip(func.params, args, strict=True))
    local: dict = {}
    for var, value in bindings(func):
        if isinstance(value, relax.Function):
            local[var] = value
        elif isinstance(value, tvm.ir.Call) and value.op in local:
            inner = [remap_expr(a, vmap) for a in value.args]
            vmap[var] = _emit_inlined(bb, local[value.op], inner)
        else:
            vmap[var] = bb.emit(remap_expr(value, vmap), name_hint=var.name)
    return remap_expr(func.body.body, vmap)


def lower_region(func: relax.Function, symbol: str, target) -> tvm.runtime.Module:
    """One offloaded region -> a runtime module exporting ``symbol`` (see the module doc)."""
    bb = relax.BlockBuilder()
    params = [relax.Var(p.name, p.ty) for p in func.params]
    with bb.function("region", params, {"Primitive": True}):
        with bb.dataflow():
            out = bb.emit_output(_emit_inlined(bb, func, params))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    # FuseTIR fuses the Primitive functions a caller calls: give it one caller
    bb = relax.BlockBuilder(mod)
    params = [relax.Var(p.name, p.ty) for p in func.params]
    with bb.function("caller", params):
        bb.emit_func_output(bb.emit(relax.Call(mod.get_global_var("region"), params)))
    fused = relax.transform.FuseTIR()(bb.get())
    kernels = [f for _, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    if len(kernels) != 1:
        raise RuntimeError(f"{symbol}: expected one fused kernel, got {len(kernels)}")
    kernel = kernels[0].with_attr("global_symbol", symbol)
    return tvm.tirx.build(tvm.IRModule({symbol: kernel}), target=target)


@tvm_ffi.register_global_func(f"relax.ext.{CODEGEN}", override=True)
def codegen(functions, options, constant_names) -> list:
    """The external codegen entry point ``RunCodegen`` calls (module doc). ``options``:
    ``RunCodegen(target_options={"autoq_npu": {"target": <tvm.target.Target>}})``
    (default: LLVM for this CPU)."""
    opts = dict(options or {})
    target = opts.get("target") or tvm.target.Target(
        {"kind": "llvm", "mcpu": tvm.target.codegen.llvm_get_system_cpu()}
    )
    return [lower_region(f, str(f.attrs["global_symbol"]), target) for f in functions]
