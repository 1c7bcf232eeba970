"""The side file of a tuning database (autoq.build.tuning_defaults): which kernels keep autoq's
default schedule, from measured seconds; JSON round trip, atomic writes, corrupt files."""

from __future__ import annotations

import json

import pytest

import autoq.json_document
from autoq.build.tuning_defaults import DEFAULTS_FILE, DefaultSchedules, KernelChoice, keeps_default
from autoq.errors import InputError


def choices() -> DefaultSchedules:
    return DefaultSchedules(
        (
            KernelChoice("11", "fused_add", 10e-6, 20e-6, "1"),  # record slower: default
            KernelChoice("22", "fused_conv", 10e-6, 5e-6, "2"),  # record 2x faster: record
            KernelChoice("33", "fused_pad", 10e-6, 9.8e-6, "3"),  # 2% faster: noise, default
            KernelChoice("44", "fused_pool", None, 5e-6, "4"),  # default failed: record
        )
    )


def test_decisions_follow_the_measured_seconds():
    assert choices().default_wins() == {"11", "33"}
    assert choices().measured() == {"11": "1", "22": "2", "33": "3", "44": "4"}
    assert keeps_default(1.0, 0.5) is False and keeps_default(1.0, 1.0) is True
    assert keeps_default(1.0, 0.98, min_gain=0.0) is False
    # a new measurement replaces the old one of the same workload
    again = choices().with_kernels([KernelChoice("11", "fused_add", 10e-6, 1e-6, "5")])
    assert again.default_wins() == {"33"} and len(again.kernels) == 4
    assert again.measured()["11"] == "5"


def test_json_round_trip_and_atomic_save(tmp_path, monkeypatch):
    doc = choices()
    path = doc.save_to(tmp_path)
    assert path == tmp_path / DEFAULTS_FILE
    assert DefaultSchedules.load(tmp_path) == doc
    assert json.loads(path.read_text())["kernels"][3]["default_s"] is None
    assert DefaultSchedules.load(tmp_path / "nothing-yet") == DefaultSchedules()

    def interrupted(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(autoq.json_document.os, "replace", interrupted)
    with pytest.raises(OSError, match="disk full"):
        DefaultSchedules().save_to(tmp_path)
    assert DefaultSchedules.load(tmp_path) == doc  # the old file is intact
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULTS_FILE]  # no temporary left


@pytest.mark.parametrize(
    "text, why",
    [
        ("{not json", "Expecting property name"),
        ('{"format": "other", "version": 1}', "not an 'autoq.default_schedules' document"),
        ('{"format": "autoq.default_schedules", "version": 9}', "version 9"),
        (
            '{"format": "autoq.default_schedules", "version": 1, "min_gain": 0.03, '
            '"kernels": [{"workload": "1", "task": "k", "default_s": -1, "tuned_s": 1, '
            '"default_hash": "7"}]}',
            "default_s must be > 0",
        ),
        (
            '{"format": "autoq.default_schedules", "version": 1, "min_gain": 0.03, '
            '"kernels": [{"workload": "1", "task": "k", "default_s": 1}]}',
            "tuned_s",
        ),
    ],
)
def test_a_corrupt_side_file_names_the_file(tmp_path, text, why):
    (tmp_path / DEFAULTS_FILE).write_text(text)
    with pytest.raises(InputError, match=DEFAULTS_FILE) as e:
        DefaultSchedules.load(tmp_path)
    assert why in str(e.value) and "autoq tune" in str(e.value)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="twice"):
        DefaultSchedules(
            (KernelChoice("1", "a", 1.0, 1.0, "h"), KernelChoice("1", "b", 1.0, 1.0, "h"))
        )
    with pytest.raises(ValueError, match="min_gain"):
        DefaultSchedules((), 1.5)
    with pytest.raises(ValueError, match="workload"):
        KernelChoice("", "a", 1.0, 1.0, "h")
