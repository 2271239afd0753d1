"""Config of the data pipeline: the corpus and sequence building (``"bertopt": {"data": {...}}``) and the
length-aware batch planner (``"bertopt": {"sampler": {...}}``); see ``docs/data.md`` and ``docs/batching.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..errors import DataError, check
from .corpus import file_kind
from .cost import BERT_LARGE_QUADRATIC, CostModel

STRATEGIES = (
    "random",
    "sorted_megabatch",
    "global_sort",
    "stratified",
    "stratified_node_sort",
    "stratified_node_balance",
    "packed_node_balance",
    "padded_node_balance",
)
PACKED_STRATEGIES = ("packed_node_balance", "padded_node_balance")  # variable micro-batch sizes (ragged plans)
PEER_STRATEGIES = ("hf_batch_rebalance",)  # other libraries' planners, run inside our loop for side-by-side runs
STRATIFIED = ("stratified", "stratified_node_sort", "stratified_node_balance", *PACKED_STRATEGIES)
"""The strategies that draw from length bins (``bins``, ``num_bins``, ``bin_counts``)."""
NODE_POOLED = ("stratified_node_balance", *PACKED_STRATEGIES)  # node pools of split_across_nodes
COSTED = ("global_sort", "stratified_node_sort", *NODE_POOLED)
"""The strategies that deal or pack by the cost model ``a·L + b·L²`` (``cost_linear``, ``cost_quadratic``)."""


@dataclass(frozen=True)
class SamplerConfig:
    strategy: Literal[
        "random",
        "sorted_megabatch",
        "global_sort",
        "stratified",
        "stratified_node_sort",
        "stratified_node_balance",
        "packed_node_balance",
        "padded_node_balance",
        "hf_batch_rebalance",
    ] = "random"
    """How samples are assigned to ranks and micro-batches each step: ``random`` (DistributedSampler),
    ``sorted_megabatch`` (Hugging Face ``group_by_length``), ``global_sort`` (sort the global batch, deal
    across all ranks), ``stratified`` (same per-bin counts in every local batch), ``stratified_node_sort``
    (plus snake dealing within each node), ``stratified_node_balance`` (plus cost-model dealing within
    each node), and two with micro-batches of varying size (the same samples per step, packed to equal
    cost): ``packed_node_balance`` for kernels that skip padding (``model.unpadded``; cost ``Σ a·L + b·L²``)
    and ``padded_node_balance`` for kernels that compute on padding (cost ``samples × cost(padded
    length)``). ``hf_batch_rebalance`` runs transformers' ``BatchRebalanceSampler`` (as ``Trainer`` builds it)
    inside this loop, for side-by-side comparisons."""
    pad_multiple: int = 8
    """Dynamic padding rounds each micro-batch's length up to a multiple of this."""
    bins: tuple[int, ...] = ()
    """Upper edges of the length bins for the stratified strategies, ascending, e.g. ``[128, 256, 384,
    512]`` (bin 1 = lengths 1–128, …); the last edge must cover the longest sequence. Empty: ``num_bins``
    bins at the corpus's length quantiles."""
    num_bins: int = 4
    """Number of quantile-derived bins when ``bins`` is empty (fewer if quantiles coincide, e.g. at a
    spike of full-length sequences)."""
    bin_counts: tuple[int, ...] = ()
    """Samples per bin in every local batch (``micro × accumulation`` in total), e.g. ``[6, 3, 2, 5]``;
    needs explicit ``bins``. Empty: proportional to each bin's share of the corpus, every step within
    one of ``share × local batch`` so that an epoch uses all samples."""
    cost_linear: float = 1.0
    """Cost model ``a·L + b·L²``: ``a``, work per token (dense layers)."""
    cost_quadratic: float = BERT_LARGE_QUADRATIC
    """Cost model ``a·L + b·L²``: ``b``, work per token pair (attention). ``1/(6·hidden)`` relative to
    ``a = 1``; the default is BERT-large (hidden 1024)."""
    padded: bool = True
    """Cost that ``stratified_node_balance`` balances. True — a micro-batch costs ``micro × cost(its
    padded length)``, what kernels that compute on padding pay (Hugging Face BERT, which this package
    trains): with accumulation, micro-batches are then runs of consecutive lengths (little padding)
    dealt whole. False — per sample ``a·L + b·L²``, for kernels that skip padding (unpadded/varlen
    attention): samples are dealt one by one. The packed strategies carry their cost in their name and
    ignore this."""
    balance_each_micro_batch: bool = False
    """``stratified_node_balance`` and the packed strategies with accumulation: balance every micro-batch
    slot across ranks, not only each step's total. Set it under ZeRO 2/3, which reduce gradients at
    every micro-step; ZeRO 0/1 communicate only at the accumulation boundary
    (``DeepSpeedEngine.allreduce_gradients``), where the step total is what counts and balancing only it
    leaves more freedom."""
    megabatch_mult: Optional[int] = None
    """``sorted_megabatch``: local batches per sorted mega-batch. Empty: Hugging Face's default,
    ``min(50, samples // (4 × local batch))``."""
    micro_batch_tokens: Optional[int] = None
    """Packed strategies: the most tokens one micro-batch may hold (its memory) — real tokens for
    ``packed_node_balance``, samples × padded length for ``padded_node_balance``. Empty: micro-batch ×
    the longest sequence (rounded up to ``pad_multiple``), what a nominal micro-batch can hold at worst,
    so a config that fits memory with fixed micro-batches still fits. A step whose samples cannot be
    packed under it fails the plan with the step named."""
    max_micro_batch_samples: Optional[int] = None
    """Packed strategies: the most samples one micro-batch may hold (at least the micro-batch; it sizes
    the plan's slot axis). Empty: 4 × the micro-batch."""

    def __post_init__(self) -> None:
        check(self.pad_multiple >= 1, f"pad_multiple: must be at least 1, got {self.pad_multiple}")
        check(all(b >= 1 for b in self.bins), f"bins: edges must be positive, got {list(self.bins)}")
        check(
            all(a < b for a, b in zip(self.bins, self.bins[1:])),
            f"bins: edges must be strictly ascending, got {list(self.bins)}",
        )
        check(self.num_bins >= 1, f"num_bins: must be at least 1, got {self.num_bins}")
        if self.bin_counts:
            check(bool(self.bins), "bin_counts: needs explicit bins (bin counts for quantile bins are derived)")
            check(
                len(self.bin_counts) == len(self.bins),
                f"bin_counts: {len(self.bin_counts)} counts for {len(self.bins)} bins",
            )
            check(
                all(c >= 0 for c in self.bin_counts) and sum(self.bin_counts) > 0,
                f"bin_counts: must be non-negative with a positive sum, got {list(self.bin_counts)}",
            )
        check(
            self.cost_linear >= 0 and self.cost_quadratic >= 0 and self.cost_linear + self.cost_quadratic > 0,
            f"cost_linear/cost_quadratic: must be non-negative, not both 0, got {self.cost_linear}, "
            f"{self.cost_quadratic}",
        )
        check(
            self.megabatch_mult is None or self.megabatch_mult >= 1,
            f"megabatch_mult: must be at least 1, got {self.megabatch_mult}",
        )
        check(
            self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
            f"micro_batch_tokens: must be at least 1, got {self.micro_batch_tokens}",
        )
        check(
            self.max_micro_batch_samples is None or self.max_micro_batch_samples >= 1,
            f"max_micro_batch_samples: must be at least 1, got {self.max_micro_batch_samples}",
        )

    def dead_fields(self) -> dict[str, str]:
        """Fields the strategy never reads (``ds_bertopt.data.plan.Planner``: bins in ``_resolve_bins``, the cost model
        in ``deal``/``split_across_nodes``/``pack_pools``, the rest where named)."""
        s, dead = self.strategy, {}
        said = f'strategy is "{s}"'
        if s not in STRATIFIED:
            for name in ("bins", "num_bins", "bin_counts"):
                dead[name] = f"only the length-bin strategies (stratified*, the packed ones) use bins; {said}"
        elif self.bins:
            dead["num_bins"] = "bins are given, so no quantile bins are derived"
        if s not in COSTED:
            for name in ("cost_linear", "cost_quadratic"):
                dead[name] = f"only the strategies that deal or pack by cost use the cost model; {said}"
        if s != "stratified_node_balance":
            dead["padded"] = f"only stratified_node_balance reads it (the packed strategies name their cost); {said}"
        if s not in NODE_POOLED:
            dead["balance_each_micro_batch"] = f"only stratified_node_balance and the packed strategies balance; {said}"
        if s != "sorted_megabatch":
            dead["megabatch_mult"] = f"only sorted_megabatch has mega-batches; {said}"
        if s not in PACKED_STRATEGIES:
            for name in ("micro_batch_tokens", "max_micro_batch_samples"):
                dead[name] = f"only the packed strategies pack micro-batches of varying size; {said}"
        return dead

    @property
    def cost_model(self) -> CostModel:
        return CostModel(linear=self.cost_linear, quadratic=self.cost_quadratic)


@dataclass(frozen=True)
class DataConfig:
    train_files: tuple[str, ...] = ()
    """Text corpus files or globs: ``.txt`` (a document per blank-line-separated block, or per
    line with ``txt_format: "line"``), ``.jsonl`` / ``.json`` (one object per line with
    ``text_field``), optionally ``.gz``. Empty: the embedded corpus (Python stdlib docstrings)."""
    dataset: Optional[str] = None
    """A ``datasets`` name or a directory saved with ``save_to_disk``, used instead of files."""
    dataset_split: str = "train"
    """Split of ``dataset`` to read."""
    text_field: str = "text"
    """Field holding the document text in jsonl files and datasets."""
    txt_format: Literal["paragraph", "line"] = "paragraph"
    """How ``.txt`` files are split into documents: blank-line-separated blocks, or one per line."""
    tokenizer: Optional[str] = None
    """Tokenizer directory (or the name of one in the local Hugging Face cache; runs are offline). Empty: a
    WordPiece tokenizer trained on the corpus, deterministically (the same corpus and settings give the same
    vocabulary on any node), and cached."""
    tokenizer_vocab_size: int = 8192
    """Vocabulary size of the trained default tokenizer."""
    max_seq_length: int = 128
    """Longest training sequence in tokens, [CLS] and [SEP]s included."""
    short_seq_prob: float = 0.1
    """Probability that a sequence targets a random shorter length (as in BERT's data builder)."""
    mlm_probability: float = 0.15
    """Fraction of tokens selected for masking (then 80 % [MASK], 10 % random, 10 % kept)."""
    eval_fraction: float = 0.05
    """Fraction of documents held out for evaluation (at least one document)."""
    max_eval_samples: int = 512
    """Cap on held-out sequences evaluated."""
    max_documents: Optional[int] = None
    """Read at most this many documents (quick experiments)."""
    cache_dir: str = "~/.cache/ds_bertopt"
    """Where the tokenizer, the extracted default corpus and the ``datasets`` caches go. Node-local disks are
    fine: the default tokenizer is trained deterministically, and at start-up every node's vocabulary and
    sequences are compared (a node that differs stops the job, naming both nodes and their cache
    directories). Not part of a run's identity: a moved or deleted cache is rebuilt, and resume compares the
    vocabulary and sequences themselves."""
    seed: int = 1234
    """Seed for sequence building (fixed per corpus so every rank builds the same samples)."""
    num_proc: Optional[int] = None
    """Processes that tokenize and build sequences (local rank 0 of each node builds while the node's other ranks
    wait). Empty: one per CPU core this process may use, at most one per 4 MB of text. Any count builds the same
    sequences (nodes with other core counts agree); a ``data.dataset`` that already holds ``input_ids`` skips
    tokenization."""
    max_skipped_fraction: float = 0.01
    """Records without usable text (jsonl or dataset records with no text field, text that is not a string or
    is empty; fine-tuning rows with empty text) are skipped and counted in the data line; when more than this
    fraction of them is skipped the run refuses to start (the data is probably read wrongly: another
    ``text_field``?). Fine-tuning reads this key too."""

    def dead_fields(self) -> dict[str, str]:
        """Fields the corpus reader (``ds_bertopt.data.corpus.load_documents``) and the tokenizer never read here."""
        dead = {}
        if not self.dataset:
            dead["dataset_split"] = "only a data.dataset has splits"
        kinds = {_kind(p) for p in self.train_files}
        if self.dataset or not self.train_files or kinds == {"json"}:
            source = "data.dataset" if self.dataset else "the corpus" if self.train_files else "the embedded corpus"
            dead["txt_format"] = f"it splits .txt files, and {source} is not one"
        if not self.dataset and (not self.train_files or kinds == {"text"}):
            source = ".txt files" if self.train_files else "the embedded corpus"
            dead["text_field"] = f"{source} have no fields to choose from (jsonl and datasets do)"
        if self.tokenizer:
            dead["tokenizer_vocab_size"] = "data.tokenizer is given; only the trained default tokenizer has this size"
        return dead

    def __post_init__(self) -> None:
        check(self.max_seq_length >= 8, f"max_seq_length: must be at least 8, got {self.max_seq_length}")
        check(0.0 <= self.short_seq_prob <= 1.0, f"short_seq_prob: must be in [0, 1], got {self.short_seq_prob}")
        check(0.0 < self.mlm_probability < 1.0, f"mlm_probability: must be in (0, 1), got {self.mlm_probability}")
        check(0.0 < self.eval_fraction < 1.0, f"eval_fraction: must be in (0, 1), got {self.eval_fraction}")
        check(self.max_eval_samples > 0, f"max_eval_samples: must be positive, got {self.max_eval_samples}")
        check(
            self.tokenizer_vocab_size >= 1000,
            f"tokenizer_vocab_size: must be at least 1000, got {self.tokenizer_vocab_size}",
        )
        check(
            self.max_documents is None or self.max_documents > 1,
            f"max_documents: must be at least 2, got {self.max_documents}",
        )
        check(not (self.train_files and self.dataset), "train_files: give either train_files or dataset, not both")
        check(self.num_proc is None or self.num_proc >= 1, f"num_proc: must be at least 1, got {self.num_proc}")
        check(
            0.0 <= self.max_skipped_fraction < 1.0,
            f"max_skipped_fraction: must be in [0, 1), got {self.max_skipped_fraction}",
        )


def _kind(pattern: str) -> Optional[str]:
    """``"text"``/``"json"`` of a corpus file or glob by its name; None when the name does not say."""
    try:
        return file_kind(pattern)
    except DataError:
        return None
