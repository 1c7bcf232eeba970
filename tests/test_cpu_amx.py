"""autoq.cpu AMX path: the tile dense kernel against numpy int64 (where the CPU has AMX and
Linux grants the tile state; skipped with the reason otherwise), its selection from the
target's features, the default target's AMX ``mattr``, the permission error, and a realized
attention model compiled for an AMX target against the generic lowering, bit for bit."""

from __future__ import annotations

import doctest
import functools
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq import Config
from autoq.cpu import amx, amx_dense
from autoq.cpu.amx_dense import amx_dense_kernel
from autoq.cpu.isa import VNNI, kernel_isa
from autoq.cpu.lowering import lower_to_cpu_kernels
from autoq.cpu.packing import compensation, pack_dense_weight, round_up
from autoq.errors import PlatformError
from models import attention

HOST = tvm.target.codegen.llvm_get_system_cpu()
FLAGS = amx.cpu_flags(Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "")
_REASON = (
    "this CPU has no AMX int8 tiles (amx_tile/amx_int8 in /proc/cpuinfo)"
    if not {"amx_tile", "amx_int8"} <= FLAGS
    else f"Linux refuses the AMX tile state: {amx.request_amx()}"
)
needs_amx = pytest.mark.skipif(
    not {"amx_tile", "amx_int8"} <= FLAGS or amx.request_amx() is not None, reason=_REASON
)
AMX_TARGET = tvm.target.Target({"kind": "llvm", "mcpu": HOST, "mattr": ["+amx-tile", "+amx-int8"]})


def test_doctests():
    for module in (amx, amx_dense):
        assert doctest.testmod(module).failed == 0


def _dense(x: np.ndarray, w: np.ndarray, zx: int) -> np.ndarray:
    m, k = x.shape
    n = w.shape[0]
    shift = VNNI.shift(str(x.dtype), zx)
    np_ = round_up(n, amx_dense.BLOCK)
    lib = tvm.compile(
        tvm.IRModule({"main": amx_dense_kernel(m, k, n, str(x.dtype), shift)}), AMX_TARGET
    )
    args = [
        x,
        pack_dense_weight(w, 16, 4, "int8", np_, round_up(k, amx_dense.KSTEP)),
        compensation(w, zx + shift, np_),
    ]
    out = tvm.runtime.tensor(np.zeros((m, n), np.int32))
    lib["main"](*[tvm.runtime.tensor(a) for a in args], out)
    return out.numpy()


@needs_amx
@pytest.mark.parametrize(
    ("m", "k", "n", "dtype", "zx"),
    [
        (32, 64, 32, "int8", 0),  # one block, one step
        (128, 384, 96, "int8", -5),  # several blocks, tasks split over channel groups
        (37, 70, 19, "int8", 3),  # every dimension padded
        (9, 200, 50, "uint8", 128),  # uint8 activations: no shift, zx * sum(w) compensation
    ],
)
def test_amx_dense_matches_numpy(m, k, n, dtype, zx):
    rng = np.random.default_rng(m + k + n)
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max + 1, (m, k)).astype(dtype)
    w = rng.integers(-128, 128, (n, k)).astype(np.int8)
    ref = (x.astype(np.int64) - zx) @ w.astype(np.int64).T
    np.testing.assert_array_equal(_dense(x, w, zx), ref)


@needs_amx
def test_amx_dense_extreme_values():
    """All-extreme operands, K = 1536: the largest int32 sums (nothing saturates in tdpbusd)."""
    x = np.full((16, 1536), -128, np.int8)
    w = np.full((32, 1536), -128, np.int8)
    ref = (x.astype(np.int64) - 127) @ w.astype(np.int64).T
    np.testing.assert_array_equal(_dense(x, w, 127), ref)


def test_kernel_isa_from_target_features():
    assert kernel_isa(AMX_TARGET).amx
    assert kernel_isa(tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"})).amx
    assert not kernel_isa(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})).amx
    assert not kernel_isa(tvm.target.Target({"kind": "llvm", "mcpu": "haswell"})).amx


def test_default_target_keeps_host_cpu_and_adds_amx_when_usable():
    target = autoq.default_target()
    assert str(target.attrs["mcpu"]) == HOST
    usable = {"amx_tile", "amx_int8"} <= FLAGS and amx.request_amx() is None
    assert amx.target_has_amx(target) == usable
    attrs = [str(a) for a in target.attrs.get("mattr", [])]
    assert attrs == amx.missing_amx_features(HOST, FLAGS if usable else frozenset())


def test_refused_tile_state_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(amx, "request_amx", lambda: "arch_prctl(...) failed: nope (errno 22)")
    with pytest.raises(PlatformError, match=r"uses AMX tiles.*errno 22.*drop them from 'mattr'"):
        amx.require_amx(AMX_TARGET)
    amx.require_amx(tvm.target.Target({"kind": "llvm", "mcpu": "znver4"}))  # no AMX: fine


def test_dense_rows_choose_amx_or_vnni():
    """Lowering for an AMX target: dense with >= AMX_MIN_ROWS rows on tiles, fewer on VNNI;
    targets without the AMX features keep VNNI (nothing is run: works on any CPU)."""
    many, few = _quantized(8)[0], _quantized(4)[0]
    assert _lowered_names(many, AMX_TARGET) == {"autoq_dense_amx"}
    sapphire = tvm.target.Target({"kind": "llvm", "mcpu": "sapphirerapids"})
    assert _lowered_names(many, sapphire) == {"autoq_dense_amx"}
    znver4 = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})
    assert _lowered_names(many, znver4) == {"autoq_dense_vnni"}
    assert _lowered_names(few, AMX_TARGET) == {"autoq_dense_vnni"}


def _lowered_names(qmod, target):
    lowered = lower_to_cpu_kernels(qmod, target)
    names = (gv.name_hint for gv in lowered.functions)
    return {n.rstrip("0123456789") for n in names if n.startswith("autoq_dense")}


@functools.cache
def _quantized(seq: int):
    mod, params, data = attention(seq=seq, dim=40)
    return autoq.quantize(mod, params, data(8, 1), Config(progress=False)), data


@needs_amx
def test_realized_attention_same_outputs_on_amx():
    qmod, data = _quantized(20)
    assert _lowered_names(qmod, AMX_TARGET) == {"autoq_dense_amx"}
    outs = []
    for target, use in (
        (AMX_TARGET, True),
        (tvm.target.Target({"kind": "llvm", "mcpu": HOST}), False),
    ):
        vm = relax.VirtualMachine(autoq.compile(qmod, target, cpu_kernels=use), tvm.cpu())
        outs.append([vm["main"](tvm.runtime.tensor(x)).numpy() for x in data(3, 5)])
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)
