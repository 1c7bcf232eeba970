"""What ``autoq`` prints (issue 37, item 5): piped, no progress-bar redraws (no carriage
return), one line per stage with its time and counts on standard output, warnings on
standard error; on a terminal (a pseudo-terminal as standard error) every stage's live
progress; ``--quiet`` prints nothing; ``--version``."""

from __future__ import annotations

import doctest
import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_cli import TARGET, assert_user_error, tiny_onnx

import autoq
from autoq.config import progress

AUTOQ = Path(sys.executable).with_name("autoq")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("console")
    model = tiny_onnx(d / "tiny.onnx")
    np.savez(
        d / "calib.npz", x=np.random.default_rng(3).normal(size=(3, 3, 8, 8)).astype(np.float32)
    )
    return d, model


def _argv(files, out: str, *extra) -> list[str]:
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
    return [str(a) for a in argv]


def _quantize(files, out: str, *extra):
    return subprocess.run(_argv(files, out, *extra), capture_output=True, text=True, timeout=600)


def _on_a_terminal(argv: list[str]) -> tuple[int, str, str]:
    """Run ``argv`` with a pseudo-terminal as standard error: (exit code, what the terminal
    got, standard output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 columns
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    tty = b""
    while True:  # read the terminal as it is written (its buffer is small)
        if select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal (Linux: EIO)
                break
            if not chunk:
                break
            tty += chunk
        elif p.poll() is not None:
            break
    os.close(master)
    out = p.stdout.read()
    p.wait(timeout=600)
    return p.returncode, tty.decode(errors="replace"), out


def test_terminal_shows_every_stage_live(files):
    code, tty, out = _on_a_terminal(_argv(files, "tty"))
    assert code == 0, tty
    # the live status of each stage (its name and elapsed time, redrawn with '\r') and the
    # bars of the stages that count steps (patterns, samples, layers)
    for stage in ("import", "match", "guard", "calibrate", "realize", "compile"):
        assert re.search(rf"\r{stage} +\d+\.\d s \.\.\.", tty), (stage, tty)
    bars = {"match": "pattern", "guard": "sample", "calibrating": "step", "realize": "layer"}
    for desc, unit in bars.items():
        assert re.search(rf"\r{desc}: +\d+%\|.*{unit}", tty), (desc, tty)
    assert "\r" not in out and re.search(r"^compile +\d+\.\d s  model.so$", out, re.M), out


class _Terminal(io.StringIO):
    """Standard error as a terminal looks to autoq (``isatty()`` true), read back as text."""

    def isatty(self) -> bool:
        return True


def test_no_progress_turns_it_off_on_a_terminal(files, capsys, monkeypatch):
    """In-process, standard error a stand-in terminal (the real one is the test above):
    with ``--no-progress`` nothing is redrawn and the stage lines are printed."""
    from autoq import cli
    from autoq.config import Resources

    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert Resources().show_progress  # without the option it would draw
    code = cli.main(_argv(files, "tty2", "--no-progress")[1:])
    out = capsys.readouterr().out
    assert code == 0 and "\r" not in tty.getvalue() and "\r" not in out, tty.getvalue()
    assert re.search(r"^realize +\d+\.\d s  2 int8 layers$", out, re.M), out


def test_piped_output_has_stage_lines_and_no_redraws(files, capfd):
    """In-process (what a pipe gets is what the process writes to its two file descriptors,
    which capfd reads; the real pipes of a process are in the --quiet test)."""
    from autoq import cli

    code = cli.main(_argv(files, "piped")[1:])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert "\r" not in out and "\r" not in err
    lines = out.splitlines()
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
    """The installed console script (pyproject [project.scripts]) in a process of its own:
    ``--quiet`` prints nothing at all; a user error still shows as its one line, with the
    exit code propagated."""
    p = _quantize(files, "quiet", "--quiet")
    assert (p.returncode, p.stdout, p.stderr) == (0, "", ""), p.stderr
    assert (files[0] / "quiet" / "model.so").is_file()
    p = _quantize(files, "quiet2", "-q", "--skip", "nope")
    assert p.stdout == ""
    assert_user_error(p.returncode, p.stderr, "fallback id 'nope' matches no layer")


def test_version():
    p = subprocess.run([str(AUTOQ), "--version"], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout.strip()) == (0, f"autoq {autoq.__version__}")


def _until(condition, timeout_s: float = 10.0) -> None:
    end = time.perf_counter() + timeout_s
    while not condition() and time.perf_counter() < end:
        time.sleep(0.01)


def test_status_redraws_pauses_for_a_bar_and_stops_when_interrupted(monkeypatch):
    """The live status of an opaque call: redrawn by a daemon thread, silent while a bar is
    open, and on Ctrl-C its thread ends and its line is erased (``autoq: interrupted`` then
    starts a clean line)."""
    screen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setattr(progress, "INTERVAL_S", 0.01)
    draws = lambda: screen.getvalue().count("\rcompile ")  # noqa: E731
    with pytest.raises(KeyboardInterrupt), progress.status("compile", show=True):
        (thread,) = [t for t in threading.enumerate() if t.name == "autoq-status-compile"]
        assert thread.daemon
        _until(lambda: draws() >= 3)  # redrawn while the call runs
        b = progress.bar(total=2, desc="layers", show=True)
        before = draws()
        time.sleep(0.1)
        assert draws() == before and "\rlayers:   0%|" in screen.getvalue()
        b.close()
        _until(lambda: draws() > before)  # back after the bar
        assert draws() > before
        raise KeyboardInterrupt
    assert not thread.is_alive()
    assert doctest.testmod(progress).failed == 0
    width = len(f"{'compile':<14} {0:6.1f} s ...")
    assert screen.getvalue().endswith("\r" + " " * width + "\r")


def test_library_run_draws_progress_when_asked(monkeypatch):
    """``autoq.quantize(..., progress=True)`` draws the same live progress as the command,
    SmoothQuant's pass over the samples included (a LayerNorm block); ``False``: nothing."""
    from models import TARGET as MODEL_TARGET
    from models import ln_block, ln_block_data

    mod, params, _ = ln_block()
    # static int8 layers (the cnn recipe), so that every stage has something to count: the
    # transformer recipe leaves this block's dense layers dynamic and its residual add float
    config = autoq.Config(recipe="cnn", smooth_quant=0.5)
    for show in (True, False):
        screen = io.StringIO()
        monkeypatch.setattr(sys, "stderr", screen)
        autoq.quantize(mod, params, ln_block_data(4), config, MODEL_TARGET, progress=show)
        drawn = set(re.findall(r"\r(\w+)(:| +\d+\.\d s \.\.\.)", screen.getvalue()))
        if show:
            bars = {"match", "smooth_quant", "guard", "calibrating", "realize"}
            assert bars <= {name for name, kind in drawn if kind == ":"}, drawn
            assert {"smooth_quant", "realize"} <= {name for name, kind in drawn if kind != ":"}
        else:
            assert screen.getvalue() == ""
