"""``python -m pipegoose.kernels``: doctor | build | clean.

    python -m pipegoose.kernels doctor [--load]           toolchain checks + each kernel's state, as tables
    python -m pipegoose.kernels build --all [-j N]         build every kernel of the manifest, N at a time
    python -m pipegoose.kernels build NAME [NAME ...]      build some (ids or aliases)
    python -m pipegoose.kernels clean [--dry-run]          remove the temp folders of killed builds (every key)

Common options: ``--manifest PATH`` (default: the repository's kernels.yaml), ``--cache-dir DIR``.
Exit status, every subcommand: 0 success; 1 a failure (below); 2 a usage error (a bad option, an unknown kernel name,
a missing or invalid ``--manifest``, a ``--cache-dir`` that is a file or under one for ``clean``; for ``build``, a
``PIPEGOOSE_BUILD_LOCK_TIMEOUT`` that is no number of seconds or a ``PIPEGOOSE_ALLOW_MODIFIED_VENDOR`` that is no
switch value: nothing is built; for ``clean``, a cache that cannot be written: "cache not writable"), as argparse's
own; 3 none failed but some kernels are unavailable here (vendored files missing or changed, a tools/port.py change
running or interrupted, toolchain), each listed with the reason; 130 interrupted (Ctrl-C). ``build``: 1 a build
failed, or was left ``busy`` (another process held its build lock past ``PIPEGOOSE_BUILD_LOCK_TIMEOUT``; nothing was
attempted).
``doctor``: 0 every check passed and every kernel can be built or loaded; 1 a check failed (one is a
tools/port.py change running or interrupted in ``vendor/.port-txn/``) or, with ``--load``, a kernel failed to load.
``doctor`` also counts those temp folders. ``clean`` removes only ``<key>.tmp-<pid>-<8 hex>`` folders whose pid is
not a live process on this host, each under its key's build lock (a key being built is skipped); published builds,
locks and failure logs stay (:func:`pipegoose.kernels.cache.clean_abandoned`).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from .manifest import ManifestError


def _console():
    """A rich console of :func:`pipegoose._table.terminal_width` (160 columns when piped, unless COLUMNS says otherwise;
    rich assumed 80 there, which split kernel names mid-word in the tables: session 35's walkthrough). Lines of text are
    not wrapped (soft_wrap), as port.py's."""
    from rich.console import Console

    from pipegoose._table import terminal_width

    return Console(width=terminal_width(), soft_wrap=True)


def _builders(args, names):
    from .builder import KernelBuilder
    from .manifest import load_manifest

    manifest = load_manifest(args.manifest)
    ids = list(manifest.kernels) if names is None else [manifest.resolve(n).id for n in names]
    return manifest, [KernelBuilder(i, manifest=manifest, cache_dir=args.cache_dir) for i in dict.fromkeys(ids)]


def _doctor(args) -> int:
    from rich.text import Text

    from pipegoose._table import print_table

    from . import cache, toolchain

    console = _console()
    cache_dir = cache.default_cache_dir() if args.cache_dir is None else args.cache_dir
    import torch

    env = [("python", sys.version.split()[0]), ("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")]
    gpus = [f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    env += [("GPUs", ", ".join(gpus) or "none visible"), ("cache", str(cache_dir))]
    env += [(var, os.environ.get(var, "(unset)")) for var in ("CUDA_HOME", "TORCH_CUDA_ARCH_LIST", "MAX_JOBS",
                                                             "PIPEGOOSE_CACHE_DIR", "PIPEGOOSE_ALLOW_MODIFIED_VENDOR")]
    # the names, checks, kernels and states whole (rich cut them, "TORCH_CUDA_ARCH…", in narrow terminals; a
    # walkthrough), else a list (pipegoose._table)
    print_table(console, "environment", ("name", "value"), env, whole=(0,), head=(0,), show_header=False)

    checks = []   # (check, status, detail, fix)
    fail, ok = Text("FAIL", style="red"), Text("ok", style="green")
    bad = 0
    with warnings.catch_warnings():   # a CUDA_HOME passed over: its row says so (the raw warning repeated it)
        warnings.filterwarnings("ignore", message=r".* is not a CUDA toolkit", category=UserWarning)
        pre = toolchain.preflight(cache_dir, create_cache=False)  # a diagnosis makes no folder
    for c in pre:
        status = fail if not c.ok else Text("warn", style="yellow") if c.warn else ok
        bad += not c.ok
        checks.append((c.name, status, c.detail, c.fix))
    from pipegoose import _env

    allow = os.environ.get("PIPEGOOSE_ALLOW_MODIFIED_VENDOR", "")
    if _env.flag(allow) is None:  # every build and load refuses it (KernelBuilder._check_vendored)
        bad += 1
        checks.append(("PIPEGOOSE_ALLOW_MODIFIED_VENDOR", fail, f"{allow!r}",
                       "set it to 1/true/yes/on or 0/false/no/off, or unset it"))
    from .manifest import default_manifest_path, pending_port_change

    # a tools/port.py change running or interrupted: its vendored kernels are unavailable too (their rows say so)
    root = (Path(args.manifest).expanduser().absolute() if args.manifest else default_manifest_path()).parent
    what, fix = pending_port_change(root)
    if what:
        bad += 1
        checks.append(("tools/port.py change", fail, what, fix))
    quiet = os.environ.get("PIPEGOOSE_QUIET", "")
    if _env.flag(quiet) is None:  # the builder warns and keeps its progress lines (builder.quiet)
        bad += 1
        checks.append(("PIPEGOOSE_QUIET", fail, f"{quiet!r}", "set it to 1/true/yes/on or 0/false/no/off, or unset it"))
    # the dispatcher's variables (PIPEGOOSE_IMPL_*, PIPEGOOSE_STRICT, PIPEGOOSE_SMALL_NUMEL, the norm kernels'): a bad
    # value is otherwise an error only at the first call of the op it applies to

    from pipegoose.nn.fusion import dispatch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            dispatch.check_env()
        except ValueError as e:
            bad += 1
            checks.append(("dispatcher variables", fail, str(e), "fix the value, or unset the variable"))
        else:
            checks.append(("dispatcher variables", ok, "PIPEGOOSE_IMPL_*, PIPEGOOSE_STRICT, PIPEGOOSE_SMALL_NUMEL, "
                           "PIPEGOOSE_NORM_CLUSTERS, PIPEGOOSE_NORM_SMEM_LIMIT", ""))
    try:  # read when a build waits for another's lock
        cache.env_lock_timeout()
    except ValueError as e:
        bad += 1
        checks.append(("PIPEGOOSE_BUILD_LOCK_TIMEOUT", fail, str(e), "fix the value, or unset it"))
    # a PIPEGOOSE_IMPL_* name of no op (the other unknown names: the line below the tables)
    impl_names = [str(w.message) for w in caught if str(w.message).startswith("PIPEGOOSE_IMPL_")]
    print_table(console, "preflight", ("check", "status", "detail", "fix"), checks, whole=(0, 1), head=(0, 1))

    manifest, builders = _builders(args, None)
    kt = []   # (kernel, aliases, state, detail)
    colors = {"cached": "green", "loaded": "green", "not built": "yellow", "unavailable": "red", "error": "red"}
    states = []
    for b in builders:
        st = b.status()
        if args.load and st["state"] == "cached":
            try:
                ops = b.load()
                st = {**st, "state": "loaded", "detail": f"{len(ops.ops)} ops from {ops.library_path}"}
            except Exception as e:  # report, do not stop the table
                st = {**st, "state": "error", "detail": str(e)}
        detail = st["detail"]
        if _env.flag(allow) is None and detail.startswith("PIPEGOOSE_ALLOW_MODIFIED_VENDOR="):
            detail = "PIPEGOOSE_ALLOW_MODIFIED_VENDOR: see preflight"   # (its message was repeated in every row)
        kt.append((b.kernel.id, ", ".join(b.kernel.aliases), Text(st["state"], style=colors[st["state"]]), detail))
        states.append(st["state"])
    print_table(console, f"kernels ({manifest.path})", ("kernel", "aliases", "state", "detail"), kt, whole=(0, 2),
                head=(0, 2))
    from pipegoose._env import unknown_names

    for msg in impl_names:
        console.print(msg, style="yellow", markup=False)
    for name, close in unknown_names():  # a misspelt PIPEGOOSE_CACHE_DIR, say, is otherwise ignored without a word
        console.print(f"[yellow]{name}[/]: pipegoose reads no variable of that name, so it is ignored"
                      + (f"; did you mean {close}?" if close else ""))
    litter = cache.abandoned_tmp(cache_dir)
    if litter:
        console.print(f"[yellow]{len(litter)} temp folder(s) of killed builds[/] in {cache_dir} "
                      f"({_size(litter) / 2**20:.1f} MiB): remove them with python -m pipegoose.kernels clean")
    # as build's exit status: a kernel that cannot be built here is 3 (it was 0: a passing preflight hid a changed
    # vendored file from CI; session 35's walkthrough)
    return 1 if bad or "error" in states else 3 if "unavailable" in states else 0


# build's result colors (FAILED and anything unforeseen: red)
_STATE_COLORS = {"built": "green", "cached": "green", "unavailable": "yellow", "busy": "yellow"}


def _size(dirs) -> int:
    total = 0
    for f in (f for d in dirs for f in d.rglob("*")):
        try:
            total += f.lstat().st_size
        except OSError:  # removed meanwhile
            pass
    return total


def _clean(args) -> int:
    from . import cache

    if args.manifest is not None:   # clean reads no kernel, but a --manifest given is checked, as everywhere (exit 2:
        from .manifest import load_manifest   # a missing one passed with exit 0; a review)

        load_manifest(args.manifest)
    cache_dir = cache.default_cache_dir() if args.cache_dir is None else Path(args.cache_dir)
    # a file, or a path under a file (it said "removed 0" and exit 0; reviews): the nearest part there, as
    # benchmarks.run's --out and --tuning-dir
    on_disk = next((q for q in (cache_dir, *cache_dir.parents) if q.exists()), None)
    if on_disk is not None and not on_disk.is_dir():
        where = "--cache-dir" if args.cache_dir is not None else "PIPEGOOSE_CACHE_DIR"
        got = "a file" if on_disk == cache_dir else f"a path under the file {on_disk}"
        print(f"python -m pipegoose.kernels clean: {where} {cache_dir}: expected the build cache's folder, got {got}",
              file=sys.stderr)
        return 2
    if args.dry_run:
        litter = cache.abandoned_tmp(cache_dir)
        for d in litter:
            print(f"would remove {d}")
        print(f"{len(litter)} temp folder(s) of killed builds ({_size(litter) / 2**20:.1f} MiB)")
        return 0
    try:
        removed, busy = cache.clean_abandoned(cache_dir)
    except OSError as e:   # a read-only cache, one of another user (a review: a raw OSError from filelock, exit 1)
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        where = f" ({e.strerror}: {e.filename})" if e.filename else f" ({e.strerror or e})"
        print(f"python -m pipegoose.kernels clean: cache not writable: {cache_dir}{where}; its temp folders of "
              "killed builds stay (clean --dry-run lists them): run clean as the cache's owner, or where it is "
              "writable", file=sys.stderr)
        return 2
    for d in removed:
        print(f"removed {d}")
    for key in busy:
        print(f"skipped {key}: a build of it holds its lock")
    print(f"removed {len(removed)} temp folder(s) of killed builds")
    return 0


def _build(args) -> int:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from . import cache
    from .builder import KernelBuildBusyError, KernelBuildError, KernelUnavailableError, stop_workers

    if not args.all and not args.names:
        print("build: name kernels or pass --all", file=sys.stderr)
        return 2
    if args.all and args.names:  # the names were ignored: a typo started a build of every kernel
        print(f"build: --all builds every kernel; name kernels or pass --all, not both (got {' '.join(args.names)})",
              file=sys.stderr)
        return 2
    try:   # read where a build waits for another's lock: a bad value failed the uncached kernels only, mid-run,
        cache.env_lock_timeout()   # and passed where every kernel was cached (a review); nothing is built with it
    except ValueError as e:
        print(f"build: {e} (fix the value, or unset it)", file=sys.stderr)
        return 2
    from pipegoose import _env

    # every build and load refuses it: said once, nothing built (a review: each kernel was FAILED, ours too, exit 1)
    allow = os.environ.get("PIPEGOOSE_ALLOW_MODIFIED_VENDOR", "")
    if _env.flag(allow) is None:
        print(f"build: PIPEGOOSE_ALLOW_MODIFIED_VENDOR={allow!r}: expected 1/true/yes/on or 0/false/no/off (fix the "
              "value, or unset it)", file=sys.stderr)
        return 2
    os.environ.setdefault("PIPEGOOSE_QUIET", "1")
    console = _console()
    _, builders = _builders(args, None if args.all else args.names)
    from .toolchain import max_jobs_check

    mj = max_jobs_check()  # a MAX_JOBS torch ignores, or 0 (no limit): said by doctor only before (a walkthrough)
    if mj is not None and mj.ok and mj.warn:
        print(f"build: warning: MAX_JOBS={mj.detail}; {mj.fix}", file=sys.stderr)
    results: dict[str, tuple[str, str, float]] = {}
    jobs = args.jobs
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        overall = progress.add_task(f"building {len(builders)} kernel(s), {jobs} at a time", total=len(builders))

        def one(b):
            t0 = time.monotonic()

            def waiting(owner: dict) -> None:
                # another process (a second `build`, a training job's first load) holds the key's build lock: say so,
                # or the row sits silent until that build ends (the builder's own line is off under PIPEGOOSE_QUIET)
                who = (f"pid {owner.get('pid', '?')} on {owner.get('hostname', '?')}" if owner
                       else "another process")
                try:
                    limit = cache.env_lock_timeout()
                except ValueError:  # (the lock raises it; this line only reports)
                    limit = None
                if limit == 0:  # (it said "waiting" and then failed after 0 s; session 35's walkthrough)
                    progress.console.print(f"[yellow]busy[/] {b.kernel.id}: {who} is building it; "
                                           "PIPEGOOSE_BUILD_LOCK_TIMEOUT=0: not waiting for it")
                    return
                progress.console.print(f"[yellow]waiting[/] {b.kernel.id}: {who} is building it; waiting for that "
                                       f"build to end (at most PIPEGOOSE_BUILD_LOCK_TIMEOUT seconds, default 3600)")

            try:
                res = b.build(force=args.force, on_wait=waiting)
                return b, "built" if res.built else "cached", str(res.library_path), time.monotonic() - t0
            except KernelUnavailableError as e:
                return b, "unavailable", str(e), time.monotonic() - t0
            except KernelBuildBusyError as e:  # (it said FAILED: nothing had failed, nothing was attempted; a review)
                return b, "busy", str(e), time.monotonic() - t0
            except KernelBuildError as e:
                return b, "FAILED", str(e), time.monotonic() - t0
            except Exception as e:  # a bug must not hide the other kernels' results
                return b, "FAILED", f"{type(e).__name__}: {e}", time.monotonic() - t0

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futs = [pool.submit(one, b) for b in builders]
            try:
                for f in as_completed(futs):
                    b, state, detail, secs = f.result()
                    results[b.kernel.id] = (state, detail, secs)
                    color = _STATE_COLORS.get(state, "red")
                    progress.console.print(f"[{color}]{state:>11}[/] {b.kernel.id} ({secs:.1f} s)")
                    progress.advance(overall)
            except BaseException:  # Ctrl-C reaches this thread only: stop the queued builds and the running workers
                pool.shutdown(wait=False, cancel_futures=True)
                stop_workers()
                raise
    from rich.text import Text

    from pipegoose._table import print_table

    rows = []
    for b in builders:
        state, detail, secs = results[b.kernel.id]
        color = _STATE_COLORS.get(state, "red")
        rows.append((b.kernel.id, Text(state, style=color), f"{secs:.1f}", detail))
    # kernel, result and seconds whole (at 40 columns rich folded them to 7 characters a line: "apex/mu|lti_ten")
    print_table(console, "build results", ("kernel", "result", "seconds", "detail"), rows, whole=(0, 1, 2),
                head=(0, 1, 2))
    states = [r[0] for r in results.values()]
    if "FAILED" in states or "busy" in states:
        return 1
    return 3 if "unavailable" in states else 0



def _positive_int(text: str) -> int:
    """argparse type of --jobs: an integer >= 1 (0 or a negative count was taken as 1 without a word)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


# (pipegoose._env.user_cache_dir's order; the help said only "$PIPEGOOSE_CACHE_DIR or ~/.cache/...", a review)
CACHE_DIR_HELP = ("build cache (default: $PIPEGOOSE_CACHE_DIR, else $XDG_CACHE_HOME/pipegoose/kernels, else "
                  "~/.cache/pipegoose/kernels)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        from .builder import _worker_main

        return _worker_main(argv[1])
    p = argparse.ArgumentParser(prog="python -m pipegoose.kernels",
                                description=__doc__.split("\n\n")[0].replace("``", ""))
    from pipegoose._cli import path_arg

    p.add_argument("--manifest", default=None, type=path_arg, help="kernels.yaml to use (default: the repository's)")
    p.add_argument("--cache-dir", default=None, type=path_arg, help=CACHE_DIR_HELP)
    # the same common options after the subcommand too (SUPPRESS: absent there keeps the value given before it)
    common = argparse.ArgumentParser(add_help=False)
    # (listed in each subcommand's help too: `doctor -h` did not show them; a fresh-clone check)
    common.add_argument("--manifest", default=argparse.SUPPRESS, type=path_arg,
                        help="kernels.yaml to use (default: the repository's)")
    common.add_argument("--cache-dir", default=argparse.SUPPRESS, type=path_arg, help=CACHE_DIR_HELP)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="toolchain checks and each kernel's state", parents=[common])
    d.add_argument("--load", action="store_true", help="also load every cached kernel")
    b = sub.add_parser("build", help="build kernels (in parallel child processes)", parents=[common])
    b.add_argument("names", nargs="*", help="kernel ids or aliases")
    b.add_argument("--all", action="store_true", help="every kernel of the manifest")
    b.add_argument("-j", "--jobs", type=_positive_int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="kernels built at once (default: half the CPU cores)")
    b.add_argument("--force", action="store_true", help="rebuild even when cached")
    c = sub.add_parser("clean", help="remove the temp folders left by killed builds (owner process gone)",
                       parents=[common])
    c.add_argument("--dry-run", action="store_true", help="only list them")
    args = p.parse_args(argv)
    if args.cmd == "build":   # PIPEGOOSE_QUIET's warning for a bad value also where every kernel is cached (no line)
        from .builder import quiet

        quiet()
    restore = _on_sigterm_raise() if args.cmd == "build" else None
    try:
        if args.cmd == "doctor":
            return _doctor(args)
        if args.cmd == "clean":
            return _clean(args)
        return _build(args)
    except KeyError as e:  # an unknown kernel name: the message lists names like it (or says it is empty)
        print(f"python -m pipegoose.kernels {args.cmd}: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    except ManifestError as e:  # --manifest: missing, unreadable or invalid (the message names the file)
        print(f"python -m pipegoose.kernels {args.cmd}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: a line, not a traceback (builds are cached only once complete)
        how = "terminated (SIGTERM)" if isinstance(e, _Terminated) else "interrupted"
        print(f"python -m pipegoose.kernels {args.cmd}: {how}; a kernel whose build had not finished is not "
              "cached (its temp folder, if one is left, is removed by: python -m pipegoose.kernels clean)",
              file=sys.stderr)
        return 128 + signal.SIGTERM if isinstance(e, _Terminated) else 130
    finally:
        if restore is not None:
            restore()


class _Terminated(KeyboardInterrupt):
    """SIGTERM during ``build`` (a job scheduler's stop, ``timeout``, ``kill``): handled as Ctrl-C is (the queued
    builds cancelled, the running workers stopped, one line), with exit status 143. It used to end the process at once
    with status 143 and no word, the workers left to notice their parent was gone."""


def _on_sigterm_raise():
    """Make SIGTERM raise :class:`_Terminated` in the main thread; returns a function that puts back the handler it
    replaced, or None where signals cannot be set here (not the main thread, as when ``main`` is called from a
    test's thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    # (None: a handler set outside Python; the default is the nearest we can put back)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


if __name__ == "__main__":
    sys.exit(main())
