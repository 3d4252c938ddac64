"""One-off check: llama.cpp's own converter on an exported folder, read back.

    python tools/check_gguf_export.py <export folder> <llama.cpp checkout>

runs `<llama.cpp>/convert_hf_to_gguf.py` (with that checkout's gguf-py) on the folder, writes
an f32 GGUF to a scratch folder, loads it with transformers' GGUF reader and prints the
largest difference of next-token probabilities against the folder loaded by transformers, and
which output tensors the GGUF holds. A folded export should print a difference near 1e-7 and,
for a tied model, no `output.weight`. llama.cpp's C++ inference is not run (docs/export.md).
Not a test: it needs a llama.cpp source tree, which the project does not ship.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

PROBE_IDS = [[5, 17, 300, 41, 9, 1200], [88, 7, 7, 2301, 15, 4]]


def convert(folder: Path, llama_cpp: Path, out: Path) -> None:
    """llama.cpp's converter on `folder`, f32, into `out`."""
    env = dict(os.environ, PYTHONPATH=str(llama_cpp / "gguf-py"))
    command = [
        sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder),
        "--outfile", str(out), "--outtype", "f32",
    ]  # fmt: skip
    subprocess.run(command, check=True, env=env)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    import gguf
    from transformers import AutoModelForCausalLM

    folder, llama_cpp = Path(argv[0]), Path(argv[1])
    with tempfile.TemporaryDirectory(prefix="gguf-check-") as scratch:
        target = Path(scratch)
        for name in folder.iterdir():  # config + tokenizer beside the GGUF for the reader
            if name.suffix in (".json", ".jinja"):
                (target / name.name).write_bytes(name.read_bytes())
        convert(folder, llama_cpp, target / "model.gguf")
        names = {t.name for t in gguf.GGUFReader(str(target / "model.gguf")).tensors}
        served = AutoModelForCausalLM.from_pretrained(
            target, gguf_file="model.gguf", dtype=torch.float32
        ).eval()
        exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ids = torch.tensor(PROBE_IDS)
        with torch.no_grad():
            a = torch.softmax(served(input_ids=ids).logits, dim=-1)
            b = torch.softmax(exported(input_ids=ids).logits, dim=-1)
    print(f"output.weight in the GGUF: {'output.weight' in names}")
    print(f"output_norm.weight in the GGUF: {'output_norm.weight' in names}")
    print(f"max |p_gguf - p_export| over {ids.numel()} positions: {(a - b).abs().max():.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
