"""A stand-in on the CPU for the RoPE kernel's ops (``torch.ops.pipegoose.rope_forward`` / ``rope_backward`` and the
autograd op ``rope``), for the CPU tests of the Python code around them (the functional's kernel path, partial rotary
included, and fuse's routing of GPT-NeoX's calls to it): :func:`stand_in_ops` gives the ops, and :func:`kernel_on_cpu`
makes the dispatcher run the kernel's path on CPU tensors (its real ``supports`` asked as if they were on a GPU)."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import torch

_HALF = (torch.float16, torch.bfloat16)


def _rotate(x, cos, sin, backward, out, interleaved=False):
    """The kernel's per-half formulas in float64 on the first R = cos.shape[-1] values of each head (forward:
    y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; backward, the transposed rotation: g1 = d1 c1 + d2 s2,
    g2 = d2 c2 - d1 s1; ``interleaved``: the same per pair of neighbours, x1 the even values, x2 the odd ones), cos
    and sin broadcast over the heads, the rest passed through; rounded once to ``out`` in ``torch.empty_like``'s
    layout of x (the kernel's)."""
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    r = cos.shape[-1]
    h = r // 2
    if interleaved:
        xd = x.double()
        x1, x2 = xd[..., 0:r:2], xd[..., 1:r:2]
        c1, c2, s1, s2 = c[..., 0::2], c[..., 1::2], s[..., 0::2], s[..., 1::2]
        y1, y2 = (x1 * c1 + x2 * s2, x2 * c2 - x1 * s1) if backward else (x1 * c1 - x2 * s1, x2 * c2 + x1 * s2)
        y = torch.cat((torch.stack((y1, y2), -1).flatten(-2), xd[..., r:]), -1)
        return torch.empty_like(x if x.stride(-1) == 1 else x.contiguous(), dtype=out).copy_(y)
    x1, x2 = x.double()[..., :h], x.double()[..., h:r]
    c1, c2, s1, s2 = c[..., :h], c[..., h:], s[..., :h], s[..., h:]
    if backward:
        y = torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1, x.double()[..., r:]), -1)
    else:
        y = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, x.double()[..., r:]), -1)
    return torch.empty_like(x if x.stride(-1) == 1 else x.contiguous(), dtype=out).copy_(y)


def stand_in_ops(calls: list) -> SimpleNamespace:
    """``rope_forward(q, k, cos, sin, interleaved=False)``, ``rope_backward(grad_q_embed, grad_k_embed, cos, sin,
    dtype=None, interleaved=False)`` and the
    autograd op ``rope.default`` over them, with the kernel's checks that matter here (4-d q and k of one batch, seq
    and head size, cos and sin [batch or 1, seq, R], R the head size or an even 2 <= R below it, a last dimension of
    stride 1 or a copy), dtypes (results in q's dtype, fp32 for 16-bit q with fp32 tables; the backward's in ``dtype``
    or cos's) and layouts (``torch.empty_like``'s), float64 math rounded once; each call appended to ``calls`` as
    (name, q-like argument, k-like argument)."""
    def check(q, k, cos, sin):
        assert q.dim() == k.dim() == 4 and cos.dim() == 3 and sin.shape == cos.shape
        assert k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:], (q.shape, k.shape)
        d, r = q.shape[3], cos.shape[2]
        assert cos.shape[0] in (1, q.shape[0]) and cos.shape[1] == q.shape[2], (q.shape, cos.shape)
        assert (r == d or 2 <= r < d) and r % 2 == 0, (q.shape, cos.shape)

    @torch.no_grad()   # like the real ops, which have no autograd formula
    def rope_forward(q, k, cos, sin, interleaved=False):
        check(q, k, cos, sin)
        calls.append(("rope_forward", q, k) + (("interleaved",) if interleaved else ()))
        out = torch.float32 if cos.dtype == torch.float32 and q.dtype in _HALF else q.dtype
        return _rotate(q, cos, sin, False, out, interleaved), _rotate(k, cos, sin, False, out, interleaved)

    @torch.no_grad()
    def rope_backward(gq, gk, cos, sin, dtype=None, interleaved=False):
        check(gq, gk, cos, sin)
        calls.append(("rope_backward", gq, gk) + (("interleaved",) if interleaved else ()))
        gq, gk = gq.to(cos.dtype), gk.to(cos.dtype)
        out = dtype or cos.dtype
        return _rotate(gq, cos, sin, True, out, interleaved), _rotate(gk, cos, sin, True, out, interleaved)

    class RoPE(torch.autograd.Function):   # the autograd op pipegoose::rope, on the two above
        @staticmethod
        def forward(ctx, q, k, cos, sin, interleaved=False):
            ctx.save_for_backward(cos, sin)
            ctx.dtype = q.dtype
            ctx.interleaved = interleaved
            return rope_forward(q, k, cos, sin, interleaved)

        @staticmethod
        def backward(ctx, gq, gk):
            cos, sin = ctx.saved_tensors
            return (*rope_backward(gq, gk, cos, sin, dtype=ctx.dtype, interleaved=ctx.interleaved), None, None, None)

    return SimpleNamespace(rope_forward=rope_forward, rope_backward=rope_backward,
                           rope=SimpleNamespace(default=RoPE.apply))


@contextlib.contextmanager
def kernel_on_cpu(monkeypatch, dispatch):
    """Within the block, the dispatcher's ``rope`` implementation ``pipegoose`` takes CPU tensors (its real
    ``supports`` asked as if they were on a GPU) and loads :func:`stand_in_ops` (their calls: the yielded list); no
    tuning table, no small-problem rule. The real implementation and the caches are restored afterwards."""
    im = dispatch.implementations("rope")["pipegoose"]

    def on_gpu(p, _real=im.supports):
        return _real(dataclasses.replace(p, device=torch.device("cuda", 0)))

    calls: list = []
    ops = stand_in_ops(calls)
    real_load = dispatch._load_kernel
    monkeypatch.setattr(dispatch, "_load_kernel", lambda name: ops if name == "pipegoose/rope" else real_load(name))
    monkeypatch.setattr(dispatch, "_device_name", lambda device: None)
    monkeypatch.setenv("PIPEGOOSE_SMALL_NUMEL", "0")
    dispatch.register(dataclasses.replace(im, supports=on_gpu))
    dispatch.clear_kernel_cache()
    dispatch.clear_tuning_cache()
    try:
        yield calls
    finally:
        dispatch.register(im)
        dispatch.clear_kernel_cache()
        dispatch.clear_tuning_cache()
        dispatch.reset_stats()
