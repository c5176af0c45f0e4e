"""Comments and docstrings say why the code is as it is, never when or after which issue it
changed: a date, an issue number or a commit hash in them goes stale the day it is written
and sends the reader to history the checkout does not hold. Only comments and docstrings are
read (tokenize for comments, ast for docstrings), so a string the code uses is never flagged.
Benchmark scripts are named for what they measure, not for the issue that asked for them."""
import ast
import io
import os
import re
import tokenize

import pytest

pytestmark = [pytest.mark.fast]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_ROOTS = ("jaxtrain", "models", "meshes", "pallas_kernels")
PROSE_FILES = ("README.md",)

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
ISSUE = re.compile(r"\bissues? ?#?\d+", re.IGNORECASE)
# A commit hash: one word of 7-40 lowercase hex digits holding at least one digit and one
# letter. `0x`-prefixed constants never match (the `x` joins them into one longer word), and
# a hex run inside a longer word (an identifier, a checksum in a URL path) is not a word.
HASH = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
RULES = {"date": DATE, "issue reference": ISSUE, "commit hash": HASH}


def comment_lines(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every line of every docstring in a Python source."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                found += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return sorted(found)


def offences(roots, prose_files=()) -> list[str]:
    """`path:line: what: text` for every date, issue reference or commit hash in the comments and
    docstrings of the .py files under `roots` and in the whole text of `prose_files`."""
    texts = []
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    texts += [(path, n, line) for n, line in comment_lines(f.read())]
    for path in prose_files:
        with open(path, encoding="utf-8") as f:
            texts += [(path, n, line) for n, line in enumerate(f.read().splitlines(), start=1)]
    return [f"{os.path.relpath(path, REPO)}:{n}: {what}: {line.strip()}"
            for path, n, line in texts for what, rule in RULES.items() if rule.search(line)]


def test_code_comments_and_docstrings_carry_no_date_issue_or_commit():
    found = offences([os.path.join(REPO, r) for r in CODE_ROOTS])
    assert not found, "say why, not when (no date, issue number or commit hash):\n" + "\n".join(found)


def test_readme_carries_no_date_issue_or_commit():
    found = offences([], [os.path.join(REPO, p) for p in PROSE_FILES])
    assert not found, "say why, not when (no date, issue number or commit hash):\n" + "\n".join(found)


def test_the_scanner_reports_each_kind_in_comments_and_docstrings_but_not_in_code(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bad.py").write_text(
        '"""Module docstring.\n\nFixed in issue 26.5."""\n'
        'X = "issue 7, 2024-01-02, deadbeef1"  # a string the code uses is not a comment\n'
        'def f():\n'
        '    """Was slow before 3f2a9c1."""\n'
        '    return 0x1f2e3d4c5b  # measured on 2025-03-04\n'
        'class C:\n'
        '    """See #12 and Issues #40."""\n')
    (tmp_path / "README.md").write_text("Fine.\nChanged at a2a0a7f.\n")
    found = offences([str(tmp_path / "pkg")], [str(tmp_path / "README.md")])
    where = sorted((line.split(": ")[0].split(os.sep)[-1], line.split(": ")[1]) for line in found)
    assert where == [("README.md:2", "commit hash"), ("bad.py:3", "issue reference"),
                     ("bad.py:6", "commit hash"), ("bad.py:7", "date"), ("bad.py:9", "issue reference")]
    assert any("Fixed in issue 26.5." in line for line in found)


@pytest.mark.parametrize("word, flagged", [("a2a0a7f", True), ("6b2c6b5f0e1d", True),
                                           ("deadbeef", False), ("1234567", False), ("0x1f2e3d4c", False),
                                           ("abc123", False), ("sha256", False), ("a2a0a7fz", False)])
def test_a_commit_hash_is_a_hex_word_with_a_digit_and_a_letter(word, flagged):
    assert bool(HASH.search(f"see {word} here")) is flagged


def test_no_benchmark_script_is_named_after_an_issue():
    named = sorted(name for name in os.listdir(os.path.join(REPO, "benchmarks")) if "issue" in name.lower())
    assert not named, f"name benchmarks/ scripts for what they measure, not the issue: {named}"
