"""Open a volume in napari from Python through gpulazy: lazy, GPU-cached, prefetched as you scroll.

    python notebooks/napari_open.py scan.npy            # any file or folder gpulazy opens
    python notebooks/napari_open.py                     # the generated sample volume
    python notebooks/napari_open.py --screenshot docs/napari.png --steps 40   # scripted, then quit

The volume opens instantly (nothing is read until a plane is shown). Scroll the z slider:
the gpulazy dock widget (right) shows read throughput, cache occupancy and hit rate, and
the chunks warmed ahead of the slider. Without a GPU the same runs on the host.
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", nargs="?", help="a file or folder (default: the generated sample volume)")
    ap.add_argument("--device", default=None, help="'cpu' or 'cuda:N' (default: a GPU when usable)")
    ap.add_argument("--steps", type=int, default=0, help="step the slider this many planes at 20 planes/s")
    ap.add_argument("--screenshot", default=None, help="save a screenshot of the window here, then quit")
    args = ap.parse_args(argv)

    import napari

    import napari_gpulazy
    from napari_gpulazy._sample import write_sample_volume
    from napari_gpulazy._widget import GpulazyWidget

    if args.screenshot:  # a scripted run: no toast over the canvas for napari's own warnings
        from napari.settings import get_settings

        get_settings().application.gui_notification_level = "error"
    viewer = napari.Viewer(title="gpulazy")
    path = args.path or write_sample_volume()
    # The plugin's reader, as File > Open would use it; read_layers takes gpulazy's options.
    for data, kwargs, kind in napari_gpulazy.read_layers(path, device=args.device):
        viewer.add_layer(napari.layers.Layer.create(data, kwargs, kind))
    napari_gpulazy.attach(viewer)  # motion-aware prefetch (the reader does it for File > Open)
    viewer.window.add_dock_widget(GpulazyWidget(viewer), name="gpulazy", area="right")

    if args.steps:
        start = viewer.dims.current_step[0]
        for z in range(start, min(start + args.steps, viewer.dims.nsteps[0])):
            viewer.dims.set_current_step(0, z)
            napari.qt.get_qapp().processEvents()
            time.sleep(0.05)
    if args.screenshot:
        viewer.window._qt_window.resize(1280, 720)
        napari.qt.get_qapp().processEvents()
        viewer.screenshot(args.screenshot, canvas_only=False, flash=False)
        print(f"saved {args.screenshot}")
        viewer.close()
        return
    napari.run()


if __name__ == "__main__":
    main()
