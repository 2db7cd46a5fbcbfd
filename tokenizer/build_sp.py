"""Train the ``sp_bbpe`` tokenizer: sentencepiece BPE with byte_fallback, converted to a HF fast tokenizer.

Owns: the sentencepiece trainer settings and the conversion of the trained model into a
``tokenizers.Tokenizer`` whose learned pieces take ids 0..n-1 (the 256 byte pieces first, then the
merged/character pieces in sentencepiece score order), so that the special tokens can follow them as
the contract requires.

Why a conversion: sentencepiece reserves ids 0-2 for unk/bos/eos. Here bos/eos/pad are disabled and the
mandatory ``<unk>`` (id 0, never produced thanks to byte_fallback) is dropped; every other piece keeps
its order, shifted down by one. The meta symbol U+2581 is renamed to a real space in the pieces, so a
literal U+2581 in user text is not a piece any more and round-trips exactly through byte fallback
(sentencepiece itself would decode it as a space).
Must never: let sentencepiece normalise text (identity rule, no dummy prefix, no whitespace folding),
or save the raw sentencepiece model (its ids differ from ours and would mislead users).
"""
from __future__ import annotations

import io
import logging
import re
from typing import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

log = logging.getLogger(__name__)

SP_META = "\u2581"
# Sentencepiece drops longer "sentences"; documents are cut into chunks below this many bytes.
_SP_MAX_SENTENCE_BYTES = 16384
_CHUNK_BYTES = 8000
# The sentencepiece trainer splits words before a run of whitespace (allow_whitespace_only_pieces);
# the same split here keeps pieces aligned with what was trained.
WORD_SPLIT = r" *[^ ]+| +"
_BYTE_PIECE = re.compile(r"^<0x[0-9A-F]{2}>$")


def sentence_chunks(docs: Iterable[str]) -> Iterator[str]:
    """Cut long documents at line ends (or hard, for a huge line) so sentencepiece never drops them."""
    for doc in docs:
        if len(doc) * 4 <= _CHUNK_BYTES or len(doc.encode("utf-8")) <= _CHUNK_BYTES:
            yield doc
            continue
        cur: list[str] = []
        size = 0
        for line in doc.splitlines(keepends=True):
            n = len(line.encode("utf-8"))
            if size + n > _CHUNK_BYTES and cur:
                yield "".join(cur)
                cur, size = [], 0
            while n > _CHUNK_BYTES:
                step = _CHUNK_BYTES // 4  # characters; <= _CHUNK_BYTES bytes in any encoding
                yield line[:step]
                line = line[step:]
                n = len(line.encode("utf-8"))
            cur.append(line)
            size += n
        if cur:
            yield "".join(cur)


def train_sentencepiece(docs: Iterable[str], learned_vocab_size: int, seed: int = 0, num_threads: int = 2,
                        character_coverage: float = 0.9995, verbose: bool = False) -> bytes:
    """Train and return the serialized sentencepiece model (sentencepiece keeps all input in memory).
    Its C++ log (hundreds of lines) is shown only when `verbose`."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    out = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentence_chunks(docs), model_writer=out,
            model_type="bpe",
            vocab_size=learned_vocab_size + 1,  # + the <unk> dropped in the conversion
            byte_fallback=True,
            character_coverage=character_coverage,
            normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
            split_by_whitespace=True, allow_whitespace_only_pieces=True,
            unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,
            hard_vocab_limit=False,  # a small corpus yields fewer pieces; reserved tokens fill the rest
            max_sentence_length=_SP_MAX_SENTENCE_BYTES,
            input_sentence_size=0, shuffle_input_sentence=False,  # the sample was already drawn upstream
            num_threads=max(1, num_threads),
            minloglevel=0 if verbose else 2,
        )
    except RuntimeError as e:
        raise ValueError(f"sentencepiece training failed (vocab_size too small for the corpus' characters "
                         f"plus 256 byte pieces?): {e}") from e
    return out.getvalue()


def sp_pieces(model_proto: bytes) -> list[str]:
    """The learned pieces in our id order: byte pieces, then normal pieces with U+2581 -> ' '."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    pieces: list[str] = []
    dropped = 0
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i) or sp.is_control(i):
            continue
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            pieces.append(piece)
            continue
        # A learned piece spelled like a byte piece (text "<0x41>") would be decoded as that byte.
        if _BYTE_PIECE.match(piece):
            dropped += 1
            continue
        pieces.append(piece.replace(SP_META, " "))
    if dropped:
        log.warning("dropped %d learned pieces that look like byte pieces (<0xNN>)", dropped)
    if len(set(pieces)) != len(pieces):
        raise ValueError("sentencepiece conversion produced duplicate pieces")
    return pieces


def merges_from_pieces(pieces: list[str], first_merged: int = 256) -> list[tuple[str, str]]:
    """BPE merges equivalent to sentencepiece's scores: a piece's rank is its id (= score order);
    every split into two known pieces is a merge, so whichever pair BPE sees can build it."""
    vocab = {p: i for i, p in enumerate(pieces)}
    ranked: list[tuple[int, int, int, str, str]] = []
    for merged, mid in vocab.items():
        if mid < first_merged or len(merged) < 2:
            continue
        for k in range(1, len(merged)):
            a, b = merged[:k], merged[k:]
            ia, ib = vocab.get(a), vocab.get(b)
            if ia is not None and ib is not None and ia >= first_merged and ib >= first_merged:
                ranked.append((mid, ia, ib, a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def sp_to_hf(model_proto: bytes) -> Tokenizer:
    pieces = sp_pieces(model_proto)
    vocab = {p: i for i, p in enumerate(pieces)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_pieces(pieces), byte_fallback=True,
                              unk_token=None, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(WORD_SPLIT), behavior="isolated")
    # Byte pieces back to bytes, then to text; no Replace/Strip: spaces are already real spaces.
    tk.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tk


def train_sp_bbpe(docs: Iterable[str], learned_vocab_size: int, seed: int = 0, num_threads: int = 2,
                  character_coverage: float = 0.9995, verbose: bool = False) -> Tokenizer:
    proto = train_sentencepiece(docs, learned_vocab_size, seed, num_threads, character_coverage, verbose)
    return sp_to_hf(proto)
