"""Extend an existing tokenizer with pieces learned on a new corpus (continued pretraining on a new language).

Owns: the ``python -m tokenizer.extend_tokenizer`` command and ``extend_tokenizer(...)``: reading the base
tokenizer (a sentencepiece-model Llama directory with ``tokenizer.model``, or any BPE ``tokenizer.json``:
byte-level like GPT-2/Llama-3/ours, or byte-fallback like our sp_bbpe), training pieces on the corpus
with the same streaming readers as train_tokenizer, appending the ones the base lacks (and their merges)
after ALL existing ids, padding to a multiple of 64 with ``<|reserved_k|>``, and the atomic save.
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
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from typing import Any, Container, Iterator, Sequence

from tokenizer.contract import (META_FILENAME, SPECIAL_TOKENS, VOCAB_MULTIPLE, file_hashes, fingerprint_dir,
                                write_json)
from tokenizer.corpus import CorpusError, SkipCounter, collect_input_files, command_exit_code, no_input_files_error
from tokenizer.documents import TEXT_FIELDS_HELP, iter_file_documents, parse_text_fields, text_fields_spec
from utils.publish import staged_dir
from utils.writable import check_writable_dir

log = logging.getLogger("tokenizer.extend_tokenizer")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")
_RESERVED = re.compile(r"^<\|reserved_(\d+)\|>$")
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
# sentencepiece ModelProto.SentencePiece.Type
SP_NORMAL, SP_CONTROL = 1, 3

POLICY = """\
base: a directory with tokenizer.model (sentencepiece Llama; tokenizer.json, if present, is extended too)
  or a BPE tokenizer.json (byte-level or byte-fallback). Every base id keeps its string; new pieces get
  the ids after ALL base ids (specials, reserved and added tokens included); <|reserved_k|> pad the total
  to a multiple of 64.
held-out text: every --heldout_every-th document (in file order) is never used for training; up to
  --heldout_chars characters of it measure tokens per character before and after.
bad input: the corpus follows train_tokenizer's policy (bad records skipped and counted, --strict makes
  them errors). Exit 2: no tokenizer in the base dir, --num_new_tokens <= 0, unusable options.
  Exit 3: missing/unreadable corpus, no usable documents (e.g. no record has the --text_fields).
"""


class BaseTokenizerError(ValueError):
    """The base directory holds no usable tokenizer (exit code 2)."""


# ---------------------------------------------------------------- base tokenizer

def _base_files(base_dir: str) -> list[str]:
    return [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(base_dir, n))]


def tokenizer_fingerprint(base_dir: str) -> str:
    """sha256 over the tokenizer files only (a model directory may also hold gigabytes of weights)."""
    h = hashlib.sha256()
    for name in _base_files(base_dir):
        with open(os.path.join(base_dir, name), "rb") as f:
            data = f.read()
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def load_base(base_dir: str) -> tuple[str, dict[str, Any], Any]:
    """(kind, tokenizer.json as a dict, sentencepiece ModelProto or None). kind is "sentencepiece" or "bpe"."""
    if not os.path.isdir(base_dir):
        raise BaseTokenizerError(f"--base_tokenizer_dir {base_dir}: not a directory")
    has_model = os.path.isfile(os.path.join(base_dir, "tokenizer.model"))
    has_json = os.path.isfile(os.path.join(base_dir, "tokenizer.json"))
    if not has_model and not has_json:
        raise BaseTokenizerError(f"--base_tokenizer_dir {base_dir}: no tokenizer.json or tokenizer.model in it")
    proto = None
    if has_model:
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        try:
            with open(os.path.join(base_dir, "tokenizer.model"), "rb") as f:
                proto.ParseFromString(f.read())
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others
            raise BaseTokenizerError(f"{base_dir}/tokenizer.model: not a sentencepiece model: {e}") from None
        if proto.trainer_spec.model_type != 2:  # BPE
            raise BaseTokenizerError(f"{base_dir}/tokenizer.model: sentencepiece model_type "
                                     f"{proto.trainer_spec.model_type} is not BPE (only BPE bases can be extended)")
    if has_json:
        with open(os.path.join(base_dir, "tokenizer.json"), encoding="utf-8") as f:
            tj = json.load(f)
    else:  # a Llama directory with only tokenizer.model: let transformers convert it as AutoTokenizer does
        from transformers import AutoTokenizer

        tj = json.loads(AutoTokenizer.from_pretrained(base_dir, trust_remote_code=False).backend_tokenizer.to_str())
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise BaseTokenizerError(f"{base_dir}: tokenizer.json model type {model.get('type')!r} is not BPE")
    if proto is not None and len(proto.pieces) > 0:
        for i, p in enumerate(proto.pieces):
            if model["vocab"].get(p.piece, i) != i:
                raise BaseTokenizerError(f"{base_dir}: tokenizer.json and tokenizer.model disagree on piece "
                                         f"{p.piece!r} (id {model['vocab'][p.piece]} vs {i})")
    return ("sentencepiece" if proto is not None else "bpe"), tj, proto


def _all_ids(tj: dict[str, Any]) -> dict[str, int]:
    ids = dict(tj["model"]["vocab"])
    for t in tj.get("added_tokens", []):
        ids.setdefault(t["content"], t["id"])
    return ids


def _uses_byte_level(tj: dict[str, Any]) -> bool:
    def walk(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False
    return walk(tj.get("pre_tokenizer"))


# ---------------------------------------------------------------- corpus: training stream and held-out slice

class Corpus:
    """The corpus split deterministically: document i (file order) is held out when i % every == every - 1."""

    def __init__(self, files: list[str], text_fields: Sequence[str], strict: bool, heldout_every: int,
                 heldout_chars: int, max_train_bytes: int | None, seed: int):
        self.files, self.text_fields, self.every = files, parse_text_fields(text_fields), heldout_every
        self.max_train_bytes, self.seed = max_train_bytes, seed
        self.stats = SkipCounter(strict=strict)
        self.heldout: list[str] = []
        self.train_docs = self.train_bytes = self.heldout_docs = 0
        self.sampled_docs = self.sampled_chars = 0  # of the last training pass
        held_chars = 0
        for i, (text, nbytes) in enumerate(self._docs(self.stats)):  # pass 1: count, collect held-out text
            if self._held(i):
                self.heldout_docs += 1
                if held_chars < heldout_chars:
                    self.heldout.append(text[:heldout_chars - held_chars])
                    held_chars += len(self.heldout[-1])
            else:
                self.train_docs += 1
                self.train_bytes += nbytes

    def _held(self, i: int) -> bool:
        return self.every > 0 and i % self.every == self.every - 1

    def _docs(self, stats: SkipCounter) -> Iterator[tuple[str, int]]:
        for path in self.files:
            yield from iter_file_documents(path, self.text_fields, stats)

    def training_documents(self) -> Iterator[str]:
        """The non-held-out documents, or a uniform sample of them of about max_train_bytes (Algorithm S).
        The same sample on every call (fixed seed), streamed: memory does not grow with the corpus."""
        quiet = SkipCounter(strict=False, quiet=True)
        n = self.train_docs
        if self.max_train_bytes is None or self.train_bytes <= self.max_train_bytes:
            k = n
        else:
            k = max(1, min(n, round(n * self.max_train_bytes / self.train_bytes)))
        rng = random.Random(self.seed)
        taken = seen = 0
        self.sampled_docs = self.sampled_chars = 0
        for i, (text, _) in enumerate(self._docs(quiet)):
            if self._held(i):
                continue
            if k == n or (n - seen) * rng.random() < (k - taken):
                taken += 1
                self.sampled_docs += 1
                self.sampled_chars += len(text)
                yield text
            seen += 1
            if taken >= k:
                return


# ---------------------------------------------------------------- training candidate pieces

def _train_bpe_candidates(tj: dict[str, Any], docs: Iterator[str], vocab_size: int,
                          min_frequency: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Train HF BPE with the base's normalizer and pre-tokenizer (so pieces live in the base's string space).
    Returns (alphabet, merges in learned order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    sub = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "normalizer": tj.get("normalizer"), "pre_tokenizer": tj.get("pre_tokenizer"),
           "post_processor": None, "decoder": None, "model": json.loads(tk.to_str())["model"]}
    tk = Tokenizer.from_str(json.dumps(sub))
    byte_level = _uses_byte_level(tj)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [])

    def batches_of(it: Iterator[str]) -> Iterator[list[str]]:
        batch: list[str] = []
        for d in it:
            batch.append(d)
            if len(batch) == 1000:
                yield batch
                batch = []
        if batch:
            yield batch

    chars: Counter = Counter()

    def counted(it: Iterator[str]) -> Iterator[str]:
        for d in it:
            if not byte_level:
                chars.update(d)  # distinct characters only: bounded by the script, not the corpus
            yield d

    tk.train_from_iterator(batches_of(counted(docs)), trainer=trainer)
    m = json.loads(tk.to_str())["model"]
    merges = [tuple(x) if isinstance(x, list) else tuple(x.split(" ", 1)) for x in m["merges"]]
    merged = {a + b for a, b in merges}
    # The trainer lists its alphabet in character order; the most frequent characters should come first.
    alphabet = sorted((t for t in m["vocab"] if t not in merged), key=lambda t: (-chars[t], t))
    return alphabet, merges  # type: ignore[return-value]


def _train_sp_candidates(proto: Any, docs: Iterator[str], vocab_size: int, seed: int,
                         threads: int) -> list[str]:
    """Train a sentencepiece BPE model with the base's text settings; its normal pieces in score order."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    from tokenizer.build_sp import _chunks

    ns, ts = proto.normalizer_spec, proto.trainer_spec
    docs_list = None  # sentencepiece keeps every sentence in memory anyway; a retry needs them again
    for attempt in range(2):
        spm.set_random_generator_seed(seed)
        out = io.BytesIO()
        source = _chunks(docs) if docs_list is None else iter(docs_list)
        if attempt == 0:
            docs_list = []

            def keep(it: Iterator[str]) -> Iterator[str]:
                for d in it:
                    docs_list.append(d)
                    yield d
            source = keep(source)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=source, model_writer=out, model_type="bpe", vocab_size=vocab_size,
                byte_fallback=True, character_coverage=0.9995, normalization_rule_name="identity",
                add_dummy_prefix=ns.add_dummy_prefix, remove_extra_whitespaces=ns.remove_extra_whitespaces,
                split_digits=ts.split_digits, split_by_whitespace=ts.split_by_whitespace,
                allow_whitespace_only_pieces=ts.allow_whitespace_only_pieces, hard_vocab_limit=False,
                unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1, max_sentence_length=16384,
                input_sentence_size=0, shuffle_input_sentence=False, num_threads=max(1, threads), minloglevel=2)
            break
        except RuntimeError as e:
            need = re.search(r"(\d+) vs (\d+)", str(e))
            if attempt == 0 and need and "required_chars" in str(e):
                vocab_size += int(need.group(2))  # a script with thousands of characters (CJK): room for them
                continue
            raise ValueError(f"sentencepiece training on the corpus failed: {e}") from e
    new = pb.ModelProto()
    new.ParseFromString(out.getvalue())
    pieces = [(p.score, i, p.piece) for i, p in enumerate(new.pieces) if p.type == SP_NORMAL]
    pieces.sort(key=lambda x: (-x[0], x[1]))
    return [p for _, _, p in pieces]


def _splits(token: str, known: Container[str]) -> list[tuple[str, str]]:
    return [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in known and token[k:] in known]


def select_new_tokens(candidates: list[tuple[str, tuple[str, str] | None]], vocab: dict[str, int],
                      forbidden: set[str], n: int) -> list[str]:
    """Up to n candidates the base lacks, in order, each reachable from its characters.

    ``candidates`` are (token, primary merge or None) in learned order. Characters of a token that are not
    known yet are taken first (each costs one of the n; the token is skipped if they do not fit); then a
    multi-character token is taken only when some split of it into two known tokens exists (its learned
    merge's parts came before it). Tokens spelled like a base added token or a byte piece are never taken."""
    known = dict(vocab)
    chosen: list[str] = []

    def take(t: str) -> None:
        known[t] = -1
        chosen.append(t)

    for tok, merge in candidates:
        if len(chosen) >= n:
            break
        if tok in known or tok in forbidden or _BYTE_PIECE.match(tok):
            continue
        if len(tok) == 1:
            take(tok)
            continue
        # characters the base lacks (a Chinese character for an English sentencepiece base) come first:
        # without them the piece could not be built (byte fallback never merges into pieces)
        missing = list(dict.fromkeys(ch for ch in tok if ch not in known))
        if any(ch in forbidden for ch in missing) or len(chosen) + len(missing) + 1 > n:
            continue
        for ch in missing:
            take(ch)
        if len(chosen) < n and _splits(tok, known):
            take(tok)
    return chosen


# ---------------------------------------------------------------- the extended tokenizer

def _next_reserved(all_tokens: Sequence[str]) -> int:
    ks = [int(m.group(1)) for t in all_tokens if (m := _RESERVED.match(t))]
    return max(ks) + 1 if ks else 0


def build_extended_json(tj: dict[str, Any], new_tokens: list[str],
                        primary: dict[str, tuple[str, str]]) -> tuple[dict[str, Any], int, int, list[str]]:
    """Append new_tokens (ids after every base id) with merges, then reserved tokens to a multiple of 64.
    Returns (tokenizer.json dict, first new id, total vocab size, reserved token strings)."""
    tj = json.loads(json.dumps(tj))
    ids = _all_ids(tj)
    start = max(ids.values()) + 1 if ids else 0
    vocab = tj["model"]["vocab"]
    # Base added tokens (our specials/reserved after the learned pieces) also go into the model vocab at their
    # ids: tokenizers ignores an added token's id when it falls inside the model's id range, so a hole
    # there would move them. No merge ever builds them, so user text still cannot produce them.
    used = set(vocab.values())
    for t in tj.get("added_tokens", []):
        if t["content"] not in vocab and t["id"] not in used:
            vocab[t["content"]] = t["id"]
            used.add(t["id"])
    for k, t in enumerate(new_tokens):
        vocab[t] = start + k
    known = set(vocab)
    merges_old = tj["model"]["merges"]
    as_strings = bool(merges_old) and isinstance(merges_old[0], str)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges_old]
    seen = set(merges)
    for t in new_tokens:
        if len(t) < 2:
            continue
        first = [primary[t]] if t in primary else []
        for a, b in first + [(t[:k], t[k:]) for k in range(1, len(t))]:
            if a in known and b in known and (a, b) not in seen:
                merges.append((a, b))
                seen.add((a, b))
    if as_strings and any(" " in a or " " in b for a, b in merges):
        as_strings = False  # a piece with a space cannot be written "a b"; the list form always works
    tj["model"]["merges"] = [f"{a} {b}" if as_strings else [a, b] for a, b in merges]
    end = start + len(new_tokens)
    total = -(-end // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    r0 = _next_reserved(list(ids) + new_tokens)
    reserved = [f"<|reserved_{r0 + k}|>" for k in range(total - end)]
    for k, t in enumerate(reserved):
        tj.setdefault("added_tokens", []).append({"id": end + k, "content": t, "single_word": False, "lstrip": False,
                                                  "rstrip": False, "normalized": False, "special": True})
    return tj, start, total, reserved


def extend_proto(proto: Any, tj_base: dict[str, Any], new_tokens: list[str], reserved: list[str]) -> bytes:
    """Chinese-LLaMA style: append pieces to the ModelProto. Base added tokens past the proto (e.g. a pad
    token added in transformers) become CONTROL pieces at their ids first, so proto ids == HF ids."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.CopyFrom(proto)
    by_id = {i: t for t, i in _all_ids(tj_base).items()}
    for i in range(len(m.pieces), max(by_id) + 1 if by_id else 0):
        m.pieces.append(pb.ModelProto.SentencePiece(piece=by_id.get(i, f"<|unused_{i}|>"), score=0.0,
                                                    type=SP_CONTROL))
    low = min((p.score for p in m.pieces if p.type == SP_NORMAL), default=0.0)
    for k, t in enumerate(new_tokens):
        # below every base score, decreasing in learned order: base merges first, then ours (= HF merge order)
        m.pieces.append(pb.ModelProto.SentencePiece(piece=t, score=low - 1.0 - k, type=SP_NORMAL))
    for t in reserved:
        m.pieces.append(pb.ModelProto.SentencePiece(piece=t, score=0.0, type=SP_CONTROL))
    return m.SerializeToString()


def _check_ids(ext_str: str, base_ids: dict[str, int], new_tokens: list[str], start: int, total: int) -> None:
    """The saved tokenizer, as tokenizers loads it, must keep every base id and place the new ones."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_str(ext_str)
    for t, i in base_ids.items():
        if tk.token_to_id(t) != i:
            raise RuntimeError(f"internal error: base token {t!r} would move from id {i} to {tk.token_to_id(t)}")
    for k, t in enumerate(new_tokens):
        if tk.token_to_id(t) != start + k:
            raise RuntimeError(f"internal error: new token {t!r} got id {tk.token_to_id(t)}, expected {start + k}")
    if tk.get_vocab_size(with_added_tokens=True) != total:
        raise RuntimeError(f"internal error: vocab size {tk.get_vocab_size(with_added_tokens=True)} != {total}")


def tokens_per_char(tokenizer_json: str, texts: Sequence[str]) -> float | None:
    """Tokens per character of texts with the injection-safe path (no specials added, special text plain)."""
    from tokenizers import Tokenizer

    chars = sum(len(t) for t in texts)
    if not chars:
        return None
    tk = Tokenizer.from_str(tokenizer_json)
    tk.encode_special_tokens = True
    tk.no_truncation()
    tk.no_padding()
    n = sum(len(e.ids) for e in tk.encode_batch(list(texts), add_special_tokens=False))
    return n / chars


def _special_tokens_meta(tj: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Our meta keys (unk/bos/eos/pad/im_start/im_end) for the base's special tokens that exist."""
    ids = _all_ids(tj)

    def name(v: Any) -> str | None:
        return v.get("content") if isinstance(v, dict) else v

    roles = {k: name(config.get(f"{k}_token")) for k in ("unk", "bos", "eos", "pad")}
    defaults = dict(SPECIAL_TOKENS)
    out = {}
    for key, default in defaults.items():
        tok = roles.get(key) or default
        if tok in ids:
            out[key] = {"token": tok, "id": ids[tok]}
    return out


def extend_tokenizer(base_tokenizer_dir: str, data_dir_or_files: str | Sequence[str], num_new_tokens: int,
                     output_dir: str, text_fields: Sequence[str] | str = ("text",),
                     max_train_bytes: int | None = None, seed: int = 0, min_frequency: int = 2,
                     heldout_every: int = 10, heldout_chars: int = 1_000_000, num_threads: int | None = None,
                     file_glob: str = "**/*", recursive: bool = True, strict: bool = False,
                     overwrite: bool = True) -> dict[str, Any]:
    """Extend the base tokenizer with up to ``num_new_tokens`` pieces learned on the corpus; save; return the meta."""
    t0 = time.time()
    if num_new_tokens <= 0:
        raise ValueError(f"--num_new_tokens must be positive, got {num_new_tokens}")
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
    threads = num_threads or os.cpu_count() or 1
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))

    found = collect_input_files(data_dir_or_files, file_glob, recursive, exclude_dir=output_dir)
    if not found.files:
        raise no_input_files_error(data_dir_or_files, file_glob)
    corpus = Corpus(found.files, text_fields, strict, heldout_every, heldout_chars, max_train_bytes, seed)
    if corpus.train_docs == 0:
        detail = f"; {corpus.stats.total} records were skipped: {dict(corpus.stats.counts)}, first: " \
                 f"{corpus.stats.first_locations}" if corpus.stats.total else ""
        raise CorpusError(f"no usable training documents in {len(found.files)} file(s) "
                          f"({', '.join(found.files[:3])}){detail}")

    base_ids = _all_ids(tj)
    forbidden = {t["content"] for t in tj.get("added_tokens", [])}
    if proto is not None:
        base_ids.update({p.piece: i for i, p in enumerate(proto.pieces)})
    # Learn more pieces than asked (some the base already has); grow the request while the corpus allows.
    request = num_new_tokens * 2 + 256
    for attempt in range(4):
        if kind == "sentencepiece":
            pieces = _train_sp_candidates(proto, corpus.training_documents(), request, seed, threads)
            cands: list[tuple[str, tuple[str, str] | None]] = []
            known_so_far = set(base_ids)
            for p in pieces:
                split = _splits(p, known_so_far) if len(p) > 1 else []
                cands.append((p, split[0] if split else (p[0], p[1:]) if len(p) > 1 else None))
                known_so_far.add(p)
            learned = len(pieces)
        else:
            alphabet, merges = _train_bpe_candidates(tj, corpus.training_documents(), request, min_frequency)
            # merges in learned order (each pulls in the characters it needs), then characters by frequency
            cands = [(a + b, (a, b)) for a, b in merges] + [(a, None) for a in alphabet]
            learned = len(alphabet) + len(merges)
        new_tokens = select_new_tokens(cands, base_ids, forbidden, num_new_tokens)
        if len(new_tokens) >= num_new_tokens or learned < request * 0.95:
            break  # enough, or the corpus supports no more pieces
        request *= 2
    if len(new_tokens) < num_new_tokens:
        log.warning("the corpus supports only %d new tokens (asked for %d)", len(new_tokens), num_new_tokens)
    primary = {t: m for t, m in cands if m is not None}
    ext, start, total, reserved = build_extended_json(tj, new_tokens, primary)
    ext_str = json.dumps(ext, ensure_ascii=False)
    _check_ids(ext_str, base_ids if proto is None else _all_ids(tj), new_tokens, start, total)

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
                                          "tokens_per_char_before": before, "tokens_per_char_after": after})
    if corpus.stats.total:
        log.warning("skipped %d bad records: %s (first: %s)", corpus.stats.total, dict(corpus.stats.counts),
                    "; ".join(corpus.stats.first_locations))
    return meta


def _save(base_dir: str, output_dir: str, kind: str, tj: dict[str, Any], proto: Any, ext: dict[str, Any],
          ext_str: str, new_tokens: list[str], reserved: list[str], start: int, total: int,
          training: dict[str, Any], heldout: dict[str, Any]) -> dict[str, Any]:
    # `<output_dir>.tmp/`, fsynced and renamed into place (an old output_dir is swapped aside, then
    # deleted): utils/publish.py. A failure leaves output_dir as it was.
    with staged_dir(os.path.abspath(output_dir), replace=True) as tmp:
        for name in _base_files(base_dir):
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
        meta = {
            "tokenizer_type": "extended_" + (base_meta or {}).get("tokenizer_type", kind),
            "vocab_size": total,
            "learned_vocab_size": total - len(ext.get("added_tokens", [])),  # ids that are not added/special tokens
            "special_tokens": _special_tokens_meta(ext, config),
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
    p.add_argument("--data_dir", required=True, nargs="+", action="extend",
                   help="directories, files or glob patterns (.txt, .json, .jsonl, .parquet); repeatable")
    p.add_argument("--num_new_tokens", type=int, required=True, help="how many new pieces to add (at most)")
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
                                args.recursive, args.strict, args.overwrite)
    except Exception as e:  # noqa: BLE001 - a named error's code or a bad value's (2); anything else re-raised
        code = command_exit_code(e, log)
        if code is None:
            raise
        return code
    x = meta["extension"]
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
