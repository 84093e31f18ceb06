"""Runs at interpreter start in every Python process of the environment, through the
`sfi_sglang_startup.pth` file installed next to site-packages' packages.

Why a .pth and not SGLang's plugin hook: SGLang imports `sgl_kernel` at module level
(sglang.srt.entrypoints.engine -> ... -> mem_cache/memory_pool.py) before it calls
`load_plugins()`, and it spawns its scheduler and detokenizer processes, so only
interpreter start-up comes early enough in each of them.

What it does: nothing, unless a process imports `sgl_kernel` and that import fails on a
machine without CUDA (the PyPI build of sgl_kernel needs libcuda). Then the module is
completed with the pure-torch CPU ops of `sfi_sglang.cpu_ops`. Where `sgl_kernel` imports
fine, it is left exactly as it is. Keep this file free of heavy imports: it runs in every
Python process of the environment.
"""

import importlib.abc
import importlib.machinery
import sys

_NAME = "sgl_kernel"


class _FallbackLoader(importlib.abc.Loader):
    def __init__(self, real_loader):
        self.real_loader = real_loader

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if self.real_loader is not None:
            try:
                self.real_loader.exec_module(module)
                return
            except ImportError as err:
                if not _may_fall_back():
                    raise
                reason = f"sgl_kernel failed to import ({str(err).strip().splitlines()[-1]})"
        else:
            if not _may_fall_back():
                raise ModuleNotFoundError(f"No module named {_NAME!r}", name=_NAME)
            reason = "sgl_kernel is not installed"
        from sfi_sglang.cpu_ops import fill_module

        fill_module(module, reason)


def _may_fall_back() -> bool:
    import torch

    return not torch.cuda.is_available()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return importlib.machinery.ModuleSpec(fullname, _FallbackLoader(None), is_package=True)
        spec.loader = _FallbackLoader(spec.loader)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
