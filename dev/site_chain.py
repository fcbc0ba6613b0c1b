"""What a sitecustomize.py of dev/ runs last: the next sitecustomize.py after its own folder on sys.path (the
offline sglang site ships one), so that several of them chain. Picking the first one on the path that is not
one's own would make two that chain pick each other and skip the rest."""
import importlib.util
import os
import sys


def run_next(here: str) -> None:
    """Run the first sitecustomize.py in a folder after `here` on sys.path (folders compared by real path)."""
    here = os.path.realpath(here)
    folders = [os.path.realpath(entry or os.getcwd()) for entry in sys.path]
    for folder in folders[folders.index(here) + 1:] if here in folders else folders:
        path = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location(f"_sitecustomize_of_{len(sys.modules)}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return
