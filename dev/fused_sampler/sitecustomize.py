# Imported by every Python process started with this folder first on PYTHONPATH, SGLang's scheduler included:
# once sglang.srt.layers.sampler is imported, patch.install() replaces its Sampler.forward (see patch.py).
# Shadows any later sitecustomize.py on the path (the offline sglang site ships one), so it runs that one too.
import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
_TARGET = "sglang.srt.layers.sampler"


class _AfterSamplerImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)                 # find the real spec, then wrap its loader
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            import patch
            patch.install()
        spec.loader.exec_module = exec_module
        return spec


if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
if not any(isinstance(f, _AfterSamplerImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterSamplerImport())

if "_lorabench_fused_site" not in sys.modules:   # never chained into twice in one process
    sys.modules["_lorabench_fused_site"] = sys.modules[__name__]
    _folders = [os.path.realpath(_entry or os.getcwd()) for _entry in sys.path]
    # the next sitecustomize.py after this folder on the path: another chaining one before it (dev/stacks)
    # has run already, and picking the first that is not this one would skip the offline site's
    for _folder in _folders[_folders.index(_HERE) + 1:] if _HERE in _folders else _folders:
        _next = os.path.join(_folder, "sitecustomize.py")
        if _folder != _HERE and os.path.isfile(_next):
            _spec = importlib.util.spec_from_file_location("_sitecustomize_shadowed", _next)
            _module = importlib.util.module_from_spec(_spec)
            sys.modules[_spec.name] = _module
            _spec.loader.exec_module(_module)
            break
