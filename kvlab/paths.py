"""Where kvlab's bundled data lives: scripted conversations, retrieval sessions, code, edits, the RAG corpus."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository (or install) root that holds kvlab/ and data/
DATA_DIR = ROOT / "data"
CONVERSATIONS_DIR = DATA_DIR / "conversations"
RETRIEVAL_DIR = DATA_DIR / "retrieval"
CODE_DIR = DATA_DIR / "code"
EDITS_DIR = DATA_DIR / "edits"
RAG_CORPUS = DATA_DIR / "rag" / "corpus.json"
