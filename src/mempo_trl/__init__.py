"""MemPO (Self-Memory Policy Optimization) for search agents on Hugging Face TRL."""

__version__ = "0.1.0"
