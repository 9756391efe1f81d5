"""csrc/metal/*.mm and the clang stubs checked against Apple's own Metal API table (metal-cpp,
from the PyPI sdist of pymetal-cpp, fetched at run time). tests/test_metal_api.py drives it.

    apple.locate(cache) -> the metal-cpp tree; apple.Table(tree) -> the table
    check.check_source(text, name, table) / check.check_stubs(dir, table) -> check.Report
"""
from . import apple, check, objc  # noqa: F401
