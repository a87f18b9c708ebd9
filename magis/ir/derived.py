"""The names of the facts derived from a graph version (`Graph.derived`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class DerivedKey(Generic[T]):
    """The name of one fact derived from a graph version, of type T.

    Create one per fact, once, in the module that computes it (``PROBLEM =
    DerivedKey[Problem]("schedule.problem")``). Keys compare by identity, so two packages can
    never read each other's facts by choosing the same name; `name` is for messages only.
    """

    name: str
