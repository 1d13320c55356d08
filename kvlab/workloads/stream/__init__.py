"""Streams: a long text fed in chunks through policies side by side, scored token by token (StreamingLLM)."""
