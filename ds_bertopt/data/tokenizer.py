"""The tokenizer: a user's (a directory, or a name in the local Hugging Face cache), or a WordPiece vocabulary
trained on the corpus and cached.

The trained vocabulary is a pure function of the corpus and the settings, so every node builds the same one
from its own cache (nodes with local disks) and a deleted cache is rebuilt identically. ``tokenizers``' own
WordPiece trainer is not: it gives continuation pieces (``##s``) their ids in hash-map order, and those ids
break ties between equally frequent merges, so two builds from one corpus differed in 1,458 of 8,192 ids
(huggingface/tokenizers#1794). :func:`wordpiece_vocab` runs the same BPE trainer with every id fixed before it
starts: words are counted here, and a continuation character is given its own code point (the supplementary
private-use planes), so that it is part of the alphabet, which the trainer sorts; the merged pieces are mapped
back to ``##`` pieces afterwards. The result is saved as a Hugging Face fast tokenizer under
``cache_dir/tokenizers/<corpus fingerprint>-v<size>-<TRAINER_VERSION>``.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter
from typing import Iterable, Mapping

from ..errors import DataError
from .parallel import part_ranges, run_parts

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TRAINER_VERSION = "det1"
"""Part of the cache key: a vocabulary trained by an earlier (non-deterministic) trainer is not reused."""
LIMIT_ALPHABET = 1000
"""Characters kept in the alphabet (the most frequent; ties by code point), as ``BertWordPieceTokenizer``."""
_CONTINUATION = 0xF0000
"""A continuation character ``c`` is trained as ``chr(_CONTINUATION + ord(c))`` (planes 15-16, private use)."""


def check_tokenizer_location(name_or_path: str, key: str = "data.tokenizer") -> None:
    """A path that does not exist, or is not a directory, is named in one line (not the Hub's repo-id rules)."""
    path = os.path.expanduser(name_or_path)
    looks_like_path = os.sep in name_or_path or name_or_path.startswith((".", "~"))
    if looks_like_path and not os.path.exists(path):
        raise DataError(f"{key}: {name_or_path} does not exist")
    if os.path.exists(path) and not os.path.isdir(path):
        raise DataError(f"{key}: {name_or_path} is not a directory (give the directory holding tokenizer.json)")


def load_tokenizer(name_or_path: str, key: str = "data.tokenizer"):
    from transformers import AutoTokenizer

    check_tokenizer_location(name_or_path, key)
    path = os.path.expanduser(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError/ValueError with long texts
        if not os.path.isdir(path):
            raise DataError(
                f"{key}: {name_or_path} is neither a local directory nor a tokenizer in the Hugging Face cache "
                "(runs are offline, HF_HUB_OFFLINE=1)"
            ) from None
        raise DataError(f"tokenizer {name_or_path} cannot be loaded: {str(exc).splitlines()[0][:300]}") from None
    missing = [t for t in ("cls_token", "sep_token", "mask_token", "pad_token") if getattr(tok, t) is None]
    if missing:
        raise DataError(f"tokenizer {name_or_path} lacks BERT special tokens: {', '.join(missing)}")
    return tok


_ASCII_WORD = re.compile(r"[!-/:-@\[-`{-~]|[^ !-/:-@\[-`{-~]+")
"""BERT's pre-tokenizer on normalized ASCII text: after the normalizer the only white space left is " ", and each
ASCII punctuation character is a word of its own."""


def count_words(texts: Iterable[str]) -> Counter:
    """Words as BERT's lower-casing normaliser and pre-tokenizer split them, with their counts. The normalized text's
    ASCII chunks (between spaces) are split by :data:`_ASCII_WORD` and counted in C; the other chunks by
    ``BertPreTokenizer`` itself (Unicode punctuation), all of a document's in one call. The same counts as the
    pre-tokenizer alone, in half the time or less."""
    from tokenizers import normalizers, pre_tokenizers

    normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True
    )
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter = Counter()
    for text in texts:
        normalized = normalizer.normalize_str(text)
        if not normalized.isascii():
            chunks = normalized.split(" ")
            other = " ".join(chunk for chunk in chunks if not chunk.isascii())
            counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(other))
            normalized = " ".join(chunk for chunk in chunks if chunk.isascii())
        counts.update(_ASCII_WORD.findall(normalized))
    return counts


def wordpiece_vocab(
    word_counts: Mapping[str, int], vocab_size: int, min_frequency: int = 2, limit_alphabet: int = LIMIT_ALPHABET
) -> dict[str, int]:
    """A WordPiece vocabulary (piece → id) learnt from ``word_counts``: the same for the same counts, whatever
    their order (see the module docstring). Special tokens first, then the alphabet, then merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    chars: Counter = Counter()
    for word, n in word_counts.items():
        for c in word:
            chars[c] += n
    alphabet = sorted((c for c in chars if ord(c) < _CONTINUATION), key=lambda c: (-chars[c], c))[:limit_alphabet]
    kept = set(alphabet)

    def encode(word: str) -> str:
        # a continuation character of a plane beyond 1 has no private-use twin: left out, as unknown characters are
        return "".join(
            c if i == 0 else chr(_CONTINUATION + ord(c))
            for i, c in enumerate(word)
            if c in kept and (i == 0 or ord(c) < 0x20000)
        )

    encoded: Counter = Counter()
    for word, n in word_counts.items():
        encoded[encode(word)] += n
    encoded.pop("", None)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=sorted(kept),  # a character seen only inside words still gets its word-initial piece
        show_progress=False,
    )
    bpe.train_from_iterator((" ".join([word] * encoded[word]) for word in sorted(encoded)), trainer=trainer)

    def decode(piece: str) -> str:
        if piece in SPECIAL_TOKENS:
            return piece
        text = "".join(chr(ord(c) - _CONTINUATION) if ord(c) >= _CONTINUATION else c for c in piece)
        return "##" + text if ord(piece[0]) >= _CONTINUATION else text

    return {decode(piece): i for piece, i in bpe.get_vocab().items()}


def _count_range(documents, start: int, end: int) -> Counter:
    def texts():
        for first in range(start, end, 1000):
            yield from documents[first : min(end, first + 1000)]["text"]

    return count_words(texts())


def count_words_parallel(documents, num_proc: int, share=None, progress=None) -> Counter:
    """:func:`count_words` of a ``datasets`` text column, cut into parts over ``num_proc`` processes (with ``share``,
    a :class:`~.parallel.Share`: only this node's parts of the crew's). Counts add up: the same vocabulary for any
    process or node count."""
    ranges = part_ranges(len(documents), sum(share.procs) if share else num_proc, 1)
    mine = share.owned(len(ranges)) if share else range(len(ranges))
    if progress is not None:
        progress.stage("counting words for the vocabulary", total=len(mine))
    counts: Counter = Counter()
    for part in run_parts([(_count_range, (documents, *ranges[i])) for i in mine], num_proc, progress):
        counts.update(part)
    return counts


def save_wordpiece(word_counts: Mapping[str, int], vocab_size: int, out_dir: str) -> None:
    """Train the lower-cased WordPiece vocabulary of ``word_counts`` (:func:`wordpiece_vocab`) and save it as a
    Hugging Face fast tokenizer in ``out_dir`` (atomically)."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    vocab = wordpiece_vocab(word_counts, vocab_size)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = f"{out_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    BertWordPieceTokenizer(vocab=vocab, lowercase=True, strip_accents=True, clean_text=True).save(
        os.path.join(tmp, "trained.json")
    )
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


def train_wordpiece(documents, vocab_size: int, out_dir: str, num_proc: int = 1):
    """Train a lower-cased WordPiece tokenizer on ``documents`` (a ``datasets`` text column) into ``out_dir``."""
    save_wordpiece(count_words_parallel(documents, num_proc), vocab_size, out_dir)
    return load_tokenizer(out_dir)


def trained_dir(data_cfg, documents, cache_dir: str) -> str:
    """Where the default tokenizer of this corpus and vocabulary size is cached."""
    if "text" not in documents.column_names:
        raise DataError(
            f"data.dataset: {data_cfg.dataset} holds input_ids (already tokenized); give data.tokenizer, the tokenizer "
            "that made them"
        )
    name = f"{documents._fingerprint}-v{data_cfg.tokenizer_vocab_size}-{TRAINER_VERSION}"
    return os.path.join(cache_dir, "tokenizers", name)


def get_tokenizer(data_cfg, documents, cache_dir: str, num_proc: int = 1):
    """The configured tokenizer, or the cached corpus-trained WordPiece one (trained on first use)."""
    if data_cfg.tokenizer:
        return load_tokenizer(data_cfg.tokenizer)
    out_dir = trained_dir(data_cfg, documents, cache_dir)
    if os.path.exists(os.path.join(out_dir, "tokenizer.json")):
        return load_tokenizer(out_dir)
    return train_wordpiece(documents, data_cfg.tokenizer_vocab_size, out_dir, num_proc)
