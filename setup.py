"""Build hook: the wheel ships andpush.py as the package ``andpush`` with a py.typed marker.

andpush stays one file to copy into a project, but a lone module cannot carry the py.typed
marker (PEP 561) that tells type checkers to use its annotations. So the wheel installs that
same file, unchanged, as ``andpush/__init__.py`` beside ``py.typed``, with a ``__main__.py``
that keeps ``python -m andpush`` working. Everything else is declared in setup.cfg.
"""

import os
from typing import List

from setuptools import setup
from setuptools.command.build_py import build_py

MODULE = "andpush.py"
MAIN = "import sys\n\nfrom andpush import main\n\nsys.exit(main())\n"


class BuildModuleAsPackage(build_py):
    """Build ``andpush/__init__.py`` (a copy of andpush.py), ``__main__.py`` and ``py.typed``."""

    def run(self) -> None:
        package = os.path.join(self.build_lib, "andpush")
        self.mkpath(package)
        self.copy_file(MODULE, os.path.join(package, "__init__.py"))
        for name, text in (("__main__.py", MAIN), ("py.typed", "")):
            with open(os.path.join(package, name), "w", encoding="utf-8") as file:
                file.write(text)
        if self.compile or self.optimize:
            self.byte_compile(self.get_outputs(include_bytecode=False))

    def get_outputs(self, include_bytecode: bool = True) -> List[str]:
        package = os.path.join(self.build_lib, "andpush")
        return [os.path.join(package, name) for name in ("__init__.py", "__main__.py", "py.typed")]

    def get_source_files(self) -> List[str]:
        return [MODULE]


# packages names what the hook builds (there is no andpush/ directory to discover).
setup(packages=["andpush"], cmdclass={"build_py": BuildModuleAsPackage})
