"""A tiny word-level tokenizer with a ChatML chat template, built in the
test (no downloads), saved as transformers saves any tokenizer. The C++
trainer test runs this file to make one too."""
import sys

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = ("user assistant system you are a helpful bot hello hi how what is two plus three four "
         "five six the answer it sum of and thanks bye fine good name my friend think done "
         "please add numbers or , . ? !").split()

# ChatML; the assistant's content and end of turn inside {% generation %}, so
# that transformers gives its own assistant mask. "thinking" renders only
# the last assistant turn with a prefix (as Qwen3's template renders the
# reasoning of the last turn only): earlier turns render differently once
# later ones follow.
CHATML = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' -}}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- if thinking is defined and thinking and loop.last -%}{{- 'think done ' -}}{%- endif -%}"
    "{% generation %}{{- m['content'] + '<|im_end|>' -}}{% endgeneration %}{{- '\n' -}}"
    "{%- else -%}{{- m['content'] + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")
# The same with the last-turn prefix always on (Qwen3-like).
CHATML_LAST_TURN_THINKS = CHATML.replace("thinking is defined and thinking and loop.last",
                                         "loop.last")


def tiny_tokenizer(directory=None, template=CHATML, extra_words=()):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + list(extra_words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = template
    if directory is not None:
        fast.save_pretrained(directory)
    return fast


if __name__ == "__main__":
    # tiny_tokenizer.py DIR [last_turn_thinks] [extra words...]
    template = CHATML_LAST_TURN_THINKS if len(sys.argv) > 2 and sys.argv[2] == "thinks" else CHATML
    tiny_tokenizer(sys.argv[1], template, sys.argv[3:])
