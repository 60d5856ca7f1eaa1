"""Importing tpurec must not change what other backends see."""

import subprocess
import sys


def test_import_leaves_torch_decomposition_table_alone():
    # A decomposition added to torch's global table makes inductor refuse to
    # start under CI=1 ("a decomposition exists, we should switch to it").
    code = (
        "import torch\n"
        "from torch._decomp import decomposition_table\n"
        "before = set(decomposition_table)\n"
        "import tpurec\n"
        "from tpurec.dense.registry import _load_families\n"
        "_load_families()\n"
        "(torch.ones(2, device='tpu') * 2).cpu()\n"
        "added = set(decomposition_table) - before\n"
        "assert not added, sorted(map(str, added))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
