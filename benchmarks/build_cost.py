"""Build cost (``--build-cost``) and specialised builds (``--specialise``).

Build cost: a cold build of every kernel of the manifest, ``python -m pipegoose.kernels --cache-dir <empty temp
dir> build --all -j 16`` (wall time, per-kernel seconds from its output), then the warm load time: a fresh
process loading every kernel from that cache (``pipegoose.kernels.load``), timed per kernel and in total.

Specialised builds: a kernel may expose a compile-time switch, a ``PIPEGOOSE_*`` macro tested with
``#ifdef``/``#if defined`` in its own sources. For the causal softmax (``pipegoose/softmax``: ``PIPEGOOSE_SOFTMAX_KEYS``,
the key length as a constant) and LayerNorm (``pipegoose/layer_norm``: ``PIPEGOOSE_NORM_HIDDEN``, the hidden size as
a constant) the harness defines the switch at the benchmarked shape (:data:`SPECIALISE_DEFINES`; or the ``-D``
flags given with ``--specialise-define KERNEL:FLAG``), builds the kernel with and without it, each in its own
process and cold cache (two builds of one op cannot share a process: they register the same ``torch.ops.pipegoose``
names), checks each build's forward and backward against a float64 reference on the benchmark input, and times the
raw forward and backward ops. With no switch in the sources, the result says "not available" and why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import REPO_ROOT

__all__ = ["builder_with_defines", "check_defines", "find_switches", "build_cost", "specialise"]

MARK = "BUILD_RESULT "
SPECIALISE_KERNELS = ("pipegoose/softmax", "pipegoose/layer_norm")
# The benchmarked shape's size as a compile-time constant (the shapes are those of _worker).
SPECIALISE_DEFINES = {"pipegoose/softmax": ["-DPIPEGOOSE_SOFTMAX_KEYS=2048"],
                      "pipegoose/layer_norm": ["-DPIPEGOOSE_NORM_HIDDEN=4096"]}
_SWITCH = re.compile(r"#\s*(?:ifdef|ifndef|if\s+defined\s*\(?|elif\s+defined\s*\(?)\s*(PIPEGOOSE_[A-Z0-9_]+)")


def find_switches(kernel_id: str, manifest_path: str | Path | None = None) -> list[str]:
    """``PIPEGOOSE_*`` macros tested with #ifdef / #if defined in the kernel's files (and its binding), sorted."""
    from pipegoose.kernels.manifest import load_manifest

    m = load_manifest(manifest_path)
    k = m.resolve(kernel_id)
    found: set[str] = set()
    for p in [*m.kernel_paths(k), m.binding_path(k)]:
        if p.is_file():
            found.update(_SWITCH.findall(p.read_text(errors="replace")))
    return sorted(found)


def _run(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, str, float]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
        return p.returncode, p.stdout, p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        return 124, str(e.stdout or ""), f"timed out after {timeout:.0f} s", time.perf_counter() - t0


def build_cost(jobs: int = 16, timeout: float = 580.0) -> dict:
    """Cold parallel build of every kernel into an empty cache, then the warm load time in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="pipegoose-cold-") as cache:
        env = {**os.environ, "PIPEGOOSE_CACHE_DIR": cache, "PIPEGOOSE_QUIET": "1", "COLUMNS": "200"}
        rc, out, err, wall = _run([sys.executable, "-m", "pipegoose.kernels", "--cache-dir", cache, "build", "--all",
                                   "-j", str(jobs)], env, timeout)
        per = dict(re.findall(r"(?:built|cached|FAILED|unavailable)\s+(\S+/\S+) \((\d+\.\d+) s\)", out))
        res = {"jobs": jobs, "cold_build_s": round(wall, 1), "exit_code": rc,
               "per_kernel_s": {k: float(v) for k, v in per.items()},
               "failed": re.findall(r"(?:FAILED|unavailable)\s+(\S+/\S+)", out)}
        if rc not in (0, 2):
            res["detail"] = (err or out).strip().splitlines()[-5:]
        code = ("import json, time; t=time.perf_counter(); import pipegoose.kernels as K; t_imp=time.perf_counter()-t;"
                "from pipegoose.kernels.manifest import load_manifest; r={};\n"
                "for k in load_manifest().kernels:\n"
                "    t0=time.perf_counter()\n"
                "    try: K.load(k); r[k]=round(time.perf_counter()-t0,3)\n"
                "    except Exception as e: r[k]=f'{type(e).__name__}: {str(e)[:120]}'\n"
                f"print({MARK!r}+json.dumps({{'import_s':round(t_imp,3),'load_s':r}}))")
        rc2, out2, err2, wall2 = _run([sys.executable, "-c", code], env, 300)
        lines = [ln for ln in out2.splitlines() if ln.startswith(MARK)]
        if lines:
            warm = json.loads(lines[-1][len(MARK):])
            ok = [v for v in warm["load_s"].values() if isinstance(v, float)]
            res.update(warm_load_total_s=round(sum(ok), 3), warm_load_s=warm["load_s"],
                       warm_process_s=round(wall2, 2))
        else:
            res["warm_load_error"] = (err2 or out2).strip().splitlines()[-3:]
    return res


# --- specialisation ------------------------------------------------------------------------------------------


_DEFINE = re.compile(r"-D([A-Za-z_][A-Za-z0-9_]*)(=.*)?")


def check_defines(kernel_ids: list[str], defines: list[str]) -> None:
    """Raises ValueError, naming the define, unless each of ``defines`` is ``-DNAME`` or ``-DNAME=VALUE`` with a NAME
    that occurs in the files of at least one of ``kernel_ids`` (a misspelt switch would otherwise build the default
    kernel under a new build key without a word)."""
    from pipegoose.kernels.manifest import load_manifest

    m = load_manifest()
    texts: dict[str, str] = {}
    for d in defines:
        got = _DEFINE.fullmatch(d)
        if got is None:
            raise ValueError(f"{d!r}: expected -DNAME or -DNAME=VALUE")
        if not texts:
            for kid in kernel_ids:
                k = m.resolve(kid)
                texts[k.id] = "\n".join(p.read_text(errors="replace") for p in m.kernel_paths(k) if p.is_file())
        if not any(re.search(rf"\b{got.group(1)}\b", t) for t in texts.values()):
            raise ValueError(f"{d!r}: {got.group(1)} occurs in none of the files of {', '.join(texts)}")


def builder_with_defines(kernel_id: str, defines: list[str], cache: str | None):
    """A ``KernelBuilder`` for ``kernel_id`` whose nvcc and C++ flags gain ``defines`` (``-DNAME[=VALUE]``; they
    change the build key), building into ``cache`` (None: the default cache). Raises ValueError for a define that
    ``check_defines`` rejects."""
    from pipegoose.kernels.builder import KernelBuilder
    from pipegoose.kernels.manifest import load_manifest

    check_defines([kernel_id], defines)
    m = load_manifest()
    k = m.resolve(kernel_id)
    if defines:
        flags = dict(k.flags)
        flags["nvcc"] = tuple(flags.get("nvcc", ())) + tuple(defines)
        flags["cxx"] = tuple(flags.get("cxx", ())) + tuple(defines)
        m.kernels[k.id] = dataclasses.replace(k, flags=flags)
    return KernelBuilder(k.id, manifest=m, cache_dir=cache)


def _worker(kernel_id: str, defines: list[str], cache: str) -> dict:
    """In a fresh process: build ``kernel_id`` with extra nvcc ``defines`` into ``cache`` and time its raw ops."""
    import torch

    from pipegoose.kernels.manifest import load_manifest

    k = load_manifest().resolve(kernel_id)
    b = builder_with_defines(kernel_id, defines, cache)
    t0 = time.perf_counter()
    b.build()
    build_s = time.perf_counter() - t0
    ops = b.load()
    from .timing import Timer

    timer = Timer("cuda", warmup=5, reps=30)
    g = torch.Generator(device="cuda").manual_seed(0)
    res = {"kernel": k.id, "defines": defines, "build_s": round(build_s, 1)}
    if k.id == "pipegoose/softmax":
        x = torch.randn(16, 16, 2048, 2048, device="cuda", generator=g).to(torch.bfloat16)
        y = ops.softmax_forward(x, None, 0.125, True)
        dy = torch.randn_like(y)
        dx = ops.softmax_backward(dy, y, 0.125, True)
        # float64 reference on a slice of the rows (the whole input would need 64 GB in float64)
        xs, dys = x[:1, :2].double(), dy[:1, :2].double()
        causal = torch.ones(2048, 2048, dtype=torch.bool, device="cuda").triu_(1)
        yr = torch.softmax((xs * 0.125).masked_fill(causal, float("-inf")), dim=-1)
        dxr = 0.125 * yr * (dys - (dys * yr).sum(-1, keepdim=True))
        res["max_err_fwd"] = float((y[:1, :2].double() - yr).abs().max())
        res["max_err_bwd"] = float((dx[:1, :2].double() - dxr).abs().max())
        res["fwd_ms"] = timer.time(lambda _: ops.softmax_forward(x, None, 0.125, True))["median_ms"]
        res["bwd_ms"] = timer.time(lambda _: ops.softmax_backward(dy, y, 0.125, True))["median_ms"]
        res["case"] = "causal softmax bf16 [16, 16, 2048, 2048]"
    else:
        x = torch.randn(16384, 4096, device="cuda", generator=g).to(torch.bfloat16)
        w = torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16)
        bb = torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16)
        y, mean, rstd = ops.layer_norm_forward(x, w, bb, 1e-5, None)
        dy = torch.randn_like(y)
        dx, dw, db = ops.layer_norm_backward(dy, x, w, bb, mean, rstd)
        xr = x.double().requires_grad_()
        wr, br = w.double().requires_grad_(), bb.double().requires_grad_()
        yr = torch.nn.functional.layer_norm(xr, (4096,), wr, br, 1e-5)
        dxr, dwr, dbr = torch.autograd.grad(yr, (xr, wr, br), dy.double())
        res["max_err_fwd"] = float((y.double() - yr.detach()).abs().max())
        res["max_err_bwd"] = max(float((dx.double() - dxr).abs().max()),
                                 float((dw.double() - dwr).abs().max() / dwr.abs().max()),
                                 float((db.double() - dbr).abs().max() / dbr.abs().max()))
        res["fwd_ms"] = timer.time(lambda _: ops.layer_norm_forward(x, w, bb, 1e-5, None))["median_ms"]
        res["bwd_ms"] = timer.time(lambda _: ops.layer_norm_backward(dy, x, w, bb, mean, rstd))["median_ms"]
        res["case"] = "layer_norm bf16 [16384, 4096]"
    return res


def specialise(extra: dict[str, list[str]] | None = None, timeout: float = 300.0) -> dict:
    """Compare generic and specialised builds of the causal softmax and LayerNorm kernels (see module doc).

    ``extra``: kernel id -> -D flags to use instead of the auto-detected switches. Returns per kernel either
    ``{"available": False, "reason": ...}`` or both builds' build_s / fwd_ms / bwd_ms."""
    out: dict = {}
    for kid in SPECIALISE_KERNELS:
        try:
            switches = find_switches(kid)
        except Exception as e:  # noqa: BLE001
            out[kid] = {"available": False, "reason": f"{type(e).__name__}: {e}"}
            continue
        defines = (extra or {}).get(kid) or SPECIALISE_DEFINES.get(kid, [])
        wanted = [d[2:].split("=", 1)[0] for d in defines]
        if not defines or not set(wanted) <= set(switches):
            out[kid] = {"available": False,
                        "reason": f"the kernel's sources test no switch {', '.join(wanted) or '(none given)'} "
                                  f"(found: {', '.join(switches) or 'none'})"}
            continue
        runs = {}
        for label, defs in (("generic", []), ("specialised", defines)):
            with tempfile.TemporaryDirectory(prefix="pipegoose-spec-") as cache:
                env = {**os.environ, "PIPEGOOSE_CACHE_DIR": cache, "PIPEGOOSE_QUIET": "1"}
                rc, so, se, wall = _run([sys.executable, "-m", "benchmarks.build_cost", "--worker", kid, cache,
                                         *defs], env, timeout)
                lines = [ln for ln in so.splitlines() if ln.startswith(MARK)]
                runs[label] = (json.loads(lines[-1][len(MARK):]) if lines else
                               {"error": f"exit {rc}: " + " | ".join(se.strip().splitlines()[-3:])[:400]})
        out[kid] = {"available": True, "switches": switches, "defines": defines, **runs}
    return out


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        try:
            r = _worker(sys.argv[2], sys.argv[4:], sys.argv[3])
        except Exception as e:  # noqa: BLE001 - reported to the parent
            r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(MARK + json.dumps(r), flush=True)
    elif sys.argv[1:] in (["-h"], ["--help"]):   # (it was the usage error, exit 2: a walkthrough)
        print("usage: python -m benchmarks.build_cost --worker KERNEL CACHE_DIR [-DFLAG ...]\n\n"
              "The worker process of python -m benchmarks.run --build-cost / --specialise (run those instead): builds\n"
              "KERNEL with the -D flags in a cold CACHE_DIR, checks and times it, and prints one JSON line.\n\n"
              + __doc__.split("\n\n")[0])
    else:
        print("usage: python -m benchmarks.build_cost --worker KERNEL CACHE_DIR [-DFLAG ...] (the worker of "
              "python -m benchmarks.run --build-cost / --specialise; --help says more)", file=sys.stderr)
        sys.exit(2)
