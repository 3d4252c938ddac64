"""Cost of CALM against plain LoRA fine-tuning and against Regularization, measured in one run.

Prints, per outer step (against the project's cost targets):
  time   = CALM outer step / (plain LoRA step x (T + 3))       target <= 1.1
  memory = CALM peak memory / plain LoRA peak memory             target <= 1.25
and per epoch, CALM epoch time / Regularization (`reg`) epoch time on the same
batches, for the per-step surrogate at T = --epoch-inner-steps (paper: 20) and for the
amortized one (a persistent surrogate, m = --amortized-steps inner steps per outer step);
target for amortized <= 3.4 (the paper's Table 10 ratio; goal 2.5), memory <= 1.25x plain.
Every outer step of a schedule costs the same on same-shaped batches, so an epoch of N
batches is composed from measured step times: reg N x step, per_step N x outer step,
amortized its first step (theta~ fitted from theta) + (N - 1) x outer step (printed for
several N; a re-synchronisation costs one forward more than a step, and is counted).

Each measurement runs in its own subprocess, so a peak is that mode's alone. Timing workers
(plain and CALM alternating, `--repeats` times, medians) run with the default allocator. On
GPU memory is the CUDA allocator's peak of live tensors. On CPU it is the peak resident set
size of a separate memory worker run with MALLOC_MMAP_THRESHOLD_=65536: with glibc's default
(dynamic) threshold, freed tensors stay in the heap, and RSS grows with the variety of
allocation sizes rather than with what is alive (CALM's many differently-shaped passes made
RSS 1.35x plain while the live peak was ~1.1x). The default-allocator peaks are printed too.

    python benchmarks/calm_step.py                      # embedded SmolLM2, T = 5, batch 4 x 256
    python benchmarks/calm_step.py --model tiny --inner-steps 3 --steps 2   # seconds, a smoke run
    python benchmarks/calm_step.py --batch 2 --seq 128 --steps 1 --repeats 1  # ~25 min on 2 cores
    python benchmarks/calm_step.py --model random --shape olmo2_7b --json costs.json  # a GPU

`--model random --shape NAME` measures a released architecture's shape with random weights
(conf/model/random.yaml; bf16 on GPU, `--quantization nf4` for QLoRA); `--json PATH` writes
every measured step time and peak, for `python -m calm_lightning.plan --costs PATH`.

The measurement ships with the package because the GPU acceptance check runs it
(`python -m calm_lightning check`); `benchmarks/calm_step.py` is its command line in the
repository, and `python -m calm_lightning.benchmarking.calm_step` the same without it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

from calm_lightning.benchmarking.step_worker import MODELS, WORKERS, model_config, worker

# Workers run this module in a fresh process, whichever script started the benchmark.
WORKER_MODULE = "calm_lightning.benchmarking.calm_step"


def _calm_defaults():
    """conf/method/calm.yaml's module node: the inner step and surrogate the runs use (read
    from the installed config package, so a wheel without the repository finds it too)."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    with (files("calm_lightning.conf") / "method" / "calm.yaml").open() as handle:
        return OmegaConf.load(handle).module


def main(argv: list[str] | None = None) -> None:
    """The benchmark's command line (`argv`: its arguments, default sys.argv[1:])."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return

    passthrough = [a for a in argv if not a.startswith("--worker")]
    run_worker = functools.partial(_run_worker, passthrough)

    import torch

    record = new_record(args, torch.cuda.is_available())
    if args.epoch_only:
        on_gpu = torch.cuda.is_available()
        mem_key = "cuda_peak_mb" if on_gpu else "peak_rss_mb"
        env = {} if on_gpu else {"MALLOC_MMAP_THRESHOLD_": "65536"}
        plain = run_worker("plain", env, steps=1)
        add_step(record, "plain", plain, plain, mem_key)
        epoch_comparison(args, run_worker, on_gpu, plain[mem_key], mem_key, record)
        finish(args, run_worker, record, mem_key)
        return
    on_gpu, memory, mem_key = step_comparison(args, run_worker, record)
    if not args.no_epoch:
        epoch_comparison(args, run_worker, on_gpu, memory["plain"][mem_key], mem_key, record)
    finish(args, run_worker, record, mem_key)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--shape", default="small", help="--model random: an architecture shape")
    parser.add_argument(
        "--tokenizer", choices=["embedded", "bytes"], default="embedded",
        help="tiny / random: the SmolLM2 tokenizer or the built-in byte-level one",
    )  # fmt: skip
    parser.add_argument("--dtype", default="auto", help="--model random: model.dtype")
    parser.add_argument("--quantization", default="none", help="--model random: none | nf4")
    parser.add_argument("--json", metavar="PATH", help="also write the measured costs here")
    parser.add_argument("--inner-steps", type=int, default=5, help="T")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per worker")
    parser.add_argument("--repeats", type=int, default=2, help="plain/CALM worker pairs")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.01, help="LoRA dropout (paper 0.01)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--epoch-inner-steps", type=int, default=20, help="T of the epoch part")
    parser.add_argument(
        "--epoch-batches", type=int, nargs="+", default=[20, 100, 1000],
        help="epoch sizes (batches) to compose epoch ratios for",
    )  # fmt: skip
    defaults = _calm_defaults()
    parser.add_argument(
        "--amortized-steps", type=int, default=defaults.surrogate.steps,
        help="m, inner steps of the persistent surrogate per outer step",
    )  # fmt: skip
    parser.add_argument("--inner-optimizer", default=defaults.inner_optimizer)
    parser.add_argument("--inner-lr", type=float, default=defaults.inner_lr, help="rho")
    parser.add_argument("--no-epoch", action="store_true", help="skip the epoch comparison")
    parser.add_argument("--epoch-only", action="store_true", help="only the epoch comparison")
    parser.add_argument("--worker", choices=WORKERS, help=argparse.SUPPRESS)
    return parser


def _run_worker(
    passthrough: list[str],
    mode: str,
    extra_env: dict | None = None,
    steps: int | None = None,
    extra_args=(),
) -> dict:
    """One measurement in its own process (so a peak is that mode's alone); its result."""
    args_ = [sys.executable, "-m", WORKER_MODULE, *passthrough, "--worker", mode, *extra_args]
    if steps is not None:
        args_ += ["--steps", str(steps)]
    env = dict(os.environ, **(extra_env or {}))
    done = subprocess.run(args_, capture_output=True, text=True, check=False, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"{mode} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def step_comparison(args, run_worker, record: dict) -> tuple[bool, dict, str]:
    """CALM's outer step against a plain LoRA step: time and memory ratios."""
    timing: dict[str, list[dict]] = {"plain": [], "calm": []}
    for repeat in range(args.repeats):
        for mode in ("plain", "calm"):
            timing[mode].append(run_worker(mode))
            print(
                f"timing {repeat + 1}/{args.repeats} {mode:5s}: "
                f"{timing[mode][-1]['step_s']:.2f} s/step",
                flush=True,
            )
    on_gpu = "cuda_peak_mb" in timing["plain"][0]
    memory = {}
    for mode in ("plain", "calm"):
        # One step is enough for the peak (the first step allocates everything there is).
        memory[mode] = (
            timing[mode][0]
            if on_gpu
            else run_worker(mode, {"MALLOC_MMAP_THRESHOLD_": "65536"}, steps=1)
        )
        peak = memory[mode].get("cuda_peak_mb") or memory[mode]["peak_rss_mb"]
        print(f"memory {mode:5s}: peak {peak:.0f} MiB", flush=True)

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in timing[mode])

    T = args.inner_steps
    plain_s, calm_s = median("plain", "step_s"), median("calm", "step_s")
    time_ratio = calm_s / (plain_s * (T + 3))
    mem_key, base_key = (
        ("cuda_peak_mb", "cuda_loaded_mb") if on_gpu else ("peak_rss_mb", "loaded_rss_mb")
    )
    plain_mem, calm_mem = memory["plain"][mem_key], memory["calm"][mem_key]
    plain_extra = plain_mem - memory["plain"][base_key]
    calm_extra = calm_mem - memory["calm"][base_key]
    print()
    print(f"model={args.model} T={T} batch={args.batch}x{args.seq} dropout={args.dropout}")
    print(f"plain LoRA step           {plain_s:8.2f} s")
    print(f"CALM outer step           {calm_s:8.2f} s  (= {calm_s / plain_s:.2f} plain steps)")
    print(f"time ratio   CALM / (plain x (T+3)) = {time_ratio:.3f}   (target <= 1.1)")
    print(f"peak memory  plain {plain_mem:.0f} MiB, CALM {calm_mem:.0f} MiB ({mem_key})")
    print(f"memory ratio CALM / plain           = {calm_mem / plain_mem:.3f}   (target <= 1.25)")
    print(
        f"  above the loaded model: plain +{plain_extra:.0f} MiB, CALM +{calm_extra:.0f} MiB "
        f"(ratio {calm_extra / max(plain_extra, 1e-9):.2f})"
    )
    if not on_gpu:
        default_plain = median("plain", "peak_rss_mb")
        default_calm = median("calm", "peak_rss_mb")
        print(
            f"  default glibc allocator (freed heap kept): plain {default_plain:.0f} MiB, "
            f"CALM {default_calm:.0f} MiB (ratio {default_calm / default_plain:.3f})"
        )
    add_step(record, "plain", {"step_s": plain_s}, memory["plain"], mem_key)
    add_step(record, "calm", {"step_s": calm_s}, memory["calm"], mem_key, schedule="per_step",
             inner_steps=T)  # fmt: skip
    record["ratios"].update(time=time_ratio, memory=calm_mem / plain_mem)
    return on_gpu, memory, mem_key


def new_record(args, on_gpu: bool) -> dict:
    """What the json of --json says about the machine and the measured configuration."""
    import platform

    import torch

    from calm_lightning.models.shapes import SHAPES, parameter_count

    cfg = model_config(args)
    shape = SHAPES.get(cfg.get("shape"))
    return {
        "benchmark": "benchmarks/calm_step.py",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if on_gpu else f"cpu ({platform.machine()})",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": cfg,
        "shape_parameters": parameter_count(shape) if shape else None,
        "batch": args.batch,
        "seq": args.seq,
        "lora": {"r": 64, "lora_alpha": 32, "lora_dropout": args.dropout},
        "memory": "CUDA allocator peak" if on_gpu else "peak RSS (returning allocator)",
        "steps": {},
        "ratios": {},
    }


def add_step(record: dict, name: str, timed: dict, measured: dict, mem_key: str, **what) -> None:
    """One measured step: its median time, its peak memory and the loaded model's memory."""
    base_key = "cuda_loaded_mb" if mem_key == "cuda_peak_mb" else "loaded_rss_mb"
    record["steps"][name] = {
        "step_s": timed["step_s"],
        "peak_mb": measured[mem_key],
        "loaded_mb": measured[base_key],
        **{k: measured[k] for k in ("first_s", "parameters", "trainable", "dtype", "quantized")
           if k in measured},
        **{k: timed[k] for k in ("first_s", "resyncs") if k in timed},
        **what,
    }  # fmt: skip


def finish(args, run_worker, record: dict, mem_key: str) -> None:
    """With --json: time an evaluation forward too, then write the record."""
    if not args.json:
        return
    forward = run_worker("forward")
    add_step(record, "forward", forward, forward, mem_key)
    print(f"eval forward              {forward['step_s']:8.2f} s (no grad, the same batch shape)")
    with open(args.json, "w") as handle:
        json.dump(record, handle, indent=2)
    print(f"wrote {args.json}")


def epoch_comparison(
    args, run_worker, on_gpu: bool, plain_mem: float, mem_key: str, record: dict
) -> None:
    """CALM epoch / Regularization epoch on the same batches, both schedules."""
    T = args.epoch_inner_steps
    runs = {}
    for mode in ("reg", "per_step", "amortized"):
        runs[mode] = run_worker(mode)
        print(f"epoch timing {mode:9s}: {runs[mode]['step_s']:.2f} s/step", flush=True)
    reg_s, per_step_s = runs["reg"]["step_s"], runs["per_step"]["step_s"]
    between_s, first_s = runs["amortized"]["step_s"], runs["amortized"]["first_s"]
    peaks = {}
    for mode in ("reg", "per_step", "amortized"):
        # CPU: memory workers at T <= 3. Neither schedule's peak grows with T (every inner step
        # makes fresh tensors and frees the last; a refresh holds T - 1 token-id batches).
        env = {"MALLOC_MMAP_THRESHOLD_": "65536"}
        small_t = ["--epoch-inner-steps", str(min(T, 3))]
        measured = runs[mode] if on_gpu else run_worker(mode, env, steps=1, extra_args=small_t)
        peaks[mode] = measured[mem_key]
    print()
    print(f"epoch comparison, T={T}, batch={args.batch}x{args.seq}, same batches for every mode")
    print(f"reg step                  {reg_s:8.2f} s")
    print(f"per_step outer step       {per_step_s:8.2f} s  (= {per_step_s / reg_s:.2f} reg steps)")
    m = args.amortized_steps
    print(
        f"amortized outer step      {between_s:8.2f} s  (= {between_s / reg_s:.2f} reg steps; "
        f"m = {m}, {runs['amortized']['resyncs']} re-syncs in {args.steps + 1} steps)"
    )
    print(f"amortized first step      {first_s:8.2f} s  (= {first_s / reg_s:.2f} reg steps)")
    for n in args.epoch_batches:
        amortized = (first_s + (n - 1) * between_s) / (n * reg_s)
        print(
            f"epoch ratio vs reg, N={n:5d} batches: per_step ratio {per_step_s / reg_s:6.2f}   "
            f"amortized ratio {amortized:5.2f}   (target amortized <= 3.4, goal 2.5)"
        )
    print(f"epoch ratio vs reg, N -> inf:          amortized ratio {between_s / reg_s:5.2f}")
    add_step(record, "reg", runs["reg"], {**runs["reg"], mem_key: peaks["reg"]}, mem_key)
    add_step(record, "per_step", runs["per_step"], {**runs["per_step"], mem_key: peaks["per_step"]},
             mem_key, schedule="per_step", inner_steps=T)  # fmt: skip
    add_step(record, "amortized", runs["amortized"],
             {**runs["amortized"], mem_key: peaks["amortized"]}, mem_key, schedule="amortized",
             surrogate_steps=m)  # fmt: skip
    record["ratios"]["amortized_epoch_vs_reg"] = between_s / reg_s
    record["ratios"]["per_step_epoch_vs_reg"] = per_step_s / reg_s
    for mode in ("reg", "per_step", "amortized"):
        print(
            f"peak memory {mode:9s} {peaks[mode]:.0f} MiB = {peaks[mode] / plain_mem:.3f} x plain "
            f"(target <= 1.25)"
        )


if __name__ == "__main__":
    main()
