"""napari plugin for gpulazy (package skeleton; the reader and dock widget come later).

Kept free of Qt imports so that ``import napari_gpulazy`` is cheap and headless-safe.
"""
