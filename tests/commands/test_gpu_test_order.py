"""The GPU tests' order (tests/gpu_order.py): every xdist worker starts with one of the longest tests, as
xdist's own worksteal scheduler hands the chunks out; no test lost or repeated; the predicted stage time close
to the longest-first bound. Pure functions and xdist's scheduler with stand-in workers: no GPU needed."""
from types import SimpleNamespace

import pytest

from tests.gpu_order import GPU_TEST_SECONDS, expected_seconds, spread_longest_first, worksteal_chunks


def _gpu_like_collection() -> tuple[list[str], list[float]]:
    """44 names like the GPU suite's: the table's long tests scattered late among fast ones, as collected."""
    long = ["test_trainer_on_cuda[extra0]", "test_trainer_on_cuda[extra1]", "test_trainer_on_cuda[extra2]",
            "test_trainer_on_cuda[extra3]", "test_trainer_zero_on_nccl_world_1",
            "test_whole_model_compiles_with_zero_graph_breaks[auto]",
            "test_whole_model_compiles_with_zero_graph_breaks[triton]", "test_gpu_opcheck_every_op"]
    names = [f"test_fast_{i}" for i in range(44 - len(long))]
    for k, name in enumerate(long):  # the long ones in the last third, as tests/model/test_gpu.py sits
        names.insert(28 + 2 * k, name)
    secs = [expected_seconds(n, n.split("[")[0]) for n in names]
    return names, secs


def _xdist_first_chunks(collection: list[str], workers: int) -> list[list[str]]:
    """What xdist's WorkStealingScheduling sends each of `workers` stand-in workers first."""
    ws = pytest.importorskip("xdist.scheduler.worksteal")

    class Node:
        def __init__(self, i):
            self.gateway = SimpleNamespace(id=f"gw{i}")
            self.shutting_down = False
            self.sent: list[int] = []

        def send_runtest_some(self, indices):
            self.sent.extend(indices)

        def send_runtest_all(self):
            self.sent.extend(range(len(collection)))

        def shutdown(self):
            self.shutting_down = True

    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"] if name == "tx" else None)
    sched = ws.WorkStealingScheduling(config)
    nodes = [Node(i) for i in range(workers)]
    for n in nodes:
        sched.add_node(n)
    for n in nodes:
        sched.add_node_collection(n, collection)
    sched.schedule()
    return [[collection[i] for i in n.sent] for n in nodes]


@pytest.mark.parametrize("n,workers", [(44, 6), (41, 6), (12, 4), (5, 3), (7, 8)])
def test_chunk_sizes_are_xdists(n, workers):
    collection = [f"t{i}" for i in range(n)]
    chunks = _xdist_first_chunks(collection, workers)
    assert [len(c) for c in chunks] == worksteal_chunks(n, workers)


def test_each_worker_starts_with_one_of_the_longest_and_nothing_is_lost():
    names, secs = _gpu_like_collection()
    order = spread_longest_first(names, secs, 6)
    assert sorted(order) == sorted(names)  # a permutation
    chunks = _xdist_first_chunks(order, 6)
    by_name = dict(zip(names, secs))
    six_longest = sorted(secs, reverse=True)[:6]
    assert sorted((by_name[c[0]] for c in chunks), reverse=True) == six_longest
    for c in chunks:  # each worker's share longest first
        assert [by_name[x] for x in c] == sorted((by_name[x] for x in c), reverse=True)
    # the predicted stage time: the most loaded first chunk, against the collection order's and the bound
    # max(longest test, total / workers)
    loads = [sum(by_name[x] for x in c) for c in chunks]
    as_collected = [sum(by_name[x] for x in c) for c in _xdist_first_chunks(names, 6)]
    bound = max(max(secs), sum(secs) / 6)
    assert max(loads) <= bound + max(s for s in secs if s < max(secs))  # LPT's guarantee, loosely
    assert max(loads) < max(as_collected)


def test_without_workers_the_longest_run_first_and_ties_keep_collection_order():
    names = ["a", "b", "c", "d"]
    assert spread_longest_first(names, [3.0, 9.0, 3.0, 5.0], 0) == ["b", "d", "a", "c"]


def test_the_table_names_tests_that_exist():
    """A renamed test would silently drop out of the table: every key names a test function in tests/."""
    import os
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    defined = set()
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                    defined.update(re.findall(r"^def (test_\w+)\(", fh.read(), re.M))
    missing = {k for k in GPU_TEST_SECONDS if k.split("[")[0] not in defined}
    assert not missing, missing
