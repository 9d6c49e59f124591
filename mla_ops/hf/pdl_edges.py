"""Programmatic dependencies set on a captured CUDA graph (lowering/pdl.py says why).

    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        step()
    n = programmatic_edges(g)        # edges made programmatic
    g.instantiate()

A kernel node whose function lowering.pdl.is_pdl_kernel names, and whose one dependency is
another kernel node, gets that edge made programmatic (the CUDA driver's graph edge type
and the predecessor's programmatic port, what a stream capture records for a launch with
programmatic stream serialization): the node may start while its predecessor runs and
waits inside (griddepcontrol.wait). Every other edge stays as captured, so a node with
several dependencies, or after a copy, a memset or an event, starts as before.

The CUDA driver API (12.3 or newer) is called through ctypes on the process's libcuda.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from lowering.pdl import is_pdl_kernel

_KERNEL_NODE = 0                   # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1             # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
_DEPENDENCY_PROGRAMMATIC = 1       # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte),
                ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


@functools.lru_cache(maxsize=1)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    for name in ("cuGraphAddDependencies_v2", "cuGraphNodeGetDependencies_v2", "cuFuncGetName"):
        if not hasattr(lib, name):
            raise RuntimeError(f"the CUDA driver has no {name} (programmatic graph edges need "
                               f"a driver of CUDA 12.3 or newer)")
    return lib


def programmatic_unmet(device: torch.device) -> str | None:
    """None where programmatic edges can be set for `device`'s kernels (a CUDA device of
    compute capability 9.0 or newer, whose kernels lowering.pdl compiles with their
    waits, and a driver with the graph API used here), else what is missing."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the device is {device}, not a CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"the GPU is sm_{major}{minor}; programmatic dependent launch needs sm_90 or newer"
    try:
        _driver()
    except (OSError, RuntimeError) as exc:
        return str(exc)
    return None


def _check(lib, rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: {msg.value.decode() if msg.value else rc}")


def _nodes(lib, graph) -> list[int]:
    n = ctypes.c_size_t(0)
    _check(lib, lib.cuGraphGetNodes(graph, None, ctypes.byref(n)), "cuGraphGetNodes")
    arr = (ctypes.c_void_p * n.value)()
    _check(lib, lib.cuGraphGetNodes(graph, arr, ctypes.byref(n)), "cuGraphGetNodes")
    return list(arr[:n.value])


def _is_kernel(lib, node) -> bool:
    kind = ctypes.c_int(-1)
    _check(lib, lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)),
           "cuGraphNodeGetType")
    return kind.value == _KERNEL_NODE


def _kernel_name(lib, node) -> str | None:
    """The kernel node's function name; None where the node holds no CUfunction."""
    params = (ctypes.c_void_p * 16)()      # CUDA_KERNEL_NODE_PARAMS: the CUfunction first
    _check(lib, lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), params),
           "cuGraphKernelNodeGetParams")
    if not params[0]:
        return None
    name = ctypes.c_char_p()
    if lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params[0])) != 0 or not name.value:
        return None
    return name.value.decode()


def _dependencies(lib, node) -> tuple[list[int], list[_EdgeData]]:
    n = ctypes.c_size_t(0)
    _check(lib, lib.cuGraphNodeGetDependencies_v2(ctypes.c_void_p(node), None, None,
                                                   ctypes.byref(n)),
           "cuGraphNodeGetDependencies")
    if n.value == 0:
        return [], []
    deps = (ctypes.c_void_p * n.value)()
    data = (_EdgeData * n.value)()
    _check(lib, lib.cuGraphNodeGetDependencies_v2(ctypes.c_void_p(node), deps, data,
                                                   ctypes.byref(n)),
           "cuGraphNodeGetDependencies")
    return list(deps[:n.value]), list(data[:n.value])


def programmatic_edges(graph: torch.cuda.CUDAGraph, accept=is_pdl_kernel, log=None) -> int:
    """Make the edges into PDL kernels programmatic (see the module's docstring) in a graph
    captured with keep_graph=True and not yet instantiated; returns how many changed.
    accept(name) says which kernels wait before reading (lowering.pdl.is_pdl_kernel); a
    list given as log gets (predecessor's name, kernel's name) for each edge changed."""
    if not isinstance(graph, torch.cuda.CUDAGraph):
        raise TypeError(f"graph must be a torch.cuda.CUDAGraph, got {type(graph).__name__}")
    lib = _driver()
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    changed = 0
    for node in _nodes(lib, handle):
        name = _kernel_name(lib, node) if _is_kernel(lib, node) else None
        if not name or not accept(name):
            continue
        deps, data = _dependencies(lib, node)
        if len(deps) != 1 or data[0].type != 0 or not _is_kernel(lib, deps[0]):
            continue
        src, dst = (ctypes.c_void_p * 1)(deps[0]), (ctypes.c_void_p * 1)(node)
        _check(lib, lib.cuGraphRemoveDependencies(handle, src, dst, ctypes.c_size_t(1)),
               "cuGraphRemoveDependencies")
        edge = (_EdgeData * 1)()
        edge[0].from_port, edge[0].type = _PORT_PROGRAMMATIC, _DEPENDENCY_PROGRAMMATIC
        _check(lib, lib.cuGraphAddDependencies_v2(handle, src, dst, edge, ctypes.c_size_t(1)),
               "cuGraphAddDependencies")
        changed += 1
        if log is not None:
            log.append((_kernel_name(lib, deps[0]), name))
    return changed
