"""Store and Load as custom operators (`magis.backend.host_ops`): their fake kernels give the
strides the real copies have, or a compiled graph asserts on them (a Store of a sliced
attention projection through Inductor: "expected stride 32==96", issue 43)."""

from __future__ import annotations

import pytest
import torch

from magis.backend import host_ops
from magis.backend.runtime import HostPool, host_strides

BASE = torch.arange(3 * 4 * 6, dtype=torch.float64).reshape(3, 4, 6)
VIEWS = {
    "contiguous": BASE,
    "transposed": BASE.transpose(0, 2),
    "sliced": BASE[:, :, 2:4],
    "expanded": BASE[:, :1].expand(3, 5, 6),
    "size-one slice": BASE[:, 1:2, :3],
}


@pytest.mark.parametrize("name", VIEWS)
def test_a_host_copy_has_the_strides_its_fake_kernel_gives(name):
    x = VIEWS[name]
    pool = HostPool()
    number = host_ops.pool_number(pool)
    stored = torch.ops.magis.store(x, number)
    assert torch.equal(stored, x)
    assert stored.stride() == host_strides(x)
    assert stored.untyped_storage().nbytes() == x.numel() * x.element_size()
    loaded = torch.ops.magis.load(stored, number, torch.device("cpu"))
    assert torch.equal(loaded, x) and loaded.stride() == stored.stride()
    torch.library.opcheck(torch.ops.magis.store.default, (x, number))
    torch.library.opcheck(torch.ops.magis.load.default, (stored, number, torch.device("cpu")))


def test_dense_strides_are_kept_and_others_become_row_major():
    assert host_strides(BASE.transpose(0, 2)) == (1, 6, 24)
    assert host_strides(BASE[:, :, 2:4]) == (8, 2, 1)
    assert host_strides(BASE[:, :1].expand(3, 5, 6)) == (30, 6, 1)
