"""Export a checkpoint of ours to a Hugging Face directory: `python export_hf.py --ckpt=out/run --output_dir=hf`.

Owns: the command-line bridge from our checkpoints to `transformers.LlamaForCausalLM.from_pretrained`
(config.json + model.safetensors + the tokenizer files). For a run trained with LoRA, the adapters are
merged into the weights by default; with `--adapters_output_dir` the base weights are exported
unmerged and the adapters are written in the PEFT layout next to them instead, for
`peft.PeftModel.from_pretrained(base, adapters_dir)`. Importing goes the other way with
`--init_from=<HF dir>` in train_my_ddp.py. Must never modify the checkpoint.
"""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="run directory (newest complete checkpoint) or a checkpoint dir")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--tokenizer_dir", default=None, help="default: the run's --tokenizer_dir")
    p.add_argument("--adapters_output_dir", default=None,
                   help="LoRA runs: export base weights + PEFT adapters here instead of merging")
    args = p.parse_args(argv)

    from model import Transformer
    from model.hf_interop import export_hf
    from model.lora import merge_lora, save_lora
    from train_my_ddp import model_from_checkpoint
    from utils import checkpoint as ckpt

    found = ckpt.resolve_checkpoint_dir(args.ckpt)
    if found is None:
        print(f"export_hf: no complete checkpoint under {args.ckpt}", file=sys.stderr)
        return 2
    model, run_cfg = model_from_checkpoint(found)
    tok_dir = args.tokenizer_dir or run_cfg.get("tokenizer_dir")
    lora = run_cfg.get("lora_rank", 0) > 0
    if args.adapters_output_dir and not lora:
        print("export_hf: --adapters_output_dir given but the run did not train LoRA adapters", file=sys.stderr)
        return 2
    if lora and args.adapters_output_dir:
        save_lora(model, args.adapters_output_dir, base_model_name_or_path=os.path.abspath(args.output_dir))
        base = Transformer(model.cfg)  # the frozen base weights, without the adapters
        base.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" not in k})
        model = base
        print(f"export_hf: adapters (PEFT layout) -> {args.adapters_output_dir}")
    elif lora:
        merge_lora(model)
    out = export_hf(model, args.output_dir, tokenizer_dir=tok_dir)
    print(f"export_hf: {found} -> {out} (LlamaForCausalLM{', LoRA merged' if lora and not args.adapters_output_dir else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
