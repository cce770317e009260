"""Activation bytes per rank of GPT-2 as this project runs it, 1D against 2D (pure).

``tp2d_cost.activation_bytes`` is Korthikanti et al.'s per-layer accounting (2-byte elements,
dropout masks, a fused attention kernel's intermediates). This module counts what the
autograd graph of the implementations here keeps, op by op: Hugging Face GPT-2 with eager
attention and its tanh GELU (``gelu_new``), without dropout, run by

- ``1d``: Colossal-AI's shardformer GPT-2 policy, tp ranks (column linears save their full
  input; heads, MLP width and the vocabulary split by tp; the loss is its vocab-parallel
  cross-entropy);
- ``1d-sp``: the same with ``split_gather`` sequence parallelism (LayerNorms and the column
  linears' saved inputs split along the sequence, but each column linear also keeps its
  all-gathered input on its context: Colossal-AI 0.5's ``ctx.gathered_input``);
- ``2d``: ``tp2d.GPT2LM2D`` (every tensor split over the mesh; LayerNorm2D keeps the
  normalised input and rstd, as the native kernel keeps its input, mean and rstd; the tanh
  GELU is one kernel that keeps only its input, ``tp2d.gpt2.lean_activation``).

Per layer, for T tokens of width h (MLP width f, a heads, s sequence; "/P" = split by tp),
in elements:

    LayerNorm (native)  input T h, mean and rstd 2 T          (2D: centred + normed 2 T h, T)
    QKV linear          its input (the LN output) T h
    attention           q, k, v 3 T h (views of QKV's output or copies), softmax a s T
    attention proj      its input T h
    MLP                 fc input T h, tanh GELU 4 T f (HF's gelu_new: pow, tanh, two products;
                        one-kernel GELU: its input T f), proj input T f
    causal mask         s^2 booleans

so 1D = 4 T h + (4 T h + 5 T f + a s T) / P, 1D+SP = 2 T h + (8 T h + 5 T f + a s T) / P and
2D = (8 T h + 2 T f + a s T) / P per layer, plus the statistics, the final LayerNorm, the LM
head's input, the loss's saved softmax and the embedding indices. ``lean_gelu`` gives 1D the
one-kernel GELU too (HF's ``activation_function: gelu_pytorch_tanh``): 2 T f / P instead of
5 T f / P, the like-for-like comparison. Scalars (a few bytes) are
left out. tests/unit/test_tp2d_plan.py checks the formula against hand counts; ``bench tp2d``
against the bytes measured on the running implementations.
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["1d", "1d-sp", "2d"]
INDEX_BYTES = 8  # int64 token ids and targets
BOOL_BYTES = 1


def gpt2_activation_bytes(
    mode: Mode,
    *,
    layers: int,
    batch: int,
    seq: int,
    hidden: int,
    heads: int,
    vocab: int,
    tp: int,
    ffn: int = 0,
    elem_bytes: int = 4,
    lean_gelu: bool = False,
) -> float:
    """Bytes one rank's graph keeps after a forward of ``batch`` x ``seq`` tokens (even split;
    2D: tp = q * q, batch and vocab split by q, hidden, heads and ffn by q, rank (0, 0)).
    ``lean_gelu``: 1D runs a one-kernel GELU (2D always does)."""
    if mode not in ("1d", "1d-sp", "2d"):
        raise ValueError(f"parallel.tp_mode: unknown mode {mode!r} (1d, 1d-sp or 2d)")
    f = ffn or 4 * hidden
    tokens, h, e = batch * seq, hidden, elem_bytes
    if mode == "2d":
        return _two_d(layers, batch, seq, h, heads, vocab, f, tp, e)
    p = tp
    split = ((2 if lean_gelu else 5) * tokens * f + heads * seq * tokens) / p
    if mode == "1d":
        per_layer = 4 * tokens * h + (4 * tokens * h) / p + split
        stats: float = 4 * tokens
    else:
        per_layer = 2 * tokens * h + (8 * tokens * h) / p + split
        stats = 4 * tokens / p
    layer_bytes = e * (per_layer + stats) + BOOL_BYTES * seq * seq
    # ln_f (input, 2 statistics) and the LM head's input, whole on every rank; the
    # vocab-parallel loss keeps exp(logits) of the shifted tokens, their mask and targets.
    shifted = batch * (seq - 1)
    final = e * (2 * tokens * h + 2 * tokens + shifted * vocab / p)
    final += shifted * (BOOL_BYTES + INDEX_BYTES)
    indices = INDEX_BYTES * (tokens + seq)  # token ids, positions
    return layers * layer_bytes + final + indices


def _two_d(
    layers: int, batch: int, seq: int, h: int, heads: int, vocab: int, f: int, tp: int, e: int
) -> float:
    q = round(tp**0.5)
    if q * q != tp or batch % q or heads % q or f % q or vocab % q:
        raise ValueError(
            f"2D activation bytes need a square tp and batch, heads, ffn, vocab divisible by "
            f"q (tp={tp})"
        )
    b_i, h_j, f_j, a_j, v_j = batch // q, h // q, f // q, heads // q, vocab // q
    t_i = b_i * seq
    per_layer = 8 * t_i * h_j + 2 * t_i * f_j + a_j * seq * t_i + 2 * t_i
    layer_bytes = e * per_layer + BOOL_BYTES * seq * seq
    shifted = b_i * (seq - 1)
    # ln_f (normed, rstd), the LM head's input block; the loss keeps the softmax block and a
    # float validity mask, int64 local targets and a boolean "inside" mask.
    final = e * (2 * t_i * h_j + t_i + shifted * v_j + shifted)
    final += shifted * (INDEX_BYTES + BOOL_BYTES)
    # The vocab-parallel embedding looks up the whole batch: int64 ids and a float mask.
    indices = INDEX_BYTES * (batch * seq + seq) + e * batch * seq
    return layers * layer_bytes + final + indices
