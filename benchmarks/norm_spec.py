"""Shipped backward specialisations of our LayerNorm / RMSNorm against the generic backward (issue #8).

    python -m benchmarks.norm_spec [--hidden 768,1024,2048,4096,8192] [--rows 16384] [--dtypes bf16,fp32]
                                   [--out FILE.json]

The norm kernels (``pipegoose/kernels/csrc/norm_kernels.cuh``) ship backward kernels specialised to the hidden sizes
``BwdSpecHidden`` and, for inputs with gradients of the same dtype, the model widths of ``BwdSpecExtra`` (576-7168,
per op and dtype); ``-DPIPEGOOSE_NORM_NO_SPEC`` leaves all of them out. This builds ``pipegoose/layer_norm`` and
``pipegoose/rms_norm`` both ways (in parallel, each build in its own process: two builds of one op cannot share a
process, they register the same ``torch.ops.pipegoose`` names; the generic one in a cold temporary cache, the shipped
one in the user's cache, reused when present), then, one process at a time, times
the raw backward op of each build (``benchmarks.timing.Timer``: CUDA events, L2 flushed, median) on the same
inputs (``rows`` x H, random, weight and bias in the input dtype) and checks it against a float64 reference on the
first 64 rows (grad_input; the parameter gradients sum over every row and are checked by the GPU tests). It prints per (op, dtype, H): generic and specialised milliseconds, the change, the effective
bandwidth of the specialised one (bytes: x, dy, dx, plus w and the parameter gradients once) and the largest error.
Build times are printed as well: the specialisations cost build time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from .build_cost import builder_with_defines
from .common import REPO_ROOT

MARK = "NORM_SPEC "
KERNELS = ("pipegoose/layer_norm", "pipegoose/rms_norm")
GENERIC = ["-DPIPEGOOSE_NORM_NO_SPEC"]


def _build_worker(kernel_id: str, defines: list[str], cache: str) -> dict:
    t0 = time.perf_counter()
    builder_with_defines(kernel_id, defines, cache).build()
    return {"kernel": kernel_id, "defines": defines, "build_s": round(time.perf_counter() - t0, 1)}


def _time_worker(kernel_id: str, defines: list[str], cache: str, hidden: list[int], rows: int,
                 dtypes: list[str]) -> dict:
    import torch

    from .timing import Timer

    ops = builder_with_defines(kernel_id, defines, cache).load()
    rms = kernel_id.endswith("rms_norm")
    timer = Timer("cuda", warmup=5, reps=40)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for dname in dtypes:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dname]
        for h in hidden:
            x = torch.randn(rows, h, device="cuda", generator=g).to(dt)
            w = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(dt)
            if rms:
                y, rstd = ops.rms_norm_forward(x, w, 1e-6, None)
                dy = torch.randn_like(y)
                bwd = lambda _: ops.rms_norm_backward(dy, x, w, rstd)  # noqa: E731
                dx = bwd(None)[0]
                xr, wr = x[:64].double().requires_grad_(), w.double().requires_grad_()
                yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
                dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy[:64].double())
                err = float((dx[:64].double() - dxr).abs().max() / dxr.abs().max())
                nbytes = 3 * x.numel() * x.element_size() + 2 * h * w.element_size()
            else:
                b = (0.1 * torch.randn(h, device="cuda", generator=g)).to(dt)
                y, mean, rstd = ops.layer_norm_forward(x, w, b, 1e-5, None)
                dy = torch.randn_like(y)
                bwd = lambda _: ops.layer_norm_backward(dy, x, w, b, mean, rstd)  # noqa: E731
                dx = bwd(None)[0]
                xr = x[:64].double().requires_grad_()
                wr, br = w.double().requires_grad_(), b.double().requires_grad_()
                yr = torch.nn.functional.layer_norm(xr, (h,), wr, br, 1e-5)
                (dxr,) = torch.autograd.grad(yr, (xr,), dy[:64].double())
                err = float((dx[:64].double() - dxr).abs().max() / dxr.abs().max())
                nbytes = 3 * x.numel() * x.element_size() + 3 * h * w.element_size()
            ms = timer.time(bwd)["median_ms"]
            out.append({"dtype": dname, "hidden": h, "ms": ms, "gbps": nbytes / ms / 1e6, "rel_err_dx": err})
            del x, y, dy
    return {"kernel": kernel_id, "defines": defines, "results": out}


def _default_cache() -> str:
    from pipegoose.kernels.cache import default_cache_dir

    return str(default_cache_dir())


def _spawn(args: list[str], cache: str) -> subprocess.Popen:
    env = {**os.environ, "PIPEGOOSE_CACHE_DIR": cache, "PIPEGOOSE_QUIET": "1"}
    return subprocess.Popen([sys.executable, "-m", "benchmarks.norm_spec", "--worker", *args], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collect(p: subprocess.Popen, timeout: float) -> dict:
    try:
        so, se = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        so, se = p.communicate()
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in so.splitlines() if ln.startswith(MARK)]
    if not lines:
        return {"error": f"exit {p.returncode}: " + " | ".join(se.strip().splitlines()[-3:])[:400]}
    return json.loads(lines[-1][len(MARK):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.norm_spec", description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", default="768,1024,2048,4096,8192")
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per build (the builds run in parallel)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    try:
        hidden = [int(h) for h in a.hidden.split(",") if h.strip()]
    except ValueError:
        hidden = []
    if not hidden or any(h < 1 for h in hidden):
        ap.error(f"--hidden: expected comma-separated positive integers, got {a.hidden!r}")
    if a.rows < 64:
        ap.error(f"--rows: expected >= 64, got {a.rows}")
    import torch

    if not torch.cuda.is_available():  # before the builds, which take minutes and would time nothing
        print("norm_spec: needs a CUDA GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pipegoose-normspec-") as root:
        # The specialised build is the shipped one: it shares the user's kernel cache (PIPEGOOSE_CACHE_DIR), so that a
        # prior `python -m pipegoose.kernels build` is reused; the generic one gets a cold cache of its own.
        caches = {"generic": os.path.join(root, "generic"), "specialised": _default_cache()}
        defines = {"generic": GENERIC, "specialised": []}
        t0 = time.perf_counter()
        procs = {(label, k): _spawn(["build", k, caches[label], *defines[label]], caches[label])
                 for label in caches for k in KERNELS}
        builds = {key: _collect(p, a.timeout) for key, p in procs.items()}
        print(f"builds (parallel, {time.perf_counter() - t0:.0f} s wall): "
              + ", ".join(f"{lab} {k.split('/')[1]} {r.get('build_s', r.get('error'))}" for (lab, k), r in builds.items()))
        timed = {}
        for (label, k) in procs:
            if "error" in builds[(label, k)]:
                timed[(label, k)] = builds[(label, k)]
                continue
            timed[(label, k)] = _collect(_spawn(["time", k, caches[label], ",".join(map(str, hidden)), str(a.rows),
                                                 a.dtypes,
                                                 *defines[label]], caches[label]), 300)
    rows = []
    print(f"{'op':10s} {'dtype':5s} {'H':>6s} {'generic ms':>11s} {'spec ms':>9s} {'change':>8s} {'spec GB/s':>10s} "
          f"{'max rel err dx':>15s}")
    for k in KERNELS:
        gen, spec = timed[("generic", k)], timed[("specialised", k)]
        if "error" in gen or "error" in spec:
            print(f"{k}: generic {gen.get('error', 'ok')}; specialised {spec.get('error', 'ok')}")
            continue
        for rg, rs in zip(gen["results"], spec["results"]):
            change = rs["ms"] / rg["ms"] - 1
            rows.append({"kernel": k, "dtype": rs["dtype"], "hidden": rs["hidden"], "generic_ms": rg["ms"],
                         "specialised_ms": rs["ms"], "change": change, "specialised_gbps": rs["gbps"],
                         "rel_err_dx": max(rg["rel_err_dx"], rs["rel_err_dx"])})
            print(f"{k.split('/')[1]:10s} {rs['dtype']:5s} {rs['hidden']:6d} {rg['ms']:11.4f} {rs['ms']:9.4f} "
                  f"{100 * change:+7.1f}% {rs['gbps']:10.0f} {rows[-1]['rel_err_dx']:15.2e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"builds": {f"{lab}:{k}": r for (lab, k), r in builds.items()}, "rows": rows}, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        mode, kid, cache = sys.argv[2], sys.argv[3], sys.argv[4]
        try:
            if mode == "build":
                r = _build_worker(kid, sys.argv[5:], cache)
            else:
                hid, rows, dts = sys.argv[5], int(sys.argv[6]), sys.argv[7]
                r = _time_worker(kid, sys.argv[8:], cache, [int(h) for h in hid.split(",")], rows, dts.split(","))
        except Exception as e:  # noqa: BLE001 - reported to the parent
            r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(MARK + json.dumps(r), flush=True)
    else:
        sys.exit(main())
