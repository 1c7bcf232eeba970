"""What ``autoq`` prints when its output is piped (issue 37, item 5): no progress-bar
redraws (no carriage return), one line per stage with its time and counts on standard
output, warnings on standard error; ``--quiet`` prints nothing; ``--version``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_cli import TARGET, tiny_onnx

import autoq

AUTOQ = Path(sys.executable).with_name("autoq")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("console")
    model = tiny_onnx(d / "tiny.onnx")
    np.savez(
        d / "calib.npz", x=np.random.default_rng(3).normal(size=(3, 3, 8, 8)).astype(np.float32)
    )
    return d, model


def _quantize(files, out: str, *extra):
    d, model = files
    argv = [
        AUTOQ,
        "quantize",
        model,
        "--calib",
        d / "calib.npz",
        "--out",
        d / out,
        "--target",
        TARGET,
        *extra,
    ]
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600)


def test_piped_output_has_stage_lines_and_no_redraws(files):
    p = _quantize(files, "piped")
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stdout and "\r" not in p.stderr
    lines = p.stdout.splitlines()
    stage = {
        m.group(1): m.group(2)
        for m in map(re.compile(r"^(\w+) +\d+\.\d s *(.*)$").match, lines)
        if m
    }
    assert stage["match"] == "2 layers" and stage["realize"] == "2 int8 layers", lines
    assert stage["compile"] == "model.so" and "calibrate" in stage, lines
    assert "calibrated on 3 samples" in lines
    assert lines[-1].startswith("done in ")
    assert "compile ..." not in lines  # the -v line


def test_quiet_prints_nothing_and_errors_still_show(files):
    p = _quantize(files, "quiet", "--quiet")
    assert (p.returncode, p.stdout, p.stderr) == (0, "", ""), p.stderr
    assert (files[0] / "quiet" / "model.so").is_file()
    p = _quantize(files, "quiet2", "-q", "--skip", "nope")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("autoq: error: ") and "nope" in p.stderr


def test_version():
    p = subprocess.run([str(AUTOQ), "--version"], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout.strip()) == (0, f"autoq {autoq.__version__}")
