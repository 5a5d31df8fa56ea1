"""The launch plan and chunk search of pipegoose's multi-tensor kernels (``pipegoose_multi_tensor.cuh``, used by
``multi_tensor_adam.cu`` and ``clip_grad_norm.cu``), built on the CPU with the host compiler (the header is host and
device code) into a test extension (``tests/kernels/csrc/multi_tensor_plan.cpp``) with the kernels' two tables and a
small one that splits often. Checks, on lists of odd sizes with empty and misaligned tensors:

* the launches hold the non-empty tensors in order, a launch is split only when the next tensor does not fit (its
  table is full or its chunk count would pass the chunk type's maximum), the chunk prefix sums count
  ceil(numel / elems_per_chunk) chunks per tensor, and a tensor is on the vector path only when all its pointers are
  16-byte aligned;
* the walk of the chunks as each kernel does it (Adam: a block per chunk, searching from tensor 0; clipping: a fixed
  grid of blocks, each walking one contiguous range of chunks (``chunk_range``, ``next_tensor``; the ranges differ by
  at most one chunk)) visits every chunk exactly once and finds the tensor that owns it.

Marked ``slow``: it compiles a C++ extension (about a minute on two cores)."""

from __future__ import annotations

import bisect
import os
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# (lists, tensors a launch, chunk type's maximum) of the extension's tables
TABLES = {"small": (2, 3, INT32_MAX), "adam": (4, 384, INT32_MAX), "clip": (1, 1024, INT64_MAX)}


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler ($CXX or c++) to build the test extension")
    from torch.utils.cpp_extension import load
    build = tmp_path_factory.mktemp("multi_tensor_plan")
    return load(name="pg_multi_tensor_plan_test", sources=[str(ROOT / "tests/kernels/csrc/multi_tensor_plan.cpp")],
                extra_include_paths=[str(ROOT / "pipegoose/kernels/csrc")], build_directory=str(build),
                extra_cflags=["-O1"], verbose=False)


def make_lists(sizes, n_lists, misaligned=(), seed=0):
    """``n_lists`` lists of float32 tensors of ``sizes``; tensor i of list k is a view one element into a buffer when
    ``(k, i)`` is in ``misaligned`` (4 bytes off 16-byte alignment)."""
    lists = []
    for k in range(n_lists):
        lst = []
        for i, n in enumerate(sizes):
            if (k, i) in misaligned:
                lst.append(torch.empty(n + 1)[1:])
            else:
                lst.append(torch.empty(n))
        lists.append(lst)
    return lists


def check_plan(launches, lists, elems, table):
    n_lists, max_tensors, max_chunks = TABLES[table]
    want = [i for i, t in enumerate(lists[0]) if t.numel() > 0]
    got = []
    for j, l in enumerate(launches):
        count, start = l["count"], l["chunk_start"]
        assert 1 <= count <= max_tensors and len(l["numel"]) == count
        assert start[0] == 0 and start[-1] == l["chunks"] <= max_chunks
        for s in range(count):
            i = want[len(got)]
            got.append(i)
            assert l["numel"][s] == lists[0][i].numel()
            assert start[s + 1] - start[s] == -(-lists[0][i].numel() // elems)
            for k in range(n_lists):
                assert l["ptr"][k][s] == lists[k][i].data_ptr()
            assert l["aligned"][s] == int(all(lists[k][i].data_ptr() % 16 == 0 for k in range(n_lists)))
        if j + 1 < len(launches):   # split only where the next tensor does not fit
            nxt = -(-launches[j + 1]["numel"][0] // elems)
            assert count == max_tensors or l["chunks"] + nxt > max_chunks
    assert got == want


def check_walk(walk, launches, grid):
    for j, l in enumerate(launches):
        steps = [w for w in walk if w[0] == j]
        assert sorted(c for _, _, c, _ in steps) == list(range(l["chunks"])), "every chunk exactly once"
        g = l["chunks"] if grid == 0 else min(grid, l["chunks"])
        per, extra = divmod(l["chunks"], g)
        firsts = [b * per + min(b, extra) for b in range(g + 1)]   # the contiguous ranges: sizes per + 1, then per
        for _, b, c, t in steps:
            if grid == 0:
                assert c == b
            else:
                assert firsts[b] <= c < firsts[b + 1], f"launch {j}: block {b} took chunk {c}"
            assert t == bisect.bisect_right(l["chunk_start"], c) - 1, f"launch {j}: chunk {c} found tensor {t}"
            assert l["chunk_start"][t] <= c < l["chunk_start"][t + 1]


def test_tables_fit_the_parameter_block(ext):
    assert ext.adam_table_bytes == 384 * (4 * 8 + 8 + 4 + 1) + 4 + 4    # 17288, padded to 8 bytes
    assert ext.clip_table_bytes == 1024 * (8 + 8 + 8 + 1) + 8           # 25608
    assert max(ext.adam_table_bytes, ext.clip_table_bytes) < 32764


@pytest.mark.parametrize("elems", [1, 4, 7])
def test_small_table_splits_and_walks(ext, elems):
    sizes = [5, 0, 17, 1, 0, 0, 33, 8, 9, 2, 0, 40, 3]
    lists = make_lists(sizes, 2, misaligned={(1, 2), (0, 7), (0, 11), (1, 11)})
    launches = ext.describe_small(lists, elems)
    assert len(launches) == 3    # nine non-empty tensors, three a launch
    check_plan(launches, lists, elems, "small")
    assert [a for l in launches for a in l["aligned"]] == [1, 0, 1, 1, 0, 1, 1, 0, 1]
    check_walk(ext.walk_small(lists, elems, 0), launches, 0)
    for grid in (1, 2, 5, 1000):
        check_walk(ext.walk_small(lists, elems, grid), launches, grid)


def test_only_empty_tensors_plan_no_launch(ext):
    assert ext.describe_clip(make_lists([0, 0], 1), 8) == []
    assert ext.walk_clip(make_lists([0], 1), 8, 3) == []


def test_adam_table_over_several_launches(ext):
    gen = torch.Generator().manual_seed(1)
    sizes = [int(s) for s in torch.randint(0, 20000, (1000,), generator=gen)]
    sizes[::97] = [0] * len(sizes[::97])
    lists = make_lists(sizes, 4, misaligned={(3, 5), (1, 400), (0, 999)})
    launches = ext.describe_adam(lists, 4096)
    assert [l["count"] for l in launches] == [384, 384, 1000 - 384 * 2 - len(sizes[::97])]
    check_plan(launches, lists, 4096, "adam")
    check_walk(ext.walk_adam(lists, 4096, 0), launches, 0)


@pytest.mark.parametrize("grid", [1, 7, 132 * 6, 10**6])
def test_clip_table_walks_with_a_fixed_grid(ext, grid):
    gen = torch.Generator().manual_seed(2)
    sizes = [int(s) for s in torch.randint(0, 30000, (2500,), generator=gen)]
    sizes[5:9] = [0, 8192, 8193, 1]
    lists = make_lists(sizes, 1, misaligned={(0, 3), (0, 2000)})
    launches = ext.describe_clip(lists, 8192)
    assert [l["count"] for l in launches] == [1024, 1024, 2500 - 2048 - sizes.count(0)]
    check_plan(launches, lists, 8192, "clip")
    check_walk(ext.walk_clip(lists, 8192, grid), launches, grid)


def test_chunk_count_splits_launches_at_the_int32_limit(ext):
    big = torch.empty(1).expand(2**30)    # 2**30 elements, no memory: the plan reads sizes and pointers only
    lists = [[big, big, torch.empty(5), big], [big, big, torch.empty(5), big]]
    launches = ext.describe_small(lists, 1)
    assert [l["numel"] for l in launches] == [[2**30], [2**30, 5], [2**30]]
    check_plan(launches, lists, 1, "small")
    # exactly INT32_MAX chunks fit one launch
    rest = torch.empty(1).expand(2**30 - 1)
    assert [l["chunks"] for l in ext.describe_small([[big, rest], [big, rest]], 1)] == [INT32_MAX]
    # the int64 table takes them in one launch
    assert [l["count"] for l in ext.describe_clip([lists[0]], 1)] == [4]


def test_a_tensor_of_more_chunks_than_a_launch_counts_is_refused(ext):
    huge = torch.empty(1).expand(2**31)
    with pytest.raises(RuntimeError, match=r"test_op: xs\[1\] has 2147483648 elements, more than one launch covers "
                                           r"\(1 \* 2147483647\)"):
        ext.describe_small([[torch.empty(3), huge], [torch.empty(3), huge]], 1)
    halves = ext.describe_small([[torch.empty(3), huge], [torch.empty(3), huge]], 2)   # 2 + 2**30 chunks: one launch
    assert [(l["numel"], l["chunks"]) for l in halves] == [([3, 2**31], 2 + 2**30)]
