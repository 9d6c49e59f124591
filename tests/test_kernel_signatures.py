"""Every Triton kernel the library launches takes no default arguments: torch 2.11's
wrap_triton (what a triton_op's launch goes through under torch.compile) passes only the
arguments of the call and does not fill a kernel's defaults, so a launch that leaves one
out compiles with it as None. Without defaults a missing argument fails on every torch, the
CPU interpreter's tests included."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def jit_kernels():
    for path in sorted([*ROOT.glob("lowering/**/*.py"), *ROOT.glob("mla_ops/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.FunctionDef) and node.name.endswith("kernel")
                    and any("jit" in ast.unparse(d) for d in node.decorator_list)):
                yield path.relative_to(ROOT), node


def test_launched_kernels_take_no_defaults():
    kernels = list(jit_kernels())
    assert len(kernels) > 20                     # the scan finds the library's kernels
    with_defaults = [f"{path}: {node.name}" for path, node in kernels
                     if node.args.defaults or node.args.kw_defaults]
    assert not with_defaults, with_defaults
