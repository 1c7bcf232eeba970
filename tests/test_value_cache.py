"""autoq.calibration.value_cache: cached values come back as they went in, aligned for TVM so that a
VM input read from RAM is the cached memory itself (no copy), and from disk a copy."""

from __future__ import annotations

import numpy as np
import tvm

from autoq.calibration.value_cache import ALIGN, ValueCache, aligned_copy, as_tensor


def test_aligned_copy_of_tensors_and_arrays():
    rng = np.random.default_rng(0)
    values = [
        rng.normal(size=(2, 3, 5)).astype(np.float32),
        rng.integers(-128, 128, size=(7,)).astype(np.int8),
        np.asfortranarray(rng.normal(size=(4, 3))),  # not C-contiguous
        np.float32(2.5),
        np.zeros((0, 3), np.float32),
    ]
    for v in values + [tvm.runtime.tensor(np.ascontiguousarray(v)) for v in values]:
        ref = v.numpy() if hasattr(v, "numpy") else np.asarray(v)
        got = aligned_copy(v)
        assert got.dtype == ref.dtype and got.flags.c_contiguous
        np.testing.assert_array_equal(got, ref)
        if got.size:
            assert got.ctypes.data % ALIGN == 0
        np.testing.assert_array_equal(as_tensor(got).numpy(), ref)


def test_ram_values_reach_the_vm_without_a_copy_and_spilled_ones_with_one(tmp_path):
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    ram, disk = ValueCache(2**20), ValueCache(0, str(tmp_path))
    for cache in (ram, disk):
        cache.put("x", tvm.runtime.tensor(x))
        np.testing.assert_array_equal(cache.get_numpy("x"), x)
        np.testing.assert_array_equal(cache.get("x").numpy(), x)
    shared = np.from_dlpack(ram.get("x"))
    assert shared.ctypes.data == ram.get_numpy("x").ctypes.data
    assert np.from_dlpack(disk.get("x")).ctypes.data != disk.get_numpy("x").ctypes.data
    disk.close()
