"""States pickled between the processes of one search (its workers, local or Ray actors).

What compares by identity travels by name and is found again in the receiving process: the op
registry, the rules, the keys of a graph's cached facts, module-level sentinels, and the search's
cost model (the receiver puts its own in). See `_Pickler`.
"""

from __future__ import annotations

import importlib
import io
import pickle
import sys
from typing import Any

from magis.ir import DEFAULT_REGISTRY, DerivedKey
from magis.rules import Rule
from magis.search.collector import collector_paused


def _by_identity(value: Any) -> bool:
    """Objects that mean something only as themselves: fact keys, sentinels (`object()`)."""
    return isinstance(value, DerivedKey) or type(value) is object


def _module_keys() -> dict[int, tuple]:
    """Objects magis declares at module level that travel by name: identity-compared ones, and
    the rules (their matchers are closures), alone or in a module's tuple of rules.
    id -> (module, name) or (module, name, index)."""
    found: dict[int, tuple] = {}
    for name, module in list(sys.modules.items()):
        if name == "magis" or name.startswith("magis."):
            for attr, value in list(vars(module).items()):
                if _by_identity(value) or isinstance(value, Rule):
                    found[id(value)] = (name, attr)
                elif isinstance(value, tuple) and value and all(isinstance(r, Rule) for r in value):
                    for i, rule in enumerate(value):
                        found.setdefault(id(rule), (name, attr, i))
    return found


class _Pickler(pickle.Pickler):
    """Pickles a state so that it arrives whole: the op registry (its FLOP formulas are
    closures), the keys of the facts cached on a graph (`DerivedKey`: they compare by
    identity, so a copy would orphan every cached fact: storages, tables, node times) and
    module-level sentinels (a layered storage map's deleted mark) are sent by name and found
    again in the receiving process.

    So is the search's cost model, when given: a graph's node times are cached per cost model
    (by identity), so a copy would orphan them, and the copy's op-time memo (megabytes on a
    large graph) took most of the pickling of a 42,000-node state (1.3 of 1.9 s).

    `reducer_override`, not `persistent_id`: pickle asks the latter about every object, the
    millions of ints, strings and tuples of a state included (half the time of pickling it),
    and the former only about instances of other types."""

    def __init__(self, file, keys: dict[int, tuple], cost: Any = None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.keys = keys
        self.cost = cost

    def reducer_override(self, obj: Any) -> Any:
        if obj is DEFAULT_REGISTRY:
            return _registry, ()
        if obj is self.cost and obj is not None:
            return _search_cost, ()
        if isinstance(obj, Rule) and id(obj) in self.keys:
            return _by_name, self.keys[id(obj)]
        if _by_identity(obj):
            where = self.keys.get(id(obj))
            if where is None and isinstance(obj, DerivedKey):  # declared since the table was made
                self.keys.update(_module_keys())
                where = self.keys.get(id(obj))
            if where is None and type(obj) is object:
                raise pickle.PicklingError("a sentinel object() that is not at module level")
            if where is not None:
                return _by_name, where
        return NotImplemented  # pickled as usual (a key not declared: copied, its facts redone)


def _registry() -> Any:
    return DEFAULT_REGISTRY


def _by_name(module: str, attr: str, index: int | None = None) -> Any:
    value = getattr(importlib.import_module(module), attr)
    return value if index is None else value[index]


def _search_cost() -> Any:
    """Stands for the search's cost model in a pickle (`_Unpickler` puts its own in)."""
    raise pickle.UnpicklingError("a state sent with the search's cost model by name")


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, cost: Any = None) -> None:
        super().__init__(file)
        self.cost = cost

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == _search_cost.__name__ and self.cost is not None:
            cost = self.cost
            return lambda: cost
        return super().find_class(module, name)


def dumps(obj: Any, keys: dict[int, tuple] | None = None, cost: Any = None) -> bytes:
    """`obj` pickled for another magis process; `keys`: a `_module_keys()` table to reuse.
    `cost`: the search's cost model, which the receiving process holds too: sent by name
    (`loads` with the receiver's own)."""
    buf = io.BytesIO()
    with collector_paused():
        _Pickler(buf, _module_keys() if keys is None else keys, cost).dump(obj)
    return buf.getvalue()


def loads(blob: bytes, cost: Any = None) -> Any:
    """`dumps`'s object again; `cost`: this process's cost model of the search, for a blob
    that was pickled with the sender's."""
    with collector_paused():
        return _Unpickler(io.BytesIO(blob), cost).load()
