"""Cost of drawing Sem-ECE samples: the cached sampler against n separate `generate` calls per
question, on the same prompts, measured in one run.

The command line of calm_lightning/benchmarking/sampling.py (options, output and examples
there; `--help` lists them):

    python benchmarks/sampling.py                          # embedded SmolLM2, 8 questions x 20
    python benchmarks/sampling.py --model tiny --questions 2 --samples 4   # seconds, a smoke run
"""

from calm_lightning.benchmarking.sampling import main

if __name__ == "__main__":
    main()
