"""The docs' code-block reader (tests/docs_blocks.py) on small pages: pure, no processes."""

from __future__ import annotations

import pytest
from docs_blocks import blocks, command_lines, parse_marker, undated_figures

PAGE = """# Title

<!-- test: quick np=2 equal=model env=A=1 expect=test_accuracy -->
```python
print("hi")
```

Text.

<!-- not run: a fragment -->
```python
model.fit(x)
```

1. A list item:

    ```bash
    hvdkit run -np 2 \\
        -- python train.py  # comment
    ```
"""


def test_blocks_carry_their_markers_and_dedented_code():
    found = blocks(PAGE, "p.md")
    assert [(b.lang, b.line) for b in found] == [("python", 4), ("python", 11), ("bash", 17)]
    run, fragment, shell = found
    assert run.test_id == "quick" and run.env == {"A": "1"}
    assert run.options == {"np": "2", "equal": "model", "expect": "test accuracy"}
    assert fragment.not_run == "a fragment" and fragment.test_id is None
    assert shell.code.startswith("hvdkit run -np 2 \\\n") and shell.test_id is None


def test_command_lines_join_continuations_and_drop_prompts_comments_and_assignments():
    code = (
        "$ A=1 B=2 hvdkit run -np 2 \\\n    -- python t.py  # why\n"
        "# only a comment\nexec make test\n"
    )
    assert command_lines(code) == [
        ["hvdkit", "run", "-np", "2", "--", "python", "t.py"],
        ["make", "test"],
    ]


@pytest.mark.parametrize(
    "marker, message",
    [("np=2", "needs an ID first"), ("x gpus=2", "is not one of"), ("", "needs an ID first")],
)
def test_bad_markers_are_named_with_the_place(marker, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_marker(marker, "docs/a.md:3")
    assert "docs/a.md:3" in str(error.value)


def test_an_unclosed_block_is_an_error():
    with pytest.raises(ValueError, match="p.md:1: a code block that is never closed"):
        blocks("```python\nx = 1\n", "p.md")


def test_figures_need_a_date_in_their_section_or_one_enclosing_it():
    assert undated_figures("# A\n\nIt took 35 s.\n") == ["section 'A' quotes '35 s' with no date"]
    assert undated_figures("# A\nMeasured 2026-11-26.\n## B\nIt took 35 s.\n") == []
    # A date in a sibling section does not count, nor does a figure quoted in code.
    assert undated_figures("## A\n2026-11-26\n## B\nratio 1.012\n") == [
        "section 'B' quotes '1.012' with no date"
    ]
    assert undated_figures("## A\n`no start within 600 s`\n```\nsleep 30 s\n```\n") == []
