"""Extend an existing tokenizer with pieces learned on a new corpus (continued pretraining on a new language).

Owns: the ``python -m tokenizer.extend_tokenizer`` command and ``extend_tokenizer(...)`` (with 0 new pieces: the base
adopted as it is, a released model's tokenizer for our pipeline): reading the base
tokenizer (extend_base.py: a sentencepiece-model Llama directory with ``tokenizer.model``, or any BPE
``tokenizer.json``), training pieces on the corpus with the same streaming readers as train_tokenizer
(extend_pieces.py), appending the ones the base lacks (and their merges) after ALL existing ids, padding to a
multiple of 64 with ``<|reserved_k|>`` (extend_build.py), and the atomic save.
Must never: change the string or id of a base token, read a whole corpus file into memory, use a
held-out document for training, or write files that need ``trust_remote_code`` to load.

Layout of the result: base ids 0..B-1 unchanged (learned pieces, specials, reserved and added tokens of
the base, whatever their order), new pieces B..B+n-1 in the order they were learned, then
``<|reserved_k|>`` (special) up to a multiple of 64. For a sentencepiece base the new pieces are also
appended to ``tokenizer.model`` (as Chinese-LLaMA merges its Chinese model into Llama's), with scores
below every base score so base merges keep their priority; the HF ``tokenizer.json`` gets the same
pieces and the merges equivalent to those scores (every split of a new piece into two known pieces).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from typing import Any, Sequence

from tokenizer.contract import META_FILENAME, VOCAB_MULTIPLE, file_hashes, fingerprint_dir, write_json
from tokenizer.corpus import CorpusError, collect_input_files, command_exit_code, no_input_files_error
from tokenizer.documents import TEXT_FIELDS_HELP, parse_text_fields, text_fields_spec
from tokenizer.extend_base import all_ids, base_files, load_base, tokenizer_fingerprint
from tokenizer.extend_build import (build_extended_json, check_extended_ids, extend_proto, special_tokens_meta,
                                    tokens_per_char)
from tokenizer.extend_pieces import (Corpus, select_new_tokens, train_bpe_candidates, train_sp_candidates,
                                     two_piece_splits)
from utils.publish import staged_dir
from utils.writable import check_writable_dir

log = logging.getLogger("tokenizer.extend_tokenizer")
ROLE_FLAGS = ("bos", "eos", "pad")  # --bos_token, ...: the roles our data layouts need (tokenizer/contract.py)

POLICY = """\
base: a directory with tokenizer.model (sentencepiece Llama; tokenizer.json, if present, is extended too)
  or a BPE tokenizer.json (byte-level or byte-fallback). Every base id keeps its string; new pieces get
  the ids after ALL base ids (specials, reserved and added tokens included); <|reserved_k|> pad the total
  to a multiple of 64. --num_new_tokens=0 (no --data_dir): the base adopted as it is, for our pipeline
  (a released model's tokenizer with its ids, specials and chat template, and a tokenizer_meta.json).
held-out text: every --heldout_every-th document (in file order) is never used for training; up to
  --heldout_chars characters of it measure tokens per character before and after.
bad input: the corpus follows train_tokenizer's policy (bad records skipped and counted, --strict makes
  them errors). Exit 2: no tokenizer in the base dir, --num_new_tokens < 0 (or > 0 without --data_dir),
  unusable options.
  Exit 3: missing/unreadable corpus, no usable documents (e.g. no record has the --text_fields).
"""


def extend_tokenizer(base_tokenizer_dir: str, data_dir_or_files: str | Sequence[str] | None, num_new_tokens: int,
                     output_dir: str, text_fields: Sequence[str] | str = ("text",),
                     max_train_bytes: int | None = None, seed: int = 0, min_frequency: int = 2,
                     heldout_every: int = 10, heldout_chars: int = 1_000_000, num_threads: int | None = None,
                     file_glob: str = "**/*", recursive: bool = True, strict: bool = False,
                     overwrite: bool = True, roles: dict[str, str] | None = None) -> dict[str, Any]:
    """Extend the base tokenizer with up to ``num_new_tokens`` pieces learned on the corpus; save; return the meta.
    ``num_new_tokens=0`` adopts the base as it is (no corpus): a released model's tokenizer for our pipeline.
    ``roles``: meta role (bos, eos, pad) -> a base token to play it, where the base's config names none (Qwen2's
    tokenizer has no bos) or another one is wanted; the tokenizer files are unchanged."""
    t0 = time.time()
    if num_new_tokens < 0:
        raise ValueError(f"--num_new_tokens must be >= 0 (0 adopts the base as it is), got {num_new_tokens}")
    if num_new_tokens and not data_dir_or_files:
        raise ValueError("--data_dir is required to learn new pieces (--num_new_tokens=0 adopts the base as it is)")
    text_fields = parse_text_fields(text_fields)  # the one grammar (tokenizer.documents): ValueError when empty
    if max_train_bytes is not None and max_train_bytes <= 0:
        raise ValueError("max_train_bytes must be positive")
    if heldout_every == 1:
        raise ValueError("--heldout_every=1 would hold out every document (0 disables the held-out slice)")
    check_writable_dir(output_dir, "--out_dir", staged=True)  # exit 2 now, not a traceback after the training
    if os.path.exists(output_dir) and os.listdir(output_dir) and not overwrite:
        raise FileExistsError(f"{output_dir} exists and is not empty (pass --overwrite=true to replace it)")
    if os.path.abspath(output_dir) == os.path.abspath(base_tokenizer_dir):
        raise ValueError(f"--out_dir {output_dir} is the base tokenizer directory; write the extension elsewhere")
    kind, tj, proto = load_base(base_tokenizer_dir)
    base_ids = all_ids(tj)
    for role, token in (roles or {}).items():
        if token not in base_ids:
            raise ValueError(f"--{role}_token={token!r} is not a token of the base tokenizer {base_tokenizer_dir}")
    threads = num_threads or os.cpu_count() or 1
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    if num_new_tokens == 0:  # adopted: every base id, special and template kept; reserved ids pad the vocabulary
        ext, start, total, reserved = build_extended_json(tj, [], {})
        ext_str = json.dumps(ext, ensure_ascii=False)
        check_extended_ids(ext_str, base_ids, [], start, total)
        return _save(base_tokenizer_dir, output_dir, kind, tj, proto, ext, ext_str, [], reserved, start, total,
                     None, {"characters": 0, "tokens_per_char_before": None, "tokens_per_char_after": None}, roles)

    found = collect_input_files(data_dir_or_files, file_glob, recursive, exclude_dir=output_dir)
    if not found.files:
        raise no_input_files_error(data_dir_or_files, file_glob)
    corpus = Corpus(found.files, text_fields, strict, heldout_every, heldout_chars, max_train_bytes, seed)
    if corpus.train_docs == 0:
        detail = f"; {corpus.stats.total} records were skipped: {dict(corpus.stats.counts)}, first: " \
                 f"{corpus.stats.first_locations}" if corpus.stats.total else ""
        raise CorpusError(f"no usable training documents in {len(found.files)} file(s) "
                          f"({', '.join(found.files[:3])}){detail}")
    new_tokens, primary = _learn_pieces(kind, tj, proto, corpus, num_new_tokens, seed, threads, min_frequency)
    ext, start, total, reserved = build_extended_json(tj, new_tokens, primary)
    ext_str = json.dumps(ext, ensure_ascii=False)
    check_extended_ids(ext_str, base_ids, new_tokens, start, total)

    before = tokens_per_char(json.dumps(tj, ensure_ascii=False), corpus.heldout)
    after = tokens_per_char(ext_str, corpus.heldout)
    training = {
        "files": [os.path.abspath(f) for f in found.files], "text_fields": text_fields_spec(text_fields),
        "max_train_bytes": max_train_bytes, "seed": seed, "min_frequency": min_frequency,
        "train_documents": corpus.train_docs, "heldout_documents": corpus.heldout_docs,
        "sampled_documents": corpus.sampled_docs, "sampled_characters": corpus.sampled_chars,
        "heldout_every": heldout_every, "seconds": round(time.time() - t0, 2), **corpus.stats.summary(),
    }
    meta = _save(base_tokenizer_dir, output_dir, kind, tj, proto, ext, ext_str, new_tokens, reserved,
                 start, total, training, {"characters": sum(len(t) for t in corpus.heldout),
                                          "tokens_per_char_before": before, "tokens_per_char_after": after}, roles)
    if corpus.stats.total:
        log.warning("skipped %d bad records: %s (first: %s)", corpus.stats.total, dict(corpus.stats.counts),
                    "; ".join(corpus.stats.first_locations))
    return meta


def _learn_pieces(kind: str, tj: dict[str, Any], proto: Any, corpus: Corpus, num_new_tokens: int, seed: int,
                  threads: int, min_frequency: int) -> tuple[list[str], dict[str, tuple[str, str]]]:
    """(up to num_new_tokens new pieces in learned order, each one's primary merge)."""
    base_ids = all_ids(tj)
    forbidden = {t["content"] for t in tj.get("added_tokens", [])}
    if proto is not None:
        base_ids.update({p.piece: i for i, p in enumerate(proto.pieces)})
    # Learn more pieces than asked (some the base already has); grow the request while the corpus allows.
    request = num_new_tokens * 2 + 256
    for attempt in range(4):
        if kind == "sentencepiece":
            pieces = train_sp_candidates(proto, corpus.training_documents(), request, seed, threads)
            cands: list[tuple[str, tuple[str, str] | None]] = []
            known_so_far = set(base_ids)
            for p in pieces:
                split = two_piece_splits(p, known_so_far) if len(p) > 1 else []
                cands.append((p, split[0] if split else (p[0], p[1:]) if len(p) > 1 else None))
                known_so_far.add(p)
            learned = len(pieces)
        else:
            alphabet, merges = train_bpe_candidates(tj, corpus.training_documents(), request, min_frequency)
            # merges in learned order (each pulls in the characters it needs), then characters by frequency
            cands = [(a + b, (a, b)) for a, b in merges] + [(a, None) for a in alphabet]
            learned = len(alphabet) + len(merges)
        new_tokens = select_new_tokens(cands, base_ids, forbidden, num_new_tokens)
        if len(new_tokens) >= num_new_tokens or learned < request * 0.95:
            break  # enough, or the corpus supports no more pieces
        request *= 2
    if len(new_tokens) < num_new_tokens:
        log.warning("the corpus supports only %d new tokens (asked for %d)", len(new_tokens), num_new_tokens)
    return new_tokens, {t: m for t, m in cands if m is not None}


def _save(base_dir: str, output_dir: str, kind: str, tj: dict[str, Any], proto: Any, ext: dict[str, Any],
          ext_str: str, new_tokens: list[str], reserved: list[str], start: int, total: int,
          training: dict[str, Any] | None, heldout: dict[str, Any],
          roles: dict[str, str] | None = None) -> dict[str, Any]:
    # `<output_dir>.tmp/`, fsynced and renamed into place (an old output_dir is swapped aside, then
    # deleted): utils/publish.py. A failure leaves output_dir as it was.
    with staged_dir(os.path.abspath(output_dir), replace=True) as tmp:
        for name in base_files(base_dir):
            if name not in ("tokenizer.json", "tokenizer.model"):
                shutil.copyfile(os.path.join(base_dir, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(ext_str)
        if proto is not None:
            with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
                f.write(extend_proto(proto, tj, new_tokens, reserved))
        cfg_path = os.path.join(tmp, "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.exists(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                config = json.load(f)
        if "added_tokens_decoder" in config:  # transformers 4.x layout: list the reserved tokens there too
            for k, t in enumerate(reserved):
                config["added_tokens_decoder"][str(start + len(new_tokens) + k)] = {
                    "content": t, "lstrip": False, "normalized": False, "rstrip": False,
                    "single_word": False, "special": True}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config["clean_up_tokenization_spaces"] = False  # would break decode(encode(x)) == x
        write_json(cfg_path, config)
        base_meta = None
        if os.path.exists(os.path.join(base_dir, META_FILENAME)):
            with open(os.path.join(base_dir, META_FILENAME), encoding="utf-8") as f:
                base_meta = json.load(f)
        ext_ids = all_ids(ext)
        meta = {
            "tokenizer_type": "extended_" + (base_meta or {}).get("tokenizer_type", kind),
            "vocab_size": total,
            "learned_vocab_size": total - len(ext.get("added_tokens", [])),  # ids that are not added/special tokens
            "special_tokens": {**special_tokens_meta(ext, config),
                               **{r: {"token": t, "id": ext_ids[t]} for r, t in (roles or {}).items()}},
            "fingerprint": fingerprint_dir(tmp),
            "files": file_hashes(tmp),
            "extension": {
                "base_dir": os.path.abspath(base_dir), "base_kind": kind,
                "base_fingerprint": tokenizer_fingerprint(base_dir),
                "base_meta_fingerprint": (base_meta or {}).get("fingerprint"),
                "base_vocab_size": start, "num_new_tokens": len(new_tokens),
                "new_token_ids": [start, start + len(new_tokens)], "reserved_tokens": len(reserved),
                "heldout": heldout,
            },
            "training": training,
        }
        write_json(os.path.join(tmp, META_FILENAME), meta)
    return meta


# ---------------------------------------------------------------- command line

def build_arg_parser() -> argparse.ArgumentParser:
    from tokenizer.train_tokenizer import parse_byte_size
    from utils.cli import Parser, add_bool, add_out_dir

    p = Parser(prog="python -m tokenizer.extend_tokenizer",
               description="Add pieces learned on a corpus to an existing tokenizer (sentencepiece Llama "
                           "tokenizer.model, or a BPE tokenizer.json). Base ids keep their strings; new ids follow "
                           f"all base ids; <|reserved_k|> pad to a multiple of {VOCAB_MULTIPLE}. Prints tokens "
                           "per character of held-out corpus text before and after.",
               epilog=POLICY, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base_tokenizer_dir", required=True, help="HF tokenizer (or model) directory to extend")
    p.add_argument("--data_dir", default=None, nargs="+", action="extend",
                   help="directories, files or glob patterns (.txt, .json, .jsonl, .parquet); repeatable (not "
                        "read with --num_new_tokens=0)")
    p.add_argument("--num_new_tokens", type=int, required=True,
                   help="how many new pieces to add (at most); 0 adopts the base as it is")
    add_out_dir(p, "the extended tokenizer directory to write", required=True)
    p.add_argument("--text_fields", default="text", help=TEXT_FIELDS_HELP)
    p.add_argument("--max_train_bytes", type=parse_byte_size, default=None,
                   help="train on a uniform random sample of about this many bytes (e.g. 2G); memory stays bounded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min_frequency", type=int, default=2, help="BPE bases: minimum pair count for a merge")
    p.add_argument("--heldout_every", type=int, default=10,
                   help="every N-th document is held out for the tokens/char report (0: none)")
    p.add_argument("--heldout_chars", type=int, default=1_000_000, help="at most this much held-out text is measured")
    p.add_argument("--num_threads", type=int, default=None)
    p.add_argument("--file_glob", default="**/*")
    add_bool(p, "recursive", True, "descend into subdirectories")
    add_bool(p, "strict", False, "bad records are errors instead of counted skips")
    for role in ROLE_FLAGS:
        p.add_argument(f"--{role}_token", default=None,
                       help=f"a token of the base to be the {role} token of our pipeline (where its config names "
                            "none, e.g. Qwen2's bos, or another is wanted); the tokenizer files are unchanged")
    add_bool(p, "overwrite", False, "replace a non-empty --out_dir (default: refuse it, exit 2, as the trainer "
             "refuses a second run in one --out_dir)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_arg_parser().parse_args(argv)
    if args.num_threads:
        os.environ["RAYON_NUM_THREADS"] = str(args.num_threads)
    try:
        meta = extend_tokenizer(args.base_tokenizer_dir, args.data_dir, args.num_new_tokens, args.out_dir,
                                args.text_fields, args.max_train_bytes, args.seed, args.min_frequency,
                                args.heldout_every, args.heldout_chars, args.num_threads, args.file_glob,
                                args.recursive, args.strict, args.overwrite,
                                {r: getattr(args, f"{r}_token") for r in ROLE_FLAGS if getattr(args, f"{r}_token")})
    except Exception as e:  # noqa: BLE001 - a named error's code or a bad value's (2); anything else re-raised
        code = command_exit_code(e, log)
        if code is None:
            raise
        return code
    x = meta["extension"]
    if x["num_new_tokens"] == 0 and meta["training"] is None:
        specials = ", ".join(f"{k}={v['id']}" for k, v in meta["special_tokens"].items()) or "none"
        print(f"adopted {args.base_tokenizer_dir} as {args.out_dir}: vocab_size {meta['vocab_size']} (base "
              f"{x['base_vocab_size']}, {x['reserved_tokens']} reserved ids), specials {specials}")
        return 0
    h = x["heldout"]

    def fmt(v: float | None) -> str:
        return "n/a (no held-out text)" if v is None else f"{v:.4f}"

    print(f"held-out tokens/char: before {fmt(h['tokens_per_char_before'])}  after {fmt(h['tokens_per_char_after'])}"
          f"  ({h['characters']} characters)")
    print(f"saved {args.out_dir}: {x['num_new_tokens']} new tokens (ids {x['new_token_ids'][0]}.."
          f"{x['new_token_ids'][1] - 1}), vocab_size {meta['vocab_size']} (base {x['base_vocab_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
