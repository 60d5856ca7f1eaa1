"""tpurec.buckets: a text model over varying lengths compiles once per bucket and trains as unpadded on CPU."""

from __future__ import annotations

import copy
import random

import pytest
import torch

import tpurec
from tpurec.buckets import SequenceBuckets, pad_to, power_of_two_buckets

PAD = {"input_ids": 0, "attention_mask": 0, "labels": -100}


def test_size_for_picks_the_smallest_bucket_that_holds_the_length():
    buckets = SequenceBuckets((16, 32, 64))
    assert [buckets.size_for(n) for n in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    assert power_of_two_buckets(128).sizes == (16, 32, 64, 128)
    assert power_of_two_buckets(100, shortest=8).sizes == (8, 16, 32, 64, 128)


@pytest.mark.parametrize("sizes", [(), (0, 4), (8, 8), (16, 8), (4.0, 8), (True, 4)])
def test_bad_bucket_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="SequenceBuckets: sizes must be"):
        SequenceBuckets(sizes)


def test_pad_pads_every_tensor_at_the_end_with_its_own_value():
    ids = torch.tensor([[5, 6, 7]])
    out = SequenceBuckets((4, 8)).pad({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, PAD)
    assert out["input_ids"].tolist() == [[5, 6, 7, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0]]
    assert out["labels"].tolist() == [[5, 6, 7, -100]]
    features = torch.ones(2, 3, 5)
    padded = SequenceBuckets((8,)).pad({"x": features}, {"x": 0.5})["x"]
    assert padded.shape == (2, 8, 5) and torch.equal(padded[:, :3], features) and bool((padded[:, 3:] == 0.5).all())
    assert pad_to(features, 3, 0.0) is features
    assert pad_to(features, 4, -1.0, dim=0).shape == (4, 3, 5)


def test_bad_input_to_pad_says_what_is_wrong():
    buckets = SequenceBuckets((4, 8))
    with pytest.raises(ValueError, match=r"longer than the largest bucket \(8\); add a bucket of at least 9"):
        buckets.pad({"input_ids": torch.zeros(1, 9)}, PAD)
    with pytest.raises(ValueError, match=r"no padding value for \['labels'\]"):
        buckets.pad({"input_ids": torch.zeros(1, 3), "labels": torch.zeros(1, 3)}, {"input_ids": 0})
    with pytest.raises(ValueError, match="lengths along dim 1 differ"):
        buckets.pad({"input_ids": torch.zeros(1, 3), "labels": torch.zeros(1, 4)}, PAD)
    with pytest.raises(ValueError, match="longer than 2"):
        pad_to(torch.zeros(1, 3), 2, 0)


def _tiny_bert() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fused", "compiled"])
def test_a_text_model_over_varying_lengths_compiles_once_per_bucket_and_trains_as_on_cpu(how):
    cpu = _tiny_bert()
    model = copy.deepcopy(cpu).to("tpu")
    # dynamic=False: one static graph per bucket (with automatic dynamic shapes Dynamo would trace a
    # second, symbolic graph at the second bucket and compile every bucket again under it).
    forward = torch.compile(model, backend="tpu", dynamic=False) if how == "compiled" else model
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.05)
    tpu_opt = torch.optim.SGD(model.parameters(), lr=0.05)
    buckets = SequenceBuckets((16, 32, 64))
    rng = random.Random(0)
    lengths = [rng.randint(1, 64) for _ in range(10)]
    seen: set[int] = set()
    with tpurec.mode("fused"):
        for step, length in enumerate(lengths):
            ids = torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(step))
            mask = torch.ones_like(ids)
            expected = cpu(input_ids=ids, attention_mask=mask, labels=ids).loss  # unpadded, on CPU
            expected.backward()
            cpu_opt.step()
            cpu_opt.zero_grad()

            batch = buckets.pad({"input_ids": ids, "attention_mask": mask, "labels": ids}, PAD)
            before = tpurec.stats()["compile_requests"]  # disk cache hits count too
            loss = forward(**{name: tensor.to("tpu") for name, tensor in batch.items()}).loss
            loss.backward()
            tpu_opt.step()
            tpu_opt.zero_grad()
            got = loss.item()
            compiled = tpurec.stats()["compile_requests"] - before
            bucket = buckets.size_for(length)
            if bucket in seen:
                assert compiled == 0, f"step {step}: length {length} in bucket {bucket} compiled {compiled} programs"
            else:
                # fused: the step is one window (transformers' mask.all() reads the mask's host
                # mirror, no sync point); compiled: the forward and backward graphs
                assert compiled <= (1 if how == "fused" else 2), (
                    f"step {step}: a new bucket compiled {compiled} programs"
                )
            seen.add(bucket)
            assert got == pytest.approx(expected.item(), rel=1e-5), step
    assert len(seen) >= 2  # the lengths drawn span several buckets
    for (name, got), expected in zip(model.named_parameters(), cpu.parameters()):
        # atol: the attention key biases get a gradient that is zero up to rounding (softmax is shift-invariant)
        torch.testing.assert_close(got.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6, msg=name)
