"""Pretokenize KTO's labelled examples (`python -m data_preprocess.pretokenize_kto_data`).

Owns: rendering {"prompt" | "conversations", "completion", "label"} records (TRL's unpaired preference shape: a
reply judged good, label true, or bad, false) into one chat branch, prompt + completion, with labels only on the
completion (its content and the template's closing token, -100 elsewhere), and the pretokenized KTO format:
  <out>/input_ids.bin   token ids of every example; dtype uint16 if vocab_size <= 65536 else uint32
  <out>/labels.bin      int32, aligned with the ids (unshifted); -100 outside the completion
  <out>/examples.npy    int64 [n, 5]: offset, length, desirable (1 / 0), file id, position in that file (1-based
                        line of a .jsonl, 0-based record of a .json array / row of a .parquet)
  <out>/kto_meta.json   written last: format version, dtype, vocab/pad ids, tokenizer fingerprint, max_seq_len,
                        overlong policy, counts, files
`tokenize_kto_records` makes the same arrays in memory: what the trainer reads when --data_dir holds such records.
DPO pairs train KTO too (trainer/tasks/kto.py: each pair a desirable and an undesirable example).
Must never: label a prompt token, or drop an example without counting it.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Optional

from data_preprocess.chat_tokens import DPO, KTO, drop_totals, is_pretokenized
from data_preprocess.pretokenize_sft_data import ChatTask, chat_pretokenize_cli
from data_preprocess.readers import RECORD_KINDS, find_input_files, iter_records, skip_counter
from data_preprocess.shard_format import DataError
from data_preprocess.sft_format import TaggedConversations, kto_messages, last_run_only, with_tools

log = logging.getLogger("pretokenize_kto")


def kto_conversations(rec: Any) -> TaggedConversations:
    """[prompt + completion], tagged with the label (1 desirable, 0 undesirable); RecordError for a bad record."""
    prompt, completion, desirable = kto_messages(rec)
    return TaggedConversations([with_tools(rec, prompt + [completion])], (int(desirable),))


KTO_TASK = ChatTask(KTO, kto_conversations, last_run_only, "dropped_overlong",
                    lambda stats: f"{drop_totals(stats)}; see the log for file:line",
                    {"examples_columns": ["offset", "length", "desirable", "file_id", "position"]})
pretokenize_kto = KTO_TASK.pretokenize  # writes the folder; returns kto_meta (+ out_dir)
tokenize_kto_records = KTO_TASK.tokenize_records  # what dataset_kto reads for raw records, in memory


def holds_pairs(path: str) -> bool:
    """Whether a --data_dir for KTO holds DPO pairs (a pretokenized DPO folder, or records whose first has "chosen")
    rather than labelled examples (a pretokenized KTO folder, or records with "completion" and "label")."""
    if is_pretokenized(path, DPO) or is_pretokenized(path, KTO):
        return is_pretokenized(path, DPO)
    try:
        files = find_input_files(path, kinds=RECORD_KINDS, what="KTO")
    except (DataError, OSError):
        return False  # (the examples' reader names what is missing)
    for f in files:
        try:
            for _, _, rec in iter_records(f, skip_counter(False)):
                if isinstance(rec, dict):
                    return "chosen" in rec and "completion" not in rec
        except DataError:
            continue
    return False


HELP_EPILOG = """\
records: {"prompt": str | [messages] | "conversations": [messages], "completion", "label": true | false,
  "system"?}; completion a string or an assistant message (or a list ending with one). Each example is prompt +
  completion rendered with the chat template; labels are the completion's ids and its closing token.
  DPO pairs ({"prompt", "chosen", "rejected"}) train --task_type=kto as they are (pretokenize_dpo_data).
over-long policy (--overlong): truncate (default) cuts the tail and keeps the example while its completion keeps a
  target token; drop drops it. Counted per file.
bad-input policy: malformed JSON, records that are not objects, a missing prompt or completion, a label that is
  not true / false: counted, logged (file:line) and skipped; --strict makes the first one an error (exit 3).
output: train with --task_type=kto --data_dir=<out>.
"""


def main(argv: Optional[list[str]] = None) -> int:
    code, meta = chat_pretokenize_cli(
        "python -m data_preprocess.pretokenize_kto_data",
        "Render KTO's labelled examples with the chat template and store their ids + labels (int32, -100 outside "
        "the completion) and desirable flags.", HELP_EPILOG, "examples",
        "out/kto_tokenized/<input name>_L<max_seq_len>", pretokenize_kto, argv)
    if meta is None:
        return code
    log.info("%d examples, %d tokens (%d targets)", meta["num_examples"], meta["num_tokens"],
             meta["num_target_tokens"])
    print(f"wrote {meta['num_examples']} KTO examples to {meta['out_dir']} "
          f"(train with --task_type=kto --data_dir={meta['out_dir']})")
    return code


if __name__ == "__main__":
    sys.exit(main())
