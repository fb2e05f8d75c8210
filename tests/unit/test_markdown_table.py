"""tools/tables.py: the one way the tools write markdown tables."""

from tools.tables import markdown_cell, markdown_header, markdown_row, markdown_table


def test_a_row_str_s_its_cells():
    assert markdown_row(["a", 1, 2.5, None]) == "| a | 1 | 2.5 | None |"


def test_an_empty_cell_keeps_one_space():
    assert markdown_row(["speedup", "1.20x", "", ""]) == "| speedup | 1.20x | | |"


def test_a_pipe_inside_a_cell_is_escaped():
    assert markdown_cell("|tree - decode|") == "\\|tree - decode\\|"
    assert markdown_row(["a|b"]).count("|") - markdown_row(["a|b"]).count("\\|") == 2


def test_the_header_has_one_separator_per_column():
    assert markdown_header(["T", "ms", "vs T=1"]) == "| T | ms | vs T=1 |\n|---|---|---|"


def test_a_table_is_the_header_then_the_rows():
    table = markdown_table(["T", "ms"], [(1, "2.00"), (2, "3.50")])
    assert table == "| T | ms |\n|---|---|\n| 1 | 2.00 |\n| 2 | 3.50 |"


def test_a_table_without_rows_is_its_header():
    assert markdown_table(["a"], []) == "| a |\n|---|"


def test_rows_may_be_any_iterables():
    assert markdown_table(["x"], (iter([n]) for n in range(2))) == "| x |\n|---|\n| 0 |\n| 1 |"
