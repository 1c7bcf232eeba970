"""Configs written by the version before recipes (31 Config fields, 14 AutoFallback fields):
what moved is read in its new home, what was at its old default is dropped, what measured no
gain and was set is refused by name; one warning says what happened. Plus the start-up
promises: importing autoq changes nothing, and the command answers --help / --version
without TVM."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from autoq import BiasCorrection, Config

#: a config.json of the previous version, as ``Config().dumps()`` wrote it then (default
#: values of every field; the activation and weight specs trimmed to what differs)
OLD = {
    "activation": {"dtype": "int8", "symmetric": False, "calibrator": "mse"},
    "weight": {"dtype": "int8", "symmetric": True, "narrow_range": True, "per_channel": True,
               "calibrator": "max"},
    "rounding": "float", "calibration": "topological",
    "fallback": {"type": "Fallback", "ids": [], "op_types": [], "patterns": [], "validate": True},
    "overrides": [], "patterns": None, "memory_budget_mb": 1024.0, "cache_dir": None,
    "progress": True, "skip_unbounded": True, "check_scales": True, "int8_outputs": False,
    "distributed": None, "weight_rounding": "gptq", "bias_correction": False,
    "empirical_bias_correction": False, "bias_correction_holdout": 0,
    "bias_correction_skip": [], "scale_search": False, "equalization": False,
    "int16_tensors": [], "smooth_quant": 0.5, "smooth_quant_alphas": [], "token_mask": None,
    "lut_input_ranges": False, "dynamic_gptq": False, "lut_input_per_channel": False,
    "depthwise_input_per_channel": False, "residual_per_channel": False,
    "residual_int16_per_channel": False,
}  # fmt: skip


def _load(d: dict):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = Config.loads(json.dumps(d))
    return cfg, [str(w.message) for w in caught]


def test_an_old_default_config_is_the_cnn_recipe():
    cfg, said = _load(OLD)
    assert cfg == Config(recipe="cnn") and cfg.resolved
    assert len(said) == 1 and "older version" in said[0] and "scale_search" in said[0]


def test_moved_options_are_read_in_their_new_home():
    old = {**OLD, "lut_input_ranges": True, "lut_input_per_channel": True,
           "depthwise_input_per_channel": True, "empirical_bias_correction": True,
           "bias_correction_holdout": 8, "memory_budget_mb": 512.0}  # fmt: skip
    cfg, said = _load(old)
    assert cfg.rules == ("lookup_input_ranges", "lookup_per_channel", "depthwise_per_channel")
    assert cfg.bias_correction == BiasCorrection(holdout=8)
    assert "memory_budget_mb=512.0 ignored" in said[0] and "Quantizer" in said[0]
    assert "Config.rules containing 'lookup_per_channel'" in said[0]


@pytest.mark.parametrize(
    ("field", "value"),
    [("scale_search", True), ("equalization", True), ("smooth_quant_alphas", [0.3, 0.5]),
     ("dynamic_gptq", True), ("bias_correction", True), ("bias_correction_skip", ["c1"]),
     ("token_mask", {"input": "attention_mask"})],
)  # fmt: skip
def test_removed_options_that_were_set_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=rf"Config\.{field}=.*removed"):
        Config.loads(json.dumps({**OLD, field: value}))


def test_old_auto_fallback_fields():
    fb = {"type": "AutoFallback", "ids": [], "op_types": [], "patterns": [], "validate": True,
          "metric": "sqnr", "min_sqnr": 30.0, "max_drop": 0.01, "max_fp32_layers": 8,
          "ranking": "local", "precision": "int16_tensors", "holdout": 0,
          "max_int16_fraction": 0.2, "recalibrate": False, "trial_samples": 4,
          "swap_rounds": 0, "first_tensors": 0, "shortlist": "sqnr", "search": "greedy"}  # fmt: skip
    cfg, said = _load({**OLD, "fallback": fb})
    assert cfg.fallback.precision == "int16_tensors" and any("swap_rounds" in s for s in said)
    with pytest.raises(ValueError, match=r"AutoFallback\.swap_rounds=2.*removed"):
        Config.loads(json.dumps({**OLD, "fallback": {**fb, "swap_rounds": 2}}))


def test_unknown_fields_are_still_errors():
    with pytest.raises(ValueError, match=r"Config has no fields \['colour'\]"):
        Config.from_json({**Config().to_json(), "colour": 1})


def _python(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )


def test_import_autoq_changes_nothing_and_loads_no_tvm():
    code = (
        "import os, sys; before = dict(os.environ); import autoq\n"
        "assert dict(os.environ) == before, 'environment changed'\n"
        "assert 'tvm' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)\n"
        "assert autoq.Config().recipe == 'auto'\n"
        "assert 'tvm' not in sys.modules\n"
    )
    _python(code)


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_the_command_answers_without_importing_tvm(flag):
    code = f"from autoq.cli import main; raise SystemExit(main([{flag!r}]))"
    out = _python(code, "-X", "importtime")
    modules = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert not {m for m in modules if m.split(".")[0] in ("tvm", "tvm_ffi", "numpy")}
    assert ("autoq" in out.stdout) and (flag == "--help" or out.stdout.startswith("autoq "))
