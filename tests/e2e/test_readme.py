"""README.md as a user reads it: the client example runs against a real `kvbroker serve`,
the picture is drawn from its source, and the README stays short."""

from __future__ import annotations

import json
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from tests.e2e.test_cli import start_serve

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKER = "<!-- run by tests/e2e/test_readme.py against a real kvbroker serve -->"
TARGET = "127.0.0.1:50051"
# The command line the README gives for the example's broker (beside its broker.toml).
SERVE = ".venv/bin/kvbroker serve --config broker.toml --listen 127.0.0.1:50051 --journal none"


def _block(language: str) -> str:
    text = README.read_text()
    assert MARKER in text, "the README lost its tested client example"
    block = re.search(rf"```{language}\n(.*?)```", text[text.index(MARKER) :], re.S)
    assert block is not None
    return block.group(1)


def client_example() -> str:
    return _block("python")


def server_config() -> str:
    """The README's broker.toml for the example: an HBM of 5 MiB (watermarks 0.95/0.90) over
    a DRAM, so four 2 MiB blocks cannot all stay up."""
    config = _block("toml")
    assert SERVE in config, "the README's broker.toml lost the serve command line beside it"
    return config


def run_example(code: str, port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code.replace(TARGET, f"127.0.0.1:{port}")], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_the_readme_client_example_runs_and_gets_directives(tmp_path: pathlib.Path) -> None:
    code = client_example()
    assert len(code.strip().splitlines()) <= 15  # "a client in ten lines", give or take the import
    assert TARGET in code
    proc, port = start_serve(tmp_path, "--journal", "none", config_text=server_config())
    try:
        done = run_example(code, port)
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
    # 410: issue 32 put the example's broker.toml, its rejections and the compose section in;
    # 450: issues 38-41 the try-it without a GPU, vLLM's best setting beside the default, the
    # plug-in name, install lines that work from a clone and the demo's whole output.
    assert len(README.read_text().splitlines()) < 450


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


def test_run_twice_the_second_run_says_its_events_were_rejected(tmp_path: pathlib.Path) -> None:
    """The same blocks allocated again are rejected by the broker: the client counts them
    (rejected_events, what `kvbroker status` counts) and says so in a log line, as the README
    shows; before, the second run printed nothing at all."""
    code = client_example() + "print('rejected_events', client.rejected_events)\n"
    proc, port = start_serve(tmp_path, "--journal", "none", config_text=server_config())
    try:
        first = run_example(code, port)
        second = run_example(code, port)
        status = subprocess.run(
            [str(pathlib.Path(sys.executable).parent / "kvbroker"), "status", "--target", f"127.0.0.1:{port}", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
    assert first.stdout.splitlines()[-1] == "rejected_events 0" and "rejected" not in first.stderr, first
    assert second.stdout.splitlines() == ["rejected_events 4"], second.stdout
    (line,) = [x for x in second.stderr.splitlines() if "rejected" in x]
    assert "client engine-0: the broker rejected 4 event(s), not applied" in line, line
    assert "block 'req-1/blk-0' is already allocated" in line, line
    shown = re.sub(r"\s+", " ", README.read_text())
    assert "client engine-0: the broker rejected 4 event(s), not applied ... block 'req-1/blk-0' is already allocated" in shown
    assert json.loads(status.stdout)["rejected_events"] == 4


def test_with_the_broker_down_flush_raises_timeout_error_and_nothing_else(tmp_path: pathlib.Path) -> None:
    """As the README says: TimeoutError from flush; and no asyncio "Future exception was
    never retrieved" lines after it (a shielded wait of the flush outlived it)."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        done = run_example(client_example(), closed.getsockname()[1])
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("TimeoutError: broker client engine-0: no answer within 5.000s"), done.stderr
    assert "never retrieved" not in done.stderr, done.stderr
    assert "flush` raises TimeoutError" in README.read_text()


def _where_it_ran(text: str) -> str:
    """The output with what differs from run to run (the broker's port, the journal's
    temporary folder) replaced by placeholders."""
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    return re.sub(r"/tmp/kvbroker-demo-[^/]+/", "/tmp/kvbroker-demo-DIR/", text)


def test_the_readme_shows_what_kvbroker_demo_prints() -> None:
    """The demo's output block is what `kvbroker demo` prints, line for line (it showed 24
    policies, 9 rows and no `live:` line where the demo printed 25 rows and one)."""
    text = README.read_text()
    shown = re.search(r"What `kvbroker demo` prints[^\n]*\n\n```\n(.*?)```", text, re.S)
    assert shown is not None, "the README lost its demo output block"
    kvbroker = pathlib.Path(sys.executable).parent / "kvbroker"
    done = subprocess.run([str(kvbroker), "demo"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _where_it_ran(shown.group(1)) == _where_it_ran(done.stdout)
