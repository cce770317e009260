"""What a torch.fx trace computes: the ops the fx planner reads, with per-sample counts.

Traces a model (transformers models as a meta-device twin with their own tracer, others with
``torch.fx``), propagates shapes on the meta device, and lists the nodes that hold weights or
cost matmul FLOPs (:class:`Op`), each with where its inputs come from. Grouping ops into the
planner's layers is :mod:`.fx`'s job.
"""

from __future__ import annotations

import copy
import inspect
import math
import operator
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from colossal_hetero.planner.hf import _LOSS_FLOPS, _NORM_FLOPS  # the config path's conventions

_MATMULS = {torch.matmul, operator.matmul, torch.bmm, torch.mm, "matmul", "bmm", "mm"}
_BIAS_MATMULS = {torch.baddbmm, torch.addmm, torch.addbmm, "baddbmm", "addmm"}
_LOSSES = {F.cross_entropy, F.nll_loss}
ADDS = {operator.add, operator.iadd, torch.add, "add", "add_", "__add__"}
_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


class OpKind(Enum):
    EMBEDDING = "embedding"
    LINEAR = "linear"
    NORM = "norm"
    ATTENTION = "attention"
    LOSS = "loss"


@dataclass
class Op:
    """A graph node that costs compute or holds weights, with per-sample counts."""

    node: fx.Node
    kind: OpKind
    module: str
    """Qualified module name ("" for a function call)."""
    flops: float
    """Forward FLOPs per sample."""
    tokens: int
    in_features: int
    out_features: int
    weight: int = 0
    bias: int = 0
    replicated: int = 0
    weight_id: int | None = None
    """``id`` of the weight tensor, to find tied weights."""
    head_dim: int = 0
    """Attention ops: features per head (the query's last dim)."""
    indexed_by_input: bool = False
    """Embeddings: looked up by the model input (word ids), not by positions or types."""


# --------------------------------------------------------------------------- tracing


def _owns_weights(module: nn.Module) -> bool:
    """Leaves are the modules that hold parameters and no submodules (Conv1D, RMSNorm, ...)."""
    return any(True for _ in module.parameters(recurse=False)) and not any(
        True for _ in module.children()
    )


class _WeightLeaves:
    """Tracer mixin: keep every weight-owning module a single ``call_module`` node."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return _owns_weights(m) or super().is_leaf_module(m, module_qualified_name)  # type: ignore[misc]


class _Tracer(_WeightLeaves, fx.Tracer):
    pass


@cache
def _hf_tracer_cls() -> type:
    from transformers.utils.fx import HFTracer

    class _HFTracer(_WeightLeaves, HFTracer):
        def iter(self, obj: Any) -> Any:
            # transformers 4.51 unpacks traced shapes (``(*x.shape[:-1], -1, d)``); the proxy
            # carries its meta value, so iterate over that many items.
            meta = getattr(obj, "_metadata", None)
            if meta is None:
                return super().iter(obj)
            return iter([obj[i] for i in range(len(meta))])

    return _HFTracer


def _is_transformers_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # not imported: cannot be its model
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _meta_twin(model: nn.Module) -> nn.Module:
    """The same transformers class, built from a copy of ``model.config`` on the meta device.

    Same module names and tied weights, no memory, and the live model is never touched. The
    twin's ``forward`` is the undecorated one: fx cannot trace through transformers'
    ``*args, **kwargs`` wrappers.
    """
    cls = type(model)
    twin_cls = type(cls.__name__, (cls,), {"forward": inspect.unwrap(cls.forward)})
    config = copy.deepcopy(model.config)
    config.use_cache = False
    with torch.device("meta"):
        return twin_cls(config)


def _concrete_args(forward: Any, inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Every ``forward`` argument not in ``inputs``, fixed to its default."""
    params = inspect.signature(forward).parameters
    unknown = sorted(set(inputs) - set(params))
    if unknown:
        raise ValueError(f"example_inputs: {unknown} are not arguments of the model's forward")
    concrete: dict[str, Any] = {}
    for p in params.values():
        if p.name in inputs or p.kind is p.VAR_POSITIONAL:
            continue
        if p.kind is p.VAR_KEYWORD:
            concrete[p.name] = {}
        elif p.default is p.empty:
            raise ValueError(f"example_inputs: the model's forward needs argument {p.name!r}")
        else:
            concrete[p.name] = p.default
    return concrete


def trace(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> tuple[fx.GraphModule, nn.Module]:
    """The graph module and the root it was traced from (``model`` or its meta twin)."""
    if _is_transformers_model(model):
        root = _meta_twin(model)
        tracer = _hf_tracer_cls()()
        trace_kwargs = {
            "dummy_inputs": dict(inputs),
            "complete_concrete_args_with_inputs_not_in_dummy_inputs": False,
        }
    else:
        root, tracer, trace_kwargs = model, _Tracer(), {}
    try:
        graph = tracer.trace(
            root, concrete_args=_concrete_args(root.forward, inputs), **trace_kwargs
        )
    except (fx.proxy.TraceError, TypeError) as error:  # proxies in control flow or ctors
        raise ValueError(f"cannot trace {type(model).__name__} with torch.fx: {error}") from None
    return fx.GraphModule(tracer.root, graph), tracer.root


# --------------------------------------------------------------------------- shapes


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


class _MetaShapeProp(ShapeProp):
    """ShapeProp on the meta device.

    Meta tensors carry shapes and dtypes through every op without memory or arithmetic, so a
    billion-parameter model costs what a tiny one does, and a live model's weights are read as
    meta views (no copy). ShapeProp on small real inputs would run a real forward instead.
    """

    def fetch_attr(self, target: str) -> Any:
        return _to_meta(super().fetch_attr(target))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(target)
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        meta = {name: t.to("meta") for name, t in state.items()}
        return torch.func.functional_call(module, meta, tuple(args), dict(kwargs))


def propagate_shapes(gm: fx.GraphModule, inputs: Mapping[str, torch.Tensor]) -> None:
    args = []
    for node in gm.graph.find_nodes(op="placeholder"):
        default = node.args[0] if node.args else None
        args.append(_to_meta(inputs[node.target]) if node.target in inputs else default)
    try:
        _MetaShapeProp(gm).propagate(*args)
    except RuntimeError as error:
        raise ValueError(f"shape propagation on the meta device failed: {error}") from None


def _shape(node: Any) -> tuple[int, ...]:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    if meta is None or not hasattr(meta, "shape"):
        raise ValueError(f"node {getattr(node, 'name', node)}: expected a tensor")
    return tuple(meta.shape)


def is_tensor(node: Any) -> bool:
    return isinstance(node, fx.Node) and "tensor_meta" in node.meta


def position(node: fx.Node) -> int:
    return node.meta["fx_position"]


# --------------------------------------------------------------------------- ops


def _module_op(node: fx.Node, module: nn.Module, batch: int) -> Op | None:
    """The op of a leaf module call, None for weightless modules (dropout, activations)."""
    name = str(node.target)
    if isinstance(module, nn.CrossEntropyLoss | nn.NLLLoss):
        return _loss_op(node, name, batch)
    if not isinstance(module, _NORMS) and not any(True for _ in module.parameters()):
        return None
    x, y = _shape(node.args[0]), _shape(node)
    numel = math.prod(y) / batch
    params = dict(module.named_parameters())
    if isinstance(module, nn.Embedding):
        w = module.weight
        tokens = int(numel // w.shape[1])
        return Op(node, OpKind.EMBEDDING, name, numel, tokens, w.shape[0], w.shape[1],
                   weight=w.numel(), weight_id=id(w))  # fmt: skip
    if isinstance(module, nn.Conv2d) and _is_patch_conv(module):
        fan_in = module.in_channels * math.prod(module.kernel_size)
        tokens = int(numel // module.out_channels)
        return _linear_op(node, name, params, fan_in, module.out_channels, tokens)
    if _is_linear(params, x[-1], y[-1]):
        return _linear_op(node, name, params, x[-1], y[-1], int(numel // y[-1]))
    if _is_norm(module, params, x, y):
        width = y[-1]
        replicated = sum(p.numel() for p in params.values())
        return Op(node, OpKind.NORM, name, _NORM_FLOPS * numel, int(numel // width), width,
                   width, replicated=replicated)  # fmt: skip
    raise ValueError(
        f"module {name} ({type(module).__name__}) holds weights but is not an embedding, linear, "
        f"patch convolution or norm: the fx planner cannot classify it"
    )


def _is_patch_conv(conv: nn.Conv2d) -> bool:
    return tuple(conv.kernel_size) == tuple(conv.stride) and conv.padding in ((0, 0), "valid")


def _is_linear(params: Mapping[str, torch.Tensor], fan_in: int, fan_out: int) -> bool:
    weight, bias = params.get("weight"), params.get("bias")
    return (
        set(params) <= {"weight", "bias"}
        and weight is not None
        and weight.dim() == 2
        and sorted(weight.shape) == sorted((fan_in, fan_out))
        and (bias is None or tuple(bias.shape) == (fan_out,))
    )


def _is_norm(
    module: nn.Module, params: Mapping[str, torch.Tensor], x: tuple[int, ...], y: tuple[int, ...]
) -> bool:
    per_feature = all(tuple(p.shape) == (y[-1],) for p in params.values())
    return x == y and per_feature and "norm" in type(module).__name__.lower()


def _linear_op(
    node: fx.Node,
    name: str,
    params: Mapping[str, torch.Tensor],
    fan_in: int,
    fan_out: int,
    tokens: int,
) -> Op:
    weight, bias = params["weight"], params.get("bias")
    return Op(
        node,
        OpKind.LINEAR,
        name,
        2.0 * tokens * fan_in * fan_out,
        tokens,
        fan_in,
        fan_out,
        weight=weight.numel(),
        bias=0 if bias is None else bias.numel(),
        weight_id=id(weight),
    )


def _loss_op(node: fx.Node, name: str, batch: int) -> Op:
    logits = _shape(node.args[0] if node.args else node.kwargs["input"])
    classes = logits[-1]
    tokens = int(math.prod(logits) / batch // classes)
    return Op(node, OpKind.LOSS, name, _LOSS_FLOPS * tokens * classes, tokens, classes, 1)


def _matmul_operands(node: fx.Node) -> list[Any] | None:
    """The operands whose product the node computes, None if it is no matmul-like call."""
    target = node.target
    if node.op not in ("call_function", "call_method"):
        return None
    if target in _MATMULS:
        return list(node.args[:2])
    if target in _BIAS_MATMULS:
        return list(node.args[1:3])
    if target is F.scaled_dot_product_attention:
        return list(node.args[:3])
    if target is F.linear:
        return [node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs["weight"]]
    if target is torch.einsum:
        return list(node.args[1:])
    return None


def _matmul_flops(node: fx.Node, operands: list[Any]) -> float:
    """Forward FLOPs of a matmul-like node, from its operand and output shapes."""
    if node.target is F.scaled_dot_product_attention:
        q, k, v = (_shape(o) for o in operands)
        rows = math.prod(q[:-1])  # batch x heads x query tokens
        return 2.0 * rows * k[-2] * (q[-1] + v[-1])  # scores and context
    if node.target is torch.einsum:
        sizes: dict[str, int] = {}
        lhs = str(node.args[0]).replace(" ", "").split("->")[0]
        for letters, operand in zip(lhs.split(","), operands, strict=True):
            sizes.update(zip(letters, _shape(operand), strict=False))
        return 2.0 * math.prod(sizes.values())
    return 2.0 * math.prod(_shape(node)) * _shape(operands[0])[-1]


def _call_op(node: fx.Node, is_data: Mapping[fx.Node, bool], batch: int) -> Op | None:
    """The op of a function or method call: a loss, an attention matmul, or None."""
    if node.op == "call_function" and node.target in _LOSSES:
        return _loss_op(node, "", batch)
    operands = _matmul_operands(node)
    if operands is None:
        return None
    data = [o for o in operands if is_data.get(o, False)]
    if not data:
        return None  # rotary tables, masks: no input-dependent operand, shared by every layer
    if len(data) == 1:
        raise ValueError(
            f"node {node.name} ({node.target}) multiplies an activation by a weight outside a "
            f"module: the fx planner cannot classify it (use nn.Linear, or tie the module's weight)"
        )
    flops = _matmul_flops(node, operands) / batch
    # Tokens and features come from the projections around it.
    return Op(node, OpKind.ATTENTION, "", flops, 0, 0, 0, head_dim=_shape(operands[0])[-1])


def collect_ops(gm: fx.GraphModule, batch: int) -> list[Op]:
    """Ops in graph order; records each node's position and whether it depends on the input."""
    ops: list[Op] = []
    is_data: dict[fx.Node, bool] = {}
    for i, node in enumerate(gm.graph.nodes):
        node.meta["fx_position"] = i
        is_data[node] = node.op == "placeholder" or any(
            is_data.get(n, False) for n in node.all_input_nodes if is_tensor(n)
        )
        if node.op == "call_module":
            op = _module_op(node, gm.get_submodule(str(node.target)), batch)
            if op is not None and op.kind is OpKind.EMBEDDING:
                op.indexed_by_input = is_data.get(node.args[0], False)
        elif is_data[node]:
            op = _call_op(node, is_data, batch)
        else:
            op = None
        if op is not None:
            ops.append(op)
    return ops


def op_sources(gm: fx.GraphModule, ops: list[Op]) -> dict[fx.Node, frozenset[int]]:
    """For every node, the ops (indices) its value comes from through non-op nodes."""
    index = {op.node: i for i, op in enumerate(ops)}
    sources: dict[fx.Node, frozenset[int]] = {}
    for node in gm.graph.nodes:
        if node in index:
            sources[node] = frozenset((index[node],))
        else:
            parents = [sources[n] for n in node.all_input_nodes if is_tensor(n)]
            sources[node] = frozenset().union(*parents)
    return sources


def inputs_of(op: Op, sources: Mapping[fx.Node, frozenset[int]]) -> frozenset[int]:
    """The ops feeding ``op``."""
    return frozenset().union(*(sources[n] for n in op.node.all_input_nodes if is_tensor(n)))
