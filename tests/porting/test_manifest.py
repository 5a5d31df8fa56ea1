"""Manifest validation: every error names the file, the entry and the field."""

from __future__ import annotations

from pathlib import Path
import pytest

from pipegoose.kernels.manifest import ManifestError, load_manifest
from porting_helpers import MANIFEST_HEAD, kernel_yaml, source_yaml

GOOD_SRC = source_yaml("up", "pypi: {name: up, version: '1.0', sha256: " + "a" * 64 + "}")
GOOD_K = kernel_yaml("up/alpha", "up", ["csrc/kernels/alpha.cu"], "alpha_fwd", "alpha_forward")


def with_limits(limits: str) -> str:
    return GOOD_K.replace("    backward: false\n", f"    backward: false\n    limits: {limits}\n")


def write(tmp_path, text):
    p = tmp_path / "kernels.yaml"
    p.write_text(text)
    return p


def test_good_manifest_loads(tmp_path):
    m = load_manifest(write(tmp_path, MANIFEST_HEAD + GOOD_SRC + "kernels:\n" + GOOD_K))
    assert m.resolve("alpha").id == "up/alpha"
    assert m.sources["up"].pin == {"name": "up", "version": "1.0", "sha256": "a" * 64}


@pytest.mark.parametrize("src,kern,expected", [
    (GOOD_SRC.replace("a" * 64, "abc"), GOOD_K, "kernels.yaml: sources.up.fetch.pypi.sha256: expected 64 lower-case hex"),
    (GOOD_SRC.replace("Apache-2.0", "GPL-3.0"), GOOD_K, "kernels.yaml: sources.up.license: license 'GPL-3.0' is not allowed"),
    (source_yaml("up", "git: {url: /x, commit: deadbeef}"), GOOD_K, "kernels.yaml: sources.up.fetch.git.commit: expected a full 40-hex"),
    (GOOD_SRC, GOOD_K.replace("source: up", "source: nope"), "kernels.yaml: kernels.up/alpha.source: unknown source 'nope'"),
    (GOOD_SRC, GOOD_K.replace("files: [csrc/kernels/alpha.cu]", "files: [csrc/a.h]"),
     "kernels.yaml: kernels.up/alpha.files: expected at least one compiled file"),
    (GOOD_SRC, GOOD_K.replace("files: [csrc/kernels/alpha.cu]", "files: [../x.cu]"),
     "kernels.yaml: kernels.up/alpha.files: expected a relative path inside the source"),
    (GOOD_SRC, GOOD_K.replace("role: forward", "role: sideways"), "kernels.yaml: kernels.up/alpha.entries[0].role: expected one of"),
    (GOOD_SRC, GOOD_K.replace("dtypes: [float16]", "dtypes: [float8]"), "kernels.yaml: kernels.up/alpha.dtypes: unknown dtype"),
    (GOOD_SRC, GOOD_K.replace("  backward: false\n", ""), "kernels.yaml: kernels.up/alpha.backward: required field is missing"),
    # a walkthrough: an unquoted 0.10 became the version 0.1 ("not in the download cache"), without a word
    (GOOD_SRC.replace("'1.0'", "0.10"), GOOD_K,
     "kernels.yaml: sources.up.fetch.pypi.version: expected a version string, got the number 0.1: quote it"),
    # session 38's walkthrough: these passed list, sync and doctor
    (GOOD_SRC.replace("'1.0'", "'1.0; rm -rf /'"), GOOD_K,
     "kernels.yaml: sources.up.fetch.pypi.version: expected a PEP 440 version (e.g. '0.19.8'), got '1.0; rm -rf /'"),
    (GOOD_SRC, with_limits("{key_len_max: -5}"),
     "kernels.yaml: kernels.up/alpha.limits.key_len_max: expected a whole number >= 1, got -5"),
    (GOOD_SRC, with_limits("{input_rank: true}"),
     "kernels.yaml: kernels.up/alpha.limits.input_rank: expected a whole number >= 1, got True"),
    (GOOD_SRC, with_limits("{hidden_min: 9, hidden_max: 8}"),
     "kernels.yaml: kernels.up/alpha.limits.hidden_min: expected at most hidden_max (8), got 9"),
    (GOOD_SRC, with_limits("{hidden_min: 2, hidden_max: true}"),
     "kernels.yaml: kernels.up/alpha.limits.hidden_max: expected a whole number >= 1, got True"),
    (GOOD_SRC, GOOD_K + GOOD_K.replace("alpha_forward", "beta_forward"),
     "found the key 'up/alpha' twice (first on line"),
])
def test_manifest_errors_name_file_entry_field(tmp_path, src, kern, expected):
    with pytest.raises(ManifestError) as ei:
        load_manifest(write(tmp_path, MANIFEST_HEAD + src + "kernels:\n" + kern))
    assert expected in str(ei.value)


def test_real_manifest_loads():
    m = load_manifest()
    assert "megatron/scaled_masked_softmax" in m.kernels
    assert m.sources["colossalai"].kind == "pypi"


@pytest.mark.parametrize("text,expect", [
    ("sources: {}\n", "no 'version' key: not a whole kernels.lock"),
    ("version: 1\nsources:\n  s: {kind: pypi, pin: {name: a}, license: MIT}\nkernels:\n  k: {source: s, files: [a, b]}\n",
     "malformed entry"),
    ("version: 1\nsources: {}\nkernels: {}\nkernels: {}\n", "found the key 'kernels' twice"),  # session 38
])
def test_a_broken_lock_is_one_clear_error(tmp_path, text, expect):
    """A walkthrough: a kernels.lock cut short said "version: expected 1, got None", and one whose files were a list
    raised a bare ValueError (a traceback from port.py)."""
    from pipegoose.porting import PortError
    from pipegoose.porting.lock import Lock

    (tmp_path / "kernels.lock").write_text(text)
    with pytest.raises(PortError, match=expect):
        Lock.load(tmp_path / "kernels.lock")


def test_a_full_sha_missing_from_the_repository_does_not_resolve(tmp_path):
    """`audit --to 0000...` raised gitpython's ValueError: a full sha resolves lazily, and only reading the commit
    finds out it is not there. It now resolves to nothing (audit then reports the source's error)."""
    import git

    from pipegoose.porting.fetch import Fetcher

    repo = git.Repo.init(tmp_path / "up")
    (tmp_path / "up" / "a").write_text("a")
    repo.index.add(["a"])
    sha = repo.index.commit("a").hexsha
    assert Fetcher._git_resolve(repo, sha) == sha
    assert Fetcher._git_resolve(repo, "0" * 40) is None


@pytest.mark.parametrize("text, expect", [("", "the file is empty"), ("- a\n", "got list")])
def test_a_manifest_that_is_no_mapping_is_named_by_its_path(tmp_path, monkeypatch, text, expect):
    """`port.py list --manifest /dev/null` said "null: <top>: ...": the errors named the file by its name alone. They
    now name it by its path (relative to the working folder when inside it), and say what the top level was."""
    bad = tmp_path / "sub" / "kernels.yaml"
    bad.parent.mkdir()
    bad.write_text(text)
    monkeypatch.chdir(tmp_path)
    for given, shown in ((bad, "sub/kernels.yaml"), (Path("sub/kernels.yaml"), "sub/kernels.yaml")):
        with pytest.raises(ManifestError) as ei:
            load_manifest(given)
        assert str(ei.value).startswith(f"{shown}: <top>: expected a mapping") and expect in str(ei.value), ei.value
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # not inside the working folder: the path as given
    with pytest.raises(ManifestError) as ei:
        load_manifest(bad)
    assert str(ei.value).startswith(f"{bad}: <top>:"), ei.value
    # relative and outside the working folder: as given, not /.../elsewhere/../sub/kernels.yaml (a review)
    (tmp_path / "sub" / "dup.yaml").write_text("schema: 1\nschema: 1\n")
    for given in ("../sub/kernels.yaml", "../sub/nope.yaml", "../sub/dup.yaml", "../sub"):
        with pytest.raises(ManifestError) as ei:
            load_manifest(given)
        assert str(ei.value).startswith(given + ":") and "elsewhere/.." not in str(ei.value), ei.value


def test_a_lock_given_as_the_manifest_says_it_is_no_manifest(tmp_path):
    """`PIPEGOOSE_MANIFEST=.../kernels.lock` read "schema: expected 1, got None" (a fresh-clone walkthrough)."""
    lock = tmp_path / "kernels.lock"
    lock.write_text("version: 1\nsources: {}\nkernels: {}\n")
    with pytest.raises(ManifestError, match=r"schema: required field is missing: not a kernels.yaml \(one has schema: "
                                            r"1, sources and kernels; this file has version, sources, kernels\)"):
        load_manifest(lock)


def test_manifest_errors_keep_the_name_given_to_a_link(tmp_path, monkeypatch):
    """_shown() followed symbolic links: kernels.yaml -> configs/real.yaml was named configs/real.yaml (a review)."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "real.yaml").write_text("")
    (tmp_path / "kernels.yaml").symlink_to(tmp_path / "configs" / "real.yaml")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ManifestError, match=r"^kernels.yaml: <top>:"):
        load_manifest(tmp_path / "kernels.yaml")


def test_no_default_manifest_says_how_pipegoose_is_installed(tmp_path, monkeypatch):
    """A walkthrough installed a wheel: every kernel command said only "<site-packages>/kernels.yaml: manifest not
    found". The default manifest's absence now says that pipegoose runs from a clone (or takes --manifest)."""
    from pipegoose.kernels import manifest

    monkeypatch.setattr(manifest, "default_manifest_path", lambda: tmp_path / "kernels.yaml")
    with pytest.raises(ManifestError, match=r"manifest not found: pipegoose builds its kernels from a clone .*"
                                            r"pip install -e \.` .*--manifest"):
        load_manifest()
    with pytest.raises(ManifestError, match=r"nope\.yaml: manifest not found$"):  # a path given: it is the mistake
        load_manifest(tmp_path / "nope.yaml")


def test_package_data_holds_every_data_file_of_the_package():
    """The H200 tuning table was not in the package data, so an installed (non-editable) pipegoose dispatched without
    it (a walkthrough); every file under pipegoose/ that is not Python must match a package-data pattern."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+; pyproject.toml allows 3.10)

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = [p for p in (root / "pipegoose").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert any(p.suffix == ".json" for p in data) and any(p.suffix == ".cu" for p in data)
    unmatched = []
    for p in data:
        rel = p.relative_to(root)
        ok = False
        for pkg, globs in patterns.items():
            base = Path(*pkg.split("."))
            # part by part, as setuptools globs match: a "*" does not cross a "/" (fnmatch's would)
            parts = rel.relative_to(base).parts if rel.is_relative_to(base) else ()
            if any(len(parts) == len(g.split("/")) and all(map(fnmatch.fnmatch, parts, g.split("/"))) for g in globs):
                ok = True
        if not ok:
            unmatched.append(rel.as_posix())
    assert unmatched == []
