"""Live A/B split: clients assigned to policy arms by a stable hash of their id.

Each arm is a core of its own running its policy on its share of every tier, and truly
drives the clients that hash to it: their batches are applied there and its directives are
the ones they get. The hash is of the client id alone (blake2b, not Python's salted
``hash``), so a client lands on the same arm in every process, after every restart and in
every replay of the journal; replay following the journal routes batches the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib

from broker.config import ConfigError, CoreConfig, with_policy
from broker.model.core import Core


def arm_point(client_id: str) -> float:
    """The client's point in [0, 1): the first 8 bytes of blake2b(client_id)."""
    digest = hashlib.blake2b(client_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def arm_for(client_id: str, split: tuple[tuple[str, float], ...]) -> str:
    """The arm a client belongs to: arms cover [0, 1) in config order by their shares."""
    point, edge = arm_point(client_id), 0.0
    for name, share in split:
        edge += share
        if point < edge:
            return name
    return split[-1][0]  # shares sum to 1 up to rounding


def split_label(split: tuple[tuple[str, float], ...]) -> str:
    """The policy name a split reports: ``split(arc=0.5,lru=0.5)``."""
    return "split(" + ",".join(f"{name}={share:g}" for name, share in split) + ")"


def arm_config(config: CoreConfig, name: str, share: float) -> CoreConfig:
    """The config an arm's core runs: its policy (with the configured parameters when it is
    the configured policy) on ``share`` of every tier's capacity."""
    arm = with_policy(config, name)
    tiers = tuple(dataclasses.replace(t, capacity_bytes=int(t.capacity_bytes * share)) for t in config.tiers)
    return dataclasses.replace(arm, tiers=tiers)


class SplitArms:
    """The cores of a split, keyed by arm (policy) name, in config order."""

    def __init__(self, config: CoreConfig, generation: int, ablate_intent: bool = False) -> None:
        self.split = config.policy.split
        self.cores = {
            name: Core(arm_config(config, name, share), generation=generation, ablate_intent=ablate_intent) for name, share in self.split
        }
        # Routing is a pure function of the client id; memoized because it runs per batch.
        self._route: dict[str, Core] = {}

    def core_for(self, client_id: str) -> Core:
        core = self._route.get(client_id)
        if core is None:
            core = self._route[client_id] = self.cores[arm_for(client_id, self.split)]
        return core

    def follow(self, config: CoreConfig, generation: int) -> None:
        """A config change with the same arms and shares: every arm follows it (all or
        none: a refused one is rolled back)."""
        done: list[tuple[Core, CoreConfig, int]] = []
        try:
            for name, share in self.split:
                core = self.cores[name]
                done.append((core, core.config, core.generation))
                core.follow(arm_config(config, name, share), generation)
        except ConfigError:
            for core, previous, previous_generation in done:
                core.follow(previous, previous_generation)
            raise

    @property
    def label(self) -> str:
        return split_label(self.split)


class Driving:
    """The core or cores that drive clients under a config: one core, or one per split
    arm. The live broker, crash recovery and replay following a journal all go through
    it, so they route and reconfigure identically."""

    def __init__(
        self, config: CoreConfig, generation: int, *, ablate_intent: bool = False, future_uses: dict[str, list[int]] | None = None
    ) -> None:
        """``ablate_intent`` and ``future_uses``: replay only (see Core)."""
        self.ablate_intent = ablate_intent
        self.future_uses = future_uses
        self.config = config
        self.core, self.split = self._build(config, generation)

    def _build(self, config: CoreConfig, generation: int) -> tuple[Core, SplitArms | None]:
        if config.policy.split:
            split = SplitArms(config, generation, self.ablate_intent)
            return next(iter(split.cores.values())), split
        return Core(config, generation=generation, ablate_intent=self.ablate_intent, future_uses=self.future_uses), None

    def follow(self, config: CoreConfig, generation: int, *, force: bool = False) -> None:
        """Apply a config change, or raise ConfigError and change nothing. ``force``
        reconfigures even an unchanged config (a reload re-warms the policy). Entering,
        leaving or changing a split re-routes clients, which blocks already placed in a
        core cannot follow: refused while any block is allocated."""
        same_split = config.policy.split == self.config.policy.split
        if same_split and self.split is not None:
            self.split.follow(config, generation)
        elif same_split and force:
            self.core.reconfigure(config, generation)
        elif same_split:
            self.core.follow(config, generation)
        else:
            resident = sum(len(core.blocks) for core in self.cores().values())
            if resident:
                raise ConfigError(
                    f"policy.split: entering, leaving or changing a split re-routes clients; refused while {resident} blocks "
                    "are allocated (free them first, or restart on a new journal stream)"
                )
            seqs: dict[str, int] = {}
            for core in self.cores().values():
                seqs.update(core.client_seq)
            self.core, self.split = self._build(config, generation)
            for core in self.cores().values():
                core.client_seq.update(seqs)  # resume and duplicate detection carry over
        self.config = config

    def cores(self) -> dict[str, Core]:
        """The driving cores: the one core, or every split arm by name (config order)."""
        if self.split is not None:
            return self.split.cores
        return {self.core.policy_name: self.core}

    def core_for(self, client_id: str) -> Core:
        """The core that drives this client (its arm's, in a split)."""
        return self.split.core_for(client_id) if self.split is not None else self.core

    @property
    def policy_name(self) -> str:
        return self.split.label if self.split is not None else self.core.policy_name
