"""The book, the notebooks and the README agree with each other and with pyproject.toml."""
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPO_URL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
OWNER_REPO = REPO_URL.removeprefix("https://github.com/")
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _cells(path):
    return json.loads(path.read_text())["cells"]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_conventions(nb):
    assert nb.stat().st_size < 1_000_000, "notebooks must stay under 1 MB"
    cells = _cells(nb)
    first = cells[0]
    assert first["cell_type"] == "code" and "nbval-skip" in first["metadata"].get("tags", [])
    src = "".join(first["source"])
    assert '"google.colab" in sys.modules' in src
    assert f"git+{REPO_URL}" in src, "install cell must use the repository URL of pyproject.toml"
    title = "".join(cells[1]["source"])
    assert title.startswith(f"# {nb.name[:2]} ·")
    badge = f"https://colab.research.google.com/github/{OWNER_REPO}/blob/main/notebooks/{nb.name}"
    assert badge in title, f"Colab badge must point at {badge}"
    assert "**You will learn**" in title
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    assert "## Takeaways" in text and "## Exercises" in text
    assert text.count("<summary>Answer</summary>") >= 2
    for c in cells:
        if c["cell_type"] == "code":
            code = "".join(c["source"])
            # library code is imported, never defined in a notebook at top level
            assert not re.search(r"^def \w+\(.*\):\n(?:    .*\n){25,}", code, re.M), "long function in a notebook"
        assert "execution" not in c["metadata"]
    assert "widgets" not in json.loads(nb.read_text())["metadata"]


def test_every_notebook_is_in_the_book_and_the_readme():
    toc = (ROOT / "book" / "_toc.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    for nb in NOTEBOOKS:
        assert f"file: notebooks/{nb.stem}" in toc, f"{nb.name} missing from book/_toc.yml"
        assert f"https://colab.research.google.com/github/{OWNER_REPO}/blob/main/notebooks/{nb.name}" in readme


def test_book_config_uses_the_repository_url():
    cfg = (ROOT / "book" / "_config.yml").read_text()
    assert f"url: {REPO_URL}" in cfg
    assert "colab_url: https://colab.research.google.com" in cfg
    assert 'execute_notebooks: "off"' in cfg


def test_every_repository_url_in_the_docs_is_the_same():
    found = set()
    for path in [ROOT / "README.md", ROOT / "book" / "intro.md", *NOTEBOOKS]:
        found |= set(re.findall(r"github\.com/([\w.-]+/[\w.-]+?)(?:/|\"|\)|\s|$)", path.read_text()))
    assert found == {OWNER_REPO}, found


def _readme_python_blocks():
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.parametrize("i", range(len(_readme_python_blocks())))
def test_readme_code_blocks_run(i, tmp_path):
    code = _readme_python_blocks()[i]
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr


def test_readme_states_the_supported_jax_range():
    """The range in pyproject.toml is the one the README promises (and dev.py tests both ends)."""
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (jax_dep,) = [d for d in deps if d.startswith("jax")]
    rng = jax_dep.removeprefix("jax").replace(" ", "")
    assert f"`{rng}`" in (ROOT / "README.md").read_text(), f"README must state JAX {rng}"


def test_dev_py_pins_the_newest_jax_that_installs(monkeypatch, capsys):
    """An index can hold a jax[tpu] release before the libtpu it pins: dev.py then pins the
    newest release that resolves rather than letting pip backtrack to a 2021 jax (which fails on
    its URL dependency, as CI did when jax 0.12.1 came out before libtpu 0.0.53)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("flashlab_dev", ROOT / ".ci" / "dev.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    monkeypatch.setattr(dev, "jax_range", lambda: ("0.7.0", "0.13"))
    asked = []

    def fake_run(cmd, **kw):
        asked.append(cmd[3:])
        if cmd[3:5] == ["index", "versions"]:
            out = "jax (0.13.0)\nAvailable versions: 0.13.0, 0.12.1, 0.12.0.1, 0.6.2\n"
            return subprocess.CompletedProcess(cmd, 0, out, "")
        ok = cmd[-1] != "jax[tpu]==0.12.1"
        err = "" if ok else "ERROR: No matching distribution found for libtpu==0.0.53.*"
        return subprocess.CompletedProcess(cmd, 0 if ok else 1, "", err)
    monkeypatch.setattr(dev.subprocess, "run", fake_run)
    assert dev.installable_jax_tpu("python") == "jax[tpu]==0.12.0.1"
    assert [a[-1] for a in asked[1:]] == ["jax[tpu]==0.12.1", "jax[tpu]==0.12.0.1"]
    assert "libtpu==0.0.53" in capsys.readouterr().out
    assert dev._version("0.12.0rc1") is None and dev._version("0.12.0.1") == (0, 12, 0, 1)


def test_every_public_callable_is_on_the_api_page():
    """``book/api.md`` documents (autodoc) every function/class of ``flashlab.__all__`` and of
    ``flashlab.models.__all__``, and the page is in the book."""
    import flashlab
    page = (ROOT / "book" / "api.md").read_text()
    assert "file: api" in (ROOT / "book" / "_toc.yml").read_text()
    missing = [n for n in flashlab.__all__
               if callable(getattr(flashlab, n))
               and not re.search(rf"^\.\. auto(function|class):: flashlab\.{n}$", page, re.M)]
    assert not missing, f"not on book/api.md: {missing}"
    pytest.importorskip("flax")
    import flashlab.models as models
    missing = [n for n in models.__all__ if callable(getattr(models, n))
               and not re.search(rf"^\.\. auto(function|class):: flashlab\.models\.{n}$", page, re.M)]
    assert not missing, f"not on book/api.md: {missing}"
