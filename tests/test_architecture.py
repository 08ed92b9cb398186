"""The dependency rules of the plugin architecture, enforced on the source.

* The core (``core/omniinfer``, except the ``testing`` kit) never imports a plugin or a vendor
  library and never touches ``torch.cuda`` / ``torch.xpu`` / ``torch.version.cuda|hip``:
  everything vendor-specific goes through the selected platform.
* No plugin imports another plugin.
* A plugin's hook module (``plugin.py``) imports only the hookspec at module level.
* Every module of every plugin imports on this machine, without its hardware; importing a
  plugin package (what entry-point discovery does) imports neither torch nor a vendor library,
  creates no device context and writes nothing to ``os.environ``.

Each failure names ``file:line`` for every violation.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "omniinfer"
CORE_EXEMPT = CORE / "testing"
PLUGIN_PACKAGES = sorted(p.parent for p in (ROOT / "plugins").glob("*/omniinfer_*/__init__.py"))

VENDOR_LIBRARIES = frozenset({
    "flash_attn", "flashinfer", "xformers", "vllm", "apex", "pynvml", "nvidia", "cupy",
    "tensorrt", "tensorrt_llm", "amdsmi", "pyrsmi", "aiter", "intel_extension_for_pytorch",
    "ipex", "oneccl_bindings_for_pytorch", "torch_ccl", "habana_frameworks", "torch_npu",
    "torch_xla",
})
# torch attributes that are one vendor's: the core asks the platform instead
VENDOR_TORCH_ATTRIBUTES = frozenset({"torch.cuda", "torch.xpu", "torch.version.cuda",
                                     "torch.version.hip"})


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every absolute import, and importlib.import_module / __import__ with
    a constant name. `from torch import cuda` counts as importing `torch.cuda`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module in ("torch", "torch.version"):
                found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and _dotted(node.func) in ("importlib.import_module", "__import__")
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def _torch_names(tree: ast.AST) -> set[str]:
    """Local names bound to the torch module (`import torch`, `import torch as t`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or (alias.asname is None and alias.name.startswith("torch.")):
                    names.add(alias.asname or "torch")
    return names


def core_violations(source: str) -> list[tuple[int, str]]:
    """(line, message) for every way `source` breaks the core's rules."""
    tree = ast.parse(source)
    out = []
    for line, module in _imported_modules(tree):
        top = module.split(".")[0]
        if top.startswith("omniinfer_"):
            out.append((line, f"imports plugin package {module!r}"))
        elif top in VENDOR_LIBRARIES:
            out.append((line, f"imports vendor library {module!r}"))
        elif module in VENDOR_TORCH_ATTRIBUTES or module.startswith(("torch.cuda.", "torch.xpu.")):
            out.append((line, f"imports {module!r} (ask the platform instead)"))
    torch_names = _torch_names(tree)
    for node in ast.walk(tree):
        dotted = None
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            base = _dotted(node.args[0])
            dotted = f"{base}.{node.args[1].value}" if base else None
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        if head in torch_names and f"torch.{rest}" in VENDOR_TORCH_ATTRIBUTES:
            out.append((node.lineno, f"touches {dotted} (ask the platform instead)"))
    return sorted(set(out))


def _module_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """Imports executed when the module is imported (not inside functions or TYPE_CHECKING)."""
    found = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and _dotted(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                found.extend((node.lineno, a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                found.append((node.lineno, "." * node.level + (node.module or "")))
            visit(ast.iter_child_nodes(node))

    visit(tree.body)
    return found


def _python_files(directory: Path, exempt: Path | None = None) -> list[Path]:
    return sorted(p for p in directory.rglob("*.py")
                  if exempt is None or exempt not in p.parents)


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def _fail_on(violations: list[str], rule: str) -> None:
    if violations:
        pytest.fail(f"{rule}:\n" + "\n".join(f"  {v}" for v in violations), pytrace=False)


# ---- the checker catches what it should --------------------------------------------------
def test_the_core_checker_catches_violations():
    source = textwrap.dedent("""\
        import torch as t
        import flash_attn.ops
        from omniinfer_cuda.platform import CudaPlatform
        from torch.version import hip
        if t.cuda.is_available() and t.version.cuda:
            getattr(t, "xpu")
        importlib.import_module("omniinfer_rocm")
        t.device("cuda")  # a device string is plain data, not a vendor API
        """)
    assert core_violations(source) == [
        (2, "imports vendor library 'flash_attn.ops'"),
        (3, "imports plugin package 'omniinfer_cuda.platform'"),
        (4, "imports 'torch.version.hip' (ask the platform instead)"),
        (5, "touches t.cuda (ask the platform instead)"),
        (5, "touches t.version.cuda (ask the platform instead)"),
        (6, "touches t.xpu (ask the platform instead)"),
        (7, "imports plugin package 'omniinfer_rocm'"),
    ]


# ---- the rules ---------------------------------------------------------------------------
def test_core_imports_no_plugin_and_no_vendor_library():
    files = _python_files(CORE, exempt=CORE_EXEMPT)
    assert len(files) > 10
    violations = [f"{_where(path, line)}: {message}" for path in files
                  for line, message in core_violations(path.read_text(encoding="utf-8"))]
    _fail_on(violations, "core/omniinfer must stay vendor-neutral")


def test_no_plugin_imports_another_plugin():
    assert {p.name for p in PLUGIN_PACKAGES} >= {"omniinfer_cpu", "omniinfer_cuda", "omniinfer_rocm",
                                                  "omniinfer_xpu"}
    violations = []
    for package in PLUGIN_PACKAGES:
        for path in _python_files(package):
            for line, module in _imported_modules(ast.parse(path.read_text(encoding="utf-8"))):
                top = module.split(".")[0]
                if top.startswith("omniinfer_") and top != package.name:
                    violations.append(f"{_where(path, line)}: {package.name} imports {module!r}")
    _fail_on(violations, "a plugin must not import another plugin")


def test_hook_modules_import_only_the_hookspec():
    violations = []
    for package in PLUGIN_PACKAGES:
        path = package / "plugin.py"
        if not path.exists():
            violations.append(f"{path.relative_to(ROOT)}: missing (the entry point's hook module)")
            continue
        for line, module in _module_level_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if module not in ("__future__", "omniinfer.platforms.hookspec"):
                violations.append(f"{_where(path, line)}: imports {module!r} at module level "
                                  "(import it inside the hook)")
    _fail_on(violations, "plugin.py hook modules must be free to import")


# Runs in a fresh interpreter per plugin: import the package and its hook module first (what
# discovery does), then every other module.
_IMPORT_PROBE = """
import importlib, json, os, pkgutil, sys, traceback
VENDOR = set(json.loads(sys.argv[2]))
package_name = sys.argv[1]
result = {"failures": [], "environ": [], "vendor": [], "torch_at_discovery": False,
          "device_context": []}

def environ_changes(before, what):
    after = dict(os.environ)
    for key in sorted(before.keys() | after.keys()):
        if before.get(key) != after.get(key):
            result["environ"].append(f"{what} sets {key}={after.get(key)!r} (was {before.get(key)!r})")

before = dict(os.environ)
package = importlib.import_module(package_name)
importlib.import_module(package_name + ".plugin")
environ_changes(before, "importing " + package_name + " and its plugin.py")
result["torch_at_discovery"] = "torch" in sys.modules
result["vendor"] = sorted(m for m in sys.modules if m.split(".")[0] in VENDOR)

import torch  # the rest of the package may use torch; only what the plugin adds counts
names = [m.name for m in pkgutil.walk_packages(package.__path__, package_name + ".",
                                               onerror=lambda name: None)]
for name in [package_name] + names:
    before = dict(os.environ)
    try:
        importlib.import_module(name)
    except BaseException as e:
        last = traceback.extract_tb(e.__traceback__)[-1]
        result["failures"].append(f"{name} ({last.filename}:{last.lineno}): {type(e).__name__}: {e}")
    environ_changes(before, "importing " + name)
for vendor in ("cuda", "xpu"):
    module = getattr(torch, vendor, None)
    if module is not None and module.is_initialized():
        result["device_context"].append(f"torch.{vendor} was initialized by an import")
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def import_probes() -> dict[str, dict]:
    """One fresh interpreter per plugin, run side by side."""
    procs = {package.name: subprocess.Popen(
        [sys.executable, "-c", _IMPORT_PROBE, package.name, json.dumps(sorted(VENDOR_LIBRARIES))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for package in PLUGIN_PACKAGES}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"the import probe for {name} crashed:\n{err}"
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("package", [p.name for p in PLUGIN_PACKAGES])
def test_every_plugin_module_imports_without_its_hardware(import_probes, package):
    _fail_on(import_probes[package]["failures"], f"modules of {package} that do not import here")


@pytest.mark.parametrize("package", [p.name for p in PLUGIN_PACKAGES])
def test_importing_a_plugin_is_free(import_probes, package):
    probe = import_probes[package]
    violations = probe["environ"] + probe["device_context"]
    violations += [f"importing {package} imports vendor library {m!r}" for m in probe["vendor"]]
    if probe["torch_at_discovery"]:
        violations.append(f"importing {package} and {package}.plugin imports torch "
                          "(import it inside the hooks and platform methods)")
    _fail_on(violations, f"importing {package} must be free")


# ---- the step as plain data, short code at the contract (issue 19) -------------------------
BELOW_THE_ENGINE = ("worker", "sampling", "attention", "spec_decode", "models")
MAX_FILE_LINES = 400  # "about 400": a file a few lines over passes, 2% over fails
MAX_CONTRACT_LINES = 15  # LLMEngine.step(), a metadata builder's build()


def engine_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of omniinfer.engine (at any depth, lazy ones too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "omniinfer":
            found += [(node.lineno, f"omniinfer.{a.name}") for a in node.names if a.name == "engine"]
    found += [(line, module) for line, module in _imported_modules(ast.parse(source))]
    return sorted({(line, m) for line, m in found if m == "omniinfer.engine"
                   or m.startswith("omniinfer.engine.")})


def test_the_engine_checker_catches_violations():
    source = textwrap.dedent("""\
        from omniinfer.engine.sequence import Sequence
        from omniinfer import engine
        def lazy():
            import omniinfer.engine.scheduler
        from omniinfer.step import SchedulerOutput
        """)
    assert engine_imports(source) == [(1, "omniinfer.engine.sequence"), (2, "omniinfer.engine"),
                                      (4, "omniinfer.engine.scheduler")]


def test_nothing_below_the_engine_imports_it():
    """The step crosses as plain data (omniinfer/step.py): the worker, sampling, attention,
    speculative decoding and the models never see the engine's objects."""
    violations = [f"{_where(path, line)}: imports {module!r}"
                  for sub in BELOW_THE_ENGINE for path in _python_files(CORE / sub)
                  for line, module in engine_imports(path.read_text(encoding="utf-8"))]
    _fail_on(violations, "worker/, sampling/, attention/, spec_decode/ and models/ must not import engine/")


def _definition(path: Path, qualname: str) -> ast.AST:
    node = ast.parse(path.read_text(encoding="utf-8"))
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part)
    return node


def _lines(node: ast.AST) -> int:
    """Lines of a definition, from its `def` to its last line (docstring included)."""
    return node.end_lineno - node.lineno + 1


def builders() -> list[tuple[Path, str]]:
    """Every metadata builder's `build` in core and the plugins: (file, Class.build)."""
    found = []
    for path in _python_files(CORE) + [p for package in PLUGIN_PACKAGES for p in _python_files(package)]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("MetadataBuilder") and any(
                    isinstance(n, ast.FunctionDef) and n.name == "build" for n in node.body):
                found.append((path, f"{node.name}.build"))
    return found


def test_the_step_and_the_builders_are_short():
    """LLMEngine.step() reads as schedule -> execute -> update -> outputs; FLASH_ATTN's builder,
    the kit's example backend's and every other build their metadata in one short call."""
    step = _definition(CORE / "engine" / "llm_engine.py", "LLMEngine.step")
    assert _lines(step) <= MAX_CONTRACT_LINES, f"LLMEngine.step() is {_lines(step)} lines"
    found = builders()
    names = {name for _, name in found}
    assert {"FlashAttentionMetadataBuilder.build", "ExampleMetadataBuilder.build",
            "AttentionMetadataBuilder.build"} <= names
    long = [f"{_where(path, _definition(path, name).lineno)}: {name} is "
            f"{_lines(_definition(path, name))} lines" for path, name in found
            if _lines(_definition(path, name)) > MAX_CONTRACT_LINES]
    _fail_on(long, f"a metadata builder builds in at most {MAX_CONTRACT_LINES} lines")


def test_no_file_is_over_about_400_lines():
    """Small modules, one job each: Python and the CPU kernels' C alike."""
    files = [p for root in (ROOT / "core", ROOT / "plugins") for ext in ("*.py", "*.c", "*.h")
             for p in root.rglob(ext) if "build" not in p.relative_to(ROOT).parts]
    assert any(p.suffix == ".c" for p in files)
    limit = MAX_FILE_LINES * 102 // 100
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in files
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit]
    _fail_on(long, f"files stay under about {MAX_FILE_LINES} lines")
