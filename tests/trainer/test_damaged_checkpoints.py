"""Every damaged checkpoint, in every reader: the trainer (`--init_from=resume`, `--init_from=<checkpoint>`),
`sample.py` and `export_hf.py` either skip it with a log line (resume falls back to the older checkpoint
and exits 0) or refuse it with exit 5 and ONE line on stderr naming the damaged file; never a traceback,
never exit 1 or 2 (docs/errors.md, "Damaged checkpoints", lists the same cases).

One tiny real run per engine kind (ddp: model.safetensors + optimizer_rank0.pt; fsdp at one process:
DCP's .metadata + __0_0.distcp) is made once for the module, with checkpoints at steps 1 and 2. Each
case copies it, damages step 2, and, where the case says so, recomputes manifest.json + COMPLETE
(checkpoint/protocol.py publish_checkpoint_dir), as a file damaged before hashing or a deliberate tamper
would leave it: then the sha256 check passes and the reader itself must catch the damage.

The readers run in this process through their `main(argv)` (the return value is the exit code; an
uncaught exception fails the test as a traceback would). `test_real_processes_print_one_line` runs
two of the cases as real processes to prove no traceback reaches stderr.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import export_hf
import sample
import train_my_ddp as T
from tests.conftest import ROOT, child_env, run_python
from checkpoint.protocol import publish_checkpoint_dir
from checkpoint.verify import list_checkpoints, verify_checkpoint
from utils.constants import EXIT_BAD_CHECKPOINT, EXIT_BAD_CONFIG, EXIT_OK

STEP = "step_00000002"  # the newest checkpoint of each run: the one damaged
OLDER = "step_00000001"


_env = child_env  # tests/conftest.py: one thread per process, unbuffered output


@pytest.fixture(scope="module")
def runs(tiny_pretrain_run_args, tmp_path_factory) -> dict:
    """{"ddp": run dir, "fsdp": run dir, "args": the run's flags}: 2 steps, a checkpoint after each."""
    base = tmp_path_factory.mktemp("damaged")
    out = {"args": tiny_pretrain_run_args}
    for kind in ("ddp", "fsdp"):
        run = base / kind
        code = T.main([*tiny_pretrain_run_args, f"--out_dir={run}", "--max_iters=2", "--checkpoint_interval=1",
                       f"--parallel={kind}"])
        assert code == EXIT_OK
        assert [os.path.basename(p) for _, p in list_checkpoints(str(run))] == [STEP, OLDER]
        out[kind] = run
    return out


# ---------------------------------------------------------------------------- damage

def republish(step_dir) -> None:
    """Recompute manifest.json + COMPLETE (and dcp_manifest.json's file list, when it parses) of a
    damaged checkpoint, so that the sha256 check passes."""
    step_dir = str(step_dir)
    for name in ("manifest.json", "COMPLETE"):
        if os.path.exists(os.path.join(step_dir, name)):
            os.remove(os.path.join(step_dir, name))
    dm_path = os.path.join(step_dir, "dcp_manifest.json")
    try:
        dm = json.load(open(dm_path))
    except (OSError, ValueError):
        dm = None
    if isinstance(dm, dict):
        dm["files"] = {n: os.path.getsize(os.path.join(step_dir, n)) for n in sorted(os.listdir(step_dir))
                       if n != "dcp_manifest.json"}
        json.dump(dm, open(dm_path, "w"))
    tmp = step_dir + ".re"
    os.replace(step_dir, tmp)
    publish_checkpoint_dir(tmp, step_dir, 2)


def _edit_json(path, **changes) -> None:
    data = json.load(open(path))
    data.update(changes)
    json.dump(data, open(path, "w"))


def _random_bytes(path) -> None:
    with open(path, "r+b") as f:  # same length: only reading the file can tell
        f.write(random.Random(0).randbytes(os.path.getsize(path)))


def _truncate(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _rewrite_metadata(d, edit) -> None:
    """Unpickle the test's own (trusted) DCP .metadata, change it, pickle it back."""
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)
    edit(md)
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)


def _metadata_outside(d) -> None:
    """Every storage item points at ../outside.distcp, a copy of the real shard placed just outside the
    checkpoint: a loader that followed the path would load it without complaint."""
    shutil.copy(d / "__0_0.distcp", d.parent / "outside.distcp")
    def edit(md):
        for info in md.storage_data.values():
            info.relative_path = "../outside.distcp"
    _rewrite_metadata(d, edit)


def _metadata_bytes_item(d) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    def edit(md):
        md.state_dict_metadata["extra_object"] = BytesStorageMetadata()
    _rewrite_metadata(d, edit)


def _safetensors_other_shapes(d) -> None:
    sd = load_file(str(d / "model.safetensors"))
    save_file({k: torch.zeros(v.shape[0] + 1, *v.shape[1:], dtype=v.dtype) for k, v in sd.items()},
              str(d / "model.safetensors"))


def _nan_weight(d) -> None:
    """One weight element NaN in model.safetensors (ddp) or in the DCP shards (fsdp, rewritten in one process)."""
    if (d / "model.safetensors").exists():
        sd = load_file(str(d / "model.safetensors"))
        sd["layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
        save_file(sd, str(d / "model.safetensors"))
        return
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
    flat = d.parent / "flat.pt"
    dcp_to_torch_save(str(d), str(flat))
    sd = torch.load(flat, weights_only=True)
    sd["model.layers.0.mlp.down_proj.weight"][0, 0] = float("inf")
    torch.save(sd, flat)
    for name in (".metadata", "__0_0.distcp"):
        os.remove(d / name)
    torch_save_to_dcp(str(flat), str(d))
    os.remove(flat)


def fp16_moment(path) -> None:
    """One Adam moment of an optimizer file of our DDP's format saved as fp16: it used to be cast to fp32 without
    a word."""
    sd = torch.load(path, weights_only=True)
    name = sorted(sd["params"])[0]
    sd["params"][name]["exp_avg"] = sd["params"][name]["exp_avg"].half()
    torch.save(sd, path)


def _link_outside(d) -> None:
    """model.safetensors moved out of the checkpoint and linked back (another run's weights, say)."""
    os.replace(d / "model.safetensors", d.parent / "elsewhere.safetensors")
    os.symlink(d.parent / "elsewhere.safetensors", d / "model.safetensors")


def _step_dir_linked(d) -> None:
    """The whole step directory moved out of checkpoints/ and linked back."""
    away = d.parent.parent / "other_run_step"
    os.replace(d, away)
    os.symlink(away, d)


def _named(needle, line: str) -> bool:
    """A case's needle: one string, or a tuple of strings that must all be in the line."""
    return all(n in line for n in ((needle,) if isinstance(needle, str) else needle))


# what each reader does with a case: refuse = exit 5 and one error line naming the file; fallback = resume
# skips the checkpoint with a log line naming the file and trains on from the older one (exit 0);
# warn = exit 0 with a warning naming the file; ok = the reader does not need the file (exit 0)
VERIFY = {"resume": "fallback", "init": "refuse", "sample": "refuse", "export": "refuse"}
LOAD = {"resume": "refuse", "init": "refuse", "sample": "refuse", "export": "refuse"}
RESUME_ONLY = {"resume": "refuse", "init": "ok", "sample": "ok", "export": "ok"}

# (id, engine kinds, damage(step_dir), recompute the manifest, what each reader does, the file named)
CASES = [
    ("manifest_list", ("ddp", "fsdp"), lambda d: (d / "manifest.json").write_text("[1, 2]"), False,
     VERIFY, "manifest.json"),
    ("manifest_wrong_object", ("ddp", "fsdp"), lambda d: (d / "manifest.json").write_text('{"x": 5}'), False,
     VERIFY, "manifest.json"),
    ("manifest_names_outside", ("ddp",), lambda d: _edit_json(d / "manifest.json", **{"../model.safetensors": {
        "bytes": 1, "sha256": "0" * 64}}), False, VERIFY, "manifest.json"),
    ("trainer_state_step_abc", ("ddp", "fsdp"), lambda d: _edit_json(d / "trainer_state.json", step="abc"), True,
     VERIFY, "trainer_state.json"),
    # bounded (issue 33 item 11): "step": 10**30 ended the run at once as "done"; an exponent too
    ("trainer_state_step_10e30", ("ddp", "fsdp"), lambda d: _edit_json(d / "trainer_state.json", step=10 ** 30), True,
     VERIFY, ("trainer_state.json", "step=")),
    ("trainer_state_step_1e30", ("ddp",), lambda d: _edit_json(d / "trainer_state.json", step=1e30), True,
     VERIFY, ("trainer_state.json", "step=")),
    ("trainer_state_world_size_huge", ("ddp",), lambda d: _edit_json(d / "trainer_state.json", world_size=10 ** 12),
     True, VERIFY, ("trainer_state.json", "world_size=")),
    ("weight_nan", ("ddp", "fsdp"), _nan_weight, True, LOAD, ("layers.0.mlp.down_proj.weight", "NaN/inf")),
    ("optimizer_fp16", ("ddp",), lambda d: fp16_moment(d / "optimizer_rank0.pt"), True, RESUME_ONLY,
     ("optimizer_rank0.pt", "torch.float16", "refused")),
    # symbolic links that leave the checkpoint (issue 33 item 10): refused, not followed
    ("safetensors_linked_outside", ("ddp",), _link_outside, True, VERIFY, ("model.safetensors", "symbolic link")),
    ("step_dir_linked_outside", ("ddp", "fsdp"), _step_dir_linked, False, VERIFY, (STEP, "symbolic link")),
    ("trainer_state_brace", ("ddp", "fsdp"), lambda d: (d / "trainer_state.json").write_text("{"), True,
     VERIFY, "trainer_state.json"),
    ("model_config_dim_64x", ("ddp", "fsdp"), lambda d: _edit_json(d / "model_config.json", dim="64x"), True,
     LOAD, "model_config.json"),
    ("safetensors_random", ("ddp",), lambda d: _random_bytes(d / "model.safetensors"), True,
     LOAD, "model.safetensors"),
    ("safetensors_other_shapes", ("ddp",), _safetensors_other_shapes, True, LOAD, "model.safetensors"),
    ("optimizer_truncated", ("ddp",), lambda d: _truncate(d / "optimizer_rank0.pt"), True,
     RESUME_ONLY, "optimizer_rank0.pt"),
    ("extra_missing", ("ddp", "fsdp"), lambda d: os.remove(d / "extra_rank0.pt"), True,
     {"resume": "warn", "init": "ok", "sample": "ok", "export": "ok"}, "extra_rank0.pt"),
    ("extra_rng_broken", ("ddp",), lambda d: torch.save({"rng": {"torch_cpu": torch.zeros(3, dtype=torch.uint8)}},
                                                      d / "extra_rank0.pt"), True, RESUME_ONLY, "extra_rank0.pt"),
    ("distcp_truncated", ("fsdp",), lambda d: _truncate(d / "__0_0.distcp"), True, VERIFY, "__0_0.distcp"),
    ("distcp_random", ("fsdp",), lambda d: _random_bytes(d / "__0_0.distcp"), True, LOAD, "__0_0.distcp"),
    ("metadata_missing", ("fsdp",), lambda d: os.remove(d / ".metadata"), True, VERIFY, ".metadata"),
    ("metadata_random", ("fsdp",), lambda d: _random_bytes(d / ".metadata"), True, VERIFY, ".metadata"),
    ("metadata_path_outside", ("fsdp",), _metadata_outside, True, VERIFY, ".metadata"),
    ("metadata_bytes_item", ("fsdp",), _metadata_bytes_item, True, VERIFY, ".metadata"),
    ("dcp_manifest_brace", ("fsdp",), lambda d: (d / "dcp_manifest.json").write_text("{"), True,
     VERIFY, "dcp_manifest.json"),
    ("dcp_manifest_optimizer_null", ("fsdp",), lambda d: _edit_json(d / "dcp_manifest.json", optimizer=None), True,
     RESUME_ONLY, "dcp_manifest.json"),
]

PARAMS = [pytest.param(kind, damage, again, expect[reader], needle, reader, id=f"{name}-{kind}-{reader}")
          for name, kinds, damage, again, expect, needle in CASES for kind in kinds
          for reader in ("resume", "init", "sample", "export")]


def _damaged_copy(runs, kind, damage, again, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs[kind], run)
    step = run / "checkpoints" / STEP
    damage(step)
    if again:
        republish(step)
    return run, step


def run_reader(reader: str, runs, run, step, tmp_path, capsys) -> tuple[int, str, str, str]:
    """(exit code, stdout, stderr, the prefix of the reader's error lines)."""
    if reader == "resume":
        code, prefix = T.main(["--init_from=resume", f"--out_dir={run}"]), "error:"
    elif reader == "init":
        code = T.main([*runs["args"], f"--out_dir={tmp_path / 'new'}", f"--init_from={step}", "--max_iters=1"])
        prefix = "error:"
    elif reader == "sample":
        code = sample.main([f"--ckpt={step}", "--prompt=a", "--max_new_tokens=2", "--device=cpu"])
        prefix = "sample.py:"
    else:
        code, prefix = export_hf.main([f"--ckpt={step}", f"--out_dir={tmp_path / 'hf'}"]), "export_hf:"
    out, err = capsys.readouterr()
    return code, out, err, prefix


def assert_refused(code: int, err: str, prefix: str, needle) -> None:
    assert "Traceback" not in err, err
    assert code == EXIT_BAD_CHECKPOINT, (code, err[-3000:])
    lines = [line for line in err.splitlines() if prefix in line]
    assert len(lines) == 1, err
    assert _named(needle, lines[0]), lines[0]


@pytest.mark.parametrize("kind, damage, again, what, needle, reader", PARAMS)
def test_damaged_checkpoint(runs, tmp_path, capsys, kind, damage, again, what, needle, reader):
    run, step = _damaged_copy(runs, kind, damage, again, tmp_path)
    code, out, err, prefix = run_reader(reader, runs, run, step, tmp_path, capsys)
    assert "Traceback" not in err, err
    if what == "refuse":
        assert_refused(code, err, prefix, needle)
        return
    assert code == EXIT_OK, (code, err[-3000:])
    assert not [line for line in err.splitlines() if prefix in line], err
    if what == "fallback":  # the damaged checkpoint is skipped, named; the run trains on from the older one
        skipped = [line for line in out.splitlines() if line.startswith(f"[checkpoint] skipping {step}:")]
        assert len(skipped) == 1 and _named(needle, skipped[0]), out[-3000:]
        assert f"[resume] continuing {run} from step 1 (--init_from=resume)" in out  # OLDER
        assert verify_checkpoint(str(step)) is None  # step 2 was trained again and saved over the damage
    elif what == "warn":
        warned = [line for line in out.splitlines() if "warning" in line and _named(needle, line)]
        assert len(warned) == 1 and "fresh RNG state" in warned[0], out[-3000:]
        assert f"[resume] continuing {run} from step 2 (--init_from=resume)" in out  # STEP


def test_intact_checkpoint_of_other_lora_flags_is_exit_2(runs, tmp_path, capsys, monkeypatch):
    """A genuine mismatch (the configuration builds another model than the intact checkpoint holds) keeps
    exit 2 and names the changed flag; the same mismatch under the run's own flags is a damaged file (5)."""
    from utils import run_config
    run, step = _damaged_copy(runs, "ddp", lambda d: None, False, tmp_path)
    # what a resume that slipped a --lora_rank change past the configuration check would meet
    monkeypatch.setattr(run_config, "MODEL_SHAPE_KEYS", tuple(k for k in run_config.MODEL_SHAPE_KEYS
                                                               if k != "lora_rank"))
    code = T.main(["--init_from=resume", f"--out_dir={run}", "--lora_rank=2"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_CONFIG, err[-3000:]
    line = [line for line in err.splitlines() if "error:" in line]
    assert len(line) == 1 and "--lora_rank changed since the run started" in line[0], err


def test_sample_and_export_name_a_damaged_step_or_fall_back(runs, tmp_path, capsys):
    """--ckpt=<run>: `latest` skips the damaged newest checkpoint with a log line (exit 0);
    `--checkpoint=step_2` names it: exit 5 with one line; a step that does not exist stays exit 2."""
    run, step = _damaged_copy(runs, "ddp", lambda d: _truncate(d / "model.safetensors"), False, tmp_path)
    hf = tmp_path / "hf"
    assert export_hf.main([f"--ckpt={run}", f"--out_dir={hf}"]) == EXIT_OK
    out, err = capsys.readouterr()
    assert f"[checkpoint] skipping {step}: model.safetensors has" in out and f"{OLDER} -> {hf}" in out, out
    assert sample.main([f"--ckpt={run}", "--prompt=a", "--max_new_tokens=2", "--device=cpu"]) == EXIT_OK
    assert f"[checkpoint] skipping {step}: model.safetensors has" in capsys.readouterr().err
    for reader, main, prefix, extra in (("export", export_hf.main, "export_hf:", [f"--out_dir={tmp_path / 'x'}"]),
                                        ("sample", sample.main, "sample.py:", ["--prompt=a", "--device=cpu"])):
        assert_refused(main([f"--ckpt={run}", "--checkpoint=step_2", *extra]), capsys.readouterr().err, prefix,
                       "model.safetensors has")
        assert main([f"--ckpt={run}", "--checkpoint=step_7", *extra]) == EXIT_BAD_CONFIG, reader
        assert "no checkpoint at step 7" in capsys.readouterr().err


# ---------------------------------------------------------------------------- paths outside the checkpoint

_opened: list | None = None


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


def test_no_dcp_loader_opens_a_path_outside_the_checkpoint(runs, tmp_path):
    """A .metadata naming ../outside.distcp: every loading path refuses it (DCPCheckpointError naming
    .metadata) without opening that file, verified or not: torch's loader is only reached through the
    reader, which confines the paths itself."""
    global _opened
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from checkpoint import dcp as D
    _, step = _damaged_copy(runs, "fsdp", _metadata_outside, True, tmp_path)
    outside = os.path.realpath(step.parent / "outside.distcp")
    sys.addaudithook(_audit)
    template = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in
                {"model.tok_embeddings.weight": ((1,), torch.float32)}.items()}
    calls = {
        "read_dcp_metadata": lambda: D.read_dcp_metadata(str(step)),
        "model_tensor_specs": lambda: D.model_tensor_specs(str(step)),
        "load_full_model_state_dict": lambda: D.load_full_model_state_dict(str(step)),
        "load_model_tensors": lambda: D.load_model_tensors(str(step), ["tok_embeddings.weight"]),
        "SafeFileSystemReader under dcp.load": lambda: dcp.load(template, no_dist=True,
                                                                 storage_reader=D.SafeFileSystemReader(str(step))),
    }
    for name, call in calls.items():
        _opened = []
        try:  # dcp.load itself wraps the reader's refusal in its CheckpointException (a BaseException)
            with pytest.raises((D.DCPCheckpointError, CheckpointException)) as e:
                call()
        finally:
            seen, _opened = _opened, None
        assert ".metadata: it points at '../outside.distcp', outside the checkpoint directory" in str(e.value), \
            (name, e.value)
        assert any(p.endswith(".metadata") for p in seen), (name, seen)  # the hook does see the reader's opens
        assert outside not in [os.path.realpath(p) for p in seen], (name, seen)


# ---------------------------------------------------------------------------- real processes

def test_real_processes_print_one_line(runs, tmp_path):
    """The trainer resuming past a random-byte DCP shard, and export_hf.py on a random-byte
    model.safetensors: exit 5, one line on stderr naming the file, no traceback."""
    run, step = _damaged_copy(runs, "fsdp", lambda d: _random_bytes(d / "__0_0.distcp"), True, tmp_path / "a")
    proc = run_python([sys.executable, os.path.join(ROOT, "train_my_ddp.py"), "--init_from=resume",
                       f"--out_dir={run}"], cwd=ROOT, env=_env())
    assert_refused(proc.returncode, proc.stderr, "error:", "__0_0.distcp")
    _, step = _damaged_copy(runs, "ddp", lambda d: _random_bytes(d / "model.safetensors"), True, tmp_path / "b")
    proc = run_python([sys.executable, os.path.join(ROOT, "export_hf.py"), f"--ckpt={step}",
                       f"--out_dir={tmp_path / 'hf'}"], cwd=ROOT, env=_env())
    assert_refused(proc.returncode, proc.stderr, "export_hf:", "model.safetensors")
    assert not os.path.exists(tmp_path / "hf")


# ---------------------------------------------------------------------------- configuration values

@pytest.mark.parametrize("flag, needle", [("--seed=-1", "--seed=-1: must be in [0, 4294967295]"),
                                          ("--out_dir=", "--out_dir='': must name the run directory")])
def test_crashing_cli_values_are_exit_2(runs, tmp_path, capsys, flag, needle):
    argv = [*runs["args"], f"--out_dir={tmp_path / 'run'}", "--max_iters=1", flag]
    code = T.main(argv)
    err = capsys.readouterr().err
    assert code == EXIT_BAD_CONFIG and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize("name, text, where", [
    ("dup.yaml", "learning_rate: 0.1\nbatch_size: 4\nlearning_rate: 0.2\n", "lines 1 and 3"),
    ("dup.json", '{"batch_size": 4, "batch_size": 8}', "'batch_size'"),
])
def test_config_file_with_a_duplicated_key_is_an_error(tmp_path, name, text, where):
    from utils.configurator import ConfigError, parse_config
    from trainer.config import TrainConfig
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match="is given twice") as e:
        parse_config(TrainConfig(), [str(path)])
    assert str(path) in str(e.value) and where in str(e.value)
