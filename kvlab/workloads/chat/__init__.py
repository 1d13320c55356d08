"""Multi-turn chat: conversations and the session that runs every policy side by side, turn by turn."""
