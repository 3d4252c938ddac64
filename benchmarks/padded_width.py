r"""How wide a training batch really is: rows are padded to the batch's longest row, so the
compute of a step follows the expected longest of `batch` rows, not `setting.max_length`.

Reads instruction data in Alpaca's schema (json / jsonl: `instruction`, `input`, `output`),
renders each row as the training collator does (chat template, prompt cut from the left at
`--max-length`), and prints the mean and 99th percentile of the longest row of random batches.
The plan's cost model (calm_lightning/planning/passes.py: EXPECTED_WIDTH) holds the figures this
printed on real Alpaca rows with the embedded SmolLM2 tokenizer; rerun it to update them:

    python benchmarks/padded_width.py --files alpaca_train.jsonl \
        --json results/padded_width_alpaca.json

The tokenizer is the embedded SmolLM2-135M-Instruct's (a 49k-token BPE); other models'
tokenizers give counts of the same order on English text.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from calm_lightning.data.collate import InstructionCollator
from calm_lightning.data.records import InstructionRecord


def row_lengths(files: list[str], max_length: int) -> list[int]:
    """Token count of every row as the training collator builds it."""
    from transformers import AutoTokenizer

    from calm_lightning.models.embedded import ensure_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tokenizer()))
    collator = InstructionCollator(tokenizer, max_length=max_length)
    lengths = []
    for name in files:
        with open(name, encoding="utf-8") as handle:
            text = handle.read()
        rows = json.loads(text) if name.endswith(".json") else map(json.loads, text.splitlines())
        for row in rows:
            record = InstructionRecord(row["instruction"], row.get("input", ""), row["output"])
            lengths.append(len(collator.encode(record)[0]))
    return lengths


def widths(lengths: list[int], batch: int, draws: int, seed: int) -> dict:
    """Mean and 99th percentile of the longest of `batch` rows drawn without replacement."""
    rng = random.Random(seed)
    longest = sorted(max(rng.sample(lengths, batch)) for _ in range(draws))
    return {"mean": round(statistics.mean(longest), 1), "p99": longest[int(0.99 * draws)]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", required=True, help="Alpaca-schema json / jsonl")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    lengths = row_lengths(args.files, args.max_length)
    result = {
        "rows": len(lengths),
        "max_length": args.max_length,
        "row_tokens": {
            "mean": round(statistics.mean(lengths), 1),
            "median": statistics.median(lengths),
            "at_max_length": sum(n >= args.max_length for n in lengths),
        },
        "padded_width": {
            str(b): widths(lengths, b, args.draws, args.seed) for b in args.batch_sizes
        },
        "tokenizer": "SmolLM2-135M-Instruct (embedded)",
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
