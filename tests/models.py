"""Small hand-built fp32 Relax models shared by the tests (BlockBuilder, named weights).

Each builder returns ``(mod, params, make_data)`` where ``params`` maps weight parameter
names to arrays and ``make_data(n, seed)`` gives ``n`` samples for the single input ``x``.
Weights use module-path names (``block.conv1.weight``) like the frontends produce.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

F32 = "float32"

#: Tests compile with LLVM opt-level 0: 4x faster builds, same IEEE arithmetic. One test
#: (test_end_to_end) checks bit-exactness with the optimizing default target too.
TARGET = tvm.target.Target({"kind": "llvm", "opt-level": 0})


class Builder:
    """Tiny helper: declare inputs and named weights, emit ops, get (mod, params)."""

    def __init__(self, seed: int = 0):
        self.bb = relax.BlockBuilder()
        self.rng = np.random.default_rng(seed)
        self.inputs: list[relax.Var] = []
        self.weights: list[relax.Var] = []
        self.params: dict[str, np.ndarray] = {}

    def input(self, name, shape):
        v = relax.Var(name, relax.TensorType(list(shape), F32))
        self.inputs.append(v)
        return v

    def weight(self, name, array):
        array = np.asarray(array, np.float32)
        v = relax.Var(name, relax.TensorType(list(array.shape), F32))
        self.weights.append(v)
        self.params[name] = array
        return v

    def randw(self, name, shape, scale=None):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
        scale = scale if scale is not None else 1.0 / np.sqrt(fan_in)
        return self.weight(name, self.rng.normal(size=shape).astype(np.float32) * scale)

    def build(self, body_fn):
        # weights are declared while the body is built, so the function is assembled last
        self.bb._begin_dataflow_block()
        gv = self.bb.emit_output(body_fn(self))
        block = self.bb._end_block()
        func = relax.Function(self.inputs + self.weights, relax.SeqExpr([block], gv), gv.ty)
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        return relax.transform.Normalize()(mod), self.params

    def emit(self, expr):
        return self.bb.emit(expr)


def conv(b, x, name, cin, cout, k=3, stride=1, pad=1, groups=1, bias=True):
    w = b.randw(f"{name}.weight", (cout, cin // groups, k, k))
    y = b.emit(relax.op.nn.conv2d(x, w, strides=stride, padding=pad, groups=groups))
    if bias:
        bv = b.weight(f"{name}.bias", b.rng.normal(size=(cout,)) * 0.1)
        y = b.emit(relax.op.add(y, relax.op.reshape(bv, [1, cout, 1, 1])))
    return y


def image_data(shape, seed=0, n=4):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=shape).astype(np.float32) for _ in range(n)]


def small_cnn(seed=0):
    """conv-bias-relu -> residual block (conv-bias-relu, conv-bias + add, relu) -> maxpool ->
    depthwise conv -> global average pool -> flatten -> dense-bias."""
    b = Builder(seed)
    x = b.input("x", (1, 3, 16, 16))

    def body(b):
        y = b.emit(relax.op.nn.relu(conv(b, x, "stem", 3, 8)))
        r = b.emit(relax.op.nn.relu(conv(b, y, "block.conv1", 8, 8)))
        r = conv(b, r, "block.conv2", 8, 8)
        y = b.emit(relax.op.nn.relu(b.emit(relax.op.add(r, y))))
        y = b.emit(relax.op.nn.max_pool2d(y, pool_size=2, strides=2))
        y = b.emit(relax.op.nn.relu(conv(b, y, "dw", 8, 8, groups=8)))
        y = b.emit(relax.op.mean(y, axis=[2, 3], keepdims=True))
        y = b.emit(relax.op.reshape(y, [1, 8]))
        w = b.randw("fc.weight", (10, 8))
        fb = b.weight("fc.bias", b.rng.normal(size=(10,)) * 0.1)
        y = b.emit(relax.op.matmul(y, relax.op.permute_dims(w, [1, 0])))
        return b.emit(relax.op.add(y, fb))

    mod, params = b.build(body)
    return mod, params, lambda n=4, seed=1: image_data((1, 3, 16, 16), seed, n)


def mlp(seed=0):
    """dense-bias-relu -> dense-bias -> clip(0, 6) -> dense."""
    b = Builder(seed)
    x = b.input("x", (2, 16))

    def body(b):
        w1, b1 = (
            b.randw("fc1.weight", (32, 16)),
            b.weight("fc1.bias", b.rng.normal(size=(32,)) * 0.1),
        )
        y = b.emit(relax.op.add(b.emit(relax.op.matmul(x, relax.op.permute_dims(w1, [1, 0]))), b1))
        y = b.emit(relax.op.nn.relu(y))
        w2, b2 = (
            b.randw("fc2.weight", (32, 32)),
            b.weight("fc2.bias", b.rng.normal(size=(32,)) * 0.1),
        )
        y = b.emit(relax.op.add(b.emit(relax.op.matmul(y, relax.op.permute_dims(w2, [1, 0]))), b2))
        y = b.emit(relax.op.clip(y, 0.0, 6.0))
        w3 = b.randw("fc3.weight", (4, 32))
        return b.emit(relax.op.matmul(y, relax.op.permute_dims(w3, [1, 0])))

    mod, params = b.build(body)
    return mod, params, lambda n=4, seed=1: image_data((2, 16), seed, n)


def attention(seed=0, seq=8, dim=16):
    """Single-head self-attention with a residual: q/k/v dense-bias, q @ k^T, scale, softmax,
    @ v, output dense-bias + residual add (the transformer block shape)."""
    b = Builder(seed)
    x = b.input("x", (1, seq, dim))

    def dense(name, y, bias=True):
        w = b.randw(f"{name}.weight", (dim, dim))
        out = b.emit(relax.op.matmul(y, relax.op.permute_dims(w, [1, 0])))
        if bias:
            out = b.emit(
                relax.op.add(out, b.weight(f"{name}.bias", b.rng.normal(size=(dim,)) * 0.1))
            )
        return out

    def body(b):
        q, k, v = dense("attn.q", x), dense("attn.k", x), dense("attn.v", x)
        s = b.emit(relax.op.matmul(q, b.emit(relax.op.permute_dims(k, [0, 2, 1]))))
        s = b.emit(relax.op.multiply(s, relax.const(1.0 / np.sqrt(dim), F32)))
        p = b.emit(relax.op.nn.softmax(s, axis=-1))
        a = b.emit(relax.op.matmul(p, v))
        o = dense("attn.out", a)
        return b.emit(relax.op.add(o, x))

    mod, params = b.build(body)
    return mod, params, lambda n=4, seed=1: image_data((1, seq, dim), seed, n)


#: the LayerNorm block's sizes (sequence, hidden, FFN) and its outlier channel: LayerNorm
#: gamma of this channel is 40x the others (BERT's LN outliers); the dense layers reading it
#: have 40x smaller weights there (so it does not dominate their outputs)
LN_SEQ, LN_DIM, LN_HID, LN_OUTLIER = 16, 16, 32, 5


def ln_block(seed=0):
    """LN1 (outlier gamma) -> dense (weight transposed, as exported) -> gelu -> dense, + LN1
    output (post-LN residual: LN1 has another reader) -> LN2 (outlier gamma) -> dense (a
    (K, N) weight; LN2's only reader: pre-LN style). SmoothQuant's test model."""
    b = Builder(seed)
    x = b.input("x", (1, LN_SEQ, LN_DIM))
    dim, out = LN_DIM, LN_OUTLIER

    def ln(name, y):
        gamma = np.ones(dim)
        gamma[out] = 40.0
        beta = b.rng.normal(size=dim) * 0.1
        return b.emit(relax.op.nn.layer_norm(y, b.weight(f"{name}.weight", gamma),
                                             b.weight(f"{name}.bias", beta), [-1]))  # fmt: skip

    def dense_t(name, y, n_in, n_out):
        w = b.randw(f"{name}.weight", (n_out, n_in))
        if n_in == dim:  # reads an LN output: small weights on the outlier channel, as trained
            b.params[f"{name}.weight"][:, out] /= 40.0
        h = b.emit(relax.op.matmul(y, relax.op.permute_dims(w, [1, 0])))
        return b.emit(relax.op.add(h, b.weight(f"{name}.bias", b.rng.normal(size=n_out) * 0.1)))

    def body(b):
        h = ln("ln1", x)
        f = b.emit(relax.op.nn.gelu(dense_t("ffn.in", h, dim, LN_HID)))
        h2 = ln("ln2", b.emit(relax.op.add(dense_t("ffn.out", f, LN_HID, dim), h)))
        head = b.randw("head", (dim, dim))
        b.params["head"][out] /= 40.0
        return b.emit(relax.op.matmul(h2, head))

    mod, params = b.build(body)
    return mod, params, ln_block_data


def ln_block_data(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(1, LN_SEQ, LN_DIM)).astype(np.float32) for _ in range(n)]


def op_sequence(mod) -> list[tuple[str, str]]:
    """(op, output dtype) of every binding of ``main``, in order (``relax.`` prefix dropped)."""
    out = []
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            is_op = isinstance(v, tvm.ir.Call) and hasattr(v.op, "name")
            name = v.op.name if is_op else type(v).__name__
            dtype = str(b.var.ty.dtype) if hasattr(b.var.ty, "dtype") else ""
            out.append((name.removeprefix("relax."), dtype))
    return out


def build_tuple_module(inputs: dict[str, np.ndarray], body) -> tvm.IRModule:
    """``main(*inputs) -> Tuple(body(*vars))``: one module computing several outputs."""
    bb = relax.BlockBuilder()
    params = [
        relax.Var(n, relax.TensorType(list(a.shape), str(a.dtype))) for n, a in inputs.items()
    ]
    with bb.function("main", params):
        with bb.dataflow():
            outs = [bb.emit(e) for e in body(*params)]
            gv = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(gv)
    return bb.get()


def run_tuple(inputs: dict[str, np.ndarray], body, target=None) -> list[np.ndarray]:
    """Compile ``build_tuple_module(inputs, body)``, run it, return every output as numpy."""
    ex = tvm.compile(build_tuple_module(inputs, body), target or TARGET)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return [
        r.numpy()
        for r in vm["main"](*[tvm.runtime.tensor(np.array(a, order="C")) for a in inputs.values()])
    ]


def run(mod: tvm.IRModule, inputs: list, params: dict | None = None, target=None) -> np.ndarray:
    """Compile and run ``main`` on the llvm target (params appended in parameter order)."""
    target = target or TARGET
    ex = tvm.compile(mod, target)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    args = [tvm.runtime.tensor(np.asarray(a)) for a in inputs]
    if params:
        names = [p.name for p in mod["main"].params]
        args += [tvm.runtime.tensor(params[n]) for n in names if n in params]
    out = vm["main"](*args)
    return out.numpy() if hasattr(out, "numpy") else [o.numpy() for o in out]


class Runner:
    """Compile once, run many samples."""

    def __init__(self, mod, params=None, target=None):
        target = target or TARGET
        self.vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())
        names = [p.name for p in mod["main"].params]
        self.extra = [tvm.runtime.tensor(params[n]) for n in names if params and n in params]

    def __call__(self, *inputs, extra=()):
        out = self.vm["main"](
            *[tvm.runtime.tensor(np.asarray(a)) for a in inputs], *self.extra, *extra
        )
        return out.numpy() if hasattr(out, "numpy") else [o.numpy() for o in out]


def conv2d_nchw(x: np.ndarray, w: np.ndarray, pad: int = 0) -> np.ndarray:
    """Plain numpy NCHW x OIHW convolution, stride 1, groups 1 (dtype of the inputs' product)."""
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, _, h, wd = x.shape
    o, _, kh, kw = w.shape
    out = np.zeros((n, o, h - kh + 1, wd - kw + 1), dtype=np.result_type(x, w))
    for i in range(kh):
        for j in range(kw):
            patch = x[:, :, i : i + out.shape[2], j : j + out.shape[3]]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    return out


def two_convs(seed=0):
    """x -> conv c1 (+bias) -> relu -> conv c2 (+bias)."""
    b = Builder(seed)
    x = b.input("x", (1, 3, 8, 8))

    def body(b):
        y = b.emit(relax.op.nn.relu(conv(b, x, "c1", 3, 4)))
        return conv(b, y, "c2", 4, 2)

    mod, params = b.build(body)
    return mod, params, lambda n=4, seed=1: image_data((1, 3, 8, 8), seed, n)


def torch_cnn():
    """``(torch, net)``: a tiny torch CNN (stem conv + hardswish, a residual block with a
    depthwise conv, a sigmoid gate, a 2x2 average pool and a linear classifier) for
    1x3x16x16 inputs; skips the test when torch is not installed."""
    import pytest

    torch = pytest.importorskip("torch", reason="torch is not installed (autoq[torch])")
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
            self.pw = nn.Conv2d(8, 8, 1)
            self.act = nn.Hardswish()

        def forward(self, x):
            return x + self.pw(self.act(self.dw(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.act = nn.Hardswish()
            self.block = Block()
            self.gate = nn.Conv2d(8, 8, 1)
            self.pool = nn.AvgPool2d(2)
            self.fc = nn.Linear(8 * 4 * 4, 10)

        def forward(self, x):
            y = self.block(self.act(self.stem(x)))
            y = y * torch.sigmoid(self.gate(y))
            return self.fc(torch.flatten(self.pool(y), 1))

    torch.manual_seed(0)
    return torch, Net().eval()
