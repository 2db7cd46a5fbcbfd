"""Loading a trained model for inference: the checkpoint a `--ckpt` (a run dir, a checkpoint dir or a Hugging Face
model dir) and `--checkpoint=latest|best|step_N` name, the model from it in eval mode, and the `--tokenizer_dir` the
run trained with. `precheck` answers what needs no torch (a --tokenizer_dir or a --checkpoint that names nothing,
exit 2) before torch is imported; the rest import it when called. Errors: TrainingError with its exit code (5 for a
damaged checkpoint, 2 for a choice that names nothing) or CheckpointError (exit 5, naming the file)."""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch  # imported by the loaders, after the flags were checked


def select_for_inference(ckpt_path: str, which: str, log: Callable[[str], None]) -> str:
    """A HF directory as it is, or the run's `which` checkpoint (verified). TrainingError with exit 5
    when what was asked for is damaged, 2 when it names nothing."""
    from checkpoint.select import select_checkpoint
    from checkpoint.verify import selection_exit_code
    from trainer.config import TrainingError
    from trainer.weights import is_hf_dir
    from utils.errors import CheckpointError, one_line
    if os.path.isdir(ckpt_path) and is_hf_dir(ckpt_path):
        return ckpt_path
    try:
        return select_checkpoint(ckpt_path, which, log=log)
    except CheckpointError as e:
        raise TrainingError(one_line(e), selection_exit_code(e, ckpt_path, which)) from e


def load_for_inference(ckpt_path: str, device: torch.device, which: str = "latest", reward: bool = False,
                       mtp_layers: int = 0):
    """(language model in eval mode on `device`, info) from a HF directory, or a run's `which` checkpoint; a reward
    model (model/score_head.py) with `reward`; up to `mtp_layers` of an HF model's multi-token prediction layers
    (model/hf_mtp.py). TrainingError (with its exit code: 2 for the other kind of model) or CheckpointError (exit 5,
    naming the file) when it cannot."""
    from trainer.config import TrainingError
    from trainer.weights import load_weights_from
    from utils.constants import EXIT_BAD_CONFIG
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    model, info = load_weights_from(select_for_inference(ckpt_path, which, log), log=log, mtp_layers=mtp_layers)
    if reward and not model.cfg.num_labels:
        raise TrainingError(f"{ckpt_path} is a language model: --preferences scores pairs with a reward model "
                            "(--task_type=reward's, or a Hugging Face *ForSequenceClassification)", EXIT_BAD_CONFIG)
    if model.cfg.num_labels and not reward:  # (model/score_head.py)
        raise TrainingError(f"{ckpt_path} is a reward model ({model.cfg.num_labels} score(s) per sequence, no LM "
                            "head): it neither generates nor scores tokens (eval_lm.py --preferences measures it; "
                            "export_hf.py writes it as a *ForSequenceClassification)", EXIT_BAD_CONFIG)
    return model.to(device).eval(), info


def recorded_tokenizer_dir(ckpt_path: str, which: str = "latest") -> Optional[str]:
    """The --tokenizer_dir the run trained with (from the checkpoint's config.json), or a HF dir's own."""
    from trainer.weights import is_hf_dir
    from utils.checkpoint_json import recorded_tokenizer
    found = select_for_inference(ckpt_path, which, log=lambda m: None)
    if is_hf_dir(found):
        return found if os.path.exists(os.path.join(found, "tokenizer_meta.json")) else None
    return recorded_tokenizer(found)


def no_tokenizer_message(tok_dir: Optional[str], given: Optional[str]) -> str:
    if given:
        return f"--tokenizer_dir={given}: not a directory"
    return f"no tokenizer: the run recorded {tok_dir!r}; pass --tokenizer_dir"


def precheck(args: Any) -> Optional[str]:
    """What is wrong with `args.ckpt` / `args.checkpoint` / `args.tokenizer_dir` that needs no torch to tell (the
    line the command prints, exit 2), or None: a --tokenizer_dir that is not there, a --ckpt that is no Hugging
    Face directory and where --checkpoint names nothing (utils.run_dir.checkpoint_choice_problem: the full path's
    message)."""
    from utils.run_dir import checkpoint_choice_problem, is_hf_dir, one_line
    if args.tokenizer_dir and not os.path.isdir(args.tokenizer_dir):
        return no_tokenizer_message(args.tokenizer_dir, args.tokenizer_dir)
    if os.path.isdir(args.ckpt) and is_hf_dir(args.ckpt):
        return None
    problem = checkpoint_choice_problem(args.ckpt, args.checkpoint)
    return one_line(problem) if problem else None
