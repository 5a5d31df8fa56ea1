"""audit / update against two versions of a local sdist and two commits of a local git repository."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipegoose.porting import PortError, audit, update
from pipegoose.porting.audit import edit_source_pin, symbol_defined
from pipegoose.porting.lock import Lock
from porting_helpers import (APACHE, APACHE_V2, V1_FILES, commit_files, init_git_upstream, kernel_yaml, make_sdist,
                             publish, sha256, source_yaml)

ROOT = Path(__file__).resolve().parents[2]
K_ALPHA = kernel_yaml("up/alpha", "up", ["csrc/kernels/alpha.cu", "csrc/common/util.h"], "alpha_fwd", "alpha_forward")
K_BETA = kernel_yaml("up/beta", "up", ["csrc/kernels/beta.cu", "csrc/common/extra.h", "csrc/common/util.h"],
                     "beta_fwd", "beta_forward")

# v2: alpha.cu changed (+2/-1), util.h unchanged, extra.h moved to csrc/include/, a new file beside alpha.cu
V2_CHANGED = {**V1_FILES,
              "csrc/kernels/alpha.cu": V1_FILES["csrc/kernels/alpha.cu"].replace("  return twice(x);\n",
                                                                                 "  int y = twice(x);\n  return y;\n"),
              "csrc/kernels/gamma.cu": "int gamma_fwd(int x) { return x; }\n"}
V2_CHANGED["csrc/include/extra.h"] = V2_CHANGED.pop("csrc/common/extra.h")
# v2 where alpha_fwd disappears (renamed), but every file stays
V2_RENAMED = {**V1_FILES, "csrc/kernels/alpha.cu": V1_FILES["csrc/kernels/alpha.cu"].replace("alpha_fwd", "alpha_forward_v2")}


def publish_version(repo, version, files, license_text=APACHE):
    sd = make_sdist(repo.root.parent / "build", "up", version, files, license_text)
    publish(Path(repo.index_url[len("file://"):]), sd)
    return sd


def setup_sdist(repo, kernels=K_ALPHA + K_BETA, add=("alpha", "beta")):
    sd = publish_version(repo, "1.0", V1_FILES)
    repo.write_manifest(
        "  # the upstream\n" + source_yaml("up", f"pypi: {{name: up, version: '1.0', sha256: {sha256(sd.read_bytes())}}}"),
        kernels)
    p = repo.porter()
    p.add(list(add))
    return p


def by_path(report, kernel):
    s = report.sources[0]
    k = next(k for k in s.kernels if k.kernel == kernel)
    return {f.path: f for f in k.files}, k


def test_audit_unchanged_is_in_sync(repo):
    p = setup_sdist(repo)
    publish_version(repo, "1.1", V1_FILES)
    r = audit(p, to="1.1")
    assert r.exit_code == 0
    assert r.sources[0].to_pin["version"] == "1.1"
    files, k = by_path(r, "up/alpha")
    assert {f.status for f in files.values()} == {"unchanged"}
    assert [(s.symbol, s.before, s.after) for s in k.symbols] == [("alpha_fwd", True, True)]
    # --latest (the default) finds 1.1 as the newest final release, ignoring a pre-release
    publish_version(repo, "2.0rc1", V2_CHANGED)
    r = audit(p, latest=True)
    assert r.sources[0].to_pin["version"] == "1.1" and r.exit_code == 0


def test_audit_latest_offline_says_it_needs_the_index(repo, monkeypatch):
    """A walkthrough: `audit --offline` (whose default is --latest) asked the package index, which --offline ("use only
    the download cache") rules out, and failed with "cannot reach any package index". It now says why without asking,
    and what to pass instead; --to with the sdist in the download cache works offline."""
    setup_sdist(repo)
    publish_version(repo, "1.1", V1_FILES)
    audit(repo.porter(), to="1.1")   # online: 1.1's sdist is now in the download cache
    from pipegoose.porting import fetch

    offline = repo.porter(offline=True)
    monkeypatch.setattr(fetch, "SimpleIndex", lambda *a, **k: pytest.fail("asked the package index"))
    offline.fetcher._index = None
    for kw in ({"latest": True}, {}):
        r = audit(offline, **kw)
        assert r.exit_code == 2 and r.sources[0].error.startswith(
            "up: the newest upstream is on the package index, and --offline was given: pass --to VERSION"), r.sources
        # the versions it can take, and the whole command (a walkthrough: `audit --offline --to 0.5.0` then failed
        # for want of the source's name)
        assert "in the cache: 1.0, 1.1" in r.sources[0].error and \
            "`python tools/port.py audit up --offline --to 1.1`" in r.sources[0].error, r.sources[0].error
    assert audit(offline, to="1.1").exit_code == 0


def test_audit_changed_moved_new_and_license(repo):
    p = setup_sdist(repo)
    publish_version(repo, "2.0", V2_CHANGED, APACHE_V2)
    r = audit(p, to="2.0", with_diff=True)
    assert r.exit_code == 1
    s = r.sources[0]
    assert [(f.path, f.status) for f in s.licenses] == [("LICENSE", "changed")] and s.license_changed
    files, k = by_path(r, "up/alpha")
    assert files["csrc/kernels/alpha.cu"].status == "changed"
    assert (files["csrc/kernels/alpha.cu"].added, files["csrc/kernels/alpha.cu"].deleted) == (2, 1)
    assert "+  int y = twice(x);" in files["csrc/kernels/alpha.cu"].diff
    assert files["csrc/common/util.h"].status == "unchanged"
    assert k.new_files == ["csrc/kernels/gamma.cu"]
    assert k.symbols[0].after
    files_b, kb = by_path(r, "up/beta")
    assert files_b["csrc/common/extra.h"].status == "moved"
    assert files_b["csrc/common/extra.h"].moved_to == ["csrc/include/extra.h"]
    # JSON is stable and complete
    data = json.loads(r.to_json())
    assert data["exit_code"] == 1 and data["sources"][0]["license_changed"] is True
    assert r.to_json() == audit(p, to="2.0").to_json()
    # update refuses: a vendored file moved
    before = repo.snapshot()
    with pytest.raises(PortError, match="extra.h moved to csrc/include/extra.h"):
        update(p, "up", to="2.0", force=True)
    assert repo.snapshot() == before


def test_audit_removed_file(repo):
    p = setup_sdist(repo)
    v2 = {k: v for k, v in V1_FILES.items() if k != "csrc/common/extra.h"}
    v2["csrc/kernels/beta.cu"] = "int beta_fwd(int x) { return x; }\n"
    publish_version(repo, "2.0", v2)
    r = audit(p, ["beta"], to="2.0")
    files, _ = by_path(r, "up/beta")
    assert files["csrc/common/extra.h"].status == "removed"
    assert r.exit_code == 1


def test_vanished_symbol_blocks_update_unless_forced(repo):
    p = setup_sdist(repo)
    publish_version(repo, "2.0", V2_RENAMED)
    r = audit(p, to="2.0")
    _, k = by_path(r, "up/alpha")
    assert [(s.symbol, s.before, s.after) for s in k.symbols] == [("alpha_fwd", True, False)]
    assert r.exit_code == 1
    before = repo.snapshot()
    with pytest.raises(PortError, match="entry symbol alpha_fwd .* not found"):
        update(p, "alpha", to="2.0")
    assert repo.snapshot() == before
    update(p, "alpha", to="2.0", force=True)
    text = (repo.root / "kernels.yaml").read_text()
    assert "# the upstream" in text and "version: '2.0'" in text
    sd2 = repo.root.parent / "build" / "up-2.0.tar.gz"
    assert sha256(sd2.read_bytes()) in text
    assert p.manifest.sources["up"].pin["version"] == "2.0"
    lock = Lock.load(repo.root / "kernels.lock")
    assert lock.sources["up"].pin["version"] == "2.0"
    assert set(lock.kernels) == {"up/alpha", "up/beta"}  # every locked kernel of the source moved together
    assert "alpha_forward_v2" in (repo.root / "vendor/up/csrc/kernels/alpha.cu").read_text()
    assert p.verify() == []


def test_license_change_blocks_update_unless_forced(repo):
    p = setup_sdist(repo)
    publish_version(repo, "1.1", V1_FILES, APACHE_V2)
    with pytest.raises(PortError, match="license file LICENSE changed"):
        update(p, "up", to="1.1")
    update(p, "up", to="1.1", force=True)
    assert (repo.root / "LICENSES/up/LICENSE").read_text() == APACHE_V2
    assert p.verify() == []


def test_update_clean(repo):
    p = setup_sdist(repo, add=("alpha",))
    publish_version(repo, "1.1", {**V1_FILES, "csrc/common/util.h": V1_FILES["csrc/common/util.h"] + "// v1.1\n"})
    r = update(p, "up/alpha", to="1.1")
    assert r.exit_code == 1  # the audit saw the change it then applied
    assert (repo.root / "vendor/up/csrc/common/util.h").read_text().endswith("// v1.1\n")
    assert audit(p, to="1.1").exit_code == 0
    assert p.verify() == []


def test_cli_update_names_the_local_edits_it_replaced_and_the_files_it_removed(repo):
    """A review: `update` wrote the source's folders whole at the new pin and threw local edits to vendored files and
    files kernels.lock does not record away without a word (`add` names the edits it replaces)."""
    setup_sdist(repo)
    publish_version(repo, "1.1", {**V1_FILES, "csrc/common/util.h": V1_FILES["csrc/common/util.h"] + "// v1.1\n"})
    edited = repo.root / "vendor/up/csrc/kernels/beta.cu"
    edited.write_text(edited.read_text() + "// a local edit\n")
    mine = repo.root / "vendor/up/my_patches/fix.patch"
    mine.parent.mkdir()
    mine.write_text("keep\n")
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": repo.index_url, "PIP_EXTRA_INDEX_URL": "",
           "PIP_FIND_LINKS": ""}
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "update", "up", "--root", str(repo.root),
                        "--cache", str(repo.cache), "--to", "1.1"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "updated up: up 1.0 -> up 1.1" in out, r.stdout
    assert "replaced the local changes to these kernels' files" in out and "up/beta (vendor/up/csrc/kernels/beta.cu)" \
        in out and "up/alpha (" not in out, r.stdout
    assert "removed files not recorded in kernels.lock" in out and "vendor/up/my_patches/fix.patch" in out, r.stdout
    assert not mine.exists() and "a local edit" not in edited.read_text()


@pytest.mark.parametrize("links", [True, False])
def test_update_killed_at_any_rename_leaves_kernels_yaml_in_place(repo, monkeypatch, links):
    """A walkthrough killed `update` (kill -9) at each rename of its transaction: at one of them kernels.yaml was
    moved aside, and every later port.py run failed with "kernels.yaml: manifest not found" (it loaded the manifest
    before rolling back; the next run now rolls back first). A review: meanwhile `doctor` said "manifest not found ...
    install it with pip install -e .". A single file is now replaced in one rename, its backup a copy (a hard link, or
    without links a copy made whole first): killed at any rename or link, kernels.yaml and kernels.lock are there,
    and the next run rolls back or finishes the change."""
    from pipegoose.porting import txn as txn_mod

    p = setup_sdist(repo, add=("alpha",))
    publish_version(repo, "1.1", {**V1_FILES, "csrc/common/util.h": V1_FILES["csrc/common/util.h"] + "// v1.1\n"})
    audit(p, to="1.1")  # 1.1 in the download cache
    before = repo.snapshot()
    real_replace, real_link = os.replace, os.link
    for n in range(1, 40):
        calls = {"n": 0}

        def killed(real):
            def call(*a, **kw):
                calls["n"] += 1
                if calls["n"] == n:
                    raise SystemExit("killed")
                return real(*a, **kw)
            return call

        def no_link(*a, **kw):
            raise OSError(1, "Operation not permitted")

        with monkeypatch.context() as m:  # kill -9: no rollback, no clean-up in the dying process
            m.setattr(txn_mod.os, "replace", killed(real_replace))
            m.setattr(txn_mod.os, "link", killed(real_link) if links else no_link)
            m.setattr(txn_mod, "_rollback", lambda root, entries: None)
            m.setattr(txn_mod.Transaction, "__exit__", lambda self, *exc: None)
            try:
                update(repo.porter(), "up", to="1.1")
            except SystemExit:
                pass
            else:
                break   # past the last rename: every one was tried
        for name in ("kernels.yaml", "kernels.lock"):
            assert (repo.root / name).is_file(), (name, n)
        notes = []
        assert repo.porter(log=notes.append).verify() == [], (n, notes)   # rolled back, or finished
        if repo.snapshot() != before:  # killed after the commit point: applied in full; back to 1.0
            update(repo.porter(), "up", to="1.0", allow_downgrade=True)
        assert repo.snapshot() == before
    else:
        pytest.fail("update's transaction did not end within 40 renames")
    assert n > 8   # (journal, vendor/up, LICENSES/up, kernels.lock, kernels.yaml: each one tried)


def test_update_follows_a_file_moved_upstream_once_kernels_yaml_names_it(repo):
    """A walkthrough: upstream moved a vendored header; `update` said to fix kernels.yaml's file list first, and once
    it was fixed said the new path was "removed" (it is absent only at the old pin): the only way on was remove and
    add, which skip update's review. A path at the new pin only is now "added", and the update goes through."""
    p = setup_sdist(repo, kernels=K_ALPHA, add=("alpha",))
    moved = {**V1_FILES, "csrc/kernels/alpha.cu": V1_FILES["csrc/kernels/alpha.cu"].replace("common/util.h",
                                                                                           "include/util.h")}
    moved["csrc/include/util.h"] = moved.pop("csrc/common/util.h")
    publish_version(repo, "1.1", moved)
    with pytest.raises(PortError, match="csrc/common/util.h moved to csrc/include/util.h"):
        update(p, "up", to="1.1")
    manifest = repo.root / "kernels.yaml"
    manifest.write_text(manifest.read_text().replace("csrc/common/util.h", "csrc/include/util.h"))
    r = update(repo.porter(), "up", to="1.1")
    files = {f.path: f.status for f in r.sources[0].kernels[0].files}
    assert files == {"csrc/kernels/alpha.cu": "changed", "csrc/include/util.h": "added"}
    assert repo.porter().verify() == []
    assert (repo.root / "vendor/up/csrc/include/util.h").is_file() and not (repo.root / "vendor/up/csrc/common").exists()


def test_update_to_the_current_pin_changes_nothing(repo):
    p = setup_sdist(repo)
    before = repo.snapshot()
    r = update(p, "up", to="1.0")
    assert r.updated is False and r.exit_code == 0
    assert repo.snapshot() == before
    publish_version(repo, "1.1", V1_FILES)
    assert update(p, "up", to="1.1").updated is True
    assert p.manifest.sources["up"].pin["version"] == "1.1"


@pytest.mark.parametrize("spelling", ["v1.0", "1.0.0", "1"])
def test_update_to_the_current_version_spelled_otherwise_changes_nothing(repo, spelling):
    """PEP 440 equal versions are the pin: no rewrite of kernels.yaml (a found walkthrough bug: 'v0.5.0' was taken
    for a new pin and written into kernels.yaml and the lock)."""
    p = setup_sdist(repo)
    before = repo.snapshot()
    r = update(p, "up", to=spelling)
    assert r.updated is False and r.sources[0].to_pin["version"] == "1.0"
    assert repo.snapshot() == before


@pytest.mark.parametrize("bad", ["", "latest", "1.0 beta"])
def test_update_to_an_invalid_version_is_a_clear_error(repo, bad):
    p = setup_sdist(repo)
    before = repo.snapshot()
    with pytest.raises(PortError, match=f"--to: {bad!r} is not a valid version of up \\(PEP 440, e.g. 1.0\\)"):
        update(p, "up", to=bad)
    assert repo.snapshot() == before
    assert audit(p, to=bad).exit_code == 2


def test_update_refuses_a_downgrade_unless_allowed(repo):
    """A found walkthrough bug: `update colossalai --to 0.4.9` (older than the pin) downgraded without a word."""
    p = setup_sdist(repo)
    publish_version(repo, "0.9", V1_FILES)
    before = repo.snapshot()
    for to in ("0.9", "v0.9.0", "1.0rc1"):  # PEP 440 order: a pre-release of the pin is older too
        with pytest.raises(PortError, match=rf"^up: refusing to downgrade up from the pinned 1\.0 to {to} \(--to\); "
                                            r"pass --allow-downgrade to do it anyway$"):
            update(p, "up", to=to)
    assert repo.snapshot() == before
    assert not list((repo.cache / "pypi" / "up").glob("up-0.9*"))  # refused before any download
    # the CLI: refused (exit 2, the error on stderr), then done with --allow-downgrade
    cmd = [sys.executable, str(ROOT / "tools/port.py"), "update", "up", "--root", str(repo.root), "--cache",
           str(repo.cache), "--to", "0.9"]
    import os

    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": repo.index_url, "PIP_EXTRA_INDEX_URL": "",
           "PIP_FIND_LINKS": ""}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "refusing to downgrade up from the pinned 1.0 to 0.9" in " ".join(r.stderr.split())
    assert repo.snapshot() == before
    r = subprocess.run(cmd + ["--allow-downgrade"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "updated up: up 1.0 -> up 0.9" in " ".join(r.stdout.split())
    p.reload_manifest()
    assert p.manifest.sources["up"].pin["version"] == "0.9" and p.verify() == []
    assert Lock.load(repo.root / "kernels.lock").sources["up"].pin["version"] == "0.9"
    # --latest: the newest release on the index may be older than the pin
    update(p, "up", to="1.0")
    (Path(repo.index_url[len("file://"):]) / "files" / "up-1.0.tar.gz").unlink()
    publish_version(repo, "0.9", V1_FILES)  # rewrites the index page: 0.9 only
    before = repo.snapshot()
    with pytest.raises(PortError, match=r"refusing to downgrade up from the pinned 1\.0 to 0\.9 \(--latest"):
        update(p, "up", latest=True)
    assert repo.snapshot() == before
    assert update(p, "up", latest=True, allow_downgrade=True).updated is True


def test_update_to_an_older_git_commit_is_no_downgrade(repo, tmp_path):
    """Commits have no order: update moves a git source to any commit without --allow-downgrade."""
    up, c1 = init_git_upstream(tmp_path / "upstream", V1_FILES)
    c2 = commit_files(up, {**V1_FILES, "csrc/common/util.h": V1_FILES["csrc/common/util.h"] + "// v2\n"}, APACHE, "v2")
    repo.write_manifest(source_yaml("up", f"git: {{url: '{up.working_tree_dir}', commit: {c2}}}"), K_ALPHA)
    p = repo.porter()
    p.add(["alpha"])
    assert update(p, "up", to=c1).updated is True
    assert Lock.load(repo.root / "kernels.lock").sources["up"].pin["commit"] == c1 and p.verify() == []


def test_audit_to_without_a_source_name_needs_exactly_one_source(repo):
    """A version belongs to one source: `audit --to X` without a name, when more than one source is vendored, is a
    usage error that says so (it said "the kernels named come from ..." when none was named)."""
    sd = publish_version(repo, "1.0", V1_FILES)
    other = make_sdist(repo.root.parent / "build", "other", "1.0", V1_FILES)
    publish(Path(repo.index_url[len("file://"):]), other)
    repo.write_manifest(
        source_yaml("up", f"pypi: {{name: up, version: '1.0', sha256: {sha256(sd.read_bytes())}}}")
        + source_yaml("other", f"pypi: {{name: other, version: '1.0', sha256: {sha256(other.read_bytes())}}}"),
        K_ALPHA + kernel_yaml("other/gamma", "other", ["csrc/kernels/alpha.cu", "csrc/common/util.h"], "alpha_fwd",
                              "gamma_forward"))
    p = repo.porter()
    p.add(["up/alpha", "other/gamma"])
    with pytest.raises(PortError, match=r"^--to needs exactly one source, and without a name audit covers every "
                                        r"vendored one \(other, up\): name it, e\.g\. `audit other --to 1\.0`$"):
        audit(p, to="1.0")
    with pytest.raises(PortError, match=r"^--to needs the kernels of exactly one source; the kernels named come "
                                        r"from other, up$"):
        audit(p, ["up/alpha", "other"], to="1.0")
    assert audit(p, ["other"], to="1.0").exit_code == 0  # one source named: fine
    assert audit(p).exit_code == 0  # --latest (the default) covers every source


def test_update_of_an_unknown_name_lists_the_sources(repo):
    p = setup_sdist(repo)
    with pytest.raises(PortError, match=r"unknown source or kernel 'upp' in kernels.yaml; did you mean the source up\? "
                                        r"update takes a source id \(up\) or a kernel id"):
        update(p, "upp", to="1.1")
    with pytest.raises(PortError, match=r"unknown source or kernel 'up/alpah' in kernels.yaml; did you mean: up/alpha"):
        update(p, "up/alpah", to="1.1")


def test_audit_git_two_commits_and_latest(repo, tmp_path):
    up, c1 = init_git_upstream(tmp_path / "upstream", V1_FILES)
    repo.write_manifest(source_yaml("up", f"git: {{url: '{up.working_tree_dir}', commit: {c1}}}"), K_ALPHA)
    p = repo.porter()
    p.add(["alpha"])
    c2 = commit_files(up, V2_CHANGED, APACHE, "v2")
    r = audit(p, to=c2)
    assert r.sources[0].to_pin["commit"] == c2
    files, k = by_path(r, "up/alpha")
    assert files["csrc/kernels/alpha.cu"].status == "changed" and files["csrc/common/util.h"].status == "unchanged"
    assert k.new_files == ["csrc/kernels/gamma.cu"]
    r2 = audit(p, latest=True)  # the branch head is c2
    assert r2.sources[0].to_pin["commit"] == c2
    assert audit(p, to=c1).exit_code == 0
    update(p, "up", to=c2)
    assert c2 in (repo.root / "kernels.yaml").read_text()
    assert Lock.load(repo.root / "kernels.lock").sources["up"].pin["commit"] == c2
    assert p.verify() == []


def test_network_failure_is_exit_2(repo, tmp_path):
    p = setup_sdist(repo)
    import shutil

    shutil.rmtree(Path(repo.index_url[len("file://"):]))  # the index is gone; 9.9 is in no cache
    r = audit(p, to="9.9")
    assert r.exit_code == 2 and "no sdist of up 9.9 on" in r.sources[0].error, r.sources[0].error
    # through the CLI, with an index that refuses connections
    env = {**__import__("os").environ, "PIP_CONFIG_FILE": __import__("os").devnull,
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "",
           "PIPEGOOSE_PORT_CACHE": str(repo.cache), "PIP_DEFAULT_TIMEOUT": "3", "PIP_RETRIES": "0"}
    out = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "audit", "--root", str(repo.root), "--latest",
                          "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert json.loads(out.stdout)["sources"][0]["error"]


def test_cli_audit_exit_codes_and_json(repo):
    setup_sdist(repo)
    publish_version(repo, "2.0", V2_RENAMED)
    env_cmd = [sys.executable, str(ROOT / "tools/port.py"), "audit", "--root", str(repo.root), "--cache", str(repo.cache)]
    # the index of the test is reached through pip's configuration: point pip at it
    import os

    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": repo.index_url, "PIP_EXTRA_INDEX_URL": "",
           "PIP_FIND_LINKS": ""}
    r = subprocess.run(env_cmd + ["--to", "2.0", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr
    data = json.loads(r.stdout)
    assert data["sources"][0]["kernels"][0]["symbols"][0] == {"symbol": "alpha_fwd", "op": "alpha_forward",
                                                                 "before": True, "after": False}
    r = subprocess.run(env_cmd + ["--to", "1.0"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "in sync" in r.stdout
    upd = [a if a != "audit" else "update" for a in env_cmd]
    before = repo.snapshot()
    r = subprocess.run(upd + ["up", "--to", "1.0"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "up is already at up 1.0: nothing changed" in " ".join(r.stdout.split()), r.stdout
    assert "updated" not in r.stdout and repo.snapshot() == before


@pytest.mark.parametrize("text,expected", [
    ("torch::Tensor fwd_cuda(torch::Tensor const& input, float s) {", True),
    ("std::tuple<at::Tensor, at::Tensor> fwd_cuda(\n int a);", True),
    ("template <typename T>\nvoid fwd_cuda(T x);", True),
    ("int y = fwd_cuda(x);", False),
    ("  return fwd_cuda(x);", False),
    ("// torch::Tensor fwd_cuda(int);", False),
    ("AT_DISPATCH(x, \"fwd_cuda\", ...);", False),
    ("torch::Tensor fwd_cuda_v2(int);", False),
])
def test_symbol_regex(text, expected):
    assert symbol_defined("fwd_cuda", text) is expected


def test_edit_source_pin_keeps_layout():
    text = ("schema: 1\nsources:\n  a:\n    fetch:\n      pypi: {name: a, version: 1.0, sha256: " + "a" * 64 + "}  # pinned\n"
            "  b:\n    fetch:\n      pypi: {name: b, version: 1.0, sha256: " + "b" * 64 + "}\nkernels: {}\n")
    new = edit_source_pin(text, "b", {"name": "b", "version": "1.0", "sha256": "b" * 64},
                          {"name": "b", "version": "1.1", "sha256": "c" * 64})
    d = yaml.safe_load(new)
    assert d["sources"]["a"]["fetch"]["pypi"]["version"] == 1.0 and "# pinned" in new
    assert d["sources"]["b"]["fetch"]["pypi"] == {"name": "b", "version": "1.1", "sha256": "c" * 64}


def test_audit_of_a_misspelt_source_suggests_the_source(repo):
    """A walkthrough: `audit colosalai` suggested kernels ("did you mean: causal_softmax"); audit takes source ids too,
    and now suggests the source."""
    p = setup_sdist(repo, add=("alpha",))
    with pytest.raises(PortError, match="unknown source or kernel 'upp' in kernels.yaml; did you mean the source up"):
        audit(p, ["upp"])


def test_a_misspelt_entry_symbol_is_refused_by_add_and_is_drift_in_audit(repo):
    """A fresh-clone walkthrough misspelt an entry symbol in kernels.yaml: add, sync and doctor said nothing, and audit
    printed "in sync; entry symbols present 9/10" with exit 0. Now add refuses it, naming the symbol, and audit (of a
    lock written before the check) counts a symbol not found at the target as drift."""
    from pipegoose.porting import ManifestFactError

    setup_sdist(repo, kernels=K_ALPHA, add=("alpha",))
    manifest = repo.root / "kernels.yaml"
    manifest.write_text(manifest.read_text().replace("symbol: alpha_fwd,", "symbol: alpha_fwdX,"))
    (repo.root / "vendor" / "up" / "csrc" / "kernels" / "alpha.cu").write_text("tampered\n")  # add re-locks
    # a binding that declares the upstream function it calls does not count: the symbol must be in the kernel's
    # files, where audit looks (a review: the binding was searched too, and add and audit disagreed)
    binding = repo.root / "pipegoose" / "kernels" / "bindings" / "alpha_forward.cpp"
    binding.parent.mkdir(parents=True, exist_ok=True)
    binding.write_text("int alpha_fwdX(int x);\n")
    before = repo.snapshot()
    with pytest.raises(ManifestFactError, match=r"kernels\.up/alpha\.entries: expected each entry symbol declared .*"
                                                r"not found in up 1\.0 sdist: alpha_fwdX \(alpha_forward\)"):
        repo.porter().add(["alpha"])
    assert repo.snapshot() == before
    publish_version(repo, "1.1", V1_FILES)
    r = audit(repo.porter(), to="1.1")
    _, k = by_path(r, "up/alpha")
    assert [(s.symbol, s.before, s.after) for s in k.symbols] == [("alpha_fwdX", False, False)]
    assert r.exit_code == 1


@pytest.mark.parametrize("columns", [40, 60, 160])
def test_cli_audit_fits_narrow_terminals(repo, columns):
    """A walkthrough (session 41): at 40 columns `port.py audit` folded kernel ids and file paths mid-word (rich
    shrank every column of its tables). They now stay whole: a table where the rest fits, else a list."""
    setup_sdist(repo)
    publish_version(repo, "2.0", V2_CHANGED)
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": repo.index_url, "PIP_EXTRA_INDEX_URL": "",
           "PIP_FIND_LINKS": "", "COLUMNS": str(columns)}
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "audit", "--root", str(repo.root), "--cache",
                        str(repo.cache), "--to", "2.0"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns, r.stdout
    words = {w.strip("│|,;()") for line in lines for w in line.split()}
    for whole in ("up/alpha", "up/beta", "csrc/kernels/alpha.cu", "csrc/common/extra.h", "csrc/kernels/gamma.cu"):
        assert whole in words, f"{whole} not whole at {columns} columns:\n{r.stdout}"
    assert "drift" in r.stdout
    if "┏" not in r.stdout:   # the list layout names its cells (a walkthrough: "2/2; -" said nothing)
        assert "entry symbols: 1/1" in " ".join(r.stdout.split()), r.stdout


EVIL_V11 = {**V1_FILES, "csrc/kernels/alpha.cu": V1_FILES["csrc/kernels/alpha.cu"] + "// EVIL\n"}


def _tamper_cached(repo, version: str, how: str) -> Path:
    """The download cache's sdist of ``version`` altered (``evil``: a repacked archive with an extra line in alpha.cu;
    ``cut``: its first half, a download cut short)."""
    cached = repo.cache / "pypi" / "up" / f"up-{version}.tar.gz"
    if how == "evil":
        cached.write_bytes(make_sdist(repo.root.parent / "evil", "up", version, EVIL_V11).read_bytes())
    else:
        data = cached.read_bytes()
        cached.write_bytes(data[: len(data) // 2])
    return cached


@pytest.mark.parametrize("with_hash", [True, False])
@pytest.mark.parametrize("how", ["evil", "cut"])
def test_an_altered_cached_sdist_of_a_version_not_pinned_is_downloaded_again(repo, how, with_hash):
    """A review: `update --to`/`audit --to` took whatever sdist the download cache held for a version kernels.yaml does
    not pin, even online: a repacked archive was pinned in kernels.yaml and kernels.lock as it was (its vendored file
    carried `// EVIL`, and verify passed), and one cut short failed naming no cache path. Online, the cached file is now
    checked against the index's sha256 and downloaded again where it differs (where the index publishes none, the
    file is downloaded afresh)."""
    p = setup_sdist(repo)
    sd = make_sdist(repo.root.parent / "build", "up", "1.1", V1_FILES)
    publish(Path(repo.index_url[len("file://"):]), sd, with_hash)
    audit(p, to="1.1")   # 1.1 in the download cache
    cached = _tamper_cached(repo, "1.1", how)
    r = audit(repo.porter(), to="1.1")
    assert r.exit_code == 0 and not r.sources[0].unverified and r.sources[0].to_pin["sha256"] == sha256(sd.read_bytes())
    assert cached.read_bytes() == sd.read_bytes()
    _tamper_cached(repo, "1.1", how)
    assert update(repo.porter(), "up", to="1.1").updated
    assert "EVIL" not in (repo.root / "vendor/up/csrc/kernels/alpha.cu").read_text()
    assert yaml.safe_load((repo.root / "kernels.yaml").read_text())["sources"]["up"]["fetch"]["pypi"]["sha256"] == \
        sha256(sd.read_bytes()) == Lock.load(repo.root / "kernels.lock").sources["up"].pin["sha256"]
    assert repo.porter().verify() == []


def test_offline_a_version_not_pinned_is_unverified_and_update_needs_trust_cache(repo):
    """The review's offline half: with --offline nothing can check a cached sdist of a version kernels.yaml does not
    pin. audit says so (`unverified`, also in --json); update refuses to pin it unless --trust-cache is given; a file
    cut short is named with its path and what to do. The pinned version's cached file is checked against the pin."""
    p = setup_sdist(repo)
    sd = publish_version(repo, "1.1", V1_FILES)
    audit(p, to="1.1")
    cached = _tamper_cached(repo, "1.1", "evil")
    offline = repo.porter(offline=True)
    r = audit(offline, to="1.1")
    assert r.exit_code == 1 and f"{cached} is the download cache's sdist of up 1.1, which kernels.yaml does not pin, " \
        "and --offline was given: its sha256" in r.sources[0].unverified, r.sources[0]
    assert json.loads(r.to_json())["sources"][0]["unverified"] == r.sources[0].unverified
    before = repo.snapshot()
    with pytest.raises(PortError, match=r"^up: refusing to pin up 1.1 unverified: .*run without --offline .*or pass "
                                        r"--trust-cache to pin the cached file's sha256 as it is$"):
        update(offline, "up", to="1.1")
    assert repo.snapshot() == before
    # the CLI: exit 2, then --trust-cache pins it and says it is unverified
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": repo.index_url, "PIP_EXTRA_INDEX_URL": "",
           "PIP_FIND_LINKS": ""}
    cmd = [sys.executable, str(ROOT / "tools/port.py"), "update", "up", "--root", str(repo.root), "--cache",
           str(repo.cache), "--to", "1.1", "--offline"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "refusing to pin up 1.1 unverified" in " ".join(r.stderr.split()), r.stderr
    assert repo.snapshot() == before
    r = subprocess.run(cmd + ["--trust-cache"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "up: up 1.0 -> up 1.1: unverified:" in out and "updated up: up 1.0 -> up 1.1" in out, r.stdout
    assert "EVIL" in (repo.root / "vendor/up/csrc/kernels/alpha.cu").read_text()   # (as asked)
    # online, the pinned (altered) sha256 is what the next update --to of the same version checks against: the pin
    update(repo.porter(), "up", to="1.0", allow_downgrade=True)
    # a file cut short: its path and the fix, offline
    cached.write_bytes(sd.read_bytes()[:100])
    r = audit(repo.porter(offline=True), to="1.1")
    assert r.exit_code == 2 and r.sources[0].error.startswith(f"{cached}: cannot read archive: ") and \
        "delete it and run without --offline" in r.sources[0].error, r.sources[0].error
    # the pinned version: checked against the pin, offline too (it was taken unpinned, and re-pinned as it was)
    pinned = repo.cache / "pypi" / "up" / "up-1.0.tar.gz"
    pinned.write_bytes(make_sdist(repo.root.parent / "evil", "up", "1.0", EVIL_V11).read_bytes())
    with pytest.raises(PortError, match=r"the download cache holds .*up-1.0.tar.gz with sha256 .*either the pin is "
                                        r"wrong"):
        update(repo.porter(offline=True), "up", to="1.0.0")


def test_reading_pips_index_config_leaves_pip_out_of_the_process():
    """pip's configuration and default index are read in subprocesses: importing pip here turned setuptools' distutils
    shim off (on Python < 3.12), and a kernel built afterwards in the same process failed at ``import setuptools``
    (torch.utils.cpp_extension) with an AssertionError. A fresh interpreter with no index configured reads the
    config, then imports setuptools."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull   # (no index-url from the machine's pip config: pip's default is asked for)
    code = ("import sys; from pipegoose.porting.fetch import pip_index_config; c = pip_index_config(); "
            "assert c.index_urls and c.index_urls[0].startswith('https://'), c; "
            "assert 'pip' not in sys.modules, sorted(m for m in sys.modules if m.startswith('pip')); "
            "import setuptools; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
