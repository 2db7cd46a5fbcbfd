"""tests/forked_ranks.py's wait: a run's exit code is the first failing rank's, judged from one reading of
the exit codes per pass (processes stand in for ranks: their exit codes come from a list, one per read)."""
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
