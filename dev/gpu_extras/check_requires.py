"""Structural check, runnable on any Python with `packaging`: every Requires-Dist of every package
in the extras site (extras and markers evaluated for CPython 3.12 on x86_64 Linux) must be met by
the extras site, the sglang site, or the GPU venv's known packages (GPU_VENV below, versions
unknown unless given; gpu-venv-pip-list.txt, `pip list` as seen on the GPU machine, adds the rest
with versions). Run from the repo root:
    python .gpu-extras/check_requires.py [EXTRAS_SITE] [SGLANG_SITE]
"""
from __future__ import annotations

import email.parser
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

EXTRAS = Path(sys.argv[1] if len(sys.argv) > 1 else ".gpu-extras/site")
SGLANG = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/sgsite/sglang-site")
# given for the GPU machine (plus what those packages themselves require, e.g. transformers ->
# packaging/pyyaml/tqdm/regex, accelerate -> psutil; versions unknown -> None)
GPU_VENV = {"torch": "2.11.0", "numpy": "2.5.2", "triton": "3.6.0", "safetensors": None, "tokenizers": None,
            "transformers": None, "huggingface-hub": None, "accelerate": None, "sentencepiece": None,
            "peft": None, "packaging": None, "pyyaml": None, "tqdm": None, "regex": None, "psutil": None,
            "filelock": None, "jinja2": None, "markupsafe": None, "sympy": None, "networkx": None,
            "fsspec": None, "setuptools": None}
_PIP_LIST = Path(__file__).with_name("gpu-venv-pip-list.txt")
if _PIP_LIST.is_file():
    for _line in _PIP_LIST.read_text().splitlines()[2:]:
        if len(_line.split()) >= 2:
            GPU_VENV[canonicalize_name(_line.split()[0])] = _line.split()[1]
# not needed at run time: the JS halves of ipywidgets; debugpy is an optional import in ipykernel
NOT_NEEDED = {"widgetsnbextension", "jupyterlab-widgets", "debugpy"}

ENV = default_environment()
ENV.update(python_version="3.12", python_full_version="3.12.3", sys_platform="linux", platform_system="Linux",
           platform_machine="x86_64", os_name="posix", implementation_name="cpython",
           platform_python_implementation="CPython")


def dists(site: Path) -> dict[str, tuple[str, list[str]]]:
    out = {}
    for meta in site.glob("*.dist-info/METADATA"):
        m = email.parser.Parser().parsestr(meta.read_text(encoding="utf-8", errors="replace"), headersonly=True)
        out[canonicalize_name(m["Name"])] = (m["Version"], m.get_all("Requires-Dist") or [])
    return out


extras, sglang = dists(EXTRAS), dists(SGLANG)
provided = {**{k: (v, "gpu-venv") for k, v in GPU_VENV.items()},
            **{k: (v[0], "sglang-site") for k, v in sglang.items()},
            **{k: (v[0], "extras") for k, v in extras.items()}}
shadow = sorted(set(extras) & (set(sglang) | set(GPU_VENV)))
problems = 0
print(f"{len(extras)} distributions in {EXTRAS}:")
for name, (version, reqs) in sorted(extras.items()):
    notes = []
    for line in reqs:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({**ENV, "extra": ""}):
            continue
        dep = canonicalize_name(req.name)
        if dep in NOT_NEEDED:
            notes.append(f"{dep} (skipped: not needed at run time)")
            continue
        if dep not in provided:
            notes.append(f"MISSING {req}")
            problems += 1
            continue
        have, where = provided[dep]
        if have is not None and req.specifier and not req.specifier.contains(Version(have), prereleases=True):
            notes.append(f"VERSION {req} but {where} has {have}")
            problems += 1
    print(f"  {name}=={version}" + "".join(f"\n      {n}" for n in notes))
print(f"also in sglang site or GPU venv (extras copy shadows the venv's, not the sglang site's): {shadow}")
print("all Requires-Dist satisfied" if not problems else f"{problems} unmet requirement(s)")
sys.exit(1 if problems else 0)
