"""How many CPU threads a process computes on.

Owns: `usable_cores` (the cores this process may run on: its affinity mask, not the machine's count),
`choose_threads` (--threads, else OMP_NUM_THREADS as torchrun sets it per rank, else the usable cores
shared among the node's local ranks), `plan_threads` (that choice, the tuner when nothing fixed it, the count to
start on and the warning: what the trainer and eval_lm.py both set), `ThreadTuner` (an automatic choice that measures: the chosen count
or one thread, whichever trains faster now), `describe_threads` (the words of the trainer's [layout] line)
and `oversubscription_warning` (the load average against the usable cores).
Must never: import torch (the trainer's pre-check path stays torch-free) or anything above utils/.

Why (measured by bench/bench_threads.py, docs/training.md "CPU threads"): PyTorch's OpenMP threads spin at the end
of every parallel region waiting for the others. When another process holds one of the cores, the thread
that waits spins on its own core while the thread it waits for is descheduled, so every op waits a
scheduler slice: on 2 shared cores 2 threads trained 2-10x slower than 1. On idle cores 2 threads are
~1.7x faster than 1. OMP_WAIT_POLICY=PASSIVE (waiting threads sleep) removes the collapse but costs ~20%
on idle cores (every parallel region wakes its threads): so the trainer keeps libgomp's spinning and,
when nothing fixed the count, measures both counts now and then (ThreadTuner) and trains on the faster.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"


def usable_cores() -> int:
    """The cores this process may run on (taskset, cgroup cpusets, a scheduler's allocation), >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS / Windows: no affinity API
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    source: str  # what chose it, in words: "--threads", "OMP_NUM_THREADS", "2 usable cores"


def choose_threads(requested: int = 0, env: Optional[Mapping[str, str]] = None,
                   cores: Optional[int] = None) -> ThreadChoice:
    """The number of compute threads: `requested` (--threads) when > 0; else OMP_NUM_THREADS when it is
    a positive integer (torchrun sets 1 per rank when it starts several); else the usable cores divided
    among the processes of this node (LOCAL_WORLD_SIZE), at least 1."""
    env = os.environ if env is None else env
    if requested > 0:
        return ThreadChoice(requested, "--threads")
    omp = str(env.get("OMP_NUM_THREADS", "")).strip()
    if omp.isdigit() and int(omp) > 0:
        return ThreadChoice(int(omp), "OMP_NUM_THREADS")
    cores = usable_cores() if cores is None else cores
    local = str(env.get("LOCAL_WORLD_SIZE", "")).strip()
    procs = int(local) if local.isdigit() and int(local) > 0 else 1
    if procs > 1:
        return ThreadChoice(max(1, cores // procs), f"{cores} usable cores / {procs} local ranks")
    return ThreadChoice(cores, f"{cores} usable core{'s' if cores != 1 else ''}")


def wait_policy(env: Optional[Mapping[str, str]] = None) -> str:
    """The OpenMP wait policy in words, as the [layout] line says it."""
    env = os.environ if env is None else env
    policy = env.get(WAIT_POLICY_ENV)
    return f"OMP_WAIT_POLICY={policy}" if policy else "OpenMP threads spin while waiting (libgomp's default)"


def describe_threads(choice: ThreadChoice, adaptive: bool = False, env: Optional[Mapping[str, str]] = None) -> str:
    """'threads 2 (2 usable cores, or 1 while that trains faster (measured); OpenMP threads spin while
    waiting (libgomp's default))': the words the [layout] line ends with."""
    source = choice.source + (", or 1 while that trains faster (measured)" if adaptive else "")
    return f"threads {choice.threads} ({source}; {wait_policy(env)})"


def oversubscription_warning(threads: int, cores: Optional[int] = None, load: Optional[float] = None,
                             env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A warning when the machine's 1-minute load average exceeds the usable cores by at least one, i.e.
    at least one more process wants a core than there are (this run's own threads count in the load:
    it alone keeps it near `threads`); None otherwise, or where there is no load average. The advice fits
    the run: fewer threads only where there are more than one; under torchrun, ranks x threads per node."""
    cores = usable_cores() if cores is None else cores
    env = os.environ if env is None else env
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return None
    if load < cores + 1:
        return None
    local = str(env.get("LOCAL_WORLD_SIZE", "")).strip()
    ranks = int(local) if local.isdigit() and int(local) > 1 else 1
    if ranks > 1:
        advice = (f"this node runs {ranks} ranks x {threads} thread{'s' if threads != 1 else ''}: fewer ranks "
                  "(--nproc_per_node) or other work moved off these cores helps")
    elif threads > 1:
        advice = "fewer threads may help: --threads=1"
    else:
        advice = "this run is already on 1 thread: only the other processes leaving helps"
    return (f"the 1-minute load average is {load:.1f} on {cores} usable core{'s' if cores != 1 else ''}: other "
            f"processes compete for them, so this run is slower than its {threads} thread{'s' if threads != 1 else ''} "
            f"can be ({advice}; see docs/training.md \"CPU threads\")")


@dataclass
class ThreadPlan:
    choice: ThreadChoice
    start: int                         # the count to set now
    tuner: Optional["ThreadTuner"]     # None when the count is fixed
    warning: Optional[str]             # the oversubscription warning, with what the plan does about it


def plan_threads(requested: int = 0, cpu: bool = True, fixed: bool = False,
                 env: Optional[Mapping[str, str]] = None, load: Optional[float] = None,
                 cores: Optional[int] = None, **tuner_kw) -> ThreadPlan:
    """The thread count to start on and whether to keep measuring: the `choose_threads` count, fixed when
    --threads or OMP_NUM_THREADS chose it (or `fixed`: --deterministic); otherwise, on the CPU and with more
    than one thread, a ThreadTuner that starts on one thread when the machine is already oversubscribed
    (spinning threads collapse there) and measures the other count later. `tuner_kw` go to the tuner."""
    choice = choose_threads(requested, env, cores)
    fixed = fixed or choice.source in ("--threads", "OMP_NUM_THREADS")
    busy = oversubscription_warning(choice.threads, cores, load, env)
    if fixed or choice.threads <= 1 or not cpu:
        return ThreadPlan(choice, choice.threads, None, busy)
    tuner = ThreadTuner(choice.threads, start=1 if busy else None, **tuner_kw)
    if busy:
        busy += "; starting on 1 thread, the automatic choice measures more later"
    return ThreadPlan(choice, tuner.current, tuner, busy)


class ThreadTuner:
    """Chooses between `threads` and 1 thread by measuring them, for as long as the run lasts.

    The loop calls `threads_for_next_step()` before each step (set the count it returns when it differs)
    and `record(seconds, tokens)` after it. The first `skip` steps (compilation, first allocations) are not
    judged. Then, and again later, the tuner tries the other count for `probe_steps` steps (the first after a
    switch is not judged: the pool wakes up) and keeps whichever gave more tokens/s, comparing the probe
    with the current count's recent steps. The next trial comes once the time spent trying amounts to at
    most `budget` of the time since (at least `min_interval_s` later): a probe of a slow count is rare.
    `changes` records (step, old, new, tokens/s old, tokens/s new) of every switch kept, for the log.
    The count changes the order of floating-point sums in some ops: a run on an automatic count is not
    bit-reproducible (a fixed --threads or OMP_NUM_THREADS is)."""

    def __init__(self, threads: int, skip: int = 2, probe_steps: int = 3, budget: float = 0.03,
                 min_interval_s: float = 20.0, recent: int = 5, clock=None, start: Optional[int] = None) -> None:
        import time
        self.choices = (threads, 1)
        self.current = threads if start is None else start  # `start`: 1 on a machine already busy
        self.skip, self.probe_steps, self.budget = skip, probe_steps, budget
        self.min_interval_s, self.recent = min_interval_s, recent
        self.clock = clock or time.monotonic
        self.rates: list[float] = []      # tokens/s of the current count's recent steps
        self.probe: list[float] = []      # tokens/s of the count on trial
        self.trying: Optional[int] = None
        self.steps = 0
        self.next_trial_at: Optional[float] = None  # None: as soon as the skip is over
        self.trial_started = 0.0
        self.changes: list[tuple[int, int, int, float, float]] = []

    def threads_for_next_step(self) -> int:
        if self.trying is None and self.steps >= self.skip and len(self.rates) >= 2 and \
                (self.next_trial_at is None or self.clock() >= self.next_trial_at):
            self.trying = next(c for c in self.choices if c != self.current)
            self.probe, self.trial_started = [], self.clock()
        return self.trying if self.trying is not None else self.current

    def record(self, seconds: float, tokens: float) -> None:
        self.steps += 1
        if self.steps <= self.skip:
            return
        rate = tokens / max(seconds, 1e-9)
        if self.trying is None:
            self.rates = (self.rates + [rate])[-self.recent:]
            return
        self.probe.append(rate)
        if len(self.probe) < self.probe_steps:
            return
        import statistics
        now, tried = statistics.median(self.rates), statistics.median(self.probe[1:])
        spent = self.clock() - self.trial_started
        if tried > now:
            self.changes.append((self.steps, self.current, self.trying, now, tried))
            self.current, self.rates = self.trying, self.probe[1:]
        self.trying = None
        self.next_trial_at = self.clock() + max(self.min_interval_s, spent / self.budget)
