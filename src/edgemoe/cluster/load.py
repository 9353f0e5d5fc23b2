"""Reading a cluster: a YAML/TOML file or a preset name -> `Cluster`.

This module sits above `schema` (validation) and `presets` (preset files, the generator) so that the
imports inside cluster/ run one way: load -> presets -> schema -> hardware/radio/units. `presets` builds
its clusters through `schema.build_cluster`; only this module resolves a name to a preset.
"""

from __future__ import annotations

from pathlib import Path

from edgemoe.errors import EdgeMoEError
from edgemoe.io import loads_toml, loads_yaml, read_text

from .presets import PRESETS, preset_path
from .schema import Cluster, build_cluster


def read_cluster_file(path: str | Path) -> dict:
    """Parse a .yaml/.yml/.toml cluster file into a dict (no validation), through edgemoe.io's guarded
    reader (regular files only, size, nesting and integer limits)."""
    path = Path(path)
    text = read_text(path, "cluster file", ".yaml/.toml")
    data = loads_toml(text, str(path)) if path.suffix == ".toml" else loads_yaml(text, str(path))
    if not isinstance(data, dict):
        raise EdgeMoEError(f"{path}: a cluster file is a mapping with nodes, links and users")
    return data


def load_cluster(path_or_preset: str | Path) -> Cluster:
    """A Cluster from a file path (.yaml/.yml/.toml) or a preset name (see `edgemoe.cluster.presets`)."""
    name = str(path_or_preset)
    if name in PRESETS:
        return build_cluster(read_cluster_file(preset_path(name)), source=name)
    path = Path(path_or_preset)
    if not path.exists() and not path.is_symlink():
        raise EdgeMoEError(f"{name}: no such cluster file or preset; presets: {sorted(PRESETS)}")
    return build_cluster(read_cluster_file(path), source=str(path))
