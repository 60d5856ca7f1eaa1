"""Sharded checkpoints refuse what is damaged or does not fit, and change nothing when they do.

Damage: byte flips in 40 places over the checkpoint's files, truncated and deleted files,
an interrupted save, a checkpoint of another model (more or fewer rows, other dense sizes)
or of another optimizer. Every case is an error naming the file or the entry, and the
model's whole state (tables, slots, step, dense) is bit-identical after it.
"""

from __future__ import annotations

import json
import shutil
import warnings

import jax
import numpy as np
import pytest
import torch
from helpers import make_tables, random_kjt
from jax.sharding import Mesh
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM

import tpurec
import tpurec.sparse as sp
from tpurec.sparse.checkpoint import sharded as checkpoint

EBC_PATH = "sparse_arch.embedding_bag_collection"
ROWS = (40, 23, 17)


def _tables(rows=ROWS):
    return make_tables(dims=(8, 8, 8), rows=rows, features=(("f0", "f1"), ("f2",), ("f3",)))


def _model(seed=0, rows=ROWS, optimizer=None, dense_sizes=(16, 8), devices=4, plan=None):
    tables = _tables(rows)
    torch.manual_seed(seed)
    reference = DLRM(
        embedding_bag_collection=TorchrecEBC(tables),
        dense_in_features=5,
        dense_arch_layer_sizes=list(dense_sizes),
        over_arch_layer_sizes=[16, 1],
    )
    model = sp.from_torchrec(reference, optimizer=optimizer or sp.Adam(learning_rate=0.05)).to("tpu")
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    plan = plan or {"t0": row_wise(), "t1": table_wise(rank=1), "t2": table_wise(rank=2)}
    module_plan = construct_module_sharding_plan(meta, plan, local_size=devices, world_size=devices, device_type="cpu")
    mesh = Mesh(np.array(jax.devices()[:devices]), ("devices",))
    model = tpurec.shard(model, ShardingPlan({EBC_PATH: module_plan}), mesh)
    dense_optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    rng = np.random.default_rng(seed)
    for _ in range(2):  # non-zero slots and a step count
        dense = torch.from_numpy(rng.standard_normal((8, 5)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, 8).astype(np.float32))
        dense_optimizer.zero_grad()
        logits = model(dense, random_kjt(tables, 8, rng)).squeeze(-1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to("tpu")).backward()
        dense_optimizer.step()
    return model


def _everything(model) -> dict[str, np.ndarray]:
    ebc = model.sparse_arch.embedding_bag_collection
    tables, slots = ebc.full_tables()
    state = {f"table/{k}": v for k, v in tables.items()}
    state.update({f"slot/{t}/{s}": v for t, d in slots.items() for s, v in d.items()})
    state.update(
        {f"dense/{k}": v.cpu().numpy() for k, v in model.state_dict().items() if "embedding_bag_collection" not in k}
    )
    state["step"] = np.array(ebc._step)
    return {k: np.array(v, copy=True) for k, v in state.items()}


def _assert_same(after, before):
    assert after.keys() == before.keys()
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value, err_msg=key)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    model = _model(seed=0)
    checkpoint.save(model, path)
    return path, _everything(model)


@pytest.fixture(scope="module")
def target():
    model = _model(seed=1, devices=2, plan={"t0": table_wise(rank=0), "t1": row_wise(), "t2": table_wise(rank=1)})
    return model, _everything(model)


def _refused(path, target, match=None, error=ValueError) -> str:
    model, before = target
    with pytest.raises(error, match=match) as info:
        checkpoint.load(model, path)
    _assert_same(_everything(model), before)
    return str(info.value)


def _files(folder):
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_an_intact_checkpoint_loads_resharded_without_a_warning(saved, tmp_path):
    path, want = saved
    model = _model(seed=3, devices=2, plan={"t0": table_wise(rank=0), "t1": row_wise(), "t2": table_wise(rank=1)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.load(model, path)
    _assert_same(_everything(model), want)


def test_byte_flips_in_40_places_are_all_refused_naming_the_file(saved, target, tmp_path):
    path, _ = saved
    files = [p.relative_to(path) for p in _files(path)]
    # Every file at its start, middle and end, then more places in the largest files.
    places = [(f, where) for f in files for where in (0.0, 0.5, 1.0)]
    by_size = sorted(files, key=lambda f: -(path / f).stat().st_size)
    places += [(f, where) for where in (0.2, 0.8) for f in by_size][: max(0, 40 - len(places))]
    places = places[:40]
    assert len(places) == 40
    for relative, where in places:
        damaged = tmp_path / "ckpt"
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(path, damaged)
        file = damaged / relative
        data = bytearray(file.read_bytes())
        if not data:
            continue
        at = min(int(len(data) * where), len(data) - 1)
        data[at] ^= 0x10
        file.write_bytes(bytes(data))
        message = _refused(damaged, target)
        assert str(damaged) in message, (relative, at, message)


@pytest.mark.parametrize("what", ["truncate", "delete"])
def test_cut_and_deleted_files_are_refused_naming_the_file(saved, target, tmp_path, what):
    path, _ = saved
    for relative in [p.relative_to(path) for p in _files(path)]:
        damaged = tmp_path / "ckpt"
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(path, damaged)
        file = damaged / relative
        if what == "truncate":
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
        else:
            file.unlink()
        message = _refused(damaged, target)
        assert str(damaged) in message, (relative, message)


def test_a_missing_folder_and_an_interrupted_save_are_refused(saved, target, tmp_path):
    path, _ = saved
    _refused(tmp_path / "nothing", target, "no such checkpoint folder")
    unfinished = tmp_path / "ckpt.orbax-checkpoint-tmp-1234"
    shutil.copytree(path, unfinished)
    _refused(unfinished, target, "a save that did not finish")
    without_manifest = tmp_path / "ckpt"
    shutil.copytree(path, without_manifest)
    (without_manifest / "tpurec_manifest.json").unlink()
    assert str(without_manifest) in _refused(without_manifest, target, "tpurec_manifest.json: missing")


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (
            {"rows": (41, 23, 17)},
            r"checkpoint entry sparse_arch.embedding_bag_collection.embedding_bags.t0.weight has shape \(40, 8\), the model's is \(41, 8\)",
        ),
        (
            {"rows": (40, 22, 17)},
            r"checkpoint entry sparse_arch.embedding_bag_collection.embedding_bags.t1.weight has shape \(23, 8\), the model's is \(22, 8\)",
        ),
        (
            {"dense_sizes": (32, 8)},
            r"checkpoint entry dense_arch.model._mlp.0._linear.weight has shape \(16, 5\), the model's is \(32, 5\)",
        ),
    ],
    ids=["more-rows", "fewer-rows", "other-dense"],
)
def test_a_checkpoint_of_another_model_is_refused_naming_the_entry(saved, other, match):
    path, _ = saved
    model = _model(seed=1, **other)
    _refused(path, (model, _everything(model)), match)


def test_an_adam_checkpoint_is_refused_by_an_adagrad_model(saved):
    path, _ = saved
    model = _model(seed=1, optimizer=sp.Adagrad(learning_rate=0.1))
    _refused(
        path,
        (model, _everything(model)),
        r"module 'sparse_arch.embedding_bag_collection': the optimizer state is of Adam, but this EmbeddingBagCollection uses Adagrad",
    )


def test_an_old_checkpoint_without_checksums_loads_with_one_warning(saved, tmp_path):
    path, want = saved
    import orbax.checkpoint as ocp

    # What an older tpurec wrote: the same tree, no checksums, description or manifest.
    old = tmp_path / "old"
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(path)
        del tree["checksums"]
        checkpointer.save(old, tree)
        checkpointer.wait_until_finished()
    model = _model(seed=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        checkpoint.load(model, old)
        checkpoint.load(model, old)
    messages = [str(w.message) for w in record if "without checksums" in str(w.message)]
    assert len(messages) == 1 and str(old) in messages[0] and "save it again" in messages[0], messages
    _assert_same(_everything(model), want)


def test_the_next_save_removes_leftover_temporary_folders_and_lists_checkpoints(saved, tmp_path):
    path, _ = saved
    leftover = tmp_path / "step1.orbax-checkpoint-tmp-1700000000"  # what a killed save leaves
    shutil.copytree(path, leftover)
    model = _model(seed=0)
    checkpoint.save(model, tmp_path / "step2")
    assert not leftover.exists()
    checkpoint.save(model, tmp_path / "step3")
    assert checkpoint.list_checkpoints(tmp_path) == [tmp_path / "step2", tmp_path / "step3"]
    manifest = json.loads((tmp_path / "step3" / "tpurec_manifest.json").read_text())
    assert "_METADATA" in manifest["files"]


def test_a_damaged_tensor_is_named_by_its_checksum(saved, target, tmp_path):
    # Damage that file hashes cannot see (the manifest rewritten after it): one table value changed.
    path, _ = saved
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(path)
        custom = checkpointer.metadata(path).custom_metadata
        tables = tree["embeddings"]["sparse_arch~embedding_bag_collection"]["tables"]
        tables["t1"]["momentum2"] = np.asarray(tables["t1"]["momentum2"]).copy()
        tables["t1"]["momentum2"][3, 2] += 1.0
        checkpointer.save(tmp_path / "ckpt", tree, custom_metadata=custom)
        checkpointer.wait_until_finished()
    checkpoint._write_manifest(tmp_path / "ckpt")
    _refused(tmp_path / "ckpt", target, r"entry 'sparse_arch.embedding_bag_collection' table 't1' momentum2 is damaged")
