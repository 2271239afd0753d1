"""ds_bertopt: DeepSpeed integration layer for fast BERT pretraining and memory-cheap fine-tuning."""

__version__ = "0.1.0"
