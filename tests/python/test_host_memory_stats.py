"""RoundPipe.host_memory_stats(): the arena's bytes, against the model's own."""
import torch

from hf_models import tiny_qwen3
from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe


def test_the_arena_holds_the_weights_and_reports_them():
    model = tiny_qwen3().to(torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    pipe = wrap_model_to_roundpipe(model, devices="sim:1", optim_dtype=torch.float32,
                                   use_sequential_preset=True,
                                   model_run_config=RoundPipeRunConfig(num_microbatch=2))
    stats = pipe.host_memory_stats()
    assert stats["model_state_bytes"] == weight_bytes
    # Blocks are the requests rounded up to 512 bytes, one block a parameter at most.
    assert weight_bytes <= stats["arena_allocated_bytes"] <= weight_bytes + 512 * stats["arena_live_blocks"]
    assert stats["arena_allocated_bytes"] <= stats["arena_reserved_bytes"]
    ids = torch.randint(0, 96, (2, 16))
    pipe.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
    pipe.synchronize()
    after = pipe.host_memory_stats()
    assert after["arena_peak_allocated_bytes"] > stats["arena_allocated_bytes"]  # the gradients' downloads
    assert after["arena_pinned_bytes"] == 0  # simulated devices pin nothing
