#!/usr/bin/env python3
"""Vendor, verify and audit the upstream kernels declared in kernels.yaml (a thin CLI over pipegoose.porting).

    python tools/port.py list                      every kernel: source, license, state
    python tools/port.py add megatron/scaled_masked_softmax
    python tools/port.py sync [--all]              vendor everything in kernels.lock (--all: every kernel)
    python tools/port.py verify                    recompute hashes; exit 1 on any difference (a kernel of
                                                   kernels.yaml that kernels.lock does not record is named, no failure)
    python tools/port.py remove <id>
    python tools/port.py audit [IDS] [--to X | --latest] [--diff] [--json]   exit 0 in sync, 1 drift, 2 error
    python tools/port.py update <id|source> (--to X | --latest) [--force] [--allow-downgrade] [--trust-cache]

Options common to all: --root DIR (repository root: kernels.yaml, kernels.lock, vendor/, LICENSES/) or
--manifest FILE (env PIPEGOOSE_MANIFEST; empty or blank: unset); --cache DIR (download cache; env PIPEGOOSE_PORT_CACHE);
--offline.
A version kernels.yaml does not pin (audit, update) is checked against the sha256 the package index publishes (a cached
sdist that differs is downloaded again); with --offline the download cache's file cannot be: audit says so, and update
refuses to pin it unless --trust-cache is given.
Exit codes: 0 success, 1 verification failure / drift, 2 error.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.text import Text  # noqa: E402

from pipegoose._cli import path_arg  # noqa: E402
from pipegoose.kernels.manifest import ManifestError  # noqa: E402
from pipegoose.porting import PortError, Porter, audit, update  # noqa: E402
from pipegoose.porting.util import short_pin  # noqa: E402

from pipegoose._table import print_table, terminal_width  # noqa: E402

out = Console(highlight=False, soft_wrap=True, width=terminal_width())
err = Console(stderr=True, highlight=False, soft_wrap=True)

_STATE_STYLE = {"verified": "green", "vendored": "cyan", "declared": "dim", "modified": "red", "missing": "yellow",
                "stale": "yellow"}


_made: list[Porter] = []  # the Porters of this run: after a Ctrl-C, whether one passed its commit point


def _porter(a: argparse.Namespace) -> Porter:
    if a.root and Path(a.root).exists() and not Path(a.root).is_dir():   # (a traceback: a walkthrough)
        raise PortError(f"--root {a.root}: expected the repository's folder (it holds kernels.yaml), got a file")
    # (an empty or blank PIPEGOOSE_MANIFEST is unset, as the other path variables' are: blank gave "error:  : manifest
    # not found", a review)
    env = os.environ.get("PIPEGOOSE_MANIFEST", "")
    manifest = a.manifest or (Path(a.root) / "kernels.yaml" if a.root else env if env.strip() else None)
    p = Porter(manifest, cache_dir=a.cache, offline=a.offline, log=lambda m: err.print(m, style="dim", markup=False))
    _made.append(p)
    return p


def cmd_list(a) -> int:
    p = _porter(a)
    rows = [(s.id, f"{s.project}: {s.pin}", s.license, Text(s.state, style=_STATE_STYLE.get(s.state, "")), s.detail)
            for s in p.states(check_hashes=not a.quick)]
    # id, license and state whole in the table (rich folded ids mid-word below 133 columns), where they leave
    # print_table's rest_min (40 characters) to source and detail; else a list: a line of id and state per kernel, its
    # source, license and detail indented below (at 60 columns the table broke the ids mid-word)
    print_table(out, f"kernels ({p.manifest.path})", ("kernel", "source", "license", "state", "detail"), rows,
                whole=(0, 2, 3), head=(0, 3))
    return 0


def cmd_add(a) -> int:
    p = _porter(a)
    before = {s.id: s for s in p.states()}
    unrecorded = p.unrecorded()
    o = p.add_outcome(a.ids)
    ids = o["added"] + list(o["re-recorded"]) + o["re-vendored"]
    # only a kernel new to kernels.lock is "added" (a review: our own kernel whose record matched its files, and a
    # ported one re-vendored over an edit, were "added" too)
    if o["added"]:
        out.print(f"added {len(o['added'])} kernel(s): {', '.join(o['added'])}")
    if o["re-recorded"]:
        what = [f"{kid} ({', '.join(fs)})" for kid, fs in o["re-recorded"].items()]
        out.print(f"re-recorded {len(what)} kernel(s) of this project in kernels.lock (what changed since it recorded "
                  f"them): {', '.join(what)}", markup=False)
    if o["re-vendored"]:
        out.print(f"re-vendored {len(o['re-vendored'])} kernel(s) already in kernels.lock, from the pinned source(s): "
                  f"{', '.join(o['re-vendored'])}", markup=False)
    if ids and o["in_place"]:
        out.print(f"already in place: {', '.join(o['in_place'])}", markup=False)
    if ids:
        # a source's folder is written whole, with the other kernels kernels.lock holds of it: say so (a walkthrough:
        # `add fused_layernorm` in a fresh clone wrote six kernels' files and named one), and name the local edits
        # of those kernels' files that it replaced (a review: they went without a word)
        after = {s.id: s.state for s in p.states()}
        ported = {sid for sid, src in p.manifest.sources.items() if not src.is_local}
        rewritten = {kid: s for kid, s in before.items() if s.source in ported and after.get(kid) == "verified"}
        back = [kid for kid, s in rewritten.items() if kid not in ids and s.state == "missing"]
        # (the kernels added too: re-vendoring replaces their own edits; and a missing kernel's present edited files)
        edited = [kid for kid, s in rewritten.items() if s.modified]
        if back:
            out.print(f"restored with them, from the same source(s) as kernels.lock records them: {', '.join(back)}")
        _print_replaced(edited, before, "from the pinned source(s)")
    else:
        out.print("nothing to add: every kernel named is already in place (vendored at its pin, or this project's own "
                  "with kernels.lock recording its files as they are) and verifies")
    _print_unrecorded(p, unrecorded)
    return 0


def _print_replaced(edited: list[str], before: dict, how: str) -> None:
    """Name the kernels whose local edits a change replaced (``before``: their states before it)."""
    if edited:
        out.print(f"replaced the local changes to these kernels' files, {how}: "
                  f"{', '.join(f'{kid} ({before[kid].modified})' for kid in edited)}", style="yellow", markup=False)


def _print_unrecorded(p: Porter, before: dict[str, list[str]]) -> None:
    """Name the files kernels.lock does not record (``before``: :meth:`Porter.unrecorded` before the change) that the
    change removed, writing their source's folders whole, and those still there (a review: `add` deleted a user's own
    vendor/<source>/my_patches/ without a word)."""
    # lexists: a dangling link left in place is still there (exists() follows it; a review)
    gone = [f for files in before.values() for f in files if not os.path.lexists(p.root / f)]
    if gone:
        out.print(f"removed files not recorded in kernels.lock, with their source's folders written as kernels.lock "
                  f"records them: {', '.join(gone)}", style="yellow", markup=False)
    left = [f for files in p.unrecorded().values() for f in files]
    if left:
        out.print(f"not recorded in kernels.lock, left in place (verify fails until they go; sync removes them): "
                  f"{', '.join(left)}", style="yellow", markup=False)


def _print_unlocked(p: Porter, cmd: str) -> None:
    """Name the kernels of kernels.yaml that kernels.lock does not record: ``cmd`` neither vendors nor verifies them."""
    left = p.unlocked_kernels()
    if left:
        out.print(f"{cmd}: declared in kernels.yaml but not recorded in kernels.lock, so neither vendored nor verified "
                  f"(the builder refuses the ported ones): {', '.join(left)}; record them with python tools/port.py "
                  f"add {' '.join(left)} (or python tools/port.py sync --all)", style="yellow", markup=False)


def cmd_sync(a) -> int:
    p = _porter(a)
    r = p.sync(all_kernels=a.all)
    # (a review: "added 0 kernel(s)" beside "vendored ..." on a fresh clone read as if nothing had been fetched)
    added = f" ({', '.join(r['added'])})" if r["added"] else ""
    done = [f"added {len(r['added'])} kernel(s) to kernels.lock{added}"]
    if r.get("vendored"):
        done.append(f"vendored {', '.join(r['vendored'])}")
    if r["restored"]:
        done.append(f"re-vendored {', '.join(r['restored'])} (their folders differed from kernels.lock: files "
                    "missing, changed or not recorded there, which sync removes)")
    done.append(f"already in place {', '.join(r['ok']) or 'none'}")
    if r.get("dropped"):
        done.append(f"dropped {', '.join(r['dropped'])} (no vendored kernel comes from it any more)")
    out.print("sync: " + "; ".join(done), markup=False)
    if r.get("differs"):
        out.print(f"sync: this project's own files differ from kernels.lock (verify fails): {', '.join(r['differs'])}; "
                  f"sync fetches nothing for them: restore missing or changed files from git (git checkout -- <path>), "
                  f"or re-record intended changes with python tools/port.py add <id>", style="yellow", markup=False)
    if r["stray"]:
        out.print(f"sync: not recorded in kernels.lock, left in place (not sync's files; verify fails until they go: "
                  f"delete them, or declare their source and kernels in kernels.yaml and add them): "
                  f"{', '.join(r['stray'])}", style="yellow", markup=False)
    _print_unlocked(p, "sync")
    return 0


def cmd_verify(a) -> int:
    p = _porter(a)
    problems = p.verify()
    for pr in problems:
        out.print(str(pr), markup=False)
    if problems:
        out.print(f"[red]verify: {len(problems)} problem(s)[/red]")
    else:
        out.print("verify: every vendored file and license matches kernels.lock")
    _print_unlocked(p, "verify")
    return 1 if problems else 0


def cmd_remove(a) -> int:
    ids = _porter(a).remove(a.ids)
    out.print(f"removed {len(ids)} kernel(s): {', '.join(ids)}")
    return 0


def _print_audit(report, with_diff: bool) -> None:
    """One row per kernel (file counts by status, entry symbols, new upstream files), then one row per file
    that is not unchanged."""
    for s in report.sources:
        head = f"{s.source}: {short_pin(s.from_pin)} -> {short_pin(s.to_pin) if s.to_pin else '?'}"
        if s.error:
            out.print(f"{head}: error: {s.error}", style="red", markup=False, soft_wrap=False)
            continue
        if s.unverified:
            out.print(f"{head}: unverified: {s.unverified}", style="yellow", markup=False)
        rows = [("(license)", ", ".join(f"{f.path} {f.status}" for f in s.licenses), "", "")]
        details = []
        for k in s.kernels:
            counts: dict[str, int] = {}
            for f in k.files:
                counts[f.status] = counts.get(f.status, 0) + 1
            files = ", ".join(f"{n} {st}" for st, n in sorted(counts.items()))
            present = sum(1 for sy in k.symbols if sy.after)
            gone = [sy.symbol for sy in k.symbols if not sy.after]
            syms = f"{present}/{len(k.symbols)}" + (f" (missing: {', '.join(gone)})" if gone else "")
            rows.append((k.kernel, Text(files, style="red" if k.drift else "green"), syms,
                         ", ".join(k.new_files) or "-"))
            details += [(k.kernel, f) for f in k.files if f.status != "unchanged"]
        # kernel ids whole (rich folded them mid-word at 40 columns); a list where the rest would not fit
        print_table(out, head, ("kernel", "files", "entry symbols", "new upstream files beside"), rows,
                    whole=(0,), head=(0, 1), labels=True)
        if details:
            print_table(out, f"{s.source}: files not unchanged", ("kernel", "file", "status", "+/-", "moved to"),
                        [(kid, f.path, f.status, f"+{f.added}/-{f.deleted}", ", ".join(f.moved_to))
                         for kid, f in details],
                        whole=(0, 2, 3), head=(0, 2), labels=True)
        verdict = "[red]drift[/red]" if s.drift else "[green]in sync[/green]"
        nsym = sum(1 for k in s.kernels for sy in k.symbols if sy.after)
        tot = sum(len(k.symbols) for k in s.kernels)
        out.print(f"{s.source}: {verdict}; entry symbols present {nsym}/{tot}; "
                  f"license {'changed' if s.license_changed else 'unchanged'}", soft_wrap=False)   # (at words)
        if with_diff:
            for f in [*s.licenses, *(f for k in s.kernels for f in k.files)]:
                if f.diff:
                    out.print(f.diff, markup=False)


def cmd_audit(a) -> int:
    report = audit(_porter(a), a.ids or None, to=a.to, latest=a.latest, with_diff=a.diff)
    if a.json:
        print(report.to_json(with_diff=a.diff))
    else:
        _print_audit(report, a.diff)
    return report.exit_code


def cmd_update(a) -> int:
    p = _porter(a)
    # update writes the source's folders whole at the new pin, as add does: name the local edits it replaces and the
    # files kernels.lock does not record that it removes (a review: they went without a word)
    before = {s.id: s for s in p.states()}
    unrecorded = p.unrecorded()
    report = update(p, a.id, to=a.to, latest=a.latest, force=a.force, allow_downgrade=a.allow_downgrade,
                    trust_cache=a.trust_cache)
    _print_audit(report, False)
    s = report.sources[0]
    if not report.updated:
        out.print(f"{s.source} is already at {short_pin(s.to_pin)}: nothing changed")
        return 0
    out.print(f"updated {s.source}: {short_pin(s.from_pin)} -> {short_pin(s.to_pin)} (kernels.yaml and kernels.lock)")
    edited = [kid for kid, st in before.items() if st.source == s.source and st.modified]
    _print_replaced(edited, before, "with the files at the new pin")
    _print_unrecorded(p, {s.source: unrecorded.get(s.source, [])})
    return 0


class _Parser(argparse.ArgumentParser):
    """Points ``doctor`` and ``build``, commands of ``python -m pipegoose.kernels``, there (a walkthrough: "invalid
    choice: 'doctor'" alone)."""

    def error(self, message: str):
        for cmd in ("doctor", "build"):
            if f"invalid choice: '{cmd}'" in message:
                message += f"; for {cmd}: python -m pipegoose.kernels {cmd}"
        super().error(message)


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(prog="tools/port.py", description=__doc__.split("\n\n")[0])
    # the common options before the subcommand, and again after it (SUPPRESS there: absent after it keeps the value
    # given before; they worked only after it, though the docstring says "common to all")
    common = argparse.ArgumentParser(add_help=False)
    for flag, kw in (("--root", {"type": path_arg,
                                 "help": "repository root (holds kernels.yaml); default: this repository"}),
                     ("--manifest", {"type": path_arg, "help": "path of kernels.yaml (overrides --root)"}),
                     ("--cache", {"type": path_arg,
                                  "help": "download cache (default $PIPEGOOSE_PORT_CACHE, else "
                                          "$XDG_CACHE_HOME/pipegoose/port, else ~/.cache/pipegoose/port)"}),
                     ("--offline", {"action": "store_true", "help": "use only the download cache"})):
        ap.add_argument(flag, **kw)
        common.add_argument(flag, default=argparse.SUPPRESS, **kw)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("list", parents=[common], help="every kernel: source, license, state")
    s.add_argument("--quick", action="store_true", help="do not hash files (state 'vendored' instead of verified)")
    s.set_defaults(fn=cmd_list)
    s = sub.add_parser("add", parents=[common], help="vendor kernels at their pin")
    s.add_argument("ids", nargs="+")
    s.set_defaults(fn=cmd_add)
    s = sub.add_parser("sync", parents=[common], help="vendor everything in kernels.lock")
    s.add_argument("--all", action="store_true", help="also add every kernel of kernels.yaml not in the lock")
    s.set_defaults(fn=cmd_sync)
    s = sub.add_parser("verify", parents=[common], help="recompute hashes against kernels.lock")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("remove", parents=[common], help="drop vendored kernels")
    s.add_argument("ids", nargs="+")
    s.set_defaults(fn=cmd_remove)
    s = sub.add_parser("audit", parents=[common], help="compare vendored kernels with a newer upstream")
    s.add_argument("ids", nargs="*", help="kernel ids/aliases or source ids (default: every vendored kernel)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--to", help="version (pypi) or commit/ref (git) to compare with; needs exactly one source "
                                "(name it when more than one is vendored)")
    g.add_argument("--latest", action="store_true", help="newest release / branch head (the default)")
    s.add_argument("--diff", action="store_true", help="show the changes")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_audit)
    s = sub.add_parser("update", parents=[common], help="re-vendor a source at a new pin")
    s.add_argument("id", help="kernel id/alias or source id")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--to", help="version (pypi) or commit/ref (git) to move to")
    g.add_argument("--latest", action="store_true", help="newest release / branch head")
    s.add_argument("--force", action="store_true", help="update even if a symbol vanished or a license changed")
    s.add_argument("--allow-downgrade", action="store_true",
                   help="allow a version older (PEP 440) than the pinned one; without it update refuses "
                        "(git sources, pinned by commit, have no order and are never refused)")
    s.add_argument("--trust-cache", action="store_true",
                   help="with --offline, pin the download cache's sdist of a version kernels.yaml does not pin as it "
                        "is (its sha256 cannot be checked against the package index); without it update refuses")
    s.set_defaults(fn=cmd_update)
    a = ap.parse_args(argv)
    _made.clear()
    try:
        return a.fn(a)
    except (PortError, ManifestError) as e:
        err.print(f"error: {e}", style="red", markup=False)
        return 2
    except BrokenPipeError:   # (below, in __main__)
        raise
    except OSError as e:   # a folder not writable, a file where a folder must be, ...: exit 1 means drift
        where = f"{e.filename}: " if e.filename else ""
        err.print(f"error: {where}{e.strerror or e}", style="red", markup=False)
        return 2
    except KeyboardInterrupt:
        # A Ctrl-C can land before a change's commit point (it is rolled back: now, or by the next run if the
        # rollback itself was cut short) or after it (the change is in place): say which
        if any(p.committed for p in _made):
            err.print("interrupted after the change was applied: kernels.lock, vendor/ and LICENSES/ (and kernels.yaml "
                      "for update) hold it; check with: python tools/port.py verify")
        else:
            err.print("interrupted: this run changed nothing (a change cut short midway is rolled back at once, or by "
                      "the next run)")
        return 130


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... --json | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
