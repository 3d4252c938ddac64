"""Cost of drawing Sem-ECE samples: the cached sampler (each prompt encoded once, its KV cache
repeated n times, all n answers drawn together) against n separate `generate` calls per
question, on the same prompts, measured in one run.

Prints the ratio (target: >= 5x) and, for reference, `generate` with
`num_return_sequences=n`. Every way samples at temperature 1 over the full vocabulary until
end of turn or `--max-new-tokens`; `generate` has no newline stop (it would need a stopping
criterion), so the ratio uses the cached sampler timed without its newline stop as well (the
evaluation's setting, with the stop, is printed too and is faster still).

    python benchmarks/sampling.py                          # embedded SmolLM2, 8 questions x 20
    python benchmarks/sampling.py --model tiny --questions 2 --samples 4   # seconds, a smoke run

The measurement ships with the package because the GPU acceptance check runs it
(`python -m calm_lightning check`); `benchmarks/sampling.py` is its command line in the
repository, and `python -m calm_lightning.benchmarking.sampling` the same without it.
"""

from __future__ import annotations

import argparse
import statistics
import time

QUESTIONS = [
    "What is the capital of Australia?",
    "Who wrote the novel Nineteen Eighty-Four?",
    "Which planet is known as the Red Planet?",
    "In which year did the Berlin Wall fall?",
    "What is the chemical symbol for gold?",
    "Who painted the Mona Lisa?",
    "What is the largest ocean on Earth?",
    "Which composer wrote the Moonlight Sonata?",
    "What is the tallest mountain in Africa?",
    "Which country hosted the 2016 Summer Olympics?",
    "What is the currency of Japan?",
    "Who discovered penicillin?",
]
MODELS = {
    "smollm2": {"name": "smollm2", "source": "embedded", "dtype": "float32"},
    "tiny": {"name": "tiny", "source": "tiny", "tiny": {"embedding_scale": 1.0}},
}


def _generate(lm, tokenizer, prompt: str, calls: int, per_call: int, max_new_tokens: int) -> None:
    """`calls` generate calls drawing `per_call` answers each, pure sampling at temperature 1."""
    import torch

    from calm_lightning.data.tokens import encode_prompt

    # The prompt as the cached sampler encodes it (BOS where the model takes one).
    ids = torch.tensor([encode_prompt(tokenizer, prompt)], device=lm.device)
    for _ in range(calls):
        with torch.no_grad():
            lm.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                top_k=0,
                temperature=1.0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=per_call,
                pad_token_id=tokenizer.pad_token_id,
            )


def main(argv: list[str] | None = None) -> None:
    """The benchmark's command line (`argv`: its arguments, default sys.argv[1:])."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4, help="questions per cached-sampler batch")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument(
        "--tokenizer", choices=["embedded", "bytes"], default="embedded",
        help="--model tiny: the SmolLM2 tokenizer or the built-in byte-level one",
    )  # fmt: skip
    args = parser.parse_args(argv)

    import torch

    from calm_lightning.data.prompts import render_prompt
    from calm_lightning.evaluation.sampling import sample_answers
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.loading import load_language_model

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = dict(MODELS[args.model])
    if cfg["source"] == "tiny":
        cfg["tokenizer"] = args.tokenizer
    loaded = load_language_model(cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lm, tokenizer = loaded.model.to(device).eval(), loaded.tokenizer
    model = CalibratedLM(lm).eval()
    questions = (QUESTIONS * (1 + args.questions // len(QUESTIONS)))[: args.questions]
    prompts = [render_prompt(tokenizer, f"Answer briefly. {q}") for q in questions]
    n, m = args.samples, args.max_new_tokens

    # Warm-up (first-call allocations, lazy kernels) outside the timings.
    sample_answers(model, tokenizer, prompts[:1], n=2, max_new_tokens=2)
    _generate(lm, tokenizer, prompts[0], 1, 1, 2)

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def cached(stop_on_newline: bool):
        return lambda: sample_answers(
            model,
            tokenizer,
            prompts,
            n=n,
            max_new_tokens=m,
            batch_size=args.batch,
            stop_on_newline=stop_on_newline,
        )

    per_question = {}
    per_question["cached sampler, no newline stop"] = timed(cached(False)) / len(prompts)
    per_question["cached sampler, newline stop (as evaluated)"] = timed(cached(True)) / len(prompts)
    separate = [timed(lambda p=p: _generate(lm, tokenizer, p, n, 1, m)) for p in prompts]
    per_question[f"{n} separate generate calls"] = statistics.fmean(separate)
    returning = [timed(lambda p=p: _generate(lm, tokenizer, p, 1, n, m)) for p in prompts]
    per_question[f"generate(num_return_sequences={n})"] = statistics.fmean(returning)

    print(f"model {args.model}, {len(prompts)} questions x {n} samples x {m} new tokens")
    for name, seconds in per_question.items():
        print(f"  {name:<45} {seconds:8.3f} s / question")
    base = per_question["cached sampler, no newline stop"]
    ratio = per_question[f"{n} separate generate calls"] / base
    print(f"speed-up vs {n} generate calls: {ratio:.2f}x (target >= 5x)")
    print(
        f"speed-up vs num_return_sequences: "
        f"{per_question[f'generate(num_return_sequences={n})'] / base:.2f}x"
    )


if __name__ == "__main__":
    main()
