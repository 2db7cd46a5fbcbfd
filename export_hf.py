"""Export a checkpoint of ours to a Hugging Face directory: `python export_hf.py --ckpt=out/run --out_dir=hf [--checkpoint=best]`.

Owns: the command-line bridge from our checkpoints to `transformers.LlamaForCausalLM.from_pretrained`
(config.json + model.safetensors + generation_config.json + the tokenizer files; model/hf_interop.py). For a run trained with LoRA, the adapters are
merged into the weights by default; with `--adapters_out_dir` the base weights are exported
unmerged and the adapters are written in the PEFT layout next to them instead, for
`peft.PeftModel.from_pretrained(base, adapters_dir)`; a trained embedding / LM head goes into the
adapters as PEFT `modules_to_save`, and the base is the run's frozen base (for a run that grew the
vocabulary of a Hugging Face model, that model grown to the run's tokenizer: same vocabulary size,
new rows as initialised, model/resize.py). Checkpoints of every engine export the same way: a
pipeline-parallel run's stage files are merged into one model (checkpoint.weights.checkpoint_model_state),
a sharded FSDP (DCP) one without LoRA is streamed: read and written one safetensors shard at a time
(`--max_shard_gb`, HF's sharded layout with model.safetensors.index.json), never the whole model in memory. Importing goes the other way with
`--init_from=<HF dir>` in train_my_ddp.py. Exit 2 for a bad flag or a --checkpoint that names nothing
(both answered before torch is imported), 5 for a damaged checkpoint (one line naming the file;
docs/errors.md). Must never modify the checkpoint.
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    from utils.cli import Parser, add_out_dir
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="run directory, or one checkpoint directory")
    p.add_argument("--checkpoint", default="latest",
                   help="which checkpoint of the run: latest (newest valid), best (lowest validation loss) or step_N")
    add_out_dir(p, "the Hugging Face model directory to write", required=True)
    p.add_argument("--tokenizer_dir", default=None, help="default: the run's --tokenizer_dir")
    p.add_argument("--adapters_out_dir", "--adapters_output_dir", dest="adapters_out_dir", default=None,
                   help="LoRA runs: export base weights + PEFT adapters here instead of merging")
    p.add_argument("--max_shard_gb", type=float, default=2.0,
                   help="sharded (--parallel=fsdp) checkpoints: safetensors shards of at most this many GiB, "
                        "read and written one at a time (the whole model is never in memory)")
    args = p.parse_args(argv)
    from utils.run_dir import checkpoint_choice_problem, one_line
    problem = checkpoint_choice_problem(args.ckpt, args.checkpoint)  # names nothing: told before the torch import
    if problem:
        print(f"export_hf: {one_line(problem)}", file=sys.stderr)
        return 2  # checkpoint.verify.selection_exit_code of the same choice
    from utils.errors import report_named
    from utils.writable import UnwritableDirError, check_writable_dir
    try:  # where the export goes (`<out_dir>.tmp/` renamed into place): exit 2 before the checkpoint is read
        check_writable_dir(args.out_dir, "--out_dir", staged=True)
        if args.adapters_out_dir:
            check_writable_dir(args.adapters_out_dir, "--adapters_out_dir")
    except UnwritableDirError as e:
        return report_named(e, "export_hf")

    from model import Transformer
    from model.hf_interop import export_hf, hf_family
    from model.lora import merge_lora, peft_moe_caveat, save_lora
    from trainer.weights import load_lora_base, model_from_checkpoint
    from checkpoint.verify import selection_exit_code
    from utils.checkpoint_json import read_trainer_state
    from utils.errors import CheckpointError, one_line
    from checkpoint.select import select_checkpoint

    try:
        found = select_checkpoint(args.ckpt, args.checkpoint)
    except CheckpointError as e:  # 5: the checkpoint asked for is damaged; 2: it names nothing
        print(f"export_hf: {one_line(e)}", file=sys.stderr)
        return selection_exit_code(e, args.ckpt, args.checkpoint)
    try:
        streamed = _export_sharded_streaming(found, args)
        if streamed is not None:
            return streamed
        model, run_cfg = model_from_checkpoint(found)
    except Exception as e:  # noqa: BLE001 - named errors end the command with their code; others re-raise
        # a damaged file (named, 5), or e.g. the LoRA base or its tokenizer moved (TrainingError's code)
        code = report_named(e, "export_hf")
        if code is None:
            raise
        return code
    tok_dir = args.tokenizer_dir or run_cfg.get("tokenizer_dir")
    tok_dir = tok_dir if isinstance(tok_dir, str) else None
    problem = _tokenizer_problem(tok_dir, model.cfg.vocab_size)
    if problem:
        print(f"export_hf: {problem[1]}", file=sys.stderr)
        return problem[0]
    lora = run_cfg.get("lora_rank", 0) > 0
    if args.adapters_out_dir and not lora:
        print("export_hf: --adapters_out_dir given but the run did not train LoRA adapters", file=sys.stderr)
        return 2
    if lora and args.adapters_out_dir:
        save_lora(model, args.adapters_out_dir, base_model_name_or_path=os.path.abspath(args.out_dir))
        caveat = peft_moe_caveat(model)
        if caveat:
            print(f"export_hf: note: {caveat}", file=sys.stderr)
        lora_base = read_trainer_state(found).get("lora_base")
        if lora_base:  # the frozen base as the run started (grown to the run's tokenizer when it was)
            base = load_lora_base(lora_base, found, log=lambda m: None)
        else:  # the frozen base weights, without the adapters (trained embedding / LM head rows included)
            base = Transformer(model.cfg)
            base.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" not in k})
        model = base
        print(f"export_hf: adapters (PEFT layout) -> {args.adapters_out_dir}")
    elif lora:
        merge_lora(model)
    try:
        out = export_hf(model, args.out_dir, tokenizer_dir=tok_dir, stop_ids=_stop_ids(tok_dir))
    except ValueError as e:  # an MoE model that its family's format cannot hold (model/hf_interop.py moe_family)
        print(f"export_hf: {e}", file=sys.stderr)
        return 2
    family = hf_family(model.cfg)
    print(f"export_hf: {found} -> {out} ({family}{', LoRA merged' if lora and not args.adapters_out_dir else ''})")
    _say_mtp_left_out(model.cfg)
    return 0


def _tokenizer_problem(tok_dir: str | None, vocab_size: int) -> tuple[int, str] | None:
    """Why the tokenizer cannot be exported with this model: more tokens than the model's vocabulary, or a
    tokenizer file that changed since the tokenizer was written (a truncated tokenizer.json was exported
    without a word, exit 3). (exit code, message), or None when it can."""
    from tokenizer.contract import TokenizerMetaError
    from tokenizer.loading import check_tokenizer_files, load_tokenizer_meta
    from utils.checkpoint_json import read_json
    meta_path = os.path.join(tok_dir, "tokenizer_meta.json") if tok_dir else ""
    if meta_path and os.path.isfile(meta_path):
        try:
            check_tokenizer_files(tok_dir, load_tokenizer_meta(tok_dir))
        except (TokenizerMetaError, OSError) as e:
            return 3, f"--tokenizer_dir={tok_dir}: {e}"
        n_tok = int(read_json(meta_path)["vocab_size"])
        if n_tok > vocab_size:
            return 2, (f"--tokenizer_dir={tok_dir} has {n_tok} tokens, more than the model's vocabulary "
                       f"({vocab_size}); export with the tokenizer the run trained with")
    return None


def _stop_ids(tok_dir: str | None) -> list[int] | None:
    """What the export's generation_config.json stops at: the tokenizer's eos and its chat template's end of turn
    (Llama 3's <|eot_id|>, ChatML's <|im_end|>); None without a tokenizer of ours (no ids are written then)."""
    if not tok_dir or not os.path.isfile(os.path.join(tok_dir, "tokenizer_meta.json")):
        return None
    from tokenizer.chat import chat_stop_ids
    from tokenizer.loading import load_tokenizer_and_meta
    tok, meta = load_tokenizer_and_meta(tok_dir)
    return chat_stop_ids(tok, meta["special_tokens"]) if "eos" in meta["special_tokens"] else None


def _export_sharded_streaming(found: str, args) -> int | None:
    """A DCP (--parallel=fsdp) checkpoint without LoRA: stream it shard by shard into a sharded HF
    directory, never holding the whole model. None when the checkpoint is not of that kind."""
    from model.config import read_model_config
    from model.hf_interop import export_hf_streaming, hf_family
    from checkpoint.reads import is_sharded_checkpoint
    from utils.checkpoint_json import read_checkpoint_json
    from utils.checkpoint_layout import RUN_CONFIG
    if not is_sharded_checkpoint(found):
        return None
    run_cfg = read_checkpoint_json(found, RUN_CONFIG)
    lora_rank = run_cfg.get("lora_rank", 0)
    if not isinstance(lora_rank, int) or lora_rank > 0 or args.adapters_out_dir:
        return None  # adapters are merged or split in memory: the general path below (it names a bad config.json)
    from checkpoint.dcp import load_model_tensors, model_tensor_specs
    cfg = read_model_config(found)  # CheckpointError naming model_config.json: exit 5
    tok_dir = args.tokenizer_dir or run_cfg.get("tokenizer_dir")
    tok_dir = tok_dir if isinstance(tok_dir, str) else None
    problem = _tokenizer_problem(tok_dir, cfg.vocab_size)
    if problem:
        print(f"export_hf: {problem[1]}", file=sys.stderr)
        return problem[0]
    specs = model_tensor_specs(found)  # a damaged file raises DCPCheckpointError naming it (caught by main: 5)
    try:
        out, n = export_hf_streaming(cfg, specs, lambda names: load_model_tensors(found, names), args.out_dir,
                                     tokenizer_dir=tok_dir, max_shard_bytes=int(args.max_shard_gb * 2**30),
                                     stop_ids=_stop_ids(tok_dir))
    except ValueError as e:  # an MoE model that its family's format cannot hold (model/hf_interop.py moe_family)
        print(f"export_hf: {e}", file=sys.stderr)
        return 2
    print(f"export_hf: {found} -> {out} ({hf_family(cfg)}, streamed from the sharded checkpoint: {n} safetensors "
          f"shard(s) of <= {args.max_shard_gb:g} GiB, one in memory at a time)")
    _say_mtp_left_out(cfg)
    return 0


def _say_mtp_left_out(cfg) -> None:
    from model.hf_interop import writes_mtp
    if writes_mtp(cfg):
        print(f"export_hf: the {cfg.mtp_num_layers} multi-token prediction depth(s) written as the MTP layers "
              f"model.layers.{cfg.n_layers}.. (num_nextn_predict_layers, as DeepSeek-V3 / GLM-4.5 keep them)")
    elif cfg.mtp_num_layers:
        print(f"export_hf: the {cfg.mtp_num_layers} multi-token prediction depth(s) (mtp.*) are left out of the "
              "Hugging Face checkpoint (its family has no MTP layers): the export is the next-token model")


if __name__ == "__main__":
    sys.exit(main())
