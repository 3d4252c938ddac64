"""One measurement of the CALM step benchmark (calm_step.py) in this process (`--worker
MODE`): a mode's step times on fixed batches (plain LoRA, reg, CALM per_step or amortized, or
an evaluation forward), its peak memory and the model's size. calm_step.py runs each in its own
process."""

from __future__ import annotations

import os
import resource
import statistics
import time

MODELS = {
    "smollm2": {
        "name": "smollm2",
        "source": "embedded",
        "dtype": "float32",
        "quantization": "none",
    },
    "tiny": {"name": "tiny", "source": "tiny", "tiny": {"embedding_scale": 30.0}},
    # conf/model/random.yaml's node; --shape, --tokenizer, --dtype, --quantization fill it in.
    "random": {"source": "tiny", "tiny": {"seed": 0, "embedding_scale": 1.0}},
}


def model_config(args) -> dict:
    """The model node the workers load: MODELS[--model], with --tokenizer for the random-weight
    models and --shape, --dtype, --quantization for model=random."""
    cfg = dict(MODELS[args.model])
    if cfg["source"] == "tiny":
        cfg["tokenizer"] = args.tokenizer
    if args.model == "random":
        cfg.update(
            name="random",
            shape=args.shape,
            dtype=args.dtype,
            quantization=args.quantization,
        )
    return cfg


WORKERS = ["plain", "calm", "reg", "per_step", "amortized", "forward"]


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        pages = int(handle.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _batch(tokenizer, batch: int, seq: int, seed: int) -> dict:
    """Fixed-shape batch: random tokens, the second half of each row is the response."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, len(tokenizer) - 100, (batch, seq), generator=generator)
    labels = ids.clone()
    labels[:, : seq // 2] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def worker(args) -> dict:
    """One worker process's measurement (`--worker MODE`): the mode's step times on the same
    batches as every other mode's, its peak memory and the model's size."""
    import torch

    epoch_mode = args.worker in ("per_step", "amortized")
    T = args.epoch_inner_steps if epoch_mode else args.inner_steps
    amortized = args.worker == "amortized"
    module, lm, loaded, device = _worker_module(args, T, amortized)

    def on_device(seed: int) -> dict:
        return {
            k: v.to(device) for k, v in _batch(loaded.tokenizer, args.batch, args.seq, seed).items()
        }

    # The same sequence of distinct batches for every mode; the held-out batch is fixed.
    batches = [on_device(2 + i) for i in range(max(T, args.steps + 2))]
    train, heldout = batches[0], on_device(1)
    names, theta = module._theta()
    baseline = _rss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    times, extra = _timed_steps(
        args, module, lm, loaded, batches, train, heldout, theta, device, epoch_mode, amortized
    )
    result = {
        "mode": args.worker,
        "step_s": statistics.median(times[1:]),  # the first step pays one-off allocation
        "peak_rss_mb": _peak_rss_mb(),
        "loaded_rss_mb": baseline,
        "parameters": sum(p.numel() for p in lm.parameters()),
        "trainable": sum(p.numel() for p in lm.parameters() if p.requires_grad),
        "quantized": loaded.quantized,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        **extra,
    }
    if device.type == "cuda":
        result["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        result["cuda_loaded_mb"] = cuda_base / 2**20
    return result


def _worker_module(args, T: int, amortized: bool):
    """The model with LoRA adapters and a head, wrapped in the CALM module the modes time."""
    import torch

    from calm_lightning.methods.calm import CALM
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.loading import load_language_model
    from calm_lightning.models.logit_adjustment import LogitAdjustment
    from calm_lightning.models.lora import wrap_with_lora

    torch.manual_seed(0)
    loaded = load_language_model(model_config(args))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lora = {"r": 64, "lora_alpha": 32, "lora_dropout": args.dropout}
    lm = wrap_with_lora(loaded.model, lora, quantized=loaded.quantized)
    if not loaded.quantized:  # 4-bit weights are placed on their GPU when loaded
        lm = lm.to(device)
    lm.train()
    head = LogitAdjustment(lm.get_output_embeddings().weight.shape[0]).to(device)
    surrogate = {"schedule": "amortized" if amortized else "per_step"}
    if amortized:
        surrogate["steps"] = args.amortized_steps
    module = CALM(
        CalibratedLM(lm, head), loaded.tokenizer, inner_steps=T, surrogate=surrogate,
        inner_optimizer=args.inner_optimizer, inner_lr=args.inner_lr,
    )  # fmt: skip
    module.upper_objective = "vocab"
    return module, lm, loaded, device


def _timed_steps(
    args, module, lm, loaded, batches, train, heldout, theta, device, epoch_mode, amortized
) -> tuple[list[float], dict]:
    """`--steps` + 1 timed steps of the worker's mode, and what else the mode reports."""
    import torch

    from calm_lightning.methods.objectives import cross_entropy, select_response_logits
    from calm_lightning.methods.single_level import Regularization
    from calm_lightning.models.calibrated_lm import CalibratedLM

    times = []
    extra: dict = {}

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    if args.worker == "forward":
        # An evaluation pass: no-grad forward of the batch, last position's logits only.
        with torch.no_grad():
            for i in range(args.steps + 1):
                times.append(
                    timed(
                        lambda i=i: module.model.raw_logits(
                            batches[i]["input_ids"], batches[i]["attention_mask"]
                        )
                    )
                )
    elif args.worker in ("plain", "reg"):
        optimizer = torch.optim.AdamW(theta, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.02)
        reg = Regularization(CalibratedLM(lm, None), loaded.tokenizer, alpha_reg=1e-5)

        def plain_step(batch):
            if args.worker == "reg":  # CE - alpha_reg * entropy of the same logits, one pass
                loss, _ = reg.loss(batch)
            else:
                raw = module.model.raw_logits(batch["input_ids"], batch["attention_mask"])
                selected, targets = select_response_logits(raw, batch["labels"])
                loss = cross_entropy(selected, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for i in range(args.steps + 1):
            times.append(
                timed(lambda i=i: plain_step(batches[i] if args.worker == "reg" else train))
            )
    else:
        opt_theta = torch.optim.AdamW(theta, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.02)
        opt_alpha = torch.optim.AdamW(module._alpha(), lr=1e-5, betas=(0.9, 0.95))

        def outer(batch):
            module.bilevel_update(batch, heldout, opt_theta, opt_alpha)

        for i in range(args.steps + 1):
            times.append(timed(lambda i=i: outer(batches[i] if epoch_mode else train)))
        if amortized:
            # Step 0 fitted theta~ from theta; its time includes the one-off allocations of a
            # first step, so its cost is slightly overstated.
            extra["first_s"] = times[0]
            extra["resyncs"] = module.persistent.resyncs
    return times, extra
