"""A real recurrent model: silero-vad's ONNX file (the ``silero-vad`` package; a top-level
``If`` on the sample-rate input ``sr``, an LSTM inside) quantized by autoq and by ONNX
Runtime, run frame by frame on synthesized speech with the LSTM state carried from frame
to frame as the package's own wrapper does (512 new samples + 64 of context, 16 kHz).

Speech: sentences spoken by espeak-ng (Debian package ``espeak-ng``), resampled to 16 kHz,
separated by silence with a little noise; the first sentences calibrate, the others are
held out. Fidelity is measured on the held-out stream against ONNX Runtime fp32: Pearson
correlation and largest difference of the speech probability, and the share of frames on
the same side of 0.5. Latency: median ms per frame on one thread (state in, state out),
with the load average next to it.

    python benchmarks/recurrent.py [--frames-timed 300]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import (
    load_average,
    machine_line,
    markdown_table,
    median_ms,
    ort_session,
    run_benchmark,
)

RATE, CHUNK, CONTEXT = 16000, 512, 64
CALIB_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "A voice activity detector tells speech from silence, frame by frame.",
]
HELD_OUT_TEXT = [
    "Six spoons of fresh snow peas, five thick slabs of blue cheese, and maybe a snack.",
    "We also need a small plastic snake and a big toy frog for the kids.",
    "She can scoop these things into three red bags, and we will go meet her.",
    "Quantization maps real numbers onto a small grid of integers.",
]


def _speak(text: str, tmp: Path, k: int, speed: int) -> np.ndarray:
    path = tmp / f"s{k}.wav"
    subprocess.run(["espeak-ng", "-s", str(speed), "-w", str(path), text], check=True)
    with wave.open(str(path)) as w:
        rate = w.getframerate()
        pcm = np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768
    t = np.arange(int(len(pcm) * RATE / rate)) / RATE
    return np.interp(t, np.arange(len(pcm)) / rate, pcm).astype(np.float32)


def speech_stream(texts: list[str], seed: int) -> np.ndarray:
    """The sentences with 0.3-1.2 s of silence around each and noise at about -50 dB."""
    rng = np.random.default_rng(seed)
    parts = []
    with tempfile.TemporaryDirectory(prefix="autoq-speech-") as tmp:
        for k, text in enumerate(texts):
            parts.append(np.zeros(int(RATE * rng.uniform(0.3, 1.2)), np.float32))
            parts.append(_speak(text, Path(tmp), k, int(rng.integers(140, 190))))
    parts.append(np.zeros(RATE // 2, np.float32))
    audio = np.concatenate(parts)
    return (audio + rng.normal(0, 0.003, audio.shape)).astype(np.float32)


def frames(audio: np.ndarray) -> list[np.ndarray]:
    """The model inputs: each 512-sample chunk after the previous chunk's last 64 samples."""
    audio = np.concatenate([np.zeros(CONTEXT, np.float32), audio])
    n = (len(audio) - CONTEXT) // CHUNK
    return [audio[None, i * CHUNK : i * CHUNK + CHUNK + CONTEXT].copy() for i in range(n)]


def stream(step, xs):
    """Speech probabilities over ``xs`` with the state carried; also the (input, state)
    samples seen. ``step(x, state) -> (prob, state)``."""
    state = np.zeros((2, 1, 128), np.float32)
    probs, samples = [], []
    for x in xs:
        samples.append({"input": x, "state": state})
        p, state = step(x, state)
        probs.append(float(np.asarray(p).reshape(-1)[0]))
    return np.array(probs), samples


def ort_step(sess, with_sr: bool):
    sr = np.array(RATE, np.int64)

    def step(x, state):
        feeds = {"input": x, "state": state}
        if with_sr:
            feeds["sr"] = sr
        out = sess.run(None, feeds)
        return out[0], out[1]

    return step


def autoq_step(vm):
    import tvm

    def step(x, state):
        out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(state))
        return out[0].numpy(), out[1].numpy()

    return step


def vm_call_step():
    """The per-call floor of a compiled Relax VM function with this model's signature: it
    returns its two inputs (a probability-sized slice and the state) and does nothing else."""
    import tvm
    from tvm import relax

    x = relax.Var("input", relax.TensorType((1, CHUNK + CONTEXT), "float32"))
    st = relax.Var("state", relax.TensorType((2, 1, 128), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, st]):
        with bb.dataflow():
            p = bb.emit(relax.op.strided_slice(x, [1], [0], [1]))
            out = bb.emit_output(relax.Tuple([p, relax.op.add(st, relax.const(0.0))]))
        bb.emit_func_output(out)
    vm = relax.VirtualMachine(tvm.compile(bb.get(), "llvm"), tvm.cpu())
    return autoq_step(vm)


def fixed_model(src: Path, dst: Path) -> None:
    """The file with ``sr`` fixed to 16000 and its If nodes inlined as ``from_onnx`` does
    it (autoq's fold, then ONNX Runtime's constant folding, repeated): what ONNX Runtime's
    quantizers get (they do not quantize inside an If; ONNX Runtime's own optimizer
    crashes on this file when it has to inline the top-level If itself)."""
    import onnx

    from autoq.frontends.control_flow import apply_constant_inputs, fold_ifs
    from autoq.frontends.onnx_model import fix_input_shapes, ort_optimize

    model = onnx.load(str(src))
    apply_constant_inputs(model, {"sr": RATE})
    fix_input_shapes(model, {"input": (1, CHUNK + CONTEXT), "state": (2, 1, 128)})
    fold_ifs(model)
    model = ort_optimize(model, dst.parent)
    while any(n.op_type == "If" for n in model.graph.node) and fold_ifs(model):
        model = ort_optimize(model, dst.parent)
    onnx.save(model, str(dst))


def ort_int8(fixed: Path, calib: list[dict], out: Path, static: bool) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    if not static:  # LSTM -> DynamicQuantizeLSTM, MatMul -> dynamic int8
        quantize_dynamic(str(fixed), str(out), weight_type=QuantType.QInt8, per_channel=True)
        return

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calib)

        def get_next(self):
            return next(self.it, None)

    quantize_static(
        str(fixed), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
    )  # fmt: skip


def cell_state_slots(mod, params) -> tuple[str, ...]:
    """The activation slots of the LSTM cell state: the sum ``f * c + i * g`` that ``tanh``
    reads, its two products and the previous cell state they read (not a gate)."""
    import autoq
    from autoq.ir.toolkit import free_vars, op_name

    sim = autoq.simulate(mod, params, autoq.Config())
    g, slots = sim.graph, set(sim.activation_slots())
    out = []
    for var, value in g.bindings:
        users = [op_name(g.value[u]) for u in g.users.get(var, []) if u in g.value]
        if op_name(value) == "relax.add" and "relax.tanh" in users:
            out.append(var)
            for prod in free_vars(value):
                out.append(prod)
                out += [
                    u
                    for u in free_vars(g.value.get(prod, prod))
                    if u in g.value and op_name(g.value[u]) not in ("relax.sigmoid", "relax.tanh")
                ]
    return tuple(g.ids[v] for v in out if v in g.ids and g.ids[v] in slots)


def log(msg: str) -> None:
    print(f"[recurrent] {msg}", file=sys.stderr, flush=True)


def fidelity(ref: np.ndarray, got: np.ndarray) -> tuple[str, str, str]:
    corr = float(np.corrcoef(ref, got)[0, 1])
    agree = float(np.mean((ref > 0.5) == (got > 0.5)))
    return f"{corr:.4f}", f"{np.abs(ref - got).max():.3f}", f"{agree:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames-timed", type=int, default=300)
    ap.add_argument("--page", default=None)
    args = ap.parse_args()
    if shutil.which("espeak-ng") is None:
        print("espeak-ng is not installed (apt-get install espeak-ng): nothing measured")
        return 0
    try:
        import silero_vad
    except ImportError:
        print("the silero-vad package is not installed (pip install silero-vad): skipped")
        return 0
    import autoq

    src = Path(silero_vad.__file__).parent / "data" / "silero_vad.onnx"
    calib_audio, test_audio = speech_stream(CALIB_TEXT, 0), speech_stream(HELD_OUT_TEXT, 1)
    calib_x, test_x = frames(calib_audio), frames(test_audio)
    print(machine_line())
    print(
        f"\nmodel: silero-vad {silero_vad.__version__ if hasattr(silero_vad, '__version__') else ''} "
        f"`silero_vad.onnx` (If on sr, LSTM 128); speech: espeak-ng, "
        f"{len(calib_x)} calibration frames ({len(CALIB_TEXT)} sentences), "
        f"{len(test_x)} held-out frames ({len(HELD_OUT_TEXT)} sentences), 32 ms each\n"
    )
    fp32 = ort_session(src, threads=1, optimize=True)
    ref, _ = stream(ort_step(fp32, True), test_x)
    _, calib = stream(ort_step(fp32, True), calib_x)
    rows = []
    timed = test_x[: args.frames_timed]

    def latency(step) -> float:
        state = [np.zeros((2, 1, 128), np.float32)]
        it = iter(range(10**9))

        def one():
            x = timed[next(it) % len(timed)]
            _, state[0] = step(x, state[0])

        return median_ms(one, repeats=len(timed), warmup=10)

    rows.append(
        [
            "ONNX Runtime fp32",
            "1.0000",
            "0.000",
            "1.000",
            f"{latency(ort_step(fp32, True)):.3f}",
            "",
        ]
    )
    with tempfile.TemporaryDirectory(prefix="autoq-vad-") as tmp:
        tmp = Path(tmp)
        fixed = tmp / "fixed.onnx"
        fixed_model(src, fixed)
        log("fixed model written")
        for static in (False, True):
            out = tmp / f"ort_{'static' if static else 'dynamic'}.onnx"
            t0 = time.perf_counter()
            ort_int8(fixed, calib, out, static)
            log(f"ORT int8 static={static} written")
            sess = ort_session(out, threads=1, optimize=True)
            got, _ = stream(ort_step(sess, False), test_x)
            name = "ORT quantize_static (QDQ)" if static else "ORT quantize_dynamic"
            rows.append(
                [
                    name,
                    *fidelity(ref, got),
                    f"{latency(ort_step(sess, False)):.3f}",
                    f"{time.perf_counter() - t0:.1f}",
                ]
            )
        t0 = time.perf_counter()
        mod, params = autoq.from_onnx(
            src, {"input": (1, CHUNK + CONTEXT), "state": (2, 1, 128)},
            constant_inputs={"sr": RATE},
        )  # fmt: skip
        log("autoq import done")
        q = autoq.quantize(mod, params, calib)
        log("autoq quantize done")
        vm = autoq.load_library(autoq.export_library(q, tmp / "vad.so"))
        t_q = time.perf_counter() - t0
        got, _ = stream(autoq_step(vm), test_x)
        rows.append(
            ["autoq int8", *fidelity(ref, got), f"{latency(autoq_step(vm)):.3f}", f"{t_q:.1f}"]
        )
        import tvm
        from tvm import relax

        cell = cell_state_slots(mod, params)
        t0 = time.perf_counter()
        q16 = autoq.quantize(mod, params, calib, config=autoq.Config(int16_tensors=cell))
        vm16 = autoq.load_library(autoq.export_library(q16, tmp / "vad16.so"))
        t_q = time.perf_counter() - t0
        got, _ = stream(autoq_step(vm16), test_x)
        rows.append(
            [f"autoq, cell state int16 ({', '.join(cell)})", *fidelity(ref, got),
             f"{latency(autoq_step(vm16)):.3f}", f"{t_q:.1f}"]
        )  # fmt: skip
        from autoq.build import compile as autoq_compile

        f32 = relax.VirtualMachine(autoq_compile(mod, cpu_kernels=False), tvm.cpu())
        w = [tvm.runtime.tensor(params[p.name]) for p in mod["main"].params[2:]]

        def f32_step(x, state):
            out = f32["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(state), *w)
            return out[0].numpy(), out[1].numpy()

        got, _ = stream(f32_step, test_x)
        rows.append(
            ["autoq import, fp32 (TVM)", *fidelity(ref, got), f"{latency(f32_step):.3f}", ""]
        )
    rows.append(
        ["TVM VM call only (output = inputs)", "", "", "", f"{latency(vm_call_step()):.3f}", ""]
    )
    print(
        markdown_table(
            [
                "model",
                "prob. correlation",
                "max abs diff",
                "same side of 0.5",
                "ms / frame",
                "quantize s",
            ],
            rows,
        )
    )
    print(f"\nload average after the run: {load_average()}")
    print(
        "\nms / frame: median over the held-out frames of one call with the state passed "
        "in and out (numpy <-> runtime copies included), one thread. quantize s: "
        "quantization (autoq: import + quantize + export) wall time."
    )
    return 0


if __name__ == "__main__":
    sys.exit(run_benchmark(main, __file__))
