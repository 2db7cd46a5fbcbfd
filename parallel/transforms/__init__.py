"""Parallelism and compilation as transforms of one model, applied in one fixed order by parallel/build.py
(torchtitan's `parallelize` shape). Each is a module with `apply(model_or_engine, mesh, config)` that does
nothing when its flag is off:

    ORDER = tensor_parallel      split each block's matmuls, the embedding and the LM head over mesh["tp"]
                                 (inside the engine's builder, before FSDP2 shards the result over dp)
            activation_checkpoint  recompute each block's activations in the backward
            context_parallel      split every sequence over mesh["cp"], ring attention (model/ring_attention.py)
            float8                the blocks' linear layers to torchao's FP8 training layers (--float8)
            (data-parallel wrap)  the engine: our DDP / ZeRO, FSDP2 over dp, or pipeline stages (parallel/engine_*.py)
            compile               the engine's forward (whole model; per block under tensor parallelism)

"""
ORDER = ("tensor_parallel", "activation_checkpoint", "context_parallel", "float8", "compile")
