"""The installed-packages corpus (experiments/lib/data/packages.py): dedup by content, split by package, byte cap,
file filter, bad settings; and that the real site-packages gives a corpus many times the stdlib's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from experiments.lib.data import packages as P
from experiments.lib.data.pipeline import prepare_data
from experiments.lib.data.sources import stdlib_files


def _code(name: str, n: int) -> str:
    return "".join(f"def {name}_{j}(x):\n    return x * {j} + len({name!r})  # {name}\n\n" for j in range(n))


def _site(root: Path) -> Path:
    """A small site-packages: packages of different sizes, a single-file module, a vendored duplicate,
    an empty file, caches, hidden directories and files that are not .py."""
    for package, files, size in (("alpha", 6, 30), ("beta", 3, 20), ("gamma", 2, 10), ("delta", 4, 25)):
        for i in range(files):
            path = root / package / ("sub" if i % 2 else "") / f"m{i}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_code(f"{package}{i}", size))
    (root / "single.py").write_text(_code("single", 15))
    (root / "beta" / "_vendor").mkdir()
    (root / "beta" / "_vendor" / "copy.py").write_text((root / "alpha" / "m0.py").read_text())  # a vendored copy
    (root / "alpha" / "__init__.py").write_text("")
    for skipped in ("__pycache__", ".hidden"):
        (root / "alpha" / skipped).mkdir()
        (root / "alpha" / skipped / "x.py").write_text(_code("skipped", 5))
    (root / "alpha" / "data.json").write_text(json.dumps({"not": "code"}))
    (root / "alpha" / "stub.pyi").write_text("def f() -> int: ...\n")
    return root


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return _site(tmp_path_factory.mktemp("site"))


def _prepare(site: Path, cache: Path, **kwargs):
    return prepare_data(source="packages", paths=[str(site)], vocab_size=300, cache_dir=str(cache), **kwargs)


def _meta(data, cache: Path) -> dict:
    return json.loads((cache / data.cache_key / "meta.json").read_text())


def test_package_of():
    assert P.package_of("torch/nn/modules/linear.py") == "torch"
    assert P.package_of("six.py") == "six"
    assert P.package_of("typing_extensions.py") == "typing_extensions"
    assert P.package_of("pkg.py/inner.py") == "pkg.py"  # a directory is a package whatever its name


def test_files_are_python_deduplicated_and_never_cached_or_hidden(site):
    ids = [doc_id for doc_id, _ in P.package_files(site)]
    assert ids == sorted(ids)
    assert all(doc_id.endswith(".py") for doc_id in ids)
    assert "beta/_vendor/copy.py" not in ids and "alpha/m0.py" in ids  # the first in sorted order keeps it
    assert "alpha/__init__.py" not in ids  # empty
    assert not any("__pycache__" in d or ".hidden" in d for d in ids)
    contents = [Path(site, d).read_bytes() for d in ids]
    assert len({hashlib.sha1(c).digest() for c in contents}) == len(contents)
    stubs = [d for d, _ in P.package_files(site, include=("*.pyi",))]
    assert stubs == ["alpha/stub.pyi"]


def test_split_holds_whole_packages_within_the_fraction(site, tmp_path):
    data = _prepare(site, tmp_path, val_fraction=0.3)
    meta = _meta(data, tmp_path)
    train = {P.package_of(d) for d in meta["train_files"]}
    val = {P.package_of(d) for d in data.val_files}
    assert train and val and not train & val  # no package on both sides
    assert meta["val_bytes"] <= 0.3 * (meta["train_bytes"] + meta["val_bytes"])
    assert meta["split_rule"] == P.PACKAGE_SPLIT_RULE
    # The documented rule, reproduced independently: sha1(name) order, skip what would overflow.
    sizes: dict[str, int] = {}
    for d in meta["train_files"] + data.val_files:
        sizes[P.package_of(d)] = sizes.get(P.package_of(d), 0) + len(Path(site, d).read_bytes())
    budget, expected, taken = 0.3 * sum(sizes.values()), set(), 0
    for name in sorted(sizes, key=lambda n: int(hashlib.sha1(n.encode()).hexdigest(), 16)):
        if taken + sizes[name] <= budget:
            expected.add(name)
            taken += sizes[name]
    assert val == expected


def test_a_fraction_no_package_fits_still_holds_one_out():
    ids = ["big/a.py", "big/b.py", "small/c.py", "mid.py"]
    train, val = P.split_by_package(ids, [1000, 1000, 50, 300], val_fraction=0.01)
    assert [ids[i] for i in val] == ["small/c.py"] and len(train) == 3


def test_one_package_cannot_be_split():
    with pytest.raises(ValueError, match="1 top-level package"):
        P.split_by_package(["only/a.py", "only/b.py"], [10, 10], 0.5)


def test_max_bytes_caps_the_corpus_over_every_package(site, tmp_path):
    whole = P.package_files(site)
    total = sum(len(Path(p).read_bytes()) for _, p in whole)
    capped = P.package_files(site, max_bytes=total // 2)
    size = sum(len(Path(p).read_bytes()) for _, p in capped)
    assert 0 < size <= total // 2 and len(capped) < len(whole)
    assert [d for d, _ in capped] == sorted(d for d, _ in capped)
    assert len({P.package_of(d) for d, _ in capped}) >= 3  # spread, not the first packages alphabetically
    a, b = _prepare(site, tmp_path), _prepare(site, tmp_path, max_bytes=total // 2)
    assert a.cache_key != b.cache_key and b.train_ids.numel() < a.train_ids.numel()


def test_tokens_decode_back_to_the_held_out_packages(site, tmp_path):
    data = _prepare(site, tmp_path, val_fraction=0.3)
    text = data.tokenizer.decode(data.val_ids.long().tolist(), skip_special_tokens=False)
    for doc_id in data.val_files:
        assert Path(site, doc_id).read_text() in text
    again = _prepare(site, tmp_path, val_fraction=0.3)  # a cache hit
    assert again.cache_key == data.cache_key and again.val_files == data.val_files


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(source="stdlib", max_bytes=100), "are for source='packages'"),
        (dict(source="stdlib", include=["*.py"]), "are for source='packages'"),
        (dict(source="packages", paths=["a", "b"]), "one directory"),
        (dict(source="packages", include="*.py"), "include='\\*.py' must be a non-empty list"),
        (dict(source="packages", include=[]), "must be a non-empty list"),
        (dict(source="packages", max_bytes=0), "max_bytes=0 must be a positive integer"),
        (dict(source="packages", max_bytes=True), "max_bytes=True"),
        (dict(source="packages", paths=["/nonexistent/site"]), "is not a directory"),
        (dict(source="packages", include=["*.nothing"]), "matches include"),
    ],
)
def test_bad_settings_are_refused_in_one_line(kwargs, named, site, tmp_path):
    if kwargs.get("paths") is None and kwargs["source"] == "packages":
        kwargs = {**kwargs, "paths": [str(site)]}
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=named) as info:
        prepare_data(cache_dir=str(cache), **kwargs)
    assert "\n" not in str(info.value)
    assert not cache.exists()  # nothing written


def test_the_installed_packages_are_many_times_the_stdlib():
    """The default root is this interpreter's site-packages (the project's .venv under make): listing it
    (file sizes, without reading or deduplicating) must find far more Python source than the stdlib holds."""
    files = P._matching_files(P.site_packages(), P.INCLUDE)
    packages = {P.package_of(d) for d, _ in files}
    size = sum(Path(p).stat().st_size for _, p in files)
    stdlib = sum(p.stat().st_size for p in stdlib_files())
    assert len(packages) >= 20 and size >= 5 * stdlib
