"""The compile cache (autoq.ir.compile_cache): a second quantization / export of the same model
compiles nothing; damaged entries are compiled again; results equal the uncached ones."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import autoq
from autoq.ir import compile_cache
from autoq.ir.library_file import check_library, stamp_path
from autoq.ir.toolkit import compile_vm
from models import TARGET, Runner, mlp, small_cnn


@pytest.fixture
def folder(tmp_path, monkeypatch):
    d = tmp_path / "compiled"
    monkeypatch.setenv(compile_cache.ENV, str(d))
    return d


def delta(before: dict) -> dict:
    now = compile_cache.counts()
    return {k: now[k] - before[k] for k in now}


#: another target: another entry
OTHER = tvm.target.Target({"kind": "llvm", "opt-level": 1})


def dense_vm(target=TARGET):
    """A VM of ``main(x, w) = x @ w.T`` through :func:`compile_vm`, and its numpy reference."""
    x = relax.Var("x", relax.TensorType([2, 8], "float32"))
    w = relax.Var("w", relax.TensorType([4, 8], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
        bb.emit_func_output(y)
    return compile_vm({"main": bb.get()["main"]}, target)


def check_dense(vm):
    rng = np.random.default_rng(0)
    x, w = rng.normal(size=(2, 8)).astype("f4"), rng.normal(size=(4, 8)).astype("f4")
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    np.testing.assert_allclose(got, x @ w.T, rtol=1e-5, atol=1e-5)


def test_miss_then_hit(folder):
    before = compile_cache.counts()
    check_dense(dense_vm())
    assert delta(before) == {"hits": 0, "misses": 1}
    (entry,) = folder.glob("*.so")
    assert stamp_path(entry).is_file()
    check_dense(dense_vm())
    assert delta(before) == {"hits": 1, "misses": 1}
    assert list(folder.glob("*.so")) == [entry]  # nothing new, no temporary left


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_stamp", "garbage"])
def test_damaged_entry_is_compiled_again(folder, damage):
    dense_vm()
    (entry,) = folder.glob("*.so")
    data = entry.read_bytes()
    bad = {
        "truncate": data[: len(data) // 2],
        "flip": data[:100] + bytes([data[100] ^ 0xFF]) + data[101:],  # only the stamp tells
        "garbage": b"not a library at all",
    }
    if damage == "no_stamp":  # an interrupted store
        stamp_path(entry).unlink()
    else:  # a new file in its place (this process still maps the loaded one)
        (folder / "new").write_bytes(bad[damage])
        (folder / "new").replace(entry)
    before = compile_cache.counts()
    check_dense(dense_vm())  # the right result, from a fresh compile
    assert delta(before) == {"hits": 0, "misses": 1}
    check_library(entry)  # stored again, complete, with its stamp


def test_off_and_unwritable(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, "off")
    before = compile_cache.counts()
    check_dense(dense_vm())
    assert compile_cache.cache_folder() is None and delta(before) == {"hits": 0, "misses": 0}
    check_dense(dense_vm())  # the module compiled last is reused in the process
    assert delta(before) == {"hits": 1, "misses": 0}
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv(compile_cache.ENV, str(blocker / "compiled"))  # cannot be created
    check_dense(dense_vm(OTHER))
    assert delta(before) == {"hits": 1, "misses": 0}
    assert list(tmp_path.rglob("*.so")) == []


def test_least_recently_used_entries_go(folder, monkeypatch):
    dense_vm()
    (old,) = folder.glob("*.so")
    monkeypatch.setattr(compile_cache, "LIMIT_BYTES", old.stat().st_size + 1)
    mod, params, data = mlp()
    autoq.export_library(autoq.quantize(mod, params, data(4), target=TARGET), folder / "x.so")
    assert not old.exists() and not stamp_path(old).exists()


def test_key_follows_module_target_and_kind():
    def bound(seed):  # the weights as constants of the module
        mod, params, _ = mlp(seed)
        return relax.transform.BindParams("main", params)(mod)

    mod = bound(0)
    key = compile_cache.cache_key(mod, TARGET, "k")
    assert key == compile_cache.cache_key(bound(0), TARGET, "k")  # rebuilt: the same
    assert key != compile_cache.cache_key(bound(1), TARGET, "k")  # other weights
    assert key != compile_cache.cache_key(mod, TARGET, "k2")
    assert key != compile_cache.cache_key(mod, {"kind": "llvm"}, "k")


def test_second_quantization_compiles_nothing(folder, tmp_path):
    """Quantize + export twice (the API, then the same model again): the second run only
    loads libraries; qparams and weights are the same bits, and the copied library computes
    what the realized module computes."""
    mod, params, data = small_cnn()
    runs = []
    for _ in range(2):
        before = compile_cache.counts()
        res = autoq.Quantizer(target=TARGET).run(mod, params, data(8))
        path = autoq.export_library(res.module, tmp_path / f"m{len(runs)}.so", target=TARGET)
        runs.append((res, path, delta(before)))
    (r1, p1, d1), (r2, p2, d2) = runs
    # one module for the guard and calibration (compiled, then a hit), the library
    assert d1 == {"hits": 1, "misses": 2}
    assert d2 == {"hits": 3, "misses": 0}
    assert r1.qparams.dumps() != "" and _qp_bits(r1) == _qp_bits(r2)
    x = data(1, seed=5)[0]
    want = Runner(r1.module, target=TARGET)(x)
    for p in (p1, p2):  # compiled, then copied from the cache
        np.testing.assert_array_equal(
            autoq.load_library(p)["main"](tvm.runtime.tensor(x)).numpy(), want
        )


def _qp_bits(res) -> list:
    """Every qparam and tuned integer weight of a result, as bytes."""
    out = []
    for s, qp in sorted(res.qparams.params.items()):
        out.append((s, np.asarray(qp.scale).tobytes(), np.asarray(qp.zero_point).tobytes()))
    for k, v in sorted(res.qparams.values.items()):
        out.append((k, np.asarray(v).tobytes()))
    return out


def test_guard_and_calibration_share_one_module(folder):
    """The guard's float graph is a function of the calibration module: it gives the values
    of the separate float graph, bit for bit, and calibration then compiles nothing."""
    from autoq import simulate
    from autoq.calibration import calibrate, fp32_slot_runner, samples_for

    mod, params, data = small_cnn()
    sim = simulate(mod, params, autoq.Config(recipe="cnn"))
    slots = sim.activation_slots()[::2]
    before = compile_cache.counts()
    two = samples_for(data(2), sim.graph.inputs)
    shared = list(fp32_slot_runner(sim, slots, TARGET, shared=True)(two))
    assert delta(before) == {"hits": 0, "misses": 1}
    alone = list(fp32_slot_runner(sim, slots, TARGET)(two))
    assert len(shared) == 2 and len(shared[0]) == len(slots) > 1
    for a, b in zip(shared, alone, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    before = compile_cache.counts()
    calibrate(sim, params, data(4), target=TARGET)
    assert delta(before) == {"hits": 1, "misses": 0}


def test_a_killed_stores_work_folder_goes_with_the_next_store(folder):
    folder.mkdir(parents=True)
    dead = folder / ".autoq-store-999999999-dead"  # (no such pid)
    dead.mkdir()
    (dead / "half.so").write_bytes(b"\x7fELF")
    check_dense(dense_vm())
    assert not dead.exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
