"""OME-Zarr (NGFF 0.4 and 0.5) ``multiscales``: the pyramid's arrays and their physical axes.

NGFF 0.4 keeps ``multiscales`` in a Zarr v2 group's attributes; 0.5 keeps it under
``attributes["ome"]`` of a Zarr v3 group. Each dataset (level) has a ``path`` and
``coordinateTransformations`` (a ``scale``, optionally a ``translation``); the
multiscale's own transformations apply after them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from gpulazy.errors import LayoutError

__all__ = ["Level", "multiscale_levels", "find_multiscales"]


@dataclass(frozen=True)
class Level:
    """One resolution level: its array path in the group and what ``Index.attrs`` gets."""

    path: str
    attrs: Mapping[str, Any]


def find_multiscales(attrs: Mapping[str, Any]) -> list | None:
    """The ``multiscales`` list of a group's attributes (0.5 under ``ome``, 0.4 at the top)."""
    ome = attrs.get("ome")
    if isinstance(ome, Mapping) and "multiscales" in ome:
        return ome["multiscales"]
    return attrs.get("multiscales")


def multiscale_levels(attrs: Mapping[str, Any], where: str) -> list[Level] | None:
    """The levels of the first multiscale in a group's ``attrs``; ``None`` if it has none.

    ``where`` (the group's metadata file) names the file in a ``LayoutError`` for
    malformed metadata.
    """
    ms = find_multiscales(attrs)
    if ms is None:
        return None
    try:
        return _levels(ms[0], _version(attrs, ms[0]))
    except LayoutError as e:
        raise LayoutError(f"{where!r}: {e}") from e
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise LayoutError(f"{where!r}: malformed OME-Zarr multiscales metadata: {type(e).__name__}: {e}") from e


def _version(attrs: Mapping[str, Any], ms: Mapping[str, Any]) -> str | None:
    ome = attrs.get("ome")
    if isinstance(ome, Mapping) and ome.get("version"):
        return str(ome["version"])
    v = ms.get("version")
    return str(v) if v is not None else None


def _levels(ms: Mapping[str, Any], version: str | None) -> list[Level]:
    datasets = ms["datasets"]
    if not datasets:
        raise LayoutError("the multiscale lists no datasets")
    names, units = _axes(ms.get("axes"))
    outer = _transforms(ms.get("coordinateTransformations"))
    levels = []
    for ds in datasets:
        scale, trans = _transforms(ds.get("coordinateTransformations"))
        scale, trans = _compose((scale, trans), outer)
        attrs: dict[str, Any] = {"multiscale_path": str(ds["path"])}
        if version is not None:
            attrs["ngff_version"] = version
        if ms.get("name") is not None:
            attrs["name"] = str(ms["name"])
        if names is not None:
            attrs["axes"] = names
        if units is not None:
            attrs["units"] = units
        if scale is not None:
            attrs["scale"] = scale
        if trans is not None:
            attrs["translation"] = trans
        levels.append(Level(str(ds["path"]), attrs))
    return levels


def _axes(axes: Sequence[Any] | None) -> tuple[tuple[str, ...] | None, tuple[str | None, ...] | None]:
    if not axes:
        return None, None
    if all(isinstance(a, str) for a in axes):  # NGFF 0.3: plain names
        return tuple(axes), None
    names = tuple(str(a["name"]) for a in axes)
    units = tuple(a.get("unit") for a in axes)
    return names, (units if any(u is not None for u in units) else None)


def _transforms(ts: Sequence[Mapping[str, Any]] | None) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    scale = trans = None
    for t in ts or ():
        kind = t.get("type")
        if kind == "scale" and "scale" in t:
            scale = tuple(float(x) for x in t["scale"])
        elif kind == "translation" and "translation" in t:
            trans = tuple(float(x) for x in t["translation"])
        elif kind not in ("identity", "scale", "translation"):
            raise LayoutError(f"coordinate transformation {kind!r} is not one NGFF defines for multiscales")
    return scale, trans


def _compose(inner: tuple, outer: tuple) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    # x = s_o * (s_i * i + t_i) + t_o  ->  scale s_o*s_i, translation s_o*t_i + t_o
    (si, ti), (so, to) = inner, outer
    if so is None and to is None:
        return si, ti
    n = len(next(v for v in (si, ti, so, to) if v is not None))
    one, zero = (1.0,) * n, (0.0,) * n
    si2, ti2, so2, to2 = si or one, ti or zero, so or one, to or zero
    scale = tuple(a * b for a, b in zip(so2, si2))
    trans = tuple(a * b + c for a, b, c in zip(so2, ti2, to2))
    return scale, (trans if (ti is not None or to is not None) else None)
