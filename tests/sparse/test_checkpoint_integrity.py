"""Single-device checkpoints refuse what is damaged or does not fit, and change nothing when they do.

Damage: byte flips in 40 places, truncations, a deleted file, a checkpoint of another
model (more or fewer rows, other dense sizes) or of another optimizer. Every case is an
error naming the file or the entry, and the model's whole state is bit-identical after it.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch
from helpers import make_tables, random_kjt
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.models.dlrm import DLRM

import tpurec.sparse as sp
from tpurec.sparse import checkpoint

TABLES = make_tables(dims=(4, 4, 4))


def _model(tables=TABLES, optimizer=None, dense_sizes=(8, 4), device="cpu", seed=0):
    torch.manual_seed(seed)
    reference = DLRM(
        embedding_bag_collection=TorchrecEBC(tables),
        dense_in_features=5,
        dense_arch_layer_sizes=list(dense_sizes),
        over_arch_layer_sizes=[8, 1],
    )
    model = sp.from_torchrec(reference, optimizer=optimizer or sp.Adam(0.05), capacities=sp.Capacity(64)).to(device)
    dense_optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    rng = np.random.default_rng(seed)
    for _ in range(2):  # non-zero slots, step counts and dense optimizer state
        dense = torch.from_numpy(rng.standard_normal((4, 5)).astype(np.float32)).to(device)
        labels = torch.from_numpy(rng.integers(0, 2, (4, 1)).astype(np.float32)).to(device)
        dense_optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, random_kjt(tables, 4, rng)), labels)
        loss.backward()
        dense_optimizer.step()
    return model, dense_optimizer


def _everything(model, dense_optimizer) -> dict[str, object]:
    """Every tensor and value a load could change (tables, slots, steps, dense, optimizer), by path."""
    state = checkpoint.state_dict(model, dense_optimizer)
    flat: dict[str, object] = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)
        else:
            flat[prefix] = value.clone() if isinstance(value, torch.Tensor) else value

    walk("", {k: v for k, v in state.items() if k not in ("rng", "checksums")})
    return flat


def _assert_same(after: dict, before: dict) -> None:
    assert after.keys() == before.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(after[key], value), key
        else:
            assert after[key] == value, key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    model, dense_optimizer = _model(seed=0)
    checkpoint.save(path, model, dense_optimizer, extra={"step": 2})
    return path


@pytest.fixture
def target():
    model, dense_optimizer = _model(seed=1)
    return model, dense_optimizer, _everything(model, dense_optimizer)


def _refused(path, target, match=None) -> str:
    model, dense_optimizer, before = target
    with pytest.raises(ValueError, match=match) as info:
        checkpoint.load(path, model, dense_optimizer)
    _assert_same(_everything(model, dense_optimizer), before)
    return str(info.value)


def test_an_intact_checkpoint_loads_without_a_warning(saved, target):
    model, dense_optimizer, _ = target
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checkpoint.load(saved, model, dense_optimizer) == {"step": 2}
    want_model, want_optimizer = _model(seed=0)
    _assert_same(_everything(model, dense_optimizer), _everything(want_model, want_optimizer))


def test_byte_flips_in_40_places_are_all_refused_naming_the_file(saved, target, tmp_path):
    data = saved.read_bytes()
    # Spread over the whole file: zip headers, the pickle, every tensor record, the end record, the hash.
    places = sorted({*np.linspace(0, len(data) - 1, 36).astype(int), 1, len(data) - 1, len(data) - 30, len(data) - 90})
    places = places[:40]
    assert len(places) >= 36
    damaged = tmp_path / "ckpt.pt"
    for at in places:
        flipped = bytearray(data)
        flipped[at] ^= 0x10
        damaged.write_bytes(bytes(flipped))
        message = _refused(damaged, target)
        assert str(damaged) in message, (at, message)


@pytest.mark.parametrize("keep", [0, 10, 0.5, -1, -78, -100])
def test_truncated_files_are_refused_naming_the_file(saved, target, tmp_path, keep):
    data = saved.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    damaged = tmp_path / "ckpt.pt"
    damaged.write_bytes(data[:cut])
    assert str(damaged) in _refused(damaged, target)


def test_a_deleted_file_is_refused_naming_it(target, tmp_path):
    assert str(tmp_path / "gone.pt") in _refused(tmp_path / "gone.pt", target, "no such checkpoint file")


def test_a_damaged_entry_is_named(saved, target, tmp_path):
    # Re-saved by torch without the file hash, one table value changed: the entry's checksum catches it.
    state = torch.load(saved, weights_only=True)
    key = next(k for k in state["model"] if k.endswith("t1.weight"))
    state["model"][key][0, 0] += 1
    torch.save(state, tmp_path / "ckpt.pt")
    message = _refused(tmp_path / "ckpt.pt", target, "file hash written by save is missing")
    assert str(tmp_path / "ckpt.pt") in message
    with pytest.raises(checkpoint.CheckpointError, match=f"entry '/model/{key}' is damaged"):
        checkpoint.load_state_dict(target[0], state, target[1])
    _assert_same(_everything(target[0], target[1]), target[2])


@pytest.mark.parametrize(
    "other",
    [
        {"tables": make_tables(dims=(4, 4, 4), rows=(14, 7, 5))},  # more rows
        {"tables": make_tables(dims=(4, 4, 4), rows=(13, 6, 5))},  # fewer rows
        {"dense_sizes": (16, 4)},  # other dense layer sizes
    ],
    ids=["more-rows", "fewer-rows", "other-dense"],
)
def test_a_checkpoint_of_another_model_is_refused_naming_the_entry(saved, other):
    model, dense_optimizer = _model(seed=1, **other)
    before = _everything(model, dense_optimizer)
    with pytest.raises(ValueError, match=r"checkpoint entry \S+ has shape \(\d+, \d+\), the model's is"):
        checkpoint.load(saved, model, dense_optimizer)
    _assert_same(_everything(model, dense_optimizer), before)


def test_an_adam_checkpoint_is_refused_by_an_adagrad_model(saved):
    model, dense_optimizer = _model(optimizer=sp.Adagrad(0.1), seed=1)
    before = _everything(model, dense_optimizer)
    with pytest.raises(
        ValueError, match=r"module 'sparse_arch.embedding_bag_collection'.*state is of Adam, but .* uses Adagrad"
    ):
        checkpoint.load(saved, model, dense_optimizer)
    _assert_same(_everything(model, dense_optimizer), before)


def test_an_old_checkpoint_without_checksums_loads_with_one_warning(saved, target, tmp_path):
    state = torch.load(saved, weights_only=True)
    del state["checksums"]
    old = tmp_path / "old.pt"
    torch.save(state, old)
    model, dense_optimizer, _ = target
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            checkpoint.load(old, model, dense_optimizer)
    messages = [str(w.message) for w in record if "without checksums" in str(w.message)]
    assert len(messages) == 1, messages
    assert str(old) in messages[0] and "save it again with tpurec.sparse.checkpoint.save" in messages[0]
    want_model, want_optimizer = _model(seed=0)
    _assert_same(_everything(model, dense_optimizer), _everything(want_model, want_optimizer))


def test_the_next_save_removes_leftover_temporary_files_and_lists_checkpoints(tmp_path):
    model, dense_optimizer = _model(seed=0)
    leftover = tmp_path / ".step1.pt.a1b2c3d4.tmp"  # what a save killed mid-write leaves
    leftover.write_bytes(b"half a checkpoint")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    first = checkpoint.save(tmp_path / "step2.pt", model, dense_optimizer)
    assert not leftover.exists()
    second = checkpoint.save(tmp_path / "step1.pt", model, dense_optimizer)
    os.utime(first, ns=(1_000_000_000, 1_000_000_000))  # the older one, whatever the names say
    os.utime(second, ns=(2_000_000_000, 2_000_000_000))
    (tmp_path / ".step3.pt.zzzzzzzz.tmp").write_bytes(b"PK")  # a save in progress is not listed
    assert checkpoint.list_checkpoints(tmp_path) == [first, second]


def test_a_checkpoint_saved_on_tpu_is_checked_too(tmp_path):
    model, dense_optimizer = _model(device="tpu", seed=0)
    path = checkpoint.save(tmp_path / "ckpt.pt", model, dense_optimizer)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    other, other_optimizer = _model(device="tpu", seed=1)
    before = _everything(other, other_optimizer)
    with pytest.raises(checkpoint.CheckpointError, match="the file is damaged"):
        checkpoint.load(path, other, other_optimizer)
    _assert_same(_everything(other, other_optimizer), before)
