"""The original's model-presets page (docs/ModelZoo/model_presets.md): the
classes wrap_model_to_roundpipe recognizes and converts to a RoundPipe
(GptOssForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM,
Qwen3MoeForCausalLM), each converted by default (saying so) into a
Sequential of its decoder layers plus an input and an output layer that
computes what transformers computes; a class not in the table has no
preset. (Training, padding, packing for each: ../test_hf_presets.py.)

Tolerance: fp32 on both sides, the same products summed in another order
through 3 layers and the loss: 2e-5 relative, as ../test_hf_presets.py."""
import copy

import pytest
import torch
from hf_models import tiny_gpt_oss, tiny_llama, tiny_qwen3, tiny_qwen3_moe
from roundpipe import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe

TABLE = {"GptOssForCausalLM": tiny_gpt_oss, "LlamaForCausalLM": tiny_llama,
         "Qwen3ForCausalLM": tiny_qwen3, "Qwen3MoeForCausalLM": tiny_qwen3_moe}


def test_the_table_is_what_roundpipe_models_supports():
    from roundpipe.models import SUPPORTED_MODELS

    assert set(SUPPORTED_MODELS) >= set(TABLE)


@pytest.mark.parametrize("class_name", sorted(TABLE))
def test_each_listed_class_is_converted_to_a_roundpipe(class_name, capsys):
    hf = TABLE[class_name]()
    assert type(hf).__name__ == class_name
    oracle = copy.deepcopy(hf)
    model = wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=1))
    assert isinstance(model, RoundPipe)
    assert model.num_layers == hf.config.num_hidden_layers + 2
    captured = capsys.readouterr()
    assert "[INFO] Replace model" in captured.out + captured.err and class_name in captured.out + captured.err
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (2, 8), generator=g)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        expected = oracle(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, expected.loss, rtol=2e-5, atol=2e-5 * expected.loss.abs().item())


def test_a_class_not_in_the_table_has_no_preset():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    with pytest.raises(NotImplementedError):
        wrap_model_to_roundpipe(MistralForCausalLM(config), use_sequential_preset=True)
