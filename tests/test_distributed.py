"""Distributed calibration on a Dask LocalCluster (issue 18): the qparams are the same bit for
bit as in-process calibration (the reference: ``autoq.calibration``, itself checked against
numpy in test_calibrate.py) for every calibrator, both calibration modes and any number of
shards; worker-side sources are never read by the coordinator; a killed worker fails the run
with an error naming its shard.

One cluster of 2 worker processes for the module (starting it takes a few seconds). "1
worker" runs use one shard, which lives on one worker.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip(
    "distributed", reason="dask[distributed] is not installed (pip install 'autoq[dask]')"
)

import autoq
from autoq import (
    BiasCorrection,
    Config,
    Distributed,
    QParams,
    QuantSpec,
    Resources,
    calibrate,
    simulate,
)
from autoq.calibrators.kl import KL
from autoq.calibrators.mse import MSE
from autoq.calibrators.percentile import Percentile
from autoq.dataset import CallableShards, DatasetError, NpzShards
from autoq.distributed import ShardLostError, calibrate_distributed
from models import TARGET, ln_block, ln_block_data, mlp, small_cnn

COORDINATOR = "AUTOQ_TEST_COORDINATOR_PID"
os.environ.setdefault(COORDINATOR, str(os.getpid()))

# small histograms keep the searches fast; the merge is exact for any bin count
CALIBRATORS = {
    "max": "max",
    "moving_average": "moving_average",
    "percentile": Percentile(99.9, bins=256),
    "kl": KL(bins=512),
    "mse": MSE(bins=256),
}


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    os.environ[COORDINATOR] = str(os.getpid())  # inherited by the workers
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
    ) as cluster, Client(cluster) as c:  # fmt: skip
        c.wait_for_workers(2)
        yield c


@pytest.fixture(scope="module")
def model():
    mod, params, make = small_cnn()
    return mod, params, make(7)  # 7 samples: uneven shards


def bits(q) -> tuple:
    arrays = (q.scale, q.zero_point, q.rmin, q.rmax)
    return (q.dtype, q.axis, *(None if a is None else (a.dtype.str, a.tobytes()) for a in arrays))


def assert_identical(a: QParams, b: QParams) -> None:
    assert list(a.params) == list(b.params)
    for sid in a.params:
        assert bits(a[sid]) == bits(b[sid]), sid
    assert a.meta["samples"] == b.meta["samples"]


def config(calibrator, mode="topological", **kw) -> Config:
    act = QuantSpec(calibrator=calibrator)
    return Config(recipe="cnn", activation=act, calibration=mode, skip_unbounded=False, **kw)


@pytest.mark.parametrize("mode", ["topological", "fp32"])
@pytest.mark.parametrize("name", list(CALIBRATORS))
def test_same_qparams_as_in_process(client, model, name, mode):
    mod, params, data = model
    cfg = config(CALIBRATORS[name], mode)
    sim = simulate(mod, params, cfg)
    want = calibrate(sim, params, data, cfg, target=TARGET)
    got = calibrate_distributed(sim, data, cfg, TARGET, client, shards=2)
    assert got.meta["stats"]["shards"] == 2
    assert_identical(want, got)
    # the activations really were calibrated from data (not defaults): distinct scales
    acts = [float(want[s].scale) for s in sim.activation_slots()]
    assert len(set(acts)) == len(acts)


@pytest.mark.parametrize("shards", [1, 3])
def test_any_number_of_shards(client, model, shards):
    """1 shard (one worker does everything) and 3 shards on 2 workers: still identical."""
    mod, params, data = model
    cfg = config(CALIBRATORS["kl"])
    sim = simulate(mod, params, cfg)
    want = calibrate(sim, params, data, cfg, target=TARGET)
    got = calibrate_distributed(sim, data, cfg, TARGET, client, shards=shards)
    assert got.meta["stats"]["shards"] == shards
    assert_identical(want, got)


def shard_of_seven(i: int, n: int):
    """Shard ``i`` of the model fixture's 7 samples; refuses to run in the coordinator."""
    if str(os.getpid()) == os.environ[COORDINATOR]:
        raise AssertionError("the coordinator read the dataset")
    return small_cnn()[2](7)[i::n]


def test_quantize_with_worker_side_sources(client, model, tmp_path):
    """autoq.quantize(cluster=...) with a callable source the coordinator must never call,
    and with .npz shards on a shared path: the in-process qparams."""
    mod, params, data = model
    cfg = config("mse")
    want = autoq.Quantizer(cfg, target=TARGET).run(mod, params, data).qparams
    out = autoq.quantize(mod, params, CallableShards(shard_of_seven), cfg, TARGET, cluster=client)
    assert_identical(want, QParams.loads(out.attrs["autoq.qparams"]))
    for k in range(3):  # files of 3, 2 and 2 samples
        part = np.concatenate(data[k::3])
        np.savez(tmp_path / f"part{k}.npz", x=part)
    source = NpzShards(str(tmp_path / "*.npz"))
    got = autoq.Quantizer(cfg, target=TARGET, cluster=client).run(mod, params, source)
    assert got.samples == 7
    # the samples arrive in another order (by file): the merged statistics do not care
    assert_identical(want, got.qparams)


def ln_shard(i: int, n: int):
    """Shard ``i`` of 7 LayerNorm-block samples; refuses to run in the coordinator."""
    if str(os.getpid()) == os.environ[COORDINATOR]:
        raise AssertionError("the coordinator read the dataset")
    return ln_block_data(7, 3)[i::n]


def test_smooth_quant_on_a_cluster(client):
    """SmoothQuant measures its channel maxima in this process and the workers quantize the
    rewritten model: the in-process qparams and report. With a source only the workers read
    it is skipped with a SmoothQuantSkipped warning: the qparams of smooth_quant=None."""
    mod, params, make = ln_block()
    data = make(7, 3)
    cfg = Config(recipe="cnn", skip_unbounded=False, check_scales=False, smooth_quant=0.5)
    want = autoq.Quantizer(cfg, target=TARGET, report=True).run(mod, params, data)
    got = autoq.Quantizer(cfg, target=TARGET, report=True, cluster=client).run(mod, params, data)
    assert len(got.smoothed) == 2 and got.smoothed == want.smoothed
    assert_identical(want.qparams, got.qparams)
    a, b = want.report.to_json(), got.report.to_json()
    a.pop("meta"), b.pop("meta")
    assert a == b
    source = CallableShards(ln_shard)
    with pytest.warns(autoq.SmoothQuantSkipped, match="read only by the workers"):
        skipped = autoq.Quantizer(cfg, target=TARGET, cluster=client).run(mod, params, source)
    assert skipped.smoothed == ()
    plain = autoq.Quantizer(cfg.replace(smooth_quant=None), target=TARGET).run(mod, params, data)
    assert_identical(plain.qparams, skipped.qparams)


def test_report_fans_out(client, model):
    """Quantizer(report=True) on the cluster: the per-layer analysis' samples run on the
    workers and the report is the in-process one (same sums added in the same order)."""
    mod, params, data = model
    cfg = config("percentile")
    want = autoq.Quantizer(cfg, target=TARGET, report=True).run(mod, params, data).report
    got = autoq.Quantizer(cfg, target=TARGET, report=True, cluster=client).run(mod, params, data)
    a, b = want.to_json(), got.report.to_json()
    a.pop("meta"), b.pop("meta")
    assert a == b
    assert got.report.samples == 7 and np.isfinite(got.report.output_sqnr)


def test_auto_fallback_trials_fan_out(client, model):
    """AutoFallback (2 held-out samples) on the cluster: the report and every SQNR trial
    computed from the workers' sums (over the calibration part) give the in-process
    decision, trial for trial."""
    mod, params, data = model
    fb = autoq.AutoFallback(min_sqnr=60.0, max_fp32_layers=2, holdout=2)  # unreachable
    cfg = config("max").replace(fallback=fb)
    with pytest.warns(UserWarning, match="not reached"):
        want = autoq.Quantizer(cfg, target=TARGET).run(mod, params, data).decision
    with pytest.warns(UserWarning, match="not reached"):
        got = autoq.Quantizer(cfg, target=TARGET, cluster=client).run(mod, params, data).decision
    assert [t["metric"] for t in got.trials] == [t["metric"] for t in want.trials]
    assert len(want.trials) >= 3 and got.layers == want.layers and not got.met
    # the held-out check ran on the same samples (the coordinator's), with the same verdicts
    assert [t.get("kept") for t in got.trials] == [t.get("kept") for t in want.trials]
    assert any("kept" in t for t in want.trials)


def test_report_and_auto_fallback_from_a_worker_side_source(client, model):
    """AutoFallback + report with a source only the workers read: the decision, trial for
    trial, and the report of in-process runs over the samples in shard order (shard 1's
    samples, then shard 2's); the options that need the samples here are refused."""
    mod, params, data = model
    fb = autoq.AutoFallback(min_sqnr=60.0, max_fp32_layers=1)  # unreachable: the search runs
    cfg = config("max").replace(fallback=fb)
    with pytest.warns(UserWarning, match="not reached"):
        want = autoq.Quantizer(cfg, target=TARGET, report=True).run(
            mod, params, data[0::2] + data[1::2]
        )
    q = autoq.Quantizer(cfg, target=TARGET, report=True, cluster=client)
    with pytest.warns(UserWarning, match="not reached"):
        got = q.run(mod, params, CallableShards(shard_of_seven))
    assert [t["metric"] for t in got.decision.trials] == [t["metric"] for t in want.decision.trials]
    assert len(want.decision.trials) == 2 and got.decision.layers == want.decision.layers
    a, b = want.report.to_json(), got.report.to_json()
    a.pop("meta"), b.pop("meta")
    assert a == b and got.report.samples == 7
    with pytest.raises(ValueError, match=r"samples .* are read by the workers"):
        got.analysis.run()
    for bad in (dict(precision="int16"), dict(holdout=2)):
        q = autoq.Quantizer(cfg.replace(fallback=replace(fb, **bad)), target=TARGET, cluster=client)
        with pytest.raises(ValueError, match=r"AutoFallback\((precision|holdout).*give the data"):
            q.run(mod, params, CallableShards(shard_of_seven))


def bad_second_shard(i: int, n: int):
    data = small_cnn()[2](4)
    return data if i == 0 else [np.zeros((1, 3, 8, 8), np.float32)]


def test_bad_data_in_a_shard_names_it(client, model, tmp_path):
    mod, params, _ = model
    cfg = config("max")
    sim = simulate(mod, params, cfg)
    with pytest.raises(DatasetError, match=r"shard 2/2 of CallableShards.*shape"):
        calibrate_distributed(sim, CallableShards(bad_second_shard), cfg, TARGET, client)
    # an error of the worker's own code (a missing file) is not a lost worker
    missing = NpzShards([str(tmp_path / "a.npz"), str(tmp_path / "b.npz")])
    np.savez(tmp_path / "a.npz", x=small_cnn()[2](2)[0])
    with pytest.raises(FileNotFoundError, match=r"b\.npz"):
        calibrate_distributed(sim, missing, cfg, TARGET, client)


def test_shard_sources_split_the_data(tmp_path):
    """Every sample in exactly one shard, in the documented i, i + n, ... order."""
    pil = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    from autoq.dataset import ImageFolderShards, from_image_folder

    for k in range(5):
        pil.fromarray(np.full((6, 6, 3), 40 * k, np.uint8)).save(tmp_path / f"im{k}.png")
    source = ImageFolderShards(str(tmp_path), {"size": 4})
    whole = [float(x.mean()) for x in from_image_folder(tmp_path, size=4)]
    parts = [[float(x.mean()) for x in source.shard(i, 2)] for i in range(2)]
    assert parts == [whole[0::2], whole[1::2]]
    with pytest.raises(DatasetError, match="no file matches"):
        NpzShards(str(tmp_path / "*.npz"))


TUNING = {
    "gptq": {"weight_rounding": "gptq"},
    "ebc": {"bias_correction": BiasCorrection()},
    "gptq_ebc": {"weight_rounding": "gptq", "bias_correction": BiasCorrection()},
    "ebc_gated": {"bias_correction": BiasCorrection(holdout=2)},
}


@pytest.mark.parametrize(
    ("name", "shards"), [("gptq", 3), ("gptq_ebc", 2), ("ebc", 2), ("ebc_gated", 3)]
)
def test_weight_tuning_gives_the_in_process_weights(client, model, name, shards):
    """GPTQ on the shards' merged (exact) Hessians, empirical bias correction on their fp32 sums added in dataset order, its held-out gate
    on a held-out shard: the same weight scales, activation qparams and tuned integers
    (QParams.values), the same gate decisions."""
    mod, params, data = model
    cfg = config("max", **TUNING[name])
    sim = simulate(mod, params, cfg)
    want = calibrate(sim, params, data, cfg, target=TARGET)
    got = calibrate_distributed(sim, data, cfg, TARGET, client, shards=shards)
    assert_identical(want, got)
    tuned = want.meta["weight_tuning"]
    if name.startswith("gptq"):
        assert tuned["gptq"] >= 3, tuned  # the layers with enough rows were really rounded
    if name != "gptq":
        assert tuned["bias_corrected"] >= 3 - (name == "ebc_gated"), tuned
    if name == "ebc_gated":
        assert tuned["bias_kept"] >= 1 and got.meta["stats"]["held_out_samples"] == 2, tuned
    timings = [k for k in tuned if k.endswith("_s")]
    assert {k: v for k, v in got.meta["weight_tuning"].items() if k not in timings} == {
        k: v for k, v in tuned.items() if k not in timings
    }
    assert want.values and list(got.values) == list(want.values)
    for k, v in want.values.items():
        assert got.values[k].dtype == v.dtype and got.values[k].tobytes() == v.tobytes(), k


def test_bias_correction_holdout_refuses_a_worker_side_source(client, model):
    mod, params, _ = model
    cfg = config("max", bias_correction=BiasCorrection(holdout=2))
    sim = simulate(mod, params, cfg)
    with pytest.raises(ValueError, match="holdout=2 needs the samples streamed"):
        calibrate_distributed(sim, CallableShards(shard_of_seven), cfg, TARGET, client)


def test_in_process_runs_never_import_dask():
    import subprocess
    import sys

    code = (
        "import sys; sys.path.insert(0, 'tests'); import autoq; from models import mlp\n"
        "mod, params, make = mlp()\n"
        "autoq.quantize(mod, params, make(2), autoq.Config())\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')]"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=600)


def test_config_and_cli(tmp_path):
    dist = Distributed(scheduler="tcp://127.0.0.1:8786", shards=4, retries=2)
    assert Distributed.from_json(dist.to_json()) == dist
    with pytest.raises(ValueError, match="retries must be an int >= 0"):
        Distributed(workers=1, retries=-1)
    with pytest.raises(ValueError, match="exactly one of scheduler"):
        Distributed()
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        Distributed(workers=0)
    from autoq.cli import _resources
    from autoq.cli.args import build_parser

    args = build_parser().parse_args(["quantize", "m.onnx", "--calib", "d", "--workers", "3"])
    assert _resources(args)["distributed"] == Distributed(workers=3)
    args = build_parser().parse_args(["quantize", "m.onnx", "--scheduler", "tcp://h:1"])
    assert _resources(args)["distributed"] == Distributed(scheduler="tcp://h:1")
    assert _resources(build_parser().parse_args(["quantize", "m.onnx"]))["distributed"] is None


def kill_on_second_shard(batch):
    """A range calibrator that kills its worker process when that worker was told to."""
    if os.environ.get("AUTOQ_TEST_KILL") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return float(batch.min()), float(batch.max())


def _arm():
    os.environ["AUTOQ_TEST_KILL"] = "1"


def test_killed_worker_is_restarted_or_reported_with_its_shard(client, model):
    """A worker killed during calibration: its shard is restarted on the other worker (its
    samples reloaded, the segments so far replayed) and the qparams are the in-process
    ones; with ``retries=0`` the run fails with an error naming the shard. (The nanny
    restarts a killed worker, unarmed.)"""
    mod, params, data = model
    cfg = config(kill_on_second_shard)
    sim = simulate(mod, params, cfg)
    want = calibrate(sim, params, data, cfg, target=TARGET)
    victim = sorted(client.scheduler_info(n_workers=-1)["workers"])[1]  # holds shard 2
    client.run(_arm, workers=[victim])
    with pytest.warns(UserWarning, match=r"shard 2/2 \(samples 1, 3, .*restarting the shard"):
        got = calibrate_distributed(sim, data, cfg, TARGET, client, shards=2)
    assert_identical(want, got)
    client.wait_for_workers(2, timeout=120)
    victim = sorted(client.scheduler_info(n_workers=-1)["workers"])[1]
    client.run(_arm, workers=[victim])
    once = Resources(distributed=Distributed(scheduler="unused", retries=0))
    with pytest.raises(ShardLostError, match=r"shard 2/2 \(samples 1, 3, \.\.\..*lost"):
        calibrate_distributed(sim, data, cfg, TARGET, client, once, shards=2)


def test_scale_health_merges_across_shards(client, model):
    """An extreme value in the last shard's last sample: the distributed calibration finds
    the same unusable scales (autoq.calibration.scale_health) as the in-process one."""
    mod, params, data = model
    data = [x.copy() for x in data]
    data[-1][0, 0, 0, 0] = 1e30
    cfg = config("max")
    sim = simulate(mod, params, cfg)
    want = calibrate(sim, params, data, cfg, target=TARGET)
    got = calibrate_distributed(sim, data, cfg, TARGET, client, shards=2)
    assert want.meta["scale_problems"] and "x" in want.meta["scale_problems"]
    assert got.meta["scale_problems"] == want.meta["scale_problems"]


def test_a_recipes_per_channel_rules_are_left_out_on_a_cluster(client, model):
    """small_cnn has a depthwise conv: ``auto`` picks depthwise_cnn, whose per-channel rules
    the workers cannot calibrate; on a cluster they are left out with a warning (and the
    qparams are those of the recipe without them, in-process); named by the user, they are
    an error naming them."""
    mod, params, data = model
    with pytest.warns(UserWarning, match=r"depthwise_cnn recipe's per-channel rules"):
        res = autoq.Quantizer(target=TARGET, cluster=client).run(mod, params, data)
    kept = ("lookup_input_ranges", "clip_output_ranges")  # the per-tensor rules
    assert res.recipe[0] == "depthwise_cnn" and res.config.rules == kept
    want = autoq.Quantizer(res.config, target=TARGET).run(mod, params, data)
    assert_identical(want.qparams, res.qparams)
    mine = Config(recipe="depthwise_cnn", rules=("depthwise_per_channel",))
    with pytest.raises(autoq.InputError, match=r"depthwise_per_channel.*not supported with distr"):
        autoq.Quantizer(mine, target=TARGET, cluster=client).run(mod, params, data)


def test_worker_killed_between_calls_is_restarted(client, model, monkeypatch):
    """Issue 38, item 11: a worker killed from outside between two calls of its shard
    (SIGKILL by pid, the scheduler told of the loss first): the next call met dask's
    ``RuntimeError: Worker holding Actor was lost`` and the run ended with it. Now the
    shard is restarted on the other worker and the qparams are the in-process ones."""
    from autoq.distributed.remote_shards import RemoteShard

    mod, params, data = model
    cfg = config("max")
    sim = simulate(mod, params, cfg)
    want = calibrate(sim, params, data, cfg, target=TARGET)
    client.wait_for_workers(2, timeout=120)
    victim = sorted(client.scheduler_info(n_workers=-1)["workers"])[1]  # holds shard 2
    pid = client.run(os.getpid, workers=[victim])[victim]
    run_segment, killed = RemoteShard.run_segment, []

    def kill_then_run(self, j, *args, **kw):
        if j == 1 and self.name.startswith("shard 2/2") and not killed:
            self.wait()  # segment 0 done: kill the worker while the shard is idle
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            deadline = time.monotonic() + 120
            while victim in client.scheduler_info(n_workers=-1)["workers"]:
                assert time.monotonic() < deadline, "the scheduler never saw the loss"
                time.sleep(0.1)
        return run_segment(self, j, *args, **kw)

    monkeypatch.setattr(RemoteShard, "run_segment", kill_then_run)
    with pytest.warns(UserWarning, match=r"shard 2/2 .*its worker was lost.*restarting"):
        got = calibrate_distributed(sim, data, cfg, TARGET, client, shards=2)
    assert killed and got.meta["stats"]["segments"] >= 2
    assert_identical(want, got)


def test_unreachable_scheduler_is_a_one_line_error_naming_it(tmp_path, capsys):
    """Issue 38, item 11: it took 61 s (the 60 s wait for workers) and ended in a traceback."""
    from test_cli import TARGET as CLI_TARGET
    from test_cli import assert_user_error, run, tiny_onnx

    address = "tcp://127.0.0.1:1"
    mod, params, make = small_cnn()
    with pytest.raises(autoq.InputError, match=r"cannot reach the Dask scheduler at 'tcp://127.0.0.1:1' within 5 s"):  # fmt: skip
        autoq.quantize(mod, params, make(2), distributed=Distributed(scheduler=address))
    model = tiny_onnx(tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", np.ones((2, 1, 3, 8, 8), np.float32))
    argv = ["quantize", model, "--calib", tmp_path / "x.npy", "--out", tmp_path / "out"]
    code, _, err = run(capsys, *argv, "--scheduler", address, "--target", CLI_TARGET)
    assert_user_error(code, err, f"Dask scheduler at {address!r}", "check the address")
    assert not (tmp_path / "out").exists()


def test_nothing_to_quantize_on_a_cluster(client):
    """Issue 38, item 9 on a cluster: a softmax-only model has no slot to calibrate; no
    library is shipped to the workers (an empty one failed to load) and the fp32 model
    comes back with the warning."""
    from tvm import relax

    x = relax.Var("x", relax.TensorType((1, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.softmax(x))
        bb.emit_func_output(out)
    data = [np.random.default_rng(i).normal(size=(1, 8)).astype(np.float32) for i in range(3)]
    cfg = Config(recipe="cnn")
    q = calibrate_distributed(simulate(bb.get(), {}, cfg), data, cfg, TARGET, client)
    assert list(q.params) == []
    with pytest.warns(UserWarning, match="no layer is quantized"):
        r = autoq.Quantizer(cfg, target=TARGET, cluster=client).run(bb.get(), {}, data)
    assert r.int8_layers == []


def test_clip_output_ranges_on_a_cluster(client):
    """The per-tensor ``clip_output_ranges`` rule (a ReLU6 output calibrated by its min /
    max whatever the spec's calibrator) is kept on a cluster: the workers give the
    in-process qparams, and the rule really changed a range (mse cuts the clip's output)."""
    mod, params, make = mlp()
    data = make(8)
    plain = config(MSE())
    ruled = replace(plain, rules=("clip_output_ranges",))
    sim = simulate(mod, params, ruled)
    want = calibrate(sim, params, data, ruled, target=TARGET)
    got = calibrate_distributed(sim, data, ruled, TARGET, client, shards=2)
    assert_identical(want, got)
    base = calibrate(simulate(mod, params, plain), params, data, plain, target=TARGET)
    changed = [sid for sid in want.params if bits(want[sid]) != bits(base[sid])]
    assert changed, "the rule must change the clip output's range"
