"""Shared fixtures: offline environment, config composition, the override lists several test
modules use, and the tiny model. Test modules request these as fixture arguments and never
import from each other or from this file (tests/test_layout.py checks)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

# Nothing in the test suite may reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose as hydra_compose  # noqa: E402
from hydra import initialize_config_module  # noqa: E402

import calm_lightning.runtime.resolvers  # noqa: E402, F401  (registers resolvers)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


HUB = Path(__file__).parent / "fixtures" / "hub"  # local files in each hub dataset's schema
SIZES = {"train": 4, "calibration": 2, "test": 4, "ood_test": 4}
MCQA_FILES = {
    name: str(HUB / f"{name}.jsonl") for name in ("mmlu", "medmcqa", "openbookqa", "arc_challenge")
}


def _compose_run(overrides: list[str] | None = None, output_dir=None, hydra: bool = False):
    """Compose the primary config like `python -m calm_lightning.run` would (`hydra`: with the
    `hydra` node: launcher, sweeper, run mode)."""
    overrides = list(overrides or [])
    if output_dir is not None:
        overrides.append(f"paths.output_dir={output_dir}")
    with initialize_config_module("calm_lightning.conf", version_base="1.3"):
        return hydra_compose("run", overrides=overrides, return_hydra_config=hydra)


@pytest.fixture(scope="session")
def compose():
    """`compose(overrides, output_dir=None, hydra=False)`: the primary config like `python -m
    calm_lightning.run` would compose it, with `paths.output_dir` set when given and the
    `hydra` node when asked."""
    return _compose_run


@pytest.fixture
def ood_overrides() -> list[str]:
    """setting=ood on the local hub-schema files: 8 / 3 / 2 Alpaca items, 4 MCQA test items."""
    return [
        "setting=ood",
        f"setting.train.files=[{HUB / 'alpaca.jsonl'}]",
        "setting.train.train_size=8",
        "setting.train.heldout_size=3",
        "setting.train.test_size=2",
        *[f"setting.test.sources.{n}.files=[{p}]" for n, p in MCQA_FILES.items()],
        *[f"setting.test.sizes.{k}={v}" for k, v in SIZES.items()],
        "setting.batch_size=2",
        "setting.heldout_batch_size=2",
        "setting.eval_batch_size=4",
        "setting.max_length=128",
    ]


@pytest.fixture
def resume_overrides() -> list[str]:
    """A tiny CALM run of 2 epochs x 2 batches that trains visibly (a large head LR): what the
    kill-and-resume tests interrupt after its first epoch."""
    return [
        "model=tiny",
        "method=calm",
        "peft.r=4",
        "setting.test.limit=8",
        "trainer.limit_train_batches=2",
        "trainer.max_epochs=2",
        "method.module.inner_steps=1",
        "method.module.upper_lr=0.05",
        "evaluation.compare_with_base=false",
        "trainer.enable_progress_bar=false",
        "logger=none",
    ]


@pytest.fixture
def id_overrides() -> list[str]:
    """setting=id on the local hub-schema MCQA files: 4 train, 2 calibration, 4 test items."""
    return [
        "setting=id",
        *[f"setting.train.sources.{n}.files=[{p}]" for n, p in MCQA_FILES.items()],
        *[f"setting.train.sizes.{k}={v}" for k, v in SIZES.items()],
        "setting.batch_size=2",
        "setting.heldout_batch_size=2",
        "setting.eval_batch_size=4",
        "setting.max_length=256",
    ]


@pytest.fixture
def gen_overrides() -> list[str]:
    """setting=gen_ood on the local PopQA / TriviaQA files, 3 items per part."""
    return [
        "setting=gen_ood",
        f"setting.train.files=[{HUB / 'popqa.jsonl'}]",
        "setting.train.eval_size=3",
        "setting.train.heldout_size=3",
        f"setting.test.files=[{HUB / 'triviaqa.jsonl'}]",
        "setting.test.eval_size=3",
        "setting.test.heldout_size=3",
        "setting.batch_size=2",
        "setting.heldout_batch_size=2",
    ]


def _gen_ood(*extra: str) -> list[str]:
    return [
        "model=tiny",
        "model.tiny.embedding_scale=1.0",  # near-uniform tiny model: varied, non-empty samples
        "peft.r=4",
        "trainer.enable_progress_bar=false",
        "setting=gen_ood",
        f"setting.train.files=[{HUB / 'popqa.jsonl'}]",
        "setting.train.eval_size=3",
        "setting.train.heldout_size=3",
        f"setting.test.files=[{HUB / 'triviaqa.jsonl'}]",
        "setting.test.eval_size=4",
        "setting.test.heldout_size=3",
        "setting.batch_size=2",
        "setting.heldout_batch_size=2",
        "setting.eval_batch_size=3",
        "evaluation.openqa.n_samples=6",
        "evaluation.openqa.max_new_tokens=4",
        *extra,
    ]


@pytest.fixture(scope="session")
def gen_ood():
    """`gen_ood(*extra)`: overrides for a small open-QA run of the tiny model (setting=gen_ood
    on the local files, 4 test questions, 6 samples of up to 4 tokens), then `extra`."""
    return _gen_ood


@pytest.fixture(scope="session")
def tiny_loaded():
    """The tiny random Llama with the embedded tokenizer (built once per session)."""
    from calm_lightning.models.loading import load_language_model

    cfg = _compose_run(["model=tiny", "paths.output_dir=/tmp/unused"])
    return load_language_model(cfg.model)


@pytest.fixture
def tiny_calm_stop(tiny_loaded):
    """tiny_calm_stop(cls=CALM, **options): a CALM module (or subclass) of the tiny model with
    rank-4 LoRA, a log-scalar head and calm_stop's switches at test-sized LRs; `options`
    change or add constructor arguments."""
    import copy

    from calm_lightning.methods.calm import CALM
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.logit_adjustment import LogitAdjustment
    from calm_lightning.models.lora import wrap_with_lora

    def build(cls=CALM, **options):
        lm = wrap_with_lora(copy.deepcopy(tiny_loaded.model), {"r": 4, "lora_alpha": 8})
        head = LogitAdjustment(
            lm.get_output_embeddings().weight.shape[0], kind="scalar", parameterization="log"
        )
        switches = dict(
            inner_steps=2, lower_lr=1e-2, upper_lr=0.3, warmup_ratio=0.0,
            inner_optimizer="adam", surrogate={"schedule": "amortized", "steps": 1},
            variant={"value_function": "joint", "lambda_blocks": "per_block",
                     "head_step": "sign"},
        )  # fmt: skip
        return cls(CalibratedLM(lm, head), tiny_loaded.tokenizer, **{**switches, **options})

    return build


# The one tiny CALM run export and retention tests read (built once per session): two outer
# steps that move the adapters and the head measurably, and retention on two local tasks.
TINY_CALM_RETENTION_TASKS = ("piqa", "winogrande")
TINY_CALM = [
    "model=tiny",
    "method=calm",
    "setting=demo",
    "setting.test.limit=8",
    "peft.r=4",
    "trainer.limit_train_batches=2",
    "trainer.enable_progress_bar=false",
    "logger=none",
    "method.module.inner_steps=1",
    "method.module.lower_lr=0.01",  # adapters that move the option scores measurably
    "method.module.upper_lr=0.5",  # and a head that does too
    f"evaluation.retention.tasks=[{','.join(TINY_CALM_RETENTION_TASKS)}]",
    *[
        f"evaluation.retention.data_files.{t}=[{HUB / f'{t}.jsonl'}]"
        for t in TINY_CALM_RETENTION_TASKS
    ],
    "evaluation.retention.limit=4",
]


@pytest.fixture(scope="session")
def tiny_calm_run(tmp_path_factory) -> Path:
    """A finished tiny CALM run folder (8 demo test questions, retention rows for piqa and
    winogrande); tests read it and write only below their own tmp_path."""
    from calm_lightning.pipeline import run_experiment

    run_dir = tmp_path_factory.mktemp("tiny_calm_run")
    run_experiment(_compose_run(TINY_CALM, run_dir))
    return run_dir


@pytest.fixture(scope="session")
def tokenizer(tiny_loaded):
    return tiny_loaded.tokenizer


@pytest.fixture
def demo_datamodule():
    """datamodule(tokenizer): batches of 2 from 8 demo instructions (train and held-out) and 8
    demo MCQA test questions, sequences <= 96 tokens."""
    from calm_lightning.data.datamodule import CalibrationDataModule
    from calm_lightning.data.sources import EmbeddedDemoSource

    def build(tokenizer):
        return CalibrationDataModule(
            tokenizer,
            train=EmbeddedDemoSource("instruction", "train", limit=8),
            heldout=EmbeddedDemoSource("instruction", "heldout", limit=8),
            test=EmbeddedDemoSource("mcqa", "test", limit=8),
            batch_size=2,
            max_length=96,
        )

    return build


@pytest.fixture
def fit_on_demo(demo_datamodule, tokenizer, tmp_path):
    """fit(module, steps=1) -> trainer: a CPU Lightning fit of `steps` batches of
    `demo_datamodule`, no logger, no checkpoints."""
    import lightning as L

    def fit(module, steps: int = 1):
        trainer = L.Trainer(
            max_epochs=1, limit_train_batches=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
            accelerator="cpu",
        )  # fmt: skip
        trainer.fit(module, datamodule=demo_datamodule(tokenizer))
        return trainer

    return fit


# ----- a real SentencePiece tokenizer (Zephyr's) and a tiny Mistral around it -----
# Zephyr-7B-beta's chat template, the `chat_template` of HuggingFaceH4/zephyr-7b-beta's
# tokenizer_config.json on the Hub: every turn `<|role|>\n{content}</s>\n`, the generation
# prompt `<|assistant|>\n`, and no BOS written.
ZEPHYR_TEMPLATE = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n"
    "{{ '<|assistant|>' }}\n"
    "{% endif %}\n"
    "{% endfor %}"
)


def _sentencepiece_file() -> Path:
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or spec.origin is None:
        pytest.skip("mistral-common (the dev extra) is not installed")
    return Path(spec.origin).parent / "data" / "tokenizer.model.v1"


@pytest.fixture(scope="session")
def zephyr(tmp_path_factory):
    """The Mistral v1 tokenizer as Zephyr ships it: BOS added by default, no EOS, legacy
    SentencePiece spaces, Zephyr's template, `</s>` as padding (as the loader sets it)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("mistral-v1")
    shutil.copy(_sentencepiece_file(), folder / "tokenizer.model")
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "legacy": True}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_eos_token": False}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = ZEPHYR_TEMPLATE
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _tiny_mistral(vocab_size: int):
    """A 2-layer, 64-wide random MistralForCausalLM over `vocab_size` tokens."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return MistralForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_mistral():
    """tiny_mistral(vocab_size): a 2-layer random MistralForCausalLM (seeded)."""
    return _tiny_mistral


@pytest.fixture(scope="session")
def tiny_mistral_folder(zephyr, tmp_path_factory) -> Path:
    """A tiny random MistralForCausalLM with the Mistral v1 vocabulary, saved with Zephyr's
    tokenizer: what `model=mistral model.local_path=<folder>` loads."""
    folder = tmp_path_factory.mktemp("tiny-mistral") / "zephyr-shaped"
    _tiny_mistral(len(zephyr)).save_pretrained(folder)
    zephyr.save_pretrained(folder)
    return folder
