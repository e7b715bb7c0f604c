"""Switching live inside vLLM: ``kvbroker_settings_file``, watched, applied between calls.

The settings file is a JSON object of ``kvbroker_*`` keys (the keys and readers of
kv_connector_extra_config, vllm_integration/decisions_to_vllm/settings.py) that override the startup settings:
vLLM's extra config, then the environment, then the defaults, with the file's keys on top.
It is read at start (a bad file stops vLLM's start, naming the file and key) and then
looked at every ``kvbroker_settings_poll_s`` by a daemon thread. A change is parsed and
validated in full (``load_settings``); a file that is unreadable, not a JSON object, has an
unknown key or a bad value, or changes a key that cannot change while vLLM runs
(``FROZEN``), is refused with one WARNING line naming the file and the reason, and the
settings in force keep running.

No signal: vLLM's engine owns the process's signal handlers (SIGHUP among them, as
SIGTERM/SIGINT), and a handler of ours would replace or be replaced by its own.

Two threads, and only one touches the core. The watcher's thread reads and validates, then
hands the new settings over (one attribute, under a lock) and sets the translator's
``reload_due``. vLLM's scheduler thread, which calls the translator, applies them at its
next call boundary (``LiveSettings.apply_pending``): the buffered calls first, under the
old policy; then the embedded core is reconfigured (``EmbeddedCore.reconfigure``: the next
config generation, a CONFIG record at that point of the journal, which replay follows as it
follows ``kvbroker serve``'s reloads); then one INFO line, then the ``on_reload`` listeners.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any, Final

from broker.config import ConfigError
from clients.regular_file import open_regular
from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.policy_calls import Translator
from vllm_integration.decisions_to_vllm.settings import PREFIX, OffloadSettings, SettingsError, load_settings

# Under vLLM's logger (this runs inside vLLM): vLLM's logging configuration shows it.
log = logging.getLogger("vllm.kvbroker")

# Settings that cannot change while vLLM runs: where and as whom the journal is written,
# how the engine reaches the broker, the core's history (sized with the tier at start), and
# the settings file itself. A file that changes one is refused whole.
FROZEN: Final = (
    "mode",
    "journal",
    "journal_stream",
    "journal_flush_ms",
    "journal_exit_s",
    "client_id",
    "broker",
    "broker_tier",
    "history_ghosts",
    "settings_file",
    # The reporter's server, file and timer are set up at start (vllm_integration/decisions_to_vllm/report.py).
    "report_s",
    "metrics_port",
    "metrics_host",
    "status_file",
    "status_s",
)
# Sidecar mode: the broker's stream was opened for this tenant.
FROZEN_SIDECAR: Final = ("tenant",)
# A settings file is a few lines; past this it is refused unread (a wrong path).
MAX_FILE_BYTES: Final = 1 << 20

Listener = Callable[[OffloadSettings, OffloadSettings], None]


def read_file(path: str) -> bytes:
    """The file's bytes; SettingsError naming the file when it cannot be read or is no
    regular file (a FIFO's open would wait for a writer forever: vLLM's start, or the
    watcher, hung; read as the journal and trace readers read, clients.regular_file)."""
    try:
        with open_regular(path) as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise SettingsError(f"settings file {path}: unreadable ({exc.strerror or exc})") from None
    if len(data) > MAX_FILE_BYTES:
        raise SettingsError(f"settings file {path}: larger than {MAX_FILE_BYTES} bytes")
    return data


def file_keys(path: str, data: bytes) -> dict[str, Any]:
    """The file's keys: a JSON object. SettingsError naming the file and the reason."""
    try:
        keys = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SettingsError(f"settings file {path}: not valid JSON ({exc})") from None
    if not isinstance(keys, dict):
        raise SettingsError(f"settings file {path}: expected a JSON object of kvbroker_* keys, got {type(keys).__name__}")
    if PREFIX + "settings_file" in keys:
        raise SettingsError(f"settings file {path}: {PREFIX}settings_file: cannot be set in the settings file itself")
    return keys


def with_file(
    extra: Mapping[str, Any], path: str, data: bytes, environ: Mapping[str, str] | None = None, *, rank: int = 0
) -> OffloadSettings:
    """The settings of ``extra`` (and the environment) with the file's keys on top, validated
    in full; SettingsError naming the file and the key."""
    return load_settings(extra, environ, rank=rank, overrides=file_keys(path, data), overrides_from=f"settings file {path}")


def settings_at_start(
    extra: Mapping[str, Any], environ: Mapping[str, str] | None = None, *, rank: int = 0
) -> tuple[OffloadSettings, bytes | None]:
    """The settings to start with, and the settings file's bytes when there is one (what
    the watcher compares with). A file that is not there yet is watched for; one that is
    there and bad stops the start (SettingsError naming the file and the key)."""
    settings = load_settings(extra, environ, rank=rank)
    path = settings.resolved_settings_file()
    if not path:
        return settings, None
    if not os.path.exists(path):
        log.info("kvbroker: settings file %s is not there yet; the startup settings run until it is", path)
        return settings, None
    data = read_file(path)
    return with_file(extra, path, data, environ, rank=rank), data


def changes(old: OffloadSettings, new: OffloadSettings) -> str:
    """What differs, for the log: ``policy lru -> arc, policy_params {} -> {...}``."""
    parts = [
        f"{f.name} {_show(getattr(old, f.name))} -> {_show(getattr(new, f.name))}"
        for f in dataclasses.fields(OffloadSettings)
        if getattr(old, f.name) != getattr(new, f.name)
    ]
    return ", ".join(parts) or "nothing"


def _show(value: Any) -> str:
    return value if isinstance(value, str) and value else repr(value)


class LiveSettings:
    """The settings in force, the settings file's watcher, and the switch.

    ``check`` runs on the watcher's thread (or a test's); ``apply_pending`` on vLLM's
    (the translator calls it through ``on_reload_due``). ``on_reload`` listeners are called
    with (old, new) settings after each switch, on vLLM's thread."""

    def __init__(
        self,
        settings: OffloadSettings,
        extra: Mapping[str, Any],
        *,
        local: EmbeddedCore,
        translator: Translator,
        capacity: int,
        seen: bytes | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.path = settings.resolved_settings_file()
        self.on_reload: list[Listener] = []
        self.reloads = 0
        self.refused = 0
        self._extra = dict(extra)
        self._environ = environ
        self._local = local
        self._translator = translator
        self._capacity = capacity
        # What the file held when last looked at (applied or refused): a file is judged
        # once per content, so a refused one is not warned about at every poll.
        self._seen = seen
        # The newest valid settings not yet applied (the watcher's thread writes it, vLLM's
        # takes it), and what the watcher compares the next file with.
        self._lock = threading.Lock()
        self._pending: OffloadSettings | None = None
        self._latest = settings
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        translator.on_reload_due = self.apply_pending

    def start(self) -> None:
        """Start watching the settings file (no thread when there is none)."""
        if self.path and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="kvbroker-settings", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def _watch(self) -> None:
        # The poll interval is read at each turn: it may change live too.
        while not self._stop.wait(self._latest.settings_poll_s):
            try:
                self.check()
            except Exception:  # the watcher must outlive any surprise, and say so
                log.exception("kvbroker: looking at settings file %s failed", self.path)

    def check(self) -> bool:
        """Look at the settings file (the watcher's thread). Valid settings that differ from
        the ones in force are handed over to vLLM's thread (True); a bad file is refused
        with one WARNING line and changes nothing (False).

        The file's content is compared, not its mtime and size: a rewrite within the
        filesystem's timestamp tick with the same length (``"arc"`` for ``"lru"``) would
        otherwise go unseen, and reading a few hundred bytes a second costs nothing."""
        try:
            data: bytes | None = read_file(self.path)
            problem = ""
        except SettingsError as exc:
            data, problem = None, str(exc)
        if data == self._seen:
            return False
        self._seen = data
        base = self._latest
        try:
            if data is None:
                raise SettingsError(problem)
            new = with_file(self._extra, self.path, data, self._environ, rank=base.rank)
            self._check_frozen(base, new)
        except SettingsError as exc:
            self.refused += 1
            log.warning("kvbroker: settings file refused, the settings in force keep running (policy %s): %s", base.policy, exc)
            return False
        if new == base:
            return False
        with self._lock:
            self._pending = new
            self._latest = new
        self._translator.reload_due = True
        return True

    def _check_frozen(self, old: OffloadSettings, new: OffloadSettings) -> None:
        frozen = FROZEN + (FROZEN_SIDECAR if old.mode == "sidecar" else ())
        for name in frozen:
            before, after = getattr(old, name), getattr(new, name)
            if before != after:
                raise SettingsError(
                    f"settings file {self.path}: {PREFIX}{name}: cannot change while vLLM runs ({before!r} -> {after!r}); "
                    "restart vLLM to change it"
                )

    def apply_pending(self) -> None:
        """Switch to the settings handed over, if any (vLLM's thread, between two calls)."""
        with self._lock:
            new, self._pending = self._pending, None
        if new is None:
            return
        old = self.settings
        translator, local = self._translator, self._local
        translator.apply()  # the calls so far are the old policy's
        # Sidecar mode: the switch is the local core's, the fallback's (and mirror's).
        fallback = new.fallback_policy if new.mode == "sidecar" else ""
        config = new.core_config(self._capacity, fallback or None)
        generation = local.generation
        if config != local.config:
            try:
                generation = local.reconfigure(config)
            except ConfigError as exc:
                self.refused += 1
                with self._lock:
                    if self._pending is None:  # nothing newer came: the next file compares with these
                        self._latest = old
                log.warning("kvbroker: settings from %s refused by the core, the settings in force keep running: %s", self.path, exc)
                return
        self.settings = new
        if new.tenant != old.tenant:
            translator.set_tenant(new.tenant)
        deadline = getattr(translator.decider, "deadline_s", None)
        if deadline is not None and new.deadline_ms != old.deadline_ms:
            translator.decider.deadline_s = new.deadline_ms / 1000.0  # type: ignore[attr-defined]
        self.reloads += 1
        log.info("kvbroker: settings reloaded from %s: %s (config generation %d)", self.path, changes(old, new), generation)
        for listener in self.on_reload:
            try:
                listener(old, new)
            except Exception:  # a listener's failure must not reach vLLM's call
                log.exception("kvbroker: a listener of the settings reload failed")
