"""The tpu device's random number state: a seed and a counter.

Every random op folds the counter into ``jax.random.key(seed)`` inside its
compiled program, so seeds and counters are runtime values (no recompilation)
and ``torch.manual_seed`` makes device randomness reproducible.
"""

from __future__ import annotations

import jax
import numpy as np
import torch

__all__ = ["manual_seed", "next_seed_and_counter", "key_from", "get_state", "set_state"]

_seed = 0
_counter = 0
# While a step is captured (tpurec.core.graphs): every (seed high, seed low, counter) handed out.
_log: list | None = None


def manual_seed(seed: int) -> None:
    global _seed, _counter
    _seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    _counter = 0


def next_seed_and_counter() -> tuple[np.uint32, np.uint32, np.uint32]:
    """(seed high bits, seed low bits, counter) for the next random op; advances the counter."""
    global _counter
    counter = _counter
    _counter += 1
    out = np.uint32(_seed >> 32), np.uint32(_seed & 0xFFFF_FFFF), np.uint32(counter & 0xFFFF_FFFF)
    if _log is not None:
        _log.append((out, counter))
    return out


def key_from(seed_hi, seed_lo, counter):
    """The jax.random key of one random op (traceable)."""
    key = jax.random.key(seed_lo)
    key = jax.random.fold_in(key, seed_hi)
    return jax.random.fold_in(key, counter)


def get_state() -> torch.Tensor:
    """The state as a CPU uint8 tensor, like ``torch.cuda.get_rng_state``."""
    raw = np.array([_seed, _counter], dtype=np.uint64).view(np.uint8)
    return torch.from_numpy(raw.copy())


def set_state(state: torch.Tensor) -> None:
    global _seed, _counter
    if state.dtype != torch.uint8 or state.numel() != 16:
        raise ValueError("a tpu RNG state is a uint8 tensor of 16 bytes, as returned by torch.tpu.get_rng_state()")
    seed, counter = state.cpu().numpy().view(np.uint64)
    _seed, _counter = int(seed), int(counter)
