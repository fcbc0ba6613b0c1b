"""The notebook tests' record of each figure's name and smallest text (tests/figure_text_size.py):
in the PNG as rendered, at the dpi it is rendered at, through savefig and through IPython's PNG
formatter; and nothing recorded once it is stopped."""
import io

import pytest
from figure_text_size import png_text_info, recording, smallest_text_pt
from IPython.core.pylabtools import print_figure
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


@pytest.fixture
def figure():
    fig = Figure(figsize=(3, 2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1])
    ax.set_title("title", fontsize=12)
    ax.set_xlabel("smallest", fontsize=7)
    ax.set_ylabel("", fontsize=3)   # empty: not text a reader sees
    fig.set_label("a_figure")
    return fig


def saved(fig, **kwargs) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **kwargs)
    return buffer.getvalue()


def test_smallest_visible_text_in_points(figure):
    assert smallest_text_pt(figure) == 7
    figure.axes[0].xaxis.label.set_visible(False)
    assert smallest_text_pt(figure) == 10        # then the tick labels (matplotlib's default size)


@pytest.mark.parametrize("dpi", [50, 100, 250])
def test_recorded_in_pixels_at_the_dpi_rendered_at(figure, dpi):
    with recording():
        info = png_text_info(saved(figure, dpi=dpi, bbox_inches="tight"))
    assert info == {"figure": "a_figure", "min_text_px": pytest.approx(7 * dpi / 72, abs=0.01)}
    assert figure.dpi == 100                     # savefig put the figure's own dpi back


def test_recorded_through_ipythons_png_formatter(figure):
    """The inline backend's formatter renders with print_figure (png at the figure's dpi, retina at
    twice it); the metadata savefig is given survives next to the record."""
    with recording():
        png, retina = print_figure(figure, "png"), print_figure(figure, "retina")
        own = saved(figure, metadata={"Title": "kept"})
    assert png_text_info(png)["min_text_px"] == pytest.approx(7 * 100 / 72, abs=0.01)
    assert png_text_info(retina)["min_text_px"] == pytest.approx(2 * 7 * 100 / 72, abs=0.01)
    from PIL import Image
    assert Image.open(io.BytesIO(own)).info["Title"] == "kept" and png_text_info(own)["figure"] == "a_figure"


def test_nothing_recorded_outside(figure):
    with recording():
        pass
    assert png_text_info(saved(figure)) == {"figure": "", "min_text_px": None}
