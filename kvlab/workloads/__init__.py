"""The three workloads kvlab drives the model through: multi-turn chat, RAG prompts, code edits."""
