"""tools/bench_llamacpp.py: each round is judged against the bandwidth measured next to it."""

from pathlib import Path

from tools.bench_llamacpp import PairResult, print_table


def test_roofline_fractions_divide_each_round_by_its_own_bandwidth(capsys):
    result = PairResult("int8", Path("model.gguf"), ours_tps=[10.0, 12.0, 9.0], llama_tps=[5.0, 6.0, 4.0],
                        ours_bytes=int(1e9), llama_bytes=int(2e9), bandwidth_gbs=[20.0, 12.0, 10.0])
    ours, llama = result.roofline_fractions()
    # Per round: ours 0.5, 1.0, 0.9 and llama.cpp 0.5, 1.0, 0.8. Against one bandwidth (the best,
    # 20 GB/s) the medians would be 0.5 and 0.5 instead.
    assert ours == 0.9
    assert llama == 0.8
    print_table([result], threads=2)
    table = capsys.readouterr().out
    assert "| 90% | 80% |" in table
    assert "read bandwidth 10.0-20.0 GB/s" in table
