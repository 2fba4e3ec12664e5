"""The original's Qwen3 fine-tuning quick start
(docs/UserGuide/QuickStart/qwen3_nekoqa.en.md), its cells as written, on a
tiny random-weight Qwen3 and the tiny word-level tokenizer saved to a local
directory (the page: "Replace with a local path if needed"), and ten
NekoQA-like samples (instruction / output) plus one too long, from a
stand-in load_dataset. Asserted: the samples kept and printed; greedy
generation picks the oracle's top token; the training loop's printed epoch
losses are the mean of the microbatch losses of transformers on the
initial weights (asynchronous steps: both one-batch epochs run one update
old); the loss scale stays 2^16 without an overflow; after synchronize()
the float16 model holds the float32 masters, save_pretrained writes them,
and generation after fine-tuning follows the saved model.

Tolerances: ours runs float16, the oracle (transformers) float32 on the
same float16 weights. Each of the 2 decoder layers rounds its residual
stream to float16 (2^-11 relative) at most 8 times (norms, attention,
MLP, residual adds), the final norm and lm_head once more: the logits
differ by at most 16 such roundings of the largest logit (LOGIT_TOL); a
cross entropy moves by at most 2 * max|logit change| (its gradient in the
logits has an L1 norm of at most 2)."""
import copy
import random

import pytest
import torch
from tiny_tokenizer import CHATML_LAST_TURN_THINKS, WORDS, tiny_tokenizer

LOGIT_TOL = 16 * 2.0**-11


@pytest.fixture
def model_dir(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = tmp_path / "tiny-qwen3"
    tok = tiny_tokenizer(str(directory), CHATML_LAST_TURN_THINKS)  # Qwen3-like: the reply after "think done"
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    Qwen3ForCausalLM(config).save_pretrained(str(directory))
    return str(directory)


def samples():
    rng = random.Random(0)
    words = [w for w in WORDS if w not in ("user", "assistant", "system")]

    def sentence():
        return " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))

    kept = [{"instruction": sentence(), "output": sentence()} for _ in range(10)]
    return kept + [{"instruction": "hello", "output": " ".join(["hi"] * 800)}]  # 2400 characters: filtered


def load_dataset(name, split):
    """Stands in for datasets.load_dataset: no downloads in the tests."""
    assert (name, split) == ("liumindmind/NekoQA-10K", "train")
    return samples()


def oracle_loss(oracle, ids, mask):
    """transformers' loss of each row alone (its padding dropped)."""
    with torch.no_grad():
        return [oracle(input_ids=r[m.bool()][None], labels=r[m.bool()][None]) for r, m in zip(ids, mask)]


def check_generation(generated, oracle):
    """Every token generate() appended is within 2 LOGIT_TOL of the top of
    the oracle's logits after its prefix: ours picks the top of logits
    that differ from the oracle's by at most LOGIT_TOL."""
    assert generated
    for prompt_len, ids in generated:
        assert ids.shape[1] > prompt_len
        with torch.no_grad():
            logits = oracle(input_ids=ids).logits[0].float()
        tol = LOGIT_TOL * logits.abs().max().item()
        for t in range(prompt_len, ids.shape[1]):
            row = logits[t - 1]
            assert row[ids[0, t]] >= row.max() - 2 * tol, (t, row[ids[0, t]].item(), row.max().item())


def test_the_notebook(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # 1. Setup and Dependencies
    import torch
    from transformers import AutoTokenizer, AutoModelForCausalLM
    from tqdm import tqdm

    from roundpipe import wrap_model_to_roundpipe, RoundPipeRunConfig, GradScaler
    from roundpipe.optim import Adam

    # 2. Load the Model and Tokenizer
    MODEL_NAME = model_dir  # Replace with a local path if needed

    tokenizer = AutoTokenizer.from_pretrained(MODEL_NAME)
    raw_model = AutoModelForCausalLM.from_pretrained(
        MODEL_NAME,
        use_cache=False,
        dtype=torch.float16,
    )
    oracle = copy.deepcopy(raw_model).float().eval()  # the initial weights, in float32

    # 3. Wrap the Model with RoundPipe
    model = wrap_model_to_roundpipe(
        raw_model,
        model_run_config=RoundPipeRunConfig(num_microbatch=10),
        optim_dtype=torch.float32,
    )
    optim = Adam(model.optim_parameters(), lr=1e-5)
    scaler = GradScaler()
    initial = {n: p.detach().clone() for n, p in model.optim_named_parameters()}
    assert model.num_layers == 2 + 2  # Prefix -> DecoderLayers -> Postfix
    assert "[INFO] Replace model" in capsys.readouterr().err

    # 4. Prepare the NekoQA-10K Dataset
    dataset = load_dataset("liumindmind/NekoQA-10K", split="train")

    text_input = []
    for sample in dataset:
        messages = [
            {"role": "user", "content": sample["instruction"]},
            {"role": "assistant", "content": sample["output"]},
        ]
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False
        )
        if len(text) < 2000:  # Filter out overly long samples
            text_input.append(text)

    print(f"Training samples: {len(text_input)}")
    print(f"\nExample:\n{text_input[0][:300]}...")
    out = capsys.readouterr().out
    assert "Training samples: 10\n" in out
    assert f"Example:\n<|im_start|>user\n{dataset[0]['instruction']}<|im_end|>" in out

    BATCH_SIZE = 10  # (the page: 80 of 10041 samples; here one batch of all 10)
    dataloader = torch.utils.data.DataLoader(text_input, batch_size=BATCH_SIZE, shuffle=True)

    def tokenize(texts):
        """Tokenize a batch of texts and build labels, with pad positions set to -100 so they are ignored in the loss."""
        enc = tokenizer(texts, return_tensors="pt", padding=True, truncation=False)
        labels = enc["input_ids"].clone()
        labels[labels == tokenizer.pad_token_id] = -100
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}, labels

    # 5. Baseline Output Before Fine-Tuning
    prompt_lengths, generated = [], []  # for the oracle: prompt lengths, the ids generate() decodes
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: (generated.append(ids[None]), decode(ids, **kw))[1])

    @torch.no_grad()
    def generate(prompt, max_new_tokens=128):
        """A simple greedy decoder for comparing outputs before and after fine-tuning."""
        model.synchronize()
        model.eval()
        messages = [
            {"role": "user", "content": prompt},
        ]
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        input_ids = tokenizer(text, return_tensors="pt")["input_ids"]
        prompt_lengths.append(input_ids.shape[1])
        for _ in tqdm(range(max_new_tokens)):
            attention_mask = torch.ones_like(input_ids)
            outputs = model(
                input_ids=input_ids.to(torch.long),
                attention_mask=attention_mask,
                roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1),
            )
            next_id = outputs.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            input_ids = torch.cat([input_ids, next_id], dim=-1)
            if next_id.item() == tokenizer.eos_token_id:
                break
        model.train()
        return tokenizer.decode(input_ids[0], skip_special_tokens=True)

    test_prompts = [
        "hello !",
        "what is two plus three ?",
        "how are you my friend ?",
    ]

    print("===== Before Fine-Tuning =====")
    for p in test_prompts:
        print(f"\nUser: {p}")
        print(f"Model: {generate(p, max_new_tokens=3)}")  # (the page: 128 new tokens)
    out = capsys.readouterr().out
    for p, n, (ids,) in zip(test_prompts, prompt_lengths, generated):
        # the prompt and the reply, special tokens skipped
        assert f"User: {p}\nModel: {decode(ids[:n], skip_special_tokens=True)} " in out
        assert f"{decode(ids, skip_special_tokens=True)}\n" in out
    check_generation(list(zip(prompt_lengths, generated)), oracle)
    assert model.training  # generate() switched back to training mode

    # 6. Training Loop
    NUM_EPOCHS = 2
    NUM_MICROBATCH = 10  # Must match RoundPipeRunConfig

    def optimizer_step():
        scaler.step(optim)
        optim.zero_grad()

    for epoch in range(NUM_EPOCHS):
        model.train()
        epoch_loss = []
        for batch_texts in tqdm(dataloader):
            input_dict, labels = tokenize(batch_texts)
            loss = model.forward_backward(
                input_kwargs=input_dict,
                label=labels,
                loss_fn=lambda outputs, labels: scaler.scale(
                    model.loss_function(
                        logits=outputs.logits, labels=labels, vocab_size=model.vocab_size
                    )
                    / NUM_MICROBATCH
                ),
            )
            loss_item = loss.item() / scaler.get_scale()
            epoch_loss.append(loss_item)

            model.step(optimizer_step)
            scaler.update()

        mean_loss = sum(epoch_loss) / len(epoch_loss)
        print(f"Epoch {epoch + 1}/{NUM_EPOCHS}, Loss: {mean_loss:.4f}")

    # Each microbatch is one row: the loss is the mean of the rows' own
    # mean token losses, on the initial weights in both epochs.
    input_dict, _ = tokenize(text_input)
    rows = oracle_loss(oracle, input_dict["input_ids"], input_dict["attention_mask"])
    expected = sum(r.loss.item() for r in rows) / len(rows)
    largest_logit = max(r.logits.abs().max().item() for r in rows)
    tol = 2 * LOGIT_TOL * largest_logit + 5e-5  # and the printed rounding to 4 decimals
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch ")]
    assert [line.split(",")[0] for line in printed] == ["Epoch 1/2", "Epoch 2/2"]
    for line in printed:
        assert float(line.split("Loss: ")[1]) == pytest.approx(expected, abs=tol)
    assert scaler.get_scale() == 2.0**16  # no overflow, no skipped step

    # 7. Output After Fine-Tuning (generate() synchronizes first)
    prompt_lengths.clear()
    generated.clear()
    print("===== After Fine-Tuning =====")
    for p in test_prompts:
        print(f"\nUser: {p}")
        print(f"Model: {generate(p, max_new_tokens=3)}")

    # 8. Save the Fine-Tuned Model
    model.synchronize()
    model.save_pretrained("./Qwen3-1.7B-nekoqa-finetuned")

    saved = AutoModelForCausalLM.from_pretrained("./Qwen3-1.7B-nekoqa-finetuned", dtype=torch.float16)
    masters = dict(model.optim_named_parameters())
    moved = False
    assert set(masters) == {n for n, _ in saved.named_parameters()}
    for name, p in saved.named_parameters():
        assert torch.equal(p, masters[name].to(torch.float16)), name  # the fine-tuned weights
        assert torch.equal(p, dict(raw_model.named_parameters())[name])  # raw_model holds them too
        moved |= not torch.equal(masters[name], initial[name])
    assert moved  # two Adam steps changed the masters
    check_generation(list(zip(prompt_lengths, generated)), saved.float().eval())
