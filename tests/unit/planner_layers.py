"""Small ``LayerSpec`` builders for planner tests (search, SFB): hand-sized layers whose costs
the tests can reason about."""

from __future__ import annotations

from colossal_hetero.planner.spec import LayerKind, LayerSpec, ShardDim, Strategy


def linear(name, kind, fan_in, fan_out, tokens=16, heads=0, **kw) -> LayerSpec:
    """A linear layer of ``kind``; attention projections split by whole heads."""
    in_dim = ShardDim(fan_in, fan_in // heads if heads and kind is LayerKind.ATTENTION_OUT else 1)
    out_dim = ShardDim(
        fan_out, fan_out // heads if heads and kind is LayerKind.ATTENTION_QKV else 1
    )
    return LayerSpec(
        name=name,
        kind=kind,
        tokens=tokens,
        in_features=fan_in,
        out_features=fan_out,
        flops_per_token=2.0 * fan_in * fan_out,
        weight_params=fan_in * fan_out,
        bias_params=fan_out,
        in_shard=in_dim,
        out_shard=out_dim,
        num_heads=heads,
        **kw,
    )


def norm(name, width, tokens=16, **kw) -> LayerSpec:
    """A layer norm with weight and bias."""
    return LayerSpec(
        name=name,
        kind=LayerKind.NORM,
        tokens=tokens,
        in_features=width,
        out_features=width,
        flops_per_token=8.0 * width,
        replicated_params=2 * width,
        **kw,
    )


def loss(classes, tokens=16) -> LayerSpec:
    """Cross entropy over ``classes`` logits, vocab-parallel by default."""
    return LayerSpec(
        name="loss",
        kind=LayerKind.LOSS,
        tokens=tokens,
        in_features=classes,
        out_features=1,
        flops_per_token=4.0 * classes,
        in_shard=ShardDim(classes),
        default=Strategy.COLUMN,
    )


def embedding(vocab, width, tokens=16) -> LayerSpec:
    """A vocab-parallel embedding table."""
    return LayerSpec(
        name="embed",
        kind=LayerKind.EMBEDDING,
        tokens=tokens,
        in_features=vocab,
        out_features=width,
        flops_per_token=float(width),
        weight_params=vocab * width,
        in_shard=ShardDim(vocab),
        out_shard=ShardDim(width),
        saves_input=False,
        default=Strategy.ROW,
    )
