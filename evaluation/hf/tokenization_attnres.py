"""The byte-level tokenizer of attnres models (id = byte value, 256 ids) as a transformers tokenizer.

Shipped inside exported folders (AutoTokenizer with trust_remote_code). Special tokens are bytes
too: eos is byte 0 (the document separator of the harness' data), bos the byte a text is conditioned
on when it has no context (lm-eval's prefix token), so a text holding them tokenizes as bytes still.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizer


def _token(b: int) -> str:
    return chr(b) if b < 128 else f"<0x{b:02X}>"  # a byte >= 0x80 is no character alone


class AttnResByteTokenizer(PreTrainedTokenizer):
    vocab_files_names: dict = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, bos_token: str = "\n", eos_token: str = "\x00", pad_token: str = "\x00", **kwargs):
        self._ids = {_token(b): b for b in range(256)}
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return 256

    def get_vocab(self) -> dict:
        return dict(self._ids)

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [_token(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        return self._ids[token]

    def _convert_id_to_token(self, index: int) -> str:
        return _token(int(index))

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self._ids[t] for t in tokens if t in self._ids).decode("utf-8", errors="ignore")

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return list(token_ids_0) + list(token_ids_1 or [])  # no bos or eos added: the text's bytes only

    def _decode(self, token_ids, skip_special_tokens: bool = False, clean_up_tokenization_spaces=None, **kwargs) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        # every id is a byte of text; only the end-of-text byte is dropped when specials are skipped
        keep = [i for i in ids if 0 <= i < 256 and not (skip_special_tokens and i == self.eos_token_id)]
        return bytes(keep).decode("utf-8", errors="ignore")

    def save_vocabulary(self, save_directory: str, filename_prefix=None) -> tuple:
        return ()  # the vocabulary is the 256 bytes: nothing to write
