"""Cost of option-likelihood (cloze) MCQA scoring: the shared-prompt path (each question prompt
encoded once, its KV cache reused by its K options) against K separate full forwards of prompt
+ option per question (lm-eval-harness's way), on the same questions, measured in one run.

Prints the time ratio (target: >= 2x) and the largest absolute difference of the
option log-likelihoods between the two paths. Both paths batch `--batch` questions (the
separate one as batch x K full rows) and keep logits only where the options are scored.

    python benchmarks/cloze_scoring.py                         # embedded SmolLM2, demo test split
    python benchmarks/cloze_scoring.py --mcqa mmlu=/path/mmlu_test.jsonl   # local hub-schema files
    python benchmarks/cloze_scoring.py --model tiny --questions 4      # seconds, a smoke run
"""

from __future__ import annotations

import argparse
import time

MODELS = {
    "smollm2": {"name": "smollm2", "source": "embedded", "dtype": "float32"},
    "tiny": {"name": "tiny", "source": "tiny", "tiny": {"embedding_scale": 1.0}},
}


def _records(mcqa: list[str], n: int):
    """The first n MCQA records of the demo test split, or of local files in a hub schema
    (`name=path`, name one of mmlu, medmcqa, openbookqa, arc_challenge)."""
    if not mcqa:
        from calm_lightning.data.sources import EmbeddedDemoSource

        return EmbeddedDemoSource("mcqa", "test").load()[:n]
    from calm_lightning.data.mcqa import SourceSpec, read_source

    pools = []
    for item in mcqa:
        name, _, path = item.partition("=")
        pools.append(read_source(SourceSpec(name=name, hub_id=name, files=[path]))[0])
    # Interleave the sources so a small n still sees all of them.
    records = [r for group in zip(*pools, strict=False) for r in group]
    return records[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--mcqa", action="append", default=[], help="name=path, repeatable")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="questions per batch")
    parser.add_argument("--prompt", choices=("chat", "plain"), default="chat")
    parser.add_argument("--repeats", type=int, default=2, help="alternating timings per path")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    args = parser.parse_args()

    import torch

    from calm_lightning.evaluation.cloze import score_cloze, score_cloze_separate
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.loading import load_language_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_language_model(MODELS[args.model])
    tokenizer = loaded.tokenizer
    model = CalibratedLM(loaded.model.eval()).eval()
    records = _records(args.mcqa, args.questions)
    batches = [records[i : i + args.batch] for i in range(0, len(records), args.batch)]

    def run(score) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        out = [
            score(
                model,
                tokenizer,
                [r.question for r in b],
                [list(r.choices) for r in b],
                args.prompt,
            ).loglik
            for b in batches
        ]
        return time.perf_counter() - start, torch.cat(out)

    run(lambda m, t, q, c, p: score_cloze(m, t, q[:1], c[:1], p))  # warm-up
    times: dict[str, list[float]] = {"shared": [], "separate": []}
    scores = {}
    for _ in range(args.repeats):
        for name, score in (("separate", score_cloze_separate), ("shared", score_cloze)):
            seconds, scores[name] = run(score)
            times[name].append(seconds)
    shared, separate = min(times["shared"]), min(times["separate"])
    k = len(records[0].choices)
    source = ", ".join(args.mcqa) or "demo MCQA test split"
    print(
        f"model {args.model}, {len(records)} questions x {k} options from {source}, "
        f"prompt {args.prompt}, batch {args.batch}, best of {args.repeats}"
    )
    print(f"  shared prompt (KV cache reused)     {shared / len(records):8.4f} s / question")
    print(f"  {k} separate full forwards          {separate / len(records):8.4f} s / question")
    print(f"time ratio separate / shared: {separate / shared:.2f}x (target >= 2x)")
    diff = (scores["shared"] - scores["separate"]).abs().max().item()
    print(f"max abs difference of option log-likelihoods: {diff:.2e}")


if __name__ == "__main__":
    main()
