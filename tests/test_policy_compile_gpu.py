"""grpo.compile on a CUDA GPU (marker `gpu`): one GRPO update of a compiled policy equals the eager
one in float32, with checkpointing inside the compiled layer and without it. The CPU test
(test_policy_compile.py) passed for a version that failed on the GPU (checkpointing around a
compiled layer: CheckpointError in backward), so the GPU gets its own. The batch's micro-batches
include one sequence alone (no padding: transformers passes no mask), so the layer's other graph
variant runs too. bf16's gap is benchmarks/train_gpu.py's figure, not a test's."""
import pytest
import torch
from test_policy_compile import assert_same_update, trained

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run on the GPU machine: bash dev/gpu_suite.sh)", allow_module_level=True)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_compiled_update_equals_eager_on_gpu(tiny_model_dir, checkpointing):
    from torch._dynamo.utils import counters
    setting = f"grpo.activation_checkpointing={str(checkpointing).lower()}"
    # a 30-token budget: the longest sequence (up to 21 tokens) gets a micro-batch of its own
    eager_stats, eager_grads = trained(tiny_model_dir, "off", "cuda", setting, "grpo.micro_batch_tokens=30")
    counters.clear()
    compiled_stats, compiled_grads = trained(tiny_model_dir, "all", "cuda", setting, "grpo.micro_batch_tokens=30")
    assert counters["stats"]["unique_graphs"] >= 3 and not counters["graph_break"], dict(counters)
    assert_same_update((eager_stats, eager_grads), (compiled_stats, compiled_grads), rel=1e-4, abs_stats=1e-6)
