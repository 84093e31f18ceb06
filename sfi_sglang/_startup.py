"""Runs at interpreter start in every Python process of the environment, through the
`sfi_sglang_startup.pth` file installed next to site-packages' packages.

Why a .pth and not SGLang's plugin hook: SGLang imports `sgl_kernel` at module level
(sglang.srt.entrypoints.engine -> ... -> mem_cache/memory_pool.py) before it calls
`load_plugins()`, and it spawns its scheduler and detokenizer processes, so only
interpreter start-up comes early enough in each of them.

What it does: nothing, unless a process imports `sgl_kernel` and that import fails
- on a machine without CUDA (the PyPI build of sgl_kernel needs libcuda): the module is
  completed with the pure-torch CPU ops of `sfi_sglang.integration.sgl_kernel_standin`;
- on a CUDA machine, and only with SFI_SGLANG_TORCH_KERNELS=1 set: with that module's
  torch stand-ins for SGLang's CUDA ops (see there; bench/sglang_h200.sh).
Where `sgl_kernel` imports fine, it is left exactly as it is.
It also installs the filters of `sfi_sglang.integration.quiet` for the known harmless warnings SGLang
issues while importing (named there). Keep this file free of heavy imports: it runs in every
Python process of the environment.
"""

import importlib.abc
import importlib.machinery
import sys

from sfi_sglang.integration import quiet as _quiet

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
            except Exception as err:  # ImportError/OSError without libcuda, RuntimeError without a GPU
                mode = _fallback_mode()
                if mode is None:
                    raise
                reason = f"sgl_kernel failed to import ({str(err).strip().splitlines()[-1]})"
        else:
            mode = _fallback_mode()
            if mode is None:
                raise ModuleNotFoundError(f"No module named {_NAME!r}", name=_NAME)
            reason = "sgl_kernel is not installed"
        from sfi_sglang.integration import sgl_kernel_standin

        if mode == "cpu":
            sgl_kernel_standin.fill_module(module, reason)
        else:
            sgl_kernel_standin.fill_module_torch(module, reason)


class _SubmoduleLoader(importlib.abc.Loader):
    """`sgl_kernel.<sub>` under the CUDA stand-in: a stand-in module too."""

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        from sfi_sglang.integration.sgl_kernel_standin import fill_module_torch

        fill_module_torch(module, sys.modules[_NAME].SFI_TORCH_STANDIN)


def _fallback_mode():
    """"cpu", "torch" or None (no stand-in: the import error stands)."""
    import os

    import torch

    if not torch.cuda.is_available():
        return "cpu"
    if os.environ.get("SFI_SGLANG_TORCH_KERNELS") == "1":
        return "torch"
    return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(_NAME + ".") and hasattr(sys.modules.get(_NAME), "SFI_TORCH_STANDIN"):
            from sfi_sglang.integration.sgl_kernel_standin import NO_STANDIN_SUBMODULES

            if fullname.split(".", 1)[1] in NO_STANDIN_SUBMODULES:
                return None  # ModuleNotFoundError: SGLang's own fallback takes over
            return importlib.machinery.ModuleSpec(fullname, _SubmoduleLoader(), is_package=True)
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
_quiet.install_warning_filters()
