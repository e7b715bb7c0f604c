"""``kvbroker_journal`` naming a file in a folder that does not exist stops vLLM's start with
one line naming the key and the folder (not a JournalError about a lock file); a journal
that cannot be opened otherwise (another process holds it) names the key too."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_integration.decisions_to_vllm.embedded import EmbeddedCore
from vllm_integration.decisions_to_vllm.settings import SettingsError, load_settings


def core(journal: str) -> EmbeddedCore:
    return EmbeddedCore(load_settings({"kvbroker_policy": "lru", "kvbroker_journal": journal}, {}), 16)


def test_a_journal_in_a_missing_folder_is_one_line_naming_the_key_and_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "not" / "there"
    with pytest.raises(SettingsError) as caught:
        core(f"file://{folder}/vllm-{{pid}}.journal")
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("kvbroker_journal: ")
    assert f"the folder {folder} does not exist" in message
    assert ".lock" not in message
    assert not folder.exists()  # nothing created on the way


def test_a_journal_another_process_holds_names_the_key(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/vllm.journal"
    first = core(url)
    try:
        with pytest.raises(SettingsError, match=r"^kvbroker_journal: cannot open .*vllm\.journal"):
            core(url)
    finally:
        first.close()


def test_a_journal_in_an_existing_folder_opens(tmp_path: Path) -> None:
    embedded = core(f"file://{tmp_path}/vllm.journal")
    embedded.close()
    assert (tmp_path / "vllm.journal").stat().st_size > 0


@pytest.mark.vllm
def test_vllm_s_start_stops_with_that_line(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from tests.vllm_integration.decisions_to_vllm.manager_driver import ADAPTER_CLASS, ADAPTER_MODULE, offloading_config

    extra = {
        "eviction_policy": ADAPTER_CLASS,
        "cache_policy_module_path": ADAPTER_MODULE,
        "kvbroker_journal": f"file://{tmp_path}/no/x.journal",
    }
    config = offloading_config(extra)
    with pytest.raises(ValueError, match=rf"^kvbroker_journal: the folder {tmp_path}/no does not exist"):
        CPUOffloadingSpec(config).get_manager()  # type: ignore[arg-type]
