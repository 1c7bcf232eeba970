"""A worked BYOC backend for autoq's int8 modules: a pretend NPU (see docs/byoc.md).

* :mod:`.codegen` registers the external codegen ``relax.ext.autoq_npu`` (TVM's BYOC entry
  point that ``relax.transform.RunCodegen`` calls) and compiles each offloaded region;
* :mod:`.partition` partitions with ``autoq.byoc.pattern_table("autoq_npu")`` and
  ``MergeCompositeFunctions``, builds, and reports what stayed on the host.

Usage::

    import npu_backend                       # registers relax.ext.autoq_npu
    ex = npu_backend.build(int8_mod, target)
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](x)
"""

from .codegen import CODEGEN, codegen, lower_region
from .partition import build, host_ops, partition

__all__ = ["CODEGEN", "build", "codegen", "host_ops", "lower_region", "partition"]
