"""`python -m data_preprocess.verify --data_dir=DIR`: re-check every token shard of a directory, whole.

What loading checks cheaply (each .bin's size against its sidecar, the sidecar's recorded largest id against
the vocabulary) misses bits that flipped inside the range of valid ids, and what the trainer checks per sample
(every id it reads below the vocabulary) comes only when that sample is drawn. This reads every shard in full:
its sha256 against the one its sidecar recorded when it was written, every id against the vocabulary, and the
document offsets. One line per problem, naming the file (and the offset of a bad id); exit 0 when every shard
is sound, 3 when one is not (or the directory is not a set of shards), 2 for bad flags.

Owns: nothing of the format (data_preprocess/shard_format.py does); it only reads.
Must never: write or repair a shard (re-run the pretokenizer for that).
"""
from __future__ import annotations

import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    from data_preprocess.shard_format import DataError, list_shards, verify_shard
    from utils.cli import Parser
    from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA, EXIT_OK
    ap = Parser(prog="python -m data_preprocess.verify",
                description="Re-check every token shard of --data_dir in full: sha256 against its sidecar, every "
                            "id against the vocabulary, the document offsets.",
                epilog="exit 0: every shard is sound; 3: a damaged shard (each problem one line naming the file) "
                       "or no shards; 2: bad flags. Shards written before checksums were recorded have none to "
                       "compare: their ids and offsets are still checked.")
    ap.add_argument("--data_dir", required=True, help="folder of <stem>_<k:05d>.bin/.json shards")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return EXIT_OK if e.code == 0 else EXIT_BAD_CONFIG
    try:
        shards = list_shards(args.data_dir)
    except DataError as e:
        print(f"verify: error: {e}", file=sys.stderr)
        return EXIT_BAD_DATA
    bad = 0
    unchecked = 0
    for info in shards:
        problems = verify_shard(info)
        unchecked += "sha256" not in info.sidecar
        for p in problems:
            print(f"verify: error: {p}", file=sys.stderr)
        bad += bool(problems)
    tokens = sum(s.num_tokens for s in shards)
    note = f"; {unchecked} without a recorded sha256 (written by an older version)" if unchecked else ""
    print(f"verify: {len(shards) - bad} of {len(shards)} shard(s) sound, {tokens} tokens, vocab "
          f"{shards[0].vocab_size}{note}", flush=True)
    return EXIT_BAD_DATA if bad else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
