"""The seam between the RL loop and everything that scores a sample.

A reward function gets the model's completion and the sample's reference data (`spec`:
tests, a gold answer, expected tags) and returns a `RewardResult`. Failures of the
system (sandbox errors, crashes of the reward function) are never a reward of 0: they
come back as `error_kind="infra"` with `reward=None`, and the RL loop keeps them apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

JSON = None | bool | int | float | str | list["JSON"] | dict[str, "JSON"]
ErrorKind = Literal["infra", "invalid_spec"]


REPAIRED = "completion_repaired"
"""Key of `RewardResult.details` set by the reward server when the completion held lone
surrogates (text decoded from bytes that are not UTF-8): how many were scored as
U+FFFD (see wire.py)."""


class InvalidSpec(ValueError):
    """The reference data of a sample is malformed (bad input, not a model failure)."""


@dataclass(frozen=True)
class RewardRequest:
    """One sample to score, as it travels to the reward server."""

    id: str
    """Unique per attempt; the server runs each id at most once (see server.py)."""
    reward: str
    """Name of the reward function (a key of the server's registry)."""
    completion: str
    spec: Mapping[str, Any]

    def to_json(self) -> dict[str, JSON]:
        return {"id": self.id, "reward": self.reward, "completion": self.completion,
                "spec": dict(self.spec)}  # fmt: skip


@dataclass(frozen=True)
class RewardResult:
    reward: float | None
    """In [0, 1]; None exactly when `error_kind` is set."""
    error_kind: ErrorKind | None = None
    error: str | None = None
    passed: int | None = None
    """Tests passed (code rewards)."""
    total: int | None = None
    compile_ok: bool | None = None
    """Compile status as its own signal (None where nothing is compiled)."""
    status: str | None = None
    """The sandbox's status of the decisive execution, for metrics."""
    details: dict[str, JSON] = field(default_factory=dict)
    seconds: float | None = None
    """Wall time of the reward function on the server (set by the server), for
    per-domain latency; None when it did not run."""

    def __post_init__(self) -> None:
        if (self.reward is None) != (self.error_kind is not None):
            raise ValueError("a RewardResult has either a reward or an error_kind, not both")
        if self.reward is not None and not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"reward must be in [0, 1], got {self.reward}")

    @classmethod
    def infra(cls, message: str, **kw: Any) -> RewardResult:
        return cls(reward=None, error_kind="infra", error=message, **kw)

    @classmethod
    def invalid(cls, message: str) -> RewardResult:
        return cls(reward=None, error_kind="invalid_spec", error=message)

    def to_json(self) -> dict[str, JSON]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RewardResult:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@runtime_checkable
class RewardFunction(Protocol):
    """Scores one completion. Implementations must be thread-safe: the server calls
    `score` from many threads. They raise InvalidSpec for malformed reference data and
    return `RewardResult.infra(...)` when the system failed."""

    name: str

    def score(self, completion: str, spec: Mapping[str, Any]) -> RewardResult: ...
