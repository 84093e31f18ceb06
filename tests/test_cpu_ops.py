"""The pure-torch sgl_kernel CPU ops against plain references, and the start-up hook."""

import subprocess
import sys

import pytest
import torch

from sfi_sglang import cpu_ops


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
    cpu_ops.assign_req_to_token_pool_cpu(rows, table, start, end, out, table.shape[1])
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
    cpu_ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref):
        assert torch.equal(b, r)


def test_speculative_ops_say_unsupported():
    op = cpu_ops._speculative_op("verify_tree_greedy_cpu")
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
