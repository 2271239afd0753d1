"""The label that marks a position the loss ignores: torch's ``cross_entropy`` default, and Hugging Face's."""

IGNORE_INDEX = -100
