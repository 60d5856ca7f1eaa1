"""Measures float32 special functions on the tpu device against float64 computed on the host.

Run on a machine with a TPU (``python tests/dense/special_accuracy_on_device.py``); writes
``$OUT/special_accuracy.json`` (or ./special_accuracy.json): for each function, the largest relative
error of the device's float32 result and of PyTorch CPU's float32 result against PyTorch CPU's
float64 one (over inputs whose float64 answer is a normal float32 number), where the device's is
largest, how many inputs exceed twice CPU's error plus 8 float32 epsilons, and how many NaN or
infinities differ from CPU's. Unary functions are scanned at every 8192nd float32 bit pattern,
binary ones on a log-spaced grid.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable

import numpy as np
import torch

import tpurec  # noqa: F401  (the tpu device)

_TINY = float(np.finfo(np.float32).tiny)
_MAX = float(np.finfo(np.float32).max)
_EPS = 2.0**-23


def _every_float32(stride: int = 2**13) -> np.ndarray:
    values = np.arange(0, 2**32, stride, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = values[np.isfinite(values) & ((np.abs(values) >= _TINY) | (values == 0))]
    return np.concatenate([values, np.array([np.inf, -np.inf, np.nan], np.float32)])


def _grid(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.meshgrid(first.astype(np.float32), second.astype(np.float32), indexing="ij")
    return a.ravel(), b.ravel()


def _log_spaced(low: float, high: float, n: int) -> np.ndarray:
    return np.concatenate([10 ** np.linspace(low, high, n), [0.0]])


def _measure(function: Callable[..., torch.Tensor], inputs: tuple[np.ndarray, ...]) -> dict:
    tensors = [torch.from_numpy(np.ascontiguousarray(x)) for x in inputs]
    start = time.perf_counter()
    exact = function(*(t.double() for t in tensors)).numpy()
    cpu = function(*tensors).double().numpy()
    device = function(*(t.to("tpu") for t in tensors)).cpu().double().numpy()
    normal = np.isfinite(exact) & (np.abs(exact) >= _TINY) & (np.abs(exact) <= _MAX)
    with np.errstate(all="ignore"):
        device_error = np.where(normal, np.abs(device - exact) / np.abs(exact), 0.0)
        cpu_error = np.where(normal, np.abs(cpu - exact) / np.abs(exact), 0.0)
    device_error = np.where(np.isnan(device_error), np.inf, device_error)
    worst = int(np.argmax(device_error))
    return {
        "inputs": int(exact.size),
        "device_max_relative_error": float(device_error.max()),
        "device_worst_at": [float(x[worst]) for x in inputs],
        "device_value_there": float(device[worst]),
        "float64_value_there": float(exact[worst]),
        "cpu_float32_max_relative_error": float(cpu_error.max()),
        "over_twice_cpu_plus_8_eps": int((normal & (device_error > 2 * cpu_error + 8 * _EPS)).sum()),
        "nan_mismatches_outside_normal": int((~normal & (np.isnan(device) != np.isnan(cpu))).sum()),
        "inf_mismatches_outside_normal": int((~normal & (np.isinf(device) != np.isinf(cpu))).sum()),
        "seconds": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    x = _every_float32()
    unary: dict[str, Callable[..., torch.Tensor]] = {
        "erfc": torch.erfc,
        "erfcx": torch.special.erfcx,
        "log_ndtr": torch.special.log_ndtr,
        "ndtr": torch.special.ndtr,
        "ndtri": torch.special.ndtri,
        "erf": torch.erf,
        "erfinv": torch.erfinv,
        "lgamma": torch.lgamma,
        "digamma": torch.digamma,
        "i0e": torch.special.i0e,
        "i1e": torch.special.i1e,
        "bessel_j0": torch.special.bessel_j0,
        "bessel_y0": torch.special.bessel_y0,
        "modified_bessel_k0": torch.special.modified_bessel_k0,
        "airy_ai": torch.special.airy_ai,
    }
    shapes = _log_spaced(-30, 7, 300)
    binary: dict[str, tuple[Callable[..., torch.Tensor], tuple[np.ndarray, np.ndarray]]] = {
        "zeta": (
            torch.special.zeta,
            _grid(
                np.concatenate([1 + 10 ** np.linspace(-6, 0, 100), np.linspace(2, 120, 200)]), _log_spaced(-30, 7, 300)
            ),
        ),
        "igamma": (torch.special.gammainc, _grid(shapes, shapes)),
        "igammac": (torch.special.gammaincc, _grid(shapes, shapes)),
        "pow": (torch.pow, _grid(_log_spaced(-30, 30, 300), np.linspace(-20, 20, 301))),
        "polygamma_2": (lambda t, _: torch.polygamma(2, t), (x[::8], x[::8])),
    }
    results = {"device": str(torch.ones(1, device="tpu").device), "functions": {}}
    for name, function in unary.items():
        results["functions"][name] = _measure(function, (x,))
        print(name, results["functions"][name], flush=True)
    for name, (function, inputs) in binary.items():
        results["functions"][name] = _measure(function, inputs)
        print(name, results["functions"][name], flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "special_accuracy.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
