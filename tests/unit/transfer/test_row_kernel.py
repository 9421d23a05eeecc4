"""The compiled page-row kernel against a plain numpy reference, for every word size and both host layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.memory.pools import DevicePool, HostPool, KVShape
from runtime.transfer.engine import copy_layers
from runtime.transfer.row_kernel import RowView


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize(
    "head_dim,dtype,ps",
    [(8, torch.float16, 4), (3, torch.float16, 1), (1, torch.float16, 1), (1, torch.uint8, 1), (5, torch.float32, 2)],
)
def test_rows_copied_exactly_and_nothing_else(layout, head_dim, dtype, ps):
    shape = KVShape(num_layers=4, num_kv_heads=1, head_dim=head_dim, dtype=dtype)
    dev = DevicePool(shape, 12 * ps, ps)
    host = HostPool(shape, 10 * ps, ps, layout)
    gen = torch.Generator().manual_seed(head_dim * 31 + ps)
    dev.buffer.copy_(torch.randint(1, 100, dev.buffer.shape, generator=gen).to(dtype))
    src_rows, dst_rows = dev.page_rows(), host.page_rows()
    before = dst_rows.copy()
    sp = np.array([11, 0, 1, 2, 7], dtype=np.int64)
    dp = np.array([3, 4, 5, 6, 0], dtype=np.int64)
    copy_layers(RowView(src_rows), RowView(dst_rows), slice(1, 3), sp, dp)
    want = before.copy()
    want[:, 1:3, dp] = src_rows[:, 1:3, sp]
    assert np.array_equal(dst_rows, want)


def test_row_view_rejects_negative_strides_and_mismatched_rows():
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float16)
    rows = DevicePool(shape, 8, 2).page_rows()
    with pytest.raises(ValueError):
        RowView(rows[:, ::-1])
    other = RowView(DevicePool(KVShape(2, 1, 8, torch.float16), 8, 2).page_rows())
    one = np.zeros(1, dtype=np.int64)
    from runtime.transfer.row_kernel import copy_rows

    with pytest.raises(ValueError):
        copy_rows(RowView(rows), other, 0, 1, one, one)
