# Imported by every Python process started with this folder first on PYTHONPATH (site's sitecustomize
# hook, which runs in a venv too, where usercustomize does not), SGLang's scheduler and detokenizer
# included: SIGUSR2 then prints the process's every thread's stack to its stderr. benchmarks/watch.py
# sends it to the engine's processes when a phase overruns. This file shadows any later
# sitecustomize.py on the path (the offline sglang site ships one), so it runs the next one after its
# folder (dev/site_chain.py).
import faulthandler
import importlib.util
import os
import signal

faulthandler.register(signal.SIGUSR2, all_threads=True)

_HERE = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("_dev_site_chain", os.path.join(os.path.dirname(_HERE), "site_chain.py"))
_chain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_chain)
_chain.run_next(_HERE)
