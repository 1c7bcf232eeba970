"""``autoq quantize --out`` never loses or mixes files (issue 17, item 3): the folder is
checked and locked before any work, written in a temporary folder next to it and swapped in
whole; a folder autoq did not write is refused without ``--force``; a second run on the same
folder is refused while the first holds it (two processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from test_cli import TARGET, assert_user_error, run, tiny_onnx

from autoq.cli.output_dir import MARKER


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_out")
    model = tiny_onnx(d / "tiny.onnx")
    rng = np.random.default_rng(1)
    np.savez(d / "calib.npz", x=rng.normal(size=(4, 3, 8, 8)).astype(np.float32))
    return d, model


def quantize(capsys, files, out, *extra):
    d, model = files
    argv = ["quantize", model, "--calib", d / "calib.npz", "--out", out, "--target", TARGET]
    return run(capsys, *argv, "--no-progress", *extra)


def test_user_files_are_never_replaced_without_force(files, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "model.py").write_text("my own code\n")
    (out / "notes.txt").write_text("keep\n")
    code, _, err = quantize(capsys, files, out)
    assert_user_error(code, err, "--out", "not empty and was not written by autoq", "--force")
    assert (out / "model.py").read_text() == "my own code\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    code, _, err = quantize(capsys, files, out, "--force")
    assert code == 0, err
    assert "my own code" not in (out / "model.py").read_text()
    assert not (out / "notes.txt").exists()


def test_rerun_replaces_an_earlier_result_whole(files, tmp_path, capsys):
    out = tmp_path / "res"
    assert quantize(capsys, files, out)[0] == 0
    listed = json.loads((out / MARKER).read_text())["files"]
    assert {"model.so", "qparams.json", "model.py", "config.json", "report.txt"} <= set(listed)
    (out / "stale.txt").write_text("from an older run\n")  # the swap drops what is not new
    (out / MARKER).write_text("{}")
    (tmp_path / ".res.autoq-tmp-killed").mkdir()  # left by a run killed with SIGKILL
    assert quantize(capsys, files, out)[0] == 0
    assert not (out / "stale.txt").exists()
    leftovers = [p.name for p in tmp_path.iterdir() if "autoq-tmp" in p.name or "old" in p.name]
    assert leftovers == []


def test_failure_mid_write_leaves_the_old_result(files, tmp_path, capsys, monkeypatch):
    out = tmp_path / "res"
    assert quantize(capsys, files, out)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crash(*a, **k):
        raise RuntimeError("disk full (simulated)")

    import autoq.cli.summary

    monkeypatch.setattr(autoq.cli.summary, "quantize_report", crash)
    code, _, err = quantize(capsys, files, out)
    assert code == 1 and "disk full" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if "autoq-tmp" in p.name] == []


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_unwritable_out_is_exit_2_before_any_work(files, tmp_path, capsys, monkeypatch, where):
    import autoq

    def never(*a, **k):
        raise AssertionError("calibration started")

    monkeypatch.setattr(autoq.Quantizer, "run", never)
    (tmp_path / "file.txt").write_text("x")
    out = tmp_path / "file.txt" / "sub" if where == "under_a_file" else "/proc/autoq_out"
    code, _, err = quantize(capsys, files, out)
    assert_user_error(code, err, "--out", "cannot be written")


def test_out_is_a_file(files, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    code, _, err = quantize(capsys, files, tmp_path / "f")
    assert_user_error(code, err, "--out", "is not a folder")
    assert (tmp_path / "f").read_text() == "x"


def test_second_process_on_the_same_out_is_refused(files, tmp_path, capsys):
    """Another process holds --out (a run in progress): this one exits 2 naming its pid,
    and writes nothing."""
    out = tmp_path / "res"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from autoq.cli.output_dir import OutputDir
            with OutputDir({str(out)!r}) as o:
                print("locked", flush=True)
                sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = quantize(capsys, files, out)
        assert_user_error(code, err, "--out", "another autoq run", f"pid {holder.pid}")
        assert not out.exists()
    finally:
        holder.communicate("\n", timeout=30)
    assert quantize(capsys, files, out)[0] == 0  # free again
