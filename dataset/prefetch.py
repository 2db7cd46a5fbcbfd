"""`PrefetchLoader`: the next batches of a loader drawn on a background thread while the step runs.

Why: the trainer drew each step's batches (reading the samples, collating, pinning for the copy to the
GPU) on the training thread right after the optimizer step, so the device finished the step's update
and then waited for that host work before the next forward's first kernel (issue "GPU speed, third
pass", item 3). Here one thread keeps up to `depth` batches ready, collated and, for an accelerator,
in pinned memory (utils.device.to_device then copies them without staging).

Exact: the batches are those of the wrapped loader, in its order, and `state_dict()` is the wrapped
loader's cursor after the last batch handed OUT (not the ones drawn ahead), so a checkpoint resumes
at the same sample whether or not batches were drawn ahead. `load_state_dict` drops the batches drawn
ahead and repositions the wrapped loader. An error drawing a batch (a corrupt sample: DataError with
its file and line) is raised by the `next()` that would have returned that batch, not earlier.

Owns: the thread and its queue only. Must never: hand out a batch twice or skip one, report a cursor
past the batches handed out, or touch the wrapped loader from two threads at once (it has one reader:
the thread while it runs, the caller when it is stopped).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Optional

import torch

from utils.device import set_device

_POLL_S = 0.05  # how often a blocked thread looks for a stop request


def pin_batch(batch: Any) -> Any:
    """The batch with its CPU tensors in pinned (page-locked) memory; other values as they are."""
    if isinstance(batch, dict):
        return {k: pin_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(pin_batch(v) for v in batch)
    if torch.is_tensor(batch) and batch.device.type == "cpu" and not batch.is_pinned():
        return batch.pin_memory()
    return batch


class PrefetchLoader:
    """Iterates like `loader` (any attribute not defined here is the wrapped loader's), drawing up to
    `depth` batches ahead on one daemon thread; pin=True also pins them (only for an accelerator:
    pinning needs one). `device`: the process's accelerator, made the thread's current device before it
    pins anything (a new thread's current device is 0: pinning there would create a CUDA context on GPU 0
    in every rank's process, hundreds of MB each; torch's DataLoader pin thread does the same)."""

    def __init__(self, loader, depth: int = 2, pin: bool = False, device: Optional[torch.device] = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.loader, self.depth, self.pin = loader, int(depth), bool(pin)
        self.device = torch.device(device) if device is not None else None
        self._queue: Optional[queue.Queue] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._cursor: Optional[dict] = None  # the wrapped loader's state after the last batch handed out

    def __getattr__(self, name: str) -> Any:  # num_samples, samples_per_step, ...: the wrapped loader's
        if name == "loader":  # not set yet (during unpickling / a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> "PrefetchLoader":
        return self

    def __len__(self) -> int:
        return len(self.loader)

    # ------------------------------------------------------------------ the thread
    def _start(self) -> None:
        self._cursor = self.loader.state_dict()  # nothing handed out yet from here on
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(target=self._run, args=(self._queue,), name="batch-prefetch", daemon=True)
        self._thread.start()

    def _put(self, q: queue.Queue, item: tuple) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, q: queue.Queue) -> None:
        if self.pin and self.device is not None:
            set_device(self.device)  # the thread's current device: the rank's own, not GPU 0
        while not self._stop.is_set():
            try:
                batch = next(self.loader)
                cursor = self.loader.state_dict()
                if self.pin:
                    batch = pin_batch(batch)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised by its next()
                self._put(q, ("error", e, None))
                return
            if not self._put(q, ("batch", batch, cursor)):
                return

    def _halt(self) -> None:
        """Stop the thread and drop what it drew ahead; the wrapped loader is then where the thread left
        it (ahead of the cursor): the caller repositions it."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread, self._queue = None, None

    # ------------------------------------------------------------------ the loader's API
    def __next__(self) -> Any:
        if self._thread is None:
            self._start()
        kind, value, cursor = self._queue.get()
        if kind == "error":
            self._halt()
            self.loader.load_state_dict(self._cursor)  # the failed batch is next again
            raise value
        self._cursor = cursor
        return value

    def state_dict(self) -> dict:
        """The cursor after the last batch handed out (batches drawn ahead are not counted)."""
        return dict(self._cursor) if self._thread is not None else self.loader.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.close()
        self.loader.load_state_dict(sd)

    def close(self) -> None:
        """Stop drawing ahead; the wrapped loader is left at the cursor (usable directly again)."""
        if self._thread is not None:
            cursor = self._cursor
            self._halt()
            self.loader.load_state_dict(cursor)
