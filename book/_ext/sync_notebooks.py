"""Copy ../notebooks/*.ipynb into book/notebooks/ before Sphinx reads its sources.

Sphinx only reads files under the book's directory, and a symlink would make the launch
buttons point at the symlink's path (which Colab cannot open). Copying keeps the
repository's notebooks/ the single source and the launch links pointing at it.
"""
import shutil
from pathlib import Path


def _sync(app, config):
    src = Path(app.srcdir).parent / "notebooks"
    dst = Path(app.srcdir) / "notebooks"
    dst.mkdir(exist_ok=True)
    wanted = {p.name for p in src.glob("[0-9][0-9]_*.ipynb")}
    for stale in dst.glob("*.ipynb"):
        if stale.name not in wanted:
            stale.unlink()
    for name in sorted(wanted):
        if not (dst / name).exists() or (dst / name).read_bytes() != (src / name).read_bytes():
            shutil.copyfile(src / name, dst / name)


def setup(app):
    app.connect("config-inited", _sync)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
