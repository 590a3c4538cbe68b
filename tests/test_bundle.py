"""tools/bundle.py: submission.py is what the package makes, the leaderboard adapter and every module it imports in
import order; subpackage modules are inlined under banners naming their real paths, with the package's relative
imports (of any level) dropped; a name two modules define, or one a module imports before any module defines it (an
import cycle), is refused."""

import ast

import pytest

from tools import bundle as B


def test_submission_is_the_bundle_with_every_module_bannered():
    text = B.bundle()
    assert B.TARGET.read_text() == text, "submission.py is stale: run `make bundle`"
    order = B.import_order()
    assert order[-1] == "leaderboard" and {"backends", "aiter_backend", "torch_backend", "triton/decode"} <= set(order)
    assert order.index("triton/common") < order.index("aiter_backend") < order.index("backends")
    for name in order:
        assert f"\n# mla_decode/{name}.py\n" in text, name
    relative = [n for n in ast.parse(text).body if isinstance(n, ast.ImportFrom) and n.level]
    assert relative == []


def _package(tmp_path, monkeypatch, files: dict, entry: str):
    for path, source in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    monkeypatch.setattr(B, "ROOT", tmp_path)
    monkeypatch.setattr(B, "PACKAGE", tmp_path / "mla_decode")
    monkeypatch.setattr(B, "ENTRY", entry)


FILES = {"mla_decode/base.py": '"""Base."""\n\nimport math\n\nX = math.pi\n',
         "mla_decode/sub/common.py": '"""Common."""\n\nfrom ..base import X\n\nY = X\n',
         "mla_decode/sub/user.py": '"""User."""\n\nfrom .common import Y\nfrom ..base import X\n\nZ = X + Y\n'}


def test_subpackage_modules_are_inlined_by_path(tmp_path, monkeypatch):
    _package(tmp_path, monkeypatch, FILES, "sub/user")
    assert B.import_order() == ["base", "sub/common", "sub/user"]
    text = B.bundle()
    assert "# mla_decode/sub/common.py\n# Common." in text and "# mla_decode/sub/user.py\n# User." in text
    assert "from ." not in text and text.count("import math") == 1
    namespace: dict = {}
    exec(compile(text, "bundle", "exec"), namespace)
    assert namespace["Z"] == 2 * namespace["X"]


def test_a_name_defined_twice_is_refused(tmp_path, monkeypatch):
    files = dict(FILES, **{"mla_decode/sub/user.py": '"""User."""\n\nfrom .common import Y\n\nX = Y\n'})
    _package(tmp_path, monkeypatch, files, "sub/user")
    with pytest.raises(SystemExit, match="'X' is defined in both mla_decode/base.py and mla_decode/sub/user.py"):
        B.bundle()


def test_an_import_cycle_is_refused(tmp_path, monkeypatch):
    files = {"mla_decode/a.py": '"""A."""\n\nfrom .b import Y\n\nX = 1\n',
             "mla_decode/b.py": '"""B."""\n\nfrom .a import X\n\nY = X\n'}
    _package(tmp_path, monkeypatch, files, "a")
    with pytest.raises(SystemExit, match=r"mla_decode/b.py imports \['X'\] from .a"):
        B.bundle()


def test_a_module_the_entry_reaches_through_a_subpackage_joins(tmp_path, monkeypatch):
    """A new backend: its module and the registry's import of it, and nothing else, bring it into the bundle."""
    files = dict(FILES, **{"mla_decode/sub/__init__.py": '"""Sub."""\n\nfrom .user import Z\n',
                           "mla_decode/registry.py": '"""Registry."""\n\nfrom .sub import Z\n\nRECORDS = (Z,)\n'})
    _package(tmp_path, monkeypatch, files, "registry")
    assert B.import_order() == ["base", "sub/common", "sub/user", "registry"]
    assert "# mla_decode/sub/__init__.py" not in B.bundle()
