"""Export a checkpoint of ours to a Hugging Face directory: `python export_hf.py --ckpt=out/run --out_dir=hf [--checkpoint=best]`.

Owns: the command-line bridge from our checkpoints to `transformers.LlamaForCausalLM.from_pretrained`
(config.json + model.safetensors + the tokenizer files). For a run trained with LoRA, the adapters are
merged into the weights by default; with `--adapters_out_dir` the base weights are exported
unmerged and the adapters are written in the PEFT layout next to them instead, for
`peft.PeftModel.from_pretrained(base, adapters_dir)`; a trained embedding / LM head goes into the
adapters as PEFT `modules_to_save`, and the base is the run's frozen base (for a run that grew the
vocabulary of a Hugging Face model, that model grown to the run's tokenizer: same vocabulary size,
new rows as initialised, model/resize.py). Checkpoints of every engine export the same way: a
pipeline-parallel run's stage files are merged into one model (parallel.engine.checkpoint_model_state),
a sharded FSDP one is read whole. Importing goes the other way with
`--init_from=<HF dir>` in train_my_ddp.py. Must never modify the checkpoint.
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
    args = p.parse_args(argv)

    from model import Transformer
    from model.hf_interop import export_hf
    from model.lora import merge_lora, save_lora
    from train_my_ddp import load_lora_base, model_from_checkpoint
    from utils import checkpoint as ckpt
    from utils.run_config import select_checkpoint

    try:
        found = select_checkpoint(args.ckpt, args.checkpoint)
    except ckpt.CheckpointError as e:
        print(f"export_hf: {e}", file=sys.stderr)
        return 2
    from train_config import TrainingError
    try:
        model, run_cfg = model_from_checkpoint(found)
    except (TrainingError, ckpt.CheckpointError) as e:  # e.g. the LoRA base or its tokenizer moved
        print(f"export_hf: {' '.join(str(e).split())}", file=sys.stderr)
        return getattr(e, "code", 5)
    tok_dir = args.tokenizer_dir or run_cfg.get("tokenizer_dir")
    meta_path = os.path.join(tok_dir, "tokenizer_meta.json") if tok_dir else ""
    if meta_path and os.path.isfile(meta_path):
        n_tok = int(ckpt.read_json(meta_path)["vocab_size"])
        if n_tok > model.cfg.vocab_size:
            print(f"export_hf: --tokenizer_dir={tok_dir} has {n_tok} tokens, more than the model's vocabulary "
                  f"({model.cfg.vocab_size}); export with the tokenizer the run trained with", file=sys.stderr)
            return 2
    lora = run_cfg.get("lora_rank", 0) > 0
    if args.adapters_out_dir and not lora:
        print("export_hf: --adapters_out_dir given but the run did not train LoRA adapters", file=sys.stderr)
        return 2
    if lora and args.adapters_out_dir:
        save_lora(model, args.adapters_out_dir, base_model_name_or_path=os.path.abspath(args.out_dir))
        lora_base = ckpt.read_json(os.path.join(found, "trainer_state.json")).get("lora_base")
        if lora_base:  # the frozen base as the run started (grown to the run's tokenizer when it was)
            base = load_lora_base(lora_base, found, log=lambda m: None)
        else:  # the frozen base weights, without the adapters (trained embedding / LM head rows included)
            base = Transformer(model.cfg)
            base.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" not in k})
        model = base
        print(f"export_hf: adapters (PEFT layout) -> {args.adapters_out_dir}")
    elif lora:
        merge_lora(model)
    out = export_hf(model, args.out_dir, tokenizer_dir=tok_dir)
    print(f"export_hf: {found} -> {out} (LlamaForCausalLM{', LoRA merged' if lora and not args.adapters_out_dir else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
