"""Packaging: environment.yml and pyproject.toml agree with each other."""
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _parse_env_minimal(text: str) -> dict:
    """Enough YAML for environment.yml (top-level keys, '- item' lists, one nested 'pip:' list),
    used only when PyYAML is not installed."""
    data: dict = {}
    key = None
    pip_list = None
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()   # comments
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        item = line.strip()
        if indent == 0 and item.endswith(":"):
            key, pip_list = item[:-1], None
            data[key] = []
        elif indent == 0 and ":" in item:
            k, v = item.split(":", 1)
            data[k.strip()] = v.strip()
        elif item.startswith("- ") and pip_list is not None and indent > pip_indent:
            pip_list.append(item[2:].strip())
        elif item.startswith("- "):
            value = item[2:].strip()
            if value.endswith(":"):
                pip_list, pip_indent = [], indent
                data[key].append({value[:-1]: pip_list})
            else:
                pip_list = None
                data[key].append(value)
    return data


@pytest.fixture(scope="module")
def env() -> dict:
    text = (ROOT / "environment.yml").read_text()
    try:
        import yaml
    except ImportError:
        return _parse_env_minimal(text)
    data = yaml.safe_load(text)
    assert _parse_env_minimal(text) == data   # keep the fallback honest while yaml is available
    return data


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
    names = [re.split(r"[=<>! ]", d, 1)[0] for d in _conda_deps(env)]
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
