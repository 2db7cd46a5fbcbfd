"""`ResumableLoader`: deterministic, resumable, rank-disjoint batching.

Owns: which samples each rank reads at each step. That is a pure function of
(seed, epoch, position in the epoch, rank, world_size): epoch e uses a permutation P_e of [0, N)
derived from (seed, e); the c-th call of the epoch covers P_e[c*B*W : (c+1)*B*W] and rank r takes
the r-th slice of B. Ranks therefore never share a sample within an epoch and together cover it.

An optimizer step reads G = B * W * A samples (A micro-batches per step, `samples_per_step`):
the window P_e[s*G : (s+1)*G] for step s of the epoch, whatever (B, W, A) make up G. The cursor
counts samples (`sample_in_epoch`), so a checkpoint saved at 2 ranks x batch 4 x accumulation 2
resumes at 1 rank x batch 4 x accumulation 4 (same G = 16) and reads the same samples in each
optimizer step; only which rank and micro-batch reads which of them changes.

The permutation is a keyed Feistel network with cycle-walking (`FeistelPermutation`): O(1)
memory and O(B) work per batch whatever N is, so the loader is flat in memory for any corpus
and resuming is O(1) -- `load_state_dict` just sets (epoch, sample_in_epoch).

drop_last=True (default): an epoch is N // G optimizer steps; the < G left-over positions of
each epoch's permutation are not read that epoch (they differ from epoch to epoch).
drop_last=False: ceil(N / G) steps; the last one wraps around to the start of the epoch's
permutation, so those few samples are read twice in that epoch.

Must never: take rank/world from mutable flags or the environment (known trap 1; they are
constructor arguments), or depend on iteration history (no hidden RNG state).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wrapping arithmetic is intended)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A bijection of [0, n) keyed by `key`: balanced Feistel on 2*h bits + cycle-walking.

    The domain is padded to 4**h >= n (< 4n), so cycle-walking takes < 4 rounds on average."""

    ROUNDS = 6

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError("n must be >= 1")
        self.n = int(n)
        h = 1
        while (1 << (2 * h)) < self.n:
            h += 1
        self.half_bits = h
        self.mask = np.uint64((1 << h) - 1)
        base = mix64(np.array([key & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0]
        self.round_keys = mix64(np.arange(1, self.ROUNDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ base)
        self._int_keys = [int(k) for k in self.round_keys]

    def _once(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half_bits)
        left, right = x >> h, x & self.mask
        for k in self.round_keys:
            with np.errstate(over="ignore"):
                f = mix64(right ^ k) & self.mask
            left, right = right, left ^ f
        return (left << h) | right

    def _once_int(self, x: int) -> int:
        # Same function as _once on Python ints: for a batch of a few indices, numpy's per-call
        # overhead (x ~60 ops per round trip, x cycle-walks) costs more than the arithmetic.
        h, m = self.half_bits, (1 << self.half_bits) - 1
        left, right = x >> h, x & m
        for k in self._int_keys:
            z = right ^ k
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
            left, right = right, left ^ ((z ^ (z >> 31)) & m)
        return (left << h) | right

    def __call__(self, idx: np.ndarray | int) -> np.ndarray:
        x = np.atleast_1d(np.asarray(idx, dtype=np.int64))
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise IndexError("permutation index out of range")
        if x.size <= 64:
            out = []
            for v in x.tolist():
                v = self._once_int(v)
                while v >= self.n:
                    v = self._once_int(v)
                out.append(v)
            return np.asarray(out, dtype=np.int64)
        y = self._once(x.astype(np.uint64))
        todo = y >= np.uint64(self.n)
        while todo.any():  # cycle-walk: stays a bijection on [0, n)
            y[todo] = self._once(y[todo])
            todo = y >= np.uint64(self.n)
        return y.astype(np.int64)


def default_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


CURSOR_FORMAT = 2  # 1: {epoch, step_in_epoch} counted in calls of B*W samples; 2: counted in samples


class ResumableLoader:
    """Infinite iterator over batches for one rank; see the module docstring for the order."""

    def __init__(self, dataset: Any, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 collate_fn: Optional[Callable[[list], Any]] = None, shuffle: bool = True,
                 drop_last: bool = True, samples_per_step: Optional[int] = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.dataset, self.batch_size, self.seed = dataset, int(batch_size), int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.collate_fn = collate_fn or default_collate
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.num_samples = len(dataset)
        self.call_samples = self.batch_size * self.world_size  # samples one call reads over all ranks
        self.samples_per_step = int(samples_per_step or self.call_samples)
        if self.samples_per_step % self.call_samples:
            raise ValueError(f"samples_per_step {self.samples_per_step} is not a multiple of batch_size {batch_size} "
                             f"x world_size {world_size}")
        g = self.samples_per_step
        opt_steps = self.num_samples // g if drop_last else -(-self.num_samples // g)
        if opt_steps == 0:
            raise ValueError(f"dataset of {self.num_samples} samples has no full global batch of {g} samples "
                             f"(batch_size {batch_size} x world_size {world_size} x accumulation "
                             f"{g // self.call_samples}); use drop_last=False")
        self.steps_per_epoch = opt_steps * (g // self.call_samples)  # calls (micro-batches) per epoch
        self.epoch = 0
        self.step_in_epoch = 0
        self._perm: Optional[FeistelPermutation] = None
        self._perm_epoch = -1

    def _permutation(self, epoch: int) -> Optional[FeistelPermutation]:
        if not self.shuffle:
            return None
        if self._perm_epoch != epoch:
            key = int(mix64(np.array([self.seed * 1_000_003 + epoch], dtype=np.uint64))[0])
            self._perm, self._perm_epoch = FeistelPermutation(self.num_samples, key), epoch
        return self._perm

    def batch_indices(self, epoch: int, step: int) -> np.ndarray:
        """Dataset indices this rank reads at (epoch, call `step` of the epoch): a pure function of
        its arguments and (seed, rank, world_size, batch_size, N)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside epoch of {self.steps_per_epoch} steps")
        first = (step * self.world_size + self.rank) * self.batch_size
        pos = np.arange(first, first + self.batch_size, dtype=np.int64) % self.num_samples
        perm = self._permutation(epoch)
        return pos if perm is None else perm(pos)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> Any:
        idx = self.batch_indices(self.epoch, self.step_in_epoch)
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return self.collate_fn([self.dataset[int(i)] for i in idx])

    def __len__(self) -> int:
        return self.steps_per_epoch

    def state_dict(self) -> dict[str, int]:
        """The cursor (next sample position of the epoch) plus what it is only valid for.
        `step_in_epoch` is informative (this layout's call count); loading reads `sample_in_epoch`."""
        return {"format": CURSOR_FORMAT, "epoch": self.epoch, "sample_in_epoch": self.step_in_epoch * self.call_samples,
                "step_in_epoch": self.step_in_epoch, "seed": self.seed, "num_samples": self.num_samples,
                "global_batch_size": self.samples_per_step, "shuffle": int(self.shuffle),
                "drop_last": int(self.drop_last)}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """O(1) reposition. Refuses a cursor from another dataset size, seed or global batch (samples
        per optimizer step), where the same position would mean other samples; accepts any split of
        that global batch into ranks, micro-batch size and accumulation steps."""
        if "sample_in_epoch" in sd:
            gb_key, gb = "global_batch_size", self.samples_per_step
            sample = int(sd["sample_in_epoch"])
        else:  # format 1 (older checkpoints): calls of B*W samples, the same B*W required
            gb_key, gb = "global_batch_size", self.call_samples
            sample = int(sd["step_in_epoch"]) * self.call_samples
        for key, mine in (("seed", self.seed), ("num_samples", self.num_samples), (gb_key, gb),
                          ("shuffle", int(self.shuffle)), ("drop_last", int(self.drop_last))):
            if key in sd and int(sd[key]) != mine:
                raise ValueError(f"loader state has {key}={sd[key]} but this loader has {mine}")
        epoch = int(sd["epoch"])
        if sample % self.call_samples:
            raise ValueError(f"loader state is at sample {sample} of its epoch, not a multiple of this loader's "
                             f"{self.call_samples} samples per call (batch_size x world_size)")
        step = sample // self.call_samples
        if "sample_in_epoch" not in sd and step >= self.steps_per_epoch:
            epoch, step = epoch + 1, 0  # a format-1 epoch (dropping < B*W) outlasts one dropping < G: it ended
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"loader state (epoch {epoch}, sample {sample}) outside the {self.steps_per_epoch} "
                             f"calls of {self.call_samples} samples per epoch")
        self.epoch, self.step_in_epoch = epoch, step
