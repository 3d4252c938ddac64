"""One LightningDataModule for every setting: a train source, an optional held-out source
(the upper level's unlabeled inputs) and a test source (MCQA, or open-ended QA)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import lightning as L
from torch.utils.data import DataLoader

from calm_lightning.data.collate import InstructionCollator, MCQACollator, OpenQACollator
from calm_lightning.data.prompts import OPTION_LETTERS, mcqa_user_text, openqa_user_text
from calm_lightning.data.records import InstructionRecord, MCQARecord, OpenQARecord
from calm_lightning.data.resumable import ResumableLoader
from calm_lightning.errors import ConfigError
from calm_lightning.runtime.distributed import ShardedBatchSampler

log = logging.getLogger(__name__)


def as_training_example(record: MCQARecord | InstructionRecord | OpenQARecord) -> InstructionRecord:
    """Every record trains as an instruction example: MCQA items answer with the letter the
    evaluation reads, open QA items with their first gold alias; instructions pass through."""
    if isinstance(record, InstructionRecord):
        return record
    if isinstance(record, OpenQARecord):
        return InstructionRecord(openqa_user_text(record), "", record.answers[0], id=record.id)
    return InstructionRecord(
        instruction=mcqa_user_text(record),
        input="",
        output=OPTION_LETTERS[record.answer],
        id=record.id,
    )


class CalibrationDataModule(L.LightningDataModule):
    """Loaders for a setting: `train` (+ `heldout`, combined) for fitting, `test` for scoring."""

    def __init__(
        self,
        tokenizer=None,
        train=None,
        heldout=None,
        test=None,
        batch_size: int = 4,
        heldout_batch_size: int | None = None,
        eval_batch_size: int = 16,
        max_length: int = 512,
        eval_max_length: int = 1024,
        num_workers: int = 0,
        seed: int = 0,
        mcqa_collator: Callable | None = None,
        epoch_batches: int | None = None,
    ) -> None:
        """`mcqa_collator`: how MCQA records train (and feed held-out objectives), from the
        MCQA scorer (`data_options`): None, as instruction examples answering with the option
        letter (the letter-scoring protocol), or `mcqa_collator(tokenizer, max_length)` builds
        the collator of their batches (cloze scoring: the answer text and all K options).

        `epoch_batches`: training (and held-out) batches per epoch, successive epochs reading
        on through the shuffled data (the paper budget of the bilevel methods, `budget=paper`);
        None: an epoch is one pass over the training data."""
        super().__init__()
        self.mcqa_collator = mcqa_collator
        self.tokenizer = tokenizer
        self.sources = {"train": train, "heldout": heldout, "test": test}
        self.batch_size = batch_size
        self.heldout_batch_size = heldout_batch_size or batch_size
        self.eval_batch_size = eval_batch_size
        self.max_length = max_length
        self.eval_max_length = eval_max_length
        self.num_workers = num_workers
        self.seed = seed
        self.epoch_batches = epoch_batches
        self.records: dict[str, list] = {}
        self._train_collator: InstructionCollator | None = None
        self._mcqa_train_collator = None
        self._test_collator: MCQACollator | None = None

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ConfigError("CalibrationDataModule needs a tokenizer before building loaders")
        return self.tokenizer

    def _load(self, split: str) -> list:
        if split not in self.records:
            source = self.sources[split]
            if source is None:
                raise ConfigError(f"this setting defines no '{split}' data")
            self.records[split] = source.load()
            log.info("%s split: %d records from %s", split, len(self.records[split]), source.name)
        return self.records[split]

    def load_records(self) -> dict[str, list]:
        """Read and validate every configured split now (files exist, parse, required fields
        present): the pipeline calls this before any model is loaded, so a bad data file
        fails in seconds, not after a 7B model has loaded."""
        for split, source in self.sources.items():
            if source is not None:
                self._load(split)
        self._check_test_kind()
        return self.records

    def _check_test_kind(self) -> None:
        test = self._load("test")
        if test and not isinstance(test[0], MCQARecord | OpenQARecord):
            raise ConfigError(
                "the test split must be multiple-choice (kind: mcqa) or open-ended QA "
                "(kind: openqa)"
            )

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit"):
            self._load("train")
            if self.sources["heldout"] is not None:
                self._load("heldout")
        if stage in (None, "test", "predict", "validate"):
            self._check_test_kind()

    @property
    def train_collator(self) -> InstructionCollator:
        if self._train_collator is None:
            self._train_collator = InstructionCollator(self._require_tokenizer(), self.max_length)
        return self._train_collator

    @property
    def test_collator(self) -> MCQACollator | OpenQACollator:
        """Left-padded option-scoring prompts for MCQA, prompt texts for the open-QA sampler."""
        if self._test_collator is None:
            if getattr(self.sources["test"], "kind", "mcqa") == "openqa":
                self._test_collator = OpenQACollator(self._require_tokenizer())
            else:
                self._test_collator = MCQACollator(self._require_tokenizer(), self.eval_max_length)
        return self._test_collator

    @property
    def mcqa_train_collator(self):
        """MCQA training batches in the scorer's own format (`mcqa_collator`)."""
        if self._mcqa_train_collator is None:
            self._mcqa_train_collator = self.mcqa_collator(
                self._require_tokenizer(), self.max_length
            )
        return self._mcqa_train_collator

    def _instruction_loader(
        self, split: str, batch_size: int, offset: int, shuffle: bool = True, fresh=False
    ) -> DataLoader:
        """`fresh`: a collator of its own, whose truncation counts stay out of the summary."""
        records = self._load(split)
        if self.mcqa_collator is not None and records and isinstance(records[0], MCQARecord):
            examples, collate = records, self.mcqa_train_collator
            if fresh:
                collate = self.mcqa_collator(self._require_tokenizer(), self.max_length)
        else:
            examples, collate = [as_training_example(r) for r in records], self.train_collator
            if fresh:
                collate = InstructionCollator(self._require_tokenizer(), self.max_length)
        if not shuffle:  # every example once on every process (initial-model passes, fits)
            return DataLoader(
                examples,
                batch_size=batch_size,
                collate_fn=collate,
                num_workers=self.num_workers,
            )
        # Each process takes its slice of the same global batches (runtime/distributed.py);
        # the loader's position is saved in every checkpoint (data/resumable.py).
        sampler = ShardedBatchSampler(
            len(examples),
            batch_size,
            shuffle=True,
            seed=self.seed + offset,
            drop_last=True,
            epoch_batches=self.epoch_batches,
        )
        return ResumableLoader(
            examples, batch_sampler=sampler, collate_fn=collate, num_workers=self.num_workers
        )

    def ordered_train_dataloader(self) -> DataLoader:
        """Every training example once, in file order (for passes of the initial model)."""
        return self._instruction_loader("train", self.eval_batch_size, offset=0, shuffle=False)

    def ordered_heldout_dataloader(self) -> DataLoader:
        """Every held-out example once, in file order (post-hoc fitting)."""
        return self._instruction_loader("heldout", self.eval_batch_size, offset=1, shuffle=False)

    def heldout_dataloader(self) -> DataLoader:
        """Unlabeled-use inputs for the upper level (labels are collated but never needed)."""
        return self._instruction_loader("heldout", self.heldout_batch_size, offset=1)

    def train_dataloader(self):
        train = self._instruction_loader("train", self.batch_size, offset=0)
        if self.sources["heldout"] is None:
            return train
        from lightning.pytorch.utilities import CombinedLoader

        # One held-out batch per training batch; the shorter loader cycles.
        return CombinedLoader(
            {"train": train, "heldout": self.heldout_dataloader()}, mode="max_size_cycle"
        )

    def test_dataloader(self) -> DataLoader:
        # Under DDP the processes score whole batches in turn: the very batches one process
        # would score, so the gathered predictions do not depend on the world size.
        records = self._load("test")
        sampler = ShardedBatchSampler(
            len(records), self.eval_batch_size, shuffle=False, shard="round_robin"
        )
        return DataLoader(
            records,
            batch_sampler=sampler,
            collate_fn=self.test_collator,
            num_workers=self.num_workers,
        )

    def summary(self, option_tokens: dict | None = None) -> dict:
        """Split sizes, sources and truncation counts, for the run's output dir; with a
        tokenizer and a test split, `tokenization` (what the model was fed): its BOS id, the
        share of the test prompts that start with it (as the test collator encodes them) and
        the option letters' ids as scored (`option_tokens`, the evaluation's record; None
        under cloze scoring or for open QA)."""
        out = {}
        for split, source in self.sources.items():
            if source is None:
                continue
            out[split] = dict(source.describe(), n=len(self.records.get(split, [])))
        if self._train_collator is not None:
            out["train_truncation"] = dict(self._train_collator.stats)
        if self._mcqa_train_collator is not None:
            collator = self._mcqa_train_collator
            out[collator.summary_key] = dict(collator.stats)
        if self._test_collator is not None:
            out["test_prompts_truncated"] = self._test_collator.truncated
        if self.tokenizer is not None and self.records.get("test"):
            out["tokenization"] = self.tokenization(option_tokens)
        return out

    def tokenization(self, option_tokens: dict | None = None) -> dict:
        """The `tokenization` record of `summary`."""
        bos = self.tokenizer.bos_token_id
        test = self.records["test"]
        starts = sum(self.test_collator.prompt_ids(r)[0][:1] == [bos] for r in test)
        tokens = option_tokens or {}
        # Cloze scoring records no letter ids (it scores the option texts).
        ids = dict(zip(tokens.get("letters", ""), tokens.get("ids", ()), strict=False))
        return {
            "bos_token_id": bos,
            "test_prompts_starting_with_bos": starts / len(test),
            "option_token_ids": ids or None,
        }
