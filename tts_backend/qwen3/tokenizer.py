"""The text tokenizer, built from the checkpoint's own files (vocab.json, merges.txt, tokenizer_config.json).

The published folders ship the slow-tokenizer files of Qwen2's byte-level BPE; this rebuilds the same pipeline with
the `tokenizers` library (no `transformers`): NFC normalisation, Qwen2's pre-tokenisation regex, byte-level BPE,
and the added/special tokens with the ids listed in `tokenizer_config.json`.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# Qwen2's pre-tokenisation pattern (contractions, letters, single digits, punctuation runs, newlines, spaces).
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


class TokenizerFilesError(ValueError):
    pass


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._added_tokens: list[str] | None = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "TextTokenizer":
        folder = Path(folder)
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            if not (folder / name).is_file():
                raise TokenizerFilesError(f"missing tokenizer file {folder / name}")
        bpe = models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
        tok = Tokenizer(bpe)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        added = sorted(((int(i), spec) for i, spec in config.get("added_tokens_decoder", {}).items()))
        for token_id, spec in added:
            token = AddedToken(
                spec["content"], single_word=spec.get("single_word", False), lstrip=spec.get("lstrip", False),
                rstrip=spec.get("rstrip", False), normalized=spec.get("normalized", False),
                special=spec.get("special", True),
            )
            tok.add_tokens([token])
            got = tok.token_to_id(spec["content"])
            if got != token_id:
                raise TokenizerFilesError(
                    f"{folder / 'tokenizer_config.json'}: added token {spec['content']!r} should have id {token_id}"
                    f" but lands on {got} (vocab.json holds {tok.get_vocab_size(with_added_tokens=False)} tokens)"
                )
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        """Plain encoding; special tokens written in the text (e.g. `<|im_start|>`) map to their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def text_ids(self, text: str) -> list[int]:
        """t_1..t_n exactly as the reference gets them: the templated assistant text, sliced [3:-5]."""
        ids = self.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
        return ids[3:-5]

    def ref_text_ids(self, ref_text: str) -> list[int]:
        """A clone's reference transcript as the reference gets it: `<|im_start|>assistant\n{ref}<|im_end|>\n`,
        sliced [3:-2]."""
        return self.encode(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n")[3:-2]

    def instruct_ids(self, instruct: str) -> list[int]:
        """All ids of `<|im_start|>user\\n{instruct}<|im_end|>\\n` (the reference embeds every one)."""
        return self.encode(f"<|im_start|>user\n{instruct}<|im_end|>\n")

    def settled_text_ids(self, text: str) -> list[int]:
        """For a text that is still being written: the first of `text_ids(text)` that no text appended to
        it can change, so that tokens fed to the model before the text is complete are the complete text's.

        Byte-level BPE merges only inside a pre-token (a word with its leading space, a run of
        punctuation, a digit, ...: QWEN2_SPLIT_PATTERN) and the pattern's matches left of the last one are
        fixed by characters already there, so appending text can change only the last pre-token: "Hello
        wor" may become "Hello world", "Hello." may become "Hello.\n" (one pre-token), "it'" may become
        "it's". Two things the pre-tokenizer alone does not see hold the cut back further: a special token
        half written at the end ("<|im_" before "end|>"), which is split out before pre-tokenisation once
        complete, and the NFC normalisation (the cut is taken in the normalised text). A candidate cut is
        kept only if its ids really are a prefix of the text's ids."""
        normalized = unicodedata.normalize("NFC", text)
        starts = [start for _, (start, _) in self._tok.pre_tokenizer.pre_tokenize_str(normalized)]
        if len(starts) < 2:
            return []
        cut = starts[-1]
        # Every text the tokenizer may yet see before the cut: this one grown by ordinary text, and, where a
        # special token may be half written at the end, the text before it, which is then tokenised on its
        # own ("   <" is "  " + " <", but "   <|im_end|>" is "   " + the special token).
        futures = [self.text_ids(normalized)]
        for i in range(max(0, len(normalized) - self._longest_added), len(normalized)):
            tail = normalized[i:]
            if any(token.startswith(tail) for token in self._added):
                cut = min(cut, i)
                futures.append(self.text_ids(normalized[:i]))
        for start in reversed([s for s in starts if 0 < s <= cut]):
            ids = self.text_ids(normalized[:start])
            if all(ids == future[: len(ids)] for future in futures):
                return ids
        return []

    @property
    def _added(self) -> list[str]:
        if self._added_tokens is None:
            self._added_tokens = [t.content for t in self._tok.get_added_tokens_decoder().values()]
        return self._added_tokens

    @property
    def _longest_added(self) -> int:
        return max((len(t) for t in self._added), default=0)

    def continuation_ids(self, text: str) -> list[int]:
        """Ids of a piece of text pushed into a running streaming-text generation (tokenised on its own)."""
        return self.encode(text)
