"""A conditional node in a CUDA graph being captured by torch: `capture_if(pred, body)`
records body() so that a replay runs its kernels only when the device bool `pred` holds.

torch gained this as CUDAGraph.begin_capture_to_if_node; the torch of our GPU machine
(2.11) lacks it, so this module builds the same node from CUDA's runtime API (12.4+,
through the `cuda.bindings` package):
  1. body() is captured into a graph of its own, on a side stream, with torch's allocator
     routed to a memory pool shared by all such bodies (they run one after another);
  2. in the main capture, a one-thread kernel copies `pred` into a conditional handle
     (cudaGraphSetConditional), and an IF node whose body graph holds the captured graph
     as a child node follows it; the stream's capture goes on after the IF node.
The set-conditional kernel is compiled once per process with NVRTC (cuda.bindings.nvrtc),
or nvcc where NVRTC is missing. `available()` says whether all of it works here.

`run_if(pred, body)` is what the `sfi` backend calls: torch's own node where torch has one,
else this module's, else body() unconditionally. `no_host_reads()` makes a host read inside
a decode step fail loudly (tests), since it would stall graphs and the overlap scheduler.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile

import torch

# torch's own conditional node (newer torch than the GPU machine's 2.11)
HAS_IF_NODE = hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node") and hasattr(
    torch.cuda.CUDAGraph, "get_currently_capturing_graph")
# Set to "1" (tests): a device-path decode layer that reads a tensor to the host
# (Tensor.item/.tolist/.cpu) raises instead, so a sync that would stall CUDA graphs and the
# overlap scheduler fails loudly on the CPU engine too.
SYNC_GUARD_ENV = "SFI_SGLANG_SYNC_GUARD"

_SRC = r"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __attribute__((cudart_builtin)) void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                     unsigned int value);
extern "C" __global__ void sfi_set_conditional(cudaGraphConditionalHandle handle, const bool* value) {
    cudaGraphSetConditional(handle, *value ? 1u : 0u);
}
"""
_SRC_NVCC = "#include <cuda_runtime.h>\n" + r"""
extern "C" __global__ void sfi_set_conditional(cudaGraphConditionalHandle handle, const bool* value) {
    cudaGraphSetConditional(handle, *value ? 1u : 0u);
}
"""

_STATE: dict = {}


def _check(result):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed: {err}")
    if isinstance(result, tuple):
        return result[1] if len(result) == 2 else result[1:]
    return None


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def _cubin() -> bytes:
    """The set-conditional kernel for this GPU: NVRTC, else nvcc."""
    errors = []
    try:
        from cuda.bindings import nvrtc

        prog = _check(nvrtc.nvrtcCreateProgram(_SRC.encode(), b"sfi_cond.cu", 0, [], []))
        opts = [f"--gpu-architecture={_arch()}".encode(), b"-default-device"]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(res[0]) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(log.decode(errors="replace"))
        size = _check(nvrtc.nvrtcGetCUBINSize(prog))
        out = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, out))
        return out
    except Exception as err:  # noqa: BLE001 - try nvcc next
        errors.append(f"nvrtc: {err}")
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "c.cu"), os.path.join(d, "c.cubin")
        with open(src, "w") as f:
            f.write(_SRC_NVCC)
        r = subprocess.run([nvcc, "-cubin", f"-arch={_arch()}", "-o", out, src], capture_output=True, text=True)
        if r.returncode == 0:
            with open(out, "rb") as f:
                return f.read()
        errors.append(f"nvcc: {r.stderr[-500:]}")
    raise RuntimeError("no compiler for the set-conditional kernel: " + "; ".join(errors))


def _setup() -> dict:
    if "ok" in _STATE:
        return _STATE
    try:
        from cuda.bindings import driver, runtime

        _check(driver.cuInit(0))
        # torch's (primary) context, current in this thread before the module loads into it
        dev = _check(driver.cuDeviceGet(torch.cuda.current_device()))
        ctx = _check(driver.cuDevicePrimaryCtxRetain(dev))
        _check(driver.cuCtxSetCurrent(ctx))
        module = _check(driver.cuModuleLoadData(_cubin()))
        func = _check(driver.cuModuleGetFunction(module, b"sfi_set_conditional"))
        _STATE.update(ok=True, driver=driver, rt=runtime, module=module, func=func,
                      pool=torch.cuda.graph_pool_handle(), graphs=[], streams={})
    except Exception as err:  # noqa: BLE001 - reported by available()
        _STATE.update(ok=False, error=f"{type(err).__name__}: {err}")
    return _STATE


def available() -> bool:
    return torch.cuda.is_available() and _setup()["ok"]


def error() -> str:
    return _setup().get("error", "")


def _capture_info(rt, stream):
    """(graph, dependencies) of the stream's ongoing capture (the runtime's signature
    differs between CUDA 12 and 13: deps come with or without edge data)."""
    res = rt.cudaStreamGetCaptureInfo(stream)
    _check((res[0], None))
    graph, deps = res[3], res[4]
    n = res[-1]
    return graph, list(deps)[:int(n)] if deps is not None else []


def _add_node(rt, graph, deps, params):
    try:
        return _check(rt.cudaGraphAddNode(graph, deps, len(deps), params))
    except TypeError:  # CUDA 13: edge data before the count
        return _check(rt.cudaGraphAddNode(graph, deps, None, len(deps), params))


def _set_deps(rt, stream, node):
    flag = rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies
    try:
        _check(rt.cudaStreamUpdateCaptureDependencies(stream, [node], 1, flag))
    except TypeError:  # CUDA 13: edge data before the count
        _check(rt.cudaStreamUpdateCaptureDependencies(stream, [node], None, 1, flag))


def _as_int(x) -> int:
    try:
        return int(x)
    except TypeError:
        return int(x.getPtr())


def capture_if(pred: torch.Tensor, body) -> None:
    """Inside a torch CUDA-graph capture on the current stream: record body() under an IF
    node on `pred` (a bool CUDA tensor of one element, read at replay)."""
    st = _setup()
    rt, driver = st["rt"], st["driver"]
    main = torch.cuda.current_stream()
    dev = main.device
    side = st["streams"].get(dev)
    if side is None:
        side = st["streams"][dev] = torch.cuda.Stream(dev)
    # 1. the body, as a graph of its own (kept alive: its memory lives in the shared pool)
    child = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(side):
        child.capture_begin(pool=st["pool"], capture_error_mode="relaxed")
        try:
            body()
        finally:
            child.capture_end()
    st["graphs"].append(child)
    # 2. set-conditional kernel + IF node in the main capture
    stream = rt.cudaStream_t(init_value=main.cuda_stream)
    graph, _ = _capture_info(rt, stream)
    handle = _check(rt.cudaGraphConditionalHandleCreate(graph, 0, 0))
    value = pred.reshape(1).to(torch.bool)
    args = ((_as_int(handle), value.data_ptr()), (ctypes.c_ulonglong, ctypes.c_void_p))
    _check(driver.cuLaunchKernel(st["func"], 1, 1, 1, 1, 1, 1, 0, driver.CUstream(main.cuda_stream), args, 0))
    graph, deps = _capture_info(rt, stream)
    params = rt.cudaGraphNodeParams()
    params.type = rt.cudaGraphNodeType.cudaGraphNodeTypeConditional
    params.conditional.handle = handle
    params.conditional.type = rt.cudaGraphConditionalNodeType.cudaGraphCondTypeIf
    params.conditional.size = 1
    node = _add_node(rt, graph, deps, params)
    body_graph = params.conditional.phGraph_out[0]
    child_graph = rt.cudaGraph_t(init_value=child.raw_cuda_graph())
    _check(rt.cudaGraphAddChildGraphNode(body_graph, None, 0, child_graph))
    _set_deps(rt, stream, node)


def run_if(pred: torch.Tensor, body) -> None:
    """body() where pred (a device bool scalar) holds. Inside a CUDA graph capture: a
    conditional graph node, so a replay skips the body's kernels when pred is false
    (torch's own node where it has one, else capture_if's); elsewhere body() always runs
    (its work is masked per row, so the result is the same) and nothing is read back to
    the host; on the CPU, whose tensors are host memory, pred decides."""
    if not pred.is_cuda:
        if bool(pred):
            body()
        return
    if torch.cuda.is_current_stream_capturing():
        if HAS_IF_NODE:
            graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
            graph.begin_capture_to_if_node(pred)
            try:
                body()
            finally:
                graph.end_capture_to_conditional_node()
            return
        if available():
            capture_if(pred, body)
            return
    body()


@contextlib.contextmanager
def no_host_reads(on: bool = True):
    """Inside: Tensor.item, .tolist and .cpu raise RuntimeError (when `on`)."""
    if not on:
        yield
        return
    names = ("item", "tolist", "cpu")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def f(self, *args, **kwargs):
            raise RuntimeError(f"SFI decode step read a tensor to the host (Tensor.{name})")
        return f

    for n in names:
        setattr(torch.Tensor, n, refuse(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
