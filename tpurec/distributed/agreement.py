"""Every rank of a group checks that the others make the same collective call, in bounded time.

Before each collective every rank posts a short description of its call (the collective, shapes,
dtype, arguments, and a payload such as all-to-all split sizes) to the group's c10d store and
reads everyone's. Ranks that disagree all raise :class:`CollectiveMismatch` naming the collective
and the difference; a rank that never makes the call (it stopped early or skipped a collective)
makes the others raise :class:`CollectiveTimeout` after the group's timeout. Without this, XLA
programs that do not fit together would wait on each other forever. Only these descriptions go
through the store; tensor data never does.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence

import numpy as np
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

__all__ = ["Agreement", "CollectiveMismatch", "CollectiveTimeout"]


class CollectiveMismatch(RuntimeError):
    """The ranks of a group called collectives that do not fit together."""


class CollectiveTimeout(RuntimeError):
    """Some ranks of a group did not make a collective call within the group's timeout."""


class Agreement:
    """The call descriptions of one group's ranks, exchanged through its store (one round per collective).

    Args:
        store: the group's store.
        rank: this rank in the group.
        size: ranks in the group.
        timeout: how long to wait for the other ranks' calls.
    """

    def __init__(self, store: Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        self._store = PrefixStore("tpurec-calls/", store)
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._round = 0

    def __call__(
        self,
        name: str,
        shapes: Sequence[Sequence[int]],
        dtype: str,
        static: Sequence[int] = (),
        payload: Sequence[int] = (),
    ) -> np.ndarray:
        """Waits until every rank described its call; every rank's ``payload`` as an ``(n, len)`` matrix.

        Raises:
            CollectiveMismatch: the ranks' calls differ (on every rank, with the same message).
            CollectiveTimeout: some ranks did not make a call within the timeout.
        """
        call = {"collective": name, "shapes": [list(map(int, s)) for s in shapes], "dtype": dtype,
                "arguments": list(map(int, static))}  # fmt: skip
        keys = [f"{self._round}/{r}" for r in range(self._size)]
        self._store.set(keys[self._rank], json.dumps({"call": call, "payload": list(map(int, payload))}))
        try:
            self._store.wait(keys, self._timeout)
        except dist.DistStoreError:
            missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
            raise CollectiveTimeout(
                f"{name}: waited {self._timeout.total_seconds():g} s for group rank(s) {missing} to call a collective "
                f"(this rank called {_describe(call)}); a rank stopped early or skipped a collective: every rank must "
                "make the same collective calls in the same order"
            ) from None
        records = [json.loads(v) for v in self._store.multi_get(keys)]
        if self._round:  # every rank has read the previous round (it posted this one after it)
            self._store.delete_key(f"{self._round - 1}/{self._rank}")
        self._round += 1
        for r, record in enumerate(records):
            if record["call"] != records[0]["call"]:
                raise CollectiveMismatch(
                    f"{name}: the ranks of this group made calls that do not match: rank 0 called "
                    f"{_describe(records[0]['call'])} but rank {r} called {_describe(record['call'])}; every rank must "
                    "make the same collective calls in the same order, with the same shapes and dtype"
                )
        return np.array([record["payload"] for record in records], dtype=np.int64).reshape(self._size, -1)


def _describe(call: dict) -> str:
    arguments = f", arguments {call['arguments']}" if call["arguments"] else ""
    return f"{call['collective']} (shapes {call['shapes']}, dtype {call['dtype']}{arguments})"
