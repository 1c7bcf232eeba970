"""Integer inputs are checked against the table they index before anything runs (issue 17,
item 5): token ids outside the embedding table were accepted (TVM's gather does not check;
a large id crashed the process). Issue 38, item 7: an ONNX Gather's ids pass TVM's
negative-index wrap (``where(less(x, 0), add(x, n), x)``) first, which hid them from the
check: id 10,000,000 segfaulted the API and the CLI, id 1000 on a 100-row table passed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from test_cli import assert_user_error, run
from tvm import relax

import autoq
from autoq.dataset import as_dataset, index_bounds, input_specs
from models import TARGET

VOCAB, DIM = 10, 8


def embedding_model():
    """ids (1, 4) int64 -> reshape -> take(embed.weight (10, 8)) -> matmul fc.weight."""
    rng = np.random.default_rng(0)
    params = {
        "embed.weight": rng.normal(size=(VOCAB, DIM)).astype(np.float32),
        "fc.weight": rng.normal(size=(DIM, 3)).astype(np.float32) * 0.3,
    }
    ids = relax.Var("ids", relax.TensorType((1, 4), "int64"))
    emb = relax.Var("embed.weight", relax.TensorType((VOCAB, DIM), "float32"))
    fc = relax.Var("fc.weight", relax.TensorType((DIM, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [ids, emb, fc]):
        with bb.dataflow():
            flat = bb.emit(relax.op.reshape(ids, (4,)))
            e = bb.emit(relax.op.take(emb, flat, axis=0))
            out = bb.emit_output(relax.op.matmul(e, fc))
        bb.emit_func_output(out)
    return bb.get(), params


def test_bounds_found_through_a_reshape():
    mod, params = embedding_model()
    assert index_bounds(mod["main"]) == {"ids": ("embed.weight", 0, VOCAB)}
    (spec,) = input_specs(mod, params)
    assert spec.index == ("embed.weight", 0, VOCAB)


@pytest.mark.parametrize("bad", [VOCAB, -1, 2**40])
def test_out_of_range_id_is_refused_before_any_work(bad, monkeypatch):
    mod, params = embedding_model()
    data = [np.array([[1, 2, 3, 4]], np.int64), np.array([[0, bad, 9, 1]], np.int64)]
    monkeypatch.setattr("autoq.pipeline.simulate", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(autoq.DatasetError) as e:
        autoq.Quantizer(autoq.Config(recipe="cnn"), target=TARGET).run(mod, params, data)
    msg = str(e.value)
    assert "sample 1, input 'ids'" in msg and "'embed.weight' of 10 rows" in msg
    assert f"[0, {VOCAB})" in msg


def test_in_range_ids_quantize_and_run():
    mod, params = embedding_model()
    data = [np.array([[i % VOCAB, 1, 2, 9]], np.int64) for i in range(6)]
    ds = as_dataset(data, input_specs(mod, params))
    assert ds.num_samples == 6
    r = autoq.Quantizer(autoq.Config(recipe="cnn"), target=TARGET).run(mod, params, data)
    vm = relax.VirtualMachine(tvm.compile(r.module, TARGET), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(data[0])).numpy()
    want = params["embed.weight"][data[0].reshape(-1)] @ params["fc.weight"]
    np.testing.assert_allclose(got, want, atol=0.1 * np.abs(want).max())


ROWS = 100


@pytest.fixture(scope="module")
def gather_onnx(tmp_path_factory):
    """ids (1, 8) int64 -> Gather(emb (100, 16)) -> MatMul (16, 4); calibration files with
    ids in range, one id 1000 and one id 10,000,000 (sample 3)."""
    d = tmp_path_factory.mktemp("gather")
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=(ROWS, 16)).astype(np.float32), "emb"),
        numpy_helper.from_array(rng.normal(size=(16, 4)).astype(np.float32), "w"),
    ]
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"], axis=0),
        helper.make_node("MatMul", ["e", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "gather",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 4])],
        inits,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), d / "m.onnx")
    ids = rng.integers(0, ROWS, size=(6, 1, 8)).astype(np.int64)
    for bad in (1000, 10_000_000):
        b = ids.copy()
        b[3, 0, 2] = bad
        np.savez(d / f"ids_{bad}.npz", ids=b)
    return d


def test_onnx_gather_ids_are_checked_with_the_negative_wrap(gather_onnx):
    mod, params = autoq.from_onnx(gather_onnx / "m.onnx")
    assert index_bounds(mod["main"]) == {"ids": ("emb", -ROWS, ROWS)}
    (spec,) = input_specs(mod, params)
    # ONNX Gather counts negative ids from the end: -100 is row 0, -101 is outside
    assert as_dataset([np.full((1, 8), -ROWS, np.int64)], [spec]).num_samples == 1
    for bad in (-ROWS - 1, ROWS, 10_000_000):
        with pytest.raises(autoq.DatasetError, match=rf"outside \[-{ROWS}, {ROWS}\)"):
            as_dataset([np.full((1, 8), bad, np.int64)], [spec])


def test_onnx_gather_out_of_range_id_is_an_error_in_the_api(gather_onnx):
    mod, params = autoq.from_onnx(gather_onnx / "m.onnx")
    data = np.load(gather_onnx / "ids_10000000.npz")["ids"]
    with pytest.raises(autoq.DatasetError, match=r"sample 3, input 'ids'.*'emb' of 100 rows"):
        autoq.quantize(mod, params, list(data), target=TARGET)


def test_cli_refuses_id_1000_on_a_100_row_table(gather_onnx, tmp_path, capsys):
    argv = ["quantize", gather_onnx / "m.onnx", "--calib", gather_onnx / "ids_1000.npz"]
    code, _, err = run(capsys, *argv, "--out", tmp_path / "out", "--no-progress")
    assert_user_error(code, err, "ids_1000.npz", "sample 3, input 'ids'", "1000", "'emb'")
    assert not (tmp_path / "out").exists()


def test_cli_process_survives_id_ten_million(gather_onnx, tmp_path):
    """In a real process: the id used to segfault it (exit -11)."""
    argv = ["quantize", str(gather_onnx / "m.onnx"), "--out", str(tmp_path / "out")]
    argv += ["--calib", str(gather_onnx / "ids_10000000.npz"), "--no-progress"]
    exe = Path(sys.executable).with_name("autoq")
    r = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert lines[-1].startswith("autoq: error: ") and "10000000" in lines[-1], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()
