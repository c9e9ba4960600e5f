"""MkDocs hook: let mkdocstrings find `tfscale.strategies`, `.launch` and `.datasets`.

Those packages live in top-level folders and install under `tfscale.` through setuptools'
`package_dir` (DESIGN.md), which griffe's static finder cannot follow (it walks `tfscale/`).
This builds, in a temporary folder, a `tfscale/` of symlinks that puts them where Python
sees them, and gives that folder to the python handler as its search path.
"""

import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority

_REPO = Path(__file__).resolve().parents[2]
_MAPPED = ("strategies", "launch", "datasets")  # setup.cfg [options.package_dir]


def _tree():
    root = Path(tempfile.mkdtemp(prefix="tfscale-api-"))
    package = root / "tfscale"
    package.mkdir()
    for entry in (_REPO / "tfscale").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name in _MAPPED:
        (package / name).symlink_to(_REPO / name)
    return root


@event_priority(100)  # before mkdocstrings reads its handler options
def on_config(config):
    handler = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    handler["paths"] = [str(_tree())]
    return config
