"""PyTorch import: :func:`from_torch` through ``torch.export`` (torch is optional and imported
lazily, extra ``autoq[torch]``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import tvm
from tvm import relax

from autoq.frontends.errors import FrontendError, QuantizedModelError, warnings_quiet
from autoq.frontends.weights import finish_import

__all__ = ["from_torch"]


def _import_torch():
    try:
        import torch
    except ImportError:
        raise ImportError("from_torch needs PyTorch: pip install torch (or autoq[torch])") from None
    return torch


def from_torch(
    module,
    example_inputs,
    *,
    fold_bn: bool = True,
) -> tuple[tvm.IRModule, dict[str, np.ndarray]]:
    """Import a ``torch.nn.Module`` as ``(mod, params)`` via ``torch.export``.

    ``example_inputs``: a tensor, a tuple/list of tensors (positional arguments) or a dict
    (keyword arguments); numpy arrays are accepted. Shapes are taken from them (static).
    The module is exported in eval mode (its training flag is restored afterwards). Weight
    parameters are named by their module path (``layer1.0.conv1.weight``); buffers such as
    batch-norm running statistics become constants; batch norms are folded into the
    preceding convolutions unless ``fold_bn=False``. A single output is returned as a
    tensor, several as a tuple.
    """
    torch = _import_torch()
    from tvm.relax.frontend.torch import from_exported_program

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch takes a torch.nn.Module, got {type(module).__name__}")
    _reject_quantized(torch, module)
    ep = _export(torch, module, example_inputs)
    try:
        with warnings_quiet():
            mod = from_exported_program(
                ep, keep_params_as_input=True, unwrap_unit_return_tuple=True
            )
    except Exception as e:
        raise FrontendError(f"TVM's PyTorch importer failed: {type(e).__name__}: {e}") from e
    mod, _ = relax.frontend.detach_params(mod)
    func = mod["main"]
    rename, params = _parameters(torch, ep, func)
    return finish_import(mod, func, rename, params, fold_bn)


def _reject_quantized(torch, module) -> None:
    """A PT2E-converted model (``quantized_decomposed`` ops) goes to ``import_quantized``."""
    if not isinstance(module, torch.fx.GraphModule):
        return
    ops = sorted(
        {
            str(n.target)
            for n in module.graph.nodes
            if str(n.target).startswith("quantized_decomposed.")
        }
    )
    if ops:
        raise QuantizedModelError(
            f"the torch model is already quantized ({', '.join(ops[:3])}{', ...' if len(ops) > 3 else ''}): "
            "import it with autoq.import_quantized(model, example_inputs=...) to keep its own "
            "scales and zero points, or quantize the float model with autoq.quantize"
        )


def _export(torch, module, example_inputs):
    """``torch.export.export`` of ``module`` in eval mode (its training flag restored)."""

    def to_tensor(x):
        if isinstance(x, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(x))
        return x

    if isinstance(example_inputs, Mapping):
        args, kwargs = (), {k: to_tensor(v) for k, v in example_inputs.items()}
    elif isinstance(example_inputs, tuple | list):
        args, kwargs = tuple(to_tensor(x) for x in example_inputs), {}
    else:
        args, kwargs = (to_tensor(example_inputs),), {}

    was_training = module.training
    try:
        module.eval()
    except NotImplementedError:
        # torch.export's own GraphModules refuse eval(): their graph is already traced
        was_training = None
    try:
        with torch.no_grad():
            return torch.export.export(module, args, kwargs)
    finally:
        if was_training is not None:
            module.train(was_training)


def _parameters(torch, ep, func: relax.Function):
    """``(var -> module path, module path -> array)`` of the exported module's parameters."""
    kind = torch.export.graph_signature.InputKind
    targets = {
        s.arg.name: s.target for s in ep.graph_signature.input_specs if s.kind == kind.PARAMETER
    }
    state = ep.state_dict
    rename: dict[relax.Var, str] = {}
    params: dict[str, np.ndarray] = {}
    for var in func.params:
        if var.name not in targets:
            continue
        target = targets[var.name]
        rename[var] = target
        params[target] = state[target].detach().cpu().numpy()
    return rename, params
