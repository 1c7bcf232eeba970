"""Does the simulated graph predict the integer graph? Compare every quantized tensor.

Both stages name the binding that holds a slot's integers ``<slot>.q`` (the simulated
graph's ``qnn.simulated_quantize`` output, the realized graph's int8 tensor for that slot,
whatever op computes it after propagation). :func:`compare` runs both graphs with those
bindings as extra outputs and counts, per slot, the elements that differ and by how many
LSBs. In the default ``float`` rounding mode every count is 0 (while accumulators stay
below 2**24); the integer modes differ by 1 LSB at some elements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from autoq.ir.target import default_target
from autoq.ir.toolkit import with_main
from autoq.qparams import QParams
from autoq.simulation import SimResult

__all__ = ["FidelityReport", "compare", "expose_slots"]


@dataclass
class FidelityReport:
    """Per slot: elements compared, elements that differ, largest difference in LSBs."""

    elements: dict[str, int] = field(default_factory=dict)
    differing: dict[str, int] = field(default_factory=dict)
    max_lsb: dict[str, int] = field(default_factory=dict)

    @property
    def total_differing(self) -> int:
        return sum(self.differing.values())

    @property
    def exact(self) -> bool:
        return bool(self.elements) and self.total_differing == 0

    def table(self) -> str:
        rows = [f"{'slot':<40} {'elements':>10} {'differ':>8} {'max LSB':>8}"]
        for s in self.elements:
            rows.append(
                f"{s:<40} {self.elements[s]:>10} {self.differing[s]:>8} {self.max_lsb[s]:>8}"
            )
        return "\n".join(rows)


def expose_slots(
    mod: tvm.IRModule, slots: list[str], integer: bool
) -> tuple[tvm.IRModule, list[str]]:
    """``mod`` whose ``main`` also returns the ``<slot>.q`` bindings it has (in order)."""
    func = mod["main"]
    # binding names are sanitized ("." -> "_"); the last binding of a name holds the value
    by_name = {f"{s}.q".replace(".", "_"): s for s in slots}
    found: dict[str, relax.Var] = {}
    for block in func.body.blocks:
        for b in block.bindings:
            sid = by_name.get(b.var.name)
            if sid is not None and isinstance(b.var.ty, relax.TensorType):
                if (str(b.var.ty.dtype) != "float32") == integer:
                    found[sid] = b.var
    order = [s for s in slots if s in found]
    bb = relax.BlockBuilder()
    body = func.body
    blocks = list(body.blocks)
    last = blocks[-1]
    outs = [body.body] + [found[s] for s in order]
    new_bindings = list(last.bindings)
    tup_var = relax.Var("autoq_fidelity_out", relax.TupleType([o.ty for o in outs]))
    new_bindings.append(relax.VarBinding(tup_var, relax.Tuple(outs)))
    new_last = type(last)(new_bindings)
    new_body = relax.SeqExpr([*blocks[:-1], new_last], tup_var)
    new_func = relax.Function(func.params, bb.normalize(new_body), tup_var.ty, attrs=func.attrs)
    return with_main(mod, new_func), order


def _run_all(mod, feeds_list, target):
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
    for feeds in feeds_list:
        yield [o.numpy() for o in vm["main"](*feeds)]


def compare(
    sim: SimResult, realized: tvm.IRModule, qparams: QParams, samples: list[dict], target=None
) -> FidelityReport:
    """Per-slot differences between the realized graph and the calibrated simulated graph."""
    target = target or default_target()
    slots = list(sim.slots)
    sim_mod, sim_order = expose_slots(sim.mod, slots, integer=False)
    real_mod, real_order = expose_slots(realized, slots, integer=True)
    common = [s for s in real_order if s in sim_order]
    g = sim.graph
    weights = [tvm.runtime.tensor(np.ascontiguousarray(g.params[p.name])) for p in g.weight_params]
    values = sim.input_values(qparams)
    n_fixed = len(g.inputs) + len(g.weight_params)
    qargs = [tvm.runtime.tensor(values[p.name]) for p in sim.mod["main"].params[n_fixed:]]
    sim_feeds = [
        [tvm.runtime.tensor(s[v.name]) for v in g.inputs] + weights + qargs for s in samples
    ]
    real_feeds = [[tvm.runtime.tensor(s[v.name]) for v in g.inputs] for s in samples]
    rep = FidelityReport()
    for s in common:
        rep.elements[s] = rep.differing[s] = rep.max_lsb[s] = 0
    for sim_out, real_out in zip(
        _run_all(sim_mod, sim_feeds, target), _run_all(real_mod, real_feeds, target), strict=True
    ):
        sim_vals = dict(zip(sim_order, sim_out[1:], strict=True))
        real_vals = dict(zip(real_order, real_out[1:], strict=True))
        for s in common:
            a = real_vals[s].astype(np.int64)
            b = sim_vals[s].astype(np.int64)
            d = np.abs(a - b)
            rep.elements[s] += d.size
            rep.differing[s] += int(np.count_nonzero(d))
            rep.max_lsb[s] = max(rep.max_lsb[s], int(d.max(initial=0)))
    return rep
