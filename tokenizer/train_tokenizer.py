"""Train a tokenizer on the user's corpus and save it as a Hugging Face tokenizer directory.

Owns: the ``python -m tokenizer.train_tokenizer`` command and the ``train_tokenizer(...)`` API, vocabulary
sizing, appending the special/reserved tokens after the learned pieces, and the atomic save of
tokenizer.json, tokenizer_config.json (with the ChatML template), special_tokens_map.json and
tokenizer_meta.json.
Must never: read a whole corpus file into memory, leave a half-written output directory behind, or
write files that need ``trust_remote_code`` to load.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Sequence

from tokenizer.contract import (
    CHATML_TEMPLATE, META_FILENAME, NUM_SPECIAL, SPECIAL_TOKENS, TOKENIZER_TYPES, VOCAB_MULTIPLE, added_tokens,
    build_meta, check_meta, file_hashes, fingerprint_dir, write_json,
)
from tokenizer.corpus import (CorpusError, SkipCounter, collect_input_files, command_exit_code, is_dataset_source,
                              no_input_files_error)
from tokenizer.documents import (TEXT_FIELDS_HELP, count_documents, iter_documents, parse_text_fields,
                                 sample_documents, text_fields_spec)
from tokenizer.dataset_source import add_hf_dataset_flags, hf_dataset_from_args
from utils.publish import staged_dir
from utils.writable import check_writable_dir

log = logging.getLogger("tokenizer.train_tokenizer")

MIN_LEARNED = {"hf_bbpe": 256 + 1, "sp_bbpe": 256 + 2}  # 256 byte pieces + at least one more piece

POLICY = """\
bad-input policy:
  .txt is one document per line (a trailing \\r\\n or \\n is removed; empty lines are ignored).
  .jsonl is one JSON value per line; .json is a top-level array of objects (streamed) or, when it does
  not start with '[', JSON Lines; .parquet is read in record batches of the text columns only.
  A line/record that is invalid UTF-8, malformed JSON, not an object, missing a text field (or null),
  or has a non-string text field is SKIPPED and COUNTED; the first 5 locations (file:line, or
  file row N for parquet) are logged and all counts are saved in tokenizer_meta.json["training"].
  With --strict the first such record is an error naming file and line (exit code 3).
  A malformed element inside a .json array skips the rest of that file (it cannot be resynchronised).
  A missing/unreadable file, no documents left, or an unsupported explicit file is always an error
  (exit 3); an impossible option such as a vocab_size too small for 256 bytes + the 6 special tokens
  is exit 2.
"""


def _learned_target(vocab_size: int, tokenizer_type: str) -> int:
    learned = vocab_size - NUM_SPECIAL
    if learned < MIN_LEARNED[tokenizer_type]:
        raise ValueError(f"vocab_size={vocab_size} is too small: {tokenizer_type} needs at least "
                         f"{MIN_LEARNED[tokenizer_type]} learned pieces (256 bytes + merges) plus "
                         f"{NUM_SPECIAL} special tokens = {MIN_LEARNED[tokenizer_type] + NUM_SPECIAL}")
    return learned


def _tokenizer_config() -> dict[str, Any]:
    names = dict(SPECIAL_TOKENS)
    return {
        # The generic fast class loads tokenizer.json as is, on transformers 4.x and 5.x, without remote code.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": names["unk"], "bos_token": names["bos"], "eos_token": names["eos"], "pad_token": names["pad"],
        "additional_special_tokens": [names["im_start"], names["im_end"]],
        "add_bos_token": False, "add_eos_token": False,  # <s>/</s> are added by data_preprocess, not here
        "clean_up_tokenization_spaces": False,  # would break decode(encode(x)) == x
        "split_special_tokens": False,  # apply_chat_template must see the ChatML markers; see encode_texts
        "model_max_length": 1_000_000_000,
        "chat_template": CHATML_TEMPLATE,
    }


def save_tokenizer_dir(tk: Any, output_dir: str, tokenizer_type: str, training: dict[str, Any] | None = None,
                       overwrite: bool = False) -> dict[str, Any]:
    """Append special + reserved tokens to a trained ``tokenizers.Tokenizer`` and save atomically."""
    from tokenizers import AddedToken

    learned = tk.get_vocab_size(with_added_tokens=True)
    extra = added_tokens(learned)
    # special=True: skip_special_tokens drops them; normalized=False: matched on the raw text only.
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    for i, t in enumerate(extra):
        if tk.token_to_id(t) != learned + i:  # a learned piece spelled like a special token
            raise RuntimeError(f"special token {t!r} got id {tk.token_to_id(t)}, expected {learned + i}")
    if os.path.exists(output_dir) and os.listdir(output_dir) and not overwrite:
        raise FileExistsError(f"{output_dir} exists and is not empty (pass --overwrite=true to replace it)")
    # `<output_dir>.tmp/`, fsynced and renamed into place (an old output_dir is swapped aside, then
    # deleted): utils/publish.py. A failure leaves output_dir as it was.
    with staged_dir(os.path.abspath(output_dir), replace=True) as tmp:
        tk.save(os.path.join(tmp, "tokenizer.json"))
        write_json(os.path.join(tmp, "tokenizer_config.json"), _tokenizer_config())
        names = dict(SPECIAL_TOKENS)
        write_json(os.path.join(tmp, "special_tokens_map.json"), {
            "unk_token": names["unk"], "bos_token": names["bos"], "eos_token": names["eos"],
            "pad_token": names["pad"], "additional_special_tokens": [names["im_start"], names["im_end"]]})
        meta = build_meta(tokenizer_type, learned, {t: tk.token_to_id(t) for _, t in SPECIAL_TOKENS},
                          fingerprint_dir(tmp), training, files=file_hashes(tmp))
        check_meta(meta)
        write_json(os.path.join(tmp, META_FILENAME), meta)
    return meta


def train_tokenizer(data_dir_or_files: str | os.PathLike | Sequence[str | os.PathLike], output_dir: str,
                    vocab_size: int, tokenizer_type: str = "hf_bbpe", text_fields: str | Sequence[str] = "text",
                    max_train_bytes: int | None = None, seed: int = 0, min_frequency: int = 2,
                    num_threads: int | None = None, file_glob: str = "**/*", recursive: bool = True,
                    strict: bool = False, overwrite: bool = True, progress: bool = False,
                    character_coverage: float = 0.9995, verbose: bool = False,
                    hf_dataset: Any = None) -> dict[str, Any]:
    """Train and save a tokenizer; return its meta (the content of tokenizer_meta.json).

    ``data_dir_or_files`` may be None or empty when ``hf_dataset`` (a tokenizer.dataset_source.DatasetSource: a
    Hugging Face dataset's split) is given; its records are read after the files, with the same ``text_fields``.

    ``vocab_size`` is the target including the 6 special tokens; the saved vocabulary is the learned
    size + 6 rounded up to a multiple of 64 with ``<|reserved_k|>`` (so it may end below vocab_size
    when the corpus supports fewer merges, and above it when vocab_size is not a multiple of 64).
    """
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"tokenizer_type must be one of {TOKENIZER_TYPES}, got {tokenizer_type!r}")
    text_fields = parse_text_fields(text_fields)  # the one grammar (tokenizer.documents): ValueError when empty
    if max_train_bytes is not None and max_train_bytes <= 0:
        raise ValueError("max_train_bytes must be positive")
    learned_target = _learned_target(vocab_size, tokenizer_type)
    if not overwrite and os.path.isdir(output_dir) and os.listdir(output_dir):  # before the training, not after
        raise FileExistsError(f"{output_dir} exists and is not empty (pass --overwrite=true to replace it)")
    check_writable_dir(output_dir, "--out_dir", staged=True)  # exit 2 now, not a traceback after the training
    threads = num_threads or os.cpu_count() or 1
    # Rayon reads this when its pool starts (the first parallel call in the process); later it has no effect.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))

    t0 = time.time()
    found = collect_input_files(data_dir_or_files, file_glob, recursive) if data_dir_or_files else None
    files: list[Any] = list(found.files) if found else []
    if found and not files:
        raise no_input_files_error(data_dir_or_files, file_glob)
    if hf_dataset is not None:
        files.append(hf_dataset)
    if not files:
        raise ValueError("no input: give --data_dir and/or --hf_dataset")
    stats = SkipCounter(strict=strict)
    if max_train_bytes is not None:
        count = count_documents(files, text_fields, stats, progress)
        if count.documents == 0:
            _raise_empty(files, stats)
        docs = sample_documents(files, text_fields, max_train_bytes, seed, count, progress)
    else:
        count = None
        docs = iter_documents(files, text_fields, stats, progress)

    used = {"documents": 0, "bytes": 0}
    failure: list[BaseException] = []

    def counted(it):
        # Exceptions raised inside a Python iterator are mangled by the Rust/C++ trainers, so a corpus
        # error (e.g. under --strict) is stored, the stream ends, and it is re-raised after training.
        try:
            for d in it:
                used["documents"] += 1
                used["bytes"] += len(d)  # characters; cheap, and only informational
                yield d
        except Exception as e:  # noqa: BLE001
            failure.append(e)

    try:
        if tokenizer_type == "hf_bbpe":
            from tokenizer.build_hf import train_hf_bbpe
            tk = train_hf_bbpe(counted(docs), learned_target, min_frequency, progress)
        else:
            from tokenizer.build_sp import train_sp_bbpe
            tk = train_sp_bbpe(counted(docs), learned_target, seed, threads, character_coverage, verbose)
    except Exception:
        if failure:
            raise failure[0] from None
        if used["documents"] == 0:
            _raise_empty(files, stats)
        raise
    if failure:
        raise failure[0]
    if used["documents"] == 0:
        _raise_empty(files, stats)

    training = {
        "files": [str(f) if is_dataset_source(f) else os.path.abspath(f) for f in files],
        "ignored_files": [os.path.abspath(f) for f in found.ignored] if found else [],
        "text_fields": text_fields_spec(text_fields),
        "requested_vocab_size": vocab_size,
        "max_train_bytes": max_train_bytes,
        "seed": seed,
        "min_frequency": min_frequency,
        "corpus_documents": count.documents if count else used["documents"],
        "corpus_bytes": count.bytes if count else None,
        "train_documents": used["documents"],
        "train_characters": used["bytes"],
        "seconds": round(time.time() - t0, 2),
        **stats.summary(),
    }
    meta = save_tokenizer_dir(tk, output_dir, tokenizer_type, training, overwrite)
    if stats.total:
        log.warning("skipped %d bad records: %s (first: %s)", stats.total, dict(stats.counts),
                    "; ".join(stats.first_locations))
    return meta


def _raise_empty(files: Sequence[str], stats: SkipCounter) -> None:
    detail = f"; {stats.total} records were skipped: {dict(stats.counts)}, first: {stats.first_locations}" \
        if stats.total else ""
    raise CorpusError(f"no usable documents in {len(files)} file(s) ({', '.join(map(str, files[:3]))}"
                      f"{', ...' if len(files) > 3 else ''}){detail}")


def build_arg_parser() -> argparse.ArgumentParser:
    from utils.cli import Parser, add_bool, add_out_dir
    p = Parser(
        prog="python -m tokenizer.train_tokenizer",
        description="Train a byte-level BPE tokenizer (hf_bbpe: HF tokenizers; sp_bbpe: sentencepiece BPE with "
                    "byte_fallback) and save a transformers-loadable directory with the ChatML template and "
                    "tokenizer_meta.json. Special tokens <unk> <s> </s> <pad> <|im_start|> <|im_end|> get ids "
                    f"right after the learned pieces; <|reserved_k|> pad the vocabulary to a multiple of {VOCAB_MULTIPLE}.",
        epilog=POLICY)  # utils.cli.Parser: descriptions keep their lines, options show their defaults
    p.add_argument("--data_dir", nargs="+", action="extend", default=None,
                   help="directories, files or glob patterns (.txt, .json, .jsonl, .parquet); repeatable "
                        "(required unless --hf_dataset is given)")
    add_hf_dataset_flags(p)
    add_out_dir(p, "the tokenizer directory to write", required=True)
    p.add_argument("--vocab_size", type=int, required=True, help="target size including the 6 special tokens")
    p.add_argument("--tokenizer_type", choices=TOKENIZER_TYPES, default="hf_bbpe")
    p.add_argument("--text_fields", default="text", help=TEXT_FIELDS_HELP)
    p.add_argument("--max_train_bytes", type=parse_byte_size, default=None,
                   help="train on a uniform random sample of documents of about this many UTF-8 bytes "
                        "(e.g. 2000000000, 2e9, 2G, 500M) "
                        "(two streaming passes; memory stays bounded). Default: all documents")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min_frequency", type=int, default=2, help="hf_bbpe: minimum pair count for a merge")
    p.add_argument("--character_coverage", type=float, default=0.9995, help="sp_bbpe: rarer characters use byte pieces")
    p.add_argument("--num_threads", type=int, default=None, help="default: all cores")
    p.add_argument("--file_glob", default="**/*", help="pattern inside each directory (default **/*)")
    add_bool(p, "recursive", True, "descend into subdirectories")
    add_bool(p, "strict", False, "bad records are errors instead of counted skips")
    add_bool(p, "overwrite", False, "replace a non-empty --out_dir (default: refuse it, exit 2, as the trainer "
             "refuses a second run in one --out_dir)")
    add_bool(p, "progress", True, "progress bars", false_aliases=("quiet",))
    add_bool(p, "verbose", False, "sentencepiece's own training log (hundreds of lines)")
    return p


def parse_byte_size(text: str) -> int:
    """'2000000000', '2e9', '2G', '500M', '64k' -> bytes (decimal units, as a user types sizes)."""
    t = text.strip().upper().rstrip("B")
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2e9, 2G, 500M)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a positive whole number of bytes: {text!r}")
    return int(value)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_arg_parser().parse_args(argv)
    if args.num_threads:
        os.environ["RAYON_NUM_THREADS"] = str(args.num_threads)  # before any tokenizers call starts the pool
    try:
        source = hf_dataset_from_args(args)
        meta = train_tokenizer(
            args.data_dir, args.out_dir, args.vocab_size, args.tokenizer_type, args.text_fields,
            args.max_train_bytes, args.seed, args.min_frequency, args.num_threads, args.file_glob,
            args.recursive, args.strict, args.overwrite, args.progress, args.character_coverage,
            verbose=args.verbose, hf_dataset=source)
    except Exception as e:  # noqa: BLE001 - a named error's code or a bad value's (2); anything else re-raised
        code = command_exit_code(e, log)
        if code is None:
            raise
        return code
    t = meta["training"]
    if meta["vocab_size"] < args.vocab_size:
        log.warning("vocab_size %d, not the %d asked for: the corpus supports only %d learned pieces at "
                    "--min_frequency=%d (a merge needs a pair seen that often); more or more varied text, or a lower "
                    "--min_frequency, learns more", meta["vocab_size"], args.vocab_size, meta["learned_vocab_size"],
                    args.min_frequency)
    log.info("saved %s: vocab_size=%d (learned %d), trained on %d of %d documents, skipped %d, %.1fs",
             args.out_dir, meta["vocab_size"], meta["learned_vocab_size"], t["train_documents"],
             t["corpus_documents"], t["skipped"], t["seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
