"""docs/cli.md against the command itself: every verb has its section, every flag of every
verb is in it (and no flag that is not), every --format, exit code and --json field."""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from broker.cli.main import ARM_FIELDS, build_parser, main, status_record
from broker.cli.size import size_record
from broker.cli.vllm_status import ROW, TOP
from broker.replay.traces import FORMATS
from clients import kvsize
from kvbroker.v1 import broker_service_pb2 as spb
from policies import registry

ROOT = Path(__file__).parents[3]
DOC = ROOT / "docs" / "cli.md"


def sections() -> dict[str, str]:
    parts = re.split(r"^## `kvbroker ([a-z-]+)`\s*$", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def verbs() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def flags(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        out += [o for o in action.option_strings if o.startswith("--")] or [action.dest.upper()]
    return out


def assert_fields(section: str, fields: Iterable[str]) -> None:
    missing = [f for f in fields if f"`{f}`" not in section]
    assert not missing, f"--json fields missing from docs/cli.md: {missing}"


def test_every_verb_has_a_section_with_every_one_of_its_flags() -> None:
    docs = sections()
    assert set(docs) == set(verbs())
    for verb, parser in verbs().items():
        missing = [f for f in flags(parser) if f"`{f}" not in docs[verb]]
        assert not missing, f"kvbroker {verb}: flags missing from docs/cli.md: {missing}"
        documented = re.findall(r"`(--[a-z][a-z-]*)", docs[verb])
        stale = sorted(set(documented) - set(flags(parser)) - {"--help"})
        assert not stale, f"kvbroker {verb}: docs/cli.md names flags the verb does not have: {stale}"


def test_every_format_and_exit_code_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    for fmt in FORMATS:
        assert f"| `{fmt}` |" in text
    for code in (0, 1, 2):
        assert re.search(rf"^\| {code} \| \S", text, flags=re.MULTILINE)


def test_every_json_field_of_status_ab_size_policies_and_vllm_status_is_documented() -> None:
    docs = sections()
    stats = spb.GetStatsResponse()
    stats.tiers.add(name="hbm")
    record = status_record(stats)
    assert_fields(docs["status"], [*record, *record["tiers"][0]])
    assert_fields(docs["ab"], ARM_FIELDS)
    assert_fields(docs["size"], size_record(kvsize.resolve_shape("llama-3-8b"), 100, 16, "fp16"))
    assert_fields(docs["policies"], registry.describe(registry.policy_class("lru")))
    assert_fields(docs["vllm-status"], [*TOP, *ROW, "metrics_url"])


def test_every_json_field_of_replay_import_and_repair_is_documented(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = sections()
    trace = tmp_path / "trace.jsonl"
    with (ROOT / "tests" / "data" / "mooncake" / "synthetic_trace.jsonl").open() as f:
        trace.write_text("".join(next(f) for _ in range(3)))
    journal = tmp_path / "t.journal"
    assert main(["import", "--trace", str(trace), "--format", "mooncake", "--out", str(journal)]) == 0
    assert_fields(docs["import"], json.loads(capsys.readouterr().out))
    assert main(["replay", "--journal", str(journal), "--policy", "lru", "--jobs", "1", "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert_fields(docs["replay"], [*record, "first_mismatch", "sources"])  # a mismatch's; a fleet row's
    assert main(["repair", str(journal), "--json"]) == 0
    assert_fields(docs["repair"], [*json.loads(capsys.readouterr().out), "offset", "bytes"])


def record_keys(path: Path, kind: str) -> list[str]:
    """The keys of the dict literal with ``"kind": kind`` in ``path`` (a bench record)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            value = dict(zip(keys, node.values, strict=False)).get("kind")
            if isinstance(value, ast.Constant) and value.value == kind:
                return [str(k) for k in keys]
    raise AssertionError(f"no {kind} record in {path}")


def test_every_json_field_of_bench_is_documented() -> None:
    section = sections()["bench"]
    assert_fields(section, record_keys(ROOT / "broker" / "bench" / "run.py", "throughput"))
    assert_fields(section, record_keys(ROOT / "broker" / "bench" / "memory.py", "memory"))
