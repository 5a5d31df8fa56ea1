"""add / sync / verify / remove / list against a local sdist (file:// simple index) and a local git repository."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from pipegoose.porting import (FetchError, IntegrityError, LicenseError, ManifestFactError, PortError,
                               SourceFileMissing)
from pipegoose.porting import porter as porter_mod
from pipegoose.porting import txn as txn_mod
from pipegoose.porting.fetch import Fetcher
from pipegoose.porting.licenses import detect_licenses, file_license_problem
from pipegoose.porting.lock import Lock
from porting_helpers import (APACHE, GPL, MIT, V1_FILES, init_git_upstream, kernel_yaml, make_sdist,
                             publish, sha256, source_yaml)

ROOT = Path(__file__).resolve().parents[2]

K_ALPHA = kernel_yaml("up/alpha", "up", ["csrc/kernels/alpha.cu", "csrc/common/util.h"], "alpha_fwd", "alpha_forward")
K_BETA = kernel_yaml("up/beta", "up", ["csrc/kernels/beta.cu", "csrc/common/extra.h", "csrc/common/util.h"],
                     "beta_fwd", "beta_forward")


def sdist_source(repo, files=V1_FILES, license_text=APACHE, version="1.0", declared="Apache-2.0", with_hash=True):
    sd = make_sdist(repo.root.parent / "build", "up", version, files, license_text)
    publish(Path(repo.index_url[len("file://"):]), sd, with_hash)
    return source_yaml("up", f"pypi: {{name: up, version: '{version}', sha256: {sha256(sd.read_bytes())}}}", declared), sd


@pytest.fixture
def sdist_repo(repo):
    src, _ = sdist_source(repo)
    repo.write_manifest(src, K_ALPHA + K_BETA)
    return repo


@pytest.fixture
def git_repo(repo, tmp_path):
    up, sha = init_git_upstream(tmp_path / "upstream", V1_FILES)
    repo.write_manifest(source_yaml("up", f"git: {{url: '{up.working_tree_dir}', commit: {sha}}}"), K_ALPHA + K_BETA)
    repo.upstream = up
    return repo


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sdist", "git"])
def test_add_vendors_files_licenses_and_lock(kind, request):
    repo = request.getfixturevalue(f"{kind}_repo")
    p = repo.porter()
    assert p.add(["alpha"]) == ["up/alpha"]
    v = repo.root / "vendor" / "up"
    assert (v / "csrc/kernels/alpha.cu").read_text() == V1_FILES["csrc/kernels/alpha.cu"]
    assert (v / "csrc/common/util.h").read_text() == V1_FILES["csrc/common/util.h"]
    assert not (v / "csrc/kernels/beta.cu").exists()
    assert (repo.root / "LICENSES/up/LICENSE").read_text() == APACHE
    lock = yaml.safe_load((repo.root / "kernels.lock").read_text())
    assert lock["kernels"]["up/alpha"]["files"] == {
        "csrc/kernels/alpha.cu": sha256(V1_FILES["csrc/kernels/alpha.cu"].encode()),
        "csrc/common/util.h": sha256(V1_FILES["csrc/common/util.h"].encode())}
    assert lock["sources"]["up"]["license_files"] == {"LICENSE": sha256(APACHE.encode())}
    pin = lock["sources"]["up"]["pin"]
    assert pin == dict(p.manifest.sources["up"].pin)
    assert p.verify() == []
    assert {s.id: s.state for s in p.states()} == {"up/alpha": "verified", "up/beta": "declared"}
    # deterministic: re-serialising gives the same bytes
    assert Lock.load(repo.root / "kernels.lock").dumps() == (repo.root / "kernels.lock").read_text()
    assert not (repo.root / "vendor" / ".port-txn").exists()


def test_sync_restores_from_cache_without_network(sdist_repo):
    repo = sdist_repo
    with pytest.raises(PortError, match="sync --all"):
        repo.porter().sync()
    r = repo.porter().sync(all_kernels=True)
    assert r["added"] == ["up/alpha", "up/beta"]
    before = repo.snapshot()
    import shutil

    shutil.rmtree(repo.root / "vendor" / "up")
    shutil.rmtree(repo.root / "LICENSES")
    # the index disappears: only the download cache can serve
    shutil.rmtree(Path(repo.index_url[len("file://"):]))
    lines = []
    r = repo.porter(offline=True, log=lines.append).sync()
    # absent (a fresh clone): "vendored", not "re-vendored"
    assert r["vendored"] == ["up"] and r["restored"] == []
    # offline, the progress line does not promise the network (session 34's walkthrough)
    assert [ln for ln in lines if ln.startswith("getting ")] and not [ln for ln in lines if "network" in ln], lines
    assert repo.snapshot() == before
    assert repo.porter().verify() == []
    # nothing to do the second time: no fetch at all
    r = repo.porter(offline=True).sync()
    assert r == {"added": [], "vendored": [], "restored": [], "ok": ["up"], "differs": [], "dropped": [], "stray": []}
    # a file the lock does not record under vendor/up or LICENSES/up: verify reports it, sync removes it (it used to
    # leave it, and verify kept failing after sync)
    for extra in (repo.root / "vendor" / "up" / "stray.cu", repo.root / "LICENSES" / "up" / "NOTES.txt"):
        extra.write_text("not upstream's")
        assert [p.kind for p in repo.porter().verify()] == ["extra"]
        r = repo.porter(offline=True).sync()
        assert r["restored"] == ["up"] and r["vendored"] == [] and not extra.exists()
        assert repo.snapshot() == before and repo.porter().verify() == []
    # what belongs to no source at the top of vendor/ or LICENSES/: sync leaves it and names it (it said nothing, and
    # verify kept failing after it)
    (repo.root / "vendor" / "extra.txt").write_text("mine")
    (repo.root / "LICENSES" / "other").mkdir()
    (repo.root / "LICENSES" / "other" / "LICENSE").write_text("x")
    r = repo.porter(offline=True).sync()
    assert r["stray"] == ["vendor/extra.txt", "LICENSES/other"] and (repo.root / "vendor" / "extra.txt").exists()
    assert {p.path for p in repo.porter().verify()} == {"vendor/extra.txt", "LICENSES/other/LICENSE"}
    # an empty folder fails no verify, so sync does not name it as something that does
    (repo.root / "LICENSES" / "junk").mkdir()
    assert "LICENSES/junk" not in repo.porter(offline=True).sync()["stray"]


def test_offline_without_cache_fails_clearly(sdist_repo):
    with pytest.raises(FetchError, match="not in the download cache"):
        sdist_repo.porter(offline=True).add(["alpha"])


def _killed_while_holding(lock: Path, make_temp: str) -> None:
    """Run a process that takes the cache lock ``lock``, makes a temporary folder as a download does (``make_temp``:
    Python code that binds ``d``) with a partial file in it, and is killed with SIGKILL: what a killed run leaves."""
    code = (f"import os, signal, tempfile\nfrom pathlib import Path\nfrom filelock import FileLock\n"
            f"FileLock({str(lock)!r}).acquire()\nd = {make_temp}\n(Path(d) / 'part.tar.gz').write_bytes(b'x' * 100)\n"
            f"os.kill(os.getpid(), signal.SIGKILL)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -9, r.stderr


def test_next_run_removes_what_a_killed_download_left(sdist_repo):
    """A found walkthrough bug: a download killed midway left its .dl-* folder in the port cache for ever. The next
    run removes it under the cache lock, which the killed run no longer holds; one held by a live run is left."""
    repo = sdist_repo
    d = repo.cache / "pypi" / "up"
    d.mkdir(parents=True)
    _killed_while_holding(d / ".lock", f"tempfile.mkdtemp(dir={str(d)!r}, prefix='.dl-')")
    assert len(list(d.glob(".dl-*"))) == 1
    repo.porter().add(["alpha"])  # downloads
    assert list(d.glob(".dl-*")) == []
    # the sdist now in the cache: a run that downloads nothing removes a leftover too
    _killed_while_holding(d / ".lock", f"tempfile.mkdtemp(dir={str(d)!r}, prefix='.dl-')")
    repo.porter(offline=True).fetcher.tree(repo.porter().manifest.sources["up"])
    assert list(d.glob(".dl-*")) == []
    # while another run holds the lock, its .dl-* folder may be in use: left alone
    from filelock import FileLock

    (d / ".dl-live").mkdir()
    with FileLock(str(d / ".lock")):
        t = repo.porter(offline=True).fetcher.tree(repo.porter().manifest.sources["up"])
        assert t.has("csrc/kernels/alpha.cu") and (d / ".dl-live").is_dir()
    repo.porter(offline=True).fetcher.tree(repo.porter().manifest.sources["up"])
    assert not (d / ".dl-live").exists()


def test_a_cached_sdist_reads_where_its_lock_cannot_be_opened(sdist_repo):
    """From a code review: the sweep of leftovers takes the cache lock without waiting; a lock file that cannot be
    opened (a read-only cache, another user's lock) must not stop a run from reading the sdist already cached."""
    repo = sdist_repo
    repo.porter().add(["alpha"])  # downloads into the cache
    d = repo.cache / "pypi" / "up"
    (d / ".lock").unlink(missing_ok=True)
    (d / ".lock").mkdir()  # opening it raises IsADirectoryError, as an unreadable lock raises PermissionError
    t = repo.porter(offline=True).fetcher.tree(repo.porter().manifest.sources["up"])
    assert t.has("csrc/kernels/alpha.cu")


def test_next_run_removes_what_a_killed_clone_left(git_repo):
    from pipegoose.porting.util import sha256_bytes

    repo = git_repo
    key = sha256_bytes(repo.upstream.working_tree_dir.encode())[:16]
    g = repo.cache / "git"
    g.mkdir(parents=True)
    _killed_while_holding(g / f".{key}.lock", f"tempfile.mkdtemp(dir={str(g)!r}, prefix='.{key}-')")
    (g / ".0123456789abcdef-other").mkdir()  # another URL's: not ours to judge
    repo.porter().add(["alpha"])
    assert list(g.glob(f".{key}-*")) == [] and (g / ".0123456789abcdef-other").is_dir()


def test_verify_names_differing_missing_and_extra_files(git_repo):
    repo = git_repo
    p = repo.porter()
    p.add(["alpha", "beta"])
    v = repo.root / "vendor" / "up"
    (v / "csrc/common/util.h").write_text("tampered\n")
    (v / "csrc/kernels/beta.cu").unlink()
    (v / "csrc/kernels/sneaky.cu").write_text("int x;\n")
    (repo.root / "LICENSES/up/NOTICE").write_text("extra\n")
    problems = {(pr.kind, pr.path) for pr in p.verify()}
    assert problems == {("differs", "vendor/up/csrc/common/util.h"), ("missing", "vendor/up/csrc/kernels/beta.cu"),
                        ("extra", "vendor/up/csrc/kernels/sneaky.cu"), ("extra", "LICENSES/up/NOTICE")}
    states = {s.id: s.state for s in p.states()}
    assert states == {"up/alpha": "modified", "up/beta": "missing"}
    # beta's missing file and its changed util.h are named (walkthroughs: only "1 file(s) absent")
    beta = next(s for s in p.states() if s.id == "up/beta")
    assert beta.detail == ("1 file(s) absent (vendor/up/csrc/kernels/beta.cu), 1 modified "
                           "(vendor/up/csrc/common/util.h): run sync"), beta.detail
    # the CLI exits non-zero and names the files
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "verify", "--root", str(repo.root)],
                       capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "vendor/up/csrc/common/util.h" in r.stdout and "sneaky.cu" in r.stdout
    # sync puts back exactly the locked files
    p.sync()
    assert p.verify() == []


def test_a_missing_kernel_names_its_first_absent_files_only(git_repo, monkeypatch):
    """A review: in a fresh clone (nothing vendored) `port.py list` named every path of every kernel, three screens
    at 120 columns. A kernel none of whose files is there says so; otherwise the first few absent files are named."""
    import shutil

    import pipegoose.porting.porter as porter_mod

    repo = git_repo
    p = repo.porter()
    p.add(["alpha", "beta"])
    v = repo.root / "vendor" / "up"
    (v / "csrc/kernels/beta.cu").unlink()
    (v / "csrc/common/extra.h").unlink()
    monkeypatch.setattr(porter_mod, "_ABSENT_SHOWN", 1)
    beta = next(s for s in p.states() if s.id == "up/beta")
    assert beta.detail == "2 file(s) absent (vendor/up/csrc/common/extra.h, and 1 more): run sync", beta.detail
    shutil.rmtree(v)
    shutil.rmtree(repo.root / "LICENSES" / "up")
    details = {s.id: s.detail for s in p.states()}
    assert details == {"up/alpha": "none of its 3 files is there (not vendored yet): run sync",
                       "up/beta": "none of its 4 files is there (not vendored yet): run sync"}, details
    # a modified kernel names its first few changed files too
    p.sync()
    for f in ("csrc/kernels/beta.cu", "csrc/common/extra.h", "csrc/common/util.h"):
        (v / f).write_text("changed\n")
    beta = next(s for s in p.states() if s.id == "up/beta")
    assert (beta.state, beta.detail) == ("modified", "vendor/up/csrc/common/extra.h, and 2 more"), beta.detail



def test_verify_checks_the_license_and_the_lock_paths_and_hashes(git_repo):
    """Session 34's walkthrough: a license changed in kernels.yaml passed verify (and showed as verified in list); a
    lock key such as /etc/passwd or ../x made verify hash a file outside vendor/, and a lock hash of 'xyz' was
    taken; a lock hash edited in its last digit showed as two equal 12-digit prefixes."""
    repo = git_repo
    p = repo.porter()
    p.add(["alpha"])
    yml = repo.root / "kernels.yaml"
    text = yml.read_text()
    yml.write_text(text.replace("license: Apache-2.0", "license: MIT", 1))
    p = repo.porter()
    probs = [(pr.kind, pr.path, pr.detail) for pr in p.verify()]
    assert [(k, path) for k, path, _ in probs] == [("stale", "sources.up")], probs
    assert "kernels.yaml license MIT != kernels.lock license Apache-2.0" in probs[0][2]
    assert {s.id: s.state for s in p.states()} == {"up/alpha": "stale", "up/beta": "declared"}
    assert p.states()[0].detail.startswith("kernels.yaml and kernels.lock disagree: kernels.yaml license MIT != "
                                           "kernels.lock license Apache-2.0")
    yml.write_text(text)

    lock_path = repo.root / "kernels.lock"
    good = lock_path.read_text()
    key, digest = next((k, h) for k, h in yaml.safe_load(good)["kernels"]["up/alpha"]["files"].items())
    for bad_key in ("/etc/passwd", "../../outside.h", "csrc/./x.h"):
        lock_path.write_text(good.replace(f"{key}:", f"{bad_key}:", 1))
        with pytest.raises(PortError, match=r"kernels.up/alpha.files: .*expected a relative path inside"):
            repo.porter().verify()
    lock_path.write_text(good.replace(digest, "xyz", 1))
    with pytest.raises(PortError, match=r"expected a sha256 \(64 lowercase hex digits\), got 'xyz'"):
        repo.porter().verify()
    edited = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    lock_path.write_text(good.replace(digest, edited, 1))
    (detail,) = [pr.detail for pr in repo.porter().verify() if pr.kind == "differs"]
    shown = re.findall(r"[0-9a-f]{12,}", detail)
    assert len(shown) == 2 and shown[0] != shown[1], detail
    lock_path.write_text(good)
    assert repo.porter().verify() == []


def test_a_source_no_kernel_comes_from_is_dropped(git_repo, tmp_path):
    """A kernel moved to another source in kernels.yaml and added again left its old source in kernels.lock (the
    review of session 34); a kernel entry deleted from kernels.lock by hand, its source kept, made sync say
    "re-vendored" while it removed the source's folders, after which verify failed (session 34's walkthrough). Now add
    and sync drop such a source from the lock with its vendor/ and LICENSES/ folders, and say so; verify names it. A
    kernel moved to another source takes its files out of the old source's folder, which keeps the rest."""
    repo = git_repo
    p = repo.porter()
    p.add(["alpha", "beta"])
    up2, sha2 = init_git_upstream(tmp_path / "upstream2", V1_FILES)
    yml = repo.root / "kernels.yaml"
    data = yaml.safe_load(yml.read_text())
    data["sources"]["up2"] = dict(data["sources"]["up"], fetch={"git": {"url": up2.working_tree_dir, "commit": sha2}})
    data["kernels"]["up/alpha"]["source"] = "up2"
    data["kernels"]["up/beta"]["source"] = "up2"
    yml.write_text(yaml.safe_dump(data, sort_keys=False))
    lines = []
    assert repo.porter(log=lines.append).add(["alpha", "beta"]) == ["up/alpha", "up/beta"]
    lock = Lock.load(repo.root / "kernels.lock")
    assert sorted(lock.sources) == ["up2"] and {k.source for k in lock.kernels.values()} == {"up2"}
    assert "dropping source up from kernels.lock: no vendored kernel comes from it any more" in lines
    assert not (repo.root / "vendor" / "up").exists() and not (repo.root / "LICENSES" / "up").exists()
    assert repo.porter().verify() == []

    # beta back to up: two sources; then beta's entry deleted from kernels.lock by hand leaves up without kernels
    data["kernels"]["up/beta"]["source"] = "up"
    yml.write_text(yaml.safe_dump(data, sort_keys=False))
    repo.porter().add(["beta"])
    # beta's files left vendor/up2, where alpha keeps its own and the header both use (session 34 left them there,
    # reported as extra by verify until a sync)
    up2_dir = repo.root / "vendor" / "up2"
    assert not (up2_dir / "csrc/kernels/beta.cu").exists() and not (up2_dir / "csrc/common/extra.h").exists()
    assert (up2_dir / "csrc/kernels/alpha.cu").is_file() and (up2_dir / "csrc/common/util.h").is_file()
    assert (repo.root / "vendor/up/csrc/kernels/beta.cu").is_file()
    assert repo.porter().verify() == []
    lock_path = repo.root / "kernels.lock"
    ld = yaml.safe_load(lock_path.read_text())
    assert sorted(ld["sources"]) == ["up", "up2"]
    del ld["kernels"]["up/beta"]
    lock_path.write_text(yaml.safe_dump(ld))
    assert ("stale", "sources.up") in {(pr.kind, pr.path) for pr in repo.porter().verify()}
    r = repo.porter().sync()
    assert r["dropped"] == ["up"] and r["ok"] == ["up2"], r
    assert not (repo.root / "vendor" / "up").exists() and not (repo.root / "LICENSES" / "up").exists()
    assert repo.porter().verify() == []
    assert {s.id: s.state for s in repo.porter().states()} == {"up/alpha": "verified", "up/beta": "declared"}


def test_cli_add_names_the_kernels_restored_with_it(git_repo):
    """A walkthrough: in a fresh clone (kernels.lock holds every kernel, vendor/ is empty) `port.py add` of one kernel
    wrote its source's whole folder, the other locked kernels too, and said "added 1 kernel(s)" alone."""
    repo = git_repo
    repo.porter().add(["alpha", "beta"])
    shutil.rmtree(repo.root / "vendor" / "up")
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "--root", str(repo.root), "add", "alpha"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # (a review: up/alpha was in kernels.lock already: it is re-vendored, not "added")
    assert "re-vendored 1 kernel(s) already in kernels.lock, from the pinned source(s): up/alpha" in r.stdout
    assert "restored with them" in r.stdout and "up/beta" in r.stdout and "added" not in r.stdout, r.stdout


def test_cli_add_names_the_local_edits_it_replaced(git_repo):
    """A review: `port.py add` of a kernel whose source folder is rewritten replaced a sibling kernel's locally
    edited file and said nothing of it (the sibling was not missing, so it was not named as restored)."""
    repo = git_repo
    repo.porter().add(["alpha", "beta"])
    # edit a file only beta has (the two share util.h), and take alpha's own file away
    edited = repo.root / "vendor" / "up" / "csrc/kernels/beta.cu"
    edited.write_text(edited.read_text() + "// a local edit\n")
    (repo.root / "vendor" / "up" / "csrc/kernels/alpha.cu").unlink()
    assert {s.id: s.state for s in repo.porter().states()} == {"up/alpha": "missing", "up/beta": "modified"}
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "--root", str(repo.root), "add", "alpha"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "replaced the local changes" in r.stdout and "up/beta" in r.stdout and "beta.cu" in r.stdout, r.stdout
    assert "restored with them" not in r.stdout
    assert "a local edit" not in edited.read_text()
    # a sibling both missing a file and edited in another is named as restored and as edited (its edits went unsaid)
    edited.write_text(edited.read_text() + "// a local edit\n")
    for f in ("csrc/kernels/alpha.cu", "csrc/common/extra.h"):
        (repo.root / "vendor" / "up" / f).unlink()
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "--root", str(repo.root), "add", "alpha"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "restored with them" in r.stdout and "replaced the local changes" in r.stdout, r.stdout
    assert "up/beta (vendor/up/csrc/kernels/beta.cu)" in r.stdout.replace("\n", " "), r.stdout


def test_add_keeps_or_names_files_kernels_lock_does_not_record(git_repo):
    """A review: `add` of a kernel in place rewrote its source's folder for a file kernels.lock does not record there
    (a user's own vendor/<source>/my_patches/), deleted it without a word and said "added 1 kernel(s)"; `list` said
    verified where verify failed with "extra"."""
    repo = git_repo
    repo.porter().add(["alpha", "beta"])
    mine = repo.root / "vendor" / "up" / "my_patches" / "fix.patch"
    mine.parent.mkdir()
    mine.write_text("keep\n")
    # list agrees with verify
    assert [(pr.kind, pr.path) for pr in repo.porter().verify()] == [("extra", "vendor/up/my_patches/fix.patch")]
    states = {s.id: s for s in repo.porter().states()}
    assert {kid: s.state for kid, s in states.items()} == {"up/alpha": "modified", "up/beta": "modified"}
    assert "vendor/up/my_patches/fix.patch" in states["up/alpha"].detail and not states["up/alpha"].modified
    assert repo.porter().unrecorded() == {"up": ["vendor/up/my_patches/fix.patch"]}
    # the kernel named is in place: nothing is added or removed, and the file is named as left in place
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "--root", str(repo.root), "add", "alpha"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.replace("\n", " ")
    assert "nothing to add" in out and "added" not in out, r.stdout
    assert "left in place" in out and "vendor/up/my_patches/fix.patch" in out, r.stdout
    assert mine.read_text() == "keep\n"
    # a kernel that has to be vendored again writes the folder whole: the file goes, and is named
    (repo.root / "vendor" / "up" / "csrc/kernels/alpha.cu").unlink()
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "--root", str(repo.root), "add", "alpha"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.replace("\n", " ")
    assert "re-vendored 1 kernel(s)" in out and "up/alpha" in out, r.stdout
    assert "removed files not recorded in kernels.lock" in out, r.stdout
    assert "vendor/up/my_patches/fix.patch" in out and "left in place" not in out, r.stdout
    assert not mine.exists() and repo.porter().verify() == []
    assert {s.id: s.state for s in repo.porter().states()} == {"up/alpha": "verified", "up/beta": "verified"}


def test_links_kernels_lock_does_not_record_are_named_by_their_own_path(git_repo):
    """A review: a link under vendor/<source>/ was named by its target in list/add/update/verify ("README.md", a
    recorded file, an absolute path for a dangling one); add of a kernel in place said "removed" of a dangling link it
    left, and one that re-vendored removed a link to a recorded file without naming it."""
    repo = git_repo
    repo.porter().add(["alpha", "beta"])
    (repo.root / "NOTES.md").write_text("notes\n")
    up = repo.root / "vendor" / "up"
    (up / "link").symlink_to("../../NOTES.md")
    (up / "dangling").symlink_to("/nonexistent")
    (up / "alias.cu").symlink_to("csrc/kernels/alpha.cu")
    links = ["vendor/up/alias.cu", "vendor/up/dangling", "vendor/up/link"]
    assert repo.porter().unrecorded() == {"up": links}
    assert [(pr.kind, pr.path) for pr in repo.porter().verify()] == [("extra", f) for f in links]
    detail = {s.id: s for s in repo.porter().states()}["up/alpha"].detail
    assert all(f in detail for f in links) and "NOTES.md (" not in detail and "alpha.cu," not in detail, detail
    cli = [sys.executable, str(ROOT / "tools/port.py"), "--root", str(repo.root), "add", "alpha"]
    # in place: the links are left, and named so (none as removed)
    r = subprocess.run(cli, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.replace("\n", " ")
    assert "nothing to add" in out and "removed" not in out, r.stdout
    assert f"left in place (verify fails until they go; sync removes them): {', '.join(links)}" in out, r.stdout
    assert all(os.path.lexists(repo.root / f) for f in links)
    # vendored again: the links go, each named as removed
    (up / "csrc/kernels/alpha.cu").unlink()
    r = subprocess.run(cli, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.replace("\n", " ")
    assert f"records them: {', '.join(links)}" in out and "left in place" not in out, r.stdout
    assert not any(os.path.lexists(repo.root / f) for f in links) and repo.porter().verify() == []
    assert (repo.root / "NOTES.md").read_text() == "notes\n"


def test_add_of_a_source_id_names_its_kernels(git_repo):
    """`port.py add colossalai` (a source id) answered "did you mean: causal_softmax" (session 34's walkthrough)."""
    with pytest.raises(PortError, match=r"^'up' is a source, not a kernel; its kernels: up/alpha, up/beta$"):
        git_repo.porter().add(["up"])


def test_lock_source_ids_are_checked(git_repo):
    """A source id of kernels.lock names folders: '../../secret' made verify hash a file outside the repository
    (the review of session 34)."""
    repo = git_repo
    repo.porter().add(["alpha"])
    lock_path = repo.root / "kernels.lock"
    good = lock_path.read_text()
    for bad in ("../../secret", "Up", "a/b"):
        lock_path.write_text(good.replace("source: up\n", f"source: '{bad}'\n").replace("\n  up:\n",
                                                                                          f"\n  '{bad}':\n"))
        with pytest.raises(PortError, match=r"sources: .*expected a source id"):
            repo.porter().verify()
    lock_path.write_text(good)
    assert repo.porter().verify() == []


def test_wrong_sha256_changes_nothing(repo):
    src, sd = sdist_source(repo)
    repo.write_manifest(src.replace(sha256(sd.read_bytes()), "f" * 64), K_ALPHA)
    before = repo.snapshot()
    with pytest.raises(IntegrityError, match="sha256"):
        repo.porter().add(["alpha"])
    assert repo.snapshot() == before
    assert not (repo.root / "kernels.lock").exists()


def test_index_hash_mismatch_is_refused(repo):
    src, sd = sdist_source(repo)
    repo.write_manifest(src, K_ALPHA)
    # the index now serves different bytes under the same name (a swapped upload)
    make_sdist(repo.root.parent / "evil", "up", "1.0", {**V1_FILES, "csrc/common/util.h": "evil\n"})
    (Path(repo.index_url[len("file://"):]) / "files" / sd.name).write_bytes(
        (repo.root.parent / "evil" / sd.name).read_bytes())
    with pytest.raises((FetchError, IntegrityError)):
        repo.porter().add(["alpha"])
    assert not (repo.root / "vendor" / "up").exists()


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_copy_leaves_everything_as_it_was(sdist_repo, monkeypatch, exc):
    repo = sdist_repo
    repo.porter().add(["alpha"])
    before = repo.snapshot()
    calls = {"n": 0}
    real = porter_mod._write_staged

    def flaky(path, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise exc
        real(path, data)

    monkeypatch.setattr(porter_mod, "_write_staged", flaky)
    with pytest.raises(type(exc)):
        repo.porter().add(["beta"])
    assert calls["n"] == 3
    assert repo.snapshot() == before
    assert not (repo.root / "vendor" / ".port-txn").exists()


def _raising_on_call(real, n: int, exc: BaseException):
    """``real``, except that its ``n``-th call raises ``exc`` instead (a crash or interrupt at that point)."""
    calls = {"n": 0}

    def wrapper(*args):
        calls["n"] += 1
        if calls["n"] == n:
            raise exc
        return real(*args)

    return wrapper


def test_failure_during_swap_rolls_back(sdist_repo, monkeypatch):
    repo = sdist_repo
    repo.porter().add(["alpha"])
    before = repo.snapshot()
    real = os.replace
    # the 4th rename: after the journal and vendor/up were swapped, before the lock
    monkeypatch.setattr(txn_mod.os, "replace", _raising_on_call(real, 4, OSError("simulated crash mid-swap")))
    with pytest.raises(OSError, match="mid-swap"):
        repo.porter().add(["beta"])
    monkeypatch.setattr(txn_mod.os, "replace", real)
    assert repo.snapshot() == before


def _add_beta_and_die(repo, monkeypatch) -> None:
    """``add beta`` in a process that dies where a patched function raises SystemExit: no in-process rollback, no
    clean-up of the transaction folder (what kill -9 leaves); the patches are undone afterwards."""
    monkeypatch.setattr(txn_mod, "_rollback", lambda root, entries: None)
    monkeypatch.setattr(txn_mod.Transaction, "__exit__", lambda self, *exc: None)
    with pytest.raises(SystemExit):
        repo.porter().add(["beta"])
    monkeypatch.undo()


def test_killed_swap_is_rolled_back_by_next_run(sdist_repo, monkeypatch):
    """A crash with no chance to roll back in-process (kill -9): the journal lets the next run restore."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    before = repo.snapshot()
    monkeypatch.setattr(txn_mod.os, "replace", _raising_on_call(os.replace, 4, SystemExit("killed")))
    _add_beta_and_die(repo, monkeypatch)
    assert repo.snapshot() != before  # half-swapped on disk
    assert list((repo.root / "vendor" / ".port-txn").iterdir())
    p = repo.porter()
    assert p.verify() == []  # the next run recovers under the lock first
    assert repo.snapshot() == before


@pytest.mark.parametrize("cut", ["first", "committed"])
def test_journal_cut_short_by_a_kill_is_recovered(sdist_repo, monkeypatch, cut):
    """A fresh-clone walkthrough killed an update while its journal was being written: the empty journal.json made
    every later run fail (JSONDecodeError). The journal is now replaced whole; one cut short (as the old writes could
    leave it) is recognised from what is on disk: written before the first rename (nothing applied) or after the
    last (everything applied), so the next run removes it and says which."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    before = repo.snapshot()
    real = txn_mod._fsync_replace
    calls = {"n": 0}

    def killed(path, data):
        calls["n"] += 1
        if calls["n"] == (1 if cut == "first" else 2):
            path.write_bytes(b"")  # what a kill between the old truncating open and its write left
            raise SystemExit("killed")
        real(path, data)

    monkeypatch.setattr(txn_mod, "_fsync_replace", killed)
    _add_beta_and_die(repo, monkeypatch)
    notes = []
    p = repo.porter(log=notes.append)
    assert p.verify() == []  # no JSONDecodeError; vendor/ and kernels.lock agree
    assert not (repo.root / "vendor" / ".port-txn").exists()
    if cut == "first":
        assert repo.snapshot() == before and any("not applied" in n for n in notes), notes
    else:
        assert repo.snapshot() != before and any("applied in full" in n for n in notes), notes
        assert "up/beta" in Lock.load(repo.root / "kernels.lock").kernels


@pytest.mark.parametrize("when", ["before", "after", "sync after"])
def test_ctrl_c_says_whether_the_change_was_applied(sdist_repo, monkeypatch, capsys, when):
    """A fresh-clone walkthrough's Ctrl-C during `update` printed "vendor/, LICENSES/ and kernels.lock are unchanged"
    while kernels.yaml and kernels.lock already held the new pin (the interrupt came after the commit point). The CLI
    now asks the transaction: a real `add`, interrupted while staging (before) or in the clean-up after the commit
    point (after)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("port_cli", ROOT / "tools" / "port.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    repo = sdist_repo
    repo.porter().add(["alpha"])  # the sdist in the cache: the CLI's run below fetches nothing
    before = repo.snapshot()

    def ctrl_c(*a, **kw):
        raise KeyboardInterrupt

    args = ["add", "--root", str(repo.root), "--cache", str(repo.cache), "--offline", "beta"]
    if when == "before":
        monkeypatch.setattr(porter_mod, "_write_staged", ctrl_c)
    else:
        monkeypatch.setattr(txn_mod.Transaction, "_cleanup", ctrl_c)
    if when == "sync after":  # sync restores vendor/ and leaves kernels.lock as it was (a review: "unchanged")
        (repo.root / "vendor" / "up" / "csrc" / "kernels" / "alpha.cu").write_text("tampered\n")
        args = ["sync", "--root", str(repo.root), "--cache", str(repo.cache), "--offline"]
    rc = cli.main(args)
    msg = " ".join(capsys.readouterr().err.split())
    monkeypatch.undo()
    assert rc == 130
    if when == "sync after":
        assert "interrupted after the change was applied" in msg, msg
        assert repo.porter().verify() == [] and repo.snapshot() == before  # restored (the clean-up: next run)
    elif when == "after":
        assert "interrupted after the change was applied" in msg, msg
        assert "up/beta" in Lock.load(repo.root / "kernels.lock").kernels
    else:
        assert "interrupted: this run changed nothing" in msg, msg
        assert repo.snapshot() == before
    assert repo.porter().verify() == []


def test_missing_license_file_stops_the_port(repo):
    src, _ = sdist_source(repo, license_text=None)
    repo.write_manifest(src, K_ALPHA)
    with pytest.raises(LicenseError, match="license file.*LICENSE.*not found"):
        repo.porter().add(["alpha"])
    assert not (repo.root / "vendor" / "up").exists()


def test_disallowed_license_text_stops_the_port(repo):
    src, _ = sdist_source(repo, license_text=GPL)
    repo.write_manifest(src, K_ALPHA)
    with pytest.raises(LicenseError, match="GPL.*not allowed"):
        repo.porter().add(["alpha"])
    assert not (repo.root / "vendor").exists() or not (repo.root / "vendor" / "up").exists()


@pytest.mark.parametrize("header", [
    "// SPDX-License-Identifier: GPL-3.0-only\n",
    "/* This file is part of X, licensed under the GNU General Public License v3. */\n",
    # a notice that wraps across comment lines (the LGPL's standard one): found with the markers removed
    "/*\n * This library is free software; you can redistribute it and/or\n * modify it under the terms of the GNU "
    "Lesser General Public\n * License as published by the Free Software Foundation.\n */\n",
    "// For non-commercial research use only\n"])
def test_a_kernel_file_of_a_copyleft_license_stops_the_port(repo, header):
    """A walkthrough vendored a .cu file whose header said SPDX-License-Identifier: GPL-3.0-only (inside a source whose
    license file is Apache-2.0): the gate read the license files only. Each vendored file's own header is now read
    (a best-effort check, see licenses.file_license_problem)."""
    files = {**V1_FILES, "csrc/kernels/alpha.cu": header + V1_FILES["csrc/kernels/alpha.cu"]}
    src, _ = sdist_source(repo, files=files)
    repo.write_manifest(src, K_ALPHA)
    with pytest.raises(LicenseError, match="up/alpha: csrc/kernels/alpha.cu in .*(SPDX-License-Identifier names GPL-3.0-only"
                                           "|grants or restricts it under a (GPL|non-commercial) license).*not vendored"):
        repo.porter().add(["alpha"])
    assert not (repo.root / "vendor" / "up").exists()


@pytest.mark.parametrize("header", [
    "// SPDX-License-Identifier: MIT OR GPL-2.0\n// You may use it under the MIT license or the GNU GPL v2.\n",
    "// SPDX-License-Identifier: MIT see LICENSE\n",          # words after the expression are not license ids
    "// SPDX-License-Identifier: (Apache-2.0 WITH LLVM-exception)\n",
    "// Apache-2.0 code is compatible with the GNU General Public License v3.\n",   # a mention, not a grant
    "// works for commercial and noncommercial use alike\n"])
def test_a_kernel_file_with_a_permissive_header_is_taken(repo, header):
    """A second review: prose that mentions the GPL, words after an SPDX expression and a dual license with an allowed
    choice were refused."""
    files = {**V1_FILES, "csrc/kernels/alpha.cu": header + V1_FILES["csrc/kernels/alpha.cu"]}
    src, _ = sdist_source(repo, files=files)
    repo.write_manifest(src, K_ALPHA)
    repo.porter().add(["alpha"])
    assert repo.porter().verify() == []


@pytest.mark.parametrize("bundled", [
    "Mozilla Public License Version 2.0 (test fixture)\n",
    "GNU LIBRARY GENERAL PUBLIC LICENSE\nVersion 2 (test fixture)\n",
    "This model may be used for non-commercial purposes only (test fixture).\n",
    "Released under CC BY-NC 4.0 (test fixture).\n"])
def test_a_combined_license_file_bundling_a_disallowed_license_stops_the_port(repo, bundled):
    """The license-file check knew AGPL, LGPL, GPL and "noncommercial" only: an Apache-2.0 file that bundled a
    Mozilla, GNU Library (LGPL v2.0) or "non-commercial"/BY-NC licensed project was vendored, though a source file
    with the same license in its header was refused."""
    src, _ = sdist_source(repo, license_text=APACHE + "\n---- bundled: tinylib ----\n" + bundled)
    repo.write_manifest(src, K_ALPHA)
    with pytest.raises(LicenseError, match="up: LICENSE in .* carries (MPL|GPL|non-commercial) text, which is not"):
        repo.porter().add(["alpha"])
    assert not (repo.root / "vendor" / "up").exists()


@pytest.mark.parametrize("family, name, short_id", [
    ("GPL", "GNU Library General Public License", "GPLv2"),
    ("MPL", "Mozilla Public License", "MPL-2.0"),
    ("non-commercial", "Non-Commercial License", None),
    ("non-commercial", "CC BY-NC 4.0 license", None)])
def test_a_disallowed_family_is_recognised_in_a_header_and_a_license_file_alike(family, name, short_id):
    """One table (licenses.DISALLOWED_FAMILIES) for both checks: a license a file header is refused for is found in a
    license file too. A short id counts in a header's grant only: a permissive license file may mention it (the LLVM
    exception to Apache-2.0 speaks of software licensed under the GPLv2)."""
    allowed = ("Apache-2.0", "MIT")
    assert f"under a {family} license" in file_license_problem(f"// Licensed under the {name}.\n", allowed)
    assert detect_licenses(APACHE + f"\nbundled: tinylib, {name} (test fixture)\n") == ({"Apache-2.0"}, {family})
    if short_id is not None:
        assert f"under a {family} license" in file_license_problem(f"// Licensed under {short_id}.\n", allowed)
        mention = f"\nExceptions: you may combine this software with software licensed under the {short_id}.\n"
        assert detect_licenses(APACHE + mention) == ({"Apache-2.0"}, set())


def test_declared_license_must_match_the_text(repo):
    src, _ = sdist_source(repo, license_text=MIT, declared="Apache-2.0")
    repo.write_manifest(src, K_ALPHA)
    with pytest.raises(LicenseError, match="declares Apache-2.0.*recognised: MIT"):
        repo.porter().add(["alpha"])


def test_declared_license_must_be_the_first_text_of_a_combined_file(repo):
    """A combined license file (ColossalAI's: its Apache-2.0 text, then the MIT notices of bundled projects) carries
    the MIT phrase too: declaring MIT was accepted and recorded. The declared license must be the file's first text."""
    bsd3 = ("Copyright (c) test fixture\nRedistribution and use in source and binary forms, with or without "
            "modification, are permitted provided that the following conditions are met: ... 3. Neither the name of "
            "the copyright holder nor the names of its contributors may be used to endorse products.\n")
    src, _ = sdist_source(repo, license_text=APACHE + "\n---- bundled: tinylib ----\n" + MIT, declared="MIT")
    repo.write_manifest(src, K_ALPHA)
    with pytest.raises(LicenseError, match="declares MIT but the first license text of LICENSE.* is Apache-2.0"):
        repo.porter().add(["alpha"])
    assert not (repo.root / "vendor" / "up").exists()
    src, _ = sdist_source(repo, license_text=bsd3, declared="BSD-2-Clause")
    repo.write_manifest(src, K_ALPHA)
    with pytest.raises(LicenseError, match="declares BSD-2-Clause but the first license text .* is BSD-3-Clause"):
        repo.porter().add(["alpha"])
    src, _ = sdist_source(repo, license_text=APACHE + "\n---- bundled: tinylib ----\n" + MIT, declared="Apache-2.0")
    repo.write_manifest(src, K_ALPHA)
    repo.porter().add(["alpha"])
    assert (repo.root / "vendor" / "up").exists()


def test_unknown_id_lists_close_matches(sdist_repo):
    with pytest.raises(PortError, match="unknown kernel 'up/alpah'.*did you mean: up/alpha"):
        sdist_repo.porter().add(["up/alpah"])
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "add", "--root", str(sdist_repo.root), "alpah"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "did you mean" in r.stderr


def test_unrelated_names_are_not_suggested(sdist_repo):
    """`port.py remove nothere` answered "did you mean: rms_norm" (session 41's walkthrough): a name close to none
    lists the known kernels instead ("opal" is 0.5 alike to "up/alpha" and 0.44 to its alias "alpha")."""
    with pytest.raises(PortError, match="unknown kernel 'opal'") as e:
        sdist_repo.porter().add(["opal"])
    assert "did you mean" not in str(e.value) and "known kernels: " in str(e.value), str(e.value)


def test_file_missing_in_source(repo):
    src, _ = sdist_source(repo)
    repo.write_manifest(src, K_ALPHA.replace("csrc/common/util.h", "csrc/common/util.h, csrc/common/gone.h"))
    with pytest.raises(SourceFileMissing, match="gone.h"):
        repo.porter().add(["alpha"])


def test_header_missing_from_files_is_a_manifest_fact_error(repo):
    src, _ = sdist_source(repo)
    repo.write_manifest(src, K_BETA.replace(", csrc/common/util.h", ""))
    with pytest.raises(ManifestFactError, match=r"kernels.up/beta.files: .*csrc/common/util.h \(included by csrc/common/extra.h\)"):
        repo.porter().add(["beta"])


def test_remove_keeps_shared_files_then_drops_source(git_repo):
    repo = git_repo
    p = repo.porter()
    p.add(["alpha", "beta"])
    p.remove(["beta"])
    v = repo.root / "vendor" / "up"
    assert (v / "csrc/common/util.h").exists()  # still used by alpha
    assert not (v / "csrc/kernels/beta.cu").exists() and not (v / "csrc/common/extra.h").exists()
    assert p.verify() == []
    with pytest.raises(PortError, match="not vendored"):
        p.remove(["beta"])
    p.remove(["up/alpha"])
    assert not v.exists() and not (repo.root / "LICENSES" / "up").exists()
    lock = Lock.load(repo.root / "kernels.lock")
    assert lock.kernels == {} and lock.sources == {}
    assert p.verify() == []


def declare_our_own_kernel(repo) -> Path:
    """A kernel of this project (a local source, ``pipegoose/ours``) in the test repository's manifest; returns its
    one file."""
    (repo.root / "pipegoose/kernels/csrc").mkdir(parents=True)
    cu = repo.root / "pipegoose/kernels/csrc/ours.cu"
    cu.write_text("int ours_fwd(int x) { return x; }\n")
    repo.write_manifest(source_yaml("pipegoose", "local: {path: .}", license="MIT"),
                        kernel_yaml("pipegoose/ours", "pipegoose", ["pipegoose/kernels/csrc/ours.cu"], "ours_fwd",
                                    "ours_forward", include_dirs="[]"))
    return cu


def test_audit_of_our_own_kernels_says_there_is_no_upstream(repo):
    """A fresh-clone walkthrough: `audit pipegoose` printed nothing and exited 0 (update said "nothing to update")."""
    from pipegoose.porting import audit

    declare_our_own_kernel(repo)
    p = repo.porter()
    p.add(["ours"])
    for names in (["pipegoose"], ["pipegoose/ours"]):
        with pytest.raises(PortError, match=r"our own kernels \(a local source\) have no upstream to audit"):
            audit(p, names)
    assert audit(p).sources == []  # unnamed: every ported source, here none


def test_offline_with_an_altered_cached_sdist_names_the_file(sdist_repo):
    """A fresh-clone walkthrough truncated the cached sdist: `sync --offline` said it was "not in the download cache";
    the message now names the file, both sha256 and what to do. A review: it blamed the file alone ("a partial or
    altered download; remove it"), where the pin may be what is wrong."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    cached = next((repo.cache / "pypi" / "up").glob("*.tar.gz"))
    data = cached.read_bytes()
    cached.write_bytes(data[: len(data) // 2])  # a download cut short
    src = repo.porter().manifest.sources["up"]
    with pytest.raises(FetchError, match=rf"the download cache holds .*{re.escape(cached.name)} with sha256 .*"
                                         rf"the pin \(kernels.yaml, kernels.lock\) says sha256 {src.pin['sha256']}: "
                                         r"either the pin is wrong \(edited by hand or by a merge: restore kernels.yaml "
                                         r"and kernels.lock from git\) or the file is \(a partial or altered download: "
                                         r"remove it and run without --offline"):
        repo.porter(offline=True).fetcher.tree(src)
    # the whole file, and a pin that is wrong: the same words (the file is not blamed alone)
    cached.write_bytes(data)
    text = (repo.root / "kernels.yaml").read_text()
    (repo.root / "kernels.yaml").write_text(text.replace(src.pin["sha256"], "f" * 64))
    with pytest.raises(FetchError, match=r"either the pin is wrong"):
        repo.porter(offline=True).fetcher.tree(repo.porter().manifest.sources["up"])
    (repo.root / "kernels.yaml").write_text(text)
    cached.unlink()
    with pytest.raises(FetchError, match=r"not in the download cache .* --offline was given \(run the same command "
                                         r"without --offline on a machine with network"):
        repo.porter(offline=True).fetcher.tree(src)


def test_add_of_a_vendored_kernel_fetches_nothing(sdist_repo, monkeypatch):
    """A fresh-clone walkthrough: `add` of a kernel already vendored fetched its source again and said "added 1
    kernel(s)", where sync says "already in place". A tampered file still sends it back to be vendored."""
    repo = sdist_repo
    assert repo.porter().add(["alpha"]) == ["up/alpha"]
    before = repo.snapshot()

    def no_fetch(*a, **kw):
        raise AssertionError("fetched a source that is in place")

    monkeypatch.setattr(Fetcher, "tree", no_fetch)
    notes = []
    assert repo.porter(log=notes.append).add(["alpha"]) == []
    assert repo.snapshot() == before and any("already vendored" in n for n in notes), notes
    monkeypatch.undo()
    (repo.root / "vendor" / "up" / "csrc" / "kernels" / "alpha.cu").write_text("tampered\n")
    assert repo.porter().add(["alpha"]) == ["up/alpha"]
    assert repo.porter().verify() == []


def test_add_vendors_a_license_file_declared_since(sdist_repo):
    """A code review of the add that fetches nothing when a kernel is in place: a license file newly declared in
    kernels.yaml must still send the source back to be vendored with it."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    manifest = repo.root / "kernels.yaml"
    text = manifest.read_text()
    assert "license_files: [LICENSE]" in text
    manifest.write_text(text.replace("license_files: [LICENSE]", "license_files: [LICENSE, PKG-INFO]"))
    assert repo.porter().add(["alpha"]) == ["up/alpha"]
    assert (repo.root / "LICENSES" / "up" / "PKG-INFO").is_file()
    assert set(Lock.load(repo.root / "kernels.lock").sources["up"].license_files) == {"LICENSE", "PKG-INFO"}


def test_a_rollback_cut_short_keeps_what_the_next_run_needs(sdist_repo, monkeypatch):
    """A code review: a second Ctrl-C during the in-process rollback (or an OSError there) deleted the transaction
    folder, journal and backups with it, so the next run could not restore vendor/. The folder now stays."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    before = repo.snapshot()
    def second_ctrl_c(root, entries):
        raise KeyboardInterrupt

    monkeypatch.setattr(txn_mod.os, "replace", _raising_on_call(os.replace, 4, OSError("simulated crash mid-swap")))
    monkeypatch.setattr(txn_mod, "_rollback", second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        repo.porter().add(["beta"])
    monkeypatch.undo()
    assert list((repo.root / "vendor" / ".port-txn").iterdir())  # journal and backups kept
    assert repo.porter().verify() == [] and repo.snapshot() == before  # the next run rolled back


def test_a_kill_while_the_journal_is_rewritten_leaves_the_previous_one(sdist_repo, monkeypatch):
    """The journal is written to a temporary file and renamed: a kill during the committed write leaves the
    uncommitted journal whole, and the next run rolls the swap back (the old in-place write left it empty)."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    before = repo.snapshot()
    real = txn_mod._fsync_write
    seen = {"journal": 0}

    def killed(path, data):
        if path.name == ".journal.json.tmp":
            seen["journal"] += 1
            if seen["journal"] == 2:  # the committed write
                path.write_bytes(data[: len(data) // 2])
                raise SystemExit("killed")
        real(path, data)

    monkeypatch.setattr(txn_mod, "_fsync_write", killed)
    _add_beta_and_die(repo, monkeypatch)
    assert seen["journal"] == 2
    notes = []
    assert repo.porter(log=notes.append).verify() == [] and repo.snapshot() == before
    assert any("rolled back interrupted transaction" in n for n in notes), notes


def test_cli_add_says_added_only_of_a_kernel_new_to_the_lock(git_repo):
    """A review: `port.py add` of our own kernel whose kernels.lock record matched its files said "added 1 kernel(s)"
    (and logged "added ... (local:.)") with kernels.lock unchanged, where a ported kernel in place gets "nothing to
    add"; and `add` of a ported kernel already in kernels.lock whose vendored file was edited said "added" where it
    re-vendored it. Now: in place, "nothing to add"; our own kernel's files changed, "re-recorded" with the files;
    a ported kernel written again, "re-vendored"; "added" only of a kernel new to kernels.lock."""
    repo = git_repo

    def said_added(r):   # (the word: the test's folder, in the pin of the source, holds "_added_")
        return re.search(r"\badded\b", r.stdout + r.stderr)

    cu = declare_our_own_kernel(repo)
    src = source_yaml("up", f"git: {{url: '{repo.upstream.working_tree_dir}', commit: {repo.upstream.head.commit.hexsha}}}")
    repo.write_manifest(source_yaml("pipegoose", "local: {path: .}", license="MIT") + src,   # and a ported kernel
                        kernel_yaml("pipegoose/ours", "pipegoose", ["pipegoose/kernels/csrc/ours.cu"], "ours_fwd",
                                    "ours_forward", include_dirs="[]") + K_ALPHA)
    cli = [sys.executable, str(ROOT / "tools/port.py"), "--root", str(repo.root), "add"]
    r = subprocess.run(cli + ["ours", "alpha"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "added 2 kernel(s): pipegoose/ours, up/alpha" in r.stdout, r.stdout
    lock = (repo.root / "kernels.lock").read_bytes()
    # both in place
    r = subprocess.run(cli + ["ours", "alpha"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nothing to add" in r.stdout and not said_added(r), r.stdout + r.stderr
    assert "pipegoose/ours is this project's own (local:.) and kernels.lock records its files as they are" in \
        " ".join(r.stderr.split()), r.stderr
    assert (repo.root / "kernels.lock").read_bytes() == lock
    assert repo.porter().add_outcome(["ours"]) == {"added": [], "re-recorded": {}, "re-vendored": [],
                                                    "in_place": ["pipegoose/ours"]}
    # our own file changed: re-recorded, naming it; the other kernel named stays in place
    cu.write_text("int ours_fwd(int x) { return x + 1; }\n")
    r = subprocess.run(cli + ["ours", "alpha"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "re-recorded 1 kernel(s) of this project in kernels.lock (what changed since it recorded them): " \
           "pipegoose/ours (pipegoose/kernels/csrc/ours.cu)" in out, out
    assert "already in place: up/alpha" in out and not said_added(r), r.stdout + r.stderr
    assert (repo.root / "kernels.lock").read_bytes() != lock and repo.porter().verify() == []
    # a ported kernel's vendored file edited: re-vendored (the edit it replaced is named), not added
    edited = repo.root / "vendor/up/csrc/kernels/alpha.cu"
    edited.write_text(edited.read_text() + "// a local edit\n")
    r = subprocess.run(cli + ["alpha"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    out = " ".join(r.stdout.split())
    assert "re-vendored 1 kernel(s) already in kernels.lock, from the pinned source(s): up/alpha" in out, out
    assert "replaced the local changes" in out and not said_added(r), r.stdout + r.stderr
    assert repo.porter().verify() == []


def test_local_source_is_hashed_in_place(repo):
    cu = declare_our_own_kernel(repo)
    p = repo.porter()
    p.add(["ours"])
    assert not (repo.root / "vendor" / "pipegoose").exists()
    assert not (repo.root / "LICENSES" / "pipegoose").exists()
    lock = Lock.load(repo.root / "kernels.lock")
    assert lock.kernels["pipegoose/ours"].files == {"pipegoose/kernels/csrc/ours.cu": sha256(cu.read_bytes())}
    assert lock.sources["pipegoose"].license_files == {"LICENSE": sha256(MIT.encode())}
    assert [s.state for s in p.states()] == ["verified"]
    cu.write_text("int ours_fwd(int x) { return x + 1; }\n")
    assert [s.state for s in p.states()] == ["modified"]
    assert [(pr.kind, pr.path) for pr in p.verify()] == [("differs", "pipegoose/kernels/csrc/ours.cu")]
    # sync vendors the upstream sources and only notes our own edited files (git is their record; verify fails)
    result = p.sync()
    # a walkthrough: sync listed it as "already in place" right after noting that its files differ
    assert "pipegoose" in result["differs"] and "pipegoose" not in result["ok"]
    assert [s.state for s in p.states()] == ["modified"]
    assert "re-record it with `python tools/port.py add`" in p.verify()[0].detail
    p.add(["ours"])  # re-record after an intended change
    assert p.verify() == []
    # the repository's other files are no "extra" of our own source: sync notes nothing
    (repo.root / "pipegoose/kernels/csrc/other.cu").write_text("// not declared\n")
    notes: list[str] = []
    assert "pipegoose" in repo.porter(log=notes.append).sync()["ok"] and notes == []


def _tar_with(member: tarfile.TarInfo, data: bytes | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for path, text in [("up-1.0/LICENSE", APACHE), *((f"up-1.0/{k}", v) for k, v in V1_FILES.items())]:
            info = tarfile.TarInfo(path)
            info.size = len(text.encode())
            tf.addfile(info, io.BytesIO(text.encode()))
        tf.addfile(member, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


@pytest.mark.parametrize("make_member,match", [
    (lambda: (tarfile.TarInfo("up-1.0/../../evil.h"), b"x"), "unsafe member name"),
    (lambda: (tarfile.TarInfo("/etc/evil.h"), b"x"), "unsafe member name"),
    (lambda: (_link("up-1.0/csrc/link.h", "../../../etc/passwd", tarfile.SYMTYPE), None), "points outside"),
    (lambda: (_link("up-1.0/csrc/hard.h", "../../etc/passwd", tarfile.LNKTYPE), None), "points outside"),
])
def test_unsafe_archives_are_refused(repo, make_member, match):
    member, data = make_member()
    if data is not None:
        member.size = len(data)
    blob = _tar_with(member, data)
    d = repo.root.parent / "bad"
    d.mkdir(exist_ok=True)
    sd = d / "up-1.0.tar.gz"
    sd.write_bytes(blob)
    publish(Path(repo.index_url[len("file://"):]), sd)
    repo.write_manifest(source_yaml("up", f"pypi: {{name: up, version: '1.0', sha256: {sha256(blob)}}}"), K_ALPHA)
    with pytest.raises(FetchError, match=match):
        repo.porter().add(["alpha"])
    assert not (repo.root / "vendor" / "up").exists()
    assert not (repo.root.parent / "evil.h").exists()


def _link(name, target, kind):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


def test_links_inside_the_archive_are_followed(repo):
    info = _link("up-1.0/csrc/common/alias.h", "util.h", tarfile.SYMTYPE)
    blob = _tar_with(info)
    sd = repo.root.parent / "up-1.0.tar.gz"
    sd.write_bytes(blob)
    publish(Path(repo.index_url[len("file://"):]), sd)
    repo.write_manifest(source_yaml("up", f"pypi: {{name: up, version: '1.0', sha256: {sha256(blob)}}}"),
                        K_ALPHA.replace("csrc/common/util.h]", "csrc/common/util.h, csrc/common/alias.h]"))
    repo.porter().add(["alpha"])
    v = repo.root / "vendor/up/csrc/common"
    assert (v / "alias.h").read_bytes() == (v / "util.h").read_bytes()
    assert not (v / "alias.h").is_symlink()


def test_a_download_never_runs_the_upstream_setup_py(tmp_path, monkeypatch):
    """A walkthrough: fetching an sdist ran `pip download`, which builds the package's metadata, i.e. runs its
    setup.py, before the sha256 pin was checked: a tampered or mispinned archive ran code on this machine (and every
    `port.py sync` ran ColossalAI's and DeepSpeed's setup.py). The archive now comes from the simple API of the same
    pip configuration and is checked before it is kept or opened; nothing of it runs."""
    index = tmp_path / "index"
    marker = tmp_path / "setup_py_ran"
    evil = make_sdist(tmp_path / "b", "evil-pkg", "1.0", {
        **V1_FILES, "setup.py": f"open({str(marker)!r}, 'w').write('ran')\nfrom setuptools import setup\nsetup()\n"})
    publish(index, evil)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index.as_uri())
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "repo"
    root.mkdir()
    from pipegoose.kernels.manifest import Source

    f = Fetcher(root, tmp_path / "cache")
    wrong = Source("evil", "E", "h", "Apache-2.0", ("LICENSE",), "pypi",
                   {"name": "evil-pkg", "version": "1.0", "sha256": "a" * 64})
    with pytest.raises(IntegrityError, match="kernels.yaml pins aaaa"):
        f.tree(wrong)
    assert not marker.exists() and not list((tmp_path / "cache/pypi/evil-pkg").glob("*.tar.gz"))
    right = Source("evil", "E", "h", "Apache-2.0", ("LICENSE",), "pypi",
                   {"name": "evil-pkg", "version": "1.0", "sha256": sha256(evil.read_bytes())})
    assert f.tree(right).read("csrc/kernels/alpha.cu") == V1_FILES["csrc/kernels/alpha.cu"].encode()
    assert not marker.exists()


def test_cli_list_shows_states(git_repo):
    repo = git_repo
    repo.porter().add(["alpha"])
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "list", "--root", str(repo.root)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = {ln.split("│")[1].strip(): ln for ln in r.stdout.splitlines() if ln.startswith("│")}
    assert "verified" in lines["up/alpha"] and "declared" in lines["up/beta"]
    assert "Apache-2.0" in lines["up/alpha"]
    # an empty PIPEGOOSE_MANIFEST is unset (it gave "error: .: cannot read the manifest: IsADirectoryError"; session
    # 34's walkthrough): the repository's kernels.yaml, from the repository's folder
    # and so is a blank one (a review: "error:  : manifest not found"), as PIPEGOOSE_PORT_CACHE and PIPEGOOSE_CACHE_DIR
    for blank in ("", " ", "\t "):
        r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "list", "--quick"], capture_output=True,
                           text=True, cwd=ROOT, env={**os.environ, "PIPEGOOSE_MANIFEST": blank})
        assert r.returncode == 0 and "pipegoose/layer_norm" in r.stdout, repr(blank) + r.stdout + r.stderr


def test_list_quick_calls_a_source_with_unrecorded_files_modified(git_repo):
    """A review: `list --quick` said vendored of every kernel of a source whose folder held a file kernels.lock does
    not record, where the README says modified (verify fails on it); looking for one hashes nothing."""
    repo = git_repo
    repo.porter().add(["alpha", "beta"])
    assert {s.id: s.state for s in repo.porter().states(check_hashes=False)} == {"up/alpha": "vendored",
                                                                                  "up/beta": "vendored"}
    mine = repo.root / "vendor" / "up" / "my_patches" / "p.diff"
    mine.parent.mkdir()
    mine.write_text("x\n")
    states = {s.id: s for s in repo.porter().states(check_hashes=False)}
    assert {kid: s.state for kid, s in states.items()} == {"up/alpha": "modified", "up/beta": "modified"}
    assert states["up/alpha"].detail == ("its source's folders hold 1 file(s) not recorded in kernels.lock "
                                         "(vendor/up/my_patches/p.diff): verify fails; sync removes them")
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "list", "--quick", "--root", str(repo.root)],
                       capture_output=True, text=True, env={**os.environ, "COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    lines = {ln.split("│")[1].strip(): ln for ln in r.stdout.splitlines() if ln.startswith("│")}
    assert "modified" in lines["up/alpha"] and "vendor/up/my_patches/p.diff" in lines["up/alpha"], r.stdout


def test_cli_list_fits_narrow_terminals(git_repo):
    """Session 39's walkthrough: at 60 columns `port.py list` folded the kernel ids mid-word inside the table. Where the
    table's short columns do not fit, it prints a line per kernel (id and state) and its source, license and detail
    indented under it; COLUMNS is honoured when piped (it printed 160 columns whatever COLUMNS said)."""
    repo = git_repo
    repo.porter().add(["alpha"])
    port = [sys.executable, str(ROOT / "tools/port.py"), "list", "--root", str(repo.root)]
    for cols in (40, 60):
        r = subprocess.run(port, capture_output=True, text=True, env={**os.environ, "COLUMNS": str(cols)})
        assert r.returncode == 0, r.stderr
        lines = r.stdout.splitlines()
        assert all(len(ln) <= cols for ln in lines), r.stdout
        assert "up/alpha  verified" in lines and "up/beta  declared" in lines, r.stdout
        i, j = lines.index("up/alpha  verified"), lines.index("up/beta  declared")
        assert lines[i + 1].startswith("    ") and "Apache-2.0" in "".join(lines[i + 1:j]), r.stdout
        # every wrapped line of the block indented (at 40 columns "Apache-2.0" began at the left edge; a walkthrough)
        assert all(ln.startswith("    ") and ln == ln.rstrip() for ln in lines[i + 1:j]), r.stdout
    r = subprocess.run(port, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0 and any(ln.startswith("│ up/alpha") for ln in r.stdout.splitlines()), r.stdout
    # every width: the ids whole, in the table (rich shrank its columns, folding ids just above the list's threshold)
    # or the list; COLUMNS=0 (not a width: it printed nothing) as unset, 160 columns when piped
    for cols in (80, 100, 110, 120, 130, 140, 160, 0):
        r = subprocess.run(port, capture_output=True, text=True, env={**os.environ, "COLUMNS": str(cols)})
        lines = r.stdout.splitlines()
        assert r.returncode == 0 and all(len(ln) <= (cols or 160) for ln in lines), (cols, r.stdout)
        for kid in ("up/alpha", "up/beta"):
            assert any(ln.startswith((f"│ {kid} ", f"{kid}  ")) for ln in lines), (cols, kid, r.stdout)


def test_cli_common_options_before_the_subcommand_and_bad_lock_or_cache(git_repo, tmp_path):
    """Session 35's walkthrough: the options "common to all" worked only after the subcommand (`port.py --root D list`:
    "invalid choice"); a kernels.lock that is not UTF-8 and a download cache that is not a folder gave raw tracebacks
    and exit 1, which port.py documents as drift. Now the options go either side, and both are a clean error, exit 2."""
    repo = git_repo
    repo.porter().add(["alpha"])
    port = [sys.executable, str(ROOT / "tools/port.py")]
    r = subprocess.run(port + ["--root", str(repo.root), "list"], capture_output=True, text=True)
    assert r.returncode == 0 and "up/alpha" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(port + ["--root", "/nonexistent", "list", "--root", str(repo.root)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "up/alpha" in r.stdout, r.stdout + r.stderr  # after the subcommand wins
    shutil.rmtree(repo.root / "vendor" / "up")
    not_dir = tmp_path / "a-file"
    not_dir.write_text("")
    r = subprocess.run(port + ["sync", "--root", str(repo.root)], capture_output=True, text=True,
                       env={**os.environ, "PIPEGOOSE_PORT_CACHE": str(not_dir)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"download cache {not_dir}" in r.stderr and "PIPEGOOSE_PORT_CACHE" in r.stderr, r.stderr
    (repo.root / "kernels.lock").write_bytes(b"\xff\xfe")
    r = subprocess.run(port + ["verify", "--root", str(repo.root)], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "kernels.lock: not UTF-8 text" in r.stderr, r.stderr


def test_cli_points_the_kernels_commands_to_their_cli(capsys):
    """A walkthrough: `port.py doctor` said only "invalid choice: 'doctor'"; doctor and build are commands of
    `python -m pipegoose.kernels`, and the error now says so (exit 2, argparse's usage error)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import port
    finally:
        sys.path.remove(str(ROOT / "tools"))
    for cmd in ("doctor", "build", "bogus"):
        with pytest.raises(SystemExit) as e:
            port.main([cmd])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"invalid choice: '{cmd}'" in err, err
        assert (f"for {cmd}: python -m pipegoose.kernels {cmd}" in err) == (cmd != "bogus"), err


def test_git_commit_not_found(repo, tmp_path):
    up, sha = init_git_upstream(tmp_path / "upstream", V1_FILES)
    repo.write_manifest(source_yaml("up", f"git: {{url: '{up.working_tree_dir}', commit: {'a' * 40}}}"), K_ALPHA)
    with pytest.raises(FetchError, match="not found"):
        repo.porter().add(["alpha"])


def test_git_unreachable_remote(repo, tmp_path):
    repo.write_manifest(source_yaml("up", f"git: {{url: '{tmp_path / 'nowhere'}', commit: {'a' * 40}}}"), K_ALPHA)
    with pytest.raises(FetchError, match="git failed"):
        repo.porter().add(["alpha"])
    assert not (repo.root / "kernels.lock").exists()


def test_an_index_not_reached_is_named_beside_those_that_answered(repo, tmp_path):
    """A review: without network (`unshare -n`), sync said "no sdist of deepspeed 0.19.8 on https://pypi.org/simple,
    file:///opt/pypi/simple...": pypi.org's connection error was dropped because the file:// indexes answered (empty).
    The message now names the index not reached and why, and what to do without network."""
    from pipegoose.porting.fetch import IndexConfig, SimpleIndex

    src, _ = sdist_source(repo)   # published on repo's index, which this run does not read
    repo.write_manifest(src, K_ALPHA)
    empty = tmp_path / "empty-index"
    empty.mkdir()
    refused = "http://127.0.0.1:9/simple"
    index = SimpleIndex(IndexConfig([refused, empty.as_uri()], [], None, 10.0))
    p = porter_mod.Porter(repo.root / "kernels.yaml", fetcher=Fetcher(repo.root, repo.cache, index=index))
    fix = (rf"without network, copy the pypi/up/ folder of the port cache of a machine that ran the same command with "
           rf"network into {re.escape(str(repo.cache / 'pypi' / 'up'))} and pass --offline")
    with pytest.raises(FetchError, match=rf"no sdist of up 1.0 on {refused}, {empty.as_uri()}; not reached: "
                                         rf"{refused}: <urlopen error .*refused.*>; {fix}"):
        p.add(["alpha"])
    # none reached: the same advice
    index = SimpleIndex(IndexConfig([refused], [], None, 10.0))
    p = porter_mod.Porter(repo.root / "kernels.yaml", fetcher=Fetcher(repo.root, repo.cache, index=index))
    with pytest.raises(FetchError, match=rf"cannot reach any package index for up: {refused}: .*; {fix}"):
        p.add(["alpha"])
    assert not (repo.root / "kernels.lock").exists()


def test_an_index_with_credentials_in_its_url_is_read_with_them_and_they_are_never_shown(tmp_path):
    """A second review: with `pip download` gone, the simple-API client sent an index URL's user:token@host to DNS as
    a host name (private mirrors stopped working) and printed the token in its errors. The credentials now go as HTTP
    Basic auth to that host, for its pages and its downloads, and every message shows *** in their place."""
    import base64
    import http.server
    import threading

    from pipegoose.porting.fetch import IndexConfig, SimpleIndex

    archive = b"not really a tarball"
    want = "Basic " + base64.b64encode(b"user:s3cret").decode()
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append((self.path, self.headers.get("Authorization")))
            if self.headers.get("Authorization") != want:
                self.send_response(401)
                self.end_headers()
                return
            body = (b'<a href="/files/up-1.0.tar.gz">up-1.0.tar.gz</a>' if self.path.startswith("/simple/")
                    else archive)
            self.send_response(200)
            self.send_header("Content-Type", "text/html" if self.path.startswith("/simple/") else "application/x-tar")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        idx = SimpleIndex(IndexConfig([f"http://user:s3cret@127.0.0.1:{port}/simple"], [], None, 10.0))
        links = idx.sdists("up")
        assert [link.filename for link in links] == ["up-1.0.tar.gz"] and "s3cret" not in links[0].url
        idx.download(links[0], tmp_path / "up-1.0.tar.gz")
        assert (tmp_path / "up-1.0.tar.gz").read_bytes() == archive
        assert seen == [("/simple/up/", want), ("/files/up-1.0.tar.gz", want)]
        wrong = SimpleIndex(IndexConfig([f"http://user:wr0ng@127.0.0.1:{port}/simple"], [], None, 10.0))
        with pytest.raises(FetchError) as e:
            wrong.sdists("up")
        assert "wr0ng" not in str(e.value) and "***@127.0.0.1" in str(e.value)
    finally:
        server.shutdown()


def test_cli_relative_root_or_manifest_from_another_folder(git_repo, tmp_path):
    """A walkthrough: `port.py --root sub/repo sync` run from the parent vendored into sub/repo/sub/repo/vendor (the
    relative root was joined onto itself) and said it vendored; PIPEGOOSE_MANIFEST relative did the same, and from a
    folder inside the repository `--root ..` gave a traceback. `--root` naming a file gave a traceback."""
    repo = git_repo
    repo.porter().add(["alpha"])
    shutil.rmtree(repo.root / "vendor" / "up")
    port = [sys.executable, str(ROOT / "tools/port.py")]
    rel = os.path.relpath(repo.root, tmp_path)
    inside = repo.root / "docs"
    inside.mkdir()
    for cwd, args, env in ((tmp_path, ["--root", rel], {}),
                           (tmp_path, [], {"PIPEGOOSE_MANIFEST": os.path.join(rel, "kernels.yaml")}),
                           (inside, ["--root", ".."], {}), (inside, ["--manifest", "../kernels.yaml"], {})):
        r = subprocess.run(port + [*args, "sync"], capture_output=True, text=True, cwd=cwd,
                           env={**os.environ, **env})
        assert r.returncode == 0, r.stdout + r.stderr
        r = subprocess.run(port + ["--root", str(repo.root), "verify"], capture_output=True, text=True)
        assert r.returncode == 0, (args, env, r.stdout + r.stderr)
        assert not [q for q in repo.root.rglob("vendor") if q.parent != repo.root], list(repo.root.rglob("vendor"))
        shutil.rmtree(repo.root / "vendor" / "up")
    (tmp_path / "a-file").write_text("")
    r = subprocess.run(port + ["--root", str(tmp_path / "a-file"), "list"], capture_output=True, text=True)
    assert r.returncode == 2 and "expected the repository's folder" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_cli_path_options_expand_the_home_folder_and_refuse_blanks(git_repo, tmp_path):
    """`port.py --cache=~/p sync` downloaded into a folder named `~` in the working folder (a shell leaves `~` after
    `=` as it is), and `--cache ""` meant the working folder (a fresh-clone walkthrough): `~` is now expanded, and a
    blank path option is a usage error naming the option."""
    repo = git_repo
    repo.porter().add(["alpha"])
    port = [sys.executable, str(ROOT / "tools/port.py")]
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home)}
    (home / "repo").symlink_to(repo.root)
    r = subprocess.run(port + ["list", "--root=~/repo"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "up/alpha" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "~").exists()
    for flag in ("--cache", "--root", "--manifest"):
        r = subprocess.run(port + ["list", flag, " "], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 2 and f"argument {flag}: expected a path, got an empty value" in r.stderr, r.stderr


def test_default_download_cache_blank_and_relative_variables(monkeypatch, tmp_path):
    """A blank PIPEGOOSE_PORT_CACHE made a download cache folder named by the spaces, and a relative XDG_CACHE_HOME
    was taken (the kernel cache already ignored both; docs audit, session 38)."""
    from pipegoose.porting.util import default_cache_dir

    monkeypatch.setenv("PIPEGOOSE_PORT_CACHE", "  ")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative-xdg")
    assert default_cache_dir() == Path.home() / ".cache" / "pipegoose" / "port"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "pipegoose" / "port"
    monkeypatch.setenv("PIPEGOOSE_PORT_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"


def test_a_missing_file_of_our_own_kernel_is_not_sent_to_sync(repo):
    """A fresh-clone walkthrough deleted one of this project's kernel files: verify and list said "run sync", and sync
    (which fetches nothing for a local source) exited 0 with the file still missing. The fix named now is git."""
    own = declare_our_own_kernel(repo)
    repo.porter().add(["ours"])
    own.unlink()
    probs = [pr for pr in repo.porter().verify() if pr.kind == "missing"]
    assert len(probs) == 1 and "ours.cu" in probs[0].path, probs
    assert "restore it from git" in probs[0].detail and "sync" not in probs[0].detail
    state = {s.id: s for s in repo.porter().states()}["pipegoose/ours"]
    assert state.state == "missing" and state.detail == (
        "1 file(s) absent (pipegoose/kernels/csrc/ours.cu): restore from git (own files)"), state.detail
    notes = []  # sync's own note said only "re-record them with add", which fails on a missing file (a review)
    assert repo.porter(log=notes.append).sync()["differs"] == ["pipegoose"]
    assert any("restore missing or changed files from git" in n for n in notes), notes


# --------------------------------------------------------------------------------------------------------- session 59
# (a fresh-clone review that tried to break the porting tool: lock records that disagreed among themselves or with
# kernels.yaml, read-only checkouts, messages that sent the user the wrong way)

def test_a_lock_recording_one_shared_file_with_two_hashes_is_refused(git_repo):
    """alpha and beta share csrc/common/util.h. A lock in which one of them records another sha256 for it (a bad
    merge) passed verify and sync, which check one record, while the builder checked the other and refused; no
    command mended it. Loading such a lock is an error that names both entries."""
    repo = git_repo
    repo.porter().add(["alpha", "beta"])
    lock_path = repo.root / "kernels.lock"
    data = yaml.safe_load(lock_path.read_text())
    h = data["kernels"]["up/beta"]["files"]["csrc/common/util.h"]
    data["kernels"]["up/beta"]["files"]["csrc/common/util.h"] = h[:-1] + ("0" if h[-1] != "0" else "1")
    lock_path.write_text(yaml.safe_dump(data))
    with pytest.raises(PortError, match=r"up's csrc/common/util.h is recorded with different sha256 by kernels "
                                        r"up/alpha, up/beta .*restore kernels.lock from git"):
        repo.porter().verify()


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["sources"]["up"].update(kind="banana"), r"sources.up.kind: expected one of pypi, git, local, got "
                                                         r"'banana'"),
    (lambda d: d.update(extras={}), r"unknown key\(s\) extras: expected version, sources and kernels"),
], ids=["kind", "top-level key"])
def test_a_lock_with_an_unknown_kind_or_key_is_refused(git_repo, edit, message):
    repo = git_repo
    repo.porter().add(["alpha"])
    lock_path = repo.root / "kernels.lock"
    data = yaml.safe_load(lock_path.read_text())
    edit(data)
    lock_path.write_text(yaml.safe_dump(data))
    with pytest.raises(PortError, match=message):
        repo.porter().verify()


def test_a_license_file_declared_since_is_stale_everywhere(sdist_repo):
    """A license file added to kernels.yaml's license_files: verify, list and the builder's check passed it (only add
    saw it), and sync said "already in place". Now verify and list call the lock stale, and sync refuses, naming add
    (which vendors and records it: test_add_vendors_a_license_file_declared_since)."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    manifest = repo.root / "kernels.yaml"
    manifest.write_text(manifest.read_text().replace("license_files: [LICENSE]", "license_files: [LICENSE, NOTICE]"))
    p = repo.porter()
    probs = [(pr.kind, pr.path, pr.detail) for pr in p.verify()]
    assert [(k, path) for k, path, _ in probs] == [("stale", "sources.up")], probs
    assert "kernels.yaml license files LICENSE, NOTICE != kernels.lock's LICENSE" in probs[0][2]
    assert {s.id: s.state for s in p.states()}["up/alpha"] == "stale"
    with pytest.raises(PortError, match=r"sources.up: kernels.yaml license files .*: run `python tools/port.py add "
                                        r"up/alpha`"):
        p.sync()


def test_a_kernel_whose_locked_source_is_not_kernels_yamls_is_stale(git_repo):
    """A kernel's source changed in kernels.lock by hand: sync said "dropped source ..." (it had not) and then failed
    on a file of the wrong source. Now verify and list call it stale, and sync refuses at once, naming add."""
    repo = git_repo
    repo.porter().add(["alpha"])
    lock_path = repo.root / "kernels.lock"
    data = yaml.safe_load(lock_path.read_text())
    data["sources"]["up2"] = dict(data["sources"]["up"])
    data["kernels"]["up/alpha"]["source"] = "up2"
    lock_path.write_text(yaml.safe_dump(data))
    lines = []
    p = repo.porter(log=lines.append)
    assert ("stale", "up/alpha", "kernels.yaml takes it from up, kernels.lock from up2") in [
        (pr.kind, pr.path, pr.detail) for pr in p.verify()]
    # list names what disagrees; it said "kernels.yaml changed since it was locked" of the edited lock
    assert {s.id: (s.state, s.detail) for s in p.states()}["up/alpha"] == (
        "stale", "kernels.yaml and kernels.lock disagree: kernels.yaml takes it from up, kernels.lock from up2")
    with pytest.raises(PortError, match=r"kernels.lock: up/alpha: recorded from source up2, but kernels.yaml takes it "
                                        r"from up: run `python tools/port.py add up/alpha`"):
        p.sync()
    assert not [line for line in lines if "dropp" in line], lines


def test_a_lock_hash_that_is_not_the_pinned_files_is_blamed_on_the_lock(sdist_repo):
    """A file's sha256 edited in kernels.lock: sync blamed the download cache (delete it and retry), but the archive
    was checked against the pin, so a new download brings the same bytes. The message names the lock and the way to
    re-record the file."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    lock_path = repo.root / "kernels.lock"
    data = yaml.safe_load(lock_path.read_text())
    f, h = next(iter(data["kernels"]["up/alpha"]["files"].items()))
    data["kernels"]["up/alpha"]["files"][f] = h[:-1] + ("0" if h[-1] != "0" else "1")
    lock_path.write_text(yaml.safe_dump(data))
    with pytest.raises(IntegrityError, match=r"kernels.lock's record does not match the pinned source .*restore "
                                             r"kernels.lock from git \(git checkout kernels.lock\), or re-record the "
                                             r"file with `python tools/port.py add` of its kernels \(up/alpha\)"):
        repo.porter().sync()


def test_sync_with_nothing_to_do_stages_nothing(sdist_repo, monkeypatch):
    """A read-only checkout, in place: sync made vendor/.port-txn/<id> before knowing there was nothing to change,
    and failed there. A transaction now makes its folder at the first staged change, and commits nothing as a
    no-op."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    made = []
    real = txn_mod.Transaction._stage_path
    monkeypatch.setattr(txn_mod.Transaction, "_stage_path", lambda self, name: made.append(name) or real(self, name))
    result = repo.porter().sync()
    assert result["ok"] == ["up"] and made == [], (result, made)
    assert not (repo.root / "vendor" / ".port-txn").exists()
    with txn_mod.Transaction(repo.root) as tx:
        tx.commit()
    assert tx.committed and not (repo.root / "vendor" / ".port-txn").exists()


def test_verify_runs_where_no_lock_file_can_be_made(sdist_repo, monkeypatch):
    """A read-only checkout: verify took the repository lock, whose file it could not make (a traceback, exit 1,
    which means drift). It now verifies without the lock and says so, unless an interrupted change waits, which needs
    writing."""
    import errno

    repo = sdist_repo
    repo.porter().add(["alpha"])

    def read_only(root, timeout=60.0):
        raise PermissionError(errno.EACCES, "Permission denied", str(root / "vendor" / ".port.lock"))

    monkeypatch.setattr(porter_mod, "repo_lock", read_only)
    lines = []
    assert repo.porter(log=lines.append).verify() == []
    assert any("Permission denied: verifying without the repository lock" in line for line in lines), lines
    # sync: nothing to do is done; something to do is refused, saying what and why (a re-test: sync took the lock)
    assert repo.porter().sync()["ok"] == ["up"]
    vendored = next(p for p in (repo.root / "vendor" / "up").rglob("*") if p.is_file())
    vendored.unlink()
    with pytest.raises(PortError, match=r"sync has to vendor up here, which cannot be written \(.*\.port\.lock: "
                                        r"Permission denied\)"):
        repo.porter().sync()
    p = repo.porter()
    (repo.root / "vendor" / ".port-txn" / "abc").mkdir(parents=True)   # (after the Porter, which would recover it)
    with pytest.raises(PortError, match=r"vendor/.port-txn: an interrupted change waits to be finished or rolled "
                                        r"back, which needs write access"):
        p.verify()


@pytest.mark.parametrize("link", ["vendor/up", "vendor"])
def test_a_vendor_folder_linked_outside_the_repository_is_a_clear_error(sdist_repo, tmp_path, link):
    """A review: vendor/ or vendor/<source> a symbolic link to a folder outside the repository made sync end in a raw
    ValueError ("... is not in the subpath of ...") from the transaction, exit 1, which port.py documents as drift.
    It is now an error line naming the link, exit 2, and nothing changed; verify works on that layout."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    outside = tmp_path / "elsewhere" / Path(link).name
    outside.parent.mkdir()
    shutil.move(str(repo.root / link), str(outside))
    (repo.root / link).symlink_to(outside)
    assert repo.porter().verify() == []
    (repo.root / "vendor/up/csrc/kernels/alpha.cu").write_text("tampered\n")
    before = repo.snapshot()
    with pytest.raises(PortError, match=rf"^{link} is a symbolic link to {re.escape(str(outside))}, outside the "
                                        rf"repository {re.escape(str(repo.root))}: tools/port.py writes vendor/, "
                                        r"LICENSES/ and kernels.lock only inside it .*replace the link with a folder"):
        repo.porter(offline=True).sync()
    assert repo.snapshot() == before and not list(outside.parent.rglob(".port-txn/*"))
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "sync", "--offline", "--root", str(repo.root),
                        "--cache", str(repo.cache)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and f"error: {link} is a symbolic link" in r.stderr, \
        r.stderr
    assert [pr.kind for pr in repo.porter().verify()] == ["differs"]


def test_sync_and_verify_name_the_kernels_kernels_lock_does_not_record(sdist_repo):
    """A review: a kernel of kernels.yaml absent from kernels.lock passed sync and verify without a word (exit 0,
    "every vendored file ... matches"), where doctor called it unavailable. Both now name it and how to record it
    (verify still passes: what it checks matches)."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    assert repo.porter().unlocked_kernels() == ["up/beta"]
    cli = [sys.executable, str(ROOT / "tools/port.py"), "--root", str(repo.root), "--cache", str(repo.cache),
           "--offline"]
    says = ("declared in kernels.yaml but not recorded in kernels.lock, so neither vendored nor verified (the builder "
            "refuses the ported ones): up/beta; record them with python tools/port.py add up/beta (or python "
            "tools/port.py sync --all)")
    for cmd in ("verify", "sync"):
        r = subprocess.run(cli + [cmd], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and f"{cmd}: {says}" in " ".join(r.stdout.split()), r.stdout + r.stderr
    repo.porter(offline=True).sync(all_kernels=True)
    assert repo.porter().unlocked_kernels() == []
    r = subprocess.run(cli + ["verify"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "not recorded in kernels.lock" not in r.stdout, r.stdout


def test_an_os_error_is_an_error_line_with_exit_2(sdist_repo):
    """`vendor` a file: a FileExistsError traceback, exit 1 (documented as drift). Now an error line, exit 2."""
    repo = sdist_repo
    (repo.root / "vendor").write_text("not a folder")
    r = subprocess.run([sys.executable, str(ROOT / "tools/port.py"), "verify", "--root", str(repo.root)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and re.search(r"error: .*vendor.*File exists", r.stderr), r.stderr


def test_add_of_one_kernel_re_records_a_shared_file_for_every_kernel_that_lists_it(repo):
    """A re-test of the two-hash refusal: verify's advice for a changed file of our own ("re-record it with add of its
    kernel"), followed for one of the kernels that share it, wrote a lock that every command then refused. add now
    re-records the file for every locked kernel of the source that lists it, and says so."""
    (repo.root / "pipegoose/kernels/csrc").mkdir(parents=True)
    shared = repo.root / "pipegoose/kernels/csrc/check.h"
    shared.write_text("// shared\n")
    for name in ("one", "two"):
        (repo.root / f"pipegoose/kernels/csrc/{name}.cu").write_text(f"int {name}_fwd(int x) {{ return x; }}\n")
    repo.write_manifest(source_yaml("pipegoose", "local: {path: .}", license="MIT"),
                        kernel_yaml("pipegoose/one", "pipegoose", ["pipegoose/kernels/csrc/one.cu",
                                                                   "pipegoose/kernels/csrc/check.h"], "one_fwd",
                                    "one_forward", include_dirs="[]")
                        + kernel_yaml("pipegoose/two", "pipegoose", ["pipegoose/kernels/csrc/two.cu",
                                                                     "pipegoose/kernels/csrc/check.h"], "two_fwd",
                                      "two_forward", include_dirs="[]"))
    repo.porter().add(["one", "two"])
    shared.write_text("// shared, changed\n")
    assert [pr.kind for pr in repo.porter().verify()] == ["differs"]
    lines = []
    repo.porter(log=lines.append).add(["pipegoose/one"])
    assert "re-recorded pipegoose/kernels/csrc/check.h for pipegoose/two too (it lists the same file)" in lines, lines
    lock = Lock.load(repo.root / "kernels.lock")   # (it loads: one hash)
    assert lock.kernels["pipegoose/one"].files["pipegoose/kernels/csrc/check.h"] == \
        lock.kernels["pipegoose/two"].files["pipegoose/kernels/csrc/check.h"]
    assert repo.porter().verify() == []
    # and a lock with two hashes is never written
    lock.kernels["pipegoose/two"].files["pipegoose/kernels/csrc/check.h"] = "0" * 64
    with pytest.raises(PortError, match=r"not writing kernels.lock: pipegoose's pipegoose/kernels/csrc/check.h is "
                                        r"recorded with different sha256 by kernels pipegoose/one, pipegoose/two"):
        lock.dumps()


def test_a_pin_edited_in_kernels_yaml_is_answered_with_revert_then_update(sdist_repo):
    """sync, the builder and update itself advised `update` for a pin edited in kernels.yaml by hand, which update
    then refused: the advice is to restore the edited file and move both with update."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    manifest = repo.root / "kernels.yaml"
    manifest.write_text(manifest.read_text().replace("version: '1.0'", "version: '1.1'").replace(
        'version: "1.0"', 'version: "1.1"').replace("version: 1.0", "version: 1.1"))
    with pytest.raises(PortError, match=r"kernels.yaml pins up otherwise than kernels.lock records \(version: '1.0' "
                                        r"-> '1.1'\): one of the two was edited by hand \(or by a merge\): restore it "
                                        r"from git \(git checkout kernels.yaml, or git checkout kernels.lock; .*\), "
                                        r"then move both with `python tools/port.py update up --to ...`"):
        repo.porter().sync()


def _other_hex(digit: str) -> str:
    """A hex digit other than ``digit`` (an edited sha256 must differ: "9" + pin[1:] was the pin itself for one sdist
    in 16: nothing was edited, and the test failed)."""
    return "0" if digit != "0" else "1"


def test_a_hash_edited_in_the_lock_is_answered_with_kernels_lock_too(sdist_repo):
    """A review: a pin's sha256 edited in kernels.lock by hand made sync and `update --to <the pinned version>` say
    "revert kernels.yaml (git checkout kernels.yaml)", which was clean, and never named kernels.lock; a file's sha256
    edited there made verify say "sync restores it", and sync then refused. The advice names kernels.lock, the same
    from each command."""
    from pipegoose.porting import update

    repo = sdist_repo
    repo.porter().add(["alpha"])
    lock_path = repo.root / "kernels.lock"
    good = lock_path.read_text()
    pin = yaml.safe_load(good)["sources"]["up"]["pin"]["sha256"]
    lock_path.write_text(good.replace(pin, _other_hex(pin[0]) + pin[1:]))   # (the sdist's sha256 varies per run)
    for run in (lambda: repo.porter(offline=True).sync(), lambda: update(repo.porter(offline=True), "up", to="1.0")):
        with pytest.raises(PortError, match=r"kernels.yaml pins up otherwise than kernels.lock records \(sha256: .*"
                                            r"git checkout kernels.lock"):
            run()
    lock_path.write_text(good)
    f, h = next(iter(yaml.safe_load(good)["kernels"]["up/alpha"]["files"].items()))
    lock_path.write_text(good.replace(h, _other_hex(h[0]) + h[1:]))
    [pr] = repo.porter().verify()
    assert pr.kind == "differs" and pr.detail.endswith(
        "`python tools/port.py sync` restores it, unless kernels.lock's record is what was edited (sync says so "
        "then): git checkout kernels.lock"), pr
    with pytest.raises(IntegrityError, match=r"kernels.lock's record does not match the pinned source .*restore "
                                             r"kernels.lock from git \(git checkout kernels.lock\)"):
        repo.porter(offline=True).sync()


def test_a_pin_edited_in_the_lock_is_named_by_verify_and_list(sdist_repo):
    """Session 60: a version edited in kernels.lock showed in list as "kernels.yaml changed since it was locked", and
    verify printed both pins whole (sha256 and all). Both now name the two short pins, and where those agree the fields
    that differ, hashes shortened."""
    repo = sdist_repo
    repo.porter().add(["alpha"])
    lock_path = repo.root / "kernels.lock"
    data = yaml.safe_load(lock_path.read_text())
    data["sources"]["up"]["pin"]["version"] = "0.9"
    lock_path.write_text(yaml.safe_dump(data))
    p = repo.porter()
    want = "kernels.lock pin up==0.9 != kernels.yaml pin up==1.0"
    assert ("stale", "sources.up", want) in [(pr.kind, pr.path, pr.detail) for pr in p.verify()]
    assert {s.id: (s.state, s.detail) for s in p.states()}["up/alpha"] == (
        "stale", f"kernels.yaml and kernels.lock disagree: {want}")
    data["sources"]["up"]["pin"]["version"] = "1.0"
    data["sources"]["up"]["pin"]["sha256"] = "0" * 64    # a field the short pin leaves out: both shown whole
    lock_path.write_text(yaml.safe_dump(data))
    detail = {pr.path: pr.detail for pr in repo.porter().verify()}["sources.up"]
    declared = yaml.safe_load((repo.root / "kernels.yaml").read_text())["sources"]["up"]["fetch"]["pypi"]["sha256"]
    assert detail == f"kernels.lock pin up==1.0 (sha256 {'0' * 12}…) != kernels.yaml pin up==1.0 (sha256 " \
                     f"{declared[:12]}…)", detail


def test_remove_of_a_kernel_whose_source_was_edited_in_the_lock_takes_its_files(git_repo):
    """Session 59's gaps: a kernel's source edited in kernels.lock by hand, then ``remove``d: its files stayed in its
    kernels.yaml source's folder (where add had put them), and verify called them extra. Now remove takes them too,
    and keeps what another kernel of that source still records."""
    repo = git_repo
    repo.porter().add(["alpha", "beta"])
    lock_path = repo.root / "kernels.lock"
    data = yaml.safe_load(lock_path.read_text())
    data["sources"]["up2"] = dict(data["sources"]["up"])
    data["kernels"]["up/alpha"]["source"] = "up2"
    lock_path.write_text(yaml.safe_dump(data))
    shared = set(data["kernels"]["up/alpha"]["files"]) & set(data["kernels"]["up/beta"]["files"])
    own = set(data["kernels"]["up/alpha"]["files"]) - shared
    assert shared and own
    repo.porter().remove(["up/alpha"])
    assert repo.porter().verify() == []
    vdir = repo.root / "vendor" / "up"
    assert not any((vdir / f).exists() for f in own) and all((vdir / f).is_file() for f in shared)
