"""The CPU this process runs on, as an LLVM target: ``default_target()``.

LLVM's host CPU name does not tell everything: a CPU may have Intel AMX int8 tiles that the
name lacks (a virtualized Sapphire Rapids reports ``rocketlake``), and Linux must grant the
process the tile data state before the first AMX instruction. :func:`default_target` adds
the AMX features as ``mattr`` only when both hold (:func:`host_target_features`), so code
compiled for it never faults; the AMX kernels themselves live in :mod:`autoq.cpu`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

import tvm

__all__ = [
    "AMX_FEATURES",
    "cpu_flags",
    "default_target",
    "host_target_features",
    "missing_amx_features",
    "request_amx",
    "target_has_amx",
]

# (flag in /proc/cpuinfo, LLVM target feature): what the AMX int8 kernels need
AMX_FEATURES = (("amx_tile", "amx-tile"), ("amx_int8", "amx-int8"))
_SYS_ARCH_PRCTL = 158  # x86-64 system call number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in a ``/proc/cpuinfo`` text.

    >>> sorted(cpu_flags("processor : 0\\nflags\\t\\t: fpu avx2 amx_int8\\n\\nflags : sse\\n"))
    ['amx_int8', 'avx2', 'fpu']
    """
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def _host_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return cpu_flags(f.read())
    except OSError:  # not Linux
        return frozenset()


def target_has_amx(target: tvm.target.Target) -> bool:
    """Whether the LLVM ``target`` (``mcpu`` + ``mattr``) has the AMX int8 tile features."""
    features = [feature for _, feature in AMX_FEATURES]
    return target.kind.name == "llvm" and bool(
        tvm.target.codegen.target_has_features(features, target)
    )


def missing_amx_features(mcpu: str, flags: frozenset[str]) -> list[str]:
    """``mattr`` entries for the AMX features a CPU with ``/proc/cpuinfo`` ``flags`` has and
    LLVM's ``mcpu`` lacks (empty when the CPU lacks AMX or ``mcpu`` already has it).

    >>> missing_amx_features("rocketlake", frozenset({"avx512_vnni", "amx_tile", "amx_int8"}))
    ['+amx-tile', '+amx-int8']
    >>> missing_amx_features("sapphirerapids", frozenset({"amx_tile", "amx_int8"}))
    []
    >>> missing_amx_features("haswell", frozenset({"avx2"}))
    []
    """
    if not all(flag in flags for flag, _ in AMX_FEATURES):
        return []
    if target_has_amx(tvm.target.Target({"kind": "llvm", "mcpu": mcpu})):
        return []
    return [f"+{feature}" for _, feature in AMX_FEATURES]


def host_target_features(mcpu: str) -> list[str]:
    """:func:`missing_amx_features` of this host, empty unless Linux grants this process
    the tile state (:func:`request_amx`)."""
    missing = missing_amx_features(mcpu, _host_flags())
    return missing if missing and request_amx() is None else []


@functools.cache
def request_amx() -> str | None:
    """Ask Linux once per process for the AMX tile data state; None when granted, else why
    not (the OS, the architecture or the kernel's errno)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return f"AMX needs Linux on x86-64 (this is {sys.platform} on {platform.machine()})"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0:
        return None
    err = ctypes.get_errno()
    return f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed: {os.strerror(err)} (errno {err})"


def default_target() -> tvm.target.Target:
    """LLVM for this machine's CPU (a bare {"kind": "llvm"} is generic x86-64 without AVX2,
    and "mcpu": "native" is silently ignored): ``mcpu`` is ``llvm_get_system_cpu()``, plus
    ``mattr`` ``+amx-tile``/``+amx-int8`` when the CPU has AMX, that name lacks it and Linux
    grants this process the tile state (:func:`host_target_features`)."""
    mcpu = tvm.target.codegen.llvm_get_system_cpu()
    mattr = host_target_features(mcpu)
    if mattr:
        return tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "mattr": mattr})
    return tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
