"""tools.soak: the report's latency percentiles are nearest-rank (the ceil(p * n)-th smallest), and a server
that does not answer is named in one line."""

from __future__ import annotations

from tools.soak import percentile


def test_the_median_of_an_even_count_is_the_lower_middle_value():
    assert percentile([6.0, 1.0, 5.0, 2.0, 4.0, 3.0], 0.5) == 3.0
    assert percentile([float(v) for v in range(1, 11)], 0.5) == 5.0
    assert percentile([2.0, 1.0], 0.5) == 1.0


def test_p99_of_a_hundred_values_is_the_99th_not_the_largest():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 0.07) == 7.0  # 0.07 * 100 is 7.000000000000001 in floats


def test_edges():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0, 3.0], 0.0) == 1.0
    assert percentile([1.0, 2.0, 3.0], 1.0) == 3.0
    assert percentile([1.0, 2.0, 3.0], 0.5) == 2.0


def test_a_server_that_does_not_answer_is_one_line(monkeypatch, tmp_path):
    """--connect to an endpoint nobody serves ended in a HandshakeError traceback."""
    from click.testing import CliRunner

    from ipc.handshake import HandshakeError
    from tools import soak, soak_clients

    endpoint = f"ipc://{tmp_path}/nobody.sock"

    def no_answer(address, **_kwargs):
        raise HandshakeError(f"no answer from {address} within 10 s: is a dovetail-run serving there?")

    monkeypatch.setattr(soak_clients, "DovetailClient", no_answer)
    result = CliRunner().invoke(soak.main, ["--connect", endpoint, "--duration", "1", "--prompts", "1"])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == f"Error: no answer from {endpoint} within 10 s: is a dovetail-run serving there?"


class FakeClient:
    """Answers every request at once with the same tokens (a server that is always right)."""

    def __init__(self, kind, *_args):
        self.kind = kind

    def ask(self, request):
        from tools.soak_clients import Answer

        return Answer([1, 2], "ab", 0.01, 0.005 if self.kind.endswith("stream") else None)

    def close(self):
        pass


def test_a_run_against_a_server_that_answers_right_passes(monkeypatch, tmp_path):
    """The whole command, clients included, against fake clients: every answer right, exit 0."""
    from click.testing import CliRunner

    from tools import soak

    monkeypatch.setattr(soak, "SoakClient", FakeClient)
    result = CliRunner().invoke(soak.main, ["--connect", f"ipc://{tmp_path}/s.sock", "--duration", "1",
                                            "--clients", "2", "--prompts", "1"])
    assert result.exit_code == 0, result.output
    assert "| all | 2 |" in result.output and "wrong 0, lost 0" in result.output
