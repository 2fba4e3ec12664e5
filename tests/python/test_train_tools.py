"""roundpipe.prepare (tokenisation and label masks against the tokenizer's
own output, for every data format and file type), the token file,
roundpipe.train (against a plain transformers + torch loop: clipping,
schedules, accumulation, evaluation), its metrics and TensorBoard files,
and roundpipe.plot."""
import copy
import json
import math
import os

import pytest
import torch

from conftest import ADAM_EPS, assert_adam_weights_close, roundpipe_train_binary
from hf_models import tiny_qwen3
from tiny_tokenizer import CHATML, CHATML_LAST_TURN_THINKS, tiny_tokenizer

from roundpipe import TrainingArguments, train
from roundpipe.plot import main as plot_main
from roundpipe.plot import read_metrics
from roundpipe.prepare import (main as prepare_main, tokenize_chat, tokenize_prompt_completion,
                               tokenize_text, to_messages)
from roundpipe.token_file import Example, TokenFile, write_token_file
from roundpipe.trainer import collate, pack, step_batches

CHAT = [{"role": "system", "content": "you are a helpful bot"},
        {"role": "user", "content": "what is two plus three ?"},
        {"role": "assistant", "content": "five"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "good bye !"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    directory = str(tmp_path_factory.mktemp("tokenizer"))
    tiny_tokenizer(directory)
    return AutoTokenizer.from_pretrained(directory)  # as roundpipe.prepare loads it


def test_text_is_the_tokenizers_ids_plus_eos_all_trained(tokenizer):
    ex = tokenize_text(tokenizer, "hello my friend")
    assert ex.input_ids == tokenizer("hello my friend")["input_ids"] + [tokenizer.eos_token_id]
    assert ex.input_ids[0] == tokenizer.bos_token_id
    assert ex.trained == [1] * len(ex.input_ids)


def test_prompt_completion_trains_on_the_completion_and_eos_only(tokenizer):
    ex = tokenize_prompt_completion(tokenizer, "what is two plus three ?", "five")
    prompt = tokenizer("what is two plus three ?")["input_ids"]
    completion = tokenizer("five", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ex.input_ids == prompt + completion
    assert ex.trained == [0] * len(prompt) + [1] * len(completion)
    assert tokenize_prompt_completion(tokenizer, "hi", "five", train_on="all").trained == [1] * 4


# The answer's words also appear earlier, in the system and user messages.
ECHO = [{"role": "system", "content": "five or six"},
        {"role": "user", "content": "what is two plus three ? five or six ?"},
        {"role": "assistant", "content": "five"},
        {"role": "user", "content": "and two plus four ?"},
        {"role": "assistant", "content": "six"}]


@pytest.mark.parametrize("template", [CHATML, CHATML_LAST_TURN_THINKS], ids=["chatml", "last_turn_thinks"])
@pytest.mark.parametrize("chat", [CHAT, ECHO], ids=["chat", "answers_echo_the_prompt"])
def test_chat_masks_are_transformers_assistant_masks(tokenizer, template, chat):
    """Assistant spans found in the rendered text (any template) give the
    mask transformers computes from the template's {% generation %} markers,
    also where the last turn renders differently from earlier ones and
    where an answer's words appear earlier in the conversation."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    ours = tokenize_chat(tok, chat, use_generation_markers=False)
    theirs = tok.apply_chat_template(chat, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    assert ours.input_ids == list(theirs["input_ids"])
    assert ours.trained == [int(m) for m in theirs["assistant_masks"]]
    answers = sum(len(m["content"].split()) + 1 for m in chat if m["role"] == "assistant")
    assert sum(ours.trained) == answers  # each answer's words and its <|im_end|>
    assert tokenize_chat(tok, chat) == ours  # the markers' path gives the same
    assert tokenize_chat(tok, chat, train_on="all").trained == [1] * len(ours.input_ids)


@pytest.mark.parametrize("template", [CHATML, CHATML_LAST_TURN_THINKS], ids=["chatml", "last_turn_thinks"])
def test_an_assistant_turn_without_content_trains_what_the_template_writes(tokenizer, template):
    """A turn without content (as a tool call's) is no error: what the
    template writes for it (here its end of turn) is trained, as with
    transformers' mask."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""},
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    ours = tokenize_chat(tok, chat, use_generation_markers=False)
    assert ours == tokenize_chat(tok, chat, use_generation_markers=True)
    assert sum(ours.trained) == 3  # "<|im_end|>", then "hello <|im_end|>"


def test_sharegpt_conversations_are_messages(tokenizer):
    who = {"system": "system", "user": "human", "assistant": "gpt"}
    row = {"conversations": [{"from": who[m["role"]], "value": m["content"]} for m in CHAT]}
    assert to_messages(row) == CHAT
    with pytest.raises(ValueError, match="ShareGPT turn from 'robot'"):
        to_messages({"conversations": [{"from": "robot", "value": "hi"}]})


def _write_rows(rows, path):
    import datasets
    table = datasets.Dataset.from_list(rows)
    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    elif path.endswith(".parquet"):
        table.to_parquet(path)
    else:
        table.to_csv(path, index=False)


@pytest.mark.parametrize("ext", ["jsonl", "parquet", "csv"])
def test_prepare_writes_what_the_tokenizer_gives_for_each_file_type(tokenizer, tmp_path, ext):
    rows = [{"prompt": "what is two plus three ?", "completion": "five"},
            {"prompt": "hello", "completion": "hi my friend !"}]
    data, out = str(tmp_path / f"data.{ext}"), str(tmp_path / "data.rpt")
    _write_rows(rows, data)
    assert prepare_main(["--tokenizer", tokenizer.name_or_path, "--data", data, "--output", out]) == 0
    f = TokenFile(out)
    assert len(f) == 2
    for row, ex in zip(rows, f):
        assert ex == tokenize_prompt_completion(tokenizer, row["prompt"], row["completion"])
    assert f.header["source_format"] == "prompt_completion"
    assert f.header["tokenizer"] == tokenizer.name_or_path
    assert f.header["chat_template_fingerprint"] == ""  # no template applied
    assert len(f.header["tokenizer_fingerprint"]) == 16


def test_prepare_chat_records_the_template_and_names_bad_rows(tokenizer, tmp_path, capsys):
    data, out = str(tmp_path / "chat.jsonl"), str(tmp_path / "chat.rpt")
    _write_rows([{"messages": CHAT}], data)
    assert prepare_main(["--tokenizer", tokenizer.name_or_path, "--data", data, "--output", out]) == 0
    f = TokenFile(out)
    assert f[0] == tokenize_chat(tokenizer, CHAT)
    assert f.header["chat_template_fingerprint"] != ""
    assert f.header["trained_tokens"] == 6
    _write_rows([{"messages": [{"role": "user"}]}], data)
    assert prepare_main(["--tokenizer", tokenizer.name_or_path, "--data", data, "--output", out]) == 1
    assert "example 0" in capsys.readouterr().err
    _write_rows([{"question": "hi"}], data)
    assert prepare_main(["--tokenizer", tokenizer.name_or_path, "--data", data, "--output", out]) == 1
    assert "cannot tell the data's format" in capsys.readouterr().err


def test_token_file_round_trip_and_cut(tmp_path):
    examples = [Example([5, 6, 7], [0, 1, 1]), Example([9] * 10, [1] * 10)]
    path = str(tmp_path / "t.rpt")
    header = write_token_file(path, examples, {"tokenizer": "none"})
    assert header["num_tokens"] == 13 and header["max_token_id"] == 9
    f = TokenFile(path, max_tokens=4)
    assert f[0] == examples[0] and f[0].labels == [-100, 6, 7]
    assert f[1].input_ids == [9] * 4
    with open(str(tmp_path / "bad.rpt"), "wb") as bad:
        bad.write(b"not a token file")
    with pytest.raises(ValueError, match="not a valid token file"):
        TokenFile(str(tmp_path / "bad.rpt"))


def _examples(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(6, 20, (1,), generator=g))
        ids = torch.randint(3, 90, (length,), generator=g).tolist()
        prompt = int(torch.randint(1, length - 2, (1,), generator=g))
        out.append(Example(ids, [0] * prompt + [1] * (length - prompt)))
    return out


def _plain_oracle(model, data, args, total_steps, optimizer_class=torch.optim.AdamW):
    """The same steps in plain transformers + torch: AdamW (or
    `optimizer_class`) with the same param groups, transformers' schedule,
    clip_grad_norm_, synchronous."""
    from transformers import get_scheduler
    named = list(model.named_parameters())
    groups = [dict(params=[p for n, p in named if not n.endswith(".bias") and "norm" not in n],
                   weight_decay=args.weight_decay),
              dict(params=[p for n, p in named if n.endswith(".bias") or "norm" in n], weight_decay=0.0)]
    opt = optimizer_class([g for g in groups if g["params"]], lr=args.lr, eps=args.adam_epsilon)
    warmup = math.ceil(args.warmup_ratio * total_steps)
    sched = get_scheduler(args.lr_schedule, opt, num_warmup_steps=warmup, num_training_steps=total_steps)
    losses, norms, lrs = [], [], []
    for step in range(total_steps):
        batches = step_batches(data, args, step, 2)
        items = sum(int((b["labels"][:, 1:] != -100).sum()) for b, _ in batches)
        loss = 0.0
        for b, _ in batches:
            out = model(**b, num_items_in_batch=items)
            out.loss.backward()
            loss += float(out.loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss)
    return losses, norms, lrs, opt


def test_train_matches_plain_transformers_with_clipping_schedule_and_accumulation(tmp_path):
    """roundpipe.train (synchronous steps, padded batches, 2 accumulated
    calls a step, cosine with warmup, clipping that binds) against the same
    steps in plain transformers and torch: losses, gradient norms, learning
    rates and the trained weights."""
    data = _examples(48)
    args = TrainingArguments(output_dir=str(tmp_path / "run"), batch_size=4, grad_accum=2, max_steps=5,
                             lr=3e-3, lr_schedule="cosine", warmup_ratio=0.2, weight_decay=0.1,
                             max_grad_norm=0.5, packing=False, num_microbatch=2, sync_step=True,
                             save_model=False, tensorboard=False, adam_epsilon=ADAM_EPS)
    model = tiny_qwen3()
    oracle = copy.deepcopy(model)
    result = train(model, data, args)
    losses, norms, lrs, _ = _plain_oracle(oracle, data, args, 5)
    assert result.losses == pytest.approx(losses, rel=1e-4)
    assert result.grad_norms == pytest.approx(norms, rel=1e-4)
    assert all(n > args.max_grad_norm for n in norms), "clipping never bound: the test shows nothing"
    assert result.learning_rates == pytest.approx(lrs)
    assert lrs[0] == 0 and lrs[1] == pytest.approx(3e-3)  # warmup of ceil(0.2 * 5) = 1 update
    # (ADAM_EPS on both sides: weights after Adam compare only so, conftest.)
    for p, q in zip(model.parameters(), oracle.parameters()):
        assert_adam_weights_close(p, q, steps=4, lr=3e-3)  # 5 updates, the first at lr 0


def test_accumulation_equals_one_big_batch(tmp_path):
    data = _examples(64, seed=1)
    runs = []
    for batch, accum in ((8, 1), (4, 2)):
        args = TrainingArguments(output_dir=str(tmp_path / f"b{batch}"), batch_size=batch,
                                 grad_accum=accum, max_steps=3, lr=1e-3, packing=False,
                                 num_microbatch=2, sync_step=True, save_model=False, tensorboard=False)
        runs.append(train(tiny_qwen3(), data, args).losses)
    assert runs[1] == pytest.approx(runs[0], rel=1e-4)


def test_packed_rows_keep_examples_apart():
    examples = [Example([5, 6, 7], [1, 1, 1]), Example([8, 9], [0, 1]), Example([10] * 4, [1] * 4)]
    b = pack(examples, seq_len=6, min_rows=2)
    assert b["input_ids"].shape[0] == 2
    for r in range(2):
        starts = (b["position_ids"][r] == 0).nonzero().flatten().tolist()
        for s in starts:
            assert b["labels"][r, s] == -100  # no label crosses from one example into the next
    assert int((b["labels"] != -100).sum()) == 3 - 1 + 1 + 4 - 1
    padded = collate(examples)
    assert padded["attention_mask"].sum() == 9
    # the loss's count (the targets of the shift): each example's trained
    # tokens after its first, packed or padded alike
    for batch in (b, padded):
        assert int((batch["labels"][:, 1:] != -100).sum()) == sum(sum(e.trained[1:]) for e in examples) == 6


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_learning_rates_are_transformers_schedules(kind):
    """roundpipe.train's (and roundpipe-train's) schedule, roundpipe._C's,
    against transformers' get_scheduler, update by update."""
    from transformers import get_scheduler
    from roundpipe import _C
    total, ratio = 11, 0.2
    ours = _C.LrSchedule(kind, 3e-3, ratio, 0, total)
    assert ours.warmup_steps == math.ceil(ratio * total) == 3
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    sched = get_scheduler(kind if kind != "constant" else "constant_with_warmup", opt,
                          num_warmup_steps=3, num_training_steps=total)
    for done in range(total):
        assert ours.at(done) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-18), done
        opt.step()
        sched.step()


def test_metrics_tensorboard_evaluation_and_plot(tmp_path):
    pytest.importorskip("tensorboard")
    data_path = str(tmp_path / "data.rpt")
    write_token_file(data_path, _examples(40, seed=2), {"tokenizer": "test"})
    out = str(tmp_path / "run")
    result = train(tiny_qwen3(), data_path, output_dir=out, batch_size=4, max_steps=6, lr=2e-3,
                   eval_fraction=0.1, eval_every=3, num_microbatch=2, lr_schedule="linear",
                   warmup_steps=2, save_model=True)
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    steps = [l for l in lines if "loss" in l]
    assert [l["step"] for l in steps] == [1, 2, 3, 4, 5, 6]
    for l, norm, lr in zip(steps, result.grad_norms, result.learning_rates):
        assert l["grad_norm"] == norm and l["lr"] == lr and l["tokens_per_second"] > 0
    assert [l["lr"] for l in steps[:3]] == pytest.approx([0.0, 1e-3, 2e-3])
    evals = [l for l in lines if "eval_loss" in l]
    assert [l["step"] for l in evals] == [3, 6]
    assert evals[-1]["eval_perplexity"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))
    events = os.listdir(os.path.join(out, "tensorboard"))
    assert any(e.startswith("events.out.tfevents") for e in events)
    assert os.path.exists(os.path.join(out, "config.json"))  # save_pretrained
    m = read_metrics(out)
    assert m["loss"] == pytest.approx(result.losses) and m["eval_step"] == [3, 6]
    png = str(tmp_path / "curves.png")
    assert plot_main([out, os.path.join(out, "metrics.jsonl"), "-o", png]) == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert plot_main([str(tmp_path / "nowhere"), "-o", png]) == 1


def test_evaluation_loss_is_transformers(tmp_path):
    data = _examples(7, seed=3)
    model = tiny_qwen3()
    oracle = copy.deepcopy(model)
    result = train(model, data[:4], output_dir=str(tmp_path / "ev"), batch_size=4, max_steps=1,
                   lr=1e-9, eval_data=data[4:], num_microbatch=2, save_model=False, tensorboard=False,
                   sync_step=True, max_grad_norm=0)
    total = count = 0.0
    with torch.no_grad():
        for e in data[4:]:
            labels = torch.tensor([e.labels])
            n = int((labels[:, 1:] != -100).sum())
            total += float(oracle(input_ids=torch.tensor([e.input_ids]), labels=labels).loss) * n
            count += n
    assert result.eval_losses[-1][1] == pytest.approx(total / count, rel=1e-4)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="lr_schedule must be"):
        TrainingArguments(lr_schedule="exp").validate()
    with pytest.raises(ValueError, match="eval_data or eval_fraction"):
        TrainingArguments(eval_data=[], eval_fraction=0.1).validate()
    with pytest.raises(TypeError, match="unknown argument 'epochs'"):
        train(None, [], epochs=3)


def test_roundpipe_train_takes_a_prepared_chat_file_of_its_models_tokenizer(tmp_path):
    """roundpipe.prepare, then the C++ roundpipe-train on a HuggingFace
    checkpoint saved with that tokenizer: it trains (a gradient norm a step
    in the metrics) and writes nothing to stderr; a file of another tokenizer, or of another chat
    template, is refused before training, naming the fix."""
    import subprocess
    model_dir = str(tmp_path / "model")
    tiny_qwen3().save_pretrained(model_dir)
    tiny_tokenizer(model_dir)
    data = str(tmp_path / "chats.jsonl")
    _write_rows([{"messages": CHAT}] * 12, data)

    def prepare(tokenizer_dir, name):
        out = str(tmp_path / name)
        assert prepare_main(["--tokenizer", tokenizer_dir, "--data", data, "--output", out]) == 0
        return out

    def run(token_file, output):
        return subprocess.run([roundpipe_train_binary(), "--model", model_dir, "--data", token_file,
                               "--devices", "sim:2", "--steps", "3", "--batch-size", "4",
                               "--seq-len", "64", "--output", str(tmp_path / output)],
                              capture_output=True, text=True, timeout=600)

    done = run(prepare(model_dir, "ours.rpt"), "trained")
    assert done.returncode == 0, done.stderr
    # A clean run prints progress and results only (issue 33: no LibTorch
    # "Memory block of unknown size" warning from the engine's meter).
    assert done.stderr == "", done.stderr
    lines = [json.loads(l) for l in open(tmp_path / "trained" / "metrics.jsonl")]
    assert [l["step"] for l in lines if "loss" in l] == [1, 2, 3]
    assert all(l["grad_norm"] > 0 for l in lines if "loss" in l)

    other = str(tmp_path / "other_tokenizer")
    tiny_tokenizer(other, extra_words=["zebra"])
    refused = run(prepare(other, "theirs.rpt"), "refused")
    assert refused.returncode == 1 and "another tokenizer.json" in refused.stderr, refused.stderr

    other_template = str(tmp_path / "other_template")
    tiny_tokenizer(other_template, template=CHATML_LAST_TURN_THINKS)
    refused = run(prepare(other_template, "template.rpt"), "refused2")
    assert refused.returncode == 1 and "chat template" in refused.stderr, refused.stderr
