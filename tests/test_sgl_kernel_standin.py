"""The pure-torch sgl_kernel CPU ops against plain references, and the start-up hook."""

import subprocess
import sys

import pytest
import torch

from sfi_sglang.integration import sgl_kernel_standin as standin


def test_assign_req_to_token_pool_matches_reference():
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 1000, (6, 40), generator=g, dtype=torch.int32)
    expect = table.clone()
    rows = torch.tensor([3, 1, 5])
    start = torch.tensor([0, 7, 12])
    end = torch.tensor([5, 7, 30])  # an empty range in the middle
    out = torch.randint(0, 1000, (23,), generator=g, dtype=torch.int64)
    offset = 0
    for r, s, e in zip(rows.tolist(), start.tolist(), end.tolist()):
        for j in range(s, e):
            expect[r, j] = int(out[offset])
            offset += 1
    standin.assign_req_to_token_pool_cpu(rows, table, start, end, out, table.shape[1])
    assert torch.equal(table, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_all_layer_kv_cache_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    bufs = [torch.randn(50, 3, 8, generator=g).to(dtype) for _ in range(4)]
    ref = [b.clone() for b in bufs]
    # overlapping source/target rows: every source is read before any target is written
    src = torch.tensor([2, 3, 4, 10])
    tgt = torch.tensor([3, 4, 40, 2])
    for b in ref:
        b[tgt] = b[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    standin.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref):
        assert torch.equal(b, r)


def test_speculative_ops_say_unsupported():
    op = standin._speculative_op("verify_tree_greedy_cpu")
    with pytest.raises(NotImplementedError, match="speculative decoding is not supported"):
        op()


def test_sgl_kernel_import_is_completed_in_a_fresh_process():
    """The .pth start-up hook acts in a brand-new interpreter (like SGLang's spawned
    processes): sgl_kernel imports and carries the CPU ops."""
    code = ("import torch, sgl_kernel\n"
            "from sgl_kernel import copy_all_layer_kv_cache_cpu, assign_req_to_token_pool_cpu\n"
            "print(getattr(sgl_kernel, 'SFI_CPU_FALLBACK', 'native'))\n"
            "print(hasattr(sgl_kernel, 'no_such_op'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    if torch.cuda.is_available():
        assert lines[0] == "native"
    else:
        assert "sgl_kernel" in lines[0]
    assert lines[1] == "False"


# ---------------------------------------------------------------- the CUDA-side torch ops
def _rms64(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_norms_match_float64(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 64, generator=g).to(dtype)
    r = torch.randn(7, 64, generator=g).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(standin.rmsnorm(x, w, 1e-6).double(), _rms64(x, w, 1e-6), **tol)
    out = torch.empty_like(x)
    assert standin.gemma_rmsnorm(x, w, 1e-6, out=out) is out
    torch.testing.assert_close(out.double(), _rms64(x, w.double() + 1, 1e-6), **tol)
    # in place, as sgl_kernel: residual <- x + residual, x <- rmsnorm(residual)
    xi, ri = x.clone(), r.clone()
    standin.fused_add_rmsnorm(xi, ri, w, 1e-6)
    s = x.double() + r.double()
    torch.testing.assert_close(ri.double(), s, **tol)
    torch.testing.assert_close(xi.double(), _rms64(s, w, 1e-6), **tol)


def test_torch_activations_match_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2 * 48, generator=g)
    a, b = x[:, :48].double(), x[:, 48:].double()
    torch.testing.assert_close(standin.silu_and_mul(x).double(), a * torch.sigmoid(a) * b)
    out = torch.empty(5, 48)
    standin.gelu_tanh_and_mul(x, out)
    ref = 0.5 * a * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (a + 0.044715 * a**3))) * b
    torch.testing.assert_close(out.double(), ref)


def test_torch_standin_names_every_missing_op():
    import types

    mod = types.ModuleType("sgl_kernel")
    standin.fill_module_torch(mod, "test")
    assert mod.rmsnorm is standin.rmsnorm
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.top_k_renorm_prob has no pure-torch"):
        mod.top_k_renorm_prob(None, 1)
    with pytest.raises(AttributeError):
        mod.__version__


def test_cuda_standin_is_opt_in():
    """On a CUDA machine without a working sgl_kernel (simulated: torch.cuda.is_available
    patched before the import), the stand-in needs SFI_SGLANG_TORCH_KERNELS=1; with it,
    SGLang's module-level imports from sgl_kernel and its submodules succeed, except
    sgl_kernel.scalar_type, whose ImportError SGLang answers with its own fallback."""
    code = ("import torch; torch.cuda.is_available = lambda: True\n"
            "try:\n"
            "    from sgl_kernel import rmsnorm, top_k_renorm_prob\n"
            "    from sgl_kernel.quantization import ggml_mul_mat_a8\n"
            "    print('ok', top_k_renorm_prob.__name__, ggml_mul_mat_a8.__name__)\n"
            "    import sgl_kernel.scalar_type\n"
            "except Exception as e:\n"
            "    print('failed', type(e).__name__)\n")
    import os

    runs = {}
    for flag in ("0", "1"):
        env = dict(os.environ, SFI_SGLANG_TORCH_KERNELS=flag)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr
        runs[flag] = out.stdout.strip()
    assert runs["1"] == "ok top_k_renorm_prob ggml_mul_mat_a8\nfailed ModuleNotFoundError"
    assert runs["0"].startswith("failed")  # the real import error stands
