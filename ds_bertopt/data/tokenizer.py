"""The tokenizer: a user's (path or name), or a WordPiece vocabulary trained on the corpus and cached.

Training a lower-cased WordPiece vocabulary of ``tokenizer_vocab_size`` on the documents takes a few
seconds for the embedded corpus; the result is saved as a Hugging Face fast tokenizer under
``cache_dir/tokenizers/<corpus fingerprint>-v<size>`` and reused by every later run and rank.
"""

from __future__ import annotations

import os
import shutil

from ..errors import DataError

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    path = os.path.expanduser(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError with long texts
        raise DataError(f"tokenizer {name_or_path} cannot be loaded: {str(exc).splitlines()[0][:300]}") from None
    missing = [t for t in ("cls_token", "sep_token", "mask_token", "pad_token") if getattr(tok, t) is None]
    if missing:
        raise DataError(f"tokenizer {name_or_path} lacks BERT special tokens: {', '.join(missing)}")
    return tok


def train_wordpiece(documents, vocab_size: int, out_dir: str):
    """Train a lower-cased WordPiece tokenizer on ``documents`` (a ``datasets`` text column) into ``out_dir``."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    trainer = BertWordPieceTokenizer(lowercase=True, strip_accents=True, clean_text=True)

    def batches():
        for start in range(0, len(documents), 1000):
            yield documents[start : start + 1000]["text"]

    trainer.train_from_iterator(
        batches(), vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tmp = f"{out_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    trainer.save(os.path.join(tmp, "trained.json"))
    # transformers 5 ignores ``vocab_file``; wrap the trained tokenizer object itself.
    tok = BertTokenizerFast(
        tokenizer_file=os.path.join(tmp, "trained.json"),
        do_lower_case=True,
        unk_token="[UNK]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        mask_token="[MASK]",
    )
    tok.save_pretrained(tmp)
    os.unlink(os.path.join(tmp, "trained.json"))
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another process finished first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return load_tokenizer(out_dir)


def get_tokenizer(data_cfg, documents, cache_dir: str):
    """The configured tokenizer, or the cached corpus-trained WordPiece one (trained on first use)."""
    if data_cfg.tokenizer:
        return load_tokenizer(data_cfg.tokenizer)
    out_dir = os.path.join(cache_dir, "tokenizers", f"{documents._fingerprint}-v{data_cfg.tokenizer_vocab_size}")
    if os.path.exists(os.path.join(out_dir, "tokenizer.json")):
        return load_tokenizer(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    return train_wordpiece(documents, data_cfg.tokenizer_vocab_size, out_dir)
