"""The kernel the notebook tests start (notebook_helpers.write_kernelspec): ipykernel as
`python -m ipykernel_launcher` starts it, plus the extension figure_text_size, which stamps every
PNG matplotlib renders with its figure's name and smallest text. The notebook's own code sees a
plain kernel: this folder is taken off sys.path again before the kernel starts."""
import sys

if __name__ == "__main__":
    # sys.path[0] is this file's folder while Python starts it; the module imports no matplotlib
    # (ipykernel picks the inline backend before matplotlib is imported)
    import figure_text_size  # noqa: F401  (found by the extension loader in sys.modules)

    del sys.path[0]
    from ipykernel import kernelapp

    kernelapp.IPKernelApp.launch_instance(extensions=["figure_text_size"])
