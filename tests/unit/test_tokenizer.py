"""Tokenizer loading, chat template, streaming detokenisation and stop-string search.

stories260K: SentencePiece BPE with byte fallback (vocab 512, committed fixture).
SmolLM2: GPT-2-style byte-level BPE, from the GGUF metadata and from the shared HF folder.
"""

from __future__ import annotations

import os
import random

import pytest

from engine.tokenizer import IncrementalDetokenizer, apply_chat_template, find_stop, load_tokenizer
from engine.weights.gguf_loader import default_model_path

from tests.conftest import SHARED  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "stories260K")
SMOLLM2_HF = os.path.join(SHARED, "models", "smollm2-135m-instruct")
MULTIBYTE = "naïve café 日本語 😀"
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def stories():
    return load_tokenizer(FIXTURE)


@pytest.fixture(scope="module")
def smollm2_hf():
    return load_tokenizer(SMOLLM2_HF)


@pytest.fixture(scope="module")
def smollm2_gguf_folder(tmp_path_factory) -> str:
    try:
        gguf_path = default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    folder = tmp_path_factory.mktemp("gguf_only")
    os.symlink(gguf_path, folder / os.path.basename(gguf_path))
    return str(folder)


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_gguf_folder):
    return load_tokenizer(smollm2_gguf_folder)  # a folder holding only a .gguf


def stream(tokenizer, ids: list[int], chunk: int = 1, **kwargs) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas, detok.flush()


def test_stories260k_multibyte_deltas_are_whole_characters(stories) -> None:
    ids = stories.encode(MULTIBYTE)
    assert ids == [1, 297, 412, 198, 178, 360, 280, 412, 431, 485, 410, 233, 154, 168, 233, 159,
                   175, 235, 173, 161, 410, 243, 162, 155, 131]
    deltas, rest = stream(stories, ids)
    # byte-fallback runs (<0xC3><0xAF>, the nine CJK bytes, the emoji) are released whole, by
    # the next non-byte token or by flush; "▁c" keeps its space because it is not first
    assert deltas == ["", "n", "a", "", "", "ïve", " c", "a", "f", "é", " ", "", "", "", "", "",
                      "", "", "", "", "日本語 ", "", "", "", ""]
    assert rest == "😀"
    assert "".join(deltas) + rest == stories.decode(ids, skip_special_tokens=True) == MULTIBYTE
    assert not any(REPLACEMENT in d for d in deltas + [rest])


def test_stories260k_byte_fallback_newline_and_special_tokens_kept(stories) -> None:
    ids = stories.encode("Hello\nworld") + [2]
    assert ids == [1, 346, 306, 414, 13, 424, 304, 341, 2]  # 13 is <0x0A>
    deltas, rest = stream(stories, ids, skip_special_tokens=False)
    assert deltas == ["<s>", " He", "ll", "o", "", "\nw", "or", "ld", "</s>"]
    assert "".join(deltas) + rest == stories.decode(ids) == "<s> Hello\nworld</s>"


def test_stories260k_invalid_bytes_match_batch_decode(stories) -> None:
    # "=" then a lone 0xF6: ByteFallback turns the whole run into U+FFFD, so "=" must be held
    ids = [341, 64, 249, 333]  # ld <0x3D> <0xF6> ig
    deltas, rest = stream(stories, ids)
    assert deltas == ["ld", "", "", REPLACEMENT * 2 + "ig"]
    assert "".join(deltas) + rest == stories.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_random_ids_deltas_concatenate_to_decode(stories, smollm2_hf, skip, chunk) -> None:
    rng = random.Random(1234)
    for tokenizer, vocab in ((stories, 512), (smollm2_hf, 49152)):
        for _ in range(50):
            # bias towards low ids: byte tokens live there in both vocabularies
            ids = [rng.randrange(vocab) if rng.random() < 0.5 else rng.randrange(300)
                   for _ in range(rng.randrange(1, 40))]
            deltas, rest = stream(tokenizer, ids, chunk, skip_special_tokens=skip)
            assert "".join(deltas) + rest == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_smollm2_byte_level_multibyte_deltas(smollm2_hf) -> None:
    ids = smollm2_hf.encode(MULTIBYTE)
    assert ids == [3546, 46494, 37366, 17097, 241, 115, 40993, 179, 120, 248, 40303, 218]
    deltas, rest = stream(smollm2_hf, ids)
    assert deltas == ["na", "ïve", " café", "", "", " 日", "本", "", "", "語", "", " 😀"]
    assert rest == ""
    assert not any(REPLACEMENT in d for d in deltas)
    detok = IncrementalDetokenizer(smollm2_hf)
    for i in ids:
        detok.add([i])
    assert detok.text == MULTIBYTE


def test_smollm2_special_tokens_skipped_or_kept(smollm2_hf) -> None:
    ids = [19556, 2, 905]  # "Hello" <|im_end|> " world"
    assert "".join(stream(smollm2_hf, ids)[0]) == "Hello world"
    assert "".join(stream(smollm2_hf, ids, skip_special_tokens=False)[0]) == "Hello<|im_end|> world"


def test_gguf_tokenizer_matches_hf_tokenizer_json(smollm2_gguf, smollm2_hf) -> None:
    for text in [MULTIBYTE, "Hello, world! 12345\n  def f(x):", "<|im_start|>user\nhi<|im_end|>"]:
        assert smollm2_gguf.encode(text) == smollm2_hf.encode(text), text
    assert smollm2_hf.encode("Hello, world! 12345\n  def f(x):") == [
        19556, 28, 905, 17, 216, 33, 34, 35, 36, 37, 3805, 753, 275, 24, 104, 727]
    assert (smollm2_gguf.bos_token, smollm2_gguf.eos_token) == ("<|im_start|>", "<|im_end|>")
    with open(os.path.join(SMOLLM2_HF, "chat_template.jinja")) as f:
        assert smollm2_gguf.chat_template == f.read()


def test_gguf_chat_template_is_chatml(smollm2_gguf) -> None:
    ids = apply_chat_template(smollm2_gguf, [{"role": "user", "content": "hi"}])
    assert type(ids) is list and all(type(t) is int for t in ids)
    assert smollm2_gguf.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[-4:] == [1, 520, 9531, 198]  # <|im_start|> assistant \n
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert apply_chat_template(smollm2_gguf, messages) == [
        1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2,
        198, 1, 520, 9531, 198]


def test_load_tokenizer_from_gguf_file_path(smollm2_gguf_folder) -> None:
    gguf_file = os.path.join(smollm2_gguf_folder, os.listdir(smollm2_gguf_folder)[0])
    assert load_tokenizer(gguf_file).encode("Hello world") == [19556, 905]


def test_load_tokenizer_missing_or_empty_path_raises(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path))


def test_find_stop_earliest_match_wins() -> None:
    assert find_stop("hello world", ["world", "lo w"], 0) == (3, "lo w")
    assert find_stop("abc", ["bc", "b"], 0) == (1, "bc")  # same index: first listed
    assert find_stop("abc", [], 0) is None
    assert find_stop("abc", ["", "x"], 0) is None


def test_find_stop_spans_token_boundary() -> None:
    old = "The end.\n\nU"  # previous deltas; the new one completes "\n\nUser:"
    text = old + "ser: hi"
    assert find_stop(text, ["\n\nUser:"], len(old)) == (8, "\n\nUser:")
    # the stop's last character is the first new one
    assert find_stop("abSTO" + "P", ["STOP"], 5) == (2, "STOP")


def test_find_stop_ignores_match_wholly_in_old_text() -> None:
    text = "ab STOP cd STOP"
    assert find_stop(text, ["STOP"], 8) == (11, "STOP")
    assert find_stop("ab STOP cd", ["STOP"], 8) is None
