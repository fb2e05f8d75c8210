"""An fp32 target through the whole runtime (dovetail-run processes): on its exact kernel
(MKL's packed sgemm or our row kernel) dovetail gives exactly --mode ar's tokens at fp32 (the
in-process checks are in tests/unit/test_fp32_packed.py)."""

from __future__ import annotations

import json

from test_runtime_e2e import CODE_PROMPTS

from runtime_harness import FIXED_TREE, dovetail_run


def test_fp32_target_through_the_runtime_equals_ar(tmp_path, demo_target, demo_draft):
    prompt_file = tmp_path / "code.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CODE_PROMPTS))
    done = dovetail_run("--target", str(demo_target), "--draft", str(demo_draft), "--compare-ar", "--json",
                        "--prompt-file", str(prompt_file), "--max-new-tokens", "64", "--log-level", "info", *FIXED_TREE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("target: fp32 (mkl-packed)" in done.stderr or "target: fp32 (dovetail-fp32)" in done.stderr)
    assert "trees verified bit-exact" in done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == len(CODE_PROMPTS)
    for line in lines:
        assert line["ar"]["same_tokens"], f"fp32 dovetail differs from fp32 ar for {line['prompt']!r}"
        assert line["stats"]["tau"] > 1.5
