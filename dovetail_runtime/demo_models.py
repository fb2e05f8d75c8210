"""Where the demo pairs live: the real one (SmolLM2-135M-Instruct's Q4_1 GGUF, fetched once into
the user's cache by ``scripts/fetch_fixture.sh``, with its head in ``demo/draft-smollm2``) and the
9M code pair bundled in ``demo/`` (the fast one the tests use). Paths only: nothing here downloads."""

from __future__ import annotations

import os
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"  # a checkout or an editable install
CODE_TARGET = DEMO_DIR / "target-code-9m"
CODE_DRAFT = DEMO_DIR / "draft-dgf"
SMOLLM2_DRAFT = DEMO_DIR / "draft-smollm2"

FIXTURES = Path(os.environ.get("DOVETAIL_FIXTURES") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dovetail" / "fixtures")
SMOLLM2_GGUF = FIXTURES / "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = FIXTURES / "smollm2-135m-instruct"  # its fp32 HF folder (transformers' dequantization)
FETCH_HINT = "bash scripts/fetch_fixture.sh"


def real_pair_present() -> bool:
    return SMOLLM2_GGUF.is_file() and (SMOLLM2_DRAFT / "config.json").is_file()
