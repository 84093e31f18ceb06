"""Only job beyond pyproject.toml: install `sfi_sglang_startup.pth` into site-packages,
so `sfi_sglang._startup` runs at interpreter start in every process (see that module)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "sfi_sglang_startup.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        target = os.path.join(self.build_lib, PTH)
        with open(target, "w") as f:
            f.write("import sfi_sglang._startup\n")

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
