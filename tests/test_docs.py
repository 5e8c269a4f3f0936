"""The documentation: the site builds with `mkdocs build --strict` (every page, API reference
and notebook; a broken link or reference fails), and every Python example in the README and
the docs pages runs as written.

Each Markdown file's ```python blocks run in order in one namespace (a page is read top to
bottom), in a temporary working directory, with Keras' global settings restored afterwards.
Examples train on the bundled toy data or scikit-learn's small data sets. Here `fit` runs at
most `EXAMPLE_EPOCHS` of the epochs an example asks for: the test proves that every example
runs as written (every call, argument and printed shape); what they print at their full
budget is what the benchmarks measure (BENCHMARKS.md).
"""

import glob
import inspect
import os
import re
import subprocess
import sys

import keras
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
)
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
#: The most epochs `fit` runs in an example under test (`test_examples_run`).
EXAMPLE_EPOCHS = 1


def python_blocks(page):
    """`[(line, code)]` of the ```python blocks of a Markdown file (line: where the code starts)."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in FENCE.finditer(text)]


def test_every_page_with_examples_is_found():
    assert len(PAGES) > 20 and "docs/getting-started.md" in PAGES
    assert all(python_blocks(page) for page in ("README.md", "docs/getting-started.md", "docs/guide/layers.md"))


@pytest.fixture
def keras_settings():
    """Restores the global settings an example may change (the image data format; the float
    type and dtype policy are restored by `conftest.py`)."""
    data_format = keras.config.image_data_format()
    yield
    keras.config.set_image_data_format(data_format)


@pytest.mark.heavy
@pytest.mark.parametrize("page", [page for page in PAGES if python_blocks(page)])
def test_examples_run(page, tmp_path, monkeypatch, keras_settings):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    fit = keras.Model.fit
    signature = inspect.signature(fit)

    def short_fit(*args, **kwargs):  # the example's own call, with at most EXAMPLE_EPOCHS epochs
        bound = signature.bind(*args, **kwargs)
        bound.arguments["epochs"] = min(bound.arguments.get("epochs", 1), EXAMPLE_EPOCHS)
        return fit(*bound.args, **bound.kwargs)

    monkeypatch.setattr(keras.Model, "fit", short_fit)
    namespace = {"__name__": "__docs__"}
    for line, code in python_blocks(page):
        exec(compile(code, f"{page}:{line}", "exec"), namespace)  # noqa: S102 - the page's own code


@pytest.mark.heavy
def test_site_builds_strictly(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert os.path.exists(tmp_path / "site" / "api" / "dense" / "index.html")
    assert os.path.exists(tmp_path / "site" / "notebooks" / "06_bayesian_cnn_mnist" / "index.html")
    _check_api_reference(tmp_path / "site")


#: What Python's built-in types say of themselves: a constant or flag documented by inspection.
BUILTIN_DOCSTRINGS = ("Built-in immutable sequence", "Built-in mutable sequence", "Convert a string or number",
                      "Returns True when the argument", "str(object=", "int([x])", "Create a new dictionary")


def _check_api_reference(site):
    """The API reference tells the truth: docstring examples render as code (not as the nested
    block quotes that `>>>` lines at the section's indent become), no argument with a default
    is marked required, no constant shows its type's docstring, no object is documented twice,
    long signatures wrap, and the maths renders offline (MathJax served with the site)."""
    pages = sorted(glob.glob(str(site / "api" / "*" / "index.html")))
    assert pages
    for page in pages:
        with open(page) as f:
            html = f.read()
        name = os.path.basename(os.path.dirname(page))
        assert "<blockquote>" not in html, f"{name}: an example renders as a block quote"
        assert '<span class="gp">&gt;&gt;&gt; </span>' in html or name in ("index", "maths"), f"{name}: no example"
        assert not [text for text in BUILTIN_DOCSTRINGS if text in html], name
        assert "<code>required</code>" not in html and "<em>required</em>" not in html, name
    with open(site / "api" / "dense" / "index.html") as f:  # arguments passed on in **kwargs show their defaults
        dense = re.sub(r"<[^>]+>", "", f.read())
    assert "use_bias=True" in dense and "regularizer=None" in dense
    objects = {}
    for page in pages:
        with open(page) as f:
            for anchor in re.findall(r'<h[23] id="(keras_dvi\.[\w.]+)"', f.read()):
                objects.setdefault(_canonical(anchor), []).append((anchor, os.path.basename(os.path.dirname(page))))
    twice = {key: found for key, found in objects.items() if len(found) > 1}
    assert not twice, twice
    with open(site / "index.html") as f:
        home = f.read()
    assert "javascripts/mathjax/tex-svg.js" in home and "unpkg.com" not in home and "cdn.jsdelivr" not in home
    assert os.path.getsize(site / "javascripts" / "mathjax" / "tex-svg.js") > 1_000_000
    with open(site / "stylesheets" / "extra.css") as f:
        assert "pre-wrap" in f.read()


def _canonical(anchor):
    """The object an API anchor documents (`keras_dvi.layers.DenseDVI` and
    `keras_dvi.layers.dense_dvi.DenseDVI` are one object)."""
    import importlib

    parts = anchor.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            value = getattr(value, part, None)
        if value is None or isinstance(value, (int, float, str, bool)):
            return anchor
        owner = getattr(value, "__module__", None)
        qualname = getattr(value, "__qualname__", None)
        return f"{owner}.{qualname}" if owner and qualname else anchor
    return anchor


def test_the_api_reference_covers_every_public_name():
    """Every class and function `keras_dvi` exports has an entry (`::: path.Name`) in the API
    reference, or is documented with its module there."""
    import keras_dvi

    text = ""
    for path in glob.glob(os.path.join(ROOT, "docs", "api", "*.md")):
        with open(path) as f:
            text += f.read()
    entries = set(re.findall(r"^::: ([\w.]+)", text, re.M))
    names = {entry.rsplit(".", 1)[-1] for entry in entries}
    missing = []
    for name in keras_dvi.__all__:
        value = getattr(keras_dvi, name, None)
        if name.startswith("__") or isinstance(value, type(keras_dvi)):  # modules: their page lists members
            continue
        if name not in names:
            missing.append(name)
    assert not missing, missing
