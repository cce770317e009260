"""colossal_hetero.data: corpus split, deterministic resumable batches, MLM masking, digits,
data-parallel and micro-batch slicing."""

from __future__ import annotations

import itertools

import pytest
import torch

from colossal_hetero.config.schema import DataConfig
from colossal_hetero.data import (
    BERT_VOCAB_SIZE,
    IGNORE_INDEX,
    MASK_ID,
    TEXT_VOCAB_SIZE,
    TextData,
    build_data,
    load_pydoc_corpus,
    shard_batch,
    split_corpus,
    split_microbatches,
    vocab_size_for,
)


@pytest.fixture(scope="module")
def gpt2_data():
    return build_data(DataConfig(seq_len=32, val_fraction=0.1), "gpt2")


@pytest.fixture(scope="module")
def bert_data():
    return build_data(DataConfig(seq_len=64, val_fraction=0.1), "bert")


@pytest.fixture(scope="module")
def digits_data():
    return build_data(DataConfig(dataset="digits", val_fraction=0.1), "vit")


def _assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_corpus_is_bytes_of_sorted_topics():
    from pydoc_data.topics import topics

    corpus = load_pydoc_corpus()
    expected = "".join(topics[k] for k in sorted(topics)).encode("utf-8")
    assert corpus.dtype == torch.uint8
    assert bytes(corpus.tolist()) == expected
    assert int(corpus.max()) < TEXT_VOCAB_SIZE


def test_corpus_split_is_disjoint_and_covers_everything():
    corpus = load_pydoc_corpus()
    train, val = split_corpus(corpus, 0.1)
    assert train.numel() > 0 and val.numel() > 0
    assert train.numel() + val.numel() == corpus.numel()
    assert torch.equal(torch.cat([train, val]), corpus)
    assert val.numel() == -(-corpus.numel() // 10)  # ceil(N / 10)
    with pytest.raises(ValueError):
        split_corpus(corpus, 0.0)


def test_windows_never_cross_the_split():
    # Train bytes are < 100 and validation bytes >= 200: any leak shows up in the values.
    tokens = torch.cat([torch.arange(900) % 100, 200 + torch.arange(100) % 50]).to(torch.uint8)
    data = TextData(tokens, seq_len=10, val_fraction=0.1, masked_lm=False)
    assert (data.num_train_samples, data.num_val_samples) == (90, 10)
    train = torch.cat([data.train_batch(step, 16, seed=3)["input_ids"] for step in range(50)])
    assert int(train.max()) < 100
    val = torch.cat([b["input_ids"] for b in data.val_batches(5, 2)])
    assert int(val.min()) >= 200
    with pytest.raises(ValueError):
        data.val_batches(5, 3)


def test_causal_batch_shapes_and_labels(gpt2_data):
    batch = gpt2_data.train_batch(0, 4, seed=0)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    for tensor in batch.values():
        assert tensor.shape == (4, 32) and tensor.dtype == torch.long
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert batch["labels"].data_ptr() != batch["input_ids"].data_ptr()
    assert bool((batch["attention_mask"] == 1).all())
    assert int(batch["input_ids"].max()) < TEXT_VOCAB_SIZE
    assert gpt2_data.tokens_per_sample == 32


def test_train_stream_is_deterministic_and_resumable(gpt2_data, digits_data):
    for data in (gpt2_data, digits_data):
        first = list(itertools.islice(data.train_batches(8, seed=7), 6))
        again = list(itertools.islice(data.train_batches(8, seed=7), 6))
        resumed = list(itertools.islice(data.train_batches(8, seed=7, start_step=4), 2))
        for a, b in zip(first + first[4:], again + resumed, strict=True):
            _assert_batches_equal(a, b)
        other = next(data.train_batches(8, seed=8))
        assert not torch.equal(other["labels"], first[0]["labels"])
        assert not torch.equal(first[0]["labels"], first[1]["labels"])


def test_train_stream_leaves_global_rng_alone(gpt2_data):
    state = torch.get_rng_state()
    gpt2_data.train_batch(3, 4, seed=1)
    assert torch.equal(torch.get_rng_state(), state)


def test_bad_stream_arguments_raise(gpt2_data):
    with pytest.raises(ValueError):
        gpt2_data.train_batches(0, seed=0)
    with pytest.raises(ValueError):
        gpt2_data.train_batches(4, seed=0, start_step=-1)


def test_mlm_masking(bert_data):
    batches = [bert_data.train_batch(step, 32, seed=0) for step in range(8)]
    batch = batches[0]
    assert set(batch) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert bool((batch["token_type_ids"] == 0).all())
    masked = torch.cat([b["input_ids"] == MASK_ID for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    # Seeded, so deterministic: 8 x 32 x 64 = 16384 draws have a binomial sd of 0.0028 at
    # p = 0.15, so 0.02 is 7 sd and a rate off by 2 points fails.
    assert masked.float().mean().item() == pytest.approx(0.15, abs=0.02)
    assert bool(masked.any(dim=1).all())
    assert torch.equal(labels == IGNORE_INDEX, ~masked)
    assert int(labels[masked].min()) >= 0 and int(labels[masked].max()) < TEXT_VOCAB_SIZE
    # Unmasked inputs are real bytes; the model's vocabulary must hold MASK_ID.
    inputs = torch.cat([b["input_ids"] for b in batches])
    assert int(inputs[~masked].max()) < TEXT_VOCAB_SIZE
    assert vocab_size_for("bert") == BERT_VOCAB_SIZE > MASK_ID
    assert vocab_size_for("gpt2") == TEXT_VOCAB_SIZE


def test_mlm_validation_is_fixed(bert_data):
    _assert_batches_equal(bert_data.val_batches(4, 2)[1], bert_data.val_batches(4, 2)[1])


def test_digits_shapes_normalisation_and_split(digits_data):
    assert digits_data.num_train_samples + digits_data.num_val_samples == 1797
    assert digits_data.num_val_samples == 180  # ceil(0.1 * 1797)
    assert digits_data.tokens_per_sample is None
    batch = digits_data.train_batch(0, 16, seed=0)
    assert batch["pixel_values"].shape == (16, 1, 8, 8)
    assert batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].shape == (16,) and batch["labels"].dtype == torch.long
    # float32 reductions over ~1e5 pixels of magnitude ~1 (pairwise sums): error ~ log2(1e5) u
    # ~ 1e-6, under 1e-5; a skipped normalisation is off by O(1).
    assert digits_data.train_pixels.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert digits_data.train_pixels.std().item() == pytest.approx(1.0, abs=1e-5)
    labels = torch.cat([digits_data.train_labels, digits_data.val_labels])
    assert int(labels.min()) == 0 and int(labels.max()) == 9
    assert set(digits_data.val_labels.tolist()) == set(range(10))  # stratified
    val = digits_data.val_batches(60, 3)
    assert sum(len(b["labels"]) for b in val) == 180


def test_digits_epoch_visits_every_image_once(digits_data):
    n = digits_data.num_train_samples  # 1617 = 3 * 7 * 7 * 11
    batches = [digits_data.train_batch(step, 49, seed=0) for step in range(n // 49)]
    pixels = torch.cat([b["pixel_values"] for b in batches]).flatten(1)
    assert (
        torch.unique(pixels, dim=0).shape[0]
        == torch.unique(digits_data.train_pixels.flatten(1), dim=0).shape[0]
    )


def test_dataset_must_fit_arch():
    with pytest.raises(ValueError):
        build_data(DataConfig(dataset="digits"), "gpt2")
    with pytest.raises(ValueError):
        build_data(DataConfig(), "vit")
    with pytest.raises(ValueError):
        build_data(DataConfig(), "t5")


def test_shard_batch_takes_contiguous_rows():
    batch = {"x": torch.arange(12).reshape(6, 2), "y": torch.arange(6)}
    shards = [shard_batch(batch, rank, 3) for rank in range(3)]
    assert torch.equal(shards[1]["y"], torch.tensor([2, 3]))
    assert torch.equal(torch.cat([s["x"] for s in shards]), batch["x"])
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_batch(batch, 0, 4)
    with pytest.raises(ValueError):
        shard_batch(batch, 3, 3)
    with pytest.raises(ValueError):
        shard_batch({"x": torch.zeros(4), "y": torch.zeros(3)}, 0, 1)


def test_split_microbatches():
    batch = {"x": torch.arange(8)}
    micro = split_microbatches(batch, 4)
    assert [m["x"].tolist() for m in micro] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert len(split_microbatches(batch, 1)) == 1
    with pytest.raises(ValueError):
        split_microbatches(batch, 3)
    with pytest.raises(ValueError):
        split_microbatches(batch, 0)
