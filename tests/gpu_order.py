"""The order the GPU tests run in (`pytest -m gpu`, the GPU report's tests stage): the longest first, spread so
that every xdist worker starts with one of them.

On 2026-11-27 the report's tests stage (6 workers, 110 s) ran out of time with 42 of 44 tests passed: the two
left were trainer runs of ~30-60 s that collection order had put near the end, so they started when the other
workers had nothing left to do. xdist's worksteal scheduler (>= 3.2) hands each worker one contiguous chunk of
the collection at the start (then idle workers steal from the end of the longest queue); `spread_longest_first`
lays the collection out so that each chunk is one worker's share of a longest-first assignment.
"""
from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")

# Seconds per test on an H100/H200 (call + setup, the largest seen in the "slowest tests" tables of
# `make gpu-report` reports on both GPUs). Keyed by test name with its parameters,
# or by the bare function name for every parametrization. A test not named here counts as DEFAULT_SECONDS.
GPU_TEST_SECONDS = {
    "test_trainer_on_cuda[extra2]": 60.0,  # --compile=true
    "test_trainer_zero_on_nccl_world_1": 33.0,
    "test_on_cuda_the_cuda_graph_steps_equal_the_plain_compiled_ones": 30.0,
    "test_whole_model_compiles_with_zero_graph_breaks": 30.0,
    "test_trainer_on_cuda[extra0]": 29.0,
    "test_trainer_on_cuda[extra3]": 26.0,
    "test_engine_wrapped_model_and_loss_compile_with_zero_breaks_from_a_cold_process": 22.0,
    "test_trainer_on_cuda[extra1]": 16.0,
    "test_gpu_opcheck_every_op": 15.0,
    "test_gpu_torch_compile_fullgraph_matches_eager": 10.0,
    # not yet run on a GPU (estimated: two small engines, 25 steps each, the AdamW kernel compiled twice)
    "test_on_cuda_the_trainers_engine_keeps_bf16_moments_in_its_kernel": 10.0,
    "test_on_cuda_the_bench_times_each_step_by_events_with_one_sync_at_the_end": 10.0,  # (a tiny eager row)
}
DEFAULT_SECONDS = 3.0


def expected_seconds(name: str, function_name: str) -> float:
    """The table's seconds for a test (`name` with its parameters, `function_name` without)."""
    return GPU_TEST_SECONDS.get(name, GPU_TEST_SECONDS.get(function_name, DEFAULT_SECONDS))


def worksteal_chunks(n: int, workers: int) -> list[int]:
    """How many of n collected tests xdist's worksteal scheduler first gives each of `workers` workers: the
    pending tests split evenly in collection order (scheduler/worksteal.py check_schedule)."""
    sizes, left = [], n
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def spread_longest_first(items: Sequence[T], seconds: Sequence[float], workers: int) -> list[T]:
    """`items` reordered: a longest-first assignment to `workers` workers of the chunk sizes worksteal gives
    them (each test to the least-loaded worker with room), each worker's share longest first, the shares
    laid out one after another. Ties keep collection order (fixtures stay together)."""
    longest_first = sorted(range(len(items)), key=lambda i: (-seconds[i], i))
    if workers < 2:
        return [items[i] for i in longest_first]
    sizes = worksteal_chunks(len(items), workers)
    shares: list[list[int]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for i in longest_first:
        w = min((w for w in range(workers) if len(shares[w]) < sizes[w]), key=lambda w: (loads[w], w))
        shares[w].append(i)
        loads[w] += seconds[i]
    return [items[i] for share in shares for i in share]
