"""Helpers of the kernel tests: a throw-away manifest with tiny kernels (builder tests); the norm backward's
specialised widths (NORM_SPEC_*: GPU tests; all three checked against norm_kernels.cuh by
tests/kernels/test_norm_spec_lists.py); a stable seed per test key and the allocator poisoning of the elementwise
kernels' GPU tests (SwiGLU, RoPE); the launches of the packed gated kernels (silu_and_mul, gelu_and_mul) from
the profiler."""

from __future__ import annotations

import gc
import math
import re
import textwrap
import zlib
from pathlib import Path

# BwdSpec16Ln / BwdSpec16Rms / BwdSpec32Ln / BwdSpec32Rms in norm_kernels.cuh (BwdSpecExtra): the widths whose
# backward (input and grad_output of one dtype) runs a kernel specialised to the width, by the input's bits.
NORM_SPEC_EXTRA = {
    16: {"layer_norm": (576, 896, 960, 1152, 1280, 1536, 1600, 2304, 2560, 3072, 3840, 4608, 5120, 7168),
         "rms_norm": (576, 896, 960, 1152, 1280, 1536, 1600, 2304, 2560, 3072, 3584, 3840, 4608, 5120, 6144, 7168)},
    32: {"layer_norm": (576, 896, 960, 1152, 1280, 1536, 1600, 2304, 3072, 3584, 3840, 4608, 6144),
         "rms_norm": (576, 1152, 1280, 1600, 7168)}}
# BwdSpecHidden: every dtype pair
NORM_SPEC_HIDDEN = (768, 1024, 2048, 4096, 8192)
# BwdPcache16Ln: the 16-bit LayerNorm specialisations that always read the weight from shared memory
NORM_PCACHE16_LN = (576, 768, 896, 960, 1152, 1280, 1600, 4608, 5120, 7168, 8192)
# BwdPcache16Rms: the same for 16-bit RMSNorm
NORM_PCACHE16_RMS = (576, 768, 6144)
# BwdPcache32Ln / BwdPcache32Rms: the same for fp32 input and grad_output
NORM_PCACHE32_LN = (576, 1024, 1152, 1280)
NORM_PCACHE32_RMS = (576, 1152)


def write_manifest(root: Path, op: str, *, cpp_body: str | None = None, extra_kernels: str = "",
                   flags: str = "{cxx: [-O1]}") -> Path:
    """A manifest at ``root`` with kernel ``test/tiny`` (CPU-only C++) whose op is ``torch.ops.pipegoose.<op>``."""
    (root / "csrc").mkdir(parents=True, exist_ok=True)
    (root / "bindings").mkdir(parents=True, exist_ok=True)
    (root / "LICENSE").write_text("MIT\n")
    (root / "csrc" / "tiny.cpp").write_text(cpp_body or textwrap.dedent("""\
        #include <ATen/ATen.h>
        at::Tensor tiny_add_one(const at::Tensor& x) { return x + 1; }
        """))
    (root / "bindings" / "tiny_helper.h").write_text("// helper\n#pragma once\n")
    (root / "bindings" / "tiny_binding.cpp").write_text(textwrap.dedent(f"""\
        #include <ATen/ATen.h>
        #include <torch/library.h>
        #include "tiny_helper.h"
        at::Tensor tiny_add_one(const at::Tensor& x);
        TORCH_LIBRARY_FRAGMENT(pipegoose, m) {{ m.def("{op}(Tensor x) -> Tensor"); }}
        TORCH_LIBRARY_IMPL(pipegoose, CPU, m) {{ m.impl("{op}", &tiny_add_one); }}
        """))
    path = root / "kernels.yaml"
    path.write_text(textwrap.dedent(f"""\
        schema: 1
        sources:
          local:
            project: test
            homepage: https://example.invalid/test
            license: MIT
            license_files: [LICENSE]
            fetch: {{local: {{path: .}}}}
          upstream:
            project: upstream
            homepage: https://example.invalid/upstream
            license: Apache-2.0
            license_files: [LICENSE]
            fetch: {{pypi: {{name: upstream, version: "1.0", sha256: "{"a" * 64}"}}}}
        kernels:
          test/tiny:
            source: local
            aliases: [tiny]
            files: [csrc/tiny.cpp]
            binding: bindings/tiny_binding.cpp
            entries: [{{symbol: tiny_add_one, op: {op}, role: utility}}]
            dtypes: [float32]
            backward: false
            flags: {flags}
          test/cuda_one:
            source: local
            files: [csrc/one.cu]
            binding: bindings/tiny_binding.cpp
            entries: [{{symbol: one, op: {op}_cuda, role: utility}}]
            dtypes: [float32]
            backward: false
            flags: {{nvcc: [-O3]}}
          test/vendored:
            source: upstream
            files: [src/kernel.cu, src/kernel.h]
            binding: bindings/tiny_binding.cpp
            entries: [{{symbol: k, op: {op}_vendored, role: utility}}]
            dtypes: [float16]
            backward: false
        """) + extra_kernels)
    (root / "csrc" / "one.cu").write_text("__global__ void one_kernel() {}\n")
    return path


def seed_of(*key) -> int:
    """A seed that depends on ``key`` only (not on the test order or the interpreter's hash randomisation)."""
    return zlib.crc32(repr(key).encode())


def poison(*like, device: str = "cuda") -> None:
    """Leave NaN-filled (0xFF bytes: NaN in fp32/fp16/bf16) blocks of the outputs' sizes (``(shape, dtype)`` pairs) in
    the caching allocator, so that an output element the kernel does not write reads back as NaN."""
    import torch

    blocks = [torch.full((max(1, math.prod(s)) * torch.empty((), dtype=d).element_size(),), 0xFF,
                         dtype=torch.uint8, device=device) for s, d in like]
    torch.cuda.synchronize()
    del blocks


def at_offset(t, k: int):
    """The same values as ``t``, a view at element offset ``k`` of a larger buffer on its device (not 16-byte aligned
    for odd ``k``: the kernels' scalar paths)."""
    import torch

    buf = torch.empty(t.numel() + k, dtype=t.dtype, device=t.device)
    buf[k:] = t.reshape(-1)
    return buf[k:].view(t.shape)


def check_elementwise(name: str, got, want, dtype, shape) -> None:
    """An elementwise kernel's output ``got`` against the float64 CPU reference ``want``: ``shape``, ``dtype``, on
    CUDA, contiguous, every element finite (an element not written reads back as a poisoned NaN), within the dtype's
    tolerance (tests/tolerances.py)."""
    import torch
    from tolerances import TOLERANCES

    assert got.shape == torch.Size(shape), f"{name}: shape {tuple(got.shape)} != {tuple(shape)}"
    assert got.dtype == dtype and got.device.type == "cuda", f"{name}: {got.dtype} on {got.device}"
    assert got.is_contiguous(), f"{name}: not contiguous"
    bad = int((~torch.isfinite(got)).sum())
    assert bad == 0, f"{name}: {bad} element(s) not finite (not written, or a value the reference does not have)"
    torch.testing.assert_close(got.cpu().double(), want, **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")


def require_free_gpu_memory(gib: float, device: str = "cuda") -> None:
    """Skip the calling test unless ``gib`` GiB of GPU memory are free. The blocks that earlier tests of the same process
    left in PyTorch's caching allocator (tens of GiB after a full ``pytest -m cuda`` run) are released first: without
    that, ``mem_get_info`` counts them as used and a large test skips on a GPU that has the room."""
    import pytest
    import torch

    gc.collect()                 # (tensors kept alive only by reference cycles: their blocks go back to the allocator)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()     # (the allocator's unused cached blocks go back to the driver)
    free, _ = torch.cuda.mem_get_info(device)
    if free < gib * 2**30:
        pytest.skip(f"needs {gib:g} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def _packed_kernels(fn) -> list[str]:
    """The names of the packed kernels (``act_and_mul_kernel``: silu_and_mul's, gelu_and_mul's) that ``fn()``
    launches, in launch order (torch.profiler's)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    found = [n for n in names if "act_and_mul_kernel" in n]
    assert found, f"no act_and_mul kernel among the launches: {names}"
    return found


def packed_launches(fn, act: str = "Silu") -> list[tuple[int, bool]]:
    """(values per access, 64-bit indices) of each packed kernel that ``fn()`` launches, in launch order: the
    template arguments V (1 for the scalar kernel, 4 or 8 for the 16-byte vectors) and ``wide`` of
    ``act_and_mul_kernel<Act, T, V, backward, wide>`` in torch.profiler's kernel names; each launch's activation
    must be ``act`` (``Silu``, ``GeluTanh``, ``GeluErf``)."""
    names = _packed_kernels(fn)
    # demangled ("act_and_mul_kernel<pipegoose::(anonymous namespace)::Silu, c10::Half, 8, true, false>(...)") or,
    # should a profiler leave it so, mangled ("..._118act_and_mul_kernelINS0_4SiluEN3c104HalfELi8ELb1ELb0EEEv...")
    found = [re.search(r"act_and_mul_kernel[^,]*?(Silu|GeluTanh|GeluErf)[^,]*?"
                       r"(?:,[^,<>]+,\s*(\d+)\s*,\s*(?:true|false)\s*,\s*(true|false)\s*>|.*?Li(\d+)ELb[01]ELb([01])E)",
                       n) for n in names]
    assert all(found), f"an act_and_mul kernel name this test does not read: {names}"
    acts = [m.group(1) for m in found]
    assert all(a == act for a in acts), f"activations {acts} launched, expected {act}: {names}"
    return [(int(m.group(2) or m.group(4)), (m.group(3) or m.group(5)) in ("true", "1")) for m in found]


def packed_widths(fn, act: str = "Silu") -> list[int]:
    """The values per access (V) of the packed kernels that ``fn()`` launches (:func:`packed_launches`)."""
    return [width for width, _ in packed_launches(fn, act)]
