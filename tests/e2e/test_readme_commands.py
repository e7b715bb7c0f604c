"""The README's shell commands, as a newcomer runs them: in order, on a fresh clone in a new
folder.

Every command of the README's ```sh blocks is known here (``RULES``): run, run as the
broker the next commands talk to, or not run, with the reason (a GPU, vLLM's several GB
that .ci/run's vllm step installs, an example host). A README command that no rule knows
fails the test: whoever adds one says here how it is checked.

- Always (the main suite): every command is known, and every ``kvbroker`` command parses
  with the command's own parser.
- Marker ``readme_run`` (deselected by default: minutes; .ci/run's "README commands" step
  runs it): a ``git clone`` of this checkout in a new temporary folder, then the commands in
  README order, each of which must exit 0: the install and the demo, ``kvbroker serve`` with
  the README's broker.toml and the README's client example against it (the port replaced
  by a free one: other tests share this machine), ``replay --verify`` of the journal that
  serve wrote, and the Mooncake replay with its plots. Later sections say ``kvbroker``: the
  clone's venv is first on PATH, as ``. .venv/bin/activate`` would put it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from broker.cli.main import build_parser
from tests.e2e.test_readme import client_example, server_config

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_PORT = "127.0.0.1:50051"


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str
    action: str  # "run", "serve" (started, left running for the commands after it) or "skip"
    reason: str
    timeout: float = 600.0


RULES = (
    Rule(
        r"python3 -m venv \.venv && \.venv/bin/pip install -e \.\[dev\] && \.venv/bin/kvbroker demo",
        "run",
        "the install (mypyc compiles the hot path) and the demo",
        timeout=1800.0,
    ),
    Rule(r"\.venv/bin/python -m pytest", "skip", "the test suite this test is part of: .ci/run's test step runs it"),
    Rule(
        r"python3 -m venv \.venv-vllm && \.venv-vllm/bin/pip install -e \.\[vllm\]",
        "skip",
        "vLLM with torch, several GB: .ci/run's vllm step installs the same extra into .venv-vllm",
    ),
    Rule(r"(\.venv-vllm/bin/)?vllm serve .*", "skip", "vLLM serving a model needs a GPU"),
    Rule(r"kvbroker replay --journal file:///var/lib/kvbroker/vllm-1234\.journal .*", "skip", "reads the journal vllm serve writes (GPU)"),
    Rule(
        r"(PYTHONPATH=\. )?\.venv-vllm/bin/.*",
        "skip",
        "runs in the vLLM venv, which .ci/run's vllm step builds (and runs the try-it there, on a short trace)",
    ),
    Rule(r"kvbroker serve --config broker\.toml --listen 127\.0\.0\.1:50051", "serve", "the broker of the bridge and the replay below"),
    Rule(r"kvbroker vllm-bridge .*", "skip", "mirrors a running vLLM's KV events (vllm serve, GPU)"),
    Rule(r"kvbroker replay --journal file://kvbroker\.journal --verify", "run", "the journal the serve above wrote"),
    Rule(r"kvbroker replay --trace tests/data/mooncake/synthetic_trace\.jsonl .*", "run", "the bundled Mooncake trace"),
    Rule(
        r"kvbroker replay --journal redis://10\.0\.0\.5:6379/.*",
        "skip",
        "an example fleet: a Redis at 10.0.0.5 (no such host here) and Ray (.venv-ray; .ci/run's ray step)",
    ),
)


def readme_commands(text: str | None = None) -> list[str]:
    """The commands of the README's ```sh blocks, in order: a command continued by a
    trailing backslash or by a quote left open spans lines."""
    text = README.read_text() if text is None else text
    out: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        pending = ""
        for line in block.splitlines():
            pending = f"{pending}\n{line}" if pending else line
            if pending.rstrip().endswith("\\"):
                continue
            try:
                words = shlex.split(pending, comments=True)
            except ValueError:  # a quotation still open: the command goes on
                continue
            if words:
                out.append(pending.strip())
            pending = ""
        assert not pending, f"README: a command in a sh block never ends: {pending[:200]}"
    return out


def words_of(command: str) -> list[str]:
    """The command's words as the shell reads them: continuations joined, the comment gone."""
    return shlex.split(command.replace("\\\n", " "), comments=True)


def rule_of(command: str) -> Rule | None:
    """The first rule whose pattern matches the command's words, joined by spaces (quotes gone)."""
    flat = " ".join(words_of(command))
    return next((rule for rule in RULES if re.fullmatch(rule.pattern, flat, re.S)), None)


def kvbroker_invocations(command: str) -> list[list[str]]:
    """The argument lists of each ``kvbroker`` (or ``PATH/kvbroker``) in the command, && chains split."""
    words = words_of(command)
    parts: list[list[str]] = [[]]
    for word in words:
        if word in ("&&", "||", ";", "|"):
            parts.append([])
        else:
            parts[-1].append(word)
    return [part[1:] for part in parts if part and Path(part[0]).name == "kvbroker"]


def test_the_extraction_joins_continued_and_quoted_lines() -> None:
    text = "x\n```sh\na b \\\n  c   # note\nd '{\"k\":\n 1}'\n\n# only a comment\n```\n"
    assert readme_commands(text) == ["a b \\\n  c   # note", "d '{\"k\":\n 1}'"]
    assert shlex.split(readme_commands(text)[1]) == ["d", '{"k":\n 1}']
    assert words_of(readme_commands(text)[0]) == ["a", "b", "c"]


def test_every_readme_command_is_known_and_every_kvbroker_command_parses() -> None:
    commands = readme_commands()
    assert len(commands) >= 8
    unknown = [c for c in commands if rule_of(c) is None]
    assert unknown == [], f"README commands no rule of {Path(__file__).name} knows (say how each is checked): {unknown}"
    parser = build_parser()
    for command in commands:
        for argv in kvbroker_invocations(command):
            try:
                parser.parse_args(argv)
            except SystemExit as exc:
                pytest.fail(f"README: `kvbroker {shlex.join(argv)}` does not parse (exit {exc.code})")
    # What the run needs comes first: the install before any kvbroker, the serve before the
    # replay of the journal it writes.
    actions = [(rule_of(c), c) for c in commands]
    order = [rule.pattern for rule, _ in actions if rule is not None]
    assert order.index(RULES[0].pattern) == 0
    serve = next(r.pattern for r in RULES if r.action == "serve")
    verify = next(r.pattern for r in RULES if "kvbroker\\.journal" in r.pattern and "verify" in r.pattern)
    assert order.index(serve) < order.index(verify)


# ---- the run on a fresh clone ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve(command: str, clone: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command}"], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{") and json.loads(line).get("event") == "listening":
                return proc
        if proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"`{command}` did not start listening: {proc.stderr.read() if proc.stderr else ''}")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.readme_run
@pytest.mark.timeout(3600)
def test_the_readme_commands_run_in_order_on_a_fresh_clone(tmp_path: Path) -> None:
    clone = tmp_path / "kvbroker"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "KVBROKER_PURE_PYTHON")}
    env["PATH"] = f"{clone / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    port = str(free_port())
    served: list[subprocess.Popen[str]] = []
    ran = []
    try:
        for command in readme_commands():
            rule = rule_of(command)
            assert rule is not None, command
            if rule.action == "skip":
                continue
            command = command.replace(README_PORT, f"127.0.0.1:{port}")
            if rule.action == "serve":
                # The README's broker.toml (its client example's), then the broker, then the
                # client example against it: traffic for the journal the replay reads.
                (clone / "broker.toml").write_text(server_config())
                served.append(start_serve(command, clone, env))
                example = client_example().replace(README_PORT, f"127.0.0.1:{port}")
                python = str(clone / ".venv" / "bin" / "python")
                done = subprocess.run([python, "-c", example], cwd=clone, env=env, capture_output=True, text=True, timeout=120)
                assert done.returncode == 0 and "DIRECTIVE_KIND_DEMOTE" in done.stdout, done.stderr[-2000:]
                stop(served.pop())
            else:
                done = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True, timeout=rule.timeout)
                assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
                assert "Traceback" not in done.stderr, done.stderr[-3000:]
            ran.append(command)
    finally:
        for proc in served:
            stop(proc)
    assert len(ran) >= 4
    # What the commands left: a demo that verified, a journal replayed exactly, plots drawn.
    assert (clone / "kvbroker.journal").stat().st_size > 0
    assert list((clone / "plots").glob("*.png"))
