"""Integer inputs are checked against the table they index before anything runs (issue 17,
item 5): token ids outside the embedding table were accepted (TVM's gather does not check;
a large id crashed the process)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
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
    assert index_bounds(mod["main"]) == {"ids": ("embed.weight", VOCAB)}
    (spec,) = input_specs(mod, params)
    assert spec.index == ("embed.weight", VOCAB)


@pytest.mark.parametrize("bad", [VOCAB, -1, 2**40])
def test_out_of_range_id_is_refused_before_any_work(bad, monkeypatch):
    mod, params = embedding_model()
    data = [np.array([[1, 2, 3, 4]], np.int64), np.array([[0, bad, 9, 1]], np.int64)]
    monkeypatch.setattr(autoq.pipeline, "simulate", lambda *a, **k: pytest.fail("ran"))
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
