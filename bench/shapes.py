"""The model shapes the GPU benchmarks use (random weights, no downloads):
the configurations of Qwen3-1.7B/4B/8B, the Llama-3.2-3B and Llama-3.1-8B shapes, and a
tiny Qwen3 for the CPU. One place, so that every script measures the same
models.

  python bench/shapes.py SHAPE DIR [SEQ]
writes DIR/config.json and a tokenizer whose vocab_size is the real
model's (word-level, ids only matter for the random data), so that a
script that calls AutoConfig/AutoTokenizer.from_pretrained(DIR), as the
original's benchmark/train.py does, runs with no network."""
import json
import os
import sys

QWEN_TOKENIZER_VOCAB = 151643   # Qwen3's tokenizer.vocab_size (the config has 151936 rows)
LLAMA3_TOKENIZER_VOCAB = 128000

SHAPES = {
    "tiny": ("qwen3", dict(vocab_size=1024, hidden_size=128, intermediate_size=384,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32), 1000),
    "1.7B": ("qwen3", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                           num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, tie_word_embeddings=True), QWEN_TOKENIZER_VOCAB),
    "4B": ("qwen3", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, tie_word_embeddings=True), QWEN_TOKENIZER_VOCAB),
    "8B": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, tie_word_embeddings=False), QWEN_TOKENIZER_VOCAB),
    "llama3-8B": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=8, head_dim=128,
                                tie_word_embeddings=False), LLAMA3_TOKENIZER_VOCAB),
    "llama3-3B": ("llama", dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                num_hidden_layers=28, num_attention_heads=24,
                                num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
                  LLAMA3_TOKENIZER_VOCAB),
}


def make_config(shape, seq=4096):
    from transformers import LlamaConfig, Qwen3Config
    family, fields, _ = SHAPES[shape]
    config_cls = Qwen3Config if family == "qwen3" else LlamaConfig
    return config_cls(**fields, max_position_embeddings=max(seq, 4096))


def write_model_dir(shape, directory, seq=4096):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    make_config(shape, seq).save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(SHAPES[shape][2])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1",
                            pad_token="t0").save_pretrained(directory)
    # Named as transformers 4 names it too (the original runs on 4.57, which
    # does not know transformers 5's "TokenizersBackend").
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        fields = json.load(f)
    fields["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(fields, f, indent=2)


if __name__ == "__main__":
    write_model_dir(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 4096)
