"""draftsmith: build, evaluate and ship speculative-decoding drafters for a target LLM."""

__version__ = "0.1.0"
