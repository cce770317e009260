"""ModelSpec from a Hugging Face transformers config (GPT-2, Llama, BERT, ViT).

Duck-typed on the config's attributes, so this module imports neither transformers nor torch.
Layer names are module paths of the matching ``*LMHeadModel`` / ``*ForCausalLM`` /
``*ForMaskedLM`` / ``*ForImageClassification`` class; ``LayerSpec.modules`` lists the modules a
fused layer covers (q, k and v for a QKV projection). FLOPs count a multiply-add as 2.
"""

from __future__ import annotations

from typing import Any

from colossal_hetero.planner.spec import (
    LayerKind,
    LayerSpec,
    ModelSpec,
    ShardDim,
    Strategy,
    min_head_groups,
)

_NORM_FLOPS = 8
"""Forward FLOPs per feature of a layer norm (mean, variance, normalise, scale, shift)."""

_LOSS_FLOPS = 4
"""Forward FLOPs per logit of softmax cross entropy (max, exp, sum, log)."""


def _norm(name: str, width: int, tokens: int, *, params: int, opens: bool = False) -> LayerSpec:
    return LayerSpec(
        name=name,
        kind=LayerKind.NORM,
        tokens=tokens,
        in_features=width,
        out_features=width,
        flops_per_token=_NORM_FLOPS * width,
        replicated_params=params,
        opens_residual=opens,
        modules=(name,),
    )


def _linear(
    name: str,
    kind: LayerKind,
    tokens: int,
    in_dim: ShardDim,
    out_dim: ShardDim,
    *,
    in_features: int | None = None,
    out_features: int | None = None,
    bias: bool = True,
    default: Strategy = Strategy.REPLICATE,
    modules: tuple[str, ...] | None = None,
    **flags: Any,
) -> LayerSpec:
    # Fused projections (QKV, gate+up) have more features than their shard dim's width units.
    fan_in = in_features or in_dim.size
    fan_out = out_features or out_dim.size
    return LayerSpec(
        name=name,
        kind=kind,
        tokens=tokens,
        in_features=fan_in,
        out_features=fan_out,
        flops_per_token=2.0 * fan_in * fan_out,
        weight_params=fan_in * fan_out,
        bias_params=fan_out if bias else 0,
        in_shard=in_dim,
        out_shard=out_dim,
        default=default,
        modules=modules or (name,),
        **flags,
    )


def _attention(
    prefix: str,
    *,
    qkv: tuple[str, str],
    out: str,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    tokens: int,
    bias: bool,
    opens: bool,
    min_groups: int,
) -> list[LayerSpec]:
    """QKV projection, head-local attention core and output projection of one block.

    ``qkv`` is (layer name, its Hugging Face modules joined by "|"), so separate q/k/v modules
    and GPT-2's fused c_attn both become one layer. Widths count query features; each device
    holds whole key/value heads with their group of query heads, and at least ``min_groups``
    of them (``spec.min_head_groups`` of the model type).
    """
    hidden_dim = ShardDim(hidden)
    q_width = heads * head_dim
    group = head_dim * (heads // kv_heads)
    heads_dim = ShardDim(q_width, group, aligned=False, min_units=min_groups)
    qkv_features = q_width + 2 * kv_heads * head_dim
    name, modules = qkv
    return [
        _linear(
            name,
            LayerKind.ATTENTION_QKV,
            tokens,
            hidden_dim,
            heads_dim,
            out_features=qkv_features,
            bias=bias,
            default=Strategy.COLUMN,
            modules=tuple(modules.split("|")),
            num_heads=kv_heads,
            head_dim=head_dim,
            opens_residual=opens,
        ),
        _attention_core(prefix, tokens, qkv_features, heads_dim, kv_heads, head_dim),
        _linear(
            out,
            LayerKind.ATTENTION_OUT,
            tokens,
            heads_dim,
            hidden_dim,
            in_features=q_width,
            out_features=hidden,
            bias=bias,
            default=Strategy.ROW,
            num_heads=kv_heads,
            head_dim=head_dim,
            closes_residual=True,
        ),
    ]


def _attention_core(
    prefix: str,
    tokens: int,
    qkv_features: int,
    heads_dim: ShardDim,
    kv_heads: int,
    head_dim: int,
) -> LayerSpec:
    """The head-local attention core (QK^T, softmax, times V) between QKV and the output."""
    q_width = heads_dim.size
    return LayerSpec(
        name=f"{prefix}.core",
        kind=LayerKind.ATTENTION_CORE,
        tokens=tokens,
        in_features=qkv_features,
        out_features=q_width,
        # QK^T and softmax(.)V: 2 * tokens * q_width FLOPs per token each (causal masks
        # are not skipped by the eager/SDPA kernels Colossal-AI runs on CPU).
        flops_per_token=4.0 * tokens * q_width,
        in_shard=heads_dim,
        out_shard=heads_dim,
        num_heads=kv_heads,
        head_dim=head_dim,
        saves_output=True,
        default=Strategy.COLUMN,
        modules=(prefix,),
    )


def _mlp(
    up: tuple[str, str],
    down: str,
    *,
    hidden: int,
    inner: int,
    tokens: int,
    bias: bool,
    gated: bool,
    opens: bool,
) -> list[LayerSpec]:
    """Up projection (gate and up fused when ``gated``) and down projection of one block."""
    name, modules = up
    hidden_dim, inner_dim = ShardDim(hidden), ShardDim(inner)
    return [
        _linear(
            name,
            LayerKind.MLP_UP,
            tokens,
            hidden_dim,
            inner_dim,
            out_features=inner * (2 if gated else 1),
            bias=bias,
            default=Strategy.COLUMN,
            modules=tuple(modules.split("|")),
            saves_output=True,  # the activation function's input
            opens_residual=opens,
        ),
        _linear(
            down,
            LayerKind.MLP_DOWN,
            tokens,
            inner_dim,
            hidden_dim,
            bias=bias,
            default=Strategy.ROW,
            closes_residual=True,
        ),
    ]


def _embedding(
    name: str, vocab: int, hidden: int, tokens: int, *, replicated: int, modules: tuple[str, ...]
) -> LayerSpec:
    return LayerSpec(
        name=name,
        kind=LayerKind.EMBEDDING,
        tokens=tokens,
        in_features=vocab,
        out_features=hidden,
        flops_per_token=float(hidden),  # a row copy (and the position add)
        weight_params=vocab * hidden,
        replicated_params=replicated,
        in_shard=ShardDim(vocab),
        out_shard=ShardDim(hidden),
        saves_input=False,  # token ids: negligible
        default=Strategy.ROW,  # Colossal-AI's vocab-parallel embedding
        modules=modules,
    )


def _head_and_loss(
    name: str,
    hidden: int,
    classes: int,
    tokens: int,
    *,
    tied: bool,
    bias: bool,
    vocab_parallel: bool,
) -> list[LayerSpec]:
    default = Strategy.COLUMN if vocab_parallel else Strategy.REPLICATE
    classes_dim = ShardDim(classes)
    return [
        _linear(
            name,
            LayerKind.LM_HEAD if vocab_parallel else LayerKind.LINEAR,
            tokens,
            ShardDim(hidden),
            classes_dim,
            bias=bias,
            default=default,
            tied=tied,
        ),
        LayerSpec(
            name="loss",
            kind=LayerKind.LOSS,
            tokens=tokens,
            in_features=classes,
            out_features=1,
            flops_per_token=_LOSS_FLOPS * classes,
            in_shard=classes_dim,
            default=default,
        ),
    ]


def _gpt2(cfg: Any, seq_len: int) -> list[LayerSpec]:
    hidden, heads, vocab = cfg.n_embd, cfg.n_head, cfg.vocab_size
    inner = cfg.n_inner or 4 * hidden
    layers = [
        _embedding(
            "transformer.wte",
            vocab,
            hidden,
            seq_len,
            replicated=cfg.n_positions * hidden,
            modules=("transformer.wte", "transformer.wpe"),
        )
    ]
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}"
        layers.append(_norm(f"{p}.ln_1", hidden, seq_len, params=2 * hidden, opens=True))
        layers += _attention(
            f"{p}.attn",
            qkv=(f"{p}.attn.c_attn", f"{p}.attn.c_attn"),
            out=f"{p}.attn.c_proj",
            hidden=hidden,
            heads=heads,
            kv_heads=heads,
            head_dim=hidden // heads,
            tokens=seq_len,
            bias=True,
            opens=False,
            min_groups=min_head_groups(cfg.model_type),
        )
        layers.append(_norm(f"{p}.ln_2", hidden, seq_len, params=2 * hidden, opens=True))
        layers += _mlp(
            (f"{p}.mlp.c_fc", f"{p}.mlp.c_fc"),
            f"{p}.mlp.c_proj",
            hidden=hidden,
            inner=inner,
            tokens=seq_len,
            bias=True,
            gated=False,
            opens=False,
        )
    layers.append(_norm("transformer.ln_f", hidden, seq_len, params=2 * hidden))
    tied = bool(getattr(cfg, "tie_word_embeddings", True))
    layers += _head_and_loss(
        "lm_head", hidden, vocab, seq_len, tied=tied, bias=False, vocab_parallel=True
    )
    return layers


def _llama(cfg: Any, seq_len: int) -> list[LayerSpec]:
    hidden, heads, vocab = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    bias = bool(getattr(cfg, "attention_bias", False))
    layers = [
        _embedding(
            "model.embed_tokens",
            vocab,
            hidden,
            seq_len,
            replicated=0,
            modules=("model.embed_tokens",),
        )
    ]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        layers.append(_norm(f"{p}.input_layernorm", hidden, seq_len, params=hidden, opens=True))
        qkv_modules = "|".join(f"{p}.self_attn.{x}_proj" for x in "qkv")
        layers += _attention(
            f"{p}.self_attn",
            qkv=(f"{p}.self_attn.qkv_proj", qkv_modules),
            out=f"{p}.self_attn.o_proj",
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            tokens=seq_len,
            bias=bias,
            opens=False,
            min_groups=min_head_groups(cfg.model_type),
        )
        layers.append(
            _norm(f"{p}.post_attention_layernorm", hidden, seq_len, params=hidden, opens=True)
        )
        layers += _mlp(
            (f"{p}.mlp.gate_up_proj", f"{p}.mlp.gate_proj|{p}.mlp.up_proj"),
            f"{p}.mlp.down_proj",
            hidden=hidden,
            inner=cfg.intermediate_size,
            tokens=seq_len,
            bias=bool(getattr(cfg, "mlp_bias", False)),
            gated=True,
            opens=False,
        )
    layers.append(_norm("model.norm", hidden, seq_len, params=hidden))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    layers += _head_and_loss(
        "lm_head", hidden, vocab, seq_len, tied=tied, bias=False, vocab_parallel=True
    )
    return layers


def _encoder_block(p: str, cfg: Any, tokens: int, *, bert: bool) -> list[LayerSpec]:
    """A BERT (post-norm) or ViT (pre-norm) encoder block."""
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    attn = f"{p}.attention.self" if bert else f"{p}.attention.attention"
    qkv_modules = "|".join(f"{attn}.{x}" for x in ("query", "key", "value"))
    layers = []
    if not bert:
        layers.append(_norm(f"{p}.layernorm_before", hidden, tokens, params=2 * hidden, opens=True))
    layers += _attention(
        attn,
        qkv=(f"{attn}.qkv", qkv_modules),
        out=f"{p}.attention.output.dense",
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        head_dim=hidden // heads,
        tokens=tokens,
        bias=bool(getattr(cfg, "qkv_bias", True)),
        opens=bert,
        min_groups=min_head_groups(cfg.model_type),
    )
    if bert:
        layers.append(_norm(f"{p}.attention.output.LayerNorm", hidden, tokens, params=2 * hidden))
    else:
        layers.append(_norm(f"{p}.layernorm_after", hidden, tokens, params=2 * hidden, opens=True))
    layers += _mlp(
        (f"{p}.intermediate.dense", f"{p}.intermediate.dense"),
        f"{p}.output.dense",
        hidden=hidden,
        inner=cfg.intermediate_size,
        tokens=tokens,
        bias=True,
        gated=False,
        opens=bert,
    )
    if bert:
        layers.append(_norm(f"{p}.output.LayerNorm", hidden, tokens, params=2 * hidden))
    return layers


_BERT_EMBEDDINGS = ("word_embeddings", "position_embeddings", "token_type_embeddings")


def _bert(cfg: Any, seq_len: int) -> list[LayerSpec]:
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    extra = (cfg.max_position_embeddings + cfg.type_vocab_size) * hidden
    e = "bert.embeddings"
    layers = [
        _embedding(
            f"{e}.word_embeddings",
            vocab,
            hidden,
            seq_len,
            replicated=extra,
            modules=tuple(f"{e}.{m}" for m in _BERT_EMBEDDINGS),
        ),
        _norm(f"{e}.LayerNorm", hidden, seq_len, params=2 * hidden),
    ]
    for i in range(cfg.num_hidden_layers):
        layers += _encoder_block(f"bert.encoder.layer.{i}", cfg, seq_len, bert=True)
    t = "cls.predictions.transform"
    layers.append(
        _linear(f"{t}.dense", LayerKind.LINEAR, seq_len, ShardDim(hidden), ShardDim(hidden))
    )
    layers.append(_norm(f"{t}.LayerNorm", hidden, seq_len, params=2 * hidden))
    tied = bool(getattr(cfg, "tie_word_embeddings", True))
    layers += _head_and_loss(
        "cls.predictions.decoder",
        hidden,
        vocab,
        seq_len,
        tied=tied,
        bias=True,
        vocab_parallel=True,
    )
    return layers


def _vit(cfg: Any) -> tuple[list[LayerSpec], int]:
    hidden, patch, channels = cfg.hidden_size, cfg.patch_size, cfg.num_channels
    num_patches = (cfg.image_size // patch) ** 2
    tokens = num_patches + 1  # the CLS token
    pixels = channels * patch * patch
    e = "vit.embeddings"
    layers = [
        LayerSpec(
            name=f"{e}.patch_embeddings",
            kind=LayerKind.LINEAR,
            tokens=num_patches,
            in_features=pixels,
            out_features=hidden,
            flops_per_token=2.0 * pixels * hidden,
            weight_params=pixels * hidden,
            bias_params=hidden,
            replicated_params=(1 + tokens) * hidden,  # CLS token and position embeddings
            in_shard=ShardDim(pixels),
            out_shard=ShardDim(hidden),
            modules=(f"{e}.patch_embeddings", f"{e}.cls_token", f"{e}.position_embeddings"),
        )
    ]
    for i in range(cfg.num_hidden_layers):
        layers += _encoder_block(f"vit.encoder.layer.{i}", cfg, tokens, bert=False)
    layers.append(_norm("vit.layernorm", hidden, tokens, params=2 * hidden))
    layers += _head_and_loss(
        "classifier", hidden, cfg.num_labels, 1, tied=False, bias=True, vocab_parallel=False
    )
    return layers, tokens


def model_spec_from_hf(
    hf_config: Any, batch_size: int, seq_len: int, *, dtype_bytes: int = 4
) -> ModelSpec:
    """The planner's view of a transformers config.

    Args:
        hf_config: a GPT2Config, LlamaConfig, BertConfig or ViTConfig (by ``model_type``).
        batch_size: samples per optimizer step over all data-parallel ranks.
        seq_len: tokens per sample; ViT ignores it and uses its patch count plus one.
        dtype_bytes: bytes per parameter and activation element (4 for fp32, 2 for fp16/bf16).

    Raises:
        ValueError: an unsupported ``model_type`` or a non-positive batch or sequence length.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "gpt2":
        layers = _gpt2(hf_config, seq_len)
    elif model_type == "llama":
        layers = _llama(hf_config, seq_len)
    elif model_type == "bert":
        layers = _bert(hf_config, seq_len)
    elif model_type == "vit":
        layers, seq_len = _vit(hf_config)
    else:
        raise ValueError(f"model_type {model_type!r} is not supported (gpt2, llama, bert or vit)")
    return ModelSpec(
        name=model_type,
        layers=tuple(layers),
        batch_size=batch_size,
        seq_len=seq_len,
        dtype_bytes=dtype_bytes,
        extra={"heads": getattr(hf_config, "num_attention_heads", None)},
    )
