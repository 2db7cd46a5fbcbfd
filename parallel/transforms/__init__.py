"""Parallelism and compilation as transforms of one model, applied in one fixed order by parallel/build.py
(torchtitan's `parallelize` shape), on the run's one mesh. Each is a module with `apply(model_or_engine, mesh,
config)` that does nothing when its flag is off:

    ORDER = tensor_parallel       split each block's matmuls, the embedding and the LM head over mesh["tp"]
                                  (after the first rank's weights are broadcast, before FSDP2 shards the result)
            activation_checkpoint recompute each block's activations in the backward
            context_parallel      split every sequence over mesh["cp"], ring attention (model/ring_attention.py)
            expert_parallel       the MoE blocks' experts sharded over mesh["ep"], tokens sent to them by all-to-all
            float8                the blocks' linear layers to torchao's FP8 training layers (--float8)
            data_parallel         the engine's wrap with its optimizer: our DDP / ZeRO, FSDP2 over dp, or pipeline
                                  stages in either (parallel/build.py ENGINE_WRAPS, parallel/engine_*.py)
            compile               the engine's forward (whole model; per block under tensor parallelism)

Under pipeline parallelism the model transforms apply to this rank's stage, as torchtitan applies them per
model part. A new mesh dimension is a dimension of parallel/mesh.py, a module here, and its name in ORDER.
"""
ORDER = ("tensor_parallel", "activation_checkpoint", "context_parallel", "expert_parallel", "float8", "data_parallel",
         "compile")
