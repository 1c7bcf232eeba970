"""``autoq quantize --out`` never loses or mixes files (issues 17 and 38): the folder is
checked and locked before any work, written in a temporary folder next to it and swapped in
whole; a folder without autoq's marker is refused without ``--force`` (which says what it
removed); a second run on the same folder is refused while the first holds it (two
processes, different TMPDIRs); a planted lock file is never followed; only this run's
leftovers are cleaned; a symbolic link --out is followed; bad names and a full disk (a real
tmpfs) are one-line errors; modes follow the umask."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from test_cli import TARGET, assert_user_error, run, tiny_onnx

from autoq.cli.output_dir import MARKER, OutputDir
from autoq.errors import OutputError


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
    """Only autoq's file names but no marker (issue 38, item 1): refused; --force replaces
    them and says what it removed; modes follow the umask (issue 37, item 4)."""
    out = tmp_path / "proj"
    out.mkdir(mode=0o755)
    (out / "model.py").write_text("my own code\n")
    (out / "config.json").write_text('{"mine": 1}\n')
    code, _, err = quantize(capsys, files, out)
    assert_user_error(code, err, "--out", "not empty and was not written by autoq", "--force")
    assert (out / "model.py").read_text() == "my own code\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj"]
    old_umask = os.umask(0o027)
    try:
        code, _, err = quantize(capsys, files, out, "--force")
    finally:
        os.umask(old_umask)
    assert code == 0, err
    assert "my own code" not in (out / "model.py").read_text()
    assert "autoq: note: --force removed 2 entries" in err and "config.json, model.py" in err
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    for name in ("config.json", "qparams.json", "module.json", "model.so.autoq.json", MARKER):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o640, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj"]  # no lock, no staging left


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_rerun_replaces_an_earlier_result_whole(files, tmp_path, capsys):
    out = tmp_path / "res"
    assert quantize(capsys, files, out)[0] == 0
    listed = json.loads((out / MARKER).read_text())["files"]
    assert {"model.so", "qparams.json", "model.py", "config.json", "report.txt"} <= set(listed)
    (out / "stale.txt").write_text("from an older run\n")  # the swap drops what is not new
    (out / MARKER).write_text("{}")
    killed = tmp_path / f".res.autoq-tmp-{_dead_pid()}-0a1b"  # left by a run killed with -9
    killed.mkdir()
    assert quantize(capsys, files, out)[0] == 0
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res"]


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


@contextlib.contextmanager
def holding(out, tmpdir=None):
    """Another process inside ``OutputDir(out)`` (a run in progress) until the block ends;
    yields (its pid, its staging folder)."""
    env = dict(os.environ, **({"TMPDIR": str(tmpdir)} if tmpdir else {}))
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from autoq.cli.output_dir import OutputDir
            with OutputDir({str(out)!r}) as o:
                (o.path / "model.so").write_text("staged")
                print(o.path, flush=True)
                sys.stdin.readline()
                o.commit(["model.so"])
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        yield holder.pid, Path(holder.stdout.readline().strip())
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0


def test_second_process_on_the_same_out_is_refused(files, tmp_path, capsys, monkeypatch):
    """Another process holds --out (issue 38, items 5 and 14): refused whatever TMPDIR and
    however --out is spelled, with one message, written nothing; free again afterwards."""
    out = tmp_path / "res"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "link").symlink_to(tmp_path)
    with holding(out, tmpdir=tmp_path / "a") as (pid, staged):
        monkeypatch.setenv("TMPDIR", str(tmp_path / "b"))
        monkeypatch.setattr(tempfile, "tempdir", None)
        for spelling in (out, tmp_path / "link" / "res", tmp_path / "a" / ".." / "res"):
            code, _, err = quantize(capsys, files, spelling)
            assert err == (
                f"autoq: error: --out {str(spelling)!r} is being written by another autoq run "
                f"(pid {pid}): wait for it to finish or choose another --out\n"
            )
            assert code == 2
        assert not out.exists() and staged.parent == tmp_path
        assert list((tmp_path / "a").iterdir()) == list((tmp_path / "b").iterdir()) == []
    assert (out / "model.so").read_text() == "staged"  # the holder's commit went through
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "link", "res"]


def test_cleanup_removes_only_this_runs_leftovers(tmp_path):
    """--out 'r*' next to a running --out results (issue 38, item 3): the other run's
    staging folder, and dead runs' folders of other names, are left alone."""
    dead = _dead_pid()
    others = [f".rx.autoq-tmp-{dead}-0a1b", f".r.autoq-tmp-{dead}.autoq-tmp-1-2", "r-keep"]
    for name in others:
        (tmp_path / name).mkdir()
    (tmp_path / f".r*.autoq-tmp-{dead}-0a1b").mkdir()  # this --out's, of a dead run
    with holding(tmp_path / "results") as (_, staged):
        for name in ("r*", "r"):
            with OutputDir(tmp_path / name) as o:
                (o.path / "x").write_text("x")
                o.commit(["x"])
        assert staged.is_dir()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([*others, "r*", "r", "results"])


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "other_user"])
def test_planted_lock_file_is_refused(tmp_path, plant):
    """A lock file someone else made (issue 38, item 2): never followed, never truncated;
    the run is refused naming it. Locks live next to --out, not in the temp folder."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    lock = tmp_path / ".res.autoq-lock"
    if plant == "symlink":
        lock.symlink_to(victim)
    elif plant == "hardlink":
        os.link(victim, lock)
    else:
        lock.write_text("")
        os.chown(lock, 65534, 65534)
    with pytest.raises(OutputError, match=r"the lock file .*\.res\.autoq-lock.* remove it"):
        with OutputDir(tmp_path / "res"):
            pass
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "res").exists()
    assert [p for p in tmp_path.iterdir() if "autoq-tmp" in p.name] == []


def test_out_symlink_to_a_folder_is_followed(files, tmp_path, capsys):
    """--out is a link to an earlier result (issue 38, item 4): the link stays, the folder
    it points to holds the new result, nothing stray is left in either parent."""
    real = tmp_path / "store" / "res"
    real.mkdir(parents=True)
    (real / MARKER).write_text("{}")
    (real / "report.txt").write_text("old\n")
    (tmp_path / "work").mkdir()
    link = tmp_path / "work" / "res"
    link.symlink_to(real)
    code, _, err = quantize(capsys, files, link)
    assert code == 0, err
    assert link.is_symlink() and link.resolve() == real
    assert (real / "report.txt").read_text() != "old\n" and (real / "model.so").is_file()
    assert [p.name for p in (tmp_path / "work").iterdir()] == ["res"]
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["res"]


@pytest.mark.parametrize("case", ["dot", "dotdot", "dangling", "not_utf8"])
def test_bad_out_names_are_one_line_errors(files, tmp_path, capsys, monkeypatch, case):
    """Issue 38, item 12: each is exit 2 with one line, before any work, nothing written."""
    import autoq

    def never(*a, **k):
        raise AssertionError("calibration started")

    monkeypatch.setattr(autoq.Quantizer, "run", never)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    out, needle = {
        "dot": (".", "is the current folder"),
        "dotdot": ("..", "a folder holding the current one"),
        "dangling": (tmp_path / "gone", "is a symbolic link to"),
        "not_utf8": (os.fsdecode(bytes(tmp_path / "empty") + b"/r\xff"), "not a UTF-8"),
    }[case]
    if case == "dangling":
        (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    code, _, err = quantize(capsys, files, out)
    assert_user_error(code, err, "--out", needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "empty",
        *(["gone"] * (case == "dangling")),
    ]
    assert list(empty.iterdir()) == []


@pytest.mark.parametrize("when", ["before_the_library", "after_the_library"])
def test_full_disk_leaves_old_result_and_user_files(files, tmp_path, capsys, monkeypatch, when):
    """A full disk (issue 38, item 12; a real tmpfs): too little space for the library is
    refused before LLVM writes it (LLVM ends the process on a write error); a disk that
    fills up later (another process) fails the next write. Both: exit 2, one line; the
    earlier result and the user's files are unchanged, no staging folder is left."""
    import autoq.build

    disk = tmp_path / "disk"
    disk.mkdir()
    size = "512k" if when == "before_the_library" else "24m"
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                           capture_output=True, text=True)  # fmt: skip
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")
    export = autoq.build.export_library

    def export_then_fill(*a, **k):
        path = export(*a, **k)
        with open(disk / "filler", "ab") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        return path

    try:
        out = disk / "res"
        out.mkdir()
        (out / MARKER).write_text("{}")
        (out / "report.txt").write_text("old result\n")
        (disk / "mine.txt").write_text("user file\n")
        if when == "after_the_library":
            monkeypatch.setattr(autoq.build, "export_library", export_then_fill)
        before = {p.relative_to(disk): p.read_bytes() for p in out.rglob("*")}
        code, _, err = quantize(capsys, files, out)
        assert_user_error(code, err, "no space left", str(out), "--out is unchanged")
        assert {p.relative_to(disk): p.read_bytes() for p in out.rglob("*")} == before
        assert (disk / "mine.txt").read_text() == "user file\n"
        assert sorted(p.name for p in disk.iterdir()) == sorted(
            ["mine.txt", "res", *(["filler"] * (when == "after_the_library"))]
        )
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_rerun_keeps_and_uses_the_tuning_database(files, tmp_path, capsys, monkeypatch):
    """A tuning database 'autoq tune' left in --out is compiled with and carried into the
    new result (the swap used to drop it, and the compile looked for it in the staging
    folder)."""
    import autoq.build
    from autoq.build.tuning_database import RECORD_FILE, WORKLOAD_FILE

    out = tmp_path / "res"
    (out / "tuning").mkdir(parents=True)
    (out / MARKER).write_text("{}")
    for name in (WORKLOAD_FILE, RECORD_FILE):
        (out / "tuning" / name).write_text("")
    used = []
    export = autoq.build.export_library

    def spy(*a, database=None, **k):
        used.append(database)
        return export(*a, database=database, **k)

    monkeypatch.setattr(autoq.build, "export_library", spy)
    code, _, err = quantize(capsys, files, out)
    assert code == 0, err
    assert used and used[0] == out / "tuning"
    assert sorted(p.name for p in (out / "tuning").iterdir()) == [RECORD_FILE, WORKLOAD_FILE]
    assert "tuning" in json.loads((out / MARKER).read_text())["files"]


def test_tune_is_refused_while_out_is_written(tmp_path, capsys):
    """'autoq tune FOLDER' writes the database and rebuilds the library inside the folder:
    it takes the folder's --out lock first, so while an 'autoq quantize --out FOLDER' runs
    it is refused at once (naming that run's pid), before any tuning."""
    import tvm
    from tvm import relax

    out = tmp_path / "res"
    out.mkdir()
    (out / MARKER).write_text('{"files": ["module.json"]}\n')
    x = relax.Var("x", relax.TensorType((2,), "float32"))
    mod = tvm.IRModule({"main": relax.Function([x], x)})
    (out / "module.json").write_text(tvm.ir.save_json(mod))
    with holding(out) as (pid, _):
        code, _, err = run(capsys, "tune", out, "--trials", "1")
        assert_user_error(code, err, f"{str(out)!r} is being written by another autoq run")
        assert f"(pid {pid})" in err
        assert not (out / "tuning").exists()
