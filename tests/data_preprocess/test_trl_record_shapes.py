"""TRL's record shapes. Its prompt-completion SFT records are the conversation they spell. Its implicit-prompt
preference records (trl-lib/ultrafeedback_binarized's shape; Anthropic hh-rlhf's as texts):
"chosen" and "rejected" each the whole conversation. They tokenize exactly as the same pairs with an explicit prompt
(the shared messages, or the shared text up to the space before the first difference, as TRL's extract_prompt cuts
it), and records that do not share a prompt this way are counted skips naming the rule."""
from __future__ import annotations

import json

import pytest

from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records
from data_preprocess.sft_format import RecordError, dpo_messages
from dataset.dataset_dpo import DPODataset

U = {"role": "user", "content": "What is 2+2?"}
A1 = {"role": "assistant", "content": "It is 4."}
U2 = {"role": "user", "content": "And 3+3?"}


def _asst(text: str) -> dict:
    return {"role": "assistant", "content": text}


IMPLICIT = [
    {"chosen": [U, _asst("4")], "rejected": [U, _asst("5")]},
    {"chosen": [U, A1, U2, _asst("6")], "rejected": [U, A1, U2, _asst("7")], "score_chosen": 8.0},
    {"chosen": "Human: hi there. Assistant: hello!", "rejected": "Human: hi there. Assistant: go away."},
]
EXPLICIT = [
    {"prompt": [U], "chosen": [_asst("4")], "rejected": [_asst("5")]},
    {"prompt": [U, A1, U2], "chosen": [_asst("6")], "rejected": [_asst("7")]},
    {"prompt": "Human: hi there. Assistant:", "chosen": " hello!", "rejected": " go away."},
]


def test_the_shared_messages_or_text_are_the_prompt():
    for imp, exp in zip(IMPLICIT, EXPLICIT):
        assert dpo_messages(imp) == dpo_messages(exp)
    assert [m["content"] for m in dpo_messages(IMPLICIT[2])[1:]] == [" hello!", " go away."]  # (TRL's space rule)
    with_system = dict(IMPLICIT[0], system="Be brief.")
    assert dpo_messages(with_system)[0] == [{"role": "system", "content": "Be brief."}, U]
    for bad, said in (({"chosen": [U, A1, _asst("x")], "rejected": [U, _asst("y")]}, "share every message but"),
                      ({"chosen": [_asst("x")], "rejected": [_asst("y")]}, "share every message but"),
                      ({"chosen": [U, U2], "rejected": [U, {"role": "user", "content": "?"}]}, "assistant reply"),
                      ({"chosen": "same", "rejected": "same"}, "share a prompt and then differ"),
                      ({"chosen": "abc", "rejected": "xyz"}, "share a prompt and then differ"),
                      ({"chosen": [U, _asst("x")], "rejected": "y"}, "implicit prompt")):
        with pytest.raises(RecordError, match=said):
            dpo_messages(bad)


def test_implicit_records_tokenize_as_explicit_ones(tmp_path, tiny_pretrain_data):
    tok = tiny_pretrain_data["tokenizer_dir"]
    for name, recs in (("implicit", IMPLICIT + [{"chosen": "abc", "rejected": "xyz"}]), ("explicit", EXPLICIT)):
        d = tmp_path / name
        d.mkdir()
        (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    imp = DPODataset(tokenize_dpo_records(str(tmp_path / "implicit"), tok, 64), 64)
    exp = DPODataset(tokenize_dpo_records(str(tmp_path / "explicit"), tok, 64), 64)
    assert len(imp) == len(exp) == 3 and imp.stats["skipped"] == {
        "implicit prompt: 'chosen' and 'rejected' must share a prompt and then differ, or give 'prompt'": 1}
    for i in range(3):
        a, b = imp[i], exp[i]
        assert a.keys() == b.keys() and all(a[k].tolist() == b[k].tolist() for k in a), i


def test_trls_prompt_completion_sft_records_are_the_conversation():
    """SFT's prompt-completion records (TRL's shape), as texts or as messages, give the conversation they spell; the
    prompt's own assistant turns are context (TRL's completion-only loss): OpenAI's `"weight": 0` on them."""
    from data_preprocess.sft_format import sft_messages
    conv = {"conversations": [U, _asst("4")]}
    assert sft_messages({"prompt": U["content"], "completion": "4"}) == sft_messages(conv)
    assert sft_messages({"prompt": [U], "completion": [_asst("4")]}) == sft_messages(conv)
    assert sft_messages({"prompt": [U, A1, U2], "completion": [_asst("6")], "system": "Be brief."}) == sft_messages(
        {"conversations": [U, dict(A1, weight=0), U2, _asst("6")], "system": "Be brief."})
    for bad, said in (({"prompt": "q", "completion": 3}, "'completion' is int"),
                      ({"prompt": "q", "completion": [{"role": "robot", "content": "x"}]}, "unknown role"),
                      ({"prompt": "q", "completion": ""}, "no non-empty assistant turn")):
        with pytest.raises(RecordError, match=said):
            sft_messages(bad)


def test_a_turns_weight_0_is_context_and_not_learned(tmp_path, tiny_pretrain_data):
    """OpenAI's fine-tuning format: an assistant turn with `"weight": 0` is tokenized as before and not learned; so
    is a TRL prompt-completion record's earlier reply. The labels are the whole conversation's with that reply's span
    (what its prefix alone learns) set to -100."""
    from data_preprocess.pretokenize_sft_data import tokenize_sft_records
    from data_preprocess.sft_format import sft_messages
    from dataset.dataset_sft import SFTDataset
    recs = [{"conversations": [U, A1, U2, _asst("6")]}, {"conversations": [U, A1]},
            {"conversations": [U, dict(A1, weight=0), U2, dict(_asst("6"), weight=1)]},
            {"prompt": [U, A1, U2], "completion": [_asst("6")]}]
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    ds = SFTDataset(tokenize_sft_records(str(tmp_path / "s"), tiny_pretrain_data["tokenizer_dir"], 64))
    (whole, prefix, weighted, trl) = [ds[i] for i in range(4)]
    n = len(prefix["labels"])
    expect = whole["labels"].clone()
    learned_first = prefix["labels"] != -100
    assert learned_first.any() and (whole["labels"][:n] == prefix["labels"]).all()
    expect[:n][learned_first] = -100
    for got in (weighted, trl):
        assert got["input_ids"].tolist() == whole["input_ids"].tolist()
        assert got["labels"].tolist() == expect.tolist()
    assert (expect != -100).sum() > 0
    for bad, said in (({"weight": 0.5}, "must be 0 or 1"), ({"weight": True}, "must be 0 or 1"),
                      ({"weight": "0"}, "must be 0 or 1")):
        with pytest.raises(RecordError, match=said):
            sft_messages({"conversations": [U, dict(A1, **bad)]})
    with pytest.raises(RecordError, match="'weight' on a user turn"):
        sft_messages({"conversations": [dict(U, weight=0), A1]})
    with pytest.raises(RecordError, match="each one has 'weight': 0"):
        sft_messages({"conversations": [U, dict(A1, weight=0)]})
