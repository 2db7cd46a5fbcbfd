"""Asynchronous checkpoints (--async_checkpoint=true): the step that saves copies the state to host memory and
returns; one background thread writes the checkpoint with the synchronous protocol's files, fsync, manifest,
verification, publish and pruning.

    writer = AsyncCheckpointer(log, rank=r, world_size=n, device=device)
    manager.save(step, ...)           # (CheckpointManager(..., async_writes=True)) waits for the previous save,
                                      # snapshots (collectives here), submits
    ...
    writer.wait()                     # before the next snapshot, at the end of the run, on SIGTERM

Pieces:
  HostBuffers       the host copies of every tensor a checkpoint holds, one buffer per position in the state
                    (pinned when the tensor lives on an accelerator), reused by the next save when its shape and
                    dtype match: the host memory of N saves is one checkpoint's, not N (`allocations` counts).
  AsyncCheckpointer at most one write in flight; `submit(what, write)` starts it on a thread, `wait()` joins it.
                    A write that fails is logged at once (naming the file) and raised again by the next wait()
                    on the training thread, where every rank's verdict is exchanged (one collective) so that
                    all ranks end alike: DiskFullError (exit 7) when a rank's disk was full, else
                    AsyncCheckpointError (exit 1, a crash: the supervisor resumes from the previous checkpoint).
  rank markers      how ranks agree that a checkpoint may be published without a collective from a background
                    thread: each rank's writer, once its files are written and fsynced, writes
                    `step_N.tmp/.rank{r}.written` (or `.rank{r}.failed` with the reason); rank 0's writer waits
                    for every rank's marker (polling, with a timeout), removes them, then writes the manifest and
                    COMPLETE and renames the directory into place, as the synchronous save does after its barrier.

Crash guarantees are the synchronous protocol's: until rank 0's rename, the checkpoint is a `step_N.tmp`
directory that loading ignores, so a crash or SIGKILL at any instant of a background write leaves the previous
checkpoint the latest valid one.

Owns: the snapshot buffers, the writer thread, the rank markers. Must never: issue a collective from the
background thread (snapshots and gathers happen on the training thread), or let two writes overlap.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Optional

import torch

from checkpoint.protocol import agreement, prepare_step_dir, save_guard, step_dir_paths
from checkpoint.verify import prune_checkpoints, remember_verified
from utils.checkpoint_layout import checkpoint_root
from utils.constants import EXIT_DISK_FULL
from utils.device import is_accelerator, synchronize
from utils.disk_space import DiskFullError
from utils.errors import exit_code_for, one_line
from utils.publish import atomic_write_text

RANK_MARKER_TIMEOUT_S = 3600.0  # how long rank 0's writer waits for the other ranks' files (a slow disk, not a hang)
_WRITTEN, _FAILED = ".rank{}.written", ".rank{}.failed"


class AsyncCheckpointError(RuntimeError):
    """A background checkpoint write failed (on this rank or another): no exit code of its own, so the run ends
    as a crash (exit 1) and the supervisor resumes it from the previous checkpoint."""


# ---------------------------------------------------------------------------- host buffers

class HostBuffers:
    """Reusable host copies of the tensors of a (nested dict / list / tuple) state."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.allocations = 0  # host buffers created so far (a steady state stops growing after the first save)

    def snapshot(self, obj: Any, key: tuple = ()) -> Any:
        """`obj` with every tensor replaced by a host copy (contiguous, its own storage); containers rebuilt,
        other leaves kept (they are immutable: numbers, strings, None). `key` names this state among the
        others of one save (its buffers are `key + path`). Call `ready()` before handing the copies over."""
        if torch.is_tensor(obj):
            return self._copy(key, obj)
        if isinstance(obj, dict):
            return {k: self.snapshot(v, key + (k,)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            out = [self.snapshot(v, key + (i,)) for i, v in enumerate(obj)]
            return out if isinstance(obj, list) else tuple(out)
        return obj

    def _copy(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if hasattr(t, "to_local"):  # a DTensor: this rank's shard
            t = t.to_local()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            pin = is_accelerator(t.device)  # page-locked: the device-to-host copy runs asynchronously
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self._buffers[key] = buf
            self.allocations += 1
        buf.copy_(t, non_blocking=buf.is_pinned())
        return buf

    def ready(self, device: Optional[torch.device] = None) -> None:
        """Wait for the device-to-host copies (non-blocking into pinned buffers) to land."""
        if device is not None and is_accelerator(device):
            synchronize(device)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def tensors(self) -> list[torch.Tensor]:
        return list(self._buffers.values())

    def release(self) -> None:
        self._buffers.clear()


# ---------------------------------------------------------------------------- rank markers

def mark_rank_written(tmp: str, rank: int) -> None:
    atomic_write_text(os.path.join(tmp, _WRITTEN.format(rank)), "ok\n")


def mark_rank_failed(tmp: str, rank: int, why: str) -> None:
    try:
        atomic_write_text(os.path.join(tmp, _FAILED.format(rank)), why + "\n")
    except OSError:
        pass  # the directory may be gone (a full disk removed it): rank 0 sees that instead


def wait_for_ranks(tmp: str, world_size: int, timeout: float = RANK_MARKER_TIMEOUT_S, poll: float = 0.02) -> None:
    """Rank 0's writer: return once every other rank marked its files written (then remove the markers, which
    are not part of the checkpoint); AsyncCheckpointError when a rank failed, the directory vanished, or time
    ran out."""
    deadline = time.monotonic() + timeout
    pending = set(range(1, world_size))
    while pending:
        for r in sorted(pending):
            failed = os.path.join(tmp, _FAILED.format(r))
            if os.path.exists(failed):
                with open(failed, encoding="utf-8", errors="replace") as f:
                    raise AsyncCheckpointError(f"rank {r} could not write its part of {tmp}: {f.read().strip()}")
            if os.path.exists(os.path.join(tmp, _WRITTEN.format(r))):
                pending.discard(r)
        if not pending:
            break
        if not os.path.isdir(tmp):
            raise AsyncCheckpointError(f"{tmp} was removed before ranks {sorted(pending)} finished writing")
        if time.monotonic() > deadline:
            raise AsyncCheckpointError(f"ranks {sorted(pending)} did not finish writing their files into {tmp} "
                                       f"within {timeout:.0f} s: not published")
        time.sleep(poll)
    for r in range(1, world_size):
        os.remove(os.path.join(tmp, _WRITTEN.format(r)))


# ---------------------------------------------------------------------------- the writer

class AsyncCheckpointer:
    """One background checkpoint write at a time, and the host buffers its snapshots reuse."""

    def __init__(self, log: Callable[[str], None] = print, rank: int = 0, world_size: int = 1,
                 device: Optional[torch.device] = None) -> None:
        self.log, self.rank, self.world_size, self.device = log, rank, world_size, device
        self.buffers = HostBuffers()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._what = ""
        self.last_written: Optional[str] = None  # what the last write finished (the published path on rank 0)
        self.last_write_s = 0.0  # how long the last background write took
        self.last_wait_s = 0.0   # how long the last wait() blocked the training thread

    def snapshot(self, tensors: dict[str, Any], *jsons: Any) -> tuple:
        """On the training thread: each state of `tensors` copied into this writer's reused host buffers (named
        by its key), then each JSON-able object in `jsons` deep-copied, then the device-to-host copies waited
        for. Returns the copies in that order (the states', then the JSON objects')."""
        states = [self.buffers.snapshot(x, (name,)) for name, x in tensors.items()]
        copies = [json_copy(j) for j in jsons]
        self.buffers.ready(self.device)
        return (*states, *copies)

    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, what: str, write: Callable[[], Optional[str]]) -> None:
        """Run `write()` on the background thread (the previous write must have been waited for)."""
        if self._thread is not None:
            raise RuntimeError("AsyncCheckpointer.submit: a write is still in flight (wait() first)")
        self._what = what

        def run() -> None:
            t0 = time.perf_counter()
            try:
                self.last_written = write() or what
            except BaseException as e:  # noqa: BLE001 - kept, logged now, raised again by wait()
                self._error = e
                line = f"[checkpoint] error: the background write of {what} failed: {type(e).__name__}: {one_line(e)}"
                self.log(line)
                if self.rank != 0:  # the trainer's log prints on rank 0 only
                    print(f"[rank {self.rank}] {line}", file=sys.stderr, flush=True)
            finally:
                self.last_write_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self, agree: bool = True, raise_errors: bool = True) -> None:
        """Join the write in flight (if any). agree (every rank calls wait() at the same point, on the training
        thread): one collective of every rank's verdict, so a failure on any rank ends every rank alike.
        raise_errors=False (a run already failing for another reason): log only."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.last_wait_s = time.perf_counter() - t0
        err, self._error = self._error, None
        verdict = None
        if err is not None:
            named = exit_code_for(err)
            verdict = (named[0] if named else 1, f"{self._what}: {type(err).__name__}: {one_line(err)}")
        if agree and self.world_size > 1:
            from utils.dist import first_error_of_ranks  # looked up at the call (the tests stand in for it)
            verdict = first_error_of_ranks(verdict, self.device)
        if verdict is None or not raise_errors:
            return
        if err is not None:
            raise err
        if verdict[0] == EXIT_DISK_FULL:  # another rank's disk was full
            raise DiskFullError(f"another rank's checkpoint write did not fit: {verdict[1]}")
        raise AsyncCheckpointError(f"another rank's background checkpoint write failed: {verdict[1]}")

    def close(self) -> None:
        """Wait (quietly: errors were logged) and free the host buffers."""
        self.wait(agree=False, raise_errors=False)
        self.buffers.release()


# ---------------------------------------------------------------------------- the protocol, in the background

def save_in_background(out_dir: str, step: int, rank: int, world_size: int, writer: AsyncCheckpointer,
                       write_files: Callable[[str, Any], None], publish: Callable[[str, str, Any], None],
                       barrier: Optional[Callable[[], None]] = None, keep_last: int = 3, keep_best: bool = True,
                       log: Callable[[str], None] = print) -> str:
    """The synchronous save's protocol with its writing on the writer thread; every rank calls it on the training
    thread once the state is snapshotted (what `write_files` and `publish` read never changes afterwards).
    Here: rank 0 checks the space and creates step_N.tmp, one verdict of every rank. On the writer thread:
    `write_files(tmp, guard)` (this rank's files, fsynced; guard.file names the file being written), then this
    rank's marker (ranks > 0), or (rank 0) every rank's marker awaited, `publish(tmp, final, guard)` (sidecars,
    manifest, COMPLETE, rename), verification remembered, pruning. Returns where the checkpoint will appear."""
    root = checkpoint_root(out_dir)
    final, tmp = step_dir_paths(root, step)
    # step_N.tmp exists for every rank's writer, or a full disk there is exit 7 at every rank (one verdict of
    # every rank in place of a barrier: checkpoint/protocol.agreed_phase)
    with save_guard(root, step) as guard:
        prepare_step_dir(guard, rank, agreement(barrier is not None))

    def write() -> Optional[str]:
        t0 = time.perf_counter()
        with save_guard(root, step) as guard:
            try:
                write_files(tmp, guard)
            except BaseException as e:
                if rank != 0:
                    mark_rank_failed(tmp, rank, f"{guard.file}: {type(e).__name__}: {one_line(e)}")
                if isinstance(e, (DiskFullError, AsyncCheckpointError)) or not isinstance(e, Exception):
                    raise
                raise AsyncCheckpointError(f"writing {guard.file}: {type(e).__name__}: {one_line(e)}") from e
            if rank != 0:
                mark_rank_written(tmp, rank)
                return None
            wait_for_ranks(tmp, world_size)
            publish(tmp, final, guard)
        remember_verified(final)
        prune_checkpoints(out_dir, keep_last=keep_last, keep_best=keep_best, log=log)
        log(f"[checkpoint] step {step} published -> {final} (written in the background in "
            f"{time.perf_counter() - t0:.2f} s)")
        return final
    writer.submit(f"checkpoint step {step} ({final})", write)
    return final


def json_copy(obj: Any) -> Any:
    """A deep copy of a JSON-shaped value (the trainer state, the run configuration) that the training thread
    may go on changing while the writer serialises the copy."""
    import copy
    return copy.deepcopy(obj)
