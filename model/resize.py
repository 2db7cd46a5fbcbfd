"""Grow a model's vocabulary to an extended tokenizer (continued pretraining on a new language).

    info = resize_to_tokenizer(model, base_tokenizer_dir, tokenizer_dir)   # in place

The extended tokenizer must keep every id of the base tokenizer (the one the model was trained with)
with the same string; its new ids follow. Each new row of `embed_tokens` (and of `lm_head`) is the
mean of the base rows of the pieces the BASE tokenizer splits the new token's string into; a new
token without pieces (special or reserved padding tokens) gets the mean of all base rows. Old rows
are never touched, so the model's outputs on base-vocabulary text do not change.

Owns: the compatibility check (`check_base_ids`), the piece map (`new_token_pieces`), the pure row
computation (`grow_rows`) and the in-place resize of our Transformer (`resize_token_embeddings`).
Must never: resize silently when the tokenizers disagree (raises VocabMismatch), change an old row,
draw random numbers (the result is a pure function of the base weights and the two tokenizers, which
light LoRA checkpoints rely on to rebuild the base), or download anything.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch
from torch import nn

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class VocabMismatch(ValueError):
    """The tokenizer is not an extension of the model's vocabulary."""


def has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def load_any_tokenizer(path: str):
    """AutoTokenizer (no remote code); our tokenizer_meta.json, when present, is checked against it."""
    from tokenizer import load_tokenizer
    return load_tokenizer(path)


def check_base_ids(base_tok: Any, new_tok: Any, model_vocab: int) -> int:
    """Raise VocabMismatch unless every base id below the model's vocabulary has the same string in
    `new_tok`. Returns the number of ids compared."""
    n = min(len(base_tok), model_vocab)
    if len(new_tok) < n:
        raise VocabMismatch(f"the tokenizer has {len(new_tok)} tokens, fewer than the model's vocabulary "
                            f"({n} tokens of its own tokenizer): it is not an extension of the model's tokenizer")
    ids = list(range(n))
    old, new = base_tok.convert_ids_to_tokens(ids), new_tok.convert_ids_to_tokens(ids)
    for i, (a, b) in enumerate(zip(old, new)):
        if a != b:
            raise VocabMismatch(f"token id {i} is {b!r} in the tokenizer but {a!r} in the model's own tokenizer: "
                                "an extended tokenizer must keep every base id with its string")
    return n


def new_token_pieces(base_tok: Any, new_tok: Any, model_vocab: int) -> list[list[int]]:
    """For each id in [model_vocab, len(new_tok)): the base ids its string splits into ([] = none).

    A piece of the extended vocabulary is split by the base tokenizer's own model (BPE on the
    byte-level or sentencepiece-style string), so pieces that are only part of a UTF-8 character split
    too. Added tokens: specials (and reserved padding) have no pieces; other added words are encoded
    as text. Base specials never count as pieces, and only ids the model has rows for do.
    """
    added = getattr(new_tok, "added_tokens_decoder", {}) or {}
    backend = getattr(base_tok, "backend_tokenizer", None)
    skip = set(getattr(base_tok, "all_special_ids", []) or [])
    out: list[list[int]] = []
    for i in range(model_vocab, len(new_tok)):
        if i in added:
            at = added[i]
            ids = [] if at.special else base_tok.encode(at.content, add_special_tokens=False)
        else:
            s = new_tok.convert_ids_to_tokens(i)
            if backend is not None:
                ids = [t.id for t in backend.model.tokenize(s)]
            else:
                ids = base_tok.encode(new_tok.convert_tokens_to_string([s]), add_special_tokens=False)
        out.append([j for j in ids if 0 <= j < model_vocab and j not in skip])
    return out


def grow_rows(weight: torch.Tensor, pieces: Sequence[Sequence[int]]) -> torch.Tensor:
    """[V, d] -> [V + len(pieces), d]: old rows copied, new row k = mean of weight[pieces[k]] (or of
    all V rows when pieces[k] is empty), computed in float64 and cast to the weight's dtype."""
    w = weight.detach()
    w64 = w.to(torch.float64)
    mean_all = w64.mean(dim=0)
    rows = [w64[list(p)].mean(dim=0) if len(p) else mean_all for p in pieces]
    if not rows:
        return w.clone()
    return torch.cat([w, torch.stack(rows).to(w.dtype)], dim=0)


def resize_token_embeddings(model: nn.Module, pieces: Sequence[Sequence[int]]) -> nn.Module:
    """Grow `model.embed_tokens` and `model.lm_head` (our Transformer; a reward model's score head stays) in place by
    len(pieces) rows, keeping requires_grad and weight tying; updates model.cfg.vocab_size."""
    if not pieces:
        return model
    emb = model.embed_tokens
    tied = model.lm_head.weight is emb.weight
    score = bool(getattr(model.cfg, "num_labels", 0))  # a reward model's score head has no vocabulary rows
    with torch.no_grad():
        new_emb = nn.Parameter(grow_rows(emb.weight, pieces), requires_grad=emb.weight.requires_grad)
        new_head = None if tied or score else nn.Parameter(grow_rows(model.lm_head.weight, pieces),
                                                           requires_grad=model.lm_head.weight.requires_grad)
    emb.weight = new_emb
    emb.num_embeddings = new_emb.shape[0]
    if not score:
        model.lm_head.weight = new_emb if tied else new_head
        model.lm_head.out_features = new_emb.shape[0]
    model.cfg.vocab_size = new_emb.shape[0]
    return model


def resize_to_tokenizer(model: nn.Module, base_tokenizer_dir: str, tokenizer_dir: str) -> dict:
    """Check `tokenizer_dir` against the model's own tokenizer (in `base_tokenizer_dir`) and grow the
    model to it. Returns {"old_vocab", "new_vocab", "from_pieces", "mean_of_all"} (counts of new rows).

    Raises VocabMismatch for a tokenizer that is not an extension, or when the vocabulary must grow
    and `base_tokenizer_dir` holds no tokenizer to split the new tokens with.
    """
    model_vocab = int(model.cfg.vocab_size)
    try:
        new_tok = load_any_tokenizer(tokenizer_dir)
    except (OSError, ValueError, ImportError) as e:
        raise VocabMismatch(f"cannot load the tokenizer in {tokenizer_dir} ({' '.join(str(e).split())})") from e
    if not has_tokenizer(base_tokenizer_dir):
        if len(new_tok) > model_vocab:
            raise VocabMismatch(f"the tokenizer has {len(new_tok)} tokens, more than the model's {model_vocab}, and "
                                f"{base_tokenizer_dir} holds no tokenizer files (tokenizer.json or tokenizer.model) "
                                "to check the base ids and split the new tokens with")
        return {"old_vocab": model_vocab, "new_vocab": model_vocab, "from_pieces": 0, "mean_of_all": 0,
                "checked": 0}
    try:
        base_tok = load_any_tokenizer(base_tokenizer_dir)
    except (OSError, ValueError, ImportError) as e:
        if len(new_tok) > model_vocab:
            raise VocabMismatch(f"cannot load the model's own tokenizer in {base_tokenizer_dir} to check the base "
                                f"ids and split the new tokens with ({' '.join(str(e).split())})") from e
        return {"old_vocab": model_vocab, "new_vocab": model_vocab, "from_pieces": 0, "mean_of_all": 0,
                "checked": 0}  # nothing to grow: an unreadable base tokenizer is not this run's problem
    checked = check_base_ids(base_tok, new_tok, model_vocab)
    pieces = new_token_pieces(base_tok, new_tok, model_vocab) if len(new_tok) > model_vocab else []
    resize_token_embeddings(model, pieces)
    return {"old_vocab": model_vocab, "new_vocab": int(model.cfg.vocab_size),
            "from_pieces": sum(1 for p in pieces if p), "mean_of_all": sum(1 for p in pieces if not p),
            "checked": checked}
