# Imported by every Python process started with this folder first on PYTHONPATH (site's sitecustomize
# hook, which runs in a venv too, where usercustomize does not), SGLang's scheduler and detokenizer
# included: SIGUSR2 then prints the process's every thread's stack to its stderr. benchmarks/watch.py
# sends it to the engine's processes when a phase overruns. This file shadows any later
# sitecustomize.py on the path (the offline sglang site ships one), so it runs the next one after its
# own folder (the first one that is not its own could be another that chains back to this one).
import faulthandler
import importlib.util
import os
import signal
import sys

faulthandler.register(signal.SIGUSR2, all_threads=True)

_HERE = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
_FOLDERS = [os.path.realpath(_entry or os.getcwd()) for _entry in sys.path]
for _folder in _FOLDERS[_FOLDERS.index(_HERE) + 1:] if _HERE in _FOLDERS else _FOLDERS:
    _next = os.path.join(_folder, "sitecustomize.py")
    if _folder != _HERE and os.path.isfile(_next):
        _spec = importlib.util.spec_from_file_location("_sitecustomize_shadowed", _next)
        _module = importlib.util.module_from_spec(_spec)
        sys.modules[_spec.name] = _module
        _spec.loader.exec_module(_module)
        break
