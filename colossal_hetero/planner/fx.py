"""ModelSpec from a torch.fx trace: any traceable model, not only the configs ``hf`` knows.

The model is traced (transformers models with their own tracer, others with ``torch.fx``), its
shapes are propagated on the meta device, and the graph is read as the planner's chain of layers:

* leaf modules that own weights become ops: ``nn.Embedding``, linears (``nn.Linear``, GPT-2's
  ``Conv1D`` and any module holding one 2-D weight of ``in * out`` and a bias), patch
  convolutions (kernel = stride, a linear over patches) and norms;
* matmul-like calls whose two operands both depend on the input (scores, context,
  ``scaled_dot_product_attention``) are attention ops, counted from their shapes;
* cross entropy is the loss.

Dataflow between ops (through every non-op node, along tensor-valued edges) then names the
layers: linears feeding attention are its QKV projection, the first linear reading the attention
is its output projection, linears feeding only another linear are an MLP's up and down
projections, embeddings summed before the first other op are one embedding layer, the linear
feeding the loss is the head, and an ``add`` of two values produced by different layers is a
residual (it opens after the earlier layer and closes at the later). Costs follow the config
path's conventions (``hf``): 2 FLOPs per multiply-add, per-feature constants for norms, lookups
and the loss, elementwise ops (activations, softmax, masks) not counted. Computations that read
no input-dependent value (rotary tables, masks) are shared by all layers and not counted.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn

from colossal_hetero.planner.fx_ops import (
    ADDS,
    Op,
    OpKind,
    collect_ops,
    inputs_of,
    is_tensor,
    op_sources,
    position,
    propagate_shapes,
    trace,
)
from colossal_hetero.planner.spec import (
    LayerKind,
    LayerSpec,
    ModelSpec,
    ShardDim,
    Strategy,
    min_head_groups,
)

# --------------------------------------------------------------------------- layers


@dataclass(frozen=True)
class _AttentionShape:
    """What the QKV projection, the core and the output projection of one attention share."""

    prefix: str
    """Module the projections share (``transformer.h.0.attn``); the core is ``{prefix}.core``."""
    tokens: int
    q_width: int
    qkv_features: int
    head_dim: int
    kv_heads: int
    min_groups: int = 1
    """Fewest key/value groups a rank holds (``spec.min_head_groups`` of the model type)."""

    @property
    def heads_dim(self) -> ShardDim:
        heads = self.q_width // self.head_dim
        group = self.head_dim * (heads // self.kv_heads)
        return ShardDim(self.q_width, group, aligned=False, min_units=self.min_groups)


@dataclass
class _Layer:
    kind: LayerKind
    ops: list[Op]
    free_params: list[str] = field(default_factory=list)
    """Parameters read outside any leaf module (ViT's CLS token): replicated, in ``modules``."""
    extra_params: int = 0
    opens: bool = False
    closes: bool = False
    attention: _AttentionShape | None = None
    inner: int = 0
    """MLP up projection: the width of the hidden (down projection's input) features."""
    vocab_parallel: bool = False
    tied: bool = False

    @property
    def first(self) -> int:
        return min(position(op.node) for op in self.ops)


class _Grouping:
    """Assigns every op to a layer; each pattern claims its ops once, in a fixed order."""

    def __init__(self, ops: list[Op], sources: Mapping[fx.Node, frozenset[int]]) -> None:
        self.ops, self.sources = ops, sources
        self.owner: dict[int, _Layer] = {}
        self.layers: list[_Layer] = []

    def feeding(self, i: int) -> frozenset[int]:
        return inputs_of(self.ops[i], self.sources)

    def claim(self, kind: LayerKind, indices: Iterable[int]) -> _Layer:
        idx = sorted(indices)
        taken = [self.ops[i].node.name for i in idx if i in self.owner]
        assert not taken, f"ops {taken} are already in a layer"
        layer = _Layer(kind, [self.ops[i] for i in idx])
        self.owner.update(dict.fromkeys(idx, layer))
        self.layers.append(layer)
        return layer

    def free(self, i: int, kind: OpKind) -> bool:
        return i not in self.owner and self.ops[i].kind is kind

    def indices(self, kind: OpKind) -> list[int]:
        return [i for i, op in enumerate(self.ops) if op.kind is kind]


def _attention_groups(g: _Grouping) -> list[set[int]]:
    """Attention ops joined by dataflow (the context matmul reads the scores)."""
    groups: list[set[int]] = []
    for i in g.indices(OpKind.ATTENTION):
        feeding = g.feeding(i)
        joined = [s for s in groups if s & feeding]
        groups = [s for s in groups if not s & feeding] + [{i}.union(*joined)]
    return sorted(groups, key=min)


def _group_attention(g: _Grouping, group: set[int]) -> None:
    node = g.ops[min(group)].node.name
    feeding = frozenset().union(*(g.feeding(i) for i in group)) - group
    if not feeding or not all(g.free(i, OpKind.LINEAR) for i in feeding):
        raise ValueError(
            f"attention at node {node}: its queries, keys and values must each come straight from "
            f"a linear projection, got {sorted(g.ops[i].node.name for i in feeding)}"
        )
    readers = [i for i in g.indices(OpKind.LINEAR) if i > max(group) and g.feeding(i) & group]
    if not readers or not g.feeding(readers[0]) <= group:
        raise ValueError(f"attention at node {node}: no linear output projection reads it alone")
    qkv = g.claim(LayerKind.ATTENTION_QKV, feeding)
    core = g.claim(LayerKind.ATTENTION_CORE, group)
    out = g.claim(LayerKind.ATTENTION_OUT, readers[:1])
    shape = _attention_shape(qkv, core, out)
    qkv.attention = core.attention = out.attention = shape


def _attention_shape(qkv: _Layer, core: _Layer, out: _Layer) -> _AttentionShape:
    prefix = _common_parent([op.module for op in qkv.ops])
    head_dim = core.ops[0].head_dim
    q_width = out.ops[0].in_features
    qkv_features = sum(op.out_features for op in qkv.ops)
    heads, rem = divmod(q_width, head_dim)
    kv_heads, kv_rem = divmod(qkv_features - q_width, 2 * head_dim)
    if rem or kv_rem or kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"attention {prefix}: cannot split {q_width} query and {qkv_features - q_width} "
            f"key/value features into whole heads of {head_dim}"
        )
    tokens = out.ops[0].tokens
    return _AttentionShape(prefix, tokens, q_width, qkv_features, head_dim, kv_heads)


def _group_mlps(g: _Grouping) -> None:
    """A linear fed only by unclaimed linears is an MLP's down projection; they are its up."""
    for i in g.indices(OpKind.LINEAR):
        feeding = g.feeding(i)
        if i in g.owner or not feeding or not all(g.free(j, OpKind.LINEAR) for j in feeding):
            continue
        up = g.claim(LayerKind.MLP_UP, feeding)
        down = g.claim(LayerKind.MLP_DOWN, [i])
        up.inner = down.ops[0].in_features


def _group_embeddings(g: _Grouping) -> None:
    """Embeddings summed before the first other op reads them are one layer (word, positions)."""
    for i, op in enumerate(g.ops):
        if op.kind is OpKind.EMBEDDING:
            continue
        summed = [j for j in sorted(g.feeding(i)) if g.free(j, OpKind.EMBEDDING)]
        if summed:
            g.claim(LayerKind.EMBEDDING, summed)
    for j in g.indices(OpKind.EMBEDDING):
        if j not in g.owner:
            g.claim(LayerKind.EMBEDDING, [j])


def _group_heads_and_losses(g: _Grouping) -> None:
    vocabs = {op.in_features for op in g.ops if op.kind is OpKind.EMBEDDING}
    embedding_weights = {op.weight_id for op in g.ops if op.kind is OpKind.EMBEDDING}
    losses = g.indices(OpKind.LOSS)
    if len(losses) > 1:
        names = [g.ops[i].node.name for i in losses]
        raise ValueError(
            f"the trace computes {len(losses)} losses ({names}); the planner needs one"
        )
    for i in losses:
        heads = [j for j in g.feeding(i) if g.free(j, OpKind.LINEAR)]
        vocab_parallel = False
        if len(heads) == 1:
            head_op = g.ops[heads[0]]
            vocab_parallel = head_op.out_features in vocabs
            head = g.claim(LayerKind.LM_HEAD if vocab_parallel else LayerKind.LINEAR, heads)
            head.vocab_parallel = vocab_parallel
            head.tied = head_op.weight_id in embedding_weights
        g.claim(LayerKind.LOSS, [i]).vocab_parallel = vocab_parallel


def _group(ops: list[Op], sources: Mapping[fx.Node, frozenset[int]]) -> list[_Layer]:
    """The layers in chain order (by their first op in the graph)."""
    g = _Grouping(ops, sources)
    for group in _attention_groups(g):
        _group_attention(g, group)
    _group_mlps(g)
    _group_embeddings(g)
    _group_heads_and_losses(g)
    for i, op in enumerate(ops):
        if i not in g.owner:
            g.claim(LayerKind.NORM if op.kind is OpKind.NORM else LayerKind.LINEAR, [i])
    if not g.layers:
        raise ValueError("the trace holds no layer the planner knows (linear, embedding, ...)")
    return sorted(g.layers, key=lambda layer: layer.first)


def _attach_free_params(gm: fx.GraphModule, ops: list[Op], layers: list[_Layer]) -> None:
    """Parameters read outside leaf modules join the layer of the op just before their use."""
    counted = {id(p) for op in ops if op.module for p in gm.get_submodule(op.module).parameters()}
    owner = {op.node: layer for layer in layers for op in layer.ops}
    current = layers[0]
    for node in gm.graph.nodes:
        current = owner.get(node, current)
        if node.op != "get_attr":
            continue
        value = _parameter(gm, str(node.target))
        if value is None or id(value) in counted:
            continue
        counted.add(id(value))
        current.free_params.append(str(node.target))
        current.extra_params += value.numel()


def _parameter(gm: fx.GraphModule, target: str) -> nn.Parameter | None:
    try:
        return gm.get_parameter(target)
    except AttributeError:  # a buffer (position ids, rotary frequencies)
        return None


def _mark_residuals(
    gm: fx.GraphModule,
    ops: list[Op],
    sources: Mapping[fx.Node, frozenset[int]],
    layers: list[_Layer],
) -> None:
    """An add of values from two different layers: the residual opens after the earlier one
    (its output is the skip branch) and closes at the later one."""
    index = {id(op): li for li, layer in enumerate(layers) for op in layer.ops}
    layer_of = [index[id(op)] for op in ops]
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or node.target not in ADDS:
            continue
        operands = [a for a in node.args if is_tensor(a)]
        if len(operands) != 2:
            continue
        if not all(sources[a] for a in operands):
            continue  # a mask or a table: not computed by any layer
        skip, branch = sorted(max(layer_of[i] for i in sources[a]) for a in operands)
        if skip == branch:
            continue  # both sides from one layer (rotary embedding, summed embeddings)
        layers[skip + 1].opens = True
        layers[branch].closes = True


# --------------------------------------------------------------------------- names and specs


def _common_parent(modules: list[str]) -> str:
    parts = [m.split(".")[:-1] for m in modules]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def _fused_name(modules: list[str], *, qkv: bool) -> str:
    """``self_attn.qkv_proj`` for q/k/v_proj, ``attention.self.qkv`` for query/key/value,
    ``mlp.gate_up_proj`` for gate/up_proj: the config path's names for fused layers."""
    leaves = [m.rpartition(".")[2] for m in modules]
    shared = ""
    for chars in zip(*(reversed(leaf) for leaf in leaves), strict=False):
        if len(set(chars)) > 1:
            break
        shared = chars[0] + shared
    suffix = shared[shared.find("_") :] if "_" in shared else ""
    stems = [leaf[: len(leaf) - len(suffix)] for leaf in leaves]
    stem = ("qkv" if qkv else "_".join(stems)) + suffix
    parent = _common_parent(modules)
    return f"{parent}.{stem}" if parent else stem


class _Names:
    """Layer names from module names, in the model's own definition order."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.order = {name: i for i, (name, _) in enumerate(root.named_modules())}

    def display(self, module: str) -> str:
        """A module that is its parent's only child takes the parent's name (ViT's
        ``patch_embeddings.projection`` is ``patch_embeddings``), as the config path names it."""
        parent = module.rpartition(".")[0]
        if parent and len(list(self.root.get_submodule(parent).children())) == 1:
            return parent
        return module

    def modules(self, layer: _Layer) -> list[str]:
        own = sorted({op.module for op in layer.ops}, key=lambda m: self.order.get(m, 0))
        return [self.display(m) for m in own] + layer.free_params

    def name(self, layer: _Layer) -> str:
        if layer.kind is LayerKind.ATTENTION_CORE:
            assert layer.attention is not None
            return f"{layer.attention.prefix}.core"
        if layer.kind is LayerKind.EMBEDDING:
            return self.display(_main_embedding(layer).module)
        modules = self.modules(layer)[: len({op.module for op in layer.ops})]
        if len(modules) == 1:
            return modules[0]
        return _fused_name(modules, qkv=layer.kind is LayerKind.ATTENTION_QKV)


def _same(values: Iterable[int], what: str, layer: str) -> int:
    distinct = set(values)
    if len(distinct) != 1:
        raise ValueError(f"layer {layer}: its projections differ in {what}: {sorted(distinct)}")
    return distinct.pop()


def _linear_spec(layer: _Layer, name: str, modules: tuple[str, ...]) -> LayerSpec:
    tokens = _same((op.tokens for op in layer.ops), "tokens", name)
    fan_in = _same((op.in_features for op in layer.ops), "input features", name)
    fan_out = sum(op.out_features for op in layer.ops)
    in_dim, out_dim, default, flags = _linear_layout(layer, fan_in, fan_out)
    return LayerSpec(
        name=name,
        kind=layer.kind,
        tokens=tokens,
        in_features=fan_in,
        out_features=fan_out,
        flops_per_token=sum(op.flops for op in layer.ops) / tokens,
        weight_params=sum(op.weight for op in layer.ops),
        bias_params=sum(op.bias for op in layer.ops),
        replicated_params=layer.extra_params,
        in_shard=in_dim,
        out_shard=out_dim,
        opens_residual=layer.opens,
        closes_residual=layer.closes,
        default=default,
        modules=modules,
        **flags,
    )


def _linear_layout(
    layer: _Layer, fan_in: int, fan_out: int
) -> tuple[ShardDim, ShardDim, Strategy, dict[str, Any]]:
    """Shard dims, stock strategy and flags of a linear layer, as the config path sets them."""
    kind, att = layer.kind, layer.attention
    if kind is LayerKind.ATTENTION_QKV and att is not None:
        heads = {"num_heads": att.kv_heads, "head_dim": att.head_dim}
        return ShardDim(fan_in), att.heads_dim, Strategy.COLUMN, heads
    if kind is LayerKind.ATTENTION_OUT and att is not None:
        heads = {"num_heads": att.kv_heads, "head_dim": att.head_dim}
        return att.heads_dim, ShardDim(fan_out), Strategy.ROW, heads
    if kind is LayerKind.MLP_UP:
        return ShardDim(fan_in), ShardDim(layer.inner), Strategy.COLUMN, {"saves_output": True}
    if kind is LayerKind.MLP_DOWN:
        return ShardDim(fan_in), ShardDim(fan_out), Strategy.ROW, {}
    if kind is LayerKind.LM_HEAD:
        return ShardDim(fan_in), ShardDim(fan_out), Strategy.COLUMN, {"tied": layer.tied}
    return ShardDim(fan_in), ShardDim(fan_out), Strategy.REPLICATE, {"tied": layer.tied}


def _core_spec(layer: _Layer, name: str) -> LayerSpec:
    att = layer.attention
    assert att is not None
    tokens = att.tokens
    return LayerSpec(
        name=name,
        kind=LayerKind.ATTENTION_CORE,
        tokens=tokens,
        in_features=att.qkv_features,
        out_features=att.q_width,
        flops_per_token=sum(op.flops for op in layer.ops) / tokens,
        in_shard=att.heads_dim,
        out_shard=att.heads_dim,
        num_heads=att.kv_heads,
        head_dim=att.head_dim,
        saves_output=True,
        default=Strategy.COLUMN,
        modules=(att.prefix,),
    )


def _main_embedding(layer: _Layer) -> Op:
    """The word embedding: looked up by the input ids (others by positions or token types)."""
    return next((op for op in layer.ops if op.indexed_by_input), layer.ops[0])


def _embedding_spec(layer: _Layer, name: str, modules: tuple[str, ...]) -> LayerSpec:
    main = _main_embedding(layer)
    rest = sum(op.weight for op in layer.ops if op is not main)
    return LayerSpec(
        name=name,
        kind=LayerKind.EMBEDDING,
        tokens=main.tokens,
        in_features=main.in_features,
        out_features=main.out_features,
        flops_per_token=main.flops / main.tokens,  # a row copy per token; position adds in it
        weight_params=main.weight,
        replicated_params=rest + layer.extra_params,
        in_shard=ShardDim(main.in_features),
        out_shard=ShardDim(main.out_features),
        saves_input=False,
        opens_residual=layer.opens,
        closes_residual=layer.closes,
        default=Strategy.ROW,
        modules=modules,
    )


def _norm_spec(layer: _Layer, name: str, modules: tuple[str, ...]) -> LayerSpec:
    op = layer.ops[0]
    return LayerSpec(
        name=name,
        kind=LayerKind.NORM,
        tokens=op.tokens,
        in_features=op.in_features,
        out_features=op.out_features,
        flops_per_token=op.flops / op.tokens,
        replicated_params=op.replicated + layer.extra_params,
        opens_residual=layer.opens,
        closes_residual=layer.closes,
        modules=modules,
    )


def _loss_spec(layer: _Layer) -> LayerSpec:
    op = layer.ops[0]
    return LayerSpec(
        name="loss",
        kind=LayerKind.LOSS,
        tokens=op.tokens,
        in_features=op.in_features,
        out_features=1,
        flops_per_token=op.flops / op.tokens,
        in_shard=ShardDim(op.in_features),
        default=Strategy.COLUMN if layer.vocab_parallel else Strategy.REPLICATE,
    )


def _spec(layer: _Layer, names: _Names) -> LayerSpec:
    if layer.kind is LayerKind.LOSS:
        return _loss_spec(layer)
    name, modules = names.name(layer), tuple(names.modules(layer))
    if layer.kind is LayerKind.ATTENTION_CORE:
        return _core_spec(layer, name)
    if layer.kind is LayerKind.EMBEDDING:
        return _embedding_spec(layer, name, modules)
    if layer.kind is LayerKind.NORM:
        return _norm_spec(layer, name, modules)
    return _linear_spec(layer, name, modules)


# --------------------------------------------------------------------------- entry point


def _default_inputs(model: nn.Module, seq_len: int | None) -> dict[str, torch.Tensor]:
    """One sample for a transformers model: token ids (or pixels) and labels, on meta."""
    config = getattr(model, "config", None)
    params = inspect.signature(model.forward).parameters
    meta = torch.device("meta")
    if config is not None and "pixel_values" in params:
        size, channels = config.image_size, config.num_channels
        pixels = torch.empty(1, channels, size, size, device=meta)
        return {"pixel_values": pixels, "labels": torch.zeros(1, dtype=torch.long, device=meta)}
    if config is not None and "input_ids" in params:
        if seq_len is None or seq_len < 1:
            raise ValueError(f"seq_len must be >= 1 to trace a text model, got {seq_len}")
        ids = torch.zeros(1, seq_len, dtype=torch.long, device=meta)
        return {"input_ids": ids, "labels": ids}
    raise ValueError(
        f"example_inputs is required for {type(model).__name__}: the forward arguments of one "
        f"sample (only shapes and dtypes are used)"
    )


def _set_min_head_groups(layers: list[_Layer], model_type: str | None) -> None:
    """Let every attention's ranks hold as few head groups as the model type's policy runs
    (0 for GPT-2 and Llama, as ``model_spec_from_hf`` plans them)."""
    min_groups = min_head_groups(model_type)
    for layer in layers:
        if layer.attention is not None:
            layer.attention = replace(layer.attention, min_groups=min_groups)


def model_spec_from_fx(
    model: nn.Module,
    batch_size: int,
    seq_len: int | None = None,
    *,
    example_inputs: Mapping[str, torch.Tensor] | None = None,
    dtype_bytes: int = 4,
) -> ModelSpec:
    """The planner's view of ``model``, read from a torch.fx trace of its forward.

    Transformers models are traced as a meta-device twin built from ``model.config`` (same
    classes and module names), other modules with ``torch.fx``; shapes propagate on the meta
    device, so no weight is copied and nothing is computed. Layer names, kinds, FLOPs and
    parameters follow :func:`model_spec_from_hf` where both apply (tested).

    Args:
        model: a transformers ``PreTrainedModel`` or any fx-traceable ``nn.Module``; include
            the loss in its forward (labels in ``example_inputs``) to plan the loss layer.
        batch_size: samples per optimizer step over all data-parallel ranks.
        seq_len: tokens per sample for a transformers text model without ``example_inputs``.
        example_inputs: keyword arguments of ``model.forward``; the leading dim of the first
            is the example batch, counts are divided by it. Only shapes and dtypes are read.
            Default: token ids and labels (or pixels and labels) of one sample.
        dtype_bytes: bytes per parameter and activation element (4 for fp32, 2 for fp16/bf16).

    Raises:
        ValueError: naming the module or node the trace cannot classify (a module holding
            weights that is no embedding, linear, patch convolution or norm; a weight used
            outside a module; an attention without linear projections), an untraceable model,
            missing inputs, or a non-positive batch size.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if example_inputs is None:
        inputs = _default_inputs(model, seq_len)
    elif example_inputs:
        inputs = dict(example_inputs)
    else:
        raise ValueError("example_inputs is empty: give the forward arguments of one sample")
    first = next(iter(inputs.values()))
    batch = first.shape[0] if first.dim() > 0 else 1
    gm, root = trace(model, inputs)
    propagate_shapes(gm, inputs)
    ops = collect_ops(gm, batch)
    sources = op_sources(gm, ops)
    layers = _group(ops, sources)
    _attach_free_params(gm, ops, layers)
    _mark_residuals(gm, ops, sources, layers)
    names = _Names(root)
    config = getattr(model, "config", None)
    _set_min_head_groups(layers, getattr(config, "model_type", None))
    specs = [_spec(layer, names) for layer in layers]
    return ModelSpec(
        name=getattr(config, "model_type", None) or type(model).__name__,
        layers=tuple(specs),
        batch_size=batch_size,
        seq_len=max(s.tokens for s in specs),
        dtype_bytes=dtype_bytes,
        extra={"heads": getattr(config, "num_attention_heads", None), "source": "fx"},
    )
