"""Layered maps (ir.storage): a storage map derived from its parent's shares the parent's dicts
and keeps its changes on top; it must read, and iterate, exactly as a plain dict edited the same
way."""

import random

from magis.ir.storage import Layered


def _check(layered, plain: dict) -> None:
    assert list(layered) == list(plain)  # same keys in the same order
    assert len(layered) == len(plain)
    assert dict(layered.items()) == plain
    for key in range(-5, 60):
        assert (key in layered) == (key in plain)
        assert layered.get(key, "none") == plain.get(key, "none")


def test_layered_map_reads_and_iterates_like_a_dict_through_many_versions():
    rng = random.Random(0)
    plain = {k: k * 10 for k in range(40)}
    layered = Layered(dict(plain))
    folded = 0
    for _ in range(300):  # a line of versions, each a few edits of the one before
        draft = layered.draft()
        for _ in range(rng.randrange(1, 6)):
            key = rng.randrange(55)
            op = rng.random()
            if op < 0.4:
                draft[key] = plain[key] = rng.randrange(1000)
            elif op < 0.7:
                assert draft.pop(key, None) == plain.pop(key, None)
            else:
                assert draft.setdefault(key, -1) == plain.setdefault(key, -1)
            assert (key in draft) == (key in plain)
        before = layered
        snapshot = dict(before.items())
        layered = draft.done()
        folded += layered._flat is not before._flat
        _check(layered, plain)
        assert dict(before.items()) == snapshot  # the parent version is unchanged
    assert folded >= 3  # the changes were folded into a new shared dict now and then
