# Imported by every Python process started with this folder first on PYTHONPATH, SGLang's scheduler included:
# once sglang.srt.layers.sampler is imported, patch.install() replaces its Sampler.forward (see patch.py).
# Shadows any later sitecustomize.py on the path (the offline sglang site ships one), so it runs the next one after
# its folder (dev/site_chain.py).
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
    _spec = importlib.util.spec_from_file_location("_dev_site_chain",
                                                   os.path.join(os.path.dirname(_HERE), "site_chain.py"))
    _chain = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_chain)
    _chain.run_next(_HERE)
