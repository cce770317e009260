"""ZERO-resizing inside SUMMA steps: a straggler's Linear2D GEMMs over a kept subset of K.

The 2D counterpart of ``balance/ops/resize.py`` (the 1D op). A Linear2D y = x W, W [K, N],
runs one summa_ab: rank (i, j) sums over the q blocks of the reduction dimension K (block t
in step t, cut by ``in_sizes``). With a ``Resize2D`` attached for mesh position (i*, j*),
that rank computes only the kept entries P of K in every step:

    y[b_i*, n_j*] = x[b_i*, P] W[P, n_j*] (+ bias)            (smaller GEMMs in each step)
    its share of dx[b_i*, D] and of dW[D, n_j*] = impute_value (0: no contribution)

and everything else is unchanged: every broadcast and reduce (2q per kernel, the same groups
and sizes), the output and gradient shapes, the other ranks' GEMMs. Its shares of dx and dW
are terms of sums reduced over its row and column group, so with impute_value 0 the result
is the exact gradient of the resized layer: dW[D, n_j*] keeps the other batch shares' terms
(unlike 1D, where the straggler owns its whole dW and D gets none), and dx[:, D] keeps the
other output columns' terms. The bias and the other ranks' outputs are exact. Never active in
eval or under no_grad (Linear2D checks), so evaluation uses the whole layer.

Choosing P reuses the 1D pieces (``balance/ops/selection.py``): the fraction from a measured
slowdown (``kept_fraction``), priority by recent weight change with stale scores
(``PriorityTracker`` on each rank's block W[K_i, N_j], summed per mesh column by
``Priority2D.scores``, one gather over the mesh), then ``select_kept``. Every input of those
is identical on every rank, so is P. Freezing: ``freeze_targets_2d`` gives the rows W[D, n_j*]
(on the ranks of column j*) for ``balance.ops.resize.frozen_columns``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from colossal_hetero.balance.ops.resize import check_columns, complement
from colossal_hetero.balance.ops.selection import PriorityTracker, kept_fraction, select_kept
from colossal_hetero.tp2d.layers import Linear2D, gather_matrix
from colossal_hetero.tp2d.layout import offsets


@dataclass(frozen=True)
class Resize2D:
    """One Linear2D's ZERO-resizing: mesh position ``straggler`` computes ``kept`` of K only.

    ``kept``: sorted LongTensor within [0, sum(in_sizes)), the same on every rank.
    ``steps``: what this rank's summa_ab takes, ``kept`` cut into the q reduction blocks
    (local indices per step) on the straggler, None elsewhere or when every entry is kept.
    """

    straggler: tuple[int, int]
    kept: torch.Tensor
    steps: tuple[torch.Tensor, ...] | None
    impute_value: float = 0.0


def split_steps(kept: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Global indices ``kept`` within [0, sum(sizes)) -> per block t its local indices."""
    out = []
    for start, size in zip(offsets(sizes), sizes, strict=True):
        inside = kept[(kept >= start) & (kept < start + size)]
        out.append(inside - start)
    return tuple(out)


def linear_layers(model: nn.Module) -> dict[str, Linear2D]:
    """Every Linear2D of ``model`` by qualified name (the model itself: name '')."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear2D)}


def _check_straggler(straggler: tuple[int, int], q: int) -> tuple[int, int]:
    i, j = (int(v) for v in straggler)
    if not (0 <= i < q and 0 <= j < q):
        raise ValueError(f"straggler must be a mesh position (i, j) of the {q} x {q} mesh")
    return i, j


def attach_resize_2d(
    model: nn.Module,
    straggler: tuple[int, int],
    kept: Mapping[str, torch.Tensor],
    *,
    impute_value: float = 0.0,
) -> dict[str, Resize2D]:
    """ZERO-resize the Linear2D layers named in ``kept`` at mesh position ``straggler``.

    ``kept[name]``: that layer's kept reduction entries (see ``Resize2D``); every rank passes
    the same arguments. Everything is checked (ValueError, the same on every rank, no
    collective) before any layer changes; layers not named keep their current resize.
    """
    layers = linear_layers(model)
    unknown = sorted(set(kept) - set(layers))
    if unknown:
        raise ValueError(f"kept names no Linear2D of the model: {unknown}")
    ops = {}
    for name, indices in kept.items():
        layer = layers[name]
        position = _check_straggler(straggler, layer.mesh.q)
        indices = indices.detach().cpu()
        check_columns(indices, sum(layer.in_sizes), f"kept[{name!r}]")
        mine = (layer.mesh.i, layer.mesh.j) == position
        steps = None
        if mine and indices.numel() < sum(layer.in_sizes):
            device = layer.weight.device
            steps = tuple(s.to(device) for s in split_steps(indices, layer.in_sizes))
        ops[name] = Resize2D(position, indices, steps, float(impute_value))
    for name, op in ops.items():
        layers[name].resize = op
    return ops


def detach_resize_2d(model: nn.Module) -> None:
    """Every Linear2D of ``model`` back to the whole GEMM."""
    for layer in linear_layers(model).values():
        layer.resize = None


def _dropped_rows(layer: Linear2D) -> torch.Tensor:
    """Rows of this rank's weight block W[K_i, N_j] its column's straggler drops (else empty)."""
    op = layer.resize
    if op is None or layer.mesh.j != op.straggler[1]:
        return torch.empty(0, dtype=torch.long)
    i = layer.mesh.i
    own = split_steps(op.kept, layer.in_sizes)[i]
    return complement(own, layer.in_sizes[i])


def freeze_targets_2d(model: nn.Module) -> list[tuple[nn.Parameter, int, torch.Tensor]]:
    """(weight, 0, dropped rows) of each resized Linear2D block on this rank, for
    ``balance.ops.resize.frozen_columns``: the straggler's dropped entries W[D, n_j*] keep
    their value and optimizer state on every rank of its mesh column (they still get the other
    batch shares' gradient terms; freezing drops those too)."""
    targets = []
    for layer in linear_layers(model).values():
        rows = _dropped_rows(layer)
        if rows.numel():
            targets.append((layer.weight, 0, rows.to(layer.weight.device)))
    return targets


class Priority2D:
    """Priority scores (the A.4 rule) of every Linear2D's K entries, per mesh column.

    Each rank tracks its own block W[K_i, N_j] with a ``PriorityTracker`` (rows: dim 0).
    ``refresh`` (local) at each period boundary: the rows the column's straggler computed
    last period get their change, the dropped rows keep their stale score. ``scores``
    (collective over the mesh: one gather per layer) returns [K, q]: column j scores the
    entries by their change in W[:, n_j], the weights mesh column j's outputs use.
    """

    def __init__(self, model: nn.Module) -> None:
        self.trackers = {
            name: PriorityTracker(layer.weight, 0) for name, layer in linear_layers(model).items()
        }

    def refresh(self, model: nn.Module) -> None:
        for name, layer in linear_layers(model).items():
            rows = layer.in_sizes[layer.mesh.i]
            dropped = _dropped_rows(layer)
            computed = complement(dropped, rows) if dropped.numel() else torch.arange(rows)
            self.trackers[name].refresh(layer.weight, computed)

    def scores(self, model: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, layer in linear_layers(model).items():
            mesh, mine = layer.mesh, self.trackers[name].scores
            out[name] = gather_matrix(mine.unsqueeze(1), mesh, layer.in_sizes, [1] * mesh.q)
        return out


def kept_for_slowdown(
    model: nn.Module,
    straggler: tuple[int, int],
    slowdown: float,
    scores: Mapping[str, torch.Tensor] | None = None,
    *,
    min_fraction: float = 0.5,
    gemm_share: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Every Linear2D's kept entries for a straggler ``slowdown`` times slower (pure, local).

    The fraction is ``kept_fraction(slowdown, min_fraction=, gemm_share=)``; the entries the
    highest-scored ones of the straggler's mesh column in ``scores`` (``Priority2D.scores``),
    or the first ones (ties by index) without scores.
    """
    fraction = kept_fraction(slowdown, min_fraction=min_fraction, gemm_share=gemm_share)
    out = {}
    for name, layer in linear_layers(model).items():
        i, j = _check_straggler(straggler, layer.mesh.q)
        total = sum(layer.in_sizes)
        column = scores[name][:, j] if scores is not None else torch.ones(total)
        out[name] = select_kept(column, fraction)
    return out
