"""Learning the pieces an extension adds (tokenizer/extend_tokenizer.py): the corpus as a training stream with a
held-out slice that training never sees (`Corpus`), candidate pieces trained on it in the base's own kind (BPE
merges, or a sentencepiece model), and the first `n` of them the base lacks (`select_new_tokens`). Never changes
the base.
"""
from __future__ import annotations

import io
import json
import random
import re
from collections import Counter
from typing import Any, Container, Iterator, Sequence

from tokenizer.corpus import SkipCounter
from tokenizer.documents import iter_file_documents, parse_text_fields

from tokenizer.extend_base import uses_byte_level

_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
# sentencepiece ModelProto.SentencePiece.Type
SP_NORMAL, SP_CONTROL = 1, 3


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


def train_bpe_candidates(tj: dict[str, Any], docs: Iterator[str], vocab_size: int,
                          min_frequency: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Train HF BPE with the base's normalizer and pre-tokenizer (so pieces live in the base's string space).
    Returns (alphabet, merges in learned order)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    sub = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "normalizer": tj.get("normalizer"), "pre_tokenizer": tj.get("pre_tokenizer"),
           "post_processor": None, "decoder": None, "model": json.loads(tk.to_str())["model"]}
    tk = Tokenizer.from_str(json.dumps(sub))
    byte_level = uses_byte_level(tj)
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


def train_sp_candidates(proto: Any, docs: Iterator[str], vocab_size: int, seed: int,
                         threads: int) -> list[str]:
    """Train a sentencepiece BPE model with the base's text settings; its normal pieces in score order."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    from tokenizer.build_sp import sentence_chunks

    ns, ts = proto.normalizer_spec, proto.trainer_spec
    docs_list = None  # sentencepiece keeps every sentence in memory anyway; a retry needs them again
    for attempt in range(2):
        spm.set_random_generator_seed(seed)
        out = io.BytesIO()
        source = sentence_chunks(docs) if docs_list is None else iter(docs_list)
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


def two_piece_splits(token: str, known: Container[str]) -> list[tuple[str, str]]:
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
        if len(chosen) < n and two_piece_splits(tok, known):
            take(tok)
    return chosen
