"""Every error train_my_ddp.py can name exits with its documented code and one clear line on stderr,
never a traceback: 2 bad configuration, 3 bad data, 5 unusable checkpoint (utils/constants.py).
The supervisor retries none of them.

Most cases call `train_my_ddp.main()` in this process (its return value is the exit code, an
uncaught exception fails the test like a traceback would); `test_cli_prints_one_line` runs two of
them as real processes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import pytest
import torch

import train_my_ddp as T
from tests.conftest import ROOT, child_env, run_cmd, run_python
from utils.constants import EXIT_BAD_CHECKPOINT, EXIT_BAD_CONFIG, EXIT_BAD_DATA, NON_RETRYABLE_EXIT_CODES

TRAIN = os.path.join(ROOT, "train_my_ddp.py")


_env = child_env  # tests/conftest.py: one thread per process, unbuffered output


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    code = T.main(argv)
    _, err = capsys.readouterr()
    return code, err


def assert_one_error_line(err: str, needle: str) -> None:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert needle in lines[0], lines[0]


def test_checkpoint_errors_are_not_retried():
    assert {EXIT_BAD_CONFIG, EXIT_BAD_DATA, EXIT_BAD_CHECKPOINT} <= NON_RETRYABLE_EXIT_CODES


CASES = [
    ("log_interval_0", ["--log_interval=0"], EXIT_BAD_CONFIG, "--log_interval=0: must be >= 1"),
    ("eval_iters_0", ["--eval_iters=0"], EXIT_BAD_CONFIG, "--eval_iters=0: must be >= 1"),
    ("keep_last_0", ["--keep_last=0"], EXIT_BAD_CONFIG, "--keep_last=0: must be >= 1"),
    ("n_heads_3_dim_64", ["--dim=64", "--n_heads=3"], EXIT_BAD_CONFIG,
     "bad model configuration: dim=64 is not divisible by n_heads=3"),
    ("lora_targets", ["--lora_rank=4", "--lora_targets=q_proj,qq_proj"], EXIT_BAD_CONFIG,
     "--lora_targets=q_proj,qq_proj: unknown module name(s) qq_proj"),
    ("learning_rate_nan", ["--learning_rate=nan"], EXIT_BAD_CONFIG, "--learning_rate=nan: must be a finite number > 0"),
    ("learning_rate_negative", ["--learning_rate=-0.1"], EXIT_BAD_CONFIG,
     "--learning_rate=-0.1: must be a finite number > 0"),
    ("min_lr_inf", ["--min_lr=inf"], EXIT_BAD_CONFIG, "--min_lr=inf: must be a finite number >= 0"),
    ("beta2_1.5", ["--beta2=1.5"], EXIT_BAD_CONFIG, "--beta2=1.5: must be in [0, 1)"),
    ("dropout_1", ["--dropout=1"], EXIT_BAD_CONFIG, "--dropout=1.0: must be in [0, 1)"),
    ("lr_schedule", ["--lr_schedule=exp"], EXIT_BAD_CONFIG, "--lr_schedule='exp' (cosine | linear | wsd | constant)"),
    ("cpu_offload_without_fsdp", ["--cpu_offload=true"], EXIT_BAD_CONFIG, "--cpu_offload=true cannot be combined with --parallel=ddp"),
    ("fsdp_powersgd", ["--parallel=fsdp", "--comm_hook=powersgd"], EXIT_BAD_CONFIG,
     "--comm_hook=powersgd cannot be combined with --parallel=fsdp"),
    ("parallel_unknown", ["--parallel=tp"], EXIT_BAD_CONFIG, "--parallel='tp' (ddp | fsdp)"),
    ("num_train_epochs_negative", ["--num_train_epochs=-1"], EXIT_BAD_CONFIG,
     "--num_train_epochs=-1.0: must be a finite number >= 0 (0 = off"),
    ("num_train_epochs_nan", ["--num_train_epochs=nan"], EXIT_BAD_CONFIG, "--num_train_epochs=nan: must be a finite"),
    ("num_train_epochs_1e300", ["--num_train_epochs=1e300"], EXIT_BAD_CONFIG,
     "--num_train_epochs=1e+300: must be <= 1e+06"),
    ("max_iters_huge", ["--max_iters=99999999999999999999"], EXIT_BAD_CONFIG,
     "--max_iters=99999999999999999999: must be <= 1,000,000,000"),
    ("lr_decay_iters_huge", ["--lr_decay_iters=10000000000"], EXIT_BAD_CONFIG,
     "--lr_decay_iters=10000000000: must be <= 1,000,000,000"),
    ("sample_every_fsdp", ["--sample_every=2", "--parallel=fsdp"], EXIT_BAD_CONFIG,
     "--sample_every=2 cannot be combined with --parallel=fsdp"),
    ("sample_every_negative", ["--sample_every=-1"], EXIT_BAD_CONFIG, "--sample_every=-1: must be >= 0"),
    ("sample_prompts_empty_file", ["--sample_every=1", "--sample_prompts={empty}"], EXIT_BAD_CONFIG,
     "empty.txt': the file holds no prompt (one per line)"),
    ("sample_tokenizer_unloadable", ["--sample_every=1", "--tokenizer_dir={meta_only}"], EXIT_BAD_CONFIG,
     "--sample_every=1: cannot load the tokenizer of --tokenizer_dir="),
    ("device_cuda_99", ["--device=cuda:99"], EXIT_BAD_CONFIG, "--device=cuda:99:"),
    ("device_unknown", ["--device=tpu"], EXIT_BAD_CONFIG, "--device=tpu:"),
    ("tokenizer_dir_missing", ["--tokenizer_dir=/nonexistent/tok"], EXIT_BAD_CONFIG,
     "--tokenizer_dir=/nonexistent/tok:"),
    ("init_from_missing", ["--init_from=/nonexistent/run"], EXIT_BAD_CONFIG,
     "--init_from=/nonexistent/run: no complete checkpoint or Hugging Face model there"),
    ("init_from_pickled_hf", ["--init_from={pickled_hf}"], EXIT_BAD_CONFIG,
     "no complete checkpoint or Hugging Face model there (pytorch_model.bin is a pickle, which this project never "
     "loads"),
    ("resume_without_record", ["--init_from=resume"], EXIT_BAD_CONFIG,
     "--init_from=resume: no complete checkpoint in"),
    ("data_dir_missing", ["--data_dir=/nonexistent/shards"], EXIT_BAD_DATA,
     "/nonexistent/shards: not a directory of token shards"),
    ("stale_index", ["--max_seq_len=16"], EXIT_BAD_DATA, "no index for max_seq_len=16"),
]


@pytest.mark.parametrize("extra, code, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_value_exits_with_its_code_and_one_line(tiny_pretrain_run_args, tmp_path, capsys, extra, code, needle):
    (tmp_path / "empty.txt").write_text("\n  \n", encoding="utf-8")  # a prompt file with no prompt in it
    tok = next(a.split("=", 1)[1] for a in tiny_pretrain_run_args if a.startswith("--tokenizer_dir="))
    (tmp_path / "meta_only").mkdir()  # tokenizer_meta.json (the data check passes) without the tokenizer files
    shutil.copy(os.path.join(tok, "tokenizer_meta.json"), tmp_path / "meta_only")
    (tmp_path / "pickled_hf").mkdir()  # a Hugging Face directory with only the pickled weights
    (tmp_path / "pickled_hf" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pickled_hf" / "pytorch_model.bin").write_bytes(b"\x80\x02")
    extra = [a.replace("{empty}", str(tmp_path / "empty.txt")).replace("{meta_only}", str(tmp_path / "meta_only"))
             .replace("{pickled_hf}", str(tmp_path / "pickled_hf")) for a in extra]
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=2", *extra], capsys)
    assert got == code, err
    assert_one_error_line(err, needle)


def test_device_cuda_without_cuda(tiny_pretrain_run_args, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device=cuda is valid here")
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=2",
                         "--device=cuda"], capsys)
    assert got == EXIT_BAD_CONFIG
    assert_one_error_line(err, "--device=cuda: no cuda device is available on this machine")


def test_cli_prints_one_line(tiny_pretrain_run_args, tmp_path):
    """The real process: exit code and a single error line on stderr, no traceback."""
    for extra, code, needle in ((["--log_interval=0"], EXIT_BAD_CONFIG, "--log_interval=0: must be >= 1"),
                                (["--max_seq_len=16"], EXIT_BAD_DATA, "no index for max_seq_len=16")):
        proc = run_python([sys.executable, TRAIN, *tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}",
                           "--max_iters=2", *extra], cwd=ROOT, env=_env())
        assert proc.returncode == code, proc.stderr[-3000:]
        assert_one_error_line(proc.stderr, needle)


# ---------------------------------------------------------------------------- tokenizer mismatch

@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> str:
    """A second real tokenizer with a smaller vocabulary (320 instead of 448)."""
    base = tmp_path_factory.mktemp("tok2")
    corpus = base / "corpus.jsonl"
    with open(os.path.join(ROOT, "data", "pretrain", "en_python_docs.jsonl"), encoding="utf-8") as f:
        corpus.write_text("".join(line for _, line in zip(range(40), f)), encoding="utf-8")
    run_cmd([sys.executable, "-m", "tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--output_dir={base / 'tok'}",
             "--vocab_size=300", "--tokenizer_type=hf_bbpe", "--quiet"])
    return str(base / "tok")


def test_shards_of_another_tokenizer_are_a_data_error(tiny_pretrain_run_args, tiny_pretrain_data, other_tokenizer,
                                                      tmp_path, capsys):
    meta2 = json.loads(open(os.path.join(other_tokenizer, "tokenizer_meta.json")).read())
    meta1 = json.loads(open(os.path.join(tiny_pretrain_data["tokenizer_dir"], "tokenizer_meta.json")).read())
    assert meta2["vocab_size"] < meta1["vocab_size"]  # the ids of the shards do not fit this tokenizer
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=2",
                         f"--tokenizer_dir={other_tokenizer}"], capsys)
    assert got == EXIT_BAD_DATA, err
    assert_one_error_line(err, "were tokenized with another tokenizer")
    line = next(line for line in err.splitlines() if "error:" in line)
    for s in (meta1["fingerprint"][:12], meta2["fingerprint"][:12], f"vocab {meta1['vocab_size']}",
              f"vocab {meta2['vocab_size']}", other_tokenizer, tiny_pretrain_data["data_dir"]):
        assert s in line, (s, line)


def test_same_vocab_other_fingerprint_is_a_data_error(tiny_pretrain_run_args, tiny_pretrain_data, tmp_path, capsys):
    tok = tmp_path / "tok"
    shutil.copytree(tiny_pretrain_data["tokenizer_dir"], tok)
    meta = json.loads((tok / "tokenizer_meta.json").read_text())
    meta["fingerprint"] = "0" * 64
    (tok / "tokenizer_meta.json").write_text(json.dumps(meta))
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=2",
                         f"--tokenizer_dir={tok}"], capsys)
    assert got == EXIT_BAD_DATA, err
    assert_one_error_line(err, "were tokenized with another tokenizer")
    assert "000000000000" in err


# ---------------------------------------------------------------------------- unusable checkpoints

@pytest.fixture(scope="module")
def small_run(tiny_pretrain_run_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "run"
    run_cmd([sys.executable, TRAIN, *tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=3"], env=_env())
    return out


def _copy_run(small_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(small_run, dst)
    step = dst / "checkpoints" / "step_00000003"
    return dst, step


def _rewrite(step_dir, name: str, data: bytes) -> None:
    """Replace a file and update the manifest, so that only loading it can tell it is bad."""
    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_init_from_a_damaged_checkpoint_exits_5(tiny_pretrain_run_args, small_run, tmp_path, capsys):
    _, step = _copy_run(small_run, tmp_path)
    with open(step / "model.safetensors", "r+b") as f:
        f.truncate(10)
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'new'}", "--max_iters=2",
                         f"--init_from={step}"], capsys)
    assert got == EXIT_BAD_CHECKPOINT, err
    assert_one_error_line(err, f"error: checkpoint {step} is not usable: model.safetensors has 10 bytes")


def test_checkpoint_with_a_bad_model_config_exits_5(tiny_pretrain_run_args, small_run, tmp_path, capsys):
    _, step = _copy_run(small_run, tmp_path)
    cfg = json.loads((step / "model_config.json").read_text())
    cfg["n_layerz"] = 2
    _rewrite(step, "model_config.json", json.dumps(cfg).encode())
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'new'}", "--max_iters=2",
                         f"--init_from={step}"], capsys)
    assert got == EXIT_BAD_CHECKPOINT, err
    assert_one_error_line(err, "unknown ModelConfig keys: ['n_layerz']")


def test_resume_from_an_unpicklable_checkpoint_file_exits_5(tiny_pretrain_run_args, small_run, tmp_path, capsys):
    import argparse
    import io
    run, step = _copy_run(small_run, tmp_path)
    buf = io.BytesIO()
    torch.save({"rng": argparse.Namespace(a=1)}, buf)  # not loadable with weights_only=True
    _rewrite(step, "extra_rank0.pt", buf.getvalue())
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={run}", "--max_iters=4", "--init_from=resume"], capsys)
    assert got == EXIT_BAD_CHECKPOINT, err
    assert_one_error_line(err, "extra_rank0.pt")


def test_resume_with_other_lora_flags_exits_2(tiny_pretrain_run_args, small_run, tmp_path, capsys):
    run, _ = _copy_run(small_run, tmp_path)
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={run}", "--max_iters=4", "--init_from=resume",
                         "--lora_rank=4"], capsys)
    assert got == EXIT_BAD_CONFIG, err
    assert_one_error_line(err, "--lora_rank=4 (the run used 0): the model's shape is fixed by its checkpoint")


def test_resume_when_every_checkpoint_is_damaged_exits_5(tiny_pretrain_run_args, small_run, tmp_path, capsys):
    """Starting over (from the recorded start) would hide the lost work and let pruning delete the
    damaged checkpoints: refuse instead."""
    run, step = _copy_run(small_run, tmp_path)
    with open(step / "model.safetensors", "r+b") as f:
        f.truncate(10)
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={run}", "--max_iters=4", "--init_from=resume"], capsys)
    assert got == EXIT_BAD_CHECKPOINT, err
    assert_one_error_line(err, "--init_from=resume: none of the 1 checkpoint(s) in")
    assert os.path.isdir(step)  # nothing was deleted


# ---------------------------------------------------------------------------- a full disk (issue 33 item 3)

def test_a_save_that_hits_a_file_size_limit_exits_7_with_no_partial_directory(tiny_pretrain_run_args, tmp_path):
    """The real process under RLIMIT_FSIZE (64 KiB, SIGXFSZ ignored: a write past it fails with EFBIG, as a
    full disk fails with ENOSPC): the first checkpoint's model.safetensors does not fit. One line naming the
    file and the free space, exit 7 (not retried by the supervisor), no step_N.tmp left behind."""
    import resource
    import signal
    import subprocess
    from utils.constants import EXIT_DISK_FULL

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, TRAIN, *tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=3"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, preexec_fn=limit)
    assert proc.returncode == EXIT_DISK_FULL and EXIT_DISK_FULL in NON_RETRYABLE_EXIT_CODES, proc.stderr[-3000:]
    assert_one_error_line(proc.stderr, f"error: disk full: saving checkpoint {out / 'checkpoints' / 'step_00000003'}"
                                       " failed: writing ")
    assert "step_00000003.tmp/model.safetensors did not fit" in proc.stderr and " free on " in proc.stderr
    assert os.listdir(out / "checkpoints") == []


@pytest.mark.parametrize("victim", ["metrics.jsonl", "heartbeat"])
def test_a_disk_that_fills_between_saves_exits_7_naming_the_file(tiny_pretrain_run_args, tmp_path, capsys,
                                                                 monkeypatch, victim):
    """The disk fills after set-up: the step's heartbeat or metrics row does not fit. One line naming the file,
    exit 7 (not retried by the supervisor), where it was an OSError traceback (exit 1, retried on the same disk)."""
    import builtins
    import errno

    import utils.metrics as M
    from utils.constants import EXIT_DISK_FULL
    real = builtins.open

    def full(path, mode="r", *a, **kw):
        if os.path.basename(str(path)) == victim and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, mode, *a, **kw)
    monkeypatch.setattr(M, "open", full, raising=False)
    out = tmp_path / "run"
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=2"], capsys)
    assert got == EXIT_DISK_FULL, err
    assert_one_error_line(err, f"error: disk full: writing {out / victim} did not fit")


def test_a_restart_on_a_full_disk_exits_7_at_its_saved_config(tiny_pretrain_run_args, tmp_path, capsys, monkeypatch):
    """A restart (or any start) whose config.json no longer fits: one line naming it, exit 7."""
    import errno

    import utils.configurator as C
    from utils.constants import EXIT_DISK_FULL

    def full(path, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(C, "atomic_write_json", full)
    out = tmp_path / "run"
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=2"], capsys)
    assert got == EXIT_DISK_FULL, err
    assert_one_error_line(err, f"error: disk full: writing {out / 'config.json'} did not fit")


# ---------------------------------------------------------------------------- model sizes (issue 33 item 7)

@pytest.mark.parametrize("field, value, needle", [
    ("dim", -64, "dim=-64: must be in [1, 65536]"),
    ("n_layers", 1000000, "n_layers=1000000: must be in [1, 1024]"),
    ("n_heads", 0, "n_heads=0: must be in [1, 1024]"),
    ("max_seq_len", 2 ** 40, f"max_seq_len={2 ** 40}: must be in [1, 2097152]"),
    ("norm_eps", -1.0, "norm_eps=-1.0: must be in (0, 1)"),
])
def test_checkpoint_model_config_out_of_bounds_exits_5_on_resume(tiny_pretrain_run_args, small_run, tmp_path,
                                                                  capsys, field, value, needle):
    """A recomputed manifest hides the edit from verification: the model_config.json reader bounds every
    size field before anything is built (n_layers=1000000 built layers until memory ran out)."""
    run, step = _copy_run(small_run, tmp_path)
    cfg = json.loads((step / "model_config.json").read_text())
    cfg[field] = value
    _rewrite(step, "model_config.json", json.dumps(cfg).encode())
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={run}", "--max_iters=4"], capsys)
    assert got == EXIT_BAD_CHECKPOINT, err
    assert_one_error_line(err, f"checkpoint {step}: model_config.json: {needle}")


def test_a_checkpoint_model_within_the_bounds_but_too_big_for_the_device_exits_5(tiny_pretrain_run_args, small_run,
                                                                                  tmp_path, capsys):
    """dim 65536 x 1024 layers is inside every bound (each field alone is legal) and ~56T parameters: refused
    before anything is allocated, naming the checkpoint's model_config.json (it built layers until memory ran out)."""
    run, step = _copy_run(small_run, tmp_path)
    cfg = json.loads((step / "model_config.json").read_text())
    cfg.update(dim=65536, n_layers=1024, n_heads=512, n_kv_heads=512, hidden_dim=None)
    _rewrite(step, "model_config.json", json.dumps(cfg).encode())
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={run}", "--max_iters=4"], capsys)
    assert got == EXIT_BAD_CHECKPOINT, err
    assert_one_error_line(err, f"checkpoint {step}: model_config.json: the model has ")
    assert "of fp32 weights alone" in err and "free on --device=cpu" in err


@pytest.mark.parametrize("flag, needle", [
    ("--dim=1048576", "--dim=1048576: must be in [1, 65536]"),
    ("--n_layers=1000000", "--n_layers=1000000: must be in [1, 1024]"),
    ("--vocab_size=8589934592", "--vocab_size=8589934592: must be in [1, 4294967296]"),
    ("--max_seq_len=99999999", "--max_seq_len=99999999: must be in [1, 2097152]"),
    ("--rope_theta=1e300", "--rope_theta=1e+300: must be in (0, 1e+12]"),
])
def test_model_flags_out_of_bounds_exit_2(tiny_pretrain_run_args, tmp_path, capsys, flag, needle):
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=2", flag], capsys)
    assert got == EXIT_BAD_CONFIG, err
    assert_one_error_line(err, needle)


def test_a_model_that_cannot_fit_the_device_is_refused_before_allocating(tiny_pretrain_run_args, tmp_path, capsys,
                                                                          monkeypatch):
    """dim 32, 2 layers, vocab 384 (tied: no) = 51,360 parameters (model/llama.py counts the same), 200.6 KiB of
    fp32 weights: refused when the device has 100 KiB free, one line, nothing built or written."""
    import utils.model_bounds as B
    from model.config import ModelConfig
    from model.llama import Transformer
    assert B.param_count(32, 2, 4, 384, multiple_of=16) == \
        sum(p.numel() for p in Transformer(ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=384,
                                                       multiple_of=16)).parameters()) == 51360
    for kw in (dict(n_kv_heads=2, tie_embeddings=True), dict(hidden_dim=80), dict(ffn_dim_multiplier=1.3)):
        model = Transformer(ModelConfig(dim=64, n_layers=3, n_heads=4, vocab_size=448, multiple_of=32, **kw))
        assert B.param_count(64, 3, 4, 448, multiple_of=32, **kw) == sum(p.numel() for p in model.parameters()), kw
    asked = []
    monkeypatch.setattr(B, "available_bytes", lambda device: asked.append(device) or 100 * 1024)
    got, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=2",
                         "--vocab_size=384"], capsys)
    assert got == EXIT_BAD_CONFIG and asked == ["cpu"], err
    assert_one_error_line(err, "the model has 51,360 parameters, 200.6 KiB of fp32 weights alone (training needs "
                               "about 4x that), more than the 100.0 KiB free on --device=cpu")
