"""``storage_shortfall``: where a tensor's elements end, against the bytes its storage holds; and
``refuse_short_storage``, the one refusal every entry makes of a tensor that falls short.

A tensor needs its storage up to the end of its last element, ``(storage_offset + 1 + sum((size - 1) * stride))
* element_size`` bytes: a contiguous one ``(storage_offset + numel) * element_size``, a slice with gaps more than
its ``numel``, an ``expand()``-ed one (stride 0) less. FSDP frees a tensor's memory with
``untyped_storage().resize_(0)`` and keeps the tensor; nothing here reads the elements, so freed and shrunk
storages are safe to look at in this process. The entries' own refusals (naming their arguments and leaves,
nothing written): tests/test_kernels_cpu.py, test_kernels_triton.py, test_grad_copy.py, test_adam_errors.py,
test_offload_misuse.py and test_offload_edits_and_refusals.py.
"""

from __future__ import annotations

import pytest
import torch

from sofx.errors import LeafError, UndoError
from sofx.kernels.storage import in_storage, refuse_short_storage, storage_shortfall


def _cut(t: torch.Tensor, keep: int) -> torch.Tensor:
    """``t`` with its storage resized to ``keep`` bytes (the tensor keeps its shape, strides and offset)."""
    t.untyped_storage().resize_(keep)
    return t


def test_a_tensor_in_its_whole_storage_falls_short_of_nothing():
    assert storage_shortfall(torch.randn(3, 4)) is None
    assert storage_shortfall(torch.randn(4, 5).t()) is None  # (dense, not contiguous)
    assert storage_shortfall(torch.randn(10, 8)[:, ::2]) is None  # (gaps)
    assert storage_shortfall(torch.randn(10, 8)[5:, 1::2]) is None  # (gaps, offset: its last element is the last)
    assert storage_shortfall(torch.tensor(2.0)) is None


def test_a_freed_or_shrunk_contiguous_tensor_falls_short_by_where_its_last_element_ends():
    assert storage_shortfall(_cut(torch.randn(3000), 0)) == (0, 12000)
    assert storage_shortfall(_cut(torch.randn(3000), 40)) == (40, 12000)
    assert storage_shortfall(_cut(torch.randn(3000, dtype=torch.bfloat16), 5998)) == (5998, 6000)
    assert storage_shortfall(_cut(torch.tensor(2.0), 0)) == (0, 4)


def test_a_view_with_its_storage_offset_near_the_end_needs_the_storage_up_to_its_last_element():
    base = torch.randn(100)
    tail, last, before_last = base[97:], base[99:], base[98:99]  # (views made first: torch checks them then)
    assert storage_shortfall(tail) is None and storage_shortfall(last) is None
    _cut(base, 396)  # one element short: the views' last element was the storage's last
    assert storage_shortfall(tail) == (396, 400)
    assert storage_shortfall(last) == (396, 400)
    assert storage_shortfall(before_last) is None  # (ends at byte 396)
    _cut(base, 399)  # a byte short
    assert storage_shortfall(last) == (399, 400)


def test_an_expanded_view_needs_only_the_elements_it_repeats():
    one = torch.randn(1).expand(37)  # stride 0: every element is the first
    assert storage_shortfall(one) is None
    assert storage_shortfall(_cut(one, 0)) == (0, 4)
    rows = torch.randn(3, 1).expand(3, 5)  # strides (1, 0): needs 3 elements, has 15
    assert storage_shortfall(rows) is None
    assert storage_shortfall(_cut(rows, 8)) == (8, 12)
    last = torch.randn(100)[99:].expand(10)  # an expanded view of the storage's last element
    assert storage_shortfall(last) is None
    assert storage_shortfall(_cut(last, 396)) == (396, 400)


def test_a_view_with_gaps_needs_its_span_not_its_numel():
    t = torch.randn(10, 8)[:, ::2]  # (10, 4), strides (8, 2): 40 elements over 79 of memory
    _cut(t, 316)
    assert storage_shortfall(t) is None  # (ends exactly at byte 316)
    _cut(t, 312)  # still more than (offset + numel) * element_size = 160 bytes
    assert storage_shortfall(t) == (312, 316)
    tail = torch.randn(10, 8)[5:, 1::2]  # offset 41, strides (8, 2): ends at element 80
    _cut(tail, 316)
    assert storage_shortfall(tail) == (316, 320)


def test_a_dimension_of_one_element_needs_nothing_whatever_its_stride():
    t = torch.randn(6).as_strided((1, 6), (1000, 1))  # contiguous: a size-1 dimension's stride has no say
    assert t.is_contiguous() and storage_shortfall(t) is None
    assert storage_shortfall(torch.randn(6).as_strided((6, 1), (1, 1000))) is None


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5)])
def test_an_empty_tensor_needs_nothing_even_of_a_freed_storage(shape):
    assert storage_shortfall(_cut(torch.empty(shape), 0)) is None
    base = torch.randn(100)
    middle = base[50:50]  # (storage offset 50, no element)
    _cut(base, 0)
    assert storage_shortfall(middle) is None


def test_a_refusal_names_the_tensor_and_says_where_its_elements_end():
    t = _cut(torch.randn(10, 8)[:, ::2], 312)
    with pytest.raises(LeafError) as e:
        refuse_short_storage(t, "grads['w']")
    assert str(e.value) == ("grads['w']: its storage holds 312 bytes, but its elements (shape (10, 4), strides (8, 2), "
                            "storage offset 0, torch.float32) reach byte 316: its memory was freed or shrunk "
                            "(untyped_storage().resize_(), as FSDP frees a tensor's memory); give it its memory back "
                            "(or a tensor that has it) before this call")
    with pytest.raises(UndoError, match=r"^params\['w'\]: the record's gradient: its storage holds 0 bytes"):
        refuse_short_storage(_cut(torch.randn(3), 0), lambda: "params['w']: the record's gradient", UndoError)


def test_a_refusal_builds_the_name_only_to_raise():
    built = []

    def name() -> str:
        built.append(1)
        return "x"

    refuse_short_storage(torch.randn(3), name)
    refuse_short_storage(torch.randn(1).expand(5), name)
    refuse_short_storage(_cut(torch.empty(0), 0), name)
    assert not built
    with pytest.raises(LeafError, match="^x: its storage holds 0 bytes"):
        refuse_short_storage(_cut(torch.randn(3), 0), name)
    assert built == [1]


def test_the_common_case_test_passes_only_contiguous_tensors_in_their_storage():
    base = torch.randn(100)
    tail, last = base[97:], base[99:]
    assert in_storage(torch.randn(3, 4)) and in_storage(tail) and in_storage(last)
    assert in_storage(torch.empty(0)) and in_storage(_cut(torch.empty(0), 0))
    # what it cannot tell (not contiguous) is storage_shortfall's to decide, in its storage or not
    assert not in_storage(torch.randn(4, 5).t()) and not in_storage(torch.randn(1).expand(37))
    _cut(base, 396)
    assert not in_storage(tail) and not in_storage(last) and in_storage(base[:99])
    assert not in_storage(_cut(torch.randn(3000), 0))
    for t in (torch.randn(3, 4), tail, last, base[:99], torch.randn(4, 5).t(), _cut(torch.randn(8), 16)):
        assert not in_storage(t) or storage_shortfall(t) is None
