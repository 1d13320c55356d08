"""The app's pages: where each lives, its title and icon in the navigation, and the question it answers on Home."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PageEntry:
    path: str
    title: str
    icon: str
    question: str  # on Home, beside its link
    link: str = ""  # the link's words on Home, where they are not the title


PAGES = [
    PageEntry("app_pages/lessons.py", "Lessons", ":material/school:",
              "Each claim of the notes turned into a live experiment on the model, with a verdict drawn from the run.",
              link="Start here: Lessons"),
    PageEntry("app_pages/chat.py", "Multi-turn chat", ":material/forum:",
              "Do attention sinks exist in this model? What does StreamingLLM, H2O, SnapKV or PyramidKV keep after "
              "each turn, how much of it is freeable in paged blocks, and how far do their answers drift from the full "
              "cache as the conversation goes on?"),
    PageEntry("app_pages/rag.py", "RAG & RoPE drift", ":material/library_books:",
              "A document chunk was prefilled once at offset 0; what does reusing it at another offset cost (RoPE "
              "drift), and what do re-rotation, CacheBlend recompute, fixed ordering and reserved positions buy back?"),
    PageEntry("app_pages/code_edits.py", "Code edits & CLA", ":material/code:",
              "After an edit, how much of the cache survives (longest common token prefix), and what would "
              "cross-layer KV sharing (CLA, YOCO) really save on re-prefill?"),
    PageEntry("app_pages/arena.py", "Policy arena", ":material/leaderboard:",
              "Which policy keeps answering at which budget, turn after turn, over whole workloads?"),
    PageEntry("app_pages/streams.py", "Streams", ":material/stream:",
              "Streamed past the trained context, which bounded cache keeps the perplexity near recomputing every "
              "window, and what do attention sinks have to do with it (StreamingLLM's own experiment)?"),
]
