"""Resizable layers equal their dense counterparts, forward and every gradient.

Every rank builds the same dense module and inputs (one seed) and shards a deep copy with
random widths that include zero-width ranks. The sharded forward must give the dense output
(or this rank's slice of it) and every gradient must equal the dense gradient (or this rank's
slice): input, weight and bias. Also checked: the checkpoint hooks (state_dict gathers the
full tensor under the same name; load_state_dict re-shards one), tied embedding/LM-head
weights, the uneven vocabulary-parallel loss, and that resize moves weights, gradients and
Adam state losslessly.

Tolerances: float64 throughout; sharded and dense results differ only in summation order
(the all-reduce of partial products): the chain bound of tests/tolerances.py, ~7e-11.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from colossal_hetero.layers import (
    ResizableConv1DCol,
    ResizableConv1DRow,
    ResizableLinearCol,
    ResizableLinearRow,
    ResizableLMHead,
    ResizableVocabEmbedding,
    causal_lm_loss,
    layout_of,
    resize_layer,
    shard_of,
)
from colossal_hetero.plugin import prepare_device
from tests.dist_utils import run_distributed
from tests.tolerances import chain_atol

# float64: a chain of <= 3 sums (forward, backward, the loss's log-sum-exp) of <= 64 terms, each
# a product of two N(0, 1) draws (|x| < 5 in these seeded draws), so sum|terms| <= 64 * 25.
TOL = {"rtol": 0.0, "atol": chain_atol(3, 64, torch.float64, 64 * 25.0)}  # ~7e-11


def _randn(*shape, seed, device):
    return torch.randn(
        *shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    ).to(device)


def _slice(x, dim, widths, rank, num_parts=1):
    return shard_of(x, dim, list(widths), rank, num_parts)


def _random_widths(total, num_ranks, generator):
    """Random widths summing to ``total``, often with zero-width ranks."""
    cuts = sorted(torch.randint(0, total + 1, (num_ranks - 1,), generator=generator).tolist())
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True))


def _width_cases(total, num_ranks, seed):
    generator = torch.Generator().manual_seed(seed)
    edge = [(total,) + (0,) * (num_ranks - 1), (0,) * (num_ranks - 1) + (total,)]
    return edge + [_random_widths(total, num_ranks, generator) for _ in range(3)]


def _check_column(rank, group, device, widths, *, conv, gather_output, num_parts=1):
    in_features, out_features = 5, num_parts * sum(widths)
    torch.manual_seed(0)
    dense = Conv1D(out_features, in_features) if conv else nn.Linear(in_features, out_features)
    dense = dense.double().to(device)
    with torch.no_grad():
        dense.bias.normal_()
    cls = ResizableConv1DCol if conv else ResizableLinearCol
    layer = cls.from_native_module(
        copy.deepcopy(dense), group, widths=widths, gather_output=gather_output, num_parts=num_parts
    )
    x = _randn(2, 3, in_features, seed=1, device=device)
    grad_out = _randn(2, 3, out_features, seed=2, device=device)
    x_dense, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_dense = dense(x_dense)
    (y_dense * grad_out).sum().backward()
    y = layer(x_tp)
    if gather_output:
        torch.testing.assert_close(y, y_dense, **TOL)
        (y * grad_out).sum().backward()
    else:  # each rank's loss is its slice's share; summed over ranks it is the dense loss
        torch.testing.assert_close(y, _slice(y_dense, -1, widths, rank, num_parts), **TOL)
        (y * _slice(grad_out, -1, widths, rank, num_parts)).sum().backward()
    torch.testing.assert_close(x_tp.grad, x_dense.grad, **TOL)
    weight_dim = 1 if conv else 0
    expected = _slice(dense.weight.grad, weight_dim, widths, rank, num_parts)
    torch.testing.assert_close(layer.weight.grad, expected, **TOL)
    torch.testing.assert_close(
        layer.bias.grad, _slice(dense.bias.grad, 0, widths, rank, num_parts), **TOL
    )
    _check_state_dict(layer, dense)


def _check_row(rank, group, device, widths, *, conv, parallel_input):
    in_features, out_features = sum(widths), 4
    torch.manual_seed(0)
    dense = Conv1D(out_features, in_features) if conv else nn.Linear(in_features, out_features)
    dense = dense.double().to(device)
    with torch.no_grad():
        dense.bias.normal_()
    cls = ResizableConv1DRow if conv else ResizableLinearRow
    layer = cls.from_native_module(
        copy.deepcopy(dense), group, widths=widths, parallel_input=parallel_input
    )
    x = _randn(2, 3, in_features, seed=3, device=device)
    grad_out = _randn(2, 3, out_features, seed=4, device=device)
    x_dense = x.clone().requires_grad_()
    (dense(x_dense) * grad_out).sum().backward()
    x_tp = (x if not parallel_input else _slice(x, -1, widths, rank)).clone().requires_grad_()
    y = layer(x_tp)
    torch.testing.assert_close(y, dense(x), **TOL)
    (y * grad_out).sum().backward()
    expected_dx = x_dense.grad if not parallel_input else _slice(x_dense.grad, -1, widths, rank)
    torch.testing.assert_close(x_tp.grad, expected_dx, **TOL)
    weight_dim = 0 if conv else 1
    torch.testing.assert_close(
        layer.weight.grad, _slice(dense.weight.grad, weight_dim, widths, rank), **TOL
    )
    torch.testing.assert_close(layer.bias.grad, dense.bias.grad, **TOL)
    _check_state_dict(layer, dense)


def _check_state_dict(layer, dense):
    """state_dict gathers full tensors under the dense names; load_state_dict re-shards."""
    state = layer.state_dict()
    assert set(state) == set(dense.state_dict())
    for name, tensor in dense.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    changed = {name: tensor + 1 for name, tensor in dense.state_dict().items()}
    layer.load_state_dict(changed)
    for name, tensor in layer.state_dict().items():
        torch.testing.assert_close(tensor, changed[name], rtol=0, atol=0)


def _check_embedding_and_loss(rank, group, device, widths):
    vocab, dim = sum(widths), 6
    torch.manual_seed(0)
    embedding = nn.Embedding(vocab, dim, padding_idx=vocab // 2).double().to(device)
    head = nn.Linear(dim, vocab, bias=False).double().to(device)
    head.weight = embedding.weight  # tied, as in GPT-2
    dense = nn.ModuleDict({"embedding": embedding, "head": head})
    sharded = copy.deepcopy(dense)
    emb_tp = ResizableVocabEmbedding.from_native_module(sharded["embedding"], group, widths=widths)
    head_tp = ResizableLMHead.from_native_module(sharded["head"], group, widths=widths)
    assert head_tp.weight is emb_tp.weight, "tied weights must stay one parameter"

    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(5)).to(device)
    labels = ids.clone()
    labels[0, 3] = labels[1, 5] = -100
    logits = dense["head"](dense["embedding"](ids))
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
    loss.backward()
    hidden_tp = emb_tp(ids)
    torch.testing.assert_close(hidden_tp, dense["embedding"](ids), **TOL)
    logits_tp = head_tp(hidden_tp)
    torch.testing.assert_close(logits_tp, _slice(logits, -1, widths, rank), **TOL)
    loss_tp = causal_lm_loss(logits_tp, labels, widths=widths, group=group)
    torch.testing.assert_close(loss_tp, loss, **TOL)
    loss_tp.backward()
    torch.testing.assert_close(
        emb_tp.weight.grad, _slice(embedding.weight.grad, 0, widths, rank), **TOL
    )
    # Gathered logits take the plain cross entropy path.
    gathered = ResizableLMHead.from_native_module(
        copy.deepcopy(head), group, widths=widths, gather_output=True
    )
    full_logits = gathered(dense["embedding"](ids).detach())
    torch.testing.assert_close(full_logits, logits, **TOL)
    gathered_loss = causal_lm_loss(full_logits, labels, widths=widths, group=group, gathered=True)
    torch.testing.assert_close(gathered_loss, loss, **TOL)


def _check_resize(rank, group, device, old, new):
    """resize_layer moves weight, grad and Adam state: each equals the slice of its full tensor."""
    torch.manual_seed(0)
    dense = Conv1D(3 * sum(old), 4).double().to(device)
    layer = ResizableConv1DCol.from_native_module(dense, group, widths=old, num_parts=3)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    x = _randn(3, 4, seed=6, device=device)
    for _ in range(2):  # one step (Adam state exists), then fresh grads
        optimizer.zero_grad()
        layer(x).square().sum().backward()
        if _ == 0:
            optimizer.step()
    names = ("weight", "bias")
    full = {}
    for name in names:
        param = getattr(layer, name)
        layout = layout_of(param)
        state = optimizer.state[param]
        full[name] = [
            layout.gather(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])
        ]
    resize_layer(layer, new, optimizer=optimizer)
    assert layer.widths == tuple(new)
    for name in names:
        param = getattr(layer, name)
        state = optimizer.state[param]
        dim = 1 if name == "weight" else 0
        for got, whole in zip(
            (param, param.grad, state["exp_avg"], state["exp_avg_sq"]), full[name], strict=True
        ):
            torch.testing.assert_close(got, _slice(whole, dim, new, rank, 3), rtol=0, atol=0)
    optimizer.zero_grad()
    layer(x).square().sum().backward()
    optimizer.step()  # the re-sharded state still fits its parameter


def _check_errors(group, device):
    dense = nn.Linear(4, 6).to(device)
    with pytest.raises(ValueError, match="output features"):
        ResizableLinearCol.from_native_module(copy.deepcopy(dense), group, widths=(3, 4))
    with pytest.raises(ValueError, match="one width per rank"):
        ResizableLinearRow.from_native_module(copy.deepcopy(dense), group, widths=(4,))
    with pytest.raises(ValueError, match="process_group is required"):
        ResizableLinearRow.from_native_module(copy.deepcopy(dense), None, widths=(2, 2))


def _check_all(rank, group, device, num_ranks, seed):
    for widths in _width_cases(6, num_ranks, seed):
        for conv in (False, True):
            _check_column(rank, group, device, widths, conv=conv, gather_output=False)
            _check_column(rank, group, device, widths, conv=conv, gather_output=True)
            _check_row(rank, group, device, widths, conv=conv, parallel_input=True)
        _check_row(rank, group, device, widths, conv=False, parallel_input=False)
        heads = tuple(w // 2 for w in widths)  # head_dim 2: heads are the unit of c_attn
        head_widths = tuple(2 * h for h in heads)
        if sum(heads):
            _check_column(
                rank, group, device, head_widths, conv=True, gather_output=False, num_parts=3
            )
            _check_column(
                rank, group, device, head_widths, conv=True, gather_output=True, num_parts=3
            )
        _check_embedding_and_loss(
            rank, group, device, tuple(w + 1 for w in widths[:-1]) + (widths[-1],)
        )
    cases = _width_cases(4, num_ranks, seed + 1)
    for old, new in zip(cases[:-1], cases[1:], strict=True):
        _check_resize(rank, group, device, old, new)


def _two_ranks(rank, world_size, device):
    prepare_device(device)
    _check_all(rank, dist.group.WORLD, device, world_size, seed=0)
    _check_errors(dist.group.WORLD, device)


def _three_ranks(rank, world_size, device):
    prepare_device(device)
    _check_all(rank, dist.group.WORLD, device, world_size, seed=10)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_resizable_layers_match_dense_two_ranks():
    run_distributed(_two_ranks, world_size=2)


@pytest.mark.dist
@pytest.mark.slow  # three processes importing colossalai on two cores: about a minute
@pytest.mark.timeout(300)
def test_resizable_layers_match_dense_three_ranks():
    run_distributed(_three_ranks, world_size=3)
