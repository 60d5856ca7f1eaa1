"""How `make test` shares the suite out between pytest-xdist workers: units of tests (a file, or a part of one),
handed out in collection order, one to a worker when it is about to run out of work.

This module imports only pytest and pytest-xdist, so that a small suite of its own (tests/test_scheduling.py)
can run under it: a worker that dies must not stop the run, and must not leave it waiting forever.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController


def file_of(nodeid: str) -> str:
    """The default unit: the test's file."""
    return nodeid.partition("::")[0]


class FileScheduling(LoadScopeScheduling):
    """``--dist loadfile`` with units from :attr:`unit_of`, handed out in collection order, a unit handed to a worker
    only when it has one test left (xdist holds back a worker's last test until it knows the next one, so a unit is
    handed over then, not earlier: no unit waits behind a long one).

    A worker that dies: the test it was running is reported as failed by xdist (``worker 'gwN' crashed while running
    ...``) and is not run again; the rest of its units go back to the front of the queue, for the other workers and
    the worker started in its place.
    """

    unit_of: Callable[[str], str] = staticmethod(file_of)

    def _split_scope(self, nodeid: str) -> str:
        return self.unit_of(nodeid)

    def remove_node(self, node: WorkerController) -> str | None:
        # xdist's LoadScopeScheduling puts back every unit the node was ever given, finished ones included, and the
        # test that took the node down as still to run. A finished unit handed to a worker holding its last test
        # sends it nothing to run: no test ends, nothing asks for more work, and the run waits forever (a whole-suite
        # run hung at 99% so). Here only unfinished tests go back, the lost one not among them (run again, it would
        # take down the next worker as well).
        workload = self.assigned_work.pop(node)
        unfinished = [(scope, tests) for scope, tests in workload.items() if not all(tests.values())]
        if not unfinished:
            return None
        # A worker runs its units' tests in the order it was given them: the first unfinished one was running.
        crashitem = next(nodeid for _, tests in unfinished for nodeid, done in tests.items() if not done)
        requeued: OrderedDict[str, dict[str, bool]] = OrderedDict()
        for scope, tests in unfinished:
            if crashitem in tests:
                tests[crashitem] = True
            if not all(tests.values()):
                requeued[scope] = tests
        # The lost worker's units were due before the queue's: they go first.
        requeued.update(self.workqueue)
        self.workqueue = requeued
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if node not in self.registered_collections:
            # A worker started in place of one that died: it gets work once its collection is in (xdist reschedules
            # every node when any one finishes collecting, and would index this one's missing collection: an
            # INTERNALERROR that ends the whole run).
            return
        if not self.workqueue:
            node.shutdown()
            return
        while self.workqueue and self._pending_of(self.assigned_work[node]) <= 1:
            self._assign_work_unit(node)

    def _assign_work_unit(self, node: WorkerController) -> None:
        # Only units with a test left are queued (see remove_node); a unit without one would send nothing.
        scope, tests = self.workqueue.popitem(last=False)
        self.assigned_work.setdefault(node, {})[scope] = tests
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in tests.items() if not done])

    def schedule(self) -> None:
        # Collection order, not xdist's default of the units with the most tests first.
        reorder = self.config.option.loadscopereorder
        self.config.option.loadscopereorder = False
        try:
            super().schedule()
        finally:
            self.config.option.loadscopereorder = reorder
