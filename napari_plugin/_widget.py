"""The dock widget: backend, throughput, cache and memory of gpulazy, with prefetch controls.

The only module of the plugin that imports Qt. Its figures are those of the Jupyter
dashboard (``gpulazy.widgets.dashboard_figures``, ``sparkline_svg``, ``gpu_info``),
refreshed by a ``QTimer`` on the GUI thread; it only reads recorded statistics.
Controls: planes to warm ahead (the viewer's motion prefetch depth) and the default
device cache's capacity (``gpulazy.config`` ``cache``).
"""

from __future__ import annotations

from typing import Any

from qtpy.QtCore import QByteArray, QTimer
try:  # Qt 6 (napari's default binding) moved the SVG widget into QtSvgWidgets
    from qtpy.QtSvgWidgets import QSvgWidget
except ImportError:  # Qt 5
    from qtpy.QtSvg import QSvgWidget
from qtpy.QtWidgets import (QFormLayout, QHBoxLayout, QLabel, QLineEdit, QProgressBar, QPushButton, QSpinBox,
                            QVBoxLayout, QWidget)

import gpulazy
from gpulazy.widgets import dashboard_figures, format_bytes, gpu_info, sparkline_svg

__all__ = ["GpulazyWidget"]

_BAR_STEPS = 1000


class GpulazyWidget(QWidget):
    """gpulazy's live figures for one napari viewer.

    Parameters
    ----------
    napari_viewer
        The viewer (npe2 passes it); its gpulazy layers say which device and cache to show,
        and its motion prefetch (``napari_gpulazy.attach``) gets the depth control.
    interval_ms
        Refresh period; ``0`` refreshes only when ``refresh()`` is called.
    """

    def __init__(self, napari_viewer: Any = None, *, interval_ms: int = 500):
        super().__init__()
        from napari_gpulazy._hook import attach

        self.viewer = napari_viewer
        self.hook = attach(napari_viewer) if napari_viewer is not None else None
        self.figures: dict[str, Any] = {}
        self.last_error: str | None = None
        self._build()
        self.refresh()
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.refresh)
        if interval_ms:
            self.timer.start(int(interval_ms))

    # -- layout ----------------------------------------------------------------------------
    def _build(self) -> None:
        box = QVBoxLayout(self)
        self.backend_label = self._label(box)
        self.modes_label = self._label(box)
        self.sparkline = QSvgWidget()
        self.sparkline.setFixedHeight(70)
        self.sparkline.setMinimumWidth(200)
        box.addWidget(self.sparkline)
        self.throughput_label = self._label(box)
        self.cache_bar, self.cache_label = self._bar(box, "cache")
        self.prefetch_label = self._label(box)
        self.memory_bar, self.memory_label = self._bar(box, "memory")
        form = QFormLayout()
        self.depth_spin = QSpinBox()
        self.depth_spin.setRange(0, 4096)
        self.depth_spin.setValue(self._depth())
        self.depth_spin.setToolTip("planes to warm ahead of the slider (more when it moves fast; "
                                   "at most half the cache either way)")
        self.depth_spin.valueChanged.connect(self.set_depth)
        form.addRow("prefetch depth (planes)", self.depth_spin)
        row = QHBoxLayout()
        self.capacity_edit = QLineEdit(_capacity_text(gpulazy.config.get("cache")))
        self.capacity_edit.setToolTip("default device cache: '8 GiB', '25%' of free memory, or 0 for none")
        self.capacity_button = QPushButton("apply")
        self.capacity_button.clicked.connect(lambda: self.set_capacity(self.capacity_edit.text()))
        self.capacity_edit.returnPressed.connect(lambda: self.set_capacity(self.capacity_edit.text()))
        row.addWidget(self.capacity_edit)
        row.addWidget(self.capacity_button)
        form.addRow("cache capacity", row)
        box.addLayout(form)
        self.status_label = self._label(box)
        box.addStretch(1)

    @staticmethod
    def _label(box: QVBoxLayout) -> QLabel:
        label = QLabel()
        label.setWordWrap(True)
        box.addWidget(label)
        return label

    def _bar(self, box: QVBoxLayout, name: str) -> tuple[QProgressBar, QLabel]:
        bar = QProgressBar()
        bar.setRange(0, _BAR_STEPS)
        bar.setFormat(f"{name} %p%")
        box.addWidget(bar)
        return bar, self._label(box)

    # -- controls --------------------------------------------------------------------------
    def _depth(self) -> int:
        if self.hook is not None and self.hook.depth is not None:
            return int(self.hook.depth)
        return int(gpulazy.config.get("prefetch_depth"))

    def set_depth(self, planes: int) -> None:
        """Planes the viewer's motion prefetch warms ahead."""
        if self.hook is not None:
            self.hook.depth = int(planes)
        if self.depth_spin.value() != planes:
            self.depth_spin.setValue(int(planes))

    def set_capacity(self, text: str) -> bool:
        """Set the default device cache's capacity (``config`` ``cache``); False and a message if invalid."""
        try:
            gpulazy.config.set(cache=text.strip())
        except Exception as e:
            self.status_label.setText(f"cache capacity not changed: {e}")
            return False
        self.status_label.setText(f"cache capacity set to {_capacity_text(gpulazy.config.get('cache'))}")
        self.refresh()
        return True

    # -- figures -----------------------------------------------------------------------------
    def _source(self) -> Any:
        """The chunk source of the viewer's first gpulazy layer (device and cache), or None."""
        from napari_gpulazy._view import HostView

        for layer in getattr(self.viewer, "layers", []):
            views = list(layer.data) if getattr(layer, "multiscale", False) else [layer.data]
            for v in views:
                if isinstance(v, HostView) and v.target is not None:
                    return v.target.chunk_source
        return None

    def read_figures(self) -> dict[str, Any]:
        stats = gpulazy.stats()
        snapshot = stats.snapshot()
        source = self._source()
        cache = source.cache_instance() if source is not None else None
        device = source.device if source is not None else snapshot.get("last_device")
        f = dashboard_figures(snapshot, cache.stats() if cache is not None else None, gpu_info(device),
                              history=stats.history(1.0))
        f["window"] = stats.window
        f["motion"] = self.hook.totals() if self.hook is not None else None
        return f

    def refresh(self) -> bool:
        """Read the figures and show them; False (and ``last_error`` shown) if that failed."""
        try:
            f = self.read_figures()
            self._show(f)
        except Exception as e:  # a display must never take the viewer down
            self.last_error = f"{type(e).__name__}: {e}"
            self.status_label.setText(f"refresh failed: {self.last_error}")
            return False
        self.figures = f
        return True

    def _show(self, f: dict[str, Any]) -> None:
        t = f["text"]
        self.backend_label.setText(t["backend"])
        self.modes_label.setText(t["modes"])
        self.sparkline.load(QByteArray(sparkline_svg(f["series"], seconds=f["window"]).encode()))
        self.throughput_label.setText(t["throughput"])
        cache = f["cache"]
        self.cache_bar.setValue(int(_BAR_STEPS * cache["occupancy"]) if cache else 0)
        self.cache_label.setText(t["cache"])
        motion = f["motion"]
        text = t["queue"]
        if motion is not None:
            text += (f" · slider: {motion['events']} steps, {motion['jumps']} jumps, "
                     f"{motion['issued']} chunks warmed, {motion['cancelled']} cancelled")
        self.prefetch_label.setText(text)
        self.memory_bar.setValue(int(_BAR_STEPS * f["memory"]["fraction"]))
        self.memory_label.setText(t["memory"])


def _capacity_text(value: Any) -> str:
    """The config value as a person writes it: ``"25%"``, ``"256.0 MiB"``, ``"off"``."""
    if value is False:
        return "off"
    return format_bytes(value) if isinstance(value, int) else str(value)
