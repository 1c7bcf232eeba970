"""Control flow: an ONNX ``If`` on an input the user fixes folds at import
(``constant_inputs``), a data-dependent one is a clear error, a Relax module with an ``If``
quantizes around it (the unbounded-activation guard no longer crashes) and builds, and
``quantize`` never returns a module that would not build (autoq.build.module_check)."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import autoq
from autoq.build.module_check import check_builds
from autoq.errors import BuildCheckError
from autoq.frontends import FrontendError
from models import Runner, run

ort = pytest.importorskip("onnxruntime")
X_SHAPE = (1, 3, 8, 8)


def if_model(data_dependent=False, seed=0):
    """``y = conv1x1_a(relu(conv(x))) * 2`` when ``sr == 16000`` (or, data-dependent, when
    ``mean(x) > 0``), else ``conv1x1_b(...) * 3``; each branch has its own weight."""
    rng = np.random.default_rng(seed)

    def init(name, shape):
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    def branch(name, factor):
        nodes = [
            helper.make_node("Conv", ["h", f"{name}.weight"], ["c"]),
            helper.make_node("Mul", ["c", factor], ["out"]),
        ]
        out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
        return helper.make_graph(nodes, name, [], [out], [init(f"{name}.weight", (4, 4, 1, 1))])

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, X_SHAPE)
    nodes = [
        helper.make_node("Conv", ["x", "conv.weight"], ["h0"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h0"], ["h"]),
    ]
    consts = [
        init("conv.weight", (4, 3, 3, 3)),
        numpy_helper.from_array(np.array(2, np.float32), "two"),
        numpy_helper.from_array(np.array(3, np.float32), "three"),
    ]
    if data_dependent:
        nodes += [
            helper.make_node("ReduceMean", ["x"], ["m"], keepdims=0),
            helper.make_node("Greater", ["m", "zero"], ["cond"]),
        ]
        consts.append(numpy_helper.from_array(np.array(0, np.float32), "zero"))
        inputs = [x]
    else:
        nodes.append(helper.make_node("Equal", ["sr", "k16"], ["cond"]))
        consts.append(numpy_helper.from_array(np.array(16000, np.int64), "k16"))
        inputs = [x, helper.make_tensor_value_info("sr", TensorProto.INT64, [])]
    nodes.append(
        helper.make_node(
            "If", ["cond"], ["y"], name="rate_branch",
            then_branch=branch("then", "two"), else_branch=branch("else", "three"),
        )
    )  # fmt: skip
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, (1, 4, 8, 8))
    graph = helper.make_graph(nodes, "if_model", inputs, [y], consts)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _data(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=X_SHAPE).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize("optimize", [True, False])
@pytest.mark.parametrize("sr", [16000, 8000])
def test_if_on_a_fixed_input_folds_at_import(sr, optimize):
    model = if_model()
    x = _data(1, 0)[0]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ref = sess.run(None, {"x": x, "sr": np.array(sr, np.int64)})[0]
    mod, params = autoq.from_onnx(model, constant_inputs={"sr": sr}, optimize=optimize)
    assert [p.name for p in mod["main"].params[:1]] == ["x"] and "sr" not in params
    assert "If" not in mod.script()
    np.testing.assert_allclose(run(mod, [x], params), ref, rtol=1e-5, atol=1e-5)
    # only the taken branch's weight is left
    assert any(k.startswith("then" if sr == 16000 else "else") for k in params)
    assert not any(k.startswith("else" if sr == 16000 else "then") for k in params)


def test_folded_model_quantizes_exports_and_runs(tmp_path):
    mod, params = autoq.from_onnx(if_model(), constant_inputs={"sr": 16000})
    q = autoq.quantize(mod, params, _data(8, 1))
    lib = autoq.export_library(q, tmp_path / "model.so")
    vm = autoq.load_library(lib)
    f = Runner(mod, params)
    for x in _data(3, 2):
        got = vm["main"](tvm.runtime.tensor(x)).numpy()
        ref = f(x)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


def test_data_dependent_if_is_a_clear_error():
    with pytest.raises(FrontendError, match=r"If node 'rate_branch'.*constant_inputs"):
        autoq.from_onnx(if_model(data_dependent=True))


def test_loop_is_a_clear_error():
    """A Loop (trip count from the data) is named with the fix, not an importer crash."""
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "x"], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2])],
    )  # fmt: skip
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], name="repeat", body=body)],
        "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("n", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(FrontendError, match=r"Loop node .repeat.*does not unroll Loop"):
        autoq.from_onnx(model)


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"rate": 16000}, r"'rate', which is not a data input.*'x', 'sr'"),
        ({"sr": [16000, 8000]}, r"constant_inputs\['sr'\] has shape \(2,\)"),
    ],
)
def test_bad_constant_inputs_name_the_input(bad, match):
    with pytest.raises(ValueError, match=match):
        autoq.from_onnx(if_model(), constant_inputs=bad)


def test_relax_if_quantizes_around_it_with_the_guard_on(tmp_path):
    """TVM's own importer keeps a data-dependent If as a Relax ``If``: the guard used to
    crash on it (``Var ... is not defined``) and, with the guard off, quantize returned a
    module export_library could not build. The If now runs as one fp32 function."""
    from tvm.relax.frontend.onnx import from_onnx as tvm_from_onnx

    mod = tvm_from_onnx(if_model(data_dependent=True), keep_params_in_input=False)
    q = autoq.quantize(mod, None, _data(8, 1), config=autoq.Config(skip_unbounded=True))
    assert '"qnn.conv2d"' in q.script()
    vm = autoq.load_library(autoq.export_library(q, tmp_path / "if.so"))
    f = Runner(mod)
    for x in [*_data(2, 2), -np.abs(_data(1, 3)[0])]:  # both branches taken
        got, ref = vm["main"](tvm.runtime.tensor(x)).numpy(), f(x)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.05


def test_a_module_that_would_not_build_is_refused_naming_the_binding():
    x = relax.Var("x", relax.TensorType((2, 2), "float32"))
    ghost = relax.Var("ghost", relax.TensorType((2, 2), "float32"))
    y = relax.Var("lv_add", relax.TensorType((2, 2), "float32"))
    body = relax.SeqExpr([relax.BindingBlock([relax.VarBinding(y, relax.op.add(x, ghost))])], y)
    mod = tvm.IRModule({"main": relax.Function([x], body, y.ty)})
    with pytest.raises(BuildCheckError, match=r"'main'.*binding 'lv_add' \(add\) reads 'ghost'"):
        check_builds(mod)
    with pytest.raises(Exception, match="ghost"):  # what the check spares the user
        tvm.compile(mod, "llvm")


def test_cli_constant_input_and_its_errors(tmp_path, capsys):
    from autoq import cli

    path = tmp_path / "if.onnx"
    onnx.save(if_model(), str(path))
    np.savez(tmp_path / "calib.npz", x=np.stack(_data(4, 1))[:, 0])
    base = ["quantize", str(path), "--calib", str(tmp_path / "calib.npz"), "--no-progress"]
    code = cli.main([*base, "--out", str(tmp_path / "out"), "--constant-input", "sr=16000"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "model.so").is_file()
    capsys.readouterr()
    # without it the If is data-dependent: one line naming the node and the CLI fix
    code = cli.main([*base, "--out", str(tmp_path / "out2")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "rate_branch" in err[0], err
    assert "--constant-input NAME=VALUE" in err[0] and "constant_inputs" not in err[0], err
