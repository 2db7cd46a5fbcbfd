"""dataset package: readers of pretokenized data (pretrain shards, SFT, DPO), batching and mixing.

Owns reading, never writing: files come from `data_preprocess/`, and so do raw SFT / DPO records
tokenized in memory (`data_preprocess.chat_tokens.ChatTokens`, handed in by the trainer). Imports from
`data_preprocess/` only its file formats (`shard_format`, `chat_tokens`, the sample index), never a
tokenizer, a chat template or a record reader. Must never import the model, optimizer or training code
(it sits before them in the pipeline)."""
from dataset.dataset_pretrain import PretokDataset, PretokDatasetWithIndex, TokenStream
from dataset.loader import ResumableLoader
from dataset.mixture import MixtureDataset, build_pretrain_mixture, parse_data_mix

__all__ = ["PretokDataset", "PretokDatasetWithIndex", "TokenStream", "ResumableLoader",
           "MixtureDataset", "build_pretrain_mixture", "parse_data_mix"]
