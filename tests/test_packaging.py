"""Packaging: environment.yml and pyproject.toml agree with each other; the package has the layout of
the re-cut (every module imports, none of the removed ones is left); the repository tracks no stray
binaries or logs and its docs point at what exists."""
import ast
import importlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def env() -> dict:
    import yaml  # PyYAML: a dependency of transformers, so always installed with lorabench
    return yaml.safe_load((ROOT / "environment.yml").read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _conda_deps(env):
    return [d for d in env["dependencies"] if isinstance(d, str)]


def _pip_deps(env):
    sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(sections) == 1, "environment.yml needs exactly one pip: section"
    return sections[0]


def test_channels(env):
    assert env["channels"] == ["conda-forge", "nodefaults"]
    assert env["name"] == "lorabench"


def test_python_and_pip_from_conda(env, pyproject):
    names = [re.split(r"[=<>! ]", d, maxsplit=1)[0] for d in _conda_deps(env)]
    assert "python" in names and "pip" in names
    python = next(d for d in _conda_deps(env) if d.startswith("python"))
    version = re.search(r"(\d+)\.(\d+)", python)
    assert version, f"pin a python version in environment.yml ({python!r})"
    minimum = re.search(r">=\s*(\d+)\.(\d+)", pyproject["project"]["requires-python"])
    assert tuple(map(int, version.groups())) >= tuple(map(int, minimum.groups()))


def test_pip_installs_package_with_extras(env, pyproject):
    pip = _pip_deps(env)
    editable = [d for d in pip if d.startswith("-e ")]
    assert editable == ["-e .[notebook,sglang,dev]"]
    extras = re.search(r"\[(.*)\]", editable[0]).group(1).split(",")
    defined = pyproject["project"]["optional-dependencies"]
    for extra in extras:
        assert extra.strip() in defined, f"extra {extra!r} is not in [project.optional-dependencies]"
        assert defined[extra.strip()], f"extra {extra!r} is empty"


def test_dev_extra_has_pytest(pyproject):
    dev = pyproject["project"]["optional-dependencies"]["dev"]
    assert any(re.match(r"pytest\b", d) for d in dev)


def test_browser_tooling_is_the_test_suites_own(pyproject):
    """No extra pulls in Playwright: the browser test's driver is in tests/browser_requirements.txt,
    which the README's test command (`make test`) installs before it runs the tests."""
    extras = pyproject["project"]["optional-dependencies"]
    assert [d for deps in extras.values() for d in deps if re.match(r"playwright\b", d, re.I)] == []
    assert re.search(r"^playwright\b", (ROOT / "tests" / "browser_requirements.txt").read_text(), re.M)
    makefile = (ROOT / "Makefile").read_text()
    rule = r"^(\S+): .*tests/browser_requirements\.txt\n\t.*-r tests/browser_requirements\.txt"
    stamp = re.search(rule, makefile, re.M)
    assert stamp, "the Makefile has no rule installing tests/browser_requirements.txt"
    assert stamp.group(1) in re.search(r"^test:(.*)$", makefile, re.M).group(1).split(), "make test does not install it"


def test_console_script(pyproject):
    assert pyproject["project"]["scripts"]["lorabench"] == "lorabench.cli:main"
    module, func = pyproject["project"]["scripts"]["lorabench"].split(":")
    assert (ROOT / Path(*module.split("."))).with_suffix(".py").is_file()
    assert re.search(rf"^def {func}\(", (ROOT / "lorabench" / "cli.py").read_text(), re.M)


def test_version_agrees(pyproject):
    import lorabench
    assert pyproject["project"]["version"] == lorabench.__version__


def test_pytest_markers_declared(pyproject):
    markers = " ".join(pyproject["tool"]["pytest"]["ini_options"]["markers"])
    assert "gpu:" in markers and "slow:" in markers


def test_requires_python(pyproject):
    assert pyproject["project"]["requires-python"] == ">=3.11"   # tomllib and BaseException.add_note
    import sys
    assert sys.version_info >= (3, 11)


def _minimum_python(pyproject) -> tuple[int, int]:
    return tuple(map(int, re.search(r">=\s*(\d+)\.(\d+)", pyproject["project"]["requires-python"]).groups()))


@pytest.mark.parametrize("doc", ["Makefile", "README.md"])
def test_docs_state_the_minimum_python(doc, pyproject):
    """Where a doc says 'Python X.Y+', it is the minimum pyproject.toml requires."""
    stated = [tuple(map(int, m)) for m in re.findall(r"Python (\d+)\.(\d+)\+", (ROOT / doc).read_text())]
    assert all(v == _minimum_python(pyproject) for v in stated), (doc, stated)


# --- the package layout ----------------------------------------------------------------------------
MODULES = ["__init__", "adapters", "cli", "data", "datafiles", "engines/__init__", "engines/base",
           "engines/engine_thread", "engines/hf", "engines/sglang", "engines/sglang_internals",
           "explain/__init__", "explain/checks", "explain/hotswap", "explain/lora", "explain/ranks",
           "explain/refresh_costs", "explain/staleness", "explain/step", "grpo", "hub", "interrupts",
           "loss", "machine", "models", "policy", "progress", "refresh", "refresh_bench", "rewards", "rollout",
           "rundir", "runlog", "safedir", "session/__init__", "session/compat", "session/config",
           "session/preflight", "session/run", "settings", "tiny", "viz", "widgets"]
REMOVED = ["warmstart", "engines/sglang_inplace", "engines/sglang_pool", "engines/loopback", "fsutil", "shapes",
           "session/fingerprint", "session/sizes"]
MOVED_INTO_THE_SESSION = ["config", "compat", "preflight", "sizes", "fingerprint"]   # they handle the whole Config


def test_package_has_the_modules_of_the_recut():
    present = {p.relative_to(ROOT / "lorabench").with_suffix("").as_posix()
               for p in (ROOT / "lorabench").rglob("*.py")}
    assert set(MODULES) <= present, sorted(set(MODULES) - present)
    assert not present & set(REMOVED), f"removed modules are still in the tree: {sorted(present & set(REMOVED))}"


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports_without_optional_dependencies(module):
    """sglang is imported only when an SGLang engine starts, so every module imports on a CPU box."""
    importlib.import_module("lorabench." + module.replace("/", ".").removesuffix(".__init__"))


def test_only_the_session_handles_the_whole_config():
    """The modules that read every section live in lorabench/session/; no other module imports its Config."""
    assert not any((ROOT / "lorabench" / f"{m}.py").exists() for m in MOVED_INTO_THE_SESSION)
    for path in (ROOT / "lorabench").rglob("*.py"):
        if "session" in path.relative_to(ROOT / "lorabench").parts:
            continue
        text = path.read_text()
        assert not re.search(r"from \.+session(\.config)? import [^\n]*\bConfig\b", text), f"{path} imports Config"


def test_nothing_refers_to_removed_modules():
    names = [m.replace("/", ".") for m in REMOVED]
    for path in (ROOT / "lorabench").rglob("*.py"):
        if path.relative_to(ROOT / "lorabench").with_suffix("").as_posix() in REMOVED:
            continue
        text = path.read_text()
        for name in names:
            leaf = name.rsplit(".", 1)[-1]
            assert not re.search(rf"(import|from)\s+[.\w]*\b{leaf}\b", text), f"{path} imports {name}"
            assert f"lorabench.{name}" not in text, f"{path} names lorabench.{name}"


# --- the repository -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tracked() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_dev_tooling_moved_out_of_scripts(tracked):
    rel = [p.relative_to(ROOT).as_posix() for p in tracked]
    assert not [r for r in rel if r.startswith("scripts/")]
    assert "dev/gpu_suite.sh" in rel and "dev/run_notebooks_gpu.py" in rel


def test_no_stray_wheels_logs_or_build_outputs_tracked(tracked):
    stray = [p.relative_to(ROOT).as_posix() for p in tracked
             if p.suffix in (".whl", ".log", ".pyc", ".egg", ".so", ".pt", ".safetensors", ".bin", ".tgz", ".zip")
             or any(part in ("__pycache__", ".pytest_cache", ".ipynb_checkpoints", "runs", "dist", "build")
                    or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]
    assert stray == []


MAX_TRACKED_BYTES = 5 * 2**20
BINARY_ALLOWED = (".png",)   # committed figures of measured results


def test_no_tracked_file_is_a_large_or_unexpected_binary(tracked):
    large, binary = [], []
    for path in tracked:
        if not path.is_file():   # deleted in the working tree, not yet committed
            continue
        if path.stat().st_size > MAX_TRACKED_BYTES:
            large.append((path.relative_to(ROOT).as_posix(), path.stat().st_size))
        with open(path, "rb") as fh:
            if b"\0" in fh.read(8192) and path.suffix not in BINARY_ALLOWED:
                binary.append(path.relative_to(ROOT).as_posix())
    assert large == [], f"tracked files over {MAX_TRACKED_BYTES} bytes: {large}"
    assert binary == [], f"tracked binary files: {binary}"


DOCS = ["README.md", "Makefile", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS)
def test_docs_point_at_existing_tooling(doc):
    """The dev tooling lives in dev/ (scripts/ is gone): every dev/ or scripts/ file a doc names exists."""
    text = (ROOT / doc).read_text()
    named = set(re.findall(r"(?<![\w/.])((?:scripts|dev)/[\w./-]*\w\.(?:sh|py))", text))
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert missing == [], f"{doc} names {missing}"


def test_readme_module_table_names_existing_modules():
    table = (ROOT / "README.md").read_text().split("## What is inside", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([\w/]+\.py)`", table))
    assert named, "README has no module table"
    missing = sorted(n for n in named if not (ROOT / "lorabench" / n).is_file())
    assert missing == [], f"README's module table names modules that do not exist: {missing}"


def _readme_commands() -> list[list[str]]:
    """`lorabench demo|run ...` command lines in README code blocks (continuation lines joined)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", text, re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0]
            if re.match(r"\s*lorabench (demo|run)\b", line):
                commands.append(shlex.split(line))
    return commands


def test_readme_commands_use_valid_config_keys():
    """The commands README tells people to run must pass config validation (no renamed keys)."""
    from lorabench.session.config import Config
    commands = _readme_commands()
    assert commands, "README shows no lorabench command"
    for args in commands:
        overrides = [a for a in args if re.match(r"^[a-z_]+\.[a-z_]+=", a)]
        Config.load(overrides=overrides)


def test_step_benchmark_checks_the_readme_real_model_command():
    """benchmarks/step_gpu.py's 24 GB check runs README's real-model command less the hub parts; the
    two must not drift apart (a README edit would leave the check measuring another setting)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from step_gpu import README_COMMAND
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    real = [args for args in _readme_commands() if "model.name_or_path=Qwen/Qwen3-0.6B" in args]
    assert len(real) == 1, "README should show one real-model command"
    overrides = {a for a in real[0] if re.match(r"^[a-z_]+(\.[a-z_]+)+=", a)}
    hub_or_length = {"model.", "data.", "engine.backend", "engine.sglang.dtype", "grpo.steps"}
    expected = {a for a in overrides if not a.startswith(tuple(hub_or_length))}
    assert set(README_COMMAND) == expected, (set(README_COMMAND) ^ expected)


# --- the shape of the code (what the re-cut promised, measured on the tree) ------------------------------
def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """lorabench modules `path` imports anywhere (module level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                hit = next((c for c in (f"{target}.{alias.name}", target) if c in modules), None)
                if hit and hit != name:
                    found.add(hit)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules and a.name != name}
    return found


def test_no_import_cycle_in_the_package():
    paths = {_module_name(p): p for p in (ROOT / "lorabench").rglob("*.py")}
    graph = {name: _imports(path, name, set(paths)) for name, path in paths.items()}
    done, stack = set(), []

    def visit(name):
        if name in stack:
            pytest.fail(f"import cycle: {' -> '.join(stack[stack.index(name):] + [name])}")
        if name in done:
            return
        stack.append(name)
        for target in sorted(graph[name]):
            visit(target)
        stack.pop()
        done.add(name)
    for name in sorted(graph):
        visit(name)


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_function_over_60_lines():
    long = [(p.relative_to(ROOT).as_posix(), name, n) for p in (ROOT / "lorabench").rglob("*.py")
            for name, n in _functions(p) if n > 60]
    assert long == [], f"functions over 60 lines: {long}"


def test_the_grpo_step_reads_as_the_algorithm():
    lengths = dict(_functions(ROOT / "lorabench" / "grpo.py"))
    assert lengths["step"] <= 40, f"GRPOTrainer.step is {lengths['step']} lines"


def test_readme_is_for_users_and_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines; results go to docs/results.md"


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_lines_fit_120_characters(path):
    long = [i + 1 for i, line in enumerate(path.read_text().splitlines()) if len(line) > 120]
    assert long == [], f"{path.name}: lines over 120 characters: {long[:10]}"


NUMBERED_PERIOD = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth)"
                             r"(\W+\w+)?\W+(session|round)\b|\bsession \d+|\bissue \d+", re.I)


def test_text_states_what_is_true_now():
    """Numbered work periods belong in the research log's dated entries, not in the package or docs."""
    places = [*DOCS, *(ROOT / "lorabench").rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{i + 1}" for p in places if p.name != "research_log.md"
             for i, line in enumerate(p.read_text().splitlines()) if NUMBERED_PERIOD.search(line)]
    assert found == [], found


# the design card's entries, plus the folders and files a repository of this kind needs
TOP_LEVEL = {"notebooks", "lorabench", "data", "environment.yml", "pyproject.toml", "README.md",
             "tests", "benchmarks", "docs", "dev", "Makefile"}


def test_top_level_holds_only_the_design_cards_entries(tracked):
    top = {p.relative_to(ROOT).parts[0] for p in tracked}
    extra = sorted(t for t in top - TOP_LEVEL if not t.startswith("."))
    assert extra == [], f"unexpected top-level entries: {extra}"
    assert TOP_LEVEL - {"Makefile"} <= top, sorted(TOP_LEVEL - top)


def test_data_folder_holds_a_data_file(tracked):
    data = [p for p in tracked if p.relative_to(ROOT).parts[0] == "data" and p.suffix in (".jsonl", ".parquet")]
    assert data, "data/ holds no data file"


def test_license_is_an_spdx_string(pyproject):
    # a TOML table ({text = ...}) makes setuptools warn on every install; the SPDX string needs setuptools 77
    assert isinstance(pyproject["project"]["license"], str)
    requires = pyproject["build-system"]["requires"]
    floor = next(re.search(r"setuptools>=(\d+)", r) for r in requires if r.startswith("setuptools"))
    assert floor and int(floor.group(1)) >= 77, requires


def test_building_the_wheel_warns_nothing_about_the_project(tmp_path):
    # the project's own metadata must not trip a setuptools deprecation (pip prints the backend's warnings)
    pytest.importorskip("setuptools")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert "deprecated" not in text.lower(), [line for line in text.splitlines() if "deprecat" in line.lower()]


def _gpu_tests(path: Path) -> set[str]:
    """The test functions of a test file that pytest's `gpu` marker selects (the module's or its own)."""
    def marked(node) -> bool:
        return any(isinstance(d, ast.Attribute) and d.attr == "gpu" for d in ast.walk(node))
    tree = ast.parse(path.read_text())
    whole = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                and marked(n.value) for n in tree.body)
    return {f"tests/{path.name}::{n.name}" for n in tree.body if isinstance(n, ast.FunctionDef)
            and n.name.startswith("test_") and (whole or any(marked(d) for d in n.decorator_list))}


def test_the_gpu_suite_plan_names_every_single_gpu_test_once():
    """dev/gpu_suite_calls.txt is the whole single-GPU suite (the two-GPU file aside): a new GPU test not in it
    would never run in `dev/gpu_session.sh suite`, a removed one would stop its call."""
    lines = [line.split() for line in (ROOT / "dev/gpu_suite_calls.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    planned = [entry.split("@")[0] for _, entry in lines]
    assert all(call.isdigit() and re.fullmatch(r"\S+::\w+@\d+", entry) for call, entry in lines), lines
    found = set().union(*(_gpu_tests(p) for p in sorted((ROOT / "tests").glob("test_*.py"))
                          if p.name != "test_sglang_tp2.py"))
    assert len(found) > 15 and sorted(planned) == sorted(found), (set(planned) ^ found)
