"""Figures for a tracker that never cost it its scalars.

A tracker sink draws its figures through :class:`FigureGuard`: a figure that cannot be drawn (matplotlib
or pillow not installed, a drawing error) is left out of that delivery with one warning per figure, and
the scalars and tables of the gate still go out.

Example:
    >>> import warnings
    >>> guard = FigureGuard("wandb")
    >>> def broken():
    ...     raise ModuleNotFoundError("No module named 'matplotlib'")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     first, second = guard.draw("C2 heatmap", broken), guard.draw("C2 heatmap", broken)
    >>> first, second, len(caught)
    (None, None, 1)
    >>> str(caught[0].message).split(";")[0]
    "atlas: wandb left out the C2 heatmap figure (ModuleNotFoundError: No module named 'matplotlib')"
    >>> guard.draw("C2 heatmap", lambda: "png")
    'png'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from atlas_tracking.sinks.delivery import warn_operator

T = TypeVar("T")


class FigureGuard:
    """Draw one tracker's figures; a failure is a warning (once per figure), never a failed delivery."""

    def __init__(self, sink_name: str, warn: Callable[[str], None] = warn_operator):
        self.sink_name, self.warn = sink_name, warn
        self._warned: set[str] = set()

    def draw(self, figure: str, make: Callable[[], T]) -> T | None:
        """``make()``, or None (and a warning the first time for ``figure``) when it raises."""
        try:
            return make()
        except Exception as exc:  # a figure must never keep the scalars from the tracker
            if figure not in self._warned:
                self._warned.add(figure)
                self.warn(f"atlas: {self.sink_name} left out the {figure} figure ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); the scalars and tables of each gate are still delivered")
            return None
