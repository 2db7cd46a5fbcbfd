"""Kill-and-resume trials: SIGKILL supervised training runs at random instants, compare with an uninterrupted run.

    python scripts/kill_trials.py [--kills=5] [--seed=0] [--configs=ddp,zero2,...] [--work=/tmp/kill_trials]

For every configuration: one uninterrupted reference run, then the same command under
`monitor_process.py`, whose training process tree (torchrun and every rank) this script kills with
SIGKILL `--kills` times, at instants drawn from a seeded random generator over the reference's
wall time (some land in start-up, before anything is recorded; some inside an evaluation or a
checkpoint save, which the intervals make frequent). The monitor restarts the run each time and it
resumes. Kills that land inside a checkpoint save (a step_N.tmp newer than every published checkpoint is
left) are counted; the *-async configurations (--async_checkpoint=true) hold each background write open
2 s (MYLLM_FAULT_SAVE_DELAY; their reference runs too) while the training goes on, so many kills land
inside one. A trial matches
when its per-step losses (the last row of each step) and its final weights are bit-identical to the
reference's. Prints one line per configuration and the totals; exit 1 on any mismatch or any run that did
not finish.

Not a test (minutes of wall time, real random kills): its figures go into docs/benchmarks.md. The tiny
tokenizer and shards are built from the bundled corpus as tests/conftest.py does.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from utils.proc_tree import descendants  # noqa: E402
PY = sys.executable

# issue 54: GRPO runs on toy prompts with a toy reward (tests/trainer/grpo_toy_rewards.py); a rollout is a function of
# (seed, step, prompt), nothing of it is checkpointed, so kills that land mid-rollout must resume to the same completions
GRPO = ["--task_type=grpo", "@grpo", "@base", "--reward_funcs=", "--reward_fn=tests.trainer.grpo_toy_rewards:vowels",
        "--num_generations=4", "--max_prompt_length=12", "--max_completion_length=8", "--learning_rate=1e-3"]
# name -> (processes, flags); every run: fp32, CPU, 16 steps, evaluation and checkpoint every 2 steps
CONFIGS: dict[str, tuple[int, list[str]]] = {
    "ddp": (1, []),
    "ddp2-zero1": (2, ["--batch_size=2", "--use_distributed_optimizer=true", "--zero_stage=1"]),
    "ddp2-zero2": (2, ["--batch_size=2", "--use_distributed_optimizer=true", "--zero_stage=2"]),
    "fsdp2-raf-false": (2, ["--batch_size=2", "--parallel=fsdp", "--reshard_after_forward=false"]),
    "fsdp1": (1, ["--parallel=fsdp"]),
    "pipeline2": (2, ["--pipeline_parallel_size=2", "--gradient_accumulation_steps=2"]),
    "lora": (1, ["--lora_rank=4", "@base"]),  # @base: --init_from=<the ddp reference run>
    # the configurations the reliability review killed by hand (issue 33), kept covered here
    "tp2-sp": (2, ["--parallel=fsdp", "--tensor_parallel_size=2", "--sequence_parallel=true"]),
    "hsdp2": (2, ["--parallel=fsdp", "--dp_replicate_size=2", "--batch_size=2"]),
    "sft-epochs": (1, ["--task_type=sft", "@sft", "@base", "--max_seq_len=96", "--num_train_epochs=2",
                       "--max_iters=-", "--learning_rate=3e-3"]),  # --max_iters=-: dropped (the epochs set it)
    "dpo-lora": (1, ["--task_type=dpo", "@dpo", "@base", "--max_seq_len=96", "--lora_rank=4", "--dpo_beta=0.5",
                     "--learning_rate=3e-3"]),
    "samples": (1, ["--sample_every=3", "--sample_prompts=Once upon a time|def main("]),
    "spike-guard": (1, ["--spike_guard=true"]),
    # issue 34: the pipeline engine runs the task's own loss (DPO) and frozen parameters (LoRA)
    "pipeline2-dpo-lora": (2, ["--pipeline_parallel_size=2", "--gradient_accumulation_steps=2", "--task_type=dpo",
                               "@dpo", "@base", "--max_seq_len=96", "--lora_rank=4", "--dpo_beta=0.5",
                               "--learning_rate=3e-3"]),
    # issue 35: --async_checkpoint=true; @slow_writes holds every background write open 2 s before its publish
    # (MYLLM_FAULT_SAVE_DELAY) while the training goes on, so that many random kills land inside a write
    "ddp-async": (1, ["--async_checkpoint=true", "@slow_writes"]),
    "ddp2-zero2-async": (2, ["--batch_size=2", "--use_distributed_optimizer=true", "--zero_stage=2",
                             "--async_checkpoint=true", "@slow_writes"]),
    "fsdp2-async": (2, ["--batch_size=2", "--parallel=fsdp", "--async_checkpoint=true", "@slow_writes"]),
    "pipeline2-async": (2, ["--pipeline_parallel_size=2", "--gradient_accumulation_steps=2", "--async_checkpoint=true",
                            "@slow_writes"]),
    # issue 36: --optimizer=muon (its momentum in the checkpoints): one process, ZeRO-2 (matrices cut by shards),
    # FSDP2 (DTensor row shards)
    "muon": (1, ["--optimizer=muon"]),
    "ddp2-zero2-muon": (2, ["--batch_size=2", "--use_distributed_optimizer=true", "--zero_stage=2",
                            "--optimizer=muon"]),
    "fsdp2-muon": (2, ["--batch_size=2", "--parallel=fsdp", "--optimizer=muon"]),
    # issue 35: context parallelism (each sequence split over the 2 ranks, ring attention)
    "cp2": (2, ["--context_parallel_size=2"]),
    # issue 32: batches drawn ahead on a thread (a GPU run's default), gradient buffers not zero-filled between
    # steps (every ddp config), gradient accumulation over micro-batches drawn ahead
    "ddp-prefetch": (1, ["--prefetch_batches=2", "--gradient_accumulation_steps=2"]),
    "ddp2-zero1-prefetch": (2, ["--batch_size=2", "--use_distributed_optimizer=true", "--zero_stage=1",
                                "--prefetch_batches=3"]),
    # issue 32: the one-launch AdamW (optimizer/flat_adamw.py, a GPU run's default) forced on: its moments and step
    # count travel through the checkpoints (@flat_adamw: MYLLM_FLAT_ADAMW=on; the kernel's torch reference on a
    # CPU, the kernel itself with TRITON_INTERPRET=1); bf16 parameters over fp32 masters, and at 2 ranks
    "ddp-bf16-flat": (1, ["--dtype=bf16", "@flat_adamw"]),
    "ddp2-flat": (2, ["--batch_size=2", "@flat_adamw"]),
    # ZeRO-1 with it: each rank's shards in one launch (the moments compact, the shards' offsets in a row table)
    "ddp2-zero1-bf16-flat": (2, ["--batch_size=2", "--dtype=bf16", "--use_distributed_optimizer=true",
                                 "--zero_stage=1", "@flat_adamw"]),
    # gradients reduced in bf16, read in place by the kernel (no fp32 gradient store)
    "ddp2-bf16grads-flat": (2, ["--batch_size=2", "--dtype=bf16", "--grad_reduce_in_fp32=false", "@flat_adamw"]),
    # the reliability review's hand-killed configurations: Muon with ZeRO-1 and under the pipeline, context
    # parallelism with FSDP, ZeRO and Muon, SFT with LoRA, full DPO, async saves under Muon
    "ddp2-zero1-muon": (2, ["--batch_size=2", "--use_distributed_optimizer=true", "--zero_stage=1",
                            "--optimizer=muon"]),
    "pipeline2-muon": (2, ["--pipeline_parallel_size=2", "--gradient_accumulation_steps=2", "--optimizer=muon"]),
    "cp2-fsdp": (2, ["--context_parallel_size=2", "--parallel=fsdp"]),
    "cp2-zero1": (2, ["--context_parallel_size=2", "--use_distributed_optimizer=true", "--zero_stage=1"]),
    "cp2-muon": (2, ["--context_parallel_size=2", "--optimizer=muon"]),
    "sft-lora": (1, ["--task_type=sft", "@sft", "@base", "--max_seq_len=96", "--lora_rank=4",
                     "--learning_rate=3e-3"]),
    "dpo": (1, ["--task_type=dpo", "@dpo", "@base", "--max_seq_len=96", "--dpo_beta=0.5", "--learning_rate=3e-3"]),
    "muon-async": (1, ["--optimizer=muon", "--async_checkpoint=true", "@slow_writes"]),
    # issue 55: mixture of experts, every balancing option on (the selection biases travel in the checkpoints)
    "moe": (1, ["@moe"]),
    "moe-ddp2-zero1": (2, ["--batch_size=2", "--use_distributed_optimizer=true", "--zero_stage=1", "@moe"]),
    "moe-fsdp2": (2, ["--batch_size=2", "--parallel=fsdp", "@moe"]),
    "grpo": (1, [*GRPO, "--batch_size=2"]),
    "ddp2-zero1-grpo": (2, [*GRPO, "--batch_size=1", "--use_distributed_optimizer=true", "--zero_stage=1"]),
    "grpo-mu2-kl": (1, [*GRPO, "--batch_size=2", "--num_iterations=2", "--beta=0.05", "--loss_type=grpo",
                        "--generation_kv_cache=false"]),
    # the step's reward std over both ranks, and the held-out greedy evaluation split over them every 2 steps
    "ddp2-grpo-batch-eval": (2, [*GRPO, "--batch_size=1", "--scale_rewards=batch", "@grpo_eval"]),
    "moe-ep2": (2, ["--batch_size=2", "--parallel=fsdp", "--expert_parallel_size=2", "@moe"]),
    # expert parallelism under our DDP: the experts' shards reduced (and ZeRO-sharded) over their own group
    "moe-ep2-ddp": (2, ["--batch_size=2", "--expert_parallel_size=2", "@moe"]),
    "moe-ep2-zero1": (2, ["--batch_size=2", "--use_distributed_optimizer=true", "--zero_stage=1",
                          "--expert_parallel_size=2", "@moe"]),
    # a reward model (a new score head on the reference run's blocks; under LoRA its light checkpoints rebuild the
    # head over the frozen base) and distillation towards the reference run (the student moves off it by its CE term)
    "reward": (1, ["--task_type=reward", "@dpo", "@base", "--max_seq_len=96", "--learning_rate=3e-3"]),
    "reward-lora-ddp2": (2, ["--task_type=reward", "@dpo", "@base", "--max_seq_len=96", "--lora_rank=4",
                             "--batch_size=2", "--learning_rate=3e-3"]),
    "distill-fsdp2": (2, ["--task_type=distill", "@sft", "@base", "@teacher", "--max_seq_len=96", "--batch_size=2",
                          "--parallel=fsdp", "--distill_alpha=0.5", "--learning_rate=3e-3"]),
    # half the steps on replies the student samples itself (GKD's lambda), the others on the teacher's samples
    # (sequence-level KD), at 2 ranks of our DDP
    "distill-onpolicy-ddp2": (2, ["--task_type=distill", "@sft", "@base", "@teacher", "--max_seq_len=96",
                                  "--batch_size=2", "--distill_alpha=0.5", "--learning_rate=3e-3",
                                  "--distill_lmbda=0.5", "--max_completion_length=24", "--distill_seq_kd=true"]),
    # GRPO with each token's reverse KL to a frozen model in its advantage (on-policy distillation's term; the
    # reference run, where the policy starts, as the teacher), beside the toy reward, at 2 ranks
    "grpo-teacher-ddp2": (2, [*GRPO, "--batch_size=1", "--teacher_kl_coef=0.5", "@teacher"]),
    # selective activation checkpointing per op, with dropout (each recompute replays the draws), at 2 ranks
    "selective-ac-ddp2": (2, ["--batch_size=2", "--activation_checkpoint=selective", "--dropout=0.1"]),
    # DeepSeek-V3's shape: multi-head latent attention (a query latent too) over the MoE, an MTP depth, under FSDP2
    # with the experts over 2 ranks
    "mla-moe-ep2": (2, ["--batch_size=2", "--parallel=fsdp", "--expert_parallel_size=2", "@moe", "--kv_lora_rank=16",
                        "--q_lora_rank=24", "--mtp_num_layers=1"]),
    # multi-token prediction: two depths (their weights and optimizer state in the checkpoints)
    "mtp": (1, ["--mtp_num_layers=2", "--mtp_loss_weight=0.3"]),
    # an MoE model with an MTP depth (an MoE block too) and a capacity factor, experts over 2 ep ranks of our DDP
    "mtp-moe-capacity-ep2": (2, ["--batch_size=2", "--expert_parallel_size=2", "@moe", "--mtp_num_layers=1",
                                 "--moe_capacity_factor=0.75"]),
    # 2 pipeline stages with an MoE model's MTP depth on the last (its inputs sent on from the first stage)
    "mtp-moe-pipeline2": (2, ["--pipeline_parallel_size=2", "--gradient_accumulation_steps=2", "@moe",
                              "--mtp_num_layers=1", "--mtp_loss_weight=0.3"]),
}
MOE_FLAGS = ["--moe_num_experts=4", "--moe_top_k=2", "--moe_hidden_dim=32", "--moe_shared_experts=1",
             "--moe_aux_loss_coef=0.01", "--moe_z_loss_coef=0.001", "--moe_bias_update_rate=0.01"]
SLOW_WRITES_S = "2.0"


def config_args(common: list[str], flags: list[str], data: dict, base_ref: str) -> list[str]:
    """The common flags with a configuration's over them (a flag given again replaces the common one;
    `--key=-` drops it); @base / @sft / @dpo / @grpo name the ddp reference run and the toy SFT / DPO / GRPO files
    (@grpo_eval: the GRPO prompts as held-out prompts; @teacher: the reference run as a distillation teacher), @moe
    the MoE flags."""
    marks = {"@base": f"--init_from={base_ref}", "@sft": f"--data_dir={data['sft']}", "@dpo": f"--data_dir={data['dpo']}",
             "@grpo": f"--data_dir={data['grpo']}", "@grpo_eval": f"--eval_data_dir={data['grpo']}",
             "@teacher": f"--ref_model={base_ref}"}
    flags = [g for f in flags if f not in ("@slow_writes", "@flat_adamw")
             for g in (MOE_FLAGS if f == "@moe" else [marks.get(f, f)])]
    keys = {f.split("=", 1)[0] for f in flags}
    return [f for f in common if f.split("=", 1)[0] not in keys] + [f for f in flags if not f.endswith("=-")]


def build_data(base: str) -> dict:
    from scripts.corpus_slice import write_corpus_slice
    corpus = write_corpus_slice(os.path.join(base, "corpus"))
    tok, shards = os.path.join(base, "tok"), os.path.join(base, "shards")
    for cmd in ([PY, "-m", "tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--output_dir={tok}",
                 "--vocab_size=384", "--tokenizer_type=hf_bbpe", "--overwrite=true"],
                [PY, "-m", "data_preprocess.pretokenize_pretrain_data", f"--data_dir={corpus}",
                 f"--tokenizer_dir={tok}", f"--output_dir={shards}", "--num_workers=1", "--no_progress"],
                [PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={shards}",
                 "--max_seq_len=32", "--val_ratio=0.1"]):
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    toys = {}
    for key, src, n in (("sft", os.path.join("data", "sft", "sft_conversations.jsonl"), 32),
                        ("dpo", os.path.join("data", "dpo", "dpo_pairs.jsonl"), 40)):
        toys[key] = os.path.join(base, f"toy_{key}.jsonl")
        with open(os.path.join(ROOT, src), encoding="utf-8") as f, open(toys[key], "w", encoding="utf-8") as out:
            out.write("".join(line for _, line in zip(range(n), f)))
    toys["grpo"] = os.path.join(base, "toy_grpo.jsonl")
    with open(toys["grpo"], "w", encoding="utf-8") as out:
        out.write("".join(json.dumps({"prompt": f"{a} plus {b} is", "answer": str(a + b)}) + "\n"
                          for a in range(1, 9) for b in range(1, 5)))
    return {"tok": tok, "shards": shards, **toys}


def train_cmd(nproc: int, args: list[str]) -> list[str]:
    if nproc == 1:
        return [PY, os.path.join(ROOT, "train_my_ddp.py"), *args]
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            os.path.join(ROOT, "train_my_ddp.py"), *args]


def common_args(data: dict) -> list[str]:
    return [f"--data_dir={data['shards']}", f"--tokenizer_dir={data['tok']}", "--max_seq_len=32", "--dim=32",
            "--n_layers=2", "--n_heads=4", "--multiple_of=16", "--batch_size=4", "--learning_rate=1e-2",
            "--warmup_iters=2", "--max_iters=16", "--eval_interval=2", "--eval_iters=2", "--checkpoint_interval=2",
            "--keep_last=2", "--log_interval=1", "--progress=false", "--peak_flops=1e11", "--device=cpu",
            "--seed=7"]


def results(out_dir: str) -> tuple[dict[int, float], dict]:
    from checkpoint.weights import checkpoint_model_state
    from checkpoint.verify import find_latest_valid
    from utils.metrics import dedupe_by_step, read_metrics
    losses = {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(out_dir, "metrics.jsonl"))).items()}
    return losses, checkpoint_model_state(find_latest_valid(out_dir, log=lambda m: None))


def kill_tree_of_child(monitor_pid: int) -> bool:
    """SIGKILL every process under the monitor (the training, all ranks); the monitor survives."""
    pids = descendants(monitor_pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return bool(pids)


def unpublished_saves(out: str, since: float) -> bool:
    """Whether this attempt (started at `since`) left a step_N.tmp newer than every published checkpoint: the kill
    landed inside a save (a synchronous one, or a background write of --async_checkpoint). A leftover of an
    earlier attempt's kill is older than `since` and does not count."""
    from utils.checkpoint_layout import parse_step
    root = os.path.join(out, "checkpoints")
    try:
        names = os.listdir(root)
    except OSError:
        return False
    done = [s for n in names if (s := parse_step(n)) is not None]
    newest = max(done, default=0)
    for n in names:
        step = parse_step(n[:-len(".tmp")]) if n.endswith(".tmp") else None
        try:
            if step is not None and step > newest and os.stat(os.path.join(root, n)).st_mtime >= since:
                return True
        except OSError:
            continue
    return False


def trial(name: str, nproc: int, args: list[str], work: str, kills: int, rng: random.Random,
          ref_seconds: float, env_extra: dict) -> dict:
    out = os.path.join(work, f"{name}-killed")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [PY, os.path.join(ROOT, "monitor_process.py"), "--backoff_base=0", "--max_restarts=50",
           "--hang_timeout=300", "--", *train_cmd(nproc, [*args, f"--out_dir={out}"])]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_extra)
    os.makedirs(out, exist_ok=True)
    mon_out = open(os.path.join(work, f"{name}-monitor.out"), "w")  # the monitor's own output (its log is in out)
    mon = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=mon_out, stderr=subprocess.STDOUT)
    done_kills, instants, in_saves = 0, [], 0
    while done_kills < kills and mon.poll() is None:
        wait = rng.uniform(0.2, 0.9 * ref_seconds)  # from the (re)start: start-up, steps, evals, saves
        since = time.time()
        deadline = since + wait
        while time.time() < deadline and mon.poll() is None:
            time.sleep(0.05)
        if mon.poll() is None and kill_tree_of_child(mon.pid):
            done_kills += 1
            in_saves += unpublished_saves(out, since)
            instants.append(round(wait, 2))
            time.sleep(0.3)  # let the monitor notice and restart (backoff 0)
    rc = mon.wait(timeout=1800)
    mon_out.close()
    summary = {}
    try:
        summary = json.load(open(os.path.join(out, "monitor_summary.json")))
    except (OSError, ValueError):
        pass
    return {"out": out, "rc": rc, "kills": done_kills, "instants": instants, "in_saves": in_saves,
            "status": summary.get("final_status"),
            "restarts": summary.get("restarts")}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--work", default="/tmp/kill_trials")
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    os.makedirs(a.work, exist_ok=True)
    data = build_data(os.path.join(a.work, "data"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    total_kills = mismatches = failures = total_in_saves = 0
    base_ref = os.path.join(a.work, "ddp-ref")
    for name in a.configs.split(","):
        nproc, flags = CONFIGS[name]
        args = config_args(common_args(data), flags, data, base_ref)
        ref = os.path.join(a.work, f"{name}-ref")
        shutil.rmtree(ref, ignore_errors=True)
        env_extra = {"MYLLM_FAULT_SAVE_DELAY": SLOW_WRITES_S} if "@slow_writes" in flags else {}
        if "@flat_adamw" in flags:
            env_extra["MYLLM_FLAT_ADAMW"] = "on"
        t0 = time.time()  # the reference holds its writes open too: the kill instants span the same run time
        proc = subprocess.run(train_cmd(nproc, [*args, f"--out_dir={ref}"]), cwd=ROOT, env=dict(env, **env_extra),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{name}: the reference run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            return 1
        ref_seconds = time.time() - t0
        t = trial(name, nproc, args, a.work, a.kills, rng, ref_seconds, env_extra)
        total_in_saves += t["in_saves"]
        total_kills += t["restarts"] or 0  # kills that cost the run an attempt (a late one may hit its exit)
        ok_run = t["rc"] == 0 and t["status"] == "completed"
        same = False
        if ok_run:
            (lr, wr), (lk, wk) = results(ref), results(t["out"])
            same = lr == lk and wr.keys() == wk.keys() and all(bool((wr[k] == wk[k]).all()) for k in wr)
        failures += not ok_run
        mismatches += ok_run and not same
        print(f"{name:16s} kills {t['kills']} at {t['instants']} s after each start ({t['in_saves']} inside a save) "
              f"-> monitor {t['status']} "
              f"after {t['restarts']} restarts "
              f"(rc {t['rc']}); losses and weights {'identical' if same else 'DIFFER' if ok_run else 'n/a'} "
              f"(reference {ref_seconds:.0f} s)", flush=True)
    print(f"total: {total_kills} kills that forced a restart over {len(a.configs.split(','))} configurations "
          f"({total_in_saves} inside a checkpoint save), {mismatches} mismatches, {failures} runs that did not "
          "complete")
    return 1 if mismatches or failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
