"""The README's results table as a chart: docs/results.png.

    python -m tools.plot_results [--out docs/results.png]      # needs matplotlib: pip install -e '.[bench]'

The figures are the latest per CPU family from docs/performance.md, where each one has the command
that measured it; this script only draws them, so the chart and the README's table never disagree
(both come from RESULTS: tests/system/test_readme.py checks the README's table against it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import click

from tools.tables import markdown_row

# The checkout's chart wherever the command runs from (a relative docs/results.png failed outside the repo).
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "results.png"


@dataclass(frozen=True)
class Result:
    cpu: str  # CPU family, 2 cores each
    setup: str  # model and precision
    versus_llamacpp: float | None  # plain decoding, ours / llama.cpp's at the same bits
    llamacpp_format: str  # the llama.cpp format compared with
    dovetail_over_ar: tuple[float, float]  # speculative / plain decoding, same tokens: lowest, highest run


RESULTS = (
    Result("Intel Xeon (AMX)", "7B stand-in, int8-row", 1.11, "Q8_0", (1.74, 1.90)),
    Result("Intel Xeon (AMX)", "7B stand-in, q4_0", 0.85, "Q4_0", (1.46, 1.46)),
    Result("AMD Zen 4 (AVX512-VNNI)", "7B stand-in, int8-row", 1.10, "Q8_0", (1.21, 1.30)),
    Result("AMD Zen 3 (AVX2)", "7B Q4_0 GGUF (llama.cpp's), q4_0-a16", 1.33, "Q4_0", (0.94, 0.94)),
    Result("AMD Zen 3 (AVX2)", "7B stand-in, int8-row", 1.38, "Q8_0", (1.33, 1.44)),
    Result("AMD Zen 3 (AVX2)", "SmolLM2 chat pair inflated to 7B, q4_0, chat prompts", None, "", (1.27, 1.30)),
    Result("AMD Zen 3 (AVX2)", "SmolLM2 chat pair inflated to 7B, q4_0-a16, chat prompts", None, "", (0.81, 0.92)),
    Result("AMD Zen 3 (AVX2)", "SmolLM2-135M GGUF (the demo), plain fallback", None, "", (0.77, 1.16)),
    Result("AMD Zen 4 (AVX512-VNNI)", "SmolLM2-135M GGUF (the demo), plain fallback", 2.06, "Q4_1", (0.61, 0.97)),
    Result("AMD Zen 4 (AVX512-VNNI)", "SmolLM2 chat pair inflated to 7B, q4_0, chat prompts", None, "", (1.40, 1.64)),
)


def markdown_rows() -> list[str]:
    """The README's table rows, in RESULTS' order."""
    rows = []
    for result in RESULTS:
        versus = f"{result.versus_llamacpp:.2f}x {result.llamacpp_format}" if result.versus_llamacpp else "-"
        low, high = result.dovetail_over_ar
        speedup = f"{low:.2f}x" if low == high else f"{low:.2f}-{high:.2f}x"
        rows.append(markdown_row([result.cpu, result.setup, versus, speedup]))
    return rows


def draw(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    labels = [f"{result.cpu}\n{result.setup}" for result in RESULTS]
    positions = range(len(RESULTS))
    figure, axis = plt.subplots(figsize=(10, 5.5))
    height = 0.38
    axis.barh([p - height / 2 for p in positions], [max(r.dovetail_over_ar) for r in RESULTS], height,
              label="dovetail / plain decoding, same tokens (best run)", color="#2b7bba")
    axis.barh([p + height / 2 for p in positions], [r.versus_llamacpp or 0.0 for r in RESULTS], height,
              label="plain decoding: ours / llama.cpp, same bits", color="#f0a030")
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.set_yticks(list(positions), labels, fontsize=8)
    axis.invert_yaxis()
    axis.set_xlabel("speed ratio (x), 2 CPU cores")
    axis.set_title("Dovetail: measured speed ratios (docs/performance.md has the commands)")
    axis.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@click.command(help=__doc__)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_OUT,
              show_default="docs/results.png in this checkout")
def main(out: Path) -> None:
    if not out.parent.is_dir():  # savefig's FileNotFoundError traceback, after the drawing
        raise click.BadParameter(f"{out.parent} is not a folder", param_hint="'--out'")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is missing: pip install -e '.[bench]'", file=sys.stderr)
        sys.exit(1)
    draw(out)
    print(f"written {out}")


if __name__ == "__main__":
    main()
