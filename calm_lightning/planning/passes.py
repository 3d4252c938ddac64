"""One planned job's GPU time and peak memory: how many passes of which kind its method makes
(read from the method code, docs/calm.md "Cost accounting"), priced by `cost_model`.

A training batch is padded to its longest row, so a step's compute follows the expected
longest of `batch` rows. For Alpaca (the paper's OOD and open-QA training data) that is
measured (EXPECTED_WIDTH: real Alpaca rows rendered by the training collator, SmolLM2
tokenizer; benchmarks/padded_width.py, results/padded_width_alpaca.json): 240 tokens for 16
rows, not the 512 of `setting.max_length`. Other training data are priced at `max_length`, an
upper bound, and so are evaluation prompts at `setting.eval_max_length` (MCQA prompts are
short; a part of the job that is small anyway). Peak memory is priced at `max_length`: over a
whole epoch some batch reaches the cap (1 of the 2,000 measured rows does).
"""

from __future__ import annotations

from types import SimpleNamespace

from calm_lightning.method_traits import MethodTraits
from calm_lightning.planning import cost_model as cm

# Mean longest row of a random batch of Alpaca rows (batch size -> tokens, max_length 512),
# measured by benchmarks/padded_width.py on 2,000 real rows (results/padded_width_alpaca.json).
EXPECTED_WIDTH = {"AlpacaSource": {4: 169.7, 8: 203.9, 16: 239.7, 32: 277.4}}


def batch_width(job, batch: int) -> tuple[float, str]:
    """(tokens per row a training batch of `batch` rows is padded to, how it is known)."""
    table = EXPECTED_WIDTH.get(job.train_source or "")
    if not table:
        return float(job.max_length), "max_length (upper bound)"
    nearest = min(table, key=lambda size: abs(size - batch))
    return min(table[nearest], float(job.max_length)), "measured Alpaca width"


def step_passes(job) -> tuple[float, float, float]:
    """(training passes on a training batch, on a held-out batch, forwards on a training batch)
    of one training step, outer step for CALM.

    per_step CALM: T full passes (the first shares grad g with the outer gradient), one no-grad
    forward at theta~ with a backward through the head only, and the entropy pass on a held-out
    batch: T + 1 passes + 1 forward (the literal algorithm's T + 3 shares two of its passes).
    amortized: the pass at theta, m passes at the persistent theta~ and the entropy pass.
    Iterate: a plain LoRA pass, and every `lower_steps` steps an upper step's forward on a
    held-out batch (its backward runs through the head only). A single-level loss whose entropy
    reads a held-out batch (`reg` with entropy_on: heldout) adds that batch's pass."""
    if job.traits.bilevel:
        if job.schedule == "amortized":
            return 1 + (job.surrogate_steps or 1), 1, 0
        return job.inner_steps or 1, 1, 1
    if job.traits.training == "alternating":
        return 1, 0, 1 / max(job.lower_steps, 1)
    return 1, int(job.entropy_heldout), 0


def _train(job, shape, device, share) -> tuple[float, float]:
    """(seconds of one training step, its FLOPs)."""
    lora = cm.lora_parameters(shape, job.lora_r)
    seq, held_seq = batch_width(job, job.batch)[0], batch_width(job, job.heldout_batch)[0]
    train, heldout, forwards = step_passes(job)
    tokens, held_tokens = job.batch * seq, job.heldout_batch * held_seq
    flops = train * tokens * cm.training_pass_flops(shape, seq, lora, job.checkpointing)
    flops += (
        heldout * held_tokens * cm.training_pass_flops(shape, held_seq, lora, job.checkpointing)
    )
    flops += forwards * tokens * cm.forward_flops(shape, seq, lora)
    return cm.seconds(flops, device, share), flops


def _evaluation(job, shape, device, share) -> float:
    """Seconds of the job's forwards and sampling outside its training steps. A training job
    that compares with the base model scores it too, unless an earlier job of its sweep did
    and it reads that row from the base cache (`base_read_from`, plan.price)."""
    fwd = cm.forward_flops(shape, job.eval_max_length, cm.lora_parameters(shape, job.lora_r))
    scores_base = job.compare_with_base and job.train_steps
    passes = 2 if scores_base and getattr(job, "base_read_from", None) is None else 1
    rows = (job.eval_rows or 0) * passes + (job.heldout_rows or 0) * job.traits.heldout_forward
    total = cm.seconds(rows * job.eval_max_length * fwd, device, share)
    if job.heldout_scored:  # evaluation/heldout_pass.py: the held-out split once, calibrated
        width = job.eval_max_length if job.mcqa_heldout else job.max_length
        held_fwd = cm.forward_flops(shape, width, cm.lora_parameters(shape, job.lora_r))
        total += cm.seconds((job.heldout_rows or 0) * width * held_fwd, device, share)
    if job.traits.forward_first and job.train_steps:
        train_fwd = cm.forward_flops(shape, job.max_length)
        total += cm.seconds((job.train_rows or 0) * job.max_length * train_fwd, device, share)
    if job.sampling:  # open QA Sem-ECE: n samples of up to max_new_tokens per question
        samples, new_tokens = job.sampling
        total += (
            passes
            * (job.eval_rows or 0)
            * cm.decode_seconds(shape, job.quantized, new_tokens, samples, device, share)
        )
    if job.reference_shape is not None and not job.train_steps:
        # Post-hoc reference methods: the PLM's forward (and its logit-lens readout, one head
        # projection per layer at the answer position) over the held-out and test rows.
        ref = job.reference_shape
        lens_rows = (job.heldout_rows or 0) + (job.eval_rows or 0)
        ref_fwd = cm.forward_flops(ref, job.eval_max_length) * job.eval_max_length
        lens = 2 * ref.num_layers * ref.hidden_size * ref.vocab_size
        total += cm.seconds(lens_rows * (ref_fwd + lens), device, share)
    return total


def estimate(job, device_name: str, measured: dict | None = None) -> dict:
    """Seconds per step, GPU-hours and peak GiB of one job on `device_name` against its usable
    GiB (`fits`), with the basis."""
    device = cm.get_device(device_name)
    shape = job.shape
    if shape is None:
        return {"basis": f"no shape for model {job.model} (cost_model.MODEL_SHAPES)"}
    measured = measured or {}
    share = cm.utilisation(job.quantized, measured.get("train"))
    eval_share = cm.utilisation(job.quantized, measured.get("eval", measured.get("train")))
    out = {"step_s": 0.0, "train_s": 0.0, "utilisation": share}
    if job.train_steps:
        out["step_s"], out["step_flops"] = _train(job, shape, device, share)
        out["train_s"] = job.train_steps * out["step_s"]
    out["eval_s"] = _evaluation(job, shape, device, eval_share)
    out["total_s"] = out["train_s"] + out["eval_s"]
    out["gpu_hours"] = out["total_s"] / 3600
    out["peak_gib"] = cm.gib(_peak(job, shape, job.checkpointing))
    if job.train_steps and out["peak_gib"] > device.usable_gib and not job.checkpointing:
        out["checkpointed_peak_gib"] = cm.gib(_peak(job, shape, True))
    elif job.train_steps and job.checkpointing:  # what turning it off would buy, if it fits
        peak = cm.gib(_peak(job, shape, False))
        if peak <= device.usable_gib:
            unchecked = SimpleNamespace(**{**vars(job), "checkpointing": False})
            out["uncheckpointed"] = {
                "peak_gib": peak,
                "step_s": _train(unchecked, shape, device, share)[0],
            }
    # usable: what CUDA reports for the device; the peak holds the CUDA context already
    out["usable_gib"] = device.usable_gib
    out["fits"] = out["peak_gib"] <= device.usable_gib
    source = "measured" if "train" in measured else "assumed"
    width, known = batch_width(job, job.batch)
    tokens = (
        f"{job.batch} x {width:.0f} tokens per training batch ({known})"
        if job.train_steps
        else f"evaluation prompts at eval_max_length {job.eval_max_length} (upper bound)"
    )
    out["basis"] = f"{source} utilisation {share:.0%} of {device.peak_tflops:g} TFLOP/s, {tokens}"
    return out


# Rows of logits a letter-format MCQA training example has the objective read: the answer
# slot, and for the answer's cross-entropy its response tokens (the letter and the chat
# template's end-of-turn marker: a handful of tokens; 8 is a bound, not a measurement).
MCQA_RESPONSE_ROWS = 8


def selected_rows(job, batch: int) -> int:
    """Logit rows a training batch's objective reads (cost_model.FULL_LOGIT_BYTES): a few per
    MCQA example (its answer), every position of instruction data (Alpaca, PopQA: every
    response token; at the max_length peak all positions, an upper bound)."""
    if job.mcqa_training:
        return batch * MCQA_RESPONSE_ROWS
    return batch * job.max_length


def _peak(job, shape, checkpointing: bool) -> float:
    if not job.train_steps:
        models = [(shape, job.quantized)]
        if job.reference_shape is not None:
            models.append((job.reference_shape, job.reference_quantized))
        kept = job.eval_batch * job.eval_kept_positions
        return cm.inference_peak_bytes(models, job.eval_batch * job.eval_max_length, kept)
    lora = cm.lora_parameters(shape, job.lora_r)
    batch = max(job.batch, job.heldout_batch)
    return cm.peak_bytes(shape, job.quantized, batch * job.max_length, lora, checkpointing,
                         job.traits.bilevel, selected_rows(job, batch))  # fmt: skip


def calm_ratios(costs: dict) -> list[str]:
    """Each CALM step of a cost file against its reg step, measured and by the pass count
    (`step_passes`): a check of the pass model wherever a GPU has measured both."""
    steps, lines = costs.get("steps", {}), []
    shape = cm.model_shape(costs.get("model", {}))
    if shape is None or "reg" not in steps:
        return lines
    seq, lora = int(costs["seq"]), int(steps["reg"].get("trainable", 0))
    forward_share = cm.forward_flops(shape, seq, lora) / cm.training_pass_flops(
        shape, seq, lora, False
    )
    for name in ("calm", "per_step", "amortized"):
        if name not in steps:
            continue
        step = steps[name]
        job = SimpleNamespace(
            traits=MethodTraits("bilevel"), schedule=step.get("schedule", "per_step"),
            inner_steps=step.get("inner_steps"), surrogate_steps=step.get("surrogate_steps"),
        )  # fmt: skip
        train, heldout, forwards = step_passes(job)
        model = train + heldout + forwards * forward_share
        measured = step["step_s"] / steps["reg"]["step_s"]
        lines.append(f"{name}: {measured:.1f} reg steps measured, {model:.1f} by the pass count")
    return lines


def paper_comparison(job, estimate_: dict) -> str | None:
    """The paper's Table 10 figure for this method, beside this job's estimate."""
    key = job.traits.paper_cost_row
    if key not in cm.PAPER_TABLE10 or "gpu_hours" not in estimate_:
        return None
    text, paper_s, paper_gb = cm.PAPER_TABLE10[key]
    line = f"paper Table 10 (A100 40G, 7-8B, in-domain, 5 epochs): {text}, ~{paper_gb} GB"
    if job.train_steps:
        line += (
            f"; this job: {job.train_steps} steps, {_minutes(estimate_['train_s'])} of "
            f"training ({estimate_['train_s'] / paper_s:.1f}x), "
            f"{estimate_['peak_gib']:.0f} GiB"
        )
    return line


def _minutes(seconds: float) -> str:
    """A duration as Table 10 writes it: minutes under two hours, else hours."""
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
