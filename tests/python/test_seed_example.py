"""The seed document's code, adapted only in the model path and size (and,
where the flash_attn package is missing, the attention implementation
transformers must load: RoundPipe's preset layers use their own attention
either way), then a few training steps through the Python API."""
import importlib.util

import torch

from hf_models import tiny_qwen3


def test_seed_wrap_example_trains(tmp_path):
    tiny_qwen3().to(torch.float16).save_pretrained(tmp_path)  # stands in for Qwen/Qwen3-1.7B
    attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"

    # --- the seed's code block ---
    from transformers import AutoModelForCausalLM
    from roundpipe import wrap_model_to_roundpipe, RoundPipeRunConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(tmp_path),
        use_cache=False,          # KV cache must be off for training
        dtype=torch.float16,
        _attn_implementation=attn,
    )

    model = wrap_model_to_roundpipe(
        model,
        use_sequential_preset=True,  # force preset lookup and conversion
        model_run_config=RoundPipeRunConfig(num_microbatch=4),  # optional: override the run config
        optim_dtype=torch.float32,
        # more RoundPipe() constructor arguments may be passed
    )
    # --- end of the seed's code ---

    assert model.vocab_size == 96 and model.config.model_type == "qwen3"
    import roundpipe

    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=3e-3)
    assert all(p.dtype == torch.float32 for p in model.optim_parameters())
    ids = torch.randint(0, 96, (8, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        losses.append(float(loss) / 4)  # sum over 4 microbatches
    model.synchronize()
    assert losses[-1] < losses[0] - 0.1, losses
    assert all(p.dtype == torch.float16 for p in model.parameters())
