"""What a worker's start imports: loading the shipped models reads their configs without transformers
(cpu_worker.model.hf_config) and builds their modules on the meta device without an init that first
imports torch._dynamo (nn.Embedding's and the fusion weights' normal_). Each was seconds of every start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gguf_support import need_fixture

from dovetail_runtime.demo_models import SMOLLM2_DRAFT, SMOLLM2_GGUF

from conftest import DEMO_TARGET

REPO = Path(__file__).resolve().parents[2]

LOADS = f"""
import sys
from pathlib import Path
from cpu_worker.target_loading import load_target_model
from gpu_worker.drafter import Drafter
load_target_model(Path({str(DEMO_TARGET)!r}))
load_target_model(Path({str(SMOLLM2_GGUF)!r}))
Drafter.from_pretrained({str(REPO / "demo" / "draft-dgf")!r}, {str(DEMO_TARGET)!r}, device="cpu", dtype="fp32")
Drafter.from_pretrained({str(SMOLLM2_DRAFT)!r}, {str(SMOLLM2_GGUF)!r}, device="cpu", dtype="q4_0")
print(sorted(name for name in sys.modules if name.split(".")[0] == "transformers" or name.startswith("torch._dynamo")))
"""


def test_loading_the_shipped_pairs_imports_neither_transformers_nor_dynamo():
    need_fixture()
    done = subprocess.run([sys.executable, "-c", LOADS], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
