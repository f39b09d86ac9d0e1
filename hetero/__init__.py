"""hetero: a declarative pipeline compiler for fine-tuning LLMs across mixed GPUs."""

__version__ = "0.1.0"
