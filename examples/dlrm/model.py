"""TorchRec's DLRM variants on the tpu device.

The model is TorchRec's own ``DLRM``, ``DLRM_DCN`` or ``DLRM_Projection``,
unmodified, built as ``dlrm_main.py`` builds it: one table per sparse feature,
the ``EmbeddingBagCollection`` on the ``meta`` device. ``tpurec.sparse.
from_torchrec`` then swaps in tpurec's SparseCore-shaped collection, which
materialises the tables itself (from the configs' initialisers) with the fused
embedding optimizer, so a large model is never held twice.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection

import tpurec.sparse as sparse
from dlrm.flags import DENSE_FEATURES, Config, ConfigError


def table_configs(cfg: Config) -> list[EmbeddingBagConfig]:
    """One table ``t_<feature>`` per sparse feature, as ``dlrm_main.py`` names them."""
    return [
        EmbeddingBagConfig(name=f"t_{name}", embedding_dim=cfg.embedding_dim, num_embeddings=rows, feature_names=[name])
        for name, rows in zip(cfg.feature_names, cfg.table_rows)
    ]


def build_torchrec_model(cfg: Config, embedding_bag_collection: nn.Module) -> nn.Module:
    """TorchRec's model for ``--interaction_type`` around ``embedding_bag_collection``."""
    common = dict(
        embedding_bag_collection=embedding_bag_collection,
        dense_in_features=DENSE_FEATURES,
        dense_arch_layer_sizes=cfg.dense_arch_layer_sizes,
        over_arch_layer_sizes=cfg.over_arch_layer_sizes,
    )
    if cfg.interaction_type == "original":
        return DLRM(**common)
    if cfg.interaction_type == "dcn":
        return DLRM_DCN(**common, dcn_num_layers=cfg.dcn_num_layers, dcn_low_rank_dim=cfg.dcn_low_rank_dim)
    if cfg.interaction_type == "projection":
        return DLRM_Projection(
            **common,
            interaction_branch1_layer_sizes=cfg.interaction_branch1_layer_sizes,
            interaction_branch2_layer_sizes=cfg.interaction_branch2_layer_sizes,
        )
    raise ConfigError(f"unknown --interaction_type {cfg.interaction_type!r}; choose one of original, dcn, projection")


def embedding_optimizer(cfg: Config) -> sparse.EmbeddingOptimizer:
    """The fused embedding optimizer: ``--embedding_optimizer`` (default Adagrad
    with ``--adagrad``, else SGD, as ``dlrm_main.py``), at ``--learning_rate``."""
    lr, eps = cfg.learning_rate, cfg.eps
    return {
        "sgd": lambda: sparse.SGD(learning_rate=lr),
        "adagrad": lambda: sparse.Adagrad(learning_rate=lr, eps=eps),
        "rowwise_adagrad": lambda: sparse.RowWiseAdagrad(learning_rate=lr, eps=eps),
        "adam": lambda: sparse.Adam(learning_rate=lr, eps=eps),
    }[cfg.embedding_optimizer]()


def dense_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """``torch.optim`` Adagrad (``--adagrad``) or SGD over the dense parameters.

    The tables are updated inside the backward (fused) and get no gradient, so
    they are left out.
    """
    from tpurec.sparse.sharding import ShardedEmbeddingBagCollection

    kinds = (sparse.EmbeddingBagCollection, ShardedEmbeddingBagCollection)
    tables = {id(p) for m in model.modules() if isinstance(m, kinds) for p in m.parameters()}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in tables]
    if cfg.adagrad:
        # graphed: fused=True keeps the step counts on the device, where a replay advances them (same arithmetic)
        return torch.optim.Adagrad(
            params, lr=cfg.learning_rate, eps=cfg.eps, fused=True if cfg.mode == "graphed" else None
        )
    return torch.optim.SGD(params, lr=cfg.learning_rate)


def ids_per_sample(cfg: Config) -> int:
    """Ids one sample looks up over all features (its bag sizes added up)."""
    return sum(cfg.multi_hot_sizes) if cfg.multi_hot_sizes else len(cfg.feature_names)


def build_model(cfg: Config, device: str = "tpu", max_ids_per_sample: int | None = None) -> nn.Module:
    """The training model on ``device``, seeded with ``--seed``.

    Args:
        cfg: the run's config.
        device: where the model lives.
        max_ids_per_sample: ids of one sample over all features (default: from
            ``--multi_hot_sizes``, else one per feature); sizes the static
            capacity of the sparse input so that no batch recompiles.

    Returns:
        TorchRec's model with tpurec's ``EmbeddingBagCollection`` inside.
    """
    torch.manual_seed(cfg.seed)
    ebc = EmbeddingBagCollection(tables=table_configs(cfg), device=torch.device("meta"))
    model = build_torchrec_model(cfg, ebc)
    per_sample = max_ids_per_sample or ids_per_sample(cfg)
    # All tables have --embedding_dim, so they share one stack and one partition:
    # a batch never holds more ids than this.
    capacity = sparse.Capacity(max(cfg.batch_size, cfg.test_batch_size) * per_sample)
    model = sparse.from_torchrec(model, optimizer=embedding_optimizer(cfg), device=device, capacities=capacity)
    return model.to(device)
