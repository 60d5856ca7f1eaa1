"""Cross-check preprocess_kjt against jax-tpu-embedding's host preprocessing."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

import tpurec.sparse as sp

jte = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding")
from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec  # noqa: E402


def _jte_entries(out, name, num_sc, num_partitions, batch_size):
    """Valid (partition, global id, global sample, gain) of jax-tpu-embedding's buffers.

    Its buffers hold one chunk per SparseCore (a contiguous slice of the batch);
    inside a chunk, partition p's entries end at row_pointers[p] and the next
    partition starts at the pointer rounded up to 8. Ids are shard-local
    (id // P), samples chunk-local.
    """
    rp = np.asarray(out.lhs_row_pointers[name]).reshape(num_sc, -1)
    ids = np.asarray(out.lhs_embedding_ids[name]).reshape(num_sc, -1)
    samples = np.asarray(out.lhs_sample_ids[name]).reshape(num_sc, -1)
    gains = np.asarray(out.lhs_gains[name]).reshape(num_sc, -1)
    per_sc = batch_size // num_sc
    entries, counts = [], collections.Counter()
    for c in range(num_sc):
        start = 0
        for p in range(num_partitions):
            end = int(rp[c, p])
            for i in range(start, end):
                entries.append(
                    (
                        p,
                        int(ids[c, i]) * num_partitions + p,
                        c * per_sc + int(samples[c, i]),
                        round(float(gains[c, i]), 5),
                    )
                )
            counts[p] += end - start
            start = -(-end // 8) * 8
    return sorted(entries), counts


@pytest.mark.parametrize("num_sc,weighted,pooling", [(2, False, "sum"), (4, True, "sum"), (2, False, "mean")])
def test_same_entries_as_jax_tpu_embedding(num_sc, weighted, pooling):
    rng = np.random.default_rng(num_sc)
    batch_size = 8
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=8,
            num_embeddings=rows,
            feature_names=[f"f{i}"],
            pooling=PoolingType.SUM if pooling == "sum" else PoolingType.MEAN,
        )
        for i, rows in enumerate((37, 11))
    ]
    features, weights, specs, values, lengths, all_weights = {}, {}, {}, [], [], []
    for t in tables:
        f = t.feature_names[0]
        lens = rng.integers(0, 5, batch_size)
        ids = [rng.integers(0, t.num_embeddings, n).astype(np.int32) for n in lens]
        ws = [rng.uniform(0.5, 2.0, n).astype(np.float32) for n in lens]
        features[f] = np.empty(batch_size, dtype=object)
        weights[f] = np.empty(batch_size, dtype=object)
        for b in range(batch_size):
            features[f][b] = ids[b]
            weights[f][b] = ws[b] if weighted else np.ones(lens[b], np.float32)
        values.extend(ids)
        all_weights.extend(ws)
        lengths.append(lens)
        table_spec = embedding_spec.TableSpec(
            name=t.name,
            vocabulary_size=t.num_embeddings,
            embedding_dim=8,
            initializer=lambda *a, **k: None,
            optimizer=embedding_spec.SGDOptimizerSpec(),
            combiner=pooling,
            max_ids_per_partition=64,
            max_unique_ids_per_partition=64,
        )
        specs[f] = embedding_spec.FeatureSpec(
            name=f, table_spec=table_spec, input_shape=[batch_size, 1], output_shape=[batch_size, 8]
        )
    jte.prepare_feature_specs_for_training(specs, global_device_count=1, num_sc_per_device=num_sc)
    out, _ = jte.preprocess_sparse_dense_matmul_input(features, weights, specs, 1, 1, num_sc_per_device=num_sc)

    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[t.feature_names[0] for t in tables],
        values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
        lengths=torch.from_numpy(np.concatenate(lengths)),
        weights=torch.from_numpy(np.concatenate(all_weights)) if weighted else None,
    )
    ours = sp.preprocess_kjt(
        kjt, sp.stack_tables(tables, stack=False), num_partitions=num_sc, capacities=sp.Capacity(64)
    )
    for t in tables:
        csr = ours.stacks[t.name]
        size = csr.embedding_ids.shape[0] // num_sc
        mine = sorted(
            (p, int(csr.embedding_ids[i]), int(csr.sample_ids[i]), round(float(csr.gains[i]), 5))
            for p in range(num_sc)
            for i in range(p * size, int(csr.row_pointers[p]))
        )
        theirs, counts = _jte_entries(out, t.name, num_sc, num_sc, batch_size)
        assert mine and mine == theirs
        # Row pointers agree: our partition length is the sum of its per-SparseCore lengths.
        assert [int(csr.row_pointers[p]) - p * size for p in range(num_sc)] == [counts[p] for p in range(num_sc)]
