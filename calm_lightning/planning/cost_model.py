"""What one job costs on a named GPU, from the model's shape and the work its method does.

Time is FLOPs / (the device's dense bf16 peak x a utilisation); memory is the sum of what sits
on the device at the busiest moment of a training step. Every constant below is an assumption
stated with its reason; a cost file measured on a GPU (`benchmarks/calm_step.py --json`)
replaces the assumed utilisation with the measured one (`calibrate`).

FLOPs per token. A matmul with a weight of n entries costs 2n per token forward. LoRA trains
adapters only, so the frozen base needs no weight gradient: its backward is the activation
gradient alone, 2n per token, and a training pass through the base is 4 N (not the 6 N of full
fine-tuning). The adapters (P entries) cost 2P forward and 4P backward (activation and weight
gradients). Attention scores add 2 x layers x seq x query width per token forward (causal: half
of the square), twice that backward. Gradient checkpointing recomputes the forward once more.
N counts the output head (2 x hidden x vocabulary per token, large for 100k-262k vocabularies)
but not the input embedding, which is a lookup.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

from calm_lightning.errors import ConfigError
from calm_lightning.models.model_node import (  # noqa: F401  (the planner's names for them)
    MODEL_SHAPES,
    model_shape,
)
from calm_lightning.models.shapes import Shape, parameter_count


@dataclass(frozen=True)
class Device:
    """A GPU: dense bf16 peak (no sparsity) and memory bandwidth from its datasheet; its memory
    as its label says it (`memory_gb`: the A100's "40GB" is about what nvidia-smi lists in GiB)
    and as CUDA reports it to a process (`usable_gib`), which fits are judged against."""

    label: str
    peak_tflops: float
    memory_gb: float
    bandwidth_tbs: float
    usable_gib: float

    @property
    def memory_gib(self) -> float:
        """The memory fits are judged against: `usable_gib` (its name before there were two)."""
        return self.usable_gib


# usable_gib: total memory as torch.cuda.get_device_properties(i).total_memory (= CUDA's
# cudaDeviceProp.totalGlobalMem) reports it, in GiB: what the driver leaves to processes,
# less than the label's figure read as GiB and than nvidia-smi's memory.total (40960 MiB on an
# A100 40GB: modal-labs/modal-client PR #2797). Looked up in public logs
# (no GPU here), the lowest reading where drivers differ:
#   A100 40GB: deviceQuery "40339 MBytes (42298834944 bytes)" (bottlerocket-os/bottlerocket
#     PR #3873) = 39.39 GiB; Paddle's device properties read 40536MB (39.59 GiB) elsewhere.
#   A100 80GB: torch's OOM message "GPU 0 has a total capacity of 79.15 GiB" on cards
#     nvidia-smi lists as 81920MiB; deviceQuery 81251 MBytes (79.35 GiB) elsewhere.
#   H100 80GB HBM3: torch's _CudaDeviceProperties total_memory=81082MB to 81090MB (MiB) =
#     79.18-79.19 GiB; nvidia-smi 81559MiB (vllm-project/vllm issue #27508).
#   H200: torch total_memory=143156MB = 139.80 GiB, and OOM messages "total capacity of
#     139.80 GiB"; nvidia-smi 143771MiB (results/gpu_check/README.md).
# A job's peak (peak_bytes, inference_peak_bytes) already includes CUDA_CONTEXT_GIB for the
# context, cuBLAS workspace and allocator slack, which come out of this total: a job fits when
# its peak <= usable_gib, with nothing subtracted a second time.
DEVICES = {
    "a100_40g": Device("NVIDIA A100 40GB (SXM)", 312.0, 40.0, 1.555, 39.39),
    "a100_80g": Device("NVIDIA A100 80GB (SXM)", 312.0, 80.0, 2.039, 79.15),
    "h100": Device("NVIDIA H100 80GB (SXM)", 989.0, 80.0, 3.35, 79.18),
    "h200": Device("NVIDIA H200 141GB (SXM)", 989.0, 141.0, 4.8, 139.80),
}
DEFAULT_DEVICE = "a100_40g"  # the paper's GPU (Table 10), when no GPU is visible here

# Share of the bf16 peak a step reaches end to end. nf4 QLoRA: bitsandbytes dequantises every
# weight matrix to bf16 before each matmul (forward and backward), and the step also runs the
# norms, RoPE, dropout and an fp32 loss over the vocabulary in unfused eager kernels; published
# HF + bitsandbytes QLoRA runs of 7B models sit around a third of peak. bf16 LoRA skips the
# dequantisation. Assumptions, not measurements: a GPU cost file replaces them.
UTILISATION = {"nf4": 0.35, "bf16": 0.45}
# Sampling decodes one token per step: it reads every weight once per step, so it is bound by
# memory bandwidth, of which eager HF generation reaches about half.
DECODE_BANDWIDTH_SHARE = 0.5

# Bytes per parameter. nf4 with double quantisation: 4 bits plus an 8-bit absmax per 64 weights
# plus an fp32 constant per 256 absmax. peft's prepare_model_for_kbit_training casts what is not
# quantised (embeddings, output head, norms) to fp32. LoRA parameters are fp32 with an fp32
# gradient and AdamW's two fp32 moments: 16 bytes each.
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
BF16_BYTES = 2
FP32_BYTES = 4
TRAINABLE_BYTES = 16
# CALM's surrogate: a copy of the adapters with its own gradient and two Adam moments
# (docs/calm.md, cost accounting): another 16 bytes per adapter parameter.
SURROGATE_BYTES = 16
# Logits, per vocabulary entry, as the code materialises them (logit_bytes).
# Training: CalibratedLM.raw_logits (models/calibrated_lm.py) keeps every position
# (logits_to_keep=0) in the compute dtype, bf16 under the GPU's bf16-mixed autocast (2 bytes);
# the objective selects its rows from it (every response position: select_response_logits in
# data/collate.py, through methods/objectives.py and methods/single_level.py; the answer slot
# of letter-format MCQA: answer_slot_rows in evaluation/mcqa.py, through the scorer's
# training_logits) and `adjust` casts them to fp32 (4 bytes), kept with their log-softmax (4)
# and its gradient (4): 12 bytes per selected row. The full bf16 tensor is freed once selected;
# the backward scatters the selection's gradient into zeros of the sliced and then of the full
# shape (two full-size bf16 tensors for a moment, beside the fp32 copy).
FULL_LOGIT_BYTES = 2
SELECTED_LOGIT_BYTES = 12
# Evaluation keeps the last position only (logits_to_keep=1): letter scoring (evaluation/mcqa.py
# score_options, option_probabilities), the logit lens of the post-hoc reference methods
# (models/logit_lens.py) and the sampler's prefill (evaluation/sampling.py); per row the bf16
# logits, their fp32 copy and the softmax: 10 bytes. Cloze scoring keeps each option's tokens
# (evaluation/cloze.py, logits_to_keep = option width + 1): the plan charges it every position.
KEPT_LOGIT_BYTES = 10
CUDA_CONTEXT_GIB = 1.0  # CUDA context, cuBLAS workspace and allocator slack

# CALM paper, Table 10: one 7-8B model on one A100 40G, a complete run at 5 epochs.
PAPER_TABLE10 = {
    "reg": ("~35 min", 35 * 60, 20),
    "ls": ("~10 min", 10 * 60, 20),
    "iterate": ("~5 min", 5 * 60, 20),
    "calm": ("~2 h", 2 * 3600, 38),
    "ts": ("<1 min", 60, 15),
}


def default_device() -> str:
    """The local GPU's entry when `nvidia-smi` lists one we know, else the paper's A100 40G.

    Asked of nvidia-smi rather than torch, so that a plan never imports torch (seconds of
    start-up, and a CUDA context the plan has no use for). The first GPU the job may use:
    CUDA_VISIBLE_DEVICES' first index when it names one, else the first listed."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    command = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    if visible.isdigit():
        command += ["--id", visible]
    try:
        listed = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
        name, memory_mib = listed.stdout.splitlines()[0].rsplit(",", 1)
        return _known_gpu(name.strip().lower(), float(memory_mib) / 1024) or DEFAULT_DEVICE
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return DEFAULT_DEVICE  # no driver, no GPU, or output we cannot read: the default


def _known_gpu(name: str, memory_gib: float) -> str | None:
    """The DEVICES entry of a GPU by its (lower-case) name and memory, None if not listed."""
    for key in ("h200", "h100"):
        if key in name:
            return key
    if "a100" in name:
        return "a100_80g" if memory_gib > 60 else "a100_40g"
    return None


def get_device(name: str) -> Device:
    if name not in DEVICES:
        raise ConfigError(f"--device {name}: choose one of {', '.join(DEVICES)}")
    return DEVICES[name]


def matmul_parameters(shape: Shape) -> int:
    """Weights a token multiplies through: everything but the input embedding lookup."""
    untied = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    return parameter_count(shape) - untied


def lora_parameters(shape: Shape, r: int) -> int:
    """LoRA parameters on every linear layer but the head (peft's all-linear): r x (in + out)
    for q, k, v, o, gate, up and down."""
    h, i = shape.hidden_size, shape.intermediate_size
    q = shape.num_heads * shape.attention_head_dim
    kv = shape.num_kv_heads * shape.attention_head_dim
    return shape.num_layers * r * (7 * h + 2 * q + 2 * kv + 3 * i)


def _attention_flops(shape: Shape, seq: int) -> float:
    return 2 * shape.num_layers * seq * shape.num_heads * shape.attention_head_dim


def forward_flops(shape: Shape, seq: int, lora: int = 0) -> float:
    """FLOPs of one forward, per token, at sequence length `seq`."""
    return 2 * matmul_parameters(shape) + _attention_flops(shape, seq) + 2 * lora


def training_pass_flops(shape: Shape, seq: int, lora: int, checkpointing: bool) -> float:
    """FLOPs of one LoRA forward + backward, per token (frozen base: 4N, see the module doc)."""
    backward = 2 * matmul_parameters(shape) + 2 * _attention_flops(shape, seq) + 4 * lora
    forwards = 2 if checkpointing else 1
    return forwards * forward_flops(shape, seq, lora) + backward


def activation_bytes(shape: Shape, checkpointing: bool) -> float:
    """Bytes a training pass keeps per token for its backward (bf16 compute).

    Per layer, without checkpointing: the dropped-out input each adapter saves for its weight
    gradient (peft applies one dropout per adapted module: 5h + q + I entries, bf16, plus a
    1-byte mask each), what attention saves (q, k, v and its output: 2q + 2kv), the MLP's gate,
    up and activation outputs (3I) and the down input (I), and two RMSNorms that save an fp32
    copy of their input and of its normalised value (16h bytes). With checkpointing only each
    layer's input (2h bytes) is kept, and one layer's set while it is recomputed."""
    h, i = shape.hidden_size, shape.intermediate_size
    q = shape.num_heads * shape.attention_head_dim
    kv = shape.num_kv_heads * shape.attention_head_dim
    dropped = 5 * h + q + i
    layer = 2 * (dropped + 2 * q + 2 * kv + 4 * i) + dropped + 16 * h
    if checkpointing:
        return shape.num_layers * 2 * h + layer
    return shape.num_layers * layer


def weight_bytes(shape: Shape, quantized: bool) -> float:
    """The base model's weights on the device: nf4 layers and fp32 embeddings / head, or bf16."""
    total = parameter_count(shape)
    if not quantized:
        return BF16_BYTES * total
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return NF4_BYTES * (total - embeddings) + FP32_BYTES * embeddings


def utilisation(quantized: bool, measured: float | None = None) -> float:
    return measured if measured is not None else UTILISATION["nf4" if quantized else "bf16"]


def seconds(flops: float, device: Device, share: float) -> float:
    return flops / (device.peak_tflops * 1e12 * share)


def decode_seconds(shape: Shape, quantized: bool, steps: int, batch: int, device: Device,
                   share: float) -> float:  # fmt: skip
    """Sampling `steps` decode steps of `batch` sequences: the slower of reading the weights
    once per step and the matmuls of `batch` tokens."""
    read = weight_bytes(shape, quantized) / (device.bandwidth_tbs * 1e12 * DECODE_BANDWIDTH_SHARE)
    compute = seconds(batch * forward_flops(shape, 0), device, share)
    return steps * max(read, compute)


def gib(n_bytes: float) -> float:
    return n_bytes / 2**30


def training_logit_bytes(shape: Shape, tokens: int, selected: int) -> float:
    """Logit bytes at the busiest moment of a training pass over `tokens` positions of which the
    objective reads `selected` (see FULL_LOGIT_BYTES): the fp32 rows with their log-softmax and
    gradient (12 per row), or the fp32 copy beside the backward's two full-width bf16 tensors
    (2 x 2 per position + 4 per row), whichever is more."""
    full = 2 * FULL_LOGIT_BYTES * tokens + FP32_BYTES * selected
    return shape.vocab_size * max(SELECTED_LOGIT_BYTES * selected, full)


def peak_bytes(shape: Shape, quantized: bool, tokens: int, lora: int, checkpointing: bool,
               surrogate: bool, selected: int | None = None) -> float:  # fmt: skip
    """Peak device memory of a training step over `tokens` tokens (batch x length), of which the
    objective reads `selected` rows of logits (None: every position)."""
    total = weight_bytes(shape, quantized) + TRAINABLE_BYTES * lora
    total += SURROGATE_BYTES * lora if surrogate else 0
    total += tokens * activation_bytes(shape, checkpointing)
    total += training_logit_bytes(shape, tokens, tokens if selected is None else selected)
    return total + CUDA_CONTEXT_GIB * 2**30


def inference_peak_bytes(shapes: list[tuple[Shape, bool]], tokens: int, kept: int) -> float:
    """Peak of an evaluation batch of `tokens` tokens: the models' weights, one layer's
    transient tensors (the residual stream, its normed copy, q and the attention output in
    bf16: 8h bytes per token, and the MLP's intermediate: 2I) and the `kept` positions' logits
    of the widest vocabulary (the batch's rows when only the last is kept: KEPT_LOGIT_BYTES)."""
    total = sum(weight_bytes(s, q) for s, q in shapes)
    widest = max((s for s, _ in shapes), key=lambda s: s.hidden_size)
    total += tokens * (8 * widest.hidden_size + 2 * widest.intermediate_size)
    total += kept * KEPT_LOGIT_BYTES * max(s.vocab_size for s, _ in shapes)
    return total + CUDA_CONTEXT_GIB * 2**30


def usable_gib(name: str) -> float:
    """The memory a job's peak must fit on the named GPU: its total as CUDA reports it, in GiB
    (the CUDA context is part of every peak, not subtracted here)."""
    return get_device(name).usable_gib


def check_order(costs: dict) -> None:
    """Refuse a cost file whose phases are out of order: reg is plain's pass plus an entropy
    term, and a CALM outer step does several passes, so plain <= reg <= every CALM step. A file
    that says otherwise was measured under load (or is broken) and would mislead the plan."""
    steps = costs.get("steps", {})
    seconds_of = {name: s["step_s"] for name, s in steps.items() if "step_s" in s}
    wrong = []
    if "plain" in seconds_of and "reg" in seconds_of and seconds_of["plain"] > seconds_of["reg"]:
        wrong.append(
            f"plain ({seconds_of['plain']:.3g} s) is slower than reg ({seconds_of['reg']:.3g} s)"
        )
    for calm in ("calm", "per_step", "amortized"):
        if calm in seconds_of and "reg" in seconds_of and seconds_of[calm] < seconds_of["reg"]:
            wrong.append(
                f"{calm} ({seconds_of[calm]:.3g} s) is faster than reg ({seconds_of['reg']:.3g} s)"
            )
    if wrong:
        raise ConfigError(
            "the cost file's phases are out of order: " + "; ".join(wrong) + ". A plain LoRA "
            "step cannot be slower than reg (the same pass plus an entropy term), nor a CALM "
            "step faster than reg; measure again on an idle device."
        )


def device_of(costs: dict) -> str | None:
    """The DEVICES entry a cost file was measured on, None for a CPU or an unknown GPU."""
    text = str(costs.get("device", "")).lower()
    return _known_gpu(text, 80 if "80g" in text else 40)


def calibrate(costs: dict) -> dict:
    """The utilisation a GPU cost file measured: the model's FLOPs of its reg step (and of its
    evaluation forward) over the measured seconds, as a share of its device's peak."""
    check_order(costs)
    name = device_of(costs)
    if name is None:
        raise ConfigError(
            f"the cost file was measured on {costs.get('device')!r}, not on a GPU of "
            f"{', '.join(DEVICES)}: its utilisation says nothing about a GPU"
        )
    shape = model_shape(costs.get("model", {}))
    steps = costs.get("steps", {})
    if shape is None or "reg" not in steps:
        raise ConfigError("the cost file has no model shape or no reg step to calibrate from")
    reg, seq, tokens = steps["reg"], int(costs["seq"]), int(costs["batch"]) * int(costs["seq"])
    lora = int(reg.get("trainable", 0))
    peak = DEVICES[name].peak_tflops * 1e12
    out = {"device": name, "file_device": costs.get("device")}
    flops = tokens * training_pass_flops(shape, seq, lora, checkpointing=False)
    out["train"] = flops / reg["step_s"] / peak
    if "forward" in steps:
        out["eval"] = tokens * forward_flops(shape, seq, lora) / steps["forward"]["step_s"] / peak
    return out
