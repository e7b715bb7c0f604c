"""Build kvbroker's wheel and sdist with ``python -m build``, install each into a fresh venv
and smoke-test what got installed (CI runs it: .ci/run, step "dist").

    python scripts/check_dist.py [--out DIR]

- The build runs on a copy of the tracked files (``git ls-files``) in a temporary folder:
  building in the checkout would rewrite its ``broker/_native_build.json`` (the record of
  what its compiled modules were compiled from) for sources it did not compile.
- The wheel, installed with its dependencies, must run compiled: every module of
  broker.native.BUILT_MODULES an extension, none stale.
- The sdist, installed with ``KVBROKER_PURE_PYTHON=1`` (a second mypyc compile of the same
  sources would only repeat the wheel's), must run interpreted.
- Each install runs from an empty folder, so nothing of the checkout can be imported:
  ``kvbroker --version`` prints pyproject's version, ``kvbroker policies --json`` lists the
  policies, ``kvbroker size`` answers, no warning on stderr, and the metadata declares the
  console script and vLLM's plugin entry point.

Exits 0 when both pass; else 1, naming what failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# What the installed package reports about itself; run by the venv's Python from an empty folder.
PROBE = """
import importlib, importlib.metadata, json
from broker import native
built = {m: importlib.import_module(m).__file__ for m in native.BUILT_MODULES if m not in native.C_EXTENSIONS}
eps = importlib.metadata.entry_points()
print(json.dumps({
    "compiled": sorted(m for m, f in built.items() if not f.endswith(".py")),
    "interpreted": sorted(m for m, f in built.items() if f.endswith(".py")),
    "stale": native.stale(),
    "scripts": sorted(e.name for e in eps.select(group="console_scripts") if e.dist.name == "kvbroker"),
    "vllm_plugins": sorted(e.value for e in eps.select(group="vllm.general_plugins") if e.dist.name == "kvbroker"),
}))
"""


def run(argv: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"check_dist: {' '.join(map(str, argv))} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return done.stdout + done.stderr


def copy_tracked(into: Path) -> None:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        source = ROOT / name
        if source.is_file():
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def smoke(venv: Path, empty: Path, *, compiled: bool) -> list[str]:
    """What is wrong with the kvbroker installed in ``venv`` (nothing: [])."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVBROKER_PURE_PYTHON")}
    kvbroker, python = venv / "bin" / "kvbroker", venv / "bin" / "python"
    problems = []
    version = run([kvbroker, "--version"], cwd=empty, env=env).strip()
    if version != f"kvbroker {PROJECT['version']}":
        problems.append(f"kvbroker --version printed {version!r}")
    policies = subprocess.run([kvbroker, "policies", "--json"], cwd=empty, env=env, capture_output=True, text=True, timeout=120)
    names = {p["name"] for p in json.loads(policies.stdout)} if policies.returncode == 0 else set()
    if not {"lru", "history_arc", "deadline_edf"} <= names:
        problems.append(f"kvbroker policies --json: exit {policies.returncode}, policies {sorted(names)}")
    if policies.stderr.strip():
        problems.append(f"kvbroker policies wrote to stderr: {policies.stderr.strip()[:500]}")
    size = run([kvbroker, "size", "--model", "llama-3-8b", "--tokens", "1000", "--json"], cwd=empty, env=env)
    if "bytes" not in size:
        problems.append(f"kvbroker size printed {size[:200]!r}")
    probe = json.loads(run([python, "-c", PROBE], cwd=empty, env=env))
    if probe["stale"]:
        problems.append(f"stale compiled modules: {probe['stale']}")
    if compiled and probe["interpreted"]:
        problems.append(f"the wheel runs these modules interpreted, not compiled: {probe['interpreted']}")
    if not compiled and probe["compiled"]:
        problems.append(f"the pure install runs compiled modules: {probe['compiled']}")
    if probe["scripts"] != ["kvbroker"]:
        problems.append(f"console scripts: {probe['scripts']}")
    if probe["vllm_plugins"] != list(PROJECT["entry-points"]["vllm.general_plugins"].values()):
        problems.append(f"vllm.general_plugins entry points: {probe['vllm_plugins']}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="keep the wheel and the sdist in this folder")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvbroker-dist-") as tmp:
        work = Path(tmp)
        src, dist, venv, empty = work / "src", work / "dist", work / "venv", work / "empty"
        empty.mkdir()
        copy_tracked(src)
        run([sys.executable, "-m", "build", "--outdir", dist, src], cwd=work)
        (wheel,) = dist.glob("kvbroker-*.whl")
        (sdist,) = dist.glob("kvbroker-*.tar.gz")
        print(f"built {wheel.name} and {sdist.name} in {time.monotonic() - started:.0f} s")
        run([sys.executable, "-m", "venv", venv], cwd=work)
        pip: list[str | Path] = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
        failed = []
        for artifact, compiled in ((wheel, True), (sdist, False)):
            env = dict(os.environ)
            if not compiled:
                env["KVBROKER_PURE_PYTHON"] = "1"
                run([venv / "bin" / "python", "-m", "pip", "uninstall", "-q", "-y", "kvbroker"], cwd=empty)
            run([*pip, artifact], cwd=empty, env=env)
            problems = smoke(venv, empty, compiled=compiled)
            kind = "compiled" if compiled else "pure Python"
            print(f"{artifact.name} ({kind}): " + ("smoke test passed" if not problems else "FAILED"))
            failed += [f"{artifact.name}: {p}" for p in problems]
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            for artifact in (wheel, sdist):
                shutil.copy2(artifact, args.out / artifact.name)
    print(f"check_dist: {time.monotonic() - started:.0f} s")
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
