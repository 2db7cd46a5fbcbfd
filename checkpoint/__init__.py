"""Checkpoints: one package owns the files of `<out_dir>/checkpoints/step_N/` for every engine.

  manager.py       CheckpointManager: the trainer's one interface (save, load, resume_problem, wait, close)
  plain.py         the "replicated" engines' format (our DDP / ZeRO): model.safetensors, optimizer_rank{r}.pt
  dcp.py           the "dtensor" engines' format (FSDP2): torch.distributed.checkpoint shards, any world size
  dcp_async.py     the sharded format written in the background (DCP serialised to memory, then to disk)
  dcp_files.py     DCP's .metadata read with an allow-list, every rank's shard present (verification)
  pipeline.py      the "stages" engines' format (pipeline): per-stage files, pipeline.json
  convert.py       ddp <-> fsdp checkpoints, converted per parameter name
  protocol.py      the atomic save protocol every format shares (step_N.tmp, manifest, COMPLETE, rename)
  async_writer.py  --async_checkpoint: host snapshots, one background writer, rank markers
  verify.py        verification, the newest valid checkpoint, pruning
  select.py        which checkpoint `latest` / `best` / `step_N` means; the configuration a resume starts from
  files.py         tensor files read and checked (safetensors, weights-only .pt), run_start.json
  reads.py         each rank's reads agreed on before a collective; optimizer, extra and LoRA weights read
  weights.py       one process's view of any format's weights (export, sampling, --init_from)
  rng.py           every RNG a step touches, as tensors

The names of the layout and the JSON sidecars' schema are torch-free and sit below every package
(utils/checkpoint_layout.py, utils/checkpoint_json.py): model/config.py, the supervisor and the commands'
pre-checks read them before torch. Engines expose their state (parallel/engine.py StateSpec), never files.
Importing this package imports nothing: each module is imported for what it holds.
"""
