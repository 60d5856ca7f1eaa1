"""tpurec: recommendation models on TPUs from plain PyTorch.

``import tpurec`` makes ``"tpu"`` a PyTorch device (PrivateUse1 renamed),
backed by JAX devices: TPUs where present, otherwise XLA:GPU or XLA:CPU.

Example::

    import torch, tpurec
    model = torch.nn.Linear(4, 4).to("tpu")
    loss = model(torch.randn(8, 4, device="tpu")).sum()
    loss.backward()
"""

from importlib import metadata as _metadata

try:
    __version__: str = _metadata.version("tpurec")
except _metadata.PackageNotFoundError:  # a source checkout on sys.path, never installed
    __version__ = "0+unknown"
del _metadata

from tpurec import _patches  # noqa: E402

# Every change import tpurec makes to torch, JAX and the process, in order, with its reason: tpurec/_patches.py.
_patches.install()

from tpurec import core  # noqa: E402

from tpurec import library  # noqa: E402,F401
from tpurec import debug  # noqa: E402,F401 (TPUREC_SHADOW=cpu starts shadowing at import)
from tpurec.core import (  # noqa: E402
    TpuGraph,
    TpuTensor,
    enable_disk_cache,
    explain_recompiles,
    get_mode,
    graph,
    mode,
    platform,
    reset_stats,
    set_mode,
    stats,
    synchronize,
)
from tpurec.profiler import profile  # noqa: E402

from tpurec import config  # noqa: E402,F401

from tpurec._api import flush, shard  # noqa: E402
from tpurec._warmup import warmup  # noqa: E402
from tpurec.dense.registry import defer as _defer  # noqa: E402

# TorchRec's TPU lookup ops (its UNFUSED_TPU kernel under DistributedModelParallel) lower to the
# sparse op set, a layer above the lowering table: their family loads on the first such op.
_defer("torchrec", "tpurec.dmp.lookup_ops")

# The public API: what ``from tpurec import *`` and the docs promise. Everything else
# here (``tpurec.core``, ``tpurec.compile``, ...) is an implementation module.
__all__ = [
    "TpuGraph",
    "TpuTensor",
    "config",
    "debug",
    "enable_disk_cache",
    "explain_recompiles",
    "flush",
    "get_mode",
    "graph",
    "library",
    "mode",
    "platform",
    "profile",
    "reset_stats",
    "set_mode",
    "shard",
    "stats",
    "synchronize",
    "warmup",
]
