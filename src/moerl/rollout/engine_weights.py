"""How a `MegatronEngine` takes a new weight version: from a published directory or over the
trainer's weight group, every rank of the server at once, all or none.

A failed load leaves the old weights and version: they are read back from their own
checkpoint (or from a host copy when they were a random init). A streamed version
arrives whole on every rank before any parameter changes (`weight_receive`).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from megatron.core.models.gpt import GPTModel

from moerl.models.arch import MoEArch
from moerl.rollout.ranks import Command, WeightLoadError
from moerl.rollout.weight_group import GroupSpec, Manifest, abort
from moerl.rollout.weight_receive import ReceiveLink, install, join, stage

if TYPE_CHECKING:
    from moerl.rollout.ranks import RolloutRanks


class EngineBroken(RuntimeError):
    """The weights are in an unknown state (a failed update could not be undone)."""


class WeightUpdates:
    """The weight-update half of `MegatronEngine` (it sets these attributes)."""

    model: GPTModel
    arch: MoEArch | None
    ranks: RolloutRanks | None
    lock: threading.RLock
    broken: str | None
    _version: int
    _weights_path: Path | None
    _link: ReceiveLink | None  # the trainer's weight group, once joined
    last_received: list[dict[str, int]]  # what each rank received of the last version

    def _weights_changed(self) -> None:
        """Called after every change of the weights (the engine drops what it cached)."""

    def load_weights(self, path: str | Path, version: int) -> None:
        """Swap in the weights at `path` (a `models.weights` checkpoint) as `version`."""
        from moerl.models.weights_marker import is_complete

        path = Path(path)
        if not is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete weights checkpoint")
        with self.lock:
            if self.ranks is not None:
                self.ranks.send(Command("load", path=str(path), version=version))
            self.load_on_every_rank(path, version)

    def load_on_every_rank(self, path: str | Path, version: int) -> None:
        """This rank's shard of `path`; all ranks keep the old weights unless every
        rank loaded its shard."""
        from moerl.models.weights import load_weights

        path = Path(path)
        backup = None
        if self._weights_path is None:
            backup = {k: v.detach().to("cpu", copy=True)
                      for k, v in self.model.state_dict().items() if torch.is_tensor(v)}
        error: BaseException | None = None
        try:
            load_weights([self.model], path)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            error = exc
        loaded = error is None
        if self.ranks is not None:
            loaded = self.ranks.all_ok(loaded)
        if not loaded:
            self._restore(backup)
            why = ("another rank failed" if error is None else
                   str(error).splitlines()[0] if str(error) else repr(error))
            raise WeightLoadError(f"loading {path} as version {version} failed: {why}") \
                from error
        self._weights_path, self._version = path, version
        self.model.eval()
        self._weights_changed()

    def join_weight_group(self, spec: GroupSpec) -> None:
        """Join the trainer's weight group (`rollout.weight_group`), every rank of the
        server at once, and agree what each rank takes from which trainer rank; returns
        when the whole group has joined."""
        with self.lock:
            if self.ranks is not None:
                self.ranks.send(Command("join", group=spec))
            self.join_on_every_rank(spec)

    def join_on_every_rank(self, spec: GroupSpec) -> None:
        """Raises WeightLoadError on every rank unless every rank joined."""
        if self.arch is None:
            raise WeightLoadError("this engine was built without its architecture; a weight "
                                  "group needs it")
        self._drop_link()
        rank = spec.rank_offset + (self.ranks.rank if self.ranks is not None else 0)
        problem = None
        try:
            self._link = join(spec, rank, self.model, self.arch)
        except Exception as exc:
            problem = f"joining weight group {spec.group_name}: {exc}"
        if not self._all_ok(problem is None):
            self._drop_link()
            raise WeightLoadError(problem or "another rank of this server could not join")

    def receive_weights(self, manifest: Manifest) -> None:
        """Take version `manifest.version` from the weight group: every tensor arrives
        before any parameter changes, so a failure leaves the old version whole."""
        with self.lock:
            if self.ranks is not None:
                self.ranks.send(Command("receive", manifest=manifest))
            self.receive_on_every_rank(manifest)

    def receive_on_every_rank(self, manifest: Manifest) -> None:
        """Raises WeightLoadError on every rank (old weights kept) unless every rank
        received its whole shard; a failed group is left, the next version joins anew."""
        problem, staged = None, None
        if self._link is None:
            problem = "no weight group joined (POST /init_weights_update_group first)"
        else:
            try:
                staged = stage(self._link, manifest)
            except Exception as exc:
                problem = f"version {manifest.version}: {exc}"
        if not self._all_ok(problem is None) or staged is None:
            self._drop_link()
            raise WeightLoadError(problem or f"version {manifest.version}: another rank of "
                                  "this server did not receive it")
        report = {**staged.traffic.as_dict(), "held_bytes": staged.held_bytes}
        self.last_received = (self.ranks.gather_counts(report) if self.ranks is not None
                              else [report])
        install(staged)
        self._weights_path, self._version = None, manifest.version
        self.model.eval()
        self._weights_changed()

    def _all_ok(self, ok: bool) -> bool:
        return self.ranks.all_ok(ok) if self.ranks is not None else ok

    def _drop_link(self) -> None:
        if self._link is not None:
            abort(self._link.group)
            self._link = None

    def _restore(self, backup: dict[str, torch.Tensor] | None) -> None:
        from moerl.models.weights import load_weights

        try:
            if backup is not None:
                self.model.load_state_dict(backup, strict=False)
            elif self._weights_path is not None:
                load_weights([self.model], self._weights_path)
        except BaseException as exc:  # the model now holds a mix of two versions
            self.broken = f"weight update failed and the old weights could not be restored: {exc}"
            raise EngineBroken(self.broken) from exc
