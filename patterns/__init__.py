"""Quantizable patterns: one module per pattern (modules starting with ``_`` are shared
helpers). Each module registers its pattern with :func:`autoq.ir.registry.register`; the
registry imports every module of this package, so adding a pattern is adding a file."""
