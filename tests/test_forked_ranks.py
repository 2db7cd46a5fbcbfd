"""tests/forked_ranks.py's wait: a run's exit code is the first failing rank's, judged from one reading of
the exit codes per pass (processes stand in for ranks: their exit codes come from a list, one per read)."""
import os
import time

from tests.forked_ranks import wait_for


class _Proc:
    """A stand-in process: each read of `exitcode` returns the next listed value (the last one repeats)."""

    def __init__(self, codes):
        self._codes = list(codes)

    def join(self, timeout=None):
        pass

    @property
    def exitcode(self):
        return self._codes.pop(0) if len(self._codes) > 1 else self._codes[0]


def test_a_rank_that_exits_2_between_two_reads_is_reported_failed():
    # the loop before wait_for read the codes twice per pass: "still running?" (None), "failed?" (None: not
    # yet), then "still running?" again (2: no) and it returned exit 0 without a failure
    p = _Proc([None, None, 2])
    assert wait_for([p], time.monotonic() + 60, poll=0) == (p, False)


def test_success_failure_and_timeout():
    assert wait_for([_Proc([None, None, 0]), _Proc([0])], time.monotonic() + 60, poll=0) == (None, False)
    bad = _Proc([None, -9])
    assert wait_for([_Proc([None]), bad], time.monotonic() + 60, poll=0) == (bad, False)  # the other still runs
    assert wait_for([_Proc([None])], time.monotonic() - 1, poll=0) == (None, True)


def test_nothing_is_forked_on_a_cuda_machine(monkeypatch):
    """DESIGN.md trap 17: on a machine with CUDA, every trainer run and script starts a fresh interpreter
    (a fork of the preloaded server cannot use CUDA)."""
    import tests.conftest as C
    import tests.forked_ranks as F
    monkeypatch.setattr(F, "_CUDA", False)
    assert F.can_fork_with(None)
    monkeypatch.setattr(F, "_CUDA", True)
    assert not F.can_fork_with(None)
    monkeypatch.setattr(C, "can_fork_with", F.can_fork_with)
    assert not C._forked_ok(C.train_cmd(["--device=cuda"]), None)
    called = []
    monkeypatch.setattr(C, "run_script", lambda *a, **k: called.append(a))
    proc = C.run_python([C.PY, "-c", "print('fresh')"])  # -c never forks; a project script must not either
    assert proc.stdout.strip() == "fresh"
    proc = C.run_python([C.PY, "sample.py", "--help"])
    assert proc.returncode == 0 and not called


def _abort_once(rank: int, world: int, marker: str) -> None:
    """Rank 1 dies by SIGABRT the first time (no marker yet), then both ranks write their marker."""
    import os
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()
    open(f"{marker}.{rank}", "w").close()


def _abort_always(rank: int, world: int) -> None:
    import os
    if rank == 1:
        os.abort()


def test_spawn_runs_again_only_after_a_rank_was_killed_by_a_signal(tmp_path, capfd):
    """tests/dist_helpers.py spawn(retries_on_signal=1): a rank killed by a signal once is run again (and said so on
    stderr); one killed every time still fails; without the option the first death fails."""
    import pytest
    import torch.multiprocessing as mp
    from tests.dist_helpers import spawn
    marker = str(tmp_path / "m")
    spawn(_abort_once, 2, marker, retries_on_signal=1)
    assert all(os.path.exists(f"{marker}.{r}") for r in (0, 1))
    assert "_abort_once at world 2: process 1 terminated with signal SIGABRT; running it again" in capfd.readouterr().err
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn(_abort_always, 2, retries_on_signal=1)
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn(_abort_once, 2, str(tmp_path / "n"))
