"""Pretokenize DPO preference pairs (`python -m data_preprocess.pretokenize_dpo_data`).

Owns: rendering {"prompt" | "conversations", "chosen", "rejected"} records (shapes and bad-record
policy of `data_preprocess.sft_format`) into two chat branches, prompt + reply each, with labels
only on the final reply (its content and <|im_end|>, -100 elsewhere), the over-long policy for a
pair, and the pretokenized DPO format, written atomically:
  <out>/input_ids.bin   token ids of every pair, chosen branch then rejected branch; dtype uint16 if
                        vocab_size <= 65536 else uint32
  <out>/labels.bin      int32, aligned with the ids (unshifted); -100 outside the final reply
  <out>/pairs.npy       int64 [n, 6]: chosen offset, chosen length, rejected offset, rejected length,
                        file id, position in that file (1-based line of a .jsonl, 0-based record of a
                        .json array / row of a .parquet)
  <out>/values.npy      float64 [n, 1], only where a kept pair's record carried "margin" (0.0 for a pair
                        without one): the margin a reward model's loss subtracts (trainer/tasks/reward.py)
  <out>/dpo_meta.json   written last: format version, dtype, vocab/pad ids, tokenizer fingerprint,
                        max_seq_len, overlong policy, counts, files [{path, file_id, first_pair, ...}]
`tokenize_dpo_records` makes the same arrays in memory (`chat_tokens.ChatTokens`) from raw records:
what the trainer hands `dataset.dataset_dpo.DPODataset` when --data_dir holds records, so training from
the raw files and from this folder reads the same items. `DPO_TASK` is the shared pretokenizer
(`pretokenize_sft_data.ChatTask`: the loop over files, the folder writer, the in-memory form, the command
line) given DPO's record shape, labels and counts.

Must never: store labels unsigned (trap 2), label a prompt token (earlier assistant turns included),
or drop a pair without counting it.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Optional

from data_preprocess.chat_tokens import DPO, drop_totals
from data_preprocess.pretokenize_sft_data import ChatTask, chat_pretokenize_cli
from data_preprocess.sft_format import TaggedConversations, dpo_margin, dpo_messages, last_run_only, with_tools

log = logging.getLogger("pretokenize_dpo")
DPO_FORMAT_VERSION = DPO.format_version


def dpo_conversations(rec: Any) -> TaggedConversations:
    """[prompt + chosen reply, prompt + rejected reply], with the record's margin (NaN: none); RecordError for a bad
    record."""
    prompt, chosen, rejected = dpo_messages(rec)
    return TaggedConversations([with_tools(rec, prompt + [chosen]), with_tools(rec, prompt + [rejected])],
                               values=(dpo_margin(rec),))


# DPO: labels on the final reply only; a pair whose branch is over-long is truncated (the reply's tail; kept when
# both replies keep a target token) or dropped, and any dropped pair counts as dropped_overlong
DPO_TASK = ChatTask(DPO, dpo_conversations, last_run_only, "dropped_overlong",
                    lambda stats: f"{drop_totals(stats)}; see the log for file:line",
                    {"pairs_columns": ["chosen_offset", "chosen_length", "rejected_offset", "rejected_length",
                                       "file_id", "position"]})
tokenize_dpo_files = DPO_TASK.tokenize_files  # (ids, labels, pairs [n, 6], per-file stats)
pretokenize_dpo = DPO_TASK.pretokenize  # writes the folder; returns dpo_meta (+ out_dir)
tokenize_dpo_records = DPO_TASK.tokenize_records  # what dataset_dpo.DPODataset reads for raw records, in memory


HELP_EPILOG = """\
records: {"prompt": str | "conversations": [{"role"|"from", "content"|"value"}], "chosen", "rejected",
  "system"?, "margin"?}; chosen/rejected a string or an assistant message (or a list ending with one);
  margin a number (a reward model's loss subtracts it; kept in values.npy where any record has one). Or TRL's
  implicit prompt: {"chosen": [messages], "rejected": [messages]} sharing all but their last (assistant)
  message, or two texts sharing a prefix: the shared part is the prompt. Each
  branch is prompt + reply rendered with the chat template; labels are the ids of the final reply
  and its <|im_end|>, -100 on every prompt token (earlier assistant turns included).
over-long policy (--overlong): a branch may hold max_seq_len+1 tokens. truncate (default) cuts the
  tail and keeps the pair if both replies keep a target token; drop drops the pair. Counted per file.
inputs: .jsonl, .json (an array), .parquet, extensions in any case; other files in the folder (.txt
  included) are ignored and named in a warning.
bad-input policy: malformed JSON, invalid UTF-8, records that are not objects, a missing prompt,
  chosen or rejected, non-string fields, text holding a lone surrogate (a JSON "\\ud800" escape):
  counted, logged (file:line) and skipped; --strict makes the first one an error (exit 3). A file
  without any usable pair is named in a warning; no usable pair at all is an error (exit 3). A broken
  .json array or parquet file, or a worker exception, fails that input: the others are still read,
  then every failed input is listed with its file and lines (exit 3).
output: train with --task_type=dpo --data_dir=<out>; the trainer checks that --tokenizer_dir is the
  tokenizer the pairs were made with (fingerprint, vocab size). The files are the same byte for
  byte for any --num_workers.
"""


def main(argv: Optional[list[str]] = None) -> int:
    code, meta = chat_pretokenize_cli(
        "python -m data_preprocess.pretokenize_dpo_data",
        "Render DPO preference pairs with the chat template and store chosen/rejected ids + labels (int32, "
        "-100 outside the final reply).", HELP_EPILOG, "pairs", "out/dpo_tokenized/<input name>_L<max_seq_len>",
        pretokenize_dpo, argv)
    if meta is None:
        return code
    for f in meta["files"]:
        log.info("%s: %d pairs, %d truncated, %d dropped over-long, skipped %s", f["path"], f["num_pairs"],
                 f["truncated"], f["dropped_overlong"], f["skipped"] or "none")
    log.info("%d pairs, %d tokens (%d targets)", meta["num_pairs"], meta["num_tokens"], meta["num_target_tokens"])
    print(f"wrote {meta['num_pairs']} DPO pairs to {meta['out_dir']} "
          f"(train with --task_type=dpo --data_dir={meta['out_dir']})")
    return code


if __name__ == "__main__":
    sys.exit(main())
