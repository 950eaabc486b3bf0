"""matplotlib backend used inside jails (`MPLBACKEND=module://appliance.inside.appliance_mpl`).

Renders with Agg; `plt.show()` publishes every open figure as a `display` frame
(through the driver's `display` builtin) and closes it, as a notebook does.
"""

from __future__ import annotations

import builtins
from typing import Any

from matplotlib import _pylab_helpers
from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas

__all__ = ["FigureCanvas", "show"]


def show(*args: Any, **kwargs: Any) -> None:
    """Publish and close every open figure."""
    import matplotlib.pyplot as plt

    display = getattr(builtins, "display", None)
    for manager in _pylab_helpers.Gcf.get_all_fig_managers():
        if display is not None:
            display(manager.canvas.figure)
    plt.close("all")
