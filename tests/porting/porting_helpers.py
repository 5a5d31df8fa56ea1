"""Helpers for the porting tests: a throw-away repository root, a local git "upstream", and local sdists
served through a file:// simple index. Nothing here touches the real vendor/, LICENSES/ or kernels.lock."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import textwrap
from pathlib import Path

import pytest

from pipegoose.porting import Porter
from pipegoose.porting.fetch import Fetcher, IndexConfig, SimpleIndex

APACHE = textwrap.dedent("""\
                                     Apache License
                               Version 2.0, January 2004
    TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION (test fixture text)
""")
APACHE_V2 = APACHE + "\n   Appendix: a notice added in the next release.\n"
MIT = "MIT License\n\nPermission is hereby granted, free of charge, to any person obtaining a copy (test fixture)\n"
GPL = "GNU GENERAL PUBLIC LICENSE\nVersion 3, 29 June 2007 (test fixture)\n"

# The tiny upstream: two kernels sharing a header; one includes a second header by a path relative to an
# include dir.
V1_FILES = {
    "csrc/common/util.h": "#pragma once\ninline int twice(int x) { return 2 * x; }\n",
    "csrc/common/extra.h": "#pragma once\n#include \"util.h\"\n",
    "csrc/kernels/alpha.cu": "#include \"common/util.h\"\n#include <cuda.h>\nint alpha_fwd(int x) {\n  return twice(x);\n}\n",
    "csrc/kernels/beta.cu": "#include \"common/extra.h\"\nint beta_fwd(int x);\nint beta_fwd(int x) { return x; }\n",
    "setup.py": "raise SystemExit('this sdist cannot build its metadata')\n",
}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_sdist(dest: Path, name: str, version: str, files: dict[str, str], license_text: str | None = APACHE,
               extra_members: list[tarfile.TarInfo] | None = None) -> Path:
    """A .tar.gz sdist laid out as <name>-<version>/..., returned path."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / f"{name}-{version}.tar.gz"
    top = f"{name}-{version}"
    contents = dict(files)
    if license_text is not None:
        contents["LICENSE"] = license_text
    contents.setdefault("PKG-INFO", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    with tarfile.open(out, "w:gz") as tf:
        for path, text in sorted(contents.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{path}")
            info.size = len(data)
            info.mtime = 0
            tf.addfile(info, io.BytesIO(data))
        for m in extra_members or []:
            tf.addfile(m)
    return out


def publish(index_root: Path, sdist: Path, with_hash: bool = True) -> None:
    """Add an sdist to a PEP 503 file index at ``index_root`` (<root>/<project>/index.html + files/)."""
    files = index_root / "files"
    files.mkdir(parents=True, exist_ok=True)
    target = files / sdist.name
    target.write_bytes(sdist.read_bytes())
    project = sdist.name.rsplit("-", 1)[0].lower().replace("_", "-")
    pdir = index_root / project
    pdir.mkdir(parents=True, exist_ok=True)
    links = []
    for f in sorted(files.iterdir()):
        if f.name.rsplit("-", 1)[0].lower().replace("_", "-") == project:
            frag = f"#sha256={sha256(f.read_bytes())}" if with_hash else ""
            links.append(f'<a href="../files/{f.name}{frag}">{f.name}</a>')
    (pdir / "index.html").write_text("<html><body>\n" + "\n".join(links) + "\n</body></html>\n")


MANIFEST_HEAD = """\
# test manifest
schema: 1
sources:
"""


def source_yaml(sid: str, fetch: str, license: str = "Apache-2.0", license_files: str = "[LICENSE]") -> str:
    return textwrap.indent(textwrap.dedent(f"""\
        {sid}:
          project: Up
          homepage: https://example.invalid/up
          license: {license}
          license_files: {license_files}
          fetch:
            {fetch}
        """), "  ")


def kernel_yaml(kid: str, source: str, files: list[str], symbol: str, op: str, include_dirs: str = "[csrc]") -> str:
    return textwrap.indent(textwrap.dedent(f"""\
        {kid}:
          source: {source}
          aliases: [{kid.split('/')[1]}]
          files: [{', '.join(files)}]
          include_dirs: {include_dirs}
          binding: pipegoose/kernels/bindings/{op}.cpp
          entries:
            - {{symbol: {symbol}, op: {op}, role: forward}}
          dtypes: [float16]
          backward: false
        """), "  ")


class Repo:
    """A throw-away repository root plus the helpers to write its manifest and snapshot its state."""

    def __init__(self, root: Path, cache: Path, index_url: str):
        self.root = root
        self.cache = cache
        self.index_url = index_url

    def write_manifest(self, sources: str, kernels: str) -> Path:
        p = self.root / "kernels.yaml"
        p.write_text(MANIFEST_HEAD + sources + "kernels:\n" + kernels)
        return p

    def porter(self, offline: bool = False, **kw) -> Porter:
        fetcher = Fetcher(self.root, self.cache, offline=offline,
                          index=SimpleIndex(IndexConfig([self.index_url], [], None, 10.0)))
        return Porter(self.root / "kernels.yaml", fetcher=fetcher, **kw)

    def snapshot(self) -> dict[str, bytes]:
        """Every file under vendor/, LICENSES/ plus kernels.lock and kernels.yaml (lock file of filelock excluded)."""
        out = {}
        for top in ("vendor", "LICENSES"):
            d = self.root / top
            if d.exists():
                for p in sorted(d.rglob("*")):
                    if p.is_file() and p.name != ".port.lock":
                        out[p.relative_to(self.root).as_posix()] = p.read_bytes()
                    elif p.is_dir() and not any(p.iterdir()):
                        out[p.relative_to(self.root).as_posix() + "/"] = b""
        for name in ("kernels.lock", "kernels.yaml"):
            if (self.root / name).exists():
                out[name] = (self.root / name).read_bytes()
        return out


def init_git_upstream(path: Path, files: dict[str, str], license_text: str = APACHE):
    """A local git repository with one commit of ``files`` + LICENSE; returns (repo, commit sha)."""
    import git

    path.mkdir(parents=True)
    r = git.Repo.init(path, initial_branch="main")
    with r.config_writer() as cw:
        cw.set_value("user", "name", "test")
        cw.set_value("user", "email", "test@example.invalid")
    sha = commit_files(r, files, license_text, "v1")
    return r, sha


def commit_files(r, files: dict[str, str], license_text: str | None, msg: str) -> str:
    root = Path(r.working_tree_dir)
    for p in list(root.rglob("*")):
        if p.is_file() and ".git" not in p.parts:
            p.unlink()
    contents = dict(files)
    if license_text is not None:
        contents["LICENSE"] = license_text
    for path, text in contents.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    r.git.add("-A")
    r.index.commit(msg)
    return r.head.commit.hexsha


def git_available() -> bool:
    return os.system("git --version >/dev/null 2>&1") == 0
