"""Partial rotary (GPT-NeoX / Pythia's RoPE over part of each head): forward, and forward + backward, time and
effective bandwidth, in one run beside the copy bandwidth.

    python -m benchmarks.rope_partial [--shapes 8x2048x16x64x16 ...] [--dtypes bf16,fp16,fp32] [--reps 30]
                                      [--impls a,b] [--out DIR] [--raw | --defines=-DNAME=VALUE,...]
                                      [--style neox|cohere|glm|gptj]

Shapes ``BxSxHxDxR``: batch, sequence, heads (q's and k's), head size, rotated values a head (R == D, whole heads: an
A/B of the kernel's rotation path; ``benchmarks.run --only rope`` times those beside the peers). q and k are GPT-NeoX's:
chunks of one [B, H, S, 3D] projection (``qkv.view(B, S, H, 3D).transpose(1, 2).chunk(3, -1)``: not dense), cos and sin
[1, S, R] (GPT-NeoX's rotary embedding: angles from positions, ``cat(freqs, freqs)``), all of one dtype (``--dtypes``,
default bf16: the training dtype; fp32 and fp16 change the vector width of the rotated halves, so which kernel path
runs).

``--style`` (default ``neox``) picks the model whose RoPE is timed: ``neox`` as above; ``cohere``, Cohere's interleaved
RoPE (pairs of neighbours rotate; its function computes in fp32 and casts back) on Llama-layout q and k (views of
separate [B, S, H * D] projections) with Cohere's tables (each frequency twice, ``repeat_interleave``); ``glm``, GLM-4's
(the interleaved RoPE of the first half of rotate-half tables, the first R values of each head; its function builds
those tables each call, as our routing does before the op) on the same layout. Default shapes per style: Cohere's heads
of 128 whole, GLM-4's of 128 half-rotated. ``gptj``, GPT-J's (and CodeGen's) RoPE section of its attention as the module
runs it: q and k [B, S, H, D] (views of separate projections), its function called on the first R values of each (a
strided view), once for k and once for q, with tables of R / 2 values that it repeats, then ``torch.cat`` with the rest
of each head; the ``pipegoose`` row makes the same calls as fuse's routing does (q alone beside an empty k, the tables
repeated in the call), the cat included in every row. Default shapes: GPT-J-6B's 16 heads of 256 (64 rotated), the e2e
model's 8, CodeGen-350M's 16 heads of 64 (32 rotated). The ``pipegoose`` row of an interleaved style calls
``apply_rotary_pos_emb(..., interleaved=True)`` (GLM: on ``transformers.rope.kernel_tables``' tables, built in the timed
call as fuse's routing builds them).

Implementations, each of ``(q_embed, k_embed) = apply_rotary_pos_emb(q, k, cos, sin)``:

* ``pipegoose``: :func:`pipegoose.nn.fusion.functional.apply_rotary_pos_emb` with ``impl="pipegoose"`` (strict: the
  kernel's partial path or an error): our RoPE kernel, one launch each way (the rotated values rotated, the rest
  copied); with ``--raw``, ``torch.ops.pipegoose.rope(q, k, cos, sin)`` called directly (the call the functional makes
  for these inputs, without the dispatcher), and with ``--defines`` the same op of a build of ``pipegoose/rope`` with
  those nvcc defines (``benchmarks.build_cost.builder_with_defines``: its own build key; a define that no file of the
  kernel names is refused). An A/B of a build switch is two runs, ``--impls pipegoose --raw`` and ``--impls pipegoose
  --defines=-DPIPEGOOSE_ROPE_COPY_BYTES=16`` (with ``=``: a value that starts with ``-`` is not an option), one
  process each (two builds cannot register one op in one process);
* ``transformers``: GPT-NeoX's ``apply_rotary_pos_emb`` (``modeling_gpt_neox``), eager: what the model runs;
* ``compile``: ``torch.compile`` of that function.

Each implementation's results and gradients are first compared with ``transformers``' (within the dtype's tolerance
of ``tests/tolerances.py``, scaled by 2 for eager's three roundings); one that differs is reported FAILED and not
timed. Time: the median of the repetitions (CUDA events, the L2 cache flushed before each: ``benchmarks.timing``);
the backward is timed with the forward (``fwd+bwd``). Effective bandwidth: the fewest bytes each pass must move (q and
k read and their results written, cos and sin read; the backward the same for the gradients) over the median time,
and its share of the device copy bandwidth measured in the same run. Writes ``rope_partial.json`` and ``.md`` (GPU,
versions, date) into ``--out``. ``--device cpu`` is a dry run of the plumbing (small shapes, no flush; ``pipegoose``
errors there: the kernel needs a GPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import (environment, parse_dtypes_reps_impls, parse_sizes, raise_compile_limits, timing_cells,
                               today, tolerances, versions_line)
from benchmarks.timing import Timer

# Pythia-410m (the end-to-end NeoX step's shape), Pythia-1.4b, Pythia-6.9b, Pythia-2.8b (heads of 80, 20 rotated) and
# GPT-NeoX-20B (heads of 96, 24 rotated; both with halves narrower than a 16-byte vector: the kernel's staged path): a
# quarter of each head rotates
SHAPES = ["8x2048x16x64x16", "4x2048x16x128x32", "2x2048x32x128x32", "4x2048x32x80x20", "2x2048x64x96x24"]
# Cohere-style models (heads of 128, whole: Command-R 7B's 32 heads, and 16) and GLM-4's (heads of 128, half rotated)
STYLE_SHAPES = {"neox": SHAPES, "cohere": ["4x2048x32x128x128", "4x2048x16x128x128", "8x2048x16x64x64"],
                "glm": ["4x2048x32x128x64", "4x2048x16x128x64"],
                "gptj": ["4x2048x16x256x64", "4x2048x8x256x64", "8x2048x16x64x32"]}
DRY_SHAPES = ["2x16x4x16x4"]
IMPLS = ("pipegoose", "transformers", "compile")
PASSES = ("fwd", "fwd+bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``BxSxHxDxR`` -> (B, S, H, D, R); R even, at most D (R == D: whole heads, for an A/B of the rotation path)."""
    b, s, h, d, r = parse_sizes(text, "BxSxHxDxR", "batch x seq x heads x head size x rotated")
    if r % 2 or r > d:
        raise argparse.ArgumentTypeError(f"expected positive sizes with R even and at most D, got {text!r}")
    return b, s, h, d, r


def functions(raw_ops: Any = None, style: str = "neox") -> dict[str, Callable | None]:
    """name -> ``fn(q, k, cos, sin)`` returning ``(q_embed, k_embed)``; ``raw_ops``: the loaded ops of a build of
    pipegoose/rope, whose ``rope`` the ``pipegoose`` row then calls directly."""
    import importlib

    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.functional import apply_rotary_pos_emb
    from pipegoose.nn.fusion.transformers.rope import INTERLEAVED_FIRST_HALF, kernel_tables

    module = {"neox": "gpt_neox", "cohere": "cohere", "glm": "glm4", "gptj": "gptj"}[style]
    theirs = importlib.import_module(f"transformers.models.{module}.modeling_{module}").apply_rotary_pos_emb
    inter = style != "neox"
    if style == "gptj":
        return _gptj_functions(theirs, raw_ops)

    def tables(cos, sin):   # (GLM's: the first half of each, each value twice, as its function and our routing do)
        return kernel_tables(cos, sin, INTERLEAVED_FIRST_HALF) if style == "glm" else (cos, sin)

    def ours(q, k, cos, sin):
        with dispatch.strict():
            return apply_rotary_pos_emb(q, k, *tables(cos, sin), interleaved=inter, impl="pipegoose")

    if raw_ops is not None:
        def ours(q, k, cos, sin):   # noqa: F811 (the op itself)
            return raw_ops.rope(q, k, *tables(cos, sin), inter)

    raise_compile_limits()   # (one compiled function for every shape and dtype of the run)
    return {"pipegoose": ours, "transformers": theirs, "compile": torch.compile(theirs, dynamic=False)}


def _gptj_functions(theirs: Callable, raw_ops: Any = None) -> dict[str, Callable | None]:
    """:func:`functions` of style ``gptj``: each ``fn(q, k, cos, sin)`` of [B, S, H, D] q and k and half tables
    [1, S, R / 2] runs GPT-J's RoPE section (its function on the first R values of k, then of q, each then cat with
    the rest of its heads), with GPT-J's function, ours as fuse's routing calls it, or compiled."""
    from pipegoose.nn.fusion import dispatch
    from pipegoose.nn.fusion.functional import apply_rotary_pos_emb

    def section(rotate):
        def fn(q, k, cos, sin):   # (GPT-J's function takes (tensor, sin, cos))
            r = 2 * cos.shape[-1]
            k_embed = torch.cat([rotate(k[..., :r], sin, cos), k[..., r:]], dim=-1)
            q_embed = torch.cat([rotate(q[..., :r], sin, cos), q[..., r:]], dim=-1)
            return q_embed, k_embed
        return fn

    def ours(x, sin, cos):   # (the routing: the tables repeated, x as q beside an empty k, [B, S, H, R])
        c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        if raw_ops is not None:
            t = x.transpose(1, 2)
            return raw_ops.rope(t, t.narrow(1, 0, 0), c, s, True)[0].transpose(1, 2)
        with dispatch.strict():
            return apply_rotary_pos_emb(x, x.narrow(2, 0, 0), c, s, 2, interleaved=True, impl="pipegoose")[0]

    raise_compile_limits()
    return {"pipegoose": section(ours), "transformers": section(theirs),
            "compile": torch.compile(section(theirs), dynamic=False)}


def inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str, style: str = "neox") -> dict[str, torch.Tensor]:
    """q, k (GPT-NeoX's chunks of a fused projection; for the interleaved styles Llama's layout, views of separate
    projections), cos, sin (Cohere's: each frequency twice), and the output gradients dq, dk."""
    b, s, h, d, r = shape
    g = torch.Generator(device=device).manual_seed(b + s + h + d + r)
    if style == "neox":
        qkv = torch.randn(b, s, h, 3 * d, device=device, generator=g).to(dtype).transpose(1, 2)
        q, k, _ = qkv.chunk(3, dim=-1)
    elif style == "gptj":   # ([B, S, H, D]: the projections' views, as GPT-J's module rotates them)
        q, k = (torch.randn(b, s, h * d, device=device, generator=g).to(dtype).view(b, s, h, d) for _ in range(2))
    else:
        q, k = (torch.randn(b, s, h * d, device=device, generator=g).to(dtype).view(b, s, h, d).transpose(1, 2)
                for _ in range(2))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, r, 2, device=device, dtype=torch.float32) / r)
    freqs = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv_freq
    emb = (freqs.repeat_interleave(2, dim=-1) if style == "cohere" else torch.cat((freqs, freqs), dim=-1))[None]
    dq = torch.randn(q.shape, device=device, generator=g).to(dtype)
    dk = torch.randn(k.shape, device=device, generator=g).to(dtype)
    if style == "gptj":   # (GPT-J's tables: one value a frequency, R / 2 of them)
        emb = freqs[None]
    return dict(q=q.detach().requires_grad_(), k=k.detach().requires_grad_(), cos=emb.cos().to(dtype),
                sin=emb.sin().to(dtype), dq=dq, dk=dk)


def min_bytes(shape: tuple[int, ...], dtype: torch.dtype, passes: str) -> int:
    """The fewest bytes a pass must move: q and k read and their results written (every value: the unrotated ones are
    copied), cos and sin read; the backward the same for the gradients."""
    b, s, h, d, r = shape
    e = torch.empty((), dtype=dtype).element_size()
    one = (2 * 2 * b * h * s * d + 2 * s * r) * e
    return one if passes == "fwd" else 2 * one


def run_pass(fn: Callable, inp: dict, passes: str) -> tuple:
    q, k = inp["q"], inp["k"]
    qe, ke = fn(q, k, inp["cos"], inp["sin"])
    if passes == "fwd":
        return qe, ke
    gq, gk = torch.autograd.grad((qe, ke), (q, k), (inp["dq"], inp["dk"]))
    return qe, ke, gq, gk


def run_shape(shape: tuple[int, ...], fns: dict, timer: Timer, dtype: torch.dtype, device: str, copy_gbps: float,
              impls: tuple[str, ...] | None = None, style: str = "neox") -> list[dict[str, Any]]:
    """One row per implementation and pass; ``transformers`` is the correctness check of every row."""
    inp = inputs(shape, dtype, device, style)
    want = run_pass(fns["transformers"], inp, "fwd+bwd")
    tol = tolerances()[dtype]
    b, s, h, d, r = shape
    rows = []
    for name in IMPLS:
        if impls is not None and name not in impls:
            continue
        base: dict[str, Any] = dict(impl=name, style=style, batch=b, seq=s, heads=h, head_dim=d, rotary=r,
                                    dtype=str(dtype).removeprefix("torch."))
        try:
            got = run_pass(fns[name], inp, "fwd+bwd")
            bad = [n for n, a, w in zip(("q_embed", "k_embed", "grad_q", "grad_k"), got, want)
                   if a.shape != w.shape or not torch.allclose(a.float(), w.float(), rtol=2 * tol["rtol"],
                                                               atol=2 * tol["atol"])]
            del got
            if bad:
                rows += [dict(base, passes=p, status="FAILED", why=f"differs from the model's function: {bad}")
                         for p in PASSES]
                continue
            for p in PASSES:
                t = timer.time(lambda _, p=p: run_pass(fns[name], inp, p))
                gbps = min_bytes(shape, dtype, p) / (t["median_ms"] * 1e-3) / 1e9
                rows.append(dict(base, passes=p, status="ok", **t, gbps=gbps,
                                 pct_copy=100 * gbps / copy_gbps if copy_gbps else None))
        except Exception as e:  # noqa: BLE001 (one implementation's failure is a row, not the end of the run)
            rows += [dict(base, passes=p, status="error", why=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                     for p in PASSES]
    return rows


def markdown(env: dict, rows: list[dict], copy_gbps: float) -> str:
    dtypes = ", ".join(dict.fromkeys(r["dtype"] for r in rows)) or "no rows"
    style = rows[0].get("style", "neox") if rows else "neox"
    what = {"neox": "Partial rotary (GPT-NeoX's RoPE)", "cohere": "Interleaved RoPE (Cohere's)",
            "glm": "Interleaved partial rotary (GLM-4's RoPE)",
            "gptj": "GPT-J's RoPE section (one tensor a call, the rotated part of each head, then cat)"}[style]
    lines = [f"# {what}, {dtypes} ({env.get('gpu')}, {env.get('date')})", "", versions_line(env, copy_gbps), "",
             f"pipegoose rows: {env.get('rope_call', 'the functional (dispatcher, strict)')}.", "",
             "| B x S x H x D x R | dtype | pass | impl | ms | GB/s | % of copy | status |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['batch']}x{r['seq']}x{r['heads']}x{r['head_dim']}x{r['rotary']} | {r['dtype']} | {r['passes']} "
        lines.append(head + timing_cells(r))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.rope_partial", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=None,
                    help=f"BxSxHxDxR (default: the style's, neox {' '.join(SHAPES)}; on the CPU "
                         f"{' '.join(DRY_SHAPES)})")
    ap.add_argument("--style", choices=tuple(STYLE_SHAPES), default="neox",
                    help="whose RoPE: neox (rotate-half, partial), cohere (interleaved), glm (interleaved, "
                         "partial), gptj (interleaved, one tensor a call, half tables, partial)")
    ap.add_argument("--dtypes", default="bf16", help="comma separated, of bf16, fp16, fp32 (default: bf16)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--impls", default="", help=f"comma separated, of {', '.join(IMPLS)} (default: all)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the plumbing")
    ap.add_argument("--out", type=Path, default=None, help="folder for rope_partial.json / .md")
    ap.add_argument("--raw", action="store_true", help="the pipegoose rows call torch.ops.pipegoose.rope directly")
    ap.add_argument("--defines", default="", help="comma separated -DNAME[=VALUE], given as --defines=-D...: the "
                                                  "pipegoose rows call the op of a build of pipegoose/rope with them "
                                                  "(implies --raw)")
    args = ap.parse_args(argv)
    defines = [d.strip() for d in args.defines.split(",") if d.strip()]
    if (args.raw or defines) and args.device != "cuda":
        ap.error("--raw / --defines: the op needs a CUDA GPU (the CPU dry run goes through the functional)")
    if defines:
        from .build_cost import check_defines
        try:
            check_defines(["pipegoose/rope"], defines)
        except ValueError as e:
            ap.error(f"--defines: {e}")
    dtypes, impls = parse_dtypes_reps_impls(ap, args, DTYPES, IMPLS)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.rope_partial: needs a CUDA GPU (--device cpu: a dry run)")
    dry = ["2x16x4x16x16"] if args.style == "cohere" else DRY_SHAPES   # (Cohere's function rotates whole heads)
    shapes = args.shapes or [parse_shape(s) for s in (STYLE_SHAPES[args.style] if args.device == "cuda" else dry)]
    env = environment(args.device)
    raw_ops = None
    if defines:
        from .build_cost import builder_with_defines
        raw_ops = builder_with_defines("pipegoose/rope", defines, None).load()
        env["rope_call"] = f"torch.ops.pipegoose.rope of a build with {' '.join(defines)}"
    elif args.raw:
        from pipegoose.kernels import load
        raw_ops = load("pipegoose/rope")
        env["rope_call"] = "torch.ops.pipegoose.rope (the shipped build), called directly"
    timer = Timer(args.device, warmup=3, reps=args.reps, max_s=10.0)
    copy_gbps = timer.copy_gbps() if args.device == "cuda" else 0.0
    fns = functions(raw_ops, args.style)
    rows = []
    for dtype in dtypes:
        for shape in shapes:
            rows += run_shape(shape, fns, timer, dtype, args.device, copy_gbps, impls, args.style)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    md = markdown(env, rows, copy_gbps)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "rope_partial" if args.style == "neox" else f"rope_{args.style}"
        (args.out / f"{name}.json").write_text(json.dumps(dict(environment=env, date=today(), copy_gbps=copy_gbps,
                                                               rows=rows), indent=1))
        (args.out / f"{name}.md").write_text(md)


if __name__ == "__main__":
    main()
