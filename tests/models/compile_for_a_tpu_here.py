"""XLA:TPU compile seconds of a zoo family's fused training step, measured on a machine without a TPU.

libtpu compiles for a TPU topology with no chip attached (JAX's deviceless ahead-of-time compilation):
this script trains the zoo's tiny model (tests/models/zoo.py) for two fused steps on the tpu device
here (XLA:CPU), then compiles each fused window's program again for a TPU v5e and prints its StableHLO
size and compile seconds; ``--per-op`` also compiles each op of the steady window on its own, totalled
by op, which names the ops XLA:TPU is slow to compile (a first run of each kind pays a fixed cost). It
needs libtpu (``pip install "jax[tpu]==<jax's version>"``), which tpurec does not depend on: CI does not
run it. The seconds are this machine's; the chip's host compiles faster, in the same proportions.

    TPU_ACCELERATOR_TYPE=v5litepod-1 JAX_PLATFORMS=cpu python tests/models/compile_for_a_tpu_here.py resnet --per-op
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path
from typing import Any

_OPERATION = re.compile(r"^\s*(?:%\S+(?:, %\S+)* = )?\"?((?:stablehlo|chlo)\.[a-z_]+)", re.M)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("family", help="a zoo family (tests/models/zoo.py)")
    parser.add_argument("--per-op", action="store_true", help="also compile each op of the steady window alone")
    parser.add_argument("--topology", default="v5e:1x1", help="libtpu's topology name")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import jax
    import torch
    from jax.experimental import topologies

    import tpurec
    import zoo
    from tpurec.core import accounting, fused, runtime

    programs: list[tuple[str, Any, dict, tuple]] = []
    windows: list[list] = []
    execute, build = runtime.Program._execute, fused._build

    def observed(self, jitted, arguments):
        if not self.ran:
            programs.append((accounting._compile_label(self.origin), self.raw, self._options, arguments))
        return execute(self, jitted, arguments)

    def built(nodes, *rest, **options):
        windows.append(list(nodes))
        return build(nodes, *rest, **options)

    setattr(runtime.Program, "_execute", observed)
    fused._build = built
    model, batch, _ = zoo.initial(zoo.FAMILIES[args.family])
    model = model.to("tpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=zoo.LR)
    batch = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    for _ in range(2):
        with tpurec.mode("fused"):
            optimizer.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
        float(loss.detach().cpu())

    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=args.topology, chip_config_name="default", chips_per_host_bounds=(1, 1, 1)
    )
    on_tpu = jax.sharding.SingleDeviceSharding(topology.devices[0])

    def spec(x):
        if isinstance(x, (jax.Array, fused.Pending)):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_tpu)
        return x

    def compile_seconds(fn, options: dict, arguments) -> tuple[int, float]:
        options = {k: v for k, v in options.items() if k != "out_shardings"}
        lowered = jax.jit(fn, out_shardings=on_tpu, **options).lower(*jax.tree.map(spec, arguments))
        start = time.perf_counter()
        lowered.compile()
        return len(_OPERATION.findall(lowered.as_text())), time.perf_counter() - start

    for label, raw, options, arguments in programs:
        if label.startswith("fused window"):
            size, seconds = compile_seconds(raw, options, arguments)
            print(f"{args.family} {label}: {size} StableHLO ops, XLA:TPU compile {seconds:.2f} s", flush=True)
    if args.per_op and windows:
        by_op: collections.defaultdict[str, float] = collections.defaultdict(float)
        count: collections.Counter = collections.Counter()
        for node in windows[-1]:
            origin = node.program.origin
            label = str(origin[1][0]) if origin and origin[0] == "op" else str(origin)[:60]
            _, seconds = compile_seconds(node.program.raw, {}, node.inputs)
            by_op[label] += seconds
            count[label] += 1
        print(f"{args.family}: the steady window's {len(windows[-1])} ops compiled one by one, slowest first")
        for label, seconds in sorted(by_op.items(), key=lambda item: -item[1])[:15]:
            print(f"  {seconds:7.2f} s  {count[label]:3d}x {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
