"""README.md as a user reads it: the client example runs against a real `kvbroker serve`,
the picture is drawn from its source, and the README stays short."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from tests.e2e.test_cli import start_serve

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKER = "<!-- run by tests/e2e/test_readme.py against a real kvbroker serve -->"
TARGET = "127.0.0.1:50051"

# An HBM of 5 MiB (watermarks 0.95/0.90) over a DRAM: four 2 MiB blocks cannot all stay up.
CONFIG = """
[policy]
name = "lru"
[[tiers]]
name = "hbm"
capacity = "5MiB"
[[tiers]]
name = "dram"
capacity = "1GiB"
"""


def client_example() -> str:
    text = README.read_text()
    assert MARKER in text, "the README lost its tested client example"
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], re.S)
    assert block is not None
    return block.group(1)


def test_the_readme_client_example_runs_and_gets_directives(tmp_path: pathlib.Path) -> None:
    code = client_example()
    assert len(code.strip().splitlines()) <= 15  # "a client in ten lines", give or take the import
    assert TARGET in code
    proc, port = start_serve(tmp_path, "--journal", "none", config_text=CONFIG)
    try:
        done = subprocess.run(
            [sys.executable, "-c", code.replace(TARGET, f"127.0.0.1:{port}")], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    # The pinned, just-read blk-0 stays; the policy demotes others out of the 5 MiB HBM.
    lines = done.stdout.splitlines()
    assert lines, "no directive came back"
    for line in lines:
        kind, block, from_tier, arrow, to_tier = line.split()
        assert (kind, from_tier, arrow, to_tier) == ("DIRECTIVE_KIND_DEMOTE", "hbm", "->", "dram"), line
        assert block != "req-1/blk-0"


def test_the_picture_is_drawn_from_its_source(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "architecture.png"
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "architecture.py"), str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "docs/architecture.png" in README.read_text()


def test_the_readme_is_for_users_and_short() -> None:
    assert len(README.read_text().splitlines()) < 400


def test_every_file_the_readme_links_or_names_exists() -> None:
    text = README.read_text()
    linked = re.findall(r"\]\(([^)#]+)\)", text)
    assert linked
    for target in linked:
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    # Commands the README tells users to run: python bench/X.py and docs/X.py must exist.
    for script in re.findall(r"python (?:-m )?((?:bench|docs)/[\w./]+\.py)", text):
        assert (ROOT / script).exists(), f"README runs {script}, which does not exist"


def test_every_relative_link_of_the_docs_resolves_from_its_page() -> None:
    """A link in docs/X.md is read from docs/ (a path written from the root, such as
    docs/mooncake/hit_rate.png, is a broken image on GitHub and in any viewer)."""
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.name}: {target}")
    assert not broken, broken
