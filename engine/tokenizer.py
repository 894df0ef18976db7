"""Tokenizer loading (local files or GGUF metadata), chat templates, streaming detokenisation
and stop-string search."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from engine.weights.gguf_loader import find_gguf

_REPLACEMENT_CHAR = "\ufffd"
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte-fallback piece


def load_tokenizer(path: str) -> Any:
    """Load a transformers tokenizer from local files only (never a hub download).

    ``path`` is one of: a Hugging Face folder with ``tokenizer.json`` / ``tokenizer_config.json``;
    a ``.gguf`` file; a folder holding exactly one ``.gguf`` and no tokenizer files. For GGUF the
    vocabulary, merges, special tokens and chat template come from the ``tokenizer.ggml.*`` and
    ``tokenizer.chat_template`` metadata, converted by transformers (``gguf_file=``).

    Returns: a ``PreTrainedTokenizerBase`` (a fast, ``tokenizers``-backed one for these formats).
    Raises:
        FileNotFoundError: ``path`` does not exist or holds neither tokenizer files nor one GGUF.
    """
    from transformers import AutoTokenizer  # lazy: importing transformers costs seconds

    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    if os.path.isdir(path) and any(
            os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    gguf_path = find_gguf(path)
    if gguf_path is None:
        raise FileNotFoundError(
            f"{path!r} has no tokenizer.json/tokenizer_config.json and is not (a folder with "
            "exactly one) .gguf file")
    folder, name = os.path.split(os.path.abspath(gguf_path))
    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)


def apply_chat_template(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the tokenizer's chat
    template, ending with the assistant generation prompt, and tokenise it.

    Returns: prompt token ids as a plain ``list[int]`` (transformers 5 returns a
    ``BatchEncoding``; older versions a list).
    Raises: whatever transformers raises when the tokenizer has no chat template (ValueError).
    """
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):  # a tensor or numpy array if a caller set return_tensors
        out = out.tolist()
    if out and isinstance(out[0], list):  # batched form of a single conversation
        out = out[0]
    return [int(t) for t in out]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, one ``add`` call per decode step.

    Decoding tokens one at a time is wrong for SentencePiece (``▁x`` loses its space at the start
    of a string) and for byte-fallback / byte-level tokens (one character spans several tokens).
    So we decode a window of token ids twice, from ``prefix_offset`` to ``read_offset`` (text
    already emitted) and from ``prefix_offset`` to the end, and emit the difference. The window
    start only advances to a position whose text was complete, so both decodes see the same
    leading context and the same space stripping. While the decoded tail ends in U+FFFD (an
    incomplete UTF-8 sequence) nothing is emitted and the offsets stay put.

    SentencePiece byte-fallback tokens (``<0xE6>``) need one more hold: HF's ``ByteFallback``
    decoder decodes a whole run of consecutive byte tokens at once and, if the run is not valid
    UTF-8, turns *every* byte of it into U+FFFD, so a later invalid byte can rewrite an earlier
    valid one (``<0x3D><0xF6>`` decodes to two U+FFFD, not "=" + U+FFFD). We therefore hold text
    while the window ends in a byte token; it is released by the next non-byte token or ``flush``.

    Invariant: ``text + flush()`` == ``tokenizer.decode(all_ids, skip_special_tokens=...)``.
    ``spaces_between_special_tokens`` is forwarded to ``decode``; fast tokenizers ignore it.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True,
                 context_ids: list[int] | tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # ``context_ids`` (the prompt's last few tokens, as SGLang's detokenizer keeps) are
        # decoded with the output so its first token keeps its leading space; never emitted.
        self.token_ids: list[int] = [int(t) for t in context_ids]
        self.prefix_offset = 0  # window start: first token of the context re-decoded each step
        self.read_offset = len(self.token_ids)  # tokens before this are already in ``text``
        self._text_parts: list[str] = []
        # skipped specials vanish before decoding, so they do not end a byte-fallback run
        self._skipped_ids = set(tokenizer.all_special_ids) if skip_special_tokens else set()

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta)."""
        return "".join(self._text_parts)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)

    def _ends_in_byte_run(self) -> bool:
        for tid in reversed(self.token_ids[self.read_offset:]):
            if tid not in self._skipped_ids:
                return bool(_BYTE_TOKEN.fullmatch(self.tokenizer.convert_ids_to_tokens(tid) or ""))
        return False

    def _delta(self, force: bool) -> str:
        window = self.token_ids[self.prefix_offset:]
        emitted = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(window)
        if len(full) <= len(emitted):  # e.g. only skipped special tokens arrived: keep context
            return ""
        if not force and (full.endswith(_REPLACEMENT_CHAR) or self._ends_in_byte_run()):
            return ""
        delta = full[len(emitted):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._text_parts.append(delta)
        return delta

    def add(self, token_ids: list[int]) -> str:
        """Append newly generated ``token_ids`` and return the text they complete (may be "";
        never ends in a partial UTF-8 character)."""
        self.token_ids.extend(int(t) for t in token_ids)
        return self._delta(force=False)

    def flush(self) -> str:
        """Return any held-back text (an incomplete character decodes as U+FFFD, as
        ``tokenizer.decode`` would); call once at the end of the stream."""
        return self._delta(force=True)


def find_stop(text: str, stop_strs: list[str], search_from: int) -> tuple[int, str] | None:
    """Find the earliest stop string in ``text`` that could involve text at or after
    ``search_from`` (a character index, normally ``len`` of the text before the latest delta).

    Each stop ``s`` is searched from ``max(0, search_from - len(s) + 1)`` (never earlier than
    ``search_from - max_stop_len + 1``), so a stop split across tokens or deltas is found, while a
    match lying wholly in old text, which an earlier call would have reported, is not.

    Returns: ``(index_in_text, matched_string)`` for the smallest index over all stop strings
    (ties: the one listed first), or None. Empty stop strings are ignored.
    """
    best: tuple[int, str] | None = None
    for stop in stop_strs:
        if not stop:
            continue
        idx = text.find(stop, max(0, search_from - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


def stop_prefix_len(text: str, stop_strs: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

    A stream holds that suffix back: it may grow into a stop string, which is then trimmed,
    so a client never sees text that the final answer does not have."""
    best = 0
    for stop in stop_strs:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
