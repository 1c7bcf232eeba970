"""Hostile inputs through the API (issue 17): each one is autoq's own exception type
(:class:`autoq.errors.AutoqError`) with a message naming the slot, layer, input, weight,
file or option at fault, and nothing is written. The command-line half is
``test_bad_inputs_cli.py``. Models are tiny (tests/models.mlp, the CLI's 8x8 ONNX model);
most cases fail before anything is compiled."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import ClassVar

import numpy as np
import onnx
import pytest
from test_cli import tiny_onnx

import autoq
from autoq.errors import AutoqError, CalibratorError, DatasetError, InputError, QParamsError
from models import TARGET, mlp

MOD, PARAMS, DATA = mlp()
GOOD = DATA(3)

# ----------------------------------------------------------------------------- qparams files


def qparams_doc() -> dict:
    """A valid qparams document: one activation slot, one per-channel weight slot."""
    return {
        "format": "autoq.qparams",
        "version": 1,
        "meta": {},
        "slots": {
            "x": {"kind": "activation", "layer": "fc1", "op": "dense", "shape": [2, 16]},
            "fc1.weight": {
                "kind": "weight",
                "layer": "fc1",
                "op": "dense",
                "shape": [4, 16],
                "axis": 0,
            },
        },
        "qparams": {
            "x": {"dtype": "int8", "axis": None, "scale": 0.1, "zero_point": 0},
            "fc1.weight": {"dtype": "int8", "axis": 0, "scale": [0.1] * 4, "zero_point": [0] * 4},
        },
    }


QPARAMS_EDITS = {
    "zero point 3.5": ("x", "zero_point", 3.5, "zero_point must be integers"),
    "scale 0": ("x", "scale", 0.0, "scale must be positive and finite"),
    "negative scale": ("x", "scale", -1.0, "scale must be positive and finite"),
    "NaN scale": ("x", "scale", float("nan"), "scale must be positive and finite"),
    # issue 38, item 12b: a denormal scale loaded, then overflowed every value it divided
    "scale 1e-45": ("x", "scale", 1e-45, "scale must be at least 1.175e-38"),
    "one channel 1e-40": ("fc1.weight", "scale", [0.1, 0.1, 1e-40, 0.1], "at least 1.175e-38"),
    "text scale": ("x", "scale", "abc", "must be numbers"),
    "unknown dtype": ("x", "dtype", "int7", "unsupported quantized dtype 'int7'"),
    "zero point out of range": ("x", "zero_point", 200, "inside the int8 range"),
    "axis outside the tensor": ("fc1.weight", "axis", 5, "axis 5 does not exist"),
    "axis as text": ("fc1.weight", "axis", "0", "axis must be an integer"),
    "channel count": ("fc1.weight", "scale+zero_point", ([0.1] * 3, [0] * 3), "3 scale(s) for 4"),
    "zero point count": ("fc1.weight", "zero_point", [0, 0], "does not match scale shape"),
    "unknown field": ("x", "scal", 0.1, "unknown QParam fields ['scal']"),
    "missing scale": ("x", "scale", None, "missing field(s) ['scale']"),
}


@pytest.mark.parametrize("case", QPARAMS_EDITS)
def test_qparams_file(tmp_path, case):
    slot, key, value, needle = QPARAMS_EDITS[case]
    doc = qparams_doc()
    if value is None:
        del doc["qparams"][slot][key]
    elif "+" in key:
        for k, v in zip(key.split("+"), value, strict=True):
            doc["qparams"][slot][k] = v
    else:
        doc["qparams"][slot][key] = value
    path = tmp_path / "qparams.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(QParamsError) as e:
        autoq.load_qparams(path)
    msg = str(e.value)
    assert f"qparams slot {slot!r}" in msg and needle in msg and str(path) in msg


def test_qparams_slot_not_an_object(tmp_path):
    doc = qparams_doc()
    doc["qparams"]["x"] = [0.1, 0]
    (tmp_path / "q.json").write_text(json.dumps(doc))
    with pytest.raises(QParamsError, match=r"qparams slot 'x': expected an object"):
        autoq.load_qparams(tmp_path / "q.json")


def test_qparams_not_json(tmp_path):
    (tmp_path / "q.json").write_text("{not json")
    with pytest.raises(QParamsError, match=r"q.json' is not JSON"):
        autoq.load_qparams(tmp_path / "q.json")


def test_qparams_nested_100000_deep(tmp_path):
    """Issue 38, item 12b: Python's JSON parser raised RecursionError."""
    (tmp_path / "q.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(QParamsError, match=r"q.json': .* nested too deeply"):
        autoq.load_qparams(tmp_path / "q.json")
    with pytest.raises(ValueError, match="QParams JSON text is not a JSON document"):
        autoq.QParams.loads("{" + '"a": {' * 100_000 + "}" * 100_001)


def test_qdq_file_scale_1e_45_names_the_node(tmp_path):
    """A pre-quantized ONNX file with a denormal scale: an InputError naming the node and
    the scale's initializer (it was a bare ValueError naming neither)."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.array(1e-45, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "x_zp"),
        numpy_helper.from_array(np.ones((8, 4), np.float32), "w"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"], name="q_x"),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"], name="dq_x"),
        helper.make_node("MatMul", ["xd", "w"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], [y], inits), opset_imports=[helper.make_opsetid("", 17)]
    )
    onnx.save(model, tmp_path / "qdq.onnx")
    with pytest.raises(InputError, match=r"q_x \(QuantizeLinear\): scale 'x_scale' = \[1.4"):
        autoq.import_quantized(tmp_path / "qdq.onnx")


# ----------------------------------------------------------------------------- ONNX files


def _onnx_files(d):
    good = tiny_onnx(d / "tiny.onnx")
    data = good.read_bytes()
    (d / "truncated.onnx").write_bytes(data[: len(data) // 2])
    (d / "empty.onnx").write_bytes(b"")
    (d / "text.onnx").write_text("hello, not a model\n")
    model = onnx.load(str(good))
    onnx.save(model, str(d / "external.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="external.data", size_threshold=0)  # fmt: skip
    (d / "external.data").unlink()
    return d


ONNX_CASES = {
    "truncated.onnx": "is not an ONNX model",
    "empty.onnx": "is empty (0 bytes)",
    "text.onnx": "is not an ONNX model",
    "external.onnx": "external data file",
    "missing.onnx": "no ONNX file at",
}


@pytest.mark.parametrize("name", ONNX_CASES)
def test_from_onnx_file(tmp_path, name):
    _onnx_files(tmp_path)
    with pytest.raises(AutoqError) as e:
        autoq.from_onnx(tmp_path / name)
    assert name in str(e.value) and ONNX_CASES[name] in str(e.value)


# ----------------------------------------------------------------------------- datasets


_X = GOOD[0]
#: case -> (dataset, what the message must say)
DATASETS = {
    "wrong shape": ([np.zeros((3, 16), np.float32)], "input 'x': expected shape (2, 16)"),
    "wrong dtype": ([_X.astype(np.float64)], "expected dtype float32, got float64"),
    "NaN": ([_X, np.where(_X > 1, np.nan, _X).astype(np.float32)], "sample 1, input 'x': contains"),
    "Inf": ([np.where(_X > 1, np.inf, _X).astype(np.float32)], "Inf value(s)"),
    "unknown name": ([{"image": _X}], "unknown input name(s) ['image']"),
    "missing input": ([{}], "missing input(s) ['x']"),
    "not an array": ([[1, 2, 3]], "sample 0 is a list"),
    "empty list": ([], "empty"),
    "empty generator": ((s for s in []), "empty"),
    "a string": ("data.npz", "got str"),
}


@pytest.mark.parametrize("case", DATASETS)
def test_dataset(case, tmp_path):
    data, needle = DATASETS[case]
    cfg = autoq.Config(recipe="cnn")
    with pytest.raises(DatasetError, match=re.escape(needle)):
        autoq.Quantizer(cfg, target=TARGET, cache_dir=str(tmp_path / "cache")).run(
            MOD, PARAMS, data
        )
    assert not (tmp_path / "cache").exists()


def _npz_declaring(path, shape, dtype="<f4", data=bytes(64)):
    """An .npz whose member 'x' declares ``shape`` in its header but holds ``data``."""
    import io
    import zipfile

    from numpy.lib import format as npformat

    head = io.BytesIO()
    npformat.write_array_header_1_0(head, {"descr": dtype, "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.npy", head.getvalue() + data)
    return path


def test_npz_member_declaring_2_8_tib_is_refused_before_allocating(tmp_path):
    """Issue 38, item 12b: np.load tried to allocate the 2.8 TiB (MemoryError)."""
    path = _npz_declaring(tmp_path / "huge.npz", (750_000, 1024, 1024))
    with pytest.raises(DatasetError, match=r"member 'x' declares shape \(750000, 1024, 1024\) "
                       r"float32 \(2.9 TiB\) but holds 64 bytes"):  # fmt: skip
        autoq.dataset.from_npz(path)


def test_npz_larger_than_memory_is_refused_before_reading(tmp_path):
    from autoq.dataset.arrays import check_npz_sizes

    path = tmp_path / "calib.npz"
    np.savez(path, x=np.zeros((4, 2, 16), np.float32))
    check_npz_sizes(path)  # fits: no error; the same file against a 100-byte machine
    with pytest.raises(DatasetError, match="holds 512 bytes of arrays, more than this machine's"):
        check_npz_sizes(path, memory=100)
    assert len(autoq.dataset.from_npz(path)) == 4


# ----------------------------------------------------------------------------- layer rules


@pytest.mark.parametrize(
    ("rule", "needle"),
    [
        ({"ids": ("a" * 100_000,)}, "Fallback.ids: a rule of 100000 characters ('aaaa"),
        ({"patterns": ("[" * 100_000,)}, "Fallback.patterns: a rule of 100000 characters"),
        ({"op_types": ("d" * 2000,)}, "Fallback.op_types: a rule of 2000 characters"),
        ({"patterns": ("re:" + "(" * 510 + ")" * 510,)}, "nested too deeply"),
    ],
)
def test_overlong_fallback_rule(rule, needle):
    """Issue 38, item 12b: a 100,000-character glob of '[' took minutes to match, a deep
    regex raised RecursionError, a long id was echoed whole in a one-million-character line."""
    with pytest.raises(InputError) as e:
        autoq.Fallback(**rule)
    assert needle in str(e.value) and len(str(e.value)) < 400


def test_overlong_override_match():
    with pytest.raises(InputError, match="layer rule: a rule of 5000 characters"):
        autoq.Override("x" * 5000, activation=autoq.QuantSpec(calibrator="max"))


# ----------------------------------------------------------------------------- weights, config


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_named(value):
    params = dict(PARAMS)
    params["fc2.weight"] = params["fc2.weight"].copy()
    params["fc2.weight"][3, 5] = value
    with pytest.raises(InputError, match=r"weight 'fc2.weight' \(32, 32\).*index \[3, 5\]"):
        autoq.Quantizer(autoq.Config(recipe="cnn"), target=TARGET).run(MOD, params, GOOD)


def test_cache_dir_is_a_file(tmp_path):
    (tmp_path / "cache").write_text("mine")
    q = autoq.Quantizer(
        autoq.Config(recipe="cnn"),
        target=TARGET,
        cache_dir=str(tmp_path / "cache"),
        memory_budget_mb=0,
    )
    with pytest.raises(InputError, match=r"cache_dir .*cache' is a file"):
        q.run(MOD, PARAMS, GOOD)
    assert (tmp_path / "cache").read_text() == "mine"


CALIBRATORS = {
    "returns a number": (lambda x: 1.0, "returned 1.0"),
    "returns one value": (lambda x: (1.0,), "returned (1.0,)"),
    "returns NaN": (lambda x: (float("nan"), 1.0), "returned (nan, 1.0)"),
    "returns lo > hi": (lambda x: (2.0, 1.0), "returned (2.0, 1.0)"),
}


@pytest.mark.parametrize("case", CALIBRATORS)
def test_calibration_function_breaking_the_contract(case):
    fn, needle = CALIBRATORS[case]
    act = dataclasses.replace(autoq.Config(recipe="cnn").activation, calibrator=fn)
    cfg = autoq.Config(recipe="cnn", activation=act)
    with pytest.raises(CalibratorError, match=r"calibrator contract: a calibration function") as e:
        autoq.Quantizer(cfg, target=TARGET).run(MOD, PARAMS, GOOD)
    assert needle in str(e.value)


def test_calibrator_object_breaking_the_contract():
    with pytest.raises(CalibratorError, match=r"calibrator contract: a calibrator must be"):
        dataclasses.replace(autoq.Config(recipe="cnn").activation, calibrator=object())


class _TupleObserver:
    """Satisfies the observer protocol except that compute returns a tuple."""

    def update(self, x):
        pass

    def merge(self, other):
        pass

    def state(self):
        return {}

    def merge_state(self, state):
        pass

    def compute(self, spec):
        return (0.1, 0)


@dataclasses.dataclass(frozen=True)
class _Broken:
    name: ClassVar[str] = "broken"
    needs_range: ClassVar[bool] = False

    def observer(self, axis=None, data_range=None):
        return _TupleObserver()


def test_observer_returning_something_else():
    act = dataclasses.replace(autoq.Config(recipe="cnn").activation, calibrator=_Broken())
    cfg = autoq.Config(recipe="cnn", activation=act)
    with pytest.raises(CalibratorError, match=r"must return an autoq.QParam.*returned tuple"):
        autoq.Quantizer(cfg, target=TARGET).run(MOD, PARAMS, GOOD)
