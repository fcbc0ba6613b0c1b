"""Each figure's name and smallest text, written into the PNG it is rendered to, so the notebook
tests can check the figures a notebook shows (text >= 8 px) from the PNG bytes alone.

While `recording()` is on (in-process tests) or in a kernel started by `text_size_kernel.py` (the
notebook tests' kernelspec), every PNG matplotlib's Agg canvas renders carries two text chunks:
the figure's label (`fig.set_label`) and its smallest visible text in pixels at the PNG's own size.
Both ways a notebook shows a figure go through Agg's `print_png`: the inline backend's PNG formatter
(the user's, whatever its dpi or retina setting: the pixels are counted at the dpi it renders at)
and the step panel's image widget (`savefig`). The package itself stamps nothing."""
from __future__ import annotations

import functools
import io
import math
from contextlib import contextmanager

FIGURE = "lorabench-test:figure"
MIN_TEXT_PX = "lorabench-test:min_text_px"
_original_print_png = None


def smallest_text_pt(fig) -> float:
    """The smallest font size (pt) of any visible, non-empty text in `fig` (inf if none), tick labels
    included: asking for them makes them, as drawing does."""
    from matplotlib.text import Text
    for ax in fig.axes:
        ax.get_xticklabels(which="both"), ax.get_yticklabels(which="both")
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    return min(sizes, default=math.inf)


def _stamping(print_png):
    # functools.wraps keeps matplotlib's module and signature, so savefig passes on only the
    # keywords the original takes
    @functools.wraps(print_png)
    def print_png_stamped(self, filename_or_obj, *args, metadata=None, **kwargs):
        fig = self.figure   # savefig has set fig.dpi to the dpi it renders at
        stamp = {FIGURE: fig.get_label() or "", MIN_TEXT_PX: f"{smallest_text_pt(fig) * fig.dpi / 72:.2f}"}
        return print_png(self, filename_or_obj, *args, metadata={**(metadata or {}), **stamp}, **kwargs)
    return print_png_stamped


def start() -> None:
    """Stamp every PNG Agg renders from now on, in this process."""
    global _original_print_png
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    if _original_print_png is None:
        _original_print_png = FigureCanvasAgg.print_png
        FigureCanvasAgg.print_png = _stamping(_original_print_png)


def stop() -> None:
    global _original_print_png
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    if _original_print_png is not None:
        FigureCanvasAgg.print_png = _original_print_png
        _original_print_png = None


def load_ipython_extension(shell) -> None:
    """As an IPython extension (text_size_kernel.py): loaded after ipykernel has chosen the inline
    backend, before any cell runs."""
    start()


@contextmanager
def recording():
    start()
    try:
        yield
    finally:
        stop()


def png_text_info(png: bytes) -> dict:
    """What a stamped PNG says: {'figure': str, 'min_text_px': float | None} (None: not stamped)."""
    from PIL import Image
    info = Image.open(io.BytesIO(png)).info
    px = info.get(MIN_TEXT_PX)
    return {"figure": info.get(FIGURE, ""), "min_text_px": float(px) if px else None}
