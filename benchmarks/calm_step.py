"""Cost of CALM against plain LoRA fine-tuning and against Regularization, measured in one run.

The command line of calm_lightning/benchmarking/calm_step.py (options, output and examples
there; `--help` lists them):

    python benchmarks/calm_step.py                      # embedded SmolLM2, T = 5, batch 4 x 256
    python benchmarks/calm_step.py --model tiny --inner-steps 3 --steps 2   # seconds, a smoke run
    python benchmarks/calm_step.py --model random --shape olmo2_7b --json costs.json  # a GPU
"""

from calm_lightning.benchmarking.calm_step import main

if __name__ == "__main__":
    main()
