"""tools.bench_real: source folders that are no model folders are named before anything is inflated."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tools import bench_real

from conftest import DEMO_DRAFT, DEMO_TARGET


def not_inflated(*_args, **_kwargs):
    raise AssertionError("inflation started before the sources were checked")


@pytest.mark.parametrize("option", ["--target", "--draft"])
def test_a_source_without_a_config_is_a_usage_error(tmp_path, monkeypatch, option):
    """--draft /tmp inflated the target, then died in a FileNotFoundError traceback; --target /tmp at once."""
    monkeypatch.setattr(bench_real, "ensure_inflated", not_inflated)
    sources = {"--target": str(DEMO_TARGET), "--draft": str(DEMO_DRAFT)} | {option: str(tmp_path)}
    result = CliRunner().invoke(bench_real.main, ["--runs", "tiny-1k:fp32", "--work-dir", str(tmp_path / "work"),
                                                  *(item for pair in sources.items() for item in pair)])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}': {tmp_path} has no config.json: not a model folder" in result.output
