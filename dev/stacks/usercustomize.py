# Imported by every Python process started with this folder on PYTHONPATH (site's usercustomize
# hook), SGLang's scheduler and detokenizer included: SIGUSR2 then prints the process's every thread's
# stack to its stderr. dev/group_probe.py sends it to the engine's processes when a phase overruns.
import faulthandler
import signal

faulthandler.register(signal.SIGUSR2, all_threads=True)
