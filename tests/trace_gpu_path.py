"""Trace the model's GPU kernel path on a machine without a GPU (run by tests/model/test_triton_cuda_compile.py).

On a GPU, model/triton_ops.py registers the kernel modules' ops as `torch.library.triton_op`s whose bodies launch
the kernels through `wrap_triton`; under torch.compile, AOTAutograd traces those bodies into
`triton_kernel_wrapper_functional` nodes after analysing which arguments each kernel writes (which
compiles the kernel to TTIR for the current target). On CPU the tests use the interpreter and the
`custom_op` registration instead, so none of that code runs. This script imports the kernels
*without* the interpreter (the GPU registration), points Triton at a stand-in driver that reports an
sm_90 target (nothing is launched: every tensor is a FakeTensor), and runs AOTAutograd with the
min-cut partitioner Inductor uses over the whole model's forward and backward. It prints one JSON
line: how many nodes of each kernel the forward and backward graphs hold.

    python tests/trace_gpu_path.py fp32|fp16-autocast
"""
import json
import os
import sys
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be JITFunctions: the GPU registration

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import model.triton_norm as tnorm  # noqa: E402,F401  (imported here: registers its ops, GPU style)
import model.triton_ops as tops  # noqa: E402
import model.triton_rope as trope  # noqa: E402,F401
import model.triton_swiglu as tswiglu  # noqa: E402,F401
import model.triton_loss as tlo  # noqa: E402


class _Sm90Driver:
    """Just enough of a Triton driver for torch's kernel analysis: the target it compiles TTIR for."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def main() -> None:
    mode = sys.argv[1]
    assert not tops.INTERPRET, "the GPU registration (triton_op + wrap_triton) must be the one traced"
    triton.runtime.driver.set_active(_Sm90Driver())
    # let kernels.choose() hand CPU (fake) tensors to the Triton ops: nothing runs, everything is traced
    os.environ["TRITON_INTERPRET"] = "1"
    tops.supported = tlo.supported = lambda t: True

    from functorch.compile import min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_function
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    from model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                      kernel_backend="triton")
    model = Transformer(cfg)
    counts = {"forward": Counter(), "backward": Counter()}

    def counter(graph_name):
        def compiler(gm, example_inputs):
            for node in gm.graph.nodes:
                if node.op != "call_function":
                    continue
                if "triton_kernel_wrapper" in str(node.target):
                    counts[graph_name][kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__] += 1
                elif "myllm" in str(node.target):
                    counts[graph_name][str(node.target)] += 1
            return gm
        return compiler

    def loss_fn(params, buffers, x, y):
        ctx = (torch.autocast("cpu", dtype=torch.float16) if mode == "fp16-autocast"
               else torch.autocast("cpu", enabled=False))
        with ctx:
            return functional_call(model, {**params, **buffers}, (x,), {"labels": y})

    fn = aot_function(loss_fn, fw_compiler=counter("forward"), bw_compiler=counter("backward"),
                      partition_fn=min_cut_rematerialization_partition)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        params = {n: torch.empty_like(p).requires_grad_(True) for n, p in model.named_parameters()}
        # the buffers as inputs too (RoPE's cos/sin tables, sliced in forward): a real tensor sliced
        # inside the fake-mode trace cannot become a graph constant
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        x = torch.randint(0, cfg.vocab_size, (2, 12))
        y = torch.randint(0, cfg.vocab_size, (2, 12))
        loss = fn(params, buffers, x, y)
        loss.backward()
        n_grads = sum(p.grad is not None for p in params.values())
    print(json.dumps({"forward": dict(counts["forward"]), "backward": dict(counts["backward"]),
                      "grads": n_grads, "params": len(params), "loss_dtype": str(loss.dtype)}))


if __name__ == "__main__":
    main()
