"""autoq: post-training auto-quantization for Apache TVM Relax (simulate -> calibrate -> realize)."""

from . import primitives, qnn  # noqa: F401  (importing qnn registers the qnn.* ops)

__version__ = "0.1.0"
