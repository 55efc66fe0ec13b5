"""Instruction and chat data: the formats, the loss mask, packing, `zoo eval` and `zoo chat`,
and an end-to-end instruction finetune that answers held-out questions."""

import json
import random
import subprocess

import numpy as np
import pytest
from helpers import gemm_rounding, needs, zoo_command

import zoo
from zoo.text.chat_template import FALLBACK_TEMPLATE, ChatTemplate
from zoo.text.tokenizers import Tokenizer
from zoo.train.data import (
    IGNORE,
    DataError,
    PackedWindows,
    Windows,
    batches_for,
    tokenize_files,
)

ZOO = zoo_command()


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def tok():
    return Tokenizer.byte_level()


def _template():
    byte_level = Tokenizer.byte_level()
    return ChatTemplate(FALLBACK_TEMPLATE, "the fallback template", byte_level.bos_token, byte_level.eos_token)


def _examples(tf):
    starts = np.asarray(tf.starts)
    return [(np.asarray(tf.tokens[a:b]), np.asarray(tf.trained[a:b]).astype(bool)) for a, b in zip(starts, starts[1:])]


def test_prompt_completion_trains_on_the_completion_only(tmp_path, tok):
    f = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}])
    tf = tokenize_files([f], tok, tmp_path / "cache")
    assert tf.formats == ["prompt/completion"] and tf.masked
    (ids, trained), = _examples(tf)
    assert tok.decode(ids[trained].tolist()) == " 4" + tok.decode([tok.eos_id])
    assert not trained[: 1 + len(tok.encode("Q: 2+2?\nA:"))].any()  # BOS and the prompt


def test_chats_train_on_the_assistant_turns_only(tmp_path, tok):
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                         {"role": "assistant", "content": "Bye!"}]}
    f = _jsonl(tmp_path / "chat.jsonl", [chat])
    tf = tokenize_files([f], tok, tmp_path / "cache", _template())
    (ids, trained), = _examples(tf)
    assert tok.decode(ids.tolist()) == _template().render(chat["messages"])
    answers = tok.decode(ids[trained].tolist())
    assert "Hello." in answers and "Bye!" in answers
    assert "Hi" not in answers and "Be brief" not in answers and "user" not in answers


def test_alpaca_records_are_a_two_turn_chat(tmp_path, tok):
    f = _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "Add them.", "input": "2 and 3", "output": "5"},
                                           {"instruction": "Say hi.", "output": "hi"}])
    tf = tokenize_files([f], tok, tmp_path / "cache", _template())
    assert tf.formats == ["alpaca"]
    (ids, trained), _ = _examples(tf)
    assert tok.decode(ids.tolist()) == _template().render(
        [{"role": "user", "content": "Add them.\n\n2 and 3"}, {"role": "assistant", "content": "5"}])
    assert tok.decode(ids[trained].tolist()).startswith("5")


def test_text_records_and_text_files_are_one_stream(tmp_path, tok):
    f = _jsonl(tmp_path / "docs.jsonl", [{"text": "first document " * 20}, {"text": "second " * 30}])
    (tmp_path / "more.txt").write_text("plain text " * 40)
    tf = tokenize_files([f, tmp_path / "more.txt"], tok, tmp_path / "cache")
    assert tf.formats == ["text", "text"] and not tf.masked and len(tf.starts) == 4
    assert isinstance(batches_for(tf, 2, 16, 0.1, 1, 0, "data"), Windows)


def test_short_examples_are_packed_with_positions_restarting(tmp_path, tok):
    f = _jsonl(tmp_path / "pc.jsonl", [{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(12)])
    tf = tokenize_files([f], tok, tmp_path / "cache")
    w = batches_for(tf, 4, 32, 0.0, 1, 0, "data")
    assert isinstance(w, PackedWindows) and len(w.train_rows) < 12  # several examples per row
    x, y, positions = w.train_batch(0, 0)
    for r in range(x.shape[0]):
        starts = np.flatnonzero(positions[r] == 0)
        assert len(starts) >= 2 and starts[0] == 0
        for a in starts[1:]:  # no target crosses into the next example
            assert y[r, a - 1] in (tok.eos_id, IGNORE)
        # Every example (it begins with BOS) starts at position 0, and counts up from there.
        bos = np.flatnonzero(x[r] == tok.bos_id)
        assert len(bos) >= 2 and (positions[r, bos] == 0).all(), (bos, positions[r])
        following = positions[r, 1:]
        assert ((following == 0) | (following == positions[r, :-1] + 1)).all(), positions[r]
    # --train-on-everything: one stream again, every token a target
    assert isinstance(batches_for(tf, 4, 32, 0.0, 1, 0, "data", train_on_everything=True), Windows)


def test_an_answer_beyond_the_row_is_left_out_and_a_long_one_cut(tmp_path, tok):
    f = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "p" * 40, "completion": "c"},
                                       {"prompt": "p", "completion": "c" * 40}, {"prompt": "q", "completion": "a"}])
    w = PackedWindows(tokenize_files([f], tok, tmp_path / "cache"), 2, 16, 0.0, 1, 0)
    assert (w.dropped, w.truncated) == (1, 1)


def test_token_id_files(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(100, dtype=np.int64) % 50)
    (np.arange(60, dtype=np.uint16) % 50).tofile(tmp_path / "b.bin")
    tf = tokenize_files([tmp_path / "a.npy", tmp_path / "b.bin"], None, tmp_path / "cache", vocab_size=64)
    assert tf.formats == ["token ids", "token ids"] and len(tf.tokens) == 160
    np.save(tmp_path / "bad.npy", np.array([1, 2, 70]))
    with pytest.raises(DataError, match=r"bad.npy: token id 70 at index 2 is outside the vocabulary \[0, 64\)"):
        tokenize_files([tmp_path / "bad.npy"], None, tmp_path / "cache", vocab_size=64)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="odd.bin: 3 bytes is not a whole number of uint16 token ids"):
        tokenize_files([tmp_path / "odd.bin"], None, tmp_path / "cache", vocab_size=64)


@pytest.mark.parametrize("lines,message", [
    (['{"prompt": "a", "completion": "b"}', "{not json"], r"bad.jsonl, line 2: not JSON"),
    (['{"question": "a", "answer": "b"}'], r"bad.jsonl, line 1: a record with keys \['answer', 'question'\] is none"),
    (['{"prompt": "a", "completion": "b"}', '{"text": "c"}'], r"line 2: a text record in a file of prompt/completion"),
    (['{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}'],
     r"bad.jsonl, line 1: .*wizard"),
    (['{"messages": [{"role": "user", "content": "x"}]}'], r"line 1: the last message is 'user'"),
    (['{"prompt": 3, "completion": "b"}'], r"line 1: \"prompt\" must be a string"),
])
def test_bad_records_name_the_file_and_line(tmp_path, tok, lines, message):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        tokenize_files([f], tok, tmp_path / "cache", _template())


def test_a_template_that_fails_to_render_names_the_line(tmp_path, tok):
    f = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "x"},
                                                       {"role": "assistant", "content": "y"}]}])
    broken = ChatTemplate("{{ raise_exception('no chats here') }}", "tokenizer_config.json chat_template")
    with pytest.raises(DataError, match=r"chat.jsonl, line 1: .*no chats here"):
        tokenize_files([f], tok, tmp_path / "cache", broken)


# --- end to end -------------------------------------------------------------------------

# Names a byte-level model tells apart (no two start alike), and question forms that end with
# the name; measured here: 4 of 4 held-out questions right for 8 of 8 shuffles, with oneMKL and
# with OpenBLAS.
COLORS = {"apple": "red", "banana": "yellow", "cherry": "red", "date": "brown", "fig": "purple", "grape": "green",
          "kiwi": "brown", "lime": "green", "mango": "orange", "olive": "black", "plum": "purple", "tomato": "red",
          "walnut": "brown"}
FORMS = ["What color is the {}?", "Tell me the color of the {}.", "Color of the {}?", "Name the color of the {}."]


def _answer_log_likelihood(model, tok, template, question: str, answer: str) -> float:
    """log p(answer | the question rendered as the chat template renders it for a reply)."""
    prompt = tok.encode(template.render([{"role": "user", "content": question}], add_generation_prompt=True))
    ids = prompt + tok.encode(answer)
    logits = model.logits(np.asarray([ids[:-1]]))[0].astype(np.float64)
    logp = logits - logits.max(axis=1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
    return float(sum(logp[t - 1, ids[t]] for t in range(len(prompt), len(ids))))


@gemm_rounding
def test_an_instruction_finetune_answers_held_out_questions(tmp_path):
    """A tiny Llama trained on a few hundred chats of one form answers questions of that form it
    never saw (other phrasing and fruit combinations): for each, "It is <its color>." is the
    likeliest answer of that form over every color. The exact replies depend on the GEMM
    library's rounding over 300 steps, so `zoo chat` is compared with this process's greedy
    reply from the same folder; eval reproduces the trainer's val loss."""
    import io

    from zoo.chat import ChatSession

    pairs = [(form, fruit) for form in FORMS for fruit in COLORS]
    random.Random(0).shuffle(pairs)
    held, train = pairs[:4], pairs[4:]
    chats = [{"messages": [{"role": "user", "content": form.format(fruit)},
                           {"role": "assistant", "content": f"It is {COLORS[fruit]}."}]}
             for form, fruit in (train * 20)[:400]]
    data = _jsonl(tmp_path / "qa.jsonl", chats)
    run = tmp_path / "run"
    env_cache = ["--cache-dir", str(tmp_path / "cache")]
    # One thread: on a machine other work keeps busy, two spin at every OpenMP barrier (measured
    # under a load of 10 to 15 on 2 cores: 35-39 s at one thread, 166 s at two).
    out = subprocess.run(ZOO + ["train", "--preset", "tiny-llama", "--data", str(data), "--steps", "300",
                                "--batch-size", "8", "--seq-len", "256", "--lr", "3e-3", "--out", str(run),
                                "--no-progress", "--sample-tokens", "0", "--threads", "1", *env_cache],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "(1 chat)" in out.stderr + out.stdout and "packed rows" in out.stderr + out.stdout

    model, tok, template = zoo.Model.from_pretrained(run), Tokenizer.from_pretrained(run), ChatTemplate.for_folder(run)
    for form, fruit in held:
        question = form.format(fruit)
        scores = {c: _answer_log_likelihood(model, tok, template, question, f"It is {c}.")
                  for c in set(COLORS.values())}
        assert max(scores, key=scores.get) == COLORS[fruit], (question, scores)
    greedy = {}
    for form, fruit in held[:2]:
        session = ChatSession(model, tok, template, temperature=0.0, max_new_tokens=40)
        greedy[form, fruit] = session.reply(form.format(fruit), file=io.StringIO())
        reply = subprocess.run(ZOO + ["chat", "--from", str(run), "--prompt", form.format(fruit),
                                      "--temperature", "0", "--max-new-tokens", "40"],
                               capture_output=True, text=True, timeout=120)
        assert reply.returncode == 0, reply.stderr
        assert reply.stdout.strip() == greedy[form, fruit], (form, fruit, reply.stdout)
    # interactive: one reply per line read (blank lines skipped), the conversation carried along
    # (a second turn is beyond what one-turn training data teaches: only that it comes)
    (form1, fruit1), (form2, fruit2) = held[:2]
    talk = subprocess.run(ZOO + ["chat", "--from", str(run), "--temperature", "0", "--max-new-tokens", "40"],
                          input=f"{form1.format(fruit1)}\n\n{form2.format(fruit2)}\n", capture_output=True, text=True,
                          timeout=120)
    assert talk.returncode == 0, talk.stderr
    lines = talk.stdout.strip().split("\n")
    assert lines[0] == greedy[form1, fruit1] and len(lines) >= 2

    # eval on training's one thread: OpenBLAS's products round differently on one thread and on
    # two (2048 x 64 times 64 x 176: up to 1.5e-5 apart), which moves a loss this near zero by
    # 1e-6 (the Clad build on a Zen 3). zoo's results are exact for a given thread count.
    result = tmp_path / "eval.json"
    ev = subprocess.run(ZOO + ["eval", "--from", str(run), "--split", "val", "--json", str(result), "--threads", "1",
                               *env_cache],
                        capture_output=True, text=True, timeout=120)
    assert ev.returncode == 0, ev.stderr
    last_val = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if "val_loss" in line][-1]["val_loss"]
    assert json.loads(result.read_text())["loss"] == pytest.approx(last_val, rel=1e-9)


def test_token_ids_train_a_checkpoint_without_a_tokenizer(tmp_path):
    folder = tmp_path / "bare"
    model = zoo.Model(zoo.preset("tiny-llama"), seed=0)
    model.save_pretrained(folder)
    assert not any(folder.glob("*token*"))
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 256, 4000))
    out = subprocess.run(ZOO + ["finetune", "--from", str(folder), "--data", str(tmp_path / "ids.npy"),
                                "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--out", str(tmp_path / "run"),
                                "--no-progress", "--threads", "1", "--cache-dir", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "(1 token ids)" in out.stderr + out.stdout
    (tmp_path / "text.txt").write_text("some text")
    out = subprocess.run(ZOO + ["finetune", "--from", str(folder), "--data", str(tmp_path / "text.txt"),
                                "--steps", "1", "--out", str(tmp_path / "run2"), "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no tokenizer here" in out.stderr


# --- chat templates against transformers -------------------------------------------------

LLAMA3_STYLE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
                "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
SYSTEM_BRANCH = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
                 "{% set messages = messages[1:] %}{% else %}{% set system = 'You are helpful.' %}{% endif %}"
                 "<|system|>\n{{ system }}{{ eos_token }}\n"
                 "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}{{ eos_token }}\n"
                 "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}{{ eos_token }}\n"
                 "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize("source", [FALLBACK_TEMPLATE, LLAMA3_STYLE, SYSTEM_BRANCH], ids=["chatml", "llama3", "system"])
@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("system", [False, True])
@needs("tokenizers", "transformers")
def test_rendering_equals_transformers_apply_chat_template(source, generation_prompt, system):
    import tokenizers
    import transformers

    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        bos_token="<s>", eos_token="</s>")
    hf.chat_template = source
    messages = ([{"role": "system", "content": "Answer in French."}] if system else []) + [
        {"role": "user", "content": "  Bonjour? "}, {"role": "assistant", "content": "Salut, ça va ? 🙂"},
        {"role": "user", "content": "Oui"}]
    ours = ChatTemplate(source, "test", bos_token="<s>", eos_token="</s>")
    assert ours.render(messages, add_generation_prompt=generation_prompt) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt)
    with_answer = messages + [{"role": "assistant", "content": "Très bien."}]
    pieces = ours.segments(with_answer)
    assert "".join(p for p, _ in pieces) == ours.render(with_answer)
    assert [p for p, trained in pieces if trained][-1].startswith("Très bien.")
